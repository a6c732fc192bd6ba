//! The staging pipeline's protocol: a transfer of GPU memory no NIC reaches,
//! against a peer's direct grant, cut into slices that each borrow a slot
//! of a pinned bounce pool, so that copies and the wire overlap.
//!
//! A WRITE slice is copied out of the GPU into its slot, then goes on the
//! wire from it; a READ slice goes on the wire into its slot, then is
//! copied into the GPU. Its slot is free once its last step ended. The
//! driver owns the pool, the streams and the queue pairs; [`Pipe`] decides
//! which slice starts (while the driver has free slots), what each does
//! next, and how the transfer ends:
//! - a failure (a copy, the wire, the deadline, a cancel, the peer) starts
//!   no new slice and no next step; the transfer ends once its slices in
//!   flight have drained (their slots freed), exactly once;
//! - `Ok` only once every byte went through.

use std::collections::VecDeque;
use std::time::Instant;

/// One slice: `len` bytes at `offset` of the transfer, through pool slot
/// `slot`; `id` names it in reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    /// The slice, within its pipe.
    pub id: u64,
    /// Offset in the transfer.
    pub offset: u64,
    /// Bytes, nonzero.
    pub len: u64,
    /// The pool slot it borrows.
    pub slot: usize,
}

/// What the driver is to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipeAction {
    /// Copy the slice from the GPU into its slot (a WRITE); report with
    /// [`Pipe::copy_ended`].
    CopyOut(Slice),
    /// Put the slice on the wire (WRITE from its slot, or READ into it);
    /// report with [`Pipe::wire_ended`].
    Post(Slice),
    /// Copy the slice from its slot into the GPU (a READ); report with
    /// [`Pipe::copy_ended`].
    CopyIn(Slice),
    /// The slot is free again.
    Free {
        /// The slot.
        slot: usize,
    },
}

/// Why a pipe failed (the driver keeps the details of its own failures).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipeFailure {
    /// A copy or a wire op failed.
    Failed,
    /// The deadline passed.
    TimedOut,
    /// The caller cancelled it.
    Cancelled,
    /// The peer is gone.
    PeerGone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    CopyingOut,
    OnWire,
    CopyingIn,
}

/// One staged transfer going through its GPU's pool.
#[derive(Debug)]
pub struct Pipe {
    write: bool,
    len: u64,
    /// The next offset to start a slice at.
    next: u64,
    next_id: u64,
    slices: Vec<(Slice, Stage)>,
    failure: Option<PipeFailure>,
    deadline: Instant,
    ended: bool,
    actions: VecDeque<PipeAction>,
}

impl Pipe {
    /// A transfer of `len` bytes (a WRITE when `write`), due by `deadline`.
    pub fn new(write: bool, len: u64, deadline: Instant) -> Self {
        Self {
            write,
            len,
            next: 0,
            next_id: 0,
            slices: Vec::new(),
            failure: None,
            deadline,
            ended: false,
            actions: VecDeque::new(),
        }
    }

    /// Whether it failed (nothing new of it starts).
    pub fn is_failing(&self) -> bool {
        self.failure.is_some()
    }

    /// Starts slices while `take_slot` gives a free slot; `max_len(offset)`
    /// bounds a slice starting there (the slot's size, the remote
    /// segment's end). Returns how many started.
    pub fn start(
        &mut self,
        mut take_slot: impl FnMut() -> Option<usize>,
        max_len: impl Fn(u64) -> u64,
    ) -> usize {
        let mut started = 0;
        while self.failure.is_none() && self.next < self.len {
            let Some(slot) = take_slot() else { break };
            let offset = self.next;
            let len = (self.len - offset).min(max_len(offset).max(1));
            self.next_id += 1;
            let slice = Slice {
                id: self.next_id,
                offset,
                len,
                slot,
            };
            self.next += len;
            let (stage, action) = if self.write {
                (Stage::CopyingOut, PipeAction::CopyOut(slice))
            } else {
                (Stage::OnWire, PipeAction::Post(slice))
            };
            self.slices.push((slice, stage));
            self.actions.push_back(action);
            started += 1;
        }
        started
    }

    fn take(&mut self, id: u64) -> Option<(Slice, Stage)> {
        let at = self.slices.iter().position(|(s, _)| s.id == id)?;
        Some(self.slices.swap_remove(at))
    }

    /// Slice `id`'s copy ended (`ok`: it succeeded).
    pub fn copy_ended(&mut self, id: u64, ok: bool) {
        let Some((slice, stage)) = self.take(id) else {
            return;
        };
        if !ok {
            self.failure.get_or_insert(PipeFailure::Failed);
        }
        match stage {
            Stage::CopyingOut if self.failure.is_none() => {
                self.slices.push((slice, Stage::OnWire));
                self.actions.push_back(PipeAction::Post(slice));
            }
            _ => self
                .actions
                .push_back(PipeAction::Free { slot: slice.slot }),
        }
    }

    /// Slice `id`'s wire op ended (`ok`: it succeeded).
    pub fn wire_ended(&mut self, id: u64, ok: bool) {
        let Some((slice, _)) = self.take(id) else {
            return;
        };
        if !ok {
            self.failure.get_or_insert(PipeFailure::Failed);
        }
        if !self.write && self.failure.is_none() {
            self.slices.push((slice, Stage::CopyingIn));
            self.actions.push_back(PipeAction::CopyIn(slice));
        } else {
            self.actions
                .push_back(PipeAction::Free { slot: slice.slot });
        }
    }

    /// It fails (first reason wins): no new slice or step starts.
    pub fn fail(&mut self, why: PipeFailure) {
        self.failure.get_or_insert(why);
    }

    /// Fails it if its deadline passed by `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        if now >= self.deadline {
            self.fail(PipeFailure::TimedOut);
        }
    }

    /// The next thing to do. Changes after every other call.
    pub fn poll_action(&mut self) -> Option<PipeAction> {
        self.actions.pop_front()
    }

    /// How it ended, handed out once: when nothing of it is in flight (its
    /// slots all freed) and every byte went through or it failed.
    pub fn poll_outcome(&mut self) -> Option<Result<(), PipeFailure>> {
        let over = self.slices.is_empty()
            && self.actions.is_empty()
            && (self.next >= self.len || self.failure.is_some());
        if self.ended || !over {
            return None;
        }
        self.ended = true;
        Some(match self.failure {
            Some(why) => Err(why),
            None => Ok(()),
        })
    }
}

#[cfg(test)]
mod tests;
