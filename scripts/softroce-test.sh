#!/usr/bin/env bash
# softroce-test.sh — run programs against real kernel RDMA (SoftRoCE, rdma_rxe) inside a
# throw-away qemu guest (TCG) booted from Debian's stock kernel.
#
# usage: softroce-test.sh [options] [BINARY...]
#   (no tests given: runs scripts/verbs-test.sh, the project's verbs suite + cross-device test)
#   BINARY...             host executables: copied with their shared libraries to /opt/bin
#                         in the guest and run once each, without arguments
#   --run 'CMD'           run a shell command line in the guest (repeatable, in order,
#                         after the BINARYs); named run1, run2, ...
#   --run-as NAME 'CMD'   the same with a test name of your choice ([A-Za-z0-9_.-]+)
#   --include FILE        copy FILE (with its libraries if it is a dynamic ELF) to
#                         /opt/bin without running it (repeatable)
#   --copy SRC[:DEST]     copy a file or directory into the guest, at DEST (absolute)
#                         or /opt/data/<basename SRC> (repeatable)
#   --env NAME[=VALUE]    export NAME in the guest, with VALUE or the host's current value
#                         (repeatable; e.g. --env RUST_LOG=debug --env RUST_BACKTRACE)
#   --timeout SECS        per-test time limit (default 600); on expiry the test's whole
#                         process group gets SIGTERM, then SIGKILL 5 s later
#   --vm-timeout SECS     wall-clock limit of the whole VM (default: derived from tests)
#   --veth                also create rxe_a/rxe_b on a veth pair (192.168.77.1/.2): two
#                         "nodes" whose RoCE traffic crosses a real netdev
#   --share-host          the host's / read-only over virtio-9p at /host (tmpfs overlay
#                         for writes); run host programs with `hostrun CMD...` (chroot
#                         into /host, cwd and PATH as on the host), e.g. a JVM
#   --selftest            first run ibv_devinfo, ibv_rc_pingpong and perftest
#                         (send/read/write bw, read latency) on rxe0 (+veth pingpong)
#   --mtu N               netdev MTU (default 1500 -> RoCE active MTU 1024; 4200 -> 4096)
#   --mem SIZE --smp N    guest memory (default 2G) and CPUs (default 2)
#   --accel tcg|kvm       default tcg (this project's /dev/kvm cannot boot a stock kernel)
#   --log FILE            also write the console log to FILE
#   --quiet               do not stream the console; print results (and the log on failure)
#   --keep                keep the work dir (initramfs, console log)
#   -h, --help
# env: SOFTROCE_CACHE (default $HOME/.cache/rdma-shuffle/softroce; prepared on demand by
#      softroce-prepare.sh, which installs missing host packages with apt)
#
# In the guest (busybox + rdma tools; tests run as root in /tmp, stdin /dev/null):
#   SOFTROCE_IBDEV=rxe0  SOFTROCE_GID_INDEX=<RoCEv2 IPv4 GID index>  SOFTROCE_IPADDR=10.0.2.15
#   SOFTROCE_NETDEV; with --veth SOFTROCE_VETH_DEVS="rxe_a rxe_b",
#   SOFTROCE_VETH_IPS="192.168.77.1 192.168.77.2", SOFTROCE_VETH_GID_INDEXES="<a> <b>";
#   with --share-host SOFTROCE_HOST=/host. The NIC is slirp with restrict=on and there is
#   no default route: nothing the guest sends leaves the VM.
# Output: the console (unless --quiet), one "SOFTROCE-RESULT <name> PASS|FAIL rc=.. time=.."
#   line per test, then "softroce: N passed, M failed".
# Exit: 0 iff every test (and self test) passed; 1 if any failed or the guest did not
#   finish (timeout, panic); 2 on a usage error; 3 if preparation or qemu failed to start.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export SOFTROCE_CACHE=${SOFTROCE_CACHE:-$HOME/.cache/rdma-shuffle/softroce}
CACHE=$SOFTROCE_CACHE
T0=$(date +%s.%N)
log() { printf '[softroce %(%T)T] %s\n' -1 "$*" >&2; }
usage_error() { printf 'softroce-test: %s (see --help)\n' "$*" >&2; exit 2; }
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }
squote() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }

SELFTEST=0 VETH=0 SHARE=0 KEEP=0 QUIET=0 ACCEL=tcg MTU=1500 MEM=2G SMP=2
TIMEOUT=600 VM_TIMEOUT="" LOGFILE=""
BINS=() INCS=() COPIES=() ENVS=()
TEST_NAMES=() TEST_CMDS=()
NRUN=0
need() { [ $# -ge 2 ] || usage_error "$1 needs a value"; }
while [ $# -gt 0 ]; do
  case $1 in
    --run) need "$@"; NRUN=$((NRUN+1)); TEST_NAMES+=("run$NRUN"); TEST_CMDS+=("$2"); shift 2 ;;
    --run-as) [ $# -ge 3 ] || usage_error "--run-as needs NAME and CMD"
              NRUN=$((NRUN+1)); TEST_NAMES+=("$2"); TEST_CMDS+=("$3"); shift 3 ;;
    --include) need "$@"; INCS+=("$2"); shift 2 ;;
    --copy) need "$@"; COPIES+=("$2"); shift 2 ;;
    --env) need "$@"; ENVS+=("$2"); shift 2 ;;
    --timeout) need "$@"; TIMEOUT=$2; shift 2 ;;
    --vm-timeout) need "$@"; VM_TIMEOUT=$2; shift 2 ;;
    --veth) VETH=1; shift ;;
    --share-host) SHARE=1; shift ;;
    --selftest) SELFTEST=1; shift ;;
    --mtu) need "$@"; MTU=$2; shift 2 ;;
    --mem) need "$@"; MEM=$2; shift 2 ;;
    --smp) need "$@"; SMP=$2; shift 2 ;;
    --accel) need "$@"; ACCEL=$2; shift 2 ;;
    --log) need "$@"; LOGFILE=$2; shift 2 ;;
    --quiet) QUIET=1; shift ;;
    --keep) KEEP=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; BINS+=("$@"); break ;;
    -*) usage_error "unknown option '$1'" ;;
    *) BINS+=("$1"); shift ;;
  esac
done
isnum() { [[ $1 =~ ^[0-9]+$ ]] && [ "$1" -gt 0 ]; }
isnum "$TIMEOUT" || usage_error "--timeout must be a positive number of seconds, got '$TIMEOUT'"
[ -z "$VM_TIMEOUT" ] || isnum "$VM_TIMEOUT" || usage_error "--vm-timeout must be a positive number of seconds, got '$VM_TIMEOUT'"
isnum "$MTU" && [ "$MTU" -ge 1280 ] && [ "$MTU" -le 9000 ] || usage_error "--mtu must be 1280..9000, got '$MTU'"
isnum "$SMP" || usage_error "--smp must be a positive number, got '$SMP'"
# shellcheck disable=SC2054  # the commas are qemu syntax
case $ACCEL in tcg) QACCEL=(-accel tcg,thread=multi -cpu max) ;; kvm) QACCEL=(-accel kvm -cpu host) ;;
  *) usage_error "--accel must be tcg or kvm, got '$ACCEL'" ;; esac

# Binaries run first, named after their file.
B_NAMES=() B_CMDS=()
for b in "${BINS[@]}"; do
  [ -f "$b" ] && [ -x "$b" ] || usage_error "not an executable file: $b"
  B_NAMES+=("$(basename "$b")"); B_CMDS+=("/opt/bin/$(basename "$b")")
done
TEST_NAMES=("${B_NAMES[@]}" "${TEST_NAMES[@]}")
TEST_CMDS=("${B_CMDS[@]}" "${TEST_CMDS[@]}")
declare -A SEEN=()
for n in "${TEST_NAMES[@]}"; do
  [[ $n =~ ^[A-Za-z0-9_.-]+$ ]] || usage_error "bad test name '$n' (allowed: A-Z a-z 0-9 _ . -)"
  [ -z "${SEEN[$n]:-}" ] || usage_error "two tests named '$n' (use --run-as NAME to rename)"
  SEEN[$n]=1
done
for i in "${INCS[@]}"; do [ -f "$i" ] || usage_error "--include: no such file: $i"; done
if [ ${#TEST_NAMES[@]} -eq 0 ] && [ "$SELFTEST" = 0 ] && [ ${#INCS[@]} -eq 0 ]; then
  # No tests named: run the project's verbs suite and the cross-device test.
  exec bash "$HERE/verbs-test.sh"
fi

bash "$HERE/softroce-prepare.sh" || { log "softroce-prepare.sh failed"; exit 3; }
KV=$(cat "$CACHE/kver")
T_PREP=$(elapsed "$T0")
T1=$(date +%s.%N)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/softroce.XXXXXX")
R=$WORK/root
cleanup() { if [ "$KEEP" = 1 ]; then log "kept $WORK"; else rm -rf "$WORK"; fi; }
trap cleanup EXIT

# ------------------------------------------------------------------ per-run initramfs
# Appended to the cached base archive (the kernel unpacks concatenated cpio archives
# in order, later files replacing earlier ones). Left uncompressed: gunzip under TCG
# is slower than reading a few more MB.
mkdir -p "$R/opt/bin" "$R/opt/data" "$R/softroce.d"
declare -A INBASE=()
while IFS= read -r f; do INBASE[$f]=1; done < "$CACHE/base.manifest"
guest_path() { # host library path -> path in the guest's merged-/usr layout
  case $1 in /lib/*|/lib64/*|/bin/*|/sbin/*) echo "/usr$1" ;; *) echo "$1" ;; esac
}
LIBPATH="$CACHE/uroot/usr/lib/x86_64-linux-gnu:$CACHE/uroot/lib/x86_64-linux-gnu"
copy_libs() { # shared-library closure of ELF $1, minus what the base archive has
  local out lib g
  out=$(ldd "$1" 2>&1) || { grep -q 'not a dynamic' <<<"$out" && return 0; usage_error "ldd $1: $out"; }
  # libraries the host lacks (e.g. libibverbs without the -dev package) come from the
  # cached RDMA user space, which the base archive already carries
  if grep -q 'not found' <<<"$out"; then
    out=$(LD_LIBRARY_PATH=$LIBPATH ldd "$1" 2>&1)
    grep -q 'not found' <<<"$out" && usage_error "libraries of $1 not found on the host:
$(grep 'not found' <<<"$out")"
  fi
  for lib in $(awk '/=> \//{print $3} /^[ \t]*\/[^ ]*ld-linux/{print $1}' <<<"$out"); do
    g=$(guest_path "${lib#"$CACHE/uroot"}")
    [ -n "${INBASE[$g]:-}" ] && continue
    INBASE[$g]=1
    mkdir -p "$R$(dirname "$g")"
    cp -L "$lib" "$R$g"
  done
}
for b in "${BINS[@]}" "${INCS[@]}"; do
  dst=$R/opt/bin/$(basename "$b")
  [ -e "$dst" ] && usage_error "two files named $(basename "$b") for /opt/bin"
  cp -L "$b" "$dst"; chmod 755 "$dst"
  copy_libs "$b"
done
for c in "${COPIES[@]}"; do
  src=${c%%:*}
  if [ "$src" != "$c" ]; then dest=${c#*:}; else dest=/opt/data/$(basename "$src"); fi
  [ -e "$src" ] || usage_error "--copy: no such file or directory: $src"
  [[ $dest == /* ]] || usage_error "--copy: destination must be absolute, got '$dest'"
  mkdir -p "$R$(dirname "$dest")"
  cp -a "$src" "$R$dest"
done

{
  echo "SOFTROCE_SELFTEST=$SELFTEST"
  echo "SOFTROCE_VETH=$VETH"
  echo "SOFTROCE_SHARE_HOST=$SHARE"
  echo "SOFTROCE_MTU=$MTU"
  echo "export SOFTROCE_HOST_CWD=$(squote "$PWD") SOFTROCE_HOST_PATH=$(squote "$PATH")"
  for e in "${ENVS[@]}"; do
    name=${e%%=*}
    [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || usage_error "--env: bad variable name '$name'"
    if [ "$name" != "$e" ]; then val=${e#*=}
    elif [ -n "${!name+x}" ]; then val=${!name}
    else log "--env $name: not set on the host, not exported"; continue; fi
    echo "export $name=$(squote "$val")"
  done
} > "$R/softroce.conf"
: > "$R/softroce.tests"
for i in "${!TEST_NAMES[@]}"; do
  f=/softroce.d/$(printf '%03d' "$i").sh
  printf '%s\n' "${TEST_CMDS[$i]}" > "$R$f"
  echo "${TEST_NAMES[$i]} $TIMEOUT $f" >> "$R/softroce.tests"
done
install -m 755 "$HERE/softroce-guest-init.sh" "$R/init"

cp "$CACHE/base.cpio.gz" "$WORK/initrd"
# The kernel only recognises an uncompressed archive at a 4-byte aligned offset:
# zero-pad the gzip member (zeros between archives are skipped).
truncate -s $(( ($(stat -c %s "$WORK/initrd") + 511) / 512 * 512 )) "$WORK/initrd"
(cd "$R" && find . -mindepth 1 -print0 | cpio --null -o -H newc --quiet --owner=0:0) >> "$WORK/initrd"
T_INITRD=$(elapsed "$T1")
log "initramfs $(du -h "$WORK/initrd" | cut -f1) (base $(du -h "$CACHE/base.cpio.gz" | cut -f1)) in ${T_INITRD}s"

# ------------------------------------------------------------------ boot
if [ -z "$VM_TIMEOUT" ]; then
  # boot ~15 s; a test may take its limit plus the 5 s kill grace; self tests ~60 s
  VM_TIMEOUT=$((120 + ${#TEST_NAMES[@]} * (TIMEOUT + 10) + SELFTEST * 900))
fi
QSHARE=()
[ "$SHARE" = 1 ] && QSHARE=(-virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap")
KERNEL=$CACHE/kroot/boot/vmlinux-$KV        # PVH entry, no decompression (see prepare)
[ -f "$KERNEL" ] && [ "${SOFTROCE_BZIMAGE:-0}" != 1 ] || KERNEL=$CACHE/kroot/boot/vmlinuz-$KV
# cryptomgr.notests, initcall_blacklist: skip crypto self-tests (~2-4 s under TCG);
# the guest uses no kernel crypto beyond crc32.
KARGS="console=ttyS0 panic=-1 quiet loglevel=4 mitigations=off cryptomgr.notests=1"
KARGS+=" initcall_blacklist=crypto_kdf108_init ${SOFTROCE_KERNEL_ARGS:-}"
LOG=$WORK/console.log
log "booting kernel $KV ($ACCEL, $SMP cpus, $MEM; VM limit ${VM_TIMEOUT}s; ${#TEST_NAMES[@]} tests, selftest=$SELFTEST veth=$VETH share-host=$SHARE)"
T2=$(date +%s.%N)
set +e
# restrict=on: the slirp NIC has no way out of the VM. romfile= : no PXE option ROM
# (not needed for -kernel boots, and ipxe-qemu may not be installed).
timeout --foreground -k 10 "$VM_TIMEOUT" \
  qemu-system-x86_64 "${QACCEL[@]}" -m "$MEM" -smp "$SMP" \
    -machine q35 -nodefaults -no-user-config -no-reboot -display none -monitor none -serial stdio \
    -kernel "$KERNEL" -initrd "$WORK/initrd" -append "$KARGS" \
    -netdev user,id=n0,restrict=on -device virtio-net-pci,netdev=n0,romfile= \
    "${QSHARE[@]}" </dev/null 2>&1 | tr -d '\r' | if [ "$QUIET" = 1 ]; then cat > "$LOG"; else tee "$LOG"; fi
QRC=${PIPESTATUS[0]}
set -e
T_VM=$(elapsed "$T2")
[ -z "$LOGFILE" ] || cp "$LOG" "$LOGFILE"

GRC=$(awk '/^SOFTROCE-EXIT /{print $2}' "$LOG" | tail -n 1)
if [ "$QRC" = 124 ] || [ "$QRC" = 137 ]; then
  log "VM killed after the ${VM_TIMEOUT}s limit"
elif [ -z "$GRC" ] && ! grep -q '^SOFTROCE\[' "$LOG"; then
  [ "$QUIET" = 1 ] && cat "$LOG" >&2
  log "qemu failed to start the guest (rc=$QRC)"; exit 3
fi
PASS=0 FAILN=0
mapfile -t RESULTS < <(grep '^SOFTROCE-RESULT ' "$LOG" || true)
for r in "${RESULTS[@]}"; do
  case $r in *" PASS "*) PASS=$((PASS+1)) ;; *) FAILN=$((FAILN+1)) ;; esac
done
for n in "${TEST_NAMES[@]}"; do
  if ! printf '%s\n' "${RESULTS[@]}" | grep -q "^SOFTROCE-RESULT $n "; then
    RESULTS+=("SOFTROCE-RESULT $n FAIL rc=none (did not finish: the guest crashed, powered off or hit the VM time limit first)"); FAILN=$((FAILN+1))
  fi
done
if [ "${GRC:-1}" != 0 ] && [ "$FAILN" = 0 ]; then
  RESULTS+=("SOFTROCE-RESULT guest-setup FAIL rc=${GRC:-none} (see the SOFTROCE[..] FAIL lines above)"); FAILN=1
fi
if [ "$QUIET" = 1 ] && { [ "$FAILN" -gt 0 ] || [ "${GRC:-1}" != 0 ]; }; then cat "$LOG"; fi
log "VM ${T_VM}s, total $(elapsed "$T0")s (prepare ${T_PREP}s, initramfs ${T_INITRD}s); qemu rc=$QRC, guest rc=${GRC:-none}"
[ ${#RESULTS[@]} -eq 0 ] || printf '%s\n' "${RESULTS[@]}"
echo "softroce: $PASS passed, $FAILN failed"
[ "$QRC" = 0 ] && [ "${GRC:-1}" = 0 ] && [ "$FAILN" = 0 ]
