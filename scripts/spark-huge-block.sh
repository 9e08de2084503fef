#!/usr/bin/env bash
# Blocks and fetch requests over 2 GiB through the plugin on local-cluster (issue 14), outside CI.
#
#   scripts/spark-huge-block.sh [--scale S] [--no-build]
#
# Two jobs of jvm-plugin/jobs ShuffleJobs, each once with Spark's default shuffle and once with
# the plugin, on local-cluster[2,1,1024] with the settings of tests/spark/conftest.py (its Runner
# submits them), incompressible bytes, shuffle.compress=false:
#   bigblock    at scale 10.5*S: one map task writes two blocks of 2205*S MiB; one of them is
#               fetched by the other executor: one block > 2 GiB (S = 1).
#   hugerequest at scale S:      four map tasks write 1100*S MiB each for reduce partition 0;
#               with spark.reducer.maxSizeInFlight=8g the blocks of the other executor's two
#               maps form one fetch request of 2200*S MiB > 2 GiB.
# Spark asks for both on disk (maxRemoteBlockSizeFetchToMem, 200m): the plugin streams every
# block into Spark's temp file in ranges of at most the largest pool tier, two at a time.
# Checks: the outputs (record count, checksum of every byte, bytes per partition) equal the
# default shuffle's; the engines streamed more than 2 GiB (streamed_bytes) and failed nothing;
# Spark's fetcher sent a request of more than 2 GiB (its DEBUG line, executor logs). Writes
# target/bench/spark-huge-block.json. Needs ~20 GB of disk at S = 1 (map outputs, spills and
# temp files of both modes); ~10-20 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

scale=1
build=yes
while [ $# -gt 0 ]; do
  case "$1" in
    --scale) scale=$2; shift 2 ;;
    --no-build) build=no; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "spark-huge-block.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

step "Spark runtime"
. scripts/spark-env.sh
[ "$build" = no ] || build_plugin
mkdir -p target/bench
step "bigblock and hugerequest, default shuffle vs plugin (scale $scale)"
SCALE=$scale "$VENV_DIR/bin/python" - <<'EOF'
import json, os, re, sys, tempfile
sys.path.insert(0, "tests/spark")
import conftest

scale = float(os.environ["SCALE"])
env = conftest.spark_env()
log4j = tempfile.NamedTemporaryFile("w", suffix=".properties", delete=False)
# Spark's own fetcher logs every request it sends at DEBUG: the proof of a > 2 GiB request.
log4j.write("rootLogger.level = info\nrootLogger.appenderRef.stderr.ref = console\n"
            "appender.console.type = Console\nappender.console.name = console\nappender.console.target = SYSTEM_ERR\n"
            "appender.console.layout.type = PatternLayout\nappender.console.layout.pattern = %d %p %c{1}: %m%n\n"
            "logger.fetch.name = org.apache.spark.storage.ShuffleBlockFetcherIterator\nlogger.fetch.level = debug\n")
log4j.close()
runner = conftest.Runner(env, env["RDMA_PLUGIN_JAR"], env["RDMA_JOBS_JAR"])
GIB = 1 << 30
conf = {"spark.executor.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{log4j.name}",
        "spark.network.timeout": "600s"}
cases = [("bigblock", 10.5 * scale, {}), ("hugerequest", scale, {"spark.reducer.maxSizeInFlight": "8g"})]
report, ok = [], True
for job, s, extra in cases:
    runs = {m: runner.custom(m, job, s, {**conf, **extra}) for m in ("default", "plugin")}
    for r in runs.values():
        if r.returncode != 0:
            sys.exit(f"{job}/{r.mode} failed (rc {r.returncode}); stderr tail:\n{r.stderr[-4000:]}")
    d, p = (runs[m].line("DIGEST", job) for m in ("default", "plugin"))
    totals = conftest.engine_totals(runs["plugin"].stderr)
    total = lambda k: sum(kv.get(k, 0) for kv in totals.values())
    sizes = []
    for text in runs["plugin"].executor_logs.values():
        for m in re.finditer(r"Sending request for (\d+) blocks \(([\d.]+) (GiB|MiB|KiB|B)\)", text):
            mult = {"GiB": GIB, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1}[m.group(3)]
            sizes.append(float(m.group(2)) * mult)
    row = {"job": job, "scale": s, "default": d, "plugin": p, "same_output": d == p,
           "default_wall_s": round(runs["default"].wall_s, 1), "plugin_wall_s": round(runs["plugin"].wall_s, 1),
           "streamed_blocks": total("streamed_blocks"), "streamed_bytes": total("streamed_bytes"),
           "failed_blocks_fetched": total("failed_blocks_fetched"),
           "peak_stream_buffers": max((kv.get("peak_stream_buffers", 0) for kv in totals.values()), default=0),
           "largest_request_bytes": int(max(sizes, default=0))}
    print(json.dumps(row))
    report.append(row)
    big = max(int(x) for x in p["check"].removeprefix("block_bytes=").split("/"))
    checks = {"outputs equal": d == p, "a partition over 2 GiB": big > 2 * GIB,
              "engines streamed > 2 GiB": total("streamed_bytes") > 2 * GIB,
              "no failed block": total("failed_blocks_fetched") == 0}
    if job == "bigblock":
        checks["a streamed block over 2 GiB"] = any(kv.get("streamed_bytes", 0) > 2 * GIB for kv in totals.values())
    else:
        checks["a fetch request over 2 GiB"] = max(sizes, default=0) > 2 * GIB
    for what, good in checks.items():
        print(f"  {job}: {what}: {'ok' if good else 'FAILED'}")
        ok &= good
json.dump(report, open("target/bench/spark-huge-block.json", "w"), indent=1)
sys.exit(0 if ok else 1)
EOF
