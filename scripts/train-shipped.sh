#!/usr/bin/env bash
# Reproduces the shipped model under models/cadenza-small from the shared
# corpus (classical and folk), on the CPU, in one cosine schedule. Usage:
#   bash scripts/train-shipped.sh [CORPUS] [RUN_DIR]
# STEPS (default 8200, 1.5-4.5 hours on 2 cores by the machine), VOCAB (default
# the compact vocabulary), STOP_AFTER (stop early; `cadenza train -o RUN_DIR
# --resume` continues the same schedule exactly), CONFIG (default
# scripts/shipped-music.toml, the shipped model: 2 local softmax heads over 512
# tokens with musical RoPE; scripts/shipped-rope.toml, the one shipped before it:
# RoPE on the token index; scripts/shipped-local.toml: over 128 tokens, SPE;
# scripts/shipped.toml: FAVOR+ in every head).
# Give it the machine alone.
# Then: bash scripts/ship-model.sh RUN_DIR models/cadenza-small
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-${CADENZA_CORPUS:-../shared/corpus}}
run=${2:-runs/shipped}
steps=${STEPS:-8200}
vocab=${VOCAB:-vocab/remi-compact.json}
bash scripts/setup.sh
cargo build --release --quiet
bin=target/release/cadenza
data=runs/corpus-data-$(basename "$vocab" .json)
if [ ! -f "$data/manifest.json" ]; then
  $bin tokenize "$corpus/classical" "$corpus/folk" --vocab "$vocab" -o "$data"
fi
$bin train --data "$data" -o "$run" --preset small --vocab "$vocab" \
  --config "${CONFIG:-scripts/shipped-music.toml}" --steps "$steps" --seed 0 --threads 2 \
  ${STOP_AFTER:+--stop-after "$STOP_AFTER"}
