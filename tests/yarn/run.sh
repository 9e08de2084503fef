#!/usr/bin/env bash
# The YARN suite: Spark on a real YARN cluster (Hadoop's MiniYARNCluster: a ResourceManager and
# a NodeManager in one JVM, containers as real processes, the physical-memory check on, the
# `spark_shuffle` auxiliary service), unchanged jobs submitted with `spark-submit --master yarn`
# in client and cluster mode, Spark's default shuffle against the plugin. Needs Maven Central and
# PyPI on first use; the cluster's jars are cached under $HOME/.cache/rdma-shuffle/.
#   tests/yarn/run.sh                 # build the jars if missing, run every case
#   tests/yarn/run.sh --no-build -k kill
#   RDMA_TEST_FULL=1 tests/yarn/run.sh   # scripts/test.sh --full: every deploy mode with and
#                                        # without the service, the jobs at scale 1
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build=yes
if [ "${1:-}" = --no-build ]; then build=no; shift; fi
. "$here/../../scripts/spark-env.sh"
"$VENV_DIR/bin/python" -c "import pytest" 2>/dev/null || "$VENV_DIR/bin/pip" install -q --disable-pip-version-check pytest
# The jars of this Spark line, and of Spark 3.5 for its application (RDMA_YARN_SPARK35=0 leaves
# it out).
jars() { # profile
  (RDMA_SPARK_PROFILE=$1; . "$REPO_ROOT/scripts/spark-env.sh" >/dev/null && echo "$RDMA_PLUGIN_JAR $RDMA_JOBS_JAR")
}
profiles=("${RDMA_SPARK_PROFILE:-}")
[ "${RDMA_YARN_SPARK35:-1}" = 1 ] && [ "${RDMA_SPARK_PROFILE:-}" != spark-3.5 ] && profiles+=(spark-3.5)
for profile in "${profiles[@]}"; do
  for j in $(jars "$profile"); do
    [ -f "$j" ] && continue
    if [ "$build" = yes ]; then
      (cd "$REPO_ROOT/jvm-plugin" && mvn -q -B package -DskipTests ${profile:+-P$profile})
    fi
    [ -f "$j" ] || { echo "tests/yarn/run.sh: missing $j (build it, or run without --no-build)" >&2; exit 1; }
  done
done

# The cluster's class path: tests/yarn/pom.xml resolved once into a versioned cache.
cache="$HOME/.cache/rdma-shuffle/yarn-hadoop-3.5.0-v1"
mkdir -p "$cache"
(
  flock 9
  if [ ! -f "$cache/.complete" ]; then
    rm -rf "$cache/lib"
    mvn -B -q -f "$here/pom.xml" dependency:copy-dependencies -DoutputDirectory="$cache/lib" \
      || { echo "tests/yarn/run.sh: resolving tests/yarn/pom.xml from Maven Central failed" >&2; exit 1; }
    touch "$cache/.complete"
  fi
) 9>"$cache.lock"

# The spark_shuffle auxiliary service: Spark's own YarnShuffleService (the spark-network-yarn
# jar of this Spark version) where the registry serves it; else Spark's ExternalBlockHandler in
# the small service of tests/yarn/src (the registry CI reaches has no spark-network-yarn).
work="$REPO_ROOT/target/yarn"
mkdir -p "$work/classes"
javac -nowarn -d "$work/classes" -cp "$cache/lib/*:$SPARK_HOME/jars/*" "$here"/src/*.java
ess_jar="$HOME/.m2/repository/org/apache/spark/spark-network-yarn_$SCALA_BINARY/$SPARK_VERSION/spark-network-yarn_$SCALA_BINARY-$SPARK_VERSION.jar"
if [ ! -f "$ess_jar" ]; then
  mvn -B -q dependency:get -Dartifact="org.apache.spark:spark-network-yarn_$SCALA_BINARY:$SPARK_VERSION" \
    -Dtransitive=false >/dev/null 2>&1 || true
fi
if [ -f "$ess_jar" ]; then
  export RDMA_YARN_AUX_CLASS=org.apache.spark.network.yarn.YarnShuffleService RDMA_YARN_AUX_CLASSPATH="$ess_jar"
else
  echo "tests/yarn/run.sh: spark-network-yarn_$SCALA_BINARY:$SPARK_VERSION is not in the registry;" \
    "the spark_shuffle service is Spark's ExternalBlockHandler in tests/yarn/src/SparkShuffleAuxService.java" >&2
  export RDMA_YARN_AUX_CLASS=rdmashuffle.yarn.SparkShuffleAuxService RDMA_YARN_AUX_CLASSPATH=""
fi
export RDMA_YARN_CLASSPATH="$work/classes:$cache/lib/*:$SPARK_HOME/jars/*"
cd "$REPO_ROOT"
PYTHONDONTWRITEBYTECODE=1 exec "$VENV_DIR/bin/python" -m pytest -ra -s --durations=10 -p no:cacheprovider "$here" "$@"
