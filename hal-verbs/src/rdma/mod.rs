//! The real verbs backend, over rdma-core's libibverbs.
//!
//! The library is reached through `rdma-mummy-sys`, which links a small static
//! shim that `dlopen`s `libibverbs.so.1` when the process starts: a binary
//! built with this backend runs on a machine without rdma-core, and
//! [`RdmaProvider::load`] then reports [`VerbsError::LibraryUnavailable`]
//! instead of every call failing in silence (the shim's stubs return
//! NULL/-1 with errno `EOPNOTSUPP` when a symbol was not found).
//!
//! Object lifetimes follow sideway: every handle owns its parents through an
//! [`Arc`](std::sync::Arc) (an MR its PD, a QP its PD and CQs, a PD or CQ the
//! device context), so handles may be dropped in any order; each `Drop`
//! destroys exactly its own native object, after which its parents' `Arc`s
//! are released, children before parents. `Drop` never panics: a failure is
//! logged with `tracing::warn!`.
//!
//! Measured on SoftRoCE (`rxe0`, Debian kernel 6.1, rdma-core 44, in the VM
//! of `softroce/run-in-vm.sh`; `tests/tests/rxe_verbs.rs` checks them):
//! - with the library but no RDMA subsystem, `ibv_get_device_list` returns
//!   NULL with `ENOSYS` ([`VerbsError::NoDevice`]); a library that cannot be
//!   loaded, or loads without the verbs symbols, is
//!   [`VerbsError::LibraryUnavailable`] from [`RdmaProvider::load`];
//! - the GID table holds RoCE v2 entries only (the netdev's IPv6 link-local
//!   address, then its IPv4 address), no RoCE v1 twins;
//! - `ibv_create_qp` grants exactly the `max_send_wr` asked (8), yet the
//!   queue takes 15 before `ibv_post_send` fails with `ENOMEM`
//!   ([`VerbsError::QueueFull`], whose `depth` is the granted figure): the
//!   granted depth is a floor, not the point of failure;
//! - `ibv_reg_dmabuf_mr` fails with `EOPNOTSUPP`
//!   ([`VerbsError::NotSupported`]);
//! - WRITE/READ past an MR's end, and WRITE into an MR without
//!   REMOTE_WRITE, complete with status 10 (remote access error), move no
//!   byte, and leave the requester QP in ERROR; the completion's opcode is
//!   then undefined (rxe reports 0). The responder QP goes to ERROR too
//!   (IBA class C), its posted receive completing as `WR_FLUSH_ERR`;
//! - a receive posted to a QP already in ERROR is never flushed (librxe
//!   posts receives in user space and nothing runs the responder again);
//!   a send posted then is. Hence [`crate::drain`]'s receive marker goes in
//!   before the move to ERROR;
//! - `max_inline_data` 64 is granted as asked; above it librxe answers
//!   EINVAL (libmlx5 answers ENOMEM), so the HAL checks it first;
//! - `max_qp_rd_atom` is 128, the active MTU 1024 on a 1500-byte netdev;
//!   a READ depth asked above it is clamped to 128 before `ibv_modify_qp`
//!   (rxe refuses more with EINVAL), and `ibv_query_qp` reports the 128;
//! - `max_send_sge` 3 is granted as 4 (`QpCaps` holds the granted figures);
//! - `num_comp_vectors` is the guest's CPU count (2), and `cq_mod_caps` are
//!   zero: CQ moderation is [`VerbsError::NotSupported`], refused before
//!   `ibv_modify_cq` (which rxe does not implement);
//! - completion channels: an armed CQ fires once, a completion already in
//!   the CQ when it is armed fires nothing, a solicited-only arm ignores an
//!   unsolicited SEND (`tests/tests/rxe_events.rs`);
//! - async events: taking the netdev down raises `IBV_EVENT_PORT_ERR` (the
//!   port leaves ACTIVE), up again `IBV_EVENT_PORT_ACTIVE`; while it is
//!   down, RTR fails with ENETUNREACH ([`VerbsError::Os`]) and a WRITE on
//!   an established QP completes at once with `LOC_QP_OP_ERR`; a responder's
//!   remote access error moves its QP to ERROR but raises no event (IBA
//!   and mlx5 raise `IBV_EVENT_QP_ACCESS_ERR`); rxe cannot be made fatal
//!   while a process holds it;
//! - a QP in ERROR goes to RESET and back to RTS, towards the same or a new
//!   peer, and transfers again.
//!
//! The layout: `device` holds the provider and the opened device (device
//! list, attributes, ports, GID table), `events` completion channels and
//! async events, `memory` the protection domain and
//! memory registrations, `queue` completion queues and queue pairs (state
//! transitions, linked posts, completions), `cm` connection management over
//! librdmacm (also loaded by the shim; [`RdmaCm::load`] probes it).

mod cm;
mod device;
mod events;
mod memory;
mod queue;

pub use cm::{RdmaCm, RdmaConnectRequest, RdmaConnection, RdmaListener};
pub use device::{RdmaContext, RdmaProvider};
pub use events::RdmaCompChannel;
pub use memory::{RdmaMr, RdmaPd};
pub use queue::{RdmaCq, RdmaQp};

use crate::error::VerbsError;

/// The rdma-core backend: libibverbs loaded at run time.
#[derive(Debug)]
pub struct RdmaApi;

impl crate::Api for RdmaApi {
    type Provider = RdmaProvider;
    type Context = RdmaContext;
    type ProtectionDomain = RdmaPd;
    type MemoryRegion = RdmaMr;
    type CompletionQueue = RdmaCq;
    type CompletionChannel = RdmaCompChannel;
    type QueuePair = RdmaQp;
    type ConnectionManager = RdmaCm;
    type Listener = RdmaListener;
    type ConnectRequest = RdmaConnectRequest;
    type Connection = RdmaConnection;
}

/// The library the shim loads, as named in errors.
pub(crate) const LIBIBVERBS: &str = "libibverbs.so.1";

/// The calling thread's errno.
pub(crate) fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Clears errno, so a NULL return that did not set it is told apart.
pub(crate) fn clear_errno() {
    // SAFETY: `__errno_location` returns the calling thread's errno slot,
    // valid for the thread's lifetime; writing an int to it is what C does.
    unsafe { *libc::__errno_location() = 0 };
}

/// The errno of a verb that returned NULL (or -1): errno, or `EIO` when the
/// library returned failure without setting it.
pub(crate) fn errno_or_eio() -> i32 {
    match errno() {
        0 => libc::EIO,
        e => e,
    }
}

/// The errno behind a verb's `int` return value. rdma-core returns the errno
/// itself (positive) from most verbs, a negated errno from some provider
/// paths, and -1 with errno set from the rest.
pub(crate) fn ret_errno(ret: i32) -> i32 {
    match ret {
        -1 => errno_or_eio(),
        r if r < 0 => r.checked_neg().unwrap_or(libc::EIO),
        r => r,
    }
}

/// Maps a failed verb to the HAL's error, naming the device.
pub(crate) fn verb_error(operation: &'static str, device: &str, errno: i32) -> VerbsError {
    VerbsError::from_errno(operation, device, errno)
}
