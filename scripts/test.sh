#!/usr/bin/env bash
# Runs every test of the project, installing what it needs first. This is the README's test
# command and what CI runs (.ci/run calls it, then the small demo).
#
#   scripts/test.sh            every suite; campaign-sized ones at one representative case (CI)
#   scripts/test.sh --full     every suite whole (run it before resolving an issue that touches
#                              those paths): exports RDMA_TEST_FULL=1, which the suites read
#   RDMA_SHUFFLE_FUZZ_SECONDS=N   seconds per fuzz target (default 5; 60 under --full)
#   RDMA_TEST_JVM_C2=1            the Spark suites' JVMs keep C2 (otherwise C1 only, for speed)
#
# What --full adds: TPC-DS all 103 queries of each Spark line at SF 0.1 (those empty there again
# at SF 1) instead of a representative set; the Spark 3.5 line's fault, soak, large-block,
# security and elastic tests; each fuzz target for 60 s instead of 5; on YARN, each
# application in the other deploy mode too, Spark 3.5's default shuffle beside its plugin run,
# and the jobs at scale 1; the Mobius suite's `full` cases (world 3 beside 2 and 4, more host
# layouts, the sdist build). Each step's time is printed at the end
# (step_summary in scripts/lib.sh; under .ci/run, at the end of CI). To add a step:
# `step "what it shows"` then its commands, in the place its prerequisites are built; a step only
# for --full goes inside `if full; then ... fi` (or reads RDMA_TEST_FULL inside its suite). Keep
# CI under 45 minutes on a quiet machine: the step table shows where the time goes.
#
# Every step is required: a script this file names that is missing makes the run fail (scripts
# are run with `bash`, so a lost exec bit cannot drop a suite either).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
while [ $# -gt 0 ]; do
  case "$1" in
    --full) export RDMA_TEST_FULL=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "test.sh: unknown argument '$1' (--full, --help)" >&2; exit 2 ;;
  esac
done
mkdir -p target
# Step times: into CI's file when .ci/run runs this (it prints the table at its end), else ours.
STEP_TIMES=${RDMA_STEP_TIMES:-$PWD/target/step-times.tsv}
if [ -z "${RDMA_STEP_TIMES:-}" ]; then
  : > "$STEP_TIMES"
  trap 'rc=$?; step_summary "$STEP_TIMES" $([ $rc = 0 ] || echo failed); exit $rc' EXIT
fi

step "toolchain"
ensure_rust
ensure_rust_lint_tools

step "lint: rustfmt (rustfmt.toml) over the workspace"
cargo fmt --all --check

step "lint: clippy over the workspace, warnings are errors"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "lint: clippy over the verbs provider, the registry, shuffle, mobius-collective and the benches with verbs built in"
apt_install libibverbs-dev librdmacm-dev libclang-dev clang pkg-config   # build deps of rdma-sys
cargo clippy --locked -p rdma-shuffle-provider-verbs -p rdma-shuffle-providers -p rdma-shuffle-shuffle -p mobius-collective -p rdma-shuffle-bench \
  --all-targets --features rdma-shuffle-providers/verbs -- -D warnings

step "lint: no import cycle between the modules of fabric and of each provider crate (scripts/module_cycles.py)"
for src in crates/fabric/src crates/providers/*/src; do python3 scripts/module_cycles.py "$src"; done

step "lint: Scala formatting (scalafmt through spotless; 'mvn spotless:apply' fixes it)"
(cd jvm-plugin && mvn -B -q spotless:check)

step "settings: the README tables (and docs/mobius.md's) are the ones generated from settings/*.tsv"
python3 settings/readme_table.py --check README.md jvm-plugin/README.md docs/mobius.md

step "rust: build and test the workspace"
cargo build --workspace --all-targets --locked
cargo test --workspace --locked 2>&1 | tee target/test-rust.log
summarize_cargo target/test-rust.log

step "libfabric: the ofi provider, its shuffle and mesh conformance suites over tcp;ofi_rxm (fi_read and messages) and shm, opened by name (libfabric 2.1 built once per machine)"
apt_install libclang-dev clang pkg-config   # bindgen in ofi-libfabric-sys
LIBFABRIC_PREFIX=$(run_script scripts/ensure-libfabric.sh)
PKG_CONFIG_PATH=$LIBFABRIC_PREFIX/lib/pkgconfig cargo clippy --locked -p rdma-shuffle-provider-ofi -p rdma-shuffle-providers --all-targets --features rdma-shuffle-providers/ofi -- -D warnings
PKG_CONFIG_PATH=$LIBFABRIC_PREFIX/lib/pkgconfig cargo test --locked -p rdma-shuffle-provider-ofi --features libfabric 2>&1 | tee target/test-ofi.log
# The registry's own test binary has no rpath to libfabric (the provider's tests do).
PKG_CONFIG_PATH=$LIBFABRIC_PREFIX/lib/pkgconfig LD_LIBRARY_PATH=$LIBFABRIC_PREFIX/lib \
  cargo test --locked -p rdma-shuffle-providers --features ofi --lib 2>&1 | tee -a target/test-ofi.log
summarize_cargo target/test-ofi.log

step "mobius: collectives in real processes (numpy, torch backend, DDP vs gloo, faults, bench smoke)"
run_script tests/collective/run.sh

step "libfabric: the Mobius suite with MOBIUS_TRANSPORT=ofi over tcp;ofi_rxm and shm, 2 ranks in real processes (numpy: every op x dtype x reduce op; torch.distributed against numpy; DDP against gloo; transport and libfabric's counters checked)"
# The wheel built with the ofi feature (it links the libfabric of ensure-libfabric.sh), once.
PKG_CONFIG_PATH=$LIBFABRIC_PREFIX/lib/pkgconfig MOBIUS_FEATURES=ofi RDMA_TEST_OFI='tcp;ofi_rxm,shm' LD_LIBRARY_PATH=$LIBFABRIC_PREFIX/lib run_script tests/collective/run.sh test_ofi.py
if full; then
  # The rest of the suite's correctness and torch cases at every world, over each provider.
  for prov in 'tcp;ofi_rxm' shm; do
    MOBIUS_SKIP_BUILD=1 MOBIUS_TRANSPORT=ofi MOBIUS_OFI_PROVIDER=$prov LD_LIBRARY_PATH=$LIBFABRIC_PREFIX/lib \
      run_script tests/collective/run.sh test_correctness.py test_c10d.py test_torch.py test_python_api.py \
      -k "every_op or mid_sizes or 64_mib or float_sums or every_collective or async_work or ddp or torch_distributed_calls or in_place"
  done
fi

step "rust: verbs provider built in, on this host (no RDMA device: auto must pick tcp and say why)"
run_script scripts/softroce-prepare.sh   # host build deps of rdma-sys (libibverbs-dev, clang) and the VM cache
cargo test --locked -p rdma-shuffle-provider-verbs -p rdma-shuffle-providers -p rdma-shuffle-shuffle --features rdma-shuffle-providers/verbs --lib 2>&1 | tee target/test-verbs-host.log
summarize_cargo target/test-verbs-host.log

step "verbs: conformance suite, cross-device test and Mobius collectives on real kernel RDMA (SoftRoCE VM)"
run_script scripts/verbs-test.sh

step "libfabric over verbs;ofi_rxm on real kernel RDMA (SoftRoCE VM): sends, fi_read as RDMA READs (counted), and the shuffle conformance suite over the ofi provider"
run_script scripts/ofi-verbs-test.sh

step "rust: criterion micro-benchmarks compile and run once"
# In test mode (criterion runs each benchmark once), on the dev build made above: a release
# build of criterion and its dependencies only for this check cost ~4 min of CI.
cargo test --locked -p rdma-shuffle-wire --bench codec 2>&1 | tail -n 8
cargo test --locked -p rdma-shuffle-fabric --bench pool 2>&1 | tail -n 8

step "jvm: native library (verbs + tcp-only builds) and the plugin jar, both Spark lines (JUnit runs in package)"
run_script scripts/build-native.sh
. scripts/spark-env.sh
for profile in "" spark-3.5; do
  log=target/mvn-${profile:-default}.log
  if ! (cd jvm-plugin && mvn -B ${profile:+-P$profile} package) > "$log" 2>&1; then
    tail -n 80 "$log"; echo "maven build ${profile:-default} failed (full log: $log)" >&2; exit 1
  fi
  grep -E "^\[(INFO|WARNING|ERROR)\] Tests run:" "$log" | tail -n 3
done

step "jni: the real bridge inside a JVM under -Xcheck:jni"
run_script scripts/jni-test.sh --no-build   # the library built above

# The Spark suites reuse the jars built above (--no-build) and fail, rather than skip, when the
# plugin runs without its native engine.
export RDMA_SHUFFLE_REQUIRE_NATIVE=1
# The JVMs of the Spark suites (drivers, executors, local-cluster's and the namespace cluster's
# daemons, YARN's) run the client compiler only: their applications live seconds on two cores,
# where C2's compile threads cost more than they return (the Spark 4.2 suite 492 -> 255 s, the
# cluster suite 161 -> 87 s, its TPC-DS queries at SF 0.1 30 -> 15 s; all tests the same). It
# changes how fast the JVM runs Spark, not what the plugin does; no benchmark and not the demo
# set it. RDMA_TEST_JVM_C2=1 leaves the JVMs' defaults.
if [ "${RDMA_TEST_JVM_C2:-0}" != 1 ]; then
  export JAVA_TOOL_OPTIONS="${JAVA_TOOL_OPTIONS:+$JAVA_TOOL_OPTIONS }-XX:TieredStopAtLevel=1"
fi

step "spark $SPARK_VERSION: unchanged jobs on local-cluster, default shuffle vs the plugin (+ fault, decommission and dynamic-allocation tests, 200-shuffle soak, TPC-DS SF 0.1)"
# test_tpcds.py: a representative set of 6 TPC-DS queries at SF 0.1 under both shuffles (every
# one returns rows; the most shuffle-heavy, the ones with DOUBLE columns), ~1.5 min quiet; under
# --full all 103 (~10 min quiet) and the 21 empty at SF 0.1 again at SF 1 (~4 min).
run_script tests/spark/run.sh --no-build

# Spark 3.5 differs from 4.x in how the plugin is installed (extraClassPath, not --jars) and in
# the shims the -Pspark-3.5 build compiles. The lean run covers exactly that with the job suite
# (test_jobs.py: every job's output equal to the default shuffle's, the manager on every executor,
# the engines' counters equal to Spark's remote reads, Spark's read metrics): its assertions share
# one application per mode, and a representative TPC-DS set on 3.5's own query texts. Left to
# --full, to keep CI within its budget: the fault tests (test_faults.py: three more applications
# with executor kills, and a broken native library) the soak (test_soak.py: 200 shuffles in one
# more application), the large blocks (test_large_blocks.py: two more applications), the
# security tests (test_security.py: two more, spark.authenticate and encryption settings the
# plugin reads the same way on both lines) and the elastic tests (test_elastic.py:
# decommission and dynamic allocation, two more), whose code paths have nothing specific to
# 3.5 (the resolver method the migration hook overrides is the same in both lines), and the
# other TPC-DS queries.
if full; then
  step "spark 3.5.9: every Spark suite and all TPC-DS queries, the plugin installed on the JVMs' class path"
  RDMA_SPARK_PROFILE=spark-3.5 run_script tests/spark/run.sh --no-build
else
  step "spark 3.5.9: the same jobs and 2 TPC-DS queries, the plugin installed on the JVMs' class path (lean run)"
  RDMA_SPARK_PROFILE=spark-3.5 run_script tests/spark/run.sh --no-build --ignore=tests/spark/test_faults.py --ignore=tests/spark/test_soak.py --ignore=tests/spark/test_large_blocks.py --ignore=tests/spark/test_security.py --ignore=tests/spark/test_elastic.py
fi

step "yarn: Spark $SPARK_VERSION and 3.5.9 on a real YARN cluster (MiniYARNCluster, pmem check on, spark_shuffle service): client mode without and cluster mode with the external shuffle service and dynamic allocation, executors released, a container killed in each; default shuffle vs the plugin, peak memory per container"
# Two applications per shuffle and one Spark 3.5 application on one cluster start
# (tests/yarn/test_yarn.py); RDMA_TEST_FULL=1 adds the other deploy mode of each and scale 1.
run_script tests/yarn/run.sh --no-build

step "cluster: Spark standalone, master + 3 workers in network namespaces (each with Spark's external shuffle service), default shuffle vs the plugin, executors killed with and without the service"
run_script tests/cluster/run.sh

step "container: the podman image and a standalone cluster of containers started as Kubernetes starts pods (uid 185, no capabilities, default memlock, memory limits), default shuffle vs the plugin (tcp, saying why)"
run_script docker/build.sh
run_script docker/cluster.sh terasort,wordcount 0.1

step "spark over verbs: the preflight (Doctor) and an unchanged job through the plugin on real kernel RDMA (SoftRoCE VM)"
run_script scripts/spark-verbs-test.sh

step "spark over libfabric: unchanged jobs through the plugin with transport=ofi over tcp;ofi_rxm and shm (native library built with ofi), outputs equal to the default shuffle's, blocks by messages and fi_read"
run_script scripts/spark-ofi-test.sh terasort,wordcount 0.05 'tcp;ofi_rxm,shm'

# The benchmark scripts at CI size, so they cannot rot: reports complete, speed not asserted.
# One in CI (the verbs sweep); the scale run (a release build of the bench crate with the verbs
# feature, ~2 min, and the VM again) under --full.
step "bench (CI size, SoftRoCE VM): verbs sweep at 4k/64k/1m; report complete, speed not asserted"
run_script scripts/bench-engine.sh --provider verbs -- --sizes 4k,64k,1m --secs 0.5 --lat-samples 5:20 --lat-secs 1 --max-mib 8
if full; then
  step "bench (SoftRoCE VM): verbs scale run at 2 and 4 peers; report complete"
  run_script scripts/bench-scale.sh --provider verbs --verbs-peers 2,4 --timeout 600 -- --samples 2 --settle-secs 1
fi

step "fuzz: frame decoder and handshake, bounded"
# 5 s per target in CI: a smoke of each target (its kept corpus, crashes included, replays in the
# first second); the campaign is --full's 60 s, or scripts/fuzz.sh with a longer time.
run_script scripts/fuzz.sh "${RDMA_SHUFFLE_FUZZ_SECONDS:-$(full && echo 60 || echo 5)}"

finish
