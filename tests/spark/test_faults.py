"""Fault tests: the plugin (with its native engine) under an executor loss, and the plugin whose
native library cannot load.

1. One application of FaultJob (jvm-plugin/jobs) on local-cluster[2,1,1024] with the plugin runs
   three scenarios, each a self-checking job (8 map tasks -> partitionBy -> 4 reduce tasks; the
   driver computes the expected digest without a shuffle):
   - clean: no fault (remote blocks go through the engine; the baseline of the counters);
   - before_reduce: when the driver reports the map stage done, the test kills (SIGKILL, by PID)
     an executor holding map outputs while every reduce task waits at a gate *before* asking for
     its input, and opens the gate once the driver has dropped that executor's outputs: the
     reducers fail with a metadata fetch failure, Spark recomputes the lost map outputs;
   - during_reduce: the reduce tasks read their first record (the reader holds the map output
     locations and fetches one 750 KiB block at a time, spark.reducer.maxSizeInFlight=1m) and
     wait at a gate; the test kills an executor holding >= 2 map outputs and opens the gate: the
     survivor's next native fetch goes to a dead engine and fails as a real FetchFailedException
     raised through the plugin's NativeBlockStoreClient; Spark reruns the lost map tasks.
   Between the two fault scenarios the job waits for the worker's replacement executor, whose
   engine registers with the driver like the others.
2. The same job with a copy of the plugin jar whose two bundled native libraries do not load
   (one built for another architecture, one a Git LFS pointer; nothing on java.library.path):
   every JVM logs exactly one warning naming the reasons, every shuffle goes to Spark's sort
   shuffle, and the result is still right. No test-only switch in the loader is needed.

Run: `tests/spark/run.sh -k faults`. The tests act on the lines the driver prints, never on timers;
they assert on what happened (logs, event log), never on how long it took.
"""
import glob
import json
import os
import re
import signal
import subprocess
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import CLUSTER_CONF, RUN_TIMEOUT_S, engine_totals, plugin_submit_args

FAULT_JOB = "org.apache.spark.shuffle.rdma.jobs.FaultJob"
SCENARIOS = ["clean", "before_reduce", "during_reduce"]
# How long one step may wait for the application (executor start-up on 2 busy cores included).
STEP_TIMEOUT_S = 240

FAULT_CONF = {
    **CLUSTER_CONF,
    # One remote block per request and one request in flight: a reducer that read its first
    # record still has blocks of the other executor to fetch (FaultJob's blocks are ~750 KiB).
    "spark.reducer.maxSizeInFlight": "1m",
    # Short timeouts so a lost peer surfaces quickly; nothing below asserts on timings.
    "spark.network.timeout": "20s",
    "spark.network.timeoutInterval": "5s",
    "spark.shuffle.rdma.fetchTimeout": "15s",
    "spark.shuffle.rdma.connectTimeout": "5s",
    "spark.shuffle.io.maxRetries": "1",
    "spark.shuffle.io.retryWait": "1s",
    # A plain JSON-lines event log (Spark 4 otherwise writes rolling zstd files).
    "spark.eventLog.enabled": "true",
    "spark.eventLog.compress": "false",
    "spark.eventLog.rolling.enabled": "false",
}


class App:
    """A spark-submit of FaultJob whose output lines the test waits on while it runs."""

    def __init__(self, env: dict, cmd: list):
        self.env = env
        self.cmd = cmd
        self.out: list = []
        self.err: list = []
        self._cond = threading.Condition()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, errors="replace")
        self._readers = [threading.Thread(target=self._pump, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    def _pump(self, stream, buf):
        for line in stream:
            with self._cond:
                buf.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, stream: str = "out", timeout: float = STEP_TIMEOUT_S) -> re.Match:
        """The first line of stdout/stderr matching `pattern`; fails on timeout or exit."""
        rx = re.compile(pattern)
        buf = self.out if stream == "out" else self.err
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in buf[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(buf)
                if self.proc.poll() is not None and not any(t.is_alive() for t in self._readers):
                    raise AssertionError(f"application exited (rc={self.proc.returncode}) before "
                                         f"/{pattern}/; stdout:\n" + "\n".join(self.out[-20:]) +
                                         "\nstderr tail:\n" + "\n".join(self.err[-60:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no /{pattern}/ in {stream} within {timeout} s; stdout:\n"
                                         + "\n".join(self.out[-20:]) + "\nstderr tail:\n"
                                         + "\n".join(self.err[-60:]))
                self._cond.wait(min(left, 1.0))

    def finish(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                # Our own child only: the driver JVM, whose shutdown stops its executors.
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            for t in self._readers:
                t.join(timeout=10)
        return self.proc.returncode


@dataclass
class Outcome:
    """What one fault application did: its output, logs, event log and the executors killed."""
    rc: int
    wall_s: float
    stdout: str
    stderr: str
    app_id: str
    executor_logs: dict
    events: list
    killed: dict = field(default_factory=dict)  # scenario -> executor id

    def lines(self, prefix: str) -> list:
        out = []
        for ln in self.stdout.splitlines():
            if ln.startswith(prefix + " "):
                out.append(dict(kv.split("=", 1) for kv in ln.split()[1:] if "=" in kv))
        return out

    def result(self, scenario: str) -> dict:
        rs = [r for r in self.lines("FAULT_RESULT") if r["scenario"] == scenario]
        assert len(rs) == 1, f"FAULT_RESULT lines for {scenario}: {rs}; stderr tail:\n{self.stderr[-3000:]}"
        return rs[0]

    def stage_groups(self) -> dict:
        """stage id -> job group (the scenario), from the event log."""
        return {e["Stage Info"]["Stage ID"]: (e.get("Properties") or {}).get("spark.jobGroup.id")
                for e in self.events if e["Event"] == "SparkListenerStageSubmitted"}

    def task_ends(self, scenario: str) -> list:
        groups = self.stage_groups()
        return [e for e in self.events
                if e["Event"] == "SparkListenerTaskEnd" and groups.get(e["Stage ID"]) == scenario]

    def map_stage_attempts(self, scenario: str) -> set:
        """Attempt numbers of the scenario's map stage (stages that ran ShuffleMapTasks)."""
        return {(e["Stage ID"], e["Stage Attempt ID"]) for e in self.task_ends(scenario)
                if e["Task Type"] == "ShuffleMapTask"}


def _submit_cmd(env: dict, jobs_jar: str, plugin_jar: str, gate_dir: Path, event_dir: Path,
                scenarios: list, extra_conf: dict | None = None) -> list:
    cmd = [f"{env['SPARK_HOME']}/bin/spark-submit", "--master", "local-cluster[2,1,1024]",
           "--driver-memory", "1g"]
    conf = {**FAULT_CONF, "spark.eventLog.dir": str(event_dir), **(extra_conf or {})}
    for k, v in conf.items():
        cmd += ["--conf", f"{k}={v}"]
    cmd += plugin_submit_args(env, plugin_jar)
    cmd += ["--class", FAULT_JOB, jobs_jar, str(gate_dir), ",".join(scenarios)]
    return cmd


def executor_pid(app_id: str, executor_id: str) -> int:
    """The PID of exactly one executor JVM, found by its command line (app id + executor id).
    Reads /proc/*/cmdline: `ps` truncates the executors' long class-path command lines."""
    found = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            argv = Path(cmdline).read_bytes().decode(errors="replace").split("\0")
        except OSError:  # the process exited meanwhile
            continue
        if "org.apache.spark.executor.CoarseGrainedExecutorBackend" not in argv:
            continue
        opts = dict(zip(argv, argv[1:]))
        if opts.get("--app-id") == app_id and opts.get("--executor-id") == executor_id:
            found.append(int(Path(cmdline).parent.name))
    assert len(found) == 1, f"executor {executor_id} of {app_id}: PIDs {found}"
    return found[0]


def kill_executor(app_id: str, executor_id: str) -> int:
    pid = executor_pid(app_id, executor_id)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except FileNotFoundError:
            return pid
        if state == "Z":  # dead, not yet reaped by its worker
            return pid
        time.sleep(0.05)
    raise AssertionError(f"executor {executor_id} (pid {pid}) still alive 30 s after SIGKILL")


def _outputs(line: dict) -> dict:
    """`outputs=0:5,1:3` -> {"0": 5, "1": 3}."""
    return {e: int(n) for e, n in (x.split(":") for x in line["outputs"].split(",") if x)}


def _collect(app: App, rc: int, spark_home: str, event_dir: Path, killed: dict) -> Outcome:
    stdout, stderr = "\n".join(app.out), "\n".join(app.err)
    m = re.search(r"^FAULT_APP id=(\S+)", stdout, re.M)
    app_id = m.group(1) if m else ""
    logs = {f: Path(f).read_text(errors="replace")
            for f in glob.glob(f"{spark_home}/work/{app_id}/*/stderr")} if app_id else {}
    events = []
    ev_file = event_dir / app_id
    if app_id and ev_file.exists():
        events = [json.loads(ln) for ln in ev_file.read_text().splitlines() if ln.strip()]
    return Outcome(rc, time.monotonic() - app.t0, stdout, stderr, app_id, logs, events, killed)


@pytest.fixture(scope="module")
def faults(runner, tmp_path_factory) -> Outcome:
    """Runs the three scenarios in one application, injecting the faults as the job reaches its
    gates; shared by the assertions below."""
    gate = tmp_path_factory.mktemp("gates")
    event_dir = tmp_path_factory.mktemp("events")
    app = App(runner.env, _submit_cmd(runner.env, runner.jobs_jar, runner.plugin_jar, gate,
                                      event_dir, SCENARIOS))
    killed = {}
    try:
        app_id = app.wait_for(r"^FAULT_APP id=(\S+)").group(1)

        # before_reduce: kill an executor holding map outputs; open the gate once the driver
        # has unregistered that executor's outputs, so the reducers find them missing.
        m = app.wait_for(r"^FAULT_MAP_DONE scenario=before_reduce .*attempt=0 outputs=(\S+)")
        outputs = _outputs({"outputs": m.group(1)})
        victim = max(outputs, key=outputs.get)
        kill_executor(app_id, victim)
        killed["before_reduce"] = victim
        print(f"\n[faults] before_reduce: killed executor {victim} (map outputs {outputs}) "
              f"at {time.monotonic() - app.t0:.1f}s")
        app.wait_for(rf"Shuffle files lost for executor: {victim}\b", stream="err")
        (gate / "go-before_reduce").touch()

        # during_reduce: wait until both running reducers hold their map output locations and
        # have read a record, then kill an executor whose outputs the other one still needs.
        m = app.wait_for(r"^FAULT_MAP_DONE scenario=during_reduce .*attempt=0 outputs=(\S+)")
        outputs = _outputs({"outputs": m.group(1)})
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while True:
            readers = {re.match(r"reading-during_reduce-exec(\w+)-", p.name).group(1)
                       for p in gate.glob("reading-during_reduce-*-attempt0")}
            if len(readers) >= 2:
                break
            assert time.monotonic() < deadline, f"reducers reading: {readers}; stdout:\n" + "\n".join(app.out)
            assert app.proc.poll() is None, "application exited:\n" + "\n".join(app.err[-60:])
            time.sleep(0.1)
        candidates = [e for e in outputs if outputs[e] >= 2 and readers - {e}]
        assert candidates, f"no executor with >= 2 map outputs and a reader elsewhere: {outputs}, {readers}"
        victim = max(candidates, key=outputs.get)
        kill_executor(app_id, victim)
        killed["during_reduce"] = victim
        print(f"[faults] during_reduce: killed executor {victim} (map outputs {outputs}, reducers "
              f"on {sorted(readers)}) at {time.monotonic() - app.t0:.1f}s")
        (gate / "go-during_reduce").touch()
        rc = app.finish(timeout=RUN_TIMEOUT_S)
    finally:
        # Never leave gated tasks waiting if a step above failed.
        for s in SCENARIOS:
            (gate / f"go-{s}").touch()
        rc = app.finish(timeout=60)
    out = _collect(app, rc, runner.env["SPARK_HOME"], event_dir, killed)
    print(f"[faults] rc={rc} wall={out.wall_s:.1f}s app={out.app_id}")
    for ln in out.stdout.splitlines():
        if ln.startswith("FAULT_"):
            print(f"[faults] {ln}")
    return out




def _fetch_failures(out: Outcome, scenario: str) -> list:
    return [e["Task End Reason"] for e in out.task_ends(scenario)
            if e["Task End Reason"]["Reason"] == "FetchFailed"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_result_is_correct(faults, scenario):
    r = faults.result(scenario)
    assert r["ok"] == "true", r
    assert r["records"] == r["expected_records"] == "6000", r
    assert r["sum"] == r["expected_sum"] and r["misplaced"] == "0", r


def test_application_succeeded(faults):
    assert faults.rc == 0, f"rc={faults.rc}; stderr tail:\n{faults.stderr[-4000:]}"
    assert set(faults.killed) == {"before_reduce", "during_reduce"}, faults.killed


def test_clean_scenario_had_no_failure(faults):
    assert _fetch_failures(faults, "clean") == []
    assert len(faults.map_stage_attempts("clean")) == 1


def test_executor_lost_before_reduce_reran_the_map_stage(faults):
    victim = faults.killed["before_reduce"]
    failures = _fetch_failures(faults, "before_reduce")
    assert failures, "no FetchFailed task end in before_reduce"
    # The driver had dropped the victim's outputs before the reducers asked: metadata failure.
    assert any("Missing an output location" in f.get("Message", "") for f in failures), failures
    attempts = faults.map_stage_attempts("before_reduce")
    assert any(a >= 1 for _, a in attempts), f"map stage attempts: {sorted(attempts)}"
    # The rerun replaced exactly what the victim held, on live executors.
    reruns = [d for d in faults.lines("FAULT_MAP_DONE")
              if d["scenario"] == "before_reduce" and d["attempt"] != "0"]
    assert reruns and all(victim not in _outputs(d) for d in reruns), reruns


def test_executor_lost_during_reduce_is_a_native_fetch_failure(faults):
    victim = faults.killed["during_reduce"]
    failures = _fetch_failures(faults, "during_reduce")
    from_victim = [f for f in failures
                   if (f.get("Block Manager Address") or {}).get("Executor ID") == victim]
    assert from_victim, f"no FetchFailed naming executor {victim}: {failures}"
    # Raised by the plugin's client for a native fetch (the message names the engine).
    assert any(f"executor {victim} engine" in f.get("Message", "") for f in from_victim), from_victim
    attempts = faults.map_stage_attempts("during_reduce")
    assert any(a >= 1 for _, a in attempts), f"map stage attempts: {sorted(attempts)}"


def test_native_engine_moved_the_blocks(faults):
    ran_tasks = {e["Task Info"]["Executor ID"] for e in faults.events if e["Event"] == "SparkListenerTaskEnd"}
    ran_reduce = {e["Task Info"]["Executor ID"] for e in faults.events
                  if e["Event"] == "SparkListenerTaskEnd" and e["Task Type"] == "ResultTask"
                  and e["Task End Reason"]["Reason"] == "Success"}
    # Two original executors and the replacement of the first victim ran tasks.
    assert len(ran_tasks) >= 3, ran_tasks
    # Every executor that ran a task (the killed ones and the replacement too) had its engine.
    for eid in ran_tasks:
        logs = [t for p, t in faults.executor_logs.items() if Path(p).parent.name == eid]
        assert len(logs) == 1, (eid, sorted(faults.executor_logs))
        assert "native=loaded" in logs[0], eid
        assert f"RDMA shuffle engine of executor {eid} listening on" in logs[0], eid
    registered = set(re.findall(r"RDMA shuffle engine of executor (\d+) registered", faults.stderr))
    assert registered >= ran_tasks, (registered, ran_tasks)
    latest = engine_totals(faults.stderr)
    assert set(latest) >= ran_reduce, f"stats lines in the driver log: {sorted(latest)}, reducers {ran_reduce}"
    total = lambda k: sum(kv[k] for kv in latest.values())
    assert total("native_requests") > 0 and total("bytes_fetched") > 0, latest
    # Nothing was handed to Spark's own client: dead peers were tried natively and failed there.
    assert total("delegated_requests") == 0, latest
    remote = sum(e["Task Metrics"]["Shuffle Read Metrics"]["Remote Bytes Read"]
                 for e in faults.events
                 if e["Event"] == "SparkListenerTaskEnd" and e["Task End Reason"]["Reason"] == "Success"
                 and e["Task Type"] == "ResultTask" and e.get("Task Metrics"))
    assert remote > 0
    assert total("bytes_fetched") >= remote, (total("bytes_fetched"), remote)


# -------------------------------------------------------------------------------------------------
# 2. Native library that cannot load.

# ELF header field e_machine (offset 18, little-endian) and two machine numbers.
_E_MACHINE, _EM_X86_64, _EM_AARCH64 = 18, 62, 183


def _jar_with_unloadable_native(plugin_jar: str, dest: Path) -> dict:
    """Copies the plugin jar with both bundled libraries made unloadable the way real builds go
    wrong, where dlopen refuses them cleanly:
      - librdma_shuffle_jni.so: the real file marked as built for another architecture (its
        ELF e_machine set to aarch64 on x86_64, to x86_64 elsewhere);
      - librdma_shuffle_jni_tcp.so: a Git LFS pointer (a checkout without `git lfs pull`).
    (A truncated ELF is not used: ld.so maps the missing segments and the JVM dies of SIGBUS
    inside dlopen, which no Java-side loader can catch.) Returns entry name -> what was done."""
    done = {}
    with zipfile.ZipFile(plugin_jar) as src, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith("/librdma_shuffle_jni.so"):
                assert data[:4] == b"\x7fELF", item.filename
                machine = int.from_bytes(data[_E_MACHINE:_E_MACHINE + 2], "little")
                other = _EM_AARCH64 if machine == _EM_X86_64 else _EM_X86_64
                data = data[:_E_MACHINE] + other.to_bytes(2, "little") + data[_E_MACHINE + 2:]
                done[item.filename] = "foreign architecture"
            elif item.filename.endswith("/librdma_shuffle_jni_tcp.so"):
                data = (b"version https://git-lfs.github.com/spec/v1\n"
                        b"oid sha256:" + b"0" * 64 + b"\nsize %d\n" % len(data))
                done[item.filename] = "git lfs pointer"
            dst.writestr(item, data)
    return done


def test_unloadable_native_library_falls_back_to_sort_shuffle(runner, tmp_path):
    bad_jar = tmp_path / "rdma-shuffle-unloadable-native.jar"
    replaced = _jar_with_unloadable_native(runner.plugin_jar, bad_jar)
    assert sorted(set(replaced.values())) == ["foreign architecture", "git lfs pointer"], replaced
    gate, event_dir = tmp_path / "gates", tmp_path / "events"
    gate.mkdir()
    event_dir.mkdir()
    app = App(runner.env, _submit_cmd(runner.env, runner.jobs_jar, str(bad_jar), gate, event_dir,
                                      ["clean"]))
    rc = app.finish(timeout=RUN_TIMEOUT_S)
    out = _collect(app, rc, runner.env["SPARK_HOME"], event_dir, {})
    print(f"\n[faults] unloadable native: rc={rc} wall={out.wall_s:.1f}s app={out.app_id}")
    assert rc == 0, f"stderr tail:\n{out.stderr[-4000:]}"
    r = out.result("clean")
    assert r["ok"] == "true" and r["records"] == "6000", r

    # Exactly one warning per JVM, naming why both bundled builds failed to load.
    warning = re.compile(r"WARN .*RDMA shuffle: native library librdma_shuffle_jni\.so could not be "
                         r"loaded \((.*)\)\. Every shuffle")
    jvm_logs = {"driver": out.stderr, **out.executor_logs}
    assert len(out.executor_logs) == 2, sorted(out.executor_logs)
    for name, text in jvm_logs.items():
        reasons = warning.findall(text)
        assert len(reasons) == 1, f"{name}: {len(reasons)} warnings"
        why = reasons[0]
        print(f"[faults] {name.split('/work/')[-1]} warning reason: {why}")
        assert "not on java.library.path" in why, why
        for variant in ("librdma_shuffle_jni.so", "librdma_shuffle_jni_tcp.so"):
            assert re.search(rf"loading the bundled \S+/{variant} failed: java\.lang\.UnsatisfiedLinkError", why), \
                (variant, why)
        assert "native=unavailable" in text, name
        # No engine anywhere, no counters.
        assert "RDMA shuffle engine of executor" not in text, name
        assert "RDMA_SHUFFLE_ENGINE_STATS" not in text, name

    # Every shuffle the application registered was handed to Spark's sort shuffle.
    shuffles = {int(x["shuffle"]) for x in out.lines("FAULT_RESULT")}
    handed = {int(s) for s in re.findall(
        r"Shuffle (\d+) handed to Spark's sort shuffle: native library unavailable", out.stderr)}
    assert shuffles and handed == shuffles, (handed, shuffles)
    # ... and Spark's own transfer service moved the blocks between the executors.
    remote = sum(e["Task Metrics"]["Shuffle Read Metrics"]["Remote Bytes Read"]
                 for e in out.events if e["Event"] == "SparkListenerTaskEnd" and e.get("Task Metrics"))
    assert remote > 0
