//! CUDA streams in the C ABI: a stream gdr makes on one GPU of a context,
//! its native `CUstream` for the caller's own kernels and copies, copies
//! between buffers queued on it, and (in [`crate::engine`]) the
//! stream-ordered fences: a stream that waits for a batch
//! (`gdr_batch_fence_stream`) and a batch that waits for a stream
//! (`gdr_peer_submit_after_stream`).
//!
//! As for buffers and engines, the functions are written once: a context's
//! backend makes the stream (`Backend::stream`) and the stream is erased
//! behind `AnyStream`, implemented once for every CUDA backend.
//!
//! A copy queued on a stream holds both its buffers:
//! `gdr_buffer_free` refuses them with `GDR_RESULT_BUSY` until a
//! [`gdr_stream_synchronize`] that began after the copy was queued
//! returns `GDR_RESULT_OK`, or the stream is freed ([`gdr_stream_free`]
//! waits for its work first). So memory gdr owns is never freed under a
//! copy the GPU may still run.

use std::any::Any;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};

use hal_cuda::Stream as _;

use crate::api::{BufferHold, BufferObject, GdrBuffer, GdrContext};
use crate::boundary::{Out, ffi_boundary};
use crate::handle::{Kind, Table};
use crate::instance::MemoryKind;
use crate::result::{FfiError, GdrResult};

/// A CUDA stream gdr made on one GPU of a context.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrStream {
    /// Opaque; 0 is never a live stream.
    pub id: u64,
}

crate::handle::c_handles!(GdrStream);

/// One end of a stream copy: host memory by its pointer, or device memory
/// by its device address.
#[derive(Debug, Clone, Copy)]
pub(crate) enum CopyEnd {
    Host(*mut u8),
    Device(u64),
}

/// A stream of some CUDA backend ([`StreamOf`] inside).
pub(crate) trait AnyStream: Send + Sync {
    /// The native handle (see `hal_cuda::Stream::raw`).
    fn raw(&self) -> *mut c_void;
    fn synchronize(&self) -> Result<(), FfiError>;
    /// Queues a copy of `len` bytes from `src` to `dst`.
    ///
    /// # Safety
    /// Both ranges must be memory of their kind, valid until the stream
    /// has passed the copy, and not overlap.
    unsafe fn copy(&self, dst: CopyEnd, src: CopyEnd, len: usize) -> Result<(), FfiError>;
    fn as_any(&self) -> &dyn Any;
}

/// The stream of CUDA backend `C`.
pub(crate) struct StreamOf<C: hal_cuda::Api>(pub C::Stream);

impl<C: hal_cuda::Api> StreamOf<C> {
    /// `stream` as a stream of backend `C`, or the error for another's.
    pub(crate) fn of(stream: &dyn AnyStream) -> Result<&C::Stream, FfiError> {
        stream
            .as_any()
            .downcast_ref::<Self>()
            .map(|s| &s.0)
            .ok_or_else(|| {
                FfiError::new(
                    GdrResult::InvalidHandle,
                    "the stream belongs to a context of other backends",
                )
            })
    }
}

impl<C: hal_cuda::Api> AnyStream for StreamOf<C> {
    fn raw(&self) -> *mut c_void {
        self.0.raw()
    }

    fn synchronize(&self) -> Result<(), FfiError> {
        Ok(self.0.synchronize()?)
    }

    unsafe fn copy(&self, dst: CopyEnd, src: CopyEnd, len: usize) -> Result<(), FfiError> {
        let queued = match (dst, src) {
            (CopyEnd::Device(dst), CopyEnd::Host(src)) => {
                // SAFETY: the caller's contract: both ranges are memory of
                // their kind, valid until the stream has passed the copy.
                unsafe { self.0.copy_host_to_device(dst, src, len) }
            }
            (CopyEnd::Host(dst), CopyEnd::Device(src)) => {
                // SAFETY: as above.
                unsafe { self.0.copy_device_to_host(dst, src, len) }
            }
            (CopyEnd::Device(dst), CopyEnd::Device(src)) => {
                // SAFETY: as above.
                unsafe { self.0.copy_device_to_device(dst, src, len) }
            }
            (CopyEnd::Host(_), CopyEnd::Host(_)) => {
                return Err(FfiError::new(
                    GdrResult::NotSupported,
                    "a stream copies to or from GPU memory; host to host is the caller's memcpy",
                ));
            }
        };
        Ok(queued?)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A stream and the buffers its queued copies hold.
pub(crate) struct StreamObject {
    context: u64,
    device: u32,
    pub(crate) stream: Box<dyn AnyStream>,
    /// The buffers of copies queued and not yet seen done. Locked across
    /// queueing a copy and recording its holds, so a synchronize's
    /// snapshot holds exactly copies queued before it began.
    holds: Mutex<Vec<BufferHold>>,
}

impl StreamObject {
    fn holds(&self) -> std::sync::MutexGuard<'_, Vec<BufferHold>> {
        self.holds.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for the work queued so far; on success lets go of the buffers
    /// of the copies that were among it.
    fn synchronize(&self) -> Result<(), FfiError> {
        let queued_before = std::mem::take(&mut *self.holds());
        match self.stream.synchronize() {
            Ok(()) => Ok(()),
            Err(error) => {
                // Not seen done: still held.
                self.holds().extend(queued_before);
                Err(error)
            }
        }
    }
}

impl Drop for StreamObject {
    fn drop(&mut self) {
        let holds = std::mem::take(self.holds.get_mut().unwrap_or_else(PoisonError::into_inner));
        if !holds.is_empty()
            && let Err(error) = self.stream.synchronize()
        {
            // The stream's context failed (a sticky error, a lost device):
            // it runs nothing more, so the buffers can go.
            tracing::warn!(error = %error.message, "a stream failed before its copies were seen done");
        }
        drop(holds);
    }
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
        let stream = owner.backend.stream(device)?;
        let object = StreamObject { context: context.id, device, stream, holds: Mutex::new(Vec::new()) };
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
        object.synchronize()
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
        self::stream(stream)?.synchronize()
    }
}

/// The end of a copy in `buffer` at `offset`, `len` bytes: in the stream's
/// context, in range, host memory or device memory of the stream's GPU.
fn copy_end(
    stream: &StreamObject,
    buffer: &BufferObject,
    name: &str,
    offset: u64,
    len: usize,
) -> Result<CopyEnd, FfiError> {
    if buffer.context != stream.context {
        return Err(FfiError::invalid(
            name,
            "made in another context than the stream's",
        ));
    }
    let facts = buffer.with(|backend, b| backend.facts(b))?;
    let in_range = offset
        .checked_add(len as u64)
        .is_some_and(|end| end <= facts.size);
    if !in_range {
        return Err(FfiError::invalid(
            name,
            format!(
                "{len} bytes at offset {offset} exceed the buffer's {} bytes",
                facts.size
            ),
        ));
    }
    let addr = facts.addr + offset;
    match facts.kind {
        MemoryKind::Host | MemoryKind::Pinned => Ok(CopyEnd::Host(addr as *mut u8)),
        MemoryKind::Device if facts.device == Some(stream.device) => Ok(CopyEnd::Device(addr)),
        MemoryKind::Device => Err(FfiError::invalid(
            name,
            format!(
                "memory of GPU {:?}, the stream is on GPU {}",
                facts.device, stream.device
            ),
        )),
        MemoryKind::Managed => Err(FfiError::new(
            GdrResult::NotSupported,
            format!("{name}: managed memory is not copied on streams by gdr"),
        )),
    }
}

/// The addresses of two ends overlap (same address space: host pointers
/// and device addresses are compared only with their kind).
fn overlap(a: CopyEnd, b: CopyEnd, len: usize) -> bool {
    let (a, b) = match (a, b) {
        (CopyEnd::Host(a), CopyEnd::Host(b)) => (a as u64, b as u64),
        (CopyEnd::Device(a), CopyEnd::Device(b)) => (a, b),
        _ => return false,
    };
    a < b + len as u64 && b < a + len as u64
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
        // Held before their addresses are taken: from here neither buffer
        // can be freed.
        let holds = [dst.hold()?, src.hold()?];
        let dst_end = copy_end(&stream, &dst, "dst_buffer", dst_offset, len)?;
        let src_end = copy_end(&stream, &src, "src_buffer", src_offset, len)?;
        if overlap(dst_end, src_end, len) {
            return Err(FfiError::invalid("src_offset", "the source and destination ranges overlap"));
        }
        let mut held = stream.holds();
        // SAFETY: both ranges lie in their buffers (checked) and are of
        // the kinds given (the buffers' facts), do not overlap (checked),
        // and stay valid until the stream is seen past the copy: the holds
        // recorded below keep gdr_buffer_free from freeing either until
        // then (wrapped memory: the caller's contract, as documented).
        unsafe { stream.stream.copy(dst_end, src_end, len) }?;
        held.extend(holds);
        Ok(())
    }
}
