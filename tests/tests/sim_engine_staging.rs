//! Staging-rung regions moved by the engine (simulated NICs and GPUs): GPU
//! memory that no NIC reaches (the ladder's policy allows only the staging
//! rung) on either side or both, against host, pinned and GPU memory,
//! WRITE and READ, data verified byte for byte; and the owner refusing a
//! rendezvous outside its grant's rights.

use std::time::Duration;

use gdr_core::descriptor::{GrantRights, Reach};
use gdr_core::engine::{EngineConfig, Transfer, TransferError};
use gdr_core::ladder::{LadderConfig, Policy, Rung};
use gdr_sim::{GpuConfig, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, Kind};
use gdr_tests::pattern;

const T: Duration = Duration::from_secs(10);

fn staging_world(qps: u16) -> EngineWorld<SimVerbsApi> {
    staging_world_with(qps, |_| {})
}

/// A world whose GPU memory takes only the staging rung, configured
/// further by `tune`.
fn staging_world_with(qps: u16, tune: impl FnOnce(&mut EngineConfig)) -> EngineWorld<SimVerbsApi> {
    let mut config = EngineConfig {
        qps_per_peer: qps,
        slice_size: 64 * 1024,
        default_timeout: T,
        ladder: LadderConfig {
            policy: Policy::Only(Rung::Staging),
            ..LadderConfig::default()
        },
        ..EngineConfig::default()
    };
    tune(&mut config);
    EngineWorld::sim(1, GpuConfig::default(), config, T)
}

/// Every pair of memory kinds where at least one side is staged GPU
/// memory: the local side through the pipeline (or a bounce buffer, on the
/// naive path), the remote side by rendezvous with its owner (served by
/// the owner's own progress thread: nothing here waits on the owner), the
/// transfers longer than the pool so slices take turns in its slots.
#[test]
fn staged_gpu_memory_moves_both_ways_against_every_kind() {
    for pipeline in [true, false] {
        every_kind_against_staged_gpu_memory(pipeline);
    }
}

fn every_kind_against_staged_gpu_memory(pipeline: bool) {
    const LEN: u64 = 200 * 1024 + 3;
    let w = staging_world_with(2, |c| {
        c.staging_pipeline = pipeline;
        c.staging_slice = 16 * 1024;
        c.staging_slots = 3;
    });
    // No driver for b, and b waits on nothing: granting a staged region
    // started b's own progress thread, which serves the rendezvous.
    let kinds = [Kind::Host, Kind::Pinned, Kind::Gpu];
    for (i, &from) in kinds.iter().enumerate() {
        for (j, &to) in kinds.iter().enumerate() {
            if from != Kind::Gpu && to != Kind::Gpu {
                continue;
            }
            let seed = (i * 3 + j) as u8 + 1;
            let what = if pipeline { "pipelined" } else { "naive" };
            let (src_rungs, _, remote) = w.write_and_read_back(from, to, LEN, seed, 2, what);
            if from == Kind::Gpu {
                assert_eq!(src_rungs, [Rung::Staging]);
            }
            assert_eq!(
                matches!(remote.reach, Reach::Staged),
                to == Kind::Gpu,
                "a staged region's grant says so: {remote:?}"
            );
        }
    }
}

/// A batch mixing a direct transfer and a rendezvous ends once both have,
/// awaited as a future too.
#[test]
fn a_batch_mixing_direct_and_staged_transfers_ends_once_both_have() {
    const LEN: u64 = 64 * 1024;
    let w = staging_world(1);
    let _b_driver = w.b.engine.spawn_driver(Duration::from_millis(1));
    let (_s, src) = w.a.alloc(Kind::Host, 2 * LEN, 7);
    let (host_buf, host) = w.b.alloc(Kind::Host, LEN, 0);
    let (gpu_buf, gpu) = w.b.alloc(Kind::Gpu, LEN, 0);
    let (_g1, to_host) = w.b_grants(&host, GrantRights::Write);
    let (_g2, to_gpu) = w.b_grants(&gpu, GrantRights::Write);
    let batch =
        w.ab.submit(&[
            Transfer::write(&src, 0, &to_host, 0, LEN),
            Transfer::write(&src, LEN, &to_gpu, 0, LEN),
        ])
        .unwrap();
    futures_lite_block_on(batch).unwrap();
    let all = pattern(2 * LEN as usize, 7);
    assert!(
        w.b.bytes(&host_buf) == all[..LEN as usize],
        "the direct part"
    );
    assert!(
        w.b.bytes(&gpu_buf) == all[LEN as usize..],
        "the staged part"
    );
}

/// The owner checks a rendezvous against its grant: a WRITE into a
/// read-only staged grant is refused before anything is posted here, and a
/// grant revoked meanwhile is refused by the owner (typed, nothing moved).
#[test]
fn the_owner_refuses_a_rendezvous_its_grant_does_not_cover() {
    const LEN: u64 = 16 * 1024;
    let w = staging_world(1);
    let _b_driver = w.b.engine.spawn_driver(Duration::from_millis(1));
    let (_s, src) = w.a.alloc(Kind::Host, LEN, 9);
    let (gpu_buf, gpu) = w.b.alloc(Kind::Gpu, LEN, 0);
    let (read_only, remote) = w.b_grants(&gpu, GrantRights::Read);
    let err =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
            .unwrap_err();
    assert!(
        matches!(err, gdr_core::engine::EngineError::AccessDenied { .. }),
        "{err}"
    );
    // Revoked at the owner, the notice not yet read here: the owner says no.
    drop(read_only);
    let (back_buf, back) = w.a.alloc(Kind::Host, LEN, 0);
    // (a has made no progress since: the revocation notice is unread, so
    // the request goes out and the owner refuses it.)
    let err =
        w.ab.submit(&[Transfer::read(&back, 0, &remote, 0, LEN)])
            .unwrap()
            .wait(T)
            .unwrap_err();
    assert!(
        matches!(err, TransferError::StagedRefused { status: 1, .. }),
        "{err}"
    );
    // What each held before (the worlds fill fresh memory with seed 0).
    assert!(
        w.a.bytes(&back_buf) == pattern(LEN as usize, 0),
        "nothing moved into a's memory"
    );
    assert!(
        w.b.bytes(&gpu_buf) == pattern(LEN as usize, 0),
        "nothing moved into b's GPU memory"
    );
}

/// Drives a future to completion on this thread (no runtime needed: the
/// batch wakes itself while no driver runs on its engine).
fn futures_lite_block_on<F: std::future::Future>(future: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(out) => return out,
            Poll::Pending => std::thread::park_timeout(Duration::from_millis(1)),
        }
    }
}

/// Sizes from one byte to several pools' worth, including non-multiples of
/// the slice: each WRITE and READ of staged GPU memory against host memory
/// arrives whole.
#[test]
fn pipelined_sizes_from_one_byte_up() {
    let w = staging_world_with(1, |c| {
        c.staging_slice = 8 * 1024;
        c.staging_slots = 2;
    });
    for (i, len) in [
        1u64,
        4095,
        8 * 1024,
        8 * 1024 + 1,
        3 * 8 * 1024 - 7,
        1 << 20,
    ]
    .into_iter()
    .enumerate()
    {
        w.write_and_read_back(
            Kind::Gpu,
            Kind::Host,
            len,
            i as u8 + 1,
            2,
            &format!("{len} B"),
        );
    }
}

/// Many staged transfers at once through a pool of two slots: each waits
/// its turn (back-pressure), none fails for want of a slot, all arrive.
#[test]
fn a_busy_pool_makes_transfers_wait_not_fail() {
    const PART: u64 = 96 * 1024 + 5;
    const PARTS: u64 = 12;
    let w = staging_world_with(2, |c| {
        c.staging_slice = 16 * 1024;
        c.staging_slots = 2;
    });
    let (_s, src) = w.a.alloc(Kind::Gpu, PART * PARTS, 6);
    let (dst_buf, dst) = w.b.alloc(Kind::Host, PART * PARTS, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::Write);
    // One batch per part, all submitted before any is waited for.
    let batches: Vec<_> = (0..PARTS)
        .map(|i| {
            w.ab.submit(&[Transfer::write(&src, i * PART, &remote, i * PART, PART)])
                .unwrap()
        })
        .collect();
    for (i, batch) in batches.iter().enumerate() {
        batch.wait(T).unwrap_or_else(|e| panic!("part {i}: {e}"));
    }
    assert!(
        w.b.bytes(&dst_buf) == pattern((PART * PARTS) as usize, 6),
        "every part arrived"
    );
}

/// A CUDA copy that fails fails only its transfer: the other transfer of
/// the same batch's neighbours, and later transfers, go through.
#[test]
fn a_failed_staging_copy_fails_only_its_transfer() {
    use gdr_sim::{Fault, FaultSite};
    const LEN: u64 = 64 * 1024;
    let w = staging_world_with(1, |c| {
        c.staging_slice = 16 * 1024;
        c.staging_slots = 2;
    });
    let (_s, src) = w.a.alloc(Kind::Gpu, LEN, 8);
    let (dst_buf, dst) = w.b.alloc(Kind::Host, LEN, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::Write);
    // Warm the pool (its first use allocates and registers it).
    w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, 1)])
        .unwrap()
        .wait(T)
        .unwrap();
    let failure = hal_cuda::CudaError::Driver {
        operation: "cuMemcpyDtoHAsync",
        code: 700,
        name: "CUDA_ERROR_ILLEGAL_ADDRESS",
    };
    w.fabric()
        .faults()
        .fail_next(FaultSite::CudaCopy, Fault::Cuda(failure));
    let failed =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
            .unwrap();
    let other =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
            .unwrap();
    let err = failed.wait(T).unwrap_err();
    assert!(
        matches!(&err, TransferError::Local { what } if what.contains("staging copy")),
        "{err}"
    );
    other
        .wait(T)
        .unwrap_or_else(|e| panic!("the other transfer: {e}"));
    assert!(w.b.bytes(&dst_buf) == pattern(LEN as usize, 8));
}

/// The pipeline's slices in flight spread over the peer's queue pairs
/// (each slot's slice on its own), not all on the first one.
#[test]
fn pipelined_slices_spread_over_the_queue_pairs() {
    const LEN: u64 = 256 * 1024;
    let w = staging_world_with(4, |c| {
        c.staging_slice = 16 * 1024;
        c.staging_slots = 4;
    });
    let before = w.ab.counters();
    w.write_and_read_back(Kind::Gpu, Kind::Host, LEN, 5, 1, "spread");
    let after = w.ab.counters();
    let moved: Vec<u64> = before
        .iter()
        .zip(&after)
        .map(|((_, _, b), (_, _, a))| a.posted - b.posted)
        .collect();
    assert!(
        moved.iter().all(|&n| n > 0),
        "slices per queue pair: {moved:?}"
    );
    assert_eq!(
        moved.iter().sum::<u64>(),
        2 * LEN / (16 * 1024),
        "{moved:?}"
    );
}
