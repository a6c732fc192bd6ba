//! The engine's one way of waiting: make progress while work comes, spin a
//! little, then park on what can bring more work until the protocol's next
//! deadline.
//!
//! What wakes a parked engine ([`Parkable::park_set`]): the completion
//! channels of its CQs (armed before parking, then polled once more, as
//! verbs requires: arm, then poll), each NIC's async-event fd, each queue
//! pair's connection-event fd, and the reactor's own eventfd, which
//! [`Reactor::wake`] writes for work no fd announces (a batch queued behind
//! a full queue pair, a cancel, a gate opened, a grant revoked), and
//! [`Reactor::progressed`] for progress another thread made (it may have
//! taken the completion the leader waits for, which then fires no event).
//! The park's
//! timeout is the earliest deadline the engine holds, on its
//! [`Clock`](super::Clock); while a path has work only polling sees (GPU
//! copies and stream events: CUDA has no fd) it is at most
//! [`GPU_POLL`].
//!
//! One thread at a time leads: it makes progress and parks on the fds.
//! Other waiters follow: they sleep on a condition variable until the
//! leader (or anyone calling [`Engine::progress`](super::Engine::progress))
//! has made progress, or the leader leaves, when one of them takes over.
//! So two threads never park on the same fds, and a waiter whose batch
//! another thread completed is told at once.
//!
//! A waiting thread takes the lead even from a driving thread (one that
//! only drives, [`Reactor::drive_until`]): the driver steps back at its
//! next look (after its round, or when its park ends) and waits, without
//! progress of its own, until the lead is given back. Otherwise a driver
//! parked when a request is submitted must wake first and then wake the
//! waiter (two wake-ups in turn, and two threads on one completion),
//! where a waiter that leads finds its completion itself. A leader that
//! must park while a displaced driver has not stepped back yet (it may
//! still be parked on the fds) wakes it and waits for it first.
//!
//! Three ways drive the reactor:
//! a caller's wait ([`Batch::wait`](super::Batch::wait)), one owned thread
//! ([`Engine::spawn_driver`](super::Engine::spawn_driver), and the
//! engine's own thread that serves peers' rendezvous), or an async task
//! (`Engine::drive_on_tokio`, feature `tokio`) that leads through fd
//! readiness; a `Future`'s poll only registers its waker while one of them
//! drives. The task is not a thread: it asks for the lead with a [`Waker`]
//! ([`Reactor::try_lead_or_wait`]), which the reactor wakes when the lead
//! is given back, and parks in two halves ([`Reactor::park_begin`], then
//! its own wait for readiness, then [`Reactor::park_end`]) with the same
//! handshake as a thread's park. Nothing here names a runtime.
//!
//! The spin before parking is the one policy ([`SPIN_ROUNDS`], at most
//! [`SPIN_TIME`]): a request posted back to back completes within a few
//! polls, which a park (two system calls and a wake-up) would delay. A
//! driver yields its core between rounds instead of spinning on it: on a
//! busy machine the waiter it drives for may share that core. While
//! a path has work only polling sees ([`Parkable::polls`]) the leader
//! yields ([`YIELD_ROUNDS`]) and then parks at most [`GPU_POLL`] at a
//! time.

use std::os::fd::RawFd;
use std::task::Waker;
use std::time::{Duration, Instant};

use crate::cache::mutant;
use crate::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use crate::sync::{Condvar, Mutex, MutexGuard, dekker_fence, lock, wait, wait_timeout};

// The eventfd and ppoll; loom cannot run system calls, and models them.
#[cfg_attr(loom, path = "reactor/sys_model.rs")]
mod sys;
use sys::{WakeFd, poll_readable};

/// Empty progress rounds a leader makes before it parks: about the time a
/// request posted back to back takes to complete on a NIC (a few µs), far
/// less than a park and its wake-up cost. (Under loom, none: the spin is a
/// latency policy, not a step of the protocol, and each round multiplies
/// what the models explore.)
pub(crate) const SPIN_ROUNDS: u32 = if cfg!(loom) { 0 } else { 200 };

/// The longest a spin lasts, whatever rounds are left: on a NIC a round
/// costs well under a microsecond and the rounds run out first; where a
/// round is dear (the simulated fabric, a debug build, a lock other
/// threads hold) 200 of them took milliseconds, and a spinning thread kept
/// the core the thread it waited for needed (on a loaded 2-core machine a
/// peer's control messages then went 2-3 times slower, issue 23).
pub(crate) const SPIN_TIME: Duration = Duration::from_micros(50);

/// Empty rounds, after the spin, in which a leader whose engine has work
/// only polling sees yields its core before it parks.
pub(crate) const YIELD_ROUNDS: u32 = 4096;

/// How long the lead a waiter took from a driver stays free before the
/// driver takes it again: a thread waiting back to back takes it again
/// within this (a submit, a few µs), and meets no driver on the engine's
/// locks. What needs the driver then is seen this much later at most.
pub(crate) const HANDBACK: Duration = Duration::from_micros(10);

/// The longest park while a path has work whose end only polling sees.
pub(crate) const GPU_POLL: Duration = Duration::from_micros(20);

/// What the reactor drives: the engine, as the reactor sees it (the
/// reactor names no engine type).
pub(crate) trait Parkable {
    /// One round of progress; how much it handled.
    fn progress(&self) -> usize;
    /// Whether work runs whose end only polling sees (GPU copies, stream
    /// events), or a CQ that cannot be armed.
    fn polls(&self) -> bool;
    /// Arms every CQ's completion channel for its next completion.
    fn arm(&self);
    /// Fills `fds` with what can wake a park (completion channels, async
    /// and connection fds) and says when the park must end at the latest
    /// (the engine's next deadline).
    fn park_set(&self, fds: &mut Vec<RawFd>) -> Option<Instant>;
    /// Takes what woke the park (acknowledges CQ events), so the fds are
    /// quiet again.
    fn drain(&self);
    /// Now, on the engine's clock.
    fn now(&self) -> Instant;
}

/// Who leads, and how far progress has come (for the followers).
#[derive(Debug, Default)]
struct Lead {
    leading: bool,
    /// The leader is a driving thread, which a waiter may displace.
    by_driver: bool,
    /// Counts leads taken: the current lead's token (never 0).
    token: u64,
    /// Driving threads asleep on `changed` until the lead is free.
    drivers_asleep: usize,
    /// A leader sleeps on `changed` until a displaced driver steps back.
    step_back_awaited: bool,
    /// Bumped after progress that handled something, and when the leader
    /// leaves.
    generation: u64,
    /// Tasks waiting for the lead ([`Reactor::try_lead_or_wait`]): woken
    /// when it is given back.
    waiting: Vec<Waker>,
}

/// What a leader does after a round of progress: the one policy of
/// spinning, yielding and parking ([`SPIN_ROUNDS`], [`YIELD_ROUNDS`]),
/// for a leading thread and an async leader alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Within the spin: look again at once.
    Spin,
    /// Past the spin, with work only polling sees: give the core away,
    /// then look again.
    Yield,
    /// Park; `polls`: work only polling sees runs (the park is bounded by
    /// [`GPU_POLL`]).
    Park { polls: bool },
}

/// Counts a leader's empty rounds for [`Next`], and times them.
#[derive(Debug, Default)]
pub(crate) struct Spin {
    empty: u32,
    /// When the first empty round of the spin ended.
    since: Option<Instant>,
}

impl Spin {
    /// A spin already over: the next empty round parks (or yields).
    fn over() -> Self {
        Self {
            empty: SPIN_ROUNDS,
            since: None,
        }
    }

    /// What to do after a round that handled `handled`; `polls` (the
    /// engine's [`Parkable::polls`]) is asked only once the spin is over.
    pub(crate) fn next(&mut self, handled: usize, polls: impl FnOnce() -> bool) -> Next {
        if handled > 0 {
            self.empty = 0;
            self.since = None;
            return Next::Spin;
        }
        self.empty = self.empty.saturating_add(1);
        if self.empty <= SPIN_ROUNDS {
            let since = *self.since.get_or_insert_with(Instant::now);
            if since.elapsed() < SPIN_TIME {
                return Next::Spin;
            }
            // Out of time: the spin is over, as if its rounds were.
            self.empty = SPIN_ROUNDS + 1;
        }
        self.since = None;
        let polls = polls();
        if polls && self.empty <= SPIN_ROUNDS + YIELD_ROUNDS {
            return Next::Yield;
        }
        if !polls {
            // After a park the leader spins again: what woke it is often
            // followed by more.
            self.empty = 0;
        }
        Next::Park { polls }
    }
}

/// The engine's waiting, shared by every thread that waits on it.
#[derive(Debug)]
pub(crate) struct Reactor {
    wake: WakeFd,
    /// Counts what may end a wait without an fd to say so (a wake, progress
    /// that handled something, by whichever thread): a leader parks only if
    /// it did not move since the leader last looked at its `done`.
    changes: AtomicUsize,
    /// The leader is parked (or about to be) on the fds.
    parked: AtomicBool,
    /// When the parked leader's park ends at the latest (`None`: not known
    /// yet, or no bound): a deadline added before it wakes the leader
    /// ([`Reactor::deadline_added`]), a later one need not.
    park_until: Mutex<Option<Instant>>,
    lead: Mutex<Lead>,
    changed: Condvar,
    /// Followers asleep on `changed`.
    followers: AtomicUsize,
    /// Counts [`Reactor::nudge`]s: a driving thread's wait ends at the
    /// next.
    nudges: AtomicUsize,
    /// `Lead::leading`, for a driver waiting for the lead without the lock.
    held: AtomicBool,
    /// The token of a driver's lead a waiter took over, until that driver
    /// steps back (0: none). Written under the lead's lock.
    displaced: AtomicU64,
    /// Threads and tasks that may wait on the reactor (in
    /// [`Reactor::wait_until`], [`Reactor::drive_until`], an async
    /// driver's lead): with none, progress tells nobody
    /// ([`Reactor::progressed`]) and writes no line every thread shares.
    watchers: AtomicUsize,
}

/// A thread or task counted among the reactor's watchers while this lives
/// ([`Reactor::watch`]).
pub(crate) struct Watching<'a>(&'a Reactor);

impl Drop for Watching<'_> {
    fn drop(&mut self) {
        if !mutant::active("watch-skipped") {
            self.0.watchers.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// How a lead ended.
enum Led {
    /// `done` said so (`true`) or the deadline passed (`false`).
    Done(bool),
    /// A waiter took the lead from this driver.
    SteppedBack,
}

impl Reactor {
    /// A reactor with its wake-up eventfd.
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Self {
            wake: WakeFd::new()?,
            changes: AtomicUsize::new(0),
            parked: AtomicBool::new(false),
            park_until: Mutex::new(None),
            lead: Mutex::new(Lead::default()),
            changed: Condvar::new(),
            followers: AtomicUsize::new(0),
            nudges: AtomicUsize::new(0),
            held: AtomicBool::new(false),
            displaced: AtomicU64::new(0),
            watchers: AtomicUsize::new(0),
        })
    }

    /// Tells the reactor the engine has work no fd announces (or a batch
    /// ended outside progress): a parked leader wakes, one about to park
    /// does not park, followers look again.
    pub(crate) fn wake(&self) {
        self.look_again();
    }

    /// A deadline `at` was added (a batch submitted to a NIC): a parked
    /// leader whose park ends later (or is not bounded) wakes, and parks
    /// again bounded by `at` too. A leader not parked reads the engine's
    /// deadlines when it parks ([`Parkable::park_set`]), after setting
    /// `parked` and clearing `park_until`: with this load after the
    /// deadline was recorded (under the engine's lock), either the park
    /// saw the deadline or this sees it parked, and then either the park's
    /// end or `None` (not known yet: wake).
    pub(crate) fn deadline_added(&self, at: Instant) {
        if self.parked.load(Ordering::SeqCst) {
            let until = *lock(&self.park_until);
            if until.is_none_or(|until| at < until) {
                self.wake.signal();
            }
        }
    }

    /// Ends the waits of the threads that drive the engine (they compare
    /// [`Reactor::nudges`]): a driver stopping, the engine closing.
    pub(crate) fn nudge(&self) {
        self.nudges.fetch_add(1, Ordering::SeqCst);
        if !mutant::active("nudge-skips-wake") {
            self.wake();
        }
        lock(&self.lead).generation += 1;
        self.changed.notify_all();
    }

    /// How many changes a wait may end on there have been (a leader reads
    /// it after its round of progress, and parks only if it did not move:
    /// [`Reactor::park_begin`]).
    pub(crate) fn changes(&self) -> usize {
        self.changes.load(Ordering::SeqCst)
    }

    /// How many nudges there have been.
    pub(crate) fn nudges(&self) -> usize {
        self.nudges.load(Ordering::SeqCst)
    }

    /// Counts the caller among the reactor's watchers until the guard
    /// goes: progress by any thread tells it (and ends its park) from now
    /// on. Taken before the caller's first look at what it waits for.
    pub(crate) fn watch(&self) -> Watching<'_> {
        if !mutant::active("watch-skipped") {
            self.watchers.fetch_add(1, Ordering::SeqCst);
        }
        dekker_fence();
        Watching(self)
    }

    /// Progress handled something: whoever waits looks at its batch
    /// again. The leader too: a follower's spin or a thread calling
    /// [`Engine::progress`](super::Engine::progress) may have taken the
    /// completion that ends the leader's batch, which then fires no event.
    pub(crate) fn progressed(&self) {
        // Dekker's pattern with `watch` (both sides fenced): either a
        // watcher counted itself before this, and is told, or its first
        // look comes after this progress and sees what it ended. With no
        // watcher (threads that only spin on their own batches), nothing
        // shared is written.
        dekker_fence();
        if self.watchers.load(Ordering::SeqCst) == 0 {
            return;
        }
        if mutant::active("progressed-skips-leader") {
            // The bug: only the followers are told (after the fence
            // `look_again` has).
            dekker_fence();
            self.tell_followers();
            return;
        }
        self.look_again();
    }

    /// Something changed that a wait may end on: a leader about to park
    /// does not park, a parked one wakes, followers look again.
    fn look_again(&self) {
        // With `parked` below, Dekker's pattern (both SeqCst): either the
        // leader sees `changes` move before it parks, or this sees `parked`
        // and writes the eventfd.
        self.changes.fetch_add(1, Ordering::SeqCst);
        dekker_fence();
        if self.parked.load(Ordering::SeqCst) && !mutant::active("wake-skips-eventfd") {
            self.wake.signal();
        }
        self.tell_followers();
    }

    /// Followers asleep look again (the generation moves).
    fn tell_followers(&self) {
        if self.followers.load(Ordering::SeqCst) > 0 && !mutant::active("followers-not-told") {
            lock(&self.lead).generation += 1;
            self.changed.notify_all();
        }
    }

    /// Waits, driving `engine`, until `done` says so (`true`) or
    /// `deadline` passes (`false`; `None`: no deadline). It leads if nobody
    /// does or a driving thread does (that one steps back).
    pub(crate) fn wait_until(
        &self,
        engine: &impl Parkable,
        deadline: Option<Instant>,
        done: impl FnMut() -> bool,
    ) -> bool {
        self.wait_as(engine, deadline, done, false)
    }

    /// Drives `engine` until `done` says so, as a thread that only
    /// drives (a driver): a waiter may take the lead from it, and it
    /// waits for the lead without making progress of its own.
    pub(crate) fn drive_until(&self, engine: &impl Parkable, done: impl FnMut() -> bool) {
        self.wait_as(engine, None, done, true);
    }

    fn wait_as(
        &self,
        engine: &impl Parkable,
        deadline: Option<Instant>,
        mut done: impl FnMut() -> bool,
        driving: bool,
    ) -> bool {
        // Counted before the first look at `done`.
        let _watching = self.watch();
        let mut fds = Vec::new();
        // A driver that waited for the lead while a waiter led parks at
        // once when it takes it back, without a spin: the spin is for
        // work back to back, which that waiter (or the next) makes itself
        // (and the driver's rounds would only compete with it).
        let mut spin = Spin::default();
        loop {
            if done() {
                return true;
            }
            if deadline.is_some_and(|d| engine.now() >= d) {
                return done();
            }
            match self.take_lead(driving) {
                Some(leading) => {
                    let next = if driving { Spin::over() } else { Spin::default() };
                    let spin = std::mem::replace(&mut spin, next);
                    let led =
                        self.lead_until(engine, deadline, &mut done, &mut fds, &leading, spin);
                    // (Given back, or, displaced, stepped back from.)
                    drop(leading);
                    match led {
                        Led::Done(finished) => return finished,
                        Led::SteppedBack => {}
                    }
                }
                None if driving => {
                    if self.await_lead(&mut done) {
                        return true;
                    }
                }
                None => {
                    // `done` may consume what it found (a message): once
                    // it said so, it is not asked again.
                    if self.follow(engine, deadline, &mut done) {
                        return true;
                    }
                }
            }
        }
    }

    /// Leads until `done` or `deadline`: progress, spin, park.
    // (Under loom there is no spin: `empty <= SPIN_ROUNDS` is `empty == 0`.)
    #[cfg_attr(loom, allow(clippy::absurd_extreme_comparisons))]
    fn lead_until(
        &self,
        engine: &impl Parkable,
        deadline: Option<Instant>,
        done: &mut impl FnMut() -> bool,
        fds: &mut Vec<RawFd>,
        leading: &Leading<'_>,
        mut spin: Spin,
    ) -> Led {
        let token = leading.token;
        loop {
            // A waiter took over: out of its way (its progress, its park).
            if self.displaced.load(Ordering::SeqCst) == token {
                return Led::SteppedBack;
            }
            // (Progress that handled something tells the followers.)
            let handled = engine.progress();
            // What changed before this, `done` sees; what changes after,
            // the park does.
            let looked = self.changes();
            if done() {
                return Led::Done(true);
            }
            let now = engine.now();
            if deadline.is_some_and(|d| now >= d) {
                return Led::Done(false);
            }
            match spin.next(handled, || engine.polls()) {
                // A driver's spin gives its core to a thread that shares it
                // (the waiter it drives for, on a busy machine).
                Next::Spin if leading.driving => std::thread::yield_now(),
                Next::Spin => std::hint::spin_loop(),
                Next::Yield => std::thread::yield_now(),
                Next::Park { .. }
                    if self.displaced.load(Ordering::SeqCst) != 0
                        && !mutant::active("leader-parks-beside-a-displaced-driver") =>
                {
                    self.await_step_back(token);
                }
                Next::Park { polls } => self.park(engine, deadline, now, polls, looked, token, fds),
            }
        }
    }

    /// Before a leader parks: a driver it (or an earlier waiter) displaced
    /// may still be parked on the fds; it is woken, and this waits until
    /// it stepped back. (Rare: only a wait longer than the spin parks.)
    fn await_step_back(&self, token: u64) {
        let mut lead = lock(&self.lead);
        let mut told = false;
        loop {
            // (A driver that waits here may be displaced meanwhile: then
            // it steps back itself.)
            let pending = self.displaced.load(Ordering::SeqCst);
            if pending == 0 || pending == token {
                return;
            }
            if !told {
                lead.step_back_awaited = true;
                self.wake.signal();
                told = true;
            }
            lead = wait(&self.changed, lead);
        }
    }

    /// Parks on the engine's fds until one is readable, something changes
    /// ([`Reactor::wake`], [`Reactor::progressed`]), or the earliest of
    /// `deadline` and the engine's own passes; at once if something changed
    /// since `looked` (the leader's last look at its `done`).
    #[allow(clippy::too_many_arguments)]
    fn park(
        &self,
        engine: &impl Parkable,
        deadline: Option<Instant>,
        now: Instant,
        polls: bool,
        looked: usize,
        token: u64,
        fds: &mut Vec<RawFd>,
    ) {
        let Some(until) = self.park_begin(engine, deadline, now, polls, looked, token, fds)
        else {
            return;
        };
        let timeout = until.map(|u| u.saturating_duration_since(now));
        let span = tracing::trace_span!("park", fds = fds.len(), ?timeout).entered();
        poll_readable(fds, timeout);
        drop(span);
        self.park_end(engine);
    }

    /// The first half of a park, up to the wait: arms the CQs, polls once
    /// more, says the leader is parked, and looks whether anything changed
    /// since `looked` (the leader's last look at its `done`, or for a
    /// task, at its last round). `None`: work came (a completion before
    /// the arm, or a change), or a displaced driver has not stepped back
    /// (this leader's own lead, `token`, displaced; or another's, which is
    /// woken): do not park (`parked` is cleared again).
    /// Otherwise `fds` holds what must wake the park (the engine's
    /// [`Parkable::park_set`], then the reactor's wake eventfd) and the
    /// park ends at the latest at the time returned (`None`: no bound), on
    /// the engine's clock. Whoever parks then waits for one of `fds` or
    /// that time, and calls [`Reactor::park_end`], always.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn park_begin(
        &self,
        engine: &impl Parkable,
        deadline: Option<Instant>,
        now: Instant,
        polls: bool,
        looked: usize,
        token: u64,
        fds: &mut Vec<RawFd>,
    ) -> Option<Option<Instant>> {
        if !mutant::active("park-skips-arm") {
            engine.arm();
        }
        // Arm, then poll: a completion that came before the arm fires
        // nothing.
        if !mutant::active("arm-without-poll") && engine.progress() > 0 {
            return None;
        }
        *lock(&self.park_until) = None;
        self.parked.store(true, Ordering::SeqCst);
        dekker_fence();
        if self.changes.load(Ordering::SeqCst) != looked
            && !mutant::active("park-skips-change-check")
        {
            self.parked.store(false, Ordering::SeqCst);
            return None;
        }
        // A displaced driver does not park again: it steps back. Nor does
        // a leader while a displaced driver may still be parked (a thread
        // waits for its step-back before it parks; a task comes here):
        // that driver is woken, and the park is tried again.
        let pending = self.displaced.load(Ordering::SeqCst);
        if pending != 0
            && (pending == token || !mutant::active("leader-parks-beside-a-displaced-driver"))
        {
            self.parked.store(false, Ordering::SeqCst);
            if pending != token {
                self.wake.signal();
            }
            return None;
        }
        fds.clear();
        let engine_wake = engine.park_set(fds);
        let polled = polls.then(|| now + GPU_POLL);
        let until = [deadline, engine_wake, polled].into_iter().flatten().min();
        *lock(&self.park_until) = until;
        fds.push(self.wake.fd());
        Some(until)
    }

    /// The second half of a park, after the wait: the leader is no longer
    /// parked, the wake eventfd is taken, and the engine's fds are
    /// drained.
    pub(crate) fn park_end(&self, engine: &impl Parkable) {
        self.unpark();
        engine.drain();
    }

    /// [`Reactor::park_end`]'s part that needs no engine (an async
    /// leader's park that ended with the engine closed, or was dropped).
    pub(crate) fn unpark(&self) {
        self.parked.store(false, Ordering::SeqCst);
        self.wake.clear();
    }

    /// Becomes the leader if nobody leads; a waiter (not `driving`) also
    /// if a driver leads, which is displaced: it steps back at its next
    /// look (`displaced`), with no wake-up needed before then.
    fn take_lead(&self, driving: bool) -> Option<Leading<'_>> {
        let mut lead = lock(&self.lead);
        if lead.leading && !mutant::active("lead-taken-twice") {
            // (One displaced at a time: it must see its own token.)
            if driving || !lead.by_driver || self.displaced.load(Ordering::SeqCst) != 0 {
                return None;
            }
            self.displaced.store(lead.token, Ordering::SeqCst);
        }
        lead.leading = true;
        lead.by_driver = driving;
        lead.token += 1;
        self.held.store(true, Ordering::SeqCst);
        Some(Leading {
            reactor: self,
            token: lead.token,
            driving,
        })
    }

    /// A driver waits for the lead (a waiter holds it, or another
    /// driver): it watches it for a spin's worth of time ([`SPIN_TIME`]),
    /// taking it once it has stayed free for [`HANDBACK`], then sleeps
    /// until it is given back or a nudge; `true`: `done` said so. It makes
    /// no progress: the leader does, and a waiter leading back to back
    /// would only meet it on the engine's locks.
    fn await_lead(&self, done: &mut impl FnMut() -> bool) -> bool {
        // (No spin under loom: a latency policy, not the protocol.)
        if SPIN_ROUNDS > 0 {
            let start = Instant::now();
            let mut free_since = None;
            loop {
                if done() {
                    return true;
                }
                let now = Instant::now();
                if self.held.load(Ordering::SeqCst) {
                    free_since = None;
                    if now.duration_since(start) >= SPIN_TIME {
                        break;
                    }
                } else if now.duration_since(*free_since.get_or_insert(now)) >= HANDBACK {
                    return false;
                }
                // (The leader may share this core.)
                std::thread::yield_now();
            }
        }
        let mut lead = lock(&self.lead);
        if !lead.leading {
            return false;
        }
        // A nudge moves the generation under this lock, after its count
        // `done` reads: either `done` sees it or the wait does.
        let seen = lead.generation;
        if done() {
            return true;
        }
        let counted = !mutant::active("driver-asleep-not-counted");
        if counted {
            lead.drivers_asleep += 1;
        }
        while lead.leading && lead.generation == seen {
            lead = wait(&self.changed, lead);
        }
        if counted {
            lead.drivers_asleep -= 1;
        }
        false
    }

    /// Becomes the leader if nobody leads (a lead that lives as long as
    /// the returned [`OwnedLead`], which holds the reactor); otherwise
    /// `waker` is woken when the lead is given back, and the caller asks
    /// again then. For a leader that is a task, not a thread.
    #[cfg(all(feature = "tokio", not(loom)))]
    pub(crate) fn try_lead_or_wait(
        self: &std::sync::Arc<Self>,
        waker: &Waker,
    ) -> Option<OwnedLead> {
        let mut lead = lock(&self.lead);
        if lead.leading {
            if !lead.waiting.iter().any(|w| w.will_wake(waker)) {
                lead.waiting.push(waker.clone());
            }
            return None;
        }
        lead.leading = true;
        lead.by_driver = false;
        lead.token += 1;
        self.held.store(true, Ordering::SeqCst);
        Some(OwnedLead {
            reactor: std::sync::Arc::clone(self),
        })
    }

    /// Leaves the lead `token`: a displaced driver's is another's now, it
    /// only steps back (a leader waiting for that is told); otherwise the
    /// lead is given back.
    fn leave(&self, token: u64) {
        let mut lead = lock(&self.lead);
        if self.displaced.load(Ordering::SeqCst) == token {
            self.displaced.store(0, Ordering::SeqCst);
            if std::mem::take(&mut lead.step_back_awaited) && !mutant::active("step-back-not-told")
            {
                drop(lead);
                self.changed.notify_all();
            }
            return;
        }
        self.give_back(lead);
    }

    /// Gives the lead back: followers and drivers asleep look again (one
    /// takes over), tasks waiting for it are woken. (The condvar is told
    /// only if anyone sleeps on it: a notify is a system call.)
    fn give_back(&self, mut lead: MutexGuard<'_, Lead>) {
        lead.leading = false;
        self.held.store(false, Ordering::SeqCst);
        if mutant::active("leader-leaves-silently") {
            return;
        }
        lead.generation += 1;
        // Followers count themselves under this lock.
        let asleep = self.followers.load(Ordering::SeqCst) > 0 || lead.drivers_asleep > 0;
        let waiting = std::mem::take(&mut lead.waiting);
        drop(lead);
        if asleep {
            self.changed.notify_all();
        }
        for waker in waiting {
            waker.wake();
        }
    }

    /// Sleeps until progress was made or the leader left (or `deadline`),
    /// unless `done` says so first (then `true`). It makes progress itself
    /// for a spin's worth of rounds ([`SPIN_ROUNDS`], at most
    /// [`SPIN_TIME`]) before it sleeps: a request waited on back to back
    /// ends within them, without the leader's wake-up and a hand-over.
    // (Under loom there is no spin: the spin's range is empty.)
    #[cfg_attr(loom, allow(clippy::reversed_empty_ranges))]
    fn follow(
        &self,
        engine: &impl Parkable,
        deadline: Option<Instant>,
        done: &mut impl FnMut() -> bool,
    ) -> bool {
        let spun = (SPIN_ROUNDS > 0).then(Instant::now);
        for _ in 0..SPIN_ROUNDS {
            if done() {
                return true;
            }
            if engine.progress() == 0 {
                std::hint::spin_loop();
            }
            if spun.is_some_and(|start| start.elapsed() >= SPIN_TIME) {
                break;
            }
        }
        let mut lead = lock(&self.lead);
        if !lead.leading {
            return false;
        }
        let seen = lead.generation;
        // Counted before looking (`look_again` counts followers after what
        // it announces): either this sees the batch ended, or the one who
        // ended it sees this follower and moves the generation.
        let counted_late = mutant::active("follower-counted-late");
        if !counted_late {
            self.followers.fetch_add(1, Ordering::SeqCst);
            dekker_fence();
        }
        let finished = done();
        if counted_late {
            self.followers.fetch_add(1, Ordering::SeqCst);
        }
        if finished {
            self.followers.fetch_sub(1, Ordering::SeqCst);
            return true;
        }
        while lead.leading && lead.generation == seen {
            lead = match deadline {
                None => wait(&self.changed, lead),
                Some(d) => {
                    let left = d.saturating_duration_since(engine.now());
                    if left.is_zero() {
                        break;
                    }
                    wait_timeout(&self.changed, lead, left)
                }
            };
        }
        self.followers.fetch_sub(1, Ordering::SeqCst);
        false
    }
}

/// The lead, given back (and a follower told) when dropped, or stepped
/// back from if a waiter displaced it.
struct Leading<'a> {
    reactor: &'a Reactor,
    token: u64,
    /// Held by a driving thread.
    driving: bool,
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        self.reactor.leave(self.token);
    }
}

/// The lead of a task ([`Reactor::try_lead_or_wait`]): given back when
/// dropped, wherever the task stops (its loop ended, or its runtime
/// dropped it mid-park: then `parked` is cleared too, so a `wake` no
/// longer writes the eventfd for a park nobody is in; what it left there
/// ends the next leader's first park at once, which is harmless).
#[cfg(all(feature = "tokio", not(loom)))]
#[derive(Debug)]
pub(crate) struct OwnedLead {
    reactor: std::sync::Arc<Reactor>,
}

#[cfg(all(feature = "tokio", not(loom)))]
impl Drop for OwnedLead {
    fn drop(&mut self) {
        self.reactor.parked.store(false, Ordering::SeqCst);
        self.reactor.give_back(lock(&self.reactor.lead));
    }
}

#[cfg(all(test, loom))]
mod loom_tests;
#[cfg(all(test, not(loom)))]
mod tests;
