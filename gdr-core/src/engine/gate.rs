//! Gated batches: a batch that starts only once a CUDA stream reaches a
//! point (the data a kernel or a copy produced), without any CPU thread
//! synchronising with the stream.
//!
//! [`Peer::submit_after_stream`] checks the transfers at once (local
//! bounds, the grant live on this connection, its rights and bounds, as
//! [`Peer::submit_with_timeout`] does), then queues on the stream a write
//! of a fresh value into a word of the engine's pinned fence page
//! (`cuStreamWriteValue32`, [`super::fence`]) and an event after it, and
//! holds the batch unposted. The engine's progress (its own thread, so
//! nobody has to poll) sees the word reach the value and submits the batch
//! through the same path as [`Peer::submit_with_timeout`] (staged
//! transfers included). The stream's write carries the default memory
//! barrier: what the stream did before the gate is done and visible when
//! the word changes, so the batch moves the data the stream produced.
//!
//! A stream without memory operations (the driver has none:
//! `NotSupported`) gets only the event, which progress polls. On the word
//! path the event is polled too, every 64th progress call: it
//! is how a stream that failed before the gate is told
//! ([`TransferError::StreamFailed`]).
//!
//! The batch's deadline counts from the call: a gate that has not opened
//! by then ends the batch with [`TransferError::Timeout`]; a peer gone
//! meanwhile ends it with [`TransferError::PeerGone`]; [`Batch::cancel`]
//! before it opens ends it [`TransferError::Cancelled`] at once, and
//! nothing of it is ever posted. Dropping the batch does not cancel it (as
//! for any batch). A gate that ended before its stream wrote the word
//! keeps the word out of use until the write lands ([`super::fence`]'s
//! word book), so that late write can never touch a later gate's word.
//!
//! While a gate waits, the engine's own thread does not back off to its
//! idle millisecond: like a thread in `Batch::wait` it spins briefly, then
//! yields, then sleeps about 20 µs between looks.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gdr_proto::gate::{GateEnd, GateWait, Seen, Signal, Step, at_open};
use hal_cuda::{Context as _, Event as _, Stream as _};
use hal_verbs::Api;

use super::completion::CompletionCell;
use super::{
    Batch, Engine, EngineError, Idle, Op, Peer, Region, State, Transfer, TransferError,
    check_transfer,
};
use crate::descriptor::MemoryDescriptor;
use crate::sync::{Mutex, lock};

/// The gates of an engine, in its state.
pub(super) struct Gates<V: Api, C: hal_cuda::Api> {
    /// Not yet reached by their stream.
    waiting: Vec<Gate<V, C>>,
    /// Reached, to be submitted outside the engine's lock.
    ready: Vec<Held<V, C>>,
    /// Submitted: their batch's outcome is handed to the caller's batch.
    opened: Vec<Arc<GateLink<V, C>>>,
}

impl<V: Api, C: hal_cuda::Api> Default for Gates<V, C> {
    fn default() -> Self {
        Self {
            waiting: Vec::new(),
            ready: Vec::new(),
            opened: Vec::new(),
        }
    }
}

impl<V: Api, C: hal_cuda::Api> Gates<V, C> {
    /// Whether [`Engine::serve_gates`] has work (outside the lock).
    pub(super) fn serve_pending(&self) -> bool {
        !self.ready.is_empty() || !self.opened.is_empty()
    }
}

/// What the caller's [`Batch`] and the engine share of a gated batch.
pub(super) struct GateLink<V: Api, C: hal_cuda::Api> {
    /// The caller's batch's outcome.
    cell: Arc<CompletionCell>,
    cancelled: AtomicBool,
    /// The batch the gate opened into, until its outcome is handed on.
    opened: Mutex<Option<Batch<V, C>>>,
    /// The bound the caller gave (reported by a timeout).
    timeout: Duration,
}

impl<V: Api, C: hal_cuda::Api> GateLink<V, C> {
    /// Cancels the gated batch: before the gate opens it ends now and
    /// nothing is posted; after, the opened batch is cancelled.
    pub(super) fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        // The lock orders this against the opening (which looks at the
        // flag under it): the batch is either never submitted or cancelled.
        let opened = lock(&self.opened);
        match &*opened {
            Some(batch) => batch.cancel(),
            None => {
                self.cell.complete(Err(TransferError::Cancelled));
            }
        }
    }
}

/// One transfer of a gated batch, owned until the gate opens.
struct HeldTransfer<V: Api> {
    op: Op,
    local: Region<V>,
    local_offset: u64,
    remote: MemoryDescriptor,
    remote_offset: u64,
    len: u64,
}

impl<V: Api> HeldTransfer<V> {
    fn of(t: &Transfer<'_, V>) -> Self {
        Self {
            op: t.op,
            local: t.local.clone(),
            local_offset: t.local_offset,
            remote: t.remote.clone(),
            remote_offset: t.remote_offset,
            len: t.len,
        }
    }

    fn transfer(&self) -> Transfer<'_, V> {
        Transfer {
            op: self.op,
            local: &self.local,
            local_offset: self.local_offset,
            remote: &self.remote,
            remote_offset: self.remote_offset,
            len: self.len,
        }
    }
}

/// A gated batch, held unposted.
struct Held<V: Api, C: hal_cuda::Api> {
    link: Arc<GateLink<V, C>>,
    /// The peer's slot.
    slot: usize,
    transfers: Vec<HeldTransfer<V>>,
    deadline: Instant,
    span: tracing::Span,
}

/// A gate its stream has not reached yet: what the protocol decides with
/// ([`GateWait`]), and the event recorded on the stream after the gate
/// (after the word's write, where there is one: it tells a stream that
/// failed).
struct Gate<V: Api, C: hal_cuda::Api> {
    held: Held<V, C>,
    wait: GateWait,
    event: C::Event,
}

impl<V: Api, C: hal_cuda::Api> Peer<V, C> {
    /// Submits a batch that starts only once `stream` has reached this
    /// point: work queued on `stream` before this call (a kernel, a copy)
    /// is done, and its memory visible, before anything of the batch is
    /// posted; no CPU thread waits for the stream (see [`super::gate`]).
    ///
    /// Every transfer is checked now, as by [`Peer::submit_with_timeout`],
    /// and a refusal returns at once. `timeout` counts from this call and
    /// covers the wait for the stream: a gate that never opens ends the
    /// batch with [`TransferError::Timeout`]. A stream that fails first
    /// ends it with [`TransferError::StreamFailed`]. [`Batch::cancel`]
    /// before the gate opens ends it at once, with nothing posted.
    pub fn submit_after_stream(
        &self,
        stream: &C::Stream,
        transfers: &[Transfer<'_, V>],
        timeout: Duration,
    ) -> Result<Batch<V, C>, EngineError> {
        let span = tracing::debug_span!(
            "gate",
            transfers = transfers.len(),
            word = tracing::field::Empty
        );
        let _entered = span.enter();
        let engine = &self.engine;
        self.read_peer(|_, peer| -> Result<(), EngineError> {
            if let Some(why) = &peer.gone {
                return Err(EngineError::PeerGone(why.clone()));
            }
            transfers.iter().try_for_each(|t| check_transfer(peer, t))
        })??;
        let now = engine.shared.config.clock.now();
        let link = Arc::new(GateLink {
            cell: Arc::new(CompletionCell::new()),
            cancelled: AtomicBool::new(false),
            opened: Mutex::new(None),
            timeout,
        });
        let held = Held {
            link: Arc::clone(&link),
            slot: self.slot,
            transfers: transfers.iter().map(HeldTransfer::of).collect(),
            // A bound past what an Instant holds never passes.
            deadline: now
                .checked_add(timeout)
                .unwrap_or(now + Duration::from_secs(1 << 32)),
            span: span.clone(),
        };
        {
            let mut state = lock(&engine.shared.state);
            let (signal, event) = engine.queue_gate(&mut state, stream)?;
            if let Signal::Word { word, value } = signal {
                span.record("word", word);
                tracing::debug!(value, "gate queued on the stream (memory operation)");
            } else {
                tracing::debug!("gate queued on the stream (event)");
            }
            let wait = GateWait {
                signal,
                deadline: held.deadline,
            };
            state.gates.waiting.push(Gate { held, wait, event });
        }
        engine.ensure_own_driver();
        Ok(Batch {
            gate: Some(Arc::clone(&link)),
            ..Batch::of_cell(engine.clone(), Arc::clone(&link.cell))
        })
    }
}

impl<V: Api, C: hal_cuda::Api> Engine<V, C> {
    /// Queues the gate's signal on `stream`: the word write where the
    /// stream has memory operations, and an event after it.
    fn queue_gate(
        &self,
        state: &mut State<V, C>,
        stream: &C::Stream,
    ) -> Result<(Signal, C::Event), EngineError> {
        let words = self.fence_words(state)?;
        let (word, value) = words.book.take().ok_or_else(|| {
            EngineError::Refused("every word of the fence page is outstanding".into())
        })?;
        // SAFETY: the word is 4-byte aligned pinned (portable) host memory
        // of the engine's, which the device may write (unified addressing)
        // and which is never freed (`fence`'s module docs).
        let written = unsafe { stream.write_value32(words.addr(word), value) };
        match written {
            Ok(()) => match self.record_gate_event(stream) {
                Ok(event) => Ok((Signal::Word { word, value }, event)),
                Err(e) => {
                    // The write is queued: the word waits for it.
                    words.book.await_write(word, value);
                    Err(e)
                }
            },
            Err(hal_cuda::CudaError::NotSupported { .. }) => {
                words.book.unused(word);
                Ok((Signal::Event, self.record_gate_event(stream)?))
            }
            Err(e) => {
                words.book.unused(word);
                Err(e.into())
            }
        }
    }

    /// An event recorded on `stream` now. An event records only on a
    /// stream of its own context, and which GPU `stream` belongs to is
    /// not known here: each of the engine's GPUs is tried in turn.
    fn record_gate_event(&self, stream: &C::Stream) -> Result<C::Event, EngineError> {
        let gpus = self
            .shared
            .nics
            .first()
            .map_or(&[][..], |n| n.ladder.gpus());
        let mut refused = None;
        for gpu in gpus {
            let event = gpu.context.create_event()?;
            match stream.record(&event) {
                Ok(()) => return Ok(event),
                Err(e) => refused = Some(e),
            }
        }
        Err(refused.map_or_else(
            || EngineError::Unavailable("no GPU to record a gate's event on".into()),
            EngineError::from,
        ))
    }

    /// Looks at every waiting gate (under the engine's lock): those their
    /// stream reached move to `ready`, those that ended (cancelled, timed
    /// out, stream failed, peer gone) end their batch. Returns how many
    /// gates and late-written words it handled.
    pub(super) fn poll_gates(&self, state: &mut State<V, C>, now: Instant) -> usize {
        let State {
            gates,
            fence_words,
            peers,
            ticks,
            ..
        } = state;
        let mut handled = fence_words
            .as_mut()
            .map_or(0, |words| words.collect_late_writes());
        let tick = *ticks;
        let word_now = |wait: &GateWait, words: &Option<super::fence::FenceWords<C>>| match (
            wait.signal,
            words,
        ) {
            (Signal::Word { word, .. }, Some(words)) => words.word(word).load(Ordering::Acquire),
            _ => 0,
        };
        let mut i = 0;
        while i < gates.waiting.len() {
            let gate = &gates.waiting[i];
            let held = &gate.held;
            // What was seen of the stream: the word (a load) each time,
            // the event (a driver call) when the protocol says.
            let mut failure = None;
            let seen = if gate.wait.word_reached(word_now(&gate.wait, fence_words)) {
                Seen::Reached
            } else if gate.wait.looks_at_event(tick) {
                match gate.event.is_complete() {
                    Ok(true) => Seen::Reached,
                    Ok(false) => Seen::NotYet,
                    Err(source) => {
                        failure = Some(source);
                        Seen::StreamFailed
                    }
                }
            } else {
                Seen::NotYet
            };
            let peer = peers.get(held.slot).and_then(Option::as_ref);
            let peer_gone = peer.is_none_or(|p| p.gone.is_some());
            let cancelled = held.link.cancelled.load(Ordering::Acquire);
            let step = gate.wait.step(cancelled, seen, peer_gone, now);
            let verdict = match step {
                Step::Wait => {
                    i += 1;
                    continue;
                }
                Step::Open => Ok(()),
                Step::End(GateEnd::Cancelled) => Err(TransferError::Cancelled),
                Step::End(GateEnd::TimedOut) => Err(TransferError::Timeout {
                    after: held.link.timeout,
                }),
                Step::End(GateEnd::PeerGone) => Err(TransferError::PeerGone {
                    reason: peer
                        .and_then(|p| p.gone.clone())
                        .unwrap_or_else(|| "closed".to_owned()),
                }),
                Step::End(GateEnd::StreamFailed) => match failure {
                    Some(source) => Err(TransferError::StreamFailed { source }),
                    None => Err(TransferError::Local {
                        what: "the gate's stream failed".into(),
                    }),
                },
            };
            let Gate { held, wait, .. } = gates.waiting.swap_remove(i);
            handled += 1;
            let span = held.span.clone();
            let _entered = span.enter();
            // Reached through the event, the write came before it; a word
            // not showing it yet still waits for it, as does one whose gate
            // ended first.
            let word = word_now(&wait, fence_words);
            if let Some(words) = fence_words.as_mut() {
                wait.retire(&mut words.book, verdict.is_ok(), word);
            }
            match verdict {
                Ok(()) => {
                    tracing::debug!("the stream reached the gate");
                    gates.ready.push(held);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "the gate ended before it opened");
                    held.link.cell.complete(Err(e));
                }
            }
        }
        handled
    }

    /// Submits the batches whose gate opened and hands on the outcomes of
    /// those that ended (outside the engine's lock: submitting takes it).
    pub(super) fn serve_gates(&self) -> usize {
        let (ready, opened) = {
            let mut state = lock(&self.shared.state);
            (
                std::mem::take(&mut state.gates.ready),
                std::mem::take(&mut state.gates.opened),
            )
        };
        let mut handled = 0;
        let mut running = Vec::new();
        for link in opened {
            if self.hand_on(&link) {
                handled += 1;
            } else {
                running.push(link);
            }
        }
        for held in ready {
            handled += 1;
            if let Some(link) = self.open(held) {
                running.push(link);
            }
        }
        if !running.is_empty() {
            lock(&self.shared.state).gates.opened.extend(running);
        }
        handled
    }

    /// Submits the batch of a gate its stream reached, unless it was
    /// cancelled or its deadline passed; returns its link while it runs.
    fn open(&self, held: Held<V, C>) -> Option<Arc<GateLink<V, C>>> {
        let _entered = held.span.enter();
        let link = held.link;
        let end = |e: TransferError| {
            tracing::debug!(error = %e, "the gate opened too late");
            link.cell.complete(Err(e));
            None
        };
        let mut opened = lock(&link.opened);
        let left = match at_open(
            link.cancelled.load(Ordering::SeqCst),
            self.shared.config.clock.now(),
            held.deadline,
        ) {
            Ok(left) => left,
            Err(GateEnd::Cancelled) => return end(TransferError::Cancelled),
            Err(_) => {
                return end(TransferError::Timeout {
                    after: link.timeout,
                });
            }
        };
        let transfers: Vec<Transfer<'_, V>> =
            held.transfers.iter().map(HeldTransfer::transfer).collect();
        let peer = Peer {
            engine: self.clone(),
            slot: held.slot,
        };
        match peer.submit_with_timeout(&transfers, left) {
            Ok(batch) => {
                tracing::debug!("gate opened: the batch is submitted");
                *opened = Some(batch);
                drop(opened);
                Some(link)
            }
            Err(EngineError::PeerGone(reason)) => end(TransferError::PeerGone { reason }),
            Err(e) => end(TransferError::Local {
                what: format!("refused when its gate opened: {e}"),
            }),
        }
    }

    /// Hands the opened batch's outcome (its staging copies and GPU fence
    /// applied) to the caller's batch, once it has ended; true then.
    fn hand_on(&self, link: &GateLink<V, C>) -> bool {
        let mut opened = lock(&link.opened);
        let Some(batch) = opened.as_ref() else {
            return true;
        };
        let Some(outcome) = batch.outcome() else {
            return false;
        };
        let outcome = batch.fenced(outcome).map_err(|e| match e {
            // The caller's bound, counted from the call.
            TransferError::Timeout { .. } => TransferError::Timeout {
                after: link.timeout,
            },
            e => e,
        });
        link.cell.complete(outcome);
        let batch = opened.take();
        drop(opened);
        drop(batch);
        true
    }

    /// Whether a gate waits for its stream (the own thread then paces
    /// itself as a waiter does).
    fn gates_waiting(&self) -> bool {
        !lock(&self.shared.state).gates.waiting.is_empty()
    }

    /// The own progress thread's pace: after a call that handled
    /// `handled`, while a gate waits, `idle` spins, yields or sleeps
    /// briefly and the call counts as work (the thread does not back off
    /// to its idle millisecond); otherwise `handled` as it was.
    pub(super) fn pace_gates(&self, handled: usize, idle: &mut Idle) -> usize {
        if handled > 0 || !self.gates_waiting() {
            *idle = Idle::default();
            return handled;
        }
        idle.after(0);
        1
    }
}
