#!/bin/sh
# softroce-guest-init.sh — /init of the SoftRoCE test guest (busybox sh, no udev).
#
# Installed as /init in the initramfs by softroce-test.sh; not meant to run on a host.
# Reads /softroce.conf (settings + exported user environment) and /softroce.tests
# (one test a line: "NAME TIMEOUT_SECONDS SCRIPT", SCRIPT a shell script file in the
# initramfs), sets up SoftRoCE, runs
# the tests and powers off. Everything goes to the serial console:
#   SOFTROCE[<uptime>] ...              progress
#   SOFTROCE-RESULT <name> PASS|FAIL rc=<rc> time=<s>s [timeout]   one per test
#   SOFTROCE-EXIT <rc>                  last line; 0 iff every test passed
# Exported for the tests:
#   SOFTROCE_IBDEV=rxe0  SOFTROCE_GID_INDEX  SOFTROCE_IPADDR  SOFTROCE_NETDEV
#   with --veth: SOFTROCE_VETH_DEVS="rxe_a rxe_b"  SOFTROCE_VETH_IPS="192.168.77.1 192.168.77.2"
#                SOFTROCE_VETH_GID_INDEXES="<a> <b>"
#   with --share-host: SOFTROCE_HOST=/host (the host's / ; run programs there with hostrun)
export PATH=/opt/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root
umask 022
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm /tmp /run /root
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /dev/shm
chmod 1777 /tmp /dev/shm

. /softroce.conf

up() { cut -d' ' -f1 /proc/uptime; }
say() { echo "SOFTROCE[$(up)] $*"; }
since() { awk -v a="$1" -v b="$(up)" 'BEGIN{printf "%.2f", b-a}'; }
RC=0
fail() { say "FAIL: $*"; RC=1; }
finish() {
  say "guest done after $(up)s uptime"
  echo "SOFTROCE-EXIT $RC"
  sync
  poweroff -f
  sleep 30
}

say "init (kernel $(uname -r), $(nproc) cpus, $(awk '/MemTotal/{print $2" kB"}' /proc/meminfo))"

# ---- kernel modules, in the dependency order the host computed
load_mods() {
  while read -r m args; do
    [ -n "$m" ] || continue
    # shellcheck disable=SC2086  # args are module parameters, split on purpose
    insmod "$m" $args 2>/tmp/insmod.err || {
      grep -q 'File exists' /tmp/insmod.err || fail "insmod $m: $(cat /tmp/insmod.err)"
    }
  done < "$1"
}
load_mods /modules.core
[ "${SOFTROCE_SHARE_HOST:-0}" = 1 ] && load_mods /modules.share

# ---- host root over virtio-9p at /host: read-only 9p lower layer + tmpfs upper layer
# (overlayfs), so host programs (a JVM, test binaries) can write /tmp etc. in the guest
# while the host's files stay untouched.
if [ "${SOFTROCE_SHARE_HOST:-0}" = 1 ]; then
  mkdir -p /host /.h9p /.hovl
  if mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /.h9p; then
    mount -t tmpfs tmpfs /.hovl && mkdir -p /.hovl/u /.hovl/w
    if mount -t overlay overlay -o lowerdir=/.h9p,upperdir=/.hovl/u,workdir=/.hovl/w /host 2>/tmp/ovl.err; then
      say "host / at /host (9p read-only + tmpfs overlay: writes stay in the guest)"
    else
      say "overlay failed ($(cat /tmp/ovl.err)); /host is read-only, /host/tmp an empty tmpfs"
      mount --bind /.h9p /host
      mount -t tmpfs tmpfs /host/tmp && chmod 1777 /host/tmp
    fi
    mount -t proc proc /host/proc
    mount -t sysfs sysfs /host/sys
    mount --bind /dev /host/dev
    mount -t tmpfs tmpfs /host/run
    # The host's /tmp stays visible (a checkout under /tmp, as CI may use, must be reachable);
    # what the guest writes there lands in the overlay's tmpfs layer.
    export SOFTROCE_HOST=/host
  else
    fail "9p mount of the host root failed"
  fi
fi

# ---- network: the virtio NIC (slirp with restrict=on on the host side: nothing the
# guest sends leaves the VM). No default route is configured on purpose.
ip link set lo up
NETDEV=""
for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
  for d in /sys/class/net/*; do
    n=${d##*/}
    [ "$n" = lo ] && continue
    [ -e "$d/device" ] && { NETDEV=$n; break 2; }
  done
  sleep 0.1
done
if [ -z "$NETDEV" ]; then
  say "no NIC found; using a dummy netdev"
  /usr/sbin/ip link add dummy0 type dummy
  NETDEV=dummy0
fi
/usr/sbin/ip link set "$NETDEV" mtu "${SOFTROCE_MTU:-1500}" || fail "cannot set MTU ${SOFTROCE_MTU:-1500} on $NETDEV"
/usr/sbin/ip link set "$NETDEV" up
/usr/sbin/ip addr add 10.0.2.15/24 dev "$NETDEV"
IP=10.0.2.15
say "netdev $NETDEV: $IP mtu $(cat "/sys/class/net/$NETDEV/mtu")"

# gid_index DEV: index of the RoCEv2 GID carrying an IPv4-mapped address (::ffff:a.b.c.d).
# rxe fills the table from the netdev's addresses shortly after the link is added, so
# retry for a few seconds. Index 0 is always the link-local fe80:: GID.
gid_index() {
  for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
    # rxe has hundreds of GID slots; the used ones come first (forks are slow under TCG)
    for i in 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15; do
      g=/sys/class/infiniband/$1/ports/1/gids/$i
      v=$(cat "$g" 2>/dev/null) || continue
      case $v in
        0000:0000:0000:0000:0000:ffff:*)
          t=$(cat "/sys/class/infiniband/$1/ports/1/gid_attrs/types/$i" 2>/dev/null)
          case $t in *v2*) echo "$i"; return 0 ;; esac ;;
      esac
    done
    sleep 0.25
  done
  return 1
}
# port_active DEV: wait until port 1 is ACTIVE
port_active() {
  for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
    grep -q ACTIVE "/sys/class/infiniband/$1/ports/1/state" 2>/dev/null && return 0
    sleep 0.25
  done
  return 1
}
describe() { # describe DEV [noibv]: state, active MTU (not with noibv) and GIDs for the log
  if [ "${2:-}" = noibv ]; then
    say "$1: port $(cat "/sys/class/infiniband/$1/ports/1/state")"
  else
    say "$1: port $(cat "/sys/class/infiniband/$1/ports/1/state"), active_mtu $(ibv_devinfo -d "$1" | awk '/active_mtu/{print $2}')"
  fi
  for i in 0 1 2 3 4 5 6 7; do
    v=$(cat "/sys/class/infiniband/$1/ports/1/gids/$i" 2>/dev/null) || continue
    [ "$v" = 0000:0000:0000:0000:0000:0000:0000:0000 ] && continue
    say "  gid[$i] $v ($(cat "/sys/class/infiniband/$1/ports/1/gid_attrs/types/$i" 2>/dev/null))"
  done
}

# rxe transmits a READ response of N bytes as a burst of N/MTU packets; over veth each
# lands in the per-CPU input backlog, whose default (1000) overflows with a few MiB in
# flight: drops, "rdma_rxe: Failed sending ACK", retransmissions after the QP timeout.
# Real RoCE fabrics are lossless (PFC), so make the guest lossless too; a test that
# wants drops can lower it again.
sysctl -qw net.core.netdev_max_backlog=16384

# ---- SoftRoCE device rxe0 on the NIC
rdma link add rxe0 type rxe netdev "$NETDEV" || fail "rdma link add rxe0 netdev $NETDEV failed"
port_active rxe0 || fail "rxe0 port 1 not ACTIVE"
GIDX=$(gid_index rxe0) || { fail "rxe0 has no RoCEv2 IPv4 GID"; GIDX=1; }
describe rxe0
export SOFTROCE_IBDEV=rxe0 SOFTROCE_GID_INDEX=$GIDX SOFTROCE_IPADDR=$IP SOFTROCE_NETDEV=$NETDEV

# ---- optional second and third "node": rxe_a/rxe_b on a veth pair.
# Both ends live in one network namespace, so by default the kernel routes
# 192.168.77.1 -> .2 through lo (both addresses are local) and rxe cannot reach the
# peer: modify-QP to RTR fails with ENOSPC. Policy routing sends locally generated
# traffic for the peer out of the veth, and accept_local lets the other end accept
# packets from a local source address.
if [ "${SOFTROCE_VETH:-0}" = 1 ]; then
  # one `ip -batch` process: every exec of a dynamic binary costs ~0.2 s under TCG.
  # The last two lines put the local table after our rules, else it wins for local
  # addresses.
  M=${SOFTROCE_MTU:-1500}
  /usr/sbin/ip -batch - <<VETH || fail "veth setup failed"
link add va mtu $M type veth peer name vb mtu $M
addr add 192.168.77.1/24 dev va
addr add 192.168.77.2/24 dev vb
link set va up
link set vb up
rule add pref 10 to 192.168.77.2 iif lo lookup 100
rule add pref 11 to 192.168.77.1 iif lo lookup 101
route add 192.168.77.2 dev va src 192.168.77.1 table 100
route add 192.168.77.1 dev vb src 192.168.77.2 table 101
rule add pref 1000 lookup local
rule del pref 0 lookup local
VETH
  for k in all va vb; do
    sysctl -qw net.ipv4.conf.$k.accept_local=1 net.ipv4.conf.$k.rp_filter=0
  done
  rdma link add rxe_a type rxe netdev va || fail "rdma link add rxe_a netdev va failed"
  rdma link add rxe_b type rxe netdev vb || fail "rdma link add rxe_b netdev vb failed"
  port_active rxe_a || fail "rxe_a not ACTIVE"
  port_active rxe_b || fail "rxe_b not ACTIVE"
  GA=$(gid_index rxe_a) || { fail "rxe_a has no RoCEv2 IPv4 GID"; GA=1; }
  GB=$(gid_index rxe_b) || { fail "rxe_b has no RoCEv2 IPv4 GID"; GB=1; }
  describe rxe_a noibv; describe rxe_b noibv
  export SOFTROCE_VETH_DEVS="rxe_a rxe_b" SOFTROCE_VETH_IPS="192.168.77.1 192.168.77.2" \
         SOFTROCE_VETH_GID_INDEXES="$GA $GB"
  say "veth: rxe_a(va 192.168.77.1) <-> rxe_b(vb 192.168.77.2)"
fi

# ---- hostrun CMD...: run CMD in the host's root (needs --share-host), in the directory
# softroce-test.sh was started from, with the host's PATH.
cat > /usr/bin/hostrun <<'EOF'
#!/bin/sh
[ -d /host/usr ] || { echo "hostrun: the host root is not shared (use --share-host)" >&2; exit 2; }
exec chroot /host /bin/sh -c 'cd "$SOFTROCE_HOST_CWD" 2>/dev/null || cd /; PATH=$SOFTROCE_HOST_PATH; export PATH; exec "$@"' hostrun "$@"
EOF
chmod 755 /usr/bin/hostrun

say "environment for tests: $(env | grep '^SOFTROCE_' | grep -v 'SOFTROCE_HOST_PATH' | sort | tr '\n' ' ')"

# ---- test runner
# run NAME TIMEOUT CMD: CMD runs in its own session so that on timeout, and after it
# ends, the whole process group (servers it started in the background, too) is killed.
run() {
  name=$1; to=$2; cmd=$3
  say "BEGIN $name: $cmd"
  t0=$(up)
  rm -f /tmp/.timeout
  (cd /tmp && exec setsid sh -c "$cmd" </dev/null) &
  pid=$!
  ( sleep "$to"; echo > /tmp/.timeout; kill -TERM -"$pid" 2>/dev/null; sleep 5; kill -KILL -"$pid" 2>/dev/null ) &
  wd=$!
  wait "$pid"; r=$?
  kill "$wd" 2>/dev/null
  kill -KILL -"$pid" 2>/dev/null   # stragglers of this test
  extra=""
  [ -f /tmp/.timeout ] && extra=" timeout(${to}s)"
  if [ "$r" = 0 ] && [ -z "$extra" ]; then verdict=PASS; else verdict=FAIL; RC=1; fi
  say "END $name rc=$r"
  echo "SOFTROCE-RESULT $name $verdict rc=$r time=$(since "$t0")s$extra"
}
# pair NAME TIMEOUT CMD...: CMD as server in the background, then CMD <server ip> as
# client (the perftest / pingpong convention)
pair() {
  name=$1; to=$2; shift 2
  run "$name" "$to" "$* > /tmp/$name.srv 2>&1 & sleep 1; $* $IP; c=\$?; wait \$!; s=\$?; echo '-- server:'; cat /tmp/$name.srv; [ \$c = 0 ] && [ \$s = 0 ]"
}

if [ "${SOFTROCE_SELFTEST:-0}" = 1 ]; then
  D=rxe0
  run selftest_ibv_devinfo 30 "ibv_devinfo -v -d $D"
  pair selftest_rc_pingpong 120 ibv_rc_pingpong -d $D -g "$GIDX" -n 200
  pair selftest_send_bw 180 ib_send_bw -d $D -x "$GIDX" -F -s 65536 -n 200
  pair selftest_read_bw 180 ib_read_bw -d $D -x "$GIDX" -F -s 65536 -n 200
  pair selftest_write_bw 180 ib_write_bw -d $D -x "$GIDX" -F -s 65536 -n 200
  pair selftest_read_lat 180 ib_read_lat -d $D -x "$GIDX" -F -s 64 -n 200
  if [ "${SOFTROCE_VETH:-0}" = 1 ]; then
    # server on rxe_a, client on rxe_b; the TCP side channel runs over lo
    run selftest_veth_rc_pingpong 120 "ibv_rc_pingpong -d rxe_a -g $GA -n 200 > /tmp/vp.srv 2>&1 & sleep 1; ibv_rc_pingpong -d rxe_b -g $GB -n 200 127.0.0.1; c=\$?; wait \$!; s=\$?; cat /tmp/vp.srv; /usr/sbin/ip -s link show va | sed -n '3,4p'; [ \$c = 0 ] && [ \$s = 0 ]"
  fi
fi

if [ -f /softroce.tests ]; then
  while read -r name to script; do
    [ -n "$name" ] || continue
    run "$name" "$to" ". $script"
  done < /softroce.tests
fi

[ "$RC" = 0 ] || { say "dmesg tail:"; dmesg | tail -n 30; }
finish
