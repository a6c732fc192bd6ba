//! [`Context`]: the backends chosen at run time (real or simulated NIC and
//! GPU), erased once; the [`Buffer`]s and [`Stream`]s it allocates, and the
//! [`Engine`](crate::Engine)s made of it (wgpu's instance and device are
//! the model). The C ABI, the `gdr` command and the Python package sit on
//! these.
//!
//! ```
//! use std::time::Duration;
//! use gdr_core::{BackendChoice, Context, EngineConfig, GrantRights};
//!
//! # #[cfg(not(feature = "sim"))]
//! # fn main() {}
//! # #[cfg(feature = "sim")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
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
//! # Ok(())
//! # }
//! ```

mod buffer;
mod stream;

pub use buffer::{Buffer, MemoryKind};
pub use stream::Stream;

/// A buffer of the context's backends.
type Erased = buffer::BufferOf;

use std::collections::HashMap;
use std::ffi::c_void;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use hal_cuda::{Context as _, Driver as _};
use hal_verbs::Provider as _;

use self::buffer::BufferOf;
use self::stream::StreamOf;
use crate::backend::{BackendChoice, Backends};
use crate::buffer::{Access, Buffer as BufferOfC, HostAllocError};
use crate::engine::{Engine as EngineOf, EngineConfig, VerbsCall};
use crate::engine::{Error, Unsupported};
use crate::ladder::{Gpu, Ladder, Policy, Rung};
use crate::uri::BufferUri;

/// The backends of this process, chosen once ([`BackendChoice`]): the
/// verbs provider and its NICs, the CUDA driver and its GPUs. Cheap to
/// clone (a shared handle); what is made from it keeps it alive.
///
/// Simulated contexts are nodes of one simulated fabric per process, with
/// one NIC and one GPU each: engines of two sim contexts connect to each
/// other as two machines on one network would.
#[derive(Clone)]
pub struct Context {
    pub(super) inner: Shared,
    pub(super) id: u64,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("id", &self.id)
            .field("verbs", &self.inner.verbs_name())
            .field("cuda", &self.inner.cuda_name())
            .finish_non_exhaustive()
    }
}

/// How GPU memory of a (GPU, NIC) pair is registered, probed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathInfo {
    /// The first rung that works (staging always does).
    pub rung: Rung,
    /// Why each higher rung does not, one line each.
    pub why_not: Vec<String>,
}

static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(1);

impl Context {
    /// Opens the backends `choice` names. [`BackendChoice::Sim`] adds a
    /// node to this process's simulated fabric.
    pub fn open(choice: BackendChoice) -> Result<Self, Error> {
        let inner = open(choice)?;
        Ok(Self {
            inner,
            id: NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// A context of backends made elsewhere: a HAL implementation of
    /// your own, erased by [`Backends::new`].
    pub fn of_backends(backends: Backends) -> Result<Self, Error> {
        Ok(Self {
            inner: open_on(backends)?,
            id: NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// A node of this process's simulated fabric with the devices and GPUs
    /// given (a GPU without dma-buf or peermem, two NICs, a NIC that
    /// cannot reach GPU memory, ...): what [`Context::open`] with
    /// [`BackendChoice::Sim`] makes with the defaults.
    #[cfg(feature = "sim")]
    pub fn sim(node: gdr_sim::NodeConfig, gpus: Vec<gdr_sim::GpuConfig>) -> Result<Self, Error> {
        Self::sim_backends(node, gpus)
    }

    /// A node of this process's simulated fabric beside simulated GPUs its
    /// NIC cannot register at all: what [`BackendChoice::Auto`] makes on a
    /// GPU machine without an RDMA device (a simulated NIC beside the real
    /// GPU), on the simulation. GPU memory takes the staging rung. Every
    /// such context shares one simulated GPU of this process (as every
    /// context shares the real driver), so engines of two of them copy GPU
    /// memory to each other by device copies where their peer-copy path
    /// is on.
    #[cfg(feature = "sim")]
    pub fn sim_nic_beside_unreachable_gpu() -> Result<Self, Error> {
        static GPU: std::sync::LazyLock<gdr_sim::SimCuda> = std::sync::LazyLock::new(|| {
            gdr_sim::SimCuda::new(
                vec![gdr_sim::GpuConfig::default()],
                crate::backend::SIM_FABRIC.faults(),
            )
        });
        let backends = crate::backend::sim_verbs(
            Some(hal_cuda::dynamic::DynDriver::new::<gdr_sim::SimCudaApi>(
                GPU.clone(),
            )),
            vec!["a simulated NIC beside simulated GPUs it cannot reach".to_owned()],
        )
        .nic_cannot_reach_gpu();
        Ok(Self {
            inner: open_on(backends)?,
            id: NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed),
        })
    }

    #[cfg(feature = "sim")]
    fn sim_backends(
        node: gdr_sim::NodeConfig,
        gpus: Vec<gdr_sim::GpuConfig>,
    ) -> Result<Self, Error> {
        let backends = Backends::sim(&crate::backend::SIM_FABRIC, node, gpus).with_note(
            "simulated node on this process's simulated fabric (shared by every sim context)",
        );
        Ok(Self {
            inner: open_on(backends)?,
            id: NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Its id (what its buffers and engines are matched by).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Whether the NICs can register GPU memory of this context's GPUs:
    /// false without a GPU, and where a simulated NIC stands beside a real
    /// GPU.
    pub fn nic_reaches_gpu(&self) -> bool {
        self.inner.nic_reaches_gpu()
    }

    /// The verbs backend's name (`rdma-core`, `sim`).
    pub fn verbs_backend(&self) -> &'static str {
        self.inner.verbs_name()
    }

    /// The CUDA backend's name (`cuda`, `sim`); `None` without a GPU.
    pub fn cuda_backend(&self) -> Option<&'static str> {
        self.inner.cuda_name()
    }

    /// Why each backend was chosen where it was not the one asked for, and
    /// what that limits.
    pub fn notes(&self) -> &[String] {
        self.inner.notes()
    }

    /// The backends in use and why, as text (one line, then the notes).
    pub fn describe(&self) -> String {
        let mut text = format!(
            "verbs: {}; cuda: {}",
            self.verbs_backend(),
            self.cuda_backend().unwrap_or("none")
        );
        for note in self.notes() {
            text.push('\n');
            text.push_str(note);
        }
        text
    }

    /// The GPUs this context can use.
    pub fn gpu_count(&self) -> u32 {
        self.inner.gpu_count()
    }

    /// The NICs' names.
    pub fn nics(&self) -> Vec<String> {
        self.inner.nics()
    }

    /// The address NIC `nic` is reached at: its RoCE v2 GID on port 1, IPv4
    /// first. Give it (with a port) to [`Engine::listen`](crate::Engine::listen) and to the peer.
    pub fn nic_address(&self, nic: &str) -> Result<IpAddr, Error> {
        self.inner.nic_address(nic)
    }

    /// How GPU `gpu`'s memory registers on NIC `nic` (probed once).
    pub fn path(&self, gpu: u32, nic: u32) -> Result<PathInfo, Error> {
        self.inner.path(gpu, nic)
    }

    /// `size` zeroed bytes of ordinary host memory.
    pub fn alloc_host(&self, size: u64) -> Result<Buffer, Error> {
        Ok(self.buffer(self.inner.alloc(MemoryKind::Host, 0, size)?))
    }

    /// `size` bytes of pinned host memory (needs a GPU's driver).
    pub fn alloc_pinned(&self, size: u64) -> Result<Buffer, Error> {
        Ok(self.buffer(self.inner.alloc(MemoryKind::Pinned, 0, size)?))
    }

    /// `size` bytes of device memory on GPU `gpu`.
    pub fn alloc_device(&self, gpu: u32, size: u64) -> Result<Buffer, Error> {
        Ok(self.buffer(self.inner.alloc(MemoryKind::Device, gpu, size)?))
    }

    /// The caller's memory at `addr` as a buffer: host memory, or device
    /// memory CUDA knows.
    ///
    /// # Safety
    /// The range stays mapped and unfreed while the buffer, or any region,
    /// grant or transfer of it, lives (a buffer over caller memory waits
    /// for them when dropped).
    pub unsafe fn wrap(&self, addr: u64, size: u64) -> Result<Buffer, Error> {
        // SAFETY: the caller's contract is this function's.
        let buffer = unsafe { self.inner.wrap(addr, size, Access::ReadWrite) }?;
        Ok(self.buffer(buffer))
    }

    /// The caller's read-only memory at `addr` as a buffer, as
    /// [`Context::wrap`]: nothing gdr does writes it. Its registrations
    /// have no local or remote write access; a grant of it with write
    /// rights, a READ into it and [`Buffer::copy_from_host`] into it are
    /// refused.
    ///
    /// # Safety
    /// As for [`Context::wrap`].
    pub unsafe fn wrap_read_only(&self, addr: u64, size: u64) -> Result<Buffer, Error> {
        // SAFETY: the caller's contract is this function's.
        let buffer = unsafe { self.inner.wrap(addr, size, Access::ReadOnly) }?;
        Ok(self.buffer(buffer))
    }

    /// Opens the device memory a `gdr://` URI names (a CUDA IPC handle).
    pub fn open_uri(&self, uri: &BufferUri) -> Result<Buffer, Error> {
        Ok(self.buffer(self.inner.open_uri(uri)?))
    }

    /// A new stream on GPU `gpu` (non-blocking).
    pub fn stream(&self, gpu: u32) -> Result<Stream, Error> {
        Ok(Stream::new(self.id, gpu, self.inner.stream(gpu)?))
    }

    /// A stream someone else made on GPU `gpu` (a framework's: torch's
    /// `cuda_stream`, CuPy's `ptr`, a `__cuda_array_interface__`'s
    /// `stream`), so that gdr's work can be ordered with theirs
    /// ([`Peer::submit_after_stream`](crate::Peer::submit_after_stream)).
    /// Never destroyed by gdr. The simulation takes only another of its
    /// streams' [`Stream::raw`] and refuses anything else.
    ///
    /// # Safety
    /// On real CUDA, `raw` is a `CUstream` of GPU `gpu`'s primary context
    /// (or `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`) that outlives the
    /// returned stream.
    pub unsafe fn borrow_stream(&self, gpu: u32, raw: *mut c_void) -> Result<Stream, Error> {
        // SAFETY: the caller's contract is this function's.
        let inner = unsafe { self.inner.borrow_stream(gpu, raw) }?;
        Ok(Stream::new(self.id, gpu, inner))
    }

    /// A transfer engine over this context's NICs and the GPUs they reach.
    pub fn engine(&self, config: EngineConfig) -> Result<EngineOf, Error> {
        self.inner.engine(config, self.id)
    }

    fn buffer(&self, inner: Erased) -> Buffer {
        Buffer::new(self.clone(), inner)
    }
}

/// The backends `V`, `C`, with the GPUs' contexts retained.
pub(super) struct Instance {
    backends: Backends,
    gpus: Vec<hal_cuda::dynamic::DynContext>,
    paths: Mutex<HashMap<(u32, u32), PathInfo>>,
}

impl Instance {
    pub(super) fn gpu(&self, index: u32) -> Result<&hal_cuda::dynamic::DynContext, Error> {
        self.gpus.get(index as usize).ok_or(Error::NoGpu {
            index,
            count: self.gpus.len() as u32,
        })
    }

    /// Any GPU's context (CUDA's unified addressing answers for all).
    fn any_gpu(&self) -> Option<&hal_cuda::dynamic::DynContext> {
        self.gpus.first()
    }

    fn probe(&self, gpu: u32, nic: u32) -> Result<PathInfo, Error> {
        let nics = self.nics();
        let name = nics.get(nic as usize).ok_or(Error::NoNic {
            index: nic,
            count: nics.len() as u32,
        })?;
        let Some(driver) = self.backends.registrable_cuda() else {
            return Ok(PathInfo {
                rung: Rung::Staging,
                why_not: vec![format!(
                    "{name} cannot reach GPU memory of this CUDA backend"
                )],
            });
        };
        let context = self.backends.verbs().open(name).map_err(|e| {
            Error::verbs(
                VerbsCall::OpenDevice {
                    device: name.clone(),
                },
                e,
            )
        })?;
        let ladder = Ladder::standalone(&context, vec![Gpu::open(driver, gpu)?])?;
        let mut why_not = Vec::new();
        for (_, rung, verdict) in ladder.probe_all() {
            match verdict {
                Ok(()) => return Ok(PathInfo { rung, why_not }),
                Err(refusal) => why_not.push(format!("{rung:?}: {refusal}")),
            }
        }
        Ok(PathInfo {
            rung: Rung::Staging,
            why_not,
        })
    }

    fn wrap_buffer(self: &Arc<Self>, buffer: BufferOfC) -> BufferOf {
        BufferOf {
            instance: Arc::clone(self),
            buffer,
        }
    }
}

/// A context as its handles hold it: the instance behind an `Arc` so its
/// buffers can reach its GPUs.
pub(super) struct Shared(Arc<Instance>);

impl Clone for Shared {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl Shared {
    fn verbs_name(&self) -> &'static str {
        self.0.backends.verbs_name()
    }

    fn cuda_name(&self) -> Option<&'static str> {
        self.0.backends.cuda_name()
    }

    fn notes(&self) -> &[String] {
        self.0.backends.notes()
    }

    fn gpu_count(&self) -> u32 {
        self.0.gpus.len() as u32
    }

    fn nics(&self) -> Vec<String> {
        self.0.nics()
    }

    fn nic_reaches_gpu(&self) -> bool {
        self.0.backends.nic_reaches_gpu() && !self.0.gpus.is_empty()
    }

    fn nic_address(&self, nic: &str) -> Result<IpAddr, Error> {
        let context = self.0.backends.verbs().open(nic).map_err(|e| {
            Error::verbs(
                VerbsCall::OpenDevice {
                    device: nic.to_owned(),
                },
                e,
            )
        })?;
        crate::engine::roce_address(&context, nic)
    }

    fn path(&self, gpu: u32, nic: u32) -> Result<PathInfo, Error> {
        self.0.gpu(gpu)?;
        let paths = || self.0.paths.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(known) = paths().get(&(gpu, nic)) {
            return Ok(known.clone());
        }
        let info = self.0.probe(gpu, nic)?;
        paths().insert((gpu, nic), info.clone());
        Ok(info)
    }

    fn alloc(&self, kind: MemoryKind, gpu: u32, size: u64) -> Result<BufferOf, Error> {
        if size == 0 || isize::try_from(size).is_err() {
            return Err(Error::BadSize { what: "size", size });
        }
        let buffer = match kind {
            MemoryKind::Host => BufferOfC::try_alloc_host(size).map_err(|e| match e {
                HostAllocError::OutOfMemory { .. } => Error::OutOfMemory {
                    what: "host memory",
                    size,
                },
                _ => Error::BadSize { what: "size", size },
            })?,
            MemoryKind::Pinned => {
                let gpu = self.0.any_gpu().ok_or(Error::NeedsGpu {
                    what: "pinned memory",
                })?;
                BufferOfC::alloc_pinned(gpu, size)?
            }
            MemoryKind::Device => BufferOfC::alloc_device(self.0.gpu(gpu)?, size)?,
            MemoryKind::Managed => return Err(Unsupported::ManagedMemory.into()),
        };
        Ok(self.0.wrap_buffer(buffer))
    }

    /// # Safety
    /// As for [`Context::wrap`].
    unsafe fn wrap(&self, addr: u64, size: u64, access: Access) -> Result<BufferOf, Error> {
        let gpu = self.0.any_gpu();
        // SAFETY: the caller's contract is Buffer::wrap's.
        let buffer = unsafe { BufferOfC::wrap_as(access, gpu, addr, size, None) }?;
        Ok(self.0.wrap_buffer(buffer))
    }

    fn open_uri(&self, uri: &BufferUri) -> Result<BufferOf, Error> {
        let gpu = self.0.gpu(uri.device())?;
        let buffer = BufferOfC::import_ipc_range(
            gpu,
            uri.handle(),
            uri.allocation(),
            uri.offset(),
            uri.size(),
        )?;
        Ok(self.0.wrap_buffer(buffer))
    }

    fn stream(&self, gpu: u32) -> Result<StreamOf, Error> {
        Ok(StreamOf(self.0.gpu(gpu)?.create_stream()?))
    }

    /// # Safety
    /// As for [`Context::borrow_stream`].
    unsafe fn borrow_stream(&self, gpu: u32, raw: *mut c_void) -> Result<StreamOf, Error> {
        // SAFETY: the caller's contract is Context::borrow_stream's.
        let stream = unsafe { self.0.gpu(gpu)?.borrow_stream(raw) }?;
        Ok(StreamOf(stream))
    }

    fn engine(&self, mut config: EngineConfig, context: u64) -> Result<EngineOf, Error> {
        if !self.0.backends.nic_reaches_gpu() && config.ladder.policy == Policy::Fallback {
            // The NIC cannot register GPU memory at all (a simulated NIC
            // beside a real GPU): straight to the staging rung, which
            // moves it all the same, without probing rungs that cannot be.
            config.ladder.policy = Policy::Only(Rung::Staging);
        }
        EngineOf::build(
            self.0.backends.verbs(),
            self.0.backends.cuda(),
            config,
            context,
        )
    }
}

impl Instance {
    fn nics(&self) -> Vec<String> {
        self.backends
            .verbs()
            .devices()
            .map(|devices| devices.into_iter().map(|d| d.name).collect())
            .unwrap_or_default()
    }
}

/// Makes the context for the backends chosen.
fn open_on(backends: Backends) -> Result<Shared, Error> {
    let gpus = match backends.cuda() {
        Some(driver) => (0..driver.device_count().unwrap_or(0))
            .map(|ordinal| driver.context(ordinal))
            .collect::<Result<Vec<_>, _>>()?,
        None => Vec::new(),
    };
    Ok(Shared(Arc::new(Instance {
        backends,
        gpus,
        paths: Mutex::new(HashMap::new()),
    })))
}

/// The simulation for a new context: a node of the process's simulated
/// fabric with one NIC at an address of its own, and one simulated GPU.
#[cfg(feature = "sim")]
fn sim_node() -> Result<Backends, Error> {
    use gdr_sim::{DeviceConfig, GpuConfig, NodeConfig};
    let addr = crate::backend::next_sim_node_address().ok_or(Error::SimFabricFull)?;
    let backends = Backends::sim(
        &crate::backend::SIM_FABRIC,
        NodeConfig {
            ipv4: Some(addr),
            devices: vec![DeviceConfig::default()],
        },
        vec![GpuConfig::default()],
    );
    Ok(backends.with_note(format!(
        "simulated node {addr} on this process's simulated fabric (shared by every sim context)"
    )))
}

fn open(choice: BackendChoice) -> Result<Shared, Error> {
    #[cfg(feature = "sim")]
    if choice == BackendChoice::Sim {
        return open_on(sim_node()?);
    }
    open_on(Backends::choose(choice)?)
}
