//! The engine's facade: [`Engine`], [`Region`], [`Listener`], [`Peer`],
//! [`Grant`], [`Batch`] and [`Transfer`], each the engine's type on the
//! erased backends.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use super::{Buffer, Context, Error, Stream};
use crate::buffer::Access;
use crate::descriptor::{GrantRights, MemoryDescriptor, MemoryLocation};
use crate::engine::{
    Batch as BatchOf, Driver, Engine as EngineOf, EngineConfig, EngineListener, Fence, Op, Outcome,
    Peer as PeerOf, Region as RegionOf, RegionGrant, Transfer as TransferOf,
};
use crate::ladder::Rung;

/// A transfer engine over a context's NICs and the GPUs they reach: it
/// registers buffers, listens and connects, and moves bytes between its
/// regions and peers' grants. Cheap to clone (a shared handle).
#[derive(Clone)]
pub struct Engine {
    context: Context,
    inner: EngineOf,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("id", &format_args!("{:#x}", self.inner.id()))
            .field("nics", &self.inner.nics())
            .finish_non_exhaustive()
    }
}

impl Engine {
    pub(super) fn new(context: Context, inner: EngineOf) -> Self {
        Self { context, inner }
    }

    /// An engine on backends of its own: [`Context::open`] then
    /// [`Context::engine`].
    pub fn open(
        choice: crate::backend::BackendChoice,
        config: EngineConfig,
    ) -> Result<Self, Error> {
        Context::open(choice)?.engine(config)
    }

    /// Its context (to allocate buffers and streams).
    pub fn context(&self) -> &Context {
        &self.context
    }

    /// Its id (random, named in the descriptors of its grants).
    pub fn id(&self) -> u64 {
        self.inner.id()
    }

    /// Its NICs' names.
    pub fn nics(&self) -> Vec<String> {
        self.inner.nics()
    }

    /// The address NIC `nic` is reached at ([`Context::nic_address`]).
    pub fn nic_address(&self, nic: &str) -> Result<IpAddr, Error> {
        self.context.nic_address(nic)
    }

    /// Its configuration.
    pub fn config(&self) -> &EngineConfig {
        self.inner.config()
    }

    /// Registers all of `buffer` (a buffer of this engine's context).
    pub fn register(&self, buffer: &Buffer) -> Result<Region, Error> {
        self.register_range(buffer, 0, buffer.len())
    }

    /// Registers `len` bytes of `buffer` at `offset`: on each NIC, by the
    /// first rung of the registration ladder that takes it.
    pub fn register_range(&self, buffer: &Buffer, offset: u64, len: u64) -> Result<Region, Error> {
        if buffer.context().id != self.context.id {
            return Err(Error::Foreign {
                what: "buffer",
                owner: "context (the engine's)",
            });
        }
        let inner = buffer.with(|b| Ok(self.inner.register_range(&b.buffer, offset, len)?))?;
        Ok(Region {
            engine: self.inner.id(),
            inner,
        })
    }

    /// Listens for peers at `addr` (an address of one of its NICs; port 0
    /// picks one).
    pub fn listen(&self, addr: SocketAddr) -> Result<Listener, Error> {
        Ok(Listener {
            inner: self.inner.listen(addr)?,
        })
    }

    /// Connects to the engine listening at `addr`.
    pub fn connect(&self, addr: SocketAddr, timeout: Duration) -> Result<Peer, Error> {
        Ok(Peer {
            engine: self.inner.id(),
            inner: self.inner.connect(addr, timeout)?,
        })
    }

    /// The GPU fence for what peers WROTE into `region`: once this returns,
    /// this process's kernels see it. [`Fence::NotNeeded`] for host memory
    /// and GPUs that order inbound writes themselves.
    pub fn fence_inbound_writes(&self, region: &Region) -> Result<Fence, Error> {
        self.same_engine(region)?;
        Ok(self.inner.fence_inbound_writes(&region.inner)?)
    }

    /// Makes progress once in this thread (completions, deadlines, staged
    /// copies), without waiting: how many events it handled. For callers
    /// that drive the engine from a loop of their own.
    pub fn progress(&self) -> usize {
        self.inner.progress()
    }

    /// The registration cache's counters on NIC `nic`.
    pub fn cache_stats(&self, nic: usize) -> Option<crate::cache::CacheStats> {
        self.inner.cache_stats(nic)
    }

    /// Starts a thread that drives the engine (completions, deadlines,
    /// staged copies): it parks on the engine's fds while nothing happens.
    /// Dropping the [`Driver`] stops it. Without one, [`Batch::wait`]
    /// drives in the caller's thread and an awaited batch starts the
    /// engine's own thread. A thread the OS refuses is
    /// `EngineError::Unavailable` ([`crate::engine::Unavailable::Os`]).
    pub fn spawn_driver(&self) -> Result<Driver, Error> {
        Ok(self.inner.spawn_driver()?)
    }

    /// Drives the engine from the current tokio runtime (a task awaiting
    /// the engine's fds) instead of a thread.
    #[cfg(all(feature = "tokio", not(loom)))]
    pub fn drive_on_tokio(
        &self,
    ) -> Result<crate::engine::AsyncDriver, crate::engine::AsyncDriverError> {
        self.inner.drive_on_tokio()
    }

    fn same_engine(&self, region: &Region) -> Result<(), Error> {
        if region.engine == self.inner.id() {
            Ok(())
        } else {
            Err(Error::Foreign {
                what: "region",
                owner: "engine",
            })
        }
    }
}

/// A registered range of a buffer, for transfers and grants. It keeps the
/// registrations, and the memory under them, alive. Cheap to clone.
#[derive(Clone)]
pub struct Region {
    engine: u64,
    inner: RegionOf,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("len", &self.inner.len())
            .field("rungs", &self.inner.rungs())
            .finish_non_exhaustive()
    }
}

impl Region {
    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where its memory is.
    pub fn location(&self) -> MemoryLocation {
        self.inner.location()
    }

    /// The rung each NIC registered it by.
    pub fn rungs(&self) -> Vec<Rung> {
        self.inner.rungs()
    }

    /// Whether its memory may be written: a region of a read-only buffer
    /// ([`Context::wrap_read_only`]) is never granted with write rights
    /// nor READ into.
    pub fn access(&self) -> Access {
        self.inner.access()
    }

    /// Each rung above the one NIC `nic` took, and why it was not taken.
    pub fn rung_failures(&self, nic: usize) -> Vec<crate::ladder::RungFailure> {
        self.inner.rung_failures(nic).to_vec()
    }

    /// The id of the engine that registered it.
    pub fn engine_id(&self) -> u64 {
        self.engine
    }
}

/// A listening engine: accepts peers.
pub struct Listener {
    inner: EngineListener,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("local_addr", &self.inner.local_addr())
            .finish_non_exhaustive()
    }
}

impl Listener {
    /// The address it listens at (the port picked where 0 was given).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr()
    }

    /// Waits up to `timeout` for a peer to connect. Threads may accept on
    /// one listener at once: each waits on its own, and a peer goes to
    /// one of them.
    pub fn accept(&self, timeout: Duration) -> Result<Peer, Error> {
        let inner = self.inner.accept(timeout)?;
        Ok(Peer {
            engine: inner.engine().id(),
            inner,
        })
    }
}

/// A connected peer: grants to it, and batches of READs and WRITEs
/// against its grants. Cheap to clone.
#[derive(Clone)]
pub struct Peer {
    engine: u64,
    inner: PeerOf,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field(
                "remote_engine",
                &format_args!("{:#x}", self.inner.remote_engine()),
            )
            .finish_non_exhaustive()
    }
}

/// One READ or WRITE of a batch: `len` bytes between `local` at
/// `local_offset` and the peer's grant `remote` at `remote_offset`.
#[derive(Debug, Clone, Copy)]
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
            local,
            local_offset,
            remote,
            remote_offset,
            len,
        }
    }

    /// A READ of `len` bytes of `remote` at `remote_offset` into `local`
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
            ..Self::write(local, local_offset, remote, remote_offset, len)
        }
    }
}

impl Peer {
    /// The remote engine's id.
    pub fn remote_engine(&self) -> u64 {
        self.inner.remote_engine()
    }

    /// How transfers with this peer move GPU memory: through the NIC, or
    /// by device copies (the peer an engine of this process, or of another
    /// process on this machine reached through CUDA IPC).
    pub fn route(&self) -> crate::engine::PeerCopyRoute {
        self.inner.peer_copy()
    }

    /// Grants `len` bytes at `offset` of `region` to this peer with
    /// `rights`, announced on the connection. Dropping the grant revokes
    /// it.
    pub fn grant(
        &self,
        region: &Region,
        offset: u64,
        len: u64,
        rights: GrantRights,
    ) -> Result<Grant, Error> {
        self.same_engine(region)?;
        Ok(Grant {
            inner: self.inner.grant(&region.inner, offset, len, rights)?,
        })
    }

    /// Waits up to `timeout` for the peer to announce grant `grant`.
    pub fn wait_grant(&self, grant: u64, timeout: Duration) -> Result<MemoryDescriptor, Error> {
        Ok(self.inner.wait_grant(grant, timeout)?)
    }

    /// Submits a batch with the engine's default timeout.
    pub fn submit(&self, transfers: &[Transfer<'_>]) -> Result<Batch, Error> {
        self.submit_inner(transfers, None)
    }

    /// Submits a batch that must end within `timeout`: every transfer is
    /// checked (local bounds, the grant live on this connection, its
    /// rights and bounds) before anything is posted.
    pub fn submit_with_timeout(
        &self,
        transfers: &[Transfer<'_>],
        timeout: Duration,
    ) -> Result<Batch, Error> {
        self.submit_inner(transfers, Some(timeout))
    }

    /// A WRITE of all of `local` into `remote` at `remote_offset`.
    pub fn write(
        &self,
        local: &Region,
        remote: &MemoryDescriptor,
        remote_offset: u64,
    ) -> Result<Batch, Error> {
        self.submit(&[Transfer::write(
            local,
            0,
            remote,
            remote_offset,
            local.len(),
        )])
    }

    /// A READ into all of `local` from `remote` at `remote_offset`.
    pub fn read(
        &self,
        local: &Region,
        remote: &MemoryDescriptor,
        remote_offset: u64,
    ) -> Result<Batch, Error> {
        self.submit(&[Transfer::read(local, 0, remote, remote_offset, local.len())])
    }

    /// Submits a batch that starts once `stream` reaches this point (no CPU
    /// thread waits for the stream); `timeout` (`None`: the engine's
    /// default) covers the wait.
    pub fn submit_after_stream(
        &self,
        stream: &Stream,
        transfers: &[Transfer<'_>],
        timeout: Option<Duration>,
    ) -> Result<Batch, Error> {
        for t in transfers {
            self.same_engine(t.local)?;
        }
        let transfers = unerased(transfers);
        let timeout = timeout.unwrap_or(self.inner.engine().config().default_timeout);
        Ok(Batch {
            inner: self
                .inner
                .submit_after_stream(&stream.inner.0, &transfers, timeout)?,
        })
    }

    /// Sends a control message (at most the negotiated size).
    pub fn send(&self, message: &[u8]) -> Result<Batch, Error> {
        Ok(Batch {
            inner: self.inner.send(message)?,
        })
    }

    /// Waits up to `timeout` for the peer's next control message.
    pub fn recv(&self, timeout: Duration) -> Result<Vec<u8>, Error> {
        Ok(self.inner.recv(timeout)?)
    }

    /// Closes the connection: requests under way fail, the peer is told.
    pub fn close(&self) -> Result<(), Error> {
        Ok(self.inner.close()?)
    }

    fn submit_inner(
        &self,
        transfers: &[Transfer<'_>],
        timeout: Option<Duration>,
    ) -> Result<Batch, Error> {
        for t in transfers {
            self.same_engine(t.local)?;
        }
        let transfers = unerased(transfers);
        let inner = match timeout {
            Some(timeout) => self.inner.submit_with_timeout(&transfers, timeout)?,
            None => self.inner.submit(&transfers)?,
        };
        Ok(Batch { inner })
    }

    fn same_engine(&self, region: &Region) -> Result<(), Error> {
        if region.engine == self.engine {
            Ok(())
        } else {
            Err(Error::Foreign {
                what: "region",
                owner: "engine (the peer's)",
            })
        }
    }
}

/// Memory granted to a peer; dropping it revokes the grant.
pub struct Grant {
    inner: RegionGrant,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("descriptor", self.inner.descriptor())
            .finish()
    }
}

impl Grant {
    /// What the peer uses (it got it on the connection too).
    pub fn descriptor(&self) -> &MemoryDescriptor {
        self.inner.descriptor()
    }

    /// The grant's id (the descriptor's).
    pub fn id(&self) -> u64 {
        self.descriptor().grant
    }

    /// Revokes the grant and waits, at most `timeout`, for the revocation
    /// fence: once this returns `Ok`, no byte moves under the grant by any
    /// path, the requests the peer had under way included (they fail).
    pub fn revoke(self, timeout: Duration) -> Result<(), Error> {
        Ok(self.inner.revoke(timeout)?)
    }
}

/// A submitted batch: ends exactly once (`wait`, `status`, `cancel`, or
/// `.await`).
pub struct Batch {
    inner: BatchOf,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("status", &self.inner.status())
            .finish()
    }
}

impl Batch {
    /// The outcome, if it has ended.
    pub fn status(&self) -> Option<Outcome> {
        self.inner.status()
    }

    /// Waits up to `timeout` for the batch to end (driving the engine in
    /// this thread when no other does); `TransferError::Timeout` if it
    /// has not, the batch still running.
    pub fn wait(&self, timeout: Duration) -> Outcome {
        self.inner.wait(timeout)
    }

    /// Cancels it: it ends with `TransferError::Cancelled` unless it ended
    /// first; nothing of it runs in the NIC after.
    pub fn cancel(&self) {
        self.inner.cancel()
    }

    /// The `Future`'s poll through a shared reference: the outcome once
    /// ended, else `cx`'s waker registered to be woken when it ends (for
    /// runtimes that hold batches behind handles, as Python's asyncio
    /// glue does).
    pub fn poll_ended(&self, cx: &mut TaskContext<'_>) -> Poll<Outcome> {
        self.inner.poll_ended(cx)
    }

    /// Makes `stream` wait for the batch (its GPU fence included): work
    /// queued on it after this call sees what the batch READ.
    pub fn fence_stream(&self, stream: &Stream) -> Result<(), Error> {
        Ok(self.inner.fence_stream(&stream.inner.0)?)
    }
}

impl Future for Batch {
    type Output = Outcome;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Outcome> {
        self.inner.poll_ended(cx)
    }
}

/// The transfers with the engine's own regions.
fn unerased<'a>(transfers: &[Transfer<'a>]) -> Vec<TransferOf<'a>> {
    transfers
        .iter()
        .map(|t| TransferOf {
            op: t.op,
            local: &t.local.inner,
            local_offset: t.local_offset,
            remote: t.remote,
            remote_offset: t.remote_offset,
            len: t.len,
        })
        .collect()
}
