#!/usr/bin/env python3
"""How sharp can a FAVOR+ head attend? One query among N keys (unit directions scaled so that
the query's own key scores a logit q.k/sqrt(d) of G and the others about 0): the weight that
softmax gives that key, against the weight FAVOR+ gives it with M positive orthogonal random
features (the shipped model's map: orthogonal blocks with chi row norms, q and k scaled by
d^-1/4, phi(x) = exp(Wx - |x|^2/2) / sqrt(M)), median and 10-90% over 50 draws.
Copying a tune heard far back needs such a peak among the hundreds of tokens in between.
The Taylor columns give the weight under Based's 2nd-order map (kernel 1 + s + s^2/2, s the
same logit) with the keys' directions drawn in the n dims of its projection; its last row,
"inf", is the limit of ever larger logits, about 1 / (1 + N/n): the squared term bounds the
peak whatever the scale, where softmax's tends to 1.

Usage: python3 scripts/form/favor-sharpness.py [--d 32] [--n 600] [--seed 0]
Needs numpy (the reference venv of scripts/reference/setup.sh has it)."""
import argparse

import numpy as np


def orthogonal_features(rng, m, d):
    """(m, d): orthogonal blocks of d rows, each row rescaled to a chi(d) norm."""
    blocks = []
    for _ in range((m + d - 1) // d):
        qm, _ = np.linalg.qr(rng.standard_normal((d, d)))
        blocks.append(qm.T)
    w = np.concatenate(blocks)[:m]
    norms = np.linalg.norm(rng.standard_normal((m, d)), axis=1)
    return w * norms[:, None]


def phi(x, w):
    return np.exp(x @ w.T - (x * x).sum(-1, keepdims=True) / 2) / np.sqrt(w.shape[0])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d", type=int, default=32)
    p.add_argument("--n", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    trng = np.random.default_rng(a.seed + 1)  # the Taylor keys' own draws: FAVOR+'s stay as before
    ms = [64, 256, 2048]
    ns = [16, 64]
    print(f"one matching key among {a.n}, head width {a.d}")
    print("| logit of the match | softmax weight on it | " + " | ".join(f"FAVOR+ M = {m}" for m in ms)
          + " | " + " | ".join(f"Taylor n = {n}" for n in ns) + " |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in ms + ns) + " |")
    sc = a.d ** -0.25
    for gap in [2, 4, 6, 8, 10]:
        u = rng.standard_normal((a.n, a.d))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        k = u * np.sqrt(gap * np.sqrt(a.d))  # |q| = |k|: the match scores q.k/sqrt(d) = gap
        q = k[0]
        logits = k @ q / np.sqrt(a.d)
        w = np.exp(logits - logits.max())
        row = [f"{gap}", f"{w[0] / w.sum():.3f}"]
        for m in ms:
            est = []
            for _ in range(50):
                f = orthogonal_features(rng, m, a.d)
                s = phi(k * sc, f) @ phi(q[None] * sc, f)[0]
                est.append(s[0] / s.sum())
            row.append(summary(est))
        row += [summary(taylor_weights(trng, a.n, n, gap)) for n in ns]
        print("| " + " | ".join(row) + " |")
    row = ["inf", "1.000"] + ["" for _ in ms]
    row += [summary(taylor_weights(trng, a.n, n, np.inf)) for n in ns]
    print("| " + " | ".join(row) + " |")


def summary(est):
    e = np.array(est)
    return f"{np.median(e):.3f} ({np.percentile(e, 10):.3f}-{np.percentile(e, 90):.3f})"


def taylor_weights(rng, n_keys, n, gap, draws=50):
    """The match's weight under 1 + s + s^2/2, keys' directions uniform in n dims, over draws."""
    out = []
    for _ in range(draws):
        u = rng.standard_normal((n_keys, n))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        cos = u @ u[0]
        if np.isinf(gap):  # the kernel's leading term: s^2/2 = gap^2 cos^2 / 2
            kern = cos * cos
        else:
            s = gap * cos
            kern = 1 + s + s * s / 2
        out.append(kern[0] / kern.sum())
    return out


if __name__ == "__main__":
    main()
