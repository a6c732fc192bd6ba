//! # gdr-core
//!
//! Moves bytes between host memory, GPU memory and remote peers over RDMA:
//! GPU memory is registered with the NIC directly (GPUDirect RDMA) where
//! the machine allows, and staged through pinned host memory, per buffer
//! and transparently, where it does not.
//!
//! # The types
//!
//! A [`Context`] opens the backends once, at run time
//! ([`BackendChoice`]: real rdma-core and CUDA where found, the simulation
//! otherwise, or either on demand); it allocates [`Buffer`]s (host, pinned,
//! GPU, the caller's memory, a `gdr://` URI's) and [`Stream`]s, and makes
//! [`Engine`]s. An engine registers buffers as [`Region`]s (each NIC on
//! the first rung of the registration ladder that works), listens and
//! connects ([`Peer`]), grants a range of a region to a peer with explicit
//! rights ([`Grant`]; its [`MemoryDescriptor`] goes to the peer on the
//! connection) and moves bytes with [`Batch`]es of [`Transfer`]s that end
//! exactly once (`wait`, or `.await`). Every call fails with one
//! [`Error`] that keeps each layer's typed error. `use
//! gdr_core::prelude::*;` brings these.
//!
//! These are the engine's own types, not a layer over it: one engine type,
//! on the `hal-verbs` and `hal-cuda` backends erased once ([`backend`]:
//! their `dynamic` modules). A backend of your own comes in through
//! [`backend::Backends::new`] and [`Context::of_backends`].
//! [`descriptor`] and [`uri`] are what peers and processes exchange;
//! [`doctor`] (feature `doctor`) is `gdr info`'s report. The user guide
//! (`docs/guide.md` in the repository) covers prerequisites, run-time
//! behaviour and tuning; from C, use `gdr-ffi`.
//!
//! # Features
//!
//! None by default: the crate builds with nothing native, and
//! [`Context::open`] says which feature a backend asked for needs. The
//! backends of the run-time choice ([`backend`]):
//!
//! | feature | backend | build needs |
//! | --- | --- | --- |
//! | `sim` | gdr-sim's simulated NIC and GPU (also at [`sim`]) | nothing native |
//! | `rdma` | rdma-core (`hal-verbs/rdma-core`), loaded at run time | cmake, libclang |
//! | `cuda` | the CUDA driver (`hal-cuda/cuda`), loaded at run time | nothing native |
//!
//! Not backends: `tokio` adds [`Engine::drive_on_tokio`] (an engine driven
//! by a task on the caller's tokio runtime through fd readiness instead of
//! a thread); `doctor` adds [`doctor`] (serde); `testing` opens the wire
//! format and test hooks to the fuzz targets and the tests, not to
//! applications.
//!
//! # Using it: a storage client on the simulator
//!
//! Two contexts of this process's simulated fabric (on hardware:
//! `BackendChoice::Auto`), each with an engine; the server grants a GPU
//! buffer, the client WRITEs host memory into it and READs it back into GPU
//! memory of its own, then checks the bytes.
//!
//! ```
//! use std::time::Duration;
//!
//! use gdr_core::prelude::*;
//!
//! # // The simulation is feature `sim` (`cargo test -p gdr-core` alone
//! # // builds no backend, and this example is then a no-op).
//! # #[cfg(not(feature = "sim"))]
//! # fn main() {}
//! # #[cfg(feature = "sim")]
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let wait = Duration::from_secs(5);
//!     let server_context = Context::open(BackendChoice::Sim)?;
//!     let server = server_context.engine(EngineConfig::default())?;
//!     let client_context = Context::open(BackendChoice::Sim)?;
//!     let client = client_context.engine(EngineConfig::default())?;
//!
//!     // The server listens on its NIC's address; the client connects.
//!     let nic = &server.nics()[0];
//!     let listener = server.listen((server.nic_address(nic)?, 0).into())?;
//!     let addr = listener.local_addr();
//!     let accepting = std::thread::spawn(move || listener.accept(wait));
//!     let to_server = client.connect(addr, wait)?;
//!     let to_client = accepting.join().expect("accept thread")?;
//!
//!     // The server's GPU buffer, granted for READ and WRITE.
//!     const LEN: u64 = 1 << 20;
//!     let gpu = server_context.alloc_device(0, LEN)?;
//!     let grant = to_client.grant(&server.register(&gpu)?, 0, LEN, GrantRights::ReadWrite)?;
//!     // (A real server sends the grant id in its own protocol; here we share it.)
//!     let remote = to_server.wait_grant(grant.id(), wait)?;
//!
//!     // WRITE a host buffer into it, READ it back into the client's GPU.
//!     let data: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
//!     let host = client_context.alloc_host(LEN)?;
//!     host.copy_from_host(0, &data)?;
//!     to_server.write(&client.register(&host)?, &remote, 0)?.wait(wait)?;
//!     let back = client_context.alloc_device(0, LEN)?;
//!     let back_region = client.register(&back)?;
//!     // Success returns after the GPU fence: kernels may read `back` now.
//!     to_server
//!         .submit(&[Transfer::read(&back_region, 0, &remote, 0, LEN)])?
//!         .wait(wait)?;
//!     assert_eq!(back.to_vec()?, data);
//!     Ok(())
//! }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
// The crate docs link the doctor and the tokio driver, which their
// features build: without them those links have nothing to name.
#![cfg_attr(
    not(all(feature = "doctor", feature = "tokio")),
    allow(rustdoc::broken_intra_doc_links)
)]

pub mod backend;
mod context;
pub mod descriptor;
#[cfg(feature = "doctor")]
pub mod doctor;
mod lifetime;
pub mod prelude;
mod reaper;
pub mod uri;

#[allow(dead_code, unused_imports)] // the cache and engine take their types from here
mod sync;

/// The verbs backend every engine, ladder and cache is of: the HAL's
/// erased one, whatever was chosen at run time ([`backend::Backends`]).
pub(crate) type Verbs = hal_verbs::dynamic::DynApi;

/// The layers under the public types: private, opened to the tests, the
/// benches and the fuzz targets by feature `testing`; what a user names of
/// them is re-exported below. Without `testing`, what serves only those
/// (the bare-HAL loops' helpers, cache and ladder calls the tests make) is
/// allowed to go unused.
macro_rules! layers {
    ($($layer:ident),*) => {$(
        #[cfg(feature = "testing")]
        pub mod $layer;
        #[cfg(not(feature = "testing"))]
        #[allow(dead_code, unused_imports)]
        mod $layer;
    )*};
}
layers!(buffer, cache, cq_wait, engine, ladder, loopback);

pub use backend::BackendChoice;
pub use buffer::{Access, BufferAccessError};
pub use cache::{
    Bounds, BudgetExceeded, BudgetLimits, BudgetUsage, CacheConfig, CacheError, CacheStats, Limits,
};
pub use context::{Buffer, Context, MemoryKind, PathInfo, Stream};
pub use descriptor::{GrantRights, MemoryDescriptor, MemoryLocation};
#[cfg(all(feature = "tokio", not(loom)))]
pub use engine::{AsyncDriver, AsyncDriverError};
pub use engine::{
    Batch, Clock, DialError, DialRefused, Driver, Engine, EngineConfig, EngineResources, Fence,
    GiveUp, Grant, HandshakeFailure, Listener, NotAccepted, Op, Outcome, Path, Peer, PeerCopyRoute,
    PeerCopyStats, PeerGone, PeerLimits, PeerMisbehaved, PeerResources, QpCounters, ReadOnlyUse,
    Refusal, Region, SharedEngineError, SystemClock, TimedOut, Transfer, TransferError,
    Unavailable, VerbsCall,
};
pub use engine::{Error, Unsupported};
/// The HAL errors [`Error`] carries (with their native codes).
pub use hal_cuda::CudaError;
pub use hal_verbs::{VerbsError, WcStatus};
pub use ladder::{
    GpuLacks, LadderConfig, LadderError, Policy, Refusal as RungRefusal, RegisterError, Rung,
    RungFailure,
};
pub use loopback::LoopbackError;

/// The simulated NIC and GPU (gdr-sim), for tests and for trying gdr
/// without hardware.
#[cfg(feature = "sim")]
pub use gdr_sim as sim;

/// The user guide (`docs/guide.md`): its Rust examples run as doc tests
/// here (they use `backend`, hence the `sim` feature; `cargo test
/// --workspace` turns it on).
#[cfg(all(doctest, feature = "sim"))]
#[doc = include_str!("../../docs/guide.md")]
mod user_guide {}

/// The README's Rust example is the crate docs' (which runs as a doc test):
/// the same lines, less the doc test's hidden ones.
#[cfg(test)]
mod readme {
    fn rust_blocks(markdown: &str) -> Vec<String> {
        let mut blocks = Vec::new();
        let mut current: Option<Vec<&str>> = None;
        for line in markdown.lines() {
            match (&mut current, line.trim_start()) {
                (None, "```rust") => current = Some(Vec::new()),
                (Some(_), "```") => blocks.push(current.take().expect("open").join("\n")),
                (Some(lines), _) => lines.push(line),
                _ => {}
            }
        }
        blocks
    }

    #[test]
    fn the_readmes_example_is_the_crate_docs_doc_test() {
        let readme = include_str!("../../README.md");
        let docs: String = include_str!("lib.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("//!"))
            .map(|l| l.strip_prefix(' ').unwrap_or(l))
            .collect::<Vec<_>>()
            .join("\n");
        let start = docs.find("```\nuse ").expect("the crate docs' example") + 4;
        let end = start + docs[start..].find("\n```").expect("its end");
        let example: Vec<&str> = docs[start..end]
            .lines()
            .filter(|l| !(l.starts_with("# ") || *l == "#"))
            .collect();
        let blocks = rust_blocks(readme);
        assert_eq!(blocks.len(), 1, "the README has one Rust example");
        assert_eq!(blocks[0], example.join("\n"));
    }
}
