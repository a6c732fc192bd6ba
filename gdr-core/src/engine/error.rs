//! What can go wrong in the engine: a request's outcome ([`TransferError`],
//! delivered exactly once through its completion) and the errors of calls
//! that set things up or are refused before anything is posted
//! ([`EngineError`]).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use gdr_proto::PeerMisbehaved;
use gdr_proto::outbox::OutboxFull;
use gdr_proto::reconnect::{GiveUp, Gone};
use gdr_proto::setup::DialError;
use hal_verbs::{AsyncEvent, ConnectionState, VerbsError, WcStatus};

use crate::buffer::BufferAccessError;
use crate::descriptor::{DescriptorError, GrantRights};
use crate::engine::setup::NotAccepted;
use crate::engine::wire::{RejectReason, WireError};
use crate::ladder::LadderError;

/// A bound that passed: the one definition of a timeout, carried by both
/// [`TransferError::Timeout`] (a request's deadline) and
/// [`EngineError::Timeout`] (a call that waited).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("timed out after {after:?}")]
pub struct TimedOut {
    /// The bound that passed.
    pub after: Duration,
}

/// Why a peer is gone (or one of its queue pairs failed for good): the one
/// definition, carried by both [`TransferError::PeerGone`] and
/// [`EngineError::PeerGone`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerGone {
    /// This side closed the peer ([`crate::engine::Peer::close`], or the
    /// engine dropped it).
    #[error("closed by this side")]
    Closed,
    /// The peer closed the connection (it said goodbye).
    #[error("closed by the peer (it said goodbye)")]
    ClosedByPeer,
    /// A queue pair's connection left the connected state (the
    /// connection manager's event): it is re-established, or given up.
    #[error("connection {state:?}")]
    Disconnected {
        /// Where the connection stands now.
        state: ConnectionState,
    },
    /// The peer re-established this queue pair: what was in flight on
    /// the old one failed.
    #[error("the peer re-established this queue pair")]
    QueuePairReplaced,
    /// Every queue pair is down (failed and not re-established).
    #[error("every queue pair failed")]
    EveryQueuePairFailed,
    /// A queue pair failed before the session was established.
    #[error("queue pair {index} failed during set-up")]
    FailedDuringSetUp {
        /// The queue pair.
        index: usize,
    },
    /// Re-establishing a queue pair was given up (the last one, for a
    /// peer gone).
    #[error("{0}")]
    GivenUp(GiveUp),
    /// This side dropped the peer: it broke the protocol.
    #[error("dropped: {0}")]
    Misbehaved(PeerMisbehaved),
    /// The NIC every remaining queue pair used reported a fatal error.
    #[error("device {device} failed")]
    DeviceFailed {
        /// The NIC.
        device: String,
    },
    /// Connecting failed after the peer was added (the connect returned
    /// why): what it held was failed with this.
    #[error("connect failed")]
    ConnectFailed,
    /// Accepting failed after the peer was added (the accept returned
    /// why): what it held was failed with this.
    #[error("accept failed")]
    AcceptFailed,
}

impl From<Gone> for PeerGone {
    fn from(gone: Gone) -> Self {
        match gone {
            Gone::FailedDuringSetUp { index } => Self::FailedDuringSetUp { index },
            Gone::EveryQueuePairFailed => Self::EveryQueuePairFailed,
            Gone::GivenUp(why) => Self::GivenUp(why),
        }
    }
}

/// Why a request or call was refused before anything was posted (or, for
/// a gated batch, when its gate opened).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// As many peers as the engine carries are connected
    /// ([`super::EngineConfig::max_peers`], brought down to what its NICs'
    /// completion queues hold): a peer goes before another comes.
    #[error("{max} peers are connected, as many as this engine's completion queues carry")]
    PeerLimit {
        /// The bound.
        max: usize,
    },
    /// A region registered by another engine.
    #[error("a region of engine {region_engine:#x} used with engine {engine:#x}")]
    ForeignRegion {
        /// The engine that registered the region.
        region_engine: u64,
        /// The engine it was used with.
        engine: u64,
    },
    /// A region on the staging rung used where only a directly registered
    /// one can go.
    #[error("a staging-rung region on a direct path")]
    StagingRungOnDirectPath,
    /// A transfer of no staging-rung region handed to the staged path.
    #[error("the staged path carries only staging-rung transfers")]
    NotStaged,
    /// Landing slots asked for on memory of the staging rung.
    #[error("landing slots on the staging rung")]
    LandingSlotsOnStagingRung,
    /// Host memory on the staging rung (the rung is for GPU memory).
    #[error("host memory on the staging rung")]
    HostMemoryOnStagingRung,
    /// The grant was revoked.
    #[error("grant {grant} was revoked")]
    GrantRevoked {
        /// The grant.
        grant: u64,
    },
    /// The grant's range lies outside the GPU allocation it names.
    #[error(
        "grant {grant} of {len} bytes at offset {offset} lies outside its {size}-byte allocation"
    )]
    GrantOutsideAllocation {
        /// The grant.
        grant: u64,
        /// Its offset in the allocation.
        offset: u64,
        /// Its length.
        len: u64,
        /// The allocation's size.
        size: u64,
    },
    /// The grant cannot be reached by the peer-copy path.
    #[error("grant {grant} is not reachable by peer copy")]
    NotPeerCopyReachable {
        /// The grant.
        grant: u64,
    },
    /// As many control messages as the outbox holds already wait.
    #[error("{max} control messages already wait for the peer")]
    OutboxFull {
        /// The bound.
        max: usize,
    },
    /// Every word of the stream-fence page is held by a stream fence or a
    /// gate outstanding.
    #[error("{max} stream fences and gates are already outstanding")]
    FencesOutstanding {
        /// The bound (the words of the page).
        max: usize,
    },
    /// Connecting was asked with no path.
    #[error("no path to connect over")]
    NoPath,
    /// A session to accept with no queue pair.
    #[error("a session without queue pairs")]
    NoQueuePairs,
}

impl From<OutboxFull> for Refusal {
    fn from(full: OutboxFull) -> Self {
        Self::OutboxFull { max: full.max }
    }
}

/// What would have written read-only memory ([`EngineError::ReadOnly`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReadOnlyUse {
    /// A grant with write rights (grant it [`GrantRights::Read`]).
    #[error("no grant with {rights:?} rights (Read only)")]
    WriteGrant {
        /// The rights asked for.
        rights: GrantRights,
    },
    /// A READ into it (it may be the source of a WRITE only).
    #[error("no READ into it")]
    ReadInto,
}

/// Why no device or path could serve a call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Unavailable {
    /// The provider lists no RDMA device the engine may use.
    #[error("no RDMA device to use")]
    NoRdmaDevice,
    /// A device's completion queues cannot hold the completions of one
    /// peer's queue pairs (`qps_per_peer` × (`qp_depth` + `recv_depth`)).
    #[error("{device}'s completion queues hold {max_cqe} completions, one peer needs {per_peer}")]
    CompletionQueueTooSmall {
        /// The NIC.
        device: String,
        /// What the device allows per CQ.
        max_cqe: u64,
        /// What one peer's queue pairs need.
        per_peer: u64,
    },
    /// No NIC of the engine has the source address asked for.
    #[error("no NIC of this engine has address {address}")]
    NoNicWithAddress {
        /// The address.
        address: IpAddr,
    },
    /// The route to the peer leaves through a NIC the engine was not
    /// given.
    #[error("the route uses {device}, which this engine was not given")]
    RouteDeviceNotGiven {
        /// The route's NIC.
        device: String,
    },
    /// The engine has no GPU for what was asked.
    #[error("no GPU {purpose}")]
    NoGpu {
        /// What it was needed for.
        purpose: &'static str,
    },
    /// A NIC the engine was not given.
    #[error("{device} is not one of the engine's NICs")]
    UnknownNic {
        /// The NIC asked for.
        device: String,
    },
    /// A GPU the engine was not given.
    #[error("GPU {ordinal} is not one of the engine's")]
    UnknownGpu {
        /// The GPU asked for.
        ordinal: u32,
    },
    /// The operating system refused a resource (a thread, an eventfd).
    #[error("{what}: {source}")]
    Os {
        /// What the engine asked for.
        what: &'static str,
        /// The OS's error, with its errno.
        #[source]
        source: std::io::Error,
    },
}

/// Why a connection's handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeFailure {
    /// The peer speaks another version of the wire formats.
    #[error("wire version {theirs} received, this side speaks version {ours}")]
    Version {
        /// This side's version.
        ours: u8,
        /// The peer's.
        theirs: u8,
    },
    /// The peer's hello does not decode.
    #[error("malformed hello: {0}")]
    Malformed(WireError),
    /// The connection attempt failed: no route, no answer, or a reject
    /// that is not an engine's.
    #[error("{0}")]
    Connect(VerbsError),
    /// The set-up failed another way (a reply that does not answer the
    /// connect, an abort).
    #[error("{0}")]
    Dial(DialError),
    /// Sending this side's paths, the last step, failed.
    #[error("sending paths: {0}")]
    SendingPaths(TransferError),
}

impl From<WireError> for HandshakeFailure {
    fn from(error: WireError) -> Self {
        match error {
            WireError::Version { ours, theirs } => Self::Version { ours, theirs },
            other => Self::Malformed(other),
        }
    }
}

/// An [`Error`](crate::Error) a request's outcome carries ([`TransferError::Setup`]):
/// shared, so that the outcome stays [`Clone`]. Two are equal when they are
/// the same failure (clones of one another), not when their messages agree.
#[derive(Debug, Clone, thiserror::Error)]
#[error(transparent)]
pub struct SharedEngineError(Arc<EngineError>);

impl SharedEngineError {
    /// The engine's error.
    pub fn get(&self) -> &EngineError {
        &self.0
    }
}

impl PartialEq for SharedEngineError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for SharedEngineError {}

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
    #[error("the peer is gone: {0}")]
    PeerGone(PeerGone),
    /// The request did not complete within its deadline. Its queue pair
    /// was stopped first, so nothing of it still runs in the NIC.
    #[error(transparent)]
    Timeout(TimedOut),
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
        cause: Box<TransferError>,
    },
    /// A work completion failed on this side (a local protection or length
    /// error, a QP operation error).
    #[error("local failure: {status} (vendor error {vendor_err:#x})")]
    LocalCompletion {
        /// The completion's status.
        status: WcStatus,
        /// Vendor syndrome.
        vendor_err: u32,
    },
    /// The provider refused to post the request.
    #[error("local failure: posting: {source}")]
    PostFailed {
        /// The HAL's error, with the native code.
        #[source]
        source: VerbsError,
    },
    /// The queue pair's NIC reported an async error for it (QP fatal,
    /// request or access error).
    #[error("local failure: async event {event:?}")]
    QpAsyncError {
        /// The event.
        event: AsyncEvent,
    },
    /// A GPU call the request needed failed (a staging or peer copy, its
    /// event, the GPU fence after the batch).
    #[error("local failure: {what}: {source}")]
    Gpu {
        /// What the engine was doing.
        what: &'static str,
        /// The driver's error, with its native code.
        #[source]
        source: hal_cuda::CudaError,
    },
    /// The remote descriptor has no segment for this slice on the NIC the
    /// queue pair reaches.
    #[error("local failure: the slice's remote segment: {source}")]
    RemoteSegment {
        /// Why.
        #[source]
        source: DescriptorError,
    },
    /// A control message could not be written into its send slot.
    #[error("local failure: {source}")]
    SendBuffer {
        /// Why.
        #[source]
        source: BufferAccessError,
    },
    /// Setting up what the request needed failed on this side (a staging
    /// pool, a GPU), or a gated batch was refused when its gate opened.
    #[error("local failure: {what}: {source}")]
    Setup {
        /// What the engine was doing.
        what: &'static str,
        /// The engine's error.
        #[source]
        source: SharedEngineError,
    },
    /// The peer broke the protocol of this request (a staged request's
    /// slots or slices): the request fails.
    #[error("the peer broke the protocol: {0}")]
    Misbehaved(PeerMisbehaved),
    /// A failure whose cause the engine did not keep (a gdr bug when it
    /// shows): `what` says where.
    #[error("local failure: {what}")]
    Internal {
        /// Where.
        what: &'static str,
    },
    /// The device reported a fatal error: everything on it failed.
    #[error("device {device} failed (fatal async event)")]
    DeviceFatal {
        /// The NIC.
        device: String,
    },
    /// The NIC's completion queue failed (it overran, or polling it
    /// failed): completions were lost, so everything on the NIC failed
    /// with this, as for a fatal device error.
    #[error("the completion queue of {device} failed: {source}")]
    CompletionQueueFailed {
        /// The NIC.
        device: String,
        /// What polling it (or its async event) said.
        source: hal_verbs::VerbsError,
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

/// [`EngineError::OutOfBounds`]'s text: a zero length (nothing to move)
/// says so, not that it exceeds anything.
fn out_of_bounds(what: &str, offset: u64, len: u64, size: u64) -> String {
    if len == 0 {
        format!("{what}: a length of 0 bytes (at offset {offset}): nothing to move")
    } else {
        format!("{what}: {len} bytes at offset {offset} exceed its {size} bytes")
    }
}

impl TransferError {
    /// The error a failed work completion means.
    pub fn from_status(status: WcStatus, vendor_err: u32) -> Self {
        match status {
            WcStatus::REM_ACCESS_ERR | WcStatus::REM_INV_REQ_ERR | WcStatus::REM_OP_ERR => {
                Self::RemoteAccess { status, vendor_err }
            }
            WcStatus::RETRY_EXC_ERR | WcStatus::RNR_RETRY_EXC_ERR => Self::RetryExceeded { status },
            _ => Self::LocalCompletion { status, vendor_err },
        }
    }

    /// The outcome a request gets when an engine call it needed failed
    /// with `error` while `what`: a peer gone or a timeout stays one, a
    /// GPU call's error is [`Self::Gpu`], anything else [`Self::Setup`].
    pub(crate) fn from_engine(what: &'static str, error: EngineError) -> Self {
        match error {
            EngineError::PeerGone(why) => Self::PeerGone(why),
            EngineError::Timeout(t) => Self::Timeout(t),
            EngineError::Cuda(source) => Self::Gpu { what, source },
            error => Self::Setup {
                what,
                source: SharedEngineError(Arc::new(error)),
            },
        }
    }
}

impl From<PeerGone> for TransferError {
    fn from(why: PeerGone) -> Self {
        Self::PeerGone(why)
    }
}

impl From<TimedOut> for TransferError {
    fn from(t: TimedOut) -> Self {
        Self::Timeout(t)
    }
}

impl From<PeerMisbehaved> for TransferError {
    fn from(why: PeerMisbehaved) -> Self {
        Self::Misbehaved(why)
    }
}

/// What a call of gdr-core can fail with, one enum for every layer (the
/// context, its buffers and streams, the engine and its peers): each HAL
/// error keeps its native code, each refusal says what to change. A
/// request's own outcome is a [`TransferError`], delivered exactly once
/// through its batch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No backends could be chosen ([`crate::Context::open`]).
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    /// A verbs call failed.
    #[error("{call}: {source}")]
    Verbs {
        /// What was being done.
        call: VerbsCall,
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
    /// A control message could not be encoded (a wire-format limit). A
    /// peer's hello that does not decode is [`HandshakeFailure::Malformed`]
    /// and a peer's control message that does not decode drops the peer
    /// ([`PeerMisbehaved::Malformed`]).
    #[error("wire format: {0}")]
    Wire(#[from] WireError),
    /// A request was refused before anything was posted.
    #[error("refused: {0}")]
    Refused(#[from] Refusal),
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
    /// The local region is read-only memory
    /// ([`crate::buffer::Access::ReadOnly`]) and the call would have let it
    /// be written: refused, nothing posted or granted.
    #[error("the region is read-only memory: {0}")]
    ReadOnly(ReadOnlyUse),
    /// Offset and length fall outside a region or grant.
    #[error("{}", out_of_bounds(what, *offset, *len, *size))]
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
    #[error("handshake with {}: {why}", peer.map_or_else(|| "a peer gone since".to_owned(), |a| a.to_string()))]
    Handshake {
        /// The peer's address (`None` where the peer went before it was
        /// read).
        peer: Option<SocketAddr>,
        /// What went wrong.
        why: HandshakeFailure,
    },
    /// The listener refused a queue pair of the connection, saying why:
    /// [`RejectReason::Busy`] means its backlog of connections waiting for
    /// accept is full (or it is closing): try again later. Nothing of the
    /// attempt remains on either side.
    #[error("{peer} rejected the connection: {reason}")]
    Rejected {
        /// The peer's address.
        peer: SocketAddr,
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
        peer: SocketAddr,
        /// Which way it was not accepted.
        reason: NotAccepted,
    },
    /// Waiting ran out of time.
    #[error(transparent)]
    Timeout(#[from] TimedOut),
    /// The peer is gone (closed, failed, disconnected).
    #[error("the peer is gone: {0}")]
    PeerGone(#[from] PeerGone),
    /// No device, no path.
    #[error("{0}")]
    Unavailable(#[from] Unavailable),
    /// A CUDA call failed (with its native code:
    /// [`CudaError::OutOfMemory`](hal_cuda::CudaError::OutOfMemory) for
    /// pinned or device memory CUDA refused).
    #[error("GPU: {0}")]
    Cuda(#[from] hal_cuda::CudaError),
    /// A `gdr://` URI is malformed or does not fit.
    #[error(transparent)]
    Uri(#[from] crate::uri::UriError),
    /// The CPU cannot touch the buffer's memory that way.
    #[error(transparent)]
    BufferAccess(#[from] BufferAccessError),
    /// An object made in one context (of other backends) was given to
    /// another's engine or stream. (A region of another engine is
    /// [`Refusal::ForeignRegion`], with both engines' ids.)
    #[error("the {what} belongs to another {owner}")]
    Foreign {
        /// What was given (`buffer`, `stream`).
        what: &'static str,
        /// Whose it must be (`context`).
        owner: &'static str,
    },
    /// No GPU of that index in this context.
    #[error("no GPU {index} ({count} in this context)")]
    NoGpu {
        /// The index asked for.
        index: u32,
        /// How many the context has.
        count: u32,
    },
    /// The call needs a GPU and the context has none.
    #[error("{what} needs a GPU, and this context has none")]
    NeedsGpu {
        /// What needed it.
        what: &'static str,
    },
    /// No NIC of that index in this context.
    #[error("no NIC {index} ({count} in this context)")]
    NoNic {
        /// The index asked for.
        index: u32,
        /// How many the context has.
        count: u32,
    },
    /// The context cannot do this at all.
    #[error(transparent)]
    Unsupported(#[from] Unsupported),
    /// A size that cannot be allocated or moved (zero, or past the address
    /// space).
    #[error("{what}: {size} bytes is not a usable size")]
    BadSize {
        /// Which size.
        what: &'static str,
        /// The size given.
        size: u64,
    },
    /// Host memory of that size could not be allocated (out of memory, or
    /// past what the process may map). Nothing was allocated; the process
    /// goes on.
    #[error("{what}: {size} bytes could not be allocated (out of memory)")]
    OutOfMemory {
        /// What was being allocated.
        what: &'static str,
        /// The size asked for.
        size: u64,
    },
    /// A stream copy's source and destination overlap.
    #[error("the source and destination ranges of a stream copy overlap")]
    Overlap,
    /// A stream copy names device memory of another GPU than the stream's.
    #[error("{what} is memory of GPU {memory}, the stream is on GPU {stream}")]
    WrongGpu {
        /// Which end.
        what: &'static str,
        /// The memory's GPU.
        memory: u32,
        /// The stream's GPU.
        stream: u32,
    },
    /// The process's simulated fabric has no address left for another sim
    /// context (about eight million were made).
    #[error("the process's simulated fabric has no address left for another context")]
    SimFabricFull,
    /// The buffer was released; its handle is spent.
    #[error("the buffer was released")]
    Released,
    /// The buffer cannot be released yet: copies queued on streams still
    /// use it (synchronize their streams first).
    #[error(
        "{copies} copies queued on streams still use the buffer (synchronize or drop their streams first)"
    )]
    StreamCopiesPending {
        /// How many.
        copies: usize,
    },
    /// The buffer cannot be released yet: memory registrations (a region,
    /// a grant, a transfer in flight) still cover it past its release
    /// timeout.
    #[error("memory registrations still cover the buffer (a region, grant or transfer holds them)")]
    StillRegistered,
}

/// The engine's name for [`Error`] (its calls were the first to have one).
pub type EngineError = Error;

impl Error {
    pub(crate) fn verbs(call: VerbsCall, source: VerbsError) -> Self {
        Self::Verbs { call, source }
    }
}

/// The verbs call an [`Error::Verbs`] failed in, with what it was about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsCall {
    /// Listing the RDMA devices.
    #[error("listing RDMA devices")]
    ListDevices,
    /// Opening the connection manager (rdma_cm's event channel).
    #[error("opening the connection manager")]
    OpenConnectionManager,
    /// Opening a device.
    #[error("opening {device}")]
    OpenDevice {
        /// The device.
        device: String,
    },
    /// Reading a device's GID table.
    #[error("reading the GID table of {device}")]
    QueryGids {
        /// The device.
        device: String,
    },
    /// Creating a completion queue.
    #[error("creating a CQ on {device}")]
    CreateCq {
        /// The device.
        device: String,
    },
    /// Listening at an address.
    #[error("listening on {addr}")]
    Listen {
        /// The address.
        addr: SocketAddr,
    },
    /// Resolving the route to a peer.
    #[error("route to {peer}")]
    Route {
        /// The peer's address.
        peer: SocketAddr,
    },
    /// Posting the receives control messages land in.
    #[error("posting control receives")]
    PostControlReceives,
}

/// What a context cannot do at all, whatever the arguments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unsupported {
    /// CUDA managed memory is never registered or copied by gdr.
    #[error("managed memory is not supported (it is never registered)")]
    ManagedMemory,
    /// Only device memory has a `gdr://` URI (a CUDA IPC handle).
    #[error("only device memory has a gdr:// URI")]
    UriOfHostMemory,
    /// A stream copies to or from GPU memory; host to host is a memcpy.
    #[error("a stream copies to or from GPU memory; host to host is the caller's memcpy")]
    HostToHostStreamCopy,
    /// The NIC has no RoCE v2 address on port 1.
    #[error("{nic} port 1 has no RoCE v2 address")]
    NoRoceAddress {
        /// The NIC.
        nic: String,
    },
}
