#!/usr/bin/env bash
# The learning experiment of docs/learning.md: every variant of the model, and
# two outside references, trained on the same batches of the shared corpus with
# the same budget (scripts/learning/common.toml), then scored by the same
# per-type metrics on every held-out piece. Runs one at a time: give it the
# machine alone (about 40 minutes on 2 cores).
#   bash scripts/learning.sh [VARIANT ...]     (default: all of them)
# THREADS=1 runs each with one libtorch thread (two lanes side by side);
# STEPS=N another budget (warm-up and schedule as in common.toml), OUT=DIR
# another results folder (default runs/learning).
# Results: OUT/<variant>/eval.json, the table in OUT/table.md.
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${CADENZA_CORPUS:-../shared/corpus}
steps=${STEPS:-200}
out=${OUT:-runs/learning}
bin=target/release/cadenza
bash scripts/setup.sh
cargo build --release --quiet
mkdir -p "$out"
data=runs/corpus-data
[ -f $data/manifest.json ] || $bin tokenize "$corpus/classical" "$corpus/folk" -o $data
compact=runs/corpus-data-compact
if [ -f vocab/remi-compact.json ] && [ ! -f $compact/manifest.json ]; then
  $bin tokenize "$corpus/classical" "$corpus/folk" --vocab vocab/remi-compact.json -o $compact
fi
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(today head spread nodrop all tied conv16 favor128 softmax-ape compact gpt performer)
for v in "${variants[@]}"; do
  run=$out/$v
  if [ -f $run/eval.json ]; then echo "== $v: done"; continue; fi
  echo "== $v ($(date +%H:%M:%S))"
  case $v in
    gpt|performer|gpt-compact|performer-compact)
      # the references train on the batches cadenza would draw (`export-probe`)
      case $v in
        *-compact) probe=$out/probe-compact; pd=$compact; pv=(--vocab vocab/remi-compact.json) ;;
        *) probe=$out/probe; pd=$data; pv=() ;;
      esac
      [ -f $probe/meta.json ] || $bin export-probe --data $pd -o $probe-run --preset small \
        "${pv[@]}" --config scripts/learning/common.toml --steps "$steps" --probe $probe
      bash scripts/reference/setup.sh
      mkdir -p $run
      runs/ref-venv/bin/python scripts/reference/train_ref.py --model ${v%-compact} --probe $probe \
        --out $run/eval.json --threads "${THREADS:-2}" | tee $run/log.txt
      continue ;;
    compact) cfg=scripts/learning/common.toml; d=$compact; vocab=(--vocab vocab/remi-compact.json) ;;
    all) cfg=scripts/learning/common.toml; d=$data; vocab=() ;;
    # compact-X: variant X's options on the compact vocabulary (the shipped one)
    compact-*) cfg=$out/$v.toml; cat scripts/learning/common.toml scripts/learning/${v#compact-}.toml > $cfg
      d=$compact; vocab=(--vocab vocab/remi-compact.json) ;;
    *) cfg=$out/$v.toml; cat scripts/learning/common.toml scripts/learning/$v.toml > $cfg; d=$data; vocab=() ;;
  esac
  rm -rf $run
  $bin train --data $d -o $run --preset small "${vocab[@]}" --config $cfg --steps "$steps" \
    --threads "${THREADS:-2}" 2>&1 \
    | grep -v '^\s*$' | tail -n 4
  $bin eval --model $run --max-len 512 --bin 512 --threads "${THREADS:-2}" --json $run/eval.json > $run/eval.txt
done
python3 scripts/learning_table.py $out "${variants[@]}"
