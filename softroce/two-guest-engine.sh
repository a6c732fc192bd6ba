#!/bin/bash
# two-guest-engine.sh TEST_BINARY [--kill-server [SECONDS]]
# Runs the transfer engine's two-guest tests (tests/tests/rxe_engine_wire.rs)
# across two SoftRoCE guests joined by two virtual wires (RXEVM_PAIR_WIRES=2:
# rxe0 on 10.99.0.x, rxe1 on 10.99.1.x): A (.1) serves, B (.2) is the
# client, started in no fixed order (the client retries). Builds nothing:
# TEST_BINARY is the rxe_engine_wire test executable, e.g. from
#   cargo test -p gdr-tests --test rxe_engine_wire --no-run
# Both guests run engine_wire_large_batches (32 MiB batches over rxe0, WRITE
# and READ verified) and engine_wire_two_nics (the same over rxe0 and rxe1
# at once); each must report both passed (libtest's "test result: ok. 1
# passed", once per test: see require_passed in two-guest-lib.sh).
#
# --kill-server [S]: then, in the same guests (one boot less), the engine's
# dead-peer test: A holds a connection, B keeps WRITE batches in flight; S
# seconds (default 1) after B prints GDR_WIRE_TRANSFERS_RUNNING guest A's
# qemu is killed; B's requests must end with a typed error (its DEAD-PEER
# line says which), and this script says how long after the kill that
# came. B must report that test passed too; A's status no longer counts.
# Env (exported, so the guests see it too): GDR_WIRE_PORT (7480; the tests
# use it and the next two), GDR_WIRE_ACK_TIMEOUT (the QPs' ACK timeout code,
# default 18, ~1.07 s a try), and the RXEVM_* knobs of two-guests.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=softroce/two-guest-lib.sh
. "$HERE/two-guest-lib.sh"
ME=two-guest-engine
two_guest_setup "$ME" 1 "$@"
# One test per invocation, chained: a side whose test failed ends at once,
# and two-guests.sh stops its partner (which would wait for it) soon after.
run() { echo "'$BIN' --exact $1 --nocapture --test-threads=1"; }
ENV="env GDR_EXPECT_RXE=1"
SA="$ENV GDR_WIRE_ROLE=server"
SB="$ENV GDR_WIRE_ROLE=client GDR_WIRE_PEER=10.99.0.1 GDR_WIRE_PEER2=10.99.1.1"
CA="$SA $(run engine_wire_large_batches) && $SA $(run engine_wire_two_nics)"
CB="$SB $(run engine_wire_large_batches) && $SB $(run engine_wire_two_nics)"
export RXEVM_PAIR_WIRES=2
[ "$KILL" = 1 ] || pair_run "$ME" "$CA" "$CB" A:2 B:2
# A is killed on purpose: B, whose requests then take seconds to fail, is
# stopped only if it hangs (two minutes: it needed ~25 s).
KILLED=engine_wire_peer_killed
pair_run_killing "$ME" GDR_WIRE_TRANSFERS_RUNNING 120 "$CA && $SA $(run $KILLED)" \
  "$CB && $SB $(run $KILLED)" A:2 B:3
