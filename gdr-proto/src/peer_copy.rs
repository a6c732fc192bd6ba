//! The peer-copy path's protocol: GPU memory of two engines on one host,
//! moved by the *requester's* device copies (no NIC, no owner in the loop).
//!
//! Because the requester copies, the owner's revoke can stop a transfer only
//! with the requester's help, so copies are never queued all at once:
//!
//! - [`CopyFlight`]: one batch cut into slices and queued a *window* at a
//!   time (at most a few windows on the GPU). Before each window the driver
//!   checks that every grant the batch uses is still live and stops the
//!   flight if not ([`CopyFlight::stop`]); a stopped flight queues nothing
//!   more and ends once the windows already queued have run. The revoke's
//!   fence therefore waits for at most the windows in flight, never the
//!   whole transfer.
//! - [`Exports`]: the owner's side of the cross-process route. A CUDA IPC
//!   handle cannot be taken back, so after a revoke the owner keeps the
//!   grant's memory until the importer says it has nothing queued under it
//!   ([`crate::wire::Control::GrantReleased`]) or a bound passes: only a
//!   cooperating importer can be fenced (`peer_copy: false` is the setting
//!   for peers that are not trusted that far).
//! - [`Releases`]: the importer's side: the releases it owes, sent once no
//!   flight uses the revoked grant any more.
//!
//! [`PeerCopy`] holds the three for one connection (gdr-proto's
//! [`crate::connection::Connection`] keeps one): this side's flights to
//! the peer, the grants exported to it and the releases owed it, with one
//! deadline over the flights' deadlines and the exports' bounds.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::grants::GrantId;

/// One slice of a flight: `len` bytes at `offset` of transfer `transfer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    /// The transfer's index in the batch.
    pub transfer: usize,
    /// Where the slice starts within the transfer.
    pub offset: u64,
    /// Its length, nonzero.
    pub len: u64,
}

/// Why a flight stopped queueing copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// A grant it copies under was revoked (or its peer's handle went).
    Revoked {
        /// The grant.
        grant: GrantId,
    },
    /// The caller cancelled the batch.
    Cancelled,
    /// A copy could not be queued, or a queued one failed.
    Failed,
    /// The deadline passed.
    TimedOut,
}

/// How a flight's batch ends.
pub type FlightOutcome = Result<(), Stop>;

/// The shape of a flight's windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    /// Largest slice, nonzero.
    pub slice: u64,
    /// Slices per window, nonzero.
    pub slices: usize,
    /// Windows queued on the GPU at once, nonzero: two keep the GPU busy
    /// while the driver learns that one ended and queues the next.
    pub in_flight: usize,
}

/// One batch of peer copies (see the module docs).
#[derive(Debug)]
pub struct CopyFlight {
    lens: Vec<u64>,
    windows: Windows,
    /// The next slice to queue: (transfer, offset).
    next: (usize, u64),
    /// Windows queued and not yet reported done.
    queued: usize,
    stop: Option<Stop>,
    deadline: Option<Instant>,
    /// The batch's outcome was handed out.
    ended: bool,
}

impl CopyFlight {
    /// A flight of transfers of `lens` bytes, due by `deadline`.
    pub fn new(lens: Vec<u64>, windows: Windows, deadline: Option<Instant>) -> Self {
        let windows = Windows {
            slice: windows.slice.max(1),
            slices: windows.slices.max(1),
            in_flight: windows.in_flight.max(1),
        };
        let mut flight = Self {
            lens,
            windows,
            next: (0, 0),
            queued: 0,
            stop: None,
            deadline,
            ended: false,
        };
        flight.skip_empty();
        flight
    }

    fn skip_empty(&mut self) {
        while self.next.0 < self.lens.len() && self.next.1 >= self.lens[self.next.0] {
            self.next = (self.next.0 + 1, 0);
        }
    }

    fn exhausted(&self) -> bool {
        self.next.0 >= self.lens.len()
    }

    /// The next window to queue, counted as queued: `None` once stopped,
    /// once every slice was handed out, or while the most windows are on
    /// the GPU. Changes after [`CopyFlight::window_done`] and
    /// [`CopyFlight::stop`].
    pub fn poll_window(&mut self) -> Option<Vec<Slice>> {
        if self.stop.is_some() || self.exhausted() || self.queued >= self.windows.in_flight {
            return None;
        }
        let mut window = Vec::with_capacity(self.windows.slices);
        while window.len() < self.windows.slices && !self.exhausted() {
            let (transfer, offset) = self.next;
            let len = (self.lens[transfer] - offset).min(self.windows.slice);
            window.push(Slice {
                transfer,
                offset,
                len,
            });
            self.next.1 += len;
            self.skip_empty();
        }
        self.queued += 1;
        Some(window)
    }

    /// The oldest queued window has run (or, failed, will never run more).
    pub fn window_done(&mut self) {
        debug_assert!(self.queued > 0, "a window done that was never queued");
        self.queued = self.queued.saturating_sub(1);
    }

    /// Queues nothing more: the first reason is the one the batch ends
    /// with (a revoke after the last window was queued still fails it:
    /// the requests under way when a revoke comes fail).
    pub fn stop(&mut self, why: Stop) {
        self.stop.get_or_insert(why);
    }

    /// Why it stopped, if it did.
    pub fn stopped(&self) -> Option<Stop> {
        self.stop
    }

    /// The time passed `now`: past the deadline the flight stops (the
    /// batch ends at once with [`Stop::TimedOut`] from
    /// [`CopyFlight::poll_outcome`]; its windows still drain).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.deadline.is_some_and(|at| now >= at) && !self.is_drained() {
            self.stop(Stop::TimedOut);
        }
    }

    /// When [`CopyFlight::handle_timeout`] next has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.ended { None } else { self.deadline }
    }

    /// Whether nothing of the flight is queued on the GPU and nothing more
    /// will be: the driver may let go of the memory it holds for it.
    pub fn is_drained(&self) -> bool {
        self.queued == 0 && (self.stop.is_some() || self.exhausted())
    }

    /// The batch's outcome, handed out once: when the flight drained, or
    /// at once when its deadline passed (the memory still held until it
    /// drains). Changes after [`CopyFlight::window_done`],
    /// [`CopyFlight::stop`] and [`CopyFlight::handle_timeout`].
    pub fn poll_outcome(&mut self) -> Option<FlightOutcome> {
        if self.ended {
            return None;
        }
        let outcome = match self.stop {
            Some(Stop::TimedOut) => Err(Stop::TimedOut),
            _ if !self.is_drained() => return None,
            Some(why) => Err(why),
            None => Ok(()),
        };
        self.ended = true;
        Some(outcome)
    }
}

/// The owner's grants whose CUDA IPC handle went to a peer of another
/// process (see the module docs), each holding `K` (what keeps its memory)
/// until the importer released it or the bound after its revoke passed.
#[derive(Debug)]
pub struct Exports<K> {
    grants: HashMap<GrantId, Export<K>>,
    /// The last grants given up on at the bound (at most
    /// [`GIVEN_UP_KEPT`]), so that a revoke waiting on one learns that it
    /// was not confirmed.
    given_up: VecDeque<GrantId>,
}

/// Grants given up on that [`Exports::release`] still reports as such.
pub const GIVEN_UP_KEPT: usize = 64;

#[derive(Debug)]
struct Export<K> {
    /// The connection the handle went to.
    peer: u64,
    keep: K,
    revoked: bool,
    /// When a revoked grant is given up on (`None`: never, for a bound
    /// past what an `Instant` holds).
    release_by: Option<Instant>,
}

impl<K> Default for Exports<K> {
    fn default() -> Self {
        Self {
            grants: HashMap::new(),
            given_up: VecDeque::new(),
        }
    }
}

/// How a revoke of an exported grant stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Not exported, or released: nothing the importer queued remains.
    Released,
    /// The importer has not said it released the handle's copies yet.
    Awaiting,
    /// The bound passed without the importer's release: the memory was
    /// given back unconfirmed (among the last [`GIVEN_UP_KEPT`] such).
    GivenUp,
}

impl<K> Exports<K> {
    /// Grant `grant`'s handle went to connection `peer`; `keep` holds its
    /// memory.
    pub fn export(&mut self, grant: GrantId, peer: u64, keep: K) {
        self.grants.insert(
            grant,
            Export {
                peer,
                keep,
                revoked: false,
                release_by: None,
            },
        );
    }

    /// The grant was revoked at `now`: its memory is kept until the
    /// importer releases it, at most `bound`.
    pub fn revoke(&mut self, grant: GrantId, now: Instant, bound: Duration) -> Release {
        match self.grants.get_mut(&grant) {
            Some(export) => {
                if !export.revoked {
                    export.revoked = true;
                    export.release_by = now.checked_add(bound);
                }
                Release::Awaiting
            }
            None => Release::Released,
        }
    }

    /// Connection `peer` released `grant`: what kept it comes back, if the
    /// grant was exported to that peer and revoked (a release of a live
    /// grant, or from another peer, changes nothing).
    pub fn on_released(&mut self, grant: GrantId, peer: u64) -> Option<K> {
        match self.grants.get(&grant) {
            Some(e) if e.peer == peer && e.revoked => self.grants.remove(&grant).map(|e| e.keep),
            _ => None,
        }
    }

    /// How grant `grant`'s revoke stands.
    pub fn release(&self, grant: GrantId) -> Release {
        if self.grants.contains_key(&grant) {
            Release::Awaiting
        } else if self.given_up.contains(&grant) {
            Release::GivenUp
        } else {
            Release::Released
        }
    }

    /// The revoked grants whose bound passed by `now`, given up on (their
    /// memory comes back to be dropped).
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<(GrantId, K)> {
        let expired: Vec<GrantId> = self
            .grants
            .iter()
            .filter(|(_, e)| e.release_by.is_some_and(|at| now >= at))
            .map(|(&g, _)| g)
            .collect();
        for &grant in &expired {
            if self.given_up.len() == GIVEN_UP_KEPT {
                self.given_up.pop_front();
            }
            self.given_up.push_back(grant);
        }
        expired
            .into_iter()
            .filter_map(|g| self.grants.remove(&g).map(|e| (g, e.keep)))
            .collect()
    }

    /// When [`Exports::handle_timeout`] next has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.grants.values().filter_map(|e| e.release_by).min()
    }

    /// Grants exported and not released (revoked or not).
    pub fn len(&self) -> usize {
        self.grants.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }
}

/// The importer's releases owed: grants revoked by their owner whose IPC
/// handle this side had, by (connection, grant).
#[derive(Debug, Default)]
pub struct Releases {
    owed: Vec<(u64, GrantId)>,
}

impl Releases {
    /// The owner on connection `peer` revoked `grant`, whose handle this
    /// side had.
    pub fn owe(&mut self, peer: u64, grant: GrantId) {
        if !self.owed.contains(&(peer, grant)) {
            self.owed.push((peer, grant));
        }
    }

    /// The releases to send now: those of grants no flight uses any more
    /// (`in_use` says which are), handed out once. Changes after
    /// [`Releases::owe`] and whenever a flight drains.
    pub fn poll_release(
        &mut self,
        mut in_use: impl FnMut(u64, GrantId) -> bool,
    ) -> Vec<(u64, GrantId)> {
        let mut ready = Vec::new();
        self.owed.retain(|&(peer, grant)| {
            if in_use(peer, grant) {
                true
            } else {
                ready.push((peer, grant));
                false
            }
        });
        ready
    }

    /// Connection `peer` is gone: nothing can be sent to it.
    pub fn forget(&mut self, peer: u64) {
        self.owed.retain(|&(p, _)| p != peer);
    }

    /// Releases owed.
    pub fn len(&self) -> usize {
        self.owed.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.owed.is_empty()
    }
}

/// A flight's name within its connection's [`PeerCopy`].
pub type FlightId = u64;

/// The peer-copy path's state of one connection: this side's flights to
/// the peer (their windows), our grants exported to it (each holding `K`)
/// and the releases we owe it.
#[derive(Debug)]
pub struct PeerCopy<K> {
    flights: BTreeMap<FlightId, CopyFlight>,
    next_flight: FlightId,
    exports: Exports<K>,
    releases: Releases,
}

impl<K> Default for PeerCopy<K> {
    fn default() -> Self {
        Self {
            flights: BTreeMap::new(),
            next_flight: 0,
            exports: Exports::default(),
            releases: Releases::default(),
        }
    }
}

impl<K> PeerCopy<K> {
    /// Takes `flight` on; the id names it to the other calls.
    pub fn start(&mut self, flight: CopyFlight) -> FlightId {
        let id = self.next_flight;
        self.next_flight += 1;
        self.flights.insert(id, flight);
        id
    }

    /// Flight `id`, while it is held.
    pub fn flight(&self, id: FlightId) -> Option<&CopyFlight> {
        self.flights.get(&id)
    }

    /// Flight `id`, to step.
    pub fn flight_mut(&mut self, id: FlightId) -> Option<&mut CopyFlight> {
        self.flights.get_mut(&id)
    }

    /// Lets go of flight `id` (the driver does once it drained and its
    /// outcome was handed out).
    pub fn finish(&mut self, id: FlightId) -> Option<CopyFlight> {
        self.flights.remove(&id)
    }

    /// Flights held.
    pub fn flights_len(&self) -> usize {
        self.flights.len()
    }

    /// The grants exported to the peer.
    pub fn exports(&self) -> &Exports<K> {
        &self.exports
    }

    /// The grants exported to the peer, to change.
    pub fn exports_mut(&mut self) -> &mut Exports<K> {
        &mut self.exports
    }

    /// The releases owed the peer.
    pub fn releases(&self) -> &Releases {
        &self.releases
    }

    /// The releases owed the peer, to change.
    pub fn releases_mut(&mut self) -> &mut Releases {
        &mut self.releases
    }

    /// The earliest deadline: a flight's, or an export's bound after its
    /// revoke.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.flights
            .values()
            .filter_map(CopyFlight::poll_timeout)
            .chain(self.exports.poll_timeout())
            .min()
    }

    /// The time passed `now`: flights past their deadline stop (their
    /// outcome comes out of [`CopyFlight::poll_outcome`]); exports past
    /// their bound are given up on (returned, with what kept them).
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<(GrantId, K)> {
        for flight in self.flights.values_mut() {
            flight.handle_timeout(now);
        }
        self.exports.handle_timeout(now)
    }
}

#[cfg(test)]
mod tests;
