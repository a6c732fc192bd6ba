//! The real CUDA backend: libcuda loaded at run time through cudarc's raw
//! `driver::sys` layer (`dynamic-loading`), with its own `Result` layer here.
//!
//! What this layer guarantees on top of cudarc:
//! - no panic reaches a caller: libcuda's presence is probed before the
//!   first call ([`CudaDriver::load`](crate::cuda::CudaDriver::load) returns
//!   [`CudaError::LibraryUnavailable`]), optional entry points are looked up
//!   in the loaded library before use ([`CudaError::NotSupported`]), and every
//!   driver call runs under `catch_unwind` anyway;
//! - a failed `CUresult` becomes a [`CudaError`] through
//!   [`CudaError::from_code`] on the raw code (printing a cudarc `DriverError`
//!   would call `cuGetErrorString`, itself a driver call);
//! - every handle keeps the primary context it was made in alive (an `Arc`)
//!   and binds it to the calling thread before each driver call, its `Drop`
//!   included; `Drop` never panics and logs a failure with `tracing::warn!`.
//!
//! Output parameters are read as plain integers, never as cudarc's Rust enums,
//! so a value a newer driver adds cannot become an invalid enum.

mod context;
mod memory;
mod stream;

use std::os::raw::{c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cudarc::driver::sys;

use crate::api::{Api, Driver};
use crate::error::{CudaError, Result};
use crate::types::{DeviceAttributes, FlushWritesOptions, WritesOrdering};

pub use context::CudaContext;
pub use memory::{CudaDeviceMemory, CudaHostRegistration, CudaIpcMapping, CudaPinnedHostMemory};
pub use stream::{CudaEvent, CudaStream};

/// The library name reported in [`CudaError::LibraryUnavailable`].
const LIBRARY: &str = "libcuda.so.1";

/// The real backend's handle types.
#[derive(Debug)]
pub struct CudaApi;

impl Api for CudaApi {
    type Driver = CudaDriver;
    type Context = CudaContext;
    type Stream = CudaStream;
    type Event = CudaEvent;
    type DeviceMemory = CudaDeviceMemory;
    type PinnedHostMemory = CudaPinnedHostMemory;
    type HostRegistration = CudaHostRegistration;
    type IpcMapping = CudaIpcMapping;
}

/// Runs one raw driver call. A panic inside cudarc (a symbol the driver
/// lacks) becomes [`CudaError::LibraryUnavailable`]; a failed `CUresult`
/// becomes the error [`CudaError::from_code`] names.
pub(crate) fn call(operation: &'static str, f: impl FnOnce() -> sys::CUresult) -> Result<()> {
    match raw_call(operation, f)? {
        0 => Ok(()),
        code => Err(CudaError::from_code(operation, code)),
    }
}

/// Like [`call`], but hands back the raw code (for calls where a non-zero code
/// is an answer, e.g. `CUDA_ERROR_NOT_READY` from a query).
pub(crate) fn raw_call(operation: &'static str, f: impl FnOnce() -> sys::CUresult) -> Result<u32> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(code) => Ok(code as u32),
        Err(payload) => {
            let detail = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("panic");
            Err(CudaError::LibraryUnavailable {
                library: LIBRARY,
                reason: format!("{operation}: {detail}"),
            })
        }
    }
}

/// For `Drop`: runs a call and logs a failure instead of returning it.
pub(crate) fn call_logged(operation: &'static str, f: impl FnOnce() -> sys::CUresult) {
    if let Err(error) = call(operation, f) {
        tracing::warn!(%error, "{operation} failed while releasing a CUDA object");
    }
}

/// Whether the loaded libcuda exports `name`. Calling a symbol the driver
/// lacks through cudarc panics, so optional entry points are probed first.
fn has_symbol(name: &str) -> bool {
    catch_unwind(|| {
        // SAFETY: only called after `is_culib_present` succeeded (a
        // `CudaDriver` exists), so `culib()` opens the library instead of
        // panicking; looking a symbol up runs no code of the library, and the
        // symbol is dropped at once without being called.
        unsafe {
            sys::culib()
                .get::<unsafe extern "C" fn()>(name.as_bytes())
                .is_ok()
        }
    })
    .unwrap_or(false)
}

/// Optional driver entry points, probed once at load.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Symbols {
    /// `cuMemGetHandleForAddressRange` (CUDA 11.7+).
    pub(crate) dmabuf_export: bool,
    /// `cuFlushGPUDirectRDMAWrites` (CUDA 11.3+).
    pub(crate) flush_rdma_writes: bool,
}

/// The host page size.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the process; no memory is touched.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as u64 } else { 4096 }
}

/// The loaded CUDA driver.
#[derive(Debug, Clone)]
pub struct CudaDriver {
    symbols: Symbols,
}

impl CudaDriver {
    /// Loads libcuda and initialises the driver (`cuInit`).
    ///
    /// Without libcuda this is [`CudaError::LibraryUnavailable`], never a
    /// panic; with a stub library (`CUDA_ERROR_STUB_LIBRARY`) too.
    pub fn load() -> Result<CudaDriver> {
        let _span = tracing::debug_span!("cuda_load").entered();
        let present = catch_unwind(|| {
            // SAFETY: this only tries to dlopen the candidate names of libcuda
            // and closes what it opened; libcuda's initialisers are the
            // driver's own and safe to run.
            unsafe { sys::is_culib_present() }
        })
        .unwrap_or(false);
        if !present {
            return Err(CudaError::LibraryUnavailable {
                library: LIBRARY,
                reason: "no libcuda could be opened (is the NVIDIA driver installed?)".into(),
            });
        }
        // SAFETY: cuInit takes a flags word that must be 0.
        match call("cuInit", || unsafe { sys::cuInit(0) }) {
            Ok(()) => {}
            Err(CudaError::Driver { code: 34, .. }) => {
                return Err(CudaError::LibraryUnavailable {
                    library: LIBRARY,
                    reason: "the library found is CUDA's stub, not a driver".into(),
                });
            }
            Err(e) => return Err(e),
        }
        let symbols = Symbols {
            dmabuf_export: has_symbol("cuMemGetHandleForAddressRange"),
            flush_rdma_writes: has_symbol("cuFlushGPUDirectRDMAWrites"),
        };
        tracing::debug!(?symbols, "libcuda loaded");
        Ok(CudaDriver { symbols })
    }

    fn device(&self, ordinal: u32) -> Result<sys::CUdevice> {
        let count = self.device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice {
                detail: format!("ordinal {ordinal} asked for, {count} device(s) present"),
            });
        }
        let mut dev: sys::CUdevice = 0;
        // SAFETY: `dev` is a valid out-pointer; the ordinal is in range.
        call("cuDeviceGet", || unsafe {
            sys::cuDeviceGet(&mut dev, ordinal as c_int)
        })?;
        Ok(dev)
    }

    fn attribute(dev: sys::CUdevice, attribute: sys::CUdevice_attribute) -> Result<i32> {
        let mut value: c_int = 0;
        // SAFETY: `value` is a valid out-pointer and `dev` a device handle.
        call("cuDeviceGetAttribute", || unsafe {
            sys::cuDeviceGetAttribute(&mut value, attribute, dev)
        })?;
        Ok(value)
    }

    /// An attribute an older driver may not know: 0 (with a debug line) when
    /// it is refused.
    fn optional_attribute(dev: sys::CUdevice, attribute: sys::CUdevice_attribute) -> i32 {
        Self::attribute(dev, attribute).unwrap_or_else(|error| {
            tracing::debug!(?attribute, %error, "device attribute unavailable, taken as 0");
            0
        })
    }
}

fn c_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `dddd:bb:dd.f`, lower case, whatever width the driver gives the domain.
fn normalize_pci_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => id,
    }
}

impl Driver<CudaApi> for CudaDriver {
    fn backend_name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> Result<u32> {
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer.
        call("cuDeviceGetCount", || unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        if count <= 0 {
            return Err(CudaError::NoDevice {
                detail: "the driver reports 0 devices".into(),
            });
        }
        Ok(count as u32)
    }

    fn device_attributes(&self, ordinal: u32) -> Result<DeviceAttributes> {
        use sys::CUdevice_attribute as A;
        let dev = self.device(ordinal)?;

        let mut name: [c_char; 256] = [0; 256];
        // SAFETY: `name` holds `len` writable bytes; the driver NUL-terminates.
        call("cuDeviceGetName", || unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev)
        })?;
        let mut bus: [c_char; 64] = [0; 64];
        // SAFETY: as above, for the bus id.
        call("cuDeviceGetPCIBusId", || unsafe {
            sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as c_int, dev)
        })?;
        let mut total: usize = 0;
        // SAFETY: `total` is a valid out-pointer.
        call("cuDeviceTotalMem", || unsafe {
            sys::cuDeviceTotalMem_v2(&mut total, dev)
        })?;
        let major = Self::attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = Self::attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let opt = |a| Self::optional_attribute(dev, a);

        Ok(DeviceAttributes {
            ordinal,
            name: c_string(&name),
            pci_bus_id: normalize_pci_bus_id(&c_string(&bus)),
            total_memory: total as u64,
            compute_capability: (major.max(0) as u32, minor.max(0) as u32),
            dma_buf_supported: opt(A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) != 0,
            gpu_direct_rdma_supported: opt(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED) != 0,
            flush_writes_options: FlushWritesOptions::from_bits_truncate(opt(
                A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS,
            ) as u32),
            writes_ordering: WritesOrdering::from_native(opt(
                A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
            )),
            virtual_memory_management: opt(
                A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            ) != 0,
        })
    }

    fn context(&self, ordinal: u32) -> Result<CudaContext> {
        let dev = self.device(ordinal)?;
        let mut raw: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer and `dev` a device handle;
        // the retain is balanced by the release in `ContextInner::drop`.
        call("cuDevicePrimaryCtxRetain", || unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut raw, dev)
        })?;
        let inner = context::ContextInner {
            raw,
            dev,
            ordinal,
            symbols: self.symbols,
        };
        let ctx = CudaContext {
            inner: Arc::new(inner),
        };
        ctx.inner.bind()?;
        Ok(ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_bus_ids_are_normalized() {
        assert_eq!(normalize_pci_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_pci_bus_id("0000:3B:00.0"), "0000:3b:00.0");
    }

    #[test]
    fn c_strings_stop_at_nul() {
        let buf: [c_char; 6] = [b'H' as c_char, b'2' as c_char, 0, b'x' as c_char, 0, 0];
        assert_eq!(c_string(&buf), "H2");
    }
}
