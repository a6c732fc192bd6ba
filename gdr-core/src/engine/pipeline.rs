//! The pipelined staging path: a transfer of staging-rung GPU memory
//! against a peer's direct grant, cut into slices that each borrow a slot
//! of a pinned bounce pool while copies and the wire overlap.
//!
//! - One pool per GPU (`StagingPool`): `staging_slots` slots of
//!   `staging_slice` bytes of pinned host memory, allocated and registered
//!   on every NIC once, at the first staged transfer of that GPU, with one
//!   stream for device→host and one for host→device copies.
//! - A WRITE takes a slot, queues the slice's device→host copy and records
//!   an event; once the event has passed the slice goes on the wire; its
//!   completion frees the slot. A READ takes a slot, READs into it, queues
//!   the host→device copy on completion, and frees the slot once that
//!   copy's event has passed. So slice k+1 is copied while slice k is on
//!   the wire (and the other way for a READ).
//! - Back-pressure: a slice waits for a free slot (first come, first
//!   served across transfers); a transfer never fails because the pool is
//!   busy, and one larger than the pool goes through it in turns.
//! - Exactly once: a transfer's part of its batch ends when its last slice
//!   has; a CUDA copy that fails, or a slice that fails on the wire, fails
//!   that transfer only (its slices in flight drain first). Past the
//!   deadline no new slice starts; those in flight end by the same
//!   deadline (their queue pairs are stopped as for any request).
//!
//! The engine steps every pipeline from [`super::Engine::progress`]: CUDA
//! events are polled there, so a pipeline moves while someone makes
//! progress (a waiter, or a driver thread). Which slice starts, what each
//! does next and how the transfer ends are the protocol's
//! ([`gdr_proto::pipeline::Pipe`], tested in memory); this module runs the
//! copies and wire ops it asks for.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hal_cuda::{Context as _, Event as _, Stream as _};
use hal_verbs::{Api, MemoryRegion as _, SendFlags};

use super::completion::CompletionCell;
use super::core::{Core, Keep, Work};
use super::{Engine, EngineError, Op, PeerState, Region, TransferError};
use crate::buffer::Buffer;
use crate::descriptor::MemoryDescriptor;
use gdr_proto::pipeline::{PipeAction, PipeFailure, Slice};

/// The pinned bounce slots of one GPU, registered on every NIC.
pub(super) struct StagingPool<V: Api, C: hal_cuda::Api> {
    pub gpu: u32,
    pub slot_size: u64,
    /// Free slot indices, lowest first out.
    pub free: Vec<usize>,
    pub region: Region<V>,
    pub to_host: C::Stream,
    pub to_device: C::Stream,
    _buffer: Buffer<C>,
}

impl<V: Api, C: hal_cuda::Api> StagingPool<V, C> {
    pub fn slot_addr(&self, slot: usize) -> u64 {
        self.region.inner.addr + slot as u64 * self.slot_size
    }
}

/// Where one slice is.
enum Stage<C: hal_cuda::Api> {
    /// Its copy (device→host for a WRITE, host→device for a READ) runs.
    Copying(C::Event),
    /// Its RDMA request is with the engine's core.
    OnWire(Arc<CompletionCell>),
}

/// One staged transfer going through its GPU's pool.
pub(super) struct Pipe<V: Api, C: hal_cuda::Api> {
    peer: usize,
    op: Op,
    gpu: u32,
    /// Device address of the transfer's first byte.
    gpu_addr: u64,
    remote: MemoryDescriptor,
    remote_offset: u64,
    /// The protocol: which slice starts, what each does next, the end.
    proto: gdr_proto::pipeline::Pipe,
    /// The copies and wire ops under way, by slice.
    running: Vec<(Slice, Stage<C>)>,
    /// Why it failed, in the engine's terms (the first failure).
    error: Option<TransferError>,
    deadline: Instant,
    timeout: Duration,
    cell: Arc<CompletionCell>,
    /// The staged region (its memory stays while the pipe runs).
    _region: Region<V>,
}

impl<V: Api, C: hal_cuda::Api> Pipe<V, C> {
    /// A pipe for `len` bytes at `offset` of staged `region` (on GPU
    /// `gpu`) against `remote` at `remote_offset`, for the peer in slot
    /// `peer`; its outcome goes to the returned cell.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        peer: usize,
        op: Op,
        gpu: u32,
        region: &Region<V>,
        offset: u64,
        len: u64,
        remote: &MemoryDescriptor,
        remote_offset: u64,
        now: Instant,
        timeout: Duration,
    ) -> (Self, Arc<CompletionCell>) {
        let cell = Arc::new(CompletionCell::new());
        let pipe = Self {
            peer,
            op,
            gpu,
            gpu_addr: region.inner.addr + offset,
            remote: remote.clone(),
            remote_offset,
            proto: gdr_proto::pipeline::Pipe::new(op == Op::Write, len, now + timeout),
            running: Vec::new(),
            error: None,
            deadline: now + timeout,
            timeout,
            cell: Arc::clone(&cell),
            _region: region.clone(),
        };
        (pipe, cell)
    }

    /// A failure here (not one of its slices): the pipe fails with it.
    fn fail_local(&mut self, error: TransferError) {
        self.error.get_or_insert(error);
        self.proto.fail(PipeFailure::Failed);
    }
}

impl<V: Api, C: hal_cuda::Api> Engine<V, C> {
    /// Cancels the pipes whose outcome goes to one of `cells`: no new slice
    /// starts; each ends [`TransferError::Cancelled`] once its slices in
    /// flight have drained.
    pub(super) fn cancel_pipes(state: &mut super::State<V, C>, cells: &[Arc<CompletionCell>]) {
        for pipe in state.pipes.iter_mut() {
            if cells.iter().any(|c| Arc::ptr_eq(c, &pipe.cell)) {
                pipe.proto.fail(PipeFailure::Cancelled);
            }
        }
    }

    /// The pool of GPU `gpu`, made (allocated, pinned, registered on every
    /// NIC) at its first use.
    pub(super) fn pool<'p>(
        &self,
        pools: &'p mut std::collections::HashMap<u32, StagingPool<V, C>>,
        gpu: u32,
    ) -> Result<&'p mut StagingPool<V, C>, EngineError> {
        use std::collections::hash_map::Entry;
        let vacant = match pools.entry(gpu) {
            Entry::Occupied(pool) => return Ok(pool.into_mut()),
            Entry::Vacant(vacant) => vacant,
        };
        let config = &self.shared.config;
        let slot_size = config.staging_slice.max(4096);
        let slots = config.staging_slots.max(1);
        let _span = tracing::debug_span!("staging_pool", gpu, slots, slot_size).entered();
        let context = &self.gpu(gpu)?.context;
        let buffer = Buffer::alloc_pinned(context, slot_size * slots as u64)?;
        let region = self.register(&buffer)?;
        tracing::info!(gpu, slots, slot_size, "staging pool ready");
        Ok(vacant.insert(StagingPool {
            gpu,
            slot_size,
            free: (0..slots).rev().collect(),
            region,
            to_host: context.create_stream()?,
            to_device: context.create_stream()?,
            _buffer: buffer,
        }))
    }

    /// Steps every pipeline: slices whose copy ended go on the wire (or
    /// free their slot), slices off the wire get their copy (or free their
    /// slot), new slices start while slots are free, and pipes with
    /// nothing left deliver their outcome.
    /// Returns how many slices moved on (a driver counts it as work).
    pub(super) fn pump_pipes(&self, state: &mut super::State<V, C>, now: Instant) -> usize {
        if state.pipes.is_empty() {
            return 0;
        }
        let mut moved = 0;
        let super::State {
            core,
            peers,
            pipes,
            pools,
            ..
        } = state;
        for pipe in pipes.iter_mut() {
            let Some(peer) = peers.get(pipe.peer).and_then(Option::as_ref) else {
                pipe.proto.fail(PipeFailure::PeerGone);
                continue;
            };
            let pool = match self.pool(pools, pipe.gpu) {
                Ok(pool) => pool,
                Err(e) => {
                    pipe.fail_local(TransferError::Local {
                        what: format!("the staging pool: {e}"),
                    });
                    continue;
                }
            };
            moved += self.advance(pipe);
            // Next steps and freed slots first: a slot freed now serves a
            // new slice in this same call.
            self.carry_out(core, peer, pool, pipe);
            pipe.proto.handle_timeout(now);
            let slot_size = pool.slot_size;
            let (remote, remote_offset) = (&pipe.remote, pipe.remote_offset);
            let free = &mut pool.free;
            moved += pipe.proto.start(
                || free.pop(),
                // A slice never crosses a segment of the remote grant.
                |offset| {
                    let remote_at = remote_offset + offset;
                    let in_segment = remote
                        .segments()
                        .iter()
                        .filter(|s| s.offset <= remote_at && remote_at < s.offset + s.len)
                        .map(|s| s.offset + s.len - remote_at)
                        .min()
                        .unwrap_or(u64::MAX);
                    slot_size.min(in_segment)
                },
            );
            self.carry_out(core, peer, pool, pipe);
        }
        pipes.retain_mut(|pipe| {
            let Some(outcome) = pipe.proto.poll_outcome() else {
                return true;
            };
            // The first failure, as the protocol recorded it; the details
            // of the pipe's own failures are the driver's.
            let outcome = outcome.map_err(|why| match why {
                PipeFailure::TimedOut => TransferError::Timeout {
                    after: pipe.timeout,
                },
                PipeFailure::Cancelled => TransferError::Cancelled,
                PipeFailure::PeerGone => TransferError::PeerGone {
                    reason: "closed".into(),
                },
                PipeFailure::Failed => pipe.error.take().unwrap_or(TransferError::Local {
                    what: "a staged slice failed".into(),
                }),
            });
            pipe.cell.complete(outcome);
            false
        });
        moved
    }

    /// Reports the copies and wire ops of `pipe` that ended to its
    /// protocol; returns how many.
    fn advance(&self, pipe: &mut Pipe<V, C>) -> usize {
        let mut ended = Vec::new();
        pipe.running.retain(|(slice, stage)| {
            let end = match stage {
                Stage::Copying(event) => match event.is_complete() {
                    Ok(false) => return true,
                    Ok(true) => (true, None),
                    Err(e) => (
                        true,
                        Some(TransferError::Local {
                            what: format!("staging copy: {e}"),
                        }),
                    ),
                },
                Stage::OnWire(cell) => match cell.outcome() {
                    None => return true,
                    Some(Ok(())) => (false, None),
                    Some(Err(e)) => (false, Some(e)),
                },
            };
            ended.push((slice.id, end));
            false
        });
        let moved = ended.len();
        for (id, (copy, error)) in ended {
            let ok = error.is_none();
            if let Some(e) = error {
                pipe.error.get_or_insert(e);
            }
            if copy {
                pipe.proto.copy_ended(id, ok);
            } else {
                pipe.proto.wire_ended(id, ok);
            }
        }
        moved
    }

    /// Carries out what `pipe`'s protocol asks: copies, wire ops, slots
    /// freed. A step that cannot start is reported failed at once.
    fn carry_out(
        &self,
        core: &mut Core,
        peer: &PeerState<V, C>,
        pool: &mut StagingPool<V, C>,
        pipe: &mut Pipe<V, C>,
    ) {
        while let Some(action) = pipe.proto.poll_action() {
            let (slice, started, copy) = match action {
                PipeAction::Free { slot } => {
                    pool.free.push(slot);
                    continue;
                }
                PipeAction::CopyOut(s) => (
                    s,
                    self.copy_out(pool, pipe.gpu, pipe.gpu_addr + s.offset, s.slot, s.len),
                    true,
                ),
                PipeAction::CopyIn(s) => (
                    s,
                    self.copy_in(pool, pipe.gpu, pipe.gpu_addr + s.offset, s.slot, s.len),
                    true,
                ),
                PipeAction::Post(s) => (
                    s,
                    self.post_slice(
                        core,
                        peer,
                        pool,
                        pipe.op,
                        &pipe.remote,
                        pipe.remote_offset,
                        s.offset,
                        s.len,
                        s.slot,
                        pipe.deadline,
                        pipe.timeout,
                    ),
                    false,
                ),
            };
            match started {
                Ok(stage) => pipe.running.push((slice, stage)),
                Err(e) => {
                    pipe.error.get_or_insert(e.unwrap_or(TransferError::Local {
                        what: "a staged slice did not start".into(),
                    }));
                    if copy {
                        pipe.proto.copy_ended(slice.id, false);
                    } else {
                        pipe.proto.wire_ended(slice.id, false);
                    }
                }
            }
        }
    }

    /// Submits one slice's RDMA request (between pool slot `slot` and
    /// `remote` at `remote_offset + offset`) to the core, on a queue pair
    /// of the peer that is up, nearest the pool's GPU when one is.
    #[allow(clippy::too_many_arguments)]
    fn post_slice(
        &self,
        core: &mut Core,
        peer: &PeerState<V, C>,
        pool: &StagingPool<V, C>,
        op: Op,
        remote: &MemoryDescriptor,
        remote_offset: u64,
        offset: u64,
        len: u64,
        slot: usize,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Stage<C>, Option<TransferError>> {
        let at = remote_offset + offset;
        let cell = self.post_rdma(
            core,
            peer,
            Some(pool.gpu),
            slot,
            op,
            remote,
            at,
            &pool.region,
            pool.slot_addr(slot),
            len,
            (deadline, timeout),
        )?;
        Ok(Stage::OnWire(cell))
    }

    /// Submits one RDMA request of `len` bytes between `local_addr` (in
    /// `local`) and `remote` at `remote_at` to the core, on a queue pair of
    /// the peer that is up, nearest GPU `gpu` when one is; `spread` picks
    /// among the candidates (requests in flight at once spread over them).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn post_rdma(
        &self,
        core: &mut Core,
        peer: &PeerState<V, C>,
        gpu: Option<u32>,
        spread: usize,
        op: Op,
        remote: &MemoryDescriptor,
        remote_at: u64,
        local: &Region<V>,
        local_addr: u64,
        len: u64,
        (deadline, timeout): (Instant, Duration),
    ) -> Result<Arc<CompletionCell>, Option<TransferError>> {
        let local_error = |what: String| Some(TransferError::Local { what });
        // The queue pairs that are up (else those being re-established),
        // on the NICs nearest the GPU when one of those is among them.
        let up: Vec<_> = match peer.qps.iter().any(|q| core.is_ready(q.core)) {
            true => peer.qps.iter().filter(|q| core.is_ready(q.core)).collect(),
            false => peer
                .qps
                .iter()
                .filter(|q| core.accepts_work(q.core))
                .collect(),
        };
        let near: Vec<_> = match gpu.and_then(|g| self.shared.nearest_nics.get(&g)) {
            Some(nics) => up
                .iter()
                .copied()
                .filter(|q| nics.contains(&q.nic))
                .collect(),
            None => Vec::new(),
        };
        let candidates = if near.is_empty() { &up } else { &near };
        let Some(&qp) = candidates.get(spread % candidates.len().max(1)) else {
            return Err(Some(TransferError::PeerGone {
                reason: "every queue pair failed".into(),
            }));
        };
        let device = qp.remote_device.as_deref().unwrap_or("");
        let segment = remote
            .segment(device, remote_at, len)
            .map_err(|e| local_error(format!("the slice's remote segment: {e}")))?;
        let Some(mr) = local.inner.per_nic[qp.nic].mr() else {
            return Err(local_error("the local memory has no MR".into()));
        };
        let rdma = op.send_op(segment.addr + (remote_at - segment.offset), segment.rkey);
        let work = Work::single(rdma, local_addr, len as u32, mr.lkey(), SendFlags::empty());
        let cell = Arc::new(CompletionCell::new());
        let keep: Vec<Keep> = vec![Arc::clone(&local.inner) as Keep];
        core.submit(
            vec![(qp.core, work)],
            Arc::clone(&cell),
            Some((deadline, timeout)),
            keep,
        );
        Ok(cell)
    }
}

impl<V: Api, C: hal_cuda::Api> Engine<V, C> {
    /// Queues the device→host copy of `len` bytes at `src` into slot `slot`.
    fn copy_out(
        &self,
        pool: &StagingPool<V, C>,
        gpu: u32,
        src: u64,
        slot: usize,
        len: u64,
    ) -> Result<Stage<C>, Option<TransferError>> {
        self.queue_copy(gpu, &pool.to_host, "to host", |stream| {
            // SAFETY: the slot is this slice's alone until it is freed, which
            // is after this copy's event has passed; `src..src + len` lies in
            // the staged region the pipe holds, checked against its bounds
            // at submit.
            unsafe {
                stream.copy_device_to_host(pool.slot_addr(slot) as *mut u8, src, len as usize)
            }
        })
    }

    /// Queues the host→device copy of `len` bytes of slot `slot` to `dst`.
    fn copy_in(
        &self,
        pool: &StagingPool<V, C>,
        gpu: u32,
        dst: u64,
        slot: usize,
        len: u64,
    ) -> Result<Stage<C>, Option<TransferError>> {
        self.queue_copy(gpu, &pool.to_device, "to the GPU", |stream| {
            // SAFETY: the slot holds the slice the NIC finished writing (its
            // completion came) and stays this slice's until the event has
            // passed; `dst..dst + len` lies in the staged region the pipe
            // holds.
            unsafe {
                stream.copy_host_to_device(dst, pool.slot_addr(slot) as *const u8, len as usize)
            }
        })
    }

    /// Queues `copy` on `stream` of GPU `gpu` and an event after it.
    fn queue_copy(
        &self,
        gpu: u32,
        stream: &C::Stream,
        what: &str,
        copy: impl FnOnce(&C::Stream) -> Result<(), hal_cuda::CudaError>,
    ) -> Result<Stage<C>, Option<TransferError>> {
        self.copy_event(gpu, stream, what, copy)
            .map(Stage::Copying)
            .map_err(Some)
    }

    /// Queues `copy` on `stream` of GPU `gpu` and returns an event recorded
    /// after it.
    pub(super) fn copy_event(
        &self,
        gpu: u32,
        stream: &C::Stream,
        what: &str,
        copy: impl FnOnce(&C::Stream) -> Result<(), hal_cuda::CudaError>,
    ) -> Result<C::Event, TransferError> {
        let failed = |e: &dyn std::fmt::Display| TransferError::Local {
            what: format!("staging copy {what}: {e}"),
        };
        let event = self
            .gpu(gpu)
            .map_err(|e| failed(&e))?
            .context
            .create_event()
            .map_err(|e| failed(&e))?;
        copy(stream).map_err(|e| failed(&e))?;
        stream.record(&event).map_err(|e| failed(&e))?;
        Ok(event)
    }
}
