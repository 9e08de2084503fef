"""Launching a group of real processes for the Mobius tests.

Each rank is a separate Python process running ``worker.py <scenario>`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, as torchrun would. A worker writes its
result as JSON to ``<outdir>/rank<r>.json``. Every launch has a hard wall-clock limit: a hang
kills the whole group and fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Ports of this suite: 29500-29999 (the range assigned to the Mobius tests). Launches take
# them in turn, from an offset that differs between concurrent test sessions, wrapping
# around and skipping ports in use.
_LOW, _HIGH = 29500, 30000
_next = _LOW + (os.getpid() * 37) % (_HIGH - _LOW)


def free_port() -> int:
    global _next
    for _ in range(_HIGH - _LOW):
        port = _next
        _next = _LOW + (_next + 1 - _LOW) % (_HIGH - _LOW)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_LOW}-{_HIGH - 1}")


class Group:
    """A launched group of ranks."""

    def __init__(self, scenario: str, world: int, outdir: Path, args: dict | None = None,
                 env: dict | None = None, ranks: list[int] | None = None, script: str = "worker.py"):
        self.world = world
        self.outdir = Path(outdir)
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}
        self._cmd = [sys.executable, str(HERE / script), scenario, json.dumps(args or {}), str(self.outdir)]
        base = dict(os.environ)
        base.update({
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            "MOBIUS_TUNE": base.get("MOBIUS_TUNE", "off"),
            "PYTHONUNBUFFERED": "1",
        })
        base.update(env or {})
        self._env = base
        for r in ranks if ranks is not None else range(world):
            self.start(r)

    def start(self, r: int) -> None:
        """Starts rank ``r`` (for groups launched with some ranks held back)."""
        log = self.outdir / f"rank{r}.log"
        self.logs[r] = log
        self.procs[r] = subprocess.Popen(self._cmd, env=dict(self._env, RANK=str(r)), stdout=open(log, "w"),
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float) -> dict[int, int]:
        """Waits for every rank; kills them all and raises if the limit passes."""
        deadline = time.monotonic() + timeout
        codes = {}
        for r, p in self.procs.items():
            left = deadline - time.monotonic()
            try:
                codes[r] = p.wait(timeout=max(left, 0.01))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise AssertionError(f"rank {r} still running after {timeout:.0f} s (hang); logs:\n{self.tail()}")
        return codes

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()

    def result(self, rank: int):
        path = self.outdir / f"rank{rank}.json"
        if not path.exists():
            raise AssertionError(f"rank {rank} wrote no result; its log:\n{self.logs[rank].read_text()[-4000:]}")
        return json.loads(path.read_text())

    def results(self) -> dict[int, object]:
        return {r: self.result(r) for r in self.procs}

    def tail(self) -> str:
        return "\n".join(f"--- rank {r}\n{log.read_text()[-3000:]}" for r, log in self.logs.items() if log.exists())


def run(scenario: str, world: int, outdir: Path, args: dict | None = None, env: dict | None = None,
        timeout: float = 300, script: str = "worker.py") -> dict[int, object]:
    """Runs a group to completion; every rank must exit 0."""
    g = Group(scenario, world, outdir, args, env, script=script)
    codes = g.wait(timeout)
    bad = {r: c for r, c in codes.items() if c != 0}
    assert not bad, f"ranks exited with {bad}; logs:\n{g.tail()}"
    return g.results()
