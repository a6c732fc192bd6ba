//! The path seam: how the engine moves a transfer's bytes.
//!
//! A *path* is one way bytes go between this side's memory and a peer's:
//! the RDMA path (the NIC reads or writes the peer's memory directly), the
//! staged path (GPU memory no NIC reaches goes through pinned bounce
//! slices; the peer's by the slotted rendezvous) and the peer-copy path
//! (the GPU's own copy engines, when the peer's memory is a GPU this
//! process can map). Gating ([`super::gate`]) is not a path: it holds any
//! path's batch until a GPU stream reaches a point.
//!
//! The RDMA path is the engine's own, not an implementation of
//! [`TransferPath`]: its state is the peers' queue pairs and the batches
//! in flight on them ([`gdr_proto::batches`]), which the other
//! paths ride as well (the control channel, the staged path's slices), so
//! it is the [`Wire`] the seam hands them rather than a path beside them.
//!
//! The seam is in the shape of NIXL's backend engine: a path is asked what
//! it can carry ([`TransferPath::carries`], the capability predicate), is
//! handed a batch it said it carries ([`TransferPath::post`], which checks
//! everything before anything moves: NIXL's prepare and post in one call,
//! since nothing here is worth preparing twice), is advanced by
//! [`TransferPath::progress_peer`], takes the control messages of its own
//! protocol ([`TransferPath::on_control`]), and releases what it holds of
//! a peer ([`TransferPath::release_peer`]). Each path owns its state, and
//! what it keeps of a peer is the peer's ([`TransferPath::Peer`]: in the
//! peer's slot, under the peer's lock, handed to every call about that
//! peer with a wire to that peer alone); what a path shares among peers
//! (the staging pools; the peer-copy streams and IPC mappings) is under a
//! lock of its own, taken briefly under a peer's. The engine keeps the
//! peers, the grants and the choice of path per batch, and carries out
//! what the paths ask through [`PathCx`]: the engine's [`Resources`] (read
//! only) and the [`Wire`] (the peer's queue pairs and control channel). No
//! path module reaches the engine, or another path.
//!
//! # The lifetime contract, at the seam
//!
//! - Whatever a path holds of a buffer's memory, it holds through the
//!   buffer's lease: a [`super::Region`] (every rung, the staging rung
//!   included, keeps its `Buffer`'s memory alive), or a `Keep` handed to
//!   the core with the work.
//! - A revoke is a fence: once a grant's revoke completes, no byte moves
//!   under it by any path. A path that serves a peer's requests under a
//!   grant ends each one before the revoke completes (the staged path's
//!   [`gdr_proto::grants`] fence, the peer-copy path's
//!   [`gdr_proto::peer_copy`] windows and released exports).
//! - Every state a peer creates on this side is bounded and has a
//!   deadline ([`gdr_proto::PeerLimits`]); past it the peer is refused or
//!   dropped with a named reason.
//! - Every batch a path takes ends exactly once, through its
//!   [`CompletionCell`].
//!
//! # How a TCP path would fit
//!
//! A TCP path (for peers no NIC reaches) is one more implementation of
//! [`TransferPath`] beside these, owning its sockets and its framing: its
//! `carries` says yes for a peer whose connection is TCP, `post` copies
//! (or `sendfile`s) the local range out and frames the request, its
//! `progress` reads and writes the sockets it owns, and its control
//! messages ride its own stream. Grants stay the engine's: the TCP path
//! checks a request against the same grant tables and the same revocation
//! fence before touching memory, so none of the other paths changes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::completion::CompletionCell;
use super::resources::Resources;
use super::wire::Control;
use super::{EngineError, Op, Region, Transfer, TransferError};
use crate::descriptor::MemoryDescriptor;
use gdr_proto::PeerMisbehaved;

/// What the engine knows of a peer, for a path.
#[derive(Clone, Debug)]
pub(crate) struct PeerView {
    /// The peer's engine id.
    pub(crate) engine: u64,
    /// The connection's session id.
    pub(crate) session: u64,
    /// Why the peer is gone, once it is.
    pub(crate) gone: Option<super::PeerGone>,
}

/// The engine's side of the seam: the peers' connections, which a path
/// asks to carry its control messages and its RDMA operations.
pub(crate) trait Wire {
    /// The peer in `slot`, if there is one.
    fn peer(&self, slot: usize) -> Option<PeerView>;

    /// Queues control message `message` for the peer in `slot`, to go out
    /// within `timeout`; the cell ends when the peer's NIC has it.
    fn send(
        &mut self,
        slot: usize,
        message: &Control<'_>,
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError>;

    /// Posts `rdma` on one of the peer's queue pairs: those on the NICs
    /// nearest GPU `gpu` when one is up, the `spread`-th among the
    /// candidates. The cell ends when the op does, by `deadline`.
    /// `Err(None)`: nothing to report beyond what the caller knows (the
    /// peer is gone).
    fn post_rdma(
        &mut self,
        slot: usize,
        gpu: Option<u32>,
        spread: usize,
        rdma: RdmaOp<'_>,
        deadline: (Instant, Duration),
    ) -> Result<Arc<CompletionCell>, Option<TransferError>>;
}

/// One RDMA operation a path asks the wire for: `op` of `len` bytes
/// between `local` (at address `local_addr`) and the peer's `remote`
/// grant (at offset `remote_at`).
pub(crate) struct RdmaOp<'r> {
    pub(crate) op: Op,
    pub(crate) remote: &'r MemoryDescriptor,
    pub(crate) remote_at: u64,
    pub(crate) local: &'r Region,
    pub(crate) local_addr: u64,
    pub(crate) len: u64,
}

/// What a path is handed for one step: the engine's resources, the wire,
/// and the time the driver read (a path reads no clock).
pub(crate) struct PathCx<'a> {
    /// The engine's shared, unchanging resources.
    pub(crate) res: &'a Resources,
    /// The peers' connections.
    pub(crate) wire: &'a mut dyn Wire,
    /// Now, as the engine's clock read it for this step.
    pub(crate) now: Instant,
}

/// One way of moving a batch's bytes (see the module docs).
///
/// The engine calls these under a lock (its own for what is engine-wide,
/// the peer's for the calls handed its `Peer`); none blocks on a device
/// (a path that needs a synchronous copy hands it out as work to run
/// outside the lock).
pub(crate) trait TransferPath {
    /// What the path keeps of one peer: it lives in the peer's slot, under
    /// the peer's lock, and the engine hands it to the calls about that
    /// peer (with a wire to that peer alone: the peer's lock is held).
    type Peer<'a>;

    /// Whether this path carries `transfers` for the peer in `slot` (its
    /// part here: `peer`; the capability predicate). The engine asks the peer-copy path, then the
    /// staged path, and posts to the first that says yes; what neither
    /// carries goes over the NIC directly (the RDMA path: the batch sliced
    /// over the peer's queue pairs, as [`Wire::post_rdma`] posts one op).
    /// `&mut`: a path may have to open what it would carry them through
    /// to know (the peer-copy path opens, and caches, a peer's IPC handle:
    /// one that does not open here leaves the batch to the NIC).
    fn carries(
        &mut self,
        res: &Resources,
        slot: usize,
        peer: &mut Self::Peer<'_>,
        transfers: &[Transfer<'_>],
    ) -> bool;

    /// Starts `transfers` for the peer in `slot` (its part here: `peer`),
    /// which the engine checked first (local bounds; the grant live on
    /// this connection, its rights and range): the path checks what is
    /// its own (a mapping that opens, a pool it can make) before anything
    /// moves. The returned cell ends exactly once, by `timeout`. On `Err`
    /// nothing started.
    fn post(
        &mut self,
        cx: &mut PathCx<'_>,
        slot: usize,
        peer: &mut Self::Peer<'_>,
        transfers: &[Transfer<'_>],
        timeout: Duration,
    ) -> Result<Arc<CompletionCell>, EngineError>;

    /// Advances the path's part of the peer in `slot`: what ended since
    /// the last call, deadlines passed at `cx.now`, what may start now.
    /// Returns how much moved (a driver counts it as work). The part says
    /// when it wants the next call (its work, its earliest deadline, and
    /// whether only polling sees its work end: GPU copies have no fd to
    /// wait on) through the peer's mark.
    fn progress_peer(&mut self, cx: &mut PathCx<'_>, slot: usize, peer: &mut Self::Peer<'_>)
    -> usize;

    /// A control message from the peer in `slot`: the path takes those of
    /// its own protocol (`Ok(None)`) and hands the others back.
    fn on_control<'m>(
        &mut self,
        cx: &mut PathCx<'_>,
        slot: usize,
        peer: &mut Self::Peer<'_>,
        message: Control<'m>,
    ) -> Result<Option<Control<'m>>, PeerMisbehaved>;

    /// Stops the batches whose outcome goes to one of `cells`; each ends
    /// [`TransferError::Cancelled`] once nothing of it is in flight.
    /// Returns the cells with the parts each stands for, for
    /// [`TransferPath::cancel_peer`].
    fn cancel(&mut self, cells: &[Arc<CompletionCell>]) -> Vec<Arc<CompletionCell>>;

    /// [`TransferPath::cancel`]'s part in the peer's slot.
    fn cancel_peer(&mut self, peer: &mut Self::Peer<'_>, cells: &[Arc<CompletionCell>]);

    /// The peer in `slot` is gone: end what the path does for or with it
    /// and free what it holds of it (once nothing in flight uses it).
    fn release_peer(&mut self, cx: &mut PathCx<'_>, slot: usize, peer: &mut Self::Peer<'_>);
}
