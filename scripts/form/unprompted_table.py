"""Summarizes scripts/form/unprompted.sh's OUT: the bar-similarity curve of the pieces
against the held-out folk tunes, split by instruments, with the loops, the flat pieces,
the guard's changes, a 90% interval of each ratio and the spread of an 8-piece mean; the
same over the first 32 bars where OUT has stats-32.json; with several OUTs (seeds), each
and then all pooled. Usage: unprompted_table.py OUT..."""
import json
import os
import random
import statistics
import subprocess
import sys

LAGS = (1, 2, 4, 8, 16)
BIN = os.environ.get("BIN", "target/release/cadenza")


def programs(midi):
    """The programs `cadenza inspect` lists for a MIDI file."""
    text = subprocess.run([BIN, "inspect", midi], capture_output=True, text=True).stdout
    for line in text.splitlines():
        if line.startswith("programs:"):
            return line.split(":", 1)[1].split()
    return []


def curve(piece):
    """L_t at the lags, None where the piece is too short for the lag."""
    c = piece["similarity_curve"]
    return [c[t - 1] if t <= len(c) else None for t in LAGS]


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else float("nan")


def fmt(means, real):
    return " | ".join(f"{m:.3f} ({m / r:.2f}x)" for m, r in zip(means, real))


def interval(curves, real_curves, k, draws=2000):
    """90% interval of mean L_t(pieces) / mean L_t(tunes), both resampled with replacement."""
    gen = [c[k] for c in curves if c[k] is not None]
    real = [c[k] for c in real_curves if c[k] is not None]
    rng = random.Random(1)
    ratios = sorted(
        statistics.mean(rng.choices(gen, k=len(gen))) / statistics.mean(rng.choices(real, k=len(real)))
        for _ in range(draws)
    )
    return ratios[draws // 20], ratios[draws - 1 - draws // 20]


def table(title, pieces, real_pieces, real, with_programs):
    """The L_t rows of `pieces` against the tunes' curve `real`, and the intervals."""
    groups = {"all": pieces}
    if with_programs:
        groups.update({"program 0 alone": [], "other instruments": []})
        for p in pieces:
            key = "program 0 alone" if programs(p["source"]) == ["0"] else "other instruments"
            groups[key].append(p)
    print(f"{title}\n")
    print("| pieces | n | " + " | ".join(f"L_{t}" for t in LAGS) + " | loops (L_16 > 0.6) | flat (L_8 < 0.2) |")
    print("| --- | ---: |" + " ---: |" * (len(LAGS) + 2))
    print("| real folk tunes | | " + " | ".join(f"{r:.3f}" for r in real) + " | | |")
    for name, group in groups.items():
        if not group:
            continue
        curves = [curve(p) for p in group]
        means = [mean(c) for c in zip(*curves)]
        loops = sum((c[4] or 0) > 0.6 for c in curves)
        flat = sum((c[3] or 0) < 0.2 for c in curves)
        print(f"| {name} | {len(group)} | {fmt(means, real)} | {loops} | {flat} |")
    curves = [curve(p) for p in pieces]
    real_curves = [curve(p) for p in real_pieces]
    spans = []
    for k in range(len(LAGS)):
        lo, hi = interval(curves, real_curves, k)
        spans.append(f"L_{LAGS[k]} {lo:.2f}x-{hi:.2f}x")
    print("\nratio to the tunes', 90% interval (pieces and tunes resampled): " + ", ".join(spans))
    if len(curves) >= 16:
        rng = random.Random(0)
        spans = []
        for k in range(len(LAGS)):
            xs = sorted(mean(rng.sample([c[k] for c in curves], 8)) for _ in range(2000))
            spans.append(f"L_{LAGS[k]} {xs[100] / real[k]:.2f}x-{xs[1900] / real[k]:.2f}x")
        print("\nmean of 8 pieces, 5-95%: " + ", ".join(spans))
    print()


def guard_changes(pieces):
    changes = 0
    for p in pieces:
        record = os.path.splitext(p["source"])[0] + ".json"
        if os.path.exists(record):
            changes += json.load(open(record)).get("guard_changes", 0)
    return changes


def summarize(outs, heading):
    """One block: the pieces of every OUT in `outs` together, whole and over 32 bars."""
    print(f"## {heading}\n")
    for name, title in (("stats.json", "Whole pieces"), ("stats-32.json", "The first 32 bars of every piece and tune")):
        paths = [os.path.join(out, name) for out in outs]
        if not all(os.path.exists(p) for p in paths):
            continue
        runs = [json.load(open(p)) for p in paths]
        pieces = [p for r in runs for p in r["generated"]["pieces"]]
        # the same tunes in every run: take the first run's
        real_pieces = runs[0]["real"]["pieces"]
        real = [runs[0]["real"]["summary"]["similarity_curve"][t - 1] for t in LAGS]
        if name == "stats.json":
            changes = guard_changes(pieces)
            print(f"{len(pieces)} pieces, guard changes {changes} ({changes / max(len(pieces), 1):.1f} per piece)\n")
        table(f"{title}:", pieces, real_pieces, real, name == "stats.json")


for out in sys.argv[1:]:
    summarize([out], out)
if len(sys.argv) > 2:
    summarize(sys.argv[1:], f"pooled: {len(sys.argv) - 1} runs")
