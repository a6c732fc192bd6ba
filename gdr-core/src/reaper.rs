//! Frees of gdr's own CUDA memory that must not run where the memory's
//! last holder goes.
//!
//! On the real driver (measured on an H100, driver 580,
//! `tests/gpu-probes/lock_probe.cu`) `cuMemFree` and `cuMemFreeHost` wait
//! for every stream of the process, a stream held by a stream fence
//! included, and only the engine's progress releases such a stream. The
//! engine often holds the last lease on memory (a region a finished batch
//! kept alive, a revoked grant, a staging pool): dropped there, inside
//! progress or under the engine's lock, the free would wait for the
//! stream, the stream for progress, and progress for the free. So while a
//! thread is inside the engine ([`EngineSection`]), the memory is handed to
//! one process-wide thread that frees it; anywhere else it is freed on the
//! spot, as before.

use std::cell::Cell;
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

thread_local! {
    /// How deep this thread is inside the engine (progress, or its lock).
    static INSIDE: Cell<u32> = const { Cell::new(0) };
}

/// Marks this thread as inside the engine while it lives.
pub(crate) struct EngineSection(());

impl EngineSection {
    pub(crate) fn enter() -> Self {
        INSIDE.with(|inside| inside.set(inside.get() + 1));
        Self(())
    }
}

impl Drop for EngineSection {
    fn drop(&mut self) {
        INSIDE.with(|inside| inside.set(inside.get().saturating_sub(1)));
    }
}

/// Whether this thread is inside the engine.
pub(crate) fn inside_engine() -> bool {
    INSIDE.with(|inside| inside.get() > 0)
}

type Doomed = Box<dyn Send>;

/// The reaper's queue (std's types: nothing here is model-checked).
static REAPER: OnceLock<Mutex<Option<mpsc::Sender<Doomed>>>> = OnceLock::new();

/// Drops `doomed` on the reaper thread (started at the first use); here,
/// where the OS makes no thread.
pub(crate) fn free_later(doomed: Doomed) {
    let queue = REAPER.get_or_init(|| {
        let (sender, frees) = mpsc::channel::<Doomed>();
        let started = std::thread::Builder::new()
            .name("gdr-reaper".into())
            .spawn(move || {
                while let Ok(doomed) = frees.recv() {
                    drop(doomed);
                }
            });
        match started {
            Ok(_) => Mutex::new(Some(sender)),
            Err(e) => {
                tracing::warn!(error = %e, "no reaper thread: memory is freed where it is dropped");
                Mutex::new(None)
            }
        }
    });
    let sender = queue
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    match sender {
        Some(sender) => {
            if let Err(mpsc::SendError(doomed)) = sender.send(doomed) {
                drop(doomed);
            }
        }
        None => drop(doomed),
    }
}
