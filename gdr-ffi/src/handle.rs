//! Handles: what a C caller holds instead of a pointer. A handle is a
//! 64-bit value naming a slot of one table, checked on every use: zero,
//! freed (the slot's generation moved on), another kind of object, or a
//! handle made by another instance of the library (a second `dlopen`ed
//! copy: its instance tag differs) are refused with `GDR_INVALID_HANDLE`,
//! never dereferenced.
//!
//! Layout, high bits first: instance tag (16), kind (8), generation (16),
//! slot index (24). The instance tag is drawn once per loaded copy of the
//! library and is never 0, so no valid handle is 0. A slot's generation
//! never comes round again: a slot whose generation would wrap is retired
//! (never reused), so a stale handle, kept however long, never names a new
//! object. Retiring costs one slot per 65,535 objects made in it; once
//! every one of the 2^24 slots is live or retired (about 10^12 objects of
//! one kind), making another fails with `GDR_OUT_OF_RESOURCES`. Another
//! instance's handle matches ours only where the two tags collide (1 in
//! 65535).

use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use crate::boundary::Out;
use crate::result::{FfiError, GdrResult};

const INDEX_BITS: u32 = 24;
const GENERATION_BITS: u32 = 16;
const KIND_BITS: u32 = 8;
const MAX_SLOTS: usize = 1 << INDEX_BITS;

/// What a handle names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    Context = 1,
    Buffer = 2,
    Engine = 3,
    Region = 4,
    Listener = 5,
    Peer = 6,
    Grant = 7,
    Descriptor = 8,
    Batch = 9,
    Stream = 10,
}

impl Kind {
    #[cfg(test)]
    const ALL: [Self; 10] = [
        Self::Context,
        Self::Buffer,
        Self::Engine,
        Self::Region,
        Self::Listener,
        Self::Peer,
        Self::Grant,
        Self::Descriptor,
        Self::Batch,
        Self::Stream,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Context => "context",
            Self::Buffer => "buffer",
            Self::Engine => "engine",
            Self::Region => "region",
            Self::Listener => "listener",
            Self::Peer => "peer",
            Self::Grant => "grant",
            Self::Descriptor => "descriptor",
            Self::Batch => "batch",
            Self::Stream => "stream",
        }
    }
}

/// This loaded copy's tag: random (std's per-process random hasher keys,
/// the time and the address of a static of this copy), never 0.
fn instance_tag() -> u16 {
    static TAG: OnceLock<u16> = OnceLock::new();
    *TAG.get_or_init(|| {
        static ANCHOR: u8 = 0;
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_usize(&ANCHOR as *const u8 as usize);
        hasher.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        hasher.write_u32(std::process::id());
        let folded = hasher.finish();
        let tag = (folded ^ folded >> 16 ^ folded >> 32 ^ folded >> 48) as u16;
        tag.max(1)
    })
}

fn encode(kind: Kind, generation: u16, index: usize) -> u64 {
    u64::from(instance_tag()) << (KIND_BITS + GENERATION_BITS + INDEX_BITS)
        | u64::from(kind as u8) << (GENERATION_BITS + INDEX_BITS)
        | u64::from(generation) << INDEX_BITS
        | index as u64
}

struct Slot<T: ?Sized> {
    /// The generation a live handle of this slot carries (never 0).
    generation: u16,
    value: Option<Arc<T>>,
}

struct Slots<T: ?Sized> {
    slots: Vec<Slot<T>>,
    /// Free slots whose generation can still move on; a retired slot is in
    /// neither this list nor use.
    free: Vec<usize>,
}

/// A C handle type: a struct of one opaque `id`.
pub(crate) trait CHandle {
    fn from_id(id: u64) -> Self;
}

/// Implements [`CHandle`] for handle structs of one `id` field.
macro_rules! c_handles {
    ($($handle:ty),+ $(,)?) => {
        $(impl $crate::handle::CHandle for $handle {
            fn from_id(id: u64) -> Self {
                Self { id }
            }
        })+
    };
}
pub(crate) use c_handles;

/// The live objects of one kind.
pub(crate) struct Table<T: ?Sized> {
    kind: Kind,
    /// How many slots the table may have: [`MAX_SLOTS`], less in tests.
    max_slots: usize,
    slots: Mutex<Slots<T>>,
}

impl<T: ?Sized> Table<T> {
    pub const fn new(kind: Kind) -> Self {
        Self::with_max_slots(kind, MAX_SLOTS)
    }

    const fn with_max_slots(kind: Kind, max_slots: usize) -> Self {
        assert!(max_slots <= MAX_SLOTS, "a slot index has INDEX_BITS");
        Self {
            kind,
            max_slots,
            slots: Mutex::new(Slots {
                slots: Vec::new(),
                free: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots<T>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stores `value`; its handle.
    pub fn insert(&self, value: Arc<T>) -> Result<u64, FfiError> {
        let mut slots = self.lock();
        let index = match slots.free.pop() {
            Some(index) => index,
            None if slots.slots.len() < self.max_slots => {
                slots.slots.push(Slot {
                    generation: 1,
                    value: None,
                });
                slots.slots.len() - 1
            }
            None => {
                return Err(FfiError::new(
                    GdrResult::OutOfResources,
                    format!(
                        "no {} handle left: all {} slots are live or retired \
                         (a slot retires after {} objects)",
                        self.kind.name(),
                        self.max_slots,
                        u16::MAX
                    ),
                ));
            }
        };
        let slot = &mut slots.slots[index];
        slot.value = Some(value);
        Ok(encode(self.kind, slot.generation, index))
    }

    /// Stores `value` and writes its handle to `out`: the last step of a
    /// call that made an object (nothing is written if the store fails).
    ///
    /// # Safety
    /// `out` (checked by [`Out::new`]) must be valid for a write.
    pub unsafe fn publish<H: CHandle>(&self, value: Arc<T>, out: Out<H>) -> Result<(), FfiError> {
        let id = self.insert(value)?;
        // SAFETY: the caller's contract.
        unsafe { out.write(H::from_id(id)) };
        Ok(())
    }

    /// The slot index `handle` names, if it is one of ours of this kind and
    /// live.
    fn index(&self, slots: &Slots<T>, handle: u64) -> Result<usize, FfiError> {
        let invalid = |why: &str| {
            FfiError::new(
                GdrResult::InvalidHandle,
                format!("{} handle {handle:#x}: {why}", self.kind.name()),
            )
        };
        if handle == 0 {
            return Err(invalid("zero (never a live handle)"));
        }
        let tag = (handle >> (KIND_BITS + GENERATION_BITS + INDEX_BITS)) as u16;
        if tag != instance_tag() {
            return Err(invalid("made by another instance of the library"));
        }
        let kind = (handle >> (GENERATION_BITS + INDEX_BITS)) as u8;
        if kind != self.kind as u8 {
            return Err(invalid("names another kind of object"));
        }
        let generation = (handle >> INDEX_BITS) as u16;
        let index = (handle & (MAX_SLOTS as u64 - 1)) as usize;
        match slots.slots.get(index) {
            Some(slot) if slot.generation == generation && slot.value.is_some() => Ok(index),
            _ => Err(invalid("freed already, or never made")),
        }
    }

    /// The object `handle` names.
    pub fn get(&self, handle: u64) -> Result<Arc<T>, FfiError> {
        let slots = self.lock();
        let index = self.index(&slots, handle)?;
        Ok(Arc::clone(
            slots.slots[index].value.as_ref().expect("checked live"),
        ))
    }

    /// Frees `handle` (it is invalid from now on); its object.
    pub fn remove(&self, handle: u64) -> Result<Arc<T>, FfiError> {
        let mut slots = self.lock();
        let index = self.index(&slots, handle)?;
        let slot = &mut slots.slots[index];
        let value = slot.value.take().expect("checked live");
        // A generation that would wrap retires the slot: reusing it would
        // one day hand a stale handle's exact value to a new object.
        if let Some(next) = slot.generation.checked_add(1) {
            slot.generation = next;
            slots.free.push(index);
        }
        Ok(value)
    }

    /// Test hook: moves the generation of the free slot `freed` named (a
    /// handle already removed) to `generation`, standing in for that many
    /// objects made and freed in it. False if the slot is not free now.
    #[cfg(test)]
    pub fn set_free_slot_generation(&self, freed: u64, generation: u16) -> bool {
        let mut slots = self.lock();
        let index = (freed & (MAX_SLOTS as u64 - 1)) as usize;
        if !slots.free.contains(&index) {
            return false;
        }
        slots.slots[index].generation = generation;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_zero_foreign_and_other_kind_handles_are_refused() {
        let buffers: Table<u32> = Table::new(Kind::Buffer);
        let a = buffers.insert(Arc::new(7)).unwrap();
        assert_ne!(a, 0);
        assert_eq!(*buffers.get(a).unwrap(), 7);
        let err = |r: Result<Arc<u32>, FfiError>| r.unwrap_err();
        assert_eq!(err(buffers.get(0)).result, GdrResult::InvalidHandle);
        // Another kind with the same slot and generation.
        let as_context = a & !(0xff << 40) | (Kind::Context as u64) << 40;
        assert!(
            err(buffers.get(as_context))
                .message
                .contains("another kind")
        );
        // Another instance's tag.
        let foreign = a ^ 1 << 63;
        assert!(
            err(buffers.get(foreign))
                .message
                .contains("another instance")
        );
        // Freed, and its slot reused: the old handle stays invalid.
        assert_eq!(*buffers.remove(a).unwrap(), 7);
        assert!(err(buffers.get(a)).message.contains("freed"));
        assert!(err(buffers.remove(a)).message.contains("freed"));
        let b = buffers.insert(Arc::new(8)).unwrap();
        assert_eq!(b & 0xff_ffff, a & 0xff_ffff, "the slot is reused");
        assert_ne!(a, b);
        assert!(buffers.get(a).is_err());
        assert_eq!(*buffers.get(b).unwrap(), 8);
        // An index past the table.
        assert!(buffers.get(b | 0xff_fff0).is_err());
    }

    /// A slot whose generation would wrap is retired: the stale handle of
    /// its first object is refused, never handed to a new one (before
    /// retiring, the 65,536th object in a slot got the first one's handle).
    #[test]
    fn a_slot_is_retired_before_its_generation_wraps_in_every_kind() {
        for kind in Kind::ALL {
            let table: Table<u32> = Table::new(kind);
            let stale = table.insert(Arc::new(1)).unwrap();
            table.remove(stale).unwrap();
            // 65,533 more objects made and freed in that slot.
            assert!(table.set_free_slot_generation(stale, u16::MAX));
            let last = table.insert(Arc::new(2)).unwrap();
            assert_eq!(last & 0xff_ffff, stale & 0xff_ffff, "{kind:?}: same slot");
            table.remove(last).unwrap();
            let fresh = table.insert(Arc::new(3)).unwrap();
            assert_ne!(fresh, stale, "{kind:?}: a stale handle names a new object");
            assert_ne!(
                fresh & 0xff_ffff,
                stale & 0xff_ffff,
                "{kind:?}: slot reused"
            );
            for gone in [stale, last] {
                let err = table.get(gone).unwrap_err();
                assert_eq!(err.result, GdrResult::InvalidHandle, "{kind:?}");
                assert!(table.remove(gone).is_err(), "{kind:?}");
            }
            assert_eq!(*table.get(fresh).unwrap(), 3, "{kind:?}");
        }
    }

    /// Past the last slot, with every other slot retired, making an object
    /// fails with a typed error and loses nothing that is live.
    #[test]
    fn a_table_of_retired_slots_refuses_new_objects() {
        let table: Table<u32> = Table::with_max_slots(Kind::Peer, 3);
        let live = table.insert(Arc::new(7)).unwrap();
        for _ in 0..2 {
            let h = table.insert(Arc::new(0)).unwrap();
            table.remove(h).unwrap();
            assert!(table.set_free_slot_generation(h, u16::MAX));
            let h = table.insert(Arc::new(0)).unwrap();
            table.remove(h).unwrap();
        }
        let err = table.insert(Arc::new(8)).unwrap_err();
        assert_eq!(err.result, GdrResult::OutOfResources);
        assert!(err.message.contains("retired"), "{}", err.message);
        assert_eq!(*table.get(live).unwrap(), 7);
    }
}
