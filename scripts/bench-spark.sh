#!/usr/bin/env bash
# Spark-level benchmark: Spark's default shuffle vs the plugin on the project's baseline workload
# (13 M x 110-byte records, below), both modes in every round (default first in odd rounds,
# plugin first in even).
#
#   scripts/bench-spark.sh [--records N] [--rounds R] [--jobs sortByKey,partitionBy,repartition]
#                          [--no-build]
#
# Workload (jvm-plugin/jobs ShuffleBench): N records (default 13 M) of a 10-byte random key and a
# 100-byte random value, 32 map x 32 reduce partitions, shuffled by sortByKey (range), partitionBy
# (hash) and DataFrame repartition(32). One application per mode and round runs all jobs on
# local-cluster[2,1,2048] with the cluster settings of tests/spark/conftest.py CLUSTER_CONF (read
# from that file, so both stay the same: readHostLocalDisk=false etc., so blocks cross executors).
# Each job is timed inside the application after the executors registered and every selected job
# ran once untimed at 1/8 of the size (class loading, connections, JIT): cluster start-up and
# warm-up are not in any timed number. Fetch wait is Spark's shuffleReadMetrics
# fetchWaitTime summed over the job's tasks (a SparkListener in the application).
#
# Prints a table (mean over rounds and their ratio, in how many rounds the plugin was faster, the
# median of the per-round ratios, and every round), the executor CPU spent during each timed job
# by kind of thread (tasks, JIT, GC, transport, other; sampled from /proc), and writes
# target/bench/spark.json:
#   {"jobs": [{"name", "default_s", "plugin_s", "ratio", "default_fetch_wait_ms",
#              "plugin_fetch_wait_ms", ...}], "plugin_engine_stats": {...}, ...}
# and draws target/bench/spark.png (plugin vs default per job, every round a dot; scripts/plot_bench.py).
# Logs of every application: target/bench/spark-logs/.
# Fails when a plugin run did not move its blocks through the native engine (no
# RDMA_SHUFFLE_ENGINE_STATS with fetched blocks in the driver log), or when the outputs of the two
# modes differ. Full size takes ~14 min on 2 cores (2 rounds; 4 rounds ~28 min).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

records=13000000
rounds=2
jobs=sortByKey,partitionBy,repartition
build=yes
while [ $# -gt 0 ]; do
  case "$1" in
    --records) records=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --no-build) build=no; shift ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "bench-spark.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$records" in ''|*[!0-9]*) echo "--records needs a positive integer, got '$records'" >&2; exit 2 ;; esac
case "$rounds" in ''|*[!0-9]*|0) echo "--rounds needs a positive integer, got '$rounds'" >&2; exit 2 ;; esac

step "Spark runtime"
. scripts/spark-env.sh
line=4.x; [ "${RDMA_SPARK_PROFILE:-}" = spark-3.5 ] && line=3.5
plugin_jar="$REPO_ROOT/jvm-plugin/plugin/target/spark-$line/rdma-shuffle-spark${line}_${SCALA_BINARY}-0.1.0-SNAPSHOT.jar"
jobs_jar="$REPO_ROOT/jvm-plugin/jobs/target/spark-$line/rdma-shuffle-jobs-spark${line}_${SCALA_BINARY}-0.1.0-SNAPSHOT.jar"
[ "$build" = no ] || build_plugin
for j in "$plugin_jar" "$jobs_jar"; do
  [ -f "$j" ] || { echo "missing $j (run without --no-build)" >&2; exit 1; }
done
if ! unzip -l "$plugin_jar" | grep -q 'librdma_shuffle_jni'; then
  echo "$plugin_jar bundles no native library: the plugin would hand every shuffle to Spark" >&2
  exit 1
fi

mkdir -p target/bench
step "benchmark: $records records, $rounds round(s), jobs $jobs"
export BENCH_RECORDS=$records BENCH_ROUNDS=$rounds BENCH_JOBS=$jobs \
  BENCH_PLUGIN_JAR=$plugin_jar BENCH_JOBS_JAR=$jobs_jar
"$VENV_DIR/bin/python" - <<'PY'
import ast, glob, json, os, re, shutil, statistics, subprocess, sys, threading, time
from pathlib import Path

repo = Path(os.environ["REPO_ROOT"])
spark_home = os.environ["SPARK_HOME"]
records = int(os.environ["BENCH_RECORDS"])
rounds = int(os.environ["BENCH_ROUNDS"])
jobs = os.environ["BENCH_JOBS"].split(",")
out_dir = repo / "target" / "bench"
logs = out_dir / "spark-logs"
shutil.rmtree(logs, ignore_errors=True)
logs.mkdir(parents=True)

# The cluster settings of the Spark suite, read from its source so the two cannot drift apart.
tree = ast.parse((repo / "tests/spark/conftest.py").read_text())
cluster_conf = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", None) == "CLUSTER_CONF" for t in n.targets))

# Executor threads that move shuffle blocks: the engine's (rdma-shuffle-*) and Netty's shuffle
# transport (shuffle-client-*, shuffle-server-*). Thread names as /proc shows them (15 chars).
TRANSPORT_THREADS = ("rdma-shuffle", "shuffle-client", "shuffle-server")
CPU_KINDS = ("tasks", "jit", "gc", "transport", "other")

def cpu_kind(name):
    """What an executor thread does, by its /proc name: Spark's task threads, the JIT
    compiler's, the garbage collector's (G1 and the VM thread, which runs its pauses), the
    shuffle transport's, or anything else (RPC, heartbeats, block manager, ...)."""
    if name.startswith("Executor task"):
        return "tasks"
    if "CompilerThre" in name:
        return "jit"
    if name.startswith(("GC Thread", "G1 ", "VM Thread")):
        return "gc"
    if name.startswith(TRANSPORT_THREADS):
        return "transport"
    return "other"

def sample_executor_cpu(proc, cpu, series):
    """CPU seconds (user+system) of every thread of every executor JVM of the application,
    sampled from /proc while it runs. Task metrics count only task threads; this also counts
    the engine's threads, Netty's and the JIT compiler's, so the modes compare on all the work
    they cause, and the transport's own share can be told apart. `cpu` keeps each thread's
    latest total (threads that exit keep theirs); `series` gets (epoch s, {kind: total}) per
    sweep, so the CPU of a timed job is the difference between its start and end."""
    tick = os.sysconf("SC_CLK_TCK")
    while proc.poll() is None:
        for d in glob.glob("/proc/[0-9]*"):
            try:
                if b"CoarseGrainedExecutorBackend" not in Path(d, "cmdline").read_bytes():
                    continue
                for t in glob.glob(d + "/task/*"):
                    st = Path(t, "stat").read_text()
                    name = st[st.index("(") + 1:st.rindex(")")]
                    f = st.rsplit(")", 1)[1].split()
                    cpu[t] = (name, (int(f[11]) + int(f[12])) / tick)
            except (OSError, IndexError, ValueError):
                pass
        totals = dict.fromkeys(CPU_KINDS, 0.0)
        for name, c in list(cpu.values()):
            totals[cpu_kind(name)] += c
        series.append((time.time(), totals))
        time.sleep(0.5)

def cpu_between(series, start, end):
    """Executor CPU seconds by kind between two epoch times, interpolated between sweeps."""
    def at(t):
        before = [s for s in series if s[0] <= t]
        after = [s for s in series if s[0] >= t]
        if not before or not after:
            return None
        (t0, a), (t1, b) = before[-1], after[0]
        w = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
        return {k: a[k] + w * (b[k] - a[k]) for k in CPU_KINDS}
    a, b = at(start), at(end)
    if a is None or b is None:
        return None
    return {k: round(b[k] - a[k], 2) for k in CPU_KINDS}

def submit(mode, rnd):
    cmd = [f"{spark_home}/bin/spark-submit", "--master", "local-cluster[2,1,2048]",
           "--driver-memory", "1g"]
    for k, v in cluster_conf.items():
        cmd += ["--conf", f"{k}={v}"]
    if mode == "plugin":
        cmd += ["--conf", "spark.shuffle.manager=org.apache.spark.shuffle.rdma.RdmaShuffleManager",
                "--jars", os.environ["BENCH_PLUGIN_JAR"]]
    cmd += ["--class", "org.apache.spark.shuffle.rdma.jobs.ShuffleBench",
            os.environ["BENCH_JOBS_JAR"], str(records), ",".join(jobs)]
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    cpu, series = {}, []
    sampler = threading.Thread(target=sample_executor_cpu, args=(proc, cpu, series), daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=3600)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    sampler.join()
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    wall = time.monotonic() - t0
    tag = f"round{rnd}-{mode}"
    (logs / f"{tag}.stdout").write_text(p.stdout)
    (logs / f"{tag}.stderr").write_text(p.stderr)
    m = re.search(r"app ID (app-\d+-\d+)", p.stderr)
    executor_logs = {}
    if m:
        for f in sorted(glob.glob(f"{spark_home}/work/{m.group(1)}/*/stderr")):
            n = Path(f).parent.name
            executor_logs[n] = Path(f).read_text(errors="replace")
            (logs / f"{tag}.executor{n}.stderr").write_text(executor_logs[n])
    if p.returncode != 0:
        sys.exit(f"{tag}: spark-submit failed (rc={p.returncode}); see {logs}/{tag}.stderr\n"
                 + p.stderr[-3000:])
    res = {}
    for ln in p.stdout.splitlines():
        if ln.startswith("BENCH "):
            kv = dict(x.split("=", 1) for x in ln.split()[1:])
            res[kv["job"]] = kv
    missing = [j for j in jobs if j not in res]
    if missing:
        sys.exit(f"{tag}: no BENCH line for {missing}; see {logs}/{tag}.stdout")
    load = (load_before, os.getloadavg()[0])
    summary = "  ".join(f"{j} {int(res[j]['wall_ms'])/1000:.1f}s" for j in jobs)
    executor_cpu = sum(c for _, c in cpu.values())
    transport_cpu = sum(c for n, c in cpu.values() if cpu_kind(n) == "transport")
    jit_cpu = sum(c for n, c in cpu.values() if cpu_kind(n) == "jit")
    print(f"  {tag:15s} submit {wall:6.1f}s  load {load[0]:.1f}->{load[1]:.1f}  "
          f"executor cpu {executor_cpu:6.1f}s (shuffle transport {transport_cpu:.1f}s, "
          f"JIT {jit_cpu:.1f}s)  {summary}", flush=True)
    # Executor CPU (all threads) between each timed job's start and end, by kind of thread.
    job_cpu = {j: cpu_between(series, int(res[j]["start_epoch_ms"]) / 1000,
                              int(res[j]["end_epoch_ms"]) / 1000)
               if "start_epoch_ms" in res[j] else None for j in jobs}
    for j in jobs:
        r = res[j]
        jc = job_cpu[j]
        kinds = (f"  executor cpu in job {sum(jc.values()):.1f}s ("
                 + ", ".join(f"{k} {jc[k]:.1f}" for k in CPU_KINDS) + ")") if jc else ""
        print(f"    {j}: map tasks {int(r.get('map_task_ms', 0))/1000:.1f}s "
              f"(cpu {int(r.get('map_cpu_ms', 0))/1000:.1f}s)  reduce tasks "
              f"{int(r.get('reduce_task_ms', 0))/1000:.1f}s (cpu {int(r.get('reduce_cpu_ms', 0))/1000:.1f}s)"
              f"  gc {int(r.get('gc_ms', 0))/1000:.1f}s{kinds}", flush=True)
    return {"jobs": res, "job_cpu": job_cpu, "stderr": p.stderr, "executor_logs": executor_logs,
            "submit_s": wall, "load": load, "executor_cpu_s": executor_cpu,
            "transport_cpu_s": transport_cpu, "jit_cpu_s": jit_cpu}

runs = {"default": [], "plugin": []}
for rnd in range(1, rounds + 1):
    # Odd rounds run default first, even rounds plugin first: whichever runs second inherits
    # the first one's page-cache writeback and the machine's drift, so neither mode always does.
    for mode in (("default", "plugin") if rnd % 2 else ("plugin", "default")):
        runs[mode].append(submit(mode, rnd))

# --- the plugin really used the native engine ---
problems = []
stats_re = re.compile(r"RDMA_SHUFFLE_ENGINE_STATS (.*)$", re.M)
engine_stats = []
for i, r in enumerate(runs["plugin"], 1):
    if not all("native=loaded" in t for t in r["executor_logs"].values()) or len(r["executor_logs"]) != 2:
        problems.append(f"round {i}: the native library did not load on both executors")
    latest = {}
    for m in stats_re.finditer(r["stderr"]):
        kv = dict(x.split("=", 1) for x in m.group(1).split() if "=" in x)
        latest[kv.get("executor", "?")] = kv
    engine_stats.append(latest)
    fetched = sum(int(kv.get("blocks_fetched", 0)) for kv in latest.values())
    fetched_bytes = sum(int(kv.get("bytes_fetched", 0)) for kv in latest.values())
    remote = sum(int(j["remote_bytes"]) for j in r["jobs"].values())
    print(f"\nround {i} plugin: driver's RDMA_SHUFFLE_ENGINE_STATS lines:")
    for ex, kv in sorted(latest.items()):
        keys = ["transport", "native_requests", "delegated_requests", "blocks_fetched",
                "bytes_fetched", "blocks_served", "bytes_served", "eager_blocks_fetched",
                "rendezvous_blocks_fetched", "stream_pulls", "failed_blocks_fetched", "pool_waits",
                "pool_peak_bytes_in_use"]
        print(f"  executor={ex} " + " ".join(f"{k}={kv[k]}" for k in keys if k in kv))
    # The engine's counters cover the whole application, warm-up included; Spark's remote
    # bytes only the timed jobs. So the engine must have fetched at least as much.
    print(f"  engine bytes_fetched {fetched_bytes} (warm-up included) vs Spark remote_bytes "
          f"read by the timed jobs {remote}")
    if set(latest) < {"0", "1"} or fetched == 0 or fetched_bytes < remote:
        problems.append(f"round {i}: engine stats do not show the remote blocks going through "
                        f"the engine ({sorted(latest)}, blocks_fetched={fetched}, "
                        f"bytes_fetched={fetched_bytes}, remote_bytes={remote})")

# --- same output in both modes, blocks crossed executors ---
for j in jobs:
    digests = {(m, r["jobs"][j]["digest"]) for m in runs for r in runs[m]}
    if len({d for _, d in digests}) != 1:
        problems.append(f"{j}: outputs differ between runs: {sorted(digests)}")
    for m in runs:
        for r in runs[m]:
            if int(r["jobs"][j]["remote_bytes"]) == 0:
                problems.append(f"{j}/{m}: no shuffle bytes crossed executors")

# --- table and JSON ---
def col(mode, j, key, scale=1.0):
    return [int(r["jobs"][j][key]) * scale for r in runs[mode]]

rows = []
print(f"\n{records} records x 110 bytes, 32 x 32 partitions, local-cluster[2,1,2048], "
      f"{rounds} round(s), default/plugin order alternating per round; times are per job, "
      f"inside the app\n")
hdr = (f"{'job':12s} | {'default s':>9s} {'plugin s':>9s} {'ratio':>6s} | {'plugin faster':>13s} "
       f"{'median':>6s} | {'fetch wait ms (default / plugin)':>34s} | rounds (default / plugin s)")
print(hdr)
print("-" * len(hdr))
for j in jobs:
    d, p = col("default", j, "wall_ms", 1e-3), col("plugin", j, "wall_ms", 1e-3)
    dw, pw = col("default", j, "fetch_wait_ms"), col("plugin", j, "fetch_wait_ms")
    per_round = [b / a for a, b in zip(d, p)]
    row = {
        "name": j,
        "default_s": round(statistics.mean(d), 2),
        "plugin_s": round(statistics.mean(p), 2),
        "ratio": round(statistics.mean(p) / statistics.mean(d), 3),
        "default_fetch_wait_ms": round(statistics.mean(dw), 1),
        "plugin_fetch_wait_ms": round(statistics.mean(pw), 1),
        # Per round: the two runs of a round are neighbours in time, so under changing load
        # on a shared machine these say more than the ratio of the means.
        "ratio_per_round": [round(r, 3) for r in per_round],
        "median_ratio_per_round": round(statistics.median(per_round), 3),
        "rounds_plugin_faster": sum(r < 1 for r in per_round),
        "default_runs_s": [round(x, 2) for x in d],
        "plugin_runs_s": [round(x, 2) for x in p],
        "default_fetch_wait_runs_ms": dw,
        "plugin_fetch_wait_runs_ms": pw,
        "shuffle_write_bytes": int(runs["default"][0]["jobs"][j]["write_bytes"]),
        "default_remote_bytes": col("default", j, "remote_bytes"),
        "plugin_remote_bytes": col("plugin", j, "remote_bytes"),
        "records": int(runs["default"][0]["jobs"][j]["records"]),
    }
    # Summed over the job's tasks (task threads only), mean over rounds: where the time went.
    for key in ("map_task_ms", "map_cpu_ms", "reduce_task_ms", "reduce_cpu_ms", "gc_ms"):
        if all(key in r["jobs"][j] for m in runs for r in runs[m]):
            row[f"default_{key}"] = round(statistics.mean(col("default", j, key)))
            row[f"plugin_{key}"] = round(statistics.mean(col("plugin", j, key)))
    # Executor CPU (every thread) during the timed job, mean over rounds, by kind of thread.
    if all(r["job_cpu"][j] for m in runs for r in runs[m]):
        for m in runs:
            row[f"{m}_job_cpu_s"] = {k: round(statistics.mean(r["job_cpu"][j][k] for r in runs[m]), 2)
                                     for k in CPU_KINDS}
    rows.append(row)
    fw = f"{row['default_fetch_wait_ms']:.0f} / {row['plugin_fetch_wait_ms']:.0f}"
    rr = " ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(d, p))
    faster = f"{row['rounds_plugin_faster']} of {rounds}"
    print(f"{j:12s} | {row['default_s']:9.1f} {row['plugin_s']:9.1f} {row['ratio']:6.2f} | "
          f"{faster:>13s} {row['median_ratio_per_round']:6.2f} | {fw:>34s} | {rr}")

if all("default_job_cpu_s" in row for row in rows):
    print("\nexecutor CPU s during each timed job (every thread of both executors, sampled from "
          "/proc; mean over rounds), default / plugin:")
    print(f"{'job':12s} | {'total':>13s} | " + " | ".join(f"{k:>11s}" for k in CPU_KINDS))
    for row in rows:
        d, p = row["default_job_cpu_s"], row["plugin_job_cpu_s"]
        print(f"{row['name']:12s} | {sum(d.values()):5.1f} / {sum(p.values()):5.1f} | "
              + " | ".join(f"{d[k]:4.1f} / {p[k]:4.1f}" for k in CPU_KINDS))

report = {
    "workload": {"records": records, "key_bytes": 10, "value_bytes": 100, "map_partitions": 32,
                 "reduce_partitions": 32, "master": "local-cluster[2,1,2048]",
                 "executor_memory": "Spark's default (1g)", "driver_memory": "1g",
                 "cluster_conf": cluster_conf, "rounds": rounds,
                 "order": "default first in odd rounds, plugin first in even rounds", "spark_version": os.environ.get("SPARK_VERSION")},
    "jobs": rows,
    "plugin_engine_stats": engine_stats,
    # 1-minute load average before/after each application: the machine is shared, and other
    # people's work is the largest source of noise in these numbers.
    "load_avg": {m: [[round(x, 2) for x in r["load"]] for r in runs[m]] for m in runs},
    "submit_s": {m: [round(r["submit_s"], 1) for r in runs[m]] for m in runs},
    # CPU seconds of the executor JVMs over each whole application (all jobs, start-up and
    # warm-up included; every thread, the engine's too), sampled from /proc.
    "executor_cpu_s": {m: [round(r["executor_cpu_s"], 1) for r in runs[m]] for m in runs},
    # The part of it on threads that move shuffle blocks (engine: rdma-shuffle-*; Netty:
    # shuffle-client-*, shuffle-server-*), and the JIT compiler's part (large on 2 cores).
    "transport_cpu_s": {m: [round(r["transport_cpu_s"], 1) for r in runs[m]] for m in runs},
    "jit_cpu_s": {m: [round(r["jit_cpu_s"], 1) for r in runs[m]] for m in runs},
    "problems": problems,
    "logs": str(logs),
}
(out_dir / "spark.json").write_text(json.dumps(report, indent=2) + "\n")
print(f"\nreport: {out_dir / 'spark.json'}   logs: {logs}")
if problems:
    print("PROBLEMS:\n  " + "\n  ".join(problems))
    sys.exit(1)
PY

step "plot: target/bench/spark.png"
apt_install python3-matplotlib
/usr/bin/python3 scripts/plot_bench.py spark target/bench/spark.json target/bench/spark.png
