//! The peer-copy protocol in memory: flights against a GPU that runs
//! windows when told, an owner and an importer exchanging revokes and
//! releases, with no simulator.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;

const WINDOWS: Windows = Windows {
    slice: 4,
    slices: 2,
    in_flight: 2,
};

/// A GPU that runs the windows queued on it, in order, when told; bytes
/// copied per transfer.
struct Gpu {
    queue: VecDeque<Vec<Slice>>,
    copied: Vec<Vec<(u64, u64)>>,
}

impl Gpu {
    fn new(transfers: usize) -> Self {
        Self {
            queue: VecDeque::new(),
            copied: vec![Vec::new(); transfers],
        }
    }

    /// Queues every window the flight hands out now.
    fn feed(&mut self, flight: &mut CopyFlight) -> usize {
        let mut n = 0;
        while let Some(window) = flight.poll_window() {
            self.queue.push_back(window);
            n += 1;
        }
        n
    }

    /// Runs the oldest window.
    fn run_one(&mut self, flight: &mut CopyFlight) -> bool {
        let Some(window) = self.queue.pop_front() else {
            return false;
        };
        for s in window {
            self.copied[s.transfer].push((s.offset, s.len));
        }
        flight.window_done();
        true
    }

    fn bytes(&self, transfer: usize) -> u64 {
        self.copied[transfer].iter().map(|&(_, len)| len).sum()
    }
}

#[test]
fn windows_cover_every_byte_once_in_order() {
    let lens = vec![10, 0, 3, 8];
    let mut flight = CopyFlight::new(lens.clone(), WINDOWS, None);
    let mut gpu = Gpu::new(lens.len());
    loop {
        gpu.feed(&mut flight);
        assert!(
            gpu.queue.len() <= WINDOWS.in_flight,
            "too many windows on the GPU"
        );
        if !gpu.run_one(&mut flight) {
            break;
        }
    }
    for (t, &len) in lens.iter().enumerate() {
        let mut at = 0;
        for &(offset, n) in &gpu.copied[t] {
            assert_eq!(offset, at, "transfer {t}: a gap or an overlap");
            assert!(n > 0 && n <= WINDOWS.slice);
            at += n;
        }
        assert_eq!(at, len, "transfer {t}");
    }
    assert!(flight.is_drained());
    assert_eq!(flight.poll_outcome(), Some(Ok(())));
    assert_eq!(flight.poll_outcome(), None, "the outcome comes once");
}

#[test]
fn a_revoke_mid_transfer_stops_it_after_the_windows_already_queued() {
    let mut flight = CopyFlight::new(vec![64], WINDOWS, None);
    let mut gpu = Gpu::new(1);
    gpu.feed(&mut flight);
    gpu.run_one(&mut flight);
    gpu.feed(&mut flight);
    let queued_before_revoke = gpu.queue.len() as u64 * WINDOWS.slice * WINDOWS.slices as u64;
    let copied_before_revoke = gpu.bytes(0);
    flight.stop(Stop::Revoked { grant: 7 });
    assert_eq!(
        flight.poll_window(),
        None,
        "nothing queued after the revoke"
    );
    assert!(
        !flight.is_drained(),
        "not fenced while windows are on the GPU"
    );
    assert_eq!(flight.poll_outcome(), None, "no outcome before it drained");
    while gpu.run_one(&mut flight) {
        assert_eq!(flight.poll_window(), None);
    }
    assert!(flight.is_drained());
    assert_eq!(
        gpu.bytes(0),
        copied_before_revoke + queued_before_revoke,
        "exactly the windows queued before the revoke ran"
    );
    assert!(gpu.bytes(0) < 64, "the revoke stopped the transfer");
    assert_eq!(flight.poll_outcome(), Some(Err(Stop::Revoked { grant: 7 })));
}

#[test]
fn a_revoke_after_the_last_window_was_queued_still_fails_the_batch() {
    let mut flight = CopyFlight::new(vec![8], WINDOWS, None);
    let mut gpu = Gpu::new(1);
    gpu.feed(&mut flight);
    flight.stop(Stop::Revoked { grant: 1 });
    gpu.run_one(&mut flight);
    assert_eq!(flight.poll_outcome(), Some(Err(Stop::Revoked { grant: 1 })));
}

#[test]
fn the_first_stop_is_the_one_the_batch_ends_with() {
    let mut flight = CopyFlight::new(vec![64], WINDOWS, None);
    let mut gpu = Gpu::new(1);
    gpu.feed(&mut flight);
    flight.stop(Stop::Cancelled);
    flight.stop(Stop::Revoked { grant: 2 });
    while gpu.run_one(&mut flight) {}
    assert_eq!(flight.poll_outcome(), Some(Err(Stop::Cancelled)));
}

#[test]
fn a_cancel_crossing_the_last_completion_ends_the_batch_once() {
    let mut flight = CopyFlight::new(vec![4], WINDOWS, None);
    let mut gpu = Gpu::new(1);
    gpu.feed(&mut flight);
    gpu.run_one(&mut flight);
    // The cancel arrives after the GPU finished, before the driver saw it.
    flight.stop(Stop::Cancelled);
    assert_eq!(flight.poll_outcome(), Some(Err(Stop::Cancelled)));
    assert_eq!(flight.poll_outcome(), None);
}

#[test]
fn at_the_deadline_the_batch_ends_at_once_and_its_memory_is_held_until_it_drains() {
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_millis(10);
    let mut flight = CopyFlight::new(vec![64], WINDOWS, Some(deadline));
    let mut gpu = Gpu::new(1);
    gpu.feed(&mut flight);
    assert_eq!(flight.poll_timeout(), Some(deadline));
    flight.handle_timeout(t0);
    assert_eq!(flight.poll_outcome(), None, "not before the deadline");
    flight.handle_timeout(deadline);
    assert_eq!(flight.poll_outcome(), Some(Err(Stop::TimedOut)));
    assert!(!flight.is_drained(), "windows still on the GPU");
    assert_eq!(flight.poll_window(), None);
    while gpu.run_one(&mut flight) {}
    assert!(flight.is_drained());
    assert_eq!(flight.poll_outcome(), None, "the outcome came once already");
    assert_eq!(flight.poll_timeout(), None);
}

#[test]
fn a_deadline_after_the_flight_drained_changes_nothing() {
    let t0 = Instant::now();
    let mut flight = CopyFlight::new(vec![4], WINDOWS, Some(t0));
    let mut gpu = Gpu::new(1);
    gpu.feed(&mut flight);
    gpu.run_one(&mut flight);
    flight.handle_timeout(t0 + Duration::from_secs(1));
    assert_eq!(flight.poll_outcome(), Some(Ok(())));
}

#[test]
fn an_empty_batch_ends_ok_with_nothing_queued() {
    let mut flight = CopyFlight::new(vec![0, 0], WINDOWS, None);
    assert_eq!(flight.poll_window(), None);
    assert!(flight.is_drained());
    assert_eq!(flight.poll_outcome(), Some(Ok(())));
}

/// The owner's and the importer's side, connected by two message queues.
struct Pair {
    owner: Exports<&'static str>,
    importer: Releases,
    /// The importer's flights, by the grant each uses, and their GPU.
    flights: Vec<(GrantId, CopyFlight, Gpu)>,
    /// Revokes on the way to the importer.
    to_importer: VecDeque<GrantId>,
    /// Releases on the way to the owner.
    to_owner: VecDeque<GrantId>,
    /// What the owner got back.
    returned: Vec<&'static str>,
}

const CONN: u64 = 5;

impl Pair {
    fn new() -> Self {
        Self {
            owner: Exports::default(),
            importer: Releases::default(),
            flights: Vec::new(),
            to_importer: VecDeque::new(),
            to_owner: VecDeque::new(),
            returned: Vec::new(),
        }
    }

    fn start(&mut self, grant: GrantId, len: u64) {
        let mut flight = CopyFlight::new(vec![len], WINDOWS, None);
        let mut gpu = Gpu::new(1);
        gpu.feed(&mut flight);
        self.flights.push((grant, flight, gpu));
    }

    /// One step of each side: the importer takes the revokes, its GPU runs
    /// a window per flight, it queues more and sends what it owes; the
    /// owner takes the releases.
    fn step(&mut self) {
        while let Some(grant) = self.to_importer.pop_front() {
            self.importer.owe(CONN, grant);
            for (g, flight, _) in &mut self.flights {
                if *g == grant {
                    flight.stop(Stop::Revoked { grant });
                }
            }
        }
        for (_, flight, gpu) in &mut self.flights {
            gpu.run_one(flight);
            gpu.feed(flight);
        }
        let flights = &self.flights;
        let ready = self.importer.poll_release(|_, grant| {
            flights
                .iter()
                .any(|(g, f, _)| *g == grant && !f.is_drained())
        });
        self.to_owner.extend(ready.into_iter().map(|(_, g)| g));
        while let Some(grant) = self.to_owner.pop_front() {
            if let Some(keep) = self.owner.on_released(grant, CONN) {
                self.returned.push(keep);
            }
        }
    }
}

#[test]
fn the_owner_keeps_the_memory_until_the_importer_released_it() {
    let t0 = Instant::now();
    let mut pair = Pair::new();
    pair.owner.export(1, CONN, "grant 1's memory");
    pair.start(1, 64);
    pair.step();
    assert_eq!(
        pair.owner.revoke(1, t0, Duration::from_secs(1)),
        Release::Awaiting
    );
    pair.to_importer.push_back(1);
    let mut steps = 0;
    while pair.owner.release(1) == Release::Awaiting {
        let (_, flight, _) = &pair.flights[0];
        assert!(
            pair.returned.is_empty(),
            "memory given back while the importer's copies run"
        );
        assert!(steps < 100, "the release never came");
        let _ = flight;
        pair.step();
        steps += 1;
    }
    let (_, flight, gpu) = &mut pair.flights[0];
    assert!(flight.is_drained(), "released before the flight drained");
    assert!(gpu.bytes(0) < 64, "the revoke stopped the transfer");
    assert_eq!(flight.poll_outcome(), Some(Err(Stop::Revoked { grant: 1 })));
    assert_eq!(pair.returned, ["grant 1's memory"]);
    assert!(pair.owner.is_empty() && pair.importer.is_empty());
}

#[test]
fn an_importer_that_never_releases_is_given_up_on_at_the_bound() {
    let t0 = Instant::now();
    let bound = Duration::from_millis(500);
    let mut owner: Exports<u32> = Exports::default();
    owner.export(3, CONN, 30);
    assert_eq!(owner.poll_timeout(), None, "a live grant has no deadline");
    owner.revoke(3, t0, bound);
    assert_eq!(owner.poll_timeout(), Some(t0 + bound));
    assert!(owner.handle_timeout(t0 + bound / 2).is_empty());
    assert_eq!(owner.release(3), Release::Awaiting);
    assert_eq!(owner.handle_timeout(t0 + bound), vec![(3, 30)]);
    assert_eq!(owner.release(3), Release::GivenUp, "not confirmed");
    assert!(owner.is_empty());
    // The record of it is bounded.
    for g in 100..100 + GIVEN_UP_KEPT as u64 {
        owner.export(g, CONN, 0);
        owner.revoke(g, t0, bound);
    }
    assert_eq!(owner.handle_timeout(t0 + bound).len(), GIVEN_UP_KEPT);
    assert_eq!(owner.release(3), Release::Released, "forgotten");
    assert_eq!(owner.poll_timeout(), None);
}

#[test]
fn a_release_of_a_live_grant_or_from_another_peer_changes_nothing() {
    let t0 = Instant::now();
    let mut owner: Exports<u32> = Exports::default();
    owner.export(4, CONN, 40);
    assert_eq!(
        owner.on_released(4, CONN),
        None,
        "not revoked: still granted"
    );
    owner.revoke(4, t0, Duration::from_secs(1));
    assert_eq!(owner.on_released(4, CONN + 1), None, "another connection");
    assert_eq!(owner.on_released(99, CONN), None, "never exported");
    assert_eq!(owner.release(4), Release::Awaiting);
    assert_eq!(owner.on_released(4, CONN), Some(40));
    assert_eq!(owner.on_released(4, CONN), None, "released once");
}

#[test]
fn a_revoke_of_a_grant_never_exported_is_released_at_once() {
    let mut owner: Exports<u32> = Exports::default();
    assert_eq!(
        owner.revoke(8, Instant::now(), Duration::from_secs(1)),
        Release::Released
    );
}

#[test]
fn releases_owed_to_a_gone_peer_are_forgotten() {
    let mut importer = Releases::default();
    importer.owe(1, 10);
    importer.owe(2, 20);
    importer.owe(2, 20);
    assert_eq!(importer.len(), 2, "owed once");
    importer.forget(2);
    assert_eq!(importer.poll_release(|_, _| false), vec![(1, 10)]);
    assert!(importer.is_empty());
}

#[derive(Debug, Clone)]
enum Step {
    Feed,
    Run,
    Stop(u8),
    Tick(u8),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        prop_oneof![
            4 => Just(Step::Feed),
            4 => Just(Step::Run),
            1 => (0u8..3).prop_map(Step::Stop),
            1 => (0u8..20).prop_map(Step::Tick),
        ],
        0..60,
    )
}

proptest! {
    /// Whatever the order of windows done, stops and ticks: at most
    /// `in_flight` windows on the GPU, nothing queued once stopped, every
    /// byte copied at most once, the outcome handed out exactly once, and
    /// never before the flight drained unless it timed out.
    #[test]
    fn every_flight_ends_exactly_once(
        lens in prop::collection::vec(0u64..40, 0..4),
        steps in steps(),
    ) {
        let t0 = Instant::now();
        let mut flight = CopyFlight::new(lens.clone(), WINDOWS, Some(t0 + Duration::from_millis(15)));
        let mut gpu = Gpu::new(lens.len());
        let mut outcomes = Vec::new();
        let mut stopped = false;
        for step in steps.into_iter().chain(std::iter::repeat_n(Step::Run, 200)) {
            match step {
                Step::Feed => {
                    let n = gpu.feed(&mut flight);
                    prop_assert!(!stopped || n == 0, "queued after a stop");
                }
                Step::Run => {
                    gpu.run_one(&mut flight);
                    if !stopped {
                        gpu.feed(&mut flight);
                    }
                }
                Step::Stop(k) => {
                    stopped = true;
                    flight.stop(match k {
                        0 => Stop::Cancelled,
                        1 => Stop::Failed,
                        _ => Stop::Revoked { grant: 9 },
                    });
                }
                Step::Tick(ms) => {
                    flight.handle_timeout(t0 + Duration::from_millis(u64::from(ms)));
                    stopped |= flight.stopped().is_some();
                }
            }
            prop_assert!(gpu.queue.len() <= WINDOWS.in_flight);
            if let Some(outcome) = flight.poll_outcome() {
                prop_assert!(
                    flight.is_drained() || outcome == Err(Stop::TimedOut),
                    "an outcome while windows run"
                );
                outcomes.push(outcome);
            }
        }
        prop_assert!(flight.is_drained());
        prop_assert_eq!(outcomes.len(), 1, "outcomes: {:?}", outcomes);
        for (t, &len) in lens.iter().enumerate() {
            let mut at = 0;
            for &(offset, n) in &gpu.copied[t] {
                prop_assert_eq!(offset, at);
                at += n;
            }
            prop_assert!(at <= len);
            if outcomes[0] == Ok(()) {
                prop_assert_eq!(at, len, "Ok with bytes missing");
            }
        }
    }
}

#[test]
fn a_bound_past_what_an_instant_holds_never_gives_up() {
    let t0 = Instant::now();
    let mut owner: Exports<u32> = Exports::default();
    owner.export(6, CONN, 60);
    owner.revoke(6, t0, Duration::MAX);
    assert!(
        owner
            .handle_timeout(t0 + Duration::from_secs(1 << 30))
            .is_empty()
    );
    assert_eq!(owner.release(6), Release::Awaiting);
    assert_eq!(owner.on_released(6, CONN), Some(60), "still revoked");
}

#[test]
fn one_connections_deadline_covers_its_flights_and_exports() {
    let now = Instant::now();
    let mut copies: PeerCopy<&str> = PeerCopy::default();
    assert_eq!(copies.poll_timeout(), None);
    let windows = Windows {
        slice: 4,
        slices: 1,
        in_flight: 1,
    };
    let late = copies.start(CopyFlight::new(
        vec![8],
        windows,
        Some(now + Duration::from_secs(3)),
    ));
    let early = copies.start(CopyFlight::new(
        vec![8],
        windows,
        Some(now + Duration::from_secs(5)),
    ));
    assert_ne!(late, early, "each flight named apart");
    copies.exports_mut().export(9, 1, "the grant's memory");
    copies.exports_mut().revoke(9, now, Duration::from_secs(1));
    assert_eq!(
        copies.poll_timeout(),
        Some(now + Duration::from_secs(1)),
        "the export's bound"
    );
    assert_eq!(
        copies.handle_timeout(now + Duration::from_secs(1)),
        [(9, "the grant's memory")],
        "given up on, its memory handed back"
    );
    assert_eq!(
        copies.poll_timeout(),
        Some(now + Duration::from_secs(3)),
        "a flight's"
    );
    assert!(
        copies
            .handle_timeout(now + Duration::from_secs(3))
            .is_empty()
    );
    let flight = copies.flight_mut(late).unwrap();
    assert_eq!(flight.poll_outcome(), Some(Err(Stop::TimedOut)));
    assert_eq!(copies.flight(early).unwrap().stopped(), None, "not due");
    assert_eq!(copies.poll_timeout(), Some(now + Duration::from_secs(5)));
    assert!(copies.finish(late).is_some());
    assert_eq!(copies.flights_len(), 1);
}
