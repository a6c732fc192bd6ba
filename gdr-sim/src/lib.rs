//! # gdr-sim
//!
//! A simulated RDMA fabric and simulated GPUs behind the `hal-verbs` and
//! `hal-cuda` traits, on real memory: bytes really move, bounds and access
//! rights are really checked, dma-buf exports are real file descriptors.
//! Work runs when a caller posts, polls or synchronizes; on the NIC's
//! default clock its one background thread also moves large transfers and
//! steps RNR waits for a caller parked on a completion channel, and on its
//! Manual clock the NIC is thread-free and deterministic (see [`nic`]). A
//! shared [`FaultPlan`] scripts failures.
//!
//! ## When to use it
//!
//! To run and test code written against the HAL traits (or gdr-core's
//! engine, which is) on a machine with no NIC and no GPU, in CI, and to
//! provoke failures real hardware rarely shows: registration refusals,
//! error completions, QP error flushes, RNR, timeouts on a virtual clock,
//! CUDA allocation, copy, export and IPC faults, a lost device. Its NIC
//! follows rxe and ConnectX where they agree and takes a profile where
//! they differ ([`DeviceConfig::mlx5_like`], [`DeviceConfig::rxe_like`]);
//! one conformance suite runs the same scenarios on it and on rxe.
//! Freed GPU memory is quarantined, so a use after free is refused and
//! reported ([`SimCuda::use_after_free_reports`]) even where real CUDA
//! would have reused the address silently (see [`memory`]).
//!
//! Nodes of one [`SimFabric`] reach each other by IPv4 address over
//! simulated rdma_cm; each [`SimCuda`] is a GPU set of one simulated
//! process (CUDA IPC works between them, in one OS process).
//!
//! ## Features
//!
//! None: nothing native is needed to build or run it.
//!
//! ## Example
//!
//! Code written once against the traits, run on a simulated node and
//! GPU (the same functions run on rdma-core and libcuda, see the HAL
//! crates' docs), then a GPU buffer registered with the simulated NIC
//! through its dma-buf:
//!
//! ```
//! use std::os::fd::AsRawFd;
//!
//! use hal_cuda::{Context as _, DeviceMemory as _, Driver as _};
//! use hal_verbs::{AccessFlags, Context as _, ProtectionDomain as _, Provider as _};
//! use gdr_sim::{GpuConfig, NodeConfig, SimCuda, SimCudaApi, SimFabric, SimVerbsApi};
//!
//! fn nic_names<A: hal_verbs::Api>(p: &A::Provider) -> hal_verbs::Result<Vec<String>> {
//!     Ok(p.devices()?.into_iter().map(|d| d.name).collect())
//! }
//! fn gpu_names<A: hal_cuda::Api>(d: &A::Driver) -> hal_cuda::Result<Vec<String>> {
//!     (0..d.device_count()?).map(|i| Ok(d.device_attributes(i)?.name)).collect()
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let fabric = SimFabric::new();
//! let node = fabric.add_node("node", NodeConfig::default());
//! let gpus = SimCuda::new(vec![GpuConfig::default()], Default::default());
//! assert_eq!(nic_names::<SimVerbsApi>(&node)?, ["sim0"]);
//! assert_eq!(gpu_names::<SimCudaApi>(&gpus)?.len(), 1);
//!
//! // GPU memory registered with the NIC through a dma-buf, as with
//! // ibv_reg_dmabuf_mr on a real NIC.
//! let context = gpus.context(0)?;
//! let memory = context.alloc(1 << 20)?;
//! let dmabuf = context.export_dmabuf(memory.device_ptr(), 1 << 20)?;
//! let pd = node.open("sim0")?.alloc_pd()?;
//! let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
//! // SAFETY: the dma-buf is open during the call, and `memory` outlives
//! // `mr` (dropped first, as declared last).
//! let mr = unsafe {
//!     pd.register_dmabuf(dmabuf.as_raw_fd(), 0, 1 << 20, memory.device_ptr(), access)?
//! };
//! assert_eq!(hal_verbs::MemoryRegion::len(&mr), 1 << 20);
//! # Ok(())
//! # }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod faults;
pub mod gpu;
pub mod memory;
pub mod nic;

pub use faults::{
    Fault, FaultPlan, FaultSite, FiredCount, RandomFaults, ScriptedFault, UnfiredFaults,
};
pub use gpu::{CudaResources, GpuConfig, SimCuda, SimCudaApi, SimGpuContext};
pub use memory::{FreedAllocation, UseAfterFree};
pub use nic::{ClockMode, SimClock, ack_timeout, rnr_nak_timer};
pub use nic::{
    DeviceConfig, LISTENER_WINDOW, NicResources, NodeConfig, SimCm, SimCompChannel,
    SimConnectRequest, SimConnection, SimContext, SimCq, SimFabric, SimListener, SimMr, SimPd,
    SimQp, SimVerbs, SimVerbsApi,
};
