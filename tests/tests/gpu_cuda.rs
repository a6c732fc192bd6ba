//! The real CUDA backend on a real GPU. Every test that needs one first loads
//! the driver and counts devices; without libcuda or a GPU it prints
//! `SKIPPED <name>: <reason>` and passes, so CI without a GPU says so. With
//! `GDR_EXPECT_GPU=1` (the GPU machine's run) such a test fails instead, and
//! so does one that finds a libcuda stub on the library path.
//!
//! The IPC test runs this same binary a second time as a child process
//! (`GDR_IPC_CHILD_HANDLE` set), which opens the parent's allocation.
//!
//! On a GPU machine without cargo: build here with
//! `cargo test -p gdr-tests --test gpu_cuda --no-run --release`, copy the
//! executable it names over, and run it there (`--test-threads=1
//! --nocapture` shows what each test saw), with `GDR_EXPECT_GPU=1`. All 19
//! passed on the project's H200 (driver 580.159.04, CUDA 13), in parallel.

use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::process::Command;

use gdr_tests::{EXPECT_GPU_ENV, expect_gpu, init_tracing, pattern, skip_gpu};
use hal_cuda::cuda::{CudaContext, CudaDriver, CudaPinnedHostMemory, CudaStream};
use hal_cuda::{
    AllocationKind, Context, CudaError, DeviceMemory, Driver, Event, FlushScope,
    FlushWritesOptions, HostRegisterFlags, HostRegistration, IpcMapping, IpcMemHandle, MemoryType,
    PhysicalMemory, PinnedHostMemory, Stream, VirtualMapping, VirtualReservation,
};

const MIB: usize = 1 << 20;
const IPC_HANDLE_ENV: &str = "GDR_IPC_CHILD_HANDLE";
const IPC_LEN_ENV: &str = "GDR_IPC_CHILD_LEN";
const IPC_CHILD_OK: &str = "GDR_IPC_CHILD_VERIFIED";

/// The driver and device 0's context, or `None` after printing why the test
/// is skipped (a failure under `GDR_EXPECT_GPU=1`).
fn gpu(test: &str) -> Option<(CudaDriver, CudaContext)> {
    gdr_tests::cuda_gpu(test)
}

fn page_size() -> usize {
    // SAFETY: sysconf reads a process constant.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// Whether libcuda.so.1 can be dlopened here (the dynamic loader's answer,
/// independent of cudarc).
fn libcuda_loadable() -> bool {
    let name = CString::new("libcuda.so.1").unwrap();
    // SAFETY: dlopen with a valid C string; the handle is closed at once.
    unsafe {
        let handle = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if handle.is_null() {
            false
        } else {
            libc::dlclose(handle);
            true
        }
    }
}

fn pinned_with(ctx: &CudaContext, data: &[u8]) -> CudaPinnedHostMemory {
    let host = ctx.alloc_pinned(data.len()).expect("alloc_pinned");
    // SAFETY: `host` holds data.len() writable bytes only we use.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), host.as_ptr(), data.len()) };
    host
}

fn pinned_bytes(host: &CudaPinnedHostMemory) -> &[u8] {
    // SAFETY: the allocation holds len() bytes; callers read it after the
    // copies into it completed.
    unsafe { std::slice::from_raw_parts(host.as_ptr(), host.len()) }
}

/// Device bytes `addr..addr+len`, copied to the host through a stream.
fn read_device(ctx: &CudaContext, stream: &CudaStream, addr: u64, len: usize) -> Vec<u8> {
    let host = ctx.alloc_pinned(len).expect("alloc_pinned");
    // SAFETY: `host` and the device range hold `len` bytes and outlive the
    // synchronize below.
    unsafe { stream.copy_device_to_host(host.as_ptr(), addr, len) }.expect("D2H");
    stream.synchronize().expect("synchronize");
    pinned_bytes(&host).to_vec()
}

fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i}: got {:#04x}, want {:#04x}",
            got[i], want[i]
        );
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Whether `fd` is a dma-buf: its fdinfo names an exporter, or its link
/// names the dmabuf inode.
fn is_dmabuf(fd: i32) -> (bool, String) {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap_or_default();
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let exporter = info
        .lines()
        .find(|l| l.starts_with("exp_name:"))
        .map(str::to_owned);
    let ok = exporter.is_some() || link.contains("dmabuf");
    (ok, format!("link {link:?}, {exporter:?}"))
}

#[test]
fn load_without_libcuda_is_an_error_not_a_panic() {
    init_tracing();
    let loadable = libcuda_loadable();
    let result = std::panic::catch_unwind(CudaDriver::load).expect("CudaDriver::load panicked");
    if expect_gpu() {
        let driver =
            result.unwrap_or_else(|e| panic!("{EXPECT_GPU_ENV}=1 but the load failed: {e}"));
        let count = driver.device_count();
        assert!(
            matches!(count, Ok(n) if n > 0),
            "{EXPECT_GPU_ENV}=1 but device_count = {count:?}"
        );
        return;
    }
    if loadable {
        match result {
            Ok(driver) => {
                let count = driver.device_count();
                eprintln!("libcuda present: loaded, device_count = {count:?}");
            }
            // A driver without a GPU is still a loaded library.
            Err(e @ CudaError::NoDevice { .. }) => eprintln!("libcuda present, no device: {e}"),
            Err(e) => panic!("libcuda.so.1 opens but CudaDriver::load failed: {e}"),
        }
    } else {
        match result {
            Err(CudaError::LibraryUnavailable { library, reason }) => {
                eprintln!("no libcuda here, as expected: {library}: {reason}");
            }
            other => panic!("no libcuda.so.1 here, yet load gave {other:?}"),
        }
    }
}

#[test]
fn device_attributes_are_sane() {
    let Some((driver, ctx)) = gpu("device_attributes_are_sane") else {
        return;
    };
    assert_eq!(driver.backend_name(), "cuda");
    let attrs = driver.device_attributes(0).expect("device_attributes");
    eprintln!("{attrs:#?}");
    assert!(!attrs.name.is_empty());
    assert_eq!(attrs.pci_bus_id.len(), 12, "{}", attrs.pci_bus_id);
    assert_eq!(attrs.pci_bus_id, attrs.pci_bus_id.to_ascii_lowercase());
    assert!(attrs.total_memory > 1 << 30);
    assert!(attrs.compute_capability >= (3, 5));
    assert_eq!(ctx.ordinal(), 0);
    let count = driver.device_count().unwrap();
    assert!(matches!(
        driver.device_attributes(count),
        Err(CudaError::NoDevice { .. })
    ));
    assert!(matches!(
        driver.context(count),
        Err(CudaError::NoDevice { .. })
    ));
}

#[test]
fn dmabuf_export_of_whole_allocation_and_subrange() {
    let name = "dmabuf_export_of_whole_allocation_and_subrange";
    let Some((driver, ctx)) = gpu(name) else {
        return;
    };
    if !driver.device_attributes(0).unwrap().dma_buf_supported {
        skip_gpu(name, "the device reports DMA_BUF_SUPPORTED = 0");
        return;
    }
    let len = 8 * MIB;
    let mem = ctx.alloc(len).expect("alloc");
    let whole = ctx
        .export_dmabuf(mem.device_ptr(), len)
        .expect("export of the whole allocation");
    let (ok, why) = is_dmabuf(whole.as_raw_fd());
    assert!(ok, "whole-allocation fd is no dma-buf: {why}");
    eprintln!("whole allocation: fd {} ({why})", whole.as_raw_fd());

    let page = page_size();
    let sub = ctx
        .export_dmabuf(mem.device_ptr() + 16 * page as u64, MIB)
        .expect("export of a sub-range at a page-aligned offset");
    let (ok, why) = is_dmabuf(sub.as_raw_fd());
    assert!(ok, "sub-range fd is no dma-buf: {why}");
    assert_ne!(whole.as_raw_fd(), sub.as_raw_fd());

    // The fds are closed before the memory is freed, and after: both fine.
    drop(whole);
    drop(mem);
    drop(sub);
}

#[test]
fn dmabuf_export_refuses_bad_ranges() {
    let Some((_driver, ctx)) = gpu("dmabuf_export_refuses_bad_ranges") else {
        return;
    };
    let page = page_size();
    let len = 4 * MIB;
    let mem = ctx.alloc(len).expect("alloc");
    let base = mem.device_ptr();
    let invalid = |r: Result<std::os::fd::OwnedFd, CudaError>, what: &str| match r {
        Err(CudaError::InvalidArgument { .. }) => {}
        other => panic!("{what}: want InvalidArgument, got {other:?}"),
    };
    invalid(ctx.export_dmabuf(base + 1, page), "unaligned address");
    invalid(ctx.export_dmabuf(base, page + 1), "unaligned length");
    invalid(ctx.export_dmabuf(base, 0), "empty range");
    invalid(
        ctx.export_dmabuf(base + page as u64, len),
        "range past the allocation's end",
    );
    let host = ctx.alloc_pinned(len).unwrap();
    invalid(
        ctx.export_dmabuf(host.as_ptr() as u64, page),
        "pinned host memory",
    );
}

#[test]
fn pointer_attributes_tell_memory_kinds_apart() {
    let Some((_driver, ctx)) = gpu("pointer_attributes_tell_memory_kinds_apart") else {
        return;
    };
    let len = 4 * MIB;
    let dev = ctx.alloc(len).expect("alloc");
    let interior = dev.device_ptr() + 12345;
    let a = ctx.pointer_attributes(interior).expect("device attributes");
    eprintln!("device: {a:?}");
    assert_eq!(a.memory_type, MemoryType::Device);
    assert_eq!(a.device_ordinal, Some(0));
    assert_eq!(a.allocation_base, dev.device_ptr());
    assert_eq!(a.allocation_size, len as u64);
    assert_ne!(a.buffer_id, 0);
    assert_eq!(a.allocation_kind, AllocationKind::Legacy);
    assert_eq!(
        ctx.address_range(interior).unwrap(),
        (dev.device_ptr(), len as u64)
    );

    let pinned = ctx.alloc_pinned(len).expect("alloc_pinned");
    let p = ctx
        .pointer_attributes(pinned.as_ptr() as u64 + 100)
        .expect("pinned attributes");
    eprintln!("pinned: {p:?}");
    assert_eq!(p.memory_type, MemoryType::PinnedHost);
    assert_eq!(p.device_ordinal, None);
    assert_ne!(p.buffer_id, a.buffer_id);
    if p.allocation_size != 0 {
        assert!(p.allocation_base <= pinned.as_ptr() as u64 + 100);
        assert!(p.allocation_base + p.allocation_size >= pinned.as_ptr() as u64 + 100);
    }

    let pageable = vec![7u8; 4096];
    let h = ctx
        .pointer_attributes(pageable.as_ptr() as u64)
        .expect("pageable attributes");
    eprintln!("pageable: {h:?}");
    assert_eq!(h.memory_type, MemoryType::PageableHost);
    assert_eq!(h.buffer_id, 0);
    assert_eq!(h.device_ordinal, None);
}

#[test]
fn reallocation_gets_a_new_buffer_id() {
    let Some((_driver, ctx)) = gpu("reallocation_gets_a_new_buffer_id") else {
        return;
    };
    let len = 2 * MIB;
    let first = ctx.alloc(len).expect("alloc");
    let (addr1, id1) = (
        first.device_ptr(),
        ctx.pointer_attributes(first.device_ptr())
            .unwrap()
            .buffer_id,
    );
    drop(first);
    let second = ctx.alloc(len).expect("alloc");
    let (addr2, id2) = (
        second.device_ptr(),
        ctx.pointer_attributes(second.device_ptr())
            .unwrap()
            .buffer_id,
    );
    eprintln!(
        "first {addr1:#x} id {id1}, second {addr2:#x} id {id2} (same address: {})",
        addr1 == addr2
    );
    assert_ne!(id1, 0);
    assert_ne!(id2, 0);
    assert_ne!(id1, id2, "a re-allocation must get a new buffer id");
}

#[test]
fn ipc_handle_opens_in_a_second_process() {
    let name = "ipc_handle_opens_in_a_second_process";
    if let Ok(handle_hex) = std::env::var(IPC_HANDLE_ENV) {
        ipc_child(&handle_hex);
        return;
    }
    let Some((_driver, ctx)) = gpu(name) else {
        return;
    };
    let len = 3 * MIB + 333;
    let want = pattern(len, 0x3c);
    let mem = ctx.alloc(len).expect("alloc");
    let stream = ctx.create_stream().unwrap();
    let host = pinned_with(&ctx, &want);
    // SAFETY: both ranges hold `len` bytes and outlive the synchronize.
    unsafe { stream.copy_host_to_device(mem.device_ptr(), host.as_ptr(), len) }.unwrap();
    stream.synchronize().unwrap();

    // Export an interior address: the handle names the whole allocation.
    let handle = ctx.ipc_export(mem.device_ptr() + 4096).expect("ipc_export");
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(IPC_HANDLE_ENV, hex(&handle.0))
        .env(IPC_LEN_ENV, len.to_string())
        .output()
        .expect("spawning the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("child stdout:\n{stdout}\nchild stderr:\n{stderr}");
    assert!(out.status.success(), "child failed: {:?}", out.status);
    assert!(
        stdout.contains(IPC_CHILD_OK) || stderr.contains(IPC_CHILD_OK),
        "the child did not run the check"
    );
    drop(mem);
}

/// The child half: open the parent's handle, read it back, check the pattern.
fn ipc_child(handle_hex: &str) {
    init_tracing();
    let len: usize = std::env::var(IPC_LEN_ENV).unwrap().parse().unwrap();
    let bytes: [u8; 64] = unhex(handle_hex).try_into().expect("64-byte handle");
    let driver = CudaDriver::load().expect("child: load");
    let ctx = driver.context(0).expect("child: context");
    let mapping = ctx.ipc_open(&IpcMemHandle(bytes)).expect("child: ipc_open");
    assert!(mapping.len() >= len, "mapping {} < {len}", mapping.len());
    let a = ctx.pointer_attributes(mapping.device_ptr()).unwrap();
    eprintln!(
        "child: mapped {} bytes at {:#x}: {a:?}",
        mapping.len(),
        mapping.device_ptr()
    );
    assert_eq!(a.memory_type, MemoryType::Device);
    let stream = ctx.create_stream().unwrap();
    let got = read_device(&ctx, &stream, mapping.device_ptr(), len);
    assert_same(
        "child's view of the parent's memory",
        &got,
        &pattern(len, 0x3c),
    );
    drop(mapping);
    println!("{IPC_CHILD_OK}");
}

#[test]
fn ipc_open_of_a_garbage_handle_is_an_error() {
    let Some((_driver, ctx)) = gpu("ipc_open_of_a_garbage_handle_is_an_error") else {
        return;
    };
    let garbage = IpcMemHandle(std::array::from_fn(|i| (i as u8).wrapping_mul(37) ^ 0x5a));
    match ctx.ipc_open(&garbage) {
        Ok(m) => panic!("a garbage handle opened: {m:?}"),
        Err(e) => eprintln!("garbage handle refused: {e}"),
    }
    // The context still works afterwards.
    let mem = ctx.alloc(4096).expect("alloc after the failed open");
    assert!(ctx.ipc_export(mem.device_ptr()).is_ok());
}

#[test]
fn async_copies_round_trip_byte_for_byte() {
    let Some((_driver, ctx)) = gpu("async_copies_round_trip_byte_for_byte") else {
        return;
    };
    let s1 = ctx.create_stream().unwrap();
    let s2 = ctx.create_stream().unwrap();
    let h2d_done = ctx.create_event().unwrap();
    let all_done = ctx.create_event().unwrap();
    for (i, len) in [1usize, 3, 4095, 4097, 65536 + 7, MIB, 16 * MIB + 3]
        .into_iter()
        .enumerate()
    {
        let want = pattern(len, i as u8 + 1);
        let src = pinned_with(&ctx, &want);
        let dst = pinned_with(&ctx, &vec![0u8; len]);
        let a = ctx.alloc(len).unwrap();
        let b = ctx.alloc(len).unwrap();
        // SAFETY: every range holds `len` bytes and outlives the event
        // synchronize below.
        unsafe {
            s1.copy_host_to_device(a.device_ptr(), src.as_ptr(), len)
                .unwrap();
            s1.record(&h2d_done).unwrap();
            s2.wait(&h2d_done).unwrap();
            s2.copy_device_to_device(b.device_ptr(), a.device_ptr(), len)
                .unwrap();
            s2.copy_device_to_host(dst.as_ptr(), b.device_ptr(), len)
                .unwrap();
        }
        s2.record(&all_done).unwrap();
        all_done.synchronize().unwrap();
        assert!(all_done.is_complete().unwrap());
        assert_same(
            &format!("H2D/D2D/D2H of {len} bytes"),
            pinned_bytes(&dst),
            &want,
        );
    }

    // Pageable host memory too (the driver stages it).
    let len = 5 * MIB + 1;
    let want = pattern(len, 99);
    let mut back = vec![0u8; len];
    let d = ctx.alloc(len).unwrap();
    // SAFETY: `want`, `back` and `d` hold `len` bytes and outlive the
    // synchronize.
    unsafe {
        s1.copy_host_to_device(d.device_ptr(), want.as_ptr(), len)
            .unwrap();
        s1.copy_device_to_host(back.as_mut_ptr(), d.device_ptr(), len)
            .unwrap();
    }
    s1.synchronize().unwrap();
    assert_same("pageable round trip", &back, &want);
}

#[test]
fn event_reports_pending_work() {
    let Some((_driver, ctx)) = gpu("event_reports_pending_work") else {
        return;
    };
    let stream = ctx.create_stream().unwrap();
    let event = ctx.create_event().unwrap();
    // A fresh event counts as complete.
    assert!(event.is_complete().unwrap());
    let len = 256 * MIB;
    let a = ctx.alloc(len).unwrap();
    // SAFETY: `a` holds `len` bytes and outlives the synchronize.
    unsafe { stream.memset(a.device_ptr(), 1, len) }.unwrap();
    stream.record(&event).unwrap();
    let early = event.is_complete().unwrap();
    event.synchronize().unwrap();
    assert!(event.is_complete().unwrap());
    eprintln!("complete right after queuing 256 MiB of memset: {early}");
}

#[test]
fn memset_sets_exactly_the_range() {
    let Some((_driver, ctx)) = gpu("memset_sets_exactly_the_range") else {
        return;
    };
    let stream = ctx.create_stream().unwrap();
    let len = 3 * MIB + 5;
    let mem = ctx.alloc(len).unwrap();
    // SAFETY: every range lies inside `mem`, which outlives the synchronize.
    unsafe {
        stream.memset(mem.device_ptr(), 0xa5, len).unwrap();
        stream.memset(mem.device_ptr() + 7, 0x00, 1000).unwrap();
    }
    let got = read_device(&ctx, &stream, mem.device_ptr(), len);
    let mut want = vec![0xa5u8; len];
    want[7..1007].fill(0);
    assert_same("memset", &got, &want);
}

#[test]
fn host_registration_pins_existing_memory() {
    let Some((_driver, ctx)) = gpu("host_registration_pins_existing_memory") else {
        return;
    };
    let len = 8 * MIB;
    let mut buf = pattern(len, 5);
    let before = ctx.pointer_attributes(buf.as_ptr() as u64).unwrap();
    assert_eq!(before.memory_type, MemoryType::PageableHost);
    let t = std::time::Instant::now();
    // SAFETY: `buf` is mapped host memory that outlives `reg` (dropped below).
    let reg = unsafe { ctx.register_host(buf.as_mut_ptr(), len, HostRegisterFlags::PORTABLE) }
        .expect("cuMemHostRegister");
    eprintln!("registering {len} bytes took {:?}", t.elapsed());
    assert_eq!(reg.len(), len);
    let during = ctx.pointer_attributes(buf.as_ptr() as u64 + 4096).unwrap();
    eprintln!("registered: {during:?}");
    assert_eq!(during.memory_type, MemoryType::PinnedHost);

    // Copies from and to the registered range work.
    let stream = ctx.create_stream().unwrap();
    let d = ctx.alloc(len).unwrap();
    // SAFETY: `buf` and `d` hold `len` bytes and outlive the synchronize.
    unsafe { stream.copy_host_to_device(d.device_ptr(), buf.as_ptr(), len) }.unwrap();
    let got = read_device(&ctx, &stream, d.device_ptr(), len);
    assert_same("copy from registered memory", &got, &buf);

    drop(reg);
    let after = ctx.pointer_attributes(buf.as_ptr() as u64).unwrap();
    assert_eq!(after.memory_type, MemoryType::PageableHost);

    // Registering the same range twice is an error, not a panic.
    // SAFETY: as above.
    let first =
        unsafe { ctx.register_host(buf.as_mut_ptr(), len, HostRegisterFlags::empty()) }.unwrap();
    // SAFETY: as above.
    let again = unsafe { ctx.register_host(buf.as_mut_ptr(), len, HostRegisterFlags::empty()) };
    assert!(again.is_err(), "double registration: {again:?}");
    drop(first);
}

#[test]
fn flush_succeeds_where_supported() {
    let Some((driver, ctx)) = gpu("flush_succeeds_where_supported") else {
        return;
    };
    let attrs = driver.device_attributes(0).unwrap();
    eprintln!(
        "flush options {:?}, ordering {:?}, visibility {:?}, needs flush before kernels: {:?}",
        attrs.flush_writes_options,
        attrs.writes_ordering,
        attrs.writes_visibility(),
        attrs.needs_flush_before_kernels()
    );
    let owner = ctx.flush_gpu_direct_rdma_writes(FlushScope::Owner);
    if attrs
        .flush_writes_options
        .contains(FlushWritesOptions::HOST)
    {
        owner.expect("flush to owner");
        // Scopes wider than the device's ordering may be refused; never a panic.
        let all = ctx.flush_gpu_direct_rdma_writes(FlushScope::AllDevices);
        eprintln!("flush to all devices: {all:?}");
    } else {
        eprintln!("flush not advertised; it answered {owner:?}");
    }
    ctx.synchronize().unwrap();
}

#[test]
fn zero_length_allocations_are_refused() {
    let Some((_driver, ctx)) = gpu("zero_length_allocations_are_refused") else {
        return;
    };
    assert!(matches!(
        ctx.alloc(0),
        Err(CudaError::InvalidArgument { .. })
    ));
    assert!(matches!(
        ctx.alloc_pinned(0),
        Err(CudaError::InvalidArgument { .. })
    ));
    // An absurd size is out of memory, not a panic.
    let huge = ctx.alloc(1 << 50);
    assert!(huge.is_err(), "{huge:?}");
    eprintln!("1 PiB allocation: {:?}", huge.unwrap_err());
}

#[test]
fn handles_outlive_the_context_handle() {
    let Some((_driver, ctx)) = gpu("handles_outlive_the_context_handle") else {
        return;
    };
    let mem = ctx.alloc(MIB).unwrap();
    let stream = ctx.create_stream().unwrap();
    drop(ctx);
    // The primary context is kept alive by the memory and the stream.
    // SAFETY: `mem` holds MIB bytes and outlives the synchronize.
    unsafe { stream.memset(mem.device_ptr(), 3, MIB) }.unwrap();
    stream.synchronize().unwrap();
}

type RawGetCurrent = unsafe extern "C" fn(*mut *mut std::ffi::c_void) -> u32;
type RawSetCurrent = unsafe extern "C" fn(*mut std::ffi::c_void) -> u32;
type RawCtxCreateV2 =
    unsafe extern "C" fn(*mut *mut std::ffi::c_void, std::ffi::c_uint, std::ffi::c_int) -> u32;
type RawCtxCreateV4 = unsafe extern "C" fn(
    *mut *mut std::ffi::c_void,
    *mut std::ffi::c_void,
    std::ffi::c_uint,
    std::ffi::c_int,
) -> u32;
type RawCtxDestroy = unsafe extern "C" fn(*mut std::ffi::c_void) -> u32;

/// A libcuda symbol looked up by the test itself (not through hal-cuda),
/// as the function type `T` the caller names.
///
/// # Safety
/// `T` must be the C signature of `name` in cuda.h.
unsafe fn libcuda_symbol<T: Copy>(name: &str) -> Option<T> {
    assert_eq!(
        std::mem::size_of::<T>(),
        std::mem::size_of::<*mut libc::c_void>()
    );
    let lib = CString::new("libcuda.so.1").unwrap();
    let sym = CString::new(name).unwrap();
    // SAFETY: dlopen of a library hal-cuda loaded already (a reference count
    // only; never closed), dlsym with valid C strings.
    let ptr = unsafe {
        let handle = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if handle.is_null() {
            return None;
        }
        libc::dlsym(handle, sym.as_ptr())
    };
    // SAFETY: the caller vouches that `T` is the symbol's function type.
    (!ptr.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut libc::c_void, T>(&ptr) })
}

/// Every kind of hal-cuda call that makes a context current, and the drops
/// of what they made; `check` runs after the calls and after the drops.
fn exercise(ctx: &CudaContext, check: &dyn Fn(&str)) {
    let mem = ctx.alloc(MIB).unwrap();
    let host = pinned_with(ctx, &pattern(MIB, 1));
    let stream = ctx.create_stream().unwrap();
    let event = ctx.create_event().unwrap();
    // SAFETY: both ranges hold MIB bytes and outlive the synchronize.
    unsafe { stream.copy_host_to_device(mem.device_ptr(), host.as_ptr(), MIB) }.unwrap();
    // SAFETY: as above.
    unsafe { stream.memset(mem.device_ptr(), 7, 4096) }.unwrap();
    stream.record(&event).unwrap();
    event.synchronize().unwrap();
    assert!(event.is_complete().unwrap());
    stream.synchronize().unwrap();
    let attrs = ctx.pointer_attributes(mem.device_ptr()).unwrap();
    assert_eq!(attrs.memory_type, MemoryType::Device);
    ctx.address_range(mem.device_ptr()).unwrap();
    let dmabuf = ctx.export_dmabuf(mem.device_ptr(), MIB);
    let _ = ctx.ipc_export(mem.device_ptr()).unwrap();
    let mut plain = vec![0u8; 64 << 10];
    // SAFETY: `plain` outlives the registration, dropped below.
    let reg =
        unsafe { ctx.register_host(plain.as_mut_ptr(), plain.len(), HostRegisterFlags::empty()) }
            .unwrap();
    let _ = ctx.flush_gpu_direct_rdma_writes(FlushScope::Owner);
    ctx.synchronize().unwrap();
    let vmm = ctx.vmm_granularity().ok().map(|g| {
        let reservation = ctx.reserve_address_range(g).unwrap();
        let physical = ctx.create_physical(g).unwrap();
        let mapping = ctx.map(&reservation, 0, &physical).unwrap();
        (reservation, physical, mapping)
    });
    check("after the calls");
    drop((vmm, reg, dmabuf, event, stream, host, mem));
    check("after the drops");
}

/// Issue 8: hal-cuda must leave the calling thread's current context as the
/// caller had it (none, another context, or the primary context itself),
/// `Drop` included, so an inference runtime's current device never changes.
#[test]
fn calls_leave_the_callers_current_context_alone() {
    let name = "calls_leave_the_callers_current_context_alone";
    let Some((_driver, ctx)) = gpu(name) else {
        return;
    };
    let current = || hal_cuda::cuda::current_context().unwrap();
    // SAFETY: cuCtxSetCurrent(CUcontext).
    let set: RawSetCurrent = unsafe { libcuda_symbol("cuCtxSetCurrent") }.expect("cuCtxSetCurrent");
    // SAFETY: cuCtxGetCurrent(CUcontext*), checked against hal-cuda's view.
    let get: RawGetCurrent = unsafe { libcuda_symbol("cuCtxGetCurrent") }.expect("cuCtxGetCurrent");
    let raw_current = || {
        let mut c = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { get(&mut c) }, 0);
        c
    };

    // No context current.
    // SAFETY: a null context is allowed: it unbinds the thread.
    assert_eq!(unsafe { set(std::ptr::null_mut()) }, 0);
    exercise(&ctx, &|when| {
        assert!(
            current().is_null(),
            "none was current; {when} {:?} is",
            current()
        );
        assert!(raw_current().is_null());
    });

    // The primary context itself current: stays.
    // SAFETY: `ctx.raw()` is a retained primary context.
    assert_eq!(unsafe { set(ctx.raw()) }, 0);
    exercise(&ctx, &|when| assert_eq!(current(), ctx.raw(), "{when}"));

    // Another context of the same device current (what an application
    // with its own context has): stays.
    // SAFETY: cuda.h's signatures of cuCtxCreate_v2/_v4 and cuCtxDestroy_v2.
    let (v2, v4, destroy) = unsafe {
        (
            libcuda_symbol::<RawCtxCreateV2>("cuCtxCreate_v2"),
            libcuda_symbol::<RawCtxCreateV4>("cuCtxCreate_v4"),
            libcuda_symbol::<RawCtxDestroy>("cuCtxDestroy_v2"),
        )
    };
    let mut other = std::ptr::null_mut();
    // SAFETY: valid out-pointer, flags 0, device 0; v4 takes null params.
    let created = unsafe {
        match (v2, v4) {
            (Some(create), _) => create(&mut other, 0, 0),
            (None, Some(create)) => create(&mut other, std::ptr::null_mut(), 0, 0),
            (None, None) => u32::MAX,
        }
    };
    match (created, destroy) {
        (0, Some(destroy)) => {
            assert_eq!(
                current(),
                other,
                "cuCtxCreate makes the new context current"
            );
            assert_ne!(other, ctx.raw());
            exercise(&ctx, &|when| assert_eq!(current(), other, "{when}"));
            // SAFETY: `other` was created above and nothing of ours lives in it.
            assert_eq!(unsafe { destroy(other) }, 0);
        }
        (code, _) => eprintln!("no second context could be created (code {code}); case skipped"),
    }
    // SAFETY: unbinds the thread again.
    assert_eq!(unsafe { set(std::ptr::null_mut()) }, 0);

    // A thread that never had a context.
    std::thread::scope(|s| {
        s.spawn(|| exercise(&ctx, &|when| assert!(current().is_null(), "{when}")));
    });
    println!("{CONTEXTS_LEFT_ALONE}");
}

const CONTEXTS_LEFT_ALONE: &str = "GDR_CONTEXTS_LEFT_ALONE";

/// A fake libcuda (C, built here when a compiler is found) that keeps a
/// per-thread context stack as the driver does and aborts the process when a
/// call that needs a context finds none current.
const FAKE_LIBCUDA: &str = r#"
#include <stdlib.h>
#include <string.h>
typedef void *ctx_t;
static __thread ctx_t stack[64];
static __thread int depth;
static char primary, others[16];
static int made;
static unsigned long long next_dev = 0x200000000000ull;
#define NEED if (!depth || !stack[depth - 1]) abort()
#define DEV(p) ((p) >= 0x200000000000ull && (p) < 0x300000000000ull)
int cuInit(unsigned f) { return 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int cuDeviceGet(int *d, int o) { *d = o; return 0; }
int cuDeviceGetName(char *b, int l, int d) { strncpy(b, "fake", l); return 0; }
int cuDeviceGetPCIBusId(char *b, int l, int d) { strncpy(b, "0000:01:00.0", l); return 0; }
int cuDeviceTotalMem_v2(size_t *t, int d) { *t = 1ull << 34; return 0; }
int cuDeviceGetAttribute(int *v, int a, int d) { *v = a == 75 ? 9 : a == 118 ? 100 : 1; return 0; }
int cuDevicePrimaryCtxRetain(ctx_t *c, int d) { *c = &primary; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { return 0; }
int cuCtxGetCurrent(ctx_t *c) { *c = depth ? stack[depth - 1] : 0; return 0; }
int cuCtxSetCurrent(ctx_t c) {
    if (!c) { if (depth) depth--; } else if (depth) stack[depth - 1] = c; else stack[depth++] = c;
    return 0;
}
int cuCtxPushCurrent_v2(ctx_t c) { stack[depth++] = c; return 0; }
int cuCtxPopCurrent_v2(ctx_t *c) { if (!depth) return 201; *c = stack[--depth]; return 0; }
int cuCtxCreate_v2(ctx_t *c, unsigned f, int d) { *c = &others[made++ % 16]; stack[depth++] = *c; return 0; }
int cuCtxDestroy_v2(ctx_t c) { if (depth && stack[depth - 1] == c) depth--; return 0; }
int cuMemAlloc_v2(unsigned long long *p, size_t n) { NEED; *p = next_dev; next_dev += 2ull << 20; return 0; }
int cuMemHostAlloc(void **p, size_t n, unsigned f) { NEED; *p = malloc(n); return 0; }
int cuMemFreeHost(void *p) { NEED; free(p); return 0; }
int cuMemGetAddressRange_v2(unsigned long long *b, size_t *s, unsigned long long p) {
    NEED; *b = p & ~0x1fffffull; *s = 2ull << 20; return 0;
}
int cuPointerGetAttributes(unsigned n, int *a, void **d, unsigned long long p) {
    NEED;
    for (unsigned i = 0; i < n; i++) {
        if (a[i] == 2) *(unsigned *)d[i] = DEV(p) ? 2 : 0;
        if (a[i] == 7 && DEV(p)) *(unsigned long long *)d[i] = p >> 21;
        if (a[i] == 10 && DEV(p)) *(unsigned char *)d[i] = 1;
        if (a[i] == 11 && DEV(p)) *(unsigned long long *)d[i] = p & ~0x1fffffull;
        if (a[i] == 12 && DEV(p)) *(size_t *)d[i] = 2ull << 20;
    }
    return 0;
}
int cuMemGetAllocationGranularity(size_t *g, const void *p, int o) { NEED; *g = 2ull << 20; return 0; }
int cuMemAddressReserve(unsigned long long *p, size_t n, size_t a, unsigned long long at, unsigned long long f) {
    NEED; *p = next_dev; next_dev += n; return 0;
}
int cuMemCreate(unsigned long long *h, size_t n, const void *p, unsigned long long f) { NEED; *h = 1; return 0; }
"#;

/// The context discipline checked without a GPU: the context test runs as a
/// child against [`FAKE_LIBCUDA`], which aborts on any call made with no
/// context current and tracks the stack, so a call that is not wrapped in a
/// push/pop, or a pop that is missing, fails it.
#[test]
fn current_context_discipline_on_a_fake_driver() {
    init_tracing();
    if std::env::var_os("GDR_FAKE_LIBCUDA_CHILD").is_some() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("gdr-fake-libcuda-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut source = FAKE_LIBCUDA.to_owned();
    let defined: Vec<String> = source
        .lines()
        .filter_map(|l| l.strip_prefix("int ")?.split('(').next().map(str::to_owned))
        .collect();
    let vmm = [
        "cuMemAddressFree",
        "cuMemRelease",
        "cuMemMap",
        "cuMemUnmap",
        "cuMemSetAccess",
    ];
    for name in hal_cuda::cuda::REQUIRED_SYMBOLS.iter().chain(&vmm) {
        if !defined.iter().any(|d| d == name) {
            source += &format!("int {name}(void) {{ NEED; return 0; }}\n");
        }
    }
    let c = dir.join("fake.c");
    std::fs::write(&c, source).unwrap();
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join("libcuda.so.1"))
        .arg(&c)
        .status()
        .is_ok_and(|s| s.success());
    if !built {
        gdr_tests::skip(
            "current_context_discipline_on_a_fake_driver",
            "no C compiler to build the fake libcuda",
        );
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "calls_leave_the_callers_current_context_alone",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LD_LIBRARY_PATH", &dir)
        .env("GDR_FAKE_LIBCUDA_CHILD", "1")
        .env(EXPECT_GPU_ENV, "1")
        .output()
        .expect("spawning the child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "child failed ({:?}):\n{text}",
        out.status
    );
    assert!(
        text.contains(CONTEXTS_LEFT_ALONE),
        "the check did not run:\n{text}"
    );
}

/// Issue 8: reserve a range, map physical allocation A, unmap it and map
/// another one, B, at the same address: the buffer id changes (907 → 909
/// measured on the H200), so the registration cache can tell them apart.
#[test]
fn vmm_remap_at_the_same_address_gets_a_new_buffer_id() {
    let name = "vmm_remap_at_the_same_address_gets_a_new_buffer_id";
    let Some((driver, ctx)) = gpu(name) else {
        return;
    };
    let attrs = driver.device_attributes(0).unwrap();
    if !attrs.virtual_memory_management {
        skip_gpu(
            name,
            "the device reports VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0",
        );
        return;
    }
    let g = ctx.vmm_granularity().unwrap();
    eprintln!("VMM granularity {g}");
    let reservation = ctx.reserve_address_range(2 * g).unwrap();
    let base = reservation.base();
    let a = ctx.create_physical(g).unwrap();
    let first = ctx.map(&reservation, 0, &a).unwrap();
    assert_eq!(first.device_ptr(), base);
    let at_a = ctx.pointer_attributes(base + 4096).unwrap();
    eprintln!(
        "A mapped at {base:#x}: {at_a:?} (created RDMA capable: {})",
        a.gpu_direct_rdma_capable()
    );
    assert_eq!(at_a.memory_type, MemoryType::Device);
    assert_eq!(at_a.device_ordinal, Some(0));
    assert_ne!(at_a.buffer_id, 0);
    // The H200 (driver 580) reports the reservation as the allocation.
    assert_eq!(
        (at_a.allocation_base, at_a.allocation_size),
        (base, 2 * g as u64)
    );
    let unmapped = ctx.pointer_attributes(base + g as u64);
    eprintln!("the reservation's unmapped second chunk: {unmapped:?}");
    assert_eq!(
        at_a.allocation_kind,
        AllocationKind::VirtualMemoryManagement
    );
    assert_eq!(
        ctx.address_range(base).unwrap(),
        (base, g as u64),
        "the chunk"
    );

    let stream = ctx.create_stream().unwrap();
    let host = pinned_with(&ctx, &pattern(8192, 0x42));
    // SAFETY: both ranges hold 8192 bytes and outlive the synchronize.
    unsafe { stream.copy_host_to_device(base, host.as_ptr(), 8192) }.unwrap();
    stream.synchronize().unwrap();

    drop(first);
    let b = ctx.create_physical(g).unwrap();
    let second = ctx.map(&reservation, 0, &b).unwrap();
    assert_eq!(second.device_ptr(), base, "the same virtual address");
    let at_b = ctx.pointer_attributes(base + 4096).unwrap();
    eprintln!("B mapped at {base:#x}: {at_b:?}");
    eprintln!("buffer id {} -> {}", at_a.buffer_id, at_b.buffer_id);
    assert_eq!(at_b.memory_type, MemoryType::Device);
    assert_ne!(
        at_b.buffer_id, at_a.buffer_id,
        "a new physical allocation, a new buffer id"
    );

    // A, mapped beside B, still holds its bytes.
    let again = ctx.map(&reservation, g, &a).unwrap();
    let got = read_device(&ctx, &stream, again.device_ptr(), 8192);
    assert_same("A's bytes, mapped again", &got, &pattern(8192, 0x42));
    let at_again = ctx.pointer_attributes(again.device_ptr()).unwrap();
    eprintln!("A mapped again at {:#x}: {at_again:?}", again.device_ptr());
    assert_eq!(at_again.memory_type, MemoryType::Device);
    if attrs.dma_buf_supported {
        let one = ctx.export_dmabuf(base, g);
        eprintln!("dma-buf export of one VMM chunk: {one:?}");
        let across = ctx.export_dmabuf(base, 2 * g);
        eprintln!("export across two chunks: {across:?}");
        assert!(across.is_err());
    }
    // The mappings keep the reservation and A alive.
    drop(reservation);
    drop(a);
    let got = read_device(&ctx, &stream, again.device_ptr(), 8192);
    assert_same(
        "A's bytes after its handle dropped",
        &got,
        &pattern(8192, 0x42),
    );
    drop((second, again, b));
}

const STUB_TARGET: &str = "device_attributes_are_sane";

/// The path of the C library this process runs on.
fn libc_path() -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("/libc.so.6") || p.contains("/libc-"))
        .map(str::to_owned)
}

/// Builds, in `dir`, a `libcuda.so.1` exporting every symbol hal-cuda needs
/// (C compiler permitting): `cuInit` answers `init`, and the device count is
/// 0. `false` without a compiler.
fn build_stub(dir: &std::path::Path, init: u32) -> bool {
    let mut source = String::from("int cuDeviceGetCount(int *n) { *n = 0; return 0; }\n");
    source += "int cuDriverGetVersion(int *v) { *v = 13000; return 0; }\n";
    source += &format!("int cuInit(unsigned f) {{ (void)f; return {init}; }}\n");
    for name in hal_cuda::cuda::REQUIRED_SYMBOLS {
        if !["cuDeviceGetCount", "cuDriverGetVersion", "cuInit"].contains(name) {
            source += &format!("int {name}(void) {{ return 999; }}\n");
        }
    }
    let c = dir.join("stub.c");
    std::fs::write(&c, source).unwrap();
    Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join("libcuda.so.1"))
        .arg(&c)
        .status()
        .is_ok_and(|s| s.success())
}

/// Issue 8: a libcuda stub first on the library path (a library that is not
/// the driver, CUDA's stub whose `cuInit` fails, a driver with no device)
/// makes a GPU test skip without `GDR_EXPECT_GPU` and fail with it. Runs
/// this binary's `device_attributes_are_sane` as a child per stub.
#[test]
fn a_libcuda_stub_on_the_library_path_fails_a_gpu_run() {
    init_tracing();
    let root = std::env::temp_dir().join(format!("gdr-libcuda-stubs-{}", std::process::id()));
    let mut stubs = Vec::new();
    if let Some(libc) = libc_path() {
        let dir = root.join("not-cuda");
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink(&libc, dir.join("libcuda.so.1")).unwrap();
        stubs.push((
            "a library without cuInit",
            dir,
            "does not export cuInit",
            true,
        ));
    }
    for (what, init, want, skips) in [
        ("CUDA's stub (cuInit = 34)", 34, "stub", true),
        ("a driver with no device", 0, "0 devices", true),
        // A code CUDA 12.8's enum lacks: read as the integer it is, and a
        // failure of its own (not a skip) with or without the switch.
        (
            "a driver answering an unlisted code (cuInit = 917)",
            917,
            "CUresult 917",
            false,
        ),
    ] {
        let dir = root.join(format!("init-{init}"));
        std::fs::create_dir_all(&dir).unwrap();
        if build_stub(&dir, init) {
            stubs.push((what, dir, want, skips));
        } else {
            eprintln!("no C compiler: stub {what:?} not built");
        }
    }
    assert!(!stubs.is_empty(), "no stub could be made");
    let exe = std::env::current_exe().unwrap();
    for &(what, ref dir, want, skips) in &stubs {
        let run = |expect: bool| {
            let mut cmd = Command::new(&exe);
            cmd.args([STUB_TARGET, "--exact", "--nocapture", "--test-threads=1"])
                .env("LD_LIBRARY_PATH", dir);
            if expect {
                cmd.env(EXPECT_GPU_ENV, "1");
            } else {
                cmd.env_remove(EXPECT_GPU_ENV);
            }
            let out = cmd.output().expect("spawning the child");
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            (out.status.success(), text)
        };
        let (ok, text) = run(false);
        if !skips {
            assert!(
                !ok,
                "{what}: an unexpected driver error fails the test:\n{text}"
            );
            assert!(text.contains(want), "{what}: names {want:?}:\n{text}");
            eprintln!("{what}: failed, with the code named");
            continue;
        }
        assert!(
            ok,
            "{what}: without {EXPECT_GPU_ENV} the test skips:\n{text}"
        );
        assert!(
            text.contains(&format!("SKIPPED {STUB_TARGET}")),
            "{what}:\n{text}"
        );
        assert!(
            text.contains(want),
            "{what}: the reason names {want:?}:\n{text}"
        );
        let (ok, text) = run(true);
        assert!(
            !ok,
            "{what}: with {EXPECT_GPU_ENV}=1 the run must fail:\n{text}"
        );
        assert!(
            text.contains(&format!("{EXPECT_GPU_ENV}=1 but no usable GPU")),
            "{what}:\n{text}"
        );
        eprintln!("{what}: skipped without {EXPECT_GPU_ENV}, failed with it");
    }
    let _ = std::fs::remove_dir_all(&root);
}
