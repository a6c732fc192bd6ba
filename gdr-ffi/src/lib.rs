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
    /// The GPU context hit a sticky error (an illegal address, a failed
    /// launch, ...): every later call in it fails; release everything made
    /// in it and start again (a new process, or after the device's reset).
    ContextUnusable = 7012,
    /// The GPU exists but cannot be used now (exclusive-process mode with
    /// another process holding it, compute prohibited): may change later;
    /// not a lost device.
    DeviceUnavailable = 7013,
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
            Self::ContextUnusable => c"GPU context unusable after a sticky error",
            Self::DeviceUnavailable => c"GPU device unavailable now",
        }
    }

    /// Every result, for lookups by number.
    const ALL: [GdrResult; 14] = [
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
    ];
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
    GdrResult::ALL
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

    #[test]
    fn sticky_and_unavailable_gpu_errors_have_their_own_codes() {
        // A sticky error (illegal address) leaves the context unusable.
        let sticky = CudaError::from_code("cuStreamSynchronize", 700);
        assert!(
            matches!(sticky, CudaError::ContextUnusable { .. }),
            "{sticky:?}"
        );
        assert_eq!(GdrResult::from(&sticky), GdrResult::ContextUnusable);
        assert_eq!(GdrResult::ContextUnusable as u32, 7012);
        // CUDA_ERROR_DEVICE_UNAVAILABLE: not lost, not "other".
        let unavailable = CudaError::from_code("cuDevicePrimaryCtxRetain", 46);
        assert!(
            matches!(unavailable, CudaError::DeviceUnavailable { .. }),
            "{unavailable:?}"
        );
        assert_eq!(GdrResult::from(&unavailable), GdrResult::DeviceUnavailable);
        assert_eq!(GdrResult::DeviceUnavailable as u32, 7013);
        for (result, text) in [
            (
                GdrResult::ContextUnusable,
                "GPU context unusable after a sticky error",
            ),
            (GdrResult::DeviceUnavailable, "GPU device unavailable now"),
        ] {
            // SAFETY: gdr_result_message returns a static NUL-terminated string.
            let message = unsafe { CStr::from_ptr(gdr_result_message(result as u32)) };
            assert_eq!(message.to_str().unwrap(), text);
        }
        // An unlisted driver code is still "other".
        let other = CudaError::from_code("cuMemAlloc", 4242);
        assert_eq!(GdrResult::from(&other), GdrResult::Other);
    }

    #[test]
    fn every_result_has_a_distinct_number_in_the_range_and_a_message() {
        let mut numbers: Vec<u32> = GdrResult::ALL.iter().map(|&r| r as u32).collect();
        numbers.sort_unstable();
        numbers.dedup();
        assert_eq!(numbers.len(), GdrResult::ALL.len());
        for result in GdrResult::ALL {
            let n = result as u32;
            assert!(n == 0 || (7001..8000).contains(&n), "{result:?} = {n}");
            // SAFETY: gdr_result_message returns a static NUL-terminated string.
            let message = unsafe { CStr::from_ptr(gdr_result_message(n)) };
            assert_ne!(message.to_str().unwrap(), "unknown result", "{result:?}");
        }
    }
}
