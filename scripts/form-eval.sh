#!/usr/bin/env bash
# Evaluates issue 25's rows (scripts/form-experiments.sh) and the shipped model on the
# same pieces: held-out loss over the first 1,024 tokens of 100 held-out pieces, the same
# with the FAVOR+ heads zeroed, the context gain of the whole past over the last 512
# tokens at positions 1,024-2,048 of 6 long classical pieces (training pieces) and of the
# 19 held-out pieces of at least 2,048 tokens, and the strain return of
# 8-bar continuations of 8-bar prompts of 60 held-out folk tunes. Then the table:
# python3 scripts/form_table.py runs/form. EXTRA=1 adds the strain return without the
# repetition guard and at top-p 0.01 (nearly greedy).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/cadenza}
OUT=${OUT:-runs/form}
CORPUS=${CADENZA_CORPUS:-../shared/corpus}
FOLK=$OUT/heldout-folk
[ -d "$FOLK" ] || { echo "make $FOLK first (the held-out folk tunes; docs/learning.md)" >&2; exit 2; }
rows=("$@")
[ ${#rows[@]} -gt 0 ] || rows=(shipped base512 music512 base2048 music2048)
for row in "${rows[@]}"; do
    model=$OUT/$row
    [ "$row" = shipped ] && model=models/cadenza-small
    echo "== $row"
    common=(--device cpu --threads "${THREADS:-2}")
    # the context gain at every position from 1,024 on, 8 positions per cut window (the
    # j-th of a block sees 512 + j tokens): every 16th position, the default, moved the
    # figure by 0.6% with its offset (docs/learning.md, "The context gain at every
    # position"); 4 minutes for the 19 held-out pieces on a slow 2-core machine
    ctx=(--context-stride 1 --context-block 8)
    # a report already written is kept (delete it to measure again)
    run() { local json=${*: -1}; [ -f "$json" ] || "$BIN" "$@" > /dev/null; }
    run eval --model "$model" --max-pieces 100 --max-len 1024 "${common[@]}" \
        --json "$OUT/eval-$row.json"
    run eval --model "$model" --max-pieces 100 --max-len 1024 --ablate favor "${common[@]}" \
        --json "$OUT/ablate-$row.json"
    run eval --model "$model" --data "$CORPUS/classical/palestrina" "$CORPUS/classical/trecento" \
        --min-len 2048 --max-len 2048 --max-pieces 6 --context-cut 512 "${ctx[@]}" "${common[@]}" \
        --json "$OUT/ctx-$row.json"
    # the same on the held-out long pieces (the model's own validation split, pieces of
    # at least 2,048 tokens: 19 of them for the corpus dataset); the 6 pieces above are
    # training pieces, kept for comparison with the figures measured before
    run eval --model "$model" --min-len 2048 --max-len 2048 --context-cut 512 "${ctx[@]}" \
        "${common[@]}" --json "$OUT/ctxh-$row.json"
    run continue-eval --model "$model" --data "$FOLK" --prompt-bars 8 --bars 8 --pieces 60 \
        "${common[@]}" --json "$OUT/cont-$row.json"
    # the strain without the repetition guard, and nearly greedy (EXTRA=1)
    if [ -n "${EXTRA:-}" ]; then
        run continue-eval --model "$model" --data "$FOLK" --prompt-bars 8 --bars 8 --pieces 60 \
            --no-repetition-guard "${common[@]}" --json "$OUT/cont-noguard-$row.json"
        run continue-eval --model "$model" --data "$FOLK" --prompt-bars 8 --bars 8 --pieces 60 \
            --top-p 0.01 "${common[@]}" --json "$OUT/cont-greedy-$row.json"
    fi
done
