# Shared settings of docker/build.sh and docker/cluster.sh (sourced, not run).
# shellcheck shell=bash disable=SC2034  # the variables are for the scripts that source this
#
# Names: every podman object these scripts create starts with $RDMA_DOCKER_PREFIX, so that
# several checkouts on one machine (and their CI runs) do not collide; images are
# localhost/rdma-shuffle-*.
#
# Environment (all optional):
#   RDMA_DOCKER_PREFIX   prefix of networks and containers           (rs-a2-)
#   RDMA_DOCKER_SUBNET   the cluster network's /24                    (10.89.142.0/24)
#   RDMA_DOCKER_CACHE    downloads kept between runs                  (~/.cache/rdma-shuffle/docker)
#   RDMA_DOCKER_BASE     base image for the Containerfile; when unset, a Debian bookworm
#                        minbase made by debootstrap (no image registry is reachable here)
#   RDMA_DOCKER_IMAGE    the image to build and run                   (localhost/rdma-shuffle-spark:<spark>)

DOCKER_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$DOCKER_DIR/.." && pwd)"
# shellcheck source=scripts/lib.sh
. "$REPO_ROOT/scripts/lib.sh"

# The Spark line the image carries: the default Maven profile of jvm-plugin, pinned in
# scripts/spark-env.sh (the pyspark version) and jvm-plugin/pom.xml.
SPARK_VERSION=4.2.0
SCALA_BINARY=2.13
SPARK_LINE=4.x

PREFIX="${RDMA_DOCKER_PREFIX:-rs-a2-}"
CACHE_DIR="${RDMA_DOCKER_CACHE:-$HOME/.cache/rdma-shuffle/docker}"
BASE_SUITE=bookworm
BASE_IMAGE_LOCAL="localhost/rdma-shuffle-base:$BASE_SUITE"
IMAGE="${RDMA_DOCKER_IMAGE:-localhost/rdma-shuffle-spark:$SPARK_VERSION}"
WORK_DIR="$REPO_ROOT/target/docker"
PLUGIN_JAR="$REPO_ROOT/jvm-plugin/plugin/target/spark-$SPARK_LINE/rdma-shuffle-spark${SPARK_LINE}_${SCALA_BINARY}-0.1.0-SNAPSHOT.jar"
JOBS_JAR="$REPO_ROOT/jvm-plugin/jobs/target/spark-$SPARK_LINE/rdma-shuffle-jobs-spark${SPARK_LINE}_${SCALA_BINARY}-0.1.0-SNAPSHOT.jar"
NATIVE_IN_JAR="org/apache/spark/shuffle/rdma/native/linux/$(uname -m)"

# apt_install_locked PKG...: like apt_install, but waits for another apt/dpkg run to finish
# (several checkouts may install at once on a shared machine) instead of failing on its lock.
apt_install_locked() {
  local missing=() p
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "installing ${missing[*]}" >&2
  $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends "${missing[@]}" >/dev/null
}

# ensure_podman: rootful podman and its helpers, and the containers.conf this machine needs,
# named by CONTAINERS_CONF (exported) so that the system-wide configuration stays untouched.
ensure_podman() {
  apt_install_locked podman buildah runc fuse-overlayfs slirp4netns uidmap netavark aardvark-dns iptables
  mkdir -p "$WORK_DIR"
  local nofile
  nofile=$(ulimit -Hn)
  [ "$nofile" = unlimited ] && nofile=1048576
  # crun (podman's default runtime) refuses this host's hybrid cgroup layout: use runc.
  # podman's default ulimits exceed the hard limits of some hosts (setrlimit fails in every
  # container): use the caller's own hard limit.
  cat > "$WORK_DIR/containers.conf.new" <<EOF
# Written by docker/lib.sh (ensure_podman).
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=32768:32768"]

[engine]
runtime = "runc"
EOF
  mv "$WORK_DIR/containers.conf.new" "$WORK_DIR/containers.conf"
  export CONTAINERS_CONF="$WORK_DIR/containers.conf"
}

# image_exists REF: whether podman has the image locally.
image_exists() { podman image exists "$1"; }
