#!/usr/bin/env bash
# The SPE length-extrapolation experiment: the same model size, data, seed and
# step budget with SineSPE (gated), ConvSPE (gated) and sinusoidal APE, trained
# on windows of L tokens, then evaluated per position up to 4L on held-out
# pieces at least 4L long. Writes docs/extrapolation.{json,png,md}.
#   bash scripts/extrapolation.sh [CORPUS]
# Knobs: L (256), STEPS (500), PRESET (small).
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-${CADENZA_CORPUS:-../shared/corpus}}
L=${L:-256}
steps=${STEPS:-500}
preset=${PRESET:-small}
bash scripts/setup.sh
cargo build --release --quiet
bin=target/release/cadenza
if [ ! -f runs/corpus-data/manifest.json ]; then
  $bin tokenize "$corpus/classical" "$corpus/folk" -o runs/corpus-data
fi
mkdir -p docs
for pe in spe-sine spe-conv ape; do
  run=runs/extrap-$pe
  if [ ! -f "$run/checkpoint/state.json" ] || ! grep -q "\"step\": $steps" "$run/checkpoint/state.json"; then
    if [ -f "$run/config.json" ]; then
      $bin train -o "$run" --resume
    else
      $bin train --data runs/corpus-data -o "$run" --preset "$preset" --positional "$pe" \
        --steps "$steps" --seq-len "$L" --batch 8 --seed 0
    fi
  fi
  $bin eval --model "$run" --max-len $((4 * L)) --min-len $((4 * L + 1)) --bin 64 \
    --json "docs/extrapolation-$pe.json" --png "runs/extrap-$pe.png"
done
$bin compare-eval docs/extrapolation-spe-sine.json docs/extrapolation-spe-conv.json \
  docs/extrapolation-ape.json --png docs/extrapolation.png --markdown docs/extrapolation-table.md
