#!/usr/bin/env bash
# Training speed of every variant of docs/learning.md, measured side by side
# in one run with the machine alone and 2 libtorch threads: 20 steps of each
# (the first 5 not counted), then the two references on the same batches.
# Results: runs/learning-speed/<variant>/ (learning_table.py reads them).
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/learning-speed
bin=target/release/cadenza
data=runs/corpus-data
compact=runs/corpus-data-compact
mkdir -p $out
for v in today head spread nodrop all tied conv16 favor128 softmax-ape compact; do
  run=$out/$v
  rm -rf $run
  case $v in
    compact) cfg=scripts/learning/common.toml; d=$compact; vocab=(--vocab vocab/remi-compact.json) ;;
    all) cfg=scripts/learning/common.toml; d=$data; vocab=() ;;
    *) cfg=$out/$v.toml; cat scripts/learning/common.toml scripts/learning/$v.toml > $cfg; d=$data; vocab=() ;;
  esac
  $bin train --data $d -o $run --preset small "${vocab[@]}" --config $cfg --steps 200 \
    --stop-after 20 --threads 2 2>/dev/null | tail -n 2 | head -n 1
done
probe=$out/probe
rm -rf $probe $out/probe-run
$bin export-probe --data $data -o $out/probe-run --preset small \
  --config scripts/learning/common.toml --steps 200 --stop-after 20 --probe $probe
for m in gpt performer; do
  mkdir -p $out/$m
  runs/ref-venv/bin/python scripts/reference/train_ref.py --model $m --probe $probe \
    --out $out/$m/eval.json --threads 2 2>&1 | grep -v "unable to import" | tail -n 2
done
