"""The table of issue 25's side-by-side rows from scripts/form-eval.sh's reports.

Usage: python3 scripts/form_table.py runs/form
"""
import json
import os
import sys

ROWS = [
    ("shipped", "the shipped model (no extra steps)"),
    ("base512", "+150 steps, shipped config, 8 x 512"),
    ("music512", "+150 steps, musical RoPE + 25% piece starts, 8 x 512"),
    ("base2048", "+150 steps, shipped config, 2 x 2,048"),
    ("music2048", "+150 steps, musical RoPE + 25% piece starts, 2 x 2,048"),
]


def load(d, name):
    p = os.path.join(d, name)
    return json.load(open(p)) if os.path.exists(p) else None


def main(d):
    print("| row | held-out loss | pitch top-1 | loss, FAVOR+ heads zeroed | "
          "context gain (full / last 512) | strain return (real) | share >= 0.5 (real) | in-scale |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row, label in ROWS:
        e, a, c, k = (load(d, f"{p}-{row}.json") for p in ("eval", "ablate", "ctx", "cont"))
        if e is None:
            continue
        cells = [label, f"{e['loss']:.4f}", f"{100 * e['by_type']['Pitch']['top1']:.1f}%"]
        cells.append(f"{a['loss']:.4f} (+{100 * (a['loss'] / e['loss'] - 1):.1f}%)" if a else "")
        if c:
            g = c["context_gain"]
            cells.append(f"{g['full']:.4f} / {g['cut']['512']:.4f} = {g['ratio']['512']:.3f}")
        else:
            cells.append("")
        if k and k.get("strain_return"):
            s = k["strain_return"]
            cells.append(f"{s['generated']['mean']:.3f} ({s['real']['mean']:.3f})")
            cells.append(f"{s['generated']['share']:.3f} ({s['real']['share']:.3f})")
        else:
            cells += ["", ""]
        cells.append(f"{k['generated']['in_scale']:.3f}" if k and 'generated' in k and 'in_scale' in k['generated'] else "")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/form")
