//! The driver entry points this backend calls, resolved from libcuda with
//! `libloading` into function pointers of our own types.
//!
//! Every entry point returns the raw `CUresult` as a `u32`, never a Rust
//! enum: a newer driver returns codes an older binding does not list (CUDA 13
//! returns 36, 47, 227, 917–919 …), and an unlisted value in a Rust enum is
//! undefined behaviour before any code can look at it. Arguments that are C
//! enums are passed as the `c_int`/`c_uint` they are in the C ABI, and
//! structures are declared here with `cuda.h`'s layout.
//!
//! Every symbol is looked up once, when the library is opened: a missing
//! required one makes loading fail with [`CudaError::LibraryUnavailable`]
//! naming it; a missing optional one (newer than the oldest driver gdr
//! supports) is `None`, and the operation that needs it answers
//! [`CudaError::NotSupported`]. Nothing is resolved lazily, so no call can
//! hit a missing symbol.

#![allow(non_snake_case)]

use std::ffi::c_void;
use std::os::raw::{c_char, c_int, c_uint, c_ulonglong};
use std::sync::OnceLock;

use crate::error::{CudaError, Result};

/// A raw `CUresult`.
pub(crate) type CuResult = u32;
/// `CUdevice`.
pub(crate) type CuDevice = c_int;
/// `CUdeviceptr`.
pub(crate) type CuDevicePtr = c_ulonglong;
/// `CUcontext`: an opaque driver handle.
pub type CuContext = *mut c_void;
/// `CUstream`: an opaque driver handle.
pub type CuStream = *mut c_void;
/// `CUevent`: an opaque driver handle.
pub(crate) type CuEvent = *mut c_void;
/// `CUmemGenericAllocationHandle`.
pub(crate) type CuMemHandle = c_ulonglong;

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct CuIpcMemHandle {
    pub(crate) reserved: [c_char; 64],
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct CuMemLocation {
    /// `CUmemLocationType` (`CU_MEM_LOCATION_TYPE_DEVICE` = 1).
    pub(crate) kind: c_uint,
    /// The device ordinal.
    pub(crate) id: c_int,
}

/// The `allocFlags` member of `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CuMemAllocFlags {
    pub(crate) compression_type: u8,
    pub(crate) gpu_direct_rdma_capable: u8,
    pub(crate) usage: u16,
    pub(crate) reserved: [u8; 4],
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct CuMemAllocationProp {
    /// `CUmemAllocationType` (`CU_MEM_ALLOCATION_TYPE_PINNED` = 1).
    pub(crate) kind: c_uint,
    /// `CUmemAllocationHandleType` (none = 0).
    pub(crate) requested_handle_types: c_uint,
    pub(crate) location: CuMemLocation,
    pub(crate) win32_handle_meta_data: *mut c_void,
    pub(crate) alloc_flags: CuMemAllocFlags,
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct CuMemAccessDesc {
    pub(crate) location: CuMemLocation,
    /// `CUmemAccess_flags` (`CU_MEM_ACCESS_FLAGS_PROT_READWRITE` = 3).
    pub(crate) flags: c_uint,
}

// Layouts as in cuda.h on 64-bit targets.
const _: () = assert!(std::mem::size_of::<CuMemAllocationProp>() == 32);
const _: () = assert!(std::mem::size_of::<CuMemAccessDesc>() == 12);
const _: () = assert!(std::mem::size_of::<CuIpcMemHandle>() == 64);

/// `cuda.h` constants, as the integers the C ABI passes.
pub(crate) mod consts {
    use std::os::raw::{c_int, c_uint};

    pub(crate) const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
    pub(crate) const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;
    pub(crate) const CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: c_int = 102;
    pub(crate) const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: c_int = 110;
    pub(crate) const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED: c_int = 116;
    pub(crate) const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS: c_int = 117;
    pub(crate) const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING: c_int = 118;
    pub(crate) const CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: c_int = 124;

    pub(crate) const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
    pub(crate) const CU_POINTER_ATTRIBUTE_BUFFER_ID: c_int = 7;
    pub(crate) const CU_POINTER_ATTRIBUTE_IS_MANAGED: c_int = 8;
    pub(crate) const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
    pub(crate) const CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: c_int = 10;
    pub(crate) const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: c_int = 11;
    pub(crate) const CU_POINTER_ATTRIBUTE_RANGE_SIZE: c_int = 12;
    pub(crate) const CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: c_int = 15;
    pub(crate) const CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: c_int = 17;

    pub(crate) const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;
    pub(crate) const CU_STREAM_NON_BLOCKING: c_uint = 1;
    pub(crate) const CU_EVENT_DISABLE_TIMING: c_uint = 2;
    pub(crate) const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
    pub(crate) const CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;
    pub(crate) const CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX: c_int = 0;
    pub(crate) const CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER: c_int = 100;
    pub(crate) const CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES: c_int = 200;

    pub(crate) const CU_MEM_ALLOCATION_TYPE_PINNED: c_uint = 1;
    pub(crate) const CU_MEM_LOCATION_TYPE_DEVICE: c_uint = 1;
    pub(crate) const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_uint = 3;
    pub(crate) const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;
}

/// Declares a table of entry points: a struct of function pointers and a
/// constructor that resolves each one by its exact symbol name.
macro_rules! entry_points {
    (
        $(#[$meta:meta])*
        struct $table:ident {
            $( $name:ident : fn($($arg:ty),* $(,)?); )*
        }
    ) => {
        $(#[$meta])*
        pub(crate) struct $table {
            $( pub(crate) $name: unsafe extern "C" fn($($arg),*) -> CuResult, )*
        }

        impl $table {
            /// The symbol names of the table, in order.
            #[allow(dead_code)]
            pub(crate) const SYMBOLS: &[&str] = &[$(stringify!($name)),*];

            /// Resolves every entry point, or names the first one missing.
            ///
            /// # Safety
            /// `lib` must be the CUDA driver library, whose symbols of these
            /// names have the signatures declared here (cuda.h's).
            unsafe fn resolve(lib: &libloading::Library) -> std::result::Result<Self, &'static str> {
                Ok(Self {
                    $(
                        // SAFETY: the caller vouches that `lib` is libcuda, whose
                        // symbol of this name has this C signature; the pointer is
                        // copied out and used only while the library stays loaded
                        // (it is never unloaded: see `driver`).
                        $name: unsafe {
                            *lib.get::<unsafe extern "C" fn($($arg),*) -> CuResult>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                            .map_err(|_| stringify!($name))?
                        },
                    )*
                })
            }
        }

        impl std::fmt::Debug for $table {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($table)).finish_non_exhaustive()
            }
        }
    };
}

entry_points! {
    /// The entry points gdr cannot work without; all exist since CUDA 11.0.
    struct Required {
        cuInit: fn(c_uint);
        cuDriverGetVersion: fn(*mut c_int);
        cuDeviceGetCount: fn(*mut c_int);
        cuDeviceGet: fn(*mut CuDevice, c_int);
        cuDeviceGetName: fn(*mut c_char, c_int, CuDevice);
        cuDeviceGetPCIBusId: fn(*mut c_char, c_int, CuDevice);
        cuDeviceTotalMem_v2: fn(*mut usize, CuDevice);
        cuDeviceGetAttribute: fn(*mut c_int, c_int, CuDevice);
        cuDevicePrimaryCtxRetain: fn(*mut CuContext, CuDevice);
        cuDevicePrimaryCtxRelease_v2: fn(CuDevice);
        cuCtxGetCurrent: fn(*mut CuContext);
        cuCtxPushCurrent_v2: fn(CuContext);
        cuCtxPopCurrent_v2: fn(*mut CuContext);
        cuCtxSynchronize: fn();
        cuMemGetAddressRange_v2: fn(*mut CuDevicePtr, *mut usize, CuDevicePtr);
        cuPointerGetAttributes: fn(c_uint, *mut c_int, *mut *mut c_void, CuDevicePtr);
        cuMemAlloc_v2: fn(*mut CuDevicePtr, usize);
        cuMemFree_v2: fn(CuDevicePtr);
        cuMemHostAlloc: fn(*mut *mut c_void, usize, c_uint);
        cuMemFreeHost: fn(*mut c_void);
        cuMemHostRegister_v2: fn(*mut c_void, usize, c_uint);
        cuMemHostUnregister: fn(*mut c_void);
        cuMemcpyHtoD_v2: fn(CuDevicePtr, *const c_void, usize);
        cuMemcpyDtoH_v2: fn(*mut c_void, CuDevicePtr, usize);
        cuIpcGetMemHandle: fn(*mut CuIpcMemHandle, CuDevicePtr);
        cuIpcOpenMemHandle_v2: fn(*mut CuDevicePtr, CuIpcMemHandle, c_uint);
        cuIpcCloseMemHandle: fn(CuDevicePtr);
        cuStreamCreate: fn(*mut CuStream, c_uint);
        cuStreamDestroy_v2: fn(CuStream);
        cuStreamSynchronize: fn(CuStream);
        cuStreamWaitEvent: fn(CuStream, CuEvent, c_uint);
        cuMemcpyHtoDAsync_v2: fn(CuDevicePtr, *const c_void, usize, CuStream);
        cuMemcpyDtoHAsync_v2: fn(*mut c_void, CuDevicePtr, usize, CuStream);
        cuMemcpyDtoDAsync_v2: fn(CuDevicePtr, CuDevicePtr, usize, CuStream);
        cuMemsetD8Async: fn(CuDevicePtr, u8, usize, CuStream);
        cuEventCreate: fn(*mut CuEvent, c_uint);
        cuEventDestroy_v2: fn(CuEvent);
        cuEventRecord: fn(CuEvent, CuStream);
        cuEventQuery: fn(CuEvent);
        cuEventSynchronize: fn(CuEvent);
    }
}

entry_points! {
    /// `cuMemGetHandleForAddressRange` (CUDA 11.7+): dma-buf export.
    struct DmabufExport {
        cuMemGetHandleForAddressRange: fn(*mut c_void, CuDevicePtr, usize, c_int, c_ulonglong);
    }
}

entry_points! {
    /// `cuFlushGPUDirectRDMAWrites` (CUDA 11.3+).
    struct FlushWrites {
        cuFlushGPUDirectRDMAWrites: fn(c_int, c_int);
    }
}

entry_points! {
    /// The virtual memory management API (CUDA 10.2+), present as a whole or
    /// not at all.
    struct Vmm {
        cuMemGetAllocationGranularity: fn(*mut usize, *const CuMemAllocationProp, c_int);
        cuMemAddressReserve: fn(*mut CuDevicePtr, usize, usize, CuDevicePtr, c_ulonglong);
        cuMemAddressFree: fn(CuDevicePtr, usize);
        cuMemCreate: fn(*mut CuMemHandle, usize, *const CuMemAllocationProp, c_ulonglong);
        cuMemRelease: fn(CuMemHandle);
        cuMemMap: fn(CuDevicePtr, usize, usize, CuMemHandle, c_ulonglong);
        cuMemUnmap: fn(CuDevicePtr, usize);
        cuMemSetAccess: fn(CuDevicePtr, usize, *const CuMemAccessDesc, usize);
    }
}

/// The loaded driver: required entry points, and the optional groups that
/// the library has.
#[derive(Debug)]
pub(crate) struct Driver {
    pub(crate) req: Required,
    pub(crate) dmabuf: Option<DmabufExport>,
    pub(crate) flush: Option<FlushWrites>,
    pub(crate) vmm: Option<Vmm>,
    /// The file name that opened.
    pub(crate) library: &'static str,
}

/// The library names tried, in order.
pub(crate) const LIBRARY_NAMES: &[&str] = &["libcuda.so.1", "libcuda.so"];

static DRIVER: OnceLock<std::result::Result<Driver, CudaError>> = OnceLock::new();

/// The process's driver table, opened and resolved on first use. The library
/// is never unloaded (driver handles outlive any one owner), so the function
/// pointers stay valid for the life of the process.
pub(crate) fn driver() -> Result<&'static Driver> {
    DRIVER.get_or_init(open).as_ref().map_err(Clone::clone)
}

fn open() -> std::result::Result<Driver, CudaError> {
    let mut failures = Vec::new();
    for &name in LIBRARY_NAMES {
        // SAFETY: loading runs the library's initialisers; libcuda's are the
        // driver's own, written to be run by dlopen in any process.
        let lib = match unsafe { libloading::Library::new(name) } {
            Ok(lib) => lib,
            Err(e) => {
                // libloading keeps dlerror()'s text in the source.
                match std::error::Error::source(&e) {
                    Some(detail) => failures.push(format!("{name}: {e}: {detail}")),
                    None => failures.push(format!("{name}: {e}")),
                }
                continue;
            }
        };
        // SAFETY: `lib` was opened under libcuda's name; the tables declare
        // cuda.h's signatures.
        let req =
            unsafe { Required::resolve(&lib) }.map_err(|symbol| CudaError::LibraryUnavailable {
                library: name_static(name),
                reason: format!("{name} does not export {symbol}: not a usable CUDA driver"),
            })?;
        // SAFETY: as above.
        let dmabuf = unsafe { DmabufExport::resolve(&lib) }.ok();
        // SAFETY: as above.
        let flush = unsafe { FlushWrites::resolve(&lib) }.ok();
        // SAFETY: as above.
        let vmm = unsafe { Vmm::resolve(&lib) }.ok();
        // The pointers above must stay valid for the process's life.
        std::mem::forget(lib);
        return Ok(Driver {
            req,
            dmabuf,
            flush,
            vmm,
            library: name_static(name),
        });
    }
    Err(CudaError::LibraryUnavailable {
        library: LIBRARY_NAMES[0],
        reason: format!(
            "no libcuda could be opened (is the NVIDIA driver installed?): {}",
            failures.join("; ")
        ),
    })
}

fn name_static(name: &str) -> &'static str {
    LIBRARY_NAMES
        .iter()
        .copied()
        .find(|n| *n == name)
        .unwrap_or(LIBRARY_NAMES[0])
}
