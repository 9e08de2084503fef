#!/usr/bin/env bash
# What one engine costs as the number of engines it talks to grows (issue 13).
#
#   scripts/bench-scale.sh [--provider tcp|verbs|both] [--peers 2,4,8,16,32] [--verbs-peers 2,4,8,16]
#                          [--vm-mem 3G] [--timeout SECS] [-- SCALE-BENCH-ARGS...]
#
# One hub engine (a process) serves a map output to every peer and fetches every peer's map
# output; peer engines (a process each) are added up to each count and fetch from the hub, so
# every connection carries traffic both ways (4 KiB blocks inline, 128 KiB ones by rendezvous)
# while the hub is measured: threads (/proc/PID/status), open fds (/proc/PID/fd), RSS, and
# registered bytes (the engine's `registered_bytes` counter when the build has it, else the
# kernel's VmPin, which counts pages pinned by RDMA registration; 0 on tcp). Each count is taken
# once every connection has carried traffic both ways; the run fails if traffic stops.
#
#   tcp    (default) on this host, peers 2..32; the report's `peers` list.
#   verbs  inside the SoftRoCE VM (real kernel RDMA over rxe0; see scripts/softroce-test.sh),
#          peers 2..16; the report's `verbs_peers` list. Emulation: counts and bytes mean
#          something, speeds do not.
#   both   tcp, then verbs.
# The report target/bench/scale.json keeps the other provider's list from an earlier run (each
# list carries its own run's metadata); it prints the table(s) and draws target/bench/scale.png.
# SCALE-BENCH-ARGS go to `scale-bench run` (e.g. --samples 3 --settle-secs 1 --pause-ms 50).
# Exits non-zero if a build, the VM, the run, or the report (every key, finite) fails.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
PROVIDER=tcp
PEERS=2,4,8,16,32
VERBS_PEERS=2,4,8,16
VM_MEM=3G
TIMEOUT=1800
EXTRA=()
while [ $# -gt 0 ]; do
  case $1 in
    --provider) PROVIDER=${2:?}; shift 2 ;;
    --peers) PEERS=${2:?}; shift 2 ;;
    --verbs-peers) VERBS_PEERS=${2:?}; shift 2 ;;
    --vm-mem) VM_MEM=${2:?}; shift 2 ;;
    --timeout) TIMEOUT=${2:?}; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-scale.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case $PROVIDER in tcp|verbs|both) ;; *) echo "--provider must be tcp, verbs or both, got '$PROVIDER'" >&2; exit 2 ;; esac
ensure_rust >/dev/null
apt_install python3-matplotlib
mkdir -p target/bench
OUT=target/bench/scale.json
T_START=$(date +%s)

# merge SECTION PART.json: puts the part's rows under SECTION of $OUT (the rest of the part
# under SECTION_run), keeping whatever else $OUT holds.
merge() {
  /usr/bin/python3 - "$OUT" "$1" "$2" <<'PY'
import json, os, sys, time, subprocess
out, section, part = sys.argv[1:]
r = json.load(open(out)) if os.path.exists(out) else {}
p = json.load(open(part))
r[section] = p.pop("rows")
try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    head = ""
p.update({"git_head": head, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
r[section + "_run"] = p
open(out + ".tmp", "w").write(json.dumps(r, indent=2) + "\n")
os.replace(out + ".tmp", out)
PY
}

if [ "$PROVIDER" = tcp ] || [ "$PROVIDER" = both ]; then
  step "build scale-bench (release)"
  cargo build --release -q -p rdma-shuffle-bench --bin scale-bench
  step "tcp: one engine with $PEERS peer engines"
  rm -f target/bench/scale-tcp.json
  ./target/release/scale-bench run --provider tcp --peers "$PEERS" --out target/bench/scale-tcp.json "${EXTRA[@]}"
  merge peers target/bench/scale-tcp.json
fi

if [ "$PROVIDER" = verbs ] || [ "$PROVIDER" = both ]; then
  scripts/softroce-prepare.sh   # the VM's kernel and user space; libibverbs-dev, clang for the build
  step "build scale-bench with the verbs provider"
  cargo build --release -q -p rdma-shuffle-bench --features verbs --bin scale-bench
  # A separate name: the tcp build shares target/release/scale-bench.
  cp target/release/scale-bench target/bench/scale-bench-verbs
  GUEST_ARGS=""
  for a in "${EXTRA[@]}"; do GUEST_ARGS+=" $(printf '%q' "$a")"; done
  # The guest's files do not come back: it prints the table and the report with a prefix on
  # every line, so kernel messages interleaved on the console cannot corrupt them.
  GUEST_CMD="/opt/bin/scale-bench-verbs run --provider verbs --device \"\$SOFTROCE_IBDEV\" --gid-index \"\$SOFTROCE_GID_INDEX\" \
--peers $VERBS_PEERS --progress-timeout 600 --dir /tmp --out /tmp/scale-verbs.json$GUEST_ARGS > /tmp/table.txt \
&& sed 's/^/@@TABLE /' /tmp/table.txt && sed 's/^/@@JSON /' /tmp/scale-verbs.json"
  LOG=target/bench/scale-verbs.console.log
  rm -f target/bench/scale-verbs.json
  step "verbs: one engine with $VERBS_PEERS peer engines over rxe0 in the SoftRoCE VM (console log: $LOG)"
  set +e
  scripts/softroce-test.sh --log "$LOG" --timeout "$TIMEOUT" --mem "$VM_MEM" --env RUST_BACKTRACE=1 \
    --include target/bench/scale-bench-verbs --run-as verbs_scale "$GUEST_CMD" 2>&1 \
    | grep --line-buffered -E '^(\[softroce|SOFTROCE-RESULT|softroce:|scale-bench)'
  VM_RC=${PIPESTATUS[0]}
  set -e
  if [ "$VM_RC" != 0 ]; then
    echo "the verbs scale run failed in the VM (softroce-test rc=$VM_RC); the console log is $LOG" >&2
    [ -f "$LOG" ] && grep -vE '^(@@|scale-bench)' "$LOG" | tail -n 40 >&2
    exit 1
  fi
  sed -n 's/^@@JSON //p' "$LOG" > target/bench/scale-verbs.json
  sed -n 's/^@@TABLE //p' "$LOG"
  merge verbs_peers target/bench/scale-verbs.json
fi

/usr/bin/python3 scripts/plot_bench.py scale "$OUT" target/bench/scale.png
echo "wrote $OUT (whole run $(( $(date +%s) - T_START )) s)"
