//! The engine's small-request rate against a bare verbs loop, in one
//! process on the simulator (two nodes of one `SimFabric`): 4 KiB RDMA
//! WRITEs (and READs), a window of `WINDOW` requests outstanding on one RC
//! queue pair of depth `WINDOW`, posted in linked batches of `B` with the
//! last of each batch signalled.
//!
//! - `bare_hal`: two QPs connected directly through the `hal_verbs` traits,
//!   the batch's requests built once and only their `wr_id` and addresses
//!   rewritten, one `post_send` per batch, the CQ polled 16 at a time.
//! - `engine`: `Peer::submit` of `B` `Transfer`s per batch, `WINDOW / B`
//!   batches in flight, the oldest waited on before the next is submitted;
//!   the engine has one queue pair of the same depth and signals every `B`
//!   (so, like the bare loop, only the last of each batch).
//!
//! One iteration is one batch retired and another posted (the window is
//! filled before the clock starts and drained after it stops), so the
//! throughput is requests per second in steady state. The goal (issue):
//! engine ≥ 0.9 × bare. The sim moves the bytes with the CPU, so both rates
//! include the sim's own cost; the difference is the engine's.
//!
//! On a machine shared with other work, set `GDR_BENCH_CPU_TIME=1`: both
//! loops are then timed by their thread's CPU time instead of the wall
//! clock (both are single-threaded busy loops, so on a quiet machine the
//! two agree; on a busy one the CPU time leaves out the time the thread
//! was not running).
//!
//! Instructions per request, under callgrind (`scripts/engine-callgrind.sh`
//! runs it): `GDR_BENCH_ONLY=<write|read>/<bare_hal|engine>/<B>` and
//! `GDR_BENCH_ITERS=<n>` run that one loop for `n` batches outside
//! criterion, between two callgrind toggles (`CALLGRIND_TOGGLE` below), so
//! the set-up is not counted.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use gdr_core::engine::{Batch, EngineConfig, Transfer};
use gdr_core::ladder::LadderConfig;
use gdr_sim::{DeviceConfig, SimVerbsApi};
use gdr_tests::engine_world::{HostPeers, sim_host_peers};
use gdr_tests::pair::{Buf, Pair, PairConfig, SimBackend};
use hal_verbs::{
    AccessFlags, Completion, CompletionQueue as _, MemoryRegion as _, QpCaps, SendFlags, SendOp,
    SendRequest,
};

/// Bytes per request.
const REQ: usize = 4096;
/// Requests outstanding, and the send queue's depth, on both sides.
const WINDOW: usize = 128;
/// Batch sizes measured.
const BATCHES: [usize; 3] = [1, 16, 64];
const T: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Write,
    Read,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::Write => "write",
            Dir::Read => "read",
        }
    }
}

/// What a run is timed by: the wall clock, or (with `GDR_BENCH_CPU_TIME`
/// set) the calling thread's CPU time.
#[derive(Debug, Clone, Copy)]
struct Stopwatch(Option<Instant>, Duration);

impl Stopwatch {
    fn start() -> Self {
        if std::env::var_os("GDR_BENCH_CPU_TIME").is_some() {
            Self(None, thread_cpu_time())
        } else {
            Self(Some(Instant::now()), Duration::ZERO)
        }
    }

    fn elapsed(self) -> Duration {
        match self.0 {
            Some(start) => start.elapsed(),
            None => thread_cpu_time().saturating_sub(self.1),
        }
    }
}

/// The calling thread's CPU time.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; the clock id is a
    // constant every Linux has.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Offset of request `n` (counted from the start) in the window's buffer.
fn offset(n: u64) -> usize {
    (n as usize % WINDOW) * REQ
}

/// The bare loop: a connected pair, a source and a destination buffer.
struct Bare {
    pair: Pair<SimVerbsApi>,
    local: Buf<SimVerbsApi>,
    remote: Buf<SimVerbsApi>,
}

impl Bare {
    fn new() -> Self {
        let caps = QpCaps {
            max_send_wr: WINDOW as u32,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let pair = Pair::with(
            &SimBackend::new("default", DeviceConfig::default()),
            PairConfig {
                caps,
                ..PairConfig::default()
            },
        );
        let len = WINDOW * REQ;
        let local = pair.a.buf(len, 1, AccessFlags::transfer());
        let remote = pair.b.buf(len, 2, AccessFlags::transfer());
        Self {
            pair,
            local,
            remote,
        }
    }

    /// `iters` batches of `b` retired (and as many posted) in steady state.
    fn run(&self, dir: Dir, b: usize, iters: u64) -> Duration {
        let mut batch: Vec<SendRequest> = (0..b)
            .map(|_| SendRequest {
                wr_id: 0,
                op: SendOp::Write {
                    remote_addr: 0,
                    rkey: self.remote.mr.rkey(),
                },
                sg_list: [self.local.sge(0, REQ)].into_iter().collect(),
                flags: SendFlags::empty(),
            })
            .collect();
        batch[b - 1].flags = SendFlags::SIGNALED;
        let mut next: u64 = 0;
        let post = |batch: &mut Vec<SendRequest>, next: &mut u64| {
            for request in batch.iter_mut() {
                let at = offset(*next);
                request.wr_id = *next;
                request.sg_list[0].addr = self.local.addr(at);
                request.op = match dir {
                    Dir::Write => self.remote.write_op(at),
                    Dir::Read => self.remote.read_op(at),
                };
                *next += 1;
            }
            Pair::<SimVerbsApi>::post(&self.pair.qa, batch);
        };
        let mut wcs = [Completion::default(); 16];
        let mut banked = 0usize;
        let mut reap = |banked: &mut usize| {
            while *banked == 0 {
                let n = self.pair.cqa.poll(&mut wcs).expect("poll");
                for wc in &wcs[..n] {
                    assert!(wc.status.is_success(), "{wc:?}");
                }
                *banked += n;
            }
            *banked -= 1;
        };
        let in_flight = WINDOW / b;
        for _ in 0..in_flight {
            post(&mut batch, &mut next);
        }
        let start = Stopwatch::start();
        for _ in 0..iters {
            reap(&mut banked);
            post(&mut batch, &mut next);
        }
        let elapsed = start.elapsed();
        for _ in 0..in_flight {
            reap(&mut banked);
        }
        elapsed
    }
}

/// Two engines on two nodes, connected, b's region granted to a (the
/// engines run on the erased backends, as every engine does).
struct Engines(HostPeers);

impl std::ops::Deref for Engines {
    type Target = HostPeers;
    fn deref(&self) -> &HostPeers {
        &self.0
    }
}

/// The engines' configuration: one QP of `WINDOW`, signalled every
/// `signal_every`.
fn engine_config(signal_every: u32) -> EngineConfig {
    EngineConfig::default()
        .with_qps_per_peer(1)
        .with_qp_depth(WINDOW as u32)
        .with_signal_every(signal_every)
        .with_inline_threshold(0)
        .with_default_timeout(T)
        // The self-check proves GPU rungs with a loopback pair of QPs
        // per engine; host memory never uses it, and its four idle QPs
        // would only make every one of the sim's QP lookups (a BTreeMap
        // by number, the connection's QPs last) dearer than the bare
        // loop's two-QP fabric: a cost of the sim, not of the engine.
        .with_ladder(LadderConfig::default().with_self_check(false))
}

impl Engines {
    fn new(signal_every: u32) -> Self {
        Self(sim_host_peers(
            engine_config(signal_every),
            (WINDOW * REQ) as u64,
            T,
        ))
    }
}

impl Engines {
    /// `iters` batches of `b` retired (and as many submitted) in steady
    /// state.
    fn run(&self, dir: Dir, b: usize, iters: u64) -> Duration {
        let mut transfers: Vec<Transfer<'_>> = Vec::with_capacity(b);
        let mut next: u64 = 0;
        let mut submit = |next: &mut u64| -> Batch {
            transfers.clear();
            for _ in 0..b {
                let at = offset(*next) as u64;
                transfers.push(match dir {
                    Dir::Write => Transfer::write(&self.local, at, &self.remote, at, REQ as u64),
                    Dir::Read => Transfer::read(&self.local, at, &self.remote, at, REQ as u64),
                });
                *next += 1;
            }
            self.a_to_b.submit(&transfers).expect("submit")
        };
        let reap = |batches: &mut VecDeque<Batch>| {
            batches
                .pop_front()
                .expect("a batch in flight")
                .wait(T)
                .expect("batch");
        };
        let in_flight = WINDOW / b;
        let mut batches = VecDeque::with_capacity(in_flight);
        for _ in 0..in_flight {
            batches.push_back(submit(&mut next));
        }
        let start = Stopwatch::start();
        for _ in 0..iters {
            reap(&mut batches);
            batches.push_back(submit(&mut next));
        }
        let elapsed = start.elapsed();
        while !batches.is_empty() {
            reap(&mut batches);
        }
        elapsed
    }
}

fn engine_vs_bare(c: &mut Criterion) {
    let bare = Bare::new();
    for dir in [Dir::Write, Dir::Read] {
        let mut group = c.benchmark_group(format!("sim_4KiB_{}", dir.name()));
        for b in BATCHES {
            let engines = Engines::new(b as u32);
            group.throughput(Throughput::Elements(b as u64));
            group.bench_with_input(BenchmarkId::new("bare_hal", b), &b, |bench, &b| {
                bench.iter_custom(|iters| bare.run(dir, b, iters))
            });
            group.bench_with_input(BenchmarkId::new("engine", b), &b, |bench, &b| {
                bench.iter_custom(|iters| engines.run(dir, b, iters))
            });
        }
        group.finish();
    }
}

/// Costs the engine pays per batch that the bare loop does not, measured
/// alone (a local experiment backing the profile's findings, not the
/// engine's code): a `Condvar::notify_all` with nobody waiting (the
/// engine's `CompletionCell::complete` does one per batch; std's futex
/// condvar makes it a `futex` system call whether or not anyone waits),
/// and a clock read (the engine reads its clock several times a batch).
fn per_batch_costs(c: &mut Criterion) {
    let mut group = c.benchmark_group("per_batch_costs");
    let condvar = std::sync::Condvar::new();
    group.bench_function("condvar_notify_all_no_waiter", |b| {
        b.iter(|| condvar.notify_all())
    });
    group.bench_function("instant_now", |b| b.iter(Instant::now));
    group.finish();
}

criterion_group!(benches, engine_vs_bare, per_batch_costs);

/// `GDR_BENCH_ONLY` and `GDR_BENCH_ITERS`: one loop, for callgrind.
fn only(spec: &str, iters: u64) {
    let parts: Vec<&str> = spec.split('/').collect();
    let [dir, kind, b] = parts[..] else {
        panic!("GDR_BENCH_ONLY={spec:?}: want <write|read>/<bare_hal|engine>/<batch>");
    };
    let dir = match dir {
        "write" => Dir::Write,
        "read" => Dir::Read,
        other => panic!("GDR_BENCH_ONLY: no direction {other:?}"),
    };
    let b: usize = b.parse().expect("GDR_BENCH_ONLY: a batch size");
    // Warm both the same way; callgrind counts only between the toggles
    // (`--collect-atstart=no --toggle-collect=<this function>`).
    match kind {
        "bare_hal" => {
            let bare = Bare::new();
            bare.run(dir, b, 1000);
            measured(|| bare.run(dir, b, iters));
        }
        "engine" => {
            let engines = Engines::new(b as u32);
            engines.run(dir, b, 1000);
            measured(|| engines.run(dir, b, iters));
        }
        other => panic!("GDR_BENCH_ONLY: no loop {other:?}"),
    }
}

/// What callgrind counts (`--toggle-collect=*measured*`).
#[inline(never)]
fn measured(run: impl FnOnce() -> Duration) {
    std::hint::black_box(run());
}

fn main() {
    if let Ok(spec) = std::env::var("GDR_BENCH_ONLY") {
        let iters = std::env::var("GDR_BENCH_ITERS")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(10_000);
        only(&spec, iters);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
