#!/bin/bash
# two-guest-cm.sh TEST_BINARY [--kill-server [SECONDS]]
# Runs the rdma_cm two-guest test (tests/tests/rxe_cm.rs, rxe_cm_two_guests)
# across two SoftRoCE guests on a virtual wire: A (10.99.0.1) is the server,
# B (10.99.0.2) the client, started in no fixed order (the client retries).
# Builds nothing: TEST_BINARY is the rxe_cm test executable, e.g. from
#   cargo test -p gdr-tests --test rxe_cm --no-run
# Exit status: nonzero if either side fails.
#
# --kill-server [S]: the server holds the connection and the client READs in
# a loop; S seconds (default 2) after the client prints
# GDR_CM_TRANSFERS_RUNNING, guest A's qemu is killed, and the client reports
# how long after its last successful READ the next one failed (its own
# DEAD-PEER line). Only the client's status counts then.
# Passing requires more than exit status 0: each side that counts (both, or
# the client with --kill-server) must print libtest's "test result: ok. 1
# passed" for the named test, so a renamed or filtered-out test (zero tests
# run, exit 0) fails.
# Env: GDR_CM_PORT (7471), GDR_CM_ACK_TIMEOUT (QP ACK timeout code, or "cm"
# for rdma_cm's; default: the HAL's), GDR_CM_TEST (the test to run, default
# rxe_cm_two_guests), and the RXEVM_* knobs of two-guests.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
if [ $# -lt 1 ]; then echo "usage: $0 TEST_BINARY [--kill-server [SECONDS]]" >&2; exit 2; fi
BIN=$(realpath "$1"); shift
KILL=0; KILL_AFTER=2
if [ "${1:-}" = --kill-server ]; then KILL=1; KILL_AFTER=${2:-2}; fi
[ -x "$BIN" ] || { echo "two-guest-cm: $BIN is not executable" >&2; exit 2; }
D=$(mktemp -d /tmp/rxevm-cm.XXXXXX)
trap 'rm -rf "$D"' EXIT
HOLD=""; [ "$KILL" = 1 ] && HOLD="GDR_CM_HOLD=1"
COMMON="GDR_EXPECT_RXE=1 GDR_CM_PORT=${GDR_CM_PORT:-7471} ${GDR_CM_ACK_TIMEOUT:+GDR_CM_ACK_TIMEOUT=$GDR_CM_ACK_TIMEOUT} $HOLD"
NAME=${GDR_CM_TEST:-rxe_cm_two_guests}
TEST="'$BIN' --exact '$NAME' --nocapture --test-threads=1"
# require_ok LOG SIDE...: each SIDE's labelled output holds libtest's
# summary with exactly one test passed (with --exact NAME, only NAME can be
# that test). libtest's own "test NAME ... ok" line is no anchor: with
# --nocapture and one thread the test's output lands between its two halves.
require_ok() {
  local log=$1 side ok=0; shift
  for side in "$@"; do
    if ! grep -qE "^$side\| test result: ok\. 1 passed;" "$log"; then
      echo "two-guest-cm: guest $side did not report '$NAME' run and passed (no 'test result: ok. 1 passed'; test missing, renamed or filtered out?)" >&2
      ok=1
    fi
  done
  return $ok
}
CA="env $COMMON GDR_CM_ROLE=server $TEST"
CB="env $COMMON GDR_CM_ROLE=client GDR_CM_PEER=10.99.0.1 $TEST"
export RXEVM_PAIR_DIR=$D
rc=0
if [ "$KILL" = 0 ]; then
  "$HERE/two-guests.sh" "$CA" "$CB" 2>&1 | tee "$D/out" || rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && { require_ok "$D/out" A B || rc=1; }
  echo "two-guest-cm: exit $rc" >&2
  exit "$rc"
fi
# Kill mode: watch the merged output for the client's marker.
"$HERE/two-guests.sh" "$CA" "$CB" 2>&1 | {
  killed=0
  while IFS= read -r line; do
    printf '%s\n' "$line"
    if [ "$killed" = 0 ] && [[ $line == "B| GDR_CM_TRANSFERS_RUNNING"* ]]; then
      killed=1
      ( sleep "$KILL_AFTER"
        pid=$(cat "$D/a.pid")
        kill "$pid"
        echo "two-guest-cm: killed guest A (qemu pid $pid) at $(date +%T.%N)" ) &
    fi
  done
  wait
} | tee "$D/out" || true
RB=$(cat "$D/b.rc" 2>/dev/null || echo 125)
[ "$RB" = 0 ] && { require_ok "$D/out" B || RB=1; }
echo "two-guest-cm: client (B) exit $RB" >&2
exit "$RB"
