"""Faults never hang: a rank killed mid-allreduce, a rank that never joins, mismatched
arguments — every surviving rank raises, naming the rank at fault, within the timeout."""

import time

from harness import Group, run

# Generous, so that scheduling on a loaded machine is never mistaken for a hang; a rank that
# was killed is noticed from its links going down, well inside half of it.
TIMEOUT = 30.0


def test_a_rank_killed_during_an_allreduce_makes_the_others_raise_within_the_timeout(tmp_path):
    g = Group("loop_allreduce", 3, tmp_path, {"n": 4 << 20, "timeout": TIMEOUT})
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in range(3)):
            assert time.monotonic() < deadline, f"ranks never got going:\n{g.tail()}"
            assert all(p.poll() is None for p in g.procs.values()), f"a rank exited early:\n{g.tail()}"
            time.sleep(0.05)
        # Every rank wrote ready after an allreduce of the loop, so all are in the loop, and
        # every call of the survivors from now on needs rank 1.
        killed_at = time.time()
        g.kill(1)
        # The survivors must finish on their own: a hang fails here.
        for r in (0, 2):
            g.procs[r].wait(timeout=TIMEOUT + 30)
    finally:
        g.kill_all()
    for r in (0, 2):
        res = g.result(r)
        assert res["type"] == "MobiusError", res
        assert "rank 1" in res["error"], res["error"]
        assert res["calls"] >= 1, res
        assert res["failed_at"] - killed_at < TIMEOUT / 2, f"rank {r} took {res['failed_at'] - killed_at:.1f} s"


def test_a_rank_that_never_joins_is_named_after_the_timeout(tmp_path):
    g = Group("join", 3, tmp_path, {"settings": {"timeout": 3}}, ranks=[0, 1])
    codes = g.wait(60)
    assert codes == {0: 0, 1: 0}, g.tail()
    for r in (0, 1):
        res = g.result(r)
        assert res["error"] and "rank(s) [2]" in res["error"] and "never joined" in res["error"], res
        assert res["seconds"] < 20, res


def test_mismatched_sizes_raise_on_every_rank_naming_the_argument(tmp_path):
    res = run("mismatch", 2, tmp_path)
    for rank, r in res.items():
        assert r["type"] == "MobiusError", r
        assert f"rank {1 - rank}" in r["error"], r["error"]
        assert "count" in r["error"] and "10" in r["error"] and "12" in r["error"], r["error"]
        assert r["seconds"] < 20, r
