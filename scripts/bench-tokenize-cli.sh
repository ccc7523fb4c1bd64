#!/usr/bin/env bash
# Tokenizing a corpus from the command line, start-up included: the wall time
# of `cadenza tokenize CORPUS -o DATASET -j 1` (one thread: read, tokenize,
# write the dataset) against the wall time of a Python process that imports
# MidiTok and tokenizes the same folder with REMI (scripts/miditok_bench.py,
# single-threaded; it writes nothing). Side by side in one run; give it the
# machine alone. Needs the MidiTok venv that scripts/bench-tokenize.sh makes
# (target/miditok-venv).
# Environment: CADENZA_CORPUS [../shared/corpus], MIDITOK_VENV [target/miditok-venv].
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${CADENZA_CORPUS:-../shared/corpus}
py=${MIDITOK_VENV:-target/miditok-venv}/bin/python
[ -x "$py" ] || { echo "no $py: run scripts/bench-tokenize.sh once" >&2; exit 1; }
cargo build --release -q
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
now() { date +%s.%N; }
# Both sides read the files from a warm page cache.
find "$corpus" -type f -exec cat {} + > /dev/null
t0=$(now)
target/release/cadenza tokenize "$corpus" -o "$tmp/ds" -j 1 > "$tmp/cadenza.log" 2>&1
t1=$(now)
"$py" scripts/miditok_bench.py --corpus "$corpus" > "$tmp/miditok.json" 2> "$tmp/miditok.log"
t2=$(now)
python3 - "$t0" "$t1" "$t2" "$tmp/miditok.json" <<'PY'
import json, sys
t0, t1, t2 = map(float, sys.argv[1:4])
m = json.load(open(sys.argv[4]))
c, p = t1 - t0, t2 - t1
print("| tokenizer, whole process | threads | files | wall time (s) |\n|---|---:|---:|---:|")
print(f"| cadenza tokenize (writes the dataset) | 1 | {m['files'] + m['errors']:,} | {c:.2f} |")
print(f"| python + MidiTok {m['miditok']} REMI (tokenizes only) | 1 | {m['files'] + m['errors']:,} | {p:.2f} |")
print(f"\ncadenza is {p / c:.1f}x faster, start-up included "
      f"(MidiTok's own timed calls: {m['seconds']:.2f} s of its {p:.2f} s).")
PY
