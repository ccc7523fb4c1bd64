#!/usr/bin/env bash
# Can the FAVOR+ heads learn to copy a segment from beyond the local heads' reach? Trains one
# 2-layer model per row on the far-copy task (scripts/form/far-copy.py: BOS, A, 600 random
# pitches, A, EOS; the local heads see 128 tokens) and scores the second A with the whole
# past and with the last 128 tokens only (the first A out of reach).
# Usage: [STEPS=2000] [SEED=0] [OUT=runs/far-copy] [GAP=600] bash scripts/form/far-copy.sh [ROW ...]
# (GAP: random pitches between the two A; the data is made once per OUT, the same for every
# OUT; SEED: the training seed, one OUT per seed. The RoPE softmax control learns the copy
# at seeds 0-2 only with STEPS=6000: docs/learning.md.)
# ROW: base favor256 noredraw nospe shortconv shortconv256 favor2048-nospe wide-local gate gate256 taylor taylor-nospe taylor-rope softmax-nope (scripts/form/far-copy/ROW.toml); all by
# default. Each row: OUT/ROW (the run), OUT/ROW.json (the eval report); then the table.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/form/train-row.sh
STEPS=${STEPS:-2000}
SEED=${SEED:-0}
OUT=${OUT:-runs/far-copy}
GAP=${GAP:-600}
SEG=24
BIN=${BIN:-target/release/cadenza}
ROWS=("$@")
[ ${#ROWS[@]} -gt 0 ] || ROWS=(base favor256 noredraw nospe shortconv shortconv256 favor2048-nospe wide-local gate gate256 taylor taylor-nospe taylor-rope softmax-nope)
[ -x "$BIN" ] || cargo build --release --quiet
[ -d "$OUT/data/valid" ] || python3 scripts/form/far-copy.py vocab/remi-compact.json "$OUT/data" --seg $SEG --gap "$GAP"
for row in "${ROWS[@]}"; do
    run=$OUT/$row
    train_row "$row" "$run" "$STEPS" "$BIN" train --config "scripts/form/far-copy/$row.toml" \
        --data "$OUT/data/train" --vocab vocab/remi-compact.json --steps "$STEPS" --seed "$SEED" -o "$run"
    # the second A begins at 1 + SEG + GAP; cut 128 leaves the first out of reach
    "$BIN" eval --model "$run" --data "$OUT/data/valid" --max-len $((2 + 2 * SEG + GAP)) \
        --context-cut 128 --context-from $((1 + SEG + GAP)) --context-stride 1 --json "$OUT/$row.json" \
        > "$OUT/$row.eval.txt"
done
python3 scripts/form/far_copy_table.py "$OUT" "${ROWS[@]}"
