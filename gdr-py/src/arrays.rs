//! The buffer protocol from Rust: one-dimensional arrays of unsigned 64-bit
//! integers (numpy `uint64`, `array.array("Q")`, a memoryview of either)
//! read in place (a paged KV cache's block lists reach the engine with no
//! Python loop and no copy), and the export a region holds on the object
//! it was registered from ([`Export`]: while it is held, a `bytearray`
//! cannot be resized nor an `mmap` closed).
//!
//! The abi3-py39 limited API has no buffer functions (they joined it in
//! 3.11); `PyObject_GetBuffer` and `PyBuffer_Release` are exported by every
//! CPython 3 and `Py_buffer`'s layout has not changed since 3.3 (it is the
//! one 3.11's stable ABI fixed), so they are declared here.

use std::ffi::{CStr, c_char, c_int, c_void};

use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::raise;

#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: isize,
    itemsize: isize,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut isize,
    strides: *mut isize,
    suboffsets: *mut isize,
    internal: *mut c_void,
}

// CPython's flags (Include/pybuffer.h).
const PYBUF_FORMAT: c_int = 0x0004;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | PYBUF_STRIDES;

unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

/// A C-contiguous array of u64 held through the buffer protocol; released
/// when dropped (with the GIL held: it lives within one call).
pub(crate) struct U64Array<'py> {
    view: RawBuffer,
    _py: Python<'py>,
}

/// An empty `Py_buffer`, for `PyObject_GetBuffer` to fill.
fn empty_view() -> RawBuffer {
    RawBuffer {
        buf: std::ptr::null_mut(),
        obj: std::ptr::null_mut(),
        len: 0,
        itemsize: 0,
        readonly: 0,
        ndim: 0,
        format: std::ptr::null_mut(),
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        suboffsets: std::ptr::null_mut(),
        internal: std::ptr::null_mut(),
    }
}

/// A buffer export held natively: the memory it names cannot move or go
/// (a `bytearray` refuses to resize, an `mmap` to close) until it is
/// released. Held by a region for its whole life, where no Python code can
/// reach it (a memoryview would be: anyone holding it can `release()` it).
pub(crate) struct Export {
    view: RawBuffer,
}

// SAFETY: the view is only read or released with the GIL held (`release`
// takes a `Python` token, `Drop` attaches), which serialises every use of
// it across threads.
unsafe impl Send for Export {}
// SAFETY: as for `Send`: no method touches the view without the GIL.
unsafe impl Sync for Export {}

impl Export {
    /// Exports `obj`'s buffer (C-contiguous) and checks that it is the
    /// `length` bytes at `address` the caller resolved; `InvalidArgument`
    /// otherwise (the memory moved since, or it is not this object's).
    pub(crate) fn of(
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        address: u64,
        length: u64,
    ) -> PyResult<Self> {
        let mut view = empty_view();
        // SAFETY: `obj` is a live object (the GIL is held, through `py`);
        // `view` is a Py_buffer-shaped struct the call fills and, on
        // success, owns a reference and an export in, released by
        // `release` or `Drop`.
        let failed = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut view, PYBUF_C_CONTIGUOUS) };
        if failed != 0 {
            drop(PyErr::take(py));
            return Err(raise(
                py,
                "InvalidArgument",
                "the object's buffer cannot be exported C-contiguous".into(),
            ));
        }
        let export = Self { view };
        let (at, len) = (export.view.buf as u64, export.view.len as u64);
        if at != address || len != length {
            return Err(raise(
                py,
                "InvalidArgument",
                format!(
                    "the object's memory is {len} bytes at {at:#x}, not the {length} bytes at \
                     {address:#x} resolved (was it resized meanwhile?)"
                ),
            ));
        }
        Ok(export)
    }

    /// Lets go of the export (once; later calls do nothing).
    pub(crate) fn release(&mut self, _py: Python<'_>) {
        if self.view.obj.is_null() {
            return;
        }
        // SAFETY: the view was filled by a successful PyObject_GetBuffer
        // and not released yet (its `obj` is cleared below and by the
        // release itself); the GIL is held (`_py`).
        unsafe { PyBuffer_Release(&mut self.view) };
        self.view.obj = std::ptr::null_mut();
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        if !self.view.obj.is_null() {
            Python::attach(|py| self.release(py));
        }
    }
}

impl<'py> U64Array<'py> {
    /// `obj`'s buffer as u64s; `InvalidArgument` naming `what` for anything
    /// else (another element type, not contiguous, not one-dimensional).
    pub(crate) fn of(py: Python<'py>, obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        let mut view = empty_view();
        // SAFETY: `obj` is a live object (the GIL is held, through `py`);
        // `view` is a Py_buffer-shaped struct the call fills and, on
        // success, owns a reference and an export in, released by `Drop`.
        let failed = unsafe {
            PyObject_GetBuffer(obj.as_ptr(), &mut view, PYBUF_C_CONTIGUOUS | PYBUF_FORMAT)
        };
        if failed != 0 {
            // The exporter's own error (not contiguous, no buffer) is
            // replaced by ours, which names the argument.
            drop(PyErr::take(py));
            return Err(raise(
                py,
                "InvalidArgument",
                format!("{what}: not a C-contiguous array of uint64"),
            ));
        }
        let array = Self { view, _py: py };
        let format = if array.view.format.is_null() {
            b"B".to_vec()
        } else {
            // SAFETY: set by a successful PyObject_GetBuffer with
            // PYBUF_FORMAT: NUL-terminated, valid while the view is held.
            unsafe { CStr::from_ptr(array.view.format) }
                .to_bytes()
                .to_vec()
        };
        // 'Q' is unsigned long long; 'L' (numpy's uint64 on LP64) is
        // unsigned long, 8 bytes only there.
        let long_is_64 = std::mem::size_of::<std::ffi::c_ulong>() == 8;
        let unsigned_64 = match format.as_slice() {
            b"Q" | b"<Q" | b"=Q" | b"@Q" => true,
            b"L" | b"<L" | b"=L" | b"@L" => long_is_64,
            _ => false,
        };
        if !unsigned_64 || array.view.itemsize != 8 || array.view.ndim > 1 {
            return Err(raise(
                py,
                "InvalidArgument",
                format!(
                    "{what}: a one-dimensional array of uint64 (got format {:?}, {} dimensions)",
                    String::from_utf8_lossy(&format),
                    array.view.ndim
                ),
            ));
        }
        if !array.view.buf.cast::<u64>().is_aligned() {
            return Err(raise(py, "InvalidArgument", format!("{what}: misaligned")));
        }
        Ok(array)
    }

    /// The values.
    pub(crate) fn values(&self) -> &[u64] {
        let count = self.view.len as usize / 8;
        if count == 0 {
            return &[];
        }
        // SAFETY: a C-contiguous, aligned (checked) buffer of `len` bytes of
        // 8-byte items (checked), valid and pinned by its export while
        // `self` (and so the view) lives; the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(self.view.buf.cast::<u64>(), count) }
    }
}

impl Drop for U64Array<'_> {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and
        // is released once, with the GIL held (the `'py` lifetime).
        unsafe { PyBuffer_Release(&mut self.view) };
    }
}
