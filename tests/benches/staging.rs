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
//! - `naive_*`: the baseline, copy all, then send: the same transfers
//!   with no overlap, built here on the engine's public API (the engine
//!   has no such path): `naive_pipelined` is a synchronous device→pinned
//!   copy of the whole range on a stream, then an engine WRITE from that
//!   pinned buffer (host memory the NIC reaches) into the peer's host
//!   memory; `naive_pipelined_in` is an engine WRITE of host memory into a
//!   pinned host buffer the owner granted, then the owner's synchronous
//!   host→device copy of the whole range into its GPU memory (run here,
//!   on the owner's driver, once the WRITE ended: the message that would
//!   tell the owner is left out); `naive_pipelined_gpu` is both. The
//!   pinned buffers are allocated and registered once, outside the
//!   measurement.
//!
//! The goal (issue): pipelined ≥ 0.9 × its slowest stage at ≥ 16 MiB.
//! With `GDR_STAGING_SWEEP=1` (on a GPU) it sweeps the pipeline's slice
//! size and slot count instead (`staging_sweep`); with
//! `GDR_STAGING_SWEEP=rendezvous` the landing slots per peer and the slice
//! size of the rendezvous (`rendezvous_sweep`, on the sim without a GPU).
//! Run: `cargo bench -p gdr-tests --bench staging -- --warm-up-time 1
//! --measurement-time 3`. With `GDR_BENCH_TRACE=<filter>` (an
//! `EnvFilter`, e.g. `gdr_core::engine::rendezvous=trace,gdr_sim=debug`)
//! the events it lets through go to stderr with the time since start.

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

fn config() -> EngineConfig {
    EngineConfig::default()
        .with_qps_per_peer(2)
        .with_default_timeout(T)
        // The staging path is measured: both engines share the GPU here.
        .with_peer_copy(false)
        .with_ladder(LadderConfig::default().with_policy(Policy::Only(Rung::Staging)))
}

/// A synchronous copy of `len` bytes from device address `src` into host
/// memory at `dst` on `stream`.
///
/// # Safety
/// `dst` and `src` name `len` bytes each, mapped, alive until it returns.
unsafe fn d2h<C: hal_cuda::Api>(stream: &C::Stream, dst: u64, src: u64, len: u64) {
    // SAFETY: the caller's.
    unsafe { stream.copy_device_to_host(dst as *mut u8, src, len as usize) }.unwrap();
    stream.synchronize().unwrap();
}

/// A synchronous copy of `len` bytes from host memory at `src` to device
/// address `dst` on `stream`.
///
/// # Safety
/// As [`d2h`].
unsafe fn h2d<C: hal_cuda::Api>(stream: &C::Stream, dst: u64, src: u64, len: u64) {
    // SAFETY: the caller's.
    unsafe { stream.copy_host_to_device(dst, src as *const u8, len as usize) }.unwrap();
    stream.synchronize().unwrap();
}

fn bench_on<C: hal_cuda::Api<Driver: Clone>>(
    c: &mut Criterion,
    what: &str,
    cuda: impl Fn() -> C::Driver,
) {
    let w: EngineWorld<SimVerbsApi, C> = EngineWorld::sim_with(1, config(), T, |_| cuda());
    let driver = cuda();
    let ctx = driver.context(0).expect("GPU 0");
    let stream = ctx.create_stream().expect("a stream");
    // The baseline's buffers, of the same driver erased (as buffers are).
    let erased = hal_cuda::dynamic::DynDriver::new::<C>(driver.clone());
    let buffers_ctx = erased.context(0).expect("GPU 0");
    // The baseline's copies, on each side's own GPU.
    let a_stream = w.a.cuda.context(0).unwrap().create_stream().unwrap();
    let b_stream = w.b.cuda.context(0).unwrap().create_stream().unwrap();
    // The owner serves rendezvous on its driver thread.
    let _driver = w.b.engine.spawn_driver().unwrap();
    let mut group = c.benchmark_group(format!("staging_{what}"));
    group.sample_size(10);
    for len in SIZES {
        group.throughput(Throughput::Bytes(len));
        let device = Buffer::alloc_device(&buffers_ctx, len).expect("device memory");
        let pinned = Buffer::alloc_pinned(&buffers_ctx, len).expect("pinned memory");
        group.bench_function(BenchmarkId::new("d2h", len), |b| {
            b.iter(|| {
                // SAFETY: both buffers hold `len` bytes and outlive the copy.
                unsafe { d2h::<C>(&stream, pinned.addr(), device.addr(), len) }
            })
        });
        group.bench_function(BenchmarkId::new("h2d", len), |b| {
            b.iter(|| {
                // SAFETY: as above.
                unsafe { h2d::<C>(&stream, device.addr(), pinned.addr(), len) }
            })
        });
        let (_hs, host_src) = w.a.alloc(Kind::Host, len, 1);
        let (gpu_src_buf, gpu_src) = w.a.alloc(Kind::Gpu, len, 2);
        let (pinned_src_buf, pinned_src) = w.a.alloc(Kind::Pinned, len, 0);
        let (_hd, host_dst) = w.b.alloc(Kind::Host, len, 0);
        let (gpu_dst_buf, gpu_dst) = w.b.alloc(Kind::Gpu, len, 0);
        let (pinned_dst_buf, pinned_dst) = w.b.alloc(Kind::Pinned, len, 0);
        let (_g1, to_host) = w.b_grants(&host_dst, GrantRights::ReadWrite);
        let (_g2, to_gpu) = w.b_grants(&gpu_dst, GrantRights::Write);
        let (_g3, to_pinned) = w.b_grants(&pinned_dst, GrantRights::Write);
        // What a rendezvous would add on the requester's side if it granted
        // its range: a grant to the owner, announced, then revoked (a
        // driver sends the announcements: nothing else makes progress here).
        {
            let _sender = w.a.engine.spawn_driver().unwrap();
            group.bench_function(BenchmarkId::new("grant", len), |b| {
                b.iter(|| drop(w.ab.grant(&host_src, 0, len, GrantRights::Read).unwrap()))
            });
        }
        let write = |transfer: Transfer<'_>| w.ab.submit(&[transfer]).unwrap().wait(T).unwrap();
        let mut run = |name: &str, transfer: Transfer<'_>| {
            group.bench_function(BenchmarkId::new(name, len), |b| b.iter(|| write(transfer)));
        };
        run("wire", Transfer::write(&host_src, 0, &to_host, 0, len));
        // The owner's side of a rendezvous into staged GPU memory READs:
        // the wire as that direction sees it.
        run("wire_read", Transfer::read(&host_src, 0, &to_host, 0, len));
        run("pipelined", Transfer::write(&gpu_src, 0, &to_host, 0, len));
        run(
            "pipelined_in",
            Transfer::write(&host_src, 0, &to_gpu, 0, len),
        );
        run(
            "pipelined_gpu",
            Transfer::write(&gpu_src, 0, &to_gpu, 0, len),
        );
        // The baseline: copy all, then send (or send all, then copy).
        let (gs, ps) = (gpu_src_buf.addr(), pinned_src_buf.addr());
        let (gd, pd) = (gpu_dst_buf.addr(), pinned_dst_buf.addr());
        group.bench_function(BenchmarkId::new("naive_pipelined", len), |b| {
            b.iter(|| {
                // SAFETY: a's GPU and pinned buffers hold `len` bytes and
                // outlive the copy; no transfer uses them meanwhile.
                unsafe { d2h::<C>(&a_stream, ps, gs, len) };
                write(Transfer::write(&pinned_src, 0, &to_host, 0, len));
            })
        });
        group.bench_function(BenchmarkId::new("naive_pipelined_in", len), |b| {
            b.iter(|| {
                write(Transfer::write(&host_src, 0, &to_pinned, 0, len));
                // SAFETY: b's GPU and pinned buffers hold `len` bytes and
                // outlive the copy; the WRITE into the pinned one ended.
                unsafe { h2d::<C>(&b_stream, gd, pd, len) };
            })
        });
        group.bench_function(BenchmarkId::new("naive_pipelined_gpu", len), |b| {
            b.iter(|| {
                // SAFETY: as in the two above.
                unsafe { d2h::<C>(&a_stream, ps, gs, len) };
                write(Transfer::write(&pinned_src, 0, &to_pinned, 0, len));
                // SAFETY: as above.
                unsafe { h2d::<C>(&b_stream, gd, pd, len) };
            })
        });
    }
    group.finish();
}

/// The pipeline's knobs against each other: a 256 MiB staged GPU→host
/// WRITE for each slice size and slot count (`staging_sweep/<slice>x<slots>`),
/// to choose the defaults.
fn sweep_on<C: hal_cuda::Api<Driver: Clone>>(c: &mut Criterion, cuda: impl Fn() -> C::Driver) {
    const LEN: u64 = 256 << 20;
    let mut group = c.benchmark_group("staging_sweep");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(LEN));
    for slice in [1u64 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20] {
        for slots in [2usize, 4, 8, 16] {
            let mut config = config();
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
fn rendezvous_sweep_on<C: hal_cuda::Api<Driver: Clone>>(
    c: &mut Criterion,
    cuda: impl Fn() -> C::Driver,
) {
    const LEN: u64 = 16 << 20;
    let mut group = c.benchmark_group("rendezvous_sweep");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(LEN));
    // The stages alone, in the same run: the wire (host → host WRITE)
    // and the owner's host → device copy.
    {
        let w: EngineWorld<SimVerbsApi, C> = EngineWorld::sim_with(1, config(), T, |_| cuda());
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
        let erased = hal_cuda::dynamic::DynDriver::new::<C>(driver.clone());
        let buffers_ctx = erased.context(0).expect("GPU 0");
        let device = Buffer::alloc_device(&buffers_ctx, LEN).expect("device memory");
        let pinned = Buffer::alloc_pinned(&buffers_ctx, LEN).expect("pinned memory");
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
            let mut config = config();
            config.staging_slice = slice;
            config.rendezvous_slots = slots;
            let w: EngineWorld<SimVerbsApi, C> = EngineWorld::sim_with(1, config, T, |_| cuda());
            let (_hs, host_src) = w.a.alloc(Kind::Host, LEN, 1);
            let (_gs, gpu_src) = w.a.alloc(Kind::Gpu, LEN, 2);
            let (_gd, gpu_dst) = w.b.alloc(Kind::Gpu, LEN, 0);
            let (_g, to_gpu) = w.b_grants(&gpu_dst, GrantRights::Write);
            let _driver = w.b.engine.spawn_driver().unwrap();
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

/// With `GDR_BENCH_TRACE=<filter>` (an `EnvFilter`, e.g.
/// `gdr_core::engine::rendezvous=trace`), the events it lets through go to
/// stderr, stamped with the time since start: the trace of a run.
fn trace_from_env() {
    let Ok(filter) = std::env::var("GDR_BENCH_TRACE") else {
        return;
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_timer(tracing_subscriber::fmt::time::Uptime::default())
        .with_ansi(false)
        .with_thread_ids(true)
        .with_writer(std::io::stderr)
        .try_init();
}

fn staging(c: &mut Criterion) {
    trace_from_env();
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
