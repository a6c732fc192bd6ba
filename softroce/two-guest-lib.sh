# shellcheck shell=bash
# Sourced by the two-guest test scripts (two-guest-cm.sh, two-guest-engine.sh):
# what they share around two-guests.sh.
TWO_GUESTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/two-guests.sh

# two_guest_setup SCRIPT DEFAULT_S ARGS...: parses the scripts' arguments,
# "TEST_BINARY [--kill-server [S]]", into BIN (absolute), KILL (0 or 1) and
# KILL_AFTER (S, default DEFAULT_S); makes the run's folder D, removed on
# exit, and exports it as RXEVM_PAIR_DIR (sockets, qemu PIDs, rc files).
# shellcheck disable=SC2034  # BIN, KILL and KILL_AFTER are the caller's
two_guest_setup() {
  local script=$1
  KILL_AFTER=$2; shift 2
  if [ $# -lt 1 ]; then echo "usage: $script TEST_BINARY [--kill-server [SECONDS]]" >&2; exit 2; fi
  if [ ! -x "$1" ]; then echo "$script: $1 is not executable" >&2; exit 2; fi
  BIN=$(realpath "$1"); shift
  KILL=0
  if [ "${1:-}" = --kill-server ]; then KILL=1; KILL_AFTER=${2:-$KILL_AFTER}; fi
  D=$(mktemp -d "/tmp/rxevm-$script.XXXXXX")
  # shellcheck disable=SC2064  # D is fixed now
  trap "rm -rf '$D'" EXIT
  export RXEVM_PAIR_DIR=$D
}

# require_passed SCRIPT LOG SIDE:RUNS...: SIDE's labelled output holds
# libtest's summary "test result: ok. 1 passed" RUNS times (the callers run
# one test per invocation, named with --exact, so only it can be the one
# counted). Exit status 0 is not enough: a renamed or filtered-out test runs
# zero tests and exits 0. libtest's own "test NAME ... ok" line is no
# anchor: with --nocapture and one thread the test's output lands between
# its two halves.
require_passed() {
  local script=$1 log=$2 spec side runs seen ok=0; shift 2
  for spec in "$@"; do
    side=${spec%%:*}; runs=${spec#*:}
    seen=$(grep -cE "^$side\| test result: ok\. 1 passed;" "$log" || true)
    if [ "$seen" -lt "$runs" ]; then
      echo "$script: guest $side reported $seen of its $runs test(s) run and passed ('test result: ok. 1 passed'; a test failed, is missing, renamed or filtered out?)" >&2
      ok=1
    fi
  done
  return $ok
}

# kill_a_after MARKER SECONDS DIR SCRIPT: a filter over two-guests.sh's
# merged output (copied through): SECONDS after guest B prints a line
# starting with MARKER, guest A's qemu (DIR/a.pid) is killed; when B then
# prints a line holding DEAD-PEER, says how long after the kill it came
# (host clock: the guest's output reaches us within milliseconds).
kill_a_after() {
  local marker=$1 after=$2 dir=$3 script=$4 line killed=0 reported=0
  while IFS= read -r line; do
    printf '%s\n' "$line"
    if [ "$killed" = 0 ] && [[ $line == "B| $marker"* ]]; then
      killed=1
      ( sleep "$after"
        pid=$(cat "$dir/a.pid")
        kill "$pid"
        date +%s.%N > "$dir/killed-at"
        echo "$script: killed guest A (qemu pid $pid) at $(date +%T.%N)" ) &
    fi
    if [ "$reported" = 0 ] && [[ $line == "B| "*DEAD-PEER* ]] && [ -s "$dir/killed-at" ]; then
      reported=1
      awk -v a="$(date +%s.%N)" -v k="$(cat "$dir/killed-at")" \
        'BEGIN { printf "'"$script"': B reported the dead peer %.2f s after guest A was killed\n", a - k }'
    fi
  done
  wait
}

# pair_run SCRIPT CMD_A CMD_B SIDE:RUNS...: runs the two guests' commands
# (two-guests.sh), their output shown and kept in D/out; exits with their
# status, or 1 where a side did not report its tests passed.
pair_run() {
  local script=$1 ca=$2 cb=$3 rc=0; shift 3
  "$TWO_GUESTS" "$ca" "$cb" 2>&1 | tee "$D/out" || rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && { require_passed "$script" "$D/out" "$@" || rc=1; }
  echo "$script: exit $rc" >&2
  exit "$rc"
}

# pair_run_killing SCRIPT MARKER LINGER CMD_A CMD_B SIDE:RUNS...: the same,
# with guest A killed KILL_AFTER seconds after B prints MARKER
# (kill_a_after); B's status counts, and RXEVM_PAIR_LINGER is LINGER (A's
# death must not stop B at once).
pair_run_killing() {
  local script=$1 marker=$2 linger=$3 ca=$4 cb=$5 rb; shift 5
  RXEVM_PAIR_LINGER=$linger "$TWO_GUESTS" "$ca" "$cb" 2>&1 \
    | kill_a_after "$marker" "$KILL_AFTER" "$D" "$script" | tee "$D/out" || true
  rb=$(cat "$D/b.rc" 2>/dev/null || echo 125)
  [ "$rb" = 0 ] && { require_passed "$script" "$D/out" "$@" || rb=1; }
  echo "$script: exit $rb (B's, after A was killed)" >&2
  exit "$rb"
}

# qmp DIR GUEST JSON: one QMP command to guest GUEST's qemu (a or b), through
# the monitor FIFOs two-guests.sh gives it (DIR/GUEST.mon.in and .out, see
# RXEVM_MONITOR in run-in-vm.sh); the session's capabilities are negotiated
# the first time. Replies so far are appended to DIR/GUEST.qmp.log. Opening
# the FIFOs read-write never blocks, even once qemu is gone.
qmp() {
  local dir=$1 g=$2
  if [ ! -e "$dir/$g.qmp.log" ]; then
    printf '%s\n' '{"execute":"qmp_capabilities"}' 1<>"$dir/$g.mon.in"
    : > "$dir/$g.qmp.log"
  fi
  printf '%s\n' "$3" 1<>"$dir/$g.mon.in"
  qmp_drain "$dir" "$g"
}

# qmp_drain DIR GUEST: what guest GUEST's monitor answered so far, appended
# to DIR/GUEST.qmp.log.
qmp_drain() {
  dd iflag=nonblock status=none 0<>"$1/$2.mon.out" >> "$1/$2.qmp.log" 2>/dev/null || true
}

# set_link DIR on|off: the wire 0 cable between the guests plugged in or
# pulled: both guests' eth0 (netdev n0) get their link set (each guest sees
# its carrier change; packets to or from a NIC that is down are dropped).
set_link() {
  local up=false g
  [ "$2" != on ] || up=true
  for g in a b; do
    qmp "$1" "$g" '{"execute":"set_link","arguments":{"name":"n0","up":'"$up"'}}'
  done
}

# flap_link DIR SECONDS SCHEDULE SCRIPT: pulls and plugs the wire 0 cable
# for SECONDS by SCHEDULE, "DOWN:UP ..." in seconds, repeated; ends plugged.
flap_link() {
  local dir=$1 secs=$2 schedule=$3 script=$4 end spec flaps=0
  end=$(($(date +%s) + secs))
  while :; do
    for spec in $schedule; do
      [ "$(date +%s)" -lt "$end" ] || break 2
      set_link "$dir" off; flaps=$((flaps + 1)); sleep "${spec%%:*}"
      set_link "$dir" on; sleep "${spec#*:}"
    done
  done
  set_link "$dir" on
  echo "$script: flapping done: the link went down $flaps times in ${secs}s (schedule $schedule)"
}

# drive_link DIR SCRIPT SCHEDULE: a filter over two-guests.sh's merged
# output (copied through) that does what guest B asks of the wire:
# "GDR_WIRE_LINK off|on" sets the link (set_link), "GDR_WIRE_FLAP S" flaps
# it for S seconds (flap_link with SCHEDULE, in the background).
drive_link() {
  local dir=$1 script=$2 schedule=$3 line
  while IFS= read -r line; do
    printf '%s\n' "$line"
    case "$line" in
      "B| GDR_WIRE_LINK off"*|"B| GDR_WIRE_LINK on"*)
        set_link "$dir" "${line##* }"
        echo "$script: link ${line##* } at $(date +%T.%N)" ;;
      "B| GDR_WIRE_FLAP "*)
        flap_link "$dir" "${line##* }" "$schedule" "$script" & ;;
    esac
  done
  wait
  qmp_drain "$dir" a; qmp_drain "$dir" b
}
