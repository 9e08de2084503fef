#!/usr/bin/env bash
# ensure-libfabric.sh — build libfabric once per machine and print its install prefix.
#
# The libfabric provider (crates/providers/ofi) binds libfabric through the OFI working
# group's `ofi-libfabric-sys`, which needs libfabric 2.x headers (fi_profile.h). Debian 12
# ships 1.17, so this script builds 2.1.0 from Debian's own source package of the next
# release (trixie): its orig tarball (upstream's release), fetched with apt from the
# Debian archive and hash-checked against its signed index; nothing is installed from
# trixie. Debian's own patches are not applied: some mirrors serve only the orig tarball,
# and every machine must build the same library.
# It is built with the verbs provider in (rdma-core's headers: libibverbs-dev,
# librdmacm-dev), so the same prefix serves `tcp;ofi_rxm`, `shm` and `verbs;ofi_rxm`.
#
# Idempotent and cheap once built (~0.1 s): the prefix is
#   $LIBFABRIC_CACHE/<version-stamp>     (default cache $HOME/.cache/rdma-shuffle/libfabric)
# built under a lock file so CI and several sessions sharing a machine build it once.
# The last line on stdout is the prefix; logs go to stderr. Use it as
#   PREFIX=$(bash scripts/ensure-libfabric.sh)
#   export PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig      # ofi-libfabric-sys finds it
# (the ofi crate's build script also finds the newest ready prefix by itself).
#
# usage: ensure-libfabric.sh [--force|--check]
#        --force: rebuild this stamp from scratch; --check: print the prefix if it is built,
#        else exit 1 without building (the bench scripts add libfabric rows only then)
# env:   LIBFABRIC_CACHE        cache dir (default $HOME/.cache/rdma-shuffle/libfabric)
#        LIBFABRIC_DEB_VERSION  Debian source version (default 2.1.0-1.1)
#        LIBFABRIC_SUITE        Debian suite holding it (default trixie)
# Needs root for apt-get (build tools and the source download); talks only to the
# configured Debian mirror.
set -euo pipefail

CACHE=${LIBFABRIC_CACHE:-$HOME/.cache/rdma-shuffle/libfabric}
DEB_VERSION=${LIBFABRIC_DEB_VERSION:-2.1.0-1.1}
SUITE=${LIBFABRIC_SUITE:-trixie}
# Bump the recipe letter when the configure options or the steps below change.
RECIPE=r1
STAMP=${DEB_VERSION}-${RECIPE}
PREFIX=$CACHE/$STAMP
FORCE=0
CHECK=0
case ${1:-} in
  --force) FORCE=1 ;;
  --check) CHECK=1 ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "ensure-libfabric: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

log() { printf '[ensure-libfabric %(%T)T] %s\n' -1 "$*" >&2; }
die() { printf 'ensure-libfabric: %s\n' "$*" >&2; exit 1; }
SECONDS=0

ready() { [ "$(cat "$PREFIX/.ready" 2>/dev/null)" = "$STAMP" ] && [ -e "$PREFIX/lib/libfabric.so" ]; }

if [ "$CHECK" = 1 ]; then
  ready || exit 1
  echo "$PREFIX"
  exit 0
fi
mkdir -p "$CACHE"
# Fast path without the lock: a ready stamp is never changed in place (a rebuild removes
# .ready first, under the lock).
if [ "$FORCE" = 0 ] && ready; then
  log "libfabric $STAMP ready at $PREFIX"
  echo "$PREFIX"
  exit 0
fi
exec 9>"$CACHE/.lock"
flock 9
if [ "$FORCE" = 0 ] && ready; then   # another session built it while we waited
  log "libfabric $STAMP ready at $PREFIX (built by another session)"
  echo "$PREFIX"
  exit 0
fi

[ "$(id -u)" = 0 ] || die "libfabric $STAMP is not built at $PREFIX and building it needs root (apt-get)"

# ------------------------------------------------------------------ build tools
need=()
for p in autoconf automake libtool make gcc dpkg-dev pkg-config xz-utils \
         libibverbs-dev librdmacm-dev debian-archive-keyring; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  apt-get -o DPkg::Lock::Timeout=900 update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -qq \
    --no-install-recommends "${need[@]}" >/dev/null || die "apt-get install ${need[*]} failed"
fi

# ------------------------------------------------------------------ source package
# A private apt configuration holding only the trixie deb-src entry: the host's sources
# and package lists stay as they are (no trixie entry left behind for later updates).
WORK=$(mktemp -d "$CACHE/build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/sources.list.d" "$WORK/src"
cat > "$WORK/apt/sources.list.d/src.sources" <<EOF
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: $SUITE
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
APT_OPTS=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$WORK/apt/sources.list.d"
          -o "Dir::State::Lists=$WORK/apt/lists" -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")
log "fetching Debian's libfabric $DEB_VERSION sources ($SUITE)"
apt-get "${APT_OPTS[@]}" update -qq 2>&1 | grep -v '^W: ' >&2 || true
# apt checks each file it fetches against the signed Sources index. Some mirrors serve
# the orig tarball but not the .dsc or the debian tarball (404): the orig tarball is
# what the build needs, so a partial download is accepted when it holds it.
(cd "$WORK/src" && apt-get "${APT_OPTS[@]}" source --download-only -qq "libfabric=$DEB_VERSION" \
  >"$WORK/source.log" 2>&1) || log "apt-get source was partial: $(grep -c '^E:' "$WORK/source.log") errors (see below if the tarball is missing)"
UPSTREAM=${DEB_VERSION%-*}
ORIG=$(ls "$WORK"/src/libfabric_"$UPSTREAM".orig.tar.* 2>/dev/null | head -n 1)
[ -n "$ORIG" ] || { cat "$WORK/source.log" >&2; die "no libfabric_$UPSTREAM.orig tarball from $SUITE (set LIBFABRIC_DEB_VERSION to the version 'apt-cache showsrc libfabric' lists for $SUITE)"; }
tar -xf "$ORIG" -C "$WORK/src"
SRC=$(find "$WORK/src" -mindepth 1 -maxdepth 1 -type d -name 'libfabric*' | head -n 1)
[ -n "$SRC" ] || die "the orig tarball has no libfabric directory"
# ------------------------------------------------------------------ build
cd "$SRC"
if [ ! -x configure ]; then
  log "autogen"
  ./autogen.sh >"$WORK/autogen.log" 2>&1 || { tail -n 30 "$WORK/autogen.log" >&2; die "autogen.sh failed"; }
fi
rm -rf "$PREFIX"
log "configure (verbs, tcp, rxm, shm built in)"
# --enable-verbs=yes etc.: fail loudly instead of silently dropping a provider whose
# dependencies are missing. Providers are built into libfabric.so (not as DSOs), so one
# library and one rpath are all a consumer needs.
./configure --prefix="$PREFIX" --disable-static --enable-only --enable-verbs=yes \
  --enable-tcp=yes --enable-rxm=yes --enable-rxd=yes --enable-shm=yes --enable-sm2=yes \
  --enable-udp=yes --enable-sockets=yes \
  >"$WORK/configure.log" 2>&1 || { tail -n 40 "$WORK/configure.log" >&2; die "configure failed"; }
log "make (about 5 minutes on 2 cores)"
make -j"$(nproc)" >"$WORK/make.log" 2>&1 || { tail -n 40 "$WORK/make.log" >&2; die "make failed"; }
make install >"$WORK/install.log" 2>&1 || { tail -n 20 "$WORK/install.log" >&2; die "make install failed"; }

# ------------------------------------------------------------------ check
providers=$("$PREFIX/bin/fi_info" -l 2>/dev/null | sed -n 's/:$//p' | tr '\n' ' ')
for p in verbs ofi_rxm tcp shm; do
  grep -qw "$p" <<<"$providers" || die "the built libfabric lacks the $p provider (fi_info -l: $providers)"
done
{
  echo "libfabric $DEB_VERSION from Debian $SUITE source"
  echo "providers: $providers"
  echo "rdma-core $(dpkg-query -W -f='${Version}' libibverbs-dev)"
} > "$PREFIX/versions.txt"
echo "$STAMP" > "$PREFIX/.ready"
log "built in ${SECONDS}s: $PREFIX (providers: $providers)"
echo "$PREFIX"
