#!/usr/bin/env bash
# The libfabric provider over `verbs;ofi_rxm` on real kernel RDMA: builds the ofi crate's
# loopback test binary against the libfabric that scripts/ensure-libfabric.sh caches (verbs
# provider built in) and runs its `env_provider` case in one SoftRoCE VM boot: ordered small
# sends, and fi_read of a registered region as RDMA READs on rxe0, counted by the endpoint
# (ofi_reads) and by rxe's own hardware counters, printed after the run.
# usage: scripts/ofi-verbs-test.sh [softroce-test.sh options]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust >/dev/null
scripts/softroce-prepare.sh   # the VM cache and rdma-core's headers
apt_install libclang-dev clang pkg-config
LIBFABRIC_PREFIX=$(bash scripts/ensure-libfabric.sh)
export PKG_CONFIG_PATH=$LIBFABRIC_PREFIX/lib/pkgconfig
step "build the ofi loopback test binary (libfabric $LIBFABRIC_PREFIX)"
exe=$(cargo test --locked -p rdma-shuffle-provider-ofi --features libfabric --test loopback --no-run \
  --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"): print(m["executable"])')
[ -n "$exe" ] || { echo "no loopback test binary was built" >&2; exit 1; }
cp "$exe" target/ofi_loopback
step "run it in the SoftRoCE VM over verbs;ofi_rxm"
# The binary's rpath names $LIBFABRIC_PREFIX/lib: softroce-test.sh copies libfabric.so.1 to
# the same path in the guest, with libibverbs and librdmacm. FI_UNIVERSE_SIZE=64: ofi_rxm
# sizes verbs completion queues for that many peers (default 256 needs more entries than
# rxe's 32767). rxe's packet counters are printed around the run.
exec scripts/softroce-test.sh --quiet --timeout 600 --env RUST_BACKTRACE=1 --include target/ofi_loopback \
  --include "$LIBFABRIC_PREFIX/bin/fi_info" \
  --run-as fi_info_verbs_rxm '/opt/bin/fi_info -p "verbs;ofi_rxm" -t FI_EP_RDM -c FI_RMA' \
  --run-as ofi_verbs_rxm 'c=/sys/class/infiniband/rxe0/ports/1/hw_counters; echo "rxe0 before: sent_pkts $(cat $c/sent_pkts) rcvd_pkts $(cat $c/rcvd_pkts)"; FI_UNIVERSE_SIZE=64 OFI_TEST_PROVIDER="verbs;ofi_rxm" OFI_TEST_NODE=$SOFTROCE_IPADDR /opt/bin/ofi_loopback --ignored --exact env_provider --nocapture && echo "rxe0 after: sent_pkts $(cat $c/sent_pkts) rcvd_pkts $(cat $c/rcvd_pkts)"' "$@"
