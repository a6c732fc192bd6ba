//! [`Batch`]: what a submit returns; it ends exactly once (`wait`,
//! `status`, `cancel`, a stream fence, or `.await` as a `Future`), after
//! the GPU fence where the batch read into GPU memory.

use super::*;

/// A submitted batch (or control message): ends exactly once.
pub struct Batch {
    pub(super) engine: Engine,
    pub(super) cell: Arc<CompletionCell>,
    /// Its peer's slot and its id in that peer's core; `None` for a
    /// control message (not cancellable).
    pub(super) id: Option<(Arc<PeerLock>, BatchId)>,
    /// GPUs this batch READ into: fenced once it succeeds, before
    /// [`Batch::wait`] or the `Future` returns.
    pub(super) fence: Vec<u32>,
    /// Set by whoever applied the GPU fence (a waiter, or the release of a
    /// stream fence): once is enough.
    pub(super) fenced: Arc<std::sync::atomic::AtomicBool>,
    /// A gated batch's link to the batch its gate opens into
    /// ([`Peer::submit_after_stream`]).
    pub(super) gate: Option<Arc<gate::GateLink>>,
    /// The staged path's part of the batch (pipes, requests through the
    /// peer's landing slots): ends with them.
    pub(super) parts: Vec<Arc<CompletionCell>>,
    /// The peer whose slot holds the batch's work on the paths beside the
    /// NIC (the staged requests of `parts`, a peer copy's flight).
    pub(super) path_peer: Option<Arc<PeerLock>>,
    /// The CQs its peer's queue pairs complete on: a waiter spins on
    /// these first ([`Engine::progress_of`]).
    pub(super) home: CqSet,
}

impl fmt::Debug for Batch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batch")
            .field("id", &self.id.as_ref().map(|(_, id)| id))
            .field("outcome", &self.cell.outcome())
            .finish()
    }
}

impl Batch {
    /// A batch that is just `cell` (a control message, an empty batch).
    pub(super) fn of_cell(engine: Engine, cell: Arc<CompletionCell>) -> Self {
        Self {
            engine,
            cell,
            id: None,
            fence: Vec::new(),
            fenced: Default::default(),
            gate: None,
            parts: Vec::new(),
            path_peer: None,
            home: CqSet::ALL,
        }
    }

    /// The outcome once every part has ended: the first error, in order.
    pub(super) fn outcome(&self) -> Option<Outcome> {
        let mut first = Ok(());
        for cell in std::iter::once(&self.cell).chain(&self.parts) {
            match cell.outcome()? {
                Err(e) if first.is_ok() => first = Err(e),
                _ => {}
            }
        }
        Some(first)
    }

    /// The outcome, if it has ended (makes progress first: on its peer's
    /// CQs, and, with no driver running, the others now and then and the
    /// engine's pass when due, as a waiter's spin does; a thread looking
    /// at its own batches then takes no other peer's completions, and
    /// their locks). With a driver, what only the pass ends (a staged or
    /// peer-copy batch) is ended by the driver: a loop of `status` on the
    /// thread a tokio driver runs on waits for it forever; `.await` it.
    pub fn status(&self) -> Option<Outcome> {
        if self.outcome().is_none() {
            self.engine.progress_of(self.home);
        }
        self.outcome().map(|o| self.fenced(o))
    }

    /// The batch's outcome with its GPU fence applied (once).
    pub(super) fn fenced(&self, outcome: Outcome) -> Outcome {
        if outcome.is_ok() && !self.fence.is_empty() && !self.fenced.swap(true, Ordering::AcqRel) {
            for &ordinal in &self.fence {
                self.engine
                    .fence_gpu(ordinal)
                    .map_err(|e| TransferError::from_engine("GPU fence after the batch", e))?;
            }
        }
        outcome
    }

    /// Waits for the outcome, making progress, at most `timeout`; a batch
    /// still running then is not cancelled ([`TransferError::Timeout`] is
    /// returned for the wait, the batch's own deadline still runs).
    pub fn wait(&self, timeout: Duration) -> Outcome {
        // Already over (a wait after progress elsewhere): no clock read.
        if let Some(outcome) = self.outcome() {
            return self.fenced(outcome);
        }
        let engine = &self.engine;
        // A spin on its peer's CQs alone first: threads waiting on
        // different peers' batches then poll different CQs, none taking
        // (and locking) another's peer, and none waiting for the reactor's
        // lead. A batch that outlasts the spin waits in the reactor.
        engine.spin_home_until(self.home, || self.outcome().is_some());
        if let Some(outcome) = self.outcome() {
            return self.fenced(outcome);
        }
        let deadline = engine.shared.config.clock.now().checked_add(timeout);
        engine
            .shared
            .reactor
            .wait_until(engine, deadline, || self.outcome().is_some());
        match self.outcome() {
            Some(outcome) => self.fenced(outcome),
            None => Err(TransferError::Timeout(TimedOut { after: timeout })),
        }
    }

    /// Makes `stream` wait for this batch: work queued on `stream` after
    /// this call runs once the batch has ended and, where the GPU needs
    /// it, its inbound writes were flushed (see `fence`). The stream is
    /// released however the batch ends: work after the fence may use the
    /// data only if the batch succeeded ([`Batch::status`]).
    ///
    /// A batch that ends without a CUDA call (its transfers on a NIC's
    /// direct rungs) is fenced without blocking a thread: the stream waits
    /// on a word of the engine's pinned memory that its progress stores
    /// when the batch ends. Any other batch (staged transfers, a peer copy,
    /// a gated batch or a control message) is waited for here, on the
    /// host, and nothing is queued on the stream: its end needs CUDA calls
    /// (copies, events) that the driver holds back while any free of the
    /// process waits for the held stream, so holding the stream on it
    /// could deadlock the process (see the guide's Fences section).
    pub fn fence_stream(&self, stream: &crate::Stream) -> Result<(), EngineError> {
        let stream = stream.erased();
        if !self.ends_without_cuda() {
            let _span = tracing::debug_span!("fence_on_host").entered();
            // The outcome stays the batch's (`status`); the stream only
            // has to come after the end.
            let _ = self.wait(Duration::MAX);
            return Ok(());
        }
        let cells = vec![Arc::clone(&self.cell)];
        let _span = tracing::debug_span!("fence_stream").entered();
        let engine = &self.engine;
        engine.ensure_fence_page()?;
        // The word under the lock, the stream's wait on it outside (a
        // stream operation can block while the driver's queue is full).
        let taken = lock_streams(&engine.shared)
            .stream_fences
            .take_word(&engine.shared.res)?;
        let queued = super::fence::StreamFences::queue_wait(stream, &taken);
        let mut streams = lock_streams(&engine.shared);
        if let Err(e) = queued {
            streams.stream_fences.unused(taken);
            return Err(e);
        }
        streams.stream_fences.queued(
            taken,
            cells,
            self.fence.clone(),
            Arc::clone(&self.fenced),
        );
        drop(streams);
        engine.ensure_own_driver();
        engine.wake();
        Ok(())
    }

    /// Whether the batch ends without any CUDA call of the engine's: a
    /// batch of the core (not a control message, a peer copy or a gate)
    /// with no staged part.
    fn ends_without_cuda(&self) -> bool {
        self.id.is_some() && self.parts.is_empty() && self.gate.is_none()
    }

    /// Cancels the batch: what is not posted is dropped; it ends
    /// [`TransferError::Cancelled`] once nothing of it is in flight (a
    /// gated batch whose gate has not opened: at once, nothing posted).
    pub fn cancel(&self) {
        if let Some(gate) = &self.gate {
            gate.cancel();
        }
        if let Some((lock, id)) = &self.id {
            let mut guard = lock_slot(lock);
            guard.core.cancel(*id);
            self.engine.settle_slot(guard);
        }
        if let Some(lock) = &self.path_peer {
            // The staged parts (pipelines and requests through the peer's
            // landing slots) and a peer copy's flight: the paths' parts of
            // the peer, in its slot.
            let mut staged = self.engine.shared.staged();
            let cells = staged.cancel(&self.parts);
            let mut guard = lock_slot(lock);
            let PeerSlot {
                core,
                staged: part,
                copy,
                ..
            } = &mut *guard;
            let mut part = PeerPart {
                staged: part,
                rendezvous: core.conn.rendezvous_mut(),
            };
            staged.cancel_peer(&mut part, &cells);
            let mut proto = core.conn.lend_peer_copy();
            self.engine.shared.copies().cancel_peer(
                &mut CopyPart {
                    copy,
                    proto: &mut proto,
                },
                std::slice::from_ref(&self.cell),
            );
            core.conn.return_peer_copy(proto);
            // They end at the next pass.
            self.engine.shared.due.set();
        }
        self.engine.wake();
    }

    /// Runs `f` while this thread counts as spinning on the batch's home
    /// CQs, as [`Batch::wait`]'s spin does (other threads' polls of every
    /// CQ pass them by). Feature `testing`.
    #[cfg(feature = "testing")]
    pub fn while_spun_on<R>(&self, f: impl FnOnce() -> R) -> R {
        let _spinning = self.engine.spin_home(self.home);
        f()
    }

    /// The completion cell (for a driver that waits elsewhere). Feature
    /// `testing`.
    #[cfg(feature = "testing")]
    pub fn cell(&self) -> &Arc<CompletionCell> {
        &self.cell
    }
}

/// A gate opens into a batch of the engine's ([`Peer::submit_after_stream`]).
impl gate::Opened for Batch {
    fn cancel(&self) {
        Batch::cancel(self);
    }

    fn ended(&self) -> Option<Outcome> {
        self.outcome().map(|outcome| self.fenced(outcome))
    }
}

impl Batch {
    /// Polls every part, registering the task's waker with those pending.
    pub(super) fn poll_parts(&self, cx: &mut TaskContext<'_>) -> Poll<Outcome> {
        let mut pending = false;
        for cell in std::iter::once(&self.cell).chain(&self.parts) {
            pending |= cell.poll(cx).is_pending();
        }
        match self.outcome() {
            Some(outcome) if !pending => Poll::Ready(outcome),
            _ => Poll::Pending,
        }
    }
}

/// Awaiting a batch is runtime-agnostic, and its poll only registers the
/// task's waker: a driver completes the batch and wakes the task
/// ([`Engine::spawn_driver`]'s thread, or, with feature `tokio`, the task
/// of `Engine::drive_on_tokio`). With no driver running, the first
/// pending poll starts the engine's own thread, which drives from then on.
/// No poll makes progress itself, and a task is not re-polled before its
/// batch ends.
impl Future for Batch {
    type Output = Outcome;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Outcome> {
        self.poll_ended(cx)
    }
}

impl Batch {
    /// The `Future`'s poll through a shared reference (a batch awaited by
    /// a runtime that holds it behind a handle, Python's asyncio): the
    /// outcome once ended, else the task's waker registered (with the
    /// engine's own thread started when nothing drives).
    pub fn poll_ended(&self, cx: &mut TaskContext<'_>) -> Poll<Outcome> {
        // The waker is registered with every part still running before
        // their outcomes are read: an end after that wakes it.
        if let Poll::Ready(outcome) = self.poll_parts(cx) {
            return Poll::Ready(self.fenced(outcome));
        }
        if self.engine.shared.drivers.load(Ordering::Acquire) == 0 {
            self.engine.ensure_own_driver();
        }
        Poll::Pending
    }
}
