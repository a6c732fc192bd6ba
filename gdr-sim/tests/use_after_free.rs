//! The simulator catches uses after free on its own: freed device memory is
//! quarantined, and every access by address into it is refused (as CUDA
//! refuses a pointer it does not know) and reported on the GPU that freed
//! it, whether or not the address was allocated again. A GPU configured to
//! reuse freed addresses keeps CUDA's "same address, new buffer id".

use hal_cuda::{
    Context as _, CudaError, DeviceMemory as _, Driver as _, HostRegisterFlags, IpcMapping as _,
    MemoryType, PinnedHostMemory as _, Stream as _, VirtualMapping as _, VirtualReservation as _,
};
use hal_verbs::{AccessFlags, ProtectionDomain as _, Provider as _, VerbsError};

use gdr_sim::{FaultPlan, GpuConfig, NodeConfig, SimCuda, SimFabric, SimGpuContext, UseAfterFree};

const LEN: usize = 1 << 20;

fn gpus(configs: Vec<GpuConfig>) -> SimCuda {
    SimCuda::new(configs, FaultPlan::new())
}

fn one_gpu() -> (SimCuda, SimGpuContext) {
    let cuda = gpus(vec![GpuConfig::default()]);
    let ctx = cuda.context(0).unwrap();
    (cuda, ctx)
}

/// CUDA's answer to a pointer it does not know, non-sticky.
fn assert_invalid_value(result: hal_cuda::Result<()>, what: &str) {
    match result {
        Err(CudaError::InvalidArgument { code, reason, .. }) => {
            assert_eq!(code, Some(1), "{what}: CUDA_ERROR_INVALID_VALUE");
            assert!(reason.contains("use after free"), "{what}: {reason}");
        }
        other => panic!("{what}: {other:?}"),
    }
}

fn read(ctx: &SimGpuContext, addr: u64, len: usize) -> Vec<u8> {
    let stream = ctx.create_stream().unwrap();
    let mut out = vec![0xffu8; len];
    // SAFETY: `out` outlives the synchronize below.
    unsafe { stream.copy_device_to_host(out.as_mut_ptr(), addr, len) }.unwrap();
    stream.synchronize().unwrap();
    out
}

fn write(ctx: &SimGpuContext, addr: u64, bytes: &[u8]) -> hal_cuda::Result<()> {
    let stream = ctx.create_stream()?;
    // SAFETY: `bytes` outlives the synchronize below.
    unsafe { stream.copy_host_to_device(addr, bytes.as_ptr(), bytes.len()) }?;
    stream.synchronize()
}

#[test]
fn a_copy_into_freed_memory_is_refused_and_reported_after_a_new_allocation() {
    let (cuda, ctx) = one_gpu();
    let freed = ctx.alloc(LEN).unwrap();
    let (addr, id) = (freed.device_ptr(), freed.buffer_id());
    drop(freed);
    // The next allocation of that size: never the freed address.
    let next = ctx.alloc(LEN).unwrap();
    assert_ne!(next.device_ptr(), addr, "a quarantined address reused");
    assert_ne!(next.buffer_id(), id);

    let data = [0xabu8; 4096];
    assert_invalid_value(write(&ctx, addr + 100, &data), "H2D into freed memory");
    let reports = cuda.use_after_free_reports(0);
    let [
        UseAfterFree {
            operation,
            addr: at,
            len,
            freed,
        },
    ] = &reports[..]
    else {
        panic!("one report: {reports:?}");
    };
    assert_eq!(
        (*operation, *at, *len),
        ("cuMemcpyHtoDAsync", addr + 100, 4096)
    );
    assert_eq!(
        (freed.buffer_id, freed.base, freed.len, freed.ordinal),
        (id, addr, LEN, 0)
    );
    assert_eq!(freed.freed_by, "cuMemFree");
    assert_eq!(read(&ctx, next.device_ptr(), 4096), vec![0u8; 4096]);
    // The context is not broken by it (a non-sticky error).
    write(&ctx, next.device_ptr(), &data).unwrap();
    assert_eq!(read(&ctx, next.device_ptr(), 4096), data);
    assert_eq!(cuda.use_after_free_count(0), 1);
}

#[test]
fn every_access_by_address_to_freed_memory_is_refused_and_reported() {
    let (cuda, ctx) = one_gpu();
    let live = ctx.alloc(LEN).unwrap();
    let freed = ctx.alloc(LEN).unwrap();
    let (addr, id) = (freed.device_ptr(), freed.buffer_id());
    drop(freed);
    let stream = ctx.create_stream().unwrap();
    let mut host = vec![0u8; 64];
    let to = live.device_ptr();
    // Each call is refused before anything is queued; `host` and `live`
    // outlive the stream anyway.
    // SAFETY: as said.
    let result = unsafe { stream.copy_device_to_host(host.as_mut_ptr(), addr, 64) };
    assert_invalid_value(result, "D2H from freed memory");
    // SAFETY: as said.
    let result = unsafe { stream.copy_device_to_device(addr, to, 64) };
    assert_invalid_value(result, "D2D into freed memory");
    // SAFETY: as said.
    let result = unsafe { stream.copy_device_to_device(to, addr + 64, 64) };
    assert_invalid_value(result, "D2D from freed memory");
    // SAFETY: as said.
    let result = unsafe { stream.memset(addr, 7, 64) };
    assert_invalid_value(result, "memset of freed memory");
    // SAFETY: as said.
    let result = unsafe { stream.write_value32(addr, 1) };
    assert_invalid_value(result, "stream write into freed memory");
    // SAFETY: as said.
    let result = unsafe { stream.wait_value32(addr, 1) };
    assert_invalid_value(result, "stream wait on freed memory");
    stream.synchronize().unwrap();
    let exported = ctx.export_dmabuf(addr, 4096).map(drop);
    assert_invalid_value(exported, "cuMemGetHandleForAddressRange");
    assert_invalid_value(ctx.ipc_export(addr).map(drop), "cuIpcGetMemHandle");

    let reports = cuda.use_after_free_reports(0);
    let operations: Vec<_> = reports.iter().map(|r| r.operation).collect();
    assert_eq!(
        operations,
        [
            "cuMemcpyDtoHAsync",
            "cuMemcpyDtoDAsync",
            "cuMemcpyDtoDAsync",
            "cuMemsetD8Async",
            "cuStreamWriteValue32",
            "cuStreamWaitValue32",
            "cuMemGetHandleForAddressRange",
            "cuIpcGetMemHandle",
        ]
    );
    assert!(reports.iter().all(|r| r.freed.buffer_id == id));
    assert_eq!(reports[2].addr, addr + 64, "the source's address");

    // Queries answer as CUDA does for a freed pointer, unreported.
    assert!(ctx.pointer_attributes(addr).is_err());
    assert!(ctx.address_range(addr).is_err());
    assert_eq!(cuda.use_after_free_count(0), 8);
    assert_eq!(gdr_sim::memory::freed(addr).map(|f| f.buffer_id), Some(id));
}

#[test]
fn with_reuse_freed_addresses_a_freed_address_comes_back_with_a_new_buffer_id() {
    let cuda = gpus(vec![GpuConfig {
        reuse_freed_addresses: true,
        ..GpuConfig::default()
    }]);
    let ctx = cuda.context(0).unwrap();
    let first = ctx.alloc(LEN).unwrap();
    let (addr, id) = (first.device_ptr(), first.buffer_id());
    drop(first);
    let second = ctx.alloc(LEN).unwrap();
    assert_eq!(second.device_ptr(), addr, "CUDA's allocator reuses it");
    let attrs = ctx.pointer_attributes(addr).unwrap();
    assert_ne!(attrs.buffer_id, id, "a new buffer id");
    assert_eq!(attrs.buffer_id, second.buffer_id());
    // A stale write lands in the new allocation, unseen: what the
    // quarantine exists to catch.
    write(&ctx, addr, &[5u8; 16]).unwrap();
    assert_eq!(read(&ctx, second.device_ptr(), 16), [5u8; 16]);
    assert!(cuda.use_after_free_reports(0).is_empty());
}

#[test]
fn reports_of_one_gpu_do_not_show_on_another() {
    let two = gpus(vec![GpuConfig::default(), GpuConfig::default()]);
    let other = gpus(vec![GpuConfig::default()]);
    let (zero, one) = (two.context(0).unwrap(), two.context(1).unwrap());
    let on_zero = zero.alloc(LEN).unwrap();
    let addr = on_zero.device_ptr();
    drop(on_zero);
    let on_one = one.alloc(LEN).unwrap();
    drop(on_one);
    let _live = other.context(0).unwrap().alloc(LEN).unwrap();

    // GPU 1's context touches GPU 0's freed memory: GPU 0's report.
    assert_invalid_value(write(&one, addr, &[1]), "H2D from GPU 1");
    assert_eq!(two.use_after_free_count(0), 1);
    assert_eq!(two.use_after_free_reports(0)[0].freed.ordinal, 0);
    assert_eq!(two.use_after_free_count(1), 0);
    assert!(two.use_after_free_reports(1).is_empty());
    assert_eq!(other.use_after_free_count(0), 0, "another node's GPU 0");
    assert_eq!(two.use_after_free_count(7), 0, "no such GPU");
}

#[test]
fn ibv_reg_mr_over_freed_device_memory_is_refused_and_reported() {
    let cuda = gpus(vec![GpuConfig {
        peermem: true,
        ..GpuConfig::default()
    }]);
    let ctx = cuda.context(0).unwrap();
    let fabric = SimFabric::new();
    let pd = {
        use hal_verbs::Context as _;
        fabric
            .add_node("n", NodeConfig::default())
            .open("sim0")
            .unwrap()
            .alloc_pd()
            .unwrap()
    };
    let memory = ctx.alloc(LEN).unwrap();
    let addr = memory.device_ptr();
    // SAFETY: `memory` outlives the MR (dropped at once).
    drop(unsafe { pd.register(addr, LEN, AccessFlags::transfer()) }.unwrap());
    drop(memory);
    // SAFETY: refused, nothing is registered.
    let err = unsafe { pd.register(addr, LEN, AccessFlags::transfer()) }.unwrap_err();
    assert_eq!(
        err,
        VerbsError::from_errno("ibv_reg_mr", "sim0", libc::EFAULT)
    );
    let reports = cuda.use_after_free_reports(0);
    assert_eq!(reports.len(), 1);
    assert_eq!(
        (reports[0].operation, reports[0].addr),
        ("ibv_reg_mr", addr)
    );
}

#[test]
fn an_unmapped_vmm_chunk_is_quarantined_until_mapped_again() {
    let (cuda, ctx) = one_gpu();
    let g = ctx.vmm_granularity().unwrap();
    let reservation = ctx.reserve_address_range(2 * g).unwrap();
    let base = reservation.base();
    let a = ctx.create_physical(g).unwrap();
    let b = ctx.create_physical(g).unwrap();
    let first = ctx.map(&reservation, 0, &a).unwrap();
    let second = ctx.map(&reservation, g, &b).unwrap();
    let (at, id) = (second.device_ptr(), second.buffer_id());
    drop(second);
    assert_invalid_value(write(&ctx, at + 8, &[1; 8]), "into the unmapped chunk");
    // A copy from the live chunk across into the unmapped one.
    assert_invalid_value(write(&ctx, at - 8, &[1; 16]), "across the chunks");
    let reports = cuda.use_after_free_reports(0);
    assert_eq!(reports.len(), 2, "{reports:?}");
    assert!(reports.iter().all(|r| r.freed.buffer_id == id));
    assert_eq!(reports[0].freed.freed_by, "cuMemUnmap");
    assert_eq!((reports[1].addr, reports[1].len), (at - 8, 16));
    // Mapped again (the caller names the address): live, not freed.
    let again = ctx.map(&reservation, g, &b).unwrap();
    assert_eq!(again.device_ptr(), at);
    write(&ctx, at - 8, &[2; 16]).unwrap();
    assert_eq!(cuda.use_after_free_count(0), 2);
    assert_eq!(base + g as u64, at);
    drop((again, first, a, b, reservation));
}

#[test]
fn a_closed_ipc_mapping_is_quarantined() {
    let (cuda, ctx) = one_gpu();
    let memory = ctx.alloc(LEN).unwrap();
    let handle = ctx.ipc_export(memory.device_ptr()).unwrap();
    let importer = cuda.other_process();
    let imported = importer.context(0).unwrap();
    let mapping = imported.ipc_open(&handle).unwrap();
    let addr = mapping.device_ptr();
    drop(mapping);
    assert_invalid_value(write(&imported, addr, &[3; 4]), "into a closed mapping");
    // The importer's GPU: the same GPU of the node (the exporter's view).
    let reports = importer.use_after_free_reports(0);
    assert_eq!(reports.len(), 1);
    assert_eq!(cuda.use_after_free_count(0), 1);
    assert_eq!(reports[0].freed.freed_by, "cuIpcCloseMemHandle");
    // The exporter's allocation is untouched and still live.
    assert_eq!(read(&ctx, memory.device_ptr(), 4), [0; 4]);
}

/// The permissions `/proc/self/maps` shows for the mapping holding `addr`
/// (`None`: unmapped).
fn permissions(addr: u64) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (range, perms) = (fields.next()?, fields.next()?);
        let (start, end) = range.split_once('-')?;
        let start = u64::from_str_radix(start, 16).ok()?;
        let end = u64::from_str_radix(end, 16).ok()?;
        (start <= addr && addr < end).then(|| perms.to_owned())
    })
}

#[test]
fn freed_pinned_memory_is_inaccessible_refused_and_reported() {
    let cuda = gpus(vec![GpuConfig {
        peermem: true,
        ..GpuConfig::default()
    }]);
    let ctx = cuda.context(0).unwrap();
    let device = ctx.alloc(4096).unwrap();
    let pinned = ctx.alloc_pinned(4096).unwrap();
    let ptr = pinned.as_ptr();
    assert!(permissions(ptr as u64).unwrap().starts_with("rw"));
    drop(pinned);
    // Still mapped, inaccessible: a stale CPU or NIC access faults at
    // once, and the kernel cannot give the addresses to another mapping.
    assert_eq!(permissions(ptr as u64).as_deref(), Some("---p"));
    let others: Vec<_> = (0..8).map(|_| ctx.alloc_pinned(4096).unwrap()).collect();
    assert!(others.iter().all(|p| p.as_ptr() != ptr));

    let stream = ctx.create_stream().unwrap();
    // SAFETY: refused before anything is queued.
    let result = unsafe { stream.copy_host_to_device(device.device_ptr(), ptr, 64) };
    assert_invalid_value(result, "H2D from freed pinned memory");
    // SAFETY: as above.
    let result = unsafe { stream.copy_device_to_host(ptr.wrapping_add(8), device.device_ptr(), 8) };
    assert_invalid_value(result, "D2H into freed pinned memory");
    // SAFETY: as above.
    let result = unsafe { ctx.register_host(ptr, 4096, HostRegisterFlags::empty()) };
    assert_invalid_value(result.map(drop), "cuMemHostRegister");
    let pd = {
        use hal_verbs::Context as _;
        let fabric = SimFabric::new();
        let node = fabric.add_node("n", NodeConfig::default());
        node.open("sim0").unwrap().alloc_pd().unwrap()
    };
    // SAFETY: refused, nothing is registered.
    let err = unsafe { pd.register(ptr as u64, 4096, AccessFlags::transfer()) }.unwrap_err();
    assert_eq!(
        err,
        VerbsError::from_errno("ibv_reg_mr", "sim0", libc::EFAULT)
    );
    // A query answers as for memory CUDA does not know, unreported.
    let attrs = ctx.pointer_attributes(ptr as u64).unwrap();
    assert_eq!(attrs.memory_type, MemoryType::PageableHost);

    let reports = cuda.use_after_free_reports(0);
    let operations: Vec<_> = reports.iter().map(|r| r.operation).collect();
    assert_eq!(
        operations,
        [
            "cuMemcpyHtoDAsync",
            "cuMemcpyDtoHAsync",
            "cuMemHostRegister",
            "ibv_reg_mr"
        ]
    );
    assert!(
        reports
            .iter()
            .all(|r| r.freed.base == ptr as u64 && r.freed.freed_by == "cuMemFreeHost")
    );
    assert_eq!(reports[1].addr, ptr as u64 + 8);
}

/// `cuMemFreeHost` waits for every stream (the real driver does: issue
/// 33), so a copy queued on pinned memory has run by the time its free
/// returns, and the memory is quarantined then.
#[test]
fn a_copy_queued_on_pinned_memory_runs_before_its_quarantine() {
    let (cuda, ctx) = one_gpu();
    let device = ctx.alloc(4096).unwrap();
    let pinned = ctx.alloc_pinned(4096).unwrap();
    let ptr = pinned.as_ptr();
    // SAFETY: `pinned` is 4096 bytes, written by nothing else.
    unsafe { std::ptr::write_bytes(ptr, 0x5a, 4096) };
    let stream = ctx.create_stream().unwrap();
    // SAFETY: the free waits for the queued copy (as cuMemFreeHost waits
    // for every stream), which the test checks.
    unsafe { stream.copy_host_to_device(device.device_ptr(), ptr, 4096) }.unwrap();
    drop(pinned);
    assert_eq!(
        permissions(ptr as u64).as_deref(),
        Some("---p"),
        "freed once the copy queued on it ran"
    );
    assert_eq!(read(&ctx, device.device_ptr(), 4096), vec![0x5a; 4096]);
    assert_eq!(cuda.use_after_free_count(0), 0);
}

#[test]
fn with_reuse_freed_addresses_pinned_memory_is_unmapped() {
    let cuda = gpus(vec![GpuConfig {
        reuse_freed_addresses: true,
        ..GpuConfig::default()
    }]);
    let pinned = cuda.context(0).unwrap().alloc_pinned(4096).unwrap();
    let ptr = pinned.as_ptr() as u64;
    drop(pinned);
    // (Not probed: the kernel may map something else there at once.)
    assert_eq!(gdr_sim::memory::freed(ptr), None);
}
