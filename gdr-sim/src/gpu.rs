//! A simulated GPU behind the `hal-cuda` traits.
//!
//! Device memory is host memory in disguise (see [`crate::memory`]): each
//! allocation is a memfd mapped in this process and given an address in the
//! simulated device window. dma-buf export hands out a duplicate of that
//! memfd, so a dma-buf MR sees the same bytes; IPC handles name the
//! allocation and another simulated process maps the same memfd again.
//!
//! IPC across OS processes: a handle carries the exporter's OS pid and the
//! number of an fd it keeps open on the allocation's memfd until the
//! allocation is freed, with the allocation's size and the random tag in the
//! memfd's name. Another simulated process of the same OS process finds the
//! allocation in an in-process table (the exporting simulated process itself
//! is refused, as CUDA refuses); another OS process reopens
//! `/proc/<pid>/fd/<fd>`, checks the name and size, and maps it as a mapping
//! of its own. Limits of the simulation: both processes run as the same user
//! (the kernel's ptrace read check on `/proc/<pid>/fd`, so a setuid or
//! non-dumpable exporter cannot be opened either), `/proc` is mounted, and
//! the exporter is alive while the handle is opened (an open mapping outlives
//! it, as the memfd does). A handle of a freed allocation, or one whose fd
//! number was since reused for another file, fails with `InvalidArgument`.
//!
//! Streams queue their copies; work runs when the stream or an event is
//! synchronized, or queried while the GPU is not [`SimCuda::set_paused`]. So
//! nothing moves behind a test's back, and "in flight" can be observed.
//!
//! Capability switches ([`GpuConfig`]) make dma-buf, GPUDirect RDMA,
//! nvidia-peermem and the VMM API present or absent per GPU.
//!
//! CUDA VMM: a reservation takes a range of the device window; each
//! `map` of physical memory into it is a range of its own with a fresh buffer
//! id (as the real driver gives: 907 → 909, and 1818 → 1830, measured on the
//! H200 when a second physical allocation is mapped where the first was),
//! reported as [`AllocationKind::VirtualMemoryManagement`] device memory.
//! Its pointer attributes' base and size are the whole reservation's, as the
//! H200 (driver 580) reports them (`RANGE_START_ADDR`/`RANGE_SIZE` of a
//! 2 MiB chunk mapped in a 4 MiB reservation read as the 4 MiB), while
//! `cuMemGetAddressRange` and dma-buf export see the mapped chunk only.
//!
//! There is no current context in the simulation: the real backend's
//! promise to leave the caller's current context alone holds trivially.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{
    Arc, LazyLock, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak,
};

use hal_cuda::{
    AllocationKind, CudaError, DeviceAttributes, FlushScope, FlushWritesOptions, HostRegisterFlags,
    IpcMemHandle, MemoryType, PointerAttributes, Result, WritesOrdering,
};
use memmap2::{MmapMut, MmapRaw};

use crate::faults::{Fault, FaultPlan, FaultSite};
use crate::memory::{self, Backing, DeviceRange, FreedAllocation, GpuAllocator, UseAfterFree};

const PAGE: u64 = 4096;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What one simulated GPU can do. The default is an H200 as measured on the
/// project's GPU machine, with nvidia-peermem absent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuConfig {
    /// Marketing name.
    pub name: String,
    /// PCI bus id.
    pub pci_bus_id: String,
    /// Device memory; allocations beyond it fail with out-of-memory.
    pub total_memory: u64,
    /// `DMA_BUF_SUPPORTED`: export works.
    pub dma_buf_supported: bool,
    /// `GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpu_direct_rdma_supported: bool,
    /// Whether the node has a peer-memory client for this GPU, so
    /// `ibv_reg_mr` on a device address works (the peermem rung).
    pub peermem: bool,
    /// Flush options.
    pub flush_writes_options: FlushWritesOptions,
    /// Writes ordering.
    pub writes_ordering: WritesOrdering,
    /// Give device allocations their backing's host address instead of an
    /// address in the (CPU-inaccessible) device window. A real NIC can then
    /// register them with `ibv_reg_mr`, standing in for nvidia-peermem on a
    /// machine without a GPU (the SoftRoCE tests do this); dma-buf export
    /// still hands out the memfd, which a real NIC refuses or accepts as its
    /// driver does. Freed addresses are not deliberately reused.
    pub host_visible: bool,
    /// `VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`: reservations, `cuMemCreate`
    /// and `cuMemMap` work.
    pub virtual_memory_management: bool,
    /// Hand a freed address to this GPU's next allocation of the same size,
    /// with a new buffer id, as CUDA's allocator does (what stale
    /// registration tests need), and unmap freed pinned host memory. Off by
    /// default: freed memory is quarantined instead, so that any access to
    /// it is refused and reported ([`SimCuda::use_after_free_reports`]);
    /// see [`crate::memory`].
    pub reuse_freed_addresses: bool,
}

impl Default for GpuConfig {
    fn default() -> Self {
        Self {
            name: "Simulated H200".into(),
            pci_bus_id: "0000:17:00.0".into(),
            total_memory: 1 << 30,
            dma_buf_supported: true,
            gpu_direct_rdma_supported: true,
            peermem: false,
            flush_writes_options: FlushWritesOptions::HOST,
            writes_ordering: WritesOrdering::Owner,
            host_visible: false,
            virtual_memory_management: true,
            reuse_freed_addresses: false,
        }
    }
}

#[derive(Debug)]
struct SimGpu {
    ordinal: u32,
    config: GpuConfig,
    lost: AtomicBool,
    used: AtomicU64,
    /// `cuFlushGPUDirectRDMAWrites` calls that succeeded.
    flushes: AtomicU64,
    /// `cuCtxEnablePeerAccess` calls that succeeded.
    peers_enabled: AtomicU64,
    /// Device-to-device copies queued on its streams.
    device_copies: AtomicU64,
    /// Its part in the address space: frees, quarantine, reports.
    allocator: Arc<GpuAllocator>,
}

/// The allocations that IPC handles can name, by buffer id.
static IPC_EXPORTS: LazyLock<Mutex<HashMap<u64, IpcExport>>> = LazyLock::new(Default::default);

/// One exported allocation.
#[derive(Debug)]
struct IpcExport {
    range: Weak<DeviceRange>,
    /// A duplicate of the backing's memfd, the one handles name for other OS
    /// processes (through `/proc/<pid>/fd/<fd>`). It is closed when the
    /// allocation is freed, even while other holders (a queued copy, an MR,
    /// an IPC mapping) keep the backing itself open, so a handle to freed
    /// memory no longer opens.
    fd: OwnedFd,
}

/// What a simulated IPC handle's 64 bytes hold (little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SimIpcHandle {
    /// Bytes 8..16: the allocation's buffer id.
    buffer_id: u64,
    /// Bytes 16..24: the exporting simulated process.
    exporter: u64,
    /// Bytes 24..28: the exporting OS process.
    os_pid: u32,
    /// Bytes 28..32: the [`IpcExport::fd`] in that process.
    fd: i32,
    /// Bytes 32..40: the allocation's size.
    len: u64,
    /// Bytes 40..48: the backing's tag ([`Backing::tag`]).
    tag: u64,
    /// Bytes 48..52: the GPU ordinal it lives on (52..64 are zero).
    ordinal: u32,
}

/// Bytes 0..8 of a simulated IPC handle.
const IPC_MAGIC: &[u8; 8] = b"gdrsimIP";

impl SimIpcHandle {
    fn encode(&self) -> IpcMemHandle {
        let mut bytes = [0u8; 64];
        bytes[..8].copy_from_slice(IPC_MAGIC);
        bytes[8..16].copy_from_slice(&self.buffer_id.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.exporter.to_le_bytes());
        bytes[24..28].copy_from_slice(&self.os_pid.to_le_bytes());
        bytes[28..32].copy_from_slice(&self.fd.to_le_bytes());
        bytes[32..40].copy_from_slice(&self.len.to_le_bytes());
        bytes[40..48].copy_from_slice(&self.tag.to_le_bytes());
        bytes[48..52].copy_from_slice(&self.ordinal.to_le_bytes());
        IpcMemHandle(bytes)
    }

    fn decode(handle: &IpcMemHandle) -> Option<Self> {
        let bytes = &handle.0;
        let u64_at = |i: usize| Some(u64::from_le_bytes(bytes[i..i + 8].try_into().ok()?));
        let u32_at = |i: usize| Some(u32::from_le_bytes(bytes[i..i + 4].try_into().ok()?));
        if &bytes[..8] != IPC_MAGIC || bytes[52..].iter().any(|&b| b != 0) {
            return None;
        }
        Some(Self {
            buffer_id: u64_at(8)?,
            exporter: u64_at(16)?,
            os_pid: u32_at(24)?,
            fd: i32::from_le_bytes(bytes[28..32].try_into().ok()?),
            len: u64_at(32)?,
            tag: u64_at(40)?,
            ordinal: u32_at(48)?,
        })
    }
}

/// Where each exported dma-buf fd starts inside its memfd, keyed by fd number
/// and checked by inode: a real dma-buf of a sub-range begins at that
/// sub-range, while the simulation hands out the whole allocation's memfd.
static DMABUF_ORIGINS: LazyLock<Mutex<HashMap<RawFd, DmabufOrigin>>> =
    LazyLock::new(Default::default);

#[derive(Debug, Clone, Copy)]
struct DmabufOrigin {
    inode: u64,
    offset: u64,
    len: u64,
}

/// Where byte 0 of dma-buf `fd` lies in the memfd it duplicates, and how many
/// bytes it exports. The simulated NIC maps `origin + offset`.
pub fn dmabuf_extent(fd: RawFd) -> Option<(u64, u64)> {
    // SAFETY: the caller vouches that `fd` is open for the duration of the
    // call (the HAL's register_dmabuf contract); we only fstat it.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let inode = rustix::fs::fstat(borrowed).ok()?.st_ino;
    let origin = *lock(&DMABUF_ORIGINS).get(&fd)?;
    (origin.inode == inode).then_some((origin.offset, origin.len))
}

static NEXT_PROCESS: AtomicU64 = AtomicU64::new(1);

/// Pinned host ranges of one simulated process, by start.
type PinnedRanges = BTreeMap<u64, PinnedRange>;

/// One pinned host range: `cuMemHostAlloc` memory or a `cuMemHostRegister`
/// of the caller's.
#[derive(Debug)]
struct PinnedRange {
    len: usize,
    buffer_id: u64,
    /// The mapping, for memory the simulation allocated: copies queued on
    /// it keep it (see [`PinnedMapping`]).
    mapping: Weak<PinnedMapping>,
}

#[derive(Debug)]
struct ProcessState {
    id: u64,
    /// The simulated node (the GPUs' set), shared by its processes.
    node: u64,
    gpus: Vec<Arc<SimGpu>>,
    faults: FaultPlan,
    pinned: Mutex<PinnedRanges>,
    paused: AtomicBool,
    /// This process's live streams by their [`hal_cuda::Stream::raw`]
    /// token, with their GPU: what `borrow_stream` may take.
    streams: Mutex<HashMap<usize, LiveStream>>,
    /// The driver's lock, as the real driver behaves (measured on an H100,
    /// driver 580, issue 33: `tests/gpu-probes/lock_probe.cu`): a free (`cuMemFree`,
    /// `cuMemFreeHost`, `cuMemHostUnregister`) holds it while it waits for
    /// every stream of the process to drain, value waits included, and
    /// other threads' `cuEventCreate`, `cuStreamCreate`, `cuMemAlloc`,
    /// `cuMemHostAlloc`, `cuMemHostRegister`, the async copies and fills
    /// and `cuEventRecord` wait for it meanwhile. Queries (`cuEventQuery`,
    /// `cuStreamQuery`), stream memory operations and
    /// `cuFlushGPUDirectRDMAWrites` do not take it.
    driver: RwLock<()>,
}

/// A stream's GPU ordinal and its queue while it lives.
/// The third part is the stream handles' token: a stream lives while a
/// handle does (events recorded on it may keep its queue longer, as the
/// driver keeps a destroyed stream's work).
type LiveStream = (u32, Weak<Mutex<StreamQueue>>, Weak<()>);

impl ProcessState {
    /// The driver lock as a call that waits behind a free takes it.
    fn behind_frees(&self) -> RwLockReadGuard<'_, ()> {
        self.driver.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// What a free does first on the real driver: takes the driver lock and
    /// waits, holding it, until every live stream of the process has run
    /// what was queued on it so far (a stream held by a value wait until a
    /// host thread releases it). Returns the lock, held until the free is
    /// done.
    fn synchronize_for_free(&self) -> RwLockWriteGuard<'_, ()> {
        let held = self.driver.write().unwrap_or_else(PoisonError::into_inner);
        let queued: Vec<(Arc<Mutex<StreamQueue>>, u64)> = lock(&self.streams)
            .values()
            .filter_map(|(_, queue, _)| queue.upgrade())
            .map(|queue| {
                let upto = lock(&queue).enqueued;
                (queue, upto)
            })
            .collect();
        for (queue, upto) in queued {
            drain(&queue, upto);
        }
        held
    }

    fn fault(&self, site: FaultSite, gpu: &SimGpu, operation: &'static str) -> Result<()> {
        match self.faults.hit(site) {
            None => Ok(()),
            Some(Fault::Cuda(error)) => Err(error),
            Some(Fault::Slow(duration)) => {
                std::thread::sleep(duration);
                Ok(())
            }
            Some(Fault::DeviceLost) => {
                gpu.lost.store(true, Ordering::SeqCst);
                // No CUresult names a lost device; the simulation reports
                // none.
                Err(CudaError::DeviceLost {
                    operation,
                    code: None,
                })
            }
            Some(other) => Err(CudaError::invalid(
                operation,
                format!("fault {other:?} is not a CUDA fault"),
            )),
        }
    }
}

/// What a simulated process holds ([`SimCuda::resources`]). Exported
/// dma-buf and IPC fds are plain fds of the process: count them in
/// `/proc/self/fd`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaResources {
    /// Device memory allocated on the process's node's GPUs (shared with
    /// the node's other processes).
    pub device_bytes: u64,
    /// Pinned host memory the simulation allocated for this process.
    pub pinned_bytes: u64,
    /// Host memory this process registered (`cuMemHostRegister`).
    pub host_registered_bytes: u64,
    /// Streams alive.
    pub streams: usize,
}

impl CudaResources {
    /// Whether nothing is left.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// The simulated CUDA backend's handle types.
#[derive(Debug)]
pub struct SimCudaApi;

impl hal_cuda::Api for SimCudaApi {
    type Driver = SimCuda;
    type Context = SimGpuContext;
    type Stream = SimStream;
    type Event = SimEvent;
    type DeviceMemory = SimDeviceMemory;
    type PinnedHostMemory = SimPinnedHostMemory;
    type HostRegistration = SimHostRegistration;
    type IpcMapping = SimIpcMapping;
    type VirtualReservation = SimVirtualReservation;
    type PhysicalMemory = SimPhysicalMemory;
    type VirtualMapping = SimVirtualMapping;
}

/// A simulated CUDA driver in one simulated process.
#[derive(Debug, Clone)]
pub struct SimCuda {
    process: Arc<ProcessState>,
}

impl SimCuda {
    /// This driver erased (`hal_cuda::dynamic`), as gdr-core's engines
    /// hold their backends: the erased driver's GPUs are this process's.
    pub fn erased(&self) -> hal_cuda::dynamic::DynDriver {
        hal_cuda::dynamic::DynDriver::new::<SimCudaApi>(self.clone())
    }
}

impl SimCuda {
    /// A process seeing one GPU per config, failing as `faults` scripts.
    pub fn new(configs: Vec<GpuConfig>, faults: FaultPlan) -> Self {
        let gpus = configs
            .into_iter()
            .enumerate()
            .map(|(ordinal, config)| {
                Arc::new(SimGpu {
                    ordinal: ordinal as u32,
                    allocator: GpuAllocator::new(ordinal as u32, config.reuse_freed_addresses),
                    config,
                    lost: AtomicBool::new(false),
                    used: AtomicU64::new(0),
                    flushes: AtomicU64::new(0),
                    peers_enabled: AtomicU64::new(0),
                    device_copies: AtomicU64::new(0),
                })
            })
            .collect();
        let node = NEXT_PROCESS.fetch_add(1, Ordering::Relaxed);
        Self::with_gpus(node, gpus, faults)
    }

    fn with_gpus(node: u64, gpus: Vec<Arc<SimGpu>>, faults: FaultPlan) -> Self {
        Self {
            process: Arc::new(ProcessState {
                id: NEXT_PROCESS.fetch_add(1, Ordering::Relaxed),
                node,
                gpus,
                faults,
                pinned: Mutex::new(BTreeMap::new()),
                paused: AtomicBool::new(false),
                streams: Mutex::new(HashMap::new()),
                driver: RwLock::new(()),
            }),
        }
    }

    /// The simulated process's id: clones share it, [`SimCuda::other_process`]
    /// has its own.
    pub fn process_id(&self) -> u64 {
        self.process.id
    }

    /// Another simulated process on the same node: same GPUs, its own
    /// address mappings, so IPC handles from this one can be opened there.
    pub fn other_process(&self) -> Self {
        Self::with_gpus(
            self.process.node,
            self.process.gpus.clone(),
            self.process.faults.clone(),
        )
    }

    /// While paused, event and stream queries report queued work as not yet
    /// done; synchronizing still runs it.
    pub fn set_paused(&self, paused: bool) {
        self.process.paused.store(paused, Ordering::SeqCst);
    }

    /// What this process holds of the simulated CUDA now: what a test
    /// asserts is back to zero once everything using it is dropped.
    pub fn resources(&self) -> CudaResources {
        let pinned = lock(&self.process.pinned);
        let (allocated, registered): (Vec<_>, Vec<_>) = pinned
            .values()
            .partition(|range| range.mapping.strong_count() > 0);
        CudaResources {
            device_bytes: (0..self.process.gpus.len() as u32)
                .map(|ordinal| self.used_bytes(ordinal))
                .sum(),
            pinned_bytes: allocated.iter().map(|range| range.len as u64).sum(),
            host_registered_bytes: registered.iter().map(|range| range.len as u64).sum(),
            streams: lock(&self.process.streams)
                .values()
                .filter(|(_, _, live)| live.strong_count() > 0)
                .count(),
        }
    }

    /// Device memory in use on GPU `ordinal`, in bytes.
    pub fn used_bytes(&self, ordinal: u32) -> u64 {
        self.process
            .gpus
            .get(ordinal as usize)
            .map_or(0, |g| g.used.load(Ordering::SeqCst))
    }
}

impl hal_cuda::Driver<SimCudaApi> for SimCuda {
    fn backend_name(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> Result<u32> {
        match self.process.gpus.len() {
            0 => Err(CudaError::NoDevice {
                detail: "the simulated node has no GPU".into(),
            }),
            n => Ok(n as u32),
        }
    }

    fn device_attributes(&self, ordinal: u32) -> Result<DeviceAttributes> {
        let gpu = self.gpu(ordinal)?;
        let c = &gpu.config;
        Ok(DeviceAttributes {
            ordinal,
            name: c.name.clone(),
            pci_bus_id: c.pci_bus_id.clone(),
            total_memory: c.total_memory,
            compute_capability: (9, 0),
            dma_buf_supported: c.dma_buf_supported,
            gpu_direct_rdma_supported: c.gpu_direct_rdma_supported,
            flush_writes_options: c.flush_writes_options,
            writes_ordering: c.writes_ordering,
            virtual_memory_management: c.virtual_memory_management,
        })
    }

    fn context(&self, ordinal: u32) -> Result<SimGpuContext> {
        let gpu = self.gpu(ordinal)?;
        check_alive(&gpu, "cuDevicePrimaryCtxRetain")?;
        Ok(SimGpuContext {
            gpu,
            process: Arc::clone(&self.process),
        })
    }

    /// Each simulated process is an address space of its own (its device
    /// addresses are not another's), within this OS process's token.
    fn process_token(&self) -> u64 {
        hal_cuda::os_process_token() ^ self.process.id.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    /// The simulated node: the processes of one [`SimCuda::new`] (its
    /// [`SimCuda::other_process`]es) share its GPUs; another `new` is
    /// another machine.
    fn host_token(&self) -> Option<[u8; 16]> {
        let mut token = *b"gdr-sim-node\0\0\0\0";
        token[12..].copy_from_slice(&(self.process.node as u32).to_le_bytes());
        Some(token)
    }
}

impl SimCuda {
    /// How many `cuFlushGPUDirectRDMAWrites` calls GPU `ordinal` took (a
    /// fence's test counts them; simulated writes need none to land).
    pub fn flushes(&self, ordinal: u32) -> u64 {
        self.gpu(ordinal)
            .map_or(0, |gpu| gpu.flushes.load(Ordering::SeqCst))
    }

    /// How many `cuCtxEnablePeerAccess` calls GPU `ordinal` took.
    pub fn peer_access_enabled(&self, ordinal: u32) -> u64 {
        self.gpu(ordinal)
            .map_or(0, |gpu| gpu.peers_enabled.load(Ordering::SeqCst))
    }

    /// How many device-to-device copies were queued on GPU `ordinal`'s
    /// streams (by any simulated process).
    pub fn device_copies(&self, ordinal: u32) -> u64 {
        self.gpu(ordinal)
            .map_or(0, |gpu| gpu.device_copies.load(Ordering::SeqCst))
    }

    /// The uses after free of memory GPU `ordinal` freed (the first
    /// [`memory::USE_AFTER_FREE_REPORTS_KEPT`]), by any simulated process
    /// of the node: each access was also refused. A test that expects none
    /// asserts this is empty; its GPUs are its own, so tests running in
    /// parallel do not see each other's.
    pub fn use_after_free_reports(&self, ordinal: u32) -> Vec<UseAfterFree> {
        self.gpu(ordinal)
            .map_or_else(|_| Vec::new(), |gpu| gpu.allocator.reports())
    }

    /// How many uses after free of GPU `ordinal`'s freed memory were
    /// reported in all (kept or not).
    pub fn use_after_free_count(&self, ordinal: u32) -> u64 {
        self.gpu(ordinal).map_or(0, |gpu| gpu.allocator.reported())
    }

    fn gpu(&self, ordinal: u32) -> Result<Arc<SimGpu>> {
        self.process
            .gpus
            .get(ordinal as usize)
            .cloned()
            .ok_or_else(|| CudaError::NoDevice {
                detail: format!("no simulated GPU {ordinal}"),
            })
    }
}

/// A descriptor of its own for the memfd behind `range` (a dma-buf
/// export, an IPC export).
fn dup_memfd(range: &memory::DeviceRange) -> Result<std::os::fd::OwnedFd> {
    range
        .backing
        .memfd()
        .try_clone_to_owned()
        .map_err(|e| CudaError::Os {
            operation: "dup",
            errno: e.raw_os_error().unwrap_or(libc::EMFILE),
        })
}

/// The error for an access by `operation` of `len` bytes at `addr` whose
/// byte `at` is not mapped device memory: CUDA's `CUDA_ERROR_INVALID_VALUE`
/// for a pointer it does not know, and a use-after-free report where `at`
/// was freed (see [`memory`]).
fn not_mapped(operation: &'static str, addr: u64, len: usize, at: u64) -> CudaError {
    match memory::use_after_free(operation, addr, len, at) {
        Some(report) => use_after_free_error(report),
        None if at == addr => {
            CudaError::invalid(operation, format!("{addr:#x} is not device memory"))
        }
        None => CudaError::invalid(
            operation,
            format!("{len} bytes at {addr:#x}: {at:#x} is not device memory"),
        ),
    }
}

/// CUDA's answer to a freed pointer: `CUDA_ERROR_INVALID_VALUE`, as for
/// any pointer it does not know (nothing sticky).
fn use_after_free_error(report: UseAfterFree) -> CudaError {
    CudaError::InvalidArgument {
        operation: report.operation,
        reason: report.to_string(),
        code: Some(1),
    }
}

/// Why a query (no access: nothing reported) finds no mapping at `addr`.
fn unmapped_reason(addr: u64) -> String {
    match memory::freed(addr) {
        Some(freed) => format!(
            "{addr:#x} is in buffer {} ({} bytes at {:#x}), freed by {}",
            freed.buffer_id, freed.len, freed.base, freed.freed_by
        ),
        None => format!("{addr:#x} is not mapped"),
    }
}

/// The machine's memory in bytes (`u64::MAX` where unknown).
fn physical_memory() -> u64 {
    // SAFETY: sysconf reads constants of the system; no memory is passed.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    match (u64::try_from(pages), u64::try_from(page)) {
        (Ok(pages), Ok(page)) if pages > 0 && page > 0 => pages.saturating_mul(page),
        _ => u64::MAX,
    }
}

fn check_alive(gpu: &SimGpu, operation: &'static str) -> Result<()> {
    if gpu.lost.load(Ordering::SeqCst) {
        Err(CudaError::DeviceLost {
            operation,
            code: None,
        })
    } else {
        Ok(())
    }
}

/// A simulated GPU's primary context in one process.
#[derive(Debug, Clone)]
pub struct SimGpuContext {
    gpu: Arc<SimGpu>,
    process: Arc<ProcessState>,
}

impl SimGpuContext {
    /// A range of device memory `len` bytes at `addr`, resolved to host
    /// memory, or the error CUDA gives for an address it does not know.
    fn device_range(&self, addr: u64, len: usize, operation: &'static str) -> Result<Resolved> {
        let range = memory::lookup(addr).ok_or_else(|| not_mapped(operation, addr, len, addr))?;
        if range.process != self.process.id {
            // Another process's mapping: its address means nothing here
            // (an IPC open gives this process a mapping of its own).
            return Err(CudaError::invalid(
                operation,
                format!("{addr:#x} is mapped in another process"),
            ));
        }
        let offset = addr - range.base;
        if offset + len as u64 > range.len as u64 {
            return Err(CudaError::invalid(
                operation,
                format!(
                    "{len} bytes at {addr:#x} run past the allocation at {:#x} ({} bytes)",
                    range.base, range.len
                ),
            ));
        }
        Ok(Resolved {
            // SAFETY: offset + len lies within the backing (checked above).
            ptr: unsafe { range.backing.as_ptr().add(offset as usize) },
            _keep: Some(Keep::Device {
                _backing: Arc::clone(&range.backing),
            }),
        })
    }
}

impl SimGpuContext {
    /// `len` bytes at device address `addr`, resolved to host memory one
    /// piece per mapping they cover: CUDA VMM chunks mapped side by side in
    /// one reservation are one range to the GPU's copies, as on the real
    /// driver; other allocations must hold the whole range.
    fn device_spans(&self, addr: u64, len: usize, operation: &'static str) -> Result<Vec<Span>> {
        let end = addr + len as u64;
        let mut spans = Vec::new();
        let mut at = addr;
        let mut reservation = None;
        loop {
            let here = memory::lookup(at)
                .filter(|r| reservation.is_none() || r.reservation == reservation)
                .ok_or_else(|| not_mapped(operation, addr, len, at))?;
            let left = (here.base + here.len as u64 - at).min(end - at);
            let resolved = self.device_range(at, left as usize, operation)?;
            spans.push(Span {
                at: resolved,
                len: left as usize,
            });
            at += left;
            if at >= end {
                return Ok(spans);
            }
            if here.reservation.is_none() {
                return Err(CudaError::invalid(
                    operation,
                    format!(
                        "{len} bytes at {addr:#x} run past the allocation at {:#x} ({} bytes)",
                        here.base, here.len
                    ),
                ));
            }
            reservation = here.reservation;
        }
    }
}

impl hal_cuda::Context<SimCudaApi> for SimGpuContext {
    fn ordinal(&self) -> u32 {
        self.gpu.ordinal
    }

    fn alloc(&self, len: usize) -> Result<SimDeviceMemory> {
        let _span = tracing::debug_span!("sim_cuMemAlloc", len).entered();
        let _driver = self.process.behind_frees();
        check_alive(&self.gpu, "cuMemAlloc")?;
        self.process
            .fault(FaultSite::CudaAlloc, &self.gpu, "cuMemAlloc")?;
        if len == 0 {
            return Err(CudaError::invalid("cuMemAlloc", "zero-length allocation"));
        }
        let used = self.gpu.used.fetch_add(len as u64, Ordering::SeqCst);
        if used + len as u64 > self.gpu.config.total_memory {
            self.gpu.used.fetch_sub(len as u64, Ordering::SeqCst);
            return Err(CudaError::OutOfMemory {
                operation: "cuMemAlloc",
                code: Some(2),
            });
        }
        let backing = Backing::new(len).map_err(|e| CudaError::Os {
            operation: "memfd_create",
            errno: e.raw_os_error().unwrap_or(libc::EIO),
        })?;
        let range = memory::map(
            &self.gpu.allocator,
            len,
            self.process.id,
            self.gpu.config.peermem,
            self.gpu.config.host_visible,
            Arc::new(backing),
        );
        tracing::debug!(
            base = format_args!("{:#x}", range.base),
            buffer_id = range.buffer_id,
            "allocated"
        );
        Ok(SimDeviceMemory {
            range,
            gpu: Arc::clone(&self.gpu),
            process: Arc::clone(&self.process),
        })
    }

    fn alloc_pinned(&self, len: usize) -> Result<SimPinnedHostMemory> {
        let _driver = self.process.behind_frees();
        check_alive(&self.gpu, "cuMemHostAlloc")?;
        self.process
            .fault(FaultSite::CudaAlloc, &self.gpu, "cuMemHostAlloc")?;
        if len == 0 {
            return Err(CudaError::invalid(
                "cuMemHostAlloc",
                "zero-length allocation",
            ));
        }
        // cuMemHostAlloc page-locks what it returns, so never more than the
        // machine's memory (the sim's mapping would only fail when touched,
        // with overcommit); the kernel's refusal is what it reports as
        // CUDA_ERROR_OUT_OF_MEMORY too.
        if len as u64 > physical_memory() {
            return Err(CudaError::OutOfMemory {
                operation: "cuMemHostAlloc",
                code: Some(2),
            });
        }
        let mut map = MmapMut::map_anon(len).map_err(|e| match e.raw_os_error() {
            Some(libc::ENOMEM) | None => CudaError::OutOfMemory {
                operation: "cuMemHostAlloc",
                code: Some(2),
            },
            Some(errno) => CudaError::Os {
                operation: "mmap",
                errno,
            },
        })?;
        // cuMemHostAlloc does not zero what it returns (the driver recycles
        // freed pinned memory): neither does the sim, so code that relies on
        // zeroed pinned memory fails here as it would there.
        map.fill(NOT_ZEROED);
        let mapping = Arc::new(PinnedMapping {
            map: Some(MmapRaw::from(map)),
            buffer_id: memory::next_buffer_id(),
            process: self.process.id,
            gpu: Arc::clone(&self.gpu),
        });
        lock(&self.process.pinned).insert(
            mapping.start(),
            PinnedRange {
                len,
                buffer_id: mapping.buffer_id,
                mapping: Arc::downgrade(&mapping),
            },
        );
        Ok(SimPinnedHostMemory {
            mapping,
            process: Arc::clone(&self.process),
        })
    }

    unsafe fn register_host(
        &self,
        ptr: *mut u8,
        len: usize,
        _flags: HostRegisterFlags,
    ) -> Result<SimHostRegistration> {
        let _driver = self.process.behind_frees();
        check_alive(&self.gpu, "cuMemHostRegister")?;
        if ptr.is_null() || len == 0 {
            return Err(CudaError::invalid(
                "cuMemHostRegister",
                "null or empty range",
            ));
        }
        let start = ptr as u64;
        if let Some(report) = memory::use_after_free("cuMemHostRegister", start, len, start) {
            return Err(use_after_free_error(report));
        }
        let mut pinned = lock(&self.process.pinned);
        let overlaps = pinned
            .range(..start + len as u64)
            .next_back()
            .is_some_and(|(&s, r)| s + r.len as u64 > start);
        if overlaps {
            return Err(CudaError::Driver {
                operation: "cuMemHostRegister",
                code: 712,
                name: hal_cuda::result_name(712),
            });
        }
        pinned.insert(
            start,
            PinnedRange {
                len,
                buffer_id: memory::next_buffer_id(),
                mapping: Weak::new(),
            },
        );
        Ok(SimHostRegistration {
            ptr,
            len,
            process: Arc::clone(&self.process),
        })
    }

    fn create_stream(&self) -> Result<SimStream> {
        let _driver = self.process.behind_frees();
        check_alive(&self.gpu, "cuStreamCreate")?;
        let queue = Arc::new(Mutex::new(StreamQueue::default()));
        let handle = Arc::new(());
        let mut streams = lock(&self.process.streams);
        streams.retain(|_, (_, _, live)| live.strong_count() > 0);
        streams.insert(
            Arc::as_ptr(&queue) as usize,
            (
                self.gpu.ordinal,
                Arc::downgrade(&queue),
                Arc::downgrade(&handle),
            ),
        );
        Ok(SimStream {
            ctx: self.clone(),
            queue,
            _handle: handle,
        })
    }

    unsafe fn borrow_stream(&self, raw: *mut std::ffi::c_void) -> Result<SimStream> {
        const OP: &str = "cuStreamBorrow";
        check_alive(&self.gpu, OP)?;
        let found = lock(&self.process.streams).get(&(raw as usize)).cloned();
        match found {
            Some((ordinal, queue, live)) if ordinal == self.gpu.ordinal => {
                match live.upgrade().zip(queue.upgrade()) {
                    Some((handle, queue)) => Ok(SimStream {
                        ctx: self.clone(),
                        queue,
                        _handle: handle,
                    }),
                    None => Err(CudaError::invalid(
                        OP,
                        format!("stream {raw:?} was destroyed"),
                    )),
                }
            }
            Some((ordinal, ..)) => Err(CudaError::invalid(
                OP,
                format!(
                    "stream {raw:?} is GPU {ordinal}'s, not GPU {}'s",
                    self.gpu.ordinal
                ),
            )),
            None => Err(CudaError::invalid(
                OP,
                format!("{raw:?} is no stream of this process"),
            )),
        }
    }

    fn create_event(&self) -> Result<SimEvent> {
        let _driver = self.process.behind_frees();
        check_alive(&self.gpu, "cuEventCreate")?;
        Ok(SimEvent {
            recorded: Mutex::new(None),
            paused: Arc::clone(&self.process),
            gpu: Arc::clone(&self.gpu),
        })
    }

    fn pointer_attributes(&self, addr: u64) -> Result<PointerAttributes> {
        check_alive(&self.gpu, "cuPointerGetAttributes")?;
        // One lookup: a host-visible allocation has a host address, so the
        // window test alone cannot tell device memory.
        if let Some(range) = memory::lookup(addr) {
            let gpu = &self.process.gpus[range.ordinal as usize];
            return Ok(PointerAttributes {
                memory_type: MemoryType::Device,
                device_ordinal: Some(range.ordinal),
                // VMM memory: the reservation, as the real driver reports.
                allocation_base: range.reservation.map_or(range.base, |r| r.0),
                allocation_size: range.reservation.map_or(range.len as u64, |r| r.1),
                buffer_id: range.buffer_id,
                allocation_kind: if range.reservation.is_some() {
                    AllocationKind::VirtualMemoryManagement
                } else {
                    AllocationKind::Legacy
                },
                gpu_direct_rdma_capable: gpu.config.gpu_direct_rdma_supported
                    && range.gpu_direct_rdma_capable,
            });
        }
        if addr >= memory::DEVICE_WINDOW_START {
            return Err(CudaError::invalid(
                "cuPointerGetAttributes",
                unmapped_reason(addr),
            ));
        }
        let pinned = lock(&self.process.pinned);
        if let Some((&start, range)) = pinned.range(..=addr).next_back()
            && addr < start + range.len as u64
        {
            return Ok(PointerAttributes {
                memory_type: MemoryType::PinnedHost,
                device_ordinal: None,
                allocation_base: start,
                allocation_size: range.len as u64,
                buffer_id: range.buffer_id,
                allocation_kind: AllocationKind::Other,
                gpu_direct_rdma_capable: false,
            });
        }
        Ok(PointerAttributes {
            memory_type: MemoryType::PageableHost,
            device_ordinal: None,
            allocation_base: addr,
            allocation_size: 0,
            buffer_id: 0,
            allocation_kind: AllocationKind::Other,
            gpu_direct_rdma_capable: false,
        })
    }

    fn export_dmabuf(&self, addr: u64, len: usize) -> Result<OwnedFd> {
        const OP: &str = "cuMemGetHandleForAddressRange";
        let _span =
            tracing::debug_span!("sim_export_dmabuf", addr = format_args!("{addr:#x}"), len)
                .entered();
        check_alive(&self.gpu, OP)?;
        self.process
            .fault(FaultSite::CudaExportDmabuf, &self.gpu, OP)?;
        if !self.gpu.config.dma_buf_supported {
            return Err(CudaError::NotSupported {
                operation: OP,
                reason: "the GPU does not support dma-buf export".into(),
                code: Some(801),
            });
        }
        if !addr.is_multiple_of(PAGE) || !(len as u64).is_multiple_of(PAGE) || len == 0 {
            return Err(CudaError::InvalidArgument {
                operation: OP,
                reason: format!("{len} bytes at {addr:#x} are not host-page aligned"),
                code: Some(1),
            });
        }
        let Some(range) = memory::lookup(addr) else {
            return Err(not_mapped(OP, addr, len, addr));
        };
        if addr - range.base + len as u64 > (range.len as u64).next_multiple_of(PAGE) {
            return Err(CudaError::InvalidArgument {
                operation: OP,
                reason: format!("{len} bytes at {addr:#x} are not inside one allocation"),
                code: Some(1),
            });
        }
        let fd = dup_memfd(&range)?;
        let inode = rustix::fs::fstat(&fd)
            .map_err(|e| CudaError::Os {
                operation: "fstat",
                errno: e.raw_os_error(),
            })?
            .st_ino;
        lock(&DMABUF_ORIGINS).insert(
            fd.as_raw_fd(),
            DmabufOrigin {
                inode,
                offset: addr - range.base,
                len: len as u64,
            },
        );
        Ok(fd)
    }

    fn ipc_export(&self, addr: u64) -> Result<IpcMemHandle> {
        const OP: &str = "cuIpcGetMemHandle";
        let _span =
            tracing::debug_span!("sim_ipc_export", addr = format_args!("{addr:#x}")).entered();
        check_alive(&self.gpu, OP)?;
        let range = memory::lookup(addr).ok_or_else(|| not_mapped(OP, addr, 1, addr))?;
        if range.reservation.is_some() {
            // Memory mapped with cuMemMap is not legacy-IPC capable.
            return Err(CudaError::InvalidArgument {
                operation: OP,
                reason: format!("{addr:#x} is CUDA VMM memory, not legacy-IPC capable"),
                code: Some(1),
            });
        }
        let mut exports = lock(&IPC_EXPORTS);
        let fd = match exports.get(&range.buffer_id) {
            // Exported before: the same handle, as CUDA gives.
            Some(export) => export.fd.as_raw_fd(),
            None => {
                let fd = dup_memfd(&range)?;
                let raw = fd.as_raw_fd();
                exports.insert(
                    range.buffer_id,
                    IpcExport {
                        range: Arc::downgrade(&range),
                        fd,
                    },
                );
                raw
            }
        };
        Ok(SimIpcHandle {
            buffer_id: range.buffer_id,
            exporter: range.process,
            os_pid: std::process::id(),
            fd,
            len: range.len as u64,
            tag: range.backing.tag(),
            ordinal: range.ordinal,
        }
        .encode())
    }

    fn ipc_open(&self, handle: &IpcMemHandle) -> Result<SimIpcMapping> {
        const OP: &str = "cuIpcOpenMemHandle";
        let _span = tracing::debug_span!("sim_ipc_open").entered();
        check_alive(&self.gpu, OP)?;
        self.process.fault(FaultSite::CudaIpcOpen, &self.gpu, OP)?;
        let invalid = |reason: String| CudaError::InvalidArgument {
            operation: OP,
            reason,
            code: Some(1),
        };
        let handle =
            SimIpcHandle::decode(handle).ok_or_else(|| invalid("not an IPC handle".into()))?;
        let gpu = self
            .process
            .gpus
            .get(handle.ordinal as usize)
            .ok_or_else(|| {
                invalid(format!(
                    "the allocation is on GPU {}, which this process does not see",
                    handle.ordinal
                ))
            })?;
        let backing = if handle.os_pid == std::process::id() {
            if handle.exporter == self.process.id {
                // CUDA refuses to open a handle in the process that exported it.
                return Err(CudaError::Driver {
                    operation: OP,
                    code: 201,
                    name: hal_cuda::result_name(201),
                });
            }
            let exports = lock(&IPC_EXPORTS);
            let source = exports
                .get(&handle.buffer_id)
                .and_then(|export| export.range.upgrade())
                .ok_or_else(|| invalid("the exported allocation has been freed".into()))?;
            if source.backing.tag() != handle.tag || source.len as u64 != handle.len {
                return Err(invalid(format!(
                    "buffer {} is not the allocation the handle names (a forged or stale handle)",
                    handle.buffer_id
                )));
            }
            Arc::clone(&source.backing)
        } else {
            Arc::new(open_foreign(&handle).map_err(invalid)?)
        };
        // A host-visible allocation's backing already has a host address;
        // its IPC mapping needs one of its own, so it goes in the window.
        let range = memory::map(
            &gpu.allocator,
            handle.len as usize,
            self.process.id,
            gpu.config.peermem,
            false,
            backing,
        );
        tracing::debug!(
            base = format_args!("{:#x}", range.base),
            exporter_pid = handle.os_pid,
            "opened"
        );
        Ok(SimIpcMapping { range })
    }

    fn enable_peer_access(&self, peer: &SimGpuContext) -> Result<bool> {
        check_alive(&self.gpu, "cuCtxEnablePeerAccess")?;
        check_alive(&peer.gpu, "cuCtxEnablePeerAccess")?;
        self.process.fault(
            FaultSite::CudaEnablePeerAccess,
            &self.gpu,
            "cuCtxEnablePeerAccess",
        )?;
        // The simulated GPUs of a node all reach each other (as the H200
        // pair over NVLink does); copies between them work either way.
        self.gpu.peers_enabled.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    }

    fn flush_gpu_direct_rdma_writes(&self, _scope: FlushScope) -> Result<()> {
        check_alive(&self.gpu, "cuFlushGPUDirectRDMAWrites")?;
        self.process.fault(
            FaultSite::CudaFlushWrites,
            &self.gpu,
            "cuFlushGPUDirectRDMAWrites",
        )?;
        if !self
            .gpu
            .config
            .flush_writes_options
            .contains(FlushWritesOptions::HOST)
        {
            return Err(CudaError::unsupported(
                "cuFlushGPUDirectRDMAWrites",
                "the GPU reports no host flush option",
            ));
        }
        // Simulated writes land in host memory at once: nothing to flush,
        // but the call is counted.
        self.gpu.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        check_alive(&self.gpu, "cuCtxSynchronize")
    }

    fn vmm_granularity(&self) -> Result<usize> {
        self.vmm("cuMemGetAllocationGranularity")?;
        Ok(memory::DEVICE_ALLOCATION_GRANULARITY as usize)
    }

    fn reserve_address_range(&self, len: usize) -> Result<SimVirtualReservation> {
        const OP: &str = "cuMemAddressReserve";
        self.vmm(OP)?;
        granular(OP, len)?;
        let base = memory::reserve(len as u64);
        Ok(SimVirtualReservation {
            inner: Arc::new(Reservation { base, len }),
        })
    }

    fn create_physical(&self, len: usize) -> Result<SimPhysicalMemory> {
        self.create_physical_with(len, true)
    }

    fn create_physical_with(&self, len: usize, gpu_direct_rdma: bool) -> Result<SimPhysicalMemory> {
        const OP: &str = "cuMemCreate";
        self.vmm(OP)?;
        self.process.fault(FaultSite::CudaAlloc, &self.gpu, OP)?;
        granular(OP, len)?;
        let used = self.gpu.used.fetch_add(len as u64, Ordering::SeqCst);
        if used + len as u64 > self.gpu.config.total_memory {
            self.gpu.used.fetch_sub(len as u64, Ordering::SeqCst);
            return Err(CudaError::OutOfMemory {
                operation: OP,
                code: Some(2),
            });
        }
        // From here on, dropping `physical` gives the bytes back.
        let mut physical = Physical {
            backing: None,
            len,
            gpu_direct_rdma_capable: gpu_direct_rdma && self.gpu.config.gpu_direct_rdma_supported,
            gpu: Arc::clone(&self.gpu),
        };
        let backing = Backing::new(len).map_err(|e| CudaError::Os {
            operation: "memfd_create",
            errno: e.raw_os_error().unwrap_or(libc::EIO),
        })?;
        physical.backing = Some(Arc::new(backing));
        Ok(SimPhysicalMemory {
            inner: Arc::new(physical),
        })
    }

    fn address_range(&self, addr: u64) -> Result<(u64, u64)> {
        check_alive(&self.gpu, "cuMemGetAddressRange")?;
        let range = memory::lookup(addr).ok_or_else(|| CudaError::InvalidArgument {
            operation: "cuMemGetAddressRange",
            reason: unmapped_reason(addr),
            code: Some(1),
        })?;
        Ok((range.base, range.len as u64))
    }

    fn map(
        &self,
        reservation: &SimVirtualReservation,
        offset: usize,
        physical: &SimPhysicalMemory,
    ) -> Result<SimVirtualMapping> {
        const OP: &str = "cuMemMap";
        self.vmm(OP)?;
        if !offset.is_multiple_of(memory::DEVICE_ALLOCATION_GRANULARITY as usize) {
            return Err(CudaError::InvalidArgument {
                operation: OP,
                reason: format!("offset {offset} is not a multiple of the granularity"),
                code: Some(1),
            });
        }
        let len = physical.inner.len;
        let fits = offset
            .checked_add(len)
            .is_some_and(|end| end <= reservation.inner.len);
        if !fits {
            return Err(CudaError::InvalidArgument {
                operation: OP,
                reason: format!(
                    "{len} bytes at offset {offset} do not fit the reservation of {} bytes",
                    reservation.inner.len
                ),
                code: Some(1),
            });
        }
        let Some(backing) = physical.inner.backing.clone() else {
            return Err(CudaError::invalid(OP, "physical memory without backing"));
        };
        let base = reservation.inner.base + offset as u64;
        let range = memory::map_fixed(
            &self.gpu.allocator,
            (reservation.inner.base, reservation.inner.len as u64),
            base,
            len,
            self.process.id,
            self.gpu.config.peermem,
            physical.inner.gpu_direct_rdma_capable,
            backing,
        )
        .ok_or_else(|| CudaError::InvalidArgument {
            operation: OP,
            reason: format!("{len} bytes at {base:#x} overlap a mapping"),
            code: Some(1),
        })?;
        tracing::debug!(
            base = format_args!("{base:#x}"),
            buffer_id = range.buffer_id,
            "mapped"
        );
        Ok(SimVirtualMapping {
            range,
            _reservation: Arc::clone(&reservation.inner),
            _physical: Arc::clone(&physical.inner),
        })
    }
}

impl SimGpuContext {
    fn vmm(&self, operation: &'static str) -> Result<()> {
        check_alive(&self.gpu, operation)?;
        if self.gpu.config.virtual_memory_management {
            Ok(())
        } else {
            Err(CudaError::NotSupported {
                operation,
                reason: "the GPU reports VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0".into(),
                code: Some(801),
            })
        }
    }
}

/// Maps the allocation another OS process exported: reopens its export fd
/// through `/proc/<pid>/fd/<fd>` and checks that it is the simulated GPU
/// memory the handle names (see [`Backing::adopt`]).
fn open_foreign(handle: &SimIpcHandle) -> std::result::Result<Backing, String> {
    let path = format!("/proc/{}/fd/{}", handle.os_pid, handle.fd);
    let len = usize::try_from(handle.len).map_err(|_| format!("{} bytes", handle.len))?;
    let not_it = |why: String| {
        format!("{path} is not the exported allocation (freed, or a stale or forged handle): {why}")
    };
    let gone = |e: std::io::Error| {
        format!(
            "cannot open {path} ({e}): the exported allocation has been freed, \
             its process exited, or it belongs to another user"
        )
    };
    // Looked at before it is opened, so a reused fd number's file (a pipe,
    // a device) is not opened at all; checked again once open.
    let name = std::fs::read_link(&path).map_err(gone)?;
    memory::check_memfd_name(&name, handle.tag).map_err(not_it)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(&path)
        .map_err(gone)?;
    Backing::adopt(file.into(), len, handle.tag).map_err(not_it)
}

fn granular(operation: &'static str, len: usize) -> Result<()> {
    let granularity = memory::DEVICE_ALLOCATION_GRANULARITY as usize;
    if len == 0 || !len.is_multiple_of(granularity) {
        return Err(CudaError::InvalidArgument {
            operation,
            reason: format!("{len} is not a positive multiple of the granularity ({granularity})"),
            code: Some(1),
        });
    }
    Ok(())
}

/// Host-visible view of a copy endpoint, keeping device backing alive while
/// the copy is queued.
#[derive(Debug)]
struct Resolved {
    ptr: *mut u8,
    _keep: Option<Keep>,
}

/// What a queued copy keeps alive of its endpoint's memory (held, never
/// read).
#[derive(Debug, Clone)]
enum Keep {
    Device { _backing: Arc<Backing> },
    Pinned { _mapping: Arc<PinnedMapping> },
}

// SAFETY: the pointer is only dereferenced by the stream executing the copy,
// under the stream's lock; the caller of the (unsafe) copy call guaranteed the
// memory stays valid until the copy completes.
unsafe impl Send for Resolved {}

impl Resolved {
    fn offset(&self, by: usize) -> Self {
        Self {
            ptr: self.ptr.wrapping_add(by),
            _keep: self._keep.clone(),
        }
    }
}

/// A piece of a copy's endpoint: `len` bytes at `at`.
#[derive(Debug)]
struct Span {
    at: Resolved,
    len: usize,
}

/// Pairs the pieces of a copy's two endpoints (cut where either one's
/// pieces are): `(dst, src, len)` each.
fn pair(dst: Vec<Span>, src: Vec<Span>) -> Vec<(Resolved, Resolved, usize)> {
    let mut pairs = Vec::new();
    let mut src = src.into_iter();
    let mut from = src.next();
    let mut used_src = 0;
    for d in dst {
        let mut done = 0;
        while done < d.len {
            let Some(s) = &from else { return pairs };
            let len = (d.len - done).min(s.len - used_src);
            pairs.push((d.at.offset(done), s.at.offset(used_src), len));
            done += len;
            used_src += len;
            if used_src == s.len {
                from = src.next();
                used_src = 0;
            }
        }
    }
    pairs
}

#[derive(Debug)]
enum Work {
    /// Copies each `(dst, src, len)` in turn.
    Copy(Vec<(Resolved, Resolved, usize)>),
    Fill {
        dst: Vec<Span>,
        value: u8,
    },
    Wait {
        queue: Arc<Mutex<StreamQueue>>,
        upto: u64,
    },
    /// Blocks the stream until the word at `at` is at least `value`.
    WaitValue {
        at: Resolved,
        value: u32,
    },
    /// Stores `value` at `at`.
    WriteValue {
        at: Resolved,
        value: u32,
    },
}

/// The 32-bit word a stream memory operation reads or writes.
fn word(at: &Resolved) -> &std::sync::atomic::AtomicU32 {
    // SAFETY: the caller of the (unsafe) wait/write promised 4-byte aligned
    // memory that stays valid until the operation has run, which is while
    // this reference is used; others touch it only atomically (the host
    // stores to release a wait).
    unsafe { &*at.ptr.cast::<std::sync::atomic::AtomicU32>() }
}

#[derive(Debug, Default)]
struct StreamQueue {
    pending: VecDeque<(u64, Work)>,
    enqueued: u64,
    completed: u64,
}

/// Blocks, as the driver does, until `queue` ran its work up to sequence
/// number `upto` (a value wait until a host thread releases it).
fn drain(queue: &Mutex<StreamQueue>, upto: u64) {
    loop {
        run_until(queue, upto);
        if lock(queue).completed >= upto {
            return;
        }
        std::thread::sleep(std::time::Duration::from_micros(20));
    }
}

/// Runs queued work of `queue` up to sequence number `upto`.
fn run_until(queue: &Mutex<StreamQueue>, upto: u64) {
    loop {
        let mut q = lock(queue);
        if q.completed >= upto {
            return;
        }
        let Some((seq, work)) = q.pending.pop_front() else {
            return;
        };
        match work {
            Work::Copy(pieces) => {
                for (dst, src, len) in pieces {
                    // SAFETY: both ranges were checked to lie in live memory
                    // when queued, and the caller of the unsafe copy promised
                    // they stay valid until completion; `copy` allows overlap.
                    unsafe { std::ptr::copy(src.ptr, dst.ptr, len) }
                }
            }
            Work::Fill { dst, value } => {
                for span in dst {
                    // SAFETY: as for copies.
                    unsafe { std::ptr::write_bytes(span.at.ptr, value, span.len) }
                }
            }
            Work::Wait { queue: other, upto } => {
                // Another stream's lock is taken with ours released, so two
                // streams waiting on each other cannot deadlock here.
                drop(q);
                run_until(&other, upto);
                let blocked = lock(&other).completed < upto;
                q = lock(queue);
                if blocked {
                    // The other stream is itself blocked (a value wait):
                    // this one stays blocked behind it.
                    q.pending
                        .push_front((seq, Work::Wait { queue: other, upto }));
                    return;
                }
            }
            Work::WaitValue { at, value } => {
                // CUDA's GEQ: `(int32_t)(*addr - value) >= 0`, a wrapping
                // comparison (a word far "below" the value passes).
                let now = word(&at).load(Ordering::Acquire);
                if (now.wrapping_sub(value) as i32) < 0 {
                    q.pending.push_front((seq, Work::WaitValue { at, value }));
                    return;
                }
            }
            Work::WriteValue { at, value } => word(&at).store(value, Ordering::Release),
        }
        q.completed = seq;
    }
}

/// What a new pinned allocation holds: not zero (see `alloc_pinned`); as a
/// 32-bit word, "ahead" of small values by CUDA's wrapping comparison.
const NOT_ZEROED: u8 = 0x3c;

/// A simulated stream.
#[derive(Debug)]
pub struct SimStream {
    ctx: SimGpuContext,
    queue: Arc<Mutex<StreamQueue>>,
    /// Held by every handle of the stream (its owner's and borrowers').
    _handle: Arc<()>,
}

impl SimStream {
    fn enqueue(&self, operation: &'static str, work: Work) -> Result<()> {
        // Copies and fills wait behind a free; stream memory operations do
        // not (see `ProcessState::driver`).
        let _driver = match work {
            Work::WaitValue { .. } | Work::WriteValue { .. } => None,
            _ => Some(self.ctx.process.behind_frees()),
        };
        check_alive(&self.ctx.gpu, operation)?;
        self.ctx
            .process
            .fault(FaultSite::CudaCopy, &self.ctx.gpu, operation)?;
        let mut q = lock(&self.queue);
        q.enqueued += 1;
        let seq = q.enqueued;
        q.pending.push_back((seq, work));
        Ok(())
    }

    /// A copy's host endpoint: refused (and reported) in freed pinned
    /// memory; keeping this process's pinned mapping it lies in, if any,
    /// until the copy has run (as `cuMemFreeHost` waits for it).
    fn host(&self, ptr: *const u8, len: usize, operation: &'static str) -> Result<Resolved> {
        if ptr.is_null() && len > 0 {
            return Err(CudaError::invalid(operation, "null host pointer"));
        }
        let at = ptr as u64;
        if let Some(report) = memory::use_after_free(operation, at, len, at) {
            return Err(use_after_free_error(report));
        }
        let pinned = lock(&self.ctx.process.pinned);
        let mapping = pinned
            .range(..=at)
            .next_back()
            .filter(|&(&start, range)| at < start + range.len as u64)
            .and_then(|(_, range)| range.mapping.upgrade());
        Ok(Resolved {
            ptr: ptr.cast_mut(),
            _keep: mapping.map(|m| Keep::Pinned { _mapping: m }),
        })
    }
}

impl hal_cuda::Stream<SimCudaApi> for SimStream {
    unsafe fn copy_host_to_device(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        const OP: &str = "cuMemcpyHtoDAsync";
        let dst = self.ctx.device_spans(dst, len, OP)?;
        let src = self.host(src, len, OP)?;
        self.enqueue(OP, Work::Copy(pair(dst, vec![Span { at: src, len }])))
    }

    unsafe fn copy_device_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        const OP: &str = "cuMemcpyDtoHAsync";
        let src = self.ctx.device_spans(src, len, OP)?;
        let dst = self.host(dst, len, OP)?;
        self.enqueue(OP, Work::Copy(pair(vec![Span { at: dst, len }], src)))
    }

    unsafe fn copy_device_to_device(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        const OP: &str = "cuMemcpyDtoDAsync";
        let dst = self.ctx.device_spans(dst, len, OP)?;
        let src = self.ctx.device_spans(src, len, OP)?;
        self.enqueue(OP, Work::Copy(pair(dst, src)))?;
        self.ctx.gpu.device_copies.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    unsafe fn memset(&self, dst: u64, value: u8, len: usize) -> Result<()> {
        const OP: &str = "cuMemsetD8Async";
        let dst = self.ctx.device_spans(dst, len, OP)?;
        self.enqueue(OP, Work::Fill { dst, value })
    }

    fn record(&self, event: &SimEvent) -> Result<()> {
        let _driver = self.ctx.process.behind_frees();
        check_alive(&self.ctx.gpu, "cuEventRecord")?;
        let upto = lock(&self.queue).enqueued;
        *lock(&event.recorded) = Some((Arc::clone(&self.queue), upto));
        Ok(())
    }

    fn wait(&self, event: &SimEvent) -> Result<()> {
        check_alive(&self.ctx.gpu, "cuStreamWaitEvent")?;
        let Some((queue, upto)) = lock(&event.recorded).clone() else {
            // Waiting on a never-recorded event is a no-op in CUDA too.
            return Ok(());
        };
        let mut q = lock(&self.queue);
        q.enqueued += 1;
        let seq = q.enqueued;
        q.pending.push_back((seq, Work::Wait { queue, upto }));
        Ok(())
    }

    unsafe fn wait_value32(&self, addr: u64, value: u32) -> Result<()> {
        const OP: &str = "cuStreamWaitValue32";
        self.ctx
            .process
            .fault(FaultSite::CudaStreamMemOp, &self.ctx.gpu, OP)?;
        let at = self.value_word(addr, OP)?;
        self.enqueue(OP, Work::WaitValue { at, value })
    }

    unsafe fn write_value32(&self, addr: u64, value: u32) -> Result<()> {
        const OP: &str = "cuStreamWriteValue32";
        self.ctx
            .process
            .fault(FaultSite::CudaStreamMemOp, &self.ctx.gpu, OP)?;
        let at = self.value_word(addr, OP)?;
        self.enqueue(OP, Work::WriteValue { at, value })
    }

    fn synchronize(&self) -> Result<()> {
        check_alive(&self.ctx.gpu, "cuStreamSynchronize")?;
        let upto = lock(&self.queue).enqueued;
        drain(&self.queue, upto);
        Ok(())
    }

    /// An opaque token, not a `CUstream` (no CUDA API accepts it): the
    /// address of the stream's queue, distinct for each live stream and
    /// never NULL.
    fn raw(&self) -> *mut std::ffi::c_void {
        Arc::as_ptr(&self.queue).cast_mut().cast()
    }
}

impl SimStream {
    /// The word of a stream memory operation: 4-byte aligned, in device
    /// memory of this GPU or in host memory.
    fn value_word(&self, addr: u64, operation: &'static str) -> Result<Resolved> {
        if !addr.is_multiple_of(4) {
            return Err(CudaError::invalid(operation, "address not 4-byte aligned"));
        }
        // The device window is never host memory (a freed word there is
        // reported by the device lookup).
        if memory::is_device_address(addr) {
            self.ctx.device_range(addr, 4, operation)
        } else {
            self.host(addr as *const u8, 4, operation)
        }
    }
}

/// A simulated event.
#[derive(Debug)]
pub struct SimEvent {
    recorded: Mutex<Option<(Arc<Mutex<StreamQueue>>, u64)>>,
    paused: Arc<ProcessState>,
    /// A lost GPU fails queries, as a failed context does.
    gpu: Arc<SimGpu>,
}

impl hal_cuda::Event for SimEvent {
    fn is_complete(&self) -> Result<bool> {
        check_alive(&self.gpu, "cuEventQuery")?;
        let Some((queue, upto)) = lock(&self.recorded).clone() else {
            return Ok(true);
        };
        if !self.paused.paused.load(Ordering::SeqCst) {
            run_until(&queue, upto);
        }
        Ok(lock(&queue).completed >= upto)
    }

    fn synchronize(&self) -> Result<()> {
        if let Some((queue, upto)) = lock(&self.recorded).clone() {
            run_until(&queue, upto);
        }
        Ok(())
    }
}

/// Simulated device memory; freed on drop (its address quarantined, or
/// made reusable: [`GpuConfig::reuse_freed_addresses`]).
#[derive(Debug)]
pub struct SimDeviceMemory {
    range: Arc<DeviceRange>,
    gpu: Arc<SimGpu>,
    process: Arc<ProcessState>,
}

impl SimDeviceMemory {
    /// The CUDA buffer id of the allocation.
    pub fn buffer_id(&self) -> u64 {
        self.range.buffer_id
    }
}

impl hal_cuda::DeviceMemory for SimDeviceMemory {
    fn device_ptr(&self) -> u64 {
        self.range.base
    }

    fn len(&self) -> usize {
        self.range.len
    }
}

impl Drop for SimDeviceMemory {
    fn drop(&mut self) {
        let _driver = self.process.synchronize_for_free();
        memory::unmap(self.range.base, "cuMemFree");
        // Closes the export's fd: other OS processes can no longer open it.
        lock(&IPC_EXPORTS).remove(&self.range.buffer_id);
        self.gpu
            .used
            .fetch_sub(self.range.len as u64, Ordering::SeqCst);
    }
}

/// Simulated pinned host memory; freed on drop (quarantined: see
/// [`memory`]).
#[derive(Debug)]
pub struct SimPinnedHostMemory {
    mapping: Arc<PinnedMapping>,
    process: Arc<ProcessState>,
}

impl hal_cuda::PinnedHostMemory for SimPinnedHostMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.mapping.start() as *mut u8
    }

    fn len(&self) -> usize {
        self.mapping.map.as_ref().map_or(0, MmapRaw::len)
    }
}

impl Drop for SimPinnedHostMemory {
    fn drop(&mut self) {
        let _driver = self.process.synchronize_for_free();
        // Freed for CUDA now; the mapping goes with its last queued copy.
        lock(&self.process.pinned).remove(&self.mapping.start());
    }
}

/// The mapping behind `cuMemHostAlloc` memory, held by the memory and by
/// the copies queued on it. When the last holder goes, it is quarantined
/// (made inaccessible, its addresses kept from reuse: [`memory`]), or
/// unmapped where its GPU reuses freed addresses.
#[derive(Debug)]
struct PinnedMapping {
    /// `None` only while dropped.
    map: Option<MmapRaw>,
    buffer_id: u64,
    process: u64,
    gpu: Arc<SimGpu>,
}

impl PinnedMapping {
    fn start(&self) -> u64 {
        self.map.as_ref().map_or(0, |m| m.as_mut_ptr() as u64)
    }
}

impl Drop for PinnedMapping {
    fn drop(&mut self) {
        let Some(map) = self.map.take() else {
            return;
        };
        let ptr = map.as_mut_ptr();
        let freed = FreedAllocation {
            buffer_id: self.buffer_id,
            base: ptr as u64,
            len: map.len(),
            ordinal: self.gpu.ordinal,
            process: self.process,
            freed_by: "cuMemFreeHost",
        };
        // SAFETY: `map` is this value's own private anonymous mapping of
        // `map.len()` bytes; on success it is forgotten (never unmapped by
        // it). The memory and every copy that held it are gone: whatever
        // still has its address (a stale pointer, an MR) is a use after
        // free, which the inaccessible reservation makes fault.
        if unsafe { memory::quarantine_host(&self.gpu.allocator, ptr, freed) } {
            std::mem::forget(map);
        }
    }
}

/// Simulated `cuMemHostRegister` of caller memory.
#[derive(Debug)]
pub struct SimHostRegistration {
    ptr: *mut u8,
    len: usize,
    process: Arc<ProcessState>,
}

// SAFETY: only the address is held; the memory belongs to the caller.
unsafe impl Send for SimHostRegistration {}
// SAFETY: as above.
unsafe impl Sync for SimHostRegistration {}

impl hal_cuda::HostRegistration for SimHostRegistration {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for SimHostRegistration {
    fn drop(&mut self) {
        let _driver = self.process.synchronize_for_free();
        lock(&self.process.pinned).remove(&(self.ptr as u64));
    }
}

/// Another process's allocation mapped through IPC; unmapped on drop.
#[derive(Debug)]
pub struct SimIpcMapping {
    range: Arc<DeviceRange>,
}

impl hal_cuda::IpcMapping for SimIpcMapping {
    fn device_ptr(&self) -> u64 {
        self.range.base
    }

    fn len(&self) -> usize {
        self.range.len
    }
}

impl Drop for SimIpcMapping {
    fn drop(&mut self) {
        memory::unmap(self.range.base, "cuIpcCloseMemHandle");
        // Had the mapping been exported again, its handles die with it.
        lock(&IPC_EXPORTS).remove(&self.range.buffer_id);
    }
}

#[derive(Debug)]
struct Reservation {
    base: u64,
    len: usize,
}

/// A simulated `cuMemAddressReserve` range. Its addresses are never handed
/// out again (see [`memory`]), so dropping it needs no bookkeeping; mappings
/// keep it alive anyway, as the real backend's do.
#[derive(Debug)]
pub struct SimVirtualReservation {
    inner: Arc<Reservation>,
}

impl hal_cuda::VirtualReservation for SimVirtualReservation {
    fn base(&self) -> u64 {
        self.inner.base
    }

    fn len(&self) -> usize {
        self.inner.len
    }
}

#[derive(Debug)]
struct Physical {
    backing: Option<Arc<Backing>>,
    len: usize,
    gpu_direct_rdma_capable: bool,
    gpu: Arc<SimGpu>,
}

impl Drop for Physical {
    fn drop(&mut self) {
        self.gpu.used.fetch_sub(self.len as u64, Ordering::SeqCst);
    }
}

/// Simulated `cuMemCreate` memory: released (its bytes no longer counted)
/// when it and every mapping of it are dropped.
#[derive(Debug)]
pub struct SimPhysicalMemory {
    inner: Arc<Physical>,
}

impl hal_cuda::PhysicalMemory for SimPhysicalMemory {
    fn len(&self) -> usize {
        self.inner.len
    }

    fn gpu_direct_rdma_capable(&self) -> bool {
        self.inner.gpu_direct_rdma_capable
    }
}

/// Simulated `cuMemMap`: a device range with a buffer id of its own,
/// unmapped on drop; it keeps its reservation and physical memory alive.
#[derive(Debug)]
pub struct SimVirtualMapping {
    range: Arc<DeviceRange>,
    _reservation: Arc<Reservation>,
    _physical: Arc<Physical>,
}

impl SimVirtualMapping {
    /// The buffer id the mapping has.
    pub fn buffer_id(&self) -> u64 {
        self.range.buffer_id
    }
}

impl hal_cuda::VirtualMapping for SimVirtualMapping {
    fn device_ptr(&self) -> u64 {
        self.range.base
    }

    fn len(&self) -> usize {
        self.range.len
    }
}

impl Drop for SimVirtualMapping {
    fn drop(&mut self) {
        memory::unmap(self.range.base, "cuMemUnmap");
    }
}

#[cfg(test)]
mod tests {
    use hal_cuda::{Context, DeviceMemory, Driver};

    use super::*;

    /// The handle of a fresh allocation (kept alive by the returned memory).
    fn exported(len: usize) -> (SimDeviceMemory, SimIpcHandle) {
        let driver = SimCuda::new(vec![GpuConfig::default()], FaultPlan::new());
        let ctx = driver.context(0).unwrap();
        let mem = ctx.alloc(len).unwrap();
        let handle = SimIpcHandle::decode(&ctx.ipc_export(mem.device_ptr()).unwrap()).unwrap();
        (mem, handle)
    }

    #[test]
    fn handle_round_trips_and_names_the_export_fd() {
        let (mem, handle) = exported(8192);
        assert_eq!(SimIpcHandle::decode(&handle.encode()), Some(handle));
        assert_eq!(handle.os_pid, std::process::id());
        assert_eq!(handle.len, 8192);
        assert_eq!(handle.tag, mem.range.backing.tag());
        // Reopened as another OS process would (through /proc), the same bytes.
        let adopted = open_foreign(&handle).unwrap();
        // SAFETY: both mappings are 8192 bytes long and live here.
        unsafe { mem.range.backing.as_ptr().add(100).write(0xab) };
        // SAFETY: as above.
        assert_eq!(unsafe { adopted.as_ptr().add(100).read() }, 0xab);
    }

    #[test]
    fn foreign_open_checks_size_and_liveness() {
        let (mem, handle) = exported(8192);
        let wrong_size = SimIpcHandle {
            len: 4096,
            ..handle
        };
        let err = open_foreign(&wrong_size).unwrap_err();
        assert!(err.contains("holds 8192 bytes"), "{err}");
        drop(mem);
        // The export fd is closed (or its number reused by another file).
        let err = open_foreign(&handle).unwrap_err();
        assert!(err.contains("freed"), "{err}");
        let closed = SimIpcHandle {
            fd: i32::MAX,
            ..handle
        };
        let err = open_foreign(&closed).unwrap_err();
        assert!(err.contains("cannot open"), "{err}");
    }
}
