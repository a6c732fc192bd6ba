//! The peer-copy protocol with both ends running (quinn-proto's `Pair`),
//! through the crate's public API only: an owner that exports grants of
//! its GPU memory to an importer of another process ([`Exports`]), and the
//! importer copying under them a window at a time ([`CopyFlight`]) and
//! owing releases ([`Releases`]), their messages encoded with `wire` and
//! carried by links that can delay, drop or cut them. The importer's GPU
//! runs its windows on plain memories (the owner's allocation, reached
//! through the IPC handle, and its own) as far as the test lets it, so
//! each test checks which bytes were copied where, and that none was
//! copied once the owner had its memory back. Time is the pair's `now`.

mod common;

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use common::{Link, ended_once, with};
use gdr_proto::grants::GrantId;
use gdr_proto::peer_copy::{
    CopyFlight, Exports, FlightOutcome, GIVEN_UP_KEPT, Release, Releases, Slice, Stop, Windows,
};
use gdr_proto::wire::Control;

/// The connection, as both sides name it.
const CONN: u64 = 0x5e55;
/// How long the owner keeps a revoked grant's memory for the importer.
const BOUND: Duration = Duration::from_secs(1);
const WINDOWS: Windows = Windows {
    slice: 1024,
    slices: 2,
    in_flight: 2,
};
/// Bytes around each memory that nothing may ever write.
const GUARD: usize = 4096;
/// The owner's allocation (grants are ranges of it) and the importer's
/// memory, between their guards.
const MEM: usize = 48 * 1024;
/// A GPU budget that runs every window queued.
const ALL: usize = usize::MAX;
const UNTOUCHED: u8 = 0xee;

/// One transfer of a batch: `len` bytes between `local` of the importer's
/// memory and `remote` of the grant, into the grant when `write`.
#[derive(Debug, Clone, Copy)]
struct Transfer {
    write: bool,
    local: usize,
    remote: usize,
    len: u64,
}

/// A batch of the importer's under one grant, as its driver holds it.
struct Flight {
    batch: usize,
    grant: GrantId,
    /// Where the grant starts in the owner's allocation (the mapping of
    /// its handle, held until the flight drained).
    base: usize,
    transfers: Vec<Transfer>,
    proto: CopyFlight,
    /// Its windows queued on the GPU, in order.
    gpu: VecDeque<Vec<Slice>>,
    /// The importer heard the grant's revoke.
    told: bool,
}

/// The owner's engine: what it exported and its GPU allocation.
struct OwnerSide {
    exports: Exports<GrantId>,
    mem: Vec<u8>,
    /// Grants whose memory came back to it (released or given up on), in
    /// order: the memory may be reused from then on.
    reclaimed: Vec<GrantId>,
}

/// The importer's engine: the handles it holds, its batches and its GPU,
/// the releases it owes.
struct ImporterSide {
    /// Each grant's offset in the owner's allocation, from its handle.
    handles: HashMap<GrantId, usize>,
    /// Each grant's length, from its announcement.
    lens: HashMap<GrantId, u64>,
    releases: Releases,
    flights: Vec<Flight>,
    local: Vec<u8>,
    /// Windows its GPU runs per step, per batch.
    runs: usize,
    ends: Vec<(usize, FlightOutcome)>,
    /// Every `GrantReleased` sent.
    released: Vec<GrantId>,
    /// Windows queued once the importer had heard their grant's revoke
    /// (must stay 0).
    queued_after_revoke: usize,
    /// Batches that ended, but by their deadline, with windows still on
    /// the GPU (must stay 0).
    ended_early: usize,
    /// The most windows of a batch on the GPU at once.
    most_queued: usize,
}

impl ImporterSide {
    /// A message from the owner, as the engine's `on_control` takes it.
    fn receive(&mut self, message: Control<'_>) {
        match message {
            Control::GrantIpc { grant, offset, .. } => {
                self.handles.insert(grant, offset as usize);
            }
            Control::GrantAnnounce { descriptor } => {
                let grant = u64::from_le_bytes(descriptor[..8].try_into().unwrap());
                let len = u64::from_le_bytes(descriptor[8..].try_into().unwrap());
                self.lens.insert(grant, len);
            }
            // Its handle goes (the mapping stays with the batches using
            // it) and a release is owed.
            Control::GrantRevoke { grant } => {
                if self.handles.remove(&grant).is_some() {
                    self.lens.remove(&grant);
                    self.releases.owe(CONN, grant);
                    for flight in self.flights.iter_mut().filter(|f| f.grant == grant) {
                        flight.told = true;
                    }
                }
            }
            other => panic!("the importer got {other:?}"),
        }
    }

    /// The driver's progress: stops the batches whose grant's handle went
    /// (before queueing more under it), deadlines, the next windows, the
    /// ends, then the releases owed once no batch uses their grant.
    fn progress(&mut self, now: Instant, to_owner: &mut Link) {
        for flight in &mut self.flights {
            if !self.handles.contains_key(&flight.grant) {
                flight.proto.stop(Stop::Revoked {
                    grant: flight.grant,
                });
            }
            flight.proto.handle_timeout(now);
            while let Some(window) = flight.proto.poll_window() {
                self.queued_after_revoke += usize::from(flight.told);
                flight.gpu.push_back(window);
            }
            self.most_queued = self.most_queued.max(flight.gpu.len());
            if let Some(outcome) = flight.proto.poll_outcome() {
                if outcome != Err(Stop::TimedOut) && !flight.gpu.is_empty() {
                    self.ended_early += 1;
                }
                self.ends.push((flight.batch, outcome));
            }
        }
        self.flights.retain(|f| !f.proto.is_drained());
        let flights = &self.flights;
        let ready = self
            .releases
            .poll_release(|_, grant| flights.iter().any(|f| f.grant == grant));
        for (_, grant) in ready {
            self.released.push(grant);
            to_owner.send(&Control::GrantReleased { grant });
        }
    }
}

/// The owner `o` and the importer `i`, and the link each way.
struct Pair {
    now: Instant,
    o: OwnerSide,
    i: ImporterSide,
    to_owner: Link,
    to_importer: Link,
    next_batch: usize,
    /// Bytes the importer's GPU wrote into or read from the owner's memory
    /// once it had come back to the owner (must stay 0).
    after_reclaim: u64,
}

impl Pair {
    fn new() -> Self {
        let memory = |seed: usize| {
            let mut mem = vec![UNTOUCHED; GUARD + MEM + GUARD];
            for (i, byte) in mem[GUARD..GUARD + MEM].iter_mut().enumerate() {
                *byte = ((i * seed) % 251) as u8;
            }
            mem
        };
        Self {
            now: Instant::now(),
            o: OwnerSide {
                exports: Exports::default(),
                mem: memory(7),
                reclaimed: Vec::new(),
            },
            i: ImporterSide {
                handles: HashMap::new(),
                lens: HashMap::new(),
                releases: Releases::default(),
                flights: Vec::new(),
                local: memory(13),
                runs: ALL,
                ends: Vec::new(),
                released: Vec::new(),
                queued_after_revoke: 0,
                ended_early: 0,
                most_queued: 0,
            },
            to_owner: Link::default(),
            to_importer: Link::default(),
            next_batch: 0,
            after_reclaim: 0,
        }
    }

    /// The owner grants `len` bytes at `at` of its allocation: the IPC
    /// handle, then the announcement.
    fn export(&mut self, grant: GrantId, at: usize, len: u64) {
        self.o.exports.export(grant, CONN, grant);
        self.to_importer.send(&Control::GrantIpc {
            grant,
            offset: (GUARD + at) as u64,
            handle: [grant as u8; 64],
        });
        let descriptor = [grant.to_le_bytes(), len.to_le_bytes()].concat();
        self.to_importer.send(&Control::GrantAnnounce {
            descriptor: &descriptor,
        });
    }

    /// The owner revokes `grant`: the memory is kept for the importer,
    /// and it is told.
    fn revoke(&mut self, grant: GrantId) -> Release {
        let release = self.o.exports.revoke(grant, self.now, BOUND);
        self.to_importer.send(&Control::GrantRevoke { grant });
        release
    }

    /// The importer submits a batch under `grant` (checked against the
    /// grant as the engine does), due by `deadline`.
    fn start(
        &mut self,
        grant: GrantId,
        transfers: &[Transfer],
        deadline: Option<Instant>,
    ) -> usize {
        let base = self.i.handles[&grant];
        for t in transfers {
            assert!(t.remote as u64 + t.len <= self.i.lens[&grant]);
        }
        let batch = self.next_batch;
        self.next_batch += 1;
        let lens = transfers.iter().map(|t| t.len).collect();
        self.i.flights.push(Flight {
            batch,
            grant,
            base,
            transfers: transfers.to_vec(),
            proto: CopyFlight::new(lens, WINDOWS, deadline),
            gpu: VecDeque::new(),
            told: false,
        });
        batch
    }

    fn step(&mut self) {
        self.pump_owner();
        self.pump_importer();
    }

    fn run(&mut self, steps: usize) {
        for _ in 0..steps {
            self.step();
        }
    }

    /// The owner's engine: the importer's releases, then the bound.
    fn pump_owner(&mut self) {
        let o = &mut self.o;
        self.to_owner.deliver(|m| match m {
            Control::GrantReleased { grant } => {
                if let Some(kept) = o.exports.on_released(grant, CONN) {
                    o.reclaimed.push(kept);
                }
            }
            other => panic!("the owner got {other:?}"),
        });
        let given_up = o.exports.handle_timeout(self.now);
        o.reclaimed
            .extend(given_up.into_iter().map(|(_, kept)| kept));
    }

    /// The importer's engine: the owner's messages, the windows its GPU
    /// ran, then its progress.
    fn pump_importer(&mut self) {
        let i = &mut self.i;
        self.to_importer.deliver(|m| i.receive(m));
        for flight in &mut i.flights {
            for _ in 0..i.runs {
                let Some(window) = flight.gpu.pop_front() else {
                    break;
                };
                assert!(window.len() <= WINDOWS.slices);
                for slice in window {
                    assert!(slice.len > 0 && slice.len <= WINDOWS.slice);
                    let t = flight.transfers[slice.transfer];
                    let n = slice.len as usize;
                    let remote = flight.base + t.remote + slice.offset as usize;
                    let local = GUARD + t.local + slice.offset as usize;
                    if self.o.reclaimed.contains(&flight.grant) {
                        self.after_reclaim += slice.len;
                    }
                    if t.write {
                        self.o.mem[remote..remote + n].copy_from_slice(&i.local[local..local + n]);
                    } else {
                        i.local[local..local + n].copy_from_slice(&self.o.mem[remote..remote + n]);
                    }
                }
                flight.proto.window_done();
            }
        }
        i.progress(self.now, &mut self.to_owner);
    }

    fn assert_guards(&self) {
        let untouched = |bytes: &[u8]| bytes.iter().all(|&b| b == UNTOUCHED);
        for mem in [&self.o.mem, &self.i.local] {
            assert!(untouched(&mem[..GUARD]) && untouched(&mem[GUARD + MEM..]));
        }
    }
}

fn write(local: usize, remote: usize, len: u64) -> Transfer {
    Transfer {
        write: true,
        local,
        remote,
        len,
    }
}

#[test]
fn a_batch_copies_in_windows_and_lands_every_byte_where_granted_and_nowhere_else() {
    let mut p = Pair::new();
    let at = 1000;
    p.export(1, at, 40_000);
    p.step();
    let (mem0, local0) = (p.o.mem.clone(), p.i.local.clone());
    let read = Transfer {
        write: false,
        local: 20_000,
        remote: 20_000,
        len: 7_777,
    };
    let transfers = [write(0, 0, 10_000), read, write(30_000, 39_999, 1)];
    let batch = p.start(1, &transfers, None);
    // The GPU runs one window a step: the next ones wait their turn.
    p.i.runs = 1;
    for _ in 0..40 {
        p.step();
    }
    let ends = ended_once(&p.i.ends, &[batch]);
    assert_eq!(ends[&batch], Ok(()));
    assert_eq!(
        p.i.most_queued, WINDOWS.in_flight,
        "windows overlap, bounded"
    );
    assert!(p.i.flights.is_empty());
    let g = GUARD + at;
    let want_mem = with(&mem0, g, &local0, GUARD, 10_000);
    let want_mem = with(&want_mem, g + 39_999, &local0, GUARD + 30_000, 1);
    assert!(p.o.mem == want_mem, "the owner's memory");
    let want_local = with(&local0, GUARD + 20_000, &mem0, g + 20_000, 7_777);
    assert!(p.i.local == want_local, "the importer's memory");
    p.assert_guards();
    assert_eq!(p.o.exports.len(), 1, "still granted");
    assert!(p.i.released.is_empty() && p.o.reclaimed.is_empty());
    // A confused importer's release of the grant still live takes nothing
    // from it.
    p.to_owner.send(&Control::GrantReleased { grant: 1 });
    p.run(2);
    assert!(p.o.reclaimed.is_empty());
    assert_eq!(p.o.exports.release(1), Release::Awaiting, "still exported");
}

#[test]
fn a_revoke_mid_copy_stops_the_batch_at_its_next_window_and_the_memory_waits_for_the_release() {
    let mut p = Pair::new();
    p.export(1, 0, 40_000);
    p.step();
    let (mem0, local0) = (p.o.mem.clone(), p.i.local.clone());
    let len = 32 * WINDOWS.slice;
    let batch = p.start(1, &[write(0, 0, len)], None);
    p.i.runs = 1;
    p.run(4);
    // The revoke's notice is delayed: the importer, not told yet, goes on.
    p.to_importer.hold();
    assert_eq!(p.revoke(1), Release::Awaiting);
    p.run(2);
    assert!(p.i.ends.is_empty());
    p.to_importer.release();
    for _ in 0..20 {
        p.step();
    }
    assert_eq!(
        p.i.queued_after_revoke, 0,
        "a window queued after the revoke"
    );
    assert_eq!(p.i.ended_early, 0, "ended before its windows ran");
    let ends = ended_once(&p.i.ends, &[batch]);
    assert_eq!(ends[&batch], Err(Stop::Revoked { grant: 1 }));
    // A prefix of whole windows was copied, where it belongs; the rest of
    // the grant is as it was.
    let copied = (0..len as usize)
        .take_while(|&k| p.o.mem[GUARD + k] == local0[GUARD + k])
        .count();
    let window = WINDOWS.slice as usize * WINDOWS.slices;
    assert!(copied > 0 && copied < len as usize, "the revoke stopped it");
    let copied = copied.div_ceil(window) * window;
    assert!(p.o.mem == with(&mem0, GUARD, &local0, GUARD, copied as u64));
    // Released once, after its last window ran: only then is the memory
    // the owner's again.
    assert_eq!(p.i.released, [1]);
    assert_eq!(p.o.reclaimed, [1]);
    assert_eq!(p.after_reclaim, 0, "copied after the owner got it back");
    assert_eq!(p.o.exports.release(1), Release::Released);
    assert!(p.o.exports.is_empty() && p.i.releases.is_empty());
    p.assert_guards();
}

#[test]
fn the_owner_keeps_a_revoked_grants_memory_until_the_importer_releases_it_however_slow() {
    let mut p = Pair::new();
    p.export(1, 0, 40_000);
    p.step();
    let batch = p.start(1, &[write(0, 0, 16 * WINDOWS.slice)], None);
    p.i.runs = 1;
    p.run(2);
    // The importer's GPU stalls with windows queued under the grant.
    p.i.runs = 0;
    p.step();
    assert!(p.i.flights[0].gpu.len() == WINDOWS.in_flight);
    let t0 = p.now;
    assert_eq!(p.revoke(1), Release::Awaiting);
    p.run(3);
    assert_eq!(p.i.releases.len(), 1, "owed, not sendable yet");
    p.now = t0 + BOUND / 2;
    p.run(3);
    assert_eq!(p.o.exports.release(1), Release::Awaiting);
    assert!(
        p.o.reclaimed.is_empty(),
        "given back while its copies are queued"
    );
    assert!(p.i.released.is_empty());
    // The windows run, the batch drains: the release comes back.
    p.i.runs = ALL;
    p.run(3);
    let ends = ended_once(&p.i.ends, &[batch]);
    assert_eq!(ends[&batch], Err(Stop::Revoked { grant: 1 }));
    assert_eq!(p.i.released, [1]);
    assert_eq!(p.o.reclaimed, [1]);
    assert_eq!(p.after_reclaim, 0);
    assert_eq!(p.o.exports.release(1), Release::Released);
    // The bound passing later changes nothing.
    p.now = t0 + 2 * BOUND;
    p.run(2);
    assert_eq!(p.o.reclaimed, [1], "given back once");
    assert_eq!(p.o.exports.poll_timeout(), None);
    p.assert_guards();
}

#[test]
fn an_importer_that_never_releases_costs_the_owner_its_grants_only_until_the_bound() {
    let mut p = Pair::new();
    let grants: Vec<GrantId> = (1..=GIVEN_UP_KEPT as u64 + 2).collect();
    for &grant in &grants {
        p.export(grant, 16 * grant as usize, 16);
    }
    p.step();
    let batch = p.start(1, &[write(0, 0, 16)], None);
    p.run(2);
    // Its releases never reach the owner.
    p.to_owner
        .lose(|m| matches!(m, Control::GrantReleased { .. }));
    let t0 = p.now;
    for &grant in &grants {
        assert_eq!(p.revoke(grant), Release::Awaiting);
    }
    p.run(3);
    assert_eq!(p.i.released.len(), grants.len(), "sent, and lost");
    assert_eq!(p.o.exports.len(), grants.len());
    assert_eq!(p.o.exports.poll_timeout(), Some(t0 + BOUND));
    p.now = t0 + BOUND - Duration::from_nanos(1);
    p.step();
    assert!(p.o.reclaimed.is_empty(), "given up before the bound");
    // At the bound every grant comes back, once, unconfirmed; the record of
    // those given up on is bounded too.
    p.now = t0 + BOUND;
    p.step();
    let mut reclaimed = p.o.reclaimed.clone();
    reclaimed.sort_unstable();
    assert_eq!(reclaimed, grants, "each given back once");
    assert!(p.o.exports.is_empty());
    assert_eq!(p.o.exports.poll_timeout(), None);
    let given_up = grants
        .iter()
        .filter(|&&g| p.o.exports.release(g) == Release::GivenUp)
        .count();
    assert_eq!(given_up, GIVEN_UP_KEPT);
    // A release that comes late changes nothing.
    p.to_owner.lose(|_| false);
    p.to_owner.send(&Control::GrantReleased { grant: 1 });
    p.run(2);
    assert_eq!(p.o.reclaimed.len(), grants.len());
    assert_eq!(ended_once(&p.i.ends, &[batch])[&batch], Ok(()));
}
