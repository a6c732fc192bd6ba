//! The cache's errors.

use std::sync::Arc;

/// Why the cache could not hand out a registration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError<E: std::error::Error + 'static> {
    /// A zero-length request: nothing to register.
    #[error("empty registration request at {start:#x}")]
    EmptyRange {
        /// Its start.
        start: u64,
    },
    /// `start + len` does not fit in 64 bits.
    #[error("range {start:#x}+{len:#x} overflows the address space")]
    RangeOverflow {
        /// Its start.
        start: u64,
        /// Its length.
        len: u64,
    },
    /// The range runs outside the allocation it names.
    #[error("range {start:#x}..{end:#x} runs outside its allocation {:#x}..{:#x}", bounds.start, bounds.end)]
    OutsideBounds {
        /// Its start.
        start: u64,
        /// One past its end.
        end: u64,
        /// The allocation.
        bounds: super::Bounds,
    },
    /// The registrar failed. Every request that was waiting on the same
    /// registration gets the same error, hence the `Arc`. No entry was left
    /// behind: a later request tries again.
    #[error("registering {start:#x}..{end:#x} failed")]
    Register {
        /// First address (or offset) that was being registered.
        start: u64,
        /// One past the last.
        end: u64,
        /// The registrar's error.
        #[source]
        source: Arc<E>,
    },
}
