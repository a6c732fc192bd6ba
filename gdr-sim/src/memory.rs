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

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, LazyLock, Mutex, PoisonError, RwLock};

use memmap2::MmapRaw;

/// First address of the simulated device window.
pub const DEVICE_WINDOW_START: u64 = 0xd000_0000_0000_0000;
/// Granularity of device allocations (as cuMemAlloc's, 2 MiB).
pub const DEVICE_ALLOCATION_GRANULARITY: u64 = 2 << 20;

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
}

#[derive(Default)]
struct Space {
    ranges: BTreeMap<u64, Arc<DeviceRange>>,
    next_base: u64,
    /// Freed bases by reserved size, reused last-in first-out as CUDA's
    /// allocator does: this is what makes stale registrations possible.
    free_bases: HashMap<u64, Vec<u64>>,
}

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

/// Maps `backing` at a device address (reusing a freed one of the same size
/// first) and returns the new range. A host-visible range is addressed by
/// its backing's host address instead, so a real NIC can register it.
pub(crate) fn map(
    len: usize,
    ordinal: u32,
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
        match space.free_bases.get_mut(&size).and_then(Vec::pop) {
            Some(base) => base,
            None => {
                let base = space.next_base;
                space.next_base += size;
                base
            }
        }
    };
    let range = Arc::new(DeviceRange {
        base,
        len,
        buffer_id: next_buffer_id(),
        ordinal,
        process,
        peermem,
        backing,
        reservation: None,
        gpu_direct_rdma_capable: true,
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
/// `reservation`, its `(base, len)`), with a fresh buffer id; `None` if any
/// byte of `base..base+len` is mapped already.
#[allow(clippy::too_many_arguments)] // one per field of the range
pub(crate) fn map_fixed(
    reservation: (u64, u64),
    base: u64,
    len: usize,
    ordinal: u32,
    process: u64,
    peermem: bool,
    gpu_direct_rdma_capable: bool,
    backing: Arc<Backing>,
) -> Option<Arc<DeviceRange>> {
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
    let range = Arc::new(DeviceRange {
        base,
        len,
        buffer_id: next_buffer_id(),
        ordinal,
        process,
        peermem,
        backing,
        reservation: Some(reservation),
        gpu_direct_rdma_capable,
    });
    space.ranges.insert(base, Arc::clone(&range));
    Some(range)
}

/// Unmaps the range at `base`, making its address available again.
pub(crate) fn unmap(base: u64) -> Option<Arc<DeviceRange>> {
    let mut space = SPACE.write().unwrap_or_else(PoisonError::into_inner);
    let range = space.ranges.remove(&base)?;
    if base >= DEVICE_WINDOW_START && range.reservation.is_none() {
        space
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
}

/// How the simulated NIC reaches `len` bytes at `addr` registered with
/// `ibv_reg_mr`: host addresses as they are, device addresses through their
/// backing (only where peermem is on). The returned `Arc` keeps the backing
/// alive as long as the registration, as a pinned page would be.
pub fn nic_view(addr: u64, len: usize) -> Result<(*mut u8, Option<Arc<Backing>>), NicAccessError> {
    let Some(range) = lookup(addr) else {
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
        // A size class of its own: tests run in parallel and share the space.
        let len = 5 << 20;
        let backing = Arc::new(Backing::new(len).unwrap());
        let first = map(len, 0, 1, true, false, Arc::clone(&backing));
        let (base, id) = (first.base, first.buffer_id);
        assert!(is_device_address(base));
        assert!(lookup(base + 100).is_some());
        unmap(base).unwrap();
        assert!(lookup(base).is_none());
        let second = map(len, 0, 1, true, false, backing);
        assert_eq!(second.base, base, "the allocator reuses the freed address");
        assert_ne!(second.buffer_id, id);
        unmap(second.base);
    }

    #[test]
    fn nic_view_enforces_bounds_and_peermem() {
        let backing = Arc::new(Backing::new(8192).unwrap());
        let with = map(8192, 0, 7, true, false, Arc::clone(&backing));
        let without = map(8192, 0, 7, false, false, Arc::clone(&backing));
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
        unmap(with.base);
        unmap(without.base);
    }
}
