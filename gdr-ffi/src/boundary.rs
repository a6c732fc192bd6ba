//! The panic boundary every export goes through ([`ffi_boundary!`]), the
//! calling thread's last error, and the checks of what C hands in (NULL,
//! misaligned pointers, strings) and hands out (outputs written only on
//! success, text into caller buffers).

use std::cell::RefCell;
use std::ffi::{CStr, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::result::{FfiError, GdrResult};

thread_local! {
    /// The last error of a gdr call on this thread (as errno: a success
    /// leaves it).
    static LAST_ERROR: RefCell<Option<FfiError>> = const { RefCell::new(None) };
}

/// Runs an export's body: its error (or a caught panic) is recorded as the
/// thread's last error and turned into the result code.
pub(crate) fn call(body: impl FnOnce() -> Result<(), FfiError>) -> GdrResult {
    let error = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return GdrResult::Ok,
        Ok(Err(error)) => error,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            FfiError::new(GdrResult::Panic, format!("internal error: {what}"))
        }
    };
    let result = error.result;
    // (A thread-local being torn down at thread exit: nothing to record.)
    let _ = LAST_ERROR.try_with(|last| *last.borrow_mut() = Some(error));
    result
}

/// Records `error` as the thread's last error without failing the call
/// (an outcome an export reports through an output, e.g. a batch's).
pub(crate) fn record(error: FfiError) {
    let _ = LAST_ERROR.try_with(|last| *last.borrow_mut() = Some(error));
}

/// The body of every `extern "C"` function of this crate: a closure
/// returning `Result<(), FfiError>`, run behind the panic boundary.
macro_rules! ffi_boundary {
    ($($body:tt)*) => {
        $crate::boundary::call(|| -> Result<(), $crate::result::FfiError> { $($body)* })
    };
}
pub(crate) use ffi_boundary;

/// The thread's last error message.
pub(crate) fn last_error() -> Option<String> {
    LAST_ERROR
        .try_with(|last| last.borrow().as_ref().map(|e| e.message.clone()))
        .ok()
        .flatten()
}

/// An output pointer, checked: not NULL, aligned for `T`.
pub(crate) struct Out<T>(*mut T);

impl<T> Out<T> {
    /// Checks `ptr` (named `name` in the error).
    pub fn new(name: &str, ptr: *mut T) -> Result<Self, FfiError> {
        if ptr.is_null() {
            return Err(FfiError::invalid(name, "NULL"));
        }
        if !ptr.is_aligned() {
            return Err(FfiError::invalid(
                name,
                format!("{ptr:p} is not aligned to {} bytes", align_of::<T>()),
            ));
        }
        Ok(Self(ptr))
    }

    /// Writes the output (only ever at the end of a successful call).
    ///
    /// # Safety
    /// The pointer given to [`Out::new`] must be valid for a write of `T`.
    pub unsafe fn write(self, value: T) {
        // SAFETY: not NULL and aligned (checked in `new`), valid for a
        // write by the caller's contract; `write` does not read or drop
        // what was there (C memory may be uninitialized).
        unsafe { self.0.write(value) }
    }
}

/// A NUL-terminated UTF-8 string argument.
///
/// # Safety
/// `ptr` must be NULL or point to a NUL-terminated string that stays valid
/// and unchanged for `'a`.
pub(crate) unsafe fn text_arg<'a>(name: &str, ptr: *const c_char) -> Result<&'a str, FfiError> {
    if ptr.is_null() {
        return Err(FfiError::invalid(name, "NULL"));
    }
    // SAFETY: not NULL; NUL-terminated and valid by the caller's contract.
    let text = unsafe { CStr::from_ptr(ptr) };
    text.to_str()
        .map_err(|e| FfiError::invalid(name, format!("not UTF-8 ({e})")))
}

/// A caller's text buffer: `len` bytes at `buf`, and where to say how many
/// bytes (with the NUL) the text needs.
pub(crate) struct TextOut {
    buf: *mut c_char,
    len: usize,
    needed: Option<Out<usize>>,
}

impl TextOut {
    /// Checks the arguments: `buf` may be NULL only with `len` 0 (to ask
    /// for the length); `needed` may be NULL.
    pub fn new(buf: *mut c_char, len: usize, needed: *mut usize) -> Result<Self, FfiError> {
        if buf.is_null() && len != 0 {
            return Err(FfiError::invalid("buf", format!("NULL with length {len}")));
        }
        let needed = (!needed.is_null())
            .then(|| Out::new("needed", needed))
            .transpose()?;
        Ok(Self { buf, len, needed })
    }

    /// Writes `text` and its NUL, or (leaving the buffer alone) fails with
    /// `GDR_BUFFER_TOO_SMALL`; the length needed is written either way.
    ///
    /// # Safety
    /// `buf` must be valid for writes of `len` bytes and `needed` for a
    /// write of a `usize`, as given to [`TextOut::new`].
    pub unsafe fn write(self, text: &str) -> Result<(), FfiError> {
        let need = text.len() + 1;
        if let Some(needed) = self.needed {
            // SAFETY: checked in `new`; valid by the caller's contract.
            unsafe { needed.write(need) };
        }
        if text.as_bytes().contains(&0) {
            return Err(FfiError::new(GdrResult::Other, "text with a NUL byte"));
        }
        if need > self.len {
            return Err(FfiError::new(
                GdrResult::BufferTooSmall,
                format!("{need} bytes needed, {} given", self.len),
            ));
        }
        // SAFETY: `buf` holds `len` >= `need` writable bytes (caller's
        // contract) and does not overlap `text`, a Rust string.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), self.buf.cast::<u8>(), text.len());
            self.buf.add(text.len()).write(0);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_and_panics_become_codes_and_the_last_error() {
        let ok = call(|| Ok(()));
        assert_eq!(ok, GdrResult::Ok);
        let failed = call(|| Err(FfiError::invalid("len", "zero")));
        assert_eq!(failed, GdrResult::InvalidArgument);
        assert_eq!(last_error().as_deref(), Some("len: zero"));
        // A success leaves the last error (as errno).
        assert_eq!(call(|| Ok(())), GdrResult::Ok);
        assert_eq!(last_error().as_deref(), Some("len: zero"));
        let panicked = call(|| panic!("boom {}", 7));
        assert_eq!(panicked, GdrResult::Panic);
        assert!(last_error().unwrap().contains("boom 7"));
    }

    #[test]
    fn outputs_refuse_null_and_misaligned_pointers() {
        assert!(Out::<u64>::new("out", std::ptr::null_mut()).is_err());
        let mut words = [0u64; 2];
        let odd = (words.as_mut_ptr() as usize + 1) as *mut u64;
        let e = Out::new("out", odd).err().unwrap();
        assert!(e.message.contains("not aligned"), "{}", e.message);
        let out = Out::new("out", &mut words[0] as *mut u64).unwrap();
        // SAFETY: a live, aligned u64.
        unsafe { out.write(5) };
        assert_eq!(words[0], 5);
    }

    #[test]
    fn text_goes_out_whole_or_not_at_all() {
        let mut buf = [0x55 as c_char; 6];
        let mut needed = 0usize;
        let short = TextOut::new(buf.as_mut_ptr(), 3, &mut needed).unwrap();
        // SAFETY: buf holds 6 bytes, needed is a live usize.
        let e = unsafe { short.write("hello") }.unwrap_err();
        assert_eq!(e.result, GdrResult::BufferTooSmall);
        assert_eq!(needed, 6);
        assert!(buf.iter().all(|&b| b == 0x55), "nothing written when short");
        let fits = TextOut::new(buf.as_mut_ptr(), 6, std::ptr::null_mut()).unwrap();
        // SAFETY: as above.
        unsafe { fits.write("hello") }.unwrap();
        // SAFETY: NUL-terminated now.
        let back = unsafe { CStr::from_ptr(buf.as_ptr()) };
        assert_eq!(back.to_str().unwrap(), "hello");
        assert!(TextOut::new(std::ptr::null_mut(), 4, std::ptr::null_mut()).is_err());
        // Asking for the length only.
        let ask = TextOut::new(std::ptr::null_mut(), 0, &mut needed).unwrap();
        // SAFETY: no bytes are written with len 0.
        assert!(unsafe { ask.write("abc") }.is_err());
        assert_eq!(needed, 4);
    }
}
