#!/usr/bin/env bash
# The CUDA path, verified: on a machine with an NVIDIA GPU, runs
#   1. the model's identities on CUDA (examples/device_check.rs: FAVOR+ in chunks and with
#      a carried state against the parallel form, recurrence == parallel form in f32 and
#      bf16 for tiny, small and base, the gated SPE filter against its libtorch form, the
#      parallel form on CUDA against the CPU, greedy generation on CUDA against the CPU);
#   2. STEPS_SMALL [300] training steps of `small` and STEPS_BASE [200] of `base` with
#      --precision bf16 (autocast of the dense products, as on one GPU) on the tokenized
#      midi_samples/, and `cadenza generate` from the small run on CUDA and on the CPU
#      with the same seed (whether the two pieces are the same file);
#   3. a throughput table against the PyTorch SDPA GPT of the same shape on the same GPU
#      (scripts/reference/bench_sdpa.py: tokens/s, peak memory, model FLOP utilisation).
# Writes into GPU_CHECK_DIR [docs/gpu-check]: identities.md, train-*.log,
# generate.md, throughput.md, and check.log (everything printed).
#
# The GPU machine has Python and torch but no Rust toolchain and no package registry,
# and only 64 MiB of files travel to it. So the binaries are built here:
#   scripts/gpu-check.sh --pack        # release cadenza, cadenza-torch, device_check,
#                                      # stripped, into runs/gpu-pack (19 MiB)
# It builds with CADENZA_CUDA=1 (build.rs: link libtorch_cuda.so, whose CUDA libraries
# this machine's slim .venv lacks, so the link itself is the first thing to check) and
# without --features distributed (the GPU machine has no MPI: a binary that needs
# libmpi.so.40 would not start there).
# and the pack travels with the working tree (the device tool's `carry: ["runs/gpu-pack"]`);
# there, the script links them against the machine's own torch (its lib folder on
# LD_LIBRARY_PATH). They were built against libtorch $(cat runs/gpu-pack/TORCH_VERSION)
# (tch 0.26 wants 2.13): on a machine whose torch is another version the C++ symbols may
# not resolve; the script then says so, skips parts 1-2 and still runs the PyTorch rows.
# The Python side is the standard library and torch only.
#
#   scripts/gpu-check.sh --dry-run     # here, on the CPU: every part in tiny shapes
#                                      # (device_check --device cpu, 3 training steps,
#                                      # bench_sdpa.py on the CPU), into runs/gpu-check-dry
# Environment: PYTHON [python3], PACK [runs/gpu-pack], PEAK_TFLOPS [from the GPU's name:
# H100/H200 989, A100 312; else no MFU], LENS ["512 2048 8192"], BATCH_TOKENS [65536].
set -euo pipefail
cd "$(dirname "$0")/.."
mode=run
case "${1:-}" in
  --pack) mode=pack ;;
  --dry-run) mode=dry ;;
  "") ;;
  *) echo "gpu-check: unknown argument $1 (--pack, --dry-run or nothing)" >&2; exit 2 ;;
esac
pack=${PACK:-runs/gpu-pack}
python=${PYTHON:-python3}

if [ "$mode" = pack ]; then
  CADENZA_CUDA=1 cargo build --release --bin cadenza --bin cadenza-torch --example device_check
  if readelf -d target/release/cadenza-torch | grep -q 'libmpi'; then
    echo "gpu-check --pack: cadenza-torch needs MPI (built with --features distributed?)" >&2; exit 1
  fi
  mkdir -p "$pack"
  for b in target/release/cadenza target/release/cadenza-torch target/release/examples/device_check; do
    cp "$b" "$pack/"
    strip "$pack/$(basename "$b")"
  done
  sed -n 's/^const TORCH_VERSION: &str = "\(.*\)";/\1/p' \
    "$(ls -d ~/.cargo/registry/src/*/torch-sys-0.26*/ | head -1)build.rs" > "$pack/TORCH_VERSION"
  du -sh "$pack"
  exit 0
fi

if [ "$mode" = dry ]; then
  out=${GPU_CHECK_DIR:-runs/gpu-check-dry}
  device=cpu presets=tiny steps_small=3 steps_base=0 lens=${LENS:-64} batch_tokens=${BATCH_TOKENS:-256}
  small=tiny base=tiny extra=(--seq-len 32 --batch 2 --threads 2)
else
  out=${GPU_CHECK_DIR:-docs/gpu-check}
  device=cuda presets=tiny,small,base steps_small=${STEPS_SMALL:-300} steps_base=${STEPS_BASE:-200}
  lens=${LENS:-512 2048 8192} batch_tokens=${BATCH_TOKENS:-65536}
  small=small base=base extra=()
fi
mkdir -p "$out"
exec > >(tee "$out/check.log") 2>&1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# binaries: the pack when there is one, else this checkout's release build
bin=$pack
[ -x "$bin/cadenza-torch" ] || bin=target/release
[ -x "$bin/cadenza-torch" ] || bin=target/debug
torchlib=$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
torchver=$("$python" -c 'import torch; print(torch.__version__)')
export LD_LIBRARY_PATH="$torchlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "gpu-check ($mode): binaries from $bin (built for libtorch $(cat "$bin/TORCH_VERSION" 2>/dev/null || echo '?')), torch $torchver at $torchlib"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

rust_ok=1
if ! "$bin/cadenza-torch" --version >/dev/null 2>"$work/load.err"; then
  rust_ok=0
  echo "gpu-check: $bin/cadenza-torch does not load against torch $torchver:"
  head -c 600 "$work/load.err"; echo
  echo "gpu-check: parts 1-2 skipped (build the pack against this machine's torch version)"
fi
if [ "$rust_ok" = 1 ] && [ "$device" = cuda ] && ! "$python" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
  echo "gpu-check: torch sees no CUDA device"; exit 1
fi

failed=0
if [ "$rust_ok" = 1 ]; then
  echo "## 1. identities on $device"
  check=$bin/device_check
  [ -x "$check" ] || check=$bin/examples/device_check   # a cargo target folder
  "$check" --device "$device" --presets "$presets" | tee "$out/identities.md" || failed=1

  echo "## 2. training under bf16 autocast"
  "$bin/cadenza" tokenize midi_samples -o "$work/data" >/dev/null
  precision=bf16; [ "$device" = cpu ] && precision=f32
  for spec in "$small:$steps_small" "$base:$steps_base"; do
    preset=${spec%%:*} steps=${spec##*:}
    [ "$steps" -gt 0 ] || continue
    run="$work/run-$preset"
    t0=$(date +%s)
    if "$bin/cadenza" train -o "$run" --data "$work/data" --preset "$preset" --device "$device" \
         --precision "$precision" --steps "$steps" "${extra[@]}" > "$out/train-$preset.log" 2>&1; then
      echo "$preset: $steps steps in $(( $(date +%s) - t0 )) s: $(tail -n 2 "$out/train-$preset.log" | head -n 1)"
    else
      echo "$preset: training FAILED (see $out/train-$preset.log)"; failed=1
    fi
  done
  if [ -d "$work/run-$small/best" ]; then
    for d in "$device" cpu; do
      "$bin/cadenza" generate --model "$work/run-$small" --device "$d" --precision f32 --seed 5 --tokens 256 \
        -o "$work/gen-$d.mid" >/dev/null 2>"$work/gen-$d.err" || { cat "$work/gen-$d.err"; failed=1; }
    done
    if cmp -s "$work/gen-$device.mid" "$work/gen-cpu.mid"; then same=same; else same=different; fi
    printf '| generate --seed 5 --tokens 256 | %s on %s and on the CPU |\n|---|---|\n' "$same" "$device" \
      | tee "$out/generate.md"
  fi
fi

echo "## 3. throughput against the PyTorch SDPA GPT"
peak=${PEAK_TFLOPS:-}
if [ -z "$peak" ] && [ "$device" = cuda ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
    *H100*|*H200*) peak=989 ;;
    *A100*) peak=312 ;;
    *) peak=0 ;;
  esac
fi
: > "$work/rows.jsonl"
for len in $lens; do
  batch=$(( batch_tokens / len )); [ "$batch" -ge 1 ] || batch=1
  prec=bf16; [ "$device" = cpu ] && prec=f32
  shape=(--d 256 --layers 4 --heads 4 --d-ff 1024)
  [ "$mode" = dry ] && shape=(--d 64 --layers 2 --heads 4 --d-ff 128)
  "$python" scripts/reference/bench_sdpa.py --device "$device" --len "$len" --batch "$batch" \
    --steps 5 --precision "$prec" --peak-tflops "${peak:-0}" "${shape[@]}" >> "$work/rows.jsonl" \
    || echo "{\"impl\": \"pytorch-sdpa\", \"len\": $len, \"error\": \"failed\"}" >> "$work/rows.jsonl"
  if [ "$rust_ok" = 1 ]; then
    run="$work/speed-$len"
    mem="$work/mem-$len"
    poll=""
    if [ "$device" = cuda ]; then
      (while sleep 0.5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; done) > "$mem" &
      poll=$!
    fi
    "$bin/cadenza" train -o "$run" --data "$work/data" --preset "$small" --device "$device" \
      --precision "$prec" --seq-len "$len" --batch "$batch" --steps 12 "${extra[@]:0:0}" \
      > "$run.log" 2>&1 || { echo "cadenza at L $len failed: $(tail -n 3 "$run.log")"; failed=1; }
    [ -n "$poll" ] && kill "$poll" 2>/dev/null || true
    "$python" - "$run" "$len" "$batch" "$mem" >> "$work/rows.jsonl" <<'EOF'
import json, os, statistics, sys
run, length, batch, mem = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = []
if os.path.exists(os.path.join(run, "metrics.jsonl")):
    rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
tps = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")][2:]
peak = None
if os.path.exists(mem):
    used = [float(x) for x in open(mem).read().split() if x.strip()]
    peak = max(used) if used else None
print(json.dumps({"impl": "cadenza", "len": length, "batch": batch,
                  "tokens_per_s": round(statistics.median(tps), 1) if tps else None,
                  "peak_gpu_mb": peak}))
EOF
  fi
done
"$python" - "$work/rows.jsonl" "${peak:-0}" <<'EOF' | tee "$out/throughput.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
peak = float(sys.argv[2])
print("| model | L | batch | tokens/s | peak GPU memory (MiB) | MFU |")
print("|---|---|---|---|---|---|")
for r in rows:
    mfu = r.get("mfu")
    mem = r.get("peak_gpu_mb")
    print(f"| {r['impl']} | {r['len']} | {r.get('batch', '')} | {r.get('tokens_per_s', r.get('error'))} "
          f"| {mem if mem is not None else '-'} | {f'{100 * mfu:.1f}%' if mfu else '-'} |")
print()
print("PyTorch's memory: torch.cuda.max_memory_allocated; cadenza's: the most nvidia-smi showed "
      "in use during its run (the CUDA context included). MFU: (6 N + 12 layers d L) FLOPs "
      f"per token of the GPT at a peak of {peak:g} TFLOP/s (0: unknown GPU).")
EOF
if [ "$failed" = 1 ]; then
  echo "gpu-check: some checks FAILED"; exit 1
fi
echo "gpu-check: done; results in $out"
