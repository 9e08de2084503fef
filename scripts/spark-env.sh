#!/usr/bin/env bash
# Source this file (`. scripts/spark-env.sh`) to get a Spark runtime matching the version the
# plugin is compiled against.
#
# Spark comes from the `pyspark` wheel: its package directory is a complete SPARK_HOME
# (bin/spark-submit, jars/). The venv lives at <repo>/.venv (or .venv-spark-3.5 for the 3.5
# line) and is created on first use, so a fresh machine or CI needs nothing but PyPI.
#
# Inputs (environment, all optional):
#   RDMA_SPARK_PROFILE  ""           -> the default Maven profile (Spark 4.2.0 / Scala 2.13)
#                       "spark-3.5"  -> Spark 3.5.9 / Scala 2.12
# Exports: REPO_ROOT, SPARK_VERSION, SCALA_BINARY, SPARK_HOME, SPARK_LOCAL_IP, JAVA_HOME,
#          PYSPARK_PYTHON, VENV_DIR, PATH (venv bin first).

# The pins. They must equal the <spark.version> of the matching profile in jvm-plugin/pom.xml;
# tests/spark/check_versions.sh compares them so the two cannot drift apart.
_rdma_default_spark=4.2.0
_rdma_default_scala=2.13
_rdma_35_spark=3.5.9
_rdma_35_scala=2.12

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export REPO_ROOT

case "${RDMA_SPARK_PROFILE:-}" in
  "" )        SPARK_VERSION=$_rdma_default_spark; SCALA_BINARY=$_rdma_default_scala; VENV_DIR="$REPO_ROOT/.venv" ;;
  spark-3.5 ) SPARK_VERSION=$_rdma_35_spark;      SCALA_BINARY=$_rdma_35_scala;      VENV_DIR="$REPO_ROOT/.venv-spark-3.5" ;;
  * ) echo "spark-env.sh: unknown RDMA_SPARK_PROFILE='${RDMA_SPARK_PROFILE}' (use '' or 'spark-3.5')" >&2; return 2 2>/dev/null || exit 2 ;;
esac
export SPARK_VERSION SCALA_BINARY VENV_DIR

# Java: Spark 4 needs 17; 3.5 runs on 17 as well. Prefer an explicit JAVA_HOME, else Debian's 17.
if [ -z "${JAVA_HOME:-}" ] || [ ! -x "${JAVA_HOME}/bin/java" ]; then
  for j in /usr/lib/jvm/java-17-openjdk-amd64 /usr/lib/jvm/java-17-openjdk-arm64 /usr/lib/jvm/openjdk-17; do
    if [ -x "$j/bin/java" ]; then JAVA_HOME="$j"; break; fi
  done
fi
if [ -z "${JAVA_HOME:-}" ]; then
  JAVA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")"
fi
export JAVA_HOME

_rdma_py="${PYTHON:-python3}"
if [ ! -x "$VENV_DIR/bin/python" ]; then
  echo "spark-env.sh: creating $VENV_DIR" >&2
  "$_rdma_py" -m venv "$VENV_DIR" || { echo "spark-env.sh: python venv creation failed" >&2; return 1 2>/dev/null || exit 1; }
fi
if ! "$VENV_DIR/bin/python" -c "import pyspark, sys; sys.exit(0 if pyspark.__version__ == '$SPARK_VERSION' else 1)" 2>/dev/null; then
  echo "spark-env.sh: installing pyspark==$SPARK_VERSION into $VENV_DIR (~460 MB, once)" >&2
  "$VENV_DIR/bin/pip" install -q --disable-pip-version-check "pyspark==$SPARK_VERSION" \
    || { echo "spark-env.sh: pip install pyspark==$SPARK_VERSION failed" >&2; return 1 2>/dev/null || exit 1; }
fi

SPARK_HOME="$("$VENV_DIR/bin/python" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')"
export SPARK_HOME
export SPARK_LOCAL_IP=127.0.0.1
export PYSPARK_PYTHON="$VENV_DIR/bin/python"
export PATH="$VENV_DIR/bin:$PATH"
unset _rdma_py _rdma_default_spark _rdma_default_scala _rdma_35_spark _rdma_35_scala
