//! A connection's control receive slots: where each is posted and in which
//! order, so that their completions are taken in that order whichever
//! threads polled them.
//!
//! A queue pair's receives complete in the order they were posted (RC),
//! but a CQ polled by several threads hands its completions out in runs,
//! and each thread hands its run to the peer when it gets there: the
//! peer sees them in either order. [`PostedReceives::complete`] keeps a
//! completion that came before one posted earlier on its queue until that
//! one came, and hands out every completion in turn, in posting order.
//! Bounded by the slots: a slot completes once per post.

/// The driver's receive slots (`Q`: which queue a slot is posted on; `T`:
/// a completion as the driver keeps it).
#[derive(Debug)]
pub struct PostedReceives<Q, T> {
    slots: Vec<Option<Posted<Q>>>,
    /// Receives posted so far: the next one's place in the order.
    posted: u64,
    /// Completions that came before one posted earlier on their queue.
    early: Vec<(usize, T)>,
}

#[derive(Debug, Clone, Copy)]
struct Posted<Q> {
    queue: Q,
    seq: u64,
    /// Its completion was handed out (its slot stays posted until
    /// [`PostedReceives::release`]).
    taken: bool,
}

impl<Q: Copy + Eq, T> PostedReceives<Q, T> {
    /// `slots` receive slots, none posted.
    pub fn new(slots: usize) -> Self {
        Self {
            slots: (0..slots).map(|_| None).collect(),
            posted: 0,
            early: Vec::new(),
        }
    }

    /// The slots not posted, in index order.
    pub fn free(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| self.slots[i].is_none())
            .collect()
    }

    /// Slot `slot` was posted on `queue` (after every slot posted before).
    pub fn post(&mut self, slot: usize, queue: Q) {
        if let Some(s) = self.slots.get_mut(slot) {
            *s = Some(Posted {
                queue,
                seq: self.posted,
                taken: false,
            });
            self.posted += 1;
        }
    }

    /// Whether slot `slot` is posted on `queue`.
    pub fn is_posted_on(&self, slot: usize, queue: Q) -> bool {
        matches!(self.slots.get(slot), Some(Some(p)) if p.queue == queue)
    }

    /// Whether any slot is still posted on `queue` (its completion not
    /// released).
    pub fn any_posted_on(&self, queue: Q) -> bool {
        self.slots.iter().flatten().any(|p| p.queue == queue)
    }

    /// Slot `slot`'s completion `completion` came from `queue`: the
    /// completions now in turn, in their queue's posting order (this one
    /// and those that came early), each marked taken. One of a slot not
    /// posted on `queue`, or already taken, is dropped.
    pub fn complete(&mut self, slot: usize, queue: Q, completion: T) -> Vec<(usize, T)> {
        let fresh = matches!(self.slots.get(slot), Some(Some(p)) if p.queue == queue && !p.taken);
        if !fresh || self.early.iter().any(|(s, _)| *s == slot) {
            return Vec::new();
        }
        self.early.push((slot, completion));
        let mut in_turn = Vec::new();
        while let Some(next) = self.early.iter().position(|(s, _)| self.in_turn(*s)) {
            let (slot, completion) = self.early.swap_remove(next);
            if let Some(Some(p)) = self.slots.get_mut(slot) {
                p.taken = true;
            }
            in_turn.push((slot, completion));
        }
        in_turn
    }

    /// Whether slot `slot`'s completion is the next of its queue's: no
    /// receive posted before it there is still to be handed out.
    fn in_turn(&self, slot: usize) -> bool {
        let Some(Some(this)) = self.slots.get(slot) else {
            return false;
        };
        !self
            .slots
            .iter()
            .flatten()
            .any(|p| p.queue == this.queue && !p.taken && p.seq < this.seq)
    }

    /// Slot `slot` is free to post again (its completion was handled).
    pub fn release(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            *s = None;
        }
    }

    /// Completions waiting for one posted before them.
    pub fn early_len(&self) -> usize {
        self.early.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slots 0..n posted in order on `queue`.
    fn posted(n: usize, queue: u32) -> PostedReceives<u32, &'static str> {
        let mut r = PostedReceives::new(n);
        for slot in 0..n {
            r.post(slot, queue);
        }
        r
    }

    #[test]
    fn completions_that_come_early_wait_for_those_posted_before() {
        let mut r = posted(3, 7);
        assert!(r.complete(2, 7, "c").is_empty());
        assert!(r.complete(1, 7, "b").is_empty());
        assert_eq!(r.early_len(), 2);
        assert_eq!(r.complete(0, 7, "a"), [(0, "a"), (1, "b"), (2, "c")]);
        assert_eq!(r.early_len(), 0);
    }

    #[test]
    fn a_slot_reposted_goes_behind_those_posted_before_it() {
        let mut r = posted(2, 7);
        assert_eq!(r.complete(0, 7, "a"), [(0, "a")]);
        r.release(0);
        assert_eq!(r.free(), [0]);
        r.post(0, 7);
        // Slot 0 now comes after slot 1.
        assert!(r.complete(0, 7, "c").is_empty());
        assert_eq!(r.complete(1, 7, "b"), [(1, "b"), (0, "c")]);
    }

    #[test]
    fn each_queue_keeps_its_own_order() {
        let mut r = PostedReceives::new(4);
        r.post(0, 1);
        r.post(1, 2);
        r.post(2, 1);
        r.post(3, 2);
        // Queue 2's first is not held behind queue 1's.
        assert_eq!(r.complete(1, 2, "q2 first"), [(1, "q2 first")]);
        assert!(r.complete(2, 1, "q1 second").is_empty());
        assert_eq!(
            r.complete(0, 1, "q1 first"),
            [(0, "q1 first"), (2, "q1 second")]
        );
        assert!(r.any_posted_on(2));
        r.release(1);
        assert_eq!(r.complete(3, 2, "q2 second"), [(3, "q2 second")]);
        r.release(3);
        assert!(!r.any_posted_on(2));
    }

    #[test]
    fn a_completion_of_a_slot_not_posted_there_or_taken_is_dropped() {
        let mut r = posted(2, 7);
        assert!(r.complete(0, 8, "other queue").is_empty());
        assert_eq!(r.complete(0, 7, "a"), [(0, "a")]);
        assert!(r.complete(0, 7, "again").is_empty());
        assert!(r.complete(1, 7, "b").len() == 1);
        assert!(r.complete(1, 7, "b twice").is_empty());
        assert_eq!(r.early_len(), 0);
    }
}
