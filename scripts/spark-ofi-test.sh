#!/usr/bin/env bash
# A real Spark job shuffling through the libfabric provider: spark-submit runs unchanged jobs
# on local-cluster[2,1,...] with spark.shuffle.rdma.transport=ofi over each libfabric provider
# named (default tcp;ofi_rxm; CI runs tcp;ofi_rxm and shm), and once with Spark's default
# shuffle. The outputs' digests must be equal, and the executors' engine counters must show the
# blocks went through libfabric: messages (ofi_sends/ofi_recvs) for small blocks and one-sided
# fi_read (ofi_reads, rendezvous_blocks_fetched) for blocks above the eager threshold.
#
# The native library is built with the `ofi` feature (linking the libfabric that
# scripts/ensure-libfabric.sh caches) and put on the JVMs' library path
# (spark.{driver,executor}.extraLibraryPath) beside libfabric: NativeLoader loads a library on
# java.library.path before the jar's own. The jar does not bundle this variant.
#   scripts/spark-ofi-test.sh [jobs] [scale] [providers]
#     (default: terasort,wordcount 0.05 'tcp;ofi_rxm'; several providers comma-separated)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
JOB=${1:-terasort,wordcount}
SCALE=${2:-0.05}
PROVIDERS=${3:-tcp;ofi_rxm}
. scripts/lib.sh
ensure_rust >/dev/null
apt_install libclang-dev clang pkg-config
LIBFABRIC_PREFIX=$(bash scripts/ensure-libfabric.sh)
. scripts/spark-env.sh
OUT=target/spark-ofi
mkdir -p "$OUT/lib"

step "native library with the ofi provider (libfabric $LIBFABRIC_PREFIX)"
PKG_CONFIG_PATH=$LIBFABRIC_PREFIX/lib/pkgconfig cargo build --release --locked -p rdma-shuffle-jni --features ofi
cp target/release/librdma_shuffle_jni.so "$OUT/lib/librdma_shuffle_jni.so"
readelf -d "$OUT/lib/librdma_shuffle_jni.so" | grep -q 'libfabric.so' || { echo "the library does not link libfabric" >&2; exit 1; }
[ -f "$RDMA_PLUGIN_JAR" ] && [ -f "$RDMA_JOBS_JAR" ] || build_plugin
LIBPATH="$REPO/$OUT/lib:$LIBFABRIC_PREFIX/lib"

CONF=(--conf spark.shuffle.readHostLocalDisk=false --conf spark.shuffle.reduceLocality.enabled=false
      --conf spark.shuffle.compress=false --conf spark.ui.enabled=false)
submit() { # submit LOG [spark-submit args...]
  local log=$1; shift
  "$SPARK_HOME/bin/spark-submit" --master 'local-cluster[2,1,1024]' --driver-memory 512m "${CONF[@]}" "$@" \
    --class org.apache.spark.shuffle.rdma.jobs.ShuffleJobs "$RDMA_JOBS_JAR" "$JOB" "$SCALE" > "$log.out" 2> "$log.err" \
    || { tail -n 60 "$log.err"; echo "spark-submit failed (log: $log.err)" >&2; exit 1; }
}
digest() { awk '/^DIGEST job=/ {for(i=1;i<=NF;i++) if ($i ~ /^(job|records|sum|check)=/) printf "%s ", $i; print ""}'; }

step "default shuffle ($JOB, scale $SCALE)"
submit "$OUT/default"
digest < "$OUT/default.out" | tee "$OUT/default.digest"
[ -s "$OUT/default.digest" ] || { echo "the default run printed no DIGEST line" >&2; exit 1; }

mapfile -t PLUGIN_ARGS < <(rdma_plugin_submit_args "$RDMA_PLUGIN_JAR")
IFS=, read -r -a PROVS <<< "$PROVIDERS"
for prov in "${PROVS[@]}"; do
  name=${prov//;/_}
  step "plugin over ofi, libfabric provider $prov"
  submit "$OUT/$name" "${PLUGIN_ARGS[@]}" \
    --conf spark.shuffle.rdma.transport=ofi --conf "spark.shuffle.rdma.ofi.provider=$prov" \
    --conf "spark.driver.extraLibraryPath=$LIBPATH" --conf "spark.executor.extraLibraryPath=$LIBPATH" \
    --conf spark.shuffle.rdma.pool.capBytes=128m
  digest < "$OUT/$name.out" > "$OUT/$name.digest"
  diff "$OUT/default.digest" "$OUT/$name.digest" || { echo "$prov: outputs differ from the default shuffle's" >&2; exit 1; }
  # The driver logs each executor's final counters once when it stops.
  final=$(grep -h "RDMA_SHUFFLE_ENGINE_STATS" "$OUT/$name.err" "$OUT/$name.out" | tail -n 2)
  [ "$(grep -c 'transport=ofi' <<<"$final")" = 2 ] || { echo "$prov: the engines did not run on ofi: $final" >&2; exit 1; }
  sum() { grep -o " $1=[0-9]*" <<<"$final" | cut -d= -f2 | awk '{s+=$1} END {print s+0}'; }
  sends=$(sum ofi_sends) recvs=$(sum ofi_recvs) reads=$(sum ofi_reads) eager=$(sum eager_blocks_fetched) rdv=$(sum rendezvous_blocks_fetched)
  echo "$prov: outputs equal; over both executors ofi_sends=$sends ofi_recvs=$recvs ofi_reads=$reads eager_blocks_fetched=$eager rendezvous_blocks_fetched=$rdv"
  [ "$sends" -gt 0 ] && [ "$recvs" -gt 0 ] && [ "$eager" -gt 0 ] || { echo "$prov: no block went by libfabric messages" >&2; exit 1; }
  [ "$reads" -gt 0 ] && [ "$rdv" -gt 0 ] || { echo "$prov: no block went by fi_read" >&2; exit 1; }
done
echo "spark over ofi ($PROVIDERS): outputs equal to the default shuffle's; blocks by libfabric messages and fi_read"
