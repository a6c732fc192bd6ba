//! The real CUDA backend: libcuda opened at run time with `libloading`, its
//! entry points resolved into function pointers of our own types
//! (the `sys` module), and a `Result` layer here. The driver's
//! types and constants are cudarc's (`cudarc::driver::sys`); none of
//! cudarc's functions is called.
//!
//! What this layer guarantees:
//! - no return code is read as a Rust enum: every entry point returns the
//!   raw `CUresult` as an integer, so a code a newer driver adds cannot be
//!   undefined behaviour; a failed code becomes a [`CudaError`] through
//!   [`CudaError::from_code`] (no driver call is made to print an error);
//! - every symbol is resolved when the library is opened: a missing required
//!   one is [`CudaError::LibraryUnavailable`] naming it, a missing optional
//!   one (dma-buf export, the RDMA flush, the VMM API) makes the operations
//!   that need it [`CudaError::NotSupported`]; nothing panics, and nothing is
//!   looked up lazily;
//! - the calling thread's current context is left as the caller had it:
//!   every call that needs a context pushes its own (when it is not already
//!   current) and pops it afterwards, `Drop` included, so an inference
//!   runtime's current device never changes under it;
//! - every handle keeps the primary context it was made in alive (an `Arc`);
//!   `Drop` never panics and logs a failure with `tracing::warn!`.
//!
//! Output parameters are read as plain integers, never as Rust enums.

mod context;
mod memory;
mod stream;
mod sys;
mod vmm;

use std::os::raw::{c_char, c_int};
use std::sync::Arc;

use crate::api::{Api, Driver};
use crate::error::{CudaError, Result};
use crate::types::{DeviceAttributes, FlushWritesOptions, WritesOrdering};

pub use context::CudaContext;
pub use memory::{CudaDeviceMemory, CudaHostRegistration, CudaIpcMapping, CudaPinnedHostMemory};
pub use stream::{CudaEvent, CudaStream};
pub use sys::{CuContext, CuStream};
pub use vmm::{CudaPhysicalMemory, CudaVirtualMapping, CudaVirtualReservation};

use sys::consts as C;

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
    type VirtualReservation = CudaVirtualReservation;
    type PhysicalMemory = CudaPhysicalMemory;
    type VirtualMapping = CudaVirtualMapping;
}

/// Turns a raw `CUresult` into a `Result`.
pub(crate) fn check(operation: &'static str, code: sys::CuResult) -> Result<()> {
    match code {
        C::CUDA_SUCCESS => Ok(()),
        code => Err(CudaError::from_code(operation, code)),
    }
}

/// For `Drop`: logs a failed code instead of returning it.
pub(crate) fn check_logged(operation: &'static str, code: sys::CuResult) {
    if let Err(error) = check(operation, code) {
        tracing::warn!(%error, "{operation} failed while releasing a CUDA object");
    }
}

/// The host page size.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the process; no memory is touched.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as u64 } else { 4096 }
}

/// The calling thread's current context (`cuCtxGetCurrent`; null for none),
/// for callers and tests checking that gdr left it alone.
pub fn current_context() -> Result<CuContext> {
    let drv = sys::driver()?;
    let mut raw: sys::CuCtx = std::ptr::null_mut();
    // SAFETY: `raw` is a valid out-pointer.
    check("cuCtxGetCurrent", unsafe {
        (drv.req.cuCtxGetCurrent)(&mut raw)
    })?;
    Ok(raw.cast())
}

/// The driver entry points every load resolves: a library lacking any one
/// of them is [`CudaError::LibraryUnavailable`], naming it.
pub const REQUIRED_SYMBOLS: &[&str] = sys::Required::SYMBOLS;

/// The loaded CUDA driver.
#[derive(Debug, Clone)]
pub struct CudaDriver {
    drv: &'static sys::Driver,
}

impl CudaDriver {
    /// Opens libcuda, resolves every entry point gdr uses, and initialises
    /// the driver (`cuInit`).
    ///
    /// Without libcuda, or with a library lacking a required entry point,
    /// this is [`CudaError::LibraryUnavailable`], never a panic; with CUDA's
    /// stub library (`CUDA_ERROR_STUB_LIBRARY`) too.
    pub fn load() -> Result<CudaDriver> {
        let _span = tracing::debug_span!("cuda_load").entered();
        let drv = sys::driver()?;
        // SAFETY: cuInit takes a flags word that must be 0.
        match check("cuInit", unsafe { (drv.req.cuInit)(0) }) {
            Ok(()) => {}
            Err(CudaError::Driver {
                code: C::CUDA_ERROR_STUB_LIBRARY,
                ..
            }) => {
                return Err(CudaError::LibraryUnavailable {
                    library: drv.library,
                    reason: "the library found is CUDA's stub, not a driver".into(),
                });
            }
            Err(e) => return Err(e),
        }
        let mut version: c_int = 0;
        // SAFETY: `version` is a valid out-pointer.
        check("cuDriverGetVersion", unsafe {
            (drv.req.cuDriverGetVersion)(&mut version)
        })?;
        tracing::debug!(
            library = drv.library,
            version,
            dmabuf_export = drv.dmabuf.is_some(),
            flush_rdma_writes = drv.flush.is_some(),
            vmm = drv.vmm.is_some(),
            "libcuda loaded"
        );
        Ok(CudaDriver { drv })
    }

    /// `cuDriverGetVersion`: e.g. 13000 for CUDA 13.0.
    pub fn driver_version(&self) -> Result<i32> {
        let mut version: c_int = 0;
        // SAFETY: `version` is a valid out-pointer.
        check("cuDriverGetVersion", unsafe {
            (self.drv.req.cuDriverGetVersion)(&mut version)
        })?;
        Ok(version)
    }

    fn device(&self, ordinal: u32) -> Result<sys::CuDevice> {
        let count = self.device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice {
                detail: format!("ordinal {ordinal} asked for, {count} device(s) present"),
            });
        }
        let mut dev: sys::CuDevice = 0;
        // SAFETY: `dev` is a valid out-pointer; the ordinal is in range.
        check("cuDeviceGet", unsafe {
            (self.drv.req.cuDeviceGet)(&mut dev, ordinal as c_int)
        })?;
        Ok(dev)
    }

    fn attribute(&self, dev: sys::CuDevice, attribute: c_int) -> Result<i32> {
        attribute_of(self.drv, dev, attribute)
    }

    /// An attribute an older driver may not know: 0 (with a debug line) when
    /// it is refused.
    fn optional_attribute(&self, dev: sys::CuDevice, attribute: c_int) -> i32 {
        self.attribute(dev, attribute).unwrap_or_else(|error| {
            tracing::debug!(attribute, %error, "device attribute unavailable, taken as 0");
            0
        })
    }
}

pub(crate) fn attribute_of(drv: &sys::Driver, dev: sys::CuDevice, attribute: c_int) -> Result<i32> {
    let mut value: c_int = 0;
    // SAFETY: `value` is a valid out-pointer and `dev` a device handle; an
    // attribute number the driver does not know is refused with a code.
    check("cuDeviceGetAttribute", unsafe {
        (drv.req.cuDeviceGetAttribute)(&mut value, attribute, dev)
    })?;
    Ok(value)
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
        check("cuDeviceGetCount", unsafe {
            (self.drv.req.cuDeviceGetCount)(&mut count)
        })?;
        if count <= 0 {
            return Err(CudaError::NoDevice {
                detail: "the driver reports 0 devices".into(),
            });
        }
        Ok(count as u32)
    }

    fn device_attributes(&self, ordinal: u32) -> Result<DeviceAttributes> {
        let dev = self.device(ordinal)?;
        let req = &self.drv.req;

        let mut name: [c_char; 256] = [0; 256];
        // SAFETY: `name` holds `len` writable bytes; the driver NUL-terminates.
        check("cuDeviceGetName", unsafe {
            (req.cuDeviceGetName)(name.as_mut_ptr(), name.len() as c_int, dev)
        })?;
        let mut bus: [c_char; 64] = [0; 64];
        // SAFETY: as above, for the bus id.
        check("cuDeviceGetPCIBusId", unsafe {
            (req.cuDeviceGetPCIBusId)(bus.as_mut_ptr(), bus.len() as c_int, dev)
        })?;
        let mut total: usize = 0;
        // SAFETY: `total` is a valid out-pointer.
        check("cuDeviceTotalMem", unsafe {
            (req.cuDeviceTotalMem_v2)(&mut total, dev)
        })?;
        let major = self.attribute(dev, C::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = self.attribute(dev, C::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let opt = |a| self.optional_attribute(dev, a);

        Ok(DeviceAttributes {
            ordinal,
            name: c_string(&name),
            pci_bus_id: normalize_pci_bus_id(&c_string(&bus)),
            total_memory: total as u64,
            compute_capability: (major.max(0) as u32, minor.max(0) as u32),
            dma_buf_supported: opt(C::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) != 0,
            gpu_direct_rdma_supported: opt(C::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED) != 0,
            flush_writes_options: FlushWritesOptions::from_bits_truncate(opt(
                C::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS,
            ) as u32),
            writes_ordering: WritesOrdering::from_native(opt(
                C::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
            )),
            virtual_memory_management: self.drv.vmm.is_some()
                && opt(C::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) != 0,
        })
    }

    fn context(&self, ordinal: u32) -> Result<CudaContext> {
        let dev = self.device(ordinal)?;
        let mut raw: sys::CuCtx = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer and `dev` a device handle;
        // the retain is balanced by the release in `ContextInner::drop`.
        // Retaining does not make the context current.
        check("cuDevicePrimaryCtxRetain", unsafe {
            (self.drv.req.cuDevicePrimaryCtxRetain)(&mut raw, dev)
        })?;
        let inner = context::ContextInner {
            raw,
            dev,
            ordinal,
            drv: self.drv,
        };
        Ok(CudaContext {
            inner: Arc::new(inner),
        })
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

    /// Why `line` calls the driver through cudarc or reads a driver's
    /// integer as a cudarc enum; `None` when it does neither. cudarc's types
    /// and constants are allowed: only `cudarc::driver::sys` may be named,
    /// none of its functions (`cu` + upper case) may be named by path or
    /// called, its library accessors not touched, and its result enum appear
    /// only as `<enum>::<CONSTANT> as <integer>`.
    fn forbidden_use(line: &str) -> Option<String> {
        let line = &code_only(line);
        // Built from pieces so this file does not match itself.
        let crate_name = ["cud", "arc"].concat();
        let allowed_path = crate_name.clone() + "::driver::sys";
        let substrings = [
            ["cul", "ib("].concat(),
            ["lib()", "."].concat(),
            ["sys::", "lib("].concat(),
            ["catch_", "unwind"].concat(),
            ["trans", "mute"].concat(),
            ["Driver", "Error"].concat(),
            ["-> ", "CU"].concat(),
            ["-> ", "cu::"].concat(),
            ["-> ", "cud"].concat(),
        ];
        for pattern in &substrings {
            if line.contains(pattern.as_str()) {
                return Some(format!("`{pattern}`"));
            }
        }
        let bytes = line.as_bytes();
        let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        for (at, _) in line.match_indices(crate_name.as_str()) {
            let end = at + crate_name.len();
            let token =
                (at == 0 || !ident(bytes[at - 1])) && !bytes.get(end).is_some_and(|&b| ident(b));
            if token && !line[at..].starts_with(&allowed_path) {
                return Some(format!("`{crate_name}` other than `{allowed_path}`"));
            }
        }
        let mut at = 0;
        while let Some(found) = line[at..].find("cu") {
            let start = at + found;
            at = start + 2;
            // A token `cu` + upper case: the name of a driver function.
            if start > 0 && ident(bytes[start - 1]) {
                continue;
            }
            if !bytes.get(start + 2).is_some_and(u8::is_ascii_uppercase) {
                continue;
            }
            let end = start + line[start..].bytes().take_while(|&b| ident(b)).count();
            let name = &line[start..end];
            let before = line[..start].trim_end();
            let after = line[end..].trim_start();
            if before.ends_with("::") {
                return Some(format!("`{name}` named by path"));
            }
            // Our own table's pointers are called as `(table.cuName)(..)`.
            if !before.ends_with('.') && (after.starts_with('(') || after.starts_with("::<")) {
                return Some(format!("`{name}` called"));
            }
        }
        for result in [["CU", "result"].concat(), ["cuda", "Error_enum"].concat()] {
            for (at, _) in line.match_indices(result.as_str()) {
                let rest = &line[at + result.len()..];
                let constant = rest.strip_prefix("::").map(|r| {
                    let n = r.bytes().take_while(|&b| ident(b) || b == b'$').count();
                    &r[n..]
                });
                // Or imported: `use ...::{CUresult, ...}`.
                let imported = rest.trim_start().starts_with([',', '}', ';']);
                if !imported && !constant.is_some_and(|r| r.starts_with(" as ")) {
                    return Some(format!("`{result}` used other than as a constant"));
                }
            }
        }
        None
    }

    /// `line` with the contents of its string literals removed (quotes
    /// kept): messages and symbol names call nothing.
    fn code_only(line: &str) -> String {
        let mut out = String::with_capacity(line.len());
        let mut in_string = false;
        let mut escaped = false;
        let mut previous = ' ';
        for c in line.chars() {
            if in_string {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == '"' {
                    in_string = false;
                    out.push(c);
                }
            } else {
                // `'"'` is a character, not the start of a string.
                if c == '"' && previous != '\'' {
                    in_string = true;
                }
                out.push(c);
            }
            previous = c;
        }
        out
    }

    /// Structural evidence for issue 8: cudarc supplies the driver's types
    /// and constants, but no driver call goes through cudarc's typed
    /// function pointers (whose `CUresult` return is a Rust enum) or its
    /// safe API, no driver integer is read as a cudarc enum, and
    /// `catch_unwind` is not the guard against missing symbols. Every source
    /// file of the crate (and its benches) is scanned.
    #[test]
    fn no_driver_call_goes_through_typed_bindings() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = Vec::new();
        let mut dirs = vec![root.join("src"), root.join("benches")];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    files.push(path);
                }
            }
        }
        assert!(files.len() >= 8, "scanned only {files:?}");
        let mut hits = Vec::new();
        let mut uses_types = false;
        for file in &files {
            let text = std::fs::read_to_string(file).unwrap();
            for (n, line) in text.lines().enumerate() {
                if line.trim_start().starts_with("//") {
                    continue; // comments call nothing
                }
                uses_types |= line.contains(&(["cud", "arc"].concat() + "::driver::sys"));
                if let Some(why) = forbidden_use(line) {
                    hits.push(format!("{}:{}: {why}: {line}", file.display(), n + 1));
                }
            }
        }
        assert!(
            hits.is_empty(),
            "typed binding calls remain:\n{}",
            hits.join("\n")
        );
        assert!(uses_types, "the driver's types are expected from cudarc");
    }

    /// The scanner tells cudarc's types and constants from its functions.
    #[test]
    fn the_scanner_allows_types_and_constants_only() {
        let k = ["cud", "arc"].concat();
        let allowed = [
            format!("use {k}::driver::sys as cu;"),
            format!("let p: {k}::driver::sys::CUdeviceptr = 0;"),
            format!("X = {k}::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_X as c_int;"),
            ["const A: u32 = CU", "result::CUDA_SUCCESS as u32;"].concat(),
            ["(drv.req.cu", "Init)(0)"].concat(),
            ["check(\"cu", "Init\", x)"].concat(),
            ["cu", "Init: fn(c_uint);"].concat(),
            ["format!(\"{op}: (CU", "result {code})\")"].concat(),
            "let c: sys::CuCtx = cu::CUcontext::default();".into(),
            format!("use {k}::driver::sys::{{CU{}, CUstream}};", "result"),
            format!("fn local_tables_agree_with_{k}() {{"),
        ];
        for line in &allowed {
            assert_eq!(forbidden_use(line), None, "{line}");
        }
        let forbidden = [
            format!("unsafe {{ {k}::driver::sys::cu{}(0) }};", "Init"),
            format!("{k}::driver::result::init()"),
            format!("let c = {k}::driver::Cuda{}::new(0);", "Context"),
            format!("use {k}::driver::{{Cuda{}, sys}};", "Context"),
            format!("use {k} as c;"),
            format!("use ::{k}::driver::safe;"),
            ["let f = cu::cu", "Init;"].concat(),
            ["cu", "Init(0);"].concat(),
            ["sys::cu", "lib().cu", "Init(0)"].concat(),
            ["cu::", "lib().x"].concat(),
            ["type F = unsafe extern \"C\" fn() -> CU", "result;"].concat(),
            ["match r { CU", "result::CUDA_SUCCESS => {} }"].concat(),
            ["let r: CU", "result = x;"].concat(),
            ["std::mem::trans", "mute::<u32, T>(x)"].concat(),
        ];
        for line in &forbidden {
            assert!(forbidden_use(line).is_some(), "not caught: {line}");
        }
    }

    /// The integers gdr's own tables use (error names, sticky codes, the
    /// bit flags and orderings of `types`, which the simulation needs
    /// without cudarc) are cuda.h's, as cudarc's bindings give them.
    #[test]
    fn local_tables_agree_with_the_bindings() {
        use cudarc::driver::sys::{
            CUGPUDirectRDMAWritesOrdering as Ordering, CUflushGPUDirectRDMAWritesOptions as Opt,
            CUflushGPUDirectRDMAWritesScope as Scope, CUresult,
        };

        use crate::error::{STICKY_CODES, result_name};
        use crate::types::{FlushWritesOptions, HostRegisterFlags};

        macro_rules! named {
            ($($name:ident),* $(,)?) => {
                [$((CUresult::$name as u32, stringify!($name))),*]
            };
        }
        for (code, name) in named![
            CUDA_SUCCESS,
            CUDA_ERROR_INVALID_VALUE,
            CUDA_ERROR_OUT_OF_MEMORY,
            CUDA_ERROR_NOT_INITIALIZED,
            CUDA_ERROR_DEINITIALIZED,
            CUDA_ERROR_STUB_LIBRARY,
            // CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER (36) is newer than
            // cudarc's cuda-12080 bindings: named locally only.
            CUDA_ERROR_DEVICE_UNAVAILABLE,
            CUDA_ERROR_NO_DEVICE,
            CUDA_ERROR_INVALID_DEVICE,
            CUDA_ERROR_INVALID_CONTEXT,
            CUDA_ERROR_ECC_UNCORRECTABLE,
            CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
            CUDA_ERROR_NVLINK_UNCORRECTABLE,
            CUDA_ERROR_INVALID_HANDLE,
            CUDA_ERROR_NOT_READY,
            CUDA_ERROR_ILLEGAL_ADDRESS,
            CUDA_ERROR_LAUNCH_TIMEOUT,
            CUDA_ERROR_LAUNCH_FAILED,
            CUDA_ERROR_NOT_PERMITTED,
            CUDA_ERROR_NOT_SUPPORTED,
            CUDA_ERROR_UNKNOWN,
        ] {
            assert_eq!(result_name(code), name, "code {code}");
        }
        for (code, name) in named![
            CUDA_ERROR_ILLEGAL_ADDRESS,
            CUDA_ERROR_LAUNCH_TIMEOUT,
            CUDA_ERROR_ASSERT,
            CUDA_ERROR_HARDWARE_STACK_ERROR,
            CUDA_ERROR_ILLEGAL_INSTRUCTION,
            CUDA_ERROR_MISALIGNED_ADDRESS,
            CUDA_ERROR_INVALID_ADDRESS_SPACE,
            CUDA_ERROR_INVALID_PC,
            CUDA_ERROR_LAUNCH_FAILED,
        ] {
            assert!(STICKY_CODES.contains(&code), "{name} ({code}) is sticky");
        }
        assert_eq!(
            FlushWritesOptions::HOST.bits(),
            Opt::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST as u32
        );
        assert_eq!(
            FlushWritesOptions::MEMOPS.bits(),
            Opt::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_MEMOPS as u32
        );
        assert_eq!(
            WritesOrdering::from_native(Ordering::CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER as i32),
            WritesOrdering::Owner
        );
        assert_eq!(
            WritesOrdering::from_native(
                Ordering::CU_GPU_DIRECT_RDMA_WRITES_ORDERING_ALL_DEVICES as i32
            ),
            WritesOrdering::AllDevices
        );
        assert_eq!(
            WritesOrdering::from_native(Ordering::CU_GPU_DIRECT_RDMA_WRITES_ORDERING_NONE as i32),
            WritesOrdering::None
        );
        assert_eq!(
            C::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
            Scope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER as c_int
        );
        assert_eq!(
            HostRegisterFlags::PORTABLE.bits(),
            cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE
        );
        assert_eq!(
            HostRegisterFlags::DEVICEMAP.bits(),
            cudarc::driver::sys::CU_MEMHOSTREGISTER_DEVICEMAP
        );
        assert_eq!(
            HostRegisterFlags::IOMEMORY.bits(),
            cudarc::driver::sys::CU_MEMHOSTREGISTER_IOMEMORY
        );
        assert_eq!(
            HostRegisterFlags::READ_ONLY.bits(),
            cudarc::driver::sys::CU_MEMHOSTREGISTER_READ_ONLY
        );
    }
}
