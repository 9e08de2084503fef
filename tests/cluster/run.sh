#!/usr/bin/env bash
# The multi-host cluster test: scripts/cluster.sh brings up a Spark standalone cluster of 3
# workers in network namespaces, runs the same jobs with Spark's default shuffle and with the
# plugin installed through spark-defaults.conf, and tears it down. Needs root.
#   tests/cluster/run.sh            # Spark 4.2.0
#   tests/cluster/run.sh -k fault   # extra args go to pytest
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/../../scripts/spark-env.sh"
"$VENV_DIR/bin/python" -c "import pytest" 2>/dev/null || "$VENV_DIR/bin/pip" install -q --disable-pip-version-check pytest
cd "$REPO_ROOT"
PYTHONDONTWRITEBYTECODE=1 exec "$VENV_DIR/bin/python" -m pytest -ra -s --durations=10 -p no:cacheprovider "$here" "$@"
