//! The simulated NIC behind the verbs HAL: what only the sim can show
//! (faults, pausing, device loss, its device profiles, dma-buf). What both
//! backends must do is the conformance suite's (`gdr_tests::conformance`,
//! run by `sim_conformance.rs` and `rxe_conformance.rs`).
//!
//! Everything goes through the `hal-verbs` traits, connected the way real
//! code connects (GID table, ConnectionInfo, RtrParams, RtsParams).

use std::os::fd::{AsRawFd, OwnedFd};

use gdr_sim::{
    DeviceConfig, Fault, FaultPlan, FaultSite, NodeConfig, SimContext, SimCq, SimFabric, SimPd,
    SimQp, SimVerbs,
};
use gdr_tests::sim::{self, Buf};
use gdr_tests::{init_tracing, pattern};
use hal_verbs::{
    AccessFlags, AddressFamily, Completion, CompletionQueue, ConnectionInfo, Context, InitParams,
    LinkLayer, MemoryRegion, Mtu, PostError, ProtectionDomain, Provider, QpCaps, QpState,
    QueuePair, RecvRequest, RtrParams, RtsParams, SendFlags, SendOp, SendRequest, Sge, VerbsError,
    WcStatus, select_roce_v2_gid,
};

// ---------------------------------------------------------------- helpers

/// One node's opened device and a PD.
struct Node {
    verbs: SimVerbs,
    ctx: SimContext,
    pd: SimPd,
}

impl Node {
    fn new(fabric: &SimFabric, name: &str, config: NodeConfig) -> Self {
        let verbs = fabric.add_node(name, config);
        let ctx = verbs.open("sim0").unwrap();
        let pd = ctx.alloc_pd().unwrap();
        Self { verbs, ctx, pd }
    }

    fn buf(&self, len: usize, access: AccessFlags) -> Buf {
        Buf::new(&self.pd, len, access)
    }

    fn cq(&self, depth: u32) -> SimCq {
        self.ctx.create_cq(depth).unwrap()
    }

    fn qp(&self, caps: &QpCaps, cq: &SimCq) -> SimQp {
        self.pd.create_qp(caps, cq, cq).unwrap()
    }

    /// What this side tells its peer, and the GID index it sends from.
    fn info(&self, qp: &SimQp, psn: u32) -> (ConnectionInfo, u8) {
        sim::info(&self.ctx, qp, psn)
    }
}

/// Connects `qa` (on `a`) and `qb` (on `b`) as real code does.
fn connect(a: &Node, qa: &SimQp, b: &Node, qb: &SimQp, rts: RtsParams) {
    let (psn_a, psn_b) = (0x1234, 0xabcd);
    let (info_a, sgid_a) = a.info(qa, psn_a);
    let (info_b, sgid_b) = b.info(qb, psn_b);
    for (qp, sgid, own, own_psn, remote) in [
        (qa, sgid_a, &info_a, psn_a, info_b),
        (qb, sgid_b, &info_b, psn_b, info_a),
    ] {
        qp.to_init(&InitParams::default()).unwrap();
        qp.to_rtr(&RtrParams::new(remote, sgid, own.mtu)).unwrap();
        qp.to_rts(&RtsParams {
            sq_psn: own_psn,
            ..rts
        })
        .unwrap();
        assert_eq!(qp.state().unwrap(), QpState::ReadyToSend);
    }
}

/// Two nodes, one connected QP pair, one CQ per side.
struct Pair {
    fabric: SimFabric,
    a: Node,
    b: Node,
    cqa: SimCq,
    cqb: SimCq,
    qa: SimQp,
    qb: SimQp,
}

fn pair_with(fabric: SimFabric, caps: QpCaps, rts: RtsParams) -> Pair {
    init_tracing();
    let a = Node::new(&fabric, "a", NodeConfig::default());
    let b = Node::new(&fabric, "b", NodeConfig::default());
    let (cqa, cqb) = (a.cq(256), b.cq(256));
    let (qa, qb) = (a.qp(&caps, &cqa), b.qp(&caps, &cqb));
    connect(&a, &qa, &b, &qb, rts);
    Pair {
        fabric,
        a,
        b,
        cqa,
        cqb,
        qa,
        qb,
    }
}

fn pair() -> Pair {
    pair_with(SimFabric::new(), QpCaps::default(), RtsParams::default())
}

fn req(wr_id: u64, op: SendOp, sges: &[Sge], flags: SendFlags) -> SendRequest {
    SendRequest {
        wr_id,
        op,
        sg_list: sges.iter().copied().collect(),
        flags,
    }
}

fn recv(wr_id: u64, sges: &[Sge]) -> RecvRequest {
    RecvRequest {
        wr_id,
        sg_list: sges.iter().copied().collect(),
    }
}

fn write(remote: &Buf, offset: usize) -> SendOp {
    SendOp::Write {
        remote_addr: remote.addr(offset),
        rkey: remote.mr.rkey(),
    }
}

fn read(remote: &Buf, offset: usize) -> SendOp {
    SendOp::Read {
        remote_addr: remote.addr(offset),
        rkey: remote.mr.rkey(),
    }
}

const SIG: SendFlags = SendFlags::SIGNALED;

fn post(qp: &SimQp, requests: &[SendRequest]) {
    // SAFETY: every test keeps its buffers registered until the end.
    unsafe { qp.post_send(requests) }.unwrap();
}

fn post_recv(qp: &SimQp, requests: &[RecvRequest]) {
    // SAFETY: as for `post`.
    unsafe { qp.post_recv(requests) }.unwrap();
}

/// Polls until exactly `n` completions came, then checks none follows.
fn expect(cq: &SimCq, n: usize) -> Vec<Completion> {
    let mut got = Vec::new();
    let mut slots = [Completion::default(); 8];
    for _ in 0..64 {
        let k = cq.poll(&mut slots).unwrap();
        got.extend_from_slice(&slots[..k]);
        if got.len() >= n {
            break;
        }
    }
    assert_eq!(cq.poll(&mut slots).unwrap(), 0, "more than {n}: {got:?}");
    assert_eq!(got.len(), n, "{got:?}");
    got
}

fn ids_and_status(wcs: &[Completion]) -> Vec<(u64, WcStatus)> {
    wcs.iter().map(|wc| (wc.wr_id, wc.status)).collect()
}

// ------------------------------------------------------------------ tests

#[test]
fn devices_ports_and_gids_look_like_roce() {
    init_tracing();
    let fabric = SimFabric::new();
    let verbs = fabric.add_node(
        "n",
        NodeConfig {
            ipv4: Some("192.168.7.10".parse().unwrap()),
            devices: vec![DeviceConfig::default(), DeviceConfig::rxe_like()],
        },
    );
    assert_eq!(verbs.backend_name(), "sim");
    let devices: Vec<_> = verbs
        .devices()
        .unwrap()
        .into_iter()
        .map(|d| (d.name, d.pci_bus_id))
        .collect();
    assert_eq!(
        devices,
        [
            ("sim0".to_owned(), Some("0000:18:00.0".to_owned())),
            ("sim1".to_owned(), None)
        ]
    );
    assert!(matches!(
        verbs.open("mlx5_0"),
        Err(VerbsError::NoDevice { .. })
    ));
    let empty = fabric.add_node(
        "empty",
        NodeConfig {
            ipv4: None,
            devices: vec![],
        },
    );
    assert!(matches!(empty.devices(), Err(VerbsError::NoDevice { .. })));

    for (name, ip, mtu) in [
        ("sim0", "192.168.7.10", Mtu::Mtu4096),
        ("sim1", "192.168.7.11", Mtu::Mtu1024),
    ] {
        let ctx = verbs.open(name).unwrap();
        assert_eq!(ctx.name(), name);
        let port = ctx.query_port(1).unwrap();
        assert_eq!(port.link_layer, LinkLayer::Ethernet);
        assert_eq!(port.active_mtu, mtu);
        assert!(ctx.query_port(2).is_err());
        let table = ctx.gid_table(1).unwrap();
        let v2 = select_roce_v2_gid(&table, AddressFamily::V4).unwrap();
        assert_eq!(v2.gid.to_ip().to_string(), ip);
        assert!(
            table
                .iter()
                .any(|e| e.gid == v2.gid && e.gid_type == hal_verbs::GidType::RoceV1)
        );
        assert!(ctx.query_device().unwrap().max_qp_wr >= 1024);
    }
}

/// Running out of RNR retries (the SEND waiting for a receive with
/// rnr_retry 7 is the conformance suite's `send_waits_for_a_receive`).
#[test]
fn rnr_retry_runs_out() {
    let access = AccessFlags::transfer();
    // rnr_retry 2: the third retry fails the request and the QP.
    let rts = RtsParams {
        rnr_retry: 2,
        ..RtsParams::default()
    };
    let p = pair_with(SimFabric::new(), QpCaps::default(), rts);
    let src = p.a.buf(32, access);
    post(&p.qa, &[req(1, SendOp::Send, &[src.sge(0, 32)], SIG)]);
    // Each poll progresses the fabric once: one RNR retry per poll.
    let mut slots = [Completion::default(); 4];
    assert_eq!(p.cqa.poll(&mut slots).unwrap(), 0, "first try");
    assert_eq!(p.cqa.poll(&mut slots).unwrap(), 0, "retry 1");
    // Retry 2 is NAKed as well: that was the last one.
    assert_eq!(
        ids_and_status(&expect(&p.cqa, 1)),
        [(1, WcStatus::RNR_RETRY_EXC_ERR)]
    );
    assert_eq!(p.qa.state().unwrap(), QpState::Error);
}

#[test]
fn selective_signaling_and_queue_full() {
    let caps = QpCaps {
        max_send_wr: 4,
        ..QpCaps::default()
    };
    let p = pair_with(SimFabric::new(), caps, RtsParams::default());
    let access = AccessFlags::transfer();
    let mut src = p.a.buf(64, access);
    src.data.copy_from_slice(&pattern(64, 10));
    let dst = p.b.buf(64, access);
    let chunk = |i: usize, flags| req(i as u64, write(&dst, i * 16), &[src.sge(i * 16, 16)], flags);
    let none = SendFlags::empty();
    post(
        &p.qa,
        &[chunk(0, none), chunk(1, SIG), chunk(2, none), chunk(3, SIG)],
    );
    let wcs = expect(&p.cqa, 2);
    assert_eq!(
        ids_and_status(&wcs),
        [(1, WcStatus::SUCCESS), (3, WcStatus::SUCCESS)]
    );
    assert_eq!(&dst.data[..], &pattern(64, 10)[..]);

    // A batch larger than the free slots: the first four are accepted.
    p.fabric.set_paused(true);
    let batch: Vec<_> = (0..6).map(|i| chunk(i % 4, SIG)).collect();
    // SAFETY: buffers live to the end of the test.
    let err = unsafe { p.qa.post_send(&batch) }.unwrap_err();
    assert_eq!(err.accepted(), Some(4));
    assert!(
        matches!(
            err.error,
            VerbsError::QueueFull {
                queue: "send",
                depth: 4,
                ..
            }
        ),
        "{err}"
    );
    p.fabric.set_paused(false);
    assert_eq!(expect(&p.cqa, 4).len(), 4);

    // Unsignaled requests keep their slots until a later completion is
    // polled, as on real hardware: four of them fill the queue.
    post(
        &p.qa,
        &[
            chunk(0, none),
            chunk(1, none),
            chunk(2, none),
            chunk(3, none),
        ],
    );
    expect(&p.cqa, 0);
    // SAFETY: as above.
    let err = unsafe { p.qa.post_send(&[chunk(0, SIG)]) }.unwrap_err();
    assert_eq!(err.accepted(), Some(0));
    assert!(matches!(err.error, VerbsError::QueueFull { .. }));
}

#[test]
fn keys_are_distinct_unique_and_not_a_counter() {
    let p = pair();
    let mut keys = Vec::new();
    let bufs: Vec<Buf> = (0..8)
        .flat_map(|_| {
            [
                p.a.buf(64, AccessFlags::transfer()),
                p.b.buf(64, AccessFlags::transfer()),
            ]
        })
        .collect();
    // One key per MR: its lkey, and its rkey (equal, as on rxe and mlx5).
    for buf in &bufs {
        assert_eq!(buf.mr.lkey(), buf.mr.rkey());
        keys.push(buf.mr.lkey());
    }
    let mut sorted = keys.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), keys.len(), "keys repeat: {keys:x?}");
    assert!(
        keys.windows(2).all(|w| w[1] != w[0].wrapping_add(1)),
        "{keys:x?}"
    );
    assert!(keys.iter().all(|&k| k > 0xff), "{keys:x?}");
}

/// A memfd and our own shared mapping of it (what the exporter sees).
struct Memfd {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

impl Memfd {
    fn new(len: usize) -> Self {
        let fd =
            rustix::fs::memfd_create("sim-verbs-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, len as u64).unwrap();
        // SAFETY: a fresh shared mapping of the whole memfd, unmapped in Drop.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .unwrap();
        Self {
            fd,
            ptr: ptr.cast(),
            len,
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` bytes and lives as long as self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Memfd {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping, not used after this.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

#[test]
fn dmabuf_mr_sees_the_exporters_bytes() {
    let p = pair();
    let page = 4096;
    let mut memfd = Memfd::new(4 * page);
    let iova = 0x7f00_0000_0000;
    // SAFETY: the memfd stays open and mapped past the MR.
    let mr = unsafe {
        p.b.pd.register_dmabuf(
            memfd.fd.as_raw_fd(),
            page as u64,
            2 * page,
            iova,
            AccessFlags::transfer(),
        )
    }
    .unwrap();
    assert_eq!((mr.addr(), mr.len()), (iova, 2 * page));

    // WRITE through RDMA; the exporter's mapping shows it at offset + 100.
    let mut src = p.a.buf(500, AccessFlags::transfer());
    src.data.copy_from_slice(&pattern(500, 12));
    let op = SendOp::Write {
        remote_addr: iova + 100,
        rkey: mr.rkey(),
    };
    post(&p.qa, &[req(1, op, &[src.sge(0, 500)], SIG)]);
    assert!(expect(&p.cqa, 1)[0].status.is_success());
    assert_eq!(
        &memfd.bytes()[page + 100..page + 600],
        &pattern(500, 12)[..]
    );
    assert!(memfd.bytes()[..page + 100].iter().all(|&b| b == 0));

    // The exporter writes; an RDMA READ sees it.
    memfd.bytes()[2 * page..2 * page + 64].copy_from_slice(&pattern(64, 13));
    let back = p.a.buf(64, AccessFlags::transfer());
    let op = SendOp::Read {
        remote_addr: iova + page as u64,
        rkey: mr.rkey(),
    };
    post(&p.qa, &[req(2, op, &[back.sge(0, 64)], SIG)]);
    assert!(expect(&p.cqa, 1)[0].status.is_success());
    assert_eq!(&back.data[..], &pattern(64, 13)[..]);

    // Past the MR's end (the fd has more pages, the MR does not).
    let op = SendOp::Write {
        remote_addr: iova + 2 * page as u64 - 10,
        rkey: mr.rkey(),
    };
    post(&p.qa, &[req(3, op, &[src.sge(0, 11)], SIG)]);
    assert_eq!(expect(&p.cqa, 1)[0].status, WcStatus::REM_ACCESS_ERR);
    assert!(memfd.bytes()[3 * page..].iter().all(|&b| b == 0));

    // Argument checks.
    let fd = memfd.fd.as_raw_fd();
    let access = AccessFlags::transfer();
    let errno = |fd, offset, len| {
        // SAFETY: fd is open (or -1, refused before any use).
        unsafe { p.b.pd.register_dmabuf(fd, offset, len, iova, access) }.unwrap_err()
    };
    let e = errno(fd, 0, 0);
    assert!(
        matches!(
            e,
            VerbsError::InvalidArgument {
                errno: Some(libc::EINVAL),
                ..
            }
        ),
        "{e}"
    );
    let e = errno(-1, 0, page);
    assert!(
        matches!(
            e,
            VerbsError::InvalidArgument {
                errno: Some(libc::EBADF),
                ..
            }
        ),
        "{e}"
    );
    let e = errno(fd, 3 * page as u64, page + 1);
    assert!(
        matches!(
            e,
            VerbsError::InvalidArgument {
                errno: Some(libc::EINVAL),
                ..
            }
        ),
        "{e}"
    );
    drop(mr);
}

#[test]
fn dmabuf_switched_off_is_not_supported() {
    init_tracing();
    let fabric = SimFabric::new();
    let n = Node::new(
        &fabric,
        "rxe",
        NodeConfig {
            ipv4: None,
            devices: vec![DeviceConfig::rxe_like()],
        },
    );
    let memfd = Memfd::new(4096);
    // SAFETY: the memfd is open.
    let err = unsafe {
        n.pd.register_dmabuf(
            memfd.fd.as_raw_fd(),
            0,
            4096,
            0x1000,
            AccessFlags::transfer(),
        )
    }
    .unwrap_err();
    assert!(
        matches!(
            err,
            VerbsError::NotSupported {
                errno: Some(libc::EOPNOTSUPP),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.is_unsupported());
}

#[test]
fn state_machine_misuse_is_refused() {
    init_tracing();
    let fabric = SimFabric::new();
    let a = Node::new(&fabric, "a", NodeConfig::default());
    let b = Node::new(&fabric, "b", NodeConfig::default());
    let (cqa, cqb) = (a.cq(16), b.cq(16));
    let caps = QpCaps::default();
    let (qa, qb) = (a.qp(&caps, &cqa), b.qp(&caps, &cqb));
    let buf = a.buf(64, AccessFlags::transfer());
    let einval = |e: &VerbsError| e.errno() == Some(libc::EINVAL);
    let send = |qp: &SimQp| {
        // SAFETY: `buf` outlives the QP's use here.
        unsafe { qp.post_send(&[req(1, SendOp::Send, &[buf.sge(0, 8)], SIG)]) }
    };
    let (info_b, _) = b.info(&qb, 0);
    let (_, sgid) = a.info(&qa, 0);
    let rtr = RtrParams::new(info_b, sgid, Mtu::Mtu4096);

    assert_eq!(qa.state().unwrap(), QpState::Reset);
    let e = send(&qa).unwrap_err();
    assert!(einval(&e.error) && e.accepted() == Some(0), "{e}");
    // SAFETY: as above.
    let e = unsafe { qa.post_recv(&[recv(1, &[buf.sge(0, 8)])]) }.unwrap_err();
    assert!(einval(&e.error), "{e}");
    assert!(einval(&qa.to_rtr(&rtr).unwrap_err()), "RTR before INIT");
    assert!(
        einval(&qa.to_rts(&RtsParams::default()).unwrap_err()),
        "RTS before RTR"
    );

    qa.to_init(&InitParams::default()).unwrap();
    assert!(einval(&send(&qa).unwrap_err().error), "send in INIT");
    post_recv(&qa, &[recv(1, &[buf.sge(0, 8)])]);
    qa.to_rtr(&rtr).unwrap();
    assert!(einval(&send(&qa).unwrap_err().error), "send in RTR");
    assert!(
        einval(&qa.to_init(&InitParams::default()).unwrap_err()),
        "INIT from RTR"
    );

    let forever = RtsParams {
        retry_cnt: 7,
        ..RtsParams::default()
    };
    let e = qa.to_rts(&forever).unwrap_err();
    assert!(e.to_string().contains("retry forever"), "{e}");
    assert_eq!(qa.state().unwrap(), QpState::ReadyToReceive);

    // A GID that is nowhere on the fabric cannot be resolved.
    let (_, sgid) = b.info(&qb, 0);
    qb.to_init(&InitParams::default()).unwrap();
    let mut lost = rtr;
    lost.remote.gid = hal_verbs::Gid::from_ip("10.200.0.1".parse().unwrap());
    assert!(
        qb.to_rtr(&RtrParams {
            sgid_index: sgid,
            ..lost
        })
        .is_err()
    );

    // Queue sizes above the device's are refused at creation.
    let too_deep = QpCaps {
        max_send_wr: 1 << 20,
        ..caps
    };
    assert!(einval(&a.pd.create_qp(&too_deep, &cqa, &cqa).unwrap_err()));
    assert!(einval(&a.ctx.create_cq(0).unwrap_err()));
}

#[test]
fn wrong_connection_data_surfaces_as_retry_exceeded() {
    init_tracing();
    let access = AccessFlags::transfer();
    for mistake in ["psn", "qpn"] {
        let fabric = SimFabric::new();
        let a = Node::new(&fabric, "a", NodeConfig::default());
        let b = Node::new(&fabric, "b", NodeConfig::default());
        let (cqa, cqb) = (a.cq(16), b.cq(16));
        let caps = QpCaps::default();
        let (qa, qb) = (a.qp(&caps, &cqa), b.qp(&caps, &cqb));
        let (info_a, sgid_a) = a.info(&qa, 5);
        let (mut info_b, sgid_b) = b.info(&qb, 6);
        qb.to_init(&InitParams::default()).unwrap();
        qb.to_rtr(&RtrParams::new(info_a, sgid_b, Mtu::Mtu4096))
            .unwrap();
        if mistake == "qpn" {
            info_b.qp_num += 1000;
        }
        qa.to_init(&InitParams::default()).unwrap();
        qa.to_rtr(&RtrParams::new(info_b, sgid_a, Mtu::Mtu4096))
            .unwrap();
        let sq_psn = if mistake == "psn" { 99 } else { 5 };
        qa.to_rts(&RtsParams {
            sq_psn,
            ..RtsParams::default()
        })
        .unwrap();
        let src = a.buf(8, access);
        let dst = b.buf(8, access);
        post(&qa, &[req(1, write(&dst, 0), &[src.sge(0, 8)], SIG)]);
        assert_eq!(
            ids_and_status(&expect(&cqa, 1)),
            [(1, WcStatus::RETRY_EXC_ERR)],
            "{mistake}"
        );
    }
}

#[test]
fn every_verbs_fault_fires() {
    init_tracing();
    let plan = FaultPlan::new();
    let fabric = SimFabric::with_faults(plan.clone());
    let a = Node::new(&fabric, "a", NodeConfig::default());
    let b = Node::new(&fabric, "b", NodeConfig::default());
    let access = AccessFlags::transfer();
    let enomem = |op| VerbsError::from_errno(op, "sim0", libc::ENOMEM);

    // Registration.
    plan.fail_next(FaultSite::VerbsRegister, Fault::Verbs(enomem("ibv_reg_mr")));
    let mut data = vec![0u8; 64];
    // SAFETY: `data` outlives the (failing) registration.
    let err = unsafe { a.pd.register(data.as_mut_ptr() as u64, 64, access) }.unwrap_err();
    assert_eq!(err, enomem("ibv_reg_mr"));
    let memfd = Memfd::new(4096);
    plan.fail_next(
        FaultSite::VerbsRegisterDmabuf,
        Fault::Verbs(enomem("ibv_reg_dmabuf_mr")),
    );
    // SAFETY: the memfd is open.
    let err = unsafe {
        a.pd.register_dmabuf(memfd.fd.as_raw_fd(), 0, 4096, 0, access)
    }
    .unwrap_err();
    assert_eq!(err, enomem("ibv_reg_dmabuf_mr"));

    // QP creation and modification.
    let (cqa, cqb) = (a.cq(64), b.cq(64));
    let caps = QpCaps::default();
    plan.fail_next(
        FaultSite::VerbsCreateQp,
        Fault::Verbs(enomem("ibv_create_qp")),
    );
    assert_eq!(
        a.pd.create_qp(&caps, &cqa, &cqa).unwrap_err(),
        enomem("ibv_create_qp")
    );
    let (qa, qb) = (a.qp(&caps, &cqa), b.qp(&caps, &cqb));
    let ebusy = VerbsError::from_errno("ibv_modify_qp", "sim0", libc::EBUSY);
    plan.fail_next(FaultSite::VerbsModifyQp, Fault::Verbs(ebusy.clone()));
    assert_eq!(qa.to_init(&InitParams::default()).unwrap_err(), ebusy);
    assert_eq!(
        qa.state().unwrap(),
        QpState::Reset,
        "a failed modify changes nothing"
    );
    connect(&a, &qa, &b, &qb, RtsParams::default());

    // post_send: the third request of a batch of four fails.
    let mut src = a.buf(64, access);
    src.data.copy_from_slice(&pattern(64, 14));
    let dst = b.buf(64, access);
    let eagain = VerbsError::from_errno("ibv_post_send", "sim0", libc::EAGAIN);
    plan.fail_nth(
        FaultSite::VerbsPostSend,
        plan.calls(FaultSite::VerbsPostSend) + 3,
        Fault::Verbs(eagain.clone()),
    );
    let batch: Vec<_> = (0..4)
        .map(|i| req(i as u64, write(&dst, i * 16), &[src.sge(i * 16, 16)], SIG))
        .collect();
    // SAFETY: buffers live to the end of the test.
    let err = unsafe { qa.post_send(&batch) }.unwrap_err();
    assert_eq!(err, PostError::prefix(2, eagain));
    assert_eq!(
        ids_and_status(&expect(&cqa, 2)),
        [(0, WcStatus::SUCCESS), (1, WcStatus::SUCCESS)]
    );
    assert_eq!(&dst.data[..32], &pattern(64, 14)[..32]);
    assert!(
        dst.data[32..].iter().all(|&b| b == 0),
        "refused requests never run"
    );

    // post_recv.
    let erecv = VerbsError::from_errno("ibv_post_recv", "sim0", libc::ENOMEM);
    plan.fail_next(FaultSite::VerbsPostRecv, Fault::Verbs(erecv.clone()));
    // SAFETY: as above.
    let err = unsafe { qb.post_recv(&[recv(1, &[]), recv(2, &[])]) }.unwrap_err();
    assert_eq!(err, PostError::prefix(0, erecv));

    // A completion status: no byte moves, the QP fails, the rest flushes.
    plan.fail_next(
        FaultSite::VerbsCompletion,
        Fault::CompletionStatus(WcStatus::LOC_QP_OP_ERR),
    );
    let dst2 = b.buf(64, access);
    post(
        &qa,
        &[
            req(7, write(&dst2, 0), &[src.sge(0, 64)], SendFlags::empty()),
            req(8, write(&dst2, 0), &[src.sge(0, 64)], SIG),
        ],
    );
    assert_eq!(
        ids_and_status(&expect(&cqa, 2)),
        [(7, WcStatus::LOC_QP_OP_ERR), (8, WcStatus::WR_FLUSH_ERR)]
    );
    assert!(dst2.data.iter().all(|&b| b == 0));
    assert_eq!(qa.state().unwrap(), QpState::Error);
    plan.assert_all_fired();
}

#[test]
fn device_lost_fails_every_later_call_and_flushes() {
    init_tracing();
    let plan = FaultPlan::new();
    let p = pair_with(
        SimFabric::with_faults(plan.clone()),
        QpCaps::default(),
        RtsParams::default(),
    );
    let access = AccessFlags::transfer();
    let src = p.a.buf(64, access);
    let dst = p.b.buf(64, access);
    let inbox = p.a.buf(64, access);
    post_recv(&p.qa, &[recv(30, &[inbox.sge(0, 64)])]);
    p.fabric.set_paused(true);
    plan.fail_nth(
        FaultSite::VerbsPostSend,
        plan.calls(FaultSite::VerbsPostSend) + 2,
        Fault::DeviceLost,
    );
    // SAFETY: buffers live to the end of the test.
    let err = unsafe {
        p.qa.post_send(&[
            req(1, write(&dst, 0), &[src.sge(0, 64)], SendFlags::empty()),
            req(2, write(&dst, 0), &[src.sge(0, 64)], SIG),
        ])
    }
    .unwrap_err();
    assert_eq!(err.accepted(), Some(1));
    assert!(matches!(err.error, VerbsError::DeviceLost { .. }), "{err}");
    p.fabric.set_paused(false);
    // The flushes are still handed out, then polling reports the loss.
    let wcs = expect_then_lost(&p.cqa, 2);
    assert_eq!(
        ids_and_status(&wcs),
        [(1, WcStatus::WR_FLUSH_ERR), (30, WcStatus::WR_FLUSH_ERR)]
    );
    assert!(dst.data.iter().all(|&b| b == 0));
    assert!(matches!(
        p.a.ctx.query_device(),
        Err(VerbsError::DeviceLost { .. })
    ));
    assert!(matches!(
        p.a.ctx.alloc_pd(),
        Err(VerbsError::DeviceLost { .. })
    ));
    assert!(matches!(p.qa.state(), Err(VerbsError::DeviceLost { .. })));
    assert!(matches!(
        p.a.verbs.open("sim0"),
        Err(VerbsError::DeviceLost { .. })
    ));
    // The peer's requests to the dead device time out.
    let back = p.b.buf(64, access);
    post(&p.qb, &[req(3, read(&src, 0), &[back.sge(0, 64)], SIG)]);
    assert_eq!(
        ids_and_status(&expect(&p.cqb, 1)),
        [(3, WcStatus::RETRY_EXC_ERR)]
    );

    // A loss scripted at a completion: the request flushes with the rest.
    let plan = FaultPlan::new();
    let p = pair_with(
        SimFabric::with_faults(plan.clone()),
        QpCaps::default(),
        RtsParams::default(),
    );
    let src = p.a.buf(64, access);
    let dst = p.b.buf(64, access);
    plan.fail_next(FaultSite::VerbsCompletion, Fault::DeviceLost);
    post(&p.qa, &[req(4, write(&dst, 0), &[src.sge(0, 64)], SIG)]);
    assert_eq!(
        ids_and_status(&expect_then_lost(&p.cqa, 1)),
        [(4, WcStatus::WR_FLUSH_ERR)]
    );
    plan.assert_all_fired();
}

/// Polls `n` completions from a CQ of a lost device, then expects the loss.
fn expect_then_lost(cq: &SimCq, n: usize) -> Vec<Completion> {
    let mut slots = vec![Completion::default(); n + 4];
    let k = cq.poll(&mut slots).unwrap();
    assert_eq!(k, n, "{:?}", &slots[..k]);
    assert!(matches!(
        cq.poll(&mut slots),
        Err(VerbsError::DeviceLost { .. })
    ));
    slots.truncate(n);
    slots
}

// ------------------------------------------------- issue 8: HAL soundness

/// INLINE copies the payload with the CPU from `sge.addr`: from a dma-buf
/// MR that is an iova, never readable. Refused (InvalidArgument), and the
/// requests before it in the batch are posted, as a provider takes them.
#[test]
fn inline_from_a_dmabuf_mr_is_refused() {
    let p = pair();
    let page = 4096;
    let memfd = Memfd::new(2 * page);
    // An iova no CPU mapping backs: the CPU reading it would fault.
    let iova = 0x7f00_dead_0000;
    // SAFETY: the memfd stays open and mapped past the MR.
    let mr = unsafe {
        p.a.pd
            .register_dmabuf(memfd.fd.as_raw_fd(), 0, page, iova, AccessFlags::transfer())
    }
    .unwrap();
    let dst = p.b.buf(64, AccessFlags::transfer());
    let from_dmabuf = Sge {
        addr: iova,
        length: 16,
        lkey: mr.lkey(),
    };
    p.fabric.set_paused(true);
    // SAFETY: the registrations live to the end of the test; the inline
    // request is refused before anything reads it.
    let err = unsafe {
        p.qa.post_send(&[
            req(1, write(&dst, 0), &[from_dmabuf], SIG),
            req(2, write(&dst, 16), &[from_dmabuf], SIG | SendFlags::INLINE),
        ])
    }
    .unwrap_err();
    assert_eq!(err.accepted(), Some(1), "{err}");
    assert!(
        matches!(err.error, VerbsError::InvalidArgument { .. }),
        "{err}"
    );
    assert!(err.error.to_string().contains("dma-buf"), "{err}");
    p.fabric.set_paused(false);
    // The accepted (non-inline) WRITE from the dma-buf MR runs.
    assert_eq!(ids_and_status(&expect(&p.cqa, 1)), [(1, WcStatus::SUCCESS)]);
    drop(mr);
}

/// ACK timeout 0 disables the transport timer (infinite retry): refused at
/// RTS like retry_cnt 7, and the QP stays in RTR.
#[test]
fn ack_timeout_zero_is_refused() {
    init_tracing();
    let fabric = SimFabric::new();
    let a = Node::new(&fabric, "a", NodeConfig::default());
    let b = Node::new(&fabric, "b", NodeConfig::default());
    let (cqa, cqb) = (a.cq(16), b.cq(16));
    let caps = QpCaps::default();
    let (qa, qb) = (a.qp(&caps, &cqa), b.qp(&caps, &cqb));
    let (info_b, _) = b.info(&qb, 0);
    let (_, sgid) = a.info(&qa, 0);
    qa.to_init(&InitParams::default()).unwrap();
    qa.to_rtr(&RtrParams::new(info_b, sgid, Mtu::Mtu4096))
        .unwrap();
    for bad in [
        RtsParams {
            timeout: 0,
            ..RtsParams::default()
        },
        RtsParams {
            retry_cnt: 7,
            ..RtsParams::default()
        },
    ] {
        let err = qa.to_rts(&bad).unwrap_err();
        assert!(
            matches!(err, VerbsError::InvalidArgument { .. }),
            "{bad:?}: {err}"
        );
        assert_eq!(qa.state().unwrap(), QpState::ReadyToReceive);
    }
    qa.to_rts(&RtsParams {
        timeout: 1,
        ..RtsParams::default()
    })
    .unwrap();
}

/// A node whose device destroys a QP's completions with it, as ConnectX.
fn purging_node(fabric: &SimFabric, name: &str) -> Node {
    let config = NodeConfig {
        ipv4: None,
        devices: vec![DeviceConfig {
            destroy_qp_purges_cq: true,
            ..DeviceConfig::default()
        }],
    };
    Node::new(fabric, name, config)
}

/// On a device that purges a destroyed QP's completions (ConnectX), tearing
/// a QP with outstanding work down loses them; `hal_verbs::drain` first
/// hands every one of them over (other QPs' on the shared CQ too), even with
/// the send queue full when its marker is posted.
#[test]
fn drain_hands_over_every_completion_before_destroy() {
    init_tracing();
    let fabric = SimFabric::new();
    let a = purging_node(&fabric, "a");
    let b = Node::new(&fabric, "b", NodeConfig::default());
    let access = AccessFlags::transfer();
    let src = a.buf(64, access);
    let dst = b.buf(64, access);
    let inbox = a.buf(64, access);
    // One CQ on a, shared by three QPs: qa (drained), qc (busy), qx (control).
    let cq = a.cq(64);
    let cqb = b.cq(64);
    let small = QpCaps {
        max_send_wr: 3,
        ..QpCaps::default()
    };
    let (qa, qb) = (a.qp(&small, &cq), b.qp(&QpCaps::default(), &cqb));
    connect(&a, &qa, &b, &qb, RtsParams::default());
    let (qc, qd) = (
        a.qp(&QpCaps::default(), &cq),
        b.qp(&QpCaps::default(), &cqb),
    );
    connect(&a, &qc, &b, &qd, RtsParams::default());
    let (qx, qy) = (
        a.qp(&QpCaps::default(), &cq),
        b.qp(&QpCaps::default(), &cqb),
    );
    connect(&a, &qx, &b, &qy, RtsParams::default());

    // The control: qx's flushes are in the CQ when it is destroyed, and go.
    post_recv(&qx, &[recv(50, &[inbox.sge(0, 64)])]);
    qx.to_error().unwrap();
    drop(qx);
    expect(&cq, 0);

    fabric.set_paused(true);
    let none = SendFlags::empty();
    post(&qc, &[req(100, write(&dst, 0), &[src.sge(0, 8)], SIG)]);
    // qa's send queue is full (3 of 3), mostly unsignaled, and stuck: its
    // head is a SEND that qb has no receive for (releasing the pause runs
    // what can run, as a post does; an RNR wait is left to polls).
    post(
        &qa,
        &[
            req(1, SendOp::Send, &[src.sge(0, 8)], none),
            req(2, write(&dst, 16), &[src.sge(0, 8)], SIG),
            req(3, write(&dst, 24), &[src.sge(0, 8)], none),
        ],
    );
    post_recv(
        &qa,
        &[
            recv(10, &[inbox.sge(0, 32)]),
            recv(11, &[inbox.sge(32, 32)]),
        ],
    );
    fabric.set_paused(false);

    let got = hal_verbs::drain::drain::<gdr_sim::SimVerbsApi>(
        &qa,
        &cq,
        &cq,
        std::time::Duration::from_secs(5),
    )
    .expect("drain");
    let mut of_qa: Vec<_> = got
        .iter()
        .filter(|c| c.qp_num == qa.qp_num())
        .map(|c| (c.wr_id, c.status))
        .collect();
    of_qa.sort_by_key(|&(id, _)| id);
    let flushed = WcStatus::WR_FLUSH_ERR;
    assert_eq!(
        of_qa,
        [
            (1, flushed),
            (2, flushed),
            (3, flushed),
            (10, flushed),
            (11, flushed)
        ],
        "{got:?}"
    );
    let of_qc: Vec<_> = got
        .iter()
        .filter(|c| c.qp_num == qc.qp_num())
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        of_qc,
        [(100, WcStatus::SUCCESS)],
        "other QPs' completions are handed over"
    );
    assert!(
        got.iter()
            .all(|c| c.wr_id < hal_verbs::drain::RECV_MARKER_WR_ID),
        "markers are not returned: {got:?}"
    );
    assert_eq!(qa.state().unwrap(), QpState::Error);
    drop(qa);
    expect(&cq, 0);

    // Room in both queues this time: the markers post at once, and the
    // drain still waits for (and hands over) what is ahead of them.
    fabric.set_paused(true);
    post(&qc, &[req(101, write(&dst, 32), &[src.sge(0, 8)], none)]);
    post_recv(&qc, &[recv(102, &[inbox.sge(0, 8)])]);
    let got = hal_verbs::drain::drain::<gdr_sim::SimVerbsApi>(
        &qc,
        &cq,
        &cq,
        std::time::Duration::from_secs(5),
    )
    .expect("drain");
    assert_eq!(
        ids_and_status(&got),
        [(101, flushed), (102, flushed)],
        "{got:?}"
    );
    drop(qc);
    fabric.set_paused(false);
    expect(&cq, 0);
}

/// A drain whose marker cannot be posted fails with that error and what it
/// had polled.
#[test]
fn drain_reports_a_failing_verb() {
    let plan = FaultPlan::new();
    let p = pair_with(
        SimFabric::with_faults(plan.clone()),
        QpCaps::default(),
        RtsParams::default(),
    );
    let esend = VerbsError::from_errno("ibv_post_send", "sim0", libc::EIO);
    plan.fail_next(FaultSite::VerbsPostSend, Fault::Verbs(esend.clone()));
    let err = hal_verbs::drain::drain::<gdr_sim::SimVerbsApi>(
        &p.qa,
        &p.cqa,
        &p.cqa,
        std::time::Duration::from_secs(5),
    )
    .unwrap_err();
    assert_eq!(err.error, esend, "{err}");
    assert_eq!(err.qp_num, p.qa.qp_num());
}

/// A receive marker refused before the move to ERROR (here by a scripted
/// fault; on real NICs a full receive queue) is posted after it.
#[test]
fn drain_posts_a_refused_receive_marker_after_the_move_to_error() {
    let plan = FaultPlan::new();
    let p = pair_with(
        SimFabric::with_faults(plan.clone()),
        QpCaps::default(),
        RtsParams::default(),
    );
    let inbox = p.a.buf(64, AccessFlags::transfer());
    post_recv(&p.qa, &[recv(7, &[inbox.sge(0, 64)])]);
    let erecv = VerbsError::from_errno("ibv_post_recv", "sim0", libc::ENOMEM);
    plan.fail_next(FaultSite::VerbsPostRecv, Fault::Verbs(erecv));
    let got = hal_verbs::drain::drain::<gdr_sim::SimVerbsApi>(
        &p.qa,
        &p.cqa,
        &p.cqa,
        std::time::Duration::from_secs(5),
    )
    .expect("drain");
    assert_eq!(ids_and_status(&got), [(7, WcStatus::WR_FLUSH_ERR)]);
}
