//! The engine's staging path on the real CUDA driver (the H200): two
//! engines on two nodes of the simulated NIC fabric, each with the real
//! GPU. The sim NIC moves host memory only, so GPU memory goes through the
//! staging rung: the pipelined bounce pool (and the naive path), device
//! memory copied by the real driver. GPU→GPU, GPU→host and host→GPU, WRITE
//! and READ back, from 1 byte to 1 GiB including sizes that are not
//! multiples of the slice, data verified byte for byte. Skipped (with the
//! reason printed) without a GPU; a failure then with `GDR_EXPECT_GPU=1`.

use std::time::Duration;

use gdr_core::engine::EngineConfig;
use gdr_core::ladder::{LadderConfig, Policy, Rung};
use gdr_sim::SimVerbsApi;
use gdr_tests::engine_world::{EngineWorld, Kind};
use hal_cuda::cuda::CudaApi;

const T: Duration = Duration::from_secs(120);

fn world(test: &str, policy: Policy, pipeline: bool) -> Option<EngineWorld<SimVerbsApi, CudaApi>> {
    let (driver, _ctx) = gdr_tests::cuda_gpu(test)?;
    let config = EngineConfig {
        qps_per_peer: 2,
        default_timeout: T,
        staging_pipeline: pipeline,
        ladder: LadderConfig {
            policy,
            ..LadderConfig::default()
        },
        ..EngineConfig::default()
    };
    Some(EngineWorld::sim_with(1, config, T, |_| driver.clone()))
}

/// The ladder over a NIC that cannot reach the real GPU's memory (the sim
/// NIC refuses device addresses instead of dereferencing them) falls back
/// to staging, and the data still moves.
#[test]
fn real_gpu_memory_over_the_sim_nic_takes_the_staging_rung() {
    let name = "real_gpu_memory_over_the_sim_nic_takes_the_staging_rung";
    let Some(w) = world(name, Policy::Fallback, true) else {
        return;
    };
    let (src_rungs, dst_rungs, _) =
        w.write_and_read_back(Kind::Gpu, Kind::Gpu, 1 << 20, 3, 2, "fallback");
    assert_eq!(src_rungs, [Rung::Staging], "a's GPU memory");
    assert_eq!(dst_rungs, [Rung::Staging], "b's GPU memory");
}

/// Every direction and size through the pipeline on the real GPU.
#[test]
fn pipelined_staging_on_the_real_gpu() {
    let name = "pipelined_staging_on_the_real_gpu";
    let Some(w) = world(name, Policy::Only(Rung::Staging), true) else {
        return;
    };
    let slice = w.a.engine.config().staging_slice;
    for len in [
        1,
        4095,
        slice - 1,
        slice + 1,
        5 * slice + 4097,
        64 << 20,
        1 << 30,
    ] {
        for (from, to) in [
            (Kind::Gpu, Kind::Gpu),
            (Kind::Gpu, Kind::Host),
            (Kind::Host, Kind::Gpu),
        ] {
            let seed = (len % 251) as u8;
            w.write_and_read_back(from, to, len, seed, 2, &format!("pipelined {len} B"));
        }
    }
}

/// The naive path (copy all, then send) on the real GPU, for the
/// benchmark's baseline to be right too.
#[test]
fn naive_staging_on_the_real_gpu() {
    let name = "naive_staging_on_the_real_gpu";
    let Some(w) = world(name, Policy::Only(Rung::Staging), false) else {
        return;
    };
    for len in [1, 4 << 20, (16 << 20) + 3] {
        w.write_and_read_back(Kind::Gpu, Kind::Gpu, len, 9, 2, &format!("naive {len} B"));
    }
}

/// A stream-ordered fence on the real driver (`cuStreamWaitValue32` on the
/// engine's pinned word): a copy queued after the fence does not run while
/// the batch is held (the sim fabric paused), runs once it ends, and sees
/// the data. Prints the delay from the batch's end (seen by a spinning
/// host thread) to the stream moving on, against waiting on the host and
/// then queuing the copy (median and p99 of 200): a measurement, not an
/// assertion.
#[test]
fn a_stream_fence_on_the_real_gpu() {
    use gdr_core::descriptor::GrantRights;
    use gdr_core::engine::Transfer;
    use hal_cuda::{Event as _, Stream as _};

    let name = "a_stream_fence_on_the_real_gpu";
    let Some(w) = world(name, Policy::Fallback, true) else {
        return;
    };
    let (batch, stream, event) = w.fenced_copy_after_a_held_read(1 << 20, 6);
    assert_eq!(batch.status(), Some(Ok(())));
    let (_s, src) = w.b.alloc(Kind::Host, 4096, 6);
    let (_g, remote) = w.b_grants(&src, GrantRights::Read);
    let (_gpu_buf, gpu_region) = w.a.alloc(Kind::Gpu, 4096, 0);
    // The delay, fence against host wait, small READs.
    let mut fenced = Vec::new();
    let mut hosted = Vec::new();
    for _ in 0..200 {
        let batch =
            w.ab.submit(&[Transfer::read(&gpu_region, 0, &remote, 0, 4096)])
                .unwrap();
        batch.fence_stream(&stream).unwrap();
        stream.record(&event).unwrap();
        while batch.status().is_none() {}
        let ended = std::time::Instant::now();
        while !event.is_complete().unwrap() {}
        fenced.push(ended.elapsed());
        let batch =
            w.ab.submit(&[Transfer::read(&gpu_region, 0, &remote, 0, 4096)])
                .unwrap();
        batch.wait(T).unwrap();
        let ended = std::time::Instant::now();
        stream.record(&event).unwrap();
        while !event.is_complete().unwrap() {}
        hosted.push(ended.elapsed());
    }
    for (what, mut v) in [("stream fence", fenced), ("host wait", hosted)] {
        v.sort();
        eprintln!(
            "fence delay ({what}): median {:?} p99 {:?}",
            v[v.len() / 2],
            v[v.len() * 99 / 100]
        );
    }
}

/// A gated batch on the real driver (`cuStreamWriteValue32` into the
/// engine's pinned word): a WRITE of GPU memory gated on a held stream that
/// first copies new bytes into it moves nothing while the stream is held,
/// and moves those bytes once released. Prints the delay from the
/// stream's write (seen by a spinning host thread on a marker the stream
/// writes just before the gate) to the batch being posted by the engine's
/// own thread, against a host thread that waits for the stream's event and
/// then submits (median and p99 of 200, 4 KiB WRITEs of host memory, so no
/// staging copy is timed): a measurement, not an assertion.
#[test]
fn a_gated_batch_on_the_real_gpu() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Instant;

    use gdr_core::buffer::Buffer;
    use gdr_core::descriptor::GrantRights;
    use gdr_core::engine::Transfer;
    use gdr_tests::engine_world::HeldStream;
    use hal_cuda::{Context as _, Driver as _, Event as _, Stream as _};

    let name = "a_gated_batch_on_the_real_gpu";
    let Some(w) = world(name, Policy::Fallback, true) else {
        return;
    };
    w.gated_write_after_a_held_stream(1 << 20, 21);

    let (_s, src) = w.a.alloc(Kind::Host, 4096, 3);
    let (_d, dst) = w.b.alloc(Kind::Host, 4096, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::Write);
    let write = [Transfer::write(&src, 0, &remote, 0, 4096)];
    let ctx = w.a.cuda.context(0).unwrap();
    let marker = Buffer::<CudaApi>::alloc_pinned(&ctx, 4096).unwrap();
    marker.write_at(0, &[0; 4]).unwrap();
    let held = HeldStream::<CudaApi>::new(&ctx);
    let event = ctx.create_event().unwrap();
    // SAFETY: the marker is pinned memory of this test (page aligned),
    // alive until the end (the stream is drained first: declared after);
    // host and device touch it only with aligned 32-bit accesses.
    let marker_word = unsafe { &*(marker.addr() as *const AtomicU32) };
    let posted = || -> u64 { w.ab.counters().iter().map(|(_, _, c)| c.posted).sum() };
    // The stream writes `value` to the marker, then is released; returns
    // when the host sees the write.
    let marked_release = |value: u32| {
        held.release();
        while marker_word.load(Ordering::Acquire) < value {
            std::hint::spin_loop();
        }
        Instant::now()
    };
    let mut gated = Vec::new();
    let mut hosted = Vec::new();
    for i in 1..=200u32 {
        // SAFETY: as above; the marker outlives the stream's work.
        unsafe { held.stream.write_value32(marker.addr(), 2 * i - 1) }.unwrap();
        let before = posted();
        let batch = w.ab.submit_after_stream(&held.stream, &write, T).unwrap();
        let written = marked_release(2 * i - 1);
        while posted() == before {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
        gated.push(written.elapsed());
        batch.wait(T).unwrap();
        held.hold();

        // SAFETY: as above.
        unsafe { held.stream.write_value32(marker.addr(), 2 * i) }.unwrap();
        held.stream.record(&event).unwrap();
        let written = marked_release(2 * i);
        while !event.is_complete().unwrap() {}
        let batch = w.ab.submit(&write).unwrap();
        hosted.push(written.elapsed());
        batch.wait(T).unwrap();
        held.hold();
    }
    for (what, mut v) in [("gate", gated), ("host wait", hosted)] {
        v.sort();
        eprintln!(
            "stream write to batch posted ({what}): median {:?} p99 {:?}",
            v[v.len() / 2],
            v[v.len() * 99 / 100]
        );
    }
}
