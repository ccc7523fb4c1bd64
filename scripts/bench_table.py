#!/usr/bin/env python3
"""Markdown table of scripts/bench-vs-pytorch.sh's results (JSON lines of
benches/train_speed.rs and scripts/reference/bench_sdpa.py)."""

import json
import sys


def main(path):
    rows = {}
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        rows.setdefault((r["len"], r["batch"]), {})[r["impl"]] = r
    print("| L | batch | cadenza tok/s | PyTorch SDPA tok/s | ratio | cadenza peak MB "
          "| PyTorch peak MB | cadenza KB/token | PyTorch KB/token |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (L, B), r in sorted(rows.items()):
        c, p = r.get("cadenza"), r.get("pytorch-sdpa")
        if not c or not p:
            continue
        per_tok = lambda x: (x["peak_rss_mb"] - x["base_rss_mb"]) * 1024 / (L * B)
        print(f"| {L:,} | {B} | {c['tokens_per_s']:,.0f} | {p['tokens_per_s']:,.0f} "
              f"| {c['tokens_per_s'] / p['tokens_per_s']:.2f}x | {c['peak_rss_mb']:,.0f} "
              f"| {p['peak_rss_mb']:,.0f} | {per_tok(c):.0f} | {per_tok(p):.0f} |")
    first = next(iter(rows.values()))
    t = next(iter(first.values()))["threads"]
    c = first.get("cadenza", {})
    heads = c.get("local_heads", 0)
    rope = " with RoPE" if c.get("local_position") == "rope" else ""
    local = (f"{heads} local softmax heads{rope} over {c.get('local_window')} tokens, the others FAVOR+"
             if heads else "every head FAVOR+")
    print(f"\n{t} threads; cadenza: {local}; tokens/s = batch x L / mean seconds per step; "
          "KB/token = (peak - resident before the first step) / (batch x L).")


if __name__ == "__main__":
    main(sys.argv[1])
