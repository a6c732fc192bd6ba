//! The staging path against its stages, in one run (the GPU issue's
//! benchmark): on the real GPU where one is found (the H200), else on the
//! simulated one. Two engines on two nodes of the simulated NIC fabric
//! (its "wire" is a CPU copy), GPU memory on the staging rung.
//!
//! For each size, with throughput in bytes:
//! - `d2h`, `h2d`: one device→host / host→device copy of the size between
//!   device memory and pinned memory, on a stream, synchronised: the copy
//!   stages alone;
//! - `wire`: an engine WRITE of host memory into the peer's host memory:
//!   the wire alone; `wire_read`: the same bytes READ back (the direction
//!   the owner of staged memory uses in a rendezvous);
//! - `pipelined`: an engine WRITE from staged GPU memory into the peer's
//!   host memory (device→host copies overlapped with the wire), and
//!   `pipelined_in`: host memory into the peer's staged GPU memory (the
//!   owner's wire and host→device copies overlapped), and
//!   `pipelined_gpu`: staged GPU memory into the peer's staged GPU memory
//!   (both ends staged, no GDR anywhere: the requester's device→host
//!   copies, the wire and the owner's host→device copies overlapped);
//! - `naive_*`: the same with the pipeline off (copy all, then send).
//!
//! The goal (issue): pipelined ≥ 0.9 × its slowest stage at ≥ 16 MiB.
//! With `GDR_STAGING_SWEEP=1` (on a GPU) it sweeps the pipeline's slice
//! size and slot count instead (`staging_sweep`); with
//! `GDR_STAGING_SWEEP=rendezvous` the landing slots per peer and the slice
//! size of the rendezvous (`rendezvous_sweep`, on the sim without a GPU).
//! Run: `cargo bench -p gdr-tests --bench staging -- --warm-up-time 1
//! --measurement-time 3`.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gdr_core::buffer::Buffer;
use gdr_core::descriptor::GrantRights;
use gdr_core::engine::{EngineConfig, Transfer};
use gdr_core::ladder::{LadderConfig, Policy, Rung};
use gdr_sim::{GpuConfig, SimCuda, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, Kind};
use hal_cuda::{Context as _, Driver as _, Stream as _};

const T: Duration = Duration::from_secs(120);
const SIZES: [u64; 4] = [64 << 10, 1 << 20, 16 << 20, 256 << 20];

fn config(pipeline: bool) -> EngineConfig {
    EngineConfig {
        qps_per_peer: 2,
        default_timeout: T,
        staging_pipeline: pipeline,
        // The staging path is measured: both engines share the GPU here.
        peer_copy: false,
        ladder: LadderConfig {
            policy: Policy::Only(Rung::Staging),
            ..LadderConfig::default()
        },
        ..EngineConfig::default()
    }
}

fn bench_on<C: hal_cuda::Api>(c: &mut Criterion, what: &str, cuda: impl Fn() -> C::Driver) {
    let worlds: Vec<(bool, EngineWorld<SimVerbsApi, C>)> = [true, false]
        .into_iter()
        .map(|p| (p, EngineWorld::sim_with(1, config(p), T, |_| cuda())))
        .collect();
    let driver = cuda();
    let ctx = driver.context(0).expect("GPU 0");
    let stream = ctx.create_stream().expect("a stream");
    let mut group = c.benchmark_group(format!("staging_{what}"));
    group.sample_size(10);
    for len in SIZES {
        group.throughput(Throughput::Bytes(len));
        let device = Buffer::<C>::alloc_device(&ctx, len).expect("device memory");
        let pinned = Buffer::<C>::alloc_pinned(&ctx, len).expect("pinned memory");
        group.bench_function(BenchmarkId::new("d2h", len), |b| {
            b.iter(|| {
                // SAFETY: both buffers hold `len` bytes and outlive the
                // synchronised copy.
                unsafe {
                    stream.copy_device_to_host(
                        pinned.addr() as *mut u8,
                        device.addr(),
                        len as usize,
                    )
                }
                .unwrap();
                stream.synchronize().unwrap();
            })
        });
        group.bench_function(BenchmarkId::new("h2d", len), |b| {
            b.iter(|| {
                // SAFETY: as above.
                unsafe {
                    stream.copy_host_to_device(
                        device.addr(),
                        pinned.addr() as *const u8,
                        len as usize,
                    )
                }
                .unwrap();
                stream.synchronize().unwrap();
            })
        });
        for (pipeline, w) in &worlds {
            let prefix = if *pipeline { "" } else { "naive_" };
            let (_hs, host_src) = w.a.alloc(Kind::Host, len, 1);
            let (_gs, gpu_src) = w.a.alloc(Kind::Gpu, len, 2);
            let (_hd, host_dst) = w.b.alloc(Kind::Host, len, 0);
            let (_gd, gpu_dst) = w.b.alloc(Kind::Gpu, len, 0);
            let (_g1, to_host) = w.b_grants(&host_dst, GrantRights::ReadWrite);
            let (_g2, to_gpu) = w.b_grants(&gpu_dst, GrantRights::Write);
            // The owner serves rendezvous on its driver thread.
            let _driver = w.b.engine.spawn_driver(Duration::from_micros(50));
            // What a rendezvous adds on the requester's side: a grant
            // of the range to the owner, announced, then revoked (a driver
            // sends the announcements: nothing else makes progress here).
            if *pipeline {
                let _sender = w.a.engine.spawn_driver(Duration::from_micros(50));
                group.bench_function(BenchmarkId::new("grant", len), |b| {
                    b.iter(|| drop(w.ab.grant(&host_src, 0, len, GrantRights::Read).unwrap()))
                });
            }
            let mut run = |name: String, transfer: Transfer<'_, SimVerbsApi>| {
                group.bench_function(BenchmarkId::new(name, len), |b| {
                    b.iter(|| w.ab.submit(&[transfer]).unwrap().wait(T).unwrap())
                });
            };
            if *pipeline {
                run(
                    "wire".into(),
                    Transfer::write(&host_src, 0, &to_host, 0, len),
                );
                // The owner's side of a rendezvous into staged GPU memory
                // READs: the wire as that direction sees it.
                run(
                    "wire_read".into(),
                    Transfer::read(&host_src, 0, &to_host, 0, len),
                );
            }
            run(
                format!("{prefix}pipelined"),
                Transfer::write(&gpu_src, 0, &to_host, 0, len),
            );
            run(
                format!("{prefix}pipelined_in"),
                Transfer::write(&host_src, 0, &to_gpu, 0, len),
            );
            run(
                format!("{prefix}pipelined_gpu"),
                Transfer::write(&gpu_src, 0, &to_gpu, 0, len),
            );
        }
    }
    group.finish();
}

/// The pipeline's knobs against each other: a 256 MiB staged GPU→host
/// WRITE for each slice size and slot count (`staging_sweep/<slice>x<slots>`),
/// to choose the defaults.
fn sweep_on<C: hal_cuda::Api>(c: &mut Criterion, cuda: impl Fn() -> C::Driver) {
    const LEN: u64 = 256 << 20;
    let mut group = c.benchmark_group("staging_sweep");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(LEN));
    for slice in [1u64 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20] {
        for slots in [2usize, 4, 8, 16] {
            let mut config = config(true);
            config.staging_slice = slice;
            config.staging_slots = slots;
            let w: EngineWorld<SimVerbsApi, C> = EngineWorld::sim_with(1, config, T, |_| cuda());
            let (_gs, gpu_src) = w.a.alloc(Kind::Gpu, LEN, 2);
            let (_hd, host_dst) = w.b.alloc(Kind::Host, LEN, 0);
            let (_g, to_host) = w.b_grants(&host_dst, GrantRights::Write);
            let transfer = Transfer::write(&gpu_src, 0, &to_host, 0, LEN);
            group.bench_function(format!("{}MiBx{slots}", slice >> 20), |b| {
                b.iter(|| w.ab.submit(&[transfer]).unwrap().wait(T).unwrap())
            });
        }
    }
    group.finish();
}

/// The rendezvous's knobs against each other: 16 MiB host → staged GPU
/// (`in`) and staged GPU → staged GPU (`gpu`) for each landing-slot count
/// and slice size (`rendezvous_sweep/<dir>/<slice KiB>x<slots>`), beside
/// the stages alone (`wire`, `h2d`) in the same run.
fn rendezvous_sweep_on<C: hal_cuda::Api>(c: &mut Criterion, cuda: impl Fn() -> C::Driver) {
    const LEN: u64 = 16 << 20;
    let mut group = c.benchmark_group("rendezvous_sweep");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(LEN));
    // The stages alone, in the same run: the wire (host → host WRITE)
    // and the owner's host → device copy.
    {
        let w: EngineWorld<SimVerbsApi, C> = EngineWorld::sim_with(1, config(true), T, |_| cuda());
        let (_hs, host_src) = w.a.alloc(Kind::Host, LEN, 1);
        let (_hd, host_dst) = w.b.alloc(Kind::Host, LEN, 0);
        let (_g, to_host) = w.b_grants(&host_dst, GrantRights::Write);
        let transfer = Transfer::write(&host_src, 0, &to_host, 0, LEN);
        group.bench_function("wire", |b| {
            b.iter(|| w.ab.submit(&[transfer]).unwrap().wait(T).unwrap())
        });
        let driver = cuda();
        let ctx = driver.context(0).expect("GPU 0");
        let stream = ctx.create_stream().expect("a stream");
        let device = Buffer::<C>::alloc_device(&ctx, LEN).expect("device memory");
        let pinned = Buffer::<C>::alloc_pinned(&ctx, LEN).expect("pinned memory");
        group.bench_function("h2d", |b| {
            b.iter(|| {
                // SAFETY: both buffers hold `LEN` bytes and outlive the
                // synchronised copy.
                unsafe {
                    stream.copy_host_to_device(
                        device.addr(),
                        pinned.addr() as *const u8,
                        LEN as usize,
                    )
                }
                .unwrap();
                stream.synchronize().unwrap();
            })
        });
    }
    for slice in [512u64 << 10, 1 << 20, 2 << 20, 4 << 20] {
        for slots in [2usize, 4, 8, 16] {
            let mut config = config(true);
            config.staging_slice = slice;
            config.rendezvous_slots = slots;
            let w: EngineWorld<SimVerbsApi, C> = EngineWorld::sim_with(1, config, T, |_| cuda());
            let (_hs, host_src) = w.a.alloc(Kind::Host, LEN, 1);
            let (_gs, gpu_src) = w.a.alloc(Kind::Gpu, LEN, 2);
            let (_gd, gpu_dst) = w.b.alloc(Kind::Gpu, LEN, 0);
            let (_g, to_gpu) = w.b_grants(&gpu_dst, GrantRights::Write);
            let _driver = w.b.engine.spawn_driver(Duration::from_micros(50));
            for (dir, src) in [("in", &host_src), ("gpu", &gpu_src)] {
                let transfer = Transfer::write(src, 0, &to_gpu, 0, LEN);
                group.bench_function(format!("{dir}/{}KiBx{slots}", slice >> 10), |b| {
                    b.iter(|| w.ab.submit(&[transfer]).unwrap().wait(T).unwrap())
                });
            }
        }
    }
    group.finish();
}

fn staging(c: &mut Criterion) {
    let sweep = std::env::var("GDR_STAGING_SWEEP").unwrap_or_default();
    if sweep == "rendezvous" {
        match gdr_tests::cuda_gpu("staging bench") {
            Some((driver, _)) => {
                rendezvous_sweep_on::<hal_cuda::cuda::CudaApi>(c, || driver.clone())
            }
            None => {
                let faults = gdr_sim::FaultPlan::new();
                rendezvous_sweep_on::<gdr_sim::SimCudaApi>(c, move || {
                    SimCuda::new(vec![GpuConfig::default()], faults.clone())
                })
            }
        }
        return;
    }
    let sweep = sweep == "1";
    match gdr_tests::cuda_gpu("staging bench") {
        Some((driver, _)) if sweep => sweep_on::<hal_cuda::cuda::CudaApi>(c, || driver.clone()),
        Some((driver, _)) => bench_on::<hal_cuda::cuda::CudaApi>(c, "h200", || driver.clone()),
        None => {
            let faults = gdr_sim::FaultPlan::new();
            bench_on::<gdr_sim::SimCudaApi>(c, "sim", move || {
                SimCuda::new(vec![GpuConfig::default()], faults.clone())
            })
        }
    }
}

criterion_group!(benches, staging);
criterion_main!(benches);
