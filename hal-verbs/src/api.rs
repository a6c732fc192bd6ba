//! The verbs HAL's traits, in the shape of wgpu-hal: one [`Api`] trait naming
//! a backend's handle types, and one role trait per verbs object.
//!
//! Methods are not generic so mockall can mock every role trait. Handles own
//! their parents the way sideway's do (an MR keeps its PD alive, a QP its PD
//! and CQs), so dropping in any order is safe; `Drop` releases the native
//! object and never panics.
//!
//! Addresses are `u64` rather than pointers: a registration may cover GPU
//! memory (peermem) or be addressed by an iova (dmabuf), neither of which the
//! CPU can dereference.

use std::fmt::Debug;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::time::Duration;

use crate::error::{PostError, Result};
use crate::types::{
    AccessFlags, AsyncEvent, Completion, ConnectParams, ConnectionState, CqNotify,
    DeviceAttributes, DeviceInfo, GidEntry, InitParams, PortAttributes, QpAttributes, QpCaps,
    QpState, RecvRequest, RtrParams, RtsParams, SendRequest,
};

/// A verbs backend: the handle types it hands out.
pub trait Api: Sized + Send + Sync + Debug + 'static {
    /// Enumerates and opens devices (one per process or simulated node).
    type Provider: Provider<Self>;
    /// An opened device (`ibv_context`).
    type Context: Context<Self>;
    /// A protection domain (`ibv_pd`).
    type ProtectionDomain: ProtectionDomain<Self>;
    /// A memory registration (`ibv_mr`).
    type MemoryRegion: MemoryRegion;
    /// A completion queue (`ibv_cq`).
    type CompletionQueue: CompletionQueue;
    /// A completion channel (`ibv_comp_channel`): the fd CQ events arrive on.
    type CompletionChannel: CompletionChannel;
    /// A reliable-connected queue pair (`ibv_qp`).
    type QueuePair: QueuePair;
    /// Listens and connects (rdma_cm).
    type ConnectionManager: ConnectionManager<Self>;
    /// A listening endpoint (`rdma_cm_id` after `rdma_listen`).
    type Listener: Listener<Self>;
    /// A connect request a listener received, not yet accepted.
    type ConnectRequest: ConnectRequest<Self>;
    /// One established RC connection: one queue pair.
    type Connection: Connection<Self>;
}

/// Entry point of a backend: which devices exist, and opening one.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait Provider<A: Api>: Send + Sync + Debug {
    /// A short name of the backend (`rdma-core`, `sim`).
    fn backend_name(&self) -> &'static str;
    /// The devices present. An empty list is [`crate::VerbsError::NoDevice`],
    /// never `Ok(vec![])`, whichever way the library reports it.
    fn devices(&self) -> Result<Vec<DeviceInfo>>;
    /// Opens a device by name.
    fn open(&self, name: &str) -> Result<A::Context>;
    /// The connection manager (rdma_cm); [`crate::VerbsError::LibraryUnavailable`]
    /// where librdmacm is missing.
    fn connection_manager(&self) -> Result<A::ConnectionManager>;
}

/// An opened device.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait Context<A: Api>: Send + Sync + Debug {
    /// The device's name.
    fn name(&self) -> String;
    /// Device attributes.
    fn query_device(&self) -> Result<DeviceAttributes>;
    /// Attributes of a port (numbered from 1).
    fn query_port(&self, port: u8) -> Result<PortAttributes>;
    /// The non-empty entries of a port's GID table.
    fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>>;
    /// Allocates a protection domain.
    fn alloc_pd(&self) -> Result<A::ProtectionDomain>;
    /// Creates a completion queue with at least `depth` entries.
    fn create_cq(&self, depth: u32) -> Result<A::CompletionQueue>;

    /// Creates a completion channel (`ibv_create_comp_channel`), its fd
    /// non-blocking: CQs created on it ([`Context::create_cq_on_channel`])
    /// report there once armed ([`CompletionQueue::req_notify`]).
    fn create_comp_channel(&self) -> Result<A::CompletionChannel>;

    /// Creates a completion queue of at least `depth` entries whose events
    /// go to `channel`, on completion vector `comp_vector` (in
    /// `0..`[`DeviceAttributes::num_comp_vectors`]; another is
    /// [`crate::VerbsError::InvalidArgument`]). The channel must be of this
    /// device; it lives as long as its CQs.
    fn create_cq_on_channel(
        &self,
        depth: u32,
        channel: &A::CompletionChannel,
        comp_vector: u32,
    ) -> Result<A::CompletionQueue>;

    /// The device's async event fd (`ibv_context.async_fd`), non-blocking:
    /// readable when [`Context::next_async_event`] has an event. Owned by
    /// the context (valid while it lives); register it with epoll/mio/tokio,
    /// never close it.
    fn async_fd(&self) -> RawFd;

    /// Takes the next asynchronous event without waiting
    /// (`ibv_get_async_event` on the non-blocking fd, then
    /// `ibv_ack_async_event` at once, so destroying the object it names never
    /// waits on us): `Ok(None)` when none is pending. Read until `None`
    /// after the fd turns readable (edge-triggered pollers need it).
    fn next_async_event(&self) -> Result<Option<AsyncEvent>>;
}

/// A protection domain: registers memory and creates queue pairs.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait ProtectionDomain<A: Api>: Send + Sync + Debug {
    /// Registers `len` bytes at virtual address `addr` (`ibv_reg_mr`).
    ///
    /// `addr` may be host memory, or GPU memory where a peer-memory client
    /// (nvidia-peermem) lets the kernel pin it.
    ///
    /// # Safety
    /// The range must stay mapped, and must not be freed, for as long as the
    /// returned region lives: the NIC reads and writes it without the CPU.
    unsafe fn register(
        &self,
        addr: u64,
        len: usize,
        access: AccessFlags,
    ) -> Result<A::MemoryRegion>;

    /// Registers `len` bytes at `offset` in dma-buf `fd`, addressed on the
    /// wire as `iova` (`ibv_reg_dmabuf_mr`). The region's `addr()` is `iova`.
    ///
    /// # Safety
    /// `fd` must be an open dma-buf for the duration of the call, and the
    /// memory it exports must outlive the returned region.
    unsafe fn register_dmabuf(
        &self,
        fd: RawFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<A::MemoryRegion>;

    /// Creates an RC queue pair in the RESET state.
    fn create_qp(
        &self,
        caps: &QpCaps,
        send_cq: &A::CompletionQueue,
        recv_cq: &A::CompletionQueue,
    ) -> Result<A::QueuePair>;
}

/// A registered memory range. Dropping it deregisters.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait MemoryRegion: Send + Sync + Debug {
    /// The local key, for SG entries.
    fn lkey(&self) -> u32;
    /// The remote key, for peers.
    fn rkey(&self) -> u32;
    /// First address of the region as the NIC sees it (the iova for dmabuf;
    /// rdma-core's `ibv_mr.addr` does not hold it there, the backend does).
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True when the region is empty (never, for a registered one).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The rights it was registered with.
    fn access(&self) -> AccessFlags;
    /// Deregisters now, reporting failure (dropping reports it only to the
    /// log).
    fn deregister(self) -> Result<()>;
}

/// A completion queue.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait CompletionQueue: Send + Sync + Debug {
    /// Entries the queue holds.
    fn depth(&self) -> u32;
    /// Takes up to `out.len()` completions, returning how many were written.
    /// Completions taken off the queue are never lost with an error: a
    /// failure met after some were taken is reported by the next call.
    /// `out` may be of any length (the backend polls in chunks as needed).
    fn poll(&self, out: &mut [Completion]) -> Result<usize>;

    /// Takes every completion the CQ holds now, appending them to `out`,
    /// and returns how many: polls until a poll comes back short, with no
    /// limit of its own (an event loop drains a CQ this way after arming
    /// it). On an error, the completions taken before it are in `out`
    /// already.
    fn poll_into(&self, out: &mut Vec<Completion>) -> Result<usize> {
        const CHUNK: usize = 64;
        let mut taken = 0;
        loop {
            let start = out.len();
            out.resize(start + CHUNK, Completion::default());
            let got = self.poll(&mut out[start..]);
            let n = *got.as_ref().unwrap_or(&0);
            out.truncate(start + n);
            taken += n;
            got?;
            if n < CHUNK {
                return Ok(taken);
            }
        }
    }

    /// The CQ's identity, as async events ([`crate::AsyncEvent::CqError`])
    /// and [`CompletionChannel::get_cq_event`] name it: unique among the
    /// device's live CQs (a destroyed CQ's identity may be reused).
    fn cq_id(&self) -> u64;

    /// Arms the CQ (`ibv_req_notify_cq`): the next completion added to it
    /// ([`CqNotify::Next`]), or the next solicited or error one
    /// ([`CqNotify::Solicited`]), makes its channel readable with one event.
    /// One-shot: after the event, arm again. A completion already in the CQ
    /// when it is armed does not fire it, so the event loop is:
    ///
    /// 1. wait until the channel's fd is readable;
    /// 2. take the events ([`CompletionChannel::get_cq_event`] until `None`);
    /// 3. arm each CQ they named;
    /// 4. poll each until empty, *after* arming: a completion that arrived
    ///    between the last poll and the arm is found here, and one that
    ///    arrives after the arm fires the next event.
    ///
    /// A CQ not created on a channel is
    /// [`crate::VerbsError::InvalidArgument`].
    fn req_notify(&self, notify: CqNotify) -> Result<()>;

    /// Moderates the CQ's events (`ibv_modify_cq` with `cq_count` and
    /// `cq_period` in microseconds): one event per `count` completions or
    /// per `period_us`, whichever comes first. Within
    /// [`DeviceAttributes::cq_moderation`]'s limits; a device without
    /// moderation (rxe) is [`crate::VerbsError::NotSupported`].
    fn set_moderation(&self, count: u16, period_us: u16) -> Result<()>;
}

/// A completion channel (`ibv_comp_channel`): the fd CQ events arrive on.
///
/// Its fd ([`CompletionChannel::fd`]; the backends' types are also `AsFd`
/// and `AsRawFd`) is non-blocking and readable while an event is pending:
/// register it with epoll, mio or tokio's `AsyncFd` (read interest), then
/// follow the arm-then-poll pattern of [`CompletionQueue::req_notify`].
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait CompletionChannel: Send + Sync + Debug {
    /// The channel's fd, owned by the channel (valid while it lives).
    fn fd(&self) -> RawFd;

    /// Takes the next CQ event without waiting (`ibv_get_cq_event` on the
    /// non-blocking fd): the [`CompletionQueue::cq_id`] of the CQ that
    /// fired, or `Ok(None)` when none is pending. The event is acknowledged
    /// (`ibv_ack_cq_events`) before this returns, so destroying the CQ never
    /// waits for an acknowledgement the caller forgot; the CQ stays disarmed
    /// until [`CompletionQueue::req_notify`].
    fn get_cq_event(&self) -> Result<Option<u64>>;
}

/// An RC queue pair.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait QueuePair: Send + Sync + Debug {
    /// The queue pair number.
    fn qp_num(&self) -> u32;
    /// Queue sizes as granted (may exceed those asked for).
    fn caps(&self) -> QpCaps;
    /// The current state.
    fn state(&self) -> Result<QpState>;
    /// RESET → INIT.
    fn to_init(&self, params: &InitParams) -> Result<()>;
    /// INIT → RTR, towards the peer described in `params`.
    fn to_rtr(&self, params: &RtrParams) -> Result<()>;
    /// RTR → RTS. Refuses `retry_cnt` 7 and ACK timeout 0, both infinite
    /// retry (see [`RtsParams::validate`]).
    fn to_rts(&self, params: &RtsParams) -> Result<()>;
    /// Any state → ERROR: outstanding requests complete with
    /// [`crate::WcStatus::WR_FLUSH_ERR`].
    fn to_error(&self) -> Result<()>;
    /// Any state → RESET, to recycle the queue pair (INIT, RTR and RTS
    /// again, towards a new peer if need be). Outstanding requests are
    /// dropped without completions: drain the queue pair first
    /// ([`crate::drain`]) and poll what it flushed. Whether completions of
    /// the QP still in its CQs survive is the device's choice (libmlx5
    /// removes them, rxe keeps them): poll them before the reset.
    fn to_reset(&self) -> Result<()>;
    /// The attributes as the device applied them (`ibv_query_qp`): state,
    /// granted queue sizes, the READ depths after clamping, the path.
    fn query(&self) -> Result<QpAttributes>;

    /// Links `requests` in order and posts them with one doorbell.
    ///
    /// A request the backend refuses before the provider sees it (an INLINE
    /// payload over the granted `max_inline_data`, from a dma-buf MR, or on
    /// a READ: [`crate::VerbsError::InvalidArgument`]) ends the batch there:
    /// the requests before it are posted, and the error says so
    /// ([`crate::Posted::Prefix`]). A failure whose extent the provider does
    /// not tell is [`crate::Posted::Unknown`]: drain the queue pair
    /// ([`crate::drain`]).
    ///
    /// # Safety
    /// Every SG entry must lie in a live registration whose memory stays
    /// valid until the request's completion (or the QP's flush) is polled;
    /// remote addresses are checked by the peer's NIC, not here.
    unsafe fn post_send(&self, requests: &[SendRequest]) -> Result<(), PostError>;

    /// Links and posts receives.
    ///
    /// # Safety
    /// As for [`QueuePair::post_send`]: the buffers must stay valid until
    /// their completions are polled.
    unsafe fn post_recv(&self, requests: &[RecvRequest]) -> Result<(), PostError>;
}

/// Connection management (rdma_cm): listen, connect, accept with private
/// data, disconnect.
///
/// A connection is one RC queue pair. rdma_cm picks the device from the
/// addresses (the local one a listener is bound to, the route to a peer), and
/// the queue pair must be created in a protection domain of that device, on
/// which the caller also registers the memory it exposes: so the caller
/// learns the device first ([`ConnectionManager::route_device`] on the
/// connecting side, [`ConnectRequest::device`] on the accepting side) and
/// passes a PD and CQs of it; a PD of another device is
/// [`crate::VerbsError::InvalidArgument`].
///
/// Private data is framed by the HAL (one length byte), so a peer gets
/// exactly the bytes sent, not the wire's zero padding: at most
/// [`crate::MAX_CONNECT_PRIVATE_DATA`] on connect,
/// [`crate::MAX_ACCEPT_PRIVATE_DATA`] on accept.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait ConnectionManager<A: Api>: Send + Sync + Debug {
    /// The device a connection to `peer` would use (address resolution
    /// only), so the caller can open it and allocate a PD there first.
    /// On the simulated fabric an address no device of it has is
    /// [`crate::VerbsError::NotListeningInSimulation`] at once.
    fn route_device(&self, peer: IpAddr, timeout: Duration) -> Result<String>;

    /// Listens on `addr` (port 0: one is assigned, see
    /// [`Listener::local_addr`]).
    fn listen(&self, addr: SocketAddr, backlog: u32) -> Result<A::Listener>;

    /// Connects to `peer`: resolves the address and route, creates the queue
    /// pair in `pd` with the given CQs, sends `private_data` with the
    /// request and waits until established. A peer that is not listening yet
    /// (rejected, unreachable, no route) is retried until `params.timeout`,
    /// then [`crate::VerbsError::Timeout`] (the simulated fabric, which
    /// no other process reaches, retries about a second at most, then
    /// [`crate::VerbsError::NotListeningInSimulation`]); a peer
    /// application's reject is [`crate::VerbsError::ConnectionRejected`]
    /// at once.
    fn connect(
        &self,
        peer: SocketAddr,
        pd: &A::ProtectionDomain,
        send_cq: &A::CompletionQueue,
        recv_cq: &A::CompletionQueue,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<A::Connection>;

    /// Ends every [`ConnectionManager::connect`] of this connection manager
    /// that is under way now, within one short wait of its own, with
    /// [`crate::VerbsError::Timeout`] (saying it was aborted); a connect
    /// started afterwards is not affected. For an owner going away while
    /// one of its threads still connects.
    fn abort_connects(&self);
}

/// A listening endpoint. Dropping it stops listening; requests already
/// taken live on.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait Listener<A: Api>: Send + Sync + Debug {
    /// The address listened on, with the port assigned if 0 was asked.
    fn local_addr(&self) -> SocketAddr;
    /// Waits up to `timeout` for the next connect request
    /// ([`crate::VerbsError::Timeout`] when none came).
    fn next_request(&self, timeout: Duration) -> Result<A::ConnectRequest>;
    /// Ends the `next_request` waiting now, or else the next one to wait,
    /// at once with [`crate::VerbsError::Timeout`]: for the thread serving
    /// the listener to look at something else (its owner going).
    fn wake(&self);
}

/// A connect request, to accept or reject. Dropping it rejects it.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait ConnectRequest<A: Api>: Send + Sync + Debug {
    /// The requester's private data, exactly as sent.
    fn private_data(&self) -> Vec<u8>;
    /// The device the request arrived on: the PD given to
    /// [`ConnectRequest::accept`] must be of it.
    fn device(&self) -> String;
    /// The requester's address.
    fn peer_addr(&self) -> SocketAddr;
    /// Creates the queue pair in `pd`, replies with `private_data` and
    /// waits (up to `params.timeout`) until established.
    fn accept(
        self,
        pd: &A::ProtectionDomain,
        send_cq: &A::CompletionQueue,
        recv_cq: &A::CompletionQueue,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<A::Connection>;
    /// Refuses the request; the requester gets
    /// [`crate::VerbsError::ConnectionRejected`] with `private_data`.
    fn reject(self, private_data: &[u8]) -> Result<()>;
}

/// An established connection: one RC queue pair. Dropping it disconnects,
/// then destroys the queue pair: on ConnectX that removes the queue pair's
/// completions from its CQs, so drain it first ([`crate::drain`]) when
/// work is outstanding.
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait Connection<A: Api>: Send + Sync + Debug {
    /// The queue pair, in RTS once connected: post through it.
    fn qp(&self) -> &A::QueuePair;
    /// The device the queue pair is on.
    fn device(&self) -> String;
    /// Our address.
    fn local_addr(&self) -> SocketAddr;
    /// The peer's address.
    fn peer_addr(&self) -> SocketAddr;
    /// The private data the peer sent (request or accept), exactly as sent.
    fn peer_private_data(&self) -> Vec<u8>;
    /// The connection's event fd (its `rdma_event_channel`'s), non-blocking:
    /// readable when an event (the peer's disconnect, a device removal) may
    /// be pending. Register it with epoll/mio/tokio and call
    /// [`Connection::poll_state`] with `Duration::ZERO` when it turns
    /// readable; that consumes what made it readable. Owned by the
    /// connection (valid while it lives); never close it.
    fn event_fd(&self) -> RawFd;
    /// Processes the connection's events, waiting up to `timeout` for one
    /// when none is pending (`Duration::ZERO`: never waits), and says where
    /// it stands.
    fn poll_state(&self, timeout: Duration) -> Result<ConnectionState>;
    /// Moves the queue pair to ERROR (outstanding requests flush) and tells
    /// the peer. Idempotent. Never waits for a `poll_state` in progress on
    /// another thread (which then returns promptly). Work still outstanding
    /// should be drained ([`crate::drain`]) before the connection is dropped.
    fn disconnect(&self) -> Result<()>;
}
