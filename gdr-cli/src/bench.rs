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
//! polled in batches, and an empty poll gives the CPU away (`--idle yield`)
//! rather than spinning.

use std::error::Error;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand, ValueEnum};
use gdr_core::loopback::{PairConfig, QpPair};
use hal_verbs::{
    AccessFlags, Api, Completion, CompletionQueue as _, Context as _, MemoryRegion as _,
    ProtectionDomain as _, Provider as _, QpCaps, QueuePair as _, SendFlags, SendOp, SendRequest,
    SgList, Sge,
};

use crate::parse_size;
use gdr_core::backend::Backends;

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub(crate) enum BenchCommand {
    /// RDMA WRITE and READ throughput through host memory, between two RC
    /// QPs connected to each other on one device (perftest's
    /// ib_write_bw/ib_read_bw, client and server in one process).
    Rdma(RdmaArgs),
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
    /// Back off: spin briefly, then sleep 20 µs, doubling up to 1 ms while
    /// the CQ stays empty. An idle vCPU halts, which under emulation gives
    /// its host core to the vCPU doing rxe's packet work. Costs at most a
    /// millisecond per signaled completion, which the window hides: it
    /// holds far more than a millisecond of work.
    Sleep,
}

/// Empty polls spun before [`Idle::Sleep`] starts sleeping.
const SPIN_BEFORE_SLEEP: u32 = 64;
/// First and longest sleep of [`Idle::Sleep`].
const SLEEP_FIRST: Duration = Duration::from_micros(20);
const SLEEP_MAX: Duration = Duration::from_millis(1);

/// Options of `gdr bench rdma`.
#[derive(Debug, Args)]
pub(crate) struct RdmaArgs {
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
    #[arg(long, value_enum, default_value_t = Idle::Sleep)]
    idle: Idle,
    /// Untimed messages before each measurement (0: none, as perftest).
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    /// RDMA device (default: the first).
    #[arg(long, short = 'd')]
    device: Option<String>,
    /// Port of the device.
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

impl Measurement {
    fn bytes(&self) -> u64 {
        self.plan.size as u64 * self.plan.iterations
    }
    fn seconds(&self) -> f64 {
        self.elapsed.as_secs_f64().max(1e-9)
    }
    /// perftest's MB/s: 2^20 bytes per second.
    fn mib_per_s(&self) -> f64 {
        self.bytes() as f64 / self.seconds() / f64::from(1 << 20)
    }
    /// 10^9 bits per second.
    fn gbit_per_s(&self) -> f64 {
        self.bytes() as f64 * 8.0 / self.seconds() / 1e9
    }
    fn msg_per_s(&self) -> f64 {
        self.plan.iterations as f64 / self.seconds()
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

pub(crate) fn run<V: Api, C: hal_cuda::Api>(
    backends: &Backends<V, C>,
    command: BenchCommand,
) -> Result<(), Box<dyn Error>> {
    match command {
        BenchCommand::Rdma(args) => {
            if backends.verbs_name() == "sim" && !args.json {
                println!("(simulated NIC: the figures measure gdr-sim, not a device)");
            }
            rdma::<V>(backends.verbs(), &args)
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

fn rdma<A: Api>(provider: &A::Provider, args: &RdmaArgs) -> Result<(), Box<dyn Error>> {
    let device = match &args.device {
        Some(name) => name.clone(),
        None => {
            provider
                .devices()?
                .into_iter()
                .next()
                .ok_or("no RDMA device")?
                .name
        }
    };
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
    let cq = ctx.create_cq(depth)?;
    let config = PairConfig {
        caps: QpCaps {
            max_send_wr: depth,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        // As many READs in flight as the device allows, as perftest asks.
        rd_atomic: u8::try_from(attrs.max_qp_init_rd_atom.min(attrs.max_qp_rd_atom))
            .unwrap_or(u8::MAX)
            .max(1),
    };
    let pair = QpPair::<A>::connect(&ctx, &pd, &cq, args.port, &config)?;
    // Granted may exceed asked; never use more than asked.
    let window_cap = u64::from(pair.requester.caps().max_send_wr.min(depth));
    let local = HostRegion::<A>::new(&pd, largest, AccessFlags::LOCAL_WRITE)?;
    let remote = HostRegion::<A>::new(
        &pd,
        largest,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
    )?;

    if !args.json {
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
    for &op in &args.ops {
        for &size in &args.sizes {
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
                measure::<A>(&pair, &cq, &local.mr, &remote.mr, warm)
                    .map_err(|e| drain_after_failure::<A>(&pair, &cq, e))?;
            }
            let m = measure::<A>(&pair, &cq, &local.mr, &remote.mr, plan)
                .map_err(|e| drain_after_failure::<A>(&pair, &cq, e))?;
            if args.json {
                println!("{}", json_line(&m, provider.backend_name(), &device));
            } else {
                println!(
                    "{:<6} {:>9} {:>10} {:>10.2} {:>9.3} {:>10.0} {:>9.3}",
                    op.name(),
                    size,
                    iterations,
                    m.mib_per_s(),
                    m.gbit_per_s(),
                    m.msg_per_s(),
                    m.seconds()
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
    Ok(())
}

/// How long a failed measurement's queue pair may take to flush.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

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
        m.msg_per_s(),
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
    cq: &A::CompletionQueue,
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
    let (mut empty_streak, mut nap) = (0u32, SLEEP_FIRST);

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
                request.flags = if (seq + 1) % plan.cq_mod == 0 || seq + 1 == plan.iterations {
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
        let got = cq.poll(&mut completions)?;
        polls += 1;
        if got == 0 {
            empty_polls += 1;
            match plan.idle {
                Idle::Spin => {}
                Idle::Yield => std::thread::yield_now(),
                Idle::Sleep if empty_streak < SPIN_BEFORE_SLEEP => empty_streak += 1,
                Idle::Sleep => {
                    std::thread::sleep(nap);
                    nap = (nap * 2).min(SLEEP_MAX);
                }
            }
            continue;
        }
        (empty_streak, nap) = (0, SLEEP_FIRST);
        for c in &completions[..got] {
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
            (8, 100, Some(1), 37, Idle::Sleep),
            (5, 3, Some(4), 11, Idle::Yield),
            (1, 1, None, 3, Idle::Sleep),
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
                device: None,
                port: 1,
                json: true,
            };
            rdma::<SimVerbsApi>(&node, &args).unwrap();
        }
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
            device: None,
            port: 1,
            json: true,
        };
        let err = rdma::<SimVerbsApi>(&node, &args).unwrap_err().to_string();
        assert!(err.contains("remote access error"), "{err}");
        assert!(!err.contains("drain"), "the drain succeeded: {err}");
    }
}
