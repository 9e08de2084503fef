"""The benchmark pipeline end to end at a tiny size: every library runs and yields rows with
nccl-tests' fields, the table prints and the plot is drawn. (Speed is judged on a quiet
machine with scripts/bench-collective.sh, not here.)"""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_tiny_benchmark_yields_rows_for_every_library(tmp_path):
    out = subprocess.run(
        [sys.executable, str(HERE / "bench.py"), "run", "--worlds", "2", "--sizes", "4k,256k", "--iters", "3",
         "--warmup", "1", "--rounds", "1", "--out", str(tmp_path), "--timeout", "600", "--groups", "2", "--group-world", "2"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "collective.json").read_text())
    groups = [r for r in report["rows"] if r["op"] == "new_group"]
    rows = [r for r in report["rows"] if r["op"] != "new_group"]
    assert {r["library"] for r in rows} == {"torch-mobius", "torch-mobius-tcp", "mobius", "mobius-tcp", "gloo", "mpi",
                                            "openmpi-sm", "ring"}
    # Group creation, gloo against Mobius through torch.distributed, with its target.
    assert {r["library"] for r in groups} == {"gloo", "torch-mobius"} and all(r["time_us"] > 0 for r in groups)
    kinds = {t["target"] for t in report["targets"]}
    assert any("group creation" in k for k in kinds) and any("through torch.distributed" in k for k in kinds), kinds
    assert any("Open MPI tcp" in k for k in kinds), kinds
    for r in rows:
        assert set(r) >= {"library", "op", "bytes", "world", "time_us", "algbw_gbs", "busbw_gbs"}
        assert r["time_us"] > 0
        assert abs(r["busbw_gbs"] - r["algbw_gbs"] * 2 * (r["world"] - 1) / r["world"]) < 1e-9
        assert abs(r["algbw_gbs"] - r["bytes"] / (r["time_us"] * 1e-6) / 1e9) < 1e-6 * max(r["algbw_gbs"], 1)
    assert "torch-mobius time(us)" in out.stdout and "busbw" in out.stdout and "group creation" in out.stdout
    assert (tmp_path / "collective.png").stat().st_size > 10_000
    policy = report["mobius_policy"]["allreduce/world2"]
    assert policy["decisions"]["4096"][0] == "rd"
    # All ranks on this host: the default (auto) transport is shared memory.
    assert policy["transport"] == "shm", policy


def test_tiny_ddp_benchmark_compares_gloo_and_mobius(tmp_path):
    out = subprocess.run(
        [sys.executable, str(HERE / "bench_ddp.py"), "run", "--worlds", "2", "--rounds", "1", "--steps", "1",
         "--width", "128", "--out", str(tmp_path), "--timeout", "600"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    row = json.loads((tmp_path / "ddp.json").read_text())["rows"][0]
    assert row["world"] == 2
    for b in ("gloo", "mobius"):
        assert row[b]["step_s"]["median"] > 0 and row[b]["comm_s"]["median"] > 0
    assert row["compute_s"]["median"] > 0
    # The two DDP replicas trained identically (same data, averaged gradients): the Mobius
    # replica's update equals gloo's, and every rank's Mobius replica equals rank 0's, to a
    # thousandth of the update's norm (float32 rounding of one allreduce against another is
    # ~1e-7 of it). A no-op allreduce leaves each rank the update of its own batch's gradient,
    # apart from the averaged one by a good fraction of it.
    assert row["update_norm"] > 0, row
    assert row["mobius_vs_gloo_rel"] < 1e-3, row
    assert row["replicas_rel"] < 1e-3, row
    assert "mobius/gloo steps/s" in out.stdout
    assert (tmp_path / "ddp.png").stat().st_size > 10_000
