//! Staging-rung regions: GPU memory no NIC can reach (neither dma-buf nor
//! peermem works for its GPU), moved through pinned host bounce buffers.
//!
//! - **Local** (this side's region is staged, the peer's grant is direct):
//!   through the GPU's pipelined bounce pool ([`super::pipeline`]: slices
//!   copied and sent overlapping). With
//!   [`super::EngineConfig::staging_pipeline`] off, the naive path: a WRITE
//!   copies the whole range into a bounce buffer first (a synchronous
//!   `cuMemcpy`) and posts from it; a READ lands in a bounce buffer and is
//!   copied into the region before the batch reports success.
//! - **Rendezvous** (the peer's grant says `Staged`: it has no MR to
//!   name): through the landing slots the owner lends this side
//!   ([`super::rendezvous`]). The owner hands out a slot per slice as a
//!   credit; this side WRITEs the slice into it (or READs one the owner
//!   copied in) and returns the credit; the owner copies between the slot
//!   and its GPU. When this side's memory is staged too, its side of each
//!   slice goes through its own GPU's pool, so this side's copies, the wire
//!   and the owner's copies of different slices overlap.
//! - **Naive rendezvous** (with the pipeline off, the benchmark's
//!   baseline): this side grants the owner the range it needs (read for
//!   our WRITE, write for our READ; the local range itself, or a
//!   whole-range bounce buffer when it too is staged) and sends a
//!   [`Control::StagedRequest`]; the owner checks it against its grant,
//!   moves the range against our temporary grant through a bounce buffer,
//!   and answers with a [`Control::StagedReply`]; only then does our part
//!   of the batch end, and our temporary grant is revoked.
//!
//! What it costs: the pipeline's pool per GPU is allocated, pinned and
//! registered once; each slice costs a `cuMemcpyAsync` and an event poll
//! on the staged side, overlapped with the wire. A rendezvous costs the
//! owner, once per peer, its landing slots (`rendezvous_slots` ×
//! `staging_slice` of pinned memory allocated, registered and granted
//! once: 16 MiB by default); per request a request message (and a reply
//! for a WRITE), and per slice a credit and its return (two control
//! messages) and a copy on each staged side. Nothing is registered per
//! request any more: the requester's temporary grant of its range (0.86 ms
//! for 16 MiB on the sim NIC, 70% of the wire's time there; milliseconds
//! of `ibv_reg_mr` on a real NIC) and the whole-range synchronous bounce
//! of a staged requester are gone. A slice waits for its credit, a round
//! trip of control messages: with `rendezvous_slots` slices in flight the
//! wire stays busy while a round trip is shorter than the slots' worth of
//! wire time. Measured on the sim NIC and GPU (2 shared, noisy cores;
//! `cargo bench -p gdr-tests --bench staging -- 'staging_sim/(pipelined_in|pipelined_gpu)'`),
//! before → after: host → staged GPU 1 MiB 3.0 → 5.5,
//! 16 MiB 3.9 → 6.4 GiB/s (the wire alone: 12.8); staged GPU → staged GPU 1 MiB 0.74 →
//! 4.5, 16 MiB 0.78 → 4.3 GiB/s. It needs the owner's
//! progress: it is served only while the owner's engine makes progress:
//! granting a staging-rung region starts the engine's own progress thread
//! (it ends with the engine). The naive path costs a bounce buffer
//! allocated, pinned and registered per transfer and a synchronous copy of
//! the whole range, and the naive rendezvous a grant per request.
//!
//! # The staged path
//!
//! `StagedPath` is one path behind the seam (`super::path`): it owns
//! the pools and pipes ([`super::pipeline`]), the requests this side
//! serves, and per peer slot a `StagedPeer`: this side's grants of
//! staging-rung regions, the naive requests both ways, the landing slots
//! lent and the requests through the peer's. It reaches the peers only
//! through `PathCx` (the engine's resources and the wire). What must
//! run outside the engine's lock (the naive form's registrations,
//! synchronous copies and submits, making landing slots) it hands out as
//! `Unlocked` work from `StagedPath::take_serve_work`; the engine runs
//! it and hands each result back. The pipelined form is its
//! `TransferPath::post`; the requester's side of the naive form
//! (bounces, the direct rest, its temporary grant) is the engine's, which
//! calls `StagedPath::rendezvous` for the request itself.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hal_cuda::{Context as _, Stream as _};
use hal_verbs::Api;

use super::completion::{CompletionCell, Outcome};
use super::path::{PathCx, TransferPath};
use super::pipeline::{self, Pipe, StagingPool};
use super::rendezvous::{self, Asks, Landing, LandingSlots};
use super::resources::Resources;
use super::wire::Control;
use super::{EngineConfig, EngineError, Op, Region, Transfer, TransferError};
use crate::buffer::Buffer;
use crate::descriptor::{GrantRights, MemoryDescriptor, MemoryLocation, Reach};
use crate::ladder::{Grant, Rung};
use gdr_proto::grants::{Access, LocalGrants, Revoked, Rights, Terms};
use gdr_proto::rendezvous::status::of_refusal;
use gdr_proto::{PeerLimits, PeerMisbehaved};

/// Reply codes of a [`Control::StagedReply`] (the protocol's).
pub(super) use gdr_proto::rendezvous::status::{
    ACCESS_DENIED, BAD_CREDIT, BUSY, FAILED, NOT_GRANTED, OK, OUT_OF_BOUNDS, REVOKED, TIMED_OUT,
};

/// The rendezvous request for transfer `t` (through the owner's landing
/// slots when `slots`, else against our temporary grant `id`).
pub(super) fn staged_request<V: Api>(
    id: u64,
    t: &Transfer<'_, V>,
    slots: bool,
) -> Control<'static> {
    Control::StagedRequest {
        id,
        grant: t.remote.grant,
        offset: t.remote_offset,
        len: t.len,
        write: t.op == Op::Write,
        slots,
    }
}

/// What a reply's status means for the requester.
pub(super) fn reply_outcome(status: u32) -> Outcome {
    let what = match status {
        OK => return Ok(()),
        NOT_GRANTED => "the grant is not live on this connection",
        ACCESS_DENIED => "the grant does not allow it",
        OUT_OF_BOUNDS => "outside the grant",
        FAILED => "staging failed at the owner",
        BAD_CREDIT => "a slot credit that matches no slot lent to the request",
        REVOKED => "the grant was revoked",
        BUSY => "the owner serves as many of this peer's requests as it allows",
        TIMED_OUT => "the request outlived the owner's deadline",
        _ => "unknown status",
    };
    Err(TransferError::StagedRefused { status, what })
}

/// A live grant of a staging-rung region (the owner's side).
pub(crate) struct Served<V: Api> {
    pub region: Region<V>,
    pub offset: u64,
    pub len: u64,
    pub rights: GrantRights,
}

impl<V: Api> Served<V> {
    /// Its range and rights, as the grant table checks them.
    pub(super) fn terms(&self) -> Terms {
        Terms {
            len: self.len,
            rights: match self.rights {
                GrantRights::Read => Rights::Read,
                GrantRights::Write => Rights::Write,
                GrantRights::ReadWrite => Rights::ReadWrite,
            },
        }
    }
}

/// What a staged request does to the owner's granted memory.
pub(super) fn access(write: bool) -> Access {
    if write { Access::Write } else { Access::Read }
}

/// A peer's rendezvous request, as received (the protocol's).
pub(super) use gdr_proto::rendezvous::StagedAsk;

/// This side's rendezvous request, waiting for the owner's reply; the
/// owner's access to our range (the MRs) ends when it does.
pub(super) struct Rendezvous<V: Api> {
    cell: Arc<CompletionCell>,
    deadline: Instant,
    timeout: Duration,
    grants: Vec<Grant<V>>,
}

impl<V: Api> Rendezvous<V> {
    /// Revokes the owner's access, then delivers the outcome.
    pub fn finish(self, outcome: Outcome) {
        drop(self.grants);
        self.cell.complete(outcome);
    }
}

/// A pinned host buffer registered on every NIC, standing in for a range
/// of a staging-rung region.
pub(crate) struct Bounce<V: Api, C: hal_cuda::Api> {
    region: Region<V>,
    buffer: Buffer<C>,
}

impl<V: Api, C: hal_cuda::Api> Bounce<V, C> {
    /// Its registration (what a transfer names in place of the range).
    pub(crate) fn region(&self) -> &Region<V> {
        &self.region
    }
}

/// After a batch succeeds: copy a bounce buffer into a staging-rung GPU
/// range (the data a READ brought).
pub(super) struct CopyBack<V: Api, C: hal_cuda::Api> {
    bounce: Bounce<V, C>,
    ordinal: u32,
    dst: u64,
}

/// What a batch with staged parts does once it succeeded, and holds till
/// then.
pub(super) struct After<V: Api, C: hal_cuda::Api> {
    pub copies: Vec<CopyBack<V, C>>,
    pub keep: Vec<Box<dyn Any + Send + Sync>>,
}

impl<V: Api, C: hal_cuda::Api> Default for After<V, C> {
    fn default() -> Self {
        Self {
            copies: Vec::new(),
            keep: Vec::new(),
        }
    }
}

impl<V: Api, C: hal_cuda::Api> After<V, C> {
    /// Runs the copies (once; they are gone after). Outside the engine's
    /// lock: they are synchronous.
    pub fn run(&mut self, res: &Resources<V, C>) -> Result<(), EngineError> {
        for copy in std::mem::take(&mut self.copies) {
            copy_to_gpu(res, copy.ordinal, copy.dst, &copy.bounce.buffer)?;
        }
        self.keep.clear();
        Ok(())
    }

    /// Holds `bounce` (standing in for `t`'s staged range of GPU
    /// `ordinal`) until the batch ended: a READ's data is copied into the
    /// range then.
    pub fn hold(&mut self, t: &Transfer<'_, V>, bounce: Bounce<V, C>, ordinal: u32) {
        if t.op == Op::Read {
            self.copies.push(CopyBack {
                bounce,
                ordinal,
                dst: t.local.inner.addr + t.local_offset,
            });
        } else {
            self.keep.push(Box::new(bounce.region));
            self.keep.push(Box::new(bounce.buffer));
        }
    }
}

/// A rendezvous this side serves as the owner: its RDMA op is in flight.
pub(crate) struct Serving<V: Api, C: hal_cuda::Api> {
    slot: usize,
    id: u64,
    /// The grant it runs under: a use of it is held until it ends.
    grant: u64,
    cell: Arc<CompletionCell>,
    /// The naive path's bounce (none through the pipeline).
    bounce: Option<Bounce<V, C>>,
    /// For the requester's WRITE on the naive path: where the bounce's
    /// data goes.
    copy_back: Option<(u32, u64)>,
}

impl<V: Api> Region<V> {
    /// Whether some NIC reaches it only through staging.
    pub(super) fn is_staged(&self) -> bool {
        self.inner.per_nic.iter().any(|r| r.rung() == Rung::Staging)
    }
}

/// Whether the staged path's pipelined form carries `t`: with
/// [`super::EngineConfig::staging_pipeline`] on, ours staged (through the
/// GPU's pool) or theirs staged (through the owner's landing slots). The
/// rest of a staged batch (all of it with the pipeline off) is the
/// engine's: bounce buffers and the naive rendezvous.
pub(crate) fn pipelined<V: Api>(config: &EngineConfig, t: &Transfer<'_, V>) -> bool {
    config.staging_pipeline && (t.local.is_staged() || slotted(t))
}

/// Whether `t` names a peer's staging-rung grant.
fn slotted<V: Api>(t: &Transfer<'_, V>) -> bool {
    matches!(t.remote.reach, Reach::Staged)
}

/// The GPUs to fence after a batch of the pipelined `transfers`: our READs
/// through a peer's landing slots into GPU memory the NIC reaches (fenced
/// as any; those through our pool were copied in by us).
pub(crate) fn read_fence<V: Api>(transfers: &[Transfer<'_, V>]) -> Vec<u32> {
    transfers
        .iter()
        .filter(|t| slotted(t) && t.op == Op::Read && !t.local.is_staged())
        .filter_map(|t| match t.local.inner.location {
            MemoryLocation::Gpu { ordinal } => Some(u32::from(ordinal)),
            MemoryLocation::Host => None,
        })
        .collect()
}

/// A bounce buffer of `len` bytes: pinned with GPU `ordinal`'s context
/// (pageable host memory if pinning fails), registered on every NIC.
fn bounce<V: Api, C: hal_cuda::Api>(
    res: &Resources<V, C>,
    ordinal: Option<u32>,
    len: u64,
) -> Result<Bounce<V, C>, EngineError> {
    let pinned = ordinal
        .and_then(|o| res.gpu(o).ok())
        .and_then(|gpu| Buffer::alloc_pinned(&gpu.context, len).ok());
    let buffer = pinned.unwrap_or_else(|| Buffer::alloc_host(len));
    let region = res.register(&buffer)?;
    Ok(Bounce { region, buffer })
}

/// Copies `into.len()` bytes at device address `src` of GPU `ordinal` into
/// host buffer `into`.
fn copy_from_gpu<V: Api, C: hal_cuda::Api>(
    res: &Resources<V, C>,
    ordinal: u32,
    src: u64,
    into: &Buffer<C>,
) -> Result<(), EngineError> {
    let stream = res.gpu(ordinal)?.context.create_stream()?;
    // SAFETY: `into` is gdr's own host allocation of `into.len()` bytes,
    // written by nothing else while the bounce is private to this transfer;
    // `src..src + len` lies in a registered GPU region (its bounds were
    // checked); the stream is synchronised before return.
    unsafe { stream.copy_device_to_host(into.addr() as *mut u8, src, into.len() as usize) }?;
    stream.synchronize()?;
    Ok(())
}

/// Copies host buffer `from` to device address `dst` of GPU `ordinal`.
fn copy_to_gpu<V: Api, C: hal_cuda::Api>(
    res: &Resources<V, C>,
    ordinal: u32,
    dst: u64,
    from: &Buffer<C>,
) -> Result<(), EngineError> {
    let stream = res.gpu(ordinal)?.context.create_stream()?;
    // SAFETY: as in `copy_from_gpu`, the other way: `from` holds
    // `from.len()` bytes no NIC writes any more (its transfer ended).
    unsafe { stream.copy_host_to_device(dst, from.addr() as *const u8, from.len() as usize) }?;
    stream.synchronize()?;
    Ok(())
}

/// A bounce standing in for `len` bytes at `offset` of staged `region`,
/// holding its data now when `fill` (a synchronous copy: outside the
/// engine's lock).
pub(crate) fn bounce_for<V: Api, C: hal_cuda::Api>(
    res: &Resources<V, C>,
    region: &Region<V>,
    offset: u64,
    len: u64,
    fill: bool,
) -> Result<(Bounce<V, C>, u32), EngineError> {
    let MemoryLocation::Gpu { ordinal } = region.inner.location else {
        return Err(EngineError::Refused(
            "host memory on the staging rung".into(),
        ));
    };
    let ordinal = u32::from(ordinal);
    let bounce = bounce(res, Some(ordinal), len)?;
    if fill {
        copy_from_gpu(res, ordinal, region.inner.addr + offset, &bounce.buffer)?;
    }
    Ok((bounce, ordinal))
}

/// Checks a peer's naive rendezvous request against the grant it names
/// (`served`) and the requester's grant of its range (`theirs`); `Err` is
/// the status to answer at once.
fn check_ask<V: Api>(
    ask: &StagedAsk,
    served: &Served<V>,
    theirs: Option<MemoryDescriptor>,
) -> Result<MemoryDescriptor, u32> {
    let theirs = theirs.ok_or(NOT_GRANTED)?;
    let allowed = if ask.write {
        served.rights.allows_write() && theirs.rights.allows_read()
    } else {
        served.rights.allows_read() && theirs.rights.allows_write()
    };
    if !allowed {
        return Err(ACCESS_DENIED);
    }
    if ask.len == 0
        || ask
            .offset
            .checked_add(ask.len)
            .is_none_or(|e| e > served.len)
        || theirs.len < ask.len
    {
        return Err(OUT_OF_BOUNDS);
    }
    Ok(theirs)
}

/// The owner's work that runs outside the engine's lock (it allocates,
/// registers, copies synchronously or submits), handed out by
/// [`StagedPath::take_serve_work`]; each result goes back to the path.
pub(crate) enum Unlocked<V: Api, C: hal_cuda::Api> {
    /// Make the landing slots of the peer in `slot` ([`make_landing`]),
    /// pinned with GPU `gpu`; then [`StagedPath::landing_made`].
    Landing { slot: usize, gpu: Option<u32> },
    /// Serve a request the naive way ([`NaiveServe::run`]); then
    /// [`StagedPath::serve_started`].
    Serve(NaiveServe<V>),
    /// Copy a served WRITE's bounce into the granted memory
    /// ([`copy_back`]); then [`StagedPath::serve_ended`].
    CopyBack(Serving<V, C>),
}

/// What [`StagedPath::take_serve_work`] decided.
pub(crate) struct ServeWork<V: Api, C: hal_cuda::Api> {
    /// Requests started or answered under the lock.
    pub(crate) worked: usize,
    /// What runs outside the lock.
    pub(crate) unlocked: Vec<Unlocked<V, C>>,
    /// Grants fenced now: their regions go with this, outside the lock
    /// (their registrations may be the last).
    pub(crate) fenced: Vec<Served<V>>,
}

/// A peer's request to serve the naive way: through a whole-range bounce
/// buffer against the requester's grant of its range.
pub(crate) struct NaiveServe<V: Api> {
    slot: usize,
    ask: StagedAsk,
    served: Served<V>,
    theirs: MemoryDescriptor,
}

/// A naive serve, started (the serving to watch) or refused (the status
/// to answer).
pub(crate) struct NaiveStarted<V: Api, C: hal_cuda::Api> {
    slot: usize,
    ask: StagedAsk,
    started: Result<Serving<V, C>, u32>,
}

impl<V: Api> NaiveServe<V> {
    /// The peer it serves.
    pub(crate) fn slot(&self) -> usize {
        self.slot
    }

    /// Copies out now (the requester READs) and moves the range between a
    /// bounce and the requester's grant with `submit` (the engine's
    /// submit to the peer); the copy in, for a WRITE, runs once the op
    /// ended. Outside the engine's lock.
    pub(crate) fn run<C: hal_cuda::Api>(
        self,
        res: &Resources<V, C>,
        submit: impl FnOnce(&Transfer<'_, V>) -> Result<Arc<CompletionCell>, EngineError>,
    ) -> NaiveStarted<V, C> {
        let Self {
            slot,
            ask,
            served,
            theirs,
        } = self;
        let _span = tracing::debug_span!("serve_staged", id = ask.id, len = ask.len).entered();
        let failed = |e: EngineError| {
            tracing::warn!(error = %e, "serving a staged transfer");
            FAILED
        };
        let offset = served.offset + ask.offset;
        // The requester WRITEs: we READ its range into our memory; it
        // READs: we WRITE ours into its range.
        let op = if ask.write { Op::Read } else { Op::Write };
        let started = bounce_for(res, &served.region, offset, ask.len, !ask.write)
            .map_err(failed)
            .and_then(|(bounce, ordinal)| {
                let transfer = Transfer {
                    op,
                    ..Transfer::read(&bounce.region, 0, &theirs, 0, ask.len)
                };
                let cell = submit(&transfer).map_err(failed)?;
                Ok(Serving {
                    slot,
                    id: ask.id,
                    grant: ask.grant,
                    cell,
                    copy_back: ask
                        .write
                        .then_some((ordinal, served.region.inner.addr + offset)),
                    bounce: Some(bounce),
                })
            });
        NaiveStarted { slot, ask, started }
    }
}

/// A served WRITE whose op ended, copied into the granted memory: the
/// status to answer.
pub(crate) struct CopiedBack {
    slot: usize,
    id: u64,
    grant: u64,
    status: u32,
}

/// Copies the bounce of `done` (a served WRITE whose op succeeded, its
/// grant live when handed out, its use still held) into the granted
/// memory. Outside the engine's lock (a synchronous copy).
pub(crate) fn copy_back<V: Api, C: hal_cuda::Api>(
    done: Serving<V, C>,
    res: &Resources<V, C>,
) -> CopiedBack {
    let mut status = OK;
    if let (Some((ordinal, dst)), Some(bounce)) = (done.copy_back, &done.bounce)
        && let Err(e) = copy_to_gpu(res, ordinal, dst, &bounce.buffer)
    {
        tracing::warn!(error = %e, "staging a peer's WRITE into GPU memory");
        status = FAILED;
    }
    CopiedBack {
        slot: done.slot,
        id: done.id,
        grant: done.grant,
        status,
    }
}

/// Makes the landing slots of the peer in `slot` (pinned with GPU `gpu`)
/// and grants them with `grant` (the engine's grant to that peer of `len`
/// bytes of the region, read and write). Outside the engine's lock.
pub(crate) fn make_landing<V: Api, C: hal_cuda::Api>(
    res: &Resources<V, C>,
    slot: usize,
    gpu: Option<u32>,
    grant: impl FnOnce(&Region<V>, u64) -> Result<(MemoryDescriptor, Vec<Grant<V>>), EngineError>,
) -> Result<LandingSlots<V, C>, EngineError> {
    rendezvous::make_slots(res, slot, gpu, grant)
}

/// What the staged path holds of one peer: both sides of its rendezvous.
pub(crate) struct StagedPeer<V: Api, C: hal_cuda::Api> {
    /// This side's grants of staging-rung regions, served by rendezvous:
    /// live, or revoked while a request under them still runs (the
    /// revocation fence, [`gdr_proto::grants`]).
    served: LocalGrants<Served<V>>,
    /// The peer's naive rendezvous requests not yet served.
    inbox: VecDeque<StagedAsk>,
    /// This side's naive rendezvous requests waiting for the peer's reply,
    /// by id.
    rendezvous: HashMap<u64, Rendezvous<V>>,
    /// The landing slots this side lends the peer, and its requests served
    /// through them.
    landing: Landing<V, C>,
    /// This side's requests through the peer's landing slots.
    asks: Asks<V, C>,
    /// Messages for the peer decided where no wire was at hand (as a
    /// message arrived): sent at the path's next step.
    outbox: Vec<Control<'static>>,
}

impl<V: Api, C: hal_cuda::Api> StagedPeer<V, C> {
    fn new(limits: &PeerLimits) -> Self {
        Self {
            served: LocalGrants::default(),
            inbox: VecDeque::new(),
            rendezvous: HashMap::new(),
            landing: Landing::new(limits),
            asks: Asks::default(),
            outbox: Vec::new(),
        }
    }
}

/// Several transfers posted at once: one cell for them all, ending with
/// the last of its parts (the first failure, in order).
struct Group {
    cell: Arc<CompletionCell>,
    parts: Vec<Arc<CompletionCell>>,
}

impl Group {
    /// Ends the group's cell once every part has; whether it has.
    fn resolve(&self) -> bool {
        let mut first = Ok(());
        for part in &self.parts {
            match part.outcome() {
                None => return false,
                Some(Err(e)) if first.is_ok() => first = Err(e),
                Some(_) => {}
            }
        }
        self.cell.complete(first);
        true
    }
}

/// The staged path (see the module docs): its pools and pipes, the
/// rendezvous it serves and those it asks for, by peer slot.
pub(crate) struct StagedPath<V: Api, C: hal_cuda::Api> {
    /// By peer slot. Field order is drop order, as when this was the
    /// peers' state: the peers' part first.
    peers: Vec<Option<StagedPeer<V, C>>>,
    /// Rendezvous this side serves whose RDMA op is in flight.
    serving: Vec<Serving<V, C>>,
    /// Each GPU's staging pool, made at its first staged transfer.
    pools: HashMap<u32, StagingPool<V, C>>,
    /// Staged transfers going through a pool.
    pipes: Vec<Pipe<V, C>>,
    /// Posts of several transfers not ended.
    groups: Vec<Group>,
}

impl<V: Api, C: hal_cuda::Api> Default for StagedPath<V, C> {
    fn default() -> Self {
        Self {
            peers: Vec::new(),
            serving: Vec::new(),
            pools: HashMap::new(),
            pipes: Vec::new(),
            groups: Vec::new(),
        }
    }
}

impl<V: Api, C: hal_cuda::Api> StagedPath<V, C> {
    /// A peer connected in `slot`: nothing staged with it yet.
    pub(crate) fn add_peer(&mut self, slot: usize, limits: &PeerLimits) {
        if self.peers.len() <= slot {
            self.peers.resize_with(slot + 1, || None);
        }
        self.peers[slot] = Some(StagedPeer::new(limits));
    }

    fn peer_mut(&mut self, slot: usize) -> Result<&mut StagedPeer<V, C>, EngineError> {
        self.peers
            .get_mut(slot)
            .and_then(Option::as_mut)
            .ok_or_else(|| EngineError::PeerGone("closed".into()))
    }

    fn peer(&self, slot: usize) -> Option<&StagedPeer<V, C>> {
        self.peers.get(slot).and_then(Option::as_ref)
    }

    // ------------------------------------------------------ the grants

    /// Serves grant `grant` of a staging-rung region to the peer in `slot`
    /// (recorded before it is announced: the peer may use it at once).
    pub(crate) fn grant(
        &mut self,
        slot: usize,
        grant: u64,
        served: Served<V>,
    ) -> Result<(), EngineError> {
        let terms = served.terms();
        self.peer_mut(slot)?.served.insert(grant, terms, served);
        Ok(())
    }

    /// Revokes grant `grant` to the peer in `slot`: requests under it stop
    /// at once; its fence waits for their copies under way. What is fenced
    /// now goes with the returned value (outside the engine's lock).
    pub(crate) fn revoke(&mut self, slot: usize, grant: u64) -> Revoked<Served<V>> {
        let Ok(peer) = self.peer_mut(slot) else {
            return Revoked::Unknown;
        };
        let revoked = peer.served.revoke(grant);
        if let Revoked::Draining { .. } = revoked {
            peer.landing.revoke(grant);
        }
        revoked
    }

    /// Whether grant `grant` to the peer in `slot` is fenced (no byte moves
    /// under it any more). A gone peer's (`gone`) served grants go with
    /// it, once the copies still running for it have ended (the next
    /// progress waits for them).
    pub(crate) fn is_fenced(&self, slot: usize, grant: u64, gone: bool) -> bool {
        self.peer(slot)
            .is_none_or(|p| p.served.is_fenced(grant) || (gone && !p.landing.copying()))
    }

    /// This side closes the connection to the peer in `slot`: the peer's
    /// requests served here stop (no copy starts).
    pub(crate) fn close_peer(&mut self, slot: usize) {
        if let Ok(peer) = self.peer_mut(slot) {
            peer.landing.close();
        }
    }

    /// Whether a copy for the requests of the peer in `slot` may still run.
    pub(crate) fn copying(&self, slot: usize) -> bool {
        self.peer(slot).is_some_and(|p| p.landing.copying())
    }

    // ------------------------------------------------- the naive form

    /// Asks the owner of staged grant `t.remote` (the peer in `slot`) to
    /// carry out `t` against our temporary grant `id` of the range
    /// (`grants`, announced with `descriptor`): the naive rendezvous. The
    /// cell ends with the owner's reply (our grant goes then).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rendezvous(
        &mut self,
        cx: &mut PathCx<'_, V, C>,
        slot: usize,
        t: &Transfer<'_, V>,
        id: u64,
        descriptor: &[u8],
        grants: Vec<Grant<V>>,
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError> {
        let peer = self.peer_mut(slot)?;
        cx.wire
            .send(slot, &Control::GrantAnnounce { descriptor }, timeout)?;
        cx.wire.send(slot, &staged_request(id, t, false), timeout)?;
        let cell = Arc::new(CompletionCell::new());
        peer.rendezvous.insert(
            id,
            Rendezvous {
                cell: Arc::clone(&cell),
                deadline: cx.now + timeout,
                timeout,
                grants,
            },
        );
        Ok(cell)
    }

    // ---------------------------------------------------- the serving

    /// Whether anything of a rendezvous waits for this side outside the
    /// lock (a request to serve, a served one whose op ended, landing
    /// slots to make): [`StagedPath::take_serve_work`] then.
    pub(crate) fn serve_pending(&self) -> bool {
        !self.serving.is_empty()
            || self
                .peers
                .iter()
                .flatten()
                .any(|p| !p.inbox.is_empty() || p.landing.wants_slots().is_some())
    }

    /// Serves the peers' naive rendezvous requests (refused ones answered
    /// at once, pipelined ones started) and answers those whose op ended;
    /// hands out what runs outside the lock.
    pub(crate) fn take_serve_work(&mut self, cx: &mut PathCx<'_, V, C>) -> ServeWork<V, C> {
        let mut work = ServeWork {
            worked: 0,
            unlocked: Vec::new(),
            fenced: Vec::new(),
        };
        let Self {
            peers,
            serving,
            pools,
            pipes,
            ..
        } = self;
        let max = cx.res.config.peer_limits.max_staged_requests;
        let mut piped = false;
        for (slot, peer) in peers.iter_mut().enumerate() {
            let Some(peer) = peer else { continue };
            let mut running = serving.iter().filter(|s| s.slot == slot).count();
            while let Some(ask) = peer.inbox.pop_front() {
                work.worked += 1;
                if running >= max {
                    reply(cx, slot, ask.id, BUSY);
                    continue;
                }
                // A use of the grant until the request ends: its revoke is
                // fenced only then.
                let served = peer
                    .served
                    .begin_use(ask.grant, access(ask.write), ask.offset, ask.len)
                    .map(|s| Served {
                        region: s.region.clone(),
                        offset: s.offset,
                        len: s.len,
                        rights: s.rights,
                    });
                let served = match served {
                    Ok(served) => served,
                    Err(refusal) => {
                        reply(cx, slot, ask.id, of_refusal(refusal));
                        continue;
                    }
                };
                running += 1;
                let theirs = match check_ask(&ask, &served, cx.wire.remote_grant(slot, ask.id)) {
                    Ok(theirs) => theirs,
                    Err(status) => {
                        work.fenced.extend(peer.served.end_use(ask.grant));
                        reply(cx, slot, ask.id, status);
                        continue;
                    }
                };
                let offset = served.offset + ask.offset;
                match served.region.inner.location {
                    MemoryLocation::Gpu { ordinal } if cx.res.config.staging_pipeline => {
                        // Through our pool, as our own staged transfer.
                        let _span =
                            tracing::debug_span!("serve_staged", id = ask.id, len = ask.len)
                                .entered();
                        let op = if ask.write { Op::Read } else { Op::Write };
                        let (pipe, cell) = Pipe::new(
                            slot,
                            op,
                            u32::from(ordinal),
                            &served.region,
                            offset,
                            ask.len,
                            &theirs,
                            0,
                            cx.now,
                            cx.res.config.default_timeout,
                        );
                        serving.push(Serving {
                            slot,
                            id: ask.id,
                            grant: ask.grant,
                            cell,
                            bounce: None,
                            copy_back: None,
                        });
                        pipes.push(pipe);
                        piped = true;
                    }
                    _ => work.unlocked.push(Unlocked::Serve(NaiveServe {
                        slot,
                        ask,
                        served,
                        theirs,
                    })),
                }
            }
        }
        if piped {
            pipeline::pump(cx, pipes, pools);
        }
        let (ended, still): (Vec<_>, Vec<_>) = std::mem::take(serving)
            .into_iter()
            .partition(|s| s.cell.is_done());
        *serving = still;
        for done in ended {
            work.worked += 1;
            let mut status = match done.cell.outcome() {
                Some(Ok(())) => OK,
                _ => FAILED,
            };
            // The copy into the granted memory only while the grant is
            // live (its revoke waits for this request's use to end).
            if status == OK && done.copy_back.is_some() {
                let live = peers
                    .get(done.slot)
                    .and_then(Option::as_ref)
                    .is_some_and(|p| p.served.is_live(done.grant));
                if live {
                    work.unlocked.push(Unlocked::CopyBack(done));
                    continue;
                }
                status = REVOKED;
            }
            if let Some(p) = peers.get_mut(done.slot).and_then(Option::as_mut) {
                work.fenced.extend(p.served.end_use(done.grant));
            }
            reply(cx, done.slot, done.id, status);
        }
        for (slot, peer) in peers.iter().enumerate() {
            let Some(peer) = peer else { continue };
            if cx.wire.peer(slot).is_some_and(|p| p.gone.is_none())
                && let Some(gpu) = peer.landing.wants_slots()
            {
                // Pinned with the GPU of the first request's grant.
                work.unlocked.push(Unlocked::Landing {
                    slot,
                    gpu: Some(gpu),
                });
            }
        }
        work
    }

    /// A naive serve started (watched until its op ends) or failed
    /// (answered now); what is fenced now goes with the returned value.
    pub(crate) fn serve_started(
        &mut self,
        cx: &mut PathCx<'_, V, C>,
        started: NaiveStarted<V, C>,
    ) -> Option<Served<V>> {
        let NaiveStarted { slot, ask, started } = started;
        match started {
            Ok(serving) => {
                self.serving.push(serving);
                None
            }
            Err(status) => {
                let fenced = self.end_use(slot, ask.grant);
                reply(cx, slot, ask.id, status);
                fenced
            }
        }
    }

    /// A served WRITE copied into the granted memory: answered, its use of
    /// the grant ended; what is fenced now goes with the returned value.
    pub(crate) fn serve_ended(
        &mut self,
        cx: &mut PathCx<'_, V, C>,
        copied: CopiedBack,
    ) -> Option<Served<V>> {
        let fenced = self.end_use(copied.slot, copied.grant);
        reply(cx, copied.slot, copied.id, copied.status);
        fenced
    }

    /// Ends a use of grant `grant` to the peer in `slot` (a revoke waiting
    /// for it may complete).
    fn end_use(&mut self, slot: usize, grant: u64) -> Option<Served<V>> {
        self.peer_mut(slot).ok()?.served.end_use(grant)
    }

    /// The landing slots of the peer in `slot` were made (or failed):
    /// installed and announced, or its requests fail. Returns how many were
    /// made (a driver counts it as work).
    pub(crate) fn landing_made(
        &mut self,
        cx: &mut PathCx<'_, V, C>,
        slot: usize,
        made: Result<LandingSlots<V, C>, EngineError>,
    ) -> usize {
        let timeout = cx.res.config.default_timeout;
        let peer = match self.peer_mut(slot) {
            Ok(peer) => peer,
            Err(e) => {
                tracing::warn!(error = %e, "announcing landing slots");
                return usize::from(made.is_ok());
            }
        };
        match made {
            Ok(made) => {
                if let Some(announce) = peer.landing.install(made)
                    && let Err(e) = cx.wire.send(slot, &announce.as_control(), timeout)
                {
                    tracing::warn!(error = %e, "announcing landing slots");
                }
                1
            }
            Err(e) => {
                tracing::warn!(error = %e, "making landing slots: the requests fail");
                // The protocol answers them (FAILED) at its next step.
                peer.landing.slots_failed();
                0
            }
        }
    }

    // ------------------------------------------------------ messages

    /// A control message from the peer in `slot`: the staged path takes
    /// those of its protocols (`None`) and gives the others back. What it
    /// answers goes out at its next step.
    pub(crate) fn receive<'m>(&mut self, slot: usize, message: Control<'m>) -> Option<Control<'m>> {
        let Ok(peer) = self.peer_mut(slot) else {
            return Some(message);
        };
        let message = match rendezvous::receive(&mut peer.landing, &mut peer.asks, message) {
            Ok(()) => return None,
            Err(message) => message,
        };
        match message {
            Control::StagedRequest {
                id,
                grant,
                offset,
                len,
                write,
                ..
            } => peer.inbox.push_back(StagedAsk {
                id,
                grant,
                offset,
                len,
                write,
            }),
            Control::StagedReply { id, status } => {
                if let Some(rendezvous) = peer.rendezvous.remove(&id) {
                    rendezvous.finish(reply_outcome(status));
                    // The owner's access to our range ended with the MRs.
                    peer.outbox.push(Control::GrantRevoke { grant: id });
                }
            }
            other => return Some(other),
        }
        None
    }

    /// Sends what was decided for the peer in `slot` as its messages came.
    fn flush_outbox(cx: &mut PathCx<'_, V, C>, slot: usize, peer: &mut StagedPeer<V, C>) {
        let timeout = cx.res.config.default_timeout;
        for message in peer.outbox.drain(..) {
            if let Err(e) = cx.wire.send(slot, &message, timeout) {
                tracing::debug!(error = %e, "revoking a rendezvous grant");
            }
        }
    }

    /// Ends the groups whose parts have all ended.
    fn resolve_groups(&mut self) {
        self.groups.retain(|g| !g.resolve());
    }
}

/// Answers request `id` of the peer in `slot` with `status`.
fn reply<V: Api, C: hal_cuda::Api>(cx: &mut PathCx<'_, V, C>, slot: usize, id: u64, status: u32) {
    let timeout = cx.res.config.default_timeout;
    if let Err(e) = cx
        .wire
        .send(slot, &Control::StagedReply { id, status }, timeout)
    {
        tracing::debug!(error = %e, "a staged reply not sent");
    }
}

impl<V: Api, C: hal_cuda::Api> TransferPath<V, C> for StagedPath<V, C> {
    /// The local region is staged or the peer's grant is.
    fn carries(
        &mut self,
        _res: &Resources<V, C>,
        _slot: usize,
        transfers: &[Transfer<'_, V>],
    ) -> bool {
        transfers.iter().any(|t| t.local.is_staged() || slotted(t))
    }

    /// The pipelined form: each transfer through the owner's landing slots
    /// (theirs staged; ours too, through our pool slice by slice) or our
    /// GPU's pool (ours staged, theirs direct). The naive form (the
    /// pipeline off) is refused here: it registers and copies
    /// synchronously, outside the engine's lock (the engine's).
    fn post(
        &mut self,
        cx: &mut PathCx<'_, V, C>,
        slot: usize,
        transfers: &[Transfer<'_, V>],
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError> {
        if transfers.iter().any(|t| !pipelined(&cx.res.config, t)) {
            return Err(EngineError::Refused(
                "the staged path pipelines only staging-rung transfers, with the pipeline on"
                    .into(),
            ));
        }
        let mut gpus = Vec::with_capacity(transfers.len());
        for t in transfers {
            gpus.push(rendezvous::staged_gpu(t)?);
        }
        let mut cells = Vec::with_capacity(transfers.len());
        let peer = self.peer_mut(slot)?;
        for t in transfers.iter().filter(|t| slotted(t)) {
            cells.push(peer.asks.ask(cx, slot, t, timeout)?);
        }
        let mut piped = false;
        for (t, gpu) in transfers.iter().zip(gpus).filter(|(t, _)| !slotted(t)) {
            let gpu = gpu.expect("a pipelined transfer of ours is staged GPU memory");
            let (pipe, cell) = Pipe::new(
                slot,
                t.op,
                gpu,
                t.local,
                t.local_offset,
                t.len,
                t.remote,
                t.remote_offset,
                cx.now,
                timeout,
            );
            self.pipes.push(pipe);
            cells.push(cell);
            piped = true;
        }
        if piped {
            pipeline::pump(cx, &mut self.pipes, &mut self.pools);
        }
        if cells.len() == 1 {
            return Ok(cells.remove(0));
        }
        let cell = Arc::new(CompletionCell::new());
        let group = Group {
            cell: Arc::clone(&cell),
            parts: cells,
        };
        if !group.resolve() {
            self.groups.push(group);
        }
        Ok(cell)
    }

    /// The pipes, this side's requests through the peers' landing slots
    /// (deadlines included: the naive rendezvous past theirs fail), the
    /// requests served through them; the serving of naive requests is
    /// [`StagedPath::take_serve_work`]'s.
    fn progress(&mut self, cx: &mut PathCx<'_, V, C>) -> usize {
        let now = cx.now;
        for peer in self.peers.iter_mut().flatten() {
            if peer.rendezvous.is_empty() {
                continue;
            }
            let late: Vec<u64> = peer
                .rendezvous
                .iter()
                .filter(|(_, r)| r.deadline <= now)
                .map(|(&id, _)| id)
                .collect();
            for id in late {
                if let Some(r) = peer.rendezvous.remove(&id) {
                    let after = r.timeout;
                    r.finish(Err(TransferError::Timeout { after }));
                }
            }
        }
        let mut moved = pipeline::pump(cx, &mut self.pipes, &mut self.pools);
        for (slot, peer) in self.peers.iter_mut().enumerate() {
            let Some(peer) = peer else { continue };
            if !peer.outbox.is_empty() {
                Self::flush_outbox(cx, slot, peer);
            }
            if !peer.landing.is_idle() {
                moved += rendezvous::pump_landing(cx, slot, &mut peer.landing, &mut peer.served);
            }
            if !peer.asks.is_idle() {
                moved += rendezvous::pump_asks(cx, slot, &mut peer.asks, &mut self.pools);
            }
        }
        self.resolve_groups();
        moved
    }

    fn on_control<'m>(
        &mut self,
        cx: &mut PathCx<'_, V, C>,
        slot: usize,
        message: Control<'m>,
    ) -> Result<Option<Control<'m>>, PeerMisbehaved> {
        let back = self.receive(slot, message);
        if let Ok(peer) = self.peer_mut(slot) {
            Self::flush_outbox(cx, slot, peer);
        }
        Ok(back)
    }

    /// The pipes and requests through landing slots: the naive
    /// rendezvous ends by its reply.
    fn cancel(&mut self, cells: &[Arc<CompletionCell>]) {
        let mut cells = cells.to_vec();
        for group in &self.groups {
            if cells.iter().any(|c| Arc::ptr_eq(c, &group.cell)) {
                cells.extend(group.parts.iter().cloned());
            }
        }
        pipeline::cancel(&mut self.pipes, &cells);
        for peer in self.peers.iter_mut().flatten() {
            peer.asks.cancel(&cells);
        }
    }

    /// Stops what the path does with the peer: its requests served here
    /// (no copy starts; its slots go at the next step, the copies waited
    /// for), the pipes to it and this side's requests to it (they end
    /// [`TransferError::PeerGone`] once their slices in flight drained).
    /// Its grants stay until revoked (a gone peer's are fenced once no
    /// copy for it runs).
    fn release_peer(&mut self, _cx: &mut PathCx<'_, V, C>, slot: usize) {
        for pipe in self.pipes.iter_mut().filter(|p| p.peer() == slot) {
            pipe.peer_gone();
        }
        if let Ok(peer) = self.peer_mut(slot) {
            peer.landing.close();
            peer.asks.peer_gone();
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let peers = self.peers.iter().flatten().flat_map(|p| {
            p.rendezvous
                .values()
                .map(|r| r.deadline)
                .chain(p.landing.poll_timeout())
                .chain(p.asks.poll_timeout())
        });
        self.pipes.iter().map(Pipe::deadline).chain(peers).min()
    }
}
