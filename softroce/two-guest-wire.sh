#!/bin/bash
# two-guest-wire.sh TEST_BINARY
# The transfer engine across two SoftRoCE guests whose wire is really cut
# (tests/tests/rxe_engine_wire.rs's wire tests; A serves, B is the client;
# one boot for all five):
#   engine_wire_cut_silent  B's end of wire 0 drops every packet with the
#                           link up (tc: netem loss 100% out, an ingress drop
#                           rule in) while WRITE batches are in flight
#   engine_wire_cut_link    the cable pulled: on B's "GDR_WIRE_LINK off|on"
#                           this script sets both guests' eth0 link through
#                           their qemu's QMP monitor (set_link)
#   engine_wire_cut_outlasting  a silent cut longer than the reconnect
#                           bound (5 s there): B's peer is gone, typed; once
#                           the wire is back B connects afresh
#   engine_wire_flapping    on B's "GDR_WIRE_FLAP S" the link is pulled and
#                           plugged by WIRE_FLAP_SCHEDULE for S seconds while B
#                           WRITEs and READs back
#   engine_wire_impaired    both guests put netem (GDR_WIRE_NETEM, default
#                           "delay 20ms loss 2%") on their way out; transfers
#                           must complete and verify, B prints the figures
# Each side must report each test passed (require_passed).
# Env (exported, so the guests see it too): GDR_WIRE_PORT (7480; these tests
# use ports +3..+7), GDR_WIRE_ACK_TIMEOUT (18), GDR_WIRE_RETRY (the HAL's 3),
# GDR_WIRE_NETEM; WIRE_TESTS (which of the four, in order; default all);
# WIRE_FLAP_SCHEDULE ("DOWN:UP ..." seconds, repeated; default "1:4 5:6 2:3
# 6:8": outages shorter and longer than the queue pairs' retry time); the
# RXEVM_* knobs of two-guests.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=softroce/two-guest-lib.sh
. "$HERE/two-guest-lib.sh"
ME=two-guest-wire
two_guest_setup "$ME" 0 "$@"
SCHEDULE=${WIRE_FLAP_SCHEDULE:-1:4 5:6 2:3 6:8}
run() { echo "'$BIN' --exact $1 --nocapture --test-threads=1"; }
TESTS=${WIRE_TESTS:-engine_wire_cut_silent engine_wire_cut_link engine_wire_cut_outlasting engine_wire_flapping engine_wire_impaired}
ENV="env GDR_EXPECT_RXE=1"
CA=; CB=
for t in $TESTS; do
  CA="$CA${CA:+ && }$ENV GDR_WIRE_ROLE=server $(run "$t")"
  CB="$CB${CB:+ && }$ENV GDR_WIRE_ROLE=client GDR_WIRE_PEER=10.99.0.1 $(run "$t")"
done
export RXEVM_PAIR_WIRES=1
rc=0
"$TWO_GUESTS" "$CA" "$CB" 2>&1 | drive_link "$D" "$ME" "$SCHEDULE" | tee "$D/out" || rc=${PIPESTATUS[0]}
# The monitors' replies: one '"return": {}' per command, no '"error"'.
replies=$(cat "$D/a.qmp.log" "$D/b.qmp.log" 2>/dev/null | { grep -o '"return": {}' || true; } | wc -l)
errors=$(cat "$D/a.qmp.log" "$D/b.qmp.log" 2>/dev/null | grep -c '"error"' || true)
echo "$ME: qemu monitors: $replies commands answered, $errors errors" >&2
[ "$errors" = 0 ] || { cat "$D/a.qmp.log" "$D/b.qmp.log" >&2; rc=1; }
[ "$rc" = 0 ] && { n=$(wc -w <<< "$TESTS"); require_passed "$ME" "$D/out" "A:$n" "B:$n" || rc=1; }
echo "$ME: exit $rc" >&2
exit "$rc"
