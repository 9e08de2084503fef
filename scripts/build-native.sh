#!/usr/bin/env bash
# Builds the two variants of the JNI library that the plugin jar bundles:
#   librdma_shuffle_jni.so      with the verbs provider (needs libibverbs.so.1 at run time)
#   librdma_shuffle_jni_tcp.so  tcp only (loads anywhere)
# The loader tries the first and falls back to the second, so a machine without RDMA user
# space still gets the engine over tcp instead of Spark's built-in shuffle.
# Output: jvm-plugin/plugin/target/native/org/apache/spark/shuffle/rdma/native/linux/<arch>/
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust >/dev/null
apt_install libibverbs-dev librdmacm-dev libclang-dev clang pkg-config
ARCH=$(uname -m)  # x86_64 | aarch64: the names NativeLoader.archName uses
OUT=jvm-plugin/plugin/target/native/org/apache/spark/shuffle/rdma/native/linux/$ARCH
mkdir -p "$OUT"
cargo build --release --locked -p rdma-shuffle-jni --features verbs
# Debug info stays in target/ (for symbolizing); the jar gets stripped copies.
objcopy --strip-debug target/release/librdma_shuffle_jni.so "$OUT/librdma_shuffle_jni.so"
# The same target dir: dependencies built with other features get other hashes and stay side
# by side, so this rebuilds only the crates whose features differ (the provider registry, the
# verbs provider, shuffle, jni), not every dependency again; the cdylib it overwrites was
# copied out above.
cargo build --release --locked -p rdma-shuffle-jni
objcopy --strip-debug target/release/librdma_shuffle_jni.so "$OUT/librdma_shuffle_jni_tcp.so"
if readelf -d "$OUT/librdma_shuffle_jni_tcp.so" | grep -q libibverbs; then
  echo "the tcp-only library must not depend on libibverbs" >&2; exit 1
fi
ls -la "$OUT"
