#!/usr/bin/env python3
"""The report of scripts/bench-shaped.sh: both shuffles on the shaped namespace cluster, side by
side, with the shuffle's share of the tasks' time.

    shaped_report.py --shape FILE --tpcds target/bench/tpcds-shaped.json
                     --sortbykey target/bench/shaped-sortbykey.json --out target/bench/shaped.json

- TPC-DS (scripts/tpcds.py bench --cluster): its sum ratio with the 95 % bootstrap interval,
  results equal, and per shuffle, over all rounds, the tasks' run time, fetch wait and shuffle
  write time (Spark's REST API, per stage) and their share.
- sortByKey (scripts/cluster.sh compare ... sortByKey): per round, the job's wall time, and from
  each application's event log (every task's metrics, SparkListenerTaskEnd) the same terms; the
  ratio with a 95 % interval over rounds (scripts/tpcds.py ratio_interval: mean log ratio, the
  order effect cancelled once both orders ran twice).
- The shape (--shape: the links' rate and delay, the CPU quota, the measured round trip and
  bulk rate between two workers, and the CPU each worker used and was throttled).

"Shuffle share" = (fetch wait + shuffle write time) / executor run time, summed over tasks:
the part of the tasks' time a shuffle's transport and writer account for.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpcds  # noqa: E402


def event_lines(eventlog: Path):
    """Every event of the event log(s) under a folder: plain JSON lines, or zstd files (Spark
    4's default codec) through the zstd tool."""
    for f in sorted(p for p in eventlog.rglob("*") if p.is_file() and not p.name.startswith(".")):
        if f.suffix == ".zstd" or f.suffix == ".zst":
            text = subprocess.run(["zstd", "-dc", str(f)], check=True, capture_output=True).stdout.decode()
        elif f.suffix in ("", ".inprogress") or f.name.startswith(("events_", "app-", "eventlog")):
            text = f.read_text(errors="replace")
        else:
            continue
        for ln in text.splitlines():
            if ln.startswith("{"):
                try:
                    yield json.loads(ln)
                except ValueError:
                    continue  # a line cut short by a stopped application


def task_terms(eventlog: Path) -> dict:
    """Task metrics summed over every finished task of an application."""
    t = {"tasks": 0, "run_s": 0.0, "cpu_s": 0.0, "gc_s": 0.0, "deser_s": 0.0, "write_s": 0.0,
         "fetch_wait_s": 0.0, "remote_mib": 0.0, "local_mib": 0.0}
    for e in event_lines(eventlog):
        if e.get("Event") != "SparkListenerTaskEnd" or not e.get("Task Metrics"):
            continue
        m = e["Task Metrics"]
        r, w = m.get("Shuffle Read Metrics", {}), m.get("Shuffle Write Metrics", {})
        t["tasks"] += 1
        t["run_s"] += m.get("Executor Run Time", 0) / 1e3
        t["cpu_s"] += m.get("Executor CPU Time", 0) / 1e9
        t["gc_s"] += m.get("JVM GC Time", 0) / 1e3
        t["deser_s"] += m.get("Executor Deserialize Time", 0) / 1e3
        t["write_s"] += w.get("Shuffle Write Time", 0) / 1e9
        t["fetch_wait_s"] += r.get("Fetch Wait Time", 0) / 1e3
        t["remote_mib"] += r.get("Remote Bytes Read", 0) / 2**20
        t["local_mib"] += r.get("Local Bytes Read", 0) / 2**20
    t = {k: round(v, 3) for k, v in t.items()}
    t["shuffle_share"] = round((t["fetch_wait_s"] + t["write_s"]) / t["run_s"], 4) if t["run_s"] else None
    return t


def sortbykey(report: dict, job: str = "sortByKey") -> dict:
    """The cluster compare's rounds of one ShuffleBench job, with event-log terms per run."""
    runs = {"default": [], "plugin": []}
    for d in report["runs"]:
        summ = json.loads((Path(d) / "summary.json").read_text())
        m = summ["metrics"].get(job, {})
        runs[summ["mode"]].append({"run_dir": d, "wall_s": (m.get("wall_ms") or 0) / 1e3,
                                   "fetch_wait_ms": m.get("fetch_wait_ms"),
                                   "remote_bytes": m.get("remote_bytes"),
                                   "terms": task_terms(Path(d) / "eventlog")})
    n = min(len(runs["default"]), len(runs["plugin"]))
    first = [r % 2 for r in range(n)]  # cluster.sh compare: default first in odd rounds
    d = [r["wall_s"] for r in runs["default"][:n]]
    p = [r["wall_s"] for r in runs["plugin"][:n]]
    return {
        "job": job, "rounds": n, "outputs_equal": report["outputs_equal"],
        "wall_s": {"default": d, "plugin": p},
        "ratio": round(sum(p) / sum(d), 4) if n and sum(d) else None,
        "ratio_ci95": tpcds.ratio_interval(d, p, first),
        "runs": runs,
        "shuffle_share": {m: [r["terms"]["shuffle_share"] for r in rs] for m, rs in runs.items()},
        "fetch_wait_s": {m: [r["terms"]["fetch_wait_s"] for r in rs] for m, rs in runs.items()},
    }


def tpcds_part(rep: dict) -> dict:
    shares = rep["time_shares"]
    return {
        "queries": [q["query"] for q in rep["queries"]], "equal": rep["equal"], "total": rep["total"],
        "sum_ratio": rep["sum_ratio"], "sum_ratio_ci95": rep["sum_ratio_ci95"],
        "sum_ratio_ci95_rounds_only": rep["sum_ratio_ci95_rounds_only"],
        "slow_queries": rep["slow_queries"], "problems": rep.get("problems", []),
        "shuffle_share": {m: [t["transport_bound"] for t in rs] for m, rs in shares.items()},
        "fetch_wait_s": {m: [t["fetch_wait_s"] for t in rs] for m, rs in shares.items()},
        "task_s": {m: [t["task_s"] for t in rs] for m, rs in shares.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True)
    ap.add_argument("--tpcds")
    ap.add_argument("--sortbykey")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = {"shape": json.loads(Path(a.shape).read_text())}
    problems = []
    if a.tpcds and Path(a.tpcds).exists():
        out["tpcds"] = tpcds_part(json.loads(Path(a.tpcds).read_text()))
        problems += out["tpcds"]["problems"]
    if a.sortbykey and Path(a.sortbykey).exists():
        out["sortbykey"] = sortbykey(json.loads(Path(a.sortbykey).read_text()))
        if not out["sortbykey"]["outputs_equal"]:
            problems.append("sortByKey: outputs differ between the shuffles (or a run failed)")
    out["problems"] = problems
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")

    sh = out["shape"]
    print(f"\nshaped cluster: {sh.get('workers')} workers, links {sh.get('rate')} each way per host, "
          f"+{sh.get('delay_us')} us each way, {sh.get('cpu')} cores per worker; measured between two "
          f"workers: round trip {sh.get('rtt_us')} us (median of {sh.get('pings')} pings), bulk "
          f"{sh.get('bulk_mbit_s')} Mbit/s")
    fmt = lambda iv: f"[{iv['lo']:.3f}, {iv['hi']:.3f}]" if iv else "-"  # noqa: E731
    if "tpcds" in out:
        t = out["tpcds"]
        print(f"TPC-DS ({len(t['queries'])} queries): {t['equal']}/{t['total']} equal; sum ratio {t['sum_ratio']} "
              f"{fmt(t['sum_ratio_ci95'])} (rounds and queries), {fmt(t['sum_ratio_ci95_rounds_only'])} (rounds); "
              f"slower than 1.10x beyond their interval: {t['slow_queries'] or 'none'}")
        for m in ("default", "plugin"):
            print(f"  {m:7s} shuffle share of task time per round {t['shuffle_share'][m]}, fetch wait s "
                  f"{t['fetch_wait_s'][m]}, task s {t['task_s'][m]}")
    if "sortbykey" in out:
        s = out["sortbykey"]
        print(f"sortByKey: {s['rounds']} rounds, outputs equal {s['outputs_equal']}; wall s default "
              f"{s['wall_s']['default']}, plugin {s['wall_s']['plugin']}; ratio {s['ratio']} {fmt(s['ratio_ci95'])}")
        for m in ("default", "plugin"):
            print(f"  {m:7s} shuffle share of task time per round {s['shuffle_share'][m]}, fetch wait s {s['fetch_wait_s'][m]}")
    for host, c in sh.get("cpu_used", {}).items():
        print(f"  {host}: CPU used {c['cpu_s']} s, throttled {c['throttled_s']} s ({c['nr_throttled']} periods)")
    print(f"report: {a.out}")
    if problems:
        print("PROBLEMS:\n  " + "\n  ".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
