"""The table of scripts/form/sampling-sweep.sh: per (temperature, top-p), the strain
return of 8-bar continuations of the 60 held-out folk tunes and the continuation
ratios generated / real (in-scale share, notes per bar, pitch range, repeated
notes); then, where unprompted pieces were made, their bar-similarity curve.

Usage: python3 scripts/form/sweep_table.py OUT
"""
import glob
import json
import os
import re
import sys

LAGS = (1, 2, 4, 8, 16, 32)


def pair(path, prefix):
    m = re.match(prefix + r"-t([0-9.]+)-p([0-9.]+)\.json$", os.path.basename(path))
    return (float(m.group(1)), float(m.group(2))) if m else None


def reports(d, prefix):
    found = [(pair(p, prefix), p) for p in glob.glob(os.path.join(d, prefix + "-t*-p*.json"))]
    # the default (T = 1, top-p 0.95) first, then falling temperature and top-p
    return sorted(((k, p) for k, p in found if k), key=lambda kp: (-kp[0][0], -kp[0][1]))


def main(d):
    conts = reports(d, "cont")
    real = None
    print("| temperature | top-p | strain return | share >= 0.5 | in-scale ratio | notes per bar | pitch range | repeated notes |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (t, p), path in conts:
        k = json.load(open(path))
        s = k["strain_return"]
        real = s["real"]
        r = k["ratio"]
        cells = [f"{t:g}", f"{p:g}", f"{s['generated']['mean']:.3f}", f"{s['generated']['share']:.3f}",
                 f"{r['in_scale']:.3f}x", f"{r['notes_per_bar']:.2f}x", f"{r['pitch_range']:.2f}x",
                 f"{r['repeat_share']:.2f}x"]
        print("| " + " | ".join(cells) + " |")
    if real:
        print(f"\nThe real tunes' own strain return / share: {real['mean']:.3f} / {real['share']:.3f} "
              f"({real['pieces']} tunes); targets: >= {0.8 * real['mean']:.3f}, share within 0.2.")
    stats = reports(d, "stats")
    if not stats:
        return
    print()
    print("| pieces | " + " | ".join(f"L_{t}" for t in LAGS) + " | strain return | share >= 0.5 | recall W = 16 |")
    print("| --- | " + " | ".join("---:" for _ in LAGS) + " | ---: | ---: | ---: |")
    first = json.load(open(stats[0][1]))
    rows = [("real folk tunes", first["real"]["summary"])]
    rows += [(f"unprompted, T = {t:g}, top-p {p:g}", json.load(open(path))["generated"]["summary"])
             for (t, p), path in stats]
    for label, s in rows:
        curve = s["similarity_curve"]
        cells = [label] + [f"{curve[t - 1]:.3f}" for t in LAGS]
        cells += [f"{s['strain_return']:.3f}", f"{s['strain_share']:.3f}", f"{s['section_recall']['16']:.3f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/sweep")
