#!/usr/bin/env bash
# How the sampling settings move the strain return and the rest of the continuation
# figures (key, density, range, repeated notes), and the form of unprompted pieces:
# one model, several (temperature, top-p) pairs, the same 60 held-out folk tunes and
# seeds as scripts/form-eval.sh. Then: python3 scripts/form/sweep_table.py OUT.
#   bash scripts/form/sampling-sweep.sh MODEL OUT [T:P ...]
# Default pairs: 1:0.95 (generate's default) 1:0.9 1:0.8 0.9:0.95 0.8:0.95 0.7:0.95.
# UNPROMPTED="1:0.95 0.8:0.95" also generates 8 unprompted pieces of 3,072 tokens per
# pair (seed 7) and measures their form against the held-out folk tunes.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release/cadenza}
model=${1:?usage: sampling-sweep.sh MODEL OUT [T:P ...]}
out=${2:?usage: sampling-sweep.sh MODEL OUT [T:P ...]}
shift 2
pairs=("$@")
[ ${#pairs[@]} -gt 0 ] || pairs=(1:0.95 1:0.9 1:0.8 0.9:0.95 0.8:0.95 0.7:0.95)
folk=${FOLK:-runs/form-scratch/heldout-folk}
[ -d "$folk" ] || { echo "no held-out folk tunes at $folk (scripts/form/heldout-folk.py)" >&2; exit 2; }
mkdir -p "$out"
common=(--device cpu --threads "${THREADS:-2}")
for pair in "${pairs[@]}"; do
    t=${pair%%:*}
    p=${pair##*:}
    json=$out/cont-t$t-p$p.json
    [ -f "$json" ] && continue # a report already written is kept
    echo "== continue-eval T = $t, top-p = $p"
    "$BIN" continue-eval --model "$model" --data "$folk" --prompt-bars 8 --bars 8 --pieces 60 \
        --temperature "$t" --top-p "$p" "${common[@]}" --json "$json" > /dev/null
done
for pair in ${UNPROMPTED:-}; do
    t=${pair%%:*}
    p=${pair##*:}
    json=$out/stats-t$t-p$p.json
    [ -f "$json" ] && continue
    echo "== 8 unprompted pieces, T = $t, top-p = $p"
    gen=$out/gen-t$t-p$p
    rm -rf "$gen"
    mkdir -p "$gen"
    "$BIN" generate --model "$model" --tokens 3072 --num-samples 8 --seed 7 \
        --temperature "$t" --top-p "$p" "${common[@]}" -o "$gen/sample.mid" > /dev/null
    "$BIN" stats "$gen" --real "$folk" --min-real-bars 24 --json "$json" > /dev/null
done
