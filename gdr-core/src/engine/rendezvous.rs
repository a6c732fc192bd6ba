//! The pipelined rendezvous: a transfer against a peer's staging-rung
//! grant (GPU memory no NIC reaches, so no MR to name) moves slice by
//! slice through landing slots the owner lent to the requester, with
//! credits (the shape of UCX's pipelined rendezvous).
//!
//! - **Landing slots** (the owner's side, `Landing`): at a peer's first
//!   rendezvous the owner allocates
//!   [`super::EngineConfig::rendezvous_slots`] slots of
//!   [`super::EngineConfig::staging_slice`] bytes of pinned host memory
//!   (pinned with the GPU's context), registers them once, grants them to
//!   that peer only (read and write) and tells it so
//!   ([`Control::Slots`], the descriptor inside). They are freed when the
//!   peer goes.
//! - **The requester WRITEs** into the owner's staged memory: the owner
//!   hands out a free slot as a credit ([`Control::SlotReady`]: request,
//!   slice offset, slot, length); the requester RDMA-WRITEs the slice into
//!   it and, on that WRITE's completion, says so
//!   ([`Control::SlotFilled`]); the owner copies the slot to the GPU on a
//!   stream and, once the copy's event has passed, lends the slot again.
//!   After the last slice's copy: [`Control::StagedReply`] OK.
//! - **The requester READs**: the owner copies a slice GPU → slot, and once
//!   the copy's event passed sends `SlotReady`; the requester RDMA-READs
//!   the slot and returns the credit ([`Control::SlotDone`]). The
//!   requester's part ends when every slice arrived (the owner replies
//!   only to say it failed).
//! - **Both ends staged** (GPU→GPU without GDR anywhere): the requester's
//!   side of each slice goes through its own GPU's bounce pool
//!   ([`super::pipeline`]): device→host copy then WRITE from the pool
//!   slot, or READ into a pool slot then host→device copy. So the
//!   requester's copy, the wire and the owner's copy of different slices
//!   overlap.
//! - **Fairness, back-pressure**: a peer's slots go round-robin over its
//!   requests; a request larger than the slots goes in turns; slots of one
//!   peer are never another's, so peers do not wait on each other.
//! - **Whose state**: both protocols of a peer ([`Owner`], [`Requester`])
//!   are its connection's ([`gdr_proto::connection::Connection`], whose
//!   one deadline covers theirs); what carries them out here, a peer's
//!   `Landing` and `Asks`, is the staged path's part of that peer
//!   (`staging::StagedPeer`, in the peer's slot, under its lock). The
//!   functions here step them through the seam's `PathCx` (messages and
//!   RDMA ops on the wire to that peer, copies on the engine's GPUs),
//!   with the protocols the connection lends the step, never the engine
//!   itself. Landing slots are made
//!   outside every lock (`make_slots`, the engine granting them) and
//!   installed under the peer's (`Landing::install`).
//! - **The owner's decisions are the protocol's**: which slot serves which
//!   slice, which credit is honoured, what a revoke, the bound and the
//!   deadline do, live in [`gdr_proto::rendezvous::Owner`] (sans-IO,
//!   tested in memory); this module makes the slots and runs the copies
//!   it asks for. So are the requester's ([`gdr_proto::rendezvous::Requester`]:
//!   which credit moves a slice, what the owner is told, how a request
//!   ends, tested against the owner in memory); this module moves the
//!   slices (RDMA ops, its staging pool's copies).
//! - **Failures**: a CUDA copy failure at the owner fails its request
//!   ([`Control::StagedReply`] FAILED); one at the requester, a failed
//!   RDMA op, the deadline or the peer going fail the request here. A
//!   requester that gives up waits for its requests in flight to end, then
//!   tells the owner ([`Control::StagedCancel`]), which takes back every
//!   slot lent to the request. Each request completes exactly once.
//!
//! # Trust
//!
//! A peer may be hostile. Its slots are lent to it alone, and the owner
//! only ever copies between a slot and the GPU range of a request that
//! peer made and the owner checked against its grant (rights and bounds,
//! at the request). A peer can write anything into its slots at any time:
//! what it can corrupt is the data of its own transfers, nothing else. The
//! owner refuses (the request fails, [`super::staging`]'s `BAD_CREDIT`) a
//! `SlotFilled` or `SlotDone` naming a slot out of range, one not lent, one
//! lent to another request, or the wrong direction; so no copy runs from a
//! slot the owner did not lend for exactly that slice. An unknown request
//! id is dropped. A peer that never returns a credit holds up only its own
//! slots. The requester in turn checks each `SlotReady` (slot in range and
//! not carrying another slice, the slice inside its request and inside one
//! slot) before touching its
//! memory.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hal_cuda::{Context as _, Stream as _};

use super::completion::CompletionCell;
use super::cuda_worker::Pending;
use super::path::{PathCx, RdmaOp};
use super::pipeline::{self, PendingCopy, StagingPool, TO_GPU, TO_HOST, copy_event};
use super::resources::Resources;
use super::staging;
use super::wire::Control;
use super::{
    EngineError, Op, PeerGone, PeerMisbehaved, Refusal, Region, TimedOut, Transfer, TransferError,
};
use crate::buffer::Buffer;
use crate::descriptor::{GrantRights, MemoryDescriptor, MemoryLocation, Reach};
use crate::ladder::MrGrant;
use gdr_proto::grants::LocalGrants;
use gdr_proto::rendezvous::{
    AskFailure, CopyId, Owner, OwnerAction, Placement, Requester, RequesterAction,
};

/// Slices of one request a requester has on the wire (RDMA ops posted,
/// not ended) at once. With every credited slice posted together, their
/// WRITEs landed together and the owner's copies of them ran only after
/// the wire (a trace of the H200 bench): two keep the wire busy while the
/// owner's copy of the slice before runs behind it.
pub(crate) const WIRE_WINDOW: usize = 2;

/// A message of the peer about the requests this side serves, in order.
#[derive(Debug, Clone, Copy)]
enum ToOwner {
    Request(staging::StagedAsk),
    Filled { id: u64, slot: u32 },
    Done { id: u64, slot: u32 },
    Cancel { id: u64 },
}

/// A message of the peer about this side's requests, in order.
#[derive(Debug, Clone)]
enum ToAsker {
    Slots {
        slot_len: u64,
        count: u32,
        descriptor: Vec<u8>,
    },
    Ready {
        id: u64,
        offset: u64,
        len: u64,
        slot: u32,
    },
    Reply {
        id: u64,
        status: u32,
    },
}

/// Takes a rendezvous message off the wire into the peer's `landing` (the
/// owner's side) or `asks` (the requester's): `Err` gives it back when it
/// is none of this module's (a request not through landing slots, which
/// the staged path refuses, among others).
pub(super) fn receive<'a>(
    landing: &mut Landing,
    asks: &mut Asks,
    requester: &Requester,
    message: Control<'a>,
) -> Result<(), Control<'a>> {
    let owner = &mut landing.inbox;
    let asker = &mut asks.inbox;
    match message {
        Control::StagedRequest {
            id,
            grant,
            offset,
            len,
            write,
            slots: true,
        } => owner.push_back(ToOwner::Request(staging::StagedAsk {
            id,
            grant,
            offset,
            len,
            write,
        })),
        Control::SlotFilled { id, slot } => owner.push_back(ToOwner::Filled { id, slot }),
        Control::SlotDone { id, slot } => owner.push_back(ToOwner::Done { id, slot }),
        Control::StagedCancel { id } => owner.push_back(ToOwner::Cancel { id }),
        Control::Slots {
            slot_len,
            count,
            descriptor,
        } => asker.push_back(ToAsker::Slots {
            slot_len,
            count,
            descriptor: descriptor.to_vec(),
        }),
        Control::SlotReady {
            id,
            offset,
            len,
            slot,
        } => asker.push_back(ToAsker::Ready {
            id,
            offset,
            len,
            slot,
        }),
        Control::StagedReply { id, status } if requester.knows(id) => {
            asker.push_back(ToAsker::Reply { id, status })
        }
        other => return Err(other),
    }
    Ok(())
}

// ---------------------------------------------------------------- owner

/// The owner's side of one peer, what carries out its protocol here (the
/// [`Owner`], which the peer's connection keeps: which request each
/// landing slot serves, credits, revokes, bounds and deadlines): the
/// peer's messages for it, the slots' memory, registration and grant
/// (made at the peer's first request) and the copies running.
pub(super) struct Landing {
    inbox: VecDeque<ToOwner>,
    /// Landings of this peer handed to the CUDA worker when it went (see
    /// `pump_landing`), each set once the worker has dropped it, its
    /// streams synchronized: until then copies of the gone peer's requests
    /// may still run, and its grants are not fenced.
    retiring: Vec<Pending<()>>,
    /// A thread is making the slots outside every lock
    /// ([`Landing::claim_slots`]): no other makes a second set (whose
    /// free, a pinned free, waits for the whole GPU).
    making: bool,
    /// Field order is drop order: the copies' events, then the slots
    /// (whose drop waits for their streams).
    copies: HashMap<CopyId, PendingCopy>,
    slots: Option<Slots>,
}

impl Default for Landing {
    /// Nothing lent yet.
    fn default() -> Self {
        Self {
            inbox: VecDeque::new(),
            retiring: Vec::new(),
            making: false,
            copies: HashMap::new(),
            slots: None,
        }
    }
}

impl Landing {
    /// The peer's requests served through the landing slots now, and the
    /// copies in or out of them running.
    pub fn load(&self, owner: &Owner) -> (usize, usize) {
        (owner.requests(), self.copies.len())
    }

    /// The GPU to pin landing slots with when the peer's requests wait for
    /// slots not made yet (made outside every lock).
    pub fn wants_slots(&self, owner: &Owner) -> Option<u32> {
        if self.slots.is_some() || self.making {
            return None;
        }
        owner.wants_slots()
    }

    /// [`Landing::wants_slots`], claiming the making for the caller until
    /// it hands the result back ([`Landing::install`] or
    /// [`Landing::slots_failed`]).
    pub fn claim_slots(&mut self, owner: &Owner) -> Option<u32> {
        let gpu = self.wants_slots(owner)?;
        self.making = true;
        Some(gpu)
    }

    /// Whether a copy for the peer's requests may still run: one of this
    /// landing's, or one of a landing handed to the CUDA worker when the
    /// peer went that the worker has not dropped yet.
    pub fn copying(&self, owner: &Owner) -> bool {
        !self.copies.is_empty()
            || owner.copying()
            || self.retiring.iter().any(|done| done.get().is_none())
    }

    /// Whether anything waits to be handled.
    pub fn is_idle(&self, owner: &Owner) -> bool {
        self.inbox.is_empty()
            && owner.is_idle()
            && self.copies.is_empty()
            && self.retiring.iter().all(|done| done.get().is_some())
    }
}

/// A GPU's (device→host, host→device) streams, shared with the copies
/// handed to the CUDA worker.
type StreamPair = (
    Arc<hal_cuda::dynamic::DynStream>,
    Arc<hal_cuda::dynamic::DynStream>,
);

/// Pinned host slots registered once and granted to one peer. Field order
/// is drop order: the copies are waited for, the grant's MRs go, then the
/// registration, then the memory.
struct Slots {
    /// Per GPU: (device→host, host→device) streams.
    streams: HashMap<u32, StreamPair>,
    slot_len: u64,
    count: u32,
    _grants: Vec<MrGrant>,
    _region: Region,
    buffer: Buffer,
}

impl Drop for Slots {
    fn drop(&mut self) {
        // Copies into or out of the slots may still run: wait for them
        // before the memory goes (errors change nothing then).
        for (to_host, to_device) in self.streams.values() {
            let _ = to_host.synchronize();
            let _ = to_device.synchronize();
        }
    }
}

impl Slots {
    fn slot_addr(&self, slot: u32) -> u64 {
        self.buffer.addr() + u64::from(slot) * self.slot_len
    }
}

/// Where a staged grant's bytes are, for the protocol.
fn placement(served: &staging::Served) -> Option<Placement> {
    match served.region.location() {
        MemoryLocation::Gpu { ordinal } => Some(Placement {
            gpu: u32::from(ordinal),
            addr: served.region.inner.addr + served.offset,
        }),
        MemoryLocation::Host => None,
    }
}

// ------------------------------------------------------------ requester

/// This side's requests through one peer's landing slots, what carries
/// out their protocol here (the [`Requester`], which the peer's
/// connection keeps: which slices may move, what the owner is told, how
/// each request ends): the owner's messages for it, the slots it lent and
/// what the driver holds of each request.
#[derive(Default)]
pub(super) struct Asks {
    inbox: VecDeque<ToAsker>,
    /// The peer's landing slots lent to this side (their grant).
    slots: Option<PeerSlots>,
    asking: HashMap<u64, Asking>,
}

impl Asks {
    /// This side's requests through the peer's landing slots now.
    pub fn asked(&self) -> usize {
        self.asking.len()
    }
}

impl Asks {
    /// Whether a request through the peer's landing slots runs (its
    /// staged side copies through a pool, seen by polling).
    pub fn asking(&self) -> bool {
        !self.asking.is_empty()
    }
}

/// The peer's landing slots lent to this side.
struct PeerSlots {
    descriptor: MemoryDescriptor,
    slot_len: u64,
}

/// What the driver holds of one of this side's requests through the
/// peer's slots.
struct Asking {
    write: bool,
    cell: Arc<CompletionCell>,
    deadline: Instant,
    timeout: Duration,
    local: Region,
    /// Address of the local range's first byte.
    local_addr: u64,
    /// The local range is staged: its side of each slice goes through
    /// this GPU's pool.
    staged_gpu: Option<u32>,
    slices: Vec<AskSlice>,
    /// Why a slice failed here (the protocol knows only that one did).
    error: Option<TransferError>,
}

/// What moving a request's slices did, for its protocol: slots whose
/// slice's wire op ended, slices that ended (slot, length, whole), and
/// whether one failed.
#[derive(Default)]
struct SliceEvents {
    wired: Vec<u32>,
    ended: Vec<(u32, u64, bool)>,
    failed: bool,
}

/// A slice the owner lent a slot for. Through this side's pool it moves in
/// chunks of at most a pool slot.
struct AskSlice {
    slot: u32,
    offset: u64,
    len: u64,
    /// Bytes of the slice whose chunk ended.
    pos: u64,
    chunk: u64,
    pool_slot: Option<usize>,
    stage: AskStage,
}

enum AskStage {
    /// The next chunk waits for a pool slot (or to be posted).
    Waiting,
    /// Device→host into the pool slot (a WRITE through the pool).
    CopyOut(PendingCopy),
    Wire(Arc<CompletionCell>),
    /// Pool slot → device (a READ through the pool).
    CopyIn(PendingCopy),
}

impl Landing {
    /// Making the slots failed: the requests waiting for them fail
    /// (FAILED, at the protocol's next step).
    pub fn slots_failed(&mut self, owner: &mut Owner) {
        self.making = false;
        owner.slots_failed();
    }

    /// Installs the slots made for the peer: the announcement to send, or
    /// `None` when the peer has slots already (these go; the claim in
    /// [`Landing::claim_slots`] keeps a second set from being made).
    pub fn install(&mut self, owner: &mut Owner, made: LandingSlots) -> Option<SlotsAnnounce> {
        self.making = false;
        if self.slots.is_some() {
            return None;
        }
        let LandingSlots { slots, announce } = made;
        owner.slots_made(slots.count, slots.slot_len);
        self.slots = Some(slots);
        Some(announce)
    }

}

/// Landing slots made for one peer (outside every lock) and their
/// announcement, to install ([`Landing::install`]).
pub(crate) struct LandingSlots {
    slots: Slots,
    announce: SlotsAnnounce,
}

/// Allocates and registers landing slots for the peer in slot `peer`
/// (pinned with GPU `gpu`'s context) and grants them with `grant` (to
/// that peer only: the engine's grant of `len` bytes of the region, read
/// and write). Runs outside every lock.
pub(super) fn make_slots(
    res: &Resources,
    peer: usize,
    gpu: Option<u32>,
    grant: impl FnOnce(&Region, u64) -> Result<(MemoryDescriptor, Vec<MrGrant>), EngineError>,
) -> Result<LandingSlots, EngineError> {
    let config = &res.config;
    let slot_len = config
        .staging_slice
        .clamp(4096, u64::from(u32::MAX) & !4095);
    let count = config.rendezvous_slots.clamp(1, u32::MAX as usize);
    let _span = tracing::debug_span!("landing_slots", peer, count, slot_len).entered();
    let len = slot_len * count as u64;
    let pinned = gpu
        .and_then(|o| res.gpu(o).ok())
        .and_then(|g| Buffer::alloc_pinned(&g.context, len).ok());
    let buffer = pinned.unwrap_or_else(|| Buffer::alloc_host(len));
    let region = res.register(&buffer)?;
    let (descriptor, grants) = grant(&region, len)?;
    if grants.is_empty() {
        return Err(EngineError::Refused(Refusal::LandingSlotsOnStagingRung));
    }
    let announce = SlotsAnnounce {
        slot_len,
        count: count as u32,
        descriptor: descriptor.encode()?,
    };
    // A stream pair per GPU, made here (outside progress) for the copies
    // of whichever GPU's grants the slots serve.
    let mut streams = HashMap::new();
    for g in res.nics.first().map_or(&[][..], |n| n.ladder.gpus()) {
        let stream = || g.context.create_stream().map(Arc::new);
        streams.insert(g.attributes.ordinal, (stream()?, stream()?));
    }
    tracing::info!(peer, count, slot_len, "landing slots lent");
    Ok(LandingSlots {
        slots: Slots {
            streams,
            slot_len,
            count: count as u32,
            _grants: grants,
            _region: region,
            buffer,
        },
        announce,
    })
}

impl Asks {
    /// Cancels this side's requests whose outcome goes to one of `cells`:
    /// no new slice starts; each ends [`TransferError::Cancelled`] once its
    /// slices in flight have drained, and the owner is told to take its
    /// slots back ([`Control::StagedCancel`]).
    pub fn cancel(&mut self, requester: &mut Requester, cells: &[Arc<CompletionCell>]) {
        for (&id, ask) in self.asking.iter() {
            if cells.iter().any(|c| Arc::ptr_eq(c, &ask.cell)) {
                requester.fail(id, AskFailure::Cancelled);
            }
        }
    }

    /// Whether nothing waits to be handled.
    pub fn is_idle(&self, requester: &Requester) -> bool {
        self.inbox.is_empty() && requester.is_idle()
    }

    /// Asks the owner (the peer in `peer`) of staged grant `t.remote` to
    /// move `t` through the landing slots it lends this side; the returned
    /// cell ends with the request.
    pub fn ask(
        &mut self,
        requester: &mut Requester,
        cx: &mut PathCx<'_>,
        peer: usize,
        t: &Transfer<'_>,
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError> {
        let staged_gpu = staged_gpu(t)?;
        let cell = Arc::new(CompletionCell::new());
        let now = cx.now;
        let id = requester.next_id();
        let _span = tracing::debug_span!("ask_slots", id, len = t.len).entered();
        cx.wire
            .send(peer, &staging::staged_request(id, t), timeout)?;
        let started = requester.start(t.op == Op::Write, t.len, now, timeout);
        debug_assert_eq!(started, id);
        self.asking.insert(
            id,
            Asking {
                write: t.op == Op::Write,
                cell: Arc::clone(&cell),
                deadline: now + timeout,
                timeout,
                local: t.local.clone(),
                local_addr: t.local.inner.addr + t.local_offset,
                staged_gpu,
                slices: Vec::new(),
                error: None,
            },
        );
        Ok(cell)
    }
}

/// The GPU whose pool carries this side of `t`'s slices: `None` when its
/// local memory is not staged; refused for staged host memory.
pub(super) fn staged_gpu(t: &Transfer<'_>) -> Result<Option<u32>, EngineError> {
    match (t.local.is_staged(), t.local.location()) {
        (false, _) => Ok(None),
        (true, MemoryLocation::Gpu { ordinal }) => Ok(Some(u32::from(ordinal))),
        (true, MemoryLocation::Host) => Err(EngineError::Refused(Refusal::HostMemoryOnStagingRung)),
    }
}

// ------------------------------------------------------ owner's steps

/// Carries the owner's protocol with the peer in `slot` one step: the
/// peer's messages in, copies that ended, deadlines, then what the
/// protocol decides (messages out, copies started). `served`: this side's
/// grants to the peer of staging-rung regions.
pub(super) fn pump_landing(
    cx: &mut PathCx<'_>,
    slot: usize,
    landing: &mut Landing,
    owner: &mut Owner,
    served: &mut LocalGrants<staging::Served>,
) -> usize {
    if cx.wire.peer(slot).is_none_or(|p| p.gone.is_some()) {
        // Its slots go with it, on the CUDA worker once the copies queued
        // there have been (their streams are synchronized then). Until the
        // worker has dropped it, its copies may still run: the fresh
        // landing keeps the worker's word for that (`copying`), so a
        // revoke of a gone peer's grant waits for it.
        let before = landing.retiring.len();
        landing.retiring.retain(|done| done.get().is_none());
        let mut moved = before - landing.retiring.len();
        // A landing already emptied only waits for its retiring ones (the
        // staged path polls while they run): nothing to make anew.
        let holds = landing.slots.is_some()
            || !landing.copies.is_empty()
            || !landing.inbox.is_empty()
            || !owner.is_idle();
        if holds {
            let retiring = std::mem::take(&mut landing.retiring);
            let gone = std::mem::take(landing);
            // The gone peer's requests go with it: its protocol anew.
            *owner = Owner::new(&cx.res.config.peer_limits);
            landing.retiring = retiring;
            if gone.slots.is_some() || !gone.copies.is_empty() {
                landing.retiring.push(cx.res.cuda.run(cx.res, move |_| drop(gone)));
            }
            moved += 1;
        }
        return moved;
    }
    let now = cx.now;
    let mut moved = 0;
    let mut send = Vec::new();
    let mut fenced = Vec::new();
    while let Some(message) = landing.inbox.pop_front() {
        moved += 1;
        match message {
            ToOwner::Request(ask) => {
                tracing::trace!(
                    peer = slot,
                    id = ask.id,
                    len = ask.len,
                    write = ask.write,
                    "rendezvous owner: request accepted"
                );
                owner.on_request(served, ask, placement, now)
            }
            ToOwner::Filled { id, slot: s } => {
                tracing::trace!(id, slot = s, "rendezvous owner: slot filled");
                owner.on_filled(id, s)
            }
            ToOwner::Done { id, slot: s } => {
                tracing::trace!(id, slot = s, "rendezvous owner: slot returned");
                owner.on_done(id, s)
            }
            ToOwner::Cancel { id } => owner.on_cancel(id),
        }
    }
    let mut ended = Vec::new();
    landing.copies.retain(
        |&copy, pending| match pending.is_complete("a landing copy") {
            Ok(false) => true,
            Ok(true) => {
                ended.push((copy, true));
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, "a landing copy failed");
                ended.push((copy, false));
                false
            }
        },
    );
    for (copy, ok) in ended {
        moved += 1;
        tracing::trace!(?copy, ok, "rendezvous owner: copy done");
        owner.copy_ended(copy, ok);
    }
    // Its deadlines were handled by the connection (the engine's pass,
    // before this step).
    loop {
        owner.step(served, &mut fenced);
        let mut acted = false;
        while let Some(action) = owner.poll_action() {
            acted = true;
            moved += 1;
            match action {
                OwnerAction::Reply { id, status } => {
                    if status == staging::TIMED_OUT {
                        tracing::warn!(id, "a staged request outlived its deadline");
                    }
                    send.push(Control::StagedReply { id, status })
                }
                OwnerAction::SlotReady {
                    id,
                    offset,
                    len,
                    slot,
                } => {
                    tracing::trace!(id, offset, len, slot, "rendezvous owner: slot lent");
                    send.push(Control::SlotReady {
                        id,
                        offset,
                        len,
                        slot,
                    })
                }
                OwnerAction::Copy {
                    copy,
                    slot,
                    to_gpu,
                    gpu,
                    gpu_addr,
                    len,
                } => match start_landing_copy(
                    cx.res,
                    landing.slots.as_mut(),
                    slot,
                    to_gpu,
                    gpu,
                    gpu_addr,
                    len,
                ) {
                    Ok(event) => {
                        tracing::trace!(
                            ?copy,
                            slot,
                            len,
                            "{}",
                            if to_gpu {
                                "rendezvous owner: copy in started"
                            } else {
                                "rendezvous owner: copy out started"
                            }
                        );
                        landing.copies.insert(copy, event);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, to_gpu, "a landing copy");
                        owner.copy_ended(copy, false);
                    }
                },
            }
        }
        if !acted {
            break;
        }
    }
    // Grants fenced now: their regions go (under the lock: a staged region
    // holds no MR to deregister).
    drop(fenced);
    let timeout = cx.res.config.default_timeout;
    for message in send {
        if let Err(e) = cx.wire.send(slot, &message, timeout) {
            tracing::debug!(error = %e, "a rendezvous message not sent");
        }
    }
    moved
}

/// Starts copy `len` bytes between landing slot `slot` and device
/// address `gpu_addr` of GPU `gpu` (into the GPU when `to_gpu`), as
/// the owner's protocol decided: handed to the CUDA worker.
fn start_landing_copy(
    res: &Resources,
    slots: Option<&mut Slots>,
    slot: u32,
    to_gpu: bool,
    gpu: u32,
    gpu_addr: u64,
    len: u64,
) -> Result<PendingCopy, TransferError> {
    let slots = slots.ok_or(TransferError::Internal {
        what: "a landing copy before the slots were made",
    })?;
    if slot >= slots.count || len > slots.slot_len {
        return Err(PeerMisbehaved::UnknownSlot { slot, len }.into());
    }
    let host = slots.slot_addr(slot);
    let (to_host, to_device) = slots.streams.get(&gpu).ok_or(TransferError::Internal {
        what: "a landing copy on a GPU the engine does not have",
    })?;
    let (stream, what) = if to_gpu {
        (to_device, TO_GPU)
    } else {
        (to_host, TO_HOST)
    };
    // The memory: the slots stay until every job queued before their
    // drop has run (dropped on the worker: `drop_on_worker`); the grant's
    // region is held by the request until this copy has ended.
    copy_event(res, gpu, stream, what, (), move |stream| {
        if to_gpu {
            // SAFETY: the slot (gdr's pinned memory; `len` ≤ a slot,
            // checked above) is this slice's until the copy's event has
            // passed (the protocol lends it to no one meanwhile);
            // `gpu_addr..gpu_addr + len` lies in the request's range of
            // a staged grant the protocol checked, and the grant's
            // region (its memory) is held until this copy has ended.
            unsafe { stream.copy_host_to_device(gpu_addr, host as *const u8, len as usize) }
        } else {
            // SAFETY: as above, the other way: the slot is neither lent
            // nor copied into by anything else until the event passed.
            unsafe { stream.copy_device_to_host(host as *mut u8, gpu_addr, len as usize) }
        }
    })
}

// -------------------------------------------------- requester's steps

/// Carries this side's requests through the landing slots of the peer in
/// `slot` one step: the owner's messages in, the slices moved as far as
/// they go, then what the protocol decides (messages out, requests that
/// ended). Slices of staged local memory go through `pools`.
pub(super) fn pump_asks(
    cx: &mut PathCx<'_>,
    slot: usize,
    asks: &mut Asks,
    requester: &mut Requester,
    pools: &mut HashMap<u32, StagingPool>,
) -> usize {
    let (engine, gone) = match cx.wire.peer(slot) {
        Some(p) => (p.engine, p.gone),
        None => (0, Some(PeerGone::Closed)),
    };
    let mut moved = 0;
    let mut send: Vec<Control<'static>> = Vec::new();
    while let Some(message) = asks.inbox.pop_front() {
        moved += 1;
        match message {
            ToAsker::Slots {
                slot_len,
                count,
                descriptor,
            } => match MemoryDescriptor::decode(&descriptor) {
                Ok(d)
                    if d.owner == engine
                        && matches!(d.reach, Reach::Direct(_))
                        && d.rights == GrantRights::ReadWrite
                        && slot_len.checked_mul(u64::from(count)) == Some(d.len) =>
                {
                    asks.slots = Some(PeerSlots {
                        descriptor: d,
                        slot_len,
                    });
                    requester.on_slots(slot_len, count);
                }
                _ => tracing::warn!("the peer lent landing slots that do not add up: ignored"),
            },
            ToAsker::Reply { id, status } => requester.on_reply(id, status),
            ToAsker::Ready {
                id,
                offset,
                len,
                slot,
            } => requester.on_ready(id, offset, len, slot),
        }
    }
    if gone.is_some() {
        requester.peer_gone();
    }
    // Its deadlines were handled by the connection (the engine's pass,
    // before this step).
    moved += take_ask_actions(asks, requester, &gone, &mut send);
    let ids: Vec<u64> = asks.asking.keys().copied().collect();
    for id in ids {
        let Some(mut a) = asks.asking.remove(&id) else {
            continue;
        };
        let failing = requester.is_failing(id);
        let mut events = SliceEvents::default();
        if let Some(slots) = asks.slots.as_ref() {
            moved += advance_ask(cx, slot, slots, pools, id, &mut a, failing, &mut events);
        }
        for slot in events.wired {
            requester.wired(id, slot);
        }
        for (slot, len, whole) in events.ended {
            requester.slice_ended(id, slot, len, whole);
        }
        if events.failed {
            requester.fail(id, AskFailure::Local);
        }
        asks.asking.insert(id, a);
    }
    requester.step();
    moved += take_ask_actions(asks, requester, &gone, &mut send);
    let timeout = cx.res.config.default_timeout;
    for message in send {
        if let Err(e) = cx.wire.send(slot, &message, timeout) {
            tracing::debug!(error = %e, "a rendezvous message not sent");
        }
    }
    moved
}

/// Carries out what the requester's protocol decided: slices to move
/// (handed to their request), messages for the owner (into `send`),
/// requests that ended (their batch completed once).
fn take_ask_actions(
    asks: &mut Asks,
    requester: &mut Requester,
    gone: &Option<PeerGone>,
    send: &mut Vec<Control<'static>>,
) -> usize {
    let mut moved = 0;
    while let Some(action) = requester.poll_action() {
        moved += 1;
        match action {
            RequesterAction::Move {
                id,
                slot,
                offset,
                len,
            } => {
                if let Some(a) = asks.asking.get_mut(&id) {
                    a.slices.push(AskSlice {
                        slot,
                        offset,
                        len,
                        pos: 0,
                        chunk: 0,
                        pool_slot: None,
                        stage: AskStage::Waiting,
                    });
                }
            }
            RequesterAction::Filled { id, slot } => {
                tracing::trace!(id, slot, "rendezvous asker: credit back (filled)");
                send.push(Control::SlotFilled { id, slot })
            }
            RequesterAction::Done { id, slot } => {
                tracing::trace!(id, slot, "rendezvous asker: credit back (done)");
                send.push(Control::SlotDone { id, slot })
            }
            RequesterAction::Cancel { id } => send.push(Control::StagedCancel { id }),
            RequesterAction::End { id, outcome } => {
                let Some(mut a) = asks.asking.remove(&id) else {
                    continue;
                };
                let outcome = outcome.map_err(|why| match why {
                    AskFailure::Refused(status) => {
                        staging::reply_outcome(status).expect_err("a failure status")
                    }
                    AskFailure::PeerGone => {
                        TransferError::PeerGone(gone.clone().unwrap_or(PeerGone::Closed))
                    }
                    AskFailure::TimedOut => TransferError::Timeout(TimedOut { after: a.timeout }),
                    AskFailure::Cancelled => TransferError::Cancelled,
                    AskFailure::BadCredit { slot, offset, len } => {
                        PeerMisbehaved::BadCredit { slot, offset, len }.into()
                    }
                    AskFailure::Local => a.error.take().unwrap_or(TransferError::Internal {
                        what: "a slice of the rendezvous failed",
                    }),
                    AskFailure::Incomplete => PeerMisbehaved::EndedEarly.into(),
                });
                a.cell.complete(outcome);
            }
        }
    }
    moved
}

/// Moves each slice of request `a` (`id`) as far as it can go now, with
/// at most [`WIRE_WINDOW`] of them on the wire at once.
#[allow(clippy::too_many_arguments)]
fn advance_ask(
    cx: &mut PathCx<'_>,
    peer: usize,
    slots: &PeerSlots,
    pools: &mut HashMap<u32, StagingPool>,
    id: u64,
    a: &mut Asking,
    mut failing: bool,
    events: &mut SliceEvents,
) -> usize {
    let mut pool = match a.staged_gpu {
        Some(gpu) => match pipeline::pool(cx.res, pools, gpu) {
            Ok(pool) => Some(pool),
            Err(e) => {
                a.error
                    .get_or_insert(TransferError::from_engine("the staging pool", e));
                failing = true;
                events.failed = true;
                None
            }
        },
        None => None,
    };
    let op = if a.write { Op::Write } else { Op::Read };
    let window = (a.deadline, a.timeout);
    let mut moved = 0;
    let mut index = 0;
    // Slices on the wire now: no other wire op is posted while
    // WIRE_WINDOW are.
    let mut on_wire = a
        .slices
        .iter()
        .filter(|s| matches!(s.stage, AskStage::Wire(_)))
        .count();
    while index < a.slices.len() {
        let slice = &mut a.slices[index];
        let remote_at = u64::from(slice.slot) * slots.slot_len + slice.pos;
        // What this step did: `None` nothing; `Some(Ok(()))` the slice
        // moved on; `Some(Err(e))` it ends (`e`: why it failed).
        let mut step: Option<Result<(), Option<TransferError>>> = None;
        let wire_full = on_wire >= WIRE_WINDOW;
        match &slice.stage {
            AskStage::Waiting if failing => step = Some(Err(None)),
            // A READ through the pool and a direct op post at once: they
            // wait for room on the wire (a WRITE through the pool copies
            // out first, then waits in `CopyOut`).
            AskStage::Waiting if wire_full && (pool.is_none() || !a.write) => {}
            AskStage::Waiting => match pool.as_deref_mut() {
                None => {
                    // Direct: the whole slice in one RDMA op.
                    slice.chunk = slice.len;
                    let local_addr = a.local_addr + slice.offset;
                    step = Some(
                        cx.wire
                            .post_rdma(
                                peer,
                                a.staged_gpu,
                                slice.slot as usize,
                                RdmaOp {
                                    op,
                                    remote: &slots.descriptor,
                                    remote_at,
                                    local: &a.local,
                                    local_addr,
                                    len: slice.len,
                                },
                                window,
                            )
                            .map(|cell| {
                                on_wire += 1;
                                tracing::trace!(
                                    id,
                                    slot = slice.slot,
                                    len = slice.len,
                                    "rendezvous asker: wire post"
                                );
                                slice.stage = AskStage::Wire(cell)
                            }),
                    );
                }
                Some(pool) => {
                    if let Some(pool_slot) = pool.free.pop() {
                        slice.pool_slot = Some(pool_slot);
                        slice.chunk = (slice.len - slice.pos).min(pool.slot_size);
                        let gpu_addr = a.local_addr + slice.offset + slice.pos;
                        let at = pool.slot_addr(pool_slot);
                        let chunk = slice.chunk;
                        step = Some(if a.write {
                            let keep = (a.local.clone(), pool.region.clone());
                            copy_event(
                                cx.res,
                                pool.gpu,
                                &pool.to_host,
                                TO_HOST,
                                keep,
                                move |stream| {
                                    // SAFETY: the pool slot is this chunk's
                                    // until freed (after its WRITE); the
                                    // source lies in the request's checked
                                    // local range (the slice is inside the
                                    // request); both memories held (`keep`)
                                    // until the copy is queued.
                                    unsafe {
                                        stream.copy_device_to_host(
                                            at as *mut u8,
                                            gpu_addr,
                                            chunk as usize,
                                        )
                                    }
                                },
                            )
                            .map(|event| {
                                tracing::trace!(
                                    id,
                                    slot = slice.slot,
                                    chunk,
                                    "rendezvous asker: copy out"
                                );
                                slice.stage = AskStage::CopyOut(event)
                            })
                            .map_err(Some)
                        } else {
                            cx.wire
                                .post_rdma(
                                    peer,
                                    Some(pool.gpu),
                                    pool_slot,
                                    RdmaOp {
                                        op: Op::Read,
                                        remote: &slots.descriptor,
                                        remote_at,
                                        local: &pool.region,
                                        local_addr: at,
                                        len: chunk,
                                    },
                                    window,
                                )
                                .map(|cell| {
                                    on_wire += 1;
                                    tracing::trace!(
                                        id,
                                        slot = slice.slot,
                                        chunk,
                                        "rendezvous asker: wire post"
                                    );
                                    slice.stage = AskStage::Wire(cell)
                                })
                        });
                    }
                }
            },
            AskStage::CopyOut(copy) => match copy.is_complete(TO_HOST) {
                Ok(false) => {}
                Ok(true) if failing => step = Some(Err(None)),
                // Copied out; posted once the wire has room.
                Ok(true) if wire_full => {}
                Ok(true) => {
                    let pool = pool.as_deref().expect("a pool slot has its pool");
                    let at = pool.slot_addr(slice.pool_slot.expect("a pool slot"));
                    step = Some(
                        cx.wire
                            .post_rdma(
                                peer,
                                Some(pool.gpu),
                                slice.slot as usize,
                                RdmaOp {
                                    op: Op::Write,
                                    remote: &slots.descriptor,
                                    remote_at,
                                    local: &pool.region,
                                    local_addr: at,
                                    len: slice.chunk,
                                },
                                window,
                            )
                            .map(|cell| {
                                on_wire += 1;
                                tracing::trace!(
                                    id,
                                    slot = slice.slot,
                                    chunk = slice.chunk,
                                    "rendezvous asker: copied out, wire post"
                                );
                                slice.stage = AskStage::Wire(cell)
                            }),
                    );
                }
                Err(e) => step = Some(Err(Some(e))),
            },
            AskStage::Wire(cell) => match cell.outcome() {
                None => {}
                Some(Err(e)) => {
                    on_wire -= 1;
                    tracing::trace!(id, slot = slice.slot, error = %e, "rendezvous asker: wire failed");
                    step = Some(Err(Some(e)))
                }
                Some(Ok(())) => {
                    on_wire -= 1;
                    tracing::trace!(
                        id,
                        slot = slice.slot,
                        chunk = slice.chunk,
                        "rendezvous asker: wire done"
                    );
                    let last = slice.pos + slice.chunk == slice.len;
                    if last {
                        // The slot holds the slice (a WRITE) or is the
                        // owner's again (a READ): the protocol says so.
                        events.wired.push(slice.slot);
                    }
                    let through_pool = pool.is_some() && !a.write && !failing;
                    match pool.as_deref() {
                        Some(pool) if through_pool => {
                            let pool_slot = slice.pool_slot.expect("a pool slot");
                            let from = pool.slot_addr(pool_slot);
                            let dst = a.local_addr + slice.offset + slice.pos;
                            let chunk = slice.chunk;
                            step = Some(
                                copy_event(
                                    cx.res,
                                    pool.gpu,
                                    &pool.to_device,
                                    TO_GPU,
                                    (a.local.clone(), pool.region.clone()),
                                    move |stream| {
                                        // SAFETY: the READ into the
                                        // pool slot completed and the
                                        // slot stays this chunk's until
                                        // the copy's event passed; the
                                        // destination lies in the
                                        // request's checked local range;
                                        // both memories held until queued.
                                        unsafe {
                                            stream.copy_host_to_device(
                                                dst,
                                                from as *const u8,
                                                chunk as usize,
                                            )
                                        }
                                    },
                                )
                                .map(|event| slice.stage = AskStage::CopyIn(event))
                                .map_err(Some),
                            );
                        }
                        _ => {
                            step = Some(chunk_done(slice, pool.as_deref_mut()));
                        }
                    }
                }
            },
            AskStage::CopyIn(copy) => match copy.is_complete(TO_GPU) {
                Ok(false) => {}
                Ok(true) => step = Some(chunk_done(slice, pool.as_deref_mut())),
                Err(e) => step = Some(Err(Some(e))),
            },
        }
        match step {
            None => index += 1,
            Some(Ok(())) => {
                moved += 1;
                index += 1;
            }
            Some(Err(e)) => {
                moved += 1;
                let slice = a.slices.remove(index);
                if let (Some(pool), Some(s)) = (pool.as_deref_mut(), slice.pool_slot) {
                    pool.free.push(s);
                }
                events
                    .ended
                    .push((slice.slot, slice.len, slice.pos == slice.len));
                if let Some(e) = e {
                    a.error.get_or_insert(e);
                    failing = true;
                    events.failed = true;
                }
            }
        }
    }
    moved
}

/// A chunk of `slice` ended: its pool slot is free; `Err(None)` when
/// it was the slice's last (the slice is done).
fn chunk_done(
    slice: &mut AskSlice,
    pool: Option<&mut StagingPool>,
) -> Result<(), Option<TransferError>> {
    if let (Some(pool), Some(s)) = (pool, slice.pool_slot.take()) {
        pool.free.push(s);
    }
    slice.pos += slice.chunk;
    if slice.pos == slice.len {
        return Err(None);
    }
    slice.stage = AskStage::Waiting;
    Ok(())
}

/// The announcement of a peer's landing slots.
pub(crate) struct SlotsAnnounce {
    slot_len: u64,
    count: u32,
    descriptor: Vec<u8>,
}

impl SlotsAnnounce {
    pub fn as_control(&self) -> Control<'_> {
        Control::Slots {
            slot_len: self.slot_len,
            count: self.count,
            descriptor: &self.descriptor,
        }
    }
}
