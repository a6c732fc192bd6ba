//! One import for a library user: `use gdr_core::prelude::*;` brings a
//! `Context` of backends chosen at run time, its `Engine`s, `Buffer`s and
//! `Stream`s; `Region`s, `Peer`s, `Grant`s and `Batch`es of `Transfer`s;
//! the configuration, and the errors a caller matches on.

pub use crate::{
    BackendChoice, Batch, Buffer, Context, Engine, Error, Grant, Peer, Region, Stream, Transfer,
};
pub use crate::{EngineConfig, GrantRights, MemoryDescriptor, TransferError};
