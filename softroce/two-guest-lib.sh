# shellcheck shell=bash
# Sourced by the two-guest test scripts (two-guest-cm.sh, two-guest-engine.sh):
# what they share around two-guests.sh.

# test_binary SCRIPT PATH: the absolute path of an executable test binary,
# or a usage error from SCRIPT.
test_binary() {
  if [ -z "${2:-}" ] || [ ! -x "$2" ]; then
    echo "$1: ${2:-(no test binary given)} is not executable" >&2; return 2
  fi
  realpath "$2"
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
