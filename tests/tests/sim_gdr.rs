//! The simulated NIC and the simulated GPU together: GPU memory reached by
//! RDMA through a dma-buf MR (whole allocation and sub-range) and through
//! peermem, proven with gdr-core's loopback self-check, and RDMA-written
//! bytes seen by another process through a CUDA IPC handle.

use std::os::fd::AsRawFd;

use gdr_core::loopback::{Loopback, LoopbackError};
use gdr_sim::{FaultPlan, GpuConfig, NodeConfig, SimCuda, SimCudaApi, SimFabric, SimVerbsApi};
use gdr_tests::{init_tracing, pattern};
use hal_cuda::{Context as _, DeviceMemory as _, Driver as _, IpcMapping as _, Stream as _};
use hal_verbs::{
    AccessFlags, MemoryRegion as _, ProtectionDomain as _, Provider as _, SendOp, Sge, VerbsError,
    WcStatus,
};

type GpuCtx = <SimCudaApi as hal_cuda::Api>::Context;

fn setup(gpu: GpuConfig) -> (Loopback<SimVerbsApi>, SimCuda, GpuCtx) {
    init_tracing();
    let fabric = SimFabric::new();
    let node = fabric.add_node("gpu-node", NodeConfig::default());
    let ctx = node.open("sim0").unwrap();
    let loopback = Loopback::<SimVerbsApi>::new(&ctx, 1).unwrap();
    let cuda = SimCuda::new(vec![gpu], FaultPlan::new());
    let gpu_ctx = cuda.context(0).unwrap();
    (loopback, cuda, gpu_ctx)
}

fn read_gpu(ctx: &GpuCtx, addr: u64, len: usize) -> Vec<u8> {
    let stream = ctx.create_stream().unwrap();
    let mut out = vec![0u8; len];
    // SAFETY: `out` outlives the synchronize.
    unsafe { stream.copy_device_to_host(out.as_mut_ptr(), addr, len) }.unwrap();
    stream.synchronize().unwrap();
    out
}

#[test]
fn host_memory_passes_the_loopback_self_check() {
    let (loopback, _cuda, _gpu) = setup(GpuConfig::default());
    let mut host = vec![0u8; 100_000];
    // SAFETY: `host` outlives the region.
    let mr = unsafe {
        loopback.pd().register(
            host.as_mut_ptr() as u64,
            host.len(),
            AccessFlags::transfer(),
        )
    }
    .unwrap();
    loopback.prove(&mr, 1000, 50_000).unwrap();
    assert!(loopback.prove(&mr, 90_000, 20_000).is_err(), "past the end");
}

#[test]
fn self_check_catches_a_region_without_remote_rights() {
    let (loopback, _cuda, _gpu) = setup(GpuConfig::default());
    let mut host = vec![0u8; 4096];
    // SAFETY: `host` outlives the region.
    let mr = unsafe {
        loopback
            .pd()
            .register(host.as_mut_ptr() as u64, 4096, AccessFlags::LOCAL_WRITE)
    }
    .unwrap();
    let err = loopback.prove(&mr, 0, 4096).unwrap_err();
    assert_eq!(
        err,
        LoopbackError::Completion {
            operation: "RDMA WRITE",
            status: WcStatus::REM_ACCESS_ERR
        }
    );
}

#[test]
fn rdma_reaches_gpu_memory_through_a_sub_range_dmabuf() {
    let (loopback, _cuda, gpu) = setup(GpuConfig::default());
    let len = 256 << 10;
    let mem = gpu.alloc(len).unwrap();
    let base = mem.device_ptr();
    // Export only [64 KiB, 128 KiB) and register it with iova = its address.
    let (sub_off, sub_len) = (64u64 << 10, 64usize << 10);
    let fd = gpu.export_dmabuf(base + sub_off, sub_len).unwrap();
    // SAFETY: `fd` is open for the call; `mem` outlives the region.
    let mr = unsafe {
        loopback.pd().register_dmabuf(
            fd.as_raw_fd(),
            0,
            sub_len,
            base + sub_off,
            AccessFlags::transfer(),
        )
    }
    .unwrap();
    assert_eq!(
        mr.addr(),
        base + sub_off,
        "a dma-buf MR is addressed by its iova"
    );
    loopback.prove(&mr, 0, sub_len).unwrap();

    // Now write a known pattern at 1000 bytes into the sub-range and find it
    // at base + 64 KiB + 1000 through CUDA: the right bytes, the right place.
    let payload = pattern(5000, 77);
    // SAFETY: `payload` outlives the registration and the run.
    let src = unsafe {
        loopback.pd().register(
            payload.as_ptr() as u64,
            payload.len(),
            AccessFlags::LOCAL_WRITE,
        )
    }
    .unwrap();
    // SAFETY: the SG entry lies in `src`, alive until `run` returns.
    unsafe {
        loopback.run(
            SendOp::Write {
                remote_addr: base + sub_off + 1000,
                rkey: mr.rkey(),
            },
            Sge {
                addr: src.addr(),
                length: payload.len() as u32,
                lkey: src.lkey(),
            },
            "RDMA WRITE",
        )
    }
    .unwrap();
    assert_eq!(
        read_gpu(&gpu, base + sub_off + 1000, payload.len()),
        payload
    );
    // The self-check refuses a range running past the region.
    let err = loopback.prove(&mr, sub_len as u64 - 10, 20).unwrap_err();
    assert!(matches!(
        err,
        LoopbackError::Verbs(VerbsError::InvalidArgument { .. })
    ));
}

#[test]
fn rdma_written_gpu_bytes_are_seen_through_ipc_in_another_process() {
    let (loopback, cuda, gpu) = setup(GpuConfig::default());
    let len = 128 << 10;
    let mem = gpu.alloc(len).unwrap();
    let fd = gpu.export_dmabuf(mem.device_ptr(), len).unwrap();
    // SAFETY: `fd` is open for the call; `mem` outlives the region.
    let mr = unsafe {
        loopback.pd().register_dmabuf(
            fd.as_raw_fd(),
            0,
            len,
            mem.device_ptr(),
            AccessFlags::transfer(),
        )
    }
    .unwrap();
    loopback.prove(&mr, 0, len).unwrap();
    let expected = read_gpu(&gpu, mem.device_ptr(), len);
    assert!(
        expected.iter().any(|&b| b != 0),
        "the self-check wrote a pattern"
    );

    let handle = gpu.ipc_export(mem.device_ptr()).unwrap();
    let other = cuda.other_process().context(0).unwrap();
    let mapping = other.ipc_open(&handle).unwrap();
    assert_eq!(read_gpu(&other, mapping.device_ptr(), len), expected);
}

#[test]
fn peermem_rung_follows_the_switch() {
    let (loopback, _cuda, gpu) = setup(GpuConfig {
        peermem: true,
        ..GpuConfig::default()
    });
    let mem = gpu.alloc(64 << 10).unwrap();
    // SAFETY: `mem` outlives the region.
    let mr = unsafe {
        loopback
            .pd()
            .register(mem.device_ptr(), 64 << 10, AccessFlags::transfer())
    }
    .unwrap();
    loopback.prove(&mr, 4096, 8192).unwrap();

    let (loopback, _cuda, gpu) = setup(GpuConfig::default());
    let mem = gpu.alloc(64 << 10).unwrap();
    // SAFETY: as above; the registration is expected to fail.
    let err = unsafe {
        loopback
            .pd()
            .register(mem.device_ptr(), 64 << 10, AccessFlags::transfer())
    }
    .unwrap_err();
    assert_eq!(err.errno(), Some(libc::EFAULT), "{err}");
}
