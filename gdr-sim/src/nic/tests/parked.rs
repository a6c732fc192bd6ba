//! A waiter parked in poll(2) on a completion channel's fd (armed first:
//! arm, then park), with no thread polling any CQ, sees what the fabric
//! does on the Auto clock: work run by the post, large transfers moved by
//! the NIC thread, RNR waits stepped by it, a pause released. And on the
//! Manual clock nothing moves by itself.

use std::os::fd::RawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hal_verbs::{
    AddressFamily, CompletionChannel, ConnectionInfo, CqNotify, RecvRequest, RtrParams,
    select_roce_v2_gid,
};

use super::*;

/// How long a test looks for something that must not happen.
const QUIET: Duration = Duration::from_millis(200);

/// One node with its CQ on a completion channel.
struct Parked {
    ctx: SimContext,
    pd: SimPd,
    ch: SimCompChannel,
    cq: SimCq,
    qp: SimQp,
}

impl Parked {
    fn new(fabric: &SimFabric, name: &str) -> Self {
        let ctx = fabric
            .add_node(name, NodeConfig::default())
            .open("sim0")
            .unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let ch = ctx.create_comp_channel().unwrap();
        let cq = ctx.create_cq_on_channel(64, &ch, 0).unwrap();
        let qp = pd.create_qp(&QpCaps::default(), &cq, &cq).unwrap();
        Self {
            ctx,
            pd,
            ch,
            cq,
            qp,
        }
    }

    fn info(&self) -> (ConnectionInfo, u8) {
        let table = self.ctx.gid_table(1).unwrap();
        let gid = select_roce_v2_gid(&table, AddressFamily::V4).unwrap();
        let mtu = self.ctx.query_port(1).unwrap().active_mtu;
        let info = ConnectionInfo {
            qp_num: self.qp.qp_num(),
            psn: 0,
            gid: gid.gid,
            lid: 0,
            mtu,
        };
        (info, gid.index as u8)
    }

    /// Arms the CQ for its next completion (before the waiter parks).
    fn arm(&self) {
        self.cq.req_notify(CqNotify::Next).unwrap();
    }

    fn fd(&self) -> RawFd {
        self.ch.fd()
    }

    /// Posts a receive of all of `buf`.
    fn recv(&self, wr_id: u64, buf: &Buf) {
        let request = RecvRequest {
            wr_id,
            sg_list: [buf.sge()].into_iter().collect(),
        };
        // SAFETY: every test keeps its buffers registered to its end.
        unsafe { self.qp.post_recv(&[request]) }.unwrap();
    }

    /// Posts one request.
    fn send(&self, request: SendRequest) {
        // SAFETY: as for `recv`.
        unsafe { self.qp.post_send(&[request]) }.unwrap();
    }

    /// The event the channel woke for is this CQ's, and the CQ holds one
    /// completion: returns it. (The wake came first: the poll here made
    /// none of it happen.)
    fn woke_with(&self) -> Completion {
        assert_eq!(self.ch.get_cq_event().unwrap(), Some(self.cq.cq_id()));
        let mut slot = [Completion::default(); 2];
        assert_eq!(self.cq.poll(&mut slot).unwrap(), 1);
        slot[0]
    }
}

/// Two connected nodes; the responder advertises `min_rnr_timer`, the
/// requester retries `rnr_retry` times.
fn parked_pair(fabric: &SimFabric, min_rnr_timer: u8, rnr_retry: u8) -> (Parked, Parked) {
    let (a, b) = (Parked::new(fabric, "a"), Parked::new(fabric, "b"));
    let ((ia, sa), (ib, sb)) = (a.info(), b.info());
    for (e, remote, sgid) in [(&a, ib, sa), (&b, ia, sb)] {
        e.qp.to_init(&InitParams::default()).unwrap();
        e.qp.to_rtr(&RtrParams {
            min_rnr_timer,
            ..RtrParams::new(remote, sgid, remote.mtu)
        })
        .unwrap();
        e.qp.to_rts(&RtsParams {
            rnr_retry,
            ..RtsParams::default()
        })
        .unwrap();
    }
    (a, b)
}

/// Parks in poll(2) on `fd` until it is readable or `timeout` passes;
/// whether it became readable.
fn park(fd: RawFd, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd, alive for the call.
        let n = unsafe { libc::poll(&raw mut pfd, 1, ms) };
        match n {
            0 => return false,
            n if n > 0 => return pfd.revents & libc::POLLIN != 0,
            _ => {
                let error = std::io::Error::last_os_error();
                assert_eq!(error.raw_os_error(), Some(libc::EINTR), "poll: {error}");
            }
        }
    }
}

fn send_op(wr_id: u64, buf: &Buf) -> SendRequest {
    SendRequest {
        wr_id,
        op: SendOp::Send,
        sg_list: [buf.sge()].into_iter().collect(),
        flags: SendFlags::SIGNALED,
    }
}

/// A small WRITE posted from another thread completes on the requester's
/// CQ, and a SEND lands in the responder's posted receive: both parked
/// waiters wake, nobody polls.
#[test]
fn parked_waiters_see_small_requests_posted_from_another_thread() {
    let fabric = SimFabric::new();
    let (a, b) = parked_pair(&fabric, 12, 7);
    let src = Buf::new(&a.pd, 64, |i| i as u8 + 3);
    let dst = Buf::new(&b.pd, 64, |_| 0);
    let inbox = Buf::new(&b.pd, 64, |_| 0);
    b.recv(9, &inbox);

    // The WRITE: the requester's waiter wakes.
    a.arm();
    std::thread::scope(|s| {
        s.spawn(|| a.send(write(1, src.sge(), dst.mr().addr(), dst.mr().rkey())));
        assert!(park(a.fd(), PATIENCE), "the WRITE's completion woke A");
    });
    let wc = a.woke_with();
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::SUCCESS));
    assert_eq!(dst.data, src.data);

    // The SEND: both sides' waiters wake.
    a.arm();
    b.arm();
    std::thread::scope(|s| {
        let responder = s.spawn(|| park(b.fd(), PATIENCE));
        s.spawn(|| a.send(send_op(2, &src)));
        assert!(park(a.fd(), PATIENCE), "the SEND's completion woke A");
        assert!(responder.join().unwrap(), "the SEND's arrival woke B");
    });
    let wc = a.woke_with();
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::SUCCESS));
    let wc = b.woke_with();
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (9, WcStatus::SUCCESS, 64)
    );
    assert_eq!(inbox.data, src.data);
}

/// A large WRITE posted from another thread moves on a DMA thread, and
/// its completion wakes the parked waiter once the bytes have landed (not
/// while they move).
#[test]
fn a_parked_waiter_sees_a_large_write_complete_on_a_dma_thread() {
    let fabric = SimFabric::new();
    let (a, b) = parked_pair(&fabric, 12, 7);
    let src = Buf::new(&a.pd, BIG, |i| (i % 239) as u8);
    let dst = Buf::new(&b.pd, BIG, |_| 0);
    let movers = Arc::new(Mutex::new(Vec::new()));
    let (started, go) = hold_big_copies(&fabric);
    let hold = fabric.lock().copy_hook.take().unwrap();
    let seen = Arc::clone(&movers);
    fabric.lock().copy_hook = Some(Arc::new(move |len: usize| {
        let name = std::thread::current().name().map(str::to_owned);
        seen.lock().unwrap().push(name);
        hold(len);
    }));
    a.arm();
    std::thread::scope(|s| {
        s.spawn(|| a.send(write(5, src.sge(), dst.mr().addr(), dst.mr().rkey())));
        let copying = started.recv_timeout(PATIENCE);
        let early = copying.is_ok() && park(a.fd(), QUIET);
        let _ = go.send(());
        copying.expect("the large WRITE's copy started without a poll");
        assert!(!early, "no completion while the bytes move");
        assert!(park(a.fd(), PATIENCE), "the completion woke A");
    });
    let wc = a.woke_with();
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::SUCCESS));
    assert_eq!(dst.data, src.data);
    let movers = movers.lock().unwrap();
    assert_eq!(movers.len(), 1);
    assert!(
        movers[0]
            .as_deref()
            .is_some_and(|name| name.starts_with("gdr-sim-dma")),
        "a DMA thread moved the bytes: {movers:?}"
    );
}

/// Large WRITEs of two QP pairs move at once, on two DMA threads (where
/// the machine has two cores): the second's bytes start moving while the
/// first's are held.
#[test]
fn large_writes_of_two_queue_pairs_move_at_once() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        eprintln!("skipped: one core, one DMA thread");
        return;
    }
    let fabric = SimFabric::new();
    let (a, b) = parked_pair(&fabric, 12, 7);
    let (c, d) = parked_pair(&fabric, 12, 7);
    let (src_a, dst_b) = (Buf::new(&a.pd, BIG, |_| 1), Buf::new(&b.pd, BIG, |_| 0));
    let (src_c, dst_d) = (Buf::new(&c.pd, BIG, |_| 2), Buf::new(&d.pd, BIG, |_| 0));
    let (started, go) = hold_big_copies(&fabric);
    a.send(write(1, src_a.sge(), dst_b.mr().addr(), dst_b.mr().rkey()));
    c.send(write(2, src_c.sge(), dst_d.mr().addr(), dst_d.mr().rkey()));
    let both = started.recv_timeout(PATIENCE).is_ok() && started.recv_timeout(PATIENCE).is_ok();
    let _ = go.send(());
    let _ = go.send(());
    assert!(both, "the second copy started while the first was held");
    for (end, wr_id) in [(&a, 1), (&c, 2)] {
        let wc = poll_until_one(&end.cq);
        assert_eq!((wc.wr_id, wc.status), (wr_id, WcStatus::SUCCESS));
    }
    assert_eq!(dst_b.data, src_a.data);
    assert_eq!(dst_d.data, src_c.data);
}

/// A SEND finding no receive is RNR-NAKed, the NAK stepped by the NIC
/// thread for the requester parked on its channel; when the responder
/// posts its receive later (from another thread), the SEND is retried and
/// both parked waiters wake.
#[test]
fn a_parked_waiter_sees_an_rnr_naked_send_complete_once_the_receive_comes() {
    let fabric = SimFabric::new();
    let (a, b) = parked_pair(&fabric, 12, 7);
    let src = Buf::new(&a.pd, 32, |i| i as u8 + 7);
    let inbox = Buf::new(&b.pd, 32, |_| 0);
    a.arm();
    b.arm();
    a.send(send_op(3, &src));
    // Until the NIC thread has NAKed it (it does so ~1 ms in).
    let deadline = Instant::now() + PATIENCE;
    let naked = loop {
        let state = fabric.lock();
        let timing = &state.qps[&a.qp.qp_num()].timing;
        if timing.wait.is_some() {
            break true;
        }
        drop(state);
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert!(naked, "the NIC thread NAKed the SEND without a poll");
    assert!(!park(a.fd(), QUIET), "it waits for a receive");
    std::thread::scope(|s| {
        let responder = s.spawn(|| park(b.fd(), PATIENCE));
        s.spawn(|| b.recv(4, &inbox));
        assert!(park(a.fd(), PATIENCE), "the SEND's completion woke A");
        assert!(responder.join().unwrap(), "its arrival woke B");
    });
    let wc = a.woke_with();
    assert_eq!((wc.wr_id, wc.status), (3, WcStatus::SUCCESS));
    let wc = b.woke_with();
    assert_eq!((wc.wr_id, wc.status), (4, WcStatus::SUCCESS));
    assert_eq!(inbox.data, src.data);
}

/// A SEND whose receive never comes fails with RNR_RETRY_EXC_ERR once its
/// `rnr_retry` retries are NAKed, stepped by the NIC thread for the waiter
/// parked on its channel: `rnr_retry` RNR periods of virtual time after
/// the first NAK, as a poller would see it.
#[test]
fn a_parked_waiter_sees_rnr_retries_run_out() {
    let fabric = SimFabric::new();
    let (a, _b) = parked_pair(&fabric, 12, 2);
    let src = Buf::new(&a.pd, 32, |_| 1);
    a.arm();
    std::thread::scope(|s| {
        s.spawn(|| a.send(send_op(6, &src)));
        assert!(park(a.fd(), PATIENCE), "the failure woke A");
    });
    let wc = a.woke_with();
    assert_eq!((wc.wr_id, wc.status), (6, WcStatus::RNR_RETRY_EXC_ERR));
    assert_eq!(a.qp.state().unwrap(), hal_verbs::QpState::Error);
    assert_eq!(fabric.clock().now(), rnr_nak_timer(12) * 2);
}

/// While the fabric is paused a request posted from another thread fires
/// nothing; releasing the pause runs it, and the parked waiter wakes.
#[test]
fn a_paused_fabric_fires_nothing_until_released() {
    let fabric = SimFabric::new();
    let (a, b) = parked_pair(&fabric, 12, 7);
    let src = Buf::new(&a.pd, 64, |i| i as u8);
    let dst = Buf::new(&b.pd, 64, |_| 0);
    a.arm();
    fabric.set_paused(true);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| park(a.fd(), PATIENCE));
        s.spawn(|| a.send(write(8, src.sge(), dst.mr().addr(), dst.mr().rkey())))
            .join()
            .unwrap();
        std::thread::sleep(QUIET);
        let early = waiter.is_finished();
        fabric.set_paused(false);
        assert!(!early, "nothing fired while paused");
        assert!(waiter.join().unwrap(), "the release ran it and woke A");
    });
    let wc = a.woke_with();
    assert_eq!((wc.wr_id, wc.status), (8, WcStatus::SUCCESS));
    assert_eq!(dst.data, src.data);
}

/// On the Manual clock nothing moves by itself: a post only queues, no
/// RNR wait is stepped in real time, and the test's `progress` runs it.
#[test]
fn the_manual_clock_moves_nothing_by_itself() {
    let fabric = SimFabric::new();
    fabric.clock().set_mode(ClockMode::Manual);
    let (a, b) = parked_pair(&fabric, 1, 6);
    let src = Buf::new(&a.pd, 64, |i| i as u8);
    let dst = Buf::new(&b.pd, 64, |_| 0);
    a.arm();
    a.send(write(1, src.sge(), dst.mr().addr(), dst.mr().rkey()));
    a.send(send_op(2, &src));
    assert!(!park(a.fd(), QUIET), "a post only queues");
    assert!(dst.data.iter().all(|&b| b == 0));
    assert_eq!(fabric.progress(), 1, "the WRITE ran; the SEND was NAKed");
    assert!(park(a.fd(), Duration::ZERO));
    a.woke_with();
    a.arm();
    let waiting = fabric.lock().qps[&a.qp.qp_num()].timing.wait;
    std::thread::sleep(QUIET);
    let state = fabric.lock();
    assert_eq!(state.clock.now, Duration::ZERO, "no real-time step");
    assert_eq!(
        state.qps[&a.qp.qp_num()].timing.rnr_naks,
        1,
        "one NAK, by the test's progress"
    );
    assert!(waiting.is_some() && state.nic_due.is_none());
}
