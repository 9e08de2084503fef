#!/usr/bin/env bash
# The fault campaign of issue 14 on the multi-host cluster (scripts/cluster.sh): every case with
# Spark's default shuffle and with the plugin, under the same fault at the same point of the job.
#
#   scripts/fault-campaign.sh                 # every case, kill -9 x 10 per shuffle
#   scripts/fault-campaign.sh --reps 3 --cases kill9,disk
#
# Cases (scripts/fault_campaign.py describes each and how the times are measured): kill9, cut,
# blackhole (all during the reduce stage), slow (a sleeping reducer against a 64 MiB pool),
# disk (a data file truncated, deleted or corrupted after commit) and disk_plain (truncated,
# with spark.shuffle.compress=false). Brings up N=3 workers unless a cluster is up already
# (then uses it, and leaves it up), and takes it down at the end.
# Writes target/bench/faults.json and target/bench/faults.md (the table README shows); exits 1
# when a criterion is not met. Needs root. Takes about 30 minutes on a loaded 2-core machine.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
STATE="${CLUSTER_DIR:-$REPO/target/cluster}"
. "$HERE/spark-env.sh"
ours=0
if [ ! -f "$STATE/cluster.env" ]; then
  bash "$HERE/cluster.sh" up 3
  ours=1
fi
rc=0
"$VENV_DIR/bin/python" "$HERE/fault_campaign.py" "$@" || rc=$?
[ "$ours" = 0 ] || bash "$HERE/cluster.sh" down
exit "$rc"
