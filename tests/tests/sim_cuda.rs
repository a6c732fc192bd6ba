//! The simulated GPU behind the hal-cuda traits: copies, dma-buf export,
//! IPC between simulated processes, pointer attributes, buffer ids and
//! scripted faults. Always runs.

use std::os::fd::{AsFd, AsRawFd};

use gdr_sim::{Fault, FaultPlan, FaultSite, GpuConfig, SimCuda, SimCudaApi};
use gdr_tests::{init_tracing, pattern};
use hal_cuda::{
    AllocationKind, Context, CudaError, DeviceMemory, Driver, Event, FlushScope, HostRegisterFlags,
    IpcMapping, MemoryType, PhysicalMemory, PinnedHostMemory, Stream, VirtualMapping,
    VirtualReservation,
};

type Ctx = <SimCudaApi as hal_cuda::Api>::Context;

fn gpu(config: GpuConfig) -> (SimCuda, Ctx, FaultPlan) {
    init_tracing();
    let plan = FaultPlan::new();
    let driver = SimCuda::new(vec![config], plan.clone());
    let ctx = driver.context(0).unwrap();
    (driver, ctx, plan)
}

fn read_device(ctx: &Ctx, addr: u64, len: usize) -> Vec<u8> {
    let stream = ctx.create_stream().unwrap();
    let mut out = vec![0u8; len];
    // SAFETY: `out` outlives the synchronize below.
    unsafe { stream.copy_device_to_host(out.as_mut_ptr(), addr, len) }.unwrap();
    stream.synchronize().unwrap();
    out
}

fn write_device(ctx: &Ctx, addr: u64, bytes: &[u8]) {
    let stream = ctx.create_stream().unwrap();
    // SAFETY: `bytes` outlives the synchronize below.
    unsafe { stream.copy_host_to_device(addr, bytes.as_ptr(), bytes.len()) }.unwrap();
    stream.synchronize().unwrap();
}

#[test]
fn async_copies_run_in_order_and_move_every_byte() {
    let (driver, ctx, _) = gpu(GpuConfig::default());
    assert_eq!(driver.device_count().unwrap(), 1);
    for len in [1usize, 7, 4096, 65_537, 3 << 20] {
        let a = ctx.alloc(len).unwrap();
        let b = ctx.alloc(len).unwrap();
        let src = pattern(len, len as u8);
        let mut back = vec![0u8; len];
        let stream = ctx.create_stream().unwrap();
        let done = ctx.create_event().unwrap();
        driver.set_paused(true);
        // SAFETY: `src` and `back` outlive the event synchronize below.
        unsafe {
            stream.memset(b.device_ptr(), 0xee, len).unwrap();
            stream
                .copy_host_to_device(a.device_ptr(), src.as_ptr(), len)
                .unwrap();
            stream
                .copy_device_to_device(b.device_ptr(), a.device_ptr(), len)
                .unwrap();
            stream
                .copy_device_to_host(back.as_mut_ptr(), b.device_ptr(), len)
                .unwrap();
        }
        stream.record(&done).unwrap();
        assert!(
            !done.is_complete().unwrap(),
            "a paused GPU has not run the copies"
        );
        assert!(
            back.iter().all(|&x| x == 0),
            "nothing moved before completion"
        );
        driver.set_paused(false);
        assert!(done.is_complete().unwrap());
        assert_eq!(back, src, "len {len}");
    }
}

#[test]
fn stream_waits_on_another_streams_event() {
    let (_driver, ctx, _) = gpu(GpuConfig::default());
    let len = 8192;
    let mem = ctx.alloc(len).unwrap();
    let producer = ctx.create_stream().unwrap();
    let consumer = ctx.create_stream().unwrap();
    let produced = ctx.create_event().unwrap();
    let src = pattern(len, 3);
    let mut out = vec![0u8; len];
    // SAFETY: both host buffers outlive consumer.synchronize().
    unsafe {
        producer
            .copy_host_to_device(mem.device_ptr(), src.as_ptr(), len)
            .unwrap();
        producer.record(&produced).unwrap();
        consumer.wait(&produced).unwrap();
        consumer
            .copy_device_to_host(out.as_mut_ptr(), mem.device_ptr(), len)
            .unwrap();
    }
    // Only the consumer is synchronized: the wait must drive the producer.
    consumer.synchronize().unwrap();
    assert_eq!(out, src);
}

#[test]
fn copies_outside_an_allocation_are_refused() {
    let (_driver, ctx, _) = gpu(GpuConfig::default());
    let mem = ctx.alloc(4096).unwrap();
    let stream = ctx.create_stream().unwrap();
    let buf = [0u8; 16];
    // SAFETY: the calls are expected to fail before queuing anything.
    let err = unsafe { stream.copy_host_to_device(mem.device_ptr() + 4090, buf.as_ptr(), 16) }
        .unwrap_err();
    assert!(matches!(err, CudaError::InvalidArgument { .. }), "{err}");
    // SAFETY: as above.
    let err = unsafe { stream.copy_host_to_device(0x1000, buf.as_ptr(), 16) }.unwrap_err();
    assert!(matches!(err, CudaError::InvalidArgument { .. }), "{err}");
}

#[test]
fn dmabuf_export_shares_the_allocations_bytes_whole_and_at_an_offset() {
    let (_driver, ctx, _) = gpu(GpuConfig::default());
    let len = 64 << 10;
    let mem = ctx.alloc(len).unwrap();
    let bytes = pattern(len, 9);
    write_device(&ctx, mem.device_ptr(), &bytes);

    let whole = ctx.export_dmabuf(mem.device_ptr(), len).unwrap();
    let file = std::fs::File::from(whole.as_fd().try_clone_to_owned().unwrap());
    // SAFETY: the mapping is read only here, and nothing resizes the memfd.
    let view = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    assert_eq!(&view[..len], &bytes[..], "the fd exports the device bytes");
    assert_eq!(
        gdr_sim::gpu::dmabuf_extent(whole.as_raw_fd()),
        Some((0, len as u64))
    );

    let sub = ctx.export_dmabuf(mem.device_ptr() + 16384, 8192).unwrap();
    assert_eq!(
        gdr_sim::gpu::dmabuf_extent(sub.as_raw_fd()),
        Some((16384, 8192)),
        "a sub-range's dma-buf starts at the sub-range"
    );

    let err = ctx.export_dmabuf(mem.device_ptr() + 100, 4096).unwrap_err();
    assert!(
        matches!(err, CudaError::InvalidArgument { code: Some(1), .. }),
        "{err}"
    );
    let err = ctx.export_dmabuf(mem.device_ptr(), len + 4096).unwrap_err();
    assert!(matches!(err, CudaError::InvalidArgument { .. }), "{err}");
}

#[test]
fn dmabuf_switch_off_reports_not_supported() {
    let (_driver, ctx, _) = gpu(GpuConfig {
        dma_buf_supported: false,
        ..GpuConfig::default()
    });
    let mem = ctx.alloc(4096).unwrap();
    let err = ctx.export_dmabuf(mem.device_ptr(), 4096).unwrap_err();
    assert!(err.is_unsupported(), "{err}");
    assert_eq!(err.code(), Some(801));
}

#[test]
fn ipc_handle_opens_in_another_process_and_shares_bytes() {
    let (driver, ctx, _) = gpu(GpuConfig::default());
    let len = 10_000;
    let mem = ctx.alloc(len).unwrap();
    write_device(&ctx, mem.device_ptr(), &pattern(len, 42));
    let handle = ctx.ipc_export(mem.device_ptr() + 123).unwrap();

    let err = ctx.ipc_open(&handle).unwrap_err();
    assert_eq!(
        err.code(),
        Some(201),
        "the exporting process cannot open its own handle"
    );

    let other = driver.other_process();
    let other_ctx = other.context(0).unwrap();
    let mapping = other_ctx.ipc_open(&handle).unwrap();
    assert_eq!(mapping.len(), len);
    assert_ne!(mapping.device_ptr(), mem.device_ptr());
    assert_eq!(
        read_device(&other_ctx, mapping.device_ptr(), len),
        pattern(len, 42)
    );

    // Writes through the mapping are seen by the exporter.
    write_device(&other_ctx, mapping.device_ptr() + 10, &[1, 2, 3]);
    assert_eq!(read_device(&ctx, mem.device_ptr() + 10, 3), vec![1, 2, 3]);
    let attrs = other_ctx.pointer_attributes(mapping.device_ptr()).unwrap();
    assert_ne!(
        attrs.buffer_id,
        ctx.pointer_attributes(mem.device_ptr()).unwrap().buffer_id
    );

    drop(mapping);
    drop(mem);
    assert!(
        other_ctx.ipc_open(&handle).is_err(),
        "a freed allocation cannot be opened"
    );
    let garbage = hal_cuda::IpcMemHandle([7; 64]);
    assert!(matches!(
        other_ctx.ipc_open(&garbage).unwrap_err(),
        CudaError::InvalidArgument { .. }
    ));
}

#[test]
fn in_process_ipc_refuses_a_handle_with_the_wrong_tag() {
    let (driver, ctx, _) = gpu(GpuConfig::default());
    let mem = ctx.alloc(4096).unwrap();
    let handle = ctx.ipc_export(mem.device_ptr()).unwrap();
    let other_ctx = driver.other_process().context(0).unwrap();
    let err = other_ctx.ipc_open(&forge_tag(&handle)).unwrap_err();
    assert!(
        matches!(err, CudaError::InvalidArgument { .. }),
        "a forged handle: {err}"
    );
    other_ctx
        .ipc_open(&handle)
        .expect("the genuine handle opens");
}

/// `handle` with another tag (the sim's handle holds it in bytes 40..48):
/// same pid, fd, buffer id and size, so only the tag tells it from the real one.
fn forge_tag(handle: &hal_cuda::IpcMemHandle) -> hal_cuda::IpcMemHandle {
    let mut forged = *handle;
    forged.0[40] ^= 0x5a;
    forged
}

/// Set in the child of [`ipc_handle_opens_in_another_os_process`]: the URIs
/// of the live allocation, of it with a forged tag, and of a freed one.
const IPC_CHILD_ENV: &str = "GDR_SIM_IPC_CHILD";
const IPC_CHILD_LEN: usize = 3 << 20;

/// The test binary spawns itself: the child opens (through `gdr://` URIs)
/// the handle this process exported, reads the bytes written here, writes
/// new ones that this process then sees, and is refused a forged handle
/// and a freed allocation's.
#[test]
fn ipc_handle_opens_in_another_os_process() {
    use gdr_core::uri::BufferUri;

    let name = "ipc_handle_opens_in_another_os_process";
    if let Ok(uris) = std::env::var(IPC_CHILD_ENV) {
        ipc_child(&uris);
        return;
    }
    let (_driver, ctx, _) = gpu(GpuConfig::default());
    let len = IPC_CHILD_LEN;
    let mem = ctx.alloc(len).unwrap();
    write_device(&ctx, mem.device_ptr(), &pattern(len, 42));
    let handle = ctx.ipc_export(mem.device_ptr()).unwrap();
    let freed = ctx.alloc(len).unwrap();
    let freed_handle = ctx.ipc_export(freed.device_ptr()).unwrap();
    drop(freed);
    let uri = |handle| {
        BufferUri::V1 {
            device: 0,
            size: len as u64,
            handle,
        }
        .to_string()
    };
    let uris = [uri(handle), uri(forge_tag(&handle)), uri(freed_handle)].join(" ");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(IPC_CHILD_ENV, uris)
        .output()
        .expect("running the child");
    eprintln!("child stderr:\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the child failed ({:?}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "the child ran the test"
    );
    assert!(
        read_device(&ctx, mem.device_ptr(), len) == pattern(len, 7),
        "the child's writes through its mapping land in this process's allocation"
    );
}

/// The child half: another OS process with a simulated GPU of its own.
fn ipc_child(uris: &str) {
    use gdr_core::uri::BufferUri;

    let (_driver, ctx, _) = gpu(GpuConfig::default());
    let uris: Vec<BufferUri> = uris
        .split(' ')
        .map(|u| u.parse().expect("child: a URI"))
        .collect();
    let [live, forged, freed] = uris[..] else {
        panic!("child: three URIs");
    };
    let len = IPC_CHILD_LEN;
    let mapping = ctx.ipc_open(live.handle()).expect("child: open the handle");
    assert_eq!(mapping.len(), len);
    assert!(
        read_device(&ctx, mapping.device_ptr(), len) == pattern(len, 42),
        "child: the parent's bytes"
    );
    write_device(&ctx, mapping.device_ptr(), &pattern(len, 7));
    for (what, uri) in [("forged", forged), ("freed", freed)] {
        match ctx.ipc_open(uri.handle()) {
            Err(CudaError::InvalidArgument { reason, .. }) => {
                eprintln!("child: the {what} handle refused: {reason}");
            }
            Err(other) => panic!("child: the {what} handle: the wrong error: {other}"),
            Ok(_) => panic!("child: the {what} handle opened"),
        }
    }
}

#[test]
fn reallocation_at_a_freed_address_gets_a_new_buffer_id() {
    // CUDA's allocator: the freed address comes back (the sim's default
    // quarantines it).
    let (_driver, ctx, _) = gpu(GpuConfig {
        reuse_freed_addresses: true,
        ..GpuConfig::default()
    });
    // A size no other test uses: freed addresses are reused per size class,
    // and tests run in parallel.
    let size = 7 << 20;
    let first = ctx.alloc(size).unwrap();
    let (addr, id) = (
        first.device_ptr(),
        ctx.pointer_attributes(first.device_ptr())
            .unwrap()
            .buffer_id,
    );
    drop(first);
    let second = ctx.alloc(size).unwrap();
    assert_eq!(
        second.device_ptr(),
        addr,
        "the simulated allocator reuses addresses"
    );
    let attrs = ctx.pointer_attributes(second.device_ptr() + 4096).unwrap();
    assert_ne!(attrs.buffer_id, id);
    assert_eq!(attrs.allocation_base, addr);
}

#[test]
fn pointer_attributes_tell_device_pinned_and_pageable_apart() {
    let (_driver, ctx, _) = gpu(GpuConfig::default());
    let dev = ctx.alloc(3 << 20).unwrap();
    let attrs = ctx.pointer_attributes(dev.device_ptr() + 12345).unwrap();
    assert_eq!(attrs.memory_type, MemoryType::Device);
    assert_eq!(attrs.device_ordinal, Some(0));
    assert_eq!(attrs.allocation_base, dev.device_ptr());
    assert_eq!(attrs.allocation_size, 3 << 20);
    assert!(attrs.gpu_direct_rdma_capable);

    let pinned = ctx.alloc_pinned(8192).unwrap();
    let attrs = ctx.pointer_attributes(pinned.as_ptr() as u64 + 5).unwrap();
    assert_eq!(attrs.memory_type, MemoryType::PinnedHost);
    assert_eq!(attrs.allocation_base, pinned.as_ptr() as u64);

    let mut heap = vec![0u8; 4096];
    let addr = heap.as_mut_ptr() as u64;
    assert_eq!(
        ctx.pointer_attributes(addr).unwrap().memory_type,
        MemoryType::PageableHost
    );
    // SAFETY: `heap` outlives the registration (dropped first below).
    let reg =
        unsafe { ctx.register_host(heap.as_mut_ptr(), heap.len(), HostRegisterFlags::PORTABLE) }
            .unwrap();
    assert_eq!(
        ctx.pointer_attributes(addr).unwrap().memory_type,
        MemoryType::PinnedHost
    );
    // SAFETY: as above; the overlapping registration must be refused.
    let again = unsafe { ctx.register_host(heap.as_mut_ptr(), 16, HostRegisterFlags::empty()) };
    assert_eq!(again.unwrap_err().code(), Some(712));
    drop(reg);
    assert_eq!(
        ctx.pointer_attributes(addr).unwrap().memory_type,
        MemoryType::PageableHost
    );
}

#[test]
fn out_of_memory_beyond_the_devices_capacity() {
    let (driver, ctx, _) = gpu(GpuConfig {
        total_memory: 4 << 20,
        ..GpuConfig::default()
    });
    let a = ctx.alloc(3 << 20).unwrap();
    assert!(matches!(
        ctx.alloc(2 << 20).unwrap_err(),
        CudaError::OutOfMemory { code: Some(2), .. }
    ));
    drop(a);
    assert_eq!(driver.used_bytes(0), 0);
    ctx.alloc(4 << 20).unwrap();
}

#[test]
fn flush_follows_the_devices_flush_options() {
    let (_d, ctx, _) = gpu(GpuConfig::default());
    ctx.flush_gpu_direct_rdma_writes(FlushScope::Owner).unwrap();
    let (_d, ctx, _) = gpu(GpuConfig {
        flush_writes_options: hal_cuda::FlushWritesOptions::empty(),
        ..GpuConfig::default()
    });
    assert!(
        ctx.flush_gpu_direct_rdma_writes(FlushScope::Owner)
            .unwrap_err()
            .is_unsupported()
    );
}

#[test]
fn each_cuda_fault_kind_fires() {
    let (driver, ctx, plan) = gpu(GpuConfig::default());
    let oom = CudaError::OutOfMemory {
        operation: "cuMemAlloc",
        code: Some(2),
    };
    plan.fail_nth(FaultSite::CudaAlloc, 2, Fault::Cuda(oom.clone()));
    plan.fail_nth(
        FaultSite::CudaCopy,
        1,
        Fault::Cuda(CudaError::from_code("cuMemcpyHtoDAsync", 719)),
    );
    plan.fail_nth(
        FaultSite::CudaExportDmabuf,
        1,
        Fault::Cuda(CudaError::from_code("cuMemGetHandleForAddressRange", 801)),
    );
    plan.fail_nth(
        FaultSite::CudaIpcOpen,
        1,
        Fault::Cuda(CudaError::from_code("cuIpcOpenMemHandle", 1)),
    );

    let mem = ctx.alloc(4096).unwrap();
    assert_eq!(ctx.alloc(4096).unwrap_err(), oom);
    let _third = ctx.alloc(4096).unwrap();

    let stream = ctx.create_stream().unwrap();
    let bytes = pattern(4096, 1);
    // SAFETY: `bytes` outlives the synchronize below.
    let err =
        unsafe { stream.copy_host_to_device(mem.device_ptr(), bytes.as_ptr(), 4096) }.unwrap_err();
    assert!(
        matches!(
            err,
            CudaError::ContextUnusable {
                code: Some(719),
                ..
            }
        ),
        "{err}"
    );
    // SAFETY: as above.
    unsafe { stream.copy_host_to_device(mem.device_ptr(), bytes.as_ptr(), 4096) }.unwrap();
    stream.synchronize().unwrap();

    assert!(
        ctx.export_dmabuf(mem.device_ptr(), 4096)
            .unwrap_err()
            .is_unsupported()
    );
    ctx.export_dmabuf(mem.device_ptr(), 4096).unwrap();

    let handle = ctx.ipc_export(mem.device_ptr()).unwrap();
    let other = driver.other_process().context(0).unwrap();
    assert!(other.ipc_open(&handle).is_err());
    other.ipc_open(&handle).unwrap();
    plan.assert_all_fired();
}

#[test]
fn device_lost_is_sticky() {
    let (driver, ctx, plan) = gpu(GpuConfig::default());
    let mem = ctx.alloc(4096).unwrap();
    plan.fail_next(FaultSite::CudaCopy, Fault::DeviceLost);
    let stream = ctx.create_stream().unwrap();
    // SAFETY: the call fails before queuing.
    let err = unsafe { stream.memset(mem.device_ptr(), 0, 4096) }.unwrap_err();
    assert!(matches!(err, CudaError::DeviceLost { .. }));
    assert!(matches!(
        ctx.alloc(1).unwrap_err(),
        CudaError::DeviceLost { .. }
    ));
    assert!(matches!(
        driver.context(0).unwrap_err(),
        CudaError::DeviceLost { .. }
    ));
    assert!(matches!(
        stream.synchronize().unwrap_err(),
        CudaError::DeviceLost { .. }
    ));
    plan.assert_all_fired();
}

#[test]
fn a_test_can_script_a_cuda_context_with_mockall() {
    use hal_cuda::mock::{MockApi, MockContext};
    let mut ctx = MockContext::<MockApi>::new();
    ctx.expect_export_dmabuf()
        .withf(|addr, len| *addr == 0x1000 && *len == 4096)
        .times(1)
        .returning(|_, _| Err(CudaError::from_code("cuMemGetHandleForAddressRange", 801)));
    let err = ctx.export_dmabuf(0x1000, 4096).unwrap_err();
    assert!(err.is_unsupported());
}

#[test]
fn host_visible_device_memory_has_a_host_address_but_is_still_device_memory() {
    let (_driver, ctx, _) = gpu(GpuConfig {
        host_visible: true,
        ..GpuConfig::default()
    });
    let mem = ctx.alloc(8192).unwrap();
    let addr = mem.device_ptr();
    assert!(addr < gdr_sim::memory::DEVICE_WINDOW_START, "{addr:#x}");
    let attrs = ctx.pointer_attributes(addr + 100).unwrap();
    assert_eq!(attrs.memory_type, MemoryType::Device);
    assert_eq!(attrs.allocation_base, addr);
    write_device(&ctx, addr, &pattern(8192, 4));
    // SAFETY: a host-visible allocation is host memory of this process,
    // alive until `mem` drops.
    let seen = unsafe { std::slice::from_raw_parts(addr as *const u8, 8192) };
    assert_eq!(seen, &pattern(8192, 4)[..]);
}

/// Issue 8: unmapping one physical allocation and mapping another at the
/// same virtual address gives the range a new buffer id (as the real driver
/// does: 907 → 909 on the H200), and the attributes of a mapping are device
/// memory whose base and size are the reservation's (as the H200 reports:
/// a 2 MiB chunk mapped in a 4 MiB reservation reads as the 4 MiB), while
/// dma-buf export sees the mapped chunk only.
#[test]
fn vmm_remap_at_the_same_address_gets_a_new_buffer_id() {
    let (driver, ctx, _) = gpu(GpuConfig::default());
    let g = ctx.vmm_granularity().unwrap();
    assert!(g >= 4096 && g.is_power_of_two(), "{g}");
    let reservation = ctx.reserve_address_range(2 * g).unwrap();
    assert_eq!(reservation.len(), 2 * g);
    let base = reservation.base();

    let a = ctx.create_physical(g).unwrap();
    assert_eq!(a.len(), g);
    assert_eq!(driver.used_bytes(0), g as u64);
    let first = ctx.map(&reservation, 0, &a).unwrap();
    assert_eq!(first.device_ptr(), base);
    assert_eq!(first.len(), g);
    let attrs = ctx.pointer_attributes(base + 4096).unwrap();
    assert_eq!(attrs.memory_type, MemoryType::Device);
    assert_eq!(attrs.device_ordinal, Some(0));
    assert_eq!(attrs.allocation_base, base);
    assert_eq!(attrs.allocation_size, 2 * g as u64);
    assert_eq!(
        attrs.allocation_kind,
        AllocationKind::VirtualMemoryManagement
    );
    assert_ne!(attrs.buffer_id, 0);
    write_device(&ctx, base, &pattern(8192, 7));
    let id_a = attrs.buffer_id;

    // The second chunk of the reservation is unmapped: not device memory.
    assert!(ctx.pointer_attributes(base + g as u64).is_err());

    drop(first);
    assert!(
        ctx.pointer_attributes(base).is_err(),
        "an unmapped VMM address is not device memory"
    );
    let b = ctx.create_physical(g).unwrap();
    let second = ctx.map(&reservation, 0, &b).unwrap();
    assert_eq!(second.device_ptr(), base, "same virtual address");
    let attrs = ctx.pointer_attributes(base).unwrap();
    assert_eq!(attrs.memory_type, MemoryType::Device);
    assert_eq!(
        (attrs.allocation_base, attrs.allocation_size),
        (base, 2 * g as u64)
    );
    assert_ne!(
        attrs.buffer_id, id_a,
        "a new physical allocation, a new buffer id"
    );
    assert_eq!(
        read_device(&ctx, base, 8192),
        vec![0u8; 8192],
        "B's bytes, not A's"
    );

    // A, mapped again beside it, still holds its bytes, under yet another id.
    let again = ctx.map(&reservation, g, &a).unwrap();
    assert_eq!(
        read_device(&ctx, again.device_ptr(), 8192),
        pattern(8192, 7)
    );
    let attrs_again = ctx.pointer_attributes(again.device_ptr()).unwrap();
    assert_ne!(attrs_again.buffer_id, id_a);
    assert_ne!(attrs_again.buffer_id, attrs.buffer_id);
    assert_eq!(attrs_again.allocation_base, base, "the reservation's");

    // dma-buf export works per mapped chunk, not across two.
    ctx.export_dmabuf(base, g).unwrap();
    assert!(ctx.export_dmabuf(base, 2 * g).is_err());
    // Legacy IPC does not work on VMM memory.
    assert!(ctx.ipc_export(base).is_err());
    drop((second, again, a, b, reservation));
    assert_eq!(driver.used_bytes(0), 0);
}

/// A mapping keeps its reservation and its physical memory alive: dropping
/// their handles first leaves it usable, and the memory is given back only
/// when the mapping goes.
#[test]
fn vmm_mapping_outlives_its_handles() {
    let (driver, ctx, _) = gpu(GpuConfig::default());
    let g = ctx.vmm_granularity().unwrap();
    let reservation = ctx.reserve_address_range(g).unwrap();
    let physical = ctx.create_physical(g).unwrap();
    let mapping = ctx.map(&reservation, 0, &physical).unwrap();
    drop(reservation);
    drop(physical);
    write_device(&ctx, mapping.device_ptr(), &pattern(4096, 3));
    assert_eq!(
        read_device(&ctx, mapping.device_ptr(), 4096),
        pattern(4096, 3)
    );
    assert_eq!(driver.used_bytes(0), g as u64);
    drop(mapping);
    assert_eq!(driver.used_bytes(0), 0);
}

#[test]
fn vmm_refuses_bad_sizes_offsets_and_overlaps() {
    let (_driver, ctx, _) = gpu(GpuConfig::default());
    let g = ctx.vmm_granularity().unwrap();
    let invalid = |r: Result<(), CudaError>, what: &str| match r {
        Err(CudaError::InvalidArgument { .. }) => {}
        other => panic!("{what}: want InvalidArgument, got {other:?}"),
    };
    invalid(
        ctx.reserve_address_range(g + 1).map(drop),
        "unaligned reservation",
    );
    invalid(ctx.reserve_address_range(0).map(drop), "empty reservation");
    invalid(
        ctx.create_physical(g / 2).map(drop),
        "unaligned physical size",
    );
    let reservation = ctx.reserve_address_range(2 * g).unwrap();
    let physical = ctx.create_physical(g).unwrap();
    invalid(
        ctx.map(&reservation, 4096, &physical).map(drop),
        "unaligned offset",
    );
    invalid(
        ctx.map(&reservation, 2 * g, &physical).map(drop),
        "past the reservation",
    );
    let _mapped = ctx.map(&reservation, 0, &physical).unwrap();
    invalid(
        ctx.map(&reservation, 0, &physical).map(drop),
        "already mapped there",
    );
}

#[test]
fn vmm_switched_off_is_not_supported() {
    let (driver, ctx, _) = gpu(GpuConfig {
        virtual_memory_management: false,
        ..GpuConfig::default()
    });
    assert!(
        !driver
            .device_attributes(0)
            .unwrap()
            .virtual_memory_management
    );
    assert!(matches!(
        ctx.vmm_granularity(),
        Err(CudaError::NotSupported { .. })
    ));
    assert!(
        ctx.reserve_address_range(2 << 20)
            .unwrap_err()
            .is_unsupported()
    );
    assert!(ctx.create_physical(2 << 20).unwrap_err().is_unsupported());
}

/// The simulation has no current context: the real backend's promise (every
/// call restores the caller's current context, see `gpu_cuda`) needs no
/// counterpart here. What the sim can show: handles made on one thread work
/// from another, with nothing made current anywhere.
#[test]
fn sim_handles_need_no_current_context() {
    let (_driver, ctx, _) = gpu(GpuConfig::default());
    let mem = ctx.alloc(4096).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| write_device(&ctx, mem.device_ptr(), &pattern(4096, 9)));
    });
    assert_eq!(read_device(&ctx, mem.device_ptr(), 4096), pattern(4096, 9));
}

#[test]
fn vmm_handles_are_mockable() {
    use hal_cuda::mock::{MockApi, MockContext};
    let mut ctx = MockContext::<MockApi>::new();
    ctx.expect_vmm_granularity().returning(|| Ok(2 << 20));
    ctx.expect_reserve_address_range()
        .returning(|_| Err(CudaError::unsupported("cuMemAddressReserve", "mocked")));
    assert_eq!(ctx.vmm_granularity().unwrap(), 2 << 20);
    assert!(
        ctx.reserve_address_range(2 << 20)
            .unwrap_err()
            .is_unsupported()
    );
}

/// `gpu_cache`'s stale-address test on the simulated GPU: the registration
/// cache sees a remapped VMM address as stale, deterministically.
#[test]
fn cache_detects_a_remapped_vmm_address_as_stale() {
    use gdr_core::cache::{CacheConfig, Registrar, RegistrationCache, Request};
    use std::sync::atomic::{AtomicU64, Ordering};

    #[derive(Default)]
    struct Numbering(AtomicU64);
    impl Registrar for Numbering {
        type Registration = u64;
        type Error = std::io::Error;
        fn register(&self, _request: &Request) -> Result<u64, std::io::Error> {
            Ok(self.0.fetch_add(1, Ordering::SeqCst) + 1)
        }
    }

    let (_driver, ctx, _) = gpu(GpuConfig::default());
    let g = ctx.vmm_granularity().unwrap();
    let cache = RegistrationCache::new(CacheConfig::default());
    let registrar = Numbering::default();
    let reservation = ctx.reserve_address_range(g).unwrap();
    let addr = reservation.base();
    let a = ctx.create_physical(g).unwrap();
    let first = ctx.map(&reservation, 0, &a).unwrap();
    let attrs = ctx.pointer_attributes(addr).unwrap();
    let request = Request::from_attributes(1, &attrs, addr, g as u64).unwrap();
    let old = *cache
        .get_or_register(&registrar, &request)
        .unwrap()
        .registration();
    drop(first);
    let b = ctx.create_physical(g).unwrap();
    let _second = ctx.map(&reservation, 0, &b).unwrap();
    let attrs = ctx.pointer_attributes(addr).unwrap();
    let request = Request::from_attributes(1, &attrs, addr, g as u64).unwrap();
    let fresh = *cache
        .get_or_register(&registrar, &request)
        .unwrap()
        .registration();
    assert_ne!(fresh, old);
    assert_eq!(cache.stats().stale_detections, 1, "{:?}", cache.stats());
}
