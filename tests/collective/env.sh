#!/usr/bin/env bash
# Source this (`. tests/collective/env.sh`) to get a Python that can import `mobius` and torch.
#
# * The venv lives in ~/.cache/rdma-shuffle/torch-venv (torch from PyPI is ~5 GB with its
#   CUDA wheels; created once and reused, by every worktree and by CI's cache).
#   Override with MOBIUS_VENV.
# * The `mobius` wheel (abi3, maturin) is built from this tree into target/wheels and
#   unpacked into target/mobius-py, which goes first on PYTHONPATH, so two checkouts sharing
#   the venv never see each other's build.
# * MOBIUS_SKIP_BUILD=1 reuses target/mobius-py as it is.
# * MOBIUS_FEATURES=ofi (or verbs) builds that provider in; ofi needs PKG_CONFIG_PATH at
#   scripts/ensure-libfabric.sh's prefix to build and LD_LIBRARY_PATH=<prefix>/lib to run.
#
# Exports: MOBIUS_PY (the interpreter), PYTHONPATH, PATH (venv bin first).

_mobius_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MOBIUS_VENV="${MOBIUS_VENV:-$HOME/.cache/rdma-shuffle/torch-venv}"
_mobius_lock="$HOME/.cache/rdma-shuffle/torch-venv.lock"
mkdir -p "$(dirname "$MOBIUS_VENV")"

_mobius_need='import torch, numpy, pytest, maturin, matplotlib, mpi4py, pytest_timeout'
if ! "$MOBIUS_VENV/bin/python" -c "$_mobius_need" 2>/dev/null; then
  (
    flock 9
    if ! command -v mpicc >/dev/null 2>&1; then
      echo "mobius env: installing Open MPI (Debian) for mpi4py and the benchmark" >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin libopenmpi-dev >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin libopenmpi-dev >/dev/null; }
    fi
    if [ ! -x "$MOBIUS_VENV/bin/python" ]; then
      echo "mobius env: creating $MOBIUS_VENV" >&2
      "${PYTHON:-python3}" -m venv "$MOBIUS_VENV"
    fi
    if ! "$MOBIUS_VENV/bin/python" -c "$_mobius_need" 2>/dev/null; then
      echo "mobius env: installing torch, numpy, pytest, maturin, matplotlib, mpi4py (~5.5 GB, once)" >&2
      "$MOBIUS_VENV/bin/pip" install -q --disable-pip-version-check \
        torch numpy pytest pytest-timeout "maturin>=1.5,<2" matplotlib mpi4py
    fi
  ) 9>"$_mobius_lock" || { echo "mobius env: setting up $MOBIUS_VENV failed" >&2; return 1 2>/dev/null || exit 1; }
fi

MOBIUS_PY="$MOBIUS_VENV/bin/python"
export MOBIUS_PY
export PATH="$MOBIUS_VENV/bin:$PATH"

if [ "${MOBIUS_SKIP_BUILD:-0}" != 1 ] || [ ! -d "$_mobius_root/target/mobius-py/mobius" ]; then
  echo "mobius env: building the mobius wheel (maturin, release)" >&2
  mkdir -p "$_mobius_root/target"   # a fresh checkout has none; the build log goes there
  rm -rf "$_mobius_root/target/wheels/mobius"[-_]*.whl
  # A wheel with a provider feature (verbs, ofi) links that provider's system library; it is
  # built for this machine, so maturin leaves the libraries where they are (no auditwheel
  # repair, which would copy them in and bind whatever libfabric.so.1 the loader finds first).
  (cd "$_mobius_root" && "$MOBIUS_VENV/bin/maturin" build --release ${MOBIUS_FEATURES:+--features "$MOBIUS_FEATURES" --auditwheel skip} \
      -m crates/collective-py/Cargo.toml -o target/wheels -i "$MOBIUS_PY" >target/mobius-wheel.log 2>&1) \
    || { tail -n 40 "$_mobius_root/target/mobius-wheel.log" >&2; echo "mobius env: wheel build failed" >&2; return 1 2>/dev/null || exit 1; }
  rm -rf "$_mobius_root/target/mobius-py"
  "$MOBIUS_PY" -m pip install -q --disable-pip-version-check --no-deps --target "$_mobius_root/target/mobius-py" \
    "$_mobius_root"/target/wheels/mobius_collective-*.whl
fi
export PYTHONPATH="$_mobius_root/target/mobius-py${PYTHONPATH:+:$PYTHONPATH}"
unset _mobius_root _mobius_lock _mobius_need
