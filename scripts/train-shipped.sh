#!/usr/bin/env bash
# Reproduces the shipped model under models/cadenza-small from the shared
# corpus (classical and folk), on the CPU. Usage:
#   bash scripts/train-shipped.sh [CORPUS] [RUN_DIR]
# Then copy RUN_DIR/{config.json,vocab.json,checkpoint/model.safetensors} to
# models/cadenza-small (scripts/ship-model.sh does it).
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-${CADENZA_CORPUS:-../shared/corpus}}
run=${2:-runs/small-sine}
steps=${STEPS:-3000}
bash scripts/setup.sh
cargo build --release --quiet
bin=target/release/cadenza
if [ ! -f runs/corpus-data/manifest.json ]; then
  $bin tokenize "$corpus/classical" "$corpus/folk" -o runs/corpus-data
fi
$bin train --data runs/corpus-data -o "$run" --preset small --positional spe-sine \
  --steps "$steps" --seq-len 512 --batch 8 --seed 0
