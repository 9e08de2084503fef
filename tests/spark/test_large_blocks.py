"""Blocks larger than the engine's pool cap and than Spark's fetch-to-memory threshold (issue 14).

One application per shuffle, both with `spark.network.maxRemoteBlockSizeFetchToMem=2m`; the
plugin's engines get a 4 MiB pool of buffers up to 1 MiB. The `bigblock` job at scale 0.06
writes two 12 MiB shuffle blocks (3x the pool cap, 6x the threshold) of incompressible bytes,
and one of them crosses executors. Spark asks for it on disk (a `DownloadFileManager`), the
plugin streams it into Spark's temp file in 1 MiB ranges, never a buffer of the block's size:
the output must equal the default shuffle's, and the engines' counters must show the stream.
"""
from conftest import engine_totals, require_native_or_skip

MIB = 1 << 20
SCALE = 0.06  # bigblock: 2 blocks of int(210 * 0.06) = 12 MiB
THRESHOLD = {"spark.network.maxRemoteBlockSizeFetchToMem": "2m"}
SMALL_POOL = {
    **THRESHOLD,
    "spark.shuffle.rdma.pool.capBytes": "4m",
    "spark.shuffle.rdma.pool.tiers": "4k,64k,256k,1m",
    "spark.shuffle.rdma.maxBytesInFlight": "2m",
}


def test_blocks_over_the_pool_cap_and_the_fetch_to_memory_threshold_stream_to_temp_files(runner):
    default = runner.custom("default", "bigblock", SCALE, THRESHOLD)
    plugin = runner.custom("plugin", "bigblock", SCALE, SMALL_POOL)
    for r in (default, plugin):
        assert r.returncode == 0, f"{r.mode} run failed; stderr tail:\n{r.stderr[-4000:]}"
    d, p = default.line("DIGEST", "bigblock"), plugin.line("DIGEST", "bigblock")
    assert d == p, f"default {d} != plugin {p}"
    sizes = [int(s) for s in p["check"].removeprefix("block_bytes=").split("/")]
    assert sizes == [12 * MIB, 12 * MIB], sizes
    metrics = plugin.line("SHUFFLE_METRICS", "bigblock")
    assert int(metrics["remote_bytes"]) >= 12 * MIB, metrics

    require_native_or_skip(any("native=loaded" in t for t in plugin.executor_logs.values()), "the plugin run")
    totals = engine_totals(plugin.stderr)
    total = lambda k: sum(kv.get(k, 0) for kv in totals.values())
    print(f"[spark-suite] large blocks: streamed_blocks={total('streamed_blocks')} "
          f"streamed_bytes={total('streamed_bytes')} peak_stream_buffers={max(kv.get('peak_stream_buffers', 0) for kv in totals.values())} "
          f"failed={total('failed_blocks_fetched')} pool_exhausted={total('failed_blocks_fetched_pool_exhausted')}")
    # The remote 12 MiB block went through the streamed path, whole, and nothing else failed.
    assert total("streamed_blocks") >= 1, totals
    assert total("streamed_bytes") >= 12 * MIB, totals
    # Every remote byte Spark read came through a stream (the other block is local).
    assert total("streamed_bytes") == int(metrics["remote_bytes"]), (totals, metrics)
    assert total("failed_blocks_fetched") == 0, totals
    assert total("delegated_requests") == 0, totals
    # Two buffers of 1 MiB per stream at most: never one of the block's size.
    assert all(kv.get("peak_stream_buffers", 0) <= 2 for kv in totals.values()), totals
