#!/usr/bin/env python3
"""TPC-DS for both shuffles: data, Spark's own query texts, the application that runs them, and
the interleaved benchmark that compares Spark's default shuffle with the plugin.

    tpcds.py data --sf SF                 generate (once) and print the parquet folder of scale SF
    tpcds.py queries                      fetch (once) and print the folder of Spark's query texts
    tpcds.py app --data D --queries Q --list q1,q2 --out FILE [--executors N]
                                          the Spark application (run it with spark-submit)
    tpcds.py bench --sf SF [--queries ..] [--rounds R] [--cluster N] [--kill-every S]
                                          the benchmark (scripts/bench-tpcds.sh runs this)
    tpcds.py table [--report FILE] [--top K]
                                          the time table (markdown) of a bench report
    tpcds.py stages --queries q1,q2 [--logs DIR]
                                          per stage, side by side, every round of a bench run

Run every subcommand with the python of the venv of scripts/spark-env.sh (its environment:
SPARK_HOME, SPARK_VERSION, SCALA_BINARY, VENV_DIR, RDMA_PLUGIN_JAR, ...), as
scripts/bench-tpcds.sh and tests/spark/test_tpcds.py do.

Data: DuckDB's TPC-DS extension (`dsdgen`) from PyPI: packages `duckdb` and
`duckdb-extension-tpcds` of the same version (DUCKDB_VERSION), loaded from the file the package
ships (PyPI's duckdb has no generator built in and its `INSTALL tpcds` needs the internet). Each
of the 24 tables is written as one parquet file under $RDMA_TPCDS_CACHE (default
~/.cache/rdma-shuffle/tpcds)/sf<SF>/, with generator.json naming the generator and its version.

Queries: `tpcds/q*.sql` of the `spark-sql_<scala>:<version>:tests` jar from Maven Central (103
texts for Spark 4.2.0: q1..q99, with a/b variants of q14, q23, q24 and q39), cached under
$RDMA_TPCDS_CACHE/queries-<version>/.

The application registers each table as a temporary view. q30 names the TPC-DS v1.4 column
`c_last_review_date`; the generator's `customer` has `c_last_review_date_sk`, so the view has
both names. It waits for its executors, then runs each query once under the job group of its
name, timing `collect()`, and writes per query: wall time, rows, the result itself (rows sorted,
every value exact - decimals, integers, strings, dates as text - but FLOAT/DOUBLE columns, read
from the result's schema, kept as doubles) with its digest and, from Spark's REST API at the
end, the query's shuffle bytes written/read/remote, its stage attempts, the stages that were
rerun, whether a stage failed on a fetch failure, and per stage the tasks' run, CPU, GC,
deserialisation, shuffle write and fetch-wait times and bytes read remotely and locally.

Two runs' results are equal when every exact column is equal and every floating-point value is
within float_tolerance (relative): Spark merges an aggregate's partial sums in the order their
shuffle blocks arrive, which changes a double's last bits and nothing else.
"""
import argparse
import datetime
import hashlib
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
from decimal import Decimal
from pathlib import Path

from engine_stats import engine_totals  # scripts/, beside this file

REPO = Path(__file__).resolve().parents[1]
DUCKDB_VERSION = "1.5.5"
CACHE = Path(os.environ.get("RDMA_TPCDS_CACHE", Path.home() / ".cache/rdma-shuffle/tpcds"))
PLUGIN_CLASS = "org.apache.spark.shuffle.rdma.RdmaShuffleManager"
TABLES = (
    "call_center", "catalog_page", "catalog_returns", "catalog_sales", "customer",
    "customer_address", "customer_demographics", "date_dim", "household_demographics",
    "income_band", "inventory", "item", "promotion", "reason", "ship_mode", "store",
    "store_returns", "store_sales", "time_dim", "warehouse", "web_page", "web_returns",
    "web_sales", "web_site",
)


def log(msg: str) -> None:
    print(f"[tpcds {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# data and queries


def sf_name(sf: float) -> str:
    return f"sf{sf:g}"


def ensure_duckdb() -> None:
    """duckdb and its TPC-DS extension package, of the same version, in this python's venv."""
    try:
        import duckdb  # noqa: F401
        import duckdb_extension_tpcds  # noqa: F401
        if duckdb.__version__ == DUCKDB_VERSION:
            return
    except ImportError:
        pass
    log(f"installing duckdb=={DUCKDB_VERSION} and duckdb-extension-tpcds=={DUCKDB_VERSION} (PyPI)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    f"duckdb=={DUCKDB_VERSION}", f"duckdb-extension-tpcds=={DUCKDB_VERSION}"], check=True)


def tpcds_extension_file() -> Path:
    import duckdb_extension_tpcds
    root = Path(duckdb_extension_tpcds.__file__).parent
    found = sorted(root.rglob("tpcds.duckdb_extension"))
    if not found:
        raise SystemExit(f"no tpcds.duckdb_extension inside {root}: the package "
                         f"duckdb-extension-tpcds=={DUCKDB_VERSION} changed its layout")
    return found[0]


def ensure_data(sf: float) -> Path:
    """The parquet folder of scale `sf`, generated on first use (SF 1: ~30 s, 371 MB)."""
    out = CACHE / sf_name(sf)
    if (out / "generator.json").exists():
        return out
    ensure_duckdb()
    import duckdb
    ext = tpcds_extension_file()
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sf_name(sf)}-", dir=CACHE))
    t0 = time.monotonic()
    log(f"generating TPC-DS SF {sf:g} with duckdb {duckdb.__version__} ({ext.name}) into {out}")
    con = duckdb.connect()
    con.execute(f"LOAD '{ext}'")
    con.execute(f"CALL dsdgen(sf={sf})")
    for t in TABLES:
        con.execute(f"COPY {t} TO '{tmp / (t + '.parquet')}' (FORMAT parquet)")
    con.close()
    meta = {"generator": "DuckDB tpcds extension, dsdgen", "duckdb": duckdb.__version__,
            "extension_package": f"duckdb-extension-tpcds=={DUCKDB_VERSION}", "sf": sf,
            "tables": len(TABLES), "seconds": round(time.monotonic() - t0, 1)}
    (tmp / "generator.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # the cache holds complete folders only
    log(f"generated in {meta['seconds']} s")
    return out


def data_rows(data: Path) -> int:
    """Rows of every table of a data folder (DuckDB reads the parquet footers), kept beside
    the data in rows.json."""
    f = data / "rows.json"
    if f.exists():
        return sum(json.loads(f.read_text()).values())
    ensure_duckdb()
    import duckdb
    con = duckdb.connect()
    rows = {t: con.execute(f"SELECT count(*) FROM read_parquet('{data / (t + '.parquet')}')").fetchone()[0]
            for t in TABLES}
    con.close()
    tmp = data / f".rows-{os.getpid()}.json"
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    tmp.rename(f)  # atomic: readers see the whole file or none
    return sum(rows.values())


def ensure_queries(spark_version: str, scala: str) -> Path:
    """Spark's TPC-DS query texts of `spark_version`, from its spark-sql tests jar."""
    out = CACHE / f"queries-{spark_version}"
    if out.is_dir() and len(list(out.glob("q*.sql"))) >= 99:
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".queries-{spark_version}-", dir=CACHE))
    artifact = f"org.apache.spark:spark-sql_{scala}:{spark_version}:jar:tests"
    log(f"fetching {artifact} (Maven)")
    subprocess.run(["mvn", "-q", "-B", "-Dstyle.color=never", "dependency:copy", f"-Dartifact={artifact}",
                    f"-DoutputDirectory={tmp}"], check=True, cwd=tmp, stdout=subprocess.DEVNULL)
    jar = next(tmp.glob("*.jar"))
    with zipfile.ZipFile(jar) as z:
        for name in z.namelist():
            m = re.fullmatch(r"tpcds/(q[0-9]+[ab]?\.sql)", name)
            if m:
                (tmp / m.group(1)).write_bytes(z.read(name))
    jar.unlink()
    n = len(list(tmp.glob("q*.sql")))
    if n < 99:
        raise SystemExit(f"{artifact} holds {n} tpcds/q*.sql texts, expected 103")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def query_key(name: str):
    m = re.fullmatch(r"q(\d+)([ab]?)", name)
    return (int(m.group(1)), m.group(2)) if m else (10**6, name)


def all_queries(qdir: Path) -> list:
    return sorted((p.stem for p in qdir.glob("q*.sql")), key=query_key)


# The report `heavy:K` ranks by default (a full SF 1 run of the 103 queries).
HEAVY_FROM = REPO / "docs/img/tpcds-sf1-stop35.json"


def heavy_queries(report: Path, k: int) -> list:
    """The k queries that wrote the most shuffle bytes in a bench report, leaving out those
    that returned no rows there (their comparison would be trivial)."""
    rows = json.loads(report.read_text())["queries"]

    def rows_of(q):
        r = q.get("rows")
        return max(x or 0 for m in r for x in r[m]) if isinstance(r, dict) else (r or 0)
    ranked = sorted((q for q in rows if rows_of(q) > 0), key=lambda q: -q["shuffle_bytes"])
    return sorted((q["query"] for q in ranked[:k]), key=query_key)


# ------------------------------------------------------------------------------------------------
# the application


# Results are compared exactly, except floating-point columns. Spark's decimal arithmetic is
# exact, so a decimal sum does not depend on the order its partial sums arrive in; integers,
# strings and dates are exact too. Only FLOAT and DOUBLE columns (avg over integers, stddev,
# ratios cast to double: which columns of which query is read from the result's schema, never
# from a list) may differ between runs, in their last bits, because the partial sums of an
# aggregate are merged in the order their shuffle blocks arrive.
FLOAT_TYPES = ("FloatType", "DoubleType")
UNIT_ROUNDOFF = 2.0 ** -53  # IEEE double


def column_kinds(schema) -> list:
    """'float' or 'exact' per column of a result's Spark schema."""
    return ["float" if type(f.dataType).__name__ in FLOAT_TYPES else "exact" for f in schema.fields]


def exact_text(v):
    """An exact value as text (None stays None): decimals in plain notation with their scale,
    dates and timestamps in ISO form, bytes in hex."""
    if v is None:
        return None
    if isinstance(v, Decimal):
        return format(v, "f")
    if isinstance(v, (datetime.date, datetime.datetime)):
        return v.isoformat()
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).hex()
    return str(v)


def float_value(v):
    """A floating-point value as JSON keeps it exactly: a float (Python's repr round-trips), or
    the text of a NaN or an infinity; None stays None."""
    if v is None:
        return None
    f = float(v)
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "Infinity" if f > 0 else "-Infinity"
    return f


def _sort_key(row, kinds):
    exact = tuple((0, "") if v is None else (1, v) for v, k in zip(row, kinds) if k == "exact")
    flt = tuple((0, 0.0) if v is None else ((2, 0.0) if isinstance(v, str) else (1, v))
                for v, k in zip(row, kinds) if k == "float")
    return exact + flt


def canonical(rows, kinds) -> list:
    """A result as sorted rows of exact text and floats (order-independent: rows sorted by their
    exact columns first, then by their floating-point ones)."""
    out = [[float_value(v) if k == "float" else exact_text(v) for v, k in zip(r, kinds)] for r in rows]
    out.sort(key=lambda r: _sort_key(r, kinds))
    return out


def result_digest(result) -> str:
    """A digest of the canonical result, floats by their exact repr: equal digests are equal
    results; different ones are compared value by value (compare_results)."""
    return hashlib.sha256(json.dumps(result, separators=(",", ":")).encode()).hexdigest()[:16]


def float_tolerance(rows: int) -> float:
    """The relative difference two runs' floating-point results may have. A sum of n doubles
    computed in any order is within (n - 1) u sum|x_i| of the exact sum (u = 2^-53; Higham,
    Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 4.4), so two orders differ by
    at most 2 n u sum|x_i|, which for terms of one sign is relative to the result. n is taken as
    all rows of the data set (every table): an aggregate over facts joined to their dimensions
    sums at most one term per fact row. Applied relative to the larger of the two values, with
    the column's largest magnitude as the floor (results near zero after cancellation, e.g. a
    stddev of equal values). The report gives the largest difference seen beside it."""
    return 2 * max(rows, 1) * UNIT_ROUNDOFF


def compare_results(ref: dict, other: dict, rel_tol: float) -> dict:
    """Whether two runs' results of one query agree: the same columns and kinds, the same
    number of rows, exact columns equal, floating-point columns within rel_tol (see
    float_tolerance). Returns {"equal", "why" (the first difference), "max_rel_diff" (over the
    floating-point values)}."""
    if ref.get("digest") is not None and ref.get("digest") == other.get("digest"):
        return {"equal": True, "why": None, "max_rel_diff": 0.0}
    a, b = ref.get("result"), other.get("result")
    if a is None or b is None:
        return {"equal": False, "why": "digests differ (no rows kept to compare)", "max_rel_diff": None}
    kinds = ref.get("kinds") or []
    if kinds != (other.get("kinds") or []) or ref.get("columns") != other.get("columns"):
        return {"equal": False, "max_rel_diff": None,
                "why": f"columns differ: {ref.get('columns')} {kinds} against {other.get('columns')} {other.get('kinds')}"}
    if len(a) != len(b):
        return {"equal": False, "why": f"{len(a)} rows against {len(b)}", "max_rel_diff": None}
    fcols = [i for i, k in enumerate(kinds) if k == "float"]
    scale = {i: max((abs(r[i]) for r in a if isinstance(r[i], float)), default=0.0) for i in fcols}
    worst = [0.0]

    def floats_agree(x, y) -> bool:
        for i in fcols:
            u, v = x[i], y[i]
            if isinstance(u, float) and isinstance(v, float):
                d = abs(u - v)
                if d:
                    rel = d / max(abs(u), abs(v), scale[i])
                    worst[0] = max(worst[0], rel)
                    if rel > rel_tol:
                        return False
            elif u != v:  # None, NaN or an infinity against anything else
                return False
        return True

    def exact(r):
        return [r[i] for i, k in enumerate(kinds) if k == "exact"]

    # Rows pair up in sorted order, except where rows with the same exact columns sort
    # differently by floats that differ in their last bits: those groups are matched freely.
    i = 0
    while i < len(a):
        j = i
        while j < len(a) and exact(a[j]) == exact(a[i]):
            j += 1
        ga, gb = a[i:j], b[i:j]
        if any(exact(r) != exact(ga[0]) for r in gb):
            bad = next(k for k in range(i, j) if exact(a[k]) != exact(b[k]))
            return {"equal": False, "max_rel_diff": worst[0],
                    "why": f"row {bad} of the sorted result: {a[bad]} against {b[bad]}"}
        if not all(floats_agree(x, y) for x, y in zip(ga, gb)):
            left = list(gb)
            for x in ga:
                k = next((k for k, y in enumerate(left) if floats_agree(x, y)), None)
                if k is None:
                    return {"equal": False, "max_rel_diff": worst[0],
                            "why": f"row {a.index(x)}: floating-point values beyond {rel_tol:.2g} "
                                   f"relative: {x} against the closest of {left[:3]}"}
                left.pop(k)
        i = j
    return {"equal": True, "why": None, "max_rel_diff": worst[0]}


def rest(ui: str, path: str):
    with urllib.request.urlopen(f"{ui}/api/v1{path}", timeout=60) as r:
        return json.loads(r.read())


def rest_time(v):
    """Seconds since the epoch of a REST API time ("2026-12-04T20:40:01.123GMT"), or None."""
    if not v:
        return None
    t = datetime.datetime.strptime(v.replace("GMT", ""), "%Y-%m-%dT%H:%M:%S.%f")
    return t.replace(tzinfo=datetime.timezone.utc).timestamp()


def stage_metrics(ui: str, app_id: str, names: list, windows: dict | None = None) -> dict:
    """Per query (job group): shuffle bytes and what failed/reran, from the REST API of the
    application's own UI. Waits until the status store has seen every job end (its listener
    runs behind the jobs).

    A query's broadcast exchanges run their jobs under a job group of their own (the
    exchange's run id, so that a timeout can cancel them), and such a job reads shuffle blocks
    when AQE turned a join into a broadcast after its shuffle stage ran. Those jobs belong to
    the query whose time window (`windows`: group -> (start, end), epoch seconds, while the
    queries run one after another) holds their submission."""
    deadline = time.monotonic() + 120
    while True:
        jobs = rest(ui, f"/applications/{app_id}/jobs")
        if all(j["status"] != "RUNNING" for j in jobs) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    stages = rest(ui, f"/applications/{app_id}/stages")
    for j in jobs:
        if j.get("jobGroup") not in names and windows:
            t = rest_time(j.get("submissionTime"))
            j["jobGroup"] = next((g for g, (a, b) in windows.items()
                                  if t is not None and a - 0.05 <= t <= b + 0.05), j.get("jobGroup"))
    group_of = {}
    for j in sorted(jobs, key=lambda j: j["jobId"]):
        for s in j.get("stageIds", []):
            group_of.setdefault(s, j.get("jobGroup"))
    out = {n: {"shuffle_write_bytes": 0, "shuffle_read_bytes": 0, "shuffle_remote_bytes": 0,
               "shuffle_remote_blocks": 0, "shuffle_local_blocks": 0, "fetch_wait_ms": 0,
               "stages": 0, "stage_attempts": 0, "rerun_stages": [], "fetch_failed": False,
               "failed_tasks": 0, "jobs": 0, "jobs_span_s": 0.0, "stage_detail": []}
           for n in names}
    # The time a query's jobs ran (first submission to last completion): the rest of its wall
    # time is the driver's (parsing, planning, AQE re-planning between jobs, collecting rows).
    spans = {}
    for j in jobs:
        t0, t1 = rest_time(j.get("submissionTime")), rest_time(j.get("completionTime"))
        if j.get("jobGroup") in out and t0 is not None and t1 is not None:
            out[j["jobGroup"]]["jobs"] += 1
            a, b = spans.get(j["jobGroup"], (t0, t1))
            spans[j["jobGroup"]] = (min(a, t0), max(b, t1))
    for n, (a, b) in spans.items():
        out[n]["jobs_span_s"] = round(b - a, 3)
    for s in stages:
        q = out.get(group_of.get(s["stageId"]))
        if q is None or s["status"] in ("SKIPPED", "PENDING"):
            continue
        # Per stage, where its time went: the stage's span on the driver against the tasks'
        # run and CPU time on the executors, and how long tasks waited for shuffle blocks.
        t0, t1 = rest_time(s.get("submissionTime")), rest_time(s.get("completionTime"))
        q["stage_detail"].append({
            "stage": s["stageId"], "attempt": s["attemptId"], "tasks": s.get("numTasks", 0),
            "span_ms": round((t1 - t0) * 1000) if t0 is not None and t1 is not None else None,
            "run_ms": s.get("executorRunTime", 0),
            "cpu_ms": round(s.get("executorCpuTime", 0) / 1e6),
            "deser_ms": s.get("executorDeserializeTime", 0),
            "gc_ms": s.get("jvmGcTime", 0),
            "fetch_wait_ms": s.get("shuffleFetchWaitTime", 0),
            "write_ms": round(s.get("shuffleWriteTime", 0) / 1e6),
            "read_bytes": s.get("shuffleReadBytes", 0),
            "remote_blocks": s.get("shuffleRemoteBlocksFetched", 0),
            "local_blocks": s.get("shuffleLocalBlocksFetched", 0),
            "write_bytes": s.get("shuffleWriteBytes", 0),
            "remote_bytes": s.get("shuffleRemoteBytesRead", 0),
            "local_bytes": s.get("shuffleLocalBytesRead", 0),
            "input_bytes": s.get("inputBytes", 0),
            "spill_bytes": s.get("diskBytesSpilled", 0),
            "result_ser_ms": s.get("resultSerializationTime", 0),
            "name": (s.get("name") or "")[:60],
        })
        q["stage_attempts"] += 1
        if s["attemptId"] == 0:
            q["stages"] += 1
        else:
            q["rerun_stages"].append(s["stageId"])
        q["shuffle_write_bytes"] += s.get("shuffleWriteBytes", 0)
        q["shuffle_read_bytes"] += s.get("shuffleReadBytes", 0)
        q["shuffle_remote_bytes"] += s.get("shuffleRemoteBytesRead", 0)
        q["shuffle_remote_blocks"] += s.get("shuffleRemoteBlocksFetched", 0)
        q["shuffle_local_blocks"] += s.get("shuffleLocalBlocksFetched", 0)
        q["fetch_wait_ms"] += s.get("shuffleFetchWaitTime", 0)
        q["failed_tasks"] += s.get("numFailedTasks", 0)
        if "FetchFailed" in (s.get("failureReason") or ""):
            q["fetch_failed"] = True
    for q in out.values():
        q["rerun_stages"] = sorted(set(q["rerun_stages"]))
    return out


def cmd_app(a) -> int:
    from pyspark.sql import SparkSession
    spark = (SparkSession.builder.appName(f"tpcds-{a.label}")
             .config("spark.ui.enabled", "true")
             .config("spark.ui.retainedJobs", "100000")
             .config("spark.ui.retainedStages", "100000")
             .config("spark.sql.ui.retainedExecutions", "200")
             .config("spark.ui.showConsoleProgress", "false")
             # TPC-DS's semantics, not ANSI's: at small scales q90's divisor is 0 (ANSI, Spark
             # 4's default, raises DIVIDE_BY_ZERO; TPC-DS expects NULL), seen at SF 0.1.
             .config("spark.sql.ansi.enabled", "false")
             .getOrCreate())
    sc = spark.sparkContext
    t_wait = time.monotonic()
    while len(sc._jsc.sc().statusTracker().getExecutorInfos()) - 1 < a.executors:
        if time.monotonic() - t_wait > 300:
            raise SystemExit(f"only {len(sc._jsc.sc().statusTracker().getExecutorInfos()) - 1} of "
                             f"{a.executors} executors registered within 300 s")
        time.sleep(0.2)
    for t in TABLES:
        df = spark.read.parquet(str(Path(a.data) / f"{t}.parquet"))
        if t == "customer":
            # Spark's q30 names the TPC-DS v1.4 column; the generator has the v2+ name.
            df = df.withColumn("c_last_review_date", df["c_last_review_date_sk"])
        df.createOrReplaceTempView(t)
    names = a.list.split(",")
    results = []
    retried = {}
    windows = {}
    for n in names:
        text = (Path(a.queries) / f"{n}.sql").read_text()
        group = n
        for attempt in (1, 2):
            sc.setJobGroup(group, f"TPC-DS {n}")
            t0, start = time.monotonic(), time.time()
            try:
                df = spark.sql(text)
                rows = df.collect()
                wall = time.monotonic() - t0
                kinds = column_kinds(df.schema)
                result = canonical(rows, kinds)
                r = {"query": n, "wall_s": round(wall, 3), "rows": len(rows), "columns": df.columns,
                     "types": [f.dataType.simpleString() for f in df.schema.fields], "kinds": kinds,
                     "float_columns": [c for c, k in zip(df.columns, kinds) if k == "float"],
                     "digest": result_digest(result), "result": result}
            except Exception as e:  # a failed query is a result (under executor loss, too)
                wall = time.monotonic() - t0
                r = {"query": n, "wall_s": round(wall, 3), "rows": None, "digest": None,
                     "error": f"{type(e).__name__}: {str(e)[:500]}"}
            windows[group] = (start, time.time())
            # Spark's own execution-memory limit (a task's sort or hash table could not get
            # its page; seen on q10 at SF 1 under both shuffles, in either round) is not the
            # shuffle's doing: the query runs once more, under a job group of its own, and the
            # report keeps the failed attempt. Any other error stands.
            if attempt == 1 and "UNABLE_TO_ACQUIRE_MEMORY" in r.get("error", ""):
                retried[n] = group = f"{n}~retry"
                failed = {"wall_s": r["wall_s"], "error": r["error"]}
                continue
            break
        if n in retried:
            r["failed_attempt"] = failed
        results.append(r)
        print(f"DIGEST job={n} rows={r['rows']} digest={r['digest']} wall_s={r['wall_s']}", flush=True)
    sc.setJobGroup("tpcds-end", "metrics")
    metrics = stage_metrics(sc.uiWebUrl, sc.applicationId, names + list(retried.values()), windows)
    for r in results:
        r.update(metrics[retried.get(r["query"], r["query"])])
    # The whole application's remote reads (every stage, whichever job group): what the
    # engines' counters, which are per application, must equal.
    app_stages = [st for st in rest(sc.uiWebUrl, f"/applications/{sc.applicationId}/stages")
                  if st["status"] not in ("SKIPPED", "PENDING")]
    report = {"label": a.label, "app_id": sc.applicationId, "spark_version": spark.version,
              "app_shuffle": {"remote_bytes": sum(st.get("shuffleRemoteBytesRead", 0) for st in app_stages),
                              "remote_blocks": sum(st.get("shuffleRemoteBlocksFetched", 0) for st in app_stages)},
              "conf": {k: v for k, v in sc.getConf().getAll()
                       if k.startswith(("spark.shuffle.", "spark.master", "spark.executor.memory",
                                        "spark.driver.memory", "spark.sql.adaptive"))},
              "queries": results}
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    spark.stop()
    return 0


# ------------------------------------------------------------------------------------------------
# running the application


# Settings of every local-cluster run, the same for both shuffles. All executors of local-cluster
# are on 127.0.0.1: with readHostLocalDisk Spark would read the other executor's blocks from its
# files and no block would cross the transport, unlike on separate hosts.
LOCAL_CONF = {"spark.shuffle.readHostLocalDisk": "false"}


def plugin_args(env: dict) -> list:
    """spark-submit arguments installing the plugin (the one definition in spark-env.sh)."""
    out = subprocess.run(
        ["bash", "-c", f". '{REPO}/scripts/spark-env.sh' >&2 && rdma_plugin_submit_args \"$1\"", "_",
         env["RDMA_PLUGIN_JAR"]], check=True, capture_output=True, text=True, env=env).stdout
    return out.splitlines()


def submit_local(mode: str, data: Path, qdir: Path, names: list, out: Path, logs: Path,
                 master: str = "local-cluster[2,1,3072]", driver_memory: str = "3g",
                 executors: int = 2, conf: dict | None = None, timeout: int = 3600,
                 env: dict | None = None) -> dict:
    """One application of `names` on local-cluster in `mode` (default | plugin), in `env` (that
    of scripts/spark-env.sh; default: this process's). Returns the app's report with the
    engines' counters, whether the native library loaded, and the submit wall time."""
    env = dict(env or os.environ)
    cmd = [f"{env['SPARK_HOME']}/bin/spark-submit", "--master", master,
           "--driver-memory", driver_memory]
    for k, v in {**LOCAL_CONF, **(conf or {})}.items():
        cmd += ["--conf", f"{k}={v}"]
    if mode == "plugin":
        cmd += plugin_args(env)
    cmd += [str(Path(__file__).resolve()), "app", "--data", str(data), "--queries", str(qdir),
            "--list", ",".join(names), "--out", str(out), "--executors", str(executors),
            "--label", mode]
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(logs / f"{out.stem}.stdout", "w") as so, open(logs / f"{out.stem}.stderr", "w") as se:
        p = subprocess.run(cmd, stdout=so, stderr=se, env=env, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    stderr = (logs / f"{out.stem}.stderr").read_text(errors="replace")
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"{mode} application failed (rc={p.returncode}); log "
                           f"{logs / (out.stem + '.stderr')}:\n{stderr[-3000:]}")
    rep = json.loads(out.read_text())
    rep["engine"] = engine_totals(stderr)
    rep["submit_s"] = round(wall, 1)
    rep["native_loaded"] = _executors_loaded(env, rep["app_id"])
    return rep


def _executors_loaded(env: dict, app_id: str) -> bool:
    """Whether every executor of local-cluster app `app_id` loaded the native library (its
    RdmaShuffleManager says `native=loaded` in the executor's log)."""
    logs = list(Path(env["SPARK_HOME"], "work", app_id).glob("*/stderr"))
    return bool(logs) and all("native=loaded" in f.read_text(errors="replace") for f in logs)


class Killer(threading.Thread):
    """Kills one executor (kill -9, by PID, through scripts/cluster.sh) every `every` seconds,
    the workers in turn, until stopped. The worker starts a new executor each time."""

    def __init__(self, every: float, workers: int, logf: Path):
        super().__init__(daemon=True)
        self.every, self.workers, self.logf = every, workers, logf
        self.stop = threading.Event()
        self.kills = []

    def run(self):
        i = 0
        while not self.stop.wait(self.every):
            host = f"w{i % self.workers + 1}"
            i += 1
            p = subprocess.run(["bash", str(REPO / "scripts/cluster.sh"), "kill-executor", host],
                               capture_output=True, text=True)
            self.kills.append({"t": time.time(), "host": host, "rc": p.returncode,
                               "out": (p.stdout + p.stderr).strip()[-200:]})
            with open(self.logf, "a") as f:
                f.write(json.dumps(self.kills[-1]) + "\n")


def submit_cluster(mode: str, data: Path, qdir: Path, names: list, out: Path, logs: Path,
                   workers: int, kill_every: float = 0, timeout: int = 7200) -> dict:
    """One application on the namespace cluster of scripts/cluster.sh (up already), the
    plugin installed through the driver's spark-defaults.conf (`cluster.sh run --plugin`)."""
    run_dir = logs / out.stem
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "CLUSTER_RUN_DIR": str(run_dir), "CLUSTER_RUN_TIMEOUT": str(timeout)}
    cmd = ["bash", str(REPO / "scripts/cluster.sh"), "run", f"--{mode}",
           "--conf", "spark.shuffle.readHostLocalDisk=false",
           str(Path(__file__).resolve()), "app", "--data", str(data), "--queries", str(qdir),
           "--list", ",".join(names), "--out", str(out), "--executors", str(workers),
           "--label", mode]
    killer = Killer(kill_every, workers, logs / f"{out.stem}.kills.jsonl") if kill_every else None
    t0 = time.monotonic()
    if killer:
        killer.start()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    finally:
        if killer:
            killer.stop.set()
            killer.join()
    wall = time.monotonic() - t0
    (logs / f"{out.stem}.cluster.log").write_text(p.stdout + p.stderr)
    if not out.exists():
        err = (run_dir / "driver.err").read_text(errors="replace") if (run_dir / "driver.err").exists() else ""
        raise RuntimeError(f"{mode} cluster application failed (rc={p.returncode}); "
                           f"{run_dir}/driver.err:\n{err[-3000:]}\n{p.stdout[-1500:]}{p.stderr[-1500:]}")
    rep = json.loads(out.read_text())
    stderr = (run_dir / "driver.err").read_text(errors="replace")
    rep["engine"] = engine_totals(stderr)
    rep["submit_s"] = round(wall, 1)
    rep["native_loaded"] = any("native=loaded" in f.read_text(errors="replace")
                               for f in (run_dir / "executors").glob("*.stderr"))
    if killer:
        rep["kills"] = killer.kills
    return rep


# ------------------------------------------------------------------------------------------------
# the benchmark


def spread(xs):
    return {"min": round(min(xs), 3), "max": round(max(xs), 3)}


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def time_shares(runs: dict) -> dict:
    """Per shuffle, per round: where the queries' time went, summed over every query. The
    tasks' run time against the parts of it a shuffle manager's transport and writer account
    for (tasks waiting for blocks, writing shuffle files), and the driver's time outside the
    jobs. `transport_bound` = (fetch wait + shuffle write) / task time: the share of task time
    that even a shuffle costing nothing would save, an upper bound on its gain."""
    out = {}
    for m, rs in runs.items():
        rows = []
        for r in rs:
            st = [s for q in r["queries"] for s in q.get("stage_detail", [])]
            task = sum(s["run_ms"] for s in st) / 1000
            fetch = sum(s["fetch_wait_ms"] for s in st) / 1000
            write = sum(s["write_ms"] for s in st) / 1000
            wall = sum(q["wall_s"] for q in r["queries"])
            driver = sum(q["wall_s"] - q.get("jobs_span_s", 0.0) for q in r["queries"])
            rows.append({"wall_s": round(wall, 1), "task_s": round(task, 1), "fetch_wait_s": round(fetch, 2),
                         "shuffle_write_s": round(write, 2), "driver_s": round(driver, 1),
                         "transport_bound": round((fetch + write) / task, 4) if task else None})
        out[m] = rows
    return out


# Where a query's time went, per run: its wall time, the driver's part of it, and the tasks'
# metrics summed over every stage (Spark's REST API, per stage, `stage_detail`). Task times
# are summed over tasks, which run on several executors at once.
TERMS = (
    # key, what, unit
    ("wall_s", "query wall time (collect)", "s"),
    ("driver_s", "driver outside the jobs (planning, AQE, result)", "s"),
    ("run_s", "executor run time", "s"),
    ("cpu_s", "executor CPU time", "s"),
    ("gc_s", "JVM GC time", "s"),
    ("deser_s", "task deserialisation", "s"),
    ("write_s", "shuffle write time", "s"),
    ("fetch_wait_s", "shuffle fetch wait", "s"),
    ("off_cpu_s", "run time off the CPU otherwise (run - CPU - GC - fetch wait)", "s"),
    ("remote_mib", "shuffle bytes read remotely", "MiB"),
    ("local_mib", "shuffle bytes read locally", "MiB"),
    ("spill_mib", "bytes spilled to disk", "MiB"),
)


def query_terms(q: dict) -> dict:
    """TERMS of one query in one run."""
    st = q.get("stage_detail", [])
    tot = {k: sum(x.get(k, 0) or 0 for x in st) for k in
           ("run_ms", "cpu_ms", "gc_ms", "deser_ms", "write_ms", "fetch_wait_ms", "remote_bytes",
            "local_bytes", "spill_bytes")}
    out = {"wall_s": q["wall_s"], "driver_s": q["wall_s"] - q.get("jobs_span_s", 0.0),
           "run_s": tot["run_ms"] / 1e3, "cpu_s": tot["cpu_ms"] / 1e3, "gc_s": tot["gc_ms"] / 1e3,
           "deser_s": tot["deser_ms"] / 1e3, "write_s": tot["write_ms"] / 1e3,
           "fetch_wait_s": tot["fetch_wait_ms"] / 1e3,
           "remote_mib": tot["remote_bytes"] / 2**20, "local_mib": tot["local_bytes"] / 2**20,
           "spill_mib": tot["spill_bytes"] / 2**20}
    out["off_cpu_s"] = out["run_s"] - out["cpu_s"] - out["gc_s"] - out["fetch_wait_s"]
    return {k: round(v, 4) for k, v in out.items()}


# Two-sided 97.5 % quantiles of Student's t by degrees of freedom (1..30); beyond, the normal's.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)


def t975(df: float) -> float:
    if df < 1:
        return float("inf")
    return T975[int(df) - 1] if df < 31 else 1.96


def mean_interval(xs: list, first: list) -> dict | None:
    """A 95 % interval of the mean of per-round values xs (e.g. log ratios, differences), where
    first[i] says which shuffle ran first in round i. With both orders seen at least twice, the
    mean is the average of the two orders' means and its variance comes from within each order
    (Welch), so the order effect cancels instead of widening the interval; otherwise a plain
    t-interval over the rounds. None with fewer than 2 rounds."""
    n = len(xs)
    if n < 2:
        return None
    g = [[x for x, f in zip(xs, first) if f == o] for o in sorted(set(first))]
    if len(g) == 2 and min(len(g[0]), len(g[1])) >= 2:
        m = [statistics.fmean(x) for x in g]
        v = [statistics.variance(x) / len(x) for x in g]
        mean, se2 = (m[0] + m[1]) / 2, (v[0] + v[1]) / 4
        df = (v[0] + v[1]) ** 2 / sum(vi ** 2 / (len(x) - 1) for vi, x in zip(v, g)) if any(v) else n - 2
        how = "Welch over the two orders"
    else:
        mean, se2, df, how = statistics.fmean(xs), statistics.variance(xs) / n, n - 1, "t over rounds"
    h = t975(df) * math.sqrt(se2)
    return {"mean": mean, "lo": mean - h, "hi": mean + h, "df": round(df, 1), "method": how}


def ratio_interval(d: list, p: list, first: list) -> dict | None:
    """A 95 % interval of one query's plugin/default time ratio from its per-round times: the
    interval of the mean log ratio (mean_interval), exponentiated."""
    logs = [math.log(b / a) for a, b in zip(d, p) if a > 0 and b > 0]
    if len(logs) != len(d):
        return None
    iv = mean_interval(logs, first)
    if iv is None:
        return None
    return {"ratio": round(math.exp(iv["mean"]), 4), "lo": round(math.exp(iv["lo"]), 4),
            "hi": round(math.exp(iv["hi"]), 4), "method": iv["method"]}


def bootstrap_sum_ratio(d: list, p: list, first: list, resamples: int = 4000, seed: int = 42,
                        over_queries: bool = True) -> dict:
    """The sum ratio (all plugin query times over all default ones, every round) with a 95 %
    percentile-bootstrap interval. d[r][q], p[r][q]: round r's time of query q; rounds are
    resampled as pairs (a round's two applications together) within their order (which shuffle
    ran first), so every resample keeps the order balance; with over_queries, the queries are
    resampled too (the interval then covers which queries the set happens to hold)."""
    rounds, nq = len(d), len(d[0])
    rng = random.Random(seed)
    strata = [[r for r in range(rounds) if first[r] == o] for o in sorted(set(first))]
    point = sum(map(sum, p)) / sum(map(sum, d))
    stats = []
    for _ in range(resamples):
        rs = [rng.choice(s) for s in strata for _ in s]
        dcol = [sum(d[r][q] for r in rs) for q in range(nq)]
        pcol = [sum(p[r][q] for r in rs) for q in range(nq)]
        if over_queries:
            qs = [rng.randrange(nq) for _ in range(nq)]
            stats.append(sum(pcol[q] for q in qs) / sum(dcol[q] for q in qs))
        else:
            stats.append(sum(pcol) / sum(dcol))
    stats.sort()
    return {"ratio": round(point, 4), "lo": round(stats[int(0.025 * resamples)], 4),
            "hi": round(stats[min(int(0.975 * resamples), resamples - 1)], 4),
            "resamples": resamples, "over": "rounds and queries" if over_queries else "rounds"}


def compare(runs: dict, names: list, reference: dict | None = None, float_tol: float | None = None) -> dict:
    """The report over every round's application of each mode. `runs[mode][i]`: round i+1's
    application (its query records, in order). `reference`: query -> the record of a
    fault-free default run that every result must equal (the executor-loss run); otherwise the
    first successful default result is the reference. `float_tol`: see float_tolerance."""
    tol = float_tol if float_tol is not None else float_tolerance(10**8)
    rounds = min(len(runs["default"]), len(runs["plugin"]))
    # Which shuffle ran first in each round: default in odd rounds (see cmd_bench).
    first = [r % 2 for r in range(rounds)]
    rows = []
    for n in names:
        per = {m: [next(q for q in r["queries"] if q["query"] == n) for r in runs[m]] for m in runs}
        # A run that failed (a Spark error: out of memory, a job aborted) has no result to
        # compare: it is counted in `failed_runs`, apart from results that differ.
        ok = {m: [q for q in per[m] if not q.get("error")] for m in per}
        ref = reference.get(n) if reference is not None else None
        if ref is None:
            ref = next(iter(ok["default"] + ok["plugin"]), None)
        checks = [compare_results(ref, q, tol) for m in ok for q in ok[m] if q is not ref] if ref else []
        bad = [c for c in checks if not c["equal"]]
        diffs = [c["max_rel_diff"] for c in checks if c["max_rel_diff"] is not None]
        d = [q["wall_s"] for q in per["default"]]
        p = [q["wall_s"] for q in per["plugin"]]
        ratios = [b / a for a, b in zip(d, p) if a > 0]
        first_rec = per["default"][0]
        fa = {m: sum(1 for q in per[m] if q.get("failed_attempt")) for m in per}
        iv = ratio_interval(d[:rounds], p[:rounds], first)
        row = {
            "query": n,
            "default_s": round(statistics.median(d), 3),
            "plugin_s": round(statistics.median(p), 3),
            "default_runs_s": d, "plugin_runs_s": p,
            "ratio": round(statistics.median(p) / statistics.median(d), 3),
            "ratio_per_round": [round(x, 3) for x in ratios],
            "ratio_spread": spread(ratios) if ratios else None,
            # 95 % interval of the ratio over rounds (None below 2 rounds).
            "ratio_ci95": iv,
            # Every successful result of both shuffles equals the reference (exactly, floating-point
            # columns within float_tolerance), and each shuffle has at least one.
            "equal": ref is not None and not bad and all(ok.values()),
            "differ": bool(bad),
            "why": bad[0]["why"] if bad else None,
            # The rows each run returned, per shuffle: an empty result compares equal trivially.
            "rows": {m: [q.get("rows") for q in per[m]] for m in per},
            "float_columns": (ref or {}).get("float_columns", []),
            "max_float_rel_diff": max(diffs) if diffs else None,
            "failed_runs": {m: sum(1 for q in per[m] if q.get("error")) for m in per},
            # Runs whose first attempt failed on Spark's execution-memory limit and were run
            # once more (their time is the second attempt's). Fine when both shuffles had one
            # (Spark's own limit); under one shuffle only it is a failure of that shuffle's run.
            "retried": fa,
            "one_sided_retry": (fa["default"] > 0) != (fa["plugin"] > 0),
            "shuffle_bytes": first_rec.get("shuffle_write_bytes", 0),
            "shuffle_read_bytes": first_rec.get("shuffle_read_bytes", 0),
            "remote_bytes": {m: [q.get("shuffle_remote_bytes", 0) for q in per[m]] for m in per},
            "remote_blocks": {m: [q.get("shuffle_remote_blocks", 0) for q in per[m]] for m in per},
            "fetch_wait_ms": {m: [q.get("fetch_wait_ms", 0) for q in per[m]] for m in per},
            # The tasks' run time (all stages, summed over tasks): with the fetch wait and the
            # driver's time, where a slower run's time went.
            "task_s": {m: [round(sum(st["run_ms"] for st in q.get("stage_detail", [])) / 1000, 3) for q in per[m]]
                       for m in per},
            # Every TERM per shuffle and round (the time table: `tpcds.py table`).
            "terms": {m: [query_terms(q) for q in per[m]] for m in per},
            "stages": first_rec.get("stages", 0),
            # Wall time outside the query's jobs: the driver's planning and row collection.
            "driver_s": {m: [round(q["wall_s"] - q.get("jobs_span_s", 0.0), 3) for q in per[m]] for m in per},
            "errors": [q["error"] for m in per for q in per[m] if q.get("error")],
        }
        if reference is not None or any(q.get("rerun_stages") or q.get("fetch_failed") for m in per for q in per[m]):
            row["fetch_failed"] = {m: [q.get("fetch_failed", False) for q in per[m]] for m in per}
            row["rerun_stages"] = {m: [len(q.get("rerun_stages", [])) for q in per[m]] for m in per}
        # Slower beyond its own interval: the interval's lower end above 1.10 (with a single
        # round, which has no interval: above 1.10 in that round).
        row["slow"] = (iv["lo"] > 1.10) if iv else (bool(ratios) and min(ratios) > 1.10)
        rows.append(row)
    sums = {m: [sum(q["wall_s"] for q in r["queries"]) for r in runs[m]] for m in runs}
    sum_ratios = [b / a for a, b in zip(sums["default"], sums["plugin"])]
    ratios = [r["ratio"] for r in rows if r["ratio"] > 0]
    dm = [[r["default_runs_s"][i] for r in rows] for i in range(rounds)]
    pm = [[r["plugin_runs_s"][i] for r in rows] for i in range(rounds)]
    return {
        "queries": rows,
        "equal": sum(r["equal"] for r in rows),
        "total": len(rows),
        "float_tolerance": tol,
        "default_sum_s": round(statistics.median(sums["default"]), 2),
        "plugin_sum_s": round(statistics.median(sums["plugin"]), 2),
        # All plugin query times over all default ones, every round (the bootstrap's estimate).
        "sum_ratio": round(sum(sums["plugin"][:rounds]) / sum(sums["default"][:rounds]), 3),
        "sum_ratio_ci95": bootstrap_sum_ratio(dm, pm, first),
        "sum_ratio_ci95_rounds_only": bootstrap_sum_ratio(dm, pm, first, over_queries=False),
        "sum_ratio_of_medians": round(sum(r["plugin_s"] for r in rows) / sum(r["default_s"] for r in rows), 3),
        "sum_ratio_per_round": [round(x, 3) for x in sum_ratios],
        "sum_ratio_spread": spread(sum_ratios),
        "sums_per_round_s": {m: [round(x, 1) for x in sums[m]] for m in sums},
        "geomean_ratio": round(geomean(ratios), 3),
        "slow_queries": [r["query"] for r in rows if r["slow"]],
        "empty_queries": [r["query"] for r in rows if not any(x for m in r["rows"] for x in r["rows"][m])],
        "float_columns": {r["query"]: r["float_columns"] for r in rows if r["float_columns"]},
        "max_float_rel_diff": max((r["max_float_rel_diff"] or 0 for r in rows), default=0),
        "time_shares": time_shares(runs),
        "retried": {r["query"]: r["retried"] for r in rows if any(r["retried"].values())},
        "one_sided_retries": [r["query"] for r in rows if r["one_sided_retry"]],
    }


def check_problems(rep: dict) -> list:
    """What makes a comparison fail: results that differ, a query without a successful result
    under a shuffle, and a query whose first attempt failed under one shuffle only."""
    problems = []
    differ = [(q["query"], q["why"]) for q in rep["queries"] if q["differ"]]
    if differ:
        problems.append(f"results differ: {differ}")
    no_result = [q["query"] for q in rep["queries"] if not q["equal"] and not q["differ"]]
    if no_result:
        problems.append(f"no successful result under a shuffle to compare: {no_result}")
    if rep["one_sided_retries"]:
        problems.append("a first attempt failed under one shuffle only (UNABLE_TO_ACQUIRE_MEMORY, "
                        "run again): " + str({q: rep["retried"][q] for q in rep["one_sided_retries"]}))
    return problems


def cmd_bench(a) -> int:
    spark_version, scala = os.environ["SPARK_VERSION"], os.environ["SCALA_BINARY"]
    data = ensure_data(a.sf)
    qdir = ensure_queries(spark_version, scala)
    names = (heavy_queries(Path(a.queries.split(":", 2)[2] if a.queries.count(":") == 2 else HEAVY_FROM),
                           int(a.queries.split(":")[1])) if a.queries.startswith("heavy:")
             else a.queries.split(",") if a.queries else all_queries(qdir))
    missing = [n for n in names if not (qdir / f"{n}.sql").exists()]
    if missing:
        raise SystemExit(f"no query text for {missing} in {qdir}")
    out_dir = REPO / "target/bench"
    tag = a.tag or ("tpcds" + (f"-cluster{a.cluster}" if a.cluster else "") + ("-kill" if a.kill_every else ""))
    logs = out_dir / f"{tag}-logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    generator = json.loads((data / "generator.json").read_text())
    rows_total = data_rows(data)
    where = f"namespace cluster, {a.cluster} workers" if a.cluster else "local-cluster[2,1,3072]"
    log(f"{len(names)} queries, SF {a.sf:g}, {a.rounds} round(s), {where}, Spark {spark_version}"
        + (f", an executor killed every {a.kill_every:g} s" if a.kill_every else ""))

    def submit(mode, rnd, kill=0.0):
        out = logs / f"round{rnd}-{mode}{'-kill' if kill else ''}.json"
        if a.cluster:
            r = submit_cluster(mode, data, qdir, names, out, logs, a.cluster, kill)
        else:
            r = submit_local(mode, data, qdir, names, out, logs)
        r["load"] = [round(x, 1) for x in os.getloadavg()]
        tot = sum(q["wall_s"] for q in r["queries"])
        errs = sum(1 for q in r["queries"] if q.get("error"))
        log(f"round {rnd} {mode:7s}: queries {tot:7.1f} s (application {r['submit_s']} s)"
            + (f", {errs} failed" if errs else "") + (f", {len(r.get('kills', []))} kills" if kill else ""))
        return r

    runs = {"default": [], "plugin": []}
    reference, ref = None, None
    json_out = out_dir / f"{tag}.json"

    def report(rounds_done):
        rep = compare(runs, names, reference, float_tolerance(rows_total))
        problems = []
        for i, r in enumerate(runs["plugin"], 1):
            eng = r["engine"]
            fetched = sum(int(v.get("blocks_fetched", 0)) for v in eng.values())
            if not r["native_loaded"] or fetched == 0:
                problems.append(f"plugin round {i}: the engines fetched no block (native loaded: "
                                f"{r['native_loaded']}, executors reporting: {sorted(eng)})")
        problems += check_problems(rep)
        # Runs that failed while another run of the same shuffle succeeded with the common
        # result: Spark errors of that run (the bench's memory, a kill), not a wrong result.
        partly = {q["query"]: q["failed_runs"] for q in rep["queries"]
                  if q["equal"] and any(q["failed_runs"].values())}
        rep["failed_runs"] = partly
        rep.update({
            "workload": {"benchmark": "TPC-DS, Spark's own query texts", "sf": a.sf,
                         "generator": generator, "spark_version": spark_version,
                         "queries_source": f"spark-sql_{scala}:{spark_version}:tests tpcds/*.sql",
                         "where": where, "rounds": rounds_done, "rounds_asked": a.rounds,
                         "order": "default first in odd rounds, plugin first in even rounds",
                         "conf": {"spark.shuffle.readHostLocalDisk": "false"},
                         "data_rows": rows_total,
                         "times": "per query wall time of collect() inside one application per "
                                  "shuffle and round; per query: medians over rounds and a 95 % "
                                  "interval of the mean log ratio; the sum: all rounds, with a 95 % "
                                  "bootstrap interval over rounds (within their order) and queries",
                         "comparison": "exact for every column but FLOAT/DOUBLE ones (from the "
                                       "result's schema), those within float_tolerance relative"},
            "engine": [r["engine"] for r in runs["plugin"]],
            "submit_s": {m: [r["submit_s"] for r in runs[m]] for m in runs},
            "load_avg": {m: [r["load"] for r in runs[m]] for m in runs},
            "problems": problems,
            "logs": str(logs),
        })
        if a.kill_every:
            rep["kill_every_s"] = a.kill_every
            rep["faults"] = {m: {
                "kills": [len(r.get("kills", [])) for r in runs[m]],
                "queries_with_fetch_failed": [sum(q["fetch_failed"] for q in r["queries"]) for r in runs[m]],
                "rerun_stages": [sum(len(q["rerun_stages"]) for q in r["queries"]) for r in runs[m]],
                "failed_queries": [[q["query"] for q in r["queries"] if q.get("error")] for r in runs[m]],
                "total_s": [round(sum(q["wall_s"] for q in r["queries"]), 1) for r in runs[m]],
            } for m in runs}
            rep["reference_default_s"] = round(sum(q["wall_s"] for q in ref["queries"]), 1)
        # Written after every round: a long run stopped early still leaves its report.
        json_out.write_text(json.dumps(rep, indent=1) + "\n")
        return rep

    if a.kill_every:
        # The fault-free default run every faulted result must equal, then both shuffles under
        # executor loss.
        ref = submit("default", 0)
        reference = {q["query"]: q for q in ref["queries"] if not q.get("error")}
    for rnd in range(1, a.rounds + 1):
        # Odd rounds default first, even rounds plugin first: neither always runs second.
        for mode in (("default", "plugin") if rnd % 2 else ("plugin", "default")):
            runs[mode].append(submit(mode, rnd, a.kill_every))
        rep = report(rnd)
        ci = rep["sum_ratio_ci95"]
        log(f"round {rnd}: {rep['equal']}/{rep['total']} equal, sum ratio {rep['sum_ratio']} "
            f"[{ci['lo']}, {ci['hi']}], geomean {rep['geomean_ratio']}; report {json_out}")
    problems = rep["problems"]
    print_table(rep)
    table = out_dir / f"{tag}-time.md"
    table.write_text(time_table(rep))
    print(f"\nreport: {json_out}   time table: {table}   logs: {logs}")
    if problems:
        print("PROBLEMS:\n  " + "\n  ".join(problems))
        return 1
    return 0


def cmd_stages(a) -> int:
    """Per stage, side by side, for the queries named: each round's application of both
    shuffles from a run's logs directory (written by `bench`)."""
    runs = {}
    for f in sorted(Path(a.logs).glob("round*-*.json")):
        r = json.loads(f.read_text())
        runs[f.stem] = {q["query"]: q for q in r["queries"]}
    cols = ("tasks", "span_ms", "run_ms", "cpu_ms", "deser_ms", "gc_ms", "fetch_wait_ms", "remote_blocks", "read_bytes")
    for n in a.queries.split(","):
        print(f"\n== {n}")
        for run, qs in runs.items():
            q = qs.get(n)
            if q is None:
                continue
            print(f"  {run:22s} wall {q['wall_s']:7.3f} s  jobs {q.get('jobs', 0):2d} spanning "
                  f"{q.get('jobs_span_s', 0):7.3f} s  driver {q['wall_s'] - q.get('jobs_span_s', 0):6.3f} s")
            for st in q.get("stage_detail", []):
                print("    stage %4d.%d " % (st["stage"], st["attempt"])
                      + " ".join(f"{c}={st.get(c)}" for c in cols))
    return 0


def mib(b) -> str:
    return f"{b / 1048576:.1f}"


def fmt_ci(iv) -> str:
    return f"[{iv['lo']:.2f}, {iv['hi']:.2f}]" if iv else "-"


def print_table(rep: dict) -> None:
    rows = rep["queries"]
    print(f"\n{'query':6s} {'default s':>9s} {'plugin s':>9s} {'ratio':>6s} {'95 % interval':>13s} "
          f"{'per round':>14s} {'rows d/p':>11s} {'shuffle MiB':>11s} {'equal':>5s}")
    for r in sorted(rows, key=lambda r: -r["ratio"]):
        pr = "/".join(f"{x:.2f}" for x in r["ratio_per_round"][:4]) + ("/..." if len(r["ratio_per_round"]) > 4 else "")
        nrows = f"{r['rows']['default'][0]}/{r['rows']['plugin'][0]}"
        print(f"{r['query']:6s} {r['default_s']:9.2f} {r['plugin_s']:9.2f} {r['ratio']:6.2f} "
              f"{fmt_ci(r['ratio_ci95']):>13s} {pr:>14s} {nrows:>11s} {mib(r['shuffle_bytes']):>11s} "
              f"{'yes' if r['equal'] else 'NO':>5s}")
    ci, cr = rep["sum_ratio_ci95"], rep["sum_ratio_ci95_rounds_only"]
    print(f"\n{rep['equal']}/{rep['total']} equal (exact; floating-point columns within "
          f"{rep['float_tolerance']:.2g} relative, largest difference seen {rep['max_float_rel_diff']:.2g}); "
          f"empty under both shuffles: {rep['empty_queries'] or 'none'}")
    print(f"sum ratio {rep['sum_ratio']}, 95 % interval {fmt_ci(ci)} (bootstrap over rounds and queries; "
          f"over rounds only {fmt_ci(cr)}); per round {rep['sum_ratio_per_round']}; median sums: default "
          f"{rep['default_sum_s']} s, plugin {rep['plugin_sum_s']} s; geomean of ratios {rep['geomean_ratio']}")
    print(f"slower than 1.10x beyond their interval: {rep['slow_queries'] or 'none'}")
    print("floating-point columns (from each result's schema): "
          + ("; ".join(f"{q} {', '.join(c)}" for q, c in rep["float_columns"].items()) or "none"))
    for m, rs in rep.get("time_shares", {}).items():
        for i, t in enumerate(rs, 1):
            print(f"{m} round {i}: queries {t['wall_s']} s, tasks {t['task_s']} s, of which fetch wait "
                  f"{t['fetch_wait_s']} s and shuffle write {t['shuffle_write_s']} s "
                  f"({100 * (t['transport_bound'] or 0):.2f} %); driver outside jobs {t['driver_s']} s")
    if rep.get("retried"):
        print(f"queries run twice (the first attempt failed on Spark's execution-memory limit): {rep['retried']}")
    if rep.get("failed_runs"):
        print(f"runs that failed (a Spark error) while the others agree: {rep['failed_runs']}")
    if "faults" in rep:
        for m, f in rep["faults"].items():
            print(f"{m}: kills {f['kills']}, queries with a FetchFailed {f['queries_with_fetch_failed']}, "
                  f"stages rerun {f['rerun_stages']}, failed queries {f['failed_queries']}, total {f['total_s']} s "
                  f"(fault-free default {rep['reference_default_s']} s)")


def time_table(rep: dict, top: int = 10) -> str:
    """Markdown for docs/benchmarks.md: where the two shuffles' time went, summed over the
    queries, per TERM: each shuffle's mean over rounds and the difference with its 95 %
    interval (over rounds, the order effect cancelled: mean_interval); then the queries whose
    wall time differs most, term by term."""
    qs = rep["queries"]
    rounds = min(len(qs[0]["terms"]["default"]), len(qs[0]["terms"]["plugin"]))
    first = [r % 2 for r in range(rounds)]

    def per_round(m, key, sel=qs):
        return [sum(q["terms"][m][r][key] for q in sel) for r in range(rounds)]

    ci, cr = rep["sum_ratio_ci95"], rep["sum_ratio_ci95_rounds_only"]
    wl = rep.get("workload", {})
    out = [f"TPC-DS SF {wl.get('sf', '?')}, {len(qs)} queries, {rounds} round(s), {wl.get('where', '')}: "
           f"sum ratio **{rep['sum_ratio']}** (95 % interval {fmt_ci(ci)} over rounds and queries, "
           f"{fmt_ci(cr)} over rounds), {rep['equal']}/{rep['total']} equal; slower than 1.10× "
           f"beyond their interval: {', '.join(rep['slow_queries']) or 'none'}.", "",
           "Task times are summed over tasks (the executors run in parallel), so they add up to more "
           "than the wall time.", "",
           "| summed over the queries | default | plugin | plugin − default (95 % interval) |",
           "|---|---|---|---|"]
    for key, what, unit in TERMS:
        d, p = per_round("default", key), per_round("plugin", key)
        diff = [b - a for a, b in zip(d, p)]
        iv = mean_interval(diff, first)
        rng = f" [{iv['lo']:+.2f}, {iv['hi']:+.2f}]" if iv else ""
        out.append(f"| {what} | {statistics.fmean(d):.2f} {unit} | {statistics.fmean(p):.2f} {unit} | "
                   f"{statistics.fmean(diff):+.2f}{rng} |")
    keys = [k for k, _, _ in TERMS if k not in ("remote_mib", "local_mib", "spill_mib")]
    delta = {q["query"]: {k: statistics.fmean(per_round("plugin", k, [q])) - statistics.fmean(per_round("default", k, [q]))
                          for k, _, _ in TERMS} for q in qs}
    worst = sorted(qs, key=lambda q: -abs(delta[q["query"]]["wall_s"]))[:top]
    out += ["", f"The {len(worst)} queries whose wall time differs most (plugin − default, mean over rounds; s, "
            "spill MiB):", "",
            "| query | ratio [95 %] | " + " | ".join(k.removesuffix("_s") for k in keys) + " | spill |",
            "|---|---|" + "---|" * (len(keys) + 1)]
    for q in worst:
        dq = delta[q["query"]]
        out.append(f"| {q['query']} | {q['ratio']:.2f} {fmt_ci(q['ratio_ci95'])} | "
                   + " | ".join(f"{dq[k]:+.2f}" for k in keys) + f" | {dq['spill_mib']:+.1f} |")
    return "\n".join(out) + "\n"


def cmd_table(a) -> int:
    rep = json.loads(Path(a.report).read_text())
    print(time_table(rep, a.top), end="")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--sf", type=float, required=True)
    sub.add_parser("queries")
    p = sub.add_parser("app")
    p.add_argument("--data", required=True)
    p.add_argument("--queries", required=True)
    p.add_argument("--list", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--executors", type=int, default=2)
    p.add_argument("--label", default="")
    b = sub.add_parser("bench")
    b.add_argument("--sf", type=float, default=1.0)
    b.add_argument("--queries", default="")
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("--cluster", type=int, default=0)
    b.add_argument("--kill-every", type=float, default=0.0)
    b.add_argument("--tag", default="", help="report name under target/bench (default: from the options)")
    tb = sub.add_parser("table")
    tb.add_argument("--report", default=str(REPO / "target/bench/tpcds.json"))
    tb.add_argument("--top", type=int, default=10)
    st = sub.add_parser("stages")
    st.add_argument("--logs", default=str(REPO / "target/bench/tpcds-logs"))
    st.add_argument("--queries", required=True)
    a = ap.parse_args()
    if a.cmd == "stages":
        return cmd_stages(a)
    if a.cmd == "table":
        return cmd_table(a)
    if a.cmd == "data":
        print(ensure_data(a.sf))
    elif a.cmd == "queries":
        print(ensure_queries(os.environ["SPARK_VERSION"], os.environ["SCALA_BINARY"]))
    elif a.cmd == "app":
        return cmd_app(a)
    elif a.cmd == "bench":
        if a.rounds < 1:
            raise SystemExit("--rounds needs a positive integer")
        if a.kill_every and not a.cluster:
            raise SystemExit("--kill-every needs --cluster N (it kills executors of the namespace cluster)")
        return cmd_bench(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
