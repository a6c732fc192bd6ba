//! Completion channels, CQ notification, async events, QP reset/recycle and
//! granted attributes on the simulated NIC, through the `hal-verbs` traits.
//!
//! Readiness is checked on the real file descriptors, with epoll and
//! poll(2) and a timeout, as an engine's event loop would wait on them.

use std::os::fd::AsRawFd;
use std::time::Duration;

use gdr_sim::{
    ClockMode, DeviceConfig, Fault, FaultPlan, FaultSite, SimCompChannel, SimContext, SimCq,
    SimFabric, SimPd, SimQp, SimVerbs,
};
use gdr_tests::fd::{epoll_readable, is_nonblocking, poll_readable};
use gdr_tests::init_tracing;
use gdr_tests::sim::{self, Buf};
use hal_verbs::{
    AccessFlags, AsyncEvent, Completion, CompletionChannel, CompletionQueue, ConnectionInfo,
    Context, CqNotify, InitParams, MemoryRegion, PortState, ProtectionDomain, Provider, QpCaps,
    QpState, QueuePair, RecvRequest, RtrParams, RtsParams, SendFlags, SendOp, SendRequest,
    VerbsError, WcStatus,
};

const WAIT: Duration = Duration::from_millis(200);

// --------------------------------------------------------- verbs helpers

struct Node {
    verbs: SimVerbs,
    ctx: SimContext,
    pd: SimPd,
}

impl Node {
    fn new(fabric: &SimFabric, name: &str, device: DeviceConfig) -> Self {
        let verbs = sim::add_node(fabric, name, device);
        let ctx = verbs.open("sim0").unwrap();
        let pd = ctx.alloc_pd().unwrap();
        Self { verbs, ctx, pd }
    }

    fn info(&self, qp: &SimQp, psn: u32) -> (ConnectionInfo, u8) {
        sim::info(&self.ctx, qp, psn)
    }
}

/// Every side starts at this PSN.
const PSN: u32 = 0x100;

fn connect_one(a: &Node, qa: &SimQp, b: &Node, qb: &SimQp, rtr: impl Fn(&mut RtrParams)) {
    let (info_b, _) = b.info(qb, PSN);
    let (own, sgid) = a.info(qa, PSN);
    qa.to_init(&InitParams::default()).unwrap();
    let mut params = RtrParams::new(info_b, sgid, own.mtu);
    rtr(&mut params);
    qa.to_rtr(&params).unwrap();
}

/// Connects `qa` and `qb` both ways, with `rts` (its PSN replaced).
fn connect(a: &Node, qa: &SimQp, b: &Node, qb: &SimQp, rts: RtsParams) {
    connect_one(a, qa, b, qb, |_| {});
    connect_one(b, qb, a, qa, |_| {});
    qa.to_rts(&RtsParams { sq_psn: PSN, ..rts }).unwrap();
    qb.to_rts(&RtsParams { sq_psn: PSN, ..rts }).unwrap();
}

/// Two nodes with a connected QP pair, each side's CQ on its own channel.
struct Pair {
    fabric: SimFabric,
    a: Node,
    b: Node,
    cha: SimCompChannel,
    chb: SimCompChannel,
    cqa: SimCq,
    cqb: SimCq,
    qa: SimQp,
    qb: SimQp,
    bufa: Buf,
    bufb: Buf,
}

fn pair_with(fabric: SimFabric, device: DeviceConfig) -> Pair {
    init_tracing();
    let a = Node::new(&fabric, "a", device.clone());
    let b = Node::new(&fabric, "b", device);
    let cha = a.ctx.create_comp_channel().unwrap();
    let chb = b.ctx.create_comp_channel().unwrap();
    let cqa = a.ctx.create_cq_on_channel(256, &cha, 0).unwrap();
    let cqb = b.ctx.create_cq_on_channel(256, &chb, 0).unwrap();
    let caps = QpCaps::default();
    let qa = a.pd.create_qp(&caps, &cqa, &cqa).unwrap();
    let qb = b.pd.create_qp(&caps, &cqb, &cqb).unwrap();
    connect(&a, &qa, &b, &qb, RtsParams::default());
    let bufa = Buf::new(&a.pd, 4096, AccessFlags::transfer());
    let bufb = Buf::new(&b.pd, 4096, AccessFlags::transfer());
    Pair {
        fabric,
        a,
        b,
        cha,
        chb,
        cqa,
        cqb,
        qa,
        qb,
        bufa,
        bufb,
    }
}

fn pair() -> Pair {
    pair_with(SimFabric::new(), DeviceConfig::default())
}

fn send(qp: &SimQp, buf: &Buf, wr_id: u64, op: SendOp, flags: SendFlags) {
    let request = SendRequest {
        wr_id,
        op,
        sg_list: [buf.sge(0, 64)].into_iter().collect(),
        flags,
    };
    // SAFETY: the buffer is registered and outlives the request.
    unsafe { qp.post_send(&[request]) }.unwrap();
}

fn recv(qp: &SimQp, buf: &Buf, wr_id: u64) {
    let request = RecvRequest {
        wr_id,
        sg_list: [buf.sge(0, 4096)].into_iter().collect(),
    };
    // SAFETY: as `send`.
    unsafe { qp.post_recv(&[request]) }.unwrap();
}

fn write_to(p: &Pair, wr_id: u64) -> SendOp {
    let _ = wr_id;
    SendOp::Write {
        remote_addr: p.bufb.mr.addr(),
        rkey: p.bufb.mr.rkey(),
    }
}

fn drain(cq: &SimCq) -> Vec<Completion> {
    let mut out = [Completion::default(); 256];
    let n = cq.poll(&mut out).unwrap();
    out[..n].to_vec()
}

fn events(ctx: &SimContext) -> Vec<AsyncEvent> {
    std::iter::from_fn(|| ctx.next_async_event().unwrap()).collect()
}

// ------------------------------------------------------ completion channels

#[test]
fn channel_fd_is_nonblocking_and_quiet_until_an_armed_cq_completes() {
    let p = pair();
    let fd = p.cha.fd();
    assert_eq!(fd, p.cha.as_raw_fd());
    assert!(is_nonblocking(fd), "the channel's fd is non-blocking");
    assert!(!poll_readable(fd));
    assert_eq!(
        p.cha.get_cq_event().unwrap(),
        None,
        "no event: None, no wait"
    );

    p.cqa.req_notify(CqNotify::Next).unwrap();
    assert!(
        !epoll_readable(fd, Duration::from_millis(20)),
        "armed, idle"
    );
    send(&p.qa, &p.bufa, 1, write_to(&p, 1), SendFlags::SIGNALED);
    p.fabric.progress();
    assert!(
        epoll_readable(fd, WAIT),
        "an armed CQ's completion wakes epoll"
    );
    assert_eq!(p.cha.get_cq_event().unwrap(), Some(p.cqa.cq_id()));
    assert_eq!(p.cha.get_cq_event().unwrap(), None);
    assert!(!poll_readable(fd), "taken: no longer readable");
    let got = drain(&p.cqa);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].wr_id, 1);
    assert!(
        !poll_readable(p.chb.fd()),
        "the other side's channel stayed quiet"
    );
}

#[test]
fn notify_is_one_shot() {
    let p = pair();
    p.cqa.req_notify(CqNotify::Next).unwrap();
    send(&p.qa, &p.bufa, 1, write_to(&p, 1), SendFlags::SIGNALED);
    send(&p.qa, &p.bufa, 2, write_to(&p, 2), SendFlags::SIGNALED);
    p.fabric.progress();
    assert!(epoll_readable(p.cha.fd(), WAIT));
    assert_eq!(p.cha.get_cq_event().unwrap(), Some(p.cqa.cq_id()));
    assert_eq!(
        p.cha.get_cq_event().unwrap(),
        None,
        "two completions, one event: the arm fired once"
    );
    // Not re-armed: a third completion fires nothing.
    send(&p.qa, &p.bufa, 3, write_to(&p, 3), SendFlags::SIGNALED);
    p.fabric.progress();
    assert!(!epoll_readable(p.cha.fd(), Duration::from_millis(20)));
    assert_eq!(drain(&p.cqa).len(), 3);
    // Re-armed: the next one does.
    p.cqa.req_notify(CqNotify::Next).unwrap();
    send(&p.qa, &p.bufa, 4, write_to(&p, 4), SendFlags::SIGNALED);
    p.fabric.progress();
    assert!(epoll_readable(p.cha.fd(), WAIT));
}

#[test]
fn completion_before_arming_does_not_fire_so_poll_after_arming() {
    let p = pair();
    send(&p.qa, &p.bufa, 1, write_to(&p, 1), SendFlags::SIGNALED);
    p.fabric.progress();
    // The standard pattern: arm, then poll. The completion that arrived
    // before the arm fires nothing; the poll after the arm finds it.
    p.cqa.req_notify(CqNotify::Next).unwrap();
    assert!(
        !epoll_readable(p.cha.fd(), Duration::from_millis(20)),
        "a completion already in the CQ does not fire a later arm"
    );
    let mut out = [Completion::default(); 4];
    p.fabric.set_paused(true);
    assert_eq!(
        p.cqa.poll(&mut out).unwrap(),
        1,
        "the poll after arming finds it"
    );
    assert_eq!(out[0].wr_id, 1);
    // Still armed: the next completion fires.
    send(&p.qa, &p.bufa, 2, write_to(&p, 2), SendFlags::SIGNALED);
    p.fabric.set_paused(false);
    p.fabric.progress();
    assert!(epoll_readable(p.cha.fd(), WAIT));
}

#[test]
fn a_thread_blocked_in_epoll_wakes_on_the_completion() {
    let p = pair();
    p.cqa.req_notify(CqNotify::Next).unwrap();
    let fd = p.cha.fd();
    let waiter = std::thread::spawn(move || epoll_readable(fd, Duration::from_secs(10)));
    std::thread::sleep(Duration::from_millis(50));
    send(&p.qa, &p.bufa, 1, write_to(&p, 1), SendFlags::SIGNALED);
    p.fabric.progress();
    assert!(waiter.join().unwrap(), "the waiting thread woke");
    assert_eq!(p.cha.get_cq_event().unwrap(), Some(p.cqa.cq_id()));
}

#[test]
fn solicited_only_fires_on_a_solicited_receive_or_an_error() {
    let p = pair();
    for i in 0..3 {
        recv(&p.qb, &p.bufb, 100 + i);
    }
    p.cqb.req_notify(CqNotify::Solicited).unwrap();
    send(&p.qa, &p.bufa, 1, SendOp::Send, SendFlags::SIGNALED);
    p.fabric.progress();
    assert!(
        !epoll_readable(p.chb.fd(), Duration::from_millis(20)),
        "an unsolicited SEND's receive does not fire a solicited-only arm"
    );
    send(
        &p.qa,
        &p.bufa,
        2,
        SendOp::Send,
        SendFlags::SIGNALED | SendFlags::SOLICITED,
    );
    p.fabric.progress();
    assert!(
        epoll_readable(p.chb.fd(), WAIT),
        "a solicited SEND fires it"
    );
    assert_eq!(p.chb.get_cq_event().unwrap(), Some(p.cqb.cq_id()));
    assert_eq!(drain(&p.cqb).len(), 2);
    // An error completion fires a solicited-only arm too: the flush of the
    // last receive when the QP goes to ERROR.
    p.cqb.req_notify(CqNotify::Solicited).unwrap();
    p.qb.to_error().unwrap();
    assert!(
        epoll_readable(p.chb.fd(), WAIT),
        "an error completion fires it"
    );
    let flushed = drain(&p.cqb);
    assert_eq!(flushed.len(), 1);
    assert_eq!(flushed[0].status, WcStatus::WR_FLUSH_ERR);
}

#[test]
fn one_channel_serves_many_cqs_and_names_each() {
    init_tracing();
    let fabric = SimFabric::new();
    let a = Node::new(&fabric, "a", DeviceConfig::default());
    let ch = a.ctx.create_comp_channel().unwrap();
    let cq1 = a.ctx.create_cq_on_channel(8, &ch, 0).unwrap();
    let cq2 = a.ctx.create_cq_on_channel(8, &ch, 7).unwrap();
    assert_ne!(cq1.cq_id(), cq2.cq_id());
    let qp1 = a.pd.create_qp(&QpCaps::default(), &cq1, &cq1).unwrap();
    let qp2 = a.pd.create_qp(&QpCaps::default(), &cq2, &cq2).unwrap();
    for (qp, cq) in [(&qp1, &cq1), (&qp2, &cq2)] {
        qp.to_init(&InitParams::default()).unwrap();
        recv(qp, &Buf::new(&a.pd, 4096, AccessFlags::transfer()), 1);
        cq.req_notify(CqNotify::Next).unwrap();
    }
    // Moving both QPs to ERROR flushes one receive on each CQ.
    qp2.to_error().unwrap();
    qp1.to_error().unwrap();
    assert!(epoll_readable(ch.fd(), WAIT));
    assert_eq!(ch.pending(), 2);
    assert_eq!(
        ch.get_cq_event().unwrap(),
        Some(cq2.cq_id()),
        "in firing order"
    );
    assert_eq!(ch.get_cq_event().unwrap(), Some(cq1.cq_id()));
    assert_eq!(ch.get_cq_event().unwrap(), None);
}

#[test]
fn comp_vector_is_bounded_and_req_notify_needs_a_channel() {
    init_tracing();
    let fabric = SimFabric::new();
    let mlx = Node::new(&fabric, "mlx", DeviceConfig::default());
    let rxe = Node::new(&fabric, "rxe", DeviceConfig::rxe_like());
    let vectors = mlx.ctx.query_device().unwrap().num_comp_vectors;
    assert_eq!(vectors, 8);
    assert_eq!(rxe.ctx.query_device().unwrap().num_comp_vectors, 1);
    let ch = mlx.ctx.create_comp_channel().unwrap();
    mlx.ctx.create_cq_on_channel(8, &ch, vectors - 1).unwrap();
    let err = mlx.ctx.create_cq_on_channel(8, &ch, vectors).unwrap_err();
    assert!(matches!(err, VerbsError::InvalidArgument { .. }), "{err}");
    let rch = rxe.ctx.create_comp_channel().unwrap();
    let err = rxe.ctx.create_cq_on_channel(8, &rch, 1).unwrap_err();
    assert!(matches!(err, VerbsError::InvalidArgument { .. }), "{err}");
    let err = rxe.ctx.create_cq_on_channel(8, &ch, 0).unwrap_err();
    assert!(
        matches!(err, VerbsError::InvalidArgument { .. }),
        "a channel of another device: {err}"
    );
    let plain = mlx.ctx.create_cq(8).unwrap();
    let err = plain.req_notify(CqNotify::Next).unwrap_err();
    assert!(matches!(err, VerbsError::InvalidArgument { .. }), "{err}");
}

#[test]
fn cq_moderation_within_limits_or_not_supported() {
    init_tracing();
    let fabric = SimFabric::new();
    let mlx = Node::new(&fabric, "mlx", DeviceConfig::default());
    let rxe = Node::new(&fabric, "rxe", DeviceConfig::rxe_like());
    let caps = mlx.ctx.query_device().unwrap().cq_moderation.unwrap();
    let ch = mlx.ctx.create_comp_channel().unwrap();
    let cq = mlx.ctx.create_cq_on_channel(8, &ch, 0).unwrap();
    cq.set_moderation(16, 100).unwrap();
    let err = cq
        .set_moderation(16, caps.max_cq_period_us + 1)
        .unwrap_err();
    assert!(matches!(err, VerbsError::InvalidArgument { .. }), "{err}");
    assert_eq!(rxe.ctx.query_device().unwrap().cq_moderation, None);
    let cq = rxe.ctx.create_cq(8).unwrap();
    let err = cq.set_moderation(16, 100).unwrap_err();
    assert!(matches!(err, VerbsError::NotSupported { .. }), "{err}");
    assert!(err.is_unsupported());
    assert_eq!(err.errno(), Some(libc::EOPNOTSUPP));
}

/// CQ moderation on the Manual clock: an armed CQ's event waits for
/// `count` completions, or for `period` µs of virtual time since the first
/// one it held, whichever comes first (and never for real time); in Auto
/// mode nothing is held.
#[test]
fn cq_moderation_gates_the_event_by_count_or_period_on_the_virtual_clock() {
    const NS: Duration = Duration::from_nanos(1);
    let period = Duration::from_micros(100);
    let p = pair();
    let clock = p.fabric.clock();
    clock.set_mode(ClockMode::Manual);
    let fd = p.cha.fd();
    p.cqa.set_moderation(3, 100).unwrap();

    // By count: two completions are held, the third fires the event.
    p.cqa.req_notify(CqNotify::Next).unwrap();
    let start = clock.now();
    for id in 1..=2 {
        send(&p.qa, &p.bufa, id, write_to(&p, id), SendFlags::SIGNALED);
    }
    p.fabric.progress();
    assert_eq!(drain(&p.cqa).len(), 2, "the completions are in the CQ");
    assert!(!poll_readable(fd), "2 of 3 completions: held");
    assert_eq!(clock.next_deadline(), Some(start + period));
    send(&p.qa, &p.bufa, 3, write_to(&p, 3), SendFlags::SIGNALED);
    p.fabric.progress();
    assert!(poll_readable(fd), "3 of 3: fired");
    assert_eq!(p.cha.get_cq_event().unwrap(), Some(p.cqa.cq_id()));
    assert_eq!(p.cha.get_cq_event().unwrap(), None, "one event");
    assert_eq!(clock.next_deadline(), None, "the period is off once fired");
    assert_eq!(drain(&p.cqa).len(), 1);

    // By period: one completion, held until the period has passed.
    p.cqa.req_notify(CqNotify::Next).unwrap();
    send(&p.qa, &p.bufa, 4, write_to(&p, 4), SendFlags::SIGNALED);
    p.fabric.progress();
    assert!(!poll_readable(fd), "1 of 3: held");
    clock.advance(period - NS);
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        !poll_readable(fd),
        "a tick before the period (real time passing does not count)"
    );
    clock.advance(NS);
    assert!(poll_readable(fd), "the period passed: fired");
    assert_eq!(p.cha.get_cq_event().unwrap(), Some(p.cqa.cq_id()));
    assert_eq!(drain(&p.cqa).len(), 1);

    // Auto mode: the first completion fires, as without moderation.
    clock.set_mode(ClockMode::Auto);
    p.cqa.req_notify(CqNotify::Next).unwrap();
    send(&p.qa, &p.bufa, 5, write_to(&p, 5), SendFlags::SIGNALED);
    p.fabric.progress();
    assert!(poll_readable(fd), "Auto: not held");
    assert_eq!(p.cha.get_cq_event().unwrap(), Some(p.cqa.cq_id()));
}

// ------------------------------------------------------------ async events

#[test]
fn async_fd_is_nonblocking_and_readable_with_an_event() {
    let p = pair();
    let fd = p.a.ctx.async_fd();
    assert!(is_nonblocking(fd));
    assert!(!poll_readable(fd));
    assert_eq!(p.a.ctx.next_async_event().unwrap(), None);
    p.a.verbs.set_port_state("sim0", 1, PortState::Down);
    assert!(epoll_readable(fd, WAIT));
    assert_eq!(
        p.a.ctx.next_async_event().unwrap(),
        Some(AsyncEvent::PortError { port: 1 })
    );
    assert!(!poll_readable(fd), "taken: quiet again");
    assert_eq!(p.a.ctx.query_port(1).unwrap().state, PortState::Down);
    p.a.verbs.set_port_state("sim0", 1, PortState::Active);
    assert!(epoll_readable(fd, WAIT));
    assert_eq!(events(&p.a.ctx), [AsyncEvent::PortActive { port: 1 }]);
    assert!(
        !poll_readable(p.b.ctx.async_fd()),
        "the other device saw nothing"
    );
    // Every open context of the device gets device-wide events.
    let second = p.a.verbs.open("sim0").unwrap();
    p.a.verbs
        .raise_async_event("sim0", AsyncEvent::GidChange { port: 1 });
    assert_eq!(events(&p.a.ctx), [AsyncEvent::GidChange { port: 1 }]);
    assert_eq!(events(&second), [AsyncEvent::GidChange { port: 1 }]);
}

/// A WRITE past the end of b's buffer: REM_ACCESS_ERR at a, and a QP
/// access error on b's QP (the responder) readable on b's async fd.
fn responder_access_error_on_b(p: &Pair) {
    let op = SendOp::Write {
        remote_addr: p.bufb.mr.addr() + 4096 - 8,
        rkey: p.bufb.mr.rkey(),
    };
    send(&p.qa, &p.bufa, 1, op, SendFlags::SIGNALED);
    assert_eq!(drain(&p.cqa)[0].status, WcStatus::REM_ACCESS_ERR);
    assert!(epoll_readable(p.b.ctx.async_fd(), WAIT));
    assert_eq!(
        events(&p.b.ctx),
        [AsyncEvent::QpAccessError {
            qp_num: p.qb.qp_num()
        }]
    );
}

#[test]
fn responder_access_violation_raises_qp_access_error_on_the_responder() {
    let p = pair();
    // WRITE past the end of b's buffer: REM_ACCESS_ERR at a, QP access
    // error on b's QP (the responder).
    responder_access_error_on_b(&p);
    assert_eq!(
        events(&p.a.ctx),
        [],
        "the requester learns from its completion"
    );
    assert_eq!(p.qb.state().unwrap(), QpState::Error);
}

#[test]
fn an_rxe_like_responder_raises_no_event() {
    let p = pair_with(SimFabric::new(), DeviceConfig::rxe_like());
    let op = SendOp::Write {
        remote_addr: p.bufb.mr.addr() + 4096 - 8,
        rkey: p.bufb.mr.rkey(),
    };
    send(&p.qa, &p.bufa, 1, op, SendFlags::SIGNALED);
    assert_eq!(drain(&p.cqa)[0].status, WcStatus::REM_ACCESS_ERR);
    assert_eq!(
        p.qb.state().unwrap(),
        QpState::Error,
        "it failed all the same"
    );
    assert!(
        !epoll_readable(p.b.ctx.async_fd(), Duration::from_millis(20)),
        "rxe reports no QP access error event (measured on kernel 6.1)"
    );
}

#[test]
fn invalid_request_raises_qp_request_error_on_the_responder() {
    init_tracing();
    let fabric = SimFabric::new();
    let a = Node::new(&fabric, "a", DeviceConfig::default());
    let b = Node::new(&fabric, "b", DeviceConfig::default());
    let (cqa, cqb) = (a.ctx.create_cq(16).unwrap(), b.ctx.create_cq(16).unwrap());
    let qa = a.pd.create_qp(&QpCaps::default(), &cqa, &cqa).unwrap();
    let qb = b.pd.create_qp(&QpCaps::default(), &cqb, &cqb).unwrap();
    // b's QP grants no remote write.
    connect_one(&a, &qa, &b, &qb, |_| {});
    qb.to_init(&InitParams {
        access: AccessFlags::LOCAL_WRITE,
        ..InitParams::default()
    })
    .unwrap();
    let (info_a, _) = a.info(&qa, PSN);
    let (own, sgid) = b.info(&qb, PSN);
    qb.to_rtr(&RtrParams::new(info_a, sgid, own.mtu)).unwrap();
    qa.to_rts(&RtsParams {
        sq_psn: PSN,
        ..RtsParams::default()
    })
    .unwrap();
    let bufa = Buf::new(&a.pd, 4096, AccessFlags::transfer());
    let bufb = Buf::new(&b.pd, 4096, AccessFlags::transfer());
    let op = SendOp::Write {
        remote_addr: bufb.mr.addr(),
        rkey: bufb.mr.rkey(),
    };
    send(&qa, &bufa, 1, op, SendFlags::SIGNALED);
    assert_eq!(drain(&cqa)[0].status, WcStatus::REM_INV_REQ_ERR);
    assert_eq!(
        events(&b.ctx),
        [AsyncEvent::QpRequestError {
            qp_num: qb.qp_num()
        }]
    );
}

#[test]
fn cq_overrun_raises_cq_error() {
    init_tracing();
    let fabric = SimFabric::new();
    let a = Node::new(&fabric, "a", DeviceConfig::default());
    let cq = a.ctx.create_cq(2).unwrap();
    let qp = a.pd.create_qp(&QpCaps::default(), &cq, &cq).unwrap();
    qp.to_init(&InitParams::default()).unwrap();
    let buf = Buf::new(&a.pd, 4096, AccessFlags::transfer());
    for i in 0..3 {
        recv(&qp, &buf, i);
    }
    qp.to_error().unwrap(); // three flushes into a CQ of two
    assert!(epoll_readable(a.ctx.async_fd(), WAIT));
    assert_eq!(events(&a.ctx), [AsyncEvent::CqError { cq: cq.cq_id() }]);
}

#[test]
fn affiliated_events_reach_only_the_owning_context_port_events_every_one() {
    // b's device opened twice in one process: `p.b.ctx` owns qb and cqb,
    // `other` its own PD, CQ and QP. As in verbs, a QP or CQ event goes to
    // the context that made the object, a port event to both.
    let p = pair();
    let other = p.b.verbs.open("sim0").unwrap();
    let other_pd = other.alloc_pd().unwrap();
    let other_cq = other.create_cq(2).unwrap();
    let other_qp = other_pd
        .create_qp(&QpCaps::default(), &other_cq, &other_cq)
        .unwrap();
    let quiet = Duration::from_millis(20);

    // A responder access error on qb: its owner hears it, `other` not.
    responder_access_error_on_b(&p);
    assert!(
        !epoll_readable(other.async_fd(), quiet),
        "another context of the device does not hear of a QP it does not own"
    );
    assert_eq!(events(&other), []);

    // A CQ overrun on `other`'s CQ: the other way round.
    other_qp.to_init(&InitParams::default()).unwrap();
    let buf = Buf::new(&other_pd, 4096, AccessFlags::transfer());
    for i in 0..3 {
        recv(&other_qp, &buf, i);
    }
    other_qp.to_error().unwrap(); // three flushes into a CQ of two
    assert!(epoll_readable(other.async_fd(), WAIT));
    assert_eq!(
        events(&other),
        [AsyncEvent::CqError {
            cq: other_cq.cq_id()
        }]
    );
    assert!(
        !epoll_readable(p.b.ctx.async_fd(), quiet),
        "nor of a CQ it did not create"
    );

    // Injected affiliated events route the same way.
    let qp_fatal = AsyncEvent::QpFatal {
        qp_num: other_qp.qp_num(),
    };
    p.b.verbs.raise_async_event("sim0", qp_fatal);
    let cq_error = AsyncEvent::CqError { cq: p.cqb.cq_id() };
    p.b.verbs.raise_async_event("sim0", cq_error);
    assert_eq!(events(&other), [qp_fatal]);
    assert_eq!(events(&p.b.ctx), [cq_error]);

    // A port event is unaffiliated: every context of the device hears it.
    p.b.verbs.set_port_state("sim0", 1, PortState::Down);
    assert!(epoll_readable(p.b.ctx.async_fd(), WAIT));
    assert!(epoll_readable(other.async_fd(), WAIT));
    assert_eq!(events(&p.b.ctx), [AsyncEvent::PortError { port: 1 }]);
    assert_eq!(events(&other), [AsyncEvent::PortError { port: 1 }]);
    assert_eq!(events(&p.a.ctx), [], "nor any context of another device");
}

#[test]
fn device_loss_raises_device_fatal_and_by_default_still_flushes() {
    let plan = FaultPlan::new();
    let p = pair_with(
        SimFabric::with_faults(plan.clone()),
        DeviceConfig::default(),
    );
    recv(&p.qb, &p.bufb, 9);
    plan.fail_next(FaultSite::VerbsPostSend, Fault::DeviceLost);
    let request = SendRequest {
        wr_id: 1,
        op: SendOp::Send,
        sg_list: [p.bufb.sge(0, 8)].into_iter().collect(),
        flags: SendFlags::SIGNALED,
    };
    // SAFETY: registered buffer, alive for the test.
    let err = unsafe { p.qb.post_send(&[request]) }.unwrap_err();
    assert!(matches!(err.error, VerbsError::DeviceLost { .. }), "{err}");
    assert!(epoll_readable(p.b.ctx.async_fd(), WAIT));
    assert_eq!(events(&p.b.ctx), [AsyncEvent::DeviceFatal]);
    let flushed = drain(&p.cqb);
    assert_eq!(
        flushed.len(),
        1,
        "the sim's default: outstanding work flushes"
    );
    assert_eq!(flushed[0].status, WcStatus::WR_FLUSH_ERR);
    plan.assert_all_fired();
}

#[test]
fn hardware_like_device_loss_yields_no_completion_only_the_event() {
    let device = DeviceConfig {
        device_loss_flushes: false,
        ..DeviceConfig::default()
    };
    let p = pair_with(SimFabric::new(), device);
    recv(&p.qb, &p.bufb, 9);
    p.cqb.req_notify(CqNotify::Next).unwrap();
    p.b.verbs.raise_async_event("sim0", AsyncEvent::DeviceFatal);
    assert!(epoll_readable(p.b.ctx.async_fd(), WAIT));
    assert_eq!(events(&p.b.ctx), [AsyncEvent::DeviceFatal]);
    assert!(
        !epoll_readable(p.chb.fd(), Duration::from_millis(20)),
        "no completion, so no CQ event"
    );
    let mut out = [Completion::default(); 4];
    let err = p.cqb.poll(&mut out).unwrap_err();
    assert!(matches!(err, VerbsError::DeviceLost { .. }), "{err}");
}

#[test]
fn every_injectable_event_arrives_as_raised() {
    let p = pair();
    let qp_num = p.qa.qp_num();
    let raised = [
        AsyncEvent::PortError { port: 1 },
        AsyncEvent::PortActive { port: 1 },
        AsyncEvent::GidChange { port: 1 },
        AsyncEvent::ClientReregister { port: 1 },
        AsyncEvent::LidChange { port: 1 },
        AsyncEvent::QpFatal { qp_num },
        AsyncEvent::QpAccessError { qp_num },
        AsyncEvent::QpRequestError { qp_num },
        AsyncEvent::QpLastWqeReached { qp_num },
        AsyncEvent::PathMigrated { qp_num },
        AsyncEvent::PathMigrationError { qp_num },
        AsyncEvent::CommunicationEstablished { qp_num },
        AsyncEvent::CqError { cq: p.cqa.cq_id() },
        AsyncEvent::SrqLimitReached { srq: 5 },
        AsyncEvent::SrqError { srq: 5 },
        AsyncEvent::Other { code: 20 },
        AsyncEvent::DeviceFatal,
    ];
    for event in raised {
        p.a.verbs.raise_async_event("sim0", event);
        assert_eq!(
            AsyncEvent::from_native(
                event.code(),
                event
                    .qp_num()
                    .map(u64::from)
                    .or(event.port().map(u64::from))
                    .unwrap_or(match event {
                        AsyncEvent::CqError { cq } => cq,
                        AsyncEvent::SrqError { srq } | AsyncEvent::SrqLimitReached { srq } => srq,
                        _ => 0,
                    })
            ),
            event,
            "native round trip"
        );
    }
    assert!(epoll_readable(p.a.ctx.async_fd(), WAIT));
    assert_eq!(events(&p.a.ctx), raised);
    assert!(!poll_readable(p.a.ctx.async_fd()));
}

// ----------------------------------------------------- reset and recycle

#[test]
fn a_failed_qp_is_reset_and_reconnected_to_a_new_peer() {
    let p = pair();
    // Fail the QP: a WRITE with a wrong rkey.
    let bad = SendOp::Write {
        remote_addr: p.bufb.mr.addr(),
        rkey: p.bufb.mr.rkey() ^ 0x5555,
    };
    send(&p.qa, &p.bufa, 1, bad, SendFlags::SIGNALED);
    send(&p.qa, &p.bufa, 2, write_to(&p, 2), SendFlags::SIGNALED);
    let got = drain(&p.cqa);
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].status, WcStatus::REM_ACCESS_ERR);
    assert_eq!(got[1].status, WcStatus::WR_FLUSH_ERR);
    assert_eq!(p.qa.state().unwrap(), QpState::Error);
    // Sends on a QP in ERROR flush; RESET refuses none of that.
    p.qa.to_reset().unwrap();
    assert_eq!(p.qa.state().unwrap(), QpState::Reset);
    let reset = p.qa.query().unwrap();
    assert_eq!(reset.dest_qp_num, 0, "the peer is forgotten");
    assert_eq!(reset.path_mtu, None);
    // A new peer QP on b; a's QP goes INIT, RTR, RTS towards it.
    let qb2 =
        p.b.pd
            .create_qp(&QpCaps::default(), &p.cqb, &p.cqb)
            .unwrap();
    connect(&p.a, &p.qa, &p.b, &qb2, RtsParams::default());
    assert_eq!(p.qa.query().unwrap().dest_qp_num, qb2.qp_num());
    send(&p.qa, &p.bufa, 3, write_to(&p, 3), SendFlags::SIGNALED);
    let got = drain(&p.cqa);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].wr_id, 3);
    assert_eq!(got[0].status, WcStatus::SUCCESS, "the recycled QP works");
}

#[test]
fn reset_drops_outstanding_requests_without_completions_and_frees_the_queue() {
    init_tracing();
    let fabric = SimFabric::new();
    let a = Node::new(&fabric, "a", DeviceConfig::default());
    let b = Node::new(&fabric, "b", DeviceConfig::default());
    let (cqa, cqb) = (a.ctx.create_cq(64).unwrap(), b.ctx.create_cq(64).unwrap());
    let caps = QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        ..QpCaps::default()
    };
    let qa = a.pd.create_qp(&caps, &cqa, &cqa).unwrap();
    let qb = b.pd.create_qp(&caps, &cqb, &cqb).unwrap();
    connect(&a, &qa, &b, &qb, RtsParams::default());
    let bufa = Buf::new(&a.pd, 4096, AccessFlags::transfer());
    fabric.set_paused(true);
    for i in 0..4 {
        recv(&qa, &bufa, 100 + i);
        send(&qa, &bufa, i, SendOp::Send, SendFlags::SIGNALED);
    }
    qa.to_reset().unwrap();
    fabric.set_paused(false);
    assert_eq!(drain(&cqa), [], "RESET completes nothing");
    // The queues are free again: four more fit after reconnecting.
    connect_one(&a, &qa, &b, &qb, |_| {});
    for i in 0..4 {
        recv(&qa, &bufa, 200 + i);
    }
    // Nothing from before the reset is left: a flush now reports exactly
    // the four receives posted since.
    qa.to_error().unwrap();
    let flushed = drain(&cqa);
    let ids: Vec<u64> = flushed.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [200, 201, 202, 203], "{flushed:?}");
    assert!(flushed.iter().all(|c| c.status == WcStatus::WR_FLUSH_ERR));
}

#[test]
fn reset_on_a_connectx_like_device_purges_the_qps_completions() {
    let device = DeviceConfig {
        destroy_qp_purges_cq: true,
        ..DeviceConfig::default()
    };
    let p = pair_with(SimFabric::new(), device);
    send(&p.qa, &p.bufa, 1, write_to(&p, 1), SendFlags::SIGNALED);
    p.fabric.progress();
    p.qa.to_reset().unwrap();
    assert_eq!(drain(&p.cqa), [], "libmlx5 cleans the CQ on RESET");
}

// --------------------------------------------- granted caps and attributes

#[test]
fn query_reports_granted_caps_and_clamped_read_depths() {
    init_tracing();
    let fabric = SimFabric::new();
    let a = Node::new(&fabric, "a", DeviceConfig::default());
    let b = Node::new(&fabric, "b", DeviceConfig::default());
    let limits = a.ctx.query_device().unwrap();
    let (cqa, cqb) = (a.ctx.create_cq(16).unwrap(), b.ctx.create_cq(16).unwrap());
    let caps = QpCaps {
        max_send_wr: 33,
        max_recv_wr: 17,
        max_send_sge: 3,
        max_recv_sge: 2,
        max_inline_data: 128,
    };
    let qa = a.pd.create_qp(&caps, &cqa, &cqa).unwrap();
    let qb = b.pd.create_qp(&caps, &cqb, &cqb).unwrap();
    let before = qa.query().unwrap();
    assert_eq!(before.state, QpState::Reset);
    assert_eq!(before.caps, qa.caps());
    assert_eq!(before.max_rd_atomic, 0);
    connect_one(&a, &qa, &b, &qb, |p| p.max_dest_rd_atomic = 200);
    qa.to_rts(&RtsParams {
        max_rd_atomic: 200,
        timeout: 17,
        retry_cnt: 5,
        rnr_retry: 6,
        sq_psn: 0x42,
    })
    .unwrap();
    let got = qa.query().unwrap();
    assert_eq!(got.state, QpState::ReadyToSend);
    assert_eq!(got.caps, caps, "the sim grants what was asked");
    assert_eq!(u32::from(got.max_rd_atomic), limits.max_qp_init_rd_atom);
    assert_eq!(u32::from(got.max_dest_rd_atomic), limits.max_qp_rd_atom);
    assert_eq!(got.dest_qp_num, qb.qp_num());
    assert_eq!(got.rq_psn, PSN);
    assert_eq!(got.sq_psn, 0x42);
    assert_eq!((got.timeout, got.retry_cnt, got.rnr_retry), (17, 5, 6));
    assert_eq!(got.min_rnr_timer, 12);
    assert!(got.path_mtu.is_some());
}

// ------------------------------------------------- connection event fds

#[test]
fn a_connections_event_fd_turns_readable_when_the_peer_disconnects() {
    use hal_verbs::{
        ConnectParams, ConnectRequest, Connection, ConnectionManager, ConnectionState, Listener,
    };
    use std::net::{IpAddr, SocketAddr};
    init_tracing();
    let fabric = SimFabric::new();
    let server = Node::new(&fabric, "server", DeviceConfig::default());
    let client = Node::new(&fabric, "client", DeviceConfig::default());
    let (scq, ccq) = (
        server.ctx.create_cq(16).unwrap(),
        client.ctx.create_cq(16).unwrap(),
    );
    let ip = IpAddr::V4(server.verbs.device_ipv4("sim0").unwrap());
    let listener = server
        .verbs
        .connection_manager()
        .unwrap()
        .listen(SocketAddr::new(ip, 7480), 4)
        .unwrap();
    let params = ConnectParams {
        timeout: Duration::from_secs(5),
        ..ConnectParams::default()
    };
    let (server_conn, client_conn) = std::thread::scope(|s| {
        let srv = s.spawn(|| {
            let request = listener.next_request(Duration::from_secs(5)).unwrap();
            request
                .accept(&server.pd, &scq, &scq, &params, b"")
                .unwrap()
        });
        let conn = client
            .verbs
            .connection_manager()
            .unwrap()
            .connect(
                SocketAddr::new(ip, 7480),
                &client.pd,
                &ccq,
                &ccq,
                &params,
                b"",
            )
            .unwrap();
        (srv.join().unwrap(), conn)
    });
    let fd = server_conn.event_fd();
    assert!(is_nonblocking(fd));
    assert!(
        !epoll_readable(fd, Duration::from_millis(20)),
        "connected: quiet"
    );
    // A thread waits on the server's fd; the client disconnects.
    let waiter = std::thread::spawn(move || epoll_readable(fd, Duration::from_secs(10)));
    std::thread::sleep(Duration::from_millis(30));
    client_conn.disconnect().unwrap();
    assert!(
        waiter.join().unwrap(),
        "the peer's disconnect wakes the waiter"
    );
    assert_eq!(
        server_conn.poll_state(Duration::ZERO).unwrap(),
        ConnectionState::Disconnected
    );
    assert!(
        !poll_readable(server_conn.event_fd()),
        "poll_state consumed what made it readable"
    );
    assert!(
        poll_readable(client_conn.event_fd()),
        "our own disconnect too"
    );
}

// ------------------------------------------------------------- poll_into

#[test]
fn poll_into_drains_the_cq_past_any_chunk() {
    let p = pair();
    let mut out = vec![Completion::default(); 3]; // appended to, kept
    // 100 signaled WRITEs (the QP's queue takes 256), all completed.
    for i in 0..100 {
        send(&p.qa, &p.bufa, 10 + i, write_to(&p, i), SendFlags::SIGNALED);
    }
    let n = p.cqa.poll_into(&mut out).unwrap();
    assert_eq!(n, 100);
    assert_eq!(out.len(), 103);
    let ids: Vec<u64> = out[3..].iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, (10..110).collect::<Vec<_>>(), "in order, none lost");
    assert_eq!(p.cqa.poll_into(&mut out).unwrap(), 0, "empty now");
    assert_eq!(out.len(), 103);
}

#[test]
fn a_port_that_is_down_carries_no_traffic() {
    let p = pair();
    p.b.verbs.set_port_state("sim0", 1, PortState::Down);
    assert_eq!(events(&p.b.ctx), [AsyncEvent::PortError { port: 1 }]);
    send(&p.qa, &p.bufa, 1, write_to(&p, 1), SendFlags::SIGNALED);
    let got = drain(&p.cqa);
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0].status,
        WcStatus::RETRY_EXC_ERR,
        "the peer's link is down: the requester's retries run out"
    );
}

#[test]
fn on_an_rxe_like_device_a_request_on_a_down_link_fails_at_once() {
    let p = pair_with(SimFabric::new(), DeviceConfig::rxe_like());
    p.a.verbs.set_port_state("sim0", 1, PortState::Down);
    send(&p.qa, &p.bufa, 1, write_to(&p, 1), SendFlags::SIGNALED);
    let got = drain(&p.cqa);
    assert_eq!(got[0].status, WcStatus::LOC_QP_OP_ERR, "as rxe answers");
    assert_eq!(p.qa.state().unwrap(), QpState::Error);
}
