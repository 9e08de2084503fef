#!/usr/bin/env bash
# TPC-DS, Spark's default shuffle against the plugin: every query of Spark's own TPC-DS texts,
# one application per shuffle and round, rounds interleaved (default first in odd rounds, plugin
# first in even ones).
#
#   scripts/bench-tpcds.sh [--sf N] [--queries q1,q2,...] [--rounds R] [--cluster N]
#                          [--kill-every S] [--spark-profile spark-3.5] [--no-build]
#
#   --sf N            scale factor (default 1; data cached by scale, see below)
#   --queries LIST    a subset (default: all 103 of Spark 4.2.0, 103 of 3.5.9), or heavy:K: the K
#                     that wrote the most shuffle bytes in docs/img/tpcds-sf1-stop35.json (not empty)
#   --rounds R        rounds (default 2)
#   --cluster N       on the standalone cluster of scripts/cluster.sh (N workers in network
#                     namespaces, 1 core and CLUSTER_EXECUTOR_MEMORY, default 2g here, each; the
#                     plugin installed through the driver's spark-defaults.conf) instead of
#                     local-cluster[2,1,3072]; brings the cluster up and down itself
#   --kill-every S    with --cluster: first one fault-free default run (the reference), then each
#                     round runs both shuffles while one executor is killed with kill -9 every S
#                     seconds (the workers in turn; the worker starts a new one). Every result must
#                     equal the reference; reported per shuffle: kills, queries that saw a
#                     FetchFailed, stages rerun, failed queries, total time.
#   --spark-profile   spark-3.5: Spark 3.5.9 with its own query texts and the -Pspark-3.5 build
#
# Data: DuckDB's TPC-DS generator (PyPI duckdb + duckdb-extension-tpcds, same version, installed
# into the Spark venv), parquet under $RDMA_TPCDS_CACHE (default ~/.cache/rdma-shuffle/tpcds)/sf<N>
# (SF 1: ~30 s, 371 MB, once). Queries: tpcds/q*.sql of spark-sql_<scala>:<version>:tests (Maven,
# cached beside the data). Per query: wall time of collect() in the application; the result,
# compared exactly (decimals, integers, strings, dates) but for FLOAT/DOUBLE columns (from the
# result's schema), which must agree within the summation-order tolerance; rows per shuffle;
# shuffle bytes, fetch wait and per stage the tasks' run, CPU, GC, deserialisation and shuffle
# write times from Spark's REST API. Details: scripts/tpcds.py.
#
# Writes target/bench/tpcds.json (tpcds-cluster<N>.json, tpcds-cluster<N>-kill.json with
# --cluster/--kill-every): `queries` (per query default_s, plugin_s as medians over rounds, ratio,
# ratio_ci95 (95 % interval over rounds), ratio_per_round, equal, rows, float_columns, terms,
# shuffle_bytes, ...), `equal`, `total`, `sum_ratio` with `sum_ratio_ci95` (95 % bootstrap over
# rounds, within their order, and queries), `geomean_ratio`, `slow_queries` (interval above
# 1.10), the generator and Spark versions; target/bench/tpcds-time.md, where the time went per
# term for both shuffles with intervals (scripts/tpcds.py table); and the plot (.png).
# Logs of every application: target/bench/tpcds*-logs/. Fails when results differ, a query's
# first attempt failed under one shuffle only, or the plugin's engines fetched nothing.
# At SF 1 on this machine 8 rounds resolve +-3.5 % and about 11 resolve +-3 % (docs/benchmarks.md,
# "How many rounds resolve 3 %"). Cost at SF 1 on 2 cores: 6-7 min per application, 13 min a round.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

sf=1 queries="" rounds=2 cluster=0 kill_every=0 build=yes
while [ $# -gt 0 ]; do
  case "$1" in
    --sf) sf=$2; shift 2 ;;
    --queries) queries=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --cluster) cluster=$2; shift 2 ;;
    --kill-every) kill_every=$2; shift 2 ;;
    --spark-profile) export RDMA_SPARK_PROFILE=$2; shift 2 ;;
    --no-build) build=no; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "bench-tpcds.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$sf" =~ ^[0-9]*\.?[0-9]+$ ]] || { echo "--sf needs a positive number, got '$sf'" >&2; exit 2; }
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "--rounds needs a positive integer, got '$rounds'" >&2; exit 2; }
[[ "$cluster" =~ ^[0-9]+$ ]] || { echo "--cluster needs a number of workers, got '$cluster'" >&2; exit 2; }
[[ "$kill_every" =~ ^[0-9]*\.?[0-9]+$ ]] || { echo "--kill-every needs seconds, got '$kill_every'" >&2; exit 2; }
if [ "$kill_every" != 0 ] && [ "$cluster" = 0 ]; then
  echo "--kill-every needs --cluster N (it kills executors of the namespace cluster)" >&2; exit 2
fi

step "Spark runtime"
. scripts/spark-env.sh
[ "$build" = no ] || build_plugin
[ -f "$RDMA_PLUGIN_JAR" ] || { echo "missing $RDMA_PLUGIN_JAR (run without --no-build)" >&2; exit 1; }
if ! unzip -l "$RDMA_PLUGIN_JAR" | grep -q 'librdma_shuffle_jni'; then
  echo "$RDMA_PLUGIN_JAR bundles no native library: the plugin would hand every shuffle to Spark" >&2
  exit 1
fi

step "TPC-DS data (SF $sf) and Spark $SPARK_VERSION's query texts"
"$VENV_DIR/bin/python" scripts/tpcds.py data --sf "$sf"
"$VENV_DIR/bin/python" scripts/tpcds.py queries

if [ "$cluster" != 0 ]; then
  step "namespace cluster: master + $cluster workers (scripts/cluster.sh)"
  export CLUSTER_EXECUTOR_MEMORY=${CLUSTER_EXECUTOR_MEMORY:-2g} CLUSTER_DRIVER_MEMORY=${CLUSTER_DRIVER_MEMORY:-3g}
  bash scripts/cluster.sh up "$cluster"
  trap 'bash scripts/cluster.sh down || true' EXIT
fi

step "benchmark"
rc=0
"$VENV_DIR/bin/python" scripts/tpcds.py bench --sf "$sf" --rounds "$rounds" --cluster "$cluster" \
  --kill-every "$kill_every" ${queries:+--queries "$queries"} || rc=$?

tag=tpcds; [ "$cluster" != 0 ] && tag=$tag-cluster$cluster; [ "$kill_every" != 0 ] && tag=$tag-kill
if [ -f "target/bench/$tag.json" ]; then
  step "plot: target/bench/$tag.png"
  apt_install python3-matplotlib
  /usr/bin/python3 scripts/plot_bench.py tpcds "target/bench/$tag.json" "target/bench/$tag.png" || rc=1
fi
exit "$rc"
