"""One rank of a Mobius test group: ``worker.py <scenario> <json args> <outdir>``.

Every scenario checks its own results against a numpy reference (each rank can rebuild
every rank's input from the seed) and writes a JSON report to ``<outdir>/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

# Set by harness.Group, or by torchrun; a lone process is rank 0 of 1.
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
OUT = Path(sys.argv[3])

NP = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "bf16": np.uint16, "i32": np.int32, "i64": np.int64,
      "u8": np.uint8}


def to_bf16(x) -> np.ndarray:
    """float values → bfloat16 bits (round to nearest even)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


def from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def encode(values: np.ndarray, dtype: str) -> np.ndarray:
    return to_bf16(values) if dtype == "bf16" else values.astype(NP[dtype])


def decode(a: np.ndarray, dtype: str) -> np.ndarray:
    return (from_bf16(a) if dtype == "bf16" else a).astype(np.float64)


def values(who: int, n: int, dtype: str, op: str, seed: int) -> np.ndarray:
    """Integer-valued inputs whose every reduction is exact in every dtype (as float64)."""
    rng = np.random.default_rng([seed, who, n])
    if op == "prod":
        choices = [1, 2, 1, 3] if dtype == "u8" else [1, 2, -1, 3] if dtype in ("i32", "i64") else [1, 2, -1, 0.5]
        return np.asarray(choices, dtype=np.float64)[rng.integers(0, 4, n)]
    if dtype == "u8":
        return rng.integers(0, 11, n).astype(np.float64)
    return rng.integers(-5, 6, n).astype(np.float64)


def reduce_ref(stack: np.ndarray, op: str, dtype: str) -> np.ndarray:
    if op == "sum":
        r = stack.sum(0)
    elif op == "prod":
        r = stack.prod(0)
    elif op == "min":
        r = stack.min(0)
    elif op == "max":
        r = stack.max(0)
    else:
        r = stack.sum(0) / stack.shape[0]
        if dtype in ("i32", "i64", "u8"):
            r = np.trunc(r)
    return r


def report(obj, name: str | None = None) -> None:
    """Writes this rank's JSON report (``rank<r>.json``, or ``name``) for the test to read."""
    (OUT / (name or f"rank{RANK}.json")).write_text(json.dumps(obj))


def comm_for(**settings):
    import mobius
    return mobius.init(**settings)


# ---------------------------------------------------------------------------------------------
def scenario_matrix(args):
    """Every op × dtype × reduce op × size that `args["ops"]` names, under one algorithm;
    `args["hosts"]` (a host name per rank) fakes hosts through MOBIUS_HOST_ID."""
    if "hosts" in args:
        os.environ["MOBIUS_HOST_ID"] = str(args["hosts"][RANK])
    comm = comm_for(timeout=120, algo=args["algo"], **args.get("settings", {}))
    seed, ops, fails, cases = args.get("seed", 1), set(args["ops"]), [], 0
    root = WORLD - 1

    def check(what, got, want):
        nonlocal cases
        cases += 1
        if got.shape != want.shape or not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            fails.append(f"rank {RANK} {what}: {bad.size} of {want.size} elements differ, first at {bad[:3].tolist()}: "
                         f"got {got[bad[:3]].tolist()} want {want[bad[:3]].tolist()}")

    for dtype in args["dtypes"]:
        for n in args["sizes"]:
            for op in args["reduce_ops"]:
                stack = np.stack([values(r, n, dtype, op, seed) for r in range(WORLD)])
                want = encode(reduce_ref(stack, op, dtype), dtype)
                if "allreduce" in ops:
                    x = encode(stack[RANK], dtype)
                    comm.allreduce(x, op, dtype=dtype)
                    check(f"allreduce {dtype} {op} n={n}", x, want)
                if "reduce" in ops:
                    x = encode(stack[RANK], dtype)
                    comm.reduce(x, op, root=root, dtype=dtype)
                    if RANK == root:
                        check(f"reduce {dtype} {op} n={n}", x, want)
                if "reduce_scatter" in ops:
                    full = np.stack([values(r, n * WORLD, dtype, op, seed) for r in range(WORLD)])
                    out = np.full(n, 7, dtype=NP[dtype])
                    comm.reduce_scatter(encode(full[RANK], dtype), out, op, dtype=dtype)
                    ref = encode(reduce_ref(full, op, dtype), dtype)[RANK * n:(RANK + 1) * n]
                    check(f"reduce_scatter {dtype} {op} n={n}", out, ref)
            mine = [encode(values(r, n, dtype, "sum", seed + 1), dtype) for r in range(WORLD)]
            if "broadcast" in ops:
                x = mine[RANK].copy() if RANK == root else np.zeros(n, NP[dtype])
                comm.broadcast(x, root=root, dtype=dtype)
                check(f"broadcast {dtype} n={n}", x, mine[root])
            if "allgather" in ops:
                out = np.zeros(n * WORLD, NP[dtype])
                comm.allgather(mine[RANK], out, dtype=dtype)
                check(f"allgather {dtype} n={n}", out, np.concatenate(mine))
            if "alltoall" in ops:
                blocks = lambda r: [encode(values(r * WORLD + j, n, dtype, "sum", seed + 2), dtype) for j in range(WORLD)]
                out = np.zeros(n * WORLD, NP[dtype])
                comm.alltoall(np.concatenate(blocks(RANK)), out, dtype=dtype)
                check(f"alltoall {dtype} n={n}", out, np.concatenate([blocks(j)[RANK] for j in range(WORLD)]))
    comm.barrier()
    report({"failures": fails, "cases": cases, "stats": comm.stats(), "hosts": comm.hosts})
    comm.close()


def scenario_large(args):
    """Every collective at 64 MiB (f32 and u8), against numpy; the reductions other than
    allreduce and the alltoall at counts that do not divide by the world."""
    comm = comm_for(timeout=300, algo=args.get("algo", "auto"))
    n = args["bytes"] // 4
    fails = []
    base = np.random.default_rng(7).integers(-8, 9, n).astype(np.float32)
    x = base + np.float32(RANK)
    comm.allreduce(x, "sum")
    want = base * np.float32(WORLD) + np.float32(WORLD * (WORLD - 1) / 2)
    if not np.array_equal(x, want):
        fails.append(f"rank {RANK} allreduce 64 MiB: {np.count_nonzero(x != want)} elements differ")
    y = np.full(args["bytes"], RANK, dtype=np.uint8) if RANK == 0 else np.zeros(args["bytes"], np.uint8)
    y[::4097] = 200
    comm.broadcast(y, root=0)
    exp = np.zeros(args["bytes"], np.uint8)
    exp[::4097] = 200
    if not np.array_equal(y, exp):
        fails.append(f"rank {RANK} broadcast 64 MiB differs")
    part = np.full(args["bytes"] // WORLD, RANK + 1, np.uint8)
    out = np.zeros(part.size * WORLD, np.uint8)
    comm.allgather(part, out)
    if not np.array_equal(out, np.repeat(np.arange(1, WORLD + 1, dtype=np.uint8), part.size)):
        fails.append(f"rank {RANK} allgather 64 MiB differs")
    # The rooted and scattered reductions and alltoall at 64 MiB too, with element counts that
    # do not divide by the world (3 elements over), so the last segments and chunks are short.
    x = np.concatenate([base, base[:3]]) + np.float32(RANK)
    src = x.copy()
    root = WORLD - 1
    comm.reduce(x, "max", root=root)
    if RANK == root and not np.array_equal(x, src - np.float32(RANK) + np.float32(WORLD - 1)):
        fails.append(f"rank {RANK} reduce max 64 MiB + 12 B: {np.count_nonzero(x != src - RANK + WORLD - 1)} elements differ")
    per = n // WORLD + 3
    full = np.arange(per * WORLD, dtype=np.float32) % 1021 + np.float32(RANK)
    out = np.zeros(per, np.float32)
    comm.reduce_scatter(full, out, "sum")
    ref = (np.arange(per * WORLD, dtype=np.float32) % 1021) * np.float32(WORLD) + np.float32(WORLD * (WORLD - 1) / 2)
    if not np.array_equal(out, ref[RANK * per:(RANK + 1) * per]):
        fails.append(f"rank {RANK} reduce_scatter sum {per * WORLD * 4} B: {np.count_nonzero(out != ref[RANK * per:(RANK + 1) * per])} elements differ")
    blk = args["bytes"] // WORLD + 5
    send = np.concatenate([np.full(blk, (RANK * WORLD + j) % 251, np.uint8) for j in range(WORLD)])
    recv = np.zeros(blk * WORLD, np.uint8)
    comm.alltoall(send, recv)
    want_a = np.concatenate([np.full(blk, (j * WORLD + RANK) % 251, np.uint8) for j in range(WORLD)])
    if not np.array_equal(recv, want_a):
        fails.append(f"rank {RANK} alltoall {blk * WORLD} B differs")
    report({"failures": fails, "stats": comm.stats()})
    comm.close()


def scenario_tolerance(args):
    """Random floats: f32/f16/bf16 sums against float64 within the stated bound."""
    comm = comm_for(timeout=120, algo=args.get("algo", "auto"))
    n, out = args["n"], {}
    for dtype, eps in (("f32", 2.0 ** -24), ("f16", 2.0 ** -11), ("bf16", 2.0 ** -8)):
        stack = np.stack([np.random.default_rng([5, r]).uniform(-1, 1, n) for r in range(WORLD)])
        # Inputs as the dtype stores them; the reference sums those exact values in float64.
        enc = [encode(stack[r], dtype) for r in range(WORLD)]
        exact = np.stack([decode(e, dtype) for e in enc])
        x = enc[RANK].copy()
        comm.allreduce(x, "sum", dtype=dtype)
        got = decode(x, dtype)
        ref = exact.sum(0)
        # One rounding per pairwise step (world - 1 of them) plus the final one.
        bound = (WORLD - 1) * eps * np.abs(exact).sum(0) + eps * np.abs(ref)
        err = np.abs(got - ref)
        out[dtype] = {"max_err": float(err.max()), "worst_ratio": float((err / np.maximum(bound, 1e-300)).max()),
                      "within": bool(np.all(err <= bound))}
    report(out)
    comm.close()


def scenario_zero_copy(args):
    """Collectives work in place on numpy arrays and torch tensors: same memory, new values."""
    import torch
    import mobius
    comm = mobius.init(timeout=60)
    res = {}
    a = np.arange(1000, dtype=np.float64) + RANK
    ptr = a.ctypes.data
    ret = comm.allreduce(a, "sum")
    res["numpy_same_object"] = ret is a and a.ctypes.data == ptr
    res["numpy_ok"] = bool(np.array_equal(a, np.arange(1000) * WORLD + WORLD * (WORLD - 1) / 2))
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        t = torch.full((4097,), RANK + 1, dtype=dt)
        p = t.data_ptr()
        comm.allreduce(t, "max")
        res[f"torch_{dt}_same_memory"] = t.data_ptr() == p
        res[f"torch_{dt}_ok"] = bool((t == WORLD).all())
    # Overlapping input and output: this rank's block in place (no copy), any other overlap
    # read from a copy first (here the input starts one element into the output).
    n = 3
    want = np.repeat(np.arange(WORLD, dtype=np.float32) + 1, n)
    out = np.zeros(n * WORLD, dtype=np.float32)
    out[RANK * n:(RANK + 1) * n] = RANK + 1
    comm.allgather(out[RANK * n:(RANK + 1) * n], out)
    res["allgather_in_place"] = bool(np.array_equal(out, want))
    out = np.zeros(n * WORLD + 1, dtype=np.float32)
    out[1:n + 1] = RANK + 1
    comm.allgather(out[1:n + 1], out[:n * WORLD])
    res["allgather_shifted_overlap"] = bool(np.array_equal(out[:n * WORLD], want))
    comm.monitored_barrier()
    comm.monitored_barrier(timeout=30, wait_all_ranks=True)
    res["monitored_barrier"] = True
    v = torch.zeros(10, 10)
    try:
        comm.allreduce(v[:, 0])
        res["non_contiguous"] = "accepted"
    except ValueError as e:
        res["non_contiguous"] = str(e)
    try:
        comm.allreduce(np.zeros(3, dtype=np.complex64))
    except ValueError as e:
        res["bad_dtype"] = str(e)
    res["stats"] = comm.stats()
    report(res)
    comm.close()


def scenario_mismatch(args):
    comm = comm_for(timeout=30)
    t0 = time.time()
    try:
        comm.allreduce(np.ones(10 + 2 * RANK, dtype=np.float32))
        report({"error": None})
    except Exception as e:  # noqa: BLE001 - the test inspects the type and message
        report({"error": str(e), "type": type(e).__name__, "seconds": time.time() - t0})


def scenario_loop_allreduce(args):
    """Allreduces in a loop until one fails; the parent kills a rank meanwhile."""
    comm = comm_for(timeout=args["timeout"])
    x = np.ones(args["n"], dtype=np.float32)
    comm.allreduce(x)
    calls = 0
    try:
        while True:
            comm.allreduce(x)
            calls += 1
            if calls == 1:
                # After a call of the loop: every rank is inside it once all wrote this.
                (OUT / f"ready{RANK}").write_text("1")
    except Exception as e:  # noqa: BLE001
        report({"error": str(e), "type": type(e).__name__, "failed_at": time.time(), "calls": calls})


def scenario_join(args):
    """Only some ranks start: the others must fail naming the missing ones."""
    import mobius
    t0 = time.time()
    try:
        mobius.init(**args.get("settings", {}))
        report({"error": None})
    except Exception as e:  # noqa: BLE001
        report({"error": str(e), "type": type(e).__name__, "seconds": time.time() - t0})


def scenario_policy(args):
    """Measured model and decisions are the same on every rank."""
    comm = comm_for(timeout=60, tune=True)
    decisions = {f"{op}/{n}": comm.decide(op, n) for op in ("allreduce", "broadcast", "allgather", "alltoall")
                 for n in (4096, 1 << 20, 64 << 20)}
    x = np.ones(1024, dtype=np.float32)
    comm.allreduce(x)
    report({"model": comm.cost_model(), "decisions": decisions, "calls": comm.stats()["calls"]})
    comm.close()


def scenario_policy_table(args):
    """The policy's decisions over sizes, with the model measured at start (bench.py policy)."""
    comm = comm_for(timeout=60, tune=True)
    table = {}
    for op in ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall"):
        for shift in range(10, 29, 2):
            table[f"{op}/{1 << shift}"] = comm.decide(op, 1 << shift)
    report({"model": comm.cost_model(), "table": table})
    comm.close()


# ----- torch ---------------------------------------------------------------------------------
def _torch_init(backend):
    import datetime
    import torch.distributed as dist
    if backend == "mobius":
        import mobius.torch_backend  # noqa: F401 - registers the backend
    dist.init_process_group(backend, rank=RANK, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    return dist


def _torch_finish(dist, backend, result):
    """A torch scenario's end: every rank done, the result written, the group destroyed
    (gloo's teardown skipped: see scenario_ddp)."""
    dist.barrier()
    report(result)
    if backend == "gloo":
        os._exit(0)
    dist.destroy_process_group()


def _mobius_stats(dist, backend) -> dict:
    """The Mobius communicator's stats under the torch backend (which transport carried the
    calls, and its provider's counters), as `{"stats": ...}`; nothing for another backend."""
    if backend != "mobius":
        return {}
    import torch
    return {"stats": dist.group.WORLD._get_backend(torch.device("cpu")).comm.stats()}


def scenario_torch_ops(args):
    import torch
    dist = _torch_init("mobius")
    res = {}
    t = torch.arange(6, dtype=torch.float32) * (RANK + 1)
    dist.all_reduce(t)
    res["all_reduce"] = t.tolist() == (torch.arange(6, dtype=torch.float32) * sum(range(1, WORLD + 1))).tolist()
    t = torch.tensor([RANK + 1.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    res["all_reduce_max"] = t.item() == WORLD
    t = torch.tensor([float(RANK) + 2])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    res["all_reduce_avg"] = abs(t.item() - (sum(range(WORLD)) / WORLD + 2)) < 1e-6
    t = torch.full((3,), float(RANK))
    dist.broadcast(t, src=WORLD - 1)
    res["broadcast"] = t.tolist() == [WORLD - 1.0] * 3
    outs = [torch.zeros(2) for _ in range(WORLD)]
    dist.all_gather(outs, torch.full((2,), float(RANK)))
    res["all_gather"] = [o.tolist() for o in outs] == [[float(r)] * 2 for r in range(WORLD)]
    out = torch.zeros(2 * WORLD)
    dist.all_gather_into_tensor(out, torch.full((2,), float(RANK)))
    res["all_gather_into_tensor"] = out.tolist() == sum(([float(r)] * 2 for r in range(WORLD)), [])
    inp = torch.arange(WORLD * 2, dtype=torch.float32)
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, inp)
    res["reduce_scatter_tensor"] = out.tolist() == [WORLD * float(2 * RANK), WORLD * float(2 * RANK + 1)]
    # In place, as FSDP calls them: the input is this rank's block of the output (all-gather),
    # the output this rank's block of the input (reduce-scatter); all-to-all on one tensor.
    out = torch.zeros(2 * WORLD)
    out[2 * RANK:2 * RANK + 2] = float(RANK)
    dist.all_gather_into_tensor(out, out[2 * RANK:2 * RANK + 2])
    res["all_gather_into_tensor_in_place"] = out.tolist() == sum(([float(r)] * 2 for r in range(WORLD)), [])
    inp = torch.arange(WORLD * 2, dtype=torch.float32)
    dist.reduce_scatter_tensor(inp[2 * RANK:2 * RANK + 2], inp)
    res["reduce_scatter_tensor_in_place"] = inp[2 * RANK:2 * RANK + 2].tolist() == [WORLD * float(2 * RANK), WORLD * float(2 * RANK + 1)]
    try:  # gloo refuses it too; the error must name the op, not print an object
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
        res["premul_sum_refused_by_name"] = False
    except ValueError as e:
        res["premul_sum_refused_by_name"] = "reduce op PREMUL_SUM" in str(e)
    buf = torch.arange(WORLD, dtype=torch.int64) + 10 * RANK
    dist.all_to_all_single(buf, buf)
    res["all_to_all_single_in_place"] = buf.tolist() == [10 * j + RANK for j in range(WORLD)]
    out = torch.zeros(WORLD, dtype=torch.int64)
    dist.all_to_all_single(out, torch.arange(WORLD, dtype=torch.int64) + 10 * RANK)
    res["all_to_all_single"] = out.tolist() == [10 * j + RANK for j in range(WORLD)]
    # Uneven splits: rank r sends j+1 elements to rank j.
    inp = torch.cat([torch.full((j + 1,), float(RANK * 100 + j)) for j in range(WORLD)])
    out = torch.zeros((RANK + 1) * WORLD)
    dist.all_to_all_single(out, inp, output_split_sizes=[RANK + 1] * WORLD, input_split_sizes=[j + 1 for j in range(WORLD)])
    res["all_to_all_uneven"] = out.tolist() == sum(([float(j * 100 + RANK)] * (RANK + 1) for j in range(WORLD)), [])
    if WORLD >= 2:
        if RANK == 0:
            dist.send(torch.tensor([42.0, 43.0]), dst=1, tag=5)
        elif RANK == 1:
            t = torch.zeros(2)
            dist.recv(t, src=0, tag=5)
            res["send_recv"] = t.tolist() == [42.0, 43.0]
    t = torch.tensor([1.0])
    dist.reduce(t, dst=0)
    if RANK == 0:
        res["reduce"] = t.item() == WORLD
    dist.barrier()
    pg = dist.group.WORLD
    res["backend_name"] = dist.get_backend(pg)
    dist.destroy_process_group()
    report(res)


def _train(model, opt, steps):
    """`steps` steps of a 16 → 4 regression on this rank's own random batches; the last loss."""
    import torch
    gen = torch.Generator().manual_seed(1000 + RANK)
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen)
        y = torch.randn(32, 4, generator=gen)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    return loss


def scenario_ddp(args):
    """A small MLP, DDP for `steps` steps; reports the final parameters."""
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist = _torch_init(args["backend"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets, so several allreduces per step
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    loss = _train(ddp, opt, args["steps"])
    params = [p.detach().double().reshape(-1).tolist() for p in model.parameters()]
    report({"params": params, "loss": float(loss.detach()), **_mobius_stats(dist, args["backend"])})
    if args["backend"] == "gloo":
        # torch 2.15's gloo sometimes aborts in teardown with 3 ranks ("terminate called
        # without an active exception"); the reference run is done, so skip the teardown.
        os._exit(0)
    dist.destroy_process_group()


def scenario_monitored_barrier(args):
    """dist.monitored_barrier as gloo offers it: passes when all come; with the last rank
    away, rank 0 names it and the ranks that came are not released; the group goes on."""
    import datetime
    import torch
    dist = _torch_init("mobius")
    res = {}
    dist.monitored_barrier()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=True)
    res["passed"] = True
    if RANK != WORLD - 1:
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=2), wait_all_ranks=True)
            res["error"] = None
        except RuntimeError as e:
            res["error"] = str(e)
    t = torch.ones(4)
    dist.all_reduce(t)
    res["after"] = t.tolist() == [float(WORLD)] * 4
    dist.destroy_process_group()
    report(res)


def scenario_torch_utilities(args):
    """torch.distributed utilities a training script uses, on `backend`: each case reports
    a value the test compares with gloo's (or the error it raised)."""
    import datetime
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    backend = args["backend"]
    if backend == "mobius":
        import mobius.torch_backend  # noqa: F401
    init = f"file://{OUT}/store-{backend}" if args["init"] == "file" else None
    dist.init_process_group(backend, init_method=init, rank=RANK, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    out = {}

    def case(fn):
        torch.manual_seed(0)
        try:
            out[fn.__name__] = fn()
        except Exception as e:  # noqa: BLE001 - the test compares errors too
            out[fn.__name__] = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            traceback.print_exc()

    def digest(m):
        return float(sum(p.detach().double().sum() for p in m.parameters()))

    def mlp():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))

    def data(step):
        g = torch.Generator().manual_seed(100 * step + RANK)
        return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)

    @case
    def ddp_find_unused_parameters():
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(32, 8), nn.Linear(32, 8)

            def forward(self, x, step):
                return self.a(x) if step % 2 else self.a(x) + self.b(x)
        torch.manual_seed(1)
        m = nn.parallel.DistributedDataParallel(M(), find_unused_parameters=True)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(6):
            x, y = data(step)
            opt.zero_grad()
            ((m(x, step) - y) ** 2).mean().backward()
            opt.step()
        return digest(m)

    @case
    def ddp_join_uneven_inputs():
        from torch.distributed.algorithms.join import Join
        m = nn.parallel.DistributedDataParallel(mlp())
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with Join([m]):
            for step in range(3 + 2 * RANK):
                x, y = data(step)
                opt.zero_grad()
                ((m(x) - y) ** 2).mean().backward()
                opt.step()
        return digest(m)

    @case
    def zero_redundancy_optimizer():
        from torch.distributed.optim import ZeroRedundancyOptimizer
        m = nn.parallel.DistributedDataParallel(mlp())
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        for step in range(4):
            x, y = data(step)
            opt.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            opt.step()
        opt.consolidate_state_dict(to=0)
        return digest(m)

    @case
    def distributed_checkpoint():
        import torch.distributed.checkpoint as dcp
        where = OUT / f"ckpt-{backend}"
        m = mlp()
        dcp.save({"model": m.state_dict()}, checkpoint_id=str(where))
        m2 = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        sd = {"model": m2.state_dict()}
        dcp.load(sd, checkpoint_id=str(where))
        m2.load_state_dict(sd["model"])
        return digest(m2)

    @case
    def tensor_parallel():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(3)
        hidden = 6 * WORLD  # the column and row shards split evenly
        m = parallelize_module(nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 8)), mesh,
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
        torch.manual_seed(4)
        y = m(torch.randn(4, 8))
        y.sum().backward()
        return float(y.detach().sum())

    @case
    def dtensor_redistribute():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(5)
        big = torch.randn(8 * WORLD, 6)
        d = distribute_tensor(big, mesh, [Shard(0)])
        return bool(torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), big)) and \
            bool(torch.equal(d.redistribute(mesh, [Shard(1)]).full_tensor(), big))

    @case
    def subgroups_and_objects():
        evens = dist.new_group([r for r in range(WORLD) if r % 2 == 0])
        odds = dist.new_group([r for r in range(WORLD) if r % 2 == 1])
        t = torch.tensor([float(RANK + 1)])
        dist.all_reduce(t, group=evens if RANK % 2 == 0 else odds)
        objs = [None] * WORLD
        dist.all_gather_object(objs, {"r": RANK, "s": "x" * RANK})
        sub, _ = dist.new_subgroups(group_size=1)
        u = torch.tensor([2.0])
        dist.all_reduce(u, group=sub)
        return [t.item(), objs, u.item()]

    @case
    def autograd_all_gather():
        import torch.distributed.nn.functional as F
        x = torch.full((3,), float(RANK + 1), requires_grad=True)
        s = sum((y * (i + 1)).sum() for i, y in enumerate(F.all_gather(x)))
        s.backward()
        return [float(s), x.grad.tolist()]

    @case
    def object_send_recv():
        if RANK == 0:
            dist.send_object_list([{"a": 1}, "x" * 100000], dst=WORLD - 1)
            return "sent"
        if RANK == WORLD - 1:
            got = [None, None]
            dist.recv_object_list(got, src=0)
            return [got[0], len(got[1])]
        return None

    @case
    def complex_all_reduce():
        t = torch.tensor([1 + 2j, 3 - 1j]) * (RANK + 1)
        dist.all_reduce(t)
        return [[z.real, z.imag] for z in t.tolist()]

    @case
    def ring_batch_isend_irecv():
        send = torch.arange(100000, dtype=torch.float32) + RANK
        recv = torch.empty(100000)
        ops = [dist.P2POp(dist.irecv, recv, (RANK - 1) % WORLD), dist.P2POp(dist.isend, send, (RANK + 1) % WORLD)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return float(recv.double().sum())

    _torch_finish(dist, backend, out)


def scenario_torch_reinit(args):
    """One store for the whole process, as torchrun's agent store is: the process group is
    made and destroyed three times (the same store keys each time), then 20 groups are made
    and destroyed; reports sums, and threads and fds before and after."""
    import datetime
    import torch
    import torch.distributed as dist
    import mobius.torch_backend  # noqa: F401
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), WORLD, is_master=RANK == 0,
                          timeout=datetime.timedelta(seconds=60))
    counts = lambda: (len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")))  # noqa: E731
    res = {"sums": []}
    for _ in range(3):
        dist.init_process_group("mobius", store=store, rank=RANK, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        t = torch.ones(4) * (RANK + 1)
        dist.all_reduce(t)
        res["sums"].append(t[0].item())
        if len(res["sums"]) == 1:
            res["before"] = counts()
        groups = [dist.new_group() for _ in range(20 if len(res["sums"]) == 3 else 0)]
        for g in groups:
            dist.all_reduce(t, group=g)
        if groups:
            res["with_groups"] = counts()
        for g in groups:
            dist.destroy_process_group(g)
        res["after"] = _settled(counts, res["before"])
        dist.destroy_process_group()
    report(res)


def scenario_fsdp(args):
    """FSDP2 (``fully_shard``, per layer and the root) for `steps` steps on CPU: its
    all-gathers run in place (the input is the rank's shard inside the output) and its
    gradients are reduce-scattered. Reports the final full parameters."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist = _torch_init(args["backend"])
    torch.manual_seed(0)
    # Sizes that do not divide by every world: FSDP pads the shards.
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 31), nn.Tanh(), nn.Linear(31, 4))
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loss = _train(model, opt, args["steps"])
    params = [p.full_tensor().detach().double().reshape(-1).tolist() for p in model.parameters()]
    report({"params": params, "loss": float(loss.detach())})
    if args["backend"] == "gloo":
        os._exit(0)  # see scenario_ddp
    dist.destroy_process_group()


# ----- the c10d surface: every collective × dtype × op, asynchronous work ------------------
TORCH_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
REDUCE_OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]
FLOATS = {"float16", "bfloat16", "float32", "float64"}
# Float tolerances: the ranks' values are multiples of 0.5, so sums are exact in every
# float type; products and averages round in float16/bfloat16 at each step.
RTOL = {"float16": 2e-3, "bfloat16": 2e-2, "float32": 1e-6, "float64": 1e-12}


def matrix_values(rank: int, n: int, dtype: str, salt: int) -> np.ndarray:
    """Rank `rank`'s input: small values, so products of 4 ranks stay representable."""
    i = np.arange(n)
    if dtype == "bool":
        return (i + rank + salt) % 3 == 0
    v = (i * 7 + rank * 3 + salt) % 11
    if dtype == "uint8":
        return v.astype(np.uint8)
    if dtype in FLOATS:
        return (v - 5) * 0.5
    return (v - 5).astype(np.dtype(dtype))


def matrix_ref(stack: np.ndarray, op: str, dtype: str, world: int) -> np.ndarray:
    """numpy's reduction over ranks (axis 0): integers wrap as the dtype does; floats in
    float64; bool as gloo reduces it (sum/max = any, prod/min = all)."""
    if dtype == "bool":
        if op in ("sum", "max", "bor"):
            return stack.any(axis=0)
        if op in ("prod", "min", "band"):
            return stack.all(axis=0)
        return np.logical_xor.reduce(stack, axis=0)
    if dtype in FLOATS:
        f = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}
        return stack.sum(axis=0) / world if op == "avg" else f[op](stack, axis=0)
    dt = stack.dtype
    ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "band": np.bitwise_and,
             "bor": np.bitwise_or, "bxor": np.bitwise_xor, "avg": np.add}[op]
    out = ufunc.reduce(stack, axis=0, dtype=dt)
    if op == "avg":  # the wrapped sum, divided truncating toward zero
        s = out.astype(np.int64)
        out = (np.sign(s) * (np.abs(s) // world)).astype(dt)
    return out


def scenario_destroy_then_exit(args):
    """Allreduces, then destroy_process_group and at once ``os._exit``: the group's
    shutdown must have delivered this rank's last sends, or a slower peer fails."""
    import torch
    dist = _torch_init("mobius")
    ok = True
    for i in range(args.get("calls", 200)):
        t = torch.full((1024,), float(RANK + i))
        dist.all_reduce(t)
        ok &= t[0].item() == sum(r + i for r in range(WORLD))
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    dist.destroy_process_group()
    try:
        backend.comm.stats()
        closed = False
    except Exception:  # noqa: BLE001 - any refusal of a closed communicator
        closed = True
    report({"sums": ok, "closed": closed})
    os._exit(0)


def scenario_torch_matrix(args):
    """Each collective × dtype × reduce op against numpy; unsupported combinations must
    raise an error naming them. Reports the list of failures (empty when all pass), and the
    outcome of every combination (`status`: ok, refused or wrong), which with
    ``{"backend": "gloo"}`` gives gloo's coverage for the docs' table."""
    import torch
    backend = args.get("backend", "mobius")
    dist = _torch_init(backend)
    R = dist.ReduceOp
    ops = {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX, "avg": R.AVG, "band": R.BAND, "bor": R.BOR,
           "bxor": R.BXOR}
    n = 5
    failures, checked, refused, status = [], 0, 0, {}

    def ten(a, dtype):
        return torch.tensor(a, dtype=getattr(torch, dtype))

    def same(what, got, want, dtype):
        nonlocal checked
        checked += 1
        g = got.double().numpy() if dtype in FLOATS else got.numpy()
        if dtype in FLOATS:
            ok = g.shape == want.shape and np.allclose(g, want, rtol=RTOL[dtype], atol=0)
        else:
            ok = g.shape == want.shape and np.array_equal(g, want.astype(g.dtype))
        if not ok:
            failures.append(f"{what}: got {g.tolist()} want {want.tolist()}")
        status[what] = "ok" if ok else "wrong"

    def attempt(what, call, dtype, supported=True, op=None):
        """Runs `call` (returning (who checks, got, want)); judges a refusal."""
        nonlocal refused
        try:
            who, got, exp = call()
        except Exception as e:  # noqa: BLE001 - recorded and judged below
            status[what] = f"refused: {str(e).splitlines()[0][:160]}"
            if supported:
                failures.append(f"{what}: raised {e}")
            elif f"{op} is not defined on" not in str(e):
                failures.append(f"{what}: refused without naming the combination: {e}")
            else:
                refused += 1
            return
        if not supported:
            failures.append(f"{what}: accepted an unsupported combination")
            status[what] = "accepted"
        elif who is True:
            same(what, got, exp, dtype)
        else:
            status[what] = "ok (checked on another rank)"

    for dtype in TORCH_DTYPES:
        for op in REDUCE_OPS:
            supported = not ((dtype in FLOATS and op.startswith("b")) or (dtype == "bool" and op == "avg"))
            mine = matrix_values(RANK, n, dtype, 0)
            stack = np.stack([matrix_values(r, n, dtype, 0) for r in range(WORLD)])
            blocks = np.stack([matrix_values(r, n * WORLD, dtype, 1) for r in range(WORLD)])
            want = matrix_ref(stack, op, dtype, WORLD) if supported else None
            want_rs = matrix_ref(blocks, op, dtype, WORLD)[RANK * n:(RANK + 1) * n] if supported else None
            calls = {
                "all_reduce": lambda: dist.all_reduce(t := ten(mine, dtype), op=ops[op]) or (True, t, want),
                "reduce": lambda: dist.reduce(t := ten(mine, dtype), dst=WORLD - 1, op=ops[op]) or (
                    RANK == WORLD - 1, t, want),
                "all_reduce_coalesced": lambda: dist.all_reduce_coalesced(
                    ts := [ten(mine, dtype), ten(mine[:2], dtype)], op=ops[op]) or (
                    True, torch.cat(ts), want is not None and np.concatenate([want, want[:2]])),
                "reduce_scatter": lambda: dist.reduce_scatter(
                    o := ten(np.zeros(n), dtype), [ten(b, dtype) for b in np.split(blocks[RANK], WORLD)],
                    op=ops[op]) or (True, o, want_rs),
                "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
                    o := ten(np.zeros(n), dtype), ten(blocks[RANK], dtype), op=ops[op]) or (True, o, want_rs),
            }
            for name, call in calls.items():
                attempt(f"{name} {dtype} {op}", call, dtype, supported, op)

        # Collectives that move data without reducing it: exact.
        everyone = [matrix_values(r, n, dtype, 2) for r in range(WORLD)]
        mine = everyone[RANK]
        blocks = [matrix_values(j, n, dtype, 3) for j in range(WORLD)]
        # alltoall: rank r's block j is matrix_values(r * WORLD + j); uneven: j + 1 elements.
        src = [matrix_values(RANK * WORLD + j, n, dtype, 4) for j in range(WORLD)]
        dst = [matrix_values(j * WORLD + RANK, n, dtype, 4) for j in range(WORLD)]

        def broadcast():
            t = ten(mine if RANK == WORLD - 1 else np.zeros(n), dtype)
            dist.broadcast(t, src=WORLD - 1)
            return True, t, everyone[WORLD - 1]

        def all_gather():
            outs = [ten(np.zeros(n), dtype) for _ in range(WORLD)]
            dist.all_gather(outs, ten(mine, dtype))
            return True, torch.cat(outs), np.concatenate(everyone)

        def all_gather_into_tensor():
            out = ten(np.zeros(n * WORLD), dtype)
            dist.all_gather_into_tensor(out, ten(mine, dtype))
            return True, out, np.concatenate(everyone)

        def all_gather_coalesced():
            outs = [[ten(np.zeros(n), dtype) for _ in range(WORLD)], [ten(np.zeros(2), dtype) for _ in range(WORLD)]]
            dist.all_gather_coalesced(outs, [ten(mine, dtype), ten(mine[:2], dtype)])
            return True, torch.cat(outs[0] + outs[1]), np.concatenate(everyone + [e[:2] for e in everyone])

        def gather():
            outs = [ten(np.zeros(n), dtype) for _ in range(WORLD)] if RANK == 0 else None
            dist.gather(ten(mine, dtype), gather_list=outs, dst=0)
            return RANK == 0, outs and torch.cat(outs), np.concatenate(everyone)

        def scatter():
            out = ten(np.zeros(n), dtype)
            dist.scatter(out, scatter_list=[ten(b, dtype) for b in blocks] if RANK == 0 else None, src=0)
            return True, out, blocks[RANK]

        def all_to_all_single():
            out = ten(np.zeros(n * WORLD), dtype)
            dist.all_to_all_single(out, ten(np.concatenate(src), dtype))
            return True, out, np.concatenate(dst)

        def all_to_all_single_uneven():
            out = ten(np.zeros((RANK + 1) * WORLD), dtype)
            dist.all_to_all_single(out, ten(np.concatenate([src[j][:j + 1] for j in range(WORLD)]), dtype),
                                   output_split_sizes=[RANK + 1] * WORLD,
                                   input_split_sizes=[j + 1 for j in range(WORLD)])
            return True, out, np.concatenate([d[:RANK + 1] for d in dst])

        def all_to_all():
            outs = [ten(np.zeros(j + 1), dtype) for j in range(WORLD)]
            dist.all_to_all(outs, [ten(src[j][:RANK + 1], dtype) for j in range(WORLD)])
            return True, torch.cat(outs), np.concatenate([matrix_values(j * WORLD + RANK, n, dtype, 4)[:j + 1]
                                                          for j in range(WORLD)])

        for call in (broadcast, all_gather, all_gather_into_tensor, all_gather_coalesced, gather, scatter,
                     all_to_all_single, all_to_all_single_uneven, all_to_all):
            attempt(f"{call.__name__} {dtype}", call, dtype)

    # The object collectives, built on the tensor ones.
    objs = [None] * WORLD
    dist.all_gather_object(objs, {"rank": RANK, "tag": "x" * RANK})
    same("all_gather_object", torch.tensor([o["rank"] == r and o["tag"] == "x" * r for r, o in enumerate(objs)]),
         np.ones(WORLD, dtype=bool), "bool")
    got = [None] * WORLD if RANK == 0 else None
    dist.gather_object(("from", RANK, list(range(RANK))), got, dst=0)
    if RANK == 0:
        same("gather_object", torch.tensor([got[r] == ("from", r, list(range(r))) for r in range(WORLD)]),
             np.ones(WORLD, dtype=bool), "bool")
    mine = [None]
    dist.scatter_object_list(mine, [{"to": j, "pad": "y" * j} for j in range(WORLD)] if RANK == 0 else None, src=0)
    same("scatter_object_list", torch.tensor([mine[0] == {"to": RANK, "pad": "y" * RANK}]), np.ones(1, dtype=bool), "bool")
    lst = [RANK, "a"] if RANK == WORLD - 1 else [None, None]
    dist.broadcast_object_list(lst, src=WORLD - 1)
    same("broadcast_object_list", torch.tensor([lst == [WORLD - 1, "a"]]), np.ones(1, dtype=bool), "bool")
    # The early-stopping idiom: a bool flag reduced with MAX.
    flag = torch.tensor([RANK == WORLD - 1])
    dist.all_reduce(flag, op=R.MAX)
    same("all_reduce bool flag", flag, np.array([True]), "bool")
    dist.barrier()
    report({"failures": failures, "checked": checked, "refused": refused, "status": status,
            **_mobius_stats(dist, backend)})
    if backend == "gloo":
        os._exit(0)  # see scenario_ddp: torch 2.15's gloo can abort in teardown
    dist.destroy_process_group()


def scenario_torch_async(args):
    """Asynchronous Works: pending until done, p2p that never blocks, a Work.wait timeout."""
    import datetime
    import torch
    dist = _torch_init("mobius")
    res = {}
    # 1. A 64 MiB allreduce, provably pending: rank 1 joins it only after rank 0 has looked
    #    at its Work and said so (a message on the point-to-point lane, beside the collective).
    #    torch 2.15 wraps a Python backend's Work for the caller and forwards only wait() and
    #    get_future() to it, so the caller reads completion from the future; the backend's own
    #    Work (called directly, second round) answers is_completed() itself.
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    total = float(sum(range(1, WORLD + 1)))
    for round_ in ("dist", "backend"):
        big = torch.full((16 << 20,), float(RANK + 1))
        if RANK == 1:
            dist.recv(torch.zeros(1), src=0, tag=1)
        if round_ == "dist":
            work = dist.all_reduce(big, async_op=True)
            done = lambda: work.get_future().done()  # noqa: E731
        else:
            work = backend.allreduce([big], dist.AllreduceOptions())
            done = work.is_completed
        if RANK == 0:
            res[f"{round_}_pending_before_wait"] = not done()
            dist.send(torch.ones(1), dst=1, tag=1)
        fut = work.get_future()
        work.wait()
        res[f"{round_}_completed_after_wait"] = done()
        res[f"{round_}_allreduce_value"] = bool((big == total).all())
        res[f"{round_}_future_value"] = bool((fut.wait()[0] == total).all())
    # 2. batch_isend_irecv with the receives listed first, both ring directions.
    left, right = (RANK - 1) % WORLD, (RANK + 1) % WORLD
    from_left, from_right = torch.zeros(3), torch.zeros(3)
    ops = [dist.P2POp(dist.irecv, from_left, left), dist.P2POp(dist.irecv, from_right, right),
           dist.P2POp(dist.isend, torch.full((3,), float(RANK)), right),
           dist.P2POp(dist.isend, torch.full((3,), float(RANK) + 0.5), left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    res["batch_recv_first"] = from_left.tolist() == [float(left)] * 3 and from_right.tolist() == [right + 0.5] * 3
    # 3. irecv posted before isend on both sides of a pair.
    if RANK < 2:
        peer = 1 - RANK
        got = torch.zeros(2, dtype=torch.int64)
        r = dist.irecv(got, src=peer, tag=7)
        s = dist.isend(torch.tensor([RANK, 40 + RANK]), dst=peer, tag=7)
        r.wait()
        s.wait()
        res["irecv_before_isend"] = got.tolist() == [peer, 40 + peer]
    # 4. Work.wait(timeout) on a receive nobody has sent yet: raises; then the message comes
    #    and the same Work completes.
    peer = 1 - RANK
    if RANK < 2:
        got = torch.zeros(1)
        r = dist.irecv(got, src=peer, tag=9)
        try:
            r.wait(datetime.timedelta(milliseconds=200))
            res["wait_timeout_raises"] = False
        except RuntimeError as e:
            res["wait_timeout_raises"] = "did not complete within" in str(e) and not r.get_future().done()
    dist.barrier()  # both have timed out before either sends
    if RANK < 2:
        dist.send(torch.tensor([5.0 + RANK]), dst=peer, tag=9)
        r.wait()
        res["wait_after_timeout"] = got.item() == 5.0 + peer
    # 5. recv from any source: rank 0 takes one message from every other rank. (torch 2.15
    #    cannot read the source rank of a Work written in Python, `Work._source_rank`, so
    #    the senders put their rank in the message.)
    if RANK == 0:
        seen = []
        for _ in range(WORLD - 1):
            t = torch.zeros(1)
            dist.irecv(t, tag=11).wait()
            seen.append(t.item())
        res["recv_anysource"] = sorted(seen) == [float(r) for r in range(1, WORLD)]
    else:
        dist.send(torch.tensor([float(RANK)]), dst=0, tag=11)
    dist.barrier()
    report(res)
    dist.destroy_process_group()


def scenario_torch_work_truth(args):
    """Every async_op=True call through torch.distributed, polled as a training loop that
    overlaps work polls it: is_completed() turns True by itself (no wait() first), stays True
    after wait(), is_success() and exception() agree, get_future() and a .then chain carry
    the result. Then a Work provably pending (its peer joins only after this rank looked),
    and a failed one (a receive whose wait(timeout) passed is not failed; a refused call is)."""
    import datetime
    import time
    import torch
    dist = _torch_init(args.get("backend", "mobius"))
    res = {}
    n, total = 1024, float(sum(range(1, WORLD + 1)))
    left, right = (RANK - 1) % WORLD, (RANK + 1) % WORLD

    def poll(name, work, check):
        deadline = time.monotonic() + 60
        polls = 0
        while not work.is_completed():
            polls += 1
            if time.monotonic() > deadline:
                res[name] = f"is_completed() still False after 60 s ({polls} polls)"
                return
            time.sleep(0.001)
        chained = work.get_future().then(lambda f: "chained")
        ok = [work.is_success(), work.exception() is None, work.get_future().done(), check()]
        work.wait()
        ok += [work.is_completed(), work.is_success(), chained.wait() == "chained"]
        res[name] = True if all(ok) else f"after completion: {ok}"

    t = torch.full((n,), float(RANK + 1))
    poll("all_reduce", dist.all_reduce(t, async_op=True), lambda: bool((t == total).all()))
    b = torch.full((n,), float(RANK))
    poll("broadcast", dist.broadcast(b, src=1, async_op=True), lambda: bool((b == 1.0).all()))
    outs = [torch.zeros(n) for _ in range(WORLD)]
    poll("all_gather", dist.all_gather(outs, torch.full((n,), float(RANK)), async_op=True),
         lambda: all(bool((o == r).all()) for r, o in enumerate(outs)))
    flat = torch.zeros(WORLD * n)
    poll("all_gather_into_tensor", dist.all_gather_into_tensor(flat, torch.full((n,), float(RANK)), async_op=True),
         lambda: bool((flat.view(WORLD, n) == torch.arange(WORLD).float()[:, None]).all()))
    rs = torch.zeros(n)
    poll("reduce_scatter_tensor", dist.reduce_scatter_tensor(rs, torch.ones(WORLD * n), async_op=True),
         lambda: bool((rs == WORLD).all()))
    r = torch.full((n,), 2.0)
    poll("reduce", dist.reduce(r, dst=0, async_op=True), lambda: RANK != 0 or bool((r == 2.0 * WORLD).all()))
    a2a = torch.zeros(WORLD * 4)
    poll("all_to_all_single", dist.all_to_all_single(a2a, torch.full((WORLD * 4,), float(RANK)), async_op=True),
         lambda: bool((a2a.view(WORLD, 4) == torch.arange(WORLD).float()[:, None]).all()))
    g = [torch.zeros(4) for _ in range(WORLD)] if RANK == 0 else None
    poll("gather", dist.gather(torch.full((4,), float(RANK)), g, dst=0, async_op=True),
         lambda: RANK != 0 or all(bool((x == i).all()) for i, x in enumerate(g)))
    sc = torch.zeros(4)
    poll("scatter", dist.scatter(sc, [torch.full((4,), float(i)) for i in range(WORLD)] if RANK == 0 else None,
                                 src=0, async_op=True), lambda: bool((sc == RANK).all()))
    poll("barrier", dist.barrier(async_op=True), lambda: True)
    got = torch.zeros(n)
    recv = dist.irecv(got, src=left, tag=3)
    send = dist.isend(torch.full((n,), float(RANK)), dst=right, tag=3)
    poll("isend", send, lambda: True)
    poll("irecv", recv, lambda: bool((got == left).all()))
    # Provably pending: rank 1 joins the all-reduce only after rank 0 has looked at its
    # Work (told over point-to-point, beside the collective).
    big = torch.full((1 << 16,), float(RANK + 1))
    if RANK == 1:
        dist.recv(torch.zeros(1), src=0, tag=1)
    w = dist.all_reduce(big, async_op=True)
    if RANK == 0:
        res["pending_before_peer"] = (not w.is_completed()) and w.exception() is None
        dist.send(torch.ones(1), dst=1, tag=1)
    poll("all_reduce_after_pending", w, lambda: bool((big == total).all()))
    # wait(timeout) on a receive nobody sent yet raises and leaves it pending, not failed.
    # (gloo closes the pair when a wait times out, so the gloo reference run skips this.)
    timed = args.get("backend", "mobius") == "mobius"
    if RANK < 2 and timed:
        peer = 1 - RANK
        late = torch.zeros(1)
        w = dist.irecv(late, src=peer, tag=9)
        try:
            w.wait(datetime.timedelta(milliseconds=100))
            res["wait_timeout_raises"] = "returned"
        except RuntimeError:
            res["wait_timeout_raises"] = (not w.is_completed()) or "completed"
    if timed:
        dist.barrier()  # both timed out before either sends
    if RANK < 2 and timed:
        dist.send(torch.tensor([7.0]), dst=peer, tag=9)
        poll("irecv_after_wait_timeout", w, lambda: late.item() == 7.0)
    # A failed Work: an unsupported reduce op on a dtype is refused on every rank alike.
    w = None
    try:
        w = dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND, async_op=True)
    except Exception as e:  # noqa: BLE001 - refused at the call is as good
        res["refused"] = "BAND" in str(e) or "band" in str(e) or str(e)
    if w is not None:
        deadline = time.monotonic() + 60
        while not w.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
        e = w.exception()
        res["refused"] = (w.is_completed() and not w.is_success() and e is not None and "band" in str(e).lower()) or \
            f"completed={w.is_completed()} success={w.is_success()} exception={e!r}"
    dist.barrier()
    report(res)
    dist.destroy_process_group()


def _lost_rank_model():
    import torch
    import torch.nn as nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _lost_rank_step(ddp, opt, step, rank):
    """One step on the batch of (step, rank): the same batch whichever group runs it."""
    import torch
    gen = torch.Generator().manual_seed(7919 * step + rank)
    x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
    opt.zero_grad()
    ((ddp(x) - y) ** 2).mean().backward()
    opt.step()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled(counts, bound, limit: float = 30.0):
    """``counts()`` once it is at most ``bound`` everywhere, or when ``limit`` seconds have
    passed: a destroyed group's links and loop thread end on that thread, just after
    destroy_process_group returns (a loaded machine may take a moment to run it)."""
    import time
    deadline = time.monotonic() + limit
    while True:
        c = counts()
        if all(x <= b for x, b in zip(c, bound)) or time.monotonic() > deadline:
            return c
        time.sleep(0.01)


def _threads() -> int:
    """This process's threads, native ones included (gloo's, the mesh's)."""
    return len(os.listdir("/proc/self/task"))


def scenario_torch_lost_rank(args):
    """Fault-tolerant DDP as torchft-style trainers do it. 3 ranks train; at step k the last
    rank is SIGKILLed mid-step. The survivors' step fails naming it, their next call too;
    get_error() reports it; they shrink the group (dist.shrink_group, or with `regroup` =
    "new_group" or where torch lacks it a new group of the survivors), wrap the model again and train on from the state of
    step k, which they save for the gloo reference. Before training, abort() of a healthy
    group ends a pending receive at once."""
    import re
    import signal
    import threading
    import time
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist = _torch_init("mobius")
    k, more, dead = args["k"], args["more"], WORLD - 1
    res = {}
    # abort() of a healthy group ends a pending Work at once, with the abort as its error.
    sub = dist.new_group([0, 1])
    if RANK == 0:
        w = dist.irecv(torch.zeros(4), src=1, group=sub, tag=5)
        time.sleep(0.05)
        t0 = time.monotonic()
        sub.abort()
        while not w.is_completed() and time.monotonic() - t0 < 30:
            time.sleep(0.001)
        res["abort_ends_pending"] = time.monotonic() - t0 < 5 and w.is_completed() and not w.is_success()
        res["abort_error"] = str(w.exception())
    dist.barrier()
    model = _lost_rank_model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(k):
        _lost_rank_step(ddp, opt, step, RANK)
    if RANK != dead:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{args['out']}/state{RANK}.pt")
    dist.barrier()
    threads_before, fds_before = threading.active_count(), _fds()
    if RANK == dead:
        # Mid-step: the others are already inside the step's all-reduces.
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        time.sleep(60)
    pg = dist.group.WORLD
    t0 = time.monotonic()
    try:
        _lost_rank_step(ddp, opt, k, RANK)
        res["step_error"] = None
    except Exception as e:  # noqa: BLE001 - the failure is what is checked
        res["step_error"] = str(e)
    res["failed_after_s"] = time.monotonic() - t0
    try:
        dist.all_reduce(torch.ones(2))
        res["next_error"] = None
    except Exception as e:  # noqa: BLE001
        res["next_error"] = str(e)
    backend = pg._get_backend(torch.device("cpu"))
    res["get_error"] = str(backend.get_error())
    res["failed_rank"] = backend.failed_rank()
    # Which ranks do the errors say failed? Only the dead one.
    res["blamed"] = sorted({int(m) for e in (res["step_error"], res["next_error"]) if e
                            for m in re.findall(r"rank (\d+) failed", e)})
    t1 = time.monotonic()
    pg.abort()
    res["abort_s"] = time.monotonic() - t1
    if args.get("regroup", "shrink_group") == "shrink_group" and hasattr(dist, "shrink_group"):
        new = dist.shrink_group([dead])
        res["regroup"] = "shrink_group"
    else:
        # The way where torch has no shrink_group: only the survivors take part.
        new = dist.new_group([r for r in range(WORLD) if r != dead], use_local_synchronization=True)
        res["regroup"] = "new_group"
    res["new_size"], res["new_rank"] = new.size(), new.rank()
    # Train on from step k's state: the failed step changed no parameter (its optimizer
    # step never ran); its gradients are dropped.
    state = torch.load(f"{args['out']}/state{RANK}.pt")
    model.load_state_dict(state["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(state["opt"])
    ddp = DDP(model, process_group=new, bucket_cap_mb=0.001)
    for step in range(k, k + more):
        _lost_rank_step(ddp, opt, step, new.rank())
    res["params"] = [p.detach().double().reshape(-1).tolist() for p in model.parameters()]
    res["threads"] = [threads_before, threading.active_count()]
    res["fds"] = [fds_before, _fds()]
    report(res)
    dist.destroy_process_group()


def scenario_torch_lost_rank_reference(args):
    """The gloo reference: 2 ranks from the survivors' saved state of step k, the same
    batches, the same steps."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist = _torch_init("gloo")
    model = _lost_rank_model()
    state = torch.load(f"{args['out']}/state{RANK}.pt")
    model.load_state_dict(state["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(state["opt"])
    ddp = DDP(model, bucket_cap_mb=0.001)
    for step in range(args["k"], args["k"] + args["more"]):
        _lost_rank_step(ddp, opt, step, RANK)
    report({"params": [p.detach().double().reshape(-1).tolist() for p in model.parameters()]})
    os._exit(0)  # see scenario_ddp


def scenario_torch_groups(args):
    """Group creation as a DeviceMesh or new_subgroups makes groups: `groups` times
    new_group over every rank (then new_subgroups and split_group where torch has them),
    each used once. Reports the time per group (slowest rank), and this process's threads
    and fds before, with the groups alive, and after destroying them."""
    import threading
    import time
    import torch
    backend = args.get("backend", "mobius")
    dist = _torch_init(backend)
    n = args.get("groups", 40)
    res = {"threads": [_threads()], "fds": [_fds()]}
    groups = []
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        groups.append(dist.new_group(list(range(WORLD))))
    res["new_group_s"] = (time.perf_counter() - t0) / n
    for g in groups:
        t = torch.ones(4)
        dist.all_reduce(t, group=g)
        assert t[0].item() == WORLD
    if backend == "mobius":
        # Links rank 0 measured, per group: the default group's (when MOBIUS_TUNE is on), and
        # none for the groups made after it, which take its cost model.
        cpu = torch.device("cpu")
        res["measured_links"] = [len(pg._get_backend(cpu).comm.link_costs()) for pg in [dist.group.WORLD] + groups]
    res["threads"].append(_threads())
    res["fds"].append(_fds())
    if WORLD % 2 == 0:
        dist.barrier()
        t0 = time.perf_counter()
        sub, _ = dist.new_subgroups(group_size=2)
        res["new_subgroups_s"] = time.perf_counter() - t0
        t = torch.ones(2)
        dist.all_reduce(t, group=sub)
        assert t[0].item() == 2
        if hasattr(dist, "split_group"):
            dist.barrier()
            t0 = time.perf_counter()
            halves = [list(range(0, WORLD, 2)), list(range(1, WORLD, 2))]
            sg = dist.split_group(split_ranks=halves)
            res["split_group_s"] = time.perf_counter() - t0
            t = torch.ones(2)
            dist.all_reduce(t, group=sg)
            res["split_group_ok"] = t[0].item() == WORLD // 2
    for g in groups:
        dist.destroy_process_group(g)
    after = _settled(lambda: (_threads(), _fds()), (res["threads"][0] + 5, res["fds"][0] + 16))
    res["threads"].append(after[0])
    res["fds"].append(after[1])
    _torch_finish(dist, backend, res)


def scenario_torch_device_mesh(args):
    """A 2 × 2 DeviceMesh on CPU: its row and column groups, and a DTensor sharded over one
    dimension and replicated over the other, checked against plain arithmetic."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    dist = _torch_init(args.get("backend", "mobius"))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    res = {}
    coords = mesh.get_coordinate()
    for dim, name in enumerate(("dp", "tp")):
        g = mesh.get_group(name)
        t = torch.tensor([float(RANK)])
        dist.all_reduce(t, group=g)
        peers = [r for r in range(4) if divmod(r, 2)[dim] == coords[dim]]  # placeholder
        members = dist.get_process_group_ranks(g)
        res[f"{name}_sum"] = t.item() == float(sum(members))
        res[f"{name}_size"] = len(members) == 2 and RANK in members
        del peers
    full = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    d = DTensor.from_local(full[RANK // 2 * 2:(RANK // 2 + 1) * 2].clone(), mesh, [Shard(0), Replicate()])
    res["dtensor_full"] = bool(torch.equal(d.full_tensor(), full))
    res["dtensor_sum"] = float((d * 2).sum().full_tensor()) == float(full.sum() * 2)
    report(res)
    dist.destroy_process_group()


def scenario_wrong_secret(args):
    """Rank 1 has another secret than rank 0, over `transport`: its handshake is refused, and
    a refusal is final, so it fails at once naming authentication. (Rank 0 cannot tell a
    stranger from a late rank 1: it keeps waiting, until its own short timeout here.)"""
    import time
    import mobius
    t0 = time.monotonic()
    try:
        mobius.init(timeout=args["timeout"] if RANK == 0 else 60, transport=args["transport"],
                    secret="right" if RANK == 0 else "wrong").close()
        err = None
    except mobius.MobiusError as e:
        err = str(e)
    report({"error": err, "seconds": time.monotonic() - t0})


def scenario_torch_peer_dies(args):
    """Rank 0's asynchronous 64 MiB allreduce fails at wait() when rank 1 dies mid-way."""
    import signal
    import torch
    dist = _torch_init("mobius")
    token = torch.zeros(1)
    if RANK == 1:
        dist.recv(token, src=0, tag=1)
        os.kill(os.getpid(), signal.SIGKILL)
    big = torch.ones(16 << 20)
    work = dist.all_reduce(big, async_op=True)
    res = {"pending_before_wait": not work.get_future().done()}
    dist.send(torch.ones(1), dst=1, tag=1)
    try:
        work.wait()
        res["error"] = None
    except RuntimeError as e:
        res["error"] = str(e)
    # The future fails too. (Through the caller's wrapper, torch 2.15 hands the error back as
    # the future's value rather than raising it; the backend's own future raises.)
    fut = work.get_future()
    try:
        v = fut.wait()
        res["future_error"] = str(v) if isinstance(v, BaseException) else None
    except Exception as e:  # noqa: BLE001 - recorded
        res["future_error"] = str(e)
    res["future_done"] = fut.done()
    report(res)
    os._exit(0)  # the group is broken; skip the goodbye


def dispatch(scope: dict) -> None:
    """Runs ``scenario_<argv[1]>`` of ``scope`` (a worker module's globals) with the JSON
    arguments in ``argv[2]``; a scenario that raises prints its traceback and exits 3."""
    scenario = sys.argv[1]
    args = json.loads(sys.argv[2])
    try:
        scope[f"scenario_{scenario}"](args)
    except Exception:
        traceback.print_exc()
        sys.exit(3)


if __name__ == "__main__":
    dispatch(globals())
