//! The peer-copy path against raw device copies, in one run (the GPU
//! issue's two-GPU benchmark): on the real GPUs where found (GPU 0 → GPU 1
//! with two or more, over NVLink on the two-H200 machine; GPU 0 → GPU 0 on
//! one), else on the simulated node with two GPUs. Two engines of this
//! process (the sim NIC between them carries only the control messages).
//!
//! For each size, throughput in bytes with `IN_FLIGHT` requests in flight:
//! - `raw`: `IN_FLIGHT` `copy_device_to_device` calls of the size on as many
//!   streams of GPU 0, then each stream synchronised: what the hardware
//!   does;
//! - `engine`: `IN_FLIGHT` engine WRITE batches of the size from a's GPU
//!   memory into b's grant, submitted together, then each waited for.
//!
//! The goal (issue): engine ≥ 0.95 × raw at ≥ 16 MiB.
//! Run: `cargo bench -p gdr-tests --bench peer_copy -- --warm-up-time 1
//! --measurement-time 3`.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gdr_core::descriptor::GrantRights;
use gdr_core::engine::{EngineConfig, PeerCopyRoute, Transfer};
use gdr_sim::{GpuConfig, SimCuda, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, peer_copy_gpus};
use hal_cuda::{Context as _, Driver as _, Stream as _};

const T: Duration = Duration::from_secs(120);
const SIZES: [u64; 3] = [1 << 20, 16 << 20, 256 << 20];
const IN_FLIGHT: usize = 4;

fn bench_on<C: hal_cuda::Api>(c: &mut Criterion, what: &str, cuda: impl Fn() -> C::Driver)
where
    C::Driver: Clone,
{
    let config = EngineConfig::default().with_default_timeout(T);
    let w = EngineWorld::<SimVerbsApi, C>::sim_with(1, config, T, |_| cuda());
    assert_eq!(w.ab.route(), PeerCopyRoute::SameProcess, "the route");
    let gpus = peer_copy_gpus::<C>(&w.a.cuda);
    let ctx = w.a.cuda.context(gpus.0).expect("the source GPU");
    let streams: Vec<C::Stream> = (0..IN_FLIGHT)
        .map(|_| ctx.create_stream().expect("a stream"))
        .collect();
    let mut group = c.benchmark_group(format!("peer_copy_{what}_gpu{}_to_gpu{}", gpus.0, gpus.1));
    group.sample_size(10);
    for len in SIZES {
        group.throughput(Throughput::Bytes(len * IN_FLIGHT as u64));
        let (src_buf, src) = w.a.gpu_on(gpus.0, len, 1);
        let (dst_buf, dst) = w.b.gpu_on(gpus.1, len, 0);
        let (_g, remote) = w.b_grants(&dst, GrantRights::ReadWrite);
        group.bench_function(BenchmarkId::new("raw", len), |b| {
            b.iter(|| {
                for stream in &streams {
                    // SAFETY: both buffers hold `len` bytes and outlive the
                    // synchronised copies.
                    unsafe {
                        stream.copy_device_to_device(dst_buf.addr(), src_buf.addr(), len as usize)
                    }
                    .unwrap();
                }
                for stream in &streams {
                    stream.synchronize().unwrap();
                }
            })
        });
        group.bench_function(BenchmarkId::new("engine", len), |b| {
            b.iter(|| {
                let batches: Vec<_> = (0..IN_FLIGHT)
                    .map(|_| {
                        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, len)])
                            .unwrap()
                    })
                    .collect();
                for batch in batches {
                    batch.wait(T).unwrap();
                }
            })
        });
    }
    group.finish();
}

fn peer_copy(c: &mut Criterion) {
    match gdr_tests::cuda_gpu("peer_copy bench") {
        Some((driver, _)) => bench_on::<hal_cuda::cuda::CudaApi>(c, "cuda", || driver.clone()),
        None => {
            let gpus = vec![GpuConfig::default(); 2];
            let cuda = SimCuda::new(gpus, gdr_sim::FaultPlan::new());
            bench_on::<gdr_sim::SimCudaApi>(c, "sim", || cuda.clone())
        }
    }
}

criterion_group!(benches, peer_copy);
criterion_main!(benches);
