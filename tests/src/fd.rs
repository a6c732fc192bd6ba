//! Readiness checks on file descriptors (completion channels, async event
//! and connection event fds), as an event loop sees them.

use std::os::fd::RawFd;
use std::time::Duration;

/// Waits up to `timeout` for `fd` to be readable, with epoll (a fresh
/// epoll instance, level-triggered, as an event loop registers it).
pub fn epoll_readable(fd: RawFd, timeout: Duration) -> bool {
    // SAFETY: plain syscalls on fds we own (the epoll fd, closed below) or
    // that the caller keeps open for the call; `ev`/`out` are live.
    unsafe {
        let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        assert!(ep >= 0, "epoll_create1");
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 7,
        };
        assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev), 0);
        let mut out = [libc::epoll_event { events: 0, u64: 0 }; 1];
        let n = libc::epoll_wait(ep, out.as_mut_ptr(), 1, timeout.as_millis() as i32);
        libc::close(ep);
        assert!(n >= 0, "epoll_wait");
        n == 1 && out[0].u64 == 7 && out[0].events & libc::EPOLLIN as u32 != 0
    }
}

/// Whether `fd` is readable now, with poll(2) and a zero timeout.
pub fn poll_readable(fd: RawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    assert!(n >= 0, "poll");
    n == 1 && pfd.revents & libc::POLLIN != 0
}

/// O_NONBLOCK is set on `fd`.
pub fn is_nonblocking(fd: RawFd) -> bool {
    // SAFETY: F_GETFL on an open fd.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    flags >= 0 && flags & libc::O_NONBLOCK != 0
}
