# Shared helpers for the project's scripts (sourced, not run).
# shellcheck shell=bash

T0=$(date +%s)
step() { printf '\n==> [%4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

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
