//! The slotted rendezvous with both ends running (quinn-proto's `Pair`),
//! through the crate's public API only: a [`Requester`] and an [`Owner`]
//! whose messages are encoded with `wire` and carried by links that can
//! delay, drop, rewrite or cut them. The driver's part is played on plain
//! memories: the requester's RDMA ops between its memory and the owner's
//! landing slots, the owner's copies between the slots and its GPU memory,
//! each device running as much of its queue as the test lets it. So each
//! test checks which bytes landed where, and that nothing else changed.
//! Time is the pair's `now`.

mod common;

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use common::{Link, ended_once, with};
use gdr_proto::PeerLimits;
use gdr_proto::grants::{LocalGrants, Revoked, Rights, Terms};
use gdr_proto::rendezvous::{
    AskFailure, CopyId, Owner, OwnerAction, Placement, RequestId, Requester, RequesterAction,
    StagedAsk, status,
};
use gdr_proto::wire::Control;

/// The owner's staged grant to the requester.
const GRANT: u64 = 7;
const GRANT_LEN: u64 = 10 * SLOT;
/// Landing slots: fewer than the slices of most requests here.
const SLOT: u64 = 4096;
const SLOTS: u32 = 2;
/// Bytes around every memory here that nothing may ever write.
const GUARD: usize = 4096;
/// The device address of the owner's GPU memory (the grant starts
/// [`GUARD`] bytes into it).
const GPU_BASE: u64 = 0x7000_0000;
/// The requester's registered memory.
const LOCAL_LEN: usize = 16 * SLOT as usize;
const MAX_STAGED: usize = 4;
/// The owner's deadline for a staged request.
const DEADLINE: Duration = Duration::from_secs(2);
/// The requester's deadline where it is not what a test is about.
const LONG: Duration = Duration::from_secs(600);
/// A device's budget that runs everything queued.
const ALL: usize = usize::MAX;
/// What memory nothing wrote holds.
const UNTOUCHED: u8 = 0xee;

/// The owner's engine: its protocol, its grant table, its GPU memory and
/// the pinned memory of the landing slots, and the GPU copies queued.
struct OwnerSide {
    owner: Owner,
    grants: LocalGrants<&'static str>,
    /// Payloads of grants whose fence completed, as the driver drops them.
    fenced: Vec<&'static str>,
    gpu: Vec<u8>,
    /// Guard, the slots, guard.
    host: Vec<u8>,
    slots_made: bool,
    /// Copies queued on the GPU: (copy, slot, to the GPU, device address,
    /// bytes).
    copies: VecDeque<(CopyId, u32, bool, u64, u64)>,
    /// Copies the GPU runs per step.
    runs: usize,
    copies_started: usize,
    /// Bytes copied into the GPU once the grant was fenced (must stay 0).
    landed_after_fence: u64,
    /// Every reply sent, and every cancel received.
    replies: Vec<(RequestId, u32)>,
    cancels: Vec<RequestId>,
}

/// The requester's engine: its protocol, its memory, its RDMA ops posted.
struct RequesterSide {
    requester: Requester,
    local: Vec<u8>,
    /// Each request's direction (a WRITE when true) and where its bytes
    /// lie in `local`.
    asks: HashMap<RequestId, (bool, usize)>,
    /// RDMA ops posted: (request, slot, offset in the request, bytes).
    ops: VecDeque<(RequestId, u32, u64, u64)>,
    /// Ops the NIC completes per step.
    runs: usize,
    /// Slices the protocol moved (every `Move`).
    moves: usize,
    /// Ops the NIC refused: outside the memory of the slots.
    refused: usize,
    /// Credits (`SlotReady`) received.
    credits: usize,
    /// The peer is gone.
    gone: bool,
    ends: Vec<(RequestId, Result<(), AskFailure>)>,
    /// Every reply received, and every cancel sent.
    replies: Vec<(RequestId, u32)>,
    cancels: Vec<RequestId>,
}

impl OwnerSide {
    /// A message from the requester, as the engine's `receive` and
    /// `pump_landing` take it.
    fn receive(&mut self, message: Control<'_>, now: Instant) {
        match message {
            Control::StagedRequest {
                id,
                grant,
                offset,
                len,
                write,
                slots: true,
            } => {
                let ask = StagedAsk {
                    id,
                    grant,
                    offset,
                    len,
                    write,
                };
                let place = |_: &&str| {
                    Some(Placement {
                        gpu: 0,
                        addr: GPU_BASE + GUARD as u64,
                    })
                };
                self.owner.on_request(&mut self.grants, ask, place, now);
            }
            Control::SlotFilled { id, slot } => self.owner.on_filled(id, slot),
            Control::SlotDone { id, slot } => self.owner.on_done(id, slot),
            Control::StagedCancel { id } => {
                self.cancels.push(id);
                self.owner.on_cancel(id);
            }
            other => panic!("the owner got {other:?}"),
        }
    }

    /// The GPU runs copy `copy` between a landing slot and GPU memory.
    fn run_copy(&mut self, (copy, slot, to_gpu, gpu_addr, len): (CopyId, u32, bool, u64, u64)) {
        let grant = GPU_BASE + GUARD as u64..GPU_BASE + GUARD as u64 + GRANT_LEN;
        assert!(
            grant.contains(&gpu_addr) && gpu_addr + len <= grant.end,
            "a copy outside the grant"
        );
        assert!(slot < SLOTS && len <= SLOT, "a copy outside the slots");
        let (at, n) = ((gpu_addr - GPU_BASE) as usize, len as usize);
        let s = GUARD + slot as usize * SLOT as usize;
        if to_gpu {
            if self.grants.is_fenced(GRANT) {
                self.landed_after_fence += len;
            }
            self.gpu[at..at + n].copy_from_slice(&self.host[s..s + n]);
        } else {
            self.host[s..s + n].copy_from_slice(&self.gpu[at..at + n]);
        }
        self.owner.copy_ended(copy, true);
    }
}

/// The requester `r` and the owner `o`, and the link each way.
struct Pair {
    now: Instant,
    o: OwnerSide,
    r: RequesterSide,
    to_owner: Link,
    to_requester: Link,
}

impl Pair {
    /// The owner granted the requester [`GRANT`] (read and write) of its
    /// GPU memory; no landing slot is made yet.
    fn new() -> Self {
        let mut grants = LocalGrants::default();
        grants.insert(
            GRANT,
            Terms {
                len: GRANT_LEN,
                rights: Rights::ReadWrite,
            },
            "region",
        );
        let limits = PeerLimits {
            max_staged_requests: MAX_STAGED,
            staged_request_timeout: DEADLINE,
            ..PeerLimits::default()
        };
        let mut gpu = vec![UNTOUCHED; GUARD + GRANT_LEN as usize + GUARD];
        for (i, byte) in gpu[GUARD..GUARD + GRANT_LEN as usize]
            .iter_mut()
            .enumerate()
        {
            *byte = (i * 7 % 251) as u8;
        }
        let mut local = vec![UNTOUCHED; GUARD + LOCAL_LEN + GUARD];
        for (i, byte) in local[GUARD..GUARD + LOCAL_LEN].iter_mut().enumerate() {
            *byte = (i % 253) as u8 ^ 0x5a;
        }
        Self {
            now: Instant::now(),
            o: OwnerSide {
                owner: Owner::new(&limits),
                grants,
                fenced: Vec::new(),
                gpu,
                host: vec![UNTOUCHED; GUARD + (SLOTS as usize * SLOT as usize) + GUARD],
                slots_made: false,
                copies: VecDeque::new(),
                runs: ALL,
                copies_started: 0,
                landed_after_fence: 0,
                replies: Vec::new(),
                cancels: Vec::new(),
            },
            r: RequesterSide {
                requester: Requester::new(1 << 63),
                local,
                asks: HashMap::new(),
                ops: VecDeque::new(),
                runs: ALL,
                moves: 0,
                refused: 0,
                credits: 0,
                gone: false,
                ends: Vec::new(),
                replies: Vec::new(),
                cancels: Vec::new(),
            },
            to_owner: Link::default(),
            to_requester: Link::default(),
        }
    }

    /// The requester asks to move `len` bytes at `offset` of the grant
    /// from (a WRITE) or to (a READ) `local_at` of its memory, due within
    /// `timeout`.
    fn ask(
        &mut self,
        write: bool,
        offset: u64,
        len: u64,
        local_at: usize,
        timeout: Duration,
    ) -> RequestId {
        let id = self.r.requester.next_id();
        self.to_owner.send(&Control::StagedRequest {
            id,
            grant: GRANT,
            offset,
            len,
            write,
            slots: true,
        });
        assert_eq!(self.r.requester.start(write, len, self.now, timeout), id);
        self.r.asks.insert(id, (write, GUARD + local_at));
        id
    }

    /// The owner revokes the grant, as the engine does: the table (the
    /// fence), then the requests under it, then the notice.
    fn revoke(&mut self) -> Revoked<&'static str> {
        let revoked = self.o.grants.revoke(GRANT);
        self.o.owner.revoke(GRANT);
        self.to_requester
            .send(&Control::GrantRevoke { grant: GRANT });
        revoked
    }

    /// The connection is gone: both links cut, each side told.
    fn cut(&mut self) {
        self.to_owner.cut();
        self.to_requester.cut();
        self.r.gone = true;
        self.o.owner.close();
    }

    /// One round: the owner's engine, then the requester's.
    fn step(&mut self) {
        self.pump_owner();
        self.pump_requester();
    }

    fn run(&mut self, steps: usize) {
        for _ in 0..steps {
            self.step();
        }
    }

    /// The owner's engine makes progress (`pump_landing`): the peer's
    /// messages in, landing slots made when wanted, the GPU's copies,
    /// deadlines, then what the protocol decides.
    fn pump_owner(&mut self) {
        let (o, now) = (&mut self.o, self.now);
        self.to_owner.deliver(|m| o.receive(m, now));
        if o.owner.wants_slots().is_some() && !o.slots_made {
            o.slots_made = true;
            o.owner.slots_made(SLOTS, SLOT);
            self.to_requester.send(&Control::Slots {
                slot_len: SLOT,
                count: SLOTS,
                descriptor: b"the slots' grant",
            });
        }
        for _ in 0..o.runs {
            let Some(copy) = o.copies.pop_front() else {
                break;
            };
            o.run_copy(copy);
        }
        o.owner.handle_timeout(now);
        loop {
            o.owner.step(&mut o.grants, &mut o.fenced);
            let mut acted = false;
            while let Some(action) = o.owner.poll_action() {
                acted = true;
                match action {
                    OwnerAction::Reply { id, status } => {
                        o.replies.push((id, status));
                        self.to_requester.send(&Control::StagedReply { id, status });
                    }
                    OwnerAction::SlotReady {
                        id,
                        offset,
                        len,
                        slot,
                    } => self.to_requester.send(&Control::SlotReady {
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
                    } => {
                        o.copies_started += 1;
                        o.copies.push_back((copy, slot, to_gpu, gpu_addr, len));
                    }
                }
            }
            if !acted {
                break;
            }
        }
    }

    /// The requester's engine makes progress (`pump_asks`): the owner's
    /// messages in, the peer's end, deadlines, slices posted, the NIC's
    /// completions, then how requests end.
    fn pump_requester(&mut self) {
        let r = &mut self.r;
        self.to_requester.deliver(|m| match m {
            Control::Slots {
                slot_len, count, ..
            } => r.requester.on_slots(slot_len, count),
            Control::SlotReady {
                id,
                offset,
                len,
                slot,
            } => {
                r.credits += 1;
                r.requester.on_ready(id, offset, len, slot);
            }
            Control::StagedReply { id, status } => {
                r.replies.push((id, status));
                r.requester.on_reply(id, status);
            }
            Control::GrantRevoke { grant } => assert_eq!(grant, GRANT),
            other => panic!("the requester got {other:?}"),
        });
        if r.gone {
            r.requester.peer_gone();
        }
        r.requester.handle_timeout(self.now);
        self.take_requester_actions();
        let r = &mut self.r;
        let slots = GUARD..GUARD + SLOTS as usize * SLOT as usize;
        let runs = if r.gone { ALL } else { r.runs };
        for _ in 0..runs {
            let Some((id, slot, offset, len)) = r.ops.pop_front() else {
                break;
            };
            let (write, local_at) = r.asks[&id];
            let (n, at) = (len as usize, GUARD + (u64::from(slot) * SLOT) as usize);
            if r.gone || !(slots.contains(&at) && at + n <= slots.end) {
                // Flushed with the queue pair, or refused by the NIC (no
                // key covers it): nothing moved.
                r.refused += usize::from(!r.gone);
                r.requester.slice_ended(id, slot, len, false);
                r.requester.fail(id, AskFailure::Local);
                continue;
            }
            let mine = local_at + offset as usize;
            if write {
                self.o.host[at..at + n].copy_from_slice(&r.local[mine..mine + n]);
            } else {
                r.local[mine..mine + n].copy_from_slice(&self.o.host[at..at + n]);
            }
            r.requester.wired(id, slot);
            r.requester.slice_ended(id, slot, len, true);
        }
        r.requester.step();
        self.take_requester_actions();
    }

    fn take_requester_actions(&mut self) {
        let r = &mut self.r;
        while let Some(action) = r.requester.poll_action() {
            match action {
                RequesterAction::Move {
                    id,
                    slot,
                    offset,
                    len,
                } => {
                    r.moves += 1;
                    if r.requester.is_failing(id) {
                        // Failed before it was posted: it ends unmoved.
                        r.requester.slice_ended(id, slot, len, false);
                    } else {
                        r.ops.push_back((id, slot, offset, len));
                    }
                }
                RequesterAction::Filled { id, slot } => {
                    self.to_owner.send(&Control::SlotFilled { id, slot })
                }
                RequesterAction::Done { id, slot } => {
                    self.to_owner.send(&Control::SlotDone { id, slot })
                }
                RequesterAction::Cancel { id } => {
                    r.cancels.push(id);
                    self.to_owner.send(&Control::StagedCancel { id });
                }
                RequesterAction::End { id, outcome } => r.ends.push((id, outcome)),
            }
        }
    }

    /// Whether both sides hold nothing any more.
    fn idle(&self) -> bool {
        self.o.owner.is_idle()
            && self.o.copies.is_empty()
            && self.r.requester.is_idle()
            && self.r.ops.is_empty()
    }

    /// The bytes around the slots and the grant, which nothing may write.
    fn assert_guards(&self) {
        let untouched = |bytes: &[u8]| bytes.iter().all(|&b| b == UNTOUCHED);
        let (host, gpu, local) = (&self.o.host, &self.o.gpu, &self.r.local);
        assert!(untouched(&host[..GUARD]) && untouched(&host[host.len() - GUARD..]));
        assert!(untouched(&gpu[..GUARD]) && untouched(&gpu[gpu.len() - GUARD..]));
        assert!(untouched(&local[..GUARD]) && untouched(&local[local.len() - GUARD..]));
    }

    /// The end of a scenario: nothing written outside, nothing held on
    /// either side, no use of the grant left.
    fn assert_settled(&mut self) {
        self.assert_guards();
        assert!(self.idle());
        self.assert_no_use_left();
    }

    /// Every use of the grant ended: its revoke fences at once.
    fn assert_no_use_left(&mut self) {
        assert!(
            matches!(self.o.grants.revoke(GRANT), Revoked::Fenced(_)),
            "a use of the grant is still held"
        );
    }
}

#[test]
fn a_write_and_a_read_of_more_slices_than_slots_land_exactly_in_their_ranges() {
    let mut p = Pair::new();
    let (gpu0, local0) = (p.o.gpu.clone(), p.r.local.clone());
    let (write_len, read_len) = (5 * SLOT + 300, 3 * SLOT + 17);
    let w = p.ask(true, 100, write_len, 0, LONG);
    let r = p.ask(false, 6 * SLOT, read_len, 8 * SLOT as usize, LONG);
    for _ in 0..40 {
        p.step();
        assert!(
            p.r.ops.len() <= SLOTS as usize,
            "more slices in flight than slots"
        );
    }
    let ends = ended_once(&p.r.ends, &[w, r]);
    assert_eq!((ends[&w], ends[&r]), (Ok(()), Ok(())));
    assert_eq!(p.r.moves, 6 + 4, "each slice moved once");
    // The WRITE's bytes are in its range of the grant, and nothing else
    // of the GPU changed; the READ's are in its range of the requester.
    let want_gpu = with(&gpu0, GUARD + 100, &local0, GUARD, write_len);
    assert!(p.o.gpu == want_gpu, "the owner's GPU memory");
    let want_local = with(
        &local0,
        GUARD + 8 * SLOT as usize,
        &gpu0,
        GUARD + 6 * SLOT as usize,
        read_len,
    );
    assert!(p.r.local == want_local, "the requester's memory");
    assert_eq!(
        p.o.replies,
        [(w, status::OK)],
        "a READ is answered only to fail"
    );
    p.assert_settled();
}

#[test]
fn a_revoke_mid_write_lands_nothing_after_its_fence_and_the_request_ends_once_refused() {
    let mut p = Pair::new();
    let (gpu0, local0) = (p.o.gpu.clone(), p.r.local.clone());
    (p.o.runs, p.r.runs) = (0, 0);
    let id = p.ask(true, 0, 8 * SLOT, 0, LONG);
    p.run(2);
    assert_eq!(p.r.ops.len(), 2, "a WRITE in flight into each slot");
    // The first slice lands in its slot; the owner queues its copy to the
    // GPU (which does not run yet). The second is still on the wire.
    p.r.runs = 1;
    p.step();
    p.r.runs = 0;
    p.step();
    assert!(p.o.owner.copying() && p.r.ops.len() == 1);
    assert_eq!(p.revoke(), Revoked::Draining { uses: 1 });
    let copies_at_revoke = p.o.copies_started;
    p.step();
    assert!(
        !p.o.grants.is_fenced(GRANT),
        "fenced while a copy under the grant runs"
    );
    // Not answered yet: the requester's outcome comes after the last
    // byte the owner moves for it.
    assert!(
        p.o.replies.is_empty(),
        "answered while a copy under the request runs"
    );
    // The devices go on: the copy under way ends, the second WRITE lands
    // in its slot. Nothing lands in the GPU once the fence completed.
    (p.o.runs, p.r.runs) = (ALL, ALL);
    let mut at_fence = None;
    for _ in 0..20 {
        p.step();
        if at_fence.is_none() && p.o.grants.is_fenced(GRANT) {
            at_fence = Some(p.o.gpu.clone());
        }
    }
    let at_fence = at_fence.expect("the revoke's fence completes");
    assert_eq!(p.o.replies, [(id, status::REVOKED)], "answered once");
    assert_eq!(p.o.fenced, ["region"], "the payload comes back once");
    assert_eq!(p.o.landed_after_fence, 0);
    assert!(p.o.gpu == at_fence, "a byte landed after the fence");
    assert_eq!(
        p.o.copies_started, copies_at_revoke,
        "a copy started after the revoke"
    );
    let ends = ended_once(&p.r.ends, &[id]);
    assert_eq!(ends[&id], Err(AskFailure::Refused(status::REVOKED)));
    // Exactly the slice whose copy was under way landed.
    assert!(p.o.gpu == with(&gpu0, GUARD, &local0, GUARD, SLOT));
    p.assert_guards();
    assert!(p.idle());
}

/// When the requester's caller cancels, relative to the owner's refusal.
#[derive(Debug, Clone, Copy)]
enum Order {
    /// The refusal arrives first (the request's WRITEs still in flight),
    /// then the caller cancels.
    RefusalThenCancel,
    /// The caller cancels (its WRITEs still in flight), then the refusal
    /// arrives.
    CancelThenRefusal,
    /// The caller cancels with nothing in flight: the request ends at
    /// once, and its `StagedCancel` crosses the refusal on the wire.
    Crossing,
}

#[test]
fn a_cancel_crossing_the_owners_refusal_ends_the_request_once_in_either_order() {
    for order in [
        Order::RefusalThenCancel,
        Order::CancelThenRefusal,
        Order::Crossing,
    ] {
        let mut p = Pair::new();
        p.r.runs = 0;
        let id = p.ask(true, 0, 4 * SLOT, 0, LONG);
        p.run(2);
        if let Order::Crossing = order {
            // Both slices land in their slots; the owner's copies wait.
            p.o.runs = 0;
            p.r.runs = ALL;
            p.run(2);
            assert!(p.r.ops.is_empty() && p.o.owner.copying());
        }
        p.revoke();
        if let Order::Crossing = order {
            // The copies under way end (the refusal waits for them).
            p.o.runs = ALL;
        }
        // The owner refuses: REVOKED on the wire, not delivered yet.
        p.to_requester.hold();
        p.pump_owner();
        assert_eq!(p.o.replies, [(id, status::REVOKED)], "{order:?}");
        match order {
            Order::RefusalThenCancel => {
                p.to_requester.release();
                p.pump_requester();
                p.r.requester.fail(id, AskFailure::Cancelled);
            }
            Order::CancelThenRefusal => {
                p.r.requester.fail(id, AskFailure::Cancelled);
                p.to_requester.release();
            }
            Order::Crossing => {
                p.r.requester.fail(id, AskFailure::Cancelled);
                p.pump_requester();
                assert_eq!(p.r.ends.len(), 1, "nothing in flight: it ends now");
                assert!(
                    p.to_requester
                        .carries(|m| matches!(m, Control::StagedReply { .. }))
                );
                assert!(
                    p.to_owner
                        .carries(|m| matches!(m, Control::StagedCancel { .. }))
                );
                p.to_requester.release();
            }
        }
        (p.o.runs, p.r.runs) = (ALL, ALL);
        p.run(10);
        let ends = ended_once(&p.r.ends, &[id]);
        let want = match order {
            Order::RefusalThenCancel => Err(AskFailure::Refused(status::REVOKED)),
            _ => Err(AskFailure::Cancelled),
        };
        assert_eq!(ends[&id], want, "{order:?}: the first reason");
        assert_eq!(p.o.replies.len(), 1, "{order:?}: answered once");
        assert_eq!(p.r.cancels, [id], "{order:?}: the owner told once");
        assert_eq!(p.o.cancels, [id], "{order:?}");
        assert_eq!(p.o.landed_after_fence, 0);
        assert!(p.idle(), "{order:?}");
        assert!(p.o.grants.is_fenced(GRANT), "{order:?}");
    }
}

#[test]
fn a_cancel_reaching_the_owner_mid_read_is_never_answered_and_moves_nothing_more() {
    let mut p = Pair::new();
    let (gpu0, local0) = (p.o.gpu.clone(), p.r.local.clone());
    let id = p.ask(false, 0, 8 * SLOT, 0, LONG);
    // Slices 0 and 1 move; 2 and 3 are on the wire when the caller
    // cancels.
    p.run(2);
    p.r.runs = 0;
    p.run(2);
    assert_eq!(p.r.ops.len(), 2);
    p.r.requester.fail(id, AskFailure::Cancelled);
    let moves = p.r.moves;
    // One slice ends: its slot comes back and the owner lends it again;
    // the other ends too: the request ends and its cancel goes out.
    p.r.runs = 1;
    p.run(2);
    assert_eq!(p.r.cancels, [id]);
    // The cancel is delayed: the owner's credit for slice 4 crosses it.
    p.to_owner.hold();
    p.step();
    assert_eq!(p.r.credits, 5, "a credit crossed the cancel");
    p.to_owner.release();
    p.run(5);
    assert_eq!(p.r.moves, moves, "a slice moved after the cancel");
    let ends = ended_once(&p.r.ends, &[id]);
    assert_eq!(ends[&id], Err(AskFailure::Cancelled));
    assert_eq!(p.o.cancels, [id]);
    assert!(p.o.replies.is_empty(), "a cancelled request answered");
    // Exactly the slices moved before the cancel and those on the wire
    // then, each where it belongs.
    assert!(p.r.local == with(&local0, GUARD, &gpu0, GUARD, 4 * SLOT));
    p.assert_guards();
    assert!(p.idle(), "the owner took every slot back");
    p.assert_no_use_left();
}

#[test]
fn a_request_past_the_owners_deadline_is_dropped_there_and_the_requester_told_timed_out() {
    let mut p = Pair::new();
    let gpu0 = p.o.gpu.clone();
    let t0 = p.now;
    p.r.runs = 0;
    let id = p.ask(true, 0, 4 * SLOT, 0, LONG);
    p.run(2);
    assert_eq!(p.o.owner.poll_timeout(), Some(t0 + DEADLINE));
    p.now = t0 + DEADLINE - Duration::from_nanos(1);
    p.step();
    assert_eq!(p.o.owner.requests(), 1, "not before its deadline");
    // At the deadline the owner keeps nothing of it: every slot lent to it
    // comes back at once, though the requester still holds them.
    p.now = t0 + DEADLINE;
    p.pump_owner();
    assert_eq!(p.o.owner.requests(), 0, "held past its deadline");
    assert!(p.o.owner.is_idle());
    assert_eq!(p.o.owner.poll_timeout(), None);
    assert_eq!(p.o.replies, [(id, status::TIMED_OUT)]);
    // The requester's WRITEs land in slots that are no longer its own:
    // nothing of them is copied.
    p.r.runs = ALL;
    p.run(5);
    let ends = ended_once(&p.r.ends, &[id]);
    assert_eq!(ends[&id], Err(AskFailure::Refused(status::TIMED_OUT)));
    assert_eq!(p.o.copies_started, 0);
    assert!(p.o.gpu == gpu0);
    assert_eq!(p.o.cancels, [id], "told, and nothing to take back");
    p.assert_settled();
}

#[test]
fn a_silent_owner_times_the_request_out_at_the_requester_and_is_told_to_cancel() {
    let mut p = Pair::new();
    let gpu0 = p.o.gpu.clone();
    let t0 = p.now;
    let timeout = Duration::from_millis(100);
    let id = p.ask(true, 0, 4 * SLOT, 0, timeout);
    // The owner's credits are delayed on the wire past the deadline.
    p.to_requester.hold();
    p.run(2);
    assert_eq!(p.r.requester.poll_timeout(), Some(t0 + timeout));
    p.now = t0 + timeout;
    p.step();
    let ends = ended_once(&p.r.ends, &[id]);
    assert_eq!(ends[&id], Err(AskFailure::TimedOut));
    assert!(p.r.requester.is_idle());
    // The credits that come late move nothing; the owner takes its slots
    // back on the cancel.
    p.to_requester.release();
    p.run(5);
    assert_eq!(p.r.moves, 0);
    assert_eq!(p.r.ends.len(), 1);
    assert_eq!(p.o.cancels, [id]);
    assert!(p.o.gpu == gpu0);
    assert!(p.idle());
    p.assert_no_use_left();
}

#[test]
fn a_flooding_requester_is_refused_busy_past_the_bound_and_the_owner_holds_at_most_the_bound() {
    let mut p = Pair::new();
    let (gpu0, local0) = (p.o.gpu.clone(), p.r.local.clone());
    let ids: Vec<RequestId> = (0..10)
        .map(|i| p.ask(true, i * SLOT, SLOT, (i * SLOT) as usize, LONG))
        .collect();
    for _ in 0..30 {
        p.step();
        assert!(p.o.owner.requests() <= MAX_STAGED);
    }
    let ends = ended_once(&p.r.ends, &ids);
    let (served, refused) = ids.split_at(MAX_STAGED);
    for id in served {
        assert_eq!(ends[id], Ok(()));
    }
    for id in refused {
        assert_eq!(ends[id], Err(AskFailure::Refused(status::BUSY)));
    }
    let want = with(&gpu0, GUARD, &local0, GUARD, MAX_STAGED as u64 * SLOT);
    assert!(p.o.gpu == want, "only the requests served landed");
    assert!(p.idle());
    // The bound counts what is held: served again once they ended.
    let again = p.ask(true, 9 * SLOT, SLOT, 0, LONG);
    p.run(10);
    assert_eq!(
        ended_once(&p.r.ends, &[&ids[..], &[again]].concat())[&again],
        Ok(())
    );
    // A peer that floods requests and never credits a slot (no requester
    // protocol behind it): the owner still holds at most the bound, and
    // nothing past the deadline.
    for id in 0..50 {
        p.to_owner.send(&Control::StagedRequest {
            id,
            grant: GRANT,
            offset: 0,
            len: 4 * SLOT,
            write: true,
            slots: true,
        });
    }
    p.pump_owner();
    assert_eq!(p.o.owner.requests(), MAX_STAGED);
    let busy = |p: &Pair| {
        p.o.replies
            .iter()
            .filter(|(id, s)| *id < 50 && *s == status::BUSY)
            .count()
    };
    assert_eq!(busy(&p), 50 - MAX_STAGED);
    p.now += DEADLINE;
    p.run(2);
    assert_eq!(p.o.owner.requests(), 0, "held past the deadline");
    assert!(p.o.owner.is_idle());
    p.assert_no_use_left();
}

/// A misbehaving owner's forgery of a credit (offset in the request,
/// bytes, slot).
type Forge = fn(u64, u64, u32) -> (u64, u64, u32);

/// Each forgery, named, and which of the owner's credits it replaces (those
/// before it are honest).
fn forgeries() -> [(&'static str, usize, Forge); 4] {
    [
        ("a slot past the last", 0, |offset, len, _| {
            (offset, len, SLOTS)
        }),
        ("longer than a slot", 0, |offset, _, slot| {
            (offset, SLOT + 1, slot)
        }),
        ("past the request", 0, |_, len, slot| {
            (3 * SLOT - 10, len, slot)
        }),
        // The first credit's slice is still on the wire in slot 0.
        ("a slot still carrying a slice", 1, |offset, len, _| {
            (offset, len, 0)
        }),
    ]
}

#[test]
fn a_bad_credit_from_the_owner_ends_the_request_bad_credit_and_moves_no_byte() {
    for write in [true, false] {
        for (what, nth, forge) in forgeries() {
            let mut p = Pair::new();
            let local0 = p.r.local.clone();
            // The owner lends its slots honestly; what goes on the wire is
            // a forgery of one of its credits.
            let mut credits = 0;
            p.to_requester.rewrite(move |m| match m {
                Control::SlotReady {
                    id,
                    offset,
                    len,
                    slot,
                } => {
                    credits += 1;
                    let (offset, len, slot) = if credits == nth + 1 {
                        forge(offset, len, slot)
                    } else {
                        (offset, len, slot)
                    };
                    Control::SlotReady {
                        id,
                        offset,
                        len,
                        slot,
                    }
                }
                other => other,
            });
            let id = p.ask(write, 0, 3 * SLOT, 0, LONG);
            p.run(10);
            let ends = ended_once(&p.r.ends, &[id]);
            assert!(
                matches!(ends[&id], Err(AskFailure::BadCredit { .. })),
                "{what}, write {write}: {:?}",
                ends[&id]
            );
            // No byte moved: an honest credit that came with the forgery
            // is dropped too (its request failed before its slice was
            // posted).
            assert_eq!(p.r.moves, nth, "{what}: a Move on the forgery");
            assert_eq!(p.r.refused, 0, "{what}");
            assert!(p.r.local == local0, "{what}: the requester's memory");
            if write {
                let slots = &p.o.host[GUARD..GUARD + SLOTS as usize * SLOT as usize];
                assert!(slots.iter().all(|&b| b == UNTOUCHED), "{what}: a slot");
            }
            p.assert_guards();
            assert_eq!(p.o.cancels, [id], "{what}: the owner is told");
            assert!(p.idle(), "{what}: the owner took its slots back");
            p.assert_no_use_left();
        }
    }
}

#[test]
fn an_owner_answering_a_write_ok_before_every_slice_moved_fails_it_incomplete() {
    let mut p = Pair::new();
    // The owner's first credit is replaced by an early OK.
    let mut first = true;
    p.to_requester.rewrite(move |m| match m {
        Control::SlotReady { id, .. } if std::mem::take(&mut first) => Control::StagedReply {
            id,
            status: status::OK,
        },
        other => other,
    });
    let id = p.ask(true, 0, 3 * SLOT, 0, LONG);
    p.run(5);
    let ends = ended_once(&p.r.ends, &[id]);
    assert_eq!(ends[&id], Err(AskFailure::Incomplete));
    assert!(p.r.requester.is_idle());
    // What the owner holds of it ends at its deadline.
    p.now += DEADLINE;
    p.run(3);
    assert_eq!(p.r.ends.len(), 1);
    assert!(p.idle());
    p.assert_guards();
    p.assert_no_use_left();
}

#[test]
fn a_bad_credit_from_the_requester_fails_its_request_and_nothing_of_it_is_copied() {
    type Forge = fn(RequestId, u32) -> Control<'static>;
    let forgeries: [(&str, Forge); 3] = [
        ("the wrong direction", |id, slot| Control::SlotDone {
            id,
            slot,
        }),
        // Slot 1 is the second request's.
        ("a slot lent to another request", |id, _| {
            Control::SlotFilled { id, slot: 1 }
        }),
        ("a slot past the last", |id, _| Control::SlotFilled {
            id,
            slot: SLOTS + 3,
        }),
    ];
    for (what, forge) in forgeries {
        let mut p = Pair::new();
        let (gpu0, local0) = (p.o.gpu.clone(), p.r.local.clone());
        // Two WRITEs of a slice each: slot 0 is lent to the first, slot 1
        // to the second.
        let a = p.ask(true, 0, SLOT, 0, LONG);
        let b = p.ask(true, 4 * SLOT, SLOT, 4 * SLOT as usize, LONG);
        let mut first = true;
        p.to_owner.rewrite(move |m| match m {
            Control::SlotFilled { id, slot } if id == a && std::mem::take(&mut first) => {
                forge(id, slot)
            }
            other => other,
        });
        p.run(10);
        let ends = ended_once(&p.r.ends, &[a, b]);
        assert_eq!(
            ends[&a],
            Err(AskFailure::Refused(status::BAD_CREDIT)),
            "{what}"
        );
        assert_eq!(ends[&b], Ok(()), "{what}: the other request");
        let want = with(
            &gpu0,
            GUARD + 4 * SLOT as usize,
            &local0,
            GUARD + 4 * SLOT as usize,
            SLOT,
        );
        assert!(
            p.o.gpu == want,
            "{what}: a byte of the forged credit copied"
        );
        assert_eq!(p.o.copies_started, 1, "{what}");
        assert!(p.idle(), "{what}");
        p.assert_no_use_left();
    }
}

#[test]
fn the_peer_gone_mid_transfer_ends_every_request_once_and_gives_every_slot_back() {
    let mut p = Pair::new();
    let w = p.ask(true, 0, 6 * SLOT, 0, LONG);
    let r = p.ask(false, 6 * SLOT, 4 * SLOT, 8 * SLOT as usize, LONG);
    p.run(3);
    // A slice on the wire, a copy on the GPU, when the connection goes:
    // the GPU runs one copy (the READ's next slice out into its slot), the
    // NIC none.
    (p.o.runs, p.r.runs) = (1, 0);
    p.step();
    assert!(!p.r.ops.is_empty() && p.o.owner.copying());
    let (host, local) = (p.o.host.clone(), p.r.local.clone());
    let (replies, copies) = (p.o.replies.len(), p.o.copies_started);
    p.cut();
    (p.o.runs, p.r.runs) = (ALL, ALL);
    p.run(5);
    let ends = ended_once(&p.r.ends, &[w, r]);
    assert_eq!(ends[&w], Err(AskFailure::PeerGone));
    assert_eq!(ends[&r], Err(AskFailure::PeerGone));
    assert!(p.r.cancels.is_empty(), "a cancel to a gone peer");
    assert!(p.o.host == host, "a WRITE landed after the queue pair went");
    assert!(
        p.r.local == local,
        "a READ landed after the queue pair went"
    );
    assert_eq!(p.o.replies.len(), replies, "answered after the close");
    assert_eq!(p.o.copies_started, copies, "a copy started after the close");
    assert_eq!(p.o.owner.requests(), 0);
    assert!(!p.o.owner.copying());
    assert!(p.idle(), "a slot or a request kept");
    p.assert_guards();
    p.assert_no_use_left();
}
