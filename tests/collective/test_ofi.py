"""Mobius over the libfabric provider (`MOBIUS_TRANSPORT=ofi`), in real processes at 2 ranks,
over each libfabric provider: the numpy binding's every op × dtype × reduce op against numpy
(the policy's algorithms and ring forced), the torch.distributed surface against numpy, and DDP
against gloo. Every case also checks that the group ran on ofi: the communicator's stats name
the transport, and libfabric's own counters (sends, receives, reads) moved.

The default wheel has no ofi (it links libfabric >= 2.0), so these run where the wheel was built
with it: scripts/test.sh's libfabric step sets RDMA_TEST_OFI to the libfabric providers to run
(comma-separated, e.g. `tcp;ofi_rxm,shm`), builds the wheel with MOBIUS_FEATURES=ofi and puts
scripts/ensure-libfabric.sh's library on LD_LIBRARY_PATH. Without RDMA_TEST_OFI they are skipped.
"""

import os

import pytest

from harness import run
from test_correctness import ALGOS, DTYPES, REDUCE_OPS, SETTINGS, SIZES
from test_torch import assert_same_parameters

ASKED = [p for p in os.environ.get("RDMA_TEST_OFI", "").split(",") if p]
PROVIDERS = ["tcp;ofi_rxm", "shm"]


def ofi_env(provider: str) -> dict:
    if provider not in ASKED:
        pytest.skip(f"libfabric provider {provider!r} not asked for (RDMA_TEST_OFI={','.join(ASKED)!r}; "
                    "scripts/test.sh's libfabric step runs these)")
    return {"MOBIUS_TRANSPORT": "ofi", "MOBIUS_OFI_PROVIDER": provider}


def assert_on_ofi(stats: dict, rank: int) -> dict:
    """The calls went through libfabric: the transport is ofi and its sends and receives were
    counted by the provider itself. Returns the provider's counters."""
    assert stats["transport"] == "ofi", f"rank {rank} ran on {stats['transport']!r}, not ofi"
    counters = dict(stats["provider"])
    assert counters.get("ofi_sends", 0) > 0 and counters.get("ofi_recvs", 0) > 0, f"rank {rank}: {counters}"
    return counters


@pytest.mark.parametrize("algo", ["auto", "ring"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_every_op_dtype_and_reduce_op_over_ofi(provider, algo, tmp_path):
    env = ofi_env(provider)
    res = run("matrix", 2, tmp_path, {
        "algo": algo, "ops": ALGOS[algo], "dtypes": DTYPES, "reduce_ops": REDUCE_OPS, "sizes": SIZES,
        "settings": SETTINGS,
    }, env=env)
    failures = [f for r in res.values() for f in r["failures"]]
    assert not failures, "\n".join(failures[:30])
    for rank, r in res.items():
        assert r["cases"] > 0
        s = r["stats"]
        counters = assert_on_ofi(s, rank)
        # Blocks above the eager limit went by rendezvous, read one-sided: both providers offer
        # RMA here (`fi_info -c FI_RMA`), so each read is an fi_read libfabric completed.
        assert s["eager_messages"] > 0 and s["rendezvous_messages"] > 0, s
        assert 0 < s["one_sided_reads"] <= counters.get("ofi_reads", 0), (s["one_sided_reads"], counters)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_torch_collectives_match_numpy_over_ofi(provider, tmp_path):
    res = run("torch_matrix", 2, tmp_path, env=ofi_env(provider), timeout=600)
    for rank, r in res.items():
        assert not r["failures"], f"rank {rank}: {len(r['failures'])} failures, first: {r['failures'][:5]}"
        assert r["refused"] == 13 * 5 and r["checked"] > 300, (r["refused"], r["checked"])
        assert_on_ofi(r["stats"], rank)


@pytest.fixture(scope="module")
def gloo_ddp(tmp_path_factory):
    return run("ddp", 2, tmp_path_factory.mktemp("gloo"), {"backend": "gloo", "steps": 50})


@pytest.mark.parametrize("provider", PROVIDERS)
def test_ddp_over_ofi_trains_to_the_same_parameters_as_gloo(provider, gloo_ddp, tmp_path):
    env = ofi_env(provider)
    mob = run("ddp", 2, tmp_path, {"backend": "mobius", "steps": 50}, env=env)
    assert_same_parameters(gloo_ddp, mob, 2)
    for rank, r in mob.items():
        assert_on_ofi(r["stats"], rank)
