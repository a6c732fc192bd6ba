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

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hal_cuda::{Context as _, Stream as _};
use hal_verbs::Api;

use super::completion::{CompletionCell, Outcome};
use super::pipeline::Pipe;
use super::wire::Control;
use super::{Batch, Engine, EngineError, Op, Peer, Region, State, Transfer, TransferError};
use crate::buffer::Buffer;
use crate::descriptor::{GrantRights, MemoryLocation, Reach};
use crate::ladder::{Grant, Rung};
use crate::sync::lock;
use gdr_proto::grants::{Access, Rights, Terms};
use gdr_proto::rendezvous::status::of_refusal;

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
pub(super) struct Served<V: Api> {
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
pub(super) struct Bounce<V: Api, C: hal_cuda::Api> {
    region: Region<V>,
    buffer: Buffer<C>,
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
    /// Runs the copies (once; they are gone after).
    pub fn run(&mut self, engine: &Engine<V, C>) -> Result<(), EngineError> {
        for copy in std::mem::take(&mut self.copies) {
            engine.copy_to_gpu(copy.ordinal, copy.dst, &copy.bounce.buffer)?;
        }
        self.keep.clear();
        Ok(())
    }
}

/// A rendezvous this side serves as the owner: its RDMA op is in flight.
pub(super) struct Serving<V: Api, C: hal_cuda::Api> {
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

impl<V: Api, C: hal_cuda::Api> Engine<V, C> {
    /// A bounce buffer of `len` bytes: pinned with GPU `ordinal`'s context
    /// (pageable host memory if pinning fails), registered on every NIC.
    fn bounce(&self, ordinal: Option<u32>, len: u64) -> Result<Bounce<V, C>, EngineError> {
        let pinned = ordinal
            .and_then(|o| self.gpu(o).ok())
            .and_then(|gpu| Buffer::alloc_pinned(&gpu.context, len).ok());
        let buffer = pinned.unwrap_or_else(|| Buffer::alloc_host(len));
        let region = self.register(&buffer)?;
        Ok(Bounce { region, buffer })
    }

    /// Copies `into.len()` bytes at device address `src` of GPU `ordinal`
    /// into host buffer `into`.
    fn copy_from_gpu(&self, ordinal: u32, src: u64, into: &Buffer<C>) -> Result<(), EngineError> {
        let stream = self.gpu(ordinal)?.context.create_stream()?;
        // SAFETY: `into` is gdr's own host allocation of `into.len()` bytes,
        // written by nothing else while the bounce is private to this
        // transfer; `src..src + len` lies in a registered GPU region (its
        // bounds were checked); the stream is synchronised before return.
        unsafe { stream.copy_device_to_host(into.addr() as *mut u8, src, into.len() as usize) }?;
        stream.synchronize()?;
        Ok(())
    }

    /// Copies host buffer `from` to device address `dst` of GPU `ordinal`.
    fn copy_to_gpu(&self, ordinal: u32, dst: u64, from: &Buffer<C>) -> Result<(), EngineError> {
        let stream = self.gpu(ordinal)?.context.create_stream()?;
        // SAFETY: as in `copy_from_gpu`, the other way: `from` holds
        // `from.len()` bytes no NIC writes any more (its transfer ended).
        unsafe { stream.copy_host_to_device(dst, from.addr() as *const u8, from.len() as usize) }?;
        stream.synchronize()?;
        Ok(())
    }

    /// A bounce standing in for `len` bytes at `offset` of staged `region`,
    /// holding its data now when `fill`.
    fn bounce_for(
        &self,
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
        let bounce = self.bounce(Some(ordinal), len)?;
        if fill {
            self.copy_from_gpu(ordinal, region.inner.addr + offset, &bounce.buffer)?;
        }
        Ok((bounce, ordinal))
    }

    /// Whether anything of a rendezvous waits for this side (a request to
    /// serve, or a served one whose op ended).
    pub(super) fn staged_pending(state: &State<V, C>) -> bool {
        !state.serving.is_empty()
            || state
                .peers
                .iter()
                .flatten()
                .any(|p| !p.staged_inbox.is_empty() || p.landing.wants_slots().is_some())
    }

    /// Fails rendezvous requests of this side past their deadline.
    pub(super) fn expire_rendezvous(state: &mut State<V, C>, now: Instant) {
        for peer in state.peers.iter_mut().flatten() {
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
    }

    /// Serves the peers' rendezvous requests and answers those whose op
    /// ended. Runs outside the engine's lock (it copies, registers and
    /// submits).
    /// Returns how many requests it started or answered.
    pub(super) fn serve_staged(&self) -> usize {
        let (asks, refused, ended) = {
            let mut state = lock(&self.shared.state);
            let state = &mut *state;
            let mut asks = Vec::new();
            let mut refused = Vec::new();
            let max = self.shared.config.peer_limits.max_staged_requests;
            for (slot, peer) in state.peers.iter_mut().enumerate() {
                let Some(peer) = peer else { continue };
                let mut running = state.serving.iter().filter(|s| s.slot == slot).count();
                while let Some(ask) = peer.staged_inbox.pop_front() {
                    if running >= max {
                        refused.push((slot, ask.id, BUSY));
                        continue;
                    }
                    // A use of the grant until the request ends: its
                    // revoke is fenced only then.
                    let served = peer
                        .served
                        .begin_use(ask.grant, access(ask.write), ask.offset, ask.len)
                        .map(|s| Served {
                            region: s.region.clone(),
                            offset: s.offset,
                            len: s.len,
                            rights: s.rights,
                        });
                    match served {
                        Ok(served) => {
                            running += 1;
                            let theirs = peer.remote_grants.get(ask.id).cloned();
                            asks.push((slot, ask, served, theirs));
                        }
                        Err(refusal) => refused.push((slot, ask.id, of_refusal(refusal))),
                    }
                }
            }
            let (ended, serving): (Vec<_>, Vec<_>) = std::mem::take(&mut state.serving)
                .into_iter()
                .partition(|s| s.cell.is_done());
            state.serving = serving;
            (asks, refused, ended)
        };
        let worked = asks.len() + refused.len() + ended.len() + self.make_landings();
        for (slot, id, status) in refused {
            self.reply(slot, id, status);
        }
        for (slot, ask, served, theirs) in asks {
            if let Err(status) = self.start_serving(slot, ask, served, theirs) {
                self.end_use(slot, ask.grant);
                self.reply(slot, ask.id, status);
            }
        }
        for done in ended {
            let mut status = match done.cell.outcome() {
                Some(Ok(())) => OK,
                _ => FAILED,
            };
            // The copy into the granted memory only while the grant is
            // live (its revoke waits for this request's use to end).
            if status == OK && done.copy_back.is_some() && !self.grant_live(done.slot, done.grant) {
                status = REVOKED;
            }
            if status == OK
                && let (Some((ordinal, dst)), Some(bounce)) = (done.copy_back, &done.bounce)
                && let Err(e) = self.copy_to_gpu(ordinal, dst, &bounce.buffer)
            {
                tracing::warn!(error = %e, "staging a peer's WRITE into GPU memory");
                status = FAILED;
            }
            self.end_use(done.slot, done.grant);
            self.reply(done.slot, done.id, status);
        }
        worked
    }

    /// Whether grant `grant` to the peer in `slot` is live.
    fn grant_live(&self, slot: usize, grant: u64) -> bool {
        let state = lock(&self.shared.state);
        state.peers[slot]
            .as_ref()
            .is_some_and(|p| p.served.is_live(grant))
    }

    /// Ends a use of grant `grant` to the peer in `slot` (a revoke waiting
    /// for it may complete).
    fn end_use(&self, slot: usize, grant: u64) {
        let mut state = lock(&self.shared.state);
        let fenced = state.peers[slot]
            .as_mut()
            .and_then(|p| p.served.end_use(grant));
        drop(state);
        // The region goes outside the lock (its registrations may be the
        // last).
        drop(fenced);
    }

    fn reply(&self, slot: usize, id: u64, status: u32) {
        let peer = Peer {
            engine: self.clone(),
            slot,
        };
        if let Err(e) = peer.send_control(&Control::StagedReply { id, status }) {
            tracing::debug!(error = %e, "a staged reply not sent");
        }
    }

    /// Checks a peer's rendezvous request against the grant it names and
    /// starts its RDMA op; `Err` is the status to answer at once.
    fn start_serving(
        &self,
        slot: usize,
        ask: StagedAsk,
        served: Served<V>,
        theirs: Option<crate::descriptor::MemoryDescriptor>,
    ) -> Result<(), u32> {
        let _span = tracing::debug_span!("serve_staged", id = ask.id, len = ask.len).entered();
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
        let failed = |e: EngineError| {
            tracing::warn!(error = %e, "serving a staged transfer");
            FAILED
        };
        let offset = served.offset + ask.offset;
        // The requester WRITEs: we READ its range into our memory; it
        // READs: we WRITE ours into its range.
        let op = if ask.write { Op::Read } else { Op::Write };
        if self.shared.config.staging_pipeline
            && let MemoryLocation::Gpu { ordinal } = served.region.inner.location
        {
            let now = self.shared.config.clock.now();
            let (pipe, cell) = Pipe::new(
                slot,
                op,
                u32::from(ordinal),
                &served.region,
                offset,
                ask.len,
                &theirs,
                0,
                now,
                self.shared.config.default_timeout,
            );
            let mut state = lock(&self.shared.state);
            state.serving.push(Serving {
                slot,
                id: ask.id,
                grant: ask.grant,
                cell,
                bounce: None,
                copy_back: None,
            });
            state.pipes.push(pipe);
            self.pump_pipes(&mut state, now);
            self.post_ready(&mut state);
            return Ok(());
        }
        // The naive path: copy out now and WRITE the bounce, or READ into
        // the bounce and copy in after.
        let (bounce, ordinal) = self
            .bounce_for(&served.region, offset, ask.len, !ask.write)
            .map_err(failed)?;
        let peer = Peer {
            engine: self.clone(),
            slot,
        };
        let transfer = Transfer {
            op,
            ..Transfer::read(&bounce.region, 0, &theirs, 0, ask.len)
        };
        let batch = peer.submit(&[transfer]).map_err(failed)?;
        let serving = Serving {
            slot,
            id: ask.id,
            grant: ask.grant,
            cell: Arc::clone(batch.cell()),
            bounce: Some(bounce),
            copy_back: ask
                .write
                .then_some((ordinal, served.region.inner.addr + offset)),
        };
        lock(&self.shared.state).serving.push(serving);
        Ok(())
    }
}

impl<V: Api, C: hal_cuda::Api> Peer<V, C> {
    /// Submits a batch some of whose transfers involve a staging-rung
    /// region (ours, or the peer's grant): bounce buffers for ours, a
    /// rendezvous for the peer's; the direct rest as usual.
    pub(super) fn submit_staged(
        &self,
        transfers: &[Transfer<'_, V>],
        timeout: Duration,
    ) -> Result<Batch<V, C>, EngineError> {
        let engine = &self.engine;
        self.read_peer(|_, p| {
            transfers
                .iter()
                .try_for_each(|t| super::check_transfer(p, t))
        })??;
        let config = &engine.shared.config;
        let mut parts = Vec::new();
        // Ours staged, theirs direct: through the GPU's pipeline.
        let piped = |t: &Transfer<'_, V>| {
            config.staging_pipeline
                && t.local.is_staged()
                && !matches!(t.remote.reach, Reach::Staged)
        };
        // Theirs staged: through the owner's landing slots (ours, staged
        // too, through our pool slice by slice).
        let slotted = |t: &Transfer<'_, V>| {
            config.staging_pipeline && matches!(t.remote.reach, Reach::Staged)
        };
        let mut fence = Vec::new();
        for t in transfers.iter().filter(|t| slotted(t)) {
            parts.push(self.ask_slots(t, timeout)?);
            // Our READ into GPU memory the NIC reaches: fenced as any.
            if t.op == Op::Read
                && !t.local.is_staged()
                && let MemoryLocation::Gpu { ordinal } = t.local.inner.location
            {
                fence.push(u32::from(ordinal));
            }
        }
        let now = config.clock.now();
        let mut pipes = Vec::new();
        for t in transfers.iter().filter(|t| piped(t)) {
            let MemoryLocation::Gpu { ordinal } = t.local.inner.location else {
                return Err(EngineError::Refused(
                    "host memory on the staging rung".into(),
                ));
            };
            let (pipe, cell) = Pipe::new(
                self.slot,
                t.op,
                u32::from(ordinal),
                t.local,
                t.local_offset,
                t.len,
                t.remote,
                t.remote_offset,
                now,
                timeout,
            );
            pipes.push(pipe);
            parts.push(cell);
        }
        if !pipes.is_empty() {
            let mut state = lock(&engine.shared.state);
            state.pipes.extend(pipes);
            engine.pump_pipes(&mut state, now);
            engine.post_ready(&mut state);
        }
        // Bounces next (the transfers below borrow them).
        let mut bounces: Vec<Option<(Bounce<V, C>, u32)>> = Vec::with_capacity(transfers.len());
        for t in transfers {
            bounces.push(if t.local.is_staged() && !piped(t) && !slotted(t) {
                Some(engine.bounce_for(t.local, t.local_offset, t.len, t.op == Op::Write)?)
            } else {
                None
            });
        }
        let mut direct = Vec::new();
        let mut after = After::<V, C>::default();
        for (t, bounce) in transfers
            .iter()
            .zip(&bounces)
            .filter(|(t, _)| !piped(t) && !slotted(t))
        {
            let (local, local_offset) = match bounce {
                Some((b, _)) => (&b.region, 0),
                None => (t.local, t.local_offset),
            };
            if matches!(t.remote.reach, Reach::Staged) {
                parts.push(self.rendezvous(t, local, local_offset, timeout)?);
            } else {
                direct.push(Transfer {
                    local,
                    local_offset,
                    ..*t
                });
            }
        }
        let mut batch = if direct.is_empty() {
            let cell = Arc::new(CompletionCell::new());
            cell.complete(Ok(()));
            Batch::of_cell(engine.clone(), cell)
        } else {
            self.submit_with_timeout(&direct, timeout)?
        };
        drop(direct);
        for (t, bounce) in transfers.iter().zip(bounces) {
            let Some((bounce, ordinal)) = bounce else {
                continue;
            };
            if t.op == Op::Read {
                after.copies.push(CopyBack {
                    bounce,
                    ordinal,
                    dst: t.local.inner.addr + t.local_offset,
                });
            } else {
                after.keep.push(Box::new(bounce.region));
                after.keep.push(Box::new(bounce.buffer));
            }
        }
        batch.parts = parts;
        batch.fence.extend(fence);
        batch.fence.sort_unstable();
        batch.fence.dedup();
        batch.after = std::sync::Mutex::new(after);
        Ok(batch)
    }

    /// Asks the owner of staged grant `t.remote` to carry out `t` against
    /// `local` at `local_offset` (which this grants it for the purpose).
    fn rendezvous(
        &self,
        t: &Transfer<'_, V>,
        local: &Region<V>,
        local_offset: u64,
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError> {
        let rights = match t.op {
            Op::Write => GrantRights::Read,
            Op::Read => GrantRights::Write,
        };
        let (descriptor, grants) = self.make_grant(local, local_offset, t.len, rights)?;
        if grants.is_empty() {
            return Err(EngineError::Refused(
                "both ends of a rendezvous on the staging rung".into(),
            ));
        }
        let encoded = descriptor.encode()?;
        let config = &self.engine.shared.config;
        let cell = Arc::new(CompletionCell::new());
        let id = descriptor.grant;
        self.update_peer(|core, peer| -> Result<(), EngineError> {
            let now = config.clock.now();
            peer.enqueue(
                &Control::GrantAnnounce {
                    descriptor: &encoded,
                },
                now,
                timeout,
            )?;
            peer.enqueue(&staged_request(id, t, false), now, timeout)?;
            peer.rendezvous.insert(
                id,
                Rendezvous {
                    cell: Arc::clone(&cell),
                    deadline: now + timeout,
                    timeout,
                    grants,
                },
            );
            peer.flush_backlog(core, now);
            Ok(())
        })??;
        Ok(cell)
    }
}
