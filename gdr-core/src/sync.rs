//! The synchronization types gdr-core uses, from `std` normally and from
//! `loom` under `--cfg loom`, so the same code is model-checked (the shim
//! tokio and sharded-slab use). Code in gdr-core takes its `Arc`, `Mutex`,
//! `RwLock` and atomics from here, never from `std::sync` directly.

#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard, RwLock, atomic};

#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard, RwLock, atomic};

/// Locks a mutex, recovering the data if a panicking thread poisoned it: a
/// panic elsewhere must not turn every later call into a second panic.
#[cfg(not(loom))]
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Locks a mutex (loom's cannot be poisoned by a model).
#[cfg(loom)]
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().expect("loom mutexes are not poisoned")
}
