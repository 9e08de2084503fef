"""Mobius: collective communication for deep learning.

Works in place on numpy arrays and torch CPU tensors, without copies::

    import mobius, numpy as np
    comm = mobius.init()            # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    grads = np.ones(1 << 20, dtype=np.float32)
    comm.allreduce(grads, op="avg")

As a ``torch.distributed`` backend::

    import mobius.torch_backend     # registers "mobius"
    torch.distributed.init_process_group("mobius")

Buffers go to the native library through the buffer protocol (a torch tensor through its
zero-copy numpy view, ``Tensor.numpy()``, which shares the tensor's memory), so a collective
reads and writes the caller's memory directly, with the GIL released.

Settings come from the environment (``MOBIUS_*``, see the README) and can be passed as
keyword arguments to :func:`init`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from . import _native
from ._native import MobiusError

__all__ = ["Communicator", "MobiusError", "init", "capabilities", "DTYPES", "REDUCE_OPS"]

capabilities = _native.capabilities
DTYPES = tuple(capabilities()["dtypes"])
REDUCE_OPS = tuple(capabilities()["reduce_ops"])

_NUMPY = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
    np.dtype(np.float16): "f16",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
    np.dtype(np.uint8): "u8",
    np.dtype(np.int8): "i8",
    np.dtype(np.int16): "i16",
    np.dtype(np.bool_): "bool",
}


def _torch_dtypes() -> dict:
    torch = sys.modules["torch"]
    return {
        torch.float32: "f32",
        torch.float64: "f64",
        torch.float16: "f16",
        torch.bfloat16: "bf16",
        torch.int32: "i32",
        torch.int64: "i64",
        torch.uint8: "u8",
        torch.int8: "i8",
        torch.int16: "i16",
        torch.bool: "bool",
    }


def as_buffer(x: Any, what: str = "tensor", dtype: str | None = None) -> tuple[Any, str]:
    """Returns ``(object exporting x's memory through the buffer protocol, dtype name)``.

    No copy is made: a torch tensor becomes its numpy view (bfloat16 viewed as int16, which
    numpy lacks); a numpy array is used as is. ``dtype`` overrides the element type (for
    example ``"bf16"`` for a uint16 numpy array holding bfloat16 bits).
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"`{what}` is on {x.device}; Mobius moves CPU tensors (copy it with .cpu() first)")
        if not x.is_contiguous():
            raise ValueError(f"`{what}` is not contiguous; pass a contiguous tensor (.contiguous() copies)")
        names = _torch_dtypes()
        if x.dtype not in names:
            raise ValueError(f"`{what}` has dtype {x.dtype}; Mobius supports {', '.join(DTYPES)}")
        t = x.detach()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        return t.numpy(), dtype or names[x.dtype]
    if isinstance(x, np.ndarray):
        if dtype is None:
            if x.dtype not in _NUMPY:
                raise ValueError(f"`{what}` has dtype {x.dtype}; Mobius supports {', '.join(DTYPES)}")
            dtype = _NUMPY[x.dtype]
        return x, dtype
    if isinstance(x, (bytearray, memoryview, bytes)):
        return x, dtype or "u8"
    raise TypeError(f"`{what}` must be a numpy array, a torch CPU tensor or a bytes-like object, not {type(x).__name__}")


def _op(op: Any) -> str:
    if isinstance(op, str):
        return op.lower()
    # torch.distributed.ReduceOp and its RedOpType
    name = str(op).split(".")[-1].lower()
    return {"product": "prod", "average": "avg"}.get(name, name)


class Communicator:
    """A group of ranks running collectives. Every rank must make the same calls, in the same
    order, with matching arguments; a mismatch raises :class:`MobiusError` naming the argument
    on every rank. After any failure the communicator is unusable; create a new one."""

    def __init__(self, native: Any):
        self._c = native

    @property
    def rank(self) -> int:
        return self._c.rank

    @property
    def world_size(self) -> int:
        return self._c.world_size

    def allreduce(self, x, op="sum", dtype=None):
        """Reduces ``x`` across ranks in place (``sum``, ``prod``, ``min``, ``max``, ``avg``;
        ``band``, ``bor``, ``bxor`` on integers and bool).

        ``dtype`` (every method has it) overrides the element type, e.g. ``"bf16"`` for a
        ``uint16`` numpy array holding bfloat16 bits."""
        b, d = as_buffer(x, dtype=dtype)
        self._c.allreduce(b, d, _op(op))
        return x

    def broadcast(self, x, root=0, dtype=None):
        """Copies ``root``'s ``x`` into every rank's ``x``."""
        b, d = as_buffer(x, dtype=dtype)
        self._c.broadcast(b, d, root)
        return x

    def reduce(self, x, op="sum", root=0, dtype=None):
        """Reduces into ``root``'s ``x``; other ranks' ``x`` hold partial results afterwards."""
        b, d = as_buffer(x, dtype=dtype)
        self._c.reduce(b, d, _op(op), root)
        return x

    def allgather(self, input, output, dtype=None):
        """``output`` (world × ``input`` elements) gets every rank's ``input`` in rank order.
        ``input`` may be this rank's block of ``output`` (in place, no copy of it is made);
        an input overlapping the output elsewhere is copied first."""
        bi, d = as_buffer(input, "input", dtype)
        bo, do = as_buffer(output, "output", dtype)
        _same(d, do, "allgather")
        self._c.allgather(bi, bo, d)
        return output

    def reduce_scatter(self, input, output, op="sum", dtype=None):
        """``input`` holds world blocks of ``output``'s size; rank i's ``output`` gets block i
        reduced across ranks. ``output`` may lie inside ``input`` (the input is read first)."""
        bi, d = as_buffer(input, "input", dtype)
        bo, do = as_buffer(output, "output", dtype)
        _same(d, do, "reduce_scatter")
        self._c.reduce_scatter(bi, bo, d, _op(op))
        return output

    def alltoall(self, input, output, dtype=None):
        """Block j of ``input`` goes to rank j, into block ``rank`` of its ``output``.
        ``input`` and ``output`` may be the same buffer."""
        bi, d = as_buffer(input, "input", dtype)
        bo, do = as_buffer(output, "output", dtype)
        _same(d, do, "alltoall")
        self._c.alltoall(bi, bo, d)
        return output

    def barrier(self):
        """Returns once every rank has called it."""
        self._c.barrier()

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A barrier that names who is missing (as torch's ``monitored_barrier``): rank 0
        raises ``MobiusError`` naming the first rank that did not come within ``timeout``
        seconds (default: the communicator's timeout), or all of them with
        ``wait_all_ranks``; the other ranks raise when rank 0 does not release them."""
        self._c.monitored_barrier(self._c.timeout if timeout is None else float(timeout), bool(wait_all_ranks))

    def send(self, x, dst, tag=0):
        """Sends ``x`` to rank ``dst`` (returns when ``x`` may be reused)."""
        b, _ = as_buffer(x)
        self._c.send(b, dst, tag)

    def recv(self, x, src, tag=0):
        """Receives into ``x`` from rank ``src``; the sender must send exactly ``x``'s size."""
        b, _ = as_buffer(x)
        self._c.recv(b, src, tag)
        return x

    def recv_any(self, x, tag=0) -> int:
        """Receives into ``x`` from whichever rank sends under ``tag`` first; returns that rank."""
        b, _ = as_buffer(x)
        return self._c.recv_any(b, tag)

    def decide(self, op, nbytes, dtype="f32"):
        """The policy's choice for ``op`` over ``nbytes``: ``(algorithm, segment, protocol)``."""
        return self._c.decide(op, nbytes, dtype)

    def cost_model(self) -> dict:
        """The measured α, β, γ, copy and rendezvous latency (seconds, seconds per byte); α
        and β are the network links', ``local_alpha`` and ``local_beta`` the same-host links'."""
        return self._c.cost_model()

    def link_costs(self) -> list:
        """(rank 0) Every link measured at start as ``(a, b, alpha, beta, alpha_rndv)``; the
        cost model takes the worst of them. Empty on other ranks and with ``tune`` off."""
        return self._c.link_costs()

    @property
    def hosts(self) -> list:
        """The host index of each rank (hosts numbered by their lowest rank), from the host
        identities the ranks published at start (``MOBIUS_HOST_ID`` overrides one)."""
        return self._c.hosts

    @property
    def addresses(self) -> list:
        """Every rank's published mesh address (``ip:port``), in rank order."""
        return self._c.addresses

    def stats(self) -> dict:
        """Counters: calls per ``op.algorithm``, messages and bytes per protocol."""
        return self._c.stats()

    def close(self):
        """Leaves the group (peers see a clean departure, not a failure)."""
        self._c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _same(a: str, b: str, op: str) -> None:
    if a != b:
        raise ValueError(f"{op}: `input` is {a} but `output` is {b}; they must have the same dtype")


def init(rank: int | None = None, world_size: int | None = None, master_addr: str | None = None,
         master_port: int | None = None, **settings) -> Communicator:
    """Joins a group through a TCP store served by rank 0. Arguments default to the
    environment's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` (127.0.0.1) and ``MASTER_PORT``.

    ``settings``: ``timeout`` (seconds), ``transport`` (``"auto"`` | ``"tcp"`` | ``"shm"`` | ``"verbs"``), ``secret``,
    ``job``, ``algo``, ``proto``, ``segment``, ``eager_limit``, ``max_message``, ``tune``,
    ``debug_policy``; unset ones come from ``MOBIUS_*`` variables.
    """
    def env(name):
        v = os.environ.get(name)
        if v is None or v == "":
            raise ValueError(f"{name} is not set and was not passed")
        return v

    rank = int(env("RANK")) if rank is None else rank
    world_size = int(env("WORLD_SIZE")) if world_size is None else world_size
    master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1") if master_addr is None else master_addr
    master_port = int(env("MASTER_PORT")) if master_port is None else master_port
    return Communicator(_native.Communicator.init(rank, world_size, master_addr, master_port, settings))
