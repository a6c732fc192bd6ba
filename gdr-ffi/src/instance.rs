//! The backend behind a context, chosen once at `gdr_context_new` and
//! erased: the C functions call [`Backend`]'s methods, and
//! [`Instance`] implements them once, generically, for whatever pair of
//! HAL backends was chosen (gdr-core's run-time choice; adding a backend
//! touches no export).

use std::any::Any;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use gdr_core::backend::{BackendChoice, BackendTask, Backends, run_with};
use gdr_core::buffer::Buffer;
use gdr_core::engine::{Engine, EngineConfig};
use gdr_core::ladder::{Gpu, Ladder, Rung};
use gdr_core::uri::BufferUri;
use gdr_sim::{DeviceConfig, GpuConfig, NodeConfig, SimCudaApi, SimFabric, SimVerbsApi};
use hal_cuda::{Context as _, Driver as _, MemoryType, Stream as _};
use hal_verbs::{AddressFamily, Context as _, Provider as _};

use crate::engine::AnyEngine;
use crate::result::{FfiError, GdrResult};
use crate::stream::{AnyStream, StreamOf};

/// A buffer of some backend, type-erased (`Buffer<C>` inside).
pub(crate) type AnyBuffer = Box<dyn Any + Send + Sync>;

/// What kind of memory a buffer is, as C sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemoryKind {
    Host,
    Pinned,
    Device,
    Managed,
}

/// A buffer's facts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BufferFacts {
    pub addr: u64,
    pub size: u64,
    pub kind: MemoryKind,
    pub device: Option<u32>,
}

/// How a (GPU, NIC) pair registers GPU memory, probed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PathFacts {
    /// The first rung that works (staging always does).
    pub rung: Rung,
    /// Why each higher rung does not, one line each.
    pub why_not: String,
}

/// What a context can do, whatever its backends.
pub(crate) trait Backend: Send + Sync {
    /// The backends in use and why (each fallback explained).
    fn describe(&self) -> String;
    fn gpu_count(&self) -> u32;
    fn nic_names(&self) -> Vec<String>;
    /// The rung GPU `gpu`'s memory takes on NIC `nic`.
    fn path(&self, gpu: u32, nic: u32) -> Result<PathFacts, FfiError>;
    fn alloc(&self, kind: MemoryKind, device: u32, size: u64) -> Result<AnyBuffer, FfiError>;
    /// # Safety
    /// As for [`Buffer::wrap`]: the range stays mapped, unfreed, while the
    /// buffer lives.
    unsafe fn wrap(&self, addr: u64, size: u64) -> Result<AnyBuffer, FfiError>;
    fn open_uri(&self, uri: &BufferUri) -> Result<AnyBuffer, FfiError>;
    fn export_uri(&self, buffer: &AnyBuffer) -> Result<BufferUri, FfiError>;
    fn facts(&self, buffer: &AnyBuffer) -> Result<BufferFacts, FfiError>;
    /// Frees `buffer` unless MRs still cover it past its release timeout;
    /// handed back then.
    fn release(&self, buffer: AnyBuffer) -> Result<(), (AnyBuffer, FfiError)>;
    /// Copies `len` bytes from `src` into `buffer` at `offset` (a stream
    /// copy for device memory, synchronized).
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes.
    unsafe fn copy_in(
        &self,
        buffer: &AnyBuffer,
        offset: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), FfiError>;
    /// Copies `len` bytes of `buffer` at `offset` to `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes.
    unsafe fn copy_out(
        &self,
        buffer: &AnyBuffer,
        offset: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), FfiError>;
    /// A transfer engine over the context's NICs and the GPUs they reach.
    fn engine(&self, config: EngineConfig) -> Result<Arc<dyn AnyEngine>, FfiError>;
    /// A new stream on GPU `device`.
    fn stream(&self, device: u32) -> Result<Box<dyn AnyStream>, FfiError>;
    /// The address NIC `nic` is reached at (its RoCE v2 GID on port 1,
    /// IPv4 first).
    fn nic_address(&self, nic: &str) -> Result<IpAddr, FfiError>;
}

/// A context's backends, with the GPUs' contexts retained.
pub(crate) struct Instance<V: hal_verbs::Api, C: hal_cuda::Api> {
    backends: Backends<V, C>,
    gpus: Vec<C::Context>,
    paths: Mutex<HashMap<(u32, u32), PathFacts>>,
}

/// Makes the instance for the backends chosen.
struct Open;

impl BackendTask for Open {
    type Output = Result<Arc<dyn Backend>, FfiError>;

    fn run<V: hal_verbs::Api, C: hal_cuda::Api>(self, backends: Backends<V, C>) -> Self::Output {
        let gpus = match backends.cuda() {
            Some(driver) => (0..driver.device_count().unwrap_or(0))
                .map(|ordinal| driver.context(ordinal))
                .collect::<Result<Vec<_>, _>>()?,
            None => Vec::new(),
        };
        Ok(Arc::new(Instance {
            backends,
            gpus,
            paths: Mutex::new(HashMap::new()),
        }))
    }
}

/// The simulated fabric of this process: every simulated context is a node
/// of it, so engines of two sim contexts reach each other as two machines
/// on one network would.
static SIM_FABRIC: LazyLock<SimFabric> = LazyLock::new(SimFabric::new);

/// First address of the sim contexts' nodes: 10.128.0.0/9, four
/// addresses per node (apart from the `10.77.<node>.1` the fabric assigns
/// itself).
const SIM_NODE_BASE: Ipv4Addr = Ipv4Addr::new(10, 128, 0, 1);

/// The simulation for a new context: a node of [`SIM_FABRIC`] with one
/// NIC at an address of its own, and one simulated GPU.
fn sim_node() -> Result<Backends<SimVerbsApi, SimCudaApi>, FfiError> {
    static NODES: AtomicU32 = AtomicU32::new(0);
    let node = NODES.fetch_add(1, Ordering::Relaxed);
    let addr = node
        .checked_mul(4)
        .and_then(|o| u32::from(SIM_NODE_BASE).checked_add(o))
        .map(Ipv4Addr::from)
        .filter(|a| a.octets()[0] == 10)
        .ok_or_else(|| {
            FfiError::new(
                GdrResult::OutOfResources,
                "the process's simulated fabric has no address left for another context",
            )
        })?;
    let backends = Backends::sim(
        &SIM_FABRIC,
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

/// Opens the backends `choice` names: the simulation as a node of the
/// process's simulated fabric.
pub(crate) fn open(choice: BackendChoice) -> Result<Arc<dyn Backend>, FfiError> {
    if choice == BackendChoice::Sim {
        return Open.run(sim_node()?);
    }
    run_with(choice, Open).map_err(|e| {
        let result = match &e {
            gdr_core::backend::BackendError::Verbs { source } => GdrResult::from(source),
            _ => GdrResult::NotSupported,
        };
        FfiError::new(result, e.to_string())
    })?
}

impl<V: hal_verbs::Api, C: hal_cuda::Api> Instance<V, C> {
    fn gpu(&self, device: u32) -> Result<&C::Context, FfiError> {
        self.gpus.get(device as usize).ok_or_else(|| {
            FfiError::new(
                GdrResult::NoDevice,
                format!("no GPU {device} ({} in this context)", self.gpus.len()),
            )
        })
    }

    /// Any GPU's context (CUDA's unified addressing answers for all).
    fn any_gpu(&self) -> Option<&C::Context> {
        self.gpus.first()
    }

    fn buffer<'b>(&self, buffer: &'b AnyBuffer) -> Result<&'b Buffer<C>, FfiError> {
        buffer.downcast_ref::<Buffer<C>>().ok_or_else(|| {
            FfiError::new(
                GdrResult::InvalidHandle,
                "the buffer belongs to a context of other backends",
            )
        })
    }

    fn probe(&self, gpu: u32, nic: u32) -> Result<PathFacts, FfiError> {
        let name = self
            .nic_names()
            .into_iter()
            .nth(nic as usize)
            .ok_or_else(|| FfiError::new(GdrResult::NoDevice, format!("no NIC {nic}")))?;
        let Some(driver) = self.backends.registrable_cuda() else {
            return Ok(PathFacts {
                rung: Rung::Staging,
                why_not: format!("{name} cannot reach GPU memory of this CUDA backend"),
            });
        };
        let context = self.backends.verbs().open(&name)?;
        let gpus = vec![Gpu::<C>::open(driver, gpu)?];
        let ladder = Ladder::<V, C>::standalone(&context, gpus)?;
        let mut why_not = Vec::new();
        for (_, rung, verdict) in ladder.probe_all() {
            match verdict {
                Ok(()) => {
                    return Ok(PathFacts {
                        rung,
                        why_not: why_not.join("\n"),
                    });
                }
                Err(refusal) => why_not.push(format!("{rung:?}: {refusal}")),
            }
        }
        Ok(PathFacts {
            rung: Rung::Staging,
            why_not: why_not.join("\n"),
        })
    }
}

impl<V: hal_verbs::Api, C: hal_cuda::Api> Backend for Instance<V, C> {
    fn describe(&self) -> String {
        let mut text = format!(
            "verbs: {}; cuda: {}",
            self.backends.verbs_name(),
            self.backends.cuda_name().unwrap_or("none")
        );
        for note in self.backends.notes() {
            text.push('\n');
            text.push_str(note);
        }
        text
    }

    fn gpu_count(&self) -> u32 {
        self.gpus.len() as u32
    }

    fn nic_names(&self) -> Vec<String> {
        self.backends
            .verbs()
            .devices()
            .map(|devices| devices.into_iter().map(|d| d.name).collect())
            .unwrap_or_default()
    }

    fn path(&self, gpu: u32, nic: u32) -> Result<PathFacts, FfiError> {
        self.gpu(gpu)?;
        let key = (gpu, nic);
        if let Some(known) = self
            .paths
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
        {
            return Ok(known.clone());
        }
        let facts = self.probe(gpu, nic)?;
        self.paths
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, facts.clone());
        Ok(facts)
    }

    fn alloc(&self, kind: MemoryKind, device: u32, size: u64) -> Result<AnyBuffer, FfiError> {
        if size == 0 {
            return Err(FfiError::invalid("size", "0"));
        }
        let buffer = match kind {
            MemoryKind::Host => {
                if isize::try_from(size).is_err() {
                    return Err(FfiError::new(
                        GdrResult::OutOfResources,
                        format!("{size} bytes is not an allocatable size"),
                    ));
                }
                Buffer::<C>::alloc_host(size)
            }
            MemoryKind::Pinned => {
                let gpu = self.any_gpu().ok_or_else(|| {
                    FfiError::new(GdrResult::NoDevice, "pinned memory needs a GPU's driver")
                })?;
                Buffer::<C>::alloc_pinned(gpu, size)?
            }
            MemoryKind::Device => Buffer::<C>::alloc_device(self.gpu(device)?, size)?,
            MemoryKind::Managed => {
                return Err(FfiError::new(
                    GdrResult::NotSupported,
                    "managed memory is never registered",
                ));
            }
        };
        Ok(Box::new(buffer))
    }

    unsafe fn wrap(&self, addr: u64, size: u64) -> Result<AnyBuffer, FfiError> {
        // SAFETY: the caller's contract is Buffer::wrap's.
        let buffer = unsafe { Buffer::<C>::wrap(self.any_gpu(), addr, size, None) }?;
        Ok(Box::new(buffer))
    }

    fn open_uri(&self, uri: &BufferUri) -> Result<AnyBuffer, FfiError> {
        let gpu = self.gpu(uri.device())?;
        let buffer = Buffer::<C>::import_ipc_range(
            gpu,
            uri.handle(),
            uri.allocation(),
            uri.offset(),
            uri.size(),
        )?;
        Ok(Box::new(buffer))
    }

    fn export_uri(&self, buffer: &AnyBuffer) -> Result<BufferUri, FfiError> {
        let buffer = self.buffer(buffer)?;
        let (Some(device), MemoryType::Device) = (buffer.device_ordinal(), buffer.memory_type())
        else {
            return Err(FfiError::new(
                GdrResult::NotSupported,
                "only device memory has a gdr:// URI",
            ));
        };
        let handle = self.gpu(device)?.ipc_export(buffer.addr())?;
        let uri = BufferUri::V2 {
            device,
            allocation: buffer.allocation_size(),
            offset: buffer.addr() - buffer.allocation_base(),
            size: buffer.len(),
            handle,
        };
        uri.validate()?;
        Ok(uri)
    }

    fn facts(&self, buffer: &AnyBuffer) -> Result<BufferFacts, FfiError> {
        let buffer = self.buffer(buffer)?;
        let kind = match buffer.memory_type() {
            MemoryType::PageableHost => MemoryKind::Host,
            MemoryType::PinnedHost => MemoryKind::Pinned,
            MemoryType::Device => MemoryKind::Device,
            MemoryType::Managed => MemoryKind::Managed,
        };
        Ok(BufferFacts {
            addr: buffer.addr(),
            size: buffer.len(),
            kind,
            device: buffer.device_ordinal(),
        })
    }

    fn release(&self, buffer: AnyBuffer) -> Result<(), (AnyBuffer, FfiError)> {
        let buffer = match buffer.downcast::<Buffer<C>>() {
            Ok(buffer) => *buffer,
            Err(other) => {
                return Err((
                    other,
                    FfiError::new(
                        GdrResult::InvalidHandle,
                        "the buffer belongs to a context of other backends",
                    ),
                ));
            }
        };
        let timeout = buffer.release_timeout();
        buffer.release(timeout).map_err(|kept| {
            (
                Box::new(kept) as AnyBuffer,
                FfiError::new(
                    GdrResult::Busy,
                    "memory registrations still cover the buffer (a grant or transfer holds them)",
                ),
            )
        })
    }

    unsafe fn copy_in(
        &self,
        buffer: &AnyBuffer,
        offset: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), FfiError> {
        let buffer = self.buffer(buffer)?;
        check_range(buffer, offset, len)?;
        if buffer.memory_type() == MemoryType::Device {
            let stream = self
                .gpu(buffer.device_ordinal().unwrap_or(0))?
                .create_stream()?;
            // SAFETY: `len` bytes at `offset` lie in the device buffer
            // (checked), `src` holds `len` readable bytes (the caller's
            // contract), and the stream is synchronized before returning.
            unsafe { stream.copy_host_to_device(buffer.addr() + offset, src, len) }?;
            return Ok(stream.synchronize()?);
        }
        // SAFETY: `src` is valid for reads of `len` bytes (the caller's
        // contract); not NULL (checked by the export).
        let data = unsafe { std::slice::from_raw_parts(src, len) };
        buffer
            .write_at(offset, data)
            .map_err(|e| FfiError::invalid("buffer", e))
    }

    unsafe fn copy_out(
        &self,
        buffer: &AnyBuffer,
        offset: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), FfiError> {
        let buffer = self.buffer(buffer)?;
        check_range(buffer, offset, len)?;
        if buffer.memory_type() == MemoryType::Device {
            let stream = self
                .gpu(buffer.device_ordinal().unwrap_or(0))?
                .create_stream()?;
            // SAFETY: as in copy_in, the other way.
            unsafe { stream.copy_device_to_host(dst, buffer.addr() + offset, len) }?;
            return Ok(stream.synchronize()?);
        }
        // SAFETY: `dst` is valid for writes of `len` bytes (the caller's
        // contract), not NULL (checked by the export), and not the
        // buffer's own memory as a Rust reference (read_at copies through
        // raw pointers).
        let out = unsafe { std::slice::from_raw_parts_mut(dst, len) };
        buffer
            .read_at(offset, out)
            .map_err(|e| FfiError::invalid("buffer", e))
    }

    fn engine(&self, config: EngineConfig) -> Result<Arc<dyn AnyEngine>, FfiError> {
        let engine = Engine::<V, C>::new(
            self.backends.verbs(),
            self.backends.registrable_cuda(),
            config,
        )?;
        Ok(Arc::new(engine))
    }

    fn stream(&self, device: u32) -> Result<Box<dyn AnyStream>, FfiError> {
        let stream = self.gpu(device)?.create_stream()?;
        Ok(Box::new(StreamOf::<C>(stream)))
    }

    fn nic_address(&self, nic: &str) -> Result<IpAddr, FfiError> {
        let table = self.backends.verbs().open(nic)?.gid_table(1)?;
        hal_verbs::select_roce_v2_gid(&table, AddressFamily::V4)
            .or_else(|| hal_verbs::select_roce_v2_gid(&table, AddressFamily::V6))
            .map(|entry| entry.gid.to_ip())
            .ok_or_else(|| {
                FfiError::new(
                    GdrResult::NotSupported,
                    format!("{nic} port 1 has no RoCE v2 address"),
                )
            })
    }
}

/// `len` bytes at `offset` lie in `buffer`.
fn check_range<C: hal_cuda::Api>(
    buffer: &Buffer<C>,
    offset: u64,
    len: usize,
) -> Result<(), FfiError> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= buffer.len() => Ok(()),
        _ => Err(FfiError::invalid(
            "len",
            format!(
                "{len} bytes at offset {offset} exceed the buffer's {} bytes",
                buffer.len()
            ),
        )),
    }
}
