#!/bin/bash
# two-guests.sh 'CMD_A' 'CMD_B'
# Boots guest A (10.99.0.1) and guest B (10.99.0.2) at once, each with its own
# rxe0 on a virtio-net eth0, joined by a QEMU "-netdev dgram" over two unix
# datagram sockets (no host IP address involved). Runs CMD_A in A and CMD_B
# in B (each through sh -c, same cwd and environment as here), prints their
# output (stdout and stderr merged) as it comes, lines labelled "A| " and "B| ",
# and exits 0 if both exit 0, else with A's status if nonzero, else B's.
# Start order is not guaranteed: a client must retry until its server listens.
# Env: RXEVM_PAIR_DIR  folder for the sockets and qemu PIDs (a.pid, b.pid),
#                      e.g. to kill one guest, and their monitors' FIFOs
#                      (a.mon.in, b.mon.in: see RXEVM_MONITOR in run-in-vm.sh,
#                      and monitor in two-guest-lib.sh); default: a temporary one
#      RXEVM_PAIR_WIRES=1  2: a second wire between a second virtio-net NIC
#                      of each guest, eth1, carrying rxe1: A 10.99.1.1, B
#                      10.99.1.2 (two rxe devices in one guest do not reach
#                      each other, so a second device per node needs this)
#      RXEVM_PAIR_LINGER=15  once one guest's command failed, the other is
#                      stopped if still running this many seconds later (it is
#                      likely waiting for its partner); 0: never (a script that
#                      kills a guest on purpose)
#      RXEVM_SMP=1 RXEVM_MEM=512 RXEVM_TIMEOUT=600 RXEVM_VERBOSE=1, and the
#      other RXEVM_* knobs of run-in-vm.sh, apply to both guests.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
if [ $# -ne 2 ]; then echo "usage: $0 'CMD_A' 'CMD_B'" >&2; exit 2; fi
CA=$1; CB=$2
if [ -n "${RXEVM_PAIR_DIR:-}" ]; then D=$RXEVM_PAIR_DIR; mkdir -p "$D"; OWN=0
else D=$(mktemp -d /tmp/rxevm-pair.XXXXXX); OWN=1; fi
# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() { if [ "$OWN" = 1 ]; then rm -rf "$D"; fi; }
# Background jobs of a script ignore SIGINT: stop the guests ourselves.
# shellcheck disable=SC2317
stop() {
  local f
  for f in "$D/a.pid" "$D/b.pid"; do [ ! -s "$f" ] || kill "$(cat "$f")" 2>/dev/null || true; done
  wait; exit "$1"
}
trap cleanup EXIT
trap 'stop 130' INT
trap 'stop 143' TERM
export RXEVM_SMP=${RXEVM_SMP:-1} RXEVM_MEM=${RXEVM_MEM:-512}
export RXEVM_TIMEOUT=${RXEVM_TIMEOUT:-600} RXEVM_VERBOSE=${RXEVM_VERBOSE:-1}
# Build (if stale) once here rather than in both guests' launches.
"$HERE/build-initramfs.sh"
WIRES=${RXEVM_PAIR_WIRES:-1}
case "$WIRES" in 1|2) ;; *) echo "two-guests: RXEVM_PAIR_WIRES=$WIRES: 1 or 2" >&2; exit 2 ;; esac
rm -f "$D"/[ab].sock "$D"/[ab]1.sock "$D/a.pid" "$D/b.pid" "$D/a.rc" "$D/b.rc" "$D"/[ab].mon.*
T0=$(date +%s.%N)

# wire LOCAL REMOTE: a QEMU netdev, one end of a datagram wire
wire() { echo "dgram,local.type=unix,local.path=$D/$1,remote.type=unix,remote.path=$D/$2"; }
# guest NAME N OTHER CMD: run guest NAME (host number N on each wire; its
# sockets are named after it, OTHER's after the other), output labelled
guest() {
  local me=${1,} rc=0 nic2=
  [ "$WIRES" = 1 ] || nic2=$(wire "${me}1.sock" "${3}1.sock")
  RXEVM_NIC=$(wire "$me.sock" "$3.sock") RXEVM_MAC=52:54:00:99:00:0$2 RXEVM_IP=10.99.0.$2/24 \
    RXEVM_NIC2=$nic2 RXEVM_MAC2=52:54:00:99:01:0$2 RXEVM_IP2=10.99.1.$2/24 \
    RXEVM_PIDFILE=$D/$me.pid RXEVM_MONITOR=$D/$me.mon "$HERE/run-in-vm.sh" sh -c "$4" 2>&1 | sed -u "s/^/$1| /" || rc=${PIPESTATUS[0]}
  echo "$rc" > "$D/$me.rc"
}
guest A 1 b "$CA" &
guest B 2 a "$CB" &
# The first guest to end: if it failed, its partner (likely waiting for it)
# has LINGER seconds to end too.
wait -n || true
LINGER=${RXEVM_PAIR_LINGER:-15}
failed=
for g in a b; do
  if [ -s "$D/$g.rc" ] && [ "$(cat "$D/$g.rc")" != 0 ]; then failed=$g; break; fi
done
if [ "$LINGER" != 0 ] && [ -n "$failed" ]; then
  other=b; [ "$failed" = a ] || other=a
  for _ in $(seq "$LINGER"); do [ -s "$D/$other.rc" ] && break; sleep 1; done
  if [ ! -s "$D/$other.rc" ] && [ -s "$D/$other.pid" ]; then
    echo "two-guests: guest ${failed^} failed; stopping guest ${other^}, still running ${LINGER}s later" >&2
    kill "$(cat "$D/$other.pid")" 2>/dev/null || true
  fi
fi
wait
RA=$(cat "$D/a.rc" 2>/dev/null || echo 125)
RB=$(cat "$D/b.rc" 2>/dev/null || echo 125)
echo "two-guests: rcA=$RA rcB=$RB wall=$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN { printf "%.2f", a - b }')s" >&2
if [ "$RA" != 0 ]; then exit "$RA"; fi
exit "$RB"
