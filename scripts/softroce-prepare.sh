#!/usr/bin/env bash
# softroce-prepare.sh — install and cache everything softroce-test.sh needs.
#
# Real RDMA on this project's machines runs only over SoftRoCE (rdma_rxe) inside a
# qemu guest booted from Debian's stock kernel: the host kernel has no InfiniBand
# support. This script, idempotent and cheap when the cache is ready (~0.1 s):
#
#  1. installs missing host packages with apt (running `apt-get update` once first):
#       qemu-system-x86 busybox-static cpio kmod          (always: needed to boot)
#       libibverbs-dev librdmacm-dev libclang-dev clang pkg-config
#                                                          (build deps of rdma-sys;
#                                                           skip with SOFTROCE_BUILD_DEPS=0)
#  2. downloads the kernel that `linux-image-amd64` points at plus the RDMA user space
#     (.debs, never installed on the host), extracts them, prunes the module tree to
#     what the guest loads;
#  3. builds the base initramfs (busybox, modules, rdma tools and their libraries),
#     which softroce-test.sh extends per run with the tests themselves.
#
# usage: softroce-prepare.sh [--force]     (--force: rebuild the cache from scratch)
# env:   SOFTROCE_CACHE       cache dir (default $HOME/.cache/rdma-shuffle/softroce)
#        SOFTROCE_BUILD_DEPS  1 (default) / 0: install the rdma-sys build deps too
#        SOFTROCE_KPKG        kernel package override, e.g. linux-image-6.1.0-28-amd64
# Needs root for apt-get. Talks only to the configured apt mirror.
# Exit status: 0 when the cache is ready; non-zero with a message otherwise.
set -euo pipefail

CACHE=${SOFTROCE_CACHE:-$HOME/.cache/rdma-shuffle/softroce}
# Bump when the package lists, module lists or base initramfs layout below change.
CACHE_VERSION=rs3
FORCE=0
case ${1:-} in
  --force) FORCE=1 ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "softroce-prepare: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

log() { printf '[softroce-prepare %(%T)T] %s\n' -1 "$*" >&2; }
die() { printf 'softroce-prepare: %s\n' "$*" >&2; exit 1; }
SECONDS=0

mkdir -p "$CACHE"
# Several sessions (a developer and CI) may share one cache: serialise preparation.
exec 9>"$CACHE/.lock"
flock 9

ready() { [ "$(cat "$CACHE/.ready" 2>/dev/null)" = "$CACHE_VERSION" ] && [ -s "$CACHE/base.cpio.gz" ]; }

# ------------------------------------------------------------------ host packages
need_apt=()
for b in qemu-system-x86_64:qemu-system-x86 cpio:cpio depmod:kmod modprobe:kmod xz:xz-utils; do
  command -v "${b%%:*}" >/dev/null || need_apt+=("${b#*:}")
done
# busybox-static, not the dynamic busybox: it must run inside the guest without libs.
dpkg -s busybox-static >/dev/null 2>&1 || need_apt+=(busybox-static)
if [ "${SOFTROCE_BUILD_DEPS:-1}" = 1 ]; then
  for p in libibverbs-dev librdmacm-dev libclang-dev clang pkg-config; do
    dpkg -s "$p" >/dev/null 2>&1 || need_apt+=("$p")
  done
fi
mapfile -t need_apt < <(printf '%s\n' "${need_apt[@]}" | sort -u | sed '/^$/d')

if { [ ${#need_apt[@]} -gt 0 ] || ! ready || [ "$FORCE" = 1 ]; }; then
  [ "$(id -u)" = 0 ] || die "need root for apt-get (missing: ${need_apt[*]:-none}; cache not ready)"
  log "apt-get update"
  # A fresh machine's package lists may be absent or stale; apt-cache below needs them too.
  apt-get -o DPkg::Lock::Timeout=300 update -qq || die "apt-get update failed"
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
    --no-install-recommends "${need_apt[@]}" >/dev/null || die "apt-get install ${need_apt[*]} failed"
fi

if ready && [ "$FORCE" = 0 ]; then
  log "cache $CACHE ready (kernel $(cat "$CACHE/kver"), ${SECONDS}s)"
  exit 0
fi

# ------------------------------------------------------------------ kernel + user space
KPKG=${SOFTROCE_KPKG:-$(apt-cache depends linux-image-amd64 2>/dev/null \
  | awk '/Depends: linux-image-[0-9]/{print $2; exit}')}
[ -n "$KPKG" ] || die "cannot resolve the kernel package behind linux-image-amd64; set SOFTROCE_KPKG"
log "kernel package $KPKG"

# Guest user space: the RDMA tools and libraries plus the shared-library deps a minimal
# Debian 12 host may lack (libraries present on the host are taken from the host).
USER_PKGS=(
  libibverbs1 ibverbs-providers ibverbs-utils librdmacm1 rdmacm-utils libibumad3 perftest
  iproute2 libnl-3-200 libnl-route-3-200
  libmnl0 libelf1 libbpf1 libcap2 libbsd0 libmd0 libxtables12 libdb5.3 zlib1g libselinux1
  libpcre2-8-0 libtirpc3 libpci3 libudev1 libzstd1
)
rm -rf "$CACHE/debs" "$CACHE/kroot" "$CACHE/uroot" "$CACHE/.ready"
mkdir -p "$CACHE/debs" "$CACHE/kroot" "$CACHE/uroot"
chown _apt "$CACHE/debs" 2>/dev/null || true   # apt downloads as _apt when it can
(cd "$CACHE/debs" && apt-get download -qq "$KPKG" "${USER_PKGS[@]}" 2>&1 \
  | grep -v 'sandbox' >&2) || true
[ -n "$(ls "$CACHE"/debs/"$KPKG"_*.deb 2>/dev/null)" ] || die "download of $KPKG failed"
for p in "${USER_PKGS[@]}"; do
  ls "$CACHE"/debs/"$p"_*.deb >/dev/null 2>&1 || die "download of $p failed"
done

log "extracting kernel"
dpkg-deb -x "$CACHE"/debs/"$KPKG"_*.deb "$CACHE/kroot"
KV=$(ls "$CACHE/kroot/lib/modules")
[ -f "$CACHE/kroot/boot/vmlinuz-$KV" ] || die "no vmlinuz-$KV in $KPKG"
# Under TCG the bzImage's own xz decompressor needs ~4-9 s of every boot. Debian builds
# with CONFIG_PVH, so qemu can start the uncompressed ELF vmlinux directly: decompress
# it once here (softroce-test.sh falls back to the bzImage when this is absent).
off=$(LC_ALL=C grep -obUaP -m1 '\xfd7zXZ\x00' "$CACHE/kroot/boot/vmlinuz-$KV" | head -n 1 | cut -d: -f1 || true)
# (xz stops reading at the end of the stream: keep tail's SIGPIPE out of pipefail)
if [ -n "$off" ] && xz -dc --single-stream > "$CACHE/kroot/boot/vmlinux-$KV" 2>/dev/null \
     < <(tail -c +"$((off + 1))" "$CACHE/kroot/boot/vmlinuz-$KV" || true) \
   && [ "$(head -c 4 "$CACHE/kroot/boot/vmlinux-$KV" | od -An -tx1 | tr -d ' ')" = 7f454c46 ] \
   && grep -q '^CONFIG_PVH=y' "$CACHE/kroot/boot/config-$KV"; then
  log "uncompressed vmlinux extracted for PVH boot"
else
  log "no PVH vmlinux (kernel not xz-compressed or no CONFIG_PVH): booting the bzImage"
  rm -f "$CACHE/kroot/boot/vmlinux-$KV"
fi
depmod -b "$CACHE/kroot" "$KV"
# The full module tree is ~400 MB; keep only what the guest may load.
# crc32_generic: rdma_rxe on 6.1 needs a crc32 provider and there is no udev to load it.
# rdma_ucm (with rdma_cm, ib_cm, iw_cm): /dev/infiniband/rdma_cm, which libfabric's verbs
# provider connects through (the engine's own verbs provider bootstraps over TCP instead).
CORE_MODS=(crc32_generic rdma_rxe ib_uverbs rdma_ucm virtio_pci virtio_net dummy veth)
SHARE_MODS=(9pnet_virtio 9p overlay)
deps_of() { for m in "$@"; do modprobe -d "$CACHE/kroot" -S "$KV" --show-depends "$m"; done \
  | awk '$1=="insmod"{print $2}'; }
keep=$(deps_of "${CORE_MODS[@]}" "${SHARE_MODS[@]}" | sort -u)
find "$CACHE/kroot/lib/modules/$KV/kernel" -name '*.ko*' | sort | comm -23 - <(echo "$keep") | xargs -r rm -f
find "$CACHE/kroot/lib/modules/$KV/kernel" -type d -empty -delete
depmod -b "$CACHE/kroot" "$KV"
echo "$KV" > "$CACHE/kver"

log "extracting user space"
for d in "$CACHE"/debs/*.deb; do
  case $d in *"/$KPKG"_*) continue ;; esac
  dpkg-deb -x "$d" "$CACHE/uroot"
done
{
  for d in "$CACHE"/debs/*.deb; do dpkg-deb --showformat='${Package} ${Version}\n' -W "$d"; done
  echo "qemu-system-x86 $(dpkg-query -W -f='${Version}' qemu-system-x86)"
  echo "busybox-static $(dpkg-query -W -f='${Version}' busybox-static)"
} > "$CACHE/versions.txt"
rm -rf "$CACHE/debs"

# ------------------------------------------------------------------ base initramfs
log "building base initramfs"
B=$CACHE/base
rm -rf "$B"
mkdir -p "$B"/{usr/bin,usr/sbin,usr/lib/x86_64-linux-gnu,usr/lib64,etc,proc,sys,dev,tmp,run,root,opt/bin,opt/data}
ln -s usr/bin "$B/bin"; ln -s usr/sbin "$B/sbin"; ln -s usr/lib "$B/lib"; ln -s usr/lib64 "$B/lib64"
cp /bin/busybox "$B/usr/bin/busybox"
for a in $("$B/usr/bin/busybox" --list); do
  [ -e "$B/usr/bin/$a" ] || ln -s busybox "$B/usr/bin/$a"
done

UROOT=$CACHE/uroot
LIBPATH="$UROOT/usr/lib/x86_64-linux-gnu:$UROOT/lib/x86_64-linux-gnu"
declare -A COPIED=()
copy_libs() { # shared-library closure of ELF $1; guest path = host path minus $UROOT
  local out lib
  out=$(LD_LIBRARY_PATH=$LIBPATH ldd "$1" 2>&1) || {
    grep -q 'not a dynamic' <<<"$out" && return 0
    die "ldd $1: $out"
  }
  grep -q 'not found' <<<"$out" && die "libraries missing for $1 (add their package to USER_PKGS):
$(grep 'not found' <<<"$out")"
  for lib in $(awk '/=> \//{print $3} /^[ \t]*\/[^ ]*ld-linux/{print $1}' <<<"$out"); do
    [ -n "${COPIED[$lib]:-}" ] && continue
    COPIED[$lib]=1
    mkdir -p "$(dirname "$B${lib#"$UROOT"}")"
    cp -L "$lib" "$B${lib#"$UROOT"}"
  done
}
add_exe() { mkdir -p "$(dirname "$B$2")"; cp -L "$1" "$B$2"; chmod 755 "$B$2"; copy_libs "$1"; }

for b in ibv_devinfo ibv_devices ibv_rc_pingpong ibv_ud_pingpong rping \
         ib_send_bw ib_send_lat ib_read_bw ib_read_lat ib_write_bw ib_write_lat; do
  add_exe "$UROOT/usr/bin/$b" "/usr/bin/$b"
done
add_exe "$UROOT/usr/bin/rdma" /usr/bin/rdma
# Full iproute2 `ip` (veth peers, policy rules). Debian's busybox-static runs its own
# applets before searching PATH, so the guest calls it by its full path /usr/sbin/ip.
add_exe "$UROOT/bin/ip" /usr/sbin/ip
for p in "$UROOT"/usr/lib/x86_64-linux-gnu/libibverbs/librxe-*.so; do
  add_exe "$p" "${p#"$UROOT"}"
done
mkdir -p "$B/etc/libibverbs.d"
cp "$UROOT/etc/libibverbs.d/rxe.driver" "$B/etc/libibverbs.d/"
cp -a "$UROOT/etc/iproute2" "$B/etc/" 2>/dev/null || true
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/tmp:/bin/sh\n' > "$B/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$B/etc/group"
printf '127.0.0.1 localhost\n' > "$B/etc/hosts"

# Kernel modules with dependency-ordered insmod lists (the guest has no udev/modprobe
# config; insmod in this order is all it needs).
mods_list() { # mods_list OUTFILE MODULE...
  local out=$1; shift
  : > "$out"
  for m in "$@"; do
    modprobe -d "$CACHE/kroot" -S "$KV" --show-depends "$m" | while read -r kw path args; do
      [ "$kw" = insmod ] || continue
      g=${path#"$CACHE/kroot"}
      grep -q "^$g\( \|$\)" "$B/modules.core" "$out" 2>/dev/null && continue
      mkdir -p "$(dirname "$B$g")"; cp "$path" "$B$g"
      echo "$g $args" >> "$out"
    done
  done
}
mods_list "$B/modules.core" "${CORE_MODS[@]}"
mods_list "$B/modules.share" "${SHARE_MODS[@]}"
(cd "$B" && find . -mindepth 1 | sed 's|^\.||' | sort) > "$CACHE/base.manifest"
(cd "$B" && find . -print0 | cpio --null -o -H newc --quiet) | gzip -1 > "$CACHE/base.cpio.gz.tmp"
mv "$CACHE/base.cpio.gz.tmp" "$CACHE/base.cpio.gz"
rm -rf "$B"

echo "$CACHE_VERSION" > "$CACHE/.ready"
log "done in ${SECONDS}s: kernel $KV, base initramfs $(du -h "$CACHE/base.cpio.gz" | cut -f1), cache $(du -sh "$CACHE" | cut -f1) at $CACHE"
