#!/usr/bin/env bash
# Tokenizer throughput: cadenza REMI+ (1 thread, all cores) against MidiTok REMI
# (1 thread) on the same MIDI files, printed as one markdown table.
#
# Makes a throwaway virtual environment with MidiTok (target/miditok-venv by
# default, ignored by git) on first use, then runs `cargo bench --bench tokenize`
# with CADENZA_MIDITOK_PYTHON pointing at it; the Rust bench writes the file list
# and runs scripts/miditok_bench.py on it itself.
#
# Environment (defaults in brackets):
#   CADENZA_CORPUS       [../shared/corpus]  corpus folder
#   CADENZA_BENCH_FILES  [all]               evenly spaced subset of this many files
#   CADENZA_BENCH_REPEAT [3]                 cadenza rows: fastest of this many runs
#   MIDITOK_VENV         [target/miditok-venv]
#   MIDITOK_VERSION      [3.1]               pip spec used: miditok==$MIDITOK_VERSION.*
#   PYTHON               [python3]           interpreter that makes the venv
#
# Example: CADENZA_BENCH_FILES=2000 bash scripts/bench-tokenize.sh
set -euo pipefail

cd "$(dirname "$0")/.."

venv=${MIDITOK_VENV:-target/miditok-venv}
want=${MIDITOK_VERSION:-3.1}
python=${PYTHON:-python3}

has_miditok() {
    "$venv/bin/python" - "$want" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
import miditok, symusic  # noqa: F401
v = version("miditok")
sys.exit(0 if v == sys.argv[1] or v.startswith(sys.argv[1] + ".") else 1)
EOF
}

if ! has_miditok; then
    echo "bench-tokenize: installing miditok==$want.* into $venv" >&2
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "miditok==$want.*"
    has_miditok || { echo "bench-tokenize: miditok $want not importable from $venv" >&2; exit 1; }
fi

CADENZA_MIDITOK_PYTHON="$(cd "$venv/bin" && pwd)/python"
export CADENZA_MIDITOK_PYTHON
exec cargo bench --bench tokenize "$@"
