#!/usr/bin/env python3
"""Links the held-out folk tunes of a dataset into a folder, for the form
measurements of issue 25 (scripts/form-eval.sh).

Usage: python3 scripts/form/heldout-folk.py DATA CORPUS OUT [--seed 0] [--fraction 0.05]

DATA is a tokenized dataset (`cadenza tokenize`), CORPUS the folder its sources are
relative to (the shared corpus), OUT a new folder. A piece is held out exactly as
`src/train/data.rs::is_validation` decides (FNV-1a of its source, seeded), so these are
the tunes a model trained on DATA with that seed and fraction never saw.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cadenza_split import is_validation  # noqa: E402  (the held-out split, shared)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("corpus")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fraction", type=float, default=0.05)
    ap.add_argument("--group", default="folk")
    a = ap.parse_args()
    with open(os.path.join(a.data, "pieces.json")) as f:
        pieces = json.load(f)
    if isinstance(pieces, dict):
        pieces = pieces.get("pieces", [])
    if os.path.exists(a.out):
        print(f"{a.out}: exists; give a new folder", file=sys.stderr)
        return 2
    os.makedirs(a.out)
    n = 0
    for p in pieces:
        src = p["source"]
        if not src.startswith(a.group + "/") or not is_validation(src, a.seed, a.fraction):
            continue
        target = os.path.abspath(os.path.join(a.corpus, src))
        if not os.path.isfile(target):
            print(f"{target}: not found (is CORPUS the folder DATA was made from?)", file=sys.stderr)
            return 2
        link = os.path.join(a.out, src.replace("/", "__"))
        os.symlink(target, link)
        n += 1
    print(f"linked {n} held-out {a.group} pieces into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
