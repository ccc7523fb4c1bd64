#!/usr/bin/env bash
# The reference models trained on exactly the batches of the shipped model's
# schedule (8,200 steps of 8 x 512 tokens, compact vocabulary, seed 0), scored
# on the same held-out windows as `cadenza eval` (docs/learning.md, "The whole
# budget"). Usage:
#   bash scripts/reference/full-budget.sh [DEVICE] [OUT_DIR]
# DEVICE: cuda (minutes) or cpu (about 90 minutes a run on 2 cores).
# The GPT runs of docs/full-budget/ were made this way on an H200 with the
# machine's own PyTorch 2.11 (the probe travelled as train.bin.gz).
set -euo pipefail
cd "$(dirname "$0")/../.."
device=${1:-cuda}
out=${2:-runs/full-budget}
bin=target/release/cadenza
probe=runs/probe-shipped
py=${PYTHON:-runs/ref-venv/bin/python}
[ -x "$py" ] || { bash scripts/reference/setup.sh; py=runs/ref-venv/bin/python; }
cargo build --release --quiet
data=runs/corpus-data-remi-compact
[ -f $data/manifest.json ] || $bin tokenize "${CADENZA_CORPUS:-../shared/corpus}/classical" \
  "${CADENZA_CORPUS:-../shared/corpus}/folk" --vocab vocab/remi-compact.json -o $data
[ -f $probe/meta.json ] || $bin export-probe --data $data -o $probe-run --preset small \
  --vocab vocab/remi-compact.json --config scripts/shipped.toml --steps 8200 --seed 0 --probe $probe
mkdir -p "$out"
run() {
  local name=$1; shift
  "$py" scripts/reference/train_ref.py --probe $probe --device "$device" --out "$out/$name.json" "$@" \
    > "$out/$name.log" 2>&1
  tail -n 1 "$out/$name.log"
}
run gpt-1x --model gpt
run gpt-window128 --model gpt --window 128
run gpt-large-1x --model gpt --d-model 512 --layers 8 --heads 8 --d-ff 2048
