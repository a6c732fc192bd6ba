//! The reactor's system calls as loom models them (`sys.rs` makes the
//! real ones): an fd is a flag in one table per model execution, readable
//! or not, and a park sleeps on a condition variable until one of its fds
//! is readable. loom has no time: a park with a timeout returns at once (a
//! real one may, at its timeout or an EINTR); one without sleeps until an
//! fd is signalled, so a wake-up lost shows as loom's deadlock.

use std::os::fd::RawFd;
use std::time::Duration;

use crate::sync::{Condvar, Mutex, lock, wait};

/// The fds of a model execution: whether each is readable (the fd is the
/// index).
struct Fds {
    readable: Mutex<Vec<bool>>,
    changed: Condvar,
}

loom::lazy_static! {
    static ref FDS: Fds = Fds {
        readable: Mutex::new(Vec::new()),
        changed: Condvar::new(),
    };
}

fn index(fd: RawFd) -> usize {
    usize::try_from(fd).expect("a modelled fd")
}

/// Waits until one of `fds` is readable; at once if there is a timeout.
pub(super) fn poll_readable(fds: &[RawFd], timeout: Option<Duration>) {
    if timeout.is_some() {
        return;
    }
    let mut readable = lock(&FDS.readable);
    while !fds.iter().any(|&fd| readable[index(fd)]) {
        readable = wait(&FDS.changed, readable);
    }
}

/// A modelled eventfd: readable from `signal` to `clear`.
#[derive(Debug)]
pub(super) struct WakeFd {
    fd: RawFd,
}

impl WakeFd {
    pub(super) fn new() -> std::io::Result<Self> {
        let mut readable = lock(&FDS.readable);
        readable.push(false);
        let fd = RawFd::try_from(readable.len() - 1).expect("few modelled fds");
        Ok(Self { fd })
    }

    pub(super) fn fd(&self) -> RawFd {
        self.fd
    }

    pub(super) fn signal(&self) {
        lock(&FDS.readable)[index(self.fd)] = true;
        FDS.changed.notify_all();
    }

    pub(super) fn clear(&self) {
        lock(&FDS.readable)[index(self.fd)] = false;
    }
}
