"""TPC-DS at a small scale under both shuffles (needs Spark: run through tests/spark/run.sh).

Spark's own TPC-DS query texts of the Spark line under test (tpcds/q*.sql of its spark-sql tests
jar) run on TPC-DS data at SF 0.1 (DuckDB's generator, cached under ~/.cache/rdma-shuffle/tpcds;
~5 s to make once), in one application with Spark's default shuffle and one with the plugin,
both on local-cluster[2,1,1024] with host-local disk reads off so blocks cross executors
(scripts/tpcds.py, the same code as scripts/bench-tpcds.sh).

- Spark 4.x: every query (103).
- Spark 3.5 (RDMA_SPARK_PROFILE=spark-3.5): 20 shuffle-heavy queries (SHUFFLE_HEAVY below),
  with 3.5's own texts.

Each query's result (rows sorted, floating-point values to 6 significant digits) must be the same
under both shuffles, and the plugin's engines must have served the remote blocks: their
counters, which reduce tasks report to the driver, equal Spark's own remote-read metrics.
Timings are printed, never asserted. RDMA_TPCDS_SF and RDMA_TPCDS_QUERIES (a comma list) change
the scale and the set for a quick check by hand.
"""
import os
import sys
from pathlib import Path

import pytest

from conftest import PROFILE, REPO, require_native_or_skip, spark_env

sys.path.insert(0, str(REPO / "scripts"))
import tpcds  # noqa: E402

pytestmark = pytest.mark.tpcds

SF = float(os.environ.get("RDMA_TPCDS_SF", "0.1"))
# A comma list of queries to run instead (a developer's quick check; CI runs the sets above).
ONLY = os.environ.get("RDMA_TPCDS_QUERIES", "")
# 20 shuffle-heavy queries: the multi-channel unions and year-over-year self-joins over the sales
# facts (q14, q23, q4, q11, q74, q78, q75, q47, q57, ...), whose measured shuffle bytes at SF 0.1
# include q23b 10.6 MB and q14a 8.9 MB against q3's 4 KB. Chosen by their plans, not yet ranked
# from a full `scripts/bench-tpcds.sh` report (`shuffle_bytes` per query): re-rank from one.
SHUFFLE_HEAVY = "q23a,q23b,q14a,q14b,q4,q11,q74,q78,q64,q24a,q24b,q47,q57,q75,q67,q97,q87,q38,q51,q93"
MASTER = "local-cluster[2,1,1024]"


@pytest.fixture(scope="module")
def tpcds_runs(tmp_path_factory):
    env = spark_env()
    os.environ.setdefault("RDMA_TPCDS_CACHE", str(Path.home() / ".cache/rdma-shuffle/tpcds"))
    data = tpcds.ensure_data(SF)
    qdir = tpcds.ensure_queries(env["SPARK_VERSION"], env["SCALA_BINARY"])
    names = tpcds.all_queries(qdir) if PROFILE != "spark-3.5" else SHUFFLE_HEAVY.split(",")
    if ONLY:
        names = ONLY.split(",")
    out = tmp_path_factory.mktemp("tpcds")
    logs = REPO / "target" / "spark-tpcds-logs" / (PROFILE or "spark-4.x")
    runs = {}
    for mode in ("default", "plugin"):
        runs[mode] = tpcds.submit_local(mode, data, qdir, names, out / f"{mode}.json", logs,
                                        master=MASTER, driver_memory="1g", env=env, timeout=1800)
        total = sum(q["wall_s"] for q in runs[mode]["queries"])
        print(f"\n[spark-tpcds] Spark {env['SPARK_VERSION']} SF {SF:g}: {len(names)} queries, "
              f"{mode}: queries {total:.1f} s, application {runs[mode]['submit_s']} s")
    return names, runs


def test_every_query_ran_and_results_are_equal(tpcds_runs):
    names, runs = tpcds_runs
    by = {m: {q["query"]: q for q in r["queries"]} for m, r in runs.items()}
    errors = {(m, n): by[m][n]["error"] for m in by for n in names if by[m][n].get("error")}
    assert not errors, errors
    differ = [n for n in names if by["default"][n]["digest"] != by["plugin"][n]["digest"]]
    assert not differ, [(n, by["default"][n], by["plugin"][n]) for n in differ]
    # Empty results compare equal trivially: most queries must have returned rows (a bad data
    # load or a lost view leaves them empty). At SF 0.1 some are empty by nature: q4, q8, q24a
    # and q24b of the first 27, so at most a third is allowed.
    empty = [n for n in names if by["default"][n]["rows"] == 0]
    assert len(empty) <= len(names) // 3, f"empty results: {empty}"
    # The set really shuffles, and its blocks crossed executors in both runs.
    for m in by:
        remote = sum(q["shuffle_remote_bytes"] for q in by[m].values())
        assert remote > 0, f"{m}: no shuffle bytes crossed executors"


def test_plugin_engines_served_the_remote_blocks(tpcds_runs):
    """The plugin's engines fetched every remote block Spark counted, and nothing was handed
    back to Spark's own block client."""
    names, runs = tpcds_runs
    plugin = runs["plugin"]
    require_native_or_skip(plugin["native_loaded"], f"the TPC-DS plugin run ({plugin['app_id']})")
    eng = plugin["engine"]
    assert set(eng) >= {"0", "1"}, f"engine stats in the driver log: {sorted(eng)}"
    total = lambda k: sum(int(v.get(k, 0)) for v in eng.values())
    spark_remote = sum(q["shuffle_remote_bytes"] for q in plugin["queries"])
    spark_blocks = sum(q["shuffle_remote_blocks"] for q in plugin["queries"])
    print(f"[spark-tpcds] engines: native_requests={total('native_requests')} "
          f"blocks_fetched={total('blocks_fetched')} bytes_fetched={total('bytes_fetched')}; "
          f"Spark: remote_blocks={spark_blocks} remote_bytes={spark_remote}")
    assert total("native_requests") > 0, eng
    assert total("delegated_requests") == 0, eng
    assert total("failed_blocks_fetched") == 0, eng
    assert total("bytes_fetched") == spark_remote, eng
    assert total("blocks_fetched") == spark_blocks, eng


def test_report_keeps_retries_and_the_share_a_shuffle_can_save():
    """The bench's report over synthetic rounds (no Spark): a run retried on Spark's
    execution-memory limit is counted, not hidden; the transport bound is the tasks' fetch wait
    plus shuffle write over their run time, summed over every stage of every query."""
    def q(name, wall, run_ms, fetch_ms, write_ms, span, retried=False):
        r = {"query": name, "wall_s": wall, "rows": 1, "digest": "d" + name, "jobs_span_s": span,
             "shuffle_write_bytes": 10, "shuffle_read_bytes": 10, "shuffle_remote_bytes": 5,
             "shuffle_remote_blocks": 1, "fetch_wait_ms": fetch_ms, "stages": 1, "rerun_stages": [],
             "fetch_failed": False,
             "stage_detail": [{"run_ms": run_ms, "fetch_wait_ms": fetch_ms, "write_ms": write_ms}]}
        if retried:
            r["failed_attempt"] = {"wall_s": 0.5, "error": "UNABLE_TO_ACQUIRE_MEMORY"}
        return r

    runs = {
        "default": [{"queries": [q("q1", 2.0, 3000, 30, 60, 1.5), q("q2", 1.0, 1000, 0, 10, 0.8)]}],
        "plugin": [{"queries": [q("q1", 2.2, 3300, 20, 60, 1.6, retried=True), q("q2", 1.0, 1000, 0, 10, 0.9)]}],
    }
    rep = tpcds.compare(runs, ["q1", "q2"])
    assert rep["equal"] == 2 and rep["total"] == 2
    assert rep["retried"] == {"q1": {"default": 0, "plugin": 1}}
    d, p = rep["time_shares"]["default"][0], rep["time_shares"]["plugin"][0]
    assert d["task_s"] == 4.0 and d["fetch_wait_s"] == 0.03 and d["shuffle_write_s"] == 0.07
    assert d["transport_bound"] == round(0.1 / 4.0, 4)
    assert p["driver_s"] == round(0.6 + 0.1, 1)
    row = next(r for r in rep["queries"] if r["query"] == "q1")
    assert row["task_s"] == {"default": [3.0], "plugin": [3.3]}
    assert rep["sum_ratio"] == round(3.2 / 3.0, 3)
