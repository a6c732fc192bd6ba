//! Buffers: host, pinned-host or GPU memory gdr moves data to and from,
//! allocated through the HALs, wrapped from the caller, or imported through
//! a CUDA IPC handle.
//!
//! A buffer's memory outlives every memory region over it. Each MR (cached
//! registration or grant) holds a `MemoryLease` on the buffer's backing
//! store, so leaking or cloning a handle, or dropping things in any order,
//! never leaves a live MR over freed memory (see the rule in the
//! [`crate::cache`] module docs):
//! - memory gdr allocated (host, pinned, device, an IPC mapping) is freed
//!   by whichever of the buffer and its last lease goes last;
//! - memory the caller owns ([`Buffer::wrap`]) cannot be kept: dropping the
//!   buffer unlinks its cache entries and then **waits** until every MR over
//!   it is deregistered, at most [`Buffer::release_timeout`]; past that the
//!   process is aborted, since returning would let the caller free memory a
//!   NIC can still write. [`Buffer::release`] is the non-aborting form: it
//!   hands the buffer back when the MRs are still alive.
//!
//! A [`BufferRegistration`] also borrows its buffer, so ordinary code cannot
//! even hold one past the buffer's drop.

use std::alloc::Layout;
use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use hal_cuda::{
    AllocationKind, Context as _, CudaError, DeviceMemory as _, IpcMapping as _, IpcMemHandle,
    MemoryType, PhysicalMemory as _, PinnedHostMemory as _, PointerAttributes,
    VirtualReservation as _,
};

use crate::cache::OwnerId;
use crate::ladder::{GrantRights, Ladder, LadderError, LadderRegistration, MrGrant, range_within};
use crate::lifetime::{LeaseCount, Leased};

/// What a ladder must do when a buffer goes away: unlink every cache entry
/// the buffer owns.
pub(crate) trait Forget: Send + Sync {
    fn forget(&self, owner: OwnerId);
}

/// Every buffer's owner id in the cache: entries of one buffer never serve
/// another.
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// How long dropping a buffer over the caller's memory waits for the MRs
/// over it to be deregistered.
pub const DEFAULT_RELEASE_TIMEOUT: Duration = Duration::from_secs(30);

/// What gdr may do to a buffer's memory. Every buffer gdr allocates is
/// [`Access::ReadWrite`]; memory the caller wraps is what the caller says
/// ([`Context::wrap_read_only`](crate::Context::wrap_read_only)). Read-only memory (an immutable Python
/// `bytes`, a read-only mapping or array) is registered with no local or
/// remote write access, is never granted with write rights, never READ
/// into and never written by the CPU through gdr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Access {
    /// Read only: nothing gdr does writes it.
    ReadOnly,
    /// Read and write.
    #[default]
    ReadWrite,
}

impl Access {
    /// Whether the memory may be written.
    pub fn is_writable(self) -> bool {
        self == Self::ReadWrite
    }
}

/// Why the CPU could not read or write a buffer's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BufferAccessError {
    /// The memory is not host memory the CPU may touch through its address
    /// (device memory, an IPC mapping, managed memory).
    #[error("{memory_type:?} memory is not accessible by the CPU")]
    NotCpuAccessible {
        /// The buffer's memory type.
        memory_type: MemoryType,
    },
    /// The range is not inside the buffer.
    #[error("{len} bytes at offset {offset} are not inside the buffer's {buffer_len} bytes")]
    OutOfRange {
        /// Offset asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// The buffer's length.
        buffer_len: u64,
    },
    /// The buffer is read-only memory ([`Access::ReadOnly`]).
    #[error("the buffer is read-only memory: {len} bytes at offset {offset} not written")]
    ReadOnly {
        /// Offset asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
    },
}

/// Page-aligned, zeroed host memory (a raw allocation, so the pointer
/// handed to the NIC carries the allocation's own provenance): from the
/// global allocator below [`MAPPED_FROM`] bytes, else an anonymous mapping
/// (zero pages the kernel fills in as they are touched, where the
/// allocator would write every page).
struct HostAllocation {
    ptr: NonNull<u8>,
    from: HostSource,
}

/// Where a [`HostAllocation`] came from, and what frees it.
enum HostSource {
    Allocator(Layout),
    Mapping { len: usize },
}

/// Sizes from which host memory is mapped rather than allocated.
const MAPPED_FROM: usize = 1 << 20;

// SAFETY: the allocation is plain bytes owned by this value; sharing the
// pointer across threads is what every user of the buffer does through the
// NIC, and Rust code reaches the bytes only through raw pointers.
unsafe impl Send for HostAllocation {}
// SAFETY: as above; `&HostAllocation` exposes only the pointer.
unsafe impl Sync for HostAllocation {}

impl HostAllocation {
    /// `len` zeroed bytes, or the refusal as an error (never the global
    /// allocator's failure handler, which aborts the process). More than
    /// the machine's memory and swap together is refused before anything
    /// is asked: where the kernel overcommits it would map it, and kill the
    /// process once the pages are touched.
    fn zeroed(len: u64) -> Result<Self, HostAllocError> {
        // Page alignment: an MR covers whole pages anyway, and two buffers
        // then never share a page.
        let layout = usize::try_from(len.max(1))
            .ok()
            .and_then(|size| Layout::from_size_align(size, 4096).ok())
            .ok_or(HostAllocError::TooLarge { len })?;
        if len > backable_memory() {
            return Err(HostAllocError::OutOfMemory { len });
        }
        if layout.size() < MAPPED_FROM {
            // SAFETY: the layout has a non-zero size.
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
            let ptr = NonNull::new(ptr).ok_or(HostAllocError::OutOfMemory { len })?;
            return Ok(Self {
                ptr,
                from: HostSource::Allocator(layout),
            });
        }
        // SAFETY: an anonymous private mapping at an address the kernel
        // picks: no file, no memory of ours passed or overlapped.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                layout.size(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(HostAllocError::OutOfMemory { len });
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(HostAllocError::OutOfMemory { len })?;
        Ok(Self {
            ptr,
            from: HostSource::Mapping { len: layout.size() },
        })
    }
}

/// The machine's memory and swap together: the most host memory that can
/// ever be backed at once (`u64::MAX` where the kernel does not say).
fn backable_memory() -> u64 {
    let mut info = std::mem::MaybeUninit::<libc::sysinfo>::zeroed();
    // SAFETY: sysinfo fills the struct it is given, which is ours and of
    // its type; nothing else is read or written.
    if unsafe { libc::sysinfo(info.as_mut_ptr()) } != 0 {
        return u64::MAX;
    }
    // SAFETY: sysinfo returned 0: it filled the struct (and it was zeroed
    // before, so every field is initialized either way).
    let info = unsafe { info.assume_init() };
    let unit = u64::from(info.mem_unit.max(1));
    // `c_ulong`: 64 bits here (the only targets gdr builds for).
    let (ram, swap): (u64, u64) = (info.totalram, info.totalswap);
    ram.saturating_add(swap).saturating_mul(unit)
}

/// Why host memory could not be allocated ([`Buffer::try_alloc_host`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostAllocError {
    /// More than the address space can hold (over `isize::MAX` bytes).
    #[error("{len} bytes is not an allocatable size")]
    TooLarge {
        /// The size asked for.
        len: u64,
    },
    /// The allocator refused it (out of memory, or past what the process
    /// may map).
    #[error("{len} bytes of host memory could not be allocated (out of memory)")]
    OutOfMemory {
        /// The size asked for.
        len: u64,
    },
}

impl Drop for HostAllocation {
    fn drop(&mut self) {
        match self.from {
            // SAFETY: allocated in `zeroed` with this layout, freed once.
            HostSource::Allocator(layout) => unsafe {
                std::alloc::dealloc(self.ptr.as_ptr(), layout)
            },
            HostSource::Mapping { len } => {
                // SAFETY: mapped in `zeroed` with this length, unmapped
                // once; nothing of gdr's reaches it after the buffer goes.
                let unmapped = unsafe { libc::munmap(self.ptr.as_ptr().cast(), len) };
                if unmapped != 0 {
                    tracing::warn!(
                        error = %std::io::Error::last_os_error(),
                        len,
                        "munmap of a host buffer"
                    );
                }
            }
        }
    }
}

/// One physical chunk of CUDA VMM memory behind a buffer: each mapped
/// chunk is an allocation of its own for CUDA (its own buffer id), so a
/// range over several is registered chunk by chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// First device address of the chunk (`cuMemGetAddressRange`).
    pub base: u64,
    /// Its size.
    pub len: u64,
    /// Its CUDA buffer id (a chunk mapped again gets a new one).
    pub buffer_id: u64,
    /// Whether it was created `gpuDirectRDMACapable`
    /// (`CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`); one that was
    /// not is staged.
    pub gpu_direct_rdma_capable: bool,
}

impl Chunk {
    fn end(&self) -> u64 {
        self.base + self.len
    }
}

/// CUDA VMM memory gdr made: a reservation with physical chunks mapped
/// into it. Field order is drop order: unmapped, then released, then the
/// range freed (each mapping also keeps both alive).
struct VmmMemory {
    _mappings: Vec<hal_cuda::dynamic::DynVirtualMapping>,
    _physical: Vec<hal_cuda::dynamic::DynPhysicalMemory>,
    _reservation: hal_cuda::dynamic::DynVirtualReservation,
}

/// The chunks of CUDA VMM memory covering `addr..end`, as the driver sees
/// them now (pointer attributes and `cuMemGetAddressRange` at the start and
/// at each chunk's end). An address inside the range with nothing mapped
/// (a gap), or memory of another kind or GPU, is an error.
fn walk_chunks(
    context: &hal_cuda::dynamic::DynContext,
    operation: &'static str,
    addr: u64,
    end: u64,
) -> Result<Vec<Chunk>, CudaError> {
    let mut chunks = Vec::new();
    let mut at = addr;
    let mut ordinal = None;
    while at < end {
        let gap = |why: String| {
            CudaError::invalid(
                operation,
                format!(
                    "{} bytes at {addr:#x} are not all mapped CUDA VMM memory: {at:#x} {why}",
                    end - addr
                ),
            )
        };
        let attrs = context
            .pointer_attributes(at)
            .map_err(|e| gap(format!("is not mapped ({e})")))?;
        if attrs.memory_type != MemoryType::Device || attrs.buffer_id == 0 {
            return Err(gap(format!("is {:?} memory", attrs.memory_type)));
        }
        if *ordinal.get_or_insert(attrs.device_ordinal) != attrs.device_ordinal {
            return Err(gap(format!("belongs to GPU {:?}", attrs.device_ordinal)));
        }
        let (base, len) = context
            .address_range(at)
            .map_err(|e| gap(format!("has no address range ({e})")))?;
        if len == 0 || base > at || base.saturating_add(len) <= at {
            return Err(gap(format!(
                "lies outside the range {base:#x}+{len:#x} the driver gives for it"
            )));
        }
        let chunk = Chunk {
            base,
            len,
            buffer_id: attrs.buffer_id,
            gpu_direct_rdma_capable: attrs.gpu_direct_rdma_capable,
        };
        at = chunk.end();
        chunks.push(chunk);
    }
    Ok(chunks)
}

enum Memory {
    /// Host memory gdr allocated (pageable).
    Host(HostAllocation),
    /// Pinned host memory gdr allocated through CUDA.
    Pinned(hal_cuda::dynamic::DynPinnedHostMemory),
    /// Device memory gdr allocated.
    Device(#[allow(dead_code)] hal_cuda::dynamic::DynDeviceMemory),
    /// Another process's allocation, mapped from its IPC handle.
    Ipc(#[allow(dead_code)] hal_cuda::dynamic::DynIpcMapping),
    /// CUDA VMM memory gdr reserved, created and mapped.
    Vmm(#[allow(dead_code)] VmmMemory),
    /// The caller's memory.
    Borrowed,
}

/// A buffer's memory and the count of MRs over it.
struct Backing {
    leases: LeaseCount,
    memory: Memory,
}

/// gdr's CUDA memory whose last holder goes inside the engine is freed on
/// the reaper thread ([`crate::reaper`]): a free there could wait for a
/// stream only the engine's progress releases.
impl Drop for Backing {
    fn drop(&mut self) {
        if matches!(self.memory, Memory::Host(_) | Memory::Borrowed)
            || !crate::reaper::inside_engine()
        {
            return;
        }
        let memory = std::mem::replace(&mut self.memory, Memory::Borrowed);
        crate::reaper::free_later(Box::new(memory));
    }
}

impl Leased for Backing {
    fn leases(&self) -> &LeaseCount {
        &self.leases
    }
}

/// What a ladder needs to know of a buffer to register part of it: where it
/// is, what it is, the allocation it lies in, who owns the cache entries,
/// and the memory a registration must keep alive.
pub(crate) struct Target<'a> {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) memory_type: MemoryType,
    pub(crate) device_ordinal: Option<u32>,
    pub(crate) buffer_id: u64,
    pub(crate) allocation_base: u64,
    pub(crate) allocation_size: u64,
    /// False for a CUDA VMM chunk created without `gpuDirectRDMACapable`:
    /// no GPUDirect rung is tried.
    pub(crate) gpu_direct_rdma_capable: bool,
    /// Read-only memory gets MRs without write access.
    pub(crate) access: Access,
    pub(crate) owner: OwnerId,
    pub(crate) memory: &'a Arc<dyn Leased>,
}

/// A range of memory gdr can register and move.
pub struct Buffer {
    addr: u64,
    len: u64,
    memory_type: MemoryType,
    device_ordinal: Option<u32>,
    buffer_id: u64,
    allocation_base: u64,
    allocation_size: u64,
    /// The physical chunks of CUDA VMM memory, as found when the buffer
    /// was made (empty for other memory).
    chunks: Vec<Chunk>,
    access: Access,
    owner: OwnerId,
    release_timeout: Duration,
    registered_with: Mutex<Vec<Arc<dyn Forget>>>,
    /// Serializes [`Buffer::read_at`] and [`Buffer::write_at`]: two CPU
    /// copies of one range never race each other.
    cpu_access: Mutex<()>,
    /// The memory, shared with every lease (type-erased for the leases).
    leased: Arc<dyn Leased>,
    backing: Arc<Backing>,
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let origin = match self.backing.memory {
            Memory::Host(_) => "host",
            Memory::Pinned(_) => "pinned",
            Memory::Device(_) => "device",
            Memory::Ipc(_) => "ipc",
            Memory::Vmm(_) => "vmm",
            Memory::Borrowed => "borrowed",
        };
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("memory_type", &self.memory_type)
            .field("device_ordinal", &self.device_ordinal)
            .field("buffer_id", &self.buffer_id)
            .field("chunks", &self.chunks.len())
            .field("access", &self.access)
            .field("owner", &self.owner)
            .field("origin", &origin)
            .field("leases", &self.backing.leases.live())
            .finish()
    }
}

impl Buffer {
    fn new(memory: Memory, addr: u64, len: u64, attrs: Option<PointerAttributes>) -> Self {
        let (memory_type, device_ordinal, buffer_id, allocation_base, allocation_size) = match attrs
        {
            Some(a) if a.buffer_id != 0 => (
                a.memory_type,
                a.device_ordinal,
                a.buffer_id,
                a.allocation_base,
                a.allocation_size,
            ),
            // Memory CUDA does not know: the buffer is its own allocation.
            Some(a) => (a.memory_type, a.device_ordinal, 0, addr, len),
            None => (MemoryType::PageableHost, None, 0, addr, len),
        };
        let backing = Arc::new(Backing {
            leases: LeaseCount::new(),
            memory,
        });
        let leased: Arc<dyn Leased> = backing.clone();
        Self {
            addr,
            len,
            memory_type,
            device_ordinal,
            buffer_id,
            allocation_base,
            allocation_size,
            chunks: Vec::new(),
            access: Access::ReadWrite,
            owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
            release_timeout: DEFAULT_RELEASE_TIMEOUT,
            registered_with: Mutex::new(Vec::new()),
            cpu_access: Mutex::new(()),
            leased,
            backing,
        }
    }

    /// `len` zeroed bytes of ordinary host memory, page-aligned.
    ///
    /// # Panics
    /// When `len` is not an allocatable size (more than `isize::MAX`
    /// bytes); aborts when the allocator is out of memory. For a size a
    /// caller chose, use [`Buffer::try_alloc_host`].
    pub fn alloc_host(len: u64) -> Self {
        match Self::try_alloc_host(len) {
            Ok(buffer) => buffer,
            Err(e @ HostAllocError::TooLarge { .. }) => panic!("{e}"),
            Err(HostAllocError::OutOfMemory { .. }) => std::alloc::handle_alloc_error(
                Layout::from_size_align(len as usize, 4096).unwrap_or(Layout::new::<u8>()),
            ),
        }
    }

    /// `len` zeroed bytes of ordinary host memory, page-aligned; an error,
    /// the process alive, when the size does not fit the address space or
    /// the allocator refuses it.
    pub fn try_alloc_host(len: u64) -> Result<Self, HostAllocError> {
        let memory = HostAllocation::zeroed(len)?;
        let addr = memory.ptr.as_ptr() as u64;
        Ok(Self::new(Memory::Host(memory), addr, len, None))
    }

    /// `len` bytes of pinned host memory.
    pub fn alloc_pinned(
        context: &hal_cuda::dynamic::DynContext,
        len: u64,
    ) -> Result<Self, CudaError> {
        let memory = context.alloc_pinned(alloc_size("Buffer::alloc_pinned", len)?)?;
        let addr = memory.as_ptr() as u64;
        let attrs = context.pointer_attributes(addr)?;
        Ok(Self::new(Memory::Pinned(memory), addr, len, Some(attrs)))
    }

    /// `len` bytes of device memory on `context`'s GPU.
    pub fn alloc_device(
        context: &hal_cuda::dynamic::DynContext,
        len: u64,
    ) -> Result<Self, CudaError> {
        let memory = context.alloc(alloc_size("Buffer::alloc_device", len)?)?;
        let addr = memory.device_ptr();
        let attrs = context.pointer_attributes(addr)?;
        Ok(Self::new(Memory::Device(memory), addr, len, Some(attrs)))
    }

    /// Maps another process's allocation from its IPC handle. The whole
    /// allocation becomes reachable: only accept handles from peers trusted
    /// with all of it.
    pub fn import_ipc(
        context: &hal_cuda::dynamic::DynContext,
        handle: &IpcMemHandle,
    ) -> Result<Self, CudaError> {
        let mapping = context.ipc_open(handle)?;
        let (addr, len) = (mapping.device_ptr(), mapping.len() as u64);
        let attrs = context.pointer_attributes(addr)?;
        Ok(Self::new(Memory::Ipc(mapping), addr, len, Some(attrs)))
    }

    /// Maps another process's allocation from its IPC handle, as
    /// [`Buffer::import_ipc`], and makes the buffer the `len` bytes at
    /// `offset` of it (what a `gdr://` URI names: the handle always opens
    /// the whole allocation). `allocation`, where known, is the size the
    /// exporter stated: a mapping of another size means the handle names
    /// another allocation than the one described, and is refused.
    pub fn import_ipc_range(
        context: &hal_cuda::dynamic::DynContext,
        handle: &IpcMemHandle,
        allocation: Option<u64>,
        offset: u64,
        len: u64,
    ) -> Result<Self, CudaError> {
        let mapping = context.ipc_open(handle)?;
        let (base, mapped) = (mapping.device_ptr(), mapping.len() as u64);
        let invalid = |why: String| CudaError::invalid("Buffer::import_ipc_range", why);
        if let Some(stated) = allocation.filter(|&stated| stated != mapped) {
            return Err(invalid(format!(
                "the handle opens an allocation of {mapped} bytes, not the {stated} stated"
            )));
        }
        let addr = range_within(base, mapped, offset, len).map_err(|_| {
            invalid(format!(
                "{len} bytes at offset {offset} do not lie in the {mapped}-byte allocation"
            ))
        })?;
        let attrs = context.pointer_attributes(addr)?;
        Ok(Self::new(Memory::Ipc(mapping), addr, len, Some(attrs)))
    }

    /// `len` bytes of CUDA VMM memory on `context`'s GPU, as PyTorch's
    /// expandable segments and vLLM make it: a reserved range with physical
    /// chunks of `chunk_len` bytes (a multiple of the VMM granularity)
    /// mapped into it, each its own allocation for CUDA. The buffer owns
    /// them all, freed like other memory gdr allocated.
    pub fn alloc_vmm(
        context: &hal_cuda::dynamic::DynContext,
        len: u64,
        chunk_len: u64,
    ) -> Result<Self, CudaError> {
        const OP: &str = "Buffer::alloc_vmm";
        let granularity = context.vmm_granularity()? as u64;
        if len == 0 || chunk_len == 0 || !chunk_len.is_multiple_of(granularity) {
            return Err(CudaError::invalid(
                OP,
                format!(
                    "{len} bytes in chunks of {chunk_len}: the chunk must be a positive \
                     multiple of the granularity ({granularity}), and the length positive"
                ),
            ));
        }
        let chunks = len.div_ceil(chunk_len);
        let reserved = chunks
            .checked_mul(chunk_len)
            .ok_or_else(|| CudaError::invalid(OP, format!("{len} bytes is too long")))?;
        let reservation = context.reserve_address_range(alloc_size(OP, reserved)?)?;
        let chunk = alloc_size(OP, chunk_len)?;
        let mut physical = Vec::with_capacity(chunks as usize);
        let mut mappings = Vec::with_capacity(chunks as usize);
        for i in 0..chunks as usize {
            let memory = context.create_physical(chunk)?;
            mappings.push(context.map(&reservation, i * chunk, &memory)?);
            physical.push(memory);
        }
        let addr = reservation.base();
        let attrs = context.pointer_attributes(addr)?;
        let found = walk_chunks(context, OP, addr, addr + len)?;
        debug_assert!(
            physical
                .iter()
                .zip(&found)
                .all(|(p, c)| p.len() as u64 == c.len),
            "one chunk per physical allocation"
        );
        let memory = Memory::Vmm(VmmMemory {
            _mappings: mappings,
            _physical: physical,
            _reservation: reservation,
        });
        let mut buffer = Self::new(memory, addr, len, Some(attrs));
        buffer.chunks = found;
        Ok(buffer)
    }

    /// Wraps `len` bytes at `addr` that the caller owns. The memory type is
    /// read from CUDA's pointer attributes when `context` is given (else it
    /// is taken as pageable host memory); `memory_type` overrides it. Memory
    /// CUDA knows must lie inside one allocation.
    ///
    /// Dropping the buffer waits until no MR covers the memory any more
    /// (see the [module docs](self)).
    ///
    /// # Safety
    /// The range must stay mapped, and must not be freed, until the buffer
    /// is dropped (or [`Buffer::release`] returns `Ok`).
    pub unsafe fn wrap(
        context: Option<&hal_cuda::dynamic::DynContext>,
        addr: u64,
        len: u64,
        memory_type: Option<MemoryType>,
    ) -> Result<Self, CudaError> {
        // SAFETY: the caller's contract is this function's.
        unsafe { Self::wrap_as(Access::ReadWrite, context, addr, len, memory_type) }
    }

    /// Wraps `len` bytes at `addr` that the caller owns and that nothing
    /// may write through gdr, as [`Buffer::wrap`] does: the buffer is
    /// [`Access::ReadOnly`]. Its registrations have no local or remote
    /// write access, so a grant of it with write rights is refused
    /// ([`LadderError::ReadOnly`]), and so are a CPU write into it
    /// ([`BufferAccessError::ReadOnly`]) and an engine READ into it.
    ///
    /// # Safety
    /// As for [`Buffer::wrap`].
    pub unsafe fn wrap_read_only(
        context: Option<&hal_cuda::dynamic::DynContext>,
        addr: u64,
        len: u64,
        memory_type: Option<MemoryType>,
    ) -> Result<Self, CudaError> {
        // SAFETY: the caller's contract is this function's.
        unsafe { Self::wrap_as(Access::ReadOnly, context, addr, len, memory_type) }
    }

    /// [`Buffer::wrap`] with the memory's access.
    ///
    /// # Safety
    /// As for [`Buffer::wrap`].
    pub(crate) unsafe fn wrap_as(
        access: Access,
        context: Option<&hal_cuda::dynamic::DynContext>,
        addr: u64,
        len: u64,
        memory_type: Option<MemoryType>,
    ) -> Result<Self, CudaError> {
        let invalid = |why: String| CudaError::invalid("Buffer::wrap", why);
        let Some(end) = addr.checked_add(len).filter(|_| len != 0) else {
            return Err(invalid(format!("{len} bytes at {addr:#x} is not a range")));
        };
        let attrs = context.map(|c| c.pointer_attributes(addr)).transpose()?;
        let vmm = attrs
            .as_ref()
            .filter(|a| a.allocation_kind == AllocationKind::VirtualMemoryManagement);
        if let (Some(context), Some(a)) = (context, vmm) {
            // Each mapped chunk is an allocation of its own: the range may
            // cover several (but no gap).
            let chunks = walk_chunks(context, "Buffer::wrap", addr, end)?;
            let mut buffer = Self::new(Memory::Borrowed, addr, len, Some(*a));
            buffer.chunks = chunks;
            buffer.access = access;
            if let Some(kind) = memory_type {
                buffer.memory_type = kind;
            }
            return Ok(buffer);
        }
        if let Some(a) = attrs.as_ref().filter(|a| a.buffer_id != 0) {
            let alloc_end = a.allocation_base.saturating_add(a.allocation_size);
            if addr < a.allocation_base || end > alloc_end {
                return Err(invalid(format!(
                    "{len} bytes at {addr:#x} run outside the CUDA allocation \
                     {:#x}..{alloc_end:#x} holding their start",
                    a.allocation_base
                )));
            }
        }
        let mut buffer = Self::new(Memory::Borrowed, addr, len, attrs);
        buffer.access = access;
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

    /// The CUDA buffer id (0 for memory CUDA does not know; for CUDA VMM
    /// memory, the first chunk's).
    pub fn buffer_id(&self) -> u64 {
        self.buffer_id
    }

    /// First address of the CUDA allocation holding the buffer (the
    /// buffer's own address for memory CUDA does not know).
    pub fn allocation_base(&self) -> u64 {
        self.allocation_base
    }

    /// Size of that allocation.
    pub fn allocation_size(&self) -> u64 {
        self.allocation_size
    }

    /// The physical chunks of CUDA VMM memory covering the buffer, in
    /// address order, as found when it was made (the first may start
    /// before the buffer, the last end after it); empty for other memory.
    /// Registration reads them again for memory the caller owns, so a
    /// chunk remapped since is registered anew.
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    /// Whether gdr may write the memory ([`Buffer::wrap_read_only`]).
    pub fn access(&self) -> Access {
        self.access
    }

    /// The id its cache entries are owned by.
    pub fn owner(&self) -> OwnerId {
        self.owner
    }

    /// Memory regions (cached registrations, grants) alive over the buffer.
    pub fn live_regions(&self) -> usize {
        self.backing.leases.live()
    }

    /// How long dropping a buffer over the caller's memory waits for its
    /// MRs to be deregistered before aborting.
    pub fn release_timeout(&self) -> Duration {
        self.release_timeout
    }

    /// Sets [`Buffer::release_timeout`].
    pub fn set_release_timeout(&mut self, timeout: Duration) {
        self.release_timeout = timeout;
    }

    /// A host pointer to the bytes, for host and pinned memory only.
    pub fn host_ptr(&self) -> Option<*mut u8> {
        match &self.backing.memory {
            Memory::Host(host) => Some(host.ptr.as_ptr()),
            Memory::Pinned(pinned) => Some(pinned.as_ptr()),
            Memory::Borrowed
                if matches!(
                    self.memory_type,
                    MemoryType::PageableHost | MemoryType::PinnedHost
                ) =>
            {
                Some(std::ptr::with_exposed_provenance_mut(self.addr as usize))
            }
            _ => None,
        }
    }

    /// The host pointer to `len` bytes at `offset`, when the CPU may copy
    /// them.
    fn cpu_range(&self, offset: u64, len: usize) -> Result<*mut u8, BufferAccessError> {
        let base = self.host_ptr().ok_or(BufferAccessError::NotCpuAccessible {
            memory_type: self.memory_type,
        })?;
        let len64 = len as u64;
        if offset.checked_add(len64).is_none_or(|end| end > self.len) {
            return Err(BufferAccessError::OutOfRange {
                offset,
                len: len64,
                buffer_len: self.len,
            });
        }
        // In range of the buffer, whose length fits the address space.
        Ok(base.wrapping_add(offset as usize))
    }

    /// Copies `out.len()` bytes at `offset` of the buffer into `out`. Host
    /// and pinned memory only; no reference to the buffer's bytes is made,
    /// so a NIC writing them meanwhile only makes the copy torn (order
    /// such reads after the transfer's completion).
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), BufferAccessError> {
        let src = self.cpu_range(offset, out.len())?;
        let _serial = self
            .cpu_access
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `src` points at `out.len()` bytes inside the buffer's host
        // memory (checked above), mapped while `self` lives; `out` is a
        // distinct caller-owned slice, so the ranges do not overlap. Other
        // CPU copies through this buffer are serialized by `cpu_access`;
        // only raw pointers reach the buffer's bytes.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` into the buffer at `offset`. Host and pinned memory
    /// only; the caller orders it against transfers that read or write the
    /// range. Refused for read-only memory ([`BufferAccessError::ReadOnly`]).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BufferAccessError> {
        if !self.access.is_writable() {
            return Err(BufferAccessError::ReadOnly {
                offset,
                len: data.len() as u64,
            });
        }
        let dst = self.cpu_range(offset, data.len())?;
        let _serial = self
            .cpu_access
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `dst` points at `data.len()` writable bytes inside the
        // buffer's host memory (checked above; gdr never hands out shared
        // references to it), mapped while `self` lives; `data` is a
        // distinct slice. CPU copies are serialized by `cpu_access`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// A copy of the whole buffer, for host and pinned memory.
    pub fn to_vec(&self) -> Result<Vec<u8>, BufferAccessError> {
        let len = usize::try_from(self.len).map_err(|_| BufferAccessError::OutOfRange {
            offset: 0,
            len: self.len,
            buffer_len: self.len,
        })?;
        // Checked before allocating the copy.
        self.cpu_range(0, len)?;
        let mut out = vec![0u8; len];
        self.read_at(0, &mut out)?;
        Ok(out)
    }

    fn target(&self) -> Target<'_> {
        Target {
            addr: self.addr,
            len: self.len,
            memory_type: self.memory_type,
            device_ordinal: self.device_ordinal,
            buffer_id: self.buffer_id,
            allocation_base: self.allocation_base,
            allocation_size: self.allocation_size,
            gpu_direct_rdma_capable: true,
            access: self.access,
            owner: self.owner,
            memory: &self.leased,
        }
    }

    /// The target of the buffer's part in `chunk`: the chunk is the
    /// allocation, and the cache never registers past the buffer or the
    /// chunk.
    fn chunk_target(&self, chunk: &Chunk) -> Target<'_> {
        let start = self.addr.max(chunk.base);
        let end = (self.addr + self.len).min(chunk.end());
        Target {
            addr: start,
            len: end.saturating_sub(start),
            buffer_id: chunk.buffer_id,
            allocation_base: chunk.base,
            allocation_size: chunk.len,
            gpu_direct_rdma_capable: chunk.gpu_direct_rdma_capable,
            ..self.target()
        }
    }

    /// The chunks covering `addr..addr + len` of the buffer: read again from
    /// the driver for memory the caller owns (a chunk unmapped and mapped
    /// again has a new buffer id, so its old registrations are stale, never
    /// reused), the ones found at allocation for gdr's own.
    fn chunks_now(&self, ladder: &Ladder, addr: u64, len: u64) -> Result<Vec<Chunk>, LadderError> {
        let end = addr + len;
        if !self.borrowed() {
            return Ok(self
                .chunks
                .iter()
                .filter(|c| c.base < end && addr < c.end())
                .copied()
                .collect());
        }
        let ordinal = self.device_ordinal.unwrap_or(0);
        let gpu = ladder
            .gpu(ordinal)
            .ok_or(LadderError::UnknownGpu { ordinal })?;
        walk_chunks(&gpu.context, "register", addr, end)
            .map_err(|source| LadderError::Attributes { addr, source })
    }

    /// Registers `len` bytes at `offset` with `ladder`'s NIC, on the first
    /// rung that works, for local use (the local side of transfers). The
    /// registration cannot outlive the buffer. To let a peer reach the
    /// memory, [`Ladder::grant`] a range of it.
    pub fn register<'b>(
        &'b self,
        ladder: &Ladder,
        offset: u64,
        len: u64,
    ) -> Result<BufferRegistration<'b>, LadderError> {
        Ok(BufferRegistration {
            inner: self.register_owned(ladder, offset, len)?,
            _buffer: PhantomData,
        })
    }

    /// [`Buffer::register`] without the borrow: the registration leases
    /// the memory itself, so the engine's regions may outlive the buffer
    /// value (the lifetime rule keeps the memory while they live).
    pub(crate) fn register_owned(
        &self,
        ladder: &Ladder,
        offset: u64,
        len: u64,
    ) -> Result<LadderRegistration, LadderError> {
        let mut pieces = self.register_pieces(ladder, offset, len)?;
        if pieces.len() != 1 {
            return Err(LadderError::SpansChunks {
                addr: self.addr + offset,
                len,
                chunks: pieces.len(),
            });
        }
        Ok(pieces.remove(0).registration)
    }

    /// Registers `len` bytes at `offset` as [`Buffer::register_owned`]
    /// does, one registration per physical chunk of CUDA VMM memory the
    /// range covers (one for other memory), in address order. A chunk no
    /// GPUDirect rung takes is on the staging rung, like any GPU memory.
    pub(crate) fn register_pieces(
        &self,
        ladder: &Ladder,
        offset: u64,
        len: u64,
    ) -> Result<Vec<Piece>, LadderError> {
        let addr = range_within(self.addr, self.len, offset, len)?;
        let pieces = if self.chunks.is_empty() {
            vec![Piece {
                offset: 0,
                registration: ladder.register_target(&self.target(), addr, len)?,
            }]
        } else {
            let end = addr + len;
            self.chunks_now(ladder, addr, len)?
                .iter()
                .map(|chunk| {
                    let start = addr.max(chunk.base);
                    let registration = ladder.register_target(
                        &self.chunk_target(chunk),
                        start,
                        end.min(chunk.end()) - start,
                    )?;
                    Ok(Piece {
                        offset: start - addr,
                        registration,
                    })
                })
                .collect::<Result<Vec<_>, LadderError>>()?
        };
        self.remember(ladder);
        Ok(pieces)
    }

    /// Notes that `ladder` holds registrations of the buffer, to unlink
    /// them when it goes.
    fn remember(&self, ladder: &Ladder) {
        let forget = ladder.forgetter();
        let mut registered = self
            .registered_with
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !registered.iter().any(|f| Arc::ptr_eq(f, forget)) {
            registered.push(Arc::clone(forget));
        }
    }

    /// Registers `len` bytes at `offset` and grants them to a peer with
    /// `rights`: a memory region of exactly that range and those rights,
    /// whose descriptor is what the peer gets.
    pub fn grant(
        &self,
        ladder: &Ladder,
        offset: u64,
        len: u64,
        rights: GrantRights,
    ) -> Result<MrGrant, LadderError> {
        let registration = self.register(ladder, offset, len)?;
        ladder.grant(&registration, 0, len, rights)
    }

    /// Unlinks the buffer's cache entries in every ladder it was registered
    /// with: MRs nobody else holds are deregistered now.
    fn forget_registrations(&mut self) {
        let forgets = std::mem::take(
            self.registered_with
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for forget in forgets {
            forget.forget(self.owner);
        }
    }

    /// Whether the memory is the caller's (it cannot be kept alive).
    fn borrowed(&self) -> bool {
        matches!(self.backing.memory, Memory::Borrowed)
    }

    /// Drops the buffer once no MR covers its memory, waiting at most
    /// `timeout`; hands it back (its cache entries already unlinked) if MRs
    /// are still alive then, e.g. held by an escaped handle, a grant or a
    /// transfer in flight. For memory gdr owns this never fails: the last
    /// lease frees it.
    #[allow(clippy::result_large_err)] // the buffer itself is the error
    pub fn release(mut self, timeout: Duration) -> Result<(), Self> {
        self.forget_registrations();
        if !self.borrowed() || self.backing.leases.wait_released(Some(timeout)) {
            Ok(())
        } else {
            Err(self)
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.forget_registrations();
        if !self.borrowed() {
            // gdr's own memory: freed by whichever of this buffer and its
            // last lease drops last.
            return;
        }
        let leases = &self.backing.leases;
        if leases.live() != 0 {
            tracing::warn!(
                addr = format_args!("{:#x}", self.addr),
                len = self.len,
                live = leases.live(),
                "dropping a buffer over caller memory while MRs cover it: waiting"
            );
        }
        if !leases.wait_released(Some(self.release_timeout)) {
            // Returning would let the caller free memory a NIC can still
            // write into. No safe way out is left.
            tracing::error!(
                addr = format_args!("{:#x}", self.addr),
                len = self.len,
                live = leases.live(),
                timeout = ?self.release_timeout,
                "MRs still cover caller memory past the release timeout: aborting"
            );
            std::process::abort();
        }
    }
}

/// `len` as the `usize` an allocation takes.
fn alloc_size(what: &'static str, len: u64) -> Result<usize, CudaError> {
    usize::try_from(len)
        .map_err(|_| CudaError::invalid(what, format!("{len} bytes do not fit the address space")))
}

/// The part of a registered range lying in one physical chunk: its offset
/// from the range's start and its registration.
pub struct Piece {
    /// Bytes from the start of the registered range.
    pub offset: u64,
    /// The part's registration.
    pub registration: LadderRegistration,
}

impl fmt::Debug for Piece {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Piece")
            .field("offset", &self.offset)
            .field("registration", &self.registration)
            .finish()
    }
}

/// A range of a [`Buffer`] registered on one NIC, borrowing the buffer.
pub struct BufferRegistration<'b> {
    inner: LadderRegistration,
    _buffer: PhantomData<&'b ()>,
}

impl fmt::Debug for BufferRegistration<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl std::ops::Deref for BufferRegistration<'_> {
    type Target = LadderRegistration;

    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

#[cfg(test)]
mod tests {
    use gdr_sim::{FaultPlan, GpuConfig, SimCuda};
    use hal_cuda::Driver as _;

    use super::*;

    type B = Buffer;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + 3) as u8).collect()
    }

    /// `buffer` (whose bytes are zeroed first: pinned memory comes back
    /// from the driver unzeroed) read and written within its bounds.
    fn round_trip(buffer: &B) {
        let len = buffer.len();
        buffer.write_at(0, &vec![0; len as usize]).unwrap();
        let data = pattern(100);
        buffer.write_at(len - 100, &data).unwrap();
        buffer.write_at(1, &data[..3]).unwrap();
        let mut out = [0u8; 100];
        buffer.read_at(len - 100, &mut out).unwrap();
        assert_eq!(out, data[..]);
        let all = buffer.to_vec().unwrap();
        assert_eq!(&all[..5], &[0, data[0], data[1], data[2], 0]);
        assert_eq!(&all[len as usize - 100..], &data[..]);
        // Empty copies at the very end are in range.
        buffer.read_at(len, &mut []).unwrap();
        buffer.write_at(len, &[]).unwrap();
        // One byte past the end, or an offset that wraps: refused, and
        // nothing written.
        let past = BufferAccessError::OutOfRange {
            offset: len - 99,
            len: 100,
            buffer_len: len,
        };
        assert_eq!(buffer.read_at(len - 99, &mut out), Err(past.clone()));
        assert_eq!(buffer.write_at(len - 99, &[9; 100]), Err(past));
        assert!(matches!(
            buffer.write_at(u64::MAX, &[9]),
            Err(BufferAccessError::OutOfRange { .. })
        ));
        assert!(matches!(
            buffer.read_at(len + 1, &mut []),
            Err(BufferAccessError::OutOfRange { .. })
        ));
        assert_eq!(buffer.to_vec().unwrap(), all);
    }

    #[test]
    fn host_memory_is_read_and_written_within_bounds() {
        let host = B::alloc_host(8192);
        assert!(
            host.to_vec().unwrap().iter().all(|&b| b == 0),
            "alloc_host memory starts zeroed"
        );
        round_trip(&host);
    }

    #[test]
    fn pinned_and_borrowed_host_memory_too_but_not_device_memory() {
        let cuda = SimCuda::new(vec![GpuConfig::default()], FaultPlan::new()).erased();
        let ctx = cuda.context(0).unwrap();
        round_trip(&B::alloc_pinned(&ctx, 4096).unwrap());

        let mut owned = vec![0u8; 4096];
        // SAFETY: `owned` outlives the buffer (dropped at the end of this
        // block, before `owned`), and nothing registers it.
        let wrapped = unsafe { B::wrap(None, owned.as_mut_ptr() as u64, 4096, None) }.unwrap();
        round_trip(&wrapped);
        drop(wrapped);
        assert_eq!(owned[4096 - 100..], pattern(100)[..]);

        let device = B::alloc_device(&ctx, 4096).unwrap();
        let refused = BufferAccessError::NotCpuAccessible {
            memory_type: MemoryType::Device,
        };
        assert_eq!(device.to_vec(), Err(refused.clone()));
        assert_eq!(device.read_at(0, &mut [0; 4]), Err(refused.clone()));
        assert_eq!(device.write_at(0, &[1; 4]), Err(refused.clone()));
        assert!(refused.to_string().contains("Device"), "{refused}");
    }
}
