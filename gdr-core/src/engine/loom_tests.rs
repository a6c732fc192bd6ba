//! loom models of the engine's races, run with the cache's
//! (`scripts/loom-mutants.sh`, which also runs each against the mutants
//! named in its doc and requires them to fail).
//!
//! The engine's core is single-threaded behind the engine's lock; what
//! races is who gets there first: the NIC's completion, the deadline, and
//! the thread waiting for the outcome.

use std::time::{Duration, Instant};

use loom::sync::{Arc, Mutex};
use loom::thread;

use hal_verbs::WcStatus;

use super::batches::{Core, QpLimits, Work, test_send, test_write};
use super::completion::CompletionCell;
use super::error::{TimedOut, TransferError};

fn write() -> Work {
    test_write(8)
}

/// A completion and a timeout race to set one outcome while a thread
/// waits: exactly one of them sets it, and the waiter sees that one.
/// Mutant: `complete-check-then-act` (both think they set it).
#[test]
fn a_completion_racing_a_timeout_and_a_waiter() {
    loom::model(|| {
        let cell = Arc::new(CompletionCell::new());
        let nic = {
            let cell = Arc::clone(&cell);
            thread::spawn(move || cell.complete(Ok(())))
        };
        let timer = {
            let cell = Arc::clone(&cell);
            thread::spawn(move || {
                cell.complete(Err(TransferError::Timeout(TimedOut {
                    after: Duration::from_secs(1),
                })))
            })
        };
        let seen = cell.wait(None).expect("waited without a bound");
        let (by_nic, by_timer) = (nic.join().unwrap(), timer.join().unwrap());
        assert!(
            by_nic ^ by_timer,
            "exactly one sets the outcome: {by_nic} {by_timer}"
        );
        assert_eq!(seen.is_ok(), by_nic, "the waiter sees the winner's outcome");
        assert_eq!(cell.outcome(), Some(seen), "and it never changes");
    });
}

/// A batch in flight on one queue pair; the NIC's completion and the
/// deadline race under the engine's lock, and a thread waits for the
/// outcome. Whatever the order, the outcome comes exactly once and only
/// when nothing of the batch is in flight any more (a timeout stops the
/// queue pair and waits for its flush), and the queue pair's credits all
/// come back. Mutant: `timeout-delivers-in-flight` (the deadline delivers
/// at once, while the NIC still holds the request).
#[test]
fn a_deadline_racing_the_completion_of_a_batch_in_flight() {
    loom::model(|| {
        let t0 = Instant::now();
        let timeout = Duration::from_millis(5);
        let core = Arc::new(Mutex::new(Core::for_tests()));
        // The core keeps its cells in std's Arc; their lock is loom's.
        let cell = std::sync::Arc::new(CompletionCell::new());
        let (qp, wr_ids) = {
            let mut core = core.lock().unwrap();
            let qp = core.add_qp(
                0,
                QpLimits {
                    depth: 2,
                    send_limit: 1,
                    signal_every: 2,
                },
            );
            core.submit(
                vec![(qp, write()), (qp, write())],
                std::sync::Arc::clone(&cell),
                Some((t0 + timeout, timeout)),
                vec![],
            );
            let mut out = Vec::new();
            core.take_postable(qp, &mut out);
            let ids: Vec<u64> = out.iter().map(|w| w.wr_id).collect();
            (qp, ids)
        };
        let nic = {
            let core = Arc::clone(&core);
            thread::spawn(move || {
                // The NIC reports the signaled tail: success, unless the
                // engine stopped the queue pair first (then: flushed).
                let mut core = core.lock().unwrap();
                let status = if core.is_ready(qp) {
                    WcStatus::SUCCESS
                } else {
                    WcStatus::WR_FLUSH_ERR
                };
                core.on_completion(qp, wr_ids[1], status, 0);
            })
        };
        let timer = {
            let core = Arc::clone(&core);
            thread::spawn(move || {
                core.lock().unwrap().handle_timeout(t0 + timeout);
            })
        };
        let outcome = cell.wait(None).expect("waited without a bound");
        {
            let core = core.lock().unwrap();
            assert_eq!(
                core.load(qp),
                0,
                "outcome {outcome:?} delivered while in flight"
            );
        }
        nic.join().unwrap();
        timer.join().unwrap();
        let core = core.lock().unwrap();
        assert_eq!(core.batches_live(), 0);
        assert_eq!(core.load(qp), 0, "every credit came back");
        assert_eq!(cell.outcome(), Some(outcome));
    });
}

/// Two threads send control messages on a queue pair whose peer keeps one
/// receive posted (one SEND credit) while the NIC completes them and the
/// engine posts what waits. Whatever the order: never more SENDs in flight
/// than the peer's receives, both messages go out and end, and every
/// credit comes back. Mutants: `send-limit-ignored` (two SENDs in flight
/// for one receive) and `send-credit-leak` (the second SEND never goes:
/// deadlock).
#[test]
fn sends_never_outrun_the_peers_receives_and_every_credit_comes_back() {
    use loom::sync::Condvar;
    use std::collections::VecDeque;

    struct Wire {
        core: Core,
        /// wr_ids posted and not yet completed, in order.
        posted: VecDeque<u64>,
    }

    fn post(wire: &mut Wire, qp: usize) {
        let mut out = Vec::new();
        wire.core.take_postable(qp, &mut out);
        wire.posted.extend(out.iter().map(|w| w.wr_id));
        assert!(
            wire.core.sends_in_flight(qp) <= 1,
            "{} SENDs in flight for one receive",
            wire.core.sends_in_flight(qp)
        );
    }

    loom::model(|| {
        let mut core = Core::for_tests();
        let qp = core.add_qp(
            0,
            QpLimits {
                depth: 4,
                send_limit: 1,
                signal_every: 1,
            },
        );
        let shared = Arc::new((
            Mutex::new(Wire {
                core,
                posted: VecDeque::new(),
            }),
            Condvar::new(),
        ));
        let senders: Vec<_> = (0..2)
            .map(|_| {
                let shared = Arc::clone(&shared);
                thread::spawn(move || {
                    let cell = std::sync::Arc::new(CompletionCell::new());
                    let (wire, posted) = &*shared;
                    let mut wire = wire.lock().unwrap();
                    wire.core.submit(
                        vec![(qp, test_send(8))],
                        std::sync::Arc::clone(&cell),
                        None,
                        vec![],
                    );
                    post(&mut wire, qp);
                    posted.notify_all();
                    cell
                })
            })
            .collect();
        let nic = {
            let shared = Arc::clone(&shared);
            thread::spawn(move || {
                let (wire, posted) = &*shared;
                let mut wire = wire.lock().unwrap();
                for _ in 0..2 {
                    while wire.posted.is_empty() {
                        wire = posted.wait(wire).unwrap();
                    }
                    let wr_id = wire.posted.pop_front().expect("one is posted");
                    wire.core.on_completion(qp, wr_id, WcStatus::SUCCESS, 0);
                    // The engine's post pass after completions.
                    post(&mut wire, qp);
                }
            })
        };
        let cells: Vec<_> = senders.into_iter().map(|s| s.join().unwrap()).collect();
        nic.join().unwrap();
        for cell in cells {
            assert_eq!(cell.outcome(), Some(Ok(())), "each message went out");
        }
        let wire = shared.0.lock().unwrap();
        assert_eq!(wire.core.sends_in_flight(qp), 0, "every credit came back");
        assert_eq!(wire.core.load(qp), 0);
    });
}
