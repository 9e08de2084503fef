"""The engine's counters in Spark's metrics system, and the warning for a misspelt setting.

One application of MetricsJob (jvm-plugin/jobs) on local-cluster[2,1,1024] with the plugin, and
Spark's CSV sink turned on for the executors (period 1 s). The job runs a shuffle of small
blocks and one of ~1 MiB blocks, prints METRICS_JOB_DONE and waits. The test then waits until
every executor's sink has written a row taken after the job finished, lets the application
stop, and compares the sink's last `rdmaShuffle.*` values with the engine's own totals: the
`RDMA_SHUFFLE_ENGINE_STATS executor=<id> key=value...` lines the driver logs at stop (each
reduce task reports its engine's counters to the driver; see RdmaShuffleManager).

Fetch-side counters are final when an executor's last reduce task ends, so those are compared
per executor; served bytes can still grow after that (other executors' tasks fetch from it),
so they are compared as totals: bytes served by all engines == bytes fetched by all engines.

The application also sets `spark.shuffle.rdma.eagerTreshold` (sic): the driver must warn once,
naming `spark.shuffle.rdma.eagerThreshold`, and no executor may repeat it.

The same job also runs with Spark's default shuffle first: the plugin's output (each job's
digest) must equal it. And while the plugin's application waits, with `bindHost` unset, every
engine's listening socket (from /proc/net/tcp{,6}) is on the address its log names, never on
all interfaces (README Security).

Native memory in Spark's accounts: while the application waits, its REST API (the driver's live
UI) shows the accumulator `rdmaShuffle native memory peak (bytes)` on every stage that read a
plugin shuffle and on each of its tasks; per executor, the highest task value equals the
`native_peak_bytes` the engine reported with its last counters, which stays within the bound
each executor logs (`RDMA_SHUFFLE_MEMORY ... bound=`): half of the executor's memory overhead
as Spark computes it for `spark.executor.memory=1024m` (384 MiB). The stage page of the UI shows
the accumulator too. A second test starts an application whose explicit `pool.capBytes` cannot
fit in that bound: it must fail at start, naming both settings and the numbers.

Run: `tests/spark/run.sh -k metrics`.
"""
import csv
import glob
import ipaddress
import json
import os
import re
import urllib.request
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from conftest import CLUSTER_CONF, RUN_TIMEOUT_S

METRICS_JOB = "org.apache.spark.shuffle.rdma.jobs.MetricsJob"
STATS_RE = re.compile(r"RDMA_SHUFFLE_ENGINE_STATS (.*)$", re.M)
LISTEN_RE = re.compile(r"RDMA shuffle engine of executor (\S+) listening on (\S+):(\d+) \(transport (\w+)\)")
DIGEST_RE = re.compile(r"^DIGEST job=(\S+) (.*)$")
# How long one step may wait for the application (executor start-up on 2 busy cores included).
STEP_TIMEOUT_S = 300
# The application's UI (local-cluster also starts the master's and workers' UIs), on the
# address SPARK_LOCAL_IP gives it (127.0.0.1, scripts/spark-env.sh).
UI_RE = re.compile(r"Successfully started service 'SparkUI' on port (\d+)")
MEMORY_RE = re.compile(r"RDMA_SHUFFLE_MEMORY executor=(\S+) bound=(\d+) pool_cap=(\d+) fixed=(\d+) "
                       r"transport=(\w+): (.*)$", re.M)
ACC_NAME = "rdmaShuffle native memory peak (bytes)"
# Spark's memory overhead of an executor with spark.executor.memory=1024m (local-cluster's
# third number): max(384 MiB, 0.10 x 1024 MiB), in bytes; the engine's bound is half of it.
EXPECTED_BOUND = max(384, int(0.10 * 1024)) * 2**20 * 50 // 100


def submit_cmd(runner, main_class: str, app_args: list, conf: dict, plugin: bool = True) -> list:
    """A spark-submit of `main_class` from the jobs jar on local-cluster[2,1,1024]."""
    cmd = [f"{runner.env['SPARK_HOME']}/bin/spark-submit", "--master", "local-cluster[2,1,1024]",
           "--driver-memory", "1g"]
    for k, v in {**CLUSTER_CONF, **conf}.items():
        cmd += ["--conf", f"{k}={v}"]
    if plugin:
        # Installed as the active Spark line needs it (conftest / scripts/spark-env.sh).
        cmd += runner.plugin_args
    return cmd + ["--class", main_class, runner.jobs_jar] + app_args


def app_id_of(stderr: str) -> str:
    m = re.search(r"app ID (app-\d+-\d+)", stderr)
    assert m, "no application id in the driver log:\n" + stderr[-3000:]
    return m.group(1)


def executor_logs(runner, app_id: str) -> dict:
    return {f: Path(f).read_text(errors="replace")
            for f in glob.glob(f"{runner.env['SPARK_HOME']}/work/{app_id}/*/stderr")}


def engine_stats(driver_log: str) -> dict:
    """executor id -> {key: value} from the driver's last stats line per executor."""
    latest = {}
    for m in STATS_RE.finditer(driver_log):
        kv = dict(x.split("=", 1) for x in m.group(1).split() if "=" in x)
        latest[kv["executor"]] = kv
    return latest


class App:
    """A running spark-submit whose stdout lines can be waited on."""

    def __init__(self, cmd: list, env: dict):
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, errors="replace")
        self.out, self.err = [], []
        self._cond = threading.Condition()
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

    def wait_for_line(self, text: str, timeout: float):
        deadline = time.monotonic() + timeout
        with self._cond:
            while text not in self.out:
                if self.proc.poll() is not None and not any(t.is_alive() for t in self._readers):
                    raise AssertionError(f"application exited (rc={self.proc.returncode}) before "
                                         f"'{text}'; stderr tail:\n" + "\n".join(self.err[-60:]))
                left = deadline - time.monotonic()
                assert left > 0, f"no '{text}' within {timeout} s; stderr tail:\n" + \
                    "\n".join(self.err[-60:])
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


def digests(lines: list) -> dict:
    """job -> the rest of its DIGEST line (records, sum)."""
    return {m.group(1): m.group(2) for m in map(DIGEST_RE.match, lines) if m}


def listening_addresses(port: int) -> list:
    """The local addresses of this network namespace's TCP sockets listening on `port`."""
    found = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            addr, p = f[1].split(":")
            if f[3] != "0A" or int(p, 16) != port:  # 0A: TCP_LISTEN
                continue
            raw = bytes.fromhex(addr)
            # The kernel prints the address as 32-bit words in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(ipaddress.ip_address(raw))
    return found


def check_engines_listen_on_their_own_address(runner, app_id: str) -> None:
    """README Security: with `bindHost` unset, the block server listens on the executor's own
    address, never on all interfaces. Read from the kernel's socket table while the engines
    are up, not from what the engines say."""
    seen = {}
    for text in executor_logs(runner, app_id).values():
        for m in LISTEN_RE.finditer(text):
            seen[m.group(1)] = (m.group(2), int(m.group(3)))
    assert set(seen) == {"0", "1"}, f"engines that logged their address: {seen}"
    for executor, (host, port) in seen.items():
        addrs = listening_addresses(port)
        assert addrs, f"executor {executor}: nothing listens on port {port} ({host})"
        wild = [a for a in addrs if a.is_unspecified]
        assert not wild, f"executor {executor}: the engine listens on all interfaces ({wild}, port {port})"
        try:
            want = ipaddress.ip_address(host)
        except ValueError:
            continue  # a host name: not all interfaces is what the README promises
        assert all(a == want or a == ipaddress.ip_address(f"::ffff:{want}") for a in addrs), \
            f"executor {executor}: listens on {addrs}, its log says {host}"
    print(f"[metrics] engines listen on {seen}")


def sink_rows(csv_dir: str, app_id: str) -> dict:
    """executor id -> {metric: [(t, value), ...]} from the CSV sink's rdmaShuffle files."""
    out = {}
    for f in glob.glob(os.path.join(csv_dir, f"{app_id}.*.rdmaShuffle.*.csv")):
        name = os.path.basename(f)[len(app_id) + 1:-len(".csv")]
        executor, _, metric = name.split(".", 2)
        with open(f, newline="") as fh:
            rows = [(int(r["t"]), int(float(r["value"]))) for r in csv.DictReader(fh) if r.get("value")]
        out.setdefault(executor, {})[metric] = rows
    return out


def rest(url: str):
    with urllib.request.urlopen(url, timeout=60) as r:
        body = r.read().decode()
    return json.loads(body) if r.headers.get_content_type() == "application/json" else body


def read_native_memory_from_rest_api(app) -> dict:
    """The accumulator, from the REST API of the running application: {"stages": {stage id:
    value}, "tasks": {executor id: [task update, ...]}, "ui_pages": {stage id: page shows it}}."""
    m = UI_RE.search("\n".join(app.err))
    assert m, "the driver logged no UI address:\n" + "\n".join(app.err[-40:])
    ui = f"http://127.0.0.1:{m.group(1)}"
    apps = rest(f"{ui}/api/v1/applications")
    assert len(apps) == 1, apps
    base = f"{ui}/api/v1/applications/{apps[0]['id']}"
    out = {"stages": {}, "map_stages": {}, "tasks": {}, "ui_pages": {}}
    for stage in rest(f"{base}/stages"):
        accs = [a for a in stage.get("accumulatorUpdates", []) if a["name"] == ACC_NAME]
        if not accs:
            continue
        sid, attempt = stage["stageId"], stage["attemptId"]
        if stage.get("shuffleReadBytes", 0) == 0:
            # A map stage: its tasks add the peak too, but only reduce tasks report their
            # counters to the driver, which the test compares with.
            out["map_stages"][sid] = int(accs[0]["value"])
            continue
        out["stages"][sid] = int(accs[0]["value"])
        for task in rest(f"{base}/stages/{sid}/{attempt}/taskList?length=10000"):
            for a in task.get("accumulatorUpdates", []):
                if a["name"] == ACC_NAME:
                    out["tasks"].setdefault(task["executorId"], []).append(int(a["update"]))
        # The UI's stage page is drawn by its stagepage.js from this endpoint, whose
        # accumulatorUpdates (all but Spark's internal ones) fill its Accumulators table.
        page = rest(f"{ui}/stages/stage/?id={sid}&attempt={attempt}")
        shown = rest(f"{base}/stages/{sid}/{attempt}")["accumulatorUpdates"]
        out["ui_pages"][sid] = "stagepage.js" in page and any(a["name"] == ACC_NAME for a in shown)
    return out


def test_engine_counters_reach_spark_metrics_sinks(runner):
    csv_dir = tempfile.mkdtemp(prefix="rs-a3-metrics-")
    release = os.path.join(csv_dir, "release")
    # Spark's default shuffle first, for the outputs to compare with (released at once).
    default_release = os.path.join(csv_dir, "release-default")
    Path(default_release).touch()
    default = App(submit_cmd(runner, METRICS_JOB, [default_release, "0"], {}, plugin=False), runner.env)
    rc = default.finish(RUN_TIMEOUT_S)
    assert rc == 0, f"default-shuffle run failed (rc={rc}); stderr tail:\n" + "\n".join(default.err[-60:])
    expected = digests(default.out)
    assert set(expected) == {"small", "large"}, default.out
    sink = "spark.metrics.conf.executor.sink.csv"
    conf = {
        f"{sink}.class": "org.apache.spark.metrics.sink.CsvSink",
        f"{sink}.period": "1",
        f"{sink}.unit": "seconds",
        f"{sink}.directory": csv_dir,
        "spark.shuffle.rdma.eagerTreshold": "8k",  # misspelt on purpose: one warning expected
        # The live UI and its REST API, on a free port (the address is in the driver's log).
        "spark.ui.enabled": "true",
        "spark.ui.port": "0",
    }
    app = App(submit_cmd(runner, METRICS_JOB, [release, str(RUN_TIMEOUT_S)], conf), runner.env)
    try:
        app.wait_for_line("METRICS_JOB_DONE", STEP_TIMEOUT_S)
        done = time.time()
        app_id = app_id_of("\n".join(app.err))
        check_engines_listen_on_their_own_address(runner, app_id)
        from_rest = read_native_memory_from_rest_api(app)
        # Wait for a sink row of every executor taken after the job ended (whole seconds).
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while True:
            rows = sink_rows(csv_dir, app_id)
            fresh = {e for e, m in rows.items()
                     if m.get("bytes_fetched") and m["bytes_fetched"][-1][0] >= done + 1}
            if len(fresh) >= 2:
                break
            assert time.monotonic() < deadline, \
                f"no sink rows after the job from both executors within {STEP_TIMEOUT_S} s: " \
                f"{ {e: sorted(m) for e, m in rows.items()} } in {csv_dir}"
            time.sleep(0.5)
    finally:
        Path(release).touch()
        rc = app.finish(STEP_TIMEOUT_S)
    stderr = "\n".join(app.err)
    assert rc == 0, f"application failed (rc={rc}); stderr tail:\n" + stderr[-4000:]
    assert "DIGEST job=small records=16000 " in "\n".join(app.out), app.out
    assert "DIGEST job=large records=256 " in "\n".join(app.out), app.out
    # The same records, not only as many: each job's digest (count and sum of record hashes).
    assert digests(app.out) == expected, (digests(app.out), expected)

    stats = engine_stats(stderr)
    assert set(stats) == {"0", "1"}, f"engine stats lines in the driver log: {sorted(stats)}"
    last = {e: {k: v[-1][1] for k, v in m.items()} for e, m in sink_rows(csv_dir, app_id).items()}
    assert set(last) == {"0", "1"}, f"sink files per executor: {sorted(last)}"
    print(f"\n[metrics] sink (last rows): {last}\n[metrics] engine: {stats}")

    for executor, kv in stats.items():
        sunk = last[executor]
        numeric = {k: int(v) for k, v in kv.items() if v.isdigit() and k != "executor"}
        # Every numeric counter the engine reports is a gauge of the source.
        missing = sorted(set(numeric) - set(sunk))
        assert not missing, f"executor {executor}: engine counters without a gauge: {missing}"
        fetch_side = [k for k in numeric if "fetched" in k or k in
                      ("one_sided_reads", "stream_pulls", "read_bytes", "native_requests")]
        assert "bytes_fetched" in fetch_side and "blocks_fetched" in fetch_side, fetch_side
        for k in fetch_side:
            assert sunk[k] == numeric[k], \
                f"executor {executor}: {k} is {sunk[k]} in the sink, {numeric[k]} in the engine"
        for k in ("pool_bytes_in_use", "pool_peak_bytes_in_use", "pool_waits"):
            assert k in sunk, f"executor {executor}: no {k} gauge"

    total = lambda k: sum(m.get(k, 0) for m in last.values())
    assert total("bytes_fetched") > 0 and total("blocks_fetched") > 0, last
    assert total("bytes_served") == total("bytes_fetched"), \
        f"served {total('bytes_served')} != fetched {total('bytes_fetched')}: {last}"
    # Both paths carried blocks: small ones inline, ~1 MiB ones pulled.
    assert total("eager_blocks_fetched") > 0 and total("rendezvous_blocks_fetched") > 0, last

    check_native_memory(from_rest, stats, executor_logs(runner, app_id))

    logs = [stderr] + list(executor_logs(runner, app_id).values())
    warnings = [ln for text in logs for ln in text.splitlines()
                if "spark.shuffle.rdma.eagerTreshold is not a setting" in ln]
    assert len(warnings) == 1, warnings
    assert "WARN" in warnings[0] and "did you mean spark.shuffle.rdma.eagerThreshold?" in warnings[0]


def check_native_memory(from_rest: dict, stats: dict, logs: dict) -> None:
    """The native-memory accumulator in the REST API against the engines' own reports, and
    each executor's bound line against Spark's overhead (see the module docs)."""
    print(f"[metrics] native memory from the REST API: {from_rest}")
    # Both shuffles of the job go through the plugin: their two reduce stages and two map
    # stages carry the accumulator (non-zero: the engine holds memory from its start), and the
    # UI's stage page shows it.
    assert len(from_rest["stages"]) == 2 and len(from_rest["map_stages"]) == 2, from_rest
    assert all(v > 0 for v in list(from_rest["stages"].values()) + list(from_rest["map_stages"].values())), from_rest
    assert all(from_rest["ui_pages"].values()), from_rest["ui_pages"]
    assert set(from_rest["tasks"]) == set(stats) == {"0", "1"}, (from_rest["tasks"], sorted(stats))
    for executor, kv in stats.items():
        peak, bound = int(kv["native_peak_bytes"]), int(kv["native_bound_bytes"])
        assert max(from_rest["tasks"][executor]) == peak, \
            f"executor {executor}: REST API {from_rest['tasks'][executor]}, engine native_peak_bytes={peak}"
        assert bound == EXPECTED_BOUND, f"executor {executor}: bound {bound}, expected {EXPECTED_BOUND}"
        # Over tcp the pool is capped at the bound minus the heap reserve, and the heap is far
        # below that reserve: the peak stays within the bound, and holds at least the pool.
        assert int(kv["pool_peak_bytes_in_use"]) <= peak <= bound, kv
        assert int(kv["pool_cap_bytes"]) + int(kv["native_fixed_bytes"]) == bound, kv
    assert max(from_rest["stages"].values()) == max(int(kv["native_peak_bytes"]) for kv in stats.values())
    lines = [m for text in logs.values() for m in MEMORY_RE.finditer(text)]
    assert sorted(m.group(1) for m in lines) == ["0", "1"], [m.group(0) for m in lines]
    for m in lines:
        assert int(m.group(2)) == EXPECTED_BOUND, m.group(0)
        assert "50 % (spark.shuffle.rdma.memory.overheadPercent) of spark.executor.memoryOverhead" in m.group(6) \
            and "spark.executor.memory=1024m" in m.group(6), m.group(0)


def test_a_pool_cap_that_cannot_fit_is_refused_at_start(runner):
    """An explicit pool.capBytes above the engine's share of the overhead: Spark does not start,
    and the error names both settings with their numbers and what to change."""
    release = os.path.join(tempfile.mkdtemp(prefix="rs-a3-refuse-"), "release")
    Path(release).touch()
    conf = {"spark.executor.memoryOverhead": "384m", "spark.shuffle.rdma.pool.capBytes": "512m"}
    app = App(submit_cmd(runner, METRICS_JOB, [release, "1"], conf), runner.env)
    rc = app.finish(STEP_TIMEOUT_S)
    err = "\n".join(app.err)
    assert rc != 0, "an application with a pool cap that cannot fit started"
    assert "METRICS_JOB_DONE" not in app.out
    refusal = [ln for ln in app.err if "spark.shuffle.rdma.pool.capBytes='536870912'" in ln]
    assert refusal, "no refusal naming the cap in the driver's output:\n" + err[-4000:]
    why = refusal[0]
    for want in ("RdmaShuffleConfigException",
                 "spark.executor.memoryOverhead = 402653184 bytes, set to '384m'",
                 f"native memory bound of {EXPECTED_BOUND} bytes",
                 f"at most {EXPECTED_BOUND - 8 * 2**20} bytes",
                 # (512 MiB cap + 8 MiB heap reserve) at 50 %.
                 "raise spark.executor.memoryOverhead to at least 1040m (at 50 %)"):
        assert want in why, f"{want!r} missing from: {why}"
    print(f"[metrics] refused at start: {why}")
