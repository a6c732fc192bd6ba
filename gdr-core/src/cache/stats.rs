//! The cache's counters. Hits are counted on per-thread stripes so the hot
//! path writes no cache line other threads write.

use crate::sync::atomic::{AtomicU64, Ordering};

/// A snapshot of the cache's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Requests served without a registration call: by a cached entry, or by
    /// another thread's registration of the same range in flight.
    pub hits: u64,
    /// Of the hits, those that waited for an in-flight registration.
    pub coalesced: u64,
    /// Requests that called the registrar.
    pub misses: u64,
    /// Registrar calls that failed (no entry was left behind).
    pub failures: u64,
    /// Misses whose registration was widened to cover overlapping entries of
    /// the same allocation (which it then replaced).
    pub merges: u64,
    /// Entries evicted by the LRU past a domain's limits.
    pub evictions: u64,
    /// Entries found at the requested range with another allocation's
    /// identity (freed and re-allocated memory), and dropped.
    pub stale_detections: u64,
    /// Entries removed by `invalidate*`.
    pub invalidations: u64,
    /// Bytes successfully registered, over the cache's life.
    pub bytes_registered: u64,
    /// Entries in the index now.
    pub entries: u64,
    /// Bytes the index's entries cover now.
    pub bytes_cached: u64,
}

#[cfg(not(loom))]
const STRIPES: usize = 16;
#[cfg(loom)]
const STRIPES: usize = 1;

#[derive(Debug)]
#[repr(align(128))]
struct Padded(AtomicU64);

/// A small number per thread: which hit counter it bumps and which index
/// replica it reads.
#[cfg(not(loom))]
pub(crate) fn stripe() -> usize {
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    STRIPE.with(|s| *s)
}

/// Under loom: from the model thread's id, so readers use different
/// replicas.
#[cfg(loom)]
pub(crate) fn stripe() -> usize {
    // loom's `ThreadId` hashes its execution too, which would make the
    // model non-deterministic; its `Debug` form shows the thread's number.
    let id = format!("{:?}", loom::thread::current().id());
    id.trim_start_matches("ThreadId(")
        .trim_end_matches(')')
        .parse()
        .unwrap_or(0)
}

#[derive(Debug)]
pub(crate) struct Counters {
    hits: [Padded; STRIPES],
    pub(crate) coalesced: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) merges: AtomicU64,
    pub(crate) evictions: AtomicU64,
    pub(crate) stale_detections: AtomicU64,
    pub(crate) invalidations: AtomicU64,
    pub(crate) bytes_registered: AtomicU64,
    pub(crate) entries: AtomicU64,
    pub(crate) bytes_cached: AtomicU64,
}

impl Counters {
    pub(crate) fn new() -> Self {
        Self {
            hits: std::array::from_fn(|_| Padded(AtomicU64::new(0))),
            coalesced: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            merges: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            stale_detections: AtomicU64::new(0),
            invalidations: AtomicU64::new(0),
            bytes_registered: AtomicU64::new(0),
            entries: AtomicU64::new(0),
            bytes_cached: AtomicU64::new(0),
        }
    }

    // Under loom there is one stripe (`% 1`): the same code, checked.
    #[cfg_attr(loom, allow(clippy::modulo_one))]
    pub(crate) fn hit(&self) {
        self.hits[stripe() % STRIPES]
            .0
            .fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        if n != 0 {
            counter.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn sub(counter: &AtomicU64, n: u64) {
        if n != 0 {
            counter.fetch_sub(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn snapshot(&self) -> CacheStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CacheStats {
            hits: self.hits.iter().map(|p| get(&p.0)).sum(),
            coalesced: get(&self.coalesced),
            misses: get(&self.misses),
            failures: get(&self.failures),
            merges: get(&self.merges),
            evictions: get(&self.evictions),
            stale_detections: get(&self.stale_detections),
            invalidations: get(&self.invalidations),
            bytes_registered: get(&self.bytes_registered),
            entries: get(&self.entries),
            bytes_cached: get(&self.bytes_cached),
        }
    }
}
