"""TPC-DS at a small scale under both shuffles (needs Spark: run through tests/spark/run.sh).

Spark's own TPC-DS query texts of the Spark line under test (tpcds/q*.sql of its spark-sql tests
jar) run on TPC-DS data (DuckDB's generator, cached under ~/.cache/rdma-shuffle/tpcds; SF 0.1
takes ~15 s to make once), in one application with Spark's default shuffle and one with the
plugin, both on local-cluster[2,1,1024] with host-local disk reads off so blocks cross executors
(scripts/tpcds.py, the same code as scripts/bench-tpcds.sh).

- CI (scripts/test.sh): a representative set at SF 0.1 (CI_SET below, per Spark line), every
  query of which returns rows.
- scripts/test.sh --full (RDMA_TEST_FULL=1): all 103 queries of the line at SF 0.1; the queries
  that return no rows there run again at SF 1 in two more applications.

Each query's result must be the same under both shuffles: exactly for decimals, integers,
strings and dates, and within the tolerance of Spark's summation order for FLOAT/DOUBLE columns
(scripts/tpcds.py compare_results; which columns are floating point is read from each result's
schema and printed). A query whose first attempt failed on Spark's execution-memory limit under
one shuffle only fails the test. The plugin's engines must have served the remote blocks: their
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

FULL = os.environ.get("RDMA_TEST_FULL", "") == "1"
SF = float(os.environ.get("RDMA_TPCDS_SF", "0.1"))
# The scale at which --full runs again the queries that return no rows at SF.
SF_NONEMPTY = 1.0
# A comma list of queries to run instead (a developer's quick check).
ONLY = os.environ.get("RDMA_TPCDS_QUERIES", "")
# The CI sets: queries that return rows at SF 0.1, chosen from a --full run of Spark 4.2.0's 103
# queries at SF 0.1 under both shuffles (7 December 2026: rows, shuffle bytes, column kinds):
# - the most shuffle-heavy that return rows: q23b (9.8 MiB written at SF 0.1), q51 (4.1),
#   q95 (1.3), where most blocks cross the transport;
# - the ones whose results have DOUBLE columns, so the tolerant comparison runs: q17 (stddev,
#   covariance), q39a (mean, covariance);
# - q98 (250 rows of decimals and strings);
# about 25 s of queries per application on a quiet machine, against ~300 s for all 103.
# Spark 3.5: two of them on 3.5's own texts (the heaviest shuffle, q23b, and q39a with DOUBLE
# columns). The rest run under --full only, to keep CI within its budget: q14a (8.4 MiB, but
# 20 s per application, as long as the other six together), q67 (3.0 MiB), q35 (averages),
# q2 (2 513 rows), and on 3.5 q17 and q51.
CI_SET = {
    "": "q17,q23b,q39a,q51,q95,q98",
    "spark-3.5": "q23b,q39a",
}
MASTER = "local-cluster[2,1,1024]"


def run_both(env: dict, sf: float, names: list, tag: str, tmp) -> dict:
    """One application per shuffle of `names` at scale `sf`; returns {mode: [report]}."""
    data = tpcds.ensure_data(sf)
    qdir = tpcds.ensure_queries(env["SPARK_VERSION"], env["SCALA_BINARY"])
    logs = REPO / "target" / "spark-tpcds-logs" / (PROFILE or "spark-4.x")
    runs = {}
    for mode in ("default", "plugin"):
        runs[mode] = [tpcds.submit_local(mode, data, qdir, names, tmp / f"{tag}-{mode}.json", logs,
                                         master=MASTER, driver_memory="1g", env=env, timeout=2400)]
        total = sum(q["wall_s"] for q in runs[mode][0]["queries"])
        print(f"\n[spark-tpcds] Spark {env['SPARK_VERSION']} SF {sf:g}: {len(names)} queries, "
              f"{mode}: queries {total:.1f} s, application {runs[mode][0]['submit_s']} s")
    return runs


@pytest.fixture(scope="module")
def tpcds_runs(tmp_path_factory):
    """[(sf, names, runs, report)]: the set at SF and, under --full, its empty queries at SF 1."""
    env = spark_env()
    os.environ.setdefault("RDMA_TPCDS_CACHE", str(Path.home() / ".cache/rdma-shuffle/tpcds"))
    qdir = tpcds.ensure_queries(env["SPARK_VERSION"], env["SCALA_BINARY"])
    names = (ONLY.split(",") if ONLY else tpcds.all_queries(qdir) if FULL else CI_SET[PROFILE].split(","))
    tmp = tmp_path_factory.mktemp("tpcds")
    out = []
    sets = [(SF, names)]
    while sets:
        sf, ns = sets.pop(0)
        runs = run_both(env, sf, ns, f"sf{sf:g}", tmp)
        rep = tpcds.compare(runs, ns, float_tol=tpcds.float_tolerance(tpcds.data_rows(tpcds.ensure_data(sf))))
        tpcds.print_table(rep)
        # Readers of CI logs took the ratio above for a result (it read 1.44 in one run, 0.86 in the next).
        print("[spark-tpcds] one application per shuffle, the default's always first (and in CI the client "
              "compiler only): these times and their ratio measure nothing; the measurement is "
              "scripts/bench-tpcds.sh --rounds N (docs/benchmarks.md, TPC-DS)")
        out.append((sf, ns, runs, rep))
        if FULL and not ONLY and sf < SF_NONEMPTY and rep["empty_queries"]:
            sets.append((SF_NONEMPTY, rep["empty_queries"]))
    return out


def test_every_query_ran_and_results_are_equal(tpcds_runs):
    for sf, names, runs, rep in tpcds_runs:
        errors = {(m, q["query"]): q["error"] for m in runs for q in runs[m][0]["queries"] if q.get("error")}
        assert not errors, errors
        assert not tpcds.check_problems(rep), tpcds.check_problems(rep)
        assert rep["equal"] == len(names), [(q["query"], q["why"]) for q in rep["queries"] if not q["equal"]]
        # The set really shuffles, and its blocks crossed executors in both runs.
        for m in runs:
            remote = sum(q["shuffle_remote_bytes"] for q in runs[m][0]["queries"])
            assert remote > 0, f"SF {sf:g} {m}: no shuffle bytes crossed executors"


def test_every_query_returns_rows(tpcds_runs):
    """An empty result compares equal whatever the shuffle did: a CI set holds only queries that
    return rows. Under --full, the queries empty at SF 0.1 ran again at SF 1; those empty there
    too (q78 needs a customer buying one item in one year through all three channels) are named
    in the skip reason, which -ra prints."""
    if ONLY:
        pytest.skip("a hand-picked set (RDMA_TPCDS_QUERIES) may hold empty queries")
    sf, names, runs, rep = tpcds_runs[-1]
    # Both shuffles' row counts are in the report (rows per shuffle); an empty result is empty
    # under both (the results are equal: the test above).
    if FULL:
        if rep["empty_queries"] and sf >= SF_NONEMPTY:
            pytest.skip(f"--full: empty under both shuffles at SF 0.1 and SF {sf:g}: {rep['empty_queries']}")
        return
    assert not rep["empty_queries"], (
        f"queries that return no rows at SF {sf:g} under both shuffles: {rep['empty_queries']} "
        "(choose CI_SET from queries that return rows)")


def test_plugin_engines_served_the_remote_blocks(tpcds_runs):
    """The plugin's engines fetched every remote block Spark counted, and nothing was handed
    back to Spark's own block client."""
    for sf, names, runs, rep in tpcds_runs:
        plugin = runs["plugin"][0]
        require_native_or_skip(plugin["native_loaded"], f"the TPC-DS plugin run ({plugin['app_id']})")
        eng = plugin["engine"]
        assert set(eng) >= {"0", "1"}, f"engine stats in the driver log: {sorted(eng)}"
        total = lambda k: sum(int(v.get(k, 0)) for v in eng.values())  # noqa: E731
        # Spark's remote reads over the whole application: a query's broadcast exchanges run
        # jobs of their own, which read shuffle blocks when AQE made a join a broadcast.
        spark_remote = plugin["app_shuffle"]["remote_bytes"]
        spark_blocks = plugin["app_shuffle"]["remote_blocks"]
        per_query = sum(q["shuffle_remote_bytes"] for q in plugin["queries"])
        print(f"[spark-tpcds] SF {sf:g} engines: native_requests={total('native_requests')} "
              f"blocks_fetched={total('blocks_fetched')} bytes_fetched={total('bytes_fetched')}; "
              f"Spark: remote_blocks={spark_blocks} remote_bytes={spark_remote} (by query: {per_query})")
        assert total("native_requests") > 0, eng
        assert total("delegated_requests") == 0, eng
        assert total("failed_blocks_fetched") == 0, eng
        # Spark counts a remote block when its task takes it, or releases it at the task's end;
        # a block whose fetch completes after its task ended (a join that stopped reading its
        # input early) is dropped uncounted, under either transport. At SF 0.1 every fetch
        # lands before its task ends (equal over all 103 queries); at SF 1 one of 3 326 006
        # bytes did not, in two runs (the 21 queries empty at SF 0.1, and 9 of them).
        if sf < SF_NONEMPTY:
            assert total("bytes_fetched") == spark_remote, eng
            assert total("blocks_fetched") == spark_blocks, eng
        else:
            assert total("bytes_fetched") >= spark_remote, eng
            assert total("blocks_fetched") >= spark_blocks, eng


# ------------------------------------------------------------------------------------------------
# The report's logic over synthetic runs (no Spark).


def _q(name, wall, result, kinds=("exact", "float"), run_ms=1000, fetch_ms=0, write_ms=10, span=None,
       failed_attempt=False):
    r = {"query": name, "wall_s": wall, "rows": len(result), "columns": ["k", "v"][:len(kinds)],
         "kinds": list(kinds), "float_columns": [c for c, k in zip(["k", "v"], kinds) if k == "float"],
         "result": result, "digest": tpcds.result_digest(result), "jobs_span_s": span or wall * 0.8,
         "shuffle_write_bytes": 10, "shuffle_read_bytes": 10, "shuffle_remote_bytes": 5,
         "shuffle_remote_blocks": 1, "fetch_wait_ms": fetch_ms, "stages": 1, "rerun_stages": [],
         "fetch_failed": False,
         "stage_detail": [{"run_ms": run_ms, "cpu_ms": run_ms // 2, "gc_ms": 10, "deser_ms": 5,
                           "fetch_wait_ms": fetch_ms, "write_ms": write_ms, "remote_bytes": 5,
                           "local_bytes": 5, "spill_bytes": 0}]}
    if failed_attempt:
        r["failed_attempt"] = {"wall_s": 0.5, "error": "UNABLE_TO_ACQUIRE_MEMORY"}
    return r


def test_exact_columns_compare_exactly_and_doubles_within_the_summation_tolerance():
    tol = tpcds.float_tolerance(2_000_000)
    base = {"columns": ["k", "v"], "kinds": ["exact", "float"]}

    def res(rows):
        c = tpcds.canonical(rows, base["kinds"])
        return dict(base, result=c, digest=tpcds.result_digest(c))

    from decimal import Decimal
    ref = res([(Decimal("1234567.89"), 0.1 + 0.2), (Decimal("0.01"), None)])
    # A decimal off by its last digit (a lost 0.01 row in a sum) is a difference, however large
    # the sum: the old 6-digit rounding could not see it.
    assert not tpcds.compare_results(ref, res([(Decimal("1234567.90"), 0.1 + 0.2), (Decimal("0.01"), None)]), tol)["equal"]
    # A double whose last bits moved (another summation order) is not.
    c = tpcds.compare_results(ref, res([(Decimal("1234567.89"), 0.3), (Decimal("0.01"), None)]), tol)
    assert c["equal"] and 0 < c["max_rel_diff"] < 1e-15
    # A double that moved beyond what the summation order explains is.
    assert not tpcds.compare_results(ref, res([(Decimal("1234567.89"), 0.3 * (1 + 1e-6)), (Decimal("0.01"), None)]), tol)["equal"]
    # Rows missing, NULL against a value.
    assert not tpcds.compare_results(ref, res([(Decimal("1234567.89"), 0.3)]), tol)["equal"]
    assert not tpcds.compare_results(ref, res([(Decimal("1234567.89"), 0.3), (Decimal("0.01"), 0.0)]), tol)["equal"]
    # Rows in another order are the same result.
    assert tpcds.compare_results(ref, res([(Decimal("0.01"), None), (Decimal("1234567.89"), 0.1 + 0.2)]), tol)["equal"]


def test_a_retry_under_one_shuffle_only_fails_and_under_both_is_counted():
    rows = [["1", 2.0]]
    runs = {"default": [{"queries": [_q("q1", 2.0, rows), _q("q2", 1.0, rows)]}],
            "plugin": [{"queries": [_q("q1", 2.2, rows, failed_attempt=True), _q("q2", 1.0, rows)]}]}
    rep = tpcds.compare(runs, ["q1", "q2"])
    assert rep["equal"] == 2 and rep["retried"] == {"q1": {"default": 0, "plugin": 1}}
    assert rep["one_sided_retries"] == ["q1"]
    assert any("one shuffle only" in p for p in tpcds.check_problems(rep))
    runs["default"][0]["queries"][0] = _q("q1", 2.0, rows, failed_attempt=True)
    rep = tpcds.compare(runs, ["q1", "q2"])
    assert rep["one_sided_retries"] == [] and not tpcds.check_problems(rep)


def test_report_rows_terms_and_the_share_a_shuffle_can_save():
    """Row counts of both shuffles, the time terms per query, the transport bound (fetch wait
    plus shuffle write over run time) and the sum ratio over all rounds."""
    runs = {
        "default": [{"queries": [_q("q1", 2.0, [["a", 1.0]], run_ms=3000, fetch_ms=30, write_ms=60, span=1.5),
                                 _q("q2", 1.0, [], run_ms=1000, write_ms=10, span=0.8)]}],
        "plugin": [{"queries": [_q("q1", 2.2, [["a", 1.0]], run_ms=3300, fetch_ms=20, write_ms=60, span=1.6),
                                _q("q2", 1.0, [], run_ms=1000, write_ms=10, span=0.9)]}],
    }
    rep = tpcds.compare(runs, ["q1", "q2"])
    assert rep["equal"] == 2 and rep["empty_queries"] == ["q2"]
    row = next(r for r in rep["queries"] if r["query"] == "q1")
    assert row["rows"] == {"default": [1], "plugin": [1]} and row["float_columns"] == ["v"]
    assert row["terms"]["plugin"][0]["run_s"] == 3.3 and row["terms"]["plugin"][0]["cpu_s"] == 1.65
    assert row["terms"]["default"][0]["off_cpu_s"] == round(3.0 - 1.5 - 0.01 - 0.03, 4)
    d = rep["time_shares"]["default"][0]
    assert d["task_s"] == 4.0 and d["fetch_wait_s"] == 0.03 and d["shuffle_write_s"] == 0.07
    assert d["transport_bound"] == round(0.1 / 4.0, 4)
    assert rep["sum_ratio"] == round(3.2 / 3.0, 3)
    assert "| executor CPU time |" in tpcds.time_table(rep)


def test_intervals_cover_a_known_ratio_and_shrink_with_rounds():
    """The bootstrap interval of the sum ratio and the per-query intervals, on rounds drawn with
    a known ratio (0.97), noise and an order effect (whichever runs second is 6 % faster)."""
    import random
    rng = random.Random(7)
    base = [rng.uniform(0.5, 12) for _ in range(40)]

    def draw(rounds):
        d, p = [], []
        for r in range(rounds):
            second = 0.94  # order effect
            fd, fp = (1.0, second) if r % 2 == 0 else (second, 1.0)
            d.append([t * fd * rng.gauss(1, 0.08) for t in base])
            p.append([t * 0.97 * fp * rng.gauss(1, 0.08) for t in base])
        return d, p

    widths = []
    for rounds in (4, 16):
        d, p = draw(rounds)
        first = [r % 2 for r in range(rounds)]
        ci = tpcds.bootstrap_sum_ratio(d, p, first, resamples=1000)
        assert ci["lo"] < 0.97 < ci["hi"], ci
        widths.append(ci["hi"] - ci["lo"])
        iv = tpcds.ratio_interval([x[0] for x in d], [x[0] for x in p], first)
        assert iv["method"].startswith("Welch") and iv["lo"] < iv["ratio"] < iv["hi"]
    assert widths[1] < widths[0], widths
