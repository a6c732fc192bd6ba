//! # gdr-core
//!
//! The part of gdr that knows no backend: buffers and memory kinds, the
//! registration ladder and cache, descriptors and `gdr://` URIs, and the
//! transfer engine, all generic over the `hal-verbs` and `hal-cuda` traits.
//! Concurrency goes through a `sync` shim (std or loom) so loom can check it.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

#[cfg(any(feature = "sim", feature = "rdma", feature = "cuda"))]
pub mod backend;
pub mod buffer;
pub mod descriptor;
pub mod engine;
pub mod ladder;
mod lifetime;
pub mod loopback;

#[allow(dead_code, unused_imports)] // the cache and engine take their types from here
mod sync;

pub mod cache;

pub use lifetime::MemoryLease;
