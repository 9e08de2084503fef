"""Correctness of every collective against numpy, in real processes over tcp on loopback.

Inputs are integer-valued, so every reduction is exact in every dtype and results must equal
numpy's bit for bit; `test_float_sums_within_tolerance` covers random floats, with the bound
stated there.
"""

import pytest

from harness import run

DTYPES = ["f32", "f64", "f16", "bf16", "i32", "i64", "u8"]
REDUCE_OPS = ["sum", "prod", "min", "max", "avg"]
ALL_OPS = ["allreduce", "reduce", "reduce_scatter", "broadcast", "allgather", "alltoall"]
# Each algorithm forced in turn, on the ops that have it; "auto" is the policy's choice.
ALGOS = {
    "auto": ALL_OPS,
    "ring": ["allreduce", "reduce", "reduce_scatter", "broadcast", "allgather"],
    "rd": ["allreduce", "allgather"],
    "rhd": ["allreduce", "reduce_scatter"],
    "tree": ["reduce", "broadcast"],
    "direct": ["alltoall"],
    "pairwise": ["alltoall"],
    # On one host (no MOBIUS_HOST_ID): only the in-host phases run; the several-host cases
    # are test_hierarchical_collectives_on_faked_hosts.
    "hier": ["allreduce", "allgather", "reduce_scatter"],
}
# 1 element up to 64k+1 (odd: never divides by the world); blocks split into 32 KiB segments
# and messages above 4 KiB go rendezvous, so both protocols and pipelining run.
SIZES = [1, 7, 1000, 65537]
SETTINGS = {"segment": "32k", "eager_limit": 4096}


def cases():
    yield 1, "auto"
    for world in (2, 3, 4):
        for algo in ALGOS:
            yield world, algo


@pytest.mark.parametrize("world,algo", list(cases()))
def test_every_op_dtype_and_reduce_op(world, algo, tmp_path):
    res = run("matrix", world, tmp_path, {
        "algo": algo, "ops": ALGOS[algo], "dtypes": DTYPES, "reduce_ops": REDUCE_OPS, "sizes": SIZES,
        "settings": SETTINGS,
    })
    failures = [f for r in res.values() for f in r["failures"]]
    assert not failures, "\n".join(failures[:30])
    assert all(r["cases"] > 0 for r in res.values())
    if world > 1:
        calls = res[0]["stats"]["calls"]
        if algo != "auto":
            for op in ALGOS[algo]:
                assert calls.get(f"{op}.{algo}", 0) > 0, f"{op} did not run {algo}: {calls}"
        s = res[0]["stats"]
        assert s["eager_messages"] > 0 and s["rendezvous_messages"] > 0, s


# Host of each rank (MOBIUS_HOST_ID per rank): 2 and 3 hosts, equal and unequal, ranks of a host
# consecutive and interleaved.
# CI runs three (unequal, interleaved, three unequal interleaved hosts); --full all eight.
HOST_LAYOUTS = [[0, 0, 1], [0, 1, 0, 1], [1, 0, 0, 2, 0, 1]] + [
    pytest.param(h, marks=pytest.mark.full)
    for h in ([0, 1], [0, 0, 1, 1], [0, 0, 0, 1, 1], [0, 1, 2, 0, 1], [0, 0, 1, 1, 2, 2])]


@pytest.mark.parametrize("hosts", HOST_LAYOUTS, ids=lambda h: "".join(map(str, h)))
def test_hierarchical_collectives_on_faked_hosts(hosts, tmp_path):
    """Forced hierarchical allreduce (reduce in each host, leaders' allreduce, broadcast in
    each host), allgather and reduce-scatter on every dtype × reduce op × size of the matrix,
    against numpy."""
    world = len(hosts)
    res = run("matrix", world, tmp_path, {
        "algo": "hier", "ops": ALGOS["hier"], "dtypes": DTYPES, "reduce_ops": REDUCE_OPS, "sizes": SIZES,
        "settings": SETTINGS, "hosts": [f"host{h}" for h in hosts],
    })
    failures = [f for r in res.values() for f in r["failures"]]
    assert not failures, "\n".join(failures[:30])
    assert all(r["hosts"] == res[0]["hosts"] for r in res.values())
    assert len(set(res[0]["hosts"])) == len(set(hosts)), res[0]["hosts"]
    for op in ALGOS["hier"]:
        assert res[0]["stats"]["calls"].get(f"{op}.hier", 0) > 0, res[0]["stats"]["calls"]


# Between the matrix's 256 KiB and the 64 MiB test: ~1 MiB and ~16 MiB of f32 (odd counts), every
# op, the policy's choice and the default segments, so the pipelined large-message paths of every
# algorithm the policy picks there run with short last segments. World 4 (21 s here) under
# --full; in CI 4 ranks run every algorithm on the matrix's sizes and the ring pipelined at 64 MiB.
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.full), pytest.param(4, marks=pytest.mark.full)])
def test_mid_sizes_every_op(world, tmp_path):
    res = run("matrix", world, tmp_path, {
        "algo": "auto", "ops": ALL_OPS, "dtypes": ["f32", "i32"], "reduce_ops": ["sum", "max"],
        "sizes": [262_147, 4_194_305],
    }, timeout=600)
    failures = [f for r in res.values() for f in r["failures"]]
    assert not failures, "\n".join(failures[:30])
    assert all(r["cases"] > 0 for r in res.values())
    assert res[0]["stats"]["rendezvous_bytes"] >= 4 << 20, res[0]["stats"]


@pytest.mark.parametrize("world,algo", [(2, "auto"), pytest.param(3, "auto", marks=pytest.mark.full),
                                        pytest.param(4, "auto", marks=pytest.mark.full), (4, "ring"), (3, "rhd")])
def test_64_mib_buffers(world, algo, tmp_path):
    res = run("large", world, tmp_path, {"bytes": 64 << 20, "algo": algo}, timeout=600)
    failures = [f for r in res.values() for f in r["failures"]]
    assert not failures, failures
    # 64 MiB goes rendezvous (zero-copy from the sender's buffer).
    assert res[0]["stats"]["rendezvous_bytes"] >= 32 << 20


@pytest.mark.parametrize("world,algo", [(3, "ring"), (3, "rd"), (4, "rhd"), (4, "auto")])
def test_float_sums_within_tolerance(world, algo, tmp_path):
    """f32/f16/bf16 sums of uniform(-1, 1) values: |got − exact| ≤ (world − 1)·ε·Σ|xᵢ| + ε·|exact|
    with ε = 2⁻²⁴, 2⁻¹¹, 2⁻⁸ (one rounding per pairwise combination, and the last one)."""
    res = run("tolerance", world, tmp_path, {"n": 100_003, "algo": algo})
    for rank, r in res.items():
        for dtype, v in r.items():
            assert v["within"], f"rank {rank} {dtype}: max error {v['max_err']} ({v['worst_ratio']:.2f} of the bound)"


def test_policy_model_is_measured_once_and_shared(tmp_path):
    res = run("policy", 2, tmp_path, env={"MOBIUS_TUNE": "on"})
    assert res[0]["model"] == res[1]["model"], "every rank must use rank 0's measurements"
    assert res[0]["decisions"] == res[1]["decisions"]
    m = res[0]["model"]
    assert 0 < m["alpha"] < 0.1 and 0 < m["beta"] < 1e-6, m
    assert res[0]["decisions"]["allreduce/4096"][0] == "rd", res[0]["decisions"]
    assert res[0]["calls"] == {"allreduce.rd": 1}
