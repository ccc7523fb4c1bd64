#!/usr/bin/env bash
# Stage 2 of the shipped model: 1,500 steps of 2 x 2,048 tokens from the stage-1 model
# (8,200 steps of 8 x 512: scripts/train-shipped.sh with scripts/shipped-music.toml, shipped
# on 2026-12-04), half the windows beginning at a piece's start and the pieces entered at
# their start drawn per piece, not per token (scripts/shipped-stage2.toml), lr 3e-4 cosine
# to 3e-5. Usage:
#   bash scripts/train-shipped-stage2.sh [STAGE1] [RUN_DIR]
# STAGE1: the stage-1 run or model folder (default runs/stage1-model, written from git when
# missing: the weights of models/cadenza-small at commit d9af599, the last commit before
# stage 2 shipped). RUN_DIR: default runs/shipped-stage2. A stopped run continues the same
# schedule exactly with `cadenza train -o RUN_DIR --resume`.
# Give it the machine alone (about 16-19 min on the 2-core Xeon with AMX, f32).
# Then: bash scripts/after-shipped.sh RUN_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
stage1=${1:-runs/stage1-model}
run=${2:-runs/shipped-stage2}
bash scripts/setup.sh
cargo build --release --quiet
bin=target/release/cadenza
if [ ! -f "$stage1/model.safetensors" ]; then
    [ "$stage1" = runs/stage1-model ] || { echo "no model.safetensors in $stage1" >&2; exit 2; }
    mkdir -p "$stage1"
    for f in model.safetensors config.json vocab.json generation_config.json state.json; do
        git show "d9af599:models/cadenza-small/$f" > "$stage1/$f"
    done
fi
data=runs/corpus-data-remi-compact
if [ ! -f "$data/manifest.json" ]; then
    corpus=${CADENZA_CORPUS:-../shared/corpus}
    $bin tokenize "$corpus/classical" "$corpus/folk" --vocab vocab/remi-compact.json -o "$data"
fi
$bin train -o "$run" --data "$data" --vocab vocab/remi-compact.json --init "$stage1" \
    --config scripts/shipped-stage2.toml --seq-len 2048 --batch 2 --steps 1500 --lr 3e-4
