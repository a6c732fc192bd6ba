//! # The registration cache
//!
//! Registering memory with a NIC (`ibv_reg_mr`, `ibv_reg_dmabuf_mr`) costs
//! from microseconds to tens of milliseconds, so registrations are kept and
//! reused. This cache keys them by (protection domain, memory kind,
//! allocation identity, range) and is generic over what registers: a
//! [`Registrar`] turns a [`Request`] into a registration (the engine's
//! registrar wraps a `hal_verbs::ProtectionDomain`; tests use counting
//! fakes). The registration is deregistered by dropping it, which happens
//! when its entry has left the index and no [`CacheHandle`] holds it.
//!
//! ## Keys and staleness
//!
//! - Memory registered by address (pageable host, pinned host, device memory
//!   through nvidia-peermem) lives in one index per domain, keyed by address.
//!   For CUDA-known memory the request carries the allocation's
//!   `CU_POINTER_ATTRIBUTE_BUFFER_ID`, read by the caller just before the
//!   lookup. An entry at an overlapping address with another kind or buffer
//!   id belongs to freed memory whose address was reused: it is **stale**,
//!   counted in [`CacheStats::stale_detections`], unlinked, and never
//!   returned. This replaces UCX's reliance on malloc/cudaFree hooks, where
//!   its stale-registration bugs came from (openucx/ucx #4269, #7865).
//!   Pageable host memory has no identity: callers that unmap it call
//!   [`RegistrationCache::invalidate`].
//! - dma-buf registrations are keyed by (allocation buffer id, offset range
//!   in the dma-buf), each allocation in an index of its own; buffer ids are
//!   never reused, so a re-allocation cannot reach them, and
//!   [`RegistrationCache::invalidate_allocation`] drops them when the
//!   allocation is freed (else the LRU does).
//!
//! ## Overlap policy: merge
//!
//! A request inside a cached range of the same allocation hits. A request
//! that overlaps cached ranges of the same allocation without being inside
//! one is registered as the union of itself and those ranges (UCX's rule),
//! and the new entry replaces them: the old ones are unlinked (those in use
//! live on until their handles drop). So entries in an index are always
//! disjoint, a lookup is one ordered-map probe (the last entry starting at
//! or before the address is the only candidate), and repeated overlapping
//! requests converge on one registration instead of piling up pinned
//! copies. The union of overlapping ranges is contiguous and every byte of
//! it was asked for by someone, so it is as mapped as the requests were;
//! merely adjacent ranges are not merged. For device memory the engine may
//! go further and ask for the whole allocation (base and size from pointer
//! attributes) on first touch.
//!
//! ## Concurrency
//!
//! The domains are spread over shards. Each shard keeps
//! [`CacheConfig::read_replicas`] identical copies of its index, each behind
//! its own `RwLock` on its own cache line; a reader uses the copy of its
//! thread, a writer locks them all and changes each (std's `RwLock` read
//! lock is an atomic on a shared word: one copy for all threads made hits
//! from 2 threads slower than from 1). A hit takes its copy's read lock,
//! probes, counts a use on the entry and clones its `Arc`, and leaves; it then stamps the
//! entry with the cache clock (a plain store, skipped when the stamp is
//! current) and bumps a per-thread striped counter. No write lock, no
//! shared counter on the hot path.
//!
//! A miss takes the write lock to re-check, drop stale entries and publish
//! an in-flight registration ("pending"), then **releases every lock while
//! the registrar runs**. Concurrent misses are deduplicated: a request
//! inside a pending registration of the same allocation waits for it (a
//! `Mutex` + `Condvar` slot; loom has no `OnceLock`) and shares its result,
//! error included; a request merely overlapping one waits and then looks up
//! again (it will merge with the result). So one range is registered once,
//! however many threads miss on it. A registrar that panics abandons its
//! slot, and the waiters retry.
//!
//! ## Eviction and invalidation
//!
//! Each domain (one PD per NIC: per device) has [`Limits`] in bytes and in
//! entries. When an insertion takes a domain past either, unused entries are
//! evicted least-recently-used first down to the limits less
//! [`CacheConfig::eviction_headroom_percent`] (evicting a batch keeps the
//! sort that picks victims off most insertions). "Unused" is exact: each
//! entry counts its handles, new handles are made only under the shard's
//! lock (or counted there for waiters), so an entry without handles seen
//! under the write lock is unused and stays so. Entries in use are never
//! evicted, so a domain can stay past its limits while they are; the next
//! insertion (or [`RegistrationCache::trim`]) evicts again.
//!
//! Recency is approximate: the clock advances at each insertion, and a hit
//! stamps the entry with it, so entries hit since the last insertion tie
//! (broken by age). Exact LRU would need a shared write on every hit.
//!
//! Invalidation unlinks overlapping entries at once; those in use are
//! deregistered when their last handle drops. A registration in flight over
//! an invalidated range is handed to its callers but not cached.
//!
//! Deregistration (dropping a registration) never runs under a lock.
//!
//! ## Owners and bounds
//!
//! A request names its owner (the gdr buffer it belongs to; `0` for raw
//! users) and the bounds of its allocation. Entries of one owner live in
//! indexes of their own, so two buffers never share, merge or invalidate
//! each other's registrations, even over one allocation; and nothing
//! outside a request's bounds is ever registered for it, merges included: a
//! registration never spans two allocations. [`RegistrationCache::invalidate_owner`]
//! unlinks everything a buffer owns when it is dropped. A request's
//! [`Access`] splits the indexes further: a read-only request is registered
//! without write access and never finds, nor merges with, a read-write
//! entry, and the other way round.
//!
//! ## Lifetimes: the rule
//!
//! The rule the cache, the buffers, the ladder and (next) the engine share:
//!
//! 1. **Memory is freed only after every MR over it is deregistered.** A
//!    registration is deregistered when its entry has left the index *and*
//!    its last [`CacheHandle`] is dropped. Handles can be cloned, leaked
//!    (`mem::forget` is safe Rust) or kept past the buffer, so a destructor
//!    (the buffer's) cannot be the guard. Instead each registration holds a
//!    lease on its buffer's memory (`MemoryLease`, after the MR in
//!    drop order): memory gdr allocated is freed by whichever of the buffer
//!    and the last lease goes last; for memory the caller owns
//!    ([`crate::buffer::Buffer::wrap`]) the buffer's drop waits, bounded,
//!    until no lease is left, and aborts the process past the bound rather
//!    than return while a NIC can still write into memory the caller is
//!    about to free ([`crate::buffer::Buffer::release`] is the form that
//!    hands the buffer back instead). The rule covers every way a path
//!    reaches the memory, not only MRs: each
//!    [`crate::ladder::LadderRegistration`] holds a lease too, on every
//!    rung, so the staging rung (no MR; its copies reach the memory by
//!    address) keeps the memory as long as any region built on it.
//!    Raw registrars ([`crate::ladder::NicRegistrar::new`]) have no leases:
//!    their caller promises the same rule, which is why constructing one is
//!    `unsafe`.
//! 2. **An MR stays registered from the first post that uses it to its last
//!    completion, and while a descriptor naming its rkey is granted.** The
//!    engine holds a handle (or the grant) in each posted request until its
//!    completion is polled, and grants live until revoked (dropped) or their
//!    connection closes; a QP torn down with work outstanding is drained
//!    first. Holding a handle is what "in use" means, so eviction (which
//!    takes only unused entries) and invalidation (which only unlinks: the
//!    MR goes with the last handle, the memory with the last lease) respect
//!    both.
//! 3. **Limits count every live MR.** The index's [`Limits`] steer eviction;
//!    the hard limit is the domain's [`DomainBudget`], which every MR takes a
//!    [`Reservation`] from before the NIC is asked and keeps until it is
//!    deregistered: cached entries, entries unlinked while in use,
//!    registrations in flight, grants, and the probe's and self-check's
//!    scratch MRs. A registration past the budget fails with
//!    [`BudgetExceeded`] (after evicting unused entries) instead of reaching
//!    the NIC's `max_mr`.
//! 4. **A descriptor grants exactly the range and rights it names.** Cached
//!    MRs are for local use and carry local rights only; they may be wider
//!    than any request (merged). What a peer gets is a
//!    [`crate::ladder::MrGrant`]: an uncached MR of exactly the granted range
//!    with exactly the granted rights.
//!
//! ## Plugging in a protection domain
//!
//! [`crate::ladder::NicRegistrar`] is the registrar over a verbs PD: `register`
//! calls `ProtectionDomain::register(start, len, access)` for requests
//! registered by address, and `register_dmabuf(fd, start, len, base + start,
//! access)` for [`AllocationIdentity::Dmabuf`]. [`RegistrationCache::get_or_register_with`]
//! takes any registrar with the cache's registration type, so the ladder
//! passes one per request that carries the buffer's lease and dma-buf
//! export.

mod budget;
mod error;
mod handle;
mod index;
mod key;
pub(crate) mod mutant;
#[cfg(not(loom))]
mod planner;
mod stats;

#[cfg(all(test, not(loom)))]
mod abandon_tests;
#[cfg(all(test, loom))]
pub(crate) mod loom_tests;
#[cfg(all(test, not(loom)))]
mod tests;

pub use budget::{BudgetExceeded, BudgetLimits, BudgetUsage, DomainBudget, Reservation};
pub use error::CacheError;
pub use handle::CacheHandle;
pub use key::{Access, AllocationIdentity, Bounds, DomainId, MemoryKind, OwnerId, Request};
pub use stats::CacheStats;

use std::fmt;

use handle::Entry;
use index::{Lookup, Shard, ShardState};
use key::{SpaceKey, shard_of};
use stats::Counters;

use crate::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use crate::sync::{self, Arc, Condvar, Mutex};

/// What registers memory for the cache.
///
/// Called with no lock of the cache held, possibly from many threads at
/// once. The request may be wider than any one caller asked for (merged
/// ranges); it never spans two allocations.
pub trait Registrar: Sync {
    /// A registration; dropping it deregisters.
    type Registration: Send + Sync;
    /// Why registering failed.
    type Error: std::error::Error + Send + Sync + 'static;
    /// Registers `request.start .. request.start + request.len` in
    /// `request.domain`.
    fn register(&self, request: &Request) -> Result<Self::Registration, Self::Error>;
}

/// A domain's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of registered memory.
    pub max_bytes: u64,
    /// Registrations (a NIC's `max_mr` bounds these).
    pub max_entries: u64,
}

impl Limits {
    /// No limits.
    pub const UNLIMITED: Self = Self {
        max_bytes: u64::MAX,
        max_entries: u64::MAX,
    };
}

/// How a cache is set up.
///
/// Made from [`CacheConfig::default`] and the `with_` setters (one per field);
/// `#[non_exhaustive]`, so a field can be added without breaking callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheConfig {
    /// The limits of every domain without its own
    /// (`RegistrationCache::set_limits`).
    pub limits: Limits,
    /// An eviction goes this many percent below the limits, so that it runs
    /// once per batch of insertions rather than at each.
    pub eviction_headroom_percent: u8,
    /// Shards the domains are spread over.
    pub shards: usize,
    /// Copies of each shard's index that readers spread over (by thread),
    /// so that hits from different threads share no lock word. Each copy
    /// costs about 30 bytes an entry; every change is applied to each.
    pub read_replicas: usize,
}

impl Default for CacheConfig {
    /// 64 Ki entries and 1 TiB per domain, 10 % headroom, 16 shards, one
    /// read replica per available core up to 8.
    fn default() -> Self {
        Self {
            limits: Limits {
                max_bytes: 1 << 40,
                max_entries: 1 << 16,
            },
            eviction_headroom_percent: 10,
            shards: 16,
            read_replicas: std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
        }
    }
}

impl CacheConfig {
    /// Sets [`CacheConfig::limits`].
    #[must_use]
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Sets [`CacheConfig::eviction_headroom_percent`].
    #[must_use]
    pub fn with_eviction_headroom_percent(mut self, eviction_headroom_percent: u8) -> Self {
        self.eviction_headroom_percent = eviction_headroom_percent;
        self
    }

    /// Sets [`CacheConfig::shards`].
    #[must_use]
    pub fn with_shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// Sets [`CacheConfig::read_replicas`].
    #[must_use]
    pub fn with_read_replicas(mut self, read_replicas: usize) -> Self {
        self.read_replicas = read_replicas;
        self
    }
}

/// A registration in flight, which other requests for the same range wait
/// on instead of registering again.
pub(crate) struct Pending<R: Registrar> {
    space: SpaceKey,
    kind: MemoryKind,
    identity: AllocationIdentity,
    start: u64,
    end: u64,
    /// Set (under the shard's write lock) when an invalidation overlapped the
    /// range while it was being registered: the result is not cached.
    invalidated: AtomicBool,
    /// Requests inside the range waiting for it (counted under the shard's
    /// write lock): the entry is born with a use for each, so it cannot be
    /// evicted before they take their handles.
    covered_waiters: AtomicUsize,
    outcome: Mutex<Outcome<R>>,
    done: Condvar,
}

enum Outcome<R: Registrar> {
    Registering,
    Done(Arc<Entry<R::Registration>>),
    Failed(std::sync::Arc<R::Error>),
    /// The registrar panicked.
    Abandoned,
}

impl<R: Registrar> Outcome<R> {
    fn snapshot(&self) -> Self {
        match self {
            Self::Registering => Self::Registering,
            Self::Done(e) => Self::Done(Arc::clone(e)),
            Self::Failed(e) => Self::Failed(std::sync::Arc::clone(e)),
            Self::Abandoned => Self::Abandoned,
        }
    }
}

impl<R: Registrar> Pending<R> {
    fn overlaps(&self, space: SpaceKey, start: u64, end: u64) -> bool {
        self.space == space && self.start < end && start < self.end
    }

    fn finish(&self, outcome: Outcome<R>) {
        *sync::lock(&self.outcome) = outcome;
        self.done.notify_all();
    }

    fn wait(&self) -> Outcome<R> {
        let mut outcome = sync::lock(&self.outcome);
        while matches!(*outcome, Outcome::Registering) {
            outcome = sync::wait(&self.done, outcome);
        }
        outcome.snapshot()
    }
}

/// The duty to finish a published pending registration, held by the thread
/// that registers it: the slot ends on every path. [`PendingGuard::finish`]
/// consumes the guard with the outcome; a guard dropped unfinished (a panic
/// anywhere from publishing to finishing: in the registrar, in an error's
/// `Display` or a `tracing` subscriber the cache calls) unpublishes the slot
/// and finishes it [`Outcome::Abandoned`], so its waiters retry instead of
/// waiting forever. Declare it before any shard lock taken while it lives,
/// so that an unwinding panic releases the lock before the guard takes it.
struct PendingGuard<'a, R: Registrar> {
    shard: &'a Shard<R>,
    pending: &'a Arc<Pending<R>>,
    finished: bool,
}

impl<R: Registrar> PendingGuard<'_, R> {
    /// Wakes the waiters with `outcome` (the caller unpublished the slot).
    fn finish(mut self, outcome: Outcome<R>) {
        self.finished = true;
        self.pending.finish(outcome);
    }
}

impl<R: Registrar> Drop for PendingGuard<'_, R> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if !mutant::active("abandoned-stays-pending") {
            self.shard
                .write()
                .meta
                .pending
                .retain(|p| !Arc::ptr_eq(p, self.pending));
        }
        if !mutant::active("abandon-not-finished") {
            self.pending.finish(Outcome::Abandoned);
        }
    }
}

/// The registration cache. See the [module docs](self).
pub struct RegistrationCache<R: Registrar> {
    shards: Box<[Shard<R>]>,
    config: CacheConfig,
    /// Advanced at each insertion; hits stamp entries with it.
    clock: AtomicU64,
    counters: Counters,
}

type HandleResult<R> =
    Result<CacheHandle<<R as Registrar>::Registration>, CacheError<<R as Registrar>::Error>>;

impl<R: Registrar> RegistrationCache<R> {
    /// An empty cache.
    pub fn new(config: CacheConfig) -> Self {
        let shards = (0..config.shards.max(1))
            .map(|_| Shard::new(config.read_replicas))
            .collect();
        Self {
            shards,
            config,
            clock: AtomicU64::new(1),
            counters: Counters::new(),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// Sets `domain`'s limits (instead of the configured default), evicting
    /// at once if it is now past them.
    pub fn set_limits(&self, domain: DomainId, limits: Limits) {
        let mut state = self.shard(domain).write();
        state.set_limits(domain, limits);
        if mutant::active("set-limits-no-evict") {
            return;
        }
        let victims = state.evict(
            domain,
            limits,
            self.config.eviction_headroom_percent,
            &self.counters,
        );
        drop(state);
        drop(victims);
    }

    /// The counters now.
    pub fn stats(&self) -> CacheStats {
        self.counters.snapshot()
    }

    fn shard(&self, domain: DomainId) -> &Shard<R> {
        &self.shards[shard_of(domain, self.shards.len())]
    }

    fn validate(request: &Request) -> Result<u64, CacheError<R::Error>> {
        if request.len == 0 {
            return Err(CacheError::EmptyRange {
                start: request.start,
            });
        }
        let end = request.end().ok_or(CacheError::RangeOverflow {
            start: request.start,
            len: request.len,
        })?;
        if !request.bounds.contains(request.start, end) {
            return Err(CacheError::OutsideBounds {
                start: request.start,
                end,
                bounds: request.bounds,
            });
        }
        Ok(end)
    }

    fn hit(&self, handle: CacheHandle<R::Registration>) -> CacheHandle<R::Registration> {
        handle.entry.touch(self.clock.load(Ordering::Relaxed));
        self.counters.hit();
        handle
    }

    /// The cached registration covering `request`, without registering on a
    /// miss. Counts a hit when found, nothing otherwise.
    pub fn get(&self, request: &Request) -> Option<CacheHandle<R::Registration>> {
        let end = request.end()?;
        let state = self.shard(request.domain).read();
        let Lookup::Hit(entry) = state.lookup(
            request.space(),
            request.kind,
            request.identity,
            request.start,
            end,
        ) else {
            return None;
        };
        let handle = if mutant::active("count-use-after-unlock") {
            let entry = Arc::clone(entry);
            drop(state);
            CacheHandle::new(&entry)
        } else {
            let handle = CacheHandle::new(entry);
            drop(state);
            handle
        };
        Some(self.hit(handle))
    }

    /// A registration covering `request`: cached, or registered now through
    /// `registrar` (which must register in `request.domain`).
    pub fn get_or_register(&self, registrar: &R, request: &Request) -> HandleResult<R> {
        self.get_or_register_with(registrar, request)
    }

    /// As [`RegistrationCache::get_or_register`], through any registrar with
    /// the cache's registration type: one made for this request, carrying
    /// what keeps its memory alive.
    pub fn get_or_register_with<G>(&self, registrar: &G, request: &Request) -> HandleResult<R>
    where
        G: Registrar<Registration = R::Registration, Error = R::Error> + ?Sized,
    {
        let end = Self::validate(request)?;
        let shard = self.shard(request.domain);
        {
            let state = shard.read();
            if let Lookup::Hit(entry) = state.lookup(
                request.space(),
                request.kind,
                request.identity,
                request.start,
                end,
            ) {
                let handle = CacheHandle::new(entry);
                drop(state);
                return Ok(self.hit(handle));
            }
        }
        self.miss(registrar, request, end)
    }

    fn miss<G>(&self, registrar: &G, request: &Request, end: u64) -> HandleResult<R>
    where
        G: Registrar<Registration = R::Registration, Error = R::Error> + ?Sized,
    {
        let shard = self.shard(request.domain);
        let space = request.space();
        let (kind, identity, start) = (request.kind, request.identity, request.start);
        loop {
            let mut state = shard.write();
            if let Lookup::Hit(entry) = state.lookup(space, kind, identity, start, end) {
                let handle = CacheHandle::new(entry);
                drop(state);
                return Ok(self.hit(handle));
            }

            // Stale entries go; same-allocation ones widen the registration.
            let mut victims = Vec::new();
            let (mut lo, mut hi) = (start, end);
            for entry in state.overlapping(space, start, end) {
                if entry.same_allocation(kind, identity)
                    && request.bounds.contains(entry.start, entry.end)
                {
                    lo = lo.min(entry.start);
                    hi = hi.max(entry.end);
                } else {
                    tracing::debug!(
                        stale = ?entry,
                        ?identity,
                        "stale registration: the address now belongs to another allocation"
                    );
                    Counters::add(&self.counters.stale_detections, 1);
                    victims.extend(state.remove(space, entry.start, &self.counters));
                }
            }

            // Someone registering an overlapping range of the same allocation?
            let in_flight = state
                .meta
                .pending
                .iter()
                .find(|p| p.overlaps(space, start, end) && p.kind == kind && p.identity == identity)
                .filter(|p| {
                    let covers = p.start <= start && end <= p.end;
                    !mutant::active(if covers {
                        "no-dedupe"
                    } else {
                        "overlap-ignores-pending"
                    })
                })
                .cloned();
            if let Some(pending) = in_flight {
                let covers = pending.start <= start && end <= pending.end;
                if covers && !mutant::active("no-covered-waiter-count") {
                    // Relaxed: written and read under the write lock.
                    pending.covered_waiters.fetch_add(1, Ordering::Relaxed);
                }
                drop(state);
                drop(victims);
                match pending.wait() {
                    Outcome::Done(entry) if covers => {
                        Counters::add(&self.counters.coalesced, 1);
                        return Ok(self.hit(CacheHandle::adopt(entry)));
                    }
                    Outcome::Failed(source)
                        if covers && !mutant::active("waiter-retries-failure") =>
                    {
                        return Err(CacheError::Register {
                            start: pending.start,
                            end: pending.end,
                            source,
                        });
                    }
                    // Overlapping only (look again: it merges), or abandoned.
                    _ => continue,
                }
            }

            if (lo, hi) != (start, end) {
                Counters::add(&self.counters.merges, 1);
            }
            let pending = Arc::new(Pending {
                space,
                kind,
                identity,
                start: lo,
                end: hi,
                invalidated: AtomicBool::new(false),
                covered_waiters: AtomicUsize::new(0),
                outcome: Mutex::new(Outcome::Registering),
                done: Condvar::new(),
            });
            state.meta.pending.push(Arc::clone(&pending));
            Counters::add(&self.counters.misses, 1);
            drop(state);
            drop(victims);
            return self.register(registrar, request, pending);
        }
    }

    /// Runs the registrar for `pending` (published, no lock held) and links
    /// the result.
    fn register<G>(
        &self,
        registrar: &G,
        request: &Request,
        pending: Arc<Pending<R>>,
    ) -> HandleResult<R>
    where
        G: Registrar<Registration = R::Registration, Error = R::Error> + ?Sized,
    {
        let shard = self.shard(request.domain);
        let guard = PendingGuard {
            shard,
            pending: &pending,
            finished: false,
        };
        let wide = Request {
            start: pending.start,
            len: pending.end - pending.start,
            ..*request
        };
        let result = {
            let _span = tracing::debug_span!(
                "register",
                domain = wide.domain,
                kind = ?wide.kind,
                identity = ?wide.identity,
                start = format_args!("{:#x}", wide.start),
                len = wide.len
            )
            .entered();
            registrar.register(&wide)
        };
        let mut state = shard.write();
        if result.is_ok() || !mutant::active("failed-stays-pending") {
            state.meta.pending.retain(|p| !Arc::ptr_eq(p, &pending));
        }
        match result {
            Ok(registration) => {
                let tick = self.clock.fetch_add(1, Ordering::Relaxed);
                let entry = Arc::new(Entry {
                    domain: wide.domain,
                    kind: wide.kind,
                    identity: wide.identity,
                    start: pending.start,
                    end: pending.end,
                    seq: tick,
                    last_used: AtomicU64::new(tick),
                    // Ours and each covered waiter's (their count is final:
                    // the pending slot is unpublished under this lock).
                    users: AtomicUsize::new(1 + pending.covered_waiters.load(Ordering::Relaxed)),
                    registration,
                });
                // Hand out every counted use before anything that could
                // panic: ours (released by unwinding) and the waiters' (they
                // wake with the entry; they need no shard lock).
                let handle = CacheHandle::adopt(Arc::clone(&entry));
                guard.finish(Outcome::Done(entry));
                let entry = &handle.entry;
                Counters::add(&self.counters.bytes_registered, wide.len);
                let mut victims = Vec::new();
                // Relaxed: written and read under the shard's write lock.
                if pending.invalidated.load(Ordering::Relaxed) {
                    tracing::debug!("range invalidated while registering: not cached");
                } else {
                    victims = state.insert(pending.space, Arc::clone(entry), &self.counters);
                    let limits = state.limits(wide.domain).unwrap_or(self.config.limits);
                    victims.extend(state.evict(
                        wide.domain,
                        limits,
                        self.config.eviction_headroom_percent,
                        &self.counters,
                    ));
                }
                drop(state);
                drop(victims);
                Ok(handle)
            }
            Err(error) => {
                let source = std::sync::Arc::new(error);
                guard.finish(Outcome::Failed(std::sync::Arc::clone(&source)));
                drop(state);
                tracing::debug!(error = %source, "registration failed");
                Counters::add(&self.counters.failures, 1);
                Err(CacheError::Register {
                    start: pending.start,
                    end: pending.end,
                    source,
                })
            }
        }
    }

    /// Unlinks, in each of `shards`, the entries `unlink` takes, and flags
    /// the registrations in flight `in_flight` selects so that their results
    /// are handed out but not cached (the memory is going away). Counts and
    /// returns the entries unlinked.
    fn invalidate_where<'s>(
        &self,
        shards: impl IntoIterator<Item = &'s Shard<R>>,
        mut unlink: impl FnMut(&mut ShardState<'_, R>) -> Vec<Arc<Entry<R::Registration>>>,
        in_flight: impl Fn(&Pending<R>) -> bool,
    ) -> usize
    where
        R: 's,
    {
        let mut count = 0;
        for shard in shards {
            let mut state = shard.write();
            let victims = unlink(&mut state);
            for p in state.meta.pending.iter().filter(|p| in_flight(p)) {
                // Relaxed: written and read under the shard's write lock.
                p.invalidated.store(true, Ordering::Relaxed);
            }
            drop(state);
            count += victims.len();
        }
        Counters::add(&self.counters.invalidations, count as u64);
        count
    }

    fn invalidate_with(
        &self,
        shards: &[Shard<R>],
        domain: Option<DomainId>,
        start: u64,
        end: u64,
    ) -> usize {
        self.invalidate_where(
            shards,
            |state| state.remove_range(domain, start, end, &self.counters),
            |p| {
                p.space.space == key::Space::Address
                    && domain.is_none_or(|d| d == p.space.domain)
                    && p.start < end
                    && start < p.end
                    && !mutant::active("no-invalidate-pending")
            },
        )
    }

    /// Unlinks every entry registered by address (any domain, any kind)
    /// overlapping `start..start + len`: the caller is about to free or
    /// unmap that memory. Entries in use are deregistered when their last
    /// handle drops. Returns how many were unlinked.
    pub fn invalidate(&self, start: u64, len: u64) -> usize {
        let _span =
            tracing::debug_span!("invalidate", start = format_args!("{start:#x}"), len).entered();
        let end = start.saturating_add(len);
        self.invalidate_with(&self.shards, None, start, end)
    }

    /// As [`RegistrationCache::invalidate`], in one domain only.
    pub fn invalidate_in(&self, domain: DomainId, start: u64, len: u64) -> usize {
        let _span = tracing::debug_span!(
            "invalidate",
            domain,
            start = format_args!("{start:#x}"),
            len
        )
        .entered();
        let end = start.saturating_add(len);
        let shard = shard_of(domain, self.shards.len());
        self.invalidate_with(&self.shards[shard..=shard], Some(domain), start, end)
    }

    /// Unlinks every entry of allocation `buffer_id`, registered by address
    /// or as a dma-buf, in every domain: the caller is about to free it.
    pub fn invalidate_allocation(&self, buffer_id: u64) -> usize {
        let _span = tracing::debug_span!("invalidate_allocation", buffer_id).entered();
        self.invalidate_where(
            self.shards.iter(),
            |state| {
                state.remove_where(
                    |_, e| e.identity.buffer_id() == Some(buffer_id),
                    &self.counters,
                )
            },
            |p| {
                p.identity.buffer_id() == Some(buffer_id)
                    && !mutant::active("allocation-invalidation-misses-pending")
            },
        )
    }

    /// Unlinks every entry of `owner` (a buffer being dropped), in every
    /// domain, and keeps its registrations in flight out of the index.
    /// Entries in use are deregistered when their last handle drops (the
    /// owner's memory outlives them: see the module docs). Returns how many
    /// were unlinked.
    pub fn invalidate_owner(&self, owner: OwnerId) -> usize {
        let _span = tracing::debug_span!("invalidate_owner", owner).entered();
        self.invalidate_owner_with(&self.shards, None, owner)
    }

    /// As [`RegistrationCache::invalidate_owner`], in one domain only (one
    /// shard, and only that owner's indexes are visited).
    pub fn invalidate_owner_in(&self, domain: DomainId, owner: OwnerId) -> usize {
        let _span = tracing::debug_span!("invalidate_owner", domain, owner).entered();
        self.invalidate_owner_with(
            std::slice::from_ref(self.shard(domain)),
            Some(domain),
            owner,
        )
    }

    fn invalidate_owner_with(
        &self,
        shards: &[Shard<R>],
        domain: Option<DomainId>,
        owner: OwnerId,
    ) -> usize {
        let ours =
            |space: &SpaceKey| space.owner == owner && domain.is_none_or(|d| d == space.domain);
        self.invalidate_where(
            shards,
            |state| {
                state.remove_where_in(
                    ours,
                    |_, e| !(e.in_use() && mutant::active("owner-invalidation-skips-in-use")),
                    &self.counters,
                )
            },
            |p| ours(&p.space),
        )
    }

    /// Evicts every entry of `domain` not in use (its NIC is out of MRs or
    /// pinned bytes). Returns how many.
    pub fn trim_in(&self, domain: DomainId) -> usize {
        let _span = tracing::debug_span!("trim", domain).entered();
        let mut state = self.shard(domain).write();
        let evicted = state.remove_where(
            |space, e| space.domain == domain && !e.in_use(),
            &self.counters,
        );
        drop(state);
        Counters::add(&self.counters.evictions, evicted.len() as u64);
        evicted.len()
    }

    /// Evicts every entry not in use, in every domain (memory pressure,
    /// shutdown). Returns how many.
    pub fn trim(&self) -> usize {
        let _span = tracing::debug_span!("trim").entered();
        let mut count = 0;
        for shard in self.shards.iter() {
            let mut state = shard.write();
            // Under the write lock, unused stays unused (see `evict`).
            let evicted = state.remove_where(
                |_, e| !e.in_use() || mutant::active("trim-evicts-in-use"),
                &self.counters,
            );
            drop(state);
            count += evicted.len();
        }
        Counters::add(&self.counters.evictions, count as u64);
        count
    }
}

#[cfg(all(test, not(loom)))]
impl<R: Registrar> RegistrationCache<R> {
    /// How many threads wait on `domain`'s registrations in flight (each
    /// pending slot is held by the index, its registering thread and each
    /// waiter).
    pub(crate) fn waiters(&self, domain: DomainId) -> usize {
        self.shard(domain)
            .meta()
            .pending
            .iter()
            .map(|p| Arc::strong_count(p) - 2)
            .sum()
    }
}

impl<R: Registrar> fmt::Debug for RegistrationCache<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistrationCache")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}
