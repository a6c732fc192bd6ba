//! The rdma-core verbs backend against a real device: SoftRoCE's `rxe0` in
//! the VM (`softroce/run-in-vm.sh` as the cargo runner, `GDR_EXPECT_RXE=1`).
//!
//! Without an RDMA device (the usual host) every test that needs one skips
//! with its reason on stderr; with `GDR_EXPECT_RXE=1` a missing `rxe0` is a
//! failure instead. Two queue pairs on `rxe0` connected to each other (port
//! 1, the RoCE v2 GID of the guest's 10.99.0.1) stand in for two peers.
//!
//! What both backends must do (transfers, access errors, flushes, inline)
//! is the conformance suite's (`rxe_conformance.rs`); here is what only
//! rdma-core shows: discovery, GIDs, loading, teardown, dma-buf.
//!
//! Knobs: `GDR_RXE_DEVICE` (default `rxe0`), `GDR_RXE_IP` (default
//! `10.99.0.1`, the address the VM runner gives rxe0's netdev).

use std::time::Duration;

use gdr_tests::rxe::{
    self, HostBuf, device_name, expect_rxe, expected_ip, local_info, open_rxe, serial, sge,
};
use gdr_tests::{init_tracing, skip};
use hal_verbs::rdma::{RdmaContext, RdmaCq, RdmaMr, RdmaPd, RdmaProvider, RdmaQp};
use hal_verbs::{
    AccessFlags, AddressFamily, Completion, Context, GidType, InitParams, LinkLayer, MemoryRegion,
    PortState, PostError, ProtectionDomain, Provider, QpCaps, QpState, QueuePair, RecvRequest,
    RtrParams, RtsParams, VerbsError, WcStatus, select_roce_v2_gid,
};

/// How long a completion may take under TCG before the test fails.
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(20);

/// Two RC queue pairs of one device, connected to each other.
struct Loopback {
    a: RdmaQp,
    b: RdmaQp,
    cq_a: RdmaCq,
    cq_b: RdmaCq,
}

fn connect(ctx: &RdmaContext, pd: &RdmaPd, caps: QpCaps) -> Loopback {
    let cq_a = ctx.create_cq(256).expect("CQ a");
    let cq_b = ctx.create_cq(256).expect("CQ b");
    let a = pd.create_qp(&caps, &cq_a, &cq_a).expect("QP a");
    let b = pd.create_qp(&caps, &cq_b, &cq_b).expect("QP b");
    assert_eq!(a.state().unwrap(), QpState::Reset);
    let (info_a, sgid) = local_info(ctx, &a, 0x1234);
    let (info_b, _) = local_info(ctx, &b, 0xab_cdef);
    for (qp, own, peer) in [(&a, info_a, info_b), (&b, info_b, info_a)] {
        qp.to_init(&InitParams::default()).expect("INIT");
        qp.to_rtr(&RtrParams::new(peer, sgid, peer.mtu))
            .expect("RTR");
        let rts = RtsParams {
            sq_psn: own.psn,
            ..RtsParams::default()
        };
        // retry_cnt 7 (retry forever on rxe) is refused before the verb.
        let forever = RtsParams {
            retry_cnt: 7,
            ..rts
        };
        let err = qp.to_rts(&forever).unwrap_err();
        assert!(matches!(err, VerbsError::InvalidArgument { .. }), "{err}");
        // ACK timeout 0 (no transport timer: retry forever) likewise.
        let no_timer = RtsParams { timeout: 0, ..rts };
        let err = qp.to_rts(&no_timer).unwrap_err();
        assert!(matches!(err, VerbsError::InvalidArgument { .. }), "{err}");
        assert_eq!(qp.state().unwrap(), QpState::ReadyToReceive);
        qp.to_rts(&rts).expect("RTS");
        assert_eq!(qp.state().unwrap(), QpState::ReadyToSend);
    }
    Loopback { a, b, cq_a, cq_b }
}

/// Polls until `n` completions arrived; fails after [`COMPLETION_TIMEOUT`].
fn wait(cq: &RdmaCq, n: usize) -> Vec<Completion> {
    rxe::wait(cq, n, COMPLETION_TIMEOUT)
}

fn post_recv(qp: &RdmaQp, requests: &[RecvRequest]) -> Result<(), PostError> {
    // SAFETY: as for `post_send`.
    unsafe { qp.post_recv(requests) }
}

#[test]
fn discovery_sees_rxe0() {
    const T: &str = "discovery_sees_rxe0";
    let _serial = serial();
    let Some((provider, ctx)) = open_rxe(T) else {
        return;
    };
    assert_eq!(provider.backend_name(), "rdma-core");
    let devices = provider.devices().unwrap();
    let rxe = devices
        .iter()
        .find(|d| d.name == device_name())
        .unwrap_or_else(|| panic!("{devices:?}"));
    assert_eq!(rxe.pci_bus_id, None, "rxe has no PCI function of its own");
    assert_eq!(ctx.name(), device_name());
    let attrs = ctx.query_device().expect("ibv_query_device");
    eprintln!("{T}: {devices:?}\n{attrs:#?}");
    assert!(attrs.phys_port_cnt >= 1, "{attrs:?}");
    assert!(
        attrs.max_qp > 0 && attrs.max_qp_wr > 0 && attrs.max_sge > 0,
        "{attrs:?}"
    );
    assert!(
        attrs.max_cqe > 0 && attrs.max_mr > 0 && attrs.max_mr_size > 0,
        "{attrs:?}"
    );
}

#[test]
fn port_is_active() {
    const T: &str = "port_is_active";
    let _serial = serial();
    let Some((_provider, ctx)) = open_rxe(T) else {
        return;
    };
    let port = ctx.query_port(1).expect("ibv_query_port");
    eprintln!("{T}: {port:?}");
    assert_eq!(port.state, PortState::Active);
    assert_eq!(port.link_layer, LinkLayer::Ethernet, "rxe is RoCE");
    assert!(port.gid_table_len > 0);
    assert!(port.active_mtu <= port.max_mtu);
    for bad in [0, 200] {
        let err = ctx.query_port(bad).unwrap_err();
        assert!(
            matches!(err, VerbsError::InvalidArgument { .. }),
            "port {bad}: {err}"
        );
    }
}

#[test]
fn gid_selection_finds_roce_v2_ipv4() {
    const T: &str = "gid_selection_finds_roce_v2_ipv4";
    let _serial = serial();
    let Some((_provider, ctx)) = open_rxe(T) else {
        return;
    };
    let table = ctx.gid_table(1).expect("GID table");
    eprintln!("{T}: {table:#?}");
    assert!(!table.is_empty());
    assert!(
        table.iter().all(|e| !e.gid.is_zero()),
        "only non-empty entries"
    );
    let v4 = select_roce_v2_gid(&table, AddressFamily::V4).expect("a RoCE v2 IPv4 GID");
    assert_eq!(v4.gid_type, GidType::RoceV2);
    assert!(
        v4.netdev_ifindex != 0,
        "a RoCE GID belongs to a netdev: {v4:?}"
    );
    if expect_rxe() {
        assert_eq!(v4.gid.to_ip(), expected_ip(), "{v4:?}");
    }
    // The fallback for libibverbs before ibv_query_gid_table (ibv_query_gid
    // plus sysfs types) must read the same table.
    let legacy = ctx
        .gid_table_by_query_gid(1)
        .expect("GID table via ibv_query_gid");
    assert_eq!(legacy, table);
}

#[test]
fn dmabuf_registration_reports_not_supported() {
    const T: &str = "dmabuf_registration_reports_not_supported";
    let _serial = serial();
    let Some((_provider, ctx)) = open_rxe(T) else {
        return;
    };
    use std::os::fd::AsRawFd;
    let pd = ctx.alloc_pd().unwrap();
    // Not a dma-buf; rxe refuses any dma-buf before looking at the fd.
    let memfd = rustix::fs::memfd_create("gdr-dmabuf-test", rustix::fs::MemfdFlags::CLOEXEC)
        .expect("memfd_create");
    rustix::fs::ftruncate(&memfd, 1 << 20).unwrap();
    // SAFETY: the fd is open for the call; if the registration succeeded it
    // would be dropped at once, before the memfd.
    let result = unsafe {
        pd.register_dmabuf(
            memfd.as_raw_fd(),
            0,
            1 << 16,
            0x7f00_0000_0000,
            AccessFlags::transfer(),
        )
    };
    let err = result.expect_err("a memfd is no dma-buf, and rxe has no dma-buf support");
    eprintln!("{T}: {err}");
    if expect_rxe() {
        assert!(
            matches!(
                err,
                VerbsError::NotSupported {
                    operation: "ibv_reg_dmabuf_mr",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.is_unsupported());
        assert_eq!(err.errno(), Some(libc::EOPNOTSUPP));
    }
}

/// Resource counts of the device (`rdma resource show DEV`), or `None`
/// where the `rdma` tool or its netlink interface is missing.
fn resource_counts(dev: &str) -> Option<Vec<(String, u64)>> {
    let out = std::process::Command::new("rdma")
        .args(["resource", "show", dev])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let words: Vec<&str> = text.split_whitespace().collect();
    let counts: Vec<(String, u64)> = words
        .windows(2)
        .filter_map(|w| Some((w[0].to_owned(), w[1].parse().ok()?)))
        .filter(|(k, _)| !k.ends_with(':'))
        .collect();
    (!counts.is_empty()).then_some(counts)
}

#[test]
fn teardown_in_any_order() {
    const T: &str = "teardown_in_any_order";
    let _serial = serial();
    let Some((provider, ctx)) = open_rxe(T) else {
        return;
    };
    let dev = device_name();
    let before = resource_counts(&dev);
    let buf = HostBuf::new(1 << 16, 10);

    // A full set of objects, with work in flight on the QP.
    struct Set {
        ctx: RdmaContext,
        pd: RdmaPd,
        mr: RdmaMr,
        cq: RdmaCq,
        lb: Loopback,
    }
    let build = |buf: &HostBuf| {
        let ctx = provider.open(&dev).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = buf.register(&pd, 0, 1 << 16, AccessFlags::transfer());
        let cq = ctx.create_cq(16).unwrap();
        let lb = connect(&ctx, &pd, QpCaps::default());
        post_recv(
            &lb.b,
            &[RecvRequest {
                wr_id: 1,
                sg_list: sge(&mr, 0, 4096),
            }],
        )
        .unwrap();
        Set {
            ctx,
            pd,
            mr,
            cq,
            lb,
        }
    };

    // Children first, the natural order.
    let s = build(&buf);
    drop(s.lb);
    drop(s.mr);
    drop(s.cq);
    drop(s.pd);
    drop(s.ctx);

    // Parents' handles first: the children keep them alive.
    let s = build(&buf);
    drop(s.ctx);
    drop(s.pd);
    drop(s.cq);
    drop(s.mr);
    drop(s.lb);

    // The MR before the QP that may use it, then the CQs before their QPs.
    let s = build(&buf);
    drop(s.mr);
    drop(s.ctx);
    let Loopback { a, b, cq_a, cq_b } = s.lb;
    drop(cq_a);
    drop(cq_b);
    drop(a);
    drop(s.pd);
    drop(b);
    drop(s.cq);

    // Explicit deregistration reports success; a QP moved to ERROR flushes
    // its posted receive.
    {
        let s = build(&buf);
        s.mr.deregister().expect("ibv_dereg_mr");
        s.lb.b.to_error().unwrap();
        assert_eq!(s.lb.b.state().unwrap(), QpState::Error);
        let flushed = wait(&s.lb.cq_b, 1);
        assert_eq!(flushed[0].status, WcStatus::WR_FLUSH_ERR, "{flushed:?}");
        assert_eq!(flushed[0].wr_id, 1);
    }
    drop(buf);

    let after = resource_counts(&dev);
    match (before, after) {
        (Some(before), Some(after)) => {
            eprintln!("{T}: resources before {before:?}, after {after:?}");
            assert_eq!(before, after, "native objects leaked");
        }
        _ => eprintln!("{T}: `rdma resource show` unavailable: leak count not checked"),
    }
    drop(ctx);
}

/// Set in the child process that runs with a fake libibverbs.
const FAKE_LIB_CHILD: &str = "GDR_TEST_FAKE_IBVERBS_CHILD";

#[test]
fn missing_library_or_device_is_a_typed_error() {
    const T: &str = "missing_library_or_device_is_a_typed_error";
    init_tracing();
    if std::env::var_os(FAKE_LIB_CHILD).is_some() {
        // We run with a libibverbs.so.1 that is really libc: the shim found
        // none of its symbols.
        let err = RdmaProvider::load().expect_err("load with a fake libibverbs");
        assert!(
            matches!(err, VerbsError::LibraryUnavailable { .. }),
            "{err:?}"
        );
        eprintln!("FAKE-LIBRARY-CHILD-OK: {err}");
        return;
    }
    let _serial = serial();

    // This machine as it is: every outcome is a value, none a panic.
    let outcome = RdmaProvider::load().map(|p| (p.devices(), p.open("gdr-no-such-device")));
    eprintln!("{T}: on this machine: {outcome:?}");
    match &outcome {
        Ok((Ok(devices), missing)) => {
            assert!(!devices.is_empty(), "an empty list must be NoDevice");
            assert!(
                matches!(missing, Err(VerbsError::NoDevice { .. })),
                "{missing:?}"
            );
        }
        Ok((Err(e), missing)) => {
            assert!(!expect_rxe(), "GDR_EXPECT_RXE=1 but {e}");
            assert!(
                matches!(
                    e,
                    VerbsError::NoDevice { .. } | VerbsError::LibraryUnavailable { .. }
                ),
                "{e:?}"
            );
            assert!(e.is_unsupported());
            assert!(missing.is_err());
        }
        Err(e) => {
            assert!(!expect_rxe(), "GDR_EXPECT_RXE=1 but {e}");
            assert!(matches!(e, VerbsError::LibraryUnavailable { .. }), "{e:?}");
        }
    }

    // A machine without a usable libibverbs, played by child processes
    // whose libibverbs.so.1 is an empty file (the loader refuses it) or a
    // link to libc (it loads, without a single verbs symbol).
    let libc_path = std::fs::read_to_string("/proc/self/maps")
        .ok()
        .and_then(|maps| {
            maps.lines()
                .filter_map(|l| l.split_whitespace().nth(5))
                .find(|p| p.contains("/libc.so.6"))
                .map(str::to_owned)
        });
    let dir = std::env::temp_dir().join(format!("gdr-fake-ibverbs-{}", std::process::id()));
    for case in ["empty file", "link to libc"] {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("libibverbs.so.1");
        if case == "empty file" {
            std::fs::write(&fake, b"").unwrap();
        } else if let Some(libc_path) = &libc_path {
            std::os::unix::fs::symlink(libc_path, &fake).unwrap();
        } else {
            skip(
                T,
                "libc.so.6 not found in /proc/self/maps: link case not run",
            );
            continue;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([T, "--exact", "--nocapture", "--test-threads=1"])
            .env(FAKE_LIB_CHILD, "1")
            .env("LD_LIBRARY_PATH", &dir)
            .output()
            .expect("spawning the child");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{case}: child failed: {text}");
        let line = text.lines().find(|l| l.contains("FAKE-LIBRARY-CHILD-OK"));
        let line = line.unwrap_or_else(|| panic!("{case}: child output: {text}"));
        eprintln!("{T}: libibverbs.so.1 as {case}: {line}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
