#!/usr/bin/env python3
"""Writes a tiny synthetic probe (same format as cadenza's exporter) for smoke tests.

    make_synthetic_probe.py DIR [--steps 6] [--batch 4] [--seq-len 32] [--val-windows 6]

Tokens: Pad, Bos, Eos, Bar, Position x8, Pitch x24 (pitch class = index % 12), Velocity x4.
Only numpy is needed.
"""

import argparse
import json
import os

import numpy as np

TYPES = ["Pad", "Bos", "Eos", "Bar", "Position", "Pitch", "Velocity"]
# stands for cadenza's vocabulary hash (check_context.py writes it into its synthetic dataset)
SYNTHETIC_VOCAB_HASH = "synthetic-vocab-1"


def vocab():
    token_type, pitch_class = [0, 1, 2, 3], [-1, -1, -1, -1]
    token_type += [4] * 8
    pitch_class += [-1] * 8
    token_type += [5] * 24
    pitch_class += [i % 12 for i in range(24)]
    token_type += [6] * 4
    pitch_class += [-1] * 4
    return token_type, pitch_class


def piece(rng, n_bars):
    key = rng.integers(12)
    scale = [(key + s) % 12 for s in (0, 2, 4, 5, 7, 9, 11)]
    out = [1]
    for _ in range(n_bars):
        out.append(3)
        for pos in sorted(rng.choice(8, size=rng.integers(1, 4), replace=False)):
            out += [4 + int(pos), 12 + int(rng.choice(scale)) + 12 * int(rng.integers(2)), 36 + int(rng.integers(4))]
    out.append(2)
    return out


def context_masks(window, token_type, pitch_class, L):
    """mask[t]: pitch classes of the Pitch tokens at input positions <= t whose bar is
    the bar of position t or one of the 4 before it."""
    bar = np.cumsum([token_type[x] == 3 for x in window[:L]])
    masks = np.zeros(L, dtype=np.uint16)
    for t in range(L):
        m = 0
        for j in range(t + 1):
            if token_type[window[j]] == 5 and bar[t] - bar[j] <= 4:
                m |= 1 << pitch_class[window[j]]
        masks[t] = m
    return masks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--val-windows", type=int, default=6)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    token_type, pitch_class = vocab()
    L, B, S, N = a.seq_len, a.batch, a.steps, a.val_windows

    def window(pad_short):
        p = piece(rng, int(rng.integers(2, 12)))
        if len(p) >= L + 1:
            s = int(rng.integers(len(p) - L))
            return p[s:s + L + 1]
        return p + [0] * (L + 1 - len(p)) if pad_short else window(pad_short)

    os.makedirs(a.dir, exist_ok=True)
    train = np.array([window(False) for _ in range(S * B)], dtype="<u4")
    val = np.array([window(True) for _ in range(N)], dtype="<u4")
    ctx = np.stack([context_masks(list(w), token_type, pitch_class, L) for w in val]).astype("<u2")
    train.tofile(os.path.join(a.dir, "train.bin"))
    val.tofile(os.path.join(a.dir, "val.bin"))
    ctx.tofile(os.path.join(a.dir, "val_ctx.bin"))
    meta = {
        "seq_len": L, "batch": B, "steps": S, "vocab_size": len(token_type), "pad_id": 0,
        "types": TYPES, "token_type": token_type, "pitch_class": pitch_class,
        "val_windows": N, "val_sources": [["folk", "jazz"][i % 2] for i in range(N)],
        "vocab_hash": SYNTHETIC_VOCAB_HASH,
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "favor_features": 16},
        "train": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "steps": S, "weight_decay": 0.1,
                  "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 1.0},
    }
    with open(os.path.join(a.dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"synthetic probe: {a.dir} (V={len(token_type)}, L={L}, B={B}, steps={S}, val={N})")


if __name__ == "__main__":
    main()
