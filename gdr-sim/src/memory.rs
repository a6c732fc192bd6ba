//! The simulated GPUs' device address space, shared with the simulated NIC.
//!
//! Device memory lives in its own window of addresses that the CPU cannot
//! dereference (they are non-canonical on x86-64, so a stray host access
//! faults at once, as it would on real device memory). Each allocation is
//! backed by a memfd mapped into this process: the memfd is what dma-buf
//! export hands out and what an IPC open maps again (in this OS process, or
//! reopened through `/proc` in another: see [`crate::gpu`]), so every view of
//! an allocation (device address, dma-buf MR, IPC mapping) sees the same
//! bytes.
//!
//! The window is process-wide, like CUDA's unified address space; every
//! simulated "process" takes its addresses from it, so addresses never
//! collide between them.
//!
//! ## Freed memory: quarantine and use-after-free reports
//!
//! A freed device range (`cuMemFree`, `cuMemUnmap`, `cuIpcCloseMemHandle`)
//! is not handed out again: it goes into the quarantine of its GPU, at most
//! [`QUARANTINE_RECORDS`] records per GPU (past that the oldest are
//! forgotten, and their addresses are still never reused: the window holds
//! 3 × 2^60 bytes). Every simulated access by address into a quarantined
//! range (a copy, a memset, a stream memory operation, a dma-buf or IPC
//! export, an `ibv_reg_mr`) fails as real CUDA fails for a freed pointer
//! (`CUDA_ERROR_INVALID_VALUE`, nothing sticky) and is recorded as a
//! [`UseAfterFree`] on the GPU that freed it
//! ([`crate::SimCuda::use_after_free_reports`]). So a use after free is
//! caught whether or not the address was allocated again and whether or
//! not anyone reads the bytes, and tests running in parallel in one process
//! each see their own GPUs' reports. Queries (pointer attributes,
//! `cuMemGetAddressRange`) of a freed address fail without a report.
//!
//! A GPU configured with [`crate::GpuConfig::reuse_freed_addresses`] frees
//! as CUDA's allocator does instead: its freed bases go to last-in
//! first-out lists (per reserved size) of its own, and its next allocation
//! of a size takes the last address freed with a new buffer id, which is
//! what stale-registration tests need. A free follows the setting of the
//! GPU the range belongs to (for an IPC mapping, the GPU of the importing
//! process it was opened on), whoever frees it; GPUs never take each
//! other's freed addresses.
//!
//! CUDA VMM: an unmapped chunk is quarantined the same way until `cuMemMap`
//! maps memory there again (the caller names that address: the
//! reservation's own reuse). Host-visible allocations
//! ([`crate::GpuConfig::host_visible`]) have addresses the kernel gave:
//! they are neither quarantined nor reused on purpose.
//!
//! Freed pinned host memory (`cuMemHostAlloc`'s) is not unmapped: its pages
//! are replaced by an inaccessible (`PROT_NONE`) reservation, kept in a
//! quarantine of its own ([`PINNED_QUARANTINE_RECORDS`] per GPU, each one a
//! kernel mapping). Meanwhile the kernel cannot hand the addresses to
//! another mapping, a CPU or NIC access through a stale pointer faults at
//! once (`SIGSEGV`), and a CUDA copy, `cuMemHostRegister` or `ibv_reg_mr`
//! naming them fails and is reported. A forgotten record is unmapped. The
//! swap waits for CUDA copies queued on the memory before its free (what
//! `cuMemFreeHost` waits for), not for MRs over it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::BuildHasher;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError, RwLock, Weak};

use memmap2::MmapRaw;

/// First address of the simulated device window.
pub const DEVICE_WINDOW_START: u64 = 0xd000_0000_0000_0000;
/// Granularity of device allocations (as cuMemAlloc's, 2 MiB).
pub const DEVICE_ALLOCATION_GRANULARITY: u64 = 2 << 20;
/// How many freed device ranges one GPU keeps in quarantine; past it the
/// oldest records are forgotten (accesses there fail as to any unmapped
/// address, unreported), their addresses still never reused.
pub const QUARANTINE_RECORDS: usize = 4096;
/// How many freed pinned host allocations one GPU keeps quarantined (each
/// holds a `PROT_NONE` mapping, so a kernel VMA, until forgotten).
pub const PINNED_QUARANTINE_RECORDS: usize = 256;
/// How many [`UseAfterFree`] reports one GPU keeps: the first ones, since
/// the first use after free is the one to explain (all are counted).
pub const USE_AFTER_FREE_REPORTS_KEPT: usize = 256;

/// True for simulated device memory: an address in the device window, or
/// inside a host-visible device allocation (see [`crate::GpuConfig::host_visible`]).
pub fn is_device_address(addr: u64) -> bool {
    addr >= DEVICE_WINDOW_START || lookup(addr).is_some()
}

/// Host memory backing one device allocation: a memfd and its mapping.
///
/// The memfd is named `gdr-sim-gpu:<tag>` with a random 64-bit tag, which an
/// IPC handle carries too: another OS process that reopens the memfd through
/// `/proc` checks the name, so a stale fd number (reused by then for another
/// file) is refused rather than mapped.
#[derive(Debug)]
pub struct Backing {
    memfd: OwnedFd,
    map: MmapRaw,
    tag: u64,
}

/// The prefix of every backing memfd's name.
const MEMFD_NAME: &str = "gdr-sim-gpu";

impl Backing {
    /// A zero-filled backing of `len` bytes.
    pub(crate) fn new(len: usize) -> std::io::Result<Self> {
        let tag = random_tag();
        let memfd = rustix::fs::memfd_create(
            format!("{MEMFD_NAME}:{tag:016x}"),
            rustix::fs::MemfdFlags::CLOEXEC,
        )?;
        rustix::fs::ftruncate(&memfd, len as u64)?;
        let map = MmapRaw::map_raw(&std::fs::File::from(memfd.try_clone()?))?;
        Ok(Self { memfd, map, tag })
    }

    /// The backing another OS process made: `memfd` (reopened through
    /// `/proc`) mapped shared, if it is a simulated GPU's memfd named with
    /// `tag` and exactly `len` bytes long; why not otherwise.
    pub(crate) fn adopt(memfd: OwnedFd, len: usize, tag: u64) -> Result<Self, String> {
        // What is open, not what the path named before it was opened (the
        // exporter may have closed and reused the fd number in between).
        let link = format!("/proc/self/fd/{}", memfd.as_raw_fd());
        let name = std::fs::read_link(&link).map_err(|e| format!("readlink {link}: {e}"))?;
        check_memfd_name(&name, tag)?;
        let size = rustix::fs::fstat(&memfd)
            .map_err(|e| format!("fstat: {e}"))?
            .st_size;
        if u64::try_from(size).ok() != Some(len as u64) {
            return Err(format!(
                "the memfd holds {size} bytes, the handle says {len}"
            ));
        }
        let map = MmapRaw::map_raw(&std::fs::File::from(
            memfd.try_clone().map_err(|e| format!("dup: {e}"))?,
        ))
        .map_err(|e| format!("mmap: {e}"))?;
        Ok(Self { memfd, map, tag })
    }

    /// The random tag in the memfd's name.
    pub fn tag(&self) -> u64 {
        self.tag
    }

    /// The memfd (what a dma-buf export duplicates).
    pub fn memfd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.memfd.as_fd()
    }

    /// Host pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True for an empty backing (never made).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What the NIC-facing side knows about one mapped device range.
#[derive(Debug)]
pub struct DeviceRange {
    /// First device address.
    pub base: u64,
    /// Length in bytes.
    pub len: usize,
    /// The CUDA buffer id of the allocation (a mapping through IPC has its own).
    pub buffer_id: u64,
    /// The owning simulated GPU's ordinal.
    pub ordinal: u32,
    /// The simulated process (driver instance) that mapped it.
    pub process: u64,
    /// Whether the node's kernel has a peer-memory client for this GPU
    /// (nvidia-peermem): then `ibv_reg_mr` on the device address works.
    pub peermem: bool,
    /// The host memory behind it.
    pub backing: Arc<Backing>,
    /// For memory mapped with `cuMemMap` (CUDA VMM), not allocated with
    /// `cuMemAlloc`: the reserved range `(base, len)` it was mapped into.
    /// Its address is not recycled by the allocator when unmapped (the
    /// reservation owns it).
    pub reservation: Option<(u64, u64)>,
    /// False for VMM memory created without `gpuDirectRDMACapable` (its
    /// `IS_GPU_DIRECT_RDMA_CAPABLE` reads 0).
    pub gpu_direct_rdma_capable: bool,
    /// The GPU's allocator, whose setting the range's free follows.
    owner: Arc<GpuAllocator>,
}

/// One access by address to memory that was freed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UseAfterFree {
    /// The call that made the access (`cuMemcpyHtoDAsync`, `ibv_reg_mr`, ...).
    pub operation: &'static str,
    /// First byte the access named.
    pub addr: u64,
    /// Bytes it named (the freed allocation holds some of them).
    pub len: usize,
    /// The freed allocation it reached.
    pub freed: FreedAllocation,
}

impl std::fmt::Display for UseAfterFree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            operation,
            addr,
            len,
            freed,
        } = self;
        write!(
            f,
            "use after free: {operation} of {len} bytes at {addr:#x} reaches buffer {} \
             ({} bytes at {:#x} on GPU {}), freed by {}",
            freed.buffer_id, freed.len, freed.base, freed.ordinal, freed.freed_by
        )
    }
}

/// What a quarantine record remembers of a freed allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreedAllocation {
    /// Its CUDA buffer id.
    pub buffer_id: u64,
    /// Its first address.
    pub base: u64,
    /// Its length in bytes.
    pub len: usize,
    /// The ordinal of the GPU it belonged to.
    pub ordinal: u32,
    /// The simulated process that had it mapped.
    pub process: u64,
    /// The call that freed it (`cuMemFree`, `cuMemUnmap`, ...).
    pub freed_by: &'static str,
}

/// One simulated GPU's part in the address space, shared by every process
/// that sees the GPU: where its frees go (the quarantine, or its own free
/// lists), its quarantine records, and the uses after free found in them.
///
/// The space's index names the allocator weakly; dropping the allocator
/// removes its records from the index. It must therefore never be dropped
/// while [`SPACE`] is locked: no `Arc<GpuAllocator>` goes out of scope
/// inside a critical section of the space (see `Pending`).
#[derive(Debug)]
pub(crate) struct GpuAllocator {
    ordinal: u32,
    reuse_freed_addresses: bool,
    state: Mutex<AllocatorState>,
}

#[derive(Debug, Default)]
struct AllocatorState {
    /// Freed bases by reserved size, reused last-in first-out as CUDA's
    /// allocator does (only under `reuse_freed_addresses`).
    free_bases: HashMap<u64, Vec<u64>>,
    /// The quarantine records in the space's index, oldest first: each
    /// `(first address, record number)`.
    quarantined: VecDeque<(u64, u64)>,
    /// Records forgotten past [`QUARANTINE_RECORDS`].
    forgotten: u64,
    /// The pinned host records in the space's index, oldest first, each
    /// with the reservation it keeps.
    pinned: VecDeque<(u64, u64, HostReservation)>,
    /// The first [`USE_AFTER_FREE_REPORTS_KEPT`] reports.
    reports: Vec<UseAfterFree>,
    /// Every report.
    reported: u64,
}

impl GpuAllocator {
    /// The allocator of GPU `ordinal`.
    pub(crate) fn new(ordinal: u32, reuse_freed_addresses: bool) -> Arc<Self> {
        Arc::new(Self {
            ordinal,
            reuse_freed_addresses,
            state: Mutex::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, AllocatorState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The reports kept (the first [`USE_AFTER_FREE_REPORTS_KEPT`]).
    pub(crate) fn reports(&self) -> Vec<UseAfterFree> {
        self.lock().reports.clone()
    }

    /// How many uses after free were reported in all.
    pub(crate) fn reported(&self) -> u64 {
        self.lock().reported
    }

    /// `(records held, records forgotten)`.
    #[cfg(test)]
    pub(crate) fn quarantine_len(&self) -> (usize, u64) {
        let state = self.lock();
        (state.quarantined.len(), state.forgotten)
    }

    /// Pinned host records held.
    #[cfg(test)]
    pub(crate) fn pinned_quarantine_len(&self) -> usize {
        self.lock().pinned.len()
    }

    fn record(&self, report: UseAfterFree) {
        let mut state = self.lock();
        state.reported += 1;
        if state.reports.len() < USE_AFTER_FREE_REPORTS_KEPT {
            state.reports.push(report);
        }
    }
}

impl Drop for GpuAllocator {
    fn drop(&mut self) {
        // Nobody can report to this GPU any more: its records go, so the
        // index stays bounded by the live GPUs' quarantines.
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        let mut space = SPACE.write().unwrap_or_else(PoisonError::into_inner);
        for &(base, seq) in &state.quarantined {
            space.forget(base, seq);
        }
        for &(base, seq, _) in &state.pinned {
            space.forget(base, seq);
        }
        // The reservations are unmapped after this, with the state: their
        // records are gone from the index by then.
    }
}

/// An inaccessible (`PROT_NONE`) mapping held over freed pinned host
/// memory, so the kernel does not reuse its addresses; unmapped on drop.
#[derive(Debug)]
struct HostReservation {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the value owns the reservation (nothing else unmaps or touches
// it); moving or sharing it moves only the address.
unsafe impl Send for HostReservation {}
// SAFETY: as above; `&HostReservation` exposes nothing.
unsafe impl Sync for HostReservation {}

impl Drop for HostReservation {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours (see `quarantine_host`), unmapped
        // once, here; nothing can be using it (PROT_NONE).
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) } {
            tracing::warn!(error = %e, "sim: munmap of a quarantined pinned range");
        }
    }
}

/// Quarantines freed pinned host memory, `freed.len` bytes at `ptr`, for
/// `owner`'s GPU: replaces its pages with an inaccessible reservation that
/// the quarantine keeps (and unmaps when it forgets it). False where the
/// GPU reuses freed addresses or the kernel refused the reservation: the
/// caller then unmaps the memory as before.
///
/// # Safety
///
/// `ptr..ptr + freed.len` is a private anonymous mapping the caller owns
/// and gives up on `true`: it must neither unmap it nor let anything access
/// it any more.
pub(crate) unsafe fn quarantine_host(
    owner: &Arc<GpuAllocator>,
    ptr: *mut u8,
    freed: FreedAllocation,
) -> bool {
    use rustix::mm::{MapFlags, ProtFlags};
    if owner.reuse_freed_addresses {
        return false;
    }
    let len = freed.len;
    // SAFETY: MAP_FIXED over the caller's own mapping (the contract), which
    // is replaced at once, whole: nothing else of the process is there.
    let remapped = unsafe {
        rustix::mm::mmap_anonymous(
            ptr.cast(),
            len,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
        )
    };
    if let Err(e) = remapped {
        tracing::warn!(error = %e, "sim: pinned memory freed without quarantine");
        return false;
    }
    let reservation = HostReservation { ptr, len };
    let mut space = SPACE.write().unwrap_or_else(PoisonError::into_inner);
    let seq = space.next_seq;
    space.next_seq += 1;
    let base = ptr as u64;
    space.quarantine.insert(
        base,
        Freed {
            end: base + len as u64,
            seq,
            freed,
            owner: Arc::downgrade(owner),
        },
    );
    let mut state = owner.lock();
    state.pinned.push_back((base, seq, reservation));
    while state.pinned.len() > PINNED_QUARANTINE_RECORDS {
        let Some((base, seq, oldest)) = state.pinned.pop_front() else {
            break;
        };
        // Out of the index before its addresses can be mapped again.
        space.forget(base, seq);
        drop(oldest);
        state.forgotten += 1;
    }
    true
}

/// A quarantine record: a freed range, or what is left of it after
/// `cuMemMap` mapped memory over part of it.
#[derive(Debug)]
struct Freed {
    /// One past its last byte.
    end: u64,
    /// Its number (the allocator's list names records by base and number).
    seq: u64,
    freed: FreedAllocation,
    owner: Weak<GpuAllocator>,
}

#[derive(Default)]
struct Space {
    ranges: BTreeMap<u64, Arc<DeviceRange>>,
    next_base: u64,
    /// Quarantined ranges by first address.
    quarantine: BTreeMap<u64, Freed>,
    next_seq: u64,
}

impl Space {
    /// The quarantine record holding `addr`.
    fn freed(&self, addr: u64) -> Option<&Freed> {
        let (_, record) = self.quarantine.range(..=addr).next_back()?;
        (addr < record.end).then_some(record)
    }

    /// Removes record `seq` at `base`, if it is still there.
    fn forget(&mut self, base: u64, seq: u64) {
        if self.quarantine.get(&base).is_some_and(|r| r.seq == seq) {
            self.quarantine.remove(&base);
        }
    }

    /// Quarantines `range` (just unmapped) for its GPU, forgetting the
    /// GPU's oldest records past [`QUARANTINE_RECORDS`].
    fn quarantine(&mut self, range: &DeviceRange, freed_by: &'static str) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let owner = &range.owner;
        self.quarantine.insert(
            range.base,
            Freed {
                end: range.base + range.len as u64,
                seq,
                freed: FreedAllocation {
                    buffer_id: range.buffer_id,
                    base: range.base,
                    len: range.len,
                    ordinal: range.ordinal,
                    process: range.process,
                    freed_by,
                },
                owner: Arc::downgrade(owner),
            },
        );
        let mut state = owner.lock();
        state.quarantined.push_back((range.base, seq));
        while state.quarantined.len() > QUARANTINE_RECORDS {
            let Some((base, seq)) = state.quarantined.pop_front() else {
                break;
            };
            self.forget(base, seq);
            state.forgotten += 1;
        }
    }

    /// Lifts the quarantine from `base..end`, which `cuMemMap` maps again:
    /// records there are cut to what lies outside it. Allocators whose
    /// lists it touched are pushed to `pending`, to be dropped (if last)
    /// only once the space is unlocked.
    fn unquarantine(&mut self, base: u64, end: u64, pending: &mut Pending) {
        let hit: Vec<u64> = self
            .quarantine
            .range(..end)
            .rev()
            .take_while(|(_, r)| r.end > base)
            .map(|(&b, _)| b)
            .collect();
        for at in hit {
            let Some(record) = self.quarantine.remove(&at) else {
                continue;
            };
            let mut left = Vec::new();
            if at < base {
                left.push((at, base));
            }
            if record.end > end {
                left.push((end, record.end));
            }
            for &(from, to) in &left {
                self.quarantine.insert(
                    from,
                    Freed {
                        end: to,
                        seq: record.seq,
                        freed: record.freed,
                        owner: record.owner.clone(),
                    },
                );
            }
            let Some(owner) = record.owner.upgrade() else {
                continue;
            };
            {
                let mut state = owner.lock();
                if let Some(i) = state
                    .quarantined
                    .iter()
                    .position(|&e| e == (at, record.seq))
                {
                    state.quarantined.remove(i);
                    for (n, &(from, _)) in left.iter().enumerate() {
                        state.quarantined.insert(i + n, (from, record.seq));
                    }
                }
            }
            pending.0.push(owner);
        }
    }
}

/// Allocators a critical section of the space took a strong reference to:
/// declared before the lock guard, so dropped after it (see
/// [`GpuAllocator`]).
#[derive(Default)]
struct Pending(Vec<Arc<GpuAllocator>>);

static SPACE: LazyLock<RwLock<Space>> = LazyLock::new(|| {
    RwLock::new(Space {
        next_base: DEVICE_WINDOW_START,
        ..Space::default()
    })
});

static NEXT_BUFFER_ID: Mutex<u64> = Mutex::new(1);

/// A fresh, process-unique buffer id.
pub(crate) fn next_buffer_id() -> u64 {
    let mut next = NEXT_BUFFER_ID
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let id = *next;
    *next += 1;
    id
}

/// Checks that `name`, what `/proc/<pid>/fd/<fd>` links to, is a simulated
/// GPU's memfd tagged `tag`; why not otherwise.
pub(crate) fn check_memfd_name(name: &std::path::Path, tag: u64) -> Result<(), String> {
    // What the kernel shows for a memfd: "/memfd:<name> (deleted)".
    let expected = format!("/memfd:{MEMFD_NAME}:{tag:016x} (deleted)");
    if name.as_os_str() == expected.as_str() {
        Ok(())
    } else {
        Err(format!(
            "the fd is {}, not the simulated GPU memory tagged {tag:016x}",
            name.display()
        ))
    }
}

/// A random 64-bit value: std's randomly keyed SipHash of a counter (each
/// `RandomState` is keyed afresh), so tags are neither guessable nor repeated.
fn random_tag() -> u64 {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::hash::RandomState::new().hash_one((n, std::process::id()))
}

fn reserved_size(len: usize) -> u64 {
    (len as u64).div_ceil(DEVICE_ALLOCATION_GRANULARITY) * DEVICE_ALLOCATION_GRANULARITY
}

/// Maps `backing` at a device address for `owner`'s GPU (the last one that
/// GPU freed of the same size first, where it reuses addresses) and returns
/// the new range. A host-visible range is addressed by its backing's host
/// address instead, so a real NIC can register it.
pub(crate) fn map(
    owner: &Arc<GpuAllocator>,
    len: usize,
    process: u64,
    peermem: bool,
    host_visible: bool,
    backing: Arc<Backing>,
) -> Arc<DeviceRange> {
    let mut space = SPACE.write().unwrap_or_else(PoisonError::into_inner);
    let size = reserved_size(len);
    let base = if host_visible {
        backing.as_ptr() as u64
    } else {
        let reused = owner.lock().free_bases.get_mut(&size).and_then(Vec::pop);
        match reused {
            Some(base) => base,
            None => {
                let base = space.next_base;
                space.next_base += size;
                base
            }
        }
    };
    debug_assert!(
        host_visible || space.freed(base).is_none(),
        "a quarantined address handed out"
    );
    let range = Arc::new(DeviceRange {
        base,
        len,
        buffer_id: next_buffer_id(),
        ordinal: owner.ordinal,
        process,
        peermem,
        backing,
        reservation: None,
        gpu_direct_rdma_capable: true,
        owner: Arc::clone(owner),
    });
    space.ranges.insert(base, Arc::clone(&range));
    range
}

/// Reserves `len` bytes (a multiple of [`DEVICE_ALLOCATION_GRANULARITY`]) of
/// the device window for `cuMemAddressReserve`. Reserved addresses are never
/// handed out again, not even after the reservation is freed: the window is
/// far larger than any test needs.
pub(crate) fn reserve(len: u64) -> u64 {
    let mut space = SPACE.write().unwrap_or_else(PoisonError::into_inner);
    let base = space.next_base;
    space.next_base += len.div_ceil(DEVICE_ALLOCATION_GRANULARITY) * DEVICE_ALLOCATION_GRANULARITY;
    base
}

/// Maps `backing` at the fixed address `base` (`cuMemMap` into
/// `reservation`, its `(base, len)`), with a fresh buffer id, lifting any
/// quarantine there; `None` if any byte of `base..base+len` is mapped
/// already.
#[allow(clippy::too_many_arguments)] // one per field of the range
pub(crate) fn map_fixed(
    owner: &Arc<GpuAllocator>,
    reservation: (u64, u64),
    base: u64,
    len: usize,
    process: u64,
    peermem: bool,
    gpu_direct_rdma_capable: bool,
    backing: Arc<Backing>,
) -> Option<Arc<DeviceRange>> {
    let mut pending = Pending::default();
    let mut space = SPACE.write().unwrap_or_else(PoisonError::into_inner);
    let end = base + len as u64;
    let overlaps = space
        .ranges
        .range(..end)
        .next_back()
        .is_some_and(|(_, r)| r.base + r.len as u64 > base);
    if overlaps {
        return None;
    }
    space.unquarantine(base, end, &mut pending);
    let range = Arc::new(DeviceRange {
        base,
        len,
        buffer_id: next_buffer_id(),
        ordinal: owner.ordinal,
        process,
        peermem,
        backing,
        reservation: Some(reservation),
        gpu_direct_rdma_capable,
        owner: Arc::clone(owner),
    });
    space.ranges.insert(base, Arc::clone(&range));
    Some(range)
}

/// Unmaps the range at `base`, freed by the call `freed_by`: its address
/// goes into quarantine, or back to its GPU's free list where that GPU
/// reuses addresses (see the module docs).
pub(crate) fn unmap(base: u64, freed_by: &'static str) -> Option<Arc<DeviceRange>> {
    let mut space = SPACE.write().unwrap_or_else(PoisonError::into_inner);
    // Returned, so dropped (with its allocator, if last) once unlocked.
    let range = space.ranges.remove(&base)?;
    if base < DEVICE_WINDOW_START {
        // Host-visible: the kernel's address, neither ours to reuse nor to
        // keep from it.
    } else if !range.owner.reuse_freed_addresses {
        space.quarantine(&range, freed_by);
    } else if range.reservation.is_none() {
        // A VMM chunk's address is its reservation's: only cuMemMap there
        // maps it again.
        range
            .owner
            .lock()
            .free_bases
            .entry(reserved_size(range.len))
            .or_default()
            .push(base);
    }
    Some(range)
}

/// The mapped range containing `addr`, if any.
pub fn lookup(addr: u64) -> Option<Arc<DeviceRange>> {
    let space = SPACE.read().unwrap_or_else(PoisonError::into_inner);
    let (_, range) = space.ranges.range(..=addr).next_back()?;
    (addr < range.base + range.len as u64).then(|| Arc::clone(range))
}

/// A test's look at device memory: the `len` bytes at `addr`, inside one
/// mapped allocation, copied out directly (no stream, no fault site, no
/// use-after-free report). `None` when they are not mapped. The caller
/// makes sure nothing writes those bytes meanwhile.
pub fn peek(addr: u64, len: usize) -> Option<Vec<u8>> {
    let range = lookup(addr)?;
    let offset = (addr - range.base) as usize;
    if offset.checked_add(len)? > range.len {
        return None;
    }
    let mut out = vec![0; len];
    // SAFETY: offset + len lies inside the allocation (checked above) and
    // the backing is at least its length; the `Arc` keeps the backing
    // mapped while we copy; `out` is a separate allocation of `len` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(range.backing.as_ptr().add(offset), out.as_mut_ptr(), len);
    }
    Some(out)
}

/// The freed allocation whose quarantined range holds `addr`, if any (a
/// query: nothing is reported).
pub fn freed(addr: u64) -> Option<FreedAllocation> {
    let space = SPACE.read().unwrap_or_else(PoisonError::into_inner);
    space.freed(addr).map(|r| r.freed)
}

/// Checks an access by `operation` of `len` bytes at `addr` that `at` (one
/// of its bytes) found unmapped: if `at` is quarantined, the access is a
/// use after free, reported to the GPU that freed the memory and returned.
pub(crate) fn use_after_free(
    operation: &'static str,
    addr: u64,
    len: usize,
    at: u64,
) -> Option<UseAfterFree> {
    let (report, owner) = {
        let space = SPACE.read().unwrap_or_else(PoisonError::into_inner);
        let record = space.freed(at)?;
        let report = UseAfterFree {
            operation,
            addr,
            len,
            freed: record.freed,
        };
        // Moved out of the critical section before it can be dropped.
        (report, record.owner.upgrade())
    };
    tracing::warn!(%report, "sim: use after free");
    if let Some(owner) = owner {
        owner.record(report.clone());
    }
    Some(report)
}

/// Why the NIC cannot reach a range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NicAccessError {
    /// Device memory not mapped, or the range runs past its allocation.
    #[error("{len} bytes at {addr:#x} are not inside one device allocation")]
    NotMapped {
        /// Start.
        addr: u64,
        /// Length.
        len: usize,
    },
    /// Device memory, but no peer-memory client: the kernel cannot pin it.
    #[error("device memory at {addr:#x} cannot be pinned: no peer-memory client (nvidia-peermem)")]
    NoPeerMemory {
        /// Start.
        addr: u64,
    },
    /// Freed memory (quarantined): a use after free, reported.
    #[error("{0}")]
    Freed(Box<UseAfterFree>),
}

/// How the simulated NIC reaches `len` bytes at `addr` registered with
/// `ibv_reg_mr`: host addresses as they are, device addresses through their
/// backing (only where peermem is on). The returned `Arc` keeps the backing
/// alive as long as the registration, as a pinned page would be.
pub fn nic_view(addr: u64, len: usize) -> Result<(*mut u8, Option<Arc<Backing>>), NicAccessError> {
    let Some(range) = lookup(addr) else {
        if let Some(report) = use_after_free("ibv_reg_mr", addr, len, addr) {
            return Err(NicAccessError::Freed(Box::new(report)));
        }
        return if addr >= DEVICE_WINDOW_START {
            Err(NicAccessError::NotMapped { addr, len })
        } else {
            Ok((addr as *mut u8, None))
        };
    };
    let offset = addr - range.base;
    if offset + len as u64 > range.len as u64 {
        return Err(NicAccessError::NotMapped { addr, len });
    }
    if !range.peermem {
        return Err(NicAccessError::NoPeerMemory { addr });
    }
    // SAFETY: offset + len lies within the backing's mapping (checked above,
    // and the backing is at least range.len long).
    let ptr = unsafe { range.backing.as_ptr().add(offset as usize) };
    Ok((ptr, Some(Arc::clone(&range.backing))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_address_is_reused_with_a_new_buffer_id() {
        // The GPU's own free list: no other test takes from it.
        let gpu = GpuAllocator::new(0, true);
        let len = 5 << 20;
        let backing = Arc::new(Backing::new(len).unwrap());
        let first = map(&gpu, len, 1, true, false, Arc::clone(&backing));
        let (base, id) = (first.base, first.buffer_id);
        assert!(is_device_address(base));
        assert!(lookup(base + 100).is_some());
        unmap(base, "cuMemFree").unwrap();
        assert!(lookup(base).is_none());
        assert_eq!(freed(base), None, "not quarantined");
        let second = map(&gpu, len, 1, true, false, backing);
        assert_eq!(second.base, base, "the allocator reuses the freed address");
        assert_ne!(second.buffer_id, id);
        unmap(second.base, "cuMemFree");
    }

    #[test]
    fn the_quarantine_is_bounded_and_never_gives_an_address_back() {
        let gpu = GpuAllocator::new(0, false);
        let backing = Arc::new(Backing::new(4096).unwrap());
        let freed_bases: Vec<u64> = (0..QUARANTINE_RECORDS + 3)
            .map(|_| {
                let range = map(&gpu, 4096, 1, false, false, Arc::clone(&backing));
                unmap(range.base, "cuMemFree");
                range.base
            })
            .collect();
        assert_eq!(gpu.quarantine_len(), (QUARANTINE_RECORDS, 3));
        // The three oldest records are forgotten: an access there fails as
        // to any unmapped address, unreported.
        for &base in &freed_bases[..3] {
            assert_eq!(freed(base), None);
            assert!(use_after_free("test", base, 1, base).is_none());
        }
        assert!(freed_bases[3..].iter().all(|&b| freed(b).is_some()));
        assert_eq!(gpu.reported(), 0);
        // No freed address is handed out again, forgotten or not.
        let next = map(&gpu, 4096, 1, false, false, Arc::clone(&backing));
        assert!(!freed_bases.contains(&next.base));
        unmap(next.base, "cuMemFree");
        drop(next);

        // Reports: all counted, the first ones kept.
        let last = *freed_bases.last().unwrap();
        for i in 0..=USE_AFTER_FREE_REPORTS_KEPT {
            let report = use_after_free("test", last + i as u64, 1, last + i as u64).unwrap();
            assert_eq!(report.freed.base, last);
        }
        assert_eq!(gpu.reported(), USE_AFTER_FREE_REPORTS_KEPT as u64 + 1);
        let kept = gpu.reports();
        assert_eq!(kept.len(), USE_AFTER_FREE_REPORTS_KEPT);
        assert_eq!(kept[0].addr, last);

        // A GPU gone takes its records with it.
        drop(gpu);
        assert_eq!(freed(last), None);
    }

    #[test]
    fn the_pinned_quarantine_is_bounded_and_unmaps_what_it_forgets() {
        let gpu = GpuAllocator::new(0, false);
        let freed_bases: Vec<u64> = (0..PINNED_QUARANTINE_RECORDS + 2)
            .map(|i| {
                let map = memmap2::MmapMut::map_anon(4096).unwrap();
                let ptr = map.as_ptr().cast_mut();
                let freed = FreedAllocation {
                    buffer_id: i as u64,
                    base: ptr as u64,
                    len: 4096,
                    ordinal: 0,
                    process: 1,
                    freed_by: "cuMemFreeHost",
                };
                // SAFETY: `map` is ours and forgotten once quarantined.
                assert!(unsafe { quarantine_host(&gpu, ptr, freed) });
                std::mem::forget(map);
                ptr as u64
            })
            .collect();
        assert_eq!(gpu.pinned_quarantine_len(), PINNED_QUARANTINE_RECORDS);
        assert_eq!(gpu.quarantine_len().1, 2, "two forgotten");
        // Their addresses are the kernel's again (a later mapping of this
        // loop may well be there, under a record of its own; nothing else
        // is probed: another test's thread may map there).
        for (i, &base) in freed_bases[..2].iter().enumerate() {
            assert_ne!(freed(base).map(|f| f.buffer_id), Some(i as u64));
        }
        let last = *freed_bases.last().unwrap();
        assert_eq!(freed(last + 4095).map(|f| f.base), Some(last));
        drop(gpu);
        assert_eq!(freed(last), None, "unmapped with its GPU");

        // A GPU that reuses freed addresses does not quarantine.
        let reusing = GpuAllocator::new(0, true);
        let map = memmap2::MmapMut::map_anon(4096).unwrap();
        let freed = FreedAllocation {
            buffer_id: 0,
            base: map.as_ptr() as u64,
            len: 4096,
            ordinal: 0,
            process: 1,
            freed_by: "cuMemFreeHost",
        };
        // SAFETY: refused, so `map` stays ours (and is unmapped below).
        assert!(!unsafe { quarantine_host(&reusing, map.as_ptr().cast_mut(), freed) });
        drop(map);
    }

    #[test]
    fn nic_view_enforces_bounds_and_peermem() {
        let gpu = GpuAllocator::new(0, false);
        let backing = Arc::new(Backing::new(8192).unwrap());
        let with = map(&gpu, 8192, 7, true, false, Arc::clone(&backing));
        let without = map(&gpu, 8192, 7, false, false, Arc::clone(&backing));
        let (ptr, keep) = nic_view(with.base + 4096, 4096).unwrap();
        assert_eq!(ptr, backing.as_ptr().wrapping_add(4096));
        assert!(keep.is_some());
        assert!(matches!(
            nic_view(with.base + 4096, 4097),
            Err(NicAccessError::NotMapped { .. })
        ));
        assert!(matches!(
            nic_view(without.base, 16),
            Err(NicAccessError::NoPeerMemory { .. })
        ));
        let host = [0u8; 4];
        assert_eq!(
            nic_view(host.as_ptr() as u64, 4).unwrap().0,
            host.as_ptr() as *mut u8
        );
        unmap(with.base, "cuMemFree");
        unmap(without.base, "cuMemFree");
    }
}
