//! The transfer engine on real verbs: SoftRoCE's `rxe0` in the VM
//! (`softroce/run-in-vm.sh` as the cargo runner, `GDR_EXPECT_RXE=1`).
//!
//! Two engines in one process, both on rxe0: b listens on rxe0's address
//! (10.99.0.1; rdma_cm cannot use 127.0.0.1 there) and accepts on a thread,
//! a connects. Host memory WRITE and READ sliced over several queue pairs;
//! a simulated GPU whose memory is host-visible (the stand-in for memory
//! pinned by nvidia-peermem) registered on the peermem rung and moved by
//! the kernel's rxe packet path; control messages both ways; requests
//! outside their grant refused before posting; and one queue pair failing
//! with a remote access error while the others go on.
//!
//! Without an RDMA device every test skips with its reason on stderr; with
//! `GDR_EXPECT_RXE=1` a missing `rxe0` is a failure.

use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

use gdr_core::buffer::Buffer;
use gdr_core::descriptor::{GrantRights, MemoryDescriptor, MemoryLocation};
use gdr_core::engine::{
    Engine, EngineConfig, EngineError, Peer, Region, RegionGrant, Transfer, TransferError,
};
use gdr_core::ladder::Rung;
use gdr_sim::{FaultPlan, GpuConfig, SimCuda, SimCudaApi};
use gdr_tests::pattern;
use gdr_tests::rxe::{self, serial};
use hal_cuda::{Context as _, Driver as _, Stream as _};
use hal_verbs::rdma::{RdmaApi, RdmaProvider};

type RxeEngine = Engine<RdmaApi, SimCudaApi>;
type RxePeer = Peer<RdmaApi, SimCudaApi>;
type RxeRegion = Region<RdmaApi>;
type RxeGrant = RegionGrant<RdmaApi, SimCudaApi>;

/// Generous: the guest's NIC is software under (often) software emulation.
const T: Duration = Duration::from_secs(60);

/// One side: its (simulated, host-visible, peermem) GPU and its engine.
struct Side {
    cuda: SimCuda,
    engine: RxeEngine,
}

impl Side {
    fn new(provider: &RdmaProvider, config: &EngineConfig) -> Self {
        let cuda = SimCuda::new(
            vec![GpuConfig {
                host_visible: true,
                peermem: true,
                ..GpuConfig::default()
            }],
            FaultPlan::new(),
        );
        let engine = RxeEngine::new(provider, Some(&cuda), config.clone())
            .unwrap_or_else(|e| panic!("an engine on rxe0: {e}"));
        assert_eq!(engine.nics(), [rxe::device_name()]);
        Self { cuda, engine }
    }

    fn host(&self, len: u64, seed: u8) -> (Buffer<SimCudaApi>, RxeRegion) {
        let buffer = Buffer::alloc_host(len);
        buffer
            .write_at(0, &pattern(len as usize, seed))
            .expect("host memory is CPU-writable");
        let region = self.engine.register(&buffer).unwrap();
        assert_eq!(region.rungs(), [Rung::HostMemory]);
        (buffer, region)
    }

    fn gpu(&self, len: u64, seed: u8) -> (Buffer<SimCudaApi>, RxeRegion) {
        let ctx = self.cuda.context(0).unwrap();
        let buffer = Buffer::alloc_device(&ctx, len).unwrap();
        let data = pattern(len as usize, seed);
        let stream = ctx.create_stream().unwrap();
        // SAFETY: the device allocation holds `len` bytes, as does `data`,
        // and the stream is synchronised before `data` goes.
        unsafe { stream.copy_host_to_device(buffer.addr(), data.as_ptr(), data.len()) }.unwrap();
        stream.synchronize().unwrap();
        let region = self.engine.register(&buffer).unwrap();
        (buffer, region)
    }

    /// The buffer's bytes: device memory through a stream copy.
    fn bytes(&self, buffer: &Buffer<SimCudaApi>) -> Vec<u8> {
        if buffer.memory_type() != hal_cuda::MemoryType::Device {
            return buffer.to_vec().expect("host memory is CPU-readable");
        }
        let ctx = self.cuda.context(0).unwrap();
        let mut out = vec![0; buffer.len() as usize];
        let stream = ctx.create_stream().unwrap();
        // SAFETY: `out` holds the buffer's length, and the stream is
        // synchronised before `out` is read.
        unsafe { stream.copy_device_to_host(out.as_mut_ptr(), buffer.addr(), out.len()) }.unwrap();
        stream.synchronize().unwrap();
        out
    }
}

/// Two engines on rxe0, a connected to b: (a, b, a's peer b, b's peer a);
/// `None` after printing why the test skips.
fn connected(test: &str, config: EngineConfig) -> Option<(Side, Side, RxePeer, RxePeer)> {
    let (provider, _ctx) = rxe::open_rxe(test)?;
    let config = EngineConfig {
        devices: Some(vec![rxe::device_name()]),
        default_timeout: T,
        ..config
    };
    let a = Side::new(&provider, &config);
    let b = Side::new(&provider, &config);
    let mut listener = b
        .engine
        .listen(SocketAddr::new(rxe::expected_ip(), 0))
        .unwrap_or_else(|e| panic!("listening on {}: {e}", rxe::expected_ip()));
    let addr = listener.local_addr();
    assert_ne!(addr.port(), 0, "a port was assigned: {addr}");
    let accepting = thread::spawn(move || listener.accept(T));
    let ab = a
        .engine
        .connect(addr, T)
        .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    let ba = accepting
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("accepting on {addr}: {e}"));
    assert_eq!(ab.remote_engine(), b.engine.id());
    assert_eq!(ba.remote_engine(), a.engine.id());
    assert_eq!(ab.session(), ba.session());
    Some((a, b, ab, ba))
}

fn config(qps: u16, slice_size: u64) -> EngineConfig {
    EngineConfig {
        qps_per_peer: qps,
        slice_size,
        ..EngineConfig::default()
    }
}

/// `granter` grants all of `region` to its peer, whose `grantee` waits for
/// the announcement.
fn grant_to(
    granter: &RxePeer,
    grantee: &RxePeer,
    region: &RxeRegion,
    rights: GrantRights,
) -> (RxeGrant, MemoryDescriptor) {
    let grant = granter.grant(region, 0, region.len(), rights).unwrap();
    let seen = grantee.wait_grant(grant.descriptor().grant, T).unwrap();
    assert_eq!(&seen, grant.descriptor(), "the peer sees what was granted");
    assert_eq!(seen.devices().collect::<Vec<_>>(), [rxe::device_name()]);
    (grant, seen)
}

#[test]
fn host_write_then_read_back_sliced_over_queue_pairs() {
    let _serial = serial();
    const SLICE: u64 = 256 * 1024;
    const QPS: u64 = 4;
    let Some((a, b, ab, ba)) = connected(
        "host_write_then_read_back_sliced_over_queue_pairs",
        config(QPS as u16, SLICE),
    ) else {
        return;
    };
    const LEN: u64 = 6 << 20;
    let (_src_buf, src) = a.host(LEN, 1);
    let (dst_buf, dst) = b.host(LEN, 0);
    let (_grant, remote) = grant_to(&ba, &ab, &dst, GrantRights::ReadWrite);
    let before = ab.counters();
    assert_eq!(before.len(), QPS as usize, "{before:?}");
    let start = Instant::now();
    ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap_or_else(|e| panic!("WRITE: {e}"));
    let write_took = start.elapsed();
    assert!(
        b.bytes(&dst_buf) == pattern(LEN as usize, 1),
        "b holds what a wrote"
    );
    let after = ab.counters();
    let slices = LEN / SLICE;
    for ((qp, nic, c0), (_, _, c1)) in before.iter().zip(&after) {
        assert_eq!(nic, &rxe::device_name());
        assert_eq!(c1.posted - c0.posted, slices / QPS, "queue pair {qp}");
        assert_eq!(c1.bytes - c0.bytes, LEN / QPS, "queue pair {qp}");
        assert_eq!(c1.doorbells - c0.doorbells, 1, "one doorbell on {qp}");
    }
    // READ it back into memory holding something else, in two transfers
    // of one batch at odd offsets.
    let (back_buf, back) = a.host(LEN, 9);
    let cut = LEN / 3 + 13;
    let start = Instant::now();
    ab.submit(&[
        Transfer::read(&back, 0, &remote, 0, cut),
        Transfer::read(&back, cut, &remote, cut, LEN - cut),
    ])
    .unwrap()
    .wait(T)
    .unwrap_or_else(|e| panic!("READ: {e}"));
    let read_took = start.elapsed();
    assert!(
        a.bytes(&back_buf) == pattern(LEN as usize, 1),
        "a read back what it wrote"
    );
    eprintln!(
        "rxe engine: {} MiB over {QPS} QPs in {} KiB slices: WRITE {write_took:?}, READ {read_took:?}",
        LEN >> 20,
        SLICE >> 10
    );
}

#[test]
fn sim_gpu_memory_on_the_peermem_rung_over_rxe() {
    let _serial = serial();
    let Some((a, b, ab, ba)) = connected(
        "sim_gpu_memory_on_the_peermem_rung_over_rxe",
        config(2, 64 * 1024),
    ) else {
        return;
    };
    const LEN: u64 = (1 << 20) + 4096 + 5;
    // Host on a to the GPU on b, and back.
    let (_src_buf, src) = a.host(LEN, 3);
    let (gpu_buf, gpu) = b.gpu(LEN, 0);
    assert_eq!(gpu.rungs(), [Rung::Peermem], "rxe refuses dma-buf");
    assert_eq!(gpu.location(), MemoryLocation::Gpu { ordinal: 0 });
    let (_grant, remote) = grant_to(&ba, &ab, &gpu, GrantRights::ReadWrite);
    assert_eq!(remote.location, MemoryLocation::Gpu { ordinal: 0 });
    ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap_or_else(|e| panic!("WRITE host->GPU: {e}"));
    assert!(
        b.bytes(&gpu_buf) == pattern(LEN as usize, 3),
        "WRITE host->GPU"
    );
    let (back_buf, back) = a.host(LEN, 0);
    ab.submit(&[Transfer::read(&back, 0, &remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap_or_else(|e| panic!("READ GPU->host: {e}"));
    assert!(
        a.bytes(&back_buf) == pattern(LEN as usize, 3),
        "READ GPU->host"
    );
    // And a's own GPU memory as the local side: GPU on a into host on b.
    let (_agpu_buf, agpu) = a.gpu(LEN, 4);
    assert_eq!(agpu.rungs(), [Rung::Peermem]);
    let (host_buf, host) = b.host(LEN, 0);
    let (_grant2, remote2) = grant_to(&ba, &ab, &host, GrantRights::Write);
    ab.submit(&[Transfer::write(&agpu, 0, &remote2, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap_or_else(|e| panic!("WRITE GPU->host: {e}"));
    assert!(
        b.bytes(&host_buf) == pattern(LEN as usize, 4),
        "WRITE GPU->host"
    );
}

#[test]
fn control_messages_both_ways_over_rxe() {
    let _serial = serial();
    let mut cfg = config(2, 1 << 20);
    cfg.max_message = 512;
    let Some((a, _b, ab, ba)) = connected("control_messages_both_ways_over_rxe", cfg) else {
        return;
    };
    // More messages than b keeps receives posted for: the rest go out as b
    // reposts, which a sees only while something makes progress on it.
    let driver = a.engine.spawn_driver(Duration::from_millis(1));
    for i in 0..100u32 {
        ab.send(&i.to_le_bytes()).unwrap();
    }
    for i in 0..100u32 {
        let got = ba.recv(T).unwrap_or_else(|e| panic!("message {i}: {e}"));
        assert_eq!(got, i.to_le_bytes(), "message {i} in order");
    }
    for i in 0..10u8 {
        ba.send(&[i; 300]).unwrap().wait(T).unwrap();
    }
    drop(driver);
    for i in 0..10u8 {
        assert_eq!(ab.recv(T).unwrap(), [i; 300], "reply {i}");
    }
    let largest = vec![7u8; 512 - gdr_core::engine::wire::HEADER_LEN];
    ab.send(&largest).unwrap().wait(T).unwrap();
    assert_eq!(ba.recv(T).unwrap(), largest);
    assert!(matches!(
        ab.send(&[7u8; 512]).unwrap_err(),
        EngineError::MessageTooLarge { max: 512, .. }
    ));
    assert!(matches!(
        ba.recv(Duration::from_millis(50)).unwrap_err(),
        EngineError::Timeout(_)
    ));
}

#[test]
fn requests_outside_their_grant_are_refused_before_posting_on_rxe() {
    let _serial = serial();
    let Some((a, b, ab, ba)) = connected(
        "requests_outside_their_grant_are_refused_before_posting_on_rxe",
        config(2, 1 << 20),
    ) else {
        return;
    };
    let (back_buf, back) = a.host(1 << 16, 0);
    let (_dst_buf, dst) = b.host(1 << 16, 7);
    let read_only = ba.grant(&dst, 4096, 8192, GrantRights::Read).unwrap();
    let remote = ab.wait_grant(read_only.descriptor().grant, T).unwrap();
    let before = ab.counters();
    let refused = |t: Transfer<'_, RdmaApi>| ab.submit(&[t]).unwrap_err();
    let e = refused(Transfer::write(&back, 0, &remote, 0, 16));
    assert!(
        matches!(e, EngineError::AccessDenied { op: "WRITE", .. }),
        "{e}"
    );
    let e = refused(Transfer::read(&back, 0, &remote, 8000, 193));
    assert!(
        matches!(
            e,
            EngineError::OutOfBounds {
                what: "remote grant",
                ..
            }
        ),
        "{e}"
    );
    let e = refused(Transfer::read(&back, (1 << 16) - 8, &remote, 0, 16));
    assert!(
        matches!(
            e,
            EngineError::OutOfBounds {
                what: "local region",
                ..
            }
        ),
        "{e}"
    );
    let mut forged = remote.clone();
    forged.len = 1 << 16;
    let e = refused(Transfer::read(&back, 0, &forged, 0, 16));
    assert!(matches!(e, EngineError::NotGranted { .. }), "{e}");
    assert_eq!(ab.counters(), before, "nothing was posted");
    // Inside the grant, the same descriptor works and reads the right bytes.
    ab.submit(&[Transfer::read(&back, 100, &remote, 0, 8192)])
        .unwrap()
        .wait(T)
        .unwrap();
    let got = a.bytes(&back_buf);
    assert!(got[100..100 + 8192] == pattern(1 << 16, 7)[4096..4096 + 8192]);
    assert!(
        got[..100] == pattern(1 << 16, 0)[..100],
        "nothing else moved"
    );
    // Revoked: once the notice arrives, the grant is refused.
    let id = read_only.descriptor().grant;
    drop(read_only);
    let deadline = Instant::now() + T;
    while ab.remote_grant(id).is_some() {
        assert!(Instant::now() < deadline, "revocation never seen");
        ab.engine().progress();
    }
    let before = ab.counters();
    let e = refused(Transfer::read(&back, 0, &remote, 0, 16));
    assert!(matches!(e, EngineError::NotGranted { .. }), "{e}");
    assert_eq!(ab.counters(), before, "nothing was posted");
}

/// A grant revoked on b before a has read the notice: the request reaches
/// rxe's responder with a deregistered rkey and fails with a remote access
/// error on its queue pair (queue pair `failing`; 0 also carries the control
/// messages); the other queue pair goes on and later batches succeed on it.
fn a_queue_pair_failure_fails_only_its_requests(test: &str, failing: u16) {
    let Some((a, b, ab, ba)) = connected(test, config(2, 4096)) else {
        return;
    };
    let (_src_buf, src) = a.host(1 << 16, 5);
    let (dst_buf, dst) = b.host(1 << 16, 0);
    let (good_grant, good) = grant_to(&ba, &ab, &dst, GrantRights::ReadWrite);
    let (doomed_grant, doomed) = grant_to(&ba, &ab, &dst, GrantRights::ReadWrite);
    // Slices go to the queue pairs in turn: one slice per failing queue pair
    // moves the next one there.
    for _ in 0..failing {
        ab.submit(&[Transfer::write(&src, 0, &good, 0, 4096)])
            .unwrap()
            .wait(T)
            .unwrap();
    }
    // Its MRs are deregistered now; the revoke notice sits unread at a.
    drop(doomed_grant);
    let before = ab.counters();
    let failed = ab
        .submit(&[Transfer::write(&src, 0, &doomed, 0, 4096)])
        .expect("a has not seen the revocation yet");
    let after = ab.counters();
    let used: Vec<u16> = before
        .iter()
        .zip(&after)
        .filter(|((_, _, c0), (_, _, c1))| c1.posted > c0.posted)
        .map(|((qp, _, _), _)| *qp)
        .collect();
    assert_eq!(used, [failing], "the doomed request's queue pair");
    let err = failed.wait(T).unwrap_err();
    assert!(matches!(err, TransferError::RemoteAccess { .. }), "{err}");
    eprintln!("rxe engine: queue pair {failing} failed: {err}");
    // Later batches go over the queue pair still up, and only over it.
    for round in 0..4u8 {
        dst_buf.write_at(0, &[0; 1 << 16]).unwrap();
        let before = ab.counters();
        ab.submit(&[Transfer::write(&src, 0, &good, 0, 1 << 16)])
            .unwrap()
            .wait(T)
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert!(
            b.bytes(&dst_buf) == pattern(1 << 16, 5),
            "round {round}: all of it arrived"
        );
        let after = ab.counters();
        assert_eq!(
            after[usize::from(failing)],
            before[usize::from(failing)],
            "round {round}: nothing more on the failed queue pair"
        );
    }
    if failing != 0 {
        // The control queue pair is up: messages still go both ways.
        ab.send(b"ping").unwrap().wait(T).unwrap();
        assert_eq!(ba.recv(T).unwrap(), b"ping");
        ba.send(b"pong").unwrap().wait(T).unwrap();
        assert_eq!(ab.recv(T).unwrap(), b"pong");
    }
    drop(good_grant);
}

#[test]
fn a_failure_of_the_control_queue_pair_fails_only_its_requests_on_rxe() {
    let _serial = serial();
    a_queue_pair_failure_fails_only_its_requests(
        "a_failure_of_the_control_queue_pair_fails_only_its_requests_on_rxe",
        0,
    );
}

#[test]
fn a_failure_of_a_data_queue_pair_fails_only_its_requests_on_rxe() {
    let _serial = serial();
    a_queue_pair_failure_fails_only_its_requests(
        "a_failure_of_a_data_queue_pair_fails_only_its_requests_on_rxe",
        1,
    );
}
