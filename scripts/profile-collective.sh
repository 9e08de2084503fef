#!/usr/bin/env bash
# Per-call profile of a 2-rank allreduce over tcp loopback: Mobius's direct binding
# (mobius-tcp), Mobius through torch.distributed (torch-mobius-tcp) and Open MPI's tcp BTL
# (mpi), the same rank program (tests/collective/profile_rank.py: a barrier, then the call, as
# the benchmark times it). Counts, not times, so it may run on a loaded machine:
#   * system calls per call by name (`strace -f -c`), as the difference between a run of
#     CALLS+20 calls and one of 20 (start-up cancels);
#   * from an untraced run of CALLS calls: context switches per call (voluntary/involuntary,
#     from /proc, the loop only) and Mobius's staged bytes per call (messages that arrived
#     before their receive was posted, read into a pool buffer first);
#   * with --record, `perf record -g` of both ranks (after --delay ms) for the top symbols
#     (the host has no hardware counters: samples of cpu-clock).
#
#   scripts/profile-collective.sh [--sizes 64k,1m] [--libs mobius-tcp,torch-mobius-tcp,mpi]
#                                 [--calls 1000] [--record] [--delay 5000]
# Output: target/profile/<lib>-<size>-<calls>.{strace,perf}.r<rank> and a table on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=64k,1m libs=mobius-tcp,torch-mobius-tcp,mpi calls=1000 record=0 delay=5000
while [ $# -gt 0 ]; do
  case "$1" in
    --sizes) sizes=$2; shift 2 ;; --libs) libs=$2; shift 2 ;; --calls) calls=$2; shift 2 ;;
    --record) record=1; shift ;; --delay) delay=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
. tests/collective/env.sh
export MOBIUS_TRANSPORT=tcp MOBIUS_TUNE=on
out=target/profile; mkdir -p "$out"
bytes() { "$MOBIUS_PY" -c "import sys; s=sys.argv[1].lower(); m={'k':1<<10,'m':1<<20}.get(s[-1],1); print(int(s.rstrip('km'))*m)" "$1"; }
run() { # lib size calls tool(strace|plain|record): files $out/<lib>-<size>-<calls>.<tool>.r<rank>, lines on stdout
  local lib=$1 size=$2 n=$3 tool=$4 f="$out/$1-$2-$3.$4"
  local pre=""
  case $tool in
    strace) pre="strace -f -c -o $f.r" ;;
    record) pre="perf record -D $delay -g -o $f.r" ;;
  esac
  # A rank's command: the tool's prefix with the rank appended to its output file.
  cmd() { echo "${pre:+$pre$1 }$MOBIUS_PY tests/collective/profile_rank.py"; }
  if [ "$lib" = mpi ]; then
    mpirun --allow-run-as-root --oversubscribe -np 2 --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo \
      sh -c "exec $(cmd '$OMPI_COMM_WORLD_RANK') mpi $size $n" 2>&1 | grep '^profile ' || true
  else
    local port; port=$("$MOBIUS_PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    { $(cmd 0) "$lib" "$size" "$n" 0 2 "$port" & $(cmd 1) "$lib" "$size" "$n" 1 2 "$port"; wait; } 2>&1 | grep '^profile ' || true
  fi
}
for lib in ${libs//,/ }; do
  for s in ${sizes//,/ }; do
    size=$(bytes "$s")
    for n in 20 $((calls + 20)); do run "$lib" "$size" "$n" strace >/dev/null; done
    run "$lib" "$size" "$calls" plain | sed "s/^profile /$lib $s /" | tee "$out/$lib-$size-$calls.plain"
    if [ "$record" = 1 ]; then run "$lib" "$size" "$calls" record >/dev/null; fi
  done
done
"$MOBIUS_PY" - "$out" "$libs" "$sizes" "$calls" <<'PY'
import json, re, sys
from pathlib import Path
out, libs, sizes, calls = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(","), int(sys.argv[4])
def size_of(s):
    return int(s[:-1]) * {"k": 1 << 10, "m": 1 << 20}[s[-1]] if s[-1] in "km" else int(s)
def strace(p):
    d = {}
    for line in p.read_text().splitlines():
        f = line.split()
        if len(f) >= 5 and re.fullmatch(r"[\d.]+", f[0]) and f[-1] != "total":
            d[f[-1]] = int(f[3])
    return d
print(f"per call (a barrier, then the allreduce), 2 ranks over tcp; system calls: {calls}+20 calls minus 20")
for lib in libs:
    for s in sizes:
        size = size_of(s)
        plain = {}
        p = out / f"{lib}-{size}-{calls}.plain"
        for obj in re.findall(r"\{[^{}]*\}", p.read_text() if p.exists() else ""):  # ranks' lines may interleave
            j = json.loads(obj)
            plain[j["rank"]] = j
        for r in (0, 1):
            try:
                a = strace(out / f"{lib}-{size}-20.strace.r{r}")
                b = strace(out / f"{lib}-{size}-{calls + 20}.strace.r{r}")
            except OSError as e:
                print(f"{lib} {s} r{r}: missing {e.filename}")
                continue
            per = {k: (b.get(k, 0) - a.get(k, 0)) / calls for k in set(a) | set(b)}
            top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 0.05)
            j = plain.get(r, {})
            extra = f"; switches vol/invol {j['switches_per_call']}" if "switches_per_call" in j else ""
            if "staged_bytes" in j:
                extra += f"; staged {j['staged_bytes'] / calls / 1024:.0f} KiB/call ({j['decision'][0]}, segment {j['decision'][1]})"
            print(f"{lib:17} {s:>4} r{r}: {sum(per.values()):5.1f} syscalls ({top}){extra}")
PY
