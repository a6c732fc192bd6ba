//! Cache entries and the refcounted handles that hold them.

use std::fmt;
use std::ops::Deref;

use super::key::{AllocationIdentity, DomainId, MemoryKind};
use crate::sync::Arc;
use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// One registration and what it covers. Shared by the index (one `Arc`) and
/// every handle (one each): it is deregistered, by dropping the
/// registration, when the last of them lets go.
pub(crate) struct Entry<T> {
    pub(crate) domain: DomainId,
    pub(crate) kind: MemoryKind,
    pub(crate) identity: AllocationIdentity,
    pub(crate) start: u64,
    pub(crate) end: u64,
    /// Insertion order, the LRU tie-break.
    pub(crate) seq: u64,
    /// The cache clock when last hit (approximate LRU; see the module docs).
    pub(crate) last_used: AtomicU64,
    /// Live handles. Raised only under the shard's lock (read or write) or
    /// on behalf of waiters counted under the write lock, so an eviction
    /// that reads 0 under the write lock knows the entry is unused and stays
    /// so. (Not `Arc::strong_count`: a count that is inspected rather than
    /// owned, and loom does not explore inspections against drops.)
    pub(crate) users: AtomicUsize,
    pub(crate) registration: T,
}

impl<T> Entry<T> {
    /// Whether a handle holds it (meaningful under the shard's write lock).
    pub(crate) fn in_use(&self) -> bool {
        self.users.load(Ordering::Acquire) != 0
    }

    pub(crate) fn len(&self) -> u64 {
        self.end - self.start
    }

    /// Whether this entry can serve `kind`/`identity` for `start..end`.
    pub(crate) fn covers(&self, start: u64, end: u64) -> bool {
        self.start <= start && end <= self.end
    }

    pub(crate) fn same_allocation(&self, kind: MemoryKind, identity: AllocationIdentity) -> bool {
        self.kind == kind && self.identity == identity
    }

    /// Records a use at `now` without writing the cache line when it already
    /// holds `now` (hits on a hot entry from many threads stay read-only).
    pub(crate) fn touch(&self, now: u64) {
        if self.last_used.load(Ordering::Relaxed) != now {
            self.last_used.store(now, Ordering::Relaxed);
        }
    }
}

impl<T> Drop for Entry<T> {
    fn drop(&mut self) {
        let _span = tracing::trace_span!(
            "deregister",
            domain = self.domain,
            start = format_args!("{:#x}", self.start),
            len = self.end - self.start
        )
        .entered();
        // The registration's own Drop deregisters it, after this.
    }
}

impl<T> fmt::Debug for Entry<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entry")
            .field("domain", &self.domain)
            .field("kind", &self.kind)
            .field("identity", &self.identity)
            .field("start", &format_args!("{:#x}", self.start))
            .field("end", &format_args!("{:#x}", self.end))
            .finish_non_exhaustive()
    }
}

/// A registration in use. While any handle to it lives, its entry is never
/// evicted and its registration never dropped, even when the entry is
/// invalidated or superseded (then it is only unlinked from the index, and
/// deregistered when the last handle drops).
///
/// The registration covers at least the range looked up, and possibly more:
/// [`CacheHandle::start`] and [`CacheHandle::end`] say what it covers.
pub struct CacheHandle<T> {
    pub(crate) entry: Arc<Entry<T>>,
}

impl<T> CacheHandle<T> {
    /// A new handle on `entry`; called under the shard's lock.
    pub(crate) fn new(entry: &Arc<Entry<T>>) -> Self {
        entry.users.fetch_add(1, Ordering::Relaxed);
        Self {
            entry: Arc::clone(entry),
        }
    }

    /// Takes over a use already counted in `entry.users`.
    pub(crate) fn adopt(entry: Arc<Entry<T>>) -> Self {
        Self { entry }
    }

    /// The registration.
    pub fn registration(&self) -> &T {
        &self.entry.registration
    }
    /// The protection domain.
    pub fn domain(&self) -> DomainId {
        self.entry.domain
    }
    /// The kind of memory.
    pub fn kind(&self) -> MemoryKind {
        self.entry.kind
    }
    /// The allocation.
    pub fn identity(&self) -> AllocationIdentity {
        self.entry.identity
    }
    /// First address (or dma-buf offset) the registration covers.
    pub fn start(&self) -> u64 {
        self.entry.start
    }
    /// One past the last.
    pub fn end(&self) -> u64 {
        self.entry.end
    }
    /// Bytes covered.
    pub fn len(&self) -> u64 {
        self.entry.len()
    }
    /// Never true: empty ranges are not registered.
    pub fn is_empty(&self) -> bool {
        self.entry.len() == 0
    }
    /// Whether two handles share one registration.
    pub fn same_registration(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.entry, &other.entry)
    }
}

impl<T> Clone for CacheHandle<T> {
    fn clone(&self) -> Self {
        // A use of an entry already in use: no lock needed.
        Self::new(&self.entry)
    }
}

impl<T> Drop for CacheHandle<T> {
    fn drop(&mut self) {
        // Release: what this handle did with the registration happens before
        // an eviction that sees the count reach zero.
        self.entry.users.fetch_sub(1, Ordering::Release);
    }
}

impl<T> Deref for CacheHandle<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.entry.registration
    }
}

impl<T> fmt::Debug for CacheHandle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CacheHandle").field(&*self.entry).finish()
    }
}
