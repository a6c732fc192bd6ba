//! The peer-copy path: GPU memory of two engines on one host is moved by
//! CUDA device-to-device copies (over NVLink where the GPUs are peers),
//! not through a NIC, as Mooncake's NVLink transport and UCX's `cuda_ipc`
//! do. The API is the NIC path's: [`super::Peer::submit`], the batch's
//! wait, status, `Future`, cancel and [`super::Batch::fence_stream`].
//!
//! # When it is used
//!
//! - Both engines allow it ([`super::EngineConfig::peer_copy`], on by
//!   default) and run on one host: each sends a [`Control::Locality`]
//!   (its CUDA driver's host token, the kernel's boot id, and process
//!   token: [`hal_cuda::Driver::host_token`], [`hal_cuda::Driver::process_token`]) before its paths when the
//!   connection is made; an engine that allows no peer copy sends none,
//!   and its peer then sees it as remote.
//! - A batch goes by peer copy when every transfer has GPU memory on this
//!   side and a grant of GPU memory the path reaches on the other;
//!   otherwise all of it takes the NIC path as before. A batch is not
//!   split between the two (callers mixing both submit two batches).
//! - Requests are checked exactly as on the NIC path (the grant live on
//!   this connection, its rights, its bounds) before any copy is queued:
//!   the requester is the one copying, so it enforces the grant itself.
//!
//! # Capabilities, and the trust boundary
//!
//! No address crosses the wire.
//! - One process (the same process token): the owner publishes each grant
//!   to this peer in a process-wide registry, keyed by (owner engine,
//!   grant) and naming the engine it was granted to, holding the region
//!   weakly; the requester looks it up, and the entry goes when the grant
//!   is revoked. (CUDA refuses to open an IPC handle in the process that
//!   exported it, and there is nothing to open: the address space is
//!   shared.)
//! - Another process of the host: the owner sends, per grant and only to
//!   such a peer, a [`Control::GrantIpc`] with the allocation's CUDA IPC
//!   handle and the grant's offset in it, before announcing the grant. An
//!   IPC handle opens the **whole allocation**, not only the granted
//!   range: turning the path on trusts a peer of the same host with every
//!   allocation it was granted any part of (bounds and rights are
//!   enforced by gdr on the requesting side, not by hardware). A caller
//!   that does not trust local peers that far sets `peer_copy = false`
//!   (or grants from allocations of their own). The requester opens the
//!   handle on its own GPU's context (`cuIpcOpenMemHandle`, lazy peer
//!   access), caches the mapping per handle, and closes it once the grant
//!   is revoked (or the peer is gone) and no copy uses it. CUDA VMM memory
//!   has no legacy IPC handle: its grants take the NIC path.
//!
//! # Copies and completion
//!
//! Each transfer is cut into slices of [`super::EngineConfig::peer_copy_slice`]
//! queued round-robin on a few streams of the local GPU (so several
//! requests and slices are in flight), then an event is recorded on each
//! stream used. The engine's progress (its own thread, started by the first
//! peer copy, or whoever waits) polls the events and completes the batch
//! once, when all have passed. Between two GPUs of one process the engine
//! enables peer access once per pair ([`hal_cuda::Context::enable_peer_access`]).
//! A copy that cannot be queued fails its batch only (after what was
//! queued has run). Copies cannot be recalled once queued, so a batch's
//! slices are queued a *window* at a time (one slice per stream, at most
//! two windows on the GPU: [`gdr_proto::peer_copy::CopyFlight`]), and
//! before each window every grant the batch copies under is checked: a
//! cancel, a deadline or a revoke stops the batch there. A deadline ends it
//! with [`TransferError::Timeout`] at once, a cancel with
//! [`TransferError::Cancelled`] and a revoke with [`TransferError::Revoked`]
//! once the windows already queued have run; the memory (regions, IPC
//! mappings) is held until then. A stream fence needs no GPUDirect flush: a
//! CUDA copy is ordered for kernels.
//!
//! # Revocation
//!
//! The requester copies, so the owner's revoke needs its help:
//! - One process: the registry entry carries a fence the requester's
//!   batches take a use of while anything of theirs is queued; the revoke
//!   marks it, batches stop at their next window, and
//!   [`super::Grant::revoke`] returns once the last use ended. This
//!   holds whatever the requester does: both engines are gdr in one
//!   process.
//! - Another process: a CUDA IPC handle cannot be taken back. The owner
//!   keeps the grant's memory until the importer answers the revoke with a
//!   [`Control::GrantReleased`] (sent once none of its batches has
//!   anything queued under the grant) or until
//!   [`super::EngineConfig::peer_copy_release_timeout`] passes; the revoke
//!   returns `Ok` only on the answer. Only a cooperating peer can be
//!   fenced this way: `peer_copy: false` is the setting for peers not
//!   trusted that far.
//!
//! # The path, and the engine
//!
//! `PeerCopyPath` is the path (`TransferPath`). What it keeps of each
//! peer is the peer's, in the peer's slot under the peer's lock: its
//! protocol state in the peer's connection (`CopyProto`: the flights'
//! windows, our grants exported to it, the releases we owe it, under one
//! deadline with the rest of the connection's), and beside it
//! `PeerCopyPeer` (where it runs, the IPC handles of its grants, each
//! flight's GPU side: its plan, its memory, its events). What it shares
//! among the peers, `PeerCopyShared` (the
//! streams; the IPC mappings, peer access and counters under a lock of
//! their own), is the engine's. It reaches the engine only through its
//! `PathCx`: the GPUs and settings in `Resources`, the peers (engine
//! id, session, gone) and their control channels through the wire. The
//! engine (`engine/mod.rs`) keeps the public calls ([`super::Peer::peer_copy`],
//! [`super::Engine::peer_copy_stats`], the routing in `submit`, the
//! publishing at grant time, a batch's cancel), checks a batch against the
//! peer's grants before `TransferPath::post`, hands the path the
//! control messages, and sends the [`Control::Locality`] it gives.

use std::any::Any;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::Duration;

use gdr_proto::PeerMisbehaved;
use gdr_proto::peer_copy::{CopyFlight, FlightId, PeerCopy, Stop, Windows};

use super::cuda_worker::Pending;
use crate::sync::{Mutex, lock};

use hal_cuda::{Context as _, Driver as _, Event as _, IpcMapping as _, IpcMemHandle, Stream as _};

use super::batches::Keep;
use super::completion::CompletionCell;
use super::events::PooledEvent;
use super::path::{PathCx, TransferPath};
use super::resources::Resources;
use super::wire::Control;
use super::{EngineError, Op, Refusal, Region, TimedOut, Transfer, TransferError};
use crate::descriptor::{GrantRights, MemoryDescriptor, MemoryLocation};

/// Streams of each GPU that peer copies rotate over.
const STREAMS_PER_GPU: usize = 4;
/// Windows of a batch on the GPU at once: two keep it busy while the
/// engine learns that one ended and queues the next.
const WINDOWS_IN_FLIGHT: usize = 2;

/// Where an engine runs: one host when the boot ids match, one address
/// space (process) when the process tokens do too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Locality {
    host: [u8; 16],
    process: u64,
}

impl Locality {
    /// The message that tells a peer.
    pub(super) fn message(&self) -> Control<'static> {
        Control::Locality {
            host: self.host,
            process: self.process,
        }
    }
}

/// How a peer's transfers of GPU memory travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerCopyRoute {
    /// Through the NIC: another host, or the path is off on either side.
    Nic,
    /// Device copies between the two engines' memory in this process.
    SameProcess,
    /// Device copies through the CUDA IPC handles of the peer's grants.
    Ipc,
}

/// What the engine's peer copies have done (for tests and benchmarks to
/// see the route taken).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerCopyStats {
    /// Batches moved by peer copy (counted when their copies have run,
    /// unless one failed).
    pub batches: u64,
    /// Their bytes copied (a batch stopped by a cancel, deadline or
    /// revoke counts what it had queued).
    pub bytes: u64,
    /// Device copies queued (slices).
    pub copies: u64,
}

/// The peer-copy path's part of one peer: in the peer's slot, under the
/// peer's lock, beside the peer's connection, which keeps the protocol
/// state of the path ([`CopyProto`]: the flights' windows, the grants
/// exported to the peer, the releases owed it).
#[derive(Default)]
pub(super) struct PeerCopyPeer {
    /// Where the peer runs, once it said (only if it allows the path).
    remote: Option<Locality>,
    /// The IPC handles of the peer's grants, by grant id.
    ipc: HashMap<u64, IpcGrant>,
    /// This side's batches to the peer with copies on the GPU (each named
    /// in the connection's [`CopyProto`]).
    flights: Vec<Flight>,
}

/// The peer-copy path's protocol state with one peer, in the peer's
/// connection ([`gdr_proto::peer_copy::PeerCopy`]): an export is kept by
/// the memory of its grant.
pub(super) type CopyProto = PeerCopy<Vec<Keep>>;

/// What the path's calls about one peer are handed: its part in the slot
/// and its protocol state, lent by the connection for the call.
pub(super) struct CopyPart<'a> {
    pub(super) copy: &'a mut PeerCopyPeer,
    pub(super) proto: &'a mut CopyProto,
}

impl PeerCopyPeer {
    /// The IPC handles of the peer's grants held here (bounded like its
    /// grants).
    pub(super) fn ipc_handles(&self) -> usize {
        self.ipc.len()
    }

    /// Whether the path has work of the peer's for the engine's pass:
    /// batches on the GPU, releases owed (`proto`: the connection's).
    pub(super) fn has_work(&self, proto: &CopyProto) -> bool {
        !self.flights.is_empty() || !proto.releases().is_empty()
    }

    /// Whether only polling sees the part's work end (GPU copies).
    pub(super) fn polls(&self) -> bool {
        !self.flights.is_empty()
    }
}

struct IpcGrant {
    handle: IpcMemHandle,
    /// Where the grant starts in the allocation.
    offset: u64,
    /// The allocation mapped on a local GPU (the last one used).
    mapping: Option<(u32, Arc<Mapping>)>,
    /// The local GPU its handle did not open on: copies for it there go
    /// by the NIC, not through another (slow, failing) open.
    open_failed: Option<u32>,
}

/// A driver call a peer-copy batch needs before it can be resolved, made
/// outside every lock (each can take long, and whatever waits for the
/// lock would wait for it): what [`PeerCopyPath::driver_steps_wanted`] asks for and
/// [`PeerCopyPath::driver_steps_done`] takes back.
pub(super) enum DriverStep {
    /// A peer's IPC handle to open on local GPU `ordinal`
    /// (`cuIpcOpenMemHandle`).
    IpcOpen {
        ordinal: u32,
        handle: IpcMemHandle,
        /// The mapping, or why it did not open.
        result: Option<Result<Arc<Mapping>, EngineError>>,
    },
    /// Peer access from GPU `local` to GPU `other`
    /// (`cuCtxEnablePeerAccess`), once per pair.
    PeerAccess {
        local: u32,
        other: u32,
        /// Whether it was enabled (`false`: the driver stages the copies).
        result: Option<Result<bool, EngineError>>,
    },
}

impl DriverStep {
    /// Makes the call (no engine lock held).
    pub(super) fn run(&mut self, res: &Resources) {
        match self {
            Self::IpcOpen {
                ordinal,
                handle,
                result,
            } => *result = Some(open_ipc(res, *ordinal, handle)),
            Self::PeerAccess {
                local,
                other,
                result,
            } => *result = Some(enable_gpu_peer_access(res, *local, *other)),
        }
    }
}

/// Opens a peer's IPC `handle` on local GPU `ordinal` (`cuIpcOpenMemHandle`).
fn open_ipc(
    res: &Resources,
    ordinal: u32,
    handle: &IpcMemHandle,
) -> Result<Arc<Mapping>, EngineError> {
    let _span = tracing::debug_span!("peer_copy_ipc_open", ordinal).entered();
    Ok(Arc::new(Mapping {
        mapping: res.gpu(ordinal)?.context.ipc_open(handle)?,
    }))
}

/// Lets GPU `local`'s copies reach GPU `other` (`cuCtxEnablePeerAccess`);
/// `false`: the driver stages them.
fn enable_gpu_peer_access(res: &Resources, local: u32, other: u32) -> Result<bool, EngineError> {
    let l = res.gpu(local)?;
    let o = res.gpu(other)?;
    Ok(l.context.enable_peer_access(&o.context)?)
}

/// The route between an engine at `here` and a peer at `there`.
fn route(here: Option<Locality>, there: Option<Locality>) -> PeerCopyRoute {
    match (here, there) {
        (Some(here), Some(there)) if here.host == there.host => {
            if here.process == there.process {
                PeerCopyRoute::SameProcess
            } else {
                PeerCopyRoute::Ipc
            }
        }
        _ => PeerCopyRoute::Nic,
    }
}

/// Says what came of enabling peer access from GPU `local` to `other`.
fn log_peer_access(local: u32, other: u32, result: &Result<bool, EngineError>) {
    match result {
        Ok(true) => tracing::info!(local, other, "peer access enabled"),
        Ok(false) => tracing::info!(local, other, "no peer access: copies staged by the driver"),
        Err(e) => tracing::warn!(local, other, error = %e, "enabling peer access"),
    }
}

/// Another process's allocation mapped on a local GPU; closed on drop.
pub(super) struct Mapping {
    mapping: hal_cuda::dynamic::DynIpcMapping,
}

/// A batch of copies, queued on the GPU a window at a time.
struct Flight {
    cell: Arc<CompletionCell>,
    /// Its windows, in the connection's [`CopyProto`].
    id: FlightId,
    plan: Vec<Planned>,
    /// The windows handed to the CUDA worker and not yet seen done,
    /// oldest first: once queued there, the events recorded after each
    /// (one per stream it used) and the error that stopped it, if any.
    windows: VecDeque<Pending<QueuedWindow>>,
    /// Why it failed, when a copy could not be queued or ran wrong.
    error: Option<TransferError>,
    timeout: Duration,
    /// Its bytes queued so far (counted in the stats once it drained,
    /// unless a copy failed).
    queued: u64,
    /// The grants it copies under, checked before each window.
    grants: Vec<GrantUse>,
    /// The memory copied from and to, until nothing of it is queued.
    _keep: Vec<Keep>,
}

/// A flight's hold on a grant it copies under.
enum GrantUse {
    /// A use of a same-process grant's fence (ends on drop).
    SameProcess { grant: u64, fence: FenceUse },
    /// A grant of the peer reached through its IPC handle: live while the
    /// handle is.
    Ipc { grant: u64 },
}

impl GrantUse {
    fn grant(&self) -> u64 {
        match *self {
            Self::SameProcess { grant, .. } | Self::Ipc { grant, .. } => grant,
        }
    }
}

/// The revocation fence of a grant published to an engine of this
/// process: the owner marks it revoked; the requester's batches take a use
/// while anything of theirs is queued under it.
#[derive(Debug, Default)]
pub(super) struct CopyFence {
    revoked: AtomicBool,
    uses: AtomicUsize,
    /// The owner's reactor: the last use's end wakes its revoke, which no
    /// fd of the owner's announces.
    owner: Weak<super::reactor::Reactor>,
}

impl CopyFence {
    /// The fence of a grant of the engine whose reactor is `owner`.
    pub(super) fn new(owner: Weak<super::reactor::Reactor>) -> Self {
        Self {
            owner,
            ..Self::default()
        }
    }

    /// No batch queues anything more under the grant.
    fn revoke(&self) {
        self.revoked.store(true, Ordering::SeqCst);
    }

    fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::SeqCst)
    }

    /// Revoked, and no batch has anything queued under it.
    pub(super) fn is_fenced(&self) -> bool {
        self.is_revoked() && self.uses.load(Ordering::SeqCst) == 0
    }
}

/// A batch's use of a [`CopyFence`]; ends on drop.
struct FenceUse(Arc<CopyFence>);

impl FenceUse {
    /// A use, unless the grant is revoked. The count goes up before the
    /// flag is read and the revoke sets the flag before it reads the
    /// count (both sequentially consistent): a revoke that finds no use
    /// is never followed by a use that missed its flag.
    fn take(fence: &Arc<CopyFence>) -> Option<Self> {
        fence.uses.fetch_add(1, Ordering::SeqCst);
        let taken = Self(Arc::clone(fence));
        (!fence.is_revoked()).then_some(taken)
    }
}

impl Drop for FenceUse {
    fn drop(&mut self) {
        // Revoked before the count fell (both sequentially consistent):
        // the revoke either sees no use left when it looks, or is woken
        // here to look again.
        let left = self.0.uses.fetch_sub(1, Ordering::SeqCst) - 1;
        if left == 0
            && self.0.is_revoked()
            && let Some(owner) = self.0.owner.upgrade()
        {
            owner.wake();
        }
    }
}

/// What the peer-copy path shares among the peers (the engine's, beside
/// its lock): where the engine runs, each GPU's streams, and the IPC
/// mappings, peer access and counters of `devices` (its own lock, taken
/// briefly under a peer's and never across a driver call).
pub(super) struct PeerCopyShared {
    /// Where this engine runs; `None`: no CUDA driver, or no boot id.
    here: Option<Locality>,
    /// Each local GPU's streams (made by the CUDA worker at the GPU's
    /// first window).
    streams: Arc<Mutex<HashMap<u32, Vec<hal_cuda::dynamic::DynStream>>>>,
    devices: Mutex<Devices>,
    /// This engine's reactor, which the end of the last copy under a
    /// revoked same-process grant wakes ([`CopyFence`]).
    owner: Weak<super::reactor::Reactor>,
}

/// The peer-copy path's book-keeping of the local GPUs, shared by the
/// peers' batches.
#[derive(Default)]
struct Devices {
    /// The next stream of each GPU a slice goes on.
    next_stream: HashMap<u32, usize>,
    /// Mappings of IPC handles, by (local GPU, handle), shared by grants of
    /// one allocation (of one peer, or of several peers of one process).
    mappings: HashMap<(u32, IpcMemHandle), Weak<Mapping>>,
    /// (local GPU, other GPU) pairs peer access was asked for.
    peer_access: HashSet<(u32, u32)>,
    stats: PeerCopyStats,
}

impl PeerCopyShared {
    /// The state of an engine over CUDA driver `cuda` (none: host memory
    /// only, never a peer copy) waiting with reactor `owner`.
    pub(super) fn new(
        cuda: Option<&hal_cuda::dynamic::DynDriver>,
        owner: Weak<super::reactor::Reactor>,
    ) -> Self {
        Self {
            here: cuda.and_then(|d| {
                Some(Locality {
                    host: d.host_token()?,
                    process: d.process_token(),
                })
            }),
            streams: Arc::default(),
            devices: Mutex::new(Devices::default()),
            owner,
        }
    }

    /// The message that tells a peer where this engine runs (sent before
    /// the paths when the connection is made); `None`: not known here.
    pub(super) fn locality(&self) -> Option<Control<'static>> {
        self.here.map(|here| here.message())
    }

    /// What this engine's peer copies have done.
    pub(super) fn stats(&self) -> PeerCopyStats {
        lock(&self.devices).stats
    }
}

/// The peer-copy path (see the module docs), as one call sees it: what it
/// shares among the peers. Everything else it holds is a peer's
/// ([`PeerCopyPeer`], in the peer's slot).
pub(super) struct PeerCopyPath<'p> {
    pub(super) shared: &'p PeerCopyShared,
}

/// A grant published for a peer engine of this process.
struct Published {
    /// The engine the grant was made to.
    grantee: u64,
    process: u64,
    ordinal: u32,
    addr: u64,
    len: u64,
    rights: GrantRights,
    /// The region (weak: the grant holds it).
    region: Weak<dyn Any + Send + Sync>,
    fence: Arc<CopyFence>,
}

/// Grants of GPU memory published to engines of this process, by (owner
/// engine, grant).
static PUBLISHED: LazyLock<std::sync::Mutex<HashMap<(u64, u64), Published>>> =
    LazyLock::new(Default::default);

fn published() -> std::sync::MutexGuard<'static, HashMap<(u64, u64), Published>> {
    PUBLISHED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A grant's entry in the process-wide registry, removed on drop (with
/// the grant). Holds the region, so the memory stays while it is granted.
pub(super) struct Publication {
    key: (u64, u64),
    pub(super) fence: Arc<CopyFence>,
    _region: Keep,
}

impl Drop for Publication {
    fn drop(&mut self) {
        // Batches under way stop at their next window; the region stays
        // held by theirs until they drained.
        self.fence.revoke();
        published().remove(&self.key);
    }
}

/// One transfer resolved to device addresses.
struct Planned {
    op: Op,
    ordinal: u32,
    local: u64,
    remote: u64,
}

/// What a batch holds while it resolves: the memory it copies from and to,
/// and the grants it copies under.
#[derive(Default)]
struct Held {
    keep: Vec<Keep>,
    grants: Vec<GrantUse>,
}

impl PeerCopyPath<'_> {
    /// How the peer's transfers of GPU memory travel (its part: `peer`),
    /// as far as the path knows (the engine adds the setting and whether
    /// the peer is gone).
    pub(super) fn route(&self, peer: &PeerCopyPeer) -> PeerCopyRoute {
        route(self.shared.here, peer.remote)
    }

    /// [`PeerCopyPath::route`] to the peer in `slot` as the wire sees it:
    /// the NIC when the path is off here or the peer is closed or gone.
    fn route_to(&self, cx: &PathCx<'_>, slot: usize, peer: &PeerCopyPeer) -> PeerCopyRoute {
        match cx.wire.peer(slot) {
            Some(view) if cx.res.config.peer_copy && view.gone.is_none() => self.route(peer),
            _ => PeerCopyRoute::Nic,
        }
    }

    /// Makes a new grant of GPU memory reachable by peer copy for the peer
    /// in `slot` (its part: `peer`): published in the registry for a peer
    /// of this process, its IPC handle sent to a peer of another process
    /// of this host (before the announcement). Anything else, or any
    /// failure (VMM memory has no IPC handle), leaves the grant to the NIC
    /// path.
    pub(super) fn publish(
        &mut self,
        cx: &mut PathCx<'_>,
        slot: usize,
        part: &mut CopyPart<'_>,
        region: &Region,
        offset: u64,
        descriptor: &MemoryDescriptor,
    ) -> Option<Publication> {
        let MemoryLocation::Gpu { ordinal } = region.inner.location else {
            return None;
        };
        let ordinal = u32::from(ordinal);
        let addr = region.inner.addr + offset;
        match self.route_to(cx, slot, part.copy) {
            PeerCopyRoute::Nic => None,
            PeerCopyRoute::SameProcess => {
                let here = self.shared.here?;
                let key = (cx.res.id, descriptor.grant);
                let keep: Keep = Arc::clone(&region.inner) as Keep;
                let fence = Arc::new(CopyFence::new(self.shared.owner.clone()));
                published().insert(
                    key,
                    Published {
                        grantee: cx.wire.peer(slot).map_or(0, |p| p.engine),
                        process: here.process,
                        ordinal,
                        addr,
                        len: descriptor.len,
                        rights: descriptor.rights,
                        region: Arc::downgrade(&keep),
                        fence: Arc::clone(&fence),
                    },
                );
                Some(Publication {
                    key,
                    fence,
                    _region: keep,
                })
            }
            PeerCopyRoute::Ipc => {
                let _span =
                    tracing::debug_span!("peer_copy_export", grant = descriptor.grant).entered();
                let exported = cx.res.gpu(ordinal).and_then(|gpu| {
                    let handle = gpu.context.ipc_export(addr)?;
                    let base = gpu.context.pointer_attributes(addr)?.allocation_base;
                    Ok((handle, addr - base))
                });
                match exported {
                    Ok((handle, offset)) => {
                        let message = Control::GrantIpc {
                            grant: descriptor.grant,
                            offset,
                            handle: handle.0,
                        };
                        match cx.wire.send(slot, &message, cx.res.config.default_timeout) {
                            // Held until the importer releases it (after
                            // the revoke) or the bound passes.
                            Ok(_) => {
                                let keep: Keep = Arc::clone(&region.inner) as Keep;
                                let session = cx.wire.peer(slot).map_or(0, |p| p.session);
                                part.proto
                                    .exports_mut()
                                    .export(descriptor.grant, session, vec![keep]);
                            }
                            Err(e) => {
                                tracing::debug!(error = %e, "no IPC handle sent: the NIC path")
                            }
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "no IPC handle: the NIC path"),
                }
                None
            }
        }
    }

    /// The device address of `t`'s remote range as seen from GPU
    /// `ordinal` over `route`; `None`: the path does not reach it (another
    /// path takes the batch). With `held` (posting), the batch takes what
    /// it copies under; without (asking whether the path carries it),
    /// nothing is taken beyond the cached IPC mapping.
    fn resolve(
        &self,
        res: &Resources,
        peer: &mut PeerCopyPeer,
        route: PeerCopyRoute,
        t: &Transfer<'_>,
        held: Option<&mut Held>,
    ) -> Result<Option<(u32, u64)>, EngineError> {
        let MemoryLocation::Gpu { ordinal } = t.local.inner.location else {
            return Ok(None);
        };
        if !matches!(t.remote.location, MemoryLocation::Gpu { .. }) {
            return Ok(None);
        }
        let ordinal = u32::from(ordinal);
        let remote = match route {
            PeerCopyRoute::Nic => None,
            PeerCopyRoute::SameProcess => self.published_remote(res, t, ordinal, held)?,
            PeerCopyRoute::Ipc => match held {
                Some(held) => {
                    let remote = self.mapped_remote(res, peer, t, ordinal, Some(&mut held.keep))?;
                    let grant = t.remote.grant;
                    if remote.is_some() && !held.grants.iter().any(|g| g.grant() == grant) {
                        held.grants.push(GrantUse::Ipc { grant });
                    }
                    remote
                }
                None => self.mapped_remote(res, peer, t, ordinal, None)?,
            },
        };
        Ok(remote.map(|remote| (ordinal, remote)))
    }

    /// The device address of `t`'s remote range through the registry (a
    /// peer engine of this process); `None`: not published to us. With
    /// `held`, the owner's region and a use of the grant's fence go there
    /// and peer access is enabled.
    fn published_remote(
        &self,
        res: &Resources,
        t: &Transfer<'_>,
        ordinal: u32,
        held: Option<&mut Held>,
    ) -> Result<Option<u64>, EngineError> {
        let d = t.remote;
        let (addr, owner_gpu, region, fence) = {
            let registry = published();
            let Some(entry) = registry.get(&(d.owner, d.grant)) else {
                return Ok(None);
            };
            let ours = self.shared.here.map(|h| h.process);
            if entry.grantee != res.id
                || Some(entry.process) != ours
                || entry.len != d.len
                || entry.rights != d.rights
            {
                return Ok(None);
            }
            let Some(region) = entry.region.upgrade() else {
                return Ok(None);
            };
            super::check_within("remote grant", t.remote_offset, t.len, entry.len)?;
            (entry.addr, entry.ordinal, region, Arc::clone(&entry.fence))
        };
        // Revoked since it was looked up: refused as the NIC path refuses
        // a revoked grant.
        let revoked = || EngineError::Refused(Refusal::GrantRevoked { grant: d.grant });
        let Some(held) = held else {
            return match fence.is_revoked() {
                true => Err(revoked()),
                false => Ok(Some(addr + t.remote_offset)),
            };
        };
        if !held.grants.iter().any(|g| g.grant() == d.grant) {
            let Some(fence) = FenceUse::take(&fence) else {
                return Err(revoked());
            };
            held.grants.push(GrantUse::SameProcess {
                grant: d.grant,
                fence,
            });
        }
        held.keep.push(region);
        self.enable_peer_access(res, ordinal, owner_gpu);
        Ok(Some(addr + t.remote_offset))
    }

    /// Lets GPU `local`'s copies reach GPU `other` directly, once per pair
    /// (asked for before the batch, outside the locks, as a driver step:
    /// this is the call for a pair that step missed).
    fn enable_peer_access(&self, res: &Resources, local: u32, other: u32) {
        if local == other || !lock(&self.shared.devices).peer_access.insert((local, other)) {
            return;
        }
        log_peer_access(local, other, &enable_gpu_peer_access(res, local, other));
    }

    /// The device address of `t`'s remote range through the peer's IPC
    /// handle, mapped on GPU `ordinal` (cached), the mapping held in
    /// `keep` when given; `None`: no handle for the grant, or it does not
    /// open.
    fn mapped_remote(
        &self,
        res: &Resources,
        peer: &mut PeerCopyPeer,
        t: &Transfer<'_>,
        ordinal: u32,
        keep: Option<&mut Vec<Keep>>,
    ) -> Result<Option<u64>, EngineError> {
        let d = t.remote;
        let Some(grant) = peer.ipc.get_mut(&d.grant) else {
            return Ok(None);
        };
        let (handle, offset) = (grant.handle, grant.offset);
        if grant.open_failed == Some(ordinal) {
            return Ok(None);
        }
        let mapping = match &grant.mapping {
            Some((gpu, mapping)) if *gpu == ordinal => Arc::clone(mapping),
            _ => match self.open_mapping(res, ordinal, &handle) {
                Ok(mapping) => {
                    grant.mapping = Some((ordinal, Arc::clone(&mapping)));
                    mapping
                }
                Err(e) => {
                    tracing::warn!(grant = d.grant, error = %e, "opening a peer's IPC handle: the NIC path");
                    return Ok(None);
                }
            },
        };
        // The peer names the offset; the mapping bounds it: nothing
        // outside the allocation it exported is ever touched.
        let size = mapping.mapping.len() as u64;
        let end = offset.checked_add(d.len);
        if end.is_none_or(|end| end > size) {
            return Err(EngineError::Refused(Refusal::GrantOutsideAllocation {
                grant: d.grant,
                offset,
                len: d.len,
                size,
            }));
        }
        let addr = mapping.mapping.device_ptr() + offset + t.remote_offset;
        if let Some(keep) = keep {
            keep.push(mapping as Keep);
        }
        Ok(Some(addr))
    }

    /// The driver calls `transfers` to the peer (its part: `peer`) need
    /// first and that were not made yet: IPC handles to open on their
    /// local GPUs, peer access between two GPUs of this process. The
    /// engine makes them outside every lock ([`DriverStep::run`]) and
    /// hands them back ([`PeerCopyPath::driver_steps_done`]) before it
    /// resolves the batch.
    pub(super) fn driver_steps_wanted(
        &self,
        peer: &PeerCopyPeer,
        transfers: &[Transfer<'_>],
    ) -> Vec<DriverStep> {
        let mut wanted: Vec<DriverStep> = Vec::new();
        let gpus = transfers.iter().filter_map(|t| match t.local.inner.location {
            MemoryLocation::Gpu { ordinal } => Some((t, u32::from(ordinal))),
            MemoryLocation::Host => None,
        });
        match self.route(peer) {
            PeerCopyRoute::Nic => {}
            PeerCopyRoute::SameProcess => {
                let registry = published();
                let devices = lock(&self.shared.devices);
                for (t, local) in gpus {
                    let Some(entry) = registry.get(&(t.remote.owner, t.remote.grant)) else {
                        continue;
                    };
                    let other = entry.ordinal;
                    let asked = wanted.iter().any(|w| {
                        matches!(w, DriverStep::PeerAccess { local: l, other: o, .. } if (*l, *o) == (local, other))
                    });
                    if local != other && !asked && !devices.peer_access.contains(&(local, other)) {
                        wanted.push(DriverStep::PeerAccess {
                            local,
                            other,
                            result: None,
                        });
                    }
                }
            }
            PeerCopyRoute::Ipc => self.ipc_opens_wanted(peer, gpus, &mut wanted),
        }
        wanted
    }

    /// The IPC handles of [`PeerCopyPath::driver_steps_wanted`].
    fn ipc_opens_wanted<'t>(
        &self,
        peer: &PeerCopyPeer,
        gpus: impl Iterator<Item = (&'t Transfer<'t>, u32)>,
        wanted: &mut Vec<DriverStep>,
    ) {
        let devices = lock(&self.shared.devices);
        for (t, ordinal) in gpus {
            let Some(grant) = peer.ipc.get(&t.remote.grant) else {
                continue;
            };
            let mapped = matches!(&grant.mapping, Some((gpu, _)) if *gpu == ordinal)
                || devices
                    .mappings
                    .get(&(ordinal, grant.handle))
                    .is_some_and(|m| m.strong_count() > 0);
            let asked = wanted.iter().any(|w| {
                matches!(w, DriverStep::IpcOpen { ordinal: o, handle, .. } if *o == ordinal && *handle == grant.handle)
            });
            if !mapped && !asked && grant.open_failed != Some(ordinal) {
                wanted.push(DriverStep::IpcOpen {
                    ordinal,
                    handle: grant.handle,
                    result: None,
                });
            }
        }
    }

    /// Takes back the driver calls made for the peer (its part: `peer`)
    /// outside the locks. An opened mapping is cached for the grants of
    /// its handle (the caller holds it until its batch is posted); a
    /// handle that did not open is not tried again on that GPU (those
    /// grants' copies there go by the NIC). Peer access is asked once per
    /// pair, whatever came of it.
    pub(super) fn driver_steps_done(&self, peer: &mut PeerCopyPeer, steps: &[DriverStep]) {
        for step in steps {
            match step {
                DriverStep::IpcOpen {
                    ordinal,
                    handle,
                    result: Some(Ok(mapping)),
                } => self.cache_mapping(*ordinal, *handle, mapping),
                DriverStep::IpcOpen {
                    ordinal,
                    handle,
                    result: Some(Err(e)),
                } => {
                    tracing::warn!(ordinal, error = %e, "opening a peer's IPC handle: the NIC path");
                    for grant in peer.ipc.values_mut() {
                        if grant.handle == *handle {
                            grant.open_failed = Some(*ordinal);
                        }
                    }
                }
                DriverStep::PeerAccess {
                    local,
                    other,
                    result: Some(result),
                } => {
                    if lock(&self.shared.devices).peer_access.insert((*local, *other)) {
                        log_peer_access(*local, *other, result);
                    }
                }
                DriverStep::IpcOpen { result: None, .. }
                | DriverStep::PeerAccess { result: None, .. } => {}
            }
        }
    }

    /// The mapping of `handle` on GPU `ordinal`: the cached one while any
    /// grant or copy holds it, else newly opened (outside the devices'
    /// lock; the driver steps opened it before the batch unless another
    /// batch let it go since).
    fn open_mapping(
        &self,
        res: &Resources,
        ordinal: u32,
        handle: &IpcMemHandle,
    ) -> Result<Arc<Mapping>, EngineError> {
        let cached = lock(&self.shared.devices)
            .mappings
            .get(&(ordinal, *handle))
            .and_then(Weak::upgrade);
        if let Some(mapping) = cached {
            return Ok(mapping);
        }
        let mapping = open_ipc(res, ordinal, handle)?;
        self.cache_mapping(ordinal, *handle, &mapping);
        Ok(mapping)
    }

    /// Keeps `mapping` of `handle` on GPU `ordinal` findable while anything
    /// holds it (the entries nothing holds any more go).
    fn cache_mapping(&self, ordinal: u32, handle: IpcMemHandle, mapping: &Arc<Mapping>) {
        let mut devices = lock(&self.shared.devices);
        devices.mappings.retain(|_, m| m.strong_count() > 0);
        devices
            .mappings
            .insert((ordinal, handle), Arc::downgrade(mapping));
    }

    /// Hands the windows `flight` may have on the GPU now to the CUDA
    /// worker: each window's slices over the local GPUs' streams
    /// (round-robin), then an event on each stream it used.
    fn queue_windows(&self, res: &Resources, flight: &mut Flight, proto: &mut CopyFlight) {
        while let Some(window) = proto.poll_window() {
            let mut copies = Vec::with_capacity(window.len());
            {
                let mut devices = lock(&self.shared.devices);
                for slice in &window {
                    let p = &flight.plan[slice.transfer];
                    let (dst, src) = match p.op {
                        Op::Write => (p.remote + slice.offset, p.local + slice.offset),
                        Op::Read => (p.local + slice.offset, p.remote + slice.offset),
                    };
                    let next = devices.next_stream.entry(p.ordinal).or_insert(0);
                    let index = *next;
                    *next = (index + 1) % STREAMS_PER_GPU;
                    copies.push(WindowCopy {
                        ordinal: p.ordinal,
                        stream: index,
                        dst,
                        src,
                        len: slice.len,
                    });
                    devices.stats.copies += 1;
                    flight.queued += slice.len;
                }
            }
            let streams = Arc::clone(&self.shared.streams);
            flight.windows.push_back(
                res.cuda
                    .run(res, move |res| queue_window(res, &streams, &copies)),
            );
        }
    }
}

/// One copy of a window: on stream `stream` of GPU `ordinal`.
struct WindowCopy {
    ordinal: u32,
    stream: usize,
    dst: u64,
    src: u64,
    len: u64,
}

/// A window as the CUDA worker queued it: the events recorded after its
/// copies (one per stream used; empty where the streams were synchronized
/// instead) and the error that stopped it, if any.
struct QueuedWindow {
    events: Vec<PooledEvent>,
    error: Option<TransferError>,
}

/// Queues one window's copies (on the CUDA worker) and records an event
/// on each stream they used; a copy that cannot be queued stops the
/// window (what was queued still drains).
fn queue_window(
    res: &Resources,
    streams: &Mutex<HashMap<u32, Vec<hal_cuda::dynamic::DynStream>>>,
    copies: &[WindowCopy],
) -> QueuedWindow {
    use std::collections::hash_map::Entry;
    let mut streams = lock(streams);
    let mut used: Vec<(u32, usize)> = Vec::new();
    let mut error = None;
    for copy in copies {
        let stream = match streams.entry(copy.ordinal) {
            Entry::Occupied(entry) => Ok(entry.into_mut()),
            Entry::Vacant(vacant) => res.gpu(copy.ordinal).and_then(|gpu| {
                let made = (0..STREAMS_PER_GPU)
                    .map(|_| gpu.context.create_stream())
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(vacant.insert(made))
            }),
        }
        .map(|s| &s[copy.stream]);
        let copied = stream.and_then(|stream| {
            // SAFETY: both ranges were checked to lie in device memory
            // the batch holds (the local region, and the owner's region
            // or the IPC mapping, in the flight's `_keep`) until the
            // events recorded after these copies have passed (the flight
            // is not dropped before this window is seen done); the grant
            // was live when this window was handed over (checked by
            // `progress`).
            unsafe { stream.copy_device_to_device(copy.dst, copy.src, copy.len as usize) }?;
            Ok(())
        });
        match copied {
            Ok(()) => {
                if !used.contains(&(copy.ordinal, copy.stream)) {
                    used.push((copy.ordinal, copy.stream));
                }
            }
            Err(e) => {
                error = Some(TransferError::from_engine("a peer copy", e));
                break;
            }
        }
    }
    let mut events = Vec::with_capacity(used.len());
    for (ordinal, index) in used {
        let Some(stream) = streams.get(&ordinal).map(|s| &s[index]) else {
            continue;
        };
        let recorded = res.gpu(ordinal).and_then(|gpu| {
            let event = res.events.take(gpu)?;
            stream.record(&event)?;
            Ok(event)
        });
        match recorded {
            Ok(event) => events.push(event),
            Err(e) => {
                // Without an event, wait for the stream here: the
                // memory must outlive the copies queued on it.
                if let Err(e) = stream.synchronize() {
                    tracing::warn!(error = %e, "synchronizing a peer-copy stream");
                }
                error.get_or_insert(TransferError::from_engine(
                    "recording a peer copy's event",
                    e,
                ));
            }
        }
    }
    QueuedWindow { events, error }
}

/// Sends the releases the peer in `slot` (its part: `part`) is owed for
/// its revoked grants no batch of ours has anything queued under.
fn send_releases(cx: &mut PathCx<'_>, slot: usize, part: &mut CopyPart<'_>) {
    let flights = &part.copy.flights;
    let ready = part.proto.releases_mut().poll_release(|_, grant| {
        flights.iter().any(|f| {
            f.grants
                .iter()
                .any(|g| matches!(g, GrantUse::Ipc { grant: g } if *g == grant))
        })
    });
    if cx.wire.peer(slot).is_none() {
        return;
    }
    for (_, grant) in ready {
        let message = Control::GrantReleased { grant };
        if let Err(e) = cx.wire.send(slot, &message, cx.res.config.default_timeout) {
            tracing::debug!(grant, error = %e, "a grant release not sent");
        }
    }
}

impl TransferPath for PeerCopyPath<'_> {
    type Peer<'a> = CopyPart<'a>;

    /// Every transfer has GPU memory on this side and a grant of GPU
    /// memory the path reaches on the other: published to us (a peer of
    /// this process) or whose IPC handle the peer sent and that opens here
    /// (the mapping is opened, and cached, to know). The first transfer
    /// the path would refuse (a revoked grant, a range outside the
    /// exported allocation) ends the question: [`TransferPath::post`]
    /// refuses the batch.
    fn carries(
        &mut self,
        res: &Resources,
        _slot: usize,
        part: &mut CopyPart<'_>,
        transfers: &[Transfer<'_>],
    ) -> bool {
        if !res.config.peer_copy || transfers.is_empty() {
            return false;
        }
        let peer = &mut *part.copy;
        let route = self.route(peer);
        if route == PeerCopyRoute::Nic {
            return false;
        }
        for t in transfers {
            match self.resolve(res, peer, route, t, None) {
                Ok(Some(_)) => {}
                Ok(None) => return false,
                Err(_) => return true,
            }
        }
        true
    }

    /// Resolves each transfer to device addresses (holding the memory and
    /// the grants it copies under) and queues the batch's first windows.
    /// The engine checked the transfers against the peer's grants first.
    fn post(
        &mut self,
        cx: &mut PathCx<'_>,
        _slot: usize,
        part: &mut CopyPart<'_>,
        transfers: &[Transfer<'_>],
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError> {
        let peer = &mut *part.copy;
        let route = self.route(peer);
        let _span =
            tracing::debug_span!("peer_copy_submit", transfers = transfers.len(), ?route).entered();
        let mut plan = Vec::with_capacity(transfers.len());
        let mut lens = Vec::with_capacity(transfers.len());
        let mut held = Held::default();
        for t in transfers {
            let Some((ordinal, remote)) = self.resolve(cx.res, peer, route, t, Some(&mut held))?
            else {
                // `carries` said yes under this lock: only the owner
                // revoking the grant since (in its own engine) gets here.
                return Err(EngineError::Refused(Refusal::NotPeerCopyReachable {
                    grant: t.remote.grant,
                }));
            };
            held.keep.push(Arc::clone(&t.local.inner) as Keep);
            plan.push(Planned {
                op: t.op,
                ordinal,
                local: t.local.inner.addr + t.local_offset,
                remote,
            });
            lens.push(t.len);
        }
        let cell = Arc::new(CompletionCell::new());
        let deadline = cx.now.checked_add(timeout);
        let windows = Windows {
            slice: cx.res.config.peer_copy_slice,
            slices: STREAMS_PER_GPU,
            in_flight: WINDOWS_IN_FLIGHT,
        };
        let mut proto = CopyFlight::new(lens, windows, deadline);
        let mut flight = Flight {
            cell: Arc::clone(&cell),
            id: 0,
            plan,
            windows: VecDeque::new(),
            error: None,
            timeout,
            queued: 0,
            grants: held.grants,
            _keep: held.keep,
        };
        self.queue_windows(cx.res, &mut flight, &mut proto);
        flight.id = part.proto.start(proto);
        peer.flights.push(flight);
        Ok(cell)
    }

    /// Moves the peer's batches on: retires their windows that ran, stops
    /// those whose grant was revoked (or whose deadline passed, or that
    /// were cancelled), queues their next windows, and ends each batch
    /// once; drops the peer's IPC handles once it is gone; gives up on our
    /// exported grants' releases past their bound; sends the releases we
    /// owe. Returns how many batches ended.
    fn progress_peer(&mut self, cx: &mut PathCx<'_>, slot: usize, part: &mut CopyPart<'_>) -> usize {
        // A gone peer's handles go (their mappings once no copy uses them).
        if cx.wire.peer(slot).is_none_or(|view| view.gone.is_some()) {
            part.copy.ipc.clear();
        }
        let CopyPart { copy, proto } = part;
        let PeerCopyPeer { ipc, flights, .. } = &mut **copy;
        if flights.is_empty() && proto.releases().is_empty() {
            return 0;
        }
        let mut ended = 0;
        flights.retain_mut(|flight| {
            let Some(windows) = proto.flight_mut(flight.id) else {
                return false;
            };
            // The windows that ran.
            while let Some(window) = flight.windows.front() {
                // Not yet queued by the CUDA worker.
                let Some(queued) = window.get() else { break };
                if let Some(e) = &queued.error
                    && flight.error.is_none()
                {
                    flight.error = Some(e.clone());
                    windows.stop(Stop::Failed);
                }
                let mut pending = false;
                for event in &queued.events {
                    match event.is_complete() {
                        Ok(true) => {}
                        Ok(false) => pending = true,
                        Err(e) => {
                            flight.error.get_or_insert(TransferError::Gpu {
                                what: "a peer copy",
                                source: e,
                            });
                            windows.stop(Stop::Failed);
                        }
                    }
                }
                if pending {
                    break;
                }
                flight.windows.pop_front();
                windows.window_done();
            }
            // The grants, before anything more is queued under them (its
            // deadline was the connection's to handle).
            for grant in &flight.grants {
                let live = match grant {
                    GrantUse::SameProcess { fence, .. } => !fence.0.is_revoked(),
                    GrantUse::Ipc { grant } => ipc.contains_key(grant),
                };
                if !live {
                    windows.stop(Stop::Revoked {
                        grant: grant.grant(),
                    });
                }
            }
            self.queue_windows(cx.res, flight, windows);
            if windows.is_drained() && windows.stopped() != Some(Stop::Failed) {
                // Counted once (a drained flight is dropped below), and
                // before its outcome: a caller woken by it sees it counted.
                let mut devices = lock(&self.shared.devices);
                devices.stats.batches += 1;
                devices.stats.bytes += flight.queued;
            }
            if let Some(outcome) = windows.poll_outcome() {
                let outcome = match outcome {
                    Ok(()) => Ok(()),
                    Err(Stop::TimedOut) => Err(TransferError::Timeout(TimedOut {
                        after: flight.timeout,
                    })),
                    Err(Stop::Cancelled) => Err(TransferError::Cancelled),
                    Err(Stop::Revoked { grant }) => Err(TransferError::Revoked { grant }),
                    Err(Stop::Failed) => {
                        Err(flight.error.take().unwrap_or(TransferError::Internal {
                            what: "a peer copy failed",
                        }))
                    }
                };
                if flight.cell.complete(outcome) {
                    ended += 1;
                }
            }
            let kept = !windows.is_drained();
            if !kept {
                proto.finish(flight.id);
            }
            kept
        });
        send_releases(cx, slot, part);
        ended
    }

    /// Takes where the peer runs, the IPC handles of its grants and its
    /// releases of ours; notes its revokes (the release we owe) and hands
    /// them back, with every other message. The IPC handles a peer sent
    /// and has not revoked are bounded by its live grants' bound: one
    /// more, and the peer misbehaves.
    fn on_control<'m>(
        &mut self,
        cx: &mut PathCx<'_>,
        slot: usize,
        part: &mut CopyPart<'_>,
        message: Control<'m>,
    ) -> Result<Option<Control<'m>>, PeerMisbehaved> {
        let peer = &mut *part.copy;
        match message {
            Control::Locality { host, process } => {
                peer.remote = Some(Locality { host, process });
                Ok(None)
            }
            Control::GrantIpc {
                grant,
                offset,
                handle,
            } => {
                let max_handles = cx.res.config.peer_limits.max_remote_grants;
                let ipc = &mut peer.ipc;
                if ipc.len() >= max_handles && !ipc.contains_key(&grant) {
                    return Err(PeerMisbehaved::TooManyGrants { max: max_handles });
                }
                ipc.insert(
                    grant,
                    IpcGrant {
                        handle: IpcMemHandle(handle),
                        offset,
                        mapping: None,
                        open_failed: None,
                    },
                );
                Ok(None)
            }
            // The peer revoked a grant: its handle goes (the mapping once
            // no copy uses it) and we owe a release once none of our
            // batches has anything queued under it. The engine's record of
            // the grant goes too: handed back.
            Control::GrantRevoke { grant } => {
                if peer.ipc.remove(&grant).is_some() {
                    part.proto.releases_mut().owe(slot as u64, grant);
                    // At once where no batch copies under it: before the
                    // peer's next message is taken.
                    send_releases(cx, slot, part);
                }
                Ok(Some(message))
            }
            // The importer of one of our revoked grants released it.
            Control::GrantReleased { grant } => {
                if let Some(view) = cx.wire.peer(slot)
                    && part
                        .proto
                        .exports_mut()
                        .on_released(grant, view.session)
                        .is_some()
                {
                    tracing::debug!(grant, "the importer released a revoked grant");
                }
                Ok(None)
            }
            other => Ok(Some(other)),
        }
    }

    /// The batches are the peers': [`TransferPath::cancel_peer`] stops them.
    fn cancel(&mut self, cells: &[Arc<CompletionCell>]) -> Vec<Arc<CompletionCell>> {
        cells.to_vec()
    }

    /// Stops the peer's batches of `cells`: they queue nothing more and
    /// end [`TransferError::Cancelled`] once their queued copies have run.
    fn cancel_peer(&mut self, part: &mut CopyPart<'_>, cells: &[Arc<CompletionCell>]) {
        for flight in &part.copy.flights {
            if cells.iter().any(|cell| Arc::ptr_eq(&flight.cell, cell))
                && let Some(windows) = part.proto.flight_mut(flight.id)
            {
                windows.stop(Stop::Cancelled);
            }
        }
    }

    /// Drops the peer's IPC handles (its batches stop at their next
    /// window; the mappings close once no copy uses them) and the releases
    /// owed to it (it can take none); [`TransferPath::progress_peer`] does
    /// the same for a peer it finds gone.
    fn release_peer(&mut self, _cx: &mut PathCx<'_>, slot: usize, part: &mut CopyPart<'_>) {
        part.copy.ipc.clear();
        part.proto.releases_mut().forget(slot as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_route_follows_host_and_process() {
        let at = |host: u8, process: u64| {
            Some(Locality {
                host: [host; 16],
                process,
            })
        };
        assert_eq!(route(at(1, 7), None), PeerCopyRoute::Nic, "not told");
        assert_eq!(
            route(at(1, 7), at(2, 7)),
            PeerCopyRoute::Nic,
            "another host"
        );
        assert_eq!(route(at(1, 7), at(1, 8)), PeerCopyRoute::Ipc);
        assert_eq!(route(at(1, 7), at(1, 7)), PeerCopyRoute::SameProcess);
        assert_eq!(route(None, at(1, 7)), PeerCopyRoute::Nic, "no boot id here");
    }
}
