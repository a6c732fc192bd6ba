//! Batches of work requests on a peer's queue pairs: the book-keeping of
//! every queue pair and request, in quinn-proto's shape (no I/O, no
//! thread, no clock read).
//!
//! The driver feeds it (`submit`, `on_completion`, `post_failed`,
//! `fail_qp`, `handle_timeout(now)`), takes the work to post from it
//! (`take_postable`) and carries out what [`Batches::poll_action`] hands
//! out: stop a queue pair, re-establish a drained one, tell a batch's
//! owner its outcome, release what a batch kept alive. The requests
//! themselves are the driver's ([`Requests`]): `gdr-core` posts verbs
//! send requests; the tests post plain numbers.
//!
//! Per queue pair: a queue of work not yet posted, and the work in
//! flight, in posting order. A send queue completes in order (RC), so one
//! signaled completion retires every request posted before it: only every
//! `signal_every`-th request, and the last of each post, asks for a
//! completion (selective signalling; the last so that the tail of the
//! queue is always reported, flushes included). At most `depth` requests
//! are in flight per queue pair, and at most `send_limit` SENDs (the
//! receives the peer keeps posted).
//!
//! Exactly once, by construction: a batch's [`Requests::Notify`] is moved
//! into the one [`Action::End`] that tells its outcome, and its
//! [`Requests::Hold`] into the one action that releases it. A batch ends
//! when its last work request is retired (succeeded, failed, or flushed)
//! or, past its deadline, after its queue pairs were stopped and flushed;
//! when the flushes do not come within [`FLUSH_GRACE`], its outcome is
//! told anyway, and what it holds (the regions it reads and writes, and
//! through them the buffers' memory) stays held until every one of its
//! requests is retired: the NIC may still have them.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::fmt::Debug;
use std::time::{Duration, Instant};

use crate::mutant;

#[cfg(test)]
mod tests;

/// A queue pair's index in [`Batches`].
pub type QpId = usize;
/// A batch's id: its slot's index (low 32 bits) and the slot's generation
/// (high 32 bits, from 1). Id 0 names no batch.
pub type BatchId = u64;

/// The driver's side of a batch: its work requests, its errors, and what
/// a batch tells and keeps.
pub trait Requests {
    /// One work request (its id and signalling are set by [`Batches`]).
    type Request: Debug;
    /// Why a request or batch failed.
    type Error: Clone + Debug;
    /// Told the batch's outcome, once ([`Action::End`]).
    type Notify: Debug;
    /// Kept alive until the batch's last request is retired
    /// ([`Action::End`] or [`Action::Release`]).
    type Hold: Debug;

    /// Whether the request consumes one of the peer's posted receives.
    fn is_send(request: &Self::Request) -> bool;
    /// The bytes the request moves (counters only).
    fn len(request: &Self::Request) -> u64;
    /// Sets the request's id (its completion names it) and whether it asks
    /// for a completion.
    fn number(request: &mut Self::Request, wr_id: u64, signaled: bool);
    /// What a request flushed from queue pair `qp` (index within its
    /// peer) after it failed with `cause` ends with.
    fn flushed(qp: u16, cause: &Self::Error) -> Self::Error;
    /// What a batch past its deadline ends with.
    fn timeout(after: Duration) -> Self::Error;
    /// What a cancelled batch ends with.
    fn cancelled() -> Self::Error;
}

/// One work request waiting to be posted, and its batch.
#[derive(Debug, Clone)]
pub struct Work<Q> {
    /// Set by [`Batches::submit`].
    pub batch: BatchId,
    /// The request; its id and signalling are set when it is taken.
    pub request: Q,
}

impl<Q> Work<Q> {
    /// A request of a batch not yet submitted.
    pub fn new(request: Q) -> Self {
        Self { batch: 0, request }
    }
}

/// What the driver must do for [`Batches`].
#[derive(Debug)]
pub enum Action<R: Requests> {
    /// Move this queue pair to ERROR so that what it holds flushes (a
    /// request on it passed its deadline, or a post left a tail nothing
    /// would report).
    StopQp(QpId),
    /// The queue pair failed and nothing of it is in flight any more.
    QpDrained(QpId),
    /// The batch ended: tell `notify` the outcome. With `hold`, its last
    /// request was retired too: release `hold` first (so that whoever
    /// hears the outcome finds the memory released); without, the NIC may
    /// still have requests of it, and [`Action::Release`] comes later.
    End {
        /// The batch (0: it ended at submit).
        batch: BatchId,
        /// Its outcome.
        outcome: Result<(), R::Error>,
        /// Who is told, moved out: a batch ends once.
        notify: R::Notify,
        /// What it kept alive, when nothing of it is left in flight.
        hold: Option<R::Hold>,
    },
    /// The last request of a batch that already ended was retired: release
    /// what it kept alive.
    Release {
        /// The batch.
        batch: BatchId,
        /// What it kept alive.
        hold: R::Hold,
    },
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
enum Health<E> {
    /// Posting.
    Ready,
    /// In error (the NIC's, or stopped by the driver): what is in flight
    /// flushes, nothing more is posted.
    Failing(E),
    /// In error and nothing left in flight.
    Drained(E),
    /// Drained, and being re-established (a new connection for the same
    /// queue pair index): work may queue, nothing is posted until
    /// [`Batches::revive`].
    Reconnecting(E),
}

impl<E> Health<E> {
    fn is_ready(&self) -> bool {
        matches!(self, Health::Ready)
    }
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
struct QpRecord<R: Requests> {
    index: u16,
    depth: u32,
    send_limit: u32,
    signal_every: u32,
    queue: VecDeque<Work<R::Request>>,
    in_flight: VecDeque<InFlight>,
    sends_in_flight: u32,
    next_seq: u64,
    since_signal: u32,
    health: Health<R::Error>,
    reset_requested: bool,
    counters: QpCounters,
}

#[derive(Debug)]
struct BatchRecord<R: Requests> {
    /// Taken by the batch's one [`Action::End`].
    notify: Option<R::Notify>,
    hold: R::Hold,
    unfinished: usize,
    error: Option<R::Error>,
    deadline: Option<(Instant, Duration)>,
    ended: bool,
}

/// One slot of the batch table: the batch it holds (if any), and a
/// generation that makes the ids of the slot's earlier batches stale.
#[derive(Debug)]
struct Slot<R: Requests> {
    generation: u32,
    record: Option<BatchRecord<R>>,
}

/// The live batches, indexed by id. A slot whose generation is spent is
/// never reused, so an id is never given twice: a stale id (a batch that
/// ended) finds nothing.
#[derive(Debug)]
struct Table<R: Requests> {
    slots: Vec<Slot<R>>,
    free: Vec<u32>,
    live: usize,
}

impl<R: Requests> Table<R> {
    fn insert(&mut self, record: BatchRecord<R>) -> BatchId {
        let index = self.free.pop().unwrap_or_else(|| {
            self.slots.push(Slot {
                generation: 0,
                record: None,
            });
            u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 batches live")
        });
        let slot = &mut self.slots[index as usize];
        slot.generation += 1;
        slot.record = Some(record);
        self.live += 1;
        (u64::from(slot.generation) << 32) | u64::from(index)
    }

    fn get(&self, id: BatchId) -> Option<&BatchRecord<R>> {
        self.slots
            .get(id as u32 as usize)
            .filter(|s| s.generation == (id >> 32) as u32)?
            .record
            .as_ref()
    }

    fn get_mut(&mut self, id: BatchId) -> Option<&mut BatchRecord<R>> {
        let slot = self.slots.get_mut(id as u32 as usize)?;
        if slot.generation != (id >> 32) as u32 {
            return None;
        }
        slot.record.as_mut()
    }

    fn remove(&mut self, id: BatchId) -> Option<BatchRecord<R>> {
        let index = id as u32;
        let slot = self.slots.get_mut(index as usize)?;
        if slot.generation != (id >> 32) as u32 {
            return None;
        }
        let record = slot.record.take()?;
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

/// The configuration of one queue pair.
#[derive(Debug, Clone, Copy)]
pub struct QpLimits {
    /// Work requests in flight at most.
    pub depth: u32,
    /// SENDs in flight at most (the peer's posted receives).
    pub send_limit: u32,
    /// Ask for a completion every this many requests (and at the end of
    /// each post).
    pub signal_every: u32,
}

/// How long a batch stopped at its deadline may wait for its flushes
/// before its outcome is told anyway.
pub const FLUSH_GRACE: Duration = Duration::from_secs(1);

/// The queue pairs and batches of one engine.
#[derive(Debug)]
pub struct Batches<R: Requests> {
    qps: Vec<QpRecord<R>>,
    batches: Table<R>,
    /// Earliest first; an entry whose batch ended (or moved its deadline)
    /// stays until it surfaces or the heap is compacted
    /// ([`Batches::submit`]): ending a batch costs no search.
    deadlines: BinaryHeap<Reverse<(Instant, BatchId)>>,
    actions: VecDeque<Action<R>>,
    /// The last submitted batch's work list, emptied: the next submit
    /// fills it again ([`Batches::work_buffer`]).
    spare_work: Vec<(QpId, Work<R::Request>)>,
}

impl<R: Requests> Default for Batches<R> {
    fn default() -> Self {
        Self {
            qps: Vec::new(),
            batches: Table {
                slots: Vec::new(),
                free: Vec::new(),
                live: 0,
            },
            deadlines: BinaryHeap::new(),
            actions: VecDeque::new(),
            spare_work: Vec::new(),
        }
    }
}

impl<R: Requests> Batches<R> {
    /// No queue pair, no batch.
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

    /// Whether `qp` posts. Changes with every call that fails, stops,
    /// revives or gives up a queue pair.
    #[inline]
    pub fn is_ready(&self, qp: QpId) -> bool {
        self.qps[qp].health.is_ready()
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
    /// until [`Batches::revive`] or [`Batches::give_up`]. Returns whether
    /// it was drained (anything else is left as it is).
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
    pub fn give_up(&mut self, qp: QpId, cause: R::Error) {
        let r = &mut self.qps[qp];
        if !matches!(r.health, Health::Reconnecting(_)) {
            return;
        }
        r.health = Health::Drained(cause.clone());
        let queued: Vec<_> = r.queue.drain(..).collect();
        for work in queued {
            self.retire(work.batch, 1, Err(cause.clone()));
        }
    }

    /// The counters of `qp`.
    pub fn counters(&self, qp: QpId) -> QpCounters {
        self.qps[qp].counters
    }

    /// Requests queued or in flight on `qp`.
    pub fn load(&self, qp: QpId) -> usize {
        let record = &self.qps[qp];
        record.queue.len() + record.in_flight.len()
    }

    /// Whether a SEND is next in `qp`'s queue, not yet posted: once all
    /// that could be was, it waits for one of the peer's receives (SENDs
    /// in flight completing), for room, or for the queue pair to be up.
    pub fn send_waits(&self, qp: QpId) -> bool {
        self.qps[qp]
            .queue
            .front()
            .is_some_and(|w| R::is_send(&w.request))
    }

    /// SENDs in flight on `qp` (each holds one of the peer's receives).
    pub fn sends_in_flight(&self, qp: QpId) -> u32 {
        self.qps[qp].sends_in_flight
    }

    /// Batches not yet released (told or not).
    pub fn batches_live(&self) -> usize {
        self.batches.live
    }

    /// Entries in the deadline heap, live or not.
    #[cfg(test)]
    fn deadline_entries(&self) -> usize {
        self.deadlines.len()
    }

    /// An empty work list to fill for [`Batches::submit`] (the last one's
    /// allocation, reused).
    pub fn work_buffer(&mut self) -> Vec<(QpId, Work<R::Request>)> {
        std::mem::take(&mut self.spare_work)
    }

    /// Queues a batch of work (each item on its queue pair), to end by
    /// `deadline` (`now + timeout`), keeping `hold` until its last request
    /// is retired. An empty batch succeeds at once; work for a queue pair
    /// that is neither up nor being re-established fails the batch at
    /// once. A batch that ended at once gets id 0, which names no batch
    /// (its [`Action::End`] is queued).
    pub fn submit(
        &mut self,
        mut work: Vec<(QpId, Work<R::Request>)>,
        notify: R::Notify,
        deadline: Option<(Instant, Duration)>,
        hold: R::Hold,
    ) -> BatchId {
        let refused = if work.is_empty() {
            Some(Ok(()))
        } else {
            work.iter().find_map(|(qp, _)| match &self.qps[*qp].health {
                Health::Ready | Health::Reconnecting(_) => None,
                Health::Failing(e) | Health::Drained(e) => Some(Err(e.clone())),
            })
        };
        if let Some(outcome) = refused {
            self.actions.push_back(Action::End {
                batch: 0,
                outcome,
                notify,
                hold: Some(hold),
            });
            return 0;
        }
        let record = BatchRecord {
            notify: Some(notify),
            hold,
            unfinished: work.len(),
            error: None,
            deadline,
            ended: false,
        };
        let id = self.batches.insert(record);
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

    /// Whether `qp` has work it could post now. Changes with `submit`,
    /// `on_completion` and anything that changes the queue pair's health.
    pub fn has_postable(&self, qp: QpId) -> bool {
        let r = &self.qps[qp];
        r.health.is_ready()
            && (r.in_flight.len() as u32) < r.depth
            && r.queue
                .front()
                .is_some_and(|w| !R::is_send(&w.request) || r.sends_in_flight < r.send_limit)
    }

    /// Takes the work `qp` can post now, in order, with ids and signalling
    /// set, into `out` (cleared first); the caller posts it with one
    /// doorbell and reports a refusal with [`Batches::post_failed`].
    pub fn take_postable(&mut self, qp: QpId, out: &mut Vec<R::Request>) {
        out.clear();
        let r = &mut self.qps[qp];
        if !r.health.is_ready() {
            return;
        }
        // How many of the queue's front go: as many as there is room for,
        // up to a SEND the peer has no receive left for.
        let room = (r.depth as usize).saturating_sub(r.in_flight.len());
        let mut sends = r.sends_in_flight;
        let mut n = 0;
        for work in r.queue.iter().take(room) {
            if R::is_send(&work.request) {
                let limited = !mutant::active("send-limit-ignored");
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
        for i in 0..n {
            let mut work = r.queue.pop_front().expect("counted");
            let seq = r.next_seq;
            r.next_seq += 1;
            r.since_signal += 1;
            // The last of a post always asks for a completion, so that the
            // queue's tail is reported.
            let signal = r.since_signal >= r.signal_every || i + 1 == n;
            if signal {
                r.since_signal = 0;
                signaled += 1;
            }
            R::number(&mut work.request, seq, signal);
            bytes += R::len(&work.request);
            r.in_flight.push_back(InFlight {
                seq,
                batch: work.batch,
                send: R::is_send(&work.request),
                signaled: signal,
            });
            out.push(work.request);
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
        error: R::Error,
    ) {
        let Some(accepted) = accepted else {
            // Which were posted is unknown: stop the queue pair; what it
            // flushes is retired, the rest is told by the deadline's grace
            // (and stays held: the NIC may have it).
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

    /// A send-queue completion of `qp` (`Err`: the NIC's status for it):
    /// retires every request up to `wr_id` (a signaled completion stands
    /// for the unsignaled ones before it). A completion of no request in
    /// flight changes nothing.
    pub fn on_completion(&mut self, qp: QpId, wr_id: u64, result: Result<(), R::Error>) {
        let r = &self.qps[qp];
        let in_flight = match (r.in_flight.front(), r.in_flight.back()) {
            (Some(first), Some(last)) => first.seq <= wr_id && wr_id <= last.seq,
            _ => false,
        };
        if !in_flight {
            return;
        }
        let index = r.index;
        let failure = match result {
            Err(e) if r.health.is_ready() => Some(e),
            _ => None,
        };
        // What every request retired here ends with, but the failed one.
        let common: Result<(), R::Error> = match &r.health {
            Health::Failing(cause) | Health::Drained(cause) | Health::Reconnecting(cause) => {
                Err(R::flushed(index, cause))
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
            let returned = !mutant::active("send-credit-leak");
            if item.send && returned {
                r.sends_in_flight -= 1;
            }
            if item.seq == wr_id
                && let Some(e) = &failure
            {
                if let Some((batch, n)) = run.take() {
                    self.retire(batch, n, common.clone());
                }
                self.retire(item.batch, 1, Err(e.clone()));
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
        if let Some(e) = failure {
            self.stop(qp, e);
        }
        self.check_drained(qp);
    }

    /// The queue pair is in error (the peer disconnected, the driver
    /// stopped it): its queued work fails now, what is in flight when its
    /// flushes arrive.
    pub fn fail_qp(&mut self, qp: QpId, cause: R::Error) {
        if self.qps[qp].health.is_ready() {
            self.stop(qp, cause);
        }
        self.check_drained(qp);
    }

    /// The queue pair is gone without flushing (device failure, or a queue
    /// pair destroyed): everything it holds fails now.
    pub fn abandon_qp(&mut self, qp: QpId, cause: R::Error) {
        self.fail_qp(qp, cause.clone());
        let r = &mut self.qps[qp];
        let gone: Vec<InFlight> = r.in_flight.drain(..).collect();
        r.sends_in_flight = 0;
        for item in gone {
            self.retire(item.batch, 1, Err(cause.clone()));
        }
        self.check_drained(qp);
    }

    fn stop(&mut self, qp: QpId, cause: R::Error) {
        let r = &mut self.qps[qp];
        if !r.health.is_ready() {
            return;
        }
        let flushed = R::flushed(r.index, &cause);
        r.health = Health::Failing(cause);
        let queued: Vec<_> = r.queue.drain(..).collect();
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
    fn retire(&mut self, batch: BatchId, n: usize, result: Result<(), R::Error>) {
        // A batch ends only once every request of it has retired: one
        // retiring after is a request counted twice (in tests, a panic; the
        // soak has no other sign of it once posts complete at once).
        debug_assert!(
            self.batches.get(batch).is_some(),
            "a request of batch {batch} retired after its batch had ended"
        );
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

    /// Ends `batch` once none of its requests is left.
    fn finish_if_done(&mut self, batch: BatchId) {
        if self.batches.get(batch).is_some_and(|r| r.unfinished == 0) {
            self.finish(batch);
        }
    }

    /// None of `batch`'s requests is left: its outcome is told (unless
    /// the grace told it already) and its hold released; its deadline's
    /// entry stays in the heap, stale.
    fn finish(&mut self, batch: BatchId) {
        let Some(record) = self.batches.remove(batch) else {
            return;
        };
        let action = match record.notify {
            Some(notify) => Action::End {
                batch,
                outcome: record.error.map_or(Ok(()), Err),
                notify,
                hold: Some(record.hold),
            },
            None => Action::Release {
                batch,
                hold: record.hold,
            },
        };
        self.actions.push_back(action);
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
    /// [`Requests::cancelled`] once nothing of it is in flight. A stale id
    /// changes nothing.
    pub fn cancel(&mut self, batch: BatchId) {
        let Some(record) = self.batches.get_mut(batch) else {
            return;
        };
        if record.error.is_none() {
            record.error = Some(R::cancelled());
        }
        self.drop_queued(batch);
        self.finish_if_done(batch);
    }

    /// The earliest time the driver must call [`Batches::handle_timeout`]
    /// at. Changes with `submit`, `handle_timeout` and every call that
    /// ends a batch.
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
    /// within [`FLUSH_GRACE`], its outcome is told anyway and its hold
    /// kept until its requests are retired.
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
                // The grace period passed: tell now, keep the hold until
                // its requests retire.
                if let Some(notify) = record.notify.take() {
                    let outcome = Err(record.error.clone().unwrap_or(R::timeout(after)));
                    self.actions.push_back(Action::End {
                        batch,
                        outcome,
                        notify,
                        hold: None,
                    });
                }
                continue;
            }
            record.ended = true;
            if mutant::active("timeout-delivers-in-flight")
                && let Some(notify) = record.notify.take()
            {
                self.actions.push_back(Action::End {
                    batch,
                    outcome: Err(R::timeout(after)),
                    notify,
                    hold: None,
                });
            }
            let record = self.batches.get_mut(batch).expect("looked up above");
            if record.error.is_none() {
                record.error = Some(R::timeout(after));
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

    /// The next thing the driver must do, in the order decided. Changes
    /// with every call above but the read-only ones.
    pub fn poll_action(&mut self) -> Option<Action<R>> {
        self.actions.pop_front()
    }
}
