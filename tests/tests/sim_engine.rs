//! The transfer engine between two simulated nodes: two engines connected
//! over the sim's rdma_cm, regions of host, pinned and GPU memory on every
//! rung, batched READ/WRITE verified byte for byte, slicing over queue
//! pairs and NICs, grants checked before anything is posted, queue-pair
//! failure, timeouts, peer death and control messages.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::thread;
use std::time::Duration;

use gdr_core::buffer::Buffer;
use gdr_core::descriptor::{GrantRights, MemoryDescriptor};
use gdr_core::engine::{
    Engine, EngineConfig, EngineError, Path, Peer, Region, Transfer, TransferError,
};
use gdr_core::ladder::{LadderConfig, Policy, Rung};
use gdr_sim::{
    DeviceConfig, GpuConfig, NodeConfig, SimCuda, SimCudaApi, SimFabric, SimVerbs, SimVerbsApi,
};
use gdr_tests::{init_tracing, pattern};
use hal_cuda::{Context as _, Driver as _, Stream as _};

type SimEngine = Engine<SimVerbsApi, SimCudaApi>;
type SimPeer = Peer<SimVerbsApi, SimCudaApi>;
type SimRegion = Region<SimVerbsApi>;

const T: Duration = Duration::from_secs(10);

/// One node: its NICs, its GPU, its engine.
struct Side {
    verbs: SimVerbs,
    cuda: SimCuda,
    engine: SimEngine,
}

impl Side {
    fn ip(&self, nic: &str) -> IpAddr {
        IpAddr::V4(self.verbs.device_ipv4(nic).unwrap())
    }

    fn host(&self, len: u64, seed: u8) -> (Buffer<SimCudaApi>, SimRegion) {
        let buffer = Buffer::alloc_host(len);
        buffer
            .write_at(0, &pattern(len as usize, seed))
            .expect("host memory is CPU-writable");
        let region = self.engine.register(&buffer).unwrap();
        (buffer, region)
    }

    fn pinned(&self, len: u64, seed: u8) -> (Buffer<SimCudaApi>, SimRegion) {
        let ctx = self.cuda.context(0).unwrap();
        let buffer = Buffer::alloc_pinned(&ctx, len).unwrap();
        buffer.write_at(0, &pattern(len as usize, seed)).unwrap();
        let region = self.engine.register(&buffer).unwrap();
        (buffer, region)
    }

    fn gpu(&self, len: u64, seed: u8) -> (Buffer<SimCudaApi>, SimRegion) {
        let ctx = self.cuda.context(0).unwrap();
        let buffer = Buffer::alloc_device(&ctx, len).unwrap();
        let data = pattern(len as usize, seed);
        let stream = ctx.create_stream().unwrap();
        // SAFETY: the device allocation holds `len` bytes; `data` too.
        unsafe { stream.copy_host_to_device(buffer.addr(), data.as_ptr(), data.len()) }.unwrap();
        stream.synchronize().unwrap();
        let region = self.engine.register(&buffer).unwrap();
        (buffer, region)
    }

    fn bytes(&self, buffer: &Buffer<SimCudaApi>) -> Vec<u8> {
        match buffer.to_vec() {
            Ok(bytes) => bytes,
            Err(_) => {
                let ctx = self.cuda.context(0).unwrap();
                let mut out = vec![0; buffer.len() as usize];
                let stream = ctx.create_stream().unwrap();
                // SAFETY: `out` holds the buffer's length.
                unsafe { stream.copy_device_to_host(out.as_mut_ptr(), buffer.addr(), out.len()) }
                    .unwrap();
                stream.synchronize().unwrap();
                out
            }
        }
    }
}

/// The memory a region is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Host,
    Pinned,
    Gpu,
}

impl Side {
    fn alloc(&self, kind: Kind, len: u64, seed: u8) -> (Buffer<SimCudaApi>, SimRegion) {
        match kind {
            Kind::Host => self.host(len, seed),
            Kind::Pinned => self.pinned(len, seed),
            Kind::Gpu => self.gpu(len, seed),
        }
    }
}

struct World {
    fabric: SimFabric,
    a: Side,
    b: Side,
}

fn side(
    fabric: &SimFabric,
    name: &str,
    nics: usize,
    gpu: GpuConfig,
    config: &EngineConfig,
) -> Side {
    let verbs = fabric.add_node(
        name,
        NodeConfig {
            ipv4: None,
            devices: vec![DeviceConfig::default(); nics],
        },
    );
    let cuda = SimCuda::new(vec![gpu], fabric.faults());
    let engine = SimEngine::new(&verbs, Some(&cuda), config.clone()).unwrap();
    Side {
        verbs,
        cuda,
        engine,
    }
}

fn world(nics: usize, gpu: GpuConfig, config: EngineConfig) -> World {
    init_tracing();
    let fabric = SimFabric::new();
    let a = side(&fabric, "a", nics, gpu.clone(), &config);
    let b = side(&fabric, "b", nics, gpu, &config);
    World { fabric, a, b }
}

/// Connects a to b (b listens on every NIC; a uses `paths` or the route to
/// b's first NIC) and returns (a's peer b, b's peer a).
fn connect(w: &World, multi_nic: bool) -> (SimPeer, SimPeer) {
    let mut listener =
        w.b.engine
            .listen(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
            .unwrap();
    let port = listener.local_addr().port();
    let accepting = thread::spawn(move || listener.accept(T));
    let paths: Vec<Path> = if multi_nic {
        ["sim0", "sim1"]
            .iter()
            .map(|nic| Path {
                source: Some(w.a.ip(nic)),
                peer: SocketAddr::new(w.b.ip(nic), port),
            })
            .collect()
    } else {
        vec![Path {
            source: None,
            peer: SocketAddr::new(w.b.ip("sim0"), port),
        }]
    };
    let a_to_b = w.a.engine.connect_paths(&paths, T).unwrap();
    let b_to_a = accepting.join().unwrap().unwrap();
    (a_to_b, b_to_a)
}

fn config(qps: u16) -> EngineConfig {
    EngineConfig {
        qps_per_peer: qps,
        default_timeout: T,
        ..EngineConfig::default()
    }
}

/// b grants `region` to a; a waits for the announcement.
fn grant_to(
    granter: &SimPeer,
    grantee: &SimPeer,
    region: &SimRegion,
    rights: GrantRights,
) -> (
    gdr_core::engine::RegionGrant<SimVerbsApi, SimCudaApi>,
    MemoryDescriptor,
) {
    let grant = granter.grant(region, 0, region.len(), rights).unwrap();
    let seen = grantee.wait_grant(grant.descriptor().grant, T).unwrap();
    assert_eq!(
        &seen,
        grant.descriptor(),
        "the peer sees exactly what was granted"
    );
    (grant, seen)
}

#[test]
fn host_write_then_read_back_byte_for_byte() {
    let w = world(1, GpuConfig::default(), config(2));
    let (ab, ba) = connect(&w, false);
    const LEN: u64 = 3 << 20;
    let (_src, src) = w.a.host(LEN, 1);
    let (dst_buf, dst) = w.b.host(LEN, 0);
    let (_grant, remote) = grant_to(&ba, &ab, &dst, GrantRights::ReadWrite);
    ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(w.b.bytes(&dst_buf), pattern(LEN as usize, 1));
    let (back_buf, back) = w.a.host(LEN, 9);
    ab.submit(&[Transfer::read(&back, 0, &remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(w.a.bytes(&back_buf), pattern(LEN as usize, 1));
}

/// Every pair of memory kinds, each on every rung its kind allows.
#[test]
fn every_pair_of_memory_kinds_and_rungs() {
    const LEN: u64 = 300 * 1024 + 7;
    let kinds = [Kind::Host, Kind::Pinned, Kind::Gpu];
    for rung in [Rung::Dmabuf, Rung::Peermem] {
        let mut cfg = config(2);
        cfg.slice_size = 64 * 1024;
        cfg.ladder = LadderConfig {
            policy: Policy::Only(rung),
            ..LadderConfig::default()
        };
        let gpu = GpuConfig {
            peermem: true,
            ..GpuConfig::default()
        };
        let w = world(1, gpu, cfg);
        let (ab, ba) = connect(&w, false);
        for (i, &from) in kinds.iter().enumerate() {
            for (j, &to) in kinds.iter().enumerate() {
                let seed = (i * 3 + j) as u8 + 1;
                let (_s, src) = w.a.alloc(from, LEN, seed);
                let (dst_buf, dst) = w.b.alloc(to, LEN, 0);
                if to == Kind::Gpu {
                    assert_eq!(dst.rungs(), vec![rung], "{to:?}");
                }
                let (_g, remote) = grant_to(&ba, &ab, &dst, GrantRights::ReadWrite);
                ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
                    .unwrap()
                    .wait(T)
                    .unwrap_or_else(|e| panic!("{rung:?} {from:?}->{to:?}: {e}"));
                assert_eq!(
                    w.b.bytes(&dst_buf),
                    pattern(LEN as usize, seed),
                    "{rung:?} WRITE {from:?}->{to:?}"
                );
                let (back_buf, back) = w.a.alloc(from, LEN, 0);
                ab.submit(&[Transfer::read(&back, 0, &remote, 0, LEN)])
                    .unwrap()
                    .wait(T)
                    .unwrap();
                assert_eq!(
                    w.a.bytes(&back_buf),
                    pattern(LEN as usize, seed),
                    "{rung:?} READ {to:?}->{from:?}"
                );
            }
        }
    }
}

#[test]
fn slices_spread_over_every_queue_pair_with_one_doorbell_each() {
    let mut cfg = config(4);
    cfg.slice_size = 64 * 1024;
    let w = world(1, GpuConfig::default(), cfg);
    let (ab, ba) = connect(&w, false);
    const LEN: u64 = 4 << 20;
    let (_s, src) = w.a.host(LEN, 3);
    let (dst_buf, dst) = w.b.host(LEN, 0);
    let (_g, remote) = grant_to(&ba, &ab, &dst, GrantRights::Write);
    let before = ab.counters();
    // Many transfers in one batch, at odd offsets.
    let parts: Vec<(u64, u64)> = (0..8).map(|i| (i * (LEN / 8), LEN / 8)).collect();
    let transfers: Vec<_> = parts
        .iter()
        .map(|&(off, len)| Transfer::write(&src, off, &remote, off, len))
        .collect();
    ab.submit(&transfers).unwrap().wait(T).unwrap();
    assert_eq!(w.b.bytes(&dst_buf), pattern(LEN as usize, 3));
    let after = ab.counters();
    let slices = LEN / (64 * 1024);
    let mut total = 0;
    for ((qp, _, c0), (_, _, c1)) in before.iter().zip(&after) {
        let posted = c1.posted - c0.posted;
        assert_eq!(posted, slices / 4, "queue pair {qp} took its share");
        assert!(
            c1.signaled - c0.signaled < posted,
            "selective signalling on queue pair {qp}"
        );
        total += posted;
    }
    assert_eq!(total, slices);
}

#[test]
fn slices_travel_over_both_nics() {
    let mut cfg = config(4);
    cfg.slice_size = 32 * 1024;
    let w = world(2, GpuConfig::default(), cfg);
    let (ab, ba) = connect(&w, true);
    const LEN: u64 = 1 << 20;
    let (_s, src) = w.a.host(LEN, 4);
    let (dst_buf, dst) = w.b.host(LEN, 0);
    let (_g, remote) = grant_to(&ba, &ab, &dst, GrantRights::ReadWrite);
    assert_eq!(
        remote.devices().collect::<Vec<_>>(),
        ["sim0", "sim1"],
        "one segment per NIC the peer's queue pairs use"
    );
    ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(w.b.bytes(&dst_buf), pattern(LEN as usize, 4));
    let mut per_nic = std::collections::BTreeMap::new();
    for (_, nic, c) in ab.counters() {
        *per_nic.entry(nic).or_insert(0) += c.bytes;
    }
    assert_eq!(per_nic.len(), 2, "{per_nic:?}");
    assert!(
        per_nic.values().all(|&b| b >= LEN / 2 - 32 * 1024),
        "{per_nic:?}"
    );
}

#[test]
fn requests_outside_their_grant_are_refused_before_posting() {
    let w = world(1, GpuConfig::default(), config(2));
    let (ab, ba) = connect(&w, false);
    let (_s, src) = w.a.host(1 << 16, 1);
    let (_d, dst) = w.b.host(1 << 16, 0);
    let read_only = ba.grant(&dst, 4096, 8192, GrantRights::Read).unwrap();
    let remote = ab.wait_grant(read_only.descriptor().grant, T).unwrap();
    let before = ab.counters();
    let refused = |t: Transfer<'_, SimVerbsApi>| ab.submit(&[t]).unwrap_err();
    assert!(matches!(
        refused(Transfer::write(&src, 0, &remote, 0, 16)),
        EngineError::AccessDenied { op: "WRITE", .. }
    ));
    assert!(matches!(
        refused(Transfer::read(&src, 0, &remote, 8000, 193)),
        EngineError::OutOfBounds {
            what: "remote grant",
            ..
        }
    ));
    assert!(matches!(
        refused(Transfer::read(&src, (1 << 16) - 8, &remote, 0, 16)),
        EngineError::OutOfBounds {
            what: "local region",
            ..
        }
    ));
    // A descriptor the peer never announced (a forged one: a wider range).
    let mut forged = remote.clone();
    forged.len = 1 << 16;
    assert!(matches!(
        refused(Transfer::read(&src, 0, &forged, 0, 16)),
        EngineError::NotGranted { .. }
    ));
    // Revoked: once the peer's notice arrives, the grant is refused.
    let id = read_only.descriptor().grant;
    drop(read_only);
    let deadline = std::time::Instant::now() + T;
    while ab.remote_grant(id).is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "revocation never seen"
        );
        ab.engine().progress();
    }
    assert!(matches!(
        refused(Transfer::read(&src, 0, &remote, 0, 16)),
        EngineError::NotGranted { .. }
    ));
    assert_eq!(ab.counters(), before, "nothing was posted");
    // The valid request still works.
    let ok = ba.grant(&dst, 0, 4096, GrantRights::Read).unwrap();
    let remote = ab.wait_grant(ok.descriptor().grant, T).unwrap();
    ab.submit(&[Transfer::read(&src, 0, &remote, 0, 4096)])
        .unwrap()
        .wait(T)
        .unwrap();
}

/// A grant revoked while the peer has not yet heard of it: its request
/// fails on its queue pair with a remote access error, the queue pair's
/// other requests flush, the other queue pairs go on, and later batches
/// succeed on them.
#[test]
fn a_queue_pair_failure_fails_only_its_requests() {
    let mut cfg = config(2);
    cfg.slice_size = 4096;
    let w = world(1, GpuConfig::default(), cfg);
    let (ab, ba) = connect(&w, false);
    let (_s, src) = w.a.host(1 << 16, 5);
    let (dst_buf, dst) = w.b.host(1 << 16, 0);
    let (good_grant, good) = grant_to(&ba, &ab, &dst, GrantRights::ReadWrite);
    let (doomed_grant, doomed) = grant_to(&ba, &ab, &dst, GrantRights::ReadWrite);
    // The MRs go now; the notice sits unread at a.
    drop(doomed_grant);
    // One slice, on the next queue pair in turn.
    let failed = ab
        .submit(&[Transfer::write(&src, 0, &doomed, 0, 4096)])
        .unwrap();
    let err = failed.wait(T).unwrap_err();
    assert!(matches!(err, TransferError::RemoteAccess { .. }), "{err}");
    // Later batches go over the queue pair still up.
    for _ in 0..4 {
        ab.submit(&[Transfer::write(&src, 0, &good, 0, 1 << 16)])
            .unwrap()
            .wait(T)
            .unwrap();
    }
    assert_eq!(w.b.bytes(&dst_buf), pattern(1 << 16, 5));
    drop(good_grant);
}

#[test]
fn control_messages_both_ways_and_a_message_too_large() {
    let mut cfg = config(1);
    cfg.max_message = 256;
    let w = world(1, GpuConfig::default(), cfg);
    let (ab, ba) = connect(&w, false);
    // a sends more than b keeps receives posted for: the rest goes out as
    // b reposts, which a sees only if it makes progress meanwhile.
    let driver = w.a.engine.spawn_driver(Duration::from_millis(1));
    for i in 0..100u32 {
        ab.send(&i.to_le_bytes()).unwrap();
    }
    for i in 0..100u32 {
        let got = ba.recv(T).unwrap_or_else(|e| panic!("message {i}: {e}"));
        assert_eq!(got, i.to_le_bytes(), "in order");
    }
    ba.send(b"pong").unwrap().wait(T).unwrap();
    assert_eq!(ab.recv(T).unwrap(), b"pong");
    let big = vec![7u8; 256];
    assert!(matches!(
        ab.send(&big).unwrap_err(),
        EngineError::MessageTooLarge { max: 256, .. }
    ));
    let fits = vec![7u8; 256 - gdr_core::engine::wire::HEADER_LEN];
    ab.send(&fits).unwrap().wait(T).unwrap();
    assert_eq!(ba.recv(T).unwrap(), fits);
    assert!(matches!(
        ba.recv(Duration::from_millis(20)).unwrap_err(),
        EngineError::Timeout(_)
    ));
    drop(driver);
}

#[test]
fn a_peer_that_goes_away_fails_requests_typed() {
    let w = world(1, GpuConfig::default(), config(2));
    let (ab, ba) = connect(&w, false);
    let (_s, src) = w.a.host(1 << 16, 5);
    let (_d, dst) = w.b.host(1 << 16, 0);
    let (_g, remote) = grant_to(&ba, &ab, &dst, GrantRights::ReadWrite);
    ba.close().unwrap();
    // a learns it from the goodbye or the disconnect, whichever it sees.
    let deadline = std::time::Instant::now() + T;
    loop {
        match ab.submit(&[Transfer::write(&src, 0, &remote, 0, 4096)]) {
            Err(EngineError::PeerGone(_)) => break,
            Ok(batch) => {
                let outcome = batch.wait(T);
                if let Err(e) = outcome {
                    assert!(
                        matches!(
                            e,
                            TransferError::PeerGone { .. }
                                | TransferError::RetryExceeded { .. }
                                | TransferError::Flushed { .. }
                        ),
                        "{e}"
                    );
                }
            }
            Err(e) => panic!("{e}"),
        }
        assert!(std::time::Instant::now() < deadline, "the peer never went");
    }
}

#[test]
fn a_batch_past_its_deadline_times_out_and_the_qp_is_stopped() {
    let w = world(1, GpuConfig::default(), config(1));
    let (ab, ba) = connect(&w, false);
    let (_s, src) = w.a.host(1 << 16, 5);
    let (_d, dst) = w.b.host(1 << 16, 0);
    let (_g, remote) = grant_to(&ba, &ab, &dst, GrantRights::ReadWrite);
    // Nothing moves on the fabric: the request stays in flight.
    w.fabric.set_paused(true);
    let batch = ab
        .submit_with_timeout(
            &[Transfer::write(&src, 0, &remote, 0, 4096)],
            Duration::from_millis(50),
        )
        .unwrap();
    let start = std::time::Instant::now();
    let err = batch.wait(T).unwrap_err();
    let took = start.elapsed();
    assert!(matches!(err, TransferError::Timeout { .. }), "{err}");
    assert!(
        took >= Duration::from_millis(50),
        "not before its deadline: {took:?}"
    );
    w.fabric.set_paused(false);
    // The queue pair was stopped: the peer's only queue pair is gone.
    assert!(matches!(
        ab.submit(&[Transfer::write(&src, 0, &remote, 0, 16)]),
        Err(EngineError::PeerGone(_))
    ));
}

#[test]
fn a_fatal_device_event_fails_everything_on_that_device_at_once() {
    let w = world(1, GpuConfig::default(), config(2));
    let (ab, ba) = connect(&w, false);
    let (_s, src) = w.a.host(1 << 16, 5);
    let (_d, dst) = w.b.host(1 << 16, 0);
    let (_g, remote) = grant_to(&ba, &ab, &dst, GrantRights::ReadWrite);
    w.fabric.set_paused(true);
    let batch = ab
        .submit(&[Transfer::write(&src, 0, &remote, 0, 1 << 16)])
        .unwrap();
    w.a.verbs
        .raise_async_event("sim0", hal_verbs::AsyncEvent::DeviceFatal);
    let err = batch.wait(Duration::from_secs(2)).unwrap_err();
    assert!(
        matches!(&err, TransferError::DeviceFatal { device } if device == "sim0"),
        "{err}"
    );
    assert!(matches!(
        ab.submit(&[Transfer::write(&src, 0, &remote, 0, 16)]),
        Err(EngineError::PeerGone(_))
    ));
    w.fabric.set_paused(false);
}

/// The GPU fence is tied to the batch: a READ into GPU memory flushes that
/// GPU once before `wait` returns, where the GPU's write ordering asks for
/// it, and never where it orders writes itself; a peer's WRITE is fenced
/// on the region, on request.
#[test]
fn the_gpu_fence_follows_the_batch_that_wrote() {
    for (ordering, flushes_expected) in [
        (hal_cuda::WritesOrdering::None, 1),
        (hal_cuda::WritesOrdering::Owner, 0),
    ] {
        let gpu = GpuConfig {
            writes_ordering: ordering,
            ..GpuConfig::default()
        };
        let w = world(1, gpu, config(2));
        let (ab, ba) = connect(&w, false);
        let (_s, src) = w.b.host(1 << 16, 8);
        let (_g, remote) = grant_to(&ba, &ab, &src, GrantRights::ReadWrite);
        let (gpu_buf, gpu_region) = w.a.gpu(1 << 16, 0);
        let (_h, host_region) = w.a.host(1 << 16, 0);
        // A READ into host memory fences nothing.
        ab.submit(&[Transfer::read(&host_region, 0, &remote, 0, 1 << 16)])
            .unwrap()
            .wait(T)
            .unwrap();
        assert_eq!(w.a.cuda.flushes(0), 0, "{ordering:?}");
        let batch = ab
            .submit(&[
                Transfer::read(&gpu_region, 0, &remote, 0, 1 << 15),
                Transfer::read(&gpu_region, 1 << 15, &remote, 1 << 15, 1 << 15),
            ])
            .unwrap();
        batch.wait(T).unwrap();
        batch.wait(T).unwrap();
        assert_eq!(
            w.a.cuda.flushes(0),
            flushes_expected,
            "{ordering:?}: one fence for the batch"
        );
        assert_eq!(w.a.bytes(&gpu_buf), pattern(1 << 16, 8));
        // Inbound: b WRITEs into a's GPU region; a fences the region.
        let (_g2, gpu_remote) = grant_to(&ab, &ba, &gpu_region, GrantRights::Write);
        ba.submit(&[Transfer::write(&src, 0, &gpu_remote, 0, 1 << 16)])
            .unwrap()
            .wait(T)
            .unwrap();
        let fence = w.a.engine.fence_inbound_writes(&gpu_region).unwrap();
        assert_eq!(
            fence == gdr_core::engine::Fence::Flushed,
            flushes_expected == 1,
            "{ordering:?}"
        );
        assert_eq!(
            w.a.engine.fence_inbound_writes(&host_region).unwrap(),
            gdr_core::engine::Fence::NotNeeded
        );
    }
}
