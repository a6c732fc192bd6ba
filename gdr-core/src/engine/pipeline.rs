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
//! The pools are the engine's (`staging::StagingPools`, shared by the
//! peers under their own lock); each peer's pipes are the staged path's
//! part of that peer (`staging::StagedPeer`, in the peer's slot), stepped
//! by the engine's pass under the peer's lock: CUDA events are polled
//! there, so a pipeline moves while someone makes progress (a waiter, or
//! a driver thread). Which slice starts, what each does next and how the
//! transfer ends are the protocol's ([`gdr_proto::pipeline::Pipe`], tested
//! in memory); this module hands the copies it asks for to the engine's
//! CUDA worker ([`super::cuda_worker`]) and posts its wire ops through the
//! seam (`Wire::post_rdma`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use hal_cuda::{Context as _, Event as _, Stream as _};

use std::collections::HashMap;

use super::completion::CompletionCell;
use super::cuda_worker::Pending;
use super::events::PooledEvent;
use super::path::{PathCx, RdmaOp};
use super::resources::Resources;
use super::{EngineError, Op, PeerGone, Region, TimedOut, TransferError};
use crate::buffer::Buffer;
use crate::descriptor::MemoryDescriptor;
use gdr_proto::pipeline::{PipeAction, PipeFailure, Slice};

/// The pinned bounce slots of one GPU, registered on every NIC.
pub(super) struct StagingPool {
    pub gpu: u32,
    pub slot_size: u64,
    /// Free slot indices, lowest first out.
    pub free: Vec<usize>,
    pub region: Region,
    pub to_host: Arc<hal_cuda::dynamic::DynStream>,
    pub to_device: Arc<hal_cuda::dynamic::DynStream>,
    _buffer: Buffer,
}

impl StagingPool {
    pub fn slot_addr(&self, slot: usize) -> u64 {
        self.region.inner.addr + slot as u64 * self.slot_size
    }
}

/// Where one slice is.
enum Stage {
    /// Its copy (device→host for a WRITE, host→device for a READ) runs.
    Copying(PendingCopy),
    /// Its RDMA request is with the engine's core.
    OnWire(Arc<CompletionCell>),
}

/// One staged transfer going through its GPU's pool.
pub(super) struct Pipe {
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
    running: Vec<(Slice, Stage)>,
    /// Why it failed, in the engine's terms (the first failure).
    error: Option<TransferError>,
    deadline: Instant,
    timeout: Duration,
    cell: Arc<CompletionCell>,
    /// The staged region (its memory stays while the pipe runs, and while
    /// a copy of it waits on the CUDA worker).
    region: Region,
}

impl Pipe {
    /// A pipe for `len` bytes at `offset` of staged `region` (on GPU
    /// `gpu`) against `remote` at `remote_offset`, for the peer in slot
    /// `peer`; its outcome goes to the returned cell.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        peer: usize,
        op: Op,
        gpu: u32,
        region: &Region,
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
            region: region.clone(),
        };
        (pipe, cell)
    }

    /// A failure here (not one of its slices): the pipe fails with it.
    fn fail_local(&mut self, error: TransferError) {
        self.error.get_or_insert(error);
        self.proto.fail(PipeFailure::Failed);
    }

    /// Whether its outcome goes to `cell`.
    pub fn ends(&self, cell: &Arc<CompletionCell>) -> bool {
        Arc::ptr_eq(cell, &self.cell)
    }

    /// When it fails if not done.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Its peer is gone: no new slice starts; it ends
    /// [`TransferError::PeerGone`] once its slices in flight drained.
    pub fn peer_gone(&mut self) {
        self.proto.fail(PipeFailure::PeerGone);
    }
}

/// Cancels the pipes whose outcome goes to one of `cells`: no new slice
/// starts; each ends [`TransferError::Cancelled`] once its slices in
/// flight have drained.
pub(super) fn cancel(pipes: &mut [Pipe], cells: &[Arc<CompletionCell>]) {
    for pipe in pipes.iter_mut() {
        if cells.iter().any(|c| pipe.ends(c)) {
            pipe.proto.fail(PipeFailure::Cancelled);
        }
    }
}

/// The pool of GPU `gpu`: made beforehand by the submit, outside the
/// locks and off progress ([`make_pool`]), or here, at its first
/// use, where a caller did not.
pub(super) fn pool<'p>(
    res: &Resources,
    pools: &'p mut HashMap<u32, StagingPool>,
    gpu: u32,
) -> Result<&'p mut StagingPool, EngineError> {
    use std::collections::hash_map::Entry;
    match pools.entry(gpu) {
        Entry::Occupied(pool) => Ok(pool.into_mut()),
        Entry::Vacant(vacant) => Ok(vacant.insert(make_pool(res, gpu)?)),
    }
}

/// Makes GPU `gpu`'s pool: allocated, pinned, registered on every NIC,
/// with its two streams. Driver calls that block while a free waits for a
/// held stream: made by the submitting thread, outside every lock.
pub(super) fn make_pool(res: &Resources, gpu: u32) -> Result<StagingPool, EngineError> {
    let config = &res.config;
    let slot_size = config.staging_slice.max(4096);
    let slots = config.staging_slots.max(1);
    let _span = tracing::debug_span!("staging_pool", gpu, slots, slot_size).entered();
    let context = &res.gpu(gpu)?.context;
    let buffer = Buffer::alloc_pinned(context, slot_size * slots as u64)?;
    let region = res.register(&buffer)?;
    tracing::info!(gpu, slots, slot_size, "staging pool ready");
    Ok(StagingPool {
        gpu,
        slot_size,
        free: (0..slots).rev().collect(),
        region,
        to_host: Arc::new(context.create_stream()?),
        to_device: Arc::new(context.create_stream()?),
        _buffer: buffer,
    })
}

/// Steps every pipeline: slices whose copy ended go on the wire (or free
/// their slot), slices off the wire get their copy (or free their slot),
/// new slices start while slots are free, and pipes with nothing left
/// deliver their outcome.
/// Returns how many slices moved on (a driver counts it as work).
pub(super) fn pump(
    cx: &mut PathCx<'_>,
    pipes: &mut Vec<Pipe>,
    pools: &mut HashMap<u32, StagingPool>,
) -> usize {
    if pipes.is_empty() {
        return 0;
    }
    let mut moved = 0;
    let now = cx.now;
    for pipe in pipes.iter_mut() {
        if cx.wire.peer(pipe.peer).is_none() {
            pipe.proto.fail(PipeFailure::PeerGone);
            continue;
        }
        let pool = match pool(cx.res, pools, pipe.gpu) {
            Ok(pool) => pool,
            Err(e) => {
                pipe.fail_local(TransferError::from_engine("the staging pool", e));
                continue;
            }
        };
        moved += advance(pipe);
        // Next steps and freed slots first: a slot freed now serves a new
        // slice in this same call.
        carry_out(cx, pool, pipe);
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
        carry_out(cx, pool, pipe);
    }
    pipes.retain_mut(|pipe| {
        let Some(outcome) = pipe.proto.poll_outcome() else {
            return true;
        };
        // The first failure, as the protocol recorded it; the details of
        // the pipe's own failures are the driver's.
        let outcome = outcome.map_err(|why| match why {
            PipeFailure::TimedOut => TransferError::Timeout(TimedOut {
                after: pipe.timeout,
            }),
            PipeFailure::Cancelled => TransferError::Cancelled,
            PipeFailure::PeerGone => TransferError::PeerGone(
                cx.wire
                    .peer(pipe.peer)
                    .and_then(|p| p.gone)
                    .unwrap_or(PeerGone::Closed),
            ),
            PipeFailure::Failed => pipe.error.take().unwrap_or(TransferError::Internal {
                what: "a staged slice failed",
            }),
        });
        pipe.cell.complete(outcome);
        false
    });
    moved
}

/// Reports the copies and wire ops of `pipe` that ended to its protocol;
/// returns how many.
fn advance(pipe: &mut Pipe) -> usize {
    let mut ended = Vec::new();
    pipe.running.retain(|(slice, stage)| {
        let end = match stage {
            Stage::Copying(copy) => match copy.is_complete("staging copy") {
                Ok(false) => return true,
                Ok(true) => (true, None),
                Err(e) => (true, Some(e)),
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
fn carry_out(cx: &mut PathCx<'_>, pool: &mut StagingPool, pipe: &mut Pipe) {
    while let Some(action) = pipe.proto.poll_action() {
        let (slice, started, copy) = match action {
            PipeAction::Free { slot } => {
                pool.free.push(slot);
                continue;
            }
            PipeAction::CopyOut(s) => (s, copy_slice(cx.res, pool, pipe, s, false), true),
            PipeAction::CopyIn(s) => (s, copy_slice(cx.res, pool, pipe, s, true), true),
            // One slice's RDMA op between its pool slot and the remote
            // range, on a queue pair of the peer nearest the pool's GPU.
            PipeAction::Post(s) => (
                s,
                cx.wire
                    .post_rdma(
                        pipe.peer,
                        Some(pool.gpu),
                        s.slot,
                        RdmaOp {
                            op: pipe.op,
                            remote: &pipe.remote,
                            remote_at: pipe.remote_offset + s.offset,
                            local: &pool.region,
                            local_addr: pool.slot_addr(s.slot),
                            len: s.len,
                        },
                        (pipe.deadline, pipe.timeout),
                    )
                    .map(Stage::OnWire),
                false,
            ),
        };
        match started {
            Ok(stage) => pipe.running.push((slice, stage)),
            Err(e) => {
                pipe.error
                    .get_or_insert(e.unwrap_or(TransferError::Internal {
                        what: "a staged slice did not start",
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

/// Hands slice `s`'s copy between its pool slot and the pipe's GPU memory
/// to the CUDA worker: host→device when `to_gpu` (a READ's slice the NIC
/// landed), else device→host (a WRITE's, before the wire). The job holds
/// the pipe's region and the pool's until the copy is queued; their frees
/// wait for it from then on.
fn copy_slice(
    res: &Resources,
    pool: &StagingPool,
    pipe: &Pipe,
    s: Slice,
    to_gpu: bool,
) -> Result<Stage, Option<TransferError>> {
    let (host, gpu, len) = (
        pool.slot_addr(s.slot),
        pipe.gpu_addr + s.offset,
        s.len as usize,
    );
    let (stream, what) = if to_gpu {
        (&pool.to_device, TO_GPU)
    } else {
        (&pool.to_host, TO_HOST)
    };
    let keep = (pipe.region.clone(), pool.region.clone());
    copy_event(res, pool.gpu, stream, what, keep, move |stream| {
        if to_gpu {
            // SAFETY: the slot holds the slice the NIC finished writing
            // (its completion came) and stays this slice's until the
            // event has passed; `gpu..gpu + len` lies in the staged
            // region, checked against its bounds at submit; both memories
            // are held (`keep`) until the copy is queued.
            unsafe { stream.copy_host_to_device(gpu, host as *const u8, len) }
        } else {
            // SAFETY: as above, the other way: the slot is this slice's
            // alone until it is freed, after this copy's event has passed.
            unsafe { stream.copy_device_to_host(host as *mut u8, gpu, len) }
        }
    })
    .map(Stage::Copying)
    .map_err(Some)
}

/// What a failed staging copy to host says it was doing
/// ([`TransferError::Gpu`]).
pub(super) const TO_HOST: &str = "staging copy to host";
/// What a failed staging copy to the GPU says it was doing.
pub(super) const TO_GPU: &str = "staging copy to the GPU";

/// A copy handed to the CUDA worker ([`super::cuda_worker`]): queued on
/// its stream there, with an event recorded after it.
pub(super) struct PendingCopy(Pending<Result<PooledEvent, TransferError>>);

impl PendingCopy {
    /// Whether the copy has run on the GPU (never blocks): `false` while
    /// the worker has not queued it or its event has not passed; the
    /// failure of either.
    pub(super) fn is_complete(&self, what: &'static str) -> Result<bool, TransferError> {
        match self.0.get() {
            None => Ok(false),
            Some(Ok(event)) => event
                .is_complete()
                .map_err(|source| TransferError::Gpu { what, source }),
            Some(Err(e)) => Err(e.clone()),
        }
    }
}

/// Hands `copy` on `stream` of GPU `gpu` to the CUDA worker, which queues
/// it and records an event after it (an event from the pool: see
/// `super::events`). `copy` names only addresses; `keep` holds the memory
/// behind them (the regions) until the copy is queued, after which frees
/// wait for it; the caller keeps the ranges for the copy's use until it
/// is complete (or failed).
pub(super) fn copy_event(
    res: &Resources,
    gpu: u32,
    stream: &Arc<hal_cuda::dynamic::DynStream>,
    what: &'static str,
    keep: impl Send + 'static,
    copy: impl FnOnce(&hal_cuda::dynamic::DynStream) -> Result<(), hal_cuda::CudaError> + Send + 'static,
) -> Result<PendingCopy, TransferError> {
    res.gpu(gpu)
        .map_err(|e| TransferError::from_engine(what, e))?;
    let stream = Arc::clone(stream);
    Ok(PendingCopy(res.cuda.run(res, move |res| {
        let failed = |source| TransferError::Gpu { what, source };
        let gpu = res
            .gpu(gpu)
            .map_err(|e| TransferError::from_engine(what, e))?;
        let event = res.events.take(gpu).map_err(failed)?;
        copy(&stream).map_err(failed)?;
        stream.record(&event).map_err(failed)?;
        drop(keep);
        Ok(event)
    })))
}
