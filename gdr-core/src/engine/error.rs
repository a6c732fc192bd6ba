//! What can go wrong in the engine: a request's outcome ([`TransferError`],
//! delivered exactly once through its completion) and the errors of calls
//! that set things up or are refused before anything is posted
//! ([`EngineError`]).

use hal_verbs::{VerbsError, WcStatus};

use crate::descriptor::DescriptorError;
use crate::engine::setup::NotAccepted;
use crate::engine::wire::{RejectReason, WireError};
use crate::ladder::LadderError;

/// Why a request (a transfer slice, a batch, a control message) failed.
/// Every request ends exactly once: with success or one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The peer's NIC refused the access (bad rkey, outside the MR, rights
    /// missing: the grant was revoked or never covered it).
    #[error("remote access refused ({status}, vendor error {vendor_err:#x})")]
    RemoteAccess {
        /// The completion's status.
        status: WcStatus,
        /// Vendor syndrome.
        vendor_err: u32,
    },
    /// The transport retried `retry_count` times without an answer: the
    /// peer (or the path to it) is gone.
    #[error("transport retries exceeded: the peer does not answer ({status})")]
    RetryExceeded {
        /// RETRY_EXC_ERR or RNR_RETRY_EXC_ERR.
        status: WcStatus,
    },
    /// The peer disconnected, or its queue pair went away, before the
    /// request ran.
    #[error("the peer is gone: {reason}")]
    PeerGone {
        /// What said so.
        reason: String,
    },
    /// The request did not complete within its deadline. Its queue pair
    /// was stopped first, so nothing of it still runs in the NIC.
    #[error("timed out after {after:?}")]
    Timeout {
        /// The bound that passed.
        after: std::time::Duration,
    },
    /// The caller cancelled it; nothing of it still runs in the NIC.
    #[error("cancelled")]
    Cancelled,
    /// Another request on the same queue pair failed (or timed out) and the
    /// queue pair was stopped: this one was flushed without running to the
    /// end. Requests on other queue pairs are not affected.
    #[error("flushed: queue pair {qp} of the peer failed ({cause})")]
    Flushed {
        /// The QP's index within the peer.
        qp: u16,
        /// What failed it first.
        cause: String,
    },
    /// The local side failed: a local protection or length error, or a
    /// post the provider refused.
    #[error("local failure: {what}")]
    Local {
        /// The status or error.
        what: String,
    },
    /// The device reported a fatal error: everything on it failed.
    #[error("device {device} failed (fatal async event)")]
    DeviceFatal {
        /// The NIC.
        device: String,
    },
    /// The CUDA stream a gated batch waited on failed before reaching the
    /// gate ([`crate::engine::Peer::submit_after_stream`]): nothing of the
    /// batch was posted.
    #[error("the stream the batch waited on failed: {source}")]
    StreamFailed {
        /// The driver's error, with its native code.
        #[source]
        source: hal_cuda::CudaError,
    },
    /// The owner of a staging-rung region did not carry out a rendezvous
    /// transfer of it: `status` is its wire code.
    #[error("the peer refused the staged transfer: {what} (status {status})")]
    StagedRefused {
        /// The reply's status (wire code).
        status: u32,
        /// What it means.
        what: &'static str,
    },
    /// The owner revoked the grant while the request was under way: it
    /// stopped (what it moved before the revoke may have landed).
    #[error("the grant {grant} was revoked while the request was under way")]
    Revoked {
        /// The grant.
        grant: u64,
    },
}

impl TransferError {
    /// The error a failed work completion means.
    pub fn from_status(status: WcStatus, vendor_err: u32) -> Self {
        match status {
            WcStatus::REM_ACCESS_ERR | WcStatus::REM_INV_REQ_ERR | WcStatus::REM_OP_ERR => {
                Self::RemoteAccess { status, vendor_err }
            }
            WcStatus::RETRY_EXC_ERR | WcStatus::RNR_RETRY_EXC_ERR => Self::RetryExceeded { status },
            _ => Self::Local {
                what: format!("{status} (vendor error {vendor_err:#x})"),
            },
        }
    }
}

/// Errors of engine calls: setting up, connecting, and requests refused
/// before anything reaches the wire.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A verbs call failed.
    #[error("{what}: {source}")]
    Verbs {
        /// What the engine was doing.
        what: String,
        /// The HAL's error, with the native code.
        #[source]
        source: VerbsError,
    },
    /// Registering or granting memory failed.
    #[error(transparent)]
    Ladder(#[from] LadderError),
    /// A remote descriptor is malformed or does not fit the request.
    #[error("remote descriptor: {0}")]
    Descriptor(#[from] DescriptorError),
    /// The peer's handshake or a control message is malformed.
    #[error("wire format: {0}")]
    Wire(#[from] WireError),
    /// A request was refused before anything was posted.
    #[error("refused: {0}")]
    Refused(String),
    /// The descriptor names a grant this peer has not announced on this
    /// connection, or has revoked.
    #[error("grant {grant:#x} of engine {owner:#x} is not live on this connection")]
    NotGranted {
        /// The descriptor's owner engine.
        owner: u64,
        /// The grant id.
        grant: u64,
    },
    /// The request needs a right the grant does not give.
    #[error("grant {grant:#x} does not allow {op}")]
    AccessDenied {
        /// The grant id.
        grant: u64,
        /// READ or WRITE.
        op: &'static str,
    },
    /// Offset and length fall outside a region or grant.
    #[error("{what}: {len} bytes at offset {offset} exceed its {size} bytes")]
    OutOfBounds {
        /// Which side.
        what: &'static str,
        /// The offset asked for.
        offset: u64,
        /// The length asked for.
        len: u64,
        /// The size of the region or grant.
        size: u64,
    },
    /// A control message longer than the peer accepts.
    #[error("message of {len} bytes exceeds the negotiated {max}")]
    MessageTooLarge {
        /// Its length.
        len: usize,
        /// The negotiated maximum.
        max: usize,
    },
    /// The peer refused or could not complete the handshake.
    #[error("handshake with {peer}: {why}")]
    Handshake {
        /// The peer's address.
        peer: String,
        /// What went wrong.
        why: String,
    },
    /// The listener refused a queue pair of the connection, saying why:
    /// [`RejectReason::Busy`] means its backlog of connections waiting for
    /// accept is full (or it is closing): try again later. Nothing of the
    /// attempt remains on either side.
    #[error("{peer} rejected the connection: {reason}")]
    Rejected {
        /// The peer's address.
        peer: String,
        /// The reject's reason.
        reason: RejectReason,
    },
    /// Every queue pair connected, but the listening engine did not accept
    /// the connection: nobody accepted it within the connect's timeout, or
    /// the listener dropped it first (its
    /// [`accept_timeout`](crate::engine::EngineConfig::accept_timeout)).
    /// Nothing of the attempt remains on either side: connecting again
    /// succeeds once the listener accepts.
    #[error("{peer} did not accept the connection: {reason}")]
    NotAccepted {
        /// The peer's address.
        peer: String,
        /// Which way it was not accepted.
        reason: NotAccepted,
    },
    /// Waiting ran out of time.
    #[error("timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// The peer is gone (closed, failed, disconnected).
    #[error("the peer is gone: {0}")]
    PeerGone(String),
    /// No device, no path.
    #[error("{0}")]
    Unavailable(String),
    /// A CUDA call failed (the GPU fence).
    #[error("GPU: {0}")]
    Cuda(#[from] hal_cuda::CudaError),
}

impl EngineError {
    pub(crate) fn verbs(what: impl Into<String>, source: VerbsError) -> Self {
        Self::Verbs {
            what: what.into(),
            source,
        }
    }
}
