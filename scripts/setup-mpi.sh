#!/usr/bin/env bash
# Installs what `--features distributed` needs to build and run: Open MPI (its launcher
# mpirun and its headers and libraries, Debian's openmpi-bin and libopenmpi-dev) and
# libclang (the mpi crate generates its bindings with bindgen), when missing and when
# running as root with apt-get. Quick when they are there.
set -euo pipefail
have_clang() { compgen -G '/usr/lib/llvm-*/lib/libclang*.so*' >/dev/null || compgen -G '/usr/lib/*/libclang*.so*' >/dev/null; }
if command -v mpirun >/dev/null && command -v mpicc >/dev/null && have_clang; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  echo "setup-mpi: installing openmpi-bin libopenmpi-dev libclang-dev" >&2
  apt-get install -y -q openmpi-bin libopenmpi-dev libclang-dev >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q openmpi-bin libopenmpi-dev libclang-dev >/dev/null; }
else
  echo "setup-mpi: Open MPI or libclang missing; install the Debian packages openmpi-bin, libopenmpi-dev and libclang-dev (or your cluster's MPI module and libclang)" >&2
  exit 1
fi
