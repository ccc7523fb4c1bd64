#!/usr/bin/env bash
# Ships a finished run as models/cadenza-small and measures it: per-type
# evaluation, continuations of held-out pieces, 3,072-token pieces against
# real ones. Results under docs/shipped/. Usage:
#   bash scripts/after-shipped.sh [RUN_DIR]   (a run, or a model folder
#   written by scripts/ship-model.sh, such as one carried under checkpoints/)
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:-runs/shipped}
bin=target/release/cadenza
model=models/cadenza-small
out=docs/shipped
mkdir -p $out
bash scripts/ship-model.sh "$run" $model
# config.json names the dataset relative to the model folder
data=$(python3 -c "import json,os,sys; m=sys.argv[1]; print(os.path.normpath(os.path.join(m, json.load(open(os.path.join(m, 'config.json')))['dataset'])))" "$model")
$bin eval --model $model --max-len 512 --bin 128 --json $out/eval.json --png $out/eval.png > $out/eval.txt
$bin continue-eval --model $model --pieces 150 --prompt-bars 4 --bars 8 --seed 1 \
  --json $out/continuation.json > $out/continuation.txt
bash scripts/generated-stats.sh $model $out
python3 scripts/model-card.py > $model/README.md
echo "after-shipped: done"
