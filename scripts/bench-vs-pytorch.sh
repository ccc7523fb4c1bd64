#!/usr/bin/env bash
# Training throughput and memory: cadenza (FAVOR+ with gated SineSPE, the
# `small` shape: d 256, 4 layers, 4 heads, d_ff 1024, vocabulary 845) against a
# plain PyTorch 2.13 GPT of the same shape whose attention is
# torch.nn.functional.scaled_dot_product_attention (softmax, causal), side by
# side in one run: for each length one cadenza process, then one PyTorch
# process, with the same batch, the same step (forward, cross-entropy,
# backward, clipping, AdamW) and the same number of threads. Prints one
# markdown table. Give it the machine alone (libtorch threads spin).
#
# Batches hold 32,768 tokens (batch 8 up to L = 4,096, then 4 and 2) so that
# both models fit in memory at 16,384.
#
# Needs scripts/reference/setup.sh (the PyTorch venv at runs/ref-venv).
# BATCH fixes the batch of every row instead: with BATCH=2 the rows differ in
# L only, which separates the cost of the length from that of the batch.
#
# Environment: LENS ["512 2048 4096 8192 16384"], STEPS [2: timed steps, at
#              least 64k tokens' worth], THREADS [2], BATCH [by L, as above],
#              LOCAL_HEADS [0; the shipped model: 2], LOCAL_WINDOW [128],
#              LOCAL_POSITION [shared; the shipped model: rope],
#              REPEAT [1: alternated cadenza/PyTorch pairs per row; with more,
#              the table gives medians and the range of the pairs' ratios],
#              PRECISIONS ["f32 bf16" where /proc/cpuinfo shows amx_bf16 or
#              avx512_bf16, else "f32": without them PyTorch's bf16 products run at
#              about 1/70 of f32, and a row would take an hour]: each row runs a
#              cadenza/PyTorch pair per precision (PyTorch bf16 = CPU autocast),
#              OUT [runs/bench-vs-pytorch].
set -euo pipefail
cd "$(dirname "$0")/.."
lens=${LENS:-512 2048 4096 8192 16384}
steps=${STEPS:-2}
threads=${THREADS:-2}
local_heads=${LOCAL_HEADS:-0}
local_window=${LOCAL_WINDOW:-128}
local_position=${LOCAL_POSITION:-shared}
repeat=${REPEAT:-1}
out=${OUT:-runs/bench-vs-pytorch}
if grep -qE 'amx_bf16|avx512_bf16' /proc/cpuinfo 2>/dev/null; then
  precisions=${PRECISIONS:-f32 bf16}
else
  precisions=${PRECISIONS:-f32}
fi
py=runs/ref-venv/bin/python
[ -x $py ] || { echo "no $py: run scripts/reference/setup.sh first" >&2; exit 1; }
mkdir -p "$out"
res=$out/results.jsonl
: > "$res"
cargo bench -q --bench train_speed --no-run 2>/dev/null
for L in $lens; do
  B=$(( 32768 / L )); [ $B -gt 8 ] && B=8; [ $B -lt 1 ] && B=1
  [ -n "${BATCH:-}" ] && B=$BATCH
  # At least 64k timed tokens per row: short steps are noisy.
  n=$(( 65536 / (B * L) )); [ $n -lt $steps ] && n=$steps
  for rep in $(seq "$repeat"); do
    for p in $precisions; do
      echo "L=$L batch=$B steps=$n $p pair $rep/$repeat" >&2
      cargo bench -q --bench train_speed -- --len $L --batch $B --steps $n --threads $threads \
        --local-heads $local_heads --local-window $local_window --local-position $local_position \
        --precision $p >> "$res"
      $py scripts/reference/bench_sdpa.py --len $L --batch $B --steps $n --threads $threads \
        --precision $p 2>/dev/null >> "$res"
    done
  done
done
python3 scripts/bench_table.py "$res"
