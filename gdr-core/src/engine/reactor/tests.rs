//! The reactor against a scripted engine: what wakes a park, what a
//! follower is told, and that an idle leader parks instead of spinning.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::*;

/// Far longer than any wake-up takes: a wait that runs into it failed.
const LONG: Duration = Duration::from_secs(20);

/// An engine whose work is scripted: `work` is what the next progress
/// handles; `fd` is an eventfd it parks on (a completion channel).
struct Scripted {
    work: AtomicUsize,
    progress_calls: AtomicUsize,
    arms: AtomicUsize,
    drains: AtomicUsize,
    polls: AtomicBool,
    deadline: Mutex<Option<Instant>>,
    fd: WakeFd,
    /// Set by progress that handled work: what a batch's end looks like.
    ended: AtomicUsize,
    /// At the next arm (the leader about to park), hand over work that
    /// only polling sees, with a wake: the race a park must not lose.
    hand_over_at_arm: AtomicBool,
    /// At the next arm, another thread's progress has just taken a
    /// completion and ended a batch (no fd will say so): the other race.
    end_elsewhere_at_arm: AtomicBool,
    /// How long each progress round takes (a dear one: the simulated
    /// fabric's, a debug build's, a contended lock's).
    round_cost: Mutex<Duration>,
    reactor: Arc<Reactor>,
}

impl Scripted {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            work: AtomicUsize::new(0),
            progress_calls: AtomicUsize::new(0),
            arms: AtomicUsize::new(0),
            drains: AtomicUsize::new(0),
            polls: AtomicBool::new(false),
            deadline: Mutex::new(None),
            fd: WakeFd::new().unwrap(),
            ended: AtomicUsize::new(0),
            hand_over_at_arm: AtomicBool::new(false),
            end_elsewhere_at_arm: AtomicBool::new(false),
            round_cost: Mutex::new(Duration::ZERO),
            reactor: Arc::new(Reactor::new().unwrap()),
        })
    }

    /// Work arrives as a completion would: handled by the next progress,
    /// announced on the fd.
    fn complete(&self, n: usize) {
        self.work.fetch_add(n, Ordering::SeqCst);
        self.fd.signal();
    }
}

impl Parkable for Scripted {
    fn progress(&self) -> usize {
        self.progress_calls.fetch_add(1, Ordering::SeqCst);
        let cost = *lock(&self.round_cost);
        if !cost.is_zero() {
            std::thread::sleep(cost);
        }
        let handled = self.work.swap(0, Ordering::SeqCst);
        if handled > 0 {
            self.ended.fetch_add(handled, Ordering::SeqCst);
            self.reactor.progressed();
        }
        handled
    }

    fn polls(&self) -> bool {
        self.polls.load(Ordering::SeqCst)
    }

    fn arm(&self) {
        self.arms.fetch_add(1, Ordering::SeqCst);
        if self.hand_over_at_arm.swap(false, Ordering::SeqCst) {
            self.polls.store(true, Ordering::SeqCst);
            self.reactor.wake();
        }
        if self.end_elsewhere_at_arm.swap(false, Ordering::SeqCst) {
            self.ended.fetch_add(1, Ordering::SeqCst);
            self.reactor.progressed();
        }
    }

    fn park_set(&self, fds: &mut Vec<RawFd>) -> Option<Instant> {
        fds.push(self.fd.fd());
        *lock(&self.deadline)
    }

    fn drain(&self) {
        self.drains.fetch_add(1, Ordering::SeqCst);
        self.fd.clear();
    }

    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// Waits on `engine` until `ended` reaches `want`, from another thread;
/// `true` when the wait ended that way long before its deadline (a wait
/// that slept to its deadline missed the wake-up it was owed).
fn waiter(engine: &Arc<Scripted>, want: usize) -> std::thread::JoinHandle<bool> {
    waiter_for(engine, want, LONG)
}

fn waiter_for(
    engine: &Arc<Scripted>,
    want: usize,
    patience: Duration,
) -> std::thread::JoinHandle<bool> {
    let engine = Arc::clone(engine);
    std::thread::spawn(move || {
        let reactor = Arc::clone(&engine.reactor);
        let start = Instant::now();
        let ended = reactor.wait_until(&*engine, Some(start + patience), || {
            engine.ended.load(Ordering::SeqCst) >= want
        });
        ended && start.elapsed() < patience / 2
    })
}

/// Until the reactor's leader is parked (it armed and set `parked`).
fn until_parked(engine: &Scripted) {
    let start = Instant::now();
    while !(engine.reactor.parked.load(Ordering::SeqCst) && engine.arms.load(Ordering::SeqCst) > 0)
    {
        assert!(start.elapsed() < LONG, "the leader never parked");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Until a second waiter sleeps as a follower.
fn until_following(engine: &Scripted) {
    let start = Instant::now();
    while engine.reactor.followers.load(Ordering::SeqCst) == 0 {
        assert!(start.elapsed() < LONG, "the second waiter never followed");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_parked_leader_wakes_when_its_fd_turns_readable() {
    let engine = Scripted::new();
    let waiting = waiter(&engine, 1);
    until_parked(&engine);
    engine.complete(1);
    assert!(waiting.join().unwrap(), "the wait ended at its deadline");
    assert!(
        engine.drains.load(Ordering::SeqCst) >= 1,
        "the fd was drained"
    );
}

#[test]
fn a_parked_leader_wakes_for_work_handed_over() {
    let engine = Scripted::new();
    let waiting = waiter(&engine, 1);
    until_parked(&engine);
    // Work no fd announces: only `wake` tells the leader.
    engine.work.fetch_add(1, Ordering::SeqCst);
    engine.reactor.wake();
    assert!(waiting.join().unwrap(), "the wait ended at its deadline");
}

#[test]
fn an_idle_leader_parks_instead_of_spinning() {
    let engine = Scripted::new();
    let reactor = Arc::clone(&engine.reactor);
    let start = Instant::now();
    let ended = reactor.wait_until(&*engine, Some(start + Duration::from_millis(300)), || false);
    assert!(!ended);
    // A spinning leader makes millions of progress calls in 300 ms; one
    // that parks makes its spin's worth, once.
    let calls = engine.progress_calls.load(Ordering::SeqCst);
    assert!(
        calls < 10 * SPIN_ROUNDS as usize,
        "{calls} progress calls while idle"
    );
    assert!(engine.arms.load(Ordering::SeqCst) >= 1);
}

/// A spin is bounded by time as well as rounds: with rounds of 200 µs,
/// [`SPIN_ROUNDS`] of them took 40 ms of a core before the park (issue
/// 23: a loaded machine's other threads starved meanwhile).
#[test]
fn a_leader_whose_rounds_are_dear_parks_once_its_spin_time_is_up() {
    let engine = Scripted::new();
    *lock(&engine.round_cost) = Duration::from_micros(200);
    let waiting = waiter(&engine, 1);
    until_parked(&engine);
    let calls = engine.progress_calls.load(Ordering::SeqCst);
    engine.complete(1);
    assert!(waiting.join().unwrap(), "the wait ended at its deadline");
    // Rounds of 200 µs: SPIN_TIME is over after the first (and the
    // park's own poll after the arm).
    assert!(
        calls < SPIN_ROUNDS as usize / 4,
        "{calls} progress calls of 200 µs before the park"
    );
}

/// A follower's spin too: it sleeps once its spin time is up.
#[test]
fn a_follower_whose_rounds_are_dear_sleeps_once_its_spin_time_is_up() {
    let engine = Scripted::new();
    *lock(&engine.round_cost) = Duration::from_micros(200);
    let leading = waiter(&engine, 1);
    until_parked(&engine);
    let before = engine.progress_calls.load(Ordering::SeqCst);
    let following = waiter(&engine, 1);
    until_following(&engine);
    let calls = engine.progress_calls.load(Ordering::SeqCst) - before;
    engine.complete(1);
    assert!(leading.join().unwrap() && following.join().unwrap());
    assert!(
        calls < SPIN_ROUNDS as usize / 4,
        "{calls} progress calls of 200 µs before the follower slept"
    );
}

#[test]
fn a_park_ends_at_the_engines_own_deadline() {
    let engine = Scripted::new();
    // The engine's next deadline (a request's timeout) comes long before
    // the caller's: the park must end there so progress can fail it.
    *lock(&engine.deadline) = Some(Instant::now() + Duration::from_millis(50));
    let waiting = waiter(&engine, 1);
    until_parked(&engine);
    let parks_before = engine.arms.load(Ordering::SeqCst);
    let start = Instant::now();
    while engine.arms.load(Ordering::SeqCst) == parks_before {
        assert!(
            start.elapsed() < LONG,
            "the park outlived the engine's deadline"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    *lock(&engine.deadline) = None;
    engine.complete(1);
    assert!(waiting.join().unwrap());
}

#[test]
fn a_follower_is_told_when_the_leaders_progress_ends_its_batch() {
    let engine = Scripted::new();
    // The leader waits for two ends, the follower for one.
    let leader = waiter(&engine, 2);
    until_parked(&engine);
    let follower = waiter(&engine, 1);
    // The follower has gone to sleep on the condition variable.
    until_following(&engine);
    engine.complete(1);
    assert!(
        follower.join().unwrap(),
        "the follower slept to its deadline"
    );
    engine.complete(1);
    assert!(leader.join().unwrap());
}

#[test]
fn a_follower_takes_the_lead_when_the_leader_leaves() {
    let engine = Scripted::new();
    let leader = waiter(&engine, 1);
    until_parked(&engine);
    let follower = waiter(&engine, 2);
    until_following(&engine);
    engine.complete(1);
    assert!(leader.join().unwrap());
    // Now only the follower waits: it must be parked on the fd as leader,
    // or this completion is never seen.
    until_parked(&engine);
    engine.complete(1);
    assert!(follower.join().unwrap(), "nobody led after the leader left");
}

#[test]
fn a_nudge_ends_a_driving_wait() {
    let engine = Scripted::new();
    let (ended_tx, ended) = std::sync::mpsc::channel();
    {
        let engine = Arc::clone(&engine);
        std::thread::spawn(move || {
            let reactor = Arc::clone(&engine.reactor);
            let seen = reactor.nudges();
            let _ = ended_tx.send(reactor.wait_until(&*engine, None, || reactor.nudges() != seen));
        });
    }
    until_parked(&engine);
    engine.reactor.nudge();
    assert_eq!(
        ended.recv_timeout(LONG),
        Ok(true),
        "the nudge did not end the wait"
    );
}

#[test]
fn work_handed_over_as_the_leader_parks_is_not_lost() {
    let engine = Scripted::new();
    // Between the leader's look at the engine and its park, work arrives
    // that only polling sees, and the wake comes before `parked` is set.
    engine.hand_over_at_arm.store(true, Ordering::SeqCst);
    let waiting = waiter(&engine, 1);
    let start = Instant::now();
    while engine.hand_over_at_arm.load(Ordering::SeqCst) {
        assert!(start.elapsed() < LONG, "the leader never armed");
        std::thread::sleep(Duration::from_millis(1));
    }
    engine.work.fetch_add(1, Ordering::SeqCst);
    assert!(waiting.join().unwrap(), "the park lost the hand-over");
}

#[test]
fn a_batch_ended_by_another_threads_progress_as_the_leader_parks_is_not_lost() {
    let engine = Scripted::new();
    // Between the leader's look at its batch and its park, another thread's
    // progress takes the batch's completion and ends it: only that
    // progress can tell the leader.
    engine.end_elsewhere_at_arm.store(true, Ordering::SeqCst);
    let waiting = waiter(&engine, 1);
    assert!(
        waiting.join().unwrap(),
        "the leader parked on an ended batch"
    );
}

#[test]
fn work_only_polling_sees_bounds_the_park() {
    let engine = Scripted::new();
    engine.polls.store(true, Ordering::SeqCst);
    let waiting = waiter(&engine, 1);
    until_parked(&engine);
    // No fd, no wake: the work is found by polling again.
    engine.work.fetch_add(1, Ordering::SeqCst);
    assert!(
        waiting.join().unwrap(),
        "the park outlived the poll interval"
    );
}

#[test]
fn a_sleeping_follower_takes_the_lead_when_the_leader_gives_up() {
    let engine = Scripted::new();
    // The leader gives up at its own deadline, having made no progress:
    // only its leaving can wake the follower.
    let leader = waiter_for(&engine, 1, Duration::from_millis(300));
    until_parked(&engine);
    let follower = waiter(&engine, 1);
    until_following(&engine);
    assert!(!leader.join().unwrap(), "nothing ended the leader's wait");
    until_parked(&engine);
    engine.complete(1);
    assert!(follower.join().unwrap(), "nobody led after the leader left");
}

#[test]
fn a_done_that_takes_what_it_found_is_not_asked_again() {
    let engine = Scripted::new();
    let leader = waiter(&engine, 1);
    until_parked(&engine);
    // The follower's `done` takes a message from an inbox, as
    // `Peer::recv` does, and finds it at its second look (in the
    // follower's spin): asked again, it finds the inbox empty.
    let inbox = Arc::new(AtomicUsize::new(1));
    let follower = {
        let (engine, inbox) = (Arc::clone(&engine), Arc::clone(&inbox));
        std::thread::spawn(move || {
            let reactor = Arc::clone(&engine.reactor);
            let start = Instant::now();
            let mut looks = 0;
            let took = reactor.wait_until(&*engine, Some(start + LONG), || {
                looks += 1;
                looks >= 2
                    && inbox
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                        .is_ok()
            });
            took && start.elapsed() < LONG / 2
        })
    };
    assert!(follower.join().unwrap(), "the message taken was lost");
    engine.complete(1);
    assert!(leader.join().unwrap());
}

#[test]
fn a_deadline_added_while_the_leader_is_parked_bounds_its_park() {
    let engine = Scripted::new();
    let waiting = waiter(&engine, 1);
    until_parked(&engine);
    let parks_before = engine.arms.load(Ordering::SeqCst);
    // A batch submitted now, with a deadline the park did not know of: the
    // leader must wake and park again bounded by it (then, at it, once
    // more).
    let at = Instant::now() + Duration::from_millis(50);
    *lock(&engine.deadline) = Some(at);
    engine.reactor.deadline_added(at);
    let start = Instant::now();
    while engine.arms.load(Ordering::SeqCst) < parks_before + 2 {
        assert!(
            start.elapsed() < LONG,
            "the park never learnt of the new deadline"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    *lock(&engine.deadline) = None;
    engine.complete(1);
    assert!(waiting.join().unwrap());
}

/// A deadline after the park's own end does not wake the leader (it wakes
/// before that deadline anyway): a submit to a parked engine costs no
/// wake-up unless its deadline comes first.
#[test]
fn a_deadline_after_the_parks_end_does_not_wake_the_leader() {
    let engine = Scripted::new();
    // The park ends at the waiter's own deadline (`LONG`) at the latest.
    let waiting = waiter(&engine, 1);
    until_parked(&engine);
    let parks_before = engine.arms.load(Ordering::SeqCst);
    engine
        .reactor
        .deadline_added(Instant::now() + LONG + Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        engine.arms.load(Ordering::SeqCst),
        parks_before,
        "the leader was woken (and parked again) for a deadline after its park's end"
    );
    engine.complete(1);
    assert!(waiting.join().unwrap());
}

#[cfg(feature = "tokio")]
#[test]
fn a_task_waiting_for_the_lead_is_woken_when_it_is_given_back() {
    use std::task::Wake;
    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let engine = Scripted::new();
    let waiting = waiter(&engine, 1);
    until_parked(&engine);
    let woken = Arc::new(Count(AtomicUsize::new(0)));
    let waker = Waker::from(Arc::clone(&woken));
    assert!(engine.reactor.try_lead_or_wait(&waker).is_none());
    // Asked twice: registered once.
    assert!(engine.reactor.try_lead_or_wait(&waker).is_none());
    engine.complete(1);
    assert!(waiting.join().unwrap());
    assert_eq!(woken.0.load(Ordering::SeqCst), 1, "the task was not woken");
    let lead = engine.reactor.try_lead_or_wait(&waker);
    assert!(lead.is_some(), "the lead given back was not free");
    // A thread that comes while the task leads follows; the task's drop
    // of the lead lets it lead.
    let follower = waiter(&engine, 2);
    until_following(&engine);
    drop(lead);
    until_parked(&engine);
    engine.complete(1);
    assert!(follower.join().unwrap(), "nobody led after the task left");
}

#[test]
fn a_driver_takes_the_lead_back_after_a_waiter_took_it() {
    let engine = Scripted::new();
    let stop = Arc::new(AtomicBool::new(false));
    let driver = {
        let engine = Arc::clone(&engine);
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let reactor = Arc::clone(&engine.reactor);
            reactor.drive_until(&*engine, || stop.load(Ordering::SeqCst));
        })
    };
    until_parked(&engine);
    // The waiter takes the lead from the parked driver.
    engine.complete(1);
    let start = Instant::now();
    assert!(
        engine
            .reactor
            .wait_until(&*engine, Some(start + LONG), || engine
                .ended
                .load(Ordering::SeqCst)
                >= 1),
        "the waiter's work was not seen"
    );
    // Nobody waits now: only the driver, back in the lead, sees this.
    engine.complete(1);
    while engine.ended.load(Ordering::SeqCst) < 2 {
        assert!(start.elapsed() < LONG, "the driver did not take the lead back");
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::SeqCst);
    engine.reactor.nudge();
    driver.join().unwrap();
}
