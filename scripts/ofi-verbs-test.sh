#!/usr/bin/env bash
# The libfabric provider over `verbs;ofi_rxm` on real kernel RDMA: builds the ofi crate's
# loopback and conformance test binaries against the libfabric that scripts/ensure-libfabric.sh
# caches (verbs provider built in) and runs them in one SoftRoCE VM boot: the loopback's
# `env_provider` case (ordered small sends, fi_read of a registered region as RDMA READs on
# rxe0) and the shuffle conformance suite over the provider (rendezvous blocks by fi_read,
# counted by the engine and by rxe's own hardware counters, printed around each run).
# usage: scripts/ofi-verbs-test.sh [softroce-test.sh options]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust >/dev/null
scripts/softroce-prepare.sh   # the VM cache and rdma-core's headers
apt_install libclang-dev clang pkg-config
LIBFABRIC_PREFIX=$(bash scripts/ensure-libfabric.sh)
export PKG_CONFIG_PATH=$LIBFABRIC_PREFIX/lib/pkgconfig
step "build the ofi test binaries: the loopback test and the provider's conformance suite (libfabric $LIBFABRIC_PREFIX)"
mapfile -t EXES < <(cargo test --locked -p rdma-shuffle-provider-ofi --features libfabric --test loopback --test conformance \
  --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"): print(m["executable"])')
[ ${#EXES[@]} -eq 2 ] || { echo "expected the loopback and conformance test binaries, got: ${EXES[*]}" >&2; exit 1; }
for e in "${EXES[@]}"; do cp "$e" "target/ofi_$(basename "$e" | sed 's/-[0-9a-f]*$//')"; done
step "run them in the SoftRoCE VM over verbs;ofi_rxm"
# The binaries' rpath names $LIBFABRIC_PREFIX/lib: softroce-test.sh copies libfabric.so.1 to
# the same path in the guest, with libibverbs and librdmacm. FI_UNIVERSE_SIZE=64: ofi_rxm
# sizes verbs completion queues for that many peers (default 256 needs more entries than
# rxe's 32767). rxe's packet counters are printed around each run. The conformance suite is
# the shuffle's (testkit) over the provider, its `env` module, with fi_reads counted.
VERBS_ENV='FI_UNIVERSE_SIZE=64 OFI_TEST_PROVIDER="verbs;ofi_rxm"'
RXE='c=/sys/class/infiniband/rxe0/ports/1/hw_counters; rxe() { echo "rxe0 $1: sent_pkts $(cat $c/sent_pkts) rcvd_pkts $(cat $c/rcvd_pkts)"; }'
exec scripts/softroce-test.sh --quiet --timeout 600 --env RUST_BACKTRACE=1 \
  --include target/ofi_loopback --include target/ofi_conformance \
  --include "$LIBFABRIC_PREFIX/bin/fi_info" \
  --run-as fi_info_verbs_rxm '/opt/bin/fi_info -p "verbs;ofi_rxm" -t FI_EP_RDM -c FI_RMA' \
  --run-as ofi_verbs_rxm "$RXE; rxe before; $VERBS_ENV OFI_TEST_NODE=\$SOFTROCE_IPADDR /opt/bin/ofi_loopback --ignored --exact env_provider --nocapture && rxe after" \
  --run-as ofi_verbs_rxm_conformance "$RXE; rxe before; $VERBS_ENV OFI_TEST_DOMAIN=rxe0 RDMA_SHUFFLE_TEST_ADDR=\$SOFTROCE_IPADDR:0 /opt/bin/ofi_conformance --ignored env:: --test-threads=2 --nocapture; rc=\$?; rxe after; exit \$rc" "$@"
