#!/usr/bin/env bash
# Data-parallel training on this machine: 1 process x THREADS threads against
# RANKS MPI ranks x THREADS/RANKS threads each, the same global batch and windows
# (`cadenza train` of PRESET on the tokenized midi_samples/). Prints one markdown
# table: median tokens/s over the timed steps (all but the first WARMUP), and the
# median seconds per step spent waiting for the slowest rank (the step's first
# collective, the loss) and summing the gradients once the ranks have met (the
# transfer: one 14 MiB all-reduce for `small`), with their share of the step.
# Needs a build with --features distributed (make bench-distributed builds it in
# release) and Open MPI. Give it the machine alone: libtorch threads spin.
#
# Environment: PRESET [small], SEQ_LEN [512], BATCH [8], STEPS [24], WARMUP [4],
#              THREADS [2], RANKS [2], BIN [target/release/cadenza],
#              OUT [runs/bench-distributed].
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${PRESET:-small} seq=${SEQ_LEN:-512} batch=${BATCH:-8} steps=${STEPS:-24}
warmup=${WARMUP:-4} threads=${THREADS:-2} ranks=${RANKS:-2}
out=${OUT:-runs/bench-distributed}
bin=${BIN:-}
if [ -z "$bin" ]; then
  cargo build --release --features distributed --bin cadenza --bin cadenza-torch
  bin=target/release/cadenza
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  OMPI_MCA_btl_vader_single_copy_mechanism=none
rm -rf "$out"; mkdir -p "$out"
"$bin" tokenize midi_samples -o "$out/data" >/dev/null
flags=(--data "$out/data" --preset "$preset" --seq-len "$seq" --batch "$batch"
       --steps "$steps" --device cpu --precision f32)
load=$(ps -eo args | grep -c '[c]adenza-torch train' || true)
"$bin" train -o "$out/one" "${flags[@]}" --threads "$threads" >/dev/null 2>"$out/one.err"
mpirun --oversubscribe --bind-to none -np "$ranks" "$bin" train -o "$out/ranks" "${flags[@]}" \
  --threads $(( threads / ranks > 0 ? threads / ranks : 1 )) >/dev/null 2>"$out/ranks.err"
python3 - "$out" "$warmup" "$threads" "$ranks" "$preset" "$seq" "$batch" "$load" <<'PY'
import json, os, statistics as st, sys
out, warm, threads, ranks, preset, seq, batch, load = sys.argv[1:]
def rows(run):
    m = [json.loads(l) for l in open(os.path.join(out, run, "metrics.jsonl"))]
    return m[int(warm):]
print(f"`{preset}`, L {seq}, global batch {batch}, CPU, f32; median over the timed steps")
print()
print("| layout | tokens/s | s/step | waiting for the slowest rank, s/step | gradient all-reduce, s/step | both, share of the step |")
print("|---|---|---|---|---|---|")
for run, name in [("one", f"1 process x {threads} threads"),
                  ("ranks", f"{ranks} ranks x {max(int(threads) // int(ranks), 1)} thread(s)")]:
    m = rows(run)
    tps = st.median(r["tokens_per_s"] for r in m)
    step = st.median(int(batch) * int(seq) / r["tokens_per_s"] for r in m)
    comm = [r["comm_s"] for r in m if "comm_s" in r]
    wait = [r["wait_s"] for r in m if "wait_s" in r]
    c = st.median(comm) if comm else 0.0
    w = st.median(wait) if wait else 0.0
    print(f"| {name} | {tps:.0f} | {step:.3f} | {w:.4f} | {c:.4f} | {100 * (c + w) / step:.1f}% |")
if int(load) > 0:
    print()
    print("(taken while another `cadenza train` ran on the machine: figures under load)")
PY
