"""A real YARN cluster for the suite, and spark-submit of unchanged jobs onto it.

One MiniYARNCluster (tests/yarn/src/MiniYarn.java: a ResourceManager and one NodeManager in one
JVM, the NodeManager's physical-memory check on, the `spark_shuffle` auxiliary service) is
started once per session and shared by every case; tests/yarn/run.sh sets its class path. Each
application is submitted with `spark-submit --master yarn` (client or cluster deploy mode), once
with Spark's default shuffle and once with the plugin installed as a user installs it
(`rdma_plugin_submit_args`: `--jars` on 4.x), with the same settings. While an application runs,
the RSS of every container's processes is sampled from /proc (the figure the NodeManager's
physical-memory check compares with the container's size), and each container's peak is kept.

All containers are on this one host: `spark.shuffle.readHostLocalDisk=false` makes executors
fetch each other's blocks (else Spark reads them from the other executor's files, and neither
the engine nor the service moves anything); on a cluster of several hosts that is what happens
between hosts anyway.
"""
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from engine_stats import engine_totals  # noqa: E402


def _spark_suite():
    """tests/spark/conftest.py (its Spark runtime and plugin install helpers), under a name of
    its own: this file is `conftest` too."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("spark_suite_conftest", REPO / "tests" / "spark" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_spark = _spark_suite()
spark_env, plugin_submit_args = _spark.spark_env, _spark.plugin_submit_args

WORK = REPO / "target" / "yarn"
APP_TIMEOUT_S = int(os.environ.get("RDMA_YARN_APP_TIMEOUT_S", "900"))
CONTAINER_RE = re.compile(r"container_(?:e\d+_)?(\d+)_(\d+)_\d+_(\d+)")

# The settings every application gets, under both shuffles.
COMMON_CONF = {
    # Executors on one host fetch each other's blocks instead of reading their files.
    "spark.shuffle.readHostLocalDisk": "false",
    # Reduce tasks are not pulled to the executor holding most of their input.
    "spark.shuffle.reduceLocality.enabled": "false",
    "spark.ui.enabled": "false",
    # A failed driver in cluster mode is not run again in a second application attempt.
    "spark.yarn.maxAppAttempts": "1",
    # Spark's jars are on the node already (pyspark's SPARK_HOME): nothing is zipped or uploaded.
    "spark.yarn.jars": "local:{SPARK_HOME}/jars/*",
    "spark.executor.memory": "512m",
    "spark.executor.cores": "1",
    "spark.driver.memory": "512m",
    "spark.yarn.am.memory": "512m",
    "spark.eventLog.enabled": "true",
    "spark.eventLog.compress": "false",
    "spark.eventLog.rolling.enabled": "false",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MemorySampler(threading.Thread):
    """Peak RSS per YARN container: every 0.5 s, the RSS of each process whose command line
    names a container (its launch shells and its JVM), summed per container."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peaks: dict = {}   # container id -> peak bytes
        self.roles: dict = {}   # container id -> "am" | "executor <id>"
        self.live: set = set()  # containers with a process at the last sample
        self._halt = threading.Event()

    def run(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._halt.is_set():
            now: dict = {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    m = CONTAINER_RE.search(cmd)
                    if not m:
                        continue
                    rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
                except (OSError, ValueError, IndexError):
                    continue
                cid = m.group(0)
                now[cid] = now.get(cid, 0) + rss
                if "YarnCoarseGrainedExecutorBackend" in cmd:
                    e = re.search(r"--executor-id (\S+)", cmd)
                    self.roles[cid] = f"executor {e.group(1) if e else '?'}"
                elif "deploy.yarn.ApplicationMaster" in cmd or "deploy.yarn.ExecutorLauncher" in cmd:
                    self.roles[cid] = "am"
            for cid, rss in now.items():
                self.peaks[cid] = max(self.peaks.get(cid, 0), rss)
            self.live = set(now)
            self._halt.wait(0.5)

    def stop(self):
        self._halt.set()
        self.join(timeout=5)

    @staticmethod
    def _of(app_id: str, cid: str) -> bool:
        ts, num = app_id.split("_")[1:3]
        m = CONTAINER_RE.fullmatch(cid)
        return bool(m) and m.group(1) == ts and int(m.group(2)) == int(num)

    def of_app(self, app_id: str) -> dict:
        """role -> peak bytes for the containers of `app_id`."""
        return {self.roles.get(cid, cid): peak for cid, peak in self.peaks.items() if self._of(app_id, cid)}

    def running(self, app_id: str) -> bool:
        return any(self._of(app_id, cid) for cid in self.live)


class Yarn:
    """The running MiniYARNCluster: its configuration directory and container log directory."""

    def __init__(self):
        self.env = spark_env()
        shutil.rmtree(WORK / "cluster", ignore_errors=True)
        (WORK / "cluster").mkdir(parents=True)
        self.service_port = free_port()
        cp = os.environ.get("RDMA_YARN_CLASSPATH")
        assert cp, "run the suite through tests/yarn/run.sh (it sets RDMA_YARN_CLASSPATH)"
        self.aux_class = os.environ.get("RDMA_YARN_AUX_CLASS", "rdmashuffle.yarn.SparkShuffleAuxService")
        cmd = [f"{self.env['JAVA_HOME']}/bin/java", "-Xmx768m", "-cp", cp, "rdmashuffle.yarn.MiniYarn",
               str(WORK / "cluster"), str(self.service_port), self.aux_class,
               os.environ.get("RDMA_YARN_AUX_CLASSPATH", "")]
        self.log = open(WORK / "cluster" / "minicluster.log", "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=WORK / "cluster", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=self.env)
        line = ""
        while "MINIYARN_READY" not in line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise AssertionError(f"MiniYARNCluster exited (rc={self.proc.returncode}); "
                                     f"see {WORK / 'cluster' / 'minicluster.log'}")
        kv = dict(x.split("=", 1) for x in line.split()[1:])
        self.conf_dir, self.logs = kv["conf"], Path(kv["logs"])
        self.start_s = time.monotonic() - t0
        self.env = {**self.env, "HADOOP_CONF_DIR": self.conf_dir}
        print(f"\n[yarn] MiniYARNCluster up in {self.start_s:.1f} s, conf {self.conf_dir}, "
              f"spark_shuffle = {self.aux_class} on port {self.service_port}")
        self.sampler = MemorySampler()
        self.sampler.start()

    def stop(self):
        self.sampler.stop()
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()

    def container_dir(self, app_id: str, n: int) -> Path | None:
        """Log directory of container number `n` (1: the application master) of `app_id`."""
        for d in (self.logs / app_id).glob("container_*"):
            m = CONTAINER_RE.fullmatch(d.name)
            if m and int(m.group(3)) == n:
                return d
        return None


@dataclass
class App:
    """One application on the cluster, finished."""
    name: str
    shuffle: str
    deploy: str
    rc: int
    wall_s: float
    app_id: str | None
    stdout: str          # the driver's standard output
    driver_log: str      # the driver's log (spark-submit's stderr in client mode)
    executor_logs: dict = field(default_factory=dict)   # container id -> stderr
    peaks: dict = field(default_factory=dict)           # role -> peak RSS bytes
    events: list = field(default_factory=list)          # the event log, parsed
    extra: dict = field(default_factory=dict)

    def lines(self, prefix: str) -> list:
        return [dict(kv.split("=", 1) for kv in ln.split()[1:] if "=" in kv)
                for ln in self.stdout.splitlines() if ln.startswith(prefix + " ")]

    def engines(self) -> dict:
        return engine_totals(self.driver_log)

    def total(self, key: str) -> int:
        return sum(kv.get(key, 0) for kv in self.engines().values() if isinstance(kv.get(key, 0), int))


def line_env(profile: str) -> dict:
    """The environment scripts/spark-env.sh exports for a Spark line (`""`: 4.x, `"spark-3.5"`),
    its venv created on first use."""
    out = subprocess.run(["bash", "-c", f". '{REPO}/scripts/spark-env.sh' >&2 && env -0"], check=True,
                         capture_output=True, env={**os.environ, "RDMA_SPARK_PROFILE": profile}).stdout
    return dict(kv.split("=", 1) for kv in out.decode().split("\0") if "=" in kv)


def yarn_plugin_args(env: dict, deploy: str) -> list:
    """spark-submit arguments installing the plugin on YARN as docs/yarn.md tells a user.
    Spark 4.x: `--jars` (rdma_plugin_submit_args of scripts/spark-env.sh). Spark 3.5 creates the
    shuffle manager before it adds `--jars` to an executor's class loader, so the jar must be on
    the JVMs' own class path; on YARN `--jars` ships it into every container's working directory,
    where the relative `extraClassPath` finds it (a client-mode driver takes the local path)."""
    jar = env["RDMA_PLUGIN_JAR"]
    if env["SPARK_LINE"] != "3.5":
        return plugin_submit_args(env, jar)
    name = os.path.basename(jar)
    return ["--conf", "spark.shuffle.manager=org.apache.spark.shuffle.rdma.RdmaShuffleManager",
            "--jars", jar, "--conf", f"spark.executor.extraClassPath={name}",
            "--conf", f"spark.driver.extraClassPath={jar if deploy == 'client' else name}"]


class Submitter:
    def __init__(self, yarn: Yarn):
        self.yarn = yarn
        self.line = yarn.env["SPARK_LINE"]   # the Spark line tests/yarn/run.sh was started for
        self.envs = {self.line: yarn.env}
        self.apps: list = []

    def env_of(self, line: str) -> dict:
        """The environment of Spark line `line` ("4.x" or "3.5") with the cluster's HADOOP_CONF_DIR."""
        if line not in self.envs:
            self.envs[line] = {**line_env("spark-3.5" if line == "3.5" else ""), "HADOOP_CONF_DIR": self.yarn.conf_dir}
            assert self.envs[line]["SPARK_LINE"] == line, self.envs[line]["SPARK_LINE"]
        return self.envs[line]

    def submit(self, name: str, shuffle: str, deploy: str, main: str, args: list, conf: dict,
               executors: int | None = 2, while_running=None, line: str | None = None) -> App:
        """spark-submit of `main` (a class of the jobs jar) with `args`, from Spark line `line`
        (default: the suite's); `while_running(app_id, stdout_reader)` runs beside it (fault
        injection)."""
        line = line or self.line
        env = self.env_of(line)
        for j in ("RDMA_PLUGIN_JAR", "RDMA_JOBS_JAR"):
            assert Path(env[j]).is_file(), f"{env[j]} is missing: build the Spark {line} jars first"
        tag = f"{name}-{deploy}-{shuffle}"
        events = WORK / "events" / tag
        shutil.rmtree(events, ignore_errors=True)
        events.mkdir(parents=True)
        spark_home = env["SPARK_HOME"]
        settings = {**COMMON_CONF, "spark.eventLog.dir": f"file://{events}",
                    "spark.shuffle.service.port": str(self.yarn.service_port), **conf}
        # The JVM options CI gives every Spark JVM (scripts/test.sh: the client compiler only)
        # reach the containers too: YARN's NodeManager does not pass the client's environment.
        if os.environ.get("JAVA_TOOL_OPTIONS"):
            for k in ("spark.executorEnv.JAVA_TOOL_OPTIONS", "spark.yarn.appMasterEnv.JAVA_TOOL_OPTIONS"):
                settings.setdefault(k, os.environ["JAVA_TOOL_OPTIONS"])
        cmd = [f"{spark_home}/bin/spark-submit", "--master", "yarn", "--deploy-mode", deploy,
               "--name", f"rdma-yarn-{tag}"]
        if executors is not None:
            cmd += ["--num-executors", str(executors)]
        for k, v in settings.items():
            cmd += ["--conf", f"{k}={v.format(SPARK_HOME=spark_home)}"]
        if shuffle == "plugin":
            cmd += yarn_plugin_args(env, deploy)
        if deploy == "cluster":
            # The driver runs in the application master's container: its output is there.
            cmd += ["--conf", "spark.yarn.submit.waitAppCompletion=true"]
        cmd += ["--class", main, env["RDMA_JOBS_JAR"], *args]
        out_f, err_f = WORK / f"{tag}.out", WORK / f"{tag}.err"
        t0 = time.monotonic()
        with open(out_f, "w") as out, open(err_f, "w") as err:
            p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True)
            app_id, inject_error = None, None
            try:
                while app_id is None and p.poll() is None:
                    m = re.search(r"Submitted application (application_\d+_\d+)", err_f.read_text(errors="replace"))
                    app_id = m.group(1) if m else None
                    time.sleep(0.2)
                if while_running and app_id:
                    try:
                        while_running(app_id, lambda: self._driver_stdout(deploy, app_id, out_f))
                    except Exception as e:  # noqa: BLE001 -- the tests report it; the application goes on
                        inject_error = f"{type(e).__name__}: {e}"
                p.wait(timeout=APP_TIMEOUT_S)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        wall = time.monotonic() - t0
        if app_id is None:
            m = re.search(r"(application_\d+_\d+)", err_f.read_text(errors="replace"))
            app_id = m.group(1) if m else None
        app = App(name, shuffle, deploy, p.returncode, wall, app_id,
                  self._driver_stdout(deploy, app_id, out_f), "", extra={"cmd": cmd, "inject_error": inject_error})
        if app_id:
            self._collect(app, deploy, err_f, events)
        print(f"[yarn] {name:8s} {deploy:7s} {shuffle:7s} rc={app.rc} wall={wall:5.1f}s {app_id} "
              f"peaks(MiB)={ {k: v >> 20 for k, v in sorted(app.peaks.items())} }")
        self.apps.append(app)
        return app

    def _driver_stdout(self, deploy: str, app_id: str | None, out_f: Path) -> str:
        if deploy == "client" or not app_id:
            return out_f.read_text(errors="replace")
        d = self.yarn.container_dir(app_id, 1)
        return (d / "stdout").read_text(errors="replace") if d and (d / "stdout").exists() else ""

    def _collect(self, app: App, deploy: str, err_f: Path, events: Path):
        import json
        # Container logs are complete once the NodeManager has seen every container exit.
        deadline = time.time() + 60
        while time.time() < deadline and self.yarn.sampler.running(app.app_id):
            time.sleep(0.5)
        app_dir = self.yarn.logs / app.app_id
        for d in sorted(app_dir.glob("container_*")):
            err = d / "stderr"
            if not err.exists():
                continue
            text = err.read_text(errors="replace")
            if CONTAINER_RE.fullmatch(d.name) and int(CONTAINER_RE.fullmatch(d.name).group(3)) == 1:
                if deploy == "cluster":
                    app.driver_log = text
            else:
                app.executor_logs[d.name] = text
        if deploy == "client":
            app.driver_log = err_f.read_text(errors="replace")
        app.peaks = self.yarn.sampler.of_app(app.app_id)
        files = [f for f in events.iterdir() if f.is_file()]
        if files:
            app.events = [json.loads(ln) for ln in files[0].read_text().splitlines() if ln.strip()]


@pytest.fixture(scope="session")
def yarn():
    y = Yarn()
    try:
        yield y
    finally:
        y.stop()


@pytest.fixture(scope="session")
def submitter(yarn):
    s = Submitter(yarn)
    yield s
    write_memory_table(s.apps)


def write_memory_table(apps: list) -> None:
    """Each container's peak RSS under both shuffles, side by side (target/yarn/memory.md and
    .json; docs/benchmarks.md keeps the table of a run)."""
    import json
    rows = []
    by = {(a.name, a.deploy, a.shuffle): a for a in apps}
    for name, deploy in dict.fromkeys((a.name, a.deploy) for a in apps):
        d, p = by.get((name, deploy, "default")), by.get((name, deploy, "plugin"))
        if not (d and p):
            continue
        for role in sorted(set(d.peaks) | set(p.peaks), key=lambda r: (r != "am", r)):
            dv, pv = d.peaks.get(role), p.peaks.get(role)
            rows.append({"app": name, "deploy": d.deploy, "container": role,
                         "default_mib": dv >> 20 if dv else None, "plugin_mib": pv >> 20 if pv else None})
    if not rows:
        return
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "memory.json").write_text(json.dumps(rows, indent=1))
    lines = ["| application | deploy mode | container | default shuffle, peak RSS MiB | plugin, peak RSS MiB |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['app']} | {r['deploy']} | {r['container']} | {r['default_mib'] or '–'} | {r['plugin_mib'] or '–'} |"
              for r in rows]
    (WORK / "memory.md").write_text("\n".join(lines) + "\n")
    print("\n[yarn] peak RSS per container (MiB):\n" + "\n".join(lines))
