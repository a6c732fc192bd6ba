//! One import for a library user: `use gdr_core::prelude::*;` brings the
//! facade (a `Context` of backends chosen at run time, its `Engine`,
//! `Buffer`s and `Stream`s; `Region`s, `Peer`s, `Grant`s and `Batch`es of
//! `Transfer`s: features `sim`, or `rdma` and `cuda`), its configuration,
//! and the errors a caller matches on. The layer under the facade
//! (`gdr_core::engine`, `buffer`, `ladder`) is imported by path.

pub use crate::{
    BackendChoice, Batch, Buffer, Context, Engine, Error, Grant, Peer, Region, Stream, Transfer,
};
pub use crate::{EngineConfig, GrantRights, MemoryDescriptor, TransferError};
