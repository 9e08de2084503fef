"""The cluster every module of tests/cluster shares: scripts/cluster.sh brings up a master, a
driver and three workers once per session (test_cluster.py, test_faults.py and test_service.py
run on it) and takes it down at the end, checking that no namespace is left behind. Every worker
runs Spark's external shuffle service (`up --shuffle-service`); only the applications that set
`spark.shuffle.service.enabled=true` (test_service.py) use it."""
import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER = str(REPO / "scripts" / "cluster.sh")
N = 3
PREFIX = os.environ.get("CLUSTER_PREFIX", "rsb2")
SUBNET = os.environ.get("CLUSTER_SUBNET", "10.77.0")
TIMINGS: dict = {}


def sh(*args, timeout=900, check=True) -> subprocess.CompletedProcess:
    """scripts/cluster.sh ARGS, timed per command (the totals are printed at the end)."""
    t0 = time.monotonic()
    p = subprocess.run([CLUSTER, *args], capture_output=True, text=True, timeout=timeout)
    TIMINGS[args[0]] = TIMINGS.get(args[0], 0.0) + time.monotonic() - t0
    print(f"\n$ scripts/cluster.sh {' '.join(args)}  (rc={p.returncode}, {time.monotonic() - t0:.1f} s)")
    print(p.stdout[-6000:])
    if check and p.returncode != 0:
        raise AssertionError(f"cluster.sh {' '.join(args)} failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
    return p


@pytest.fixture(scope="session")
def cluster():
    try:
        sh("up", str(N), "--shuffle-service", timeout=900)
        yield
    finally:
        sh("down", timeout=300, check=False)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        print(f"[cluster-test] seconds per command: { {k: round(v, 1) for k, v in TIMINGS.items()} }")
        assert not [ln for ln in left.splitlines() if ln.startswith(f"{PREFIX}-")], f"namespaces left: {left}"
