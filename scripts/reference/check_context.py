#!/usr/bin/env python3
"""Self-check of train_ref.py's context gain (--context), on tiny synthetic data only
(seconds on one thread):

* a synthetic probe (make_synthetic_probe.py, seq_len 64) and a synthetic dataset folder in
  `cadenza tokenize`'s format (tokens.bin u16 LE, pieces.json, manifest.json, vocab.json);
* the piece selection (min_len, spread over max_pieces, first max_len + 1 ids) against a
  direct transcription of cadenza's eval.rs;
* the batched context gain (cut windows of several offsets in one forward) against a naive
  loop: one forward of the prefix 0..p-1 per scored position for the full figure, one
  forward of tokens p-C..p-1 at offset p-C per position and cut, sums regrouped
  independently, overall, per type and per source;
* a cut C >= p gives the full-pass NLL at every position;
* a GPT with --window W (2 layers) sees n_layers*(W-1)+1 tokens: a cut of that many (or
  more) gives the full-pass NLL, one token fewer does not; the cut windows' absolute offset
  matters (offset 0 gives other NLLs);
* --context-heldout: the port of cadenza's data::is_validation (FNV-1a 64, seeded, top 53
  bits, `<=`) against hashes worked out by hand from src/train/data.rs (and the published
  FNV-1a 64 vectors at seed 0), the special cases of data::split (a single piece, no piece
  or every piece held out, fraction 0), and, when runs/corpus-data-remi-compact is here, the
  known split of the models' dataset (seed 0, 0.05: 19 held-out pieces of >= 2,048 tokens);
* the refusals (another vocabulary, windows longer than the position rows, a cut not below
  --context-from, a zero stride, --model performer), and one end-to-end run of
  train_ref.py --context whose report keys are those of cadenza's ContextGain.

    check_context.py [WORKDIR]      (default: a temporary folder)
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_synthetic_probe as msp  # noqa: E402
import train_ref as tr  # noqa: E402

SEQ_LEN = 64


def write_dataset(d, pieces, vocab_hash, vocab_size):
    """A dataset folder as cadenza-core's DatasetWriter leaves it (the fields train_ref reads,
    plus the rest of the manifest for form)."""
    os.makedirs(d, exist_ok=True)
    flat, index, off = [], [], 0
    for source, ids in pieces:
        flat += ids
        index.append({"source": source, "offset": off, "len": len(ids), "notes": 0})
        off += len(ids)
    np.asarray(flat, dtype="<u2").tofile(os.path.join(d, "tokens.bin"))
    with open(os.path.join(d, "pieces.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(d, "vocab.json"), "w") as f:
        json.dump({"version": 1, "hash": vocab_hash, "size": vocab_size}, f)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump({"format_version": 1, "vocab_hash": vocab_hash, "vocab_size": vocab_size,
                   "pieces": len(pieces), "tokens": off, "notes": 0, "input_bytes": 0,
                   "files_seen": len(pieces), "skipped": [], "warnings": []}, f)


def synthetic_pieces():
    """Pieces of 5 to ~250 ids from three sources; one has an interior Pad id (never in a real
    dataset; its position must be skipped by both implementations)."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(14):
        ids = msp.piece(rng, int(rng.integers(1, 24)))
        src = ["folk/a{}.mid", "jazz/sub/b{}.mid", "c{}.mid"][i % 3].format(i)
        out.append((src, ids))
    ids = msp.piece(rng, 20)
    ids[41] = 0  # a pad target inside the scored range
    out.insert(5, ("folk/padded.mid", ids))
    out.insert(2, ("jazz/short.mid", [1, 2]))
    # bars copied 4 (<= 5), 11 (6-12), and 14, 15, 18, 25 (> 12) ids back, for by_copy
    x, y, z = [3, 4, 20, 36], [3, 5, 21, 37, 6, 22, 38], [3, 7, 23, 39, 8, 24, 36]
    out.append(("folk/copies.mid", [1] + x + x + y + z + y + x + z + x + x + z + [2]))
    return out


def strong_gpt(meta, window=None, seed=0):
    """An untrained GPT with large random weights, so that every token of the past moves the
    prediction (the default 0.02 init is nearly uniform)."""
    torch.manual_seed(seed)
    m = dict(meta, model=dict(meta["model"], window=window))
    model = tr.build_model("gpt", m).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.3)
    return model


def logp_last(model, x, offset):
    with torch.no_grad():
        return torch.log_softmax(model(torch.as_tensor(x)[None], offset)[0, -1].float(), -1)


def naive_gain(model, meta, windows, cuts, from_, stride):
    """Per position, independently: the full figure from a forward of the prefix 0..p-1, the
    cut from a forward of p-C..p-1 at offset p-C; then the means regrouped by hand."""
    pad, types, tt = meta["pad_id"], meta["types"], meta["token_type"]
    rows = []  # (k, p, type, source, full, {C: nll})
    longest = max(len(ids) for _, ids in windows)
    for p in range(max(from_, 1), longest, stride):
        for k, (src, ids) in enumerate(windows):
            ids = [int(x) for x in ids]
            if p >= len(ids) or ids[p] == pad or all(x == pad for x in ids[p:]):
                continue
            y = ids[p]
            full = -float(logp_last(model, ids[:p], 0)[y])
            cut = {}
            for c in cuts:
                s = max(0, p - c)
                cut[c] = -float(logp_last(model, ids[s:p], s)[y])
            grp = src.split("/")[0] if "/" in src.strip("/") else "."
            rows.append((k, p, types[tt[y]], grp, full, cut, naive_band(ids, p, cuts)))

    def fig(rs):
        n = len(rs)
        return {"positions": n, "full": sum(r[4] for r in rs) / n,
                "cut": {str(c): sum(r[5][c] for r in rs) / n for c in cuts}}

    allf = fig(rows)
    return {
        "from": from_, "stride": stride, "block": 1, "positions": len(rows), "pieces": len({r[0] for r in rows}),
        "full": allf["full"], "cut": allf["cut"], "ratio": {c: v / allf["full"] for c, v in allf["cut"].items()},
        "by_type": {t: fig([r for r in rows if r[2] == t]) for t in {r[2] for r in rows}},
        "by_source": {s: fig([r for r in rows if r[3] == s]) for s in {r[3] for r in rows}},
        "by_copy": {b: fig([r for r in rows if r[6] == b]) for b in {r[6] for r in rows}},
    }, rows


def naive_band(ids, p, cuts):
    """The by_copy band of position p, by hand: the bar holding p (from the last Bar id at or
    before p up to the next), then a walk back over every earlier Bar id for the nearest bar
    with the same ids; its distance against the sorted cuts."""
    bar = 3  # make_synthetic_probe's Bar id
    s = max((i for i in range(p + 1) if ids[i] == bar), default=None)
    if s is None:
        return "fresh"
    end = next((i for i in range(s + 1, len(ids)) if ids[i] == bar), len(ids))
    for t in range(s - 1, -1, -1):
        if ids[t] != bar:
            continue
        e = next((i for i in range(t + 1, len(ids)) if ids[i] == bar), len(ids))
        if ids[t + 1:e] == ids[s + 1:end]:
            d = s - t
            cs = sorted(cuts)
            if d > cs[-1]:
                return f"copy > {cs[-1]} back"
            i = next(i for i, c in enumerate(cs) if d <= c)
            lo = cs[i - 1] + 1 if i else None
            return (f"copy <= {cs[i]} back" if lo is None
                    else f"copy {cs[i]} back" if lo == cs[i] else f"copy {lo}-{cs[i]} back")
    return "fresh"


def close(a, b, path, tol):
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            close(a[k], b[k], f"{path}.{k}", tol)
    elif isinstance(a, int) and isinstance(b, int):
        assert a == b, f"{path}: {a} != {b}"
    else:
        assert abs(a - b) <= tol * max(1.0, abs(b)), f"{path}: {a} != {b}"


def max_diff(a, b):
    if isinstance(a, dict):
        return max((max_diff(a[k], b[k]) for k in a), default=0.0)
    return 0.0 if isinstance(a, int) else abs(a - b)


def expect_exit(fn, words, what):
    try:
        fn()
    except SystemExit as e:
        msg = str(e.code)
        assert all(w in msg for w in words), f"{what}: message {msg!r} lacks {words}"
        print(f"  refused ({what}): {msg}")
        return
    raise AssertionError(f"{what}: not refused")


def rust_fields(struct):
    """Field names of a pub struct in cadenza's src/train/eval.rs (None when not found)."""
    path = os.path.join(HERE, "..", "..", "src", "train", "eval.rs")
    if not os.path.exists(path):
        return None
    src = open(path).read()
    m = re.search(r"pub struct " + struct + r" \{(.*?)\n\}", src, re.S)
    return m and re.findall(r"pub (\w+):", m.group(1))


# FNV-1a 64 of cadenza's is_validation, worked out by hand (numpy uint64 arithmetic, the prime
# as 2^40 + 0x1b3, offset basis xor seed * 0x9e3779b97f4a7c15 wrapped to 64 bits), with the
# top 53 bits (h >> 11). At seed 0 this is plain FNV-1a 64: "" is the offset basis, "a" and
# "foobar" the published test vectors 0xaf63dc4c8601ec8c and 0x85944171f73967e8.
FNV_CASES = [  # (source, seed, h)
    ("", 0, 0xCBF29CE484222325),
    ("a", 0, 0xAF63DC4C8601EC8C),
    ("foobar", 0, 0x85944171F73967E8),
    ("ab", 3, 0xF3DE46D65D1BBA39),
    ("folk/x7.mid", 1, 0x21D7BF6EE2D69EE6),
    ("a", (1 << 64) - 1, 0xD85BF04DCDA6095D),  # seed * constant wraps
    ("jazz/\u00e9.mid", 0, 0xCDC81600D77D3E35),  # UTF-8 bytes c3 a9
    ("classical/palestrina/Agnus_II_51_krn.mid", 0, 0xAF52F302B6622729),  # 0.6849: training
    ("classical/palestrina/Gloria_09_krn.mid", 0, 0x03FD53E30508D26B),  # 0.0156: held out at 0.05
    ("classical/palestrina/Gloria_09_krn.mid", 1, 0xBF2377CB87ED09BE),  # 0.7466 at seed 1
    ("classical/trecento/PMFC_04-Si dolce non sono_xml.mid", 0, 0x04FBA0569FE58AF7),  # 0.0195
]


def check_heldout():
    """tr.is_validation / tr.heldout_pieces / tr.parse_heldout against hand-worked values."""
    below = lambda x: float(np.nextafter(x, 0.0))  # noqa: E731
    discriminating = 0
    for src, seed, h in FNV_CASES:
        u = (h >> 11) / float(1 << 53)  # exact: < 2^53 over a power of two
        # `<=`: held out at exactly u, not one ulp below; this pins all 53 top bits of h
        assert tr.is_validation(src, seed, u), f"{src!r} seed {seed}: not held out at its own value {u!r}"
        assert not tr.is_validation(src, seed, below(u)), f"{src!r} seed {seed}: held out below {u!r}"
        # h / 2^64 in float rounds instead of truncating (>> 11) and would fail the first assert here
        discriminating += float(h) / 2.0 ** 64 > u
    assert discriminating >= 5, discriminating
    assert tr.is_validation("classical/palestrina/Gloria_09_krn.mid", 0, 0.05)
    assert not tr.is_validation("classical/palestrina/Gloria_09_krn.mid", 1, 0.05)
    assert not tr.is_validation("classical/palestrina/Agnus_II_51_krn.mid", 0, 0.05)
    # data.rs's test: 2,000 names, seed 3, 0.1 -> 150..250 (by hand: 196)
    n = sum(tr.is_validation(f"folk/x{i}.mid", 3, 0.1) for i in range(2000))
    assert n == 196, n
    print(f"is_validation: {len(FNV_CASES)} hand-worked FNV-1a hashes (seeds 0, 1, 3, 2^64-1; UTF-8) "
          f"pinned by the `<=` boundary ({discriminating} would fail with h / 2^64); folk/x0..1999 "
          f"seed 3, 0.1: {n} held out")

    # data::split's validation set
    P = [(f"g/p{i}.mid", [1, 2]) for i in range(40)]
    for seed, f in ((0, 0.3), (5, 0.05)):
        want = [p for p in P if tr.is_validation(p[0], seed, f)]
        assert 0 < len(want) < len(P), (seed, f, len(want))
        assert tr.heldout_pieces(P, seed, f) == want  # dataset order, nothing else
    hit = next(p for p in P if tr.is_validation(p[0], 0, 0.3))
    miss = next(p for p in P if not tr.is_validation(p[0], 0, 0.3))
    assert tr.heldout_pieces([hit], 0, 0.3) == [hit]  # single piece, held out: trains and validates on it
    assert tr.heldout_pieces([miss], 0, 0.3) == [miss]  # single piece, not held out: the same
    assert tr.heldout_pieces([miss, hit, miss], 0, 0.3) == [hit]
    no_val = [p for p in P if not tr.is_validation(p[0], 0, 0.3)]
    assert tr.heldout_pieces(no_val, 0, 0.3) == [no_val[-1]]  # none held out: the last piece
    assert tr.heldout_pieces(P, 0, 0.0) == [P[-1]]  # fraction 0: nothing held out, the last piece
    assert tr.heldout_pieces(P, 0, 1.0) == P[:-1]  # all held out: the last goes back to training
    assert tr.heldout_pieces([], 0, 0.3) == []
    assert tr.parse_heldout("0,0.05") == (0, 0.05) and tr.parse_heldout("7,0") == (7, 0.0)
    assert tr.parse_heldout(f"{(1 << 64) - 1},0.1")[0] == (1 << 64) - 1
    for bad in ("0", "0,0.05,1", "x,0.05", "0,0.9", "0,-0.1", "0,nan", "-1,0.05", f"{1 << 64},0.05"):
        try:
            tr.parse_heldout(bad)
        except argparse.ArgumentTypeError:
            continue
        raise AssertionError(f"--context-heldout {bad}: not refused")
    print("heldout_pieces: data::split's validation set (dataset order; one piece; none or all held out; "
          "fraction 0); --context-heldout refuses bad SEED,FRACTION")

    # the models' dataset, when it is here (pieces.json only)
    real = os.path.join(HERE, "..", "..", "runs", "corpus-data-remi-compact", "pieces.json")
    if not os.path.exists(real):
        print(f"(no {os.path.normpath(real)}: the known split of the models' dataset is not checked)")
        return
    with open(real) as fh:
        index = [(p["source"], range(p["len"])) for p in json.load(fh)]
    val = tr.heldout_pieces(index, 0, 0.05)
    long = [s for s, ids in val if len(ids) >= 2048]
    by = {}
    for s in long:
        g = "/".join(s.split("/")[:2])
        by[g] = by.get(g, 0) + 1
    want = {"classical/palestrina": 9, "classical/trecento": 6, "folk/oneills1850": 2,
            "classical/beethoven": 1, "classical/monteverdi": 1}
    assert by == want and len(long) == 19, by
    assert "classical/palestrina/Agnus_II_51_krn.mid" not in {s for s, _ in val}
    assert any(s == "classical/palestrina/Agnus_II_51_krn.mid" for s, _ in index)
    print(f"runs/corpus-data-remi-compact, seed 0, 0.05: {len(val)} of {len(index)} pieces held out, "
          f"{len(long)} of >= 2,048 tokens {by}; Agnus_II_51 is a training piece")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", nargs="?")
    a = ap.parse_args()
    torch.set_num_threads(1)
    work = a.workdir or tempfile.mkdtemp(prefix="check-context-")
    probe, data = os.path.join(work, "probe"), os.path.join(work, "data")
    if not os.path.exists(os.path.join(probe, "meta.json")):
        subprocess.run([sys.executable, os.path.join(HERE, "make_synthetic_probe.py"), probe, "--steps", "2",
                        "--seq-len", str(SEQ_LEN), "--val-windows", "2"], check=True)
    meta, _, _, _ = tr.load_probe(probe)
    pieces = synthetic_pieces()
    write_dataset(data, pieces, msp.SYNTHETIC_VOCAB_HASH, meta["vocab_size"])

    # -- the dataset and the selection --------------------------------------------------
    got = tr.load_dataset(data, meta)
    assert [(s, list(ids)) for s, ids in got] == pieces, "load_dataset: pieces differ"
    assert tr.spread(list(range(10)), 3) == [0, 3, 6] and tr.spread(list(range(7)), 0) == list(range(7))
    assert tr.spread(list(range(3)), 5) == [0, 1, 2] and tr.spread(list(range(10)), 4) == [0, 2, 5, 7]
    min_len, max_len, max_pieces = 40, SEQ_LEN, 5
    kept = [p for p in pieces if len(p[1]) >= min_len]
    want = [(s, ids[:max_len + 1]) for i, (s, ids) in enumerate(kept)
            if i in {j * len(kept) // max_pieces for j in range(max_pieces)}]
    windows = tr.context_windows(got, min_len, max_len, max_pieces)
    assert [(s, list(ids)) for s, ids in windows] == want, "context_windows: another selection"
    assert len(windows) == max_pieces
    all_windows = tr.context_windows(got, 0, max_len, 0)  # every piece, the short ones too
    assert len(all_windows) == len(pieces) and all(len(w) <= max_len + 1 for _, w in all_windows)
    print(f"selection: {len(windows)} of {len(kept)} pieces >= {min_len} ids "
          f"({[s for s, _ in windows]}), matches eval.rs's rule")

    check_heldout()

    # -- batched against naive ----------------------------------------------------------
    from_, stride, cuts = 20, 3, [5, 12]
    for window in (None, 4):
        model = strong_gpt(meta, window)
        name = "gpt" if window is None else f"gpt --window {window}"
        for ws, label in ((all_windows, "all pieces"), (windows, "selection")):
            g = tr.context_gain(model, meta, ws, cuts, from_, stride, torch.device("cpu"), batch=3)
            n, rows = naive_gain(model, meta, ws, cuts, from_, stride)
            assert not any(r[1] == 41 and ws[r[0]][0] == "folk/padded.mid" for r in rows)
            close(g, n, f"{name} ({label})", 2e-5)
            bands = {b: f["positions"] for b, f in g["by_copy"].items()}
            print(f"{name}, {label}: batched = naive loop ({g['positions']} positions, {g['pieces']} pieces, "
                  f"copy bands {bands}, "
                  f"max |diff| {max_diff(g, n):.1e}); full {g['full']:.4f}, "
                  + ", ".join(f"cut {c} {v:.4f}" for c, v in g["cut"].items()))

        # cut >= p: the whole past, so the full-pass NLL at every position
        jobs = tr.context_jobs(all_windows, meta["pad_id"], 1, 1)
        full = {k: tr.full_nll(model, ids, meta["pad_id"], torch.device("cpu")) for k, (_, ids) in
                enumerate(all_windows)}
        f = np.array([full[k][p] for k, p in jobs])
        for c in (SEQ_LEN, SEQ_LEN + 7):
            v = tr.cut_nll(model, all_windows, jobs, c, torch.device("cpu"), batch=5)
            d = float(np.abs(v - f).max())
            assert d <= 1e-5, f"{name}: cut {c} >= p differs from the full pass by {d}"
        print(f"{name}: cut >= p equals the full pass at all {len(jobs)} positions (max |diff| {d:.1e})")

        # the receptive field, and the offset
        late = [(k, p) for k, p in jobs if p >= 2 * 12]
        fl = np.array([full[k][p] for k, p in late])
        if window is not None:
            rf = meta["model"]["n_layers"] * (window - 1) + 1
            for c in (rf, rf + 3):
                d = float(np.abs(tr.cut_nll(model, all_windows, late, c, torch.device("cpu")) - fl).max())
                assert d <= 1e-5, f"{name}: cut {c} >= receptive field {rf} differs by {d}"
            d_in = d
            d = float(np.abs(tr.cut_nll(model, all_windows, late, rf - 1, torch.device("cpu")) - fl).max())
            assert d > 1e-3, f"{name}: cut {rf - 1} < receptive field {rf} does not change the NLL ({d})"
            print(f"{name}: receptive field {rf} tokens: cut {rf}, {rf + 3} = full pass (max |diff| "
                  f"{d_in:.1e}); cut {rf - 1} differs (max |diff| {d:.3f})")
        else:
            d = float(np.abs(tr.cut_nll(model, all_windows, late, 12, torch.device("cpu")) - fl).max())
            assert d > 1e-3, f"{name}: cut 12 does not change the NLL ({d})"
            print(f"{name}: cut 12 differs from the full pass (max |diff| {d:.3f})")
        # the same cut windows at offset 0 instead of p-C: other NLLs
        k, p = late[0]
        ids = all_windows[k][1]
        at = -float(logp_last(model, ids[p - 12:p], p - 12)[ids[p]])
        zero = -float(logp_last(model, ids[p - 12:p], 0)[ids[p]])
        assert abs(at - zero) > 1e-3, f"{name}: the offset changes nothing ({at} vs {zero})"
        print(f"{name}: the absolute offset matters (NLL {at:.4f} at p-C, {zero:.4f} at 0)")

    # -- refusals ------------------------------------------------------------------------
    def setup(**kw):
        base = dict(model="gpt", context=data, context_cut=[8], context_from=32, context_stride=4,
                    context_min_len=0, context_max_len=SEQ_LEN, context_max_pieces=0, context_heldout=None)
        base.update(kw)
        return tr.context_setup(argparse.Namespace(**base), meta)

    assert setup() is not None
    assert setup()[3]["heldout"] is None
    # --context-heldout: the held-out pieces, then the same selection
    ws, _, _, info = setup(context_heldout=(0, 0.3), context_min_len=20)
    held = tr.heldout_pieces(got, 0, 0.3)
    assert 0 < len(held) < len(got)
    want = tr.context_windows(held, 20, SEQ_LEN, 0)
    assert [(s, list(ids)) for s, ids in ws] == [(s, list(ids)) for s, ids in want]
    assert info["heldout"] == {"seed": 0, "fraction": 0.3, "pieces": len(held), "of": len(got)}, info["heldout"]
    print(f"context_setup --context-heldout 0,0.3: {len(held)} of {len(got)} pieces held out, "
          f"{len(ws)} windows of >= 20 ids; context_data.heldout = {info['heldout']}")
    expect_exit(lambda: setup(context=None, context_cut=[], context_heldout=(0, 0.05)), ["--context DATASET"],
                "--context-heldout without --context")
    other = os.path.join(work, "data-other")
    write_dataset(other, pieces, "another-hash", meta["vocab_size"])
    expect_exit(lambda: setup(context=other), ["vocabulary hash", "another-hash"], "another vocabulary")
    bigger = os.path.join(work, "data-bigger")
    write_dataset(bigger, pieces, msp.SYNTHETIC_VOCAB_HASH, meta["vocab_size"] + 1)
    expect_exit(lambda: setup(context=bigger), ["tokens"], "another vocabulary size")
    expect_exit(lambda: setup(context_max_len=None), ["position rows", f"--context-max-len {SEQ_LEN}"],
                "windows longer than the position rows (default --context-max-len 2 x seq_len)")
    expect_exit(lambda: setup(context_cut=[32]), ["below the first scored position"], "cut >= from")
    expect_exit(lambda: setup(context_stride=0), ["at least 1"], "stride 0")
    expect_exit(lambda: setup(context_from=SEQ_LEN), ["--context-max-len"], "from >= max_len")
    expect_exit(lambda: setup(model="performer"), ["gpt"], "performer")
    expect_exit(lambda: setup(context_min_len=10 ** 6), ["no pieces"], "no piece long enough")
    no_hash = dict(meta)
    del no_hash["vocab_hash"]
    assert len(tr.load_dataset(data, no_hash)) == len(pieces)  # sizes compared only, with a note
    expect_exit(lambda: tr.load_dataset(bigger, no_hash), ["tokens"], "another size, no hash in the probe")

    # -- end to end ----------------------------------------------------------------------
    out = os.path.join(work, "gpt.json")
    cmd = [sys.executable, os.path.join(HERE, "train_ref.py"), "--model", "gpt", "--probe", probe, "--out", out,
           "--threads", "1", "--window", "8", "--context", data, "--context-cut", "8,16", "--context-from", "32",
           "--context-stride", "4", "--context-min-len", "40", "--context-max-len", str(SEQ_LEN),
           "--context-max-pieces", "5"]
    weights = os.path.join(work, "gpt.pt")
    r = subprocess.run(cmd + ["--save-weights", weights], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.load(open(out))
    g = rep["context_gain"]
    keys = rust_fields("ContextGain") or ["from", "stride", "block", "positions", "pieces", "full", "cut", "ratio",
                                           "by_type", "by_source", "by_copy"]
    fig_keys = rust_fields("GainFigures") or ["positions", "full", "cut"]
    assert sorted(g) == sorted(keys), f"context_gain keys {sorted(g)} != ContextGain's {sorted(keys)}"
    for grp in ("by_type", "by_source", "by_copy"):
        for k, v in g[grp].items():
            assert sorted(v) == sorted(fig_keys), f"{grp}.{k}: keys {sorted(v)}"
        assert sum(v["positions"] for v in g[grp].values()) == g["positions"], grp
    assert g["pieces"] == 5 and set(g["cut"]) == {"8", "16"} and g["block"] == 1
    for c, v in g["cut"].items():
        assert math.isclose(g["ratio"][c], v / g["full"], rel_tol=1e-12)
    assert sum(v["positions"] for v in g["by_type"].values()) == g["positions"]
    assert [w[0] for w in rep["context_data"]["windows"]] == [s for s, _ in windows]
    print(f"train_ref.py --context: report keys = cadenza's ContextGain {keys}; {g['positions']} positions "
          f"of {g['pieces']} pieces, full {g['full']:.4f}, ratios {g['ratio']}")

    # -- saved weights: scored again without training, the same figures ------------------
    out2 = os.path.join(work, "gpt-loaded.json")
    again = [out2 if a == out else a for a in cmd] + ["--load-weights", weights]
    r = subprocess.run(again, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rep2 = json.load(open(out2))
    assert rep2["steps"] == 0 and rep2["loaded_weights"] == weights
    assert math.isclose(rep2["loss"], rep["loss"], rel_tol=1e-9), (rep2["loss"], rep["loss"])
    close(rep2["context_gain"], g, "gpt loaded", 1e-9)
    # the refusals: both flags, another shape, a file that is not weights, writing over --out
    for extra, words, what in (
            (["--save-weights", os.path.join(work, "x.pt")], ["one or the other"], "save and load"),
            (["--d-model", "16"], ["shape"], "another shape"),
    ):
        r = subprocess.run(again + extra, capture_output=True, text=True)
        assert r.returncode != 0 and all(w in r.stderr for w in words), (what, r.stderr[-500:])
        print(f"  refused ({what}): {r.stderr.strip().splitlines()[-1]}")
    junk = os.path.join(work, "junk.pt")
    with open(junk, "w") as f:
        f.write("not weights")
    bad = [a if a != weights else junk for a in again]
    r = subprocess.run(bad, capture_output=True, text=True)
    assert r.returncode != 0 and "not weights saved by train_ref.py" in r.stderr, r.stderr[-500:]
    r = subprocess.run(cmd + ["--save-weights", out], capture_output=True, text=True)
    assert r.returncode != 0 and "the same file as --out" in r.stderr, r.stderr[-500:]
    print(f"train_ref.py --save-weights / --load-weights: the same loss and context gain, refusals named")
    print("check_context: all checks passed")


if __name__ == "__main__":
    main()
