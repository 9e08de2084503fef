"""The plugin beside Spark's external shuffle service on the standalone workers (issue 38): the
cluster of conftest.py runs the service in every worker (`scripts/cluster.sh up 3
--shuffle-service`), and one application of FaultJob per shuffle turns it on
(`spark.shuffle.service.enabled=true`). Once reducers on two executors have read their first
record, the executor holding the most map outputs is killed with `kill -9`; the reducers go on.

With the service, Spark keeps a killed executor's map outputs (the service on its host still
serves the files), so under the default shuffle the reducers read them from the service: no
FetchFailed, no map task run again. The plugin must behave the same: its engines move the blocks
of live executors, and a block of the killed one, in flight or asked for later, is fetched from
the service instead of failing (NativeBlockStoreClient). The tests check, from the job's result
lines, Spark's event log and the engines' counters, that both jobs are correct, that neither
shuffle saw a FetchFailed or reran a map task, that the plugin's engines fetched blocks and
fetched the killed executor's blocks from the service, and that the harness killed exactly one
executor.

Run: tests/cluster/run.sh -k service (needs root).
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import fault_campaign as fc  # noqa: E402
from engine_stats import engine_totals  # noqa: E402

SCENARIO = "during_reduce.kill9"
SERVICE = {"spark.shuffle.service.enabled": "true"}
MODES = ["default", "plugin"]


@pytest.fixture(scope="module")
def runs(cluster):
    out = {}
    for mode in MODES:
        r = fc.run_app(mode, [(SCENARIO, "kill9")], SERVICE, "ci-service", "kill9")
        print(f"\n[service-test] {mode}: rc={r['rc']} wall {r['wall_s']} s, {r['run_dir']}")
        v = r["scenarios"][SCENARIO]
        print(f"[service-test]   { {k: v[k] for k in v if k != 'fetch_failed_messages'} }")
        out[mode] = r
    return out


def _engines(run) -> dict:
    return engine_totals((Path(run["run_dir"]) / "driver.err").read_text(errors="replace"))


@pytest.mark.parametrize("mode", MODES)
def test_the_job_is_correct_after_the_kill(runs, mode):
    run = runs[mode]
    assert run["rc"] == 0, f"see {run['run_dir']}/driver.err"
    assert run["scenarios"][SCENARIO]["ok"], run["scenarios"][SCENARIO]


@pytest.mark.parametrize("mode", MODES)
def test_the_service_served_the_killed_executors_outputs(runs, mode):
    """No FetchFailed and one map stage attempt: the outputs of the killed executor were read
    from the service, not recomputed (the default shuffle's behaviour with the service, which
    the plugin must keep)."""
    v = runs[mode]["scenarios"][SCENARIO]
    assert v["fetch_failed"] == 0, (mode, v)
    assert v["map_stage_attempts"] == 1, (mode, v)
    # The harness killed exactly one executor, and it was lost (exit code 137).
    removed = runs[mode]["executor_removed"]
    assert len(removed) == 1 and "137" in removed[0], removed
    assert runs[mode]["fatal_signals"] == [], runs[mode]["fatal_signals"]


def test_the_plugins_engines_moved_blocks_and_the_service_the_killed_ones(runs):
    totals = _engines(runs["plugin"])
    assert totals, "no engine counters in the plugin run's driver log"
    total = lambda k: sum(kv.get(k, 0) for kv in totals.values() if isinstance(kv.get(k, 0), int))
    print(f"[service-test] engines: blocks_fetched={total('blocks_fetched')} "
          f"native_requests={total('native_requests')} service_fallback_blocks={total('service_fallback_blocks')} "
          f"delegated_requests={total('delegated_requests')} departed_executors={total('departed_executors')}")
    assert total("blocks_fetched") > 0 and total("blocks_served") > 0, totals
    # The killed executor's blocks: an engine fetch towards it failed and the block came from
    # the service, or the executor was already known gone and the request went to the service.
    assert total("service_fallback_blocks") + total("delegated_requests") > 0, totals

