"""``torch.distributed`` backend ``"mobius"``.

Importing this module registers the backend::

    import mobius.torch_backend
    torch.distributed.init_process_group("mobius", rank=r, world_size=n)
    torch.distributed.all_reduce(t)            # and DistributedDataParallel on CPU

Works with torch 2.15 (tested; the version on PyPI when this was written), which has no
``dist.BackendBase``: the backend subclasses ``torch._C._distributed_c10d.Backend``, as
torch's own Python backends can, and is registered for CPU tensors. Ranks exchange their
Mobius addresses through the ``Store`` torch hands the backend (the ``MASTER_ADDR`` /
``MASTER_PORT`` one), so no second rendezvous is needed.

Collectives run synchronously inside the call and return a completed ``Work``; their
futures carry the output tensors, as DDP's communication hooks expect. The timeout torch
passes (``init_process_group(timeout=...)``) bounds each collective unless
``MOBIUS_TIMEOUT`` is set.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend

from . import Communicator, MobiusError, _native

_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.AVG: "avg",
}

# Point-to-point tags at and above this are used inside uneven alltoall.
_ALLTOALL_TAG = 0x7FFF0000


def _op(reduce_op) -> str:
    for k, v in _OPS.items():
        if reduce_op == k:
            return v
    raise ValueError(f"Mobius does not support reduce op {reduce_op}; it supports {', '.join(_OPS.values())}")


class _Work(dist.Work):
    """A collective that already ran: completed, with its outputs (or its error)."""

    def __init__(self, outputs=None, error: BaseException | None = None):
        super().__init__()
        self._outputs = outputs if outputs is not None else []
        self._error = error
        self._future = torch.futures.Future()
        if error is None:
            self._future.set_result(self._outputs)
        else:
            self._future.set_exception(error)

    def is_completed(self):
        return True

    def is_success(self):
        return self._error is None

    def exception(self):
        return self._error

    def wait(self, timeout=timedelta(0)):
        if self._error is not None:
            raise self._error
        return True

    def get_future(self):
        return self._future

    def result(self):
        return self._outputs


def _store_address(store):
    """``(host, port)`` of the TCPStore under the store torch hands a backend (a
    ``PrefixStore`` around the ``TCPStore`` of ``env://``, ``tcp://`` and torchrun), else
    ``MASTER_ADDR``/``MASTER_PORT``, else ``None`` (``file://``: no host to route to)."""
    s = store
    for _ in range(8):
        host = getattr(s, "host", None)
        if isinstance(host, str) and host:
            return host, int(getattr(s, "port", 0) or 0)
        s = getattr(s, "underlying_store", None)
        if s is None:
            break
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT") or 0)
    return None


def _local_ip(store=None) -> str:
    """The address this rank listens on and publishes to the others: ``MOBIUS_IFADDR``, else
    the address of the interface ``MOBIUS_SOCKET_IFNAME``, else that of the interface that
    routes to the store's host, else the default route's (see docs/mobius.md)."""
    host, port = _store_address(store) or (None, 0)
    return _native.local_ip(host, port)


def _group_key(store, rank: int) -> str:
    """The group's id and fresh secret (``id:secret``): rank 0 draws them and sets them in
    the group's store (torch gives each group its own key prefix), the others read them.
    Every mesh link of the group proves the secret before anything is accepted."""
    key = "mobius/group"
    if rank == 0:
        group = _native.new_group_key()
        store.set(key, group)
        return group
    return store.get(key).decode()


class MobiusBackend(_C10dBackend):
    """The Mobius process-group backend (CPU tensors)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._rank, self._size = rank, size

        def exchange(address: str) -> list[str]:
            store.set(f"mobius/addr/{rank}", address)
            return [store.get(f"mobius/addr/{r}").decode() for r in range(size)]

        settings = {"group": _group_key(store, rank)}
        if not os.environ.get("MOBIUS_TIMEOUT") and timeout is not None:
            settings["timeout"] = max(timeout.total_seconds(), 0.001)
        self.comm = Communicator(_native.Communicator.join(rank, size, _local_ip(store), exchange, settings))

    # -- identity --------------------------------------------------------------------------
    def getBackendName(self):
        return "mobius"

    # -- collectives -----------------------------------------------------------------------
    def _run(self, outputs, fn):
        try:
            fn()
        except MobiusError as e:
            # Raise at the call, as gloo does for a failed synchronous collective.
            raise RuntimeError(f"mobius: {e}") from e
        return _Work(outputs)

    def allreduce(self, tensors, opts=None):
        op = _op(opts.reduceOp) if opts is not None else "sum"

        def run():
            for t in tensors:
                self.comm.allreduce(t, op)

        return self._run(tensors, run)

    def allreduce_coalesced(self, tensors, opts=None):
        op = _op(opts.reduceOp) if opts is not None else "sum"

        def run():
            flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].contiguous()
            self.comm.allreduce(flat, op)
            if len(tensors) > 1 or flat.data_ptr() != tensors[0].data_ptr():
                at = 0
                for t in tensors:
                    n = t.numel()
                    t.copy_(flat[at:at + n].view_as(t))
                    at += n

        return self._run(tensors, run)

    def broadcast(self, tensors, opts):
        root = opts.rootRank

        def run():
            for t in tensors:
                self.comm.broadcast(t, root)

        return self._run(tensors, run)

    def reduce(self, tensors, opts):
        return self._run(tensors, lambda: self.comm.reduce(tensors[0], _op(opts.reduceOp), opts.rootRank))

    def allgather(self, output_tensors, input_tensors, opts=None):
        def run():
            for outs, inp in zip(output_tensors, input_tensors):
                flat = torch.empty((self._size * inp.numel(),), dtype=inp.dtype)
                self.comm.allgather(inp.contiguous(), flat)
                for i, o in enumerate(outs):
                    o.copy_(flat[i * inp.numel():(i + 1) * inp.numel()].view_as(o))

        return self._run(output_tensors, run)

    def _allgather_base(self, output, input, opts=None):
        return self._run([output], lambda: self.comm.allgather(input.contiguous(), output))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        def run():
            for o, i in zip(outputs, inputs):
                self.comm.allgather(i.contiguous(), o)

        return self._run(outputs, run)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        op = _op(opts.reduceOp)

        def run():
            for out, ins in zip(output_tensors, input_tensors):
                flat = torch.cat([t.reshape(-1) for t in ins])
                self.comm.reduce_scatter(flat, out, op)

        return self._run(output_tensors, run)

    def _reduce_scatter_base(self, output, input, opts):
        return self._run([output], lambda: self.comm.reduce_scatter(input.contiguous(), output, _op(opts.reduceOp)))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        op = _op(opts.reduceOp)

        def run():
            for o, i in zip(outputs, inputs):
                self.comm.reduce_scatter(i.contiguous(), o, op)

        return self._run(outputs, run)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        def run():
            if not output_split_sizes and not input_split_sizes:
                self.comm.alltoall(input.contiguous(), output)
                return
            self._alltoall_uneven(
                list(output.split(output_split_sizes or [output.shape[0] // self._size] * self._size)),
                list(input.split(input_split_sizes or [input.shape[0] // self._size] * self._size)),
            )

        return self._run([output], run)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return self._run(output_tensors, lambda: self._alltoall_uneven(output_tensors, input_tensors))

    def _alltoall_uneven(self, outs, ins):
        """Blocks of any size, one peer per step (sends complete without the peer's receive,
        so the pairwise order cannot deadlock)."""
        r, p = self._rank, self._size
        outs[r].copy_(ins[r])
        for k in range(1, p):
            to, frm = (r + k) % p, (r - k) % p
            self.comm.send(ins[to].contiguous(), to, _ALLTOALL_TAG + k)
            tmp = outs[frm] if outs[frm].is_contiguous() else torch.empty_like(outs[frm], memory_format=torch.contiguous_format)
            self.comm.recv(tmp, frm, _ALLTOALL_TAG + k)
            if tmp is not outs[frm]:
                outs[frm].copy_(tmp)

    # torch 2.15 names the single-tensor collectives `*_single`; older releases used the
    # underscored names above. Both resolve to the same code.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        return self._run([], self.comm.barrier)

    def send(self, tensors, dst, tag):
        return self._run(tensors, lambda: self.comm.send(tensors[0].contiguous(), dst, tag))

    def recv(self, tensors, src, tag):
        return self._run(tensors, lambda: self.comm.recv(tensors[0], src, tag))

    def recv_anysource(self, tensors, tag):
        raise RuntimeError("mobius: receiving from any source is not supported; name the source rank")


def _create(store, rank, size, timeout):
    return MobiusBackend(store, rank, size, timeout)


if "mobius" not in dist.Backend.backend_list:
    dist.Backend.register_backend("mobius", _create, devices=["cpu"])
