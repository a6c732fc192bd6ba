//! Buffers: host, pinned-host or GPU memory gdr moves data to and from,
//! allocated through the HALs, wrapped from the caller, or imported through
//! a CUDA IPC handle.
//!
//! Lifetimes are explicit. A [`BufferRegistration`] borrows its buffer, so
//! the compiler refuses to let it outlive the memory. The MR behind it lives
//! on in the registration cache for reuse; when the buffer is dropped it
//! first invalidates every cache entry it was registered under (and forgets
//! its dma-buf export), so the MRs are deregistered, and only then frees the
//! memory or closes the IPC mapping.

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};

use hal_cuda::{
    Context as _, CudaError, DeviceMemory as _, IpcMapping as _, IpcMemHandle, MemoryType,
    PinnedHostMemory as _, PointerAttributes,
};
use hal_verbs::Api;

use crate::ladder::{Ladder, LadderError, LadderRegistration};

/// What a ladder must do when a buffer goes away: drop every cache entry of
/// its range and allocation in that ladder's domain.
pub(crate) trait Forget: Send + Sync {
    fn forget(&self, addr: u64, len: u64, buffer_id: Option<u64>);
}

enum Memory<C: hal_cuda::Api> {
    /// Host memory gdr allocated (pageable).
    Host(#[allow(dead_code)] Box<[u8]>),
    /// Pinned host memory gdr allocated through CUDA.
    Pinned(#[allow(dead_code)] C::PinnedHostMemory),
    /// Device memory gdr allocated.
    Device(#[allow(dead_code)] C::DeviceMemory),
    /// Another process's allocation, mapped from its IPC handle.
    Ipc(#[allow(dead_code)] C::IpcMapping),
    /// The caller's memory.
    Borrowed,
}

/// A range of memory gdr can register and move.
pub struct Buffer<C: hal_cuda::Api> {
    addr: u64,
    len: u64,
    memory_type: MemoryType,
    device_ordinal: Option<u32>,
    buffer_id: u64,
    registered_with: Mutex<Vec<Arc<dyn Forget>>>,
    // Last: freed after the cache entries are forgotten (see Drop).
    memory: Memory<C>,
}

impl<C: hal_cuda::Api> fmt::Debug for Buffer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let origin = match self.memory {
            Memory::Host(_) => "host",
            Memory::Pinned(_) => "pinned",
            Memory::Device(_) => "device",
            Memory::Ipc(_) => "ipc",
            Memory::Borrowed => "borrowed",
        };
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("memory_type", &self.memory_type)
            .field("device_ordinal", &self.device_ordinal)
            .field("buffer_id", &self.buffer_id)
            .field("origin", &origin)
            .finish()
    }
}

impl<C: hal_cuda::Api> Buffer<C> {
    fn new(memory: Memory<C>, addr: u64, len: u64, attrs: Option<PointerAttributes>) -> Self {
        let (memory_type, device_ordinal, buffer_id) = match attrs {
            Some(a) => (a.memory_type, a.device_ordinal, a.buffer_id),
            None => (MemoryType::PageableHost, None, 0),
        };
        Self {
            addr,
            len,
            memory_type,
            device_ordinal,
            buffer_id,
            registered_with: Mutex::new(Vec::new()),
            memory,
        }
    }

    /// `len` zeroed bytes of ordinary host memory.
    pub fn alloc_host(len: usize) -> Self {
        let memory = vec![0u8; len].into_boxed_slice();
        let addr = memory.as_ptr() as u64;
        Self::new(Memory::Host(memory), addr, len as u64, None)
    }

    /// `len` bytes of pinned host memory.
    pub fn alloc_pinned(context: &C::Context, len: usize) -> Result<Self, CudaError> {
        let memory = context.alloc_pinned(len)?;
        let addr = memory.as_ptr() as u64;
        let attrs = context.pointer_attributes(addr)?;
        Ok(Self::new(
            Memory::Pinned(memory),
            addr,
            len as u64,
            Some(attrs),
        ))
    }

    /// `len` bytes of device memory on `context`'s GPU.
    pub fn alloc_device(context: &C::Context, len: usize) -> Result<Self, CudaError> {
        let memory = context.alloc(len)?;
        let addr = memory.device_ptr();
        let attrs = context.pointer_attributes(addr)?;
        Ok(Self::new(
            Memory::Device(memory),
            addr,
            len as u64,
            Some(attrs),
        ))
    }

    /// Maps another process's allocation from its IPC handle. The whole
    /// allocation becomes reachable: only accept handles from peers trusted
    /// with all of it.
    pub fn import_ipc(context: &C::Context, handle: &IpcMemHandle) -> Result<Self, CudaError> {
        let mapping = context.ipc_open(handle)?;
        let (addr, len) = (mapping.device_ptr(), mapping.len() as u64);
        let attrs = context.pointer_attributes(addr)?;
        Ok(Self::new(Memory::Ipc(mapping), addr, len, Some(attrs)))
    }

    /// Wraps `len` bytes at `addr` that the caller owns. The memory type is
    /// read from CUDA's pointer attributes when `context` is given (else it
    /// is taken as pageable host memory); `memory_type` overrides it.
    ///
    /// # Safety
    /// The range must stay mapped, and must not be freed, until the buffer
    /// is dropped.
    pub unsafe fn wrap(
        context: Option<&C::Context>,
        addr: u64,
        len: u64,
        memory_type: Option<MemoryType>,
    ) -> Result<Self, CudaError> {
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(CudaError::invalid(
                "Buffer::wrap",
                format!("{len} bytes at {addr:#x} is not a range"),
            ));
        }
        let attrs = context.map(|c| c.pointer_attributes(addr)).transpose()?;
        let mut buffer = Self::new(Memory::Borrowed, addr, len, attrs);
        if let Some(kind) = memory_type {
            buffer.memory_type = kind;
        }
        Ok(buffer)
    }

    /// First address (a device address for GPU memory).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host, pinned, device or managed.
    pub fn memory_type(&self) -> MemoryType {
        self.memory_type
    }

    /// The owning GPU, for device memory.
    pub fn device_ordinal(&self) -> Option<u32> {
        self.device_ordinal
    }

    /// The CUDA buffer id (0 for memory CUDA does not know).
    pub fn buffer_id(&self) -> u64 {
        self.buffer_id
    }

    /// A host pointer to the bytes, for host and pinned memory only.
    pub fn host_ptr(&self) -> Option<*mut u8> {
        matches!(
            self.memory_type,
            MemoryType::PageableHost | MemoryType::PinnedHost
        )
        .then_some(self.addr as *mut u8)
    }

    /// Registers `len` bytes at `offset` with `ladder`'s NIC, on the first
    /// rung that works. The registration cannot outlive the buffer.
    pub fn register<'b, V: Api>(
        &'b self,
        ladder: &Ladder<V, C>,
        offset: u64,
        len: u64,
    ) -> Result<BufferRegistration<'b, V>, LadderError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) || len == 0 {
            return Err(LadderError::OutsideAllocation {
                addr: self.addr.wrapping_add(offset),
                len,
                base: self.addr,
                size: self.len,
            });
        }
        let inner = ladder.register(self.addr + offset, len)?;
        let forget = ladder.forgetter();
        let mut registered = self
            .registered_with
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !registered.iter().any(|f| Arc::ptr_eq(f, forget)) {
            registered.push(Arc::clone(forget));
        }
        Ok(BufferRegistration {
            inner,
            _buffer: PhantomData,
        })
    }
}

impl<C: hal_cuda::Api> Drop for Buffer<C> {
    fn drop(&mut self) {
        let forgets = std::mem::take(
            self.registered_with
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let buffer_id = (self.buffer_id != 0).then_some(self.buffer_id);
        for forget in forgets {
            forget.forget(self.addr, self.len, buffer_id);
        }
        // `memory` drops after this: cuMemFree, cuMemFreeHost or
        // cuIpcCloseMemHandle run once no MR covers it.
    }
}

/// A range of a [`Buffer`] registered on one NIC, borrowing the buffer.
pub struct BufferRegistration<'b, V: Api> {
    inner: LadderRegistration<V>,
    _buffer: PhantomData<&'b ()>,
}

impl<V: Api> fmt::Debug for BufferRegistration<'_, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl<V: Api> std::ops::Deref for BufferRegistration<'_, V> {
    type Target = LadderRegistration<V>;

    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}
