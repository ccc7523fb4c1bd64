#!/usr/bin/env bash
# Does bf16 change what the model learns? Three runs on the same data, side by side:
#   f32  seed S    the reference
#   f32  seed S+1  another draw of the same run (its distance to the first is the noise)
#   bf16 seed S    the reference's batches, initial weights and draws, in bf16
# then each scored with `cadenza eval` (loss, pitch top-1) on the same held-out pieces,
# in the precision it trained in. Prints one markdown table: validation loss at every
# validation step, and the final eval figures.
#
# The issue's check is the shipped configuration for 1,000 steps:
#   PRESET=small STEPS=1000 SEQ_LEN=512 BATCH=8 LOCAL_WINDOW=512 bash scripts/bf16-learning-check.sh
# which needs a CPU with AMX or AVX512-BF16 (or CUDA: DEVICE=cuda); elsewhere libtorch
# multiplies bf16 about 70x slower than f32 and the defaults below are the size that fits.
#
# Environment: DATA [runs/folk-compact; made from $CADENZA_CORPUS/folk (default
#   ../shared/corpus/folk) with $VOCAB when missing], VOCAB [vocab/remi-compact.json,
#   the shipped model's], PRESET [tiny],
#   STEPS [300], SEQ_LEN [128], BATCH [8], LOCAL_HEADS [2], LOCAL_WINDOW [128],
#   SEED [0], VAL_EVERY [50], EVAL_PIECES [300], DEVICE [cpu], THREADS [2],
#   OUT [runs/bf16-check].
set -euo pipefail
cd "$(dirname "$0")/.."
data=${DATA:-runs/folk-compact}
preset=${PRESET:-tiny}
steps=${STEPS:-300}
seq_len=${SEQ_LEN:-128}
batch=${BATCH:-8}
local_heads=${LOCAL_HEADS:-2}
local_window=${LOCAL_WINDOW:-128}
seed=${SEED:-0}
val_every=${VAL_EVERY:-50}
eval_pieces=${EVAL_PIECES:-300}
device=${DEVICE:-cpu}
threads=${THREADS:-2}
out=${OUT:-runs/bf16-check}
vocab=${VOCAB:-vocab/remi-compact.json}
bin=target/release/cadenza-torch
cargo build -q --release --bins
corpus=${CADENZA_CORPUS:-../shared/corpus}
if [ ! -f "$data/manifest.json" ]; then
  target/release/cadenza tokenize "$corpus/folk" --vocab "$vocab" -o "$data"
fi
mkdir -p "$out"
cat > "$out/config.toml" <<TOML
[model]
local_heads = $local_heads
local_window = $local_window
local_position = "rope"
[train]
val_every = $val_every
checkpoint_every = $val_every
warmup_steps = $(( steps / 10 ))
TOML
run() { # name precision seed
  local dir=$out/$1
  rm -rf "$dir"
  echo "== $1: $2, seed $3" >&2
  /usr/bin/time -f "$1: %e s" $bin train --data "$data" -o "$dir" --preset "$preset" \
    --config "$out/config.toml" --steps "$steps" --seq-len "$seq_len" --batch "$batch" \
    --seed "$3" --vocab "$vocab" --precision "$2" --device "$device" --threads "$threads" 2> "$dir.log" >/dev/null \
    || { cat "$dir.log" >&2; exit 1; }
  tail -1 "$dir.log" >&2
  $bin eval --model "$dir" --max-len "$seq_len" --max-pieces "$eval_pieces" --precision "$2" \
    --device "$device" --threads "$threads" --json "$dir-eval.json" --png "$dir-eval.png" > /dev/null
}
run f32 f32 "$seed"
run f32-seed$((seed + 1)) f32 $((seed + 1))
run bf16 bf16 "$seed"
python3 - "$out" "f32" "f32-seed$((seed + 1))" "bf16" <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
val = {}
for n in names:
    for line in open(f"{out}/{n}/metrics.jsonl"):
        m = json.loads(line)
        if "val_loss" in m:
            val.setdefault(m["step"], {})[n] = m["val_loss"]
print("| step | " + " | ".join(f"{n} val loss" for n in names)
      + " | bf16 - f32 | noise (f32 seeds) |")
print("|---:|" + "---:|" * (len(names) + 2))
for step in sorted(val):
    v = val[step]
    if len(v) < len(names):
        continue
    a, b, c = (v[n] for n in names)
    print(f"| {step} | {a:.4f} | {b:.4f} | {c:.4f} | {c - a:+.4f} | {b - a:+.4f} |")
ev = {n: json.load(open(f"{out}/{n}-eval.json")) for n in names}
def pitch_top1(r):
    return r["by_type"].get("Pitch", {}).get("top1", float("nan"))
print()
print("| run | eval precision | eval loss | pitch top-1 |")
print("|---|---|---:|---:|")
for n in names:
    r = ev[n]
    print(f"| {n} | {r.get('precision', 'f32')} | {r['loss']:.4f} | {100 * pitch_top1(r):.2f}% |")
PY
