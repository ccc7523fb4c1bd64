#!/usr/bin/env bash
# Ships a finished run as models/cadenza-small and measures it: per-type
# evaluation, continuations of held-out pieces, 3,072-token pieces against
# real ones. Results under docs/shipped/. Usage:
#   bash scripts/after-shipped.sh [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:-runs/shipped}
bin=target/release/cadenza
model=models/cadenza-small
out=docs/shipped
mkdir -p $out out/gen
rm -f $model/*.safetensors $model/state.json
bash scripts/ship-model.sh "$run" $model
data=$(python3 -c "import json,sys; print(json.load(open('$model/config.json'))['dataset'])")
$bin eval --model $model --max-len 512 --bin 128 --json $out/eval.json --png $out/eval.png > $out/eval.txt
$bin continue-eval --model $model --pieces 150 --prompt-bars 4 --bars 8 --seed 1 \
  --json $out/continuation.json > $out/continuation.txt
rm -rf out/gen && mkdir -p out/gen
$bin generate --model $model --tokens 3072 --num-samples 8 --seed 7 -o out/gen/sample.mid > $out/generate.txt
$bin stats out/gen --real "$data" --markdown $out/generated-stats.md > $out/stats.txt
{
  echo "# Generated pieces against held-out real pieces"
  echo
  echo "8 pieces of 3,072 tokens sampled unprompted from \`$model\` (temperature 1.0,"
  echo "top-p 0.95, grammar-constrained, repetition guard on, EOS forbidden before 3,072"
  echo "tokens, seed 7), against held-out pieces of the corpus spread over the"
  echo "training run's validation split. Distances are in standard deviations of the"
  echo "real pieces. Written by \`scripts/after-shipped.sh\`; the model card discusses it."
  echo
  cat $out/generated-stats.md
  echo
  echo "Reproduce:"
  echo
  echo '```sh'
  echo "cadenza generate --model $model --tokens 3072 --num-samples 8 --seed 7 -o out/gen/sample.mid"
  echo "cadenza stats out/gen --real $data"
  echo '```'
} > docs/generated-stats.md
python3 scripts/model-card.py > $model/MODEL_CARD.md
echo "after-shipped: done"
