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
//!   [`super::RegionGrant::revoke`] returns once the last use ended. This
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

use std::any::Any;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::{Duration, Instant};

use gdr_proto::PeerMisbehaved;
use gdr_proto::peer_copy::{CopyFlight, Exports, Releases, Slice, Stop, Windows};

use hal_cuda::{Context as _, Event as _, IpcMapping as _, IpcMemHandle, Stream as _};
use hal_verbs::Api;

use super::completion::CompletionCell;
use super::core::Keep;
use super::wire::Control;
use super::{Batch, Engine, EngineError, Op, Peer, Region, State, Transfer, TransferError};
use crate::descriptor::{GrantRights, MemoryDescriptor, MemoryLocation};
use crate::sync::lock;

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

/// What the peer-copy path knows of one peer (in [`Copies`], by the
/// peer's slot: the path owns it, not the peer's state).
struct PeerLink<C: hal_cuda::Api> {
    /// Where the peer runs, once it said (only if it allows the path).
    remote: Option<Locality>,
    /// The IPC handles of the peer's grants, by grant id.
    ipc: HashMap<u64, IpcGrant<C>>,
}

impl<C: hal_cuda::Api> Default for PeerLink<C> {
    fn default() -> Self {
        Self {
            remote: None,
            ipc: HashMap::new(),
        }
    }
}

struct IpcGrant<C: hal_cuda::Api> {
    handle: IpcMemHandle,
    /// Where the grant starts in the allocation.
    offset: u64,
    /// The allocation mapped on a local GPU (the last one used).
    mapping: Option<(u32, Arc<Mapping<C>>)>,
}

impl<C: hal_cuda::Api> Copies<C> {
    /// Takes the control messages of the peer in `slot` (connection
    /// `session`) that concern this path; the others change nothing here.
    /// The IPC handles a peer sent and has not revoked are bounded by
    /// `max_handles` (its live grants' bound): one more, and the peer
    /// misbehaves.
    pub(super) fn on_control(
        &mut self,
        slot: usize,
        session: u64,
        message: &Control<'_>,
        max_handles: usize,
    ) -> Result<(), PeerMisbehaved> {
        match *message {
            Control::Locality { host, process } => {
                self.links.entry(slot).or_default().remote = Some(Locality { host, process });
            }
            Control::GrantIpc {
                grant,
                offset,
                handle,
            } => {
                let ipc = &mut self.links.entry(slot).or_default().ipc;
                if ipc.len() >= max_handles && !ipc.contains_key(&grant) {
                    return Err(PeerMisbehaved::TooManyGrants { max: max_handles });
                }
                ipc.insert(
                    grant,
                    IpcGrant {
                        handle: IpcMemHandle(handle),
                        offset,
                        mapping: None,
                    },
                );
            }
            // The peer revoked a grant: its handle goes (the mapping once
            // no copy uses it) and we owe a release once none of our
            // batches has anything queued under it.
            Control::GrantRevoke { grant } => {
                if let Some(link) = self.links.get_mut(&slot)
                    && link.ipc.remove(&grant).is_some()
                {
                    self.releases.owe(slot as u64, grant);
                }
            }
            // The importer of one of our revoked grants released it.
            Control::GrantReleased { grant }
                if self.exports.on_released(grant, session).is_some() =>
            {
                tracing::debug!(grant, "the importer released a revoked grant");
            }
            _ => {}
        }
        Ok(())
    }

    /// How the peer in `slot`'s transfers of GPU memory travel.
    fn route_of(&self, slot: usize) -> PeerCopyRoute {
        route(self.here, self.links.get(&slot).and_then(|l| l.remote))
    }
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

/// Another process's allocation mapped on a local GPU; closed on drop.
struct Mapping<C: hal_cuda::Api> {
    mapping: C::IpcMapping,
}

/// A batch of copies, queued on the GPU a window at a time.
struct Flight<C: hal_cuda::Api> {
    cell: Arc<CompletionCell>,
    proto: CopyFlight,
    plan: Vec<Planned>,
    /// The windows queued and not yet seen done, oldest first: the events
    /// recorded after each (one per stream it used).
    windows: VecDeque<Vec<C::Event>>,
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
    /// A grant of peer `slot` reached through its IPC handle: live while
    /// the handle is.
    Ipc { slot: usize, grant: u64 },
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
}

impl CopyFence {
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
        self.0.uses.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The engine's peer-copy state (under its lock).
pub(super) struct Copies<C: hal_cuda::Api> {
    /// Where this engine runs; `None`: no CUDA driver, or no boot id.
    here: Option<Locality>,
    /// Each local GPU's streams, and the next one to use.
    streams: HashMap<u32, (Vec<C::Stream>, usize)>,
    /// Mappings of IPC handles, by (local GPU, handle), shared by grants of
    /// one allocation.
    mappings: HashMap<(u32, IpcMemHandle), Weak<Mapping<C>>>,
    /// (local GPU, other GPU) pairs peer access was asked for.
    peer_access: HashSet<(u32, u32)>,
    flights: Vec<Flight<C>>,
    stats: PeerCopyStats,
    /// What the path knows of each peer, by slot.
    links: HashMap<usize, PeerLink<C>>,
    /// Our grants whose IPC handle went to a peer of another process, each
    /// holding its region until the importer released it.
    pub(super) exports: Exports<Keep>,
    /// The releases we owe owners that revoked a grant we had the handle
    /// of, by (peer slot, grant).
    releases: Releases,
}

impl<C: hal_cuda::Api> Copies<C> {
    /// The state of an engine over CUDA driver `cuda` (none: host memory
    /// only, never a peer copy).
    pub(super) fn new<D: hal_cuda::Driver<C>>(cuda: Option<&D>) -> Self {
        Self {
            here: cuda.and_then(|d| {
                Some(Locality {
                    host: d.host_token()?,
                    process: d.process_token(),
                })
            }),
            streams: HashMap::new(),
            mappings: HashMap::new(),
            peer_access: HashSet::new(),
            flights: Vec::new(),
            stats: PeerCopyStats::default(),
            links: HashMap::new(),
            exports: Exports::default(),
            releases: Releases::default(),
        }
    }
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

impl<V: Api, C: hal_cuda::Api> Peer<V, C> {
    /// How this peer's transfers of GPU memory travel.
    pub fn peer_copy(&self) -> PeerCopyRoute {
        let state = lock(&self.engine.shared.state);
        match state.peers.get(self.slot).and_then(Option::as_ref) {
            Some(peer) if self.engine.shared.config.peer_copy && peer.gone.is_none() => {
                state.peer_copy.route_of(self.slot)
            }
            _ => PeerCopyRoute::Nic,
        }
    }

    /// Tells the peer where this engine runs (before the paths, so that it
    /// knows once the connection is up), if the path is allowed here.
    pub(super) fn send_locality(&self) -> Result<(), EngineError> {
        if !self.engine.shared.config.peer_copy {
            return Ok(());
        }
        let here = lock(&self.engine.shared.state).peer_copy.here;
        if let Some(here) = here {
            self.send_control(&here.message())?;
        }
        Ok(())
    }

    /// Makes a new grant of GPU memory reachable by peer copy: published
    /// in the registry for a peer of this process, its IPC handle sent to
    /// a peer of another process of this host (before the announcement).
    /// Anything else, or any failure (VMM memory has no IPC handle), leaves
    /// the grant to the NIC path.
    pub(super) fn publish_for_peer_copy(
        &self,
        region: &Region<V>,
        offset: u64,
        descriptor: &MemoryDescriptor,
    ) -> Option<Publication> {
        let MemoryLocation::Gpu { ordinal } = region.inner.location else {
            return None;
        };
        let ordinal = u32::from(ordinal);
        let route = self.peer_copy();
        let addr = region.inner.addr + offset;
        match route {
            PeerCopyRoute::Nic => None,
            PeerCopyRoute::SameProcess => {
                let here = lock(&self.engine.shared.state).peer_copy.here?;
                let key = (self.engine.shared.id, descriptor.grant);
                let keep: Keep = Arc::clone(&region.inner) as Keep;
                let fence = Arc::new(CopyFence::default());
                published().insert(
                    key,
                    Published {
                        grantee: self.remote_engine(),
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
                let exported = self.engine.gpu(ordinal).and_then(|gpu| {
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
                        match self.send_control(&message) {
                            // Held until the importer releases it (after
                            // the revoke) or the bound passes.
                            Ok(_) => {
                                let keep: Keep = Arc::clone(&region.inner) as Keep;
                                let session = self.session();
                                lock(&self.engine.shared.state).peer_copy.exports.export(
                                    descriptor.grant,
                                    session,
                                    keep,
                                );
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

    /// Submits `transfers` by peer copy if every one can go that way
    /// (`Ok(None)`: the NIC path takes the batch); checks each as the NIC
    /// path does first.
    pub(super) fn submit_peer_copy(
        &self,
        transfers: &[Transfer<'_, V>],
        timeout: Duration,
    ) -> Result<Option<Batch<V, C>>, EngineError> {
        let engine = &self.engine;
        let config = &engine.shared.config;
        if !config.peer_copy || transfers.is_empty() {
            return Ok(None);
        }
        let mut guard = lock(&engine.shared.state);
        let State {
            peers,
            peer_copy: copies,
            ..
        } = &mut *guard;
        let peer = peers[self.slot]
            .as_mut()
            .ok_or_else(|| EngineError::PeerGone("closed".into()))?;
        let route = copies.route_of(self.slot);
        if route == PeerCopyRoute::Nic {
            return Ok(None);
        }
        if let Some(why) = &peer.gone {
            return Err(EngineError::PeerGone(why.clone()));
        }
        let _span =
            tracing::debug_span!("peer_copy_submit", transfers = transfers.len(), ?route).entered();
        for t in transfers {
            super::check_transfer(peer, t)?;
        }
        let mut plan = Vec::with_capacity(transfers.len());
        let mut lens = Vec::with_capacity(transfers.len());
        let mut keep: Vec<Keep> = Vec::new();
        let mut grants: Vec<GrantUse> = Vec::new();
        for t in transfers {
            let MemoryLocation::Gpu { ordinal } = t.local.inner.location else {
                return Ok(None);
            };
            if !matches!(t.remote.location, MemoryLocation::Gpu { .. }) {
                return Ok(None);
            }
            let ordinal = u32::from(ordinal);
            let remote = match route {
                PeerCopyRoute::SameProcess => {
                    engine.published_remote(copies, t, ordinal, &mut keep, &mut grants)?
                }
                _ => {
                    let remote = engine.mapped_remote(copies, self.slot, t, ordinal, &mut keep)?;
                    let grant = t.remote.grant;
                    if remote.is_some() && !grants.iter().any(|g| g.grant() == grant) {
                        grants.push(GrantUse::Ipc {
                            slot: self.slot,
                            grant,
                        });
                    }
                    remote
                }
            };
            let Some(remote) = remote else {
                return Ok(None);
            };
            keep.push(Arc::clone(&t.local.inner) as Keep);
            plan.push(Planned {
                op: t.op,
                ordinal,
                local: t.local.inner.addr + t.local_offset,
                remote,
            });
            lens.push(t.len);
        }
        let cell = Arc::new(CompletionCell::new());
        let deadline = config.clock.now().checked_add(timeout);
        let windows = Windows {
            slice: config.peer_copy_slice,
            slices: STREAMS_PER_GPU,
            in_flight: WINDOWS_IN_FLIGHT,
        };
        let mut flight = Flight {
            cell: Arc::clone(&cell),
            proto: CopyFlight::new(lens, windows, deadline),
            plan,
            windows: VecDeque::new(),
            error: None,
            timeout,
            queued: 0,
            grants,
            _keep: keep,
        };
        engine.queue_windows(copies, &mut flight);
        copies.flights.push(flight);
        drop(guard);
        engine.ensure_own_driver();
        Ok(Some(Batch::of_cell(engine.clone(), cell)))
    }
}

impl<V: Api, C: hal_cuda::Api> Engine<V, C> {
    /// What this engine's peer copies have done.
    pub fn peer_copy_stats(&self) -> PeerCopyStats {
        lock(&self.shared.state).peer_copy.stats
    }

    /// The device address of `t`'s remote range through the registry (a
    /// peer engine of this process), holding the owner's region in `keep`;
    /// `None`: not published to us.
    fn published_remote(
        &self,
        copies: &mut Copies<C>,
        t: &Transfer<'_, V>,
        ordinal: u32,
        keep: &mut Vec<Keep>,
        grants: &mut Vec<GrantUse>,
    ) -> Result<Option<u64>, EngineError> {
        let d = t.remote;
        let (addr, owner_gpu, region, fence) = {
            let registry = published();
            let Some(entry) = registry.get(&(d.owner, d.grant)) else {
                return Ok(None);
            };
            let ours = copies.here.map(|h| h.process);
            if entry.grantee != self.shared.id
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
        if !grants.iter().any(|g| g.grant() == d.grant) {
            // Revoked since it was looked up: refused as the NIC path
            // refuses a revoked grant.
            let Some(fence) = FenceUse::take(&fence) else {
                return Err(EngineError::Refused(format!(
                    "grant {} was revoked",
                    d.grant
                )));
            };
            grants.push(GrantUse::SameProcess {
                grant: d.grant,
                fence,
            });
        }
        keep.push(region);
        self.enable_peer_access(copies, ordinal, owner_gpu);
        Ok(Some(addr + t.remote_offset))
    }

    /// Lets GPU `local`'s copies reach GPU `other` directly, once per pair.
    fn enable_peer_access(&self, copies: &mut Copies<C>, local: u32, other: u32) {
        if local == other || !copies.peer_access.insert((local, other)) {
            return;
        }
        let enabled = self.gpu(local).and_then(|l| {
            let o = self.gpu(other)?;
            Ok(l.context.enable_peer_access(&o.context)?)
        });
        match enabled {
            Ok(true) => tracing::info!(local, other, "peer access enabled"),
            Ok(false) => {
                tracing::info!(local, other, "no peer access: copies staged by the driver")
            }
            Err(e) => tracing::warn!(local, other, error = %e, "enabling peer access"),
        }
    }

    /// The device address of `t`'s remote range through the peer's IPC
    /// handle, mapped on GPU `ordinal` (cached), the mapping held in
    /// `keep`; `None`: no handle for the grant, or it does not open.
    fn mapped_remote(
        &self,
        copies: &mut Copies<C>,
        slot: usize,
        t: &Transfer<'_, V>,
        ordinal: u32,
        keep: &mut Vec<Keep>,
    ) -> Result<Option<u64>, EngineError> {
        let d = t.remote;
        let Some(grant) = copies.links.get(&slot).and_then(|l| l.ipc.get(&d.grant)) else {
            return Ok(None);
        };
        let (handle, offset) = (grant.handle, grant.offset);
        let mapping = match &grant.mapping {
            Some((gpu, mapping)) if *gpu == ordinal => Arc::clone(mapping),
            _ => match self.open_mapping(copies, ordinal, &handle) {
                Ok(mapping) => {
                    if let Some(grant) = copies
                        .links
                        .get_mut(&slot)
                        .and_then(|l| l.ipc.get_mut(&d.grant))
                    {
                        grant.mapping = Some((ordinal, Arc::clone(&mapping)));
                    }
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
            return Err(EngineError::Refused(format!(
                "grant {} of {} bytes at offset {} lies outside its {size}-byte allocation",
                d.grant, d.len, offset
            )));
        }
        let addr = mapping.mapping.device_ptr() + offset + t.remote_offset;
        keep.push(mapping as Keep);
        Ok(Some(addr))
    }

    /// The mapping of `handle` on GPU `ordinal`: the cached one while any
    /// grant or copy holds it, else newly opened.
    fn open_mapping(
        &self,
        copies: &mut Copies<C>,
        ordinal: u32,
        handle: &IpcMemHandle,
    ) -> Result<Arc<Mapping<C>>, EngineError> {
        if let Some(mapping) = copies
            .mappings
            .get(&(ordinal, *handle))
            .and_then(Weak::upgrade)
        {
            return Ok(mapping);
        }
        let _span = tracing::debug_span!("peer_copy_ipc_open", ordinal).entered();
        let mapping = Arc::new(Mapping {
            mapping: self.gpu(ordinal)?.context.ipc_open(handle)?,
        });
        copies.mappings.retain(|_, m| m.strong_count() > 0);
        copies
            .mappings
            .insert((ordinal, *handle), Arc::downgrade(&mapping));
        Ok(mapping)
    }

    /// Stream `index` of GPU `ordinal`'s peer-copy streams, made at first
    /// use; rotates.
    fn next_stream<'c>(
        &self,
        copies: &'c mut Copies<C>,
        ordinal: u32,
    ) -> Result<(&'c C::Stream, usize), EngineError> {
        use std::collections::hash_map::Entry;
        let (streams, next) = match copies.streams.entry(ordinal) {
            Entry::Occupied(entry) => entry.into_mut(),
            Entry::Vacant(vacant) => {
                let context = &self.gpu(ordinal)?.context;
                let streams = (0..STREAMS_PER_GPU)
                    .map(|_| context.create_stream())
                    .collect::<Result<Vec<_>, _>>()?;
                vacant.insert((streams, 0))
            }
        };
        let index = *next;
        *next = (index + 1) % streams.len();
        Ok((&streams[index], index))
    }

    /// Queues the windows `flight` may have on the GPU now: each window's
    /// slices over the local GPUs' streams, then an event on each stream
    /// it used. A copy that cannot be queued stops the flight (what was
    /// queued still drains).
    fn queue_windows(&self, copies: &mut Copies<C>, flight: &mut Flight<C>) {
        while let Some(window) = flight.proto.poll_window() {
            let (events, queued, error) = self.queue_window(copies, &flight.plan, &window);
            flight.queued += queued;
            if let Some(e) = error {
                flight.error.get_or_insert(e);
                flight.proto.stop(Stop::Failed);
            }
            if events.is_empty() {
                // Nothing to wait for: either nothing was queued or the
                // streams were synchronized (see `queue_window`).
                flight.proto.window_done();
            } else {
                flight.windows.push_back(events);
            }
        }
    }

    /// Queues one window's slices; the events recorded after them, the
    /// bytes queued, and the error that stopped it, if any.
    fn queue_window(
        &self,
        copies: &mut Copies<C>,
        plan: &[Planned],
        window: &[Slice],
    ) -> (Vec<C::Event>, u64, Option<TransferError>) {
        let mut used: Vec<(u32, usize)> = Vec::new();
        let mut queued = 0;
        let mut error = None;
        for slice in window {
            let p = &plan[slice.transfer];
            let (dst, src) = match p.op {
                Op::Write => (p.remote + slice.offset, p.local + slice.offset),
                Op::Read => (p.local + slice.offset, p.remote + slice.offset),
            };
            let len = slice.len;
            let copied = self
                .next_stream(copies, p.ordinal)
                .and_then(|(stream, index)| {
                    // SAFETY: both ranges were checked to lie in device
                    // memory this batch holds (the local region, and the
                    // owner's region or the IPC mapping, in the flight's
                    // `_keep`) until the events recorded after these
                    // copies have passed; the grant was live when this
                    // window was queued (checked by the pump).
                    unsafe { stream.copy_device_to_device(dst, src, len as usize) }?;
                    Ok(index)
                });
            match copied {
                Ok(index) => {
                    if !used.contains(&(p.ordinal, index)) {
                        used.push((p.ordinal, index));
                    }
                    copies.stats.copies += 1;
                    queued += len;
                }
                Err(e) => {
                    error = Some(TransferError::Local {
                        what: format!("a peer copy of {len} bytes: {e}"),
                    });
                    break;
                }
            }
        }
        let mut events = Vec::with_capacity(used.len());
        for (ordinal, index) in used {
            let Some(stream) = copies.streams.get(&ordinal).map(|(s, _)| &s[index]) else {
                continue;
            };
            let recorded = self.gpu(ordinal).and_then(|gpu| {
                let event = gpu.context.create_event()?;
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
                    error.get_or_insert(TransferError::Local {
                        what: format!("recording a peer copy's event: {e}"),
                    });
                }
            }
        }
        (events, queued, error)
    }

    /// Moves the peer-copy batches on: retires their windows that ran,
    /// stops those whose grant was revoked (or whose deadline passed, or
    /// that were cancelled), queues their next windows, and ends each
    /// batch once; drops the IPC handles of peers that are gone; takes the
    /// importers' releases of our exported grants and gives up on those
    /// past their bound; sends the releases we owe. Returns how many
    /// batches ended.
    pub(super) fn pump_peer_copies(&self, state: &mut State<V, C>, now: Instant) -> usize {
        let State {
            peers,
            peer_copy: copies,
            ..
        } = state;
        // A gone peer's handles go (their mappings once no copy uses them);
        // so does everything of a peer whose state is gone.
        copies.links.retain(
            |&slot, link| match peers.get(slot).and_then(Option::as_ref) {
                None => false,
                Some(peer) => {
                    if peer.gone.is_some() {
                        link.ipc.clear();
                    }
                    true
                }
            },
        );
        for (grant, _) in copies.exports.handle_timeout(now) {
            tracing::warn!(
                grant,
                "no release of a revoked grant's IPC handle within the bound: its memory is given back unconfirmed"
            );
        }
        if copies.flights.is_empty() && copies.releases.is_empty() {
            return 0;
        }
        let mut flights = std::mem::take(&mut copies.flights);
        let mut ended = 0;
        flights.retain_mut(|flight| {
            // The windows that ran.
            while let Some(events) = flight.windows.front() {
                let mut pending = false;
                for event in events {
                    match event.is_complete() {
                        Ok(true) => {}
                        Ok(false) => pending = true,
                        Err(e) => {
                            flight.error.get_or_insert(TransferError::Local {
                                what: format!("a peer copy: {e}"),
                            });
                            flight.proto.stop(Stop::Failed);
                        }
                    }
                }
                if pending {
                    break;
                }
                flight.windows.pop_front();
                flight.proto.window_done();
            }
            // The grants, before anything more is queued under them.
            for grant in &flight.grants {
                let live = match grant {
                    GrantUse::SameProcess { fence, .. } => !fence.0.is_revoked(),
                    GrantUse::Ipc { slot, grant } => copies
                        .links
                        .get(slot)
                        .is_some_and(|l| l.ipc.contains_key(grant)),
                };
                if !live {
                    flight.proto.stop(Stop::Revoked {
                        grant: grant.grant(),
                    });
                }
            }
            flight.proto.handle_timeout(now);
            self.queue_windows(copies, flight);
            if flight.proto.is_drained() && flight.proto.stopped() != Some(Stop::Failed) {
                // Counted once: a drained flight is dropped below.
                copies.stats.batches += 1;
                copies.stats.bytes += flight.queued;
            }
            if let Some(outcome) = flight.proto.poll_outcome() {
                let outcome = match outcome {
                    Ok(()) => Ok(()),
                    Err(Stop::TimedOut) => Err(TransferError::Timeout {
                        after: flight.timeout,
                    }),
                    Err(Stop::Cancelled) => Err(TransferError::Cancelled),
                    Err(Stop::Revoked { grant }) => Err(TransferError::Revoked { grant }),
                    Err(Stop::Failed) => Err(flight.error.take().unwrap_or(TransferError::Local {
                        what: "a peer copy failed".into(),
                    })),
                };
                if flight.cell.complete(outcome) {
                    ended += 1;
                }
            }
            !flight.proto.is_drained()
        });
        copies.flights = flights;
        // The releases owed whose grants no batch has anything queued under.
        let flights = &copies.flights;
        let ready = copies.releases.poll_release(|slot, grant| {
            flights.iter().any(|f| {
                f.grants.iter().any(|g| {
                    matches!(g, GrantUse::Ipc { slot: s, grant: g } if *s as u64 == slot && *g == grant)
                })
            })
        });
        for (slot, grant) in ready {
            let Some(peer) = peers.get_mut(slot as usize).and_then(Option::as_mut) else {
                continue;
            };
            let config = &self.shared.config;
            if let Err(e) = peer.enqueue(
                &Control::GrantReleased { grant },
                now,
                config.default_timeout,
            ) {
                tracing::debug!(grant, error = %e, "a grant release not sent");
            }
        }
        ended
    }

    /// Cancels the peer-copy batch of `cell`, if it is one: it queues
    /// nothing more and ends [`TransferError::Cancelled`] once its queued
    /// copies have run.
    pub(super) fn cancel_peer_copy(&self, cell: &Arc<CompletionCell>) {
        let mut state = lock(&self.shared.state);
        if let Some(flight) = state
            .peer_copy
            .flights
            .iter_mut()
            .find(|f| Arc::ptr_eq(&f.cell, cell))
        {
            flight.proto.stop(Stop::Cancelled);
        }
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
