#!/usr/bin/env bash
# Issue 25's from-scratch side-by-side: each row trains the `small` preset from random
# weights on one cosine schedule of STEPS steps (default 2000) of 8 x 512 tokens, seed 0,
# the same batches for every row (they depend on (seed, step) and the window only).
# A finished row is skipped, an interrupted one resumed exactly (--resume).
# Rows: scratch-base (the shipped recipe), scratch-music (+ musical RoPE) and
# scratch-music-spe (+ the FAVOR+ heads' SineSPE in musical time), scratch-music-spe48
# (the same, every bar 48 steps on the SPE clock), from
# scripts/form/<row>.toml; ROW-2048 trains the same config on windows of 2 x 2,048
# tokens (as many per step), longer than the local heads' 512, so that only the
# FAVOR+ heads reach the far past. Then: OUT=runs/form-scratch bash
# scripts/form-eval.sh ROW...
# Usage: bash scripts/form-scratch.sh [ROW ...]   (give it the machine alone)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/form/train-row.sh
BIN=${BIN:-target/release/cadenza}
DATA=${DATA:-runs/corpus-data-remi-compact}
OUT=${OUT:-runs/form-scratch}
STEPS=${STEPS:-2000}
rows=("$@")
[ ${#rows[@]} -gt 0 ] || rows=(scratch-base scratch-music)
mkdir -p "$OUT"
for row in "${rows[@]}"; do
    case $row in
        *-2048) cfg=scripts/form/${row%-2048}.toml; shape=(--seq-len 2048 --batch 2) ;;
        *) cfg=scripts/form/$row.toml; shape=(--seq-len 512 --batch 8) ;;
    esac
    [ -f "$cfg" ] || { echo "unknown row $row (no $cfg)" >&2; exit 2; }
    run=$OUT/$row
    train_row "$row, from scratch" "$run" "$STEPS" \
        "$BIN" train -o "$run" --data "$DATA" --vocab vocab/remi-compact.json --preset small \
        --config "$cfg" "${shape[@]}" --steps "$STEPS" --seed 0 --threads 2
done
