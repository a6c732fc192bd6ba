//! Staging-rung regions moved by the engine (simulated NICs and GPUs): GPU
//! memory that no NIC reaches (the ladder's policy allows only the staging
//! rung) on either side or both, against host, pinned and GPU memory,
//! WRITE and READ, data verified byte for byte; and the owner refusing a
//! rendezvous outside its grant's rights, or not through its landing
//! slots.

use std::time::Duration;

use gdr_core::descriptor::{GrantRights, Reach};
use gdr_core::engine::wire::Control;
use gdr_core::engine::{EngineConfig, EngineError, PeerLimits, Transfer, TransferError};
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
    let mut config = EngineConfig::default()
        .with_qps_per_peer(qps)
        .with_slice_size(64 * 1024)
        .with_default_timeout(T)
        .with_ladder(LadderConfig::default().with_policy(Policy::Only(Rung::Staging)));
    tune(&mut config);
    EngineWorld::sim(1, GpuConfig::default(), config, T)
}

/// Every pair of memory kinds where at least one side is staged GPU
/// memory: the local side through the pipeline, the remote side by
/// rendezvous with its owner (served by the owner's own progress thread:
/// nothing here waits on the owner), the transfers longer than the pool so
/// slices take turns in its slots.
#[test]
fn staged_gpu_memory_moves_both_ways_against_every_kind() {
    const LEN: u64 = 200 * 1024 + 3;
    let w = staging_world_with(2, |c| {
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
            let (src_rungs, _, remote) = w.write_and_read_back(from, to, LEN, seed, 2, "pipelined");
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
    let _b_driver = w.b.engine.spawn_driver().unwrap();
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

/// Issue 33, item 8: a batch mixing staged and direct transfers posted its
/// staged part first; when its direct part then failed (here a grant whose
/// descriptor names no segment on the device the queue pair reaches),
/// `submit` returned `Err` while the staged bytes kept moving. Every part
/// is now resolved before any starts: on `Err` nothing moved.
#[test]
fn a_mixed_batch_whose_direct_part_fails_starts_nothing() {
    use gdr_core::descriptor::{MemoryDescriptor, MemoryLocation, Segment};
    const LEN: u64 = 64 * 1024;
    let w = staging_world(1);
    let (_g, gpu_src) = w.a.alloc(Kind::Gpu, LEN, 7);
    let (_h, host_src) = w.a.alloc(Kind::Host, LEN, 8);
    let (dst_buf, dst) = w.b.alloc(Kind::Host, LEN, 0);
    let (_grant, to_host) = w.b_grants(&dst, GrantRights::Write);
    // A grant of b's whose only segment is on a NIC a reaches none of.
    let forged = MemoryDescriptor {
        owner: w.b.engine.id(),
        grant: to_host.grant + 1000,
        location: MemoryLocation::Host,
        rights: GrantRights::Write,
        len: LEN,
        reach: Reach::Direct(vec![Segment {
            offset: 0,
            len: LEN,
            addr: 0x1000,
            rkey: 1,
            device: "nic9".into(),
        }]),
    };
    let encoded = forged.encode().unwrap();
    w.ba.send_raw_control(&Control::GrantAnnounce {
        descriptor: &encoded,
    })
    .unwrap()
    .wait(T)
    .unwrap();
    let forged = w.ab.wait_grant(forged.grant, T).unwrap();
    let before = w.b.bytes(&dst_buf);
    let posted = gdr_tests::engine_world::posted(&w.ab);
    let err =
        w.ab.submit(&[
            Transfer::write(&gpu_src, 0, &to_host, 0, LEN),
            Transfer::write(&host_src, 0, &forged, 0, LEN),
        ])
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(err, EngineError::Descriptor(_)),
        "the direct part's missing segment: {err}"
    );
    // Whatever would move, would move with progress.
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_millis(300) {
        w.a.engine.progress();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        w.b.bytes(&dst_buf) == before,
        "bytes of the staged part landed though submit returned Err"
    );
    assert_eq!(
        gdr_tests::engine_world::posted(&w.ab),
        posted,
        "a's queue pairs posted work for a batch refused"
    );
    let held = w.a.engine.resources();
    assert_eq!(
        (held.staged_transfers, held.staged_groups, held.batches),
        (0, 0, 0),
        "a holds work of a batch refused"
    );
}

/// The owner checks a rendezvous against its grant: a WRITE into a
/// read-only staged grant is refused before anything is posted here, and a
/// grant revoked meanwhile is refused by the owner (typed, nothing moved).
#[test]
fn the_owner_refuses_a_rendezvous_its_grant_does_not_cover() {
    const LEN: u64 = 16 * 1024;
    let w = staging_world(1);
    let _b_driver = w.b.engine.spawn_driver().unwrap();
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
    const LEN: u64 = 64 * 1024;
    let w = staging_world_with(1, |c| {
        c.staging_slice = 16 * 1024;
        c.staging_slots = 2;
    });
    let (_s, src) = w.a.alloc(Kind::Gpu, LEN, 8);
    let (dst_buf, dst) = w.b.alloc(Kind::Host, LEN, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::Write);
    // Warm the pool (its first use allocates and registers it).
    warm_then_fail_next_copy(&w, &src, &remote, "cuMemcpyDtoHAsync");
    let failed =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
            .unwrap();
    let other =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
            .unwrap();
    let err = failed.wait(T).unwrap_err();
    assert!(
        matches!(&err, TransferError::Gpu { what, .. } if what.starts_with("staging copy")),
        "{err}"
    );
    other
        .wait(T)
        .unwrap_or_else(|e| panic!("the other transfer: {e}"));
    assert!(w.b.bytes(&dst_buf) == pattern(LEN as usize, 8));
}

/// WRITEs one byte of `src` into `remote` (so the staging pool or the
/// owner's landing slots exist), then scripts the next CUDA copy to fail
/// as `operation` with an illegal address.
fn warm_then_fail_next_copy(
    w: &EngineWorld<SimVerbsApi>,
    src: &gdr_core::engine::Region,
    remote: &gdr_core::descriptor::MemoryDescriptor,
    operation: &'static str,
) {
    use gdr_sim::{Fault, FaultSite};
    w.ab.submit(&[Transfer::write(src, 0, remote, 0, 1)])
        .unwrap()
        .wait(T)
        .unwrap();
    let failure = hal_cuda::CudaError::Driver {
        operation,
        code: 700,
        name: "CUDA_ERROR_ILLEGAL_ADDRESS",
    };
    w.fabric()
        .faults()
        .fail_next(FaultSite::CudaCopy, Fault::Cuda(failure));
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

/// The first request id a requester gives its slotted rendezvous on a
/// peer is this plus one, then counting up (the engine's choice, relied on
/// here to forge messages about a request in flight).
const FIRST_ASK: u64 = (1 << 63) + 1;

/// A world for the landing slots: small slices (4 KiB, the least) so that
/// a few KiB go in many turns through 4 slots on the owner and 2 in each
/// side's own pool.
fn slots_world() -> EngineWorld<SimVerbsApi> {
    staging_world_with(2, |c| {
        c.staging_slice = 4096;
        c.staging_slots = 2;
        c.rendezvous_slots = 4;
    })
}

/// Through the owner's landing slots, both directions: host → staged GPU
/// and staged GPU → staged GPU (WRITE, then READ back), 1 byte, odd sizes
/// and several times slots × slice, data verified; and the requester makes
/// no grant of its own for any of it (its grant ids run on uninterrupted).
#[test]
fn rendezvous_through_landing_slots_moves_every_size_without_a_temporary_grant() {
    let w = slots_world();
    let probe = |seed| {
        let (buf, region) = w.a.alloc(Kind::Host, 64, seed);
        let grant = w.ab.grant(&region, 0, 64, GrantRights::Read).unwrap();
        (grant.descriptor().grant, buf, region)
    };
    let (before, _b1, _r1) = probe(1);
    let sizes = [1u64, 4095, 4097, 12_345, 3 * 4 * 4096 + 5];
    for (i, len) in sizes.into_iter().enumerate() {
        for from in [Kind::Host, Kind::Gpu] {
            let what = format!("slots {len} B from {from:?}");
            let (_, dst_rungs, remote) =
                w.write_and_read_back(from, Kind::Gpu, len, i as u8 + 2, 2, &what);
            assert_eq!(dst_rungs, [Rung::Staging]);
            assert!(matches!(remote.reach, Reach::Staged));
        }
    }
    let (after, _b2, _r2) = probe(2);
    assert_eq!(
        after,
        before + 1,
        "the requester granted nothing between its two grants"
    );
}

/// The contrast that shows the probe above can see a temporary grant: a
/// grant made between its two grants (here by the test itself, beside a
/// rendezvous; the naive rendezvous, no longer the engine's, made one per
/// request) shows in their ids.
#[test]
fn the_probe_sees_a_grant_made_between_its_two_grants() {
    let w = staging_world(1);
    let (_s, src) = w.a.alloc(Kind::Host, 64, 1);
    let first = w.ab.grant(&src, 0, 64, GrantRights::Read).unwrap();
    w.write_and_read_back(Kind::Host, Kind::Gpu, 8192, 3, 1, "slots");
    let _between = w.ab.grant(&src, 0, 64, GrantRights::Read).unwrap();
    let second = w.ab.grant(&src, 0, 64, GrantRights::Read).unwrap();
    assert!(
        second.descriptor().grant > first.descriptor().grant + 1,
        "a grant between the probes"
    );
}

/// A request not through landing slots (`slots: false`: the naive
/// rendezvous against the requester's grant, which the engine no longer
/// serves; an older or a hostile peer may still send one) is refused at
/// once with ACCESS_DENIED (status 2), and nothing of it is kept. The
/// status is seen through a request of the requester's own in flight with
/// the same id (the owner's answer ends it); then more such requests than
/// the owner serves at once leave it serving an honest request at once
/// (kept ones would make it BUSY, as in `sim_engine_bounds`).
#[test]
fn a_request_not_through_landing_slots_is_refused_and_nothing_kept() {
    let limits = PeerLimits {
        max_staged_requests: 2,
        staged_request_timeout: Duration::from_millis(500),
        ..PeerLimits::default()
    };
    let w = staging_world_with(2, |c| {
        c.staging_slice = 4096;
        c.staging_slots = 2;
        c.rendezvous_slots = 4;
        c.peer_limits = limits;
    });
    let (_s, src) = w.a.alloc(Kind::Host, 4096, 8);
    let (dst_buf, dst) = w.b.alloc(Kind::Gpu, 4096, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::ReadWrite);
    let naive = |id, write| Control::StagedRequest {
        id,
        grant: remote.grant,
        offset: 0,
        len: 4096,
        write,
        slots: false,
    };
    // After the request on the same queue pair: the owner refuses the
    // forged one before the honest one can end.
    let batch =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, 4096)])
            .unwrap();
    w.ab.send_raw_control(&naive(FIRST_ASK, true)).unwrap();
    let err = batch.wait(T).unwrap_err();
    assert!(
        matches!(err, TransferError::StagedRefused { status: 2, .. }),
        "refused ACCESS_DENIED: {err}"
    );
    // Ids the requester does not know: the answers are dropped there.
    for id in 1..=2 * limits.max_staged_requests as u64 + 1 {
        w.ab.send_raw_control(&naive(id, id % 2 == 0))
            .unwrap()
            .wait(T)
            .unwrap();
    }
    let sent = std::time::Instant::now();
    w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, 4096)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(
        sent.elapsed() < limits.staged_request_timeout,
        "served at once, not after anything expired"
    );
    assert!(w.b.bytes(&dst_buf) == pattern(4096, 8), "served on");
}

/// Several requests at once from two peers into one owner's staged GPU
/// memory (each peer through its own slots), larger than the slots: each
/// waits its turn, all arrive.
#[test]
fn two_peers_and_many_requests_share_one_owner() {
    const PART: u64 = 5 * 4096 + 77;
    const PARTS: u64 = 6;
    let w = slots_world();
    let config = w.a.engine.config().clone();
    let (c, cb, bc) = w.connect_another_to_b("c", config);
    let (dst_buf, dst) = w.b.alloc(Kind::Gpu, 2 * PART * PARTS, 0);
    let (_ga, to_a) = w.b_grants(&dst, GrantRights::Write);
    let (_gc, to_c) = gdr_tests::engine_world::grant_to(&bc, &cb, &dst, GrantRights::Write, T);
    let (_sa, from_a) = w.a.alloc(Kind::Gpu, 2 * PART * PARTS, 4);
    let (_sc, from_c) = c.alloc(Kind::Host, 2 * PART * PARTS, 4);
    // a writes the even parts, c the odd ones, all in flight at once.
    let mut batches = Vec::new();
    for i in 0..2 * PARTS {
        let at = i * PART;
        batches.push(if i % 2 == 0 {
            w.ab.submit(&[Transfer::write(&from_a, at, &to_a, at, PART)])
                .unwrap()
        } else {
            cb.submit(&[Transfer::write(&from_c, at, &to_c, at, PART)])
                .unwrap()
        });
    }
    for (i, batch) in batches.iter().enumerate() {
        batch.wait(T).unwrap_or_else(|e| panic!("part {i}: {e}"));
    }
    assert!(
        w.b.bytes(&dst_buf) == pattern((2 * PART * PARTS) as usize, 4),
        "every part of both peers arrived"
    );
}

/// A CUDA copy failing at the owner fails the one request whose slice it
/// was; the other request in flight, and a later one, go through (the
/// failed request's slots came back).
#[test]
fn a_failed_landing_copy_fails_only_its_request() {
    const LEN: u64 = 8 * 4096;
    let w = slots_world();
    let (_s, src) = w.a.alloc(Kind::Host, 2 * LEN, 8);
    let (dst_buf, dst) = w.b.alloc(Kind::Gpu, 2 * LEN, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::Write);
    // Warm: the owner's slots exist (the failure lands on a slice copy).
    warm_then_fail_next_copy(&w, &src, &remote, "cuMemcpyHtoDAsync");
    let halves: Vec<_> = [0, LEN]
        .iter()
        .map(|&at| {
            w.ab.submit(&[Transfer::write(&src, at, &remote, at, LEN)])
                .unwrap()
        })
        .collect();
    let outcomes: Vec<_> = halves.iter().map(|b| b.wait(T)).collect();
    let failed: Vec<usize> = (0..2).filter(|&i| outcomes[i].is_err()).collect();
    assert_eq!(failed.len(), 1, "exactly one request failed: {outcomes:?}");
    assert!(
        matches!(
            outcomes[failed[0]],
            Err(TransferError::StagedRefused { status: 4, .. })
        ),
        "{outcomes:?}"
    );
    let ok = 1 - failed[0];
    let range = |i: usize| (i as u64 * LEN) as usize..((i as u64 + 1) * LEN) as usize;
    let whole = pattern((2 * LEN) as usize, 8);
    assert!(
        w.b.bytes(&dst_buf)[range(ok)] == whole[range(ok)],
        "the other request's data"
    );
    // Again, the failed half: every slot is usable again.
    let again = failed[0] as u64 * LEN;
    w.ab.submit(&[Transfer::write(&src, again, &remote, again, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(w.b.bytes(&dst_buf) == whole, "all of it after the retry");
}

/// A requester past its deadline fails with `Timeout` (once), tells the
/// owner, and the owner's slots serve the next request.
#[test]
fn a_late_rendezvous_times_out_and_frees_its_slots() {
    const LEN: u64 = 6 * 4096;
    let w = slots_world();
    let (_s, src) = w.a.alloc(Kind::Host, LEN, 5);
    let (dst_buf, dst) = w.b.alloc(Kind::Gpu, LEN, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::Write);
    w.fabric().set_paused(true);
    let late =
        w.ab.submit_with_timeout(
            &[Transfer::write(&src, 0, &remote, 0, LEN)],
            Duration::from_millis(50),
        )
        .unwrap();
    let err = late.wait(T).unwrap_err();
    assert!(matches!(err, TransferError::Timeout(_)), "{err}");
    // Ended by its own deadline (the requester's protocol, through the
    // connection), not by the wait giving up.
    assert!(
        matches!(late.status(), Some(Err(TransferError::Timeout(_)))),
        "the batch has not ended: {:?}",
        late.status()
    );
    w.fabric().set_paused(false);
    assert!(
        matches!(late.wait(T), Err(TransferError::Timeout(_))),
        "the outcome stays"
    );
    w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(w.b.bytes(&dst_buf) == pattern(LEN as usize, 5));
}

/// A hostile requester's slot credits are checked by the owner: a
/// `SlotFilled` for a slot not lent, a slot out of range, a `SlotDone` on
/// a WRITE each fail the request they name (`StagedRefused` 5) and no copy
/// runs from the slot (the GPU memory keeps what it held); credits for an
/// unknown request are dropped; the engine serves on.
#[test]
fn the_owner_refuses_forged_slot_credits() {
    let w = slots_world();
    let (_s, src) = w.a.alloc(Kind::Host, 4096, 6);
    let (dst_buf, dst) = w.b.alloc(Kind::Gpu, 4096, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::Write);
    let (warm_buf, warm) = w.b.alloc(Kind::Gpu, 4096, 0);
    let (_gw, to_warm) = w.b_grants(&warm, GrantRights::Write);
    // Request FIRST_ASK: slot 0 of the owner holds its data afterwards.
    w.ab.submit(&[Transfer::write(&src, 0, &to_warm, 0, 4096)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(w.b.bytes(&warm_buf) == pattern(4096, 6));
    type Forge = fn(u64) -> Control<'static>;
    let forgeries: [(&str, Forge); 3] = [
        ("a slot not lent", |id| Control::SlotFilled { id, slot: 3 }),
        ("a slot out of range", |id| Control::SlotFilled {
            id,
            slot: 99,
        }),
        ("a SlotDone on a WRITE", |id| Control::SlotDone {
            id,
            slot: 0,
        }),
    ];
    for (i, (what, forge)) in forgeries.into_iter().enumerate() {
        let id = FIRST_ASK + 1 + i as u64;
        let batch =
            w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, 4096)])
                .unwrap();
        // After the request on the same queue pair: the owner reads it
        // before any honest credit of it.
        w.ab.send_raw_control(&forge(id)).unwrap();
        let err = batch.wait(T).unwrap_err();
        assert!(
            matches!(err, TransferError::StagedRefused { status: 5, .. }),
            "{what}: {err}"
        );
        assert!(
            w.b.bytes(&dst_buf) == pattern(4096, 0),
            "{what}: nothing copied into the GPU"
        );
    }
    // Credits for requests that do not exist: dropped.
    for message in [
        Control::SlotFilled {
            id: FIRST_ASK + 999,
            slot: 0,
        },
        Control::SlotDone { id: 7, slot: 1 },
        Control::StagedCancel { id: 12 },
    ] {
        w.ab.send_raw_control(&message).unwrap().wait(T).unwrap();
    }
    w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, 4096)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(w.b.bytes(&dst_buf) == pattern(4096, 6), "served on");
}

/// Cancelling a batch reaches its staged parts: a WRITE through the
/// owner's landing slots and a WRITE of this side's staged GPU memory
/// through its pool, both held on the paused fabric, end `Cancelled`
/// exactly once after the fabric resumes (their slices in flight drained);
/// the slots and the pool serve the next transfers.
#[test]
fn a_cancelled_batch_cancels_its_staged_parts() {
    const LEN: u64 = 6 * 4096;
    let w = slots_world();
    let (_s, src) = w.a.alloc(Kind::Host, LEN, 5);
    let (_gs, gpu_src) = w.a.alloc(Kind::Gpu, LEN, 6);
    let (dst_buf, dst) = w.b.alloc(Kind::Gpu, LEN, 0);
    let (host_buf, host_dst) = w.b.alloc(Kind::Host, LEN, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::Write);
    let (_h, to_host) = w.b_grants(&host_dst, GrantRights::Write);
    w.fabric().set_paused(true);
    let through_slots =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
            .unwrap();
    let through_pool =
        w.ab.submit(&[Transfer::write(&gpu_src, 0, &to_host, 0, LEN)])
            .unwrap();
    through_slots.cancel();
    through_pool.cancel();
    w.fabric().set_paused(false);
    for (what, batch) in [("slots", &through_slots), ("pool", &through_pool)] {
        let outcome = batch.wait(T);
        assert_eq!(outcome, Err(TransferError::Cancelled), "{what}");
        assert_eq!(batch.wait(T), outcome, "{what}: the outcome stays");
    }
    w.ab.submit(&[
        Transfer::write(&src, 0, &remote, 0, LEN),
        Transfer::write(&gpu_src, 0, &to_host, 0, LEN),
    ])
    .unwrap()
    .wait(T)
    .unwrap();
    assert!(
        w.b.bytes(&dst_buf) == pattern(LEN as usize, 5),
        "slots serve on"
    );
    assert!(
        w.b.bytes(&host_buf) == pattern(LEN as usize, 6),
        "the pool serves on"
    );
}

/// A peer's grants of staged GPU memory (served by rendezvous: the staged
/// path's part of that peer lives in the peer's slot) are made, announced
/// and revoked under the peer's lock alone: while another thread holds the
/// engine's lock, as grants of memory the NIC reaches are
/// (`sim_engine::a_peers_batches_run_while_the_engines_lock_is_held`).
#[test]
fn staged_grants_are_made_and_revoked_while_the_engines_lock_is_held() {
    const LEN: u64 = 64 * 1024;
    // Peer copy off: GPU memory it may export is the engine's to revoke.
    let w = staging_world_with(1, |c| c.peer_copy = false);
    let (_buf, gpu) = w.b.alloc(Kind::Gpu, LEN, 0);
    let ((), in_time) = w.b.while_engine_lock_held(Duration::from_secs(3), || {
        for _ in 0..4 {
            let grant = w.ba.grant(&gpu, 0, LEN, GrantRights::ReadWrite).unwrap();
            assert!(matches!(grant.descriptor().reach, Reach::Staged));
            grant.revoke(T).unwrap();
        }
    });
    assert!(
        in_time,
        "a staged grant or its revoke waited for the engine's lock"
    );
}

/// A staged submit (the staged path's part of the peer is in its slot,
/// the staging pools under a lock of their own) takes the peer's lock
/// alone: a's batches through its own GPU's pool and through b's landing
/// slots are submitted while another thread holds a's engine lock, and
/// move once progress (which needs it) runs again.
#[test]
fn staged_submits_are_taken_while_the_engines_lock_is_held() {
    const LEN: u64 = 64 * 1024;
    let w = staging_world_with(2, |c| c.peer_copy = false);
    let _b_driver = w.b.engine.spawn_driver().unwrap();
    let (_s, staged_src) = w.a.alloc(Kind::Gpu, LEN, 3);
    let (_h, host_src) = w.a.alloc(Kind::Host, LEN, 4);
    let (host_buf, host) = w.b.alloc(Kind::Host, LEN, 0);
    let (gpu_buf, gpu) = w.b.alloc(Kind::Gpu, LEN, 0);
    let (_g1, to_host) = w.b_grants(&host, GrantRights::Write);
    let (_g2, to_gpu) = w.b_grants(&gpu, GrantRights::Write);
    // The pool and the landing slots are made by a first round.
    let warm = [
        Transfer::write(&staged_src, 0, &to_host, 0, LEN),
        Transfer::write(&host_src, 0, &to_gpu, 0, LEN),
    ];
    w.ab.submit(&warm).unwrap().wait(T).unwrap();
    let (batches, in_time) = w.a.while_engine_lock_held(Duration::from_secs(3), || {
        [
            Transfer::write(&staged_src, 0, &to_host, 0, LEN),
            Transfer::write(&host_src, 0, &to_gpu, 0, LEN),
        ]
        .map(|t| w.ab.submit(&[t]).unwrap())
    });
    assert!(in_time, "a staged submit waited for the engine's lock");
    for batch in batches {
        batch.wait(T).unwrap();
    }
    assert_eq!(w.b.bytes(&host_buf), pattern(LEN as usize, 3));
    assert_eq!(w.b.bytes(&gpu_buf), pattern(LEN as usize, 4));
}
