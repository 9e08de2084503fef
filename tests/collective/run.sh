#!/usr/bin/env bash
# The Mobius suite in real processes: correctness against numpy (every op × dtype × reduce op,
# worlds 1-4, every algorithm forced and the policy's choice, up to 64 MiB), zero-copy numpy and
# torch buffers, the torch.distributed backend and DDP against gloo (2-4 ranks), the c10d
# surface under torch (test_c10d.py: every collective × dtype × op against numpy on 2, 3 and 4
# ranks, one launch per world; asynchronous Works, batch_isend_irecv with receives first, a
# dead peer failing a pending Work), faults (a killed rank, a rank that never joins, mismatched
# arguments), the benchmark pipeline at a tiny size, the published address under every init
# method and subgroups (test_hosts.py, ~1 min), the security cases (test_security.py, ~15 s),
# and three network-namespace hosts of `scripts/cluster.sh net 3` under torchrun, 1 and 2 ranks
# per host, plus a rank killed on one host (test_netns.py, ~2 min; needs root).
#
#   tests/collective/run.sh [pytest args]      e.g. -k ddp, -x
#
# CI runs one representative case of each family; the cases marked `full` (world 3 beside 2 and
# 4, five of the eight faked host layouts, the sdist build, ...) run under RDMA_TEST_FULL=1
# (`scripts/test.sh --full`); conftest.py deselects them otherwise.
#
# Sets up its own Python (tests/collective/env.sh: cached torch venv, mobius wheel built from
# this tree). The Rust side of Mobius is tested by `cargo test -p mobius-collective` and the
# mesh by `cargo test -p mobius-collective --lib mesh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p target
. tests/collective/env.sh
cd tests/collective
exec "$MOBIUS_PY" -m pytest -q "$@"
