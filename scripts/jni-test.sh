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
case "${RDMA_SPARK_PROFILE:-}" in spark-3.5) line=3.5 ;; *) line=4.x ;; esac
report="jvm-plugin/plugin/target/spark-$line/surefire-reports/TEST-org.apache.spark.shuffle.rdma.NativeBridgeJniTest.xml"
# A report left by an earlier run must not stand in for this one.
rm -f "$report"
(
  cd jvm-plugin
  # -am builds the parent first; surefire then runs only the JNI test class (the other modules
  # have no class of that name, hence failIfNoSpecifiedTests=false).
  mvn -q -B test -pl plugin -am ${RDMA_SPARK_PROFILE:+-P$RDMA_SPARK_PROFILE} \
    -Dtest=NativeBridgeJniTest -Dsurefire.failIfNoSpecifiedTests=false -Drdma.jni.required=true
)
# Maven passes when the filter matched nothing or the test skipped itself (Assume): only
# Surefire's report says whether the test really ran.
python3 - "$report" <<'PY'
import sys
import xml.etree.ElementTree as ET
path = sys.argv[1]
try:
    suite = ET.parse(path).getroot()
except (OSError, ET.ParseError) as e:
    sys.exit(f"jni-test.sh: FAILED: no Surefire report of NativeBridgeJniTest ({path}: {e}); the test did not run")
n = {k: int(suite.get(k, "0")) for k in ("tests", "skipped", "failures", "errors")}
if n["tests"] == 0 or n["skipped"] or n["failures"] or n["errors"]:
    sys.exit(f"jni-test.sh: FAILED: NativeBridgeJniTest ran {n['tests']} test(s), skipped {n['skipped']}, "
             f"failed {n['failures']}, errors {n['errors']} ({path}); it must run and pass, nothing skipped")
print(f"jni-test.sh: NativeBridgeJniTest: {n['tests']} test(s) ran, none skipped ({path})")
PY
step "JNI test passed"
