//! One shard: read replicas of its index (ordered maps of disjoint ranges),
//! per-domain usage, and the registrations in flight. Everything here runs under the shard's lock;
//! nothing here registers or deregisters (removed entries are handed back so
//! the caller drops them after unlocking).

use std::collections::{BTreeMap, HashMap};

use super::handle::Entry;
use super::key::{AllocationIdentity, DomainId, FxBuild, MemoryKind, Space, SpaceKey};
use super::stats::{Counters, stripe};
use super::{Limits, Pending, Registrar, mutant};
use crate::sync::{self, Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// What the index holds for a lookup.
pub(crate) enum Lookup<'a, T> {
    /// An entry of the same allocation covers the range.
    Hit(&'a Arc<Entry<T>>),
    /// An entry covers the range but belongs to another allocation.
    Stale,
    /// Nothing covers it.
    Miss,
}

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Usage {
    pub(crate) bytes: u64,
    pub(crate) entries: u64,
    pub(crate) limits: Option<Limits>,
}

type Victims<T> = Vec<Arc<Entry<T>>>;

/// One copy of a shard's ordered maps. Invariant: in each space, entries
/// are disjoint (so sorted by start they are sorted by end too, and at most
/// one entry can cover a range: the last one starting at or before it).
pub(crate) struct Index<T> {
    spaces: HashMap<SpaceKey, BTreeMap<u64, Arc<Entry<T>>>, FxBuild>,
}

impl<T> Index<T> {
    fn new() -> Self {
        Self {
            spaces: HashMap::default(),
        }
    }

    pub(crate) fn lookup(
        &self,
        space: SpaceKey,
        kind: MemoryKind,
        identity: AllocationIdentity,
        start: u64,
        end: u64,
    ) -> Lookup<'_, T> {
        let Some(map) = self.spaces.get(&space) else {
            return Lookup::Miss;
        };
        match map.range(..=start).next_back() {
            Some((_, entry)) if entry.covers(start, end) => {
                if entry.same_allocation(kind, identity) || mutant::active("stale-entry-hits") {
                    Lookup::Hit(entry)
                } else {
                    Lookup::Stale
                }
            }
            _ => Lookup::Miss,
        }
    }

    /// Entries of `space` overlapping `start..end`.
    fn overlapping(&self, space: SpaceKey, start: u64, end: u64) -> Vec<Arc<Entry<T>>> {
        let Some(map) = self.spaces.get(&space) else {
            return Vec::new();
        };
        map.range(..end)
            .rev()
            .take_while(|(_, e)| e.end > start)
            .map(|(_, e)| Arc::clone(e))
            .collect()
    }

    fn unlink(&mut self, space: SpaceKey, start: u64) -> Option<Arc<Entry<T>>> {
        let map = self.spaces.get_mut(&space)?;
        let entry = map.remove(&start)?;
        if map.is_empty() {
            self.spaces.remove(&space);
        }
        Some(entry)
    }

    fn link(&mut self, space: SpaceKey, entry: Arc<Entry<T>>) {
        self.spaces
            .entry(space)
            .or_default()
            .insert(entry.start, entry);
    }
}

/// What only writers touch: per-domain usage and the registrations in
/// flight.
pub(crate) struct Meta<R: Registrar> {
    usage: HashMap<DomainId, Usage, FxBuild>,
    /// Registrations in flight, by whoever missed first.
    pub(crate) pending: Vec<Arc<Pending<R>>>,
}

/// A copy of the index on a cache line of its own, so readers of different
/// replicas share no lock word.
#[repr(align(128))]
struct Replica<T>(RwLock<Index<T>>);

/// One shard: read replicas of its index and the writers' state.
///
/// A reader takes the read lock of one replica (picked by thread), so hits
/// from different threads write no common cache line. A writer takes the
/// writers' mutex and then every replica's write lock, in order, and
/// applies each change to every replica: all replicas are identical
/// whenever a reader can see one, and a writer excludes every reader (which
/// eviction relies on). Writers are rare (misses, evictions,
/// invalidations) and already pay for a registration.
pub(crate) struct Shard<R: Registrar> {
    meta: Mutex<Meta<R>>,
    replicas: Box<[Replica<R::Registration>]>,
}

impl<R: Registrar> Shard<R> {
    pub(crate) fn new(replicas: usize) -> Self {
        Self {
            meta: Mutex::new(Meta {
                usage: HashMap::default(),
                pending: Vec::new(),
            }),
            replicas: (0..replicas.max(1))
                .map(|_| Replica(RwLock::new(Index::new())))
                .collect(),
        }
    }

    /// This thread's replica, read-locked.
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Index<R::Registration>> {
        sync::read(&self.replicas[stripe() % self.replicas.len()].0)
    }

    /// Every replica, write-locked, and the writers' state.
    pub(crate) fn write(&self) -> ShardState<'_, R> {
        let meta = sync::lock(&self.meta);
        let replicas = self.replicas.iter().map(|r| sync::write(&r.0)).collect();
        ShardState { meta, replicas }
    }

    /// The writers' state only (no replica locked).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn meta(&self) -> MutexGuard<'_, Meta<R>> {
        sync::lock(&self.meta)
    }
}

/// A shard, write-locked. Reads go to the first replica; changes go to all.
pub(crate) struct ShardState<'a, R: Registrar> {
    pub(crate) meta: MutexGuard<'a, Meta<R>>,
    replicas: Vec<RwLockWriteGuard<'a, Index<R::Registration>>>,
}

impl<R: Registrar> ShardState<'_, R> {
    pub(crate) fn lookup(
        &self,
        space: SpaceKey,
        kind: MemoryKind,
        identity: AllocationIdentity,
        start: u64,
        end: u64,
    ) -> Lookup<'_, R::Registration> {
        self.replicas[0].lookup(space, kind, identity, start, end)
    }

    /// Entries of `space` overlapping `start..end`.
    pub(crate) fn overlapping(
        &self,
        space: SpaceKey,
        start: u64,
        end: u64,
    ) -> Vec<Arc<Entry<R::Registration>>> {
        self.replicas[0].overlapping(space, start, end)
    }

    /// Unlinks the entry starting at `start` in `space`.
    pub(crate) fn remove(
        &mut self,
        space: SpaceKey,
        start: u64,
        counters: &Counters,
    ) -> Option<Arc<Entry<R::Registration>>> {
        let mut removed = None;
        for replica in &mut self.replicas {
            removed = replica.unlink(space, start);
        }
        let entry = removed?;
        let usage = self.meta.usage.entry(space.domain).or_default();
        usage.bytes -= entry.len();
        usage.entries -= 1;
        Counters::sub(&counters.bytes_cached, entry.len());
        Counters::sub(&counters.entries, 1);
        Some(entry)
    }

    /// Links `entry`, unlinking every entry of its space it overlaps (they
    /// are superseded: merged into it, or left over from another allocation
    /// that raced with it). Returns those.
    pub(crate) fn insert(
        &mut self,
        space: SpaceKey,
        entry: Arc<Entry<R::Registration>>,
        counters: &Counters,
    ) -> Victims<R::Registration> {
        let victims: Victims<_> = self
            .overlapping(space, entry.start, entry.end)
            .into_iter()
            .filter_map(|e| self.remove(space, e.start, counters))
            .collect();
        let usage = self.meta.usage.entry(space.domain).or_default();
        usage.bytes += entry.len();
        usage.entries += 1;
        Counters::add(&counters.bytes_cached, entry.len());
        Counters::add(&counters.entries, 1);
        for replica in &mut self.replicas {
            replica.link(space, Arc::clone(&entry));
        }
        victims
    }

    pub(crate) fn limits(&self, domain: DomainId) -> Option<Limits> {
        self.meta.usage.get(&domain).and_then(|u| u.limits)
    }

    pub(crate) fn set_limits(&mut self, domain: DomainId, limits: Limits) {
        self.meta.usage.entry(domain).or_default().limits = Some(limits);
    }

    /// Evicts unused entries of `domain`, least recently used first, when it
    /// is past `limits`, down to `limits` less `headroom_percent`. Entries
    /// in use (a handle holds them) are skipped; so the domain can stay past
    /// its limits while they are in use.
    pub(crate) fn evict(
        &mut self,
        domain: DomainId,
        limits: Limits,
        headroom_percent: u8,
        counters: &Counters,
    ) -> Victims<R::Registration> {
        let Some(usage) = self.meta.usage.get(&domain).copied() else {
            return Vec::new();
        };
        if usage.bytes <= limits.max_bytes && usage.entries <= limits.max_entries {
            return Vec::new();
        }
        let headroom = u64::from(headroom_percent.min(100));
        let target_bytes = limits.max_bytes - limits.max_bytes / 100 * headroom;
        let target_entries = limits.max_entries - limits.max_entries / 100 * headroom;
        let _span = tracing::debug_span!(
            "evict",
            domain,
            bytes = usage.bytes,
            entries = usage.entries,
            target_bytes,
            target_entries
        )
        .entered();
        // Under the write lock no handle can be made from the index, so an
        // entry without users stays unused until the lock is released.
        let mut candidates: Vec<(u64, u64, SpaceKey, u64)> = self.replicas[0]
            .spaces
            .iter()
            .filter(|(space, _)| space.domain == domain)
            .flat_map(|(space, map)| {
                map.values()
                    .filter(|e| !e.in_use() || mutant::active("evict-in-use"))
                    .map(|e| {
                        (
                            e.last_used.load(crate::sync::atomic::Ordering::Relaxed),
                            e.seq,
                            *space,
                            e.start,
                        )
                    })
            })
            .collect();
        candidates.sort_unstable_by_key(|&(used, seq, _, _)| (used, seq));
        let mut victims = Vec::new();
        let mut left = usage;
        for (_, _, space, start) in candidates {
            if left.bytes <= target_bytes && left.entries <= target_entries {
                break;
            }
            if let Some(entry) = self.remove(space, start, counters) {
                left.bytes -= entry.len();
                left.entries -= 1;
                victims.push(entry);
            }
        }
        Counters::add(&counters.evictions, victims.len() as u64);
        tracing::debug!(evicted = victims.len(), "evicted");
        victims
    }

    /// Unlinks every entry for which `select` holds.
    pub(crate) fn remove_where(
        &mut self,
        select: impl FnMut(SpaceKey, &Arc<Entry<R::Registration>>) -> bool,
        counters: &Counters,
    ) -> Victims<R::Registration> {
        self.remove_where_in(|_| true, select, counters)
    }

    /// Unlinks every entry for which `select` holds, looking only in the
    /// spaces `spaces` accepts (a buffer's entries are found without
    /// walking every other buffer's).
    pub(crate) fn remove_where_in(
        &mut self,
        spaces: impl Fn(&SpaceKey) -> bool,
        mut select: impl FnMut(SpaceKey, &Arc<Entry<R::Registration>>) -> bool,
        counters: &Counters,
    ) -> Victims<R::Registration> {
        let doomed: Vec<(SpaceKey, u64)> = self.replicas[0]
            .spaces
            .iter()
            .filter(|(space, _)| spaces(space))
            .flat_map(|(space, map)| {
                map.values()
                    .filter(|e| select(*space, e))
                    .map(|e| (*space, e.start))
                    .collect::<Vec<_>>()
            })
            .collect();
        doomed
            .into_iter()
            .filter_map(|(space, start)| self.remove(space, start, counters))
            .collect()
    }

    /// Unlinks the entries of the address spaces overlapping `start..end`
    /// (of one domain, or all).
    pub(crate) fn remove_range(
        &mut self,
        domain: Option<DomainId>,
        start: u64,
        end: u64,
        counters: &Counters,
    ) -> Victims<R::Registration> {
        let spaces: Vec<SpaceKey> = self.replicas[0]
            .spaces
            .keys()
            .filter(|k| k.space == Space::Address && domain.is_none_or(|d| d == k.domain))
            .copied()
            .collect();
        let mut victims = Vec::new();
        for space in spaces {
            for e in self.overlapping(space, start, end) {
                if e.in_use() && mutant::active("invalidate-skips-in-use") {
                    continue;
                }
                victims.extend(self.remove(space, e.start, counters));
            }
        }
        victims
    }
}
