#!/usr/bin/env bash
# Copies a trained run into a self-contained model folder (weights, config,
# vocabulary; no optimizer state):  bash scripts/ship-model.sh RUN_DIR models/NAME
set -euo pipefail
run=${1:?run folder}
dst=${2:?model folder}
mkdir -p "$dst"
cp "$run/config.json" "$run/vocab.json" "$dst/"
cp "$run/checkpoint/model.safetensors" "$run/checkpoint/state.json" "$dst/"
[ -f "$run/loss.png" ] && cp "$run/loss.png" "$dst/"
ls -la "$dst"
