"""The torch.distributed backend "mobius": the c10d API, and DistributedDataParallel giving
the same parameters as gloo."""

import math

import pytest

from harness import run


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.full)])
def test_torch_distributed_calls_work_through_mobius(world, tmp_path):
    res = run("torch_ops", world, tmp_path)
    for rank, r in res.items():
        assert r.pop("backend_name") == "mobius"
        failed = [k for k, ok in r.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
        expected = 13 + (rank == 1) + (rank == 0)  # send_recv on rank 1, reduce on rank 0
        assert len(r) == expected, r


@pytest.mark.parametrize("world", [2, 4])
def test_destroy_process_group_closes_mobius_so_a_rank_may_leave_at_once(world, tmp_path):
    # Each rank leaves with os._exit right after destroy_process_group: torch calls the
    # backend's shutdown, which finishes the queued Works and closes the communicator, so
    # a rank's last sends reach a slower peer. Every rank must exit 0 with right sums.
    res = run("destroy_then_exit", world, tmp_path, {"calls": 200})
    for rank, r in res.items():
        assert r == {"sums": True, "closed": True}, f"rank {rank}: {r}"


# World 4 (two ranks per core here, 28 s) under --full: CI's 2 ranks run the same DDP path, and
# 4 ranks' collectives run in test_c10d.py and test_correctness.py.
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.full), pytest.param(4, marks=pytest.mark.full)])
def test_ddp_trains_to_the_same_parameters_as_gloo(world, tmp_path):
    steps = 50
    gloo = run("ddp", world, tmp_path / "gloo", {"backend": "gloo", "steps": steps})
    mob = run("ddp", world, tmp_path / "mobius", {"backend": "mobius", "steps": steps})
    assert_same_parameters(gloo, mob, world)
    assert gloo[0]["loss"] != 0


def assert_same_parameters(gloo, mob, world):
    """Every Mobius rank holds rank 0's parameters, and those are gloo's to 1e-6 relative per
    tensor: ‖mobius − gloo‖ ≤ 1e-6 · ‖gloo‖. (Their sums of gradients run in different
    orders, so float32 rounding differs by an ulp per step; elements near zero differ more in
    relative terms than the tensor does.)"""
    ref = gloo[0]["params"]
    for rank in range(world):
        assert mob[rank]["params"] == mob[0]["params"], f"mobius rank {rank} diverged from rank 0"
        for i, (a_list, b_list) in enumerate(zip(mob[rank]["params"], ref)):
            diff = math.sqrt(sum((a - b) ** 2 for a, b in zip(a_list, b_list)))
            norm = math.sqrt(sum(b * b for b in b_list))
            assert diff <= 1e-6 * norm, f"rank {rank} parameter {i}: relative difference {diff / norm:.3g}"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.full)])
def test_fsdp2_trains_to_the_same_parameters_as_gloo(world, tmp_path):
    # FSDP2 all-gathers in place (its input is the rank's shard inside the output), which
    # Mobius once refused ("`input` and `output` overlap").
    steps = 20
    gloo = run("fsdp", world, tmp_path / "gloo", {"backend": "gloo", "steps": steps})
    mob = run("fsdp", world, tmp_path / "mobius", {"backend": "mobius", "steps": steps})
    assert_same_parameters(gloo, mob, world)
    assert len(gloo[0]["params"]) == 6 and gloo[0]["loss"] != 0


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.full)])
def test_monitored_barrier_names_the_rank_that_did_not_come(world, tmp_path):
    # torch allows monitored_barrier on gloo only unless the backend implements it.
    res = run("monitored_barrier", world, tmp_path)
    last = world - 1
    for rank, r in res.items():
        assert r["passed"] and r["after"], f"rank {rank}: {r}"
    root = res[0]["error"]
    assert root and f"rank 0: monitored barrier: rank {last} failed to pass" in root and "within 2000 ms" in root, root
    for rank in range(1, last):
        e = res[rank]["error"]
        assert e and "rank 0 did not release it" in e, f"rank {rank}: {e}"
    assert "error" not in res[last]


def _same(a, b):
    """Equal, floats to 1e-5 relative (float32 sums, in different orders per backend)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("world,init", [(2, "env"), pytest.param(3, "file", marks=pytest.mark.full)])
def test_torch_utilities_give_gloo_s_results(world, init, tmp_path):
    # What training scripts use beyond the collectives: DDP's unused parameters and Join,
    # ZeroRedundancyOptimizer, distributed checkpoints, tensor parallelism, DTensor,
    # subgroups, autograd all_gather, object send/recv, complex all-reduce,
    # batch_isend_irecv; with torch's env:// and file:// init methods.
    args = {"init": init}
    gloo = run("torch_utilities", world, tmp_path / "gloo", {**args, "backend": "gloo"})
    mob = run("torch_utilities", world, tmp_path / "mobius", {**args, "backend": "mobius"})
    for rank in range(world):
        g, m = gloo[rank], mob[rank]
        assert len(g) == 11 and sorted(g) == sorted(m), (g, m)
        errors = {k: v for k, v in g.items() if isinstance(v, str) and v.startswith("ERROR")}
        assert not errors, f"gloo itself failed: {errors}"
        differ = {k: (g[k], m[k]) for k in g if not _same(g[k], m[k])}
        assert not differ, f"rank {rank}: gloo vs mobius: {differ}"


def test_a_process_group_made_again_on_the_same_store_works_and_groups_leave_nothing(tmp_path):
    # Under torchrun every init_process_group of a process uses the agent's store, and a
    # group made again after destroy_process_group has the same key prefix: Mobius read the
    # last group's secret and addresses from it, and every handshake failed until the timeout.
    world = 3
    res = run("torch_reinit", world, tmp_path, timeout=240)
    for rank, r in res.items():
        assert r["sums"] == [6.0, 6.0, 6.0], f"rank {rank}: {r}"
        threads, fds = r["before"]
        # 20 more groups took threads and fds (each its own mesh)...
        assert r["with_groups"][0] > threads + 20 and r["with_groups"][1] > fds + 20, f"rank {rank}: {r}"
        # ...and destroying them gave back every one.
        assert r["after"][0] <= threads and r["after"][1] <= fds, f"rank {rank}: {r}"
