//! # gdr-bench
//!
//! The measurements behind `gdr bench`, as a library: they run on the HAL
//! (the bare queue-pair loop is the floor the engine is compared with), so
//! they are generic over the HAL traits and dispatched once on the
//! backends chosen at run time ([`run`]); the `gdr` command parses the
//! arguments ([`BenchCommand`]) and calls it, naming no HAL type itself.
//!
//! `gdr bench rdma`: host-memory RDMA WRITE and READ throughput between two
//! RC queue pairs connected to each other on one device, measured the way
//! perftest's `ib_write_bw`/`ib_read_bw` measure it, so the two can be put
//! side by side in one SoftRoCE guest (`softroce/perftest-compare.sh`).
//!
//! What is measured, as perftest does: `iterations` requests of `size` bytes,
//! all from one registered source to one registered target (perftest, too,
//! reuses one address for messages above half a page), with at most
//! `tx-depth` outstanding; the clock runs from just before the first post to
//! just after the last completion is polled. MB/s is perftest's: 2^20 bytes
//! per second (its `BW average[MB/sec]`); Gb/s is 10^9 bits per second (its
//! `--report_gbits`). Registration and connection are outside the clock.
//!
//! How it is driven (what makes it cheap on the CPU, which under emulation
//! is shared with the kernel's rxe packet processing): only every
//! `cq-mod`-th request is signaled, up to `post-list` requests are linked
//! into one post (one doorbell: on rxe, one system call), completions are
//! polled in batches, and an empty poll gives the CPU away rather than
//! spinning: by default (`--idle park`) the poller waits as the engine does
//! (`gdr_core::cq_wait`: a short spin, then asleep on the CQ's completion
//! channel until a completion comes); `--idle yield` yields instead,
//! `--idle spin` polls again at once (perftest's way).
//!
//! `gdr bench engine` measures the transfer engine instead: two engines in
//! this process (one on the backends' provider listening on the device's
//! own RoCE v2 address, one on the peer provider connecting to it over
//! rdma_cm), a host buffer granted by the listener, and batches of
//! `--batch` requests of one size each, `--depth` batches in flight, until
//! `--duration` seconds (or `-n`/`--volume`, as above) are spent. Per (op,
//! size): MB/s, Gb/s, requests/s, and the latency of a batch (submit to its
//! end being seen) at p50/p99/p999. Progress is made from the bench loop
//! itself by default (`--progress inline`; with `--idle park` the loop
//! waits on its oldest batch, which runs the engine's reactor in this
//! thread; `--idle spin|yield` calls `Engine::progress` in a loop):
//! measured faster on rxe than a driver thread (`--progress driver`) when
//! that thread still polled and slept (before the engine's reactor; not
//! measured since): it cost 4 KiB and 64 KiB READs about half their
//! throughput there, the thread and the poster sharing two vCPUs with rxe's
//! kernel work.
//!
//! Across two nodes, `gdr bench engine --listen ADDR` on one serves a
//! single `gdr bench engine --connect ADDR` on the other, which measures as
//! above against the server's granted memory (the exchange is three
//! control messages: the span asked for, the grant's id, done); the server
//! only waits, polling gently, since the requests are one-sided
//! (`softroce/perftest-compare-wire.sh` puts it next to `ib_write_bw` and
//! `ib_read_bw` between two SoftRoCE guests).
//!
//! `gdr bench idle` (`idle.rs`) measures what waiting costs: the
//! process's CPU time and voluntary context switches while nothing
//! happens, and the latency of a lone 4 KiB WRITE back to back and after
//! idleness, through the engine pair above (no driver thread, or one per
//! engine) and through a bare queue pair waited on by a
//! [`CqWaiter`] (the floor).
//!
//! `gdr bench scale` (`scale.rs`) measures how requests/s grow with
//! threads, each with its own peer and one batch of WRITEs at a time:
//! through bare queue pairs (the floor), one engine with a peer per
//! thread, and an engine pair per thread; and the set-up of many peers to
//! one listener, and what they cost idle.
//!
//! `gdr bench isolation` (`isolation.rs`, simulation only) measures
//! whether one peer's slow peer-copy set-up holds up another peer of the
//! same engine: the latency of peer A's lone 4 KiB WRITEs alone and while
//! peer B runs GPU-to-GPU peer copies, each first making a driver call
//! (its IPC open) scripted to be slow.

use std::collections::VecDeque;
use std::error::Error;
use std::fmt::{self, Write as _};
use std::io::IsTerminal as _;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use clap::{Args, Subcommand, ValueEnum};
use gdr_core::buffer::Buffer;
use gdr_core::cq_wait::CqWaiter;
use gdr_core::descriptor::{GrantRights, MemoryDescriptor};
use gdr_core::engine::{
    Batch, Engine, EngineConfig, EngineError, Grant, Listener, Peer, Region, Transfer,
};
use gdr_core::ladder::LadderConfig;
use gdr_core::loopback::{PairConfig, QpPair};
use hal_verbs::{
    AccessFlags, AddressFamily, Api, Completion, CompletionQueue as _, Context as _,
    MemoryRegion as _, ProtectionDomain as _, Provider as _, QpCaps, QueuePair as _, SendFlags,
    SendOp, SendRequest, SgList, Sge,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressStyle};

use gdr_core::backend::{BackendChoice, Backends};

/// Runs `$body` with `$A` the verbs backend behind the erased `$provider`
/// and `$p` that backend's own provider: the bare loops measure a backend
/// on its own types (the floor the engine, which runs erased, is held
/// to). A backend not named here runs erased.
macro_rules! on_verbs {
    ($provider:expr, |$A:ident, $p:ident| $body:expr) => {{
        let provider: &hal_verbs::dynamic::DynProvider = $provider;
        if let Some($p) = provider.downcast_ref::<gdr_core::sim::SimVerbsApi>() {
            type $A = gdr_core::sim::SimVerbsApi;
            $body
        } else if let Some($p) = provider.downcast_ref::<hal_verbs::rdma::RdmaApi>() {
            type $A = hal_verbs::rdma::RdmaApi;
            $body
        } else {
            type $A = hal_verbs::dynamic::DynApi;
            let $p = provider;
            $body
        }
    }};
}

mod idle;
mod isolation;
mod rounds;
mod scale;

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// RDMA WRITE and READ throughput through host memory, between two RC
    /// QPs connected to each other on one device (perftest's
    /// ib_write_bw/ib_read_bw, client and server in one process).
    Rdma(RdmaArgs),
    /// RDMA WRITE and READ throughput and batch latency through the
    /// transfer engine: two engines in this process connected over
    /// rdma_cm, one granting a host buffer, the other moving batches of
    /// requests into and out of it (or, across two nodes, `--listen` on
    /// one and `--connect` on the other).
    Engine(Box<EngineArgs>),
    /// What waiting costs: idle CPU and voluntary context switches, and
    /// the latency of a lone 4 KiB WRITE back to back and after idleness,
    /// through the engine (no driver thread, or one per engine) and through
    /// a bare queue pair (the floor).
    Idle(Box<idle::IdleArgs>),
    /// How the library scales with threads, each with its own peer:
    /// batches of WRITEs through the bare queue-pair loop (the floor), one
    /// engine with T peers, and T engines; requests/s and the ratio to
    /// T = 1. With --peers N: the set-up of N peers to one listener
    /// (sequential and concurrent), and idle CPU with them connected.
    Scale(Box<scale::ScaleArgs>),
    /// Whether a slow peer-copy set-up holds up another peer (simulation
    /// only): the latency of one peer's lone 4 KiB WRITEs alone and while
    /// another peer of the same engine runs GPU-to-GPU peer copies, each
    /// first opening an IPC handle made to take --slow-us.
    Isolation(Box<isolation::IsolationArgs>),
}

/// The operation measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Op {
    /// RDMA WRITE (ib_write_bw).
    Write,
    /// RDMA READ (ib_read_bw).
    Read,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Self::Write => "WRITE",
            Self::Read => "READ",
        }
    }
}

/// What the poller does when the CQ is empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Idle {
    /// Poll again at once (perftest's way).
    Spin,
    /// `sched_yield` first, so kernel work (rxe's tasks, softirqs) waiting
    /// for this CPU runs.
    Yield,
    /// The library's one waiting policy (`gdr_core::cq_wait`, the
    /// engine's reactor): poll while completions come, spin briefly, then
    /// arm the CQ's completion channel and sleep on its fd until one comes
    /// (perftest's `--use_event`, after a spin). A sleeping vCPU halts,
    /// which under emulation gives its host core to the vCPU doing rxe's
    /// packet work.
    Park,
}

/// A poller's [`Idle`] policy for an empty poll: spin or yield (parking
/// is [`CqWaiter`]'s, the caller's business).
fn idle_after_empty_poll(policy: Idle) {
    if policy == Idle::Yield {
        std::thread::yield_now();
    }
}

/// How long a parked poller waits for a completion before it gives up.
const PARK_TIMEOUT: Duration = Duration::from_secs(30);

/// Options of `gdr bench rdma`.
#[derive(Debug, Args)]
pub struct RdmaArgs {
    /// Message sizes, comma-separated (suffixes K, M, G: powers of 1024).
    #[arg(long, value_delimiter = ',', default_value = "64K,1M,4M", value_parser = parse_size)]
    sizes: Vec<usize>,
    /// Operations, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "write,read")]
    ops: Vec<Op>,
    /// Messages per measurement. Default: `--volume` worth.
    #[arg(long, short = 'n', conflicts_with = "volume")]
    iterations: Option<u64>,
    /// Bytes per measurement, as many messages of each size as fit (at least
    /// 5, like perftest). Default: 128 MiB, at most 5000 messages (64K:
    /// 2048, 1M: 128, 4M: 32), a few seconds each under emulation.
    #[arg(long, value_parser = parse_size)]
    volume: Option<usize>,
    /// Most requests outstanding (perftest's -t), bounded by the device.
    #[arg(long, short = 't', default_value_t = 128)]
    tx_depth: u32,
    /// Signal every k-th request (perftest's -Q/--cq-mod); bounded by the
    /// window. perftest signals every request above 8 KiB unless told.
    #[arg(long, default_value_t = 16)]
    cq_mod: u32,
    /// Requests linked per post, one doorbell each (perftest's -l).
    /// Default: WRITEs as many as fit in 64 KiB, READs in 1 MiB, 1..=16
    /// (measured on rxe: linking 1 MiB WRITEs halves their throughput,
    /// linking 64 KiB READs helps).
    #[arg(long)]
    post_list: Option<u32>,
    /// Empty-CQ policy of the poller.
    #[arg(long, value_enum, default_value_t = Idle::Park)]
    idle: Idle,
    /// Untimed messages before each measurement (0: none, as perftest).
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    #[command(flatten)]
    common: Common,
}

/// Options of every benchmark: the device, and how results are printed.
#[derive(Debug, Args)]
pub(crate) struct Common {
    /// RDMA device (default: the first).
    #[arg(long, short = 'd')]
    device: Option<String>,
    /// Port of the device (`gdr bench engine` and `idle`: whose RoCE v2
    /// address the in-process engines connect to).
    #[arg(long, default_value_t = 1)]
    port: u8,
    /// One JSON object per result on stdout instead of the table.
    #[arg(long)]
    json: bool,
}

/// One measurement's parameters, after bounding by the device.
#[derive(Debug, Clone, Copy)]
struct Plan {
    op: Op,
    size: usize,
    iterations: u64,
    window: u64,
    cq_mod: u64,
    post_list: usize,
    idle: Idle,
}

/// One measurement's result.
#[derive(Debug, Clone, Copy)]
struct Measurement {
    plan: Plan,
    elapsed: Duration,
    polls: u64,
    empty_polls: u64,
    posts: u64,
}

/// What a measurement moved in how long, and the rates that follow.
trait Rates {
    /// Requests completed.
    fn requests(&self) -> u64;
    /// Bytes of one request.
    fn size(&self) -> usize;
    fn elapsed(&self) -> Duration;

    fn bytes(&self) -> u64 {
        self.size() as u64 * self.requests()
    }
    fn seconds(&self) -> f64 {
        self.elapsed().as_secs_f64().max(1e-9)
    }
    /// perftest's MB/s: 2^20 bytes per second.
    fn mib_per_s(&self) -> f64 {
        self.bytes() as f64 / self.seconds() / f64::from(1 << 20)
    }
    /// 10^9 bits per second.
    fn gbit_per_s(&self) -> f64 {
        self.bytes() as f64 * 8.0 / self.seconds() / 1e9
    }
    /// Requests per second.
    fn per_s(&self) -> f64 {
        self.requests() as f64 / self.seconds()
    }
}

impl Rates for Measurement {
    fn requests(&self) -> u64 {
        self.plan.iterations
    }
    fn size(&self) -> usize {
        self.plan.size
    }
    fn elapsed(&self) -> Duration {
        self.elapsed
    }
}

/// A page-aligned host buffer and its registration; the registration is
/// dropped first (field order), while the memory is still there.
struct HostRegion<A: Api> {
    mr: A::MemoryRegion,
    _memory: Vec<u8>,
}

impl<A: Api> HostRegion<A> {
    fn new(
        pd: &A::ProtectionDomain,
        len: usize,
        access: AccessFlags,
    ) -> Result<Self, Box<dyn Error>> {
        const PAGE: usize = 4096;
        // Touched (zeroed) before registration, so pinning faults nothing in
        // while the clock runs.
        let mut memory = vec![0x5au8; len + PAGE];
        let offset = memory.as_ptr().align_offset(PAGE);
        let addr = memory[offset..].as_mut_ptr() as u64;
        // SAFETY: `addr..addr + len` lies in `memory` (`offset < PAGE`),
        // which is neither freed nor resized while `mr` lives: both are
        // owned by the returned value, which drops `mr` first.
        let mr = unsafe { pd.register(addr, len, access) }?;
        Ok(Self {
            mr,
            _memory: memory,
        })
    }
}

/// Runs `command` on the backends `choice` leads to (their notes printed
/// first, as every `gdr` command does).
pub fn run(choice: BackendChoice, command: BenchCommand) -> Result<(), Box<dyn Error>> {
    let backends = Backends::choose(choice)?;
    for note in backends.notes() {
        println!("{note}");
    }
    run_on(&backends, command)
}

/// A size with an optional binary suffix (K, M, G: powers of 1024; `KiB`
/// and `KB` read the same), greater than zero.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let (digits, shift) = match text.trim_end_matches(['i', 'B']).chars().last() {
        Some('K' | 'k') => (&text[..text.find(['K', 'k']).unwrap_or(0)], 10),
        Some('M' | 'm') => (&text[..text.find(['M', 'm']).unwrap_or(0)], 20),
        Some('G' | 'g') => (&text[..text.find(['G', 'g']).unwrap_or(0)], 30),
        _ => (text, 0),
    };
    let value: usize = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a size"))?;
    value
        .checked_shl(shift)
        .filter(|v| *v > 0 && v >> shift == value)
        .ok_or_else(|| format!("{text:?} is out of range"))
}

fn run_on(backends: &Backends, command: BenchCommand) -> Result<(), Box<dyn Error>> {
    match command {
        BenchCommand::Rdma(args) => {
            if backends.verbs_name() == "sim" && !args.common.json {
                println!("(simulated NIC: the figures measure gdr-sim, not a device)");
            }
            on_verbs!(backends.verbs(), |A, p| rdma::<A>(p, &args))
        }
        BenchCommand::Engine(args) => {
            if backends.verbs_name() == "sim" && !args.common.json {
                println!("(simulated NIC: the figures measure gdr-sim, not a device)");
            }
            engine_bench(backends, &args).map(|_| ())
        }
        BenchCommand::Idle(args) => {
            if backends.verbs_name() == "sim" && !args.common.json {
                println!("(simulated NIC: the figures measure gdr-sim, not a device)");
            }
            idle::idle_bench(backends, &args).map(|_| ())
        }
        BenchCommand::Scale(args) => {
            if backends.verbs_name() == "sim" && !args.common.json {
                println!("(simulated NIC: the figures measure gdr-sim, not a device)");
            }
            scale::scale_bench(backends, &args).map(|_| ())
        }
        BenchCommand::Isolation(args) => {
            if backends.verbs_name() == "sim" && !args.json {
                println!("(simulated NIC: the figures measure gdr-sim, not a device)");
            }
            isolation::isolation_bench(backends, &args).map(|_| ())
        }
    }
}

/// Requests per post by default, 1..=16: WRITEs linked up to 64 KiB, READs
/// up to 1 MiB. Measured on rxe (one guest, TCG): a WRITE doorbell makes
/// the kernel move the payload inside that system call, and linking 1 MiB
/// WRITEs 4 or 16 at a time halves their throughput; a READ request is one
/// small packet, and 16 per post lift 64 KiB READs by ~20%.
fn default_post_list(op: Op, size: usize) -> u32 {
    let budget: usize = match op {
        Op::Write => 64 << 10,
        Op::Read => 1 << 20,
    };
    u32::try_from(budget / size.max(1))
        .unwrap_or(u32::MAX)
        .clamp(1, 16)
}

/// Messages of `size` bytes per measurement: `volume` bytes worth, at least
/// 5; without a volume, 128 MiB worth, 32..=5000.
fn iterations_for(size: usize, volume: Option<usize>) -> u64 {
    let size = size.max(1) as u64;
    match volume {
        Some(volume) => (volume as u64 / size).max(5),
        None => ((128u64 << 20) / size).clamp(32, 5000),
    }
}

/// The device named, else the provider's first.
fn pick_device<A: Api>(
    provider: &A::Provider,
    named: Option<&str>,
) -> Result<String, Box<dyn Error>> {
    match named {
        Some(name) => Ok(name.to_owned()),
        None => Ok(provider
            .devices()?
            .into_iter()
            .next()
            .ok_or("no RDMA device")?
            .name),
    }
}

fn rdma<A: Api>(provider: &A::Provider, args: &RdmaArgs) -> Result<(), Box<dyn Error>> {
    let device = pick_device::<A>(provider, args.common.device.as_deref())?;
    let ctx = provider.open(&device)?;
    let attrs = ctx.query_device()?;
    let bound = |limit: u32| if limit == 0 { u32::MAX } else { limit };
    let depth = args
        .tx_depth
        .max(1)
        .min(bound(attrs.max_qp_wr))
        .min(bound(attrs.max_cqe));
    let largest = args.sizes.iter().copied().max().ok_or("no sizes")?;
    if u32::try_from(largest).is_err() {
        return Err(format!("{largest} bytes exceed one work request's 4 GiB").into());
    }

    let pd = ctx.alloc_pd()?;
    // Every request may be signaled (cq-mod 1): room for a window's worth.
    // On a completion channel, where the provider makes one, for `--idle
    // park`.
    let (channel, cq) = channel_cq::<A>(&ctx, depth)?;
    let waiter = Waiter::<A> {
        cq: &cq,
        channel: channel.as_ref(),
        cq_waiter: CqWaiter::new()?,
    };
    let config = PairConfig {
        caps: send_caps(depth),
        // As many READs in flight as the device allows, as perftest asks.
        rd_atomic: u8::try_from(attrs.max_qp_init_rd_atom.min(attrs.max_qp_rd_atom))
            .unwrap_or(u8::MAX)
            .max(1),
    };
    let pair = QpPair::<A>::connect(&ctx, &pd, &cq, args.common.port, &config)?;
    // Granted may exceed asked; never use more than asked.
    let window_cap = u64::from(pair.requester.caps().max_send_wr.min(depth));
    let local = HostRegion::<A>::new(&pd, largest, AccessFlags::LOCAL_WRITE)?;
    let remote = HostRegion::<A>::new(
        &pd,
        largest,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
    )?;

    if !args.common.json {
        println!(
            "gdr bench rdma on {device} ({}), host memory, window {window_cap}, signal every {}, \
             post list {}, idle {:?}",
            provider.backend_name(),
            args.cq_mod,
            args.post_list.map_or_else(
                || "auto (WRITE 64 KiB, READ 1 MiB)".to_owned(),
                |n| n.to_string()
            ),
            args.idle
        );
        println!("MB/s = 2^20 bytes/s (as perftest); Gb/s = 10^9 bits/s");
        println!(
            "{:<6} {:>9} {:>10} {:>10} {:>9} {:>10} {:>9}",
            "op", "size", "iters", "MB/s", "Gb/s", "msg/s", "seconds"
        );
    }
    let progress = progress_bar(args.ops.len() * args.sizes.len());
    for &op in &args.ops {
        for &size in &args.sizes {
            progress.set_message(format!("{} {size} bytes", op.name()));
            let iterations = args
                .iterations
                .unwrap_or_else(|| iterations_for(size, args.volume))
                .max(1);
            let window = window_cap.min(iterations).max(1);
            let plan = Plan {
                op,
                size,
                iterations,
                window,
                cq_mod: u64::from(args.cq_mod).clamp(1, window),
                post_list: usize::try_from(
                    args.post_list
                        .unwrap_or_else(|| default_post_list(op, size)),
                )
                .unwrap_or(usize::MAX)
                .clamp(1, usize::try_from(window).unwrap_or(usize::MAX)),
                idle: args.idle,
            };
            if args.warmup > 0 {
                let warm = Plan {
                    iterations: args.warmup,
                    window: window.min(args.warmup),
                    cq_mod: plan.cq_mod.min(args.warmup),
                    ..plan
                };
                measure::<A>(&pair, &waiter, &local.mr, &remote.mr, warm)
                    .map_err(|e| drain_after_failure::<A>(&pair, &cq, e))?;
            }
            let m = measure::<A>(&pair, &waiter, &local.mr, &remote.mr, plan)
                .map_err(|e| drain_after_failure::<A>(&pair, &cq, e))?;
            progress.inc(1);
            if args.common.json {
                emit(&progress, json_line(&m, provider.backend_name(), &device));
            } else {
                emit(
                    &progress,
                    format!(
                        "{:<6} {:>9} {:>10} {:>10.2} {:>9.3} {:>10.0} {:>9.3}",
                        op.name(),
                        size,
                        iterations,
                        m.mib_per_s(),
                        m.gbit_per_s(),
                        m.per_s(),
                        m.seconds()
                    ),
                );
            }
            tracing::debug!(
                op = op.name(),
                size,
                posts = m.posts,
                polls = m.polls,
                empty_polls = m.empty_polls,
                "measured"
            );
        }
    }
    progress.finish_and_clear();
    Ok(())
}

/// A progress bar over a run's `measurements` (op, size) pairs, on
/// stderr, naming the one running, with a spinner and the time spent so a
/// long measurement shows it is alive. Hidden where stderr is not a
/// terminal (a pipe, a file, CI), so captured output stays clean; cleared
/// when the run ends or fails. The spinner ticks from a thread of its own
/// every 200 ms: nothing next to the measured loop.
fn progress_bar(measurements: usize) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} measurements: {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    let bar =
        ProgressBar::with_draw_target(Some(measurements as u64), ProgressDrawTarget::stderr())
            .with_style(style)
            .with_finish(ProgressFinish::AndClear);
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Prints a result line on stdout, the bar (on stderr) out of its way.
fn emit(progress: &ProgressBar, line: String) {
    progress.suspend(|| println!("{line}"));
}

/// How long a failed measurement's queue pair may take to flush.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The bench's CQ, its channel (when the provider made one) and the
/// library's waiter on them (`--idle park`).
struct Waiter<'q, A: Api> {
    cq: &'q A::CompletionQueue,
    channel: Option<&'q A::CompletionChannel>,
    cq_waiter: CqWaiter,
}

/// The queue sizes of a bench's queue pair: `depth` requests of one SG
/// entry each on its send queue, no inline data, one receive (never
/// posted: the requests are one-sided).
fn send_caps(depth: u32) -> QpCaps {
    QpCaps {
        max_send_wr: depth,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    }
}

/// A CQ of `depth` entries on a completion channel of its own where the
/// provider makes one (for `--idle park`), else a plain one.
fn channel_cq<A: Api>(
    ctx: &A::Context,
    depth: u32,
) -> Result<(Option<A::CompletionChannel>, A::CompletionQueue), hal_verbs::VerbsError> {
    let channel = ctx.create_comp_channel().ok();
    let cq = match &channel {
        Some(channel) => ctx.create_cq_on_channel(depth, channel, 0)?,
        None => ctx.create_cq(depth)?,
    };
    Ok((channel, cq))
}

/// A measurement failed with requests still outstanding on the requester:
/// drains it (to ERROR, every outstanding request flushed and polled)
/// before the pair and the regions are torn down, since ConnectX drops a
/// destroyed QP's completions and the NIC may still be using the buffers.
/// Returns the measurement's error, with the drain's failure added if any.
fn drain_after_failure<A: Api>(
    pair: &QpPair<A>,
    cq: &A::CompletionQueue,
    error: Box<dyn Error>,
) -> Box<dyn Error> {
    match hal_verbs::drain::drain::<A>(&pair.requester, cq, cq, DRAIN_TIMEOUT) {
        Ok(flushed) => {
            tracing::debug!(
                completions = flushed.len(),
                "drained the requester after a failed measurement"
            );
            error
        }
        Err(drain) => {
            tracing::warn!(%drain, "draining the requester after a failed measurement");
            format!("{error} (then {drain})").into()
        }
    }
}

fn json_line(m: &Measurement, backend: &str, device: &str) -> String {
    let p = &m.plan;
    let mut s = String::new();
    // Writing to a String cannot fail.
    let _ = write!(
        s,
        "{{\"bench\":\"rdma\",\"backend\":\"{backend}\",\"device\":\"{device}\",\
         \"op\":\"{}\",\"size\":{},\"iterations\":{},\"window\":{},\"cq_mod\":{},\
         \"post_list\":{},\"seconds\":{:.6},\"bytes\":{},\"mb_per_s\":{:.3},\
         \"gbit_per_s\":{:.4},\"msg_per_s\":{:.1},\"posts\":{},\"polls\":{},\
         \"empty_polls\":{}}}",
        p.op.name(),
        p.size,
        p.iterations,
        p.window,
        p.cq_mod,
        p.post_list,
        m.seconds(),
        m.bytes(),
        m.mib_per_s(),
        m.gbit_per_s(),
        m.per_s(),
        m.posts,
        m.polls,
        m.empty_polls
    );
    s
}

/// Runs one measurement: `plan.iterations` requests, at most `plan.window`
/// outstanding, posted `plan.post_list` at a time, every `plan.cq_mod`-th
/// (and the last) signaled. A completion of request `i` retires every
/// request up to `i`: an RC send queue completes in order.
fn measure<A: Api>(
    pair: &QpPair<A>,
    waiter: &Waiter<'_, A>,
    local: &A::MemoryRegion,
    remote: &A::MemoryRegion,
    plan: Plan,
) -> Result<Measurement, Box<dyn Error>> {
    let length = u32::try_from(plan.size)?;
    let op = match plan.op {
        Op::Write => SendOp::Write {
            remote_addr: remote.addr(),
            rkey: remote.rkey(),
        },
        Op::Read => SendOp::Read {
            remote_addr: remote.addr(),
            rkey: remote.rkey(),
        },
    };
    let template = SendRequest {
        wr_id: 0,
        op,
        sg_list: SgList::from_slice(&[Sge {
            addr: local.addr(),
            length,
            lkey: local.lkey(),
        }]),
        flags: SendFlags::empty(),
    };
    let mut batch = vec![template; plan.post_list];
    let mut completions =
        vec![Completion::default(); usize::try_from(plan.window / plan.cq_mod + 1).unwrap_or(64)];
    let qp = &pair.requester;
    let (mut posted, mut completed) = (0u64, 0u64);
    let (mut posts, mut polls, mut empty_polls) = (0u64, 0u64, 0u64);
    let cq = waiter.cq;
    let mut parked = Vec::new();

    let started = Instant::now();
    while completed < plan.iterations {
        // Fill the window, a linked list per post.
        while posted < plan.iterations && posted - completed < plan.window {
            let room = (plan.window - (posted - completed)).min(plan.iterations - posted);
            let n = usize::try_from(room)
                .unwrap_or(usize::MAX)
                .min(plan.post_list);
            for (i, request) in batch[..n].iter_mut().enumerate() {
                let seq = posted + i as u64;
                request.wr_id = seq;
                request.flags =
                    if (seq + 1).is_multiple_of(plan.cq_mod) || seq + 1 == plan.iterations {
                        SendFlags::SIGNALED
                    } else {
                        SendFlags::empty()
                    };
            }
            // SAFETY: the SG entries lie in `local`, and the remote range in
            // `remote`, both registered and alive until after this function
            // returns; it returns only once every request has completed, or
            // with an error after which the QP is never posted to again and
            // is destroyed (flushing) before the regions are deregistered.
            unsafe { qp.post_send(&batch[..n]) }.map_err(|e| e.error)?;
            posted += n as u64;
            posts += 1;
        }
        let mut got = cq.poll(&mut completions)?;
        polls += 1;
        let mut retired = &completions[..got];
        if got == 0 {
            empty_polls += 1;
            if plan.idle != Idle::Park {
                idle_after_empty_poll(plan.idle);
                continue;
            }
            parked.clear();
            got = waiter.cq_waiter.wait::<A>(
                cq,
                waiter.channel,
                Some(Instant::now() + PARK_TIMEOUT),
                &mut parked,
            )?;
            if got == 0 {
                return Err(format!(
                    "no completion of {} {} bytes within {PARK_TIMEOUT:?}",
                    plan.op.name(),
                    plan.size
                )
                .into());
            }
            retired = &parked;
        }
        for c in retired {
            if !c.status.is_success() {
                return Err(format!(
                    "{} of {} bytes (request {}) completed with {}",
                    plan.op.name(),
                    plan.size,
                    c.wr_id,
                    c.status
                )
                .into());
            }
            completed = completed.max(c.wr_id + 1);
        }
    }
    Ok(Measurement {
        plan,
        elapsed: started.elapsed(),
        polls,
        empty_polls,
        posts,
    })
}

/// How `gdr bench engine` makes the engine progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Progress {
    /// The bench thread calls `Engine::progress` between submissions and
    /// applies `--idle` when nothing completed.
    Inline,
    /// A driver thread (`Engine::spawn_driver`) polls; the bench thread
    /// sleeps on the oldest batch's completion.
    Driver,
}

/// Options of `gdr bench engine`.
#[derive(Debug, Args)]
pub struct EngineArgs {
    /// Sizes of one request, comma-separated (suffixes K, M, G: powers of
    /// 1024).
    #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M,4M", value_parser = parse_size)]
    sizes: Vec<usize>,
    /// Operations, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "write,read")]
    ops: Vec<Op>,
    /// Requests per submitted batch. Default: as many as make 256 KiB,
    /// 1..=64.
    #[arg(long)]
    batch: Option<u32>,
    /// Batches in flight.
    #[arg(long, default_value_t = 4)]
    depth: u32,
    /// Queue pairs per peer (the engine's `qps_per_peer`). Default: the
    /// engine's.
    #[arg(long)]
    qps: Option<u16>,
    /// Largest single RDMA request (the engine's `slice_size`; suffixes K,
    /// M, G). Default: the engine's.
    #[arg(long, value_parser = parse_size)]
    slice: Option<usize>,
    /// Work requests in flight per queue pair (the engine's `qp_depth`).
    /// Default: the engine's.
    #[arg(long)]
    qp_depth: Option<u32>,
    /// A completion every this many work requests (the engine's
    /// `signal_every`). Default: the engine's.
    #[arg(long)]
    signal_every: Option<u32>,
    /// Seconds per measurement (the default, 2 s, when neither `-n` nor
    /// `--volume` is given).
    #[arg(long, conflicts_with_all = ["iterations", "volume"])]
    duration: Option<f64>,
    /// Requests per measurement.
    #[arg(long, short = 'n', conflicts_with = "volume")]
    iterations: Option<u64>,
    /// Bytes per measurement (suffixes K, M, G), at least 5 requests: as
    /// `gdr bench rdma --volume`.
    #[arg(long, value_parser = parse_size)]
    volume: Option<usize>,
    /// Untimed batches before each measurement.
    #[arg(long, default_value_t = 4)]
    warmup: u64,
    /// Who polls the engine.
    #[arg(long, value_enum, default_value_t = Progress::Inline)]
    progress: Progress,
    /// Empty-poll policy of `--progress inline` (as `gdr bench rdma`;
    /// `park`: the bench thread waits on the oldest batch, driving the
    /// engine's reactor).
    #[arg(long, value_enum, default_value_t = Idle::Park)]
    idle: Idle,
    /// Serve one `--connect` client on this address (e.g. 0.0.0.0:18515)
    /// instead of measuring: grant it the memory it asks for, exit once it
    /// is done. Only `-d` (the NIC; default: every NIC) applies.
    #[arg(long, conflicts_with = "connect")]
    listen: Option<SocketAddr>,
    /// Measure against a `--listen` server at this address (another node)
    /// instead of a second engine in this process; `-d` picks the local NIC
    /// (default: the route's).
    #[arg(long)]
    connect: Option<SocketAddr>,
    #[command(flatten)]
    common: Common,
}

/// Bound on connecting, granting and each batch: generous, for a software
/// NIC under software emulation.
const ENGINE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a `--listen` server waits for its client, and for it to be
/// done measuring.
const SERVE_TIMEOUT: Duration = Duration::from_secs(600);

/// The `--listen`/`--connect` exchange, in control messages of a tag and a
/// little-endian u64: the client asks for `span` bytes, the server answers
/// with the id of its grant of them, the client says when it is `done`.
const SPAN: &[u8; 4] = b"span";
const GRANT: &[u8; 4] = b"grnt";
const DONE: &[u8; 4] = b"done";

fn message(tag: &[u8; 4], value: u64) -> [u8; 12] {
    let mut m = [0; 12];
    m[..4].copy_from_slice(tag);
    m[4..].copy_from_slice(&value.to_le_bytes());
    m
}

/// The value of `message` if it is `tag`'s.
fn parse_message(tag: &[u8; 4], message: &[u8]) -> Result<u64, Box<dyn Error>> {
    match message.split_first_chunk::<4>() {
        Some((t, value)) if t == tag && value.len() == 8 => {
            Ok(u64::from_le_bytes(value.try_into().expect("8 bytes")))
        }
        _ => Err(format!(
            "expected a {:?} message, got {message:?}",
            String::from_utf8_lossy(tag)
        )
        .into()),
    }
}

/// Sends `tag` and `value` and waits until the peer's NIC has it.
fn send_message(peer: &Peer, tag: &[u8; 4], value: u64) -> Result<(), Box<dyn Error>> {
    peer.send(&message(tag, value))?.wait(ENGINE_TIMEOUT)?;
    Ok(())
}

/// The peer's next message: the engine's reactor parks the waiting
/// thread (after a short spin), so it does not take the CPU that moves
/// the packets.
fn recv_message(peer: &Peer, tag: &[u8; 4], timeout: Duration) -> Result<u64, Box<dyn Error>> {
    match peer.recv(timeout) {
        Ok(m) => parse_message(tag, &m),
        Err(EngineError::Timeout(_)) => Err(format!(
            "no {:?} message from the peer within {timeout:?}",
            String::from_utf8_lossy(tag)
        )
        .into()),
        Err(e) => Err(e.into()),
    }
}

/// An engine of the backends' provider on `device`, or on every NIC.
fn engine_on(
    backends: &Backends,
    device: Option<&str>,
    mut config: EngineConfig,
) -> Result<Engine, EngineError> {
    config.devices = device.map(|d| vec![d.to_owned()]);
    Engine::new(backends.verbs(), None, config)
}

/// `gdr bench engine --listen ADDR`: one engine (on `device`, or every
/// NIC) serving one client: grants it the host memory it asks for, then
/// waits, doing nothing, until it is done (its requests are one-sided).
fn serve_engine(
    backends: &Backends,
    addr: SocketAddr,
    device: Option<&str>,
    config: EngineConfig,
) -> Result<(), Box<dyn Error>> {
    let engine = engine_on(backends, device, config)?;
    let listener = engine.listen(addr)?;
    println!(
        "gdr bench engine: serving on {} ({}, {})",
        listener.local_addr(),
        backends.verbs_name(),
        engine.nics().join(", ")
    );
    // A client that failed after connecting (and retries) leaves a peer
    // that never asks, or a half-accepted one (its stale connect request
    // fails to accept under emulation): accept again.
    let deadline = Instant::now() + SERVE_TIMEOUT;
    let (peer, span) = loop {
        let peer = match listener.accept(deadline.saturating_duration_since(Instant::now())) {
            Ok(peer) => peer,
            Err(e @ EngineError::Timeout(_)) => return Err(e.into()),
            Err(e) => {
                eprintln!("gdr bench engine: accepting a client failed ({e}); waiting");
                continue;
            }
        };
        match recv_message(&peer, SPAN, ENGINE_TIMEOUT) {
            Ok(span) => break (peer, span),
            Err(e) => eprintln!("gdr bench engine: a client left without asking ({e}); waiting"),
        }
    };
    let buffer = host_buffer(span, 0xa5)?;
    let region = engine.register_buffer(&buffer)?;
    let grant = peer.grant(&region, 0, span, GrantRights::ReadWrite)?;
    send_message(&peer, GRANT, grant.descriptor().grant)?;
    println!(
        "gdr bench engine: granted {span} bytes to {}; serving until it is done",
        peer.addr()
            .map_or_else(|| "?".to_owned(), |a| a.to_string())
    );
    recv_message(&peer, DONE, SERVE_TIMEOUT)?;
    println!("gdr bench engine: the client is done");
    Ok(())
}

/// Where the measured batches go: the engine that submits them, its peer,
/// and the peer's grant of `span` bytes.
struct Target {
    engine: Engine,
    peer: Peer,
    descriptor: MemoryDescriptor,
    /// The NIC the batches leave by (the first queue pair's).
    device: String,
    /// The address connected to.
    addr: SocketAddr,
    /// In-process: the serving engine's side, kept until the end.
    server: Option<InProcessServer>,
}

/// The serving side of the in-process pair. Field order is drop order:
/// the grant (and its memory), then the engines.
struct InProcessServer {
    _served: Served,
    pair: EnginePair,
}

/// Host memory a serving engine granted one peer. Field order is drop
/// order: the grant, its region, the memory.
pub(crate) struct Served {
    _grant: Grant,
    _region: Region,
    _buffer: Buffer,
}

/// A host buffer of `len` bytes, each `byte` (touched before it is
/// registered, so no page is faulted in while a clock runs).
pub(crate) fn host_buffer(len: u64, byte: u8) -> Result<Buffer, Box<dyn Error>> {
    let buffer = Buffer::alloc_host(len);
    buffer.write_at(0, &vec![byte; usize::try_from(len)?])?;
    Ok(buffer)
}

/// `span` bytes of `server`'s host memory granted (read and write) to the
/// peer `to_client` serves, and the descriptor `to_server` (that peer's
/// end) received of it.
pub(crate) fn grant_host(
    server: &Engine,
    to_client: &Peer,
    to_server: &Peer,
    span: u64,
) -> Result<(Served, MemoryDescriptor), Box<dyn Error>> {
    let buffer = host_buffer(span, 0xa5)?;
    let region = server.register_buffer(&buffer)?;
    let grant = to_client.grant(&region, 0, span, GrantRights::ReadWrite)?;
    let descriptor = to_server.wait_grant(grant.descriptor().grant, ENGINE_TIMEOUT)?;
    Ok((
        Served {
            _grant: grant,
            _region: region,
            _buffer: buffer,
        },
        descriptor,
    ))
}

impl Target {
    /// Two engines in this process ([`connect_engines`], on `device` or
    /// the first, listening on `port`'s address), the server granting
    /// `span` bytes of host memory.
    fn in_process(
        backends: &Backends,
        device: Option<&str>,
        port: u8,
        config: EngineConfig,
        span: u64,
    ) -> Result<Self, Box<dyn Error>> {
        let pair = connect_engines(backends, device, port, None, config)?;
        let (served, descriptor) =
            grant_host(&pair.server, &pair.to_client, &pair.to_server, span)?;
        Ok(Self {
            engine: pair.client.clone(),
            peer: pair.to_server.clone(),
            descriptor,
            device: pair.device.clone(),
            addr: pair.addr,
            server: Some(InProcessServer {
                _served: served,
                pair,
            }),
        })
    }

    /// An engine here connected to a `--listen` server at `addr` (retrying
    /// while it does not listen yet), which grants `span` bytes.
    fn remote(
        backends: &Backends,
        addr: SocketAddr,
        device: Option<&str>,
        config: EngineConfig,
        span: u64,
    ) -> Result<Self, Box<dyn Error>> {
        let engine = engine_on(backends, device, config)?;
        // One attempt may use all the time left (rdma_cm's connect itself
        // retries while nobody listens): a short one can fail after the
        // server accepted, under emulation, and leave it a dead peer. The
        // loop is for what fails at once, e.g. no route yet.
        let deadline = Instant::now() + ENGINE_TIMEOUT;
        let peer = loop {
            match engine.connect(addr, deadline.saturating_duration_since(Instant::now())) {
                Ok(peer) => break peer,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(%addr, error = %e, "the server is not ready: retrying");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(format!("connecting to {addr}: {e}").into()),
            }
        };
        send_message(&peer, SPAN, span)?;
        let grant = recv_message(&peer, GRANT, ENGINE_TIMEOUT)?;
        let descriptor = peer.wait_grant(grant, ENGINE_TIMEOUT)?;
        if descriptor.len < span {
            return Err(format!("the server granted {} of {span} bytes", descriptor.len).into());
        }
        let device = peer
            .counters()
            .first()
            .map(|(_, nic, _)| nic.clone())
            .ok_or("a peer without queue pairs")?;
        Ok(Self {
            engine,
            peer,
            descriptor,
            device,
            addr,
            server: None,
        })
    }

    /// Tells a remote server the measurements are over.
    fn finish(&self) -> Result<(), Box<dyn Error>> {
        if self.server.is_none() {
            send_message(&self.peer, DONE, 0)?;
        }
        Ok(())
    }
}

/// The bytes a measurement's buffers span at most: requests of a batch go
/// to successive offsets until this much, then wrap (perftest, too, reuses
/// its buffer).
const SPAN_CAP: usize = 16 << 20;

/// Two engines in this process, connected over rdma_cm: `server` on the
/// chosen device of the backends' provider, listening on that device's own
/// address (its RoCE v2 GID); `client` on the peer provider (the same
/// device on real hardware, another node of the fabric on the sim),
/// connected to it.
pub(crate) struct EnginePair {
    /// The connecting engine.
    pub(crate) client: Engine,
    /// The listening engine.
    pub(crate) server: Engine,
    /// The client's peer: the server.
    pub(crate) to_server: Peer,
    /// The server's peer: the client.
    pub(crate) to_client: Peer,
    /// The device the server listens on.
    pub(crate) device: String,
    /// Where it listens.
    pub(crate) addr: SocketAddr,
    // Last: outlives the engines opened from it.
    _peer_provider: hal_verbs::dynamic::DynProvider,
}

impl fmt::Debug for EnginePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EnginePair")
            .field("device", &self.device)
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// The first IPv4 (else IPv6) RoCE v2 address of `device`'s `port`.
fn device_address(
    provider: &hal_verbs::dynamic::DynProvider,
    device: &str,
    port: u8,
) -> Result<IpAddr, Box<dyn Error>> {
    let table = provider.open(device)?.gid_table(port)?;
    hal_verbs::select_roce_v2_gid(&table, AddressFamily::V4)
        .or_else(|| hal_verbs::select_roce_v2_gid(&table, AddressFamily::V6))
        .map(|entry| entry.gid.to_ip())
        .ok_or_else(|| format!("{device} port {port} has no RoCE v2 address").into())
}

/// The engines' configuration where only host memory moves: the defaults
/// with the bench's timeout, and no GPU rung to prove.
pub(crate) fn host_memory_config() -> EngineConfig {
    EngineConfig::default()
        .with_default_timeout(ENGINE_TIMEOUT)
        .with_ladder(LadderConfig::default().with_self_check(false))
}

/// Two engines in this process, not connected yet: `server` on a device
/// of the backends' provider, `client` on the peer provider (as in
/// [`EnginePair`]).
pub(crate) struct Engines {
    pub(crate) client: Engine,
    pub(crate) server: Engine,
    /// The server's device.
    pub(crate) device: String,
    /// Its RoCE v2 address, where the server listens.
    ip: IpAddr,
    // Last: outlives the engines opened from it.
    peer_provider: hal_verbs::dynamic::DynProvider,
}

impl Engines {
    /// A listener of the server on its device's address (a port of its
    /// own).
    pub(crate) fn listen(&self) -> Result<Listener, EngineError> {
        self.server.listen(SocketAddr::new(self.ip, 0))
    }

    /// One more peer of the client, accepted by `listener` (in another
    /// thread meanwhile): the client's end (to the server) and the
    /// server's.
    pub(crate) fn connect(&self, listener: &Listener) -> Result<Ends, EngineError> {
        connect_to(&self.client, listener)
    }
}

/// One more peer of `client`, accepted by `listener` (in another thread
/// meanwhile): the client's end and the listening engine's.
pub(crate) fn connect_to(client: &Engine, listener: &Listener) -> Result<Ends, EngineError> {
    let addr = listener.local_addr();
    std::thread::scope(|s| {
        let accepting = s.spawn(move || listener.accept(ENGINE_TIMEOUT));
        let connected = client.connect(addr, ENGINE_TIMEOUT);
        // A panic of the accepting thread is this thread's.
        let accepted = accepting
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        Ok((connected?, accepted?))
    })
}

/// The two ends of one connection between two engines: the client's peer
/// (the server) and the server's (the client).
pub(crate) type Ends = (Peer, Peer);

/// Starts two engines (`config`, on `device` or the first one) and
/// connects them; GPU memory of `cuda` for both.
pub(crate) fn connect_engines(
    backends: &Backends,
    device: Option<&str>,
    port: u8,
    cuda: Option<&hal_cuda::dynamic::DynDriver>,
    config: EngineConfig,
) -> Result<EnginePair, Box<dyn Error>> {
    let engines = start_engines(backends, device, port, cuda, config)?;
    let listener = engines.listen()?;
    let addr = listener.local_addr();
    let (to_server, to_client) = engines.connect(&listener)?;
    let Engines {
        client,
        server,
        device,
        ip: _,
        peer_provider,
    } = engines;
    Ok(EnginePair {
        client,
        server,
        to_server,
        to_client,
        device,
        addr,
        _peer_provider: peer_provider,
    })
}

/// Starts two engines (`config`, on `device` or the first one), to be
/// connected; GPU memory of `cuda` for both.
pub(crate) fn start_engines(
    backends: &Backends,
    device: Option<&str>,
    port: u8,
    cuda: Option<&hal_cuda::dynamic::DynDriver>,
    mut config: EngineConfig,
) -> Result<Engines, Box<dyn Error>> {
    let provider = backends.verbs();
    let device = pick_device::<hal_verbs::dynamic::DynApi>(provider, device)?;
    let ip = device_address(provider, &device, port)?;
    let server = Engine::new(
        provider,
        cuda,
        config.clone().with_devices([device.clone()]),
    )?;
    let peer_provider = backends.peer_provider();
    // The same device where the peer provider has it (real hardware);
    // else whatever its route picks.
    let same = peer_provider.devices()?.iter().any(|d| d.name == device);
    config.devices = same.then(|| vec![device.clone()]);
    let client = Engine::new(&peer_provider, cuda, config)?;
    Ok(Engines {
        client,
        server,
        device,
        ip,
        peer_provider,
    })
}

/// Distinct request slots of a batch of `batch` requests of `size` bytes:
/// successive offsets, up to [`SPAN_CAP`] (one request at least).
fn slots(batch: u32, size: usize) -> usize {
    (batch as usize).min((SPAN_CAP / size.max(1)).max(1))
}

/// Requests per batch by default: 256 KiB worth, 1..=64.
fn default_batch(size: usize) -> u32 {
    u32::try_from((256usize << 10) / size.max(1))
        .unwrap_or(u32::MAX)
        .clamp(1, 64)
}

/// When a measurement stops submitting.
#[derive(Debug, Clone, Copy)]
enum Budget {
    Requests(u64),
    Time(Duration),
}

/// One engine measurement's parameters.
#[derive(Debug, Clone, Copy)]
struct EnginePlan {
    op: Op,
    size: usize,
    batch: u32,
    depth: u32,
    /// Distinct request slots in the buffers.
    slots: usize,
    budget: Budget,
    /// Who polls the engine.
    progress: Progress,
    /// The empty-poll policy of inline progress.
    idle: Idle,
}

/// One engine measurement's result.
#[derive(Debug, Clone)]
struct EngineMeasurement {
    plan: EnginePlan,
    requests: u64,
    batches: u64,
    elapsed: Duration,
    /// Batch latencies, sorted, in nanoseconds.
    latencies: Vec<u64>,
}

impl Rates for EngineMeasurement {
    fn requests(&self) -> u64 {
        self.requests
    }
    fn size(&self) -> usize {
        self.plan.size
    }
    fn elapsed(&self) -> Duration {
        self.elapsed
    }
}

impl EngineMeasurement {
    /// The `p`-quantile (nearest rank) of the batch latencies, in µs.
    fn latency_us(&self, p: f64) -> f64 {
        percentile(&self.latencies, p) as f64 / 1e3
    }
}

/// The nearest-rank `p`-quantile of sorted `values` (0 when empty).
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `gdr bench engine`: the measurements made (none when serving).
fn engine_bench(
    backends: &Backends,
    args: &EngineArgs,
) -> Result<Vec<EngineMeasurement>, Box<dyn Error>> {
    let defaults = EngineConfig::default();
    let config = defaults
        .clone()
        .with_qps_per_peer(args.qps.unwrap_or(defaults.qps_per_peer).max(1))
        .with_slice_size(args.slice.map_or(defaults.slice_size, |s| s as u64).max(1))
        .with_qp_depth(args.qp_depth.unwrap_or(defaults.qp_depth).max(1))
        .with_signal_every(args.signal_every.unwrap_or(defaults.signal_every).max(1))
        .with_default_timeout(ENGINE_TIMEOUT);
    let (qps, slice, qp_depth, signal_every) = (
        config.qps_per_peer,
        config.slice_size,
        config.qp_depth,
        config.signal_every,
    );
    if let Some(addr) = args.listen {
        serve_engine(backends, addr, args.common.device.as_deref(), config)?;
        return Ok(Vec::new());
    }
    let largest = args.sizes.iter().copied().max().ok_or("no sizes")?;
    let batch_of = |size: usize| args.batch.unwrap_or_else(|| default_batch(size)).max(1);
    let slots_of = |size: usize| slots(batch_of(size), size);
    let span = args
        .sizes
        .iter()
        .map(|&size| size * slots_of(size))
        .max()
        .unwrap_or(largest) as u64;

    let target = match args.connect {
        Some(addr) => Target::remote(backends, addr, args.common.device.as_deref(), config, span)?,
        None => Target::in_process(
            backends,
            args.common.device.as_deref(),
            args.common.port,
            config,
            span,
        )?,
    };
    let local_buffer = host_buffer(span, 0x5a)?;
    let local = target.engine.register_buffer(&local_buffer)?;
    let _driver = match args.progress {
        Progress::Driver => Some(target.engine.spawn_driver()?),
        Progress::Inline => None,
    };

    let backend = backends.verbs_name();
    if !args.common.json {
        println!(
            "gdr bench engine on {} ({backend}), host memory, engine to engine over rdma_cm \
             ({}{}): {qps} QPs, slice {slice}, QP depth {qp_depth}, signal every {signal_every}, \
             batch {}, {} batches in flight, progress {}",
            target.device,
            target.addr,
            if target.server.is_some() {
                ", both in this process"
            } else {
                ", a remote server"
            },
            args.batch.map_or_else(
                || "auto (256 KiB, 1..=64 requests)".to_owned(),
                |n| n.to_string()
            ),
            args.depth.max(1),
            match args.progress {
                Progress::Inline => format!("inline (idle {:?})", args.idle),
                Progress::Driver => "by a driver thread".to_owned(),
            }
        );
        println!(
            "MB/s = 2^20 bytes/s (as perftest); Gb/s = 10^9 bits/s; ops/s = requests/s; \
             latency: a batch's, submit to wait returning, in µs"
        );
        println!(
            "{:<6} {:>9} {:>6} {:>9} {:>10} {:>9} {:>10} {:>9} {:>9} {:>9} {:>8}",
            "op",
            "size",
            "batch",
            "requests",
            "MB/s",
            "Gb/s",
            "ops/s",
            "p50",
            "p99",
            "p999",
            "seconds"
        );
    }
    let mut measured = Vec::new();
    let progress = progress_bar(args.ops.len() * args.sizes.len());
    for &op in &args.ops {
        for &size in &args.sizes {
            progress.set_message(format!("{} {size} bytes", op.name()));
            let budget = match (args.duration, args.iterations, args.volume) {
                (_, Some(n), _) => Budget::Requests(n.max(1)),
                (_, None, Some(volume)) => Budget::Requests(iterations_for(size, Some(volume))),
                (Some(seconds), None, None) => {
                    Budget::Time(Duration::from_secs_f64(seconds.max(0.0)))
                }
                (None, None, None) => Budget::Time(Duration::from_secs(2)),
            };
            let plan = EnginePlan {
                op,
                size,
                batch: batch_of(size),
                depth: args.depth.max(1),
                slots: slots_of(size),
                budget,
                progress: args.progress,
                idle: args.idle,
            };
            if args.warmup > 0 {
                let warm = EnginePlan {
                    budget: Budget::Requests(args.warmup * u64::from(plan.batch)),
                    ..plan
                };
                measure_engine(
                    &target.engine,
                    &target.peer,
                    &target.descriptor,
                    &local,
                    warm,
                )?;
            }
            let m = measure_engine(
                &target.engine,
                &target.peer,
                &target.descriptor,
                &local,
                plan,
            )?;
            progress.inc(1);
            if args.common.json {
                emit(
                    &progress,
                    engine_json_line(&m, backend, &target.device, qps, slice, args.progress),
                );
            } else {
                emit(
                    &progress,
                    format!(
                        "{:<6} {:>9} {:>6} {:>9} {:>10.2} {:>9.3} {:>10.0} {:>9.1} {:>9.1} {:>9.1} {:>8.3}",
                        op.name(),
                        size,
                        plan.batch,
                        m.requests,
                        m.mib_per_s(),
                        m.gbit_per_s(),
                        m.per_s(),
                        m.latency_us(0.5),
                        m.latency_us(0.99),
                        m.latency_us(0.999),
                        m.seconds()
                    ),
                );
            }
            measured.push(m);
        }
    }
    progress.finish_and_clear();
    if !args.common.json {
        for (index, nic, c) in target.peer.counters() {
            println!(
                "queue pair {index} on {nic}: {} work requests, {} doorbells, {} signaled, {} bytes",
                c.posted, c.doorbells, c.signaled, c.bytes
            );
        }
    }
    target.finish()?;
    Ok(measured)
}

/// Runs one measurement: batches of `plan.batch` requests of `plan.size`
/// bytes (the last one shorter where the budget ends inside it), at most
/// `plan.depth` in flight, until the budget is spent; the clock runs from
/// the first submission to the moment the last batch is seen done.
pub(crate) fn measure_engine(
    engine: &Engine,
    peer: &Peer,
    remote: &MemoryDescriptor,
    local: &Region,
    plan: EnginePlan,
) -> Result<EngineMeasurement, Box<dyn Error>> {
    let size = plan.size as u64;
    let transfers: Vec<Transfer<'_>> = (0..plan.batch as usize)
        .map(|i| {
            let offset = (i % plan.slots) as u64 * size;
            match plan.op {
                Op::Write => Transfer::write(local, offset, remote, offset, size),
                Op::Read => Transfer::read(local, offset, remote, offset, size),
            }
        })
        .collect();
    let mut in_flight: VecDeque<(Batch, Instant, u64)> =
        VecDeque::with_capacity(plan.depth as usize);
    let mut latencies = Vec::new();
    let (mut submitted, mut requests, mut batches) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    let mut finished = started;
    loop {
        // Keep `depth` batches in flight while the budget lasts.
        while in_flight.len() < plan.depth as usize {
            let n = match plan.budget {
                Budget::Requests(total) => (total - submitted).min(u64::from(plan.batch)),
                Budget::Time(limit) if started.elapsed() < limit => u64::from(plan.batch),
                Budget::Time(_) => 0,
            };
            if n == 0 {
                break;
            }
            let at = Instant::now();
            let batch = peer.submit(&transfers[..n as usize])?;
            in_flight.push_back((batch, at, n));
            submitted += n;
        }
        let Some((oldest, _, _)) = in_flight.front() else {
            break;
        };
        match plan.progress {
            // The engine's reactor in this thread: it spins, then parks
            // until the oldest batch ends (or any other does: all are
            // looked at below).
            Progress::Inline if plan.idle == Idle::Park => {
                // (Its outcome, failed or not, is taken below.)
                let _ = oldest.wait(ENGINE_TIMEOUT);
                if oldest.status().is_none() {
                    return Err(format!(
                        "a batch of {} {} bytes did not end within {ENGINE_TIMEOUT:?}",
                        plan.op.name(),
                        plan.size
                    )
                    .into());
                }
            }
            Progress::Inline => {
                if engine.progress() == 0 {
                    idle_after_empty_poll(plan.idle);
                }
            }
            Progress::Driver => {
                // The driver thread makes progress; this only waits.
                if oldest.wait(ENGINE_TIMEOUT).is_err() && oldest.status().is_none() {
                    return Err(format!(
                        "a batch of {} {} bytes did not end within {ENGINE_TIMEOUT:?}",
                        plan.op.name(),
                        plan.size
                    )
                    .into());
                }
            }
        }
        // Every batch that ended, in whatever order.
        let now = Instant::now();
        let mut i = 0;
        while i < in_flight.len() {
            if in_flight[i].0.status().is_none() {
                i += 1;
                continue;
            }
            let (batch, at, n) = in_flight.remove(i).expect("index in range");
            if let Some(Err(e)) = batch.status() {
                return Err(format!(
                    "a batch of {n} {} of {} bytes failed: {e}",
                    plan.op.name(),
                    plan.size
                )
                .into());
            }
            latencies.push(u64::try_from(now.duration_since(at).as_nanos()).unwrap_or(u64::MAX));
            requests += n;
            batches += 1;
            finished = now;
        }
    }
    latencies.sort_unstable();
    Ok(EngineMeasurement {
        plan,
        requests,
        batches,
        elapsed: finished.duration_since(started),
        latencies,
    })
}

fn engine_json_line(
    m: &EngineMeasurement,
    backend: &str,
    device: &str,
    qps: u16,
    slice: u64,
    progress: Progress,
) -> String {
    let p = &m.plan;
    let mut s = String::new();
    // Writing to a String cannot fail.
    let _ = write!(
        s,
        "{{\"bench\":\"engine\",\"backend\":\"{backend}\",\"device\":\"{device}\",\
         \"op\":\"{}\",\"size\":{},\"batch\":{},\"depth\":{},\"qps\":{qps},\"slice\":{slice},\
         \"progress\":\"{}\",\"requests\":{},\"batches\":{},\"seconds\":{:.6},\"bytes\":{},\
         \"mb_per_s\":{:.3},\"gbit_per_s\":{:.4},\"ops_per_s\":{:.1},\"p50_us\":{:.2},\
         \"p99_us\":{:.2},\"p999_us\":{:.2}}}",
        p.op.name(),
        p.size,
        p.batch,
        p.depth,
        match progress {
            Progress::Inline => "inline",
            Progress::Driver => "driver",
        },
        m.requests,
        m.batches,
        m.seconds(),
        m.bytes(),
        m.mib_per_s(),
        m.gbit_per_s(),
        m.per_s(),
        m.latency_us(0.5),
        m.latency_us(0.99),
        m.latency_us(0.999)
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use gdr_sim::nic::{NodeConfig, SimFabric, SimVerbsApi};

    #[test]
    fn default_post_lists_by_op() {
        assert_eq!(default_post_list(Op::Write, 4096), 16);
        assert_eq!(default_post_list(Op::Write, 16 << 10), 4);
        assert_eq!(default_post_list(Op::Write, 64 << 10), 1);
        assert_eq!(default_post_list(Op::Write, 4 << 20), 1);
        assert_eq!(default_post_list(Op::Read, 64 << 10), 16);
        assert_eq!(default_post_list(Op::Read, 256 << 10), 4);
        assert_eq!(default_post_list(Op::Read, 1 << 20), 1);
    }

    #[test]
    fn iterations_fill_the_volume() {
        assert_eq!(iterations_for(64 << 10, None), 2048);
        assert_eq!(iterations_for(1 << 20, None), 128);
        assert_eq!(iterations_for(4 << 20, None), 32);
        assert_eq!(iterations_for(64, None), 5000);
        assert_eq!(iterations_for(64 << 10, Some(32 << 20)), 512);
        assert_eq!(iterations_for(4 << 20, Some(32 << 20)), 8);
        assert_eq!(iterations_for(4 << 20, Some(1 << 20)), 5);
    }

    /// Every combination of window, signaling and batching finishes on the
    /// simulated NIC, whose send queue refuses posts beyond its depth and
    /// retires unsignaled requests only through a later signaled one.
    #[test]
    fn measurement_loop_completes_on_the_sim() {
        let node = SimFabric::new().add_node("a", NodeConfig::default());
        for (tx_depth, cq_mod, post_list, iterations, idle) in [
            (128, 16, Some(16), 300, Idle::Spin),
            (8, 100, Some(1), 37, Idle::Park),
            (5, 3, Some(4), 11, Idle::Yield),
            (1, 1, None, 3, Idle::Park),
        ] {
            let args = RdmaArgs {
                sizes: vec![4096, 65536],
                ops: vec![Op::Write, Op::Read],
                iterations: Some(iterations),
                volume: None,
                tx_depth,
                cq_mod,
                post_list,
                idle,
                warmup: 2,
                common: Common {
                    device: None,
                    port: 1,
                    json: true,
                },
            };
            rdma::<SimVerbsApi>(&node, &args).unwrap();
        }
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let sorted: Vec<u64> = (1..=1000).collect();
        assert_eq!(percentile(&sorted, 0.5), 500);
        assert_eq!(percentile(&sorted, 0.99), 990);
        assert_eq!(percentile(&sorted, 0.999), 999);
        assert_eq!(percentile(&[7], 0.999), 7);
        assert_eq!(percentile(&[], 0.5), 0);
        assert_eq!(default_batch(4096), 64);
        assert_eq!(default_batch(64 << 10), 4);
        assert_eq!(default_batch(4 << 20), 1);
    }

    /// Two engines on the simulated fabric: every budget, progress mode and
    /// batch shape finishes, a partial last batch included.
    #[test]
    fn engine_bench_completes_on_the_sim() {
        let backends = Backends::sim_default();
        for (batch, depth, progress, iterations, duration, qps, slice) in [
            (
                Some(3),
                2,
                Progress::Inline,
                Some(10),
                None,
                Some(3),
                Some(16 << 10),
            ),
            (None, 4, Progress::Driver, Some(7), None, None, None),
            (
                Some(1),
                1,
                Progress::Inline,
                None,
                Some(0.05),
                Some(1),
                None,
            ),
        ] {
            let args = EngineArgs {
                sizes: vec![4096, 65536],
                ops: vec![Op::Write, Op::Read],
                batch,
                depth,
                qps,
                slice,
                qp_depth: Some(16),
                signal_every: Some(4),
                duration,
                iterations,
                volume: None,
                warmup: 1,
                progress,
                idle: Idle::Park,
                listen: None,
                connect: None,
                common: Common {
                    device: None,
                    port: 1,
                    json: true,
                },
            };
            engine_bench(&backends, &args).unwrap();
        }
    }

    /// `--listen` on one node of the simulated fabric, `--connect` on
    /// another: the client measures every (op, size) against the server's
    /// grant, all requests of its budget, and the server exits once told
    /// the client is done.
    #[test]
    fn engine_bench_across_two_nodes_on_the_sim() {
        use gdr_sim::nic::{NodeConfig, SimFabric};
        let fabric = SimFabric::new();
        let node = |name: &str| {
            let other = fabric.clone();
            let verbs = fabric.add_node(name, NodeConfig::default());
            let ip = verbs.device_ipv4("sim0").expect("sim0's address");
            let backends = Backends::new::<gdr_sim::nic::SimVerbsApi, gdr_sim::SimCudaApi>(
                verbs,
                None,
                move || other.add_node("unused", NodeConfig::default()),
            );
            (backends, ip)
        };
        let ((server, ip), (client, _)) = (node("server"), node("client"));
        let args = |listen, connect| EngineArgs {
            sizes: vec![4096, 1 << 20],
            ops: vec![Op::Write, Op::Read],
            batch: Some(3),
            depth: 2,
            qps: Some(3),
            slice: Some(256 << 10),
            qp_depth: None,
            signal_every: None,
            duration: None,
            iterations: Some(7),
            volume: None,
            warmup: 1,
            progress: Progress::Inline,
            idle: Idle::Park,
            listen,
            connect,
            common: Common {
                device: None,
                port: 1,
                json: true,
            },
        };
        let serving = std::thread::spawn(move || {
            engine_bench(
                &server,
                &args(Some(SocketAddr::from(([0; 4], 18515))), None),
            )
            .map_err(|e| e.to_string())
        });
        let measured = engine_bench(
            &client,
            &args(None, Some(SocketAddr::new(ip.into(), 18515))),
        )
        .unwrap();
        assert!(
            serving.join().unwrap().unwrap().is_empty(),
            "a server measures nothing"
        );
        let shapes: Vec<_> = measured
            .iter()
            .map(|m| (m.plan.op, m.plan.size, m.requests, m.bytes()))
            .collect();
        assert_eq!(
            shapes,
            [
                (Op::Write, 4096, 7, 7 * 4096),
                (Op::Write, 1 << 20, 7, 7 << 20),
                (Op::Read, 4096, 7, 7 * 4096),
                (Op::Read, 1 << 20, 7, 7 << 20),
            ]
        );
    }

    #[test]
    fn exchange_messages_are_checked() {
        assert_eq!(
            parse_message(SPAN, &message(SPAN, 1 << 40)).unwrap(),
            1 << 40
        );
        let wrong_tag = parse_message(GRANT, &message(SPAN, 7)).unwrap_err();
        assert!(
            wrong_tag.to_string().contains("expected a \"grnt\""),
            "{wrong_tag}"
        );
        assert!(
            parse_message(DONE, &message(DONE, 0)[..11]).is_err(),
            "short"
        );
        assert!(parse_message(DONE, b"done").is_err(), "no value");
    }

    /// A request failing mid-measurement with more outstanding: the error
    /// is reported and the requester drained (on a device that purges a
    /// destroyed QP's completions, as ConnectX does) before teardown.
    #[test]
    fn a_failed_measurement_drains_and_reports() {
        use gdr_sim::{DeviceConfig, Fault, FaultPlan, FaultSite};
        use hal_verbs::WcStatus;
        let plan = FaultPlan::new();
        let config = NodeConfig {
            ipv4: None,
            devices: vec![DeviceConfig {
                destroy_qp_purges_cq: true,
                ..DeviceConfig::default()
            }],
        };
        let node = SimFabric::with_faults(plan.clone()).add_node("a", config);
        plan.fail_nth(
            FaultSite::VerbsCompletion,
            plan.calls(FaultSite::VerbsCompletion) + 5,
            Fault::CompletionStatus(WcStatus::REM_ACCESS_ERR),
        );
        let args = RdmaArgs {
            sizes: vec![4096],
            ops: vec![Op::Write],
            iterations: Some(64),
            volume: None,
            tx_depth: 32,
            cq_mod: 4,
            post_list: Some(8),
            idle: Idle::Spin,
            warmup: 0,
            common: Common {
                device: None,
                port: 1,
                json: true,
            },
        };
        let err = rdma::<SimVerbsApi>(&node, &args).unwrap_err().to_string();
        assert!(err.contains("remote access error"), "{err}");
        assert!(!err.contains("drain"), "the drain succeeded: {err}");
    }
}
