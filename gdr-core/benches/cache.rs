//! Registration cache benchmarks.
//!
//! - `hit/{1k,100k,1M}`: latency of a hit (lookup, handle, drop) at random
//!   among N cached entries of one domain. Goal: 1 M ≤ 2 × 1 k.
//! - `hit_hot/{1k,100k,1M}`: the same with lookups spread over a hot set
//!   of 1 k entries among the N (what a transfer engine reusing its buffers
//!   does): the index's own cost, without DRAM misses on cold entries.
//! - `hit_threads/{1,2,4,8}`: aggregate hits per second from T threads of
//!   one domain, 1 k entries, each thread its own random order. Goal: grows
//!   with threads (up to the machine's cores).
//! - `register16/{serial,planned}`: registering 16 buffers with a registrar
//!   that sleeps 2 ms (a stand-in for a slow `ibv_reg_mr`), one by one and
//!   through `register_all`. Goal: planned ≥ 3 × serial.
//!
//! Run: `cargo bench -p gdr-core --bench cache -- --warm-up-time 1 --measurement-time 3`.
// The loom build (model checking) has no planner and nothing to measure.
#![cfg_attr(loom, allow(unused_imports, dead_code))]

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gdr_core::cache::{CacheConfig, Limits, Registrar, RegistrationCache, Request};

/// Registers instantly, or after sleeping.
struct BenchRegistrar {
    delay: Duration,
}

impl Registrar for BenchRegistrar {
    type Registration = u64;
    type Error = Infallible;
    fn register(&self, request: &Request) -> Result<u64, Infallible> {
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        Ok(request.start)
    }
}

const PAGE: u64 = 4096;
const DOMAIN: u64 = 1;

fn filled(entries: u64) -> RegistrationCache<BenchRegistrar> {
    let cache = RegistrationCache::new(CacheConfig::default().with_limits(Limits::UNLIMITED));
    let reg = BenchRegistrar {
        delay: Duration::ZERO,
    };
    for i in 0..entries {
        // Disjoint, with a gap, so nothing merges.
        drop(
            cache
                .get_or_register(&reg, &Request::host(DOMAIN, i * 2 * PAGE, PAGE))
                .unwrap(),
        );
    }
    assert_eq!(cache.stats().entries, entries);
    cache
}

/// A random order over `hot` entries spread evenly among `n`.
fn hot_order(n: u64, hot: u64, seed: u64, len: usize) -> Vec<Request> {
    let stride = n / hot;
    order(hot, seed, len)
        .into_iter()
        .map(|r| Request {
            start: (r.start / (2 * PAGE)) * stride * 2 * PAGE + 64,
            ..r
        })
        .collect()
}

/// A random order over `n` entries (xorshift: no rand dependency).
fn order(n: u64, seed: u64, len: usize) -> Vec<Request> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = x % n;
            // Inside the entry, not at its start.
            Request::host(DOMAIN, i * 2 * PAGE + 64, 1024)
        })
        .collect()
}

fn hit_latency(c: &mut Criterion) {
    let reg = BenchRegistrar {
        delay: Duration::ZERO,
    };
    for (name, n) in [("1k", 1_000u64), ("100k", 100_000), ("1M", 1_000_000)] {
        let cache = filled(n);
        for (group, requests) in [
            ("hit", order(n, 0x9e37_79b9, 1 << 16)),
            ("hit_hot", hot_order(n, 1000, 0x9e37_79b9, 1 << 16)),
        ] {
            let mut group = c.benchmark_group(group);
            let mut next = 0usize;
            group.throughput(Throughput::Elements(1));
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    let r = &requests[next & (requests.len() - 1)];
                    next += 1;
                    black_box(cache.get_or_register(&reg, black_box(r)).unwrap());
                })
            });
            group.finish();
        }
        assert_eq!(cache.stats().misses, n, "every lookup hit");
    }
}

fn hit_threads(c: &mut Criterion) {
    const BATCH: u64 = 1000;
    let reg = BenchRegistrar {
        delay: Duration::ZERO,
    };
    let cache = filled(1000);
    let mut group = c.benchmark_group("hit_threads");
    for threads in [1usize, 2, 4, 8] {
        let orders: Vec<_> = (0..threads)
            .map(|t| order(1000, 0x1234_5678 + t as u64 * 7919, BATCH as usize))
            .collect();
        group.throughput(Throughput::Elements(threads as u64 * BATCH));
        group.bench_function(BenchmarkId::from_parameter(threads), |b| {
            b.iter_custom(|iters| {
                let barrier = Barrier::new(threads + 1);
                std::thread::scope(|s| {
                    for order in &orders {
                        let (cache, reg, barrier) = (&cache, &reg, &barrier);
                        s.spawn(move || {
                            barrier.wait();
                            for _ in 0..iters {
                                for r in order {
                                    black_box(cache.get_or_register(reg, r).unwrap());
                                }
                            }
                            barrier.wait();
                        });
                    }
                    barrier.wait();
                    let start = Instant::now();
                    barrier.wait();
                    start.elapsed()
                })
            })
        });
    }
    group.finish();
}

#[cfg(not(loom))]
fn register16(c: &mut Criterion) {
    let reg = BenchRegistrar {
        delay: Duration::from_millis(2),
    };
    let requests: Vec<_> = (0..16)
        .map(|i| Request::host(DOMAIN, i << 30, 64 << 20))
        .collect();
    let fresh = || RegistrationCache::<BenchRegistrar>::new(CacheConfig::default());
    let mut group = c.benchmark_group("register16");
    group.sample_size(10);
    group.throughput(Throughput::Elements(16));
    group.bench_function("serial", |b| {
        b.iter_batched(
            fresh,
            |cache| {
                for r in &requests {
                    black_box(cache.get_or_register(&reg, r).unwrap());
                }
                cache
            },
            BatchSize::PerIteration,
        )
    });
    group.bench_function("planned", |b| {
        b.iter_batched(
            fresh,
            |cache| {
                for h in cache.register_all(&reg, &requests, 16) {
                    black_box(h.unwrap());
                }
                cache
            },
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

#[cfg(not(loom))]
criterion_group!(benches, hit_latency, hit_threads, register16);
#[cfg(not(loom))]
criterion_main!(benches);

#[cfg(loom)]
fn main() {}
