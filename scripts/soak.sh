#!/usr/bin/env bash
# Soak: one Spark application with many small shuffles, looking for anything that grows with
# the number of shuffles (issue 14).
#
#   scripts/soak.sh [--shuffles N] [--every C] [--mode plugin|default] [--out PATH] [--no-build]
#                   [--replay DIR]   (re-check the driver.stdout a run saved in DIR, no Spark)
#
# Runs jvm-plugin/jobs SoakJob on local-cluster[2,1,1024] with the plugin installed as
# tests/spark/conftest.py installs it (and that file's CLUSTER_CONF, read from it), plus Spark's
# JmxSink on the executors so the job can read the engine's gauges (metrics source
# `rdmaShuffle`). N shuffles (default 2000), each checked against the same records computed in
# the driver; the job keeps only weak references to them, so Spark's ContextCleaner unregisters
# them after the driver's GC. Every C shuffles (default 10 below 1000 shuffles, else 20) the job
# runs System.gc() in the driver, waits until every engine holds no more shuffles than are still
# alive (at most 30 s), and samples every executor JVM from a task: fds, /proc/self/maps lines,
# threads, VmRSS (after a GC there and a trim of glibc's free memory) and the engine's gauges.
# SOAK_CONF="k=v ..." adds Spark settings to the run.
#
# Checks, per executor (fails with exit 1 and a PROBLEMS list):
#  - growth: the median of the 5 samples from shuffle 100 on ("@100") against the median of the
#    last 5 ("@end"): end <= max(1.05 x @100, @100 + slack) for fds, maps, threads, the heap in
#    use after a GC, and the engine's registered_bytes, pool_bytes_allocated, connections_open,
#    open_data_files and native_heap_bytes (the bytes the engine's Rust code holds, counted by
#    its allocator); the slack is 0 except for gauges that are legitimately 0 or tiny at @100
#    (see SLACK below). RSS outside the Java heap less what the JIT and the collector hold (see
#    PROC below) has no 5 %: end <= @100 + a slack measured without the plugin (SLACK below).
#    VmRSS is reported, not checked (see PROC below: heap pages touched by the collector make
#    it swing without a leak);
#  - between shuffles (every sample): leases_held, exposed_bytes, reads_in_flight and
#    pool_bytes_in_use are 0, and shuffles_registered <= the shuffles still alive in the driver;
#  - the same executor process (pid) answered every sample (a restart would hide a leak), the
#    job checked all N outputs, and in plugin mode the engine's gauges were there.
# Writes PATH (default target/bench/soak.json) and prints a table. The full 2000 took 813 s on 2
# cores at load average 20-40 (docs/benchmarks.md); tests/spark/test_soak.py runs 200 (CI).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

shuffles=2000
every=
mode=plugin
out=target/bench/soak.json
build=yes
replay=
while [ $# -gt 0 ]; do
  case "$1" in
    --shuffles) shuffles=$2; shift 2 ;;
    --every) every=$2; shift 2 ;;
    --mode) mode=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-build) build=no; shift ;;
    --replay) replay=$2; build=no; shift 2 ;;
    -h|--help) sed -n '2,36p' "$0"; exit 0 ;;
    *) echo "soak.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$shuffles" in ''|*[!0-9]*|0) echo "--shuffles needs a positive integer, got '$shuffles'" >&2; exit 2 ;; esac
if [ -z "$every" ]; then every=10; [ "$shuffles" -ge 1000 ] && every=20; fi
case "$every" in ''|*[!0-9]*|0) echo "--every needs a positive integer, got '$every'" >&2; exit 2 ;; esac
case "$mode" in plugin|default) ;; *) echo "--mode is plugin or default, got '$mode'" >&2; exit 2 ;; esac
# The growth check compares 5 samples from shuffle 100 on with the last 5: they must not overlap.
if [ $(( 100 + 10 * every )) -gt $(( shuffles + every )) ]; then
  echo "soak.sh: $shuffles shuffles with a sample every $every leave no 5 samples from shuffle 100 and 5 more after them; use at least $(( 100 + 9 * every )) shuffles or a smaller --every" >&2
  exit 2
fi

. scripts/spark-env.sh
[ "$build" = no ] || build_plugin
for j in "$RDMA_PLUGIN_JAR" "$RDMA_JOBS_JAR"; do
  [ -f "$j" ] || { echo "soak.sh: missing $j (run without --no-build)" >&2; exit 1; }
done
mapfile -t plugin_args < <(rdma_plugin_submit_args "$RDMA_PLUGIN_JAR")
mkdir -p "$(dirname "$out")"

step "soak: $shuffles shuffles, a sample every $every, mode $mode"
export SOAK_SHUFFLES=$shuffles SOAK_EVERY=$every SOAK_MODE=$mode SOAK_OUT=$out SOAK_REPLAY=$replay
"$VENV_DIR/bin/python" - "${plugin_args[@]}" <<'PY'
import ast, glob, json, os, re, statistics, subprocess, sys, time
from pathlib import Path

repo = Path(os.environ["REPO_ROOT"])
spark_home = os.environ["SPARK_HOME"]
shuffles, every = int(os.environ["SOAK_SHUFFLES"]), int(os.environ["SOAK_EVERY"])
mode, out = os.environ["SOAK_MODE"], Path(os.environ["SOAK_OUT"])
plugin_args = sys.argv[1:]
EXECUTORS = 2
WINDOW = 5          # samples per median
BASE_SHUFFLE = 100  # "@100": the first WINDOW samples from this shuffle on
RATIO = 1.05
# Absolute slack for quantities that are legitimately 0 or a handful at @100, where 5 % of
# the baseline is less than one unit: connections to the other executor's engine (opened and
# idle-closed as reduce tasks come and go: 0..2 per direction) and data files the block server
# keeps open (those of shuffles not yet cleaned up: up to every x 4 maps). All others: 0, but
# native RSS (native_rss_kb, below), which gets this slack and no 5 % (ABSOLUTE): its ~100 MB
# are the JVM's and Spark's, 5 % of them would be 5 MB whatever the plugin does.
# Its slack is what the figure does without the plugin (scripts/soak_baseline.py over reports
# of `scripts/soak.sh --shuffles 200 --mode default`): 4 runs x 2 executors grew by +0.6 to
# +2.7 MB between the two windows (metaspace +0.3-0.6 MB of it: Spark loading classes; the
# rest outside NMT, glibc's arenas most likely); the 99.9 % upper prediction bound of one more executor's growth is 5.3 MB:
# 6 MiB (CI checks 2 executors a run; a run failed for nothing should be rarer than 1 in 500).
# Two plugin runs grew +0.8 to +1.3 MB. It was 8 MB on top of the 5 %, a guess, which passed a
# build leaking 96 KiB of native memory per shuffle (+6.6 and +6.8 MB); this fails it. At the
# CI size the windows' medians are 60 shuffles apart, so leaks from ~80 kB per shuffle fail it;
# smaller ones are the exact counters' job (native_heap_bytes, fds, pool bytes, leases).
SLACK = {"connections_open": 4, "open_data_files": 4 * every, "native_rss_kb": 6 * 1024}
ABSOLUTE = {"native_rss_kb"}
# Every sample is taken after a GC of the Java heap and a trim of glibc's (free memory it kept,
# e.g. of C2's arenas, returned to the kernel); the untrimmed figure is reported too.
# RSS is checked in two parts: the resident pages outside the Java heap's address range
# (native memory such as the engine's, metaspace, stacks) and the heap in use after a GC. The
# first is checked less what two parts of the JVM hold by its own accounting (NMT, committed),
# neither of which follows the shuffle count, and neither of which can hold the engine's memory
# (its Rust code allocates through malloc, which NMT does not see; the plugin's JVM side holds
# Java objects, checked as heap_used_kb, and direct buffers, NMT `Other`, left in):
#  - the JIT: its code cache (`Code`; HotSpot keeps compiling more of Spark for the whole run
#    and never uncommits it: +7-9 MB from shuffle 100 to 2000 with either shuffle,
#    docs/benchmarks.md) and the working memory of compilations in flight (`Compiler`, `Arena
#    Chunk`: 0-15 MB at one sample, 0.3-16 MB at the next);
#  - the collector's own structures (`GC`: 44 MB or 49-54 MB from one sample to the next on a
#    1 GB executor, two states whichever the shuffle count). With it, 3 of the last 5 samples
#    in the high state failed a CI run at +5.4 % (2026-12-03).
# Measured without the plugin (the 4 default-mode runs of SLACK): between the two windows `Code`
# grew +1.2 to +2.6 MB, `GC` -0.1 to +5.1 MB, `Arena Chunk` -5.1 to +5.0 MB, and `Compiler`
# jumped by up to 17 MB from one sample to the next; RSS outside the heap with them in
# (non_heap_rss_kb) grew -3.3 to +8.6 MB, without them +0.6 to +2.7 MB. non_heap_rss_kb and
# non_heap_rss_less_jit_kb (less the code cache only) are reported.
# VmRSS itself is reported, not checked: it includes every heap page the collector touched
# since its last shrink, which swings by 100+ MB from sample to sample with no leak (a 2000-
# shuffle run had 340-495 MB on one executor with the heap in use at 42 MB throughout).
PROC = ["fds", "maps", "threads", "native_rss_kb", "heap_used_kb"]
# The NMT categories taken out of native_rss_kb (above).
JVM_HELD = ["code", "compiler", "arena_chunk", "gc"]
# Reported, not checked: the JVM's native memory by category (NMT) and what is resident outside
# both the heap and the JVM's own native memory (outside_jvm_kb = non_heap_rss_kb - (NMT total
# - NMT java_heap), committed counted as resident: a lower bound, for its trend).
INFO = ["rss_kb", "rss_file_kb", "non_heap_rss_less_jit_kb", "non_heap_rss_kb", "non_heap_rss_untrimmed_kb", "outside_jvm_kb",
        "nmt.total_kb", "nmt.code_kb", "nmt.compiler_kb", "nmt.gc_kb", "nmt.class_kb",
        "nmt.thread_kb", "nmt.other_kb", "nmt.internal_kb", "nmt.symbol_kb",
        "nmt.arena_chunk_kb", "nmt.metaspace_kb"]
# native_heap_bytes: what the engine's Rust code holds on the heap, counted by the library's
# allocator (exact, unlike any RSS figure).
GAUGES = ["registered_bytes", "pool_bytes_allocated", "connections_open", "open_data_files",
          "native_heap_bytes"]
QUIET_ZERO = ["leases_held", "exposed_bytes", "reads_in_flight", "pool_bytes_in_use"]

tree = ast.parse((repo / "tests/spark/conftest.py").read_text())
cluster_conf = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", None) == "CLUSTER_CONF" for t in n.targets))
conf = {**cluster_conf,
        "spark.metrics.conf.executor.sink.jmx.class": "org.apache.spark.metrics.sink.JmxSink",
        # The JVM's own native memory by category in every sample (nmt.*), to tell growth of
        # JIT code, GC structures and metaspace from memory outside the JVM (the engine's).
        "spark.executor.extraJavaOptions": "-XX:NativeMemoryTracking=summary"}
# SOAK_CONF="k=v k=v": more settings for this run (e.g. spark.executorEnv.MALLOC_ARENA_MAX=2),
# recorded in the report's cluster_conf.
conf.update(kv.split("=", 1) for kv in os.environ.get("SOAK_CONF", "").split())
cmd = [f"{spark_home}/bin/spark-submit", "--master", f"local-cluster[{EXECUTORS},1,1024]",
       "--driver-memory", "1g"]
for k, v in conf.items():
    cmd += ["--conf", f"{k}={v}"]
if mode == "plugin":
    cmd += plugin_args
cmd += ["--class", "org.apache.spark.shuffle.rdma.jobs.SoakJob", os.environ["RDMA_JOBS_JAR"],
        str(shuffles), str(every), "30", "rdmaShuffle", str(EXECUTORS)]
t0 = time.monotonic()
replay = os.environ.get("SOAK_REPLAY")
if replay:
    logs = Path(replay)
    p = subprocess.CompletedProcess(cmd, 0, (logs / "driver.stdout").read_text(),
                                    (logs / "driver.stderr").read_text())
else:
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                       timeout=int(os.environ.get("SOAK_TIMEOUT_S", "7200")))
    logs = out.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "driver.stdout").write_text(p.stdout)
    (logs / "driver.stderr").write_text(p.stderr)
wall = time.monotonic() - t0
m = re.search(r"app ID (app-\d+-\d+)", p.stderr)
if m and not replay:
    for f in glob.glob(f"{spark_home}/work/{m.group(1)}/*/stderr"):
        (logs / f"executor{Path(f).parent.name}.stderr").write_text(Path(f).read_text(errors="replace"))

problems = []
if p.returncode != 0:
    problems.append(f"spark-submit failed (rc={p.returncode}); driver log {logs}/driver.stderr: "
                    + " | ".join(p.stderr.strip().splitlines()[-8:]))

def kv(line):
    return dict(x.split("=", 1) for x in line.split()[1:] if "=" in x)

samples, threads = {}, {}
done = None
for ln in p.stdout.splitlines():
    if ln.startswith("SOAK_SAMPLE "):
        d = kv(ln)
        s = {k: (int(v) if re.fullmatch(r"-?\d+", v) else v) for k, v in d.items()}
        if "nmt.code_kb" in s and s.get("non_heap_rss_kb", -1) >= 0:
            s["non_heap_rss_less_jit_kb"] = s["non_heap_rss_kb"] - s["nmt.code_kb"]
            if all(f"nmt.{k}_kb" in s for k in JVM_HELD):
                s["native_rss_kb"] = s["non_heap_rss_kb"] - sum(s[f"nmt.{k}_kb"] for k in JVM_HELD)
        if "nmt.total_kb" in s and s.get("non_heap_rss_kb", -1) >= 0:
            s["outside_jvm_kb"] = s["non_heap_rss_kb"] - (s["nmt.total_kb"] - s.get("nmt.java_heap_kb", 0))
        samples.setdefault(d["executor"], []).append(s)
    elif ln.startswith("SOAK_THREADS "):
        d = kv(ln)
        threads.setdefault(d.pop("executor"), {})[int(d.pop("shuffle"))] = {k: int(v) for k, v in d.items()}
    elif ln.startswith("SOAK_DONE "):
        done = {k: int(v) for k, v in kv(ln).items()}
if not done or done.get("checked") != shuffles:
    problems.append(f"the job did not check all {shuffles} shuffle outputs (SOAK_DONE: {done})")

checkpoints = sorted({0, shuffles} | set(range(every, shuffles + 1, every)))
growth, quiet = [], []
for ex, ss in sorted(samples.items()):
    got = [s["shuffle"] for s in ss]
    if got != checkpoints:
        problems.append(f"executor {ex}: samples at {len(got)} of {len(checkpoints)} checkpoints")
    pids = sorted({s["pid"] for s in ss})
    if len(pids) != 1:
        problems.append(f"executor {ex}: several processes answered ({pids}): it was restarted")
    if mode == "plugin" and not all("gauge.shuffles_registered" in s for s in ss):
        problems.append(f"executor {ex}: no rdmaShuffle gauges in some samples: the engine did "
                        "not run (or the JmxSink is off)")
    base = [s for s in ss if s["shuffle"] >= BASE_SHUFFLE][:WINDOW]
    last = ss[-WINDOW:]
    if any("native_rss_kb" not in s for s in ss):
        problems.append(f"executor {ex}: no NMT {'/'.join(JVM_HELD)} in some samples, so RSS "
                        "outside the heap less the JIT's and the collector's is unknown (is "
                        "-XX:NativeMemoryTracking=summary in spark.executor.extraJavaOptions?)")
    if any(s.get("heap_rss_kb", -1) < 0 for s in ss):
        problems.append(f"executor {ex}: the Java heap's resident pages could not be measured "
                        "(GC.heap_info / smaps), so its native RSS is unknown")
    keys = PROC + ([f"gauge.{g}" for g in GAUGES] if mode == "plugin" else []) + INFO
    for key in keys:
        if key in INFO and not all(key in s for s in ss):
            continue
        b = statistics.median(s.get(key, 0) for s in base)
        e = statistics.median(s.get(key, 0) for s in last)
        slack = SLACK.get(key.removeprefix("gauge."), 0)
        limit = b + slack if key in ABSOLUTE else max(RATIO * b, b + slack)
        row = {"executor": ex, "quantity": key, "at_100": b, "at_end": e,
               "ratio": round(e / b, 4) if b else None, "limit": round(limit, 1), "slack": slack,
               "ok": e <= limit or key in INFO, "checked": key not in INFO, "base_shuffles": [s["shuffle"] for s in base],
               "end_shuffles": [s["shuffle"] for s in last]}
        growth.append(row)
        if e > limit and key not in INFO:
            problems.append(f"executor {ex}: {key} grew from {b} (median of shuffles "
                            f"{row['base_shuffles']}) to {e} (shuffles {row['end_shuffles']}), "
                            f"limit {limit:.1f}")
    if mode != "plugin":
        continue
    for s in ss:
        bad = {k: s.get(f"gauge.{k}") for k in QUIET_ZERO if s.get(f"gauge.{k}", 0) != 0}
        reg = s.get("gauge.shuffles_registered", 0)
        if reg > s["live_shuffles"]:
            bad["shuffles_registered"] = f"{reg} > {s['live_shuffles']} alive"
        if bad:
            quiet.append({"executor": ex, "shuffle": s["shuffle"], **bad})
            problems.append(f"executor {ex} after shuffle {s['shuffle']}, between shuffles: {bad}")
if len(samples) != EXECUTORS:
    problems.append(f"samples of {len(samples)} executors, expected {EXECUTORS}")

waits = [s["cleanup_wait_ms"] for ss in samples.values() for s in ss]
report = {
    "shuffles": shuffles, "every": every, "mode": mode, "master": f"local-cluster[{EXECUTORS},1,1024]",
    "spark_version": os.environ.get("SPARK_VERSION"), "cluster_conf": conf,
    "submit_wall_s": round(wall, 1), "job": done,
    "native_heap_trimmed": sum(s.get("native_trimmed", 0) for ss in samples.values() for s in ss),
    "cleanup_wait_ms": {"median": statistics.median(waits) if waits else None,
                        "max": max(waits) if waits else None},
    "rule": f"median of {WINDOW} samples from shuffle {BASE_SHUFFLE} vs median of the last "
            f"{WINDOW}: end <= max({RATIO} x base, base + slack); {', '.join(sorted(ABSOLUTE))}: "
            "end <= base + slack",
    "growth": growth, "between_shuffle_violations": quiet, "samples": samples,
    "threads_by_name": threads, "problems": problems, "logs": str(logs),
}
out.write_text(json.dumps(report, indent=1) + "\n")

print(f"\n{shuffles} shuffles ({mode}), a sample every {every}, submit {wall:.0f} s, "
      f"job {(done or {}).get('wall_ms', 0) / 1000:.0f} s, cleanup wait median "
      f"{report['cleanup_wait_ms']['median']} ms max {report['cleanup_wait_ms']['max']} ms")
print(f"{'executor':8s} {'quantity':28s} {'@100':>12s} {'@end':>12s} {'ratio':>7s} {'limit':>12s}  ok")
for r in growth:
    ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
    print(f"{r['executor']:8s} {r['quantity']:28s} {r['at_100']:12g} {r['at_end']:12g} "
          f"{ratio:>7s} {r['limit']:12g}  {('yes' if r['ok'] else 'NO') if r['checked'] else '(not checked)'}")
print(f"between-shuffle samples with something held: {len(quiet)}")
print(f"report: {out}   logs: {logs}")
if problems:
    print("PROBLEMS:\n  " + "\n  ".join(problems))
    sys.exit(1)
PY
