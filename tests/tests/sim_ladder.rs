//! The registration ladder and buffers on the simulation backends: every
//! rung forced on and off with the sim's capability switches, the reasons
//! recorded for each rung above the one taken, policies, the self-check,
//! one dma-buf export shared by two NICs, stale address reuse, and faults
//! in the middle of a registration.

use std::sync::Arc;

use gdr_core::buffer::{Access, Buffer, BufferAccessError};
use gdr_core::cache::{Bounds, Request};
use gdr_core::descriptor::{MemoryDescriptor, MemoryLocation, Reach};
use gdr_core::ladder::{
    Gpu, GrantRights, Ladder, LadderConfig, LadderError, Policy, Refusal, Rung,
};
use gdr_core::loopback::{Loopback, LoopbackError};
use gdr_sim::{DeviceConfig, Fault, FaultSite, GpuConfig};
use gdr_tests::ladder_world::LadderWorld;
use gdr_tests::pattern;
use hal_cuda::{Context as _, Driver as _, MemoryType, Stream as _};
use hal_verbs::{AccessFlags, MemoryRegion as _, Provider as _, SendOp, Sge, VerbsError, WcStatus};

type World = LadderWorld;

fn world(nics: Vec<DeviceConfig>, gpu: GpuConfig) -> World {
    World::new(nics, gpu)
}

fn read_gpu(world: &World, addr: u64, len: usize) -> Vec<u8> {
    let ctx = world.gpu();
    let stream = ctx.create_stream().unwrap();
    let mut out = vec![0u8; len];
    // SAFETY: `out` outlives the synchronize.
    unsafe { stream.copy_device_to_host(out.as_mut_ptr(), addr, len) }.unwrap();
    stream.synchronize().unwrap();
    out
}

#[test]
fn host_buffers_take_the_host_rung_and_hit_the_cache_again() {
    let w = world(vec![DeviceConfig::default()], GpuConfig::default());
    let ladder = w.ladder("sim0", LadderConfig::default());
    let buffer = Buffer::alloc_host(1 << 20);
    let first = buffer.register(&ladder, 0, 1 << 20).unwrap();
    assert_eq!(first.rung(), Rung::HostMemory);
    assert!(first.failures().is_empty());
    assert!(!first.cache_hit(), "the first registration registers");
    let inner = buffer.register(&ladder, 4096, 8192).unwrap();
    assert!(inner.cache_hit(), "a range inside a cached one is a hit");
    assert!(
        inner
            .handle()
            .unwrap()
            .same_registration(first.handle().unwrap()),
        "a range inside a cached one hits"
    );
    let stats = w.cache.stats();
    assert_eq!((stats.hits, stats.misses), (1, 1), "{stats:?}");
    let again = buffer.register(&ladder, 0, 1 << 20).unwrap();
    assert!(again.cache_hit(), "the same range again is a hit");
    // Invalidated (the handles held keep their MR): registered anew.
    assert_eq!(w.cache.invalidate(buffer.addr(), 1 << 20), 1);
    let after = buffer.register(&ladder, 0, 1 << 20).unwrap();
    assert!(!after.cache_hit(), "an invalidated range registers again");
    assert!(
        !after
            .handle()
            .unwrap()
            .same_registration(first.handle().unwrap())
    );
    assert!(buffer.register(&ladder, 0, 4096).unwrap().cache_hit());

    let pinned = Buffer::alloc_pinned(&w.gpu(), 8192).unwrap();
    assert_eq!(pinned.memory_type(), MemoryType::PinnedHost);
    assert_eq!(
        pinned.register(&ladder, 0, 8192).unwrap().rung(),
        Rung::HostMemory
    );
    assert!(matches!(
        buffer.register(&ladder, 1 << 20, 1),
        Err(LadderError::OutsideAllocation { .. })
    ));
}

#[test]
fn gpu_memory_takes_dmabuf_when_both_sides_can_and_is_reachable_by_rdma() {
    let w = world(vec![DeviceConfig::default()], GpuConfig::default());
    let ladder = w.ladder("sim0", LadderConfig::default());
    assert_eq!(ladder.verdict(0, Rung::Dmabuf), None, "probed on first use");
    let buffer = Buffer::alloc_device(&w.gpu(), 1 << 20).unwrap();
    let reg = buffer.register(&ladder, 64 << 10, 128 << 10).unwrap();
    assert_eq!(reg.rung(), Rung::Dmabuf);
    assert!(reg.failures().is_empty());
    assert!(!reg.cache_hit());
    assert!(
        buffer
            .register(&ladder, 64 << 10, 4096)
            .unwrap()
            .cache_hit()
    );
    assert_eq!(ladder.verdict(0, Rung::Dmabuf), Some(Ok(())));
    let grant = ladder
        .grant(&reg, 0, 128 << 10, GrantRights::ReadWrite)
        .unwrap();
    assert_eq!(grant.location(), MemoryLocation::Gpu { ordinal: 0 });
    assert_eq!(
        (grant.addr(), grant.len()),
        (buffer.addr() + (64 << 10), 128 << 10)
    );
    // What the peer gets, through the text form and back.
    let sent = MemoryDescriptor {
        owner: 1,
        grant: 1,
        location: grant.location(),
        rights: grant.rights(),
        len: grant.len(),
        reach: Reach::Direct(vec![grant.segment(0)]),
    };
    let received: MemoryDescriptor = sent.to_string().parse().unwrap();
    assert_eq!(received, sent);
    let descriptor = received.segment("sim0", 100, 3000).unwrap();
    assert_eq!(descriptor.addr, buffer.addr() + (64 << 10));
    assert_eq!(descriptor.len, 128 << 10);
    assert_ne!(
        descriptor.rkey,
        reg.mr().unwrap().rkey(),
        "a grant is an MR of its own"
    );

    // A peer writes through the descriptor; the bytes land in GPU memory.
    let ctx = w.node.erased().open("sim0").unwrap();
    let peer =
        Loopback::<hal_verbs::dynamic::DynApi>::with_pd(&ctx, Arc::clone(ladder.pd()), 1).unwrap();
    let payload = pattern(3000, 5);
    // SAFETY: `payload` outlives the registration and the operation.
    let src = unsafe {
        hal_verbs::ProtectionDomain::register(
            &**peer.pd(),
            payload.as_ptr() as u64,
            payload.len(),
            hal_verbs::AccessFlags::LOCAL_WRITE,
        )
    }
    .unwrap();
    // SAFETY: the SG entry lies in `src`, alive until `run` returns.
    unsafe {
        peer.run(
            SendOp::Write {
                remote_addr: descriptor.addr + 100,
                rkey: descriptor.rkey,
            },
            Sge {
                addr: src.addr(),
                length: 3000,
                lkey: src.lkey(),
            },
            "RDMA WRITE",
        )
    }
    .unwrap();
    assert_eq!(read_gpu(&w, descriptor.addr + 100, 3000), payload);
}

#[test]
fn peermem_is_taken_when_the_nic_refuses_dmabuf_and_the_reason_is_kept() {
    let w = world(
        vec![DeviceConfig::rxe_like()],
        GpuConfig {
            peermem: true,
            ..GpuConfig::default()
        },
    );
    let ladder = w.ladder("sim0", LadderConfig::default());
    let buffer = Buffer::alloc_device(&w.gpu(), 256 << 10).unwrap();
    let reg = buffer.register(&ladder, 0, 256 << 10).unwrap();
    assert_eq!(reg.rung(), Rung::Peermem);
    let [failure] = reg.failures() else {
        panic!("one rung above peermem: {:?}", reg.failures())
    };
    assert_eq!(failure.rung, Rung::Dmabuf);
    assert!(failure.from_probe);
    let Refusal::Nic(error) = &failure.refusal else {
        panic!("{failure}")
    };
    assert!(error.is_unsupported());
    assert_eq!(error.errno(), Some(libc::EOPNOTSUPP));

    // A second buffer reuses the verdict: no new dma-buf probe.
    let exports_before = w.plan.calls(FaultSite::CudaExportDmabuf);
    let other = Buffer::alloc_device(&w.gpu(), 64 << 10).unwrap();
    assert_eq!(
        other.register(&ladder, 0, 4096).unwrap().rung(),
        Rung::Peermem
    );
    assert_eq!(w.plan.calls(FaultSite::CudaExportDmabuf), exports_before);
}

#[test]
fn staging_when_no_direct_rung_works_with_every_reason() {
    let w = world(
        vec![DeviceConfig::default()],
        GpuConfig {
            dma_buf_supported: false,
            ..GpuConfig::default()
        },
    );
    let ladder = w.ladder("sim0", LadderConfig::default());
    let buffer = Buffer::alloc_device(&w.gpu(), 64 << 10).unwrap();
    let reg = buffer.register(&ladder, 0, 64 << 10).unwrap();
    assert_eq!(reg.rung(), Rung::Staging);
    assert!(reg.mr().is_none());
    assert!(matches!(
        ladder.grant(&reg, 0, 4096, GrantRights::Read),
        Err(LadderError::NotGrantable { .. })
    ));
    let rungs: Vec<_> = reg.failures().iter().map(|f| f.rung).collect();
    assert_eq!(rungs, [Rung::Dmabuf, Rung::Peermem]);
    assert!(matches!(reg.failures()[0].refusal, Refusal::Gpu(_)));
    let Refusal::Nic(e) = &reg.failures()[1].refusal else {
        panic!("{:?}", reg.failures())
    };
    assert_eq!(e.errno(), Some(libc::EFAULT), "no peer-memory client");
}

#[test]
fn policies_forbid_falling_back() {
    let w = world(vec![DeviceConfig::rxe_like()], GpuConfig::default());
    let strict = w.ladder(
        "sim0",
        LadderConfig::default().with_policy(Policy::RequireGpuDirect),
    );
    let buffer = Buffer::alloc_device(&w.gpu(), 64 << 10).unwrap();
    let Err(LadderError::NoAllowedRung { failures, .. }) = buffer.register(&strict, 0, 4096) else {
        panic!("GPU-direct or error")
    };
    assert_eq!(failures.len(), 2);
    let text = LadderError::NoAllowedRung {
        policy: Policy::RequireGpuDirect,
        failures,
    }
    .to_string();
    assert!(
        text.contains("Dmabuf") && text.contains("Peermem"),
        "{text}"
    );

    let w = world(
        vec![DeviceConfig::default()],
        GpuConfig {
            peermem: true,
            ..GpuConfig::default()
        },
    );
    let only_peermem = w.ladder(
        "sim0",
        LadderConfig::default().with_policy(Policy::Only(Rung::Peermem)),
    );
    let buffer = Buffer::alloc_device(&w.gpu(), 64 << 10).unwrap();
    let reg = buffer.register(&only_peermem, 0, 4096).unwrap();
    assert_eq!(reg.rung(), Rung::Peermem);
    assert_eq!(reg.failures()[0].refusal, Refusal::Policy);
}

#[test]
fn self_check_refuses_a_rung_that_registers_but_does_not_transfer() {
    let w = world(
        vec![DeviceConfig::default()],
        GpuConfig {
            peermem: true,
            ..GpuConfig::default()
        },
    );
    let ladder = w.ladder("sim0", LadderConfig::default());
    // The dma-buf probe's loopback WRITE fails as a broken GDR path would.
    w.plan.fail_next(
        FaultSite::VerbsCompletion,
        Fault::CompletionStatus(WcStatus::LOC_PROT_ERR),
    );
    let buffer = Buffer::alloc_device(&w.gpu(), 64 << 10).unwrap();
    let reg = buffer.register(&ladder, 0, 4096).unwrap();
    assert_eq!(reg.rung(), Rung::Peermem);
    assert!(
        matches!(reg.failures()[0].refusal, Refusal::SelfCheck(_)),
        "{:?}",
        reg.failures()
    );
    w.plan.assert_all_fired();
}

/// Read-only memory (`Buffer::wrap_read_only`) registers with no write
/// access, host and GPU memory alike; its cache entries are its own (a
/// read-write request of the same owner and range finds nothing); a grant
/// of it with write rights is refused, never downgraded, and a read
/// grant's MR allows READs only. The NIC holds to it: a WRITE through the
/// read grant and a READ into the registration both fail, the bytes
/// unchanged, while a READ of it works.
#[test]
fn read_only_memory_registers_and_grants_without_write_access() {
    let w = world(vec![DeviceConfig::default()], GpuConfig::default());
    let ladder = w.ladder("sim0", LadderConfig::default());
    let writes = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let owner = Buffer::alloc_host(8192);
    owner.write_at(0, &pattern(8192, 5)).unwrap();
    // SAFETY: `owner` holds the memory and outlives the buffer.
    let ro = unsafe { Buffer::wrap_read_only(None, owner.addr(), 8192, None) }.unwrap();
    assert_eq!(ro.access(), Access::ReadOnly);
    assert_eq!(
        ro.write_at(0, &[1]),
        Err(BufferAccessError::ReadOnly { offset: 0, len: 1 })
    );
    let reg = ro.register(&ladder, 0, 8192).unwrap();
    assert_eq!(
        (reg.rung(), reg.access()),
        (Rung::HostMemory, Access::ReadOnly)
    );
    let flags = reg.mr().unwrap().access();
    assert!(!flags.intersects(writes), "{flags:?}");
    let request = Request::host(ladder.domain(), ro.addr(), 8192)
        .within(ro.owner(), Bounds::new(ro.addr(), 8192));
    assert!(
        w.cache.get(&request).is_none(),
        "a read-write request never finds a read-only entry"
    );
    let entry = w.cache.get(&request.with_access(Access::ReadOnly)).unwrap();
    assert!(entry.same_registration(reg.handle().unwrap()));
    for rights in [GrantRights::Write, GrantRights::ReadWrite] {
        assert!(
            matches!(
                ladder.grant(&reg, 0, 8192, rights),
                Err(LadderError::ReadOnly { rights: asked, len: 8192, .. }) if asked == rights
            ),
            "{rights:?}"
        );
        assert!(matches!(
            ro.grant(&ladder, 0, 4096, rights),
            Err(LadderError::ReadOnly { .. })
        ));
    }
    let grant = ladder.grant(&reg, 0, 8192, GrantRights::Read).unwrap();
    assert_eq!(grant.mr().access(), AccessFlags::REMOTE_READ);

    // GPU memory on the dma-buf rung: no write access either.
    let gpu_owner = Buffer::alloc_device(&w.gpu(), 1 << 16).unwrap();
    // SAFETY: `gpu_owner` holds the memory and outlives the buffer.
    let gpu_ro =
        unsafe { Buffer::wrap_read_only(Some(&w.gpu()), gpu_owner.addr(), 1 << 16, None) }.unwrap();
    let gpu_reg = gpu_ro.register(&ladder, 0, 1 << 16).unwrap();
    assert_eq!(gpu_reg.rung(), Rung::Dmabuf);
    assert!(!gpu_reg.mr().unwrap().access().intersects(writes));

    // The NIC: a WRITE through the read grant, a READ into the
    // registration.
    let scratch = Buffer::alloc_host(8192);
    scratch.write_at(0, &pattern(8192, 9)).unwrap();
    let scratch_reg = scratch.register(&ladder, 0, 8192).unwrap();
    let scratch_grant = ladder
        .grant(&scratch_reg, 0, 8192, GrantRights::ReadWrite)
        .unwrap();
    let ctx = w.node.erased().open("sim0").unwrap();
    let loopback =
        Loopback::<hal_verbs::dynamic::DynApi>::with_pd(&ctx, Arc::clone(ladder.pd()), 1).unwrap();
    let sge = |mr: &hal_verbs::dynamic::DynMemoryRegion| Sge {
        addr: mr.addr(),
        length: 8192,
        lkey: mr.lkey(),
    };
    let failed = |operation, status| Err(LoopbackError::Completion { operation, status });
    // SAFETY: each SG entry lies in a live registration of the ladder's PD
    // (its memory outlives the call), and `run` waits for the completion.
    let write = unsafe {
        loopback.run(
            SendOp::Write {
                remote_addr: grant.addr(),
                rkey: grant.mr().rkey(),
            },
            sge(scratch_reg.mr().unwrap()),
            "RDMA WRITE",
        )
    };
    assert_eq!(write, failed("RDMA WRITE", WcStatus::REM_ACCESS_ERR));
    // SAFETY: as above.
    let read_into = unsafe {
        loopback.run(
            SendOp::Read {
                remote_addr: scratch_grant.addr(),
                rkey: scratch_grant.mr().rkey(),
            },
            sge(reg.mr().unwrap()),
            "RDMA READ",
        )
    };
    assert_eq!(read_into, failed("RDMA READ", WcStatus::LOC_PROT_ERR));
    assert_eq!(owner.to_vec().unwrap(), pattern(8192, 5), "unchanged");
    // SAFETY: as above.
    unsafe {
        loopback.run(
            SendOp::Read {
                remote_addr: grant.addr(),
                rkey: grant.mr().rkey(),
            },
            sge(scratch_reg.mr().unwrap()),
            "RDMA READ",
        )
    }
    .unwrap();
    assert_eq!(scratch.to_vec().unwrap(), pattern(8192, 5), "a READ of it");
    drop((
        grant,
        entry,
        reg,
        gpu_reg,
        scratch_grant,
        scratch_reg,
        loopback,
    ));
    drop((ro, gpu_ro));
}

#[test]
fn two_nics_share_one_dmabuf_export_per_allocation() {
    let w = world(
        vec![DeviceConfig::default(), DeviceConfig::default()],
        GpuConfig::default(),
    );
    let nic0 = w.ladder("sim0", LadderConfig::default());
    let nic1 = w.ladder("sim1", LadderConfig::default());
    let buffer = Buffer::alloc_device(&w.gpu(), 1 << 20).unwrap();
    let a = buffer.register(&nic0, 0, 1 << 20).unwrap();
    let exports_after_first = w.plan.calls(FaultSite::CudaExportDmabuf);
    let b = buffer.register(&nic1, 0, 1 << 20).unwrap();
    assert_eq!((a.rung(), b.rung()), (Rung::Dmabuf, Rung::Dmabuf));
    assert_ne!(a.mr().unwrap().lkey(), b.mr().unwrap().lkey());
    // nic1's first registration probes with a scratch export of its own
    // (one call), but the buffer's allocation is not exported again.
    assert_eq!(
        w.plan.calls(FaultSite::CudaExportDmabuf),
        exports_after_first + 1
    );
    assert!(w.exports.get(buffer.buffer_id()).is_some());
    drop((a, b));
    let id = buffer.buffer_id();
    drop(buffer);
    assert!(w.exports.get(id).is_none(), "freeing closes the export");
    assert_eq!(w.exports.live(), 0);
    assert_eq!(w.cache.stats().entries, 0, "and every registration");
}

#[test]
fn a_reallocated_address_gets_a_new_registration() {
    let w = world(
        vec![DeviceConfig::rxe_like()],
        GpuConfig {
            peermem: true,
            // CUDA's allocator: the freed address comes back.
            reuse_freed_addresses: true,
            ..GpuConfig::default()
        },
    );
    let ladder = w.ladder("sim0", LadderConfig::default());
    let ctx = w.gpu();
    let size = 9 << 20; // a size class no other test uses
    let first = ctx.alloc(size).unwrap();
    let addr = hal_cuda::DeviceMemory::device_ptr(&first);
    // SAFETY: the buffer is dropped before `first` is freed.
    let wrapped = unsafe { Buffer::wrap(Some(&ctx), addr, 4096, None) }.unwrap();
    let old_lkey = {
        let reg = wrapped.register(&ladder, 0, 4096).unwrap();
        assert_eq!(reg.rung(), Rung::Peermem);
        reg.mr().unwrap().lkey()
    };
    drop(wrapped);
    drop(first);
    let second = ctx.alloc(size).unwrap();
    assert_eq!(hal_cuda::DeviceMemory::device_ptr(&second), addr);
    // SAFETY: as above.
    let wrapped = unsafe { Buffer::wrap(Some(&ctx), addr, 4096, None) }.unwrap();
    let reg = wrapped.register(&ladder, 0, 4096).unwrap();
    assert_ne!(reg.mr().unwrap().lkey(), old_lkey, "a new registration");
    drop(reg);
    drop(wrapped);
}

#[test]
fn a_fault_mid_registration_leaves_no_entry_and_is_not_remembered() {
    let w = world(vec![DeviceConfig::default()], GpuConfig::default());
    let ladder = w.ladder("sim0", LadderConfig::default());
    let buffer = Buffer::alloc_device(&w.gpu(), 64 << 10).unwrap();
    // The probe registers once (call 1); the buffer's own registration is
    // call 2, and runs out of resources.
    w.plan.fail_nth(
        FaultSite::VerbsRegisterDmabuf,
        2,
        Fault::Verbs(VerbsError::from_errno(
            "ibv_reg_dmabuf_mr",
            "sim0",
            libc::ENOMEM,
        )),
    );
    let entries = w.cache.stats().entries;
    let reg = buffer.register(&ladder, 0, 4096).unwrap();
    assert_eq!(reg.rung(), Rung::Staging, "peermem is off: staging");
    assert!(!reg.failures()[0].from_probe);
    assert_eq!(w.cache.stats().entries, entries, "no half-registered entry");
    drop(reg);
    // A transient failure is not a verdict: the next attempt uses dma-buf.
    assert_eq!(
        buffer.register(&ladder, 0, 4096).unwrap().rung(),
        Rung::Dmabuf
    );
    w.plan.assert_all_fired();
}

#[test]
fn an_ipc_imported_buffer_registers_and_closes_after_its_registrations() {
    let w = world(vec![DeviceConfig::default()], GpuConfig::default());
    let exporter = w.gpu();
    let source = Buffer::alloc_device(&exporter, 128 << 10).unwrap();
    let handle = exporter.ipc_export(source.addr()).unwrap();

    let other_process = w.cuda.other_process().erased();
    let importer = other_process.context(0).unwrap();
    let imported = Buffer::import_ipc(&importer, &handle).unwrap();
    assert_eq!(imported.len(), 128 << 10);
    let gpu = Gpu::open(&other_process, 0).unwrap();
    let ctx = w.node.erased().open("sim0").unwrap();
    let ladder = Ladder::new(
        &ctx,
        vec![gpu],
        Arc::clone(&w.cache),
        Arc::clone(&w.exports),
        LadderConfig::default(),
    )
    .unwrap();
    let reg = imported.register(&ladder, 0, 128 << 10).unwrap();
    assert_eq!(reg.rung(), Rung::Dmabuf);
    drop(reg);
    assert!(w.cache.stats().entries > 0);
    drop(imported);
    assert_eq!(
        w.cache.stats().entries,
        0,
        "closing the mapping dropped its MRs first"
    );
}

#[test]
fn probe_all_reports_every_gpu_rung_once() {
    let w = world(
        vec![DeviceConfig::rxe_like()],
        GpuConfig {
            peermem: true,
            ..GpuConfig::default()
        },
    );
    let ladder = w.ladder("sim0", LadderConfig::default());
    let verdicts = ladder.probe_all();
    assert_eq!(verdicts.len(), 2, "{verdicts:?}");
    assert!(matches!(
        &verdicts[0],
        (0, Rung::Dmabuf, Err(Refusal::Nic(e))) if e.errno() == Some(libc::EOPNOTSUPP)
    ));
    assert_eq!(verdicts[1], (0, Rung::Peermem, Ok(())));
    let probes = w.plan.calls(FaultSite::VerbsRegisterDmabuf);
    assert_eq!(ladder.probe_all(), verdicts, "kept, not probed again");
    assert_eq!(w.plan.calls(FaultSite::VerbsRegisterDmabuf), probes);
}
