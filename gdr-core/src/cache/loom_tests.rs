//! loom models of the cache's races. Run with
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p gdr-core --release --lib loom`,
//! and against their mutants with `scripts/loom-mutants.sh` (CI does).
//!
//! Each model is named after a race and checks only what a caller can
//! observe: which registration a request gets, whether a range is still
//! cached, the counters, how many registrations are alive (the test
//! registrar counts them) and what the MR budget and the memory's leases
//! count. Each must fail on a deliberate bug, a *mutant*
//! ([`super::mutant`]) planted by `GDR_MUTANT=<name>` in the loom build:
//! its doc names the mutants it catches, and `scripts/loom-mutants.sh`
//! requires each of those runs to fail.
//!
//! No model needs a preemption bound: each is explored exhaustively. Measured
//! unbounded (release build, one core of the 2-core CI machine):
//!
//! | model | interleavings | time |
//! | --- | ---: | ---: |
//! | `concurrent_lookup_and_insert_of_overlapping_ranges` | 20431 | 1.6 s |
//! | `invalidate_allocation_racing_a_registration_in_flight` | 3237 | 0.5 s |
//! | `a_waiter_racing_an_eviction` | 2140 | 0.3 s |
//! | `invalidate_racing_a_registration_in_flight` | 1770 | 0.2 s |
//! | `a_failed_registration_is_shared_with_its_waiters` | 1160 | 0.2 s |
//! | `lookup_racing_eviction` | 632 | 0.1 s |
//! | `concurrent_registrations_never_pass_the_mr_budget` | 594 | 0.02 s |
//! | `dropping_a_buffer_waits_for_an_escaped_handle` | 460 | 0.01 s |
//! | `concurrent_misses_on_one_range_register_once` | 391 | 0.05 s |
//! | `an_abandoned_registration_is_retried_by_its_waiters` | 390 | 0.06 s |
//! | `refcount_reaching_zero_while_an_eviction_runs` | 370 | 0.06 s |
//! | `trim_and_set_limits_racing_a_hit` | 99 | 0.01 s |
//! | `a_reused_address_racing_a_lookup_of_the_old_allocation` | 79 | 0.01 s |
//! | `invalidate_racing_a_hit` | 52 | 0.01 s |

use loom::sync::Arc;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;

use super::*;
use crate::lifetime::{LeaseCount, Leased, MemoryLease};

/// A registration: which registrar call made it, for which allocation, and
/// the generation of the memory then (see [`Reg::generation`]).
#[derive(Debug)]
struct Mr {
    call: usize,
    identity: AllocationIdentity,
    generation: usize,
    live: Arc<AtomicUsize>,
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Debug, thiserror::Error)]
#[error("registrar call {call} refused")]
struct Refused {
    call: usize,
}

/// What the registrar's first call does (later calls succeed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum First {
    Succeed,
    /// Fails with [`Refused`].
    Fail,
    /// Panics with [`DELIBERATE`].
    Panic,
}

const DELIBERATE: &str = "the registrar panicked (deliberately)";

/// The test registrar: counts its calls and the registrations alive.
#[derive(Debug)]
struct Reg {
    calls: AtomicUsize,
    live: Arc<AtomicUsize>,
    /// The memory's generation: a model bumps it when the memory is about to
    /// be freed (before it invalidates), so a registration made before the
    /// invalidation carries the old generation.
    generation: AtomicUsize,
    first: First,
    /// The cache the registrar works for, when the model wants the first
    /// call to record how many requests wait inside it ([`Reg::waiters`]).
    cache: std::sync::OnceLock<Arc<Cache>>,
    /// The requests waiting inside the first call's range when it ended
    /// (they are sure to get its outcome).
    waiters: AtomicUsize,
}

impl Reg {
    fn new() -> Arc<Self> {
        Self::with(First::Succeed)
    }

    fn with(first: First) -> Arc<Self> {
        Arc::new(Self {
            calls: AtomicUsize::new(0),
            live: Arc::new(AtomicUsize::new(0)),
            generation: AtomicUsize::new(0),
            first,
            cache: std::sync::OnceLock::new(),
            waiters: AtomicUsize::new(0),
        })
    }

    /// The registrar of `cache`, recording its first call's waiters.
    fn serving(first: First, cache: &Arc<Cache>) -> Arc<Self> {
        let reg = Self::with(first);
        assert!(reg.cache.set(Arc::clone(cache)).is_ok());
        reg
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }
}

impl Registrar for Reg {
    type Registration = Mr;
    type Error = Refused;
    fn register(&self, request: &Request) -> Result<Mr, Refused> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(cache) = self.cache.get().filter(|_| call == 1) {
            self.waiters.store(covered_waiters(cache), Ordering::SeqCst);
        }
        match self.first {
            First::Fail if call == 1 => return Err(Refused { call }),
            First::Panic if call == 1 => std::panic::panic_any(DELIBERATE),
            _ => {}
        }
        self.live.fetch_add(1, Ordering::SeqCst);
        Ok(Mr {
            call,
            identity: request.identity,
            generation: self.generation.load(Ordering::SeqCst),
            live: Arc::clone(&self.live),
        })
    }
}

type Cache = RegistrationCache<Reg>;

fn cache(max_entries: u64) -> Arc<Cache> {
    Arc::new(RegistrationCache::new(CacheConfig {
        limits: Limits {
            max_bytes: u64::MAX,
            max_entries,
        },
        eviction_headroom_percent: 0,
        shards: 1,
        read_replicas: 2,
    }))
}

/// Runs `model` under loom, and checks that loom did explore more than one
/// interleaving (a model whose threads loom sees as independent would pass
/// vacuously).
pub(crate) fn explore(name: &str, model: impl Fn() + Sync + Send + 'static) {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = std::sync::Arc::clone(&runs);
    let started = std::time::Instant::now();
    loom::model(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        model();
    });
    let runs = runs.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "loom: {name}: {runs} interleavings in {:.2?}",
        started.elapsed()
    );
    assert!(runs > 1, "{name}: loom explored a single interleaving");
}

/// Once no handle is held: trimming leaves nothing cached, and every
/// registration has been deregistered (none leaked by a lost use count).
fn settle(cache: &Cache, reg: &Reg) {
    cache.trim();
    let s = cache.stats();
    assert_eq!((s.entries, s.bytes_cached), (0, 0), "left cached: {s:?}");
    assert_eq!(reg.live(), 0, "registrations alive with no handle: {s:?}");
}

/// Requests waiting inside a registration in flight (peeked under the
/// shard's lock).
fn covered_waiters(cache: &Cache) -> usize {
    cache.shards[0]
        .write()
        .meta
        .pending
        .iter()
        .map(|p| p.covered_waiters.load(Ordering::Relaxed))
        .sum()
}

/// Silences the default panic message of [`DELIBERATE`] panics (loom
/// explores one per interleaving); other panics print as usual.
fn quiet_deliberate_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() != Some(&DELIBERATE) {
                default(info);
            }
        }));
    });
}

fn host(start: u64, len: u64) -> Request {
    Request::host(1, start, len)
}

/// Two overlapping requests race; whatever the order, one merged
/// registration covers both at the end.
///
/// Catches `overlap-ignores-pending`: the second registers its own range
/// beside the first's in flight, and the later insertion replaces the other.
#[test]
fn concurrent_lookup_and_insert_of_overlapping_ranges() {
    explore("concurrent_lookup_and_insert_of_overlapping_ranges", || {
        let (cache, reg) = (cache(u64::MAX), Reg::new());
        let t = {
            let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
            thread::spawn(move || {
                let h = cache.get_or_register(&*reg, &host(0x0, 0x2000)).unwrap();
                assert!(h.start() == 0 && h.end() >= 0x2000);
            })
        };
        let h = cache.get_or_register(&*reg, &host(0x1000, 0x2000)).unwrap();
        assert!(h.start() <= 0x1000 && h.end() == 0x3000);
        drop(h);
        t.join().unwrap();
        let s = cache.stats();
        assert_eq!((s.entries, s.bytes_cached), (1, 0x3000), "{s:?}");
        assert!(cache.get(&host(0x0, 0x3000)).is_some());
        assert_eq!(reg.live(), 1);
        assert!(reg.calls() <= 2);
        settle(&cache, &reg);
    });
}

/// Two misses on one range: one registers, the other waits for it.
///
/// Catches `no-dedupe`: both register.
#[test]
fn concurrent_misses_on_one_range_register_once() {
    explore("concurrent_misses_on_one_range_register_once", || {
        let (cache, reg) = (cache(u64::MAX), Reg::new());
        let t = {
            let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
            thread::spawn(move || cache.get_or_register(&*reg, &host(0x0, 0x1000)).unwrap())
        };
        let mine = cache.get_or_register(&*reg, &host(0x0, 0x1000)).unwrap();
        let theirs = t.join().unwrap();
        assert!(mine.same_registration(&theirs));
        assert_eq!(reg.calls(), 1);
        let s = cache.stats();
        assert_eq!((s.hits, s.misses), (1, 1));
        drop((mine, theirs));
        settle(&cache, &reg);
    });
}

/// A hit races an insertion that evicts past a limit of one entry: the hit
/// either comes first and pins the entry, or finds nothing.
///
/// Catches `count-use-after-unlock`: the hit counts its use after the read
/// lock, the eviction sees the entry unused in between and unlinks it.
#[test]
fn lookup_racing_eviction() {
    explore("lookup_racing_eviction", || {
        let (cache, reg) = (cache(1), Reg::new());
        drop(cache.get_or_register(&*reg, &host(0x0, 0x1000)).unwrap());
        let t = {
            let cache = Arc::clone(&cache);
            thread::spawn(move || {
                let hit = cache.get(&host(0x0, 0x1000));
                if let Some(h) = &hit {
                    // In use: never evicted.
                    let again = cache.get(&host(0x0, 0x1000)).expect("evicted in use");
                    assert!(again.same_registration(h));
                }
                hit.is_some()
            })
        };
        let b = cache.get_or_register(&*reg, &host(0x8000, 0x1000)).unwrap();
        let hit = t.join().unwrap();
        let s = cache.stats();
        assert_eq!(s.entries + s.evictions, 2);
        if !hit {
            assert_eq!(s.evictions, 1);
        }
        drop(b);
        assert_eq!(reg.live() as u64, s.entries);
        settle(&cache, &reg);
    });
}

/// An invalidation races a hit: the range is uncached when `invalidate`
/// returns, and the held registration is deregistered when its handle drops.
///
/// Catches `invalidate-skips-in-use`: an entry held during the invalidation
/// stays cached.
#[test]
fn invalidate_racing_a_hit() {
    explore("invalidate_racing_a_hit", || {
        let (cache, reg) = (cache(u64::MAX), Reg::new());
        drop(cache.get_or_register(&*reg, &host(0x0, 0x1000)).unwrap());
        let t = {
            let cache = Arc::clone(&cache);
            thread::spawn(move || {
                if let Some(h) = cache.get(&host(0x0, 0x1000)) {
                    thread::yield_now();
                    assert_eq!(h.registration().call, 1);
                }
            })
        };
        assert_eq!(cache.invalidate(0x0, 0x1000), 1);
        assert!(cache.get(&host(0x0, 0x1000)).is_none());
        t.join().unwrap();
        let s = cache.stats();
        assert_eq!((s.entries, s.invalidations), (0, 1), "{s:?}");
        assert_eq!(reg.live(), 0, "deregistered after the hit");
    });
}

/// A handle's last drop races an eviction: the entry is evicted only if the
/// eviction saw it unused; never while a handle holds it.
///
/// Catches `evict-in-use`.
#[test]
fn refcount_reaching_zero_while_an_eviction_runs() {
    explore("refcount_reaching_zero_while_an_eviction_runs", || {
        let (cache, reg) = (cache(1), Reg::new());
        let a = cache.get_or_register(&*reg, &host(0x0, 0x1000)).unwrap();
        let t = {
            let cache = Arc::clone(&cache);
            thread::spawn(move || {
                assert!(cache.get(&host(0x0, 0x1000)).is_some(), "evicted in use");
                drop(a);
            })
        };
        let b = cache.get_or_register(&*reg, &host(0x8000, 0x1000)).unwrap();
        t.join().unwrap();
        let s = cache.stats();
        assert_eq!(s.entries + s.evictions, 2);
        assert_eq!(
            cache.get(&host(0x0, 0x1000)).is_some(),
            s.evictions == 0,
            "{s:?}"
        );
        drop(b);
        assert_eq!(reg.live() as u64, s.entries);
        settle(&cache, &reg);
    });
}

/// An invalidation races a registration in flight over its range. The
/// caller stops using the memory (the model bumps its generation) and then
/// invalidates: once `invalidate` has returned, no registration made before
/// may be returned from the cache, whether it was cached or in flight then.
///
/// Catches `no-invalidate-pending`: the registration in flight is cached
/// after the invalidation, and a later lookup hits the freed memory's MR.
#[test]
fn invalidate_racing_a_registration_in_flight() {
    explore("invalidate_racing_a_registration_in_flight", || {
        let (cache, reg) = (cache(u64::MAX), Reg::new());
        let t = {
            let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
            thread::spawn(move || {
                // Handed to its caller either way.
                cache.get_or_register(&*reg, &host(0x0, 0x1000)).unwrap();
            })
        };
        reg.generation.store(1, Ordering::SeqCst);
        let invalidated = cache.invalidate(0x0, 0x1000);
        t.join().unwrap();
        if let Some(h) = cache.get(&host(0x0, 0x1000)) {
            assert_eq!(
                h.registration().generation,
                1,
                "a registration older than the invalidation is still cached"
            );
        }
        let s = cache.stats();
        assert!(invalidated + s.entries as usize <= 1);
        assert_eq!(reg.live() as u64, s.entries);
        settle(&cache, &reg);
    });
}

/// A waiter inside a registration in flight shares the entry, which is born
/// with a use for it: it stays in use (never evicted, never trimmed) while
/// either handle is held, and is evicted once neither is.
///
/// Catches `no-covered-waiter-count`: the waiter's use is not counted, so
/// the entry reads unused while the waiter still holds it.
#[test]
fn a_waiter_racing_an_eviction() {
    explore("a_waiter_racing_an_eviction", || {
        let (cache, reg) = (cache(1), Reg::new());
        let t = {
            let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
            thread::spawn(move || cache.get_or_register(&*reg, &host(0x0, 0x1000)).unwrap())
        };
        // Same range (one registers, one may wait on it), then an insertion
        // past the limit of one entry.
        let a = cache.get_or_register(&*reg, &host(0x0, 0x1000)).unwrap();
        let b = cache.get_or_register(&*reg, &host(0x8000, 0x1000)).unwrap();
        let theirs = t.join().unwrap();
        assert!(a.same_registration(&theirs));
        assert!(cache.get(&host(0x0, 0x1000)).is_some(), "evicted in use");
        drop((b, theirs));
        cache.trim();
        assert!(cache.get(&host(0x0, 0x1000)).is_some(), "trimmed in use");
        drop(a);
        settle(&cache, &reg);
    });
}

/// The registrar fails while another request may wait inside its range: a
/// waiter gets the same failure (it does not register again: the registrar
/// records whether one waited), a later request registers anew (the failure
/// is not cached).
///
/// Catches `waiter-retries-failure` (the waiter calls the registrar itself)
/// and `failed-stays-pending` (a later request is served the old failure).
#[test]
fn a_failed_registration_is_shared_with_its_waiters() {
    explore("a_failed_registration_is_shared_with_its_waiters", || {
        let cache = cache(u64::MAX);
        let reg = Reg::serving(First::Fail, &cache);
        let t = {
            let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
            thread::spawn(move || cache.get_or_register(&*reg, &host(0x0, 0x1000)))
        };
        let mine = cache.get_or_register(&*reg, &host(0x0, 0x1000));
        let theirs = t.join().unwrap();
        let source = |e| match e {
            CacheError::Register { source, .. } => source,
            other => panic!("not the registrar's failure: {other:?}"),
        };
        match (mine, theirs) {
            (Err(a), Err(b)) => {
                let (a, b) = (source(a), source(b));
                assert!(std::sync::Arc::ptr_eq(&a, &b), "two failures");
                assert_eq!((a.call, reg.calls()), (1, 1));
            }
            (Err(failed), Ok(registered)) | (Ok(registered), Err(failed)) => {
                assert_eq!(source(failed).call, 1);
                assert_eq!(registered.registration().call, 2);
                assert_eq!(
                    reg.waiters.load(Ordering::SeqCst),
                    0,
                    "a waiter did not get the failure it waited for"
                );
            }
            (Ok(_), Ok(_)) => panic!("the registrar's failure was lost"),
        }
        let again = cache.get_or_register(&*reg, &host(0x0, 0x1000));
        assert_eq!(
            again.expect("the failure was cached").registration().call,
            2
        );
        assert_eq!(cache.stats().failures, 1);
        settle(&cache, &reg);
    });
}

/// The registrar panics while another request may wait inside its range: a
/// waiter is woken and registers itself (it never hangs), and the panic
/// leaves nothing behind.
///
/// Catches `abandon-not-finished` (the waiter is never woken: loom reports
/// the deadlock) and `abandoned-stays-pending` (the waiter finds the
/// abandoned slot again, forever: loom's branch limit ends it).
#[test]
fn an_abandoned_registration_is_retried_by_its_waiters() {
    quiet_deliberate_panics();
    explore(
        "an_abandoned_registration_is_retried_by_its_waiters",
        || {
            let (cache, reg) = (cache(u64::MAX), Reg::with(First::Panic));
            // The registrar call that made the registration, or the panic.
            let call = |cache: &Cache, reg: &Reg| {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let h = cache.get_or_register(reg, &host(0x0, 0x1000));
                    h.map(|h| h.registration().call)
                }))
            };
            let t = {
                let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
                thread::spawn(move || call(&cache, &reg))
            };
            let mine = call(&cache, &reg);
            let theirs = t.join().unwrap();
            // One panicked; the other registered (the second call), after
            // waiting for the first or not.
            let calls = match (mine, theirs) {
                (Err(_), Ok(Ok(call))) | (Ok(Ok(call)), Err(_)) => call,
                _ => panic!("expected one panic and one registration"),
            };
            assert_eq!((calls, reg.calls()), (2, 2));
            let s = cache.stats();
            assert_eq!((s.entries, s.failures), (1, 0), "{s:?}");
            settle(&cache, &reg);
        },
    );
}

/// An address is reused by another allocation (GPU memory freed and
/// re-allocated: a new buffer id) while the old allocation's entry is
/// cached and looked up: the new allocation never gets the old registration,
/// the old entry is detected stale and unlinked, and the old allocation's
/// lookup gets its own registration or nothing.
///
/// Catches `stale-entry-hits`.
#[test]
fn a_reused_address_racing_a_lookup_of_the_old_allocation() {
    explore(
        "a_reused_address_racing_a_lookup_of_the_old_allocation",
        || {
            let old = Request::device(1, 0, 7, 0x0, 0x1000);
            let new = Request::device(1, 0, 8, 0x0, 0x1000);
            let (cache, reg) = (cache(u64::MAX), Reg::new());
            drop(cache.get_or_register(&*reg, &old).unwrap());
            let t = {
                let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
                thread::spawn(move || {
                    let h = cache.get_or_register(&*reg, &new).unwrap();
                    assert_eq!(h.registration().identity, new.identity, "stale hit");
                })
            };
            if let Some(h) = cache.get(&old) {
                assert_eq!(h.registration().identity, old.identity);
            }
            t.join().unwrap();
            assert!(cache.get(&old).is_none());
            let h = cache.get(&new).expect("the new allocation is cached");
            assert_eq!(h.registration().identity, new.identity);
            drop(h);
            let s = cache.stats();
            assert_eq!((s.stale_detections, s.entries), (1, 1), "{s:?}");
            settle(&cache, &reg);
        },
    );
}

/// `invalidate_allocation` races a registration of the allocation in flight
/// (by address) and unlinks its cached dma-buf entry: once it has returned,
/// nothing of the allocation registered before is served from the cache.
///
/// Catches `allocation-invalidation-misses-pending`.
#[test]
fn invalidate_allocation_racing_a_registration_in_flight() {
    explore(
        "invalidate_allocation_racing_a_registration_in_flight",
        || {
            let by_address = Request::device(1, 0, 7, 0x0, 0x1000);
            let dmabuf = Request::dmabuf(1, 0, 7, 0x0, 0x1000);
            let (cache, reg) = (cache(u64::MAX), Reg::new());
            drop(cache.get_or_register(&*reg, &dmabuf).unwrap());
            let t = {
                let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
                thread::spawn(move || {
                    cache.get_or_register(&*reg, &by_address).unwrap();
                })
            };
            reg.generation.store(1, Ordering::SeqCst);
            let invalidated = cache.invalidate_allocation(7);
            assert!(cache.get(&dmabuf).is_none(), "the dma-buf entry survived");
            t.join().unwrap();
            if let Some(h) = cache.get(&by_address) {
                assert_eq!(
                    h.registration().generation,
                    1,
                    "a registration older than the invalidation is still cached"
                );
            }
            let s = cache.stats();
            assert!((1..=2).contains(&invalidated), "{invalidated}");
            assert_eq!(reg.live() as u64, s.entries);
            settle(&cache, &reg);
        },
    );
}

/// `set_limits` (down to no entries) and `trim` race a hit: both evict every
/// unused entry at once, and neither evicts the entry the hit holds.
///
/// Catches `set-limits-no-evict` (an unused entry stays past the new limit)
/// and `trim-evicts-in-use` (the held entry is trimmed).
#[test]
fn trim_and_set_limits_racing_a_hit() {
    explore("trim_and_set_limits_racing_a_hit", || {
        let (cache, reg) = (cache(u64::MAX), Reg::new());
        drop(cache.get_or_register(&*reg, &host(0x0, 0x1000)).unwrap());
        drop(cache.get_or_register(&*reg, &host(0x8000, 0x1000)).unwrap());
        let t = {
            let cache = Arc::clone(&cache);
            thread::spawn(move || {
                if let Some(h) = cache.get(&host(0x0, 0x1000)) {
                    thread::yield_now();
                    let again = cache.get(&host(0x0, 0x1000)).expect("evicted in use");
                    assert!(again.same_registration(&h));
                }
            })
        };
        cache.set_limits(
            1,
            Limits {
                max_bytes: u64::MAX,
                max_entries: 0,
            },
        );
        assert!(
            cache.get(&host(0x8000, 0x1000)).is_none(),
            "an unused entry stayed past the limits"
        );
        cache.trim();
        t.join().unwrap();
        settle(&cache, &reg);
    });
}

/// A registration as the ladder makes one (`NicRegistration`): the MR, then
/// its share of the domain's budget, then its lease on the buffer's memory;
/// field order is drop order, so the memory is released last.
#[derive(Debug)]
struct LeasedMr {
    mr: Mr,
    _reservation: Reservation,
    _lease: Option<MemoryLease>,
}

/// A buffer's memory, as leases see it.
#[derive(Debug)]
struct Memory {
    leases: LeaseCount,
}

impl Leased for Memory {
    fn leases(&self) -> &LeaseCount {
        &self.leases
    }
}

type Budget = Box<dyn Fn(u64) -> Result<Reservation, BudgetExceeded> + Send + Sync>;

/// Registers as the ladder does: a budget reservation first (refused past
/// the budget), then the MR, which holds a lease on `memory` if any.
struct Leasing {
    reg: Arc<Reg>,
    reserve: Budget,
    usage: Box<dyn Fn() -> BudgetUsage + Send + Sync>,
    memory: Option<std::sync::Arc<dyn Leased>>,
}

impl Leasing {
    fn new(max_mrs: u64, memory: Option<std::sync::Arc<dyn Leased>>) -> Arc<Self> {
        let budget = DomainBudget::new(BudgetLimits {
            max_mrs,
            max_bytes: u64::MAX,
        });
        let for_usage = budget.clone();
        Arc::new(Self {
            reg: Reg::new(),
            reserve: Box::new(move |bytes| budget.reserve(bytes)),
            usage: Box::new(move || for_usage.usage()),
            memory,
        })
    }
}

impl Registrar for Leasing {
    type Registration = LeasedMr;
    type Error = BudgetExceeded;
    fn register(&self, request: &Request) -> Result<LeasedMr, BudgetExceeded> {
        let reservation = (self.reserve)(request.len)?;
        let mr = self.reg.register(request).expect("this registrar succeeds");
        Ok(LeasedMr {
            mr,
            _reservation: reservation,
            _lease: self.memory.as_ref().map(MemoryLease::new),
        })
    }
}

fn leasing_cache() -> Arc<RegistrationCache<Leasing>> {
    Arc::new(RegistrationCache::new(CacheConfig {
        limits: Limits::UNLIMITED,
        eviction_headroom_percent: 0,
        shards: 1,
        read_replicas: 2,
    }))
}

/// A buffer over caller memory is dropped (its owner's entries unlinked,
/// then a wait for its leases) while a handle that escaped it is still
/// used and dropped on another thread: the wait returns only once no MR
/// over the memory is alive, and leaves nothing cached over it.
///
/// Catches `owner-invalidation-skips-in-use` (the entry held by the handle
/// stays cached, its lease with it: the wait never ends, loom reports the
/// deadlock) and `lease-release-no-notify` (the last lease goes without
/// waking the wait: deadlock).
#[test]
fn dropping_a_buffer_waits_for_an_escaped_handle() {
    explore("dropping_a_buffer_waits_for_an_escaped_handle", || {
        let memory: std::sync::Arc<dyn Leased> = std::sync::Arc::new(Memory {
            leases: LeaseCount::new(),
        });
        let (cache, reg) = (
            leasing_cache(),
            Leasing::new(u64::MAX, Some(memory.clone())),
        );
        let request = host(0x0, 0x1000).within(5, Bounds::new(0x0, 0x1000));
        let escaped = cache.get_or_register(&*reg, &request).unwrap();
        let t = thread::spawn(move || {
            let again = escaped.clone();
            drop(escaped);
            assert_eq!(again.registration().mr.call, 1);
            drop(again);
        });
        // The buffer's drop.
        cache.invalidate_owner(5);
        assert!(
            memory
                .leases()
                .wait_released(Some(std::time::Duration::from_secs(60)))
        );
        assert_eq!(reg.reg.live(), 0, "an MR outlives the wait for its memory");
        assert!(cache.get(&request).is_none());
        assert_eq!((reg.usage)().mrs, 0);
        t.join().unwrap();
    });
}

/// Two registrations race for a domain budget of one MR: one gets it, the
/// other is refused (never a second live MR); once the first is unused,
/// trimming gives the budget back and the refused one succeeds.
///
/// Catches `budget-check-then-act` (both pass the check: two live MRs).
#[test]
fn concurrent_registrations_never_pass_the_mr_budget() {
    explore("concurrent_registrations_never_pass_the_mr_budget", || {
        let (cache, reg) = (leasing_cache(), Leasing::new(1, None));
        let t = {
            let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
            thread::spawn(move || cache.get_or_register(&*reg, &host(0x0, 0x1000)).ok())
        };
        let mine = cache.get_or_register(&*reg, &host(0x8000, 0x1000)).ok();
        let theirs = t.join().unwrap();
        let usage = (reg.usage)();
        assert_eq!(
            (usage.peak_mrs, reg.reg.live()),
            (1, 1),
            "past the budget: {usage:?}"
        );
        let refused = match (mine, theirs) {
            (Some(_), None) => host(0x0, 0x1000),
            (None, Some(_)) => host(0x8000, 0x1000),
            _ => panic!("expected one registration and one refusal"),
        };
        assert!(cache.get_or_register(&*reg, &refused).is_err());
        assert_eq!(cache.trim(), 1);
        assert!(cache.get_or_register(&*reg, &refused).is_ok());
        cache.trim();
        assert_eq!(((reg.usage)().mrs, reg.reg.live()), (0, 0));
    });
}
