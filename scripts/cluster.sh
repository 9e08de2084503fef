#!/usr/bin/env bash
# A multi-host Spark standalone cluster on one machine: a master, a driver and N workers, each
# in its own network namespace with its own address on a bridge. The bridge lives in a switch
# namespace of its own and every host hangs off it by a veth pair, so a host can be cut off
# (link down) or blackholed (nft drop on the bridge) without touching the machine's network.
#
#   scripts/cluster.sh up N [--shuffle-service]  start master + N workers (one 1-core executor each);
#                                                with --shuffle-service every worker also runs Spark's
#                                                external shuffle service (port 7337), which runs
#                                                with `--conf spark.shuffle.service.enabled=true` use
#   scripts/cluster.sh run [--default|--plugin] [--conf k=v]... JOB [ARGS...]
#   scripts/cluster.sh compare [--rounds R] [--json FILE] [--conf k=v]... JOB [ARGS...]
#   scripts/cluster.sh status
#   scripts/cluster.sh down                      stop every process, remove namespaces and links
#   scripts/cluster.sh shape [--rate R] [--delay-us D] [--cpu C]
#                                                shape the running cluster like hosts of a datacenter:
#                                                every host's link limited to R (tc tbf, both ways,
#                                                e.g. 130mbit), D microseconds added each way (tc
#                                                netem: the kernel must have it), each worker's
#                                                processes limited to C cores (cgroup cpu quota)
#   scripts/cluster.sh shape-stats               per worker: CPU used and time throttled (JSON)
#   scripts/cluster.sh net N                     the hosts' network only (namespaces, bridge,
#                                                addresses), no Spark: for other multi-host tests
#                                                (tests/collective/test_netns.py runs Mobius on it)
#   fault injection (HOST = master | driver | w1..wN):
#   scripts/cluster.sh kill-executor HOST        kill -9 the executor JVM of HOST (exact PID)
#   scripts/cluster.sh cut HOST | heal HOST      switch-side veth of HOST down / up
#   scripts/cluster.sh blackhole HOST | unblackhole HOST   drop every frame to/from HOST on the bridge
#
# JOB is one of the jobs of jvm-plugin/jobs, run unchanged by spark-submit in the driver's namespace:
#   ShuffleJobs:  wordcount | terasort | sql | sparse | bigblock | a comma list | all   ARGS: [scale]
#   ShuffleBench: sortByKey | partitionBy | repartition | a comma list               ARGS: [records]
# or a class name (ShuffleJobs | ShuffleBench | FaultJob) followed by that class's own arguments,
# or a PySpark application FILE.py followed by its arguments (scripts/tpcds.py app ...).
#
# The plugin is installed the way a user installs it: a spark-defaults.conf in the driver's conf
# dir (SPARK_CONF_DIR) with spark.shuffle.manager and the jar (spark.jars on Spark 4.x; on the
# 3.5 line, which creates the shuffle manager before it adds user jars, spark.driver/executor
# .extraClassPath). `run --default` uses a conf dir without those lines: Spark's own shuffle on
# the same cluster. Each run gets a directory (printed at the end) with the driver's output,
# every executor's log, an event log, per-process samples of threads and RSS, and summary.json.
#
# Environment (optional):
#   RDMA_SPARK_PROFILE     "" (Spark 4.2.0, default) | spark-3.5   fixed at `up` for the cluster
#   CLUSTER_EXECUTOR_MEMORY  executor heap (default 512m); CLUSTER_DRIVER_MEMORY (default 1g);
#                          CLUSTER_DAEMON_MEMORY master and worker daemons' heap (default 256m)
#   CLUSTER_PREFIX         prefix of namespaces/links (default rsb2); CLUSTER_SUBNET (default 10.77.0,
#                          a /24); CLUSTER_DIR state and logs (default <repo>/target/cluster)
#   CLUSTER_RUN_TIMEOUT    seconds before a run is killed (default 1800)
#   CLUSTER_RUN_DIR        the directory of the next `run` (default: a new one under runs/); a
#                          harness that watches driver.out while the job runs sets it
#
# Needs root (namespaces, veth, nft). Installs nftables when missing; builds the native library
# and the jars when they are missing.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
. "$HERE/lib.sh"

P="${CLUSTER_PREFIX:-rsb2}"
NET="${CLUSTER_SUBNET:-10.77.0}"
STATE="${CLUSTER_DIR:-$REPO/target/cluster}"
SW="$P-sw"          # the switch namespace, holding the bridge
BR="${P}br"         # the bridge
MASTER_PORT=7077
WORKER_PORT=7078
MAX_WORKERS=16
PLUGIN_CLASS=org.apache.spark.shuffle.rdma.RdmaShuffleManager
JOBS_PKG=org.apache.spark.shuffle.rdma.jobs
SHUFFLE_JOBS="wordcount terasort sql sparse bigblock"
BENCH_JOBS="sortByKey partitionBy repartition"

die() { echo "cluster.sh: $*" >&2; exit 1; }
log() { printf '[cluster %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# --- hosts ---------------------------------------------------------------------------------------

ns_of() { echo "$P-$1"; }                 # host -> its namespace
veth_of() {                               # host -> the switch-side end of its veth pair
  case "$1" in master) echo "$P-m" ;; driver) echo "$P-d" ;; *) echo "$P-$1" ;; esac
}
ip_of() {                                 # host -> its address on the bridge
  case "$1" in
    master) echo "$NET.2" ;;
    driver) echo "$NET.3" ;;
    w[0-9]*) echo "$NET.$((10 + ${1#w}))" ;;
    *) die "unknown host '$1'" ;;
  esac
}
workers() { local n; n=$(state_get N); seq -f 'w%g' 1 "$n"; }
all_hosts() { echo master; echo driver; workers; }
is_host() { all_hosts | grep -qx "$1"; }

# Every namespace this prefix may have made (also those of an earlier, larger cluster).
our_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$P-(sw|master|driver|w[0-9]+)$" || true
}

# --- state ---------------------------------------------------------------------------------------

state_get() { # KEY
  [ -f "$STATE/cluster.env" ] || die "no cluster is up (no $STATE/cluster.env); run: scripts/cluster.sh up N"
  local v; v=$(sed -n "s/^$1=//p" "$STATE/cluster.env")
  [ -n "$v" ] || die "cluster state has no $1"
  echo "$v"
}

# Loads the Spark runtime of the cluster's Spark line (or of RDMA_SPARK_PROFILE before `up`).
load_spark() {
  if [ -f "$STATE/cluster.env" ]; then
    RDMA_SPARK_PROFILE="$(sed -n 's/^PROFILE=//p' "$STATE/cluster.env")"
  fi
  export RDMA_SPARK_PROFILE="${RDMA_SPARK_PROFILE:-}"
  . "$HERE/spark-env.sh"
  LINE=4.x; [ "$RDMA_SPARK_PROFILE" = spark-3.5 ] && LINE=3.5
  PLUGIN_JAR="$REPO/jvm-plugin/plugin/target/spark-$LINE/rdma-shuffle-spark${LINE}_${SCALA_BINARY}-0.1.0-SNAPSHOT.jar"
  JOBS_JAR="$REPO/jvm-plugin/jobs/target/spark-$LINE/rdma-shuffle-jobs-spark${LINE}_${SCALA_BINARY}-0.1.0-SNAPSHOT.jar"
  PY="$VENV_DIR/bin/python"
}

# Builds what is missing: the native library (bundled into the plugin jar) and both jars.
ensure_jars() {
  local native
  native="$REPO/jvm-plugin/plugin/target/native/org/apache/spark/shuffle/rdma/native/linux/$(uname -m)/librdma_shuffle_jni_tcp.so"
  if [ ! -f "$native" ]; then
    log "building the native engine (scripts/build-native.sh)"
    mkdir -p "$REPO/target"
    bash "$HERE/build-native.sh" > "$REPO/target/build-native.log" 2>&1 \
      || { tail -n 30 "$REPO/target/build-native.log"; die "native build failed (log: target/build-native.log)"; }
  fi
  if [ ! -f "$PLUGIN_JAR" ] || [ ! -f "$JOBS_JAR" ]; then
    log "building jvm-plugin (Spark $SPARK_VERSION)"
    (cd "$REPO/jvm-plugin" && mvn -q -B package -DskipTests ${RDMA_SPARK_PROFILE:+-P$RDMA_SPARK_PROFILE}) \
      || die "maven build failed"
  fi
  [ -f "$PLUGIN_JAR" ] && [ -f "$JOBS_JAR" ] || die "jars missing after the build: $PLUGIN_JAR $JOBS_JAR"
}

# --- processes -----------------------------------------------------------------------------------

# Starts a command in HOST's namespace, detached (own session), output to LOG. Every process
# gets the host's own address and directories; nothing is shared but the file system.
start_in() { # HOST LOG CMD...
  local host=$1 logf=$2; shift 2
  local dir="$STATE/hosts/$host"
  ip netns exec "$(ns_of "$host")" env \
    JAVA_HOME="$JAVA_HOME" SPARK_HOME="$SPARK_HOME" \
    SPARK_LOCAL_IP="$(ip_of "$host")" SPARK_LOCAL_HOSTNAME="$(ip_of "$host")" \
    SPARK_CONF_DIR="$dir/conf" SPARK_LOCAL_DIRS="$dir/local" SPARK_LOG_DIR="$dir" \
    SPARK_DAEMON_MEMORY="${CLUSTER_DAEMON_MEMORY:-256m}" \
    setsid "$@" </dev/null >"$logf" 2>&1 &
}

# PIDs of the processes in HOST's namespace whose command line contains PATTERN. A child that
# a matching JVM forked and that has not exec'd yet carries the same command line: skipped.
pids_matching() { # HOST PATTERN
  local pid ppid
  for pid in $(ip netns pids "$(ns_of "$1")" 2>/dev/null); do
    tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$2" || continue
    ppid=$(awk '/^PPid:/ { print $2 }' "/proc/$pid/status" 2>/dev/null)
    [ -n "$ppid" ] && tr '\0' ' ' < "/proc/$ppid/cmdline" 2>/dev/null | grep -q -- "$2" && continue
    echo "$pid"
  done
  return 0
}

wait_for_line() { # FILE PATTERN SECONDS WHAT
  local deadline=$(( $(date +%s) + $3 ))
  until grep -q -- "$2" "$1" 2>/dev/null; do
    [ "$(date +%s)" -lt "$deadline" ] || { tail -n 20 "$1" >&2 2>/dev/null || true; die "$4: no '$2' in $1 within $3 s"; }
    sleep 0.5
  done
}

# --- up / down -----------------------------------------------------------------------------------

do_down() {
  local ns pid left
  for ns in $(our_namespaces); do
    # Every process in our namespaces was started by this script: TERM, then KILL by PID.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null || true; done
  done
  for _ in $(seq 1 20); do
    left=0
    for ns in $(our_namespaces); do [ -n "$(ip netns pids "$ns" 2>/dev/null)" ] && left=1; done
    [ "$left" = 0 ] && break
    sleep 0.5
  done
  for ns in $(our_namespaces); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
  done
  for ns in $(our_namespaces); do
    for _ in $(seq 1 20); do [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break; sleep 0.2; done
    # Deleting the switch namespace removes the bridge and every veth pair with it.
    ip netns del "$ns" 2>/dev/null || log "could not delete namespace $ns"
  done
  local cg
  for cg in "$CG_CPU/$P"-* "$CG_ACCT/$P"-*; do [ -d "$cg" ] && { rmdir "$cg" 2>/dev/null || log "could not remove cgroup $cg"; }; done
  # Shuffle files and scratch space go; logs of past runs stay under $STATE/runs.
  rm -rf "$STATE"/hosts/*/local 2>/dev/null || true
  rm -f "$STATE/cluster.env"
  [ -z "$(our_namespaces)" ] || die "namespaces left behind: $(our_namespaces | tr '\n' ' ')"
}

make_network() { # N
  local n=$1 host ns veth
  ip netns add "$SW"
  ip -n "$SW" link set lo up
  ip -n "$SW" link add "$BR" type bridge
  ip -n "$SW" link set "$BR" up
  # Blackholing: a set of switch-side ports whose frames the bridge drops, both directions.
  ip netns exec "$SW" nft -f - <<EOF
table bridge $P {
  set holes { type ifname; }
  chain forward_filter {
    type filter hook forward priority 0; policy accept;
    iifname @holes drop
    oifname @holes drop
  }
}
EOF
  for host in master driver $(seq -f 'w%g' 1 "$n"); do
    ns=$(ns_of "$host"); veth=$(veth_of "$host")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$SW" link add "$veth" type veth peer name eth0 netns "$ns"
    ip -n "$SW" link set "$veth" master "$BR"
    ip -n "$SW" link set "$veth" up
    ip -n "$ns" addr add "$(ip_of "$host")/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

# The driver's conf dirs: one with the plugin installed, one without (Spark's own shuffle).
write_driver_confs() { # N
  local n=$1 mode f
  for mode in plugin default; do
    mkdir -p "$STATE/conf/$mode"
    f="$STATE/conf/$mode/spark-defaults.conf"
    {
      echo "# scripts/cluster.sh: the driver's spark-defaults.conf ($mode shuffle)"
      echo "spark.master                                      spark://$(ip_of master):$MASTER_PORT"
      echo "spark.driver.memory                               ${CLUSTER_DRIVER_MEMORY:-1g}"
      echo "spark.executor.memory                             ${CLUSTER_EXECUTOR_MEMORY:-512m}"
      echo "spark.executor.cores                              1"
      echo "spark.cores.max                                   $n"
      echo "# Start tasks only once every worker's executor has registered (standalone counts cores.max)."
      echo "spark.scheduler.minRegisteredResourcesRatio       1.0"
      echo "spark.scheduler.maxRegisteredResourcesWaitingTime 120s"
      echo "spark.ui.enabled                                  false"
      echo "spark.eventLog.enabled                            true"
      if [ "$mode" = plugin ]; then
        echo "# The plugin, installed as a user installs it."
        echo "spark.shuffle.manager                             $PLUGIN_CLASS"
        if [ "$LINE" = 3.5 ]; then
          # Spark 3.5 creates the shuffle manager before it adds spark.jars to the class path.
          echo "spark.driver.extraClassPath                       $PLUGIN_JAR"
          echo "spark.executor.extraClassPath                     $PLUGIN_JAR"
        else
          echo "spark.jars                                        $PLUGIN_JAR"
        fi
      fi
    } > "$f"
  done
}

do_up() {
  local n=${1:-} service=0
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$MAX_WORKERS" ] \
    || die "usage: scripts/cluster.sh up N [--shuffle-service]   (1 <= N <= $MAX_WORKERS)"
  case "${2:-}" in
    "") ;;
    --shuffle-service) service=1 ;;
    *) die "usage: scripts/cluster.sh up N [--shuffle-service]" ;;
  esac
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces, veth pairs, nft)"
  apt_install nftables iproute2 procps
  rm -f "$STATE/cluster.env"    # a fresh `up` takes RDMA_SPARK_PROFILE from the environment
  load_spark
  ensure_jars
  local t0; t0=$(date +%s.%N)
  [ -z "$(our_namespaces)" ] || { log "cleaning up a previous cluster: $(our_namespaces | tr '\n' ' ')"; do_down; }
  # Any failure from here on tears down what was made.
  trap 'rc=$?; trap - EXIT; if [ $rc -ne 0 ]; then log "up failed (rc=$rc); tearing down"; do_down || true; fi; exit $rc' EXIT
  trap 'exit 130' INT TERM
  rm -rf "$STATE/hosts" "$STATE/conf"
  mkdir -p "$STATE/runs"
  local host
  for host in master driver $(seq -f 'w%g' 1 "$n"); do
    mkdir -p "$STATE/hosts/$host/conf" "$STATE/hosts/$host/local" "$STATE/hosts/$host/work"
  done
  cat > "$STATE/cluster.env" <<EOF
N=$n
PROFILE=$RDMA_SPARK_PROFILE
SPARK_VERSION=$SPARK_VERSION
PREFIX=$P
SUBNET=$NET
EXECUTOR_MEMORY=${CLUSTER_EXECUTOR_MEMORY:-512m}
SHUFFLE_SERVICE=$service
EOF
  make_network "$n"
  write_driver_confs "$n"
  local t_net; t_net=$(date +%s.%N)

  start_in master "$STATE/hosts/master/daemon.log" "$SPARK_HOME/bin/spark-class" \
    org.apache.spark.deploy.master.Master --host "$(ip_of master)" --port "$MASTER_PORT" --webui-port 8080
  wait_for_line "$STATE/hosts/master/daemon.log" "I have been elected leader" 180 "master"
  for host in $(seq -f 'w%g' 1 "$n"); do
    if [ "$service" = 1 ]; then
      # The worker reads its own conf dir's spark-defaults.conf: it starts Spark's external
      # shuffle service in its JVM, as `spark.shuffle.service.enabled` on a worker does.
      printf 'spark.shuffle.service.enabled true\n' > "$STATE/hosts/$host/conf/spark-defaults.conf"
    fi
    start_in "$host" "$STATE/hosts/$host/daemon.log" "$SPARK_HOME/bin/spark-class" \
      org.apache.spark.deploy.worker.Worker --host "$(ip_of "$host")" --port "$WORKER_PORT" \
      --webui-port 8081 --cores 1 --memory "${CLUSTER_EXECUTOR_MEMORY:-512m}" \
      --work-dir "$STATE/hosts/$host/work" "spark://$(ip_of master):$MASTER_PORT"
  done
  for host in $(seq -f 'w%g' 1 "$n"); do
    wait_for_line "$STATE/hosts/$host/daemon.log" "Successfully registered with master" 240 "worker $host"
  done
  trap - EXIT INT TERM
  awk -v a="$t_net" -v b="$t0" -v c="$(date +%s.%N)" \
    'BEGIN { printf "[cluster] up: %d workers, network %.2f s, daemons %.1f s\n", '"$n"', a - b, c - a }'
  do_status
}

# The network of `up` without Spark: namespaces master, driver and w1..wN on the bridge, each
# with its address, `lo` up and no default route. Prints `host namespace address` per worker.
do_net() {
  local n=${1:-}
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$MAX_WORKERS" ] \
    || die "usage: scripts/cluster.sh net N   (1 <= N <= $MAX_WORKERS)"
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces, veth pairs, nft)"
  apt_install nftables iproute2 procps
  [ -z "$(our_namespaces)" ] || { log "cleaning up a previous cluster: $(our_namespaces | tr '\n' ' ')"; do_down; }
  mkdir -p "$STATE"
  printf 'N=%s\nPREFIX=%s\nSUBNET=%s\nNETWORK_ONLY=1\n' "$n" "$P" "$NET" > "$STATE/cluster.env"
  trap 'rc=$?; trap - EXIT; if [ $rc -ne 0 ]; then log "net failed (rc=$rc); tearing down"; do_down || true; fi; exit $rc' EXIT
  make_network "$n"
  trap - EXIT
  local host
  for host in $(seq -f 'w%g' 1 "$n"); do echo "$host $(ns_of "$host") $(ip_of "$host")"; done
}

# --- status and faults ---------------------------------------------------------------------------

do_status() {
  local n host ns role pid
  n=$(state_get N)
  local ess=""
  [ "$(sed -n 's/^SHUFFLE_SERVICE=//p' "$STATE/cluster.env")" = 1 ] && ess=", external shuffle service on every worker"
  echo "cluster: $n workers, Spark $(state_get SPARK_VERSION)${RDMA_SPARK_PROFILE:+ ($RDMA_SPARK_PROFILE)}, master spark://$(ip_of master):$MASTER_PORT$ess, state $STATE"
  local holes; holes=$(ip netns exec "$SW" nft list set bridge "$P" holes 2>/dev/null | sed -n 's/.*elements = { \(.*\) }/\1/p')
  for host in $(all_hosts); do
    ns=$(ns_of "$host")
    local link; link=$(ip -n "$SW" -br link show dev "$(veth_of "$host")" 2>/dev/null | awk '{print $2}')
    local bh=""; echo "$holes" | grep -q "\"$(veth_of "$host")\"" && bh=" BLACKHOLED"
    local procs=""
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      case "$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)" in
        *CoarseGrainedExecutorBackend*) role=executor ;;
        *deploy.worker.Worker*) role=worker ;;
        *deploy.master.Master*) role=master ;;
        *SparkSubmit*) role=driver ;;
        *) role=other ;;
      esac
      procs+=" $role:$pid"
    done
    printf '  %-7s %-12s %-13s link=%s%s procs:%s\n' "$host" "$ns" "$(ip_of "$host")" "${link:-missing}" "$bh" "${procs:- none}"
  done
}

need_host() { # HOST
  state_get N >/dev/null
  is_host "$1" || die "unknown host '$1'; hosts: $(all_hosts | tr '\n' ' ')"
}

do_kill_executor() { # HOST
  need_host "$1"
  local pids; pids=$(pids_matching "$1" CoarseGrainedExecutorBackend)
  [ -n "$pids" ] || die "no executor JVM runs on $1 (namespace $(ns_of "$1"))"
  local pid
  for pid in $pids; do kill -KILL "$pid"; echo "killed executor of $1: pid $pid"; done
}

do_link() { # HOST up|down
  need_host "$1"
  ip -n "$SW" link set "$(veth_of "$1")" "$2"
  echo "$1: switch port $(veth_of "$1") $2"
}

do_blackhole() { # HOST add|delete
  need_host "$1"
  ip netns exec "$SW" nft "$2" element bridge "$P" holes "{ \"$(veth_of "$1")\" }"
  echo "$1: blackhole $([ "$2" = add ] && echo on || echo off)"
}

# --- shaping: a datacenter's links and a CPU share per host --------------------------------------

CG_CPU=/sys/fs/cgroup/cpu
CG_ACCT=/sys/fs/cgroup/cpuacct

# tbf RATE: a token bucket at RATE whose bucket holds 1 ms of it, at least a 64 KiB GSO frame
# (tbf splits larger ones), and a queue of 20 ms (325 KB at 130 Mbit/s, a congested port's share
# of a switch's buffer). With 10 ms, TCP's 64 KiB offload frames overflowed it: a 3 s iperf3
# between two workers at 130 Mbit/s retransmitted 385-33 811 segments; with 20 ms, 0-1, at the
# same rate, and a ping beside it saw 2-16 ms.
tbf_args() { # RATE
  local bits burst
  bits=$(tc_rate_bits "$1")
  burst=$(( bits / 8 / 1000 )); [ "$burst" -ge 65536 ] || burst=65536
  echo "rate $1 burst $burst latency 20ms"
}

tc_rate_bits() { # RATE (tc's units: 100mbit, 1gbit, 500kbit) -> bits per second
  local v=${1%[a-zA-Z]*} u=${1##*[0-9.]}
  case "$u" in
    gbit) awk -v v="$v" 'BEGIN { printf "%d", v * 1e9 }' ;;
    mbit) awk -v v="$v" 'BEGIN { printf "%d", v * 1e6 }' ;;
    kbit) awk -v v="$v" 'BEGIN { printf "%d", v * 1e3 }' ;;
    bit|"") awk -v v="$v" 'BEGIN { printf "%d", v }' ;;
    *) die "rate '$1': use a number with kbit, mbit or gbit" ;;
  esac
}

# Limits one direction of a link: the switch side's egress (frames to HOST) or HOST's own eth0
# egress (frames from it). With a delay, netem sits under tbf (its one class).
shape_dev() { # NS DEV RATE DELAY_US
  local ns=$1 dev=$2
  # shellcheck disable=SC2046
  ip netns exec "$ns" tc qdisc replace dev "$dev" root handle 1: tbf $(tbf_args "$3")
  if [ "$4" != 0 ]; then
    ip netns exec "$ns" tc qdisc add dev "$dev" parent 1:1 handle 10: netem delay "${4}us" limit 100000
  fi
}

do_shape() {
  local rate="" delay=0 cpu="" host ns pid
  while [ $# -gt 0 ]; do
    case "$1" in
      --rate) rate=$2; shift 2 ;;
      --delay-us) delay=$2; shift 2 ;;
      --cpu) cpu=$2; shift 2 ;;
      *) die "shape: unknown option '$1' (--rate R --delay-us D --cpu C)" ;;
    esac
  done
  state_get N >/dev/null
  [[ "$delay" =~ ^[0-9]+$ ]] || die "--delay-us needs whole microseconds, got '$delay'"
  if [ "$delay" != 0 ]; then
    # Probe on a throwaway link: tc's error for a missing qdisc is "Specified qdisc kind is unknown".
    ip -n "$SW" link add "$P-probe0" type veth peer name "$P-probe1"
    local ok=1
    ip netns exec "$SW" tc qdisc add dev "$P-probe0" root netem delay 1us 2>/dev/null || ok=0
    ip -n "$SW" link del "$P-probe0"
    [ "$ok" = 1 ] || die "--delay-us: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so no delay can be added; run with --delay-us 0 (the path's own round trip is measured and reported)"
  fi
  if [ -n "$rate" ]; then
    tc_rate_bits "$rate" >/dev/null
    for host in $(all_hosts); do
      shape_dev "$SW" "$(veth_of "$host")" "$rate" "$delay"     # to the host
      shape_dev "$(ns_of "$host")" eth0 "$rate" "$delay"        # from the host
    done
    log "links: $rate each way per host, +${delay} us each way ($(tbf_args "$rate"))"
  fi
  if [ -n "$cpu" ]; then
    [[ "$cpu" =~ ^[0-9]*\.?[0-9]+$ ]] || die "--cpu needs a number of cores, got '$cpu'"
    [ -d "$CG_CPU" ] && [ -d "$CG_ACCT" ] || die "no cgroup v1 cpu and cpuacct hierarchies at $CG_CPU, $CG_ACCT"
    local quota; quota=$(awk -v c="$cpu" 'BEGIN { printf "%d", c * 100000 }')
    for host in $(workers); do
      mkdir -p "$CG_CPU/$P-$host" "$CG_ACCT/$P-$host"
      echo 100000 > "$CG_CPU/$P-$host/cpu.cfs_period_us"
      echo "$quota" > "$CG_CPU/$P-$host/cpu.cfs_quota_us"
      # The worker daemon and whatever runs already; the executors it starts later inherit it.
      for pid in $(ip netns pids "$(ns_of "$host")"); do
        echo "$pid" > "$CG_CPU/$P-$host/cgroup.procs" 2>/dev/null || true
        echo "$pid" > "$CG_ACCT/$P-$host/cgroup.procs" 2>/dev/null || true
      done
    done
    log "CPU: each worker's processes limited to $cpu cores (cfs quota $quota us per 100000 us)"
  fi
  sed -i '/^SHAPE_/d' "$STATE/cluster.env"
  printf 'SHAPE_RATE=%s\nSHAPE_DELAY_US=%s\nSHAPE_CPU=%s\n' "${rate:-none}" "$delay" "${cpu:-none}" >> "$STATE/cluster.env"
}

do_shape_stats() {
  local host first=1
  printf '{'
  for host in $(workers); do
    [ -f "$CG_ACCT/$P-$host/cpuacct.usage" ] || continue
    [ "$first" = 1 ] || printf ','
    first=0
    printf '"%s": {"cpu_ns": %s, "throttled_ns": %s, "nr_throttled": %s}' "$host" \
      "$(cat "$CG_ACCT/$P-$host/cpuacct.usage")" \
      "$(awk '$1 == "throttled_time" { print $2 }' "$CG_CPU/$P-$host/cpu.stat")" \
      "$(awk '$1 == "nr_throttled" { print $2 }' "$CG_CPU/$P-$host/cpu.stat")"
  done
  printf '}\n'
}

# --- run / compare -------------------------------------------------------------------------------

# Maps JOB [ARGS] to a class and its arguments; sets JOB_CLASS, JOB_APP (what spark-submit
# runs: --class CLASS JOBS_JAR, or a .py file) and JOB_ARGS.
resolve_job() {
  local job=$1; shift
  JOB_APP=()
  case "$job" in
    ShuffleJobs|ShuffleBench|FaultJob) JOB_CLASS="$JOBS_PKG.$job"; JOB_ARGS=("$@"); return ;;
    *.py) [ -f "$job" ] || die "no PySpark application '$job'"
          JOB_CLASS=""; JOB_APP=("$(readlink -f "$job")"); JOB_ARGS=("$@"); return ;;
  esac
  local names j k kind=""
  IFS=, read -r -a names <<< "$job"
  for j in "${names[@]}"; do
    if [ "$j" = all ] || echo " $SHUFFLE_JOBS " | grep -q " $j "; then k="jobs"
    elif echo " $BENCH_JOBS " | grep -q " $j "; then k="bench"
    else die "unknown job '$j'; ShuffleJobs: $SHUFFLE_JOBS all; ShuffleBench: $BENCH_JOBS"; fi
    [ -z "$kind" ] || [ "$kind" = "$k" ] || die "'$job' mixes ShuffleJobs and ShuffleBench jobs"
    kind=$k
  done
  if [ "$kind" = jobs ]; then
    JOB_CLASS="$JOBS_PKG.ShuffleJobs"; JOB_ARGS=("$job" "$@")
  else
    # ShuffleBench takes the record count first; its default is the full 13 M.
    JOB_CLASS="$JOBS_PKG.ShuffleBench"; JOB_ARGS=("${1:-13000000}" "$job")
  fi
}

# One spark-submit in the driver's namespace. Sets RUN_DIR; returns spark-submit's exit code.
run_once() { # MODE JOB [ARGS...]   (extra --conf pairs in the CONFS array)
  local mode=$1; shift
  resolve_job "$@"
  [ ${#JOB_APP[@]} -gt 0 ] || JOB_APP=(--class "$JOB_CLASS" "$JOBS_JAR")
  local tag; tag="$(date +%Y%m%d-%H%M%S)-$mode-$(basename "$1" | tr ',' '+')"
  RUN_DIR="$STATE/runs/$tag"
  local i=1; while [ -e "$RUN_DIR" ]; do RUN_DIR="$STATE/runs/$tag.$i"; i=$((i + 1)); done
  if [ -n "${CLUSTER_RUN_DIR:-}" ]; then
    [ ! -e "$CLUSTER_RUN_DIR/driver.out" ] || die "CLUSTER_RUN_DIR $CLUSTER_RUN_DIR holds a run already"
    RUN_DIR=$CLUSTER_RUN_DIR
  fi
  mkdir -p "$RUN_DIR/eventlog" "$RUN_DIR/executors"
  local hosts; hosts="master,driver,$(workers | paste -sd,)"
  # Threads and RSS of every process of every host, sampled from outside the cluster.
  "$PY" "$HERE/cluster_metrics.py" sample --prefix "$P" --hosts "$hosts" \
    --out "$RUN_DIR/samples.jsonl" --stop "$RUN_DIR/.stop" &
  local sampler=$!
  # shellcheck disable=SC2064
  trap "touch '$RUN_DIR/.stop'; wait $sampler 2>/dev/null || true" EXIT
  local t0 t1 rc=0
  t0=$(date +%s.%N)
  ip netns exec "$(ns_of driver)" env \
    JAVA_HOME="$JAVA_HOME" SPARK_HOME="$SPARK_HOME" \
    SPARK_LOCAL_IP="$(ip_of driver)" SPARK_LOCAL_HOSTNAME="$(ip_of driver)" \
    SPARK_CONF_DIR="$STATE/conf/$mode" SPARK_LOCAL_DIRS="$STATE/hosts/driver/local" \
    timeout --kill-after=30 "${CLUSTER_RUN_TIMEOUT:-1800}" \
    "$SPARK_HOME/bin/spark-submit" --conf "spark.eventLog.dir=file://$RUN_DIR/eventlog" \
    ${CONFS[@]+"${CONFS[@]}"} "${JOB_APP[@]}" "${JOB_ARGS[@]}" \
    > "$RUN_DIR/driver.out" 2> "$RUN_DIR/driver.err" < /dev/null || rc=$?
  t1=$(date +%s.%N)
  touch "$RUN_DIR/.stop"; wait "$sampler" 2>/dev/null || true; trap - EXIT
  local app; app=$(grep -o 'app ID app-[0-9-]*' "$RUN_DIR/driver.err" | head -n 1 | cut -d' ' -f3 || true)
  local host f
  # The workers stop the application's executors after the driver has gone; their last log
  # lines (the engine's counters at stop) are written then, so copy the logs after that.
  local deadline=$(( $(date +%s) + 60 )) busy=1
  while [ "$busy" = 1 ] && [ "$(date +%s)" -lt "$deadline" ]; do
    busy=0
    for host in $(workers); do [ -n "$(pids_matching "$host" CoarseGrainedExecutorBackend)" ] && busy=1; done
    [ "$busy" = 0 ] || sleep 0.5
  done
  [ "$busy" = 0 ] || log "executors still running 60 s after the driver exited; copying their logs as they are"
  if [ -n "$app" ]; then
    for host in $(workers); do
      for f in "$STATE/hosts/$host/work/$app"/*/stderr; do
        [ -f "$f" ] && cp "$f" "$RUN_DIR/executors/$host.exec$(basename "$(dirname "$f")").stderr"
      done
    done
  fi
  # What summarize needs to know about the run (one value per line, arguments one per line).
  cat > "$RUN_DIR/meta.env" <<EOF
mode=$mode
job=$1
class=$JOB_CLASS
rc=$rc
submit_wall_s=$(awk -v a="$t1" -v b="$t0" 'BEGIN { printf "%.3f", a - b }')
app_id=$app
workers=$(state_get N)
spark_version=$SPARK_VERSION
profile=$RDMA_SPARK_PROFILE
executor_memory=$(state_get EXECUTOR_MEMORY)
EOF
  printf '%s\n' "${JOB_ARGS[@]}" > "$RUN_DIR/args.txt"
  printf '%s\n' ${CONFS[@]+"${CONFS[@]}"} > "$RUN_DIR/confs.txt"
  "$PY" "$HERE/cluster_metrics.py" summarize "$RUN_DIR" || { [ "$rc" -ne 0 ] || rc=1; }
  return "$rc"
}

parse_run_opts() { # sets MODE, ROUNDS, JSON_OUT, CONFS, REST
  MODE=plugin; ROUNDS=1; JSON_OUT="$REPO/target/bench/cluster.json"; CONFS=(); REST=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --default) MODE=default ;;
      --plugin) MODE=plugin ;;
      --rounds) ROUNDS=$2; shift ;;
      --json) JSON_OUT=$2; shift ;;
      --conf) CONFS+=(--conf "$2"); shift ;;
      -*) die "unknown option '$1'" ;;
      *) REST=("$@"); break ;;
    esac
    shift
  done
  [ ${#REST[@]} -gt 0 ] || die "missing JOB; see the top of scripts/cluster.sh"
}

do_run() {
  parse_run_opts "$@"
  state_get N >/dev/null
  load_spark
  local rc=0
  run_once "$MODE" "${REST[@]}" || rc=$?
  echo "run directory: $RUN_DIR  (driver.out/.err, executors/, eventlog/, samples.jsonl, summary.json)"
  return "$rc"
}

do_compare() {
  parse_run_opts "$@"
  [[ "$ROUNDS" =~ ^[0-9]+$ ]] && [ "$ROUNDS" -ge 1 ] || die "--rounds must be a positive integer"
  state_get N >/dev/null
  load_spark
  local runs=() r mode rc=0
  for r in $(seq 1 "$ROUNDS"); do
    # Alternate which mode goes first, so that neither always runs on a warmer machine.
    local order="default plugin"; [ $((r % 2)) = 0 ] && order="plugin default"
    for mode in $order; do
      log "round $r/$ROUNDS: $mode shuffle: ${REST[*]}"
      run_once "$mode" "${REST[@]}" || { rc=$?; log "$mode run failed (rc=$rc): $RUN_DIR/driver.err"; }
      runs+=("$RUN_DIR")
    done
  done
  mkdir -p "$(dirname "$JSON_OUT")"
  "$PY" "$HERE/cluster_metrics.py" compare --out "$JSON_OUT" "${runs[@]}" || rc=1
  echo "report: $JSON_OUT"
  return "$rc"
}

# --- main ----------------------------------------------------------------------------------------

cmd=${1:-}; [ $# -gt 0 ] && shift
case "$cmd" in
  up) do_up "$@" ;;
  down) do_down; echo "cluster down (prefix $P)" ;;
  net) do_net "$@" ;;
  shape) do_shape "$@" ;;
  shape-stats) do_shape_stats ;;
  status) load_spark >/dev/null 2>&1 || true; do_status ;;
  run) do_run "$@" ;;
  compare) do_compare "$@" ;;
  kill-executor) [ $# = 1 ] || die "usage: kill-executor HOST"; do_kill_executor "$1" ;;
  cut) [ $# = 1 ] || die "usage: cut HOST"; do_link "$1" down ;;
  heal) [ $# = 1 ] || die "usage: heal HOST"; do_link "$1" up ;;
  blackhole) [ $# = 1 ] || die "usage: blackhole HOST"; do_blackhole "$1" add ;;
  unblackhole) [ $# = 1 ] || die "usage: unblackhole HOST"; do_blackhole "$1" delete ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; [ -z "$cmd" ] || [ "$cmd" = help ] || exit 2 ;;
esac
