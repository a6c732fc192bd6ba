//! The batch book-keeping driven step by step (ported from `gdr-core`'s
//! engine core: same scenarios, same assertions). A small harness plays
//! the driver: it carries out each [`Action::End`] and
//! [`Action::Release`] as it comes (a batch told twice fails the test) and
//! keeps the queue-pair actions for the test to see.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;

use super::*;

/// The tests' errors, shaped as `gdr-core`'s.
#[derive(Debug, Clone, PartialEq, Eq)]
enum E {
    RemoteAccess { vendor_err: u32 },
    WrFlush,
    Flushed { qp: u16, cause: String },
    Timeout { after: Duration },
    Local { what: String },
    Cancelled,
    PeerGone { reason: String },
}

#[derive(Debug, Clone)]
struct Req {
    wr_id: u64,
    signaled: bool,
    send: bool,
    len: u64,
}

/// A batch's outcome as its owner sees it.
#[derive(Debug, Clone, Default)]
struct Cell(Rc<RefCell<Option<Result<(), E>>>>);

impl Cell {
    fn outcome(&self) -> Option<Result<(), E>> {
        self.0.borrow().clone()
    }
    fn is_done(&self) -> bool {
        self.0.borrow().is_some()
    }
}

#[derive(Debug)]
struct T;

impl Requests for T {
    type Request = Req;
    type Error = E;
    type Notify = Cell;
    type Hold = Vec<Arc<u8>>;

    fn is_send(request: &Req) -> bool {
        request.send
    }
    fn len(request: &Req) -> u64 {
        request.len
    }
    fn number(request: &mut Req, wr_id: u64, signaled: bool) {
        request.wr_id = wr_id;
        request.signaled = signaled;
    }
    fn flushed(qp: u16, cause: &E) -> E {
        E::Flushed {
            qp,
            cause: format!("{cause:?}"),
        }
    }
    fn timeout(after: Duration) -> E {
        E::Timeout { after }
    }
    fn cancelled() -> E {
        E::Cancelled
    }
}

/// The queue-pair actions, as the tests compare them.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    StopQp(QpId),
    QpDrained(QpId),
}

/// [`Batches`] with a driver that tells and releases at once.
struct Core {
    inner: Batches<T>,
    steps: VecDeque<Step>,
}

impl Core {
    fn new() -> Self {
        Self {
            inner: Batches::new(),
            steps: VecDeque::new(),
        }
    }

    fn settle(&mut self) {
        while let Some(action) = self.inner.poll_action() {
            match action {
                Action::StopQp(qp) => self.steps.push_back(Step::StopQp(qp)),
                Action::QpDrained(qp) => self.steps.push_back(Step::QpDrained(qp)),
                Action::End {
                    outcome,
                    notify,
                    hold,
                    ..
                } => {
                    drop(hold);
                    let mut told = notify.0.borrow_mut();
                    assert!(told.is_none(), "a batch told twice: {told:?}, {outcome:?}");
                    *told = Some(outcome);
                }
                Action::Release { hold, .. } => drop(hold),
            }
        }
    }

    fn add_qp(&mut self, index: u16, limits: QpLimits) -> QpId {
        self.inner.add_qp(index, limits)
    }
    fn submit(
        &mut self,
        work: Vec<(QpId, Work<Req>)>,
        cell: Cell,
        deadline: Option<(Instant, Duration)>,
        hold: Vec<Arc<u8>>,
    ) -> BatchId {
        let id = self.inner.submit(work, cell, deadline, hold);
        self.settle();
        id
    }
    fn take_postable(&mut self, qp: QpId, out: &mut Vec<Req>) {
        self.inner.take_postable(qp, out);
    }
    fn has_postable(&self, qp: QpId) -> bool {
        self.inner.has_postable(qp)
    }
    fn on_completion(&mut self, qp: QpId, wr_id: u64, result: Result<(), E>) {
        self.inner.on_completion(qp, wr_id, result);
        self.settle();
    }
    fn post_failed(&mut self, qp: QpId, taken: usize, accepted: Option<usize>, error: E) {
        self.inner.post_failed(qp, taken, accepted, error);
        self.settle();
    }
    fn fail_qp(&mut self, qp: QpId, cause: E) {
        self.inner.fail_qp(qp, cause);
        self.settle();
    }
    fn give_up(&mut self, qp: QpId, cause: E) {
        self.inner.give_up(qp, cause);
        self.settle();
    }
    fn cancel(&mut self, batch: BatchId) {
        self.inner.cancel(batch);
        self.settle();
    }
    fn handle_timeout(&mut self, now: Instant) {
        self.inner.handle_timeout(now);
        self.settle();
    }
    fn next_deadline(&mut self) -> Option<Instant> {
        self.inner.next_deadline()
    }
    fn poll_action(&mut self) -> Option<Step> {
        self.steps.pop_front()
    }
    fn begin_reconnect(&mut self, qp: QpId) -> bool {
        self.inner.begin_reconnect(qp)
    }
    fn revive(&mut self, qp: QpId, limits: QpLimits) {
        self.inner.revive(qp, limits);
    }
    fn is_ready(&self, qp: QpId) -> bool {
        self.inner.is_ready(qp)
    }
    fn is_down(&self, qp: QpId) -> bool {
        self.inner.is_down(qp)
    }
    fn accepts_work(&self, qp: QpId) -> bool {
        self.inner.accepts_work(qp)
    }
    fn load(&self, qp: QpId) -> usize {
        self.inner.load(qp)
    }
    fn sends_in_flight(&self, qp: QpId) -> u32 {
        self.inner.sends_in_flight(qp)
    }
    fn batches_live(&self) -> usize {
        self.inner.batches_live()
    }
    fn counters(&self, qp: QpId) -> QpCounters {
        self.inner.counters(qp)
    }
    fn deadline_entries(&self) -> usize {
        self.inner.deadline_entries()
    }
}

const OK: Result<(), E> = Ok(());

fn remote_access(vendor_err: u32) -> Result<(), E> {
    Err(E::RemoteAccess { vendor_err })
}

fn flush() -> Result<(), E> {
    Err(E::WrFlush)
}

fn write(len: u32) -> Work<Req> {
    Work::new(Req {
        wr_id: 0,
        signaled: false,
        send: false,
        len: u64::from(len),
    })
}

fn send() -> Work<Req> {
    let mut work = write(8);
    work.request.send = true;
    work
}

fn limits(depth: u32, signal_every: u32) -> QpLimits {
    QpLimits {
        depth,
        send_limit: 2,
        signal_every,
    }
}

fn cell() -> Cell {
    Cell::default()
}
#[test]
fn selective_signalling_and_depth() {
    let mut core = Core::new();
    let qp = core.add_qp(0, limits(6, 4));
    let c = cell();
    core.submit(vec![(qp, write(10)); 8], c.clone(), None, vec![]);
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    assert_eq!(out.len(), 6, "depth bounds the post");
    let signaled: Vec<bool> = out.iter().map(|w| w.signaled).collect();
    assert_eq!(signaled, [false, false, false, true, false, true]);
    assert!(!core.has_postable(qp));
    // The 4th request's completion retires the first four.
    core.on_completion(qp, out[3].wr_id, OK);
    assert_eq!(core.load(qp), 4);
    core.take_postable(qp, &mut out);
    assert_eq!(out.len(), 2);
    assert!(out[1].signaled, "tail signaled");
    core.on_completion(qp, 6, OK);
    assert!(!c.is_done());
    core.on_completion(qp, out[1].wr_id, OK);
    assert_eq!(c.outcome(), Some(Ok(())));
    assert_eq!(core.batches_live(), 0);
    assert_eq!(core.counters(qp).doorbells, 2);
}

#[test]
fn an_error_fails_its_request_and_flushes_the_rest_of_its_qp_only() {
    let mut core = Core::new();
    let (a, b) = (core.add_qp(0, limits(8, 8)), core.add_qp(1, limits(8, 8)));
    let (first, second, other) = (cell(), cell(), cell());
    core.submit(
        vec![(a, write(1)), (a, write(1))],
        first.clone(),
        None,
        vec![],
    );
    core.submit(vec![(a, write(1))], second.clone(), None, vec![]);
    core.submit(vec![(b, write(1))], other.clone(), None, vec![]);
    let mut out = Vec::new();
    core.take_postable(a, &mut out);
    assert_eq!(out.len(), 3);
    // The second request fails remotely: the first succeeded before it.
    core.on_completion(a, 2, remote_access(7));
    assert!(matches!(
        first.outcome(),
        Some(Err(E::RemoteAccess { vendor_err: 7, .. }))
    ));
    assert!(!second.is_done(), "in flight: ends with its flush");
    core.on_completion(a, 3, flush());
    assert!(matches!(
        second.outcome(),
        Some(Err(E::Flushed { qp: 0, .. }))
    ));
    assert_eq!(core.poll_action(), Some(Step::QpDrained(a)));
    // The other queue pair is untouched.
    core.take_postable(b, &mut out);
    core.on_completion(b, out[0].wr_id, OK);
    assert_eq!(other.outcome(), Some(Ok(())));
    // New work for the failed queue pair is refused at once.
    let late = cell();
    core.submit(vec![(a, write(1))], late.clone(), None, vec![]);
    assert!(matches!(late.outcome(), Some(Err(E::RemoteAccess { .. }))));
}

#[test]
fn a_deadline_stops_the_qp_and_ends_after_the_flush() {
    let t0 = Instant::now();
    let mut core = Core::new();
    let qp = core.add_qp(0, limits(1, 1));
    let (slow, queued_behind) = (cell(), cell());
    let keep = Arc::new(5u8);
    core.submit(
        vec![(qp, write(1))],
        slow.clone(),
        Some((t0 + Duration::from_millis(10), Duration::from_millis(10))),
        vec![Arc::clone(&keep)],
    );
    core.submit(vec![(qp, write(1))], queued_behind.clone(), None, vec![]);
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    assert_eq!(core.next_deadline(), Some(t0 + Duration::from_millis(10)));
    core.handle_timeout(t0 + Duration::from_millis(9));
    assert_eq!(core.poll_action(), None);
    core.handle_timeout(t0 + Duration::from_millis(10));
    assert_eq!(core.poll_action(), Some(Step::StopQp(qp)));
    assert!(
        matches!(queued_behind.outcome(), Some(Err(E::Flushed { .. }))),
        "work queued behind it on the stopped QP fails"
    );
    assert!(!slow.is_done(), "not before the NIC gave the request back");
    assert_eq!(Arc::strong_count(&keep), 2);
    core.on_completion(qp, out[0].wr_id, flush());
    assert!(matches!(slow.outcome(), Some(Err(E::Timeout { .. }))));
    assert_eq!(Arc::strong_count(&keep), 1, "released once retired");
}

#[test]
fn a_deadline_whose_flush_never_comes_is_delivered_after_the_grace() {
    let t0 = Instant::now();
    let mut core = Core::new();
    let qp = core.add_qp(0, limits(4, 1));
    let c = cell();
    let keep = Arc::new(5u8);
    let t = Duration::from_millis(10);
    core.submit(
        vec![(qp, write(1))],
        c.clone(),
        Some((t0 + t, t)),
        vec![keep.clone()],
    );
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    core.handle_timeout(t0 + t);
    assert!(!c.is_done());
    core.handle_timeout(t0 + t + FLUSH_GRACE);
    assert!(matches!(c.outcome(), Some(Err(E::Timeout { .. }))));
    assert_eq!(Arc::strong_count(&keep), 2, "still held: the NIC has it");
    core.on_completion(qp, out[0].wr_id, flush());
    assert_eq!(Arc::strong_count(&keep), 1);
    assert!(matches!(c.outcome(), Some(Err(E::Timeout { .. }))));
}

#[test]
fn sends_wait_for_the_peers_receives_in_order() {
    let mut core = Core::new();
    let qp = core.add_qp(0, limits(8, 8));
    let c = cell();
    core.submit(
        vec![(qp, send()), (qp, send()), (qp, send()), (qp, write(1))],
        c.clone(),
        None,
        vec![],
    );
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    assert_eq!(out.len(), 2, "two receives posted at the peer");
    assert_eq!(core.sends_in_flight(qp), 2);
    core.on_completion(qp, out[0].wr_id, OK);
    core.take_postable(qp, &mut out);
    assert_eq!(out.len(), 2, "the third send, then the write behind it");
    core.on_completion(qp, out[1].wr_id, OK);
    assert_eq!(c.outcome(), Some(Ok(())));
    assert_eq!(core.sends_in_flight(qp), 0, "every credit came back");
}

#[test]
fn a_refused_post_fails_what_was_refused() {
    let mut core = Core::new();
    let qp = core.add_qp(0, limits(8, 1));
    let (a, b) = (cell(), cell());
    core.submit(vec![(qp, write(1))], a.clone(), None, vec![]);
    core.submit(vec![(qp, write(1))], b.clone(), None, vec![]);
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    core.post_failed(
        qp,
        2,
        Some(1),
        E::Local {
            what: "refused".into(),
        },
    );
    assert!(matches!(b.outcome(), Some(Err(E::Local { .. }))));
    assert!(!a.is_done());
    core.on_completion(qp, out[0].wr_id, OK);
    assert_eq!(a.outcome(), Some(Ok(())));
    assert_eq!(core.load(qp), 0);
    assert_eq!(core.poll_action(), None);
}

#[test]
fn a_refused_post_leaving_an_unsignaled_tail_stops_the_qp() {
    let mut core = Core::new();
    let qp = core.add_qp(0, limits(8, 8));
    let (a, b) = (cell(), cell());
    core.submit(vec![(qp, write(1))], a.clone(), None, vec![]);
    core.submit(vec![(qp, write(1))], b.clone(), None, vec![]);
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    let refused = E::Local {
        what: "refused".into(),
    };
    core.post_failed(qp, 2, Some(1), refused);
    assert!(matches!(b.outcome(), Some(Err(E::Local { .. }))));
    assert_eq!(core.poll_action(), Some(Step::StopQp(qp)));
    assert!(!a.is_done(), "ends with its flush");
    core.on_completion(qp, out[0].wr_id, flush());
    assert!(matches!(a.outcome(), Some(Err(E::Flushed { .. }))));
    assert_eq!(core.poll_action(), Some(Step::QpDrained(qp)));
}

#[test]
fn one_completion_retires_the_runs_of_several_batches() {
    let mut core = Core::new();
    let qp = core.add_qp(0, limits(16, 16));
    let (a, b, c) = (cell(), cell(), cell());
    core.submit(vec![(qp, write(1)); 3], a.clone(), None, vec![]);
    core.submit(vec![(qp, write(1)); 1], b.clone(), None, vec![]);
    core.submit(vec![(qp, write(1)); 2], c.clone(), None, vec![]);
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    assert_eq!(out.len(), 6);
    // The 5th (c's first) retires a and b whole, and half of c.
    core.on_completion(qp, out[4].wr_id, OK);
    assert_eq!((a.outcome(), b.outcome()), (Some(Ok(())), Some(Ok(()))));
    assert!(!c.is_done(), "one of c's requests is still in flight");
    assert_eq!(core.batches_live(), 1);
    core.on_completion(qp, out[5].wr_id, OK);
    assert_eq!(c.outcome(), Some(Ok(())));
    assert_eq!(core.batches_live(), 0);
}

#[test]
fn an_error_in_a_run_fails_its_batch_only_and_flushes_the_runs_behind() {
    let mut core = Core::new();
    let qp = core.add_qp(0, limits(16, 16));
    let (a, b, c) = (cell(), cell(), cell());
    core.submit(vec![(qp, write(1)); 2], a.clone(), None, vec![]);
    core.submit(vec![(qp, write(1)); 2], b.clone(), None, vec![]);
    core.submit(vec![(qp, write(1)); 2], c.clone(), None, vec![]);
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    // b's second request fails: a and b's first succeeded before it.
    core.on_completion(qp, out[3].wr_id, remote_access(3));
    assert_eq!(a.outcome(), Some(Ok(())));
    assert!(matches!(
        b.outcome(),
        Some(Err(E::RemoteAccess { vendor_err: 3, .. }))
    ));
    assert!(!c.is_done());
    core.on_completion(qp, out[5].wr_id, flush());
    assert!(matches!(c.outcome(), Some(Err(E::Flushed { .. }))));
    assert_eq!(core.batches_live(), 0);
    assert_eq!(core.load(qp), 0);
}

#[test]
fn a_stale_batch_id_names_no_batch() {
    let mut core = Core::new();
    let qp = core.add_qp(0, limits(4, 1));
    let (old, new) = (cell(), cell());
    let old_id = core.submit(vec![(qp, write(1))], old.clone(), None, vec![]);
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    core.on_completion(qp, out[0].wr_id, OK);
    assert_eq!(old.outcome(), Some(Ok(())));
    // The next batch takes the ended one's slot, under a new id.
    let new_id = core.submit(vec![(qp, write(1))], new.clone(), None, vec![]);
    assert_ne!(old_id, new_id);
    assert_eq!(old_id as u32, new_id as u32, "the slot is reused");
    core.cancel(old_id);
    let empty = core.submit(vec![], cell(), None, vec![]);
    core.cancel(empty);
    core.take_postable(qp, &mut out);
    core.on_completion(qp, out[0].wr_id, OK);
    assert_eq!(new.outcome(), Some(Ok(())), "not cancelled by a stale id");
}

#[test]
fn deadlines_of_mixed_timeouts_fire_in_time_order() {
    let t0 = Instant::now();
    let mut core = Core::new();
    let (a, b) = (core.add_qp(0, limits(4, 1)), core.add_qp(1, limits(4, 1)));
    let (long, short) = (cell(), cell());
    let (tl, ts) = (Duration::from_millis(50), Duration::from_millis(10));
    core.submit(
        vec![(a, write(1))],
        long.clone(),
        Some((t0 + tl, tl)),
        vec![],
    );
    core.submit(
        vec![(b, write(1))],
        short.clone(),
        Some((t0 + ts, ts)),
        vec![],
    );
    let mut out = Vec::new();
    core.take_postable(a, &mut out);
    core.take_postable(b, &mut out);
    assert_eq!(core.next_deadline(), Some(t0 + ts));
    core.handle_timeout(t0 + ts);
    assert_eq!(core.poll_action(), Some(Step::StopQp(b)));
    assert_eq!(core.poll_action(), None, "the long batch runs on");
    core.on_completion(b, out[0].wr_id, flush());
    assert!(matches!(
        short.outcome(),
        Some(Err(E::Timeout { after })) if after == ts
    ));
    assert_eq!(core.poll_action(), Some(Step::QpDrained(b)));
    assert!(core.is_ready(a));
    assert_eq!(core.next_deadline(), Some(t0 + tl));
    core.handle_timeout(t0 + tl);
    assert_eq!(core.poll_action(), Some(Step::StopQp(a)));
}

#[test]
fn ended_batches_leave_the_deadline_heap_bounded_and_live_deadlines_in_it() {
    let t0 = Instant::now();
    let mut core = Core::new();
    let (slow_qp, qp) = (core.add_qp(0, limits(4, 1)), core.add_qp(1, limits(4, 1)));
    let t = Duration::from_millis(10);
    let slow = cell();
    core.submit(
        vec![(slow_qp, write(1))],
        slow.clone(),
        Some((t0 + t, t)),
        vec![],
    );
    let mut out = Vec::new();
    core.take_postable(slow_qp, &mut out);
    let keep = Arc::new(0u8);
    for i in 0..1000u32 {
        let at = t0 + t + Duration::from_micros(u64::from(i));
        let c = cell();
        core.submit(
            vec![(qp, write(1))],
            c.clone(),
            Some((at, t)),
            vec![keep.clone()],
        );
        core.take_postable(qp, &mut out);
        core.on_completion(qp, out[0].wr_id, OK);
        assert_eq!(c.outcome(), Some(Ok(())));
        // Bounded by the batches live when it last grew (this one too).
        assert!(core.deadline_entries() <= 2 * (core.batches_live() + 1) + 64);
    }
    assert_eq!(Arc::strong_count(&keep), 1, "ended batches keep nothing");
    assert_eq!(core.next_deadline(), Some(t0 + t));
    core.handle_timeout(t0 + t + Duration::from_millis(5));
    assert_eq!(core.poll_action(), Some(Step::StopQp(slow_qp)));
    assert_eq!(core.poll_action(), None, "no ended batch times out");
    assert_eq!(core.next_deadline(), Some(t0 + t + FLUSH_GRACE));
}

#[test]
fn cancel_drops_queued_work_and_waits_for_what_is_posted() {
    let mut core = Core::new();
    let qp = core.add_qp(0, limits(1, 1));
    let c = cell();
    let id = core.submit(
        vec![(qp, write(1)), (qp, write(1))],
        c.clone(),
        None,
        vec![],
    );
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    core.cancel(id);
    assert!(!c.is_done());
    assert_eq!(core.load(qp), 1);
    core.on_completion(qp, out[0].wr_id, OK);
    assert_eq!(c.outcome(), Some(Err(E::Cancelled)));
}

/// A drained queue pair being re-established takes work and holds it
/// until it is revived (then posts it, signalling afresh) or given up
/// (then fails it with the cause); a failed one refuses work.
#[test]
fn a_reconnecting_qp_holds_work_until_revived_or_given_up() {
    let mut core = Core::new();
    let qp = core.add_qp(0, limits(8, 4));
    let mut out = Vec::new();
    let first = cell();
    core.submit(vec![(qp, write(10))], first.clone(), None, vec![]);
    core.take_postable(qp, &mut out);
    core.on_completion(qp, out[0].wr_id, remote_access(0));
    assert!(core.is_down(qp) && !core.accepts_work(qp));
    let refused = cell();
    core.submit(vec![(qp, write(10))], refused.clone(), None, vec![]);
    assert!(
        refused.outcome().is_some_and(|o| o.is_err()),
        "a failed QP refuses work"
    );
    assert!(core.begin_reconnect(qp));
    assert!(core.accepts_work(qp) && !core.is_ready(qp));
    let held = cell();
    core.submit(vec![(qp, write(10)); 3], held.clone(), None, vec![]);
    assert!(!core.has_postable(qp), "nothing posts while reconnecting");
    core.revive(qp, limits(8, 4));
    core.take_postable(qp, &mut out);
    assert_eq!(out.len(), 3);
    assert!(out[2].signaled);
    core.on_completion(qp, out[2].wr_id, OK);
    assert_eq!(held.outcome(), Some(Ok(())));
    // Fail it again, and give it up this time.
    let doomed = cell();
    core.submit(vec![(qp, write(10))], doomed.clone(), None, vec![]);
    core.fail_qp(qp, E::Cancelled);
    assert!(doomed.outcome().is_some_and(|o| o.is_err()));
    assert!(core.begin_reconnect(qp));
    let abandoned = cell();
    core.submit(vec![(qp, write(10))], abandoned.clone(), None, vec![]);
    let gone = E::PeerGone {
        reason: "test".into(),
    };
    core.give_up(qp, gone.clone());
    assert_eq!(abandoned.outcome(), Some(Err(gone)));
    assert!(core.is_down(qp));
}

/// A batch spread over two queue pairs fails on one: its outcome waits
/// for its request on the other (the NIC still has it), and so does the
/// release of what it holds.
#[test]
fn a_failure_waits_for_the_batchs_requests_on_other_queue_pairs() {
    let mut core = Core::new();
    let (a, b) = (core.add_qp(0, limits(8, 8)), core.add_qp(1, limits(8, 8)));
    let c = cell();
    let keep = Arc::new(1u8);
    core.submit(
        vec![(a, write(1)), (b, write(1))],
        c.clone(),
        None,
        vec![Arc::clone(&keep)],
    );
    let (mut on_a, mut on_b) = (Vec::new(), Vec::new());
    core.take_postable(a, &mut on_a);
    core.take_postable(b, &mut on_b);
    core.on_completion(a, on_a[0].wr_id, remote_access(4));
    assert!(!c.is_done(), "told while its request on b is in flight");
    assert_eq!(Arc::strong_count(&keep), 2, "held while the NIC has it");
    core.on_completion(b, on_b[0].wr_id, OK);
    assert_eq!(c.outcome(), Some(Err(E::RemoteAccess { vendor_err: 4 })));
    assert_eq!(Arc::strong_count(&keep), 1);
    assert_eq!(core.batches_live(), 0);
}
