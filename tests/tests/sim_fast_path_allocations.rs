//! The fast path allocates nothing per request: a post of WRITEs that
//! completes at once, and the poll of its completion, make no heap
//! allocation in the steady state. A simulated NIC that allocated per
//! request would add the process allocator's locks between threads that
//! share nothing on a real NIC (glibc's arena locks: seen as threads
//! waiting in `free` on the 16-core machine's scaling benchmark).
//!
//! This binary's global allocator counts what the calling thread
//! allocates (`gdr_tests::alloc_count`). Run it without debug logging
//! (`RUST_LOG` unset): a log line the fast path writes allocates.

use hal_verbs::{AccessFlags, Completion, CompletionQueue as _, QpCaps, SendFlags};

use gdr_tests::alloc_count::{Counting, allocations_in};
use gdr_tests::pair::{Pair, PairConfig, SimBackend, req};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn a_post_of_writes_and_the_poll_of_its_completion_allocate_nothing() {
    const BATCH: usize = 16;
    const SIZE: usize = 4096;
    let backend = SimBackend::new("default", gdr_sim::DeviceConfig::default());
    let pair = Pair::with(
        &backend,
        PairConfig {
            caps: QpCaps {
                max_send_wr: 64,
                ..QpCaps::default()
            },
            ..PairConfig::default()
        },
    );
    let src = pair.a.buf(BATCH * SIZE, 1, AccessFlags::transfer());
    let dst = pair.b.buf(BATCH * SIZE, 2, AccessFlags::transfer());
    // One linked post, the last request signalled: the bare loop's batch.
    let batch: Vec<_> = (0..BATCH)
        .map(|i| {
            let flags = match i + 1 == BATCH {
                true => SendFlags::SIGNALED,
                false => SendFlags::empty(),
            };
            req(
                i as u64,
                dst.write_op(i * SIZE),
                &[src.sge(i * SIZE, SIZE)],
                flags,
            )
        })
        .collect();
    let mut slot = [Completion::default()];
    let mut round = || {
        Pair::<gdr_sim::SimVerbsApi>::post(&pair.qa, &batch);
        assert_eq!(
            pair.cqa.poll(&mut slot).unwrap(),
            1,
            "the batch completed in its post"
        );
        assert_eq!(slot[0].wr_id, (BATCH - 1) as u64);
    };
    // Warm-up: the CQ's ring and any first-use state grow here.
    for _ in 0..4 {
        round();
    }
    const ROUNDS: u64 = 100;
    let (made, ()) = allocations_in(|| {
        for _ in 0..ROUNDS {
            round();
        }
    });
    assert_eq!(
        made, 0,
        "{made} allocations over {ROUNDS} posts of {BATCH} WRITEs and their polls"
    );
    assert_eq!(dst.bytes(), src.bytes(), "the bytes landed");
}
