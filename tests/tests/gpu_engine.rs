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
