//! gdr's errors as the package's exceptions (`gdr.errors`, defined in
//! Python so each can also derive from the builtin a caller already
//! catches): the engine's typed errors mapped to a class, the message
//! the Rust error's own.

use gdr_core::LadderError;
use gdr_core::NotAccepted;
use gdr_core::{CudaError, Error, TransferError};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// The `gdr.errors` module, imported once.
static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// An exception of class `gdr.errors.<kind>` with `message`.
pub(crate) fn raise(py: Python<'_>, kind: &str, message: String) -> PyErr {
    let class = ERRORS
        .get_or_try_init(py, || py.import("gdr.errors").map(Bound::unbind))
        .and_then(|module| module.bind(py).getattr(kind));
    match class {
        Ok(class) => match class.call1((message,)) {
            Ok(instance) => PyErr::from_value(instance),
            Err(e) => e,
        },
        // The package's Python part is missing: still an error, not a panic.
        Err(_) => PyRuntimeError::new_err(format!("{kind}: {message}")),
    }
}

/// An error of gdr-core as its exception.
pub(crate) fn raise_error(py: Python<'_>, error: &Error) -> PyErr {
    let kind = match error {
        Error::Timeout(_) => "Timeout",
        Error::PeerGone(_) => "PeerGone",
        Error::NotAccepted {
            reason: NotAccepted::Timeout { .. },
            ..
        } => "Timeout",
        Error::Handshake { .. } | Error::Rejected { .. } | Error::NotAccepted { .. } => {
            "ConnectFailed"
        }
        Error::Refused(gdr_core::Refusal::GrantRevoked { .. }) => "Revoked",
        // An object of another engine: the caller's mistake, not a refusal.
        Error::Refused(gdr_core::Refusal::ForeignRegion { .. }) => "InvalidArgument",
        Error::NotGranted { .. } | Error::AccessDenied { .. } | Error::Refused(_) => "Refused",
        Error::OutOfBounds { what, .. } if *what == "remote grant" => "Refused",
        Error::Backend(_) | Error::Unavailable(_) => "Unavailable",
        Error::NoGpu { .. } | Error::NeedsGpu { .. } | Error::NoNic { .. } => "Unavailable",
        Error::Unsupported(_) => "NotSupported",
        Error::OutOfMemory { .. } | Error::Cuda(CudaError::OutOfMemory { .. }) => "OutOfMemory",
        Error::StreamCopiesPending { .. } | Error::StillRegistered => "Busy",
        Error::OutOfBounds { .. }
        | Error::MessageTooLarge { .. }
        | Error::Descriptor(_)
        | Error::Wire(_)
        | Error::ReadOnly(_)
        | Error::Ladder(LadderError::ReadOnly { .. })
        | Error::Uri(_)
        | Error::BufferAccess(_)
        | Error::Foreign { .. }
        | Error::BadSize { .. }
        | Error::Overlap
        | Error::WrongGpu { .. }
        | Error::Released => "InvalidArgument",
        Error::Verbs { .. } | Error::Cuda(_) | Error::Ladder(_) => "DeviceError",
        _ => "GdrError",
    };
    raise(py, kind, error_chain(error))
}

/// A batch's failure as its exception.
pub(crate) fn raise_outcome(py: Python<'_>, error: &TransferError) -> PyErr {
    let kind = match error {
        TransferError::Timeout(_) => "Timeout",
        TransferError::Cancelled => "Cancelled",
        TransferError::PeerGone(_) | TransferError::RetryExceeded { .. } => "PeerGone",
        TransferError::Revoked { .. } => "Revoked",
        TransferError::RemoteAccess { .. } | TransferError::StagedRefused { .. } => "Refused",
        TransferError::DeviceFatal { .. } | TransferError::CompletionQueueFailed { .. } => {
            "DeviceError"
        }
        _ => "TransferFailed",
    };
    raise(py, kind, error_chain(error))
}

/// The error's message and its causes', as `a: b: c`.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}
