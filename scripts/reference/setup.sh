#!/usr/bin/env bash
# Creates the Python venv for the outside reference models (scripts/reference/).
# Path: ${REF_VENV:-runs/ref-venv}, relative to the repository root (runs/ is git-ignored).
# Idempotent: a stamp file records the pinned set; when it matches, nothing is done.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
VENV="${REF_VENV:-runs/ref-venv}"
PYTHON="${PYTHON:-python3}"

PINS=(torch==2.13.0 performer-pytorch==1.1.4 local-attention==1.4.4 numpy)
STAMP="$VENV/.cadenza-ref-stamp"
WANT="${PINS[*]}"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] \
   && "$VENV/bin/python" -c 'import torch, performer_pytorch, numpy' 2>/dev/null; then
    echo "reference venv ready: $VENV"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install "${PINS[@]}"
"$VENV/bin/python" -c 'import torch, performer_pytorch, local_attention, numpy; print("torch", torch.__version__)'
echo "$WANT" > "$STAMP"
echo "reference venv ready: $VENV"
