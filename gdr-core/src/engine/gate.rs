//! Gated batches: a batch that starts only once a CUDA stream reaches a
//! point (the data a kernel or a copy produced), without any CPU thread
//! synchronising with the stream.
//!
//! [`super::Peer::submit_after_stream`] checks the transfers at once (local
//! bounds, the grant live on this connection, its rights and bounds, as
//! [`super::Peer::submit_with_timeout`] does), then queues on the stream a
//! write of a fresh value into a word of the engine's pinned fence page
//! (`cuStreamWriteValue32`, [`super::fence`]) and an event after it, and
//! hands the batch to `Gates::wait`, which holds it unposted. The
//! engine's progress (its own thread, so nobody has to poll) calls
//! `Gates::poll`, which sees the word reach the value; `Gates::serve`
//! then hands the opened batches out, and the engine, outside its lock,
//! submits each through the same path as
//! [`super::Peer::submit_with_timeout`] (staged transfers included) with
//! `Serve::run`. The stream's write carries the default memory barrier:
//! what the stream did before the gate is done and visible when the word
//! changes, so the batch moves the data the stream produced.
//!
//! A stream without memory operations (the driver has none:
//! `NotSupported`) gets only the event, which progress polls. On the word
//! path the event is polled too, every 64th progress call: it
//! is how a stream that failed before the gate is told
//! ([`TransferError::StreamFailed`]).
//!
//! The batch's deadline counts from the call: a gate that has not opened
//! by then ends the batch with [`TransferError::Timeout`]; a peer gone
//! meanwhile ends it with [`TransferError::PeerGone`]; [`super::Batch::cancel`]
//! before it opens ends it [`TransferError::Cancelled`] at once, and
//! nothing of it is ever posted. Dropping the batch does not cancel it (as
//! for any batch). A gate that ended before its stream wrote the word
//! keeps the word out of use until the write lands ([`super::fence`]'s
//! word book), so that late write can never touch a later gate's word.
//!
//! While a gate waits, the engine's own thread does not back off to its
//! idle millisecond: like a thread in `Batch::wait` it spins briefly, then
//! yields, then sleeps about 20 µs between looks (`Gates::waiting`).
//!
//! Gating is a wrapper over any path, not a path: `Gates` owns the held
//! batches and what it saw of their streams and decides (with
//! [`gdr_proto::gate`]); the engine records the event on the caller's
//! stream, lends the fence page (`StreamFences`) and the peers (the
//! `PathCx`'s wire) for each step, and carries out the submits. The
//! batch a gate opened into is the engine's, seen here as `Opened`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gdr_proto::gate::{GateEnd, GateWait, Seen, Signal, Step, at_open};
use hal_cuda::Event as _;

use super::completion::{CompletionCell, Outcome};
use super::events::PooledEvent;
use super::fence::StreamFences;
use super::path::PathCx;
use super::{EngineError, Op, PeerGone, Region, TimedOut, Transfer, TransferError};
use crate::descriptor::MemoryDescriptor;
use crate::sync::{Mutex, lock};

/// The batch a gate opened into (the engine's), as the gate sees it.
pub(super) trait Opened: Send {
    /// Cancels the batch.
    fn cancel(&self);

    /// The batch's outcome once it has ended, with what it applies at its
    /// end (staging copies, GPU fence) applied; `None` while it runs.
    fn ended(&self) -> Option<Outcome>;
}

/// What submitting an opened gate's batch gave: the engine's batch, or
/// why it was refused.
pub(super) type Submitted = Result<Box<dyn Opened>, EngineError>;

/// The gates of an engine, in its state.
#[derive(Default)]
pub(super) struct Gates {
    /// Not yet reached by their stream.
    waiting: Vec<Gate>,
    /// Reached, to be submitted outside the streams' lock.
    ready: Vec<Held>,
    /// Submitted: their batch's outcome is handed to the caller's batch.
    opened: Vec<Arc<GateLink>>,
    /// Polls so far: the event is looked at on some of them
    /// ([`GateWait::looks_at_event`]).
    polls: u64,
}

/// What the caller's batch and the engine share of a gated batch.
pub(super) struct GateLink {
    /// The caller's batch's outcome.
    cell: Arc<CompletionCell>,
    cancelled: AtomicBool,
    /// The batch the gate opened into, until its outcome is handed on.
    opened: Mutex<Option<Box<dyn Opened>>>,
    /// The bound the caller gave (reported by a timeout).
    timeout: Duration,
}

impl GateLink {
    /// The caller's batch's outcome.
    pub(super) fn cell(&self) -> &Arc<CompletionCell> {
        &self.cell
    }

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

    /// Hands the opened batch's outcome (its staging copies and GPU fence
    /// applied) to the caller's batch, once it has ended; true then.
    fn hand_on(&self) -> bool {
        let mut opened = lock(&self.opened);
        let Some(batch) = opened.as_ref() else {
            return true;
        };
        let Some(outcome) = batch.ended() else {
            return false;
        };
        let outcome = outcome.map_err(|e| match e {
            // The caller's bound, counted from the call.
            TransferError::Timeout(_) => TransferError::Timeout(TimedOut {
                after: self.timeout,
            }),
            e => e,
        });
        self.cell.complete(outcome);
        let batch = opened.take();
        // The batch goes after the lock: dropping it may drop the engine,
        // whose drop takes the engine's and the streams' locks.
        drop(opened);
        drop(batch);
        true
    }
}

/// One transfer of a gated batch, owned until the gate opens.
struct HeldTransfer {
    op: Op,
    local: Region,
    local_offset: u64,
    remote: MemoryDescriptor,
    remote_offset: u64,
    len: u64,
}

impl HeldTransfer {
    fn of(t: &Transfer<'_>) -> Self {
        Self {
            op: t.op,
            local: t.local.clone(),
            local_offset: t.local_offset,
            remote: t.remote.clone(),
            remote_offset: t.remote_offset,
            len: t.len,
        }
    }

    fn transfer(&self) -> Transfer<'_> {
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
struct Held {
    link: Arc<GateLink>,
    /// The peer's slot.
    slot: usize,
    transfers: Vec<HeldTransfer>,
    deadline: Instant,
    span: tracing::Span,
}

/// A gate its stream has not reached yet: what the protocol decides with
/// ([`GateWait`]), and the event recorded on the stream after the gate
/// (after the word's write, where there is one: it tells a stream that
/// failed).
struct Gate {
    held: Held,
    wait: GateWait,
    event: PooledEvent,
}

/// What the gates hand the engine to carry out outside its lock
/// ([`Gates::serve`], [`Serve::run`]).
pub(super) struct Serve {
    /// Gates their stream reached: submit their batch.
    ready: Vec<Held>,
    /// Opened batches: hand on their outcome once they end.
    opened: Vec<Arc<GateLink>>,
}

impl Gates {
    /// Holds the batch of `transfers` for the peer in `slot` until
    /// `stream`'s `signal` (queued there, then `event` recorded after it)
    /// says the stream reached the gate; `timeout` counts from `now`.
    /// Returns what the caller's batch shares with the gate.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn wait(
        &mut self,
        slot: usize,
        transfers: &[Transfer<'_>],
        timeout: Duration,
        now: Instant,
        signal: Signal,
        event: PooledEvent,
        span: &tracing::Span,
    ) -> Arc<GateLink> {
        let link = Arc::new(GateLink {
            cell: Arc::new(CompletionCell::new()),
            cancelled: AtomicBool::new(false),
            opened: Mutex::new(None),
            timeout,
        });
        let held = Held {
            link: Arc::clone(&link),
            slot,
            transfers: transfers.iter().map(HeldTransfer::of).collect(),
            // A bound past what an Instant holds never passes.
            deadline: now
                .checked_add(timeout)
                .unwrap_or(now + Duration::from_secs(1 << 32)),
            span: span.clone(),
        };
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
        self.waiting.push(Gate { held, wait, event });
        link
    }

    /// Whether a gate waits for its stream (the engine's own thread then
    /// paces itself as a waiter does).
    pub(super) fn waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Whether [`Gates::serve`] has work (outside the lock).
    pub(super) fn serve_pending(&self) -> bool {
        !self.ready.is_empty() || !self.opened.is_empty()
    }

    /// Looks at every waiting gate (under the streams' lock; the fence
    /// page `words` lent): those their stream reached move to `ready`,
    /// those that ended (cancelled, timed out, stream failed, peer gone)
    /// end their batch. Returns how many gates and late-written words it
    /// handled.
    pub(super) fn poll(&mut self, cx: &mut PathCx<'_>, words: &mut StreamFences) -> usize {
        let mut handled = words.collect_late_writes();
        self.polls += 1;
        let tick = self.polls;
        let now = cx.now;
        let mut i = 0;
        while i < self.waiting.len() {
            let gate = &self.waiting[i];
            let held = &gate.held;
            // What was seen of the stream: the word (a load) each time,
            // the event (a driver call) when the protocol says.
            let mut failure = None;
            let seen = if gate.wait.word_reached(words.gate_word(gate.wait.signal)) {
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
            let peer = cx.wire.peer(held.slot);
            let peer_gone = peer.as_ref().is_none_or(|p| p.gone.is_some());
            let cancelled = held.link.cancelled.load(Ordering::Acquire);
            let step = gate.wait.step(cancelled, seen, peer_gone, now);
            let verdict = match step {
                Step::Wait => {
                    i += 1;
                    continue;
                }
                Step::Open => Ok(()),
                Step::End(GateEnd::Cancelled) => Err(TransferError::Cancelled),
                Step::End(GateEnd::TimedOut) => Err(TransferError::Timeout(TimedOut {
                    after: held.link.timeout,
                })),
                Step::End(GateEnd::PeerGone) => Err(TransferError::PeerGone(
                    peer.and_then(|p| p.gone)
                        .unwrap_or(PeerGone::Closed),
                )),
                Step::End(GateEnd::StreamFailed) => match failure {
                    Some(source) => Err(TransferError::StreamFailed { source }),
                    None => Err(TransferError::Internal {
                        what: "the gate's stream failed",
                    }),
                },
            };
            let Gate { held, wait, .. } = self.waiting.swap_remove(i);
            handled += 1;
            let span = held.span.clone();
            let _entered = span.enter();
            // Reached through the event, the write came before it; a word
            // not showing it yet still waits for it, as does one whose gate
            // ended first.
            let word = words.gate_word(wait.signal);
            words.retire_gate(&wait, verdict.is_ok(), word);
            match verdict {
                Ok(()) => {
                    tracing::debug!("the stream reached the gate");
                    self.ready.push(held);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "the gate ended before it opened");
                    held.link.cell.complete(Err(e));
                }
            }
        }
        handled
    }

    /// Takes the work to do outside the streams' lock: the batches whose
    /// gate opened, to submit, and the opened batches, to hand on.
    pub(super) fn serve(&mut self) -> Serve {
        Serve {
            ready: std::mem::take(&mut self.ready),
            opened: std::mem::take(&mut self.opened),
        }
    }

    /// Takes back the opened batches [`Serve::run`] left running.
    pub(super) fn running(&mut self, running: Vec<Arc<GateLink>>) {
        self.opened.extend(running);
    }
}

impl Serve {
    /// Carries it out (outside the streams' lock: submitting takes a
    /// peer's, never under it):
    /// hands on the outcomes of the opened batches that ended, and submits
    /// with `submit` (the peer's slot, the transfers, the time left) the
    /// batch of each gate its stream reached, unless it was cancelled or
    /// its deadline passed at `clock`'s time, which ends it instead.
    /// Returns how many it handled and the opened batches still running
    /// (for [`Gates::running`]).
    pub(super) fn run(
        self,
        clock: impl Fn() -> Instant,
        mut submit: impl FnMut(usize, &[Transfer<'_>], Duration) -> Submitted,
    ) -> (usize, Vec<Arc<GateLink>>) {
        let mut handled = 0;
        let mut running = Vec::new();
        for link in self.opened {
            if link.hand_on() {
                handled += 1;
            } else {
                running.push(link);
            }
        }
        for held in self.ready {
            handled += 1;
            if let Some(link) = held.open(&clock, &mut submit) {
                running.push(link);
            }
        }
        (handled, running)
    }
}

impl Held {
    /// Submits the batch of a gate its stream reached, unless it was
    /// cancelled or its deadline passed; returns its link while it runs.
    fn open(
        self,
        clock: impl Fn() -> Instant,
        submit: impl FnOnce(usize, &[Transfer<'_>], Duration) -> Submitted,
    ) -> Option<Arc<GateLink>> {
        let _entered = self.span.enter();
        let link = self.link;
        let end = |e: TransferError| {
            tracing::debug!(error = %e, "the gate opened too late");
            link.cell.complete(Err(e));
            None
        };
        let mut opened = lock(&link.opened);
        let left = match at_open(
            link.cancelled.load(Ordering::SeqCst),
            clock(),
            self.deadline,
        ) {
            Ok(left) => left,
            Err(GateEnd::Cancelled) => return end(TransferError::Cancelled),
            Err(_) => {
                return end(TransferError::Timeout(TimedOut {
                    after: link.timeout,
                }));
            }
        };
        let transfers: Vec<Transfer<'_>> =
            self.transfers.iter().map(HeldTransfer::transfer).collect();
        match submit(self.slot, &transfers, left) {
            Ok(batch) => {
                tracing::debug!("gate opened: the batch is submitted");
                *opened = Some(batch);
                drop(opened);
                Some(link)
            }
            Err(e) => end(TransferError::from_engine(
                "refused when its gate opened",
                e,
            )),
        }
    }
}
