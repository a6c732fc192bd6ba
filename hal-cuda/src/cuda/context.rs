//! A device's primary context and what is made in it.

use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::raw::c_int;
use std::sync::Arc;

use super::memory::{CudaDeviceMemory, CudaHostRegistration, CudaIpcMapping, CudaPinnedHostMemory};
use super::stream::{CudaEvent, CudaStream};
use super::sys::{self, CuContext, consts as C};
use super::vmm::{CudaPhysicalMemory, CudaVirtualMapping, CudaVirtualReservation};
use super::{CudaApi, check, page_size};
use crate::api::Context;
use crate::error::{CudaError, Result};
use crate::types::{
    AllocationKind, FlushScope, HostRegisterFlags, IpcMemHandle, MemoryType, PointerAttributes,
};

/// The retained primary context, shared by every handle made in it: the last
/// one dropped releases it.
#[derive(Debug)]
pub(crate) struct ContextInner {
    pub(crate) raw: sys::CuCtx,
    pub(crate) dev: sys::CuDevice,
    pub(crate) ordinal: u32,
    pub(crate) drv: &'static sys::Driver,
}

// SAFETY: a CUcontext is a driver handle, not memory we dereference; the
// driver API is thread safe and a context may be made current on any thread.
unsafe impl Send for ContextInner {}
// SAFETY: as above; `&ContextInner` only hands the handle to the driver.
unsafe impl Sync for ContextInner {}

/// The context made current for the duration of one or more driver calls;
/// dropping it restores the thread's previous current context (or none).
#[derive(Debug)]
#[must_use = "the context is current only while the guard lives"]
pub(crate) struct Current<'a> {
    ctx: &'a ContextInner,
    pushed: bool,
    /// The push belongs to this thread's context stack: not `Send`.
    _thread: std::marker::PhantomData<*const ()>,
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        if !self.pushed {
            return;
        }
        let mut popped: sys::CuCtx = std::ptr::null_mut();
        // SAFETY: balances the cuCtxPushCurrent of `enter` on this thread
        // (the guard is not Send); `popped` is a valid out-pointer.
        let code = unsafe { (self.ctx.drv.req.cuCtxPopCurrent_v2)(&mut popped) };
        match check("cuCtxPopCurrent", code) {
            Ok(()) if popped == self.ctx.raw => {}
            Ok(()) => tracing::warn!(
                ?popped,
                ours = ?self.ctx.raw,
                "cuCtxPopCurrent popped another context: the stack was changed under us"
            ),
            Err(error) => tracing::warn!(%error, "restoring the caller's CUDA context failed"),
        }
    }
}

impl ContextInner {
    /// Makes the context current on the calling thread until the guard is
    /// dropped, which restores what was current before (a context of the
    /// caller's, or none). When it is current already, nothing changes.
    pub(crate) fn enter(&self) -> Result<Current<'_>> {
        let req = &self.drv.req;
        let mut current: sys::CuCtx = std::ptr::null_mut();
        // SAFETY: `current` is a valid out-pointer.
        check("cuCtxGetCurrent", unsafe {
            (req.cuCtxGetCurrent)(&mut current)
        })?;
        if current == self.raw {
            return Ok(Current {
                ctx: self,
                pushed: false,
                _thread: std::marker::PhantomData,
            });
        }
        // SAFETY: `raw` is a primary context retained for as long as `self`
        // lives; the guard pops it again.
        check("cuCtxPushCurrent", unsafe {
            (req.cuCtxPushCurrent_v2)(self.raw)
        })?;
        Ok(Current {
            ctx: self,
            pushed: true,
            _thread: std::marker::PhantomData,
        })
    }

    /// [`enter`](Self::enter) for a `Drop`: a failure is logged, and the
    /// release is still tried.
    pub(crate) fn enter_logged(&self) -> Option<Current<'_>> {
        self.enter()
            .inspect_err(|error| {
                tracing::warn!(%error, "making the CUDA context current failed while releasing an object");
            })
            .ok()
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: balances the cuDevicePrimaryCtxRetain that made `self`;
        // needs no current context.
        super::check_logged("cuDevicePrimaryCtxRelease", unsafe {
            (self.drv.req.cuDevicePrimaryCtxRelease_v2)(self.dev)
        });
    }
}

/// A device's primary context, retained (released when it and every handle
/// made in it are dropped). Every method makes it current on the calling
/// thread for the call only, and restores what the caller had current.
#[derive(Debug, Clone)]
pub struct CudaContext {
    pub(crate) inner: Arc<ContextInner>,
}

impl CudaContext {
    /// The raw `CUcontext`, for callers that drive libcuda themselves
    /// (benchmarks, baselines). It stays valid while `self` lives.
    pub fn raw(&self) -> CuContext {
        self.inner.raw.cast()
    }

    /// Synchronous `cuMemcpyHtoD` (the baseline a benchmark compares with).
    ///
    /// # Safety
    /// `src..src+len` must be readable host memory and `dst..dst+len` device
    /// memory of this context.
    pub unsafe fn copy_host_to_device_sync(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<()> {
        let _current = self.inner.enter()?;
        // SAFETY: the caller guarantees both ranges (this method's contract).
        check("cuMemcpyHtoD", unsafe {
            (self.inner.drv.req.cuMemcpyHtoD_v2)(dst, src.cast(), len)
        })
    }

    /// Synchronous `cuMemcpyDtoH` (the baseline a benchmark compares with).
    ///
    /// # Safety
    /// `dst..dst+len` must be writable host memory and `src..src+len` device
    /// memory of this context.
    pub unsafe fn copy_device_to_host_sync(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<()> {
        let _current = self.inner.enter()?;
        // SAFETY: the caller guarantees both ranges (this method's contract).
        check("cuMemcpyDtoH", unsafe {
            (self.inner.drv.req.cuMemcpyDtoH_v2)(dst.cast(), src, len)
        })
    }
}

pub(crate) fn address_range(drv: &sys::Driver, addr: u64) -> Result<(u64, u64)> {
    let mut base: sys::CuDevicePtr = 0;
    let mut size: usize = 0;
    // SAFETY: both are valid out-pointers; any address may be asked about.
    check("cuMemGetAddressRange", unsafe {
        (drv.req.cuMemGetAddressRange_v2)(&mut base, &mut size, addr)
    })?;
    Ok((base, size as u64))
}

/// The pointer attributes gdr asks for, in the order of the query. Each is
/// answered into a zeroed 8-byte slot (no attribute is wider).
const POINTER_ATTRIBUTES: [c_int; 9] = [
    C::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    C::CU_POINTER_ATTRIBUTE_IS_MANAGED,
    C::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    C::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
    C::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    C::CU_POINTER_ATTRIBUTE_BUFFER_ID,
    // Newer than the rest (CUDA 11.x): an older driver refuses them.
    C::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    C::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
    C::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
];

/// What the driver answered for each attribute: `None` where it refused the
/// attribute itself (`CUDA_ERROR_INVALID_VALUE` when asked for it alone).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct RawPointerAttributes {
    memory_type: u32,
    is_managed: bool,
    device_ordinal: Option<i32>,
    range_start: Option<u64>,
    range_size: Option<u64>,
    buffer_id: Option<u64>,
    legacy_ipc_capable: Option<bool>,
    gpu_direct_rdma_capable: Option<bool>,
    mempool: Option<u64>,
}

/// The first four bytes of a slot, where a 4-byte (or 1-byte) answer lies
/// whatever the byte order.
fn low32(slot: u64) -> u32 {
    let b = slot.to_ne_bytes();
    u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
}

/// Asks `query` (a `cuPointerGetAttributes` over zeroed slots, returning the
/// raw code) for every attribute of [`POINTER_ATTRIBUTES`].
///
/// An unknown address is `CUDA_SUCCESS` with zeroed answers (memory type 0):
/// pageable host memory. `CUDA_ERROR_INVALID_VALUE` for the whole query may
/// only mean that the driver lacks one of the attributes, so it never means
/// "host memory": the attributes are then asked one at a time, and one the
/// driver refuses alone is recorded as unknown. Without the memory type, or
/// without the allocation's identity for memory CUDA knows, the address
/// cannot be classified and this is an error.
fn query_pointer(
    addr: u64,
    query: &mut dyn FnMut(&[c_int], &mut [u64]) -> u32,
) -> Result<RawPointerAttributes> {
    const OP: &str = "cuPointerGetAttributes";
    const INVALID_VALUE: u32 = C::CUDA_ERROR_INVALID_VALUE;
    let mut slots = [0u64; POINTER_ATTRIBUTES.len()];
    let mut known = [true; POINTER_ATTRIBUTES.len()];
    match query(&POINTER_ATTRIBUTES, &mut slots) {
        C::CUDA_SUCCESS => {}
        INVALID_VALUE => {
            tracing::debug!(
                addr = format_args!("{addr:#x}"),
                "{OP} refused the batch; asking one attribute at a time"
            );
            for (i, &attribute) in POINTER_ATTRIBUTES.iter().enumerate() {
                let mut slot = [0u64];
                match query(&[attribute], &mut slot) {
                    C::CUDA_SUCCESS => slots[i] = slot[0],
                    INVALID_VALUE => {
                        slots[i] = 0;
                        known[i] = false;
                    }
                    code => return Err(CudaError::from_code(OP, code)),
                }
            }
        }
        code => return Err(CudaError::from_code(OP, code)),
    }
    let get = |i: usize| known[i].then_some(slots[i]);
    let cannot = |what: &str| CudaError::InvalidArgument {
        operation: OP,
        reason: format!(
            "the driver refused {what} of {addr:#x}: its memory type cannot be determined"
        ),
        code: Some(INVALID_VALUE),
    };
    let memory_type = get(0).map(low32).ok_or_else(|| cannot("the memory type"))?;
    let raw = RawPointerAttributes {
        memory_type,
        is_managed: get(1).is_some_and(|v| low32(v) != 0),
        device_ordinal: get(2).map(|v| low32(v) as i32),
        range_start: get(3),
        range_size: get(4),
        buffer_id: get(5),
        legacy_ipc_capable: get(6).map(|v| low32(v) != 0),
        gpu_direct_rdma_capable: get(7).map(|v| low32(v) != 0),
        mempool: get(8),
    };
    if memory_type != 0 || raw.is_managed {
        // Memory CUDA knows: the cache keys it by its allocation's identity.
        if raw.buffer_id.is_none() {
            return Err(cannot("the buffer id"));
        }
        if raw.range_start.is_none() || raw.range_size.is_none() {
            return Err(cannot("the allocation range"));
        }
    }
    Ok(raw)
}

fn classify(raw: &RawPointerAttributes) -> PointerAttributes {
    const HOST: u32 = C::CU_MEMORYTYPE_HOST;
    const DEVICE: u32 = C::CU_MEMORYTYPE_DEVICE;
    const ARRAY: u32 = C::CU_MEMORYTYPE_ARRAY;
    const UNIFIED: u32 = C::CU_MEMORYTYPE_UNIFIED;
    let memory_type = if raw.is_managed {
        MemoryType::Managed
    } else {
        match raw.memory_type {
            // Zero: an address the driver does not know.
            0 => return pageable(),
            HOST => MemoryType::PinnedHost,
            DEVICE | ARRAY => MemoryType::Device,
            UNIFIED => MemoryType::Managed,
            // A memory type newer than this code: never guessed to be host
            // memory; treated as device memory, which gdr never touches with
            // the CPU.
            _ => MemoryType::Device,
        }
    };
    let device_ordinal = match (memory_type, raw.device_ordinal) {
        (MemoryType::Device | MemoryType::Managed, Some(ordinal)) if ordinal >= 0 => {
            Some(ordinal as u32)
        }
        _ => None,
    };
    // cuMemAlloc memory is legacy-IPC capable; device memory that is neither
    // that nor from a memory pool (cuMemAllocAsync) was mapped with cuMemMap.
    // Caveat (seen on the H200, driver 580): another process's allocation
    // opened here with cuIpcOpenMemHandle also reports "not legacy-IPC
    // capable, no pool", so it is classified VirtualMemoryManagement too,
    // which only makes dma-buf export of it stricter, never wrong. Where the
    // driver does not know these attributes, the kind is not told.
    let allocation_kind = match (memory_type, raw.legacy_ipc_capable, raw.mempool) {
        (MemoryType::Device, Some(true), _) => AllocationKind::Legacy,
        (MemoryType::Device, Some(false), Some(0)) => AllocationKind::VirtualMemoryManagement,
        _ => AllocationKind::Other,
    };
    PointerAttributes {
        memory_type,
        device_ordinal,
        allocation_base: raw.range_start.unwrap_or(0),
        allocation_size: raw.range_size.unwrap_or(0),
        buffer_id: raw.buffer_id.unwrap_or(0),
        allocation_kind,
        gpu_direct_rdma_capable: raw.gpu_direct_rdma_capable == Some(true),
    }
}

fn pageable() -> PointerAttributes {
    PointerAttributes {
        memory_type: MemoryType::PageableHost,
        device_ordinal: None,
        allocation_base: 0,
        allocation_size: 0,
        buffer_id: 0,
        allocation_kind: AllocationKind::Other,
        gpu_direct_rdma_capable: false,
    }
}

/// `cuPointerGetAttributes` of `addr` (the caller made a context current).
pub(crate) fn pointer_attributes(drv: &sys::Driver, addr: u64) -> Result<PointerAttributes> {
    let mut query = |kinds: &[c_int], slots: &mut [u64]| -> u32 {
        debug_assert_eq!(kinds.len(), slots.len());
        let mut kinds = kinds.to_vec();
        let mut data: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|slot| (slot as *mut u64).cast::<c_void>())
            .collect();
        // SAFETY: `kinds` and `data` have the same length; each data pointer
        // points at a zeroed 8-byte slot, at least as large as what the
        // driver writes for any of these attributes (unsigned int, int,
        // CUdeviceptr, size_t, unsigned long long, bool, CUmemoryPool); all
        // live across the call.
        unsafe {
            (drv.req.cuPointerGetAttributes)(
                kinds.len() as u32,
                kinds.as_mut_ptr(),
                data.as_mut_ptr(),
                addr,
            )
        }
    };
    query_pointer(addr, &mut query).map(|raw| classify(&raw))
}

impl Context<CudaApi> for CudaContext {
    fn ordinal(&self) -> u32 {
        self.inner.ordinal
    }

    fn alloc(&self, len: usize) -> Result<CudaDeviceMemory> {
        let _span = tracing::debug_span!("cuda_alloc", ordinal = self.inner.ordinal, len).entered();
        CudaDeviceMemory::new(&self.inner, len)
    }

    fn alloc_pinned(&self, len: usize) -> Result<CudaPinnedHostMemory> {
        let _span =
            tracing::debug_span!("cuda_alloc_pinned", ordinal = self.inner.ordinal, len).entered();
        CudaPinnedHostMemory::new(&self.inner, len)
    }

    unsafe fn register_host(
        &self,
        ptr: *mut u8,
        len: usize,
        flags: HostRegisterFlags,
    ) -> Result<CudaHostRegistration> {
        let _span = tracing::debug_span!(
            "cuda_register_host",
            ordinal = self.inner.ordinal,
            ptr = ?ptr,
            len
        )
        .entered();
        // SAFETY: the caller guarantees the range is mapped host memory that
        // outlives the registration (this method's contract).
        unsafe { CudaHostRegistration::new(&self.inner, ptr, len, flags) }
    }

    fn create_stream(&self) -> Result<CudaStream> {
        CudaStream::new(&self.inner)
    }

    unsafe fn borrow_stream(&self, raw: *mut std::ffi::c_void) -> Result<CudaStream> {
        // SAFETY: the caller's contract is this function's.
        Ok(unsafe { CudaStream::borrowed(&self.inner, raw.cast()) })
    }

    fn create_event(&self) -> Result<CudaEvent> {
        CudaEvent::new(&self.inner)
    }

    fn pointer_attributes(&self, addr: u64) -> Result<PointerAttributes> {
        let _current = self.inner.enter()?;
        pointer_attributes(self.inner.drv, addr)
    }

    fn export_dmabuf(&self, addr: u64, len: usize) -> Result<OwnedFd> {
        const OP: &str = "cuMemGetHandleForAddressRange";
        let _span = tracing::debug_span!(
            "cuda_export_dmabuf",
            ordinal = self.inner.ordinal,
            addr = format_args!("{addr:#x}"),
            len
        )
        .entered();
        let page = page_size();
        if len == 0 {
            return Err(CudaError::invalid(OP, "empty range"));
        }
        if !addr.is_multiple_of(page) || !(len as u64).is_multiple_of(page) {
            return Err(CudaError::invalid(
                OP,
                format!(
                    "address {addr:#x} and length {len} must be multiples of the page size ({page})"
                ),
            ));
        }
        let end = addr
            .checked_add(len as u64)
            .ok_or_else(|| CudaError::invalid(OP, "range wraps around"))?;
        let Some(export) = &self.inner.drv.dmabuf else {
            return Err(CudaError::unsupported(
                OP,
                "the loaded libcuda does not export it (driver older than CUDA 11.7)",
            ));
        };
        let _current = self.inner.enter()?;
        let attrs = pointer_attributes(self.inner.drv, addr)?;
        if attrs.memory_type != MemoryType::Device {
            return Err(CudaError::invalid(
                OP,
                format!(
                    "{addr:#x} is {:?} memory, not device memory",
                    attrs.memory_type
                ),
            ));
        }
        if attrs.device_ordinal != Some(self.inner.ordinal) {
            return Err(CudaError::invalid(
                OP,
                format!(
                    "{addr:#x} belongs to device {:?}, not {}",
                    attrs.device_ordinal, self.inner.ordinal
                ),
            ));
        }
        let alloc_end = attrs.allocation_base + attrs.allocation_size;
        // cuMemGetAddressRange gives, for VMM memory, the one physical chunk
        // holding `addr`: one dma-buf cannot span chunks.
        let (chunk_base, chunk_size) = address_range(self.inner.drv, addr)?;
        let chunk_end = chunk_base + chunk_size;
        if end > chunk_end {
            if attrs.allocation_kind == AllocationKind::VirtualMemoryManagement && end <= alloc_end
            {
                return Err(CudaError::unsupported(
                    OP,
                    format!(
                        "[{addr:#x}, {end:#x}) spans several physical chunks of a CUDA VMM \
                         allocation (the chunk holding {addr:#x} is [{chunk_base:#x}, \
                         {chunk_end:#x})): export each chunk separately"
                    ),
                ));
            }
            return Err(CudaError::invalid(
                OP,
                format!(
                    "[{addr:#x}, {end:#x}) is not inside one allocation (the one holding \
                     {addr:#x} is [{chunk_base:#x}, {chunk_end:#x}))"
                ),
            ));
        }
        let mut fd: c_int = -1;
        // SAFETY: `fd` is a valid out-pointer for the int a DMA_BUF_FD handle
        // is; the range was checked to be page aligned and inside one
        // allocation of this device; flags must be 0.
        check(OP, unsafe {
            (export.cuMemGetHandleForAddressRange)(
                (&mut fd as *mut c_int).cast(),
                addr,
                len,
                C::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        if fd < 0 {
            return Err(CudaError::Os {
                operation: OP,
                errno: libc::EBADF,
            });
        }
        tracing::debug!(fd, "dma-buf exported");
        // SAFETY: the driver just created `fd` for us; nobody else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn ipc_export(&self, addr: u64) -> Result<IpcMemHandle> {
        let _span = tracing::debug_span!(
            "cuda_ipc_export",
            ordinal = self.inner.ordinal,
            addr = format_args!("{addr:#x}")
        )
        .entered();
        let _current = self.inner.enter()?;
        // cuIpcGetMemHandle wants the allocation's base; the handle names the
        // whole allocation either way.
        let (base, _) = address_range(self.inner.drv, addr)?;
        let mut handle = sys::CuIpcMemHandle { reserved: [0; 64] };
        // SAFETY: `handle` is a valid out-pointer of the right layout; `base`
        // is the start of a live allocation.
        check("cuIpcGetMemHandle", unsafe {
            (self.inner.drv.req.cuIpcGetMemHandle)(&mut handle, base)
        })?;
        Ok(IpcMemHandle(handle.reserved.map(|b| b as u8)))
    }

    fn ipc_open(&self, handle: &IpcMemHandle) -> Result<CudaIpcMapping> {
        let _span = tracing::debug_span!("cuda_ipc_open", ordinal = self.inner.ordinal).entered();
        CudaIpcMapping::open(&self.inner, handle)
    }

    fn enable_peer_access(&self, peer: &CudaContext) -> Result<bool> {
        const OP: &str = "cuCtxEnablePeerAccess";
        if peer.inner.dev == self.inner.dev {
            return Ok(true);
        }
        let _span = tracing::debug_span!(
            "cuda_enable_peer_access",
            ordinal = self.inner.ordinal,
            peer = peer.inner.ordinal
        )
        .entered();
        let Some(access) = &self.inner.drv.peer else {
            return Err(CudaError::unsupported(
                OP,
                "the loaded libcuda does not export the peer access calls",
            ));
        };
        let mut can: c_int = 0;
        // SAFETY: `can` is a valid out-pointer; both devices are live
        // handles of this driver.
        check("cuDeviceCanAccessPeer", unsafe {
            (access.cuDeviceCanAccessPeer)(&mut can, self.inner.dev, peer.inner.dev)
        })?;
        if can == 0 {
            return Ok(false);
        }
        // Enabling is a property of the current context (ours).
        let _current = self.inner.enter()?;
        // SAFETY: `peer.inner.raw` is a retained primary context; flags must
        // be 0.
        let code = unsafe { (access.cuCtxEnablePeerAccess)(peer.inner.raw, 0) };
        match code {
            C::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(true),
            code => check(OP, code).map(|()| true),
        }
    }

    fn flush_gpu_direct_rdma_writes(&self, scope: FlushScope) -> Result<()> {
        const OP: &str = "cuFlushGPUDirectRDMAWrites";
        let Some(flush) = &self.inner.drv.flush else {
            return Err(CudaError::unsupported(
                OP,
                "the loaded libcuda does not export it (driver older than CUDA 11.3)",
            ));
        };
        let _current = self.inner.enter()?;
        let scope = match scope {
            FlushScope::Owner => C::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
            FlushScope::AllDevices => C::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES,
        };
        // SAFETY: the target is the current context, made current above.
        check(OP, unsafe {
            (flush.cuFlushGPUDirectRDMAWrites)(
                C::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                scope,
            )
        })
    }

    fn synchronize(&self) -> Result<()> {
        let _current = self.inner.enter()?;
        // SAFETY: waits on the current context, made current above.
        check("cuCtxSynchronize", unsafe {
            (self.inner.drv.req.cuCtxSynchronize)()
        })
    }

    fn vmm_granularity(&self) -> Result<usize> {
        super::vmm::granularity(&self.inner)
    }

    fn reserve_address_range(&self, len: usize) -> Result<CudaVirtualReservation> {
        CudaVirtualReservation::new(&self.inner, len)
    }

    fn create_physical(&self, len: usize) -> Result<CudaPhysicalMemory> {
        CudaPhysicalMemory::new(&self.inner, len, true)
    }

    fn create_physical_with(
        &self,
        len: usize,
        gpu_direct_rdma: bool,
    ) -> Result<CudaPhysicalMemory> {
        CudaPhysicalMemory::new(&self.inner, len, gpu_direct_rdma)
    }

    fn address_range(&self, addr: u64) -> Result<(u64, u64)> {
        let _current = self.inner.enter()?;
        address_range(self.inner.drv, addr)
    }

    fn map(
        &self,
        reservation: &CudaVirtualReservation,
        offset: usize,
        physical: &CudaPhysicalMemory,
    ) -> Result<CudaVirtualMapping> {
        CudaVirtualMapping::new(&self.inner, reservation, offset, physical)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `cuPointerGetAttributes`: answers `values` for the attributes
    /// it knows and refuses a batch holding any it does not (as an older
    /// driver does) with `CUDA_ERROR_INVALID_VALUE`.
    fn fake_driver<'a>(
        values: &'a [(c_int, u64)],
        unknown: &'a [c_int],
    ) -> impl FnMut(&[c_int], &mut [u64]) -> u32 + 'a {
        move |kinds, slots| {
            if kinds.iter().any(|k| unknown.contains(k)) {
                return 1;
            }
            for (kind, slot) in kinds.iter().zip(slots.iter_mut()) {
                *slot = values
                    .iter()
                    .find(|(k, _)| k == kind)
                    .map_or(0, |&(_, v)| v);
            }
            0
        }
    }

    fn device_values() -> Vec<(c_int, u64)> {
        vec![
            (C::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, 2),
            (C::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, 0),
            (C::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, 0x7000_0000_0000),
            (C::CU_POINTER_ATTRIBUTE_RANGE_SIZE, 1 << 21),
            (C::CU_POINTER_ATTRIBUTE_BUFFER_ID, 907),
            (C::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, 1),
            (C::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, 1),
        ]
    }

    fn attributes(values: &[(c_int, u64)], unknown: &[c_int]) -> Result<PointerAttributes> {
        let mut fake = fake_driver(values, unknown);
        query_pointer(0x7000_0000_1000, &mut fake).map(|raw| classify(&raw))
    }

    #[test]
    fn unknown_addresses_are_success_with_zeroes_and_pageable() {
        assert_eq!(attributes(&[], &[]).unwrap(), pageable());
    }

    #[test]
    fn device_memory_on_a_driver_lacking_an_attribute_is_still_device_memory() {
        // All known: the batch answers.
        let all = attributes(&device_values(), &[]).unwrap();
        assert_eq!(all.memory_type, MemoryType::Device);
        assert_eq!(all.buffer_id, 907);
        assert_eq!(all.allocation_kind, AllocationKind::Legacy);
        // An older driver without MEMPOOL_HANDLE refuses the batch with
        // INVALID_VALUE: never host memory; asked one at a time instead.
        let old = attributes(&device_values(), &[C::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE]).unwrap();
        assert_eq!(old.memory_type, MemoryType::Device, "{old:?}");
        assert_eq!(old.device_ordinal, Some(0));
        assert_eq!(old.buffer_id, 907);
        assert_eq!(old.allocation_base, 0x7000_0000_0000);
        assert_eq!(old.allocation_size, 1 << 21);
        assert_eq!(old.allocation_kind, AllocationKind::Legacy);
        // Without the legacy-IPC attribute either, the kind is not told.
        let older = attributes(
            &device_values(),
            &[
                C::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                C::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                C::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
            ],
        )
        .unwrap();
        assert_eq!(older.memory_type, MemoryType::Device);
        assert_eq!(older.allocation_kind, AllocationKind::Other);
        assert!(!older.gpu_direct_rdma_capable);
    }

    #[test]
    fn an_undeterminable_memory_type_is_an_error_not_host_memory() {
        for missing in [
            C::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            C::CU_POINTER_ATTRIBUTE_BUFFER_ID,
            C::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ] {
            let r = attributes(&device_values(), &[missing]);
            assert!(
                matches!(r, Err(CudaError::InvalidArgument { code: Some(1), .. })),
                "attribute {missing} refused: {r:?}"
            );
        }
        // Another failure is reported as it is.
        let mut failing = |_: &[c_int], _: &mut [u64]| 201;
        assert!(query_pointer(0x1000, &mut failing).is_err());
    }

    #[test]
    fn memory_kinds_are_classified() {
        let mut raw = RawPointerAttributes {
            memory_type: 2,
            device_ordinal: Some(0),
            range_start: Some(0x7000_0000_0000),
            range_size: Some(1 << 21),
            buffer_id: Some(9),
            legacy_ipc_capable: Some(true),
            gpu_direct_rdma_capable: Some(true),
            mempool: Some(0),
            ..Default::default()
        };
        let a = classify(&raw);
        assert_eq!(a.memory_type, MemoryType::Device);
        assert_eq!(a.device_ordinal, Some(0));
        assert_eq!(a.allocation_kind, AllocationKind::Legacy);
        raw.legacy_ipc_capable = Some(false);
        assert_eq!(
            classify(&raw).allocation_kind,
            AllocationKind::VirtualMemoryManagement
        );
        raw.mempool = Some(0xdead);
        assert_eq!(classify(&raw).allocation_kind, AllocationKind::Other);
        raw.memory_type = 1;
        let a = classify(&raw);
        assert_eq!(a.memory_type, MemoryType::PinnedHost);
        assert_eq!(a.device_ordinal, None);
        // A memory type newer than this code is never taken for host memory.
        raw.memory_type = 77;
        assert_eq!(classify(&raw).memory_type, MemoryType::Device);
    }
}
