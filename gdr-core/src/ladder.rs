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
//! ([`LadderConfig::self_check`]), and the verdict is kept: later buffers
//! skip a refused rung at no cost, with the probe's reason. Registrations go
//! through the [`RegistrationCache`], so a buffer registered again hits.
//! A [`Policy`] can forbid falling back (3FS's final design: "GDR or error").

use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use hal_cuda::{
    Context as _, CudaError, DeviceAttributes, DeviceMemory as _, MemoryType, PointerAttributes,
};
use hal_verbs::{
    AccessFlags, Api, Context as _, MemoryRegion as _, ProtectionDomain as _, VerbsError,
};

use crate::buffer::Forget;
use crate::cache::{
    CacheError, CacheHandle, DomainId, Limits, Registrar, RegistrationCache, Request,
};
use crate::descriptor::{MemoryDescriptor, MemoryLocation};
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

/// Why a rung was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The GPU reports it cannot (an attribute is 0).
    #[error("not supported by the GPU: {0}")]
    Gpu(String),
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
        let probed = if self.from_probe { " (probed)" } else { "" };
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LadderConfig {
    /// Which rungs GPU memory may take.
    pub policy: Policy,
    /// Prove each GPU rung with a loopback WRITE and READ when probing it.
    pub self_check: bool,
    /// The NIC port the self-check's queue pairs use.
    pub port: u8,
    /// Rights every registration gets.
    pub access: AccessFlags,
}

impl Default for LadderConfig {
    fn default() -> Self {
        Self {
            policy: Policy::Fallback,
            self_check: true,
            port: 1,
            access: AccessFlags::transfer(),
        }
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
        source: CacheError<VerbsError>,
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

/// One allocation exported as a dma-buf.
#[derive(Debug)]
pub struct DmabufExport {
    fd: OwnedFd,
    base: u64,
    len: u64,
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
}

/// The dma-buf exports of a process, one per allocation (by CUDA buffer id),
/// shared by every NIC's ladder: each export holds BAR1 resources, so a
/// second NIC reuses the fd rather than exporting again.
#[derive(Debug, Default)]
pub struct DmabufExports {
    by_buffer: Mutex<HashMap<u64, Arc<DmabufExport>>>,
}

impl DmabufExports {
    /// No exports yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The export of the allocation `attrs` describes, made on first use.
    pub fn get_or_export<C: hal_cuda::Api>(
        &self,
        context: &C::Context,
        attrs: &PointerAttributes,
    ) -> Result<Arc<DmabufExport>, CudaError> {
        if let Some(export) = lock(&self.by_buffer).get(&attrs.buffer_id) {
            return Ok(Arc::clone(export));
        }
        // Exported outside the lock: a racing second export of the same
        // allocation is dropped below, which only costs a duplicate fd.
        let len = attrs.allocation_size.next_multiple_of(HOST_PAGE);
        let fd = context.export_dmabuf(attrs.allocation_base, len as usize)?;
        let export = Arc::new(DmabufExport {
            fd,
            base: attrs.allocation_base,
            len,
        });
        tracing::debug!(
            buffer_id = attrs.buffer_id,
            base = format_args!("{:#x}", export.base),
            len,
            "exported allocation as dma-buf"
        );
        Ok(Arc::clone(
            lock(&self.by_buffer)
                .entry(attrs.buffer_id)
                .or_insert(export),
        ))
    }

    /// The export of allocation `buffer_id`, if one was made.
    pub fn get(&self, buffer_id: u64) -> Option<Arc<DmabufExport>> {
        lock(&self.by_buffer).get(&buffer_id).cloned()
    }

    /// Forgets the export of a freed allocation (the fd closes when the last
    /// registration on it is gone).
    pub fn release(&self, buffer_id: u64) {
        lock(&self.by_buffer).remove(&buffer_id);
    }
}

/// CUDA's dma-buf export wants host-page alignment; gdr's platforms have
/// 4 KiB base pages (larger pages are multiples of it).
const HOST_PAGE: u64 = 4096;

/// What the cache keeps: an MR, and the dma-buf it was made from (kept open
/// as long as the MR, so other NICs can reuse it).
pub struct NicRegistration<V: Api> {
    // Declared first: the MR is deregistered before the fd closes.
    mr: V::MemoryRegion,
    export: Option<Arc<DmabufExport>>,
}

impl<V: Api> fmt::Debug for NicRegistration<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NicRegistration")
            .field("mr", &self.mr)
            .field("dmabuf", &self.export.as_ref().map(|e| e.fd.as_raw_fd()))
            .finish()
    }
}

impl<V: Api> NicRegistration<V> {
    /// The memory region.
    pub fn mr(&self) -> &V::MemoryRegion {
        &self.mr
    }
}

/// Registers cache requests in one protection domain.
pub struct NicRegistrar<V: Api> {
    pd: Arc<V::ProtectionDomain>,
    exports: Arc<DmabufExports>,
    access: AccessFlags,
}

impl<V: Api> fmt::Debug for NicRegistrar<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NicRegistrar")
            .field("pd", &self.pd)
            .field("access", &self.access)
            .finish()
    }
}

impl<V: Api> NicRegistrar<V> {
    /// A registrar for `pd`.
    ///
    /// # Safety
    /// Every range later registered through it must stay mapped until its
    /// registration is dropped: the owner of the memory invalidates the
    /// cache before freeing it (gdr's buffers do).
    pub unsafe fn new(
        pd: Arc<V::ProtectionDomain>,
        exports: Arc<DmabufExports>,
        access: AccessFlags,
    ) -> Self {
        Self {
            pd,
            exports,
            access,
        }
    }
}

impl<V: Api> Registrar for NicRegistrar<V> {
    type Registration = NicRegistration<V>;
    type Error = VerbsError;

    fn register(&self, request: &Request) -> Result<Self::Registration, Self::Error> {
        let len = usize::try_from(request.len)
            .map_err(|_| VerbsError::invalid("ibv_reg_mr", "length exceeds usize"))?;
        match request.identity {
            crate::cache::AllocationIdentity::Dmabuf { buffer_id } => {
                let export = self.exports.get(buffer_id).ok_or_else(|| {
                    VerbsError::invalid(
                        "ibv_reg_dmabuf_mr",
                        format!("allocation {buffer_id} has no dma-buf export"),
                    )
                })?;
                // SAFETY: the fd is open (the export owns it); the memory
                // outlives the region by `NicRegistrar::new`'s contract.
                let mr = unsafe {
                    self.pd.register_dmabuf(
                        export.fd.as_raw_fd(),
                        request.start,
                        len,
                        export.base + request.start,
                        self.access,
                    )
                }?;
                Ok(NicRegistration {
                    mr,
                    export: Some(export),
                })
            }
            _ => {
                // SAFETY: the memory outlives the region by
                // `NicRegistrar::new`'s contract.
                let mr = unsafe { self.pd.register(request.start, len, self.access) }?;
                Ok(NicRegistration { mr, export: None })
            }
        }
    }
}

/// A GPU the ladder can register memory of.
pub struct Gpu<C: hal_cuda::Api> {
    /// Its context.
    pub context: C::Context,
    /// Its attributes.
    pub attributes: DeviceAttributes,
}

impl<C: hal_cuda::Api> fmt::Debug for Gpu<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.attributes.ordinal)
            .field("name", &self.attributes.name)
            .finish()
    }
}

impl<C: hal_cuda::Api> Gpu<C> {
    /// GPU `ordinal` of `driver`.
    pub fn open(driver: &C::Driver, ordinal: u32) -> Result<Self, CudaError> {
        use hal_cuda::Driver as _;
        Ok(Self {
            context: driver.context(ordinal)?,
            attributes: driver.device_attributes(ordinal)?,
        })
    }
}

/// A buffer range registered on one NIC: the rung taken, why each higher
/// one was not, and (except for staging) the cached MR.
pub struct LadderRegistration<V: Api> {
    rung: Rung,
    failures: Vec<RungFailure>,
    addr: u64,
    len: u64,
    location: MemoryLocation,
    device: Arc<str>,
    handle: Option<CacheHandle<NicRegistration<V>>>,
}

impl<V: Api> fmt::Debug for LadderRegistration<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LadderRegistration")
            .field("rung", &self.rung)
            .field("failures", &self.failures)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("device", &self.device)
            .finish()
    }
}

impl<V: Api> LadderRegistration<V> {
    /// The rung taken.
    pub fn rung(&self) -> Rung {
        self.rung
    }

    /// Each rung above it, and why it was not taken.
    pub fn failures(&self) -> &[RungFailure] {
        &self.failures
    }

    /// The MR covering the range (a cached one may cover more); `None` when
    /// staged.
    pub fn mr(&self) -> Option<&V::MemoryRegion> {
        self.handle.as_ref().map(|h| h.registration().mr())
    }

    /// The cache handle, for comparing registrations.
    pub fn handle(&self) -> Option<&CacheHandle<NicRegistration<V>>> {
        self.handle.as_ref()
    }

    /// What a peer needs to access the range; `None` when staged.
    pub fn descriptor(&self) -> Option<MemoryDescriptor> {
        let mr = self.mr()?;
        Some(MemoryDescriptor {
            addr: self.addr,
            len: self.len,
            rkey: mr.rkey(),
            device: self.device.to_string(),
            location: self.location,
        })
    }
}

type Verdict = Result<(), Refusal>;

static NEXT_DOMAIN: AtomicU64 = AtomicU64::new(1);

/// The registration ladder of one NIC, over the GPUs it was given.
pub struct Ladder<V: Api, C: hal_cuda::Api> {
    // Shared with every registration: a hit must not allocate.
    device: Arc<str>,
    domain: DomainId,
    config: LadderConfig,
    // Declared before the PD's other owners so self-check QPs go first.
    loopback: Option<Loopback<V>>,
    registrar: NicRegistrar<V>,
    cache: Arc<RegistrationCache<NicRegistrar<V>>>,
    exports: Arc<DmabufExports>,
    gpus: Vec<Gpu<C>>,
    verdicts: Mutex<HashMap<(u32, Rung), Verdict>>,
    forget: Arc<dyn Forget>,
}

/// What a buffer calls on drop to remove its registrations in one domain.
struct LadderForget<V: Api> {
    cache: Arc<RegistrationCache<NicRegistrar<V>>>,
    exports: Arc<DmabufExports>,
    domain: DomainId,
}

impl<V: Api> Forget for LadderForget<V> {
    fn forget(&self, addr: u64, len: u64, buffer_id: Option<u64>) {
        let dropped = self.cache.invalidate_in(self.domain, addr, len)
            + buffer_id.map_or(0, |id| self.cache.invalidate_allocation(id));
        if let Some(id) = buffer_id {
            self.exports.release(id);
        }
        tracing::debug!(
            domain = self.domain,
            addr = format_args!("{addr:#x}"),
            len,
            dropped,
            "buffer gone: registrations invalidated"
        );
    }
}

impl<V: Api, C: hal_cuda::Api> fmt::Debug for Ladder<V, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ladder")
            .field("device", &self.device)
            .field("domain", &self.domain)
            .field("config", &self.config)
            .field("gpus", &self.gpus)
            .field("verdicts", &*lock(&self.verdicts))
            .finish()
    }
}

impl<V: Api, C: hal_cuda::Api> Ladder<V, C> {
    /// A ladder on NIC `context` (a PD of its own), for memory of `gpus`,
    /// registering through `cache` (shared by every NIC's ladder; this one's
    /// entries are limited to the NIC's `max_mr`) and exporting dma-bufs
    /// through `exports` (shared likewise).
    ///
    /// # Safety
    /// Memory registered through the ladder must stay mapped until the cache
    /// entries covering it are invalidated (or the cache dropped): use
    /// gdr's buffers, or invalidate before freeing.
    pub unsafe fn new(
        context: &V::Context,
        gpus: Vec<Gpu<C>>,
        cache: Arc<RegistrationCache<NicRegistrar<V>>>,
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
        let domain = NEXT_DOMAIN.fetch_add(1, Ordering::Relaxed);
        cache.set_limits(
            domain,
            Limits {
                max_entries: u64::from(attrs.max_mr).max(1),
                ..cache.config().limits
            },
        );
        let loopback = if config.self_check {
            Some(Loopback::with_pd(context, Arc::clone(&pd), config.port).map_err(setup)?)
        } else {
            None
        };
        // SAFETY: forwarded to our caller (this function's contract).
        let registrar = unsafe { NicRegistrar::new(pd, Arc::clone(&exports), config.access) };
        let forget = Arc::new(LadderForget {
            cache: Arc::clone(&cache),
            exports: Arc::clone(&exports),
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
            verdicts: Mutex::new(HashMap::new()),
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
    pub fn pd(&self) -> &Arc<V::ProtectionDomain> {
        &self.registrar.pd
    }

    /// The cache this ladder registers through.
    pub fn cache(&self) -> &Arc<RegistrationCache<NicRegistrar<V>>> {
        &self.cache
    }

    /// The dma-buf exports this ladder shares.
    pub fn exports(&self) -> &Arc<DmabufExports> {
        &self.exports
    }

    /// Proves a registration made here with a loopback WRITE and READ of its
    /// first `len` bytes (overwriting them). Needs
    /// [`LadderConfig::self_check`]; a staged registration has nothing to
    /// prove.
    pub fn prove(
        &self,
        registration: &LadderRegistration<V>,
        len: u64,
    ) -> Result<(), LoopbackError> {
        let not_possible =
            |why: &str| LoopbackError::Verbs(VerbsError::invalid("Ladder::prove", why.to_owned()));
        let loopback = self
            .loopback
            .as_ref()
            .ok_or_else(|| not_possible("the ladder was built without self_check"))?;
        let handle = registration
            .handle
            .as_ref()
            .ok_or_else(|| not_possible("a staged registration has no MR"))?;
        let mr = handle.registration().mr();
        let len = usize::try_from(len.min(registration.len))
            .map_err(|_| not_possible("length exceeds usize"))?;
        loopback.prove(mr, registration.addr - mr.addr(), len)
    }

    /// Probes every GPU rung for every GPU of the ladder (those not probed
    /// yet) and returns the verdicts: what this NIC can do with each GPU's
    /// memory, whatever the policy.
    pub fn probe_all(&self) -> Vec<(u32, Rung, Result<(), Refusal>)> {
        self.gpus
            .iter()
            .flat_map(|gpu| {
                [Rung::Dmabuf, Rung::Peermem]
                    .map(|rung| (gpu.attributes.ordinal, rung, self.probe(gpu, rung)))
            })
            .collect()
    }

    /// The verdict of probing `rung` for GPU `ordinal`, if probed.
    pub fn verdict(&self, ordinal: u32, rung: Rung) -> Option<Result<(), Refusal>> {
        lock(&self.verdicts).get(&(ordinal, rung)).cloned()
    }

    fn attributes(&self, addr: u64) -> Result<PointerAttributes, LadderError> {
        match self.gpus.first() {
            Some(gpu) => gpu
                .context
                .pointer_attributes(addr)
                .map_err(|source| LadderError::Attributes { addr, source }),
            // Without CUDA every address is host memory as far as anyone knows.
            None => Ok(PointerAttributes {
                memory_type: MemoryType::PageableHost,
                device_ordinal: None,
                allocation_base: addr,
                allocation_size: 0,
                buffer_id: 0,
                allocation_kind: hal_cuda::AllocationKind::Other,
                gpu_direct_rdma_capable: false,
            }),
        }
    }

    /// Registers `len` bytes at `addr` on the first rung that works.
    pub fn register(&self, addr: u64, len: u64) -> Result<LadderRegistration<V>, LadderError> {
        // Debug, not info: this runs on every registration, cache hits
        // included; probe verdicts are what info reports.
        let _span = tracing::debug_span!(
            "register",
            device = %self.device,
            addr = format_args!("{addr:#x}"),
            len
        )
        .entered();
        let attrs = self.attributes(addr)?;
        let registration = match attrs.memory_type {
            MemoryType::Managed => return Err(LadderError::ManagedMemory { addr }),
            MemoryType::PageableHost | MemoryType::PinnedHost => {
                let request = Request::from_attributes(self.domain, &attrs, addr, len)
                    .ok_or(LadderError::ManagedMemory { addr })?;
                let handle = self
                    .cache
                    .get_or_register(&self.registrar, &request)
                    .map_err(|source| LadderError::Host {
                        device: self.device.to_string(),
                        source,
                    })?;
                self.registration(
                    Rung::HostMemory,
                    Vec::new(),
                    addr,
                    len,
                    MemoryLocation::Host,
                    Some(handle),
                )
            }
            MemoryType::Device => self.register_gpu(&attrs, addr, len)?,
        };
        tracing::debug!(
            rung = ?registration.rung,
            refused = %list(&registration.failures),
            "registered"
        );
        Ok(registration)
    }

    fn registration(
        &self,
        rung: Rung,
        failures: Vec<RungFailure>,
        addr: u64,
        len: u64,
        location: MemoryLocation,
        handle: Option<CacheHandle<NicRegistration<V>>>,
    ) -> LadderRegistration<V> {
        LadderRegistration {
            rung,
            failures,
            addr,
            len,
            location,
            device: self.device.clone(),
            handle,
        }
    }

    fn register_gpu(
        &self,
        attrs: &PointerAttributes,
        addr: u64,
        len: u64,
    ) -> Result<LadderRegistration<V>, LadderError> {
        let ordinal = attrs.device_ordinal.unwrap_or(0);
        let gpu = self
            .gpus
            .iter()
            .find(|g| g.attributes.ordinal == ordinal)
            .ok_or(LadderError::UnknownGpu { ordinal })?;
        let (base, size) = (attrs.allocation_base, attrs.allocation_size);
        if addr.checked_add(len).is_none_or(|end| end > base + size) || len == 0 {
            return Err(LadderError::OutsideAllocation {
                addr,
                len,
                base,
                size,
            });
        }
        let location = MemoryLocation::Gpu {
            ordinal: ordinal as u16,
        };
        let mut failures = Vec::new();
        for rung in [Rung::Dmabuf, Rung::Peermem] {
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
            match self.register_on(gpu, rung, attrs, addr, len) {
                Ok(handle) => {
                    return Ok(self.registration(
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
            Ok(self.registration(Rung::Staging, failures, addr, len, location, None))
        } else {
            Err(LadderError::NoAllowedRung {
                policy: self.config.policy,
                failures,
            })
        }
    }

    fn register_on(
        &self,
        gpu: &Gpu<C>,
        rung: Rung,
        attrs: &PointerAttributes,
        addr: u64,
        len: u64,
    ) -> Result<CacheHandle<NicRegistration<V>>, Refusal> {
        let ordinal = gpu.attributes.ordinal;
        let request = match rung {
            Rung::Dmabuf => {
                self.exports
                    .get_or_export::<C>(&gpu.context, attrs)
                    .map_err(Refusal::Driver)?;
                Request::dmabuf(
                    self.domain,
                    ordinal,
                    attrs.buffer_id,
                    addr - attrs.allocation_base,
                    len,
                )
            }
            _ => Request::device(self.domain, ordinal, attrs.buffer_id, addr, len),
        };
        self.cache
            .get_or_register(&self.registrar, &request)
            .map_err(|e| match e {
                CacheError::Register { source, .. } => Refusal::Nic((*source).clone()),
                other => Refusal::Nic(VerbsError::invalid("register", other.to_string())),
            })
    }

    /// The (NIC, GPU) pair's verdict on `rung`, probing it on first use.
    fn probe(&self, gpu: &Gpu<C>, rung: Rung) -> Verdict {
        let key = (gpu.attributes.ordinal, rung);
        if let Some(verdict) = lock(&self.verdicts).get(&key) {
            return verdict.clone();
        }
        let _span =
            tracing::info_span!("probe", device = %self.device, gpu = key.0, ?rung).entered();
        let verdict = self.probe_once(gpu, rung);
        match &verdict {
            Ok(()) => tracing::info!("rung works"),
            Err(refusal) => tracing::info!(%refusal, "rung refused"),
        }
        lock(&self.verdicts).insert(key, verdict.clone());
        verdict
    }

    fn probe_once(&self, gpu: &Gpu<C>, rung: Rung) -> Verdict {
        let a = &gpu.attributes;
        match rung {
            Rung::Dmabuf if !a.dma_buf_supported => {
                return Err(Refusal::Gpu(
                    "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0".into(),
                ));
            }
            Rung::Peermem if !a.gpu_direct_rdma_supported => {
                return Err(Refusal::Gpu(
                    "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED is 0".into(),
                ));
            }
            _ => {}
        }
        let scratch = gpu.context.alloc(PROBE_LEN).map_err(Refusal::Driver)?;
        let addr = scratch.device_ptr();
        let pd = &self.registrar.pd;
        let mr = match rung {
            Rung::Dmabuf => {
                let fd = gpu
                    .context
                    .export_dmabuf(addr, PROBE_LEN)
                    .map_err(Refusal::Driver)?;
                // SAFETY: `fd` is open; `scratch` outlives `mr` (dropped first).
                unsafe {
                    pd.register_dmabuf(fd.as_raw_fd(), 0, PROBE_LEN, addr, self.config.access)
                }
            }
            // SAFETY: `scratch` outlives `mr` (dropped first).
            _ => unsafe { pd.register(addr, PROBE_LEN, self.config.access) },
        }
        .map_err(Refusal::Nic)?;
        if let Some(loopback) = &self.loopback {
            loopback
                .prove(&mr, 0, PROBE_LEN)
                .map_err(Refusal::SelfCheck)?;
        }
        drop(mr);
        drop(scratch);
        Ok(())
    }
}
