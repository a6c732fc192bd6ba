//! How a peer breaks the protocol, by name (rustls's `PeerMisbehaved`):
//! each is a reason to drop the peer, said to the application.

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
}
