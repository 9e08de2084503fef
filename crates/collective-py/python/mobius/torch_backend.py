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

Every call returns at once with a pending ``Work``. Each process group runs its collectives
in call order on a worker thread of its own (its progress context, as gloo's async work);
the native call releases the GIL, so Python (and DDP's backward) runs meanwhile.
Point-to-point calls run beside the collectives on their own ordered lanes: one for sends,
one per source rank for receives, one for receives from any source. So ``isend``/``irecv``
never block, and ``batch_isend_irecv`` works with its operations in any order.
``Work.wait()``, ``is_completed()`` and ``get_future()`` report the truth; a failure (a dead
peer, a timeout, an unsupported dtype × op) is raised by ``wait`` and set on the future.
The timeout torch passes (``init_process_group(timeout=...)``) bounds each call unless
``MOBIUS_TIMEOUT`` is set.
"""

from __future__ import annotations

import os
import queue
import threading
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
    dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}

# Tags at and above this are the backend's own (collectives built on point-to-point
# messages); user tags must stay below it.
_RESERVED_TAG = 0x7FFF0000
_ALLTOALL_TAG = _RESERVED_TAG
_GATHER_TAG = _RESERVED_TAG + 0x8000
_SCATTER_TAG = _RESERVED_TAG + 0x8001


def _op(reduce_op) -> str:
    for k, v in _OPS.items():
        if reduce_op == k:
            return v
    # A ReduceOp made by a helper (PREMUL_SUM) prints as an object; its `op` has the name.
    name = str(getattr(reduce_op, "op", reduce_op)).rsplit(".", 1)[-1]
    raise ValueError(f"Mobius does not support reduce op {name}; it supports {', '.join(_OPS.values())}")


def _user_tag(tag: int) -> int:
    if not 0 <= tag < _RESERVED_TAG:
        raise ValueError(f"mobius: tag {tag} is outside 0..{_RESERVED_TAG - 1} (tags above are the backend's own)")
    return tag


class _Work(dist.Work):
    """One call of a process group: pending until its lane has run it.

    ``wait()`` blocks until the call finished (or ``timeout`` passed, when given) and raises
    its error; the future completes with the outputs, or with the error."""

    def __init__(self, label: str, outputs, fn):
        super().__init__()
        self._label = label
        self._outputs = outputs if outputs is not None else []
        self._fn = fn
        self._error: BaseException | None = None
        self._source: int = -1
        self._done = threading.Event()
        self._future = torch.futures.Future()

    def _run(self) -> None:
        try:
            source = self._fn()
            if isinstance(source, int):
                self._source = source
        except BaseException as e:  # noqa: BLE001 - every failure belongs to the Work
            self._error = RuntimeError(f"mobius: {self._label} failed: {e}")
            self._error.__cause__ = e
        self._fn = None
        # The future first: DDP's callbacks chained on it run here, on the lane, before
        # `wait()` returns to a caller that then reads the outputs.
        if self._error is None:
            self._future.set_result(self._outputs)
        else:
            self._future.set_exception(self._error)
        self._done.set()

    def is_completed(self):
        return self._done.is_set()

    def is_success(self):
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def wait(self, timeout=timedelta(0)):
        secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)
        if not self._done.wait(secs if secs > 0 else None):
            raise RuntimeError(f"mobius: {self._label} did not complete within {secs:g} s (Work.wait timeout)")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self):
        return self._future

    def result(self):
        return self._outputs

    def _source_rank(self):
        return self._source

    def source_rank(self):
        return self._source


class _Lane:
    """Runs Works one after another, in submission order, on a daemon thread of its own."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: _Work) -> _Work:
        self._q.put(work)
        return work

    def _loop(self) -> None:
        while True:
            work = self._q.get()
            if work is None:
                return
            work._run()

    def stop(self) -> None:
        self._q.put(None)

    def join(self) -> None:
        self._thread.join()


def _staged(t: torch.Tensor):
    """``(contiguous tensor to hand to Mobius, function writing it back into t)``."""
    if t.is_contiguous():
        return t, lambda: None
    c = t.contiguous()
    return c, lambda: t.copy_(c)


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


def _generation(store, size: int) -> int:
    """How many groups of this size were made under this store prefix before this one.
    torch gives each group its own prefix, but a process group made again after
    ``destroy_process_group`` (the same script initialising twice, a test suite) gets the
    same prefix on the same store, where the last group's keys still are: read as this
    group's, its stale secret and addresses failed every handshake until the timeout. Every
    rank counts itself in; all ranks of one group do so before any can make the next."""
    return (store.add("mobius/joined", 1) - 1) // size


def _group_key(store, rank: int, prefix: str) -> str:
    """The group's id and fresh secret (``id:secret``): rank 0 draws them and sets them in
    the group's store, the others read them. Every mesh link of the group proves the secret
    before anything is accepted."""
    key = f"{prefix}/group"
    if rank == 0:
        group = _native.new_group_key()
        store.set(key, group)
        return group
    return store.get(key).decode()


class MobiusBackend(_C10dBackend):
    """The Mobius process-group backend (CPU tensors)."""

    # torch's property of the same name calls back into the Python object, which recursed
    # without end (RecursionError in batch_isend_irecv). Point-to-point Works are
    # independent, so batch_isend_irecv needs no coalescing: it posts each op, in any order.
    supports_coalescing = False

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._rank, self._size = rank, size

        prefix = f"mobius/{_generation(store, size)}"

        def exchange(address: str) -> list[str]:
            store.set(f"{prefix}/addr/{rank}", address)
            return [store.get(f"{prefix}/addr/{r}").decode() for r in range(size)]

        settings = {"group": _group_key(store, rank, prefix)}
        if not os.environ.get("MOBIUS_TIMEOUT") and timeout is not None:
            settings["timeout"] = max(timeout.total_seconds(), 0.001)
        self.comm = Communicator(_native.Communicator.join(rank, size, _local_ip(store), exchange, settings))
        self._lanes_lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}

    def shutdown(self) -> None:
        """Called by torch's ``destroy_process_group``: every queued Work runs to its end,
        then the communicator leaves the group (its last sends delivered, its peers told of
        a clean departure) while the interpreter is whole. Left to the interpreter's
        teardown instead, a process that then leaves with ``os._exit`` lost sends a peer
        still waited for."""
        with self._lanes_lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.stop()
        for lane in lanes:
            lane.join()
        self.comm.close()

    def _lane(self, name: str) -> _Lane:
        with self._lanes_lock:
            lane = self._lanes.get(name)
            if lane is None:
                lane = self._lanes[name] = _Lane(f"mobius-r{self._rank}-{name}")
            return lane

    def _submit(self, lane: str, label: str, outputs, fn) -> _Work:
        return self._lane(lane).submit(_Work(label, outputs, fn))

    def _collective(self, label: str, outputs, fn) -> _Work:
        """Queues a collective on the group's collective lane (calls run in call order)."""
        return self._submit("coll", label, outputs, fn)

    # -- identity --------------------------------------------------------------------------
    def getBackendName(self):
        return "mobius"

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = _op(opts.reduceOp) if opts is not None else "sum"

        def run():
            for t in tensors:
                c, back = _staged(t)
                self.comm.allreduce(c, op)
                back()

        return self._collective(f"allreduce ({op})", tensors, run)

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

        return self._collective(f"allreduce_coalesced ({op})", tensors, run)

    def broadcast(self, tensors, opts):
        root = opts.rootRank

        def run():
            for t in tensors:
                c, back = _staged(t)
                self.comm.broadcast(c, root)
                back()

        return self._collective(f"broadcast (root {root})", tensors, run)

    def reduce(self, tensors, opts):
        op, root = _op(opts.reduceOp), opts.rootRank

        def run():
            c, back = _staged(tensors[0])
            self.comm.reduce(c, op, root)
            back()

        return self._collective(f"reduce ({op}, root {root})", tensors, run)

    def _allgather_into(self, outs, inp):
        flat = torch.empty((self._size * inp.numel(),), dtype=inp.dtype)
        self.comm.allgather(inp.contiguous(), flat)
        for i, o in enumerate(outs):
            o.copy_(flat[i * inp.numel():(i + 1) * inp.numel()].view_as(o))

    def allgather(self, output_tensors, input_tensors, opts=None):
        def run():
            for outs, inp in zip(output_tensors, input_tensors):
                self._allgather_into(outs, inp)

        return self._collective("allgather", output_tensors, run)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        def run():
            for outs, inp in zip(output_lists, input_list):
                self._allgather_into(outs, inp)

        return self._collective("allgather_coalesced", output_lists, run)

    def _allgather_base(self, output, input, opts=None):
        def run():
            c, back = _staged(output)
            self.comm.allgather(input.contiguous(), c)
            back()

        return self._collective("allgather_into_tensor", [output], run)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        def run():
            for o, i in zip(outputs, inputs):
                c, back = _staged(o)
                self.comm.allgather(i.contiguous(), c)
                back()

        return self._collective("allgather_into_tensor_coalesced", outputs, run)

    def gather(self, output_tensors, input_tensors, opts):
        """Root receives every rank's tensor (rank order); the others send theirs."""
        root, r = opts.rootRank, self._rank

        def run():
            inp = input_tensors[0].contiguous()
            if r != root:
                self.comm.send(inp, root, _GATHER_TAG)
                return
            outs = output_tensors[0]
            for src in range(self._size):
                if src == r:
                    outs[src].copy_(inp.view_as(outs[src]))
                    continue
                c, back = _staged(outs[src])
                self.comm.recv(c, src, _GATHER_TAG)
                back()

        return self._collective(f"gather (root {root})", output_tensors, run)

    def scatter(self, output_tensors, input_tensors, opts):
        """Root sends block j to rank j; the others receive theirs."""
        root, r = opts.rootRank, self._rank

        def run():
            out = output_tensors[0]
            if r != root:
                c, back = _staged(out)
                self.comm.recv(c, root, _SCATTER_TAG)
                back()
                return
            ins = input_tensors[0]
            for dst in range(self._size):
                if dst != r:
                    self.comm.send(ins[dst].contiguous(), dst, _SCATTER_TAG)
            out.copy_(ins[r].view_as(out))

        return self._collective(f"scatter (root {root})", output_tensors, run)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        op = _op(opts.reduceOp)

        def run():
            for out, ins in zip(output_tensors, input_tensors):
                flat = torch.cat([t.reshape(-1) for t in ins])
                c, back = _staged(out)
                self.comm.reduce_scatter(flat, c, op)
                back()

        return self._collective(f"reduce_scatter ({op})", output_tensors, run)

    def _reduce_scatter_base(self, output, input, opts):
        op = _op(opts.reduceOp)

        def run():
            c, back = _staged(output)
            self.comm.reduce_scatter(input.contiguous(), c, op)
            back()

        return self._collective(f"reduce_scatter_tensor ({op})", [output], run)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        op = _op(opts.reduceOp)

        def run():
            for o, i in zip(outputs, inputs):
                c, back = _staged(o)
                self.comm.reduce_scatter(i.contiguous(), c, op)
                back()

        return self._collective(f"reduce_scatter_tensor_coalesced ({op})", outputs, run)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        def run():
            if not output_split_sizes and not input_split_sizes and output.is_contiguous():
                self.comm.alltoall(input.contiguous(), output)
                return
            self._alltoall_uneven(
                list(output.split(output_split_sizes or [output.shape[0] // self._size] * self._size)),
                list(input.split(input_split_sizes or [input.shape[0] // self._size] * self._size)),
            )

        return self._collective("alltoall_base", [output], run)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return self._collective("alltoall", output_tensors, lambda: self._alltoall_uneven(output_tensors, input_tensors))

    def _alltoall_uneven(self, outs, ins):
        """Blocks of any size, one peer per step (sends complete without the peer's receive,
        so the pairwise order cannot deadlock)."""
        r, p = self._rank, self._size
        outs[r].copy_(ins[r])
        for k in range(1, p):
            to, frm = (r + k) % p, (r - k) % p
            self.comm.send(ins[to].contiguous(), to, _ALLTOALL_TAG + k)
            c, back = _staged(outs[frm])
            self.comm.recv(c, frm, _ALLTOALL_TAG + k)
            back()

    # torch 2.15 names the single-tensor collectives `*_single`; older releases used the
    # underscored names above. Both resolve to the same code.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        return self._collective("barrier", [], self.comm.barrier)

    def monitored_barrier(self, opts, wait_all_ranks=False):
        """``dist.monitored_barrier`` (gloo's debugging barrier): after the collectives queued
        before it, rank 0 waits up to ``opts.timeout`` for every rank and raises naming
        those that did not come (the first, or all with ``wait_all_ranks``)."""
        secs = opts.timeout.total_seconds()
        work = self._collective(f"monitored barrier ({secs:g} s)", [], lambda: self.comm.monitored_barrier(secs, wait_all_ranks))
        work.wait()

    # -- point to point: beside the collectives, never blocking the caller ------------------
    def send(self, tensors, dst, tag):
        tag = _user_tag(tag)
        t = tensors[0].contiguous()
        return self._submit("send", f"send to rank {dst} (tag {tag})", tensors, lambda: self.comm.send(t, dst, tag))

    def recv(self, tensors, src, tag):
        tag = _user_tag(tag)

        def run():
            c, back = _staged(tensors[0])
            self.comm.recv(c, src, tag)
            back()
            return src

        return self._submit(f"recv{src}", f"recv from rank {src} (tag {tag})", tensors, run)

    def recv_anysource(self, tensors, tag):
        tag = _user_tag(tag)

        def run():
            c, back = _staged(tensors[0])
            src = self.comm.recv_any(c, tag)
            back()
            return src

        return self._submit("recv-any", f"recv from any rank (tag {tag})", tensors, run)


def _create(store, rank, size, timeout):
    return MobiusBackend(store, rank, size, timeout)


if "mobius" not in dist.Backend.backend_list:
    dist.Backend.register_backend("mobius", _create, devices=["cpu"])
