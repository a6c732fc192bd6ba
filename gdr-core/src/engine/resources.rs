//! What every path of the engine shares and nothing changes after start:
//! the engine's id and configuration, its NICs (each a completion queue and
//! a registration [`Ladder`]), the GPUs they reach and which NICs are
//! nearest each GPU.
//!
//! It is the seam's read-only half: a path is handed `&Resources` with its
//! [`super::path::PathCx`] and never the engine itself, so no path module
//! reaches the engine's state or another path's.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::cuda_worker::CudaWorker;
use super::events::EventPools;
use super::{EngineConfig, EngineError, Fence, Region, topology};
use crate::buffer::Buffer;
use crate::ladder::{Gpu, Ladder};

/// One NIC of the engine.
pub(crate) struct Nic {
    pub(crate) name: String,
    pub(crate) cqs: Cqs,
    /// The CQs' completion channel, which a parked engine waits on
    /// (`None`: the provider made none; the CQs are then polled).
    pub(crate) channel: Option<hal_verbs::dynamic::DynCompletionChannel>,
    pub(crate) ladder: Ladder,
    pub(crate) context: hal_verbs::dynamic::DynContext,
}

/// The engine's shared, unchanging resources.
pub(crate) struct Resources {
    pub(crate) id: u64,
    pub(crate) config: EngineConfig,
    pub(crate) cm: hal_verbs::dynamic::DynConnectionManager,
    // After `cm`: the NICs' CQs, PDs and contexts go after the connection
    // manager (and the state's connections, dropped before all of this).
    pub(crate) nics: Vec<Nic>,
    pub(crate) next_grant: AtomicU64,
    /// For each GPU (by ordinal), the engine's NICs nearest it (all at the
    /// least PCIe distance); none listed: no preference (the distance is
    /// unknown).
    pub(crate) nearest_nics: HashMap<u32, Vec<usize>>,
    /// The events progress records on its GPU copies (never made there:
    /// see [`super::events`]).
    pub(crate) events: EventPools,
    /// Peers connected at once at most: `max_peers`, or fewer where a
    /// NIC's completion queue holds fewer.
    pub(crate) peer_capacity: usize,
    /// Completion queues of each NIC (every NIC has as many): a CQ's index
    /// in the engine is its NIC's index times this plus its own.
    pub(crate) cqs_per_nic: usize,
    /// The thread that makes progress's blocking driver calls
    /// ([`super::cuda_worker`]).
    pub(crate) cuda: CudaWorker,
}

impl Resources {
    /// Resources over `nics` (the nearest NICs of each GPU read from the
    /// configured topology), shared: their CUDA worker runs jobs with
    /// them.
    pub(crate) fn new(
        id: u64,
        config: EngineConfig,
        cm: hal_verbs::dynamic::DynConnectionManager,
        nics: Vec<Nic>,
        peer_capacity: usize,
    ) -> std::sync::Arc<Self> {
        let nearest_nics = nearest_nics(&config.topology, &nics);
        // Enough for every staging slot's copy in both directions and the
        // landing and peer-copy copies beside them; more are made on demand.
        let events = EventPools::new(
            nics.first().map_or(&[][..], |n| n.ladder.gpus()),
            2 * config.staging_slots + 32,
        );
        let cqs_per_nic = nics.first().map_or(1, |n| n.cqs.queues().len());
        std::sync::Arc::new_cyclic(|weak| Self {
            id,
            config,
            cm,
            nics,
            next_grant: AtomicU64::new(1),
            nearest_nics,
            events,
            peer_capacity,
            cqs_per_nic,
            cuda: CudaWorker::new(weak.clone()),
        })
    }

    /// GPU `ordinal` of the engine (every NIC's ladder opened the same).
    pub(crate) fn gpu(&self, ordinal: u32) -> Result<&Gpu, EngineError> {
        self.nics
            .first()
            .and_then(|n| n.ladder.gpu(ordinal))
            .ok_or(EngineError::Unavailable(super::Unavailable::UnknownGpu {
                ordinal,
            }))
    }

    /// Makes the NIC's writes into GPU `ordinal` visible to kernels
    /// launched after this, where the GPU asks for it.
    pub(crate) fn fence_gpu(&self, ordinal: u32) -> Result<Fence, EngineError> {
        use hal_cuda::Context as _;
        let gpu = self.gpu(ordinal)?;
        if gpu.attributes.needs_flush_before_kernels()? {
            let _span = tracing::debug_span!("gpu_fence", ordinal).entered();
            gpu.context
                .flush_gpu_direct_rdma_writes(hal_cuda::FlushScope::Owner)?;
            Ok(Fence::Flushed)
        } else {
            Ok(Fence::NotNeeded)
        }
    }

    /// Registers `len` bytes at `offset` of `buffer` on every NIC (each on
    /// the first rung that works there).
    pub(crate) fn register_range(
        &self,
        buffer: &Buffer,
        offset: u64,
        len: u64,
    ) -> Result<Region, EngineError> {
        let _span = tracing::debug_span!("engine_register", len).entered();
        Region::register(
            self.id,
            buffer,
            offset,
            len,
            self.nics.iter().map(|nic| &nic.ladder),
        )
    }

    /// Registers the whole of `buffer` on every NIC.
    pub(crate) fn register(&self, buffer: &Buffer) -> Result<Region, EngineError> {
        self.register_range(buffer, 0, buffer.len())
    }
}

/// For each GPU of the NICs' ladders, the NICs at the least known PCIe
/// distance from it.
fn nearest_nics(topology: &topology::PciTopology, nics: &[Nic]) -> HashMap<u32, Vec<usize>> {
    let names: Vec<&str> = nics.iter().map(|n| n.name.as_str()).collect();
    let mut nearest = HashMap::new();
    let Some(first) = nics.first() else {
        return nearest;
    };
    for gpu in first.ladder.gpus() {
        let distances = topology.nic_distances(Some(&gpu.attributes.pci_bus_id), &names);
        let Some(best) = distances.iter().flatten().min().copied() else {
            continue;
        };
        let chosen: Vec<usize> = (0..nics.len())
            .filter(|&i| distances[i] == Some(best))
            .collect();
        tracing::info!(
            gpu = gpu.attributes.ordinal,
            nics = ?chosen.iter().map(|&i| names[i]).collect::<Vec<_>>(),
            distance = ?best,
            "nearest NICs"
        );
        nearest.insert(gpu.attributes.ordinal, chosen);
    }
    nearest
}

/// A NIC's completion queues, each with its seats: a queue pair takes one
/// (room for its `qp_depth` + `recv_depth` completions) on the queue with
/// the fewest taken, and gives it back when it is destroyed, so no queue
/// overruns while the seats last.
pub(crate) struct Cqs {
    queues: Vec<hal_verbs::dynamic::DynCompletionQueue>,
    taken: Arc<[AtomicUsize]>,
    seats: usize,
    /// Threads spinning on each queue now (a waiter's home,
    /// [`Cqs::home`]): a poll of every CQ leaves those queues to them.
    homed: Box<[Homed]>,
}

/// One CQ's count of threads spinning on it, on a cache line of its own
/// (each waiter writes its queue's twice a wait; every poll of all CQs
/// reads them all).
#[derive(Default)]
#[repr(align(128))]
struct Homed(AtomicUsize);

impl Cqs {
    /// Queue pairs seated on each CQ.
    pub(crate) fn seated(&self) -> impl Iterator<Item = usize> + '_ {
        self.taken.iter().map(|t| t.load(Ordering::Acquire))
    }

    pub(crate) fn new(queues: Vec<hal_verbs::dynamic::DynCompletionQueue>, seats: usize) -> Self {
        let taken = queues.iter().map(|_| AtomicUsize::new(0)).collect();
        let homed = queues.iter().map(|_| Homed::default()).collect();
        Self {
            queues,
            taken,
            seats,
            homed,
        }
    }

    /// A thread starts spinning on queue `index` (its waiter's home):
    /// until [`Cqs::leave`], polls of every CQ pass it by, its completions
    /// taken by the spinning thread.
    pub(crate) fn home(&self, index: usize) {
        self.homed[index].0.fetch_add(1, Ordering::AcqRel);
    }

    /// The end of a [`Cqs::home`].
    pub(crate) fn leave(&self, index: usize) {
        self.homed[index].0.fetch_sub(1, Ordering::AcqRel);
    }

    /// Whether a thread spins on queue `index` now.
    pub(crate) fn is_homed(&self, index: usize) -> bool {
        self.homed[index].0.load(Ordering::Acquire) > 0
    }

    /// The queues, by index.
    pub(crate) fn queues(&self) -> &[hal_verbs::dynamic::DynCompletionQueue] {
        &self.queues
    }

    /// A seat on queue `prefer` while it has room (the queue of another
    /// of the peer's queue pairs: a waiter on the peer then polls one
    /// queue), else on the queue with the fewest taken (`None`: every
    /// queue is full).
    pub(crate) fn seat(&self, prefer: Option<usize>) -> Option<CqSeat> {
        if let Some(index) = prefer.filter(|&i| i < self.taken.len()) {
            let room = self.taken[index].fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                (t < self.seats).then_some(t + 1)
            });
            if room.is_ok() {
                return Some(CqSeat {
                    taken: Arc::clone(&self.taken),
                    index,
                });
            }
        }
        loop {
            let (index, taken) = self
                .taken
                .iter()
                .map(|t| t.load(Ordering::Acquire))
                .enumerate()
                .min_by_key(|&(_, taken)| taken)?;
            if taken >= self.seats {
                return None;
            }
            // Another thread may have taken it meanwhile: look again.
            if self.taken[index]
                .compare_exchange(taken, taken + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Some(CqSeat {
                    taken: Arc::clone(&self.taken),
                    index,
                });
            }
        }
    }
}

/// A queue pair's seat on one of its NIC's CQs ([`Cqs::seat`]), given back
/// when dropped.
#[derive(Debug)]
pub(crate) struct CqSeat {
    taken: Arc<[AtomicUsize]>,
    index: usize,
}

impl CqSeat {
    /// The CQ's index on its NIC.
    pub(crate) fn cq(&self) -> usize {
        self.index
    }
}

impl Drop for CqSeat {
    fn drop(&mut self) {
        self.taken[self.index].fetch_sub(1, Ordering::AcqRel);
    }
}

/// A queue pair's connection with its seat on a CQ: the connection goes
/// first (the queue pair is destroyed), then the seat. A drained queue
/// pair gives its seat back at once ([`SeatedConnection::release_seat`]):
/// it completes nothing more of its own (a gone peer's stay until the
/// engine goes, and one re-established needs a seat for its successor).
pub(crate) struct SeatedConnection {
    conn: hal_verbs::dynamic::DynConnection,
    seat: Option<CqSeat>,
    cq: usize,
}

impl SeatedConnection {
    pub(crate) fn new(conn: hal_verbs::dynamic::DynConnection, seat: CqSeat) -> Self {
        let cq = seat.cq();
        Self {
            conn,
            seat: Some(seat),
            cq,
        }
    }

    /// The CQ it completes on, by index on its NIC.
    pub(crate) fn cq(&self) -> usize {
        self.cq
    }

    /// Gives its seat back (the queue pair drained).
    pub(crate) fn release_seat(&mut self) {
        self.seat = None;
    }
}

impl std::ops::Deref for SeatedConnection {
    type Target = hal_verbs::dynamic::DynConnection;
    fn deref(&self) -> &Self::Target {
        &self.conn
    }
}

impl std::ops::DerefMut for SeatedConnection {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.conn
    }
}
