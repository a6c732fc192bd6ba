//! Streams and events.

use std::sync::Arc;

use super::context::ContextInner;
use super::sys::{self, consts as C};
use super::{CudaApi, check, check_logged};
use crate::api::{Event, Stream};
use crate::error::{CudaError, Result};

/// A stream: one this backend made (non-blocking, `CU_STREAM_NON_BLOCKING`:
/// no implicit synchronisation with the legacy default stream), destroyed
/// on drop, or one borrowed from whoever made it, left to them.
#[derive(Debug)]
pub struct CudaStream {
    ctx: Arc<ContextInner>,
    raw: sys::CuStrm,
    owned: bool,
}

// SAFETY: a CUstream is a driver handle usable from any thread; the driver
// serialises work queued on it.
unsafe impl Send for CudaStream {}
// SAFETY: as above.
unsafe impl Sync for CudaStream {}

impl CudaStream {
    pub(crate) fn new(ctx: &Arc<ContextInner>) -> Result<Self> {
        let _current = ctx.enter()?;
        let mut raw: sys::CuStrm = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        check("cuStreamCreate", unsafe {
            (ctx.drv.req.cuStreamCreate)(&mut raw, C::CU_STREAM_NON_BLOCKING)
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            raw,
            owned: true,
        })
    }

    /// `raw`, made by someone else, used in place and never destroyed.
    ///
    /// # Safety
    /// `raw` is a stream of `ctx`'s primary context (or a special handle)
    /// that outlives the returned value.
    pub(crate) unsafe fn borrowed(ctx: &Arc<ContextInner>, raw: sys::CuStrm) -> Self {
        Self {
            ctx: ctx.clone(),
            raw,
            owned: false,
        }
    }

    /// The raw `CUstream`, valid while `self` lives.
    pub fn raw(&self) -> sys::CuStream {
        self.raw.cast()
    }
}

impl Stream<CudaApi> for CudaStream {
    unsafe fn copy_host_to_device(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _current = self.ctx.enter()?;
        // SAFETY: the caller guarantees both ranges stay valid until the copy
        // completes (this method's contract); the stream belongs to the
        // current context.
        check("cuMemcpyHtoDAsync", unsafe {
            (self.ctx.drv.req.cuMemcpyHtoDAsync_v2)(dst, src.cast(), len, self.raw)
        })
    }

    unsafe fn copy_device_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _current = self.ctx.enter()?;
        // SAFETY: as for copy_host_to_device, with `dst` writable host memory.
        check("cuMemcpyDtoHAsync", unsafe {
            (self.ctx.drv.req.cuMemcpyDtoHAsync_v2)(dst.cast(), src, len, self.raw)
        })
    }

    unsafe fn copy_device_to_device(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _current = self.ctx.enter()?;
        // SAFETY: the caller guarantees both device ranges stay valid until
        // the copy completes.
        check("cuMemcpyDtoDAsync", unsafe {
            (self.ctx.drv.req.cuMemcpyDtoDAsync_v2)(dst, src, len, self.raw)
        })
    }

    unsafe fn memset(&self, dst: u64, value: u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _current = self.ctx.enter()?;
        // SAFETY: the caller guarantees the device range stays valid until
        // the set completes.
        check("cuMemsetD8Async", unsafe {
            (self.ctx.drv.req.cuMemsetD8Async)(dst, value, len, self.raw)
        })
    }

    fn record(&self, event: &CudaEvent) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: both handles are alive for the call.
        check("cuEventRecord", unsafe {
            (self.ctx.drv.req.cuEventRecord)(event.raw, self.raw)
        })
    }

    fn wait(&self, event: &CudaEvent) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: both handles are alive for the call; flags must be 0.
        check("cuStreamWaitEvent", unsafe {
            (self.ctx.drv.req.cuStreamWaitEvent)(self.raw, event.raw, 0)
        })
    }

    unsafe fn wait_value32(&self, addr: u64, value: u32) -> Result<()> {
        const OP: &str = "cuStreamWaitValue32";
        let memops = self.memops(OP)?;
        let _current = self.ctx.enter()?;
        // SAFETY: the caller guarantees `addr` is device-readable memory
        // valid until the wait passes; flags 0 is CU_STREAM_WAIT_VALUE_GEQ.
        check(OP, unsafe {
            (memops.cuStreamWaitValue32_v2)(self.raw, addr, value, 0)
        })
    }

    unsafe fn write_value32(&self, addr: u64, value: u32) -> Result<()> {
        const OP: &str = "cuStreamWriteValue32";
        let memops = self.memops(OP)?;
        let _current = self.ctx.enter()?;
        // SAFETY: the caller guarantees `addr` is device-writable memory
        // valid until the write is done; flags 0 is the default write.
        check(OP, unsafe {
            (memops.cuStreamWriteValue32_v2)(self.raw, addr, value, 0)
        })
    }

    fn synchronize(&self) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: the stream is alive for the call.
        check("cuStreamSynchronize", unsafe {
            (self.ctx.drv.req.cuStreamSynchronize)(self.raw)
        })
    }

    fn raw(&self) -> *mut std::ffi::c_void {
        CudaStream::raw(self)
    }
}

impl CudaStream {
    /// The stream memory operations, or NotSupported for `operation`.
    fn memops(&self, operation: &'static str) -> Result<&sys::StreamMemOps> {
        self.ctx.drv.memops.as_ref().ok_or(CudaError::NotSupported {
            operation,
            reason: "the driver has no stream memory operations".into(),
            code: None,
        })
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let _current = self.ctx.enter_logged();
        // SAFETY: `raw` came from cuStreamCreate and is destroyed once, here;
        // the driver lets queued work finish first.
        check_logged("cuStreamDestroy", unsafe {
            (self.ctx.drv.req.cuStreamDestroy_v2)(self.raw)
        });
    }
}

/// An event with timing disabled, destroyed on drop.
#[derive(Debug)]
pub struct CudaEvent {
    ctx: Arc<ContextInner>,
    raw: sys::CuEvent,
}

// SAFETY: a CUevent is a driver handle usable from any thread.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    pub(crate) fn new(ctx: &Arc<ContextInner>) -> Result<Self> {
        let _current = ctx.enter()?;
        let mut raw: sys::CuEvent = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        check("cuEventCreate", unsafe {
            (ctx.drv.req.cuEventCreate)(&mut raw, C::CU_EVENT_DISABLE_TIMING)
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            raw,
        })
    }
}

impl Event for CudaEvent {
    fn is_complete(&self) -> Result<bool> {
        const NOT_READY: u32 = C::CUDA_ERROR_NOT_READY;
        let _current = self.ctx.enter()?;
        // SAFETY: the event is alive for the call.
        match unsafe { (self.ctx.drv.req.cuEventQuery)(self.raw) } {
            C::CUDA_SUCCESS => Ok(true),
            NOT_READY => Ok(false),
            code => Err(CudaError::from_code("cuEventQuery", code)),
        }
    }

    fn synchronize(&self) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: the event is alive for the call.
        check("cuEventSynchronize", unsafe {
            (self.ctx.drv.req.cuEventSynchronize)(self.raw)
        })
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let _current = self.ctx.enter_logged();
        // SAFETY: `raw` came from cuEventCreate and is destroyed once, here.
        check_logged("cuEventDestroy", unsafe {
            (self.ctx.drv.req.cuEventDestroy_v2)(self.raw)
        });
    }
}
