"""No silent plaintext: what the plugin does when the application asks for encryption.

The engine does not encrypt yet. Two applications of ShuffleJobs (wordcount and terasort at
scale 0.1) on local-cluster[2,1,1024] with the plugin and `spark.authenticate=true`:

1. `spark.network.crypto.enabled=true`: every shuffle goes to Spark's built-in sort shuffle
   (which encrypts), no engine is started anywhere, and exactly one warning (in the driver's
   log; executors do not repeat it) names the setting, says why and what to do.
2. `spark.io.encryption.enabled=true` (encrypted shuffle files): the engine moves the files'
   bytes as they are and Spark's reader decrypts them; the outputs equal those of run 1, which
   went through Spark's own shuffle, and the engine's counters show the blocks went through it.
   Engine connections authenticate with the application's secret (spark.authenticate).

Run: `tests/spark/run.sh -k security`.
"""
import subprocess

import pytest

from conftest import RUN_TIMEOUT_S
from test_metrics import app_id_of, engine_stats, executor_logs, submit_cmd

JOB_CLASS = "org.apache.spark.shuffle.rdma.jobs.ShuffleJobs"
JOBS = ["wordcount", "terasort"]
AUTH = {"spark.authenticate": "true", "spark.authenticate.secret": "rs-a3-test-secret"}
WARNING = "spark.network.crypto.enabled=true asks Spark to encrypt the traffic between executors"


def _run(runner, conf: dict):
    cmd = submit_cmd(runner, JOB_CLASS, [",".join(JOBS), "0.1"], {**AUTH, **conf})
    p = subprocess.run(cmd, capture_output=True, text=True, env=runner.env, timeout=RUN_TIMEOUT_S)
    assert p.returncode == 0, f"application failed; stderr tail:\n{p.stderr[-4000:]}"
    app_id = app_id_of(p.stderr)
    digests = {ln.split()[1]: ln for ln in p.stdout.splitlines() if ln.startswith("DIGEST ")}
    assert set(digests) == {f"job={j}" for j in JOBS}, p.stdout
    return p, digests, executor_logs(runner, app_id)


@pytest.fixture(scope="module")
def crypto_run(runner):
    return _run(runner, {"spark.network.crypto.enabled": "true"})


def test_network_crypto_hands_every_shuffle_to_spark_with_one_warning(crypto_run):
    p, digests, logs = crypto_run
    assert len(logs) == 2, list(logs)
    warnings = [ln for text in [p.stderr] + list(logs.values()) for ln in text.splitlines()
                if WARNING in ln]
    assert len(warnings) == 1 and warnings[0] in p.stderr, warnings
    assert "WARN" in warnings[0] and "handed to Spark's built-in sort shuffle" in warnings[0], warnings
    assert "turn spark.network.crypto.enabled off" in warnings[0], warnings
    for path, text in logs.items():
        assert "RdmaShuffleManager created (isDriver=false" in text, path
        assert "RDMA shuffle engine not started: spark.network.crypto.enabled=true" in text, path
        assert "listening on" not in text, f"{path}: an engine started despite encryption"
    assert "RDMA_SHUFFLE_ENGINE_STATS" not in p.stderr, "an engine moved blocks"
    assert "sorted=true" in digests["job=terasort"], digests


def test_encrypted_shuffle_files_go_through_the_engine(runner, crypto_run):
    _, reference, _ = crypto_run
    p, digests, logs = _run(runner, {"spark.io.encryption.enabled": "true"})
    assert digests == reference, f"io encryption through the engine: {digests}, Spark: {reference}"
    assert WARNING not in p.stderr
    stats = engine_stats(p.stderr)
    assert set(stats) == {"0", "1"}, f"engine stats lines in the driver log: {sorted(stats)}"
    assert sum(int(kv["bytes_fetched"]) for kv in stats.values()) > 0, stats
    assert sum(int(kv["native_requests"]) for kv in stats.values()) > 0, stats
    assert all(int(kv.get("auth_failures", "0")) == 0 for kv in stats.values()), stats
