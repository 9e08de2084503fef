#!/usr/bin/env bash
# The JNI test: builds the native library, then runs NativeBridgeJniTest, which drives every
# NativeBridge export of the real library in a child JVM started with -Xcheck:jni and fails on
# any JNI warning HotSpot prints (see jvm-plugin/plugin/src/test/java/.../NativeBridgeJniTest.java).
#
#   scripts/jni-test.sh            # Spark 4.x build of the plugin
#   RDMA_SPARK_PROFILE=spark-3.5 scripts/jni-test.sh
#   scripts/jni-test.sh --no-build # reuse the native library scripts/build-native.sh made
#
# -Drdma.jni.required=true makes a missing library a failure instead of a skip. The child JVM's
# output stays in jvm-plugin/plugin/target/spark-<line>/jni-check/.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
if [ "${1:-}" = --no-build ]; then
  lib="jvm-plugin/plugin/target/native/org/apache/spark/shuffle/rdma/native/linux/$(uname -m)/librdma_shuffle_jni.so"
  [ -f "$lib" ] || { echo "jni-test.sh --no-build: $lib is missing; run scripts/build-native.sh" >&2; exit 1; }
else
  step "native library (scripts/build-native.sh)"
  bash scripts/build-native.sh >/dev/null
fi
step "NativeBridgeJniTest under -Xcheck:jni"
cd jvm-plugin
# -am builds the parent first; surefire then runs only the JNI test class.
mvn -q -B test -pl plugin -am ${RDMA_SPARK_PROFILE:+-P$RDMA_SPARK_PROFILE} \
  -Dtest=NativeBridgeJniTest -Dsurefire.failIfNoSpecifiedTests=false -Drdma.jni.required=true
step "JNI test passed"
