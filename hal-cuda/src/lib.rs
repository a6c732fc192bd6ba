//! # hal-cuda
//!
//! The CUDA hardware-abstraction layer of gdr: traits ([`Api`] and its role
//! traits), plain types and one error enum over the CUDA driver API
//! (contexts, device memory, pinned host memory, streams and events, stream
//! memory operations, dma-buf export, IPC, VMM, the GPUDirect RDMA flush).
//! Nothing here names a layer above.
//!
//! ## When to use it
//!
//! To write code generic over a GPU backend: the real driver (`cuda`), the
//! simulated GPU of `gdr-sim` (on host memory, no GPU needed) or mockall
//! mocks. To move GPU memory over RDMA, use `gdr-core`, built on this.
//!
//! The real backend opens libcuda at run time (`libloading`) and resolves
//! every entry point when it opens, each typed to return the raw
//! `CUresult` integer (a code newer than the bindings is an error value,
//! never undefined behaviour); `cudarc` supplies only the driver's types
//! and constants. Entry points a driver may lack (dma-buf, the flush, VMM,
//! stream memory operations) are optional groups: a call without them is
//! [`CudaError`]'s not-supported kind, not a failure to load.
//!
//! ## Features
//!
//! | feature | default | what it adds | build needs |
//! | --- | --- | --- | --- |
//! | `cuda` | yes | `cuda`: the real backend over libcuda, opened at run time | nothing native |
//! | `mock` | no | `mock`: a mockall mock of every role trait, tied together by `mock::MockApi` | nothing |
//!
//! ## Example
//!
//! Code is written once against the traits. This function reports what
//! gdr cares about of each GPU; it runs against the real driver here (on
//! a machine without one it says so) and against `gdr-sim`'s simulated
//! GPU in that crate's docs.
//!
//! ```
//! use hal_cuda::{Api, CudaError, Driver as _};
//!
//! fn describe<A: Api>(driver: &A::Driver) -> Result<Vec<String>, CudaError> {
//!     (0..driver.device_count()?)
//!         .map(|ordinal| {
//!             let a = driver.device_attributes(ordinal)?;
//!             Ok(format!(
//!                 "GPU {ordinal} {}: dma-buf {}, GPUDirect RDMA {}",
//!                 a.name, a.dma_buf_supported, a.gpu_direct_rdma_supported
//!             ))
//!         })
//!         .collect()
//! }
//!
//! # #[cfg(feature = "cuda")]
//! match hal_cuda::cuda::CudaDriver::load() {
//!     Ok(driver) => match describe::<hal_cuda::cuda::CudaApi>(&driver) {
//!         Ok(lines) => lines.iter().for_each(|l| println!("{l}")),
//!         Err(e) => println!("CUDA: {e}"),
//!     },
//!     // No libcuda here: the error says what was missing.
//!     Err(e) => println!("CUDA unavailable: {e}"),
//! }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod api;
pub mod dynamic;
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
