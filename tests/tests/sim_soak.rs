//! The seeded soak (simulated NICs and GPUs): four engines, connected in
//! four pairs, move random batches of one to three transfers (WRITE and
//! READ, 1 B to 64 KiB, host, pinned and GPU memory: GPU memory on the
//! dma-buf rung, the peermem rung and the staging rung, and GPU to GPU by
//! CUDA IPC between two processes of one node; some batches gated on a
//! GPU stream) under faults drawn at
//! random at every verbs and CUDA site of the simulation (each error
//! status a completion can carry, CQ overruns, QPs failing on their own,
//! devices lost), with random deadlines, cancels, buffers dropped under
//! their transfers, grants revoked under them, messages (bursts nobody
//! reads, up to the inbox bound) and peers closed and reconnected.
//!
//! What it checks, as it goes:
//! - every request ends, within its deadline plus a grace, and keeps the
//!   outcome it ended with;
//! - a transfer that succeeded moved exactly its bytes (read back from
//!   the memory itself);
//! - nothing moved outside the granted ranges (guard bytes around each)
//!   nor under a revoked grant once its revoke returned (the memory is
//!   compared with its state at the revoke once the requests under it
//!   ended);
//! - nothing touched freed GPU memory (the simulation's freed-memory
//!   reports);
//! - what each engine holds for a peer stays within the configured bounds;
//! - a message arrives at most once and only if it was sent;
//!
//! and at the end of each round that the engines and the simulation are
//! back to nothing (every MR, QP, CQ, device and pinned byte released).
//!
//! A round is one seed: the seed picks the operations and the faults (a
//! fault fires at the n-th call of its site, so the same seed draws the
//! same faults at the same calls; the three engines' driver threads make
//! the interleaving, so a replay is the same run up to thread timing).
//! `GDR_SOAK_SECONDS` (default 40) bounds the run; `GDR_SOAK_SEED` starts
//! from that seed (a failing round prints its seed and the command that
//! replays it); `GDR_SOAK_RATE` scales the fault rates (default 1).
//! Figures (operations, bytes verified, outcomes, faults fired per site)
//! are printed at the end.

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use gdr_core::buffer::Buffer;
use gdr_core::descriptor::{GrantRights, MemoryDescriptor};
use gdr_core::engine::{
    Batch, EngineConfig, EngineError, Path, PeerLimits, Region, Transfer, TransferError,
};
use gdr_sim::{
    CudaResources, DeviceConfig, Fault, FaultPlan, FaultSite, GpuConfig, NodeConfig, RandomFaults,
    SimCuda, SimFabric, SimVerbsApi,
};
use gdr_tests::engine_world::{Kind, Side, WorldGrant, WorldPeer, staged_through_slots};
use hal_cuda::{Context as _, CudaError, Driver as _, MemoryType};
use hal_verbs::{VerbsError, WcStatus};

type Sim = SimVerbsApi;

/// A granted target is this many slots; a transfer owns one slot while it
/// runs, so its bytes can be checked.
const SLOTS: usize = 4;
const SLOT: u64 = 64 << 10;
/// Bytes before and after each granted range that no transfer may touch.
const GUARD: u64 = 4096;
const TARGET: u64 = GUARD + SLOTS as u64 * SLOT + GUARD;
/// Transfers in flight at most.
const IN_FLIGHT: usize = 12;
/// How long a request may run past its deadline before the soak calls it
/// hung.
const GRACE: Duration = Duration::from_secs(10);
/// Blocking calls of the soak itself (connect, wait for a grant, revoke).
const T: Duration = Duration::from_secs(5);
/// A transfer's deadline, unless it draws a short one (a request a fault
/// stalls ends at it).
const DEADLINE: Duration = Duration::from_secs(2);
/// The engines' bounds on what a peer may make them hold (small, so the
/// message bursts reach them).
const LIMITS: PeerLimits = PeerLimits {
    max_remote_grants: 64,
    max_inbox_messages: 32,
    max_inbox_bytes: 64 << 10,
    max_staged_requests: 8,
    staged_request_timeout: Duration::from_secs(5),
};
/// Operations a round runs at most.
const OPS_PER_ROUND: usize = 400;

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value}: not a number")),
    )
}

/// The faults the soak draws from, per site, at `scale` times the rates
/// below (parts per million of the site's calls).
fn menu(scale: f64) -> Vec<(FaultSite, u32, Vec<Fault>)> {
    let rate = |ppm: f64| (ppm * scale) as u32;
    let verbs =
        |op: &'static str, errno: i32| Fault::Verbs(VerbsError::from_errno(op, "sim0", errno));
    let cuda = |op: &'static str, code: u32| Fault::Cuda(CudaError::from_code(op, code));
    let statuses = [
        WcStatus::LOC_LEN_ERR,
        WcStatus::LOC_QP_OP_ERR,
        WcStatus::LOC_PROT_ERR,
        WcStatus::WR_FLUSH_ERR,
        WcStatus::BAD_RESP_ERR,
        WcStatus::LOC_ACCESS_ERR,
        WcStatus::REM_INV_REQ_ERR,
        WcStatus::REM_ACCESS_ERR,
        WcStatus::REM_OP_ERR,
        WcStatus::RETRY_EXC_ERR,
        WcStatus::RNR_RETRY_EXC_ERR,
        WcStatus::FATAL_ERR,
        WcStatus::RESP_TIMEOUT_ERR,
        WcStatus::GENERAL_ERR,
    ];
    let mut completion: Vec<Fault> = statuses.into_iter().map(Fault::CompletionStatus).collect();
    completion.push(Fault::CqOverrun);
    completion.push(Fault::QpFatal);
    // A verbs site failing with each of `errnos` (as `op` reports them).
    let verbs_site = |site, ppm, op: &'static str, errnos: &[i32]| {
        let faults = errnos.iter().map(|&e| verbs(op, e)).collect();
        (site, rate(ppm), faults)
    };
    use FaultSite::*;
    use libc::{EFAULT, EINVAL, ENOMEM, EOPNOTSUPP, ETIMEDOUT};
    vec![
        verbs_site(VerbsRegister, 20_000.0, "ibv_reg_mr", &[ENOMEM, EFAULT]),
        verbs_site(
            VerbsRegisterDmabuf,
            20_000.0,
            "ibv_reg_dmabuf_mr",
            &[ENOMEM, EOPNOTSUPP],
        ),
        verbs_site(VerbsCreateQp, 20_000.0, "ibv_create_qp", &[ENOMEM]),
        verbs_site(
            VerbsModifyQp,
            5_000.0,
            "ibv_modify_qp",
            &[EINVAL, ETIMEDOUT],
        ),
        verbs_site(VerbsPostSend, 1_000.0, "ibv_post_send", &[ENOMEM, EINVAL]),
        verbs_site(VerbsPostRecv, 1_000.0, "ibv_post_recv", &[ENOMEM]),
        (VerbsCompletion, rate(1_500.0), completion),
        (VerbsCompletion, rate(60.0), vec![Fault::DeviceLost]),
        (
            FaultSite::CudaAlloc,
            rate(20_000.0),
            vec![cuda("cuMemAlloc", 2)], // CUDA_ERROR_OUT_OF_MEMORY
        ),
        (
            FaultSite::CudaCopy,
            rate(2_000.0),
            vec![cuda("cuMemcpyAsync", 700), cuda("cuMemcpyAsync", 719)], // illegal address, launch failed
        ),
        (CudaCopy, rate(300.0), vec![Fault::DeviceLost]),
        (
            FaultSite::CudaStreamMemOp,
            rate(20_000.0),
            vec![Fault::Cuda(CudaError::unsupported(
                "cuStreamWriteValue32",
                "no stream memory operations",
            ))],
        ),
        (
            FaultSite::CudaExportDmabuf,
            rate(20_000.0),
            vec![cuda("cuMemGetHandleForAddressRange", 2)],
        ),
        (
            FaultSite::CudaIpcOpen,
            rate(20_000.0),
            vec![cuda("cuIpcOpenMemHandle", 1)],
        ),
    ]
}

/// One of the soak's operations on a round.
type Operation = fn(&mut Round<'_>);

/// The operations a round draws from: each takes the draws below its
/// bound (out of 100) not taken by those before it.
const OPERATIONS: [(u32, &str, Operation); 7] = [
    (65, "transfer", |r| r.transfer()),
    (70, "revoke", |r| r.revoke()),
    (72, "close", |r| r.close()),
    (76, "reconnect", |r| r.reconnect()),
    (86, "message", |r| r.message()),
    (88, "burst", |r| r.burst()),
    (100, "cancel", |r| r.cancel_one()),
];

/// One engine of the soak.
struct Node {
    side: Side<Sim>,
    ip: IpAddr,
    /// The GPU its device memory is on.
    gpu: u32,
}

/// A region one end grants the other, with the bytes around the grant
/// that must never change.
struct Target {
    /// Which end of the connection owns it (0: `i`, 1: `j`).
    owner: usize,
    kind: Kind,
    buffer: Buffer,
    region: Region,
    /// The owner's grant and the user's descriptor of it; `None` once
    /// revoked (or never made: a fault).
    grant: Option<(WorldGrant, MemoryDescriptor)>,
    /// The descriptor of a revoked grant, which the user may still try.
    stale: Option<MemoryDescriptor>,
    busy: [bool; SLOTS],
    /// Its bytes when a revoke returned, while requests under the revoked
    /// grant may still end.
    at_revoke: Option<Vec<u8>>,
    /// A revoke did not confirm (or the owner is gone): its bytes are not
    /// checked against `at_revoke` and no new grant is made.
    retired: bool,
    guard: (Vec<u8>, Vec<u8>),
}

/// Two engines, `i` connecting to `j`.
struct Conn {
    i: usize,
    j: usize,
    /// `i`'s end and `j`'s end; `None` once closed or failed to connect.
    peers: Option<[WorldPeer; 2]>,
    targets: Vec<Target>,
    /// Messages sent by each end and not yet taken by the other.
    sent: [HashSet<u64>; 2],
    taken: [HashSet<u64>; 2],
}

/// One transfer of a batch in flight.
struct Part {
    target: usize,
    slot: usize,
    /// Offset of its bytes inside the slot.
    at: u64,
    len: u64,
    write: bool,
    /// Under a revoked grant's descriptor (it must not succeed).
    stale: bool,
    /// WRITE: the bytes it writes; READ: the target's bytes when it began.
    expect: Vec<u8>,
    /// The local memory, unless dropped while the transfer runs.
    local: Option<(Buffer, Region)>,
}

/// A batch in flight.
struct Running {
    batch: Batch,
    conn: usize,
    parts: Vec<Part>,
    /// The stream a gated batch waits for.
    _stream: Option<gdr_core::Stream>,
    must_end_by: Instant,
}

#[derive(Default)]
struct Figures {
    rounds: u64,
    ops: u64,
    transfers: u64,
    bytes_verified: u64,
    outcomes: BTreeMap<String, u64>,
    revokes: u64,
    closes: u64,
    reconnects: u64,
    messages: u64,
    calls: BTreeMap<String, u64>,
    fired: BTreeMap<String, u64>,
    /// Time the soak's thread spent, by operation.
    time: BTreeMap<&'static str, Duration>,
}

impl Figures {
    fn outcome(&mut self, what: impl Into<String>) {
        *self.outcomes.entry(what.into()).or_insert(0) += 1;
    }
}

/// A short name for an error: its variant's (the first word of its
/// `Debug`).
fn variant_name(e: &dyn std::fmt::Debug) -> String {
    let debug = format!("{e:?}");
    debug
        .split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or("?")
        .to_string()
}

/// The bytes of `len` at `offset` of `buffer`, read directly (no stream:
/// nothing the fault plan counts).
fn peek(buffer: &Buffer, offset: u64, len: u64) -> Vec<u8> {
    if buffer.memory_type() == MemoryType::Device {
        gdr_sim::memory::peek(buffer.addr() + offset, len as usize)
            .expect("the soak's GPU memory is mapped")
    } else {
        let all = buffer.to_vec().expect("host memory is CPU-readable");
        all[offset as usize..(offset + len) as usize].to_vec()
    }
}

/// Memory of `kind` on `node` holding `data`, registered; `None` when a
/// fault refused it (counted).
fn alloc(node: &Node, kind: Kind, data: &[u8], figures: &mut Figures) -> Option<(Buffer, Region)> {
    let len = data.len() as u64;
    let buffer = match kind {
        Kind::Host => Ok(Buffer::alloc_host(len)),
        Kind::Pinned => node
            .side
            .driver
            .context(node.gpu)
            .map_err(EngineError::from)
            .and_then(|ctx| Buffer::alloc_pinned(&ctx, len).map_err(EngineError::from)),
        Kind::Gpu => node
            .side
            .driver
            .context(node.gpu)
            .map_err(EngineError::from)
            .and_then(|ctx| Buffer::alloc_device(&ctx, len).map_err(EngineError::from)),
    };
    let buffer = match buffer {
        Ok(b) => b,
        Err(_) => {
            figures.outcome("alloc refused");
            return None;
        }
    };
    if buffer.memory_type() == MemoryType::Device {
        let range = gdr_sim::memory::lookup(buffer.addr()).expect("mapped");
        let offset = (buffer.addr() - range.base) as usize;
        // SAFETY: the allocation holds `len` bytes at `offset` of its
        // backing (it was just made, nothing else uses it yet).
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                range.backing.as_ptr().add(offset),
                data.len(),
            )
        };
    } else {
        buffer
            .write_at(0, data)
            .expect("host memory is CPU-writable");
    }
    match node.side.engine.register_buffer(&buffer) {
        Ok(region) => Some((buffer, region)),
        Err(_) => {
            figures.outcome("register refused");
            None
        }
    }
}

/// `i` connects to `j` (a listener of its own on `j`); `None` when a fault
/// refused it.
fn connect(nodes: &[Node], i: usize, j: usize) -> Option<[WorldPeer; 2]> {
    let listener = nodes[j]
        .side
        .engine
        .listen(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
        .ok()?;
    let port = listener.local_addr().port();
    let path = Path {
        source: None,
        peer: SocketAddr::new(nodes[j].ip, port),
    };
    std::thread::scope(|scope| {
        // The simulation connects in milliseconds: a connect a fault
        // refused is not waited for long.
        let accepting = scope.spawn(move || listener.accept(Duration::from_secs(1)));
        let ij = nodes[i].side.engine.connect_paths(&[path], T);
        let ji = accepting.join().expect("the accepting thread");
        match (ij, ji) {
            (Ok(ij), Ok(ji)) => Some([ij, ji]),
            _ => None,
        }
    })
}

/// The owner of `target` grants its slots to the other end, which waits
/// for the announcement.
fn grant(conn: &Conn, target: usize) -> Option<(WorldGrant, MemoryDescriptor)> {
    let peers = conn.peers.as_ref()?;
    let t = &conn.targets[target];
    let (owner, user) = (&peers[t.owner], &peers[1 - t.owner]);
    let grant = owner
        .grant(
            &t.region,
            GUARD,
            SLOTS as u64 * SLOT,
            GrantRights::ReadWrite,
        )
        .ok()?;
    let remote = user.wait_grant(grant.descriptor().grant, T).ok()?;
    Some((grant, remote))
}

struct Round<'f> {
    seed: u64,
    rng: fastrand::Rng,
    plan: FaultPlan,
    fabric: SimFabric,
    cudas: Vec<SimCuda>,
    nodes: Vec<Node>,
    conns: Vec<Conn>,
    running: Vec<Running>,
    next_message: u64,
    figures: &'f mut Figures,
}

impl Round<'_> {
    fn new(seed: u64, scale: f64, figures: &mut Figures) -> Round<'_> {
        gdr_tests::init_tracing();
        let plan = FaultPlan::random(RandomFaults {
            seed,
            menu: menu(scale),
        });
        // The world is made without faults; they start with the first
        // operation.
        plan.set_random_active(false);
        let fabric = SimFabric::with_faults(plan.clone());
        let base = EngineConfig::default()
            .with_qps_per_peer(2)
            // Small slices and a shallow send queue: a 64 KiB transfer is
            // up to 16 requests, queued behind one another.
            .with_slice_size(4096)
            .with_qp_depth(8)
            .with_default_timeout(DEADLINE)
            .with_reconnect_timeout(Duration::from_secs(2))
            .with_peer_limits(LIMITS);
        // n0: GPU memory on the dma-buf rung, two GPUs (its own on 0); n1:
        // on the peermem rung; n2: on the staging rung (its peers reach it
        // through landing slots); n3: another process of n0's node, on
        // n0's GPU 1 (GPU to GPU with n0 by CUDA IPC, no NIC).
        let peermem = GpuConfig {
            dma_buf_supported: false,
            peermem: true,
            ..GpuConfig::default()
        };
        let second = GpuConfig {
            pci_bus_id: "0000:2a:00.0".into(),
            ..GpuConfig::default()
        };
        let n0_cuda = SimCuda::new(vec![GpuConfig::default(), second], plan.clone());
        let kinds: [(EngineConfig, SimCuda, u32); 4] = [
            (base.clone(), n0_cuda.clone(), 0),
            (base.clone(), SimCuda::new(vec![peermem], plan.clone()), 0),
            (
                staged_through_slots(base.clone()),
                SimCuda::new(vec![GpuConfig::default()], plan.clone()),
                0,
            ),
            (base, n0_cuda.other_process(), 1),
        ];
        let mut cudas = Vec::new();
        let nodes: Vec<Node> = kinds
            .into_iter()
            .enumerate()
            .map(|(n, (config, cuda, gpu))| {
                let verbs = fabric.add_node(
                    &format!("n{n}"),
                    NodeConfig {
                        ipv4: None,
                        devices: vec![DeviceConfig::default()],
                    },
                );
                cudas.push(cuda.clone());
                let ip = IpAddr::V4(verbs.device_ipv4("sim0").expect("sim0"));
                Node {
                    side: Side::new(verbs, cuda, config),
                    ip,
                    gpu,
                }
            })
            .collect();
        let mut round = Round {
            seed,
            rng: fastrand::Rng::with_seed(seed),
            plan,
            fabric,
            cudas,
            nodes,
            conns: Vec::new(),
            running: Vec::new(),
            next_message: 0,
            figures,
        };
        for (i, j) in [(0, 1), (0, 2), (1, 2), (0, 3)] {
            let peers = connect(&round.nodes, i, j);
            assert!(
                peers.is_some(),
                "seed {seed}: n{i} connects to n{j} without faults"
            );
            let mut conn = Conn {
                i,
                j,
                peers,
                targets: Vec::new(),
                sent: Default::default(),
                taken: Default::default(),
            };
            for owner in 0..2 {
                for kind in [Kind::Host, Kind::Gpu] {
                    let node = &round.nodes[[i, j][owner]];
                    let data = gdr_tests::pattern(TARGET as usize, round.rng.u8(..));
                    let (buffer, region) =
                        alloc(node, kind, &data, round.figures).expect("no faults yet");
                    let guard = (
                        data[..GUARD as usize].to_vec(),
                        data[(TARGET - GUARD) as usize..].to_vec(),
                    );
                    conn.targets.push(Target {
                        owner,
                        kind,
                        buffer,
                        region,
                        grant: None,
                        stale: None,
                        busy: [false; SLOTS],
                        at_revoke: None,
                        retired: false,
                        guard,
                    });
                    let t = conn.targets.len() - 1;
                    let made = grant(&conn, t);
                    assert!(made.is_some(), "seed {seed}: a grant without faults");
                    conn.targets[t].grant = made;
                }
            }
            round.conns.push(conn);
        }
        round.plan.set_random_active(true);
        round
    }

    fn run(&mut self, until: Instant) {
        let drivers: Vec<_> = self
            .nodes
            .iter()
            .map(|n| n.side.engine.spawn_driver().unwrap())
            .collect();
        for _ in 0..OPS_PER_ROUND {
            if Instant::now() >= until {
                break;
            }
            self.figures.ops += 1;
            let began = Instant::now();
            let draw = self.rng.u32(..100);
            let (_, op, run) = OPERATIONS
                .iter()
                .find(|(upto, _, _)| draw < *upto)
                .expect("the last operation takes every draw");
            run(self);
            *self.figures.time.entry(*op).or_default() += began.elapsed();
            let began = Instant::now();
            while self.running.len() >= IN_FLIGHT {
                self.reap(true);
            }
            self.reap(false);
            self.check_bounds();
            *self.figures.time.entry("reap").or_default() += began.elapsed();
        }
        while !self.running.is_empty() {
            self.reap(true);
        }
        self.plan.set_random_active(false);
        self.check_quiet_targets();
        drop(drivers);
        self.check_no_use_after_free();
    }

    /// A live connection's index, if any.
    fn live_conn(&mut self) -> Option<usize> {
        let live: Vec<usize> = (0..self.conns.len())
            .filter(|&c| self.conns[c].peers.is_some())
            .collect();
        (!live.is_empty()).then(|| live[self.rng.usize(..live.len())])
    }

    /// A batch of one to three transfers on one connection, each on a
    /// free slot of a target the other end granted.
    fn transfer(&mut self) {
        let Some(c) = self.live_conn() else {
            return;
        };
        let user = self.rng.usize(..2);
        let count = if self.rng.u32(..3) == 0 {
            self.rng.usize(2..=3)
        } else {
            1
        };
        let local_node = [self.conns[c].i, self.conns[c].j][user];
        let mut parts = Vec::new();
        let mut remotes = Vec::new();
        for _ in 0..count {
            let conn = &self.conns[c];
            let usable: Vec<(usize, usize)> = (0..conn.targets.len())
                .filter(|&t| conn.targets[t].owner != user && !conn.targets[t].retired)
                .flat_map(|t| (0..SLOTS).map(move |slot| (t, slot)))
                .filter(|&(t, slot)| {
                    !conn.targets[t].busy[slot]
                        && !parts.iter().any(|p: &Part| (p.target, p.slot) == (t, slot))
                })
                .collect();
            if usable.is_empty() {
                break;
            }
            let (t, slot) = usable[self.rng.usize(..usable.len())];
            let target = &conn.targets[t];
            // A revoked grant's descriptor, tried now and then: it must fail.
            let (remote, stale) = match (&target.grant, &target.stale) {
                (_, Some(stale)) if self.rng.u32(..4) == 0 => (stale.clone(), true),
                (Some((_, remote)), _) => (remote.clone(), false),
                _ => continue,
            };
            let len = match self.rng.u32(..4) {
                0 => self.rng.u64(1..=64),
                1 => self.rng.u64(1..=4096),
                _ => self.rng.u64(1..=SLOT),
            };
            let at = self.rng.u64(..=SLOT - len);
            let write = self.rng.bool();
            let kind = [Kind::Host, Kind::Pinned, Kind::Gpu][self.rng.usize(..3)];
            let data = gdr_tests::pattern(len as usize, self.rng.u8(..));
            let Some(local) = alloc(&self.nodes[local_node], kind, &data, self.figures) else {
                continue;
            };
            let expect = if write {
                data
            } else {
                peek(&target.buffer, GUARD + slot as u64 * SLOT + at, len)
            };
            parts.push(Part {
                target: t,
                slot,
                at,
                len,
                write,
                stale,
                expect,
                local: Some(local),
            });
            remotes.push(remote);
        }
        if parts.is_empty() {
            return;
        }
        let transfers: Vec<Transfer<'_>> = parts
            .iter()
            .zip(&remotes)
            .map(|(p, remote)| {
                let (_, region) = p.local.as_ref().expect("kept until submitted");
                let remote_at = p.slot as u64 * SLOT + p.at;
                if p.write {
                    Transfer::write(region, 0, remote, remote_at, p.len)
                } else {
                    Transfer::read(region, 0, remote, remote_at, p.len)
                }
            })
            .collect();
        let timeout = if self.rng.u32(..8) == 0 {
            Duration::from_millis(self.rng.u64(1..=50))
        } else {
            DEADLINE
        };
        let peer = &self.conns[c].peers.as_ref().expect("live")[user];
        // One batch in six waits for a GPU stream of the local node.
        let node = &self.nodes[local_node];
        let stream = if self.rng.u32(..6) == 0 {
            node.side
                .driver
                .context(node.gpu)
                .and_then(|ctx| ctx.create_stream())
                .ok()
                .map(|stream| gdr_core::Stream::from_erased(node.gpu, stream))
        } else {
            None
        };
        let submitted = match &stream {
            Some(stream) => peer.submit_after_stream(stream, &transfers, Some(timeout)),
            None => peer.submit_with_timeout(&transfers, timeout),
        };
        drop(transfers);
        let batch = match submitted {
            Ok(batch) => batch,
            Err(e) => {
                self.figures
                    .outcome(format!("submit refused: {}", variant_name(&e)));
                return;
            }
        };
        self.figures.transfers += parts.len() as u64;
        for part in &mut parts {
            self.conns[c].targets[part.target].busy[part.slot] = true;
            // Now and then the application lets go of its memory at once:
            // the transfer must keep it alive until it ends.
            if self.rng.u32(..5) == 0 {
                part.local = None;
            }
        }
        // Now and then a grant is revoked right under the batch just
        // submitted: the revoke must fence what it started.
        let revoke_now = (self.rng.u32(..8) == 0).then(|| parts[0].target);
        self.running.push(Running {
            batch,
            conn: c,
            parts,
            _stream: stream,
            must_end_by: Instant::now() + timeout + GRACE,
        });
        if let Some(t) = revoke_now {
            self.revoke_target(c, t);
        }
    }

    /// Takes the batches that ended (waiting for one when `block`) and
    /// checks each.
    fn reap(&mut self, block: bool) {
        let mut i = 0;
        let mut waited = false;
        while i < self.running.len() {
            let r = &self.running[i];
            let outcome = if block && !waited {
                waited = true;
                let left = r.must_end_by.saturating_duration_since(Instant::now());
                match r.batch.wait(left) {
                    Err(TransferError::Timeout(_)) if r.batch.status().is_none() => None,
                    outcome => Some(outcome),
                }
            } else {
                r.batch.status()
            };
            let Some(outcome) = outcome else {
                assert!(
                    Instant::now() < r.must_end_by,
                    "seed {}: a batch of {} transfers never ended (deadline plus {GRACE:?} passed)",
                    self.seed,
                    r.parts.len()
                );
                i += 1;
                continue;
            };
            let r = self.running.swap_remove(i);
            self.ended(r, outcome);
        }
    }

    fn ended(&mut self, r: Running, outcome: Result<(), TransferError>) {
        let seed = self.seed;
        // The outcome stays what it was.
        assert_eq!(
            r.batch.status().map(|o| o.is_ok()),
            Some(outcome.is_ok()),
            "seed {seed}: a batch's outcome changed"
        );
        match &outcome {
            Ok(()) => self.figures.outcome("ok"),
            Err(e) => self.figures.outcome(variant_name(e)),
        }
        for part in &r.parts {
            let target = &mut self.conns[r.conn].targets[part.target];
            target.busy[part.slot] = false;
            if outcome.is_err() {
                continue;
            }
            assert!(
                !part.stale,
                "seed {seed}: a transfer under a revoked grant succeeded"
            );
            let remote_at = GUARD + part.slot as u64 * SLOT + part.at;
            let what = if part.write { "WRITE" } else { "READ" };
            let moved = if part.write {
                peek(&target.buffer, remote_at, part.len) == part.expect
            } else if let Some((buffer, _)) = &part.local {
                peek(buffer, 0, part.len) == part.expect
            } else {
                continue;
            };
            assert!(
                moved,
                "seed {seed}: a {what} of {} bytes at {remote_at} of a {:?} target (one of {} \
                 in its batch) ended well but its bytes are not there",
                part.len,
                target.kind,
                r.parts.len()
            );
            self.figures.bytes_verified += part.len;
        }
        let c = r.conn;
        let targets: Vec<usize> = r.parts.iter().map(|p| p.target).collect();
        drop(r);
        for t in targets {
            self.check_revoked(c, t);
        }
    }

    /// Once nothing runs under a target whose grant was revoked: its bytes
    /// are those of the revoke's return; then it is granted again.
    fn check_revoked(&mut self, c: usize, t: usize) {
        if self.runs_under(c, t) {
            return;
        }
        let target = &mut self.conns[c].targets[t];
        let Some(before) = target.at_revoke.take() else {
            return;
        };
        let now = peek(&target.buffer, 0, TARGET);
        assert!(
            now == before,
            "seed {}: bytes of a {:?} target changed after its grant's revoke returned \
             (first at {:?})",
            self.seed,
            target.kind,
            now.iter().zip(&before).position(|(a, b)| a != b)
        );
        if !target.retired {
            let made = grant(&self.conns[c], t);
            self.conns[c].targets[t].grant = made;
        }
    }

    /// Whether a batch in flight moves bytes of target `t` of `c`.
    fn runs_under(&self, c: usize, t: usize) -> bool {
        self.running
            .iter()
            .any(|r| r.conn == c && r.parts.iter().any(|p| p.target == t))
    }

    /// Revokes a grant, most often one with transfers running under it.
    fn revoke(&mut self) {
        let busy: Vec<(usize, usize)> = self
            .running
            .iter()
            .flat_map(|r| r.parts.iter().map(move |p| (r.conn, p.target)))
            .filter(|&(c, t)| self.conns[c].targets[t].grant.is_some())
            .collect();
        let (c, t) = if !busy.is_empty() && self.rng.u32(..4) != 0 {
            busy[self.rng.usize(..busy.len())]
        } else {
            let Some(c) = self.live_conn() else {
                return;
            };
            (c, self.rng.usize(..self.conns[c].targets.len()))
        };
        self.revoke_target(c, t);
    }

    /// Revokes target `t` of connection `c`'s grant, if it has one.
    fn revoke_target(&mut self, c: usize, t: usize) {
        let target = &mut self.conns[c].targets[t];
        let Some((grant, remote)) = target.grant.take() else {
            return;
        };
        self.figures.revokes += 1;
        target.stale = Some(remote);
        match grant.revoke(T) {
            Ok(()) => target.at_revoke = Some(peek(&target.buffer, 0, TARGET)),
            Err(e) => {
                // Unconfirmed (the peer went, a fault): not checked, not
                // granted again.
                self.figures
                    .outcome(format!("revoke: {}", variant_name(&e)));
                target.retired = true;
            }
        }
        self.check_revoked(c, t);
    }

    fn close(&mut self) {
        let Some(c) = self.live_conn() else {
            return;
        };
        self.figures.closes += 1;
        let side = self.rng.usize(..2);
        let conn = &mut self.conns[c];
        if let Some(peers) = &conn.peers {
            let _ = peers[side].close();
        }
        self.drop_conn(c);
    }

    /// Lets go of a connection: its grants (revoked, unconfirmed) and its
    /// peers; the requests under way end on their own.
    fn drop_conn(&mut self, c: usize) {
        let conn = &mut self.conns[c];
        for target in &mut conn.targets {
            target.grant = None;
            target.stale = None;
            target.at_revoke = None;
            target.retired = true;
        }
        conn.peers = None;
        conn.sent = Default::default();
        conn.taken = Default::default();
    }

    fn reconnect(&mut self) {
        let down: Vec<usize> = (0..self.conns.len())
            .filter(|&c| self.conns[c].peers.is_none())
            .collect();
        if down.is_empty() {
            // A peer the engine dropped (a fault, a bound) is down too.
            if let Some(c) = self.live_conn() {
                let gone = self.conns[c]
                    .peers
                    .as_ref()
                    .is_some_and(|p| p.iter().any(|p| p.recv(Duration::ZERO).is_err_and(gone)));
                if gone {
                    self.drop_conn(c);
                }
            }
            return;
        }
        let c = down[self.rng.usize(..down.len())];
        // Its old targets come back only when nothing runs under them.
        if self.running.iter().any(|r| r.conn == c) {
            return;
        }
        let (i, j) = (self.conns[c].i, self.conns[c].j);
        let Some(peers) = connect(&self.nodes, i, j) else {
            self.figures.outcome("reconnect refused");
            return;
        };
        self.figures.reconnects += 1;
        self.conns[c].peers = Some(peers);
        for t in 0..self.conns[c].targets.len() {
            let target = &mut self.conns[c].targets[t];
            target.retired = false;
            target.at_revoke = None;
            target.stale = None;
            let made = grant(&self.conns[c], t);
            self.conns[c].targets[t].grant = made;
        }
    }

    /// One message from one end, and the other end takes what it has.
    fn message(&mut self) {
        let Some(c) = self.live_conn() else {
            return;
        };
        let from = self.rng.usize(..2);
        drop(self.send(c, from, 1));
        self.take(c, 1 - from);
    }

    /// A burst of messages nobody takes yet: the receiving engine holds
    /// them up to its bound, then drops the sender. The burst's messages
    /// have reached the receiving engine's inbox (or been refused) before
    /// the bounds are checked: each send has ended, and the receiver has
    /// made progress until it found nothing more to do, so what a check
    /// sees does not depend on how far its driver thread had come.
    fn burst(&mut self) {
        let Some(c) = self.live_conn() else {
            return;
        };
        let from = self.rng.usize(..2);
        // Half the bursts pass the bound on their own: one that does is
        // what shows an inbox keeping more than it may.
        let bound = LIMITS.max_inbox_messages;
        let n = if self.rng.bool() {
            self.rng.usize(bound + 1..=bound + 8)
        } else {
            self.rng.usize(1..=bound)
        };
        for batch in self.send(c, from, n) {
            let _ = batch.wait(Duration::from_secs(1));
        }
        let to = if from == 0 {
            self.conns[c].j
        } else {
            self.conns[c].i
        };
        let engine = &self.nodes[to].side.engine;
        for _ in 0..1000 {
            if engine.progress() == 0 {
                break;
            }
        }
    }

    /// Sends `n` messages from end `from` of connection `c` (fewer if one
    /// is refused); returns their batches.
    fn send(&mut self, c: usize, from: usize, n: usize) -> Vec<Batch> {
        let mut batches = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.next_message;
            self.next_message += 1;
            let conn = &mut self.conns[c];
            let Some(peers) = &conn.peers else {
                break;
            };
            self.figures.messages += 1;
            match peers[from].send(&id.to_le_bytes()) {
                Ok(batch) => {
                    conn.sent[from].insert(id);
                    batches.push(batch);
                }
                Err(_) => break,
            }
        }
        batches
    }

    fn take(&mut self, c: usize, to: usize) {
        let seed = self.seed;
        let conn = &mut self.conns[c];
        let Some(peers) = &conn.peers else {
            return;
        };
        let from = 1 - to;
        while let Ok(message) = peers[to].recv(Duration::from_millis(2)) {
            let id = u64::from_le_bytes(message.as_slice().try_into().unwrap_or_else(|_| {
                panic!(
                    "seed {seed}: a message of {} bytes nobody sent",
                    message.len()
                )
            }));
            assert!(
                conn.sent[from].contains(&id),
                "seed {seed}: message {id} arrived but was never sent"
            );
            assert!(
                conn.taken[from].insert(id),
                "seed {seed}: message {id} arrived twice"
            );
        }
    }

    fn cancel_one(&mut self) {
        if self.running.is_empty() {
            return;
        }
        let r = &self.running[self.rng.usize(..self.running.len())];
        r.batch.cancel();
    }

    /// What each engine holds for each peer is within the bounds.
    fn check_bounds(&self) {
        for (n, node) in self.nodes.iter().enumerate() {
            for p in node.side.engine.resources().peers {
                let within = p.inbox_messages <= LIMITS.max_inbox_messages
                    && p.inbox_bytes <= LIMITS.max_inbox_bytes
                    && p.remote_grants <= LIMITS.max_remote_grants
                    && p.requests_served <= LIMITS.max_staged_requests;
                assert!(
                    within,
                    "seed {}: n{n} holds more than the bounds for a peer: {p:?}",
                    self.seed
                );
            }
        }
    }

    /// The guard bytes around every grant are as they were made.
    fn check_quiet_targets(&mut self) {
        for c in 0..self.conns.len() {
            for t in 0..self.conns[c].targets.len() {
                self.check_revoked(c, t);
                let target = &self.conns[c].targets[t];
                let before = peek(&target.buffer, 0, GUARD);
                let after = peek(&target.buffer, TARGET - GUARD, GUARD);
                assert!(
                    before == target.guard.0 && after == target.guard.1,
                    "seed {}: bytes outside a {:?} target's grant changed",
                    self.seed,
                    target.kind
                );
            }
        }
    }

    fn check_no_use_after_free(&self) {
        for (n, cuda) in self.cudas.iter().enumerate() {
            for gpu in 0..2 {
                let reports = cuda.use_after_free_reports(gpu);
                assert!(
                    reports.is_empty(),
                    "seed {}: n{n}'s GPU {gpu} memory was used after it was freed: {reports:?}",
                    self.seed
                );
            }
        }
    }

    /// Drops everything and checks nothing is left on the fabric or the
    /// GPUs; adds the fault plan's figures.
    fn finish(self) {
        for (site, calls) in [
            FaultSite::VerbsRegister,
            FaultSite::VerbsRegisterDmabuf,
            FaultSite::VerbsCreateQp,
            FaultSite::VerbsModifyQp,
            FaultSite::VerbsPostSend,
            FaultSite::VerbsPostRecv,
            FaultSite::VerbsCompletion,
            FaultSite::CudaAlloc,
            FaultSite::CudaCopy,
            FaultSite::CudaStreamMemOp,
            FaultSite::CudaExportDmabuf,
            FaultSite::CudaIpcOpen,
        ]
        .map(|s| (s, self.plan.calls(s)))
        {
            *self.figures.calls.entry(format!("{site:?}")).or_insert(0) += calls;
        }
        for fired in self.plan.random_fired() {
            let fault = match &fired.fault {
                Fault::Verbs(e) => format!("{e}"),
                Fault::Cuda(e) => format!("{e}"),
                other => format!("{other:?}"),
            };
            *self
                .figures
                .fired
                .entry(format!("{:?}: {fault}", fired.site))
                .or_insert(0) += fired.fired;
        }
        self.figures.rounds += 1;
        let seed = self.seed;
        let fabric = self.fabric.clone();
        let cudas = self.cudas.clone();
        // What an engine keeps past its end, by design: its stream-fence
        // page (one per engine that fenced or gated, each node's engine on
        // its own simulated process).
        let kept: Vec<u64> = self
            .nodes
            .iter()
            .map(|n| n.side.engine.resources().fence_page_bytes)
            .collect();
        drop(self.running);
        drop(self.conns);
        drop(self.nodes);
        let left = fabric.resources();
        assert!(left.is_empty(), "seed {seed}: the fabric kept {left:?}");
        for (n, cuda) in cudas.iter().enumerate() {
            let left = cuda.resources();
            let rest = CudaResources {
                pinned_bytes: 0,
                ..left
            };
            assert!(
                rest.is_empty() && left.pinned_bytes == kept[n],
                "seed {seed}: n{n}'s GPU kept {left:?} (its fence page: {} bytes)",
                kept[n]
            );
        }
    }
}

fn gone(e: EngineError) -> bool {
    matches!(e, EngineError::PeerGone(_))
}

/// Prints the replay command if the round's thread panics.
struct ReplayHint(u64);

impl Drop for ReplayHint {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "soak: round with seed {0} failed; replay it with\n  \
                 GDR_SOAK_SEED={0} GDR_SOAK_ROUNDS=1 cargo test -p gdr-tests --test sim_soak -- --nocapture",
                self.0
            );
        }
    }
}

#[test]
fn seeded_soak_under_random_faults_keeps_every_promise() {
    let seconds = env_u64("GDR_SOAK_SECONDS").unwrap_or(40);
    let first = env_u64("GDR_SOAK_SEED").unwrap_or(1);
    let rounds = env_u64("GDR_SOAK_ROUNDS").unwrap_or(u64::MAX);
    let scale = std::env::var("GDR_SOAK_RATE")
        .ok()
        .map(|r| r.parse::<f64>().expect("GDR_SOAK_RATE: a number"))
        .unwrap_or(1.0);
    let start = Instant::now();
    let until = start + Duration::from_secs(seconds);
    let mut figures = Figures::default();
    let mut seed = first;
    while Instant::now() < until && figures.rounds < rounds {
        let hint = ReplayHint(seed);
        let mut round = Round::new(seed, scale, &mut figures);
        round.run(until);
        round.finish();
        drop(hint);
        seed += 1;
    }
    let f = &figures;
    eprintln!(
        "soak: {} rounds (seeds {first}..{}), {:.0} s: {} operations, {} transfers, {} bytes \
         verified, {} revokes, {} closes, {} reconnects, {} messages",
        f.rounds,
        seed,
        start.elapsed().as_secs_f64(),
        f.ops,
        f.transfers,
        f.bytes_verified,
        f.revokes,
        f.closes,
        f.reconnects,
        f.messages
    );
    eprintln!("soak outcomes: {:?}", f.outcomes);
    eprintln!("soak time by operation: {:?}", f.time);
    eprintln!("soak calls per site: {:?}", f.calls);
    for (fault, n) in &f.fired {
        eprintln!("soak fired {n:>6}  {fault}");
    }
    assert!(f.rounds > 0, "no round ran");
    assert!(
        f.outcomes.get("ok").copied().unwrap_or(0) > 0,
        "no transfer succeeded: the soak tested nothing"
    );
}
