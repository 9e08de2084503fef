"""The representative cases of the fault campaign (scripts/fault-campaign.sh), on the cluster
that conftest.py brought up, once with Spark's default shuffle and once with the plugin: one
application of FaultJob per shuffle runs

- `before_reduce.truncate`: after the map stage committed and before any reducer asked, the
  largest data file of one executor is cut to half its length;
- `during_reduce.kill9`: once reducers on two executors have read their first record, the
  executor holding the most map outputs is killed with `kill -9` and the reducers go on.

and the tests check, from the job's own result lines and Spark's event log, that each job is
correct, that each fault surfaced as a FetchFailed naming the damaged/killed executor followed by a
rerun of the lost map outputs, that no executor died of the disk fault (no SIGBUS), and that the
plugin's client did not retry towards the executor the driver knew was dead (SPARK-27637). They
assert what happened, never how long it took (the campaign reports the times).

Run: tests/cluster/run.sh -k faults (needs root).
"""
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import fault_campaign as fc  # noqa: E402

STEPS = [("before_reduce.truncate", "truncate"), ("during_reduce.kill9", "kill9")]


@pytest.fixture(scope="module", params=["default", "plugin"])
def run(cluster, request):
    r = fc.run_app(request.param, STEPS, {}, "ci", "ci")
    print(f"\n[faults-test] {request.param}: rc={r['rc']} wall {r['wall_s']} s, {r['run_dir']}")
    for s, v in r["scenarios"].items():
        print(f"[faults-test]   {s}: { {k: v[k] for k in v if k != 'fetch_failed_messages'} }")
    return r


def test_every_job_is_correct(run):
    assert run["rc"] == 0, f"{run['mode']}: see {run['run_dir']}/driver.err"
    for s, v in run["scenarios"].items():
        assert v["ok"], (run["mode"], s, v)


@pytest.mark.parametrize("scenario", [s for s, _ in STEPS])
def test_the_fault_is_a_fetch_failure_then_a_rerun(run, scenario):
    v = run["scenarios"][scenario]
    assert v["fetch_failed"] > 0, (run["mode"], scenario, v)
    assert v["victim"] in v["fetch_failed_from"], (run["mode"], scenario, v)
    assert v["map_stage_attempts"] >= 2, (run["mode"], scenario, v)


def test_a_damaged_file_kills_no_executor(run):
    # The only executor lost is the one the harness killed (exit code 137); no JVM crashed.
    assert len(run["executor_removed"]) == 1 and "137" in run["executor_removed"][0], run["executor_removed"]
    assert run["fatal_signals"] == [], run["fatal_signals"]


def test_plugin_names_the_truncated_file(run):
    if run["mode"] != "plugin":
        pytest.skip("the engine's typed error exists only under the plugin")
    msgs = run["scenarios"]["before_reduce.truncate"]["fetch_failed_messages"]
    assert any("data file truncated" in m for m in msgs), msgs


def test_plugin_does_not_retry_towards_a_dead_executor(run):
    if run["mode"] != "plugin":
        pytest.skip("Spark's own client is Spark's business")
    v = run["scenarios"]["during_reduce.kill9"]
    victim = v["victim"]
    msgs = v["fetch_failed_messages"]
    assert any(f"the driver reports executor {victim} dead" in m for m in msgs), msgs
    # At most the one retry a failure racing the driver's own notice of the death may cost:
    # before the fix every reducer retried maxRetries (3) times, 5 s apart.
    logs = "".join(p.read_text(errors="replace") for p in (Path(run["run_dir"]) / "executors").glob("*.stderr"))
    assert not re.search(r"Retrying fetch \([23]/3\)", logs), "reducers retried towards the dead executor"
