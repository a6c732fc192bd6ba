//! CUDA streams in the C ABI: a stream gdr makes on one GPU of a context,
//! its native `CUstream` for the caller's own kernels and copies, copies
//! between buffers queued on it, and (in [`crate::engine`]) the
//! stream-ordered fences: a stream that waits for a batch
//! (`gdr_batch_fence_stream`) and a batch that waits for a stream
//! (`gdr_peer_submit_after_stream`).
//!
//! The stream is gdr-core's [`gdr_core::Stream`]; this module checks
//! what C hands it.
//!
//! A copy queued on a stream holds both its buffers:
//! `gdr_buffer_free` refuses them with `GDR_RESULT_BUSY` until a
//! [`gdr_stream_synchronize`] that began after the copy was queued
//! returns `GDR_RESULT_OK`, or the stream is freed ([`gdr_stream_free`]
//! waits for its work first). So memory gdr owns is never freed under a
//! copy the GPU may still run.

use std::ffi::c_void;
use std::sync::Arc;

use crate::api::{GdrBuffer, GdrContext};
use crate::boundary::{Out, ffi_boundary};
use crate::handle::{Kind, Table};
use crate::result::{FfiError, GdrResult};

/// A CUDA stream gdr made on one GPU of a context.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrStream {
    /// Opaque; 0 is never a live stream.
    pub id: u64,
}

crate::handle::c_handles!(GdrStream);

/// A stream and the context (handle) that made it; it holds the buffers
/// of its queued copies ([`gdr_core::Stream::copy`]).
pub(crate) struct StreamObject {
    pub(crate) stream: gdr_core::Stream,
}

static STREAMS: Table<StreamObject> = Table::new(Kind::Stream);

pub(crate) fn stream(handle: GdrStream) -> Result<Arc<StreamObject>, FfiError> {
    STREAMS.get(handle.id)
}

/// Creates a CUDA stream on GPU `device` of `context` (non-blocking: no
/// implicit synchronization with the legacy default stream) and writes its
/// handle to `out`. `GDR_RESULT_NO_DEVICE` without that GPU. Any thread;
/// a stream's functions may be called from any thread (work is queued in
/// the order the calls queue it).
///
/// # Safety
/// `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_stream_new(
    context: GdrContext,
    device: u32,
    out: *mut GdrStream,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        let owner = crate::api::context(context)?;
        let stream = owner.context.stream(device)?;
        let object = StreamObject { stream };
        // SAFETY: `out` checked by Out::new; valid by the caller's contract.
        unsafe { STREAMS.publish(Arc::new(object), out) }
    }
}

/// Waits until the work queued on the stream is done (a fence until its
/// batch has ended), then destroys the stream; the buffers its copies held
/// are let go. Returns the stream's failure if its work failed (e.g.
/// `GDR_RESULT_CONTEXT_UNUSABLE`); the handle is invalid afterwards
/// whatever it returns. Any thread.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_stream_free(stream: GdrStream) -> GdrResult {
    ffi_boundary! {
        let object = STREAMS.remove(stream.id)?;
        Ok(object.stream.synchronize()?)
    }
}

/// Writes the stream's native handle to `out`: with the real CUDA backend
/// its `CUstream` (cast it to `CUstream`), valid until
/// [`gdr_stream_free`], on which the caller may queue its own kernels,
/// copies and events (in the stream's GPU's primary context; do not
/// destroy it). With the simulated GPU an opaque non-NULL token that no
/// CUDA function accepts. Any thread.
///
/// # Safety
/// `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_stream_raw(stream: GdrStream, out: *mut *mut c_void) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        let raw = self::stream(stream)?.stream.raw();
        // SAFETY: checked; valid by the caller's contract.
        unsafe { out.write(raw) };
        Ok(())
    }
}

/// Blocks until the work queued on the stream so far is done (fences
/// until their batches have ended). Once it returns `GDR_RESULT_OK`, the
/// buffers of the copies queued before the call can be freed again. Any
/// thread.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_stream_synchronize(stream: GdrStream) -> GdrResult {
    ffi_boundary! {
        Ok(self::stream(stream)?.stream.synchronize()?)
    }
}

/// Queues on the stream an asynchronous copy of `len` bytes from
/// `src_buffer` at `src_offset` to `dst_buffer` at `dst_offset`: host to
/// device, device to host or device to device (device memory of the
/// stream's GPU; both buffers of the stream's context; the ranges must not
/// overlap). It runs in stream order: after work queued before it (a
/// fence's batch included), before work queued after it (a gated batch
/// included). Both buffers are held until the stream is seen past the copy
/// ([`gdr_stream_synchronize`] returning `GDR_RESULT_OK`, or
/// [`gdr_stream_free`]): meanwhile [`crate::api::gdr_buffer_free`] refuses
/// them with `GDR_RESULT_BUSY`. Memory the caller wrapped
/// (`gdr_buffer_wrap`) must stay mapped until then. Touching either range
/// from the host before then races with the copy. Any thread.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_stream_copy(
    stream: GdrStream,
    dst_buffer: GdrBuffer,
    dst_offset: u64,
    src_buffer: GdrBuffer,
    src_offset: u64,
    len: usize,
) -> GdrResult {
    ffi_boundary! {
        if len == 0 || isize::try_from(len).is_err() {
            return Err(FfiError::invalid("len", format!("{len}")));
        }
        let stream = self::stream(stream)?;
        let dst = crate::api::buffer(dst_buffer)?;
        let src = crate::api::buffer(src_buffer)?;
        Ok(stream.stream.copy(&dst.buffer, dst_offset, &src.buffer, src_offset, len)?)
    }
}
