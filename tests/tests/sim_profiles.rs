//! The simulated device profiles: where ConnectX (libmlx5) and rxe differ,
//! each profile behaves as its provider does (the facts and their sources
//! are on `DeviceConfig::mlx5_like`).

use gdr_sim::{DeviceConfig, SimCq, SimFabric, SimMr, SimPd, SimQp};
use gdr_tests::{init_tracing, sim};
use hal_verbs::{
    AccessFlags, Completion, CompletionQueue, ConnectionInfo, Context, InitParams, MemoryRegion,
    ProtectionDomain, Provider, QpCaps, QueuePair, RtrParams, RtsParams, SendFlags, SendOp,
    SendRequest, SgList, Sge, VerbsError, WcStatus,
};

struct Side {
    pd: SimPd,
    cq: SimCq,
    qp: SimQp,
    info: ConnectionInfo,
    sgid: u8,
}

fn side(fabric: &SimFabric, name: &str, config: &DeviceConfig, caps: &QpCaps) -> Side {
    let ctx = sim::add_node(fabric, name, config.clone())
        .open("sim0")
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let qp = pd.create_qp(caps, &cq, &cq).unwrap();
    let (info, sgid) = sim::info(&ctx, &qp, 7);
    Side {
        pd,
        cq,
        qp,
        info,
        sgid,
    }
}

/// Two connected sides on devices of `config`.
fn pair(config: &DeviceConfig, caps: &QpCaps) -> (SimFabric, Side, Side) {
    init_tracing();
    let fabric = SimFabric::new();
    let a = side(&fabric, "a", config, caps);
    let b = side(&fabric, "b", config, caps);
    connect(&a, &b, 7);
    (fabric, a, b)
}

/// Connects the sides' QPs to each other, each sending from `sq_psn`.
fn connect(a: &Side, b: &Side, sq_psn: u32) {
    for (own, peer) in [(a, b), (b, a)] {
        own.qp.to_init(&InitParams::default()).unwrap();
        own.qp
            .to_rtr(&RtrParams::new(peer.info, own.sgid, own.info.mtu))
            .unwrap();
        own.qp
            .to_rts(&RtsParams {
                sq_psn,
                ..RtsParams::default()
            })
            .unwrap();
    }
}

fn register(pd: &SimPd, data: &mut [u8]) -> SimMr {
    // SAFETY: every caller keeps `data` alive and in place past the MR.
    unsafe {
        pd.register(
            data.as_mut_ptr() as u64,
            data.len(),
            AccessFlags::transfer(),
        )
    }
    .unwrap()
}

/// A signaled SEND of no bytes.
fn empty_send(wr_id: u64) -> SendRequest {
    SendRequest {
        wr_id,
        op: SendOp::Send,
        sg_list: Default::default(),
        flags: SendFlags::SIGNALED,
    }
}

/// One SG entry: the first `length` bytes of `mr`.
fn sg(mr: &SimMr, length: u32) -> SgList {
    [Sge {
        addr: mr.addr(),
        length,
        lkey: mr.lkey(),
    }]
    .into_iter()
    .collect()
}

#[test]
fn the_profiles_are_named_and_differ_where_the_providers_do() {
    let [(mlx5_name, mlx5), (rxe_name, rxe)] = DeviceConfig::profiles();
    assert_eq!((mlx5_name, rxe_name), ("mlx5", "rxe"));
    assert!(mlx5.destroy_qp_purges_cq && !rxe.destroy_qp_purges_cq);
    assert_eq!(mlx5.inline_overflow_errno, libc::ENOMEM);
    assert_eq!(rxe.inline_overflow_errno, libc::EINVAL);
    assert!(!mlx5.device_loss_flushes && rxe.device_loss_flushes);
    assert!(mlx5.dmabuf && !rxe.dmabuf);
    assert!(mlx5.pci_bus_id.is_some() && rxe.pci_bus_id.is_none());
    assert_eq!(
        (mlx5.gather_fault_status, rxe.gather_fault_status),
        (WcStatus::LOC_PROT_ERR, WcStatus::LOC_QP_OP_ERR)
    );
    assert_eq!(
        (mlx5.receive_fault_status, rxe.receive_fault_status),
        (WcStatus::LOC_PROT_ERR, WcStatus::LOC_QP_OP_ERR)
    );
    assert_eq!(
        mlx5.receive_too_small_status,
        (WcStatus::REM_INV_REQ_ERR, WcStatus::LOC_LEN_ERR)
    );
    assert_eq!(
        rxe.receive_too_small_status,
        (WcStatus::REM_OP_ERR, WcStatus::LOC_QP_OP_ERR)
    );
    assert!(mlx5.slots_freed_when_polled && !rxe.slots_freed_when_polled);
    assert!(!mlx5.wrong_state_post_is_unknown && rxe.wrong_state_post_is_unknown);
    assert!(!mlx5.local_only_rkey_is_zero && rxe.local_only_rkey_is_zero);
}

/// The retransmit timer runs through RNR waits on the rxe profile, as on
/// rxe (`RxeBackend::rxe_timing`), and stops at an RNR NAK on mlx5 and the
/// default device; each profile's timing facts say what its device does.
#[test]
fn the_retransmit_timer_runs_through_rnr_waits_on_rxe_only() {
    use gdr_tests::pair::{Backend, RxeBackend, SimBackend};
    let rxe = DeviceConfig::rxe_like();
    assert!(rxe.retransmit_timer_runs_during_rnr_wait);
    assert!(!DeviceConfig::mlx5_like().retransmit_timer_runs_during_rnr_wait);
    assert!(!DeviceConfig::default().retransmit_timer_runs_during_rnr_wait);
    assert_eq!(
        SimBackend::new("rxe", rxe)
            .timing()
            .retransmit_timer_runs_during_rnr_wait,
        RxeBackend::rxe_timing().retransmit_timer_runs_during_rnr_wait
    );
    for (name, config) in DeviceConfig::profiles() {
        assert_eq!(
            SimBackend::new(name, config.clone())
                .timing()
                .retransmit_timer_runs_during_rnr_wait,
            config.retransmit_timer_runs_during_rnr_wait,
            "{name}"
        );
    }
}

/// The default device is ConnectX-like wherever the providers' answers
/// differ in what a scenario sees.
#[test]
fn the_default_device_answers_as_mlx5() {
    let (default, mlx5) = (DeviceConfig::default(), DeviceConfig::mlx5_like());
    assert_eq!(default.gather_fault_status, mlx5.gather_fault_status);
    assert_eq!(default.receive_fault_status, mlx5.receive_fault_status);
    assert_eq!(
        default.receive_too_small_status,
        mlx5.receive_too_small_status
    );
    assert_eq!(
        default.slots_freed_when_polled,
        mlx5.slots_freed_when_polled
    );
    assert_eq!(
        default.wrong_state_post_is_unknown,
        mlx5.wrong_state_post_is_unknown
    );
    assert_eq!(
        default.local_only_rkey_is_zero,
        mlx5.local_only_rkey_is_zero
    );
}

/// An MR without remote rights: rkey 0 on rxe (`rxe_mr_init`), its mkey
/// (the lkey) on mlx5. A WRITE through that key fails on the MR's rights
/// either way (REM_ACCESS_ERR) and moves nothing.
#[test]
fn a_local_only_mr_has_rkey_0_on_rxe_and_its_mkey_on_mlx5() {
    for (name, config) in DeviceConfig::profiles() {
        let (_fabric, a, b) = pair(&config, &QpCaps::default());
        let mut src = vec![1u8; 16];
        let mut dst = vec![0u8; 16];
        let src_mr = register(&a.pd, &mut src);
        // SAFETY: `dst` outlives its registration.
        let dst_mr = unsafe {
            b.pd.register(dst.as_mut_ptr() as u64, 16, AccessFlags::LOCAL_WRITE)
        }
        .unwrap();
        let want = if config.local_only_rkey_is_zero {
            0
        } else {
            dst_mr.lkey()
        };
        assert_eq!(dst_mr.rkey(), want, "{name}");
        let write = SendRequest {
            wr_id: 1,
            op: SendOp::Write {
                remote_addr: dst_mr.addr(),
                rkey: dst_mr.rkey(),
            },
            sg_list: sg(&src_mr, 16),
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: the buffers outlive their registrations.
        unsafe { a.qp.post_send(&[write]) }.unwrap();
        let mut wc = [Completion::default(); 2];
        assert_eq!(a.cq.poll(&mut wc).unwrap(), 1, "{name}");
        assert_eq!(wc[0].status, WcStatus::REM_ACCESS_ERR, "{name}");
        assert_eq!(dst, [0u8; 16], "{name}: a byte moved");
        drop((src_mr, dst_mr));
    }
}

/// A receive's slot: freed when its completion is polled on mlx5 (libmlx5
/// moves the queue's tail as it polls), when the device completes it on
/// rxe (its responder advances the queue's consumer index).
#[test]
fn a_receive_slot_comes_back_on_completion_on_rxe_and_on_poll_on_mlx5() {
    let caps = QpCaps {
        max_recv_wr: 1,
        ..QpCaps::default()
    };
    for (name, config) in DeviceConfig::profiles() {
        let (fabric, a, b) = pair(&config, &caps);
        let mut inbox = vec![0u8; 16];
        let inbox_mr = register(&b.pd, &mut inbox);
        let recv = |wr_id| hal_verbs::RecvRequest {
            wr_id,
            sg_list: sg(&inbox_mr, 16),
        };
        // SAFETY: `inbox` outlives its registration.
        unsafe { b.qp.post_recv(&[recv(1)]) }.unwrap();
        let send = empty_send(2);
        // SAFETY: no SG entry.
        unsafe { a.qp.post_send(&[send]) }.unwrap();
        // The SEND consumed the receive when it was posted (posts make
        // progress); its completion is not polled.
        assert_eq!(fabric.progress(), 0, "{name}: the post ran it");
        // SAFETY: as above.
        let again = unsafe { b.qp.post_recv(&[recv(3)]) };
        if config.slots_freed_when_polled {
            let err = again.unwrap_err();
            assert!(
                matches!(err.error, VerbsError::QueueFull { .. }),
                "{name}: {err}"
            );
            let mut wc = [Completion::default(); 2];
            assert_eq!(b.cq.poll(&mut wc).unwrap(), 1, "{name}");
            // SAFETY: as above.
            unsafe { b.qp.post_recv(&[recv(3)]) }.unwrap();
        } else {
            again.unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        drop((inbox_mr, a));
    }
}

/// An INLINE request above the QP's `max_inline_data` is refused at post
/// time in both profiles (as the HAL refuses it), carrying the errno the
/// provider would answer: ENOMEM (libmlx5), EINVAL (librxe).
#[test]
fn an_oversized_inline_send_is_refused_with_the_providers_errno() {
    let caps = QpCaps {
        max_inline_data: 64,
        ..QpCaps::default()
    };
    for (name, config) in DeviceConfig::profiles() {
        let (_fabric, a, b) = pair(&config, &caps);
        let mut src = vec![0u8; 65];
        let mut dst = vec![0u8; 65];
        let (src_mr, dst_mr) = (register(&a.pd, &mut src), register(&b.pd, &mut dst));
        let request = |len: u32| SendRequest {
            wr_id: 1,
            op: SendOp::Write {
                remote_addr: dst_mr.addr(),
                rkey: dst_mr.rkey(),
            },
            sg_list: sg(&src_mr, len),
            flags: SendFlags::INLINE | SendFlags::SIGNALED,
        };
        // SAFETY: `src` is host memory, alive for the call.
        let err = unsafe { a.qp.post_send(&[request(65)]) }.unwrap_err();
        assert_eq!(err.accepted(), Some(0), "{name}");
        let expected = config.inline_overflow_errno;
        assert!(
            matches!(
                err.error,
                VerbsError::InvalidArgument { errno: Some(errno), .. } if errno == expected
            ),
            "{name}: {err}"
        );
        // 64 bytes fit.
        // SAFETY: as above.
        unsafe { a.qp.post_send(&[request(64)]) }.unwrap();
        let mut wc = [Completion::default(); 2];
        assert_eq!(a.cq.poll(&mut wc).unwrap(), 1, "{name}");
        assert_eq!(wc[0].status, WcStatus::SUCCESS, "{name}");
        drop((src_mr, dst_mr));
    }
}

/// Destroying a QP with completions still in its CQ: libmlx5 cleans them
/// out of the CQ, rxe leaves them to be polled.
#[test]
fn a_destroyed_qps_completions_go_on_mlx5_and_stay_on_rxe() {
    for (name, config) in DeviceConfig::profiles() {
        let (fabric, a, b) = pair(&config, &QpCaps::default());
        let mut src = vec![1u8; 16];
        let mut dst = vec![0u8; 16];
        let (src_mr, dst_mr) = (register(&a.pd, &mut src), register(&b.pd, &mut dst));
        let write = SendRequest {
            wr_id: 3,
            op: SendOp::Write {
                remote_addr: dst_mr.addr(),
                rkey: dst_mr.rkey(),
            },
            sg_list: sg(&src_mr, 16),
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: the buffers outlive their registrations.
        unsafe { a.qp.post_send(&[write]) }.unwrap();
        // The post ran it; its completion is not polled away.
        assert_eq!(fabric.progress(), 0, "{name}: the post ran it");
        let Side { cq, qp, .. } = a;
        drop(qp);
        let mut wc = [Completion::default(); 2];
        let n = cq.poll(&mut wc).unwrap();
        if config.destroy_qp_purges_cq {
            assert_eq!(n, 0, "{name}: purged");
        } else {
            assert_eq!((n, wc[0].wr_id), (1, 3), "{name}: kept");
        }
        assert_eq!(dst, src, "{name}: the WRITE ran either way");
        drop((src_mr, dst_mr, b));
    }
}

/// A device lost with work outstanding: rxe-like flushes it (then polls
/// fail); ConnectX-like gives no completion at all, polls just fail (the
/// async DEVICE_FATAL event is the signal).
#[test]
fn a_lost_device_flushes_on_rxe_and_completes_nothing_on_mlx5() {
    for (name, config) in DeviceConfig::profiles() {
        init_tracing();
        let plan = gdr_sim::FaultPlan::new();
        let fabric = SimFabric::with_faults(plan.clone());
        let a = side(&fabric, "a", &config, &QpCaps::default());
        let b = side(&fabric, "b", &config, &QpCaps::default());
        connect(&a, &b, RtsParams::default().sq_psn);
        let mut inbox = vec![0u8; 16];
        let inbox_mr = register(&a.pd, &mut inbox);
        let recv = hal_verbs::RecvRequest {
            wr_id: 5,
            sg_list: sg(&inbox_mr, 16),
        };
        // SAFETY: `inbox` outlives its registration.
        unsafe { a.qp.post_recv(&[recv]) }.unwrap();
        let site = gdr_sim::FaultSite::VerbsPostSend;
        plan.fail_nth(site, plan.calls(site) + 1, gdr_sim::Fault::DeviceLost);
        let send = empty_send(6);
        // SAFETY: no SG entry.
        let err = unsafe { a.qp.post_send(&[send]) }.unwrap_err();
        assert!(matches!(err.error, VerbsError::DeviceLost { .. }), "{name}");
        let mut wc = [Completion::default(); 4];
        if config.device_loss_flushes {
            assert_eq!(a.cq.poll(&mut wc).unwrap(), 1, "{name}");
            assert_eq!((wc[0].wr_id, wc[0].status), (5, WcStatus::WR_FLUSH_ERR));
        }
        assert!(
            matches!(a.cq.poll(&mut wc), Err(VerbsError::DeviceLost { .. })),
            "{name}: no completion, the poll fails"
        );
        drop((inbox_mr, b));
    }
}
