//! `gdr._gdr`: gdr-core for Python (PyO3, abi3). The package's
//! Python part (`python/gdr`) is the API users call; it resolves the
//! memory of the objects it is given (the buffer protocol, `__dlpack__`,
//! `__cuda_array_interface__`, `(address, length, device)`) to an address
//! and a length and keeps the object alive: this module registers that
//! memory and holds the object until every region, grant and batch using
//! it is gone.
//!
//! Every call that can wait (connecting, accepting, waiting for a grant or
//! a batch, a revoke, the drop of a region whose memory a transfer still
//! uses) releases the GIL; no engine thread ever takes it (asyncio is told
//! through an eventfd, `Notifier`).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::time::Duration;

use gdr_core::Op;
use gdr_core::{
    BackendChoice, Context, EngineConfig, GrantRights, MemoryDescriptor, Transfer, TransferError,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};

mod arrays;
mod errors;

use arrays::U64Array;
use errors::{raise, raise_error, raise_outcome};

/// `seconds` as a timeout (`None`: the engine's default where there is one).
fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| PyValueError::new_err(format!("{what}: {value} is not a duration in seconds")))
}

/// A transfer engine over a context of its own (the backends chosen once:
/// `"auto"`, `"real"` or `"sim"`).
#[pyclass(module = "gdr._gdr", frozen)]
struct Engine {
    engine: gdr_core::Engine,
    /// The context the engine was made of: its buffers and streams.
    context: Context,
    choice: BackendChoice,
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (backend = "auto", qps_per_peer = None, default_timeout = None, accept_timeout = None, peer_copy = None, staging_slots = None, staging_slice = None, max_peers = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        backend: &str,
        qps_per_peer: Option<u16>,
        default_timeout: Option<f64>,
        accept_timeout: Option<f64>,
        peer_copy: Option<bool>,
        staging_slots: Option<usize>,
        staging_slice: Option<u64>,
        max_peers: Option<usize>,
    ) -> PyResult<Self> {
        let choice = match backend {
            "auto" => BackendChoice::Auto,
            "real" => BackendChoice::Real,
            "sim" => BackendChoice::Sim,
            other => {
                return Err(raise(
                    py,
                    "InvalidArgument",
                    format!("backend: {other:?} is not \"auto\", \"real\" or \"sim\""),
                ));
            }
        };
        let mut config = EngineConfig::default();
        if let Some(qps) = qps_per_peer {
            config.qps_per_peer = qps;
        }
        if let Some(t) = default_timeout {
            config.default_timeout = seconds(t, "default_timeout")?;
        }
        if let Some(t) = accept_timeout {
            config.accept_timeout = seconds(t, "accept_timeout")?;
        }
        if let Some(p) = peer_copy {
            config.peer_copy = p;
        }
        if let Some(n) = staging_slots {
            config.staging_slots = n;
        }
        if let Some(n) = staging_slice {
            config.staging_slice = n;
        }
        if let Some(n) = max_peers {
            config.max_peers = n;
        }
        let (engine, context) = py
            .detach(|| {
                let context = Context::open(choice)?;
                Ok((context.engine(config)?, context))
            })
            .map_err(|e| raise_error(py, &e))?;
        Ok(Self {
            engine,
            context,
            choice,
        })
    }

    /// The engine's id (named in its grants' descriptors).
    #[getter]
    fn id(&self) -> u64 {
        self.engine.id()
    }

    /// The backends in use: `(verbs, cuda or None, notes)`.
    fn backends(&self) -> (&'static str, Option<&'static str>, Vec<String>) {
        let context = &self.context;
        (
            context.verbs_backend(),
            context.cuda_backend(),
            context.notes().to_vec(),
        )
    }

    /// The doctor's report (`gdr info --json`) for this engine's backend
    /// choice, as JSON text.
    fn describe_json(&self, py: Python<'_>) -> PyResult<String> {
        let choice = self.choice;
        py.detach(|| {
            gdr_core::doctor::report(choice, &gdr_core::doctor::DoctorOptions::default()).to_json()
        })
        .map_err(|e| raise(py, "GdrError", e.to_string()))
    }

    /// The NICs' names.
    fn nics(&self) -> Vec<String> {
        self.engine.nics()
    }

    /// The GPUs the engine's context can use.
    fn gpu_count(&self) -> u32 {
        self.context.gpu_count()
    }

    /// The address NIC `nic` is reached at.
    fn nic_address(&self, py: Python<'_>, nic: &str) -> PyResult<String> {
        self.engine
            .nic_address(nic)
            .map(|ip| ip.to_string())
            .map_err(|e| raise_error(py, &e))
    }

    /// Registers `length` bytes at `address` (memory `keepalive` owns,
    /// which the region holds until every region, grant and batch of it is
    /// gone, and hands back as its `obj`). `pin`: what else keeps the
    /// memory valid (a DLPack capsule), held as long and never handed out.
    /// `export`: the region holds a buffer export of `keepalive` itself,
    /// checked to be this memory (a `bytearray` cannot be resized under
    /// it, and no Python code can release it). `readonly` memory (a
    /// `bytes`, a read-only array or view) is registered as such: no write
    /// access, never granted for writing, never READ or copied into.
    ///
    /// The caller (the package's Python part) passes an address and length
    /// that lie in memory `keepalive` (with `pin`) keeps mapped while it
    /// lives.
    #[pyo3(signature = (address, length, keepalive, readonly = false, pin = None, export = false))]
    #[allow(clippy::too_many_arguments)] // Python's keywords, one each
    fn register_memory(
        &self,
        py: Python<'_>,
        address: u64,
        length: u64,
        keepalive: Py<PyAny>,
        readonly: bool,
        pin: Option<Py<PyAny>>,
        export: bool,
    ) -> PyResult<Region> {
        if address == 0 || length == 0 {
            return Err(raise(
                py,
                "InvalidArgument",
                format!("no memory to register: {length} bytes at {address:#x}"),
            ));
        }
        // Taken before the memory is wrapped: from here on it cannot move.
        let export = match export {
            true => Some(arrays::Export::of(py, keepalive.bind(py), address, length)?),
            false => None,
        };
        let context = &self.context;
        // SAFETY: the package resolved `address..address + length` from
        // `keepalive`'s own memory (the buffer protocol, checked against
        // the export just taken, DLPack or the CUDA array interface, whose
        // producers keep it mapped while the object and `pin` live, or the
        // caller's explicit `(address, length, device)` with its documented
        // contract), and the region holds `keepalive`, `pin` and the export
        // until the buffer is dropped, which waits for every MR of it to go.
        let buffer = unsafe {
            if readonly {
                context.wrap_read_only(address, length)
            } else {
                context.wrap(address, length)
            }
        }
        .map_err(|e| raise_error(py, &e))?;
        let region = py
            .detach(|| self.engine.register(&buffer))
            .map_err(|e| raise_error(py, &e))?;
        let mut region = Region::new(region, Some(buffer), Some(keepalive));
        region.pin = Pin { export, _held: pin };
        Ok(region)
    }

    /// `length` bytes of memory the engine allocates: `"host"`, `"pinned"`
    /// or `"device"` (of GPU `gpu`), registered.
    #[pyo3(signature = (length, kind = "host", gpu = 0))]
    fn alloc(&self, py: Python<'_>, length: u64, kind: &str, gpu: u32) -> PyResult<Region> {
        let context = &self.context;
        if !matches!(kind, "host" | "pinned" | "device") {
            return Err(raise(
                py,
                "InvalidArgument",
                format!("kind: {kind:?} is not \"host\", \"pinned\" or \"device\""),
            ));
        }
        // Pinning and device allocations can take a while.
        let buffer = py
            .detach(|| match kind {
                "host" => context.alloc_host(length),
                "pinned" => context.alloc_pinned(length),
                _ => context.alloc_device(gpu, length),
            })
            .map_err(|e| raise_error(py, &e))?;
        let region = py
            .detach(|| self.engine.register(&buffer))
            .map_err(|e| raise_error(py, &e))?;
        Ok(Region::new(region, Some(buffer), None))
    }

    /// A new stream of the engine's context on GPU `gpu` (non-blocking).
    fn stream(&self, py: Python<'_>, gpu: u32) -> PyResult<Stream> {
        let stream = self.context.stream(gpu).map_err(|e| raise_error(py, &e))?;
        Ok(Stream { stream })
    }

    /// Another's stream on GPU `gpu`, by its handle (a `CUstream`: torch's
    /// `cuda_stream`, CuPy's `ptr`, a CUDA array interface's `stream`),
    /// borrowed to order gdr's work after theirs, never destroyed.
    ///
    /// The caller (the package's Python part) passes the handle of a live
    /// stream of GPU `gpu`'s primary context, as the CUDA array interface
    /// and DLPack promise theirs are, and drops the borrow before it.
    fn borrow_stream(&self, py: Python<'_>, gpu: u32, handle: u64) -> PyResult<Stream> {
        let context = &self.context;
        // SAFETY: the handle is a live stream of this device's primary
        // context (the contract above, which the package documents for
        // `stream=`); the simulation checks its tokens itself.
        let stream =
            unsafe { context.borrow_stream(gpu, handle as usize as *mut std::ffi::c_void) }
                .map_err(|e| raise_error(py, &e))?;
        Ok(Stream { stream })
    }

    /// Listens at `host:port` (port 0 picks one).
    fn listen(&self, py: Python<'_>, host: &str, port: u16) -> PyResult<Listener> {
        let addr = socket_addr(py, host, port)?;
        let listener = self.engine.listen(addr).map_err(|e| raise_error(py, &e))?;
        Ok(Listener {
            addr: listener.local_addr(),
            listener,
        })
    }

    /// Connects to the engine listening at `host:port`.
    fn connect(&self, py: Python<'_>, host: &str, port: u16, timeout: f64) -> PyResult<Peer> {
        let addr = socket_addr(py, host, port)?;
        let timeout = seconds(timeout, "timeout")?;
        let peer = py
            .detach(|| self.engine.connect(addr, timeout))
            .map_err(|e| raise_error(py, &e))?;
        Ok(Peer { peer })
    }
}

fn socket_addr(py: Python<'_>, host: &str, port: u16) -> PyResult<SocketAddr> {
    let ip = host.parse().map_err(|_| {
        raise(
            py,
            "InvalidArgument",
            format!("host: {host:?} is not an IP address (a NIC's address: Engine.nic_address)"),
        )
    })?;
    Ok(SocketAddr::new(ip, port))
}

/// Registered memory. Holds the object whose memory it is until it, and
/// every grant and batch of it, are gone.
#[pyclass(module = "gdr._gdr", frozen)]
struct Region {
    /// `None` only while dropping: the registrations go before the buffer.
    region: Option<gdr_core::Region>,
    /// Dropped with the GIL released: a buffer over caller memory waits
    /// for its MRs (a transfer still running) before it lets go.
    buffer: Mutex<Option<gdr_core::Buffer>>,
    /// The object registered (its `obj`).
    keepalive: Option<Py<PyAny>>,
    /// What pins the memory besides: let go after the buffer.
    pin: Pin,
}

/// What keeps a region's memory where it is, out of Python's reach: a
/// buffer export of the object, or another object (a DLPack capsule) that
/// is never handed out.
#[derive(Default)]
struct Pin {
    export: Option<arrays::Export>,
    _held: Option<Py<PyAny>>,
}

impl Region {
    fn new(
        region: gdr_core::Region,
        buffer: Option<gdr_core::Buffer>,
        keepalive: Option<Py<PyAny>>,
    ) -> Self {
        Self {
            region: Some(region),
            buffer: Mutex::new(buffer),
            keepalive,
            pin: Pin::default(),
        }
    }

    fn region(&self) -> &gdr_core::Region {
        // Taken only by `drop`.
        self.region
            .as_ref()
            .unwrap_or_else(|| unreachable!("a region in use is not dropped"))
    }

    fn buffer(&self, py: Python<'_>) -> PyResult<gdr_core::Buffer> {
        self.buffer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| {
                raise(
                    py,
                    "InvalidArgument",
                    "the region's memory was let go".into(),
                )
            })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // The region's own registrations first: the buffer's drop waits
        // for every MR of its memory to go.
        drop(self.region.take());
        let buffer = self
            .buffer
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let export = self.pin.export.take();
        if buffer.is_some() || export.is_some() {
            Python::attach(|py| {
                // The last handle of caller memory waits for its MRs: not
                // with the GIL held (an engine thread never needs it, but
                // other Python threads should run meanwhile).
                py.detach(move || drop(buffer));
                // Only then may the memory move.
                if let Some(mut export) = export {
                    export.release(py);
                }
            });
        }
    }
}

#[pymethods]
impl Region {
    /// Its length in bytes.
    fn __len__(&self) -> usize {
        self.region().len() as usize
    }

    /// The rung each NIC registered it by (`"host"`, `"dmabuf"`,
    /// `"peermem"`, `"staging"`).
    fn rungs(&self) -> Vec<&'static str> {
        self.region()
            .rungs()
            .into_iter()
            .map(|rung| match rung {
                gdr_core::Rung::HostMemory => "host",
                gdr_core::Rung::Dmabuf => "dmabuf",
                gdr_core::Rung::Peermem => "peermem",
                gdr_core::Rung::Staging => "staging",
            })
            .collect()
    }

    /// The object whose memory it is (None for memory the engine
    /// allocated).
    #[getter]
    fn obj(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.keepalive.as_ref().map(|o| o.clone_ref(py))
    }

    /// The memory's address (a host pointer or a device address).
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.buffer(py)?.addr())
    }

    /// Whether its memory is read-only (registered from a `bytes`, a
    /// read-only array or view): granted for reading only, never READ or
    /// copied into.
    #[getter]
    fn readonly(&self) -> bool {
        self.region().access() == gdr_core::Access::ReadOnly
    }

    /// The GPU it lives on, None for host memory.
    #[getter]
    fn device(&self) -> Option<u32> {
        match self.region().location() {
            gdr_core::descriptor::MemoryLocation::Gpu { ordinal } => Some(u32::from(ordinal)),
            gdr_core::descriptor::MemoryLocation::Host => None,
        }
    }

    /// Copies `data` into the region at `offset` (device memory through a
    /// synchronized stream copy).
    #[pyo3(signature = (data, offset = 0))]
    fn write_bytes(&self, py: Python<'_>, data: Vec<u8>, offset: u64) -> PyResult<()> {
        let buffer = self.buffer(py)?;
        py.detach(|| buffer.copy_from_host(offset, &data))
            .map_err(|e| raise_error(py, &e))
    }

    /// `length` bytes of the region at `offset` (all of it by default).
    #[pyo3(signature = (offset = 0, length = None))]
    fn read_bytes<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        length: Option<u64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let buffer = self.buffer(py)?;
        let size = buffer.len();
        let length = length.unwrap_or_else(|| size.saturating_sub(offset));
        // The range first: a length past the region is the caller's
        // mistake, not an allocation to try.
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(raise(
                py,
                "InvalidArgument",
                format!(
                    "read_bytes: {length} bytes at offset {offset} exceed the region's {size} bytes"
                ),
            ));
        }
        // Then an allocation that fails as an exception, not an abort.
        let mut out = Vec::new();
        usize::try_from(length)
            .ok()
            .and_then(|n| out.try_reserve_exact(n).ok())
            .ok_or_else(|| {
                raise(
                    py,
                    "OutOfMemory",
                    format!("read_bytes: {length} bytes could not be allocated"),
                )
            })?;
        out.resize(length as usize, 0);
        py.detach(|| buffer.copy_to_host(offset, &mut out))
            .map_err(|e| raise_error(py, &e))?;
        Ok(PyBytes::new(py, &out))
    }
}

/// A listening engine.
#[pyclass(module = "gdr._gdr", frozen)]
struct Listener {
    addr: SocketAddr,
    /// Accepts from several threads at once wait side by side (no lock
    /// is held across an accept's wait).
    listener: gdr_core::Listener,
}

#[pymethods]
impl Listener {
    /// `(host, port)` it listens at.
    #[getter]
    fn address(&self) -> (String, u16) {
        (self.addr.ip().to_string(), self.addr.port())
    }

    /// Waits up to `timeout` seconds for a peer.
    fn accept(&self, py: Python<'_>, timeout: f64) -> PyResult<Peer> {
        let timeout = seconds(timeout, "timeout")?;
        let peer = py
            .detach(|| self.listener.accept(timeout))
            .map_err(|e| raise_error(py, &e))?;
        Ok(Peer { peer })
    }
}

/// A grant's descriptor: what the peer needs to reach it (send it out of
/// band as bytes or text, or let the peer wait for its announcement).
#[pyclass(module = "gdr._gdr", frozen, eq)]
#[derive(PartialEq)]
struct Descriptor {
    descriptor: MemoryDescriptor,
}

#[pymethods]
impl Descriptor {
    /// From its binary form.
    #[classmethod]
    fn from_bytes(_cls: &Bound<'_, PyType>, py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        MemoryDescriptor::decode(data)
            .map(|descriptor| Self { descriptor })
            .map_err(|e| raise(py, "InvalidArgument", format!("descriptor: {e}")))
    }

    /// From its text form (`gdr-md:v2:...`).
    #[classmethod]
    fn from_text(_cls: &Bound<'_, PyType>, py: Python<'_>, text: &str) -> PyResult<Self> {
        text.parse().map(|descriptor| Self { descriptor }).map_err(
            |e: gdr_core::descriptor::DescriptorError| {
                raise(py, "InvalidArgument", format!("descriptor: {e}"))
            },
        )
    }

    /// Its binary form.
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self
            .descriptor
            .encode()
            .map_err(|e| raise(py, "InvalidArgument", format!("descriptor: {e}")))?;
        Ok(PyBytes::new(py, &bytes))
    }

    fn __str__(&self) -> String {
        self.descriptor.to_string()
    }

    fn __repr__(&self) -> String {
        format!(
            "Descriptor(owner={:#x}, grant={}, length={}, rights={:?})",
            self.descriptor.owner,
            self.descriptor.grant,
            self.descriptor.len,
            self.descriptor.rights
        )
    }

    /// The grant's id.
    #[getter]
    fn grant(&self) -> u64 {
        self.descriptor.grant
    }

    /// The owner engine's id.
    #[getter]
    fn owner(&self) -> u64 {
        self.descriptor.owner
    }

    fn __len__(&self) -> usize {
        self.descriptor.len as usize
    }

    /// `"read"`, `"write"` or `"read_write"`.
    #[getter]
    fn rights(&self) -> &'static str {
        match self.descriptor.rights {
            GrantRights::Read => "read",
            GrantRights::Write => "write",
            GrantRights::ReadWrite => "read_write",
        }
    }
}

/// Memory granted to the peer; revoked when dropped (or by `revoke`).
#[pyclass(module = "gdr._gdr", frozen)]
struct Grant {
    grant: Mutex<Option<gdr_core::Grant>>,
    descriptor: MemoryDescriptor,
    /// The region granted (its memory must outlive the grant).
    _region: Py<Region>,
}

impl Drop for Grant {
    fn drop(&mut self) {
        let grant = self
            .grant
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if grant.is_some() {
            // Its revoke takes the engine's lock and tells the peer: not
            // with the GIL held.
            Python::attach(|py| py.detach(move || drop(grant)));
        }
    }
}

#[pymethods]
impl Grant {
    /// The grant's id (the descriptor's).
    #[getter]
    fn id(&self) -> u64 {
        self.descriptor.grant
    }

    /// Its descriptor.
    #[getter]
    fn descriptor(&self) -> Descriptor {
        Descriptor {
            descriptor: self.descriptor.clone(),
        }
    }

    /// Revokes it and waits up to `timeout` seconds for the fence: once
    /// this returns, no byte moves under the grant by any path.
    fn revoke(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let timeout = seconds(timeout, "timeout")?;
        let Some(grant) = self
            .grant
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        else {
            return Ok(());
        };
        py.detach(|| grant.revoke(timeout))
            .map_err(|e| raise_error(py, &e))
    }
}

/// A connected peer.
#[pyclass(module = "gdr._gdr", frozen)]
struct Peer {
    peer: gdr_core::Peer,
}

/// One transfer as the package hands it: `(op, region, local_offset,
/// descriptor, remote_offset, length)`, op 0 READ, 1 WRITE.
type TransferArgs = (u8, Py<Region>, u64, Py<Descriptor>, u64, u64);

fn op_of(py: Python<'_>, op: u8) -> PyResult<Op> {
    match op {
        0 => Ok(Op::Read),
        1 => Ok(Op::Write),
        other => Err(raise(
            py,
            "InvalidArgument",
            format!("op {other} is no READ (0) or WRITE (1)"),
        )),
    }
}

#[pymethods]
impl Peer {
    /// The remote engine's id.
    #[getter]
    fn remote_engine(&self) -> u64 {
        self.peer.remote_engine()
    }

    /// Grants `length` bytes at `offset` of `region` with `rights`
    /// (`"read"`, `"write"`, `"read_write"`).
    fn grant(
        &self,
        py: Python<'_>,
        region: Py<Region>,
        offset: u64,
        length: u64,
        rights: &str,
    ) -> PyResult<Grant> {
        let rights = match rights {
            "read" => GrantRights::Read,
            "write" => GrantRights::Write,
            "read_write" => GrantRights::ReadWrite,
            other => {
                return Err(raise(
                    py,
                    "InvalidArgument",
                    format!("rights: {other:?} is not \"read\", \"write\" or \"read_write\""),
                ));
            }
        };
        let granted = region.get();
        // Registers the range on each NIC and takes the engine's lock.
        let grant = py
            .detach(|| self.peer.grant(granted.region(), offset, length, rights))
            .map_err(|e| raise_error(py, &e))?;
        Ok(Grant {
            descriptor: grant.descriptor().clone(),
            grant: Mutex::new(Some(grant)),
            _region: region,
        })
    }

    /// How GPU memory moves with this peer: `"nic"`, `"same_process"`
    /// (device copies between two engines of this process) or `"ipc"`
    /// (device copies through CUDA IPC, another process on this machine).
    #[getter]
    fn route(&self) -> &'static str {
        match self.peer.route() {
            gdr_core::PeerCopyRoute::Nic => "nic",
            gdr_core::PeerCopyRoute::SameProcess => "same_process",
            gdr_core::PeerCopyRoute::Ipc => "ipc",
        }
    }

    /// Waits up to `timeout` seconds for the peer to announce grant `id`.
    fn wait_grant(&self, py: Python<'_>, id: u64, timeout: f64) -> PyResult<Descriptor> {
        let timeout = seconds(timeout, "timeout")?;
        py.detach(|| self.peer.wait_grant(id, timeout))
            .map(|descriptor| Descriptor { descriptor })
            .map_err(|e| raise_error(py, &e))
    }

    /// Submits `transfers` as one batch (`timeout` seconds, or the
    /// engine's default).
    #[pyo3(signature = (transfers, timeout = None, after = None))]
    fn submit(
        &self,
        py: Python<'_>,
        transfers: Vec<TransferArgs>,
        timeout: Option<f64>,
        after: Option<PyRef<'_, Stream>>,
    ) -> PyResult<Batch> {
        let mut list = Vec::with_capacity(transfers.len());
        for (op, region, local_offset, descriptor, remote_offset, len) in &transfers {
            list.push(Transfer {
                op: op_of(py, *op)?,
                local: region.get().region(),
                local_offset: *local_offset,
                remote: &descriptor.get().descriptor,
                remote_offset: *remote_offset,
                len: *len,
            });
        }
        let held = transfers
            .iter()
            .map(|(_, region, ..)| region.clone_ref(py))
            .collect();
        self.submit_list(py, &list, timeout, after.as_deref(), held)
    }

    /// Submits one batch of transfers of `op` between `region` and the
    /// grant `descriptor`: their local offsets, remote offsets and lengths
    /// from arrays of uint64 read in place (numpy, `array.array("Q")`; a
    /// paged KV cache's block lists, no Python loop), or one length for
    /// all (an int).
    #[pyo3(signature = (op, region, descriptor, local_offsets, remote_offsets, lengths, timeout = None, after = None))]
    #[allow(clippy::too_many_arguments)]
    fn submit_arrays(
        &self,
        py: Python<'_>,
        op: u8,
        region: Py<Region>,
        descriptor: PyRef<'_, Descriptor>,
        local_offsets: &Bound<'_, PyAny>,
        remote_offsets: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        after: Option<PyRef<'_, Stream>>,
    ) -> PyResult<Batch> {
        let op = op_of(py, op)?;
        let local = U64Array::of(py, local_offsets, "local_offset")?;
        let remote = U64Array::of(py, remote_offsets, "remote_offset")?;
        let (local, remote) = (local.values(), remote.values());
        let count = local.len();
        if count == 0 || count > 1 << 20 {
            return Err(raise(
                py,
                "InvalidArgument",
                format!("local_offset: {count} transfers (1 to 1 Mi)"),
            ));
        }
        if remote.len() != count {
            return Err(raise(
                py,
                "InvalidArgument",
                format!("remote_offset: {} entries, {count} expected", remote.len()),
            ));
        }
        let uniform: Option<u64> = lengths.extract().ok();
        let array = match uniform {
            Some(_) => None,
            None => Some(U64Array::of(py, lengths, "length")?),
        };
        let lens = array.as_ref().map_or(&[][..], U64Array::values);
        if uniform.is_none() && lens.len() != count {
            return Err(raise(
                py,
                "InvalidArgument",
                format!("length: {} entries, {count} expected", lens.len()),
            ));
        }
        let r = region.get();
        let list: Vec<Transfer<'_>> = (0..count)
            .map(|i| Transfer {
                op,
                local: r.region(),
                local_offset: local[i],
                remote: &descriptor.descriptor,
                remote_offset: remote[i],
                len: uniform.unwrap_or_else(|| lens[i]),
            })
            .collect();
        self.submit_list(
            py,
            &list,
            timeout,
            after.as_deref(),
            vec![region.clone_ref(py)],
        )
    }

    /// Sends a control message to the peer.
    fn send(&self, py: Python<'_>, message: &[u8]) -> PyResult<Batch> {
        let batch = py
            .detach(|| self.peer.send(message))
            .map_err(|e| raise_error(py, &e))?;
        Ok(Batch::new(batch, Vec::new()))
    }

    /// Waits up to `timeout` seconds for the peer's next control message.
    fn recv<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyBytes>> {
        let timeout = seconds(timeout, "timeout")?;
        let message = py
            .detach(|| self.peer.recv(timeout))
            .map_err(|e| raise_error(py, &e))?;
        Ok(PyBytes::new(py, &message))
    }

    /// Closes the connection.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.peer.close())
            .map_err(|e| raise_error(py, &e))
    }
}

impl Peer {
    fn submit_list(
        &self,
        py: Python<'_>,
        list: &[Transfer<'_>],
        timeout: Option<f64>,
        after: Option<&Stream>,
        held: Vec<Py<Region>>,
    ) -> PyResult<Batch> {
        let timeout = timeout.map(|t| seconds(t, "timeout")).transpose()?;
        let batch = py
            .detach(|| match (after, timeout) {
                // Starts once the stream reaches this point: no thread
                // waits for it, and nothing else on the GPU is waited for.
                (Some(stream), timeout) => {
                    self.peer.submit_after_stream(&stream.stream, list, timeout)
                }
                (None, Some(t)) => self.peer.submit_with_timeout(list, t),
                (None, None) => self.peer.submit(list),
            })
            .map_err(|e| raise_error(py, &e))?;
        Ok(Batch::new(batch, held))
    }
}

/// A CUDA stream of one GPU: one the engine made, or another's borrowed.
#[pyclass(module = "gdr._gdr", frozen)]
struct Stream {
    stream: gdr_core::Stream,
}

#[pymethods]
impl Stream {
    /// Its handle (a `CUstream`; the simulation's own token on the sim).
    #[getter]
    fn handle(&self) -> u64 {
        self.stream.raw() as usize as u64
    }

    /// The GPU it runs on.
    #[getter]
    fn gpu(&self) -> u32 {
        self.stream.gpu()
    }

    /// Queues a copy of `length` bytes from `src` at `src_offset` to `dst`
    /// at `dst_offset` (host and this GPU's memory, both of this engine's
    /// context); both regions' memory is held until the stream is seen
    /// past it.
    fn copy(
        &self,
        py: Python<'_>,
        dst: PyRef<'_, Region>,
        dst_offset: u64,
        src: PyRef<'_, Region>,
        src_offset: u64,
        length: usize,
    ) -> PyResult<()> {
        let (dst, src) = (dst.buffer(py)?, src.buffer(py)?);
        py.detach(|| self.stream.copy(&dst, dst_offset, &src, src_offset, length))
            .map_err(|e| raise_error(py, &e))
    }

    /// Waits for the work queued so far (the GIL released).
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.stream.synchronize())
            .map_err(|e| raise_error(py, &e))
    }
}

/// A submitted batch: ends exactly once. Holds its regions (and their
/// objects) until it has ended and is gone.
#[pyclass(module = "gdr._gdr", frozen)]
struct Batch {
    batch: gdr_core::Batch,
    /// The regions it moves: released when the batch object goes, after
    /// it has ended (a pending batch dropped is waited for first, without
    /// the GIL).
    regions: Mutex<Vec<Py<Region>>>,
}

impl Batch {
    fn new(batch: gdr_core::Batch, regions: Vec<Py<Region>>) -> Self {
        Self {
            batch,
            regions: Mutex::new(regions),
        }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if self.batch.status().is_none() {
            // Its memory may still be written: the objects that own it stay
            // until the batch ends (at the latest at its deadline).
            let batch = &self.batch;
            Python::attach(|py| {
                py.detach(|| {
                    while batch.status().is_none() {
                        let _ = batch.wait(Duration::from_secs(1));
                    }
                })
            });
        }
    }
}

#[pymethods]
impl Batch {
    /// Waits up to `timeout` seconds (None: until it ends); raises what it
    /// ended with, or `Timeout` if it has not ended (it goes on).
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let outcome = match timeout {
            Some(t) => {
                let t = seconds(t, "timeout")?;
                py.detach(|| self.batch.wait(t))
            }
            None => py.detach(|| {
                loop {
                    match self.batch.wait(Duration::from_secs(3600)) {
                        Err(TransferError::Timeout(_)) if self.batch.status().is_none() => continue,
                        outcome => break outcome,
                    }
                }
            }),
        };
        let outcome = match outcome {
            // The wait's bound, not the batch's own timeout: it goes on.
            Err(TransferError::Timeout(t)) if self.batch.status().is_none() => {
                return Err(raise(
                    py,
                    "Timeout",
                    format!(
                        "the batch is still running after {:?} (wait again, or cancel it)",
                        t.after
                    ),
                ));
            }
            outcome => outcome,
        };
        outcome.map_err(|e| raise_outcome(py, &e))?;
        self.release_regions(py);
        Ok(())
    }

    /// Whether it has ended (driving the engine once: the GIL released).
    fn done(&self, py: Python<'_>) -> bool {
        py.detach(|| self.batch.status()).is_some()
    }

    /// None while running; after it ended, None on success or raises what
    /// it ended with.
    fn result(&self, py: Python<'_>) -> PyResult<Option<bool>> {
        match py.detach(|| self.batch.status()) {
            None => Ok(None),
            Some(Ok(())) => {
                self.release_regions(py);
                Ok(Some(true))
            }
            Some(Err(e)) => Err(raise_outcome(py, &e)),
        }
    }

    /// Cancels it: it ends with `Cancelled` unless it ended first.
    fn cancel(&self, py: Python<'_>) {
        py.detach(|| self.batch.cancel());
    }

    /// Asks `notifier` to be told (token `token`) when the batch ends;
    /// True if it has ended already (nothing is told then).
    fn notify(&self, py: Python<'_>, notifier: &Notifier, token: u64) -> bool {
        let waker = Waker::from(Arc::new(Wakeup {
            shared: Arc::clone(&notifier.shared),
            token,
        }));
        py.detach(|| {
            let mut cx = TaskContext::from_waker(&waker);
            matches!(self.batch.poll_ended(&mut cx), Poll::Ready(_))
        })
    }
}

impl Batch {
    /// Lets go of the regions once the batch has ended; `_py`: with the
    /// GIL held (a region's drop releases it while its buffer lets go).
    fn release_regions(&self, _py: Python<'_>) {
        drop(std::mem::take(
            &mut *self.regions.lock().unwrap_or_else(PoisonError::into_inner),
        ));
    }
}

/// Tells an asyncio loop which batches ended: one eventfd the loop
/// watches (`loop.add_reader`) and the tokens of the batches that ended,
/// set by the engine's threads without the GIL. No thread per batch.
#[pyclass(module = "gdr._gdr", frozen)]
struct Notifier {
    shared: Arc<NotifierShared>,
}

struct NotifierShared {
    fd: OwnedFd,
    ended: Mutex<VecDeque<u64>>,
}

/// A batch's waker: its token queued, the eventfd bumped.
struct Wakeup {
    shared: Arc<NotifierShared>,
    token: u64,
}

impl Wake for Wakeup {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.shared
            .ended
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(self.token);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd this
        // notifier owns (open while `shared` lives). A full counter
        // (EAGAIN) still leaves the fd readable, which is all the loop needs.
        let _ = unsafe {
            libc::write(
                self.shared.fd.as_raw_fd(),
                (&raw const one).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

#[pymethods]
impl Notifier {
    #[new]
    fn new(py: Python<'_>) -> PyResult<Self> {
        // SAFETY: eventfd takes no pointer; the fd returned is owned here.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(raise(
                py,
                "DeviceError",
                format!("eventfd: {}", std::io::Error::last_os_error()),
            ));
        }
        Ok(Self {
            shared: Arc::new(NotifierShared {
                // SAFETY: `fd` is a new, valid descriptor nothing else owns.
                fd: unsafe { OwnedFd::from_raw_fd(fd) },
                ended: Mutex::new(VecDeque::new()),
            }),
        })
    }

    /// The fd to watch for reading.
    fn fileno(&self) -> i32 {
        self.shared.fd.as_raw_fd()
    }

    /// Clears the fd and returns the tokens of the batches that ended
    /// since the last call.
    fn drain(&self) -> Vec<u64> {
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from the notifier's own
        // non-blocking eventfd (EAGAIN when nothing is pending: ignored).
        let _ = unsafe {
            libc::read(
                self.shared.fd.as_raw_fd(),
                (&raw mut count).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        self.shared
            .ended
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
            .collect()
    }
}

#[pymodule]
fn _gdr(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add_class::<Region>()?;
    m.add_class::<Listener>()?;
    m.add_class::<Peer>()?;
    m.add_class::<Grant>()?;
    m.add_class::<Descriptor>()?;
    m.add_class::<Batch>()?;
    m.add_class::<Stream>()?;
    m.add_class::<Notifier>()?;
    Ok(())
}
