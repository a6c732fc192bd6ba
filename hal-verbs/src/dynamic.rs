//! Backends erased: [`DynApi`], an [`Api`] whose every handle holds some
//! backend's handle behind a trait object, so the code above it (gdr-core's
//! engine) is written once, not generic, and takes its backend at run time.
//! wgpu-hal's `dynamic` module is the model: object-safe twins of the role
//! traits, implemented for every backend's handles, and handle types that
//! forward to them.
//!
//! Make one with [`DynProvider::new`]; everything opened through it is of
//! that backend. Where a call takes another handle (a CQ to make a QP, a PD
//! to connect), that handle must be of the same backend: one of another is
//! refused with [`VerbsError::InvalidArgument`] naming what was foreign,
//! never a panic (wgpu panics there).
//!
//! ```
//! # #[cfg(feature = "mock")] {
//! use hal_verbs::dynamic::DynProvider;
//! use hal_verbs::mock::{MockApi, MockProvider};
//! use hal_verbs::Provider as _;
//!
//! let mut mock = MockProvider::new();
//! mock.expect_backend_name().return_const("mock");
//! let provider = DynProvider::new::<MockApi>(mock);
//! assert_eq!(provider.backend_name(), "mock");
//! # }
//! ```

use std::any::Any;
use std::fmt::{self, Debug};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use crate::api::{
    Api, CompletionChannel, CompletionQueue, ConnectRequest, Connection, ConnectionManager,
    Context, Listener, MemoryRegion, ProtectionDomain, Provider, QueuePair,
};
use crate::error::{PostError, Result, VerbsError};
use crate::types::{
    AccessFlags, AsyncEvent, Completion, ConnectParams, ConnectionState, CqNotify,
    DeviceAttributes, DeviceInfo, GidEntry, InitParams, PortAttributes, QpAttributes, QpCaps,
    QpState, RecvRequest, RtrParams, RtsParams, SendRequest,
};

/// The erased backend: its handles are the `Dyn*` types of this module.
#[derive(Debug)]
pub struct DynApi;

impl Api for DynApi {
    type Provider = DynProvider;
    type Context = DynContext;
    type ProtectionDomain = DynProtectionDomain;
    type MemoryRegion = DynMemoryRegion;
    type CompletionQueue = DynCompletionQueue;
    type CompletionChannel = DynCompletionChannel;
    type QueuePair = DynQueuePair;
    type ConnectionManager = DynConnectionManager;
    type Listener = DynListener;
    type ConnectRequest = DynConnectRequest;
    type Connection = DynConnection;
}

/// Implements `$role` for an erased handle: each method listed forwards to
/// the backend's handle behind `self.$field`; the methods after the list
/// (unsafe ones, those that consume the handle) are written out. Led by
/// `trait $dyn_trait { .. }`, it also declares the object-safe twin: the
/// listed methods, then the items in the braces.
macro_rules! forward {
    ($(#[$doc:meta])* trait $dyn_trait:ident { $($extra:tt)* }
    impl $role:path, for $handle:ident, via $field:tt {
        $(fn $name:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) $(-> $ret:ty)?;)*
    } $($rest:tt)*) => {
        $(#[$doc])*
        trait $dyn_trait: Send + Sync + Debug {
            $(fn $name(&self $(, $arg: $ty)*) $(-> $ret)?;)*
            $($extra)*
        }

        forward!(impl $role, for $handle, via $field {
            $(fn $name(&self $(, $arg: $ty)*) $(-> $ret)?;)*
        } $($rest)*);
    };
    (impl $role:path, for $handle:ident, via $field:tt {
        $(fn $name:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) $(-> $ret:ty)?;)*
    } $($rest:tt)*) => {
        impl $role for $handle {
            $(fn $name(&self $(, $arg: $ty)*) $(-> $ret)? {
                self.$field.$name($($arg),*)
            })*
            $($rest)*
        }
    };
}

/// `handle` as backend `A`'s `T`, or the error for a foreign handle.
fn downcast<'a, T: 'static>(
    handle: &'a dyn Any,
    operation: &'static str,
    what: &'static str,
) -> Result<&'a T> {
    handle.downcast_ref::<T>().ok_or_else(|| {
        VerbsError::invalid(
            operation,
            format!("the {what} is of another verbs backend than the call's"),
        )
    })
}

/// Declares the handle type `$dyn` (a box of `$trait`) and the wrapper
/// `$of<A>` that holds backend `A`'s handle `$assoc`.
macro_rules! erased {
    ($(#[$doc:meta])* $dyn:ident, $trait:ident, $of:ident, $assoc:ident) => {
        $(#[$doc])*
        pub struct $dyn(Box<dyn $trait>);

        impl Debug for $dyn {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        /// Backend `A`'s handle, erased.
        struct $of<A: Api>(A::$assoc);

        impl<A: Api> Debug for $of<A> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

erased!(
    /// A provider of any backend ([`Provider`]).
    DynProvider, ProviderDyn, ProviderOf, Provider
);
erased!(
    /// An opened device of any backend ([`Context`]).
    DynContext, ContextDyn, ContextOf, Context
);
erased!(
    /// A protection domain of any backend ([`ProtectionDomain`]).
    DynProtectionDomain, PdDyn, PdOf, ProtectionDomain
);
erased!(
    /// A memory region of any backend ([`MemoryRegion`]).
    DynMemoryRegion, MrDyn, MrOf, MemoryRegion
);
erased!(
    /// A completion queue of any backend ([`CompletionQueue`]).
    DynCompletionQueue, CqDyn, CqOf, CompletionQueue
);
erased!(
    /// A completion channel of any backend ([`CompletionChannel`]).
    DynCompletionChannel, ChannelDyn, ChannelOf, CompletionChannel
);
erased!(
    /// A connection manager of any backend ([`ConnectionManager`]).
    DynConnectionManager, CmDyn, CmOf, ConnectionManager
);
erased!(
    /// A listener of any backend ([`Listener`]).
    DynListener, ListenerDyn, ListenerOf, Listener
);
erased!(
    /// A connection request of any backend ([`ConnectRequest`]).
    DynConnectRequest, RequestDyn, RequestOf, ConnectRequest
);

impl DynProvider {
    /// Backend `A`'s `provider`, erased: what it opens is of `A`.
    pub fn new<A: Api>(provider: A::Provider) -> Self {
        Self(Box::new(ProviderOf::<A>(provider)))
    }

    /// The provider of backend `A` behind this one, if it is of `A`: for
    /// code that measures a backend on its own types (a benchmark's bare
    /// loop), not through the erasure.
    pub fn downcast_ref<A: Api>(&self) -> Option<&A::Provider> {
        self.0
            .as_any()
            .downcast_ref::<ProviderOf<A>>()
            .map(|of| &of.0)
    }
}

// ---- Provider

impl<A: Api> ProviderDyn for ProviderOf<A> {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn backend_name(&self) -> &'static str {
        self.0.backend_name()
    }
    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        self.0.devices()
    }
    fn open(&self, name: &str) -> Result<DynContext> {
        Ok(DynContext(Box::new(ContextOf::<A>(self.0.open(name)?))))
    }
    fn connection_manager(&self) -> Result<DynConnectionManager> {
        Ok(DynConnectionManager(Box::new(CmOf::<A>(
            self.0.connection_manager()?,
        ))))
    }
}

forward!(trait ProviderDyn {
    fn as_any(&self) -> &dyn Any;
}
impl Provider<DynApi>, for DynProvider, via 0 {
    fn backend_name(&self) -> &'static str;
    fn devices(&self) -> Result<Vec<DeviceInfo>>;
    fn open(&self, name: &str) -> Result<DynContext>;
    fn connection_manager(&self) -> Result<DynConnectionManager>;
});

// ---- Context

impl<A: Api> ContextDyn for ContextOf<A> {
    fn name(&self) -> String {
        self.0.name()
    }
    fn query_device(&self) -> Result<DeviceAttributes> {
        self.0.query_device()
    }
    fn query_port(&self, port: u8) -> Result<PortAttributes> {
        self.0.query_port(port)
    }
    fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        self.0.gid_table(port)
    }
    fn alloc_pd(&self) -> Result<DynProtectionDomain> {
        Ok(DynProtectionDomain(Box::new(PdOf::<A>(self.0.alloc_pd()?))))
    }
    fn create_cq(&self, depth: u32) -> Result<DynCompletionQueue> {
        Ok(cq::<A>(self.0.create_cq(depth)?))
    }
    fn create_comp_channel(&self) -> Result<DynCompletionChannel> {
        Ok(DynCompletionChannel(Box::new(ChannelOf::<A>(
            self.0.create_comp_channel()?,
        ))))
    }
    fn create_cq_on_channel(
        &self,
        depth: u32,
        channel: &DynCompletionChannel,
        comp_vector: u32,
    ) -> Result<DynCompletionQueue> {
        let channel: &ChannelOf<A> =
            downcast(channel.0.as_any(), "ibv_create_cq", "completion channel")?;
        Ok(cq::<A>(self.0.create_cq_on_channel(
            depth,
            &channel.0,
            comp_vector,
        )?))
    }
    fn async_fd(&self) -> RawFd {
        self.0.async_fd()
    }
    fn next_async_event(&self) -> Result<Option<AsyncEvent>> {
        self.0.next_async_event()
    }
}

fn cq<A: Api>(cq: A::CompletionQueue) -> DynCompletionQueue {
    DynCompletionQueue(Box::new(CqOf::<A>(cq)))
}

forward!(trait ContextDyn {}
impl Context<DynApi>, for DynContext, via 0 {
    fn name(&self) -> String;
    fn query_device(&self) -> Result<DeviceAttributes>;
    fn query_port(&self, port: u8) -> Result<PortAttributes>;
    fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>>;
    fn alloc_pd(&self) -> Result<DynProtectionDomain>;
    fn create_cq(&self, depth: u32) -> Result<DynCompletionQueue>;
    fn create_comp_channel(&self) -> Result<DynCompletionChannel>;
    fn create_cq_on_channel(
        &self,
        depth: u32,
        channel: &DynCompletionChannel,
        comp_vector: u32,
    ) -> Result<DynCompletionQueue>;
    fn async_fd(&self) -> RawFd;
    fn next_async_event(&self) -> Result<Option<AsyncEvent>>;
});

// ---- Protection domain

/// Backend `A`'s CQ behind `cq`, or the error for a foreign one.
fn cq_of<'a, A: Api>(
    cq: &'a DynCompletionQueue,
    operation: &'static str,
) -> Result<&'a A::CompletionQueue> {
    downcast::<CqOf<A>>(cq.0.as_any(), operation, "completion queue").map(|c| &c.0)
}

/// Backend `A`'s PD behind `pd`, or the error for a foreign one.
fn pd_of<'a, A: Api>(
    pd: &'a DynProtectionDomain,
    operation: &'static str,
) -> Result<&'a A::ProtectionDomain> {
    downcast::<PdOf<A>>(pd.0.as_any(), operation, "protection domain").map(|p| &p.0)
}

impl<A: Api> PdDyn for PdOf<A> {
    fn as_any(&self) -> &dyn Any {
        self
    }
    unsafe fn register(
        &self,
        addr: u64,
        len: usize,
        access: AccessFlags,
    ) -> Result<DynMemoryRegion> {
        // SAFETY: forwarded from our caller's contract.
        let mr = unsafe { self.0.register(addr, len, access) }?;
        Ok(DynMemoryRegion(Box::new(MrOf::<A>(mr))))
    }
    unsafe fn register_dmabuf(
        &self,
        fd: RawFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<DynMemoryRegion> {
        // SAFETY: forwarded from our caller's contract.
        let mr = unsafe { self.0.register_dmabuf(fd, offset, len, iova, access) }?;
        Ok(DynMemoryRegion(Box::new(MrOf::<A>(mr))))
    }
    fn create_qp(
        &self,
        caps: &QpCaps,
        send_cq: &DynCompletionQueue,
        recv_cq: &DynCompletionQueue,
    ) -> Result<DynQueuePair> {
        const OP: &str = "ibv_create_qp";
        let qp = self
            .0
            .create_qp(caps, cq_of::<A>(send_cq, OP)?, cq_of::<A>(recv_cq, OP)?)?;
        Ok(DynQueuePair(Box::new(QpOf::<A>(qp))))
    }
}

forward!(trait PdDyn {
    fn as_any(&self) -> &dyn Any;
    /// # Safety
    /// As [`ProtectionDomain::register`].
    unsafe fn register(
        &self,
        addr: u64,
        len: usize,
        access: AccessFlags,
    ) -> Result<DynMemoryRegion>;
    /// # Safety
    /// As [`ProtectionDomain::register_dmabuf`].
    unsafe fn register_dmabuf(
        &self,
        fd: RawFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<DynMemoryRegion>;
}
impl ProtectionDomain<DynApi>, for DynProtectionDomain, via 0 {
    fn create_qp(
        &self,
        caps: &QpCaps,
        send_cq: &DynCompletionQueue,
        recv_cq: &DynCompletionQueue,
    ) -> Result<DynQueuePair>;
}
    unsafe fn register(
        &self,
        addr: u64,
        len: usize,
        access: AccessFlags,
    ) -> Result<DynMemoryRegion> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.register(addr, len, access) }
    }
    unsafe fn register_dmabuf(
        &self,
        fd: RawFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<DynMemoryRegion> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.register_dmabuf(fd, offset, len, iova, access) }
    });

// ---- Memory region

impl<A: Api> MrDyn for MrOf<A> {
    fn lkey(&self) -> u32 {
        self.0.lkey()
    }
    fn rkey(&self) -> u32 {
        self.0.rkey()
    }
    fn addr(&self) -> u64 {
        self.0.addr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn access(&self) -> AccessFlags {
        self.0.access()
    }
    fn deregister(self: Box<Self>) -> Result<()> {
        self.0.deregister()
    }
}

forward!(trait MrDyn {
    fn deregister(self: Box<Self>) -> Result<()>;
}
impl MemoryRegion, for DynMemoryRegion, via 0 {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
    fn addr(&self) -> u64;
    fn len(&self) -> usize;
    fn access(&self) -> AccessFlags;
}
    fn deregister(self) -> Result<()> {
        self.0.deregister()
    });

// ---- Completion queue

impl<A: Api> CqDyn for CqOf<A> {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn depth(&self) -> u32 {
        self.0.depth()
    }
    fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        self.0.poll(out)
    }
    fn poll_into(&self, out: &mut Vec<Completion>) -> Result<usize> {
        self.0.poll_into(out)
    }
    fn cq_id(&self) -> u64 {
        self.0.cq_id()
    }
    fn req_notify(&self, notify: CqNotify) -> Result<()> {
        self.0.req_notify(notify)
    }
    fn set_moderation(&self, count: u16, period_us: u16) -> Result<()> {
        self.0.set_moderation(count, period_us)
    }
}

forward!(trait CqDyn {
    fn as_any(&self) -> &dyn Any;
}
impl CompletionQueue, for DynCompletionQueue, via 0 {
    fn depth(&self) -> u32;
    fn poll(&self, out: &mut [Completion]) -> Result<usize>;
    fn poll_into(&self, out: &mut Vec<Completion>) -> Result<usize>;
    fn cq_id(&self) -> u64;
    fn req_notify(&self, notify: CqNotify) -> Result<()>;
    fn set_moderation(&self, count: u16, period_us: u16) -> Result<()>;
});

// ---- Completion channel

impl<A: Api> ChannelDyn for ChannelOf<A> {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn fd(&self) -> RawFd {
        self.0.fd()
    }
    fn get_cq_event(&self) -> Result<Option<u64>> {
        self.0.get_cq_event()
    }
}

forward!(trait ChannelDyn {
    fn as_any(&self) -> &dyn Any;
}
impl CompletionChannel, for DynCompletionChannel, via 0 {
    fn fd(&self) -> RawFd;
    fn get_cq_event(&self) -> Result<Option<u64>>;
});

// ---- Queue pair

/// A queue pair of any backend ([`QueuePair`]): made by a protection
/// domain, or the one inside a [`DynConnection`].
pub struct DynQueuePair(Box<dyn QpDyn>);

impl Debug for DynQueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Backend `A`'s queue pair, erased.
struct QpOf<A: Api>(A::QueuePair);

impl<A: Api> Debug for QpOf<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What holds a queue pair: one of its own, or a connection's.
trait HoldsQp: Send + Sync + Debug {
    type Qp: QueuePair;
    fn qp(&self) -> &Self::Qp;
}

impl<A: Api> HoldsQp for QpOf<A> {
    type Qp = A::QueuePair;
    fn qp(&self) -> &A::QueuePair {
        &self.0
    }
}

impl<T: HoldsQp> QpDyn for T {
    fn qp_num(&self) -> u32 {
        self.qp().qp_num()
    }
    fn caps(&self) -> QpCaps {
        self.qp().caps()
    }
    fn state(&self) -> Result<QpState> {
        self.qp().state()
    }
    fn to_init(&self, params: &InitParams) -> Result<()> {
        self.qp().to_init(params)
    }
    fn to_rtr(&self, params: &RtrParams) -> Result<()> {
        self.qp().to_rtr(params)
    }
    fn to_rts(&self, params: &RtsParams) -> Result<()> {
        self.qp().to_rts(params)
    }
    fn to_error(&self) -> Result<()> {
        self.qp().to_error()
    }
    fn to_reset(&self) -> Result<()> {
        self.qp().to_reset()
    }
    fn query(&self) -> Result<QpAttributes> {
        self.qp().query()
    }
    unsafe fn post_send(&self, requests: &[SendRequest]) -> Result<(), PostError> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.qp().post_send(requests) }
    }
    unsafe fn post_recv(&self, requests: &[RecvRequest]) -> Result<(), PostError> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.qp().post_recv(requests) }
    }
}

forward!(trait QpDyn {
    /// # Safety
    /// As [`QueuePair::post_send`].
    unsafe fn post_send(&self, requests: &[SendRequest]) -> Result<(), PostError>;
    /// # Safety
    /// As [`QueuePair::post_recv`].
    unsafe fn post_recv(&self, requests: &[RecvRequest]) -> Result<(), PostError>;
}
impl QueuePair, for DynQueuePair, via 0 {
    fn qp_num(&self) -> u32;
    fn caps(&self) -> QpCaps;
    fn state(&self) -> Result<QpState>;
    fn to_init(&self, params: &InitParams) -> Result<()>;
    fn to_rtr(&self, params: &RtrParams) -> Result<()>;
    fn to_rts(&self, params: &RtsParams) -> Result<()>;
    fn to_error(&self) -> Result<()>;
    fn to_reset(&self) -> Result<()>;
    fn query(&self) -> Result<QpAttributes>;
}
    unsafe fn post_send(&self, requests: &[SendRequest]) -> Result<(), PostError> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.post_send(requests) }
    }
    unsafe fn post_recv(&self, requests: &[RecvRequest]) -> Result<(), PostError> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.post_recv(requests) }
    });

// ---- Connection manager

impl<A: Api> CmDyn for CmOf<A> {
    fn route_device(&self, peer: IpAddr, timeout: Duration) -> Result<String> {
        self.0.route_device(peer, timeout)
    }
    fn listen(&self, addr: SocketAddr, backlog: u32) -> Result<DynListener> {
        Ok(DynListener(Box::new(ListenerOf::<A>(
            self.0.listen(addr, backlog)?,
        ))))
    }
    fn connect(
        &self,
        peer: SocketAddr,
        pd: &DynProtectionDomain,
        send_cq: &DynCompletionQueue,
        recv_cq: &DynCompletionQueue,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<DynConnection> {
        const OP: &str = "rdma_connect";
        let connection = self.0.connect(
            peer,
            pd_of::<A>(pd, OP)?,
            cq_of::<A>(send_cq, OP)?,
            cq_of::<A>(recv_cq, OP)?,
            params,
            private_data,
        )?;
        Ok(DynConnection::new::<A>(connection))
    }
    fn abort_connects(&self) {
        self.0.abort_connects();
    }
}

forward!(trait CmDyn {
    fn connect(
        &self,
        peer: SocketAddr,
        pd: &DynProtectionDomain,
        send_cq: &DynCompletionQueue,
        recv_cq: &DynCompletionQueue,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<DynConnection>;
}
impl ConnectionManager<DynApi>, for DynConnectionManager, via 0 {
    fn route_device(&self, peer: IpAddr, timeout: Duration) -> Result<String>;
    fn listen(&self, addr: SocketAddr, backlog: u32) -> Result<DynListener>;
    fn abort_connects(&self);
}
    fn connect(
        &self,
        peer: SocketAddr,
        pd: &DynProtectionDomain,
        send_cq: &DynCompletionQueue,
        recv_cq: &DynCompletionQueue,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<DynConnection> {
        self.0
            .connect(peer, pd, send_cq, recv_cq, params, private_data)
    });

// ---- Listener and connection requests

impl<A: Api> ListenerDyn for ListenerOf<A> {
    fn local_addr(&self) -> SocketAddr {
        self.0.local_addr()
    }
    fn next_request(&self, timeout: Duration) -> Result<DynConnectRequest> {
        Ok(DynConnectRequest(Box::new(RequestOf::<A>(
            self.0.next_request(timeout)?,
        ))))
    }
    fn wake(&self) {
        self.0.wake();
    }
}

forward!(trait ListenerDyn {}
impl Listener<DynApi>, for DynListener, via 0 {
    fn local_addr(&self) -> SocketAddr;
    fn next_request(&self, timeout: Duration) -> Result<DynConnectRequest>;
    fn wake(&self);
});

impl<A: Api> RequestDyn for RequestOf<A> {
    fn private_data(&self) -> Vec<u8> {
        self.0.private_data()
    }
    fn device(&self) -> String {
        self.0.device()
    }
    fn peer_addr(&self) -> SocketAddr {
        self.0.peer_addr()
    }
    fn accept(
        self: Box<Self>,
        pd: &DynProtectionDomain,
        send_cq: &DynCompletionQueue,
        recv_cq: &DynCompletionQueue,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<DynConnection> {
        const OP: &str = "rdma_accept";
        // Checked before the request is consumed: a foreign handle leaves
        // it to be refused.
        let (pd, send_cq, recv_cq) = (
            pd_of::<A>(pd, OP)?,
            cq_of::<A>(send_cq, OP)?,
            cq_of::<A>(recv_cq, OP)?,
        );
        let connection = self.0.accept(pd, send_cq, recv_cq, params, private_data)?;
        Ok(DynConnection::new::<A>(connection))
    }
    fn reject(self: Box<Self>, private_data: &[u8]) -> Result<()> {
        self.0.reject(private_data)
    }
}

forward!(trait RequestDyn {
    fn accept(
        self: Box<Self>,
        pd: &DynProtectionDomain,
        send_cq: &DynCompletionQueue,
        recv_cq: &DynCompletionQueue,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<DynConnection>;
    fn reject(self: Box<Self>, private_data: &[u8]) -> Result<()>;
}
impl ConnectRequest<DynApi>, for DynConnectRequest, via 0 {
    fn private_data(&self) -> Vec<u8>;
    fn device(&self) -> String;
    fn peer_addr(&self) -> SocketAddr;
}
    fn accept(
        self,
        pd: &DynProtectionDomain,
        send_cq: &DynCompletionQueue,
        recv_cq: &DynCompletionQueue,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<DynConnection> {
        self.0.accept(pd, send_cq, recv_cq, params, private_data)
    }
    fn reject(self, private_data: &[u8]) -> Result<()> {
        self.0.reject(private_data)
    });

// ---- Connection

/// A connection of any backend ([`Connection`]). Its queue pair is a view
/// that shares the connection (so `qp()` can hand out a reference), and
/// the connection goes when both do.
pub struct DynConnection {
    inner: Arc<dyn ConnectionDyn>,
    qp: DynQueuePair,
}

impl Debug for DynConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

/// Backend `A`'s connection, erased.
struct ConnectionOf<A: Api>(A::Connection);

impl<A: Api> Debug for ConnectionOf<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The queue pair inside backend `A`'s connection.
struct ConnectionQp<A: Api>(Arc<ConnectionOf<A>>);

impl<A: Api> Debug for ConnectionQp<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.0.qp().fmt(f)
    }
}

impl<A: Api> HoldsQp for ConnectionQp<A> {
    type Qp = A::QueuePair;
    fn qp(&self) -> &A::QueuePair {
        self.0.0.qp()
    }
}

impl DynConnection {
    fn new<A: Api>(connection: A::Connection) -> Self {
        let inner = Arc::new(ConnectionOf::<A>(connection));
        let qp = DynQueuePair(Box::new(ConnectionQp::<A>(Arc::clone(&inner))));
        Self { inner, qp }
    }
}

impl<A: Api> ConnectionDyn for ConnectionOf<A> {
    fn device(&self) -> String {
        self.0.device()
    }
    fn local_addr(&self) -> SocketAddr {
        self.0.local_addr()
    }
    fn peer_addr(&self) -> SocketAddr {
        self.0.peer_addr()
    }
    fn peer_private_data(&self) -> Vec<u8> {
        self.0.peer_private_data()
    }
    fn event_fd(&self) -> RawFd {
        self.0.event_fd()
    }
    fn poll_state(&self, timeout: Duration) -> Result<ConnectionState> {
        self.0.poll_state(timeout)
    }
    fn disconnect(&self) -> Result<()> {
        self.0.disconnect()
    }
}

forward!(trait ConnectionDyn {}
impl Connection<DynApi>, for DynConnection, via inner {
    fn device(&self) -> String;
    fn local_addr(&self) -> SocketAddr;
    fn peer_addr(&self) -> SocketAddr;
    fn peer_private_data(&self) -> Vec<u8>;
    fn event_fd(&self) -> RawFd;
    fn poll_state(&self, timeout: Duration) -> Result<ConnectionState>;
    fn disconnect(&self) -> Result<()>;
}
    fn qp(&self) -> &DynQueuePair {
        &self.qp
    });
