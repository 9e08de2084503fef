#!/usr/bin/env bash
# Runs every test of the project, installing what it needs first. This is the README's test
# command and what CI runs (.ci/run calls it).
#
#   scripts/test.sh            everything
#   RDMA_SHUFFLE_FUZZ_SECONDS=N   seconds per fuzz target (default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

step "toolchain"
ensure_rust

step "rust: build and test the workspace"
cargo build --workspace --all-targets --locked
cargo test --workspace --locked 2>&1 | tee target/test-rust.log
summarize_cargo target/test-rust.log

step "rust: verbs provider built in, on this host (no RDMA device: auto must pick tcp and say why)"
scripts/softroce-prepare.sh   # host build deps of rdma-sys (libibverbs-dev, clang) and the VM cache
cargo test --locked -p rdma-shuffle-fabric -p rdma-shuffle-shuffle --features verbs --lib 2>&1 | tee target/test-verbs-host.log
summarize_cargo target/test-verbs-host.log

step "verbs: conformance suite + cross-device test on real kernel RDMA (SoftRoCE VM)"
scripts/verbs-test.sh

step "rust: criterion micro-benchmarks compile and run once"
cargo bench --locked -p rdma-shuffle-wire --bench codec -- --test 2>&1 | tail -n 8
cargo bench --locked -p rdma-shuffle-fabric --bench pool -- --test 2>&1 | tail -n 8

step "jvm: native library (verbs + tcp-only builds) and the plugin jar, both Spark lines (JUnit runs in package)"
scripts/build-native.sh
. scripts/spark-env.sh
for profile in "" spark-3.5; do
  log=target/mvn-${profile:-default}.log
  if ! (cd jvm-plugin && mvn -B ${profile:+-P$profile} package) > "$log" 2>&1; then
    tail -n 80 "$log"; echo "maven build ${profile:-default} failed (full log: $log)" >&2; exit 1
  fi
  grep -E "^\[(INFO|WARNING|ERROR)\] Tests run:" "$log" | tail -n 3
done

if [ -x scripts/jni-test.sh ]; then
  step "jni: the real bridge inside a JVM under -Xcheck:jni"
  scripts/jni-test.sh
fi

step "spark: unchanged jobs on local-cluster, default shuffle vs the plugin (+ fault tests)"
tests/spark/run.sh

step "cluster: Spark standalone, master + 3 workers in network namespaces, default shuffle vs the plugin"
tests/cluster/run.sh

step "spark over verbs: an unchanged job through the plugin on real kernel RDMA (SoftRoCE VM)"
scripts/spark-verbs-test.sh

step "bench (CI size, SoftRoCE VM): verbs sweep at 4k/64k/1m and verbs scale run at 2 and 4 peers; reports complete, speed not asserted"
T_BENCH=$(date +%s)
scripts/bench-engine.sh --provider verbs -- --sizes 4k,64k,1m --secs 0.5 --lat-samples 5:20 --lat-secs 1 --max-mib 8
scripts/bench-scale.sh --provider verbs --verbs-peers 2,4 --timeout 600 -- --samples 2 --settle-secs 1
echo "bench step: $(( $(date +%s) - T_BENCH )) s"

if [ -x scripts/fuzz.sh ]; then
  step "fuzz: frame decoder and handshake, bounded"
  scripts/fuzz.sh "${RDMA_SHUFFLE_FUZZ_SECONDS:-30}"
fi

finish
