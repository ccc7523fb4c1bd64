"""The tables of issue 25's side-by-side rows from scripts/form-eval.sh's reports:
the form and loss figures, then the return probe and the strain return under other
sampling settings (where those reports exist).

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
    ("starts512", "+600 steps, shipped config + 25% piece starts, 8 x 512"),
    ("bars512", "+600 steps, bar embedding (64) + 25% piece starts, 8 x 512"),
    ("barsknown512", "+600 steps, bar embedding (64), every window's bar known, + 25% piece starts, 8 x 512"),
    ("ship2048", "+{steps} steps from the musical-RoPE model, its config, 2 x 2,048"),
    ("onepiece2048", "+{steps} steps from the musical-RoPE model, every window inside one long piece, 2 x 2,048"),
    ("starts2048", "+{steps} steps from the musical-RoPE model, half the windows from a piece start, 2 x 2,048"),
    ("reprise2048", "+{steps} steps from the musical-RoPE model, half from a piece start, + made-up far returns, 2 x 2,048"),
    ("openings2048", "+{steps} steps from the musical-RoPE model, half from a piece start, openings drawn per piece, 2 x 2,048"),
    ("scratch-base", "from scratch, shipped recipe, {steps} steps"),
    ("scratch-music", "from scratch, + musical RoPE (8 bar, 8 position pairs), {steps} steps"),
    ("scratch-music-spe", "from scratch, + musical RoPE and SineSPE in musical time, {steps} steps"),
    ("scratch-base-2048", "from scratch, shipped recipe, 2 x 2,048, {steps} steps"),
    ("scratch-music-2048", "from scratch, + musical RoPE, 2 x 2,048, {steps} steps"),
    ("scratch-music-spe-2048", "from scratch, + musical RoPE and SineSPE in musical time, 2 x 2,048, {steps} steps"),
    ("scratch-music-spe48", "from scratch, + musical RoPE and SineSPE in musical time on a 48-step bar, {steps} steps"),
    ("scratch-music-spe48-2048", "from scratch, + musical RoPE and SineSPE in musical time on a 48-step bar, 2 x 2,048, {steps} steps"),
]


def labelled(d, row, label):
    """The row's label, with {steps} read from its run's config.json."""
    cfg = os.path.join(d, row, "config.json")
    steps = json.load(open(cfg))["train"]["steps"] if os.path.exists(cfg) else "?"
    return label.format(steps=f"{steps:,}" if isinstance(steps, int) else steps)


def load(d, name):
    p = os.path.join(d, name)
    return json.load(open(p)) if os.path.exists(p) else None


def main(d):
    print("| row | held-out loss | pitch top-1 | loss, FAVOR+ heads zeroed | "
          "context gain, 6 training pieces (full / last 512) | context gain, held-out pieces | "
          "strain return (real) | share >= 0.5 (real) | in-scale |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row, label in ROWS:
        e, a, c, h, k = (load(d, f"{p}-{row}.json") for p in ("eval", "ablate", "ctx", "ctxh", "cont"))
        if e is None:
            continue
        cells = [labelled(d, row, label), f"{e['loss']:.4f}", f"{100 * e['by_type']['Pitch']['top1']:.1f}%"]
        cells.append(f"{a['loss']:.4f} (+{100 * (a['loss'] / e['loss'] - 1):.1f}%)" if a else "")
        for x in (c, h):
            if x:
                g = x["context_gain"]
                # the measure: NLL with the whole past over NLL with the last 512
                # tokens (below 1: the far past helps); eval's own `ratio` is its inverse
                cells.append(f"{g['full']:.4f} / {g['cut']['512']:.4f} = {g['full'] / g['cut']['512']:.3f}")
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
    probe_table(d)


def pitch(m):
    p = m["by_type"].get("Pitch") if m else None
    return f"{100 * p['top1']:.1f}% ({p['count']})" if p else ""


def strain(k):
    if not k or not k.get("strain_return"):
        return ""
    s = k["strain_return"]["generated"]
    return f"{s['mean']:.3f} / {s['share']:.3f}"


def probe_table(d):
    rows = [(r, l) for r, l in ROWS if load(d, f"eval-{r}.json") and "returns" in load(d, f"eval-{r}.json")]
    if not rows:
        return
    print()
    print("| row | pitch top-1: returning bars | entering | continuing | first pitch of an entering bar | fresh bars "
          "| strain return / share: T = 1, top-p 0.95 | the same, no repetition guard | greedy (top-p 0.01) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row, label in rows:
        r = load(d, f"eval-{row}.json")["returns"]
        cells = [labelled(d, row, label), pitch(r["returning"]), pitch(r.get("entering")), pitch(r.get("continuing")),
                 pitch(r.get("entry_pitch")), pitch(r["fresh"])]
        cells += [strain(load(d, f"{p}-{row}.json")) for p in ("cont", "cont-noguard", "cont-greedy")]
        print("| " + " | ".join(cells) + " |")
    k = load(d, f"cont-{rows[0][0]}.json")
    if k and k.get("strain_return"):
        s = k["strain_return"]["real"]
        print(f"\nThe real tunes' own strain return / share: {s['mean']:.3f} / {s['share']:.3f}.")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/form")
