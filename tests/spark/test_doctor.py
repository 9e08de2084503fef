"""The preflight an operator runs on a node (`java -cp <plugin jar> ...Doctor`), on this host.

The host has no RDMA device (and its kernel no InfiniBand), so:
- with the defaults (`transport=auto`): exit status 0; `auto` picks tcp and says why (no RDMA
  device); the loopback moves 1 MiB inline and 1 MiB pulled, over tcp, with times; the memory
  bound is half of the overhead Spark sizes a default (1 GiB) executor with;
- asking for verbs: exit status 2, the verdict says verbs cannot work;
- with a lowered locked-memory limit (and no CAP_IPC_LOCK): the report names the limit, what
  verbs would pin, and the settings to change, and still runs over tcp.
The same preflight over real RDMA (SoftRoCE) runs in the VM: scripts/spark-verbs-test.sh.

Run: `tests/spark/run.sh -k doctor`.
"""
import json
import os
import subprocess

DOCTOR = "org.apache.spark.shuffle.rdma.Doctor"
# Spark's overhead of a default executor (1 GiB): max(384 MiB, 0.10 x 1024 MiB); the engine's
# bound is half of it.
DEFAULT_BOUND = max(384, int(0.10 * 1024)) * 2**20 // 2


def doctor(runner, *args, memlock_kib=None):
    java = os.path.join(runner.env["JAVA_HOME"], "bin", "java")
    cmd = [java, "-cp", runner.plugin_jar, DOCTOR, *args]
    env = {k: v for k, v in runner.env.items() if k not in ("SPARK_CONF_DIR", "SPARK_HOME")}
    if memlock_kib is not None:
        # Root may lock any amount (CAP_IPC_LOCK): drop the capability, as a pod has none.
        drop = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--"] if os.geteuid() == 0 else []
        cmd = drop + ["bash", "-c", f'ulimit -l {memlock_kib} && exec "$@"', "doctor", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_doctor_on_a_host_without_a_device_says_tcp_and_why(runner):
    rc, out, err = doctor(runner, "--json")
    assert rc == 0, f"rc={rc}\n{out}\n{err}"
    r = json.loads(out)
    print(f"[doctor] host: {json.dumps(r)[:1500]}")
    assert r["ok"] is True and r["exit_code"] == 0
    assert r["auto"]["transport"] == "tcp"
    assert "using tcp because verbs is unusable" in r["auto"]["why"] and "no RDMA device" in r["auto"]["why"], r["auto"]
    assert "error" in r["devices"] and "no RDMA device" in r["devices"]["error"]
    lb = r["loopback"]
    assert lb["ok"] is True and lb["transport"] == "tcp", lb
    assert lb["send"]["bytes"] == lb["read"]["bytes"] == 2**20 and lb["send"]["ms"] > 0 and lb["read"]["ms"] > 0
    assert lb["counters"]["rendezvous_blocks_fetched"] == 1 and lb["counters"]["eager_blocks_fetched"] >= 16
    assert r["memory"]["bound_bytes"] == DEFAULT_BOUND, r["memory"]
    assert "spark.executor.memoryOverhead" in r["memory"]["bound_source"]
    # The text form says the same for a person.
    rc, text, err = doctor(runner)
    assert rc == 0 and "auto picks    tcp: transport=auto: using tcp because" in text, text + err
    assert "verdict       transport auto works on this node (it runs over tcp)" in text, text


def test_doctor_fails_when_verbs_is_asked_for_and_there_is_no_device(runner):
    rc, out, err = doctor(runner, "--json", "--transport", "verbs")
    assert rc == 2, f"rc={rc}\n{out}\n{err}"
    r = json.loads(out)
    assert r["ok"] is False and r["loopback"]["ok"] is False, r
    assert r["verdict"] == "transport verbs cannot work on this node"
    assert "no RDMA device" in r["loopback"]["error"], r["loopback"]


def test_doctor_names_a_lowered_memlock_limit_and_the_setting_to_change(runner):
    rc, out, err = doctor(runner, "--json", memlock_kib=1024, )
    assert rc == 0, f"rc={rc}\n{out}\n{err}"
    r = json.loads(out)
    m = r["memlock"]
    print(f"[doctor] memlock 1 MiB: {m}")
    assert m["limit_bytes"] == 1024 * 1024 and m["cap_ipc_lock"] is False and m["ok"] is False, m
    assert m["needed_bytes"] > m["limit_bytes"]
    for want in ("1048576", "ulimit -l", "spark.shuffle.rdma.pool.capBytes", "spark.executor.memoryOverhead",
                 "IPC_LOCK"):
        assert want in m["message"], f"{want!r} missing from: {m['message']}"
    # Still usable: auto runs over tcp.
    assert r["auto"]["transport"] == "tcp" and r["loopback"]["ok"] is True
