//! `gdr bench isolation`: whether one peer's slow peer-copy set-up holds
//! up another peer of the same engine. The row: a peer-copy
//! submit (its IPC open) while another peer's batches run leaves the
//! other's latency unchanged (p99 within 10 %). On the simulation only
//! (`--backend sim`): the slow driver call is the simulator's scripted
//! `Fault::Slow`, and peer B needs two GPUs of one host; the bench makes a
//! simulated fabric and node of its own for it (three NIC nodes, one
//! `SimCuda` with two GPUs, its fault plan the fabric's), so the engines
//! the CLI's backends would open are not used. Elsewhere it fails with
//! what it needs (GPUs; the simulation).
//!
//! One client engine with two peers, in this process, peer copy on
//! (`EngineConfig::peer_copy`), a driver thread (`Engine::spawn_driver`)
//! on every engine:
//!
//! - peer A: to a server engine without a GPU, which grants 4 KiB of host
//!   memory; one 4 KiB WRITE of host memory at a time (the NIC path),
//!   back to back, its latency submit to completion seen.
//! - peer B: to a server engine of another simulated process of the same
//!   host, on its second GPU (the client's memory is on the first): each
//!   round the server grants its `--copy-size` bytes of GPU memory anew,
//!   the client WRITEs its own GPU memory into it (a GPU-to-GPU peer copy,
//!   the CUDA IPC route), waits, and the grant is revoked (the importer
//!   releases its mapping). A fresh grant's IPC handle is opened by the
//!   submit before its copies (`cuIpcOpenMemHandle`, made outside the
//!   engine's lock), and that call is scripted to take `--slow-us` (the
//!   fabric's fault plan, `FaultSite::CudaIpcOpen`, the next call each
//!   round, as the peer-copy tests do): what is slowed is B's driver call,
//!   nothing else.
//!
//! Two phases on the same engines, after 1000 untimed WRITEs of A:
//! `alone`, A's WRITEs back to back for `--seconds` with nothing else
//! running; then `beside-peer-copy`, the same while a second thread runs
//! B's rounds one after another (from its first round done until A's last
//! WRITE): with the defaults, hundreds of B's slow calls fall within A's
//! WRITEs. Per
//! phase: p50, p90, p99, p99.9 (nearest rank) and the largest latency in
//! µs; for the second, B's rounds done, those by peer copy, and the
//! (slowed) IPC opens made while A's WRITEs ran; then the ratio of p50 and p99 (beside / alone). A
//! measurement: it judges nothing.
//!
//! With `--rounds N` (N > 1), the two phases alternate N times on the same
//! engines (alone, beside-peer-copy, alone, ...; the warm-up once), a row
//! printed as each ends; then per phase over the rounds each percentile is
//! the median of the rounds' own, the largest latency the largest of
//! theirs, the samples and B's counts their sums; and the ratio is the
//! median of each round's own (its beside-peer-copy against its alone),
//! with the lowest and highest ([`OverRounds`]): one pair of phases is
//! too noisy a sample of A's tail on a busy machine.

use std::error::Error;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use gdr_core::backend::Backends;
use gdr_core::buffer::Buffer;
use gdr_core::descriptor::{GrantRights, MemoryDescriptor};
use gdr_core::engine::{Driver, Engine, EngineConfig, Peer, PeerCopyRoute, Region, Transfer};
use gdr_core::sim::{
    Fault, FaultPlan, FaultSite, GpuConfig, NodeConfig, SimCuda, SimFabric, SimVerbsApi,
};
use hal_cuda::Driver as _;

use crate::rounds::{Spread, json_array, spread, spread_or};

use super::{
    ENGINE_TIMEOUT, connect_to, device_address, grant_host, host_buffer, host_memory_config,
    parse_size, percentile, pick_device,
};

/// Bytes of each of A's WRITEs.
const REQ: usize = 4096;

/// Untimed WRITEs of A before the phases.
const WARMUP: u64 = 1000;

/// The driver call each of B's rounds makes first.
const SITE: FaultSite = FaultSite::CudaIpcOpen;

/// A phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// A's WRITEs, nothing else running.
    Alone,
    /// A's WRITEs while B's peer-copy rounds run in another thread.
    BesidePeerCopy,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Self::Alone => "alone",
            Self::BesidePeerCopy => "beside-peer-copy",
        }
    }
}

/// Options of `gdr bench isolation`.
#[derive(Debug, Args)]
pub struct IsolationArgs {
    /// Seconds of peer A's WRITEs timed in each phase.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// How long each driver call of peer B's rounds (its IPC open) is
    /// made to take, in µs.
    #[arg(long, default_value_t = 2000)]
    slow_us: u64,
    /// Bytes of each of peer B's GPU-to-GPU copies (suffixes K, M, G).
    #[arg(long, default_value = "64K", value_parser = parse_size)]
    copy_size: usize,
    /// Rounds of the two phases, alternating on the same engines (alone,
    /// beside-peer-copy, alone, ...). Above 1, each phase's row over the
    /// rounds is the median of each percentile of its rounds (max: the
    /// largest; samples and B's counts: their sums), and the ratio the
    /// median of each round's own, with their lowest and highest.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// One JSON object per phase on stdout instead of the table (with
    /// `--rounds` above 1: one per phase over the rounds, with each
    /// round's figures, then one of the ratios).
    #[arg(long)]
    pub(super) json: bool,
}

/// One phase's figures.
#[derive(Debug, Clone)]
pub(crate) struct PhaseFigures {
    phase: Phase,
    /// A's latencies, sorted, in ns.
    latencies: Vec<u64>,
    /// B's rounds done while A's WRITEs ran.
    b_batches: u64,
    /// B's batches that ended by peer copy while A's WRITEs ran (the rest
    /// went by the NIC: their grant's IPC handle had not come yet).
    b_copies: u64,
    /// Calls at [`SITE`] (each slowed) made while A's WRITEs ran.
    slow_calls: u64,
}

impl PhaseFigures {
    fn us(&self, p: f64) -> f64 {
        percentile(&self.latencies, p) as f64 / 1e3
    }
    fn max_us(&self) -> f64 {
        self.latencies.last().copied().unwrap_or(0) as f64 / 1e3
    }
    /// Its row of the table.
    fn row(&self) -> String {
        let [p50, p90, p99, p999] = PERCENTILES.map(|p| self.us(p));
        table_row(
            self.phase,
            self.latencies.len() as u64,
            [p50, p90, p99, p999, self.max_us()],
            [self.b_batches, self.b_copies, self.slow_calls],
        )
    }
}

/// `gdr bench isolation`: both phases, their figures printed as each ends.
pub(crate) fn isolation_bench(
    backends: &Backends,
    args: &IsolationArgs,
) -> Result<Vec<PhaseFigures>, Box<dyn Error>> {
    match (backends.verbs_name(), backends.cuda_name()) {
        ("sim", Some("sim")) => {}
        (verbs, None) => {
            return Err(format!(
                "gdr bench isolation needs GPUs: peer B's batches are GPU-to-GPU peer copies \
                 between two GPUs of one host, and these backends ({verbs}) have no CUDA \
                 driver; `--backend sim` runs it on two simulated GPUs"
            )
            .into());
        }
        (verbs, Some(cuda)) => {
            return Err(format!(
                "gdr bench isolation runs on the simulation only (`--backend sim`): it slows \
                 peer B's driver calls by the simulator's scripted faults, which {verbs} with \
                 {cuda} GPUs cannot do"
            )
            .into());
        }
    }
    let seconds = Duration::try_from_secs_f64(args.seconds.max(0.001))
        .map_err(|e| format!("--seconds {}: {e}", args.seconds))?;
    let slow = Duration::from_micros(args.slow_us);
    let copy = u64::try_from(args.copy_size)?;
    let world = SimWorld::new(copy)?;
    let rounds = args.rounds.max(1) as usize;
    if !args.json {
        println!(
            "gdr bench isolation on the simulation (a fabric of its own: 3 NIC nodes, 2 GPUs): \
             one client engine, a driver thread on each engine, peer copy on"
        );
        println!(
            "peer A: one {REQ}-byte WRITE of host memory at a time into a host-memory grant \
             (NIC path); peer B: {copy}-byte GPU-to-GPU peer copies (GPU 0 -> GPU 1 of another \
             process, CUDA IPC), a fresh grant each, so each first opens an IPC handle \
             (cuIpcOpenMemHandle) made to take {} µs",
            args.slow_us
        );
        println!(
            "latency of A's WRITEs: submit to completion seen, in µs, {:.1} s per phase, \
             nearest rank; B's batches, those of them by peer copy (a batch whose grant's IPC \
             handle had not come yet goes by the NIC) and slow calls (IPC opens): while A's \
             WRITEs ran",
            seconds.as_secs_f64()
        );
        if rounds > 1 {
            println!(
                "{rounds} rounds on the same engines, the phases alternating (alone, \
                 beside-peer-copy, alone, ...): a row per round and phase as it ends, then per \
                 phase over the rounds: p50 to p99.9 each the median of the rounds' own, max the \
                 largest of the rounds', samples, B batches, B copies and slow calls the sums of \
                 the rounds'; the ratio the median of the rounds' own (each round's \
                 beside-peer-copy against that round's alone), with their lowest and highest"
            );
            print!("{:>5} ", "round");
        }
        println!("{}", table_header());
    }
    for _ in 0..WARMUP {
        world.write_a()?;
    }
    let mut measured = Vec::new();
    for round in 1..=rounds {
        for phase in [Phase::Alone, Phase::BesidePeerCopy] {
            let figures = match phase {
                Phase::Alone => PhaseFigures {
                    phase,
                    latencies: world.a_loop(seconds)?,
                    b_batches: 0,
                    b_copies: 0,
                    slow_calls: 0,
                },
                Phase::BesidePeerCopy => world.beside_peer_copy(seconds, slow)?,
            };
            if args.json {
                if rounds == 1 {
                    println!("{}", json_line(&figures, copy, args.slow_us));
                }
            } else {
                if rounds > 1 {
                    print!("{round:>5} ");
                }
                println!("{}", figures.row());
            }
            measured.push(figures);
        }
    }
    let over = OverRounds::new(&measured);
    if rounds == 1 {
        if !args.json {
            println!(
                "beside-peer-copy / alone: p50 x{:.3}, p99 x{:.3}",
                over.ratio(0.5).median,
                over.ratio(0.99).median
            );
        }
    } else if args.json {
        for phase in [Phase::Alone, Phase::BesidePeerCopy] {
            println!("{}", over.json_line(phase, copy, args.slow_us));
        }
        println!("{}", over.ratio_json_line());
    } else {
        println!();
        println!("over the {rounds} rounds:");
        println!("{}", table_header());
        for phase in [Phase::Alone, Phase::BesidePeerCopy] {
            println!("{}", over.row(phase));
        }
        let (p50, p99) = (over.ratio(0.5), over.ratio(0.99));
        println!(
            "beside-peer-copy / alone, the median of the rounds' own [lowest, highest]: \
             p50 x{:.3} [x{:.3}, x{:.3}], p99 x{:.3} [x{:.3}, x{:.3}]",
            p50.median, p50.min, p50.max, p99.median, p99.min, p99.max
        );
    }
    Ok(measured)
}

/// The table's header row (after the round's column, with `--rounds`).
fn table_header() -> String {
    format!(
        "{:<17} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>10}",
        "phase",
        "samples",
        "p50",
        "p90",
        "p99",
        "p99.9",
        "max",
        "B batches",
        "B copies",
        "slow calls"
    )
}

/// A row of the table: a phase's samples, percentiles (p50, p90, p99,
/// p99.9) and largest latency in µs, and B's counts (`-` alone).
fn table_row(phase: Phase, samples: u64, us: [f64; 5], counts: [u64; 3]) -> String {
    let beside = phase == Phase::BesidePeerCopy;
    let count = |n: u64| if beside { n.to_string() } else { "-".into() };
    format!(
        "{:<17} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>10} {:>9} {:>10}",
        phase.name(),
        samples,
        us[0],
        us[1],
        us[2],
        us[3],
        us[4],
        count(counts[0]),
        count(counts[1]),
        count(counts[2]),
    )
}

/// The percentiles of each row, and of JSON: p50, p90, p99, p99.9.
const PERCENTILES: [f64; 4] = [0.5, 0.9, 0.99, 0.999];

/// Each phase over the rounds, and each round's ratio of its phases.
#[derive(Debug)]
pub(crate) struct OverRounds<'a> {
    /// Each round's phases: alone, beside-peer-copy.
    rounds: Vec<(&'a PhaseFigures, &'a PhaseFigures)>,
}

impl<'a> OverRounds<'a> {
    /// The rounds of `measured`: its n-th alone phase with its n-th
    /// beside-peer-copy.
    pub(crate) fn new(measured: &'a [PhaseFigures]) -> Self {
        let of = |phase| {
            measured
                .iter()
                .filter(move |f: &&PhaseFigures| f.phase == phase)
        };
        Self {
            rounds: of(Phase::Alone).zip(of(Phase::BesidePeerCopy)).collect(),
        }
    }

    /// Each round's `phase`.
    fn of(&self, phase: Phase) -> impl Iterator<Item = &'a PhaseFigures> + '_ {
        self.rounds.iter().map(move |&(alone, beside)| match phase {
            Phase::Alone => alone,
            Phase::BesidePeerCopy => beside,
        })
    }

    /// The median, lowest and highest of the rounds' `figure` of `phase`
    /// (zeros of no round).
    fn over(&self, phase: Phase, figure: impl Fn(&PhaseFigures) -> f64) -> Spread {
        spread_or(self.of(phase).map(figure), 0.0)
    }

    /// The rounds' `p` of `phase`, in µs: its median is the row's.
    pub(crate) fn percentile(&self, phase: Phase, p: f64) -> Spread {
        self.over(phase, |f| f.us(p))
    }

    /// The largest latency of `phase` in any round, in µs.
    pub(crate) fn max_us(&self, phase: Phase) -> f64 {
        self.over(phase, PhaseFigures::max_us).max
    }

    /// The sum of the rounds' `count` of `phase`.
    pub(crate) fn sum(&self, phase: Phase, count: impl Fn(&PhaseFigures) -> u64) -> u64 {
        self.of(phase).map(count).sum()
    }

    /// Each round's ratio of `p`: its beside-peer-copy's against its own
    /// alone's.
    pub(crate) fn ratios(&self, p: f64) -> Vec<f64> {
        self.rounds
            .iter()
            .map(|&(alone, beside)| beside.us(p) / alone.us(p).max(1e-9))
            .collect()
    }

    /// The median, lowest and highest of the rounds' ratios of `p` (zeros
    /// of no round).
    pub(crate) fn ratio(&self, p: f64) -> Spread {
        spread(&self.ratios(p)).unwrap_or(Spread {
            median: 0.0,
            min: 0.0,
            max: 0.0,
        })
    }

    /// `phase`'s row over the rounds.
    fn row(&self, phase: Phase) -> String {
        let [p50, p90, p99, p999] = PERCENTILES.map(|p| self.percentile(phase, p).median);
        table_row(
            phase,
            self.sum(phase, |f| f.latencies.len() as u64),
            [p50, p90, p99, p999, self.max_us(phase)],
            [
                self.sum(phase, |f| f.b_batches),
                self.sum(phase, |f| f.b_copies),
                self.sum(phase, |f| f.slow_calls),
            ],
        )
    }

    /// `phase` over the rounds as JSON: the fields of one phase's object
    /// (percentiles the medians, max the largest, counts the sums), then
    /// the rounds and each round's figures (`_rounds`, in round order).
    fn json_line(&self, phase: Phase, copy: u64, slow_us: u64) -> String {
        let [p50, p90, p99, p999] = PERCENTILES.map(|p| self.percentile(phase, p).median);
        let mut s = String::new();
        // Writing to a String cannot fail.
        let _ = write!(
            s,
            "{{\"bench\":\"isolation\",\"backend\":\"sim\",\"phase\":\"{}\",\"size\":{REQ},\
             \"copy_size\":{copy},\"slow_us\":{slow_us},\"samples\":{},\"p50_us\":{p50:.2},\
             \"p90_us\":{p90:.2},\"p99_us\":{p99:.2},\"p999_us\":{p999:.2},\"max_us\":{:.2},\
             \"b_batches\":{},\"b_copies\":{},\"slow_calls\":{},\"rounds\":{},\
             \"counts_over_rounds\":\"sum\"",
            phase.name(),
            self.sum(phase, |f| f.latencies.len() as u64),
            self.max_us(phase),
            self.sum(phase, |f| f.b_batches),
            self.sum(phase, |f| f.b_copies),
            self.sum(phase, |f| f.slow_calls),
            self.rounds.len(),
        );
        let us = |p: f64| json_array(self.of(phase), |f| format!("{:.2}", f.us(p)));
        let count = |n: fn(&PhaseFigures) -> u64| json_array(self.of(phase), |f| n(f).to_string());
        let _ = write!(
            s,
            ",\"samples_rounds\":{},\"p50_us_rounds\":{},\"p90_us_rounds\":{},\
             \"p99_us_rounds\":{},\"p999_us_rounds\":{},\"max_us_rounds\":{},\
             \"b_batches_rounds\":{},\"b_copies_rounds\":{},\"slow_calls_rounds\":{}}}",
            count(|f| f.latencies.len() as u64),
            us(0.5),
            us(0.9),
            us(0.99),
            us(0.999),
            json_array(self.of(phase), |f| format!("{:.2}", f.max_us())),
            count(|f| f.b_batches),
            count(|f| f.b_copies),
            count(|f| f.slow_calls),
        );
        s
    }

    /// The ratios as JSON: of p50 and p99, the median of the rounds' own,
    /// their lowest, highest, and each round's.
    fn ratio_json_line(&self) -> String {
        let mut s = format!(
            "{{\"bench\":\"isolation\",\"backend\":\"sim\",\"phase\":\"ratio\",\
             \"of\":\"beside-peer-copy/alone\",\"rounds\":{}",
            self.rounds.len()
        );
        for (name, p) in [("p50", 0.5), ("p99", 0.99)] {
            let r = self.ratio(p);
            let _ = write!(
                s,
                ",\"{name}_ratio\":{:.4},\"{name}_ratio_min\":{:.4},\"{name}_ratio_max\":{:.4},\
                 \"{name}_ratio_rounds\":{}",
                r.median,
                r.min,
                r.max,
                json_array(self.ratios(p), |v| format!("{v:.4}")),
            );
        }
        s.push('}');
        s
    }
}

/// The simulated world of the bench: the client engine and its two peers,
/// the two servers, what they registered and granted. Field order is drop
/// order: the driver threads, then A's grant and regions, the peers, the
/// engines, the providers and drivers they were opened on.
struct SimWorld {
    _drivers: Vec<Driver>,
    /// A's source: host memory of the client, registered.
    a_local: Region,
    /// The host-memory server's grant to A, as A received it.
    a_remote: MemoryDescriptor,
    _a_served: super::Served,
    /// B's source: GPU 0 memory of the client, registered.
    b_local: Region,
    /// B's target: GPU 1 memory of the GPU server, registered, granted
    /// anew each round.
    b_region: Region,
    to_a: Peer,
    _a_at_server: Peer,
    to_b: Peer,
    /// The GPU server's peer: the client.
    b_at_server: Peer,
    client: Engine,
    _host_server: Engine,
    _gpu_server: Engine,
    _b_buffers: (Buffer, Buffer),
    _a_buffer: Buffer,
    faults: FaultPlan,
    _providers: Vec<hal_verbs::dynamic::DynProvider>,
    _cuda: (hal_cuda::dynamic::DynDriver, hal_cuda::dynamic::DynDriver),
    copy: u64,
}

/// One more peer of `client`, to `server` listening on `ip`: the client's
/// end and the server's.
fn connect(client: &Engine, server: &Engine, ip: IpAddr) -> Result<(Peer, Peer), Box<dyn Error>> {
    let listener = server.listen(SocketAddr::new(ip, 0))?;
    Ok(connect_to(client, &listener)?)
}

impl SimWorld {
    fn new(copy: u64) -> Result<Self, Box<dyn Error>> {
        let fabric = SimFabric::new();
        let faults = fabric.faults();
        let second = GpuConfig {
            pci_bus_id: "0000:2a:00.0".into(),
            ..GpuConfig::default()
        };
        let cuda = SimCuda::new(vec![GpuConfig::default(), second], faults.clone());
        let here = cuda.erased();
        let there = cuda.other_process().erased();
        let node = |name: &str| {
            hal_verbs::dynamic::DynProvider::new::<SimVerbsApi>(
                fabric.add_node(name, NodeConfig::default()),
            )
        };
        let (client_nic, host_nic, gpu_nic) = (node("client"), node("host"), node("gpu"));
        let address = |provider: &hal_verbs::dynamic::DynProvider| {
            let device = pick_device::<hal_verbs::dynamic::DynApi>(provider, None)?;
            device_address(provider, &device, 1)
        };
        let (host_ip, gpu_ip) = (address(&host_nic)?, address(&gpu_nic)?);
        let config = EngineConfig::default()
            .with_default_timeout(ENGINE_TIMEOUT)
            .with_peer_copy(true);
        let client = Engine::new(&client_nic, Some(&here), config.clone())?;
        let host_server = Engine::new(&host_nic, None, host_memory_config())?;
        let gpu_server = Engine::new(&gpu_nic, Some(&there), config)?;
        let (to_a, a_at_server) = connect(&client, &host_server, host_ip)?;
        let (to_b, b_at_server) = connect(&client, &gpu_server, gpu_ip)?;
        let route = to_b.route();
        if route != PeerCopyRoute::Ipc {
            return Err(format!("peer B's route is {route:?}, not the CUDA IPC peer copy").into());
        }
        let (a_served, a_remote) = grant_host(&host_server, &a_at_server, &to_a, REQ as u64)?;
        let a_buffer = host_buffer(REQ as u64, 0x5a)?;
        let a_local = client.register_buffer(&a_buffer)?;
        let b_src = Buffer::alloc_device(&here.context(0)?, copy)?;
        let b_dst = Buffer::alloc_device(&there.context(1)?, copy)?;
        let b_local = client.register_buffer(&b_src)?;
        let b_region = gpu_server.register_buffer(&b_dst)?;
        let drivers = vec![
            client.spawn_driver()?,
            host_server.spawn_driver()?,
            gpu_server.spawn_driver()?,
        ];
        Ok(Self {
            _drivers: drivers,
            a_local,
            a_remote,
            _a_served: a_served,
            b_local,
            b_region,
            to_a,
            _a_at_server: a_at_server,
            to_b,
            b_at_server,
            client,
            _host_server: host_server,
            _gpu_server: gpu_server,
            _b_buffers: (b_src, b_dst),
            _a_buffer: a_buffer,
            faults,
            _providers: vec![client_nic, host_nic, gpu_nic],
            _cuda: (here, there),
            copy,
        })
    }

    /// One WRITE of A, timed.
    fn write_a(&self) -> Result<u64, Box<dyn Error>> {
        let transfer = Transfer::write(&self.a_local, 0, &self.a_remote, 0, REQ as u64);
        let started = Instant::now();
        self.to_a
            .submit(&[transfer])?
            .wait(ENGINE_TIMEOUT)
            .map_err(|e| format!("a {REQ}-byte WRITE of peer A: {e}"))?;
        Ok(u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// WRITEs of A back to back for `seconds`: their latencies, sorted.
    fn a_loop(&self, seconds: Duration) -> Result<Vec<u64>, Box<dyn Error>> {
        let start = Instant::now();
        let mut latencies = Vec::with_capacity(1 << 20);
        while start.elapsed() < seconds {
            latencies.push(self.write_a()?);
        }
        latencies.sort_unstable();
        Ok(latencies)
    }

    /// One round of B: a fresh grant of the server's GPU memory, its IPC
    /// open scripted to take `slow`, one peer copy into it, the grant
    /// revoked.
    fn b_round(&self, slow: Duration) -> Result<(), Box<dyn Error>> {
        let grant = self
            .b_at_server
            .grant(&self.b_region, 0, self.copy, GrantRights::ReadWrite)?;
        let remote = self
            .to_b
            .wait_grant(grant.descriptor().grant, ENGINE_TIMEOUT)?;
        // The next call at the site is slow, unless one scripted before is
        // still to come (a round whose submit found the handle open).
        if !self.faults.unfired().iter().any(|f| f.site == SITE) {
            self.faults
                .fail_nth(SITE, self.faults.calls(SITE) + 1, Fault::Slow(slow));
        }
        let batch =
            self.to_b
                .submit(&[Transfer::write(&self.b_local, 0, &remote, 0, self.copy)])?;
        batch
            .wait(ENGINE_TIMEOUT)
            .map_err(|e| format!("a peer copy of peer B: {e}"))?;
        grant.revoke(ENGINE_TIMEOUT)?;
        Ok(())
    }

    /// A's WRITEs while another thread runs B's rounds.
    fn beside_peer_copy(
        &self,
        seconds: Duration,
        slow: Duration,
    ) -> Result<PhaseFigures, Box<dyn Error>> {
        let stop = AtomicBool::new(false);
        let rounds = AtomicU64::new(0);
        let copies_before = self.client.peer_copy_stats().batches;
        let (latencies, (b_batches, b_copies, slow_calls), b_result) = std::thread::scope(|s| {
            let b = s.spawn(|| -> Result<(), String> {
                while !stop.load(Ordering::Relaxed) {
                    self.b_round(slow).map_err(|e| e.to_string())?;
                    rounds.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            });
            // B's first round done (its path set up) before A starts.
            while rounds.load(Ordering::Relaxed) == 0 && !b.is_finished() {
                std::thread::sleep(Duration::from_millis(1));
            }
            let copies = || self.client.peer_copy_stats().batches;
            let (rounds0, copies0, calls0) = (
                rounds.load(Ordering::Relaxed),
                copies(),
                self.faults.calls(SITE),
            );
            let latencies = self.a_loop(seconds);
            let (rounds1, copies1, calls1) = (
                rounds.load(Ordering::Relaxed),
                copies(),
                self.faults.calls(SITE),
            );
            stop.store(true, Ordering::Relaxed);
            let b_result = b
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            let counts = (rounds1 - rounds0, copies1 - copies0, calls1 - calls0);
            (latencies, counts, b_result)
        });
        b_result.map_err(|e| format!("peer B: {e}"))?;
        let latencies = latencies?;
        let copied = self.client.peer_copy_stats().batches - copies_before;
        let done = rounds.load(Ordering::Relaxed);
        // A round whose submit came before the grant's IPC handle (its own
        // control message, after the announcement) goes by the NIC, and
        // opens nothing: the slow calls count what was slowed. None by
        // peer copy: nothing was measured.
        if done > 0 && copied == 0 {
            return Err(format!(
                "peer B finished {done} rounds, none by peer copy: nothing slowed was measured"
            )
            .into());
        }
        Ok(PhaseFigures {
            phase: Phase::BesidePeerCopy,
            latencies,
            b_batches,
            b_copies,
            slow_calls,
        })
    }
}

fn json_line(f: &PhaseFigures, copy: u64, slow_us: u64) -> String {
    let mut s = String::new();
    // Writing to a String cannot fail.
    let _ = write!(
        s,
        "{{\"bench\":\"isolation\",\"backend\":\"sim\",\"phase\":\"{}\",\"size\":{REQ},\
         \"copy_size\":{copy},\"slow_us\":{slow_us},\"samples\":{},\"p50_us\":{:.2},\
         \"p90_us\":{:.2},\"p99_us\":{:.2},\"p999_us\":{:.2},\"max_us\":{:.2},\
         \"b_batches\":{},\"b_copies\":{},\"slow_calls\":{}}}",
        f.phase.name(),
        f.latencies.len(),
        f.us(0.5),
        f.us(0.9),
        f.us(0.99),
        f.us(0.999),
        f.max_us(),
        f.b_batches,
        f.b_copies,
        f.slow_calls,
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(seconds: f64) -> IsolationArgs {
        IsolationArgs {
            seconds,
            slow_us: 200,
            copy_size: 8192,
            rounds: 1,
            json: true,
        }
    }

    /// Backends without a GPU: the error says GPUs are needed.
    #[test]
    fn without_gpus_it_says_it_needs_them() {
        let backends = Backends::sim(&SimFabric::new(), NodeConfig::default(), Vec::new());
        let err = isolation_bench(&backends, &args(0.01)).unwrap_err();
        assert!(err.to_string().contains("needs GPUs"), "{err}");
    }

    /// Both phases run on the simulation; every round of B that went by
    /// peer copy made its (slow) IPC open (one at each end of A's WRITEs
    /// may fall outside them). Nothing timed is asserted.
    #[test]
    fn both_phases_run_on_the_simulation() {
        let figures = isolation_bench(&Backends::sim_default(), &args(0.05)).unwrap();
        let phases: Vec<Phase> = figures.iter().map(|f| f.phase).collect();
        assert_eq!(phases, [Phase::Alone, Phase::BesidePeerCopy]);
        assert!(figures.iter().all(|f| !f.latencies.is_empty()));
        let beside = &figures[1];
        assert!(
            beside.slow_calls.abs_diff(beside.b_copies) <= 2,
            "one IPC open a round: {beside:?}"
        );
    }

    /// With `--rounds 2` the phases alternate on the same engines: alone,
    /// beside-peer-copy, alone, beside-peer-copy.
    #[test]
    fn rounds_alternate_the_phases() {
        let mut two = args(0.02);
        two.rounds = 2;
        let figures = isolation_bench(&Backends::sim_default(), &two).unwrap();
        let phases: Vec<Phase> = figures.iter().map(|f| f.phase).collect();
        use Phase::{Alone, BesidePeerCopy as Beside};
        assert_eq!(phases, [Alone, Beside, Alone, Beside]);
        assert_eq!(OverRounds::new(&figures).ratios(0.99).len(), 2);
    }

    /// A phase of 100 latencies: 90 of `p50` µs, 10 of `p99` µs (so its
    /// p50 and p90 are `p50`, its p99 and p99.9 `p99`), and B's counts.
    fn phase(phase: Phase, p50: u64, p99: u64, counts: u64) -> PhaseFigures {
        let mut latencies = vec![p50 * 1000; 90];
        latencies.extend([p99 * 1000; 10]);
        PhaseFigures {
            phase,
            latencies,
            b_batches: counts,
            b_copies: counts,
            slow_calls: counts,
        }
    }

    /// Over three rounds: each percentile the median of the rounds' (not
    /// their mean, nor the first round's), max the largest, B's counts
    /// summed; the ratio the median of each round's own beside / alone
    /// (2, 0.2, 3: 2), not the ratio of the medians (2 / 10 = 0.2), with
    /// their lowest and highest.
    #[test]
    fn the_ratio_is_the_median_of_each_rounds_own() {
        use Phase::{Alone, BesidePeerCopy as Beside};
        let measured = [
            phase(Alone, 1, 10, 0),
            phase(Beside, 2, 5, 7),
            phase(Alone, 10, 20, 0),
            phase(Beside, 2, 100, 8),
            phase(Alone, 10, 40, 0),
            phase(Beside, 30, 40, 9),
        ];
        let over = OverRounds::new(&measured);
        let p50 = over.ratio(0.5);
        assert_eq!(over.ratios(0.5), [2.0, 0.2, 3.0]);
        assert_eq!((p50.median, p50.min, p50.max), (2.0, 0.2, 3.0));
        // p99: 5 / 10, 100 / 20, 40 / 40.
        let p99 = over.ratio(0.99);
        assert_eq!((p99.median, p99.min, p99.max), (1.0, 0.5, 5.0));
        assert_eq!(over.percentile(Alone, 0.5).median, 10.0);
        assert_eq!(over.percentile(Beside, 0.5).median, 2.0);
        assert_eq!(over.percentile(Alone, 0.99).median, 20.0);
        assert_eq!(over.percentile(Beside, 0.999).median, 40.0);
        assert_eq!((over.max_us(Alone), over.max_us(Beside)), (40.0, 100.0));
        assert_eq!(over.sum(Beside, |f| f.b_batches), 24);
        assert_eq!(over.sum(Alone, |f| f.latencies.len() as u64), 300);
        let row = over.row(Beside);
        let words: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            words,
            [
                "beside-peer-copy",
                "300",
                "2.0",
                "2.0",
                "40.0",
                "40.0",
                "100.0",
                "24",
                "24",
                "24"
            ]
        );
        let ratio = over.ratio_json_line();
        assert!(
            ratio.contains("\"p50_ratio\":2.0000,\"p50_ratio_min\":0.2000,")
                && ratio.contains("\"p50_ratio_rounds\":[2.0000,0.2000,3.0000]"),
            "{ratio}"
        );
        let alone = over.json_line(Alone, 1, 2);
        assert!(
            alone.contains("\"p50_us\":10.00,")
                && alone.contains("\"p50_us_rounds\":[1.00,10.00,10.00]"),
            "{alone}"
        );
        // Of two rounds, the mean of the middle two.
        let two = OverRounds::new(&measured[..4]);
        assert!((two.ratio(0.5).median - 1.1).abs() < 1e-9);
        assert_eq!(two.percentile(Alone, 0.5).median, 5.5);
    }
}
