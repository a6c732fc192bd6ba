//! # hal-verbs
//!
//! The verbs hardware-abstraction layer of gdr: traits ([`Api`] and its role
//! traits), plain types and one error enum over ibverbs. Backends implement
//! the traits: the real one over rdma-core (loaded at run time) and the
//! simulated one in `gdr-sim`. Nothing here names a layer above.
//!
//! With the `rdma-core` feature (on by default) `rdma` is the real backend
//! over libibverbs, loaded at run time.
//!
//! With the `mock` feature every role trait has a mockall mock, and
//! `mock::MockApi` ties them together as a backend.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod api;
pub mod drain;
mod error;
mod types;

#[cfg(feature = "rdma-core")]
pub mod rdma;

pub use api::{
    Api, CompletionChannel, CompletionQueue, ConnectRequest, Connection, ConnectionManager,
    Context, Listener, MemoryRegion, ProtectionDomain, Provider, QueuePair,
};
pub use error::{PostError, Posted, Result, VerbsError};
pub use types::{
    AccessFlags, AddressFamily, AsyncEvent, Completion, ConnectParams, ConnectionInfo,
    ConnectionState, CqModerationCaps, CqNotify, DeviceAttributes, DeviceInfo, EventAffiliation,
    Gid, GidEntry, GidType, InitParams, LinkLayer, MAX_ACCEPT_PRIVATE_DATA,
    MAX_CONNECT_PRIVATE_DATA, MAX_REJECT_PRIVATE_DATA, Mtu, PortAttributes, PortState,
    QpAttributes, QpCaps, QpState, RecvRequest, RtrParams, RtsParams, SendFlags, SendOp,
    SendRequest, SgList, Sge, WcOpcode, WcStatus, is_pci_bus_id, select_roce_v2_gid,
};

/// mockall mocks of the role traits, tied together by `mock::MockApi`.
#[cfg(feature = "mock")]
pub mod mock {
    pub use crate::api::{
        MockCompletionChannel, MockCompletionQueue, MockConnectRequest, MockConnection,
        MockConnectionManager, MockContext, MockListener, MockMemoryRegion, MockProtectionDomain,
        MockProvider, MockQueuePair,
    };

    /// A backend whose every handle is a mockall mock.
    #[derive(Debug)]
    pub struct MockApi;

    impl crate::Api for MockApi {
        type Provider = MockProvider<MockApi>;
        type Context = MockContext<MockApi>;
        type ProtectionDomain = MockProtectionDomain<MockApi>;
        type MemoryRegion = MockMemoryRegion;
        type CompletionQueue = MockCompletionQueue;
        type CompletionChannel = MockCompletionChannel;
        type QueuePair = MockQueuePair;
        type ConnectionManager = MockConnectionManager<MockApi>;
        type Listener = MockListener<MockApi>;
        type ConnectRequest = MockConnectRequest<MockApi>;
        type Connection = MockConnection<MockApi>;
    }
}
