//! The registration ladder: for each buffer and NIC, the first rung that
//! works, with the reason every higher rung did not.
//!
//! 1. host memory (pageable or pinned): `ibv_reg_mr`;
//! 2. GPU memory, dma-buf: the allocation is exported once
//!    (`cuMemGetHandleForAddressRange` on its base and size) and the fd is
//!    shared by every NIC ([`DmabufExports`]); each range is registered with
//!    `ibv_reg_dmabuf_mr(offset, len, iova = its device address, fd)`;
//! 3. GPU memory, nvidia-peermem: `ibv_reg_mr` on the device address;
//! 4. staging: no MR on GPU memory; transfers go through pinned bounce
//!    buffers.
//!
//! Whether a GPU rung works is probed once per (NIC, GPU) pair on a scratch
//! allocation, optionally proven by a loopback WRITE and READ
//! ([`LadderConfig::self_check`]). Only permanent answers are kept (the GPU
//! or the NIC does not support it, refuses it by design, the self-check saw
//! wrong data): later buffers skip such a rung at no cost, with the probe's
//! reason. Transient failures (out of memory or MRs, `EAGAIN`, memlock
//! limits, a timeout) are retried by a later registration after a back-off
//! that doubles with each failure. One thread probes a pair at a time; the
//! others wait for its verdict. Registrations go through the
//! [`RegistrationCache`], so a buffer registered again hits. A [`Policy`]
//! can forbid falling back (3FS's final design: "GDR or error").
//!
//! Registrations here are for local use: their MRs carry local rights only,
//! and may be wider than the range asked for (cached, merged). What a peer
//! may reach is a [`MrGrant`]: an MR of exactly the granted range and rights,
//! made from a registration. Every MR, cached or granted, and the probe's
//! and self-check's scratch MRs, counts against the NIC's [`DomainBudget`].
//! The memory rule they all follow is in the [`crate::cache`] module docs.

use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use hal_cuda::{Context as _, CudaError, DeviceAttributes, DeviceMemory as _, MemoryType};
use hal_verbs::{
    AccessFlags, Context as _, MemoryRegion as _, ProtectionDomain as _, VerbsError, WcStatus,
};

use crate::buffer::{Access, Forget, Target};
use crate::cache::{
    Bounds, BudgetExceeded, BudgetLimits, CacheConfig, CacheError, CacheHandle, DomainBudget,
    DomainId, Limits, OwnerId, Registrar, RegistrationCache, Request, Reservation,
};
pub use crate::descriptor::GrantRights;
use crate::descriptor::{MemoryLocation, Segment};
use crate::lifetime::{Leased, MemoryLease};
use crate::loopback::{Loopback, LoopbackError};

/// Size of the scratch allocation a GPU rung is probed on.
const PROBE_LEN: usize = 64 << 10;

/// One way of making memory reachable by the NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rung {
    /// Host memory, `ibv_reg_mr`.
    HostMemory,
    /// GPU memory exported as a dma-buf, `ibv_reg_dmabuf_mr`.
    Dmabuf,
    /// GPU memory pinned by nvidia-peermem, `ibv_reg_mr`.
    Peermem,
    /// No MR on the GPU memory: transfers are staged through pinned host
    /// buffers.
    Staging,
}

impl Rung {
    /// True for the rungs where the NIC reaches GPU memory directly.
    pub fn is_gpu_direct(self) -> bool {
        matches!(self, Self::Dmabuf | Self::Peermem)
    }
}

/// What the GPU (or its memory) lacks for a GPUDirect rung.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuLacks {
    /// No dma-buf export.
    #[error("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0")]
    DmaBuf,
    /// No GPUDirect RDMA (nvidia-peermem's rung).
    #[error("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED is 0")]
    GpuDirectRdma,
    /// A CUDA VMM chunk made without `gpuDirectRDMACapable`: the driver
    /// may export it, but whether a NIC can take it is unknown.
    #[error(
        "the CUDA VMM chunk at {base:#x} was created without gpuDirectRDMACapable \
         (IS_GPU_DIRECT_RDMA_CAPABLE is 0)"
    )]
    VmmChunkNotRdmaCapable {
        /// The chunk's address.
        base: u64,
    },
}

/// Why a rung was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The GPU reports it cannot (an attribute is 0).
    #[error("not supported by the GPU: {0}")]
    Gpu(GpuLacks),
    /// The CUDA driver refused (e.g. the dma-buf export).
    #[error("refused by the CUDA driver: {0}")]
    Driver(CudaError),
    /// The NIC or its kernel driver refused the registration.
    #[error("refused by the NIC: {0}")]
    Nic(VerbsError),
    /// Registration worked but a loopback WRITE and READ through it did not.
    #[error("registration works but the loopback self-check failed: {0}")]
    SelfCheck(LoopbackError),
    /// The caller's policy excludes the rung.
    #[error("excluded by the policy")]
    Policy,
    /// The NIC's budget of MRs or registered bytes is spent.
    #[error("{0}")]
    Budget(BudgetExceeded),
}

impl Refusal {
    /// Whether the refusal may go away by itself (out of memory or MRs,
    /// `EAGAIN`, memlock limits, a timeout), so a probe that met it is
    /// retried later instead of remembered.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Gpu(_) | Self::Policy => false,
            Self::Budget(_) => true,
            Self::Driver(e) => cuda_transient(e),
            Self::Nic(e) => verbs_transient(e),
            Self::SelfCheck(e) => match e {
                LoopbackError::Verbs(e) => verbs_transient(e),
                LoopbackError::Timeout { .. }
                | LoopbackError::Unquiesced { .. }
                | LoopbackError::Budget(_)
                | LoopbackError::PortNotActive { .. } => true,
                LoopbackError::Completion { status, .. } => matches!(
                    *status,
                    WcStatus::RETRY_EXC_ERR | WcStatus::RNR_RETRY_EXC_ERR | WcStatus::WR_FLUSH_ERR
                ),
                _ => false,
            },
        }
    }
}

fn verbs_transient(e: &VerbsError) -> bool {
    match e {
        VerbsError::OutOfResources { .. }
        | VerbsError::QueueFull { .. }
        | VerbsError::Timeout { .. } => true,
        // ENOMEM from ibv_reg_mr is usually RLIMIT_MEMLOCK or a full MTT.
        _ => matches!(
            e.errno(),
            Some(libc::ENOMEM | libc::EAGAIN | libc::EBUSY | libc::ENOBUFS | libc::EINTR)
        ),
    }
}

fn cuda_transient(e: &CudaError) -> bool {
    // Devices unavailable: another process holds an exclusive-mode GPU.
    matches!(
        e,
        CudaError::OutOfMemory { .. } | CudaError::DeviceUnavailable { .. }
    )
}

/// A rung above the one taken, and why it was not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RungFailure {
    /// The rung.
    pub rung: Rung,
    /// Why not.
    pub refusal: Refusal,
    /// True when the reason is the (NIC, GPU) pair's probed verdict rather
    /// than an attempt on this buffer.
    pub from_probe: bool,
}

impl fmt::Display for RungFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let probed = match (self.from_probe, self.refusal.is_transient()) {
            (true, true) => " (probed; transient, retried later)",
            (true, false) => " (probed)",
            (false, _) => "",
        };
        write!(f, "{:?}{probed}: {}", self.rung, self.refusal)
    }
}

/// Which rungs a caller accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Every rung, down to staging.
    #[default]
    Fallback,
    /// dma-buf or peermem, or an error: never stage GPU memory.
    RequireGpuDirect,
    /// This rung for GPU memory, or an error.
    Only(Rung),
}

impl Policy {
    fn allows(self, rung: Rung) -> bool {
        match self {
            Self::Fallback => true,
            Self::RequireGpuDirect => rung.is_gpu_direct(),
            Self::Only(only) => rung == only,
        }
    }
}

/// How a ladder behaves.
///
/// Made from [`LadderConfig::default`] and the `with_` setters (one per field);
/// `#[non_exhaustive]`, so a field can be added without breaking callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LadderConfig {
    /// Which rungs GPU memory may take.
    pub policy: Policy,
    /// Prove each GPU rung with a loopback WRITE and READ when probing it.
    pub self_check: bool,
    /// The NIC port the self-check's queue pairs use.
    pub port: u8,
    /// The domain's hard budget of MRs and registered bytes; `None`: the
    /// NIC's `max_mr`, bytes unbounded.
    pub budget: Option<BudgetLimits>,
    /// How long a rung whose probe failed transiently is skipped before
    /// the next registration probes it again; doubled at each further
    /// failure, up to [`LadderConfig::max_probe_backoff`].
    pub probe_backoff: Duration,
    /// The longest back-off.
    pub max_probe_backoff: Duration,
}

impl Default for LadderConfig {
    fn default() -> Self {
        Self {
            policy: Policy::Fallback,
            self_check: true,
            port: 1,
            budget: None,
            probe_backoff: Duration::from_millis(100),
            max_probe_backoff: Duration::from_secs(30),
        }
    }
}

impl LadderConfig {
    /// Sets [`LadderConfig::policy`].
    #[must_use]
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets [`LadderConfig::self_check`].
    #[must_use]
    pub fn with_self_check(mut self, self_check: bool) -> Self {
        self.self_check = self_check;
        self
    }

    /// Sets [`LadderConfig::port`].
    #[must_use]
    pub fn with_port(mut self, port: u8) -> Self {
        self.port = port;
        self
    }

    /// Sets [`LadderConfig::budget`] (`Some`).
    #[must_use]
    pub fn with_budget(mut self, budget: BudgetLimits) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Sets [`LadderConfig::probe_backoff`].
    #[must_use]
    pub fn with_probe_backoff(mut self, probe_backoff: Duration) -> Self {
        self.probe_backoff = probe_backoff;
        self
    }

    /// Sets [`LadderConfig::max_probe_backoff`].
    #[must_use]
    pub fn with_max_probe_backoff(mut self, max_probe_backoff: Duration) -> Self {
        self.max_probe_backoff = max_probe_backoff;
        self
    }
}

/// Rights on a registration that local use needs (the local side of READs
/// writes it). No remote rights: those come with a [`MrGrant`]. Read-only
/// memory gets none at all: the NIC may only read it.
fn local_access(access: Access) -> AccessFlags {
    match access {
        Access::ReadWrite => AccessFlags::LOCAL_WRITE,
        Access::ReadOnly => AccessFlags::empty(),
    }
}

/// Why a buffer could not be registered at all.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LadderError {
    /// Setting up the ladder on the NIC failed.
    #[error("setting up the registration ladder on {device}: {source}")]
    Setup {
        /// The NIC.
        device: String,
        /// Why.
        #[source]
        source: LoopbackError,
    },
    /// The memory's attributes could not be read.
    #[error("reading the pointer attributes of {addr:#x}: {source}")]
    Attributes {
        /// The address.
        addr: u64,
        /// Why.
        #[source]
        source: CudaError,
    },
    /// Managed memory may migrate between host and GPU: it is never
    /// registered.
    #[error("{addr:#x} is CUDA managed memory, which gdr does not register")]
    ManagedMemory {
        /// The address.
        addr: u64,
    },
    /// The range runs past the allocation holding its start.
    #[error("{len} bytes at {addr:#x} run past the allocation at {base:#x} ({size} bytes)")]
    OutsideAllocation {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
        /// The allocation's base.
        base: u64,
        /// The allocation's size.
        size: u64,
    },
    /// GPU memory of a GPU this ladder was not given.
    #[error("GPU {ordinal} is not one of this ladder's GPUs")]
    UnknownGpu {
        /// Its ordinal.
        ordinal: u32,
    },
    /// Host memory could not be registered.
    #[error("registering host memory on {device}: {source}")]
    Host {
        /// The NIC.
        device: String,
        /// Why.
        #[source]
        source: CacheError<RegisterError>,
    },
    /// A staged registration has no MR to grant.
    #[error("{len} bytes at {addr:#x} are staged, not registered: nothing to grant")]
    NotGrantable {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// Registering a grant failed.
    #[error("granting {len} bytes at {addr:#x} on {device}: {source}")]
    Grant {
        /// The NIC.
        device: String,
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
        /// Why.
        #[source]
        source: RegisterError,
    },
    /// The range covers several physical chunks of CUDA VMM memory, and
    /// one registration covers one chunk: register it through the engine
    /// (a region of one registration per chunk), or chunk by chunk.
    #[error(
        "{len} bytes at {addr:#x} cover {chunks} physical chunks of CUDA VMM memory; \
         one registration covers one chunk"
    )]
    SpansChunks {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
        /// Chunks covered.
        chunks: usize,
    },
    /// A grant with write rights of read-only memory
    /// ([`Access::ReadOnly`]): refused, never downgraded.
    #[error("{len} bytes at {addr:#x} are read-only memory: no grant with {rights:?} rights")]
    ReadOnly {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
        /// The rights asked for.
        rights: GrantRights,
    },
    /// The policy forbids every rung that would work.
    #[error("no rung the policy {policy:?} allows works: {}", list(failures))]
    NoAllowedRung {
        /// The policy.
        policy: Policy,
        /// Every rung tried or skipped, and why.
        failures: Vec<RungFailure>,
    },
}

/// The address of `len` bytes at `offset` of the `size` bytes at `base`, or
/// [`LadderError::OutsideAllocation`] when they do not fit (or are none).
/// An address below `base` is an `offset` that wrapped, and fails the same
/// way.
pub(crate) fn range_within(
    base: u64,
    size: u64,
    offset: u64,
    len: u64,
) -> Result<u64, LadderError> {
    if len == 0 || offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(LadderError::OutsideAllocation {
            addr: base.wrapping_add(offset),
            len,
            base,
            size,
        });
    }
    Ok(base + offset)
}

fn list(failures: &[RungFailure]) -> String {
    failures
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Why registering an MR failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// The NIC refused.
    #[error(transparent)]
    Nic(#[from] VerbsError),
    /// The domain's budget is spent (nothing was asked of the NIC).
    #[error(transparent)]
    Budget(#[from] BudgetExceeded),
}

impl From<RegisterError> for Refusal {
    fn from(e: RegisterError) -> Self {
        match e {
            RegisterError::Nic(e) => Self::Nic(e),
            RegisterError::Budget(e) => Self::Budget(e),
        }
    }
}

/// One allocation exported as a dma-buf. The fd closes when the last
/// registration made from it (or the last caller holding it) lets go.
#[derive(Debug)]
pub struct DmabufExport {
    fd: OwnedFd,
    base: u64,
    len: u64,
    buffer_id: u64,
}

impl DmabufExport {
    /// The allocation's base device address (byte 0 of the dma-buf).
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Bytes exported.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty export (never made).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The exported allocation's CUDA buffer id.
    pub fn buffer_id(&self) -> u64 {
        self.buffer_id
    }
}

/// The dma-buf exports of a process, one per allocation (by CUDA buffer id),
/// shared by every NIC's ladder and every buffer over the allocation: each
/// export holds BAR1 resources, so a second NIC reuses the fd rather than
/// exporting again. The map holds exports weakly: an export lives exactly as
/// long as a registration made from it (or a caller) holds it, so a failed
/// registration leaves nothing open, and dropping one buffer never closes an
/// export other buffers' registrations use.
#[derive(Debug, Default)]
pub struct DmabufExports {
    by_buffer: Mutex<HashMap<u64, Weak<DmabufExport>>>,
}

impl DmabufExports {
    /// No exports yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The export of allocation `buffer_id` (`base`, `size` bytes), made
    /// now unless one is alive.
    pub fn get_or_export(
        &self,
        context: &hal_cuda::dynamic::DynContext,
        buffer_id: u64,
        base: u64,
        size: u64,
    ) -> Result<Arc<DmabufExport>, CudaError> {
        if let Some(export) = self.get(buffer_id) {
            return Ok(export);
        }
        // Exported outside the lock: a racing second export of the same
        // allocation is dropped below, which only costs a duplicate fd.
        let len = size.next_multiple_of(HOST_PAGE);
        let fd = context.export_dmabuf(base, len as usize)?;
        let export = Arc::new(DmabufExport {
            fd,
            base,
            len,
            buffer_id,
        });
        tracing::debug!(
            buffer_id,
            base = format_args!("{base:#x}"),
            len,
            "exported allocation as dma-buf"
        );
        let mut map = lock(&self.by_buffer);
        map.retain(|_, weak| weak.strong_count() > 0);
        if let Some(raced) = map.get(&buffer_id).and_then(Weak::upgrade) {
            return Ok(raced);
        }
        map.insert(buffer_id, Arc::downgrade(&export));
        Ok(export)
    }

    /// The live export of allocation `buffer_id`, if any.
    pub fn get(&self, buffer_id: u64) -> Option<Arc<DmabufExport>> {
        lock(&self.by_buffer)
            .get(&buffer_id)
            .and_then(Weak::upgrade)
    }

    /// How many exports are open.
    pub fn live(&self) -> usize {
        lock(&self.by_buffer)
            .values()
            .filter(|w| w.strong_count() > 0)
            .count()
    }
}

/// CUDA's dma-buf export wants host-page alignment; gdr's platforms have
/// 4 KiB base pages (larger pages are multiples of it).
const HOST_PAGE: u64 = 4096;

/// What the cache keeps: an MR, and what must outlive it.
pub struct NicRegistration {
    // Field order is drop order: the MR is deregistered first, then the
    // dma-buf may close, the budget gets its share back, and the memory
    // may be freed.
    mr: hal_verbs::dynamic::DynMemoryRegion,
    export: Option<Arc<DmabufExport>>,
    _reservation: Reservation,
    lease: Option<MemoryLease>,
}

impl fmt::Debug for NicRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NicRegistration")
            .field("mr", &self.mr)
            .field("dmabuf", &self.export.as_ref().map(|e| e.fd.as_raw_fd()))
            .field("leased", &self.lease.is_some())
            .finish()
    }
}

impl NicRegistration {
    /// The memory region.
    pub fn mr(&self) -> &hal_verbs::dynamic::DynMemoryRegion {
        &self.mr
    }
}

/// Registers cache requests in one protection domain, within its budget.
pub struct NicRegistrar {
    pd: Arc<hal_verbs::dynamic::DynProtectionDomain>,
    exports: Arc<DmabufExports>,
    budget: Arc<DomainBudget>,
}

impl fmt::Debug for NicRegistrar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NicRegistrar")
            .field("pd", &self.pd)
            .field("budget", &self.budget)
            .finish()
    }
}

impl NicRegistrar {
    /// A registrar for `pd`, counting its MRs against `budget`. Its MRs get
    /// local rights only.
    ///
    /// # Safety
    /// This registrar registers raw ranges, with nothing keeping their
    /// memory alive: the caller upholds the rule of the [`crate::cache`]
    /// module docs for every range registered through it (the memory stays
    /// mapped until every registration over it is dropped, cache entries
    /// and escaped handles included). A [`Ladder`] upholds it for
    /// [`crate::buffer::Buffer`]s by holding a lease in each registration.
    pub unsafe fn new(
        pd: Arc<hal_verbs::dynamic::DynProtectionDomain>,
        exports: Arc<DmabufExports>,
        budget: Arc<DomainBudget>,
    ) -> Self {
        Self {
            pd,
            exports,
            budget,
        }
    }

    /// The budget its MRs count against.
    pub fn budget(&self) -> &Arc<DomainBudget> {
        &self.budget
    }

    /// Registers `len` bytes at address `addr` with `access`, through
    /// `export` (the dma-buf of the allocation holding them, whose byte 0 is
    /// `export.base`) when given, after reserving the MR in the budget.
    ///
    /// # Safety
    /// The memory stays mapped until the region is dropped.
    unsafe fn register_range(
        &self,
        export: Option<&DmabufExport>,
        addr: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<(hal_verbs::dynamic::DynMemoryRegion, Reservation), RegisterError> {
        let size = usize::try_from(len)
            .map_err(|_| VerbsError::invalid("ibv_reg_mr", "length exceeds usize"))?;
        let reservation = self.budget.reserve(len)?;
        let mr = match export {
            // SAFETY: the fd is open (the export owns it); the memory
            // outlives the region by this function's contract.
            Some(export) => unsafe {
                self.pd.register_dmabuf(
                    export.fd.as_raw_fd(),
                    addr - export.base,
                    size,
                    addr,
                    access,
                )
            },
            // SAFETY: as above.
            None => unsafe { self.pd.register(addr, size, access) },
        }?;
        Ok((mr, reservation))
    }

    /// Registers `request` with `export` (for a dma-buf request) and keeps
    /// `lease` in the registration.
    ///
    /// # Safety
    /// The memory of the request stays mapped until the registration drops
    /// (guaranteed when `lease` covers it).
    unsafe fn register_with(
        &self,
        request: &Request,
        export: Option<Arc<DmabufExport>>,
        lease: Option<MemoryLease>,
    ) -> Result<NicRegistration, RegisterError> {
        let (mr, reservation) = match (request.identity, &export) {
            (crate::cache::AllocationIdentity::Dmabuf { buffer_id }, Some(export)) => {
                if export.buffer_id != buffer_id || request.end().is_none_or(|end| end > export.len)
                {
                    return Err(VerbsError::invalid(
                        "ibv_reg_dmabuf_mr",
                        format!(
                            "offsets {:#x}+{:#x} are not inside the export of allocation {}",
                            request.start, request.len, export.buffer_id
                        ),
                    )
                    .into());
                }
                // SAFETY: the memory outlives the region by this function's
                // contract.
                unsafe {
                    self.register_range(
                        Some(export),
                        export.base + request.start,
                        request.len,
                        local_access(request.access),
                    )
                }?
            }
            (crate::cache::AllocationIdentity::Dmabuf { buffer_id }, None) => {
                return Err(VerbsError::invalid(
                    "ibv_reg_dmabuf_mr",
                    format!("allocation {buffer_id} has no dma-buf export"),
                )
                .into());
            }
            // SAFETY: as above.
            _ => unsafe {
                self.register_range(
                    None,
                    request.start,
                    request.len,
                    local_access(request.access),
                )
            }?,
        };
        Ok(NicRegistration {
            mr,
            export,
            _reservation: reservation,
            lease,
        })
    }
}

impl Registrar for NicRegistrar {
    type Registration = NicRegistration;
    type Error = RegisterError;

    fn register(&self, request: &Request) -> Result<Self::Registration, Self::Error> {
        let export = match request.identity {
            crate::cache::AllocationIdentity::Dmabuf { buffer_id } => self.exports.get(buffer_id),
            _ => None,
        };
        // SAFETY: `NicRegistrar::new`'s contract covers every raw range.
        unsafe { self.register_with(request, export, None) }
    }
}

/// The registrar of one buffer's request: the NIC's, plus the lease that
/// keeps the buffer's memory alive and the allocation's dma-buf export.
struct BufferRegistrar<'a> {
    nic: &'a NicRegistrar,
    memory: &'a Arc<dyn Leased>,
    export: Option<&'a Arc<DmabufExport>>,
    /// Set when this registrar registered an MR: the cache missed, and this
    /// request's call registered (rather than found or waited for) it.
    registered: AtomicBool,
}

impl<'a> BufferRegistrar<'a> {
    fn new(
        nic: &'a NicRegistrar,
        memory: &'a Arc<dyn Leased>,
        export: Option<&'a Arc<DmabufExport>>,
    ) -> Self {
        Self {
            nic,
            memory,
            export,
            registered: AtomicBool::new(false),
        }
    }
}

impl Registrar for BufferRegistrar<'_> {
    type Registration = NicRegistration;
    type Error = RegisterError;

    fn register(&self, request: &Request) -> Result<Self::Registration, Self::Error> {
        let lease = MemoryLease::new(self.memory);
        // SAFETY: the lease keeps the buffer's memory mapped until the
        // registration (which holds it after the MR) is dropped; the cache
        // never widens a request past the buffer's bounds.
        let registration = unsafe {
            self.nic
                .register_with(request, self.export.map(Arc::clone), Some(lease))
        }?;
        // Relaxed: read by the thread that called the cache, after the call.
        self.registered.store(true, Ordering::Relaxed);
        Ok(registration)
    }
}

/// A GPU the ladder can register memory of.
pub struct Gpu {
    /// Its context.
    pub context: hal_cuda::dynamic::DynContext,
    /// Its attributes.
    pub attributes: DeviceAttributes,
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.attributes.ordinal)
            .field("name", &self.attributes.name)
            .finish()
    }
}

impl Gpu {
    /// GPU `ordinal` of `driver`.
    pub fn open(driver: &hal_cuda::dynamic::DynDriver, ordinal: u32) -> Result<Self, CudaError> {
        use hal_cuda::Driver as _;
        Ok(Self {
            context: driver.context(ordinal)?,
            attributes: driver.device_attributes(ordinal)?,
        })
    }
}

/// A buffer range registered on one NIC for local use: the rung taken, why
/// each higher one was not, (except for staging) the cached MR, which may
/// cover more than the range and carries local rights only, and a lease on
/// the buffer's memory on every rung: whatever reaches the memory through
/// a registration (a NIC through its MR, the staging path through copies
/// by address) holds it, so no path can outlive the memory.
pub struct LadderRegistration {
    rung: Rung,
    failures: Vec<RungFailure>,
    addr: u64,
    len: u64,
    location: MemoryLocation,
    access: Access,
    device: Arc<str>,
    // Field order is drop order: the cached MR before the lease.
    handle: Option<CacheHandle<NicRegistration>>,
    cache_hit: bool,
    /// The staging rung makes no MR, so without this nothing would hold
    /// the memory its copies reach by address.
    _lease: MemoryLease,
}

impl fmt::Debug for LadderRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LadderRegistration")
            .field("rung", &self.rung)
            .field("failures", &self.failures)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("access", &self.access)
            .field("device", &self.device)
            .field("cache_hit", &self.cache_hit)
            .finish()
    }
}

impl LadderRegistration {
    /// The rung taken.
    pub fn rung(&self) -> Rung {
        self.rung
    }

    /// Each rung above it, and why it was not taken.
    pub fn failures(&self) -> &[RungFailure] {
        &self.failures
    }

    /// First address of the range registered.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never true: empty ranges are refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The MR covering the range (a cached one may cover more), for the
    /// local side of transfers; `None` when staged. Its rkey grants
    /// nothing: peers get a [`MrGrant`].
    pub fn mr(&self) -> Option<&hal_verbs::dynamic::DynMemoryRegion> {
        self.handle.as_ref().map(|h| h.registration().mr())
    }

    /// Whether the registration came from the cache without registering
    /// anything: a cached entry covered the range, or another thread's
    /// registration in flight did. False when this call registered an MR,
    /// and for staging (nothing is registered or cached).
    pub fn cache_hit(&self) -> bool {
        self.cache_hit
    }

    /// The NIC it is registered on.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Host or GPU memory.
    pub fn location(&self) -> MemoryLocation {
        self.location
    }

    /// What the registration may do to the memory: read-only memory's has
    /// no write access, and grants of it are read-only.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The cache handle, for comparing registrations.
    pub fn handle(&self) -> Option<&CacheHandle<NicRegistration>> {
        self.handle.as_ref()
    }

    /// Whether the CPU can read the range through its address: host memory
    /// only. A send may be posted with `IBV_SEND_INLINE` (the provider
    /// copies the bytes with the CPU) only from such a range; for GPU
    /// memory the address is a device address, or an iova for dma-buf.
    pub fn cpu_readable(&self) -> bool {
        self.location == MemoryLocation::Host
    }
}

/// A range granted to a peer: an MR of exactly that range and those rights,
/// never cached or shared, deregistered when the grant is dropped (revoked).
/// It keeps the buffer's memory alive like any registration.
pub struct MrGrant {
    // Field order is drop order: MR, then the dma-buf, the budget, the memory.
    mr: hal_verbs::dynamic::DynMemoryRegion,
    _export: Option<Arc<DmabufExport>>,
    _reservation: Reservation,
    _lease: MemoryLease,
    addr: u64,
    len: u64,
    rights: GrantRights,
    device: Arc<str>,
    location: MemoryLocation,
}

impl fmt::Debug for MrGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MrGrant")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("rights", &self.rights)
            .field("rkey", &self.mr.rkey())
            .field("device", &self.device)
            .finish()
    }
}

impl MrGrant {
    /// The grant's one segment, placed at `offset` within the granted
    /// range of the descriptor it goes in (usually 0): exactly the granted
    /// range, its rkey and the NIC.
    pub fn segment(&self, offset: u64) -> Segment {
        Segment {
            offset,
            len: self.len,
            addr: self.addr,
            rkey: self.mr.rkey(),
            device: self.device.to_string(),
        }
    }

    /// First address of the granted range (the iova the NIC knows).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Bytes granted.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never true: empty grants are refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host or GPU memory.
    pub fn location(&self) -> MemoryLocation {
        self.location
    }

    /// The NIC the grant's MR is registered on.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// The rights granted.
    pub fn rights(&self) -> GrantRights {
        self.rights
    }

    /// The grant's MR.
    pub fn mr(&self) -> &hal_verbs::dynamic::DynMemoryRegion {
        &self.mr
    }

    /// Revokes the grant: deregisters its MR now.
    pub fn revoke(self) {}
}

type Verdict = Result<(), Refusal>;

/// Where probing a (GPU, rung) pair stands.
#[derive(Debug, Clone)]
enum ProbeSlot {
    /// A thread is probing; others wait for it.
    Probing,
    /// A permanent verdict.
    Known(Verdict),
    /// The last probe failed transiently: skip until `retry_at`.
    BackingOff {
        refusal: Refusal,
        retry_at: Instant,
        failures: u32,
    },
}

/// Clears a probe slot whose prober unwound, so waiters probe again rather
/// than wait forever.
struct ProbeGuard<'a> {
    slots: &'a Mutex<HashMap<(u32, Rung), ProbeSlot>>,
    done: &'a Condvar,
    key: (u32, Rung),
    armed: bool,
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            lock(self.slots).remove(&self.key);
            self.done.notify_all();
        }
    }
}

static NEXT_DOMAIN: AtomicU64 = AtomicU64::new(1);

/// The registration ladder of one NIC, over the GPUs it was given.
pub struct Ladder {
    // Shared with every registration: a hit must not allocate.
    device: Arc<str>,
    domain: DomainId,
    config: LadderConfig,
    // Declared before the PD's other owners so self-check QPs go first.
    loopback: Option<Loopback<crate::Verbs>>,
    registrar: NicRegistrar,
    cache: Arc<RegistrationCache<NicRegistrar>>,
    exports: Arc<DmabufExports>,
    gpus: Vec<Gpu>,
    probes: Mutex<HashMap<(u32, Rung), ProbeSlot>>,
    probe_done: Condvar,
    forget: Arc<dyn Forget>,
}

/// What a buffer calls on drop to remove its registrations.
struct LadderForget {
    cache: Arc<RegistrationCache<NicRegistrar>>,
    domain: DomainId,
}

impl Forget for LadderForget {
    fn forget(&self, owner: OwnerId) {
        let dropped = self.cache.invalidate_owner_in(self.domain, owner);
        tracing::debug!(owner, dropped, "buffer gone: registrations unlinked");
    }
}

impl fmt::Debug for Ladder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ladder")
            .field("device", &self.device)
            .field("domain", &self.domain)
            .field("config", &self.config)
            .field("gpus", &self.gpus)
            .field("probes", &*lock(&self.probes))
            .field("budget", &self.registrar.budget)
            .finish()
    }
}

impl Ladder {
    /// A ladder of its own on NIC `context` for `gpus` (a private cache and
    /// dma-buf exports, the default configuration): to ask what the NIC can
    /// do with those GPUs' memory ([`Ladder::probe_all`]) outside any
    /// engine, as `gdr info` and the C ABI's `gdr_path_rung` do.
    pub fn standalone(
        context: &hal_verbs::dynamic::DynContext,
        gpus: Vec<Gpu>,
    ) -> Result<Self, LadderError> {
        Self::new(
            context,
            gpus,
            Arc::new(RegistrationCache::new(CacheConfig::default())),
            Arc::new(DmabufExports::new()),
            LadderConfig::default(),
        )
    }

    /// A ladder on NIC `context` (a PD of its own), for memory of `gpus`,
    /// registering through `cache` (shared by every NIC's ladder) and
    /// exporting dma-bufs through `exports` (shared likewise). Every MR of
    /// the PD counts against one budget ([`LadderConfig::budget`], by
    /// default the NIC's `max_mr`); the cache evicts this domain's unused
    /// entries a little before it is spent.
    ///
    /// Safe: the ladder registers only [`crate::buffer::Buffer`]s, whose
    /// registrations hold a lease on their memory (the rule of the
    /// [`crate::cache`] module docs, which [`NicRegistrar::new`] leaves to
    /// its caller).
    pub fn new(
        context: &hal_verbs::dynamic::DynContext,
        gpus: Vec<Gpu>,
        cache: Arc<RegistrationCache<NicRegistrar>>,
        exports: Arc<DmabufExports>,
        config: LadderConfig,
    ) -> Result<Self, LadderError> {
        let device = context.name();
        let setup = |source: LoopbackError| LadderError::Setup {
            device: device.clone(),
            source,
        };
        let pd = Arc::new(context.alloc_pd().map_err(|e| setup(e.into()))?);
        let attrs = context.query_device().map_err(|e| setup(e.into()))?;
        let limits = config.budget.unwrap_or(BudgetLimits {
            max_mrs: u64::from(attrs.max_mr).max(1),
            max_bytes: u64::MAX,
        });
        let budget = DomainBudget::new(limits);
        let domain = NEXT_DOMAIN.fetch_add(1, Ordering::Relaxed);
        // The cache's soft limits sit below the hard budget, leaving room
        // for grants, probes and the self-check.
        let soft = |hard: u64| (hard - hard / 8).max(1);
        cache.set_limits(
            domain,
            Limits {
                max_entries: soft(limits.max_mrs),
                max_bytes: soft(limits.max_bytes).min(cache.config().limits.max_bytes),
            },
        );
        let loopback = if config.self_check {
            Some(
                Loopback::with_pd(context, Arc::clone(&pd), config.port)
                    .map_err(setup)?
                    .with_budget(Arc::clone(&budget)),
            )
        } else {
            None
        };
        // SAFETY: the ladder registers only through `BufferRegistrar`s,
        // whose registrations lease their buffer's memory, and its own
        // scratch memory outlives the MRs over it (`probe_once`).
        let registrar = unsafe { NicRegistrar::new(pd, Arc::clone(&exports), budget) };
        let forget = Arc::new(LadderForget {
            cache: Arc::clone(&cache),
            domain,
        });
        Ok(Self {
            device: device.into(),
            domain,
            config,
            loopback,
            registrar,
            cache,
            exports,
            gpus,
            probes: Mutex::new(HashMap::new()),
            probe_done: Condvar::new(),
            forget,
        })
    }

    /// The NIC's name.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// The cache domain of this NIC's registrations.
    pub fn domain(&self) -> DomainId {
        self.domain
    }

    /// What a buffer registered here calls when it is dropped.
    pub(crate) fn forgetter(&self) -> &Arc<dyn Forget> {
        &self.forget
    }

    /// The protection domain of this NIC's registrations: queue pairs that
    /// serve them must be created in it.
    pub fn pd(&self) -> &Arc<hal_verbs::dynamic::DynProtectionDomain> {
        &self.registrar.pd
    }

    /// The hard budget every MR of the PD counts against.
    pub fn budget(&self) -> &Arc<DomainBudget> {
        &self.registrar.budget
    }

    /// The cache this ladder registers through.
    pub fn cache(&self) -> &Arc<RegistrationCache<NicRegistrar>> {
        &self.cache
    }

    /// The ladder's GPU of CUDA ordinal `ordinal`.
    pub fn gpu(&self, ordinal: u32) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.attributes.ordinal == ordinal)
    }

    /// Its GPUs.
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// The dma-buf exports this ladder shares.
    pub fn exports(&self) -> &Arc<DmabufExports> {
        &self.exports
    }

    /// Grants `len` bytes at `offset` of `registration` to a peer: a new MR
    /// of exactly that range with exactly `rights`, on the registration's
    /// rung (the same dma-buf for GPU memory), counted against the budget.
    pub fn grant(
        &self,
        registration: &LadderRegistration,
        offset: u64,
        len: u64,
        rights: GrantRights,
    ) -> Result<MrGrant, LadderError> {
        let addr = range_within(registration.addr, registration.len, offset, len)?;
        if rights.allows_write() && !registration.access.is_writable() {
            return Err(LadderError::ReadOnly { addr, len, rights });
        }
        let handle = registration
            .handle
            .as_ref()
            .ok_or(LadderError::NotGrantable { addr, len })?;
        let cached = handle.registration();
        let lease = cached
            .lease
            .clone()
            .ok_or(LadderError::NotGrantable { addr, len })?;
        let failed = |source: RegisterError| LadderError::Grant {
            device: self.device.to_string(),
            addr,
            len,
            source,
        };
        // SAFETY: `lease` keeps the memory mapped until after the MR (field
        // order of `Grant`).
        let (mr, reservation) = unsafe {
            self.registrar
                .register_range(cached.export.as_deref(), addr, len, rights.access())
        }
        .map_err(failed)?;
        tracing::debug!(
            device = %self.device,
            addr = format_args!("{addr:#x}"),
            len,
            ?rights,
            rkey = mr.rkey(),
            "granted"
        );
        Ok(MrGrant {
            mr,
            _export: cached.export.clone(),
            _reservation: reservation,
            _lease: lease,
            addr,
            len,
            rights,
            device: Arc::clone(&self.device),
            location: registration.location,
        })
    }

    /// Proves a registration made here with a loopback WRITE and READ of its
    /// first `len` bytes (overwriting them), through a short-lived grant of
    /// that range. Needs [`LadderConfig::self_check`]; a staged
    /// registration has nothing to prove.
    pub fn prove(&self, registration: &LadderRegistration, len: u64) -> Result<(), LoopbackError> {
        let not_possible =
            |why: String| LoopbackError::Verbs(VerbsError::invalid("Ladder::prove", why));
        let loopback = self
            .loopback
            .as_ref()
            .ok_or_else(|| not_possible("the ladder was built without self_check".into()))?;
        let grant = self
            .grant(
                registration,
                0,
                len.min(registration.len),
                GrantRights::ReadWrite,
            )
            .map_err(|e| not_possible(e.to_string()))?;
        let len = usize::try_from(grant.len).map_err(|_| not_possible("too long".into()))?;
        let result = loopback.prove(&grant.mr, 0, len);
        if matches!(result, Err(LoopbackError::Unquiesced { .. })) {
            // The NIC may still write through the grant: keep it (and the
            // memory it leases) for the life of the process.
            std::mem::forget(grant);
        }
        result
    }

    /// Probes every GPU rung for every GPU of the ladder (those without a
    /// verdict yet) and returns the verdicts: what this NIC can do with each
    /// GPU's memory, whatever the policy.
    pub fn probe_all(&self) -> Vec<(u32, Rung, Result<(), Refusal>)> {
        self.gpus
            .iter()
            .flat_map(|gpu| {
                [Rung::Dmabuf, Rung::Peermem]
                    .map(|rung| (gpu.attributes.ordinal, rung, self.probe(gpu, rung)))
            })
            .collect()
    }

    /// The verdict of probing `rung` for GPU `ordinal`: a permanent one, or
    /// the transient refusal being backed off from; `None` when not probed
    /// (or being probed).
    pub fn verdict(&self, ordinal: u32, rung: Rung) -> Option<Result<(), Refusal>> {
        match lock(&self.probes).get(&(ordinal, rung))? {
            ProbeSlot::Known(verdict) => Some(verdict.clone()),
            ProbeSlot::BackingOff { refusal, .. } => Some(Err(refusal.clone())),
            ProbeSlot::Probing => None,
        }
    }

    /// Registers the range `addr..addr + len` of `target` on the first rung
    /// that works.
    pub(crate) fn register_target(
        &self,
        target: &Target<'_>,
        addr: u64,
        len: u64,
    ) -> Result<LadderRegistration, LadderError> {
        // Debug, not info: this runs on every registration, cache hits
        // included; probe verdicts are what info reports.
        let _span = tracing::debug_span!(
            "register",
            device = %self.device,
            addr = format_args!("{addr:#x}"),
            len
        )
        .entered();
        let registration = match target.memory_type {
            MemoryType::Managed => return Err(LadderError::ManagedMemory { addr }),
            MemoryType::PageableHost | MemoryType::PinnedHost => {
                let (kind, identity) = if target.memory_type == MemoryType::PinnedHost {
                    (
                        crate::cache::MemoryKind::PinnedHost,
                        crate::cache::AllocationIdentity::Cuda {
                            buffer_id: target.buffer_id,
                        },
                    )
                } else {
                    (
                        crate::cache::MemoryKind::Host,
                        crate::cache::AllocationIdentity::Host,
                    )
                };
                let request = Request {
                    kind,
                    identity,
                    ..Request::host(self.domain, addr, len)
                }
                .within(target.owner, Bounds::new(target.addr, target.len))
                .with_access(target.access);
                let registrar = BufferRegistrar::new(&self.registrar, target.memory, None);
                let handle =
                    self.cached(&registrar, &request)
                        .map_err(|source| LadderError::Host {
                            device: self.device.to_string(),
                            source,
                        })?;
                self.registration(
                    target,
                    Rung::HostMemory,
                    Vec::new(),
                    addr,
                    len,
                    MemoryLocation::Host,
                    Some(handle),
                )
            }
            MemoryType::Device => self.register_gpu(target, addr, len)?,
        };
        tracing::debug!(
            rung = ?registration.rung,
            refused = %list(&registration.failures),
            "registered"
        );
        Ok(registration)
    }

    /// Looks `request` up, registering on a miss; when the budget is spent,
    /// evicts this domain's unused entries and tries once more. Also says
    /// whether it was a hit (nothing registered by this call).
    fn cached(
        &self,
        registrar: &BufferRegistrar<'_>,
        request: &Request,
    ) -> Result<(CacheHandle<NicRegistration>, bool), CacheError<RegisterError>> {
        let handle = match self.cache.get_or_register_with(registrar, request) {
            Err(CacheError::Register { source, .. })
                if matches!(*source, RegisterError::Budget(_)) =>
            {
                let evicted = self.cache.trim_in(self.domain);
                tracing::debug!(evicted, "MR budget spent: evicted unused entries");
                self.cache.get_or_register_with(registrar, request)
            }
            other => other,
        }?;
        Ok((handle, !registrar.registered.load(Ordering::Relaxed)))
    }

    #[allow(clippy::too_many_arguments)] // one per field of the registration
    fn registration(
        &self,
        target: &Target<'_>,
        rung: Rung,
        failures: Vec<RungFailure>,
        addr: u64,
        len: u64,
        location: MemoryLocation,
        handle: Option<(CacheHandle<NicRegistration>, bool)>,
    ) -> LadderRegistration {
        let cache_hit = handle.as_ref().is_some_and(|(_, hit)| *hit);
        LadderRegistration {
            rung,
            failures,
            addr,
            len,
            location,
            access: target.access,
            device: self.device.clone(),
            handle: handle.map(|(handle, _)| handle),
            cache_hit,
            _lease: MemoryLease::new(target.memory),
        }
    }

    fn register_gpu(
        &self,
        target: &Target<'_>,
        addr: u64,
        len: u64,
    ) -> Result<LadderRegistration, LadderError> {
        let Some(ordinal) = target.device_ordinal else {
            return Err(LadderError::Attributes {
                addr,
                source: CudaError::invalid(
                    "register",
                    "device memory without a device ordinal".to_owned(),
                ),
            });
        };
        let gpu = self
            .gpus
            .iter()
            .find(|g| g.attributes.ordinal == ordinal)
            .ok_or(LadderError::UnknownGpu { ordinal })?;
        let base = target.allocation_base;
        range_within(base, target.allocation_size, addr.wrapping_sub(base), len)?;
        let location = MemoryLocation::Gpu {
            ordinal: ordinal as u16,
        };
        let mut failures = Vec::new();
        for rung in [Rung::Dmabuf, Rung::Peermem] {
            if !target.gpu_direct_rdma_capable {
                // The driver may export such memory (the H200 does), but
                // whether a NIC can take it is unknown: it is staged.
                failures.push(RungFailure {
                    rung,
                    refusal: Refusal::Gpu(GpuLacks::VmmChunkNotRdmaCapable { base }),
                    from_probe: false,
                });
                continue;
            }
            if !self.config.policy.allows(rung) {
                failures.push(RungFailure {
                    rung,
                    refusal: Refusal::Policy,
                    from_probe: false,
                });
                continue;
            }
            if let Err(refusal) = self.probe(gpu, rung) {
                failures.push(RungFailure {
                    rung,
                    refusal,
                    from_probe: true,
                });
                continue;
            }
            match self.register_on(gpu, rung, target, addr, len) {
                Ok(handle) => {
                    return Ok(self.registration(
                        target,
                        rung,
                        failures,
                        addr,
                        len,
                        location,
                        Some(handle),
                    ));
                }
                Err(refusal) => failures.push(RungFailure {
                    rung,
                    refusal,
                    from_probe: false,
                }),
            }
        }
        if self.config.policy.allows(Rung::Staging) {
            Ok(self.registration(target, Rung::Staging, failures, addr, len, location, None))
        } else {
            Err(LadderError::NoAllowedRung {
                policy: self.config.policy,
                failures,
            })
        }
    }

    fn register_on(
        &self,
        gpu: &Gpu,
        rung: Rung,
        target: &Target<'_>,
        addr: u64,
        len: u64,
    ) -> Result<(CacheHandle<NicRegistration>, bool), Refusal> {
        let ordinal = gpu.attributes.ordinal;
        let base = target.allocation_base;
        let (request, export) = match rung {
            Rung::Dmabuf => {
                let request =
                    Request::dmabuf(self.domain, ordinal, target.buffer_id, addr - base, len)
                        .within(target.owner, Bounds::new(target.addr - base, target.len))
                        .with_access(target.access);
                // A hit needs no export (its registration holds one): look
                // the export up only for a miss.
                if let Some(handle) = self.cache.get(&request) {
                    return Ok((handle, true));
                }
                // Held only for this call: the registration keeps its own
                // reference, so a failure closes the fd at once.
                let export = self
                    .exports
                    .get_or_export(&gpu.context, target.buffer_id, base, target.allocation_size)
                    .map_err(Refusal::Driver)?;
                (request, Some(export))
            }
            _ => (
                Request::device(self.domain, ordinal, target.buffer_id, addr, len)
                    .within(target.owner, Bounds::new(target.addr, target.len))
                    .with_access(target.access),
                None,
            ),
        };
        let registrar = BufferRegistrar::new(&self.registrar, target.memory, export.as_ref());
        self.cached(&registrar, &request).map_err(|e| match e {
            CacheError::Register { source, .. } => (*source).clone().into(),
            other => Refusal::Nic(VerbsError::invalid("register", other.to_string())),
        })
    }

    /// The (NIC, GPU) pair's verdict on `rung`, probing it when it has none
    /// (or its back-off has run out). One thread probes; others wait.
    fn probe(&self, gpu: &Gpu, rung: Rung) -> Verdict {
        let key = (gpu.attributes.ordinal, rung);
        let mut slots = lock(&self.probes);
        let failures = loop {
            match slots.get(&key) {
                Some(ProbeSlot::Known(verdict)) => return verdict.clone(),
                Some(ProbeSlot::Probing) => {
                    slots = self
                        .probe_done
                        .wait(slots)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                Some(ProbeSlot::BackingOff {
                    refusal,
                    retry_at,
                    failures,
                }) => {
                    if Instant::now() < *retry_at {
                        return Err(refusal.clone());
                    }
                    break *failures;
                }
                None => break 0,
            }
        };
        slots.insert(key, ProbeSlot::Probing);
        drop(slots);
        let mut guard = ProbeGuard {
            slots: &self.probes,
            done: &self.probe_done,
            key,
            armed: true,
        };
        let verdict = {
            let _span =
                tracing::info_span!("probe", device = %self.device, gpu = key.0, ?rung).entered();
            let verdict = self.probe_once(gpu, rung);
            match &verdict {
                Ok(()) => tracing::info!("rung works"),
                Err(refusal) if refusal.is_transient() => {
                    tracing::info!(%refusal, "rung refused for now (transient): retried later")
                }
                Err(refusal) => tracing::info!(%refusal, "rung refused"),
            }
            verdict
        };
        let slot = match &verdict {
            Err(refusal) if refusal.is_transient() => {
                let backoff = self
                    .config
                    .probe_backoff
                    .saturating_mul(1 << failures.min(16))
                    .min(self.config.max_probe_backoff);
                ProbeSlot::BackingOff {
                    refusal: refusal.clone(),
                    retry_at: Instant::now() + backoff,
                    failures: failures + 1,
                }
            }
            _ => ProbeSlot::Known(verdict.clone()),
        };
        lock(&self.probes).insert(key, slot);
        guard.armed = false;
        self.probe_done.notify_all();
        verdict
    }

    fn probe_once(&self, gpu: &Gpu, rung: Rung) -> Verdict {
        let a = &gpu.attributes;
        match rung {
            Rung::Dmabuf if !a.dma_buf_supported => {
                return Err(Refusal::Gpu(GpuLacks::DmaBuf));
            }
            Rung::Peermem if !a.gpu_direct_rdma_supported => {
                return Err(Refusal::Gpu(GpuLacks::GpuDirectRdma));
            }
            _ => {}
        }
        let scratch = gpu.context.alloc(PROBE_LEN).map_err(Refusal::Driver)?;
        let addr = scratch.device_ptr();
        let pd = &self.registrar.pd;
        let reservation = self
            .registrar
            .budget
            .reserve(PROBE_LEN as u64)
            .map_err(Refusal::Budget)?;
        // The probe MR is proven as a peer would use it: remote rights.
        let access = GrantRights::ReadWrite.access();
        let mr = match rung {
            Rung::Dmabuf => {
                let fd = gpu
                    .context
                    .export_dmabuf(addr, PROBE_LEN)
                    .map_err(Refusal::Driver)?;
                // SAFETY: `fd` is open; `scratch` outlives `mr` (dropped
                // first below, or both leaked together).
                unsafe { pd.register_dmabuf(fd.as_raw_fd(), 0, PROBE_LEN, addr, access) }
            }
            // SAFETY: `scratch` outlives `mr` (as above).
            _ => unsafe { pd.register(addr, PROBE_LEN, access) },
        }
        .map_err(Refusal::Nic)?;
        if let Some(loopback) = &self.loopback {
            match loopback.prove(&mr, 0, PROBE_LEN) {
                Ok(()) => {}
                Err(e @ LoopbackError::Unquiesced { .. }) => {
                    // The NIC may still be writing into the scratch memory:
                    // neither it nor its MR may ever be freed.
                    std::mem::forget(mr);
                    std::mem::forget(scratch);
                    std::mem::forget(reservation);
                    return Err(Refusal::SelfCheck(e));
                }
                Err(e) => return Err(Refusal::SelfCheck(e)),
            }
        }
        drop(mr);
        drop(reservation);
        drop(scratch);
        Ok(())
    }
}
