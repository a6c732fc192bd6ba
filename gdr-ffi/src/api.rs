//! The exported functions and the C types they take. Every function returns
//! a [`GdrResult`], runs behind the panic boundary (`ffi_boundary!`), checks every pointer and
//! handle it is given, and writes its outputs only on success. Thread
//! safety is stated per function; "any thread" means concurrent calls on
//! the same handles are safe.

use std::ffi::{CStr, c_char};
use std::sync::Arc;

use gdr_core::Rung;
use gdr_core::backend::BackendChoice;
use gdr_core::uri::BufferUri;
use gdr_core::{Buffer, Context, MemoryKind};

use crate::boundary::{Out, TextOut, ffi_boundary, text_arg};
use crate::handle::{Kind, Table};
use crate::result::{FfiError, GdrResult};

/// A context: the backends (RDMA verbs, CUDA) a process uses, chosen once.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrContext {
    /// Opaque; 0 is never a live context.
    pub id: u64,
}

/// A buffer of host or GPU memory.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrBuffer {
    /// Opaque; 0 is never a live buffer.
    pub id: u64,
}

/// Which backends a context uses.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdrBackend {
    /// `GDR_BACKEND=sim`, `real` or `auto` in the environment decides;
    /// unset: real.
    Default = 0,
    /// Real rdma-core and CUDA, or an error: never the simulation.
    Real = 1,
    /// The simulated NIC and GPU (tests, machines without hardware).
    Sim = 2,
    /// Real hardware where found, the simulation standing in for what is
    /// missing (e.g. a GPU machine without an RDMA NIC: real CUDA, the
    /// simulated NIC), each stand-in said by [`gdr_context_describe`].
    /// Asked for, never taken silently; such a context's simulated NIC
    /// reaches no other context.
    Auto = 3,
}

/// Options of [`gdr_context_new`]; NULL means all defaults.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrOptions {
    /// Which backends.
    pub backend: GdrBackend,
}

/// Memory kinds.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdrMemory {
    /// Ordinary (pageable) host memory.
    Host = 0,
    /// Page-locked host memory.
    Pinned = 1,
    /// GPU memory.
    Device = 2,
    /// CUDA managed memory (never registered).
    Managed = 3,
}

/// How a NIC reaches a GPU's memory (the registration ladder's rungs).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdrRung {
    /// GPUDirect RDMA through a dma-buf of the GPU memory.
    Dmabuf = 0,
    /// GPUDirect RDMA through nvidia-peermem.
    Peermem = 1,
    /// Through pinned host bounce buffers (no GPUDirect).
    Staging = 2,
    /// Host memory, registered as such (a region's rung; never a path's).
    Host = 3,
}

impl GdrRung {
    const ALL: [Self; 4] = [Self::Dmabuf, Self::Peermem, Self::Staging, Self::Host];

    fn name(self) -> &'static CStr {
        match self {
            Self::Dmabuf => c"dma-buf",
            Self::Peermem => c"peermem",
            Self::Staging => c"staging",
            Self::Host => c"host",
        }
    }
}

impl GdrMemory {
    const ALL: [Self; 4] = [Self::Host, Self::Pinned, Self::Device, Self::Managed];

    fn name(self) -> &'static CStr {
        match self {
            Self::Host => c"host",
            Self::Pinned => c"pinned",
            Self::Device => c"device",
            Self::Managed => c"managed",
        }
    }
}

/// The name of a rung (`GDR_RUNG_*`): "dma-buf", "peermem", "staging" or
/// "host"; "unknown rung" for any other number. A static string: never
/// freed. Any thread.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_rung_name(rung: u32) -> *const c_char {
    GdrRung::ALL
        .into_iter()
        .find(|r| *r as u32 == rung)
        .map_or(c"unknown rung", GdrRung::name)
        .as_ptr()
}

/// The name of a memory kind (`GDR_MEMORY_*`): "host", "pinned", "device"
/// or "managed"; "unknown memory kind" for any other number. A static
/// string: never freed. Any thread.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_memory_kind_name(memory: u32) -> *const c_char {
    GdrMemory::ALL
        .into_iter()
        .find(|m| *m as u32 == memory)
        .map_or(c"unknown memory kind", GdrMemory::name)
        .as_ptr()
}

/// What [`gdr_buffer_get_info`] reports.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrBufferInfo {
    /// First byte (a device address for GPU memory).
    pub addr: u64,
    /// Length in bytes.
    pub size: u64,
    /// Memory kind.
    pub memory: GdrMemory,
    /// The GPU for device and managed memory, else -1.
    pub device: i32,
}

crate::handle::c_handles!(GdrContext, GdrBuffer);

static CONTEXTS: Table<ContextObject> = Table::new(Kind::Context);
static BUFFERS: Table<BufferObject> = Table::new(Kind::Buffer);

pub(crate) struct ContextObject {
    pub(crate) context: Context,
}

/// A buffer and the context (handle) that made it.
pub(crate) struct BufferObject {
    pub(crate) context: u64,
    pub(crate) buffer: Buffer,
}

pub(crate) fn context(handle: GdrContext) -> Result<Arc<ContextObject>, FfiError> {
    CONTEXTS.get(handle.id)
}

pub(crate) fn buffer(handle: GdrBuffer) -> Result<Arc<BufferObject>, FfiError> {
    BUFFERS.get(handle.id)
}

/// Stores a new buffer of `context`; writes its handle to `out`.
///
/// # Safety
/// `out` was checked by [`Out::new`] and is valid for a write.
unsafe fn new_buffer(
    handle: GdrContext,
    buffer: Buffer,
    out: Out<GdrBuffer>,
) -> Result<(), FfiError> {
    let object = BufferObject {
        context: handle.id,
        buffer,
    };
    // SAFETY: `out` checked by Out::new; valid by the caller's contract.
    unsafe { BUFFERS.publish(Arc::new(object), out) }
}

/// The ABI version: major in the high 16 bits, minor in the low. A new
/// minor only adds; a new major breaks. Any thread.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_abi_version() -> u32 {
    crate::ABI_VERSION
}

/// Copies this thread's last error message (with the native code and
/// context; the result codes say less) into `buf` of `len` bytes,
/// NUL-terminated. `needed` (may be NULL) gets the bytes the message needs,
/// NUL included; `buf` may be NULL with `len` 0 to ask for that. With no
/// error yet on this thread the message is empty. Returns
/// `GDR_RESULT_BUFFER_TOO_SMALL` (nothing written to `buf`) when it does
/// not fit. Reading it does not clear it. Any thread (each has its own).
///
/// # Safety
/// `buf` must be valid for `len` bytes of writes, `needed` NULL or valid
/// for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_last_error_message(
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> GdrResult {
    let message = crate::boundary::last_error().unwrap_or_default();
    // (This one does not go through the boundary's recording: reading the
    // last error must not replace it.)
    let out = match TextOut::new(buf, len, needed) {
        Ok(out) => out,
        Err(e) => return e.result,
    };
    // SAFETY: the caller's contract.
    match unsafe { out.write(&message) } {
        Ok(()) => GdrResult::Ok,
        Err(e) => e.result,
    }
}

/// Creates a context with `options` (NULL: defaults) and writes its handle
/// to `out`. The simulation is used only when asked for, by the option or
/// `GDR_BACKEND=sim`: without hardware, a default context fails (with the
/// reason in the last error message). Any thread.
///
/// # Safety
/// `options` must be NULL or valid for a read; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_context_new(
    options: *const GdrOptions,
    out: *mut GdrContext,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        // SAFETY: the caller's contract.
        let choice = unsafe { backend_choice(options) }?;
        let context = Context::open(choice)?;
        // SAFETY: `out` checked by Out::new; valid by the caller's contract.
        unsafe { CONTEXTS.publish(Arc::new(ContextObject { context }), out) }
    }
}

/// The backend choice `options` (NULL: defaults) asks for: `GDR_BACKEND`
/// decides the default (unset: real).
///
/// # Safety
/// `options` must be NULL or valid for a read.
unsafe fn backend_choice(options: *const GdrOptions) -> Result<BackendChoice, FfiError> {
    let backend = if options.is_null() {
        GdrBackend::Default
    } else {
        if !options.is_aligned() {
            return Err(FfiError::invalid("options", "misaligned"));
        }
        // SAFETY: not NULL, aligned, valid by the caller's contract;
        // read as a u32 first, so an out-of-range value is refused
        // rather than read as the enum.
        let raw = unsafe { options.cast::<u32>().read() };
        match raw {
            0 => GdrBackend::Default,
            1 => GdrBackend::Real,
            2 => GdrBackend::Sim,
            3 => GdrBackend::Auto,
            other => {
                return Err(FfiError::invalid(
                    "options.backend",
                    format!("{other} is no backend"),
                ));
            }
        }
    };
    Ok(match backend {
        GdrBackend::Real => BackendChoice::Real,
        GdrBackend::Sim => BackendChoice::Sim,
        GdrBackend::Auto => BackendChoice::Auto,
        GdrBackend::Default => match std::env::var("GDR_BACKEND").as_deref() {
            Ok("sim") => BackendChoice::Sim,
            Ok("auto") => BackendChoice::Auto,
            Ok("real") | Err(std::env::VarError::NotPresent) => BackendChoice::Real,
            Ok(other) => {
                return Err(FfiError::invalid(
                    "GDR_BACKEND",
                    format!("{other:?} is not \"real\", \"sim\" or \"auto\""),
                ));
            }
            Err(e) => return Err(FfiError::invalid("GDR_BACKEND", e)),
        },
    })
}

/// Frees a context. Its buffers stay usable until freed (each keeps the
/// backends alive). Any thread; the handle is invalid afterwards.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_context_free(context: GdrContext) -> GdrResult {
    ffi_boundary! {
        CONTEXTS.remove(context.id)?;
        Ok(())
    }
}

/// Writes which backends the context uses, and why (each fallback and
/// missing library explained), as text. See [`gdr_last_error_message`]
/// for `buf`, `len` and `needed`. Any thread.
///
/// # Safety
/// As for [`gdr_last_error_message`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_context_describe(
    context: GdrContext,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> GdrResult {
    ffi_boundary! {
        let out = TextOut::new(buf, len, needed)?;
        let text = self::context(context)?.context.describe();
        // SAFETY: the caller's contract.
        unsafe { out.write(&text) }
    }
}

/// Writes the doctor's report (what `gdr info --json` prints) as JSON
/// text: the native libraries, the NVIDIA kernel modules, RDMA devices and
/// GPUs, PCIe distances, the rung each (NIC, GPU) pair takes with why each
/// higher rung does not work, and what to do about each "no". Its
/// top-level keys: `backends`, `libraries`, `nvidia`, `kernel_release`,
/// `memlock`, `rdma`, `gpus`, `topology`, `rungs`, `hints`.
///
/// The backends are chosen as [`gdr_context_new`] chooses them from
/// `options` (NULL: defaults), for this call only: no context is needed,
/// so it also says why a context cannot be made. A choice that cannot be
/// met is not an error here: the report says why in `backends.error`.
/// Each call gathers the report anew (and probes each GPU rung with a
/// loopback transfer: milliseconds on the simulation, more on hardware),
/// so pass a generous buffer (64 KiB, say) and, on
/// `GDR_RESULT_BUFFER_TOO_SMALL`, call again with the `needed` bytes (that
/// report's size: the next one may differ a little).
/// See [`gdr_last_error_message`] for `buf`, `len` and `needed`. Any
/// thread.
///
/// # Safety
/// `options` must be NULL or valid for a read; `buf` valid for `len` bytes
/// of writes; `needed` NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_doctor_report(
    options: *const GdrOptions,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> GdrResult {
    ffi_boundary! {
        let out = TextOut::new(buf, len, needed)?;
        // SAFETY: the caller's contract.
        let choice = unsafe { backend_choice(options) }?;
        let report = gdr_core::doctor::report(choice, &gdr_core::doctor::DoctorOptions::default());
        let json = report
            .to_json()
            .map_err(|e| FfiError::new(GdrResult::Other, e.to_string()))?;
        // SAFETY: the caller's contract.
        unsafe { out.write(&json) }
    }
}

/// Writes the number of GPUs and of RDMA devices (NICs) the context sees.
/// Either output may be NULL. Any thread.
///
/// # Safety
/// `gpus` and `nics` must each be NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_device_count(
    context: GdrContext,
    gpus: *mut u32,
    nics: *mut u32,
) -> GdrResult {
    ffi_boundary! {
        let gpus = (!gpus.is_null()).then(|| Out::new("gpus", gpus)).transpose()?;
        let nics = (!nics.is_null()).then(|| Out::new("nics", nics)).transpose()?;
        let context = self::context(context)?;
        let (gpu_count, nic_count) = (context.context.gpu_count(), context.context.nics().len() as u32);
        // SAFETY: checked by Out::new; valid by the caller's contract.
        unsafe {
            if let Some(out) = gpus {
                out.write(gpu_count);
            }
            if let Some(out) = nics {
                out.write(nic_count);
            }
        }
        Ok(())
    }
}

/// How NIC `nic` reaches GPU `gpu`'s memory: the rung gdr takes, probed
/// with a loopback self-check on first use (then remembered), and in
/// `why_not` (see [`gdr_last_error_message`] for `buf`, `len`, `needed`;
/// `why_not` may be NULL with `len` 0) why each higher rung does not work.
/// Any thread.
///
/// # Safety
/// `rung` valid for a write; `why_not` valid for `len` bytes of writes;
/// `needed` NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_path_rung(
    context: GdrContext,
    gpu: u32,
    nic: u32,
    rung: *mut GdrRung,
    why_not: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> GdrResult {
    ffi_boundary! {
        let rung = Out::new("rung", rung)?;
        let text = TextOut::new(why_not, len, needed)?;
        let facts = self::context(context)?.context.path(gpu, nic)?;
        let value = match facts.rung {
            Rung::Dmabuf => GdrRung::Dmabuf,
            Rung::Peermem => GdrRung::Peermem,
            Rung::Staging | Rung::HostMemory => GdrRung::Staging,
        };
        if !why_not.is_null() {
            // SAFETY: the caller's contract.
            unsafe { text.write(&facts.why_not.join("\n")) }?;
        }
        // SAFETY: checked by Out::new; valid by the caller's contract.
        unsafe { rung.write(value) };
        Ok(())
    }
}

/// Whether GPUDirect RDMA works for some (GPU, NIC) pair of the context
/// (probing each pair as [`gdr_path_rung`] does). Any thread.
///
/// # Safety
/// `available` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_gpudirect_available(
    context: GdrContext,
    available: *mut bool,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("available", available)?;
        let context = self::context(context)?;
        let backend = &context.context;
        let nics = backend.nics().len() as u32;
        let mut any = false;
        'pairs: for gpu in 0..backend.gpu_count() {
            for nic in 0..nics {
                if backend.path(gpu, nic)?.rung.is_gpu_direct() {
                    any = true;
                    break 'pairs;
                }
            }
        }
        // SAFETY: checked by Out::new; valid by the caller's contract.
        unsafe { out.write(any) };
        Ok(())
    }
}

/// Allocates `size` bytes of `memory` (host, pinned host, or device
/// memory of GPU `device`; `device` is ignored for host memory) and writes
/// the buffer's handle to `out`. Any thread. Memory that cannot be had
/// (the allocator or CUDA refuses the size) is
/// `GDR_RESULT_OUT_OF_RESOURCES`, nothing written to `out`.
///
/// # Safety
/// `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_buffer_alloc(
    context: GdrContext,
    memory: u32,
    device: u32,
    size: u64,
    out: *mut GdrBuffer,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        let owner = self::context(context)?;
        let buffer = match memory {
            0 => owner.context.alloc_host(size)?,
            1 => owner.context.alloc_pinned(size)?,
            2 => owner.context.alloc_device(device, size)?,
            3 => return Err(gdr_core::Unsupported::ManagedMemory.into()),
            other => return Err(FfiError::invalid("memory", format!("{other} is no memory kind"))),
        };
        // SAFETY: `out` checked; valid by the caller's contract.
        unsafe { new_buffer(context, buffer, out) }
    }
}

/// Wraps `size` bytes at `addr` that the caller owns (host memory, or
/// device memory by its device address) as a buffer; its kind is what
/// CUDA says of the address. Memory gdr must not write is wrapped with
/// [`gdr_buffer_wrap_read_only`]. Any thread.
///
/// # Safety
/// The range must stay mapped, and not be freed, until the buffer is freed
/// with [`gdr_buffer_free`] returning `GDR_RESULT_OK`; `out` valid for a
/// write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_buffer_wrap(
    context: GdrContext,
    addr: u64,
    size: u64,
    out: *mut GdrBuffer,
) -> GdrResult {
    // SAFETY: the caller's contract is this function's.
    unsafe { wrap_buffer(context, addr, size, out, false) }
}

/// Wraps `size` bytes at `addr` that the caller owns and that gdr must
/// never write (a constant table, a read-only mapping), as
/// [`gdr_buffer_wrap`] does. Its memory registrations have no local or
/// remote write access; a grant of it with write rights, a READ into it,
/// `gdr_buffer_copy_in` and a stream copy into it fail with
/// `GDR_RESULT_INVALID_ARGUMENT`, nothing written. Any thread.
///
/// # Safety
/// As for [`gdr_buffer_wrap`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_buffer_wrap_read_only(
    context: GdrContext,
    addr: u64,
    size: u64,
    out: *mut GdrBuffer,
) -> GdrResult {
    // SAFETY: the caller's contract is this function's.
    unsafe { wrap_buffer(context, addr, size, out, true) }
}

/// [`gdr_buffer_wrap`] (`read_only` false) and
/// [`gdr_buffer_wrap_read_only`].
///
/// # Safety
/// As for [`gdr_buffer_wrap`].
unsafe fn wrap_buffer(
    context: GdrContext,
    addr: u64,
    size: u64,
    out: *mut GdrBuffer,
    read_only: bool,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        if addr == 0 {
            return Err(FfiError::invalid("addr", "NULL"));
        }
        let owner = self::context(context)?;
        // SAFETY: the caller's contract is wrap's.
        let buffer = unsafe {
            if read_only {
                owner.context.wrap_read_only(addr, size)
            } else {
                owner.context.wrap(addr, size)
            }
        }?;
        // SAFETY: `out` checked; valid by the caller's contract.
        unsafe { new_buffer(context, buffer, out) }
    }
}

/// Opens the GPU buffer a `gdr://` URI names (another process's memory,
/// through its CUDA IPC handle) on GPU `device` of the URI, confined to
/// the URI's range. The whole allocation is mapped: accept URIs only from
/// processes trusted with all of it. Any thread.
///
/// # Safety
/// `uri` a NUL-terminated string; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_buffer_open_uri(
    context: GdrContext,
    uri: *const c_char,
    out: *mut GdrBuffer,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        // SAFETY: the caller's contract.
        let text = unsafe { text_arg("uri", uri) }?;
        let uri: BufferUri = text.parse()?;
        let owner = self::context(context)?;
        let buffer = owner.context.open_uri(&uri)?;
        // SAFETY: `out` checked; valid by the caller's contract.
        unsafe { new_buffer(context, buffer, out) }
    }
}

/// Writes the `gdr://v2/...` URI of a GPU buffer (its allocation's CUDA IPC
/// handle and the buffer's range in it) into `buf` (see
/// [`gdr_last_error_message`] for `buf`, `len`, `needed`). The URI is a
/// capability for the whole allocation. Any thread.
///
/// # Safety
/// As for [`gdr_last_error_message`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_buffer_export_uri(
    buffer: GdrBuffer,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> GdrResult {
    ffi_boundary! {
        let out = TextOut::new(buf, len, needed)?;
        let uri = self::buffer(buffer)?.buffer.export_uri()?;
        // SAFETY: the caller's contract.
        unsafe { out.write(&uri.to_string()) }
    }
}

/// Writes a buffer's address, size, memory kind and device. Any thread.
///
/// # Safety
/// `info` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_buffer_get_info(
    buffer: GdrBuffer,
    info: *mut GdrBufferInfo,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("info", info)?;
        let object = self::buffer(buffer)?;
        let facts = &object.buffer;
        let memory = match facts.kind() {
            MemoryKind::Host => GdrMemory::Host,
            MemoryKind::Pinned => GdrMemory::Pinned,
            MemoryKind::Device => GdrMemory::Device,
            _ => GdrMemory::Managed,
        };
        let value = GdrBufferInfo {
            addr: facts.addr(),
            size: facts.len(),
            memory,
            device: facts.device().map_or(-1, |d| d as i32),
        };
        // SAFETY: checked; valid by the caller's contract.
        unsafe { out.write(value) };
        Ok(())
    }
}

/// Frees a buffer: memory gdr allocated is freed once nothing registered
/// uses it; for wrapped memory this waits (a bounded time) until no memory
/// registration covers it, and returns `GDR_RESULT_BUSY`, the handle still
/// valid, if one still does. A buffer a stream copy
/// ([`crate::stream::gdr_stream_copy`]) still uses is refused with
/// `GDR_RESULT_BUSY` at once (synchronize or free that stream first).
/// Calls on the same buffer from other threads meanwhile fail with
/// `GDR_RESULT_INVALID_HANDLE`.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_buffer_free(buffer: GdrBuffer) -> GdrResult {
    ffi_boundary! {
        let object = self::buffer(buffer)?;
        object.buffer.release()?;
        BUFFERS.remove(buffer.id)?;
        Ok(())
    }
}

/// The context a buffer was made in (for callers that keep only buffers).
/// Any thread.
///
/// # Safety
/// `context` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_buffer_context(
    buffer: GdrBuffer,
    context: *mut GdrContext,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("context", context)?;
        let id = self::buffer(buffer)?.context;
        // SAFETY: checked; valid by the caller's contract.
        unsafe { out.write(GdrContext { id }) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(name: *const c_char) -> &'static str {
        // SAFETY: the name functions return static NUL-terminated strings.
        unsafe { CStr::from_ptr(name) }.to_str().unwrap()
    }

    #[test]
    fn rungs_and_memory_kinds_have_names() {
        let rungs: Vec<_> = (0..5).map(|n| text(gdr_rung_name(n))).collect();
        assert_eq!(
            rungs,
            ["dma-buf", "peermem", "staging", "host", "unknown rung"]
        );
        let kinds: Vec<_> = (0..5).map(|n| text(gdr_memory_kind_name(n))).collect();
        assert_eq!(
            kinds,
            ["host", "pinned", "device", "managed", "unknown memory kind"]
        );
        assert_eq!(text(gdr_memory_kind_name(u32::MAX)), "unknown memory kind");
    }

    /// Through the C ABI: after a buffer's slot would have wrapped, its
    /// stale handle neither answers for nor frees the buffer made next.
    #[test]
    fn a_stale_buffer_handle_never_reaches_a_later_buffer() {
        let options = GdrOptions {
            backend: GdrBackend::Sim,
        };
        let mut context = GdrContext { id: 0 };
        // SAFETY: valid pointers to locals.
        let made = unsafe { gdr_context_new(&options, &mut context) };
        assert_eq!(made, GdrResult::Ok);
        let alloc = |size: u64| {
            let mut buffer = GdrBuffer { id: 0 };
            // SAFETY: a valid pointer to a local.
            let result = unsafe { gdr_buffer_alloc(context, 0, 0, size, &mut buffer) };
            assert_eq!(result, GdrResult::Ok);
            buffer
        };
        let info = |buffer: GdrBuffer| {
            let mut info = GdrBufferInfo {
                addr: 0,
                size: 0,
                memory: GdrMemory::Host,
                device: -1,
            };
            // SAFETY: a valid pointer to a local.
            let result = unsafe { gdr_buffer_get_info(buffer, &mut info) };
            (result, info.size)
        };
        let stale = alloc(4096);
        assert_eq!(gdr_buffer_free(stale), GdrResult::Ok);
        // 65,533 more buffers made and freed in that slot.
        assert!(BUFFERS.set_free_slot_generation(stale.id, u16::MAX));
        assert_eq!(gdr_buffer_free(alloc(4096)), GdrResult::Ok);
        let other = alloc(8192);
        assert_ne!(other, stale);
        assert_eq!(info(stale).0, GdrResult::InvalidHandle);
        assert_eq!(gdr_buffer_free(stale), GdrResult::InvalidHandle);
        assert_eq!(
            info(other),
            (GdrResult::Ok, 8192),
            "the later buffer lives on"
        );
        assert_eq!(gdr_buffer_free(other), GdrResult::Ok);
        assert_eq!(gdr_context_free(context), GdrResult::Ok);
    }

    /// The doctor's JSON on the simulation: asked for its length, then
    /// written; a short buffer is refused and left alone.
    #[test]
    fn the_doctor_report_is_json_with_every_section() {
        let options = GdrOptions {
            backend: GdrBackend::Sim,
        };
        let mut needed = 0usize;
        // SAFETY: NULL with length 0 asks for the length; `needed` is a local.
        let asked = unsafe { gdr_doctor_report(&options, std::ptr::null_mut(), 0, &mut needed) };
        assert_eq!(asked, GdrResult::BufferTooSmall);
        assert!(needed > 2, "{needed}");
        let mut short = [0x55u8; 8];
        // SAFETY: `short` is valid for its length.
        let refused = unsafe {
            gdr_doctor_report(
                &options,
                short.as_mut_ptr().cast(),
                short.len(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(refused, GdrResult::BufferTooSmall);
        assert_eq!(short, [0x55u8; 8], "nothing written on failure");
        let mut buf = vec![0u8; 1 << 16];
        // SAFETY: `buf` is valid for its length; `needed` is a local.
        let result =
            unsafe { gdr_doctor_report(&options, buf.as_mut_ptr().cast(), buf.len(), &mut needed) };
        assert_eq!(result, GdrResult::Ok);
        let json = CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap();
        assert_eq!(json.len() + 1, needed);
        assert!(
            json.starts_with('{') && json.contains("\"backends\""),
            "{json}"
        );
        assert!(json.contains("\"asked\": \"sim\""), "{json}");
        for key in [
            "libraries",
            "nvidia",
            "memlock",
            "rdma",
            "gpus",
            "topology",
            "rungs",
            "hints",
        ] {
            assert!(json.contains(&format!("\"{key}\":")), "{key} missing");
        }
        // A backend number out of range is refused, not read as the enum.
        let bogus = 9u32;
        // SAFETY: a u32 has GdrOptions's size and alignment.
        let refused = unsafe {
            gdr_doctor_report(
                (&bogus as *const u32).cast(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(refused, GdrResult::InvalidArgument);
    }
}
