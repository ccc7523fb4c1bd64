#!/usr/bin/env bash
# Installs libtorch (torch==2.13.0 from PyPI, the exact version tch 0.26 links
# against) into a project-local virtual environment and points `.libtorch` at it.
# Idempotent: returns in about a second when everything is in place.
#   - no NVIDIA GPU: the slim CPU-only install (about 1.2 GB);
#   - an NVIDIA GPU (nvidia-smi works): the full CUDA install.
# Override the choice with CADENZA_TORCH=cpu|cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
VENV=.venv
want=${CADENZA_TORCH:-}
if [ -z "$want" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then want=cuda; else want=cpu; fi
fi
stamp="$VENV/.cadenza-torch-$TORCH_VERSION-$want"
if [ -f "$stamp" ] && [ -e .libtorch/lib/libtorch_cpu.so ]; then
  exit 0
fi
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-libtorch: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
echo "setup-libtorch: installing torch==$TORCH_VERSION ($want) into $VENV" >&2
if [ "$want" = cuda ]; then
  "$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION"
else
  "$VENV/bin/python" -m pip install --quiet --no-deps "torch==$TORCH_VERSION" \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
fi
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ln -sfn "$site/torch" .libtorch
rm -f "$VENV"/.cadenza-torch-*
touch "$stamp"
echo "setup-libtorch: libtorch ready at $(readlink .libtorch)" >&2
