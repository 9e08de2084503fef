"""The engine counters in Spark's logs: the `RDMA_SHUFFLE_ENGINE_STATS executor=<id> key=value...`
lines the driver logs for every report a reduce task sends it (RdmaShuffleManager), and an
executor logs for itself when it stops. One parser for the scripts and the tests that read them
(scripts/tpcds.py, scripts/cluster_metrics.py, tests/spark/conftest.py)."""
from __future__ import annotations

import re

STATS_RE = re.compile(r"RDMA_SHUFFLE_ENGINE_STATS (.*)$", re.M)


def stats_lines(text: str) -> list:
    """(executor id, {key: int, or str for a non-numeric value}) per stats line, in order."""
    out = []
    for m in STATS_RE.finditer(text):
        kv = dict(x.split("=", 1) for x in m.group(1).split() if "=" in x)
        executor = kv.pop("executor", "?")
        out.append((executor, {k: int(v) if v.isdigit() else v for k, v in kv.items()}))
    return out


def latest(text: str) -> dict:
    """executor id -> the counters of its last stats line in `text`."""
    return dict(stats_lines(text))


def engine_totals(text: str) -> dict:
    """executor id -> its engine's counters. One executor has many lines and the reports may
    arrive out of order: the counters only grow, so each one's total is its largest value."""
    totals: dict = {}
    for executor, kv in stats_lines(text):
        mine = totals.setdefault(executor, {})
        for k, v in kv.items():
            mine[k] = max(mine.get(k, 0), v) if isinstance(v, int) else v
    return totals
