#!/usr/bin/env python3
"""Outside reference models trained on exactly cadenza's token data (a "probe").

    train_ref.py --model {gpt,performer} --probe DIR --out FILE.json [--threads 2] [--device cpu]
                 [--epochs E] [--d-model D --layers N --heads H --d-ff F] [--window W]
                 [--context DATASET --context-cut C[,C] [--context-from P] [--context-stride S]
                  [--context-heldout SEED,FRACTION]
                  [--context-min-len N] [--context-max-len N] [--context-max-pieces N]]
                 [--save-weights FILE.pt | --load-weights FILE.pt]

Trains one model on the probe's batches (train.bin, step s = rows [s*B, (s+1)*B)),
then evaluates it on the probe's validation windows and writes a JSON report.
--save-weights keeps the trained weights; --load-weights skips training and scores weights
saved so (the same --model and shape), e.g. a context gain at other positions.
With --context (gpt only), also the context gain of `cadenza eval --context-cut` on the
pieces of a dataset made by `cadenza tokenize`, selected as `cadenza eval` selects them.
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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cadenza_split import U64, is_validation  # noqa: E402  (the held-out split, shared)

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

    def forward(self, idx, offset=0):
        """Logits of `idx` [b, t] placed at absolute positions offset..offset+t-1: `offset`
        an int (every row) or a LongTensor [b] (one offset per row)."""
        t = idx.shape[1]
        rows = self.pos.num_embeddings
        pos = torch.arange(t, device=idx.device)
        if isinstance(offset, torch.Tensor):  # (one sync: the cut windows of evaluation only)
            first, last = (int(offset.min()), int(offset.max()) + t) if offset.numel() else (0, t)
            pos = offset.to(idx.device).view(-1, 1) + pos  # [b, t]
        else:
            first, last = offset, offset + t
            pos = pos + offset
        if first < 0:
            raise ValueError(f"a negative position offset ({first})")
        if last > rows:
            raise ValueError(f"positions up to {last - 1}, but the GPT has {rows} position rows")
        x = self.tok(idx) + self.pos(pos)
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
# Context gain (cadenza's `eval --context-cut`, src/train/eval.rs: context_gain)

DEFAULT_CONTEXT_STRIDE = 16  # eval::DEFAULT_CONTEXT_STRIDE
MAX_CUTS = 16  # eval::MAX_CUTS
CUT_BATCH = 16  # cut windows per forward (cadenza's eval::CUT_BATCH)


def default_context_from(cuts):
    """Twice the largest cut, at least 1,024 (eval::default_context_from)."""
    return max(2 * max(cuts, default=0), 1024)


def check_context(cuts, from_, stride):
    """cadenza's eval::check_context: the sorted distinct cuts and the first scored position,
    or an exit naming what is wrong."""
    cs = sorted(set(cuts))
    if len(cs) > MAX_CUTS:
        sys.exit(f"--context-cut: at most {MAX_CUTS} cuts (got {len(cs)})")
    bad = [c for c in cs if c < 1]
    if bad:
        sys.exit(f"--context-cut {bad[0]}: a cut must be at least 1 token")
    if from_ is None:
        from_ = default_context_from(cs)
    bad = [c for c in cs if c >= from_]
    if bad:
        sys.exit(f"--context-cut {bad[0]}: a cut must be below the first scored position "
                 f"(--context-from {from_}), or it would not cut anything")
    if stride < 1:
        sys.exit(f"--context-stride {stride}: must be at least 1")
    return cs, from_


def load_dataset(d, meta):
    """A dataset folder written by `cadenza tokenize` (cadenza-core's tokenizer/dataset.rs):
    tokens.bin (u16 LE ids, every piece `BOS tokens EOS`, back to back), pieces.json
    ([{source, offset, len, notes}], offset and len in tokens), manifest.json (vocab_hash,
    vocab_size, tokens, ...) and vocab.json (with its hash). Returns [(source, ids)] in
    file order, after checking the vocabulary against the probe's."""
    def read_json(name):
        path = os.path.join(d, name)
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"--context {d}: cannot read {name} ({e}); is it a dataset made by `cadenza tokenize`?")

    manifest, pieces, vocab = read_json("manifest.json"), read_json("pieces.json"), read_json("vocab.json")
    V = meta["vocab_size"]
    if vocab.get("hash") != manifest.get("vocab_hash"):
        sys.exit(f"--context {d}: vocab.json's hash {vocab.get('hash')} differs from the manifest's "
                 f"{manifest.get('vocab_hash')}")
    if manifest.get("vocab_size") != V:
        sys.exit(f"--context {d}: the dataset's vocabulary has {manifest.get('vocab_size')} tokens, the probe's "
                 f"{V}: not the vocabulary the model was trained on (tokenize with the probe's --vocab)")
    want = meta.get("vocab_hash")
    if want is None:
        print(f"note: the probe's meta.json has no vocab_hash; only the vocabulary sizes ({V}) were compared",
              flush=True)
    elif manifest.get("vocab_hash") != want:
        sys.exit(f"--context {d}: the dataset's vocabulary hash {manifest.get('vocab_hash')} differs from the "
                 f"probe's {want}: not the vocabulary the model was trained on (tokenize with the probe's --vocab)")
    tokens = np.fromfile(os.path.join(d, "tokens.bin"), dtype="<u2")
    if tokens.size != manifest["tokens"]:
        sys.exit(f"--context {d}: tokens.bin holds {tokens.size} ids, the manifest says {manifest['tokens']}")
    if tokens.size and int(tokens.max()) >= V:
        sys.exit(f"--context {d}: tokens.bin has id {int(tokens.max())}, outside the vocabulary of {V} tokens")
    out = []
    for p in pieces:
        o, n = p["offset"], p["len"]
        if o + n > tokens.size or n < 2:
            sys.exit(f"--context {d}: piece {p['source']} lies outside tokens.bin")
        out.append((p["source"], tokens[o:o + n].astype(np.int64)))
    return out


def spread(items, n):
    """`n` items spread evenly over `items` (indices i*len/n), all when n is 0 or larger
    (eval::spread)."""
    if n == 0 or n >= len(items):
        return list(items)
    keep = {i * len(items) // n for i in range(n)}
    return [x for i, x in enumerate(items) if i in keep]


def heldout_pieces(pieces, seed, fraction):
    """The validation pieces of cadenza's data::split(ds, seed, fraction) (`cadenza eval` with
    no --data scores them), in dataset order: the pieces is_validation puts there (none when
    fraction is 0); when that takes every piece, the last goes back to training; when it takes
    none, the last piece is validated on (with a single piece: that piece)."""
    val, train = [], []
    for p in pieces:
        (val if fraction > 0.0 and is_validation(p[0], seed, fraction) else train).append(p)
    if not train and val:
        train.append(val.pop())
    if not val and train:
        val.append(train[-1])
    return val


def parse_heldout(v):
    """--context-heldout SEED,FRACTION: the run's train.seed (u64) and train.val_fraction
    (in [0, 0.9), cadenza's config::check_val_fraction)."""
    try:
        seed, fraction = v.split(",")
        seed, fraction = int(seed), float(fraction)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r}: expected SEED,FRACTION (e.g. 0,0.05)")
    if not 0 <= seed <= U64:
        raise argparse.ArgumentTypeError(f"seed {seed}: must be in [0, 2^64)")
    if not 0.0 <= fraction < 0.9:  # NaN refused too
        raise argparse.ArgumentTypeError(f"val_fraction must be a number in [0, 0.9) (got {fraction})")
    return seed, fraction


def context_windows(pieces, min_len, max_len, max_pieces):
    """cadenza eval's selection: the pieces of at least max(min_len, 2) ids, spread over
    max_pieces, each cut to its first max_len + 1 ids (max_len scored positions)."""
    kept = [(s, ids) for s, ids in pieces if len(ids) >= max(min_len, 2)]
    kept = spread(kept, max_pieces)
    return [(s, ids[:max_len + 1]) for s, ids in kept]


def source_group(source):
    """First component of a source path, or "." for a bare name (cadenza's eval::source_group)."""
    parts = [x for x in source.replace("\\", "/").split("/") if x]
    return parts[0] if len(parts) >= 2 else "."


def scored_len(ids, pad):
    """The window as cadenza's score_window forwards it: trailing pad ids dropped."""
    nz = np.nonzero(ids != pad)[0]
    return int(nz[-1]) + 1 if nz.size else 0


def context_jobs(windows, pad, from_, stride):
    """(window k, position p) in cadenza's order: p = max(from, 1), +stride, ... below the
    longest window, each window that reaches p and whose token p is scored (not pad)."""
    longest = max((len(ids) for _, ids in windows), default=0)
    n = [scored_len(ids, pad) for _, ids in windows]
    jobs = []
    for p in range(max(from_, 1), longest, stride):
        for k, (_, ids) in enumerate(windows):
            if p < n[k] and ids[p] != pad:
                jobs.append((k, p))
    return jobs


@torch.no_grad()
def full_nll(model, ids, pad, device):
    """NLL of every token p >= 1 given tokens 0..p-1, one forward of the window (NaN where
    not scored): cadenza's score_window."""
    out = np.full(len(ids), np.nan)
    n = scored_len(ids, pad)
    if n < 2:
        return out
    w = torch.as_tensor(ids[:n], device=device)[None]
    logp = F.log_softmax(model(w[:, :-1]).float(), dim=-1)[0]
    nll = -logp.gather(-1, w[0, 1:, None]).squeeze(-1).double().cpu().numpy()
    for p in range(1, n):
        if ids[p] != pad:
            out[p] = nll[p - 1]
    return out


@torch.no_grad()
def cut_nll(model, windows, jobs, c, device, batch=CUT_BATCH):
    """NLL of token p of window k given only tokens max(0, p-c)..p-1, fed as a fresh window
    at absolute offset max(0, p-c), for every (k, p) of `jobs`; windows of one length are
    batched, each row at its own offset."""
    out = np.empty(len(jobs))
    by_len = {}
    for j, (k, p) in enumerate(jobs):
        by_len.setdefault(min(c, p), []).append(j)
    for n, js in by_len.items():
        for lo in range(0, len(js), batch):
            part = js[lo:lo + batch]
            starts = [jobs[j][1] - n for j in part]
            x = np.stack([windows[jobs[j][0]][1][s:s + n] for j, s in zip(part, starts)])
            y = [int(windows[jobs[j][0]][1][jobs[j][1]]) for j in part]
            x = torch.as_tensor(x, device=device)
            off = torch.as_tensor(starts, device=device)
            logp = F.log_softmax(model(x, off)[:, -1].float(), dim=-1)
            nll = -logp.gather(-1, torch.as_tensor(y, device=device)[:, None]).squeeze(-1)
            out[part] = nll.double().cpu().numpy()
    return out


def bar_copy_distances(ids, bar_id):
    """cadenza's eval::form::bar_copy_distances: per id, how many ids back the nearest earlier
    bar with exactly its bar's ids begins (a bar: its Bar id up to the next), None for none."""
    starts = [i for i, t in enumerate(ids) if int(t) == bar_id]
    out = [None] * len(ids)
    last_seen = {}
    for j, s in enumerate(starts):
        end = starts[j + 1] if j + 1 < len(starts) else len(ids)
        body = tuple(int(t) for t in ids[s + 1:end])
        prev = last_seen.get(body)
        last_seen[body] = s
        out[s:end] = [None if prev is None else s - prev] * (end - s)
    return out


def copy_band(distance, cuts):
    """cadenza's eval::copy_band: the by_copy label of a copy `distance` back among the sorted
    cuts ("copy <= C1 back", "copy C1+1-C2 back" or "copy C2 back" when C2 = C1 + 1, ...,
    "copy > Ck back"), "fresh" for no copy."""
    if distance is None:
        return "fresh"
    below = [c for c in cuts if c < distance]
    if len(below) == len(cuts):
        return f"copy > {cuts[-1]} back"
    c = cuts[len(below)]
    if not below:
        return f"copy <= {c} back"
    low = below[-1] + 1
    return f"copy {c} back" if low == c else f"copy {low}-{c} back"


def gain_report(meta, windows, jobs, full, cuts, from_, stride):
    """The ContextGain of cadenza (src/train/eval.rs) from the per-job NLLs: `full` [jobs],
    cuts {C: [jobs]}."""
    types, token_type = meta["types"], meta["token_type"]

    def figures(sel):
        n = len(sel)
        d = max(n, 1)
        return {"positions": n, "full": float(sum(full[j] for j in sel)) / d,
                "cut": {str(c): float(sum(v[j] for j in sel)) / d for c, v in cuts.items()}}

    bar_id = next(i for i, t in enumerate(token_type) if types[t] == "Bar")
    sorted_cuts = sorted(cuts)
    distances = {}
    groups_t, groups_s, groups_c = {}, {}, {}
    for j, (k, p) in enumerate(jobs):
        groups_t.setdefault(types[token_type[int(windows[k][1][p])]], []).append(j)
        groups_s.setdefault(source_group(windows[k][0]), []).append(j)
        if k not in distances:
            distances[k] = bar_copy_distances(windows[k][1], bar_id)
        groups_c.setdefault(copy_band(distances[k][p], sorted_cuts), []).append(j)
    allf = figures(range(len(jobs)))
    return {
        "from": from_,
        "stride": stride,
        "block": 1,  # one cut window per position: every cut exactly C tokens
        "positions": allf["positions"],
        "pieces": len({k for k, _ in jobs}),
        "full": allf["full"],
        "cut": allf["cut"],
        "ratio": {c: v / allf["full"] for c, v in allf["cut"].items()},  # cut / full, as cadenza
        "by_type": {t: figures(groups_t[t]) for t in sorted(groups_t)},
        "by_source": {s: figures(groups_s[s]) for s in sorted(groups_s)},
        "by_copy": {b: figures(groups_c[b]) for b in sorted(groups_c)},
    }


@torch.no_grad()
def context_gain(model, meta, windows, cuts, from_, stride, device, batch=CUT_BATCH):
    """The context gain of `model` over `windows` [(source, ids)]: the full-pass NLL and,
    for each cut, the NLL with only the last C tokens, at the same positions (see
    context_jobs). `cuts` need not be below `from_` here (check_context refuses that on the
    command line; the self-check uses it)."""
    model.eval()
    pad = meta["pad_id"]
    jobs = context_jobs(windows, pad, from_, stride)
    used = {k for k, _ in jobs}
    per_window = [full_nll(model, ids, pad, device) if k in used else None for k, (_, ids) in enumerate(windows)]
    full = np.array([per_window[k][p] for k, p in jobs])
    cut = {c: cut_nll(model, windows, jobs, c, device, batch) for c in sorted(set(cuts))}
    return gain_report(meta, windows, jobs, full, cut, from_, stride)


def context_setup(args, meta):
    """Everything --context needs, checked before training: (windows, cuts, from, info)."""
    if args.context is None:
        if args.context_cut:
            sys.exit("--context-cut needs --context DATASET")
        if args.context_heldout is not None:
            sys.exit("--context-heldout needs --context DATASET")
        return None
    if args.model != "gpt":
        sys.exit("--context: only --model gpt takes an absolute position offset for the cut windows")
    if not args.context_cut:
        sys.exit("--context needs --context-cut C[,C...]")
    cuts, from_ = check_context(args.context_cut, args.context_from, args.context_stride)
    L = meta["seq_len"]
    max_len = args.context_max_len if args.context_max_len is not None else 2 * L
    if max_len <= 0:
        sys.exit("--context-max-len must be positive")
    if from_ >= max_len:
        sys.exit(f"--context-from {from_}: no position to score below --context-max-len {max_len} "
                 "(raise --context-max-len or lower the cut)")
    pieces = load_dataset(args.context, meta)
    heldout = None
    if args.context_heldout is not None:
        seed, fraction = args.context_heldout
        total = len(pieces)
        pieces = heldout_pieces(pieces, seed, fraction)
        heldout = {"seed": seed, "fraction": fraction, "pieces": len(pieces), "of": total}
        print(f"context gain: --context-heldout {seed},{fraction}: kept the {len(pieces)} of {total} pieces "
              f"of {args.context} in its validation split", flush=True)
    windows = context_windows(pieces, args.context_min_len, max_len, args.context_max_pieces)
    if not windows:
        held = " held-out" if heldout is not None else ""
        sys.exit(f"--context {args.context}: no{held} pieces of at least {max(args.context_min_len, 2)} tokens")
    jobs = context_jobs(windows, meta["pad_id"], from_, args.context_stride)
    if not jobs:
        sys.exit(f"--context {args.context}: no piece reaches position {from_} (--context-from) within "
                 f"--context-max-len {max_len}")
    # the full pass forwards a window's first len-1 ids at positions 0..len-2
    need = max(scored_len(ids, meta["pad_id"]) for _, ids in windows) - 1
    if need > L:
        sys.exit(f"--context: the windows need {need} position rows (--context-max-len {max_len}), but the GPT "
                 f"has the probe's seq_len = {L} learned position rows; pass --context-max-len {L} or less "
                 f"(or export the probe with a longer --seq-len)")
    info = {"dataset": args.context, "heldout": heldout, "min_len": args.context_min_len, "max_len": max_len,
            "max_pieces": args.context_max_pieces, "windows": [[s, len(ids)] for s, ids in windows]}
    print(f"context gain: {len(windows)} windows of {args.context}, {len(jobs)} positions from {from_} "
          f"every {args.context_stride}, cuts {cuts}", flush=True)
    return windows, cuts, from_, info


# ---------------------------------------------------------------------------


def check_weights_paths(save, load, out):
    """The weight files' refusals: not both flags, no file written over one read, a save
    path that is a regular file or nothing, a load path that exists."""
    if save and load:
        sys.exit("--save-weights and --load-weights: one or the other (loaded weights are not trained)")
    if save:
        if os.path.exists(save) and not os.path.isfile(save):
            sys.exit(f"--save-weights {save}: exists and is not a regular file")
        if os.path.abspath(save) == os.path.abspath(out):
            sys.exit(f"--save-weights {save}: the same file as --out")
    if load:
        if not os.path.isfile(load):
            sys.exit(f"--load-weights {load}: no such file")
        if os.path.abspath(load) == os.path.abspath(out):
            sys.exit(f"--load-weights {load}: the same file as --out, which this run writes")


def save_weights(path, kind, meta, model):
    """The model's weights with what they fit: the --model kind and the shape."""
    torch.save({"model": kind, "shape": meta["model"], "vocab_size": meta["vocab_size"],
                "seq_len": meta["seq_len"], "state": model.state_dict()}, path)


def load_weights(path, kind, meta, model):
    """Weights saved by save_weights into `model`, after checking they fit it."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        ok = isinstance(saved, dict) and "state" in saved
    except Exception as e:  # a truncated or foreign file
        sys.exit(f"--load-weights {path}: not weights saved by train_ref.py ({e})")
    if not ok:
        sys.exit(f"--load-weights {path}: not weights saved by train_ref.py")
    want = {"model": kind, "shape": meta["model"], "vocab_size": meta["vocab_size"], "seq_len": meta["seq_len"]}
    for k, v in want.items():
        if saved.get(k) != v:
            sys.exit(f"--load-weights {path}: saved for {k} = {saved.get(k)}, this run has {v}")
    model.load_state_dict(saved["state"])


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
    ap.add_argument("--context", metavar="DATASET",
                    help="gpt: also the context gain (cadenza eval --context-cut) on this dataset's pieces")
    ap.add_argument("--context-cut", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    metavar="C[,C]", help="cuts C (each >= 1 and below --context-from)")
    ap.add_argument("--context-from", type=int,
                    help="first scored position (default: twice the largest cut, at least 1024)")
    ap.add_argument("--context-stride", type=int, default=DEFAULT_CONTEXT_STRIDE,
                    help=f"score every S-th position (default {DEFAULT_CONTEXT_STRIDE})")
    ap.add_argument("--context-heldout", type=parse_heldout, metavar="SEED,FRACTION",
                    help="only the pieces of --context's validation split for this train.seed and "
                         "train.val_fraction (cadenza eval without --data), before the other selection")
    ap.add_argument("--context-min-len", type=int, default=0, help="only pieces at least this long (default 0)")
    ap.add_argument("--context-max-len", type=int,
                    help="positions to score per piece (default: twice the probe's seq_len)")
    ap.add_argument("--context-max-pieces", type=int, default=0,
                    help="at most this many pieces, spread evenly (0 = all, the default)")
    ap.add_argument("--save-weights", metavar="FILE.pt", help="keep the trained weights in this file")
    ap.add_argument("--load-weights", metavar="FILE.pt",
                    help="score these weights (saved by --save-weights, same --model and shape) without training")
    args = ap.parse_args()
    check_weights_paths(args.save_weights, args.load_weights, args.out)

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    meta, train, val, ctx = load_probe(args.probe)
    context = context_setup(args, meta)  # checked before any training
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

    model = build_model(args.model, meta)
    if args.load_weights:
        load_weights(args.load_weights, args.model, meta, model)
        S = 0  # scored as loaded
    model = model.to(device)
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
    if args.save_weights:
        save_weights(args.save_weights, args.model, meta, model)
        print(f"weights -> {args.save_weights}", flush=True)
    ev = evaluate(model, meta, val, ctx, device)
    gain = None
    if context is not None:
        windows, cuts, from_, context_info = context
        t0 = time.perf_counter()
        gain = context_gain(model, meta, windows, cuts, from_, args.context_stride, device)
        context_info["seconds"] = time.perf_counter() - t0
        print("context gain: full {:.4f}, ".format(gain["full"])
              + ", ".join(f"last {c}: {v:.4f} (ratio {gain['ratio'][c]:.4f})" for c, v in gain["cut"].items())
              + f" over {gain['positions']} positions of {gain['pieces']} pieces", flush=True)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    report = {
        "model": args.model,
        "params": params,
        "steps": S,
        "epochs": args.epochs,
        "loaded_weights": args.load_weights,
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
    if gain is not None:
        report["context_gain"] = gain
        report["context_data"] = context_info
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"val loss {ev['loss']:.4f}  tokens/s {tokens_per_s or 0:.0f}  peak RSS {peak_rss_mb:.0f} MB  -> {args.out}",
          flush=True)


if __name__ == "__main__":
    main()
