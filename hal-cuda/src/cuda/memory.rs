//! Owned memory: device allocations, pinned host allocations, host
//! registrations and IPC mappings. Each keeps its context alive and frees its
//! memory on drop.

use std::ffi::c_void;
use std::sync::Arc;

use super::context::{ContextInner, address_range};
use super::sys::{self, consts as C};
use super::{check, check_logged};
use crate::api::{DeviceMemory, HostRegistration, IpcMapping, PinnedHostMemory};
use crate::error::{CudaError, Result};
use crate::types::{HostRegisterFlags, IpcMemHandle};

/// Device memory from `cuMemAlloc`, freed (`cuMemFree`) on drop.
#[derive(Debug)]
pub struct CudaDeviceMemory {
    ctx: Arc<ContextInner>,
    ptr: sys::CuDevicePtr,
    len: usize,
}

impl CudaDeviceMemory {
    pub(crate) fn new(ctx: &Arc<ContextInner>, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(CudaError::invalid("cuMemAlloc", "zero-length allocation"));
        }
        let _current = ctx.enter()?;
        let mut ptr: sys::CuDevicePtr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the context is current.
        check("cuMemAlloc", unsafe {
            (ctx.drv.req.cuMemAlloc_v2)(&mut ptr, len)
        })?;
        tracing::debug!(
            ptr = format_args!("{ptr:#x}"),
            len,
            "device memory allocated"
        );
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }
}

impl DeviceMemory for CudaDeviceMemory {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for CudaDeviceMemory {
    fn drop(&mut self) {
        let _current = self.ctx.enter_logged();
        // SAFETY: `ptr` came from cuMemAlloc and is freed once, here.
        check_logged("cuMemFree", unsafe {
            (self.ctx.drv.req.cuMemFree_v2)(self.ptr)
        });
    }
}

/// Pinned host memory from `cuMemHostAlloc` (portable: pinned for every
/// context), freed (`cuMemFreeHost`) on drop.
#[derive(Debug)]
pub struct CudaPinnedHostMemory {
    ctx: Arc<ContextInner>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory is owned by this handle and only its address is shared;
// who reads or writes it through that address synchronises themselves (the
// trait hands out a raw pointer, not a reference).
unsafe impl Send for CudaPinnedHostMemory {}
// SAFETY: as above; `&self` only reads the pointer and length.
unsafe impl Sync for CudaPinnedHostMemory {}

impl CudaPinnedHostMemory {
    pub(crate) fn new(ctx: &Arc<ContextInner>, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(CudaError::invalid(
                "cuMemHostAlloc",
                "zero-length allocation",
            ));
        }
        let _current = ctx.enter()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer; the context is current.
        check("cuMemHostAlloc", unsafe {
            (ctx.drv.req.cuMemHostAlloc)(&mut ptr, len, C::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        tracing::debug!(?ptr, len, "pinned host memory allocated");
        Ok(Self {
            ctx: ctx.clone(),
            ptr: ptr.cast(),
            len,
        })
    }
}

impl PinnedHostMemory for CudaPinnedHostMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for CudaPinnedHostMemory {
    fn drop(&mut self) {
        let _current = self.ctx.enter_logged();
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once, here.
        check_logged("cuMemFreeHost", unsafe {
            (self.ctx.drv.req.cuMemFreeHost)(self.ptr.cast())
        });
    }
}

/// Existing host memory page-locked by `cuMemHostRegister`, unregistered on
/// drop.
#[derive(Debug)]
pub struct CudaHostRegistration {
    ctx: Arc<ContextInner>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the handle owns only the registration, not the memory; it hands
// out the address and never dereferences it.
unsafe impl Send for CudaHostRegistration {}
// SAFETY: as above.
unsafe impl Sync for CudaHostRegistration {}

impl CudaHostRegistration {
    /// # Safety
    /// `ptr..ptr+len` must be mapped host memory that outlives the result.
    pub(crate) unsafe fn new(
        ctx: &Arc<ContextInner>,
        ptr: *mut u8,
        len: usize,
        flags: HostRegisterFlags,
    ) -> Result<Self> {
        if len == 0 || ptr.is_null() {
            return Err(CudaError::invalid(
                "cuMemHostRegister",
                "empty or null range",
            ));
        }
        let _current = ctx.enter()?;
        // SAFETY: the caller guarantees the range is mapped host memory that
        // outlives the registration; the flag bits are cuda.h's values.
        check("cuMemHostRegister", unsafe {
            (ctx.drv.req.cuMemHostRegister_v2)(ptr.cast(), len, flags.bits())
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }
}

impl HostRegistration for CudaHostRegistration {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for CudaHostRegistration {
    fn drop(&mut self) {
        let _current = self.ctx.enter_logged();
        // SAFETY: `ptr` was registered by cuMemHostRegister and is
        // unregistered once, here, while the memory is still mapped (the
        // registration's contract).
        check_logged("cuMemHostUnregister", unsafe {
            (self.ctx.drv.req.cuMemHostUnregister)(self.ptr.cast())
        });
    }
}

/// Another process's allocation, mapped from its IPC handle
/// (`cuIpcOpenMemHandle` with lazy peer access), closed on drop.
#[derive(Debug)]
pub struct CudaIpcMapping {
    ctx: Arc<ContextInner>,
    ptr: sys::CuDevicePtr,
    len: usize,
}

impl CudaIpcMapping {
    pub(crate) fn open(ctx: &Arc<ContextInner>, handle: &IpcMemHandle) -> Result<Self> {
        let _current = ctx.enter()?;
        let native = sys::CuIpcMemHandle {
            reserved: handle.0.map(|b| b as _),
        };
        let mut ptr: sys::CuDevicePtr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the handle is passed by value
        // and the driver validates it.
        check("cuIpcOpenMemHandle", unsafe {
            (ctx.drv.req.cuIpcOpenMemHandle_v2)(
                &mut ptr,
                native,
                C::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
            )
        })?;
        let mut mapping = Self {
            ctx: ctx.clone(),
            ptr,
            len: 0,
        };
        // From here on `mapping`'s drop closes the handle on error.
        let (_, len) = address_range(ctx.drv, ptr)?;
        mapping.len = len as usize;
        Ok(mapping)
    }
}

impl IpcMapping for CudaIpcMapping {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for CudaIpcMapping {
    fn drop(&mut self) {
        let _current = self.ctx.enter_logged();
        // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once, here.
        check_logged("cuIpcCloseMemHandle", unsafe {
            (self.ctx.drv.req.cuIpcCloseMemHandle)(self.ptr)
        });
    }
}
