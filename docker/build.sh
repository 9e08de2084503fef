#!/usr/bin/env bash
# Builds the rdma-shuffle Spark image (docker/Containerfile) with podman.
#
#   docker/build.sh
#
# Steps, each skipped when its result is already there (a second run takes seconds):
#   1. podman & co (apt) and the containers.conf this machine needs (docker/lib.sh);
#   2. the base image: $RDMA_DOCKER_BASE if set, else a Debian bookworm minbase made with
#      debootstrap, kept as a tarball in $RDMA_DOCKER_CACHE and imported as
#      localhost/rdma-shuffle-base:bookworm (no image registry is reachable here);
#   3. the native engine and the plugin + jobs jars (scripts/build-native.sh, mvn package),
#      rebuilt when a source under crates/ or jvm-plugin/ is newer than the jar;
#   4. the pyspark wheel, fetched by the host's pip (from pip's own cache after the first time)
#      into target/docker/wheels: pip inside the build cannot reach PyPI wherever TLS goes
#      through a proxy whose CA only the host trusts;
#   5. `podman build`, with apt's download cache mounted.
# Output: the image $RDMA_DOCKER_IMAGE (default localhost/rdma-shuffle-spark:4.2.0).
set -euo pipefail
# shellcheck source=docker/lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

step "podman"
ensure_podman
podman --version

# debian_uri KIND: the first apt source URI of this host whose address matches KIND
# ("security" or "main"), from one-line and deb822 sources; empty when there is none.
debian_uri() {
  local kind=$1 uris
  uris=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | sed -n -e 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]\+\).*/\2/p' -e 's/^URIs:[[:space:]]*//p' \
    | tr ' ' '\n' | grep -E '^https?://' || true)
  if [ "$kind" = security ]; then
    echo "$uris" | grep -m1 security || true
  else
    echo "$uris" | grep -v security | head -n 1
  fi
}

# Builds (once) and imports the debootstrap base image.
ensure_local_base() {
  if image_exists "$BASE_IMAGE_LOCAL"; then
    echo "base image $BASE_IMAGE_LOCAL present"
    return 0
  fi
  local tarball
  tarball="$CACHE_DIR/base-$BASE_SUITE-$(dpkg --print-architecture).tar.gz"
  if [ ! -s "$tarball" ]; then
    apt_install_locked debootstrap
    local mirror security rootfs="$WORK_DIR/base-rootfs"
    mirror=$(debian_uri main)
    mirror=${mirror:-http://deb.debian.org/debian}
    security=$(debian_uri security)
    echo "debootstrap --variant=minbase $BASE_SUITE from $mirror"
    rm -rf "$rootfs"
    mkdir -p "$CACHE_DIR"
    debootstrap --variant=minbase "$BASE_SUITE" "$rootfs" "$mirror" > "$WORK_DIR/debootstrap.log" 2>&1 \
      || { tail -n 30 "$WORK_DIR/debootstrap.log"; echo "debootstrap failed (log: $WORK_DIR/debootstrap.log)" >&2; exit 1; }
    {
      echo "deb $mirror $BASE_SUITE main"
      echo "deb $mirror $BASE_SUITE-updates main"
      [ -z "$security" ] || echo "deb $security $BASE_SUITE-security main"
    } > "$rootfs/etc/apt/sources.list"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar --numeric-owner -C "$rootfs" -czf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$rootfs"
  fi
  echo "importing $tarball as $BASE_IMAGE_LOCAL"
  podman import -q "$tarball" "$BASE_IMAGE_LOCAL" >/dev/null
}

step "base image"
if [ -n "${RDMA_DOCKER_BASE:-}" ]; then
  base=$RDMA_DOCKER_BASE
  echo "base image $base (RDMA_DOCKER_BASE)"
else
  ensure_local_base
  base=$BASE_IMAGE_LOCAL
fi

# jar_has_native JAR: whether the jar bundles both native builds for this machine.
jar_has_native() {
  [ -s "$1" ] || return 1
  local n
  n=$(unzip -Z1 "$1" 2>/dev/null | grep -c "^$NATIVE_IN_JAR/librdma_shuffle_jni\(_tcp\)\?\.so$" || true)
  [ "$n" = 2 ]
}

step "plugin jar (with the native engine) and jobs jar"
apt_install_locked unzip
stale=""
if ! jar_has_native "$PLUGIN_JAR" || [ ! -s "$JOBS_JAR" ]; then
  stale="missing"
else
  newer=$(find crates jvm-plugin Cargo.lock Cargo.toml -type f -newer "$PLUGIN_JAR" -not -path '*/target/*' -print -quit)
  [ -z "$newer" ] || stale="$newer is newer than the jar"
fi
if [ -n "$stale" ]; then
  echo "building ($stale)"
  command -v mvn >/dev/null || apt_install_locked maven openjdk-17-jdk-headless
  scripts/build-native.sh > "$WORK_DIR/build-native.log" 2>&1 \
    || { tail -n 40 "$WORK_DIR/build-native.log"; echo "scripts/build-native.sh failed (log: $WORK_DIR/build-native.log)" >&2; exit 1; }
  (cd jvm-plugin && mvn -q -B package -DskipTests) > "$WORK_DIR/mvn.log" 2>&1 \
    || { tail -n 60 "$WORK_DIR/mvn.log"; echo "mvn package failed (log: $WORK_DIR/mvn.log)" >&2; exit 1; }
  jar_has_native "$PLUGIN_JAR" || { echo "$PLUGIN_JAR lacks $NATIVE_IN_JAR/librdma_shuffle_jni{,_tcp}.so" >&2; exit 1; }
else
  echo "up to date: $(basename "$PLUGIN_JAR"), $(basename "$JOBS_JAR")"
fi

step "pyspark $SPARK_VERSION wheel"
wheels="$WORK_DIR/wheels/pyspark-$SPARK_VERSION"
if ! ls "$wheels"/pyspark-"$SPARK_VERSION"-*.whl >/dev/null 2>&1; then
  python3 -m pip --version >/dev/null 2>&1 || apt_install_locked python3-pip
  rm -rf "$wheels.tmp"
  echo "pip wheel pyspark==$SPARK_VERSION (~460 MB; pip caches the download)"
  python3 -m pip wheel -q --disable-pip-version-check -w "$wheels.tmp" "pyspark==$SPARK_VERSION" \
    || { echo "pip wheel pyspark==$SPARK_VERSION failed" >&2; exit 1; }
  rm -rf "$wheels"
  mv "$wheels.tmp" "$wheels"
fi
ls "$wheels"

step "podman build $IMAGE"
ctx="$WORK_DIR/context"
rm -rf "$ctx"
mkdir -p "$ctx/wheels"
for w in "$wheels"/*.whl; do
  ln "$w" "$ctx/wheels/" 2>/dev/null || cp "$w" "$ctx/wheels/"
done
install -D -m 0644 "$PLUGIN_JAR" "$ctx/jars/rdma-shuffle-plugin.jar"
install -D -m 0644 "$JOBS_JAR" "$ctx/jars/rdma-shuffle-jobs.jar"
install -D -m 0644 docker/spark-defaults.conf "$ctx/conf/spark-defaults.conf"
install -D -m 0755 docker/rdma-shuffle-node "$ctx/bin/rdma-shuffle-node"
mkdir -p "$CACHE_DIR/apt-archives/partial"
old_id=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
t0=$(date +%s)
if ! podman build --layers --network host \
    --build-arg "BASE=$base" --build-arg "SPARK_VERSION=$SPARK_VERSION" \
    -v "$CACHE_DIR/apt-archives:/var/cache/apt/archives" \
    -t "$IMAGE" -f docker/Containerfile "$ctx" > "$WORK_DIR/podman-build.log" 2>&1; then
  tail -n 60 "$WORK_DIR/podman-build.log"
  echo "podman build failed (log: $WORK_DIR/podman-build.log)" >&2
  exit 1
fi
new_id=$(podman image inspect --format '{{.Id}}' "$IMAGE")
# The previous build of this tag is now untagged: remove it (and its layers no other image
# uses) so that rebuilds do not pile up. It may still be in use by a container: then keep it.
if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then
  podman rmi "$old_id" >/dev/null 2>&1 || true
fi
echo "built $IMAGE (${new_id:0:12}) in $(( $(date +%s) - t0 )) s," \
  "$(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
awk '/^STEP /{ if (s) print s; s = "  " substr($0, 1, 90) } /^--> Using cache/{ s = s " [cached]" } END { if (s) print s }' \
  "$WORK_DIR/podman-build.log"
