//! The hand-off between a peer's steps, made under the peer's lock alone,
//! and the rest of the engine (the module docs' "Locks"): when the
//! engine's pass is due ([`PassDue`]), which peers it looks at
//! ([`PeerMark`]), and where a completion polled
//! without the engine's lock goes ([`Routes`], each polling thread's copy
//! [`RouteCache`]). Kept apart from the engine so that the loom models
//! (`handoff::loom_tests`) check this code itself.

use std::collections::HashMap;
// std's `Arc`: a thread's copy of the routes holds peers weakly, and
// loom's `Arc` has no `Weak` (the lock inside is the shim's).
use std::sync::{Arc, Weak};
use std::time::Instant;

use crate::cache::mutant;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::{RwLock, RwLockWriteGuard};

/// When the engine's pass (under its lock) must run: the per-peer steps
/// that leave it work (queue-pair actions, a receive, an error) say so,
/// and the earliest deadline it holds is kept. A progress call with
/// nothing due polls the NICs and hands completions to their peers only,
/// without the engine's lock.
pub(super) struct PassDue {
    /// Work waits for the pass (set by anyone; cleared by the pass as it
    /// starts, set again at its end while paths or re-establishments run).
    now: AtomicBool,
    /// The earliest deadline the pass handles, as nanoseconds after
    /// `base` (`u64::MAX`: none).
    at: AtomicU64,
    base: Instant,
    /// Set when the pass is to look at connection and async events: at
    /// most every [`EVENTS_EVERY`], asked at a thread's 64th progress
    /// call. (Per thread and call alone, T threads made it T times as
    /// often, and each such pass took every peer's lock: the threads
    /// of one engine then waited on each other's peers.)
    events: AtomicBool,
    /// When connection and async events are next looked at, as
    /// nanoseconds of real time after `started` (the engine's clock may
    /// be a test's, standing still).
    events_at: AtomicU64,
    started: std::time::Instant,
}

/// How often a busy engine's pass looks at connection and async events
/// (a parked one wakes on their fds).
pub(super) const EVENTS_EVERY: std::time::Duration = std::time::Duration::from_millis(1);

/// When a thread spinning on its own peer's CQs also polls the engine's
/// other CQs (a sweep: what nobody spins on still moves): asked at the
/// thread's every [`HOME_ROUNDS`](super::HOME_ROUNDS)th call, granted to
/// one asker at most every [`SWEEP_EVERY`] of real time, engine wide.
/// (Per thread alone, T spinning threads swept T times as often, each
/// sweep taking the completions, and the locks, of peers whose own
/// threads were about to poll them: 9 % of 12 threads' time went to
/// waiting for those locks.)
pub(super) struct Sweeps {
    /// When the next sweep may run, as nanoseconds of real time after
    /// `started`.
    next: AtomicU64,
    started: Instant,
}

/// The least time between two sweeps of one engine's CQs.
pub(super) const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_micros(20);

impl Sweeps {
    pub(super) fn new() -> Self {
        Self {
            next: AtomicU64::new(0),
            started: Instant::now(),
        }
    }

    /// Whether this asker sweeps now (it then owns the interval).
    pub(super) fn take(&self) -> bool {
        let now = nanos_after(self.started, Instant::now());
        let next = self.next.load(Ordering::Relaxed);
        let after = now.saturating_add(SWEEP_EVERY.as_nanos() as u64);
        now >= next
            && self
                .next
                .compare_exchange(next, after, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

/// `at` as nanoseconds after `base` (saturating: `u64::MAX` is "none" to
/// the atomics that keep deadlines).
fn nanos_after(base: Instant, at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(base).as_nanos()).unwrap_or(u64::MAX)
}

/// What one pass looked at left: `out` for its caller, whether the next
/// progress call must make the pass again (`again`: a path's or a
/// re-establishment's steps are polled) and the earliest deadline it
/// holds (`at`).
pub(super) struct Looked<T> {
    pub(super) out: T,
    pub(super) again: bool,
    pub(super) at: Option<Instant>,
}

impl PassDue {
    pub(super) fn new(base: Instant) -> Self {
        Self {
            now: AtomicBool::new(true),
            at: AtomicU64::new(u64::MAX),
            base,
            events: AtomicBool::new(false),
            events_at: AtomicU64::new(0),
            started: std::time::Instant::now(),
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        nanos_after(self.base, at)
    }

    /// The instant deadlines are counted from (the peers' marks count
    /// from it too).
    pub(super) fn base(&self) -> Instant {
        self.base
    }

    /// A deadline the pass must handle by `at`.
    pub(super) fn by(&self, at: Instant) {
        let at = self.nanos(at);
        // Looked at first: a later deadline (the common case) writes
        // nothing every thread would then share.
        if at < self.at.load(Ordering::Acquire) {
            if mutant::active("deadline-check-then-store") {
                // The bug: a later deadline stored over an earlier one
                // stored since the check.
                self.at.store(at, Ordering::Release);
                return;
            }
            self.at.fetch_min(at, Ordering::AcqRel);
        }
    }

    /// Work waits for the pass now.
    pub(super) fn set(&self) {
        self.now.store(true, Ordering::Release);
    }

    /// A peer's step under its lock alone (a submit, a cancel, completions
    /// routed to it) left the pass queue-pair `actions` and the peer's
    /// earliest deadline `at`. Returns whether work is due now (the caller
    /// wakes a parked waiter, which makes the pass).
    pub(super) fn settled(&self, actions: bool, at: Option<Instant>) -> bool {
        let due = actions && !mutant::active("settle-skips-due");
        if due {
            self.set();
        }
        if let Some(at) = at {
            self.by(at);
        }
        due
    }

    /// Whether the pass is due at `now`; counts the call (`tick`: this
    /// thread's count, kept apart so that threads share no write; every
    /// 64th looks whether the events are due).
    pub(super) fn is_due(&self, now: Instant, tick: u64) -> bool {
        if tick.is_multiple_of(64) {
            let real = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let at = self.events_at.load(Ordering::Acquire);
            let next = real.saturating_add(EVENTS_EVERY.as_nanos() as u64);
            // One thread of those that see them due takes them.
            if real >= at
                && self
                    .events_at
                    .compare_exchange(at, next, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                self.events.store(true, Ordering::Release);
                return true;
            }
        }
        self.now.load(Ordering::Acquire) || self.at.load(Ordering::Acquire) <= self.nanos(now)
    }

    /// Whether the pass is to look at connection and async events (once
    /// for each time [`PassDue::is_due`] asked it to).
    pub(super) fn take_events(&self) -> bool {
        self.events.swap(false, Ordering::AcqRel)
    }

    /// The engine's pass, `look` (under the engine's lock): what was due
    /// is cleared before it looks, so work made due while it looks (by a
    /// peer's step under that peer's lock alone) stays due for the next
    /// pass; what it left (`Looked`) is due again.
    pub(super) fn pass<T>(&self, look: impl FnOnce() -> Looked<T>) -> T {
        let late = mutant::active("pass-clears-late");
        if !late {
            self.clear();
        }
        let looked = look();
        if late {
            // The bug: what was made due while the pass looked is lost.
            self.clear();
        }
        if looked.again {
            self.set();
        }
        if let Some(at) = looked.at {
            self.by(at);
        }
        looked.out
    }

    fn clear(&self) {
        if mutant::active("pass-clears-with-store") {
            // The bug: plain stores synchronize with no step, so the pass
            // may read a mark older than the due it cleared.
            self.now.store(false, Ordering::Release);
            self.at.store(u64::MAX, Ordering::Release);
            return;
        }
        // Read-modify-writes: the pass then sees what a step that made it
        // due published before (its peer's mark).
        self.now.swap(false, Ordering::AcqRel);
        self.at.swap(u64::MAX, Ordering::AcqRel);
    }
}

/// What a peer's steps left for the engine's pass, published under the
/// peer's lock as it goes ([`PeerMark::publish`]): the pass takes the lock
/// only of a peer with work for it or a deadline due, not every peer's at
/// every pass (each taken lock is one its own thread may be waiting on).
/// A step under the peer's lock alone publishes before it tells
/// [`PassDue`] (`settled`): a pass made due by it sees its mark.
pub(super) struct PeerMark {
    /// Work for the pass: queue-pair actions, requests or control messages
    /// to post.
    work: AtomicBool,
    /// A control message waits for a send slot or a receive of the peer
    /// (it goes only with progress, which someone must make).
    held: AtomicBool,
    /// The peer's earliest deadline, as nanoseconds after `base`
    /// (`u64::MAX`: none).
    at: AtomicU64,
    base: Instant,
}

/// What a peer leaves for the pass ([`PeerMark::publish`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Mark {
    /// Queue-pair actions: the pass is due now.
    pub(super) actions: bool,
    /// Requests or control messages to post (posted at the next pass).
    pub(super) post: bool,
    /// See [`PeerMark`]'s `held`.
    pub(super) held: bool,
    /// The earliest deadline.
    pub(super) at: Option<Instant>,
}

impl PeerMark {
    /// A new peer's: work for the first pass to look at.
    pub(super) fn new(base: Instant) -> Self {
        Self {
            work: AtomicBool::new(true),
            held: AtomicBool::new(false),
            at: AtomicU64::new(u64::MAX),
            base,
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        nanos_after(self.base, at)
    }

    /// Under the peer's lock: what its steps left. Each value is written
    /// only when it changed (the pass reads them from another thread).
    pub(super) fn publish(&self, mark: Mark) {
        let work = mark.actions || mark.post;
        if self.work.load(Ordering::Relaxed) != work {
            self.work.store(work, Ordering::Release);
        }
        if self.held.load(Ordering::Relaxed) != mark.held {
            self.held.store(mark.held, Ordering::Release);
        }
        let at = mark.at.map_or(u64::MAX, |at| self.nanos(at));
        if self.at.load(Ordering::Relaxed) != at {
            self.at.store(at, Ordering::Release);
        }
    }

    /// Under the peer's lock, after a step of the peer alone: publishes
    /// `mark`, then tells `due` ([`PassDue::settled`], whose answer it
    /// returns). In this order, a pass that the step made due sees the
    /// mark.
    pub(super) fn settle(&self, due: &PassDue, mark: Mark) -> bool {
        if mutant::active("settle-before-mark") {
            // The bug: a pass made due in between looks at the old mark.
            let now = due.settled(mark.actions, mark.at);
            self.publish(mark);
            return now;
        }
        self.publish(mark);
        due.settled(mark.actions, mark.at)
    }

    /// Whether the pass is to take the peer's lock at `now`: work, or a
    /// deadline past.
    pub(super) fn is_due(&self, now: Instant) -> bool {
        if mutant::active("pass-skips-marked") {
            // The bug: the pass looks only at peers with work, not at
            // those whose deadline passed.
            return self.work.load(Ordering::Acquire);
        }
        self.work.load(Ordering::Acquire) || self.at.load(Ordering::Acquire) <= self.nanos(now)
    }

    /// Whether a control message of the peer's waits on progress.
    pub(super) fn held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }

    /// The peer's earliest deadline, as published.
    pub(super) fn at(&self) -> Option<Instant> {
        match self.at.load(Ordering::Acquire) {
            u64::MAX => None,
            nanos => Some(self.base + std::time::Duration::from_nanos(nanos)),
        }
    }
}

/// Where a completion of one queue pair goes: its peer's slot (`lock`, the
/// peer's lock; `slot`, its number) and the queue pair's index there.
pub(super) struct Route<L> {
    pub(super) lock: Arc<L>,
    pub(super) slot: usize,
    pub(super) index: usize,
}

impl<L> Clone for Route<L> {
    fn clone(&self) -> Self {
        Self {
            lock: Arc::clone(&self.lock),
            slot: self.slot,
            index: self.index,
        }
    }
}

/// Each queue pair's route, by (NIC, queue pair number): completions go
/// to their peer without the engine's lock. Written under the engine's
/// lock; read alone, briefly.
pub(super) struct Routes<L> {
    table: RwLock<HashMap<(usize, u32), Route<L>>>,
    /// Moves at every change of `table` (after it): threads' copies of
    /// routes older than it are dropped.
    version: AtomicU64,
}

impl<L> Routes<L> {
    pub(super) fn new() -> Self {
        Self {
            table: RwLock::new(HashMap::new()),
            version: AtomicU64::new(0),
        }
    }

    /// The route of queue pair `qp_num` on NIC `nic`, from the table.
    pub(super) fn get(&self, nic: usize, qp_num: u32) -> Option<Route<L>> {
        crate::sync::read(&self.table).get(&(nic, qp_num)).cloned()
    }

    /// The routes, to change: the version moves as the lock goes.
    pub(super) fn write(&self) -> RoutesWrite<'_, L> {
        RoutesWrite {
            guard: crate::sync::write(&self.table),
            version: &self.version,
        }
    }
}

/// The routes, locked to be changed ([`Routes::write`]).
pub(super) struct RoutesWrite<'a, L> {
    guard: RwLockWriteGuard<'a, HashMap<(usize, u32), Route<L>>>,
    version: &'a AtomicU64,
}

impl<L> Drop for RoutesWrite<'_, L> {
    fn drop(&mut self) {
        // Before the lock goes: a thread that sees the old version either
        // read the table before this change or waits for it.
        self.version.fetch_add(1, Ordering::AcqRel);
    }
}

impl<L> std::ops::Deref for RoutesWrite<'_, L> {
    type Target = HashMap<(usize, u32), Route<L>>;
    fn deref(&self) -> &Self::Target {
        &self.guard
    }
}

impl<L> std::ops::DerefMut for RoutesWrite<'_, L> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.guard
    }
}

/// A polling thread's copy of the routes it looked up (reading the shared
/// table writes its lock, which every polling thread shares), of one
/// engine and one version of its routes, holding the peers weakly (a
/// thread's copy keeps no peer of a dropped engine).
pub(super) struct RouteCache<L> {
    routes: HashMap<(usize, u32), (Weak<L>, usize, usize)>,
    /// The engine (its id) and the routes' version the copy was read at.
    of: (u64, u64),
}

impl<L> Default for RouteCache<L> {
    fn default() -> Self {
        Self {
            routes: HashMap::new(),
            of: (0, 0),
        }
    }
}

/// Routes a thread keeps at most.
const CACHED_ROUTES: usize = 4096;

impl<L> RouteCache<L> {
    /// The route of queue pair `qp_num` on NIC `nic` of engine `engine`
    /// (`routes`): from the copy while the routes have not changed since
    /// it was made, else from the table.
    pub(super) fn route(
        &mut self,
        routes: &Routes<L>,
        engine: u64,
        nic: usize,
        qp_num: u32,
    ) -> Option<Route<L>> {
        let of = (engine, routes.version.load(Ordering::Acquire));
        // The bug: a copy kept across a change of the routes.
        let stale = match mutant::active("route-cache-ignores-version") {
            true => self.of.0 != of.0,
            false => self.of != of,
        };
        if stale {
            self.routes.clear();
        }
        self.of = of;
        if let Some((lock, slot, index)) = self.routes.get(&(nic, qp_num))
            && let Some(lock) = lock.upgrade()
        {
            return Some(Route {
                lock,
                slot: *slot,
                index: *index,
            });
        }
        let route = routes.get(nic, qp_num)?;
        if self.routes.len() < CACHED_ROUTES {
            let weak = Arc::downgrade(&route.lock);
            self.routes
                .insert((nic, qp_num), (weak, route.slot, route.index));
        }
        Some(route)
    }
}

#[cfg(all(test, not(loom)))]
mod sweep_tests {
    use super::*;

    /// One sweep per interval: a second ask at once is refused, one after
    /// the interval granted.
    #[test]
    fn one_sweep_per_interval() {
        let sweeps = Sweeps::new();
        assert!(sweeps.take(), "the first ask sweeps");
        assert!(!sweeps.take(), "a second sweep in one interval");
        std::thread::sleep(SWEEP_EVERY * 2);
        assert!(sweeps.take(), "no sweep once the interval passed");
        assert!(!sweeps.take(), "a second sweep in one interval");
    }
}

#[cfg(all(test, loom))]
mod loom_tests;
