#!/usr/bin/env bash
# Mobius vs torch gloo vs Open MPI (TCP, and shared memory) vs a plain TCP ring ceiling: allreduce on 2 and 4
# ranks over loopback. Writes target/bench/collective.json (rows: library, op, bytes, world,
# time_us, algbw_gbs, busbw_gbs; nccl-tests definitions), prints the nccl-tests-style table
# and draws target/bench/collective.png (busbw against size, one line per library).
#
#   scripts/bench-collective.sh            the full sweep: 4 KiB … 256 MiB, 3 interleaved rounds
#   scripts/bench-collective.sh --tiny     a smoke run (4 KiB, 64 KiB, 1 MiB; 1 round) that
#                                          checks the pipeline, not the speed
#   scripts/bench-collective.sh --ddp      DDP training steps/s, gloo vs mobius, 2 and 4 ranks
#                                          (tests/collective/bench_ddp.py; target/bench/ddp.json,
#                                          ddp.png)
#   scripts/bench-collective.sh --hosts    hierarchical vs flat ring allreduce on 2 namespace hosts
#                                          x 2 ranks (tests/collective/bench_hosts.py, root;
#                                          target/bench/hier-hosts.json)
#   extra arguments go to tests/collective/bench.py (e.g. --ops allreduce,allgather,
#   --libs mobius,openmpi-sm; openmpi-sm is Open MPI over its shared-memory BTL, mpi over tcp)
#   MOBIUS_* settings in the environment (e.g. MOBIUS_SPIN=500us) reach every Mobius rank and
#   are recorded in collective.json ("mobius_env"); --out DIR keeps one setting's run apart:
#     MOBIUS_SPIN=500us scripts/bench-collective.sh --out target/bench/spin-500us ...
#
# libfabric rows: where scripts/ensure-libfabric.sh has built libfabric, the wheel is built with
# the `ofi` feature and the same interleaved rounds also run Mobius over the libfabric provider
# on libfabric's tcp;ofi_rxm (mobius-ofi-tcp) and shm (mobius-ofi-shm). RDMA_BENCH_OFI=none
# (or --no-ofi first) leaves them out.
#
# Installs what it needs: Open MPI (apt), and a venv with torch, mpi4py, matplotlib (cached in
# ~/.cache/rdma-shuffle/torch-venv); builds the mobius wheel from this tree.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p target/bench
OFI=${RDMA_BENCH_OFI:-auto}
if [ "${1:-}" = "--no-ofi" ]; then
  OFI=none
  shift
fi
ofi_args=()
if [ "$OFI" != none ]; then
  if LIBFABRIC_PREFIX=$(bash scripts/ensure-libfabric.sh --check); then
    export MOBIUS_FEATURES=${MOBIUS_FEATURES:+$MOBIUS_FEATURES,}ofi PKG_CONFIG_PATH=$LIBFABRIC_PREFIX/lib/pkgconfig
    export LD_LIBRARY_PATH=$LIBFABRIC_PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    ofi_args=(--with-ofi)
  else
    echo "bench-collective: libfabric is not built here (scripts/ensure-libfabric.sh): no libfabric rows" >&2
  fi
fi
. tests/collective/env.sh

args=()
if [ "${1:-}" = "--ddp" ]; then
  shift
  exec "$MOBIUS_PY" tests/collective/bench_ddp.py run --out target/bench "$@"
fi
if [ "${1:-}" = "--hosts" ]; then
  shift
  exec "$MOBIUS_PY" tests/collective/bench_hosts.py --out target/bench "$@"
fi
if [ "${1:-}" = "--tiny" ]; then
  shift
  args=(--sizes 4k,64k,1m --iters 5 --warmup 1 --rounds 1)
fi
exec "$MOBIUS_PY" tests/collective/bench.py run --out target/bench "${args[@]}" "${ofi_args[@]}" "$@"
