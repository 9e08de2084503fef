#!/usr/bin/env bash
# Runs the Spark job suite: every job with Spark's default shuffle and with the plugin on
# local-cluster[2,1,1024]. Needs PyPI (pyspark, pytest) and Maven Central on first use.
#   tests/spark/run.sh                 # Spark 4.2.0
#   RDMA_SPARK_PROFILE=spark-3.5 tests/spark/run.sh
#   tests/spark/run.sh -k terasort     # extra args go to pytest
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/../../scripts/spark-env.sh"
"$VENV_DIR/bin/python" -c "import pytest" 2>/dev/null || "$VENV_DIR/bin/pip" install -q --disable-pip-version-check pytest
cd "$REPO_ROOT/jvm-plugin"
mvn -q -B package -DskipTests ${RDMA_SPARK_PROFILE:+-P$RDMA_SPARK_PROFILE}
cd "$REPO_ROOT"
exec "$VENV_DIR/bin/python" -m pytest -ra -s "$here" "$@"
