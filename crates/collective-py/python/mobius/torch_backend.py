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
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _C10d
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

    def __init__(self, label: str, outputs, fn, group=None):
        super().__init__()
        self._group = group
        self._label = label
        self._outputs = outputs if outputs is not None else []
        self._fn = fn
        self._error: BaseException | None = None
        self._source: int = -1
        self._done = threading.Event()
        # The future callers (and DDP's reducer, in C++) see is completed by a callback of
        # a trigger: a callback that raises gives it a real error. (`Future.set_exception`
        # only completes a future with the exception as its *value*, which C++ consumers
        # such as DDP then read as their tensors: the process crashed.)
        self._trigger = torch.futures.Future()
        self._future = self._trigger.then(self._outcome)

    def _run(self) -> None:
        failed = self._group._failure() if self._group is not None else None
        if failed is not None:
            # The group failed or was aborted: what is queued behind ends at once, with
            # the error that ended it, instead of waiting on a peer that is gone.
            self._error = RuntimeError(f"mobius: {self._label} not run: {failed}")
        else:
            try:
                source = self._fn()
                if isinstance(source, int):
                    self._source = source
            except BaseException as e:  # noqa: BLE001 - every failure belongs to the Work
                self._error = RuntimeError(f"mobius: {self._label} failed: {e}")
                self._error.__cause__ = e
                if self._group is not None:
                    self._group._note(e)
        self._fn = None
        # The future first: DDP's callbacks chained on it run here, on the lane, before
        # `wait()` returns to a caller that then reads the outputs.
        self._trigger.set_result(None)
        self._done.set()

    def _outcome(self, _trigger):
        if self._error is not None:
            raise self._error
        return self._outputs

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


def _future_error(fut):
    """The error a completed future holds, or ``None``. (A Python backend's future, seen
    through the Work torch hands back, may give the error back as its value.)"""
    try:
        v = fut.value()
    except Exception as e:  # noqa: BLE001 - the error is the answer
        return e
    return v if isinstance(v, BaseException) else None


def _patch_torch_work() -> None:
    """Makes ``is_completed()``, ``is_success()`` and ``exception()`` of the Work that
    ``torch.distributed`` hands back tell the truth for Works of a Python backend.

    torch wraps the Work a Python backend returns in a C++ holder (``PyWorkHolder``) that
    forwards only ``wait()`` and ``get_future()`` to it; its other methods answer from the
    holder's own state, which nothing ever completes: ``is_completed()`` stays ``False``
    forever, also after ``wait()``, and ``exception()`` never has the error. The future is
    the truth (it completes when the Work does, with its error), so where torch's own answer
    is "pending", these ask the future. A Work whose C++ state is right (gloo's, a completed
    one) is answered by torch as before: only "still pending" is ever looked at again."""
    W = dist.Work
    if getattr(W, "_mobius_truthful", False):
        return
    base_completed, base_success, base_exception = W.is_completed, W.is_success, W.exception

    def future(w):
        try:
            return w.get_future()
        except Exception:  # noqa: BLE001 - a Work without a future keeps torch's answers
            return None

    def is_completed(self):
        if base_completed(self):
            return True
        fut = future(self)
        return fut is not None and fut.done()

    def is_success(self):
        if not base_success(self):
            return False
        if base_completed(self):
            return True
        fut = future(self)
        return fut is None or not fut.done() or _future_error(fut) is None

    def exception(self):
        e = base_exception(self)
        if e is not None or base_completed(self):
            return e
        fut = future(self)
        return _future_error(fut) if fut is not None and fut.done() else None

    is_completed.__doc__, is_success.__doc__, exception.__doc__ = (
        base_completed.__doc__, base_success.__doc__, base_exception.__doc__)
    W.is_completed, W.is_success, W.exception = is_completed, is_success, exception
    W._mobius_truthful = True


_patch_torch_work()


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


# Backends made by shrink(): torch's shrink_group calls it from Python and registers the
# result with a new ProcessGroup, which holds only the C++ half; without a reference here the
# Python half was freed and the next call into it crashed. Kept for the process's life (a
# closed backend is a few small objects).
_PINNED: list = []

# The cost model of the first group this process measured (its default group): groups made
# after it run over the same links, and take it instead of measuring their own.
_MEASURED: dict | None = None


class MobiusBackend(_C10dBackend):
    """The Mobius process-group backend (CPU tensors)."""

    # torch's property of the same name calls back into the Python object, which recursed
    # without end (RecursionError in batch_isend_irecv). Point-to-point Works are
    # independent, so batch_isend_irecv needs no coalescing: it posts each op, in any order.
    supports_coalescing = False
    # `dist.split_group` and `dist.shrink_group` (class attributes, for the same reason).
    supports_splitting = True
    supports_shrinking = True

    def __init__(self, store, rank: int, size: int, timeout: timedelta, model: dict | None = None):
        global _MEASURED
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._store, self._timeout = store, timeout
        self._children = 0
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()

        prefix = f"mobius/{_generation(store, size)}"

        def exchange(address: str) -> list[str]:
            store.set(f"{prefix}/addr/{rank}", address)
            return [store.get(f"{prefix}/addr/{r}").decode() for r in range(size)]

        settings = {"group": _group_key(store, rank, prefix)}
        if not os.environ.get("MOBIUS_TIMEOUT") and timeout is not None:
            settings["timeout"] = max(timeout.total_seconds(), 0.001)
        model = model if model is not None else _MEASURED
        if model is not None:
            # Measuring links costs a group tens of milliseconds; a group made after one
            # that measured runs over the same links (rank 0's model is the group's). Also
            # under MOBIUS_TUNE=on, the default said out loud: it once made every group
            # measure, 72 ms per group of 4 ranks against gloo's 6.
            settings["tune"] = False
            settings["model"] = model
        self.comm = Communicator(_native.Communicator.join(rank, size, _local_ip(store), exchange, settings))
        # Kept for the groups made from this one (also after it was aborted).
        self._model = self.comm.cost_model()
        if _MEASURED is None and size > 1:
            _MEASURED = self._model
        self._lanes_lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}

    # -- failure, abort and shutdown --------------------------------------------------------
    def _failed(self, e: BaseException) -> None:
        """A call failed: the first failure is the group's error (``get_error``)."""
        with self._error_lock:
            if self._error is None:
                self._error = e

    def _note(self, e: BaseException) -> None:
        """A call failed with ``e``: it is the group's error if it ended the group (its
        links are aborted). A refused argument or a failed monitored barrier does not."""
        try:
            ended = self.comm._c.aborted() is not None
        except MobiusError:
            ended = True
        if ended:
            self._failed(e)

    def _failure(self):
        """The group's error if it has one: a failed call, an abort, or a peer's failure its
        links saw (reported even before this rank calls again), else ``None``."""
        if self._error is not None:
            return self._error
        try:
            seen = self.comm._c.aborted()
        except MobiusError as e:  # closed
            return e
        if seen is not None:
            by, culprit, reason = seen
            who = f"rank {culprit} failed" if culprit is not None else f"rank {by} aborted the group"
            self._failed(MobiusError(f"rank {self._rank}: {who}: {reason}"))
        return self._error

    def failed_rank(self):
        """The rank whose failure ended this group, when known (else ``None``)."""
        try:
            seen = self.comm._c.aborted()
        except MobiusError:
            return None
        return seen[1] if seen is not None else None

    def get_error(self):
        """torch's ``ProcessGroup.get_error``: ``SUCCESS`` while the group is healthy;
        ``REMOTE_ERROR`` when a peer failed or aborted, ``TIMEOUT`` when a call timed out,
        ``COMM_ERROR`` otherwise (this rank aborted). The message is ``last_error``."""
        e = self._failure()
        E = _C10d.ErrorType
        if e is None:
            return E.SUCCESS
        text = str(e)
        if "timed out" in text:
            return E.TIMEOUT
        seen = None
        try:
            seen = self.comm._c.aborted()
        except MobiusError:
            pass
        if seen is not None and (seen[1] is not None or seen[0] != self._rank):
            return E.REMOTE_ERROR
        return E.COMM_ERROR

    @property
    def last_error(self) -> str | None:
        """The message of the group's error (what ``get_error`` classifies), or ``None``."""
        e = self._failure()
        return None if e is None else str(e)

    def abort(self) -> None:
        """torch's ``ProcessGroup.abort`` (and ``shutdown`` after a failure): every pending
        Work of this group ends now with the group's error (a peer's failure that caused
        it, or "aborted"), the peers are told, and the links, threads and memory are
        released. Returns without waiting for anything remote."""
        cause = self._failure()
        culprit = self.failed_rank()
        self._failed(MobiusError(f"rank {self._rank}: the process group was aborted"))
        try:
            self.comm._c.abort(f"rank {self._rank} aborted its process group"
                               + (f" ({cause})" if cause is not None else ""), culprit)
        except MobiusError:
            pass  # already closed
        self._stop_lanes()
        self.comm.close()

    def shutdown(self) -> None:
        """Called by torch's ``destroy_process_group``: every queued Work runs to its end,
        then the communicator leaves the group (its last sends delivered, its peers told of
        a clean departure) while the interpreter is whole. Left to the interpreter's
        teardown instead, a process that then leaves with ``os._exit`` lost sends a peer
        still waited for. A group that already failed is aborted instead: nothing of it can
        complete, and nothing waits."""
        if self._failure() is not None:
            self.abort()
            return
        self._stop_lanes()
        self.comm.close()

    def _stop_lanes(self) -> None:
        with self._lanes_lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.stop()
        for lane in lanes:
            lane.join()

    @property
    def options(self):
        """The backend's options (name and timeout). Defined here because torch's own
        property calls back into the Python object, which recursed without end in
        ``split_group``."""
        opts = _C10dBackend.Options("mobius", self._timeout) if self._timeout is not None else _C10dBackend.Options("mobius")
        return opts

    # -- groups made from this one ----------------------------------------------------------
    def _child(self, store, ranks: list[int]):
        """The backend of a group of ``ranks`` (this group's ranks, in the new order) made
        from this one: its own links, this group's cost model (no measurement)."""
        return MobiusBackend(store, ranks.index(self._rank), len(ranks), self._timeout, self._model)

    def split(self, store, ranks, opts=None):
        """``dist.split_group`` (and a ``DeviceMesh`` made by splitting): the group of
        ``ranks`` (of this group), over the store torch prefixes for it."""
        ranks = list(ranks)
        return None if self._rank not in ranks else self._child(store, ranks)

    def shrink(self, ranks_to_exclude, shrink_flags=0, opts_override=None):
        """``dist.shrink_group``: the group of the ranks not excluded (the survivors of a
        failure call it; the excluded ones do not). With ``SHRINK_ABORT`` this group is
        aborted first. The survivors meet under a fresh prefix of this group's store."""
        if shrink_flags & getattr(dist, "SHRINK_ABORT", 1):
            self.abort()
        out = set(ranks_to_exclude)
        ranks = [r for r in range(self._size) if r not in out]
        self._children += 1
        store = dist.PrefixStore(f"mobius-shrink/{self._children}/{'-'.join(map(str, ranks))}/", self._store)
        child = self._child(store, ranks)
        _PINNED.append(child)
        return child

    def _lane(self, name: str) -> _Lane:
        with self._lanes_lock:
            lane = self._lanes.get(name)
            if lane is None:
                lane = self._lanes[name] = _Lane(f"mobius-r{self._rank}-{name}")
            return lane

    def _submit(self, lane: str, label: str, outputs, fn) -> _Work:
        return self._lane(lane).submit(_Work(label, outputs, fn, self))

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


def _patch_torch_shrink() -> None:
    """Makes the group ``dist.shrink_group`` builds around a Mobius backend say it is a
    custom backend, as ``init_process_group`` does for one.

    torch's ``_create_shrunk_process_group`` registers any CPU backend as ``GLOO``; the group
    then calls itself "gloo", and DDP's logger, reading gloo's options off a backend that is
    not gloo's, crashed the process at random. Other backends' shrunk groups are untouched."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    create = getattr(c10d, "_create_shrunk_process_group", None)
    if create is None or getattr(create, "_mobius", False):
        return

    def create_shrunk(new_backend, *args, **kwargs):
        pg = create(new_backend, *args, **kwargs)
        if isinstance(new_backend, MobiusBackend):
            custom = dist.ProcessGroup.BackendType.CUSTOM
            pg._register_backend(torch.device("cpu"), custom, new_backend)
            pg._set_default_backend(custom)
        return pg

    create_shrunk._mobius = True
    c10d._create_shrunk_process_group = create_shrunk


_patch_torch_shrink()


def _create(store, rank, size, timeout):
    return MobiusBackend(store, rank, size, timeout)


if "mobius" not in dist.Backend.backend_list:
    dist.Backend.register_backend("mobius", _create, devices=["cpu"])
