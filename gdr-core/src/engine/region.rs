//! Registered regions: a buffer range's registrations on each of the
//! engine's NICs, in pieces.
//!
//! Most memory is one allocation, and a region holds one registration per
//! NIC. CUDA VMM memory (PyTorch's expandable segments, vLLM) is physical
//! chunks mapped side by side, each an allocation of its own: a region over
//! several holds one registration per chunk per NIC ([`Piece`]s, in
//! address order, tiling the region). The local side of a transfer is cut
//! at piece boundaries, a grant names one descriptor segment per piece, and
//! a NIC on which any piece is staged reaches the whole region through the
//! staging path.

use std::fmt;
use std::sync::Arc;

use crate::buffer::{Access, Buffer, Piece};
use crate::descriptor::{GrantRights, MemoryLocation, Segment};
use crate::ladder::{Ladder, LadderError, LadderRegistration, MrGrant, Rung};

use super::{EngineError, ReadOnlyUse, check_within};

/// A registered buffer: its registration on each of the engine's NICs.
/// Cloning shares it; the MRs (and the memory) stay while any clone, grant
/// or request in flight holds it.
pub struct Region {
    pub(super) inner: Arc<RegionInner>,
}

pub(super) struct RegionInner {
    /// The engine that registered it: its MRs are in that engine's
    /// protection domains, so no other engine may post or grant them.
    pub(super) engine: u64,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) location: MemoryLocation,
    /// Read-only memory: never granted with write rights, never READ into.
    pub(super) access: Access,
    pub(super) per_nic: Vec<NicPieces>,
}

/// A region's registrations on one NIC: one piece, or one per physical
/// chunk of CUDA VMM memory, tiling the region in address order.
pub(super) struct NicPieces {
    pieces: Vec<Piece>,
}

impl NicPieces {
    /// The rung the region takes on this NIC: staging when any piece is
    /// staged (the staging path moves the whole region), else the first
    /// piece's.
    pub(super) fn rung(&self) -> Rung {
        if self
            .pieces
            .iter()
            .any(|p| p.registration.rung() == Rung::Staging)
        {
            Rung::Staging
        } else {
            self.pieces[0].registration.rung()
        }
    }

    /// The MR covering the whole region, when one registration does (host
    /// memory always: the engine's own buffers rely on it).
    pub(super) fn mr(&self) -> Option<&hal_verbs::dynamic::DynMemoryRegion> {
        match self.pieces.as_slice() {
            [one] => one.registration.mr(),
            _ => None,
        }
    }

    /// The registration holding byte `offset` of the region, and how many
    /// bytes of the region from `offset` it holds.
    pub(super) fn at(&self, offset: u64, region_len: u64) -> (&LadderRegistration, u64) {
        // One piece: no search (the common case, on every slice).
        let index = match self.pieces.len() {
            1 => 0,
            _ => self.pieces.partition_point(|p| p.offset <= offset) - 1,
        };
        let end = self.pieces.get(index + 1).map_or(region_len, |p| p.offset);
        (&self.pieces[index].registration, end - offset)
    }

    /// Grants `len` bytes at `offset` of the region on `ladder` with
    /// `rights`: one grant per piece the range covers, and its descriptor
    /// segment (offsets from `offset`).
    pub(super) fn grant(
        &self,
        ladder: &Ladder,
        offset: u64,
        len: u64,
        rights: GrantRights,
        segments: &mut Vec<Segment>,
        grants: &mut Vec<MrGrant>,
    ) -> Result<(), LadderError> {
        let end = offset + len;
        for (i, piece) in self.pieces.iter().enumerate() {
            let piece_end = self.pieces.get(i + 1).map_or(u64::MAX, |next| next.offset);
            let (start, stop) = (offset.max(piece.offset), end.min(piece_end));
            if start >= stop {
                continue;
            }
            let grant = ladder.grant(
                &piece.registration,
                start - piece.offset,
                stop - start,
                rights,
            )?;
            segments.push(grant.segment(start - offset));
            grants.push(grant);
        }
        Ok(())
    }
}

impl Clone for Region {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("addr", &format_args!("{:#x}", self.inner.addr))
            .field("len", &self.inner.len)
            .field("location", &self.inner.location)
            .field("access", &self.inner.access)
            .field("rungs", &self.rungs())
            .field(
                "pieces",
                &self.inner.per_nic.first().map_or(0, |n| n.pieces.len()),
            )
            .finish()
    }
}

impl Region {
    /// Registers `len` bytes at `offset` of `buffer` on each of `ladders`.
    pub(super) fn register<'l>(
        engine: u64,
        buffer: &Buffer,
        offset: u64,
        len: u64,
        ladders: impl Iterator<Item = &'l Ladder>,
    ) -> Result<Self, EngineError> {
        let per_nic = ladders
            .map(|ladder| {
                let pieces = buffer.register_pieces(ladder, offset, len)?;
                let rungs = pieces.len();
                if rungs > 1 {
                    tracing::debug!(
                        device = ladder.device(),
                        pieces = rungs,
                        "CUDA VMM range registered chunk by chunk"
                    );
                }
                Ok(NicPieces { pieces })
            })
            .collect::<Result<Vec<_>, LadderError>>()?;
        let location = match buffer.device_ordinal() {
            Some(ordinal)
                if matches!(
                    buffer.memory_type(),
                    hal_cuda::MemoryType::Device | hal_cuda::MemoryType::Managed
                ) =>
            {
                MemoryLocation::Gpu {
                    ordinal: ordinal as u16,
                }
            }
            _ => MemoryLocation::Host,
        };
        Ok(Self {
            inner: Arc::new(RegionInner {
                engine,
                addr: buffer.addr() + offset,
                len,
                location,
                access: buffer.access(),
                per_nic,
            }),
        })
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    /// Never true (empty buffers are not registered).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Host or GPU memory.
    pub fn location(&self) -> MemoryLocation {
        self.inner.location
    }

    /// What may be done to its memory: a read-only region
    /// ([`Context::wrap_read_only`](crate::Context::wrap_read_only)) is never granted with write rights nor
    /// READ into.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// The rung taken on each NIC, in the engine's NIC order: for a region
    /// in several pieces, staging where any piece is staged.
    pub fn rungs(&self) -> Vec<Rung> {
        self.inner.per_nic.iter().map(NicPieces::rung).collect()
    }

    /// The id of the engine that registered it (only that engine posts
    /// or grants it).
    pub fn engine_id(&self) -> u64 {
        self.inner.engine
    }

    /// Each rung above the one NIC `nic` took, and why it was not taken
    /// (for a region in several pieces, the first piece's).
    pub fn rung_failures(&self, nic: usize) -> &[crate::ladder::RungFailure] {
        self.inner
            .per_nic
            .get(nic)
            .map_or(&[], |n| n.pieces[0].registration.failures())
    }

    /// The registration on NIC `nic` (the engine's order); for a region in
    /// several pieces, the first piece's. Feature `testing`: the HAL's MR
    /// handles are not for applications.
    #[cfg(feature = "testing")]
    pub fn registration(&self, nic: usize) -> Option<&LadderRegistration> {
        self.inner
            .per_nic
            .get(nic)
            .map(|n| &n.pieces[0].registration)
    }

    /// The pieces on NIC `nic`: one registration per physical chunk of CUDA
    /// VMM memory the region covers (one for other memory), in address
    /// order, each with its offset in the region. Feature `testing`.
    #[cfg(feature = "testing")]
    pub fn pieces(&self, nic: usize) -> Option<&[Piece]> {
        self.inner.per_nic.get(nic).map(|n| n.pieces.as_slice())
    }

    /// Checks that engine `engine` may use `len` bytes at `offset`: the
    /// region is its own and the range lies inside.
    pub(super) fn check(&self, engine: u64, offset: u64, len: u64) -> Result<(), EngineError> {
        self.check_engine(engine)?;
        check_within("local region", offset, len, self.inner.len)
    }

    /// Checks that the region is engine `engine`'s own.
    pub(super) fn check_engine(&self, engine: u64) -> Result<(), EngineError> {
        if self.inner.engine != engine {
            return Err(EngineError::Refused(super::Refusal::ForeignRegion {
                region_engine: self.inner.engine,
                engine,
            }));
        }
        Ok(())
    }

    /// Checks that the region's memory may be written the way `write`
    /// says: read-only memory never may.
    pub(super) fn check_writable(&self, write: ReadOnlyUse) -> Result<(), EngineError> {
        if self.inner.access.is_writable() {
            Ok(())
        } else {
            Err(EngineError::ReadOnly(write))
        }
    }
}
