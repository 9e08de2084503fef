"""Executors that leave and join while shuffle data is live, through the plugin: decommissioning
with shuffle-block migration, and dynamic allocation with shuffle tracking (issue 14).

ElasticJob (jvm-plugin/jobs) runs on local-cluster[3,1,1024] as an unchanged application:
- decommission: after the map stage, the executor holding most map outputs is decommissioned
  (spark.decommission.enabled, spark.storage.decommission.shuffleBlocks.enabled); Spark
  migrates its outputs to the two others, and the reduce stage reads them. The plugin registers
  each migrated output with the receiving executor's engine, so the reducers fetch them through
  the engine: no map task runs again, nothing is fetched through Spark's block transfer instead.
- dynamic: dynamic allocation with shuffle tracking, from 1 executor: two rounds of a
  three-stage job; executors are added during each round and removed between them, and the
  second round runs on new executors, whose engines serve each other.

Both modes are self-checking (the driver computes the expected digest without a shuffle).
RDMA_ELASTIC_SHUFFLES=default,plugin also runs them with Spark's default shuffle and prints both
walls (what the README's fault table quotes); CI runs the plugin only.

Run: `tests/spark/run.sh -k elastic`.
"""
import glob
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import CLUSTER_CONF, RUN_TIMEOUT_S, engine_totals, plugin_submit_args

ELASTIC_JOB = "org.apache.spark.shuffle.rdma.jobs.ElasticJob"
SHUFFLES = os.environ.get("RDMA_ELASTIC_SHUFFLES", "plugin").split(",")

MODE_CONF = {
    "decommission": {
        "spark.decommission.enabled": "true",
        "spark.storage.decommission.enabled": "true",
        "spark.storage.decommission.shuffleBlocks.enabled": "true",
        "spark.storage.decommission.rddBlocks.enabled": "false",
    },
    "dynamic": {
        "spark.dynamicAllocation.enabled": "true",
        "spark.dynamicAllocation.shuffleTracking.enabled": "true",
        "spark.dynamicAllocation.minExecutors": "0",
        "spark.dynamicAllocation.initialExecutors": "1",
        "spark.dynamicAllocation.maxExecutors": "3",
        "spark.dynamicAllocation.executorIdleTimeout": "2s",
        "spark.dynamicAllocation.schedulerBacklogTimeout": "1s",
        "spark.dynamicAllocation.sustainedSchedulerBacklogTimeout": "1s",
    },
}


def parse(stdout: str, prefix: str) -> list:
    return [dict(kv.split("=", 1) for kv in ln.split()[1:] if "=" in kv)
            for ln in stdout.splitlines() if ln.startswith(prefix + " ")]


_cache: dict = {}


def run(runner, mode: str, shuffle: str) -> dict:
    """One ElasticJob application (cached per mode and shuffle)."""
    key = (mode, shuffle)
    if key in _cache:
        return _cache[key]
    env = runner.env
    cmd = [f"{env['SPARK_HOME']}/bin/spark-submit", "--master", "local-cluster[3,1,1024]",
           "--driver-memory", "1g"]
    for k, v in {**CLUSTER_CONF, **MODE_CONF[mode]}.items():
        cmd += ["--conf", f"{k}={v}"]
    if shuffle == "plugin":
        cmd += plugin_submit_args(env, runner.plugin_jar)
    cmd += ["--class", ELASTIC_JOB, runner.jobs_jar, mode]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)
    wall = time.monotonic() - t0
    m = re.search(r"app ID (app-\d+-\d+)", p.stderr)
    logs = {}
    if m:
        for f in glob.glob(f"{env['SPARK_HOME']}/work/{m.group(1)}/*/stderr"):
            logs[f] = Path(f).read_text(errors="replace")
    out = {"rc": p.returncode, "wall_s": wall, "stdout": p.stdout, "stderr": p.stderr, "logs": logs}
    results = parse(p.stdout, "ELASTIC_RESULT")
    print(f"\n[elastic] {mode:12s} {shuffle:7s} rc={p.returncode} wall={wall:6.1f}s "
          + " ".join(f"round{r['round']}:ok={r['ok']},maps_rerun={r['maps_rerun']}" for r in results))
    for ln in p.stdout.splitlines():
        if ln.startswith(("ELASTIC_MIGRATED", "ELASTIC_ROUND", "ELASTIC_EXECUTORS", "ELASTIC_MAP_DONE")):
            print(f"[elastic] {mode:12s} {shuffle:7s} {ln}")
    _cache[key] = out
    return out


def succeeded(r: dict, rounds: int) -> list:
    assert r["rc"] == 0, f"rc={r['rc']}; stdout:\n{r['stdout'][-2000:]}\nstderr tail:\n{r['stderr'][-4000:]}"
    results = parse(r["stdout"], "ELASTIC_RESULT")
    assert len(results) == rounds, results
    for res in results:
        assert res["ok"] == "true", res
        assert res["records"] == res["expected_records"] and res["sum"] == res["expected_sum"], res
    return results


def executors_line(r: dict) -> tuple:
    (ex,) = parse(r["stdout"], "ELASTIC_EXECUTORS")
    split = lambda s: {x for x in s.split(",") if x}
    return split(ex.get("added", "")), split(ex.get("removed", ""))


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_decommissioned_executor_outputs_are_migrated_and_read(runner, shuffle):
    r = run(runner, "decommission", shuffle)
    (res,) = succeeded(r, 1)
    # The reducers read the migrated outputs: not one map task ran again.
    assert res["maps_rerun"] == "0", res
    (done,) = parse(r["stdout"], "ELASTIC_MAP_DONE")
    (mig,) = parse(r["stdout"], "ELASTIC_MIGRATED")
    victim = mig["victim"]
    before = dict(kv.split(":") for kv in done["outputs"].split(","))
    after = dict(kv.split(":") for kv in mig["outputs"].split(","))
    assert victim in before and victim not in after, (before, after)
    assert mig["missing"] == "0", mig
    assert sum(map(int, after.values())) == sum(map(int, before.values())), (before, after)
    if shuffle != "plugin":
        return
    totals = engine_totals(r["stderr"])
    migrated = int(before[victim])
    registered = sum(t.get("migrated_registrations", 0) for e, t in totals.items() if e != victim)
    assert registered >= migrated, (
        f"{migrated} outputs migrated off executor {victim}, {registered} registered with the "
        f"receivers' engines: {totals}")
    assert all(t.get("registration_failures", 0) == 0 for t in totals.values()), totals
    # Every remote block went through an engine, none through Spark's block transfer instead.
    assert sum(t.get("native_requests", 0) for t in totals.values()) > 0, totals
    assert all(t.get("delegated_requests", 0) == 0 for t in totals.values()), totals
    assert all(t.get("blocks_unknown_to_engine", 0) == 0 for t in totals.values()), totals


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_dynamic_allocation_executors_come_and_go(runner, shuffle):
    r = run(runner, "dynamic", shuffle)
    succeeded(r, 2)
    rounds = {x["round"]: {e for e in x["executors"].split(",") if e} for x in parse(r["stdout"], "ELASTIC_ROUND")}
    added, removed = executors_line(r)
    # Executors came during round 1 (it starts with one), all of them left after it, and round 2
    # ran on new ones.
    assert len(rounds["1"]) >= 2, rounds
    assert rounds["1"] <= removed, (rounds, removed)
    assert rounds["2"] and not (rounds["2"] & rounds["1"]), rounds
    assert rounds["1"] | rounds["2"] <= added, (rounds, added)
    if shuffle != "plugin":
        return
    totals = engine_totals(r["stderr"])
    assert any(totals.get(e, {}).get("native_requests", 0) > 0 for e in rounds["2"]), (rounds, totals)
    assert all(t.get("delegated_requests", 0) == 0 for t in totals.values()), totals
    assert all(t.get("blocks_unknown_to_engine", 0) == 0 for t in totals.values()), totals
