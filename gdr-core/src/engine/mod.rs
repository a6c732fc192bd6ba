//! The transfer engine: peers, grants, batched one-sided transfers and
//! control messages, with every request completing exactly once.

pub mod completion;
#[allow(dead_code)] // the driver that uses it is being written
mod core;
pub mod error;
#[cfg(all(test, loom))]
mod loom_tests;
pub mod topology;
pub mod wire;
