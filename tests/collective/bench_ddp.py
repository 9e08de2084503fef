"""DDP training benchmark: steps per second of the same model and data under gloo and mobius,
in the same run, with the overlap of gradient allreduce and backward made visible.

    bench_ddp.py run --worlds 2,4 --rounds 3 --steps 4 --out target/bench

Every rank joins one gloo group (the default) and one mobius group (``new_group``), and wraps
two copies of the same model in DistributedDataParallel, one per group (DDP's default
buckets, 25 MB). Each round measures, for each backend in turn (the order alternates between
rounds, so drifting load does not favour one):

* ``step``    — a DDP training step (forward, backward with the bucketed asynchronous
  allreduces DDP issues as gradients become ready, optimizer step);
* ``compute`` — the same step on the bare model (forward, backward, optimizer step), no
  communication;
* ``comm``    — the allreduce of the same gradient bytes alone, bucket by bucket, synchronous.

A step's time is the slowest rank's (after a barrier), averaged over ``steps`` steps; the
report gives the median over rounds and the spread (min, max). Overlap shows as
``step < compute + comm``. Threads: one intra-op thread per rank (``torch.set_num_threads``),
so ranks do not oversubscribe the cores.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BACKENDS = ("gloo", "mobius")


def make_model(width: int, layers: int):
    import torch.nn as nn
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


# ----- one rank ------------------------------------------------------------------------------
def rank_main(args: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import mobius.torch_backend  # noqa: F401 - registers "mobius"

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=args["timeout"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    groups = {"gloo": dist.group.WORLD, "mobius": dist.new_group(backend="mobius", timeout=timeout)}
    torch.manual_seed(0)
    base = make_model(args["width"], args["layers"])
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    # Gradients as views into DDP's buckets (no copy in and out of them), for both backends.
    models = {b: DDP(copy.deepcopy(base), process_group=groups[b], gradient_as_bucket_view=True) for b in BACKENDS}
    bare = copy.deepcopy(base)
    opts = {b: torch.optim.SGD(models[b].parameters(), lr=args["lr"]) for b in BACKENDS}
    bare_opt = torch.optim.SGD(bare.parameters(), lr=args["lr"])
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args["batch"], args["width"], generator=gen)
    y = torch.randn(args["batch"], args["width"], generator=gen)
    bucket = 25 << 20
    flats = [torch.ones(min(bucket, grad_bytes - at) // 4) for at in range(0, grad_bytes, bucket)]

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def timed(fn, n: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return slowest((time.perf_counter() - t0) / n)

    def ddp_step(b):
        def step():
            opts[b].zero_grad()
            ((models[b](x) - y) ** 2).mean().backward()
            opts[b].step()
        return step

    def compute():
        bare_opt.zero_grad()
        ((bare(x) - y) ** 2).mean().backward()
        bare_opt.step()

    def comm(b):
        def run():
            for f in flats:
                dist.all_reduce(f, group=groups[b])
        return run

    for b in BACKENDS:  # warm-up: DDP's first step builds its buckets
        ddp_step(b)()
        comm(b)()
    compute()
    rounds = []
    for r in range(args["rounds"]):
        order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
        row = {}
        for b in order:
            row[b] = {"step": timed(ddp_step(b), args["steps"]), "comm": timed(comm(b), args["steps"])}
        row["compute"] = timed(compute, args["steps"])
        rounds.append(row)
    # What the training did, against what it should have done. The updates (parameters now less
    # the initial ones, `base`, which training never touches) of the Mobius replica must equal
    # the gloo replica's, and every rank's Mobius replica must equal rank 0's (DDP keeps replicas
    # identical only if the allreduce really averaged the gradients: a no-op allreduce trains
    # each rank on its own batch). Both as a norm relative to the norm of the update, so a check
    # that passes cannot pass for updates lost below a fixed absolute bound.
    def flat(m):
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    init, got = flat(base), {b: flat(models[b]) for b in BACKENDS}
    update = (got["gloo"] - init).norm().item()
    rel = (got["mobius"] - got["gloo"]).norm().item() / max(update, 1e-30)
    everyone = [torch.empty_like(got["mobius"]) for _ in range(world)]
    dist.all_gather(everyone, got["mobius"])  # over gloo (the default group)
    replicas = max((x - everyone[0]).norm().item() for x in everyone) / max(update, 1e-30)
    diff = max((a - b).abs().max().item() for a, b in zip(models["gloo"].parameters(), models["mobius"].parameters()))
    worst = torch.tensor([rel, replicas, diff], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(args["out_json"]).write_text(json.dumps({
            "world": world, "grad_bytes": grad_bytes, "rounds": rounds, "lr": args["lr"],
            "update_norm": update, "mobius_vs_gloo_rel": worst[0].item(),
            "replicas_rel": worst[1].item(), "param_max_diff": worst[2].item()}))
    dist.barrier()
    os._exit(0)  # torch 2.15's gloo can abort in teardown; the results are written


# ----- driver --------------------------------------------------------------------------------
def launch(world: int, args: dict, outdir: Path, timeout: float) -> dict:
    from harness import free_port
    port = free_port()
    out_json = outdir / f"ddp-world{world}.json"
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   MOBIUS_TUNE=os.environ.get("MOBIUS_TUNE", "on"))
        log = open(outdir / f"ddp-world{world}-rank{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, __file__, "rank", json.dumps(dict(args, out_json=str(out_json)))],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    for r, p in enumerate(procs):
        try:
            code = p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"world {world}: rank {r} still running after {timeout:.0f} s")
        if code != 0:
            for q in procs:
                q.kill()
            log = (outdir / f"ddp-world{world}-rank{r}.log").read_text()[-3000:]
            raise SystemExit(f"world {world}: rank {r} exited with {code}:\n{log}")
    return json.loads(out_json.read_text())


def summarize(res: dict) -> dict:
    def stats(vals):
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    out = {"world": res["world"], "grad_mb": res["grad_bytes"] / 1e6, "param_max_diff": res["param_max_diff"],
           "update_norm": res["update_norm"], "mobius_vs_gloo_rel": res["mobius_vs_gloo_rel"],
           "replicas_rel": res["replicas_rel"], "lr": res["lr"],
           "compute_s": stats([r["compute"] for r in res["rounds"]])}
    for b in BACKENDS:
        step = stats([r[b]["step"] for r in res["rounds"]])
        comm = stats([r[b]["comm"] for r in res["rounds"]])
        out[b] = {"step_s": step, "comm_s": comm, "steps_per_s": 1 / step["median"],
                  "compute_plus_comm_s": out["compute_s"]["median"] + comm["median"],
                  "overlap": step["median"] < out["compute_s"]["median"] + comm["median"]}
    out["speedup"] = out["mobius"]["steps_per_s"] / out["gloo"]["steps_per_s"]
    # Per-round ratios, so the spread of the speedup is visible too.
    ratios = [r["gloo"]["step"] / r["mobius"]["step"] for r in res["rounds"]]
    out["speedup_rounds"] = stats(ratios)
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 4.2), squeeze=False)
    for ax, row in zip(axes[0], rows):
        labels, step, compute, comm = [], [], [], []
        for b in BACKENDS:
            labels.append(b)
            step.append(row[b]["step_s"]["median"] * 1e3)
            compute.append(row["compute_s"]["median"] * 1e3)
            comm.append(row[b]["comm_s"]["median"] * 1e3)
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], step, width=0.4, label="DDP step (overlapped)", color="#4477aa")
        ax.bar([x + 0.2 for x in xs], compute, width=0.4, label="compute alone", color="#bbbbbb")
        ax.bar([x + 0.2 for x in xs], comm, width=0.4, bottom=compute, label="+ allreduce alone", color="#ee6677")
        ax.set_xticks(list(xs), [f"{lab}\n{1e3 / s:.2f} steps/s" for lab, s in zip(labels, step)])
        ax.set_ylabel("ms per step (median of rounds)")
        ax.set_title(f"{row['world']} ranks, {row['grad_mb']:.0f} MB of gradients: mobius {row['speedup']:.2f}× gloo")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank_main(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["run"])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    # Large enough that a step's update stands far above float32 rounding of the parameters,
    # so comparing the replicas' updates can tell an allreduce that averaged from one that did
    # nothing (a 1e-4 step moved parameters by ~1e-7, below a 1e-5 bound either way).
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default="target/bench")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    args = {"rounds": a.rounds, "steps": a.steps, "width": a.width, "layers": a.layers, "batch": a.batch,
            "lr": a.lr, "timeout": a.timeout}
    rows = [summarize(launch(int(w), args, out, a.timeout)) for w in a.worlds.split(",")]
    (out / "ddp.json").write_text(json.dumps({"args": args, "rows": rows}, indent=1))
    print(f"{'ranks':>5} {'grad MB':>7} {'backend':>7} {'step ms':>16} {'compute ms':>10} {'comm ms':>16} "
          f"{'steps/s':>7} {'overlap':>7}")
    for row in rows:
        for b in BACKENDS:
            s, c = row[b]["step_s"], row[b]["comm_s"]
            print(f"{row['world']:>5} {row['grad_mb']:>7.1f} {b:>7} "
                  f"{s['median'] * 1e3:>7.1f} [{s['min'] * 1e3:.0f}-{s['max'] * 1e3:.0f}] "
                  f"{row['compute_s']['median'] * 1e3:>10.1f} "
                  f"{c['median'] * 1e3:>7.1f} [{c['min'] * 1e3:.0f}-{c['max'] * 1e3:.0f}] "
                  f"{row[b]['steps_per_s']:>7.2f} {str(row[b]['overlap']):>7}")
        sr = row["speedup_rounds"]
        print(f"      mobius/gloo steps/s: {row['speedup']:.2f}× (per round {sr['min']:.2f}–{sr['max']:.2f}); "
              f"max |param gloo − mobius| {row['param_max_diff']:.2g}; update gloo − mobius "
              f"{row['mobius_vs_gloo_rel']:.2g} and ranks' mobius replicas apart {row['replicas_rel']:.2g} "
              f"of the update's norm {row['update_norm']:.3g}")
    plot(rows, out / "ddp.png")
    print(f"wrote {out / 'ddp.json'} and {out / 'ddp.png'}")


if __name__ == "__main__":
    main()
