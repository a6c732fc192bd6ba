//! The lifetime rule (gdr-core's `cache` module docs) and the probe verdicts,
//! on the simulation backends: escaped and leaked registrations keep their
//! memory, a buffer over caller memory waits for its MRs, every live MR
//! counts against the budget, registrations stay inside their buffer, grants
//! confine the peer, dma-buf exports close with their last user, transient
//! probe failures are retried, one thread probes at a time, and the
//! self-check never frees what a NIC may still write.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use gdr_core::buffer::Buffer;
use gdr_core::cache::{BudgetLimits, CacheError};
use gdr_core::ladder::{
    GrantRights, LadderConfig, LadderError, NicRegistrar, Policy, RegisterError, Rung,
};
use gdr_core::loopback::{Loopback, LoopbackError};
use gdr_sim::{DeviceConfig, Fault, FaultSite, GpuConfig};
use gdr_tests::grants::{self, grants_confine_the_peer};
use gdr_tests::ladder_world::{LadderWorld, SimLadder};
use hal_cuda::{Context as _, Stream as _};
use hal_verbs::{
    AccessFlags, MemoryRegion as _, ProtectionDomain as _, Provider as _, SendOp, Sge, VerbsError,
};

type World = LadderWorld;

fn world(gpu: GpuConfig) -> World {
    World::new(vec![DeviceConfig::default()], gpu)
}

/// Makes the `nth` `ibv_reg_dmabuf_mr` on `sim0` fail with `errno`.
fn fail_dmabuf_registration(w: &World, nth: u64, errno: i32) {
    w.plan.fail_nth(
        FaultSite::VerbsRegisterDmabuf,
        nth,
        Fault::Verbs(VerbsError::from_errno("ibv_reg_dmabuf_mr", "sim0", errno)),
    );
}

/// Writes `byte` over `len` bytes at `addr` with an RDMA READ into the local
/// region `lkey` (the READ's sink is where the NIC writes), reading from a
/// peer region of the same PD filled with `byte`.
fn nic_writes_into(ladder: &SimLadder, world: &World, lkey: u32, addr: u64, len: usize, byte: u8) {
    let ctx = world.node.erased().open("sim0").unwrap();
    let peer =
        Loopback::<hal_verbs::dynamic::DynApi>::with_pd(&ctx, Arc::clone(ladder.pd()), 1).unwrap();
    let source = vec![byte; len];
    // SAFETY: `source` outlives the region (dropped at the end of the fn).
    let remote = unsafe {
        peer.pd().register(
            source.as_ptr() as u64,
            len,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        )
    }
    .unwrap();
    // SAFETY: the SG entry names the escaped region; the test keeps its
    // memory alive (that is what it checks), `run` waits for completion.
    unsafe {
        peer.run(
            SendOp::Read {
                remote_addr: remote.addr(),
                rkey: remote.rkey(),
            },
            Sge {
                addr,
                length: len as u32,
                lkey,
            },
            "RDMA READ",
        )
    }
    .unwrap();
}

/// The review's escaped-handle scenario: register a 64 KiB host buffer,
/// clone the registration's cache handle (or leak the registration), drop
/// the registration and the buffer. The cache shows no entry, but the MR
/// lives: its memory must too, so the allocator cannot hand it to a new
/// allocation that one RDMA write through the escaped MR then overwrites.
fn escaped_registration_keeps_its_memory(leak: bool) {
    let w = world(GpuConfig::default());
    let ladder = w.ladder("sim0", LadderConfig::default().with_self_check(false));
    const LEN: usize = 64 << 10;
    let buffer = Buffer::alloc_host(LEN as u64);
    let registration = buffer.register(&ladder, 0, LEN as u64).unwrap();
    let (lkey, addr) = {
        let mr = registration.mr().unwrap();
        (mr.lkey(), mr.addr())
    };
    let escaped = if leak {
        std::mem::forget(registration);
        None
    } else {
        let handle = registration.handle().unwrap().clone();
        drop(registration);
        Some(handle)
    };
    drop(buffer);
    assert_eq!(ladder.cache().stats().entries, 0, "unlinked from the index");
    assert_eq!(ladder.budget().usage().mrs, 1, "the escaped MR is alive");
    // Allocations of the same size that the allocator might place there.
    let victims: Vec<Vec<u8>> = (0..32).map(|_| vec![0x11u8; LEN]).collect();
    for v in &victims {
        let start = v.as_ptr() as u64;
        assert!(
            start + LEN as u64 <= addr || addr + LEN as u64 <= start,
            "the allocator reused memory a live MR covers ({start:#x} in {addr:#x}+{LEN:#x})"
        );
    }
    nic_writes_into(&ladder, &w, lkey, addr, 4096, 0xee);
    for v in &victims {
        assert!(
            v.iter().all(|&b| b == 0x11),
            "an allocation was overwritten"
        );
    }
    drop(escaped);
    if !leak {
        assert_eq!(
            ladder.budget().usage().mrs,
            0,
            "the last handle deregisters"
        );
    }
}

#[test]
fn a_cloned_handle_keeps_the_memory_of_its_mr_alive() {
    escaped_registration_keeps_its_memory(false);
}

#[test]
fn a_leaked_registration_keeps_the_memory_of_its_mr_alive() {
    escaped_registration_keeps_its_memory(true);
}

#[test]
fn dropping_a_buffer_over_caller_memory_waits_for_its_last_mr() {
    let w = world(GpuConfig::default());
    let ladder = w.ladder("sim0", LadderConfig::default().with_self_check(false));
    let mut memory = vec![0u8; 8192];
    let addr = memory.as_mut_ptr() as u64;
    // SAFETY: `memory` is freed only after the buffer is dropped (below).
    let buffer = unsafe { Buffer::wrap(None, addr, 8192, None) }.unwrap();
    let registration = buffer.register(&ladder, 0, 8192).unwrap();
    let handle = registration.handle().unwrap().clone();
    drop(registration);
    assert_eq!(buffer.live_regions(), 1);

    // `release` hands the buffer back while the MR lives...
    let buffer = buffer.release(Duration::from_millis(20)).unwrap_err();
    // ...and `drop` waits for it.
    let released = Arc::new(AtomicBool::new(false));
    let holder = {
        let released = Arc::clone(&released);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            released.store(true, Ordering::SeqCst);
            drop(handle);
        })
    };
    let started = Instant::now();
    drop(buffer);
    assert!(
        released.load(Ordering::SeqCst),
        "drop returned after {:?} while an MR still covered the memory",
        started.elapsed()
    );
    assert_eq!(ladder.budget().usage().mrs, 0);
    holder.join().unwrap();
    drop(memory);

    // With nothing alive, release returns at once.
    let mut memory = vec![0u8; 4096];
    // SAFETY: as above.
    let buffer = unsafe { Buffer::wrap(None, memory.as_mut_ptr() as u64, 4096, None) }.unwrap();
    drop(buffer.register(&ladder, 0, 4096).unwrap());
    assert!(buffer.release(Duration::ZERO).is_ok());
    drop(memory);
}

#[test]
fn every_live_mr_counts_against_the_domain_budget() {
    let w = world(GpuConfig::default());
    let ladder = w.ladder(
        "sim0",
        LadderConfig::default()
            .with_self_check(false)
            .with_budget(BudgetLimits {
                max_mrs: 2,
                max_bytes: u64::MAX,
            }),
    );
    let buffer = Buffer::alloc_host(1 << 20);
    let registered_before = w.plan.calls(FaultSite::VerbsRegister);
    // 16 widening requests, each overlapping the last, every handle held:
    // each would merge into a new, wider MR while the old ones stay in use.
    let mut held = Vec::new();
    let mut refused = 0;
    for i in 0..16u64 {
        match buffer.register(&ladder, i * 4096, 8192) {
            Ok(registration) => held.push(registration),
            Err(LadderError::Host {
                source: CacheError::Register { source, .. },
                ..
            }) if matches!(*source, RegisterError::Budget(_)) => refused += 1,
            Err(e) => panic!("request {i}: {e}"),
        }
    }
    let usage = ladder.budget().usage();
    assert!(usage.peak_mrs <= 2, "{usage:?}");
    let registered = w.plan.calls(FaultSite::VerbsRegister) - registered_before;
    assert!(
        registered <= 2,
        "{registered} MRs asked of the NIC, none deregistered"
    );
    assert_eq!(held.len() + refused, 16);
    assert!(refused > 0, "the budget refused the requests past it");
    // Grants count too: none fits now.
    let Err(LadderError::Grant {
        source: RegisterError::Budget(_),
        ..
    }) = ladder.grant(&held[0], 0, 4096, GrantRights::Read)
    else {
        panic!("a grant past the budget")
    };
    drop(held);
    // Unused entries are evicted to make room.
    let grant_source = buffer.register(&ladder, 0, 4096).unwrap();
    let grant = ladder
        .grant(&grant_source, 0, 4096, GrantRights::Read)
        .unwrap();
    assert!(ladder.budget().usage().mrs <= 2);
    drop((grant, grant_source));
}

#[test]
fn a_registration_never_reaches_past_its_buffer() {
    let w = world(GpuConfig::default());
    let ladder = w.ladder("sim0", LadderConfig::default());
    let ctx = w.gpu();
    // Two pinned allocations; whatever their placement, each buffer's
    // registrations cover it alone, and dropping one leaves the other's.
    let a = Buffer::alloc_pinned(&ctx, 8192).unwrap();
    let b = Buffer::alloc_pinned(&ctx, 8192).unwrap();
    let ra = a.register(&ladder, 0, 8192).unwrap();
    let rb = b.register(&ladder, 0, 8192).unwrap();
    let (ha, hb) = (ra.handle().unwrap(), rb.handle().unwrap());
    assert_eq!((ha.start(), ha.end()), (a.addr(), a.addr() + 8192));
    assert_eq!((hb.start(), hb.end()), (b.addr(), b.addr() + 8192));
    assert!(!ha.same_registration(hb));
    // Widening merges stay inside the buffer.
    let wide = a.register(&ladder, 4096, 4096).unwrap();
    assert!(wide.handle().unwrap().end() <= a.addr() + 8192);
    drop((ra, wide));
    let entries = ladder.cache().stats().entries;
    drop(a);
    assert_eq!(
        ladder.cache().stats().entries,
        entries - 1,
        "only a's entry"
    );
    assert!(
        b.register(&ladder, 0, 8192)
            .unwrap()
            .handle()
            .unwrap()
            .same_registration(hb)
    );
    drop(rb);

    // A GPU buffer on a ladder without its GPU is refused as such.
    let no_gpu = w.ladder_with("sim0", Vec::new(), LadderConfig::default());
    let device = Buffer::alloc_device(&ctx, 4096).unwrap();
    assert!(matches!(
        device.register(&no_gpu, 0, 4096),
        Err(LadderError::UnknownGpu { ordinal: 0 })
    ));
}

#[test]
fn the_cache_refuses_a_request_outside_its_bounds() {
    use gdr_core::cache::{Bounds, Request};
    let w = world(GpuConfig::default());
    let ladder = w.ladder("sim0", LadderConfig::default());
    let buffer = Buffer::alloc_host(8192);
    let request = Request::host(ladder.domain(), buffer.addr() + 4096, 8192)
        .within(buffer.owner(), Bounds::new(buffer.addr(), 8192));
    // SAFETY: the registrar is never used (the request is refused first).
    let registrar = unsafe {
        NicRegistrar::new(
            Arc::clone(ladder.pd()),
            Arc::clone(&w.exports),
            Arc::clone(ladder.budget()),
        )
    };
    assert!(matches!(
        w.cache.get_or_register(&registrar, &request),
        Err(CacheError::OutsideBounds { .. })
    ));
    assert_eq!(w.plan.calls(FaultSite::VerbsRegister), 0);
}

#[test]
fn grants_confine_the_peer_on_the_sim() {
    let w = world(GpuConfig::default());
    let ladder = w.ladder("sim0", LadderConfig::default());
    let ctx = w.node.erased().open("sim0").unwrap();
    grants_confine_the_peer(&ctx, &ladder, 1);
}

/// Grants over GPU memory, on the dma-buf rung and on the peermem rung.
fn gpu_grants_confine_the_peer(gpu: GpuConfig, nic: DeviceConfig, rung: Rung) {
    let w = World::new(vec![nic], gpu);
    let ladder = w.ladder("sim0", LadderConfig::default());
    let gpu = w.gpu();
    let buffer = Buffer::alloc_device(&gpu, grants::LEN as u64).unwrap();
    let registration = buffer.register(&ladder, 0, grants::LEN as u64).unwrap();
    assert_eq!(registration.rung(), rung);
    assert!(!registration.cpu_readable(), "GPU memory: no inline sends");
    drop(registration);
    let stream = gpu.create_stream().unwrap();
    let fill = |bytes: &[u8]| {
        // SAFETY: `bytes` outlives the synchronize; the range is the buffer's.
        unsafe { stream.copy_host_to_device(buffer.addr(), bytes.as_ptr(), bytes.len()) }.unwrap();
        stream.synchronize().unwrap();
    };
    let read = || {
        let mut out = vec![0u8; grants::LEN];
        // SAFETY: as above.
        unsafe { stream.copy_device_to_host(out.as_mut_ptr(), buffer.addr(), grants::LEN) }
            .unwrap();
        stream.synchronize().unwrap();
        out
    };
    let ctx = w.node.erased().open("sim0").unwrap();
    grants::grants_confine_the_peer_to(&ctx, &ladder, 1, &buffer, fill, read);
}

#[test]
fn grants_over_dmabuf_gpu_memory_confine_the_peer() {
    gpu_grants_confine_the_peer(GpuConfig::default(), DeviceConfig::default(), Rung::Dmabuf);
}

#[test]
fn grants_over_peermem_gpu_memory_confine_the_peer() {
    gpu_grants_confine_the_peer(
        GpuConfig {
            peermem: true,
            ..GpuConfig::default()
        },
        DeviceConfig::rxe_like(),
        Rung::Peermem,
    );
}

#[test]
fn a_failed_dmabuf_registration_closes_its_export() {
    let w = world(GpuConfig::default());
    let ladder = w.ladder(
        "sim0",
        LadderConfig::default().with_policy(Policy::Only(Rung::Dmabuf)),
    );
    let buffer = Buffer::alloc_device(&w.gpu(), 64 << 10).unwrap();
    // Call 1 is the probe's; the buffer's own registration fails.
    fail_dmabuf_registration(&w, 2, libc::EINVAL);
    assert!(matches!(
        buffer.register(&ladder, 0, 4096),
        Err(LadderError::NoAllowedRung { .. })
    ));
    assert_eq!(w.exports.live(), 0, "the export closed with the failure");
    assert!(w.exports.get(buffer.buffer_id()).is_none());
    w.plan.assert_all_fired();
}

#[test]
fn dropping_a_buffer_over_part_of_an_allocation_spares_the_others() {
    let w = world(GpuConfig::default());
    let ladder = w.ladder("sim0", LadderConfig::default());
    let ctx = w.gpu();
    let memory = ctx.alloc(256 << 10).unwrap();
    let base = hal_cuda::DeviceMemory::device_ptr(&memory);
    // SAFETY: both buffers are dropped before `memory`.
    let (first, second) = unsafe {
        (
            Buffer::wrap(Some(&ctx), base, 64 << 10, None).unwrap(),
            Buffer::wrap(Some(&ctx), base + (128 << 10), 64 << 10, None).unwrap(),
        )
    };
    let r1 = first.register(&ladder, 0, 64 << 10).unwrap();
    let r2 = second.register(&ladder, 0, 64 << 10).unwrap();
    assert_eq!((r1.rung(), r2.rung()), (Rung::Dmabuf, Rung::Dmabuf));
    let buffer_id = second.buffer_id();
    drop(r1);
    drop(first);
    assert!(
        w.exports.get(buffer_id).is_some(),
        "the allocation's export lives while the other buffer's MR uses it"
    );
    let again = second.register(&ladder, 0, 64 << 10).unwrap();
    assert!(
        again
            .handle()
            .unwrap()
            .same_registration(r2.handle().unwrap()),
        "the other buffer's entry was not wiped"
    );
    drop((again, r2));
    drop(second);
    assert!(w.exports.get(buffer_id).is_none());
    drop(memory);
}

#[test]
fn a_transient_probe_failure_is_retried_not_remembered() {
    let w = world(GpuConfig::default());
    let ladder = w.ladder(
        "sim0",
        LadderConfig::default().with_probe_backoff(Duration::from_millis(50)),
    );
    // The probe's own ibv_reg_dmabuf_mr runs out of memory once.
    fail_dmabuf_registration(&w, 1, libc::ENOMEM);
    let buffer = Buffer::alloc_device(&w.gpu(), 64 << 10).unwrap();
    let first = buffer.register(&ladder, 0, 4096).unwrap();
    assert_ne!(first.rung(), Rung::Dmabuf);
    let failure = &first.failures()[0];
    assert!(
        failure.from_probe && failure.refusal.is_transient(),
        "{failure}"
    );
    drop(first);
    // Within the back-off the rung is skipped without probing again...
    let probes = w.plan.calls(FaultSite::VerbsRegisterDmabuf);
    assert_ne!(
        buffer.register(&ladder, 0, 4096).unwrap().rung(),
        Rung::Dmabuf
    );
    assert_eq!(w.plan.calls(FaultSite::VerbsRegisterDmabuf), probes);
    // ...and after it, probed again and taken.
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(
        buffer.register(&ladder, 0, 4096).unwrap().rung(),
        Rung::Dmabuf
    );
    assert_eq!(ladder.verdict(0, Rung::Dmabuf), Some(Ok(())));
    w.plan.assert_all_fired();
}

#[test]
fn a_permanent_probe_refusal_is_remembered() {
    let w = world(GpuConfig::default());
    let ladder = w.ladder(
        "sim0",
        LadderConfig::default().with_probe_backoff(Duration::ZERO),
    );
    fail_dmabuf_registration(&w, 1, libc::EOPNOTSUPP);
    let buffer = Buffer::alloc_device(&w.gpu(), 64 << 10).unwrap();
    for _ in 0..3 {
        let registration = buffer.register(&ladder, 0, 4096).unwrap();
        assert_ne!(registration.rung(), Rung::Dmabuf);
        assert!(!registration.failures()[0].refusal.is_transient());
    }
    assert_eq!(
        w.plan.calls(FaultSite::VerbsRegisterDmabuf),
        1,
        "probed once"
    );
}

#[test]
fn concurrent_first_registrations_probe_a_pair_once() {
    let w = world(GpuConfig::default());
    let ladder = w.ladder("sim0", LadderConfig::default());
    let ctx = w.gpu();
    let buffers: Vec<_> = (0..8)
        .map(|_| Buffer::alloc_device(&ctx, 64 << 10).unwrap())
        .collect();
    let barrier = Barrier::new(buffers.len() + 1);
    // The NIC makes no progress at first, so the first probe's self-check
    // is still waiting when every other thread arrives.
    w.fabric.set_paused(true);
    std::thread::scope(|s| {
        for buffer in &buffers {
            let (ladder, barrier) = (&ladder, &barrier);
            s.spawn(move || {
                barrier.wait();
                assert_eq!(
                    buffer.register(ladder, 0, 4096).unwrap().rung(),
                    Rung::Dmabuf
                );
            });
        }
        barrier.wait();
        std::thread::sleep(Duration::from_millis(300));
        w.fabric.set_paused(false);
    });
    // One probe export and one export per buffer's allocation.
    assert_eq!(
        w.plan.calls(FaultSite::CudaExportDmabuf),
        1 + buffers.len() as u64,
        "the pair was probed more than once"
    );
}

#[test]
fn a_timed_out_self_check_is_flushed_before_its_buffers_go() {
    let w = world(GpuConfig::default());
    let ctx = w.node.erased().open("sim0").unwrap();
    let mut loopback = Loopback::<hal_verbs::dynamic::DynApi>::new(&ctx, 1).unwrap();
    loopback.set_timeout(Duration::from_millis(50));
    let mut target = vec![0u8; 4096];
    // SAFETY: `target` is leaked below if the check could not be flushed.
    let mr = unsafe {
        loopback.pd().register(
            target.as_mut_ptr() as u64,
            4096,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
    }
    .unwrap();
    // The NIC stops making progress: the WRITE never completes. Moving the
    // requester to the error state flushes it (the sim flushes at once; a
    // real NIC may not, and then the outcome is `Unquiesced`).
    w.fabric.set_paused(true);
    let outcome = loopback.prove(&mr, 0, 4096);
    w.fabric.set_paused(false);
    match outcome {
        Err(LoopbackError::Timeout { .. }) => {
            // Flushed: the memory is ours again.
            drop(mr);
            drop(target);
        }
        Err(LoopbackError::Unquiesced { .. }) => {
            // The stuck WRITE may still land in `target`: leak it.
            std::mem::forget(mr);
            std::mem::forget(target);
        }
        other => panic!("{other:?}"),
    }
    // A late completion of the stuck request is never taken for a new one.
    let mut fresh = vec![0u8; 4096];
    // SAFETY: `fresh` outlives its region (dropped first).
    let mr = unsafe {
        loopback.pd().register(
            fresh.as_mut_ptr() as u64,
            4096,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
    }
    .unwrap();
    loopback.set_timeout(Duration::from_secs(10));
    loopback.prove(&mr, 0, 4096).unwrap();
    drop(mr);
    drop(fresh);
}
