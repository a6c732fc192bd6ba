//! Staging-rung regions: GPU memory no NIC can reach (neither dma-buf nor
//! peermem works for its GPU), moved through pinned host bounce buffers.
//!
//! - **Local** (this side's region is staged, the peer's grant is direct):
//!   through the GPU's pipelined bounce pool ([`super::pipeline`]: slices
//!   copied and sent overlapping).
//! - **Rendezvous** (the peer's grant says `Staged`: it has no MR to
//!   name): through the landing slots the owner lends this side
//!   ([`super::rendezvous`]). The owner hands out a slot per slice as a
//!   credit; this side WRITEs the slice into it (or READs one the owner
//!   copied in) and returns the credit; the owner copies between the slot
//!   and its GPU. When this side's memory is staged too, its side of each
//!   slice goes through its own GPU's pool, so this side's copies, the wire
//!   and the owner's copies of different slices overlap.
//!
//! The staged path only pipelines. The naive form (copy the whole range
//! into a bounce buffer, then send; for a peer's staged grant, a request
//! against a temporary grant of the requester's range) is no longer the
//! engine's: it stays only as the staging benchmark's baseline
//! (`tests/benches/staging.rs`, `naive_*`), built there on the engine's
//! public API. A peer that still asks for it (a
//! [`Control::StagedRequest`] not through landing slots, as an older or a
//! hostile peer may send) is answered [`ACCESS_DENIED`] at once, and
//! nothing of the request is kept.
//!
//! What it costs: the pipeline's pool per GPU is allocated, pinned and
//! registered once; each slice costs a `cuMemcpyAsync` and an event
//! record (queued by the engine's CUDA worker, [`super::cuda_worker`]) and
//! event polls on the staged side, overlapped with the wire. A rendezvous costs the
//! owner, once per peer, its landing slots (`rendezvous_slots` ×
//! `staging_slice` of pinned memory allocated, registered and granted
//! once: 16 MiB by default); per request a request message (and a reply
//! for a WRITE), and per slice a credit and its return (two control
//! messages) and a copy on each staged side. Nothing is registered per
//! request: the requester's temporary grant of its range that the naive
//! rendezvous needed (0.86 ms for 16 MiB on the sim NIC, 70% of the
//! wire's time there; milliseconds of `ibv_reg_mr` on a real NIC) and the
//! whole-range synchronous bounce of a staged requester are gone. A slice
//! waits for its credit, a round trip of control messages: with
//! `rendezvous_slots` slices in flight the wire stays busy while a round
//! trip is shorter than the slots' worth of wire time. Measured on the sim
//! NIC and GPU (2 shared, noisy cores;
//! `cargo bench -p gdr-tests --bench staging -- 'staging_sim/(pipelined_in|pipelined_gpu)'`),
//! before → after the landing slots: host → staged GPU 1 MiB 3.0 → 5.5,
//! 16 MiB 3.9 → 6.4 GiB/s (the wire alone: 12.8); staged GPU → staged GPU 1 MiB 0.74 →
//! 4.5, 16 MiB 0.78 → 4.3 GiB/s. It needs the owner's
//! progress: it is served only while the owner's engine makes progress:
//! granting a staging-rung region starts the engine's own progress thread
//! (it ends with the engine). The baseline (copy all, then send) costs a
//! synchronous copy of the whole range on each staged side, not
//! overlapped with the wire; the engine's former naive form also
//! allocated, pinned and registered a bounce buffer per transfer and made
//! a grant per rendezvous (measured then at 16 MiB against the wire alone:
//! 0.17× GPU → host, 0.15× host → GPU, 0.07× GPU → GPU).
//!
//! # The staged path
//!
//! `StagedPath` is one path behind the seam (`super::path`): it owns
//! the pools and pipes ([`super::pipeline`]), engine-wide. What it holds
//! of one peer, a `StagedPeer` (this side's grants of staging-rung
//! regions, the landing slots lent and the requests through the peer's),
//! is its `TransferPath::Peer`: it lives in the peer's slot, under the
//! peer's lock, and each step of it runs there on a wire to that peer
//! alone, so one peer's rendezvous never waits on another's. It reaches
//! the peers only through `PathCx` (the engine's resources and the wire).
//! What must run outside every lock (making landing slots: allocation,
//! pinning, registration) the engine's pass claims
//! (`StagedPeer::claim_landing`); the engine makes them and hands each
//! result back under the peer's lock (`StagedPeer::landing_made`). Both
//! forms are its `TransferPath::post`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::completion::{CompletionCell, Outcome};
use super::path::{PathCx, TransferPath};
use super::pipeline::{self, Pipe, StagingPool};
use super::rendezvous::{self, Asks, Landing, LandingSlots};
use super::resources::Resources;
use super::wire::Control;
use super::{EngineError, Op, Refusal, Region, Transfer, TransferError};
use crate::descriptor::{GrantRights, MemoryDescriptor, MemoryLocation, Reach};
use crate::ladder::{MrGrant, Rung};
use crate::sync::{Mutex, lock};
use gdr_proto::grants::{LocalGrants, Revoked, Rights, Terms};
use gdr_proto::PeerMisbehaved;
use gdr_proto::rendezvous::Rendezvous;

/// Reply codes of a [`Control::StagedReply`] (the protocol's).
pub(super) use gdr_proto::rendezvous::status::{
    ACCESS_DENIED, BAD_CREDIT, BUSY, FAILED, NOT_GRANTED, OK, OUT_OF_BOUNDS, REVOKED, TIMED_OUT,
};

/// The rendezvous request `id` for transfer `t`, through the owner's
/// landing slots.
pub(super) fn staged_request(id: u64, t: &Transfer<'_>) -> Control<'static> {
    Control::StagedRequest {
        id,
        grant: t.remote.grant,
        offset: t.remote_offset,
        len: t.len,
        write: t.op == Op::Write,
        slots: true,
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
pub(crate) struct Served {
    pub region: Region,
    pub offset: u64,
    pub len: u64,
    pub rights: GrantRights,
}

impl Served {
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

/// A peer's rendezvous request, as received (the protocol's).
pub(super) use gdr_proto::rendezvous::StagedAsk;

impl Region {
    /// Whether some NIC reaches it only through staging.
    pub(super) fn is_staged(&self) -> bool {
        self.inner.per_nic.iter().any(|r| r.rung() == Rung::Staging)
    }
}

/// Whether the staged path carries `t`: ours staged (through the GPU's
/// pool) or theirs staged (through the owner's landing slots).
pub(crate) fn staged(t: &Transfer<'_>) -> bool {
    t.local.is_staged() || slotted(t)
}

/// Whether `t` names a peer's staging-rung grant.
fn slotted(t: &Transfer<'_>) -> bool {
    matches!(t.remote.reach, Reach::Staged)
}

/// The GPUs to fence after a batch of the pipelined `transfers`: our READs
/// through a peer's landing slots into GPU memory the NIC reaches (fenced
/// as any; those through our pool were copied in by us).
pub(crate) fn read_fence(transfers: &[Transfer<'_>]) -> Vec<u32> {
    transfers
        .iter()
        .filter(|t| slotted(t) && t.op == Op::Read && !t.local.is_staged())
        .filter_map(|t| match t.local.inner.location {
            MemoryLocation::Gpu { ordinal } => Some(u32::from(ordinal)),
            MemoryLocation::Host => None,
        })
        .collect()
}

/// Makes the landing slots of the peer in `slot` (pinned with GPU `gpu`)
/// and grants them with `grant` (the engine's grant to that peer of `len`
/// bytes of the region, read and write). Outside every lock.
pub(crate) fn make_landing(
    res: &Resources,
    slot: usize,
    gpu: Option<u32>,
    grant: impl FnOnce(&Region, u64) -> Result<(MemoryDescriptor, Vec<MrGrant>), EngineError>,
) -> Result<LandingSlots, EngineError> {
    rendezvous::make_slots(res, slot, gpu, grant)
}

/// What the staged path holds of one peer: both sides of its rendezvous.
/// It lives in the peer's slot, under the peer's lock (the engine's
/// `PeerSlot`), not in the engine-wide [`StagedPath`]: one peer's
/// rendezvous steps, grants and revokes take no other peer's lock and not
/// the engine's.
pub(crate) struct StagedPeer {
    /// This side's grants of staging-rung regions, served by rendezvous:
    /// live, or revoked while a request under them still runs (the
    /// revocation fence, [`gdr_proto::grants`]).
    served: LocalGrants<Served>,
    /// The landing slots this side lends the peer, and its requests served
    /// through them.
    landing: Landing,
    /// This side's requests through the peer's landing slots.
    asks: Asks,
    /// This side's staged transfers to the peer going through a GPU's
    /// pool.
    pipes: Vec<Pipe>,
    /// Posts of several transfers to the peer not ended.
    groups: Vec<Group>,
}

impl StagedPeer {
    /// Nothing staged with the peer yet.
    pub(crate) fn new() -> Self {
        Self {
            served: LocalGrants::default(),
            landing: Landing::default(),
            asks: Asks::default(),
            pipes: Vec::new(),
            groups: Vec::new(),
        }
    }

    /// This side's staged grants (live, or revoked while a request under
    /// them runs), the peer's requests served (`rendezvous`: the
    /// connection's), copies running for them, and this side's requests
    /// asked.
    pub(crate) fn load(&self, rendezvous: &Rendezvous) -> (usize, usize, usize, usize) {
        let (served, copies) = self.landing.load(&rendezvous.owner);
        (self.served.len(), served, copies, self.asks.asked())
    }

    /// Staged transfers going through a pool, and posts of several
    /// transfers not ended.
    pub(crate) fn transfers(&self) -> (usize, usize) {
        (self.pipes.len(), self.groups.len())
    }

    /// Serves grant `grant` of a staging-rung region to the peer (recorded
    /// before it is announced: the peer may use it at once).
    pub(crate) fn grant(&mut self, grant: u64, served: Served) {
        let terms = served.terms();
        self.served.insert(grant, terms, served);
    }

    /// Revokes grant `grant` to the peer: requests under it stop at once
    /// (`rendezvous`: the connection's); its fence waits for their copies
    /// under way. What is fenced now goes with the returned value
    /// (outside the peer's lock).
    pub(crate) fn revoke(&mut self, rendezvous: &mut Rendezvous, grant: u64) -> Revoked<Served> {
        let revoked = self.served.revoke(grant);
        if let Revoked::Draining { .. } = revoked {
            rendezvous.owner.revoke(grant);
        }
        revoked
    }

    /// Whether grant `grant` is fenced (no byte moves under it any more).
    /// A gone peer's (`gone`) served grants go with it, once the copies
    /// still running for it have ended (the next progress waits for them).
    pub(crate) fn is_fenced(&self, rendezvous: &Rendezvous, grant: u64, gone: bool) -> bool {
        self.served.is_fenced(grant) || (gone && !self.copying(rendezvous))
    }

    /// Whether a copy for the peer's requests may still run.
    pub(crate) fn copying(&self, rendezvous: &Rendezvous) -> bool {
        self.landing.copying(&rendezvous.owner)
    }

    /// Whether the engine's pass has nothing to step here (with both
    /// sides of the peer's rendezvous, the connection's).
    pub(crate) fn is_idle(&self, rendezvous: &Rendezvous) -> bool {
        self.landing.is_idle(&rendezvous.owner)
            && self.asks.is_idle(&rendezvous.requester)
            && !self.polls(rendezvous)
            && self.groups.is_empty()
    }

    /// Whether what runs here ends only as polling sees it (GPU copies
    /// and their events; a request of ours whose side copies through a
    /// pool): a parked engine must look again soon.
    pub(crate) fn polls(&self, rendezvous: &Rendezvous) -> bool {
        self.copying(rendezvous) || self.asks.asking() || !self.pipes.is_empty()
    }

    /// The pipes' earliest deadline (the rendezvous' are the
    /// connection's).
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.pipes.iter().map(Pipe::deadline).min()
    }

    /// The GPU to pin this peer's landing slots with, when its requests
    /// wait for slots and nobody makes them yet: the caller makes them
    /// outside every lock ([`make_landing`]) and hands the result back
    /// ([`StagedPeer::landing_made`]); until then no other caller is
    /// handed them (it would make a second set only to free it).
    pub(crate) fn claim_landing(&mut self, rendezvous: &Rendezvous) -> Option<u32> {
        self.landing.claim_slots(&rendezvous.owner)
    }

    /// The landing slots claimed by [`StagedPeer::claim_landing`] were
    /// made (or failed): installed and announced on `cx`'s wire to the
    /// peer in `slot`, or its requests fail. Returns how many were made
    /// (a driver counts it as work).
    pub(crate) fn landing_made(
        &mut self,
        cx: &mut PathCx<'_>,
        slot: usize,
        rendezvous: &mut Rendezvous,
        made: Result<LandingSlots, EngineError>,
    ) -> usize {
        let timeout = cx.res.config.default_timeout;
        match made {
            Ok(made) => {
                if let Some(announce) = self.landing.install(&mut rendezvous.owner, made)
                    && let Err(e) = cx.wire.send(slot, &announce.as_control(), timeout)
                {
                    tracing::warn!(error = %e, "announcing landing slots");
                }
                1
            }
            Err(e) => {
                tracing::warn!(error = %e, "making landing slots: the requests fail");
                // The protocol answers them (FAILED) at its next step.
                self.landing.slots_failed(&mut rendezvous.owner);
                0
            }
        }
    }
}

/// The staged path's part of one peer as a step sees it: the part in the
/// peer's slot and both sides of the peer's rendezvous (its connection's,
/// lent for the step: [`gdr_proto::connection::Connection::lend_rendezvous`]).
pub(crate) struct PeerPart<'a> {
    pub(crate) staged: &'a mut StagedPeer,
    pub(crate) rendezvous: &'a mut Rendezvous,
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

/// Each GPU's staging pool, made at its first staged transfer, shared by
/// every peer's staged part under a lock of its own (taken under a peer's
/// for that peer's step; under it only the CUDA worker's queue and the
/// event pool).
#[derive(Default)]
pub(crate) struct StagingPools(Mutex<HashMap<u32, StagingPool>>);

impl StagingPools {
    /// Whether GPU `gpu` has its staging pool.
    pub(crate) fn has_pool(&self, gpu: u32) -> bool {
        lock(&self.0).contains_key(&gpu)
    }

    /// Takes `pool` (made outside every lock: [`pipeline::make_pool`]) as
    /// its GPU's; one made meanwhile wins, and `pool` is handed back to be
    /// dropped outside the lock.
    pub(crate) fn install_pool(&self, pool: StagingPool) -> Option<StagingPool> {
        use std::collections::hash_map::Entry;
        match lock(&self.0).entry(pool.gpu) {
            Entry::Occupied(_) => Some(pool),
            Entry::Vacant(vacant) => {
                vacant.insert(pool);
                None
            }
        }
    }
}

/// The staged path (see the module docs), as one call sees it: the pools
/// it moves slices through. Everything else it holds is a peer's
/// ([`StagedPeer`], in the peer's slot).
pub(crate) struct StagedPath<'p> {
    pub(crate) pools: &'p StagingPools,
}

impl StagedPath<'_> {
    // ------------------------------------------------------ messages

    /// A control message from the peer in `slot`: the staged path takes
    /// those of its protocol (`None`) and gives the others back. A request
    /// not through landing slots (the naive rendezvous, which this engine
    /// no longer serves) is refused at once ([`ACCESS_DENIED`]), nothing of
    /// it kept; a reply to no request of ours is dropped.
    fn receive<'m>(
        cx: &mut PathCx<'_>,
        slot: usize,
        peer: &mut PeerPart<'_>,
        message: Control<'m>,
    ) -> Option<Control<'m>> {
        let PeerPart { staged, rendezvous } = peer;
        let (landing, asks) = (&mut staged.landing, &mut staged.asks);
        let message = match rendezvous::receive(landing, asks, &rendezvous.requester, message) {
            Ok(()) => return None,
            Err(message) => message,
        };
        match message {
            Control::StagedRequest { id, .. } => {
                tracing::debug!(id, "a request not through landing slots: refused");
                reply(cx, slot, id, ACCESS_DENIED);
            }
            Control::StagedReply { .. } => {}
            other => return Some(other),
        }
        None
    }

}

/// Answers request `id` of the peer in `slot` with `status`.
fn reply(cx: &mut PathCx<'_>, slot: usize, id: u64, status: u32) {
    let timeout = cx.res.config.default_timeout;
    if let Err(e) = cx
        .wire
        .send(slot, &Control::StagedReply { id, status }, timeout)
    {
        tracing::debug!(error = %e, "a staged reply not sent");
    }
}

impl TransferPath for StagedPath<'_> {
    type Peer<'a> = PeerPart<'a>;

    /// The local region is staged or the peer's grant is.
    fn carries(
        &mut self,
        _res: &Resources,
        _slot: usize,
        _peer: &mut PeerPart<'_>,
        transfers: &[Transfer<'_>],
    ) -> bool {
        transfers.iter().any(staged)
    }

    /// Each transfer through the owner's landing slots (theirs staged;
    /// ours too, through our pool slice by slice) or our GPU's pool (ours
    /// staged, theirs direct). A transfer with neither end staged is the
    /// engine's (the RDMA path), refused here.
    fn post(
        &mut self,
        cx: &mut PathCx<'_>,
        slot: usize,
        peer: &mut PeerPart<'_>,
        transfers: &[Transfer<'_>],
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError> {
        let PeerPart { staged: peer, rendezvous } = peer;
        if !transfers.iter().all(staged) {
            return Err(EngineError::Refused(Refusal::NotStaged));
        }
        let mut gpus = Vec::with_capacity(transfers.len());
        for t in transfers {
            gpus.push(rendezvous::staged_gpu(t)?);
        }
        let mut cells = Vec::with_capacity(transfers.len());
        for t in transfers.iter().filter(|t| slotted(t)) {
            cells.push(peer.asks.ask(&mut rendezvous.requester, cx, slot, t, timeout)?);
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
            peer.pipes.push(pipe);
            cells.push(cell);
            piped = true;
        }
        if piped {
            pipeline::pump(cx, &mut peer.pipes, &mut lock(&self.pools.0));
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
            peer.groups.push(group);
        }
        Ok(cell)
    }

    /// The peer's pipes, this side's requests through its landing slots
    /// (deadlines included) and the requests served through ours, then
    /// its groups whose parts all ended; the slots to make are
    /// [`StagedPeer::claim_landing`]'s.
    fn progress_peer(&mut self, cx: &mut PathCx<'_>, slot: usize, peer: &mut PeerPart<'_>) -> usize {
        let PeerPart { staged: peer, rendezvous: rv } = peer;
        let mut moved = 0;
        let mut pools = lock(&self.pools.0);
        moved += pipeline::pump(cx, &mut peer.pipes, &mut pools);
        if !peer.landing.is_idle(&rv.owner) {
            let (landing, served) = (&mut peer.landing, &mut peer.served);
            moved += rendezvous::pump_landing(cx, slot, landing, &mut rv.owner, served);
        }
        if !peer.asks.is_idle(&rv.requester) {
            let requester = &mut rv.requester;
            moved += rendezvous::pump_asks(cx, slot, &mut peer.asks, requester, &mut pools);
        }
        drop(pools);
        peer.groups.retain(|g| !g.resolve());
        moved
    }

    fn on_control<'m>(
        &mut self,
        cx: &mut PathCx<'_>,
        slot: usize,
        peer: &mut PeerPart<'_>,
        message: Control<'m>,
    ) -> Result<Option<Control<'m>>, PeerMisbehaved> {
        Ok(Self::receive(cx, slot, peer, message))
    }

    /// Nothing beside the peers' parts ([`TransferPath::cancel_peer`]).
    fn cancel(&mut self, cells: &[Arc<CompletionCell>]) -> Vec<Arc<CompletionCell>> {
        cells.to_vec()
    }

    /// The peer's pipes and groups, and this side's requests through its
    /// landing slots.
    fn cancel_peer(&mut self, peer: &mut PeerPart<'_>, cells: &[Arc<CompletionCell>]) {
        let PeerPart { staged: peer, rendezvous } = peer;
        let mut cells = cells.to_vec();
        for group in &peer.groups {
            if cells.iter().any(|c| Arc::ptr_eq(c, &group.cell)) {
                cells.extend(group.parts.iter().cloned());
            }
        }
        pipeline::cancel(&mut peer.pipes, &cells);
        peer.asks.cancel(&mut rendezvous.requester, &cells);
    }

    /// Stops what the path does with the peer: its requests served here
    /// (no copy starts; its slots go at the next step, the copies waited
    /// for), the pipes to it and this side's requests to it (they end
    /// [`TransferError::PeerGone`] once their slices in flight drained).
    /// Its grants stay until revoked (a gone peer's are fenced once no
    /// copy for it runs).
    fn release_peer(&mut self, _cx: &mut PathCx<'_>, _slot: usize, peer: &mut PeerPart<'_>) {
        for pipe in &mut peer.staged.pipes {
            pipe.peer_gone();
        }
        peer.rendezvous.owner.close();
        peer.rendezvous.requester.peer_gone();
    }
}
