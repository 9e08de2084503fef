"""Soak (CI size): 200 small shuffles in one application with the plugin; nothing per executor
may grow with the number of shuffles, and between shuffles the engine holds nothing.

Runs `scripts/soak.sh --shuffles 200 --no-build` (jvm-plugin/jobs SoakJob on
local-cluster[2,1,1024], a sample of every executor every 10 shuffles; see the script for the
rule) and asserts on the report it writes:
  - every shuffle's output was checked against the same records computed in the driver;
  - per executor: fds, memory maps, threads, RSS outside the Java heap (native memory, the
    engine's included; less what the JVM's JIT and collector hold by its own accounting, which
    swings by 10 MB between samples; sampled after a GC and a trim of glibc's free memory), the
    heap in use after a GC, and the engine's registered bytes, pool slabs, connections, open
    data files and native heap bytes (counted by its allocator) at the end are within 5 % of
    their value around shuffle 100 (an absolute slack only for counts that are legitimately 0
    or a handful there); native RSS within 6 MiB of it, no 5 %: what it grows by without the
    plugin (scripts/soak_baseline.py; VmRSS itself swings with the heap pages the collector
    touched and is only reported);
  - at every sample (between shuffles): no lease held, nothing exposed, no read in flight, no
    pool buffer in use, and no more shuffles registered with the engine than the driver still
    references (so Spark's ContextCleaner reached the engine through unregisterShuffle);
  - the same two executor processes answered throughout, with the engine's gauges present.
The full campaign (2000 shuffles, docs/benchmarks.md) is `scripts/soak.sh`.

Run: `tests/spark/run.sh -k soak`.
"""
import json
import os
import subprocess
import tempfile
import time

from conftest import REPO, require_native_or_skip

SHUFFLES = int(os.environ.get("RDMA_SOAK_SHUFFLES", "200"))


def test_soak_nothing_grows_with_the_number_of_shuffles(runner):
    out = os.path.join(tempfile.mkdtemp(prefix="rs-soak-"), "soak.json")
    t0 = time.monotonic()
    p = subprocess.run(["bash", str(REPO / "scripts/soak.sh"), "--shuffles", str(SHUFFLES),
                        "--no-build", "--out", out],
                       capture_output=True, text=True, env=runner.env, timeout=1800)
    wall = time.monotonic() - t0
    print(f"\n[soak] {SHUFFLES} shuffles: rc={p.returncode} in {wall:.0f} s\n" + p.stdout[-6000:])
    assert os.path.exists(out), f"soak.sh wrote no report (rc={p.returncode}):\n{p.stderr[-4000:]}"
    report = json.loads(open(out).read())
    samples = report["samples"]
    loaded = bool(samples) and all("gauge.shuffles_registered" in s
                                   for ss in samples.values() for s in ss)
    require_native_or_skip(loaded, "the soak's executors (no rdmaShuffle gauges)")

    assert report["job"] and report["job"]["checked"] == SHUFFLES, report["problems"]
    assert sorted(samples) == ["0", "1"], sorted(samples)
    bad = [r for r in report["growth"] if not r["ok"]]
    assert not bad, "grew with the number of shuffles: " + json.dumps(bad, indent=1)
    assert not report["between_shuffle_violations"], report["between_shuffle_violations"]
    # The engine really served this soak: blocks crossed executors through it, both ways.
    for ex, ss in samples.items():
        assert ss[-1]["gauge.blocks_fetched"] > 0 and ss[-1]["gauge.blocks_served"] > 0, (ex, ss[-1])
        assert ss[-1]["gauge.rendezvous_blocks_fetched"] > 0, (ex, "no pulled block", ss[-1])
        # The engine's own heap bytes are counted (and checked for growth above).
        assert all(s.get("gauge.native_heap_bytes", 0) > 0 for s in ss), (ex, "no native_heap_bytes")
    # Every sample trimmed glibc's free memory first (HotSpot's System.trim_native_heap, JDK
    # 17.0.9+), so RSS outside the heap is what the process holds, not what malloc kept.
    n = sum(len(ss) for ss in samples.values())
    assert report["native_heap_trimmed"] == n, f"trimmed before {report['native_heap_trimmed']} of {n} samples"
    assert not report["problems"], report["problems"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
