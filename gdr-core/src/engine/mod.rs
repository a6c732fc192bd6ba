//! The transfer engine: peers, grants, batched one-sided transfers and
//! control messages, with every request completing exactly once.
//!
//! # Shape
//!
//! - [`Engine`] owns the NICs it was given (one [`Ladder`] and
//!   [`EngineConfig::cqs_per_nic`] completion queues each, a queue pair
//!   seated on the one with the fewest: `resources::Cqs`), registers
//!   buffers as [`Region`]s, listens and connects with rdma_cm. Its
//!   book-keeping of each peer (batches on its queue pairs, their
//!   recovery, grants, messages) is one [`gdr_proto::connection`] per peer
//!   (no clock reads, no threads, no I/O; carried out by
//!   `engine::batches`); the engine is the driver that feeds it
//!   completions, connection events and time
//!   ([`Clock`]) and posts what it hands out. Progress is made by whoever
//!   waits ([`Batch::wait`], [`Peer::recv`]) or by [`Engine::progress`].
//! - A [`Peer`] is one connection to another engine: several RC queue pairs
//!   (each an rdma_cm connection, versioned handshake in the private data,
//!   [`wire::Hello`]), queue pair 0 also carrying control messages
//!   (SEND/RECV, [`wire::Control`]).
//! - Connections are set up as [`setup`] says: a listener keeps new
//!   peers' queue pairs in a bounded backlog, each peer until a deadline,
//!   for [`Listener::accept`], which never hands out a peer whose
//!   connector gave up; a connect that is refused or not accepted fails
//!   typed ([`EngineError::Rejected`], [`EngineError::NotAccepted`]) and
//!   leaves nothing behind on either side.
//! - A peer reaches memory only through a grant: [`Peer::grant`] makes MRs of
//!   exactly the range and rights (one per NIC the peer's queue pairs use),
//!   announces the [`MemoryDescriptor`] on the connection, and revokes it on
//!   drop. A request naming a descriptor is checked before anything is
//!   posted: the grant must be live on this connection (announced by this
//!   peer and not revoked), allow the operation, and hold the range.
//! - A [`Batch`] of [`Transfer`]s is cut into slices of at most
//!   [`EngineConfig::slice_size`] spread over the peer's queue pairs,
//!   linked and posted with one doorbell per queue pair, selectively
//!   signalled. It ends exactly once: success, or the first
//!   [`TransferError`]. An outcome is delivered only once nothing of the
//!   batch is still in the NIC (a timeout stops the queue pairs holding it
//!   first), except past a grace period when the NIC never gives it back;
//!   the regions stay registered until it does.
//! - A queue pair that fails (an error completion, a deadline that stopped
//!   it, the peer's disconnect) fails only its own requests; once drained
//!   it is re-established: the connecting side reconnects the same index
//!   of the session over the same path, the listener's thread installs it
//!   on the accepting side (queue pair 0's control receives move over slot
//!   by slot, live grants are announced again). Work submitted meanwhile
//!   goes to the queue pairs still up, or waits for this one; past
//!   [`EngineConfig::reconnect_timeout`] it is given up, and a peer with no
//!   queue pair left is gone ([`EngineError::PeerGone`]). What to do at
//!   each step is the sans-IO [`gdr_proto::reconnect::Recovery`]'s; the
//!   engine dials, installs and fails what it says.
//! - GPU memory no NIC reaches (the ladder's staging rung) is moved through
//!   bounce buffers, a peer's by rendezvous over control messages: see
//!   `staging` for how and what it costs.
//! - Slices of GPU memory go over the peer's queue pairs on the NICs
//!   nearest the GPU (`topology::PciTopology`, read at start), when one
//!   is up.
//!
//! # The GPU fence
//!
//! A NIC's writes into GPU memory (a READ's data arriving here, a peer's
//! WRITE) are complete for the NIC when the request completes; whether a
//! kernel launched afterwards sees them depends on the GPU's write
//! ordering (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`). The
//! fence is tied to the request, not to the device:
//! - a batch that READ into GPU memory flushes that GPU
//!   (`cuFlushGPUDirectRDMAWrites`, only where the attribute asks for it)
//!   before [`Batch::wait`] (or the `Future`) returns success: launch
//!   kernels after that;
//! - data a peer WROTE here is fenced by [`Engine::fence_inbound_writes`]
//!   on the region, called once the peer says its batch completed (its
//!   control message, sent after the batch, arrives after the data).
//!
//! 3FS's `hf3fs_iovsync` synchronizes the whole device instead.
//!
//! # Locks
//!
//! What each lock guards, and the order they are taken in (a lock is only
//! taken while holding those above it in this list, never the reverse;
//! debug builds check the first three and the reactor's, `lock_order`):
//!
//! 1. The engine's lock (`Shared::state`, `State`): the table of the
//!    peers' slots and the queue pairs being re-established. Taken by the
//!    engine's pass (`Engine::progress_locked`: error completions,
//!    deadlines, connection and async events, the peers' parts of the
//!    paths stepped, the gates and stream fences looked at, queue-pair
//!    actions, the receives of a peer whose queue pair 0 was replaced) and
//!    by what changes the peers (a connect, a tear-down). No peer's own
//!    work takes it: a submit on any path (gated included), a grant and
//!    its revoke and the wait for its fence, a cancel, a close, a control
//!    message, a stream fence. A
//!    progress call makes the pass only when it is due
//!    (`handoff::PassDue`: work one of those left
//!    it, its earliest deadline, connection and async events every
//!    millisecond, engine wide); one only due, with the lock busy, is
//!    left to a later call, and a waiter about to park polls instead of
//!    waiting for the lock to read its deadline. The pass
//!    takes a peer's lock only where the peer's mark says it has
//!    something for it (`handoff::PeerMark`: queue-pair actions, work to
//!    post or step, a deadline past; published by each holder of the
//!    peer's lock as it goes), reads the peers' earliest deadlines from
//!    the marks, and leaves the connection events of a peer whose lock is
//!    busy to a later pass (at most `EVENTS_SKIPPED_MAX` in a row). Never
//!    held across a driver call that can block: the GPU fence before a
//!    stream fence's release (`Engine::flush_before_stream_releases`),
//!    landing slots (allocated, pinned, registered), opened gates'
//!    batches' submits: each is decided under the lock, made outside it,
//!    and handed back under it.
//! 2. The streams' lock (`Shared::streams`, `Streams`: the page of words
//!    streams wait on, the stream fences whose batch has not ended, the
//!    gates holding any peer's batches until a stream gets somewhere):
//!    taken by the pass under the engine's, and alone by a gated submit, a
//!    stream fence and the serving of opened gates and GPU-fenced stream
//!    releases; never across a driver call that can block (a word is
//!    taken under it; the stream operations, a gate's event record and
//!    the fence page's allocation are made outside it), never under a
//!    peer's lock (a gate's look at its peer takes the peer's under it).
//! 3. A peer's lock (`PeerLock`, one `PeerSlot`: its connection,
//!    [`gdr_proto::connection`], which owns the batches on the peer's queue
//!    pairs, their recovery, grants both ways, inbox and outbox, both
//!    sides of the staged path's rendezvous and the peer-copy path's
//!    protocol state (this side's copies to the peer a window at a time,
//!    our grants exported to it, the releases owed it), with the engine's
//!    side of it, `batches::Core`; and the paths' parts of the peer,
//!    stepped there on a wire to that peer alone, `SlotWire`, with the
//!    connection's state of their protocol lent: the staged path's,
//!    `staging::StagedPeer`, its transfers through bounce slots and its
//!    staged grants, and the peer-copy path's, `peer_copy::PeerCopyPeer`,
//!    where the peer runs, its grants' IPC handles and the GPU side of
//!    this side's copies to it): taken alone by what
//!    that peer does (a submit on any path, a grant of memory and its
//!    revoke, landing slots installed, a close, a control message, a wait
//!    for a message or a grant, a cancel, the completions of its sends and
//!    its control receives, routed to it by any polling thread, whose
//!    messages are handled there by the paths' parts and the connection),
//!    or under the engine's or the streams' lock; one peer's at a time.
//!    Never held across
//!    a driver call that can block: a peer copy's IPC handle opened and
//!    peer access enabled (`peer_copy::DriverStep`) are decided under it,
//!    made outside every lock and handed back under it. Under it: the
//!    NIC's non-blocking calls (posts, a queue pair moved to error or
//!    disconnected), and what a path shares among the peers, each under a
//!    lock of its own held for one step of the peer: the staging pools
//!    (`Shared::pools`, each GPU's bounce slots) and the peer-copy path's
//!    book-keeping of the GPUs (`Shared::peer_copy`: IPC mappings, peer
//!    access, the next stream, counters); under those, only the locks
//!    below.
//! 4. Below them, each taken briefly and never across another lock: a
//!    peer's queue of receives polled (`PeerLock::inbound`, drained under
//!    the peer's lock, which takes them in their queue pair's posting
//!    order: `PeerState::early`), the routes (`handoff::Routes`, (NIC, queue pair number) to peer, written
//!    under the engine's lock; each polling thread keeps a copy, checked
//!    by the routes' version), a peer's free send slots
//!    (`ControlBuffers::free_send`, also freed by the NIC's completion of
//!    the SEND), the CUDA worker's queue (`cuda_worker`), the event pool
//!    (`events`), the peer-copy streams, the process-wide registry of
//!    published grants (`peer_copy`).
//! 5. Apart from them: the reactor's (`reactor`: who parks, until when;
//!    never taken under a peer's lock, as a follower looks at what it
//!    waits for, a peer's state under the peer's lock, holding it: a
//!    wake-up, `Engine::wake`, comes after the peer's lock went, checked
//!    in debug builds),
//!    the listeners' backlogs (`listener`: never held together with the
//!    engine's lock), the registration caches and the NICs' ladders
//!    (`crate::cache`, `crate::ladder`: registration and grants' MRs are
//!    made before the engine's lock is taken).
//!
//! The hand-off between a peer's lock and the engine's (when the pass is
//! due, where a completion goes) is `handoff`'s, checked by loom models.
//!
//! A thread waiting on one peer (a batch of the NIC's queue pairs, a
//! message, a grant) polls that peer's CQs alone for a spin
//! (`Engine::spin_home_until`; every 16th round whose own CQs gave
//! nothing the other CQs too, one thread of the engine at most every
//! 20 µs: `handoff::Sweeps`; `Batch::status` polls the same way) before
//! it joins the reactor; while it spins, its CQs are marked as its own
//! (`resources::Cqs::home`, an atomic count per CQ, no lock), and a poll
//! of every CQ by another thread (`Engine::progress`, the driver, those
//! every-16th rounds) passes them by: threads waiting on different peers
//! whose queue pairs sit on different CQs then share no CQ and take no
//! other peer's lock. While a driver runs (`Engine::spawn_driver`, the
//! engine's own thread, a tokio task), such a thread also leaves the
//! engine's pass and the other CQs to it, unless what it polled itself
//! needs the pass (an error completion, a receive behind a replaced queue
//! pair 0): a peer's waiter then never makes another peer's driver calls
//! (a GPU fence, a peer copy's steps).

mod batch;
mod batches;
mod completion;
mod cuda_worker;
mod error;
mod events;
mod fence;
mod gate;
mod handoff;
mod listener;
#[cfg(all(test, loom))]
mod loom_tests;
mod path;
mod peer;
mod peer_copy;
mod pipeline;
pub(crate) mod reactor;
mod region;
mod rendezvous;
mod resources;
mod staging;
#[cfg(all(feature = "tokio", not(loom)))]
mod tokio_driver;
// PCIe distances between GPUs and NICs: the tests' (feature `testing`).
#[cfg(feature = "testing")]
pub mod topology;
#[cfg(not(feature = "testing"))]
pub(crate) mod topology;
/// Connection set-up's state machines, from the sans-IO protocol crate
/// (feature `testing`; the errors they give are re-exported here).
#[cfg(feature = "testing")]
pub use gdr_proto::setup;
#[cfg(not(feature = "testing"))]
pub(crate) use gdr_proto::setup;
pub use gdr_proto::setup::{DialError, NotAccepted};
/// The control messages on the wire, from the sans-IO protocol crate
/// (feature `testing`: the fuzz targets and the hostile-peer tests forge
/// them).
#[cfg(feature = "testing")]
pub use gdr_proto::wire;
#[cfg(not(feature = "testing"))]
pub(crate) use gdr_proto::wire;

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use hal_verbs::{
    AccessFlags, Completion, CompletionQueue as _, ConnectParams, ConnectRequest as _,
    Connection as _, ConnectionManager as _, ConnectionState, Context as _, Listener as _,
    MemoryRegion as _, PostError, Posted, Provider as _, QpCaps, QueuePair as _, RecvRequest,
    SendFlags, SendOp, SendRequest, SgList, Sge,
};

use crate::buffer::Buffer;
use crate::cache::{CacheConfig, RegistrationCache};
use crate::descriptor::{GrantRights, MemoryDescriptor, MemoryLocation, Reach, Segment};
use crate::ladder::{DmabufExports, Gpu, Ladder, LadderConfig, MrGrant, Rung};
use crate::sync::{Mutex, lock};

pub use self::batch::Batch;
pub(crate) use self::batches::BatchId;
pub use self::batches::QpCounters;
use self::batches::{Action, Core, Keep, PeerConnection, QpId, QpLimits, single_work};
/// A request's completion, shared by the engine and the waiters (feature
/// `testing`: the benches wait on it bare).
#[cfg(feature = "testing")]
pub use self::completion::CompletionCell;
#[cfg(not(feature = "testing"))]
pub(crate) use self::completion::CompletionCell;
pub use self::completion::Outcome;
use self::completion::RevokedGrants;
use self::handoff::{Looked, Mark, PassDue, RouteCache};
pub use self::error::{
    EngineError, Error, HandshakeFailure, PeerGone, ReadOnlyUse, Refusal, SharedEngineError,
    TimedOut, TransferError, Unavailable, Unsupported, VerbsCall,
};
pub use self::listener::Listener;
use self::path::{PathCx, PeerView, RdmaOp, TransferPath, Wire};
pub use self::peer::{Grant, Peer};
pub use self::peer_copy::{PeerCopyRoute, PeerCopyStats};
pub use self::region::Region;
use self::resources::{Nic, Resources};
use self::peer_copy::{CopyPart, PeerCopyPath, PeerCopyPeer};
use self::staging::{PeerPart, StagedPeer};
use self::setup::{Admitted, Arrival, Backlog, BacklogConfig, Dial, DialState, Token};
#[cfg(all(feature = "tokio", not(loom)))]
pub use self::tokio_driver::{AsyncDriver, AsyncDriverError};
use self::wire::{Control, Hello, RejectReason, Role};
use gdr_proto::connection::{ConnectionConfig, Event, Received, SendRefused, Transmit};
use gdr_proto::peer_copy::Release;
use gdr_proto::receives::PostedReceives;
use gdr_proto::reconnect::{Backoff, Drained, OldQp, Replacement};
pub use gdr_proto::reconnect::{DialRefused, GiveUp};
pub use gdr_proto::{PeerLimits, PeerMisbehaved};

// The handshake and the reject ride in rdma_cm's private data.
const _: () = assert!(Hello::ENCODED_LEN <= hal_verbs::MAX_CONNECT_PRIVATE_DATA);
const _: () = assert!(Hello::ENCODED_LEN <= hal_verbs::MAX_ACCEPT_PRIVATE_DATA);
const _: () = assert!(RejectReason::ENCODED_LEN <= hal_verbs::MAX_REJECT_PRIVATE_DATA);

/// Where the engine's time comes from: the protocol (`gdr-proto`) reads no
/// clock; the driver asks this one.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Now.
    fn now(&self) -> Instant;
}

/// The system's monotonic clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// The engine's knobs. Defaults are for a NIC of today (see the README's
/// benchmark section for how they were chosen).
///
/// Made from [`EngineConfig::default`] and the `with_` setters (one per
/// field); the fields can also be read, and set on a `mut` value. The
/// struct is `#[non_exhaustive]`: a field can be added without breaking
/// callers, so it cannot be written as a struct literal outside this crate.
///
/// ```
/// use std::time::Duration;
/// use gdr_core::EngineConfig;
///
/// let config = EngineConfig::default()
///     .with_qps_per_peer(4)
///     .with_default_timeout(Duration::from_secs(5));
/// assert_eq!(config.qps_per_peer, 4);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EngineConfig {
    /// RC queue pairs per peer.
    pub qps_per_peer: u16,
    /// Peers connected at once at most (accepted and connected together):
    /// one more is refused ([`Refusal::PeerLimit`]; a connecting peer is
    /// rejected `Busy`). Each NIC's completion queues are sized for this
    /// many peers' queue pairs (`qps_per_peer` × (`qp_depth` +
    /// `recv_depth`) completions each), spread over its
    /// [`cqs_per_nic`](EngineConfig::cqs_per_nic) queues and brought down
    /// to what the device allows (`max_cqe` each): the bound is then what
    /// fits. Default 256: about 82,000 completions per NIC with the other
    /// defaults (5 MiB of CQ on a ConnectX, 64-byte entries); raise it for
    /// more peers.
    pub max_peers: usize,
    /// Completion queues per NIC. Each new queue pair goes on the one with
    /// the fewest, so peers waited on by different threads complete on
    /// different queues: a thread waiting on its batch polls its peer's
    /// queues alone and takes no other peer's completions (one queue for
    /// every peer makes the waiters of one engine share it, and its lock
    /// in the provider). Each queue holds its share of `max_peers`' queue
    /// pairs, so the memory is that of one queue. Default: this machine's
    /// cores, at most 32 (one queue per thread a machine runs: with fewer
    /// queues than threads waiting on their own peers, threads share a
    /// queue and take each other's completions, and the scaling benchmark
    /// loses a share of its rate); at most `max_peers` × `qps_per_peer`.
    pub cqs_per_nic: u16,
    /// Work requests in flight per queue pair.
    pub qp_depth: u32,
    /// Ask for a completion every this many work requests (and at the end
    /// of each post).
    pub signal_every: u32,
    /// Largest single RDMA request: larger transfers are cut into slices
    /// of this size, spread over the peer's queue pairs.
    pub slice_size: u64,
    /// WRITEs of host memory up to this many bytes go inline (the CPU
    /// copies them into the work request); never GPU memory. 0: never.
    pub inline_threshold: u32,
    /// Largest control message this engine receives (header included):
    /// a peer's [`Peer::send`] carries at most this less
    /// [`wire::HEADER_LEN`] bytes of payload.
    pub max_message: u32,
    /// Receives kept posted for control messages.
    pub recv_depth: u16,
    /// Bound on a batch or message without a deadline of its own.
    pub default_timeout: Duration,
    /// How long a failed queue pair may take to be re-established (the
    /// connecting side reconnects it, the accepting side waits for that)
    /// before it is given up; work queued for it meanwhile waits.
    pub reconnect_timeout: Duration,
    /// Connecting peers that may wait at a listener for
    /// [`Listener::accept`] at once (each a session of queue pairs,
    /// connected as they arrive): a new one beyond them is refused with
    /// [`wire::RejectReason::Busy`] ([`EngineError::Rejected`] on its
    /// side), so a peer cannot make a listener hold connections without
    /// bound. Default [`setup::DEFAULT_BACKLOG`] (16); brought into
    /// `1..=`[`setup::MAX_BACKLOG`].
    pub accept_backlog: usize,
    /// How long a connecting peer may wait at a listener for accept, from
    /// its first queue pair: past it, its queue pairs are disconnected
    /// (the connector, if still waiting, gets [`EngineError::NotAccepted`]).
    /// Default [`setup::DEFAULT_ACCEPT_DEADLINE`] (10 s); brought into
    /// [`setup::MIN_ACCEPT_DEADLINE`]`..=`[`setup::MAX_ACCEPT_DEADLINE`].
    pub accept_timeout: Duration,
    /// The queue pairs' connection parameters (caps are derived from the
    /// fields above).
    pub connect: ConnectParams,
    /// NICs to use, by name; `None`: every NIC the provider lists.
    pub devices: Option<Vec<String>>,
    /// The registration ladder of each NIC.
    pub ladder: LadderConfig,
    /// The registration cache shared by the NICs.
    pub cache: CacheConfig,
    /// Bytes of one slot of a GPU's staging pool (a slice of the pipeline),
    /// and of each landing slot of a rendezvous.
    /// Default 1 MiB with 8 slots: on the H200 over the sim NIC (`bench
    /// staging` with `GDR_STAGING_SWEEP=1`, 256 MiB GPU→host) every slice
    /// of 1-16 MiB and 2-16 slots ran within 5.2-7.1 GiB/s, bound by the
    /// sim NIC's CPU copy (the wire); for a rendezvous (16 MiB, staged GPU
    /// to staged GPU and host to staged GPU, `GDR_STAGING_SWEEP=rendezvous`)
    /// 1 MiB × 8 landing slots was the fastest of 0.5-4 MiB × 2-16: 0.91 ×
    /// the wire alone, against 0.87-0.88 for 2 MiB × 8 and 0.85 for 2 MiB ×
    /// 4 (smaller slices start the first copy sooner and end the last one
    /// sooner; more of them keep the wire busy while a round trip of
    /// credits runs). 1 MiB × 8 keeps 8 MiB pinned per GPU and 8 MiB per
    /// peer. Re-measure on a machine with a GPU and a NIC.
    pub staging_slice: u64,
    /// Slots of each GPU's staging pool (slices in flight at most).
    pub staging_slots: usize,
    /// GPU memory of a peer on this host (another engine of this process,
    /// or of another process through CUDA IPC) is moved by device copies,
    /// over NVLink where the GPUs have it, instead of through a NIC (see
    /// `peer_copy`). A trust decision: a peer process of this host is
    /// sent the CUDA IPC handle of each allocation it is granted part of,
    /// which opens the whole allocation; `false` keeps every transfer on
    /// the NIC and sends no handle.
    pub peer_copy: bool,
    /// Largest single device copy of the peer-copy path: larger transfers
    /// are cut into slices of this size spread over a few streams (and
    /// queued a few at a time, so that a revoke stops a transfer within
    /// about `8 x peer_copy_slice` bytes).
    pub peer_copy_slice: u64,
    /// How long a revoked grant's memory is kept for a peer process that
    /// had its CUDA IPC handle and has not answered that it released it
    /// (`peer_copy`): past it the memory is given back unconfirmed (a
    /// peer that does not cooperate cannot be fenced; `peer_copy: false`
    /// sends no handle).
    pub peer_copy_release_timeout: Duration,
    /// Landing slots (of `staging_slice` bytes, pinned, registered once)
    /// this engine lends each peer that asks for a rendezvous on its
    /// staging-rung memory: that peer's slices in flight at most
    /// (`rendezvous`).
    pub rendezvous_slots: usize,
    /// Where the PCI tree is read (which NIC is nearest each GPU: a
    /// transfer of GPU memory goes over the peer's queue pairs on the
    /// nearest NICs when any is up).
    pub topology: topology::PciTopology,
    /// Where time comes from.
    pub clock: Arc<dyn Clock>,
    /// What one peer may make this engine hold (grants it announced,
    /// messages not yet received, staged requests), and for how long: past
    /// a bound its request is refused or the peer dropped, by name
    /// ([`gdr_proto::PeerMisbehaved`]).
    pub peer_limits: PeerLimits,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            qps_per_peer: 2,
            max_peers: 256,
            cqs_per_nic: std::thread::available_parallelism()
                .map_or(1, |n| n.get().min(32) as u16),
            qp_depth: 128,
            signal_every: 16,
            slice_size: 1 << 20,
            inline_threshold: 0,
            max_message: 4096,
            recv_depth: 32,
            default_timeout: Duration::from_secs(30),
            reconnect_timeout: Duration::from_secs(10),
            accept_backlog: setup::DEFAULT_BACKLOG,
            accept_timeout: setup::DEFAULT_ACCEPT_DEADLINE,
            connect: ConnectParams::default(),
            devices: None,
            ladder: LadderConfig::default(),
            cache: CacheConfig::default(),
            staging_slice: 1 << 20,
            staging_slots: 8,
            peer_copy: true,
            peer_copy_slice: 64 << 20,
            peer_copy_release_timeout: Duration::from_secs(10),
            rendezvous_slots: 8,
            topology: topology::PciTopology::system(),
            clock: Arc::new(SystemClock),
            peer_limits: PeerLimits::default(),
        }
    }
}

impl EngineConfig {
    /// Sets [`EngineConfig::qps_per_peer`].
    #[must_use]
    pub fn with_qps_per_peer(mut self, qps_per_peer: u16) -> Self {
        self.qps_per_peer = qps_per_peer;
        self
    }

    /// Sets [`EngineConfig::max_peers`].
    #[must_use]
    pub fn with_max_peers(mut self, max_peers: usize) -> Self {
        self.max_peers = max_peers;
        self
    }

    /// Sets [`EngineConfig::cqs_per_nic`].
    #[must_use]
    pub fn with_cqs_per_nic(mut self, cqs_per_nic: u16) -> Self {
        self.cqs_per_nic = cqs_per_nic;
        self
    }

    /// Sets [`EngineConfig::qp_depth`].
    #[must_use]
    pub fn with_qp_depth(mut self, qp_depth: u32) -> Self {
        self.qp_depth = qp_depth;
        self
    }

    /// Sets [`EngineConfig::signal_every`].
    #[must_use]
    pub fn with_signal_every(mut self, signal_every: u32) -> Self {
        self.signal_every = signal_every;
        self
    }

    /// Sets [`EngineConfig::slice_size`].
    #[must_use]
    pub fn with_slice_size(mut self, slice_size: u64) -> Self {
        self.slice_size = slice_size;
        self
    }

    /// Sets [`EngineConfig::inline_threshold`].
    #[must_use]
    pub fn with_inline_threshold(mut self, inline_threshold: u32) -> Self {
        self.inline_threshold = inline_threshold;
        self
    }

    /// Sets [`EngineConfig::max_message`].
    #[must_use]
    pub fn with_max_message(mut self, max_message: u32) -> Self {
        self.max_message = max_message;
        self
    }

    /// Sets [`EngineConfig::recv_depth`].
    #[must_use]
    pub fn with_recv_depth(mut self, recv_depth: u16) -> Self {
        self.recv_depth = recv_depth;
        self
    }

    /// Sets [`EngineConfig::default_timeout`].
    #[must_use]
    pub fn with_default_timeout(mut self, default_timeout: Duration) -> Self {
        self.default_timeout = default_timeout;
        self
    }

    /// Sets [`EngineConfig::reconnect_timeout`].
    #[must_use]
    pub fn with_reconnect_timeout(mut self, reconnect_timeout: Duration) -> Self {
        self.reconnect_timeout = reconnect_timeout;
        self
    }

    /// Sets [`EngineConfig::accept_backlog`].
    #[must_use]
    pub fn with_accept_backlog(mut self, accept_backlog: usize) -> Self {
        self.accept_backlog = accept_backlog;
        self
    }

    /// Sets [`EngineConfig::accept_timeout`].
    #[must_use]
    pub fn with_accept_timeout(mut self, accept_timeout: Duration) -> Self {
        self.accept_timeout = accept_timeout;
        self
    }

    /// Sets [`EngineConfig::connect`].
    #[must_use]
    pub fn with_connect(mut self, connect: ConnectParams) -> Self {
        self.connect = connect;
        self
    }

    /// Sets [`EngineConfig::devices`]: only the NICs named (`Some`).
    #[must_use]
    pub fn with_devices(mut self, devices: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.devices = Some(devices.into_iter().map(Into::into).collect());
        self
    }

    /// Sets [`EngineConfig::ladder`].
    #[must_use]
    pub fn with_ladder(mut self, ladder: LadderConfig) -> Self {
        self.ladder = ladder;
        self
    }

    /// Sets [`EngineConfig::cache`].
    #[must_use]
    pub fn with_cache(mut self, cache: CacheConfig) -> Self {
        self.cache = cache;
        self
    }

    /// Sets [`EngineConfig::staging_slice`].
    #[must_use]
    pub fn with_staging_slice(mut self, staging_slice: u64) -> Self {
        self.staging_slice = staging_slice;
        self
    }

    /// Sets [`EngineConfig::staging_slots`].
    #[must_use]
    pub fn with_staging_slots(mut self, staging_slots: usize) -> Self {
        self.staging_slots = staging_slots;
        self
    }

    /// Sets [`EngineConfig::peer_copy`].
    #[must_use]
    pub fn with_peer_copy(mut self, peer_copy: bool) -> Self {
        self.peer_copy = peer_copy;
        self
    }

    /// Sets [`EngineConfig::peer_copy_slice`].
    #[must_use]
    pub fn with_peer_copy_slice(mut self, peer_copy_slice: u64) -> Self {
        self.peer_copy_slice = peer_copy_slice;
        self
    }

    /// Sets [`EngineConfig::peer_copy_release_timeout`].
    #[must_use]
    pub fn with_peer_copy_release_timeout(mut self, peer_copy_release_timeout: Duration) -> Self {
        self.peer_copy_release_timeout = peer_copy_release_timeout;
        self
    }

    /// Sets [`EngineConfig::rendezvous_slots`].
    #[must_use]
    pub fn with_rendezvous_slots(mut self, rendezvous_slots: usize) -> Self {
        self.rendezvous_slots = rendezvous_slots;
        self
    }

    /// Sets [`EngineConfig::topology`].
    #[must_use]
    pub fn with_topology(mut self, topology: topology::PciTopology) -> Self {
        self.topology = topology;
        self
    }

    /// Sets [`EngineConfig::clock`].
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Sets [`EngineConfig::peer_limits`].
    #[must_use]
    pub fn with_peer_limits(mut self, peer_limits: PeerLimits) -> Self {
        self.peer_limits = peer_limits;
        self
    }
}

/// The top bit of a receive's `wr_id`: send-queue ids come from the core.
const RECV_BIT: u64 = 1 << 63;

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(0);

/// A fresh nonzero id: time, process and a counter mixed, so that engines
/// of two processes (or two runs) do not collide.
fn fresh_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = nanos
        ^ (u64::from(std::process::id()) << 32)
        ^ NEXT_ENGINE
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    // splitmix64's finaliser spreads the bits.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    x.max(1)
}

/// One queue pair of a peer.
struct PeerQp {
    conn: resources::SeatedConnection,
    nic: usize,
    core: QpId,
    max_inline: u32,
    /// Where it was connected to: the connecting side re-establishes it
    /// over this path; `None` on the accepting side.
    path: Option<Path>,
    /// A new connection the peer made for this index while the old one
    /// still drains: installed once it has.
    replacement: Option<resources::SeatedConnection>,
}

/// The host buffers of a peer's control messages.
struct ControlBuffers {
    recv: Buffer,
    recv_region: Region,
    /// Where each receive slot is posted (by NIC and queue pair number),
    /// and in which order: completions handed to the peer in either order
    /// are taken in their queue pair's. A slot posted on a queue pair 0
    /// that was replaced comes back (flushed, or with a message) before
    /// it is reposted.
    receives: PostedReceives<(usize, u32), ControlReceive>,
    send: Buffer,
    send_region: Region,
    free_send: Arc<std::sync::Mutex<Vec<usize>>>,
    slot: usize,
}

struct PeerState {
    addr: SocketAddr,
    /// This engine's id (regions of another engine are refused).
    local_engine: u64,
    qps: Vec<PeerQp>,
    peer_recv_depth: u32,
    /// Replaced queue pairs 0 whose receives have not all come back.
    retired: Vec<resources::SeatedConnection>,
    control: ControlBuffers,
    /// Receives left to the engine's pass, in the order they came: any
    /// while `retired` is not empty (the routes of those go under the
    /// engine's lock), and every receive after them, so that the peer's
    /// messages are handled in order.
    for_pass: std::collections::VecDeque<ControlReceive>,
    /// The grants the peer told this side it revoked (bounded): a
    /// descriptor of one is refused as revoked, not as unknown, and a
    /// batch its owner's NIC refused under one failed for the revocation.
    revoked: Arc<RevokedGrants>,
    next_qp: usize,
    gone: Option<PeerGone>,
}

/// Control messages a peer may have waiting for a send slot.
const MAX_OUTBOX: usize = 1 << 16;

/// What an engine holds ([`Engine::resources`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineResources {
    /// Drivers running: threads of `spawn_driver`, the engine's own
    /// thread, tokio tasks.
    pub drivers: usize,
    /// Whether the engine's own progress thread runs.
    pub own_driver: bool,
    /// Batches on queue pairs not ended.
    pub batches: usize,
    /// Staged transfers going through a staging pool.
    pub staged_transfers: usize,
    /// Posts of several staged transfers not ended.
    pub staged_groups: usize,
    /// Each peer the engine holds (closed ones included until the engine
    /// goes).
    pub peers: Vec<PeerResources>,
    /// Pinned bytes of the engine's stream-fence page (made at the first
    /// stream fence or gated batch, 0 before): the one thing the engine
    /// keeps after it is dropped, for the life of the process, since a
    /// stream may still read or write its words later.
    pub fence_page_bytes: u64,
    /// Queue pairs seated on each completion queue, NIC by NIC
    /// ([`EngineConfig::cqs_per_nic`] each): a drained one gives its seat
    /// back.
    pub cq_queue_pairs: Vec<usize>,
}

/// What an engine holds for one peer ([`EngineResources::peers`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerResources {
    /// The peer's engine id.
    pub remote_engine: u64,
    /// Whether the peer is gone (closed, failed, given up).
    pub gone: bool,
    /// Queue pairs to it.
    pub queue_pairs: usize,
    /// This side's grants announced to it and not revoked.
    pub grants_announced: usize,
    /// Its grants to this side (bounded by the engine's limit).
    pub remote_grants: usize,
    /// The CUDA IPC handles of its grants, for the peer-copy path
    /// (bounded like its grants).
    pub ipc_handles: usize,
    /// Its messages not yet received (bounded by count and bytes).
    pub inbox_messages: usize,
    /// Their bytes.
    pub inbox_bytes: usize,
    /// This side's control messages waiting for a send slot (bounded).
    pub outbox_messages: usize,
    /// This side's grants of staging-rung memory to it: live, or revoked
    /// while a request under them still runs.
    pub staged_grants: usize,
    /// Its requests served through the landing slots lent to it (bounded).
    pub requests_served: usize,
    /// Copies into or out of those slots running.
    pub copies: usize,
    /// This side's requests through its landing slots.
    pub requests_asked: usize,
}

impl PeerState {
    /// Queues control message `message` for the peer, to go out by
    /// `now + timeout`; the cell ends when the peer's NIC has it.
    fn enqueue(
        &mut self,
        core: &mut Core,
        message: &Control<'_>,
        now: Instant,
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError> {
        let len = message.encoded_len();
        let max = core.conn.peer_max_message();
        if len > max {
            return Err(EngineError::MessageTooLarge { len, max });
        }
        let mut bytes = vec![0; len];
        message.encode_into(&mut bytes)?;
        self.enqueue_bytes(core, bytes, now, timeout)
    }

    /// Queues the encoded control message `bytes` (see [`Self::enqueue`]).
    fn enqueue_bytes(
        &mut self,
        core: &mut Core,
        bytes: Vec<u8>,
        now: Instant,
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError> {
        if let Some(why) = &self.gone {
            return Err(EngineError::PeerGone(why.clone()));
        }
        let cell = Arc::new(CompletionCell::new());
        core.conn
            .send(bytes, Arc::clone(&cell), now, timeout)
            .map_err(|(refused, _)| match refused {
                SendRefused::TooLarge { len, max } => EngineError::MessageTooLarge { len, max },
                SendRefused::Full(full) => EngineError::Refused(full.into()),
                SendRefused::Goodbye => EngineError::PeerGone(PeerGone::ClosedByPeer),
            })?;
        Ok(cell)
    }

    /// Moves waiting control messages into free send slots and hands them
    /// to the core; fails those past their deadline.
    fn flush_outbox(&mut self, core: &mut Core, now: Instant) {
        loop {
            let free_send = || {
                self.control
                    .free_send
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
            };
            // Queue pair 0 being re-established, or no send slot free:
            // only what expired comes out. (Slots only come back meanwhile:
            // one seen free here is there to take below.)
            let can_send = core.is_ready(self.qps[0].core) && !free_send().is_empty();
            let message = match core.conn.poll_transmit(now, can_send) {
                None => break,
                Some(Transmit::Expired(late)) => {
                    late.token.complete(Err(TransferError::Timeout(TimedOut {
                        after: late.timeout,
                    })));
                    continue;
                }
                Some(Transmit::Send(message)) => message,
            };
            let Some(slot) = free_send().pop() else {
                message.token.complete(Err(TransferError::Internal {
                    what: "the send slot seen free was taken",
                }));
                continue;
            };
            let guard = SendSlot {
                free: Arc::clone(&self.control.free_send),
                slot,
            };
            let offset = (slot * self.control.slot) as u64;
            if let Err(e) = self.control.send.write_at(offset, &message.bytes) {
                message
                    .token
                    .complete(Err(TransferError::SendBuffer { source: e }));
                continue;
            }
            let qp = &self.qps[0];
            let Some(mr) = self.control.send_region.inner.per_nic[qp.nic].mr() else {
                message.token.complete(Err(TransferError::Internal {
                    what: "the send buffer has no MR",
                }));
                continue;
            };
            let mut flags = SendFlags::empty();
            if message.bytes.len() <= qp.max_inline as usize {
                flags |= SendFlags::INLINE;
            }
            let keep: Vec<Keep> = vec![
                Arc::new(guard) as Keep,
                Arc::clone(&self.control.send_region.inner) as Keep,
            ];
            let work = single_work(
                SendOp::Send,
                self.control.send_region.inner.addr + offset,
                message.bytes.len() as u32,
                mr.lkey(),
                flags,
            );
            core.submit(
                vec![(qp.core, work)],
                message.token,
                message.deadline.map(|at| (at, message.timeout)),
                keep,
            );
        }
    }
}

/// What the engine's lock guards: the peers' slots (each under its own
/// lock), what is shared by them (queue pairs being re-established) and
/// the paths.
struct State {
    /// Each peer's slot, by number (never reused: a slot whose peer went
    /// stays, empty).
    slots: Vec<Arc<PeerLock>>,
    /// Queue pairs being re-established.
    reconnecting: usize,
    /// Whether a peer's part of a path, as the last pass saw them, runs
    /// what only polling sees end (GPU copies).
    peers_poll: bool,
}

/// A peer's own state, under the peer's lock ([`lock_slot`]): its
/// connection (its batches included) and its transport.
struct PeerSlot {
    /// The peer's connection ([`gdr_proto::connection`]: batches, recovery,
    /// grants both ways, inbox, outbox), kept after a tear-down (its
    /// batches all ended then) for a batch handle's late cancel.
    core: Core,
    /// `None` once the peer was torn down.
    peer: Option<PeerState>,
    /// Requests taken from the core for one post.
    to_post: Vec<SendRequest>,
    /// The staged path's part of the peer: both sides of its rendezvous
    /// (kept after a tear-down until the copies for it have ended).
    staged: StagedPeer,
    /// The peer-copy path's part of the peer: where it runs, its grants'
    /// IPC handles, the GPU side of this side's batches to it (kept after
    /// a tear-down until the copies end; their windows, our exports and
    /// the releases owed are the connection's).
    copy: PeerCopyPeer,
}

/// A peer's lock, and the mark its holders leave for the engine's pass
/// outside it ([`handoff::PeerMark`]: the pass takes the lock only of a
/// peer the mark says has something for it).
struct PeerLock {
    slot: Mutex<PeerSlot>,
    /// Its number in the engine's table of slots.
    index: usize,
    mark: handoff::PeerMark,
    /// The peer's control receives polls took (in any order: two threads'
    /// runs of one CQ come in either), until a holder of the peer's lock
    /// takes them, in order (`Engine::take_receives`).
    inbound: Mutex<Vec<ControlReceive>>,
    /// The engine's passes in a row that found the lock busy when they
    /// came to poll the peer's connection events (`poll_connections`),
    /// written by the pass alone.
    events_skipped: std::sync::atomic::AtomicU32,
}

impl PeerLock {
    fn new(index: usize, slot: PeerSlot, base: Instant) -> Self {
        Self {
            slot: Mutex::new(slot),
            index,
            mark: handoff::PeerMark::new(base),
            inbound: Mutex::new(Vec::new()),
            events_skipped: std::sync::atomic::AtomicU32::new(0),
        }
    }
}

/// Passes in a row that may find a peer's lock busy and leave its
/// connection events to a later one ([`Engine::poll_connections`]): then
/// one waits for the lock.
const EVENTS_SKIPPED_MAX: u32 = 8;

/// Where a completion of one queue pair goes ([`handoff::Route`]).
type Route = handoff::Route<PeerLock>;

/// What the engine's batches and GPU streams wait on each other with
/// (`Shared::streams`, a lock of its own: see the module docs).
#[derive(Default)]
struct Streams {
    /// The page of words streams wait on (made at the first stream fence
    /// or gate) and the stream fences whose batch has not ended.
    stream_fences: fence::StreamFences,
    /// Batches held until a stream reaches their gate.
    gates: gate::Gates,
}

/// What the engine's pass leaves of the streams' work for its caller and
/// its next look: the GPU fences claimed for stream releases, whether
/// opened gates are to be served, whether the work is polled.
struct StreamsLooked {
    handled: usize,
    flushes: Vec<(usize, Vec<u32>)>,
    serve: bool,
    again: bool,
}

impl Streams {
    /// The pass's look at the gates and stream fences (the peers' views
    /// through `slots`, each under its lock, taken for one call): gates
    /// the stream reached open, those that ended end their batch; ended
    /// batches' stream fences are released, those needing a GPU fence
    /// first claimed (made outside every lock).
    fn look(&mut self, res: &Resources, slots: &[Arc<PeerLock>], now: Instant) -> StreamsLooked {
        let mut wire = Connections { slots, res };
        let mut cx = PathCx {
            res,
            wire: &mut wire,
            now,
        };
        let mut handled = self.gates.poll(&mut cx, &mut self.stream_fences);
        let flushes = self.stream_fences.claim_flushes();
        handled += self.stream_fences.release();
        StreamsLooked {
            handled,
            serve: self.gates.serve_pending(),
            again: self.gates.waiting() || !flushes.is_empty() || self.stream_fences.busy(),
            flushes,
        }
    }
}

/// Takes the streams' lock (`Shared::streams`) to change what it guards
/// (a stream fence queued, a gate waiting): the pass is due as it goes.
/// Under the engine's lock, or alone; never under a peer's.
fn lock_streams(shared: &Shared) -> Guard<'_, Streams> {
    let mut guard = look_at_streams(shared);
    guard.due = Some(&shared.due);
    guard
}

/// Takes the streams' lock for the pass, or to look only.
fn look_at_streams(shared: &Shared) -> Guard<'_, Streams> {
    lock_order::streams();
    let inside = crate::reaper::EngineSection::enter();
    Guard {
        guard: lock(&shared.streams),
        _held: None,
        _inside: inside,
        due: None,
    }
}

impl State {
    /// The peer in `slot`'s lock, taken (under the engine's: the order).
    fn slot(&self, slot: usize) -> SlotGuard<'_> {
        lock_slot(&self.slots[slot])
    }
}

/// The peers' connections as the paths see them ([`path::Wire`]): each
/// peer's core (which posts on its queue pairs) and its control channel,
/// each under the peer's lock, taken for one call.
struct Connections<'a> {
    slots: &'a [Arc<PeerLock>],
    res: &'a Resources,
}

impl Wire for Connections<'_> {
    fn peer(&self, slot: usize) -> Option<PeerView> {
        lock_slot(self.slots.get(slot)?).parts().view()
    }

    fn send(
        &mut self,
        slot: usize,
        message: &Control<'_>,
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError> {
        let lock = self
            .slots
            .get(slot)
            .ok_or(EngineError::PeerGone(PeerGone::Closed))?;
        lock_slot(lock).parts().send(self.res, message, timeout)
    }

    fn post_rdma(
        &mut self,
        slot: usize,
        gpu: Option<u32>,
        spread: usize,
        rdma: RdmaOp<'_>,
        deadline: (Instant, Duration),
    ) -> Result<Arc<CompletionCell>, Option<TransferError>> {
        let Some(lock) = self.slots.get(slot) else {
            return Err(Some(TransferError::PeerGone(PeerGone::Closed)));
        };
        lock_slot(lock)
            .parts()
            .post_rdma(self.res, gpu, spread, rdma, deadline)
    }
}

/// The wire to the one peer whose lock the caller holds (a path's calls
/// about that peer, with its part from the peer's slot): any other peer
/// is not there for it.
struct SlotWire<'a> {
    slot: usize,
    parts: PeerParts<'a>,
    res: &'a Resources,
}

impl Wire for SlotWire<'_> {
    fn peer(&self, slot: usize) -> Option<PeerView> {
        (slot == self.slot).then(|| self.parts.view())?
    }

    fn send(
        &mut self,
        slot: usize,
        message: &Control<'_>,
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError> {
        // A step for one peer reaches no other (as if gone).
        debug_assert_eq!(slot, self.slot, "a path's step for one peer sent to another");
        if slot != self.slot {
            return Err(EngineError::PeerGone(PeerGone::Closed));
        }
        self.parts.send(self.res, message, timeout)
    }

    fn post_rdma(
        &mut self,
        slot: usize,
        gpu: Option<u32>,
        spread: usize,
        rdma: RdmaOp<'_>,
        deadline: (Instant, Duration),
    ) -> Result<Arc<CompletionCell>, Option<TransferError>> {
        debug_assert_eq!(slot, self.slot, "a path's step for one peer posted to another");
        if slot != self.slot {
            return Err(Some(TransferError::PeerGone(PeerGone::Closed)));
        }
        self.parts.post_rdma(self.res, gpu, spread, rdma, deadline)
    }
}

/// Runs `f` with a path step's context at `now` on the wire to the peer
/// in `slot` (its lock held: `slot_state`) and the peer-copy path's part
/// of it.
fn on_slot_copy<T>(
    res: &Resources,
    slot: usize,
    now: Instant,
    slot_state: &mut PeerSlot,
    f: impl FnOnce(&mut PathCx<'_>, &mut CopyPart<'_>) -> T,
) -> T {
    let (parts, copy) = slot_state.split_copy();
    // The connection's peer-copy state is lent to the step, as its
    // rendezvous is to the staged path's (see `on_slot`).
    let mut proto = parts.core.conn.lend_peer_copy();
    let mut wire = SlotWire { slot, parts, res };
    let out = f(
        &mut PathCx {
            res,
            wire: &mut wire,
            now,
        },
        &mut CopyPart {
            copy,
            proto: &mut proto,
        },
    );
    wire.parts.core.conn.return_peer_copy(proto);
    out
}

/// Runs `f` with a path step's context at `now` on the wire to the peer
/// in `slot` (its lock held: `slot_state`) and the staged path's part of
/// it.
fn on_slot<T>(
    res: &Resources,
    slot: usize,
    now: Instant,
    slot_state: &mut PeerSlot,
    f: impl FnOnce(&mut PathCx<'_>, &mut PeerPart<'_>) -> T,
) -> T {
    let (parts, staged) = slot_state.split();
    // The connection's rendezvous is lent to the step, while the wire
    // beside it reaches the rest of the connection (its messages, its
    // queue pairs); returned before the peer's lock goes.
    let mut rendezvous = parts.core.conn.lend_rendezvous();
    let mut wire = SlotWire { slot, parts, res };
    let out = f(
        &mut PathCx {
            res,
            wire: &mut wire,
            now,
        },
        &mut PeerPart {
            staged,
            rendezvous: &mut rendezvous,
        },
    );
    wire.parts.core.conn.return_rendezvous(rendezvous);
    out
}

/// A peer slot's connection side, borrowed apart from the paths' parts
/// beside it ([`PeerSlot::split`]).
struct PeerParts<'a> {
    core: &'a mut Core,
    peer: &'a mut Option<PeerState>,
    to_post: &'a mut Vec<SendRequest>,
}

impl PeerParts<'_> {
    /// Posts what the core has ready on the peer's queue pairs, control
    /// messages waiting for a send slot first.
    fn post(&mut self, now: Instant) {
        let PeerParts { core, peer, to_post } = self;
        let Some(peer) = peer.as_mut() else {
            return;
        };
        if core.conn.outbox_len() > 0 {
            peer.flush_outbox(core, now);
        }
        for qp in &peer.qps {
            if !core.has_postable(qp.core) {
                continue;
            }
            core.take_postable(qp.core, to_post);
            let taken = to_post.len();
            // SAFETY: every SG entry lies in a registration held by its
            // batch (the batch keeps the regions) until the core retires
            // the request after its completion or flush.
            if let Err(PostError { posted, error }) = unsafe { qp.conn.qp().post_send(to_post) } {
                let accepted = match posted {
                    Posted::Prefix(n) => Some(n),
                    Posted::Unknown => None,
                };
                core.post_failed(
                    qp.core,
                    taken,
                    accepted,
                    TransferError::PostFailed { source: error },
                );
            }
        }
    }

    /// What a path knows of the peer, if it is there.
    fn view(&self) -> Option<PeerView> {
        let peer = self.peer.as_ref()?;
        Some(PeerView {
            engine: self.core.conn.peer_engine(),
            session: self.core.conn.session(),
            gone: peer.gone.clone(),
        })
    }

    /// Queues control message `message`, to go out within `timeout`, and
    /// posts what is ready.
    fn send(
        &mut self,
        res: &Resources,
        message: &Control<'_>,
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError> {
        let now = res.config.clock.now();
        let peer = self
            .peer
            .as_mut()
            .ok_or(EngineError::PeerGone(PeerGone::Closed))?;
        let cell = peer.enqueue(self.core, message, now, timeout)?;
        self.post(now);
        Ok(cell)
    }

    /// [`Wire::post_rdma`] on this peer's queue pairs.
    fn post_rdma(
        &mut self,
        res: &Resources,
        gpu: Option<u32>,
        spread: usize,
        RdmaOp {
            op,
            remote,
            remote_at,
            local,
            local_addr,
            len,
        }: RdmaOp<'_>,
        (deadline, timeout): (Instant, Duration),
    ) -> Result<Arc<CompletionCell>, Option<TransferError>> {
        let core = &mut *self.core;
        let Some(peer) = self.peer.as_ref() else {
            return Err(Some(TransferError::PeerGone(PeerGone::Closed)));
        };
        // The queue pairs that are up (else those being re-established),
        // on the NICs nearest the GPU when one of those is among them.
        let qps = peer.qps.iter().enumerate();
        let up: Vec<_> = match peer.qps.iter().any(|q| core.is_ready(q.core)) {
            true => qps.filter(|(_, q)| core.is_ready(q.core)).collect(),
            false => qps.filter(|(_, q)| core.accepts_work(q.core)).collect(),
        };
        let near: Vec<_> = match gpu.and_then(|g| res.nearest_nics.get(&g)) {
            Some(nics) => up
                .iter()
                .copied()
                .filter(|(_, q)| nics.contains(&q.nic))
                .collect(),
            None => Vec::new(),
        };
        let candidates = if near.is_empty() { &up } else { &near };
        let Some(&(index, qp)) = candidates.get(spread % candidates.len().max(1)) else {
            return Err(Some(TransferError::PeerGone(
                PeerGone::EveryQueuePairFailed,
            )));
        };
        let device = core.conn.remote_device(index).unwrap_or("");
        let segment = remote
            .segment(device, remote_at, len)
            .map_err(|source| Some(TransferError::RemoteSegment { source }))?;
        let Some(mr) = local.inner.per_nic[qp.nic].mr() else {
            return Err(Some(TransferError::Internal {
                what: "the local memory has no MR",
            }));
        };
        let rdma = op.send_op(segment.addr + (remote_at - segment.offset), segment.rkey);
        let work = single_work(rdma, local_addr, len as u32, mr.lkey(), SendFlags::empty());
        let cell = Arc::new(CompletionCell::new());
        let keep: Vec<Keep> = vec![Arc::clone(&local.inner) as Keep];
        core.submit(
            vec![(qp.core, work)],
            Arc::clone(&cell),
            Some((deadline, timeout)),
            keep,
        );
        self.post(res.config.clock.now());
        Ok(cell)
    }
}

struct Shared {
    // Field order is drop order: connections (in the state and the
    // routes) before the NICs' CQs, PDs and contexts (in the resources).
    state: Mutex<State>,
    /// Each GPU's staging pool, shared by the peers' staged parts (its
    /// own lock: see the module docs).
    pools: staging::StagingPools,
    /// What the peer-copy path shares among the peers' parts (streams,
    /// IPC mappings, peer access: its own lock, taken under a peer's).
    peer_copy: peer_copy::PeerCopyShared,
    /// The stream fences and gates (their own lock: see the module docs).
    streams: Mutex<Streams>,
    /// Each queue pair's route, by (NIC, queue pair number): completions
    /// go to their peer without the engine's lock ([`handoff::Routes`]).
    routes: handoff::Routes<PeerLock>,
    /// NICs that reported a fatal error: nothing on them is polled or
    /// re-established. Set under the engine's lock.
    dead_nics: Box<[std::sync::atomic::AtomicBool]>,
    /// What the engine's own pass must look at soon ([`PassDue`]).
    due: PassDue,
    /// When a thread spinning on its own CQs also polls the others.
    sweeps: handoff::Sweeps,
    res: Arc<Resources>,
    /// Drivers running (threads of [`Engine::spawn_driver`], the engine's
    /// own thread, tasks of `Engine::drive_on_tokio`): while there is one,
    /// a pending `Future` only registers its waker; with none, it starts
    /// the engine's own thread.
    drivers: Arc<std::sync::atomic::AtomicUsize>,
    /// Whether the engine's own progress thread runs (started where work
    /// only progress serves has no driver: a staging-rung grant, control
    /// messages held back, a peer copy, a gate, a stream fence).
    own_driver: std::sync::atomic::AtomicBool,
    /// How the engine's internal threads hold it (one step at a time).
    holds: Arc<InternalHolds>,
    /// How the engine waits ([`reactor`]).
    reactor: Arc<reactor::Reactor>,
    /// Each listener's thread: woken and joined when the engine closes, so
    /// its listener (and port) goes with the engine, not at the end of the
    /// thread's idle wait.
    listener_threads: Mutex<Vec<listener::ListenerThread>>,
    /// The id of the [`Context`](crate::Context) it was made of
    /// ([`NO_CONTEXT`] for one made by `Engine::new`): its buffers only
    /// are registered.
    context: u64,
}

/// A control message's receive completion, and the NIC it came on.
type ControlReceive = (usize, Completion);

/// The RoCE v2 address of port 1 of `context` (NIC `nic`), IPv4 where it
/// has one: what an engine listens at.
pub(crate) fn roce_address(
    context: &hal_verbs::dynamic::DynContext,
    nic: &str,
) -> Result<std::net::IpAddr, EngineError> {
    use hal_verbs::AddressFamily;
    let table = context.gid_table(1).map_err(|e| {
        EngineError::verbs(
            VerbsCall::QueryGids {
                device: nic.to_owned(),
            },
            e,
        )
    })?;
    hal_verbs::select_roce_v2_gid(&table, AddressFamily::V4)
        .or_else(|| hal_verbs::select_roce_v2_gid(&table, AddressFamily::V6))
        .map(|entry| entry.gid.to_ip())
        .ok_or_else(|| {
            Unsupported::NoRoceAddress {
                nic: nic.to_owned(),
            }
            .into()
        })
}

/// The context id of an engine made outside any context.
#[cfg(any(test, feature = "testing"))]
const NO_CONTEXT: u64 = 0;

/// A lock of the engine (its own, [`State`], or a peer's,
/// [`PeerSlot`]), held with the thread marked inside the engine: CUDA
/// memory whose last holder goes meanwhile is freed on the reaper thread
/// ([`crate::reaper`]), never under a lock.
struct Guard<'a, T> {
    // Field order is drop order: the lock goes, then the marks.
    guard: crate::sync::MutexGuard<'a, T>,
    /// A peer's lock: marked held for the lock order's checks.
    _held: Option<lock_order::Held>,
    _inside: crate::reaper::EngineSection,
    /// The engine's lock, taken to change what it guards: set as the lock
    /// goes, so that what changed (a path's work, a fence, a grant) is the
    /// next pass's to look at. `None` for the pass itself, a look, or a
    /// peer's lock.
    due: Option<&'a PassDue>,
}

/// The engine's lock.
type StateGuard<'a> = Guard<'a, State>;

/// A peer's lock, held: as it goes, what the holder left is published for
/// the engine's pass ([`handoff::PeerMark`]).
struct SlotGuard<'a> {
    guard: Guard<'a, PeerSlot>,
    /// Where the holder's mark is published as the lock goes; `None` once
    /// [`Engine::settle_slot`] published it (and took the guard).
    published: Option<&'a handoff::PeerMark>,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        // Before the lock goes (the guard is dropped after this body).
        if let Some(published) = self.published {
            published.publish(self.guard.mark());
        }
    }
}

impl std::ops::Deref for SlotGuard<'_> {
    type Target = PeerSlot;
    fn deref(&self) -> &PeerSlot {
        &self.guard
    }
}

impl std::ops::DerefMut for SlotGuard<'_> {
    fn deref_mut(&mut self) -> &mut PeerSlot {
        &mut self.guard
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        if let Some(due) = self.due {
            due.set();
        }
    }
}

impl<T> std::ops::Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> std::ops::DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

/// Takes the engine's lock to change what it guards: the engine's next
/// pass looks at it.
fn lock_state(shared: &Shared) -> StateGuard<'_> {
    let mut guard = look_at_state(shared);
    guard.due = Some(&shared.due);
    guard
}

/// Takes the engine's lock for the pass itself, or to look only (what it
/// reads or changes needs no pass).
fn look_at_state(shared: &Shared) -> StateGuard<'_> {
    lock_order::engine();
    let inside = crate::reaper::EngineSection::enter();
    Guard {
        guard: lock(&shared.state),
        _held: None,
        _inside: inside,
        due: None,
    }
}

/// [`look_at_state`] if the lock is free now.
fn try_look_at_state(shared: &Shared) -> Option<StateGuard<'_>> {
    lock_order::engine();
    let inside = crate::reaper::EngineSection::enter();
    let guard = crate::sync::try_lock(&shared.state)?;
    Some(Guard {
        guard,
        _held: None,
        _inside: inside,
        due: None,
    })
}

/// Takes a peer's lock: alone, or under the engine's, never the other way
/// round.
fn lock_slot(lock: &PeerLock) -> SlotGuard<'_> {
    let inside = crate::reaper::EngineSection::enter();
    let held = lock_order::slot(lock);
    slot_guard(lock, crate::sync::lock(&lock.slot), held, inside)
}

/// [`lock_slot`] if the peer's lock is free now.
fn try_lock_slot(lock: &PeerLock) -> Option<SlotGuard<'_>> {
    let inside = crate::reaper::EngineSection::enter();
    let guard = crate::sync::try_lock(&lock.slot)?;
    Some(slot_guard(lock, guard, lock_order::slot(lock), inside))
}

/// The guard of `lock`'s slot, taken (`guard`), marked held.
fn slot_guard<'a>(
    lock: &'a PeerLock,
    guard: crate::sync::MutexGuard<'a, PeerSlot>,
    held: lock_order::Held,
    inside: crate::reaper::EngineSection,
) -> SlotGuard<'a> {
    SlotGuard {
        guard: Guard {
            guard,
            _held: Some(held),
            _inside: inside,
            due: None,
        },
        published: Some(&lock.mark),
    }
}

/// The lock order, checked in debug builds: a thread holding a peer's lock
/// takes neither the engine's lock, the streams', the reactor's nor a
/// peer's (that one again, or a second); each would deadlock, and a test
/// panics instead.
mod lock_order {
    #[cfg(debug_assertions)]
    thread_local! {
        static HELD: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// A peer's lock, marked held by this thread while it lives.
    pub(super) struct Held(#[cfg(debug_assertions)] usize);

    /// Panics, saying `what`, where this thread holds a peer's lock.
    fn no_peer_held(what: &str) {
        #[cfg(debug_assertions)]
        HELD.with(|held| assert!(held.borrow().is_empty(), "{what}"));
        #[cfg(not(debug_assertions))]
        let _ = what;
    }

    /// The reactor is about to be told (its lock taken).
    pub(super) fn wake() {
        no_peer_held("the reactor woken while a peer's lock is held");
    }

    /// The streams' lock is about to be taken.
    pub(super) fn streams() {
        no_peer_held("the streams' lock taken while a peer's is held");
    }

    /// The engine's lock is about to be taken.
    pub(super) fn engine() {
        no_peer_held("the engine's lock taken while a peer's is held");
    }

    /// Peer lock `lock` is about to be taken.
    pub(super) fn slot<T>(lock: &T) -> Held {
        #[cfg(debug_assertions)]
        {
            let at = std::ptr::from_ref(lock) as usize;
            HELD.with(|held| {
                let mut held = held.borrow_mut();
                assert!(!held.contains(&at), "a peer's lock taken twice by one thread");
                // Two peers' locks taken by two threads in turn, each
                // holding one, would deadlock: one at a time.
                assert!(held.is_empty(), "a second peer's lock taken while one is held");
                held.push(at);
            });
            Held(at)
        }
        #[cfg(not(debug_assertions))]
        {
            let _ = lock;
            Held()
        }
    }

    impl Drop for Held {
        fn drop(&mut self) {
            #[cfg(debug_assertions)]
            HELD.with(|held| {
                let mut held = held.borrow_mut();
                if let Some(i) = held.iter().rposition(|&at| at == self.0) {
                    held.swap_remove(i);
                }
            });
        }
    }
}

impl PeerSlot {
    /// Hands the completions `sends` of the peer's queue pair `index`
    /// (number `qp_num`, as polled) to the core. `false`, and nothing
    /// handed, when the slot's peer has gone or that queue pair was
    /// replaced since (a completion of its predecessor, already failed).
    fn on_send_completions<'c>(
        &mut self,
        index: usize,
        qp_num: u32,
        sends: impl IntoIterator<Item = &'c Completion>,
    ) -> bool {
        let Some(peer) = self.peer.as_ref() else {
            return false;
        };
        if peer.qps[index].conn.qp().qp_num() != qp_num {
            return false;
        }
        let qp = peer.qps[index].core;
        for wc in sends {
            self.core.on_completion(qp, wc.wr_id, wc.status, wc.vendor_err);
        }
        true
    }

    /// Posts what the core has ready on the peer's queue pairs, control
    /// messages waiting for a send slot first.
    fn post(&mut self, now: Instant) {
        self.parts().post(now);
    }

    /// The connection side, borrowed alone.
    fn parts(&mut self) -> PeerParts<'_> {
        self.split().0
    }

    /// The connection side and the staged path's part, borrowed apart.
    fn split(&mut self) -> (PeerParts<'_>, &mut StagedPeer) {
        let PeerSlot {
            core,
            peer,
            to_post,
            staged,
            ..
        } = self;
        (PeerParts { core, peer, to_post }, staged)
    }

    /// The connection side and the peer-copy path's part, borrowed apart.
    fn split_copy(&mut self) -> (PeerParts<'_>, &mut PeerCopyPeer) {
        let PeerSlot {
            core,
            peer,
            to_post,
            copy,
            ..
        } = self;
        (PeerParts { core, peer, to_post }, copy)
    }

    /// What the peer leaves for the engine's pass ([`handoff::PeerMark`]).
    fn mark(&mut self) -> Mark {
        let post = self.peer.as_ref().is_some_and(|p| {
            self.core.conn.outbox_len() > 0 || p.qps.iter().any(|q| self.core.has_postable(q.core))
        });
        // Receives left to the pass make it due (a progress call makes
        // it), as before they were polled.
        let for_pass = self.peer.as_ref().is_some_and(|p| !p.for_pass.is_empty());
        // The paths' parts are stepped by the pass, at its next.
        // A gone peer's IPC handles go at the pass too.
        let gone = self.peer.as_ref().is_none_or(|p| p.gone.is_some());
        let post = post
            || !self.staged.is_idle(self.core.conn.rendezvous())
            || self.copy.has_work(self.core.conn.peer_copy())
            || (gone && self.copy.ipc_handles() > 0);
        let at = [self.core.next_deadline(), self.staged.poll_timeout()];
        Mark {
            actions: self.core.has_action() || for_pass,
            post,
            held: self.control_held(),
            at: at.into_iter().flatten().min(),
        }
    }

    /// Whether a control message of the peer's waits for a send slot or a
    /// receive of the peer (it goes only with progress).
    fn control_held(&self) -> bool {
        self.peer.as_ref().is_some_and(|p| {
            p.gone.is_none()
                && (self.core.conn.outbox_len() > 0 || self.core.send_waits(p.qps[0].core))
        })
    }
}

/// What the engine's pass handled, and what it leaves its caller to serve
/// outside the engine's lock: the landing slots claimed to be made (by
/// peer slot, with the GPU to pin them with), whether opened gates are to
/// be served, and the GPU fences claimed for stream releases.
type Handled = (usize, Vec<(usize, u32)>, bool, Vec<(usize, Vec<u32>)>);

/// Some of the engine's CQs, by index (NIC × CQs per NIC + CQ): a
/// progress call polls these. Past the 64th, every CQ is in every set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CqSet(u64);

impl CqSet {
    /// Every CQ.
    pub(super) const ALL: CqSet = CqSet(u64::MAX);

    /// No CQ yet (add to it).
    pub(super) const NONE: CqSet = CqSet(0);

    /// This set and CQ `index`.
    pub(super) fn with(self, index: usize) -> CqSet {
        match index {
            0..64 => CqSet(self.0 | 1 << index),
            _ => CqSet::ALL,
        }
    }

    fn has(self, index: usize) -> bool {
        index >= 64 || self.0 & 1 << index != 0
    }

    /// The CQs named one by one (none for a set past the 64th: every CQ).
    fn named(self) -> impl Iterator<Item = usize> {
        let bits = if self == CqSet::ALL { 0 } else { self.0 };
        (0..64).filter(move |&i| bits & 1 << i != 0)
    }
}

/// A waiter's spin on its home CQs ([`Engine::spin_home`]): while it
/// lasts, polls of every CQ leave those to it; it ends when dropped.
pub(super) struct HomeSpin<'e> {
    engine: &'e Engine,
    home: CqSet,
}

impl Drop for HomeSpin<'_> {
    fn drop(&mut self) {
        for (cqs, index) in self.engine.named_cqs(self.home) {
            cqs.leave(index);
        }
    }
}

/// A thread polling its peer's CQs asks to sweep every CQ
/// (`handoff::Sweeps`) at this many calls.
const HOME_ROUNDS: u64 = 16;

/// What one progress call's poll of the NICs leaves for the engine's pass
/// (kept per thread, so the polls reuse their buffers).
#[derive(Default)]
struct Polled {
    buffer: Vec<Completion>,
    /// The peers whose control receives this poll queued
    /// (`PeerLock::inbound`).
    inbound: Vec<Arc<PeerLock>>,
    /// A receive this poll took was left to the pass (behind a replaced
    /// queue pair 0): the pass runs in this call.
    receives_for_pass: bool,
    /// A NIC's completions with an error among them, all for the pass.
    errors: Vec<(usize, Vec<Completion>)>,
    /// NICs whose CQ failed to poll.
    failed: Vec<(usize, hal_verbs::VerbsError)>,
    /// This thread's progress calls.
    ticks: u64,
    /// Routes this thread looked up ([`handoff::RouteCache`]).
    routes: RouteCache<PeerLock>,
}

thread_local! {
    static POLLED: std::cell::Cell<Option<Polled>> = const { std::cell::Cell::new(None) };
}

impl Polled {
    fn take() -> Self {
        POLLED.with(std::cell::Cell::take).unwrap_or_else(|| Polled {
            buffer: Vec::with_capacity(256),
            ..Polled::default()
        })
    }

    /// Whether the engine's pass has work in it.
    fn for_pass(&self) -> bool {
        self.receives_for_pass || !self.errors.is_empty() || !self.failed.is_empty()
    }

    fn give_back(mut self) {
        self.inbound.clear();
        self.receives_for_pass = false;
        self.errors.clear();
        self.failed.clear();
        POLLED.with(|p| p.set(Some(self)));
    }
}

/// Streams the engine holds are released, then the CUDA worker's queued
/// jobs (which name memory the state holds) all run, before the state goes
/// (fields drop after this).
impl Drop for Shared {
    fn drop(&mut self) {
        let mut state = lock(&self.state);
        // The peers' queue pairs go first (the NIC writes nothing more),
        // then the streams fenced on this engine's batches go on: nothing
        // will end those batches now, and a free the worker's last copy
        // waits behind may be waiting for such a stream.
        let slots = std::mem::take(&mut state.slots);
        for lock in &slots {
            drop(lock_slot(lock).peer.take());
        }
        self.routes_mut().clear();
        lock(&self.streams).stream_fences.release_all();
        drop(state);
        self.res.cuda.shut();
        // The peers' parts of the staged path last, as the paths' own:
        // their landing slots' pinned free waits for the whole GPU, which
        // the released stream fences and the shut worker no longer hold.
        drop(slots);
    }
}

impl Shared {
    /// The staged path, for one call (its pools).
    fn staged(&self) -> staging::StagedPath<'_> {
        staging::StagedPath { pools: &self.pools }
    }

    /// The peer-copy path, for one call (what it shares among the peers).
    fn copies(&self) -> PeerCopyPath<'_> {
        PeerCopyPath {
            shared: &self.peer_copy,
        }
    }

    /// The routes, to change: the version moves as the lock goes.
    fn routes_mut(&self) -> handoff::RoutesWrite<'_, PeerLock> {
        self.routes.write()
    }
}

/// Lets the engine's shared part read as its resources.
impl std::ops::Deref for Shared {
    type Target = Resources;
    fn deref(&self) -> &Resources {
        &self.res
    }
}

thread_local! {
    /// Set on the engine's internal threads (its own driver, a listener's):
    /// an engine handle dropped there never waits for [`InternalHolds`].
    static INTERNAL_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The engine's internal threads (its own driver, each listener's) hold
/// it only for one step at a time, within a read guard of `closed`. The
/// last handle of the caller's closes it under the write guard, so no
/// internal step holds the engine then: its teardown (which stops and
/// settles its work) runs in the caller's drop, and none of its work moves
/// after that drop returned. Without this, a step under way at that
/// moment would tear the engine down later, on its own thread.
struct InternalHolds {
    closed: crate::sync::RwLock<bool>,
    /// Internal steps holding the engine now (read before taking the
    /// write guard: a handle with more holders than these is not last).
    stepping: crate::sync::atomic::AtomicUsize,
    /// The last handle is closing the engine: a step under way ends, and
    /// a thread between steps lets the closing take the write guard.
    closing: crate::sync::atomic::AtomicBool,
}

impl Default for InternalHolds {
    fn default() -> Self {
        Self {
            closed: crate::sync::RwLock::new(false),
            stepping: crate::sync::atomic::AtomicUsize::new(0),
            closing: crate::sync::atomic::AtomicBool::new(false),
        }
    }
}

impl fmt::Debug for InternalHolds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InternalHolds")
            .field("stepping", &self.stepping.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl InternalHolds {
    /// Runs `step` with the engine behind `weak`, if it is still open.
    fn step<T>(
        &self,
        weak: &std::sync::Weak<Shared>,
        step: impl FnOnce(&Engine) -> T,
    ) -> Option<T> {
        let closed = crate::sync::read(&self.closed);
        if *closed {
            return None;
        }
        self.stepping.fetch_add(1, Ordering::SeqCst);
        let out = weak.upgrade().map(|shared| step(&Engine { shared }));
        self.stepping.fetch_sub(1, Ordering::SeqCst);
        drop(closed);
        out
    }
}

/// The thread that re-establishes a failed queue pair (see
/// [`Engine::reconnect_once`]): one attempt per step of the engine, a
/// back-off between them holding nothing, until the queue pair is up,
/// refused, not wanted any more, or the engine closed.
fn reconnect_thread(weak: &std::sync::Weak<Shared>, holds: &InternalHolds, job: &Reconnect) {
    INTERNAL_THREAD.with(|internal| internal.set(true));
    let mut backoff = Backoff::default();
    while holds.step(weak, |engine| engine.reconnect_once(job)) == Some(true) {
        let wait = backoff.next_wait();
        let until = Instant::now() + wait;
        // In short naps: a closed engine ends the thread soon.
        while weak.strong_count() > 0 && Instant::now() < until {
            std::thread::sleep(wait.min(Duration::from_millis(20)));
        }
    }
}

/// How long the last handle's drop waits for an internal step under way
/// (each is told to end: a parked one by a nudge, a reconnect attempt by
/// `abort_connects`, a listener's wait by its wake); past it the engine
/// closes when the step ends, on that step's thread (and says so).
const CLOSE_PATIENCE: Duration = Duration::from_secs(1);

impl Drop for Engine {
    fn drop(&mut self) {
        // Another handle of the caller's lives on: nothing to do (the
        // count is read before the internal steps, which count themselves
        // before they take the engine).
        let count = Arc::strong_count(&self.shared);
        let holds = &self.shared.holds;
        if count > 1 + holds.stepping.load(Ordering::SeqCst) || INTERNAL_THREAD.with(|i| i.get()) {
            return;
        }
        // Wait for the internal steps under way (bounded: a step that
        // never ends must not hang a drop; the engine then goes when it
        // ends, as it would without this). A step parked in the reactor
        // is told to return.
        holds.closing.store(true, Ordering::SeqCst);
        self.shared.reactor.nudge();
        // A reconnect attempt under way holds the engine: it ends now.
        self.shared.cm.abort_connects();
        let start = Instant::now();
        let mut closed = loop {
            match holds.closed.try_write() {
                Ok(guard) => break guard,
                Err(std::sync::TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    let waited = start.elapsed();
                    if waited > CLOSE_PATIENCE {
                        tracing::warn!(
                            ?waited,
                            "an internal step of the engine did not end: it closes when it does, \
                             on that thread"
                        );
                        holds.closing.store(false, Ordering::SeqCst);
                        return;
                    }
                    // Again: a step that began after the last nudge waits
                    // for the next one.
                    self.shared.reactor.nudge();
                    std::thread::yield_now();
                }
            }
        };
        let last = Arc::strong_count(&self.shared) == 1;
        if last {
            *closed = true;
        }
        // Under the write guard: the next step sees `closed` (or, if
        // another handle appeared, runs as before).
        holds.closing.store(false, Ordering::SeqCst);
        drop(closed);
        if last {
            // Each listener's thread sees `closed` at its next step: told
            // to take it now, and waited for, its listener goes before the
            // engine's drop returns.
            let threads = std::mem::take(&mut *lock(&self.shared.listener_threads));
            for thread in threads {
                thread.stop();
            }
        }
    }
}

/// The transfer engine over verbs backend `V` and CUDA backend `C`.
pub struct Engine {
    shared: Arc<Shared>,
}

impl Clone for Engine {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("id", &format_args!("{:#x}", self.shared.id))
            .field(
                "nics",
                &self.shared.nics.iter().map(|n| &n.name).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// An engine on the NICs of `provider` (those [`EngineConfig::devices`]
    /// names, or all), for memory of the GPUs of `cuda` (none: host memory
    /// only), outside any [`Context`](crate::Context): it registers the
    /// ladder's own buffers ([`Engine::register_buffer`]). Feature
    /// `testing`; applications make engines with
    /// [`Context::engine`](crate::Context::engine).
    #[cfg(any(test, feature = "testing"))]
    pub fn new(
        provider: &hal_verbs::dynamic::DynProvider,
        cuda: Option<&hal_cuda::dynamic::DynDriver>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        Self::build(provider, cuda, config, NO_CONTEXT)
    }

    /// An engine of context `context` (its id: the buffers it registers
    /// must be that context's).
    pub(crate) fn build(
        provider: &hal_verbs::dynamic::DynProvider,
        cuda: Option<&hal_cuda::dynamic::DynDriver>,
        config: EngineConfig,
        context: u64,
    ) -> Result<Self, EngineError> {
        let names: Vec<String> = match &config.devices {
            Some(names) => names.clone(),
            None => provider
                .devices()
                .map_err(|e| EngineError::verbs(VerbsCall::ListDevices, e))?
                .into_iter()
                .map(|d| d.name)
                .collect(),
        };
        if names.is_empty() {
            return Err(EngineError::Unavailable(Unavailable::NoRdmaDevice));
        }
        let cm = provider
            .connection_manager()
            .map_err(|e| EngineError::verbs(VerbsCall::OpenConnectionManager, e))?;
        let cache = Arc::new(RegistrationCache::new(config.cache));
        let exports = Arc::new(DmabufExports::new());
        let gpu_count = match cuda {
            Some(driver) => {
                use hal_cuda::Driver as _;
                driver.device_count().unwrap_or(0)
            }
            None => 0,
        };
        // Each NIC's CQs hold every completion its peers' queue pairs can
        // have outstanding: a full CQ overruns, and the device fails every
        // queue pair on it. Each queue pair takes a seat (its completions)
        // on the CQ with the fewest taken: with every CQ holding its share
        // of `max_peers`' queue pairs, one always has room while the peers
        // are within the bound.
        let qps_per_peer = u64::from(config.qps_per_peer.max(1));
        let per_qp = u64::from(config.qp_depth) + u64::from(config.recv_depth);
        let per_peer = qps_per_peer * per_qp;
        let qps_wanted = qps_per_peer.saturating_mul(config.max_peers.max(1) as u64);
        let cqs = u64::from(config.cqs_per_nic.max(1)).min(qps_wanted);
        let mut peer_capacity = config.max_peers.max(1);
        let mut nics = Vec::with_capacity(names.len());
        for name in names {
            let context = provider.open(&name).map_err(|e| {
                EngineError::verbs(
                    VerbsCall::OpenDevice {
                        device: name.clone(),
                    },
                    e,
                )
            })?;
            let gpus = match cuda {
                Some(driver) => (0..gpu_count)
                    .filter_map(|ordinal| Gpu::open(driver, ordinal).ok())
                    .collect(),
                None => Vec::new(),
            };
            let ladder = Ladder::new(
                &context,
                gpus,
                Arc::clone(&cache),
                Arc::clone(&exports),
                config.ladder,
            )?;
            let max_cqe = context
                .query_device()
                .map_or(u64::from(u32::MAX), |a| u64::from(a.max_cqe));
            let seats = qps_wanted.div_ceil(cqs).min(max_cqe / per_qp.max(1));
            let fits = usize::try_from(seats * cqs / qps_per_peer).unwrap_or(usize::MAX);
            if fits == 0 {
                return Err(EngineError::Unavailable(
                    Unavailable::CompletionQueueTooSmall {
                        device: name,
                        max_cqe,
                        per_peer,
                    },
                ));
            }
            if fits < peer_capacity {
                tracing::warn!(
                    device = %name,
                    max_cqe,
                    peers = fits,
                    asked = config.max_peers,
                    "the device's CQs hold fewer peers than max_peers: the bound is what fits"
                );
                peer_capacity = fits;
            }
            let depth = u32::try_from(seats * per_qp).unwrap_or(u32::MAX);
            // On a completion channel where the provider makes one, so a
            // waiting engine can park until a completion comes (one
            // channel for the NIC's CQs: one fd to wait on).
            let channel = match context.create_comp_channel() {
                Ok(channel) => Some(channel),
                Err(e) => {
                    tracing::debug!(device = %name, error = %e, "no completion channel: the CQ is polled");
                    None
                }
            };
            let mut queues = Vec::with_capacity(cqs as usize);
            for _ in 0..cqs {
                let cq = match &channel {
                    Some(channel) => context.create_cq_on_channel(depth, channel, 0),
                    None => context.create_cq(depth),
                }
                .map_err(|e| {
                    EngineError::verbs(
                        VerbsCall::CreateCq {
                            device: name.clone(),
                        },
                        e,
                    )
                })?;
                queues.push(cq);
            }
            nics.push(Nic {
                name,
                cqs: resources::Cqs::new(queues, seats as usize),
                channel,
                ladder,
                context,
            });
        }
        let reactor = Arc::new(reactor::Reactor::new().map_err(|e| {
            EngineError::Unavailable(Unavailable::Os {
                what: "the engine's wake-up eventfd",
                source: e,
            })
        })?);
        let shared = Shared {
            routes: handoff::Routes::new(),
            dead_nics: nics
                .iter()
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
            due: PassDue::new(config.clock.now()),
            sweeps: handoff::Sweeps::new(),
            pools: Default::default(),
            peer_copy: peer_copy::PeerCopyShared::new(cuda, Arc::downgrade(&reactor)),
            streams: Mutex::new(Streams::default()),
            state: Mutex::new(State {
                slots: Vec::new(),
                reconnecting: 0,
                peers_poll: false,
            }),
            res: Resources::new(fresh_id(), config, cm, nics, peer_capacity),
            context,
            drivers: Arc::default(),
            own_driver: Default::default(),
            listener_threads: Mutex::default(),
            holds: Arc::default(),
            reactor,
        };
        tracing::info!(
            engine = format_args!("{:#x}", shared.id),
            nics = ?shared.nics.iter().map(|n| &n.name).collect::<Vec<_>>(),
            "engine up"
        );
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// This engine's id (what its descriptors name as owner).
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// The NICs, in the engine's order.
    pub fn nics(&self) -> Vec<String> {
        self.shared.nics.iter().map(|n| n.name.clone()).collect()
    }

    /// The registration cache's counters on NIC `nic`.
    pub fn cache_stats(&self, nic: usize) -> Option<crate::cache::CacheStats> {
        self.shared.nics.get(nic).map(|n| n.ladder.cache().stats())
    }

    /// The ladder of NIC `nic`. Feature `testing`.
    #[cfg(feature = "testing")]
    pub fn ladder(&self, nic: usize) -> Option<&Ladder> {
        self.shared.nics.get(nic).map(|n| &n.ladder)
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.shared.config
    }

    /// What the engine holds now: its work in flight and each peer's
    /// state on this side (every part of it bounded by the engine's
    /// limits). Tests read it to see state come back to the engine's
    /// baseline once the work and the peers are gone.
    pub fn resources(&self) -> EngineResources {
        let state = look_at_state(&self.shared);
        let (mut staged_transfers, mut staged_groups) = (0, 0);
        let mut batches = 0;
        let peers = state
            .slots
            .iter()
            .filter_map(|lock| {
                let guard = lock_slot(lock);
                let (staged_grants, requests_served, copies, requests_asked) =
                    guard.staged.load(guard.core.conn.rendezvous());
                let (transfers, groups) = guard.staged.transfers();
                staged_transfers += transfers;
                staged_groups += groups;
                batches += guard.core.batches_live();
                let peer = guard.peer.as_ref()?;
                let core = &guard.core;
                Some(PeerResources {
                    remote_engine: core.conn.peer_engine(),
                    gone: peer.gone.is_some(),
                    queue_pairs: peer.qps.len(),
                    grants_announced: core.conn.announced_len(),
                    remote_grants: core.conn.remote_grants(),
                    ipc_handles: guard.copy.ipc_handles(),
                    inbox_messages: core.conn.inbox_len().0,
                    inbox_bytes: core.conn.inbox_len().1,
                    outbox_messages: core.conn.outbox_len(),
                    staged_grants,
                    requests_served,
                    copies,
                    requests_asked,
                })
            })
            .collect();
        EngineResources {
            drivers: self.shared.drivers.load(Ordering::Acquire),
            own_driver: self.shared.own_driver.load(Ordering::Acquire),
            batches,
            staged_transfers,
            staged_groups,
            peers,
            fence_page_bytes: look_at_streams(&self.shared).stream_fences.page_bytes(),
            cq_queue_pairs: self
                .shared
                .nics
                .iter()
                .flat_map(|nic| nic.cqs.seated())
                .collect(),
        }
    }

    /// Peers this engine holds: those connected or accepted, closed ones
    /// included (until the engine goes). A connect or accept that failed
    /// leaves none.
    pub fn peer_count(&self) -> usize {
        let state = look_at_state(&self.shared);
        state
            .slots
            .iter()
            .filter(|lock| lock_slot(lock).peer.is_some())
            .count()
    }

    /// Peers connected and not gone: what the CQs were sized for (a gone
    /// peer's queue pairs are disconnected and post nothing more).
    fn live_peers(state: &State) -> usize {
        state
            .slots
            .iter()
            .filter(|lock| lock_slot(lock).peer.as_ref().is_some_and(|p| p.gone.is_none()))
            .count()
    }

    /// The CQs `peer`'s queue pairs complete on.
    fn home_of(&self, peer: &PeerState) -> CqSet {
        let per_nic = self.shared.cqs_per_nic;
        peer.qps
            .iter()
            .fold(CqSet::NONE, |set, q| set.with(q.nic * per_nic + q.conn.cq()))
    }

    /// A seat for a new queue pair on one of NIC `nic`'s CQs: all taken
    /// means more queue pairs than `max_peers` peers have (ones being
    /// re-established or waiting in a listener's backlog besides), and the
    /// queue pair is refused rather than risk a CQ's overrun.
    /// `prefer`: the CQ of another of the peer's queue pairs on that NIC.
    /// A queue pair gives its seat back once drained, which the engine's
    /// pass sees: with every seat taken, progress is made for a moment
    /// first (a peer closed just now, nobody driving the engine).
    fn cq_seat(&self, nic: usize, prefer: Option<usize>) -> Result<resources::CqSeat, EngineError> {
        const DRAIN_WAIT: Duration = Duration::from_millis(5);
        let cqs = &self.shared.nics[nic].cqs;
        if let Some(seat) = cqs.seat(prefer) {
            return Ok(seat);
        }
        let start = Instant::now();
        while start.elapsed() < DRAIN_WAIT {
            self.progress();
            if let Some(seat) = cqs.seat(prefer) {
                return Ok(seat);
            }
            std::thread::yield_now();
        }
        Err(EngineError::Refused(Refusal::PeerLimit {
            max: self.shared.peer_capacity,
        }))
    }

    /// Whether one more peer may connect now ([`EngineConfig::max_peers`]).
    fn peer_room(&self) -> Result<(), EngineError> {
        let max = self.shared.peer_capacity;
        if Self::live_peers(&look_at_state(&self.shared)) >= max {
            return Err(EngineError::Refused(Refusal::PeerLimit { max }));
        }
        Ok(())
    }

    /// Registers all of `buffer` (a buffer of this engine's context) on
    /// every NIC, each on the first rung of the registration ladder that
    /// works there, as a region for transfers and grants.
    pub fn register(&self, buffer: &crate::Buffer) -> Result<Region, EngineError> {
        self.register_range(buffer, 0, buffer.len())
    }

    /// Registers `len` bytes at `offset` of `buffer` on every NIC.
    pub fn register_range(
        &self,
        buffer: &crate::Buffer,
        offset: u64,
        len: u64,
    ) -> Result<Region, EngineError> {
        if buffer.context().id() != self.shared.context {
            return Err(EngineError::Foreign {
                what: "buffer",
                owner: "context (the engine's)",
            });
        }
        buffer.with(|b| self.shared.res.register_range(&b.buffer, offset, len))
    }

    /// Registers the whole of the ladder's own `buffer`. Feature
    /// `testing`.
    #[cfg(any(test, feature = "testing"))]
    pub fn register_buffer(&self, buffer: &Buffer) -> Result<Region, EngineError> {
        self.shared.res.register(buffer)
    }

    /// Registers `len` bytes at `offset` of the ladder's own `buffer`.
    /// Feature `testing`.
    #[cfg(any(test, feature = "testing"))]
    pub fn register_buffer_range(
        &self,
        buffer: &Buffer,
        offset: u64,
        len: u64,
    ) -> Result<Region, EngineError> {
        self.shared.res.register_range(buffer, offset, len)
    }

    /// The address NIC `nic` is reached at: its RoCE v2 address on port
    /// 1 (IPv4 where it has one), to listen at.
    pub fn nic_address(&self, nic: &str) -> Result<std::net::IpAddr, EngineError> {
        let Some(found) = self.shared.nics.iter().find(|n| n.name == nic) else {
            return Err(EngineError::Unavailable(Unavailable::UnknownNic {
                device: nic.to_owned(),
            }));
        };
        roce_address(&found.context, nic)
    }

    fn fence_gpu(&self, ordinal: u32) -> Result<Fence, EngineError> {
        self.shared.res.fence_gpu(ordinal)
    }

    /// Connects to the engine listening at `addr`: [`EngineConfig::qps_per_peer`]
    /// queue pairs, all from the NIC the route to `addr` leaves by.
    pub fn connect(&self, addr: SocketAddr, timeout: Duration) -> Result<Peer, EngineError> {
        self.connect_paths(
            &[Path {
                source: None,
                peer: addr,
            }],
            timeout,
        )
    }

    /// Connects to one engine over several paths (a source address, which
    /// picks the local NIC, and the peer's address on one of its NICs): the
    /// queue pairs are spread over them in turn, so slices travel over
    /// every NIC.
    ///
    /// `timeout` bounds the whole set-up, waiting for the listener's
    /// [`Listener::accept`] included. A listener that refuses says
    /// why ([`EngineError::Rejected`]; busy: its backlog is full); one
    /// that does not accept in time, or drops the connection unaccepted,
    /// is [`EngineError::NotAccepted`]. On any failure every queue pair
    /// made is disconnected and nothing of the attempt is kept: connecting
    /// again is a fresh attempt.
    pub fn connect_paths(&self, paths: &[Path], timeout: Duration) -> Result<Peer, EngineError> {
        let first = paths.first().ok_or(EngineError::Refused(Refusal::NoPath))?;
        // Refused before any queue pair is made (checked again when the
        // peer is added: another connect may take the room meanwhile).
        self.peer_room()?;
        let clock = &self.shared.config.clock;
        let count = self.shared.config.qps_per_peer.max(1);
        let mut dial = Dial::new(fresh_id(), count, clock.now(), timeout);
        let _span = tracing::debug_span!(
            "engine_connect",
            peer = %first.peer,
            session = format_args!("{:#x}", dial.session())
        )
        .entered();
        // Queue pair i's connection is token i.
        let mut conns: Vec<(resources::SeatedConnection, usize, Option<Path>)> =
            Vec::with_capacity(count.into());
        let mut acceptor: Option<Hello> = None;
        while let Some(index) = dial.next_index() {
            let path = paths[usize::from(index) % paths.len()];
            dial.handle_timeout(clock.now());
            if let DialState::Failed(error) = dial.state() {
                return Err(self.dial_failed(&mut dial, conns, path.peer, error));
            }
            let left = dial.remaining(clock.now());
            let failure = match self.connect_qp(path, &dial, index, left, &conns) {
                Ok((conn, nic)) => match Hello::decode(&conn.peer_private_data()) {
                    Ok(reply) => {
                        conns.push((conn, nic, Some(path)));
                        match dial.on_connected(Token(index.into()), &reply) {
                            Ok(()) => {
                                acceptor.get_or_insert(reply);
                                continue;
                            }
                            Err(error) => error,
                        }
                    }
                    Err(e) => {
                        conns.push((conn, nic, Some(path)));
                        dial.abort();
                        // The peer's hello does not decode (or speaks
                        // another version).
                        let e = EngineError::Handshake {
                            peer: Some(path.peer),
                            why: e.into(),
                        };
                        return Err(self.dial_failed(&mut dial, conns, path.peer, e));
                    }
                },
                Err(QpRefused::Rejected(reason)) => dial.on_rejected(reason),
                Err(QpRefused::Failed(e)) => {
                    dial.abort();
                    return Err(self.dial_failed(&mut dial, conns, path.peer, e));
                }
            };
            return Err(self.dial_failed(&mut dial, conns, path.peer, failure));
        }
        let Some(hello) = acceptor else {
            return Err(Self::dial_error(first.peer, DialError::OutOfOrder));
        };
        let peer = match self.add_peer(first.peer, &hello, dial.session(), conns) {
            Ok(peer) => peer,
            Err(e) => {
                // Its connections went with it (dropped: disconnected).
                dial.abort();
                return Err(e);
            }
        };
        // The acceptor's paths are its sign that it accepted.
        let failure = match peer.wait_paths(dial.remaining(clock.now())) {
            Ok(()) => match dial.on_accepted() {
                Ok(()) => {
                    // One message to a side whose receives are posted: it
                    // gets what is left of the timeout, or the grace.
                    let left = dial.remaining(clock.now()).max(setup::ANSWER_GRACE);
                    match peer.send_paths(left) {
                        Ok(()) => {
                            peer.read_peer(|core, _| core.conn.recovery_mut().establish())?;
                            tracing::debug!(
                                engine = format_args!("{:#x}", hello.engine),
                                "accepted"
                            );
                            return Ok(peer);
                        }
                        Err(e) => {
                            dial.abort();
                            e
                        }
                    }
                }
                Err(error) => Self::dial_error(first.peer, error),
            },
            Err(EngineError::Timeout(_)) => {
                // The wait was bounded by the dial's deadline.
                if let Some(at) = dial.poll_timeout() {
                    dial.handle_timeout(at.max(clock.now()));
                }
                Self::dial_error(first.peer, dial.abort())
            }
            Err(EngineError::PeerGone(_)) => Self::dial_error(first.peer, dial.on_gone()),
            Err(e) => {
                dial.abort();
                e
            }
        };
        let torn: Vec<Token> = std::iter::from_fn(|| dial.poll_teardown()).collect();
        debug_assert_eq!(torn.len(), usize::from(count), "every queue pair goes");
        self.tear_down(peer.slot, PeerGone::ConnectFailed);
        Err(failure)
    }

    /// Connects queue pair `index` of `dial`'s session over `path`,
    /// within `timeout`: the connection and its NIC.
    fn connect_qp(
        &self,
        path: Path,
        dial: &Dial,
        index: u16,
        timeout: Duration,
        earlier: &[(resources::SeatedConnection, usize, Option<Path>)],
    ) -> Result<(resources::SeatedConnection, usize), QpRefused> {
        let device = match path.source {
            Some(source) => self.device_of_address(source)?,
            None => self
                .shared
                .cm
                .route_device(path.peer.ip(), timeout)
                .map_err(|e| match e {
                    // Nobody there, as for a connect to a device nobody
                    // listens on (the simulation's fabric is this
                    // process's own).
                    e @ hal_verbs::VerbsError::NotListeningInSimulation { .. } => {
                        EngineError::Handshake {
                            peer: Some(path.peer),
                            why: HandshakeFailure::Connect(e),
                        }
                    }
                    e => EngineError::verbs(VerbsCall::Route { peer: path.peer }, e),
                })?,
        };
        let nic = self.nic_index(&device)?;
        let hello = self.hello(Role::Connect, dial.session(), index, dial.qp_count());
        let mut params = self.connect_params(timeout);
        params.source = path.source;
        let n = &self.shared.nics[nic];
        let prefer = earlier.iter().find(|(_, n, _)| *n == nic).map(|(c, _, _)| c.cq());
        let seat = self.cq_seat(nic, prefer)?;
        let cq = &n.cqs.queues()[seat.cq()];
        match self
            .shared
            .cm
            .connect(path.peer, n.ladder.pd(), cq, cq, &params, &hello.encode())
        {
            Ok(conn) => Ok((resources::SeatedConnection::new(conn, seat), nic)),
            Err(e) => {
                let reason = match &e {
                    hal_verbs::VerbsError::ConnectionRejected { private_data, .. } => {
                        RejectReason::decode(private_data).ok()
                    }
                    _ => None,
                };
                Err(match reason {
                    Some(reason) => QpRefused::Rejected(reason),
                    // Unreachable, timed out, or a reject without our
                    // private data.
                    None => QpRefused::Failed(EngineError::Handshake {
                        peer: Some(path.peer),
                        why: HandshakeFailure::Connect(e),
                    }),
                })
            }
        }
    }

    /// A connect failed with `error` before its peer was added: the
    /// queue pairs `dial` names are disconnected (the rest of `conns` goes
    /// with them).
    fn dial_failed(
        &self,
        dial: &mut Dial,
        conns: Vec<(resources::SeatedConnection, usize, Option<Path>)>,
        peer: SocketAddr,
        error: impl Into<DialFailure>,
    ) -> EngineError {
        let error = match error.into() {
            DialFailure::Dial(error) => Self::dial_error(peer, error),
            DialFailure::Engine(error) => error,
        };
        while let Some(Token(index)) = dial.poll_teardown() {
            if let Some((conn, _, _)) = usize::try_from(index).ok().and_then(|i| conns.get(i))
                && let Err(e) = conn.disconnect()
            {
                tracing::debug!(error = %e, qp = index, "disconnecting a queue pair");
            }
        }
        tracing::info!(
            %peer,
            session = format_args!("{:#x}", dial.session()),
            queue_pairs = conns.len(),
            %error,
            "connect failed: its queue pairs are disconnected"
        );
        error
    }

    /// The error a failed dial is for the caller.
    fn dial_error(peer: SocketAddr, error: DialError) -> EngineError {
        match error {
            DialError::Rejected { reason, .. } => EngineError::Rejected { peer, reason },
            DialError::NotAccepted(reason) => EngineError::NotAccepted { peer, reason },
            DialError::ConnectTimeout { after, .. } => EngineError::Timeout(TimedOut { after }),
            other => EngineError::Handshake {
                peer: Some(peer),
                why: HandshakeFailure::Dial(other),
            },
        }
    }

    /// Forgets the peer in `slot`, whose set-up failed: its queue pairs
    /// are disconnected, what they hold fails, and its state goes (its
    /// connections destroyed before its buffers), so no live-looking peer
    /// remains.
    fn tear_down(&self, slot: usize, why: PeerGone) {
        let mut guard = lock_state(&self.shared);
        let state = &mut *guard;
        let Some(lock) = state.slots.get(slot).cloned() else {
            return;
        };
        let mut slot_guard = lock_slot(&lock);
        let PeerSlot { core, peer, .. } = &mut *slot_guard;
        let Some(mut peer) = peer.take() else {
            return;
        };
        state.reconnecting -= core.conn.recovery_mut().close();
        let cause = TransferError::PeerGone(why.clone());
        peer.gone.get_or_insert(why);
        let mut routes = self.shared.routes_mut();
        for q in &mut peer.qps {
            if let Err(e) = q.conn.disconnect() {
                tracing::debug!(error = %e, "disconnecting a queue pair");
            }
            routes.remove(&(q.nic, q.conn.qp().qp_num()));
            drop(q.replacement.take());
            // Destroyed below, before anything it holds is released: no
            // flush comes back.
            core.abandon_qp(q.core, cause.clone());
        }
        let nic0 = peer.qps[0].nic;
        for old in &peer.retired {
            routes.remove(&(nic0, old.qp().qp_num()));
        }
        drop(routes);
        let session = core.conn.session();
        // Each path ends what it does with the peer and lets go of it.
        let res = &self.shared.res;
        let mut staged = self.shared.staged();
        let now = res.config.clock.now();
        on_slot(res, slot, now, &mut slot_guard, |cx, peer| {
            staged.release_peer(cx, slot, peer)
        });
        let mut copies = self.shared.copies();
        on_slot_copy(res, slot, now, &mut slot_guard, |cx, peer| {
            copies.release_peer(cx, slot, peer)
        });
        drop(slot_guard);
        self.run_actions(state);
        drop(guard);
        tracing::info!(
            peer = %peer.addr,
            session = format_args!("{session:#x}"),
            why = %cause,
            "peer torn down"
        );
        drop(peer);
    }

    /// The NIC that holds local address `source` (a RoCE GID of one of its
    /// ports).
    fn device_of_address(&self, source: IpAddr) -> Result<String, EngineError> {
        let gid = hal_verbs::Gid::from_ip(source);
        for nic in &self.shared.nics {
            let ports = nic
                .context
                .query_device()
                .map(|a| a.phys_port_cnt)
                .unwrap_or(1);
            for port in 1..=ports {
                if nic
                    .context
                    .gid_table(port)
                    .is_ok_and(|table| table.iter().any(|entry| entry.gid == gid))
                {
                    return Ok(nic.name.clone());
                }
            }
        }
        Err(EngineError::Unavailable(Unavailable::NoNicWithAddress {
            address: source,
        }))
    }

    fn nic_index(&self, device: &str) -> Result<usize, EngineError> {
        self.shared
            .nics
            .iter()
            .position(|n| n.name == device)
            .ok_or_else(|| {
                EngineError::Unavailable(Unavailable::RouteDeviceNotGiven {
                    device: device.to_owned(),
                })
            })
    }

    fn hello(&self, role: Role, session: u64, qp_index: u16, qp_count: u16) -> Hello {
        let config = &self.shared.config;
        Hello {
            role,
            engine: self.shared.id,
            session,
            qp_index,
            qp_count,
            max_message: config.max_message,
            recv_depth: config.recv_depth,
            max_slice: config.slice_size.min(u64::from(u32::MAX)) as u32,
        }
    }

    fn connect_params(&self, timeout: Duration) -> ConnectParams {
        let config = &self.shared.config;
        let mut params = config.connect.clone();
        params.timeout = timeout;
        params.caps = QpCaps {
            max_send_wr: config.qp_depth.max(1),
            max_recv_wr: u32::from(config.recv_depth).max(1),
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: config.inline_threshold,
        };
        params.access = AccessFlags::transfer();
        params
    }

    /// Adds a connected peer: its queue pairs in the core, its control
    /// buffers registered, receives posted on queue pair 0.
    fn add_peer(
        &self,
        addr: SocketAddr,
        hello: &Hello,
        session: u64,
        conns: Vec<(resources::SeatedConnection, usize, Option<Path>)>,
    ) -> Result<Peer, EngineError> {
        let config = &self.shared.config;
        let my_max = config.max_message as usize;
        let peer_max = hello.max_message as usize;
        let recv_slots = usize::from(config.recv_depth).max(1);
        // Twice the peer's receives: a slot is reused only after its SEND
        // completed, so this many keep the pipe full.
        let send_slots = usize::from(hello.recv_depth).max(1) * 2;
        let recv = Buffer::alloc_host((recv_slots * my_max) as u64);
        let send = Buffer::alloc_host((send_slots * peer_max) as u64);
        let recv_region = self.shared.res.register(&recv)?;
        let send_region = self.shared.res.register(&send)?;
        let mut state = lock_state(&self.shared);
        let max = self.shared.peer_capacity;
        if Self::live_peers(&state) >= max {
            return Err(EngineError::Refused(Refusal::PeerLimit { max }));
        }
        let slot = state.slots.len();
        let connector = conns.iter().any(|(_, _, path)| path.is_some());
        let mut core = Core::new(PeerConnection::new(&ConnectionConfig {
            peer_engine: hello.engine,
            session,
            qp_count: conns.len(),
            connector,
            reconnect_timeout: config.reconnect_timeout,
            peer_max_message: peer_max,
            max_outbox: MAX_OUTBOX,
            limits: config.peer_limits,
        }));
        let mut qps = Vec::with_capacity(conns.len());
        for (index, (conn, nic, path)) in conns.into_iter().enumerate() {
            let limits = self.qp_limits(&conn, index, u32::from(hello.recv_depth));
            let core = core.add_qp(index as u16, limits);
            qps.push(PeerQp {
                max_inline: conn
                    .qp()
                    .caps()
                    .max_inline_data
                    .min(config.inline_threshold),
                conn,
                nic,
                core,
                path,
                replacement: None,
            });
        }
        let lock = Arc::new(PeerLock::new(
            slot,
            PeerSlot {
                core,
                peer: None,
                to_post: Vec::with_capacity(64),
                staged: StagedPeer::new(),
                copy: PeerCopyPeer::default(),
            },
            self.shared.due.base(),
        ));
        let mut routes = self.shared.routes_mut();
        for (index, qp) in qps.iter().enumerate() {
            let route = Route {
                lock: Arc::clone(&lock),
                slot,
                index,
            };
            routes.insert((qp.nic, qp.conn.qp().qp_num()), route);
        }
        let peer = PeerState {
            addr,
            local_engine: self.shared.id,
            qps,
            peer_recv_depth: u32::from(hello.recv_depth),
            retired: Vec::new(),
            for_pass: Default::default(),
            control: ControlBuffers {
                recv,
                recv_region,
                receives: PostedReceives::new(recv_slots),
                send,
                send_region,
                free_send: Arc::new(std::sync::Mutex::new((0..send_slots).rev().collect())),
                slot: peer_max,
            },
            revoked: Arc::default(),
            next_qp: 0,
            gone: None,
        };
        drop(routes);
        let mut slot_guard = lock_slot(&lock);
        let peer = slot_guard.peer.insert(peer);
        // Receives for control messages, before anything can arrive (the
        // peer's lock is held throughout). The peer is in its slot first:
        // a refused post tears it down whole, its queue pairs' routes
        // included, so no completion of theirs can find a slot that is not
        // there.
        let posted = self.post_free_receives(peer);
        let qps = peer.qps.len();
        drop(slot_guard);
        state.slots.push(Arc::clone(&lock));
        if let Err(e) = posted {
            drop(state);
            self.tear_down(slot, PeerGone::FailedDuringSetUp { index: 0 });
            return Err(EngineError::verbs(VerbsCall::PostControlReceives, e));
        }
        tracing::info!(
            peer = %addr,
            engine = format_args!("{:#x}", hello.engine),
            qps,
            "peer connected"
        );
        Ok(Peer {
            engine: self.clone(),
            slot,
            lock,
        })
    }

    /// The limits of queue pair `index` of a peer on `conn` (queue pair 0
    /// carries SENDs, bounded by the peer's `recv_depth` receives).
    fn qp_limits(
        &self,
        conn: &resources::SeatedConnection,
        index: usize,
        peer_recv_depth: u32,
    ) -> QpLimits {
        let config = &self.shared.config;
        QpLimits {
            depth: config.qp_depth.min(conn.qp().caps().max_send_wr).max(1),
            send_limit: if index == 0 { peer_recv_depth } else { 0 },
            signal_every: config.signal_every,
        }
    }

    /// Posts every free control receive slot on the peer's queue pair 0.
    fn post_free_receives(&self, peer: &mut PeerState) -> Result<(), hal_verbs::VerbsError> {
        let size = self.shared.config.max_message as usize;
        let free = peer.control.receives.free();
        if free.is_empty() {
            return Ok(());
        }
        let recvs: Vec<RecvRequest> = free
            .iter()
            .map(|&i| Self::recv_request(peer, i, size))
            .collect();
        let qp0 = &peer.qps[0];
        // SAFETY: the receive buffer is registered (its region lives in the
        // peer state as long as the queue pair) and gdr's own host memory;
        // nothing else writes it, and each slot is posted on one queue pair
        // at a time (`ControlBuffers::receives`).
        let posted = unsafe { qp0.conn.qp().post_recv(&recvs) };
        // The receives the queue pair took are owned by it, a refusal
        // part-way included: their slots must not be posted again while
        // they are there. Where the provider cannot say how many it took,
        // all are taken as posted (a slot never completed is lost; one
        // posted twice would take two messages into one buffer).
        let taken = match &posted {
            Ok(()) => free.len(),
            Err(e) => e.accepted().unwrap_or(free.len()),
        };
        let queue = (qp0.nic, qp0.conn.qp().qp_num());
        for &i in &free[..taken.min(free.len())] {
            peer.control.receives.post(i, queue);
        }
        posted.map_err(|e| e.error)
    }

    fn recv_request(peer: &PeerState, slot: usize, size: usize) -> RecvRequest {
        let nic = peer.qps[0].nic;
        let registration = peer.control.recv_region.inner.per_nic[nic]
            .mr()
            .expect("host memory is registered directly");
        let mut sg_list = SgList::new();
        sg_list.push(Sge {
            addr: peer.control.recv_region.inner.addr + (slot * size) as u64,
            length: size as u32,
            lkey: registration.lkey(),
        });
        RecvRequest {
            wr_id: RECV_BIT | slot as u64,
            sg_list,
        }
    }

    /// The GPU fence for data a peer WROTE into `region`: once the peer's
    /// WRITE batch has completed (its owner tells us, e.g. with a control
    /// message sent after it), kernels launched after this call see the
    /// data. Flushes (`cuFlushGPUDirectRDMAWrites`, owner scope) only where
    /// the GPU's write-ordering attribute asks for it, and only that GPU's
    /// writes: not a device-wide synchronization. Host memory needs
    /// nothing. A GPU that can neither order nor flush is an error.
    pub fn fence_inbound_writes(&self, region: &Region) -> Result<Fence, EngineError> {
        region.check_engine(self.id())?;
        match region.inner.location {
            MemoryLocation::Host => Ok(Fence::NotNeeded),
            MemoryLocation::Gpu { ordinal } => self.fence_gpu(u32::from(ordinal)),
        }
    }

    /// The earliest deadline of a request in flight: a driver that waits
    /// for completion events must call [`Engine::progress`] by then.
    pub fn next_deadline(&self) -> Option<Instant> {
        Self::next_deadline_of(&mut look_at_state(&self.shared))
    }

    /// [`Engine::next_deadline`], under the lock already held: the
    /// batches', the paths', and each peer connection's (a queue pair's
    /// re-establishment, a control message waiting for a send slot).
    fn next_deadline_of(state: &mut State) -> Option<Instant> {
        // As the peers' locks published them: one held now publishes its
        // own as it goes, and makes the pass due by it when it left one
        // (`PeerMark::settle`).
        state.slots.iter().filter_map(|lock| lock.mark.at()).min()
    }

    /// Polls every NIC's completions, handles deadlines and connection
    /// events, and posts what is ready. Returns how many completions it
    /// handled. A CQ another thread is spinning on while it waits on its
    /// peer is left to that thread, which takes its completions (they are
    /// not counted here). Waiting calls make progress themselves; call this
    /// when nothing waits (or from a thread of your own).
    pub fn progress(&self) -> usize {
        self.progress_with(CqSet::NONE, true)
    }

    /// Marks the CQs of `home` as spun on by this thread until the guard
    /// goes ([`Cqs::home`]): another thread's poll of every CQ then passes
    /// them by instead of taking their completions, and their peers'
    /// locks, from under the spinning waiter.
    pub(super) fn spin_home(&self, home: CqSet) -> HomeSpin<'_> {
        for (cqs, index) in self.named_cqs(home) {
            cqs.home(index);
        }
        HomeSpin { engine: self, home }
    }

    /// The CQs `set` names one by one, each as its NIC's queues and its
    /// index there.
    fn named_cqs(&self, set: CqSet) -> impl Iterator<Item = (&resources::Cqs, usize)> {
        let per_nic = self.shared.cqs_per_nic.max(1);
        set.named().filter_map(move |index| {
            let nic = self.shared.nics.get(index / per_nic)?;
            Some((&nic.cqs, index % per_nic))
        })
    }

    /// [`Engine::progress`], polling the CQs of `home` (a waiter's peer's)
    /// and, every [`HOME_ROUNDS`]th call of a thread when no other thread
    /// of the engine did so lately (`handoff::Sweeps`), every CQ no other
    /// thread spins on: a thread waiting on one peer's batch takes no other
    /// peer's completions (and their locks) while it spins, and what nobody
    /// waits on still moves. While a driver runs (`drivers`), it leaves the
    /// other CQs and the engine's pass (the paths' steps and the driver
    /// calls they make: a GPU fence, a peer copy's set-up) to the driver,
    /// unless what it polled itself needs the pass: a waiter then never
    /// does another peer's work.
    pub(super) fn progress_of(&self, home: CqSet) -> usize {
        self.progress_with(home, false)
    }

    /// One progress call: polls the CQs of `home` and then, with `others`
    /// or on a sweep (above, and only when `home` gave nothing), every
    /// other CQ that no thread spins on ([`Engine::spin_home`]: that
    /// thread takes its completions), then runs the engine's pass when
    /// due.
    fn progress_with(&self, home: CqSet, others: bool) -> usize {
        // Memory whose last holder goes in progress is freed elsewhere.
        let _inside = crate::reaper::EngineSection::enter();
        let mut polled = Polled::take();
        polled.ticks += 1;
        let mut handled = self.poll_completions(&mut polled, home, false);
        // A waiter on its peer's CQs, with a driver to do the rest.
        let driven = !others && self.shared.drivers.load(Ordering::Acquire) > 0;
        // A sweep only on a round whose own CQs gave nothing: a thread
        // with completions of its own takes those first.
        let sweep = others
            || (!driven
                && handled == 0
                && polled.ticks.is_multiple_of(HOME_ROUNDS)
                && self.shared.sweeps.take());
        if sweep {
            handled += self.poll_completions(&mut polled, home, true);
        }
        let now = self.shared.config.clock.now();
        if !polled.for_pass() && (driven || !self.shared.due.is_due(now, polled.ticks)) {
            polled.give_back();
            if handled > 0 {
                self.shared.reactor.progressed();
            }
            return handled;
        }
        let (more, landings, gated, flushes) = self.progress_locked(&mut polled);
        polled.give_back();
        handled += more;
        if !landings.is_empty() {
            handled += self.make_landings(landings);
        }
        if gated {
            handled += self.serve_gates();
        }
        if !flushes.is_empty() {
            handled += self.flush_before_stream_releases(&flushes);
        }
        if handled > 0 {
            // Threads waiting on a batch this may have ended look again.
            self.shared.reactor.progressed();
        }
        handled
    }

    /// Polls the live NICs' CQs of `home` (with `others`: every CQ outside
    /// `home` that no thread spins on) and hands the completions of sends
    /// to their peer's core, each under that peer's lock only; what needs
    /// the engine's pass (receives, a NIC with an error completion or a CQ
    /// that failed) is left in `polled`. Returns how many completions it
    /// took.
    fn poll_completions(&self, polled: &mut Polled, home: CqSet, others: bool) -> usize {
        let shared = &*self.shared;
        let per_nic = shared.cqs_per_nic;
        let mut handled = 0;
        let every = shared.nics.iter().enumerate().flat_map(|(nic_index, nic)| {
            nic.cqs
                .queues()
                .iter()
                .enumerate()
                .map(move |(cq_index, cq)| (nic_index, cq_index, cq))
        });
        for (nic_index, cq_index, cq) in every {
            let wanted = match others {
                false => home.has(nic_index * per_nic + cq_index),
                true => {
                    !home.has(nic_index * per_nic + cq_index)
                        && !shared.nics[nic_index].cqs.is_homed(cq_index)
                }
            };
            if !wanted || shared.dead_nics[nic_index].load(Ordering::Acquire) {
                continue;
            }
            let mut completions = std::mem::take(&mut polled.buffer);
            completions.clear();
            if let Err(e) = cq.poll_into(&mut completions) {
                // The pass fails the NIC (once: `fail_nic`).
                polled.failed.push((nic_index, e));
                polled.buffer = completions;
                continue;
            }
            // Receives go to their peers (taken there in their queue
            // pair's order: `PeerState::early`).
            for wc in completions.iter().filter(|wc| wc.wr_id & RECV_BIT != 0) {
                let Some(route) = self.route(polled, nic_index, wc.qp_num) else {
                    continue;
                };
                lock(&route.lock.inbound).push((nic_index, *wc));
                if !polled.inbound.iter().any(|l| Arc::ptr_eq(l, &route.lock)) {
                    polled.inbound.push(route.lock);
                }
            }
            handled += completions.len();
            if completions.iter().any(|wc| !wc.status.is_success()) {
                // An error may come of a device failure or a QP event: the
                // pass takes those first, so requests fail with their
                // cause (its receives are queued above, and handled
                // before them).
                polled.errors.push((nic_index, completions));
                continue;
            }
            // Completions come in runs of one queue pair: its route is
            // looked up, and its peer locked, once a run.
            let mut at = 0;
            while at < completions.len() {
                let qp_num = completions[at].qp_num;
                let end = completions[at..]
                    .iter()
                    .position(|wc| wc.qp_num != qp_num)
                    .map_or(completions.len(), |n| at + n);
                let run = &completions[at..end];
                at = end;
                let mut sends = run.iter().filter(|wc| wc.wr_id & RECV_BIT == 0).peekable();
                if sends.peek().is_none() {
                    continue;
                }
                let Some(route) = self.route(polled, nic_index, qp_num) else {
                    continue;
                };
                let mut guard = lock_slot(&route.lock);
                if guard.on_send_completions(route.index, qp_num, sends) {
                    self.settle_slot(guard);
                }
            }
            polled.buffer = completions;
        }
        for peer_lock in std::mem::take(&mut polled.inbound) {
            if let Some((guard, taken)) = self.take_receives(&peer_lock) {
                polled.receives_for_pass |= guard.peer.as_ref().is_some_and(|p| !p.for_pass.is_empty());
                self.settle_slot(guard);
                if taken {
                    self.wake();
                }
            }
        }
        handled
    }

    /// Handles the control receives queued on the peer of `peer_lock`
    /// (`PeerLock::inbound`), under its lock alone, in their queue pair's
    /// order (`PeerState::early`): each message is handled here, by the
    /// paths' parts of the peer or its connection (only those behind a
    /// replaced queue pair 0 are left to the engine's pass,
    /// `PeerState::for_pass`). The guard is handed back to be settled (or
    /// dropped, by the pass), with whether a path took a message (the
    /// pass is due then: wake a parked driver once the guard is gone);
    /// `None`: none was queued.
    fn take_receives<'l>(&self, peer_lock: &'l PeerLock) -> Option<(SlotGuard<'l>, bool)> {
        let mut guard = lock_slot(peer_lock);
        let received = std::mem::take(&mut *lock(&peer_lock.inbound));
        if received.is_empty() {
            return None;
        }
        let mut taken = false;
        for (nic, wc) in received {
            taken |= self.receive_alone(peer_lock.index, &mut guard, nic, &wc);
        }
        if taken {
            // A path's part of the peer took a message: its step is the
            // pass's (a request to serve, a reply to take up). A parked
            // driver is woken once the peer's lock is gone.
            self.shared.due.set();
        }
        Some((guard, taken))
    }

    /// One control receive of the peer in `slot` (`slot_state`), under its
    /// lock alone (see [`Engine::take_receives`]): taken in its queue
    /// pair's order, with those that came early and are now in turn.
    /// Returns whether a path took one of their messages.
    fn receive_alone(
        &self,
        slot: usize,
        slot_state: &mut PeerSlot,
        nic: usize,
        wc: &Completion,
    ) -> bool {
        let Some(peer) = slot_state.peer.as_mut() else {
            return false;
        };
        let index = (wc.wr_id & !RECV_BIT) as usize;
        let queue = (nic, wc.qp_num);
        if !peer.control.receives.is_posted_on(index, queue) {
            tracing::debug!(index, "a receive completion of a slot not posted there");
            return false;
        }
        let mut taken = false;
        for (_, (nic, wc)) in peer.control.receives.complete(index, queue, (nic, *wc)) {
            taken |= self.receive_in_turn(slot, slot_state, nic, &wc);
        }
        taken
    }

    /// One control receive of the peer in `slot` (`slot_state`) in its
    /// turn: its message handled there, by a path or the connection.
    /// Returns whether a path took it.
    fn receive_in_turn(
        &self,
        slot: usize,
        slot_state: &mut PeerSlot,
        nic: usize,
        wc: &Completion,
    ) -> bool {
        let Some(peer) = slot_state.peer.as_mut() else {
            return false;
        };
        let index = (wc.wr_id & !RECV_BIT) as usize;
        // Behind receives left to the pass (those of a replaced queue pair
        // 0 are its, as it unroutes the queue pair), in turn: the pass
        // reads it again, and its slot stays posted.
        if !peer.for_pass.is_empty() || !peer.retired.is_empty() {
            peer.for_pass.push_back((nic, *wc));
            return false;
        }
        // A peer dropped for misbehaving is not listened to any more (see
        // `Engine::on_receive`).
        let dropped = matches!(peer.gone, Some(PeerGone::Misbehaved(_)));
        let mut taken = false;
        if wc.status.is_success() && !dropped {
            let size = self.shared.config.max_message as usize;
            let mut bytes = vec![0; (wc.byte_len as usize).min(size)];
            if let Err(e) = peer.control.recv.read_at((index * size) as u64, &mut bytes) {
                tracing::warn!(error = %e, "reading a control message");
            }
            match self.on_message(slot, slot_state, &bytes) {
                Ok(by_path) => taken = by_path,
                Err(why) => {
                    let PeerSlot { core, peer, .. } = slot_state;
                    if let Some(peer) = peer.as_mut() {
                        drop_misbehaving(core, peer, &why);
                    }
                }
            }
        }
        let PeerSlot { core, peer, .. } = slot_state;
        let Some(peer) = peer.as_mut() else {
            return taken;
        };
        peer.control.receives.release(index);
        if core.is_ready(peer.qps[0].core)
            && let Err(e) = self.post_free_receives(peer)
        {
            tracing::warn!(error = %e, "reposting control receives");
        }
        taken
    }

    /// The receives the peers' holders left to the pass
    /// (`PeerState::for_pass`), each peer's in order; with `sweep`, first
    /// those still queued on any peer (`PeerLock::inbound`: a poll's whose
    /// thread has not handled them yet), as error completions are about
    /// to be handled and a revocation notice before an access error names
    /// its cause.
    fn receives_for_pass(&self, state: &mut State, now: Instant, sweep: bool) {
        for slot in 0..state.slots.len() {
            let peer_lock = Arc::clone(&state.slots[slot]);
            if sweep {
                drop(self.take_receives(&peer_lock));
            }
            if !peer_lock.mark.is_due(now) {
                continue;
            }
            // Each is handled, then taken off: a receive of the peer's
            // that comes meanwhile queues behind it.
            loop {
                let next = {
                    let guard = lock_slot(&peer_lock);
                    guard.peer.as_ref().and_then(|p| p.for_pass.front().copied())
                };
                let Some((nic, wc)) = next else { break };
                self.on_receive(state, slot, nic, &wc);
                if let Some(peer) = lock_slot(&peer_lock).peer.as_mut() {
                    peer.for_pass.pop_front();
                }
            }
        }
    }

    /// The route of queue pair `qp_num` on NIC `nic`: from this thread's
    /// copy while the routes have not changed since it was made (reading
    /// the shared table writes its lock, which every polling thread
    /// shares).
    fn route(&self, polled: &mut Polled, nic: usize, qp_num: u32) -> Option<Route> {
        let shared = &*self.shared;
        polled.routes.route(&shared.routes, shared.id, nic, qp_num)
    }

    /// After a step of one peer under its lock alone: posts what it made
    /// ready, and tells the engine's pass what it must look at (its
    /// queue-pair actions, its deadlines; a held control message starts
    /// the engine's own thread where no driver runs).
    fn settle_slot(&self, mut slot: SlotGuard<'_>) {
        let shared = &*self.shared;
        slot.post(shared.config.clock.now());
        let mark = slot.mark();
        // Published here, under the lock, once: the guard goes next.
        let settled = slot
            .published
            .take()
            .is_some_and(|published| published.settle(&shared.due, mark));
        drop(slot);
        if settled {
            self.wake();
        }
        if mark.held && shared.drivers.load(Ordering::Acquire) == 0 {
            self.ensure_own_driver();
        }
    }

    /// Tells a parked engine that it has work no fd announces (a batch
    /// queued behind a full queue pair, a cancel, a gate, a revoke).
    pub(super) fn wake(&self) {
        // A follower looks at what it waits for (a peer's state, under
        // the peer's lock) holding the reactor's lock, which a wake-up
        // takes: never under a peer's.
        lock_order::wake();
        self.shared.reactor.wake();
    }

    /// The engine's pass of [`Engine::progress`], under its lock: what
    /// the NICs gave that needs it (`polled`), connection and async events,
    /// deadlines, the paths, queue-pair actions. Says whether landing slots
    /// to make and opened gates wait, and hands out the GPU fences claimed
    /// for stream releases (all served outside the lock).
    fn progress_locked(&self, polled: &mut Polled) -> Handled {
        let shared = &*self.shared;
        let mut state = match polled.for_pass() {
            // What was polled is the pass's to handle: it waits its turn.
            true => look_at_state(shared),
            // Only due: with the lock busy, a later call makes it (what
            // is due stays so), and this one's caller looks at what the
            // poll ended.
            false => match try_look_at_state(shared) {
                Some(state) => state,
                None => return (0, Vec::new(), false, Vec::new()),
            },
        };
        let state = &mut *state;
        shared.due.pass(|| self.look(state, polled))
    }

    /// What the engine's pass looks at ([`Engine::progress_locked`]), once
    /// what was due is cleared ([`PassDue::pass`]); what it leaves is due
    /// again.
    fn look(&self, state: &mut State, polled: &mut Polled) -> Looked<Handled> {
        let shared = &*self.shared;
        let mut handled = 0;
        for (nic_index, e) in polled.failed.drain(..) {
            // A CQ that fails to poll (an overrun lost completions, the
            // device died) completes nothing again: what runs on the NIC
            // fails now rather than at its deadline. The device's own
            // event, when it came, names the cause first.
            self.poll_async_events(state);
            let nic = &shared.nics[nic_index];
            let cause = TransferError::CompletionQueueFailed {
                device: nic.name.clone(),
                source: e,
            };
            self.fail_nic(state, nic_index, &nic.name, cause);
        }
        if !polled.errors.is_empty() {
            self.poll_async_events(state);
        }
        // The receives left to the pass, before the error completions of
        // sends.
        let now = shared.config.clock.now();
        self.receives_for_pass(state, now, !polled.errors.is_empty());
        for (nic_index, completions) in polled.errors.drain(..) {
            // Its receives were taken above.
            for wc in completions.iter().filter(|wc| wc.wr_id & RECV_BIT == 0) {
                let route = shared.routes.get(nic_index, wc.qp_num);
                let Some(route) = route else {
                    continue;
                };
                state
                    .slot(route.slot)
                    .on_send_completions(route.index, wc.qp_num, [wc]);
            }
            polled.buffer = completions;
        }
        // Connection and async events cost a system call each (per QP, per
        // NIC): looked at every millisecond or so (`handoff::EVENTS_EVERY`),
        // not on every empty poll of a wait loop. Error completions look at
        // async events at once.
        if shared.due.take_events() {
            self.poll_connections(state);
            self.poll_async_events(state);
        }
        let now = shared.config.clock.now();
        if state.reconnecting > 0 {
            self.give_up_late_reconnects(state, now);
        }
        // Each peer with something for the pass: its deadlines, then its
        // parts of the staged and peer-copy paths (under its lock alone:
        // its slot holds them); the staged part's landing slots to make
        // are claimed here.
        let mut landings = Vec::new();
        let mut peers_poll = false;
        {
            let (mut staged_path, mut copies) = (shared.staged(), shared.copies());
            let due = state.slots.iter().enumerate();
            for (slot, lock) in due.filter(|(_, l)| l.mark.is_due(now)) {
                let mut guard = lock_slot(lock);
                guard.core.handle_timeout(now);
                let gone = guard.peer.as_ref().is_none_or(|p| p.gone.is_some());
                let copy = &guard.copy;
                if copy.has_work(guard.core.conn.peer_copy()) || (gone && copy.ipc_handles() > 0) {
                    handled += on_slot_copy(&shared.res, slot, now, &mut guard, |cx, part| {
                        copies.progress_peer(cx, slot, part)
                    });
                    peers_poll |= guard.copy.polls();
                }
                if guard.staged.is_idle(guard.core.conn.rendezvous()) {
                    continue;
                }
                handled += on_slot(&shared.res, slot, now, &mut guard, |cx, part| {
                    staged_path.progress_peer(cx, slot, part)
                });
                let PeerSlot {
                    core, peer, staged, ..
                } = &mut *guard;
                let rendezvous = core.conn.rendezvous();
                let gone = peer.as_ref().is_none_or(|p| p.gone.is_some());
                if !gone && let Some(gpu) = staged.claim_landing(rendezvous) {
                    landings.push((slot, gpu));
                }
                peers_poll |= staged.polls(rendezvous);
            }
        }
        state.peers_poll = peers_poll;
        // The gates and stream fences (under their lock, below the
        // engine's); the GPU fences of ended batches' stream fences are
        // claimed here and made outside the locks, those needing none are
        // released now.
        let streams = look_at_streams(shared).look(&shared.res, &state.slots, now);
        handled += streams.handled;
        let flushes = streams.flushes;
        self.run_actions(state);
        self.post_ready(state);
        let serve = streams.serve;
        // While a path or a re-establishment runs, every progress call
        // makes the pass (their steps are polled); otherwise the next one
        // due is at the earliest deadline.
        let again = state.reconnecting > 0
            || peers_poll
            || streams.again
            || !landings.is_empty()
            || serve;
        Looked {
            out: (handled, landings, serve, flushes),
            again,
            at: Self::next_deadline_of(state),
        }
    }

    /// A control receive of the peer in `slot` completed (under the
    /// engine's lock: its message may be a path's).
    fn on_receive(&self, state: &mut State, slot: usize, nic: usize, wc: &Completion) {
        let index = (wc.wr_id & !RECV_BIT) as usize;
        let message = {
            let mut guard = state.slot(slot);
            let Some(peer) = guard.peer.as_mut() else {
                return;
            };
            if !peer.control.receives.is_posted_on(index, (nic, wc.qp_num)) {
                tracing::debug!(index, "a receive completion of a slot not posted there");
                return;
            }
            peer.control.receives.release(index);
            // A peer dropped for misbehaving is not listened to any more:
            // what it had already sent would build up again what the drop
            // let go.
            let dropped = matches!(peer.gone, Some(PeerGone::Misbehaved(_)));
            (wc.status.is_success() && !dropped).then(|| {
                let size = self.shared.config.max_message as usize;
                let mut bytes = vec![0; (wc.byte_len as usize).min(size)];
                if let Err(e) = peer.control.recv.read_at((index * size) as u64, &mut bytes) {
                    tracing::warn!(error = %e, "reading a control message");
                }
                bytes
            })
        };
        let mut guard = state.slot(slot);
        let failed = message.and_then(|bytes| self.on_message(slot, &mut guard, &bytes).err());
        let PeerSlot { core, peer, .. } = &mut *guard;
        let Some(peer) = peer.as_mut() else {
            return;
        };
        if let Some(why) = failed {
            drop_misbehaving(core, peer, &why);
        }
        // Repost the slot (on queue pair 0 as it is now: a flush from a
        // replaced one frees its slot for the new one).
        if core.is_ready(peer.qps[0].core)
            && let Err(e) = self.post_free_receives(peer)
        {
            tracing::warn!(error = %e, "reposting control receives");
        }
        let receives = &peer.control.receives;
        let nic0 = peer.qps[0].nic;
        let mut routes = None;
        peer.retired.retain(|conn| {
            let kept = receives.any_posted_on((nic0, conn.qp().qp_num()));
            if !kept {
                routes
                    .get_or_insert_with(|| self.shared.routes_mut())
                    .remove(&(nic0, conn.qp().qp_num()));
            }
            kept
        });
    }

    /// Handles control message `bytes` of the peer in `slot` (its lock
    /// held: `slot_state`). Returns whether a path took it; `Err`: the
    /// peer broke the protocol and is to be dropped.
    fn on_message(
        &self,
        slot: usize,
        slot_state: &mut PeerSlot,
        bytes: &[u8],
    ) -> Result<bool, PeerMisbehaved> {
        let message = match Control::decode(bytes) {
            Ok(m) => m,
            // A control message that does not decode: the peer broke the
            // protocol (the version was agreed in the handshake).
            Err(e) => return Err(PeerMisbehaved::Malformed(e)),
        };
        // The paths own what they know of the peer, in its slot: each
        // takes the messages of its protocol under the peer's lock and
        // hands the others back; what is left is the connection's (or
        // nobody's).
        let res = &self.shared.res;
        let now = res.config.clock.now();
        let mut copies = self.shared.copies();
        let message = on_slot_copy(res, slot, now, slot_state, |cx, peer| {
            copies.on_control(cx, slot, peer, message)
        })?;
        let Some(message) = message else {
            return Ok(true);
        };
        let mut staged = self.shared.staged();
        let message = on_slot(res, slot, now, slot_state, |cx, peer| {
            staged.on_control(cx, slot, peer, message)
        })?;
        let Some(message) = message else {
            return Ok(true);
        };
        // A revoke handed back may leave the peer-copy path a release to
        // send (once no copy of ours runs under the grant): the pass's.
        let path_work = slot_state.copy.has_work(slot_state.core.conn.peer_copy());
        let PeerSlot { core, peer, .. } = slot_state;
        let Some(peer) = peer.as_mut() else {
            return Ok(path_work);
        };
        on_connection_message(core, peer, message).map(|()| path_work)
    }


    fn poll_connections(&self, state: &mut State) {
        for lock in &state.slots {
            // A peer whose lock is busy now is left to a later pass (a
            // pass a millisecond): its holder is most often its own thread
            // at work, which would wait for this pass instead. At most
            // `EVENTS_SKIPPED_MAX` in a row.
            let skipped = lock.events_skipped.load(Ordering::Relaxed);
            let guard = match skipped < EVENTS_SKIPPED_MAX {
                true => try_lock_slot(lock),
                false => Some(lock_slot(lock)),
            };
            let Some(mut guard) = guard else {
                lock.events_skipped.store(skipped + 1, Ordering::Relaxed);
                continue;
            };
            lock.events_skipped.store(0, Ordering::Relaxed);
            let PeerSlot { core, peer, .. } = &mut *guard;
            let Some(peer) = peer else { continue };
            for qp in &peer.qps {
                if !core.is_ready(qp.core) {
                    continue;
                }
                match qp.conn.poll_state(Duration::ZERO) {
                    Ok(ConnectionState::Connected) => {}
                    Ok(other) => {
                        // This queue pair only: it is re-established (or
                        // given up, and the peer with it, once none is
                        // left).
                        let why = PeerGone::Disconnected { state: other };
                        core.fail_qp(qp.core, TransferError::PeerGone(why));
                    }
                    Err(e) => tracing::debug!(error = %e, "polling a connection's events"),
                }
            }
        }
    }

    /// Takes every NIC's async events: a fatal device error fails
    /// everything on that NIC at once (nothing will flush); a queue pair's
    /// fatal error fails that queue pair.
    fn poll_async_events(&self, state: &mut State) {
        for (nic_index, nic) in self.shared.nics.iter().enumerate() {
            loop {
                let event = match nic.context.next_async_event() {
                    Ok(Some(event)) => event,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(device = %nic.name, error = %e, "reading async events");
                        break;
                    }
                };
                tracing::warn!(device = %nic.name, ?event, "async event");
                match event {
                    hal_verbs::AsyncEvent::DeviceFatal => {
                        let cause = TransferError::DeviceFatal {
                            device: nic.name.clone(),
                        };
                        self.fail_nic(state, nic_index, &nic.name, cause);
                    }
                    hal_verbs::AsyncEvent::CqError { .. } => {
                        let cause = TransferError::CompletionQueueFailed {
                            device: nic.name.clone(),
                            source: hal_verbs::VerbsError::OutOfResources {
                                operation: "the CQ error event (completions were lost)",
                                errno: None,
                            },
                        };
                        self.fail_nic(state, nic_index, &nic.name, cause);
                    }
                    hal_verbs::AsyncEvent::QpFatal { qp_num }
                    | hal_verbs::AsyncEvent::QpRequestError { qp_num }
                    | hal_verbs::AsyncEvent::QpAccessError { qp_num } => {
                        let route = self.shared.routes.get(nic_index, qp_num);
                        if let Some(route) = route {
                            let mut guard = lock_slot(&route.lock);
                            let PeerSlot { core, peer, .. } = &mut *guard;
                            if let Some(peer) = peer.as_ref()
                                && peer.qps[route.index].conn.qp().qp_num() == qp_num
                            {
                                core.fail_qp(
                                    peer.qps[route.index].core,
                                    TransferError::QpAsyncError { event },
                                );
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// NIC `nic_index` can no longer complete anything (a fatal device
    /// error, or its CQ lost completions): it is dead for this engine;
    /// every request on its queue pairs fails now with `cause`, and a peer
    /// with no queue pair left is gone.
    fn fail_nic(&self, state: &mut State, nic_index: usize, name: &str, cause: TransferError) {
        if self.shared.dead_nics[nic_index].swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(device = %name, error = %cause, "NIC failed");
        for lock in &state.slots {
            let mut guard = lock_slot(lock);
            let PeerSlot { core, peer, .. } = &mut *guard;
            let Some(peer) = peer else { continue };
            for qp in peer.qps.iter().filter(|q| q.nic == nic_index) {
                core.abandon_qp(qp.core, cause.clone());
            }
            if peer.qps.iter().all(|q| !core.is_ready(q.core)) {
                peer.gone.get_or_insert_with(|| PeerGone::DeviceFailed {
                    device: name.to_string(),
                });
            }
        }
    }

    fn run_actions(&self, state: &mut State) {
        let now = self.shared.config.clock.now();
        for slot in 0..state.slots.len() {
            if !state.slots[slot].mark.is_due(now) {
                continue;
            }
            loop {
                // One action at a time: a drained queue pair's handling
                // takes the peer's lock itself.
                let (action, index) = {
                    let mut guard = state.slot(slot);
                    let PeerSlot { core, peer, .. } = &mut *guard;
                    let Some(action) = core.poll_action() else {
                        break;
                    };
                    let qp = match action {
                        Action::StopQp(qp) | Action::QpDrained(qp) => qp,
                    };
                    // A peer's queue pairs are its core's, in index order.
                    let Some(index) = peer
                        .as_ref()
                        .and_then(|p| p.qps.iter().position(|q| q.core == qp))
                    else {
                        continue;
                    };
                    if let (Action::StopQp(_), Some(peer)) = (&action, peer.as_ref())
                        && let Err(e) = peer.qps[index].conn.qp().to_error()
                    {
                        tracing::warn!(error = %e, "stopping a queue pair");
                    }
                    (action, index)
                };
                if let Action::QpDrained(_) = action {
                    tracing::debug!(slot, qp = index, "queue pair drained");
                    self.on_qp_drained(state, slot, index);
                }
            }
        }
    }

    /// A failed queue pair has nothing left in flight: re-establish it
    /// (the connecting side reconnects; the accepting side installs the
    /// connection the peer made, or waits for it), unless its peer or its
    /// NIC is gone.
    fn on_qp_drained(&self, state: &mut State, slot: usize, index: usize) {
        let lock = Arc::clone(&state.slots[slot]);
        let mut guard = lock_slot(&lock);
        let PeerSlot { core, peer, .. } = &mut *guard;
        let Some(peer) = peer.as_mut() else {
            return;
        };
        // Drained, it completes nothing more: its seat goes to its
        // successor or another peer's queue pair.
        peer.qps[index].conn.release_seat();
        let now = self.shared.config.clock.now();
        let nic_dead = self.shared.dead_nics[peer.qps[index].nic].load(Ordering::Acquire);
        let peer_gone = peer.gone.is_some();
        match core.conn.recovery_mut().on_drained(index, now, peer_gone, nic_dead) {
            Drained::Gone(why) => {
                drop(peer.qps[index].replacement.take());
                peer.gone.get_or_insert_with(|| why.into());
            }
            Drained::StaysDown => drop(peer.qps[index].replacement.take()),
            Drained::Install => match peer.qps[index].replacement.take() {
                Some(conn) => {
                    drop(guard);
                    self.install(state, slot, index, conn);
                }
                None => tracing::warn!(qp = index, "no new connection to install"),
            },
            Drained::Reconnect { dial, .. } => {
                if !core.begin_reconnect(peer.qps[index].core) {
                    return;
                }
                state.reconnecting += 1;
                let q = &peer.qps[index];
                // Tell the peer (its side of this queue pair may be
                // healthy): the connecting side then reconnects.
                if let Err(e) = q.conn.disconnect() {
                    tracing::debug!(error = %e, "disconnecting a failed queue pair");
                }
                tracing::info!(peer = %peer.addr, qp = index, "re-establishing a queue pair");
                if let (true, Some(path)) = (dial, q.path) {
                    let job = Reconnect {
                        slot,
                        index,
                        path,
                        nic: q.nic,
                        session: core.conn.session(),
                        count: peer.qps.len() as u16,
                        engine_id: core.conn.peer_engine(),
                    };
                    // An internal thread: it holds the engine only for
                    // one attempt at a time (`InternalHolds`), so the
                    // engine closes when its caller's last handle goes,
                    // which ends the attempt under way
                    // (`ConnectionManager::abort_connects`).
                    let weak = Arc::downgrade(&self.shared);
                    let holds = Arc::clone(&self.shared.holds);
                    if let Err(e) = std::thread::Builder::new()
                        .name("gdr-reconnect".into())
                        .spawn(move || reconnect_thread(&weak, &holds, &job))
                    {
                        tracing::warn!(error = %e, "no thread to re-establish a queue pair");
                    }
                }
            }
        }
    }

    /// One attempt at a new connection for a failed queue pair of a peer
    /// this side connected to: `true` when it should be tried again (after
    /// a back-off), `false` once it is up, refused, or no longer wanted
    /// (given up, or the peer gone).
    fn reconnect_once(&self, job: &Reconnect) -> bool {
        let shared = &self.shared;
        // A wanted queue pair with no bound still tries an hour at a time.
        const LONGEST_ATTEMPT: Duration = Duration::from_secs(3600);
        {
            let left = {
                let state = look_at_state(shared);
                let guard = state.slot(job.slot);
                let Some(peer) = guard.peer.as_ref() else {
                    return false;
                };
                if peer.gone.is_some() {
                    return false;
                }
                match guard
                    .core
                    .conn
                    .recovery()
                    .time_left(job.index, shared.config.clock.now())
                {
                    Some(left) => left.min(LONGEST_ATTEMPT),
                    None => return false,
                }
            };
            let hello = self.hello(Role::Connect, job.session, job.index as u16, job.count);
            // One attempt may take all the time left: an attempt given up
            // early leaves the acceptor's listener waiting on it (up to the
            // same bound) while the next one queues behind it.
            let mut params = self.connect_params(left);
            params.source = job.path.source;
            let n = &shared.nics[job.nic];
            let prefer = {
                let state = look_at_state(shared);
                let guard = state.slot(job.slot);
                guard.peer.as_ref().and_then(|p| {
                    let others = p.qps.iter().enumerate().filter(|(i, q)| *i != job.index && q.nic == job.nic);
                    others.map(|(_, q)| q.conn.cq()).next()
                })
            };
            let seat = match self.cq_seat(job.nic, prefer) {
                Ok(seat) => seat,
                Err(e) => {
                    // Seats free as queue pairs go: tried again later.
                    tracing::debug!(error = %e, qp = job.index, "reconnect attempt: every CQ full");
                    return true;
                }
            };
            let cq = &n.cqs.queues()[seat.cq()];
            let attempt = shared
                .cm
                .connect(job.path.peer, n.ladder.pd(), cq, cq, &params, &hello.encode())
                .map(|conn| resources::SeatedConnection::new(conn, seat));
            let refused = |why: DialRefused| {
                let mut state = lock_state(shared);
                self.give_up_qp(
                    &mut state,
                    job.slot,
                    job.index,
                    GiveUp::Refused {
                        index: job.index,
                        why,
                    },
                );
            };
            match attempt {
                Ok(conn) => {
                    let reply = Hello::decode(&conn.peer_private_data())
                        .map_err(DialRefused::Malformed)
                        .and_then(|reply| {
                            gdr_proto::reconnect::check_reply(
                                &reply,
                                job.session,
                                job.index,
                                job.engine_id,
                            )
                            .map_err(DialRefused::Mismatch)
                        });
                    if let Err(why) = reply {
                        refused(why);
                        return false;
                    }
                    let mut state = lock_state(shared);
                    let now = shared.config.clock.now();
                    let wanted = {
                        let slot = state.slot(job.slot);
                        slot.peer.as_ref().is_some_and(|p| p.gone.is_none())
                            && slot.core.conn.recovery().time_left(job.index, now).is_some()
                    };
                    if wanted {
                        self.install(&mut state, job.slot, job.index, conn);
                        self.post_ready(&mut state);
                    }
                    false
                }
                Err(hal_verbs::VerbsError::ConnectionRejected { private_data, .. }) => {
                    let why = RejectReason::decode(&private_data)
                        .map_or(DialRefused::RejectedUnexplained, DialRefused::Rejected);
                    refused(why);
                    false
                }
                Err(e) => {
                    tracing::debug!(error = %e, qp = job.index, "reconnect attempt failed");
                    true
                }
            }
        }
    }

    /// Puts a new connection in place of queue pair `index` of the peer
    /// in `slot` (its old one drained) and lets it post again.
    fn install(
        &self,
        state: &mut State,
        slot: usize,
        index: usize,
        conn: resources::SeatedConnection,
    ) {
        let lock = Arc::clone(&state.slots[slot]);
        let mut guard = lock_slot(&lock);
        let PeerSlot { core, peer, .. } = &mut *guard;
        let Some(peer) = peer.as_mut() else {
            return;
        };
        let limits = self.qp_limits(&conn, index, peer.peer_recv_depth);
        if core.conn.recovery_mut().installed(index) {
            state.reconnecting -= 1;
        }
        let q = &mut peer.qps[index];
        q.max_inline = conn
            .qp()
            .caps()
            .max_inline_data
            .min(self.shared.config.inline_threshold);
        let route = Route {
            lock: Arc::clone(&lock),
            slot,
            index,
        };
        self.shared.routes_mut().insert((q.nic, conn.qp().qp_num()), route);
        let old = std::mem::replace(&mut q.conn, conn);
        core.revive(q.core, limits);
        if index == 0 {
            // Its receives come back (flushed) before their slots go to
            // the new queue pair; its completions still route here.
            peer.retired.push(old);
            if let Err(e) = self.post_free_receives(peer) {
                tracing::warn!(error = %e, "posting control receives");
            }
            // An announcement in flight on the old queue pair may be lost.
            let now = self.shared.config.clock.now();
            let timeout = self.shared.config.default_timeout;
            let again: Vec<Vec<u8>> = core.conn.announced().map(<[u8]>::to_vec).collect();
            for bytes in again {
                let cell = Arc::new(CompletionCell::new());
                if let Err((refused, _)) = core.conn.send(bytes, cell, now, timeout) {
                    tracing::warn!(%refused, "announcing a grant again");
                }
            }
        } else {
            self.shared.routes_mut().remove(&(q.nic, old.qp().qp_num()));
            drop(old);
        }
        tracing::info!(peer = %peer.addr, qp = index, "queue pair re-established");
    }

    /// Re-establishing queue pair `index` failed for good: what waits for
    /// it fails; a peer with no queue pair left is gone.
    fn give_up_qp(&self, state: &mut State, slot: usize, index: usize, why: GiveUp) {
        let lock = Arc::clone(&state.slots[slot]);
        let mut guard = lock_slot(&lock);
        let PeerSlot { core, peer, .. } = &mut *guard;
        let Some(peer) = peer.as_mut() else {
            return;
        };
        if !core.conn.recovery_mut().give_up(index, why.clone()) {
            return;
        }
        state.reconnecting -= 1;
        let cause = TransferError::PeerGone(PeerGone::GivenUp(why));
        tracing::warn!(peer = %peer.addr, qp = index, %cause, "queue pair given up");
        core.give_up(peer.qps[index].core, cause);
        if let Some(gone) = core.conn.recovery_mut().poll_gone() {
            peer.gone.get_or_insert_with(|| gone.into());
        }
    }

    /// Gives up the queue pairs not re-established in time.
    fn give_up_late_reconnects(&self, state: &mut State, now: Instant) {
        let State {
            slots,
            reconnecting,
            ..
        } = state;
        for lock in slots.iter() {
            let mut guard = lock_slot(lock);
            let PeerSlot { core, peer, .. } = &mut *guard;
            let Some(peer) = peer else { continue };
            for (index, why) in core.conn.recovery_mut().handle_timeout(now) {
                *reconnecting -= 1;
                let cause = TransferError::PeerGone(PeerGone::GivenUp(why));
                tracing::warn!(peer = %peer.addr, qp = index, %cause, "queue pair given up");
                core.give_up(peer.qps[index].core, cause);
            }
            if let Some(gone) = core.conn.recovery_mut().poll_gone() {
                peer.gone.get_or_insert_with(|| gone.into());
            }
        }
    }

    /// Posts what the peers marked as having work have ready (the
    /// engine's pass: its steps queue work on any peer, each publishing
    /// its mark as its lock goes), then carries out the queue-pair
    /// actions.
    fn post_ready(&self, state: &mut State) {
        let now = self.shared.config.clock.now();
        for lock in state.slots.iter().filter(|lock| lock.mark.is_due(now)) {
            lock_slot(lock).post(now);
        }
        self.run_actions(state);
        self.drive_held_control(state);
    }

    /// Carries out the queue-pair actions the peers' cores hold (a
    /// drained queue pair re-established), under the engine's lock, as
    /// its pass would.
    fn carry_out_actions(&self) {
        let mut state = lock_state(&self.shared);
        self.post_ready(&mut state);
    }

    /// Control messages that could not go out now (the peer's receives
    /// all taken by SENDs whose completions nobody reaped, no free send
    /// slot, queue pair 0 being re-established) go only with progress,
    /// which nobody may be making: a side that only grants or sends never
    /// waits. With no driver running, the engine's own thread makes it.
    fn drive_held_control(&self, state: &State) {
        if self.shared.drivers.load(Ordering::Acquire) > 0 {
            return;
        }
        if state.slots.iter().any(|lock| lock.mark.held()) {
            self.ensure_own_driver();
        }
    }

    /// Makes the landing slots the pass claimed for the peers' rendezvous
    /// requests (`wanted`: by peer slot, with the GPU to pin them with):
    /// outside every lock (allocated, pinned, registered, granted), each
    /// handed back under its peer's lock alone. Returns how many were made.
    fn make_landings(&self, wanted: Vec<(usize, u32)>) -> usize {
        let res = &self.shared.res;
        let mut worked = 0;
        for (slot, gpu) in wanted {
            let peer = self.peer_at(slot);
            let made = staging::make_landing(res, slot, Some(gpu), |region, len| {
                peer.make_grant(region, 0, len, GrantRights::ReadWrite)
            });
            let mut guard = lock_slot(&peer.lock);
            worked += on_slot(res, slot, res.config.clock.now(), &mut guard, |cx, part| {
                part.staged.landing_made(cx, slot, part.rendezvous, made)
            });
            drop(guard);
            // The requests waiting for them go on at the next pass.
            self.shared.due.set();
        }
        worked
    }

    // The peer-copy path's calls ([`peer_copy`]).

    /// What this engine's peer copies have done.
    pub fn peer_copy_stats(&self) -> PeerCopyStats {
        self.shared.peer_copy.stats()
    }
}

/// A thread that makes progress on an engine until dropped: completions,
/// deadlines and connection events are handled, and waiters (blocking or
/// `Future`s) are woken, without any of them polling.
/// `Future`s awaited while it runs count on it to wake them: keep it until
/// they have ended.
pub struct Driver {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    running: Arc<std::sync::atomic::AtomicUsize>,
    reactor: Arc<reactor::Reactor>,
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver").finish_non_exhaustive()
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.reactor.nudge();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the engine's driver thread panicked");
        }
        self.running.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Engine {
    /// Makes progress until `decide`, looking at the slot of the peer of
    /// `lock` under that peer's lock alone, gives an answer, or `timeout`
    /// passes.
    fn progress_until_slot<T>(
        &self,
        timeout: Duration,
        lock: &PeerLock,
        mut decide: impl FnMut(&PeerSlot) -> Option<Result<T, EngineError>>,
    ) -> Result<T, EngineError> {
        self.wait_until(timeout, || decide(&lock_slot(lock)))
    }

    /// A waiter's spin on `home` (its peer's CQs) alone, before it waits
    /// in the reactor, until `done` holds (returned) or the reactor's spin
    /// is over (rounds and time, whatever the rounds handle: completions
    /// of the peer's other work must not keep a wait out of the reactor
    /// past its own timeout). While it spins, polls of every CQ by other
    /// threads leave `home` to it ([`Engine::spin_home`]). No spin for a
    /// waiter whose home is every CQ.
    pub(super) fn spin_home_until(&self, home: CqSet, mut done: impl FnMut() -> bool) -> bool {
        if home == CqSet::ALL {
            return false;
        }
        let start = Instant::now();
        let _spinning = self.spin_home(home);
        for _ in 0..reactor::SPIN_ROUNDS {
            if self.progress_of(home) == 0 {
                std::hint::spin_loop();
            }
            if done() {
                return true;
            }
            if start.elapsed() >= reactor::SPIN_TIME {
                break;
            }
        }
        false
    }

    /// Makes progress until `decide` (taking what locks it needs) gives an
    /// answer, or `timeout` passes.
    fn wait_until<T>(
        &self,
        timeout: Duration,
        mut decide: impl FnMut() -> Option<Result<T, EngineError>>,
    ) -> Result<T, EngineError> {
        let now = self.shared.config.clock.now();
        let mut decided = None;
        self.shared
            .reactor
            .wait_until(self, now.checked_add(timeout), || {
                if decided.is_none() {
                    decided = decide();
                }
                decided.is_some()
            });
        decided.unwrap_or(Err(EngineError::Timeout(TimedOut { after: timeout })))
    }

    /// Runs `f` while holding the engine's lock: for tests that what a
    /// peer does alone never waits for it. Feature `testing`; not for
    /// applications.
    #[cfg(feature = "testing")]
    pub fn with_engine_lock_held<T>(&self, f: impl FnOnce() -> T) -> T {
        let _state = look_at_state(&self.shared);
        f()
    }

    /// The peer in `slot`, as a handle.
    fn peer_at(&self, slot: usize) -> Peer {
        let lock = Arc::clone(&look_at_state(&self.shared).slots[slot]);
        Peer {
            engine: self.clone(),
            slot,
            lock,
        }
    }

    /// Makes the engine's page of fence words if it has none yet, outside
    /// the lock: the allocation (`cuMemHostAlloc`) blocks while a free of
    /// the process waits for a held stream, which this engine's progress
    /// may be the one to release.
    fn ensure_fence_page(&self) -> Result<(), EngineError> {
        if !look_at_streams(&self.shared).stream_fences.needs_page() {
            return Ok(());
        }
        let page = fence::StreamFences::make_page(&self.shared.res)?;
        let spare = lock_streams(&self.shared)
            .stream_fences
            .install_page(page);
        // Another thread's page won: this one is freed outside the lock.
        drop(spare);
        Ok(())
    }

    /// Makes the staging pools of `gpus` that are missing, outside the
    /// lock: allocation, pinning and registration block while a free of
    /// the process waits for a held stream (see [`cuda_worker`]).
    fn ensure_staging_pools(&self, gpus: &[u32]) -> Result<(), EngineError> {
        for &gpu in gpus {
            if self.shared.pools.has_pool(gpu) {
                continue;
            }
            let pool = pipeline::make_pool(&self.shared.res, gpu)?;
            let spare = self.shared.pools.install_pool(pool);
            // Another thread's pool won: this one goes outside the lock.
            drop(spare);
        }
        Ok(())
    }

    /// Starts the engine's own progress thread, once: it holds the engine
    /// weakly and ends when the engine is dropped. A peer's rendezvous on a
    /// staging-rung grant is served only by progress here, which nothing
    /// else may make (the owner may never wait on anything); so are
    /// control messages held back ([`Engine::drive_held_control`]).
    fn ensure_own_driver(&self) {
        if self.shared.own_driver.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak = Arc::downgrade(&self.shared);
        let holds = Arc::clone(&self.shared.holds);
        let running = Arc::clone(&self.shared.drivers);
        running.fetch_add(1, Ordering::AcqRel);
        let spawned = std::thread::Builder::new()
            .name("gdr-engine-own".into())
            .spawn(move || {
                INTERNAL_THREAD.with(|i| i.set(true));
                precise_sleeps();
                // One step leads (or follows) until the engine's last
                // handle nudges it; then the next finds the engine closed.
                while holds
                    .step(&weak, |engine| {
                        let reactor = &engine.shared.reactor;
                        let seen = reactor.nudges();
                        reactor.drive_until(engine, || {
                            reactor.nudges() != seen || holds.closing.load(Ordering::SeqCst)
                        });
                    })
                    .is_some()
                {
                    // Between steps, the closing handle's turn: it polls
                    // for the write guard, which a step taken at once
                    // again would never leave it.
                    while holds.closing.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_micros(100));
                    }
                }
                running.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no progress thread of the engine's own");
            self.shared.drivers.fetch_sub(1, Ordering::AcqRel);
            self.shared.own_driver.store(false, Ordering::Release);
        }
    }

    /// Starts a thread that drives the engine: it makes progress while
    /// work comes and parks on the engine's fds while none does
    /// (the engine's reactor), so a waiting batch or `Future` is woken without
    /// polling of its own: the thread sleeps until a completion, a
    /// submission or a deadline wakes it. Dropping the returned [`Driver`]
    /// stops it. A thread the OS refuses is
    /// [`Unavailable::Os`] (nothing was started).
    pub fn spawn_driver(&self) -> Result<Driver, EngineError> {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let engine = self.clone();
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("gdr-engine".into())
            .spawn(move || {
                precise_sleeps();
                let reactor = &engine.shared.reactor;
                while !flag.load(Ordering::Acquire) {
                    let seen = reactor.nudges();
                    reactor.drive_until(&engine, || {
                        flag.load(Ordering::Acquire) || reactor.nudges() != seen
                    });
                }
            })
            .map_err(|source| {
                EngineError::Unavailable(Unavailable::Os {
                    what: "the engine's driver thread",
                    source,
                })
            })?;
        let running = Arc::clone(&self.shared.drivers);
        running.fetch_add(1, Ordering::AcqRel);
        Ok(Driver {
            stop,
            thread: Some(thread),
            running,
            reactor: Arc::clone(&self.shared.reactor),
        })
    }

    /// Makes the GPU fences (`cuFlushGPUDirectRDMAWrites`) progress
    /// claimed for the stream fences of ended batches, outside the lock
    /// (the call can take long: every peer would wait), then releases
    /// those streams. Returns how many were released.
    fn flush_before_stream_releases(&self, claimed: &[(usize, Vec<u32>)]) -> usize {
        for (_, gpus) in claimed {
            for &gpu in gpus {
                if let Err(e) = self.shared.res.fence_gpu(gpu) {
                    tracing::warn!(gpu, error = %e, "the GPU fence before a stream release");
                }
            }
        }
        let words: Vec<usize> = claimed.iter().map(|(word, _)| *word).collect();
        let mut streams = lock_streams(&self.shared);
        streams.stream_fences.flushed(&words);
        streams.stream_fences.release()
    }

    /// Submits the batches whose gate opened and hands on the outcomes of
    /// those that ended (outside the engine's lock: submitting takes it).
    fn serve_gates(&self) -> usize {
        let serve = lock_streams(&self.shared).gates.serve();
        let (handled, running) = serve.run(
            || self.shared.config.clock.now(),
            |slot, transfers, left| {
                let batch = self.peer_at(slot).submit_with_timeout(transfers, left)?;
                Ok(Box::new(batch) as Box<dyn gate::Opened>)
            },
        );
        if !running.is_empty() {
            lock_streams(&self.shared).gates.running(running);
        }
        handled
    }
}

impl reactor::Parkable for Engine {
    fn progress(&self) -> usize {
        Engine::progress(self)
    }

    fn polls(&self) -> bool {
        if self.shared.nics.iter().any(|n| n.channel.is_none()) {
            return true;
        }
        // The engine's lock busy (a grant, a path's step): poll meanwhile
        // rather than wait for it to look.
        let Some(state) = try_look_at_state(&self.shared) else {
            return true;
        };
        let Some(streams) = crate::sync::try_lock(&self.shared.streams) else {
            return true;
        };
        state.reconnecting > 0 || state.peers_poll || streams.gates.waiting()
    }

    fn arm(&self) {
        for nic in self.shared.nics.iter().filter(|n| n.channel.is_some()) {
            for cq in nic.cqs.queues() {
                if let Err(e) = cq.req_notify(hal_verbs::CqNotify::Next) {
                    tracing::debug!(device = %nic.name, error = %e, "arming the CQ");
                }
            }
        }
    }

    fn park_set(&self, fds: &mut Vec<std::os::fd::RawFd>) -> Option<Instant> {
        use hal_verbs::{CompletionChannel as _, Connection as _, Context as _};
        for nic in self.shared.nics.iter() {
            if let Some(channel) = &nic.channel {
                fds.push(channel.fd());
            }
            fds.push(nic.context.async_fd());
        }
        // One look under the lock: the connections' fds and the deadline
        // (the lock busy: a park no longer than a polling one's).
        let Some(mut state) = try_look_at_state(&self.shared) else {
            return Some(self.now() + Duration::from_micros(20));
        };
        for lock in &state.slots {
            if let Some(peer) = &lock_slot(lock).peer {
                fds.extend(peer.qps.iter().map(|qp| qp.conn.event_fd()));
            }
        }
        Self::next_deadline_of(&mut state)
    }

    fn drain(&self) {
        use hal_verbs::CompletionChannel as _;
        for nic in self.shared.nics.iter() {
            let Some(channel) = &nic.channel else {
                continue;
            };
            while let Ok(Some(_)) = channel.get_cq_event() {}
        }
    }

    fn now(&self) -> Instant {
        self.shared.config.clock.now()
    }
}

/// An event recorded on `stream` now, after a gate's signal. An event
/// records only on a stream of its own context, and which GPU `stream`
/// belongs to is not known here: each of the engine's GPUs is tried in
/// turn.
fn record_gate_event(
    res: &Resources,
    stream: &hal_cuda::dynamic::DynStream,
) -> Result<events::PooledEvent, EngineError> {
    use hal_cuda::Stream as _;
    let gpus = res.nics.first().map_or(&[][..], |n| n.ladder.gpus());
    let mut refused = None;
    for gpu in gpus {
        let event = res.events.take(gpu)?;
        match stream.record(&event) {
            Ok(()) => return Ok(event),
            Err(e) => refused = Some(e),
        }
    }
    Err(refused.map_or_else(
        || {
            EngineError::Unavailable(Unavailable::NoGpu {
                purpose: "to record a gate's event on",
            })
        },
        EngineError::from,
    ))
}

/// Makes this thread's short sleeps short: Linux lets a sleep run up to the
/// thread's timer slack (50 µs by default) past its end, which would add
/// that much to every completion a sleeping driver notices (a gate's
/// stream write, a fence's batch). 1 µs here; only this thread.
fn precise_sleeps() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: PR_SET_TIMERSLACK takes a plain number and changes only
        // the calling thread's timer slack; no memory is passed.
        let set = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong) };
        if set != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "timer slack unchanged"
            );
        }
    }
}

/// What a GPU fence did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// Host memory, or a GPU that orders inbound writes for its kernels.
    NotNeeded,
    /// The GPU's inbound writes were flushed.
    Flushed,
}

/// One way to reach a peer: the local source address (which picks the
/// NIC; `None`: the route decides) and the peer's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Path {
    /// Local address to connect from.
    pub source: Option<IpAddr>,
    /// The peer's listening address.
    pub peer: SocketAddr,
}

/// Why a queue pair of a connect did not connect.
enum QpRefused {
    /// The listener rejected it, saying why.
    Rejected(RejectReason),
    /// Anything else (no route, no answer, a reject not of an engine).
    Failed(EngineError),
}

impl From<EngineError> for QpRefused {
    fn from(error: EngineError) -> Self {
        Self::Failed(error)
    }
}

/// How a connect failed: as its dial decided, or on the driver's side.
enum DialFailure {
    Dial(DialError),
    Engine(EngineError),
}

impl From<DialError> for DialFailure {
    fn from(error: DialError) -> Self {
        Self::Dial(error)
    }
}

impl From<EngineError> for DialFailure {
    fn from(error: EngineError) -> Self {
        Self::Engine(error)
    }
}

/// A queue pair to re-establish (what the reconnecting thread needs).
struct Reconnect {
    slot: usize,
    index: usize,
    path: Path,
    nic: usize,
    session: u64,
    count: u16,
    engine_id: u64,
}

/// One direction of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// RDMA READ: remote memory into the local region.
    Read,
    /// RDMA WRITE: the local region into remote memory.
    Write,
}

impl Op {
    /// The verbs operation at `remote_addr` under `rkey`.
    fn send_op(self, remote_addr: u64, rkey: u32) -> SendOp {
        match self {
            Op::Read => SendOp::Read { remote_addr, rkey },
            Op::Write => SendOp::Write { remote_addr, rkey },
        }
    }
}

/// One transfer of a batch: `len` bytes between `local` at `local_offset`
/// and the granted remote range `remote` at `remote_offset`.
#[derive(Debug)]
pub struct Transfer<'a> {
    /// READ or WRITE.
    pub op: Op,
    /// The local region.
    pub local: &'a Region,
    /// Offset in it.
    pub local_offset: u64,
    /// The peer's grant.
    pub remote: &'a MemoryDescriptor,
    /// Offset in the grant.
    pub remote_offset: u64,
    /// Bytes.
    pub len: u64,
}

impl Clone for Transfer<'_> {
    fn clone(&self) -> Self {
        *self
    }
}

impl Copy for Transfer<'_> {}

impl<'a> Transfer<'a> {
    /// A WRITE of `len` bytes from `local` at `local_offset` into `remote`
    /// at `remote_offset`.
    pub fn write(
        local: &'a Region,
        local_offset: u64,
        remote: &'a MemoryDescriptor,
        remote_offset: u64,
        len: u64,
    ) -> Self {
        Self {
            op: Op::Write,
            ..Self::read(local, local_offset, remote, remote_offset, len)
        }
    }

    /// A READ of `len` bytes from `remote` at `remote_offset` into `local`
    /// at `local_offset`.
    pub fn read(
        local: &'a Region,
        local_offset: u64,
        remote: &'a MemoryDescriptor,
        remote_offset: u64,
        len: u64,
    ) -> Self {
        Self {
            op: Op::Read,
            local,
            local_offset,
            remote,
            remote_offset,
            len,
        }
    }
}

/// Drops a peer that broke the protocol: every queue pair disconnected
/// and failed (what is in flight flushes), the reason kept as why it is
/// gone.
/// A message of the connection's (`is_connections`) from `peer`;
/// `Err`: it broke the protocol and is to be dropped.
fn on_connection_message(
    core: &mut Core,
    peer: &mut PeerState,
    message: Control<'_>,
) -> Result<(), PeerMisbehaved> {
    match core.conn.on_control(message)? {
            Received::Event(Event::GrantAnnounced(grant)) => {
                tracing::debug!(grant, "grant announced");
            }
            Received::Event(Event::GrantRevoked(grant)) => peer.revoked.record(grant),
            Received::Event(Event::Goodbye) => {
                peer.gone.get_or_insert(PeerGone::ClosedByPeer);
                // The peer disconnects its queue pairs next: this side's
                // stop now, drain, and give their CQ seats back (whether
                // or not the disconnect's event comes).
                for qp in &peer.qps {
                    core.fail_qp(qp.core, TransferError::PeerGone(PeerGone::ClosedByPeer));
                }
            }
            Received::Event(Event::Message | Event::PathsKnown) | Received::Stale => {}
            // The paths took theirs above (and never hand one back).
            Received::Other(other) => tracing::debug!(?other, "a control message nobody takes"),
        }
    Ok(())
}

fn drop_misbehaving(core: &mut Core, peer: &mut PeerState, why: &PeerMisbehaved) {
    tracing::warn!(peer = %peer.addr, reason = %why, "dropping a misbehaving peer");
    let reason = PeerGone::Misbehaved(why.clone());
    peer.gone.get_or_insert_with(|| reason.clone());
    // Nothing reaches its grants any more: their table (up to
    // `max_remote_grants` descriptors) goes now, not when the engine does.
    core.conn.forget_remote_grants();
    for qp in &peer.qps {
        let _ = qp.conn.disconnect();
        core.fail_qp(qp.core, TransferError::PeerGone(reason.clone()));
    }
}

/// Returns a send slot to its pool when the SEND using it is retired.
struct SendSlot {
    free: Arc<std::sync::Mutex<Vec<usize>>>,
    slot: usize,
}

impl Drop for SendSlot {
    fn drop(&mut self) {
        self.free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(self.slot);
    }
}

/// `len` bytes at `offset` lie inside `size` bytes (and are not none).
fn check_within(what: &'static str, offset: u64, len: u64, size: u64) -> Result<(), EngineError> {
    if len == 0 || offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(EngineError::OutOfBounds {
            what,
            offset,
            len,
            size,
        });
    }
    Ok(())
}

/// Checks a transfer before anything is posted: local bounds, a READ's
/// local memory writable, the grant live on this connection, its rights,
/// its bounds.
fn check_transfer(core: &Core, peer: &PeerState, t: &Transfer<'_>) -> Result<(), EngineError> {
    check_transfer_of(core, peer, t, false)
}

/// [`check_transfer`], but the grant lookup is skipped when `known`: the
/// transfer's descriptor passed it in this call already.
fn check_transfer_of(
    core: &Core,
    peer: &PeerState,
    t: &Transfer<'_>,
    known: bool,
) -> Result<(), EngineError> {
    t.local.check(peer.local_engine, t.local_offset, t.len)?;
    // Every path (NIC, staging, peer copy, gated) checks here before it
    // writes local memory, by NIC or by GPU copy.
    if t.op == Op::Read {
        t.local.check_writable(ReadOnlyUse::ReadInto)?;
    }
    let d = t.remote;
    if !known {
        let not_granted = || EngineError::NotGranted {
            owner: d.owner,
            grant: d.grant,
        };
        if d.owner != core.conn.peer_engine() {
            return Err(not_granted());
        }
        // Field by field: a descriptor that differs from the announced one
        // in anything (a forged range, rkey or address) is refused.
        match core.conn.remote_grant(d.grant) {
            Some(live) if live == d => {}
            None if peer.revoked.contains(d.grant) => {
                return Err(EngineError::Refused(Refusal::GrantRevoked {
                    grant: d.grant,
                }));
            }
            _ => return Err(not_granted()),
        }
    }
    let (allowed, op) = match t.op {
        Op::Read => (d.rights.allows_read(), "READ"),
        Op::Write => (d.rights.allows_write(), "WRITE"),
    };
    if !allowed {
        return Err(EngineError::AccessDenied { grant: d.grant, op });
    }
    check_within("remote grant", t.remote_offset, t.len, d.len)?;
    Ok(())
}

#[cfg(all(test, not(loom)))]
mod teardown_tests {
    use super::*;
    use gdr_sim::{NodeConfig, SimFabric};

    /// The caller's last handle tears the engine down even while one of
    /// its internal threads is in a step: the drop waits for the step, so
    /// once it returns nothing of the engine is left to run its work
    /// (without the wait, the step's thread would drop it later).
    #[test]
    fn the_last_handle_tears_the_engine_down_while_an_internal_step_holds_it() {
        let fabric = SimFabric::new();
        let nic = fabric.add_node("a", NodeConfig::default());
        let engine = Engine::new(&nic.erased(), None, EngineConfig::default()).unwrap();
        let weak = Arc::downgrade(&engine.shared);
        let holds = Arc::clone(&engine.shared.holds);
        let (started, step_started) = std::sync::mpsc::channel();
        let internal = {
            let weak = weak.clone();
            std::thread::spawn(move || {
                INTERNAL_THREAD.with(|i| i.set(true));
                holds.step(&weak, |_engine| {
                    started.send(()).unwrap();
                    std::thread::sleep(Duration::from_millis(200));
                })
            })
        };
        step_started.recv().unwrap();
        drop(engine);
        assert!(
            weak.upgrade().is_none(),
            "the engine outlived its last handle's drop"
        );
        assert_eq!(internal.join().unwrap(), Some(()));
        // Closed: an internal thread finds no engine any more.
        let holds = InternalHolds::default();
        *crate::sync::write(&holds.closed) = true;
        assert_eq!(holds.step(&weak, |_| ()), None);
    }
}

/// The lock-order check ([`lock_order`]) turns the deadlocks it knows into
/// panics (debug builds).
#[cfg(all(test, not(loom), debug_assertions))]
mod lock_order_tests {
    use super::*;

    fn peer_lock() -> PeerLock {
        PeerLock::new(
            0,
            PeerSlot {
                core: Core::for_tests(),
                peer: None,
                to_post: Vec::new(),
                staged: StagedPeer::new(),
                copy: PeerCopyPeer::default(),
            },
            Instant::now(),
        )
    }

    #[test]
    #[should_panic(expected = "a peer's lock taken twice by one thread")]
    fn a_peers_lock_taken_again_by_its_holder_panics() {
        let lock = peer_lock();
        let _held = lock_slot(&lock);
        let _again = lock_slot(&lock);
    }

    #[test]
    #[should_panic(expected = "the engine's lock taken while a peer's is held")]
    fn the_engines_lock_taken_under_a_peers_panics() {
        let lock = peer_lock();
        let _held = lock_slot(&lock);
        lock_order::engine();
    }

    #[test]
    #[should_panic(expected = "the reactor woken while a peer's lock is held")]
    fn the_reactor_woken_under_a_peers_panics() {
        let lock = peer_lock();
        let _held = lock_slot(&lock);
        lock_order::wake();
    }

    #[test]
    #[should_panic(expected = "the streams' lock taken while a peer's is held")]
    fn the_streams_lock_taken_under_a_peers_panics() {
        let lock = peer_lock();
        let _held = lock_slot(&lock);
        lock_order::streams();
    }

    #[test]
    #[should_panic(expected = "a second peer's lock taken while one is held")]
    fn a_second_peers_lock_under_a_peers_panics() {
        let (a, b) = (peer_lock(), peer_lock());
        let _held = lock_slot(&a);
        let _second = lock_slot(&b);
    }

    #[test]
    fn peers_locks_one_after_another_under_the_engines_are_in_order() {
        lock_order::engine();
        let (a, b) = (peer_lock(), peer_lock());
        drop(lock_slot(&a));
        drop(lock_slot(&b));
        // The marks went with their locks.
        lock_order::engine();
        drop(lock_slot(&a));
    }
}
