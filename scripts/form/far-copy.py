#!/usr/bin/env python3
"""Can a head learn to copy what lies beyond the local heads' reach? A made-up dataset for
that one question, with nothing musical to learn besides: every piece is

    BOS, A (SEG random pitch tokens), F (GAP random pitch tokens), A again, EOS

drawn from ALPHABET pitch tokens of the vocabulary, uniformly and independently. The second A
is predictable only by finding the first one, GAP + SEG tokens back; everything else is
noise (NLL ln(ALPHABET) at best). With the local heads' window below GAP, only the FAVOR+
heads can reach the first A, so `cadenza eval --data OUT/valid --context-cut C
--context-from (1 + SEG + GAP) --context-stride 1` answers it: the NLL of the second A with
the whole past against the same with only the last C tokens (C < GAP: A out of reach).

Usage: python3 scripts/form/far-copy.py VOCAB OUT [--seg 24] [--gap 600] [--alphabet 32]
       [--train 20000] [--valid 64] [--seed 0]
Writes OUT/train and OUT/valid, each a dataset as `cadenza tokenize` writes one (all of
OUT/train's pieces are training pieces for `cadenza train --data`: its validation split
takes 5% of them by name, which is fine: they are all alike). Standard library only."""
import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(__file__))
from importlib import import_module  # noqa: E402

write_dataset = import_module("recall-probe").write_dataset


def piece(rng, pitches, seg, gap):
    """BOS, A, F, A, EOS as token ids."""
    a = [rng.choice(pitches) for _ in range(seg)]
    f = [rng.choice(pitches) for _ in range(gap)]
    return [1] + a + f + a + [2]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("vocab")
    p.add_argument("out")
    p.add_argument("--seg", type=int, default=24)
    p.add_argument("--gap", type=int, default=600)
    p.add_argument("--alphabet", type=int, default=32)
    p.add_argument("--train", type=int, default=20000)
    p.add_argument("--valid", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    vocab = json.load(open(a.vocab))
    names = vocab["tokens"]
    assert names[1] == "BOS" and names[2] == "EOS", "BOS and EOS are ids 1 and 2"
    all_pitches = [i for i, t in enumerate(names) if t.startswith("Pitch_")]
    mid = len(all_pitches) // 2 - a.alphabet // 2
    pitches = all_pitches[mid : mid + a.alphabet]
    if len(pitches) < a.alphabet:
        sys.exit(f"far-copy: the vocabulary has {len(all_pitches)} pitches, not {a.alphabet}")
    manifest = {"format_version": 1, "vocab_hash": vocab["hash"], "vocab_size": len(names),
                "input_bytes": 0}
    rng = random.Random(a.seed)
    for split, n in (("train", a.train), ("valid", a.valid)):
        pieces = [(f"far-copy/{split}/{i:06d}", piece(rng, pitches, a.seg, a.gap))
                  for i in range(n)]
        write_dataset(os.path.join(a.out, split), a.vocab, manifest, pieces)
    print(f"far-copy: {a.train} + {a.valid} pieces of {1 + 2 * a.seg + a.gap + 1} tokens, "
          f"A at 1 and {1 + a.seg + a.gap}, alphabet {a.alphabet} (NLL floor elsewhere "
          f"ln {a.alphabet}) -> {a.out}")


if __name__ == "__main__":
    main()
