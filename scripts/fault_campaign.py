#!/usr/bin/env python3
"""The fault campaign on the multi-host cluster of scripts/cluster.sh (issue 14).

Every case runs FaultJob (jvm-plugin/jobs) with Spark's default shuffle and with the plugin,
under the same fault injected at the same point of the job, and records what happened:

  kill9      `kill -9` of an executor holding map outputs while reducers elsewhere are reading
             (FaultJob `during_reduce`: each reducer has read its first record and waits at a
             gate; the harness kills, then opens the gate). Repeated REPS times in one
             application (the worker starts a replacement executor between repetitions).
  cut        the same moment, but the victim host's link goes down (`cluster.sh cut`) and
             stays down until the job has finished.
  blackhole  the same with every frame to and from the host dropped on the bridge (nft).
  slow       a slow consumer: reducers sleep per record while the plugin's pool is capped at
             64 MiB and Spark may have 256 MiB in flight (FaultJob `slow_reduce`); no fault.
  disk       after the map stage committed and before any reducer asked (`before_reduce`):
             one data file of the victim truncated to half, deleted, or 64 bytes of it
             flipped (shuffle compression and checksums on).

Times are the harness's wall clock against the job's own epoch-millisecond marks:
  recovery_s   = end of the faulted job - the moment of the fault;
  baseline_s   = end of an unfaulted repetition - the moment its gate opened (same app, same
                 settings): what the same stretch costs without a fault;
  fetch_failed_after_s = first FetchFailed task end (event log) - the moment of the fault;
  slots_freed_after_s  = last task end of the reduce stage attempt that saw the fault - the
                 moment of the fault (no task slot is held longer than that);
  slots_freed_healthy_after_s = the same over the tasks running at the fault on the executors
                 other than the victim (a task on an isolated host is seen to end only once the
                 driver hears from it again; one launched after the fault never waited on it).

Used by scripts/fault-campaign.sh (the whole campaign -> target/bench/faults.json and .md) and
by tests/cluster/test_faults.py (one kill -9 and one disk case per shuffle, in CI).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "scripts" / "cluster.sh"
STATE = Path(os.environ.get("CLUSTER_DIR", REPO / "target" / "cluster"))
SUBNET = os.environ.get("CLUSTER_SUBNET", "10.77.0")
STEP_TIMEOUT_S = 300

# Short timeouts, both shuffles: a lost peer surfaces in seconds, not minutes.
SHORT_TIMEOUTS = {
    "spark.network.timeout": "20s",
    "spark.network.timeoutInterval": "5s",
    "spark.executor.heartbeatInterval": "2s",
    "spark.shuffle.io.connectionTimeout": "10s",
    "spark.shuffle.rdma.fetchTimeout": "10s",
    "spark.shuffle.rdma.connectTimeout": "5s",
}
COMMON = {
    # A reducer fetches one ~750 KiB block per request: some are still to come when the gate
    # opens (FaultJob's during_reduce).
    "spark.reducer.maxSizeInFlight": "1m",
    # Every executor runs reducers, wherever the map outputs are.
    "spark.shuffle.reduceLocality.enabled": "false",
    "spark.eventLog.compress": "false",
    "spark.eventLog.rolling.enabled": "false",
}


def log(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cluster(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    p = subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"cluster.sh {' '.join(args)} failed (rc={p.returncode}): {p.stderr[-2000:]}")
    return p


def host_of_ip(ip: str) -> str:
    last = int(ip.rsplit(".", 1)[1])
    assert ip.startswith(SUBNET + ".") and last > 10, f"{ip} is not a worker of {SUBNET}.0/24"
    return f"w{last - 10}"


def kv(line: str) -> dict:
    return dict(x.split("=", 1) for x in line.split()[1:] if "=" in x)


class Job:
    """One spark-submit of FaultJob through `cluster.sh run`, watched while it runs."""

    def __init__(self, mode: str, scenarios: list, conf: dict, tag: str, executors: int = 3):
        self.mode, self.scenarios = mode, scenarios
        self.dir = STATE / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-faults-{tag}-{mode}"
        self.gates = self.dir / "gates"
        self.gates.mkdir(parents=True)
        args = ["bash", str(CLUSTER), "run", f"--{mode}"]
        for k, v in {**COMMON, **conf}.items():
            args += ["--conf", f"{k}={v}"]
        args += ["FaultJob", str(self.gates), ",".join(scenarios), str(executors)]
        self.out = self.dir / "driver.out"
        with open(self.dir / "cluster-run.log", "w") as logf:
            self.proc = subprocess.Popen(args, env={**os.environ, "CLUSTER_RUN_DIR": str(self.dir)},
                                         stdout=logf, stderr=subprocess.STDOUT, text=True)
        self.t0 = time.time()

    def lines(self) -> list:
        return self.out.read_text(errors="replace").splitlines() if self.out.exists() else []

    def wait_line(self, pattern: str, timeout: float = STEP_TIMEOUT_S) -> dict:
        rx = re.compile(pattern)
        deadline = time.time() + timeout
        while True:
            for ln in self.lines():
                if rx.search(ln):
                    return kv(ln)
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.mode} job exited (rc={self.proc.returncode}) before /{pattern}/: "
                                     f"{self.dir}/driver.err\n" + "\n".join(self.lines()[-10:]))
            if time.time() > deadline:
                raise AssertionError(f"no /{pattern}/ within {timeout} s in {self.out}")
            time.sleep(0.1)

    def wait_markers(self, what: str, scenario: str, executors: int, timeout: float = STEP_TIMEOUT_S) -> set:
        """Executor ids with a `<what>-<scenario>-exec<id>-...-attempt0` marker, once >= `executors`."""
        rx = re.compile(rf"^{what}-{re.escape(scenario)}-exec(\w+)-part\d+-attempt0$")
        deadline = time.time() + timeout
        while True:
            found = {m.group(1) for p in self.gates.iterdir() if (m := rx.match(p.name))}
            if len(found) >= executors:
                return found
            if self.proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"{scenario}: {what} markers of {sorted(found)} only")
            time.sleep(0.05)

    def go(self, scenario: str) -> float:
        (self.gates / f"go-{scenario}").touch()
        return time.time()

    def finish(self, timeout: float = 1800) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            for s in self.scenarios:  # never leave gated tasks waiting
                (self.gates / f"go-{s}").touch()
            if self.proc.poll() is None:
                self.proc.terminate()
                self.proc.wait(timeout=60)
        self.wall_s = time.time() - self.t0
        return self.proc.returncode

    # --- after the run ---------------------------------------------------------------------

    def results(self) -> dict:
        return {r["scenario"]: r for r in map(kv, self.lines()) if "ok" in r and "scenario" in r}

    def events(self) -> list:
        files = [f for f in (self.dir / "eventlog").glob("app-*") if f.is_file()]
        if not files:
            return []
        return [json.loads(ln) for ln in files[0].read_text().splitlines() if ln.strip()]

    def summary(self) -> dict:
        f = self.dir / "summary.json"
        return json.loads(f.read_text()) if f.exists() else {}


METADATA_FAILURE = "Missing an output location"


def stage_groups(events: list) -> dict:
    return {e["Stage Info"]["Stage ID"]: (e.get("Properties") or {}).get("spark.jobGroup.id")
            for e in events if e["Event"] == "SparkListenerStageSubmitted"}


def scenario_report(events: list, scenario: str, t_fault: float | None, victim: str | None = None) -> dict:
    """What the event log says about one scenario: fetch failures (when, from whom, why), the
    map stage attempts, and when the last task of the first reduce attempt ended (on any
    executor, and on the executors other than the victim)."""
    groups = stage_groups(events)
    ends = [e for e in events if e["Event"] == "SparkListenerTaskEnd" and groups.get(e["Stage ID"]) == scenario]
    ff = [e for e in ends if e["Task End Reason"]["Reason"] == "FetchFailed"]
    map_attempts = sorted({e["Stage Attempt ID"] for e in ends if e["Task Type"] == "ShuffleMapTask"})
    reduce0 = [e for e in ends if e["Task Type"] == "ResultTask" and e["Stage Attempt ID"] == 0]
    rep = {
        "fetch_failed": len(ff),
        "fetch_failed_from": sorted({(e["Task End Reason"].get("Block Manager Address") or {}).get("Executor ID", "?")
                                     for e in ff}),
        "fetch_failed_messages": sorted({e["Task End Reason"].get("Message", "")[:3000] for e in ff})[:6],
        # FetchFailed with no block manager: a MetadataFetchFailedException, a task (often one
        # resubmitted from the lost executor) that found the driver had already dropped the dead
        # executor's map outputs ("Missing an output location"), so it never fetched at all.
        "fetch_failed_metadata": sum(1 for e in ff if not e["Task End Reason"].get("Block Manager Address")
                                     and METADATA_FAILURE in e["Task End Reason"].get("Message", "")),
        "map_stage_attempts": len(map_attempts),
        "other_task_failures": sorted({e["Task End Reason"]["Reason"] for e in ends
                                       if e["Task End Reason"]["Reason"] not in ("Success", "FetchFailed")}),
    }
    if t_fault is not None:
        if ff:
            rep["fetch_failed_after_s"] = round(min(e["Task Info"]["Finish Time"] for e in ff) / 1000 - t_fault, 2)
        if reduce0:
            rep["slots_freed_after_s"] = round(max(e["Task Info"]["Finish Time"] for e in reduce0) / 1000 - t_fault, 2)
        # The slots the fault could hold: tasks running when it struck, on the executors that
        # stayed reachable. A task on a cut or blackholed host is seen to end only when the
        # driver hears from it again (its end is the driver's clock), after the fault is
        # lifted; and a task of the failed attempt launched after the fault (Spark keeps
        # launching a zombie attempt's pending tasks, then kills them at the job's end) never
        # waited on the victim.
        healthy = [e for e in reduce0 if e["Task Info"].get("Executor ID") != victim
                   and e["Task Info"]["Launch Time"] / 1000 < t_fault]
        if victim is not None and healthy:
            rep["slots_freed_healthy_after_s"] = round(
                max(e["Task Info"]["Finish Time"] for e in healthy) / 1000 - t_fault, 2)
    return rep


def executor_deaths(events: list) -> list:
    return [e.get("Removed Reason", "") for e in events if e["Event"] == "SparkListenerExecutorRemoved"]


def logs_mention(job: Job, *needles: str) -> list:
    hits = []
    for f in sorted((job.dir / "executors").glob("*.stderr")) + [job.dir / "driver.err"]:
        text = f.read_text(errors="replace") if f.exists() else ""
        hits += [f"{f.name}: {n}" for n in needles if n in text]
    return hits


def pick_victim(done: dict, readers: set | None = None) -> tuple:
    """(executor id, host) of the executor with the most map outputs (>= 2) that some reducer
    elsewhere still needs."""
    outputs = {e: int(n) for e, n in (x.split(":") for x in done["outputs"].split(","))}
    hosts = dict(x.split(":", 1) for x in done["hosts"].split(","))
    cands = [e for e in outputs if outputs[e] >= 2 and (readers is None or readers - {e})]
    assert cands, f"no executor with >= 2 map outputs and a reader elsewhere: {outputs} {readers}"
    victim = max(cands, key=lambda e: (outputs[e], e))
    return victim, host_of_ip(hosts[victim])


# --- the cases ---------------------------------------------------------------------------------

DISK_FAULTS = ("truncate", "delete", "corrupt")
NET_FAULTS = {"cut": "heal", "blackhole": "unblackhole"}


def run_app(mode: str, steps: list, conf: dict, tag: str, case: str) -> dict:
    """One application of FaultJob whose scenarios are `steps`: (scenario, fault) pairs, fault
    None (the unfaulted baseline), kill9, cut, blackhole (scenario during_reduce.*: injected
    once reducers on two executors have read their first record) or truncate, delete, corrupt
    (scenario before_reduce.*: injected after the map stage committed, before any reducer
    asked). A cut or blackholed host stays isolated until its job has ended (at most 180 s)."""
    job = Job(mode, [s for s, _ in steps], {**SHORT_TIMEOUTS, **conf}, tag)
    faults, isolated = {}, set()
    rc = None
    try:
        for s, fault in steps:
            done = job.wait_line(rf"^FAULT_MAP_DONE scenario={re.escape(s)} .*attempt=0 ")
            gated_early = s.startswith("before_reduce")
            readers = job.wait_markers("waiting" if gated_early else "reading", s, 1 if gated_early else 2)
            if fault is None:
                faults[s] = {"t": job.go(s)}
                continue
            victim, host = pick_victim(done, None if gated_early else readers)
            t = time.time()
            f = {"victim": victim, "host": host, "fault": fault}
            if fault == "kill9":
                cluster("kill-executor", host)
            elif fault in NET_FAULTS:
                cluster(fault, host)
                isolated.add(host)
            else:
                f["what"] = damage(host, done["shuffle"], fault)
            job.go(s)
            faults[s] = {"t": t, **f}
            log(f"{mode} {s}: {f.get('what', fault)} of executor {victim} on {host} (readers {sorted(readers)})")
            if fault in NET_FAULTS:
                try:
                    job.wait_line(rf"^FAULT_RESULT scenario={re.escape(s)} ", timeout=180)
                finally:
                    cluster(NET_FAULTS[fault], host)
                    isolated.discard(host)
        rc = job.finish()
    finally:
        for h in isolated:
            for undo in NET_FAULTS.values():
                cluster(undo, h, check=False)
        if rc is None:
            rc = job.finish(timeout=60)
    return collect(job, rc, faults, case)


def case_during_reduce(mode: str, fault: str, reps: int, tag: str) -> dict:
    """kill9 / cut / blackhole during the reduce stage, after one unfaulted baseline."""
    steps = [("during_reduce.base", None)] + [(f"during_reduce.{fault}{i}", fault) for i in range(1, reps + 1)]
    return run_app(mode, steps, {}, tag, fault)


def case_slow(mode: str, tag: str) -> dict:
    conf = {"spark.shuffle.rdma.fetchTimeout": "5s", "spark.shuffle.rdma.pool.capBytes": "64m",
            "spark.reducer.maxSizeInFlight": "256m", "spark.faultJob.sleepPerRecordMs": "5"}
    job = Job(mode, ["slow_reduce"], {**SHORT_TIMEOUTS, **conf}, tag)
    rc = job.finish()
    return collect(job, rc, {"slow_reduce": {"t": None}}, "slow")


def damage(host: str, shuffle: str, how: str) -> str:
    """Damages the largest committed data file of `shuffle` on `host`; returns what was done."""
    files = sorted((STATE / "hosts" / host / "local").rglob(f"shuffle_{shuffle}_*_0.data"),
                   key=lambda f: f.stat().st_size)
    assert files, f"no data file of shuffle {shuffle} under {STATE / 'hosts' / host / 'local'}"
    f = files[-1]
    size = f.stat().st_size
    if how == "truncate":
        os.truncate(f, size // 2)
    elif how == "delete":
        f.unlink()
    elif how == "corrupt":
        with open(f, "r+b") as fh:
            fh.seek(size // 2)
            b = fh.read(64)
            fh.seek(size // 2)
            fh.write(bytes(x ^ 0xFF for x in b))
    else:
        raise ValueError(how)
    return f"{how} {f.name} ({size} B)"


def case_disk(mode: str, hows: list, tag: str) -> dict:
    steps = [("before_reduce.base", None)] + [(f"before_reduce.{h}", h) for h in hows]
    # Spark's defaults, stated: compressed blocks with checksums, so corruption is detectable.
    conf = {"spark.shuffle.compress": "true", "spark.shuffle.checksum.enabled": "true"}
    return run_app(mode, steps, conf, tag, "disk")


def collect(job: Job, rc: int, faults: dict, case: str) -> dict:
    events, results = job.events(), job.results()
    out = {"mode": job.mode, "case": case, "rc": rc, "run_dir": str(job.dir), "wall_s": round(job.wall_s, 1),
           "executor_removed": executor_deaths(events),
           "fatal_signals": logs_mention(job, "SIGBUS", "SIGSEGV", "A fatal error has been detected"),
           "scenarios": {}}
    for s, f in faults.items():
        r = results.get(s, {})
        rep = scenario_report(events, s, f.get("t"), f.get("victim"))
        rep.update({k: v for k, v in f.items() if k != "t"})
        if f.get("t") is not None:
            rep["t_fault"] = f["t"]
        rep["ok"] = r.get("ok") == "true"
        if r and f.get("t") is not None:
            rep["recovery_s" if "fault" in f else "baseline_s"] = round(int(r["end_ms"]) / 1000 - f["t"], 2)
        if r:
            rep["job_s"] = round((int(r["end_ms"]) - int(r["start_ms"])) / 1000, 2)
        out["scenarios"][s] = rep
    eng = job.summary().get("engine", {})
    out["engine"] = {k: sum(v.get(k, 0) for v in eng.values() if isinstance(v.get(k, 0), int))
                     for k in ("bytes_fetched", "native_requests", "delegated_requests", "failed_blocks_fetched",
                               "failed_blocks_fetched_timeout")} if eng else {}
    if eng:
        # The slow consumer's evidence that the pool really filled up.
        out["engine"]["pool_peak_bytes_in_use_max"] = max(v.get("pool_peak_bytes_in_use", 0) for v in eng.values())
    return out


# --- the campaign ------------------------------------------------------------------------------

def med(xs: list):
    return round(statistics.median(xs), 2) if xs else None


def verdicts(report: dict) -> list:
    """One row per criterion of issue 14: (case, criterion, default, plugin, met)."""
    rows = []
    by = {(r["case"], r["mode"]): r for r in report["runs"]}

    def faulted(r):
        return {s: v for s, v in r["scenarios"].items() if "victim" in v}

    for case in ("kill9", "cut", "blackhole"):
        d, p = by.get((case, "default")), by.get((case, "plugin"))
        if not (d and p):
            continue
        fd, fp = faulted(d), faulted(p)

        def medians(key):
            """The median of `key` over the faulted scenarios: (default shuffle, plugin)."""
            return tuple(med([v[key] for v in f.values() if key in v]) for f in (fd, fp))

        okd = sum(v["ok"] for v in fd.values())
        okp = sum(v["ok"] for v in fp.values())
        rows.append((case, f"job correct ({len(fp)} runs)", f"{okd}/{len(fd)}", f"{okp}/{len(fp)}",
                     okp == len(fp) > 0 and p["rc"] == 0))
        rd, rp = medians("recovery_s")
        if case == "kill9":
            rows.append((case, "recovery time, median s (plugin <= 1.2x default)", rd, rp,
                         rd is not None and rp is not None and rp <= 1.2 * rd))
        else:
            limit = float(SHORT_TIMEOUTS["spark.shuffle.rdma.fetchTimeout"].rstrip("s"))
            ffd, ffp = medians("fetch_failed_after_s")
            # The event log has the failed task's end, which comes a moment after its fetch
            # failed: one second of slack for that.
            rows.append((case, f"first FetchFailed after the fault, s (plugin <= fetchTimeout {limit:g} s + 1 s)",
                         ffd, ffp, ffp is not None and ffp <= limit + 1))
            sd, sp = medians("slots_freed_after_s")
            rows.append((case, "last reduce task of the faulted attempt ended after, s (any executor, any "
                               "launch; the isolated one's seen once it is reachable again)", sd, sp, True))
            hd, hp = medians("slots_freed_healthy_after_s")
            rows.append((case, "... of those running at the fault on the reachable executors, s "
                               f"(plugin <= fetchTimeout {limit:g} s + 1 s)", hd, hp, hp is not None and hp <= limit + 1))
            rows.append((case, "recovery time, median s", rd, rp, True))
    d, p = by.get(("slow", "default")), by.get(("slow", "plugin"))
    if d and p:
        vd, vp = d["scenarios"]["slow_reduce"], p["scenarios"]["slow_reduce"]
        peak = p["engine"].get("pool_peak_bytes_in_use_max", 0)
        rows.append(("slow", f"FetchFailed with a sleeping reducer, 64 MiB pool (peak in use {peak >> 20} MiB)",
                     vd["fetch_failed"], vp["fetch_failed"], vp["fetch_failed"] == 0 and vp["ok"] and p["rc"] == 0))
        rows.append(("slow", "job time, s", vd.get("job_s"), vp.get("job_s"), True))
    for case, how in (("disk", "compressed"), ("disk_plain", "uncompressed")):
        d, p = by.get((case, "default")), by.get((case, "plugin"))
        if not (d and p):
            continue
        for s in p["scenarios"]:
            if s.endswith(".base"):
                continue
            vd, vp = d["scenarios"].get(s, {}), p["scenarios"][s]
            fmt = lambda v: ("correct" if v.get("ok") else "WRONG") + f", FetchFailed {v.get('fetch_failed', '-')}" + \
                f", map reruns {max(v.get('map_stage_attempts', 1) - 1, 0)}"
            rows.append((case, f"data file {s.split('.', 1)[1]} after commit ({how} blocks)", fmt(vd), fmt(vp),
                         vp["ok"] and vp["fetch_failed"] > 0 and not p["fatal_signals"]
                         and not p["executor_removed"]))
    return rows


def markdown(rows: list, header: str) -> str:
    out = [header, "", "| case | criterion | default shuffle | plugin | met |", "|---|---|---|---|---|"]
    for case, crit, d, p, met in rows:
        out.append(f"| {case} | {crit} | {d} | {p} | {'yes' if met else '**no**'} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10, help="kill -9 repetitions per shuffle (default 10)")
    ap.add_argument("--cases", default="kill9,cut,blackhole,slow,disk,disk_plain")
    ap.add_argument("--modes", default="default,plugin", help="shuffles to run (default both)")
    ap.add_argument("--json", default=str(REPO / "target" / "bench" / "faults.json"))
    ap.add_argument("--render", action="store_true", help="only rewrite the table from the --json report")
    a = ap.parse_args()
    if a.render:
        report = json.loads(Path(a.json).read_text())
        return write_report(report, Path(a.json))
    cases = a.cases.split(",")
    runs = []
    for case in cases:
        for mode in a.modes.split(","):
            log(f"case {case}, {mode} shuffle")
            if case == "kill9":
                r = case_during_reduce(mode, "kill9", a.reps, case)
            elif case in ("cut", "blackhole"):
                r = case_during_reduce(mode, case, 1, case)
            elif case == "slow":
                r = case_slow(mode, case)
            elif case == "disk":
                r = case_disk(mode, list(DISK_FAULTS), case)
            elif case == "disk_plain":
                # Uncompressed blocks: nothing but the lengths can tell a short file.
                r = run_app(mode, [("before_reduce.truncate", "truncate")], {"spark.shuffle.compress": "false"},
                            case, case)
            else:
                raise SystemExit(f"unknown case {case}")
            runs.append(r)
            log(f"case {case}, {mode}: rc={r['rc']} wall {r['wall_s']} s, {r['run_dir']}")
    env = {k: v for k, v in (ln.split("=", 1) for ln in (STATE / "cluster.env").read_text().splitlines() if "=" in ln)}
    report = {"workers": int(env.get("N", "0")), "spark_version": env.get("SPARK_VERSION"), "reps": a.reps,
              "settings": {**COMMON, **SHORT_TIMEOUTS}, "runs": runs}
    return write_report(report, Path(a.json))


def write_report(report: dict, out: Path) -> int:
    rows = verdicts(report)
    report["criteria"] = [dict(zip(("case", "criterion", "default", "plugin", "met"), r)) for r in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    md = markdown(rows, f"Fault campaign: {report['workers']} workers, Spark {report['spark_version']}, "
                        f"kill -9 x {report['reps']} per shuffle")
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"report: {out} and {out.with_suffix('.md')}")
    return 0 if all(r[4] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
