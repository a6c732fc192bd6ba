//! [`Buffer`]: memory of a context (host, pinned, device, an IPC import or
//! the caller's), erased once; registered with an engine as a
//! [`Region`](super::Region).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hal_cuda::{Context as _, MemoryType, Stream as _};

use super::Instance;
use super::{Context, Erased};
use crate::buffer::{Access, Buffer as BufferOfC, BufferAccessError};
use crate::engine::{Error, Unsupported};
use crate::uri::BufferUri;

/// What kind of memory a buffer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Ordinary (pageable) host memory.
    Host,
    /// Page-locked host memory the GPU can reach.
    Pinned,
    /// GPU memory.
    Device,
    /// CUDA managed memory (never registered).
    Managed,
}

/// A context's memory: cheap to clone (a shared handle). The memory is
/// freed when the last handle, region, grant and transfer of it are gone,
/// or by [`release`](Self::release).
#[derive(Clone)]
pub struct Buffer {
    shared: Arc<Shared>,
}

struct Shared {
    context: Context,
    addr: u64,
    len: u64,
    kind: MemoryKind,
    device: Option<u32>,
    access: Access,
    /// `None` once released.
    inner: Mutex<Option<Erased>>,
    /// Copies queued on streams not yet seen done ([`BufferHold`]).
    stream_holds: AtomicUsize,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.shared.addr))
            .field("len", &self.shared.len)
            .field("kind", &self.shared.kind)
            .field("device", &self.shared.device)
            .field("access", &self.shared.access)
            .finish_non_exhaustive()
    }
}

/// A claim on a buffer for a copy queued on a stream: while it lives,
/// [`Buffer::release`] refuses the buffer and its memory stays.
pub(super) struct BufferHold(Buffer);

impl Drop for BufferHold {
    fn drop(&mut self) {
        self.0.shared.stream_holds.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Buffer {
    pub(super) fn new(context: Context, inner: Erased) -> Self {
        let facts = inner.facts();
        Self {
            shared: Arc::new(Shared {
                context,
                addr: facts.addr,
                len: facts.len,
                kind: facts.kind,
                device: facts.device,
                access: facts.access,
                inner: Mutex::new(Some(inner)),
                stream_holds: AtomicUsize::new(0),
            }),
        }
    }

    /// The context it was made in.
    pub fn context(&self) -> &Context {
        &self.shared.context
    }

    /// Its address (a host pointer, or a device address).
    pub fn addr(&self) -> u64 {
        self.shared.addr
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.shared.len
    }

    /// Whether it is empty (never, for a buffer a context made).
    pub fn is_empty(&self) -> bool {
        self.shared.len == 0
    }

    /// What kind of memory it is.
    pub fn kind(&self) -> MemoryKind {
        self.shared.kind
    }

    /// The GPU it lives on (device memory), or whose driver pinned it.
    pub fn device(&self) -> Option<u32> {
        self.shared.device
    }

    /// Whether gdr may write its memory ([`Context::wrap_read_only`]).
    pub fn access(&self) -> Access {
        self.shared.access
    }

    /// Copies `data` into the buffer at `offset`: a CPU copy for host
    /// memory, a synchronized stream copy for device memory. Refused for
    /// read-only memory ([`BufferAccessError::ReadOnly`]).
    pub fn copy_from_host(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.check_writable(offset, data.len())?;
        self.check_range("data", offset, data.len())?;
        self.with(|b| b.copy_in(offset, data))
    }

    /// Refuses a write of `len` bytes at `offset` into read-only memory.
    pub(super) fn check_writable(&self, offset: u64, len: usize) -> Result<(), Error> {
        if self.shared.access.is_writable() {
            return Ok(());
        }
        Err(BufferAccessError::ReadOnly {
            offset,
            len: len as u64,
        }
        .into())
    }

    /// Copies `out.len()` bytes of the buffer at `offset` into `out`.
    pub fn copy_to_host(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        self.check_range("out", offset, out.len())?;
        self.with(|b| b.copy_out(offset, out))
    }

    /// The whole buffer, copied to host memory.
    pub fn to_vec(&self) -> Result<Vec<u8>, Error> {
        let len = usize::try_from(self.len()).map_err(|_| Error::BadSize {
            what: "buffer",
            size: self.len(),
        })?;
        let mut out = vec![0; len];
        self.copy_to_host(0, &mut out)?;
        Ok(out)
    }

    /// Its `gdr://` URI (device memory: a CUDA IPC handle of the whole
    /// allocation; see the trust boundary in the guide).
    pub fn export_uri(&self) -> Result<BufferUri, Error> {
        self.with(|b| b.export_uri())
    }

    /// Frees the memory now, waiting up to its release timeout for
    /// registrations (regions, grants, transfers in flight) to let go.
    /// Refused, with the buffer left as it was, while copies queued on
    /// streams use it ([`Error::StreamCopiesPending`]) or registrations
    /// still cover it ([`Error::StillRegistered`]). Every handle is spent
    /// after ([`Error::Released`]).
    pub fn release(&self) -> Result<(), Error> {
        let taken = {
            let mut guard = self.inner();
            let copies = self.shared.stream_holds.load(Ordering::SeqCst);
            if copies != 0 && guard.is_some() {
                return Err(Error::StreamCopiesPending { copies });
            }
            guard.take().ok_or(Error::Released)?
        };
        let timeout = taken.release_timeout();
        taken.release(timeout).map_err(|kept| {
            *self.inner() = Some(*kept);
            Error::StillRegistered
        })
    }

    /// Runs `f` on the live buffer.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&Erased) -> Result<T, Error>) -> Result<T, Error> {
        let guard = self.inner();
        f(guard.as_ref().ok_or(Error::Released)?)
    }

    /// Holds the buffer for a copy queued on a stream. Counted under the
    /// buffer's lock, as `release` checks the count, so no hold is taken on
    /// a buffer already released.
    pub(super) fn hold(&self) -> Result<BufferHold, Error> {
        let guard = self.inner();
        if guard.is_none() {
            return Err(Error::Released);
        }
        self.shared.stream_holds.fetch_add(1, Ordering::SeqCst);
        Ok(BufferHold(self.clone()))
    }

    /// `len` bytes at `offset` lie in the buffer.
    pub(super) fn check_range(
        &self,
        what: &'static str,
        offset: u64,
        len: usize,
    ) -> Result<(), Error> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(Error::OutOfBounds {
                what,
                offset,
                len: len as u64,
                size: self.len(),
            }),
        }
    }

    /// Whether `self` and `other` are handles of one buffer.
    pub fn same(&self, other: &Buffer) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    fn inner(&self) -> MutexGuard<'_, Option<Erased>> {
        self.shared
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// A buffer's facts, read once.
pub(super) struct Facts {
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) kind: MemoryKind,
    pub(super) device: Option<u32>,
    pub(super) access: Access,
}

/// The buffer of backends `V`, `C`, with the context's GPUs at hand.
pub(crate) struct BufferOf {
    pub(super) instance: Arc<Instance>,
    pub(crate) buffer: BufferOfC,
}

impl BufferOf {
    pub(super) fn facts(&self) -> Facts {
        let kind = match self.buffer.memory_type() {
            MemoryType::PageableHost => MemoryKind::Host,
            MemoryType::PinnedHost => MemoryKind::Pinned,
            MemoryType::Device => MemoryKind::Device,
            MemoryType::Managed => MemoryKind::Managed,
        };
        Facts {
            addr: self.buffer.addr(),
            len: self.buffer.len(),
            kind,
            device: self.buffer.device_ordinal(),
            access: self.buffer.access(),
        }
    }

    pub(super) fn export_uri(&self) -> Result<BufferUri, Error> {
        let buffer = &self.buffer;
        let (Some(device), MemoryType::Device) = (buffer.device_ordinal(), buffer.memory_type())
        else {
            return Err(Unsupported::UriOfHostMemory.into());
        };
        let handle = self.instance.gpu(device)?.ipc_export(buffer.addr())?;
        let uri = BufferUri::V2 {
            device,
            allocation: buffer.allocation_size(),
            offset: buffer.addr() - buffer.allocation_base(),
            size: buffer.len(),
            handle,
        };
        uri.validate()?;
        Ok(uri)
    }

    /// `data` into the buffer at `offset` (in range: checked).
    pub(super) fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        if self.buffer.memory_type() == MemoryType::Device {
            let gpu = self
                .instance
                .gpu(self.buffer.device_ordinal().unwrap_or(0))?;
            let stream = gpu.create_stream()?;
            // SAFETY: `data.len()` bytes at `offset` lie in the device
            // buffer (checked by the caller), `data` is a live slice, and
            // the stream is synchronized before `data` is let go.
            unsafe {
                stream.copy_host_to_device(self.buffer.addr() + offset, data.as_ptr(), data.len())
            }?;
            return Ok(stream.synchronize()?);
        }
        Ok(self.buffer.write_at(offset, data)?)
    }

    /// The buffer at `offset` into `out` (in range: checked).
    pub(super) fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        if self.buffer.memory_type() == MemoryType::Device {
            let gpu = self
                .instance
                .gpu(self.buffer.device_ordinal().unwrap_or(0))?;
            let stream = gpu.create_stream()?;
            // SAFETY: as in copy_in, the other way: `out` is a live,
            // exclusive slice until the stream is synchronized.
            unsafe {
                stream.copy_device_to_host(out.as_mut_ptr(), self.buffer.addr() + offset, out.len())
            }?;
            return Ok(stream.synchronize()?);
        }
        Ok(self.buffer.read_at(offset, out)?)
    }

    pub(super) fn release_timeout(&self) -> Duration {
        self.buffer.release_timeout()
    }

    /// Frees it unless MRs still cover it past `timeout`; handed back then.
    pub(super) fn release(self, timeout: Duration) -> Result<(), Box<Self>> {
        let Self { instance, buffer } = self;
        buffer
            .release(timeout)
            .map_err(|buffer| Box::new(BufferOf { instance, buffer }))
    }
}
