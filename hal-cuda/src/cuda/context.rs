//! A device's primary context and what is made in it.

use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::raw::{c_int, c_uint};
use std::sync::Arc;

use cudarc::driver::sys;

use super::memory::{CudaDeviceMemory, CudaHostRegistration, CudaIpcMapping, CudaPinnedHostMemory};
use super::stream::{CudaEvent, CudaStream};
use super::{CudaApi, Symbols, call, call_logged, page_size};
use crate::api::Context;
use crate::error::{CudaError, Result};
use crate::types::{
    AllocationKind, FlushScope, HostRegisterFlags, IpcMemHandle, MemoryType, PointerAttributes,
};

/// The retained primary context, shared by every handle made in it: the last
/// one dropped releases it.
#[derive(Debug)]
pub(crate) struct ContextInner {
    pub(crate) raw: sys::CUcontext,
    pub(crate) dev: sys::CUdevice,
    pub(crate) ordinal: u32,
    pub(crate) symbols: Symbols,
}

// SAFETY: a CUcontext is a driver handle, not memory we dereference; the
// driver API is thread safe and a context may be made current on any thread.
unsafe impl Send for ContextInner {}
// SAFETY: as above; `&ContextInner` only hands the handle to the driver.
unsafe impl Sync for ContextInner {}

impl ContextInner {
    /// Makes the context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: `raw` is a primary context retained for as long as `self` lives.
        call("cuCtxSetCurrent", || unsafe {
            sys::cuCtxSetCurrent(self.raw)
        })
    }

    /// Binds for a `Drop`: a failure is logged, and the release is still tried.
    pub(crate) fn bind_logged(&self) {
        if let Err(error) = self.bind() {
            tracing::warn!(%error, "cuCtxSetCurrent failed while releasing a CUDA object");
        }
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: balances the cuDevicePrimaryCtxRetain that made `self`.
        call_logged("cuDevicePrimaryCtxRelease", || unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.dev)
        });
    }
}

/// A device's primary context, retained (released when it and every handle
/// made in it are dropped). Every method makes it current on the calling
/// thread first.
#[derive(Debug, Clone)]
pub struct CudaContext {
    pub(crate) inner: Arc<ContextInner>,
}

impl CudaContext {
    /// The raw `CUcontext`, for callers that drive cudarc's `sys` layer
    /// themselves (benchmarks, baselines). It stays valid while `self` lives.
    pub fn raw(&self) -> sys::CUcontext {
        self.inner.raw
    }

    /// Makes the context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.inner.bind()
    }

    /// `cuMemGetAddressRange`: the base and size of the allocation (for VMM
    /// memory: of the one physical chunk) holding `addr`.
    pub fn address_range(&self, addr: u64) -> Result<(u64, u64)> {
        self.inner.bind()?;
        address_range(addr)
    }
}

pub(crate) fn address_range(addr: u64) -> Result<(u64, u64)> {
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: both are valid out-pointers; any address may be asked about.
    call("cuMemGetAddressRange", || unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr)
    })?;
    Ok((base, size as u64))
}

/// Raw answers of `cuPointerGetAttributes`, each zeroed before the call so a
/// value the driver does not write reads as "no".
#[derive(Default)]
struct RawPointerAttributes {
    memory_type: c_uint,
    device_ordinal: c_int,
    range_start: u64,
    range_size: u64,
    buffer_id: u64,
    is_managed: c_uint,
    legacy_ipc_capable: c_uint,
    gpu_direct_rdma_capable: c_uint,
    mempool: u64,
}

fn classify(raw: &RawPointerAttributes) -> PointerAttributes {
    const HOST: c_uint = 1;
    const DEVICE: c_uint = 2;
    const ARRAY: c_uint = 3;
    const UNIFIED: c_uint = 4;
    let memory_type = if raw.is_managed != 0 {
        MemoryType::Managed
    } else {
        match raw.memory_type {
            HOST => MemoryType::PinnedHost,
            DEVICE | ARRAY => MemoryType::Device,
            UNIFIED => MemoryType::Managed,
            _ => MemoryType::PageableHost,
        }
    };
    if memory_type == MemoryType::PageableHost {
        return pageable();
    }
    let device_ordinal = match memory_type {
        MemoryType::Device | MemoryType::Managed if raw.device_ordinal >= 0 => {
            Some(raw.device_ordinal as u32)
        }
        _ => None,
    };
    // cuMemAlloc memory is legacy-IPC capable; device memory that is neither
    // that nor from a memory pool (cuMemAllocAsync) was mapped with cuMemMap.
    // Caveat (seen on the H200, driver 580): another process's allocation
    // opened here with cuIpcOpenMemHandle also reports "not legacy-IPC
    // capable, no pool", so it is classified VirtualMemoryManagement too,
    // which only makes dma-buf export of it stricter, never wrong.
    let allocation_kind = match memory_type {
        MemoryType::Device if raw.legacy_ipc_capable != 0 => AllocationKind::Legacy,
        MemoryType::Device if raw.mempool == 0 => AllocationKind::VirtualMemoryManagement,
        _ => AllocationKind::Other,
    };
    PointerAttributes {
        memory_type,
        device_ordinal,
        allocation_base: raw.range_start,
        allocation_size: raw.range_size,
        buffer_id: raw.buffer_id,
        allocation_kind,
        gpu_direct_rdma_capable: raw.gpu_direct_rdma_capable != 0,
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

pub(crate) fn pointer_attributes(addr: u64) -> Result<PointerAttributes> {
    use sys::CUpointer_attribute as P;
    let mut raw = RawPointerAttributes::default();
    let mut kinds = [
        P::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        P::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        P::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        P::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        P::CU_POINTER_ATTRIBUTE_BUFFER_ID,
        P::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        P::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        P::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
        P::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
    ];
    let mut data: [*mut c_void; 9] = [
        (&mut raw.memory_type as *mut c_uint).cast(),
        (&mut raw.device_ordinal as *mut c_int).cast(),
        (&mut raw.range_start as *mut u64).cast(),
        (&mut raw.range_size as *mut u64).cast(),
        (&mut raw.buffer_id as *mut u64).cast(),
        (&mut raw.is_managed as *mut c_uint).cast(),
        (&mut raw.legacy_ipc_capable as *mut c_uint).cast(),
        (&mut raw.gpu_direct_rdma_capable as *mut c_uint).cast(),
        (&mut raw.mempool as *mut u64).cast(),
    ];
    // SAFETY: `kinds` and `data` have the same length; each data pointer
    // points at a zeroed field at least as large as what the driver writes
    // for its attribute (unsigned int / int / CUdeviceptr / size_t /
    // unsigned long long / bool / CUmemoryPool); all live across the call.
    let result = call("cuPointerGetAttributes", || unsafe {
        sys::cuPointerGetAttributes(
            kinds.len() as c_uint,
            kinds.as_mut_ptr(),
            data.as_mut_ptr(),
            addr,
        )
    });
    match result {
        Ok(()) => Ok(classify(&raw)),
        // The driver does not know the address: ordinary pageable memory.
        Err(CudaError::InvalidArgument { code: Some(1), .. }) => Ok(pageable()),
        Err(e) => Err(e),
    }
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

    fn create_event(&self) -> Result<CudaEvent> {
        CudaEvent::new(&self.inner)
    }

    fn pointer_attributes(&self, addr: u64) -> Result<PointerAttributes> {
        self.inner.bind()?;
        pointer_attributes(addr)
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
        if addr % page != 0 || len as u64 % page != 0 {
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
        if !self.inner.symbols.dmabuf_export {
            return Err(CudaError::unsupported(
                OP,
                "the loaded libcuda does not export it (driver older than CUDA 11.7)",
            ));
        }
        self.inner.bind()?;
        let attrs = pointer_attributes(addr)?;
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
        let (chunk_base, chunk_size) = address_range(addr)?;
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
        // allocation of this device; flags must be 0. The symbol was probed.
        call(OP, || unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut c_int).cast(),
                addr,
                len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
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
        self.inner.bind()?;
        // cuIpcGetMemHandle wants the allocation's base; the handle names the
        // whole allocation either way.
        let (base, _) = address_range(addr)?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `handle` is a valid out-pointer of the right type; `base`
        // is the start of a live allocation.
        call("cuIpcGetMemHandle", || unsafe {
            sys::cuIpcGetMemHandle(&mut handle, base)
        })?;
        Ok(IpcMemHandle(handle.reserved.map(|b| b as u8)))
    }

    fn ipc_open(&self, handle: &IpcMemHandle) -> Result<CudaIpcMapping> {
        let _span = tracing::debug_span!("cuda_ipc_open", ordinal = self.inner.ordinal).entered();
        CudaIpcMapping::open(&self.inner, handle)
    }

    fn flush_gpu_direct_rdma_writes(&self, scope: FlushScope) -> Result<()> {
        const OP: &str = "cuFlushGPUDirectRDMAWrites";
        if !self.inner.symbols.flush_rdma_writes {
            return Err(CudaError::unsupported(
                OP,
                "the loaded libcuda does not export it (driver older than CUDA 11.3)",
            ));
        }
        self.inner.bind()?;
        let scope = match scope {
            FlushScope::Owner => {
                sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER
            }
            FlushScope::AllDevices => {
                sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES
            }
        };
        // SAFETY: the symbol was probed; the target is the current context,
        // bound above.
        call(OP, || unsafe {
            sys::cuFlushGPUDirectRDMAWrites(
                sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                scope,
            )
        })
    }

    fn synchronize(&self) -> Result<()> {
        self.inner.bind()?;
        // SAFETY: waits on the current context, bound above.
        call("cuCtxSynchronize", || unsafe { sys::cuCtxSynchronize() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_addresses_are_pageable() {
        let raw = RawPointerAttributes::default();
        assert_eq!(classify(&raw), pageable());
    }

    #[test]
    fn device_memory_kinds() {
        let mut raw = RawPointerAttributes {
            memory_type: 2,
            device_ordinal: 0,
            range_start: 0x7000_0000_0000,
            range_size: 1 << 21,
            buffer_id: 9,
            legacy_ipc_capable: 1,
            gpu_direct_rdma_capable: 1,
            ..Default::default()
        };
        let a = classify(&raw);
        assert_eq!(a.memory_type, MemoryType::Device);
        assert_eq!(a.device_ordinal, Some(0));
        assert_eq!(a.allocation_kind, AllocationKind::Legacy);
        raw.legacy_ipc_capable = 0;
        assert_eq!(
            classify(&raw).allocation_kind,
            AllocationKind::VirtualMemoryManagement
        );
        raw.mempool = 0xdead;
        assert_eq!(classify(&raw).allocation_kind, AllocationKind::Other);
        raw.memory_type = 1;
        let a = classify(&raw);
        assert_eq!(a.memory_type, MemoryType::PinnedHost);
        assert_eq!(a.device_ordinal, None);
    }
}
