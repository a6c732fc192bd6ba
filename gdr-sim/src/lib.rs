//! # gdr-sim
//!
//! A simulated RDMA fabric and simulated GPUs behind the `hal-verbs` and
//! `hal-cuda` traits, on real memory: bytes really move, bounds and access
//! rights are really checked, dma-buf exports are real file descriptors.
//! Deterministic and thread-free: work runs when a caller polls or
//! synchronizes. A shared [`FaultPlan`] scripts failures.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod faults;
pub mod gpu;
pub mod memory;
pub mod nic;

pub use faults::{Fault, FaultPlan, FaultSite, ScriptedFault, UnfiredFaults};
pub use gpu::{GpuConfig, SimCuda, SimCudaApi, SimGpuContext};
pub use nic::{ClockMode, SimClock, ack_timeout, rnr_nak_timer};
pub use nic::{
    DeviceConfig, NodeConfig, SimCm, SimCompChannel, SimConnectRequest, SimConnection, SimContext,
    SimCq, SimFabric, SimListener, SimMr, SimPd, SimQp, SimVerbs, SimVerbsApi,
};
