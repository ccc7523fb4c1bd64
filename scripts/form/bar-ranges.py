#!/usr/bin/env python3
"""Where in a piece the bar next door looks like its neighbour: L_1 (the mean Jaccard
similarity of bar i and bar i + 1, a bar being the set of its notes as (position,
pitch, duration), pairs with an empty bar left out, as `cadenza stats` reads them) by
bar range, with the notes per bar, the share of pairs that are verbatim repeats and of
those that overlap by 0.2-0.5. Reads tokenized datasets (`cadenza tokenize DIR --vocab
vocab/remi-compact.json -o DATASET`), pieces of >= 24 bars; the bars are read from the
tokens (Bar, Position, Pitch, Duration), so the figures may differ from `cadenza stats`
in the last digit. Usage:
  python3 scripts/form/bar-ranges.py DATASET... [--ranges 0-32,32-64,64-128,128-]
Standard library only."""
import argparse
import array
import json
import os
import statistics


def pieces(dataset):
    """Every piece's token names."""
    meta = json.load(open(os.path.join(dataset, "pieces.json")))
    names = json.load(open(os.path.join(dataset, "vocab.json")))["tokens"]
    tokens = array.array("H")
    with open(os.path.join(dataset, "tokens.bin"), "rb") as f:
        tokens.frombytes(f.read())
    for p in meta:
        yield [names[i] for i in tokens[p["offset"]:p["offset"] + p["len"]]]


def bars(names):
    """The notes of every bar as a set of (position, pitch, duration)."""
    out, pos, pitch = [], None, None
    for n in names:
        if n == "Bar":
            out.append(set())
        elif not out:
            continue
        elif n.startswith("Position_"):
            pos = n
        elif n.startswith("Pitch"):
            pitch = n
        elif n.startswith("Duration_"):
            out[-1].add((pos, pitch, n))
    return out


def jaccard(a, b):
    return len(a & b) / len(a | b) if a and b else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("datasets", nargs="+")
    ap.add_argument("--ranges", default="0-32,32-64,64-128,128-")
    ap.add_argument("--min-bars", type=int, default=24)
    a = ap.parse_args()
    ranges = [(int(lo), int(hi) if hi else None) for lo, hi in (r.split("-") for r in a.ranges.split(","))]
    all_bars = [b for d in a.datasets for b in map(bars, pieces(d)) if len(b) >= a.min_bars]
    print(f"{len(all_bars)} pieces of >= {a.min_bars} bars, median {statistics.median(map(len, all_bars))} bars")
    print("| bars | pieces | L_1 | notes per bar | verbatim repeats | overlap 0.2-0.5 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for lo, hi in ranges:
        per_piece, notes, pairs, same, partial = [], [], 0, 0, 0
        for bs in all_bars:
            seg = bs[lo:hi]
            js = [j for j in (jaccard(x, y) for x, y in zip(seg, seg[1:])) if j is not None]
            if len(js) < 4:
                continue
            per_piece.append(statistics.mean(js))
            notes.extend(len(b) for b in seg)
            pairs += len(js)
            same += sum(j == 1.0 for j in js)
            partial += sum(0.2 <= j < 0.5 for j in js)
        if per_piece:
            print(f"| {lo + 1}-{hi or ''} | {len(per_piece)} | {statistics.mean(per_piece):.3f} | "
                  f"{statistics.mean(notes):.2f} | {same / pairs:.2%} | {partial / pairs:.1%} |")


if __name__ == "__main__":
    main()
