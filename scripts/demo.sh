#!/usr/bin/env bash
# Demo: the same unchanged Spark job, once with Spark's default shuffle and once with the
# RDMA shuffle plugin, on an embedded local-cluster (2 executor JVMs), side by side.
#
#   scripts/demo.sh [jobs] [scale]     jobs: terasort (default), a comma list of
#                                      wordcount,terasort,sql,sparse,bigblock, or all;
#                                      scale: 1 (default) = 1 M records for terasort
#   scripts/demo.sh --small            a quick check (terasort and wordcount at scale 0.05);
#                                      what .ci/run runs after the tests
#   RDMA_SPARK_PROFILE=spark-3.5 scripts/demo.sh    the same on Spark 3.5.9 / Scala 2.12
#
# Installs what it needs on first use: build dependencies (apt), the native engine
# (scripts/build-native.sh), a venv with the pinned pyspark (scripts/spark-env.sh) and the Maven
# build of jvm-plugin for that Spark line. On this machine (no RDMA device) the engine runs over
# tcp; the plugin run prints the engine's own counters, which show the blocks it moved.
# Fails when the outputs differ or when the plugin run moved no block through the engine.
set -euo pipefail
if [ "${1:-}" = --small ]; then
  set -- terasort,wordcount 0.05
fi
case "${1:-}" in -h|--help) sed -n '2,17p' "$0"; exit 0 ;; esac
job="${1:-terasort}"
scale="${2:-1}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/spark-env.sh"
mkdir -p "$REPO_ROOT/target"

echo "== building the native engine (log: target/build-native.log)"
bash "$here/build-native.sh" > "$REPO_ROOT/target/build-native.log" 2>&1 || { tail -30 "$REPO_ROOT/target/build-native.log"; exit 1; }
echo "== building jvm-plugin (Spark $SPARK_VERSION, Scala $SCALA_BINARY; log: target/build-jvm-$SPARK_LINE.log)"
(cd "$REPO_ROOT/jvm-plugin" && mvn -B package -DskipTests ${RDMA_SPARK_PROFILE:+-P$RDMA_SPARK_PROFILE}) \
  > "$REPO_ROOT/target/build-jvm-$SPARK_LINE.log" 2>&1 || { tail -40 "$REPO_ROOT/target/build-jvm-$SPARK_LINE.log"; exit 1; }
for j in "$RDMA_PLUGIN_JAR" "$RDMA_JOBS_JAR"; do
  [ -f "$j" ] || { echo "the Maven build did not produce $j" >&2; exit 1; }
done
plugin_args=()
mapfile -t plugin_args < <(rdma_plugin_submit_args "$RDMA_PLUGIN_JAR")

out="$(mktemp -d -t rdma-demo.XXXXXX)"
common=(--master 'local-cluster[2,1,1024]' --driver-memory 1g
        --conf spark.shuffle.readHostLocalDisk=false
        --conf spark.shuffle.reduceLocality.enabled=false
        --conf spark.shuffle.compress=false
        --conf spark.ui.enabled=false)

run() { # mode
  local mode=$1 extra=()
  if [ "$mode" = plugin ]; then
    extra=("${plugin_args[@]}")
  fi
  echo "== running $job (scale $scale) with the $mode shuffle"
  local t0; t0=$(date +%s.%N)
  "$SPARK_HOME/bin/spark-submit" "${common[@]}" "${extra[@]}" \
    --class org.apache.spark.shuffle.rdma.jobs.ShuffleJobs "$RDMA_JOBS_JAR" "$job" "$scale" \
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
  compared="${compared:-}$j "
  eq=yes; [ -n "$pd" ] && [ "$dd" = "$pd" ] || { eq=NO; all_equal=no; }
  printf '%-10s | %9s %9s | %11s %11s | %11s %11s | %11s %11s | %s\n' "$j" \
    "$(secs "$(field "$out/default.out" SHUFFLE_METRICS "$j" wall_ms)")" "$(secs "$(field "$out/plugin.out" SHUFFLE_METRICS "$j" wall_ms)")" \
    "$(mb "$(field "$out/default.out" SHUFFLE_METRICS "$j" write_bytes)")" "$(mb "$(field "$out/plugin.out" SHUFFLE_METRICS "$j" write_bytes)")" \
    "$(mb "$(field "$out/default.out" SHUFFLE_METRICS "$j" remote_bytes)")" "$(mb "$(field "$out/plugin.out" SHUFFLE_METRICS "$j" remote_bytes)")" \
    "$(field "$out/default.out" SHUFFLE_METRICS "$j" fetch_wait_ms)" "$(field "$out/plugin.out" SHUFFLE_METRICS "$j" fetch_wait_ms)" \
    "$eq"
  [ "$eq" = yes ] || { echo "  default: $dd"; echo "  plugin:  $pd"; }
done
[ -n "${compared:-}" ] || { echo "the default run printed no DIGEST line; see $out/default.out" >&2; all_equal=no; }
echo
echo "engine counters per executor (plugin run; the last report of each in the driver's log):"
# Reduce tasks report their engine's counters to the driver, which logs every report; the last
# one of each executor holds its totals.
stats=$(grep -o "RDMA_SHUFFLE_ENGINE_STATS executor=.*" "$out/plugin.err" \
  | awk '{ for (i = 2; i <= NF; i++) if ($i ~ /^executor=/) last[$i] = $0 } END { for (e in last) print last[e] }' | sort || true)
keys="transport blocks_served bytes_served blocks_fetched bytes_fetched eager_blocks_fetched rendezvous_blocks_fetched"
[ -z "$stats" ] || awk -v keys="$keys" '{
    n = split(keys, want, " "); delete kv
    for (i = 1; i <= NF; i++) if (split($i, p, "=") == 2 && !(p[1] in kv)) kv[p[1]] = p[2]
    line = "  executor=" kv["executor"]
    for (i = 1; i <= n; i++) if (want[i] in kv) line = line " " want[i] "=" kv[want[i]]
    print line
  }' <<<"$stats"
fetched=$(grep -o " blocks_fetched=[0-9]*" <<<"$stats" | cut -d= -f2 | awk '{ s += $1 } END { print s + 0 }')
echo "logs: $out"
if [ "$fetched" -eq 0 ]; then
  if grep -q "native library librdma_shuffle_jni.so could not be" "$out/plugin.err"; then
    echo "the native library did not load, so the plugin handed every shuffle to Spark's sort shuffle:" >&2
    grep -m1 "native library librdma_shuffle_jni.so could not be" "$out/plugin.err" >&2
  else
    echo "the plugin run moved no block through the engine (no blocks_fetched in $out/plugin.err)" >&2
  fi
  exit 1
fi
[ "$all_equal" = yes ]
