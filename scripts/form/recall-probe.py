#!/usr/bin/env python3
"""Can the model bring back a tune it heard more than 512 tokens ago? Writes three
datasets of made-up pieces from the held-out folk tunes of a tokenized dataset, each piece
one piece (one BOS ... EOS) made of whole tunes played one after another, the last tune A
beginning just before token AT (default 1,024) and ending the piece:
  far/      A, other tunes F up to AT, A again: A's first hearing is more than 512 tokens back
  near/     F, then A twice: a copy within the local heads' reach
  control/  B (another tune, cut to A's length), F, A: A heard for the first time
The last A begins at the same token in all three, after the same tunes F.
Then `cadenza eval --data DIR/far --context-cut 512 --context-from AT ...` scores the last
A with the whole past and with the last 512 tokens only; with the whole past, far against
control is what the far past is worth when it holds the very tune being played, near
against control what a copy in the local heads' reach is worth.

Usage: python3 scripts/form/recall-probe.py DATASET OUT [--at 1024] [--pieces 60] [--seed 0]
       [--training-pieces N]  (also OUT/train: DATASET and N made-up far pieces of training tunes)
Standard library only."""
import argparse
import array
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cadenza_split import is_validation  # noqa: E402


def write_dataset(out, vocab_path, manifest, pieces):
    """A dataset as `cadenza tokenize` writes one: manifest, piece index, tokens (u16 LE), vocabulary."""
    os.makedirs(out, exist_ok=True)
    tokens = array.array("H")
    index = []
    for name, ids in pieces:
        index.append({"source": name, "offset": len(tokens), "len": len(ids), "notes": 0})
        tokens.extend(ids)
    if sys.byteorder != "little":
        tokens.byteswap()
    with open(os.path.join(out, "tokens.bin"), "wb") as f:
        f.write(tokens.tobytes())
    with open(os.path.join(out, "pieces.json"), "w") as f:
        json.dump(index, f)
    m = dict(manifest, pieces=len(index), tokens=len(tokens), notes=0, files_seen=len(index),
             skipped=[], warnings=[])
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(m, f)
    with open(vocab_path) as src, open(os.path.join(out, "vocab.json"), "w") as dst:
        dst.write(src.read())


def fill(start, others, at, rng):
    """Whole tunes drawn from `others`, in a shuffled order, that fit after `start`
    tokens without passing `at`, until fewer than 48 tokens of room are left."""
    out, n = [], start
    pool = others[:]
    rng.shuffle(pool)
    for ids in pool:
        if n + len(ids) <= at:
            out.extend(ids)
            n += len(ids)
        if at - n < 48:
            break
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("out")
    ap.add_argument("--at", type=int, default=1024)
    ap.add_argument("--pieces", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--training-pieces", type=int, default=0,
                    help="also write OUT/train: DATASET plus this many made-up far pieces of training tunes")
    a = ap.parse_args()
    index = json.load(open(os.path.join(a.dataset, "pieces.json")))
    manifest = json.load(open(os.path.join(a.dataset, "manifest.json")))
    tokens = array.array("H")
    with open(os.path.join(a.dataset, "tokens.bin"), "rb") as f:
        tokens.frombytes(f.read())
    if sys.byteorder != "little":
        tokens.byteswap()
    # every piece's tokens, read once: the held-out tunes below, and OUT/train
    pieces_all = [(p["source"], list(tokens[p["offset"]:p["offset"] + p["len"]])) for p in index]
    folk = [t for s, t in pieces_all if s.startswith("folk/") and is_validation(s, 0, 0.05)]
    # A must lie wholly more than 512 tokens before its second hearing: at most 400 tokens
    tunes = [t for t in folk if 160 <= len(t) <= 400]
    short = [t for t in folk if len(t) <= 300]
    rng = random.Random(a.seed)
    rng.shuffle(tunes)
    chosen = tunes[:a.pieces]
    sets = {"far": [], "near": [], "control": []}
    # each tune without its BOS and EOS, so that every made-up piece is one piece (BOS ...
    # EOS) in which a strain comes back, not tunes strung together: the model learns
    # that nothing before a BOS belongs to the piece after it
    bos, eos = folk[0][0], folk[0][-1]
    body = lambda t: t[1:-1]
    for i, A in enumerate(chosen):
        # B: another tune at least as long as A, cut to A's length, so that the last A
        # begins at the same token in all three pieces
        B = next(t for t in tunes[(i + 1) % len(tunes):] + tunes if t is not A and len(t) >= len(A))
        a_, b_ = body(A), body(B)[:len(A) - 2]
        others = [body(t) for t in short if t is not A]
        F = fill(1 + len(a_), others, a.at, rng)
        sets["far"].append((f"far/{i}", [bos] + a_ + F + a_ + [eos]))
        sets["near"].append((f"near/{i}", [bos] + F + a_ + a_ + [eos]))
        sets["control"].append((f"control/{i}", [bos] + b_ + F + a_ + [eos]))
    if a.training_pieces:
        # a dataset to train on: every piece of DATASET, and made-up "far" pieces of
        # training tunes only (none of the held-out tunes above), so that some training
        # windows ask for a tune heard more than 512 tokens back
        train = [t for s, t in pieces_all if s.startswith("folk/") and not is_validation(s, 0, 0.05)]
        t_tunes = [t for t in train if 160 <= len(t) <= 400]
        t_short = [body(t) for t in train if len(t) <= 300]
        mixed = list(pieces_all)
        for i in range(a.training_pieces):
            A = t_tunes[rng.randrange(len(t_tunes))]
            a_ = body(A)
            F = fill(1 + len(a_), t_short, a.at, rng)
            mixed.append((f"reprise/{i}", [bos] + a_ + F + a_ + [eos]))
        write_dataset(os.path.join(a.out, "train"), os.path.join(a.dataset, "vocab.json"), manifest, mixed)
        made = sum(len(ids) for n, ids in mixed if n.startswith("reprise/"))
        print(f"train: {len(mixed):,} pieces, {a.training_pieces:,} of them made up ({made:,} of "
              f"{sum(len(ids) for _, ids in mixed):,} tokens)")
    for name, pieces in sets.items():
        write_dataset(os.path.join(a.out, name), os.path.join(a.dataset, "vocab.json"), manifest, pieces)
        starts = [len(ids) - len(chosen[i]) + 1 for i, (_, ids) in enumerate(pieces)]
        print(f"{name}: {len(pieces)} pieces, the last tune begins at tokens {min(starts)}-{max(starts)}, "
              f"{sum(len(ids) for _, ids in pieces):,} tokens")


if __name__ == "__main__":
    main()
