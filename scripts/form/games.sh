#!/usr/bin/env bash
# Issue 25, songs whose sections return (docs/learning.md, "Songs whose sections return"):
# the multitrack games songs of the shared corpus, split by name (every 4th held out: 10
# songs, 8 of them of >= 4,096 tokens), the shipped model fine-tuned on the other 31 (30 once the run's
# own validation split holds one) as row `ft` (scripts/form/games.toml) and, with local softmax heads over the whole
# 2,048-token training window, as row `wide` (scripts/form/games-wide.toml: exact
# attention over everything the FAVOR+ heads see in training, the reference for what the
# far past is worth to heads that can copy). Every row from the same weights, on the
# same batches. Then the context gain of each row on the held-out songs, by where the
# copy of each scored token's bar lies. Usage:
#   bash scripts/form/games.sh [ROW ...]     (rows: ft wide, the default both; shipped: the
#   shipped model itself, which never saw a multitrack song: 6.6 nats a token on them)
# A finished run or report is kept (delete it to redo it). OUT defaults to runs/games.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release/cadenza}
OUT=${OUT:-runs/games}
CORPUS=${CADENZA_CORPUS:-../shared/corpus}
STEPS=${STEPS:-600}
source scripts/form/train-row.sh
if [ ! -d "$OUT/test-midi" ]; then
    # built aside and moved in whole, so an interrupted split is made again
    split=$OUT/split.tmp
    rm -rf "$split"
    mkdir -p "$split/train-midi" "$split/test-midi"
    i=0
    while IFS= read -r f; do
        if [ $((i % 4)) -eq 3 ]; then part=test; else part=train; fi
        ln -s "$(realpath "$f")" "$split/$part-midi/"
        i=$((i + 1))
    done < <(printf '%s\n' "$CORPUS"/games/*.mid | LC_ALL=C sort)
    mv "$split/train-midi" "$split/test-midi" "$OUT/"
    rm -rf "$split"
fi
# the training songs, the held-out ones and all 41 (the last two for far-repeats.py)
for part in train test; do
    [ -d "$OUT/$part-data" ] || "$BIN" tokenize "$OUT/$part-midi" --vocab vocab/remi-compact.json \
        -o "$OUT/$part-data"
done
[ -d runs/games-data ] || "$BIN" tokenize "$CORPUS/games" --vocab vocab/remi-compact.json -o runs/games-data
rows=("$@")
[ ${#rows[@]} -gt 0 ] || rows=(ft wide)
common=(--device cpu --threads "${THREADS:-2}")
for row in "${rows[@]}"; do
    model=$OUT/$row
    case $row in
        shipped) model=models/cadenza-small ;;
        ft) config=scripts/form/games.toml ;;
        wide) config=scripts/form/games-wide.toml ;;
        *) echo "unknown row $row (shipped, ft, wide)" >&2; exit 2 ;;
    esac
    if [ "$row" != shipped ]; then
        train_row "$row" "$model" "$STEPS" "$BIN" train -o "$model" --data "$OUT/train-data" \
            --vocab vocab/remi-compact.json --init models/cadenza-small --config "$config" \
            --seq-len 2048 --batch 2 --steps "$STEPS" --lr 3e-4 "${common[@]}"
    fi
    # a report already written is kept
    run() { local json=${*: -1}; [ -f "$json" ] || "$BIN" "$@" > /dev/null; }
    # positions 2,048-4,096 of the 8 held-out songs of >= 4,096 tokens, 16 per cut window
    ctx=(--data "$OUT/test-midi" --min-len 4096 --max-len 4096 --context-from 2048
        --context-stride 1 --context-block 16)
    run eval --model "$model" "${ctx[@]}" --context-cut 512,1024 "${common[@]}" \
        --json "$OUT/ctx-$row.json"
    run eval --model "$model" "${ctx[@]}" --context-cut 512 --ablate favor "${common[@]}" \
        --json "$OUT/ctx-ablate-$row.json"
done
