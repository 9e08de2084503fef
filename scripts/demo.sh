#!/usr/bin/env bash
# Demo: the same unchanged Spark job, once with Spark's default shuffle and once with the
# RDMA shuffle plugin, on an embedded local-cluster (2 executor JVMs), side by side.
#
#   scripts/demo.sh [jobs] [scale]   jobs: terasort (default), a comma list of wordcount,terasort,sql,sparse,bigblock, or all
#
# Installs what it needs on first use: build dependencies (apt), the native engine
# (scripts/build-native.sh), a venv with pyspark (scripts/spark-env.sh) and the Maven build of
# jvm-plugin. On this machine (no RDMA device) the engine runs over tcp; the plugin run prints
# the engine's own counters, which show the blocks it moved.
set -euo pipefail
job="${1:-terasort}"
scale="${2:-1}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/spark-env.sh"

line=4.x; [ "${RDMA_SPARK_PROFILE:-}" = spark-3.5 ] && line=3.5
plugin_jar="$REPO_ROOT/jvm-plugin/plugin/target/spark-$line/rdma-shuffle-spark${line}_${SCALA_BINARY}-0.1.0-SNAPSHOT.jar"
jobs_jar="$REPO_ROOT/jvm-plugin/jobs/target/spark-$line/rdma-shuffle-jobs-spark${line}_${SCALA_BINARY}-0.1.0-SNAPSHOT.jar"
echo "== building the native engine"
"$here/build-native.sh" > "$REPO_ROOT/target/build-native.log" 2>&1 || { tail -30 "$REPO_ROOT/target/build-native.log"; exit 1; }
echo "== building jvm-plugin (Spark $SPARK_VERSION, Scala $SCALA_BINARY)"
(cd "$REPO_ROOT/jvm-plugin" && mvn -q -B package -DskipTests ${RDMA_SPARK_PROFILE:+-P$RDMA_SPARK_PROFILE})

out="$(mktemp -d -t rdma-demo.XXXXXX)"
common=(--master 'local-cluster[2,1,1024]' --driver-memory 1g
        --conf spark.shuffle.readHostLocalDisk=false
        --conf spark.shuffle.reduceLocality.enabled=false
        --conf spark.shuffle.compress=false
        --conf spark.ui.enabled=false)

run() { # mode
  local mode=$1 extra=()
  if [ "$mode" = plugin ]; then
    extra=(--conf spark.shuffle.manager=org.apache.spark.shuffle.rdma.RdmaShuffleManager --jars "$plugin_jar")
  fi
  echo "== running $job with $mode shuffle"
  local t0; t0=$(date +%s.%N)
  "$SPARK_HOME/bin/spark-submit" "${common[@]}" "${extra[@]}" \
    --class org.apache.spark.shuffle.rdma.jobs.ShuffleJobs "$jobs_jar" "$job" "$scale" \
    > "$out/$mode.out" 2> "$out/$mode.err" || { echo "$mode run failed, see $out/$mode.err"; tail -20 "$out/$mode.err"; exit 1; }
  awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN{printf "%.1f\n", a-b}' > "$out/$mode.wall"
}
run default
run plugin

field() { # file prefix job key
  grep "^$2 job=$3 " "$1" | tr ' ' '\n' | sed -n "s/^$4=//p"
}
mb() { awk -v x="$1" 'BEGIN{printf "%.1f", x/1048576}'; }
secs() { awk -v x="$1" 'BEGIN{printf "%.1f", x/1000}'; }

echo
echo "spark-submit wall (incl. executor start-up): default $(cat "$out/default.wall") s, plugin $(cat "$out/plugin.wall") s"
printf '%-10s | %9s %9s | %11s %11s | %11s %11s | %11s %11s | %s\n' job "wall s" "" "written MB" "" "remote MB" "" "fetch wait ms" "" "outputs"
printf '%-10s | %9s %9s | %11s %11s | %11s %11s | %11s %11s | %s\n' "" default plugin default plugin default plugin default plugin equal
all_equal=yes
for j in $(grep '^DIGEST ' "$out/default.out" | sed 's/^DIGEST job=\([^ ]*\).*/\1/'); do
  dd=$(grep "^DIGEST job=$j " "$out/default.out" | cut -d' ' -f3-)
  pd=$(grep "^DIGEST job=$j " "$out/plugin.out" | cut -d' ' -f3-)
  eq=yes; [ "$dd" = "$pd" ] || { eq=NO; all_equal=no; }
  printf '%-10s | %9s %9s | %11s %11s | %11s %11s | %11s %11s | %s\n' "$j" \
    "$(secs "$(field "$out/default.out" SHUFFLE_METRICS "$j" wall_ms)")" "$(secs "$(field "$out/plugin.out" SHUFFLE_METRICS "$j" wall_ms)")" \
    "$(mb "$(field "$out/default.out" SHUFFLE_METRICS "$j" write_bytes)")" "$(mb "$(field "$out/plugin.out" SHUFFLE_METRICS "$j" write_bytes)")" \
    "$(mb "$(field "$out/default.out" SHUFFLE_METRICS "$j" remote_bytes)")" "$(mb "$(field "$out/plugin.out" SHUFFLE_METRICS "$j" remote_bytes)")" \
    "$(field "$out/default.out" SHUFFLE_METRICS "$j" fetch_wait_ms)" "$(field "$out/plugin.out" SHUFFLE_METRICS "$j" fetch_wait_ms)" \
    "$eq"
  [ "$eq" = yes ] || { echo "  default: $dd"; echo "  plugin:  $pd"; }
done
if grep -q "native library librdma_shuffle_jni.so could not be" "$out/plugin.err"; then
  echo "note: native library absent -> the plugin handed every shuffle to Spark's sort shuffle"
fi
echo
echo "engine counters per executor (plugin run; from the driver's log):"
grep -o "RDMA_SHUFFLE_ENGINE_STATS executor=.*" "$out/plugin.err" | tr ' ' '\n' \
  | grep -E "^(executor|transport|blocks_served|bytes_served|blocks_fetched|bytes_fetched|eager_blocks_fetched|rendezvous_blocks_fetched)=" \
  | paste -sd' ' | sed 's/ executor=/\nexecutor=/g; s/^/  /'
echo "logs: $out"
[ "$all_equal" = yes ]
