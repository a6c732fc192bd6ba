//! The front door: one type-erased [`Context`], [`Engine`], [`Buffer`],
//! [`Region`], [`Peer`], [`Grant`], [`Batch`] and [`Stream`] over whichever
//! backends were chosen at run time (wgpu over wgpu-hal is the model). The
//! C ABI, the `gdr` command and the Python package sit on these. Whatever
//! was chosen, the engines are of one type: the backends are erased below
//! them ([`Backends`](crate::backend::Backends) holds the HALs' `dynamic`
//! objects, no more instructions per request than the generic engine had:
//! `scripts/engine-callgrind.sh`).
//!
//! ```
//! use std::time::Duration;
//! use gdr_core::{BackendChoice, Context, EngineConfig, GrantRights};
//!
//! // Two engines on this process's simulated fabric.
//! let (a, b) = (Context::open(BackendChoice::Sim)?, Context::open(BackendChoice::Sim)?);
//! let (server, client) = (a.engine(EngineConfig::default())?, b.engine(EngineConfig::default())?);
//! let nic = server.nics()[0].clone();
//! let listener = server.listen((server.nic_address(&nic)?, 0).into())?;
//! let addr = listener.local_addr();
//! let accepting = std::thread::spawn(move || listener.accept(Duration::from_secs(5)));
//! let peer = client.connect(addr, Duration::from_secs(5))?;
//! let accepted = accepting.join().expect("accept")?;
//!
//! // The server grants 4 KiB of GPU memory; the client writes into it.
//! let gpu = a.alloc_device(0, 4096)?;
//! let grant = accepted.grant(&server.register(&gpu)?, 0, 4096, GrantRights::ReadWrite)?;
//! let remote = peer.wait_grant(grant.id(), Duration::from_secs(5))?;
//! let host = b.alloc_host(4096)?;
//! host.copy_from_host(0, &[7; 4096])?;
//! peer.write(&client.register(&host)?, &remote, 0)?.wait(Duration::from_secs(5))?;
//! assert_eq!(gpu.to_vec()?, vec![7; 4096]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod buffer;
mod context;

/// A buffer of the facade's backends.
type Erased = buffer::BufferOf;
mod stream;

pub use crate::engine::{Error, Unsupported};
pub use buffer::{Buffer, MemoryKind};
pub use context::{Context, PathInfo};
pub use stream::Stream;
