//! `gdr bench scale`: how the library scales with threads, on whatever
//! backend the CLI picked (the simulation, rxe, a NIC), each thread with a
//! peer of its own, one batch of `--batch` RDMA WRITEs of `--size` bytes
//! of host memory at a time, waited for before the next:
//!
//! - `bare`, the floor: per thread a pair of RC queue pairs connected to
//!   each other on the device ([`QpPair`], as `gdr bench rdma`), a CQ of
//!   its own (on a completion channel of its own), and registered memory
//!   of its own; the batch is one linked post, its last request signalled
//!   (an RC send queue completes in order), the CQ polled until it is done
//!   (`--idle`: what an empty poll does).
//! - `one-engine`: one client engine with T peers, all connected to one
//!   server engine (one listener); each thread submits on its own peer
//!   against a grant of host memory of its own and waits for each batch
//!   (`Batch::wait` drives the engine's reactor in the waiting thread: no
//!   driver thread).
//! - `engines`: T client engines with one peer each, each connected to a
//!   server engine of its own (as `gdr bench engine`); the same loop.
//! - `messages`: one client engine with T peers to one server engine, as
//!   `one-engine`, but each thread ping-pongs control messages of `--size`
//!   bytes at most the peer's message size: it sends one
//!   (`Peer::send`), waits for it to go, and receives the server's echo
//!   (`Peer::recv`), which a thread of the server's per peer sends back; a
//!   request is one round trip. Not in the default modes.
//!
//! Each point (mode, T) is set up anew, outside the clock: every thread
//! runs `--warmup` untimed, all start together, then each runs
//! `--seconds`; the rate is the requests of all threads over the longest
//! thread's time (first submission to its last batch seen done), and the
//! ratio is to the mode's rate at its smallest T (1 unless told). Each
//! point also says where its threads spent the time (`getrusage`): the
//! cores the process kept busy, the measuring threads' share of their
//! time on a CPU, and voluntary context switches per 1,000 requests (a
//! thread waiting in the kernel: a parked waiter, a contended lock, the
//! allocator's). After the table, one engine against the others at each
//! T: its ratio over the bare loop's, and its rate over T engines'.
//!
//! With `--rounds N` (N > 1), the sweep runs N times, and each round
//! measures every mode at T = 1 back to back, then at the next T, so the
//! modes compared at one T are measured a moment apart, not a sweep
//! apart (a shared machine drifts by more than the modes differ). A row
//! is then its point's median over the rounds (each column its own
//! median), with the rounds' lowest and highest req/s, and its ratio is
//! to the mode's median at its smallest T; the comparison is of the
//! medians, with the range of each round's own comparison beside it.
//!
//! With `--peers N`: N peers set up from one client engine to one
//! listener of a server engine (two engines, `--qps` queue pairs per
//! peer), first one after another (one connecting and one accepting
//! thread), then, on fresh engines, by `--connect-threads` K connecting
//! threads with K accepting; total time and time per peer. A device limit
//! that refuses a peer is reported with the typed error and how many peers
//! were set up. Between the two, the process's CPU time over
//! `--idle-seconds` with the sequential set-up's peers connected (its
//! listener closed, no thread of the bench's driving the engines). A
//! measurement: it judges nothing.

use std::error::Error;
use std::fmt::Write as _;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use gdr_core::backend::Backends;
use gdr_core::buffer::Buffer;
use gdr_core::descriptor::MemoryDescriptor;
use gdr_core::engine::{Engine, EngineConfig, EngineError, Listener, Peer, Region};
use gdr_core::loopback::{PairConfig, QpPair};
use hal_verbs::{AccessFlags, Api, Context as _, Provider as _};

use super::{
    Budget, Common, EnginePlan, Engines, HostRegion, Idle, Op, Plan, Target, Waiter, channel_cq,
    drain_after_failure, emit, grant_host, host_buffer, host_memory_config, idle::Usage, idle::Who,
    idle::usage_of, measure, measure_engine, parse_size, pick_device, progress_bar, send_caps,
    slots, start_engines,
};
use crate::rounds::{Spread, json_array, spread, spread_or};
use gdr_core::cq_wait::CqWaiter;

/// What is measured at each thread count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ScaleMode {
    /// The floor: T pairs of RC queue pairs, each thread its own pair and
    /// CQ.
    Bare,
    /// One client engine with T peers, all to one server engine.
    OneEngine,
    /// T client engines with one peer each, each to its own server engine.
    Engines,
    /// One client engine with T peers to one server engine, each thread
    /// ping-ponging control messages.
    Messages,
}

impl ScaleMode {
    fn name(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::OneEngine => "one-engine",
            Self::Engines => "engines",
            Self::Messages => "messages",
        }
    }
}

/// Options of `gdr bench scale`.
#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// Modes, comma-separated, measured in this order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "bare,one-engine,engines"
    )]
    modes: Vec<ScaleMode>,
    /// Thread counts, comma-separated (measured in increasing order).
    /// Default: 1, 2, 4, 8, 12, 16, 24, 32, ... up to this machine's
    /// cores, and the core count.
    #[arg(long, value_delimiter = ',', value_parser = parse_threads)]
    threads: Vec<usize>,
    /// Seconds measured per point, after the warm-up.
    #[arg(long, default_value = "2", value_parser = parse_seconds)]
    seconds: Duration,
    /// Sweeps of every thread count and mode. Above 1, each round
    /// measures the modes back to back at each T (bare, one-engine,
    /// engines at T = 1, then at T = 2, ...), and each row is the median
    /// of its rounds, with their lowest and highest req/s.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Untimed seconds every thread runs before each point's clock.
    #[arg(long, default_value = "0.25", value_parser = parse_seconds)]
    warmup: Duration,
    /// Requests per batch.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
    /// Bytes of one request (suffixes K, M, G: powers of 1024).
    #[arg(long, default_value = "4K", value_parser = parse_size)]
    size: usize,
    /// What a thread does when nothing completed (`bare`: its poller;
    /// the engine modes: `park` waits on the batch, driving the engine's
    /// reactor; `spin`/`yield` call `Engine::progress` in a loop).
    #[arg(long, value_enum, default_value_t = Idle::Park)]
    idle: Idle,
    /// Queue pairs per peer (the engine's `qps_per_peer`), of the engine
    /// modes and `--peers`. Default: the engine's.
    #[arg(long)]
    qps: Option<u16>,
    /// Completion queues per NIC (the engine's `cqs_per_nic`), of the
    /// engine modes and `--peers`. Default: the engine's.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    cqs: Option<u16>,
    /// Also set up this many peers to one listener, one after another and
    /// then concurrently, and measure idle CPU with them connected (0:
    /// skip).
    #[arg(long, default_value_t = 0)]
    peers: usize,
    /// Only the set-up of `--peers` and its idle CPU: no mode.
    #[arg(long, requires = "peers", conflicts_with_all = ["modes", "threads"])]
    peers_only: bool,
    /// Connecting threads (and as many accepting) of the concurrent
    /// set-up of `--peers`.
    #[arg(long, default_value_t = 8, value_parser = parse_threads)]
    connect_threads: usize,
    /// Seconds of idleness over which CPU time is counted with `--peers`
    /// connected.
    #[arg(long, default_value = "3", value_parser = parse_seconds)]
    idle_seconds: Duration,
    #[command(flatten)]
    pub(super) common: Common,
}

/// A count of threads: at least one.
fn parse_threads(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(0) => Err("at least one thread".to_owned()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{text:?} is not a number of threads")),
    }
}

/// Seconds, fractions allowed, not negative.
fn parse_seconds(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("{text:?} seconds: {e}"))
}

/// The thread counts measured by default on a machine of `cores`: 1, 2,
/// then 4, 8, 12, 16, 24, 32, 48, ... (each power of two from 4 on, and
/// half way to the next from 8 on) up to `cores`, and `cores` itself.
fn default_threads(cores: usize) -> Vec<usize> {
    let mut threads = vec![1, 2];
    let mut power = 4;
    while power <= cores {
        threads.push(power);
        if power >= 8 && power + power / 2 <= cores {
            threads.push(power + power / 2);
        }
        power *= 2;
    }
    threads.push(cores);
    threads.sort_unstable();
    threads.dedup();
    threads
}

/// The thread counts asked for, in increasing order, each once.
fn thread_counts(asked: &[usize]) -> Vec<usize> {
    if asked.is_empty() {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        return default_threads(cores);
    }
    let mut threads = asked.to_vec();
    threads.sort_unstable();
    threads.dedup();
    threads
}

/// One point: a mode at a thread count.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Point {
    pub(crate) mode: ScaleMode,
    pub(crate) threads: usize,
    /// Requests completed by all threads in their measured time.
    pub(crate) requests: u64,
    /// The longest thread's measured time.
    pub(crate) elapsed: Duration,
    /// The process's usage from the measured start to the last thread's
    /// end (every thread's: the measuring ones, the engines' own, the
    /// server's), and that window.
    pub(crate) process: Usage,
    pub(crate) window: Duration,
    /// The measuring threads' own usage in their measured time, summed.
    pub(crate) measuring: Usage,
}

impl Point {
    /// Requests per second, all threads together.
    pub(crate) fn per_s(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Cores the process kept busy over the window: above T, threads
    /// other than the measuring ones ran; below, the measuring ones
    /// waited off the CPU.
    pub(crate) fn cores(&self) -> f64 {
        self.process.cpu.as_secs_f64() / self.window.as_secs_f64().max(1e-9)
    }

    /// The share of their measured time the measuring threads were on a
    /// CPU (1: never waited off it).
    pub(crate) fn on_cpu(&self) -> f64 {
        self.measuring.cpu.as_secs_f64()
            / (self.elapsed.as_secs_f64() * self.threads as f64).max(1e-9)
    }

    /// Voluntary context switches of the process per 1,000 requests (a
    /// wait in the kernel: a contended lock's futex, a parked waiter).
    pub(crate) fn waits_per_k(&self) -> f64 {
        self.process.voluntary as f64 * 1000.0 / (self.requests as f64).max(1.0)
    }
}

/// The set-up of `--peers`, sequential or concurrent.
#[derive(Debug)]
pub(crate) struct SetUp {
    /// Connecting threads (as many accepting).
    pub(crate) threads: usize,
    pub(crate) asked: usize,
    /// Peers whose connect returned one.
    pub(crate) connected: usize,
    /// Peers the listener's side accepted.
    pub(crate) accepted: usize,
    /// From the first connect to the last connect or accept that
    /// succeeded.
    pub(crate) elapsed: Duration,
    /// Connects and accepts that failed.
    pub(crate) failures: usize,
    /// The first failure (a connecting thread stops at its first).
    pub(crate) first_error: Option<EngineError>,
}

/// The idle cost of `--peers` connected.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IdleWith {
    pub(crate) peers: usize,
    pub(crate) window: Duration,
    pub(crate) cpu: Duration,
    pub(crate) switches: u64,
}

/// What `gdr bench scale` measured.
#[derive(Debug, Default)]
pub(crate) struct Scaled {
    /// Every point measured, in order: with one round, each mode at every
    /// T; with more, round after round, each every mode at T = 1, then at
    /// T = 2, ...
    pub(crate) points: Vec<Point>,
    /// Rounds of the sweep (`--rounds`).
    pub(crate) rounds: usize,
    /// With more than one round: each (mode, T)'s points over the rounds,
    /// as the table's rows.
    pub(crate) medians: Vec<Summary>,
    pub(crate) set_ups: Vec<SetUp>,
    pub(crate) idle: Option<IdleWith>,
}

impl Scaled {
    /// Each round's points.
    pub(crate) fn by_round(&self) -> Vec<&[Point]> {
        match self.points.len() / self.rounds.max(1) {
            0 => Vec::new(),
            per_round => self.points.chunks(per_round).collect(),
        }
    }
}

/// One (mode, T) over the rounds.
#[derive(Debug, Clone)]
pub(crate) struct Summary {
    pub(crate) mode: ScaleMode,
    pub(crate) threads: usize,
    /// Its point of each round, in round order.
    pub(crate) rounds: Vec<Point>,
}

impl Summary {
    /// The spread of one figure of the rounds' points.
    pub(crate) fn over(&self, figure: impl Fn(&Point) -> f64) -> Spread {
        spread_or(self.rounds.iter().map(figure), f64::NAN)
    }

    /// The rounds' requests per second.
    pub(crate) fn per_s(&self) -> Spread {
        self.over(Point::per_s)
    }
}

/// Each (mode, T) of the first round over all `rounds`, in the order of
/// one round's table: each mode (as first measured) at every T.
pub(crate) fn summarize(rounds: &[&[Point]]) -> Vec<Summary> {
    let Some(first) = rounds.first() else {
        return Vec::new();
    };
    let mut modes: Vec<ScaleMode> = Vec::new();
    for p in *first {
        if !modes.contains(&p.mode) {
            modes.push(p.mode);
        }
    }
    modes
        .into_iter()
        .flat_map(|mode| first.iter().filter(move |p| p.mode == mode))
        .map(|p| Summary {
            mode: p.mode,
            threads: p.threads,
            rounds: rounds
                .iter()
                .filter_map(|round| {
                    round
                        .iter()
                        .find(|q| q.mode == p.mode && q.threads == p.threads)
                        .copied()
                })
                .collect(),
        })
        .collect()
}

/// The measured parameters every point shares.
#[derive(Debug, Clone, Copy)]
struct Shape {
    batch: u32,
    size: usize,
    warmup: Duration,
    seconds: Duration,
    idle: Idle,
}

/// `gdr bench scale`: every mode at every thread count, printed as each
/// point ends; then the set-up of `--peers`.
pub(crate) fn scale_bench(backends: &Backends, args: &ScaleArgs) -> Result<Scaled, Box<dyn Error>> {
    if u32::try_from(args.size).is_err() {
        return Err(format!("{} bytes exceed one work request's 4 GiB", args.size).into());
    }
    let shape = Shape {
        batch: args.batch.max(1),
        size: args.size,
        warmup: args.warmup,
        seconds: args.seconds,
        idle: args.idle,
    };
    let threads = thread_counts(&args.threads);
    let modes: &[ScaleMode] = if args.peers_only { &[] } else { &args.modes };
    let device =
        pick_device::<hal_verbs::dynamic::DynApi>(backends.verbs(), args.common.device.as_deref())?;
    let backend = backends.verbs_name();
    let defaults = EngineConfig::default();
    let config = host_memory_config()
        .with_qps_per_peer(args.qps.unwrap_or(defaults.qps_per_peer).max(1))
        .with_cqs_per_nic(args.cqs.unwrap_or(defaults.cqs_per_nic));
    let qps = config.qps_per_peer;
    let cqs = config.cqs_per_nic;
    let json = args.common.json;
    let rounds = args.rounds.max(1) as usize;
    if !json && !modes.is_empty() {
        println!(
            "gdr bench scale on {device} ({backend}): batches of {} x {}-byte WRITEs of host \
             memory, each thread its own peer, one batch at a time; {:?} per point after \
             {:?} of warm-up; idle {:?}",
            shape.batch, shape.size, shape.seconds, shape.warmup, shape.idle
        );
        println!(
            "modes: bare = T pairs of RC QPs, each its own CQ, a batch one linked post with the \
             last signalled (the floor); one-engine = one client engine with T peers to one \
             server engine; engines = T client engines, each one peer to its own server engine \
             ({qps} QPs per peer, {cqs} CQs per NIC, Batch::wait drives the engine); messages = one-engine's peers, \
             each thread a round trip of a control message at a time (a request)"
        );
        for line in header_lines(rounds, threads[0]) {
            println!("{line}");
        }
    }
    let mut scaled = Scaled {
        rounds,
        ..Scaled::default()
    };
    let progress = progress_bar(rounds * modes.len() * threads.len());
    let point_at = |mode: ScaleMode, t: usize| {
        measure_point(backends, &device, args.common.port, &config, mode, t, shape)
            .map_err(|e| format!("{} at {t} threads: {e}", mode.name()))
    };
    if rounds == 1 {
        for &mode in modes {
            let mut base = None;
            for &t in &threads {
                progress.set_message(format!("{} at {t} threads", mode.name()));
                let point = point_at(mode, t)?;
                progress.inc(1);
                let base_rate = *base.get_or_insert(point.per_s());
                let ratio = point.per_s() / base_rate.max(1e-9);
                let line = if json {
                    point_json_line(
                        &point,
                        backend,
                        &device,
                        shape,
                        (qps, cqs),
                        ratio,
                        threads[0],
                    )
                } else {
                    format!(
                        "{:<10} {:>7} {:>11} {:>8.3} {:>12.0} {:>12.0} {:>6.2} {:>6.2} {:>6.2} {:>8.2}",
                        mode.name(),
                        t,
                        point.requests,
                        point.elapsed.as_secs_f64(),
                        point.per_s(),
                        point.per_s() / t as f64,
                        ratio,
                        point.cores(),
                        point.on_cpu(),
                        point.waits_per_k()
                    )
                };
                emit(&progress, line);
                scaled.points.push(point);
            }
        }
    } else {
        // Round after round; in each, every mode back to back at each T.
        for round in 1..=rounds {
            for &t in &threads {
                for &mode in modes {
                    progress.set_message(format!(
                        "round {round}/{rounds}: {} at {t} threads",
                        mode.name()
                    ));
                    scaled.points.push(point_at(mode, t)?);
                    progress.inc(1);
                }
            }
        }
        scaled.medians = summarize(&scaled.by_round());
        for line in median_lines(&scaled.medians, json, (backend, &device), shape, (qps, cqs)) {
            emit(&progress, line);
        }
    }
    progress.finish_and_clear();
    let lines = if rounds == 1 {
        compare_lines(&compare(&scaled.points), json)
    } else {
        let spreads = compare_rounds(&scaled.by_round(), &scaled.medians);
        if json {
            spreads
                .iter()
                .map(|c| compare_json_line(c, backend, &device))
                .collect()
        } else {
            compare_spread_lines(&spreads)
        }
    };
    for line in lines {
        println!("{line}");
    }
    if args.peers > 0 {
        peers_bench(backends, &device, args, config, &mut scaled)?;
    }
    Ok(scaled)
}

/// One engine against the other modes at one thread count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Compared {
    pub(crate) threads: usize,
    /// One engine's ratio (req/s at T over req/s at the first T) over the
    /// bare loop's: 1 scales as the floor does.
    pub(crate) scaling_vs_bare: Option<f64>,
    /// One engine's req/s over T engines' at the same T.
    pub(crate) per_engines: Option<f64>,
}

/// One engine's points against the bare loop's and T engines' at each of
/// its thread counts (none without one-engine points, or with neither
/// other mode).
pub(crate) fn compare(points: &[Point]) -> Vec<Compared> {
    let rates: Vec<Rate> = points
        .iter()
        .map(|p| (p.mode, p.threads, p.per_s()))
        .collect();
    compare_rates(&rates)
}

/// A mode's requests per second at a thread count.
type Rate = (ScaleMode, usize, f64);

/// [`compare`] of rates (a point's, or the median of its rounds').
fn compare_rates(rates: &[Rate]) -> Vec<Compared> {
    let of = |mode: ScaleMode| -> Vec<(usize, f64)> {
        rates
            .iter()
            .filter(|r| r.0 == mode)
            .map(|&(_, threads, per_s)| (threads, per_s))
            .collect()
    };
    let (one, bare, engines) = (
        of(ScaleMode::OneEngine),
        of(ScaleMode::Bare),
        of(ScaleMode::Engines),
    );
    if one.is_empty() || (bare.is_empty() && engines.is_empty()) {
        return Vec::new();
    }
    let at = |mode: &[(usize, f64)], threads: usize| {
        mode.iter()
            .find(|&&(t, _)| t == threads)
            .map(|&(_, per_s)| per_s)
    };
    let first = one[0].0;
    let ratio = |mode: &[(usize, f64)], threads: usize| Some(at(mode, threads)? / at(mode, first)?);
    one.iter()
        .map(|&(threads, per_s)| Compared {
            threads,
            scaling_vs_bare: ratio(&one, threads)
                .zip(ratio(&bare, threads))
                .map(|(o, b)| o / b),
            per_engines: at(&engines, threads).map(|e| per_s / e),
        })
        .collect()
}

/// One engine against the others at one T over the rounds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CompareSpread {
    /// From the medians of the rounds' rates.
    pub(crate) median: Compared,
    /// Each round's own, from that round's points, in round order.
    pub(crate) rounds: Vec<Compared>,
}

impl CompareSpread {
    /// The lowest and highest of the rounds' figures (`figure` of each
    /// round's comparison); none where no round had it.
    fn range(&self, figure: impl Fn(&Compared) -> Option<f64>) -> Option<(f64, f64)> {
        let values: Vec<f64> = self.rounds.iter().filter_map(figure).collect();
        spread(&values).map(|s| (s.min, s.max))
    }

    pub(crate) fn scaling_range(&self) -> Option<(f64, f64)> {
        self.range(|c| c.scaling_vs_bare)
    }

    pub(crate) fn per_engines_range(&self) -> Option<(f64, f64)> {
        self.range(|c| c.per_engines)
    }
}

/// One engine against the others at each T: from the `medians`' rates,
/// and each of `rounds` from its own points.
pub(crate) fn compare_rounds(rounds: &[&[Point]], medians: &[Summary]) -> Vec<CompareSpread> {
    let rates: Vec<Rate> = medians
        .iter()
        .map(|s| (s.mode, s.threads, s.per_s().median))
        .collect();
    let per_round: Vec<Vec<Compared>> = rounds.iter().map(|round| compare(round)).collect();
    compare_rates(&rates)
        .into_iter()
        .map(|median| CompareSpread {
            median,
            rounds: per_round
                .iter()
                .map(|round| {
                    round
                        .iter()
                        .find(|c| c.threads == median.threads)
                        .copied()
                        .unwrap_or(Compared {
                            threads: median.threads,
                            scaling_vs_bare: None,
                            per_engines: None,
                        })
                })
                .collect(),
        })
        .collect()
}

/// A figure of the comparison, or `-` without one.
fn cell(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"))
}

/// The lines above the table: what its columns are.
fn header_lines(rounds: usize, first: usize) -> Vec<String> {
    if rounds == 1 {
        return vec![
            format!(
                "req/s: requests of all threads over the longest thread's time; ratio: to the \
                 mode's req/s at T = {first}"
            ),
            "cores: CPUs the process kept busy (every thread); on-cpu: the measuring threads' \
             share of their time on a CPU; waits/k: voluntary context switches per 1,000 \
             requests"
                .to_owned(),
            format!(
                "{:<10} {:>7} {:>11} {:>8} {:>12} {:>12} {:>6} {:>6} {:>6} {:>8}",
                "mode",
                "threads",
                "requests",
                "seconds",
                "req/s",
                "req/s/thread",
                "ratio",
                "cores",
                "on-cpu",
                "waits/k"
            ),
        ];
    }
    vec![
        format!(
            "{rounds} rounds, each a sweep of every T with the modes measured back to back at \
             each T; a row is its point's median over the rounds"
        ),
        format!(
            "req/s: requests of all threads over the longest thread's time, the median of the \
             rounds'; min, max: the lowest and highest of the rounds' req/s; ratio: to the \
             mode's median req/s at T = {first}"
        ),
        "requests, seconds, cores, on-cpu, waits/k: each the median of the rounds' own (not \
         one round's); cores: CPUs the process kept busy (every thread); on-cpu: the measuring \
         threads' share of their time on a CPU; waits/k: voluntary context switches per 1,000 \
         requests"
            .to_owned(),
        format!(
            "{:<10} {:>7} {:>11} {:>8} {:>12} {:>12} {:>12} {:>12} {:>6} {:>6} {:>6} {:>8}",
            "mode",
            "threads",
            "requests",
            "seconds",
            "req/s",
            "min",
            "max",
            "req/s/thread",
            "ratio",
            "cores",
            "on-cpu",
            "waits/k"
        ),
    ]
}

/// The table's rows over the rounds (JSON: an object per row), each
/// mode's ratio to its first row's median.
fn median_lines(
    medians: &[Summary],
    json: bool,
    (backend, device): (&str, &str),
    shape: Shape,
    (qps, cqs): (u16, u16),
) -> Vec<String> {
    let mut bases: Vec<(ScaleMode, &Summary)> = Vec::new();
    medians
        .iter()
        .map(|m| {
            let base = match bases.iter().find(|(mode, _)| *mode == m.mode) {
                Some(&(_, base)) => base,
                None => {
                    bases.push((m.mode, m));
                    m
                }
            };
            if json {
                return median_json_line(m, base, (backend, device), shape, (qps, cqs));
            }
            let per_s = m.per_s();
            format!(
                "{:<10} {:>7} {:>11.0} {:>8.3} {:>12.0} {:>12.0} {:>12.0} {:>12.0} {:>6.2} \
                 {:>6.2} {:>6.2} {:>8.2}",
                m.mode.name(),
                m.threads,
                m.over(|p| p.requests as f64).median,
                m.over(|p| p.elapsed.as_secs_f64()).median,
                per_s.median,
                per_s.min,
                per_s.max,
                per_s.median / m.threads as f64,
                per_s.median / base.per_s().median.max(1e-9),
                m.over(Point::cores).median,
                m.over(Point::on_cpu).median,
                m.over(Point::waits_per_k).median
            )
        })
        .collect()
}

/// The comparison after the table, one round's.
fn compare_lines(compared: &[Compared], json: bool) -> Vec<String> {
    if json || compared.is_empty() {
        return Vec::new();
    }
    let mut lines = vec![
        String::new(),
        "one engine against the others at each T: scaling = its ratio over bare's ratio; \
         per engines = its req/s over engines' req/s"
            .to_owned(),
        format!("{:>7} {:>8} {:>12}", "threads", "scaling", "per engines"),
    ];
    lines.extend(compared.iter().map(|c| {
        format!(
            "{:>7} {:>8} {:>12}",
            c.threads,
            cell(c.scaling_vs_bare),
            cell(c.per_engines)
        )
    }));
    lines
}

/// The comparison after the table over the rounds: from the medians, and
/// the range of the rounds' own.
fn compare_spread_lines(spreads: &[CompareSpread]) -> Vec<String> {
    if spreads.is_empty() {
        return Vec::new();
    }
    let mut lines = vec![
        String::new(),
        "one engine against the others at each T, from the medians: scaling = its ratio over \
         bare's ratio; per engines = its req/s over engines' req/s; min, max: the lowest and \
         highest of each round's own figure (from that round's points)"
            .to_owned(),
        format!(
            "{:>7} {:>8} {:>6} {:>6} {:>12} {:>6} {:>6}",
            "threads", "scaling", "min", "max", "per engines", "min", "max"
        ),
    ];
    lines.extend(spreads.iter().map(|c| {
        let (scaling, per_engines) = (c.scaling_range(), c.per_engines_range());
        format!(
            "{:>7} {:>8} {:>6} {:>6} {:>12} {:>6} {:>6}",
            c.median.threads,
            cell(c.median.scaling_vs_bare),
            cell(scaling.map(|r| r.0)),
            cell(scaling.map(|r| r.1)),
            cell(c.median.per_engines),
            cell(per_engines.map(|r| r.0)),
            cell(per_engines.map(|r| r.1)),
        )
    }));
    lines
}

/// A point's measurement: `mode` at `threads`, set up anew.
fn measure_point(
    backends: &Backends,
    device: &str,
    port: u8,
    config: &EngineConfig,
    mode: ScaleMode,
    threads: usize,
    shape: Shape,
) -> Result<Point, Box<dyn Error>> {
    match mode {
        ScaleMode::Bare => on_verbs!(backends.verbs(), |A, p| bare::<A>(
            p, device, port, threads, shape
        )),
        ScaleMode::OneEngine => one_engine(backends, device, port, config, threads, shape),
        ScaleMode::Engines => engines(backends, device, port, config, threads, shape),
        ScaleMode::Messages => messages(backends, device, port, config, threads, shape),
    }
}

/// Runs one thread per lane: each runs `run(lane, warmup)`, all wait for
/// each other, then each runs `run(lane, seconds)`, which returns the
/// requests it completed and the time they took.
fn run_threads<L: Sync>(
    mode: ScaleMode,
    lanes: &[L],
    shape: Shape,
    run: impl Fn(&L, Duration) -> Result<(u64, Duration), Box<dyn Error>> + Sync,
) -> Result<Point, Box<dyn Error>> {
    // The measuring threads and this one, which reads the process's
    // usage as they start.
    let start = Barrier::new(lanes.len() + 1);
    type Outcome = Result<(u64, Duration, Usage), String>;
    let (outcomes, process, window): (Vec<Outcome>, _, _) = std::thread::scope(|s| {
        let running: Vec<_> = lanes
            .iter()
            .map(|lane| {
                let (run, start) = (&run, &start);
                s.spawn(move || {
                    let warm = run(lane, shape.warmup).map_err(|e| e.to_string());
                    // Every thread reaches the barrier, failed or not.
                    start.wait();
                    warm?;
                    let before = usage_of(Who::Thread).map_err(|e| e.to_string())?;
                    let (requests, elapsed) =
                        run(lane, shape.seconds).map_err(|e| e.to_string())?;
                    let used = usage_of(Who::Thread)
                        .map_err(|e| e.to_string())?
                        .since(before);
                    Ok((requests, elapsed, used))
                })
            })
            .collect();
        start.wait();
        let (before, started) = (usage_of(Who::Process), Instant::now());
        let outcomes = running
            .into_iter()
            .map(|thread| {
                thread
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect();
        let process = match (before, usage_of(Who::Process)) {
            (Ok(before), Ok(after)) => Ok(after.since(before)),
            (Err(e), _) | (_, Err(e)) => Err(e),
        };
        (outcomes, process, started.elapsed())
    });
    let mut point = Point {
        mode,
        threads: lanes.len(),
        requests: 0,
        elapsed: Duration::ZERO,
        process: process?,
        window,
        measuring: Usage::default(),
    };
    for (i, outcome) in outcomes.into_iter().enumerate() {
        let (requests, elapsed, used) = outcome.map_err(|e| format!("thread {i}: {e}"))?;
        point.requests += requests;
        point.elapsed = point.elapsed.max(elapsed);
        point.measuring += used;
    }
    Ok(point)
}

/// Batches of the bare loop run by one call of `measure` (its buffers
/// are made per call).
const BARE_CHUNK: u64 = 8;

/// One thread's queue pairs of the bare loop. Field order is drop order:
/// the queue pairs before their CQ, the CQ before its channel.
struct BareLane<A: Api> {
    pair: QpPair<A>,
    cq: A::CompletionQueue,
    channel: Option<A::CompletionChannel>,
    local: HostRegion<A>,
    remote: HostRegion<A>,
}

/// `bare` at `threads`: a pair of RC queue pairs per thread on `device`,
/// in one context and protection domain.
fn bare<A: Api>(
    provider: &A::Provider,
    device: &str,
    port: u8,
    threads: usize,
    shape: Shape,
) -> Result<Point, Box<dyn Error>> {
    let ctx = provider.open(device)?;
    let attrs = ctx.query_device()?;
    let depth = shape.batch;
    for (limit, what) in [
        (attrs.max_qp_wr, "work requests per QP"),
        (attrs.max_cqe, "CQ entries"),
    ] {
        if limit != 0 && depth > limit {
            return Err(
                format!("a batch of {depth} exceeds {device}'s {limit} {what} (--batch)").into(),
            );
        }
    }
    let pd = ctx.alloc_pd()?;
    let config = PairConfig {
        caps: send_caps(depth),
        ..PairConfig::default()
    };
    let lanes = (0..threads)
        .map(|_| -> Result<BareLane<A>, Box<dyn Error>> {
            let (channel, cq) = channel_cq::<A>(&ctx, depth)?;
            let pair = QpPair::<A>::connect(&ctx, &pd, &cq, port, &config)?;
            Ok(BareLane {
                pair,
                cq,
                channel,
                local: HostRegion::new(&pd, shape.size, AccessFlags::LOCAL_WRITE)?,
                remote: HostRegion::new(
                    &pd,
                    shape.size,
                    AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
                )?,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // One batch per window: B requests linked in one post, the last
    // signalled, all done before the next post.
    let window = u64::from(depth);
    let plan = Plan {
        op: Op::Write,
        size: shape.size,
        iterations: window * BARE_CHUNK,
        window,
        cq_mod: window,
        post_list: depth as usize,
        idle: shape.idle,
    };
    run_threads(ScaleMode::Bare, &lanes, shape, |lane, budget| {
        let waiter = Waiter::<A> {
            cq: &lane.cq,
            channel: lane.channel.as_ref(),
            cq_waiter: CqWaiter::new()?,
        };
        let started = Instant::now();
        let mut requests = 0;
        while started.elapsed() < budget {
            let m = measure::<A>(&lane.pair, &waiter, &lane.local.mr, &lane.remote.mr, plan)
                .map_err(|e| drain_after_failure::<A>(&lane.pair, &lane.cq, e))?;
            requests += m.plan.iterations;
        }
        Ok((requests, started.elapsed()))
    })
}

/// One thread's peer in the engine modes, and the memory it WRITEs from.
/// Field order is drop order: the region before its memory.
struct EngineLane<'a> {
    engine: &'a Engine,
    peer: &'a Peer,
    remote: &'a MemoryDescriptor,
    local: Region,
    _memory: Buffer,
}

impl<'a> EngineLane<'a> {
    fn new(
        engine: &'a Engine,
        peer: &'a Peer,
        remote: &'a MemoryDescriptor,
        span: u64,
    ) -> Result<Self, Box<dyn Error>> {
        let memory = host_buffer(span, 0x5a)?;
        let local = engine.register_buffer(&memory)?;
        Ok(Self {
            engine,
            peer,
            remote,
            local,
            _memory: memory,
        })
    }
}

/// The bytes one thread's batches span: successive offsets, as `gdr bench
/// engine`.
fn engine_span(shape: Shape) -> u64 {
    (slots(shape.batch, shape.size) * shape.size) as u64
}

/// The engine modes' loop on `lanes`: one batch in flight per thread.
fn run_engine_lanes(
    mode: ScaleMode,
    lanes: &[EngineLane<'_>],
    shape: Shape,
) -> Result<Point, Box<dyn Error>> {
    let plan = EnginePlan {
        op: Op::Write,
        size: shape.size,
        batch: shape.batch,
        depth: 1,
        slots: slots(shape.batch, shape.size),
        budget: Budget::Time(Duration::ZERO),
        progress: super::Progress::Inline,
        idle: shape.idle,
    };
    run_threads(mode, lanes, shape, |lane, budget| {
        let plan = EnginePlan {
            budget: Budget::Time(budget),
            ..plan
        };
        let m = measure_engine(lane.engine, lane.peer, lane.remote, &lane.local, plan)?;
        Ok((m.requests, m.elapsed))
    })
}

/// A peer's two ends: the client's, the server's.
type PeerPair = (Peer, Peer);

/// One client engine with `threads` peers to one server engine (one
/// listener): the engines, and each peer's two ends.
fn client_with_peers(
    backends: &Backends,
    device: &str,
    port: u8,
    config: &EngineConfig,
    threads: usize,
) -> Result<(Engines, Vec<PeerPair>), Box<dyn Error>> {
    let engines = start_engines(backends, Some(device), port, None, config.clone())?;
    let listener = engines.listen()?;
    let peers = (0..threads)
        .map(|_| engines.connect(&listener))
        .collect::<Result<Vec<_>, _>>()?;
    drop(listener);
    Ok((engines, peers))
}

/// `one-engine` at `threads`: one client engine, `threads` peers to one
/// server engine, each granted host memory of its own.
fn one_engine(
    backends: &Backends,
    device: &str,
    port: u8,
    config: &EngineConfig,
    threads: usize,
    shape: Shape,
) -> Result<Point, Box<dyn Error>> {
    let (engines, peers) = client_with_peers(backends, device, port, config, threads)?;
    let span = engine_span(shape);
    let granted = peers
        .iter()
        .map(|(to_server, to_client)| grant_host(&engines.server, to_client, to_server, span))
        .collect::<Result<Vec<_>, _>>()?;
    let lanes = peers
        .iter()
        .zip(&granted)
        .map(|((to_server, _), (_, remote))| {
            EngineLane::new(&engines.client, to_server, remote, span)
        })
        .collect::<Result<Vec<_>, _>>()?;
    run_engine_lanes(ScaleMode::OneEngine, &lanes, shape)
}

/// `messages` at `threads`: one client engine, `threads` peers to one
/// server engine; each thread sends a message of `shape.size` bytes (at
/// most the peer's largest) on its peer and receives the echo a server
/// thread of its own sends back.
fn messages(
    backends: &Backends,
    device: &str,
    port: u8,
    config: &EngineConfig,
    threads: usize,
    shape: Shape,
) -> Result<Point, Box<dyn Error>> {
    const WAIT: Duration = Duration::from_secs(20);
    let (_engines, peers) = client_with_peers(backends, device, port, config, threads)?;
    let max = config.max_message as usize - gdr_core::engine::wire::HEADER_LEN;
    let payload = vec![0x5au8; shape.size.min(max)];
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let echoes: Vec<_> = peers
            .iter()
            .map(|(_, to_client)| {
                let stop = &stop;
                s.spawn(move || -> Result<(), String> {
                    while !stop.load(Ordering::Relaxed) {
                        match to_client.recv(Duration::from_millis(50)) {
                            Ok(message) => {
                                let sent = to_client
                                    .send(&message)
                                    .map_err(|e| format!("an echo: {e}"))?;
                                sent.wait(WAIT).map_err(|e| format!("an echo: {e}"))?;
                            }
                            Err(EngineError::Timeout(_)) => {}
                            Err(e) => return Err(format!("the server's receive: {e}")),
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        let lanes: Vec<&Peer> = peers.iter().map(|(to_server, _)| to_server).collect();
        let point = run_threads(ScaleMode::Messages, &lanes, shape, |peer, budget| {
            let start = Instant::now();
            let mut round_trips = 0;
            while start.elapsed() < budget {
                peer.send(&payload)?.wait(WAIT)?;
                if peer.recv(WAIT)? != payload {
                    return Err("the echo differs from the message sent".into());
                }
                round_trips += 1;
            }
            Ok((round_trips, start.elapsed()))
        });
        stop.store(true, Ordering::Relaxed);
        for echo in echoes {
            echo.join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        }
        point
    })
}

/// `engines` at `threads`: `threads` pairs of engines (as `gdr bench
/// engine`), one peer each.
fn engines(
    backends: &Backends,
    device: &str,
    port: u8,
    config: &EngineConfig,
    threads: usize,
    shape: Shape,
) -> Result<Point, Box<dyn Error>> {
    let span = engine_span(shape);
    let targets = (0..threads)
        .map(|_| Target::in_process(backends, Some(device), port, config.clone(), span))
        .collect::<Result<Vec<_>, _>>()?;
    let lanes = targets
        .iter()
        .map(|t| EngineLane::new(&t.engine, &t.peer, &t.descriptor, span))
        .collect::<Result<Vec<_>, _>>()?;
    run_engine_lanes(ScaleMode::Engines, &lanes, shape)
}

/// How long a peer's connect may take in `--peers`.
const SETUP_TIMEOUT: Duration = Duration::from_secs(20);

/// How long an accepting thread waits in one accept before it looks
/// whether the connecting threads are done. A session taken near the end
/// of it has little time left to be set up: long next to a set-up.
const ACCEPT_POLL: Duration = Duration::from_secs(1);

/// How long accepting threads wait, once every connect returned, for the
/// sessions those that succeeded left.
const ACCEPT_GRACE: Duration = Duration::from_secs(5);

/// Rest between a set-up and the idle window.
const SETTLE: Duration = Duration::from_millis(200);

/// `--peers`: the sequential set-up, idle CPU with its peers, then the
/// concurrent set-up on fresh engines.
fn peers_bench(
    backends: &Backends,
    device: &str,
    args: &ScaleArgs,
    config: EngineConfig,
    scaled: &mut Scaled,
) -> Result<(), Box<dyn Error>> {
    let (backend, json) = (backends.verbs_name(), args.common.json);
    let qps = config.qps_per_peer;
    let k = args.connect_threads.min(args.peers).max(1);
    let config = config
        .clone()
        // (The engine brings it into its bounds.)
        .with_accept_backlog(config.accept_backlog.max(k))
        // Room for every peer asked for: the device's limits, not the
        // engine's default bound, are what this measures.
        .with_max_peers(config.max_peers.max(args.peers));
    if !json {
        println!(
            "set-up of {} peers to one listener: one client engine, one server engine, {qps} QPs \
             per peer; sequential = one connecting and one accepting thread, concurrent = {k} of \
             each (fresh engines)",
            args.peers
        );
        println!(
            "{:<10} {:>7} {:>6} {:>6} {:>8} {:>9} {:>10}  error",
            "set-up", "threads", "asked", "set up", "accepted", "seconds", "ms/peer"
        );
    }
    for threads in [1, k] {
        let engines = start_engines(
            backends,
            Some(device),
            args.common.port,
            None,
            config.clone(),
        )?;
        let listener = engines.listen()?;
        let (set_up, (connected, accepted)) =
            set_up_peers(&engines, &listener, args.peers, threads);
        drop(listener);
        let line = if json {
            set_up_json_line(&set_up, backend, device, qps)
        } else {
            format!(
                "{:<10} {:>7} {:>6} {:>6} {:>8} {:>9.3} {:>10.3}  {}",
                if threads == 1 {
                    "sequential"
                } else {
                    "concurrent"
                },
                threads,
                set_up.asked,
                set_up.connected,
                set_up.accepted,
                set_up.elapsed.as_secs_f64(),
                per_peer_ms(&set_up),
                set_up.first_error.as_ref().map_or_else(
                    || "-".to_owned(),
                    |e| format!("{e} ({} failed)", set_up.failures)
                )
            )
        };
        println!("{line}");
        if threads == 1 {
            let idle = idle_with(connected.len(), args.idle_seconds)?;
            if json {
                println!("{}", idle_json_line(&idle, backend, device, qps));
            } else {
                println!(
                    "idle with {} peers connected: {:.2} % of one core, {:.1} voluntary \
                     switches/s over {:.1} s",
                    idle.peers,
                    cpu_percent(&idle),
                    idle.switches as f64 / idle.window.as_secs_f64().max(1e-9),
                    idle.window.as_secs_f64()
                );
            }
            scaled.idle = Some(idle);
        }
        scaled.set_ups.push(set_up);
        // The peers go before their engines.
        drop((connected, accepted));
        // A concurrent set-up of one thread would repeat the sequential.
        if k == 1 {
            break;
        }
    }
    Ok(())
}

/// Milliseconds per peer set up.
fn per_peer_ms(set_up: &SetUp) -> f64 {
    set_up.elapsed.as_secs_f64() * 1e3 / set_up.connected.max(1) as f64
}

fn cpu_percent(idle: &IdleWith) -> f64 {
    idle.cpu.as_secs_f64() / idle.window.as_secs_f64().max(1e-9) * 100.0
}

/// The process's CPU time and voluntary context switches over `window`
/// of nothing to do, `peers` connected.
fn idle_with(peers: usize, window: Duration) -> Result<IdleWith, Box<dyn Error>> {
    std::thread::sleep(SETTLE);
    let before = usage_of(Who::Process)?;
    let started = Instant::now();
    std::thread::sleep(window);
    let used = usage_of(Who::Process)?.since(before);
    Ok(IdleWith {
        peers,
        window: started.elapsed(),
        cpu: used.cpu,
        switches: used.voluntary,
    })
}

/// The clients' ends and the server's ends of the peers set up.
type PeerEnds = (Vec<Peer>, Vec<Peer>);

/// Sets up `n` peers from `engines.client` to `listener`: `threads`
/// connecting threads, each connecting its share one after another until
/// one fails, and `threads` accepting.
fn set_up_peers(
    engines: &Engines,
    listener: &Listener,
    n: usize,
    threads: usize,
) -> (SetUp, PeerEnds) {
    let addr = listener.local_addr();
    let connecting_done = AtomicBool::new(false);
    let (connected, accepted) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let started = Instant::now();
    /// What one thread set up: its peers, its failures, when its last
    /// success was.
    type Outcome = (Vec<Peer>, Vec<(Instant, EngineError)>, Option<Instant>);
    let (connects, accepts) = std::thread::scope(|s| {
        let accepting: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let (mut peers, mut failed, mut last) = (Vec::new(), Vec::new(), None);
                    let mut done_at = None;
                    loop {
                        if connecting_done.load(Ordering::Acquire) {
                            let at = *done_at.get_or_insert_with(Instant::now);
                            if accepted.load(Ordering::Acquire) >= connected.load(Ordering::Acquire)
                                || at.elapsed() > ACCEPT_GRACE
                            {
                                break;
                            }
                        }
                        if accepted.load(Ordering::Acquire) >= n {
                            break;
                        }
                        match listener.accept(ACCEPT_POLL) {
                            Ok(peer) => {
                                peers.push(peer);
                                accepted.fetch_add(1, Ordering::AcqRel);
                                last = Some(Instant::now());
                            }
                            Err(EngineError::Timeout(_)) => {}
                            Err(e) => failed.push((Instant::now(), e)),
                        }
                    }
                    (peers, failed, last)
                })
            })
            .collect();
        let connecting: Vec<_> = (0..threads)
            .map(|i| {
                let share = n / threads + usize::from(i < n % threads);
                let connected = &connected;
                s.spawn(move || {
                    let (mut peers, mut failed, mut last) = (Vec::new(), Vec::new(), None);
                    for _ in 0..share {
                        match engines.client.connect(addr, SETUP_TIMEOUT) {
                            Ok(peer) => {
                                peers.push(peer);
                                connected.fetch_add(1, Ordering::AcqRel);
                                last = Some(Instant::now());
                            }
                            Err(e) => {
                                failed.push((Instant::now(), e));
                                break;
                            }
                        }
                    }
                    (peers, failed, last)
                })
            })
            .collect();
        let join = |thread: std::thread::ScopedJoinHandle<'_, Outcome>| {
            thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        };
        let connects: Vec<_> = connecting.into_iter().map(join).collect();
        connecting_done.store(true, Ordering::Release);
        (
            connects,
            accepting.into_iter().map(join).collect::<Vec<_>>(),
        )
    });
    let mut ends: PeerEnds = (Vec::new(), Vec::new());
    let mut failures = Vec::new();
    let mut last = started;
    for (side, outcomes) in [(&mut ends.0, connects), (&mut ends.1, accepts)] {
        for (peers, failed, at) in outcomes {
            side.extend(peers);
            failures.extend(failed);
            last = last.max(at.unwrap_or(started));
        }
    }
    failures.sort_by_key(|(at, _)| *at);
    let set_up = SetUp {
        threads,
        asked: n,
        connected: ends.0.len(),
        accepted: ends.1.len(),
        elapsed: last.duration_since(started),
        failures: failures.len(),
        first_error: failures.into_iter().next().map(|(_, e)| e),
    };
    (set_up, ends)
}

/// `text` as a JSON string.
fn json_string(text: &str) -> String {
    let mut s = String::from('"');
    for c in text.chars() {
        match c {
            '"' => s.push_str("\\\""),
            '\\' => s.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(s, "\\u{:04x}", u32::from(c));
            }
            c => s.push(c),
        }
    }
    s.push('"');
    s
}

fn point_json_line(
    p: &Point,
    backend: &str,
    device: &str,
    shape: Shape,
    (qps, cqs): (u16, u16),
    ratio: f64,
    base_threads: usize,
) -> String {
    let mut s = json_head((backend, device), p.mode, p.threads, shape, (qps, cqs));
    // Writing to a String cannot fail.
    let _ = write!(
        s,
        "\"requests\":{},\"seconds\":{:.6},\"ops_per_s\":{:.1},\"ops_per_s_per_thread\":{:.1},\
         \"ratio\":{ratio:.4},\"ratio_to_threads\":{base_threads},\"cpu_cores\":{:.3},\
         \"measuring_on_cpu\":{:.4},\"voluntary_switches\":{},\"involuntary_switches\":{}}}",
        p.requests,
        p.elapsed.as_secs_f64(),
        p.per_s(),
        p.per_s() / p.threads as f64,
        p.cores(),
        p.on_cpu(),
        p.process.voluntary,
        p.process.involuntary,
    );
    s
}

/// The start of a point's JSON object: what was measured and how (the
/// engine's queue pairs and CQs for the engine modes), up to its figures.
fn json_head(
    (backend, device): (&str, &str),
    mode: ScaleMode,
    threads: usize,
    shape: Shape,
    (qps, cqs): (u16, u16),
) -> String {
    let mut s = format!(
        "{{\"bench\":\"scale\",\"backend\":\"{backend}\",\"device\":\"{device}\",\
         \"mode\":\"{}\",\"threads\":{threads},\"batch\":{},\"size\":{},",
        mode.name(),
        shape.batch,
        shape.size,
    );
    if mode != ScaleMode::Bare {
        // Writing to a String cannot fail.
        let _ = write!(s, "\"qps\":{qps},\"cqs\":{cqs},");
    }
    s
}

/// A figure of the comparison, or `null` without one.
fn json_figure(value: Option<f64>) -> String {
    value.map_or_else(|| "null".to_owned(), |v| format!("{v:.4}"))
}

/// A row over the rounds: the fields of a point's object, each the median
/// of the rounds' (the counts rounded), then the rounds' lowest and
/// highest req/s and each round's figures (`_rounds`, in round order; its
/// ratio to its own round's point at the first T).
fn median_json_line(
    m: &Summary,
    base: &Summary,
    (backend, device): (&str, &str),
    shape: Shape,
    (qps, cqs): (u16, u16),
) -> String {
    let per_s = m.per_s();
    let mut s = json_head((backend, device), m.mode, m.threads, shape, (qps, cqs));
    // Writing to a String cannot fail.
    let _ = write!(
        s,
        "\"requests\":{:.0},\"seconds\":{:.6},\"ops_per_s\":{:.1},\"ops_per_s_per_thread\":{:.1},\
         \"ratio\":{:.4},\"ratio_to_threads\":{},\"cpu_cores\":{:.3},\
         \"measuring_on_cpu\":{:.4},\"voluntary_switches\":{:.0},\"involuntary_switches\":{:.0},\
         \"rounds\":{},\"ops_per_s_min\":{:.1},\"ops_per_s_max\":{:.1},",
        m.over(|p| p.requests as f64).median,
        m.over(|p| p.elapsed.as_secs_f64()).median,
        per_s.median,
        per_s.median / m.threads as f64,
        per_s.median / base.per_s().median.max(1e-9),
        base.threads,
        m.over(Point::cores).median,
        m.over(Point::on_cpu).median,
        m.over(|p| p.process.voluntary as f64).median,
        m.over(|p| p.process.involuntary as f64).median,
        m.rounds.len(),
        per_s.min,
        per_s.max,
    );
    let _ = write!(
        s,
        "\"requests_rounds\":{},\"seconds_rounds\":{},\"ops_per_s_rounds\":{},\
         \"ratio_rounds\":{},\"cpu_cores_rounds\":{},\"measuring_on_cpu_rounds\":{},\
         \"voluntary_switches_rounds\":{},\"involuntary_switches_rounds\":{}}}",
        json_array(&m.rounds, |p| p.requests.to_string()),
        json_array(&m.rounds, |p| format!("{:.6}", p.elapsed.as_secs_f64())),
        json_array(&m.rounds, |p| format!("{:.1}", p.per_s())),
        json_array(m.rounds.iter().zip(&base.rounds), |(p, b)| format!(
            "{:.4}",
            p.per_s() / b.per_s().max(1e-9)
        )),
        json_array(&m.rounds, |p| format!("{:.3}", p.cores())),
        json_array(&m.rounds, |p| format!("{:.4}", p.on_cpu())),
        json_array(&m.rounds, |p| p.process.voluntary.to_string()),
        json_array(&m.rounds, |p| p.process.involuntary.to_string()),
    );
    s
}

/// One engine against the others at one T over the rounds: from the
/// medians, the rounds' lowest and highest, and each round's (`null`
/// where a mode was not measured).
fn compare_json_line(c: &CompareSpread, backend: &str, device: &str) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "{{\"bench\":\"scale\",\"backend\":\"{backend}\",\"device\":\"{device}\",\
         \"mode\":\"compare\",\"threads\":{},\"rounds\":{}",
        c.median.threads,
        c.rounds.len(),
    );
    for (name, median, range, figure) in [
        (
            "scaling_vs_bare",
            c.median.scaling_vs_bare,
            c.scaling_range(),
            (|r: &Compared| r.scaling_vs_bare) as fn(&Compared) -> Option<f64>,
        ),
        (
            "per_engines",
            c.median.per_engines,
            c.per_engines_range(),
            |r: &Compared| r.per_engines,
        ),
    ] {
        let _ = write!(
            s,
            ",\"{name}\":{},\"{name}_min\":{},\"{name}_max\":{},\"{name}_rounds\":{}",
            json_figure(median),
            json_figure(range.map(|r| r.0)),
            json_figure(range.map(|r| r.1)),
            json_array(&c.rounds, |r| json_figure(figure(r))),
        );
    }
    s.push('}');
    s
}

fn set_up_json_line(set_up: &SetUp, backend: &str, device: &str, qps: u16) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "{{\"bench\":\"scale\",\"backend\":\"{backend}\",\"device\":\"{device}\",\
         \"mode\":\"setup\",\"connect\":\"{}\",\"threads\":{},\"qps\":{qps},\
         \"peers_asked\":{},\"peers\":{},\"accepted\":{},\"seconds\":{:.6},\
         \"ms_per_peer\":{:.4},\"failures\":{},\"error\":{},\"error_debug\":{}}}",
        if set_up.threads == 1 {
            "sequential"
        } else {
            "concurrent"
        },
        set_up.threads,
        set_up.asked,
        set_up.connected,
        set_up.accepted,
        set_up.elapsed.as_secs_f64(),
        per_peer_ms(set_up),
        set_up.failures,
        set_up
            .first_error
            .as_ref()
            .map_or_else(|| "null".to_owned(), |e| json_string(&e.to_string())),
        set_up
            .first_error
            .as_ref()
            .map_or_else(|| "null".to_owned(), |e| json_string(&format!("{e:?}"))),
    );
    s
}

fn idle_json_line(idle: &IdleWith, backend: &str, device: &str, qps: u16) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "{{\"bench\":\"scale\",\"backend\":\"{backend}\",\"device\":\"{device}\",\
         \"mode\":\"idle\",\"qps\":{qps},\"peers\":{},\"idle_seconds\":{:.3},\
         \"idle_cpu_pct\":{:.3},\"voluntary_switches_per_s\":{:.2}}}",
        idle.peers,
        idle.window.as_secs_f64(),
        cpu_percent(idle),
        idle.switches as f64 / idle.window.as_secs_f64().max(1e-9),
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BenchCommand;
    use clap::Parser;
    use gdr_core::engine::HandshakeFailure;
    use gdr_sim::nic::{DeviceConfig, NodeConfig, SimFabric};
    use hal_verbs::VerbsError;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        bench: BenchCommand,
    }

    fn parse(args: &[&str]) -> Result<ScaleArgs, clap::Error> {
        let cli = Cli::try_parse_from(["gdr-bench", "scale"].iter().chain(args))?;
        match cli.bench {
            BenchCommand::Scale(args) => Ok(*args),
            other => panic!("parsed as {other:?}"),
        }
    }

    fn point(mode: ScaleMode, threads: usize, per_s: f64) -> Point {
        Point {
            mode,
            threads,
            requests: per_s as u64,
            elapsed: Duration::from_secs(1),
            process: Usage::default(),
            window: Duration::from_secs(1),
            measuring: Usage::default(),
        }
    }

    /// One engine's scaling is its ratio over the bare loop's, each to its
    /// own first T, and its rate over T engines' at the same T; a mode
    /// missing a T leaves that figure out.
    #[test]
    fn one_engine_is_compared_with_the_bare_loop_and_t_engines() {
        use ScaleMode::{Bare, Engines, OneEngine};
        let points = [
            point(Bare, 1, 100.0),
            point(Bare, 4, 400.0),
            point(OneEngine, 1, 50.0),
            point(OneEngine, 4, 150.0),
            point(OneEngine, 8, 200.0),
            point(Engines, 1, 40.0),
            point(Engines, 4, 200.0),
            point(Engines, 8, 250.0),
        ];
        let compared = compare(&points);
        let figures: Vec<_> = compared
            .iter()
            .map(|c| (c.threads, c.scaling_vs_bare, c.per_engines))
            .collect();
        // T = 4: one engine 3.0x against bare's 4.0x; 150 of engines' 200.
        assert_eq!(
            figures,
            [
                (1, Some(1.0), Some(1.25)),
                (4, Some(0.75), Some(0.75)),
                (8, None, Some(0.8)),
            ]
        );
        assert!(compare(&points[..2]).is_empty(), "no one-engine point");
        assert!(compare(&points[2..5]).is_empty(), "nothing to compare with");
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    /// Three rounds, the modes interleaved at each T: a row per (mode, T)
    /// in one round's table order, its rate the median of the rounds'
    /// with their lowest and highest; the comparison from the medians,
    /// with the range of each round's own.
    #[test]
    fn rounds_are_summed_up_by_their_medians_and_range() {
        use ScaleMode::{Bare, Engines, OneEngine};
        let round = |rates: [f64; 6]| -> Vec<Point> {
            [Bare, OneEngine, Engines]
                .iter()
                .cycle()
                .zip([1, 1, 1, 4, 4, 4])
                .zip(rates)
                .map(|((&mode, threads), per_s)| point(mode, threads, per_s))
                .collect()
        };
        let scaled = Scaled {
            points: [
                round([100.0, 50.0, 40.0, 400.0, 150.0, 200.0]),
                round([90.0, 60.0, 50.0, 300.0, 120.0, 100.0]),
                round([120.0, 40.0, 45.0, 420.0, 90.0, 180.0]),
            ]
            .concat(),
            rounds: 3,
            ..Scaled::default()
        };
        let rounds = scaled.by_round();
        assert_eq!(rounds.len(), 3);
        let medians = summarize(&rounds);
        let rows: Vec<_> = medians
            .iter()
            .map(|m| {
                let s = m.per_s();
                (m.mode, m.threads, m.rounds.len(), s.median, s.min, s.max)
            })
            .collect();
        assert_eq!(
            rows,
            [
                (Bare, 1, 3, 100.0, 90.0, 120.0),
                (Bare, 4, 3, 400.0, 300.0, 420.0),
                (OneEngine, 1, 3, 50.0, 40.0, 60.0),
                (OneEngine, 4, 3, 120.0, 90.0, 150.0),
                (Engines, 1, 3, 45.0, 40.0, 50.0),
                (Engines, 4, 3, 180.0, 100.0, 200.0),
            ]
        );
        let compared = compare_rounds(&rounds, &medians);
        assert_eq!(compared.len(), 2);
        let (one, four) = (&compared[0], &compared[1]);
        assert_eq!((one.median.threads, four.median.threads), (1, 4));
        // T = 4 from the medians: one engine 2.4x against bare's 4.0x;
        // 120 of engines' 180.
        assert!(close(four.median.scaling_vs_bare.unwrap(), 0.6), "{four:?}");
        assert!(
            close(four.median.per_engines.unwrap(), 120.0 / 180.0),
            "{four:?}"
        );
        assert!(
            close(one.median.per_engines.unwrap(), 50.0 / 45.0),
            "{one:?}"
        );
        // Each round's own: 3.0 / 4.0, 2.0 / 3.33, 2.25 / 3.5; 150 / 200,
        // 120 / 100, 90 / 180.
        let (low, high) = four.scaling_range().unwrap();
        assert!(close(low, 0.6) && close(high, 0.75), "{four:?}");
        let (low, high) = four.per_engines_range().unwrap();
        assert!(close(low, 0.5) && close(high, 1.2), "{four:?}");
        let (low, high) = one.per_engines_range().unwrap();
        assert!(close(low, 40.0 / 45.0) && close(high, 1.25), "{one:?}");
        assert_eq!(one.scaling_range(), Some((1.0, 1.0)));
        // The rows and the comparison as printed.
        let shape = Shape {
            batch: 16,
            size: 4096,
            warmup: Duration::ZERO,
            seconds: Duration::from_secs(1),
            idle: Idle::Park,
        };
        let lines = median_lines(&medians, false, ("sim", "d"), shape, (1, 1));
        let words: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(
            words[..9],
            [
                "one-engine",
                "4",
                "120",
                "1.000",
                "120",
                "90",
                "150",
                "30",
                "2.40"
            ]
        );
        let lines = compare_spread_lines(&compared);
        let words: Vec<&str> = lines[4].split_whitespace().collect();
        assert_eq!(words, ["4", "0.60", "0.60", "0.75", "0.67", "0.50", "1.20"]);
        let json: Vec<String> = median_lines(&medians, true, ("sim", "d"), shape, (1, 1));
        assert!(json[3].contains("\"ops_per_s\":120.0,"), "{}", json[3]);
        assert!(
            json[3].contains("\"ops_per_s_rounds\":[150.0,120.0,90.0]"),
            "{}",
            json[3]
        );
        assert!(
            json[3].contains("\"ratio_rounds\":[3.0000,2.0000,2.2500]"),
            "{}",
            json[3]
        );
        let line = compare_json_line(four, "sim", "d");
        assert!(
            line.contains("\"scaling_vs_bare\":0.6000,\"scaling_vs_bare_min\":0.6000,"),
            "{line}"
        );
    }

    /// `--rounds 2` on the sim: round after round, the modes back to back
    /// at each T; a row per (mode, T) over both rounds.
    #[test]
    fn rounds_interleave_the_modes_at_each_thread_count_on_the_sim() {
        use ScaleMode::{Bare, OneEngine};
        let mut args = short(&[Bare, OneEngine], &[2, 1], 16, 0.02);
        args.rounds = 2;
        let scaled = scale_bench(&Backends::sim_default(), &args).unwrap();
        let order: Vec<_> = scaled.points.iter().map(|p| (p.mode, p.threads)).collect();
        let round = [(Bare, 1), (OneEngine, 1), (Bare, 2), (OneEngine, 2)];
        assert_eq!(order, [round, round].concat());
        let rows: Vec<_> = scaled
            .medians
            .iter()
            .map(|m| (m.mode, m.threads, m.rounds.len()))
            .collect();
        assert_eq!(
            rows,
            [
                (Bare, 1, 2),
                (Bare, 2, 2),
                (OneEngine, 1, 2),
                (OneEngine, 2, 2)
            ]
        );
        for m in &scaled.medians {
            let s = m.per_s();
            assert!(
                s.min > 0.0 && s.min <= s.median && s.median <= s.max,
                "{m:?}"
            );
        }
    }

    /// Short points: `seconds` measured after a brief warm-up.
    fn short(modes: &[ScaleMode], threads: &[usize], batch: u32, seconds: f64) -> ScaleArgs {
        ScaleArgs {
            modes: modes.to_vec(),
            threads: threads.to_vec(),
            seconds: Duration::from_secs_f64(seconds),
            rounds: 1,
            warmup: Duration::from_millis(10),
            batch,
            size: 4096,
            idle: Idle::Park,
            qps: None,
            cqs: None,
            peers: 0,
            peers_only: false,
            connect_threads: 2,
            idle_seconds: Duration::from_millis(50),
            common: Common {
                device: None,
                port: 1,
                json: true,
            },
        }
    }

    #[test]
    fn arguments_parse_with_defaults_and_reject_nonsense() {
        let args = parse(&[]).unwrap();
        assert_eq!(
            args.modes,
            [ScaleMode::Bare, ScaleMode::OneEngine, ScaleMode::Engines]
        );
        assert!(args.threads.is_empty(), "default: by the core count");
        assert_eq!(args.rounds, 1, "default: one sweep");
        assert_eq!(args.seconds, Duration::from_secs(2));
        assert_eq!((args.batch, args.size), (16, 4096));
        assert_eq!((args.peers, args.connect_threads), (0, 8));
        assert!(!args.peers_only && !args.common.json);

        let args = parse(&[
            "--modes",
            "engines,bare",
            "--threads",
            "4,1,2,4",
            "--seconds",
            "0.5",
            "--rounds",
            "3",
            "--batch",
            "1",
            "--size",
            "64K",
            "--idle",
            "spin",
            "--qps",
            "1",
            "--peers",
            "1000",
            "--connect-threads",
            "16",
            "--json",
        ])
        .unwrap();
        assert_eq!(args.modes, [ScaleMode::Engines, ScaleMode::Bare]);
        assert_eq!(thread_counts(&args.threads), [1, 2, 4]);
        assert_eq!(args.seconds, Duration::from_millis(500));
        assert_eq!(args.rounds, 3);
        assert_eq!(
            (args.batch, args.size, args.idle),
            (1, 64 << 10, Idle::Spin)
        );
        assert_eq!(
            (args.qps, args.peers, args.connect_threads),
            (Some(1), 1000, 16)
        );
        assert!(args.common.json);
        assert!(
            parse(&["--peers", "10", "--peers-only"])
                .unwrap()
                .peers_only
        );

        for bad in [
            &["--threads", "0"][..],
            &["--threads", "two"],
            &["--batch", "0"],
            &["--rounds", "0"],
            &["--size", "0"],
            &["--seconds", "-1"],
            &["--modes", "bare,everything"],
            &["--connect-threads", "0"],
            &["--peers-only"],
            &["--peers", "4", "--peers-only", "--modes", "bare"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} was taken");
        }
    }

    #[test]
    fn default_thread_counts_follow_the_cores() {
        assert_eq!(default_threads(1), [1, 2]);
        assert_eq!(default_threads(2), [1, 2]);
        assert_eq!(default_threads(6), [1, 2, 4, 6]);
        assert_eq!(default_threads(12), [1, 2, 4, 8, 12]);
        assert_eq!(default_threads(16), [1, 2, 4, 8, 12, 16]);
        assert_eq!(default_threads(20), [1, 2, 4, 8, 12, 16, 20]);
        assert_eq!(default_threads(64), [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]);
    }

    /// Every mode at T = 1 and 2 on the sim, batches of 16 and of 1: a
    /// point per (mode, T), in order, each with requests done at a
    /// positive rate. A measurement: its speed is not judged.
    #[test]
    fn messages_round_trip_on_the_sim() {
        let modes = [ScaleMode::Messages];
        let scaled =
            scale_bench(&Backends::sim_default(), &short(&modes, &[2, 1], 1, 0.05)).unwrap();
        let shapes: Vec<_> = scaled.points.iter().map(|p| (p.mode, p.threads)).collect();
        assert_eq!(shapes, [(ScaleMode::Messages, 1), (ScaleMode::Messages, 2)]);
        for p in &scaled.points {
            assert!(p.requests > 0 && p.per_s().is_finite(), "{p:?}");
        }
    }

    #[test]
    fn every_mode_measures_a_positive_rate_on_the_sim() {
        let modes = [ScaleMode::Bare, ScaleMode::OneEngine, ScaleMode::Engines];
        for batch in [16, 1] {
            let scaled = scale_bench(
                &Backends::sim_default(),
                &short(&modes, &[2, 1], batch, 0.05),
            )
            .unwrap();
            let shapes: Vec<_> = scaled.points.iter().map(|p| (p.mode, p.threads)).collect();
            assert_eq!(
                shapes,
                modes
                    .iter()
                    .flat_map(|&m| [(m, 1), (m, 2)])
                    .collect::<Vec<_>>()
            );
            for p in &scaled.points {
                assert!(p.requests > 0, "batch {batch}: {p:?}");
                assert_eq!(p.requests % u64::from(batch), 0, "whole batches: {p:?}");
                assert!(p.per_s() > 0.0 && p.per_s().is_finite(), "{p:?}");
                // The time to the last batch's end: it may fall just short
                // of the budget (the last batch began before it and ended
                // before it too: seen, 49.999996 ms of 50), so only that
                // time was counted.
                assert!(p.elapsed > Duration::ZERO, "{p:?}");
            }
            assert!(scaled.set_ups.is_empty() && scaled.idle.is_none());
        }
    }

    /// `--peers` on the sim: every peer set up one after another and
    /// concurrently, each accepted, no error; idle CPU counted with them.
    #[test]
    fn peers_are_set_up_sequentially_and_concurrently() {
        let mut args = short(&[], &[1], 16, 0.01);
        args.peers = 7;
        args.peers_only = true;
        args.connect_threads = 3;
        let scaled = scale_bench(&Backends::sim_default(), &args).unwrap();
        assert!(scaled.points.is_empty());
        let shapes: Vec<_> = scaled
            .set_ups
            .iter()
            .map(|s| (s.threads, s.asked, s.connected, s.accepted, s.failures))
            .collect();
        assert_eq!(shapes, [(1, 7, 7, 7, 0), (3, 7, 7, 7, 0)]);
        for s in &scaled.set_ups {
            assert!(s.first_error.is_none(), "{s:?}");
            assert!(s.elapsed > Duration::ZERO, "{s:?}");
        }
        let idle = scaled.idle.expect("idle figures");
        assert_eq!(idle.peers, 7);
        assert!(idle.window >= Duration::from_millis(50), "{idle:?}");
    }

    /// A device that allows fewer queue pairs than the peers need: the
    /// set-up stops at the limit with the device's typed refusal and says
    /// how many peers were set up, sequentially and concurrently; no panic,
    /// no hang.
    #[test]
    fn a_device_limit_is_reported_with_the_peers_set_up() {
        let mut device = DeviceConfig::default();
        device.attributes.max_qp = 10;
        let node = NodeConfig {
            ipv4: None,
            devices: vec![device],
        };
        let backends = Backends::sim(&SimFabric::new(), node, Vec::new());
        let mut args = short(&[], &[1], 16, 0.01);
        args.peers = 12;
        args.peers_only = true;
        args.connect_threads = 4;
        args.qps = Some(2);
        let started = Instant::now();
        let scaled = scale_bench(&backends, &args).unwrap();
        assert!(started.elapsed() < SETUP_TIMEOUT, "no wait for a timeout");
        assert_eq!(scaled.set_ups.len(), 2);
        for s in &scaled.set_ups {
            // 10 queue pairs of 2 per peer: 5 peers at most on each side.
            assert!(s.connected <= 5 && s.connected < s.asked, "{s:?}");
            assert!(s.failures >= 1, "{s:?}");
            // The QP the device refused, on this side or the listener's.
            assert!(
                matches!(
                    &s.first_error,
                    Some(
                        EngineError::Verbs {
                            source: VerbsError::OutOfResources { .. },
                            ..
                        } | EngineError::Handshake {
                            why: HandshakeFailure::Connect(VerbsError::OutOfResources { .. }),
                            ..
                        }
                    )
                ),
                "not the device's refusal: {s:?}"
            );
        }
        assert!(scaled.set_ups[0].connected > 0, "{:?}", scaled.set_ups[0]);
        assert_eq!(
            scaled.idle.map(|i| i.peers),
            Some(scaled.set_ups[0].connected)
        );
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_string("a \"b\" \\ c\n"), r#""a \"b\" \\ c\u000a""#);
    }
}
