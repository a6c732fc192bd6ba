//! The reactor's system calls: the eventfd that wakes a parked leader, and
//! the ppoll it parks in. (Under loom, `sys_model.rs` stands in.)

use std::os::fd::RawFd;
use std::time::Duration;

/// Waits until one of `fds` is readable or `timeout` passes (`None`: no
/// timeout). Errors (an fd closed under it, EINTR) end the wait early:
/// the caller looks at everything again.
pub(super) fn poll_readable(fds: &[RawFd], timeout: Option<Duration>) {
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // ppoll: microseconds matter here (a GPU poll interval), poll(2)
    // counts milliseconds.
    let spec = timeout.map(|t| libc::timespec {
        tv_sec: libc::time_t::try_from(t.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(t.subsec_nanos() as i32),
    });
    let spec_ptr = spec
        .as_ref()
        .map_or(std::ptr::null(), |s| s as *const libc::timespec);
    // SAFETY: `polled` is a live, writable array of `polled.len()` pollfd
    // structs and `spec_ptr` null or a live timespec, both for the
    // duration of the call; a null signal mask leaves the mask alone.
    let n = unsafe {
        libc::ppoll(
            polled.as_mut_ptr(),
            polled.len() as libc::nfds_t,
            spec_ptr,
            std::ptr::null(),
        )
    };
    if n < 0 {
        tracing::trace!(
            error = %std::io::Error::last_os_error(),
            "poll(2) of the engine's fds"
        );
    }
}

/// A non-blocking eventfd that wakes a parked leader.
#[derive(Debug)]
pub(super) struct WakeFd {
    fd: std::os::fd::OwnedFd,
}

impl WakeFd {
    pub(super) fn new() -> std::io::Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: eventfd takes no pointer; the flags are valid.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened by eventfd and is owned by no one
        // else.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        Ok(Self { fd })
    }

    pub(super) fn fd(&self) -> RawFd {
        use std::os::fd::AsRawFd;
        self.fd.as_raw_fd()
    }

    pub(super) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our open eventfd; a
        // full counter (EAGAIN) still leaves it readable, which is all a
        // signal needs.
        let _ = unsafe { libc::write(self.fd(), (&raw const one).cast(), 8) };
    }

    pub(super) fn clear(&self) {
        let mut value: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our open eventfd;
        // EAGAIN (nothing signalled) leaves it untouched.
        let _ = unsafe { libc::read(self.fd(), (&raw mut value).cast(), 8) };
    }
}
