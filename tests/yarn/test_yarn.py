"""Spark on a real YARN cluster, Spark's default shuffle against the plugin (issue 38).

Three applications per shuffle, unchanged jobs of jvm-plugin/jobs, on the one MiniYARNCluster of
conftest.py (physical-memory check on):

- `jobs`, client mode, no external shuffle service: ShuffleJobs' word count, TeraSort and the
  AQE SQL job on 2 executors. Outputs equal; the engines fetched every block Spark read remotely.
- `kill`, cluster mode (the driver in the application master's container), no service:
  FaultJob's `during_reduce`; once reducers on both executors have read their first record, the
  container of the executor holding the most map outputs is killed (`kill -9` of its JVM).
  Recovered as under the default shuffle: a FetchFailed, the lost map outputs computed again, a
  new container, the result correct and equal.
- `service`, cluster mode, the `spark_shuffle` service and dynamic allocation: ElasticJob's
  `service` mode. Two shuffles' map stages run on executors that joined for them (the first
  shuffle's blocks cross executors: the engines move them), dynamic allocation releases every
  executor, and the last stage runs on new executors that read the second shuffle's outputs of
  the departed ones from the service. Nothing is recomputed; the result is correct and equal.

Every container's peak RSS under both shuffles is printed side by side at the end
(target/yarn/memory.md; docs/benchmarks.md has the table of a run).

Run: tests/yarn/run.sh (a step of scripts/test.sh).
"""
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, WORK

sys.path.insert(0, str(REPO / "scripts"))
import fault_campaign as fc  # noqa: E402

SHUFFLES = ["default", "plugin"]
JOBS_CLASS = "org.apache.spark.shuffle.rdma.jobs.ShuffleJobs"
FAULT_CLASS = "org.apache.spark.shuffle.rdma.jobs.FaultJob"
ELASTIC_CLASS = "org.apache.spark.shuffle.rdma.jobs.ElasticJob"
JOBS = ["wordcount", "terasort", "sql"]
JOBS_SCALE = os.environ.get("RDMA_YARN_SCALE", "0.25")
KILL = "during_reduce.kill9"
SERVICE_CONF = {
    "spark.shuffle.service.enabled": "true",
    "spark.dynamicAllocation.enabled": "true",
    "spark.dynamicAllocation.minExecutors": "0",
    "spark.dynamicAllocation.maxExecutors": "2",
    "spark.dynamicAllocation.executorIdleTimeout": "3s",
    "spark.dynamicAllocation.schedulerBacklogTimeout": "1s",
    "spark.dynamicAllocation.sustainedSchedulerBacklogTimeout": "1s",
}


def pids_of_executor(app_id: str, executor: str) -> list:
    """PIDs of the JVM of `executor` of `app_id` (YarnCoarseGrainedExecutorBackend)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [c.decode(errors="replace") for c in cmd]
        if any("YarnCoarseGrainedExecutorBackend" in a for a in args) and app_id in args and \
                "--executor-id" in args and args[args.index("--executor-id") + 1] == executor:
            out.append(int(pid))
    return out


def kill_during_reduce(gates: Path, fault: dict):
    """The fault of the `kill` application: waits (on the job's own lines and gate files) until
    the map stage is done and reducers on two executors have read their first record, kills the
    executor holding the most map outputs, and opens the gate."""

    def inject(app_id, driver_stdout):
        deadline = time.time() + 600
        done = None
        while done is None:
            for ln in driver_stdout().splitlines():
                if ln.startswith(f"FAULT_MAP_DONE scenario={KILL} ") and " attempt=0 " in ln:
                    done = fc.kv(ln)
            assert time.time() < deadline, "no FAULT_MAP_DONE line within 600 s"
            time.sleep(0.2)
        rx = re.compile(rf"^reading-{re.escape(KILL)}-exec(\w+)-part\d+-attempt0$")
        readers: set = set()
        while len(readers) < 2:
            readers = {m.group(1) for p in gates.iterdir() if (m := rx.match(p.name))}
            assert time.time() < deadline, f"reducers reading: {readers}"
            time.sleep(0.1)
        outputs = {e: int(n) for e, n in (x.split(":") for x in done["outputs"].split(","))}
        victim = max((e for e in outputs if readers - {e}), key=lambda e: (outputs[e], e))
        pids = pids_of_executor(app_id, victim)
        assert pids, f"no JVM of executor {victim} of {app_id}"
        fault.update(victim=victim, t=time.time(), pids=pids, outputs=outputs)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        (gates / f"go-{KILL}").touch()

    return inject


_apps: dict = {}


def app(submitter, name: str, shuffle: str):
    """The application `name` under `shuffle`, submitted once per session."""
    key = (name, shuffle)
    if key in _apps:
        return _apps[key]
    if name == "jobs":
        a = submitter.submit(name, shuffle, "client", JOBS_CLASS, [",".join(JOBS), JOBS_SCALE], {})
    elif name == "kill":
        gates = WORK / "gates" / shuffle
        gates.mkdir(parents=True, exist_ok=True)
        for f in gates.iterdir():
            f.unlink()
        fault: dict = {}
        a = submitter.submit(name, shuffle, "cluster", FAULT_CLASS, [str(gates), KILL, "2"],
                             {**fc.COMMON, **fc.SHORT_TIMEOUTS}, while_running=kill_during_reduce(gates, fault))
        (gates / f"go-{KILL}").touch()  # never leave a gated task waiting
        a.extra["fault"] = fault
    elif name == "service":
        a = submitter.submit(name, shuffle, "cluster", ELASTIC_CLASS, ["service"], SERVICE_CONF, executors=None)
    else:
        raise ValueError(name)
    _apps[key] = a
    return a


def both(submitter, name):
    runs = {s: app(submitter, name, s) for s in SHUFFLES}
    for s, a in runs.items():
        assert a.rc == 0, f"{name}/{s} failed (rc={a.rc}, {a.app_id}); driver log tail:\n{a.driver_log[-3000:]}"
    return runs


def assert_engine_ran(a):
    """Every executor of a plugin run that started loaded the plugin with its engine, and the
    engines fetched and served blocks. (A replacement container the application no longer
    needed may be stopped before its JVM started Spark: its log has no Spark line at all.)"""
    started = {cid: t for cid, t in a.executor_logs.items() if "Started daemon with process name" in t}
    assert len(started) >= 2, f"executor logs of {a.app_id}: {list(a.executor_logs)}"
    for cid, text in started.items():
        assert "RdmaShuffleManager created (isDriver=false" in text, cid
        assert "native=loaded" in text, cid
    assert a.total("blocks_fetched") > 0 and a.total("blocks_served") > 0, a.engines()


# --- the cluster --------------------------------------------------------------------------------

def test_the_nodemanager_enforces_physical_memory(yarn):
    site = Path(yarn.conf_dir, "yarn-site.xml").read_text()
    assert re.search(r"<name>yarn.nodemanager.pmem-check-enabled</name>\s*<value>true</value>", site)


# --- jobs: client mode, no service -----------------------------------------------------------------

@pytest.mark.parametrize("job", JOBS)
def test_jobs_outputs_equal(submitter, job):
    runs = both(submitter, "jobs")
    d, p = (runs[s].lines("DIGEST") for s in SHUFFLES)
    dj, pj = [x for x in d if x["job"] == job], [x for x in p if x["job"] == job]
    assert dj and dj == pj, (dj, pj)
    assert int(dj[0]["records"]) > 0


def test_jobs_engines_moved_every_remote_block(submitter):
    runs = both(submitter, "jobs")
    p = runs["plugin"]
    assert_engine_ran(p)
    assert p.total("delegated_requests") == 0, p.engines()
    assert p.total("failed_blocks_fetched") == 0, p.engines()
    remote = sum(int(m["remote_bytes"]) for m in p.lines("SHUFFLE_METRICS"))
    assert remote > 0
    assert p.total("bytes_fetched") == remote, (p.engines(), remote)
    assert "RdmaShuffleManager" not in runs["default"].driver_log


# --- kill: cluster mode, a container killed mid-shuffle ------------------------------------------

def test_kill_recovered_as_under_the_default_shuffle(submitter):
    runs = both(submitter, "kill")
    results = {}
    for s, a in runs.items():
        fault = a.extra["fault"]
        assert fault.get("pids"), (s, fault)
        r = [x for x in a.lines("FAULT_RESULT") if x["scenario"] == KILL]
        assert r and r[0]["ok"] == "true", (s, r)
        results[s] = (r[0]["records"], r[0]["sum"])
        rep = fc.scenario_report(a.events, KILL, fault["t"], fault["victim"])
        print(f"[yarn] kill/{s}: victim {fault['victim']} {rep}")
        # The lost outputs were found missing (FetchFailed) and computed again.
        assert rep["fetch_failed"] > 0, (s, rep)
        assert rep["map_stage_attempts"] >= 2, (s, rep)
        removed = fc.executor_deaths(a.events)
        assert any("137" in r or "killed" in r.lower() or "exited" in r.lower() for r in removed), removed
    assert results["default"] == results["plugin"], results
    assert_engine_ran(runs["plugin"])


# --- service: cluster mode, the spark_shuffle service, dynamic allocation -------------------------

def test_service_executors_released_and_outputs_read_from_the_service(submitter):
    runs = both(submitter, "service")
    results = {}
    for s, a in runs.items():
        [res] = a.lines("ELASTIC_RESULT")
        assert res["ok"] == "true", (s, res)
        assert res["maps_rerun"] == "0", (s, res)  # nothing recomputed: the service served them
        results[s] = (res["records"], res["sum"])
        [done] = a.lines("ELASTIC_MAP_DONE")
        [released] = a.lines("ELASTIC_RELEASED")
        holders = {x.split(":")[0] for x in done["outputs"].split(",")}
        removed = set(released["removed"].split(","))
        assert holders and holders <= removed, (s, done, released)
        # After the release the outputs are still placed on the departed executors.
        assert released["outputs"] == done["outputs"], (s, done, released)
        [execs] = a.lines("ELASTIC_EXECUTORS")
        assert set(execs["added"].split(",")) - removed, (s, execs, released)  # new executors ran the last stage
    assert results["default"] == results["plugin"], results


def test_service_engines_moved_blocks_of_live_executors_and_the_service_the_rest(submitter):
    p = both(submitter, "service")["plugin"]
    assert_engine_ran(p)
    from_service = p.total("service_fallback_blocks") + p.total("delegated_requests")
    print(f"[yarn] service/plugin engines: blocks_fetched={p.total('blocks_fetched')} "
          f"service_fallback_blocks={p.total('service_fallback_blocks')} "
          f"delegated_requests={p.total('delegated_requests')} departed={p.total('departed_executors')}")
    assert from_service > 0, p.engines()
    assert "beside the external shuffle service" in p.driver_log


# --- all of them -----------------------------------------------------------------------------------

def test_no_container_went_over_its_memory(submitter, yarn):
    """Every application ran within its containers' sizes: the NodeManager's physical-memory
    check killed none (it logs 'running beyond physical memory limits' when it does)."""
    for name in ("jobs", "kill", "service"):
        both(submitter, name)
    log = (WORK / "cluster" / "minicluster.log").read_text(errors="replace")
    assert "beyond physical memory" not in log and "beyond the 'PHYSICAL' memory limit" not in log
