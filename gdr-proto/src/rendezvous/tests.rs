//! The owner's rendezvous, driven in memory: a grant table, an owner, and
//! a loop that plays the peer and the GPU.

use std::time::{Duration, Instant};

use super::*;
use crate::grants::{Revoked, Rights, Terms};

const GRANT: GrantId = 9;
const BASE: u64 = 0xd000_0000;
const SLOT: u64 = 4096;

fn limits(max: usize) -> PeerLimits {
    PeerLimits {
        max_staged_requests: max,
        staged_request_timeout: Duration::from_secs(1),
        ..PeerLimits::default()
    }
}

/// A grant of `len` bytes of GPU 0 at `BASE`, and an owner with `slots`
/// slots made.
fn setup(len: u64, rights: Rights, slots: u32, max: usize) -> (LocalGrants<&'static str>, Owner) {
    let mut grants = LocalGrants::default();
    grants.insert(GRANT, Terms { len, rights }, "region");
    let mut owner = Owner::new(&limits(max));
    owner.slots_made(slots, SLOT);
    (grants, owner)
}

fn place(_: &&str) -> Option<Placement> {
    Some(Placement { gpu: 0, addr: BASE })
}

fn ask(id: RequestId, offset: u64, len: u64, write: bool) -> StagedAsk {
    StagedAsk {
        id,
        grant: GRANT,
        offset,
        len,
        write,
    }
}

fn drain(owner: &mut Owner) -> Vec<OwnerAction> {
    std::iter::from_fn(|| owner.poll_action()).collect()
}

fn step(
    owner: &mut Owner,
    grants: &mut LocalGrants<&'static str>,
) -> (Vec<OwnerAction>, Vec<&'static str>) {
    let mut fenced = Vec::new();
    owner.step(grants, &mut fenced);
    (drain(owner), fenced)
}

/// Plays an honest requester and a GPU whose copies end at once until
/// nothing moves; returns every action seen.
fn run(owner: &mut Owner, grants: &mut LocalGrants<&'static str>) -> Vec<OwnerAction> {
    let mut seen = Vec::new();
    loop {
        let (actions, _) = step(owner, grants);
        if actions.is_empty() {
            return seen;
        }
        for action in &actions {
            match *action {
                OwnerAction::SlotReady { id, slot, .. } => {
                    let write = seen
                        .iter()
                        .all(|a| !matches!(a, OwnerAction::Copy { to_gpu: false, .. }));
                    if write {
                        owner.on_filled(id, slot);
                    } else {
                        owner.on_done(id, slot);
                    }
                }
                OwnerAction::Copy { copy, .. } => owner.copy_ended(copy, true),
                OwnerAction::Reply { .. } => {}
            }
            seen.push(*action);
        }
    }
}

fn copies(actions: &[OwnerAction]) -> Vec<(u64, u64, bool)> {
    actions
        .iter()
        .filter_map(|a| match *a {
            OwnerAction::Copy {
                gpu_addr,
                len,
                to_gpu,
                ..
            } => Some((gpu_addr, len, to_gpu)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_write_is_lent_slots_copied_slice_by_slice_and_answered_once() {
    let (mut grants, mut owner) = setup(1 << 20, Rights::Write, 2, 8);
    owner.on_request(
        &mut grants,
        ask(1, 100, 10_000, true),
        place,
        Instant::now(),
    );
    let seen = run(&mut owner, &mut grants);
    assert_eq!(
        copies(&seen),
        [
            (BASE + 100, 4096, true),
            (BASE + 100 + 4096, 4096, true),
            (BASE + 100 + 8192, 10_000 - 8192, true)
        ]
    );
    let replies: Vec<_> = seen
        .iter()
        .filter(|a| matches!(a, OwnerAction::Reply { .. }))
        .collect();
    assert_eq!(
        replies,
        [&OwnerAction::Reply {
            id: 1,
            status: status::OK
        }]
    );
    assert!(owner.is_idle());
    assert_eq!(
        grants.revoke(GRANT),
        Revoked::Fenced("region"),
        "the use ended"
    );
}

#[test]
fn a_read_is_copied_out_before_each_credit_and_not_answered_on_success() {
    let (mut grants, mut owner) = setup(1 << 20, Rights::Read, 1, 8);
    owner.on_request(&mut grants, ask(2, 0, 5000, false), place, Instant::now());
    let seen = run(&mut owner, &mut grants);
    assert_eq!(
        copies(&seen),
        [(BASE, 4096, false), (BASE + 4096, 904, false)]
    );
    assert!(
        matches!(seen[0], OwnerAction::Copy { .. })
            && matches!(seen[1], OwnerAction::SlotReady { .. }),
        "the slot is lent once its slice is in it: {seen:?}"
    );
    assert!(!seen.iter().any(|a| matches!(a, OwnerAction::Reply { .. })));
    assert!(owner.is_idle());
}

#[test]
fn refused_requests_are_answered_and_keep_nothing() {
    let (mut grants, mut owner) = setup(4096, Rights::Read, 1, 8);
    let now = Instant::now();
    owner.on_request(&mut grants, ask(1, 0, 16, true), place, now);
    owner.on_request(&mut grants, ask(2, 4000, 100, false), place, now);
    owner.on_request(
        &mut grants,
        StagedAsk {
            grant: 77,
            ..ask(3, 0, 1, false)
        },
        place,
        now,
    );
    owner.on_request(&mut grants, ask(4, 0, 16, false), |_| None, now);
    assert_eq!(
        drain(&mut owner),
        [
            OwnerAction::Reply {
                id: 1,
                status: status::ACCESS_DENIED
            },
            OwnerAction::Reply {
                id: 2,
                status: status::OUT_OF_BOUNDS
            },
            OwnerAction::Reply {
                id: 3,
                status: status::NOT_GRANTED
            },
            OwnerAction::Reply {
                id: 4,
                status: status::FAILED
            },
        ]
    );
    assert_eq!(owner.requests(), 0);
    assert_eq!(
        grants.revoke(GRANT),
        Revoked::Fenced("region"),
        "no use taken"
    );
}

/// The fence: a revoke fails the request at once and starts no copy, not
/// even of data the peer already put in a lent slot; the grant is fenced,
/// and the requester answered, only when the copy running at the revoke
/// has ended (an answer before it would end the requester's batch while
/// this side still writes the memory: the engine's lifetime matrix saw
/// the destination change after the outcome).
#[test]
fn a_revoke_stops_the_request_and_fences_after_the_running_copy() {
    let (mut grants, mut owner) = setup(1 << 20, Rights::Write, 2, 8);
    owner.on_request(
        &mut grants,
        ask(1, 0, 64 * 1024, true),
        place,
        Instant::now(),
    );
    let (lent, _) = step(&mut owner, &mut grants);
    assert_eq!(lent.len(), 2, "two slots lent: {lent:?}");
    owner.on_filled(1, 0);
    let running = match drain(&mut owner).as_slice() {
        [OwnerAction::Copy { copy, .. }] => *copy,
        other => panic!("one copy expected: {other:?}"),
    };
    assert!(matches!(
        grants.revoke(GRANT),
        Revoked::Draining { uses: 1 }
    ));
    owner.revoke(GRANT);
    // The peer fills the other slot after the revoke: never copied.
    owner.on_filled(1, 1);
    let (actions, fenced) = step(&mut owner, &mut grants);
    assert_eq!(actions, [], "no copy, and no answer while a copy runs");
    assert!(
        fenced.is_empty() && !grants.is_fenced(GRANT),
        "a copy still runs"
    );
    owner.copy_ended(running, true);
    let (actions, fenced) = step(&mut owner, &mut grants);
    assert_eq!(
        actions,
        [OwnerAction::Reply {
            id: 1,
            status: status::REVOKED
        }],
        "answered once, after the copy"
    );
    assert_eq!(fenced, ["region"]);
    assert!(grants.is_fenced(GRANT));
    let (actions, _) = step(&mut owner, &mut grants);
    assert_eq!(actions, [], "no second answer");
    assert!(owner.is_idle());
}

#[test]
fn requests_past_the_bound_are_refused_busy() {
    let (mut grants, mut owner) = setup(1 << 20, Rights::ReadWrite, 1, 2);
    let now = Instant::now();
    for id in 1..=3 {
        owner.on_request(&mut grants, ask(id, 0, 4096, true), place, now);
    }
    assert_eq!(
        drain(&mut owner),
        [OwnerAction::Reply {
            id: 3,
            status: status::BUSY
        }]
    );
    assert_eq!(owner.requests(), 2);
}

/// A requester that never returns its credits: past the deadline its
/// requests fail and their slots serve the next request.
#[test]
fn stalled_requests_time_out_and_give_their_slots_back() {
    let (mut grants, mut owner) = setup(1 << 20, Rights::Write, 2, 8);
    let start = Instant::now();
    owner.on_request(&mut grants, ask(1, 0, 8192, true), place, start);
    let (lent, _) = step(&mut owner, &mut grants);
    assert_eq!(lent.len(), 2);
    assert_eq!(owner.poll_timeout(), Some(start + Duration::from_secs(1)));
    owner.handle_timeout(start + Duration::from_millis(999));
    assert_eq!(step(&mut owner, &mut grants).0, []);
    owner.handle_timeout(start + Duration::from_secs(1));
    assert_eq!(
        step(&mut owner, &mut grants).0,
        [OwnerAction::Reply {
            id: 1,
            status: status::TIMED_OUT
        }]
    );
    assert_eq!(owner.poll_timeout(), None);
    owner.on_request(
        &mut grants,
        ask(2, 0, 8192, true),
        place,
        start + Duration::from_secs(2),
    );
    let (lent, _) = step(&mut owner, &mut grants);
    assert_eq!(lent.len(), 2, "the slots came back: {lent:?}");
    // A late credit of the timed-out request is refused without a copy.
    owner.on_filled(1, 0);
    assert_eq!(step(&mut owner, &mut grants).0, []);
}

#[test]
fn forged_credits_fail_their_request_and_unknown_ones_are_dropped() {
    let (mut grants, mut owner) = setup(1 << 20, Rights::ReadWrite, 2, 8);
    let now = Instant::now();
    owner.on_request(&mut grants, ask(1, 0, 4096, true), place, now);
    step(&mut owner, &mut grants);
    owner.on_filled(99, 0);
    owner.on_filled(1, 7);
    let (actions, _) = step(&mut owner, &mut grants);
    assert_eq!(
        actions,
        [OwnerAction::Reply {
            id: 1,
            status: status::BAD_CREDIT
        }]
    );
    // A WRITE's slot credited as read: the request fails, and the data
    // the peer then says it filled is not copied.
    owner.on_request(&mut grants, ask(2, 0, 4096, true), place, now);
    let slot = match step(&mut owner, &mut grants).0.as_slice() {
        [OwnerAction::SlotReady { id: 2, slot, .. }] => *slot,
        other => panic!("one slot lent to request 2: {other:?}"),
    };
    owner.on_done(2, slot);
    let (actions, _) = step(&mut owner, &mut grants);
    assert_eq!(
        actions,
        [OwnerAction::Reply {
            id: 2,
            status: status::BAD_CREDIT
        }]
    );
    owner.on_filled(2, slot);
    let (actions, _) = step(&mut owner, &mut grants);
    assert!(copies(&actions).is_empty(), "{actions:?}");
}

#[test]
fn a_cancelled_request_is_not_answered_and_its_slots_come_back() {
    let (mut grants, mut owner) = setup(1 << 20, Rights::Write, 1, 8);
    let now = Instant::now();
    owner.on_request(&mut grants, ask(1, 0, 8192, true), place, now);
    step(&mut owner, &mut grants);
    owner.on_cancel(1);
    owner.on_request(&mut grants, ask(2, 0, 4096, true), place, now);
    let (actions, fenced) = step(&mut owner, &mut grants);
    assert_eq!(
        actions,
        [OwnerAction::SlotReady {
            id: 2,
            offset: 0,
            len: 4096,
            slot: 0
        }],
        "no reply to the cancelled one; its slot lent again"
    );
    assert!(fenced.is_empty(), "request 2 holds the grant");
}

#[test]
fn requests_wait_for_slots_and_fail_if_none_can_be_made() {
    let mut grants = LocalGrants::default();
    grants.insert(
        GRANT,
        Terms {
            len: 4096,
            rights: Rights::Write,
        },
        "region",
    );
    let mut owner = Owner::new(&limits(8));
    assert_eq!(owner.wants_slots(), None);
    owner.on_request(
        &mut grants,
        ask(1, 0, 4096, true),
        |_| Some(Placement { gpu: 3, addr: BASE }),
        Instant::now(),
    );
    assert_eq!(owner.wants_slots(), Some(3));
    assert_eq!(
        step(&mut owner, &mut grants).0,
        [],
        "nothing lent without slots"
    );
    owner.slots_failed();
    let (actions, fenced) = step(&mut owner, &mut grants);
    assert_eq!(
        actions,
        [OwnerAction::Reply {
            id: 1,
            status: status::FAILED
        }]
    );
    assert!(fenced.is_empty());
    assert_eq!(grants.revoke(GRANT), Revoked::Fenced("region"));
}

/// Every copy stays inside the grant's range, for requests of many sizes
/// and offsets over few slots, both directions, interleaved.
#[test]
fn every_copy_lies_inside_the_grant() {
    const LEN: u64 = 50_000;
    for slots in 1..4 {
        let (mut grants, mut owner) = setup(LEN, Rights::ReadWrite, slots, 64);
        let now = Instant::now();
        let mut id = 0;
        for (offset, len) in [
            (0, LEN),
            (1, LEN - 1),
            (49_999, 1),
            (4095, 4097),
            (12_345, 20_000),
        ] {
            id += 1;
            owner.on_request(&mut grants, ask(id, offset, len, id % 2 == 0), place, now);
        }
        let mut seen = Vec::new();
        for _ in 0..10_000 {
            let (actions, _) = step(&mut owner, &mut grants);
            if actions.is_empty() {
                break;
            }
            for action in actions {
                match action {
                    OwnerAction::SlotReady { id, slot, .. } if id % 2 == 0 => {
                        owner.on_filled(id, slot)
                    }
                    OwnerAction::SlotReady { id, slot, .. } => owner.on_done(id, slot),
                    OwnerAction::Copy { copy, .. } => owner.copy_ended(copy, true),
                    OwnerAction::Reply { .. } => {}
                }
                seen.push(action);
            }
        }
        assert!(owner.is_idle(), "{slots} slots: everything ended");
        for (addr, len, _) in copies(&seen) {
            assert!(len > 0 && len <= SLOT);
            assert!(addr >= BASE && addr + len <= BASE + LEN, "{addr:#x}+{len}");
        }
        let copied: u64 = copies(&seen).iter().map(|c| c.1).sum();
        assert_eq!(copied, LEN + (LEN - 1) + 1 + 4097 + 20_000);
    }
}

/// Closing: every request stops (no copy starts, not even of data the peer
/// put in a lent slot), nothing is answered, and the running copy is
/// still reported until it ends.
#[test]
fn closing_stops_every_request_without_replies() {
    let (mut grants, mut owner) = setup(1 << 20, Rights::Write, 2, 8);
    owner.on_request(
        &mut grants,
        ask(1, 0, 64 * 1024, true),
        place,
        Instant::now(),
    );
    step(&mut owner, &mut grants);
    owner.on_filled(1, 0);
    let running = match drain(&mut owner).as_slice() {
        [OwnerAction::Copy { copy, .. }] => *copy,
        other => panic!("one copy expected: {other:?}"),
    };
    owner.close();
    owner.on_filled(1, 1);
    assert_eq!(step(&mut owner, &mut grants).0, [], "no copy, no reply");
    assert!(owner.copying());
    owner.copy_ended(running, true);
    assert!(!owner.copying());
    let (actions, _) = step(&mut owner, &mut grants);
    assert_eq!(actions, []);
    assert!(owner.is_idle());
    assert_eq!(
        grants.revoke(GRANT),
        Revoked::Fenced("region"),
        "the use ended"
    );
}
