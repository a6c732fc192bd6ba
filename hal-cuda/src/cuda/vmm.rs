//! CUDA virtual memory management: address reservations, physical
//! allocations and the mappings between them.
//!
//! Lifetimes are held by the handles, so no order of drops can leave a
//! mapping over a freed reservation or released memory: a mapping keeps its
//! reservation and its physical allocation alive (`Arc`s) and unmaps on
//! drop; the reservation's range is freed (`cuMemAddressFree`) once the
//! reservation handle and every mapping into it are gone, and the physical
//! allocation is released (`cuMemRelease`) once its handle and every mapping
//! of it are gone.

use std::sync::Arc;

use cudarc::driver::sys::{
    CUmemAccess_flags, CUmemAllocationHandleType, CUmemAllocationProp_st__bindgen_ty_1,
    CUmemAllocationType, CUmemLocationType,
};

use super::context::ContextInner;
use super::sys::{self, consts as C};
use super::{check, check_logged};
use crate::api::{PhysicalMemory, VirtualMapping, VirtualReservation};
use crate::error::{CudaError, Result};

fn vmm(ctx: &ContextInner, operation: &'static str) -> Result<&'static sys::Vmm> {
    let Some(vmm) = ctx.drv.vmm.as_ref() else {
        return Err(CudaError::unsupported(
            operation,
            "the loaded libcuda lacks the virtual memory management API (cuMemCreate, \
             cuMemMap, ...)",
        ));
    };
    let supported = super::attribute_of(
        ctx.drv,
        ctx.dev,
        C::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
    )
    .unwrap_or(0);
    if supported == 0 {
        return Err(CudaError::unsupported(
            operation,
            format!(
                "device {} reports VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0",
                ctx.ordinal
            ),
        ));
    }
    Ok(vmm)
}

fn location(ctx: &ContextInner) -> sys::CuMemLocation {
    sys::CuMemLocation {
        type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ctx.dev,
    }
}

/// The allocation properties gdr creates physical memory with: pinned device
/// memory of the context's device, GPUDirect RDMA capable where
/// `gpu_direct_rdma` asks for it and the device supports that for VMM memory.
fn properties(ctx: &ContextInner, gpu_direct_rdma: bool) -> sys::CuMemAllocationProp {
    let rdma = gpu_direct_rdma
        && super::attribute_of(
            ctx.drv,
            ctx.dev,
            C::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
        )
        .unwrap_or(0)
            != 0;
    sys::CuMemAllocationProp {
        type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: location(ctx),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: u8::from(rdma),
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// `cuMemGetAllocationGranularity` (minimum) for [`properties`].
pub(crate) fn granularity(ctx: &ContextInner) -> Result<usize> {
    const OP: &str = "cuMemGetAllocationGranularity";
    let vmm = vmm(ctx, OP)?;
    let _current = ctx.enter()?;
    let prop = properties(ctx, true);
    let mut granularity: usize = 0;
    // SAFETY: both pointers are valid for the call; `prop` has cuda.h's layout.
    check(OP, unsafe {
        (vmm.cuMemGetAllocationGranularity)(
            &mut granularity,
            &prop,
            C::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    if granularity == 0 {
        return Err(CudaError::invalid(OP, "the driver reported granularity 0"));
    }
    Ok(granularity)
}

fn check_granular(ctx: &ContextInner, operation: &'static str, len: usize) -> Result<usize> {
    let granularity = granularity(ctx)?;
    if len == 0 || !len.is_multiple_of(granularity) {
        return Err(CudaError::invalid(
            operation,
            format!("{len} bytes is not a positive multiple of the granularity ({granularity})"),
        ));
    }
    Ok(granularity)
}

#[derive(Debug)]
struct ReservationInner {
    ctx: Arc<ContextInner>,
    vmm: &'static sys::Vmm,
    base: u64,
    len: usize,
}

impl Drop for ReservationInner {
    fn drop(&mut self) {
        let _current = self.ctx.enter_logged();
        // SAFETY: the range came from cuMemAddressReserve and is freed once,
        // here, after every mapping into it was unmapped (each holds `self`).
        check_logged("cuMemAddressFree", unsafe {
            (self.vmm.cuMemAddressFree)(self.base, self.len)
        });
    }
}

/// A range of device virtual addresses (`cuMemAddressReserve`), freed when
/// this handle and every mapping into it are dropped.
#[derive(Debug)]
pub struct CudaVirtualReservation {
    inner: Arc<ReservationInner>,
}

impl CudaVirtualReservation {
    pub(crate) fn new(ctx: &Arc<ContextInner>, len: usize) -> Result<Self> {
        const OP: &str = "cuMemAddressReserve";
        let vmm = vmm(ctx, OP)?;
        let granularity = check_granular(ctx, OP, len)?;
        let _current = ctx.enter()?;
        let mut base: sys::CuDevicePtr = 0;
        // SAFETY: `base` is a valid out-pointer; no fixed address is asked
        // for (0) and flags must be 0.
        check(OP, unsafe {
            (vmm.cuMemAddressReserve)(&mut base, len, granularity, 0, 0)
        })?;
        tracing::debug!(
            base = format_args!("{base:#x}"),
            len,
            "address range reserved"
        );
        Ok(Self {
            inner: Arc::new(ReservationInner {
                ctx: ctx.clone(),
                vmm,
                base,
                len,
            }),
        })
    }
}

impl VirtualReservation for CudaVirtualReservation {
    fn base(&self) -> u64 {
        self.inner.base
    }
    fn len(&self) -> usize {
        self.inner.len
    }
}

#[derive(Debug)]
struct PhysicalInner {
    ctx: Arc<ContextInner>,
    vmm: &'static sys::Vmm,
    handle: sys::CuMemHandle,
    len: usize,
    gpu_direct_rdma_capable: bool,
}

impl Drop for PhysicalInner {
    fn drop(&mut self) {
        let _current = self.ctx.enter_logged();
        // SAFETY: the handle came from cuMemCreate and is released once,
        // here, after every mapping of it was unmapped (each holds `self`).
        check_logged("cuMemRelease", unsafe {
            (self.vmm.cuMemRelease)(self.handle)
        });
    }
}

/// Physical device memory (`cuMemCreate`), released when this handle and
/// every mapping of it are dropped.
#[derive(Debug)]
pub struct CudaPhysicalMemory {
    inner: Arc<PhysicalInner>,
}

impl CudaPhysicalMemory {
    pub(crate) fn new(ctx: &Arc<ContextInner>, len: usize, gpu_direct_rdma: bool) -> Result<Self> {
        const OP: &str = "cuMemCreate";
        let vmm = vmm(ctx, OP)?;
        check_granular(ctx, OP, len)?;
        let _current = ctx.enter()?;
        let prop = properties(ctx, gpu_direct_rdma);
        let mut handle: sys::CuMemHandle = 0;
        // SAFETY: `handle` is a valid out-pointer, `prop` has cuda.h's layout
        // and lives across the call; flags must be 0.
        check(OP, unsafe { (vmm.cuMemCreate)(&mut handle, len, &prop, 0) })?;
        Ok(Self {
            inner: Arc::new(PhysicalInner {
                ctx: ctx.clone(),
                vmm,
                handle,
                len,
                gpu_direct_rdma_capable: prop.allocFlags.gpuDirectRDMACapable != 0,
            }),
        })
    }
}

impl PhysicalMemory for CudaPhysicalMemory {
    fn len(&self) -> usize {
        self.inner.len
    }
    fn gpu_direct_rdma_capable(&self) -> bool {
        self.inner.gpu_direct_rdma_capable
    }
}

/// Physical memory mapped into a reservation (`cuMemMap`), readable and
/// writable by the context's device (`cuMemSetAccess`); unmapped on drop.
/// It keeps both the reservation and the physical memory alive.
#[derive(Debug)]
pub struct CudaVirtualMapping {
    ctx: Arc<ContextInner>,
    vmm: &'static sys::Vmm,
    ptr: u64,
    len: usize,
    _reservation: Arc<ReservationInner>,
    _physical: Arc<PhysicalInner>,
}

impl CudaVirtualMapping {
    pub(crate) fn new(
        ctx: &Arc<ContextInner>,
        reservation: &CudaVirtualReservation,
        offset: usize,
        physical: &CudaPhysicalMemory,
    ) -> Result<Self> {
        const OP: &str = "cuMemMap";
        let vmm = vmm(ctx, OP)?;
        let len = physical.inner.len;
        let fits = offset
            .checked_add(len)
            .is_some_and(|end| end <= reservation.inner.len);
        if !fits {
            return Err(CudaError::invalid(
                OP,
                format!(
                    "{len} bytes at offset {offset} do not fit the reservation of {} bytes",
                    reservation.inner.len
                ),
            ));
        }
        let granularity = check_granular(ctx, OP, len)?;
        if !offset.is_multiple_of(granularity) {
            return Err(CudaError::invalid(
                OP,
                format!("offset {offset} is not a multiple of the granularity ({granularity})"),
            ));
        }
        let ptr = reservation.inner.base + offset as u64;
        let _current = ctx.enter()?;
        // SAFETY: `ptr..ptr+len` lies inside a live reservation (checked
        // above) and the handle is a live physical allocation of `len` bytes;
        // offset into it and flags must be 0. The driver refuses a range
        // that is mapped already.
        check(OP, unsafe {
            (vmm.cuMemMap)(ptr, len, 0, physical.inner.handle, 0)
        })?;
        // From here on, dropping `mapping` unmaps.
        let mapping = Self {
            ctx: ctx.clone(),
            vmm,
            ptr,
            len,
            _reservation: reservation.inner.clone(),
            _physical: physical.inner.clone(),
        };
        let access = sys::CuMemAccessDesc {
            location: location(ctx),
            flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range was just mapped; `access` is one descriptor with
        // cuda.h's layout, alive across the call.
        check("cuMemSetAccess", unsafe {
            (vmm.cuMemSetAccess)(ptr, len, &access, 1)
        })?;
        tracing::debug!(
            ptr = format_args!("{ptr:#x}"),
            len,
            "physical memory mapped"
        );
        Ok(mapping)
    }
}

impl VirtualMapping for CudaVirtualMapping {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for CudaVirtualMapping {
    fn drop(&mut self) {
        let _current = self.ctx.enter_logged();
        // SAFETY: the range was mapped by cuMemMap in `new` and is unmapped
        // once, here; the reservation and the physical memory are still
        // alive (held by `self`).
        check_logged("cuMemUnmap", unsafe {
            (self.vmm.cuMemUnmap)(self.ptr, self.len)
        });
    }
}
