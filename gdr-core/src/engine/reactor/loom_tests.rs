//! loom models of the reactor's lead / follow / park protocol, run with
//! the other models by `scripts/loom-mutants.sh`, which also runs each
//! against the mutants named in its table and requires them to fail.
//!
//! The engine is a fake with one CQ: completions are made by a thread of
//! the model (standing in for the NIC), and the completion channel (a
//! modelled fd, `sys_model.rs`) turns readable only for a completion after
//! it was armed, as verbs does. Every wait has no deadline, so a park
//! sleeps until an fd is readable: a wake-up lost is a thread that never
//! returns, which loom reports as a deadlock. Each model has two threads
//! and is explored without a preemption bound, but the two with a driver
//! (its loops and the waiter's make the whole space too big: millions of
//! interleavings), explored with at most [`BOUND`] preemptions.

use std::os::fd::RawFd;
use std::time::Instant;

use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use loom::thread;

use super::{Parkable, Reactor, WakeFd};
use crate::cache::loom_tests::explore;
use crate::sync::{Mutex, lock};

/// The preemption bound of the models with a driver (see
/// `explore_bounded`).
const BOUND: usize = 5;

/// The fake engine's completion queue.
#[derive(Default)]
struct Cq {
    /// Batches completed (bit `i`: batch `i`), for the next progress.
    completed: u32,
    /// The next completion makes the completion channel readable.
    armed: bool,
}

struct Fake {
    cq: Mutex<Cq>,
    channel: WakeFd,
    /// Batches progress ended (bit `i`: batch `i`). SeqCst, as what a wait
    /// looks at must be (or be under a lock the progress takes).
    ended: AtomicU32,
    /// Threads parked on the fds (from `park_set` to `drain`): one leader
    /// at most. Relaxed: counting must not order what the reactor does.
    parking: AtomicUsize,
    reactor: Reactor,
    start: Instant,
}

impl Fake {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            cq: Mutex::new(Cq::default()),
            channel: WakeFd::new().unwrap(),
            ended: AtomicU32::new(0),
            parking: AtomicUsize::new(0),
            reactor: Reactor::new().unwrap(),
            start: Instant::now(),
        })
    }

    /// The NIC completes `batch`.
    fn complete(&self, batch: u32) {
        let mut cq = lock(&self.cq);
        cq.completed |= 1 << batch;
        if std::mem::take(&mut cq.armed) {
            self.channel.signal();
        }
    }

    fn ended(&self, batch: u32) -> bool {
        self.ended.load(Ordering::SeqCst) & (1 << batch) != 0
    }

    /// Waits, with no deadline, until `done`.
    fn wait_until(&self, done: impl FnMut() -> bool) {
        assert!(self.reactor.wait_until(self, None, done));
    }

    fn wait_for(&self, batch: u32) {
        self.wait_until(|| self.ended(batch));
    }
}

impl Parkable for Fake {
    fn progress(&self) -> usize {
        let handled = {
            let mut cq = lock(&self.cq);
            let handled = std::mem::take(&mut cq.completed);
            if handled == 0 {
                return 0;
            }
            // Under the lock, as the engine ends batches under its own.
            self.ended.fetch_or(handled, Ordering::SeqCst);
            handled
        };
        self.reactor.progressed();
        handled.count_ones() as usize
    }

    fn polls(&self) -> bool {
        false
    }

    fn arm(&self) {
        lock(&self.cq).armed = true;
    }

    fn park_set(&self, fds: &mut Vec<RawFd>) -> Option<Instant> {
        assert_eq!(
            self.parking.fetch_add(1, Ordering::Relaxed),
            0,
            "two threads park on the engine's fds"
        );
        fds.push(self.channel.fd());
        None
    }

    fn drain(&self) {
        self.channel.clear();
        self.parking.fetch_sub(1, Ordering::Relaxed);
    }

    fn now(&self) -> Instant {
        self.start
    }
}

/// A second thread running `f` on the engine.
fn on_thread(engine: &Arc<Fake>, f: impl FnOnce(&Fake) + Send + 'static) -> thread::JoinHandle<()> {
    let engine = Arc::clone(engine);
    thread::spawn(move || f(&engine))
}

/// A thread hands the engine work no fd announces (a cancel) and wakes
/// it, while the only waiter leads and is about to park: the waiter sees
/// the work before it parks, or the wake reaches its park.
#[test]
fn a_wake_reaches_a_leader_about_to_park() {
    explore("a_wake_reaches_a_leader_about_to_park", || {
        let engine = Fake::new();
        let cancelled = Arc::new(AtomicBool::new(false));
        let canceller = {
            let cancelled = Arc::clone(&cancelled);
            on_thread(&engine, move |engine| {
                cancelled.store(true, Ordering::SeqCst);
                engine.reactor.wake();
            })
        };
        engine.wait_until(|| cancelled.load(Ordering::SeqCst));
        canceller.join().unwrap();
    });
}

/// The only waiter leads and parks while the NIC completes its batch: a
/// completion before the arm is found by the poll after it, one after it
/// makes the channel readable.
#[test]
fn a_completion_around_the_arm_is_not_lost() {
    explore("a_completion_around_the_arm_is_not_lost", || {
        let engine = Fake::new();
        let nic = on_thread(&engine, |engine| engine.complete(0));
        engine.wait_for(0);
        nic.join().unwrap();
    });
}

/// The waiter leads; its batch completes and another thread's progress
/// (a follower's spin, a caller of `Engine::progress`) takes the
/// completion and ends the batch after the leader looked at it: the
/// completion fires no event for the leader's park, so that progress must
/// tell the leader.
#[test]
fn a_leader_is_told_when_another_threads_progress_ends_its_batch() {
    explore(
        "a_leader_is_told_when_another_threads_progress_ends_its_batch",
        || {
            let engine = Fake::new();
            let other = on_thread(&engine, |engine| {
                engine.complete(0);
                engine.progress();
            });
            engine.wait_for(0);
            other.join().unwrap();
        },
    );
}

/// Batch 0 has completed; one thread waits for it, the other for the
/// first's return (told by a wake): whichever follows is told when the
/// leader's progress ends its wait.
#[test]
fn a_follower_is_told_when_the_leaders_progress_ends_its_batch() {
    explore(
        "a_follower_is_told_when_the_leaders_progress_ends_its_batch",
        || {
            let engine = Fake::new();
            engine.complete(0);
            let returned = Arc::new(AtomicBool::new(false));
            let first = {
                let returned = Arc::clone(&returned);
                on_thread(&engine, move |engine| {
                    engine.wait_for(0);
                    returned.store(true, Ordering::SeqCst);
                    engine.reactor.wake();
                })
            };
            engine.wait_until(|| returned.load(Ordering::SeqCst));
            first.join().unwrap();
        },
    );
}

/// Two waiters, each completing the other's batch (standing in for the
/// NIC): the waiter of batch 0 may lead and return while the other
/// follows, which must then take the lead to see batch 1 complete; and
/// they never park at once.
#[test]
fn a_follower_takes_the_lead_when_the_leader_leaves() {
    explore("a_follower_takes_the_lead_when_the_leader_leaves", || {
        let engine = Fake::new();
        let second = on_thread(&engine, |engine| {
            engine.complete(0);
            engine.wait_for(1);
        });
        engine.wait_for(0);
        engine.complete(1);
        second.join().unwrap();
    });
}

/// A driving thread (the engine's own, or `spawn_driver`'s) waits for the
/// next nudge: the nudge ends its wait, parked or not.
#[test]
fn a_nudge_ends_a_driving_wait() {
    explore("a_nudge_ends_a_driving_wait", || {
        let engine = Fake::new();
        let seen = engine.reactor.nudges();
        let driver = on_thread(&engine, move |engine| {
            engine.wait_until(|| engine.reactor.nudges() != seen);
        });
        engine.reactor.nudge();
        driver.join().unwrap();
    });
}

/// Runs `model` as [`explore`] does, with at most `bound` preemptions
/// per execution.
fn explore_bounded(name: &str, bound: usize, model: impl Fn() + Sync + Send + 'static) {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = std::sync::Arc::clone(&runs);
    let started = std::time::Instant::now();
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(bound);
    builder.check(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        model();
    });
    let runs = runs.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "loom: {name}: {runs} interleavings (at most {bound} preemptions) in {:.2?}",
        started.elapsed()
    );
    assert!(runs > 1, "{name}: loom explored a single interleaving");
}

/// A driver drives (leading, maybe parked) while a waiter waits for a
/// batch already complete: the waiter may take the lead from it. Once the
/// waiter has left, it hands the engine work no fd announces (a stop the
/// driver's wait ends on, with a wake): the driver, stepped back and
/// maybe asleep waiting for the lead, must have been told the lead is
/// free.
#[test]
fn a_driver_resumes_when_the_waiter_that_took_its_lead_leaves() {
    explore_bounded(
        "a_driver_resumes_when_the_waiter_that_took_its_lead_leaves",
        BOUND,
        || {
            let engine = Fake::new();
            let stop = Arc::new(AtomicBool::new(false));
            let driver = {
                let stop = Arc::clone(&stop);
                on_thread(&engine, move |engine| {
                    engine
                        .reactor
                        .drive_until(engine, || stop.load(Ordering::SeqCst));
                })
            };
            engine.complete(0);
            engine.wait_for(0);
            stop.store(true, Ordering::SeqCst);
            engine.reactor.wake();
            driver.join().unwrap();
        },
    );
}

/// A driver drives while a waiter waits for batch 0, which the NIC
/// completes only once the waiter is waiting (the driver's thread stands
/// in for it: its next look at its own wait completes the batch). A
/// waiter that took the lead from the driver and finds nothing parks, but
/// only once that driver (perhaps parked on the fds) has stepped back: two
/// never park at once, and the completion reaches the one park.
#[test]
fn a_waiter_parks_only_once_the_driver_it_displaced_stepped_back() {
    explore_bounded(
        "a_waiter_parks_only_once_the_driver_it_displaced_stepped_back",
        BOUND,
        || {
            let engine = Fake::new();
            let waiting = Arc::new(AtomicBool::new(false));
            let stop = Arc::new(AtomicBool::new(false));
            let driver = {
                let waiting = Arc::clone(&waiting);
                let stop = Arc::clone(&stop);
                on_thread(&engine, move |engine| {
                    let mut completed = false;
                    engine.reactor.drive_until(engine, || {
                        if !completed && waiting.load(Ordering::SeqCst) {
                            engine.complete(0);
                            completed = true;
                        }
                        stop.load(Ordering::SeqCst)
                    });
                })
            };
            waiting.store(true, Ordering::SeqCst);
            engine.wait_for(0);
            stop.store(true, Ordering::SeqCst);
            engine.reactor.nudge();
            driver.join().unwrap();
        },
    );
}
