//! `gdr bench idle`: what waiting costs, on whatever backend the CLI
//! picked (the simulator without hardware, rxe in the SoftRoCE guest): the
//! figures of `tests/benches/idle.rs` (simulator only) on any device.
//!
//! For each mode, one 4 KiB RDMA WRITE at a time, host memory:
//!
//! - `verbs`, the floor: a bare [`QpPair`] on the device, its CQ on a
//!   completion channel, waited on with a [`CqWaiter`] (the library's one
//!   waiting policy, as `gdr bench rdma --idle park`): post one signaled
//!   WRITE, wait for its completion. Idle: this thread parked in the
//!   `CqWaiter` on the empty CQ for the whole window.
//! - `caller`: two engines connected over rdma_cm as in `gdr bench engine`
//!   (one listening on the device's own address), the listener's host
//!   buffer granted to the other; no driver thread: `Batch::wait` drives
//!   the engine's reactor. Idle: nobody waits (the engines' own threads
//!   only).
//! - `driver`: the same, with `Engine::spawn_driver` on both engines.
//!
//! In each mode, after 1000 untimed WRITEs and 200 ms of rest: the
//! process's CPU time (as % of one core) and voluntary context switches
//! per second (`getrusage`) over `--seconds` of idleness; then
//! `--samples` WRITEs back to back, then `--idle-samples` WRITEs each after
//! `--gap-ms` of idleness: p50 and p99 (nearest rank) of each, a WRITE's
//! latency being submit (post) to its completion seen. A measurement: it
//! judges nothing.

use std::error::Error;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use gdr_core::cq_wait::CqWaiter;
use gdr_core::engine::{Driver, Transfer};
use gdr_core::loopback::{PairConfig, QpPair};
use hal_verbs::{
    AccessFlags, Api, Completion, Context as _, MemoryRegion as _, Provider as _, QueuePair as _,
    SendFlags, SendOp, SendRequest, SgList, Sge,
};

use super::{
    Common, ENGINE_TIMEOUT, HostRegion, PARK_TIMEOUT, Target, channel_cq, drain_after_failure,
    host_buffer, host_memory_config, percentile, pick_device, send_caps,
};
use gdr_core::backend::Backends;

/// Bytes of each WRITE.
const REQ: usize = 4096;

/// Untimed WRITEs before a mode's measurements: the first requests set up
/// what the rest reuse.
const WARMUP: u64 = 1000;

/// Rest between the warm-up and the idle window.
const SETTLE: Duration = Duration::from_millis(200);

/// How a mode waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum WaitMode {
    /// The floor: a bare queue pair, its CQ waited on by a `CqWaiter`.
    Verbs,
    /// Two engines, no driver thread: `Batch::wait` drives.
    Caller,
    /// Two engines, `Engine::spawn_driver` on both.
    Driver,
}

impl WaitMode {
    fn name(self) -> &'static str {
        match self {
            Self::Verbs => "verbs",
            Self::Caller => "caller",
            Self::Driver => "driver",
        }
    }
}

/// Options of `gdr bench idle`.
#[derive(Debug, Args)]
pub struct IdleArgs {
    /// Seconds of idleness over which CPU time and voluntary context
    /// switches are counted.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// WRITEs timed back to back.
    #[arg(long, default_value_t = 10_000)]
    samples: u64,
    /// WRITEs timed each after `--gap-ms` of idleness.
    #[arg(long, default_value_t = 50)]
    idle_samples: u64,
    /// Idleness before each of the `--idle-samples` WRITEs, in ms.
    #[arg(long, default_value_t = 100)]
    gap_ms: u64,
    /// Modes, comma-separated, measured in this order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "verbs,caller,driver"
    )]
    mode: Vec<WaitMode>,
    #[command(flatten)]
    pub(super) common: Common,
}

/// The counts of one mode's run.
#[derive(Debug, Clone, Copy)]
struct IdlePlan {
    window: Duration,
    samples: u64,
    idle_samples: u64,
    gap: Duration,
}

/// One mode's figures.
#[derive(Debug, Clone)]
pub(crate) struct IdleFigures {
    mode: WaitMode,
    /// The idle window as it ran (wall clock).
    window: Duration,
    /// CPU time of the process (user + system) over the window.
    cpu: Duration,
    /// Voluntary context switches of the process over the window.
    switches: u64,
    /// Back-to-back latencies, sorted, in ns.
    back_to_back: Vec<u64>,
    /// Latencies after a gap each, sorted, in ns.
    after_idle: Vec<u64>,
}

impl IdleFigures {
    fn cpu_percent(&self) -> f64 {
        self.cpu.as_secs_f64() / self.window.as_secs_f64().max(1e-9) * 100.0
    }
    fn switches_per_s(&self) -> f64 {
        self.switches as f64 / self.window.as_secs_f64().max(1e-9)
    }
}

/// Whose resource usage [`usage_of`] reads.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Who {
    /// The whole process (every thread, those gone included).
    Process,
    /// The calling thread.
    Thread,
}

/// CPU time and context switches, so far (`getrusage`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Usage {
    /// User + system CPU time.
    pub(crate) cpu: Duration,
    /// Voluntary context switches (a wait: a futex, a poll, a sleep).
    pub(crate) voluntary: u64,
    /// Involuntary ones (preempted).
    pub(crate) involuntary: u64,
}

impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, other: Usage) {
        self.cpu += other.cpu;
        self.voluntary += other.voluntary;
        self.involuntary += other.involuntary;
    }
}

impl Usage {
    /// What was used from `earlier` to `self`.
    pub(crate) fn since(self, earlier: Usage) -> Usage {
        Usage {
            cpu: self.cpu.saturating_sub(earlier.cpu),
            voluntary: self.voluntary.saturating_sub(earlier.voluntary),
            involuntary: self.involuntary.saturating_sub(earlier.involuntary),
        }
    }
}

/// `who`'s usage so far.
pub(crate) fn usage_of(who: Who) -> std::io::Result<Usage> {
    let which = match who {
        Who::Process => libc::RUSAGE_SELF,
        Who::Thread => libc::RUSAGE_THREAD,
    };
    // SAFETY: an all-zero rusage (integers and timevals) is a valid value
    // for getrusage to fill.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage; `which` is one of the
    // constants getrusage takes.
    if unsafe { libc::getrusage(which, &mut ru) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let tv = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    Ok(Usage {
        cpu: tv(ru.ru_utime) + tv(ru.ru_stime),
        voluntary: u64::try_from(ru.ru_nvcsw).unwrap_or(0),
        involuntary: u64::try_from(ru.ru_nivcsw).unwrap_or(0),
    })
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// One mode's run: warm-up, rest, the idle window (`idle` spends it),
/// back-to-back WRITEs, WRITEs after a gap each (`write` times one).
fn measure_idle(
    mode: WaitMode,
    plan: IdlePlan,
    mut write: impl FnMut() -> Result<Duration, Box<dyn Error>>,
    idle: impl FnOnce(Duration) -> Result<(), Box<dyn Error>>,
) -> Result<IdleFigures, Box<dyn Error>> {
    for _ in 0..WARMUP {
        write()?;
    }
    std::thread::sleep(SETTLE);
    let before = usage_of(Who::Process)?;
    let started = Instant::now();
    idle(plan.window)?;
    let used = usage_of(Who::Process)?.since(before);
    let window = started.elapsed();
    let mut back_to_back = (0..plan.samples)
        .map(|_| write().map(nanos))
        .collect::<Result<Vec<_>, _>>()?;
    let mut after_idle = (0..plan.idle_samples)
        .map(|_| {
            std::thread::sleep(plan.gap);
            write().map(nanos)
        })
        .collect::<Result<Vec<_>, _>>()?;
    back_to_back.sort_unstable();
    after_idle.sort_unstable();
    Ok(IdleFigures {
        mode,
        window,
        cpu: used.cpu,
        switches: used.voluntary,
        back_to_back,
        after_idle,
    })
}

/// `gdr bench idle`: every mode asked for, in order, its figures printed
/// as each ends.
pub(crate) fn idle_bench(
    backends: &Backends,
    args: &IdleArgs,
) -> Result<Vec<IdleFigures>, Box<dyn Error>> {
    let window = Duration::try_from_secs_f64(args.seconds)
        .map_err(|e| format!("--seconds {}: {e}", args.seconds))?;
    let plan = IdlePlan {
        window,
        samples: args.samples.max(1),
        idle_samples: args.idle_samples.max(1),
        gap: Duration::from_millis(args.gap_ms),
    };
    let backend = backends.verbs_name();
    let device =
        pick_device::<hal_verbs::dynamic::DynApi>(backends.verbs(), args.common.device.as_deref())?;
    if !args.common.json {
        println!(
            "gdr bench idle on {device} ({backend}): one {REQ}-byte WRITE at a time, host memory; \
             idle: this process's CPU time (% of one core) and voluntary context switches over \
             {window:?} with nothing to do"
        );
        println!(
            "modes: verbs = a bare queue pair, its CQ waited on by a CqWaiter (the floor); \
             caller = two engines over rdma_cm, Batch::wait drives; driver = the same, \
             Engine::spawn_driver on both"
        );
        println!(
            "latency: post or submit to completion seen, in µs: back to back (n={}), after {} ms \
             idle each (n={}); p50/p99 nearest rank",
            plan.samples,
            plan.gap.as_millis(),
            plan.idle_samples
        );
        println!(
            "{:<7} {:>9} {:>11} {:>9} {:>9} {:>10} {:>10}",
            "mode", "idle %cpu", "switches/s", "b2b p50", "b2b p99", "idle p50", "idle p99"
        );
    }
    let mut measured = Vec::new();
    for &mode in &args.mode {
        let figures = match mode {
            WaitMode::Verbs => on_verbs!(backends.verbs(), |A, p| verbs_floor::<A>(
                p, &device, args, plan
            ))?,
            WaitMode::Caller | WaitMode::Driver => engines(backends, &device, args, plan, mode)?,
        };
        if args.common.json {
            println!("{}", idle_json_line(&figures, backend, &device, plan));
        } else {
            let us = |sorted: &[u64], p| percentile(sorted, p) as f64 / 1e3;
            println!(
                "{:<7} {:>9.2} {:>11.1} {:>9.1} {:>9.1} {:>10.1} {:>10.1}",
                mode.name(),
                figures.cpu_percent(),
                figures.switches_per_s(),
                us(&figures.back_to_back, 0.5),
                us(&figures.back_to_back, 0.99),
                us(&figures.after_idle, 0.5),
                us(&figures.after_idle, 0.99),
            );
        }
        measured.push(figures);
    }
    Ok(measured)
}

/// `caller` and `driver`: two engines in this process (as `gdr bench
/// engine`), the listener's 4 KiB granted to the other, which WRITEs into
/// it.
fn engines(
    backends: &Backends,
    device: &str,
    args: &IdleArgs,
    plan: IdlePlan,
    mode: WaitMode,
) -> Result<IdleFigures, Box<dyn Error>> {
    let target = Target::in_process(
        backends,
        Some(device),
        args.common.port,
        host_memory_config(),
        REQ as u64,
    )?;
    let buffer = host_buffer(REQ as u64, 0x5a)?;
    let local = target.engine.register_buffer(&buffer)?;
    let _drivers: Vec<Driver> = match (mode, &target.server) {
        (WaitMode::Driver, Some(server)) => vec![
            target.engine.spawn_driver()?,
            server.pair.server.spawn_driver()?,
        ],
        _ => Vec::new(),
    };
    let write = || -> Result<Duration, Box<dyn Error>> {
        let transfer = Transfer::write(&local, 0, &target.descriptor, 0, REQ as u64);
        let started = Instant::now();
        target
            .peer
            .submit(&[transfer])?
            .wait(ENGINE_TIMEOUT)
            .map_err(|e| format!("a {REQ}-byte WRITE: {e}"))?;
        Ok(started.elapsed())
    };
    measure_idle(mode, plan, write, |window| {
        std::thread::sleep(window);
        Ok(())
    })
}

/// `verbs`: a bare queue pair on `device`, its CQ on a completion channel
/// (where the provider makes one), one `CqWaiter` waiting on it.
fn verbs_floor<A: Api>(
    provider: &A::Provider,
    device: &str,
    args: &IdleArgs,
    plan: IdlePlan,
) -> Result<IdleFigures, Box<dyn Error>> {
    const DEPTH: u32 = 16;
    let ctx = provider.open(device)?;
    let pd = ctx.alloc_pd()?;
    let (channel, cq) = channel_cq::<A>(&ctx, DEPTH)?;
    if channel.is_none() && !args.common.json {
        println!("(verbs: {device} makes no completion channel: its CQ is polled)");
    }
    let config = PairConfig {
        caps: send_caps(DEPTH),
        ..PairConfig::default()
    };
    let pair = QpPair::<A>::connect(&ctx, &pd, &cq, args.common.port, &config)?;
    let local = HostRegion::<A>::new(&pd, REQ, AccessFlags::LOCAL_WRITE)?;
    let remote = HostRegion::<A>::new(
        &pd,
        REQ,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    )?;
    let waiter = CqWaiter::new()?;
    let mut request = SendRequest {
        wr_id: 0,
        op: SendOp::Write {
            remote_addr: remote.mr.addr(),
            rkey: remote.mr.rkey(),
        },
        sg_list: SgList::from_slice(&[Sge {
            addr: local.mr.addr(),
            length: REQ as u32,
            lkey: local.mr.lkey(),
        }]),
        flags: SendFlags::SIGNALED,
    };
    let mut got: Vec<Completion> = Vec::with_capacity(DEPTH as usize);
    let mut write = || -> Result<Duration, Box<dyn Error>> {
        request.wr_id += 1;
        let started = Instant::now();
        // SAFETY: the SG entry lies in `local` and the remote range in
        // `remote`, both registered and alive until this function returns;
        // each WRITE is waited for before the next is posted, and one that
        // fails or times out is drained (`drain_after_failure`) before the
        // regions go.
        unsafe { pair.requester.post_send(std::slice::from_ref(&request)) }.map_err(|e| e.error)?;
        got.clear();
        if waiter.wait::<A>(
            &cq,
            channel.as_ref(),
            Some(Instant::now() + PARK_TIMEOUT),
            &mut got,
        )? == 0
        {
            return Err(
                format!("no completion of a {REQ}-byte WRITE within {PARK_TIMEOUT:?}").into(),
            );
        }
        let elapsed = started.elapsed();
        match got.as_slice() {
            [c] if c.status.is_success() && c.wr_id == request.wr_id => Ok(elapsed),
            [c] if !c.status.is_success() => {
                Err(format!("a {REQ}-byte WRITE completed with {}", c.status).into())
            }
            other => Err(format!(
                "one WRITE (request {}) outstanding, completions {other:?}",
                request.wr_id
            )
            .into()),
        }
    };
    let idle = |window: Duration| -> Result<(), Box<dyn Error>> {
        // Parked on the empty CQ until the window's end.
        let mut none = Vec::new();
        let n = waiter.wait::<A>(
            &cq,
            channel.as_ref(),
            Some(Instant::now() + window),
            &mut none,
        )?;
        if n != 0 {
            return Err(format!("{n} completions on an idle CQ: {none:?}").into());
        }
        Ok(())
    };
    measure_idle(WaitMode::Verbs, plan, &mut write, idle)
        .map_err(|e| drain_after_failure::<A>(&pair, &cq, e))
}

fn idle_json_line(f: &IdleFigures, backend: &str, device: &str, plan: IdlePlan) -> String {
    let us = |sorted: &[u64], p| percentile(sorted, p) as f64 / 1e3;
    let mut s = String::new();
    // Writing to a String cannot fail.
    let _ = write!(
        s,
        "{{\"bench\":\"idle\",\"backend\":\"{backend}\",\"device\":\"{device}\",\
         \"mode\":\"{}\",\"size\":{REQ},\"idle_seconds\":{:.3},\"idle_cpu_pct\":{:.3},\
         \"voluntary_switches_per_s\":{:.2},\"b2b_samples\":{},\"b2b_p50_us\":{:.2},\
         \"b2b_p99_us\":{:.2},\"gap_ms\":{},\"after_idle_samples\":{},\
         \"after_idle_p50_us\":{:.2},\"after_idle_p99_us\":{:.2}}}",
        f.mode.name(),
        f.window.as_secs_f64(),
        f.cpu_percent(),
        f.switches_per_s(),
        f.back_to_back.len(),
        us(&f.back_to_back, 0.5),
        us(&f.back_to_back, 0.99),
        plan.gap.as_millis(),
        f.after_idle.len(),
        us(&f.after_idle, 0.5),
        us(&f.after_idle, 0.99),
    );
    s
}
