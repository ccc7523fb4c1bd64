#!/usr/bin/env python3
"""Training-step throughput and peak memory of the PyTorch SDPA GPT of train_ref.py.

    bench_sdpa.py --len 512 --batch 8 [--steps 3] [--threads 2] [--vocab 845]
                  [--d 256 --layers 4 --heads 4 --d-ff 1024] [--precision f32|bf16]

The same step as cadenza's benches/train_speed.rs: forward, mean cross-entropy,
backward, gradient clipping at 1.0, AdamW; random tokens, one untimed warm-up
step, then --steps timed ones. Prints one JSON line (peak RSS = ru_maxrss of
this process, so run one configuration per process). --precision bf16 runs the
forward and the loss under torch.autocast("cpu", dtype=torch.bfloat16), as a PyTorch
user would on a CPU with AMX; the weights and AdamW stay f32.
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
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT(a.vocab, a.len, a.d, a.layers, a.heads, a.d_ff)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-8,
                            weight_decay=0.01)
    base = rss_mb()

    def step():
        batch = torch.randint(1, a.vocab, (a.batch, a.len + 1))
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, a.vocab).float(),
                                   batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step()
    secs = sum(step() for _ in range(a.steps)) / max(a.steps, 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(json.dumps({
        "impl": "pytorch-sdpa", "torch": torch.__version__, "precision": a.precision,
        "len": a.len, "batch": a.batch,
        "steps": a.steps, "threads": torch.get_num_threads(),
        "secs_per_step": round(secs, 4), "tokens_per_s": round(a.batch * a.len / secs, 1),
        "base_rss_mb": round(base, 1), "peak_rss_mb": round(peak, 1),
    }))


if __name__ == "__main__":
    main()
