#!/usr/bin/env python3
"""How much of a piece the far past could give by copying: the ceiling under issue 25's
context gain. For every piece of at least LEN tokens (default 2,048) of a tokenized
dataset, the bars that begin at token positions START..LEN (default 1,024) are sorted by
the nearest earlier bar with exactly the same tokens: none (a fresh bar), one whose start
lies within WINDOW tokens (512, the local heads' reach), or one only further back (what
only the FAVOR+ heads could carry). Prints the share of tokens in each class, over the
held-out pieces (the split of scripts/cadenza_split.py, seed 0, 5%) and over all pieces.

Usage: python3 scripts/form/far-repeats.py DATASET [--len 2048] [--start 1024] [--window 512]
Standard library only."""
import argparse
import array
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cadenza_split import is_validation  # noqa: E402


def bars_of(ids, bar_id):
    """(start index, token tuple) of every bar: from a Bar token up to the next."""
    starts = [i for i, t in enumerate(ids) if t == bar_id]
    return [(s, tuple(ids[s + 1:e])) for s, e in zip(starts, starts[1:] + [len(ids)])]


def classify(ids, bar_id, start, window):
    """Token counts of the bars beginning in [start, len(ids)): fresh, near copy, far copy."""
    counts = {"fresh": 0, "near": 0, "far": 0}
    last_seen = {}
    for s, body in bars_of(ids, bar_id):
        prev = last_seen.get(body)
        if s >= start:
            kind = "fresh" if prev is None else ("near" if s - prev <= window else "far")
            counts[kind] += len(body) + 1
        last_seen[body] = s
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--len", type=int, default=2048)
    ap.add_argument("--start", type=int, default=1024)
    ap.add_argument("--window", type=int, default=512)
    a = ap.parse_args()
    pieces = json.load(open(os.path.join(a.dataset, "pieces.json")))
    names = json.load(open(os.path.join(a.dataset, "vocab.json")))["tokens"]
    bar_id = names.index("Bar")
    tokens = array.array("H")
    with open(os.path.join(a.dataset, "tokens.bin"), "rb") as f:
        tokens.frombytes(f.read())
    if sys.byteorder != "little":
        tokens.byteswap()
    for split in ("held-out", "all"):
        total = {"fresh": 0, "near": 0, "far": 0}
        n = 0
        for p in pieces:
            if p["len"] < a.len or (split == "held-out" and not is_validation(p["source"], 0, 0.05)):
                continue
            ids = list(tokens[p["offset"]:p["offset"] + a.len])
            for k, v in classify(ids, bar_id, a.start, a.window).items():
                total[k] += v
            n += 1
        t = sum(total.values()) or 1
        print(f"{split}: {n} pieces of >= {a.len:,} tokens, bars beginning at tokens {a.start:,}-{a.len:,}: "
              f"fresh {total['fresh'] / t:.1%}, an exact copy within {a.window} tokens {total['near'] / t:.1%}, "
              f"an exact copy only further back {total['far'] / t:.1%} ({t:,} tokens)")


if __name__ == "__main__":
    main()
