//! The transfer engine's async API under tokio, on the simulator.
//!
//! A [`Batch`](gdr_core::Batch) is a runtime-agnostic `Future`: any
//! executor can await it. This example starts two engines on two
//! contexts of this process's simulated fabric, connects them over rdma_cm, grants a
//! region of b's memory to a, and then, from tokio tasks, awaits many
//! batches at once: WRITEs of every part of a buffer into b's region, then
//! READs of every part back into other memory, each batch's outcome
//! checked and the bytes verified after each round.
//!
//! Two rules make it work:
//! - each engine has a driver: it makes progress (completions, deadlines,
//!   connection events) and wakes the tasks whose batches ended, so nothing
//!   depends on how, or how often, a future is polled. With gdr-core's
//!   feature `tokio` it is a task on this runtime
//!   (`Engine::drive_on_tokio`), which awaits the readiness of the
//!   engine's fds; without it, a thread ([`Engine::spawn_driver`]);
//! - the engine's blocking calls (connecting and accepting, waiting for a
//!   grant, [`Batch::wait`](gdr_core::Batch::wait)) run on a blocking
//!   thread ([`tokio::task::spawn_blocking`]), never on a runtime worker.
//!
//! Run it with `cargo run -p gdr-core --features tokio --example
//! engine_tokio` (or without the feature, for the driver thread); `cargo
//! test` runs it too (it is an example with `test = true`; the workspace's
//! tests build gdr-core with `tokio`).

use std::error::Error;
use std::time::Duration;

use gdr_core::{
    BackendChoice, Context, Engine, EngineConfig, GrantRights, MemoryDescriptor, Op, Peer, Region,
    Transfer,
};
use tokio::task::{JoinSet, spawn_blocking};
use tokio::time::timeout;

type BoxError = Box<dyn Error + Send + Sync>;

/// How many batches are in flight at once, and the size of each one's part.
const PARTS: u64 = 16;
const PART: u64 = 64 * 1024 + 13;
const LEN: u64 = PARTS * PART;
/// Longest anything may take: an error, never a hang.
const T: Duration = Duration::from_secs(10);

/// A context of this process's simulated fabric (one NIC of its own) and
/// an engine of it.
fn engine() -> Result<(Context, Engine), BoxError> {
    let context = Context::open(BackendChoice::Sim)?;
    let config = EngineConfig::default()
        .with_qps_per_peer(4)
        .with_slice_size(16 * 1024)
        .with_default_timeout(T);
    let engine = context.engine(config)?;
    Ok((context, engine))
}

/// b listens on its NIC's address (accepting on a thread of its own), a
/// connects: (a's peer b, b's peer a). Blocking.
fn connect(a: &Engine, b: &Engine) -> Result<(Peer, Peer), BoxError> {
    let nic = b.nics().into_iter().next().ok_or("b has no NIC")?;
    let listener = b.listen((b.nic_address(&nic)?, 0).into())?;
    let addr = listener.local_addr();
    let accepting = std::thread::spawn(move || listener.accept(T));
    let ab = a.connect(addr, T)?;
    let ba = accepting
        .join()
        .map_err(|_| "the accepting thread panicked")??;
    Ok((ab, ba))
}

/// A deterministic byte pattern (position-dependent, so a part landing at
/// the wrong offset shows).
fn pattern(len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ ((i >> 8) as u8))
        .collect()
}

/// Moves every part by `op` (between `local` and `remote`, at the same
/// offset in both): each part's batch submitted and awaited in a task of
/// its own, all of them at once, each outcome checked.
async fn every_part(
    op: Op,
    peer: &Peer,
    local: &Region,
    remote: &MemoryDescriptor,
) -> Result<(), BoxError> {
    let mut tasks = JoinSet::new();
    for part in 0..PARTS {
        let (peer, local, remote) = (peer.clone(), local.clone(), remote.clone());
        tasks.spawn(async move {
            let transfer = Transfer {
                op,
                local: &local,
                local_offset: part * PART,
                remote: &remote,
                remote_offset: part * PART,
                len: PART,
            };
            let batch = peer.submit(&[transfer])?;
            // The batch is the future; the timeout only bounds it.
            timeout(T, batch)
                .await
                .map_err(|_| format!("the {op:?} of part {part} never ended"))??;
            Ok::<u64, BoxError>(part)
        });
    }
    while let Some(done) = tasks.join_next().await {
        let part = done??;
        println!("{op:?} of part {part} done");
    }
    Ok(())
}

/// A task on this runtime drives each engine (gdr-core's feature `tokio`).
#[cfg(feature = "tokio")]
fn drivers(
    a: &Engine,
    b: &Engine,
) -> Result<(gdr_core::engine::AsyncDriver, gdr_core::engine::AsyncDriver), BoxError> {
    println!("driven by tokio tasks (Engine::drive_on_tokio)");
    Ok((a.drive_on_tokio()?, b.drive_on_tokio()?))
}

/// A thread drives each engine (without gdr-core's feature `tokio`).
#[cfg(not(feature = "tokio"))]
fn drivers(
    a: &Engine,
    b: &Engine,
) -> Result<(gdr_core::engine::Driver, gdr_core::engine::Driver), BoxError> {
    println!("driven by threads (Engine::spawn_driver)");
    Ok((a.spawn_driver()?, b.spawn_driver()?))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxError> {
    let (a_context, a) = engine()?;
    let (b_context, b) = engine()?;
    // The memory: a region keeps its buffer's memory alive.
    let data = pattern(LEN);
    let src = a_context.alloc_host(LEN)?;
    src.copy_from_host(0, &data)?;
    let back = a_context.alloc_host(LEN)?;
    let dst = b_context.alloc_host(LEN)?;
    let (ab, ba) = {
        let (a, b) = (a.clone(), b.clone());
        spawn_blocking(move || connect(&a, &b)).await??
    };
    // One driver per engine: progress and wake-ups come from them, until
    // they are dropped at the end of `main`.
    let _drivers = drivers(&a, &b)?;

    let src_region = a.register(&src)?;
    let back_region = a.register(&back)?;
    let dst_region = b.register(&dst)?;
    // b grants its region to a; a waits (blocking) for the announcement.
    let grant = ba.grant(&dst_region, 0, LEN, GrantRights::ReadWrite)?;
    let id = grant.id();
    let remote = {
        let ab = ab.clone();
        spawn_blocking(move || ab.wait_grant(id, T)).await??
    };

    // Every part WRITTEN, each in a task of its own, all in flight at once.
    every_part(Op::Write, &ab, &src_region, &remote).await?;
    if dst.to_vec()? != data {
        return Err("b's memory does not hold what a wrote".into());
    }
    // Then every part READ back, into other memory.
    every_part(Op::Read, &ab, &back_region, &remote).await?;
    if back.to_vec()? != data {
        return Err("a did not read back what it wrote".into());
    }
    println!(
        "{PARTS} WRITEs and {PARTS} READs of {PART} bytes awaited concurrently under tokio; \
         {LEN} bytes verified both ways"
    );
    drop(grant);
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The example, run by `cargo test` (the example has `test = true`).
    #[test]
    fn the_example_runs() {
        super::main().unwrap();
    }
}
