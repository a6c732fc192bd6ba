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
# DEAD-PEER line); this script says how long after the kill that line came.
# Only the client's status counts then.
# Passing requires more than exit status 0: each side that counts (both, or
# the client with --kill-server) must print libtest's "test result: ok. 1
# passed" for the named test (see require_passed in two-guest-lib.sh).
# Env: GDR_CM_PORT (7471), GDR_CM_ACK_TIMEOUT (QP ACK timeout code, or "cm"
# for rdma_cm's; default: the HAL's), GDR_CM_TEST (the test to run, default
# rxe_cm_two_guests), and the RXEVM_* knobs of two-guests.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=softroce/two-guest-lib.sh
. "$HERE/two-guest-lib.sh"
ME=two-guest-cm
two_guest_setup "$ME" 2 "$@"
HOLD=""; [ "$KILL" = 1 ] && HOLD="GDR_CM_HOLD=1"
COMMON="GDR_EXPECT_RXE=1 GDR_CM_PORT=${GDR_CM_PORT:-7471} ${GDR_CM_ACK_TIMEOUT:+GDR_CM_ACK_TIMEOUT=$GDR_CM_ACK_TIMEOUT} $HOLD"
NAME=${GDR_CM_TEST:-rxe_cm_two_guests}
TEST="'$BIN' --exact '$NAME' --nocapture --test-threads=1"
CA="env $COMMON GDR_CM_ROLE=server $TEST"
CB="env $COMMON GDR_CM_ROLE=client GDR_CM_PEER=10.99.0.1 $TEST"
[ "$KILL" = 1 ] || pair_run "$ME" "$CA" "$CB" A:1 B:1
# The server holds the connection until killed; the client READs in a loop.
pair_run_killing "$ME" GDR_CM_TRANSFERS_RUNNING 0 "$CA" "$CB" B:1
