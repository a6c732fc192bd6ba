//! The driver entry points this backend calls, resolved from libcuda with
//! `libloading` into function pointers of our own types.
//!
//! Every entry point returns the raw `CUresult` as a `u32`, never a Rust
//! enum: a newer driver returns codes an older binding does not list (CUDA 13
//! returns 36, 47, 227, 917–919 …), and an unlisted value in a Rust enum is
//! undefined behaviour before any code can look at it. Arguments that are C
//! enums are passed as the `c_int`/`c_uint` they are in the C ABI.
//!
//! The types and constants are cudarc's (`cudarc::driver::sys`, bindings of
//! CUDA 12.8): handle and structure types where their layout is the
//! driver's, and constants converted from cudarc's enums to integers. Only
//! cudarc's functions are not used: its function pointers return `CUresult`
//! as a Rust enum, and it resolves symbols lazily, panicking on a missing
//! one.
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

// The driver's types and constants come from cudarc's bindings (cuda-12080);
// its function pointers are never used (see the module documentation).
use cudarc::driver::sys as cu;

use crate::error::{CudaError, Result};

/// A raw `CUresult`: deliberately an integer, not cudarc's `CUresult` enum.
pub(crate) type CuResult = u32;
/// `CUdevice`.
pub(crate) type CuDevice = cu::CUdevice;
/// `CUdeviceptr`.
pub(crate) type CuDevicePtr = cu::CUdeviceptr;
/// `CUcontext`.
pub(crate) type CuCtx = cu::CUcontext;
/// `CUstream`.
pub(crate) type CuStrm = cu::CUstream;
/// `CUevent`.
pub(crate) type CuEvent = cu::CUevent;
/// `CUmemGenericAllocationHandle`.
pub(crate) type CuMemHandle = cu::CUmemGenericAllocationHandle;
/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
pub(crate) type CuIpcMemHandle = cu::CUipcMemHandle;
/// `CUmemLocation`.
pub(crate) type CuMemLocation = cu::CUmemLocation;
/// `CUmemAllocationProp`.
pub(crate) type CuMemAllocationProp = cu::CUmemAllocationProp;
/// `CUmemAccessDesc`.
pub(crate) type CuMemAccessDesc = cu::CUmemAccessDesc;

/// The public face of a `CUcontext`: an untyped driver handle, so that
/// callers driving libcuda themselves need not name cudarc's types.
pub type CuContext = *mut c_void;
/// The public face of a `CUstream`, as [`CuContext`].
pub type CuStream = *mut c_void;

// The contract with the driver: cuda.h's layouts on 64-bit targets. The
// structures below hold cudarc enums in their `type_`/`flags` fields; that is
// sound only because gdr passes them to the driver by `const` pointer or by
// value and never lets the driver write one back.
const _: () = assert!(std::mem::size_of::<CuMemAllocationProp>() == 32);
const _: () = assert!(std::mem::size_of::<CuMemLocation>() == 8);
const _: () = assert!(std::mem::size_of::<CuMemAccessDesc>() == 12);
const _: () = assert!(std::mem::size_of::<CuIpcMemHandle>() == 64);
const _: () = assert!(std::mem::size_of::<CuDevicePtr>() == 8);
const _: () = assert!(std::mem::size_of::<CuMemHandle>() == 8);
const _: () = assert!(std::mem::size_of::<CuDevice>() == 4);

/// `cuda.h` constants, taken from cudarc's bindings and converted once to the
/// integer the C ABI passes. Converting a valid Rust enum value to its
/// integer is always sound; the reverse (a driver's integer read as a cudarc
/// enum) is what this backend never does.
pub(crate) mod consts {
    use std::os::raw::{c_int, c_uint};

    use cudarc::driver::sys::{
        CUdevice_attribute as Dev, CUevent_flags, CUflushGPUDirectRDMAWritesScope as Scope,
        CUflushGPUDirectRDMAWritesTarget as Target, CUipcMem_flags,
        CUmemAllocationGranularity_flags as Granularity, CUmemRangeHandleType, CUmemorytype,
        CUpointer_attribute as Ptr, CUresult, CUstream_flags,
    };

    /// `CUDA_SUCCESS`.
    pub(crate) const CUDA_SUCCESS: u32 = CUresult::CUDA_SUCCESS as u32;
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub(crate) const CUDA_ERROR_INVALID_VALUE: u32 = CUresult::CUDA_ERROR_INVALID_VALUE as u32;
    /// `CUDA_ERROR_STUB_LIBRARY`.
    pub(crate) const CUDA_ERROR_STUB_LIBRARY: u32 = CUresult::CUDA_ERROR_STUB_LIBRARY as u32;
    /// `CUDA_ERROR_NOT_READY`.
    pub(crate) const CUDA_ERROR_NOT_READY: u32 = CUresult::CUDA_ERROR_NOT_READY as u32;
    /// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`.
    pub(crate) const CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: u32 =
        CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED as u32;

    pub(crate) const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int =
        Dev::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as c_int;
    pub(crate) const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int =
        Dev::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as c_int;
    /// cuda.h gives 102 two names; cudarc's bindgen kept only the deprecated
    /// one, `..._VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED`. Same attribute.
    pub(crate) const CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: c_int =
        Dev::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED as c_int;
    pub(crate) const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: c_int =
        Dev::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED as c_int;
    pub(crate) const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED: c_int =
        Dev::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED as c_int;
    pub(crate) const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS: c_int =
        Dev::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS as c_int;
    pub(crate) const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING: c_int =
        Dev::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING as c_int;
    pub(crate) const CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: c_int =
        Dev::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED as c_int;

    pub(crate) const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int =
        Ptr::CU_POINTER_ATTRIBUTE_MEMORY_TYPE as c_int;
    pub(crate) const CU_POINTER_ATTRIBUTE_BUFFER_ID: c_int =
        Ptr::CU_POINTER_ATTRIBUTE_BUFFER_ID as c_int;
    pub(crate) const CU_POINTER_ATTRIBUTE_IS_MANAGED: c_int =
        Ptr::CU_POINTER_ATTRIBUTE_IS_MANAGED as c_int;
    pub(crate) const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int =
        Ptr::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL as c_int;
    pub(crate) const CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: c_int =
        Ptr::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE as c_int;
    pub(crate) const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: c_int =
        Ptr::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR as c_int;
    pub(crate) const CU_POINTER_ATTRIBUTE_RANGE_SIZE: c_int =
        Ptr::CU_POINTER_ATTRIBUTE_RANGE_SIZE as c_int;
    pub(crate) const CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: c_int =
        Ptr::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE as c_int;
    pub(crate) const CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: c_int =
        Ptr::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE as c_int;

    /// `CUmemorytype` values, as the integer `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`
    /// answers (compared as an integer: a newer driver may answer others).
    pub(crate) const CU_MEMORYTYPE_HOST: u32 = CUmemorytype::CU_MEMORYTYPE_HOST as u32;
    pub(crate) const CU_MEMORYTYPE_DEVICE: u32 = CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
    pub(crate) const CU_MEMORYTYPE_ARRAY: u32 = CUmemorytype::CU_MEMORYTYPE_ARRAY as u32;
    pub(crate) const CU_MEMORYTYPE_UNIFIED: u32 = CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32;

    pub(crate) const CU_MEMHOSTALLOC_PORTABLE: c_uint =
        cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE;
    pub(crate) const CU_STREAM_NON_BLOCKING: c_uint =
        CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
    pub(crate) const CU_EVENT_DISABLE_TIMING: c_uint =
        CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
    pub(crate) const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint =
        CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
    pub(crate) const CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int =
        CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD as c_int;
    pub(crate) const CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX: c_int =
        Target::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX as c_int;
    pub(crate) const CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER: c_int =
        Scope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER as c_int;
    pub(crate) const CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES: c_int =
        Scope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES as c_int;
    pub(crate) const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int =
        Granularity::CU_MEM_ALLOC_GRANULARITY_MINIMUM as c_int;
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
        cuDevicePrimaryCtxRetain: fn(*mut CuCtx, CuDevice);
        cuDevicePrimaryCtxRelease_v2: fn(CuDevice);
        cuCtxGetCurrent: fn(*mut CuCtx);
        cuCtxPushCurrent_v2: fn(CuCtx);
        cuCtxPopCurrent_v2: fn(*mut CuCtx);
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
        cuStreamCreate: fn(*mut CuStrm, c_uint);
        cuStreamDestroy_v2: fn(CuStrm);
        cuStreamSynchronize: fn(CuStrm);
        cuStreamWaitEvent: fn(CuStrm, CuEvent, c_uint);
        cuMemcpyHtoDAsync_v2: fn(CuDevicePtr, *const c_void, usize, CuStrm);
        cuMemcpyDtoHAsync_v2: fn(*mut c_void, CuDevicePtr, usize, CuStrm);
        cuMemcpyDtoDAsync_v2: fn(CuDevicePtr, CuDevicePtr, usize, CuStrm);
        cuMemsetD8Async: fn(CuDevicePtr, u8, usize, CuStrm);
        cuEventCreate: fn(*mut CuEvent, c_uint);
        cuEventDestroy_v2: fn(CuEvent);
        cuEventRecord: fn(CuEvent, CuStrm);
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

entry_points! {
    /// Stream memory operations (CUDA 11.7+ `_v2` names): a stream waits
    /// on, or writes, a 32-bit value in memory.
    struct StreamMemOps {
        cuStreamWaitValue32_v2: fn(CuStrm, CuDevicePtr, u32, c_uint);
        cuStreamWriteValue32_v2: fn(CuStrm, CuDevicePtr, u32, c_uint);
    }
}

entry_points! {
    /// Peer access between devices (CUDA 4.0+; optional so that a driver
    /// lacking it still serves one GPU).
    struct PeerAccess {
        cuDeviceCanAccessPeer: fn(*mut c_int, CuDevice, CuDevice);
        cuCtxEnablePeerAccess: fn(CuCtx, c_uint);
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
    pub(crate) memops: Option<StreamMemOps>,
    pub(crate) peer: Option<PeerAccess>,
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
        // SAFETY: as above.
        let memops = unsafe { StreamMemOps::resolve(&lib) }.ok();
        // SAFETY: as above.
        let peer = unsafe { PeerAccess::resolve(&lib) }.ok();
        // The pointers above must stay valid for the process's life.
        std::mem::forget(lib);
        return Ok(Driver {
            req,
            dmabuf,
            flush,
            vmm,
            memops,
            peer,
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
