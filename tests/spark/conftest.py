"""Fixtures for the Spark job suite: the Spark runtime (pyspark's SPARK_HOME), the built jars,
and a cache of job runs shared by all tests of a session.

The jobs are ordinary Spark applications (jvm-plugin/jobs) that know nothing of the plugin.
All of them run in one application (executor start-up on 2 cores costs more than most jobs),
twice on `local-cluster[2,1,1024]` (two executor JVMs, so shuffle blocks cross processes):
once with Spark's default shuffle, once with
`spark.shuffle.manager=org.apache.spark.shuffle.rdma.RdmaShuffleManager --jars <plugin jar>`.
Set RDMA_JOBS=terasort,sql to run a subset.
"""
import glob
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN_CLASS = "org.apache.spark.shuffle.rdma.RdmaShuffleManager"
JOB_CLASS = "org.apache.spark.shuffle.rdma.jobs.ShuffleJobs"
PROFILE = os.environ.get("RDMA_SPARK_PROFILE", "")
LINE = "3.5" if PROFILE == "spark-3.5" else "4.x"
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
}


def spark_env() -> dict:
    """The environment scripts/spark-env.sh exports (creates the venv on first use)."""
    out = subprocess.run(
        ["bash", "-c", f". '{REPO}/scripts/spark-env.sh' >&2 && env -0"],
        check=True, capture_output=True, env={**os.environ, "RDMA_SPARK_PROFILE": PROFILE},
    ).stdout
    env = dict(kv.split("=", 1) for kv in out.decode().split("\0") if "=" in kv)
    return env


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
        self.cache: dict = {}

    def run(self, mode: str) -> Run:
        if mode not in self.cache:
            self.cache[mode] = self._submit(mode)
        return self.cache[mode]

    def _submit(self, mode: str) -> Run:
        spark_home = self.env["SPARK_HOME"]
        cmd = [f"{spark_home}/bin/spark-submit", "--master", "local-cluster[2,1,1024]",
               "--driver-memory", "1g"]
        for k, v in CLUSTER_CONF.items():
            cmd += ["--conf", f"{k}={v}"]
        if mode == "plugin":
            cmd += ["--conf", f"spark.shuffle.manager={PLUGIN_CLASS}", "--jars", self.plugin_jar]
        cmd += ["--class", JOB_CLASS, self.jobs_jar, ",".join(JOBS)]
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


def _jar(module: str, artifact: str, scala: str) -> str:
    return str(REPO / "jvm-plugin" / module / "target" / f"spark-{LINE}" /
               f"{artifact}-spark{LINE}_{scala}-0.1.0-SNAPSHOT.jar")


@pytest.fixture(scope="session")
def runner() -> Runner:
    env = spark_env()
    scala = env["SCALA_BINARY"]
    plugin_jar = _jar("plugin", "rdma-shuffle", scala)
    jobs_jar = _jar("jobs", "rdma-shuffle-jobs", scala)
    if not (os.path.exists(plugin_jar) and os.path.exists(jobs_jar)):
        args = ["mvn", "-q", "-B", "package", "-DskipTests"] + ([f"-P{PROFILE}"] if PROFILE else [])
        subprocess.run(args, cwd=REPO / "jvm-plugin", check=True, env=env)
    return Runner(env, plugin_jar, jobs_jar)
