"""Plain-socket ring for the benchmark's TCP ceiling: rank r holds one TCP connection to
r+1 and one from r−1; a step sends a buffer right while receiving one from the left
(non-blocking sockets, one `select` loop, no threads), exactly the data movement of one ring
step, with no reduction. Ranks find each other through files in the run directory."""

from __future__ import annotations

import os
import selectors
import socket
import time
from pathlib import Path

BUF = 4 << 20


def _tune(s: socket.socket) -> None:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUF)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUF)


class RingSockets:
    def __init__(self, rank: int, world: int, port: int):
        self.rank, self.world = rank, world
        cfg_dir = Path(os.environ.get("RING_DIR", "."))
        self.dir = cfg_dir
        lst = socket.socket()
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", 0))
        lst.listen(4)
        (self.dir / f"ring-{port}-{rank}").write_text(str(lst.getsockname()[1]))
        right = (rank + 1) % world
        path = self.dir / f"ring-{port}-{right}"
        deadline = time.monotonic() + 120
        while not path.exists() or not path.read_text():
            if time.monotonic() > deadline:
                raise RuntimeError(f"ring rank {right} never published its port")
            time.sleep(0.01)
        self.right = socket.create_connection(("127.0.0.1", int(path.read_text())))
        self.left, _ = lst.accept()
        lst.close()
        for s in (self.right, self.left):
            _tune(s)
            s.setblocking(False)
        self.sel = selectors.DefaultSelector()

    def step(self, send: bytearray, recv: bytearray) -> None:
        sv, rv = memoryview(send), memoryview(recv)
        sent = got = 0
        sel = self.sel
        sel.register(self.right, selectors.EVENT_WRITE)
        sel.register(self.left, selectors.EVENT_READ)
        try:
            while sent < len(sv) or got < len(rv):
                for key, _ in sel.select():
                    if key.fileobj is self.right:
                        try:
                            sent += self.right.send(sv[sent:])
                        except BlockingIOError:
                            pass
                        if sent >= len(sv):
                            sel.unregister(self.right)
                    else:
                        try:
                            n = self.left.recv_into(rv[got:])
                        except BlockingIOError:
                            continue
                        if n == 0:
                            raise RuntimeError("ring peer closed")
                        got += n
                        if got >= len(rv):
                            sel.unregister(self.left)
        finally:
            for s in (self.right, self.left):
                try:
                    sel.unregister(s)
                except (KeyError, ValueError):
                    pass

    def barrier(self) -> None:
        """A one-byte token around the ring twice."""
        one, tok = bytearray(1), bytearray(1)
        for _ in range(2):
            if self.rank == 0:
                self._send_all(one)
                self._recv_all(tok)
            else:
                self._recv_all(tok)
                self._send_all(one)

    def _send_all(self, b) -> None:
        self.right.setblocking(True)
        self.right.sendall(b)
        self.right.setblocking(False)

    def _recv_all(self, b) -> None:
        self.left.setblocking(True)
        v, got = memoryview(b), 0
        while got < len(b):
            n = self.left.recv_into(v[got:])
            if n == 0:
                raise RuntimeError("ring peer closed")
            got += n
        self.left.setblocking(False)

    def close(self) -> None:
        self.right.close()
        self.left.close()


__all__ = ["RingSockets"]
