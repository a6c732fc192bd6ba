#!/bin/bash
# The loom models of gdr-core (the registration cache, the engine, its
# reactor, its hand-off between the peers' locks and its pass), and the
# proof that each can fail: builds the loom tests once, runs every model
# on the real code (all must pass, explored without a preemption bound),
# then runs the models named for each mutant
# (gdr-core/src/cache/mutant.rs) with GDR_MUTANT=<mutant> and requires each
# of those runs to fail. Prints one line per mutant; exits non-zero if a
# model fails on the real code, if a mutant survives a model named for it,
# or if the table below and the code disagree (a mutant or a model left
# out).
#
# Usage: scripts/loom-mutants.sh   (env: CARGO_TARGET_DIR, default target/loom;
#        LOOM_MUTANT_TIMEOUT, seconds per mutant run, default 120)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
export RUSTFLAGS="--cfg loom"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/loom}
unset GDR_MUTANT LOOM_MAX_PREEMPTIONS
timeout_s=${LOOM_MUTANT_TIMEOUT:-120}
prefix=cache::loom_tests::

# mutant                                  model that must fail on it
table="
no-dedupe                                 concurrent_misses_on_one_range_register_once
overlap-ignores-pending                   concurrent_lookup_and_insert_of_overlapping_ranges
count-use-after-unlock                    lookup_racing_eviction
evict-in-use                              refcount_reaching_zero_while_an_eviction_runs
evict-in-use                              lookup_racing_eviction
invalidate-skips-in-use                   invalidate_racing_a_hit
no-invalidate-pending                     invalidate_racing_a_registration_in_flight
no-covered-waiter-count                   a_waiter_racing_an_eviction
stale-entry-hits                          a_reused_address_racing_a_lookup_of_the_old_allocation
allocation-invalidation-misses-pending    invalidate_allocation_racing_a_registration_in_flight
waiter-retries-failure                    a_failed_registration_is_shared_with_its_waiters
failed-stays-pending                      a_failed_registration_is_shared_with_its_waiters
abandon-not-finished                      an_abandoned_registration_is_retried_by_its_waiters
abandoned-stays-pending                   an_abandoned_registration_is_retried_by_its_waiters
trim-evicts-in-use                        trim_and_set_limits_racing_a_hit
set-limits-no-evict                       trim_and_set_limits_racing_a_hit
owner-invalidation-skips-in-use           dropping_a_buffer_waits_for_an_escaped_handle
lease-release-no-notify                   dropping_a_buffer_waits_for_an_escaped_handle
budget-check-then-act                     concurrent_registrations_never_pass_the_mr_budget
complete-check-then-act                   engine::loom_tests::a_completion_racing_a_timeout_and_a_waiter
notify-skips-a-waiter                     engine::loom_tests::a_completion_racing_a_timeout_and_a_waiter
timeout-delivers-in-flight                engine::loom_tests::a_deadline_racing_the_completion_of_a_batch_in_flight
send-limit-ignored                        engine::loom_tests::sends_never_outrun_the_peers_receives_and_every_credit_comes_back
send-credit-leak                          engine::loom_tests::sends_never_outrun_the_peers_receives_and_every_credit_comes_back
wake-skips-eventfd                        engine::reactor::loom_tests::a_wake_reaches_a_leader_about_to_park
park-skips-change-check                   engine::reactor::loom_tests::a_wake_reaches_a_leader_about_to_park
park-skips-arm                            engine::reactor::loom_tests::a_completion_around_the_arm_is_not_lost
arm-without-poll                          engine::reactor::loom_tests::a_completion_around_the_arm_is_not_lost
progressed-skips-leader                   engine::reactor::loom_tests::a_leader_is_told_when_another_threads_progress_ends_its_batch
wake-skips-eventfd                        engine::reactor::loom_tests::a_leader_is_told_when_another_threads_progress_ends_its_batch
park-skips-change-check                   engine::reactor::loom_tests::a_leader_is_told_when_another_threads_progress_ends_its_batch
watch-skipped                             engine::reactor::loom_tests::a_leader_is_told_when_another_threads_progress_ends_its_batch
followers-not-told                        engine::reactor::loom_tests::a_follower_is_told_when_the_leaders_progress_ends_its_batch
follower-counted-late                     engine::reactor::loom_tests::a_follower_is_told_when_the_leaders_progress_ends_its_batch
leader-leaves-silently                    engine::reactor::loom_tests::a_follower_takes_the_lead_when_the_leader_leaves
lead-taken-twice                          engine::reactor::loom_tests::a_follower_takes_the_lead_when_the_leader_leaves
nudge-skips-wake                          engine::reactor::loom_tests::a_nudge_ends_a_driving_wait
pass-clears-late                          engine::handoff::loom_tests::a_peers_step_racing_the_pass_leaves_its_work_due
settle-skips-due                          engine::handoff::loom_tests::a_peers_step_racing_the_pass_leaves_its_work_due
pass-clears-late                          engine::handoff::loom_tests::a_deadline_set_while_the_pass_runs_is_kept
deadline-check-then-store                 engine::handoff::loom_tests::a_deadline_set_while_the_pass_runs_is_kept
settle-before-mark                        engine::handoff::loom_tests::a_deadline_left_under_a_peers_lock_alone_is_handled_by_a_pass
pass-clears-with-store                    engine::handoff::loom_tests::a_deadline_left_under_a_peers_lock_alone_is_handled_by_a_pass
pass-skips-marked                         engine::handoff::loom_tests::a_deadline_left_under_a_peers_lock_alone_is_handled_by_a_pass
route-cache-ignores-version               engine::handoff::loom_tests::a_queue_pair_number_reused_while_a_poller_holds_the_old_route
driver-asleep-not-counted                 engine::reactor::loom_tests::a_driver_resumes_when_the_waiter_that_took_its_lead_leaves
leader-parks-beside-a-displaced-driver    engine::reactor::loom_tests::a_waiter_parks_only_once_the_driver_it_displaced_stepped_back
step-back-not-told                        engine::reactor::loom_tests::a_waiter_parks_only_once_the_driver_it_displaced_stepped_back
"

build_log=$(mktemp)
trap 'rm -f "$build_log"' EXIT
if ! cargo test -p gdr-core --release --lib loom --no-run >"$build_log" 2>&1; then
  cat "$build_log" >&2
  echo "loom-mutants: the loom build failed" >&2
  exit 1
fi
bin=$(sed -n 's/.*Executable unittests src\/lib.rs (\(.*\))$/\1/p' "$build_log" | tail -1)
[ -x "$bin" ] || { cat "$build_log" >&2; echo "loom-mutants: no test binary" >&2; exit 1; }

failed=0
# The table and the code must agree: every mutant has a model, every model
# a mutant.
mutants=$(sed -n '/^pub(crate) const MUTANTS/,/^];/s/^ *"\([a-z0-9-]*\)",$/\1/p' \
  gdr-core/src/cache/mutant.rs | sort -u)
# Cache models are named bare in the table, the engine's with their path.
models=$({
  grep -A1 '^#\[test\]' gdr-core/src/cache/loom_tests.rs \
    | sed -n 's/^fn \([a-z0-9_]*\)().*/\1/p'
  grep -A1 '^#\[test\]' gdr-core/src/engine/loom_tests.rs \
    | sed -n 's/^fn \([a-z0-9_]*\)().*/engine::loom_tests::\1/p'
  grep -A1 '^#\[test\]' gdr-core/src/engine/reactor/loom_tests.rs \
    | sed -n 's/^fn \([a-z0-9_]*\)().*/engine::reactor::loom_tests::\1/p'
  grep -A1 '^#\[test\]' gdr-core/src/engine/handoff/loom_tests.rs \
    | sed -n 's/^fn \([a-z0-9_]*\)().*/engine::handoff::loom_tests::\1/p'
} | sort -u)
tabled_mutants=$(awk 'NF == 2 { print $1 }' <<<"$table" | sort -u)
tabled_models=$(awk 'NF == 2 { print $2 }' <<<"$table" | sort -u)
for m in $(comm -23 <(echo "$mutants") <(echo "$tabled_mutants")); do
  echo "loom-mutants: mutant $m has no model in the table" >&2; failed=1
done
for m in $(comm -13 <(echo "$mutants") <(echo "$tabled_mutants")); do
  echo "loom-mutants: the table names $m, which mutant.rs does not define" >&2; failed=1
done
for t in $(comm -23 <(echo "$models") <(echo "$tabled_models")); do
  echo "loom-mutants: model $t has no mutant in the table" >&2; failed=1
done
for t in $(comm -13 <(echo "$models") <(echo "$tabled_models")); do
  echo "loom-mutants: the table names model $t, which loom_tests.rs does not define" >&2; failed=1
done

# The real code: every model passes.
start=$(date +%s%N)
out=$("$bin" loom_tests:: --nocapture 2>&1)
rc=$?
grep -E '^loom: |^test result' <<<"$out"
if [ $rc -ne 0 ]; then
  echo "$out" >&2
  echo "loom-mutants: a model fails on the real code" >&2
  failed=1
fi
echo "loom-mutants: models on the real code: $((($(date +%s%N) - start) / 1000000)) ms"

# Each mutant: every model named for it must fail.
killed=0 survived=0
while read -r mutant model; do
  [ -n "${mutant:-}" ] || continue
  case $model in
    *::*) full=$model ;;
    *) full=$prefix$model ;;
  esac
  out=$(GDR_MUTANT=$mutant timeout "$timeout_s" "$bin" --exact "$full" 2>&1)
  rc=$?
  why=$(grep -m1 -A1 "panicked at" <<<"$out" | tail -1 | cut -c1-110)
  # Failed: the test failed; or loom aborted the process (a second panic
  # while it unwound a model whose threads were still alive: exit 134) after
  # the model's own thread panicked first.
  first_panic=$(grep -m1 "panicked at" <<<"$out")
  if { [ $rc -eq 101 ] && grep -q "^test $full \.\.\. FAILED" <<<"$out"; } ||
    { [ $rc -eq 134 ] && [[ $first_panic == "thread '$full' "* ]]; }; then
    printf 'mutant %-40s killed   by %s: %s\n' "$mutant" "$model" "$why"
    killed=$((killed + 1))
  else
    case $rc in
      0) what="SURVIVED (the model passed)" ;;
      2) what="ERROR (unknown mutant)" ;;
      124) what="TIMEOUT after ${timeout_s}s" ;;
      *) what="ERROR (exit $rc)" ;;
    esac
    printf 'mutant %-40s %s: %s\n' "$mutant" "$what" "$model" >&2
    survived=$((survived + 1))
    failed=1
  fi
done <<<"$table"
echo "loom-mutants: $killed killed, $survived not killed"
exit $failed
