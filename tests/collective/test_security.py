"""An authenticated group, in real processes: rank 0 draws a fresh group key and hands it out
through the store; every mesh link proves it. While the group forms (rank 2 held back), rank
0's mesh port gets a silent stranger, random bytes, a rank of the same group with the wrong
secret and a rank of another group (an earlier job reusing the port): each is refused and
logged. The group then forms and runs checked allreduces, and while they run every rank's
port refuses connections (the listener closed once the group was complete)."""

import json
import os
import socket
import struct
import subprocess
import sys
import time

from harness import HERE, Group

STORE_SET, STORE_GET = 1, 2


def store_op(port: int, op: int, key: str, value: str = "", timeout: float = 60) -> str:
    """SET or GET on Mobius' own store (rank 0 serves it while the group forms, once it
    started)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, f"the store on port {port} never came up"
            time.sleep(0.05)
    with s:
        k, v = key.encode(), value.encode()
        s.sendall(bytes([op]) + struct.pack(">I", len(k)) + k + struct.pack(">I", len(v)) + v)
        f = s.makefile("rb")
        op = f.read(1)
        assert op == b"\x80", f"store answered {op!r} for {key}"
        (n,) = struct.unpack(">I", f.read(4))
        f.read(n)
        (n,) = struct.unpack(">I", f.read(4))
        return f.read(n).decode()


def closed_by_peer(s: socket.socket, limit: float) -> bool:
    """Whether the peer closes `s` (EOF or reset) within `limit` seconds, sending nothing
    that is not a refusal."""
    s.settimeout(limit)
    try:
        while True:
            b = s.recv(65536)
            if not b:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def wait_for(cond, what, g, limit=120):
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {limit} s:\n{g.tail()}"
        assert all(p.poll() is None for p in g.procs.values()), f"a rank exited early ({what}):\n{g.tail()}"
        time.sleep(0.05)


def intruder(tmp_path, name, addresses, group):
    args = {"claim": 2, "addresses": addresses, "group": group, "name": name}
    env = dict(os.environ, RANK="2", WORLD_SIZE="3")
    p = subprocess.run([sys.executable, str(HERE / "worker_hosts.py"), "intruder", json.dumps(args), str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((tmp_path / name).read_text())


def test_strangers_garbage_and_other_groups_are_refused_and_the_group_computes_right(tmp_path):
    # On tcp: this is the network-facing handshake (shm's own refusals, wrong secret and
    # another uid, are fabric's shm tests). And the stand-in card for rank 2 below would
    # otherwise put ranks 0 and 1 on tcp and the real rank 2, which reads its own card, on shm.
    g = Group("secure_loop", 3, tmp_path, {"timeout": 90}, ranks=[0, 1], script="worker_hosts.py",
              env={"MOBIUS_TIMEOUT": "90", "MOBIUS_TRANSPORT": "tcp"})
    try:
        victim = store_op(g.port, STORE_GET, "mobius/mobius/addr/0")
        gid, _secret = store_op(g.port, STORE_GET, "mobius/mobius/group").split(":")
        # A stand-in address for rank 2, so ranks 0 and 1 finish the address exchange and
        # start their meshes (accepting connections) while the real rank 2 is held back.
        # Nobody connects to rank 2 (the highest rank connects to the others), so the real
        # one, which publishes its own address later, joins normally.
        store_op(g.port, STORE_SET, "mobius/mobius/addr/2", "127.0.0.1:9")
        host, port = victim.split(" ")[0].rsplit(":", 1)
        addr = (host, int(port))

        # A stranger that connects and says nothing; one that sends random bytes.
        silent = socket.create_connection(addr)
        junk = socket.create_connection(addr)
        junk.sendall(os.urandom(4096))
        assert closed_by_peer(junk, 30), "random bytes did not get the connection closed"
        # A rank that knows the group's id (it travels in clear) but not its secret, and a
        # rank of another group (an earlier job's rank on a reused port).
        fake_secret = os.urandom(32).hex()
        wrong = intruder(tmp_path, "wrong_secret.json", [victim, "127.0.0.1:9", None], f"{gid}:{fake_secret}")
        assert not wrong["joined"] and "secret" in wrong["error"], wrong
        other = intruder(tmp_path, "other_group.json", [victim, "127.0.0.1:9", None],
                         f"{os.urandom(8).hex()}:{os.urandom(32).hex()}")
        assert not other["joined"] and "job" in other["error"] and gid in other["error"], other
        # The silent stranger is dropped at the handshake limit (10 s), before the group forms.
        assert closed_by_peer(silent, 30), "a silent stranger was kept past the handshake limit"

        # Rank 0 logged every one of them (tracing warnings on stderr).
        log0 = g.logs[0].read_text()
        assert log0.count("mesh: dropped an unauthenticated connection") >= 2, log0
        assert "mesh: a connecting peer gave up its handshake" in log0, log0   # wrong secret
        assert "mesh: refused a connection" in log0 and "mobius/" in log0, log0  # other group

        # The real rank 2 joins; the group forms and computes.
        g.start(2)
        wait_for(lambda: all((tmp_path / f"looping{r}").exists() for r in range(3)), "the allreduce loop", g)
        # Each rank's own published address (ranks 0 and 1 hold the stand-in for rank 2).
        own = [json.loads((tmp_path / f"ready{r}").read_text())[r] for r in range(3)]
        # While allreduces run, nothing listens on any rank's mesh port any more.
        for a in own:
            h, p = a.rsplit(":", 1)
            try:
                s = socket.create_connection((h, int(p)), timeout=5)
            except ConnectionRefusedError:
                continue
            s.sendall(os.urandom(1024))
            assert closed_by_peer(s, 30), f"{a} accepted a stranger during the allreduces"
        (tmp_path / "stop").write_text("")
        codes = g.wait(180)
    finally:
        g.kill_all()
    assert all(c == 0 for c in codes.values()), f"{codes}\n{g.tail()}"
    for r in range(3):
        res = g.result(r)
        assert res["iters"] >= 1 and res["bad"] == 0, (r, res)
        assert res["addresses"][r] == own[r]


def test_a_wrong_secret_is_refused_at_once_on_every_provider(tmp_path):
    from harness import run
    for transport in ("shm", "tcp"):
        res = run("wrong_secret", 2, tmp_path / transport, {"transport": transport, "timeout": 5}, timeout=120)
        wrong = res[1]
        assert "authentication" in (wrong["error"] or ""), (transport, wrong)
        # Refused is final: no retrying until the timeout (60 s on that rank).
        assert wrong["seconds"] < 2, (transport, wrong)
        assert res[0]["error"] and "rank(s) [1]" in res[0]["error"], (transport, res[0])
