# Shared helpers for the project's scripts (sourced, not run).
# shellcheck shell=bash

T0=$(date +%s)
# step TITLE: a header with the seconds since the script began. In a script that set STEP_TIMES
# (a file; a plain shell variable, not exported, so the scripts it calls keep their own steps
# to themselves), each step's start is also appended there, for step_summary.
step() {
  printf '\n==> [%4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"
  if [ -n "${STEP_TIMES:-}" ]; then printf '%s\t%s\n' "$(date +%s)" "$*" >> "$STEP_TIMES"; fi
}

# step_summary FILE [FAILED]: each recorded step's time (from its start to the next step's, the
# last one to now) and the total, as a table; FAILED marks the last step as the one that failed.
step_summary() {
  [ -s "$1" ] || return 0
  awk -F'\t' -v now="$(date +%s)" -v failed="${2:-}" '
    { t[NR] = $1; name[NR] = $2 }
    END {
      printf "\n==> step times\n%8s  %s\n", "seconds", "step"
      for (i = 1; i <= NR; i++) {
        end = (i < NR) ? t[i + 1] : now
        if (i == NR && end == t[i] && failed == "") continue   # a closing marker, no time of its own
        printf "%8d  %s%s\n", end - t[i], name[i], (i == NR && failed != "") ? "   <- FAILED here" : ""
      }
      printf "%8d  total (%d min)\n", now - t[1], (now - t[1] + 30) / 60
    }' "$1"
}

# apt_install PKG... : installs Debian packages that are missing (root; runs apt-get update once).
apt_install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  if [ ! -f /tmp/.rdma-shuffle-apt-updated ]; then
    $sudo apt-get -o DPkg::Lock::Timeout=900 update -qq && touch /tmp/.rdma-shuffle-apt-updated
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# ensure_rust: a stable Rust toolchain with cargo on PATH.
ensure_rust() {
  [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
  if ! command -v cargo >/dev/null; then
    apt_install curl ca-certificates
    echo "cargo is missing and cannot be installed offline here; install rustup first" >&2
    return 1
  fi
  cargo --version
}

# summarize_cargo LOG: one line 'N passed, N failed' over every cargo test binary in LOG.
summarize_cargo() {
  awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) } }
       END { printf "rust: %d passed, %d failed\n", p, f }' "$1"
}

# build_plugin: the native library (scripts/build-native.sh, bundled into the plugin jar) and the
# jars of the Spark line in use (RDMA_SPARK_PROFILE), as the Spark scripts need them. Source
# scripts/spark-env.sh first; run from the repository's root.
build_plugin() {
  step "native library (scripts/build-native.sh) and jars (mvn package -DskipTests)"
  bash scripts/build-native.sh >/dev/null
  (cd jvm-plugin && mvn -q -B package -DskipTests ${RDMA_SPARK_PROFILE:+-P$RDMA_SPARK_PROFILE})
}

# full: true under `scripts/test.sh --full` (RDMA_TEST_FULL=1), for steps only the full run has.
full() { [ "${RDMA_TEST_FULL:-}" = 1 ]; }

finish() {
  step "all tests passed"
}

# run_script PATH [ARGS...]: runs a script of this repository with bash. A missing script is an
# error, never a skipped step (a lost exec bit cannot drop a suite either).
run_script() {
  local script=$1; shift
  if [ ! -f "$script" ]; then
    echo "required step script '$script' is missing (run from $(pwd))" >&2
    return 1
  fi
  bash "$script" "$@"
}

# ensure_rust_lint_tools: rustfmt and clippy for the toolchain in use (rustup installs them where
# its download server is reachable; otherwise say which component is missing).
ensure_rust_lint_tools() {
  local tool comp
  for tool in fmt clippy; do
    comp=$([ "$tool" = fmt ] && echo rustfmt || echo clippy)
    cargo "$tool" --version >/dev/null 2>&1 && continue
    if command -v rustup >/dev/null; then rustup component add "$comp" >/dev/null 2>&1 || true; fi
    cargo "$tool" --version >/dev/null 2>&1 \
      || { echo "cargo $tool is missing: install the '$comp' component (rustup component add $comp)" >&2; return 1; }
  done
  cargo fmt --version
  cargo clippy --version
}
