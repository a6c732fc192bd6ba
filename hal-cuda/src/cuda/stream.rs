//! Streams and events.

use std::sync::Arc;

use cudarc::driver::sys;

use super::context::ContextInner;
use super::{CudaApi, call, call_logged, raw_call};
use crate::api::{Event, Stream};
use crate::error::{CudaError, Result};

/// A non-blocking stream (`CU_STREAM_NON_BLOCKING`: no implicit
/// synchronisation with the legacy default stream), destroyed on drop.
#[derive(Debug)]
pub struct CudaStream {
    ctx: Arc<ContextInner>,
    raw: sys::CUstream,
}

// SAFETY: a CUstream is a driver handle usable from any thread; the driver
// serialises work queued on it.
unsafe impl Send for CudaStream {}
// SAFETY: as above.
unsafe impl Sync for CudaStream {}

impl CudaStream {
    pub(crate) fn new(ctx: &Arc<ContextInner>) -> Result<Self> {
        ctx.bind()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        call("cuStreamCreate", || unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            raw,
        })
    }

    /// The raw `CUstream`, valid while `self` lives.
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }
}

impl Stream<CudaApi> for CudaStream {
    unsafe fn copy_host_to_device(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: the caller guarantees both ranges stay valid until the copy
        // completes (this method's contract); the stream belongs to the
        // current context.
        call("cuMemcpyHtoDAsync", || unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.raw)
        })
    }

    unsafe fn copy_device_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: as for copy_host_to_device, with `dst` writable host memory.
        call("cuMemcpyDtoHAsync", || unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.raw)
        })
    }

    unsafe fn copy_device_to_device(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: the caller guarantees both device ranges stay valid until
        // the copy completes.
        call("cuMemcpyDtoDAsync", || unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.raw)
        })
    }

    unsafe fn memset(&self, dst: u64, value: u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: the caller guarantees the device range stays valid until
        // the set completes.
        call("cuMemsetD8Async", || unsafe {
            sys::cuMemsetD8Async(dst, value, len, self.raw)
        })
    }

    fn record(&self, event: &CudaEvent) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: both handles are alive for the call.
        call("cuEventRecord", || unsafe {
            sys::cuEventRecord(event.raw, self.raw)
        })
    }

    fn wait(&self, event: &CudaEvent) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: both handles are alive for the call; flags must be 0.
        call("cuStreamWaitEvent", || unsafe {
            sys::cuStreamWaitEvent(self.raw, event.raw, 0)
        })
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the stream is alive for the call.
        call("cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        self.ctx.bind_logged();
        // SAFETY: `raw` came from cuStreamCreate and is destroyed once, here;
        // the driver lets queued work finish first.
        call_logged("cuStreamDestroy", || unsafe {
            sys::cuStreamDestroy_v2(self.raw)
        });
    }
}

/// An event with timing disabled, destroyed on drop.
#[derive(Debug)]
pub struct CudaEvent {
    ctx: Arc<ContextInner>,
    raw: sys::CUevent,
}

// SAFETY: a CUevent is a driver handle usable from any thread.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    pub(crate) fn new(ctx: &Arc<ContextInner>) -> Result<Self> {
        ctx.bind()?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        call("cuEventCreate", || unsafe {
            sys::cuEventCreate(&mut raw, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            raw,
        })
    }
}

impl Event for CudaEvent {
    fn is_complete(&self) -> Result<bool> {
        const NOT_READY: u32 = 600;
        self.ctx.bind()?;
        // SAFETY: the event is alive for the call.
        match raw_call("cuEventQuery", || unsafe { sys::cuEventQuery(self.raw) })? {
            0 => Ok(true),
            NOT_READY => Ok(false),
            code => Err(CudaError::from_code("cuEventQuery", code)),
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the event is alive for the call.
        call("cuEventSynchronize", || unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        self.ctx.bind_logged();
        // SAFETY: `raw` came from cuEventCreate and is destroyed once, here.
        call_logged("cuEventDestroy", || unsafe {
            sys::cuEventDestroy_v2(self.raw)
        });
    }
}
