#!/usr/bin/env bash
# Carries a training run's last checkpoint across machines through git, for a
# schedule longer than one session on a machine whose runs/ may not survive.
#   bash scripts/carry-checkpoint.sh save RUN_DIR [DEST]     (default DEST: checkpoints/NAME)
#   bash scripts/carry-checkpoint.sh restore SRC [RUN_DIR]   (default RUN_DIR: runs/NAME)
# `save` copies what `cadenza train --resume` reads (config, vocabulary,
# generation config, metrics log, and the checkpoint: weights, AdamW moments,
# step and data state); `restore` puts them back, tokenizes the shared corpus
# if the run's dataset is missing, and prints the command that resumes the
# schedule exactly. Neither writes over an existing destination.
set -euo pipefail
cd "$(dirname "$0")/.."
files=(config.json vocab.json generation_config.json metrics.jsonl
  checkpoint/model.safetensors checkpoint/optimizer.safetensors
  checkpoint/state.json checkpoint/train_features.safetensors)
mode=${1:-}
src=${2:-}
if [ -z "$mode" ] || [ -z "$src" ]; then
  echo "usage: $0 save RUN_DIR [DEST] | restore SRC [RUN_DIR]" >&2
  exit 2
fi
name=$(basename "$src")
case "$mode" in
  save) dest=${3:-checkpoints/$name} ;;
  restore) dest=${3:-runs/$name} ;;
  *) echo "carry-checkpoint: unknown mode '$mode' (save or restore)" >&2; exit 2 ;;
esac
for f in "${files[@]}"; do
  [ -f "$src/$f" ] || { echo "carry-checkpoint: $src/$f is missing" >&2; exit 1; }
done
if [ -e "$dest" ]; then
  echo "carry-checkpoint: $dest exists; move it away first" >&2
  exit 1
fi
mkdir -p "$dest/checkpoint"
for f in "${files[@]}"; do cp "$src/$f" "$dest/$f"; done
# The metrics log may run past the checkpoint (a run killed between two);
# `--resume` keeps only the records up to the checkpoint's step itself.
echo "carry-checkpoint: $src -> $dest (step $(sed -n 's/.*"step": *\([0-9]*\).*/\1/p' "$dest/checkpoint/state.json"))" >&2
if [ "$mode" = restore ]; then
  data=$(cd "$dest" && python3 -c 'import json,os; print(os.path.normpath(json.load(open("config.json"))["dataset"]))')
  if [ ! -f "$dest/$data/manifest.json" ]; then
    corpus=${CADENZA_CORPUS:-../shared/corpus}
    bash scripts/setup.sh
    cargo build --release --quiet
    target/release/cadenza tokenize "$corpus/classical" "$corpus/folk" \
      --vocab "$dest/vocab.json" -o "$dest/$data"
  fi
  echo "resume with: target/release/cadenza train -o $dest --resume   (the machine otherwise idle)" >&2
fi
