//! [`Stream`]: a CUDA stream of a context's GPU, erased once; copies queued
//! on it hold their buffers until it is seen past them.

use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard, PoisonError};

use hal_cuda::Stream as _;

use super::buffer::BufferHold;
use super::{Buffer, MemoryKind};
use crate::engine::{Error, Unsupported};

/// A stream on one GPU of a context (non-blocking: no implicit
/// synchronization with the legacy default stream). Work is queued in the
/// order calls queue it, from any thread.
pub struct Stream {
    context: u64,
    gpu: u32,
    pub(super) inner: StreamOf,
    /// The buffers of copies queued and not yet seen done. Locked across
    /// queueing a copy and recording its holds, so a synchronize's snapshot
    /// holds exactly the copies queued before it began.
    holds: Mutex<Vec<BufferHold>>,
}

/// The tests queue their own copies on the erased stream under it.
/// Feature `testing`.
#[cfg(feature = "testing")]
impl std::ops::Deref for Stream {
    type Target = hal_cuda::dynamic::DynStream;

    fn deref(&self) -> &Self::Target {
        self.erased()
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("gpu", &self.gpu)
            .field("raw", &self.inner.raw())
            .finish_non_exhaustive()
    }
}

/// One end of a stream copy.
#[derive(Debug, Clone, Copy)]
pub(super) enum CopyEnd {
    Host(*mut u8),
    Device(u64),
}

impl Stream {
    pub(super) fn new(context: u64, gpu: u32, inner: StreamOf) -> Self {
        Self {
            context,
            gpu,
            inner,
            holds: Mutex::new(Vec::new()),
        }
    }

    /// A stream of the erased driver's own, outside any context (for the
    /// tests' GPUs). Feature `testing`.
    #[cfg(feature = "testing")]
    pub fn from_erased(gpu: u32, stream: hal_cuda::dynamic::DynStream) -> Self {
        Self::new(0, gpu, StreamOf(stream))
    }

    /// The erased stream under it.
    pub(crate) fn erased(&self) -> &hal_cuda::dynamic::DynStream {
        &self.inner.0
    }

    /// The GPU it runs on.
    pub fn gpu(&self) -> u32 {
        self.gpu
    }

    /// The native handle (a `CUstream`; the simulation's own pointer on the
    /// sim): pass it to kernels and libraries that take one.
    pub fn raw(&self) -> *mut c_void {
        self.inner.raw()
    }

    /// Waits for the work queued so far; on success lets go of the buffers
    /// of the copies among it.
    pub fn synchronize(&self) -> Result<(), Error> {
        let queued_before = std::mem::take(&mut *self.holds());
        match self.inner.synchronize() {
            Ok(()) => Ok(()),
            Err(error) => {
                // Not seen done: still held.
                self.holds().extend(queued_before);
                Err(error)
            }
        }
    }

    /// Queues a copy of `len` bytes from `src` at `src_offset` to `dst` at
    /// `dst_offset`: host to device, device to host or device to device
    /// (device memory of this stream's GPU; both buffers of this stream's
    /// context; the ranges must not overlap; `dst` not read-only). Both
    /// buffers are held until the stream is seen past the copy
    /// ([`synchronize`](Self::synchronize) succeeding, or the stream
    /// dropped): meanwhile
    /// [`Buffer::release`] refuses them. Touching either range from the
    /// host before then races with the copy.
    pub fn copy(
        &self,
        dst: &Buffer,
        dst_offset: u64,
        src: &Buffer,
        src_offset: u64,
        len: usize,
    ) -> Result<(), Error> {
        if len == 0 || isize::try_from(len).is_err() {
            return Err(Error::BadSize {
                what: "len",
                size: len as u64,
            });
        }
        // Held before their addresses are taken: from here neither buffer
        // can be released.
        dst.check_writable(dst_offset, len)?;
        let holds = [dst.hold()?, src.hold()?];
        let dst_end = self.end(dst, "dst", dst_offset, len)?;
        let src_end = self.end(src, "src", src_offset, len)?;
        if overlap(dst_end, src_end, len) {
            return Err(Error::Overlap);
        }
        let mut held = self.holds();
        // SAFETY: both ranges lie in their buffers (checked), are of the
        // kinds given (the buffers' facts), do not overlap (checked), and
        // stay valid until the stream is seen past the copy: the holds
        // recorded below keep `Buffer::release` from freeing either, and
        // keep the last handle's drop from freeing the memory, until then
        // (wrapped memory: `Context::wrap`'s contract).
        unsafe { self.inner.copy(dst_end, src_end, len) }?;
        held.extend(holds);
        Ok(())
    }

    /// The end of a copy in `buffer`: of this stream's context, in range,
    /// host memory or device memory of this stream's GPU.
    fn end(
        &self,
        buffer: &Buffer,
        what: &'static str,
        offset: u64,
        len: usize,
    ) -> Result<CopyEnd, Error> {
        if buffer.context().id != self.context {
            return Err(Error::Foreign {
                what: "buffer",
                owner: "context (the stream's)",
            });
        }
        buffer.check_range(what, offset, len)?;
        let addr = buffer.addr() + offset;
        match buffer.kind() {
            MemoryKind::Host | MemoryKind::Pinned => Ok(CopyEnd::Host(addr as *mut u8)),
            MemoryKind::Device if buffer.device() == Some(self.gpu) => Ok(CopyEnd::Device(addr)),
            MemoryKind::Device => Err(Error::WrongGpu {
                what,
                memory: buffer.device().unwrap_or(u32::MAX),
                stream: self.gpu,
            }),
            MemoryKind::Managed => Err(Unsupported::ManagedMemory.into()),
        }
    }

    fn holds(&self) -> MutexGuard<'_, Vec<BufferHold>> {
        self.holds.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let holds = std::mem::take(self.holds.get_mut().unwrap_or_else(PoisonError::into_inner));
        if !holds.is_empty()
            && let Err(error) = self.inner.synchronize()
        {
            // The stream's context failed (a sticky error, a lost device):
            // it runs nothing more, so the buffers can go.
            tracing::warn!(%error, "a stream failed before its copies were seen done");
        }
        drop(holds);
    }
}

/// The addresses of two ends overlap (host pointers and device addresses
/// are compared only with their kind).
fn overlap(a: CopyEnd, b: CopyEnd, len: usize) -> bool {
    let (a, b) = match (a, b) {
        (CopyEnd::Host(a), CopyEnd::Host(b)) => (a as u64, b as u64),
        (CopyEnd::Device(a), CopyEnd::Device(b)) => (a, b),
        _ => return false,
    };
    a < b + len as u64 && b < a + len as u64
}

/// The stream of CUDA backend `C`.
pub(super) struct StreamOf(pub(super) hal_cuda::dynamic::DynStream);

impl StreamOf {
    pub(super) fn raw(&self) -> *mut c_void {
        self.0.raw()
    }

    pub(super) fn synchronize(&self) -> Result<(), Error> {
        Ok(self.0.synchronize()?)
    }

    /// Queues a copy of `len` bytes from `src` to `dst`.
    ///
    /// # Safety
    /// Both ranges are memory of their kind, valid until the stream has
    /// passed the copy, and do not overlap.
    pub(super) unsafe fn copy(&self, dst: CopyEnd, src: CopyEnd, len: usize) -> Result<(), Error> {
        let queued = match (dst, src) {
            // SAFETY: the caller's contract: both ranges are memory of
            // their kind, valid until the stream has passed the copy.
            (CopyEnd::Device(dst), CopyEnd::Host(src)) => unsafe {
                self.0.copy_host_to_device(dst, src, len)
            },
            // SAFETY: as above.
            (CopyEnd::Host(dst), CopyEnd::Device(src)) => unsafe {
                self.0.copy_device_to_host(dst, src, len)
            },
            // SAFETY: as above.
            (CopyEnd::Device(dst), CopyEnd::Device(src)) => unsafe {
                self.0.copy_device_to_device(dst, src, len)
            },
            (CopyEnd::Host(_), CopyEnd::Host(_)) => {
                return Err(Unsupported::HostToHostStreamCopy.into());
            }
        };
        Ok(queued?)
    }
}
