#!/usr/bin/env bash
# Engine benchmark over loopback tcp (release build): raw-socket ceiling vs the engine,
# 4 KiB block rate and latency, CPU per GiB. Prints a table, writes target/bench/engine.json.
#   scripts/bench-engine.sh [--gib N]
# With --provider verbs it runs the verbs benchmark inside the SoftRoCE VM instead.
set -euo pipefail
cd "$(dirname "$0")/.."
GIB=1
PROVIDER=tcp
while [ $# -gt 0 ]; do
  case $1 in
    --gib) GIB=$2; shift 2 ;;
    --provider) PROVIDER=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ "$PROVIDER" != tcp ]; then
  echo "provider '$PROVIDER' is not available in this build (only tcp)" >&2
  exit 2
fi
cargo build --release -q -p rdma-shuffle-bench --bin engine-bench
mkdir -p target/bench
./target/release/engine-bench run --gib "$GIB" --out target/bench/engine.json
