//! One import for a library user: `use gdr_core::prelude::*;` brings the
//! engine, its requests and errors, buffers, grants and descriptors, and
//! (anonymously) the HAL traits whose methods those types are used with.

pub use crate::buffer::{Buffer, BufferAccessError};
pub use crate::descriptor::{GrantRights, MemoryDescriptor, MemoryLocation};
#[cfg(all(feature = "tokio", not(loom)))]
pub use crate::engine::{AsyncDriver, AsyncDriverError};
pub use crate::engine::{
    Batch, Driver, Engine, EngineConfig, EngineError, EngineListener, Fence, Op, Outcome, Path,
    Peer, Region, RegionGrant, Transfer, TransferError,
};
pub use crate::ladder::{LadderConfig, Policy, Rung};

pub use hal_cuda::{Context as _, Driver as _, Stream as _};
pub use hal_verbs::{Context as _, Provider as _};
