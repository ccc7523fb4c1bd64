#!/usr/bin/env bash
# Copies a trained run into a self-contained model folder (weights of the best
# validation loss, config, vocabulary; no optimizer state):
#   bash scripts/ship-model.sh RUN_DIR models/NAME
set -euo pipefail
run=${1:?run folder}
dst=${2:?model folder}
src=$run/best
[ -f "$src/model.safetensors" ] || src=$run/checkpoint
mkdir -p "$dst"
cp "$run/config.json" "$run/vocab.json" "$dst/"
cp "$src/model.safetensors" "$src/state.json" "$dst/"
[ -f "$run/loss.png" ] && cp "$run/loss.png" "$dst/"
[ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$dst/"
ls -la "$dst"
