//! How a peer breaks the protocol, by name (rustls's `PeerMisbehaved`):
//! each is a reason to drop the peer, said to the application.

use crate::wire::WireError;

/// A way a peer broke the protocol or pushed past a bound of
/// [`crate::PeerLimits`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerMisbehaved {
    /// It announced more live grants than this side holds for a peer.
    #[error("the peer announced more than {max} live grants")]
    TooManyGrants {
        /// The bound.
        max: usize,
    },
    /// It sent more messages than the application has taken, past the
    /// bound.
    #[error("the peer sent more than {max} messages nobody received")]
    TooManyMessages {
        /// The bound.
        max: usize,
    },
    /// The bytes of messages nobody received passed the bound.
    #[error("the peer sent more than {max} bytes of messages nobody received")]
    TooManyMessageBytes {
        /// The bound.
        max: usize,
    },
    /// It sent a control message that does not decode: truncated, of an
    /// unknown kind, a reserved field set, a field out of range.
    #[error("the peer sent a malformed control message: {0}")]
    Malformed(WireError),
    /// It announced a grant whose descriptor does not decode.
    #[error("the peer announced a grant with a malformed descriptor")]
    MalformedGrant,
    /// It announced a grant of another engine than itself.
    #[error("the peer (engine {peer:#x}) announced a grant of engine {owner:#x}")]
    ForeignGrant {
        /// The engine the descriptor names.
        owner: u64,
        /// The peer's own engine.
        peer: u64,
    },
    /// The owner of a staged request lent a slot that does not fit the
    /// request or its slots, or one still carrying a slice.
    #[error(
        "the owner lent slot {slot} for {len} bytes at {offset}, outside the request or its \
         slots, or a slot still in use"
    )]
    BadCredit {
        /// The slot named.
        slot: u32,
        /// The slice's offset.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// It named a landing slot (or a length) that is not one this side
    /// lent.
    #[error("the peer named landing slot {slot} of {len} bytes, not one of ours")]
    UnknownSlot {
        /// The slot named.
        slot: u32,
        /// The length named.
        len: u64,
    },
    /// The owner of a staged request ended it before every slice moved.
    #[error("the owner ended the request before every slice")]
    EndedEarly,
}
