//! The synchronization types gdr-core uses, from `std` normally and from
//! `loom` under `--cfg loom`, so the same code is model-checked (the shim
//! tokio and sharded-slab use). Code in gdr-core takes its `Arc`, `Mutex`,
//! `RwLock`, `Condvar` and atomics from here, never from `std::sync` directly.
//!
//! loom has no `OnceLock`, `LazyLock` or `RwLock::downgrade`: code that must
//! be model-checked is written with `Mutex` + `Condvar` and plain locks.

#[cfg(loom)]
pub(crate) use loom::sync::{
    Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, atomic,
};

#[cfg(not(loom))]
pub(crate) use std::sync::{
    Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, atomic,
};

/// Between a SeqCst store and a SeqCst load of another atomic, in Dekker's
/// pattern (each of two threads stores, then loads what the other stores:
/// one of them sees the other's store). SeqCst accesses guarantee it, so
/// outside loom this is nothing; loom models them as AcqRel, which does
/// not, and would report wake-ups lost that cannot be: under loom it is
/// the SeqCst fence loom does model.
#[inline(always)]
pub(crate) fn dekker_fence() {
    #[cfg(loom)]
    atomic::fence(atomic::Ordering::SeqCst);
}

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

/// Locks a mutex if it is free now (`None`: another thread holds it),
/// recovering from poison as [`lock`] does.
pub(crate) fn try_lock<T>(mutex: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match mutex.try_lock() {
        Ok(guard) => Some(guard),
        Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Takes a read lock, recovering from poison as [`lock`] does.
pub(crate) fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Takes a write lock, recovering from poison as [`lock`] does.
pub(crate) fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Waits on a condition variable, recovering from poison.
pub(crate) fn wait<'a, T>(condvar: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    condvar
        .wait(guard)
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Waits on a condition variable at most `timeout`, recovering from poison.
/// (Under loom a timeout is never real: the model explores the wake-up.)
pub(crate) fn wait_timeout<'a, T>(
    condvar: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: std::time::Duration,
) -> MutexGuard<'a, T> {
    match condvar.wait_timeout(guard, timeout) {
        Ok((guard, _)) => guard,
        Err(poisoned) => poisoned.into_inner().0,
    }
}
