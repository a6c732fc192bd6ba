//! What a batch costs the process allocator: a thread submitting batches
//! of WRITEs of host memory and waiting for each (the scaling benchmark's
//! loop) makes a few allocations per batch, not per request. Each
//! allocation is a chance to meet another thread in the allocator (glibc's
//! frees past its per-thread cache take the arena's lock): the 16-core
//! machine's scaling benchmark lost most of one engine's rate there while
//! the simulator allocated per request. This binary's global allocator
//! counts what the calling thread allocates (`gdr_tests::alloc_count`).

use std::time::Duration;

use gdr_core::engine::{EngineConfig, Transfer};
use gdr_tests::alloc_count::{Counting, allocations_in};
use gdr_tests::engine_world::sim_host_peers;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Allocations a batch makes on the submitting thread (3 when this was
/// written: its outcome's cell and the flag a stream fence shares with
/// the engine, two `Arc`s, and one vector the submit pushes into).
const PER_BATCH: u64 = 3;

#[test]
fn a_batch_of_writes_allocates_a_few_times_not_per_request() {
    const T: Duration = Duration::from_secs(10);
    const BATCH: usize = 16;
    const SIZE: u64 = 4096;
    const BATCHES: u64 = 500;
    let peers = sim_host_peers(
        EngineConfig::default().with_default_timeout(T),
        BATCH as u64 * SIZE,
        T,
    );
    let transfers: Vec<Transfer<'_>> = (0..BATCH as u64)
        .map(|i| Transfer::write(&peers.local, i * SIZE, &peers.remote, i * SIZE, SIZE))
        .collect();
    let run = |batches: u64| {
        for _ in 0..batches {
            let batch = peers.a_to_b.submit(&transfers).expect("submit");
            batch.wait(T).expect("the batch");
        }
    };
    // Warm-up: queues, caches and first-use state grow here.
    run(50);
    let (made, ()) = allocations_in(|| run(BATCHES));
    // Room for the engine's periodic work that falls on this thread (its
    // pass, a millisecond apart), not for one more allocation a batch.
    let slack = BATCHES / 10;
    assert!(
        made <= PER_BATCH * BATCHES + slack,
        "{made} allocations over {BATCHES} batches of {BATCH} WRITEs: more than {PER_BATCH} a batch"
    );
}
