//! Connection management over librdmacm (rdma_cm): listen, connect, accept
//! with private data, disconnect, and the events in between, every wait
//! bounded.
//!
//! # Choices
//!
//! - **Our queue pair, not rdma_cm's.** `rdma_create_qp` needs a PD of
//!   librdmacm's own `ibv_context` for the device (it checks
//!   `id->verbs == pd->context`), but the caller's PD and CQs come from the
//!   context [`RdmaProvider::open`](super::RdmaProvider) opened. So the queue
//!   pair is created with plain `ibv_create_qp` in the caller's PD, its
//!   number goes in the connect/accept parameters, and we drive it through
//!   INIT, RTR and RTS ourselves with the attributes `rdma_init_qp_attr`
//!   gives (port, GID index, path MTU, PSNs, negotiated READ depths), as
//!   librdmacm does for its own queue pairs. The active side then sees
//!   `CONNECT_RESPONSE` (not `ESTABLISHED`) and confirms with
//!   `rdma_establish`. The device must match: the cm_id's device name is
//!   compared with the PD's, and a mismatch is `InvalidArgument`.
//! - **Retry policy in the queue pair.** The RTS attributes from the CM are
//!   overridden with [`ConnectParams::retry_count`] and
//!   [`ConnectParams::rnr_retry_count`] on both sides (the passive side
//!   would otherwise inherit the requester's), and with
//!   [`ConnectParams::ack_timeout`] where given (by default 14, ~67 ms a
//!   try, instead of the 19 the CM derives on rxe: see its docs for what
//!   that changes). `retry_count` 7 is refused.
//!
//! Measured on SoftRoCE (`tests/tests/rxe_cm.rs`, one guest and two guests
//! under TCG): REQ private data arrives padded to 56 bytes and REP to 196
//! (hence the framing); a client started before its server sees REJECTED
//! with status 8 until it listens; connect + accept in one guest ~0.1-0.2 s;
//! a disconnect is seen by the peer in ~10 ms; a killed peer guest surfaces
//! on the client as completion status 12 after retry_count + 1 ACK timeouts
//! (0.27 s with 14, 9.3 s with 19, retry_count 3), while the connection's
//! state stays `Connected` (no DREQ comes from a dead host): the queue pair
//! error is the signal.
//! - **One event channel per listener, per connect request and per
//!   connection** (a request's cm_id is migrated off the listener's channel
//!   with `rdma_migrate_id`), its fd non-blocking and waited on with
//!   `poll(2)`: no call blocks past its deadline. Events are copied and
//!   acknowledged at once (so `rdma_destroy_id`, which waits for
//!   acknowledgements, never hangs).
//! - **Private data is framed** with one length byte: the wire pads REQ
//!   private data to 56 bytes and REP to 196, and a peer would otherwise see
//!   the zeros. Hence 55 and 195 bytes for the caller
//!   ([`crate::MAX_CONNECT_PRIVATE_DATA`], [`crate::MAX_ACCEPT_PRIVATE_DATA`]).
//!   Data whose first byte does not fit as a length is handed over raw.
//! - **Connect retries** what means "not listening yet": `REJECTED` with a
//!   reason other than 28 (consumer defined; 8, invalid service id, is what
//!   a host with no listener on the port answers), `UNREACHABLE`,
//!   `CONNECT_ERROR`, `ADDR_ERROR`, `ROUTE_ERROR`, and no answer, each with
//!   a fresh cm_id and queue pair, backing off from 50 ms to 1 s, until
//!   [`ConnectParams::timeout`]; then [`VerbsError::Timeout`] naming the
//!   last reason. A consumer reject is [`VerbsError::ConnectionRejected`].
//! - **Drop order** of a connection: disconnect (queue pair to ERROR, then
//!   `rdma_disconnect`), destroy the queue pair, destroy the cm_id, destroy
//!   the channel. A request dropped unanswered is rejected. Nothing panics;
//!   failures are logged.

use std::ffi::{CStr, c_int, c_void};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdma_mummy_sys as sys;

use super::device::load_failure_reason;
use super::memory::RdmaPd;
use super::queue::{RdmaCq, RdmaQp};
use super::{RdmaApi, clear_errno, errno_or_eio, verb_error};
use crate::api::{ConnectRequest, Connection, ConnectionManager, Listener, QueuePair};
use crate::error::{Result, VerbsError};
use crate::types::{
    ConnectParams, ConnectionState, LinkLayer, MAX_ACCEPT_PRIVATE_DATA, MAX_CONNECT_PRIVATE_DATA,
    MAX_REJECT_PRIVATE_DATA,
};

/// The library the shim loads, as named in errors.
pub(crate) const LIBRDMACM: &str = "librdmacm.so.1";

/// IB CM reject reason of a reject by the peer's application.
const REJ_CONSUMER_DEFINED: c_int = 28;

/// The connection manager of the rdma-core backend (librdmacm).
#[derive(Debug, Clone)]
pub struct RdmaCm {
    /// Bumped by `abort_connects`: a connect that sees it changed since it
    /// began ends at its next look (every `ABORT_CHECK`).
    aborts: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// How often a connect's waits look whether it was aborted.
const ABORT_CHECK: Duration = Duration::from_millis(50);

impl RdmaCm {
    /// Checks that librdmacm was loaded by the shim and has its entry
    /// points; [`VerbsError::LibraryUnavailable`] otherwise.
    pub fn load() -> Result<Self> {
        let name = c"librdmacm.so.1";
        // SAFETY: NUL-terminated name; RTLD_NOLOAD only finds an object the
        // shim's constructor already loaded, running no initialisers.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if handle.is_null() {
            return Err(VerbsError::LibraryUnavailable {
                library: LIBRDMACM,
                reason: load_failure_reason(name),
            });
        }
        // SAFETY: a live handle; NUL-terminated symbol names. Only compared
        // with NULL.
        let found = [
            c"rdma_create_event_channel",
            c"rdma_init_qp_attr",
            c"rdma_migrate_id",
        ]
        .iter()
        .all(|sym| !unsafe { libc::dlsym(handle, sym.as_ptr()) }.is_null());
        // SAFETY: balances the NOLOAD dlopen above; the shim keeps its own
        // reference.
        unsafe { libc::dlclose(handle) };
        if !found {
            return Err(VerbsError::LibraryUnavailable {
                library: LIBRDMACM,
                reason: "the library that loaded lacks rdma_cm entry points".into(),
            });
        }
        Ok(Self {
            aborts: Default::default(),
        })
    }
}

// ------------------------------------------------------------ raw helpers

fn ms(d: Duration) -> c_int {
    c_int::try_from(d.as_millis().max(1)).unwrap_or(c_int::MAX)
}

/// A librdmacm call that returned -1 with errno.
fn cm_error(operation: &'static str, device: &str) -> VerbsError {
    match errno_or_eio() {
        libc::EOPNOTSUPP => VerbsError::LibraryUnavailable {
            library: LIBRDMACM,
            reason: format!("{operation} failed with EOPNOTSUPP (not loaded?)"),
        },
        e => verb_error(operation, device, e),
    }
}

/// Frames private data with its length byte (see the module docs).
fn frame(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 1);
    out.push(u8::try_from(data.len()).unwrap_or(u8::MAX));
    out.extend_from_slice(data);
    out
}

/// The bytes a peer framed, or the raw bytes when they are not framed.
fn unframe(raw: &[u8]) -> Vec<u8> {
    match raw.split_first() {
        Some((&n, rest)) if usize::from(n) <= rest.len() => rest[..usize::from(n)].to_vec(),
        _ => raw.to_vec(),
    }
}

fn event_name(kind: u32) -> &'static str {
    use sys::rdma_cm_event_type as t;
    match kind {
        t::RDMA_CM_EVENT_ADDR_RESOLVED => "ADDR_RESOLVED",
        t::RDMA_CM_EVENT_ADDR_ERROR => "ADDR_ERROR",
        t::RDMA_CM_EVENT_ROUTE_RESOLVED => "ROUTE_RESOLVED",
        t::RDMA_CM_EVENT_ROUTE_ERROR => "ROUTE_ERROR",
        t::RDMA_CM_EVENT_CONNECT_REQUEST => "CONNECT_REQUEST",
        t::RDMA_CM_EVENT_CONNECT_RESPONSE => "CONNECT_RESPONSE",
        t::RDMA_CM_EVENT_CONNECT_ERROR => "CONNECT_ERROR",
        t::RDMA_CM_EVENT_UNREACHABLE => "UNREACHABLE",
        t::RDMA_CM_EVENT_REJECTED => "REJECTED",
        t::RDMA_CM_EVENT_ESTABLISHED => "ESTABLISHED",
        t::RDMA_CM_EVENT_DISCONNECTED => "DISCONNECTED",
        t::RDMA_CM_EVENT_DEVICE_REMOVAL => "DEVICE_REMOVAL",
        t::RDMA_CM_EVENT_ADDR_CHANGE => "ADDR_CHANGE",
        t::RDMA_CM_EVENT_TIMEWAIT_EXIT => "TIMEWAIT_EXIT",
        _ => "OTHER",
    }
}

/// A socket address as the C calls take it.
fn to_sockaddr(addr: &SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain integers; all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for any
            // sockaddr type; we write one sockaddr_in at its start.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo().to_be(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for a sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
        }
    }
    ss
}

/// A socket address from a `sockaddr_storage` the library filled in.
fn from_sockaddr(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    let ptr = (ss as *const libc::sockaddr_storage).cast::<u8>();
    match c_int::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says a sockaddr_in is at the start; the
            // storage is large enough and aligned.
            let sin = unsafe { std::ptr::read(ptr.cast::<libc::sockaddr_in>()) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for a sockaddr_in6.
            let sin6 = unsafe { std::ptr::read(ptr.cast::<libc::sockaddr_in6>()) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                u32::from_be(sin6.sin6_flowinfo),
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

fn unspecified() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0))
}

// ------------------------------------------------------------ event channel

/// One event, copied out of the library and already acknowledged.
struct Event {
    /// The cm_id it is about (a new one for CONNECT_REQUEST).
    id: *mut sys::rdma_cm_id,
    kind: u32,
    /// Negative errno for the *_ERROR events, the reject reason for REJECTED.
    status: c_int,
    /// Private data as it came off the wire (padded).
    private_data: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("kind", &event_name(self.kind))
            .field("status", &self.status)
            .field("private_data_len", &self.private_data.len())
            .finish()
    }
}

/// An `rdma_event_channel` whose fd is non-blocking.
struct Channel {
    ch: *mut sys::rdma_event_channel,
}

impl Channel {
    fn new() -> Result<Self> {
        clear_errno();
        // SAFETY: no arguments; NULL on failure.
        let ch = unsafe { sys::rdma_create_event_channel() };
        if ch.is_null() {
            return Err(cm_error("rdma_create_event_channel", "-"));
        }
        let channel = Self { ch };
        let fd = channel.fd();
        // SAFETY: `fd` is the channel's open descriptor; F_GETFL/F_SETFL
        // take and return plain ints.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(verb_error("fcntl(O_NONBLOCK)", "-", errno_or_eio()));
        }
        Ok(channel)
    }

    fn fd(&self) -> c_int {
        // SAFETY: the channel is live while `self` is.
        unsafe { (*self.ch).fd }
    }

    /// The next event, waiting up to `timeout`; `Ok(None)` when none came.
    fn next(&self, timeout: Duration) -> Result<Option<Event>> {
        self.next_or_woken(timeout, None)
    }

    /// [`Channel::next`], also ending (`Ok(None)`) once `wake` (an eventfd)
    /// is readable; its count is taken.
    fn next_or_woken(&self, timeout: Duration, wake: Option<c_int>) -> Result<Option<Event>> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut ev: *mut sys::rdma_cm_event = std::ptr::null_mut();
            clear_errno();
            // SAFETY: a live channel; `ev` is a valid out-parameter. The fd
            // is non-blocking, so this returns at once.
            let ret = unsafe { sys::rdma_get_cm_event(self.ch, &mut ev) };
            if ret == 0 && !ev.is_null() {
                // SAFETY: a live event from the library, read before it is
                // acknowledged; for connection events the union holds
                // `conn`, whose private data (if any) is `private_data_len`
                // bytes owned by the event.
                let event = unsafe {
                    let e = &*ev;
                    let conn = e.param.conn;
                    let private_data = if conn.private_data.is_null() || conn.private_data_len == 0
                    {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(
                            conn.private_data.cast::<u8>(),
                            usize::from(conn.private_data_len),
                        )
                        .to_vec()
                    };
                    Event {
                        id: e.id,
                        kind: e.event,
                        status: e.status,
                        private_data,
                        responder_resources: conn.responder_resources,
                        initiator_depth: conn.initiator_depth,
                    }
                };
                // SAFETY: acknowledges the event we got above, once; nothing
                // of it is used afterwards.
                if unsafe { sys::rdma_ack_cm_event(ev) } != 0 {
                    tracing::warn!(errno = errno_or_eio(), "rdma_ack_cm_event failed");
                }
                tracing::trace!(?event, "rdma_cm event");
                return Ok(Some(event));
            }
            let e = errno_or_eio();
            if e != libc::EAGAIN && e != libc::EINTR {
                return Err(cm_error("rdma_get_cm_event", "-"));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let mut pfds = [
                libc::pollfd {
                    fd: self.fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    // A negative fd is ignored by poll.
                    fd: wake.unwrap_or(-1),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two valid pollfds, for the given count.
            let n = unsafe { libc::poll(pfds.as_mut_ptr(), 2, ms(deadline - now)) };
            if n < 0 && errno_or_eio() != libc::EINTR {
                return Err(verb_error("poll(rdma_cm channel)", "-", errno_or_eio()));
            }
            if let Some(fd) = wake
                && pfds[1].revents & libc::POLLIN != 0
            {
                let mut count = 0u64;
                // SAFETY: reads the eventfd's 8-byte count into `count`;
                // the fd is non-blocking and lives while the listener does.
                unsafe { libc::read(fd, (&raw mut count).cast(), 8) };
                return Ok(None);
            }
        }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: created by rdma_create_event_channel, destroyed once, after
        // every cm_id on it (they are dropped before their channel).
        unsafe { sys::rdma_destroy_event_channel(self.ch) };
    }
}

/// A cm_id and the channel its events arrive on. Dropping destroys the id,
/// then the channel.
struct CmId {
    id: *mut sys::rdma_cm_id,
    channel: Channel,
}

// SAFETY: librdmacm serialises operations on one cm_id internally, and the
// channel is read by one caller at a time (each owner holds a Mutex around
// `Channel::next`, or owns the CmId exclusively). Pointers are never
// reassigned and are freed only in Drop.
unsafe impl Send for CmId {}
// SAFETY: see Send.
unsafe impl Sync for CmId {}

impl CmId {
    fn new() -> Result<Self> {
        let channel = Channel::new()?;
        let mut id: *mut sys::rdma_cm_id = std::ptr::null_mut();
        clear_errno();
        // SAFETY: a live channel, a valid out-parameter, no user context.
        let ret = unsafe {
            sys::rdma_create_id(
                channel.ch,
                &mut id,
                std::ptr::null_mut(),
                sys::rdma_port_space::RDMA_PS_TCP,
            )
        };
        if ret != 0 || id.is_null() {
            return Err(cm_error("rdma_create_id", "-"));
        }
        Ok(Self { id, channel })
    }

    /// Moves a connect request's new cm_id off the listener's channel onto
    /// its own. On failure the id is rejected and destroyed.
    fn adopt(id: *mut sys::rdma_cm_id) -> Result<Self> {
        let fail = |e: VerbsError| {
            // SAFETY: `id` is the live, unanswered cm_id of a request,
            // owned by us and destroyed once here.
            unsafe {
                sys::rdma_reject(id, std::ptr::null(), 0);
                sys::rdma_destroy_id(id);
            }
            e
        };
        let channel = Channel::new().map_err(fail)?;
        clear_errno();
        // SAFETY: both live; the request's event was acknowledged, so the
        // migration does not wait on it.
        if unsafe { sys::rdma_migrate_id(id, channel.ch) } != 0 {
            return Err(fail(cm_error("rdma_migrate_id", "-")));
        }
        Ok(Self { id, channel })
    }

    /// The device the id is bound to, once it is.
    fn device(&self) -> Option<String> {
        // SAFETY: the id is live; `verbs` is NULL until bound, else a
        // context librdmacm keeps open, whose device name is NUL-terminated
        // and copied out at once.
        unsafe {
            let verbs = (*self.id).verbs;
            if verbs.is_null() {
                return None;
            }
            let name = sys::ibv_get_device_name((*verbs).device);
            (!name.is_null()).then(|| CStr::from_ptr(name).to_string_lossy().into_owned())
        }
    }

    fn port(&self) -> u8 {
        // SAFETY: the id is live.
        unsafe { (*self.id).port_num }
    }

    fn src_addr(&self) -> SocketAddr {
        // SAFETY: the id is live; the union's storage view covers all forms
        // and the library zero-initialises it.
        let ss = unsafe { (*self.id).route.addr.src_addr_union.src_storage };
        from_sockaddr(&ss).unwrap_or_else(unspecified)
    }

    fn dst_addr(&self) -> SocketAddr {
        // SAFETY: as in `src_addr`.
        let ss = unsafe { (*self.id).route.addr.dst_addr_union.dst_storage };
        from_sockaddr(&ss).unwrap_or_else(unspecified)
    }

    /// Waits until deadline for an event on this id (events of other ids,
    /// stale ones from destroyed attempts, are dropped).
    fn wait(&self, deadline: Instant) -> Result<Option<Event>> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.channel.next(left)? {
                Some(ev) if ev.id == self.id => return Ok(Some(ev)),
                Some(ev) => tracing::debug!(?ev, "rdma_cm event of another id; dropped"),
                None => return Ok(None),
            }
        }
    }

    /// [`CmId::wait`] that also ends, with `None`, once `aborted` says so
    /// (looked at every [`ABORT_CHECK`]).
    fn wait_or(&self, deadline: Instant, aborted: &dyn Fn() -> bool) -> Result<Option<Event>> {
        loop {
            let now = Instant::now();
            if now >= deadline || aborted() {
                return Ok(None);
            }
            let slice = (deadline - now).min(ABORT_CHECK);
            match self.channel.next(slice)? {
                Some(ev) if ev.id == self.id => return Ok(Some(ev)),
                Some(ev) => tracing::debug!(?ev, "rdma_cm event of another id; dropped"),
                None => {}
            }
        }
    }

    /// Attributes for moving a queue pair to `state`, from the CM.
    fn init_qp_attr(&self, state: u32) -> Result<(sys::ibv_qp_attr, c_int)> {
        // SAFETY: ibv_qp_attr is integers and unions of them; all-zero is
        // valid.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = state;
        let mut mask: c_int = 0;
        clear_errno();
        // SAFETY: a live id; both out-parameters are valid.
        if unsafe { sys::rdma_init_qp_attr(self.id, &mut attr, &mut mask) } != 0 {
            return Err(cm_error(
                "rdma_init_qp_attr",
                &self.device().unwrap_or_default(),
            ));
        }
        Ok((attr, mask))
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: created by rdma_create_id (or handed over by a connect
        // request), destroyed once; every event was acknowledged when read,
        // so this does not wait. The channel is destroyed after, as a field.
        if unsafe { sys::rdma_destroy_id(self.id) } != 0 {
            tracing::warn!(
                errno = errno_or_eio(),
                "rdma_destroy_id failed; the cm_id leaks"
            );
        }
    }
}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmId")
            .field("device", &self.device())
            .field("src", &self.src_addr())
            .field("dst", &self.dst_addr())
            .finish()
    }
}

// ------------------------------------------------------------ queue pair

fn check_device(cm: &CmId, pd: &RdmaPd, operation: &'static str) -> Result<String> {
    let ours = pd.inner.context().name().to_owned();
    match cm.device() {
        Some(dev) if dev == ours => Ok(dev),
        Some(dev) => Err(VerbsError::invalid(
            operation,
            format!(
                "rdma_cm put this connection on {dev}, but the PD is of {ours}: \
                 allocate the PD (and register memory) on {dev}"
            ),
        )),
        None => Err(VerbsError::invalid(
            operation,
            "the cm_id is bound to no device",
        )),
    }
}

/// RESET (or INIT) → INIT, with our access rights.
fn qp_init(cm: &CmId, qp: &RdmaQp, params: &ConnectParams) -> Result<()> {
    let (mut attr, mut mask) = cm.init_qp_attr(sys::ibv_qp_state::IBV_QPS_INIT)?;
    attr.qp_access_flags = params.access.bits();
    mask |= c_int::try_from(sys::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0).unwrap_or(0);
    qp.modify_raw("ibv_modify_qp(INIT)", &mut attr, mask)
}

/// INIT → RTR with the CM's path, optionally overriding the READ depth.
fn qp_rtr(cm: &CmId, qp: &RdmaQp, params: &ConnectParams, dest_rd: Option<u8>) -> Result<()> {
    // Refresh INIT first, as librdmacm does: once the CM has its own state
    // for the connection, the INIT attributes may differ from the first.
    qp_init(cm, qp, params)?;
    let (mut attr, mut mask) = cm.init_qp_attr(sys::ibv_qp_state::IBV_QPS_RTR)?;
    // librdmacm's workaround for old rdma_ucm kernels: bits 21-24 of the
    // mask are RoCE-only.
    if qp.pd().context().link_layer(cm.port().max(1))? == LinkLayer::InfiniBand {
        mask &= !0x00e0_0000;
    }
    if let Some(d) = dest_rd {
        attr.max_dest_rd_atomic = d;
    }
    qp.modify_raw("ibv_modify_qp(RTR)", &mut attr, mask)
}

/// RTR → RTS with our retry policy.
fn qp_rts(cm: &CmId, qp: &RdmaQp, params: &ConnectParams, init_rd: Option<u8>) -> Result<()> {
    use sys::ibv_qp_attr_mask as m;
    let (mut attr, mut mask) = cm.init_qp_attr(sys::ibv_qp_state::IBV_QPS_RTS)?;
    attr.retry_cnt = params.retry_count;
    attr.rnr_retry = params.rnr_retry_count;
    let mut extra = m::IBV_QP_RETRY_CNT.0 | m::IBV_QP_RNR_RETRY.0;
    if let Some(t) = params.ack_timeout {
        attr.timeout = t;
        extra |= m::IBV_QP_TIMEOUT.0;
    } else if attr.timeout == 0 {
        // 0 disables the ACK timer (a dead peer is retried forever): never
        // take it from the CM either; use the HAL's default instead.
        tracing::debug!(
            qp_num = qp.qp_num(),
            "rdma_cm derived ACK timeout 0; using 14"
        );
        attr.timeout = crate::types::RtsParams::default().timeout;
        extra |= m::IBV_QP_TIMEOUT.0;
    }
    if let Some(d) = init_rd {
        attr.max_rd_atomic = d;
    }
    mask |= c_int::try_from(extra).unwrap_or(0);
    tracing::debug!(
        qp_num = qp.qp_num(),
        timeout = attr.timeout,
        retry_cnt = attr.retry_cnt,
        rnr_retry = attr.rnr_retry,
        max_rd_atomic = attr.max_rd_atomic,
        "RTS from rdma_cm"
    );
    qp.modify_raw("ibv_modify_qp(RTS)", &mut attr, mask)
}

fn conn_param(
    private_data: &[u8],
    params: &ConnectParams,
    responder_resources: u8,
    initiator_depth: u8,
    qp_num: u32,
) -> sys::rdma_conn_param {
    sys::rdma_conn_param {
        private_data: private_data.as_ptr().cast::<c_void>(),
        private_data_len: u8::try_from(private_data.len()).unwrap_or(u8::MAX),
        responder_resources,
        initiator_depth,
        flow_control: 1,
        retry_count: params.retry_count,
        rnr_retry_count: params.rnr_retry_count,
        srq: 0,
        qp_num,
    }
}

fn clamp(asked: u8, limit: u32) -> u8 {
    let limit = u8::try_from(limit).unwrap_or(u8::MAX);
    if limit == 0 { asked } else { asked.min(limit) }
}

// ------------------------------------------------------------ connect

/// What one connect attempt came to.
enum Attempt {
    /// Not listening yet, unreachable, no answer: try again.
    Retry(String),
    /// Anything else: give up.
    Fatal(VerbsError),
}

impl From<VerbsError> for Attempt {
    fn from(e: VerbsError) -> Self {
        Self::Fatal(e)
    }
}

struct ConnectArgs<'a> {
    peer: SocketAddr,
    pd: &'a RdmaPd,
    send_cq: &'a RdmaCq,
    recv_cq: &'a RdmaCq,
    params: &'a ConnectParams,
    private_data: &'a [u8],
    deadline: Instant,
    /// Whether `abort_connects` was called since the connect began.
    aborted: &'a dyn Fn() -> bool,
}

impl RdmaCm {
    /// Resolves `peer` on a fresh cm_id (bound to `source` if given).
    fn resolve_addr(
        peer: SocketAddr,
        source: Option<IpAddr>,
        deadline: Instant,
        aborted: &dyn Fn() -> bool,
    ) -> std::result::Result<CmId, Attempt> {
        let cm = CmId::new()?;
        let mut dst = to_sockaddr(&peer);
        let mut src = source.map(|ip| to_sockaddr(&SocketAddr::new(ip, 0)));
        let src_ptr = src.as_mut().map_or(std::ptr::null_mut(), |s| {
            (s as *mut libc::sockaddr_storage).cast()
        });
        let left = deadline.saturating_duration_since(Instant::now());
        clear_errno();
        // SAFETY: a live id; the addresses are valid sockaddrs for the
        // call (the library copies them).
        let ret = unsafe {
            sys::rdma_resolve_addr(
                cm.id,
                src_ptr,
                (&mut dst as *mut libc::sockaddr_storage).cast(),
                ms(left.min(Duration::from_secs(2))),
            )
        };
        if ret != 0 {
            let e = errno_or_eio();
            return Err(match e {
                libc::ENETUNREACH | libc::EHOSTUNREACH | libc::ETIMEDOUT | libc::EAGAIN => {
                    Attempt::Retry(format!("rdma_resolve_addr: errno {e}"))
                }
                libc::EADDRNOTAVAIL | libc::ENODEV => Attempt::Fatal(VerbsError::NoDevice {
                    detail: format!("no RDMA device for a connection to {peer} (errno {e})"),
                }),
                _ => Attempt::Fatal(cm_error("rdma_resolve_addr", "-")),
            });
        }
        match cm.wait_or(deadline, aborted)? {
            Some(ev) if ev.kind == sys::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED => Ok(cm),
            Some(ev) => Err(Attempt::Retry(format!(
                "address resolution: {} (status {})",
                event_name(ev.kind),
                ev.status
            ))),
            None => Err(Attempt::Retry("address resolution: no answer".into())),
        }
    }

    fn try_connect(&self, a: &ConnectArgs<'_>) -> std::result::Result<RdmaConnection, Attempt> {
        use sys::rdma_cm_event_type as t;
        const OP: &str = "rdma_connect";
        let cm = Self::resolve_addr(a.peer, a.params.source, a.deadline, a.aborted)?;
        let device = check_device(&cm, a.pd, OP)?;
        let left = a.deadline.saturating_duration_since(Instant::now());
        clear_errno();
        // SAFETY: a live id whose address is resolved.
        if unsafe { sys::rdma_resolve_route(cm.id, ms(left.min(Duration::from_secs(2)))) } != 0 {
            return Err(Attempt::Retry(format!(
                "rdma_resolve_route: errno {}",
                errno_or_eio()
            )));
        }
        match cm.wait_or(a.deadline, a.aborted)? {
            Some(ev) if ev.kind == t::RDMA_CM_EVENT_ROUTE_RESOLVED => {}
            Some(ev) => {
                return Err(Attempt::Retry(format!(
                    "route resolution: {} (status {})",
                    event_name(ev.kind),
                    ev.status
                )));
            }
            None => return Err(Attempt::Retry("route resolution: no answer".into())),
        }
        let qp = RdmaQp::create(&a.pd.inner, &a.params.caps, a.send_cq, a.recv_cq)?;
        qp_init(&cm, &qp, a.params)?;
        let attrs = a.pd.inner.context().attrs();
        let framed = frame(a.private_data);
        let mut param = conn_param(
            &framed,
            a.params,
            clamp(a.params.responder_resources, attrs.max_qp_rd_atom),
            clamp(a.params.initiator_depth, attrs.max_qp_init_rd_atom),
            qp.qp_num(),
        );
        clear_errno();
        // SAFETY: a live id with a resolved route; `param` and the private
        // data it points to live across the call (the library copies them).
        if unsafe { sys::rdma_connect(cm.id, &mut param) } != 0 {
            return Err(Attempt::Fatal(cm_error(OP, &device)));
        }
        let ev = match cm.wait_or(a.deadline, a.aborted)? {
            Some(ev) => ev,
            None => return Err(Attempt::Retry("connect: no answer".into())),
        };
        match ev.kind {
            t::RDMA_CM_EVENT_CONNECT_RESPONSE => {}
            t::RDMA_CM_EVENT_REJECTED if ev.status == REJ_CONSUMER_DEFINED => {
                return Err(Attempt::Fatal(VerbsError::ConnectionRejected {
                    peer: a.peer.to_string(),
                    status: ev.status,
                    private_data: unframe(&ev.private_data),
                }));
            }
            kind => {
                return Err(Attempt::Retry(format!(
                    "connect: {} (status {})",
                    event_name(kind),
                    ev.status
                )));
            }
        }
        tracing::debug!(
            raw_len = ev.private_data.len(),
            "connect response; private data as received"
        );
        let peer_private_data = unframe(&ev.private_data);
        let finish = || -> Result<()> {
            qp_rtr(&cm, &qp, a.params, None)?;
            qp_rts(&cm, &qp, a.params, None)?;
            clear_errno();
            // SAFETY: a live id that got CONNECT_RESPONSE; this sends the RTU.
            if unsafe { sys::rdma_establish(cm.id) } != 0 {
                return Err(cm_error("rdma_establish", &device));
            }
            Ok(())
        };
        if let Err(e) = finish() {
            // SAFETY: a live id that got a REP we cannot honour: tell the
            // peer (best effort; the error is ours to report).
            unsafe { sys::rdma_reject(cm.id, std::ptr::null(), 0) };
            return Err(Attempt::Fatal(e));
        }
        Ok(RdmaConnection::new(qp, cm, device, peer_private_data))
    }
}

impl ConnectionManager<RdmaApi> for RdmaCm {
    fn abort_connects(&self) {
        self.aborts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    #[tracing::instrument(level = "debug", skip(self))]
    fn route_device(&self, peer: IpAddr, timeout: Duration) -> Result<String> {
        const OP: &str = "rdma_resolve_addr";
        let start = Instant::now();
        match Self::resolve_addr(SocketAddr::new(peer, 0), None, start + timeout, &|| false) {
            Ok(cm) => cm
                .device()
                .ok_or_else(|| VerbsError::invalid(OP, "resolved, yet bound to no device")),
            Err(Attempt::Fatal(e)) => Err(e),
            Err(Attempt::Retry(detail)) => Err(VerbsError::Timeout {
                operation: OP,
                waited: start.elapsed(),
                detail,
            }),
        }
    }

    #[tracing::instrument(level = "debug", skip(self))]
    fn listen(&self, addr: SocketAddr, backlog: u32) -> Result<RdmaListener> {
        let cm = CmId::new()?;
        let mut sa = to_sockaddr(&addr);
        clear_errno();
        // SAFETY: a live id; `sa` is a valid sockaddr for the call.
        if unsafe { sys::rdma_bind_addr(cm.id, (&mut sa as *mut libc::sockaddr_storage).cast()) }
            != 0
        {
            return Err(match errno_or_eio() {
                e @ (libc::EADDRNOTAVAIL | libc::ENODEV) => VerbsError::NoDevice {
                    detail: format!("no RDMA device has address {} (errno {e})", addr.ip()),
                },
                _ => cm_error("rdma_bind_addr", "-"),
            });
        }
        let backlog = c_int::try_from(backlog).unwrap_or(c_int::MAX);
        clear_errno();
        // SAFETY: a live, bound id.
        if unsafe { sys::rdma_listen(cm.id, backlog) } != 0 {
            return Err(cm_error("rdma_listen", &cm.device().unwrap_or_default()));
        }
        let local = cm.src_addr();
        tracing::debug!(%local, device = ?cm.device(), "listening");
        // SAFETY: eventfd takes no pointer; the fd returned is owned below.
        let wake = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake < 0 {
            return Err(verb_error("eventfd (listener wake)", "-", errno_or_eio()));
        }
        Ok(RdmaListener {
            local,
            cm: Mutex::new(cm),
            // SAFETY: a new fd nobody else owns.
            wake: unsafe { std::os::fd::OwnedFd::from_raw_fd(wake) },
        })
    }

    #[tracing::instrument(
        level = "info",
        name = "rdma_cm connect",
        skip(self, pd, send_cq, recv_cq, params, private_data),
        fields(device = %pd.inner.context().name(), private_len = private_data.len())
    )]
    fn connect(
        &self,
        peer: SocketAddr,
        pd: &RdmaPd,
        send_cq: &RdmaCq,
        recv_cq: &RdmaCq,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<RdmaConnection> {
        const OP: &str = "rdma_connect";
        params.validate(OP, private_data, MAX_CONNECT_PRIVATE_DATA)?;
        let start = Instant::now();
        let generation = self.aborts.load(std::sync::atomic::Ordering::SeqCst);
        let aborted = || self.aborts.load(std::sync::atomic::Ordering::SeqCst) != generation;
        let args = ConnectArgs {
            peer,
            pd,
            send_cq,
            recv_cq,
            params,
            private_data,
            deadline: start + params.timeout,
            aborted: &aborted,
        };
        let mut backoff = Duration::from_millis(50);
        let mut attempts = 0u32;
        let mut last: Option<String> = None;
        loop {
            attempts += 1;
            let why = match self.try_connect(&args) {
                Ok(conn) => {
                    tracing::info!(
                        attempts,
                        elapsed = ?start.elapsed(),
                        qp_num = conn.qp.qp_num(),
                        "connected"
                    );
                    return Ok(conn);
                }
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Retry(why)) => why,
            };
            tracing::debug!(attempts, why, "not connected yet; retrying");
            let now = Instant::now();
            // An attempt the deadline cut short says less than the one
            // before it (e.g. "no answer" after a series of rejects).
            if now < args.deadline || last.is_none() {
                last = Some(why);
            }
            if aborted() {
                return Err(VerbsError::Timeout {
                    operation: OP,
                    waited: now - start,
                    detail: format!(
                        "{attempts} attempt(s); aborted (abort_connects: the connection \
                         manager's owner is going)"
                    ),
                });
            }
            if now >= args.deadline {
                return Err(VerbsError::Timeout {
                    operation: OP,
                    waited: now - start,
                    detail: format!(
                        "{attempts} attempt(s); last answer: {}",
                        last.unwrap_or_default()
                    ),
                });
            }
            // In looks of ABORT_CHECK: an abort ends the back-off too.
            let until = now + backoff.min(args.deadline - now);
            while !aborted() && Instant::now() < until {
                std::thread::sleep(
                    ABORT_CHECK.min(until.saturating_duration_since(Instant::now())),
                );
            }
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }
}

// ------------------------------------------------------------ listen/accept

/// A listening cm_id.
#[derive(Debug)]
pub struct RdmaListener {
    local: SocketAddr,
    /// Held while reading the channel, so one caller at a time does.
    cm: Mutex<CmId>,
    /// Written by [`Listener::wake`]: ends a wait for a request.
    wake: std::os::fd::OwnedFd,
}

impl Listener<RdmaApi> for RdmaListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn wake(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from `one` to the listener's eventfd (a
        // full count cannot happen: each wait takes it).
        unsafe { libc::write(self.wake.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    #[tracing::instrument(level = "debug", skip(self), fields(local = %self.local))]
    fn next_request(&self, timeout: Duration) -> Result<RdmaConnectRequest> {
        const OP: &str = "rdma_get_request";
        let start = Instant::now();
        let deadline = start + timeout;
        let cm = self
            .cm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(ev) = cm
                .channel
                .next_or_woken(left, Some(self.wake.as_raw_fd()))?
            else {
                return Err(VerbsError::Timeout {
                    operation: OP,
                    waited: start.elapsed(),
                    detail: format!("no connect request on {}", self.local),
                });
            };
            match ev.kind {
                sys::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST => {
                    let new = CmId::adopt(ev.id)?;
                    let request = RdmaConnectRequest {
                        device: new.device().unwrap_or_default(),
                        peer: new.dst_addr(),
                        private_data: unframe(&ev.private_data),
                        their_responder_resources: ev.responder_resources,
                        their_initiator_depth: ev.initiator_depth,
                        cm: Some(new),
                    };
                    tracing::debug!(
                        peer = %request.peer,
                        device = %request.device,
                        raw_len = ev.private_data.len(),
                        "connect request"
                    );
                    return Ok(request);
                }
                sys::rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                    return Err(VerbsError::DeviceLost {
                        device: cm.device().unwrap_or_default(),
                        operation: OP,
                        errno: None,
                    });
                }
                _ => tracing::debug!(?ev, "listener event ignored"),
            }
        }
    }
}

/// A connect request taken from a listener, on its own channel. Dropping it
/// unanswered rejects it.
#[derive(Debug)]
pub struct RdmaConnectRequest {
    cm: Option<CmId>,
    device: String,
    peer: SocketAddr,
    private_data: Vec<u8>,
    their_responder_resources: u8,
    their_initiator_depth: u8,
}

impl RdmaConnectRequest {
    fn reject_raw(cm: &CmId, private_data: &[u8]) -> Result<()> {
        let framed = frame(private_data);
        let len = u8::try_from(framed.len()).unwrap_or(u8::MAX);
        clear_errno();
        // SAFETY: a live id of an unanswered request; the data lives across
        // the call.
        if unsafe { sys::rdma_reject(cm.id, framed.as_ptr().cast(), len) } != 0 {
            return Err(cm_error("rdma_reject", &cm.device().unwrap_or_default()));
        }
        Ok(())
    }
}

impl Drop for RdmaConnectRequest {
    fn drop(&mut self) {
        if let Some(cm) = self.cm.take()
            && let Err(e) = Self::reject_raw(&cm, &[])
        {
            tracing::warn!(%e, "rejecting a dropped connect request failed");
        }
    }
}

impl ConnectRequest<RdmaApi> for RdmaConnectRequest {
    fn private_data(&self) -> Vec<u8> {
        self.private_data.clone()
    }

    fn device(&self) -> String {
        self.device.clone()
    }

    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    #[tracing::instrument(
        level = "info",
        name = "rdma_cm accept",
        skip(self, pd, send_cq, recv_cq, params, private_data),
        fields(peer = %self.peer, device = %self.device, private_len = private_data.len())
    )]
    fn accept(
        mut self,
        pd: &RdmaPd,
        send_cq: &RdmaCq,
        recv_cq: &RdmaCq,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<RdmaConnection> {
        use sys::rdma_cm_event_type as t;
        const OP: &str = "rdma_accept";
        let start = Instant::now();
        // On any early return `self` drops and rejects the request.
        params.validate(OP, private_data, MAX_ACCEPT_PRIVATE_DATA)?;
        let cm_ref = self
            .cm
            .as_ref()
            .ok_or_else(|| VerbsError::invalid(OP, "request already answered"))?;
        let device = check_device(cm_ref, pd, OP)?;
        let attrs = pd.inner.context().attrs();
        // What the requester can take bounds what we offer.
        let responder_resources = clamp(
            params.responder_resources.min(self.their_initiator_depth),
            attrs.max_qp_rd_atom,
        );
        let initiator_depth = clamp(
            params.initiator_depth.min(self.their_responder_resources),
            attrs.max_qp_init_rd_atom,
        );
        let qp = RdmaQp::create(&pd.inner, &params.caps, send_cq, recv_cq)?;
        qp_init(cm_ref, &qp, params)?;
        qp_rtr(cm_ref, &qp, params, Some(responder_resources))?;
        qp_rts(cm_ref, &qp, params, Some(initiator_depth))?;
        let framed = frame(private_data);
        let mut param = conn_param(
            &framed,
            params,
            responder_resources,
            initiator_depth,
            qp.qp_num(),
        );
        clear_errno();
        // SAFETY: a live id of an unanswered request; `param` and its
        // private data live across the call.
        if unsafe { sys::rdma_accept(cm_ref.id, &mut param) } != 0 {
            return Err(cm_error(OP, &device));
        }
        // Answered: from here a failure must not reject again.
        let Some(cm) = self.cm.take() else {
            return Err(VerbsError::invalid(OP, "request already answered"));
        };
        let deadline = start + params.timeout;
        loop {
            match cm.wait(deadline)? {
                Some(ev) if ev.kind == t::RDMA_CM_EVENT_ESTABLISHED => break,
                Some(ev) if ev.kind == t::RDMA_CM_EVENT_TIMEWAIT_EXIT => {}
                Some(ev) => {
                    tracing::warn!(?ev, "accepted connection failed before it was established");
                    return Err(VerbsError::Os {
                        operation: OP,
                        errno: libc::ECONNABORTED,
                    });
                }
                None => {
                    return Err(VerbsError::Timeout {
                        operation: OP,
                        waited: start.elapsed(),
                        detail: format!("{} never confirmed (no RTU)", self.peer),
                    });
                }
            }
        }
        let private = std::mem::take(&mut self.private_data);
        tracing::info!(elapsed = ?start.elapsed(), qp_num = qp.qp_num(), "accepted");
        Ok(RdmaConnection::new(qp, cm, device, private))
    }

    fn reject(mut self, private_data: &[u8]) -> Result<()> {
        if private_data.len() > MAX_REJECT_PRIVATE_DATA {
            return Err(VerbsError::invalid(
                "rdma_reject",
                format!(
                    "{} bytes of private data; at most {MAX_REJECT_PRIVATE_DATA} fit",
                    private_data.len()
                ),
            ));
        }
        match self.cm.take() {
            Some(cm) => Self::reject_raw(&cm, private_data),
            None => Err(VerbsError::invalid(
                "rdma_reject",
                "request already answered",
            )),
        }
    }
}

// ------------------------------------------------------------ connection

#[derive(Debug)]
struct ConnState {
    state: ConnectionState,
    /// `rdma_disconnect` was called.
    disconnected: bool,
}

/// An established rdma_cm connection: one RC queue pair.
#[derive(Debug)]
pub struct RdmaConnection {
    // Field order is drop order: the queue pair, then the cm_id and its
    // channel (after Drop::drop has disconnected).
    qp: RdmaQp,
    cm: CmId,
    device: String,
    local: SocketAddr,
    peer: SocketAddr,
    peer_private_data: Vec<u8>,
    /// Held only for short, non-blocking updates: never across a wait, so
    /// `disconnect()` never waits for a `poll_state` in progress.
    state: Mutex<ConnState>,
    /// Serialises readers of the event channel (held across the wait).
    reader: Mutex<()>,
}

/// The longest `poll_state` waits on the channel before it looks at the
/// state again (a `disconnect()` from another thread ends the wait within
/// this, if its own DISCONNECTED event has not woken it already).
const POLL_SLICE: Duration = Duration::from_millis(20);

impl RdmaConnection {
    fn new(qp: RdmaQp, cm: CmId, device: String, peer_private_data: Vec<u8>) -> Self {
        Self {
            local: cm.src_addr(),
            peer: cm.dst_addr(),
            qp,
            cm,
            device,
            peer_private_data,
            state: Mutex::new(ConnState {
                state: ConnectionState::Connected,
                disconnected: false,
            }),
            reader: Mutex::new(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ConnState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queue pair to ERROR, then `rdma_disconnect` (once).
    fn disconnect_locked(&self, st: &mut ConnState) -> Result<()> {
        if st.disconnected {
            return Ok(());
        }
        st.disconnected = true;
        let was = st.state;
        if st.state == ConnectionState::Connected {
            st.state = ConnectionState::Disconnected;
        }
        // Our queue pair is not rdma_cm's, so rdma_disconnect leaves it
        // alone: flush it ourselves first.
        let qp_result = self.qp.to_error();
        clear_errno();
        // SAFETY: a live, connected (or peer-disconnected) id.
        let ret = unsafe { sys::rdma_disconnect(self.cm.id) };
        if ret != 0 && was == ConnectionState::Connected {
            return Err(cm_error("rdma_disconnect", &self.device));
        }
        qp_result
    }
}

impl Connection<RdmaApi> for RdmaConnection {
    fn qp(&self) -> &RdmaQp {
        &self.qp
    }

    fn device(&self) -> String {
        self.device.clone()
    }

    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    fn peer_private_data(&self) -> Vec<u8> {
        self.peer_private_data.clone()
    }

    fn event_fd(&self) -> std::os::fd::RawFd {
        self.cm.channel.fd()
    }

    fn poll_state(&self, timeout: Duration) -> Result<ConnectionState> {
        use sys::rdma_cm_event_type as t;
        let deadline = Instant::now() + timeout;
        // One reader of the channel at a time; the state lock is taken only
        // to apply an event, so disconnect() and Drop never wait for us.
        let _reader = self
            .reader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut seen = false;
        loop {
            // Wait (in slices) only while connected and no event came yet;
            // afterwards just take what is pending.
            let waiting = !seen && self.lock().state == ConnectionState::Connected;
            let left = if waiting {
                deadline.saturating_duration_since(Instant::now())
            } else {
                Duration::ZERO
            };
            let slice = left.min(POLL_SLICE);
            let Some(ev) = self.cm.channel.next(slice)? else {
                if slice == left {
                    break;
                }
                continue;
            };
            seen = true;
            let mut st = self.lock();
            match ev.kind {
                t::RDMA_CM_EVENT_DISCONNECTED => {
                    tracing::debug!(peer = %self.peer, "disconnected");
                    if st.state == ConnectionState::Connected {
                        st.state = ConnectionState::Disconnected;
                    }
                    // Answers the peer's DREQ at once (else it waits for
                    // its DREQ to time out) and flushes our queue pair.
                    if let Err(e) = self.disconnect_locked(&mut st) {
                        tracing::debug!(%e, "disconnect after the peer's");
                    }
                }
                t::RDMA_CM_EVENT_DEVICE_REMOVAL => st.state = ConnectionState::DeviceRemoved,
                _ => tracing::debug!(?ev, "connection event ignored"),
            }
        }
        Ok(self.lock().state)
    }

    #[tracing::instrument(level = "debug", skip(self), fields(peer = %self.peer))]
    fn disconnect(&self) -> Result<()> {
        let mut st = self.lock();
        self.disconnect_locked(&mut st)
    }
}

impl Drop for RdmaConnection {
    fn drop(&mut self) {
        let mut st = self.lock();
        if let Err(e) = self.disconnect_locked(&mut st) {
            tracing::debug!(%e, peer = %self.peer, "disconnect on drop");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_data_framing_round_trips_and_tolerates_raw() {
        let framed = frame(b"hello");
        assert_eq!(framed, b"\x05hello");
        let mut padded = framed.clone();
        padded.resize(56, 0);
        assert_eq!(unframe(&padded), b"hello");
        assert_eq!(unframe(&frame(&[])), b"");
        // Not framed by us: the length byte does not fit, hand it over raw.
        assert_eq!(unframe(b"\xffab"), b"\xffab");
        assert_eq!(unframe(&[]), b"");
    }

    #[test]
    fn socket_addresses_round_trip() {
        for addr in [
            "10.99.0.1:7471".parse::<SocketAddr>().unwrap(),
            "[fe80::1%2]:18515".parse().unwrap(),
        ] {
            assert_eq!(from_sockaddr(&to_sockaddr(&addr)), Some(addr));
        }
    }
}
