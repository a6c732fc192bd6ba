//! Deliberate bugs, compiled into the loom build only, so that each loom
//! model can be shown to fail on the bug it is named after.
//!
//! A hook (in the cache, the engine, its reactor) reads
//! `if mutant::active("name") { <the bug> }`. Outside loom, [`active`] is
//! a `const fn` answering `false`: the hooks compile to nothing. Under
//! `--cfg loom` it answers whether the environment variable `GDR_MUTANT`
//! names that mutant, so one loom build serves every mutant:
//! `GDR_MUTANT=no-invalidate-pending cargo test ... loom` must fail, and
//! `scripts/loom-mutants.sh` requires it of each mutant and the models named
//! for it (its table pairs them).
//!
//! A name in `GDR_MUTANT` that is not in [`MUTANTS`] ends the process with
//! exit status 2 (not a test failure, which would pass for a caught mutant).

/// Every mutant, with the bug it plants.
#[cfg_attr(not(loom), allow(dead_code))]
pub(crate) const MUTANTS: &[(&str, &str)] = &[
    (
        "complete-check-then-act",
        "the engine's completion cell checks for an outcome and stores one under two locks",
    ),
    (
        "notify-skips-a-waiter",
        "the completion cell skips the condvar notification although a thread waits on it",
    ),
    (
        "timeout-delivers-in-flight",
        "a batch past its deadline is delivered at once, while the NIC still holds its requests",
    ),
    (
        "send-limit-ignored",
        "the core posts a SEND although every receive the peer keeps posted is taken",
    ),
    (
        "send-credit-leak",
        "a completed SEND does not give its credit (the peer's receive) back",
    ),
    (
        "no-dedupe",
        "a request inside a registration in flight registers again instead of waiting for it",
    ),
    (
        "overlap-ignores-pending",
        "a request overlapping a registration in flight (not inside it) registers at once \
         instead of waiting and merging",
    ),
    (
        "count-use-after-unlock",
        "a hit counts its use on the entry after releasing the read lock",
    ),
    (
        "evict-in-use",
        "eviction picks entries that handles still hold",
    ),
    (
        "invalidate-skips-in-use",
        "invalidation leaves entries in use linked",
    ),
    (
        "no-invalidate-pending",
        "invalidation does not flag registrations in flight over its range",
    ),
    (
        "no-covered-waiter-count",
        "a waiter inside a registration in flight is not counted as a use of its entry",
    ),
    (
        "stale-entry-hits",
        "a lookup returns an entry of another allocation at the same address",
    ),
    (
        "allocation-invalidation-misses-pending",
        "invalidate_allocation does not flag the allocation's registrations in flight",
    ),
    (
        "waiter-retries-failure",
        "a waiter treats the failure it waited for as abandoned and registers again",
    ),
    (
        "failed-stays-pending",
        "a failed registration is not unpublished: its failure is served forever",
    ),
    (
        "abandon-not-finished",
        "a slot abandoned by a panic is unpublished but its waiters are never woken",
    ),
    (
        "abandoned-stays-pending",
        "a slot abandoned by a panic is never unpublished: its waiters retry on it forever",
    ),
    (
        "trim-evicts-in-use",
        "trim evicts entries that handles still hold",
    ),
    (
        "set-limits-no-evict",
        "set_limits lowers the limits without evicting down to them",
    ),
    (
        "owner-invalidation-skips-in-use",
        "invalidate_owner (a buffer's drop) leaves its entries in use linked",
    ),
    (
        "lease-release-no-notify",
        "the last memory lease to go does not wake the buffer waiting for it",
    ),
    (
        "budget-check-then-act",
        "a budget reservation checks the limit and counts itself under two locks",
    ),
    (
        "wake-skips-eventfd",
        "a wake (or progress elsewhere) does not write the eventfd although the leader is parked",
    ),
    (
        "park-skips-change-check",
        "a leader parks without looking whether anything changed since it last looked at its wait",
    ),
    (
        "park-skips-arm",
        "a leader parks without arming the CQs' completion channels",
    ),
    (
        "arm-without-poll",
        "a leader arms the CQs and parks without polling them once more",
    ),
    (
        "watch-skipped",
        "a thread waiting on the reactor is not counted among its watchers, so progress by \
         another thread tells nobody",
    ),
    (
        "progressed-skips-leader",
        "progress that handled something tells only the followers, not a leader about to park",
    ),
    (
        "followers-not-told",
        "a wake or progress does not move the generation for the followers asleep",
    ),
    (
        "follower-counted-late",
        "a follower counts itself after looking at its wait, not before",
    ),
    (
        "leader-leaves-silently",
        "a leader leaving does not move the generation nor wake the followers",
    ),
    (
        "lead-taken-twice",
        "a waiter takes the lead although another leads",
    ),
    (
        "nudge-skips-wake",
        "a nudge tells the followers but does not wake a parked leader",
    ),
    (
        "pass-clears-late",
        "the engine's pass clears what is due after it looked at the peers, not before",
    ),
    (
        "settle-skips-due",
        "a peer's step under its lock alone leaves queue-pair actions without making the pass due",
    ),
    (
        "deadline-check-then-store",
        "a deadline handed to the pass is checked against the earliest and stored over it, \
         not merged with it",
    ),
    (
        "pass-skips-marked",
        "the engine's pass takes the lock of peers with work only, not of those whose deadline \
         passed",
    ),
    (
        "pass-clears-with-store",
        "the engine's pass clears what is due with plain stores, which synchronize with none of \
         the steps that made it due",
    ),
    (
        "settle-before-mark",
        "a peer's step under its lock alone makes the pass due before it publishes its mark",
    ),
    (
        "route-cache-ignores-version",
        "a polling thread keeps its copy of the routes across a change of the routes",
    ),
    (
        "driver-asleep-not-counted",
        "a driver waiting for the lead a waiter took sleeps uncounted, so the waiter leaving \
         does not wake it",
    ),
    (
        "leader-parks-beside-a-displaced-driver",
        "a leader parks without waiting for the driver it displaced to leave its park",
    ),
    (
        "step-back-not-told",
        "a displaced driver steps back without waking the leader waiting for that",
    ),
];

/// Whether mutant `name` is active: never, outside loom.
#[cfg(not(loom))]
#[inline(always)]
pub(crate) const fn active(_name: &str) -> bool {
    false
}

/// Whether mutant `name` is active: `GDR_MUTANT` names it.
#[cfg(loom)]
pub(crate) fn active(name: &str) -> bool {
    debug_assert!(
        MUTANTS.iter().any(|&(known, _)| known == name),
        "hook for an unlisted mutant {name:?}"
    );
    chosen() == Some(name)
}

/// The mutant `GDR_MUTANT` names, read once (and checked against
/// [`MUTANTS`]).
#[cfg(loom)]
pub(crate) fn chosen() -> Option<&'static str> {
    static CHOSEN: std::sync::OnceLock<Option<&'static str>> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let name = std::env::var("GDR_MUTANT").ok().filter(|n| !n.is_empty())?;
        match MUTANTS.iter().find(|&&(known, _)| known == name) {
            Some(&(known, _)) => Some(known),
            None => {
                eprintln!("GDR_MUTANT={name:?} names no mutant; known: {MUTANTS:#?}");
                std::process::exit(2);
            }
        }
    })
}
