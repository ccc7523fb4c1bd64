#!/usr/bin/env python3
"""The far-copy table (scripts/form/far-copy.sh): per row, the pitch NLL of the second A
with the whole past and with the last 128 tokens (A out of reach), and the training-time
validation loss. ln 32 = 3.466 is the NLL of a guess; 0 a perfect copy. The cut NLL may
read above a guess: a window cut inside a piece, with no BOS, is not what training saw.
Usage: python3 scripts/form/far_copy_table.py OUT ROW [ROW ...]"""
import json
import os
import sys


def main():
    out, rows = sys.argv[1], sys.argv[2:]
    print("| row | second A, whole past | second A, last 128 | validation |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows:
        d = json.load(open(os.path.join(out, f"{row}.json")))
        g = d["context_gain"]["by_type"]["Pitch"]
        full, cut = g["full"], g["cut"]["128"]
        state = json.load(open(os.path.join(out, row, "checkpoint", "state.json")))
        val = state["last_val_loss"]
        print(f"| {row} | {full:.3f} | {cut:.3f} | {val:.3f} |")


if __name__ == "__main__":
    main()
