//! # gdr-core
//!
//! The part of gdr that knows no backend: buffers and memory kinds, the
//! registration ladder and cache, descriptors, and the transfer engine, all
//! generic over the `hal-verbs` and `hal-cuda` traits. Concurrency goes
//! through a `sync` shim (std or loom) so loom can check it.
//!
//! # When to use it
//!
//! This is the crate a Rust application depends on to move bytes between
//! host memory, GPU memory and remote peers over RDMA: a storage client,
//! a KV-cache transfer engine, an inference runtime. `use
//! gdr_core::prelude::*;` is the one import; [`engine`] is the transfer
//! engine, [`buffer`] the memory it moves, [`ladder`] how GPU memory is
//! registered (dma-buf, nvidia-peermem, or staged through pinned host
//! memory), [`descriptor`] and [`uri`] what peers and processes exchange.
//! The user guide (`docs/guide.md` in the repository) covers
//! prerequisites, run-time behaviour and tuning; from C, use `gdr-ffi`.
//!
//! # Features
//!
//! None by default: the library is generic over the HAL traits and builds
//! with nothing native. `sim`, `rdma` and `cuda` each add a backend to
//! the run-time choice in `backend` (the module needs `sim`, or both
//! `rdma` and `cuda`):
//!
//! | feature | backend | build needs |
//! | --- | --- | --- |
//! | `sim` | gdr-sim's simulated NIC and GPU | nothing native |
//! | `rdma` | rdma-core (`hal-verbs/rdma-core`), loaded at run time | cmake, libclang |
//! | `cuda` | the CUDA driver (`hal-cuda/cuda`), loaded at run time | nothing native |
//!
//! Without features, name the backend types yourself (as below with
//! gdr-sim's, or `hal_verbs::rdma::RdmaApi` and `hal_cuda::cuda::CudaApi`).
//!
//! Two more features are not backends: `tokio` adds
//! `Engine::drive_on_tokio`, which drives an engine from a task on the
//! caller's tokio runtime through fd readiness instead of from a thread
//! (nothing native either); `doctor` adds the doctor (`doctor`): one typed
//! report of what this machine can do, as text or JSON (serde), which
//! `gdr info` prints; it needs a backend feature, as `backend` does.
//!
//! # Using it: a storage client on the simulator
//!
//! Two nodes, each with an engine; the server grants a GPU buffer, the
//! client WRITEs a host buffer into it and READs it back into GPU memory of
//! its own, then registers again (a cache hit). The same code runs on
//! rdma-core and CUDA: only the providers differ (see `backend`, behind
//! the `sim`, `rdma` and `cuda` features).
//!
//! ```
//! use std::net::{IpAddr, Ipv4Addr, SocketAddr};
//! use std::time::Duration;
//!
//! use gdr_core::prelude::*;
//! use gdr_sim::{GpuConfig, NodeConfig, SimCuda, SimCudaApi, SimFabric, SimVerbsApi};
//!
//! // The engine is generic over the verbs and CUDA backends.
//! type SimEngine = Engine<SimVerbsApi, SimCudaApi>;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let fabric = SimFabric::new();
//! let (server_nic, client_nic) = (
//!     fabric.add_node("server", NodeConfig::default()),
//!     fabric.add_node("client", NodeConfig::default()),
//! );
//! let (server_gpu, client_gpu) = (
//!     SimCuda::new(vec![GpuConfig::default()], Default::default()),
//!     SimCuda::new(vec![GpuConfig::default()], Default::default()),
//! );
//! let server = SimEngine::new(&server_nic, Some(&server_gpu), EngineConfig::default())?;
//! let client = SimEngine::new(&client_nic, Some(&client_gpu), EngineConfig::default())?;
//!
//! // The server listens; the client connects (each side gets a Peer).
//! let mut listener = server.listen(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))?;
//! let port = listener.local_addr().port();
//! let accepting = std::thread::spawn(move || listener.accept(Duration::from_secs(5)));
//! let server_ip = IpAddr::V4(server_nic.device_ipv4("sim0").expect("an address"));
//! let to_server = client.connect(SocketAddr::new(server_ip, port), Duration::from_secs(5))?;
//! let to_client = accepting.join().expect("accept thread")?;
//!
//! // The server's GPU buffer, granted for READ and WRITE.
//! const LEN: u64 = 1 << 20;
//! let gpu = Buffer::alloc_device(&server_gpu.context(0)?, LEN)?;
//! let gpu_region = server.register(&gpu)?;
//! let grant = to_client.grant(&gpu_region, 0, LEN, GrantRights::ReadWrite)?;
//! // (A real server sends the grant id in its own protocol; here we share it.)
//! let remote = to_server.wait_grant(grant.descriptor().grant, Duration::from_secs(5))?;
//!
//! // WRITE a host buffer into it, READ it back into the client's GPU.
//! let data: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
//! let host = Buffer::alloc_host(LEN);
//! host.write_at(0, &data)?;
//! let host_region = client.register(&host)?;
//! to_server
//!     .submit(&[Transfer::write(&host_region, 0, &remote, 0, LEN)])?
//!     .wait(Duration::from_secs(5))?;
//! let back = Buffer::alloc_device(&client_gpu.context(0)?, LEN)?;
//! let back_region = client.register(&back)?;
//! // Success returns after the GPU fence: kernels may read `back` now.
//! to_server
//!     .submit(&[Transfer::read(&back_region, 0, &remote, 0, LEN)])?
//!     .wait(Duration::from_secs(5))?;
//!
//! let mut check = vec![0u8; LEN as usize];
//! let stream = client_gpu.context(0)?.create_stream()?;
//! // SAFETY: `check` holds LEN bytes; `back` is LEN bytes of device memory.
//! unsafe { stream.copy_device_to_host(check.as_mut_ptr(), back.addr(), check.len())? };
//! stream.synchronize()?;
//! assert_eq!(check, data);
//!
//! // Registering the same buffer again hits the cache.
//! let again = client.register(&host)?;
//! assert!(again.registration(0).expect("one NIC").cache_hit());
//! # Ok(())
//! # }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

#[cfg(any(feature = "sim", feature = "rdma", feature = "cuda"))]
pub mod backend;
pub mod buffer;
pub mod cq_wait;
pub mod descriptor;
#[cfg(all(
    feature = "doctor",
    any(feature = "sim", feature = "rdma", feature = "cuda")
))]
pub mod doctor;
#[cfg(all(
    feature = "doctor",
    not(any(feature = "sim", feature = "rdma", feature = "cuda"))
))]
compile_error!(
    "gdr_core::doctor needs a backend feature: `sim`, or both `rdma` and `cuda` (as gdr_core::backend)"
);
pub mod engine;
#[cfg(any(feature = "sim", all(feature = "rdma", feature = "cuda")))]
pub mod facade;
pub mod ladder;
mod lifetime;
pub mod loopback;
pub mod prelude;
pub mod uri;

#[allow(dead_code, unused_imports)] // the cache and engine take their types from here
mod sync;

pub mod cache;

pub use lifetime::MemoryLease;

#[cfg(any(feature = "sim", all(feature = "rdma", feature = "cuda")))]
pub use backend::BackendChoice;
pub use descriptor::{GrantRights, MemoryDescriptor};
pub use engine::{EngineConfig, Fence, Op, Outcome, TransferError};
/// The facade's types, at the crate's root: what a library user names.
#[cfg(any(feature = "sim", all(feature = "rdma", feature = "cuda")))]
pub use facade::{
    Batch, Buffer, Context, Engine, Error, Grant, Listener, MemoryKind, PathInfo, Peer, Region,
    Stream, Transfer, Unsupported,
};
/// The HAL errors the facade's [`Error`] carries (with their native codes).
pub use hal_cuda::CudaError;
pub use hal_verbs::{VerbsError, WcStatus};

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
