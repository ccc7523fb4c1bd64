#!/usr/bin/env python3
"""The far-copy task (scripts/form/far-copy.py) in plain PyTorch, to ask which feature map of a
linear-attention head can learn to copy from beyond the local window: the model of
scripts/form/far-copy/base.toml (2 layers, d 128, per layer 2 local softmax heads over 128
tokens with RoPE and 2 linear-attention heads, d_ff 512, pre-norm), the linear heads with
  favor   positive orthogonal random features (64, drawn once), q, k scaled by d^-1/4
  taylor  the 2nd-order Taylor map of exp (Based, Arora et al. 2024): q, k projected to 16
          dims, phi(x) = [1, x, vec(x x^T) / sqrt(2)] (273 features), scaled by 16^-1/4
  softmax exact softmax over the whole past (the upper bound)
and no position code in them, or RoPE with --far-rope (on q and k before the
feature map: the rotated Taylor map is then a kernel of the lag, as in softmax). Linear heads are computed in their causal quadratic form (the same
numbers as the recurrence). 2,000 steps of 8 windows of 650 tokens, AdamW lr 1e-3 cosine to
1e-4 (warm-up 50); then the pitch NLL of the second A of OUT/valid's pieces, whole past.

Usage: runs/ref-venv/bin/python scripts/reference/far_copy_features.py DATA --heads taylor
       [--far-rope] [--steps 2000] [--seed 0] [--threads 2]      (DATA: far-copy.py's OUT)"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def load(d):
    idx = json.load(open(os.path.join(d, "pieces.json")))
    toks = np.fromfile(os.path.join(d, "tokens.bin"), dtype="<u2").astype(np.int64)
    return [toks[p["offset"]:p["offset"] + p["len"]] for p in idx]


def rope(x):
    """Rotary positions on (B, H, L, D)."""
    _, _, n, d = x.shape
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(n, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d, heads, local, window, kind, rng, far_rope):
        super().__init__()
        self.h, self.hd, self.local, self.window, self.kind = heads, d // heads, local, window, kind
        self.far_rope = far_rope
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        if kind == "taylor":
            self.fq = nn.Linear(self.hd, 16, bias=False)
            self.fk = nn.Linear(self.hd, 16, bias=False)
        if kind == "favor":
            w = []
            for _ in range(2):  # 64 rows: two orthogonal blocks of 32
                qm, _ = np.linalg.qr(rng.standard_normal((self.hd, self.hd)))
                w.append(qm.T)
            w = np.concatenate(w) * np.linalg.norm(rng.standard_normal((64, self.hd)), axis=1)[:, None]
            self.register_buffer("proj", torch.tensor(w, dtype=torch.float32))

    def phi(self, x, query):
        if self.kind == "favor":
            if self.far_rope:
                x = rope(x)
            x = x * self.hd ** -0.25
            u = x @ self.proj.T - (x * x).sum(-1, keepdim=True) / 2
            if query:
                u = u - u.amax(-1, keepdim=True)
            return u.exp() / math.sqrt(self.proj.shape[0])
        f = (self.fq if query else self.fk)(x)
        if self.far_rope:
            f = rope(f)
        f = f * 16 ** -0.25
        outer = (f[..., :, None] * f[..., None, :]).flatten(-2) / math.sqrt(2)
        return torch.cat([torch.ones_like(f[..., :1]), f, outer], -1)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        i = torch.arange(n)
        causal = i[None, :] <= i[:, None]
        ql, kl, vl = rope(q[:, :self.local]), rope(k[:, :self.local]), v[:, :self.local]
        band = causal & (i[:, None] - i[None, :] < self.window)
        o_local = F.scaled_dot_product_attention(ql, kl, vl, attn_mask=band)
        qf, kf, vf = q[:, self.local:], k[:, self.local:], v[:, self.local:]
        if self.kind == "softmax":
            if self.far_rope:
                qf, kf = rope(qf), rope(kf)
            o_far = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
        else:
            a = (self.phi(qf, True) @ self.phi(kf, False).transpose(-1, -2)) * causal
            o_far = (a @ vf) / (a.sum(-1, keepdim=True) + 1e-6)
        o = torch.cat([o_local, o_far], 1).transpose(1, 2).reshape(b, n, d)
        return self.out(o)


class Model(nn.Module):
    def __init__(self, vocab, kind, rng, far_rope, d=128, layers=2, heads=4, ff=512):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict(dict(
                n1=nn.LayerNorm(d), att=Attention(d, heads, 2, 128, kind, rng, far_rope), n2=nn.LayerNorm(d),
                ff=nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d)))))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = x + blk["att"](blk["n1"](x))
            x = x + blk["ff"](blk["n2"](x))
        return self.head(self.norm(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data")
    ap.add_argument("--heads", choices=["favor", "taylor", "softmax"], required=True)
    ap.add_argument("--far-rope", action="store_true", help="RoPE on the far heads' q and k")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    train, valid = load(os.path.join(a.data, "train")), load(os.path.join(a.data, "valid"))
    vocab = json.load(open(os.path.join(a.data, "train", "manifest.json")))["vocab_size"]
    plen = len(train[0])
    model = Model(vocab, a.heads, rng, a.far_rope)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=0.01)
    t0 = time.time()
    for step in range(1, a.steps + 1):
        lr = 1e-3 * step / 50 if step <= 50 else \
            1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * (step - 50) / (a.steps - 50)))
        for g in opt.param_groups:
            g["lr"] = lr
        rows = rng.integers(0, len(train), 8)
        ids = torch.tensor(np.stack([train[r] for r in rows]))
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0:
            print(f"step {step}: train {loss.item():.4f} ({time.time() - t0:.0f} s)", flush=True)
    # the second A: the 24 pitches before EOS (targets 624..647 of a 650-token piece)
    with torch.no_grad():
        ids = torch.tensor(np.stack(valid))
        logp = F.log_softmax(model(ids[:, :-1]), -1)
        nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
        second_a = nll[:, plen - 2 - 24:plen - 2].mean().item()
    print(json.dumps({"heads": a.heads, "far_rope": a.far_rope, "steps": a.steps, "second_a_nll": round(second_a, 4),
                      "last_train_loss": round(loss.item(), 4),
                      "seconds": round(time.time() - t0)}))


if __name__ == "__main__":
    main()
