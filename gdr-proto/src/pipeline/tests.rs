//! The staging pipeline in memory: a pool of slots, and copies and wire ops
//! that end when the test says, with no GPU or NIC.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;

const SLOT: u64 = 100;

/// A pool and the steps under way: (slice, is a copy).
struct World {
    free: Vec<usize>,
    running: Vec<(Slice, bool)>,
    /// Bytes that reached the far end, per offset.
    moved: Vec<(u64, u64)>,
    outcome: Vec<Result<(), PipeFailure>>,
}

impl World {
    fn new(slots: usize) -> Self {
        Self {
            free: (0..slots).rev().collect(),
            running: Vec::new(),
            moved: Vec::new(),
            outcome: Vec::new(),
        }
    }

    fn start(&mut self, pipe: &mut Pipe, max_len: impl Fn(u64) -> u64) {
        let free = &mut self.free;
        pipe.start(|| free.pop(), max_len);
        self.take(pipe);
    }

    fn take(&mut self, pipe: &mut Pipe) {
        while let Some(a) = pipe.poll_action() {
            match a {
                PipeAction::CopyOut(s) | PipeAction::CopyIn(s) => self.running.push((s, true)),
                PipeAction::Post(s) => self.running.push((s, false)),
                PipeAction::Free { slot } => {
                    assert!(!self.free.contains(&slot), "slot {slot} freed twice");
                    self.free.push(slot);
                }
            }
        }
        if let Some(o) = pipe.poll_outcome() {
            self.outcome.push(o);
        }
    }

    /// Ends the oldest step under way, `ok` or not.
    fn end_one(&mut self, pipe: &mut Pipe, write: bool, ok: bool) -> bool {
        if self.running.is_empty() {
            return false;
        }
        let (s, copy) = self.running.remove(0);
        // The far end: the wire for a WRITE, the GPU for a READ.
        if ok && (write != copy) {
            self.moved.push((s.offset, s.len));
        }
        if copy {
            pipe.copy_ended(s.id, ok);
        } else {
            pipe.wire_ended(s.id, ok);
        }
        self.take(pipe);
        true
    }
}

fn run(pipe: &mut Pipe, w: &mut World, write: bool) {
    loop {
        w.start(pipe, |_| SLOT);
        if !w.end_one(pipe, write, true) {
            break;
        }
    }
}

#[test]
fn a_write_goes_slice_by_slice_copy_then_wire_and_ends_ok_once() {
    let t0 = Instant::now();
    let mut pipe = Pipe::new(true, 450, t0 + Duration::from_secs(1));
    let mut w = World::new(2);
    w.start(&mut pipe, |_| SLOT);
    assert_eq!(
        w.running
            .iter()
            .map(|(s, c)| (s.offset, *c))
            .collect::<Vec<_>>(),
        [(0, true), (100, true)],
        "two slots: two slices copied out at once"
    );
    run(&mut pipe, &mut w, true);
    w.moved.sort();
    assert_eq!(
        w.moved,
        [(0, 100), (100, 100), (200, 100), (300, 100), (400, 50)]
    );
    assert_eq!(w.outcome, [Ok(())]);
    assert_eq!(w.free.len(), 2, "every slot back");
    assert_eq!(pipe.poll_outcome(), None, "once");
}

#[test]
fn a_read_goes_wire_then_copy_in() {
    let t0 = Instant::now();
    let mut pipe = Pipe::new(false, 250, t0 + Duration::from_secs(1));
    let mut w = World::new(1);
    w.start(&mut pipe, |_| SLOT);
    assert!(matches!(w.running[..], [(_, false)]), "on the wire first");
    run(&mut pipe, &mut w, false);
    w.moved.sort();
    assert_eq!(w.moved, [(0, 100), (100, 100), (200, 50)]);
    assert_eq!(w.outcome, [Ok(())]);
}

#[test]
fn slices_never_cross_the_bound_the_driver_gives() {
    let t0 = Instant::now();
    let mut pipe = Pipe::new(true, 300, t0 + Duration::from_secs(1));
    let mut w = World::new(8);
    // A remote segment ends at 130.
    w.start(&mut pipe, |offset| {
        if offset < 130 {
            (130 - offset).min(SLOT)
        } else {
            SLOT
        }
    });
    let mut starts: Vec<(u64, u64)> = w.running.iter().map(|(s, _)| (s.offset, s.len)).collect();
    starts.sort();
    assert_eq!(starts, [(0, 100), (100, 30), (130, 100), (230, 70)]);
}

#[test]
fn a_failed_copy_fails_the_transfer_after_its_slices_drain() {
    let t0 = Instant::now();
    let mut pipe = Pipe::new(true, 1000, t0 + Duration::from_secs(1));
    let mut w = World::new(3);
    w.start(&mut pipe, |_| SLOT);
    w.end_one(&mut pipe, true, false);
    assert!(pipe.is_failing());
    w.start(&mut pipe, |_| SLOT);
    assert_eq!(w.running.len(), 2, "no slice starts after the failure");
    assert!(w.outcome.is_empty(), "not before the others drained");
    while w.end_one(&mut pipe, true, true) {}
    assert!(
        w.moved.is_empty(),
        "a slice copied out after the failure never goes on the wire"
    );
    assert_eq!(w.outcome, [Err(PipeFailure::Failed)]);
    assert_eq!(w.free.len(), 3);
}

#[test]
fn past_the_deadline_nothing_new_starts_and_it_ends_timed_out() {
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_millis(5);
    let mut pipe = Pipe::new(false, 1000, deadline);
    let mut w = World::new(2);
    w.start(&mut pipe, |_| SLOT);
    pipe.handle_timeout(t0);
    assert!(!pipe.is_failing());
    pipe.handle_timeout(deadline);
    while w.end_one(&mut pipe, false, true) {}
    assert!(w.moved.is_empty(), "no copy in after the deadline");
    assert_eq!(w.outcome, [Err(PipeFailure::TimedOut)]);
}

#[test]
fn the_first_failure_is_the_one_it_ends_with() {
    let mut pipe = Pipe::new(true, 100, Instant::now() + Duration::from_secs(1));
    let mut w = World::new(1);
    w.start(&mut pipe, |_| SLOT);
    pipe.fail(PipeFailure::Cancelled);
    pipe.fail(PipeFailure::PeerGone);
    while w.end_one(&mut pipe, true, true) {}
    assert_eq!(w.outcome, [Err(PipeFailure::Cancelled)]);
}

#[test]
fn a_report_for_an_unknown_slice_changes_nothing() {
    let mut pipe = Pipe::new(true, 100, Instant::now() + Duration::from_secs(1));
    pipe.copy_ended(42, false);
    pipe.wire_ended(42, false);
    assert!(!pipe.is_failing());
    assert_eq!(pipe.poll_action(), None);
}

proptest! {
    /// Any order of endings, failures, cancels and deadlines: a slot is
    /// never handed out twice or freed twice, every slot comes back, the
    /// transfer ends exactly once, and `Ok` means every byte moved once.
    #[test]
    fn every_pipe_ends_once_with_every_slot_back(
        write in any::<bool>(),
        len in 1u64..1000,
        slots in 1usize..4,
        events in prop::collection::vec(0u8..12, 0..80),
    ) {
        let t0 = Instant::now();
        let mut pipe = Pipe::new(write, len, t0 + Duration::from_millis(30));
        let mut w = World::new(slots);
        let mut now = t0;
        for e in events.into_iter().chain(std::iter::repeat_n([9u8, 1], 200).flatten()) {
            match e {
                0 => { w.end_one(&mut pipe, write, false); }
                1..=6 => { w.end_one(&mut pipe, write, true); }
                7 => pipe.fail(PipeFailure::Cancelled),
                8 => { now += Duration::from_millis(10); pipe.handle_timeout(now); }
                _ => w.start(&mut pipe, |_| SLOT),
            }
            let mut held: Vec<usize> = w.running.iter().map(|(s, _)| s.slot).collect();
            held.sort();
            held.dedup();
            prop_assert_eq!(held.len(), w.running.len(), "a slot carries two slices");
            prop_assert!(held.iter().all(|s| !w.free.contains(s)), "a busy slot is free");
            w.take(&mut pipe);
        }
        prop_assert_eq!(w.outcome.len(), 1, "outcomes {:?}", w.outcome);
        prop_assert_eq!(w.free.len(), slots, "every slot back");
        w.moved.sort();
        let mut at = 0;
        let mut total = 0;
        for &(o, n) in &w.moved {
            prop_assert!(o >= at, "a byte moved twice");
            at = o + n;
            total += n;
        }
        if w.outcome[0].is_ok() {
            prop_assert_eq!(total, len, "Ok with bytes missing");
        }
    }
}
