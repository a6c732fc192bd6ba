//! The registration ladder on a real NIC: SoftRoCE's `rxe0` in the VM, with
//! a simulated GPU whose memory is host-visible (the stand-in for GPU memory
//! pinned by nvidia-peermem on a machine without a GPU).
//!
//! Host memory takes the host rung; GPU memory finds the dma-buf rung
//! refused by the NIC itself (rxe has no dma-buf support: EOPNOTSUPP) and
//! takes the peermem rung, proven by a loopback WRITE and READ through the
//! kernel's rxe packet path. Skips without an RDMA device.

use std::sync::Arc;

use gdr_core::buffer::Buffer;
use gdr_core::cache::{CacheConfig, RegistrationCache};
use gdr_core::ladder::{DmabufExports, Gpu, Ladder, LadderConfig, Refusal, Rung};
use gdr_sim::{FaultPlan, GpuConfig, SimCuda};
use gdr_tests::rxe::open_rxe;
use hal_cuda::Driver as _;
use hal_verbs::rdma::RdmaApi;
use hal_verbs::{Context as _, Provider as _};

type RxeLadder = Ladder;

fn ladder(test: &str) -> Option<(RxeLadder, SimCuda)> {
    ladder_and_context(test).map(|(ladder, cuda, _)| (ladder, cuda))
}

fn ladder_and_context(test: &str) -> Option<(RxeLadder, SimCuda, hal_verbs::dynamic::DynContext)> {
    let (provider, ctx) = open_rxe(test)?;
    // The ladder holds the erased backends, as every ladder does.
    let ctx = hal_verbs::dynamic::DynProvider::new::<RdmaApi>(provider)
        .open(&ctx.name())
        .unwrap();
    let cuda = SimCuda::new(
        vec![GpuConfig {
            host_visible: true,
            ..GpuConfig::default()
        }],
        FaultPlan::new(),
    );
    let gpu = Gpu::open(&cuda.erased(), 0).unwrap();
    let ladder = Ladder::new(
        &ctx,
        vec![gpu],
        Arc::new(RegistrationCache::new(CacheConfig::default())),
        Arc::new(DmabufExports::new()),
        LadderConfig::default(),
    )
    .unwrap();
    Some((ladder, cuda, ctx))
}

#[test]
fn host_memory_takes_the_host_rung_on_rxe_and_transfers() {
    let Some((ladder, _cuda)) = ladder("host_memory_takes_the_host_rung_on_rxe_and_transfers")
    else {
        return;
    };
    let buffer = Buffer::alloc_host(1 << 20);
    let registration = buffer.register(&ladder, 0, 1 << 20).unwrap();
    assert_eq!(registration.rung(), Rung::HostMemory);
    ladder.prove(&registration, 1 << 20).unwrap();
    let again = buffer.register(&ladder, 4096, 4096).unwrap();
    assert!(
        again
            .handle()
            .unwrap()
            .same_registration(registration.handle().unwrap())
    );
    assert_eq!(ladder.cache().stats().hits, 1);
}

#[test]
fn gpu_memory_falls_from_dmabuf_refused_by_rxe_to_peermem() {
    let Some((ladder, cuda)) = ladder("gpu_memory_falls_from_dmabuf_refused_by_rxe_to_peermem")
    else {
        return;
    };
    let ctx = cuda.erased().context(0).unwrap();
    let buffer = Buffer::alloc_device(&ctx, 512 << 10).unwrap();
    let registration = buffer.register(&ladder, 0, 512 << 10).unwrap();
    assert_eq!(registration.rung(), Rung::Peermem, "{registration:?}");
    let [failure] = registration.failures() else {
        panic!("{:?}", registration.failures())
    };
    assert_eq!(failure.rung, Rung::Dmabuf);
    let Refusal::Nic(error) = &failure.refusal else {
        panic!("the NIC, not the GPU, refuses: {failure}")
    };
    assert!(error.is_unsupported(), "{error}");
    assert_eq!(error.errno(), Some(libc::EOPNOTSUPP), "{error}");
    assert_eq!(
        ladder.verdict(0, Rung::Peermem),
        Some(Ok(())),
        "the peermem probe passed its loopback self-check"
    );
    ladder.prove(&registration, 512 << 10).unwrap();
}

#[test]
fn grants_confine_the_peer_on_rxe() {
    let Some((ladder, _cuda, ctx)) = ladder_and_context("grants_confine_the_peer_on_rxe") else {
        return;
    };
    gdr_tests::grants::grants_confine_the_peer(&ctx, &ladder, 1);
}
