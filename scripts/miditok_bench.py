#!/usr/bin/env python3
"""MidiTok REMI throughput on a list of MIDI files (the baseline of benches/tokenize.rs).

Times ``tokenizer(path)`` (symusic reads the file, MidiTok preprocesses and
tokenizes it) for every file, single-threaded, with options as close as MidiTok
allows to cadenza's default ``RemiConfig``. Files that fail are skipped and
counted. Prints one JSON object on stdout (progress goes to stderr):

    {"miditok": "3.1.0", "symusic": "...", "files": N, "errors": E, "seconds": S,
     "notes": ..., "tokens": ..., "bytes": ..., "first_errors": [...]}

``seconds`` is the sum of the per-file ``tokenizer(path)`` times; counting the
notes of the result (Pitch/PitchDrum tokens) is outside the timed region.

Usage:
    miditok_bench.py --list FILES.txt          # one path per line (what the Rust bench writes)
    miditok_bench.py --corpus DIR [--limit N]  # walk DIR like cadenza's collect_midi_files
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def collect(corpus: Path) -> list[Path]:
    found = []
    for root, _dirs, files in os.walk(corpus):
        for f in files:
            if f.lower().endswith((".mid", ".midi")):
                found.append(Path(root) / f)
    found.sort(key=lambda p: p.parts)
    return found


def spread(files: list[Path], limit: int | None) -> list[Path]:
    """``limit`` files evenly spaced over the sorted list (same rule as the Rust bench)."""
    if limit is None or limit >= len(files):
        return files
    return [files[i * len(files) // limit] for i in range(limit)]


def make_tokenizer():
    import miditok

    config = miditok.TokenizerConfig(
        # MidiTok's pitch range is inclusive: 21..=108 like cadenza's.
        pitch_range=(21, 108),
        # 12 positions per beat; durations on the 1/12 grid up to 12 beats.
        beat_res={(0, 4): 12, (4, 12): 12},
        num_velocities=32,
        special_tokens=["PAD", "BOS", "EOS"],
        use_velocities=True,
        use_chords=False,
        use_rests=False,
        use_tempos=True,
        num_tempos=81,
        tempo_range=(20, 320),
        log_tempos=True,
        use_time_signatures=True,
        # cadenza: numerators 1..=12 over denominators 2, 4, 8.
        time_signature_range={2: (1, 12), 4: (1, 12), 8: (1, 12)},
        use_key_signatures=False,
        use_sustain_pedals=False,
        use_pitch_bends=False,
        use_control_changes=False,
        use_programs=True,
        one_token_stream_for_programs=True,
        program_changes=False,
        use_pitchdrum_tokens=True,
        drums_pitch_range=(27, 88),
        use_pitch_intervals=False,
    )
    return miditok.REMI(config)


def count_notes(seq) -> tuple[int, int]:
    toks = seq.tokens if not isinstance(seq, list) else [t for s in seq for t in s.tokens]
    notes = sum(1 for t in toks if t.startswith(("Pitch_", "PitchDrum_")))
    return notes, len(toks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--list", type=Path, help="file with one MIDI path per line")
    src.add_argument("--corpus", type=Path, help="folder to walk (sorted, recursive)")
    ap.add_argument("--limit", type=int, default=None, help="evenly spaced subset of --corpus")
    ap.add_argument("--progress", type=int, default=1000, help="report every N files (0: never)")
    args = ap.parse_args()

    if args.list:
        files = [Path(l) for l in args.list.read_text().splitlines() if l.strip()]
    else:
        files = spread(collect(args.corpus), args.limit)

    from importlib.metadata import version

    tokenizer = make_tokenizer()
    # Warm up lazily initialised state on the first file (not timed).
    if files:
        try:
            tokenizer(files[0])
        except Exception:  # noqa: BLE001
            pass

    seconds = 0.0
    notes = tokens = nbytes = errors = 0
    first_errors: list[str] = []
    clock = time.perf_counter
    for i, path in enumerate(files, 1):
        nbytes += path.stat().st_size
        t0 = clock()
        try:
            seq = tokenizer(path)
        except Exception as e:  # noqa: BLE001  (any per-file failure is skipped and counted)
            seconds += clock() - t0
            errors += 1
            if len(first_errors) < 5:
                first_errors.append(f"{path}: {type(e).__name__}: {e}")
            continue
        seconds += clock() - t0
        n, t = count_notes(seq)
        notes += n
        tokens += t
        if args.progress and i % args.progress == 0:
            print(
                f"miditok: {i}/{len(files)} files, {seconds:.1f} s, {i / seconds:.0f} files/s",
                file=sys.stderr,
                flush=True,
            )

    print(
        json.dumps(
            {
                "miditok": version("miditok"),
                "symusic": version("symusic"),
                "files": len(files),
                "errors": errors,
                "seconds": seconds,
                "notes": notes,
                "tokens": tokens,
                "bytes": nbytes,
                "vocab": len(tokenizer),
                "first_errors": first_errors,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
