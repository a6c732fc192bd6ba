//! The transfer engine: peers, grants, batched one-sided transfers and
//! control messages, with every request completing exactly once.

pub mod topology;
pub mod wire;
