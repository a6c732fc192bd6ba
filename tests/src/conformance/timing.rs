//! Transport timers: the ACK timeout with `retry_cnt`, and the RNR timer
//! with `rnr_retry`, checked against time as the backend keeps it (the
//! sim's virtual clock, held in Manual mode and advanced by the scenario;
//! real time on rxe, where [`Backend::advance`] sleeps).
//!
//! Each scenario computes the nominal deadline from the IBA formulas (ACK
//! timeout 4.096 µs × 2^code; the RNR timer table of `ibv_modify_qp(3)`),
//! rounded as the backend's timers are ([`TimingFacts::period`]), and
//! asserts nothing completes before it less the backend's early slack
//! ([`TimingFacts::early_per_period`] per period) and the error has come by
//! it plus [`TimingFacts::late`]. On the sim both slacks are zero: the
//! deadline is checked to the nanosecond. The timers are kept short
//! (ACK timeout code 12 ≈ 16.8 ms, RNR timer code 22 = 20.48 ms) so that
//! the real-time waits on rxe stay well under a second.

use std::time::{Duration, Instant};

use hal_verbs::{
    AccessFlags, Api, Completion, CompletionQueue, Context, InitParams, ProtectionDomain, QpCaps,
    QpState, QueuePair, RtrParams, RtsParams, SendFlags, SendOp, WcStatus,
};

use crate::pair::{Backend, Buf, Node, Pair, TimingFacts, ids_and_status, recv, req, wait};

const SIG: SendFlags = SendFlags::SIGNALED;
/// One tick of the sim's clock: "strictly before the deadline".
const NS: Duration = Duration::from_nanos(1);

/// The ACK timeout code the scenarios use: 4.096 µs × 2^12 ≈ 16.8 ms (4
/// jiffies on rxe at HZ=250).
pub const ACK_TIMEOUT_CODE: u8 = 12;
/// The RNR timer code the scenarios use: 20.48 ms (5 jiffies on rxe).
pub const RNR_TIMER_CODE: u8 = 22;
/// The ACK timeout code of the RNR scenarios: 4.096 µs × 2^14 ≈ 67 ms,
/// longer than an RNR wait. rxe keeps its retransmit timer running while
/// it waits out an RNR timer (the timer is re-armed only when a packet is
/// sent, and `rxe_completer` counts its expiry as a transport retry), so
/// an RNR period longer than the ACK timeout eats `retry_cnt` and ends in
/// `RETRY_EXC_ERR` even with `rnr_retry` 7: seen in the VM with ACK code
/// 12 (16.8 ms) and RNR code 22 (20.48 ms). The sim models it on devices
/// with `retransmit_timer_runs_during_rnr_wait` (its rxe profile), and
/// [`rnr_wait_longer_than_the_ack_timeout`] shows it; the other RNR
/// scenarios keep clear of it.
pub const RNR_ACK_TIMEOUT_CODE: u8 = 14;

/// The local ACK timeout of a `timeout` code (`ibv_modify_qp(3)`).
pub fn ack_timeout(code: u8) -> Duration {
    Duration::from_nanos(4096u64 << code)
}

/// The RNR NAK timer of a `min_rnr_timer` code (`ibv_modify_qp(3)`'s table,
/// IBA 9.7.5.2.8), in units of 10 µs.
pub fn rnr_timer(code: u8) -> Duration {
    const TABLE: [u64; 32] = [
        65536, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
        1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152,
    ];
    Duration::from_micros(TABLE[usize::from(code & 31)] * 10)
}

/// Two nodes, a QP on each connected to the other with `rts` on both and
/// `min_rnr_timer` in both RTRs; time held ([`Backend::hold_time`]).
/// Fields drop in order: QPs, CQs, nodes.
#[derive(Debug)]
pub struct Timed<A: Api> {
    /// Node a's QP, the requester.
    pub qa: A::QueuePair,
    /// Node b's QP (`None` once destroyed).
    pub qb: Option<A::QueuePair>,
    /// Node a's CQ.
    pub cqa: A::CompletionQueue,
    /// Node b's CQ.
    pub cqb: A::CompletionQueue,
    /// The requester's node.
    pub a: Node<A>,
    /// The responder's node.
    pub b: Node<A>,
}

impl<A: Api> Timed<A> {
    /// The pair, connected.
    pub fn new<B: Backend<A = A>>(backend: &B, rts: RtsParams, min_rnr_timer: u8) -> Self {
        crate::init_tracing();
        let (a, b) = backend.nodes();
        backend.hold_time(&a);
        backend.hold_time(&b);
        let cqa = a.ctx.create_cq(16).expect("CQ a");
        let cqb = b.ctx.create_cq(16).expect("CQ b");
        let caps = QpCaps::default();
        let qa = a.pd.create_qp(&caps, &cqa, &cqa).expect("QP a");
        let qb = b.pd.create_qp(&caps, &cqb, &cqb).expect("QP b");
        let (info_a, sgid_a) = a.info(&qa, 0x1234);
        let (info_b, sgid_b) = b.info(&qb, 0x5678);
        for (qp, sgid, own, remote) in
            [(&qa, sgid_a, info_a, info_b), (&qb, sgid_b, info_b, info_a)]
        {
            qp.to_init(&InitParams::default()).expect("INIT");
            let rtr = RtrParams {
                min_rnr_timer,
                ..RtrParams::new(remote, sgid, own.mtu)
            };
            qp.to_rtr(&rtr).expect("RTR");
            qp.to_rts(&RtsParams {
                sq_psn: own.psn,
                ..rts
            })
            .expect("RTS");
            assert_eq!(qp.state().unwrap(), QpState::ReadyToSend);
        }
        Self {
            qa,
            qb: Some(qb),
            cqa,
            cqb,
            a,
            b,
        }
    }

    /// Node b's QP.
    pub fn qb(&self) -> &A::QueuePair {
        self.qb.as_ref().expect("qb destroyed")
    }
}

/// One poll of `cq`.
fn poll_once<A: Api>(cq: &A::CompletionQueue) -> Vec<Completion> {
    let mut slots = [Completion::default(); 4];
    let k = cq.poll(&mut slots).expect("poll");
    slots[..k].to_vec()
}

/// Tracks how much time has passed since a request was posted: virtual
/// time advanced on the sim, real time on rxe.
struct Elapsed<'a, B: Backend> {
    backend: &'a B,
    timing: TimingFacts,
    start: Instant,
    advanced: Duration,
}

impl<'a, B: Backend> Elapsed<'a, B> {
    fn start(backend: &'a B) -> Self {
        Self {
            backend,
            timing: backend.timing(),
            start: Instant::now(),
            advanced: Duration::ZERO,
        }
    }

    /// Lets time pass until `at` after the start (at least).
    fn advance_to(&mut self, node: &Node<B::A>, at: Duration) {
        let now = self.now();
        if at > now {
            self.backend.advance(node, at - now);
            self.advanced = at;
        }
    }

    fn now(&self) -> Duration {
        if self.timing.real_time {
            self.start.elapsed()
        } else {
            self.advanced
        }
    }

    /// The completion of a request due to fail after `periods` timer
    /// periods, `nominal` in all: nothing may complete before the nominal
    /// time less the backend's early slack ([`Elapsed::nothing_until`]);
    /// then time passes to `nominal` and the completion must come within
    /// the backend's lateness.
    fn completion_due_at(
        &mut self,
        node: &Node<B::A>,
        cq: &<B::A as Api>::CompletionQueue,
        nominal: Duration,
        periods: u32,
        what: &str,
    ) -> Vec<Completion> {
        let lower = nominal.saturating_sub(self.timing.early_per_period * periods + NS);
        let wcs = self.nothing_until(node, cq, lower, what);
        if !wcs.is_empty() {
            return wcs;
        }
        self.advance_to(node, nominal);
        wait::<B::A>(cq, 1, self.timing.late)
    }

    /// Lets `window` pass in three steps, asserting at each that nothing
    /// completed on `cq` (`what` says what a completion would mean).
    fn nothing_for(
        &mut self,
        node: &Node<B::A>,
        cq: &<B::A as Api>::CompletionQueue,
        window: Duration,
        what: &str,
    ) {
        for step in 1..=3 {
            self.advance_to(node, window * step / 3);
            let wcs = poll_once::<B::A>(cq);
            assert!(
                wcs.is_empty(),
                "{what} after {:?}: {:?}",
                self.now(),
                ids_and_status(&wcs)
            );
        }
    }

    /// Asserts that nothing completes on `cq` until `bound` has passed.
    /// Virtual time: advanced to half the bound, then to the bound, with a
    /// poll at each. Real time: polled without pause until the bound; a
    /// completion found by a poll that ended by the bound is a failure, one
    /// found later (the test was descheduled past it) proves nothing and
    /// is returned for the caller to check.
    fn nothing_until(
        &mut self,
        node: &Node<B::A>,
        cq: &<B::A as Api>::CompletionQueue,
        bound: Duration,
        what: &str,
    ) -> Vec<Completion> {
        if !self.timing.real_time {
            for at in [bound / 2, bound] {
                self.advance_to(node, at);
                let wcs = poll_once::<B::A>(cq);
                assert!(
                    wcs.is_empty(),
                    "{what}: completed by {at:?} (nothing may until {bound:?}): {:?}",
                    ids_and_status(&wcs)
                );
            }
            return Vec::new();
        }
        let mut slots = [Completion::default(); 4];
        loop {
            let k = cq.poll(&mut slots).expect("poll");
            let now = self.now();
            if k > 0 {
                assert!(
                    now > bound,
                    "{what}: completed by {now:?} (nothing may until {bound:?}): {:?}",
                    ids_and_status(&slots[..k])
                );
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr().lock(),
                    "{what}: first polled after {now:?}, past {bound:?}: inconclusive"
                );
                return slots[..k].to_vec();
            }
            if now >= bound {
                return Vec::new();
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// A pair and two buffers of it.
type WithBufs<A> = (Timed<A>, Buf<A>, Buf<A>);

/// A pair with ACK timeout `code` and `retry_cnt`, `src` on A and `dst`
/// on B (64 bytes, seeds 1 and 2), B's QP destroyed: a request from A to
/// `dst` runs out of retries.
fn to_a_destroyed_peer<B: Backend>(backend: &B, code: u8, retry_cnt: u8) -> WithBufs<B::A> {
    let rts = RtsParams {
        timeout: code,
        retry_cnt,
        ..RtsParams::default()
    };
    let mut t = Timed::new(backend, rts, RNR_TIMER_CODE);
    let access = AccessFlags::transfer();
    let src = t.a.buf(64, 1, access);
    let dst = t.b.buf(64, 2, access);
    drop(t.qb.take());
    (t, src, dst)
}

/// A pair for RNR scenarios: the responders advertise RNR timer `code`,
/// the requesters retry `rnr_retry` times (ACK timeout
/// [`RNR_ACK_TIMEOUT_CODE`]).
fn rnr_pair<B: Backend>(backend: &B, code: u8, rnr_retry: u8) -> Timed<B::A> {
    let rts = RtsParams {
        timeout: RNR_ACK_TIMEOUT_CODE,
        rnr_retry,
        ..RtsParams::default()
    };
    Timed::new(backend, rts, code)
}

/// Whether scenario `name` skips (saying `why`): when `skip` holds, the
/// backend lacks what the scenario times.
fn skipped(name: &str, skip: bool, why: &str) -> bool {
    if skip {
        crate::skip(name, why);
    }
    skip
}

/// The request (wr_id 1) failed with `status`, seen after `nominal` was
/// due; the requester's QP is in ERROR.
fn failed_with<B: Backend>(
    clock: &Elapsed<'_, B>,
    t: &Timed<B::A>,
    wcs: &[Completion],
    status: WcStatus,
    nominal: Duration,
) {
    assert_eq!(
        ids_and_status(wcs),
        [(1, status)],
        "after {:?} (nominal {nominal:?})",
        clock.now()
    );
    assert_eq!(t.qa.state().unwrap(), QpState::Error);
}

/// Nothing completed on the responder's CQ.
fn responder_completed_nothing<A: Api>(t: &Timed<A>) {
    assert!(
        poll_once::<A>(&t.cqb).is_empty(),
        "the responder completed something"
    );
}

/// A request to a peer QP that no longer exists is retransmitted after
/// each ACK timeout and fails with `RETRY_EXC_ERR` after `retry_cnt + 1`
/// of them: not before, and not much later. The requester's QP goes to
/// ERROR.
pub fn retry_exceeded_after_the_ack_timeouts<B: Backend>(backend: &B) {
    let timing = backend.timing();
    if skipped(
        "retry_exceeded_after_the_ack_timeouts",
        !timing.honours_ack_timeout,
        "ACK timeout ignored",
    ) {
        return;
    }
    let retry_cnt = 2;
    let (t, src, dst) = to_a_destroyed_peer(backend, ACK_TIMEOUT_CODE, retry_cnt);
    let before = dst.bytes();
    let periods = u32::from(retry_cnt) + 1;
    let nominal = timing.period(ack_timeout(ACK_TIMEOUT_CODE)) * periods;

    let mut clock = Elapsed::start(backend);
    Pair::<B::A>::post(&t.qa, &[req(1, dst.write_op(0), &[src.sge(0, 64)], SIG)]);
    let wcs = clock.completion_due_at(&t.a, &t.cqa, nominal, periods, "retry: before the deadline");
    failed_with(&clock, &t, &wcs, WcStatus::RETRY_EXC_ERR, nominal);
    assert!(dst.bytes() == before, "bytes reached a destroyed QP's MR");
}

/// A SEND that finds no receive is RNR-NAKed and retried after the
/// responder's RNR timer; with `rnr_retry` 2 the NAK of the second retry
/// fails it with `RNR_RETRY_EXC_ERR`: two timer periods after the first
/// NAK (rxe's counting; see gdr-sim's clock docs). Nothing completes on
/// the responder.
pub fn rnr_retry_exceeded_after_the_rnr_timers<B: Backend>(backend: &B) {
    let timing = backend.timing();
    if skipped(
        "rnr_retry_exceeded_after_the_rnr_timers",
        !timing.honours_rnr_timer,
        "RNR timer ignored",
    ) {
        return;
    }
    let rnr_retry = 2;
    let t = rnr_pair(backend, RNR_TIMER_CODE, rnr_retry);
    let access = AccessFlags::transfer();
    let src = t.a.buf(64, 1, access);
    let periods = u32::from(rnr_retry);
    let nominal = timing.period(rnr_timer(RNR_TIMER_CODE)) * periods;

    let mut clock = Elapsed::start(backend);
    Pair::<B::A>::post(&t.qa, &[req(1, SendOp::Send, &[src.sge(0, 64)], SIG)]);
    let wcs = clock.completion_due_at(&t.a, &t.cqa, nominal, periods, "RNR: before the deadline");
    failed_with(&clock, &t, &wcs, WcStatus::RNR_RETRY_EXC_ERR, nominal);
    responder_completed_nothing(&t);
}

/// With `rnr_retry` 7 a SEND without a receive is retried for as long as
/// it takes (here ten RNR timer periods pass without a completion), and
/// succeeds at the first retry after a receive is posted.
pub fn rnr_retry_7_waits_for_the_receive<B: Backend>(backend: &B) {
    let timing = backend.timing();
    if skipped(
        "rnr_retry_7_waits_for_the_receive",
        !timing.honours_rnr_timer,
        "RNR timer ignored",
    ) {
        return;
    }
    let t = rnr_pair(backend, RNR_TIMER_CODE, 7);
    let access = AccessFlags::transfer();
    let src = t.a.buf(64, 1, access);
    let inbox = t.b.buf(64, 2, access);
    let period = timing.period(rnr_timer(RNR_TIMER_CODE));
    let window = period * 10 + period / 2;

    let mut clock = Elapsed::start(backend);
    Pair::<B::A>::post(&t.qa, &[req(1, SendOp::Send, &[src.sge(0, 64)], SIG)]);
    clock.nothing_for(&t.a, &t.cqa, window, "rnr_retry 7 gave up");
    // Not before the next retry (the receive is not pushed to the waiting
    // requester) on the sim; by one period plus the slack everywhere.
    a_receive_ends_the_wait(&mut clock, &t, &src, &inbox, period);
}

/// The SEND (wr_id 1 of `src`) still waiting for a receive in RTS: a
/// receive (wr_id 9, into `inbox`) is posted, and by one RNR `period`
/// (plus the backend's lateness) both sides complete with the payload in
/// `inbox`.
fn a_receive_ends_the_wait<B: Backend>(
    clock: &mut Elapsed<'_, B>,
    t: &Timed<B::A>,
    src: &Buf<B::A>,
    inbox: &Buf<B::A>,
    period: Duration,
) {
    assert_eq!(t.qa.state().unwrap(), QpState::ReadyToSend);
    Pair::<B::A>::post_recv(t.qb(), &[recv(9, &[inbox.sge(0, 64)])]);
    let done = clock.now() + period;
    clock.advance_to(&t.a, done);
    let late = clock.timing.late;
    let wcs = wait::<B::A>(&t.cqa, 1, late);
    assert_eq!(ids_and_status(&wcs), [(1, WcStatus::SUCCESS)]);
    let wcs = wait::<B::A>(&t.cqb, 1, late);
    assert_eq!(ids_and_status(&wcs), [(9, WcStatus::SUCCESS)]);
    assert!(inbox.bytes() == src.bytes(), "SEND payload");
}

/// An RNR timer longer than the ACK timeout (ACK code 12 ≈ 16.8 ms, RNR
/// code 22 = 20.48 ms), `rnr_retry` 7, `retry_cnt` 2, a SEND without a
/// receive. Where the retransmit timer runs through RNR waits
/// ([`TimingFacts::retransmit_timer_runs_during_rnr_wait`], rxe), each wait
/// spends one transport retry and the SEND fails with `RETRY_EXC_ERR`
/// when the ACK timeout expires in the wait after the last retry: at
/// `retry_cnt` × the RNR timer + the ACK timeout, `rnr_retry` 7
/// notwithstanding, the QP in ERROR. Elsewhere (IBA, ConnectX) an RNR NAK
/// stops the ACK timer: as [`rnr_retry_7_waits_for_the_receive`], nothing
/// completes for ten RNR periods and the SEND succeeds once a receive is
/// posted.
pub fn rnr_wait_longer_than_the_ack_timeout<B: Backend>(backend: &B) {
    let timing = backend.timing();
    if skipped(
        "rnr_wait_longer_than_the_ack_timeout",
        !timing.honours_rnr_timer || !timing.honours_ack_timeout,
        "RNR timer or ACK timeout ignored",
    ) {
        return;
    }
    let retry_cnt = 2;
    let rts = RtsParams {
        timeout: ACK_TIMEOUT_CODE,
        retry_cnt,
        rnr_retry: 7,
        ..RtsParams::default()
    };
    let t = Timed::new(backend, rts, RNR_TIMER_CODE);
    let access = AccessFlags::transfer();
    let src = t.a.buf(64, 1, access);
    let inbox = t.b.buf(64, 2, access);
    let rnr = timing.period(rnr_timer(RNR_TIMER_CODE));
    let ack = timing.period(ack_timeout(ACK_TIMEOUT_CODE));
    assert!(
        ack < rnr,
        "the scenario needs an ACK timeout below the RNR timer"
    );

    let mut clock = Elapsed::start(backend);
    Pair::<B::A>::post(&t.qa, &[req(1, SendOp::Send, &[src.sge(0, 64)], SIG)]);
    if timing.retransmit_timer_runs_during_rnr_wait {
        let nominal = rnr * u32::from(retry_cnt) + ack;
        let periods = u32::from(retry_cnt) + 1;
        let wcs = clock.completion_due_at(
            &t.a,
            &t.cqa,
            nominal,
            periods,
            "RNR wait: before the deadline",
        );
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "rnr_wait_longer_than_the_ack_timeout on {}: {:?} after {:?} (nominal {nominal:?})",
            backend.name(),
            ids_and_status(&wcs),
            clock.now()
        );
        failed_with(&clock, &t, &wcs, WcStatus::RETRY_EXC_ERR, nominal);
        responder_completed_nothing(&t);
        return;
    }
    let window = rnr * 10 + rnr / 2;
    clock.nothing_for(
        &t.a,
        &t.cqa,
        window,
        "an RNR wait longer than the ACK timeout ended it",
    );
    a_receive_ends_the_wait(&mut clock, &t, &src, &inbox, rnr);
}

/// What a backend actually does, measured by polling without pause: the
/// time from posting a WRITE to a destroyed peer QP (ACK timeout `code`,
/// `retry_cnt`) to its completion, and that completion's status. For
/// recording the facts of a real device (`rxe_timing_measured`).
pub fn measure_retry_exceeded<B: Backend>(
    backend: &B,
    code: u8,
    retry_cnt: u8,
) -> (Duration, WcStatus) {
    let (t, src, dst) = to_a_destroyed_peer(backend, code, retry_cnt);
    let start = Instant::now();
    Pair::<B::A>::post(&t.qa, &[req(1, dst.write_op(0), &[src.sge(0, 64)], SIG)]);
    let wcs = wait::<B::A>(&t.cqa, 1, Duration::from_secs(20));
    (start.elapsed(), wcs[0].status)
}

/// As [`measure_retry_exceeded`], for a SEND without a receive (the
/// responder's RNR timer `code`, the requester's `rnr_retry`).
pub fn measure_rnr_exceeded<B: Backend>(
    backend: &B,
    code: u8,
    rnr_retry: u8,
) -> (Duration, WcStatus) {
    let t = rnr_pair(backend, code, rnr_retry);
    let src = t.a.buf(64, 1, AccessFlags::transfer());
    let start = Instant::now();
    Pair::<B::A>::post(&t.qa, &[req(1, SendOp::Send, &[src.sge(0, 64)], SIG)]);
    let wcs = wait::<B::A>(&t.cqa, 1, Duration::from_secs(20));
    (start.elapsed(), wcs[0].status)
}
