#!/usr/bin/env bash
# The shuffle-bound run: both shuffles on the 3-host namespace cluster of scripts/cluster.sh with
# every host's link shaped and every worker's CPU limited, so that the shuffle has a real share
# of the time, as between the racks of a datacenter; TPC-DS and the sortByKey job, the two
# shuffles interleaved (default first in odd rounds, plugin first in even ones).
#
#   scripts/bench-shaped.sh [--rate R] [--delay-us D] [--cpu C] [--sf N] [--queries Q]
#                           [--rounds N] [--records N] [--workloads tpcds,sortbykey] [--tiny] [--no-build]
#
#   --cpu C        cores per worker (cgroup cpu quota; default 0.5). Three workers at 0.5 leave
#                  half a core of the two for the driver, the master and the system.
#   --rate R       each host's link, each way (tc tbf; default: scaled from C, see below)
#   --delay-us D   microseconds added each way (tc netem; default 0: this kernel has no netem,
#                  the path's own round trip is measured and reported)
#   --sf N         TPC-DS scale (default 1)
#   --queries Q    heavy:K (default heavy:16: the K queries that wrote the most shuffle bytes in
#                  the last full SF 1 report, docs/img/tpcds-sf1-stop35.json, empty ones left out),
#                  all, or a comma list
#   --rounds N     rounds of each workload (default 4)
#   --records N    sortByKey's records (default 13000000: 1.5 GB of shuffle)
#   --tiny         a check of the harness: SF 0.1, 2 queries, 1 round, 1 M records
#
# The link rate keeps a datacenter's ratio of network to compute per host: 25 GbE hosts with 32
# vCPUs whose racks are uplinked at 3:1 (a common leaf-spine build: 48 x 25G down, 4 x 100G up)
# give a host 25 / 32 / 3 = 0.26 Gbit/s per core of traffic between racks when the whole rack
# sends at once; at C cores per worker that is C x 260 Mbit/s (130mbit at 0.5). (10 GbE hosts
# with 16 cores give 0.21.) A round trip between racks is 10-50 us in such a network unloaded
# (three switch hops and two NICs); veth pairs through a bridge on this machine take 50-90 us
# already, so no delay is added here (and the kernel could not: no sch_netem).
#
# Writes target/bench/shaped.json (scripts/shaped_report.py: both workloads' ratios with 95 %
# intervals, the shuffle share of task time per shuffle and round, fetch wait, the shape and the
# measured path), target/bench/tpcds-shaped.json (+ -time.md, the per-term table),
# target/bench/shaped-sortbykey.json. Needs root (namespaces, tc, cgroups).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

cpu=0.5 rate="" delay=0 sf=1 queries=heavy:16 rounds=4 records=13000000 workloads=tpcds,sortbykey build=yes
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --delay-us) delay=$2; shift 2 ;;
    --sf) sf=$2; shift 2 ;;
    --queries) queries=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --records) records=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    --tiny) sf=0.1 queries=q3,q72 rounds=1 records=1000000; shift ;;
    --no-build) build=no; shift ;;
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) echo "bench-shaped.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$cpu" =~ ^[0-9]*\.?[0-9]+$ ]] || { echo "--cpu needs cores, got '$cpu'" >&2; exit 2; }
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "--rounds needs a positive integer, got '$rounds'" >&2; exit 2; }
[[ "$workloads" =~ ^(tpcds|sortbykey)(,(tpcds|sortbykey))*$ ]] ||
  { echo "--workloads takes tpcds and/or sortbykey, comma-separated, got '$workloads'" >&2; exit 2; }
[ -n "$rate" ] || rate="$(awk -v c="$cpu" 'BEGIN { printf "%d", c * 260 }')mbit"
WORKERS=3

export CLUSTER_PREFIX=${CLUSTER_PREFIX:-shp} CLUSTER_SUBNET=${CLUSTER_SUBNET:-10.83.0}
export CLUSTER_EXECUTOR_MEMORY=${CLUSTER_EXECUTOR_MEMORY:-2g} CLUSTER_DRIVER_MEMORY=${CLUSTER_DRIVER_MEMORY:-3g}
mkdir -p target/bench
shape_json=target/bench/shaped-shape.json
rm -f "$shape_json" target/bench/tpcds-shaped.json target/bench/shaped-sortbykey.json target/bench/shaped.json

step "Spark runtime"
. scripts/spark-env.sh
[ "$build" = no ] || build_plugin
if [[ ",$workloads," == *,tpcds,* ]]; then
  step "TPC-DS data (SF $sf) and query texts"
  "$VENV_DIR/bin/python" scripts/tpcds.py data --sf "$sf"
  "$VENV_DIR/bin/python" scripts/tpcds.py queries
fi

step "namespace cluster: master + $WORKERS workers"
bash scripts/cluster.sh up "$WORKERS"
trap 'bash scripts/cluster.sh down || true' EXIT

step "shape: links $rate each way, +$delay us, $cpu cores per worker"
bash scripts/cluster.sh shape --rate "$rate" --delay-us "$delay" --cpu "$cpu"

step "the path between two workers: round trip and bulk rate"
apt_install iperf3 iputils-ping
w1="$CLUSTER_PREFIX-w1" w2="$CLUSTER_PREFIX-w2" ip2="$CLUSTER_SUBNET.12"
rtts=$(ip netns exec "$w1" ping -c 21 -i 0.05 "$ip2" | sed -n 's/.*time=\([0-9.]*\) ms.*/\1/p' | tail -n 20)
rtt_us=$(echo "$rtts" | sort -n | awk '{ a[NR] = $1 } END { printf "%d", 1000 * (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }')
ip netns exec "$w2" iperf3 -s -1 -B "$ip2" >/dev/null 2>&1 &
iperf_pid=$!
# Wait for the listening socket (a test connection would use up the one-off server).
for _ in $(seq 1 50); do ip netns exec "$w2" ss -ltnH "sport = :5201" | grep -q . && break; sleep 0.1; done
bulk=$(ip netns exec "$w1" iperf3 -c "$ip2" -t 3 -J | "$VENV_DIR/bin/python" -c '
import json, sys
r = json.load(sys.stdin)
if "error" in r:
    sys.exit("iperf3: " + r["error"])
print(round(r["end"]["sum_received"]["bits_per_second"] / 1e6, 1))')
wait "$iperf_pid" 2>/dev/null || true
echo "round trip w1 -> w2: ${rtt_us} us (median of 20 pings); bulk w1 -> w2: $bulk Mbit/s (shaped at $rate)"
cpu0=$(bash scripts/cluster.sh shape-stats)

rc=0
if [[ ",$workloads," == *,tpcds,* ]]; then
  step "TPC-DS SF $sf ($queries), $rounds round(s)"
  "$VENV_DIR/bin/python" scripts/tpcds.py bench --sf "$sf" --rounds "$rounds" --cluster "$WORKERS" \
    --queries "$queries" --tag tpcds-shaped || rc=1
fi
if [[ ",$workloads," == *,sortbykey,* ]]; then
  step "sortByKey, $records records, $rounds round(s)"
  # Event logs uncompressed: scripts/shaped_report.py sums every task's metrics from them.
  bash scripts/cluster.sh compare --rounds "$rounds" --json target/bench/shaped-sortbykey.json \
    --conf spark.eventLog.compress=false sortByKey "$records" || rc=1
fi
cpu1=$(bash scripts/cluster.sh shape-stats)

step "report"
"$VENV_DIR/bin/python" - "$shape_json" <<PY
import json, sys
a, b = json.loads('''$cpu0'''), json.loads('''$cpu1''')
ran = "$workloads".split(",")
shape = {"workers": $WORKERS, "rate": "$rate", "delay_us": $delay, "cpu": $cpu, "rtt_us": $rtt_us,
         "pings": 20, "bulk_mbit_s": $bulk, "workloads": ran, "rounds": $rounds}
# Name a workload's parameters only when it ran: a sortByKey-only report that named an SF and
# a query set would read as if TPC-DS had been measured too.
if "tpcds" in ran:
    shape.update(sf=$sf, queries="$queries")
if "sortbykey" in ran:
    shape["records"] = $records
shape["cpu_used"] = {h: {"cpu_s": round((b[h]["cpu_ns"] - a[h]["cpu_ns"]) / 1e9, 1),
                         "throttled_s": round((b[h]["throttled_ns"] - a[h]["throttled_ns"]) / 1e9, 1),
                         "nr_throttled": b[h]["nr_throttled"] - a[h]["nr_throttled"]} for h in b}
json.dump(shape, open(sys.argv[1], "w"), indent=1)
PY
"$VENV_DIR/bin/python" scripts/shaped_report.py --shape "$shape_json" --tpcds target/bench/tpcds-shaped.json \
  --sortbykey target/bench/shaped-sortbykey.json --out target/bench/shaped.json || rc=1
exit "$rc"
