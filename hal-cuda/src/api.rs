//! The CUDA HAL's traits: one [`Api`] naming a backend's handle types, and a
//! role trait per object, wgpu-hal style. Methods are not generic so mockall
//! can mock them. Owned handles free their native object on `Drop`, which
//! never panics (a failure there is logged, as cudarc does).
//!
//! Device addresses are `u64` (`CUdeviceptr`): the CPU cannot dereference
//! them. Host addresses are raw pointers.

use std::fmt::Debug;
use std::os::fd::OwnedFd;

use crate::error::Result;
use crate::types::{
    DeviceAttributes, FlushScope, HostRegisterFlags, IpcMemHandle, PointerAttributes,
};

/// A CUDA backend: the handle types it hands out.
pub trait Api: Sized + Send + Sync + Debug + 'static {
    /// The loaded driver: devices and their contexts.
    type Driver: Driver<Self>;
    /// A device's primary context, retained.
    type Context: Context<Self>;
    /// A stream.
    type Stream: Stream<Self>;
    /// An event.
    type Event: Event;
    /// Device memory from `cuMemAlloc`, freed on drop.
    type DeviceMemory: DeviceMemory;
    /// Pinned host memory from `cuMemHostAlloc`, freed on drop.
    type PinnedHostMemory: PinnedHostMemory;
    /// Existing host memory pinned by `cuMemHostRegister`, unregistered on drop.
    type HostRegistration: HostRegistration;
    /// Another process's allocation opened from an IPC handle, closed on drop.
    type IpcMapping: IpcMapping;
    /// A range of device virtual addresses (`cuMemAddressReserve`), freed
    /// when it and every mapping into it are dropped.
    type VirtualReservation: VirtualReservation;
    /// Physical device memory (`cuMemCreate`), released when it and every
    /// mapping of it are dropped.
    type PhysicalMemory: PhysicalMemory;
    /// Physical memory mapped into a reservation (`cuMemMap` +
    /// `cuMemSetAccess`), unmapped on drop; it keeps its reservation and its
    /// physical memory alive, so it can never outlive either.
    type VirtualMapping: VirtualMapping;
}

/// The driver: which GPUs exist and what they can do.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait Driver<A: Api>: Send + Sync + Debug {
    /// A short name of the backend (`cuda`, `sim`).
    fn backend_name(&self) -> &'static str;
    /// Number of GPUs (0 is [`crate::CudaError::NoDevice`], never `Ok(0)`).
    fn device_count(&self) -> Result<u32>;
    /// The attributes of GPU `ordinal`.
    fn device_attributes(&self, ordinal: u32) -> Result<DeviceAttributes>;
    /// Retains GPU `ordinal`'s primary context (released on drop).
    fn context(&self, ordinal: u32) -> Result<A::Context>;
    /// Names the address space this driver's device pointers live in: two
    /// drivers with the same token share device addresses (one process),
    /// and an IPC handle exported by one opens only in a driver of another
    /// token. The real driver: one token per OS process; the simulated
    /// one: one per simulated process.
    fn process_token(&self) -> u64 {
        os_process_token()
    }
    /// Names the machine (kernel) the driver's GPUs belong to: two drivers
    /// with the same token see the same GPUs, so their memory is reachable
    /// by device copies (in one process) or CUDA IPC (across processes).
    /// The real driver: the kernel's boot id ([`boot_id`]); the simulated
    /// one: its simulated node. `None`: unknown (never the same host).
    fn host_token(&self) -> Option<[u8; 16]> {
        boot_id()
    }
}

/// The kernel's boot id (`/proc/sys/kernel/random/boot_id`, a random UUID
/// per boot): two processes that read the same one run on one machine,
/// whatever their network namespaces. `None` when absent or malformed.
pub fn boot_id() -> Option<[u8; 16]> {
    static ID: std::sync::OnceLock<Option<[u8; 16]>> = std::sync::OnceLock::new();
    *ID.get_or_init(|| {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        parse_uuid(&text)
    })
}

/// The 16 bytes of a textual UUID (hex digits, dashes ignored); never all
/// zero.
pub fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let digits: Vec<u8> = text
        .trim()
        .chars()
        .filter(|&c| c != '-')
        .map(|c| c.to_digit(16).map(|d| d as u8))
        .collect::<Option<_>>()?;
    if digits.len() != 32 {
        return None;
    }
    let mut out = [0; 16];
    for (byte, pair) in out.iter_mut().zip(digits.chunks(2)) {
        *byte = (pair[0] << 4) | pair[1];
    }
    (out != [0; 16]).then_some(out)
}

/// A token of this OS process, random per run (a pid is reused; this is
/// not): the default [`Driver::process_token`].
pub fn os_process_token() -> u64 {
    static TOKEN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TOKEN.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        hasher.write_u128(nanos);
        hasher.finish().max(1)
    })
}

/// A device context. Every method makes it current on the calling thread
/// for the duration of the call and then restores what the caller had
/// current (another context, or none), `Drop` of what it made included: an
/// inference runtime's current device never changes under it, and callers
/// never juggle the context stack. (The simulated backend has no notion of
/// a current context.)
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait Context<A: Api>: Send + Sync + Debug {
    /// The device ordinal.
    fn ordinal(&self) -> u32;
    /// Allocates `len` bytes of device memory.
    fn alloc(&self, len: usize) -> Result<A::DeviceMemory>;
    /// Allocates `len` bytes of pinned (page-locked) host memory.
    fn alloc_pinned(&self, len: usize) -> Result<A::PinnedHostMemory>;
    /// Page-locks existing host memory (`cuMemHostRegister`).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be mapped host memory that outlives the returned
    /// registration.
    unsafe fn register_host(
        &self,
        ptr: *mut u8,
        len: usize,
        flags: HostRegisterFlags,
    ) -> Result<A::HostRegistration>;
    /// Creates a non-blocking stream.
    fn create_stream(&self) -> Result<A::Stream>;
    /// A stream someone else made in this context (a framework's, such as
    /// torch's current stream), used in place and never destroyed here.
    /// The real backend takes any `CUstream` handle (the special
    /// `CU_STREAM_LEGACY` 0x1 and `CU_STREAM_PER_THREAD` 0x2 included); the
    /// simulation only the [`Stream::raw`] of one of its live streams of
    /// this GPU, and refuses anything else.
    ///
    /// # Safety
    /// On the real backend `raw` is a stream of this device's primary
    /// context that outlives the returned stream (the driver cannot check
    /// a handle).
    unsafe fn borrow_stream(&self, raw: *mut std::ffi::c_void) -> Result<A::Stream>;
    /// Creates an event (timing disabled: the cheap kind).
    fn create_event(&self) -> Result<A::Event>;
    /// Pointer attributes of any address (host or device).
    fn pointer_attributes(&self, addr: u64) -> Result<PointerAttributes>;
    /// Exports `len` bytes of device memory at `addr` as a dma-buf fd
    /// (`cuMemGetHandleForAddressRange`). `addr` and `len` must be aligned to
    /// the host page size and lie in one allocation; a range of CUDA VMM
    /// memory spanning several physical chunks is refused.
    fn export_dmabuf(&self, addr: u64, len: usize) -> Result<OwnedFd>;
    /// The IPC handle of the allocation containing `addr`.
    fn ipc_export(&self, addr: u64) -> Result<IpcMemHandle>;
    /// Maps another process's allocation from its IPC handle.
    fn ipc_open(&self, handle: &IpcMemHandle) -> Result<A::IpcMapping>;
    /// Lets this context's copies and kernels reach `peer`'s device memory
    /// directly (`cuCtxEnablePeerAccess`: over NVLink or PCIe peer to
    /// peer) instead of through host memory. `Ok(true)`: enabled (or
    /// already, or `peer` is this very device); `Ok(false)`: the devices
    /// cannot reach each other (`cuDeviceCanAccessPeer`), and copies
    /// between them still work, staged by the driver.
    fn enable_peer_access(&self, peer: &A::Context) -> Result<bool>;
    /// Makes inbound GPUDirect RDMA writes visible (`cuFlushGPUDirectRDMAWrites`).
    fn flush_gpu_direct_rdma_writes(&self, scope: FlushScope) -> Result<()>;
    /// Waits for all work in the context.
    fn synchronize(&self) -> Result<()>;
    /// The granularity, in bytes, that sizes and offsets of the virtual
    /// memory management calls must be multiples of
    /// (`cuMemGetAllocationGranularity`, minimum, for memory as
    /// [`Context::create_physical`] makes it).
    /// [`crate::CudaError::NotSupported`] without the VMM API.
    fn vmm_granularity(&self) -> Result<usize>;
    /// Reserves `len` bytes (a multiple of the granularity) of device
    /// virtual addresses (`cuMemAddressReserve`).
    fn reserve_address_range(&self, len: usize) -> Result<A::VirtualReservation>;
    /// Creates `len` bytes (a multiple of the granularity) of physical
    /// memory on this device (`cuMemCreate`), GPUDirect RDMA capable where
    /// the device supports that for VMM memory.
    fn create_physical(&self, len: usize) -> Result<A::PhysicalMemory>;
    /// As [`Context::create_physical`], with `gpuDirectRDMACapable` asked
    /// for only when `gpu_direct_rdma` is true (and the device supports it):
    /// memory as other allocators (PyTorch, vLLM) may create it.
    fn create_physical_with(&self, len: usize, gpu_direct_rdma: bool) -> Result<A::PhysicalMemory>;
    /// `cuMemGetAddressRange`: the base and size of the allocation holding
    /// `addr`; for CUDA VMM memory, of the one mapped physical chunk (where
    /// [`Context::pointer_attributes`] may report the whole reservation).
    /// An error for an address nothing is mapped at.
    fn address_range(&self, addr: u64) -> Result<(u64, u64)>;
    /// Maps all of `physical` at `reservation.base() + offset` (`cuMemMap`;
    /// `offset` a multiple of the granularity, the range inside the
    /// reservation and not mapped already) and gives this device read and
    /// write access to it (`cuMemSetAccess`). Each mapping is an allocation
    /// of its own for [`Context::pointer_attributes`]: a new buffer id, the
    /// mapped chunk as its base and size.
    fn map(
        &self,
        reservation: &A::VirtualReservation,
        offset: usize,
        physical: &A::PhysicalMemory,
    ) -> Result<A::VirtualMapping>;
}

/// A stream: copies run in order on it, asynchronously to the host.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait Stream<A: Api>: Send + Sync + Debug {
    /// Host → device copy.
    ///
    /// # Safety
    /// `src..src+len` must be readable host memory and `dst..dst+len` device
    /// memory, both valid until the copy completes (synchronize or an event).
    /// Pageable `src` makes the copy synchronous.
    unsafe fn copy_host_to_device(&self, dst: u64, src: *const u8, len: usize) -> Result<()>;
    /// Device → host copy.
    ///
    /// # Safety
    /// As for [`Stream::copy_host_to_device`], with `dst` writable host memory
    /// nobody else touches until the copy completes.
    unsafe fn copy_device_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()>;
    /// Device → device copy.
    ///
    /// # Safety
    /// Both ranges must be device memory valid until the copy completes.
    unsafe fn copy_device_to_device(&self, dst: u64, src: u64, len: usize) -> Result<()>;
    /// Sets `len` bytes of device memory to `value`.
    ///
    /// # Safety
    /// `dst..dst+len` must be device memory valid until the set completes.
    unsafe fn memset(&self, dst: u64, value: u8, len: usize) -> Result<()>;
    /// Records `event` after the work queued so far.
    fn record(&self, event: &A::Event) -> Result<()>;
    /// Makes later work on this stream wait for `event`.
    fn wait(&self, event: &A::Event) -> Result<()>;
    /// Makes later work on this stream wait until the 32-bit value at
    /// `addr` is at least `value` (`cuStreamWaitValue32`, GEQ): a host
    /// thread releases the stream by storing to it, no CPU thread blocks.
    /// [`crate::CudaError::NotSupported`] without stream memory operations.
    ///
    /// # Safety
    /// `addr` must be 4-byte aligned and lie in memory the device can read
    /// (pinned host memory of the driver, or device memory), valid until
    /// the wait has passed.
    unsafe fn wait_value32(&self, addr: u64, value: u32) -> Result<()>;
    /// Writes `value` to the 32-bit word at `addr` once the work queued
    /// before it is done (`cuStreamWriteValue32`).
    /// [`crate::CudaError::NotSupported`] without stream memory operations.
    ///
    /// # Safety
    /// As for [`Stream::wait_value32`], and the device must be allowed to
    /// write there.
    unsafe fn write_value32(&self, addr: u64, value: u32) -> Result<()>;
    /// Blocks until the stream's work is done.
    fn synchronize(&self) -> Result<()>;
    /// The native handle: the `CUstream` for the real driver (valid while
    /// `self` lives), for a caller's own kernels and copies on the stream;
    /// a backend without one returns an opaque non-NULL token that no CUDA
    /// API accepts.
    fn raw(&self) -> *mut std::ffi::c_void;
}

/// An event marking a point in a stream.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait Event: Send + Sync + Debug {
    /// True once the work before the record point is done (non-blocking).
    fn is_complete(&self) -> Result<bool>;
    /// Blocks until it is.
    fn synchronize(&self) -> Result<()>;
}

/// Device memory owned by gdr.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait DeviceMemory: Send + Sync + Debug {
    /// Its device address.
    fn device_ptr(&self) -> u64;
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// True for a zero-length allocation (never made).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Pinned host memory owned by gdr.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait PinnedHostMemory: Send + Sync + Debug {
    /// Its host address.
    fn as_ptr(&self) -> *mut u8;
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// True for a zero-length allocation (never made).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Host memory page-locked by `cuMemHostRegister` until dropped.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait HostRegistration: Send + Sync + Debug {
    /// The registered range's start.
    fn as_ptr(&self) -> *mut u8;
    /// Its length.
    fn len(&self) -> usize;
    /// True for an empty range (never registered).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An allocation of another process, mapped through its IPC handle.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait IpcMapping: Send + Sync + Debug {
    /// Where it is mapped in this process.
    fn device_ptr(&self) -> u64;
    /// The size of the whole allocation.
    fn len(&self) -> usize;
    /// True for an empty mapping (never made).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A reserved range of device virtual addresses.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait VirtualReservation: Send + Sync + Debug {
    /// Its first address.
    fn base(&self) -> u64;
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// True for an empty range (never made).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Physical device memory, not yet (or no longer) mapped anywhere.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait PhysicalMemory: Send + Sync + Debug {
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// True for an empty allocation (never made).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether it was created GPUDirect RDMA capable.
    fn gpu_direct_rdma_capable(&self) -> bool;
}

/// Physical memory mapped at a device address.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait VirtualMapping: Send + Sync + Debug {
    /// Where it is mapped.
    fn device_ptr(&self) -> u64;
    /// The mapped length.
    fn len(&self) -> usize;
    /// True for an empty mapping (never made).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::parse_uuid;

    #[test]
    fn boot_ids_parse_as_uuids_and_nothing_else() {
        assert_eq!(
            parse_uuid("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n"),
            Some([
                0x0f, 0x1e, 0x2d, 0x3c, 0x4b, 0x5a, 0x69, 0x78, 0x87, 0x96, 0xa5, 0xb4, 0xc3, 0xd2,
                0xe1, 0xf0
            ])
        );
        assert_eq!(parse_uuid(""), None);
        assert_eq!(parse_uuid("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1"), None);
        assert_eq!(parse_uuid("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1fg"), None);
        assert_eq!(parse_uuid("00000000-0000-0000-0000-000000000000"), None);
    }
}
