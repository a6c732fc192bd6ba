//! The slotted rendezvous, sans-IO: the requester's side ([`Requester`])
//! and the owner's. The owner's side: a peer's requests
//! against this side's staged grants (GPU memory no NIC reaches), served
//! slice by slice through landing slots lent to that peer alone, with
//! credits.
//!
//! The driver owns the slots' memory, their registration and grant, and
//! the GPU streams; this machine decides what happens to each slot and
//! request. Inputs: a request ([`Owner::on_request`], checked against the
//! grant table, taking a use of the grant), the peer's credits
//! ([`Owner::on_filled`], [`Owner::on_done`]), a cancel, a copy's end
//! ([`Owner::copy_ended`]), a revoke ([`Owner::revoke`]), the time
//! ([`Owner::handle_timeout`]). Outputs ([`Owner::poll_action`]): messages
//! for the peer and copies to run between a slot and the GPU.
//!
//! What it guarantees (each tested below, in memory):
//! - a copy touches only the GPU range of a request the grant allowed, at
//!   an offset inside it, and only while the request holds a use of the
//!   grant (so a revoke is fenced only after its last copy has ended);
//! - a revoked, cancelled, timed-out or refused request starts no copy;
//!   what a peer writes into a slot of a failed request is never copied;
//! - a peer holds at most [`crate::PeerLimits::max_staged_requests`]
//!   requests here (one more is answered [`status::BUSY`], nothing kept),
//!   each for at most [`crate::PeerLimits::staged_request_timeout`] (then
//!   [`status::TIMED_OUT`], and every slot lent to it comes back);
//! - a credit naming a slot not lent to exactly that slice fails the
//!   request ([`status::BAD_CREDIT`]); one naming no request is dropped;
//! - each request is answered at most once, and not at all once the peer
//!   cancelled it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::PeerLimits;
use crate::grants::{Access, GrantId, LocalGrants, Refusal};

#[cfg(test)]
mod pair_tests;
mod requester;

/// The first id of a requester's requests through a peer's landing slots:
/// a bit no grant id reaches (older engines named their requests not
/// through landing slots by grant ids).
pub const FIRST_REQUEST_ID: RequestId = 1 << 63;

/// Both sides of the slotted rendezvous with one peer, as its connection
/// keeps them ([`crate::connection::Connection::rendezvous_mut`]).
#[derive(Debug)]
pub struct Rendezvous {
    /// The peer's requests served through this side's landing slots.
    pub owner: Owner,
    /// This side's requests through the peer's landing slots.
    pub requester: Requester,
}

impl Rendezvous {
    /// Nothing asked either way yet, the peer's requests under `limits`.
    pub fn new(limits: &PeerLimits) -> Self {
        Self {
            owner: Owner::new(limits),
            requester: Requester::new(FIRST_REQUEST_ID),
        }
    }

    /// The earliest deadline of either side.
    pub fn poll_timeout(&self) -> Option<Instant> {
        [self.owner.poll_timeout(), self.requester.poll_timeout()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Handles both sides' deadlines up to `now` (what they decide comes
    /// out of their `poll_action`).
    pub fn handle_timeout(&mut self, now: Instant) {
        self.owner.handle_timeout(now);
        self.requester.handle_timeout(now);
    }
}
pub use requester::{AskFailure, Requester, RequesterAction};

/// The status of a `StagedReply` (on the wire: a `u32`).
pub mod status {
    /// Done.
    pub const OK: u32 = 0;
    /// No live grant of that id on this connection.
    pub const NOT_GRANTED: u32 = 1;
    /// The grant does not allow it. Also the answer to a request not
    /// through landing slots (`slots: false`, the naive rendezvous): the
    /// engine no longer serves that form.
    pub const ACCESS_DENIED: u32 = 2;
    /// Outside the grant.
    pub const OUT_OF_BOUNDS: u32 = 3;
    /// Staging failed at the owner (a copy, or the slots).
    pub const FAILED: u32 = 4;
    /// A slot credit matching no slot lent to the request.
    pub const BAD_CREDIT: u32 = 5;
    /// The grant was revoked while the request ran.
    pub const REVOKED: u32 = 6;
    /// The owner serves as many of this peer's requests as it allows.
    pub const BUSY: u32 = 7;
    /// The request outlived the owner's deadline.
    pub const TIMED_OUT: u32 = 8;

    /// What a refusal of the grant table answers.
    pub fn of_refusal(refusal: crate::grants::Refusal) -> u32 {
        match refusal {
            crate::grants::Refusal::NotGranted(_) => NOT_GRANTED,
            crate::grants::Refusal::AccessDenied { .. } => ACCESS_DENIED,
            crate::grants::Refusal::OutOfBounds { .. } => OUT_OF_BOUNDS,
        }
    }
}

/// A request's id, the requester's.
pub type RequestId = u64;
/// A copy's id, this machine's.
pub type CopyId = u64;

/// A peer's rendezvous request, as received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedAsk {
    /// Its id (echoed in replies and credits).
    pub id: RequestId,
    /// The grant it names.
    pub grant: GrantId,
    /// Offset in the grant.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// The requester WRITEs (else it READs).
    pub write: bool,
}

/// Where a grant's bytes are: its GPU and the device address of its first
/// byte (the driver reads it off the grant's payload).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The GPU's ordinal.
    pub gpu: u32,
    /// Device address of the grant's first byte.
    pub addr: u64,
}

/// What the driver is to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnerAction {
    /// Send `StagedReply { id, status }` to the peer.
    Reply {
        /// The request.
        id: RequestId,
        /// Its status ([`status`]).
        status: u32,
    },
    /// Send `SlotReady` to the peer: slot `slot` is the request's for its
    /// slice at `offset` of `len` bytes.
    SlotReady {
        /// The request.
        id: RequestId,
        /// The slice's offset in the request.
        offset: u64,
        /// The slice's length (at most a slot).
        len: u64,
        /// The slot.
        slot: u32,
    },
    /// Copy `len` bytes between landing slot `slot` (from its start) and
    /// the GPU at `gpu_addr`: into the GPU when `to_gpu`. Report the end
    /// with [`Owner::copy_ended`]. `gpu_addr..gpu_addr + len` lies inside
    /// a grant that stays held (its use not ended) until then.
    Copy {
        /// This copy.
        copy: CopyId,
        /// The slot.
        slot: u32,
        /// Direction.
        to_gpu: bool,
        /// The GPU.
        gpu: u32,
        /// Device address.
        gpu_addr: u64,
        /// Bytes, at most a slot.
        len: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    /// Lent to request `id` for its slice at `offset` (its `SlotReady`
    /// sent).
    Lent {
        id: RequestId,
        offset: u64,
        len: u64,
    },
    /// This side's copy for that slice runs.
    Copying {
        id: RequestId,
        offset: u64,
        len: u64,
        copy: CopyId,
    },
}

impl Slot {
    fn request(&self) -> Option<RequestId> {
        match *self {
            Slot::Free => None,
            Slot::Lent { id, .. } | Slot::Copying { id, .. } => Some(id),
        }
    }
}

/// A copy of one slice between a slot and the GPU, about to start.
struct Copy {
    slot: u32,
    id: RequestId,
    offset: u64,
    len: u64,
    to_gpu: bool,
    gpu: u32,
    gpu_addr: u64,
}

impl Copy {
    /// Queues it as the next copy (`next` numbers them); the slot's
    /// state while it runs.
    fn start(self, next: &mut CopyId, actions: &mut VecDeque<OwnerAction>) -> Slot {
        let copy = *next;
        *next += 1;
        actions.push_back(OwnerAction::Copy {
            copy,
            slot: self.slot,
            to_gpu: self.to_gpu,
            gpu: self.gpu,
            gpu_addr: self.gpu_addr,
            len: self.len,
        });
        Slot::Copying {
            id: self.id,
            offset: self.offset,
            len: self.len,
            copy,
        }
    }
}

#[derive(Debug)]
struct Serve {
    id: RequestId,
    grant: GrantId,
    write: bool,
    gpu: u32,
    /// Device address of the request's first byte.
    addr: u64,
    len: u64,
    /// Next offset to lend a slot for.
    next: u64,
    /// Bytes whose owner's part ended.
    landed: u64,
    failed: Option<u32>,
    replied: bool,
    cancelled: bool,
    /// Holds a use of its grant (module docs).
    holds_use: bool,
    deadline: Instant,
}

/// The owner's side of the rendezvous with one peer (module docs).
#[derive(Debug)]
pub struct Owner {
    /// The landing slots, once the driver made them.
    slots: Option<Vec<Slot>>,
    slot_len: u64,
    serving: Vec<Serve>,
    turn: usize,
    next_copy: CopyId,
    actions: VecDeque<OwnerAction>,
    max_requests: usize,
    timeout: Duration,
}

impl Owner {
    /// No slots yet, no request.
    pub fn new(limits: &PeerLimits) -> Self {
        Self {
            slots: None,
            slot_len: 0,
            serving: Vec::new(),
            turn: 0,
            next_copy: 1,
            actions: VecDeque::new(),
            max_requests: limits.max_staged_requests,
            timeout: limits.staged_request_timeout,
        }
    }

    /// The GPU whose requests wait for landing slots not made yet (the
    /// driver makes them, pinned with that GPU, then calls
    /// [`Owner::slots_made`] or [`Owner::slots_failed`]). Changes by
    /// [`Owner::on_request`] and those two.
    pub fn wants_slots(&self) -> Option<u32> {
        if self.slots.is_some() {
            return None;
        }
        self.serving
            .iter()
            .find(|s| s.failed.is_none())
            .map(|s| s.gpu)
    }

    /// The driver made `count` slots of `slot_len` bytes and told the peer.
    pub fn slots_made(&mut self, count: u32, slot_len: u64) {
        self.slots = Some(vec![Slot::Free; count as usize]);
        self.slot_len = slot_len;
    }

    /// The driver could not make the slots: the waiting requests fail.
    pub fn slots_failed(&mut self) {
        for s in &mut self.serving {
            s.failed.get_or_insert(status::FAILED);
        }
    }

    /// Whether nothing waits (no request, no action).
    pub fn is_idle(&self) -> bool {
        self.serving.is_empty() && self.actions.is_empty()
    }

    /// Requests held (served, or failed with a slot still theirs).
    pub fn requests(&self) -> usize {
        self.serving.len()
    }

    /// A request arrived at `now`: checked against grant table `grants`
    /// (a use of the grant taken while it runs), placed with `place`
    /// (`None`: the grant is not GPU memory, which a staged grant always
    /// is), or refused with a reply; past the bound refused BUSY.
    pub fn on_request<T>(
        &mut self,
        grants: &mut LocalGrants<T>,
        ask: StagedAsk,
        place: impl FnOnce(&T) -> Option<Placement>,
        now: Instant,
    ) {
        if self.serving.iter().any(|s| s.id == ask.id) {
            // A repeated id: the first stands (the peer's own confusion).
            return;
        }
        if self.serving.len() >= self.max_requests {
            self.reply(ask.id, status::BUSY);
            return;
        }
        let access = if ask.write {
            Access::Write
        } else {
            Access::Read
        };
        let placement = match grants.check(ask.grant, access, ask.offset, ask.len) {
            Ok(payload) => place(payload),
            Err(refusal) => {
                self.reply(ask.id, status::of_refusal(refusal));
                return;
            }
        };
        let Some(placement) = placement else {
            self.reply(ask.id, status::FAILED);
            return;
        };
        let taken: Result<&T, Refusal> = grants.begin_use(ask.grant, access, ask.offset, ask.len);
        debug_assert!(taken.is_ok(), "checked just now");
        self.serving.push(Serve {
            id: ask.id,
            grant: ask.grant,
            write: ask.write,
            gpu: placement.gpu,
            addr: placement.addr + ask.offset,
            len: ask.len,
            next: 0,
            landed: 0,
            failed: None,
            replied: false,
            cancelled: false,
            holds_use: true,
            deadline: now + self.timeout,
        });
    }

    /// The peer WROTE slice data into slot `slot` for request `id`: copied
    /// into the GPU if that slot is lent to exactly that WRITE.
    pub fn on_filled(&mut self, id: RequestId, slot: u32) {
        self.on_credit(id, slot, true);
    }

    /// The peer READ slot `slot` of request `id`: the slot is free again.
    pub fn on_done(&mut self, id: RequestId, slot: u32) {
        self.on_credit(id, slot, false);
    }

    fn on_credit(&mut self, id: RequestId, slot: u32, filled: bool) {
        let Some(serve) = self.serving.iter_mut().find(|s| s.id == id) else {
            return; // No such request here: dropped.
        };
        let lent = self
            .slots
            .as_mut()
            .and_then(|slots| match slots.get(slot as usize) {
                Some(&Slot::Lent {
                    id: lent_to,
                    offset,
                    len,
                }) if lent_to == id && serve.write == filled => Some((slots, offset, len)),
                _ => None,
            });
        let Some((slots, offset, len)) = lent else {
            serve.failed.get_or_insert(status::BAD_CREDIT);
            return;
        };
        let index = slot as usize;
        if !filled || serve.failed.is_some() {
            // Read by the requester, or data of a failed request: never
            // copied; the slot is free.
            if !filled {
                serve.landed += len;
            }
            slots[index] = Slot::Free;
            return;
        }
        let copy = Copy {
            slot,
            id,
            offset,
            len,
            to_gpu: true,
            gpu: serve.gpu,
            gpu_addr: serve.addr + offset,
        };
        slots[index] = copy.start(&mut self.next_copy, &mut self.actions);
    }

    /// The peer gave request `id` up: it ends without a reply, and the
    /// slots lent to it come back.
    pub fn on_cancel(&mut self, id: RequestId) {
        if let Some(s) = self.serving.iter_mut().find(|s| s.id == id) {
            s.cancelled = true;
            s.failed.get_or_insert(status::FAILED);
        }
        self.take_back_lent(id);
    }

    fn take_back_lent(&mut self, id: RequestId) {
        for slot in self.slots.iter_mut().flatten() {
            if matches!(*slot, Slot::Lent { id: lent_to, .. } if lent_to == id) {
                *slot = Slot::Free;
            }
        }
    }

    /// Copy `copy` ended (`ok`: it succeeded).
    pub fn copy_ended(&mut self, copy: CopyId, ok: bool) {
        let Some((index, id, offset, len)) =
            self.slots
                .iter()
                .flatten()
                .enumerate()
                .find_map(|(i, s)| match *s {
                    Slot::Copying {
                        id,
                        offset,
                        len,
                        copy: c,
                    } if c == copy => Some((i, id, offset, len)),
                    _ => None,
                })
        else {
            return;
        };
        let slots = self.slots.as_mut().expect("found in it");
        slots[index] = Slot::Free;
        let Some(serve) = self.serving.iter_mut().find(|s| s.id == id) else {
            return;
        };
        if !ok {
            serve.failed.get_or_insert(status::FAILED);
            return;
        }
        if serve.failed.is_some() {
            return;
        }
        if serve.write {
            serve.landed += len;
        } else {
            slots[index] = Slot::Lent { id, offset, len };
            self.actions.push_back(OwnerAction::SlotReady {
                id,
                offset,
                len,
                slot: index as u32,
            });
        }
    }

    /// This side is closing the connection: every request fails now and
    /// starts no copy (the copies running end on their own), and every
    /// slot lent comes back. Nothing is answered: the peer is told goodbye.
    pub fn close(&mut self) {
        let ids: Vec<RequestId> = self
            .serving
            .iter_mut()
            .map(|s| {
                s.cancelled = true;
                s.failed.get_or_insert(status::FAILED);
                s.id
            })
            .collect();
        for id in ids {
            self.take_back_lent(id);
        }
    }

    /// Whether a copy this machine asked for may still run (the driver
    /// reports each end with [`Owner::copy_ended`]).
    pub fn copying(&self) -> bool {
        self.slots
            .iter()
            .flatten()
            .any(|s| matches!(s, Slot::Copying { .. }))
    }

    /// Grant `grant` was revoked: every request under it fails now and
    /// starts no copy; the copies running end on their own, and each
    /// request's use of the grant ends once none of its copies runs.
    pub fn revoke(&mut self, grant: GrantId) {
        for s in &mut self.serving {
            if s.grant == grant {
                s.failed.get_or_insert(status::REVOKED);
            }
        }
    }

    /// Fails the requests past their deadline at `now`, taking back the
    /// slots lent to them.
    pub fn handle_timeout(&mut self, now: Instant) {
        let late: Vec<RequestId> = self
            .serving
            .iter_mut()
            .filter(|s| s.failed.is_none() && s.deadline <= now)
            .map(|s| {
                s.failed = Some(status::TIMED_OUT);
                s.id
            })
            .collect();
        for id in late {
            self.take_back_lent(id);
        }
    }

    /// The next deadline of a request still running. Changes by
    /// [`Owner::on_request`] and whatever ends or fails a request.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.serving
            .iter()
            .filter(|s| s.failed.is_none())
            .map(|s| s.deadline)
            .min()
    }

    /// Moves every request on: lends the free slots round-robin over the
    /// requests with slices left (a WRITE's slot at once, a READ's after
    /// its copy out of the GPU), answers and drops the requests that ended,
    /// and ends grant uses no copy needs any more (the payloads of grants
    /// now fenced go to `fenced`, for the driver to drop).
    pub fn step<T>(&mut self, grants: &mut LocalGrants<T>, fenced: &mut Vec<T>) {
        self.lend();
        let slots = self.slots.as_deref().unwrap_or(&[]);
        let actions = &mut self.actions;
        self.serving.retain_mut(|s| {
            let holds = slots.iter().any(|slot| slot.request() == Some(s.id));
            let copying = slots
                .iter()
                .any(|slot| matches!(*slot, Slot::Copying { id, .. } if id == s.id));
            // A failed request is answered once none of its copies runs:
            // the requester's outcome comes after the last byte this side
            // moves for it (a revoke that does not wait, a deadline).
            if let Some(status) = s.failed
                && !s.replied
                && !copying
            {
                s.replied = true;
                if !s.cancelled {
                    actions.push_back(OwnerAction::Reply { id: s.id, status });
                }
            }
            let done = s.failed.is_none() && s.landed == s.len && !holds;
            if done && s.write {
                actions.push_back(OwnerAction::Reply {
                    id: s.id,
                    status: status::OK,
                });
            }
            let keep = !done && (s.failed.is_none() || holds);
            if s.holds_use && (!keep || (s.failed.is_some() && !copying)) {
                s.holds_use = false;
                if let Some(payload) = grants.end_use(s.grant) {
                    fenced.push(payload);
                }
            }
            keep
        });
    }

    fn lend(&mut self) {
        let Some(slots) = self.slots.as_mut() else {
            return;
        };
        for (index, slot) in slots.iter_mut().enumerate() {
            if *slot != Slot::Free {
                continue;
            }
            let n = self.serving.len();
            let Some(k) = (0..n).map(|i| (self.turn + i) % n).find(|&k| {
                let s = &self.serving[k];
                s.failed.is_none() && s.next < s.len
            }) else {
                break;
            };
            self.turn = (k + 1) % n;
            let s = &mut self.serving[k];
            let (id, offset, write, gpu, addr) = (s.id, s.next, s.write, s.gpu, s.addr);
            let len = (s.len - offset).min(self.slot_len);
            s.next += len;
            let index = index as u32;
            *slot = if write {
                self.actions.push_back(OwnerAction::SlotReady {
                    id,
                    offset,
                    len,
                    slot: index,
                });
                Slot::Lent { id, offset, len }
            } else {
                let copy = Copy {
                    slot: index,
                    id,
                    offset,
                    len,
                    to_gpu: false,
                    gpu,
                    gpu_addr: addr + offset,
                };
                copy.start(&mut self.next_copy, &mut self.actions)
            };
        }
    }

    /// The next thing to do. Changes by every other method.
    pub fn poll_action(&mut self) -> Option<OwnerAction> {
        self.actions.pop_front()
    }

    fn reply(&mut self, id: RequestId, status: u32) {
        self.actions.push_back(OwnerAction::Reply { id, status });
    }
}

#[cfg(test)]
mod tests;
