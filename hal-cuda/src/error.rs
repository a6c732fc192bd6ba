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
    /// The device itself failed (an uncorrectable ECC or NVLink error, or a
    /// simulated loss): nothing on it can be trusted until it is reset.
    #[error("device lost during {operation}{}", Code(*code))]
    DeviceLost {
        /// The driver call.
        operation: &'static str,
        /// The native `CUresult`, where there was one.
        code: Option<u32>,
    },
    /// A sticky error (illegal address, launch timeout, device-side assert,
    /// hardware stack error, illegal or misaligned access, launch failure:
    /// 700, 702, 710, 714–719) left the context unusable: every later call
    /// in it fails. The process must drop everything made in the context and
    /// reset it (the device itself may be fine).
    #[error("the CUDA context is unusable after {operation}{}", Code(*code))]
    ContextUnusable {
        /// The driver call that reported it.
        operation: &'static str,
        /// The native `CUresult`.
        code: Option<u32>,
    },
    /// The device exists but cannot be used now (`CUDA_ERROR_DEVICE_UNAVAILABLE`,
    /// e.g. exclusive-process mode with another process holding it, or
    /// compute prohibited): may change later; not a lost device.
    #[error("device unavailable for {operation}{}", Code(*code))]
    DeviceUnavailable {
        /// The driver call.
        operation: &'static str,
        /// The native `CUresult`.
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

/// The enum name of a `CUresult`, for the codes gdr meets. A code not listed
/// (a newer driver's) is `CUDA_ERROR_(unnamed)`; the number is always kept
/// next to it.
pub fn result_name(code: u32) -> &'static str {
    match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        35 => "CUDA_ERROR_INSUFFICIENT_DRIVER",
        36 => "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        102 => "CUDA_ERROR_DEVICE_NOT_LICENSED",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        205 => "CUDA_ERROR_MAP_FAILED",
        206 => "CUDA_ERROR_UNMAP_FAILED",
        208 => "CUDA_ERROR_ALREADY_MAPPED",
        211 => "CUDA_ERROR_NOT_MAPPED",
        214 => "CUDA_ERROR_ECC_UNCORRECTABLE",
        215 => "CUDA_ERROR_UNSUPPORTED_LIMIT",
        216 => "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
        217 => "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        220 => "CUDA_ERROR_NVLINK_UNCORRECTABLE",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        401 => "CUDA_ERROR_ILLEGAL_STATE",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        701 => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        702 => "CUDA_ERROR_LAUNCH_TIMEOUT",
        708 => "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
        709 => "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        710 => "CUDA_ERROR_ASSERT",
        712 => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        713 => "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        714 => "CUDA_ERROR_HARDWARE_STACK_ERROR",
        715 => "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        716 => "CUDA_ERROR_MISALIGNED_ADDRESS",
        717 => "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        718 => "CUDA_ERROR_INVALID_PC",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        804 => "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        909 => "CUDA_ERROR_TIMEOUT",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => "CUDA_ERROR_(unnamed)",
    }
}

/// The sticky errors: after one, the context cannot be used again.
pub const STICKY_CODES: [u32; 9] = [700, 702, 710, 714, 715, 716, 717, 718, 719];

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
            c if STICKY_CODES.contains(&c) => Self::ContextUnusable {
                operation,
                code: Some(code),
            },
            // The hardware failed uncorrectably.
            214 | 220 => Self::DeviceLost {
                operation,
                code: Some(code),
            },
            46 => Self::DeviceUnavailable {
                operation,
                code: Some(code),
            },
            // Everything else, 999 (unknown) included: reported as it is.
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
            | Self::DeviceLost { code, .. }
            | Self::ContextUnusable { code, .. }
            | Self::DeviceUnavailable { code, .. } => *code,
            Self::Driver { code, .. } => Some(*code),
            Self::LibraryUnavailable { .. } | Self::NoDevice { .. } | Self::Os { .. } => None,
        }
    }

    /// True when the context is unusable (a sticky error) or the device lost:
    /// everything made in the context must be dropped and the context reset
    /// before the device is used again.
    pub fn context_unusable(&self) -> bool {
        matches!(self, Self::ContextUnusable { .. } | Self::DeviceLost { .. })
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
            CudaError::ContextUnusable {
                code: Some(700),
                ..
            }
        ));
        let e = CudaError::from_code("cuStreamQuery", 600);
        assert_eq!(e.code(), Some(600));
        assert!(e.to_string().contains("CUDA_ERROR_NOT_READY"), "{e}");
    }

    #[test]
    fn sticky_errors_leave_the_context_unusable() {
        for code in [700, 702, 710, 714, 715, 716, 717, 718, 719] {
            let e = CudaError::from_code("cuStreamSynchronize", code);
            assert!(
                matches!(e, CudaError::ContextUnusable { .. }),
                "{code}: {e:?}"
            );
            assert!(e.context_unusable());
            assert!(!e.is_unsupported());
            assert_eq!(e.code(), Some(code));
            assert!(!e.to_string().contains("(unnamed)"), "{e}");
        }
        // Not sticky: out of launch resources, cooperative launch too large.
        for code in [701, 720] {
            assert!(!CudaError::from_code("cuLaunchKernel", code).context_unusable());
        }
    }

    #[test]
    fn unavailable_and_unknown_are_not_a_lost_device() {
        let e = CudaError::from_code("cuCtxCreate", 46);
        assert!(
            matches!(e, CudaError::DeviceUnavailable { code: Some(46), .. }),
            "{e:?}"
        );
        assert!(!e.context_unusable());
        assert!(
            e.to_string().contains("CUDA_ERROR_DEVICE_UNAVAILABLE"),
            "{e}"
        );
        let e = CudaError::from_code("cuMemAlloc", 999);
        assert!(matches!(e, CudaError::Driver { code: 999, .. }), "{e:?}");
        assert!(!e.context_unusable());
        let e = CudaError::from_code("cuMemAlloc", 214);
        assert!(matches!(e, CudaError::DeviceLost { .. }), "{e:?}");
    }

    #[test]
    fn codes_newer_than_this_code_are_kept_with_their_number() {
        // CUDA 13 returns codes older bindings lack (e.g. 36, 47, 227, 917-919).
        for code in [47, 227, 917, 918, 919, 12345] {
            let e = CudaError::from_code("cuMemCreate", code);
            assert_eq!(e.code(), Some(code));
            assert!(e.to_string().contains(&code.to_string()), "{e}");
        }
        assert_eq!(result_name(36), "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER");
    }
}
