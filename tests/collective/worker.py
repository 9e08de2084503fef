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

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
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


def report(obj) -> None:
    (OUT / f"rank{RANK}.json").write_text(json.dumps(obj))


def comm_for(**settings):
    import mobius
    return mobius.init(**settings)


# ---------------------------------------------------------------------------------------------
def scenario_matrix(args):
    """Every op × dtype × reduce op × size that `args["ops"]` names, under one algorithm."""
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
    report({"failures": fails, "cases": cases, "stats": comm.stats()})
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
    (OUT / f"ready{RANK}").write_text("1")
    calls = 0
    try:
        while True:
            comm.allreduce(x)
            calls += 1
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
    gen = torch.Generator().manual_seed(1000 + RANK)
    for _ in range(args["steps"]):
        x = torch.randn(32, 16, generator=gen)
        y = torch.randn(32, 4, generator=gen)
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    params = [p.detach().double().reshape(-1).tolist() for p in model.parameters()]
    report({"params": params, "loss": float(loss.detach())})
    if args["backend"] == "gloo":
        # torch 2.15's gloo sometimes aborts in teardown with 3 ranks ("terminate called
        # without an active exception"); the reference run is done, so skip the teardown.
        os._exit(0)
    dist.destroy_process_group()


def main():
    scenario = sys.argv[1]
    args = json.loads(sys.argv[2])
    try:
        globals()[f"scenario_{scenario}"](args)
    except Exception:
        traceback.print_exc()
        sys.exit(3)


if __name__ == "__main__":
    main()
