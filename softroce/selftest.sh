#!/bin/bash
# selftest.sh: fast self-test of the SoftRoCE harness; CI runs it after setup.sh.
#   1 one guest: rxe0 is listed and ACTIVE (rdma, ibv_devices, ibv_devinfo);
#     cwd, arguments, environment, TMPDIR, stdout/stderr and the exit status
#     (3) pass through run-in-vm.sh
#   2 one guest: ib_write_bw 64 KiB x 200 server+client on 10.99.0.1, with the
#     TCP exchange (verbs) and with rdma_cm (-R)
#   3 two guests: ib_write_bw -R from B (10.99.0.2) to A (10.99.0.1)
# Prints each step's wall time and a closing "selftest: N passed, N failed";
# exits 1 if a step failed. Boots one VM at a time (two in step 3).
# The guest-* subcommands are internal: they run inside a guest.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SELF=$HERE/selftest.sh
VM=$HERE/run-in-vm.sh
BW=(ib_write_bw -d rxe0 -s 65536 -n 200)
EXPECT_VAR=$'a b \'q\' "dq" $x\nsecond line'
EXPECT_ARG='arg  with spaces'

fail() { echo "selftest: FAILED: $*" >&2; exit 1; }
case "${1:-}" in
  guest-checks)   # EXPECTED_CWD EXPECTED_ARG
    links=$(rdma link show) || fail "rdma link show"
    echo "$links"
    grep -q '^link rxe0/1 state ACTIVE' <<< "$links" || fail "rxe0/1 not ACTIVE"
    devs=$(ibv_devices) || fail "ibv_devices"
    grep -qw rxe0 <<< "$devs" || fail "ibv_devices does not list rxe0"
    info=$(ibv_devinfo -d rxe0) || fail "ibv_devinfo -d rxe0"
    grep -E 'hca_id|state|active_mtu|link_layer' <<< "$info"
    grep -q 'state:.*PORT_ACTIVE' <<< "$info" || fail "rxe0 port not PORT_ACTIVE"
    [ "$PWD" = "$2" ] || fail "cwd is $PWD, expected $2"
    [ "$3" = "$EXPECT_ARG" ] || fail "argument arrived as [$3]"
    [ "${SOFTROCE_SELFTEST_VAR:-}" = "$EXPECT_VAR" ] || fail "environment: [${SOFTROCE_SELFTEST_VAR:-}]"
    [ "$TMPDIR" = /run/rxevm-tmp ] || fail "TMPDIR=$TMPDIR"
    [ "$(stat -f -c %T "$TMPDIR")" = tmpfs ] || fail "TMPDIR is not a tmpfs"
    echo "selftest: to-stdout"
    echo "selftest: to-stderr" >&2
    exit 3 ;;
  guest-bw-server)   # PORT [perftest options]; its output only if it fails
    port=$2; shift 2
    out=$TMPDIR/bw-server.$port
    timeout 120 "${BW[@]}" -p "$port" "$@" > "$out" 2>&1 || { cat "$out"; fail "ib_write_bw server $*"; }
    exit 0 ;;
  guest-bw-client)   # LABEL HOST PORT [perftest options]; retries until the server listens
    # (and, with SERVER_PID set, only while that server process lives)
    label=$2 host=$3 port=$4; shift 4
    out=$TMPDIR/bw-client.$port
    for _ in $(seq 60); do
      sleep 0.5
      if [ -n "${SERVER_PID:-}" ] && ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "selftest: the server on port $port is gone" > "$out"
        break
      fi
      if timeout 100 "${BW[@]}" -p "$port" "$@" "$host" > "$out" 2>&1; then
        awk -v l="$label" '$1 == 65536 && NF >= 5 { print "selftest: bw " l " " $4 " MB/s"; f = 1 }
                           END { exit !f }' "$out" || { cat "$out"; fail "no result line"; }
        exit 0
      fi
    done
    cat "$out"; fail "ib_write_bw client $* $host" ;;
  guest-bw-loopback)   # both modes, server and client in this guest
    # A pair that fails is tried once more with a fresh server on another
    # port: under a loaded host the TCG guest can miss perftest's own
    # out-of-band exchange, and the one-shot server is then gone.
    for mode in verbs rdma_cm; do
      opt=(); port=18515
      if [ "$mode" = rdma_cm ]; then opt=(-R); port=18516; fi
      ok=0
      for attempt in 1 2; do
        "$SELF" guest-bw-server "$port" "${opt[@]}" & sp=$!
        if SERVER_PID=$sp "$SELF" guest-bw-client "one-guest-$mode" 10.99.0.1 "$port" "${opt[@]}" \
          && wait "$sp"; then
          ok=1; break
        fi
        # Under set -e: the server may be gone (kill fails) or have failed
        # (wait returns its status); either must not end the retry.
        kill "$sp" 2>/dev/null || true
        wait "$sp" 2>/dev/null || true
        echo "selftest: one-guest $mode pair failed (attempt $attempt)" >&2
        port=$((port + 100))
      done
      [ "$ok" = 1 ] || exit 1
    done
    exit 0 ;;
  "") ;;
  *) echo "usage: $0   (no arguments)" >&2; exit 2 ;;
esac

now() { date +%s.%N; }
sub() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", a - b }'; }
export RXEVM_TIMEOUT=${RXEVM_TIMEOUT:-300} RXEVM_VERBOSE=1
W=$(mktemp -d "/tmp/softroce selftest.XXXXXX")   # a space, to test cwd quoting
trap 'rm -rf "$W"' EXIT
cd "$W"
PASS=0 FAIL=0 SUMMARY=()
# step NAME FUNCTION: runs it, its output to ours and to $W/NAME.log
step() {
  local t0 rc=0 dt facts
  echo "=== selftest: $1" >&2
  t0=$(now)
  "$2" > >(tee "$W/$1.log") 2>&1 || rc=$?
  wait   # for tee
  dt=$(sub "$(now)" "$t0")
  facts=$(grep -ho -E 'ready=[0-9.]+s|bw [a-z0-9_-]+ [0-9.]+ MB/s' "$W/$1.log" | sed 's/^bw //' | tr '\n' ' ' || true)
  if [ "$rc" = 0 ]; then PASS=$((PASS + 1)); SUMMARY+=("ok    $1 ${dt}s  $facts")
  else FAIL=$((FAIL + 1)); SUMMARY+=("FAIL  $1 ${dt}s (rc=$rc)  $facts"); fi
}

single_guest() {
  local rc=0
  SOFTROCE_SELFTEST_VAR=$EXPECT_VAR "$VM" "$SELF" guest-checks "$PWD" "$EXPECT_ARG" > out 2> err || rc=$?
  sed 's/^/  out| /' out; sed 's/^/  err| /' err
  [ "$rc" = 3 ] || { echo "expected exit status 3, got $rc"; return 1; }
  if ! grep -qx 'selftest: to-stdout' out || ! grep -qx 'selftest: to-stderr' err || grep -q to-stderr out; then
    echo "stdout/stderr mixed up"; return 1
  fi
}
one_guest_perftest() { "$VM" "$SELF" guest-bw-loopback; }
two_guest_perftest() {
  "$HERE/two-guests.sh" "$(printf '%q ' "$SELF" guest-bw-server 18515 -R)" \
                        "$(printf '%q ' "$SELF" guest-bw-client two-guests-rdma_cm 10.99.0.1 18515 -R)"
}

T0=$(now)
step single-guest single_guest
step one-guest-perftest one_guest_perftest
step two-guest-perftest two_guest_perftest
echo "=== selftest: summary (kernel $(cat "${RXEVM_CACHE:-$HERE/cache}/kernel-version" 2>/dev/null || echo ?))"
printf 'selftest: %s\n' "${SUMMARY[@]}"
echo "selftest: total $(sub "$(now)" "$T0")s"
echo "selftest: $PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
