//! What keeps a buffer's memory alive while a NIC can reach it.
//!
//! Every memory region over a [`crate::buffer::Buffer`] (a cached
//! registration, a grant, in-flight work later) holds a [`MemoryLease`] on the
//! buffer's memory, declared after the MR so that it is released only once
//! the MR is deregistered; so does every ladder registration, on every rung
//! (the staging rung has no MR, and its copies reach the memory by
//! address). A lease keeps the memory itself alive when gdr
//! owns it (the last lease, or the buffer, frees it) and is counted, so a
//! buffer over memory gdr does not own can wait for the last one before it
//! lets the caller free that memory. The rule itself is written once, in the
//! [`crate::cache`] module docs.

use std::fmt;
use std::time::{Duration, Instant};

// std's `Arc`: it holds a `dyn` (loom's cannot coerce), and it is the
// count below, not the `Arc`, that the loom model checks.
use std::sync::Arc;

use crate::sync::{self, Condvar, Mutex};

/// Counts the leases on one buffer's memory and wakes whoever waits for
/// the last to go.
#[derive(Debug, Default)]
pub(crate) struct LeaseCount {
    live: Mutex<usize>,
    released: Condvar,
}

impl LeaseCount {
    pub(crate) fn new() -> Self {
        Self {
            live: Mutex::new(0),
            released: Condvar::new(),
        }
    }

    pub(crate) fn acquire(&self) {
        *sync::lock(&self.live) += 1;
    }

    pub(crate) fn release(&self) {
        let mut live = sync::lock(&self.live);
        *live = live.saturating_sub(1);
        if *live == 0 && !crate::cache::mutant::active("lease-release-no-notify") {
            self.released.notify_all();
        }
    }

    /// Leases alive now.
    pub(crate) fn live(&self) -> usize {
        *sync::lock(&self.live)
    }

    /// Waits until no lease is alive, at most `timeout` (forever for
    /// `None`). True when none is.
    pub(crate) fn wait_released(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut live = sync::lock(&self.live);
        while *live != 0 {
            match deadline {
                None => live = sync::wait(&self.released, live),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    live = sync::wait_timeout(&self.released, live, left);
                }
            }
        }
        true
    }
}

/// Memory that leases can keep alive: a buffer's backing store.
pub(crate) trait Leased: Send + Sync {
    fn leases(&self) -> &LeaseCount;
}

/// A claim on a buffer's memory, held by each MR over it (after the MR in
/// drop order). While it lives the memory is not freed: gdr's own memory
/// is freed by whichever of the buffer and its leases goes last, and a
/// buffer over the caller's memory waits for its leases before its drop
/// returns.
pub struct MemoryLease {
    memory: Arc<dyn Leased>,
}

impl MemoryLease {
    pub(crate) fn new(memory: &Arc<dyn Leased>) -> Self {
        memory.leases().acquire();
        Self {
            memory: Arc::clone(memory),
        }
    }
}

impl Clone for MemoryLease {
    fn clone(&self) -> Self {
        Self::new(&self.memory)
    }
}

impl Drop for MemoryLease {
    fn drop(&mut self) {
        // The count first: a waiting buffer over borrowed memory may return
        // as soon as it reaches zero, and this lease touches nothing after
        // (the `Arc` it still drops owns no caller memory).
        self.memory.leases().release();
    }
}

impl fmt::Debug for MemoryLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLease")
            .field("leases", &self.memory.leases().live())
            .finish()
    }
}
