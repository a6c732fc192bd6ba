//! What a registration is keyed by: the protection domain, the kind of
//! memory, the allocation's identity and the byte range.

use hal_cuda::{MemoryType, PointerAttributes};

pub use crate::buffer::Access;

/// Identifies a protection domain (the engine numbers its PDs; one PD per
/// NIC, so per-domain limits are per-device limits).
pub type DomainId = u64;

/// Where the registered memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemoryKind {
    /// Pageable host memory.
    Host,
    /// Page-locked host memory known to CUDA.
    PinnedHost,
    /// Device memory of GPU `ordinal`.
    Device {
        /// The GPU's ordinal.
        ordinal: u32,
    },
}

impl MemoryKind {
    /// The kind of the memory `attrs` describes; `None` for managed memory,
    /// which may migrate and is never registered.
    pub fn from_attributes(attrs: &PointerAttributes) -> Option<Self> {
        match attrs.memory_type {
            MemoryType::PageableHost => Some(Self::Host),
            MemoryType::PinnedHost => Some(Self::PinnedHost),
            MemoryType::Device => Some(Self::Device {
                ordinal: attrs.device_ordinal.unwrap_or(0),
            }),
            MemoryType::Managed => None,
        }
    }
}

/// Which allocation the range belongs to, as far as anyone can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AllocationIdentity {
    /// Pageable host memory: nothing vouches for it. A caller that frees such
    /// memory calls [`super::RegistrationCache::invalidate`].
    Host,
    /// Memory CUDA knows (device or pinned host), registered by address
    /// (`ibv_reg_mr`, nvidia-peermem for device memory), validated by
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID` on every hit.
    Cuda {
        /// The allocation's buffer id, read just now from pointer attributes.
        buffer_id: u64,
    },
    /// A dma-buf exported from the allocation with this buffer id
    /// (`ibv_reg_dmabuf_mr`). The request's range is an offset range inside
    /// the dma-buf, not an address: such entries live in their own index per
    /// allocation, and since buffer ids are never reused a re-allocation can
    /// never reach them.
    Dmabuf {
        /// The exported allocation's buffer id.
        buffer_id: u64,
    },
}

impl AllocationIdentity {
    /// The identity of the memory `attrs` describes, registered by address:
    /// [`AllocationIdentity::Cuda`] where CUDA gives a buffer id, otherwise
    /// [`AllocationIdentity::Host`].
    pub fn from_attributes(attrs: &PointerAttributes) -> Self {
        if attrs.buffer_id == 0 {
            Self::Host
        } else {
            Self::Cuda {
                buffer_id: attrs.buffer_id,
            }
        }
    }

    /// The buffer id, where there is one.
    pub fn buffer_id(&self) -> Option<u64> {
        match *self {
            Self::Host => None,
            Self::Cuda { buffer_id } | Self::Dmabuf { buffer_id } => Some(buffer_id),
        }
    }
}

/// Which gdr buffer a range belongs to: entries of different owners never
/// serve each other, so dropping one buffer never disturbs another's
/// registrations, even over the same allocation. `0` is "no owner" (raw
/// users of the cache, who keep the memory alive themselves).
pub type OwnerId = u64;

/// The extent of the allocation (or, for pageable memory, the buffer) a
/// request belongs to. Nothing outside it is ever registered for the request:
/// not the request itself, nor a merge of it with cached ranges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bounds {
    /// First address (or dma-buf offset).
    pub start: u64,
    /// One past the last.
    pub end: u64,
}

impl Bounds {
    /// No bound: the whole address space (raw users that vouch for their
    /// ranges themselves).
    pub const UNBOUNDED: Self = Self {
        start: 0,
        end: u64::MAX,
    };

    /// `len` bytes from `start` (saturating at the end of the address space).
    pub fn new(start: u64, len: u64) -> Self {
        Self {
            start,
            end: start.saturating_add(len),
        }
    }

    /// Whether `start..end` lies inside.
    pub fn contains(&self, start: u64, end: u64) -> bool {
        self.start <= start && end <= self.end
    }
}

/// A lookup, and what a [`super::Registrar`] is asked to register.
///
/// `start..start + len` is a virtual address range, except for
/// [`AllocationIdentity::Dmabuf`] where it is an offset range in the dma-buf.
/// The range handed to the registrar may be larger than the one looked up:
/// overlapping registrations of one allocation and owner are merged (see the
/// module docs), never past [`Request::bounds`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Request {
    /// The protection domain.
    pub domain: DomainId,
    /// The kind of memory.
    pub kind: MemoryKind,
    /// The allocation it belongs to.
    pub identity: AllocationIdentity,
    /// First address (or dma-buf offset).
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// The buffer the range belongs to (`0`: none).
    pub owner: OwnerId,
    /// The allocation the range lies in (same units as `start`).
    pub bounds: Bounds,
    /// What the registration may do to the memory: a read-only request is
    /// registered without write access, and read-only and read-write
    /// entries live in indexes of their own, so neither ever serves the
    /// other (a write through a read-only MR would fail; a read-only
    /// buffer must never get an MR with write access).
    pub access: Access,
}

impl Request {
    /// The same request with `access`.
    pub fn with_access(self, access: Access) -> Self {
        Self { access, ..self }
    }

    /// The same request, owned by `owner` and bounded by `bounds`.
    pub fn within(self, owner: OwnerId, bounds: Bounds) -> Self {
        Self {
            owner,
            bounds,
            ..self
        }
    }

    /// Pageable host memory.
    pub fn host(domain: DomainId, addr: u64, len: u64) -> Self {
        Self {
            domain,
            kind: MemoryKind::Host,
            identity: AllocationIdentity::Host,
            start: addr,
            len,
            owner: 0,
            bounds: Bounds::UNBOUNDED,
            access: Access::ReadWrite,
        }
    }

    /// Memory registered by address, with the kind and identity read from
    /// its pointer attributes just now. `None` for managed memory.
    pub fn from_attributes(
        domain: DomainId,
        attrs: &PointerAttributes,
        addr: u64,
        len: u64,
    ) -> Option<Self> {
        Some(Self {
            domain,
            kind: MemoryKind::from_attributes(attrs)?,
            identity: AllocationIdentity::from_attributes(attrs),
            start: addr,
            len,
            owner: 0,
            bounds: Bounds::UNBOUNDED,
            access: Access::ReadWrite,
        })
    }

    /// Device memory of GPU `ordinal`, allocation `buffer_id`, by address.
    pub fn device(domain: DomainId, ordinal: u32, buffer_id: u64, addr: u64, len: u64) -> Self {
        Self {
            domain,
            kind: MemoryKind::Device { ordinal },
            identity: AllocationIdentity::Cuda { buffer_id },
            start: addr,
            len,
            owner: 0,
            bounds: Bounds::UNBOUNDED,
            access: Access::ReadWrite,
        }
    }

    /// `len` bytes at `offset` of the dma-buf exported from allocation
    /// `buffer_id` of GPU `ordinal`.
    pub fn dmabuf(domain: DomainId, ordinal: u32, buffer_id: u64, offset: u64, len: u64) -> Self {
        Self {
            domain,
            kind: MemoryKind::Device { ordinal },
            identity: AllocationIdentity::Dmabuf { buffer_id },
            start: offset,
            len,
            owner: 0,
            bounds: Bounds::UNBOUNDED,
            access: Access::ReadWrite,
        }
    }

    /// One past the last byte, `None` when the range overflows.
    pub fn end(&self) -> Option<u64> {
        self.start.checked_add(self.len)
    }

    pub(crate) fn space(&self) -> SpaceKey {
        SpaceKey {
            domain: self.domain,
            space: Space::of(self.identity),
            owner: self.owner,
            access: self.access,
        }
    }
}

/// Which index an entry lives in (per domain, owner and access): one for everything registered
/// by address (host, pinned and device memory share it, so an address reused
/// by another kind of allocation is caught as stale too), and one per domain
/// and dma-buf allocation for offset ranges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Space {
    Address,
    Dmabuf(u64),
}

impl Space {
    pub(crate) fn of(identity: AllocationIdentity) -> Self {
        match identity {
            AllocationIdentity::Dmabuf { buffer_id } => Self::Dmabuf(buffer_id),
            AllocationIdentity::Host | AllocationIdentity::Cuda { .. } => Self::Address,
        }
    }
}

/// An index's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct SpaceKey {
    pub(crate) domain: DomainId,
    pub(crate) space: Space,
    pub(crate) owner: OwnerId,
    pub(crate) access: Access,
}

/// A small multiplicative hasher for the index maps: keys are a few
/// integers and not attacker-chosen, so SipHash's cost buys nothing on the
/// hot path.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

impl std::hash::Hasher for FxHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.write_u64(u64::from(i));
    }
    fn write_u32(&mut self, i: u32) {
        self.write_u64(u64::from(i));
    }
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }
    fn write_isize(&mut self, i: isize) {
        self.write_u64(i as u64);
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

pub(crate) type FxBuild = std::hash::BuildHasherDefault<FxHasher>;

/// Mixes a domain id into a shard number.
pub(crate) fn shard_of(domain: DomainId, shards: usize) -> usize {
    let mixed = domain.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (mixed >> 32) as usize % shards
}
