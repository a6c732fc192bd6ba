//! # gdr-ffi
//!
//! The C ABI of gdr, in the manner of rustls-ffi: one `#[repr(u32)]` result
//! enum with its own number range, every export behind a panic boundary,
//! outputs written only on success. This first cut carries the result codes
//! and their mapping from the HAL errors; the buffer, registration and
//! transfer entry points come with the engine.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

use std::ffi::{CStr, c_char};

use hal_cuda::CudaError;
use hal_verbs::VerbsError;

/// Result of every gdr C function. `GDR_OK` is 0; errors start at 7000 so
/// they never collide with errno values or CUresult codes a caller also sees.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
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
    /// A bad argument, including NULL where a pointer is required.
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
            _ => Self::Other,
        }
    }
}

impl GdrResult {
    fn message(self) -> &'static CStr {
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
        }
    }
}

/// The library version as a static NUL-terminated string.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_version() -> *const c_char {
    static VERSION: &CStr = c"gdr 0.1.0";
    VERSION.as_ptr()
}

/// A static NUL-terminated description of `result`; unknown values get
/// "unknown result". Never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_result_message(result: u32) -> *const c_char {
    let known = [
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
    ];
    known
        .into_iter()
        .find(|r| *r as u32 == result)
        .map_or(c"unknown result", GdrResult::message)
        .as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hal_errors_map_to_distinct_codes_with_messages() {
        let verbs = VerbsError::from_errno("ibv_reg_dmabuf_mr", "rxe0", 95);
        assert_eq!(GdrResult::from(&verbs), GdrResult::NotSupported);
        let timeout = VerbsError::Timeout {
            operation: "rdma_connect",
            waited: std::time::Duration::from_secs(1),
            detail: "nobody listening".into(),
        };
        assert_eq!(GdrResult::from(&timeout), GdrResult::Timeout);
        let cuda = CudaError::from_code("cuMemAlloc", 2);
        assert_eq!(GdrResult::from(&cuda), GdrResult::OutOfResources);
        // SAFETY: gdr_result_message returns a static NUL-terminated string.
        let text = unsafe { CStr::from_ptr(gdr_result_message(GdrResult::NotSupported as u32)) };
        assert_eq!(text.to_str().unwrap(), "not supported");
        // SAFETY: as above.
        let text = unsafe { CStr::from_ptr(gdr_result_message(12345)) };
        assert_eq!(text.to_str().unwrap(), "unknown result");
        // SAFETY: as above.
        let version = unsafe { CStr::from_ptr(gdr_version()) };
        assert!(version.to_str().unwrap().starts_with("gdr "));
    }
}
