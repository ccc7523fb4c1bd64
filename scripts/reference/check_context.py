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
            rows.append((k, p, types[tt[y]], grp, full, cut))

    def fig(rs):
        n = len(rs)
        return {"positions": n, "full": sum(r[4] for r in rs) / n,
                "cut": {str(c): sum(r[5][c] for r in rs) / n for c in cuts}}

    allf = fig(rows)
    return {
        "from": from_, "stride": stride, "positions": len(rows), "pieces": len({r[0] for r in rows}),
        "full": allf["full"], "cut": allf["cut"], "ratio": {c: v / allf["full"] for c, v in allf["cut"].items()},
        "by_type": {t: fig([r for r in rows if r[2] == t]) for t in {r[2] for r in rows}},
        "by_source": {s: fig([r for r in rows if r[3] == s]) for s in {r[3] for r in rows}},
    }, rows


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
            print(f"{name}, {label}: batched = naive loop ({g['positions']} positions, {g['pieces']} pieces, "
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
                    context_min_len=0, context_max_len=SEQ_LEN, context_max_pieces=0)
        base.update(kw)
        return tr.context_setup(argparse.Namespace(**base), meta)

    assert setup() is not None
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
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.load(open(out))
    g = rep["context_gain"]
    keys = rust_fields("ContextGain") or ["from", "stride", "positions", "pieces", "full", "cut", "ratio",
                                           "by_type", "by_source"]
    fig_keys = rust_fields("GainFigures") or ["positions", "full", "cut"]
    assert sorted(g) == sorted(keys), f"context_gain keys {sorted(g)} != ContextGain's {sorted(keys)}"
    for grp in ("by_type", "by_source"):
        for k, v in g[grp].items():
            assert sorted(v) == sorted(fig_keys), f"{grp}.{k}: keys {sorted(v)}"
    assert g["pieces"] == 5 and set(g["cut"]) == {"8", "16"}
    for c, v in g["cut"].items():
        assert math.isclose(g["ratio"][c], v / g["full"], rel_tol=1e-12)
    assert sum(v["positions"] for v in g["by_type"].values()) == g["positions"]
    assert [w[0] for w in rep["context_data"]["windows"]] == [s for s, _ in windows]
    print(f"train_ref.py --context: report keys = cadenza's ContextGain {keys}; {g['positions']} positions "
          f"of {g['pieces']} pieces, full {g['full']:.4f}, ratios {g['ratio']}")
    print("check_context: all checks passed")


if __name__ == "__main__":
    main()
