//! The transfer engine awaited under tokio (simulated NICs): batches are
//! runtime-agnostic `Future`s, and with a driver thread per engine
//! ([`gdr_core::engine::Engine::spawn_driver`]) many of them in flight at
//! once, from many tasks, each end with their own outcome, on a
//! multi-threaded and on a current-thread runtime; a batch that fails
//! (its deadline passes) ends its future with the typed error.
//!
//! Worlds are built before the runtime (connecting and waiting for a grant
//! block); only awaiting runs on it. Every await is bounded by a tokio
//! timeout, so a future that is never woken fails the test instead of
//! hanging it.

use std::time::Duration;

use gdr_core::descriptor::GrantRights;
use gdr_core::engine::{EngineConfig, Transfer, TransferError};
use gdr_sim::{GpuConfig, SimVerbsApi};
use gdr_tests::awaiting::{await_each, parts};
use gdr_tests::engine_world::EngineWorld;
use gdr_tests::pattern;
use tokio::runtime::{Builder, Runtime};
use tokio::time::timeout;

const T: Duration = Duration::from_secs(10);

fn world(qps: u16) -> EngineWorld<SimVerbsApi> {
    let config = EngineConfig::default()
        .with_qps_per_peer(qps)
        .with_slice_size(16 * 1024)
        .with_default_timeout(T);
    EngineWorld::sim(1, GpuConfig::default(), config, T)
}

fn multi_thread() -> Runtime {
    Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()
        .unwrap()
}

fn current_thread() -> Runtime {
    Builder::new_current_thread().enable_time().build().unwrap()
}

/// `count` WRITEs from a to b of parts of different lengths, submitted
/// together, each awaited in a task of its own, all at once, every outcome
/// checked; b holds a's bytes. Then the same parts READ back into other
/// memory of a, two transfers a batch, checked alike; a holds them again.
fn concurrent_writes_then_reads(rt: &Runtime, count: u64) {
    let w = world(4);
    let (parts, len) = parts(count);
    let h = w.host_pair(len, 3, GrantRights::ReadWrite);
    let (back_buf, back) = w.a.host(len, 9);
    let _drivers = (
        w.a.engine.spawn_driver().unwrap(),
        w.b.engine.spawn_driver().unwrap(),
    );
    let writes = parts
        .iter()
        .map(|&(offset, len)| {
            w.ab.submit(&[Transfer::write(&h.src, offset, &h.remote, offset, len)])
                .unwrap()
        })
        .collect();
    rt.block_on(await_each("WRITE", writes, T));
    assert_eq!(
        w.b.bytes(&h.dst_buf),
        pattern(len as usize, 3),
        "b holds every part where a wrote it"
    );
    let reads = parts
        .iter()
        .map(|&(offset, len)| {
            let half = len / 2;
            w.ab.submit(&[
                Transfer::read(&back, offset, &h.remote, offset, half),
                Transfer::read(&back, offset + half, &h.remote, offset + half, len - half),
            ])
            .unwrap()
        })
        .collect();
    rt.block_on(await_each("READ", reads, T));
    assert_eq!(
        w.a.bytes(&back_buf),
        pattern(len as usize, 3),
        "a read back every part where it wrote it"
    );
}

#[test]
fn many_batches_awaited_at_once_on_a_multi_thread_runtime() {
    concurrent_writes_then_reads(&multi_thread(), 64);
}

#[test]
fn many_batches_awaited_at_once_on_a_current_thread_runtime() {
    concurrent_writes_then_reads(&current_thread(), 64);
}

/// Batches awaited together in one task (`join!`), WRITEs and READs of
/// disjoint ranges mixed, each outcome checked.
#[test]
fn batches_joined_in_one_task() {
    let w = world(2);
    const LEN: u64 = 1 << 18;
    let h = w.host_pair(LEN, 5, GrantRights::ReadWrite);
    let (back_buf, back) = w.a.host(LEN, 0);
    let _drivers = (
        w.a.engine.spawn_driver().unwrap(),
        w.b.engine.spawn_driver().unwrap(),
    );
    let half = LEN / 2;
    // First half WRITTEN, then, joined: the second half WRITTEN and the
    // first READ back.
    let first =
        w.ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, half)])
            .unwrap();
    current_thread().block_on(async {
        timeout(T, first).await.unwrap().unwrap();
        let second =
            w.ab.submit(&[Transfer::write(&h.src, half, &h.remote, half, half)])
                .unwrap();
        let read =
            w.ab.submit(&[Transfer::read(&back, 0, &h.remote, 0, half)])
                .unwrap();
        let (second, read) = tokio::join!(timeout(T, second), timeout(T, read));
        second.expect("the second WRITE was woken").unwrap();
        read.expect("the READ was woken").unwrap();
    });
    assert_eq!(w.b.bytes(&h.dst_buf), pattern(LEN as usize, 5));
    assert_eq!(
        w.a.bytes(&back_buf)[..half as usize],
        pattern(LEN as usize, 5)[..half as usize]
    );
    assert_eq!(
        w.a.bytes(&back_buf)[half as usize..],
        pattern(LEN as usize, 0)[half as usize..],
        "nothing else moved"
    );
}

/// A batch whose deadline passes while nothing moves ends its future with
/// `Timeout`: the driver's deadline check wakes the task, also when the
/// batch was submitted while the driver was parked.
#[test]
fn a_batch_past_its_deadline_ends_its_future_with_timeout() {
    let w = world(1);
    let h = w.host_pair(1 << 16, 5, GrantRights::ReadWrite);
    let _driver = w.a.engine.spawn_driver().unwrap();
    // The driver parks first: the batch's deadline must reach a parked
    // driver (its park was bounded by the deadlines it knew).
    std::thread::sleep(Duration::from_millis(50));
    // (Before the submit: its deadline counts from there.)
    let start = std::time::Instant::now();
    let batch = w.stalled_write(&h, Duration::from_millis(50));
    let outcome = multi_thread().block_on(async { timeout(T, batch).await });
    let took = start.elapsed();
    let err = outcome
        .expect("the deadline woke the task")
        .expect_err("nothing moved");
    assert!(matches!(err, TransferError::Timeout(_)), "{err}");
    assert!(
        took >= Duration::from_millis(50),
        "not before its deadline: {took:?}"
    );
    w.fabric().set_paused(false);
}
