"""Fixtures for the Spark job suite: the Spark runtime (pyspark's SPARK_HOME), the built jars,
and a cache of job runs shared by all tests of a session.

The jobs are ordinary Spark applications (jvm-plugin/jobs) that know nothing of the plugin.
All of them run in one application (executor start-up on 2 cores costs more than most jobs),
twice on `local-cluster[2,1,1024]` (two executor JVMs, so shuffle blocks cross processes):
once with Spark's default shuffle, once with the plugin installed as a user installs it on that
Spark line (`rdma_plugin_submit_args` in scripts/spark-env.sh: `--jars` on 4.x, the driver's and
executors' extraClassPath on 3.5).

Environment:
  RDMA_SPARK_PROFILE=spark-3.5     run on pyspark 3.5.9 with the -Pspark-3.5 build (default 4.x)
  RDMA_JOBS=terasort,sql           run a subset of the jobs
  RDMA_SHUFFLE_REQUIRE_NATIVE=1    a plugin run without the native engine fails the suite
                                   instead of skipping the engine checks (scripts/test.sh sets it)
"""
import glob
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from engine_stats import engine_totals  # noqa: E402,F401 - the tests import it from here
PLUGIN_CLASS = "org.apache.spark.shuffle.rdma.RdmaShuffleManager"
JOB_CLASS = "org.apache.spark.shuffle.rdma.jobs.ShuffleJobs"
PROFILE = os.environ.get("RDMA_SPARK_PROFILE", "")
# In CI the engine must run: a missing native library is a failure, not a skip.
REQUIRE_NATIVE = os.environ.get("RDMA_SHUFFLE_REQUIRE_NATIVE", "") == "1"
# Per-run limit: a hung shuffle must fail the test, not the CI budget.
RUN_TIMEOUT_S = int(os.environ.get("RDMA_JOB_TIMEOUT_S", "900"))

# Settings of the cluster (the same for both runs of a job, so the comparison is fair):
# - readHostLocalDisk=false: every executor of local-cluster is on 127.0.0.1, and Spark would
#   otherwise read other executors' blocks straight from their files instead of fetching them;
# - reduceLocality off: reduce tasks are not pulled to the executor holding most of their
#   input, so remote fetches really happen (bigblock relies on it);
# - shuffle.compress=false: keeps bigblock's block > 200 MB (its bytes are random anyway) and
#   the data on the wire equal to the data in the files.
CLUSTER_CONF = {
    "spark.shuffle.readHostLocalDisk": "false",
    "spark.shuffle.reduceLocality.enabled": "false",
    "spark.shuffle.compress": "false",
    "spark.ui.enabled": "false",
    # The job application's listener bus lags 5 ms per task end (ShuffleJobs' test hook), as
    # on a loaded machine: the exact comparisons of printed metrics with the engines' counters
    # (test_jobs, test_metrics) then fail whenever a job prints before the bus drained, instead
    # of only when the machine happens to be slow.
    "spark.rdma.jobs.listenerDelayMs": "5",
}


def spark_env() -> dict:
    """The environment scripts/spark-env.sh exports (creates the venv on first use)."""
    out = subprocess.run(
        ["bash", "-c", f". '{REPO}/scripts/spark-env.sh' >&2 && env -0"],
        check=True, capture_output=True, env={**os.environ, "RDMA_SPARK_PROFILE": PROFILE},
    ).stdout
    env = dict(kv.split("=", 1) for kv in out.decode().split("\0") if "=" in kv)
    return env


def plugin_submit_args(env: dict, jar: str) -> list:
    """spark-submit arguments installing the plugin from `jar` for the active Spark line, from
    the one definition in scripts/spark-env.sh (Spark 3.5 needs the jar on the JVMs' class path:
    it creates the shuffle manager before it adds --jars to an executor's class loader)."""
    out = subprocess.run(
        ["bash", "-c", f". '{REPO}/scripts/spark-env.sh' >&2 && rdma_plugin_submit_args \"$1\"", "_", jar],
        check=True, capture_output=True, text=True, env=env,
    ).stdout
    args = out.splitlines()
    assert args and args[0] == "--conf", args
    return args


def require_native_or_skip(loaded: bool, what: str) -> None:
    """Skips an engine check when the native library is absent, unless the run requires it."""
    if loaded:
        return
    msg = f"native library librdma_shuffle_jni.so did not load in {what}: shuffles handed to Spark"
    if REQUIRE_NATIVE:
        pytest.fail(msg + " (RDMA_SHUFFLE_REQUIRE_NATIVE=1)")
    pytest.skip(msg)


JOBS = os.environ.get("RDMA_JOBS", "wordcount,terasort,sql,sparse,bigblock").split(",")


@dataclass
class Run:
    """One spark-submit of all jobs in one mode."""
    mode: str
    returncode: int
    wall_s: float
    stdout: str
    stderr: str
    app_id: str | None
    executor_logs: dict = field(default_factory=dict)

    def line(self, prefix: str, job: str) -> dict:
        """Parses the `PREFIX job=<job> k=v k=v ...` line the application printed."""
        for ln in self.stdout.splitlines():
            if ln.startswith(f"{prefix} job={job} "):
                return dict(kv.split("=", 1) for kv in ln.split()[1:] if "=" in kv)
        raise AssertionError(f"{job}/{self.mode}: no '{prefix}' line in stdout; stderr tail:\n"
                             + self.stderr[-3000:])


class Runner:
    def __init__(self, env: dict, plugin_jar: str, jobs_jar: str):
        self.env = env
        self.plugin_jar = plugin_jar
        self.jobs_jar = jobs_jar
        self.plugin_args = plugin_submit_args(env, plugin_jar)
        self.cache: dict = {}

    def run(self, mode: str) -> Run:
        if mode not in self.cache:
            self.cache[mode] = self._submit(mode)
        return self.cache[mode]

    def custom(self, mode: str, jobs: str, scale: float, conf: dict) -> Run:
        """One application of `jobs` at `scale` with `conf` on top of the cluster's settings
        (cached like `run`)."""
        key = (mode, jobs, scale, tuple(sorted(conf.items())))
        if key not in self.cache:
            self.cache[key] = self._submit(mode, jobs, scale, conf)
        return self.cache[key]

    def _submit(self, mode: str, jobs: str | None = None, scale: float | None = None,
                conf: dict | None = None) -> Run:
        spark_home = self.env["SPARK_HOME"]
        cmd = [f"{spark_home}/bin/spark-submit", "--master", "local-cluster[2,1,1024]",
               "--driver-memory", "1g"]
        for k, v in {**CLUSTER_CONF, **(conf or {})}.items():
            cmd += ["--conf", f"{k}={v}"]
        if mode == "plugin":
            cmd += self.plugin_args
        cmd += ["--class", JOB_CLASS, self.jobs_jar, jobs or ",".join(JOBS)]
        if scale is not None:
            cmd.append(str(scale))
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=RUN_TIMEOUT_S)
        wall = time.monotonic() - t0
        m = re.search(r"app ID (app-\d+-\d+)", p.stderr)
        app_id = m.group(1) if m else None
        logs = {}
        if app_id:
            for f in glob.glob(f"{spark_home}/work/{app_id}/*/stderr"):
                logs[f] = Path(f).read_text(errors="replace")
        run = Run(mode, p.returncode, wall, p.stdout, p.stderr, app_id, logs)
        print(f"\n[spark-suite] {mode:7s} rc={p.returncode} submit wall={wall:6.1f}s app={app_id}")
        for ln in p.stdout.splitlines():
            if ln.startswith(("DIGEST ", "SHUFFLE_METRICS ")):
                print(f"[spark-suite] {mode:7s} {ln}")
        return run


@pytest.fixture(scope="session")
def runner() -> Runner:
    env = spark_env()
    plugin_jar, jobs_jar = env["RDMA_PLUGIN_JAR"], env["RDMA_JOBS_JAR"]
    if not (os.path.exists(plugin_jar) and os.path.exists(jobs_jar)):
        args = ["mvn", "-q", "-B", "package", "-DskipTests"] + ([f"-P{PROFILE}"] if PROFILE else [])
        subprocess.run(args, cwd=REPO / "jvm-plugin", check=True, env=env)
    print(f"\n[spark-suite] Spark {env['SPARK_VERSION']} ({env['SPARK_HOME']}), plugin {plugin_jar}")
    return Runner(env, plugin_jar, jobs_jar)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "tpcds: Spark's TPC-DS queries at a small scale under both shuffles "
        "(test_tpcds.py; needs Spark, TPC-DS data from DuckDB's generator, Maven for the query texts)")
