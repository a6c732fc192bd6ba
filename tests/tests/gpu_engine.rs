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
