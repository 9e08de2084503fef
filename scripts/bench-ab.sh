#!/usr/bin/env bash
# Interleaved A/B of two revisions of this repository, through the benchmarks users read:
# is B (e.g. a seam change) any slower than A (the main before it)?
#
#   scripts/bench-ab.sh [--rounds N] [--tiny] [--skip engine|probe|collective]... REV_A REV_B
#
# Each revision is checked out once as a detached worktree under
# $HOME/.cache/rdma-shuffle/ab/<commit> and built there once (release engine-bench, the
# mobius wheel, the netty comparison). Then N rounds (default 5), A first in odd rounds and B
# first in even ones, each round running in both trees:
#   probe       target/release/engine-bench probe: tcp, 4 KiB blocks one at a time (p50/p99)
#               and 64 in flight (blocks/s)
#   engine      scripts/bench-engine.sh --rounds 1: tcp bulk throughput and CPU by block size
#               (the engine's rows; iperf3 and Spark's transfer run beside it as always)
#   collective  scripts/bench-collective.sh --libs mobius,mobius-tcp --rounds 1: allreduce
#               over shm (mobius) and tcp (mobius-tcp), 2 and 4 ranks
# Every report is kept under target/bench/ab/<A>-<B>/, and the summary prints, per measured
# number, the median of A's rounds, of B's, and B/A (lower time / higher rate is better; the
# spread of each side's rounds beside it), and writes summary.json.
#
# A campaign: run it alone on a quiet machine (hold /work/heavy.lock); loaded, the rounds
# disagree more than any seam costs. --tiny checks the harness in a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
ROUNDS=5 TINY=0 SKIP=()
while [ $# -gt 2 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --skip) SKIP+=("$2"); shift 2 ;;
    *) break ;;
  esac
done
[ $# -eq 2 ] || { echo "usage: scripts/bench-ab.sh [--rounds N] [--tiny] [--skip engine|probe|collective]... REV_A REV_B" >&2; exit 2; }
A=$(git rev-parse --short=10 "$1^{commit}") B=$(git rev-parse --short=10 "$2^{commit}")
skip() { local s; for s in "${SKIP[@]+"${SKIP[@]}"}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
OUT="$ROOT/target/bench/ab/$A-$B"
mkdir -p "$OUT"
# The summary reads every report in $OUT: a previous run of the same pair (a --tiny check,
# more rounds) must not leak into this one.
rm -f "$OUT"/probe-* "$OUT"/engine-* "$OUT"/collective-* "$OUT"/summary.json
CACHE="$HOME/.cache/rdma-shuffle/ab"
mkdir -p "$CACHE"

tree() { # the worktree of commit $1, made once
  local d="$CACHE/$1"
  if [ ! -d "$d" ]; then
    (flock 9; [ -d "$d" ] || git worktree add --detach "$d" "$1" >/dev/null) 9>"$CACHE/.lock"
  fi
  echo "$d"
}

# The A/B is of the native providers: no libfabric rows (they would double its time).
export RDMA_BENCH_OFI=none
probe_args=(--rounds 3 --idle-secs 1)
engine_args=(--rounds 1 --warmup 1)
coll_args=(--libs mobius,mobius-tcp --rounds 1)
if [ "$TINY" = 1 ]; then
  probe_args=(--rounds 1 --lat-samples 100 --small-reps 2 --idle-secs 1)
  engine_args=(--tiny)
  coll_args=(--tiny --libs mobius,mobius-tcp)
fi

for rev in "$A" "$B"; do
  d=$(tree "$rev")
  echo "== building $rev in $d" >&2
  (cd "$d" && CARGO_TARGET_DIR="$d/target" cargo build --release -q -p rdma-shuffle-bench --bin engine-bench)
  if ! skip collective; then
    (cd "$d" && . tests/collective/env.sh >/dev/null)
  fi
done

run_side() { # $1 = rev, $2 = round
  local d; d=$(tree "$1")
  if ! skip probe; then
    echo "== round $2, $1: probe" >&2
    (cd "$d" && target/release/engine-bench probe "${probe_args[@]}" --out "$OUT/probe-$1-$2.json" >/dev/null)
  fi
  if ! skip engine; then
    echo "== round $2, $1: engine" >&2
    (cd "$d" && bash scripts/bench-engine.sh "${engine_args[@]}" >"$OUT/engine-$1-$2.log" 2>&1) \
      || { tail -n 30 "$OUT/engine-$1-$2.log" >&2; exit 1; }
    cp "$d/target/bench/engine.json" "$OUT/engine-$1-$2.json"
  fi
  if ! skip collective; then
    echo "== round $2, $1: collective" >&2
    (cd "$d" && MOBIUS_SKIP_BUILD=1 bash scripts/bench-collective.sh "${coll_args[@]}" >"$OUT/collective-$1-$2.log" 2>&1) \
      || { tail -n 30 "$OUT/collective-$1-$2.log" >&2; exit 1; }
    cp "$d/target/bench/collective.json" "$OUT/collective-$1-$2.json"
  fi
}

for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then run_side "$A" "$r"; run_side "$B" "$r"; else run_side "$B" "$r"; run_side "$A" "$r"; fi
done

python3 - "$OUT" "$A" "$B" <<'PY'
import glob, json, os, statistics, sys
out, a, b = sys.argv[1:4]

def leaves(v, path=()):
    """Numeric leaves of a report, keyed by path; rows of a table (dicts with a 'library', or
    engine.json's block sizes, dicts with 'bytes') are keyed by what they measure, not by their
    position: two revisions that measure different sets of sizes compare the sizes both have."""
    if isinstance(v, bool):
        return
    if isinstance(v, (int, float)):
        yield path, float(v)
    elif isinstance(v, dict):
        for k, x in v.items():
            if k in ("rounds", "loadavg", "what", "secs", "spin_us", "perf_record"):
                continue
            yield from leaves(x, path + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            if isinstance(x, dict) and ("library" in x or "bytes" in x):
                key = "/".join(str(x.get(k)) for k in ("library", "op", "bytes", "world") if k in x)
                yield from leaves({k: y for k, y in x.items() if k not in ("library", "op", "bytes", "world")}, path + (key,))
            else:
                yield from leaves(x, path + (str(i),))

rows, summary = [], {}
for kind in ("probe", "engine", "collective"):
    sides = {}
    for rev in (a, b):
        vals = {}
        for f in sorted(glob.glob(os.path.join(out, f"{kind}-{rev}-*.json"))):
            for p, x in leaves(json.load(open(f))):
                vals.setdefault(p, []).append(x)
        sides[rev] = vals
    for p in sorted(set(sides[a]) & set(sides[b])):
        xa, xb = sides[a][p], sides[b][p]
        ma, mb = statistics.median(xa), statistics.median(xb)
        key = kind + ":" + "/".join(p)
        summary[key] = {"a": xa, "b": xb, "median_a": ma, "median_b": mb, "b_over_a": mb / ma if ma else None}
        rows.append((key, ma, min(xa), max(xa), mb, min(xb), max(xb), mb / ma if ma else float("nan")))
json.dump({"a": a, "b": b, "metrics": summary}, open(os.path.join(out, "summary.json"), "w"), indent=1)
w = max((len(r[0]) for r in rows), default=10)
print(f"{'metric':<{w}}  {'A ' + a:>28}  {'B ' + b:>28}  {'B/A':>6}")
for k, ma, la, ha, mb, lb, hb, ratio in rows:
    print(f"{k:<{w}}  {ma:>12.4g} [{la:.3g}..{ha:.3g}]  {mb:>12.4g} [{lb:.3g}..{hb:.3g}]  {ratio:>6.3f}")
print(f"\n{len(rows)} numbers; reports and summary.json in {out}")
PY
