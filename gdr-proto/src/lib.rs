//! The sans-IO protocol of gdr's transfer engine.
//!
//! Everything here is plain data and state machines in quinn-proto's shape:
//! no I/O, no threads, no locks, no clock reads, no HAL. Inputs come in as
//! method calls (a control message received, a connection event, a request
//! that ended, `handle_timeout(now)` with a time the caller read); what to
//! do comes out as return values and `poll_*` methods, each of which says
//! which calls may change its answer. The engine in `gdr-core` is the
//! driver: it reads the clock, owns the NICs and GPUs, feeds the state
//! machines here and carries out what they decide. Because nothing here
//! touches a device, every protocol is tested in memory, two endpoints
//! driven step by step, with no simulator.
//!
//! - [`connection`]: one peer's connection: the machines below that are
//!   per peer (recovery, grants both ways, inbox, outbox) in one object,
//!   the connection-level control messages dispatched, one deadline.
//! - [`batches`]: batches of work requests on a peer's queue pairs
//!   (depth, selective signalling, the peer's receives, deadlines with a
//!   grace for the flushes; each batch told once, its memory held until
//!   the NIC gave back its last request).
//! - [`wire`]: the formats on the wire (connection handshake, rejects,
//!   control messages), strict decoders that never panic.
//! - [`limits`]: every bound on what a peer can make this side hold, and
//!   the deadlines of what waits on it ([`PeerLimits`]); a peer past one
//!   misbehaves ([`PeerMisbehaved`]).
//! - [`gate`]: gated batches (held until a GPU stream reaches a point):
//!   what a gate does with what the driver saw of its stream, and the
//!   page of words the streams write (a late write never opens a later
//!   gate).
//! - [`grants`]: the grants this side made (with the revocation fence:
//!   once a revoke completes, no byte moves under the grant) and the ones
//!   a peer announced (bounded).
//! - [`inbox`]: the peer's messages nobody received yet (bounded).
//! - [`outbox`]: this side's messages waiting for a send slot (bounded,
//!   each with a deadline, in order).
//! - [`pipeline`]: the staging pipeline (slices through a pinned bounce
//!   pool, copies and the wire overlapped; failures drain, exactly once).
//! - [`rendezvous`]: both sides of the slotted rendezvous (slots,
//!   credits, revokes, the bound and deadline of a peer's staged requests).
//! - [`peer_copy`]: the peer-copy path (the requester's device copies,
//!   queued a window at a time so that a revoke stops them; the owner's
//!   exported IPC handles kept until the importer released them).
//! - [`reconnect`]: re-establishing a peer's failed queue pairs (what
//!   each side does once one drained, its deadline, when the peer is gone).
//! - [`setup`]: connection set-up: the listener's backlog of sessions
//!   waiting for accept (bounded, with deadlines) and the connector's dial
//!   (one deadline, teardown on failure).

#![deny(missing_docs)]

pub mod batches;
pub mod connection;
mod error;
pub mod gate;
pub mod grants;
pub mod inbox;
pub mod limits;
mod mutant;
pub mod outbox;
pub mod peer_copy;
pub mod pipeline;
pub mod receives;
pub mod reconnect;
pub mod rendezvous;
pub mod setup;
pub mod wire;

pub use error::PeerMisbehaved;
pub use limits::PeerLimits;
