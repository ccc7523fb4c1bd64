#!/usr/bin/env python3
"""Outside reference models trained on exactly cadenza's token data (a "probe").

    train_ref.py --model {gpt,performer} --probe DIR --out FILE.json [--threads 2] [--device cpu]
                 [--epochs E] [--d-model D --layers N --heads H --d-ff F] [--window W]

Trains one model on the probe's batches (train.bin, step s = rows [s*B, (s+1)*B)),
then evaluates it on the probe's validation windows and writes a JSON report.
The probe format and every metric are described in scripts/reference/README.md.
"""

import argparse
import gzip
import json
import math
import os
import resource
import sys
import time

try:
    import numpy as np
except ImportError:  # bench_sdpa.py uses the model alone (the GPU check has torch only)
    np = None
import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------
# Probe


def load_probe(d):
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    L, B, S = meta["seq_len"], meta["batch"], meta["steps"]
    V = meta["vocab_size"]
    N = meta["val_windows"]
    path = os.path.join(d, "train.bin")
    if os.path.exists(path):
        train = np.memmap(path, dtype="<u4", mode="r")
    else:  # a probe compressed to travel (gzip of train.bin)
        with gzip.open(path + ".gz", "rb") as f:
            train = np.frombuffer(f.read(), dtype="<u4")
    if train.size != S * B * (L + 1):
        sys.exit(f"train.bin has {train.size} ids, meta says {S}*{B}*{L + 1}")
    val = np.fromfile(os.path.join(d, "val.bin"), dtype="<u4")
    if val.size != N * (L + 1):
        sys.exit(f"val.bin has {val.size} ids, meta says {N}*{L + 1}")
    ctx = np.fromfile(os.path.join(d, "val_ctx.bin"), dtype="<u2")
    if ctx.size != N * L:
        sys.exit(f"val_ctx.bin has {ctx.size} values, meta says {N}*{L}")
    if len(meta["token_type"]) != V or len(meta["pitch_class"]) != V:
        sys.exit("meta: token_type / pitch_class must have vocab_size entries")
    if len(meta["val_sources"]) != N:
        sys.exit("meta: val_sources must have val_windows entries")
    hi = max(int(train.max()) if train.size else 0, int(val.max()) if val.size else 0)
    if hi >= V:
        sys.exit(f"token id {hi} >= vocab_size {V}")
    return meta, train.reshape(S * B, L + 1), val.reshape(N, L + 1), ctx.reshape(N, L)


# ---------------------------------------------------------------------------
# Models


class Block(nn.Module):
    def __init__(self, d, h, d_ff, window=None):
        super().__init__()
        self.h = h
        self.window = window  # attend to the last `window` tokens only (None: all)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)  # residual output projection
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, d_ff)
        self.fc2 = nn.Linear(d_ff, d)  # residual output projection

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        if self.window is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            i = torch.arange(t, device=x.device)
            lag = i[:, None] - i[None, :]
            band = (lag >= 0) & (lag < self.window)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2 style: pre-LN, GELU MLP, learned absolute positions, tied embeddings."""

    def __init__(self, V, L, d, n_layers, h, d_ff, window=None):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.pos = nn.Embedding(L, d)
        self.blocks = nn.ModuleList(Block(d, h, d_ff, window) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
        for blk in self.blocks:
            nn.init.normal_(blk.proj.weight, std=0.02 / math.sqrt(2 * n_layers))
            nn.init.normal_(blk.fc2.weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.tok.weight.t()


def build_model(kind, meta):
    m, V, L = meta["model"], meta["vocab_size"], meta["seq_len"]
    d, n_layers, h, d_ff = m["d_model"], m["n_layers"], m["n_heads"], m["d_ff"]
    if d % h:
        sys.exit(f"d_model {d} is not a multiple of n_heads {h}")
    if kind == "gpt":
        return GPT(V, L, d, n_layers, h, d_ff, m.get("window"))
    from performer_pytorch import PerformerLM

    if d_ff % d:
        sys.exit(f"d_ff {d_ff} is not a multiple of d_model {d} (PerformerLM takes ff_mult)")
    return PerformerLM(
        num_tokens=V,
        max_seq_len=L,
        dim=d,
        depth=n_layers,
        heads=h,
        dim_head=d // h,
        causal=True,
        nb_features=m["favor_features"],
        ff_mult=d_ff // d,
        emb_dropout=0.0,
        ff_dropout=0.0,
        attn_dropout=0.0,
    )


# ---------------------------------------------------------------------------
# Optimisation (mirrors cadenza's src/train/{adamw,config}.rs)


def lr_at(tc, step):
    """Linear warm-up, then cosine from lr to min_lr (cadenza's TrainConfig::lr_at)."""
    lr, min_lr, warm, steps = tc["lr"], tc["min_lr"], tc["warmup_steps"], tc["steps"]
    if step < warm:
        return lr * (step + 1) / warm
    span = max(steps - warm, 1)
    t = min((step - warm) / span, 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * t))


def make_optimizer(model, tc):
    """AdamW (decoupled decay p *= 1 - lr*wd); decay on every parameter with ndim >= 2
    except embedding tables (token and position embeddings)."""
    emb = {id(p) for mod in model.modules() if isinstance(mod, nn.Embedding) for p in mod.parameters()}
    decay, no_decay, decay_names = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and id(p) not in emb:
            decay.append(p)
            decay_names.append(name)
        else:
            no_decay.append(p)
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": tc["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr_at(tc, 0),
        betas=(tc["beta1"], tc["beta2"]),
        eps=tc["eps"],
    )
    return opt, decay_names


# ---------------------------------------------------------------------------
# Evaluation


class Acc:
    """Sums for one group of targets (all, or one source folder)."""

    def __init__(self, n_types):
        self.nll = 0.0
        self.count = 0
        self.t_nll = np.zeros(n_types)
        self.t_top1 = np.zeros(n_types)
        self.t_count = np.zeros(n_types, dtype=np.int64)
        self.pc_mass = 0.0
        self.pc_true = 0.0
        self.pc_count = 0

    def add(self, nll, top1, typ, pc_sel, pc_mass, pc_true, n_types):
        self.nll += float(nll.sum())
        self.count += int(nll.size)
        self.t_nll += np.bincount(typ, weights=nll, minlength=n_types)
        self.t_top1 += np.bincount(typ, weights=top1, minlength=n_types)
        self.t_count += np.bincount(typ, minlength=n_types)
        self.pc_mass += float(pc_mass[pc_sel].sum())
        self.pc_true += float(pc_true[pc_sel].sum())
        self.pc_count += int(pc_sel.sum())

    def report(self, types):
        by_type = {}
        for i, name in enumerate(types):
            c = int(self.t_count[i])
            if c:
                by_type[name] = {"nll": self.t_nll[i] / c, "top1": self.t_top1[i] / c, "count": c}
        n = self.pc_count
        return {
            "loss": self.nll / self.count if self.count else None,
            "count": self.count,
            "by_type": by_type,
            "pitch_context": {
                "model_mass": self.pc_mass / n if n else None,
                "true_share": self.pc_true / n if n else None,
                "count": n,
            },
        }


@torch.no_grad()
def evaluate(model, meta, val, ctx, device):
    model.eval()
    types = meta["types"]
    n_types = len(types)
    pad = meta["pad_id"]
    token_type = np.asarray(meta["token_type"], dtype=np.int64)
    pitch_class = np.asarray(meta["pitch_class"], dtype=np.int64)
    pitch_type = types.index("Pitch")
    pitch_ids = np.nonzero(token_type == pitch_type)[0]
    if (pitch_class[pitch_ids] < 0).any():
        sys.exit("meta: a Pitch token has pitch_class -1")
    pitch_ids_t = torch.as_tensor(pitch_ids, device=device)
    pc_t = torch.as_tensor(pitch_class[pitch_ids], device=device)
    sources = meta["val_sources"]
    total = Acc(n_types)
    per_source = {s: Acc(n_types) for s in dict.fromkeys(sources)}
    B = meta["batch"]
    for lo in range(0, val.shape[0], B):
        w = torch.as_tensor(val[lo:lo + B].astype(np.int64), device=device)
        inp, tgt = w[:, :-1], w[:, 1:]
        logits = model(inp).float()
        logp = F.log_softmax(logits, dim=-1)
        nll = -logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        top1 = (logits.argmax(-1) == tgt).double()
        # pitch context: probability mass on the Pitch tokens whose class is in the mask
        m = torch.as_tensor(ctx[lo:lo + B].astype(np.int64), device=device)
        p_pitch = logp[:, :, pitch_ids_t].exp().double()  # [b, L, |P|]
        bits = ((m.unsqueeze(-1) >> pc_t) & 1).double()
        mass = (p_pitch * bits).sum(-1) / p_pitch.sum(-1).clamp_min(1e-300)
        tgt_np = tgt.cpu().numpy()
        tgt_pc = np.where(pitch_class[tgt_np] >= 0, pitch_class[tgt_np], 0)
        m_np = m.cpu().numpy()
        true_bit = ((m_np >> tgt_pc) & 1).astype(np.float64)
        typ = token_type[tgt_np]
        valid = tgt_np != pad
        pc_sel_all = valid & (typ == pitch_type) & (m_np != 0)
        nll_np, top1_np, mass_np = nll.double().cpu().numpy(), top1.cpu().numpy(), mass.cpu().numpy()
        for r in range(tgt_np.shape[0]):
            v = valid[r]
            args = (nll_np[r][v], top1_np[r][v], typ[r][v], pc_sel_all[r][v], mass_np[r][v], true_bit[r][v], n_types)
            total.add(*args)
            per_source[sources[lo + r]].add(*args)
    out = total.report(types)
    out["by_source"] = {s: a.report(types) for s, a in per_source.items()}
    return out


# ---------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["gpt", "performer"], required=True)
    ap.add_argument("--probe", required=True, help="probe folder written by cadenza")
    ap.add_argument("--out", required=True, help="JSON report to write")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu)")
    ap.add_argument("--epochs", type=int, default=1,
                    help="passes over the probe's batches, one schedule over all of them (default 1)")
    for name in ("d-model", "layers", "heads", "d-ff"):
        ap.add_argument(f"--{name}", type=int, help="another shape than the probe's")
    ap.add_argument("--window", type=int, help="gpt: softmax over the last W tokens only")
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    meta, train, val, ctx = load_probe(args.probe)
    tc = meta["train"]
    L, B, S, pad = meta["seq_len"], meta["batch"], meta["steps"], meta["pad_id"]
    if tc["steps"] != S:
        print(f"note: meta.train.steps {tc['steps']} != meta.steps {S}; "
              f"training {S} steps, schedule over {tc['steps']}", flush=True)
    batches = S
    if args.epochs > 1:
        tc = dict(tc, steps=tc["steps"] * args.epochs)
        S = S * args.epochs
    for key, name in (("d_model", "d_model"), ("n_layers", "layers"), ("n_heads", "heads"), ("d_ff", "d_ff"),
                      ("window", "window")):
        if getattr(args, name) is not None:
            meta["model"][key] = getattr(args, name)

    model = build_model(args.model, meta).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt, decay_names = make_optimizer(model, tc)
    # torch's CUDA wheel alone puts some hundreds of MB in RSS; report it so it can be subtracted.
    rss_before_train_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(f"{args.model}: {params} parameters, {len(decay_names)} decayed tensors; "
          f"{S} steps x {B} x {L} tokens, threads {args.threads}", flush=True)

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    model.train()
    curve = []
    train_seconds = 0.0
    loss_v = float("nan")
    for step in range(S):
        b0 = (step % batches) * B
        rows = torch.as_tensor(train[b0:b0 + B].astype(np.int64), device=device)
        inp, tgt = rows[:, :-1], rows[:, 1:]
        lr = lr_at(tc, step)
        for g in opt.param_groups:
            g["lr"] = lr
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(inp)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1), ignore_index=pad)
        loss.backward()
        if tc["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc["grad_clip"])
        opt.step()
        sync()
        train_seconds += time.perf_counter() - t0
        loss_v = loss.item()
        if not math.isfinite(loss_v):
            sys.exit(f"training diverged at step {step} (loss {loss_v})")
        if step % 10 == 0 or step == S - 1:
            curve.append([step, loss_v])
            print(f"step {step:6d}  loss {loss_v:.4f}  lr {lr:.3e}  "
                  f"tok/s {(step + 1) * B * L / train_seconds:.0f}", flush=True)

    tokens_per_s = S * B * L / train_seconds if train_seconds > 0 else None
    ev = evaluate(model, meta, val, ctx, device)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    report = {
        "model": args.model,
        "params": params,
        "steps": S,
        "epochs": args.epochs,
        "shape": meta["model"],
        "batch": B,
        "seq_len": L,
        "threads": args.threads,
        "device": str(device),
        "torch": torch.__version__,
        "train_seconds": train_seconds,
        "tokens_per_s": tokens_per_s,
        "peak_rss_mb": peak_rss_mb,
        "rss_before_train_mb": rss_before_train_mb,
        "loss": ev["loss"],
        "count": ev["count"],
        "by_type": ev["by_type"],
        "pitch_context": ev["pitch_context"],
        "by_source": ev["by_source"],
        "train_curve": curve,
        "final_train_loss": loss_v,
        "decayed_params": decay_names,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"val loss {ev['loss']:.4f}  tokens/s {tokens_per_s:.0f}  peak RSS {peak_rss_mb:.0f} MB  -> {args.out}",
          flush=True)


if __name__ == "__main__":
    main()
