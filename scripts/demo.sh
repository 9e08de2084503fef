#!/usr/bin/env bash
# Demo: the same unchanged Spark job, once with Spark's default shuffle and once with the
# RDMA shuffle plugin, on an embedded local-cluster (2 executor JVMs), side by side.
#
#   scripts/demo.sh [jobs] [scale]   jobs: terasort (default), a comma list of wordcount,terasort,sql,sparse,bigblock, or all
#
# Installs what it needs on first use: a venv with pyspark (scripts/spark-env.sh) and the Maven
# build of jvm-plugin. While the native library is absent the plugin hands every shuffle to
# Spark (one warning in the logs), so both columns then measure Spark's own transport.
set -euo pipefail
job="${1:-terasort}"
scale="${2:-1}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/spark-env.sh"

line=4.x; [ "${RDMA_SPARK_PROFILE:-}" = spark-3.5 ] && line=3.5
plugin_jar="$REPO_ROOT/jvm-plugin/plugin/target/spark-$line/rdma-shuffle-spark${line}_${SCALA_BINARY}-0.1.0-SNAPSHOT.jar"
jobs_jar="$REPO_ROOT/jvm-plugin/jobs/target/spark-$line/rdma-shuffle-jobs-spark${line}_${SCALA_BINARY}-0.1.0-SNAPSHOT.jar"
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

field() { # file prefix key
  grep "^$2 " "$1" | tr ' ' '\n' | sed -n "s/^$3=//p"
}
printf '\n%-22s %18s %18s\n' "job: $job" "default shuffle" "rdma plugin"
for m in default plugin; do
  eval "${m}_submit=\"\$(cat $out/$m.wall) s\""
  eval "${m}_job=\$(( \$(field $out/$m.out SHUFFLE_METRICS wall_ms) ))"
  eval "${m}_write=\$(field $out/$m.out SHUFFLE_METRICS write_bytes)"
  eval "${m}_remote=\$(field $out/$m.out SHUFFLE_METRICS remote_bytes)"
  eval "${m}_wait=\$(field $out/$m.out SHUFFLE_METRICS fetch_wait_ms)"
  eval "${m}_digest=\$(grep '^DIGEST ' $out/$m.out | cut -d' ' -f3-)"
done
mb() { awk -v x="$1" 'BEGIN{printf "%.1f", x/1048576}'; }
secs() { awk -v x="$1" 'BEGIN{printf "%.1f", x/1000}'; }
printf '%-22s %18s %18s\n' "spark-submit wall" "$default_submit" "$plugin_submit"
printf '%-22s %16s s %16s s\n' "job wall" "$(secs "$default_job")" "$(secs "$plugin_job")"
printf '%-22s %15s MB %15s MB\n' "shuffle written" "$(mb "$default_write")" "$(mb "$plugin_write")"
printf '%-22s %15s MB %15s MB\n' "shuffle read remote" "$(mb "$default_remote")" "$(mb "$plugin_remote")"
printf '%-22s %15s ms %15s ms\n' "fetch wait (sum)" "$default_wait" "$plugin_wait"
if [ "$default_digest" = "$plugin_digest" ]; then
  echo "outputs equal: yes ($default_digest)"
else
  echo "outputs equal: NO"; echo "  default: $default_digest"; echo "  plugin:  $plugin_digest"; exit 1
fi
if grep -q "native library librdma_shuffle_jni.so could not be" "$out/plugin.err"; then
  echo "note: native library absent -> the plugin handed every shuffle to Spark's sort shuffle"
fi
echo "logs: $out"
