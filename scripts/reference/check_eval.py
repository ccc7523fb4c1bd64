#!/usr/bin/env python3
"""Self-check: train_ref.evaluate against a naive per-target loop, on a probe (the synthetic one
will do), with an untrained GPT and PerformerLM; plus the learning-rate schedule's end points.

    check_eval.py PROBE_DIR
"""

import math
import sys

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import train_ref as tr  # noqa: E402


def naive(model, meta, val, ctx):
    types, pad = meta["types"], meta["pad_id"]
    tt, pcl = meta["token_type"], meta["pitch_class"]
    P = types.index("Pitch")
    pitch_ids = [i for i in range(meta["vocab_size"]) if tt[i] == P]
    groups = {}

    def g(name):
        return groups.setdefault(name, {"nll": [], "t": {}, "pc": []})

    with torch.no_grad():
        for i in range(val.shape[0]):
            w = torch.as_tensor(val[i].astype(np.int64))[None]
            logits = model(w[:, :-1])[0].double()
            probs = logits.softmax(-1)
            for t in range(meta["seq_len"]):
                y = int(val[i][t + 1])
                if y == pad:
                    continue
                nll = -math.log(float(probs[t, y]))
                top1 = float(int(logits[t].argmax()) == y)
                m = int(ctx[i][t])
                for name in ("", meta["val_sources"][i]):
                    a = g(name)
                    a["nll"].append(nll)
                    a["t"].setdefault(types[tt[y]], []).append((nll, top1))
                    if tt[y] == P and m:
                        tot = sum(float(probs[t, p]) for p in pitch_ids)
                        inm = sum(float(probs[t, p]) for p in pitch_ids if m >> pcl[p] & 1)
                        a["pc"].append((inm / tot, float(m >> pcl[y] & 1)))
    out = {}
    for name, a in groups.items():
        out[name] = {
            "loss": float(np.mean(a["nll"])),
            "by_type": {k: {"nll": float(np.mean([x[0] for x in v])), "top1": float(np.mean([x[1] for x in v])),
                            "count": len(v)} for k, v in a["t"].items()},
            "pitch_context": {"model_mass": float(np.mean([x[0] for x in a["pc"]])) if a["pc"] else None,
                              "true_share": float(np.mean([x[1] for x in a["pc"]])) if a["pc"] else None,
                              "count": len(a["pc"])},
        }
    return out


def close(a, b, path):
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            close(a[k], b[k], f"{path}.{k}")
    elif a is None or b is None or isinstance(a, int):
        assert a == b, f"{path}: {a} != {b}"
    else:
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"{path}: {a} != {b}"


def main():
    meta, _, val, ctx = tr.load_probe(sys.argv[1])
    tc = dict(meta["train"], lr=1.0, min_lr=0.1, warmup_steps=10, steps=100)
    assert abs(tr.lr_at(tc, 0) - 0.1) < 1e-12 and abs(tr.lr_at(tc, 9) - 1.0) < 1e-12
    assert abs(tr.lr_at(tc, 10) - 1.0) < 1e-12 and abs(tr.lr_at(tc, 100) - 0.1) < 1e-9
    for kind in ("gpt", "performer"):
        torch.manual_seed(0)
        model = tr.build_model(kind, meta).eval()
        got = tr.evaluate(model, meta, val, ctx, torch.device("cpu"))
        want = naive(model, meta, val, ctx)
        for name, w in want.items():
            r = got if name == "" else got["by_source"][name]
            close({k: r[k] for k in ("loss", "by_type", "pitch_context")}, w, f"{kind}:{name or 'all'}")
        print(f"{kind}: evaluate() matches the naive loop "
              f"(loss {got['loss']:.4f}, pitch_context {got['pitch_context']['count']} targets)")


if __name__ == "__main__":
    main()
