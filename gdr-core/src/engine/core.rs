//! The engine's deterministic core, in quinn-proto's shape: it owns the
//! book-keeping of every queue pair and request and does no I/O, starts no
//! thread and reads no clock. The driver ([`super::Engine`]) feeds it
//! (`submit`, `on_completion`, `fail_qp`, `handle_timeout(now)`), takes
//! work to post from it (`take_postable`), and carries out its
//! [`Action`]s. Tests drive it step by step.
//!
//! Per queue pair: a queue of work not yet posted, and the work in flight,
//! in posting order. A send queue completes in order (RC), so one signaled
//! completion retires every request posted before it: only every
//! `signal_every`-th request, and the last of each post, asks for a
//! completion (selective signalling; the last so that the tail of the
//! queue is always reported, flushes included). At most `depth` requests
//! are in flight per QP, and at most `send_limit` SENDs (the receives the
//! peer keeps posted).
//!
//! Exactly once: a batch ends when its last work request is retired
//! (succeeded, failed, or flushed) or, past its deadline, after its queue
//! pairs were stopped and flushed; the outcome goes to its
//! [`CompletionCell`] once. A batch's resources (the regions it reads and
//! writes) are held until every one of its requests is retired, even when
//! the outcome was delivered earlier by force.

use std::any::Any;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hal_verbs::{SendFlags, SendOp, SendRequest, WcStatus};

use crate::engine::completion::{CompletionCell, Outcome};
use crate::engine::error::TransferError;

/// A queue pair's index in the core.
pub(crate) type QpId = usize;
/// A batch's id in the core.
pub type BatchId = u64;

/// What a batch keeps alive until its last request is retired.
pub(crate) type Keep = Arc<dyn Any + Send + Sync>;

/// One work request waiting to be posted (its `wr_id` and signalling are
/// the core's to set).
#[derive(Debug, Clone)]
pub(crate) struct Work {
    pub batch: BatchId,
    pub request: SendRequest,
}

impl Work {
    /// One request of one SG entry (`addr`, `len`, `lkey`); its `wr_id`,
    /// batch and signalling are the core's to set.
    pub fn single(op: SendOp, addr: u64, len: u32, lkey: u32, flags: SendFlags) -> Self {
        let mut sg_list = hal_verbs::SgList::new();
        sg_list.push(hal_verbs::Sge {
            addr,
            length: len,
            lkey,
        });
        Self {
            batch: 0,
            request: SendRequest {
                wr_id: 0,
                op,
                sg_list,
                flags,
            },
        }
    }

    fn is_send(&self) -> bool {
        matches!(self.request.op, SendOp::Send | SendOp::SendWithImm { .. })
    }
}

#[derive(Debug)]
struct InFlight {
    seq: u64,
    batch: BatchId,
    send: bool,
    signaled: bool,
}

/// Whether a queue pair takes work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Health {
    /// Posting.
    Ready,
    /// In error (the NIC's, or stopped by the engine): what is in flight
    /// flushes, nothing more is posted.
    Failing(TransferError),
    /// In error and nothing left in flight.
    Drained(TransferError),
    /// Drained, and being re-established (a new connection for the same
    /// queue pair index): work may queue, nothing is posted until
    /// [`Core::revive`].
    Reconnecting(TransferError),
}

/// Counters of one queue pair.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QpCounters {
    /// Work requests posted.
    pub posted: u64,
    /// Bytes of the work requests posted.
    pub bytes: u64,
    /// Post calls (doorbells).
    pub doorbells: u64,
    /// Work requests that asked for a completion.
    pub signaled: u64,
}

#[derive(Debug)]
struct QpRecord {
    index: u16,
    depth: u32,
    send_limit: u32,
    signal_every: u32,
    queue: VecDeque<Work>,
    in_flight: VecDeque<InFlight>,
    sends_in_flight: u32,
    next_seq: u64,
    since_signal: u32,
    health: Health,
    reset_requested: bool,
    counters: QpCounters,
}

#[derive(Debug)]
struct BatchRecord {
    cell: Arc<CompletionCell>,
    unfinished: usize,
    error: Option<TransferError>,
    deadline: Option<(Instant, Duration)>,
    ended: bool,
}

/// One slot of the batch table: the batch it holds (if any), what that
/// batch keeps alive, and a generation that makes the ids of the slot's
/// earlier batches stale.
#[derive(Debug, Default)]
struct Slot {
    generation: u32,
    record: Option<BatchRecord>,
    /// Emptied (not freed) when the batch goes: the next batch of the
    /// slot reuses the allocation.
    keep: Vec<Keep>,
}

/// The live batches, indexed by id: a batch's id is its slot's index
/// (low 32 bits) and the slot's generation when it was taken (high 32
/// bits, from 1: id 0 is never live). A slot whose generation is spent is
/// never reused, so an id is never given twice: a stale id (a batch that
/// ended) finds nothing.
#[derive(Debug, Default)]
struct Batches {
    slots: Vec<Slot>,
    free: Vec<u32>,
    live: usize,
}

impl Batches {
    fn insert(&mut self, record: BatchRecord, keep: impl IntoIterator<Item = Keep>) -> BatchId {
        let index = self.free.pop().unwrap_or_else(|| {
            self.slots.push(Slot::default());
            u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 batches live")
        });
        let slot = &mut self.slots[index as usize];
        slot.generation += 1;
        slot.record = Some(record);
        slot.keep.extend(keep);
        self.live += 1;
        (u64::from(slot.generation) << 32) | u64::from(index)
    }

    fn slot(&self, id: BatchId) -> Option<&Slot> {
        self.slots
            .get(id as u32 as usize)
            .filter(|s| s.generation == (id >> 32) as u32)
    }

    fn get(&self, id: BatchId) -> Option<&BatchRecord> {
        self.slot(id)?.record.as_ref()
    }

    fn get_mut(&mut self, id: BatchId) -> Option<&mut BatchRecord> {
        let slot = self.slots.get_mut(id as u32 as usize)?;
        if slot.generation != (id >> 32) as u32 {
            return None;
        }
        slot.record.as_mut()
    }

    /// Takes the batch out, releasing what it kept alive.
    fn remove(&mut self, id: BatchId) -> Option<BatchRecord> {
        let index = id as u32;
        let slot = self.slots.get_mut(index as usize)?;
        if slot.generation != (id >> 32) as u32 {
            return None;
        }
        let record = slot.record.take()?;
        slot.keep.clear();
        self.live -= 1;
        if slot.generation != u32::MAX {
            self.free.push(index);
        }
        Some(record)
    }

    /// Whether `(at, id)` is the live deadline of a batch (the deadline
    /// heap keeps the entries of batches that ended until they surface).
    fn is_deadline(&self, at: Instant, id: BatchId) -> bool {
        self.get(id)
            .is_some_and(|r| r.deadline.is_some_and(|(d, _)| d == at))
    }
}

/// Something the driver must do for the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// Move this queue pair to ERROR so what it holds flushes (a request
    /// on it passed its deadline).
    StopQp(QpId),
    /// The queue pair failed and nothing of it is in flight any more.
    QpDrained(QpId),
}

/// The configuration of one queue pair in the core.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QpLimits {
    /// Work requests in flight at most.
    pub depth: u32,
    /// SENDs in flight at most (the peer's posted receives).
    pub send_limit: u32,
    /// Ask for a completion every this many requests (and at the end of
    /// each post).
    pub signal_every: u32,
}

/// How long a batch stopped at its deadline may wait for its flushes
/// before its outcome is delivered anyway.
const FLUSH_GRACE: Duration = Duration::from_secs(1);

/// The deterministic core.
#[derive(Debug, Default)]
pub(crate) struct Core {
    qps: Vec<QpRecord>,
    batches: Batches,
    /// Earliest first; an entry whose batch ended (or moved its deadline)
    /// stays until it surfaces or the heap is compacted
    /// ([`Core::submit`]): ending a batch costs no search.
    deadlines: BinaryHeap<Reverse<(Instant, BatchId)>>,
    actions: VecDeque<Action>,
    /// The last submitted batch's work list, emptied: the next submit
    /// fills it again ([`Core::work_buffer`]).
    spare_work: Vec<(QpId, Work)>,
}

impl Core {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a queue pair (index `index` within its peer).
    pub fn add_qp(&mut self, index: u16, limits: QpLimits) -> QpId {
        self.qps.push(QpRecord {
            index,
            depth: limits.depth.max(1),
            send_limit: limits.send_limit.max(1),
            signal_every: limits.signal_every.max(1),
            queue: VecDeque::new(),
            in_flight: VecDeque::new(),
            sends_in_flight: 0,
            next_seq: 1,
            since_signal: 0,
            health: Health::Ready,
            reset_requested: false,
            counters: QpCounters::default(),
        });
        self.qps.len() - 1
    }

    #[inline]
    pub fn is_ready(&self, qp: QpId) -> bool {
        self.qps[qp].health == Health::Ready
    }

    /// Whether work submitted for `qp` is kept: it is up, or being
    /// re-established (the work waits for it).
    pub fn accepts_work(&self, qp: QpId) -> bool {
        matches!(self.qps[qp].health, Health::Ready | Health::Reconnecting(_))
    }

    /// Whether `qp` failed for good (drained, and not being re-established).
    pub fn is_down(&self, qp: QpId) -> bool {
        matches!(self.qps[qp].health, Health::Drained(_))
    }

    /// A drained queue pair is being re-established: work queues for it
    /// until [`Core::revive`] or [`Core::give_up`]. Returns whether it was
    /// drained (anything else is left as it is).
    pub fn begin_reconnect(&mut self, qp: QpId) -> bool {
        let r = &mut self.qps[qp];
        match &r.health {
            Health::Drained(cause) => {
                r.health = Health::Reconnecting(cause.clone());
                true
            }
            _ => false,
        }
    }

    /// The queue pair was re-established (a new connection, nothing in
    /// flight): it posts again, its queued work first, within `limits`.
    pub fn revive(&mut self, qp: QpId, limits: QpLimits) {
        let r = &mut self.qps[qp];
        debug_assert!(r.in_flight.is_empty(), "revived with work in flight");
        if !matches!(r.health, Health::Reconnecting(_) | Health::Drained(_)) {
            return;
        }
        r.health = Health::Ready;
        r.depth = limits.depth.max(1);
        r.send_limit = limits.send_limit.max(1);
        r.signal_every = limits.signal_every.max(1);
        r.since_signal = 0;
        r.sends_in_flight = 0;
        r.reset_requested = false;
    }

    /// Re-establishing the queue pair failed: what waited for it fails
    /// with `cause`, and it stays down.
    pub fn give_up(&mut self, qp: QpId, cause: TransferError) {
        let r = &mut self.qps[qp];
        if !matches!(r.health, Health::Reconnecting(_)) {
            return;
        }
        r.health = Health::Drained(cause.clone());
        let queued: Vec<Work> = r.queue.drain(..).collect();
        for work in queued {
            self.retire(work.batch, 1, Err(cause.clone()));
        }
    }

    pub fn counters(&self, qp: QpId) -> QpCounters {
        self.qps[qp].counters
    }

    /// Requests queued or in flight on `qp`.
    #[cfg(test)]
    pub fn load(&self, qp: QpId) -> usize {
        let record = &self.qps[qp];
        record.queue.len() + record.in_flight.len()
    }

    /// SENDs in flight on `qp` (each holds one of the peer's receives).
    #[cfg(test)]
    pub fn sends_in_flight(&self, qp: QpId) -> u32 {
        self.qps[qp].sends_in_flight
    }

    /// Batches not yet retired.
    #[cfg(test)]
    pub fn batches_live(&self) -> usize {
        self.batches.live
    }

    /// Entries in the deadline heap, live or not.
    #[cfg(test)]
    fn deadline_entries(&self) -> usize {
        self.deadlines.len()
    }

    /// An empty work list to fill for [`Core::submit`] (the last one's
    /// allocation, reused).
    pub fn work_buffer(&mut self) -> Vec<(QpId, Work)> {
        std::mem::take(&mut self.spare_work)
    }

    /// Queues a batch of work (each item on its queue pair), to end by
    /// `deadline` (`now + timeout`), keeping `keep` alive until its last
    /// request is retired. An empty batch succeeds at once. Work for a
    /// queue pair that is not ready fails the batch. A batch that ended
    /// at once gets id 0, which names no batch.
    pub fn submit(
        &mut self,
        mut work: Vec<(QpId, Work)>,
        cell: Arc<CompletionCell>,
        deadline: Option<(Instant, Duration)>,
        keep: impl IntoIterator<Item = Keep>,
    ) -> BatchId {
        if work.is_empty() {
            cell.complete(Ok(()));
            return 0;
        }
        if let Some(failing) = work.iter().find_map(|(qp, _)| match &self.qps[*qp].health {
            Health::Ready | Health::Reconnecting(_) => None,
            Health::Failing(e) | Health::Drained(e) => Some(e.clone()),
        }) {
            cell.complete(Err(failing));
            return 0;
        }
        let record = BatchRecord {
            cell,
            unfinished: work.len(),
            error: None,
            deadline,
            ended: false,
        };
        let id = self.batches.insert(record, keep);
        for (qp, mut item) in work.drain(..) {
            item.batch = id;
            self.qps[qp].queue.push_back(item);
        }
        if work.capacity() > self.spare_work.capacity() {
            self.spare_work = work;
        }
        if let Some((at, _)) = deadline {
            self.deadlines.push(Reverse((at, id)));
            // Entries of ended batches wait for their time to surface; past
            // twice the live ones, they go (amortised: the heap has grown
            // by as many since the last time).
            if self.deadlines.len() > 2 * self.batches.live + 64 {
                let batches = &self.batches;
                self.deadlines
                    .retain(|&Reverse((at, id))| batches.is_deadline(at, id));
            }
        }
        id
    }

    /// Whether `qp` has work it could post now.
    pub fn has_postable(&self, qp: QpId) -> bool {
        let r = &self.qps[qp];
        r.health == Health::Ready
            && (r.in_flight.len() as u32) < r.depth
            && r.queue
                .front()
                .is_some_and(|w| !w.is_send() || r.sends_in_flight < r.send_limit)
    }

    /// Takes the work `qp` can post now, in order, with `wr_id`s and
    /// signalling set, into `out` (cleared first); the caller posts it
    /// with one doorbell and reports a refusal with [`Core::post_failed`].
    pub fn take_postable(&mut self, qp: QpId, out: &mut Vec<SendRequest>) {
        out.clear();
        let r = &mut self.qps[qp];
        if r.health != Health::Ready {
            return;
        }
        // How many of the queue's front go: as many as there is room for,
        // up to a SEND the peer has no receive left for.
        let room = (r.depth as usize).saturating_sub(r.in_flight.len());
        let mut sends = r.sends_in_flight;
        let mut n = 0;
        for work in r.queue.iter().take(room) {
            if work.is_send() {
                #[cfg(loom)]
                let limited = !crate::cache::mutant::active("send-limit-ignored");
                #[cfg(not(loom))]
                let limited = true;
                if limited && sends >= r.send_limit {
                    break;
                }
                sends += 1;
            }
            n += 1;
        }
        if n == 0 {
            return;
        }
        r.sends_in_flight = sends;
        let (mut bytes, mut signaled) = (0, 0);
        for _ in 0..n {
            let mut work = r.queue.pop_front().expect("counted");
            let seq = r.next_seq;
            r.next_seq += 1;
            r.since_signal += 1;
            let signal = r.since_signal >= r.signal_every;
            if signal {
                r.since_signal = 0;
                signaled += 1;
            }
            work.request.wr_id = seq;
            work.request.flags.set(SendFlags::SIGNALED, signal);
            bytes += work
                .request
                .sg_list
                .iter()
                .map(|s| u64::from(s.length))
                .sum::<u64>();
            r.in_flight.push_back(InFlight {
                seq,
                batch: work.batch,
                send: work.is_send(),
                signaled: signal,
            });
            out.push(work.request);
        }
        // The last of a post always asks for a completion, so that the
        // queue's tail is reported.
        if let Some(last) = out.last_mut()
            && !last.flags.contains(SendFlags::SIGNALED)
        {
            last.flags |= SendFlags::SIGNALED;
            r.since_signal = 0;
            signaled += 1;
            if let Some(tail) = r.in_flight.back_mut() {
                tail.signaled = true;
            }
        }
        r.counters.posted += n as u64;
        r.counters.bytes += bytes;
        r.counters.doorbells += 1;
        r.counters.signaled += signaled;
    }

    /// The provider refused part of the last post of `qp`: the first
    /// `accepted` of the `taken` requests were posted. With `accepted`
    /// known, the rest fail with `error` and the queue pair goes on; with
    /// it unknown (`None`), the queue pair is stopped: what it holds
    /// flushes.
    pub fn post_failed(
        &mut self,
        qp: QpId,
        taken: usize,
        accepted: Option<usize>,
        error: TransferError,
    ) {
        let Some(accepted) = accepted else {
            // Which were posted is unknown: stop the queue pair; what it
            // flushes is retired, the rest is delivered by the deadline's
            // grace (and stays held: the NIC may have it).
            self.stop(qp, error);
            self.actions.push_back(Action::StopQp(qp));
            return;
        };
        // The refused requests never reached the NIC: they fail now.
        let r = &mut self.qps[qp];
        let refused = taken.saturating_sub(accepted).min(r.in_flight.len());
        let start = r.in_flight.len() - refused;
        let gone: Vec<InFlight> = r.in_flight.drain(start..).collect();
        for item in &gone {
            if item.send {
                r.sends_in_flight -= 1;
            }
        }
        if let Some(first) = gone.first() {
            r.next_seq = first.seq;
        }
        let tail_reported = r.in_flight.back().is_none_or(|last| last.signaled);
        for item in gone {
            self.retire(item.batch, 1, Err(error.clone()));
        }
        if !tail_reported {
            // What was posted ends in an unsignaled request that nothing
            // would ever report: stop the queue pair, so it flushes.
            self.stop(qp, error);
            self.actions.push_back(Action::StopQp(qp));
        }
    }

    /// A send-queue completion of `qp`: retires every request up to
    /// `wr_id` (a signaled completion stands for the unsignaled ones
    /// before it).
    pub fn on_completion(&mut self, qp: QpId, wr_id: u64, status: WcStatus, vendor_err: u32) {
        let r = &self.qps[qp];
        let in_flight = match (r.in_flight.front(), r.in_flight.back()) {
            (Some(first), Some(last)) => first.seq <= wr_id && wr_id <= last.seq,
            _ => false,
        };
        if !in_flight {
            tracing::debug!(qp = r.index, wr_id, %status, "completion of no request in flight");
            return;
        }
        let index = r.index;
        let first_error = !status.is_success() && r.health == Health::Ready;
        // What every request retired here ends with, but the failed one.
        let common: Outcome = match &r.health {
            Health::Failing(cause) | Health::Drained(cause) | Health::Reconnecting(cause) => {
                Err(TransferError::Flushed {
                    qp: index,
                    cause: cause.to_string(),
                })
            }
            Health::Ready => Ok(()),
        };
        // Consecutive requests of one batch are retired together.
        let mut run: Option<(BatchId, usize)> = None;
        loop {
            let r = &mut self.qps[qp];
            let Some(item) = r.in_flight.front() else {
                break;
            };
            if item.seq > wr_id {
                break;
            }
            let item = r.in_flight.pop_front().expect("front exists");
            #[cfg(loom)]
            let returned = !crate::cache::mutant::active("send-credit-leak");
            #[cfg(not(loom))]
            let returned = true;
            if item.send && returned {
                r.sends_in_flight -= 1;
            }
            if item.seq == wr_id && first_error {
                if let Some((batch, n)) = run.take() {
                    self.retire(batch, n, common.clone());
                }
                self.retire(
                    item.batch,
                    1,
                    Err(TransferError::from_status(status, vendor_err)),
                );
                continue;
            }
            match &mut run {
                Some((batch, n)) if *batch == item.batch => *n += 1,
                _ => {
                    if let Some((batch, n)) = run.replace((item.batch, 1)) {
                        self.retire(batch, n, common.clone());
                    }
                }
            }
        }
        if let Some((batch, n)) = run {
            self.retire(batch, n, common);
        }
        if first_error {
            tracing::debug!(qp = index, %status, "queue pair failed");
            self.stop(qp, TransferError::from_status(status, vendor_err));
        }
        self.check_drained(qp);
    }

    /// The queue pair is in error (the peer disconnected, the engine
    /// stopped it): its queued work fails now, what is in flight when its
    /// flushes arrive.
    pub fn fail_qp(&mut self, qp: QpId, cause: TransferError) {
        if self.qps[qp].health == Health::Ready {
            self.stop(qp, cause);
        }
        self.check_drained(qp);
    }

    /// The queue pair is gone without flushing (device failure, or a QP
    /// destroyed): everything it holds fails now.
    pub fn abandon_qp(&mut self, qp: QpId, cause: TransferError) {
        self.fail_qp(qp, cause.clone());
        let r = &mut self.qps[qp];
        let gone: Vec<InFlight> = r.in_flight.drain(..).collect();
        r.sends_in_flight = 0;
        for item in gone {
            self.retire(item.batch, 1, Err(cause.clone()));
        }
        self.check_drained(qp);
    }

    fn stop(&mut self, qp: QpId, cause: TransferError) {
        let r = &mut self.qps[qp];
        if r.health != Health::Ready {
            return;
        }
        r.health = Health::Failing(cause.clone());
        let flushed = TransferError::Flushed {
            qp: r.index,
            cause: cause.to_string(),
        };
        let queued: Vec<Work> = r.queue.drain(..).collect();
        for work in queued {
            self.retire(work.batch, 1, Err(flushed.clone()));
        }
    }

    fn check_drained(&mut self, qp: QpId) {
        let r = &mut self.qps[qp];
        if let Health::Failing(cause) = &r.health
            && r.in_flight.is_empty()
        {
            r.health = Health::Drained(cause.clone());
            self.actions.push_back(Action::QpDrained(qp));
        }
    }

    /// `n` requests of `batch` are done with `result`.
    fn retire(&mut self, batch: BatchId, n: usize, result: Outcome) {
        let Some(record) = self.batches.get_mut(batch) else {
            return;
        };
        record.unfinished -= n;
        if let Err(e) = result
            && record.error.is_none()
        {
            record.error = Some(e);
            // Fail fast: the batch's work not yet posted is dropped.
            self.drop_queued(batch);
            self.finish_if_done(batch);
        } else if record.unfinished == 0 {
            self.finish(batch);
        }
    }

    /// Delivers `batch`'s outcome once none of its requests is left.
    fn finish_if_done(&mut self, batch: BatchId) {
        if self.batches.get(batch).is_some_and(|r| r.unfinished == 0) {
            self.finish(batch);
        }
    }

    /// Delivers `batch`'s outcome (none of its requests is left); its
    /// deadline's entry stays in the heap, stale.
    fn finish(&mut self, batch: BatchId) {
        let Some(record) = self.batches.remove(batch) else {
            return;
        };
        let outcome = record.error.map_or(Ok(()), Err);
        record.cell.complete(outcome);
    }

    /// Retires `batch`'s work not yet posted (its outcome is decided).
    fn drop_queued(&mut self, batch: BatchId) {
        let mut dropped = 0;
        for r in &mut self.qps {
            let before = r.queue.len();
            r.queue.retain(|w| w.batch != batch);
            dropped += before - r.queue.len();
        }
        if let Some(record) = self.batches.get_mut(batch) {
            record.unfinished -= dropped;
        }
    }

    /// Cancels a batch: what is not posted is dropped; it ends
    /// [`TransferError::Cancelled`] once nothing of it is in flight.
    pub fn cancel(&mut self, batch: BatchId) {
        let Some(record) = self.batches.get_mut(batch) else {
            return;
        };
        if record.error.is_none() {
            record.error = Some(TransferError::Cancelled);
        }
        self.drop_queued(batch);
        self.finish_if_done(batch);
    }

    /// The earliest deadline the driver must call [`Core::handle_timeout`]
    /// at.
    pub fn next_deadline(&mut self) -> Option<Instant> {
        while let Some(&Reverse((at, batch))) = self.deadlines.peek() {
            if self.batches.is_deadline(at, batch) {
                return Some(at);
            }
            self.deadlines.pop();
        }
        None
    }

    /// Handles every deadline up to `now`: a batch past its deadline
    /// drops what it has not posted and stops the queue pairs holding
    /// the rest (their other requests flush); if the flushes do not come
    /// within a grace period, its outcome is delivered anyway.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(&Reverse((at, batch))) = self.deadlines.peek() {
            if at > now {
                break;
            }
            self.deadlines.pop();
            if !self.batches.is_deadline(at, batch) {
                // The batch ended (or this deadline was moved).
                continue;
            }
            let Some(record) = self.batches.get_mut(batch) else {
                continue;
            };
            let after = record.deadline.map_or(Duration::ZERO, |(_, t)| t);
            if record.ended {
                // The grace period passed: deliver now, keep the record
                // (and what it keeps alive) until its requests retire.
                record.cell.complete(Err(record
                    .error
                    .clone()
                    .unwrap_or(TransferError::Timeout { after })));
                continue;
            }
            record.ended = true;
            #[cfg(loom)]
            if crate::cache::mutant::active("timeout-delivers-in-flight") {
                record.cell.complete(Err(TransferError::Timeout { after }));
            }
            if record.error.is_none() {
                record.error = Some(TransferError::Timeout { after });
            }
            let cause = record.error.clone().expect("just set");
            let grace = at + FLUSH_GRACE;
            record.deadline = Some((grace, after));
            self.deadlines.push(Reverse((grace, batch)));
            self.drop_queued(batch);
            let holders: Vec<QpId> = (0..self.qps.len())
                .filter(|&qp| self.qps[qp].in_flight.iter().any(|f| f.batch == batch))
                .collect();
            for qp in holders {
                let r = &mut self.qps[qp];
                if !r.reset_requested {
                    r.reset_requested = true;
                    self.actions.push_back(Action::StopQp(qp));
                }
                self.stop(qp, cause.clone());
            }
            self.finish_if_done(batch);
        }
    }

    /// The next thing the driver must do.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }
}

/// A SEND of `len` bytes for the core's tests and loom models.
#[cfg(test)]
pub(crate) fn test_send(len: u32) -> Work {
    let mut work = test_write(len);
    work.request.op = SendOp::Send;
    work
}

/// A WRITE of `len` bytes for the core's tests and loom models.
#[cfg(test)]
pub(crate) fn test_write(len: u32) -> Work {
    let op = SendOp::Write {
        remote_addr: 0x2000,
        rkey: 2,
    };
    Work::single(op, 0x1000, len, 1, SendFlags::empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(len: u32) -> Work {
        test_write(len)
    }

    fn send() -> Work {
        test_send(8)
    }

    fn limits(depth: u32, signal_every: u32) -> QpLimits {
        QpLimits {
            depth,
            send_limit: 2,
            signal_every,
        }
    }

    fn cell() -> Arc<CompletionCell> {
        Arc::new(CompletionCell::new())
    }

    #[test]
    fn selective_signalling_and_depth() {
        let mut core = Core::new();
        let qp = core.add_qp(0, limits(6, 4));
        let c = cell();
        core.submit(vec![(qp, write(10)); 8], c.clone(), None, vec![]);
        let mut out = Vec::new();
        core.take_postable(qp, &mut out);
        assert_eq!(out.len(), 6, "depth bounds the post");
        let signaled: Vec<bool> = out
            .iter()
            .map(|w| w.flags.contains(SendFlags::SIGNALED))
            .collect();
        assert_eq!(signaled, [false, false, false, true, false, true]);
        assert!(!core.has_postable(qp));
        // The 4th request's completion retires the first four.
        core.on_completion(qp, out[3].wr_id, WcStatus::SUCCESS, 0);
        assert_eq!(core.load(qp), 4);
        core.take_postable(qp, &mut out);
        assert_eq!(out.len(), 2);
        assert!(out[1].flags.contains(SendFlags::SIGNALED), "tail signaled");
        core.on_completion(qp, 6, WcStatus::SUCCESS, 0);
        assert!(!c.is_done());
        core.on_completion(qp, out[1].wr_id, WcStatus::SUCCESS, 0);
        assert_eq!(c.outcome(), Some(Ok(())));
        assert_eq!(core.batches_live(), 0);
        assert_eq!(core.counters(qp).doorbells, 2);
    }

    #[test]
    fn an_error_fails_its_request_and_flushes_the_rest_of_its_qp_only() {
        let mut core = Core::new();
        let (a, b) = (core.add_qp(0, limits(8, 8)), core.add_qp(1, limits(8, 8)));
        let (first, second, other) = (cell(), cell(), cell());
        core.submit(
            vec![(a, write(1)), (a, write(1))],
            first.clone(),
            None,
            vec![],
        );
        core.submit(vec![(a, write(1))], second.clone(), None, vec![]);
        core.submit(vec![(b, write(1))], other.clone(), None, vec![]);
        let mut out = Vec::new();
        core.take_postable(a, &mut out);
        assert_eq!(out.len(), 3);
        // The second request fails remotely: the first succeeded before it.
        core.on_completion(a, 2, WcStatus::REM_ACCESS_ERR, 7);
        assert!(matches!(
            first.outcome(),
            Some(Err(TransferError::RemoteAccess { vendor_err: 7, .. }))
        ));
        assert!(!second.is_done(), "in flight: ends with its flush");
        core.on_completion(a, 3, WcStatus::WR_FLUSH_ERR, 0);
        assert!(matches!(
            second.outcome(),
            Some(Err(TransferError::Flushed { qp: 0, .. }))
        ));
        assert_eq!(core.poll_action(), Some(Action::QpDrained(a)));
        // The other queue pair is untouched.
        core.take_postable(b, &mut out);
        core.on_completion(b, out[0].wr_id, WcStatus::SUCCESS, 0);
        assert_eq!(other.outcome(), Some(Ok(())));
        // New work for the failed queue pair is refused at once.
        let late = cell();
        core.submit(vec![(a, write(1))], late.clone(), None, vec![]);
        assert!(matches!(
            late.outcome(),
            Some(Err(TransferError::RemoteAccess { .. }))
        ));
    }

    #[test]
    fn a_deadline_stops_the_qp_and_ends_after_the_flush() {
        let t0 = Instant::now();
        let mut core = Core::new();
        let qp = core.add_qp(0, limits(1, 1));
        let (slow, queued_behind) = (cell(), cell());
        let keep: Keep = Arc::new(5u8);
        core.submit(
            vec![(qp, write(1))],
            slow.clone(),
            Some((t0 + Duration::from_millis(10), Duration::from_millis(10))),
            vec![Arc::clone(&keep)],
        );
        core.submit(vec![(qp, write(1))], queued_behind.clone(), None, vec![]);
        let mut out = Vec::new();
        core.take_postable(qp, &mut out);
        assert_eq!(core.next_deadline(), Some(t0 + Duration::from_millis(10)));
        core.handle_timeout(t0 + Duration::from_millis(9));
        assert_eq!(core.poll_action(), None);
        core.handle_timeout(t0 + Duration::from_millis(10));
        assert_eq!(core.poll_action(), Some(Action::StopQp(qp)));
        assert!(
            matches!(
                queued_behind.outcome(),
                Some(Err(TransferError::Flushed { .. }))
            ),
            "work queued behind it on the stopped QP fails"
        );
        assert!(!slow.is_done(), "not before the NIC gave the request back");
        assert_eq!(Arc::strong_count(&keep), 2);
        core.on_completion(qp, out[0].wr_id, WcStatus::WR_FLUSH_ERR, 0);
        assert!(matches!(
            slow.outcome(),
            Some(Err(TransferError::Timeout { .. }))
        ));
        assert_eq!(Arc::strong_count(&keep), 1, "released once retired");
    }

    #[test]
    fn a_deadline_whose_flush_never_comes_is_delivered_after_the_grace() {
        let t0 = Instant::now();
        let mut core = Core::new();
        let qp = core.add_qp(0, limits(4, 1));
        let c = cell();
        let keep: Keep = Arc::new(5u8);
        let t = Duration::from_millis(10);
        core.submit(
            vec![(qp, write(1))],
            c.clone(),
            Some((t0 + t, t)),
            vec![keep.clone()],
        );
        let mut out = Vec::new();
        core.take_postable(qp, &mut out);
        core.handle_timeout(t0 + t);
        assert!(!c.is_done());
        core.handle_timeout(t0 + t + FLUSH_GRACE);
        assert!(matches!(
            c.outcome(),
            Some(Err(TransferError::Timeout { .. }))
        ));
        assert_eq!(Arc::strong_count(&keep), 2, "still held: the NIC has it");
        core.on_completion(qp, out[0].wr_id, WcStatus::WR_FLUSH_ERR, 0);
        assert_eq!(Arc::strong_count(&keep), 1);
        assert!(matches!(
            c.outcome(),
            Some(Err(TransferError::Timeout { .. }))
        ));
    }

    #[test]
    fn sends_wait_for_the_peers_receives_in_order() {
        let mut core = Core::new();
        let qp = core.add_qp(0, limits(8, 8));
        let c = cell();
        core.submit(
            vec![(qp, send()), (qp, send()), (qp, send()), (qp, write(1))],
            c.clone(),
            None,
            vec![],
        );
        let mut out = Vec::new();
        core.take_postable(qp, &mut out);
        assert_eq!(out.len(), 2, "two receives posted at the peer");
        assert_eq!(core.sends_in_flight(qp), 2);
        core.on_completion(qp, out[0].wr_id, WcStatus::SUCCESS, 0);
        core.take_postable(qp, &mut out);
        assert_eq!(out.len(), 2, "the third send, then the write behind it");
        core.on_completion(qp, out[1].wr_id, WcStatus::SUCCESS, 0);
        assert_eq!(c.outcome(), Some(Ok(())));
        assert_eq!(core.sends_in_flight(qp), 0, "every credit came back");
    }

    #[test]
    fn a_refused_post_fails_what_was_refused() {
        let mut core = Core::new();
        let qp = core.add_qp(0, limits(8, 1));
        let (a, b) = (cell(), cell());
        core.submit(vec![(qp, write(1))], a.clone(), None, vec![]);
        core.submit(vec![(qp, write(1))], b.clone(), None, vec![]);
        let mut out = Vec::new();
        core.take_postable(qp, &mut out);
        core.post_failed(
            qp,
            2,
            Some(1),
            TransferError::Local {
                what: "refused".into(),
            },
        );
        assert!(matches!(
            b.outcome(),
            Some(Err(TransferError::Local { .. }))
        ));
        assert!(!a.is_done());
        core.on_completion(qp, out[0].wr_id, WcStatus::SUCCESS, 0);
        assert_eq!(a.outcome(), Some(Ok(())));
        assert_eq!(core.load(qp), 0);
        assert_eq!(core.poll_action(), None);
    }

    #[test]
    fn a_refused_post_leaving_an_unsignaled_tail_stops_the_qp() {
        let mut core = Core::new();
        let qp = core.add_qp(0, limits(8, 8));
        let (a, b) = (cell(), cell());
        core.submit(vec![(qp, write(1))], a.clone(), None, vec![]);
        core.submit(vec![(qp, write(1))], b.clone(), None, vec![]);
        let mut out = Vec::new();
        core.take_postable(qp, &mut out);
        let refused = TransferError::Local {
            what: "refused".into(),
        };
        core.post_failed(qp, 2, Some(1), refused);
        assert!(matches!(
            b.outcome(),
            Some(Err(TransferError::Local { .. }))
        ));
        assert_eq!(core.poll_action(), Some(Action::StopQp(qp)));
        assert!(!a.is_done(), "ends with its flush");
        core.on_completion(qp, out[0].wr_id, WcStatus::WR_FLUSH_ERR, 0);
        assert!(matches!(
            a.outcome(),
            Some(Err(TransferError::Flushed { .. }))
        ));
        assert_eq!(core.poll_action(), Some(Action::QpDrained(qp)));
    }

    #[test]
    fn one_completion_retires_the_runs_of_several_batches() {
        let mut core = Core::new();
        let qp = core.add_qp(0, limits(16, 16));
        let (a, b, c) = (cell(), cell(), cell());
        core.submit(vec![(qp, write(1)); 3], a.clone(), None, vec![]);
        core.submit(vec![(qp, write(1)); 1], b.clone(), None, vec![]);
        core.submit(vec![(qp, write(1)); 2], c.clone(), None, vec![]);
        let mut out = Vec::new();
        core.take_postable(qp, &mut out);
        assert_eq!(out.len(), 6);
        // The 5th (c's first) retires a and b whole, and half of c.
        core.on_completion(qp, out[4].wr_id, WcStatus::SUCCESS, 0);
        assert_eq!((a.outcome(), b.outcome()), (Some(Ok(())), Some(Ok(()))));
        assert!(!c.is_done(), "one of c's requests is still in flight");
        assert_eq!(core.batches_live(), 1);
        core.on_completion(qp, out[5].wr_id, WcStatus::SUCCESS, 0);
        assert_eq!(c.outcome(), Some(Ok(())));
        assert_eq!(core.batches_live(), 0);
    }

    #[test]
    fn an_error_in_a_run_fails_its_batch_only_and_flushes_the_runs_behind() {
        let mut core = Core::new();
        let qp = core.add_qp(0, limits(16, 16));
        let (a, b, c) = (cell(), cell(), cell());
        core.submit(vec![(qp, write(1)); 2], a.clone(), None, vec![]);
        core.submit(vec![(qp, write(1)); 2], b.clone(), None, vec![]);
        core.submit(vec![(qp, write(1)); 2], c.clone(), None, vec![]);
        let mut out = Vec::new();
        core.take_postable(qp, &mut out);
        // b's second request fails: a and b's first succeeded before it.
        core.on_completion(qp, out[3].wr_id, WcStatus::REM_ACCESS_ERR, 3);
        assert_eq!(a.outcome(), Some(Ok(())));
        assert!(matches!(
            b.outcome(),
            Some(Err(TransferError::RemoteAccess { vendor_err: 3, .. }))
        ));
        assert!(!c.is_done());
        core.on_completion(qp, out[5].wr_id, WcStatus::WR_FLUSH_ERR, 0);
        assert!(matches!(
            c.outcome(),
            Some(Err(TransferError::Flushed { .. }))
        ));
        assert_eq!(core.batches_live(), 0);
        assert_eq!(core.load(qp), 0);
    }

    #[test]
    fn a_stale_batch_id_names_no_batch() {
        let mut core = Core::new();
        let qp = core.add_qp(0, limits(4, 1));
        let (old, new) = (cell(), cell());
        let old_id = core.submit(vec![(qp, write(1))], old.clone(), None, vec![]);
        let mut out = Vec::new();
        core.take_postable(qp, &mut out);
        core.on_completion(qp, out[0].wr_id, WcStatus::SUCCESS, 0);
        assert_eq!(old.outcome(), Some(Ok(())));
        // The next batch takes the ended one's slot, under a new id.
        let new_id = core.submit(vec![(qp, write(1))], new.clone(), None, vec![]);
        assert_ne!(old_id, new_id);
        assert_eq!(old_id as u32, new_id as u32, "the slot is reused");
        core.cancel(old_id);
        let empty = core.submit(vec![], cell(), None, vec![]);
        core.cancel(empty);
        core.take_postable(qp, &mut out);
        core.on_completion(qp, out[0].wr_id, WcStatus::SUCCESS, 0);
        assert_eq!(new.outcome(), Some(Ok(())), "not cancelled by a stale id");
    }

    #[test]
    fn deadlines_of_mixed_timeouts_fire_in_time_order() {
        let t0 = Instant::now();
        let mut core = Core::new();
        let (a, b) = (core.add_qp(0, limits(4, 1)), core.add_qp(1, limits(4, 1)));
        let (long, short) = (cell(), cell());
        let (tl, ts) = (Duration::from_millis(50), Duration::from_millis(10));
        core.submit(
            vec![(a, write(1))],
            long.clone(),
            Some((t0 + tl, tl)),
            vec![],
        );
        core.submit(
            vec![(b, write(1))],
            short.clone(),
            Some((t0 + ts, ts)),
            vec![],
        );
        let mut out = Vec::new();
        core.take_postable(a, &mut out);
        core.take_postable(b, &mut out);
        assert_eq!(core.next_deadline(), Some(t0 + ts));
        core.handle_timeout(t0 + ts);
        assert_eq!(core.poll_action(), Some(Action::StopQp(b)));
        assert_eq!(core.poll_action(), None, "the long batch runs on");
        core.on_completion(b, out[0].wr_id, WcStatus::WR_FLUSH_ERR, 0);
        assert!(matches!(
            short.outcome(),
            Some(Err(TransferError::Timeout { after })) if after == ts
        ));
        assert_eq!(core.poll_action(), Some(Action::QpDrained(b)));
        assert!(core.is_ready(a));
        assert_eq!(core.next_deadline(), Some(t0 + tl));
        core.handle_timeout(t0 + tl);
        assert_eq!(core.poll_action(), Some(Action::StopQp(a)));
    }

    #[test]
    fn ended_batches_leave_the_deadline_heap_bounded_and_live_deadlines_in_it() {
        let t0 = Instant::now();
        let mut core = Core::new();
        let (slow_qp, qp) = (core.add_qp(0, limits(4, 1)), core.add_qp(1, limits(4, 1)));
        let t = Duration::from_millis(10);
        let slow = cell();
        core.submit(
            vec![(slow_qp, write(1))],
            slow.clone(),
            Some((t0 + t, t)),
            vec![],
        );
        let mut out = Vec::new();
        core.take_postable(slow_qp, &mut out);
        let keep: Keep = Arc::new(0u8);
        for i in 0..1000u32 {
            let at = t0 + t + Duration::from_micros(u64::from(i));
            let c = cell();
            core.submit(
                vec![(qp, write(1))],
                c.clone(),
                Some((at, t)),
                vec![keep.clone()],
            );
            core.take_postable(qp, &mut out);
            core.on_completion(qp, out[0].wr_id, WcStatus::SUCCESS, 0);
            assert_eq!(c.outcome(), Some(Ok(())));
            // Bounded by the batches live when it last grew (this one too).
            assert!(core.deadline_entries() <= 2 * (core.batches_live() + 1) + 64);
        }
        assert_eq!(Arc::strong_count(&keep), 1, "ended batches keep nothing");
        assert_eq!(core.next_deadline(), Some(t0 + t));
        core.handle_timeout(t0 + t + Duration::from_millis(5));
        assert_eq!(core.poll_action(), Some(Action::StopQp(slow_qp)));
        assert_eq!(core.poll_action(), None, "no ended batch times out");
        assert_eq!(core.next_deadline(), Some(t0 + t + FLUSH_GRACE));
    }

    #[test]
    fn cancel_drops_queued_work_and_waits_for_what_is_posted() {
        let mut core = Core::new();
        let qp = core.add_qp(0, limits(1, 1));
        let c = cell();
        let id = core.submit(
            vec![(qp, write(1)), (qp, write(1))],
            c.clone(),
            None,
            vec![],
        );
        let mut out = Vec::new();
        core.take_postable(qp, &mut out);
        core.cancel(id);
        assert!(!c.is_done());
        assert_eq!(core.load(qp), 1);
        core.on_completion(qp, out[0].wr_id, WcStatus::SUCCESS, 0);
        assert_eq!(c.outcome(), Some(Err(TransferError::Cancelled)));
    }

    /// A drained queue pair being re-established takes work and holds it
    /// until it is revived (then posts it, signalling afresh) or given up
    /// (then fails it with the cause); a failed one refuses work.
    #[test]
    fn a_reconnecting_qp_holds_work_until_revived_or_given_up() {
        let mut core = Core::new();
        let qp = core.add_qp(0, limits(8, 4));
        let mut out = Vec::new();
        let first = cell();
        core.submit(vec![(qp, write(10))], first.clone(), None, vec![]);
        core.take_postable(qp, &mut out);
        core.on_completion(qp, out[0].wr_id, WcStatus::REM_ACCESS_ERR, 0);
        assert!(core.is_down(qp) && !core.accepts_work(qp));
        let refused = cell();
        core.submit(vec![(qp, write(10))], refused.clone(), None, vec![]);
        assert!(
            refused.outcome().is_some_and(|o| o.is_err()),
            "a failed QP refuses work"
        );
        assert!(core.begin_reconnect(qp));
        assert!(core.accepts_work(qp) && !core.is_ready(qp));
        let held = cell();
        core.submit(vec![(qp, write(10)); 3], held.clone(), None, vec![]);
        assert!(!core.has_postable(qp), "nothing posts while reconnecting");
        core.revive(qp, limits(8, 4));
        core.take_postable(qp, &mut out);
        assert_eq!(out.len(), 3);
        assert!(out[2].flags.contains(SendFlags::SIGNALED));
        core.on_completion(qp, out[2].wr_id, WcStatus::SUCCESS, 0);
        assert_eq!(held.outcome(), Some(Ok(())));
        // Fail it again, and give it up this time.
        let doomed = cell();
        core.submit(vec![(qp, write(10))], doomed.clone(), None, vec![]);
        core.fail_qp(qp, TransferError::Cancelled);
        assert!(doomed.outcome().is_some_and(|o| o.is_err()));
        assert!(core.begin_reconnect(qp));
        let abandoned = cell();
        core.submit(vec![(qp, write(10))], abandoned.clone(), None, vec![]);
        let gone = TransferError::PeerGone {
            reason: "test".into(),
        };
        core.give_up(qp, gone.clone());
        assert_eq!(abandoned.outcome(), Some(Err(gone)));
        assert!(core.is_down(qp));
    }
}
