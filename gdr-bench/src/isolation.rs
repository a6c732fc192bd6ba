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
    /// One JSON object per phase on stdout instead of the table.
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
        println!(
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
        );
    }
    for _ in 0..WARMUP {
        world.write_a()?;
    }
    let mut measured = Vec::new();
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
            println!("{}", json_line(&figures, copy, args.slow_us));
        } else {
            let beside = phase == Phase::BesidePeerCopy;
            let count = |n: u64| if beside { n.to_string() } else { "-".into() };
            println!(
                "{:<17} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>10} {:>9} {:>10}",
                phase.name(),
                figures.latencies.len(),
                figures.us(0.5),
                figures.us(0.9),
                figures.us(0.99),
                figures.us(0.999),
                figures.max_us(),
                count(figures.b_batches),
                count(figures.b_copies),
                count(figures.slow_calls),
            );
        }
        measured.push(figures);
    }
    if let [alone, beside] = measured.as_slice()
        && !args.json
    {
        let ratio = |p| beside.us(p) / alone.us(p).max(1e-9);
        println!(
            "beside-peer-copy / alone: p50 x{:.3}, p99 x{:.3}",
            ratio(0.5),
            ratio(0.99)
        );
    }
    Ok(measured)
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
}
