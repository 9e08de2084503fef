#!/usr/bin/env bash
# Engine benchmarks (release builds). Both kinds install what they need (apt, Maven, cargo).
#
#   scripts/bench-engine.sh [--tiny] [RUN-ARGS...]                     (= --provider tcp)
#     The engine against the real alternatives on loopback, in one run, rounds interleaved
#     (engine first in odd rounds, Spark first in even ones), medians and spread:
#       - ceiling: Debian's iperf3 -l 1M;
#       - Spark's own block transfer: spark-network-common's TransportServer serving
#         FileSegmentManagedBuffer blocks (OneForOneStreamManager) to a TransportClient
#         (fetchChunk), two JVMs, built by Maven from benches/netty against the Spark version
#         of jvm-plugin/pom.xml;
#       - the engine (tcp): two processes, the same Spark-layout files.
#     Throughput by block size (4 KiB .. 4 MiB; 1 GiB each), CPU s/GiB of both processes,
#     4 KiB blocks/s with 64 in flight, 4 KiB latency one at a time (p50/p99). Prints a table,
#     writes target/bench/engine.json and draws target/bench/engine.png.
#     RUN-ARGS go to `engine-bench run`: --mib N (default 1024) --sizes 4k,16k,64k,256k,1m,4m
#     --rounds N (5) --warmup N (2 untimed rounds first: the JVMs' JIT) --small-reps N
#     (20 x 1024 blocks) --lat-samples N (2000) --min-secs S (0.5: a bulk measurement repeats its
#     transfer until it ran this long, so its CPU figure is never a few 10 ms ticks) --dir DIR.
#     --tiny = --mib 32 --sizes 64k,1m --rounds 2 --warmup 1 --small-reps 2 --lat-samples 100:
#     proves the harness works in half a minute; its numbers mean nothing.
#     libfabric rows: where scripts/ensure-libfabric.sh has built libfabric (or with --ofi P,
#     which builds it), the same rounds also run the engine with transport=ofi over libfabric's
#     provider P (default tcp;ofi_rxm), two processes of its own, placed between the tcp engine
#     and Spark in every round: its rows go to engine.json's "ofi" and below the table.
#     --no-ofi (or RDMA_BENCH_OFI=none) leaves them out.
#   scripts/bench-engine.sh --profile [PROFILE-ARGS...]
#     Where each system's work goes per block, by block size, with counts the machine's load
#     does not change: the engine and Spark's transfer (no iperf3) move one bulk transfer per
#     size under a tool attached to both processes of each: `perf stat` of system calls,
#     wake-ups, context switches and CPU time (default), `perf trace -s` (--tool trace: each
#     system call by name, with its errors), `strace -c -f` (--tool strace), or `perf record -g`
#     (--tool record, files in --out-dir); CPU seconds per GiB of each thread in every mode.
#     PROFILE-ARGS go to `engine-bench profile`: --sizes (4k,16k,64k,256k,1m,4m) --mib N (256)
#     --secs S (2) --warmup N (3) --spin-us N --tool stat|trace|strace|record
#     --systems engine,netty --out-dir DIR (target/bench/profile); the report goes to
#     target/bench/profile-<tool>.json.
#   scripts/bench-engine.sh --provider verbs [-- SWEEP-ARGS...]
#     eager SEND vs rendezvous RDMA READ, throughput and p50 latency by block size (4 KiB ..
#     16 MiB), on real kernel RDMA. Without an RDMA device on the host (always, here) it boots
#     the SoftRoCE VM once and runs the sweep on its rxe0; the guest prints the report between
#     markers on the console and this script writes it to target/bench/engine-verbs.json and
#     draws target/bench/engine-verbs.png.
#     The numbers are emulation speeds: compare SEND with READ, not with hardware.
#     SWEEP-ARGS go to `engine-bench verbs-sweep` (e.g. -- --sizes 4k,1m --secs 1).
# Exits non-zero if the build, the VM, the run, or the report (every key, finite) fails.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
PROVIDER=tcp
MODE=run
OFI=${RDMA_BENCH_OFI:-auto}
ARGS=()
while [ $# -gt 0 ]; do
  case $1 in
    --provider) [ $# -ge 2 ] || { echo "--provider needs tcp or verbs" >&2; exit 2; }; PROVIDER=$2; shift 2 ;;
    --profile) MODE=profile; shift ;;
    --ofi) [ $# -ge 2 ] || { echo "--ofi needs a libfabric provider (e.g. 'tcp;ofi_rxm')" >&2; exit 2; }; OFI=$2; shift 2 ;;
    --no-ofi) OFI=none; shift ;;
    --tiny) ARGS+=(--mib 32 --sizes 64k,1m --rounds 2 --warmup 1 --small-reps 2 --lat-samples 100); shift ;;
    --) shift; ARGS+=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
SWEEP_ARGS=("${ARGS[@]}")

# Matplotlib for the plots: Debian's, run by Debian's python3.
plot() {
  apt_install python3-matplotlib
  /usr/bin/python3 scripts/plot_bench.py "$@"
}

case $PROVIDER in
tcp)
  step "tools: iperf3, a JDK and Maven (Debian)"
  need=(iperf3)
  [ "$MODE" = profile ] && need=(linux-perf strace)
  command -v java >/dev/null || need+=(openjdk-17-jdk-headless)
  command -v mvn >/dev/null || need+=(maven)
  apt_install "${need[@]}"
  ensure_rust >/dev/null
  mkdir -p target/bench
  pom() { sed -n "s:.*<$1>\(.*\)</$1>.*:\1:p" jvm-plugin/pom.xml | head -n 1; }
  SPARK_VERSION=$(pom spark.version)
  SCALA_BINARY=$(pom scala.binary.version)
  FEATURES=()
  OFI_ARGS=()
  [ "$MODE" = run ] || OFI=none
  if [ "$OFI" = auto ]; then
    if LIBFABRIC_PREFIX=$(bash scripts/ensure-libfabric.sh --check); then
      OFI='tcp;ofi_rxm'
    else
      OFI=none
      echo "bench-engine: libfabric is not built here (scripts/ensure-libfabric.sh): no libfabric rows" >&2
    fi
  elif [ "$OFI" != none ]; then
    LIBFABRIC_PREFIX=$(run_script scripts/ensure-libfabric.sh)
  fi
  if [ "$OFI" != none ]; then
    apt_install libclang-dev clang pkg-config   # bindgen in ofi-libfabric-sys
    export PKG_CONFIG_PATH=$LIBFABRIC_PREFIX/lib/pkgconfig LD_LIBRARY_PATH=$LIBFABRIC_PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    FEATURES=(--features ofi)
    OFI_ARGS=(--ofi-provider "$OFI")
  fi
  step "build: engine-bench (release${FEATURES:+, with the libfabric provider}), Spark $SPARK_VERSION's block transfer (benches/netty, Maven)"
  cargo build --release -q -p rdma-shuffle-bench --bin engine-bench "${FEATURES[@]}"
  if ! mvn -q -B -f benches/netty/pom.xml -Dspark.version="$SPARK_VERSION" -Dscala.binary.version="$SCALA_BINARY" \
      package > target/bench/netty-build.log 2>&1; then
    tail -n 40 target/bench/netty-build.log >&2
    echo "building benches/netty failed (log: target/bench/netty-build.log)" >&2
    exit 1
  fi
  CP="$PWD/benches/netty/target/netty-block-bench.jar:$PWD/benches/netty/target/lib/*"
  # An executor's JVM: Spark's default 1 GiB heap and the module opens spark-submit adds on
  # Java 17 (Netty's direct buffers need java.nio and sun.nio.ch).
  JVM=(-Xmx1g -XX:+IgnoreUnrecognizedVMOptions
    --add-opens=java.base/java.lang=ALL-UNNAMED --add-opens=java.base/java.lang.invoke=ALL-UNNAMED
    --add-opens=java.base/java.lang.reflect=ALL-UNNAMED --add-opens=java.base/java.io=ALL-UNNAMED
    --add-opens=java.base/java.net=ALL-UNNAMED --add-opens=java.base/java.nio=ALL-UNNAMED
    --add-opens=java.base/java.util=ALL-UNNAMED --add-opens=java.base/java.util.concurrent=ALL-UNNAMED
    --add-opens=java.base/java.util.concurrent.atomic=ALL-UNNAMED --add-opens=java.base/jdk.internal.ref=ALL-UNNAMED
    --add-opens=java.base/sun.nio.ch=ALL-UNNAMED --add-opens=java.base/sun.nio.cs=ALL-UNNAMED
    --add-opens=java.base/sun.security.action=ALL-UNNAMED --add-opens=java.base/sun.util.calendar=ALL-UNNAMED
    -Djdk.reflect.useDirectMethodHandle=false -Dio.netty.tryReflectionSetAccessible=true)
  JARGS=()
  for o in "${JVM[@]}"; do JARGS+=(--jvm-opt "$o"); done
  if [ "$MODE" = profile ]; then
    TOOL=stat
    for ((i = 0; i < ${#ARGS[@]}; i++)); do [ "${ARGS[$i]}" = --tool ] && TOOL=${ARGS[$((i + 1))]:-stat}; done
    step "profile: the engine and Spark (Netty) per block size, under $TOOL"
    ./target/release/engine-bench profile --netty-cp "$CP" "${JARGS[@]}" --java "$(command -v java)" \
      --out "target/bench/profile-$TOOL.json" "${ARGS[@]}"
    echo "wrote target/bench/profile-$TOOL.json"
    exit 0
  fi
  OUT=target/bench/engine.json
  rm -f "$OUT" target/bench/engine.png   # a failed run leaves no report that could pass for its result
  step "run: iperf3 vs Spark (Netty) vs engine${OFI_ARGS:+ and the engine over libfabric $OFI}, interleaved rounds"
  ./target/release/engine-bench run --netty-cp "$CP" "${JARGS[@]}" --java "$(command -v java)" \
    --iperf3 "$(command -v iperf3)" --spark-version "$SPARK_VERSION" --out "$OUT" "${OFI_ARGS[@]}" "${ARGS[@]}"
  plot engine "$OUT" target/bench/engine.png
  exit 0
  ;;
verbs) ;;
*) echo "unknown provider '$PROVIDER' (tcp or verbs)" >&2; exit 2 ;;
esac

# ---------------------------------------------------------------- verbs sweep
T_START=$(date +%s)
ensure_rust >/dev/null
if ls /sys/class/infiniband/* >/dev/null 2>&1; then
  # A host with RDMA runs the sweep directly; this project's machines never get here.
  step "build the verbs benchmark"
  cargo build --release -q -p rdma-shuffle-bench --features verbs --bin engine-bench
  mkdir -p target/bench
  ./target/release/engine-bench verbs-sweep --out target/bench/engine-verbs.json "${SWEEP_ARGS[@]}"
  plot verbs target/bench/engine-verbs.json target/bench/engine-verbs.png
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
plot verbs "$OUT" target/bench/engine-verbs.png
echo "wrote $OUT (whole run $(( $(date +%s) - T_START )) s)"
