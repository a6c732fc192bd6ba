//! loom models of the cache's races. Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p gdr-core --release --lib`.
//!
//! Each model is small (a couple of threads, one or two ranges) so it is
//! explored exhaustively within the preemption bound in seconds.

use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::thread;

use super::*;

/// A registration that knows whether it has been deregistered.
#[derive(Debug)]
struct Mr {
    dead: Arc<AtomicBool>,
    live: Arc<AtomicUsize>,
    drops: Arc<AtomicUsize>,
}

impl Mr {
    fn assert_alive(&self) {
        assert!(
            !self.dead.load(Ordering::SeqCst),
            "used after deregistration"
        );
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        assert!(
            !self.dead.swap(true, Ordering::SeqCst),
            "deregistered twice"
        );
        self.live.fetch_sub(1, Ordering::SeqCst);
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

#[derive(Debug, thiserror::Error)]
#[error("never")]
struct Never;

#[derive(Debug, Default)]
struct Reg {
    calls: AtomicUsize,
    live: Arc<AtomicUsize>,
    drops: Arc<AtomicUsize>,
}

impl Registrar for Reg {
    type Registration = Mr;
    type Error = Never;
    fn register(&self, _: &Request) -> Result<Mr, Never> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.live.fetch_add(1, Ordering::SeqCst);
        Ok(Mr {
            dead: Arc::new(AtomicBool::new(false)),
            live: Arc::clone(&self.live),
            drops: Arc::clone(&self.drops),
        })
    }
}

fn cache(max_entries: u64) -> Arc<RegistrationCache<Reg>> {
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
fn explore(name: &str, model: impl Fn() + Sync + Send + 'static) {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = std::sync::Arc::clone(&runs);
    loom::model(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        model();
    });
    let runs = runs.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("loom: {name}: {runs} interleavings");
    assert!(runs > 1, "{name}: loom explored a single interleaving");
}

fn host(start: u64, len: u64) -> Request {
    Request::host(1, start, len)
}

#[test]
fn concurrent_lookup_and_insert_of_overlapping_ranges() {
    explore("concurrent_lookup_and_insert_of_overlapping_ranges", || {
        let (cache, reg) = (cache(u64::MAX), Arc::new(Reg::default()));
        let t = {
            let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
            thread::spawn(move || {
                let h = cache.get_or_register(&reg, &host(0x0, 0x2000)).unwrap();
                assert!(h.start() == 0 && h.end() >= 0x2000);
                h.registration().assert_alive();
            })
        };
        let h = cache.get_or_register(&reg, &host(0x1000, 0x2000)).unwrap();
        assert!(h.start() <= 0x1000 && h.end() == 0x3000);
        h.registration().assert_alive();
        drop(h);
        t.join().unwrap();
        // Whatever the order, one merged registration covers both at the end.
        let s = cache.stats();
        assert_eq!((s.entries, s.bytes_cached), (1, 0x3000));
        assert!(cache.get(&host(0x0, 0x3000)).is_some());
        assert_eq!(reg.live.load(Ordering::SeqCst), 1);
        assert!(reg.calls.load(Ordering::SeqCst) <= 2);
    });
}

#[test]
fn concurrent_misses_on_one_range_register_once() {
    explore("concurrent_misses_on_one_range_register_once", || {
        let (cache, reg) = (cache(u64::MAX), Arc::new(Reg::default()));
        let t = {
            let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
            thread::spawn(move || cache.get_or_register(&reg, &host(0x0, 0x1000)).unwrap())
        };
        let mine = cache.get_or_register(&reg, &host(0x0, 0x1000)).unwrap();
        let theirs = t.join().unwrap();
        assert!(mine.same_registration(&theirs));
        assert_eq!(reg.calls.load(Ordering::SeqCst), 1);
        let s = cache.stats();
        assert_eq!((s.hits, s.misses), (1, 1));
    });
}

#[test]
fn lookup_racing_eviction() {
    explore("lookup_racing_eviction", || {
        let (cache, reg) = (cache(1), Arc::new(Reg::default()));
        drop(cache.get_or_register(&reg, &host(0x0, 0x1000)).unwrap());
        let t = {
            let cache = Arc::clone(&cache);
            thread::spawn(move || {
                // A hit either happens before the eviction (and pins the
                // entry) or finds nothing; never a dead registration.
                let hit = cache.get(&host(0x0, 0x1000));
                if let Some(h) = &hit {
                    h.registration().assert_alive();
                    // In use: never evicted.
                    let again = cache.get(&host(0x0, 0x1000)).expect("evicted in use");
                    assert!(again.same_registration(h));
                }
                hit.is_some()
            })
        };
        // Past the limit of one entry: evicts the first unless it is in use.
        let b = cache.get_or_register(&reg, &host(0x8000, 0x1000)).unwrap();
        b.registration().assert_alive();
        let hit = t.join().unwrap();
        let s = cache.stats();
        assert_eq!(s.entries + s.evictions, 2);
        if !hit {
            assert_eq!(s.evictions, 1);
        }
        drop(b);
        assert_eq!(reg.live.load(Ordering::SeqCst) as u64, s.entries);
    });
}

#[test]
fn invalidate_racing_a_hit() {
    explore("invalidate_racing_a_hit", || {
        let (cache, reg) = (cache(u64::MAX), Arc::new(Reg::default()));
        drop(cache.get_or_register(&reg, &host(0x0, 0x1000)).unwrap());
        let t = {
            let cache = Arc::clone(&cache);
            thread::spawn(move || {
                if let Some(h) = cache.get(&host(0x0, 0x1000)) {
                    // Invalidated or not, it stays registered while held.
                    h.registration().assert_alive();
                    thread::yield_now();
                    h.registration().assert_alive();
                }
            })
        };
        assert_eq!(cache.invalidate(0x0, 0x1000), 1);
        assert!(cache.get(&host(0x0, 0x1000)).is_none());
        t.join().unwrap();
        assert_eq!(cache.stats().entries, 0);
        assert_eq!(
            reg.live.load(Ordering::SeqCst),
            0,
            "deregistered after the hit"
        );
        assert_eq!(reg.drops.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn refcount_reaching_zero_while_an_eviction_runs() {
    explore("refcount_reaching_zero_while_an_eviction_runs", || {
        let (cache, reg) = (cache(1), Arc::new(Reg::default()));
        let a = cache.get_or_register(&reg, &host(0x0, 0x1000)).unwrap();
        let t = {
            let cache = Arc::clone(&cache);
            thread::spawn(move || {
                a.registration().assert_alive();
                assert!(cache.get(&host(0x0, 0x1000)).is_some(), "evicted in use");
                drop(a);
            })
        };
        let b = cache.get_or_register(&reg, &host(0x8000, 0x1000)).unwrap();
        t.join().unwrap();
        let s = cache.stats();
        // The eviction saw the handle (A stays, over the limit) or saw it
        // gone (A evicted): never lost, never dropped twice (Mr's Drop).
        assert_eq!(s.entries + s.evictions, 2);
        assert_eq!(
            cache.get(&host(0x0, 0x1000)).is_some(),
            s.evictions == 0,
            "{s:?}"
        );
        drop(b);
        assert_eq!(reg.live.load(Ordering::SeqCst) as u64, s.entries);
        assert_eq!(reg.drops.load(Ordering::SeqCst) as u64, s.evictions);
    });
}

#[test]
fn invalidate_racing_a_registration_in_flight() {
    explore("invalidate_racing_a_registration_in_flight", || {
        let (cache, reg) = (cache(u64::MAX), Arc::new(Reg::default()));
        let t = {
            let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
            thread::spawn(move || {
                let h = cache.get_or_register(&reg, &host(0x0, 0x1000)).unwrap();
                h.registration().assert_alive();
            })
        };
        let invalidated = cache.invalidate(0x0, 0x1000);
        t.join().unwrap();
        let s = cache.stats();
        // Cached only if the registration was published after (or not
        // over) the invalidation; never both invalidated and cached.
        assert!(invalidated + s.entries as usize <= 1);
        assert_eq!(reg.live.load(Ordering::SeqCst) as u64, s.entries);
    });
}

#[test]
fn a_waiter_racing_an_eviction() {
    explore("a_waiter_racing_an_eviction", || {
        let (cache, reg) = (cache(1), Arc::new(Reg::default()));
        let t = {
            let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
            thread::spawn(move || {
                let h = cache.get_or_register(&reg, &host(0x0, 0x1000)).unwrap();
                h.registration().assert_alive();
                h
            })
        };
        // Same range (one registers, one may wait on it), then an insertion
        // past the limit of one entry.
        let a = cache.get_or_register(&reg, &host(0x0, 0x1000)).unwrap();
        let b = cache.get_or_register(&reg, &host(0x8000, 0x1000)).unwrap();
        let theirs = t.join().unwrap();
        a.registration().assert_alive();
        b.registration().assert_alive();
        theirs.registration().assert_alive();
        // `a` was held throughout: its entry was never evicted.
        assert!(cache.get(&host(0x0, 0x1000)).is_some());
        drop((a, b, theirs));
        let s = cache.stats();
        assert_eq!(reg.live.load(Ordering::SeqCst) as u64, s.entries);
    });
}
