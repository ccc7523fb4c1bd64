#!/usr/bin/env python3
"""Training-step throughput and peak memory of the PyTorch SDPA GPT of train_ref.py.

    bench_sdpa.py --len 512 --batch 8 [--steps 3] [--threads 2] [--vocab 845]
                  [--d 256 --layers 4 --heads 4 --d-ff 1024] [--precision f32|bf16]
                  [--device cpu|cuda] [--peak-tflops T]

The same step as cadenza's benches/train_speed.rs: forward, mean cross-entropy,
backward, gradient clipping at 1.0, AdamW; random tokens, one untimed warm-up
step, then --steps timed ones. Prints one JSON line (peak RSS = ru_maxrss of
this process, so run one configuration per process). --precision bf16 runs the
forward and the loss under torch.autocast("cpu", dtype=torch.bfloat16), as a PyTorch
user would on a CPU with AMX; the weights and AdamW stay f32.

--device cuda (scripts/gpu-check.sh): the same step on GPU 0 under
torch.autocast("cuda", dtype=torch.bfloat16) for bf16, timed between
torch.cuda.synchronize() calls; peak memory is torch.cuda.max_memory_allocated.
With --peak-tflops (the GPU's dense bf16 peak), the line gives the model FLOP
utilisation: (6 N + 12 layers d L) FLOPs per token (N: the parameters of the
matrix products, the tied output head included; the second term: QK^T and AV of
causal attention, forward and backward, counted whole as in the PaLM paper)
times tokens/s over the peak. Standard library and torch only.
"""

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_ref import GPT  # noqa: E402


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=845)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dev = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_sdpa.py --device cuda: torch sees no CUDA device")
    model = GPT(a.vocab, a.len, a.d, a.layers, a.heads, a.d_ff).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-8,
                            weight_decay=0.01)
    base = rss_mb()

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    def step():
        batch = torch.randint(1, a.vocab, (a.batch, a.len + 1), device=dev)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, a.vocab).float(),
                                   batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    step()
    secs = sum(step() for _ in range(a.steps)) / max(a.steps, 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    extra = {}
    if a.device == "cuda":
        extra["gpu"] = torch.cuda.get_device_name(0)
        extra["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    tps = a.batch * a.len / secs
    matmul = sum(p.numel() for n, p in model.named_parameters()
                 if p.dim() == 2 and n != "pos.weight")
    flops_per_token = 6 * matmul + 12 * a.layers * a.d * a.len
    extra["model_flops_per_token"] = flops_per_token
    if a.peak_tflops > 0:
        extra["mfu"] = round(flops_per_token * tps / (a.peak_tflops * 1e12), 4)
    print(json.dumps({
        "impl": "pytorch-sdpa", "torch": torch.__version__, "precision": a.precision,
        "len": a.len, "batch": a.batch,
        "steps": a.steps, "threads": torch.get_num_threads(),
        "secs_per_step": round(secs, 4), "tokens_per_s": round(a.batch * a.len / secs, 1),
        "base_rss_mb": round(base, 1), "peak_rss_mb": round(peak, 1), **extra,
    }))


if __name__ == "__main__":
    main()
