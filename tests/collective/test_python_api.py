"""The Python package: zero-copy in-place collectives on numpy and torch, and clear errors."""

from harness import run


def test_numpy_and_torch_buffers_are_reduced_in_place_without_copies(tmp_path):
    res = run("zero_copy", 2, tmp_path)
    for rank, r in res.items():
        assert r["numpy_same_object"] and r["numpy_ok"], r
        assert r["allgather_in_place"] and r["allgather_shifted_overlap"] and r["monitored_barrier"], r
        for key, ok in r.items():
            if key.startswith("torch_"):
                assert ok, f"rank {rank}: {key}"
        assert "not contiguous" in r["non_contiguous"], r["non_contiguous"]
        assert "complex64" in r["bad_dtype"] and "f32" in r["bad_dtype"], r["bad_dtype"]
