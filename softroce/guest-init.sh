#!/bin/busybox sh
# shellcheck shell=sh disable=SC2154
# /init of the SoftRoCE guest's initramfs (PID 1). Built in by build-initramfs.sh.
# Kernel command-line words name=value arrive as environment:
#   rxevm_dir=/host/path   per-run host folder, seen at the same path through the
#                          9p root: holds cmd.sh; receives ready-uptime, status
#   rxevm_netdev=dummy0|eth0  rxe0's netdev (eth0: the virtio-net NIC, if any)
#   rxevm_ip=A/N           that netdev's address     rxevm_mtu=N  its MTU (optional)
#   rxevm_ip2=A/N          optional: rxe1 on the second virtio-net NIC, eth1,
#                          with this address (same MTU)
#   rxevm_cache=mmap       9p cache mode of the shared root
/bin/busybox mkdir -p /proc /sys /dev /newroot
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

log() { echo "rxevm-init: $*" > /dev/ttyS0 2>/dev/null || echo "rxevm-init: $*"; }
die() {
  log "FATAL: $*"
  [ -n "$rxevm_dir" ] && [ -d "/newroot$rxevm_dir" ] && echo 254 > "/newroot$rxevm_dir/status"
  sync; poweroff -f
}
up() { cut -d' ' -f1 /proc/uptime; }
log "uptime at init: $(up)"

# Modules in dependency order (computed on the host); '?' marks optional ones.
while read -r m; do
  case "$m" in
    \?*) insmod "/modules/${m#?}" 2>/dev/null || log "optional module ${m#?} not loaded" ;;
    *) insmod "/modules/$m" || die "insmod $m failed" ;;
  esac
done < /modules/load-order
log "modules loaded: $(up)"

# The host's / over virtio-9p, with fresh kernel file systems on top.
mount -t 9p -o "trans=virtio,version=9p2000.L,msize=512000,cache=${rxevm_cache:-mmap},access=client" root /newroot \
  || die "mount 9p root failed"
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs tmpfs /newroot/dev/shm
mount -t tmpfs tmpfs /newroot/run
mkdir -p /newroot/run/rxevm-tmp
chmod 1777 /newroot/run/rxevm-tmp
log "9p root mounted: $(up)"

# Network: lo, then rxe0 on dummy0 (single guest) or eth0 (virtio-net NIC).
IP="chroot /newroot /usr/sbin/ip"
$IP link set lo up
NETDEV=${rxevm_netdev:-dummy0}
case "$NETDEV" in
  dummy0) [ -e /sys/class/net/dummy0 ] || $IP link add dummy0 type dummy || die "ip link add dummy0 failed" ;;
  eth0) [ -e /sys/class/net/eth0 ] || die "no eth0 (no virtio-net NIC?)" ;;
  *) die "unknown rxevm_netdev=$NETDEV" ;;
esac
# add_rxe RXE NETDEV ADDR: address and MTU on NETDEV, up, SoftRoCE RXE on it
add_rxe() {
  $IP addr add "$3" dev "$2" || die "ip addr add $3 dev $2 failed"
  [ -z "${rxevm_mtu:-}" ] || $IP link set "$2" mtu "$rxevm_mtu" || die "ip link set $2 mtu failed"
  $IP link set "$2" up || die "ip link set $2 up failed"
  chroot /newroot /usr/bin/rdma link add "$1" type rxe netdev "$2" || die "rdma link add $1 failed"
}
add_rxe rxe0 "$NETDEV" "${rxevm_ip:-10.99.0.1/24}"
if [ -n "${rxevm_ip2:-}" ]; then
  [ -e /sys/class/net/eth1 ] || die "rxevm_ip2 given but no eth1 (no second virtio-net NIC?)"
  add_rxe rxe1 eth1 "$rxevm_ip2"
  log "rxe1 ready on eth1 $rxevm_ip2: $(up)"
fi
log "rxe0 ready on $NETDEV ${rxevm_ip:-10.99.0.1/24}: $(up)"
up > "/newroot$rxevm_dir/ready-uptime"

# The command: stdout -> hvc0, stderr -> hvc1 (the caller's stdout and stderr).
# hvc resets termios when its last fd closes, so keep both open while setting
# raw mode (no \n -> \r\n) and while the command runs. The command writes to
# pipes, not to the ttys, so that it sees no terminal (as under CI).
# cmd.sh is run by bash: its quoting ($'...') is not POSIX sh.
OUT=/dev/hvc0; ERR=/dev/hvc1
[ -e $ERR ] || ERR=$OUT
exec 3> $OUT 4> $ERR
stty -F $OUT raw -echo 2>/dev/null
stty -F $ERR raw -echo 2>/dev/null
mkfifo /out.fifo /err.fifo
cat /out.fifo >&3 & c1=$!
cat /err.fifo >&4 & c2=$!
chroot /newroot /bin/bash "$rxevm_dir/cmd.sh" < /dev/null > /out.fifo 2> /err.fifo
rc=$?
wait $c1 $c2
exec 3>&- 4>&-
free -k > "/newroot$rxevm_dir/guest-free" 2>/dev/null
echo "$rc" > "/newroot$rxevm_dir/status"
log "command exited rc=$rc at $(up)"
sync
poweroff -f
