#!/usr/bin/env python3
"""Markdown table of scripts/bench-vs-pytorch.sh's results (JSON lines of
benches/train_speed.rs and scripts/reference/bench_sdpa.py).

With several alternated pairs per row (REPEAT), tokens/s are medians, the ratio is
the median of the pairs' ratios with their range, and peaks are the largest."""

import json
import statistics
import sys


def main(path):
    rows = {}
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        key = (r["len"], r["batch"], r.get("precision", "f32"))
        rows.setdefault(key, {}).setdefault(r["impl"], []).append(r)
    print("| L | batch | precision | cadenza tok/s | PyTorch SDPA tok/s | ratio | cadenza peak MB "
          "| PyTorch peak MB | cadenza KB/token | PyTorch KB/token |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for (L, B, prec), r in sorted(rows.items()):
        cs, ps = r.get("cadenza"), r.get("pytorch-sdpa")
        if not cs or not ps:
            continue
        tok = lambda runs: statistics.median(x["tokens_per_s"] for x in runs)
        ratios = [c["tokens_per_s"] / p["tokens_per_s"] for c, p in zip(cs, ps)]
        ratio = f"{statistics.median(ratios):.2f}x"
        if len(ratios) > 1:
            ratio += f" ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} pairs)"
        peak = lambda runs: max(runs, key=lambda x: x["peak_rss_mb"])
        c, p = peak(cs), peak(ps)
        per_tok = lambda x: (x["peak_rss_mb"] - x["base_rss_mb"]) * 1024 / (L * B)
        print(f"| {L:,} | {B} | {prec} | {tok(cs):,.0f} | {tok(ps):,.0f} "
              f"| {ratio} | {c['peak_rss_mb']:,.0f} "
              f"| {p['peak_rss_mb']:,.0f} | {per_tok(c):.0f} | {per_tok(p):.0f} |")
    first = next(iter(rows.values()))
    t = next(iter(first.values()))[0]["threads"]
    c = first.get("cadenza", [{}])[0]
    heads = c.get("local_heads", 0)
    rope = " with RoPE" if c.get("local_position") == "rope" else ""
    local = (f"{heads} local softmax heads{rope} over {c.get('local_window')} tokens, the others FAVOR+"
             if heads else "every head FAVOR+")
    print(f"\n{t} threads; cadenza: {local}; tokens/s = batch x L / mean seconds per step; "
          "KB/token = (peak - resident before the first step) / (batch x L); "
          "PyTorch bf16 = torch.autocast(\"cpu\", dtype=torch.bfloat16), cadenza bf16 = "
          "--precision bf16.")


if __name__ == "__main__":
    main(sys.argv[1])
