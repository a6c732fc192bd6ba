//! The slotted rendezvous end to end in memory: a [`Requester`] and an
//! [`Owner`] (quinn-proto's two-endpoint `Pair`), joined by two message
//! queues, each with its memory, and a GPU whose copies end when told.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::grants::{Revoked, Rights, Terms};

const GRANT: GrantId = 4;
const SLOT: u64 = 4096;
const BASE: u64 = 0x9000_0000;

/// A message from the requester to the owner.
#[derive(Debug, Clone, Copy)]
enum ToOwner {
    Request(StagedAsk),
    Filled { id: RequestId, slot: u32 },
    Done { id: RequestId, slot: u32 },
    Cancel { id: RequestId },
}

/// A message from the owner to the requester.
#[derive(Debug, Clone, Copy)]
enum ToRequester {
    Ready {
        id: RequestId,
        offset: u64,
        len: u64,
        slot: u32,
    },
    Reply {
        id: RequestId,
        status: u32,
    },
}

struct Pair {
    now: Instant,
    requester: Requester,
    owner: Owner,
    grants: LocalGrants<&'static str>,
    fenced: Vec<&'static str>,
    /// The requester's memory, and the owner's granted GPU memory.
    local: Vec<u8>,
    granted: Vec<u8>,
    slots: Vec<Vec<u8>>,
    to_owner: VecDeque<ToOwner>,
    to_requester: VecDeque<ToRequester>,
    /// The owner's copies running: (copy, slot, to_gpu, gpu offset, len).
    copies: VecDeque<(CopyId, u32, bool, u64, u64)>,
    /// Whether the owner's GPU runs its copies.
    gpu_runs: bool,
    /// Whether the requester moves the slices it is lent.
    requester_moves: bool,
    ended: Vec<(RequestId, Result<(), AskFailure>)>,
    /// Each request's direction (a WRITE when true).
    writes: std::collections::HashMap<RequestId, bool>,
    /// Bytes of the granted memory the owner's copies wrote after the
    /// grant was fenced (must stay 0).
    written_after_fence: u64,
}

impl Pair {
    fn new(len: u64, slots: u32) -> Self {
        let mut grants = LocalGrants::default();
        grants.insert(
            GRANT,
            Terms {
                len,
                rights: Rights::ReadWrite,
            },
            "region",
        );
        let limits = PeerLimits {
            max_staged_requests: 4,
            staged_request_timeout: Duration::from_secs(2),
            ..PeerLimits::default()
        };
        let mut owner = Owner::new(&limits);
        owner.slots_made(slots, SLOT);
        let mut requester = Requester::new(1000);
        requester.on_slots(SLOT, slots);
        Self {
            now: Instant::now(),
            requester,
            owner,
            grants,
            fenced: Vec::new(),
            local: (0..len).map(|i| (i % 251) as u8).collect(),
            granted: vec![0; len as usize],
            slots: vec![vec![0; SLOT as usize]; slots as usize],
            to_owner: VecDeque::new(),
            to_requester: VecDeque::new(),
            copies: VecDeque::new(),
            gpu_runs: true,
            requester_moves: true,
            ended: Vec::new(),
            writes: Default::default(),
            written_after_fence: 0,
        }
    }

    fn ask(&mut self, write: bool, len: u64, timeout: Duration) -> RequestId {
        let id = self.requester.start(write, len, self.now, timeout);
        self.writes.insert(id, write);
        self.to_owner.push_back(ToOwner::Request(StagedAsk {
            id,
            grant: GRANT,
            offset: 0,
            len,
            write,
        }));
        id
    }

    fn fenced(&self) -> bool {
        self.grants.is_fenced(GRANT)
    }

    /// One step of each side, messages delivered in order.
    fn step(&mut self) {
        // The owner.
        while let Some(m) = self.to_owner.pop_front() {
            match m {
                ToOwner::Request(ask) => self.owner.on_request(
                    &mut self.grants,
                    ask,
                    |_| Some(Placement { gpu: 0, addr: BASE }),
                    self.now,
                ),
                ToOwner::Filled { id, slot } => self.owner.on_filled(id, slot),
                ToOwner::Done { id, slot } => self.owner.on_done(id, slot),
                ToOwner::Cancel { id } => self.owner.on_cancel(id),
            }
        }
        if self.gpu_runs {
            while let Some((copy, slot, to_gpu, at, len)) = self.copies.pop_front() {
                let (at, len) = (at as usize, len as usize);
                let slot = &mut self.slots[slot as usize];
                if to_gpu {
                    if self.grants.is_fenced(GRANT) {
                        self.written_after_fence += len as u64;
                    }
                    self.granted[at..at + len].copy_from_slice(&slot[..len]);
                } else {
                    slot[..len].copy_from_slice(&self.granted[at..at + len]);
                }
                self.owner.copy_ended(copy, true);
            }
        }
        self.owner.handle_timeout(self.now);
        self.owner.step(&mut self.grants, &mut self.fenced);
        while let Some(action) = self.owner.poll_action() {
            match action {
                OwnerAction::Reply { id, status } => self
                    .to_requester
                    .push_back(ToRequester::Reply { id, status }),
                OwnerAction::SlotReady {
                    id,
                    offset,
                    len,
                    slot,
                } => self.to_requester.push_back(ToRequester::Ready {
                    id,
                    offset,
                    len,
                    slot,
                }),
                OwnerAction::Copy {
                    copy,
                    slot,
                    to_gpu,
                    gpu_addr,
                    len,
                    ..
                } => self
                    .copies
                    .push_back((copy, slot, to_gpu, gpu_addr - BASE, len)),
            }
        }
        // The requester.
        while let Some(m) = self.to_requester.pop_front() {
            match m {
                ToRequester::Ready {
                    id,
                    offset,
                    len,
                    slot,
                } => self.requester.on_ready(id, offset, len, slot),
                ToRequester::Reply { id, status } => self.requester.on_reply(id, status),
            }
        }
        self.requester.handle_timeout(self.now);
        self.requester.step();
        while let Some(action) = self.requester.poll_action() {
            match action {
                RequesterAction::Move {
                    id,
                    slot,
                    offset,
                    len,
                } => {
                    if !self.requester_moves {
                        continue;
                    }
                    let (o, n) = (offset as usize, len as usize);
                    // Every request is at offset 0 of the grant and of the
                    // requester's memory.
                    let write = self.writes[&id];
                    let slot_mem = &mut self.slots[slot as usize];
                    if write {
                        slot_mem[..n].copy_from_slice(&self.local[o..o + n]);
                    } else {
                        self.local[o..o + n].copy_from_slice(&slot_mem[..n]);
                    }
                    self.requester.wired(id, slot);
                    self.requester.slice_ended(id, slot, len, true);
                }
                RequesterAction::Filled { id, slot } => {
                    self.to_owner.push_back(ToOwner::Filled { id, slot })
                }
                RequesterAction::Done { id, slot } => {
                    self.to_owner.push_back(ToOwner::Done { id, slot })
                }
                RequesterAction::Cancel { id } => self.to_owner.push_back(ToOwner::Cancel { id }),
                RequesterAction::End { id, outcome } => self.ended.push((id, outcome)),
            }
        }
        self.requester.step();
        while let Some(action) = self.requester.poll_action() {
            match action {
                RequesterAction::Cancel { id } => self.to_owner.push_back(ToOwner::Cancel { id }),
                RequesterAction::End { id, outcome } => self.ended.push((id, outcome)),
                other => panic!("{other:?} after a step with no input"),
            }
        }
    }

    fn run(&mut self, steps: usize) {
        for _ in 0..steps {
            self.step();
        }
    }
}

#[test]
fn a_write_through_the_slots_lands_whole_and_ends_ok_once() {
    let len = 5 * SLOT + 100;
    let mut pair = Pair::new(len, 2);
    let id = pair.ask(true, len, Duration::from_secs(5));
    pair.run(20);
    assert_eq!(pair.ended, [(id, Ok(()))]);
    assert!(pair.granted == pair.local, "the owner's memory");
    assert!(pair.requester.is_idle() && pair.owner.is_idle());
    assert_eq!(pair.grants.revoke(GRANT), Revoked::Fenced("region"));
}

#[test]
fn a_revoke_mid_transfer_fails_the_write_and_nothing_lands_after_the_fence() {
    let len = 8 * SLOT;
    let mut pair = Pair::new(len, 2);
    let id = pair.ask(true, len, Duration::from_secs(5));
    pair.run(2);
    // The revoke, as the engine does it: the table, then the requests.
    let revoked = pair.grants.revoke(GRANT);
    pair.owner.revoke(GRANT);
    assert!(
        matches!(revoked, Revoked::Draining { .. }),
        "a copy was under way"
    );
    pair.run(20);
    assert!(pair.fenced(), "fenced once its copies ended");
    assert_eq!(pair.written_after_fence, 0);
    assert_eq!(
        pair.ended,
        [(id, Err(AskFailure::Refused(status::REVOKED)))]
    );
    assert!(pair.granted != pair.local, "the revoke stopped it");
    assert!(pair.requester.is_idle() && pair.owner.is_idle());
}

#[test]
fn a_requester_that_never_moves_is_timed_out_by_the_owner_and_told() {
    let mut pair = Pair::new(4 * SLOT, 2);
    pair.requester_moves = false;
    let id = pair.ask(true, 4 * SLOT, Duration::from_secs(60));
    pair.run(2);
    assert!(pair.ended.is_empty());
    pair.now += Duration::from_secs(3);
    pair.run(3);
    assert!(pair.owner.is_idle(), "the owner holds nothing of it");
    assert!(
        pair.requester.is_failing(id),
        "the requester was answered (TIMED_OUT)"
    );
    assert!(pair.ended.is_empty(), "its slices never ended");
}

#[test]
fn a_silent_owner_times_the_request_out_and_is_told_to_cancel() {
    let mut pair = Pair::new(4 * SLOT, 2);
    pair.gpu_runs = false;
    let id = pair.ask(true, 4 * SLOT, Duration::from_millis(100));
    pair.run(2);
    pair.now += Duration::from_millis(100);
    pair.run(1);
    assert_eq!(pair.ended, [(id, Err(AskFailure::TimedOut))]);
    assert!(pair.requester.is_idle());
    pair.gpu_runs = true;
    pair.run(5);
    assert!(pair.owner.is_idle(), "the cancel gave every slot back");
}

#[test]
fn a_cancel_crossing_a_credit_moves_nothing_more_and_the_owner_takes_its_slots_back() {
    let mut pair = Pair::new(6 * SLOT, 2);
    let id = pair.ask(true, 6 * SLOT, Duration::from_secs(5));
    // Cancelled while the request is on its way: the owner's credits
    // cross the cancel.
    pair.requester.fail(id, AskFailure::Cancelled);
    let before = pair.granted.clone();
    pair.run(10);
    assert_eq!(pair.ended, [(id, Err(AskFailure::Cancelled))]);
    assert!(pair.requester.is_idle() && pair.owner.is_idle());
    assert!(pair.granted == before, "a slice moved after the cancel");
}

#[test]
fn a_credit_outside_the_slots_or_for_a_busy_slot_fails_the_request() {
    let t0 = Instant::now();
    for (offset, len, slot) in [
        (0, SLOT + 1, 0),  // longer than a slot
        (0, 10, 2),        // no such slot
        (SLOT * 4, 10, 0), // past the request
        (0, 0, 0),         // empty
    ] {
        let mut r = Requester::new(0);
        r.on_slots(SLOT, 2);
        let id = r.start(true, 4 * SLOT, t0, Duration::from_secs(1));
        r.on_ready(id, offset, len, slot);
        r.step();
        let actions: Vec<_> = std::iter::from_fn(|| r.poll_action()).collect();
        assert_eq!(
            actions,
            [
                RequesterAction::Cancel { id },
                RequesterAction::End {
                    id,
                    outcome: Err(AskFailure::BadCredit { slot, offset, len })
                }
            ]
        );
    }
    // A slot lent twice before its slice's wire op ended: one slice at a
    // time per slot, so a hostile owner cannot make this side hold more
    // slices than it lent slots.
    let mut r = Requester::new(0);
    r.on_slots(SLOT, 2);
    let a = r.start(true, 4 * SLOT, t0, Duration::from_secs(1));
    let b = r.start(true, 4 * SLOT, t0, Duration::from_secs(1));
    r.on_ready(a, 0, SLOT, 1);
    r.on_ready(b, 0, SLOT, 1);
    assert!(!r.is_failing(a));
    assert!(r.is_failing(b), "the second credit for a busy slot");
    // Once the wire op ended, the slot may be lent again.
    r.wired(a, 1);
    let c = r.start(true, 4 * SLOT, t0, Duration::from_secs(1));
    r.on_ready(c, 0, SLOT, 1);
    assert!(!r.is_failing(c));
}

#[test]
fn a_credit_for_an_unknown_or_ended_request_changes_nothing() {
    let mut r = Requester::new(0);
    r.on_slots(SLOT, 2);
    r.on_ready(77, 0, 10, 0);
    r.on_reply(77, status::OK);
    r.step();
    assert_eq!(r.poll_action(), None);
    assert!(r.is_idle());
}

#[test]
fn a_gone_peer_fails_every_request_without_telling_it() {
    let t0 = Instant::now();
    let mut r = Requester::new(0);
    r.on_slots(SLOT, 2);
    let id = r.start(false, SLOT, t0, Duration::from_secs(1));
    r.on_ready(id, 0, SLOT, 0);
    r.peer_gone();
    r.step();
    assert_eq!(
        r.poll_action()
            .map(|a| matches!(a, RequesterAction::Move { .. })),
        Some(true)
    );
    assert_eq!(r.poll_action(), None, "not over while its slice moves");
    r.wired(id, 0);
    r.slice_ended(id, 0, SLOT, true);
    r.step();
    let actions: Vec<_> = std::iter::from_fn(|| r.poll_action()).collect();
    assert_eq!(
        actions,
        [
            RequesterAction::Done { id, slot: 0 },
            RequesterAction::End {
                id,
                outcome: Err(AskFailure::PeerGone)
            }
        ],
        "no cancel to a gone peer"
    );
}

#[test]
fn a_write_answered_before_every_slice_moved_is_incomplete() {
    let t0 = Instant::now();
    let mut r = Requester::new(0);
    r.on_slots(SLOT, 2);
    let id = r.start(true, 2 * SLOT, t0, Duration::from_secs(1));
    r.on_reply(id, status::OK);
    r.step();
    let actions: Vec<_> = std::iter::from_fn(|| r.poll_action()).collect();
    assert_eq!(
        actions,
        [RequesterAction::End {
            id,
            outcome: Err(AskFailure::Incomplete)
        }]
    );
}

proptest! {
    /// Requests of random sizes, a revoke, a cancel, a stalled GPU and
    /// the time moving at random: every request ends exactly once, `Ok`
    /// only with every byte landed, nothing lands after the fence, and
    /// both sides end idle.
    #[test]
    fn every_request_ends_once_and_nothing_lands_after_the_fence(
        lens in prop::collection::vec(1u64..6 * SLOT, 1..4),
        events in prop::collection::vec(0u8..8, 0..30),
    ) {
        let total = 6 * SLOT;
        let mut pair = Pair::new(total, 2);
        let ids: Vec<RequestId> = lens
            .iter()
            .map(|&len| pair.ask(true, len, Duration::from_millis(500)))
            .collect();
        for e in events {
            match e {
                0 => {
                    if pair.grants.is_live(GRANT) {
                        pair.grants.revoke(GRANT);
                        pair.owner.revoke(GRANT);
                    }
                }
                1 => pair.requester.fail(ids[0], AskFailure::Cancelled),
                2 => pair.gpu_runs = !pair.gpu_runs,
                3 => pair.now += Duration::from_millis(200),
                _ => pair.step(),
            }
        }
        pair.gpu_runs = true;
        pair.now += Duration::from_secs(5);
        pair.run(10);
        prop_assert_eq!(pair.written_after_fence, 0);
        for id in &ids {
            let ends: Vec<_> = pair.ended.iter().filter(|(i, _)| i == id).collect();
            prop_assert_eq!(ends.len(), 1, "request {} ended {:?}", id, ends);
        }
        prop_assert!(pair.requester.is_idle(), "requester holds a request");
        prop_assert!(pair.owner.is_idle(), "owner holds a request");
        let fenced = pair.fenced();
        for (i, id) in ids.iter().enumerate() {
            let outcome = pair.ended.iter().find(|(x, _)| x == id).unwrap().1;
            if outcome.is_ok() && !fenced {
                let n = lens[i] as usize;
                prop_assert!(pair.granted[..n] == pair.local[..n], "Ok with bytes missing");
            }
        }
    }
}

#[test]
fn a_timeout_past_what_an_instant_holds_never_passes() {
    let t0 = Instant::now();
    let mut r = Requester::new(0);
    let id = r.start(true, SLOT, t0, Duration::MAX);
    r.handle_timeout(t0 + Duration::from_secs(1 << 30));
    assert!(!r.is_failing(id));
    assert_eq!(r.poll_timeout(), None);
}
