//! loom models of the hand-off between a peer's steps (under the peer's
//! lock alone) and the engine (its pass, its routes), run with the other
//! models by `scripts/loom-mutants.sh`, which also runs each against the
//! mutants named in its table and requires them to fail.
//!
//! [`PassDue`], [`Routes`] and [`RouteCache`] are the engine's own; a
//! peer's slot is its core of batches under a lock of the model's (the
//! engine's also holds the peer's connection), and the pass looks at the
//! cores only (the engine's also looks at paths and events). Each model is
//! explored without a preemption bound.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use loom::sync::Arc;
use loom::thread;

use hal_verbs::WcStatus;

use super::super::batches::{Action, Core, QpId, QpLimits, test_write};
use super::super::completion::CompletionCell;
use super::{Looked, Mark, PassDue, PeerMark, Route, RouteCache, Routes};
use crate::cache::loom_tests::explore;
use crate::sync::{Condvar, Mutex, lock};

const TIMEOUT: Duration = Duration::from_millis(5);

fn limits() -> QpLimits {
    QpLimits {
        depth: 2,
        send_limit: 1,
        signal_every: 1,
    }
}

/// Submits one WRITE on `qp` with a deadline `timeout` after `t0` and
/// posts it; returns its wr_id.
fn submit(core: &mut Core, qp: QpId, t0: Instant, timeout: Duration) -> u64 {
    let cell = std::sync::Arc::new(CompletionCell::new());
    core.submit(
        vec![(qp, test_write(8))],
        cell,
        Some((t0 + timeout, timeout)),
        vec![],
    );
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    out[0].wr_id
}

/// The engine's pass over the peers' cores: deadlines handled and
/// queue-pair actions taken (returned), each peer under its lock, as
/// `Engine::look` does; it leaves the earliest deadline due.
fn pass(due: &PassDue, peers: &[&Mutex<Core>], now: Instant) -> Vec<Action> {
    due.pass(|| {
        let mut taken = Vec::new();
        let mut at: Option<Instant> = None;
        for peer in peers {
            let mut core = lock(peer);
            core.handle_timeout(now);
            taken.extend(std::iter::from_fn(|| core.poll_action()));
            at = match (at, core.next_deadline()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        Looked {
            out: taken,
            again: false,
            at,
        }
    })
}

/// A peer's step under its lock left `core` as it is: the hand-off to
/// the pass, as `Engine::settle_slot` makes it.
fn settle(due: &PassDue, core: &mut Core) {
    due.settled(core.has_action(), core.next_deadline());
}

/// A queue pair the pass stopped at a deadline (its request in flight);
/// the NIC's completion of that request, routed to the peer, drains it:
/// a queue-pair action for the pass, made under the peer's lock alone
/// while the pass runs. Whatever the order, after both the pass took the
/// action or is due now (the next progress call makes it).
/// Mutants: `pass-clears-late` (the pass clears what the step set due
/// after it looked at the peer), `settle-skips-due` (the step does not
/// say it left work).
#[test]
fn a_peers_step_racing_the_pass_leaves_its_work_due() {
    explore("a_peers_step_racing_the_pass_leaves_its_work_due", || {
        let t0 = Instant::now();
        let due = Arc::new(PassDue::new(t0));
        let mut core = Core::for_tests();
        let qp = core.add_qp(0, limits());
        let wr_id = submit(&mut core, qp, t0, TIMEOUT);
        let peer = Arc::new(Mutex::new(core));
        // The pass that handled the deadline: it stopped the queue pair.
        let first = pass(&due, &[&peer], t0 + TIMEOUT);
        assert_eq!(first, [Action::StopQp(qp)]);
        let poller = {
            let (due, peer) = (Arc::clone(&due), Arc::clone(&peer));
            thread::spawn(move || {
                let mut core = lock(&peer);
                core.on_completion(qp, wr_id, WcStatus::SUCCESS, 0);
                settle(&due, &mut core);
            })
        };
        let taken = pass(&due, &[&peer], t0 + TIMEOUT);
        poller.join().unwrap();
        let left = lock(&peer).has_action();
        assert_eq!(
            taken.contains(&Action::QpDrained(qp)),
            !left,
            "the drain's action is taken once"
        );
        assert!(
            !left || due.is_due(t0, 1),
            "the queue pair's drain is left for a pass that is not due"
        );
    });
}

/// Two peers' submitters each queue a batch with a deadline (the second's
/// earlier), each under its peer's lock alone, while the pass runs. After
/// all three, the pass is due at the earliest deadline.
/// Mutants: `pass-clears-late` (the pass clears a deadline set after it
/// looked at that peer), `deadline-check-then-store` (a later deadline
/// overwrites an earlier one).
#[test]
fn a_deadline_set_while_the_pass_runs_is_kept() {
    explore("a_deadline_set_while_the_pass_runs_is_kept", || {
        let t0 = Instant::now();
        let due = Arc::new(PassDue::new(t0));
        let (mut a, mut b) = (Core::for_tests(), Core::for_tests());
        let qp = a.add_qp(0, limits());
        assert_eq!(b.add_qp(0, limits()), qp);
        let peers = [Arc::new(Mutex::new(a)), Arc::new(Mutex::new(b))];
        // A pass with nothing to do: nothing is due.
        pass(&due, &[&peers[0], &peers[1]], t0);
        assert!(!due.is_due(t0 + 2 * TIMEOUT, 1));
        let submitters: Vec<_> = [(0, 2 * TIMEOUT), (1, TIMEOUT)]
            .into_iter()
            .map(|(i, timeout)| {
                let (due, peer) = (Arc::clone(&due), Arc::clone(&peers[i]));
                thread::spawn(move || {
                    let mut core = lock(&peer);
                    submit(&mut core, qp, t0, timeout);
                    settle(&due, &mut core);
                })
            })
            .collect();
        pass(&due, &[&peers[0], &peers[1]], t0);
        for submitter in submitters {
            submitter.join().unwrap();
        }
        assert!(
            due.is_due(t0 + TIMEOUT, 1),
            "the pass is not due at the earliest deadline"
        );
    });
}

/// A peer as the engine keeps it for the pass that reads marks: its core
/// under its lock, and the mark its lock's holders publish.
struct Marked {
    core: Mutex<Core>,
    mark: PeerMark,
}

/// What `core` leaves for the pass, as `PeerSlot::mark` makes it.
fn mark_of(core: &mut Core) -> Mark {
    Mark {
        actions: core.has_action(),
        post: false,
        held: false,
        at: core.next_deadline(),
    }
}

/// The engine's pass as `Engine::look` makes it: only the peers whose
/// mark says work or a deadline past are locked (each publishing its
/// mark as its lock goes); the earliest deadline is read from the marks.
fn pass_marked(due: &PassDue, peers: &[&Marked], now: Instant) -> Vec<Action> {
    due.pass(|| {
        let mut taken = Vec::new();
        for peer in peers.iter().filter(|p| p.mark.is_due(now)) {
            let mut core = lock(&peer.core);
            core.handle_timeout(now);
            taken.extend(std::iter::from_fn(|| core.poll_action()));
            peer.mark.publish(mark_of(&mut core));
        }
        let at = peers.iter().filter_map(|p| p.mark.at()).min();
        Looked {
            out: taken,
            again: false,
            at,
        }
    })
}

/// A submitter leaves a batch with a deadline under its peer's lock alone
/// (publishing its mark, then telling the pass) while a pass at that
/// deadline runs, which locks only the peers whose mark says so. After
/// both, and one more pass if one is due, the deadline was handled (the
/// batch's queue pair stopped).
/// Mutants: `settle-before-mark` (the step makes the pass due before it
/// publishes: a pass in between skips the peer and the deadline is lost),
/// `pass-skips-marked` (the pass does not lock a peer whose deadline
/// passed).
#[test]
fn a_deadline_left_under_a_peers_lock_alone_is_handled_by_a_pass() {
    explore(
        "a_deadline_left_under_a_peers_lock_alone_is_handled_by_a_pass",
        || {
            let t0 = Instant::now();
            let due = Arc::new(PassDue::new(t0));
            let mut core = Core::for_tests();
            let qp = core.add_qp(0, limits());
            let peer = Arc::new(Marked {
                core: Mutex::new(core),
                mark: PeerMark::new(t0),
            });
            // A first pass found the new peer and nothing for it.
            assert!(pass_marked(&due, &[&peer], t0).is_empty());
            assert!(!due.is_due(t0 + TIMEOUT, 1));
            let submitter = {
                let (due, peer) = (Arc::clone(&due), Arc::clone(&peer));
                thread::spawn(move || {
                    let mut core = lock(&peer.core);
                    submit(&mut core, qp, t0, TIMEOUT);
                    let mark = mark_of(&mut core);
                    peer.mark.settle(&due, mark);
                })
            };
            let mut taken = pass_marked(&due, &[&peer], t0 + TIMEOUT);
            submitter.join().unwrap();
            if due.is_due(t0 + TIMEOUT, 1) {
                taken.extend(pass_marked(&due, &[&peer], t0 + TIMEOUT));
            }
            assert!(
                taken.contains(&Action::StopQp(qp)),
                "the batch's deadline was not handled"
            );
        },
    );
}

/// A peer's slot in the route model: its core and its queue pairs'
/// numbers (`None`: torn down), as the engine's `PeerSlot`.
struct Slot {
    core: Core,
    qps: Option<Vec<(u32, QpId)>>,
}

type SlotLock = Mutex<Slot>;

/// The NIC: its CQ of (queue pair number, wr_id), and a condvar for the
/// poller (which the model lets sleep instead of spin).
#[derive(Default)]
struct Nic {
    cq: Mutex<VecDeque<(u32, u64)>>,
    completed: Condvar,
}

/// The engine's id for the routes' copies.
const ENGINE: u64 = 1;

/// Queue pair 7 of the NIC is peer A's; a polling thread's copy of the
/// routes holds A's route. The engine tears A down and connects peer B,
/// whose queue pair the NIC numbers 7 again, and B submits a batch that
/// completes. The poller routes that completion: it goes to B (never to
/// A, whose slot stays), B's batch ends, and its credit comes back.
/// Mutant: `route-cache-ignores-version` (the copy outlives the change of
/// the routes: the completion goes to A and is dropped; B's waiter never
/// returns).
#[test]
fn a_queue_pair_number_reused_while_a_poller_holds_the_old_route() {
    explore(
        "a_queue_pair_number_reused_while_a_poller_holds_the_old_route",
        || {
            let routes = Arc::new(Routes::<SlotLock>::new());
            let nic = Arc::new(Nic::default());
            let a = {
                let mut core = Core::for_tests();
                let qp = core.add_qp(0, limits());
                std::sync::Arc::new(Mutex::new(Slot {
                    core,
                    qps: Some(vec![(7, qp)]),
                }))
            };
            routes.write().insert(
                (0, 7),
                Route {
                    lock: std::sync::Arc::clone(&a),
                    slot: 0,
                    index: 0,
                },
            );
            // The poller routed a completion of A's: its copy holds A.
            let mut cache = RouteCache::default();
            let route = cache.route(&routes, ENGINE, 0, 7).expect("A's route");
            assert!(std::sync::Arc::ptr_eq(&route.lock, &a));
            drop(route);

            let cell = std::sync::Arc::new(CompletionCell::new());
            let engine = {
                let (routes, nic, a) = (Arc::clone(&routes), Arc::clone(&nic), a.clone());
                let cell = std::sync::Arc::clone(&cell);
                thread::spawn(move || {
                    // A torn down: its slot stays (the engine's slots are
                    // never reused), empty.
                    lock(&a).qps = None;
                    routes.write().remove(&(0, 7));
                    // B connected: the NIC numbers its queue pair 7.
                    let mut core = Core::for_tests();
                    let qp = core.add_qp(0, limits());
                    let b = std::sync::Arc::new(Mutex::new(Slot {
                        core,
                        qps: Some(vec![(7, qp)]),
                    }));
                    routes.write().insert(
                        (0, 7),
                        Route {
                            lock: std::sync::Arc::clone(&b),
                            slot: 1,
                            index: 0,
                        },
                    );
                    // B submits and posts; the NIC completes the request.
                    let wr_id = {
                        let mut slot = lock(&b);
                        slot.core
                            .submit(vec![(qp, test_write(8))], cell, None, vec![]);
                        let mut out = Vec::new();
                        slot.core.take_postable(qp, &mut out);
                        out[0].wr_id
                    };
                    lock(&nic.cq).push_back((7, wr_id));
                    nic.completed.notify_all();
                    b
                })
            };
            let poller = {
                let (routes, nic) = (Arc::clone(&routes), Arc::clone(&nic));
                thread::spawn(move || {
                    let (qp_num, wr_id) = {
                        let mut cq = lock(&nic.cq);
                        loop {
                            match cq.pop_front() {
                                Some(wc) => break wc,
                                None => cq = crate::sync::wait(&nic.completed, cq),
                            }
                        }
                    };
                    // As `Engine::poll_completions` hands a run to its
                    // peer: under the peer's lock, if the queue pair at
                    // the route's index is still this one.
                    let Some(route) = cache.route(&routes, ENGINE, 0, qp_num) else {
                        return;
                    };
                    let mut slot = lock(&route.lock);
                    let Slot { core, qps } = &mut *slot;
                    if let Some(&(num, qp)) = qps.as_ref().and_then(|q| q.get(route.index))
                        && num == qp_num
                    {
                        core.on_completion(qp, wr_id, WcStatus::SUCCESS, 0);
                    }
                })
            };
            let outcome = cell.wait(None).expect("waited without a bound");
            assert_eq!(outcome, Ok(()), "B's batch ends with its completion");
            let b = engine.join().unwrap();
            poller.join().unwrap();
            let b = lock(&b);
            assert_eq!(b.core.load(0), 0, "B's credit came back");
            assert_eq!(b.core.batches_live(), 0);
            assert_eq!(lock(&a).core.batches_live(), 0, "nothing reached A");
        },
    );
}
