#!/usr/bin/env python3
"""Markdown table of the learning experiment (scripts/learning.sh).

Reads runs/learning/<variant>/eval.json (cadenza's `eval --json`, or the
reference scripts' report, which share the metric names) and, for cadenza
runs, the training speed from metrics.jsonl. Standard library only.
Usage: learning_table.py OUT_DIR VARIANT...
"""
import json
import os
import statistics
import sys

NAMES = {
    "today": "today's model (tied head scaled at both ends, dropout 0.1, reference SPE init)",
    "head": "today + untied unscaled head",
    "spread": "today + SPE periods spread 2..2048",
    "nodrop": "today + dropout 0",
    "all": "all three fixes (the new `small` preset)",
    "tied": "all fixes, GPT-2 tied head instead of untied",
    "conv16": "all fixes, ConvSPE kernel 16",
    "softmax-ape": "all fixes, cadenza softmax + APE",
    "favor128": "all fixes, 128 FAVOR+ features instead of 64",
    "compact": "all fixes, compact vocabulary (program changes, no velocity)",
    "gpt": "reference: PyTorch GPT, SDPA softmax, learned positions",
    "performer": "reference: performer-pytorch 1.1.4 PerformerLM",
    "compact-spe-r64": "compact vocabulary, SineSPE with R = 64",
    "compact-shortconv4": "compact vocabulary, short convolution (k = 4) on q, k, v",
    "compact-local2": "compact vocabulary, 2 of 4 heads local softmax over 128 tokens",
    "compact-local2-sc4": "compact vocabulary, 2 local heads and a short convolution (k = 4)",
    "gpt-compact": "reference: PyTorch GPT on the compact vocabulary",
    "performer-compact": "reference: performer-pytorch on the compact vocabulary",
}


def speed(run):
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    tps = []
    with open(path) as f:
        for line in f:
            m = json.loads(line)
            if "tokens_per_s" in m and "val_loss" not in m and m["step"] > 5:
                tps.append(m["tokens_per_s"])
    return statistics.median(tps) if tps else None


def cell(x, fmt):
    return "-" if x is None else fmt.format(x)


def pitch(block):
    p = (block or {}).get("by_type", {}).get("Pitch")
    return (p["nll"], p["top1"]) if p else (None, None)


def main():
    out, variants = sys.argv[1], sys.argv[2:]
    print("| variant | pitch NLL | pitch top-1 | in-context mass (true share) | loss | folk pitch top-1 | classical pitch top-1 | tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for v in variants:
        run = os.path.join(out, v)
        path = os.path.join(run, "eval.json")
        if not os.path.exists(path):
            continue
        r = json.load(open(path))
        nll, top1 = pitch(r)
        pc = r.get("pitch_context") or {}
        mass, share = pc.get("model_mass"), pc.get("true_share")
        src = r.get("by_source", {})
        _, folk = pitch(src.get("folk"))
        _, classical = pitch(src.get("classical"))
        # Speeds come from the side-by-side pass (learning-speed.sh) when it ran.
        fast = os.path.join(out + "-speed", v)
        ref = os.path.join(fast, "eval.json")
        if os.path.exists(ref):
            tps = json.load(open(ref)).get("tokens_per_s")
        elif os.path.exists(fast):
            tps = speed(fast)
        else:
            tps = r.get("tokens_per_s") or speed(run)
        ctx = "-" if mass is None else f"{mass:.3f} ({share:.3f})"
        print(
            f"| {NAMES.get(v, v)} | {cell(nll, '{:.3f}')} | {cell(top1 and top1 * 100, '{:.1f}%')} | {ctx} | "
            f"{cell(r.get('loss'), '{:.3f}')} | {cell(folk and folk * 100, '{:.1f}%')} | "
            f"{cell(classical and classical * 100, '{:.1f}%')} | {cell(tps, '{:,.0f}')} |"
        )


if __name__ == "__main__":
    main()
