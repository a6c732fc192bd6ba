//! Completion channels (`ibv_comp_channel`) and the device's async events
//! (`ibv_get_async_event`), both read from non-blocking fds.
//!
//! Every event is acknowledged as soon as it is read, after the number of
//! the object it names has been copied out: `ibv_destroy_cq` and
//! `ibv_destroy_qp` wait until every event reported on their object is
//! acknowledged, so an event held unacknowledged by a caller that then
//! drops the object would hang the drop. While unacknowledged the object
//! cannot be destroyed, so reading its number before the ack is safe.

use std::fmt;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::device::ContextInner;
use super::{clear_errno, errno_or_eio, ret_errno, verb_error};
use crate::api::CompletionChannel;
use crate::error::{Result, VerbsError};
use crate::types::{AsyncEvent, EventAffiliation};

/// Sets `O_NONBLOCK` on `fd`.
pub(crate) fn set_nonblocking(fd: RawFd, operation: &'static str, device: &str) -> Result<()> {
    // SAFETY: fcntl on an fd the caller owns; F_GETFL reads its flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(verb_error(operation, device, errno_or_eio()));
    }
    // SAFETY: as above; F_SETFL only changes the status flags.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(verb_error(operation, device, errno_or_eio()));
    }
    Ok(())
}

/// The native channel, destroyed when its handle and last CQ are gone.
pub(crate) struct ChannelInner {
    channel: *mut sys::ibv_comp_channel,
    fd: RawFd,
    ctx: Arc<ContextInner>,
}

// SAFETY: a completion channel is an fd plus a refcount that libibverbs
// updates under the context's lock; `ibv_get_cq_event` is a read(2) on the
// fd, safe from any thread. It is destroyed only in Drop.
unsafe impl Send for ChannelInner {}
// SAFETY: see Send.
unsafe impl Sync for ChannelInner {}

impl ChannelInner {
    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_comp_channel {
        self.channel
    }

    pub(crate) fn context(&self) -> &Arc<ContextInner> {
        &self.ctx
    }
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: `channel` came from ibv_create_comp_channel and is
        // destroyed once; every CQ on it holds an Arc to us, so none is left
        // (else libibverbs answers EBUSY, logged below).
        let ret = unsafe { sys::ibv_destroy_comp_channel(self.channel) };
        if ret != 0 {
            tracing::warn!(
                device = %self.ctx.name(),
                errno = ret_errno(ret),
                "ibv_destroy_comp_channel failed; the channel leaks"
            );
        }
    }
}

impl fmt::Debug for ChannelInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelInner")
            .field("device", &self.ctx.name())
            .field("fd", &self.fd)
            .finish()
    }
}

/// A completion channel of the rdma-core backend. Cloning shares it.
///
/// Its fd is non-blocking; it is `AsFd`/`AsRawFd` for epoll, mio and
/// tokio's `AsyncFd`.
#[derive(Debug, Clone)]
pub struct RdmaCompChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

impl RdmaCompChannel {
    pub(crate) fn create(ctx: &Arc<ContextInner>) -> Result<Self> {
        clear_errno();
        // SAFETY: the context is open.
        let channel = unsafe { sys::ibv_create_comp_channel(ctx.as_ptr()) };
        if channel.is_null() {
            return Err(verb_error(
                "ibv_create_comp_channel",
                ctx.name(),
                errno_or_eio(),
            ));
        }
        // SAFETY: a live channel from the library; `fd` is a plain int.
        let fd = unsafe { (*channel).fd };
        let inner = Arc::new(ChannelInner {
            channel,
            fd,
            ctx: Arc::clone(ctx),
        });
        // On failure `inner` is dropped, destroying the channel.
        set_nonblocking(fd, "ibv_create_comp_channel", ctx.name())?;
        Ok(Self { inner })
    }
}

impl AsRawFd for RdmaCompChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.fd
    }
}

impl AsFd for RdmaCompChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd is open for as long as the channel, which `self`
        // keeps alive for the borrow's lifetime.
        unsafe { BorrowedFd::borrow_raw(self.inner.fd) }
    }
}

impl CompletionChannel for RdmaCompChannel {
    fn fd(&self) -> RawFd {
        self.inner.fd
    }

    fn get_cq_event(&self) -> Result<Option<u64>> {
        let mut cq: *mut sys::ibv_cq = std::ptr::null_mut();
        let mut cq_context: *mut libc::c_void = std::ptr::null_mut();
        clear_errno();
        // SAFETY: the channel is live; both out-parameters are valid. The fd
        // is non-blocking, so this returns -1 with EAGAIN when no event is
        // pending instead of waiting.
        let ret = unsafe { sys::ibv_get_cq_event(self.inner.channel, &mut cq, &mut cq_context) };
        if ret != 0 {
            return match errno_or_eio() {
                libc::EAGAIN => Ok(None),
                e => Err(verb_error("ibv_get_cq_event", self.inner.ctx.name(), e)),
            };
        }
        // The identity is the CQ's address, as `RdmaCq::cq_id` gives it:
        // copied before the ack, while the CQ cannot be destroyed.
        let id = cq as u64;
        // SAFETY: `cq` is the live CQ the event names; one event is acked.
        unsafe { sys::ibv_ack_cq_events(cq, 1) };
        Ok(Some(id))
    }
}

/// Reads and acknowledges the next async event of `ctx`, whose async fd is
/// non-blocking: `Ok(None)` when none is pending.
pub(crate) fn next_async_event(ctx: &ContextInner) -> Result<Option<AsyncEvent>> {
    let mut event = MaybeUninit::<sys::ibv_async_event>::zeroed();
    clear_errno();
    // SAFETY: the context is open; `event` is a valid out-parameter. With
    // the fd non-blocking this returns -1 (EAGAIN) when nothing is pending.
    let ret = unsafe { sys::ibv_get_async_event(ctx.as_ptr(), event.as_mut_ptr()) };
    if ret != 0 {
        return match errno_or_eio() {
            libc::EAGAIN => Ok(None),
            e => Err(verb_error("ibv_get_async_event", ctx.name(), e)),
        };
    }
    let ptr = event.as_mut_ptr();
    // SAFETY: the library wrote the event. `event_type` is read as the
    // plain u32 the C enum is (the binding's Rust enum would make a value
    // newer than it knows undefined behaviour); the union's active member
    // is the one the type names.
    let code = unsafe { (&raw const (*ptr).event_type).cast::<u32>().read() };
    // SAFETY: as above: every member of the union is a pointer or an int
    // in its first 8 bytes, read as the one the event type selects.
    let element = unsafe { (&raw const (*ptr).element).cast::<u64>().read() };
    let object = match AsyncEvent::affiliation(code) {
        EventAffiliation::Qp => {
            let qp = element as *mut sys::ibv_qp;
            if qp.is_null() {
                0
            } else {
                // SAFETY: a QP event names a live QP, which cannot be
                // destroyed until the event is acked (below).
                u64::from(unsafe { (*qp).qp_num })
            }
        }
        // The CQ's and SRQ's address, as their handles report it.
        EventAffiliation::Cq | EventAffiliation::Srq | EventAffiliation::Wq => element,
        // `port_num` is an int in the union's first 4 bytes.
        EventAffiliation::Port => u64::from(element as u32),
        EventAffiliation::Device => 0,
    };
    // SAFETY: the event came from ibv_get_async_event and is acked once.
    unsafe { sys::ibv_ack_async_event(ptr) };
    let event = AsyncEvent::from_native(code, object);
    tracing::debug!(device = %ctx.name(), ?event, "async event");
    Ok(Some(event))
}

/// [`VerbsError::InvalidArgument`] for a channel of another device.
pub(crate) fn foreign_channel(channel: &ChannelInner, ctx: &ContextInner) -> VerbsError {
    VerbsError::invalid(
        "ibv_create_cq",
        format!(
            "a completion channel of {} cannot serve a CQ of {}",
            channel.ctx.name(),
            ctx.name()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The HAL's numbering is rdma-core's `enum ibv_event_type`.
    #[test]
    fn event_codes_are_rdma_cores() {
        use sys::ibv_event_type as t;
        let pairs = [
            (t::IBV_EVENT_CQ_ERR, AsyncEvent::CqError { cq: 0 }),
            (t::IBV_EVENT_QP_FATAL, AsyncEvent::QpFatal { qp_num: 0 }),
            (
                t::IBV_EVENT_QP_REQ_ERR,
                AsyncEvent::QpRequestError { qp_num: 0 },
            ),
            (
                t::IBV_EVENT_QP_ACCESS_ERR,
                AsyncEvent::QpAccessError { qp_num: 0 },
            ),
            (
                t::IBV_EVENT_PATH_MIG,
                AsyncEvent::PathMigrated { qp_num: 0 },
            ),
            (t::IBV_EVENT_DEVICE_FATAL, AsyncEvent::DeviceFatal),
            (t::IBV_EVENT_PORT_ACTIVE, AsyncEvent::PortActive { port: 0 }),
            (t::IBV_EVENT_PORT_ERR, AsyncEvent::PortError { port: 0 }),
            (
                t::IBV_EVENT_SRQ_LIMIT_REACHED,
                AsyncEvent::SrqLimitReached { srq: 0 },
            ),
            (
                t::IBV_EVENT_QP_LAST_WQE_REACHED,
                AsyncEvent::QpLastWqeReached { qp_num: 0 },
            ),
            (
                t::IBV_EVENT_CLIENT_REREGISTER,
                AsyncEvent::ClientReregister { port: 0 },
            ),
            (t::IBV_EVENT_GID_CHANGE, AsyncEvent::GidChange { port: 0 }),
        ];
        for (native, event) in pairs {
            assert_eq!(native as u32, event.code(), "{event:?}");
            assert_eq!(AsyncEvent::from_native(native as u32, 0), event);
        }
    }
}
