"""The torch.distributed backend "mobius": the c10d API, and DistributedDataParallel giving
the same parameters as gloo."""

import math

import pytest

from harness import run


@pytest.mark.parametrize("world", [2, 3])
def test_torch_distributed_calls_work_through_mobius(world, tmp_path):
    res = run("torch_ops", world, tmp_path)
    for rank, r in res.items():
        assert r.pop("backend_name") == "mobius"
        failed = [k for k, ok in r.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
        expected = 12 + (rank == 1) + (rank == 0)  # send_recv on rank 1, reduce on rank 0
        assert len(r) == expected, r


@pytest.mark.parametrize("world", [2, 4])
def test_destroy_process_group_closes_mobius_so_a_rank_may_leave_at_once(world, tmp_path):
    # Each rank leaves with os._exit right after destroy_process_group: torch calls the
    # backend's shutdown, which finishes the queued Works and closes the communicator, so
    # a rank's last sends reach a slower peer. Every rank must exit 0 with right sums.
    res = run("destroy_then_exit", world, tmp_path, {"calls": 200})
    for rank, r in res.items():
        assert r == {"sums": True, "closed": True}, f"rank {rank}: {r}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ddp_trains_to_the_same_parameters_as_gloo(world, tmp_path):
    steps = 50
    gloo = run("ddp", world, tmp_path / "gloo", {"backend": "gloo", "steps": steps})
    mob = run("ddp", world, tmp_path / "mobius", {"backend": "mobius", "steps": steps})
    ref = gloo[0]["params"]
    for rank in range(world):
        # DDP keeps replicas identical within a backend...
        assert mob[rank]["params"] == mob[0]["params"], f"mobius rank {rank} diverged from rank 0"
        # ...and the two backends agree to 1e-6 relative, per parameter tensor:
        # ‖mobius − gloo‖ ≤ 1e-6 · ‖gloo‖. (Their sums of gradients run in different orders,
        # so float32 rounding differs by an ulp per step; elements near zero differ more in
        # relative terms than the tensor does.)
        for i, (a_list, b_list) in enumerate(zip(mob[rank]["params"], ref)):
            diff = math.sqrt(sum((a - b) ** 2 for a, b in zip(a_list, b_list)))
            norm = math.sqrt(sum(b * b for b in b_list))
            assert diff <= 1e-6 * norm, f"rank {rank} parameter {i}: relative difference {diff / norm:.3g}"
    assert gloo[0]["loss"] != 0


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_trains_to_the_same_parameters_as_gloo(world, tmp_path):
    # FSDP2 all-gathers in place (its input is the rank's shard inside the output), which
    # Mobius once refused ("`input` and `output` overlap").
    steps = 20
    gloo = run("fsdp", world, tmp_path / "gloo", {"backend": "gloo", "steps": steps})
    mob = run("fsdp", world, tmp_path / "mobius", {"backend": "mobius", "steps": steps})
    ref = gloo[0]["params"]
    for rank in range(world):
        assert mob[rank]["params"] == mob[0]["params"], f"mobius rank {rank} differs from rank 0"
        for i, (a_list, b_list) in enumerate(zip(mob[rank]["params"], ref)):
            diff = math.sqrt(sum((a - b) ** 2 for a, b in zip(a_list, b_list)))
            norm = math.sqrt(sum(b * b for b in b_list))
            assert diff <= 1e-6 * norm, f"rank {rank} parameter {i}: relative difference {diff / norm:.3g}"
    assert len(ref) == 6 and gloo[0]["loss"] != 0
