"""One rank of scripts/profile-collective.sh: `calls` allreduces of `size` bytes (f32 sum), each
after a barrier as in bench.py, then the rank's context switches per call (voluntary /
involuntary, read from /proc for this process's threads over the loop only) and, for Mobius,
its message counters (placed, folded, staged) on stderr.

    profile_rank.py LIB SIZE CALLS [RANK WORLD PORT]      LIB: mobius-tcp | torch-mobius-tcp | mpi
"""
import json
import os
import sys
import time


def switches():
    """(voluntary, involuntary) context switches of this process's threads so far."""
    vol = invol = 0
    for t in os.listdir("/proc/self/task"):
        try:
            st = open(f"/proc/self/task/{t}/status").read()
        except OSError:
            continue
        vol += int(st.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        invol += int(st.split("nonvoluntary_ctxt_switches:")[1].split()[0])
    return vol, invol


def main():
    lib, size, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    n = max(size // 4, 1)
    stats = None
    if lib == "mpi":
        import numpy as np
        from mpi4py import MPI
        c = MPI.COMM_WORLD
        rank, buf = c.Get_rank(), np.ones(n, np.float32)
        barrier, op = c.Barrier, lambda: c.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    else:
        rank, world, port = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
        if lib == "mobius-tcp":
            import numpy as np
            import mobius
            comm = mobius.init(rank, world, "127.0.0.1", port, timeout=600)
            buf = np.ones(n, np.float32)
            barrier, op, stats = comm.barrier, lambda: comm.allreduce(buf), comm.stats
        else:
            import torch
            import torch.distributed as dist
            import mobius.torch_backend  # noqa: F401 - registers the backend
            dist.init_process_group("mobius", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
            t = torch.ones(n)
            barrier, op = dist.barrier, lambda: dist.all_reduce(t)
    barrier()
    s0 = switches()
    t0 = time.perf_counter()
    for _ in range(calls):
        barrier()
        op()
    dt = time.perf_counter() - t0
    s1 = switches()
    barrier()
    per = calls or 1
    line = {"rank": rank, "us_per_call_loaded": round(dt / per * 1e6, 1),
            "switches_per_call": [round((s1[0] - s0[0]) / per, 2), round((s1[1] - s0[1]) / per, 2)]}
    if stats is not None:
        st = stats()
        line.update({k: st[k] for k in ("placed", "folded", "staged", "staged_bytes")})
        line["decision"] = comm.decide("allreduce", size)
    print("profile " + json.dumps(line), file=sys.stderr)
    sys.stderr.flush()
    if lib != "mpi":
        os._exit(0)  # torch 2.15 can abort in teardown; the numbers are out


if __name__ == "__main__":
    main()
