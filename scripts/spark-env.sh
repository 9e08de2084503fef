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
# Exports: REPO_ROOT, SPARK_VERSION, SPARK_LINE (4.x | 3.5), SCALA_BINARY, SPARK_HOME,
#          SPARK_LOCAL_IP, JAVA_HOME, PYSPARK_PYTHON, VENV_DIR, PATH (venv bin first),
#          RDMA_PLUGIN_JAR and RDMA_JOBS_JAR (where `mvn package` of that line puts the jars).
# Defines: rdma_plugin_submit_args JAR — the spark-submit arguments that install the plugin
#          from JAR the way that Spark line needs (see the function).

# The pins. They must equal the <spark.version> of the matching profile in jvm-plugin/pom.xml;
# tests/spark/check_versions.sh compares them so the two cannot drift apart.
_rdma_default_spark=4.2.0
_rdma_default_scala=2.13
_rdma_35_spark=3.5.9
_rdma_35_scala=2.12

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export REPO_ROOT

case "${RDMA_SPARK_PROFILE:-}" in
  "" )        SPARK_VERSION=$_rdma_default_spark; SPARK_LINE=4.x; SCALA_BINARY=$_rdma_default_scala; VENV_DIR="$REPO_ROOT/.venv" ;;
  spark-3.5 ) SPARK_VERSION=$_rdma_35_spark;      SPARK_LINE=3.5; SCALA_BINARY=$_rdma_35_scala;      VENV_DIR="$REPO_ROOT/.venv-spark-3.5" ;;
  * ) echo "spark-env.sh: unknown RDMA_SPARK_PROFILE='${RDMA_SPARK_PROFILE}' (use '' or 'spark-3.5')" >&2; return 2 2>/dev/null || exit 2 ;;
esac
export SPARK_VERSION SPARK_LINE SCALA_BINARY VENV_DIR
RDMA_PLUGIN_JAR="$REPO_ROOT/jvm-plugin/plugin/target/spark-$SPARK_LINE/rdma-shuffle-spark${SPARK_LINE}_${SCALA_BINARY}-0.1.0-SNAPSHOT.jar"
RDMA_JOBS_JAR="$REPO_ROOT/jvm-plugin/jobs/target/spark-$SPARK_LINE/rdma-shuffle-jobs-spark${SPARK_LINE}_${SCALA_BINARY}-0.1.0-SNAPSHOT.jar"
export RDMA_PLUGIN_JAR RDMA_JOBS_JAR

# rdma_plugin_submit_args JAR: prints, one per line, the spark-submit arguments that make JAR's
# RdmaShuffleManager the shuffle manager of the driver and of every executor.
#   Spark 3.x creates the shuffle manager (SparkEnv) before it adds the jars of spark.jars/--jars
#   to the executor's class loader, so with --jars every executor dies of ClassNotFoundException:
#   the jar must be on the JVMs' own class path (spark.{driver,executor}.extraClassPath).
#   Spark 4.x creates it after the user jars are added, so the ordinary --jars works.
# Use: mapfile -t args < <(rdma_plugin_submit_args "$RDMA_PLUGIN_JAR")
rdma_plugin_submit_args() {
  printf '%s\n' --conf spark.shuffle.manager=org.apache.spark.shuffle.rdma.RdmaShuffleManager
  case "$SPARK_LINE" in
    3.5) printf '%s\n' --conf "spark.driver.extraClassPath=$1" --conf "spark.executor.extraClassPath=$1" ;;
    *)   printf '%s\n' --jars "$1" ;;
  esac
}

# Tools a fresh Debian machine may lack: a JDK 17 and Maven (the plugin build), python3's venv.
if ! command -v java >/dev/null || ! command -v mvn >/dev/null || ! command -v python3 >/dev/null; then
  declare -F apt_install >/dev/null || . "$REPO_ROOT/scripts/lib.sh"
  apt_install openjdk-17-jdk-headless maven python3 python3-venv \
    || { echo "spark-env.sh: installing a JDK 17, Maven and python3 with apt failed" >&2; return 1 2>/dev/null || exit 1; }
fi

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
  if ! "$_rdma_py" -m venv "$VENV_DIR"; then
    # Debian's python3 keeps ensurepip in a separate package.
    rm -rf "$VENV_DIR"
    declare -F apt_install >/dev/null || . "$REPO_ROOT/scripts/lib.sh"
    apt_install python3-venv && "$_rdma_py" -m venv "$VENV_DIR" \
      || { echo "spark-env.sh: creating a python venv at $VENV_DIR failed" >&2; return 1 2>/dev/null || exit 1; }
  fi
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
