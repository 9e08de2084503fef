#!/usr/bin/env bash
# Runs the Spark job suite: every job with Spark's default shuffle and with the plugin on
# local-cluster[2,1,1024], plus the fault tests and TPC-DS at SF 0.1 (test_tpcds.py). Needs PyPI (pyspark, pytest) and Maven Central
# on first use.
#   tests/spark/run.sh                                 # Spark 4.2.0
#   RDMA_SPARK_PROFILE=spark-3.5 tests/spark/run.sh    # Spark 3.5.9 (pyspark 3.5.9, -Pspark-3.5)
#   tests/spark/run.sh -k terasort                     # extra args go to pytest
#   tests/spark/run.sh --no-build ...                  # use the jars already built (scripts/test.sh)
# The jars must bundle the native library (scripts/build-native.sh before the Maven build);
# with RDMA_SHUFFLE_REQUIRE_NATIVE=1 a plugin run without its engine fails instead of skipping.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build=yes
if [ "${1:-}" = --no-build ]; then build=no; shift; fi
. "$here/../../scripts/spark-env.sh"
"$VENV_DIR/bin/python" -c "import pytest" 2>/dev/null || "$VENV_DIR/bin/pip" install -q --disable-pip-version-check pytest
if [ "$build" = yes ]; then
  (cd "$REPO_ROOT/jvm-plugin" && mvn -q -B package -DskipTests ${RDMA_SPARK_PROFILE:+-P$RDMA_SPARK_PROFILE})
fi
for j in "$RDMA_PLUGIN_JAR" "$RDMA_JOBS_JAR"; do
  [ -f "$j" ] || { echo "tests/spark/run.sh: missing $j (build it, or run without --no-build)" >&2; exit 1; }
done
cd "$REPO_ROOT"
exec "$VENV_DIR/bin/python" -m pytest -ra -s --durations=15 "$here" "$@"
