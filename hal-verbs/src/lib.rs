//! # hal-verbs
//!
//! The verbs hardware-abstraction layer of gdr: traits ([`Api`] and its role
//! traits), plain types and one error enum over ibverbs and rdma_cm.
//! Backends implement the traits: the real one over rdma-core (loaded at
//! run time), the simulated one in `gdr-sim`, and mockall mocks. Nothing
//! here names a layer above.
//!
//! ## When to use it
//!
//! To write code generic over a NIC backend (real, simulated, mocked)
//! below gdr's transfer engine: device and port queries, protection
//! domains and memory regions, completion queues, RC queue pairs and
//! rdma_cm connections. To move bytes between buffers and peers, use
//! `gdr-core`'s engine instead, which is built on this.
//!
//! Each handle owns its parents and releases itself on `Drop` (which never
//! panics); every error keeps the native errno and the call that failed
//! ([`VerbsError`]).
//!
//! ## Features
//!
//! | feature | default | what it adds | build needs |
//! | --- | --- | --- | --- |
//! | `rdma-core` | yes | `rdma`: the real backend, libibverbs and librdmacm opened at run time (rdma-mummy-sys) | cmake, libclang |
//! | `mock` | no | `mock`: a mockall mock of every role trait, tied together by `mock::MockApi` | nothing |
//!
//! ## Example
//!
//! Code is written once against the traits. This function lists a
//! provider's devices and the RoCE v2 GID of each port; it runs against
//! rdma-core here (on a machine without RDMA it says so) and against
//! `gdr-sim`'s simulated NIC in that crate's docs.
//!
//! ```
//! use hal_verbs::{AddressFamily, Api, Context as _, Provider as _, VerbsError};
//!
//! fn describe<A: Api>(provider: &A::Provider) -> Result<Vec<String>, VerbsError> {
//!     let mut lines = Vec::new();
//!     for device in provider.devices()? {
//!         let context = provider.open(&device.name)?;
//!         let ports = context.query_device()?.phys_port_cnt;
//!         for port in 1..=ports {
//!             let gids = context.gid_table(port)?;
//!             let gid = hal_verbs::select_roce_v2_gid(&gids, AddressFamily::V4)
//!                 .map_or("no RoCE v2 GID".to_owned(), |g| g.gid.to_ip().to_string());
//!             lines.push(format!("{} port {port}: {gid}", device.name));
//!         }
//!     }
//!     Ok(lines)
//! }
//!
//! # #[cfg(feature = "rdma-core")]
//! match hal_verbs::rdma::RdmaProvider::load() {
//!     Ok(provider) => match describe::<hal_verbs::rdma::RdmaApi>(&provider) {
//!         Ok(lines) => lines.iter().for_each(|l| println!("{l}")),
//!         Err(e) => println!("rdma-core: {e}"),
//!     },
//!     // No libibverbs here: the error says what was missing.
//!     Err(e) => println!("rdma-core unavailable: {e}"),
//! }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod api;
pub mod drain;
pub mod dynamic;
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
