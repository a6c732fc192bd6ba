//! Completion channels, async events, QP reset/recycle and granted
//! attributes of the rdma-core backend on SoftRoCE's `rxe0` (in the VM:
//! `GDR_EXPECT_RXE=1` with `softroce/run-in-vm.sh` as the cargo runner).
//!
//! Without an RDMA device every test skips with its reason on stderr; with
//! `GDR_EXPECT_RXE=1` a missing `rxe0` is a failure. Two queue pairs of
//! `rxe0` connected to each other stand in for two peers.
//!
//! The port test takes the guest's netdev (`GDR_RXE_NETDEV`, default
//! `dummy0`, the VM runner's) down and up with `ip link`: it runs only
//! when `GDR_EXPECT_RXE=1` (it needs the VM's root and its private netdev)
//! and brings the link back up whatever happens. So does the second half
//! of the two-context test (a CQ error reaches only the context that made
//! the CQ, a port event both).

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use gdr_tests::fd::{epoll_readable, is_nonblocking, poll_readable};
use gdr_tests::rxe::{self, HostBuf, expect_rxe, local_info, open_rxe, serial, sge};
use gdr_tests::skip;
use hal_verbs::rdma::{RdmaCompChannel, RdmaContext, RdmaCq, RdmaMr, RdmaPd, RdmaQp};
use hal_verbs::{
    AccessFlags, AsyncEvent, Completion, CompletionChannel, CompletionQueue, Context, CqNotify,
    InitParams, MemoryRegion, PortState, ProtectionDomain, QpCaps, QpState, QueuePair, RecvRequest,
    RtrParams, RtsParams, SendFlags, SendOp, SendRequest, VerbsError, WcStatus,
};

/// How long a completion or an event may take under TCG.
const TIMEOUT: Duration = Duration::from_secs(20);
/// How long "nothing happens" is watched.
const QUIET: Duration = Duration::from_millis(300);

// --------------------------------------------------------- verbs helpers

fn post_send(qp: &RdmaQp, requests: &[SendRequest]) {
    // SAFETY: every test keeps its buffers and regions alive until it has
    // polled the completions of what it posted.
    unsafe { qp.post_send(requests) }.expect("post_send");
}

fn post_recv(qp: &RdmaQp, requests: &[RecvRequest]) {
    // SAFETY: as for `post_send`.
    unsafe { qp.post_recv(requests) }.expect("post_recv");
}

/// Connects `a` and `b` (both of `ctx`) to each other, starting at `psn`,
/// with the READ depths asked for.
fn connect(ctx: &RdmaContext, a: &RdmaQp, b: &RdmaQp, psn: u32, rd_atomic: u8) {
    let (info_a, sgid) = local_info(ctx, a, psn);
    let (info_b, _) = local_info(ctx, b, psn);
    for (qp, peer) in [(a, info_b), (b, info_a)] {
        qp.to_init(&InitParams::default()).expect("INIT");
        let mut rtr = RtrParams::new(peer, sgid, peer.mtu);
        rtr.max_dest_rd_atomic = rd_atomic;
        qp.to_rtr(&rtr).expect("RTR");
        qp.to_rts(&RtsParams {
            sq_psn: psn,
            max_rd_atomic: rd_atomic,
            ..RtsParams::default()
        })
        .expect("RTS");
    }
}

/// Polls until `n` completions arrived.
fn wait(cq: &RdmaCq, n: usize) -> Vec<Completion> {
    rxe::wait(cq, n, TIMEOUT)
}

/// Two connected QPs of rxe0, each with its own CQ on one channel.
struct Setup {
    ctx: RdmaContext,
    pd: RdmaPd,
    ch: RdmaCompChannel,
    cq_a: RdmaCq,
    cq_b: RdmaCq,
    a: RdmaQp,
    b: RdmaQp,
    buf_a: HostBuf,
    buf_b: HostBuf,
    mr_a: RdmaMr,
    mr_b: RdmaMr,
}

const LEN: usize = 4096;

fn setup(test: &str) -> Option<Setup> {
    let (_provider, ctx) = open_rxe(test)?;
    let pd = ctx.alloc_pd().expect("PD");
    let ch = ctx.create_comp_channel().expect("ibv_create_comp_channel");
    let cq_a = ctx.create_cq_on_channel(64, &ch, 0).expect("CQ a");
    let cq_b = ctx.create_cq_on_channel(64, &ch, 0).expect("CQ b");
    let caps = QpCaps::default();
    let a = pd.create_qp(&caps, &cq_a, &cq_a).expect("QP a");
    let b = pd.create_qp(&caps, &cq_b, &cq_b).expect("QP b");
    connect(&ctx, &a, &b, 0x10, 16);
    let buf_a = HostBuf::new(LEN, 1);
    let buf_b = HostBuf::new(LEN, 2);
    let mr_a = buf_a.register(&pd, 0, LEN, AccessFlags::transfer());
    let mr_b = buf_b.register(&pd, 0, LEN, AccessFlags::transfer());
    Some(Setup {
        ctx,
        pd,
        ch,
        cq_a,
        cq_b,
        a,
        b,
        buf_a,
        buf_b,
        mr_a,
        mr_b,
    })
}

impl Setup {
    fn write(&self, wr_id: u64, rkey: u32) {
        post_send(
            &self.a,
            &[SendRequest {
                wr_id,
                op: SendOp::Write {
                    remote_addr: self.mr_b.addr(),
                    rkey,
                },
                sg_list: sge(&self.mr_a, 0, 256),
                flags: SendFlags::SIGNALED,
            }],
        );
    }
}

fn async_events(ctx: &RdmaContext) -> Vec<AsyncEvent> {
    std::iter::from_fn(|| ctx.next_async_event().expect("ibv_get_async_event")).collect()
}

// ------------------------------------------------------ completion channels

#[test]
fn channel_readiness_req_notify_get_cq_event_ack() {
    const T: &str = "channel_readiness_req_notify_get_cq_event_ack";
    let _serial = serial();
    let Some(s) = setup(T) else { return };
    let fd = s.ch.fd();
    assert_eq!(fd, s.ch.as_raw_fd());
    assert!(is_nonblocking(fd), "the channel's fd is non-blocking");
    assert_eq!(s.ch.get_cq_event().unwrap(), None, "EAGAIN is None");
    // Armed, idle: quiet.
    s.cq_a
        .req_notify(CqNotify::Next)
        .expect("ibv_req_notify_cq");
    assert!(!epoll_readable(fd, QUIET));
    s.write(1, s.mr_b.rkey());
    assert!(
        epoll_readable(fd, TIMEOUT),
        "an armed CQ's completion wakes epoll"
    );
    assert_eq!(s.ch.get_cq_event().unwrap(), Some(s.cq_a.cq_id()));
    assert_eq!(s.ch.get_cq_event().unwrap(), None);
    assert!(!poll_readable(fd), "event taken: not readable");
    let got = wait(&s.cq_a, 1);
    assert_eq!(got[0].status, WcStatus::SUCCESS);
    // One-shot: not re-armed, the next completion fires nothing.
    s.write(2, s.mr_b.rkey());
    wait(&s.cq_a, 1);
    assert!(!epoll_readable(fd, QUIET), "the arm fired once only");
    // Re-armed: it fires again.
    s.cq_a.req_notify(CqNotify::Next).unwrap();
    s.write(3, s.mr_b.rkey());
    assert!(epoll_readable(fd, TIMEOUT));
    assert_eq!(s.ch.get_cq_event().unwrap(), Some(s.cq_a.cq_id()));
    wait(&s.cq_a, 1);
    // Every event was acknowledged as taken: dropping the CQs (destroy
    // waits for unacknowledged events) must not hang.
    drop(s);
}

#[test]
fn completion_before_arming_needs_the_poll_after_arming() {
    const T: &str = "completion_before_arming_needs_the_poll_after_arming";
    let _serial = serial();
    let Some(s) = setup(T) else { return };
    s.write(1, s.mr_b.rkey());
    // Give the completion time to land, unpolled.
    std::thread::sleep(QUIET);
    s.cq_a.req_notify(CqNotify::Next).unwrap();
    assert!(
        !epoll_readable(s.ch.fd(), QUIET),
        "a completion already in the CQ does not fire a later arm"
    );
    // poll_into drains whatever is there (it landed long ago).
    let mut got = Vec::new();
    assert_eq!(s.cq_a.poll_into(&mut got).unwrap(), 1, "{got:?}");
    assert_eq!(got[0].wr_id, 1, "the poll after arming finds it");
}

#[test]
fn solicited_only_fires_on_a_solicited_send() {
    const T: &str = "solicited_only_fires_on_a_solicited_send";
    let _serial = serial();
    let Some(s) = setup(T) else { return };
    for i in 0..2 {
        post_recv(
            &s.b,
            &[RecvRequest {
                wr_id: 100 + i,
                sg_list: sge(&s.mr_b, 0, LEN as u32),
            }],
        );
    }
    s.cq_b.req_notify(CqNotify::Solicited).unwrap();
    let send = |wr_id, flags| SendRequest {
        wr_id,
        op: SendOp::Send,
        sg_list: sge(&s.mr_a, 0, 64),
        flags,
    };
    post_send(&s.a, &[send(1, SendFlags::SIGNALED)]);
    wait(&s.cq_a, 1);
    assert!(
        !epoll_readable(s.ch.fd(), QUIET),
        "an unsolicited SEND does not fire a solicited-only arm"
    );
    post_send(&s.a, &[send(2, SendFlags::SIGNALED | SendFlags::SOLICITED)]);
    assert!(epoll_readable(s.ch.fd(), TIMEOUT), "a solicited SEND does");
    assert_eq!(s.ch.get_cq_event().unwrap(), Some(s.cq_b.cq_id()));
    wait(&s.cq_a, 1);
    assert_eq!(wait(&s.cq_b, 2).len(), 2);
}

#[test]
fn comp_vector_bounds_and_cq_moderation_not_supported() {
    const T: &str = "comp_vector_bounds_and_cq_moderation_not_supported";
    let _serial = serial();
    let Some((_provider, ctx)) = open_rxe(T) else {
        return;
    };
    let attrs = ctx.query_device().unwrap();
    eprintln!(
        "{T}: num_comp_vectors {} cq_moderation {:?}",
        attrs.num_comp_vectors, attrs.cq_moderation
    );
    assert!(attrs.num_comp_vectors >= 1);
    let ch = ctx.create_comp_channel().unwrap();
    let last = attrs.num_comp_vectors - 1;
    ctx.create_cq_on_channel(8, &ch, last)
        .expect("the last vector");
    let err = ctx
        .create_cq_on_channel(8, &ch, attrs.num_comp_vectors)
        .unwrap_err();
    assert!(matches!(err, VerbsError::InvalidArgument { .. }), "{err}");
    let plain = ctx.create_cq(8).unwrap();
    let err = plain.req_notify(CqNotify::Next).unwrap_err();
    assert!(matches!(err, VerbsError::InvalidArgument { .. }), "{err}");
    // rxe has no CQ moderation: reported as none, refused typed.
    assert_eq!(attrs.cq_moderation, None);
    let cq = ctx.create_cq_on_channel(8, &ch, 0).unwrap();
    let err = cq.set_moderation(16, 100).unwrap_err();
    assert!(matches!(err, VerbsError::NotSupported { .. }), "{err}");
    assert!(err.is_unsupported());
}

// ----------------------------------------------------- reset and recycle

#[test]
fn failed_qps_are_reset_and_reconnected() {
    const T: &str = "failed_qps_are_reset_and_reconnected";
    let _serial = serial();
    let Some(s) = setup(T) else { return };
    let async_fd = s.ctx.async_fd();
    assert!(is_nonblocking(async_fd), "the async fd is non-blocking");
    assert!(async_events(&s.ctx).is_empty(), "no event before the error");
    // A WRITE with a wrong rkey: both QPs go to ERROR.
    s.write(1, s.mr_b.rkey() ^ 0x0100_0000);
    let got = wait(&s.cq_a, 1);
    assert_eq!(got[0].status, WcStatus::REM_ACCESS_ERR);
    let deadline = Instant::now() + TIMEOUT;
    while s.b.state().unwrap() != QpState::Error {
        assert!(Instant::now() < deadline, "the responder never failed");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(s.a.state().unwrap(), QpState::Error);
    // rxe raises no async event for the responder's access error (IBA and
    // mlx5 raise QP_ACCESS_ERR): the sim's rxe_like profile does the same
    // (`DeviceConfig::responder_error_events`); this pins the fact.
    std::thread::sleep(QUIET);
    let seen = async_events(&s.ctx);
    eprintln!("{T}: async events after a responder access error: {seen:?}");
    assert!(
        !seen.iter().any(|e| e.qp_num().is_some()),
        "rxe raised a QP event, unlike kernel 6.1: update rxe_like()'s \
         responder_error_events: {seen:?}"
    );
    // Recycle both: RESET, then INIT/RTR/RTS with new PSNs.
    for qp in [&s.a, &s.b] {
        qp.to_reset().expect("ibv_modify_qp(RESET)");
        assert_eq!(qp.state().unwrap(), QpState::Reset);
        let attrs = qp.query().expect("ibv_query_qp");
        assert_eq!(attrs.state, QpState::Reset);
    }
    connect(&s.ctx, &s.a, &s.b, 0x777, 16);
    s.buf_b.write(0, &[0; 256]);
    s.write(2, s.mr_b.rkey());
    let got = wait(&s.cq_a, 1);
    assert_eq!(got[0].wr_id, 2);
    assert_eq!(got[0].status, WcStatus::SUCCESS, "the recycled QP works");
    assert_eq!(s.buf_b.read()[..256], s.buf_a.read()[..256]);
    // Also recycled towards a brand-new peer.
    s.a.to_reset().unwrap();
    let c =
        s.pd.create_qp(&QpCaps::default(), &s.cq_b, &s.cq_b)
            .expect("QP c");
    connect(&s.ctx, &s.a, &c, 0x999, 16);
    assert_eq!(s.a.query().unwrap().dest_qp_num, c.qp_num());
    s.write(3, s.mr_b.rkey());
    assert_eq!(wait(&s.cq_a, 1)[0].status, WcStatus::SUCCESS);
}

// --------------------------------------------- granted caps and attributes

#[test]
fn granted_caps_and_clamped_read_depths() {
    const T: &str = "granted_caps_and_clamped_read_depths";
    let _serial = serial();
    let Some((_provider, ctx)) = open_rxe(T) else {
        return;
    };
    let limits = ctx.query_device().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let caps = QpCaps {
        max_send_wr: 33,
        max_recv_wr: 17,
        max_send_sge: 3,
        max_recv_sge: 2,
        max_inline_data: 64,
    };
    let a = pd.create_qp(&caps, &cq, &cq).unwrap();
    let b = pd.create_qp(&caps, &cq, &cq).unwrap();
    let before = a.query().unwrap();
    assert_eq!(before.state, QpState::Reset);
    assert_eq!(before.caps, a.caps(), "query reports the granted caps");
    // 255 is above rxe's max_qp_rd_atom (128): clamped before the verb.
    connect(&ctx, &a, &b, 0x20, u8::MAX);
    let got = a.query().unwrap();
    eprintln!(
        "{T}: limits rd_atom {} / init {}; asked {caps:?}; got {got:#?}",
        limits.max_qp_rd_atom, limits.max_qp_init_rd_atom
    );
    assert_eq!(got.state, QpState::ReadyToSend);
    assert!(got.caps.max_send_wr >= caps.max_send_wr, "{got:?}");
    assert!(got.caps.max_inline_data >= caps.max_inline_data, "{got:?}");
    assert_eq!(
        u32::from(got.max_rd_atomic),
        limits.max_qp_init_rd_atom.min(255)
    );
    assert_eq!(
        u32::from(got.max_dest_rd_atomic),
        limits.max_qp_rd_atom.min(255)
    );
    assert_eq!(got.dest_qp_num, b.qp_num());
    assert_eq!((got.sq_psn, got.rq_psn), (0x20, 0x20));
    assert_eq!(got.path_mtu, Some(ctx.query_port(1).unwrap().active_mtu));
    let defaults = RtsParams::default();
    assert_eq!(
        (got.timeout, got.retry_cnt, got.rnr_retry),
        (defaults.timeout, defaults.retry_cnt, defaults.rnr_retry)
    );
}

// ------------------------------------------------------------ async events

/// Brings the netdev back up when dropped.
struct LinkGuard(String);

fn ip_link(dev: &str, state: &str) {
    let ip = ["/usr/sbin/ip", "/sbin/ip", "ip"]
        .into_iter()
        .find(|p| !p.starts_with('/') || std::path::Path::new(p).exists())
        .unwrap();
    let status = std::process::Command::new(ip)
        .args(["link", "set", dev, state])
        .status()
        .unwrap_or_else(|e| panic!("running {ip}: {e}"));
    assert!(status.success(), "ip link set {dev} {state}: {status}");
}

impl Drop for LinkGuard {
    fn drop(&mut self) {
        ip_link(&self.0, "up");
    }
}

/// Waits (up to [`TIMEOUT`]) for port 1 of `ctx` to be ACTIVE again.
fn wait_port_active(ctx: &RdmaContext) {
    let deadline = Instant::now() + TIMEOUT;
    while ctx.query_port(1).unwrap().state != PortState::Active {
        assert!(Instant::now() < deadline, "the port never came back");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Reads async events until one matches `want`, or fails after TIMEOUT.
fn wait_event(ctx: &RdmaContext, want: AsyncEvent, seen: &mut Vec<AsyncEvent>) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "no {want:?} within {TIMEOUT:?}; saw {seen:?}"
        );
        if epoll_readable(ctx.async_fd(), left) {
            let got = async_events(ctx);
            let found = got.contains(&want);
            seen.extend(got);
            if found {
                return;
            }
        }
    }
}

#[test]
fn port_down_and_up_raise_port_error_and_port_active() {
    const T: &str = "port_down_and_up_raise_port_error_and_port_active";
    let _serial = serial();
    if !expect_rxe() {
        skip(
            T,
            "takes the VM's netdev down: runs only with GDR_EXPECT_RXE=1",
        );
        return;
    }
    let Some((_provider, ctx)) = open_rxe(T) else {
        return;
    };
    let netdev = std::env::var("GDR_RXE_NETDEV").unwrap_or_else(|_| "dummy0".into());
    assert!(is_nonblocking(ctx.async_fd()));
    async_events(&ctx);
    assert_eq!(ctx.query_port(1).unwrap().state, PortState::Active);
    // A connected pair first: with the link down, RTR cannot resolve the
    // peer (ENETUNREACH).
    let s = setup(T).expect("rxe0");
    let mut seen = Vec::new();
    {
        let _up_again = LinkGuard(netdev.clone());
        ip_link(&netdev, "down");
        wait_event(&ctx, AsyncEvent::PortError { port: 1 }, &mut seen);
        assert_ne!(ctx.query_port(1).unwrap().state, PortState::Active);
        // rxe fails it at once, locally (ConnectX would retry into the
        // dead link): the sim's rxe_like() `link_down_fails_locally`.
        s.write(1, s.mr_b.rkey());
        let got = wait(&s.cq_a, 1);
        eprintln!(
            "{T}: a loopback WRITE while the link is down: {:?}",
            got[0].status
        );
        assert_eq!(got[0].status, WcStatus::LOC_QP_OP_ERR);
    }
    wait_event(&ctx, AsyncEvent::PortActive { port: 1 }, &mut seen);
    eprintln!("{T}: events seen: {seen:?}");
    wait_port_active(&ctx);
}

#[test]
fn a_cq_error_reaches_only_the_owning_context_a_port_event_every_one() {
    const T: &str = "a_cq_error_reaches_only_the_owning_context_a_port_event_every_one";
    let _serial = serial();
    // rxe0 opened twice in one process: `owner` makes a loopback pair whose
    // send CQ holds one completion, `other` only listens.
    let Some((_p1, other)) = open_rxe(T) else {
        return;
    };
    let Some((_p2, owner)) = open_rxe(T) else {
        return;
    };
    async_events(&other);
    async_events(&owner);
    let pd = owner.alloc_pd().expect("PD");
    let small = owner.create_cq(1).expect("CQ of one");
    let cq_b = owner.create_cq(64).expect("CQ b");
    let caps = QpCaps::default();
    let a = pd.create_qp(&caps, &small, &small).expect("QP a");
    let b = pd.create_qp(&caps, &cq_b, &cq_b).expect("QP b");
    connect(&owner, &a, &b, 0x10, 1);
    let buf_a = HostBuf::new(LEN, 1);
    let buf_b = HostBuf::new(LEN, 2);
    let mr_a = buf_a.register(&pd, 0, LEN, AccessFlags::transfer());
    let mr_b = buf_b.register(&pd, 0, LEN, AccessFlags::transfer());
    // More signaled WRITEs than the CQ holds, never polled: an overrun,
    // which rxe reports as IB_EVENT_CQ_ERR (`rxe_cq_post`).
    let requests: Vec<SendRequest> = (0..8)
        .map(|wr_id| SendRequest {
            wr_id,
            op: SendOp::Write {
                remote_addr: mr_b.addr(),
                rkey: mr_b.rkey(),
            },
            sg_list: sge(&mr_a, 0, 64),
            flags: SendFlags::SIGNALED,
        })
        .collect();
    post_send(&a, &requests);
    let mut seen = Vec::new();
    wait_event(&owner, AsyncEvent::CqError { cq: small.cq_id() }, &mut seen);
    eprintln!("{T}: the owner saw {seen:?}");
    assert!(
        !epoll_readable(other.async_fd(), QUIET),
        "another context of rxe0 hears nothing of a CQ it did not create"
    );
    assert_eq!(async_events(&other), []);
    if !expect_rxe() {
        skip(
            T,
            "the port half takes the VM's netdev down: runs only with GDR_EXPECT_RXE=1",
        );
        return;
    }
    // A port event is unaffiliated: both contexts hear it.
    let netdev = std::env::var("GDR_RXE_NETDEV").unwrap_or_else(|_| "dummy0".into());
    let (mut seen_owner, mut seen_other) = (Vec::new(), Vec::new());
    {
        let _up_again = LinkGuard(netdev.clone());
        ip_link(&netdev, "down");
        wait_event(&owner, AsyncEvent::PortError { port: 1 }, &mut seen_owner);
        wait_event(&other, AsyncEvent::PortError { port: 1 }, &mut seen_other);
    }
    wait_event(&owner, AsyncEvent::PortActive { port: 1 }, &mut seen_owner);
    wait_event(&other, AsyncEvent::PortActive { port: 1 }, &mut seen_other);
    eprintln!("{T}: port events: owner {seen_owner:?}, other {seen_other:?}");
    wait_port_active(&owner);
}

// ------------------------------------------------- connection event fds

#[test]
fn a_connections_event_fd_turns_readable_when_the_peer_disconnects() {
    use hal_verbs::{
        ConnectParams, ConnectRequest, Connection, ConnectionManager, ConnectionState, Listener,
        Provider,
    };
    use std::net::SocketAddr;
    const T: &str = "a_connections_event_fd_turns_readable_when_the_peer_disconnects";
    let _serial = serial();
    let Some((provider, ctx)) = open_rxe(T) else {
        return;
    };
    let cm = match provider.connection_manager() {
        Ok(cm) => cm,
        Err(e) => {
            assert!(!expect_rxe(), "{T}: GDR_EXPECT_RXE=1 but {e}");
            skip(T, &e.to_string());
            return;
        }
    };
    let pd = ctx.alloc_pd().unwrap();
    let (scq, ccq) = (ctx.create_cq(16).unwrap(), ctx.create_cq(16).unwrap());
    let addr = SocketAddr::new(gdr_tests::rxe::expected_ip(), 7489);
    let params = ConnectParams {
        timeout: Duration::from_secs(30),
        ..ConnectParams::default()
    };
    let listener = cm.listen(addr, 4).expect("listen");
    let (server_conn, client_conn) = std::thread::scope(|s| {
        let c = s.spawn(|| cm.connect(addr, &pd, &ccq, &ccq, &params, b"hi"));
        let request = listener.next_request(TIMEOUT).expect("request");
        let conn = request
            .accept(&pd, &scq, &scq, &params, b"")
            .expect("accept");
        (conn, c.join().unwrap().expect("connect"))
    });
    let fd = server_conn.event_fd();
    assert!(
        is_nonblocking(fd),
        "the rdma_cm channel's fd is non-blocking"
    );
    assert_eq!(
        server_conn.poll_state(Duration::ZERO).unwrap(),
        ConnectionState::Connected
    );
    assert!(!epoll_readable(fd, QUIET), "connected, events taken: quiet");
    client_conn.disconnect().expect("disconnect");
    assert!(
        epoll_readable(fd, TIMEOUT),
        "the peer's disconnect makes the fd readable"
    );
    assert_eq!(
        server_conn.poll_state(Duration::ZERO).unwrap(),
        ConnectionState::Disconnected
    );
}
