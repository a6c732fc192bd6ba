//! The one error type of the CUDA HAL. The native `CUresult` is always kept.

/// Result alias of the CUDA HAL.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// What went wrong in a CUDA call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// libcuda could not be loaded, or lacks an entry point we need.
    #[error("{library} is unavailable: {reason}")]
    LibraryUnavailable {
        /// The library or symbol, e.g. `libcuda.so.1`.
        library: &'static str,
        /// Why.
        reason: String,
    },
    /// The driver works but there is no (such) GPU.
    #[error("no CUDA device: {detail}")]
    NoDevice {
        /// Which ordinal was asked for, or what the driver said.
        detail: String,
    },
    /// The device or driver cannot do this (e.g. no dma-buf export).
    #[error("{operation} is not supported: {reason}{}", Code(*code))]
    NotSupported {
        /// The driver call or capability.
        operation: &'static str,
        /// Why, in words.
        reason: String,
        /// The native `CUresult`, where there was one.
        code: Option<u32>,
    },
    /// Device or pinned-host memory is exhausted.
    #[error("{operation} ran out of memory{}", Code(*code))]
    OutOfMemory {
        /// The driver call.
        operation: &'static str,
        /// The native `CUresult`, where there was one.
        code: Option<u32>,
    },
    /// The caller passed something the driver rejects.
    #[error("{operation}: invalid argument: {reason}{}", Code(*code))]
    InvalidArgument {
        /// The driver call.
        operation: &'static str,
        /// What was wrong.
        reason: String,
        /// The native `CUresult`, where there was one.
        code: Option<u32>,
    },
    /// The context is unusable (illegal address, ECC, Xid, device removed):
    /// every later call on it fails; the process must rebuild it.
    #[error("device lost during {operation}{}", Code(*code))]
    DeviceLost {
        /// The driver call.
        operation: &'static str,
        /// The native `CUresult`, where there was one.
        code: Option<u32>,
    },
    /// Any other driver error, with its code and name.
    #[error("{operation} failed: {name} (CUresult {code})")]
    Driver {
        /// The driver call.
        operation: &'static str,
        /// The native `CUresult`.
        code: u32,
        /// Its enum name, e.g. `CUDA_ERROR_LAUNCH_FAILED`.
        name: &'static str,
    },
    /// An OS call around CUDA failed (e.g. duplicating a dma-buf fd).
    #[error("{operation} failed: {}", std::io::Error::from_raw_os_error(*errno))]
    Os {
        /// The call.
        operation: &'static str,
        /// The errno.
        errno: i32,
    },
}

struct Code(Option<u32>);

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(code) => write!(f, " ({}, CUresult {code})", result_name(code)),
            None => Ok(()),
        }
    }
}

/// The enum name of a `CUresult`, for the codes gdr meets.
pub fn result_name(code: u32) -> &'static str {
    match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        46 => "CUDA_ERROR_DEVICES_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        205 => "CUDA_ERROR_MAP_FAILED",
        208 => "CUDA_ERROR_ALREADY_MAPPED",
        214 => "CUDA_ERROR_ECC_UNCORRECTABLE",
        217 => "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        712 => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        713 => "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => "CUDA_ERROR_(unnamed)",
    }
}

impl CudaError {
    /// Maps a failed `CUresult` to the kind a caller acts on.
    pub fn from_code(operation: &'static str, code: u32) -> Self {
        match code {
            1 | 400 => Self::InvalidArgument {
                operation,
                reason: result_name(code).to_owned(),
                code: Some(code),
            },
            2 => Self::OutOfMemory {
                operation,
                code: Some(code),
            },
            100 | 101 => Self::NoDevice {
                detail: format!("{operation}: {} (CUresult {code})", result_name(code)),
            },
            801 | 217 | 800 => Self::NotSupported {
                operation,
                reason: result_name(code).to_owned(),
                code: Some(code),
            },
            // Sticky errors: the context cannot be used again.
            4 | 46 | 214 | 700 | 719 | 999 => Self::DeviceLost {
                operation,
                code: Some(code),
            },
            _ => Self::Driver {
                operation,
                code,
                name: result_name(code),
            },
        }
    }

    /// Shorthand for [`CudaError::InvalidArgument`] raised by our own checks.
    pub fn invalid(operation: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            operation,
            reason: reason.into(),
            code: None,
        }
    }

    /// Shorthand for [`CudaError::NotSupported`] raised by our own checks.
    pub fn unsupported(operation: &'static str, reason: impl Into<String>) -> Self {
        Self::NotSupported {
            operation,
            reason: reason.into(),
            code: None,
        }
    }

    /// The native `CUresult`, if the driver reported one.
    pub fn code(&self) -> Option<u32> {
        match self {
            Self::NotSupported { code, .. }
            | Self::OutOfMemory { code, .. }
            | Self::InvalidArgument { code, .. }
            | Self::DeviceLost { code, .. } => *code,
            Self::Driver { code, .. } => Some(*code),
            Self::LibraryUnavailable { .. } | Self::NoDevice { .. } | Self::Os { .. } => None,
        }
    }

    /// True when retrying can never help on this machine: fall back instead.
    pub fn is_unsupported(&self) -> bool {
        matches!(
            self,
            Self::LibraryUnavailable { .. } | Self::NoDevice { .. } | Self::NotSupported { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_kinds_and_are_kept() {
        let e = CudaError::from_code("cuMemGetHandleForAddressRange", 801);
        assert!(e.is_unsupported());
        assert_eq!(e.code(), Some(801));
        assert!(e.to_string().contains("CUDA_ERROR_NOT_SUPPORTED"), "{e}");

        assert!(matches!(
            CudaError::from_code("cuMemAlloc", 2),
            CudaError::OutOfMemory { code: Some(2), .. }
        ));
        assert!(matches!(
            CudaError::from_code("cuMemcpyHtoDAsync", 700),
            CudaError::DeviceLost { .. }
        ));
        let e = CudaError::from_code("cuStreamQuery", 600);
        assert_eq!(e.code(), Some(600));
        assert!(e.to_string().contains("CUDA_ERROR_NOT_READY"), "{e}");
    }
}
