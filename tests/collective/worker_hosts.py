"""One rank of the Mobius group tests about addresses, subgroups, hosts and security:
``worker_hosts.py <scenario> <json args> <outdir>``, launched by ``harness.Group(...,
script="worker_hosts.py")``, or by ``torchrun`` on the namespace hosts (then ``RANK`` and
``WORLD_SIZE`` come from torchrun). Each scenario checks its own results and writes a JSON
report to ``<outdir>/rank<r>.json``; files named ``<what><rank>`` in ``<outdir>`` tell the
test how far a rank got.
"""

from __future__ import annotations

import json
import os
import socket
import time

import numpy as np

from worker import OUT, RANK, WORLD, dispatch, report


def mark(what: str, data: str = "") -> None:
    """Tells the test this rank got to ``what`` (written whole, then renamed)."""
    tmp = OUT / f".{what}{RANK}.tmp"
    tmp.write_text(data)
    tmp.rename(OUT / f"{what}{RANK}")


def host_ip() -> str:
    """This host's own address: ``HOST_IP`` (the namespace hosts, which have no default
    route), else the one its default route leaves from."""
    if os.environ.get("HOST_IP"):
        return os.environ["HOST_IP"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        return s.getsockname()[0]


# ----- security --------------------------------------------------------------------------------
def scenario_secure_loop(args):
    """mobius.init, then allreduces of 1 MiB checked exactly, until rank 0 sees ``stop`` (or
    ``max_s`` passes); rank 0 tells the others through the allreduce itself, so every rank
    makes the same calls."""
    import mobius
    comm = mobius.init(timeout=args.get("timeout", 60))
    mark("ready", json.dumps(comm._c.addresses))
    n = 1 << 18
    base = np.arange(n, dtype=np.float32) % 1024
    want = base * WORLD + sum(range(WORLD))
    iters, bad, started = 0, 0, time.monotonic()
    while True:
        x = base + RANK
        stop = RANK == 0 and ((OUT / "stop").exists() or time.monotonic() - started > args.get("max_s", 120))
        flag = np.array([1.0 if stop else 0.0], dtype=np.float32)
        comm.allreduce(x)
        comm.allreduce(flag)
        iters += 1
        bad += int(not np.array_equal(x, want))
        if iters == 1:
            mark("looping")
        if flag[0] > 0:
            break
    report({"iters": iters, "bad": bad, "addresses": comm._c.addresses})
    comm.close()


def scenario_intruder(args):
    """Joins as rank ``claim`` of a world of ``world`` whose other ranks are at
    ``addresses`` (``None``: this process), with the group key ``group``; reports the error."""
    from mobius import _native
    addrs = args["addresses"]

    def exchange(mine):
        return [mine if a is None else a for a in addrs]

    try:
        c = _native.Communicator.join(args["claim"], len(addrs), "127.0.0.1", exchange,
                                      {"group": args["group"], "timeout": 20.0})
        report({"joined": True}, args["name"])
        c.close()
    except Exception as e:  # noqa: BLE001 - the report carries what happened
        report({"joined": False, "error": str(e)}, args["name"])


def scenario_links(args):
    """mobius.init with the start-up measurement on; reports the model and the links."""
    import mobius
    comm = mobius.init(timeout=60, tune=True)
    x = np.ones(1024, dtype=np.float32)
    comm.allreduce(x)
    report({"model": comm.cost_model(), "links": comm.link_costs(), "ok": bool((x == WORLD).all())})
    comm.close()


# ----- torch: init methods, subgroups, DDP, faults ----------------------------------------------
def _backend(dist, group=None):
    import torch
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg._get_backend(torch.device("cpu"))


def _init(args):
    import datetime

    import torch.distributed as dist

    import mobius.torch_backend  # noqa: F401 - registers "mobius"
    timeout = datetime.timedelta(seconds=args.get("timeout", 120))
    method = args.get("init_method")
    if method:
        dist.init_process_group("mobius", init_method=method, rank=RANK, world_size=WORLD, timeout=timeout)
    else:
        dist.init_process_group("mobius", timeout=timeout)  # env:// (and torchrun)
    return dist


def scenario_torch_init(args):
    """init_process_group("mobius") by the given init method; one allreduce; reports the
    addresses the ranks published."""
    import torch
    dist = _init(args)
    t = torch.full((5,), float(RANK + 1))
    dist.all_reduce(t)
    ok = t.tolist() == [float(WORLD * (WORLD + 1) // 2)] * 5
    report({"ok": ok, "addresses": _backend(dist).comm._c.addresses, "host": host_ip()})
    dist.destroy_process_group()


def scenario_subgroups(args):
    """Two disjoint subgroups reduce at the same time, beside the default group and an
    overlapping subgroup; every result is checked."""
    import torch
    dist = _init(args)
    res = {}
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    cross = dist.new_group([0, 2])
    mine = low if RANK < 2 else high
    members = [0, 1] if RANK < 2 else [2, 3]
    n = 1 << 16
    for i in range(args.get("rounds", 20)):
        t = torch.full((n,), float(RANK + i))
        dist.all_reduce(t, group=mine)
        res.setdefault("subgroup", True)
        res["subgroup"] &= bool((t == float(sum(members) + 2 * i)).all())
    t = torch.full((3,), float(RANK))
    dist.all_reduce(t)
    res["default"] = t.tolist() == [float(sum(range(WORLD)))] * 3
    if RANK in (0, 2):
        t = torch.full((3,), float(RANK + 1))
        dist.all_reduce(t, group=cross)
        res["overlapping"] = t.tolist() == [4.0] * 3
    dist.barrier()
    report(res)
    dist.destroy_process_group()


def scenario_ddp_hosts(args):
    """DDP of one model under mobius (the default group) and under gloo (a subgroup of every
    rank), same data; reports the largest relative parameter difference and the addresses
    mobius published."""
    dist = _init(args)
    gloo = dist.new_group(backend="gloo")
    rel, equal = _ddp_rel(dist, gloo, args.get("steps", 30))
    report({"rel": rel, "replicas_equal": equal,
            "addresses": _backend(dist).comm._c.addresses, "host": host_ip()})
    dist.barrier()
    # Leave mobius cleanly (its last sends flushed, then BYE), then skip the rest of the
    # teardown: gloo's can abort in torch 2.15 (see worker.py), and the run is done.
    _backend(dist).comm.close()
    os._exit(0)


def _ddp_rel(dist, gloo, steps):
    """DDP of one model under mobius (the default group) and under gloo, same data: the largest
    relative parameter difference, and whether every rank's mobius replica is the same."""
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    runs = {}
    for name, group in (("mobius", None), ("gloo", gloo)):
        m = model()
        ddp = DDP(m, process_group=group, bucket_cap_mb=0.001)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(1000 + RANK)
        for _ in range(steps):
            x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
            opt.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()
        runs[name] = [p.detach().double() for p in m.parameters()]
    rel = max(float((a - b).norm() / b.norm()) for a, b in zip(runs["mobius"], runs["gloo"]))
    same = torch.tensor([float(sum(p.sum() for p in runs["mobius"]))], dtype=torch.float64)
    ref = same.clone()
    dist.broadcast(ref, src=0)
    return rel, bool(same.item() == ref.item())


def scenario_hier_hosts(args):
    """Several ranks per host on several hosts: the hosts every rank sees, the cost model and
    the policy's allreduce choices; 1 MiB and 16 MiB allreduces (the policy's choice) checked
    exactly; the hierarchical allreduce against the flat ring, both forced in groups of their
    own, timed in interleaved rounds (an iteration's time is the slowest rank's); DDP under
    mobius against gloo."""
    import torch
    dist = _init(args)
    gloo = dist.new_group(backend="gloo")
    comm = _backend(dist).comm
    out = {"hosts": comm.hosts, "model": comm.cost_model(), "links": comm.link_costs(),
           "transport": comm.stats()["transport"],
           "decisions": {str(n): list(comm.decide("allreduce", n)) for n in (4096, 1 << 20, 16 << 20)}}
    checked = {}
    for n in (1 << 18, 4 << 20):
        base = torch.arange(n, dtype=torch.float32) % 1000
        t = base + RANK
        dist.all_reduce(t)
        checked[str(n * 4)] = bool(torch.equal(t, base * WORLD + sum(range(WORLD))))
    out["checked"] = checked
    out["calls"] = comm.stats()["calls"]
    groups = {}
    for algo in ("hier", "ring"):
        os.environ["MOBIUS_ALGO"] = algo
        groups[algo] = dist.new_group(backend="mobius")
    os.environ.pop("MOBIUS_ALGO")
    sizes, iters, rounds = args.get("bench_sizes", []), args.get("iters", 5), args.get("rounds", 2)
    times = {a: {str(s): [] for s in sizes} for a in groups}
    for rnd in range(rounds):
        order = list(groups) if rnd % 2 == 0 else list(groups)[::-1]
        for algo in order:
            g = groups[algo]
            for s in sizes:
                t = torch.ones(s // 4)
                dist.all_reduce(t, group=g)
                its = []
                for _ in range(iters):
                    dist.barrier(group=gloo)
                    t0 = time.perf_counter()
                    dist.all_reduce(t, group=g)
                    its.append(time.perf_counter() - t0)
                slowest = torch.tensor(its, dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=gloo)
                times[algo][str(s)].append(sorted(slowest.tolist())[iters // 2])
                assert float(t[0]) == float(WORLD ** (iters + 1)), (algo, s, float(t[0]))
    out["bench"] = times
    out["bench_calls"] = {a: _backend(dist, g).comm.stats()["calls"] for a, g in groups.items()}
    out["rel"], out["replicas_equal"] = _ddp_rel(dist, gloo, args.get("steps", 20))
    report(out)
    dist.barrier()
    for g in groups.values():
        _backend(dist, g).comm.close()
    _backend(dist).comm.close()
    os._exit(0)


def scenario_kill_loop(args):
    """torch allreduces in a loop until one fails; reports the error and how long after the
    last success it came."""
    import torch
    dist = _init(args)
    mark("ready", host_ip())
    t = torch.ones(1 << 12)
    last = time.time()
    try:
        for i in range(1_000_000):
            dist.all_reduce(t)
            t.fill_(1.0)
            last = time.time()
            if i == 0:
                mark("looping")
            time.sleep(0.01)
        report({"error": None})
    except Exception as e:  # noqa: BLE001 - the report carries the error
        report({"error": str(e), "failed_at": time.time(), "last_ok": last})
    os._exit(0)


if __name__ == "__main__":
    dispatch(globals())
