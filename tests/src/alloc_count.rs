//! A global allocator that counts what a thread allocates: a test binary
//! installs it (`#[global_allocator] static A: Counting = Counting;`) and
//! asks how many allocations a piece of work made on the calling thread
//! ([`allocations_in`]). Allocations are where threads that share nothing
//! else can meet (glibc's frees past its per-thread cache take the
//! arena's lock), so the hot paths' counts are kept low and checked.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// [`System`], counting the allocations (and reallocations) of threads
/// that asked to be counted.
#[derive(Debug)]
pub struct Counting;

thread_local! {
    /// Allocations of this thread while counted; `None`: not counted.
    static COUNT: Cell<Option<u64>> = const { Cell::new(None) };
}

fn count_one() {
    // `try_with`: allocations while the thread's locals are torn down are
    // not counted.
    let _ = COUNT.try_with(|c| {
        if let Some(n) = c.get() {
            c.set(Some(n + 1));
        }
    });
}

// SAFETY: every call is forwarded to `System` unchanged; the count is a
// const-initialized thread local, which allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_one();
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_one();
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_one();
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// The allocations this thread makes in `f` (counted only where the
/// binary installed [`Counting`]), and what `f` returned.
pub fn allocations_in<T>(f: impl FnOnce() -> T) -> (u64, T) {
    COUNT.with(|c| c.set(Some(0)));
    let out = f();
    (COUNT.with(|c| c.take()).unwrap_or(0), out)
}
