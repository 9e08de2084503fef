#!/usr/bin/env bash
# The verbs test suite on real kernel RDMA: builds the verbs-enabled test binaries on the host
# and runs them in one SoftRoCE VM boot (rxe0 for the conformance suite and the engine tests
# — 32 peers on one shared receive queue, a receiver overrun, 64 READs in flight, the flush
# of READs of a failed connection — and rxe_a <-> rxe_b on a veth pair for the cross-device
# test). `scripts/softroce-test.sh` with no arguments runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust >/dev/null
scripts/softroce-prepare.sh   # also installs libibverbs-dev, clang (rdma-sys build deps)
step "build verbs test binaries"
executables() { # the test executables a `cargo test --no-run` builds
  cargo test "$@" --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"): print(m["executable"])'
}
mapfile -t EXES < <(executables -p rdma-shuffle-provider-verbs --features ibverbs --test conformance --test verbs_cross_device --test verbs_engine)
[ ${#EXES[@]} -eq 3 ] || { echo "expected 3 test binaries, got: ${EXES[*]}" >&2; exit 1; }
mapfile -t MOBIUS < <(executables -p mobius-collective --features verbs --test verbs)
[ ${#MOBIUS[@]} -eq 1 ] || { echo "expected the mobius verbs test binary, got: ${MOBIUS[*]}" >&2; exit 1; }
ARGS=()
for e in "${EXES[@]}"; do
  name=$(basename "$e" | sed 's/-[0-9a-f]*$//')
  [ "$name" = conformance ] && name=suite_verbs   # the provider's conformance suite (testkit)
  cp "$e" "target/$name"
  ARGS+=(--include "target/$name")
done
cp "${MOBIUS[0]}" target/mobius_verbs
ARGS+=(--include target/mobius_verbs)
step "run them in the SoftRoCE VM"
# RDMA_TEST_FULL=1 (scripts/test.sh --full) runs every algorithm of the Mobius matrix, not CI's three.
exec scripts/softroce-test.sh --veth --quiet --timeout 600 --env RUST_BACKTRACE=1 ${RDMA_TEST_FULL:+--env RDMA_TEST_FULL} "${ARGS[@]}" \
  --run-as verbs_suite '/opt/bin/suite_verbs --test-threads=2' \
  --run-as verbs_cross_device '/opt/bin/verbs_cross_device --test-threads=1' \
  --run-as verbs_engine '/opt/bin/verbs_engine --test-threads=1 --nocapture' \
  --run-as mobius_verbs '/opt/bin/mobius_verbs --test-threads=1 --nocapture' "$@"
