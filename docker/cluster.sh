#!/usr/bin/env bash
# A Spark standalone cluster of containers: the same unchanged job with Spark's default shuffle
# and with the plugin, outputs compared.
#
#   docker/cluster.sh [JOBS] [SCALE]    JOBS: comma list of ShuffleJobs jobs (terasort,wordcount)
#                                       SCALE: input size, 1 = 1 M records (0.25)
#
# On one podman network, from the image docker/build.sh builds: a master, two workers (one
# executor of one core each) and a driver container (client mode); every node advertises its
# own address. Every container is started as Kubernetes starts a pod: as a non-root user (the
# image's spark, uid 185), with a memory limit, every capability dropped (so no IPC_LOCK), no
# new privileges, and the default locked-memory limit (8 MiB, the kernel's and systemd's
# default); the script checks that inside a worker before the jobs run. One application runs
# twice on that cluster: with Spark's default shuffle (`--conf spark.shuffle.manager=sort`),
# then with the plugin as the image's
# spark-defaults.conf installs it. The script fails unless
#   - both runs succeed and print the same digest for every job;
#   - each executor's engine registered with the driver at its own worker container's address;
#   - the engines ran over tcp (no RDMA device is passed into the containers), each executor
#     saying why in one line (RDMA_SHUFFLE_TRANSPORT) and giving its memory bound
#     (RDMA_SHUFFLE_MEMORY), served in all what they fetched in all, and fetched at least the
#     remote bytes Spark's read metrics count.
# Everything it creates is removed on exit (also on failure); logs stay in target/docker/cluster/.
set -euo pipefail
# shellcheck source=docker/lib.sh
. "$(dirname "$0")/lib.sh"
jobs="${1:-terasort,wordcount}"
scale="${2:-0.25}"

ensure_podman
image_exists "$IMAGE" || { echo "image $IMAGE not found: run docker/build.sh first" >&2; exit 1; }

subnet="${RDMA_DOCKER_SUBNET:-10.89.142.0/24}"
case "$subnet" in *.0/24) ;; *) echo "RDMA_DOCKER_SUBNET must be a /24 ending in .0/24, got '$subnet'" >&2; exit 2 ;; esac
net24="${subnet%.0/24}"
net="${PREFIX}net"
master_ip="$net24.10"
worker_ips=("$net24.11" "$net24.12")
driver_ip="$net24.20"
containers=("${PREFIX}driver" "${PREFIX}worker1" "${PREFIX}worker2" "${PREFIX}master")
OUT="$WORK_DIR/cluster"

teardown() {
  local c
  for c in "${containers[@]}"; do podman rm -f -t 0 "$c" >/dev/null 2>&1 || true; done
  podman network rm -f "$net" >/dev/null 2>&1 || true
}
trap teardown EXIT
trap 'exit 130' INT TERM
teardown # leftovers of an interrupted run of this checkout: same names, ours

if [ -n "$(ip -4 route show "$subnet" 2>/dev/null)" ]; then
  echo "subnet $subnet is already routed on this host ($(ip -4 route show "$subnet")); pick another with RDMA_DOCKER_SUBNET" >&2
  exit 1
fi
rm -rf "$OUT"
mkdir -p "$OUT/worker1" "$OUT/worker2"
# The workers run as uid 185 and write their executors' logs here.
chown 185:185 "$OUT/worker1" "$OUT/worker2"

# As a pod: not root, no capabilities (no IPC_LOCK), the default memlock limit, a memory limit.
# A worker container holds the worker daemon (256 MiB heap) and one executor (640 MiB heap +
# Spark's 384 MiB overhead, what its own pod's limit would be).
# A --ulimit replaces podman's default_ulimits (docker/lib.sh), so nofile and nproc are given
# again, at the values lib.sh keeps within this host's hard limits.
POD_MEMLOCK=8388608
pod_nofile=$(ulimit -Hn)
[ "$pod_nofile" = unlimited ] && pod_nofile=1048576
pod_flags() { # memory limit
  echo --user 185:185 --cap-drop=all --security-opt=no-new-privileges \
    --ulimit "memlock=$POD_MEMLOCK:$POD_MEMLOCK" --ulimit "nofile=$pod_nofile:$pod_nofile" \
    --ulimit nproc=32768:32768 --memory "$1" --memory-swap "$1"
}

step "cluster: network $net ($subnet), master $master_ip, workers ${worker_ips[*]}"
podman network create --subnet "$subnet" "$net" >/dev/null
node() { # name ip args...
  local name=$1 ip=$2
  shift 2
  # conmon inherits podman's stderr and its clean-up later writes "failed to connect to
  # syslog" to it on hosts without syslog: keep that out of the console.
  podman run -d --name "$PREFIX$name" --hostname "$name" --network "$net" --ip "$ip" \
    -e SPARK_DAEMON_MEMORY=256m "$@" > /dev/null 2> "$OUT/podman-$name.log" \
    || { cat "$OUT/podman-$name.log" >&2; echo "podman run of $PREFIX$name failed" >&2; exit 1; }
}
# shellcheck disable=SC2046
node master "$master_ip" $(pod_flags 768m) "$IMAGE" master
for i in 1 2; do
  # shellcheck disable=SC2046
  node "worker$i" "${worker_ips[i - 1]}" $(pod_flags 1792m) -v "$OUT/worker$i:/var/lib/spark/work" \
    "$IMAGE" worker "spark://$master_ip:7077" --cores 1 --memory 1g
done

# The workers are up when the master has registered both. A node that exits stops the wait.
deadline=$(($(date +%s) + 300))
while [ "$(podman logs "${PREFIX}master" 2>&1 | grep -c 'Registering worker')" -lt 2 ]; do
  for c in "${PREFIX}master" "${PREFIX}worker1" "${PREFIX}worker2"; do
    if [ "$(podman inspect -f '{{.State.Running}}' "$c")" != true ]; then
      podman logs "$c" 2>&1 | tail -n 30
      echo "container $c exited while the cluster was starting" >&2
      exit 1
    fi
  done
  if [ "$(date +%s)" -gt "$deadline" ]; then
    podman logs "${PREFIX}master" 2>&1 | tail -n 30
    echo "the master did not register 2 workers within 300 s" >&2
    exit 1
  fi
  sleep 2
done
podman logs "${PREFIX}master" 2>&1 | grep 'Registering worker' | sed 's/.*\(Registering worker\)/  \1/'

# What a process in a worker container gets, as the executor will: uid, capabilities, memlock
# (ulimit -l prints KiB), memory limit (cgroup v2 or v1).
pod=$(podman exec "${PREFIX}worker1" sh -c 'id -u; grep ^CapEff /proc/self/status | cut -f2; ulimit -l;
  cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes' | tr '\n' ' ')
echo "  worker1 as a pod: uid, CapEff, memlock KiB, memory limit = $pod"
read -r uid caps memlock_kib mem_limit <<<"$pod"
[ "$uid" = 185 ] && [ "$caps" = 0000000000000000 ] && [ "$memlock_kib" = $((POD_MEMLOCK / 1024)) ] \
  && [ "$mem_limit" = $((1792 << 20)) ] \
  || { echo "worker1 does not run as a pod would (uid 185, no capabilities, memlock $POD_MEMLOCK, limit 1792m)" >&2; exit 1; }

# submit MODE [spark-submit options...]: runs the jobs from a driver container in client mode.
# The cluster has 2 cores; the application waits until both executors have registered, so the
# map outputs are spread over both containers and every reduce task reads from the other one.
submit() {
  local mode=$1 t0 rc=0
  shift
  step "submit: $jobs (scale $scale) with the $mode shuffle"
  t0=$(date +%s)
  # shellcheck disable=SC2046
  podman run --rm --name "${PREFIX}driver" --hostname driver --network "$net" --ip "$driver_ip" \
    $(pod_flags 1536m) "$IMAGE" \
    spark-submit --master "spark://$master_ip:7077" --driver-memory 768m \
    --conf spark.executor.memory=640m --conf spark.executor.cores=1 --conf spark.cores.max=2 \
    --conf spark.scheduler.minRegisteredResourcesRatio=1.0 \
    --conf spark.scheduler.maxRegisteredResourcesWaitingTime=600s \
    "$@" --class org.apache.spark.shuffle.rdma.jobs.ShuffleJobs /opt/rdma-shuffle/lib/rdma-shuffle-jobs.jar \
    "$jobs" "$scale" > "$OUT/$mode.out" 2> "$OUT/$mode.err" || rc=$?
  echo "$(($(date +%s) - t0))" > "$OUT/$mode.wall"
  if [ "$rc" != 0 ]; then
    tail -n 40 "$OUT/$mode.err"
    echo "spark-submit with the $mode shuffle failed (exit $rc; driver log $OUT/$mode.err)" >&2
    exit 1
  fi
  grep '^DIGEST ' "$OUT/$mode.out" | sed 's/^/  /'
}
submit default --conf spark.shuffle.manager=sort
submit plugin

step "compare"
python3 - "$OUT" "$jobs" "${worker_ips[@]}" <<'EOF'
import glob, os, re, sys

out, jobs, worker_ips = sys.argv[1], sys.argv[2].split(","), set(sys.argv[3:])
read = lambda p: open(os.path.join(out, p), errors="replace").read()
problems = []

def lines(text, marker):
    """{job: {key: value}} of the `MARKER job=<j> k=v ...` lines a run printed."""
    res = {}
    for m in re.finditer(rf"^{marker} job=(\S+) (.*)$", text, re.M):
        res[m.group(1)] = dict(kv.split("=", 1) for kv in m.group(2).split() if "=" in kv)
    return res

runs = {}
for mode in ("default", "plugin"):
    text = read(f"{mode}.out")
    runs[mode] = {
        "digest": {m.group(1): m.group(2) for m in re.finditer(r"^DIGEST job=(\S+) (.*)$", text, re.M)},
        "metrics": lines(text, "SHUFFLE_METRICS"),
        "err": read(f"{mode}.err"),
        "wall": read(f"{mode}.wall").strip(),
    }

print(f"spark-submit wall (incl. executor start-up): default {runs['default']['wall']} s, plugin {runs['plugin']['wall']} s")
print(f"{'job':<10} | {'wall s':>7} {'':>7} | {'remote MB':>9} {'':>9} | digests")
print(f"{'':<10} | {'default':>7} {'plugin':>7} | {'default':>9} {'plugin':>9} |")
remote_plugin = 0
for job in jobs:
    d, p = runs["default"], runs["plugin"]
    dd, pd = d["digest"].get(job), p["digest"].get(job)
    dm, pm = d["metrics"].get(job, {}), p["metrics"].get(job, {})
    equal = dd is not None and dd == pd
    fmt = lambda m, k, div: f"{int(m[k]) / div:.1f}" if k in m else "-"
    print(f"{job:<10} | {fmt(dm, 'wall_ms', 1000):>7} {fmt(pm, 'wall_ms', 1000):>7} | "
          f"{fmt(dm, 'remote_bytes', 1 << 20):>9} {fmt(pm, 'remote_bytes', 1 << 20):>9} | {'equal' if equal else 'DIFFER'}")
    if not equal:
        problems.append(f"{job}: digest default={dd!r} plugin={pd!r}")
    for mode, m in (("default", dm), ("plugin", pm)):
        if int(m.get("remote_bytes", 0)) <= 0:
            problems.append(f"{job}: the {mode} run read no remote shuffle bytes, so nothing crossed containers")
    remote_plugin += int(pm.get("remote_bytes", 0))

if "RdmaShuffleManager created" in runs["default"]["err"] or "RDMA_SHUFFLE_ENGINE_STATS" in runs["default"]["err"]:
    problems.append("the default run instantiated the plugin (spark.shuffle.manager=sort was not honoured)")

err = runs["plugin"]["err"]
registered = {m.group(1): (m.group(2), m.group(3), m.group(4)) for m in re.finditer(
    r"RDMA shuffle engine of executor (\S+) registered at (\S+):(\d+) \(transport (\w+)\)", err)}
stats = {}
for m in re.finditer(r"RDMA_SHUFFLE_ENGINE_STATS (.*)$", err, re.M):
    kv = dict(x.split("=", 1) for x in m.group(1).split() if "=" in x)
    stats[kv.get("executor", "?")] = kv  # the last line of an executor is its final count

print("\nengines (plugin run; registrations, and counters as the driver last heard them, from its log):")
if len(registered) != 2:
    problems.append(f"expected 2 engines registered with the driver, found {sorted(registered)}")
if {h for h, _, _ in registered.values()} != worker_ips:
    problems.append(f"engines registered at {sorted(h for h, _, _ in registered.values())}, "
                    f"expected one in each worker container {sorted(worker_ips)}")
n = lambda kv, k: int(kv.get(k, 0))
for ex in sorted(set(registered) | set(stats)):
    host, port, transport = registered.get(ex, ("?", "?", "?"))
    kv = stats.get(ex)
    if kv is None:
        problems.append(f"executor {ex}: no RDMA_SHUFFLE_ENGINE_STATS line in the driver's log")
        print(f"  executor {ex} at {host}:{port}: no counters")
        continue
    print(f"  executor {ex} at {host}:{port} transport={kv.get('transport')}: "
          f"fetched {n(kv, 'blocks_fetched')} blocks / {n(kv, 'bytes_fetched')} B "
          f"(eager {n(kv, 'eager_blocks_fetched')}, rendezvous {n(kv, 'rendezvous_blocks_fetched')}), "
          f"served {n(kv, 'blocks_served')} blocks / {n(kv, 'bytes_served')} B, "
          f"connections opened {n(kv, 'connections_opened')} accepted {n(kv, 'connections_accepted')}, "
          f"requests native {n(kv, 'native_requests')} delegated {n(kv, 'delegated_requests')}")
    if kv.get("transport") != "tcp" or transport != "tcp":
        problems.append(f"executor {ex}: transport {kv.get('transport')}/{transport}, expected tcp (no RDMA device in the containers)")
# The driver holds each executor's counters as of its last finished reduce task; an engine can
# serve the other executor's fetches after that, so its final count is the line it writes
# itself when it stops (in its worker's log), taken when whole.
app = re.search(r"app ID (app-\S+)", err)
final = {}
if app:
    for log in glob.glob(os.path.join(out, "worker*", app.group(1), "*", "stderr")):
        own = re.findall(r"RDMA_SHUFFLE_ENGINE_STATS (.*)$", open(log, errors="replace").read(), re.M)
        if own:
            kv = dict(x.split("=", 1) for x in own[-1].split() if "=" in x)
            if set(kv) >= set(stats.get(kv.get("executor", "?"), {})):
                final[kv.get("executor", "?")] = kv
# Each executor is alone in its container, so every block an engine fetched came from the other
# container: with every engine's final count, what they served in all is what they fetched in
# all; with a driver's snapshot in the mix, served can only be less.
exact = set(final) == set(stats) and bool(final)
stats.update(final)
fetched = sum(n(kv, "bytes_fetched") for kv in stats.values())
served = sum(n(kv, "bytes_served") for kv in stats.values())
print(f"  engines served {served} B and fetched {fetched} B in all ({'final counts of every engine' if exact else 'some counts are driver snapshots'}); "
      f"Spark counted {remote_plugin} remote shuffle bytes")
if not (remote_plugin > 0 and fetched >= remote_plugin):
    problems.append(f"engines fetched {fetched} B, less than Spark's remote shuffle bytes ({remote_plugin})")
if (served != fetched) if exact else (served > fetched or served == 0):
    problems.append(f"engines served {served} B but fetched {fetched} B")

if app:
    for log in sorted(glob.glob(os.path.join(out, "worker*", app.group(1), "*", "stderr"))):
        text = open(log, errors="replace").read()
        # The manager's one line saying why tcp, and its memory bound line.
        why = re.findall(r"RDMA_SHUFFLE_TRANSPORT executor=\S+ transport=(\w+): ([^\n]*)", text)
        bound = re.findall(r"RDMA_SHUFFLE_MEMORY executor=\S+ bound=(\d+)[^\n]*", text)
        native = "native=loaded" in text
        print(f"  {os.path.relpath(log, out)}: native library {'loaded' if native else 'NOT loaded'}; "
              f"transport: {why[0] if why else 'no RDMA_SHUFFLE_TRANSPORT line'}; bound {bound[0] if bound else '?'} bytes")
        if not native:
            problems.append(f"{log}: the native library did not load in the executor")
        if len(why) != 1 or why[0][0] != "tcp" or "using tcp because verbs is unusable" not in why[0][1]:
            problems.append(f"{log}: expected one line saying why the engine uses tcp, found {why}")
        # 640m executors: Spark's overhead is max(384 MiB, 64 MiB); the engine's bound half of it.
        if bound != [str(192 << 20)]:
            problems.append(f"{log}: expected one memory bound line of {192 << 20} bytes, found {bound}")

if problems:
    print("\nFAILED:\n  " + "\n  ".join(problems))
    sys.exit(1)
print("\nok: outputs equal, and the plugin's engines carried the remote blocks between the worker containers over tcp")
EOF
