#!/usr/bin/env bash
# Copies a trained run (or a model folder) into a self-contained model folder
# (weights of the best validation loss, config, sampling defaults, vocabulary;
# no optimizer state):
#   bash scripts/ship-model.sh RUN_DIR models/NAME
set -euo pipefail
run=${1:?run folder}
dst=${2:?model folder}
# RUN_DIR may also be a model folder written by this script (carried in git
# between sessions): its weights are at its top level.
src=$run/best
[ -f "$src/model.safetensors" ] || src=$run/checkpoint
[ -f "$src/model.safetensors" ] || src=$run
[ -f "$src/model.safetensors" ] || { echo "ship-model: no weights in $run (best/, checkpoint/ or a model folder)" >&2; exit 1; }
[ "$(realpath "$run")" != "$(realpath -m "$dst")" ] || { echo "ship-model: $run is both source and destination" >&2; exit 1; }
mkdir -p "$dst"
# Weights of an earlier model in DST (other file names included) must not outlive it.
rm -f "$dst"/*.safetensors "$dst/state.json"
cp "$run/config.json" "$run/vocab.json" "$dst/"
# The sampling defaults of `generate` (runs from before they existed have none:
# generate then uses its built-in defaults).
[ -f "$run/generation_config.json" ] && cp "$run/generation_config.json" "$dst/"
# config.json names the dataset relative to the run: make it relative to DST.
python3 - "$run" "$dst" <<'PY'
import json, os, re, sys
run, dst = (os.path.realpath(p) for p in sys.argv[1:3])
path = os.path.join(dst, "config.json")
text = open(path).read()
data = os.path.normpath(os.path.join(run, json.loads(text)["dataset"]))
rel = os.path.relpath(data, dst)
text = re.sub(r'"dataset": "(?:[^"\\]|\\.)*"', lambda m: '"dataset": ' + json.dumps(rel), text, count=1)
open(path, "w").write(text)
PY
cp "$src/model.safetensors" "$src/state.json" "$dst/"
[ -f "$run/loss.png" ] && cp "$run/loss.png" "$dst/"
[ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$dst/"
ls -la "$dst"
