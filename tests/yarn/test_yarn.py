"""Spark on a real YARN cluster, Spark's default shuffle against the plugin (issue 38).

Two applications per shuffle (YarnJob of jvm-plugin/jobs, unchanged jobs in one application
each: starting an application costs more than its jobs), on the one MiniYARNCluster of
conftest.py (physical-memory check on, the `spark_shuffle` auxiliary service):

- `jobs`, client mode, no external shuffle service, 2 executors: ShuffleJobs' word count,
  TeraSort and AQE SQL job, then FaultJob's `during_reduce`: once reducers on both executors have
  read their first record, the container of the executor holding the most map outputs is killed
  (`kill -9` of its JVM). Outputs equal; the engines served and fetched the jobs' remote blocks;
  the kill recovered as under the default shuffle: a FetchFailed, the lost map outputs computed
  again, a new container, the result correct and equal.
- `service`, cluster mode (the driver in the application master's container), the
  `spark_shuffle` service and dynamic allocation from 0 executors: ElasticJob's `service` mode
  (two shuffles' map stages on executors that joined for them, the first shuffle's blocks
  crossing executors through the engines; dynamic allocation releases every executor; the last
  stage runs on new executors reading the departed ones' outputs from the service: nothing
  recomputed), then FaultJob's `during_reduce` kill on the executors dynamic allocation brings in
  for it: with the service, no FetchFailed and nothing recomputed under either shuffle (the
  plugin's fetches towards the dead executor go to the service).

So client and cluster mode, without and with the service, each run; `RDMA_TEST_FULL=1`
(`scripts/test.sh --full`) adds the other two pairings (`jobs` in cluster mode, `service` in
client mode) and runs the jobs at scale 1.

- `jobs35`, Spark 3.5.9 (client mode; also cluster mode under --full): ShuffleJobs' three jobs
  under the plugin, installed as docs/yarn.md gives for 3.5 on YARN; digests equal to the `jobs`
  application's under Spark 4.x's default shuffle, the engines' counters equal to Spark's remote
  reads.

Every container's peak RSS under both shuffles is
printed side by side at the end (target/yarn/memory.md; docs/benchmarks.md has the table of a
run), and no container went over its size (the NodeManager's physical-memory check).

Run: tests/yarn/run.sh (a step of scripts/test.sh).
"""
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import APP_TIMEOUT_S, REPO, WORK

sys.path.insert(0, str(REPO / "scripts"))
import fault_campaign as fc  # noqa: E402

FULL = os.environ.get("RDMA_TEST_FULL") == "1"
SHUFFLES = ["default", "plugin"]
YARN_JOB = "org.apache.spark.shuffle.rdma.jobs.YarnJob"
SHUFFLE_JOBS = "org.apache.spark.shuffle.rdma.jobs.ShuffleJobs"
SPARK35 = os.environ.get("RDMA_YARN_SPARK35", "1") == "1"
JOBS = ["wordcount", "terasort", "sql"]
JOBS_SCALE = os.environ.get("RDMA_YARN_SCALE", "1" if FULL else "0.25")
KILL = "during_reduce.kill9"
# (application, deploy mode): CI runs the first two; --full all four.
APPS = [("jobs", "client"), ("service", "cluster")] + ([("jobs", "cluster"), ("service", "client")] if FULL else [])
JOBS_APPS = [a for a in APPS if a[0] == "jobs"]
SERVICE_APPS = [a for a in APPS if a[0] == "service"]
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
    """The fault both applications take: waits (on the job's own lines and gate files) until the
    kill scenario's map stage is done and reducers on two executors have read their first
    record, kills the executor holding the most map outputs, and opens the gate (always: a
    harness that failed must not leave tasks waiting)."""

    def inject(app_id, driver_stdout):
        deadline = time.time() + APP_TIMEOUT_S
        try:
            done = None
            while done is None:
                for ln in driver_stdout().splitlines():
                    if ln.startswith(f"FAULT_MAP_DONE scenario={KILL} ") and " attempt=0 " in ln:
                        done = fc.kv(ln)
                assert time.time() < deadline, f"no FAULT_MAP_DONE line within {APP_TIMEOUT_S} s"
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
        finally:
            (gates / f"go-{KILL}").touch()

    return inject


_apps: dict = {}


def app(submitter, name: str, deploy: str, shuffle: str):
    """The application `name` in `deploy` mode under `shuffle`, submitted once per session."""
    key = (name, deploy, shuffle)
    if key in _apps:
        return _apps[key]
    gates = WORK / "gates" / f"{name}-{deploy}-{shuffle}"
    gates.mkdir(parents=True, exist_ok=True)
    for f in gates.iterdir():
        f.unlink()
    fault: dict = {}
    if name == "jobs":
        args, conf, executors = [str(gates), JOBS_SCALE], {**fc.COMMON, **fc.SHORT_TIMEOUTS}, 2
    else:
        args, conf, executors = [str(gates)], {**fc.COMMON, **fc.SHORT_TIMEOUTS, **SERVICE_CONF}, None
    a = submitter.submit(name, shuffle, deploy, YARN_JOB, [name, *args], conf,
                         executors=executors, while_running=kill_during_reduce(gates, fault))
    a.extra["fault"] = fault
    _apps[key] = a
    return a


def both(submitter, name, deploy):
    runs = {s: app(submitter, name, deploy, s) for s in SHUFFLES}
    for s, a in runs.items():
        assert a.rc == 0, f"{name}/{deploy}/{s} failed (rc={a.rc}, {a.app_id}); driver log tail:\n{a.driver_log[-3000:]}"
        assert not a.extra.get("inject_error"), (s, a.extra["inject_error"])
    return runs


def assert_engine_ran(a):
    """Every executor of a plugin run that started loaded the plugin with its engine, and the
    engines fetched and served blocks. (A replacement container the application no longer
    needed may be stopped, or find the driver gone, before its executor started: only
    containers whose executor started — "Starting executor ID", logged once it registered
    with the driver — are held to this.)"""
    started = {cid: t for cid, t in a.executor_logs.items() if "Executor: Starting executor ID" in t}
    assert len(started) >= 2, f"executor logs of {a.app_id}: {list(a.executor_logs)}"
    for cid, text in started.items():
        assert "RdmaShuffleManager created (isDriver=false" in text, cid
        assert "native=loaded" in text, cid
    assert a.total("blocks_fetched") > 0 and a.total("blocks_served") > 0, a.engines()


def kill_report(a, shuffle):
    """The kill scenario of `a`: its result line and what the event log says of it."""
    fault = a.extra["fault"]
    assert fault.get("pids"), (shuffle, fault)
    [r] = [x for x in a.lines("FAULT_RESULT") if x["scenario"] == KILL]
    assert r["ok"] == "true", (shuffle, r)
    rep = fc.scenario_report(a.events, KILL, fault["t"], fault["victim"])
    print(f"[yarn] {a.name}-{a.deploy}/{shuffle} kill: victim {fault['victim']} {rep}")
    # The harness's kill -9 is what removed the victim: YARN reports its container's exit 137.
    removed = [e.get("Removed Reason", "") for e in a.events if e["Event"] == "SparkListenerExecutorRemoved"
               and e.get("Executor ID") == fault["victim"]]
    assert removed and all("Exit status: 137" in r for r in removed), removed
    return (r["records"], r["sum"]), rep


# --- the cluster --------------------------------------------------------------------------------

def test_the_nodemanager_enforces_physical_memory(yarn):
    site = Path(yarn.conf_dir, "yarn-site.xml").read_text()
    assert re.search(r"<name>yarn.nodemanager.pmem-check-enabled</name>\s*<value>true</value>", site)


# --- jobs: no service ----------------------------------------------------------------------------

@pytest.mark.parametrize("deploy", [d for _, d in JOBS_APPS])
@pytest.mark.parametrize("job", JOBS)
def test_jobs_outputs_equal(submitter, deploy, job):
    runs = both(submitter, "jobs", deploy)
    d, p = (runs[s].lines("DIGEST") for s in SHUFFLES)
    dj, pj = [x for x in d if x["job"] == job], [x for x in p if x["job"] == job]
    assert dj and dj == pj, (dj, pj)
    assert int(dj[0]["records"]) > 0


@pytest.mark.parametrize("deploy", [d for _, d in JOBS_APPS])
def test_jobs_the_engines_moved_the_remote_blocks(submitter, deploy):
    runs = both(submitter, "jobs", deploy)
    p = runs["plugin"]
    assert_engine_ran(p)
    # The jobs' remote reads (Spark's own metrics) went through the engines: they fetched at
    # least that much (the kill scenario after the jobs fetched more; tests/spark checks the
    # counters equal to Spark's reads where nothing else runs in the application).
    remote = sum(int(m["remote_bytes"]) for m in p.lines("SHUFFLE_METRICS"))
    assert remote > 0
    assert p.total("bytes_fetched") >= remote, (p.engines(), remote)
    assert "RdmaShuffleManager" not in runs["default"].driver_log


@pytest.mark.parametrize("deploy", [d for _, d in JOBS_APPS])
def test_jobs_a_killed_container_recovered_as_under_the_default_shuffle(submitter, deploy):
    runs = both(submitter, "jobs", deploy)
    results = {}
    for s, a in runs.items():
        results[s], rep = kill_report(a, s)
        # Without the service the lost outputs were found missing (FetchFailed) and computed again.
        assert rep["fetch_failed"] > 0, (s, rep)
        assert rep["map_stage_attempts"] >= 2, (s, rep)
    assert results["default"] == results["plugin"], results


# --- service: the spark_shuffle service and dynamic allocation --------------------------------------

@pytest.mark.parametrize("deploy", [d for _, d in SERVICE_APPS])
def test_service_executors_released_and_outputs_read_from_the_service(submitter, deploy):
    runs = both(submitter, "service", deploy)
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


@pytest.mark.parametrize("deploy", [d for _, d in SERVICE_APPS])
def test_service_a_killed_container_costs_no_fetch_failure(submitter, deploy):
    """With the service, Spark keeps a killed executor's map outputs (the NodeManager's service
    still serves its files): the default shuffle's reducers read them from the service, and the
    plugin's fetches towards the dead executor go there too. No FetchFailed, nothing recomputed."""
    runs = both(submitter, "service", deploy)
    results = {}
    for s, a in runs.items():
        results[s], rep = kill_report(a, s)
        assert rep["fetch_failed"] == 0, (s, rep)
        assert rep["map_stage_attempts"] == 1, (s, rep)
    assert results["default"] == results["plugin"], results


@pytest.mark.parametrize("deploy", [d for _, d in SERVICE_APPS])
def test_service_engines_moved_blocks_of_live_executors_and_the_service_the_rest(submitter, deploy):
    p = both(submitter, "service", deploy)["plugin"]
    assert_engine_ran(p)
    from_service = p.total("service_fallback_blocks") + p.total("delegated_requests")
    print(f"[yarn] service-{deploy}/plugin engines: blocks_fetched={p.total('blocks_fetched')} "
          f"service_fallback_blocks={p.total('service_fallback_blocks')} "
          f"delegated_requests={p.total('delegated_requests')} departed={p.total('departed_executors')}")
    # Blocks of departed (released or killed) executors came from the service.
    assert from_service > 0, p.engines()
    assert "beside the external shuffle service" in p.driver_log


# --- Spark 3.5 -------------------------------------------------------------------------------------

@pytest.mark.skipif(not SPARK35, reason="RDMA_YARN_SPARK35=0")
@pytest.mark.parametrize("deploy", ["client"] + (["cluster"] if FULL else []))
def test_spark35_jobs_outputs_equal_and_the_engines_moved_every_remote_block(submitter, deploy):
    """Spark 3.5 on the same cluster: one application of ShuffleJobs (2 executors) under the
    plugin, installed the way docs/yarn.md gives for 3.5 on YARN (`--jars` and the container's
    relative `extraClassPath`). Its digests equal those of the same deterministic jobs at the
    same scale under Spark 4.x's default shuffle (the `jobs` application), and, where it runs
    (`RDMA_TEST_FULL=1` or RDMA_YARN_SPARK35_DEFAULT=1), under Spark 3.5's own. Nothing else
    runs in this application, so the engines' counters must equal Spark's remote reads."""
    p = submitter.submit("jobs35", "plugin", deploy, SHUFFLE_JOBS, [",".join(JOBS), JOBS_SCALE], {},
                         line="3.5")
    refs = {"4.x default": both(submitter, "jobs", "client")["default"]}
    if FULL or os.environ.get("RDMA_YARN_SPARK35_DEFAULT") == "1":
        refs["3.5 default"] = submitter.submit("jobs35", "default", deploy, SHUFFLE_JOBS,
                                               [",".join(JOBS), JOBS_SCALE], {}, line="3.5")
    for a in (p, *refs.values()):
        assert a.rc == 0, f"{a.name}/{a.shuffle} failed (rc={a.rc}, {a.app_id}):\n{a.driver_log[-3000:]}"
    digest = lambda a: {x["job"]: (x["records"], x["sum"]) for x in a.lines("DIGEST")}
    got = digest(p)
    assert sorted(got) == sorted(JOBS), got
    for what, ref in refs.items():
        assert got == digest(ref), (what, got, digest(ref))
    assert "Running Spark version 3.5" in p.driver_log
    assert_engine_ran(p)
    remote = sum(int(m["remote_bytes"]) for m in p.lines("SHUFFLE_METRICS"))
    assert remote > 0
    assert p.total("bytes_fetched") == remote, (p.engines(), remote)
    assert p.total("delegated_requests") == 0 and p.total("failed_blocks_fetched") == 0, p.engines()


# --- all of them -----------------------------------------------------------------------------------

def test_no_container_went_over_its_memory(submitter, yarn):
    """Every application ran within its containers' sizes: the NodeManager's physical-memory
    check killed none (it logs 'running beyond physical memory limits' when it does)."""
    for name, deploy in APPS:
        both(submitter, name, deploy)
    log = (WORK / "cluster" / "minicluster.log").read_text(errors="replace")
    assert "beyond physical memory" not in log and "beyond the 'PHYSICAL' memory limit" not in log
