#!/usr/bin/env bash
# The form of unprompted pieces, on enough of them to tell rows apart: N pieces of
# 3,072 tokens (default 64, seed 7, the generate defaults otherwise) from MODEL, their
# form measures against the held-out folk tunes of >= 24 bars, and a summary
# (scripts/form/unprompted_table.py): the bar-similarity curve and its ratio to the
# tunes', split by the pieces' instruments (program 0 alone, as every folk tune of the
# corpus, or others: the choral and chamber music of the classical half), the pieces
# that loop a phrase to the end (L_16 > 0.6) or never repeat one (L_8 < 0.2), and the
# 5-95% range of the mean over 8 pieces (the size of the earlier tables), a 90% interval
# of each ratio (pieces and tunes resampled), and the same measures over the first 32 bars
# of every piece and tune (stats-32.json: the tunes' median length, where the measures of
# a 3,072-token piece, some 200 bars, compare a tune's length with its own). Usage:
#   bash scripts/form/unprompted.sh MODEL OUT [generate flags ...]
# A finished OUT (OUT/stats.json, OUT/stats-32.json) is kept; several OUTs (other
# seeds: SEED=8 ...) are pooled by `python3 scripts/form/unprompted_table.py OUT...`.
# About 2.5 min per 64 pieces on 2 threads (a 2-core AMD EPYC).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release/cadenza}
model=${1:?usage: unprompted.sh MODEL OUT [generate flags]}
out=${2:?usage: unprompted.sh MODEL OUT [generate flags]}
shift 2
folk=${FOLK:-runs/form-stage2/heldout-folk}
[ -d "$folk" ] || { echo "no held-out folk tunes at $folk (scripts/form/heldout-folk.py)" >&2; exit 2; }
if [ ! -f "$out/stats.json" ]; then
    rm -rf "$out/gen"
    mkdir -p "$out/gen"
    "$BIN" generate --model "$model" --tokens 3072 --num-samples "${N:-64}" --seed "${SEED:-7}" \
        --device cpu --threads "${THREADS:-2}" "$@" -o "$out/gen/sample.mid" > "$out/generate.txt"
    "$BIN" stats "$out/gen" --real "$folk" --min-real-bars 24 --json "$out/stats.json" > /dev/null
fi
if [ ! -f "$out/stats-32.json" ]; then
    "$BIN" stats "$out/gen" --real "$folk" --min-real-bars 24 --bars 32 --json "$out/stats-32.json" > /dev/null
fi
python3 scripts/form/unprompted_table.py "$out" | tee "$out/summary.md"
