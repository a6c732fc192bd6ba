//! # hal-cuda
//!
//! The CUDA hardware-abstraction layer of gdr: traits ([`Api`] and its role
//! traits), plain types and one error enum over the CUDA driver API. The real
//! backend (`cuda`, feature `cuda`, on by default) opens libcuda at run
//! time (`libloading`, every entry point resolved when it opens); `gdr-sim`
//! simulates a GPU on host memory. Nothing here names a layer above.
//!
//! With the `mock` feature every role trait has a mockall mock, and
//! `mock::MockApi` ties them together as a backend.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod api;
mod error;
mod types;

/// The real backend over libcuda, opened at run time.
#[cfg(feature = "cuda")]
pub mod cuda;

pub use api::{
    Api, Context, DeviceMemory, Driver, Event, HostRegistration, IpcMapping, PhysicalMemory,
    PinnedHostMemory, Stream, VirtualMapping, VirtualReservation,
};
pub use api::{boot_id, os_process_token, parse_uuid};
pub use error::{CudaError, Result, result_name};
pub use types::{
    AllocationKind, DeviceAttributes, FlushScope, FlushWritesOptions, HostRegisterFlags,
    IpcMemHandle, MemoryType, PointerAttributes, WritesOrdering, WritesVisibility,
};

/// mockall mocks of the role traits, tied together by `mock::MockApi`.
#[cfg(feature = "mock")]
pub mod mock {
    pub use crate::api::{
        MockContext, MockDeviceMemory, MockDriver, MockEvent, MockHostRegistration, MockIpcMapping,
        MockPhysicalMemory, MockPinnedHostMemory, MockStream, MockVirtualMapping,
        MockVirtualReservation,
    };

    /// A backend whose every handle is a mockall mock.
    #[derive(Debug)]
    pub struct MockApi;

    impl crate::Api for MockApi {
        type Driver = MockDriver<MockApi>;
        type Context = MockContext<MockApi>;
        type Stream = MockStream<MockApi>;
        type Event = MockEvent;
        type DeviceMemory = MockDeviceMemory;
        type PinnedHostMemory = MockPinnedHostMemory;
        type HostRegistration = MockHostRegistration;
        type IpcMapping = MockIpcMapping;
        type VirtualReservation = MockVirtualReservation;
        type PhysicalMemory = MockPhysicalMemory;
        type VirtualMapping = MockVirtualMapping;
    }
}
