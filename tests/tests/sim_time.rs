//! The simulated fabric's virtual clock: ACK timeouts and `retry_cnt`, RNR
//! NAK timers and `rnr_retry`, READ round trips and FENCE, each checked to
//! the nanosecond of virtual time in Manual mode, and the Auto mode the
//! older tests rely on.

use std::time::Duration;

use gdr_sim::{
    ClockMode, DeviceConfig, SimContext, SimCq, SimFabric, SimPd, SimQp, ack_timeout, rnr_nak_timer,
};
use gdr_tests::sim::{self, Buf};
use gdr_tests::{init_tracing, pattern};
use hal_verbs::{
    AccessFlags, Completion, CompletionQueue, ConnectionInfo, Context, InitParams,
    ProtectionDomain, Provider, QpCaps, QpState, QueuePair, RecvRequest, RtrParams, RtsParams,
    SendFlags, SendOp, SendRequest, Sge, WcOpcode, WcStatus,
};

// ---------------------------------------------------------------- helpers

const NS: Duration = Duration::from_nanos(1);

struct Node {
    ctx: SimContext,
    pd: SimPd,
}

impl Node {
    /// A node whose device is `device`.
    fn on(fabric: &SimFabric, name: &str, device: DeviceConfig) -> Self {
        let ctx = sim::add_node(fabric, name, device).open("sim0").unwrap();
        let pd = ctx.alloc_pd().unwrap();
        Self { ctx, pd }
    }

    fn info(&self, qp: &SimQp, psn: u32) -> (ConnectionInfo, u8) {
        sim::info(&self.ctx, qp, psn)
    }

    /// `len` zeroed bytes registered for transfers.
    fn buf(&self, len: usize) -> Buf {
        Buf::new(&self.pd, len, AccessFlags::transfer())
    }
}

/// Two nodes with one QP each, on a fabric whose clock is Manual.
struct Pair {
    fabric: SimFabric,
    a: Node,
    b: Node,
    cqa: SimCq,
    cqb: SimCq,
    qa: SimQp,
    qb: SimQp,
}

impl Pair {
    /// The QPs, created but not connected.
    fn new(mode: ClockMode) -> Self {
        Self::on(mode, DeviceConfig::default())
    }

    /// As [`Pair::new`], both nodes with `device`.
    fn on(mode: ClockMode, device: DeviceConfig) -> Self {
        init_tracing();
        let fabric = SimFabric::new();
        fabric.clock().set_mode(mode);
        let a = Node::on(&fabric, "a", device.clone());
        let b = Node::on(&fabric, "b", device);
        let (cqa, cqb) = (a.ctx.create_cq(64).unwrap(), b.ctx.create_cq(64).unwrap());
        let caps = QpCaps::default();
        let qa = a.pd.create_qp(&caps, &cqa, &cqa).unwrap();
        let qb = b.pd.create_qp(&caps, &cqb, &cqb).unwrap();
        Self {
            fabric,
            a,
            b,
            cqa,
            cqb,
            qa,
            qb,
        }
    }

    /// Brings one side to RTS (or only RTR) towards the other, with
    /// `min_rnr_timer` as the RNR timer it advertises.
    fn bring_up(&self, a_side: bool, rts: Option<RtsParams>, min_rnr_timer: u8) {
        let (own, qp, peer, peer_qp, psn, peer_psn) = if a_side {
            (&self.a, &self.qa, &self.b, &self.qb, 0x100, 0x200)
        } else {
            (&self.b, &self.qb, &self.a, &self.qa, 0x200, 0x100)
        };
        let (own_info, sgid) = own.info(qp, psn);
        let (peer_info, _) = peer.info(peer_qp, peer_psn);
        qp.to_init(&InitParams::default()).unwrap();
        qp.to_rtr(&RtrParams {
            min_rnr_timer,
            ..RtrParams::new(peer_info, sgid, own_info.mtu)
        })
        .unwrap();
        if let Some(rts) = rts {
            qp.to_rts(&RtsParams { sq_psn: psn, ..rts }).unwrap();
        }
    }

    /// Both sides to RTS with `rts`; each advertises `min_rnr_timer`.
    fn connected(mode: ClockMode, rts: RtsParams, min_rnr_timer: u8) -> Self {
        let pair = Self::new(mode);
        pair.bring_up(true, Some(rts), min_rnr_timer);
        pair.bring_up(false, Some(rts), min_rnr_timer);
        pair
    }

    fn now(&self) -> Duration {
        self.fabric.clock().now()
    }

    /// Posts a SEND (wr_id 1, signaled) of 32 bytes from a; the buffer it
    /// returns is kept until the SEND completes.
    fn send_from_a(&self) -> Buf {
        let src = self.a.buf(32);
        post(&self.qa, 1, SendOp::Send, src.whole(), SendFlags::empty());
        src
    }
}

fn rts(timeout: u8, retry_cnt: u8, rnr_retry: u8) -> RtsParams {
    RtsParams {
        timeout,
        retry_cnt,
        rnr_retry,
        ..RtsParams::default()
    }
}

fn post(qp: &SimQp, wr_id: u64, op: SendOp, sge: Sge, flags: SendFlags) {
    let request = SendRequest {
        wr_id,
        op,
        sg_list: [sge].into_iter().collect(),
        flags: flags | SendFlags::SIGNALED,
    };
    // SAFETY: every test keeps its buffers registered until the end.
    unsafe { qp.post_send(&[request]) }.unwrap();
}

fn post_recv(qp: &SimQp, wr_id: u64, sge: Sge) {
    let request = RecvRequest {
        wr_id,
        sg_list: [sge].into_iter().collect(),
    };
    // SAFETY: as for `post`.
    unsafe { qp.post_recv(&[request]) }.unwrap();
}

/// Everything the CQ has now (one poll: in Manual mode a poll never moves
/// the clock).
fn drain(cq: &SimCq) -> Vec<(u64, WcStatus)> {
    let mut slots = [Completion::default(); 16];
    let n = cq.poll(&mut slots).unwrap();
    slots[..n].iter().map(|wc| (wc.wr_id, wc.status)).collect()
}

/// Request 1 on `qa` (CQ `cqa`, on `fabric`) fails with `status` `fail_at` from now, not a
/// nanosecond earlier (the QP still in RTS then, where `rts_before`),
/// and the QP is in ERROR; `what` names the case.
fn fails_at(
    (fabric, cqa, qa): (&SimFabric, &SimCq, &SimQp),
    fail_at: Duration,
    status: WcStatus,
    rts_before: bool,
    what: &str,
) {
    fabric.advance(fail_at - NS);
    assert_eq!(drain(cqa), [], "{what}");
    if rts_before {
        assert_eq!(qa.state().unwrap(), QpState::ReadyToSend);
    }
    fabric.advance(NS);
    assert_eq!(drain(cqa), [(1, status)], "{what}");
    assert_eq!(qa.state().unwrap(), QpState::Error);
}

// ------------------------------------------------------------------ tests

#[test]
fn the_timer_tables_are_the_verbs_ones() {
    // 4.096 µs × 2^timeout.
    assert_eq!(ack_timeout(0), None, "0: no timer");
    assert_eq!(ack_timeout(1), Some(Duration::from_nanos(8192)));
    assert_eq!(ack_timeout(14), Some(Duration::from_nanos(67_108_864)));
    assert_eq!(ack_timeout(31), Some(Duration::from_nanos(4096 << 31)));
    // ibv_modify_qp(3)'s min_rnr_timer table.
    assert_eq!(rnr_nak_timer(0), Duration::from_micros(655_360));
    assert_eq!(rnr_nak_timer(1), Duration::from_micros(10));
    assert_eq!(rnr_nak_timer(12), Duration::from_micros(640));
    assert_eq!(rnr_nak_timer(13), Duration::from_micros(960));
    assert_eq!(rnr_nak_timer(31), Duration::from_micros(491_520));
    let fabric = SimFabric::new();
    assert_eq!(fabric.clock().mode(), ClockMode::Auto, "the default");
    assert_eq!(fabric.clock().now(), Duration::ZERO);
    assert_eq!(fabric.clock().read_latency(), Duration::ZERO);
}

/// A WRITE to a destroyed peer QP is retransmitted `retry_cnt` times, one
/// ACK timeout apart, and fails with RETRY_EXC_ERR exactly at the
/// `(retry_cnt + 1)`th timeout, not a nanosecond before.
#[test]
fn a_dead_peer_fails_only_after_retry_cnt_plus_one_timeouts() {
    for (timeout, retry_cnt) in [(14, 3), (1, 0), (8, 6), (20, 1)] {
        let p = Pair::connected(ClockMode::Manual, rts(timeout, retry_cnt, 7), 12);
        let src = p.a.buf(64);
        let dst = p.b.buf(64);
        let tau = ack_timeout(timeout).unwrap();
        let fail_at = tau * (u32::from(retry_cnt) + 1);
        let start = p.now();
        post(&p.qa, 1, dst.write_op(), src.whole(), SendFlags::empty());
        // The peer is gone before the first packet.
        let p = destroy_b(p);
        assert_eq!(drain(&p.cqa), [], "no answer is not an error yet");
        assert_eq!(p.fabric.clock().next_deadline(), Some(start + tau));
        let what = format!("timeout {timeout} retry_cnt {retry_cnt}");
        fails_at(
            (&p.fabric, &p.cqa, &p.qa),
            fail_at,
            WcStatus::RETRY_EXC_ERR,
            true,
            &what,
        );
        assert_eq!(p.now() - start, fail_at);
        assert_eq!(p.fabric.clock().next_deadline(), None);
    }
}

/// `Pair` without its B-side QP (destroyed), for the dead-peer tests.
struct HalfPair {
    fabric: SimFabric,
    cqa: SimCq,
    qa: SimQp,
    _keep: (Node, Node, SimCq),
}

impl HalfPair {
    fn now(&self) -> Duration {
        self.fabric.clock().now()
    }
}

fn destroy_b(p: Pair) -> HalfPair {
    let Pair {
        fabric,
        a,
        b,
        cqa,
        cqb,
        qa,
        qb,
    } = p;
    drop(qb);
    HalfPair {
        fabric,
        cqa,
        qa,
        _keep: (a, b, cqb),
    }
}

/// A peer that reaches RTR between two retransmissions gets the next one:
/// the request succeeds (the old sim failed it at once).
#[test]
fn a_peer_ready_before_the_last_retry_gets_the_request() {
    let p = Pair::new(ClockMode::Manual);
    p.bring_up(true, Some(rts(10, 3, 7)), 12);
    let tau = ack_timeout(10).unwrap();
    let mut src = p.a.buf(64);
    src.data.copy_from_slice(&pattern(64, 3));
    let dst = p.b.buf(64);
    post(&p.qa, 1, dst.write_op(), src.whole(), SendFlags::empty());
    assert_eq!(drain(&p.cqa), [], "B is in RESET: the packet is dropped");
    p.fabric.advance(tau * 2 + tau / 2);
    assert_eq!(drain(&p.cqa), []);
    // B comes up half-way to the third retransmission, which it receives.
    p.bring_up(false, None, 12);
    assert_eq!(drain(&p.cqa), [], "not before the retransmission");
    assert!(dst.data.iter().all(|&b| b == 0));
    p.fabric.advance(tau / 2 - NS);
    assert_eq!(drain(&p.cqa), []);
    p.fabric.advance(NS);
    assert_eq!(drain(&p.cqa), [(1, WcStatus::SUCCESS)]);
    assert_eq!(p.now(), tau * 3);
    assert_eq!(&dst.data[..], &pattern(64, 3)[..]);
    // The next request starts with a fresh retry budget.
    drop(p.qb);
    post(&p.qa, 2, dst.write_op(), src.whole(), SendFlags::empty());
    p.fabric.advance(tau * 4 - NS);
    assert_eq!(drain(&p.cqa), []);
    p.fabric.advance(NS);
    assert_eq!(drain(&p.cqa), [(2, WcStatus::RETRY_EXC_ERR)]);
}

/// A SEND finding no receive is RNR-NAKed and retried every RNR timer of
/// the *responder* (its `min_rnr_timer`); the NAK of retry `rnr_retry`
/// fails it: `rnr_retry` periods after the first NAK, as rxe counts.
#[test]
fn rnr_retry_runs_out_after_rnr_retry_timer_periods() {
    for (rnr_retry, code) in [(3u8, 14u8), (1, 1), (6, 12)] {
        let p = Pair::new(ClockMode::Manual);
        // A advertises a different timer: B's is the one A waits.
        p.bring_up(true, Some(rts(14, 3, rnr_retry)), 0);
        p.bring_up(false, Some(rts(14, 3, 7)), code);
        let period = rnr_nak_timer(code);
        let _src = p.send_from_a();
        assert_eq!(drain(&p.cqa), [], "first NAK");
        assert_eq!(p.fabric.clock().next_deadline(), Some(period));
        let fail_at = period * u32::from(rnr_retry);
        let what = format!("rnr_retry {rnr_retry}");
        fails_at(
            (&p.fabric, &p.cqa, &p.qa),
            fail_at,
            WcStatus::RNR_RETRY_EXC_ERR,
            false,
            &what,
        );
    }
    // rnr_retry 0: the first NAK fails it, at once.
    let p = Pair::connected(ClockMode::Manual, rts(14, 3, 0), 12);
    let _src = p.send_from_a();
    assert_eq!(drain(&p.cqa), [(1, WcStatus::RNR_RETRY_EXC_ERR)]);
    assert_eq!(p.now(), Duration::ZERO);
}

/// rnr_retry 7 waits forever while the peer posts nothing, and delivers at
/// the first retry after the receive is posted (not before).
#[test]
fn rnr_retry_7_never_fails_and_delivers_once_a_receive_is_posted() {
    let p = Pair::connected(ClockMode::Manual, rts(14, 3, 7), 12);
    let period = rnr_nak_timer(12);
    let mut src = p.a.buf(32);
    src.data.copy_from_slice(&pattern(32, 9));
    let inbox = p.b.buf(32);
    post(&p.qa, 1, SendOp::Send, src.whole(), SendFlags::empty());
    assert_eq!(drain(&p.cqa), []);
    // Ten virtual seconds: over 15 000 NAKs.
    p.fabric.advance(Duration::from_secs(10));
    assert_eq!(drain(&p.cqa), []);
    assert_eq!(p.qa.state().unwrap(), QpState::ReadyToSend);
    let next = p.fabric.clock().next_deadline().expect("an RNR wait");
    assert!(next > p.now() && next <= p.now() + period);
    post_recv(&p.qb, 7, inbox.whole());
    assert_eq!(drain(&p.cqa), [], "delivered at the next retry only");
    assert_eq!(drain(&p.cqb), []);
    p.fabric.advance(next - p.now());
    assert_eq!(drain(&p.cqa), [(1, WcStatus::SUCCESS)]);
    assert_eq!(drain(&p.cqb), [(7, WcStatus::SUCCESS)]);
    assert_eq!(&inbox.data[..], &pattern(32, 9)[..]);
}

/// On a device whose retransmit timer runs through RNR waits (rxe), an
/// ACK timeout shorter than the responder's RNR timer expires in every
/// wait: each expiry spends one of `retry_cnt`, and the one after the last
/// fails the SEND with `RETRY_EXC_ERR`, at `retry_cnt` RNR periods + the
/// ACK timeout, `rnr_retry` 7 notwithstanding.
#[test]
fn rxe_retransmit_timer_runs_through_rnr_waits() {
    let ack = ack_timeout(12).unwrap();
    let rnr = rnr_nak_timer(22);
    assert!(ack < rnr);
    for retry_cnt in [0u8, 2, 3, 6] {
        let p = Pair::on(ClockMode::Manual, DeviceConfig::rxe_like());
        p.bring_up(true, Some(rts(12, retry_cnt, 7)), 0);
        p.bring_up(false, Some(rts(12, retry_cnt, 7)), 22);
        let _src = p.send_from_a();
        assert_eq!(drain(&p.cqa), [], "first NAK");
        assert_eq!(p.fabric.clock().next_deadline(), Some(ack), "ACK timer");
        let fail_at = rnr * u32::from(retry_cnt) + ack;
        let what = format!("retry_cnt {retry_cnt}");
        fails_at(
            (&p.fabric, &p.cqa, &p.qa),
            fail_at,
            WcStatus::RETRY_EXC_ERR,
            true,
            &what,
        );
        assert_eq!(drain(&p.cqb), []);
    }
    // A finite rnr_retry still counts the NAKs: rnr_retry 1 fails at the
    // first retry's NAK, one RNR period in (one ACK expiry spent by then).
    let p = Pair::on(ClockMode::Manual, DeviceConfig::rxe_like());
    p.bring_up(true, Some(rts(12, 3, 1)), 0);
    p.bring_up(false, Some(rts(12, 3, 7)), 22);
    let _src = p.send_from_a();
    p.fabric.advance(rnr - NS);
    assert_eq!(drain(&p.cqa), []);
    p.fabric.advance(NS);
    assert_eq!(drain(&p.cqa), [(1, WcStatus::RNR_RETRY_EXC_ERR)]);
}

/// The retransmit timer spends retries only in waits it outlasts: a
/// receive posted before `retry_cnt` is spent is used by the next retry,
/// and the next request starts with its count whole again. With the ACK
/// timeout above the RNR timer, or on a device whose ACK timer stops at
/// an RNR NAK (the default, mlx5), `rnr_retry` 7 waits forever.
#[test]
fn the_retransmit_timer_in_rnr_waits_spends_only_what_it_outlasts() {
    let ack = ack_timeout(12).unwrap();
    let rnr = rnr_nak_timer(22);
    // rxe, retry_cnt 1: one expiry spent in the first wait, then the
    // receive comes and the SEND succeeds at the first retry.
    let p = Pair::on(ClockMode::Manual, DeviceConfig::rxe_like());
    p.bring_up(true, Some(rts(12, 1, 7)), 0);
    p.bring_up(false, Some(rts(12, 1, 7)), 22);
    let src = p.a.buf(32);
    let inbox = p.b.buf(32);
    post(&p.qa, 1, SendOp::Send, src.whole(), SendFlags::empty());
    p.fabric.advance(ack);
    assert_eq!(drain(&p.cqa), []);
    post_recv(&p.qb, 7, inbox.whole());
    p.fabric.advance(rnr - ack);
    assert_eq!(drain(&p.cqa), [(1, WcStatus::SUCCESS)]);
    assert_eq!(drain(&p.cqb), [(7, WcStatus::SUCCESS)]);
    // The next SEND has its retry_cnt whole: it fails one RNR period +
    // the ACK timeout after it was posted, not at its first expiry.
    let start = p.now();
    post(&p.qa, 2, SendOp::Send, src.whole(), SendFlags::empty());
    p.fabric.advance(ack);
    assert_eq!(drain(&p.cqa), [], "a fresh count");
    p.fabric.advance(start + rnr + ack - p.now());
    assert_eq!(drain(&p.cqa), [(2, WcStatus::RETRY_EXC_ERR)]);

    for (device, timeout, name) in [
        (
            DeviceConfig::rxe_like(),
            14,
            "rxe, ACK timeout above the RNR timer",
        ),
        (DeviceConfig::mlx5_like(), 12, "mlx5"),
        (DeviceConfig::default(), 12, "default"),
    ] {
        let p = Pair::on(ClockMode::Manual, device);
        p.bring_up(true, Some(rts(timeout, 0, 7)), 0);
        p.bring_up(false, Some(rts(timeout, 0, 7)), 22);
        let src = p.a.buf(32);
        let inbox = p.b.buf(32);
        post(&p.qa, 1, SendOp::Send, src.whole(), SendFlags::empty());
        p.fabric.advance(Duration::from_secs(10));
        assert_eq!(drain(&p.cqa), [], "{name}");
        assert_eq!(p.qa.state().unwrap(), QpState::ReadyToSend, "{name}");
        post_recv(&p.qb, 7, inbox.whole());
        p.fabric.advance(rnr);
        assert_eq!(drain(&p.cqa), [(1, WcStatus::SUCCESS)], "{name}");
    }
}

/// A connected pair (Manual clock) whose READs take `latency`: `remote`
/// on B holding `pattern(64, 1)`, `local` on A for a READ of it, `note` on
/// A holding "done!!!!" and `inbox` on B for it. The buffers drop first.
struct ReadAhead {
    remote: Buf,
    local: Buf,
    note: Buf,
    inbox: Buf,
    latency: Duration,
    p: Pair,
}

impl ReadAhead {
    fn new() -> Self {
        let p = Pair::connected(ClockMode::Manual, rts(14, 3, 7), 12);
        let latency = Duration::from_micros(5);
        p.fabric.clock().set_read_latency(latency);
        let mut remote = p.b.buf(64);
        remote.data.copy_from_slice(&pattern(64, 1));
        let local = p.a.buf(64);
        let mut note = p.a.buf(8);
        note.data.copy_from_slice(b"done!!!!");
        let inbox = p.b.buf(8);
        Self {
            remote,
            local,
            note,
            inbox,
            latency,
            p,
        }
    }
}

/// With a READ round trip, requests behind a READ go on (an RC requester
/// pipelines), but their completions wait for the READ's: posting order.
#[test]
fn requests_pipeline_past_an_outstanding_read() {
    // `p` first: bindings drop in reverse, the pair after the buffers.
    let ReadAhead {
        p,
        latency,
        mut remote,
        local,
        note,
        inbox,
    } = ReadAhead::new();
    post_recv(&p.qb, 9, inbox.whole());
    post(
        &p.qa,
        1,
        remote.read_op(),
        local.whole(),
        SendFlags::empty(),
    );
    post(&p.qa, 2, SendOp::Send, note.whole(), SendFlags::empty());
    // The SEND arrived while the READ is outstanding...
    assert_eq!(drain(&p.cqb), [(9, WcStatus::SUCCESS)]);
    assert_eq!(&inbox.data[..], b"done!!!!");
    // ...so B, told "done", reuses the buffer the READ has not read yet:
    // the hazard FENCE exists for. The READ returns the new bytes.
    remote.data.copy_from_slice(&pattern(64, 2));
    assert_eq!(
        drain(&p.cqa),
        [],
        "the SEND's completion waits for the READ's"
    );
    assert!(local.data.iter().all(|&b| b == 0));
    p.fabric.advance(latency - NS);
    assert_eq!(drain(&p.cqa), []);
    p.fabric.advance(NS);
    assert_eq!(
        drain(&p.cqa),
        [(1, WcStatus::SUCCESS), (2, WcStatus::SUCCESS)]
    );
    assert_eq!(&local.data[..], &pattern(64, 2)[..]);
}

/// A FENCEd request waits until every earlier READ has completed: the
/// responder sees it only after the READ's round trip, and the READ got
/// the bytes from before.
#[test]
fn a_fenced_request_waits_for_earlier_reads() {
    // `p` first: bindings drop in reverse, the pair after the buffers.
    let ReadAhead {
        p,
        latency,
        remote,
        local,
        note,
        inbox,
    } = ReadAhead::new();
    let other = p.b.buf(8);
    post_recv(&p.qb, 9, inbox.whole());
    post(
        &p.qa,
        1,
        remote.read_op(),
        local.whole(),
        SendFlags::empty(),
    );
    post(&p.qa, 2, SendOp::Send, note.whole(), SendFlags::FENCE);
    // And an unfenced WRITE behind the fenced SEND waits too (RC order).
    post(&p.qa, 3, other.write_op(), note.whole(), SendFlags::empty());
    assert_eq!(drain(&p.cqb), [], "fenced: not sent yet");
    assert_eq!(drain(&p.cqa), []);
    p.fabric.advance(latency - NS);
    assert_eq!(drain(&p.cqb), []);
    assert!(other.data.iter().all(|&b| b == 0));
    p.fabric.advance(NS);
    assert_eq!(&local.data[..], &pattern(64, 1)[..], "read before the SEND");
    assert_eq!(drain(&p.cqb), [(9, WcStatus::SUCCESS)]);
    assert_eq!(&other.data[..], b"done!!!!");
    assert_eq!(
        drain(&p.cqa),
        [
            (1, WcStatus::SUCCESS),
            (2, WcStatus::SUCCESS),
            (3, WcStatus::SUCCESS)
        ]
    );
    // FENCE with no READ outstanding does not wait.
    post_recv(&p.qb, 10, inbox.whole());
    post(&p.qa, 4, SendOp::Send, note.whole(), SendFlags::FENCE);
    assert_eq!(drain(&p.cqa), [(4, WcStatus::SUCCESS)]);
}

/// A QP moved to the error state while a READ is outstanding flushes it,
/// after the completions of what ran behind it are reported.
#[test]
fn an_outstanding_read_flushes_in_order() {
    let p = Pair::connected(ClockMode::Manual, rts(14, 3, 7), 12);
    p.fabric.clock().set_read_latency(Duration::from_micros(5));
    let remote = p.b.buf(64);
    let local = p.a.buf(64);
    post(
        &p.qa,
        1,
        remote.read_op(),
        local.whole(),
        SendFlags::empty(),
    );
    post(
        &p.qa,
        2,
        remote.write_op(),
        local.whole(),
        SendFlags::empty(),
    );
    assert_eq!(drain(&p.cqa), []);
    p.qa.to_error().unwrap();
    assert_eq!(
        drain(&p.cqa),
        [(1, WcStatus::WR_FLUSH_ERR), (2, WcStatus::SUCCESS)]
    );
    assert_eq!(p.fabric.clock().next_deadline(), None);
}

/// Auto mode (the default) keeps what tests written before the clock
/// expect: a request to a dead peer fails in the progress that finds it
/// (the post's, since posts make progress), the clock having run through
/// every timeout; each poll is one RNR timer period (a post records no RNR
/// NAK and moves no RNR timer, and with no CQ armed the NIC thread steps
/// none).
#[test]
fn auto_mode_runs_transport_timeouts_within_a_poll_and_one_rnr_period_per_poll() {
    let p = Pair::connected(ClockMode::Auto, rts(14, 2, 7), 12);
    let src = p.a.buf(32);
    let dst = p.b.buf(32);
    // Gone before the post: on the Auto clock the post sends at once.
    let p = destroy_b(p);
    post(&p.qa, 1, dst.write_op(), src.whole(), SendFlags::empty());
    assert_eq!(drain(&p.cqa), [(1, WcStatus::RETRY_EXC_ERR)]);
    assert_eq!(p.now(), ack_timeout(14).unwrap() * 3);

    let p = Pair::connected(ClockMode::Auto, rts(14, 3, 2), 13);
    let period = rnr_nak_timer(13);
    let _src = p.send_from_a();
    assert_eq!(drain(&p.cqa), [], "first NAK");
    assert_eq!(p.now(), Duration::ZERO);
    assert_eq!(drain(&p.cqa), [], "retry 1");
    assert_eq!(p.now(), period);
    assert_eq!(drain(&p.cqa), [(1, WcStatus::RNR_RETRY_EXC_ERR)], "retry 2");
    assert_eq!(p.now(), period * 2);
    // An opcode check on the way: a READ in Auto mode with latency runs
    // within the poll.
    let p = Pair::connected(ClockMode::Auto, rts(14, 3, 7), 12);
    p.fabric.clock().set_read_latency(Duration::from_millis(1));
    let remote = p.b.buf(16);
    let local = p.a.buf(16);
    post(
        &p.qa,
        5,
        remote.read_op(),
        local.whole(),
        SendFlags::empty(),
    );
    let mut slots = [Completion::default(); 2];
    assert_eq!(p.cqa.poll(&mut slots).unwrap(), 1);
    assert_eq!(
        (slots[0].wr_id, slots[0].status, slots[0].opcode),
        (5, WcStatus::SUCCESS, WcOpcode::RdmaRead)
    );
    assert_eq!(p.now(), Duration::from_millis(1));
}

/// While paused the clock moves but nothing runs; timers that passed fire
/// when progress resumes.
#[test]
fn a_paused_fabric_fires_passed_timers_on_resume() {
    let p = Pair::connected(ClockMode::Manual, rts(12, 1, 7), 12);
    let src = p.a.buf(32);
    let dst = p.b.buf(32);
    post(&p.qa, 1, dst.write_op(), src.whole(), SendFlags::empty());
    let p = destroy_b(p);
    assert_eq!(drain(&p.cqa), []);
    p.fabric.set_paused(true);
    p.fabric.advance(Duration::from_secs(1));
    assert_eq!(drain(&p.cqa), [], "paused");
    p.fabric.set_paused(false);
    // One retransmission at once (its deadline passed), then the last
    // timeout runs from now.
    assert_eq!(drain(&p.cqa), []);
    p.fabric.advance(ack_timeout(12).unwrap());
    assert_eq!(drain(&p.cqa), [(1, WcStatus::RETRY_EXC_ERR)]);
    assert_eq!(p.now(), Duration::from_secs(1) + ack_timeout(12).unwrap());
    drop(p.qa);
}

/// At most `max_rd_atomic` READs are outstanding: the next waits for the
/// first to complete (and what is behind it waits too).
#[test]
fn reads_beyond_max_rd_atomic_wait_for_an_earlier_one() {
    let p = Pair::connected(
        ClockMode::Manual,
        RtsParams {
            max_rd_atomic: 2,
            ..rts(14, 3, 7)
        },
        12,
    );
    let latency = Duration::from_micros(5);
    p.fabric.clock().set_read_latency(latency);
    let remote = p.b.buf(16);
    let local = p.a.buf(16);
    for wr_id in 1..=3 {
        post(
            &p.qa,
            wr_id,
            remote.read_op(),
            local.whole(),
            SendFlags::empty(),
        );
    }
    assert_eq!(drain(&p.cqa), []);
    p.fabric.advance(latency);
    // The third left when the first completed: due one round trip later.
    assert_eq!(
        drain(&p.cqa),
        [(1, WcStatus::SUCCESS), (2, WcStatus::SUCCESS)]
    );
    assert_eq!(p.fabric.clock().next_deadline(), Some(latency * 2));
    p.fabric.advance(latency);
    assert_eq!(drain(&p.cqa), [(3, WcStatus::SUCCESS)]);
}
