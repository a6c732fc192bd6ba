//! What waiting costs (the reactor issue's figures): two engines on two
//! nodes of the simulator, connected, b's host region granted to a, in
//! three ways of driving them:
//!
//! - `caller`: no driver thread; the caller's `Batch::wait` drives;
//! - `driver`: `spawn_driver()` on both (a thread each, parked on the
//!   engine's reactor while nothing happens);
//! - `tokio_current`, `tokio_multi`: a task of `drive_on_tokio` on both
//!   (gdr-core's feature `tokio`), on a current-thread runtime or on a
//!   multi-thread one of two workers; the measurement runs in a task of
//!   the runtime (idle time is a tokio sleep, each WRITE is awaited);
//! - `verbs`: no engine, the floor: two QPs of one node connected to each
//!   other (`gdr_core::loopback::QpPair`), a signaled 4 KiB WRITE posted
//!   and its completion waited for with `gdr_core::cq_wait::CqWaiter` (the
//!   reactor's policy on a bare CQ). What the machine costs a lone request
//!   after idleness (cold caches) shows here without the engine's code.
//!
//! For each: the process's CPU time and voluntary context switches
//! (`getrusage`) over `GDR_IDLE_SECS` (10) seconds with nothing to do
//! (and, for the tokio modes, how often the driver tasks were polled);
//! lone 4 KiB WRITEs submitted and waited for (or awaited) back to back
//! (`GDR_B2B_SAMPLES`, 10,000), and after `GDR_IDLE_GAP_MS` (100) ms of
//! idleness each (`GDR_IDLE_SAMPLES`, 50): p50 and p99 of each.
//!
//! It uses only the engine's public API: `cargo bench -p gdr-tests --bench
//! idle [MODE...]` (a mode is picked when its name contains an argument:
//! `tokio` picks both tokio modes). A measurement, not a test: it asserts
//! nothing about the figures.

use std::time::{Duration, Instant};

use gdr_core::engine::{Driver, EngineConfig, Transfer};
use gdr_core::ladder::LadderConfig;
use gdr_sim::{NodeConfig, SimFabric, SimVerbsApi};
use gdr_tests::engine_world::{HostPeers, sim_host_peers};

const REQ: u64 = 4096;
const T: Duration = Duration::from_secs(30);

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Two connected engines, b's region granted to a.
struct Engines(HostPeers);

impl std::ops::Deref for Engines {
    type Target = HostPeers;
    fn deref(&self) -> &HostPeers {
        &self.0
    }
}

impl Engines {
    fn new() -> Self {
        let config = EngineConfig::default()
            .with_default_timeout(T)
            .with_ladder(LadderConfig::default().with_self_check(false));
        Self(sim_host_peers(config, REQ, T))
    }

    /// One 4 KiB WRITE, submitted and waited for: its latency.
    fn write(&self) -> Duration {
        let transfer = Transfer::write(&self.local, 0, &self.remote, 0, REQ);
        let start = Instant::now();
        self.a_to_b
            .submit(&[transfer])
            .expect("submit")
            .wait(T)
            .expect("write");
        start.elapsed()
    }

    /// One 4 KiB WRITE, submitted and awaited: its latency.
    async fn write_async(&self) -> Duration {
        let transfer = Transfer::write(&self.local, 0, &self.remote, 0, REQ);
        let start = Instant::now();
        let batch = self.a_to_b.submit(&[transfer]).expect("submit");
        tokio::time::timeout(T, batch)
            .await
            .expect("the WRITE was never woken")
            .expect("write");
        start.elapsed()
    }
}

/// What was measured in one mode.
struct Figures {
    idle_cpu: f64,
    wakeups: f64,
    secs: f64,
    back_to_back: Vec<Duration>,
    after_idle: Vec<Duration>,
    gap: Duration,
    /// Polls of the driver tasks over the idle time (tokio modes).
    task_polls: Option<u64>,
}

impl Figures {
    fn print(mut self, mode: &str) {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let polls = self.task_polls.map_or(String::new(), |p| {
            format!(", driver tasks polled {p} times")
        });
        let (b2b, lone) = (self.back_to_back.len(), self.after_idle.len());
        println!(
            "idle/{mode}: idle {:.2} % of a core, {:.1} voluntary switches/s over {:.1} s{polls}; \
             back-to-back 4 KiB WRITE p50 {:.1} us p99 {:.1} us (n={b2b}); after {} ms idle p50 {:.1} us p99 {:.1} us (n={lone})",
            self.idle_cpu,
            self.wakeups,
            self.secs,
            us(percentile(&mut self.back_to_back, 0.5)),
            us(percentile(&mut self.back_to_back, 0.99)),
            self.gap.as_millis(),
            us(percentile(&mut self.after_idle, 0.5)),
            us(percentile(&mut self.after_idle, 0.99)),
        );
    }
}

/// The knobs: idle seconds, back-to-back samples, after-idle samples, the
/// idle gap before each of those.
fn knobs() -> (u64, u64, u64, Duration) {
    (
        env_or("GDR_IDLE_SECS", 10),
        env_or("GDR_B2B_SAMPLES", 10_000),
        env_or("GDR_IDLE_SAMPLES", 50),
        Duration::from_millis(env_or("GDR_IDLE_GAP_MS", 100)),
    )
}

/// The process's CPU time and voluntary context switches so far.
fn usage() -> (Duration, u64) {
    // SAFETY: an all-zero rusage is a valid value for getrusage to fill.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid rusage to write; RUSAGE_SELF is a constant.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    assert_eq!(rc, 0, "getrusage");
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    (tv(ru.ru_utime) + tv(ru.ru_stime), ru.ru_nvcsw as u64)
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let at = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[at]
}

/// CPU time and voluntary context switches over an idle span.
struct IdleMeter {
    cpu: Duration,
    switches: u64,
    wall: Instant,
}

impl IdleMeter {
    fn start() -> Self {
        let (cpu, switches) = usage();
        Self {
            cpu,
            switches,
            wall: Instant::now(),
        }
    }

    /// Since the start: % of a core, voluntary switches a second, seconds.
    fn stop(self) -> (f64, f64, f64) {
        let (cpu, switches) = usage();
        let secs = self.wall.elapsed().as_secs_f64();
        (
            (cpu - self.cpu).as_secs_f64() / secs * 100.0,
            (switches - self.switches) as f64 / secs,
            secs,
        )
    }
}

/// The figures of `write` (one lone request, its latency) after a warm-up:
/// idle for the knobs' seconds, then back to back, then each after a gap.
fn sample(mut write: impl FnMut() -> Duration) -> Figures {
    let (idle_secs, b2b, lone, gap) = knobs();
    // Warm: the first requests set up what the rest reuse.
    for _ in 0..1000 {
        write();
    }
    std::thread::sleep(Duration::from_millis(200));
    let meter = IdleMeter::start();
    std::thread::sleep(Duration::from_secs(idle_secs));
    let (idle_cpu, wakeups, secs) = meter.stop();
    let back_to_back: Vec<Duration> = (0..b2b).map(|_| write()).collect();
    let after_idle: Vec<Duration> = (0..lone)
        .map(|_| {
            std::thread::sleep(gap);
            write()
        })
        .collect();
    Figures {
        idle_cpu,
        wakeups,
        secs,
        back_to_back,
        after_idle,
        gap,
        task_polls: None,
    }
}

fn run(mode: &str, drivers: impl Fn(&Engines) -> Vec<Driver>) {
    let engines = Engines::new();
    let _drivers = drivers(&engines);
    sample(|| engines.write()).print(mode);
    drop(_drivers);
    let _ = (&engines.a, &engines.b);
}

/// The same figures with both engines driven by `drive_on_tokio` tasks on
/// `rt`, measured in a task of `rt` (as a server's work runs; on the
/// multi-thread runtime it may share a worker with a driver task).
fn run_tokio(mode: &str, rt: tokio::runtime::Runtime) {
    let engines = std::sync::Arc::new(Engines::new());
    let measured = std::sync::Arc::clone(&engines);
    let figures = rt
        .block_on(async { tokio::spawn(measure_async(measured)).await })
        .expect("the measuring task");
    figures.print(mode);
    drop(rt);
    drop(engines);
}

async fn measure_async(engines: std::sync::Arc<Engines>) -> Figures {
    let (idle_secs, b2b, lone, gap) = knobs();
    let drivers = (
        engines.a.drive_on_tokio().expect("a's driver task"),
        engines.b.drive_on_tokio().expect("b's driver task"),
    );
    for _ in 0..1000 {
        engines.write_async().await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let polls0 = drivers.0.polls() + drivers.1.polls();
    let meter = IdleMeter::start();
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let (idle_cpu, wakeups, secs) = meter.stop();
    let task_polls = drivers.0.polls() + drivers.1.polls() - polls0;
    let mut back_to_back = Vec::with_capacity(b2b as usize);
    for _ in 0..b2b {
        back_to_back.push(engines.write_async().await);
    }
    let mut after_idle = Vec::with_capacity(lone as usize);
    for _ in 0..lone {
        tokio::time::sleep(gap).await;
        after_idle.push(engines.write_async().await);
    }
    Figures {
        idle_cpu,
        wakeups,
        secs,
        back_to_back,
        after_idle,
        gap,
        task_polls: Some(task_polls),
    }
}

/// The floor: the bare verbs loop, waited for by the reactor's policy.
fn run_verbs() {
    use gdr_core::cq_wait::CqWaiter;
    use gdr_core::loopback::{PairConfig, QpPair};
    use hal_verbs::{
        AccessFlags, Context as _, MemoryRegion as _, ProtectionDomain as _, Provider as _,
        QueuePair as _, SendFlags, SendOp, SendRequest, SgList, Sge,
    };

    let fabric = SimFabric::new();
    let ctx = fabric
        .add_node("n", NodeConfig::default())
        .open("sim0")
        .expect("sim0");
    let pd = ctx.alloc_pd().expect("pd");
    let channel = ctx.create_comp_channel().expect("a completion channel");
    let cq = ctx.create_cq_on_channel(16, &channel, 0).expect("cq");
    let pair = QpPair::<SimVerbsApi>::connect(&ctx, &pd, &cq, 1, &PairConfig::default())
        .expect("a connected pair");
    let mut memory = vec![0u8; 2 * REQ as usize];
    // SAFETY: `memory` outlives the MR (dropped at the end of this
    // function, after every WRITE completed).
    let mr = unsafe {
        pd.register(
            memory.as_mut_ptr() as u64,
            memory.len(),
            AccessFlags::transfer(),
        )
    }
    .expect("register");
    let waiter = CqWaiter::new().expect("a waiter");
    let request = SendRequest {
        wr_id: 1,
        op: SendOp::Write {
            remote_addr: mr.addr() + REQ,
            rkey: mr.rkey(),
        },
        sg_list: SgList::from_slice(&[Sge {
            addr: mr.addr(),
            length: REQ as u32,
            lkey: mr.lkey(),
        }]),
        flags: SendFlags::SIGNALED,
    };
    let mut completions = Vec::with_capacity(16);
    let write = || {
        let start = Instant::now();
        // SAFETY: both ranges lie in `mr`, alive until after the wait
        // below has seen this request complete.
        unsafe { pair.requester.post_send(std::slice::from_ref(&request)) }.expect("post");
        completions.clear();
        let got = waiter
            .wait::<SimVerbsApi>(&cq, Some(&channel), Some(start + T), &mut completions)
            .expect("poll");
        assert!(
            got == 1 && completions[0].status.is_success(),
            "{completions:?}"
        );
        start.elapsed()
    };
    sample(write).print("verbs");
    drop(mr);
    drop(memory);
}

fn main() {
    // `cargo bench` passes `--bench`; a filter picks modes.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wanted = |mode: &str| filter.is_empty() || filter.iter().any(|f| mode.contains(f.as_str()));
    if wanted("verbs") {
        run_verbs();
    }
    if wanted("caller") {
        run("caller", |_| Vec::new());
    }
    if wanted("driver") {
        run("driver", |e| {
            vec![e.a.spawn_driver().unwrap(), e.b.spawn_driver().unwrap()]
        });
    }
    if wanted("tokio_current") {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a current-thread runtime");
        run_tokio("tokio_current", rt);
    }
    if wanted("tokio_multi") {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a multi-thread runtime");
        run_tokio("tokio_multi", rt);
    }
}
