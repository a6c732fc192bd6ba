//! Batches awaited from tokio tasks, many at once (the async tests).

use std::future::Future;
use std::time::Duration;

use gdr_core::engine::Outcome;
use tokio::task::JoinSet;
use tokio::time::timeout;

/// Parts of different lengths (odd ones included) covering `len` bytes:
/// (offset, length) each, and `len`.
pub fn parts(count: u64) -> (Vec<(u64, u64)>, u64) {
    let mut parts = Vec::new();
    let mut offset = 0;
    for i in 0..count {
        let len = 4096 * (1 + i % 5) + (i * 7) % 13;
        parts.push((offset, len));
        offset += len;
    }
    (parts, offset)
}

/// Awaits every batch in a task of its own, all at once, each bounded by
/// `limit`; checks each ended, with success. `what` names them in
/// failures.
pub async fn await_each<F>(what: &'static str, batches: Vec<F>, limit: Duration)
where
    F: Future<Output = Outcome> + Send + 'static,
{
    let mut tasks = JoinSet::new();
    for (i, batch) in batches.into_iter().enumerate() {
        tasks.spawn(async move { (i, timeout(limit, batch).await) });
    }
    let mut ended = 0;
    while let Some(joined) = tasks.join_next().await {
        let (i, outcome) = joined.expect("an awaiting task");
        outcome
            .unwrap_or_else(|_| panic!("{what} {i}: never woken within {limit:?}"))
            .unwrap_or_else(|e| panic!("{what} {i}: {e}"));
        ended += 1;
    }
    assert!(ended > 0, "{what}: nothing awaited");
}
