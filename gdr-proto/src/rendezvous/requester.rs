//! The requester's side of the slotted rendezvous: this side's requests
//! through the landing slots one peer lends it.
//!
//! The driver sends each request, moves each slice the owner lends a slot
//! for (an RDMA op, through its staging pool if its memory is staged) and
//! completes the batches; this machine decides which slices may move,
//! what the owner is told, and how each request ends. Inputs: the peer's
//! slots ([`Requester::on_slots`]), credits ([`Requester::on_ready`]) and
//! replies ([`Requester::on_reply`]); a slice's wire op done
//! ([`Requester::wired`]) and its end ([`Requester::slice_ended`]); a
//! failure or cancel ([`Requester::fail`]); the peer gone; the time.
//! Outputs: [`Requester::poll_action`].
//!
//! What it guarantees (tested in memory, against the [`super::Owner`]):
//! - a slice moves only through a slot the owner lent, inside the request
//!   and the slot, and a slot carries one slice at a time: a credit naming
//!   a slot busy or out of range fails the request (a peer cannot make
//!   this side hold more slices than it lent slots);
//! - nothing new moves once a request failed; it ends once its slices in
//!   flight have ended, and the owner is told (`StagedCancel`) unless the
//!   peer is gone;
//! - each request ends exactly once, `Ok` only with every byte moved and,
//!   for a WRITE, the owner's reply.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::{RequestId, status};

/// Why a request failed, for the driver to say in its own terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AskFailure {
    /// The owner answered with this status ([`status`]), not OK.
    Refused(u32),
    /// The peer is gone.
    PeerGone,
    /// The deadline passed.
    TimedOut,
    /// The caller cancelled it.
    Cancelled,
    /// The owner lent a slot that does not fit the request or its slots,
    /// or one still carrying a slice.
    BadCredit {
        /// The slot named.
        slot: u32,
        /// The slice's offset.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// A slice failed in the driver (it keeps why).
    Local,
    /// The owner ended the request before every slice moved.
    Incomplete,
}

/// What the driver is to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequesterAction {
    /// Move `len` bytes at `offset` of request `id` through slot `slot`
    /// (WRITE into it, or READ out of it); report with
    /// [`Requester::wired`] and [`Requester::slice_ended`].
    Move {
        /// The request.
        id: RequestId,
        /// The slot.
        slot: u32,
        /// The slice's offset in the request.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// Send `SlotFilled { id, slot }`.
    Filled {
        /// The request.
        id: RequestId,
        /// The slot.
        slot: u32,
    },
    /// Send `SlotDone { id, slot }`.
    Done {
        /// The request.
        id: RequestId,
        /// The slot.
        slot: u32,
    },
    /// Send `StagedCancel { id }`.
    Cancel {
        /// The request.
        id: RequestId,
    },
    /// Request `id` ended: complete its batch.
    End {
        /// The request.
        id: RequestId,
        /// How.
        outcome: Result<(), AskFailure>,
    },
}

#[derive(Debug)]
struct Ask {
    write: bool,
    len: u64,
    /// `None`: a bound past what an `Instant` holds, which never passes.
    deadline: Option<Instant>,
    /// Its slices moving (from their credit to their end).
    in_flight: usize,
    /// Slots lent to it whose slice's wire op has not ended: the owner's
    /// again once it has (told by `SlotFilled`/`SlotDone`).
    held: Vec<u32>,
    done: u64,
    reply: Option<u32>,
    failure: Option<AskFailure>,
}

/// This side's requests through one peer's landing slots.
#[derive(Debug)]
pub struct Requester {
    /// The lent slots: (bytes each, count), once the peer said.
    slots: Option<(u64, u32)>,
    asks: HashMap<RequestId, Ask>,
    next_id: RequestId,
    gone: bool,
    actions: VecDeque<RequesterAction>,
}

impl Requester {
    /// No request yet; ids from `first_id` on (kept apart from grant ids,
    /// which older engines' requests not through landing slots used).
    pub fn new(first_id: RequestId) -> Self {
        Self {
            slots: None,
            asks: HashMap::new(),
            next_id: first_id,
            gone: false,
            actions: VecDeque::new(),
        }
    }

    /// The id the next request takes.
    pub fn next_id(&self) -> RequestId {
        self.next_id + 1
    }

    /// A request of `len` bytes (a WRITE when `write`) was sent with id
    /// [`Requester::next_id`], due by `now + timeout`.
    pub fn start(&mut self, write: bool, len: u64, now: Instant, timeout: Duration) -> RequestId {
        self.next_id += 1;
        let id = self.next_id;
        self.asks.insert(
            id,
            Ask {
                write,
                len,
                deadline: now.checked_add(timeout),
                in_flight: 0,
                held: Vec::new(),
                done: 0,
                reply: None,
                failure: None,
            },
        );
        id
    }

    /// Whether request `id` is this side's and not ended.
    pub fn knows(&self, id: RequestId) -> bool {
        self.asks.contains_key(&id)
    }

    /// Whether any request is under way.
    pub fn is_idle(&self) -> bool {
        self.asks.is_empty() && self.actions.is_empty()
    }

    /// Whether request `id` failed: the driver starts nothing more of it.
    pub fn is_failing(&self, id: RequestId) -> bool {
        self.asks.get(&id).is_none_or(|a| a.failure.is_some())
    }

    /// The peer lends `count` slots of `slot_len` bytes (the driver checked
    /// that its grant covers them).
    pub fn on_slots(&mut self, slot_len: u64, count: u32) {
        self.slots = Some((slot_len, count));
    }

    /// The owner's reply to request `id`.
    pub fn on_reply(&mut self, id: RequestId, status: u32) {
        if let Some(a) = self.asks.get_mut(&id) {
            a.reply.get_or_insert(status);
            if status != status::OK {
                a.failure.get_or_insert(AskFailure::Refused(status));
            }
        }
    }

    /// The owner's credit: slot `slot` is request `id`'s for its slice at
    /// `offset` of `len` bytes. One for a request that ended (it crossed
    /// our cancel) changes nothing.
    pub fn on_ready(&mut self, id: RequestId, offset: u64, len: u64, slot: u32) {
        let busy = self.asks.values().any(|other| other.held.contains(&slot));
        let Some(a) = self.asks.get_mut(&id) else {
            return;
        };
        if a.failure.is_some() {
            return;
        }
        let fits = self.slots.is_some_and(|(slot_len, count)| {
            slot < count
                && len > 0
                && len <= slot_len
                && offset.checked_add(len).is_some_and(|end| end <= a.len)
        });
        if !fits || busy {
            a.failure
                .get_or_insert(AskFailure::BadCredit { slot, offset, len });
            return;
        }
        a.in_flight += 1;
        a.held.push(slot);
        self.actions.push_back(RequesterAction::Move {
            id,
            slot,
            offset,
            len,
        });
    }

    /// The wire op of request `id`'s slice in `slot` is done (its last
    /// chunk): the owner is told the slot holds it (a WRITE) or is free
    /// again (a READ).
    pub fn wired(&mut self, id: RequestId, slot: u32) {
        let Some(a) = self.asks.get_mut(&id) else {
            return;
        };
        a.held.retain(|&s| s != slot);
        self.actions.push_back(if a.write {
            RequesterAction::Filled { id, slot }
        } else {
            RequesterAction::Done { id, slot }
        });
    }

    /// Request `id`'s slice in `slot` ended, `len` bytes moved when
    /// `whole` (else it stopped part-way or never started).
    pub fn slice_ended(&mut self, id: RequestId, slot: u32, len: u64, whole: bool) {
        let Some(a) = self.asks.get_mut(&id) else {
            return;
        };
        if a.in_flight == 0 {
            debug_assert!(false, "a slice ended that never started");
            return;
        }
        a.in_flight -= 1;
        a.held.retain(|&s| s != slot);
        if whole {
            a.done += len;
        }
    }

    /// Request `id` fails (first reason wins): nothing new of it moves.
    pub fn fail(&mut self, id: RequestId, why: AskFailure) {
        if let Some(a) = self.asks.get_mut(&id) {
            a.failure.get_or_insert(why);
        }
    }

    /// The peer is gone: every request fails, and the owner is not told.
    pub fn peer_gone(&mut self) {
        self.gone = true;
        for a in self.asks.values_mut() {
            a.failure.get_or_insert(AskFailure::PeerGone);
        }
    }

    /// Fails the requests past their deadline at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        for a in self.asks.values_mut() {
            if a.deadline.is_some_and(|at| now >= at) {
                a.failure.get_or_insert(AskFailure::TimedOut);
            }
        }
    }

    /// When [`Requester::handle_timeout`] next has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.asks
            .values()
            .filter(|a| a.failure.is_none())
            .filter_map(|a| a.deadline)
            .min()
    }

    /// Ends the requests that are over: nothing in flight and failed, or
    /// (a WRITE) answered, or (a READ) whole. Call after feeding inputs;
    /// then [`Requester::poll_action`].
    pub fn step(&mut self) {
        let over: Vec<RequestId> = self
            .asks
            .iter()
            .filter(|(_, a)| {
                a.in_flight == 0
                    && (a.failure.is_some()
                        || (a.write && a.reply.is_some())
                        || (!a.write && a.done == a.len))
            })
            .map(|(&id, _)| id)
            .collect();
        for id in over {
            let a = self.asks.remove(&id).expect("listed above");
            let outcome = match a.failure {
                Some(why) => {
                    if !self.gone {
                        self.actions.push_back(RequesterAction::Cancel { id });
                    }
                    Err(why)
                }
                None if a.done == a.len => Ok(()),
                None => Err(AskFailure::Incomplete),
            };
            self.actions.push_back(RequesterAction::End { id, outcome });
        }
    }

    /// The next thing to do. Changes after every input and
    /// [`Requester::step`].
    pub fn poll_action(&mut self) -> Option<RequesterAction> {
        self.actions.pop_front()
    }
}
