#!/usr/bin/env bash
# Engine benchmarks (release builds).
#   scripts/bench-engine.sh [--gib N]          (= --provider tcp)
#     loopback tcp: raw-socket ceiling vs the engine, 4 KiB block rate and latency, CPU per
#     GiB. Prints a table, writes target/bench/engine.json.
#   scripts/bench-engine.sh --provider verbs [-- SWEEP-ARGS...]
#     eager SEND vs rendezvous RDMA READ, throughput and p50 latency by block size (4 KiB ..
#     16 MiB), on real kernel RDMA. Without an RDMA device on the host (always, here) it boots
#     the SoftRoCE VM once and runs the sweep on its rxe0; the guest prints the report between
#     markers on the console and this script writes it to target/bench/engine-verbs.json.
#     The numbers are emulation speeds: compare SEND with READ, not with hardware.
#     SWEEP-ARGS go to `engine-bench verbs-sweep` (e.g. -- --sizes 4k,1m --secs 1).
# Exits non-zero if the build, the VM, the sweep, or the report fails.
set -euo pipefail
cd "$(dirname "$0")/.."
GIB=1
PROVIDER=tcp
SWEEP_ARGS=()
while [ $# -gt 0 ]; do
  case $1 in
    --gib) GIB=$2; shift 2 ;;
    --provider) PROVIDER=$2; shift 2 ;;
    --) shift; SWEEP_ARGS=("$@"); break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

case $PROVIDER in
tcp)
  cargo build --release -q -p rdma-shuffle-bench --bin engine-bench
  mkdir -p target/bench
  exec ./target/release/engine-bench run --gib "$GIB" --out target/bench/engine.json
  ;;
verbs) ;;
*) echo "unknown provider '$PROVIDER' (tcp or verbs)" >&2; exit 2 ;;
esac

# ---------------------------------------------------------------- verbs sweep
. scripts/lib.sh
T_START=$(date +%s)
ensure_rust >/dev/null
if ls /sys/class/infiniband/* >/dev/null 2>&1; then
  # A host with RDMA runs the sweep directly; this project's machines never get here.
  step "build the verbs benchmark"
  cargo build --release -q -p rdma-shuffle-bench --features verbs --bin engine-bench
  mkdir -p target/bench
  ./target/release/engine-bench verbs-sweep --out target/bench/engine-verbs.json "${SWEEP_ARGS[@]}"
  exit 0
fi
scripts/softroce-prepare.sh   # the VM's kernel and user space; libibverbs-dev, clang for the build
step "build the verbs benchmark"
cargo build --release -q -p rdma-shuffle-bench --features verbs --bin engine-bench
# A separate name: the plain tcp build shares target/release/engine-bench.
mkdir -p target/bench
cp target/release/engine-bench target/bench/engine-bench-verbs

# The guest's files do not come back: it prints the table and the JSON report with a prefix
# on every line, so kernel messages interleaved on the console cannot corrupt them.
GUEST_ARGS=""
for a in "${SWEEP_ARGS[@]}"; do GUEST_ARGS+=" $(printf '%q' "$a")"; done
GUEST_CMD="/opt/bin/engine-bench-verbs verbs-sweep --device \"\$SOFTROCE_IBDEV\" --gid-index \"\$SOFTROCE_GID_INDEX\" \
--out /tmp/engine-verbs.json$GUEST_ARGS > /tmp/table.txt && sed 's/^/@@TABLE /' /tmp/table.txt && sed 's/^/@@JSON /' /tmp/engine-verbs.json"
LOG=target/bench/engine-verbs.console.log
OUT=target/bench/engine-verbs.json
rm -f "$OUT" "$OUT.tmp"   # a failed run leaves no report that could pass for its result
step "run the sweep in the SoftRoCE VM (progress below; console log in $LOG)"
set +e
# Only the sweep's progress and the harness's verdict are shown; the whole console is in $LOG.
scripts/softroce-test.sh --log "$LOG" --timeout 900 --env RUST_BACKTRACE=1 \
  --include target/bench/engine-bench-verbs --run-as verbs_sweep "$GUEST_CMD" 2>&1 \
  | grep --line-buffered -E '^(\[softroce|SOFTROCE-RESULT|softroce:|verbs-sweep)'
VM_RC=${PIPESTATUS[0]}
set -e
if [ "$VM_RC" != 0 ]; then
  echo "the verbs sweep failed in the VM (softroce-test rc=$VM_RC); the console log is $LOG" >&2
  [ -f "$LOG" ] && grep -vE '^(@@|verbs-sweep)' "$LOG" | tail -n 40 >&2
  exit 1
fi
sed -n 's/^@@JSON //p' "$LOG" > "$OUT.tmp"
if ! python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
sizes = r["sizes"]
assert sizes, "no sizes"
for s in sizes:
    for k in ("bytes", "send_mbps", "read_mbps", "send_p50_us", "read_p50_us"):
        v = s.get(k)
        assert isinstance(v, (int, float)) and v > 0, f"{k} is {v!r} in {s}"
assert "crossover_bytes" in r and "device" in r and "note" in r
' "$OUT.tmp"; then
  echo "the report from the VM is missing or malformed (see $OUT.tmp and $LOG)" >&2
  exit 1
fi
mv "$OUT.tmp" "$OUT"
echo
sed -n 's/^@@TABLE //p' "$LOG"
echo "wrote $OUT (whole run $(( $(date +%s) - T_START )) s)"
