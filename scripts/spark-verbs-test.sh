#!/usr/bin/env bash
# A real Spark job shuffling through the plugin over real kernel RDMA: the host's JVM,
# pyspark and the plugin jar are shared into the SoftRoCE VM, where spark-submit runs an
# unchanged job on local-cluster[2,1,...] with spark.shuffle.rdma.transport=verbs (no tcp
# fallback). The same jobs run on the host with Spark's default shuffle; the outputs'
# digests must be equal, and the executors' engine counters must show both data paths: blocks
# above the eager threshold by one-sided RDMA READ (terasort's ~88 KB blocks) and blocks below
# it by SEND/RECV (wordcount's few-KB blocks).
# In the same boot, before the job, the preflight (`java -cp <plugin jar> ...Doctor`) must see
# rxe0 (port ACTIVE, Ethernet, RoCE v2 GIDs), pick the IPv4-mapped GID, register the pool's
# memory, and move 1 MiB by SEND and 1 MiB by RDMA READ on loopback; and with the locked-memory
# limit lowered (no CAP_IPC_LOCK) it must exit 2 naming the limit and the settings to change.
#   scripts/spark-verbs-test.sh [jobs] [scale]      (default: terasort,wordcount 0.05)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
JOB=${1:-terasort,wordcount}
SCALE=${2:-0.05}
. scripts/lib.sh
step "build the native library and the jars"
scripts/build-native.sh >/dev/null
. scripts/spark-env.sh
(cd jvm-plugin && mvn -q -B package -DskipTests)
PLUGIN=$(ls "$REPO"/jvm-plugin/plugin/target/spark-4.x/rdma-shuffle-spark4.x_*.jar)
JOBS=$(ls "$REPO"/jvm-plugin/jobs/target/spark-4.x/rdma-shuffle-jobs-spark4.x_*.jar)
CONF=(--conf spark.shuffle.readHostLocalDisk=false --conf spark.shuffle.reduceLocality.enabled=false
      --conf spark.shuffle.compress=false --conf spark.ui.enabled=false)
OUT=target/spark-verbs
# Under TCG every JIT compile is expensive: C1 only, one GC thread.
JOPTS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
mkdir -p "$OUT"

step "default shuffle on the host ($JOB, scale $SCALE)"
"$SPARK_HOME/bin/spark-submit" --master 'local-cluster[2,1,1024]' "${CONF[@]}" \
  --class org.apache.spark.shuffle.rdma.jobs.ShuffleJobs "$JOBS" "$JOB" "$SCALE" > "$OUT/default.out" 2> "$OUT/default.err"
grep "^DIGEST job=" "$OUT/default.out" | tee "$OUT/default.digest"

step "plugin over verbs inside the SoftRoCE VM (emulated: slow)"
cat > "$OUT/guest.sh" <<GUEST
#!/bin/sh
# Runs in the guest, chrooted into the host's root. The guest has no udev: bash's process
# substitution (spark-class uses it) needs /dev/fd.
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
export SPARK_HOME='$SPARK_HOME' JAVA_HOME='$JAVA_HOME' SPARK_LOCAL_IP=127.0.0.1 HOME=/root
# Spark's output reaches the console as it happens (prefixed, filtered to what tells the
# story), so a run that is cut off still shows how far it got.
submit() {
  "\$SPARK_HOME/bin/spark-submit" --master 'local-cluster[2,1,640]' --driver-memory 512m ${CONF[*]} \
    --conf spark.executor.memory=512m \
    --conf spark.driver.extraJavaOptions='$JOPTS' --conf spark.executor.extraJavaOptions='$JOPTS' \
    --conf spark.shuffle.manager=org.apache.spark.shuffle.rdma.RdmaShuffleManager --jars '$PLUGIN' \
    --conf spark.shuffle.rdma.transport=verbs --conf spark.shuffle.rdma.device=rxe0 \
    --conf spark.shuffle.rdma.pool.capBytes=128m --conf spark.network.timeout=300s \
    --class org.apache.spark.shuffle.rdma.jobs.ShuffleJobs '$JOBS' '$JOB' '$SCALE'
}
# The preflight, as an operator runs it on the node (verbs asked for), then with the memlock
# limit lowered as in a pod without IPC_LOCK. One JSON line each.
DOCTOR="\$JAVA_HOME/bin/java $JOPTS -cp $PLUGIN org.apache.spark.shuffle.rdma.Doctor --json --transport verbs --conf spark.shuffle.rdma.device=rxe0 --conf spark.executor.memory=512m"
out=\$(\$DOCTOR 2>/tmp/doctor.err); echo "GUEST-LOG DOCTOR rc=\$? \$out"
out=\$(setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock -- sh -c "ulimit -l 1024 && exec \$DOCTOR" 2>>/tmp/doctor.err)
echo "GUEST-LOG DOCTOR-LOWMEM rc=\$? \$out"
tail -n 5 /tmp/doctor.err | sed 's/^/GUEST-TAIL doctor: /'
for attempt in 1 2; do
  ( submit 2>&1; echo "SPARK-RC \$?" ) | tee /tmp/spark-submit.out \
    | grep --line-buffered -E '^(DIGEST|SPARK-RC)|RDMA_SHUFFLE_ENGINE_STATS|shuffle engine|transport|Granted executor|Registered executor|Starting job|Job [0-9]+ finished|ERROR|Exception|rdma' \
    | sed -u 's/^/GUEST-LOG /'
  grep -q '^SPARK-RC 0' /tmp/spark-submit.out && break
  # Unfiltered, what failed: the launcher and the JVM say "Error: ...", which the filter drops
  # (a CI run once had spark-submit exit 1 after 4 s with no line through the filter).
  tail -n 60 /tmp/spark-submit.out | sed 's/^/GUEST-TAIL /'
  # A failure before any job started is the launcher's or the JVM's start, not the shuffle's:
  # once more, saying so. A failure during a job is final.
  grep -q 'Starting job' /tmp/spark-submit.out && break
  [ "\$attempt" = 2 ] || echo "GUEST-LOG spark-submit failed before any job started; once more"
done
GUEST
chmod +x "$OUT/guest.sh"
set +e
scripts/softroce-test.sh --share-host --mem 4G --timeout 1500 --quiet \
  --run-as spark_verbs "hostrun sh $REPO/$OUT/guest.sh" --log "$OUT/console.log" > "$OUT/vm.out" 2>&1
VMRC=$?
set -e
grep -a -E "GUEST-LOG|GUEST-TAIL|SOFTROCE-RESULT" "$OUT/console.log" | tr -d '\r' > "$OUT/plugin.lines" || true
cat "$OUT/plugin.lines"
grep -q "GUEST-LOG SPARK-RC 0" "$OUT/plugin.lines" || { echo "spark-submit in the VM failed (see $OUT/console.log)" >&2; exit 1; }
[ $VMRC -eq 0 ] || { echo "the VM run failed (see $OUT/console.log)" >&2; exit 1; }

step "preflight (Doctor) in the VM: verbs usable; a lowered memlock named"
python3 - "$OUT/plugin.lines" <<'PY'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
def report(tag):
    got = [l for l in lines if l.startswith(f"GUEST-LOG {tag} rc=")]
    assert got, f"no {tag} line from the VM"
    head, _, body = got[-1][len(f"GUEST-LOG {tag} "):].partition(" ")
    return int(head[3:]), json.loads(body)
rc, r = report("DOCTOR")
print(json.dumps(r)[:3000])
assert rc == 0 and r["ok"], f"rc={rc}: {r.get('verdict')}"
rxe = [d for d in r["devices"] if d["name"] == "rxe0"]
assert rxe and rxe[0]["ports"], r["devices"]
port = rxe[0]["ports"][0]
assert port["state"] == "ACTIVE" and port["link_layer"] == "Ethernet" and port["active_mtu"] >= 1024, port
assert any(g["type"] == "RoCE v2" for g in port["gids"]), port["gids"]
uses = r["uses"]
assert uses["device"] == "rxe0" and uses["gid"].startswith("::ffff:") and "IPv4-mapped" in uses["why"], uses
assert [g for g in port["gids"] if g["index"] == uses["gid_index"]][0]["type"] == "RoCE v2", uses
assert r["registration"]["ok"] is True and r["registration"]["bytes"] > 0, r["registration"]
assert r["auto"]["transport"] == "verbs", r["auto"]
lb = r["loopback"]
assert lb["ok"] and lb["transport"] == "verbs" and lb["send"]["path"] == "SEND/RECV" and lb["read"]["path"] == "RDMA READ", lb
assert lb["counters"]["one_sided_reads"] > 0 and lb["send"]["bytes"] == lb["read"]["bytes"] == 1 << 20, lb
print(f"doctor: rxe0 port {port['port']} {port['state']} {port['link_layer']} MTU {port['active_mtu']}, GID [{uses['gid_index']}] "
      f"{uses['gid']}, registered {r['registration']['bytes']} bytes in {r['registration']['ms']:.1f} ms, "
      f"SEND 1 MiB {lb['send']['ms']:.1f} ms, READ 1 MiB {lb['read']['ms']:.1f} ms (emulated)")
rc, r = report("DOCTOR-LOWMEM")
m = r["memlock"]
assert rc == 2 and not r["ok"], f"rc={rc}: {r.get('verdict')}"
assert m["limit_bytes"] == 1 << 20 and not m["cap_ipc_lock"] and not m["ok"], m
for want in ("1048576", "ulimit -l", "spark.shuffle.rdma.pool.capBytes", "IPC_LOCK"):
    assert want in m["message"], (want, m["message"])
assert "1048576" in r["loopback"]["error"], r["loopback"]
print(f"doctor with memlock 1 MiB: exit {rc}: {m['message'][:200]}...")
PY

step "compare"
digest() { awk '{for(i=1;i<=NF;i++) if ($i ~ /^(job|records|sum|check)=/) printf "%s ", $i}'; }
for j in ${JOB//,/ }; do
  want=$(grep "^DIGEST job=$j " "$OUT/default.digest" | digest)
  got=$(grep "GUEST-LOG DIGEST job=$j " "$OUT/plugin.lines" | sed 's/^GUEST-LOG //' | digest)
  echo "$j default: $want"
  echo "$j verbs:   $got"
  [ -n "$want" ] && [ "$want" = "$got" ] || { echo "$j: outputs differ" >&2; exit 1; }
done
# The driver logs each executor's final counters once when it stops (the last lines).
final=$(grep "RDMA_SHUFFLE_ENGINE_STATS" "$OUT/plugin.lines" | tail -n 2)
grep -q "transport=verbs" <<<"$final" || { echo "the engine did not run on verbs" >&2; exit 1; }
sum() { grep -o " $1=[0-9]*" <<<"$final" | cut -d= -f2 | awk '{s+=$1} END {print s+0}'; }
reads=$(sum rdma_reads); sends=$(sum verbs_sends); eager=$(sum eager_blocks_fetched); rdv=$(sum rendezvous_blocks_fetched)
echo "engine counters over both executors: rdma_reads=$reads verbs_sends=$sends eager_blocks_fetched=$eager rendezvous_blocks_fetched=$rdv"
[ "$reads" -gt 0 ] && [ "$rdv" -gt 0 ] || { echo "no block went by RDMA READ (reads=$reads rendezvous=$rdv)" >&2; exit 1; }
[ "$sends" -gt 0 ] && [ "$eager" -gt 0 ] || { echo "no block went by SEND (sends=$sends eager=$eager)" >&2; exit 1; }
echo "spark over verbs: outputs equal; blocks by RDMA READ and by SEND/RECV"
