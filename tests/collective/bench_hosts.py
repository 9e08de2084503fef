"""Hierarchical against flat allreduce across hosts: ``scripts/cluster.sh net 2`` (two
network-namespace hosts on a bridge), ``torchrun`` with 2 ranks per host, Mobius' hierarchical
allreduce (``MOBIUS_ALGO=hier``) and its flat ring, each forced in a group of its own, in the
same processes, interleaved rounds (order reversed every other round); an iteration's time is the
slowest rank's, a round's the median of its iterations; the report gives the median of rounds
and their [min–max], busbw as nccl-tests (× 2(n−1)/n). Also printed: the policy's choice and the
model, measured at start (same-host and network links apart).

    bench_hosts.py --sizes 1m,4m,16m --iters 5 --rounds 3 --out target/bench

Needs root. Same-host links are shared memory (`MOBIUS_TRANSPORT=auto` picks the provider per link:
shm inside a namespace host, tcp across the bridge).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import free_port  # noqa: E402
import test_netns  # noqa: E402
from test_netns import in_host, ip_of, tail, wait_all  # noqa: E402

# Namespaces and a subnet of their own, so test_netns.py's cluster may be up meanwhile (its
# helpers read these at call time).
test_netns.PREFIX, test_netns.SUBNET = "mobh", "10.79.0"

REPO = HERE.parent.parent
HOSTS = ["w1", "w2"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1m,4m,16m")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="target/bench")
    a = p.parse_args()
    mult = {"k": 1 << 10, "m": 1 << 20}
    sizes = [int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s) for s in a.sizes.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-hosts-"))
    env = dict(os.environ, CLUSTER_PREFIX=test_netns.PREFIX, CLUSTER_SUBNET=test_netns.SUBNET,
               CLUSTER_DIR=str(work / "cluster"))
    cluster = ["bash", str(REPO / "scripts" / "cluster.sh")]
    subprocess.run([*cluster, "net", str(len(HOSTS))], env=env, check=True, timeout=300)
    try:
        port = free_port()
        args = {"steps": 2, "bench_sizes": sizes, "iters": a.iters, "rounds": a.rounds}
        worker = [str(HERE / "worker_hosts.py"), "hier_hosts", json.dumps(args), str(work)]
        procs, logs = [], []
        for i, h in enumerate(HOSTS):
            log = work / f"{h}.log"
            logs.append(log)
            procs.append(in_host(h, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                     "2", "--node-rank", str(i), "--master-addr", ip_of(HOSTS[0]), "--master-port",
                                     str(port), *worker], {"MOBIUS_TUNE": "on"}, log))
        codes = wait_all(procs, 3600, logs)
        if codes != [0, 0]:
            sys.exit(f"failed {codes}\n{tail(logs)}")
    finally:
        subprocess.run([*cluster, "down"], env=env, capture_output=True, timeout=120)
    r0 = json.loads((work / "rank0.json").read_text())
    m = r0["model"]
    print(f"2 hosts x 2 ranks, links {r0.get('transport', '?')}; measured: network alpha {m['alpha'] * 1e6:.1f} us, beta {1e-9 / m['beta']:.2f} GB/s; "
          f"same-host alpha {m['local_alpha'] * 1e6:.1f} us, beta {1e-9 / m['local_beta']:.2f} GB/s; "
          f"gamma {1e-9 / m['gamma']:.2f} GB/s")
    print("policy (allreduce):", {k: v[0] for k, v in r0["decisions"].items()})
    rows = []
    print(f"\n{'size':>10} {'hier us':>22} {'busbw':>7} {'ring us':>22} {'busbw':>7} {'hier/ring busbw':>16}")
    for s in sizes:
        line, bw = f"{s:>10}", {}
        for algo in ("hier", "ring"):
            ts = r0["bench"][algo][str(s)]
            t = statistics.median(ts)
            bw[algo] = s / t * 2 * 3 / 4 / 1e9
            rows.append({"algo": algo, "bytes": s, "world": 4, "hosts": 2, "time_us": t * 1e6,
                         "time_us_min": min(ts) * 1e6, "time_us_max": max(ts) * 1e6, "busbw_gbs": bw[algo],
                         "rounds": len(ts), "iters": a.iters})
            line += f" {f'{t * 1e6:.0f} [{min(ts) * 1e6:.0f}-{max(ts) * 1e6:.0f}]':>22} {bw[algo]:>7.3f}"
        print(line + f" {bw['hier'] / bw['ring']:>16.2f}")
    (out / "hier-hosts.json").write_text(json.dumps({"rows": rows, "model": m, "decisions": r0["decisions"],
                                                     "links": r0["links"], "transport": r0.get("transport")},
                                                    indent=1))
    print(f"\nwrote {out / 'hier-hosts.json'}")


if __name__ == "__main__":
    main()
