//! The one result type of the C ABI, and the error the Rust side carries
//! to the boundary (a code and the full message, which the caller can read
//! with `gdr_last_error_message`).

use std::ffi::CStr;

use gdr_core::CudaError;
use gdr_core::Error as EngineError;
use gdr_core::LadderError;
use gdr_core::NotAccepted;
use gdr_core::VerbsError;
use gdr_core::uri::UriError;
use gdr_core::{HandshakeFailure, Refusal, TransferError};

/// Result of every gdr C function. `GDR_RESULT_OK` is 0; errors start at 7000 so
/// they never collide with errno values or CUresult codes a caller also sees.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdrResult {
    /// Success.
    Ok = 0,
    /// A native library (libibverbs, librdmacm, libcuda) is missing.
    LibraryUnavailable = 7001,
    /// No RDMA device or GPU.
    NoDevice = 7002,
    /// The machine cannot do this (e.g. no dma-buf).
    NotSupported = 7003,
    /// Out of memory, MRs, QPs, locked pages.
    OutOfResources = 7004,
    /// A queue is full; poll and retry.
    QueueFull = 7005,
    /// A bad argument: NULL where a pointer is required, a misaligned
    /// pointer, a zero length, a malformed URI or descriptor.
    InvalidArgument = 7006,
    /// The device is gone; rebuild.
    DeviceLost = 7007,
    /// Any other OS or driver error.
    Other = 7008,
    /// A panic was caught at the boundary (a gdr bug).
    Panic = 7009,
    /// A bounded wait ran out (e.g. connecting to a peer that never listened).
    Timeout = 7010,
    /// The peer refused the connection.
    ConnectionRejected = 7011,
    /// The GPU context hit a sticky error (an illegal address, a failed
    /// launch, ...): every later call in it fails; release everything made
    /// in it and start again (a new process, or after the device's reset).
    ContextUnusable = 7012,
    /// The GPU exists but cannot be used now (exclusive-process mode with
    /// another process holding it, compute prohibited): may change later;
    /// not a lost device.
    DeviceUnavailable = 7013,
    /// A handle that is not live: zero, freed already, of another kind,
    /// or made by another instance of the library.
    InvalidHandle = 7014,
    /// An output buffer is too short; the length needed was written where
    /// the function takes one.
    BufferTooSmall = 7015,
    /// The peer refused the request (not granted, not allowed, out of the
    /// grant's bounds) or is gone.
    Refused = 7016,
    /// The object is still in use (e.g. a buffer with registrations a
    /// transfer or grant still holds).
    Busy = 7017,
    /// The caller cancelled the batch; nothing of it still runs.
    Cancelled = 7018,
    /// The peer is gone (closed, disconnected, not answering): its
    /// requests fail; connect again.
    PeerGone = 7019,
}

impl GdrResult {
    /// Every result, for lookups by number.
    pub(crate) const ALL: [GdrResult; 20] = [
        GdrResult::Ok,
        GdrResult::LibraryUnavailable,
        GdrResult::NoDevice,
        GdrResult::NotSupported,
        GdrResult::OutOfResources,
        GdrResult::QueueFull,
        GdrResult::InvalidArgument,
        GdrResult::DeviceLost,
        GdrResult::Other,
        GdrResult::Panic,
        GdrResult::Timeout,
        GdrResult::ConnectionRejected,
        GdrResult::ContextUnusable,
        GdrResult::DeviceUnavailable,
        GdrResult::InvalidHandle,
        GdrResult::BufferTooSmall,
        GdrResult::Refused,
        GdrResult::Busy,
        GdrResult::Cancelled,
        GdrResult::PeerGone,
    ];

    pub(crate) fn message(self) -> &'static CStr {
        match self {
            Self::Ok => c"success",
            Self::LibraryUnavailable => c"a native library is unavailable",
            Self::NoDevice => c"no device",
            Self::NotSupported => c"not supported",
            Self::OutOfResources => c"out of resources",
            Self::QueueFull => c"queue full",
            Self::InvalidArgument => c"invalid argument",
            Self::DeviceLost => c"device lost",
            Self::Other => c"operating system or driver error",
            Self::Panic => c"internal error (panic caught at the C boundary)",
            Self::Timeout => c"timed out",
            Self::ConnectionRejected => c"connection rejected by the peer",
            Self::ContextUnusable => c"GPU context unusable after a sticky error",
            Self::DeviceUnavailable => c"GPU device unavailable now",
            Self::InvalidHandle => {
                c"invalid handle (zero, freed, another kind or library instance)"
            }
            Self::BufferTooSmall => c"output buffer too small",
            Self::Refused => c"refused by the peer",
            Self::Busy => c"still in use",
            Self::Cancelled => c"cancelled",
            Self::PeerGone => c"the peer is gone",
        }
    }
}

impl From<&VerbsError> for GdrResult {
    fn from(error: &VerbsError) -> Self {
        match error {
            VerbsError::LibraryUnavailable { .. } => Self::LibraryUnavailable,
            VerbsError::NoDevice { .. } => Self::NoDevice,
            VerbsError::NotSupported { .. } => Self::NotSupported,
            VerbsError::OutOfResources { .. } => Self::OutOfResources,
            VerbsError::QueueFull { .. } => Self::QueueFull,
            VerbsError::InvalidArgument { .. } => Self::InvalidArgument,
            VerbsError::DeviceLost { .. } => Self::DeviceLost,
            VerbsError::Timeout { .. } => Self::Timeout,
            VerbsError::ConnectionRejected { .. } => Self::ConnectionRejected,
            _ => Self::Other,
        }
    }
}

impl From<&CudaError> for GdrResult {
    fn from(error: &CudaError) -> Self {
        match error {
            CudaError::LibraryUnavailable { .. } => Self::LibraryUnavailable,
            CudaError::NoDevice { .. } => Self::NoDevice,
            CudaError::NotSupported { .. } => Self::NotSupported,
            CudaError::OutOfMemory { .. } => Self::OutOfResources,
            CudaError::InvalidArgument { .. } => Self::InvalidArgument,
            CudaError::DeviceLost { .. } => Self::DeviceLost,
            CudaError::ContextUnusable { .. } => Self::ContextUnusable,
            CudaError::DeviceUnavailable { .. } => Self::DeviceUnavailable,
            _ => Self::Other,
        }
    }
}

/// An error on its way to the C caller: the code it returns and the whole
/// message (with the native code and context) it can read afterwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FfiError {
    pub result: GdrResult,
    pub message: String,
}

impl FfiError {
    pub fn new(result: GdrResult, message: impl Into<String>) -> Self {
        Self {
            result,
            message: message.into(),
        }
    }

    /// A bad argument, saying which and why.
    pub fn invalid(argument: &str, why: impl std::fmt::Display) -> Self {
        Self::new(GdrResult::InvalidArgument, format!("{argument}: {why}"))
    }
}

impl From<VerbsError> for FfiError {
    fn from(error: VerbsError) -> Self {
        Self::new(GdrResult::from(&error), error.to_string())
    }
}

impl From<CudaError> for FfiError {
    fn from(error: CudaError) -> Self {
        Self::new(GdrResult::from(&error), error.to_string())
    }
}

impl From<UriError> for FfiError {
    fn from(error: UriError) -> Self {
        Self::new(GdrResult::InvalidArgument, error.to_string())
    }
}

impl From<&LadderError> for GdrResult {
    fn from(error: &LadderError) -> Self {
        match error {
            LadderError::Attributes { source, .. } => Self::from(source),
            LadderError::ManagedMemory { .. } => Self::NotSupported,
            LadderError::OutsideAllocation { .. }
            | LadderError::UnknownGpu { .. }
            | LadderError::ReadOnly { .. } => Self::InvalidArgument,
            _ => Self::Other,
        }
    }
}

impl From<LadderError> for FfiError {
    fn from(error: LadderError) -> Self {
        Self::new(GdrResult::from(&error), error.to_string())
    }
}

impl From<&TransferError> for GdrResult {
    fn from(error: &TransferError) -> Self {
        match error {
            TransferError::RemoteAccess { .. }
            | TransferError::StagedRefused { .. }
            | TransferError::Revoked { .. } => Self::Refused,
            TransferError::RetryExceeded { .. } | TransferError::PeerGone(_) => Self::PeerGone,
            TransferError::Timeout(_) => Self::Timeout,
            TransferError::Cancelled => Self::Cancelled,
            TransferError::DeviceFatal { .. } | TransferError::CompletionQueueFailed { .. } => {
                Self::DeviceLost
            }
            TransferError::StreamFailed { source } => Self::from(source),
            _ => Self::Other,
        }
    }
}

impl From<TransferError> for FfiError {
    fn from(error: TransferError) -> Self {
        Self::new(GdrResult::from(&error), error.to_string())
    }
}

impl From<EngineError> for FfiError {
    fn from(error: EngineError) -> Self {
        Self::new(GdrResult::from(&error), error.to_string())
    }
}

impl From<&EngineError> for GdrResult {
    fn from(error: &EngineError) -> Self {
        match error {
            EngineError::Verbs { source, .. } => GdrResult::from(source),
            EngineError::Ladder(source) => GdrResult::from(source),
            EngineError::Cuda(source) => GdrResult::from(source),
            EngineError::Descriptor(_) | EngineError::Wire(_) => GdrResult::InvalidArgument,
            // Outside the peer's grant: the grant refuses it.
            EngineError::OutOfBounds { what, .. } if *what == "remote grant" => GdrResult::Refused,
            // Read-only memory written (a write grant, a READ into it).
            EngineError::OutOfBounds { .. }
            | EngineError::MessageTooLarge { .. }
            | EngineError::ReadOnly(_) => GdrResult::InvalidArgument,
            // An object of another engine: the caller's mistake.
            EngineError::Refused(Refusal::ForeignRegion { .. }) => GdrResult::InvalidArgument,
            EngineError::NotGranted { .. }
            | EngineError::AccessDenied { .. }
            | EngineError::Refused(_) => GdrResult::Refused,
            EngineError::PeerGone(_) => GdrResult::PeerGone,
            // The peer's hello did not decode: a wire format error, as
            // before the handshake's failure was typed.
            EngineError::Handshake {
                why: HandshakeFailure::Malformed(_) | HandshakeFailure::Version { .. },
                ..
            } => GdrResult::InvalidArgument,
            EngineError::Handshake { .. } | EngineError::Rejected { .. } => {
                GdrResult::ConnectionRejected
            }
            // Nobody accepted in time: a bounded wait ran out.
            EngineError::NotAccepted {
                reason: NotAccepted::Timeout { .. },
                ..
            } => GdrResult::Timeout,
            EngineError::NotAccepted { .. } => GdrResult::ConnectionRejected,
            EngineError::Timeout(_) => GdrResult::Timeout,
            EngineError::Unavailable(_) => GdrResult::NoDevice,
            EngineError::Backend(gdr_core::backend::BackendError::Verbs { source }) => {
                GdrResult::from(source)
            }
            EngineError::Backend(_) | EngineError::Unsupported(_) => GdrResult::NotSupported,
            EngineError::Uri(_)
            | EngineError::BufferAccess(_)
            | EngineError::BadSize { .. }
            | EngineError::Overlap
            | EngineError::WrongGpu { .. }
            // An object of another context given.
            | EngineError::Foreign { .. } => GdrResult::InvalidArgument,
            // A buffer being freed by another thread meanwhile.
            EngineError::Released => GdrResult::InvalidHandle,
            EngineError::NoGpu { .. } | EngineError::NeedsGpu { .. } | EngineError::NoNic { .. } => {
                GdrResult::NoDevice
            }
            EngineError::SimFabricFull | EngineError::OutOfMemory { .. } => {
                GdrResult::OutOfResources
            }
            EngineError::StreamCopiesPending { .. } | EngineError::StillRegistered => {
                GdrResult::Busy
            }
            _ => GdrResult::Other,
        }
    }
}

impl From<gdr_core::Unsupported> for FfiError {
    fn from(error: gdr_core::Unsupported) -> Self {
        gdr_core::Error::from(error).into()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use gdr_core::DialError;
    use gdr_core::WcStatus;
    use gdr_core::{PeerGone, PeerMisbehaved, TimedOut, Unavailable};

    use super::*;

    fn code(error: EngineError) -> GdrResult {
        FfiError::from(error).result
    }

    /// The typed causes keep the codes their string forms had: a malformed
    /// or other-version hello is still a wire error, the rest of a
    /// handshake still a rejected connection.
    #[test]
    fn typed_engine_errors_keep_their_codes() {
        let peer: Option<std::net::SocketAddr> = "192.0.2.1:7000".parse().ok();
        let version = HandshakeFailure::Version { ours: 1, theirs: 2 };
        let cases = [
            (
                EngineError::Handshake { peer, why: version },
                GdrResult::InvalidArgument,
            ),
            (
                EngineError::Handshake {
                    peer,
                    why: HandshakeFailure::Dial(DialError::Aborted),
                },
                GdrResult::ConnectionRejected,
            ),
            (
                EngineError::Handshake {
                    peer,
                    why: HandshakeFailure::Connect(VerbsError::invalid("connect", "test")),
                },
                GdrResult::ConnectionRejected,
            ),
            (EngineError::Refused(Refusal::NoPath), GdrResult::Refused),
            (
                EngineError::Unavailable(Unavailable::NoRdmaDevice),
                GdrResult::NoDevice,
            ),
            (
                EngineError::PeerGone(PeerGone::Misbehaved(PeerMisbehaved::EndedEarly)),
                GdrResult::PeerGone,
            ),
            (
                EngineError::Timeout(TimedOut {
                    after: Duration::from_secs(1),
                }),
                GdrResult::Timeout,
            ),
        ];
        for (error, want) in cases {
            let message = error.to_string();
            assert_eq!(code(error), want, "{message}");
        }
    }

    /// What was `TransferError::Local` stays `Other`; a peer gone and a
    /// timeout keep theirs.
    #[test]
    fn typed_transfer_errors_keep_their_codes() {
        let cases = [
            (
                TransferError::LocalCompletion {
                    status: WcStatus::LOC_PROT_ERR,
                    vendor_err: 0,
                },
                GdrResult::Other,
            ),
            (TransferError::Internal { what: "test" }, GdrResult::Other),
            (
                TransferError::Misbehaved(PeerMisbehaved::EndedEarly),
                GdrResult::Other,
            ),
            (
                TransferError::PeerGone(PeerGone::Closed),
                GdrResult::PeerGone,
            ),
            (
                TransferError::Timeout(TimedOut {
                    after: Duration::from_secs(1),
                }),
                GdrResult::Timeout,
            ),
        ];
        for (error, want) in cases {
            assert_eq!(GdrResult::from(&error), want, "{error}");
        }
    }
}
