//! Every bound on what a peer can make this side hold, in one place.
//!
//! A peer is untrusted: each piece of state it creates here (a grant it
//! announced, a message nobody received yet, a staged request being
//! served) counts against a per-peer bound, and the ones that wait on the
//! peer have a deadline. Past a bound the peer's next message or request is
//! refused with a typed error it sees, or the peer is dropped with a named
//! reason ([`crate::PeerMisbehaved`]); our memory stays under the bound
//! either way.

use std::time::Duration;

/// The per-peer bounds and deadlines (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerLimits {
    /// Grants the peer may have announced to this side and not revoked.
    /// One more drops the peer ([`crate::PeerMisbehaved::TooManyGrants`]):
    /// its announcement cannot be refused without losing track of what it
    /// granted.
    pub max_remote_grants: usize,
    /// The peer's messages (`Peer::send`) this side has received and the
    /// application has not taken (`Peer::recv`). One more drops the peer
    /// ([`crate::PeerMisbehaved::TooManyMessages`]).
    pub max_inbox_messages: usize,
    /// Bytes of those messages. One more message past it drops the peer
    /// ([`crate::PeerMisbehaved::TooManyMessageBytes`]).
    pub max_inbox_bytes: usize,
    /// Staged requests (rendezvous) of the peer this side serves at once,
    /// waiting ones included: one more is refused with a status the peer
    /// sees (busy), nothing of it kept.
    pub max_staged_requests: usize,
    /// How long a staged request may take from its arrival here: past it
    /// the request fails (timed out, told to the peer) and every slot lent
    /// to it is taken back.
    pub staged_request_timeout: Duration,
}

impl PeerLimits {
    /// The defaults: room for a busy inference server's peers, small
    /// enough that a hostile one costs little (~16 MiB of grant tables,
    /// 64 MiB of messages).
    pub const DEFAULT: Self = Self {
        max_remote_grants: 65_536,
        max_inbox_messages: 16_384,
        max_inbox_bytes: 64 << 20,
        max_staged_requests: 1_024,
        staged_request_timeout: Duration::from_secs(60),
    };
}

// A bound of zero would refuse the protocol's own first step.
const _: () = assert!(PeerLimits::DEFAULT.max_remote_grants > 0);
const _: () = assert!(PeerLimits::DEFAULT.max_inbox_messages > 0);
const _: () = assert!(PeerLimits::DEFAULT.max_staged_requests > 0);

impl Default for PeerLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}
