//! A connection to another engine, as the caller holds it: [`Peer`] (grants,
//! submits, control messages, closing) and [`Grant`] (a grant's
//! revoke, waiting or on drop). Each call checks what is the engine's to
//! check (the peer, the grant, its rights and range) and hands the batch to
//! the path that carries it ([`super::path`]).

use super::*;
use gdr_proto::gate::Signal;
use super::fence::StreamFences;

/// A connected peer. Dropping it leaves the connection up (the engine
/// holds it); [`Peer::close`] ends it.
pub struct Peer {
    pub(super) engine: Engine,
    pub(super) slot: usize,
    /// The peer's own lock (its core and connection).
    pub(super) lock: Arc<PeerLock>,
}

impl Clone for Peer {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            slot: self.slot,
            lock: Arc::clone(&self.lock),
        }
    }
}

impl fmt::Debug for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Peer").field("slot", &self.slot).finish()
    }
}

/// A grant this engine gave a peer: MRs of exactly the range and rights on
/// each NIC the peer's queue pairs use. Dropping it revokes it (the peer is
/// told, then the MRs are deregistered).
pub struct Grant {
    pub(super) descriptor: MemoryDescriptor,
    pub(super) peer: Peer,
    // After the notice is queued, the MRs go (field order).
    pub(super) _grants: Vec<MrGrant>,
    /// Its entry for a peer-copy peer of this process.
    pub(super) _published: Option<peer_copy::Publication>,
    /// Served by the staged path (staging-rung memory): its revoke fences
    /// the peer's requests under it, in the peer's slot.
    pub(super) staged: bool,
    /// GPU memory the peer-copy path may export: its revoke takes the
    /// engine's lock (the exports are engine-wide). Any other grant is
    /// made, announced and revoked under the peer's lock alone.
    pub(super) may_export: bool,
}

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grant")
            .field("descriptor", &self.descriptor)
            .finish()
    }
}

impl Grant {
    /// What the peer uses (it got it on the connection too).
    pub fn descriptor(&self) -> &MemoryDescriptor {
        &self.descriptor
    }

    /// The grant's id (the descriptor's): what the peer waits for
    /// ([`Peer::wait_grant`]).
    pub fn id(&self) -> u64 {
        self.descriptor.grant
    }

    /// Revokes the grant and waits, at most `timeout`, for the revocation
    /// fence: once this returns `Ok`, no byte moves under the grant by any
    /// path, the requests the peer had under way included (they fail). A
    /// grant the NIC reaches is fenced as soon as its MRs are deregistered
    /// (here); a staged one once the copies under way under it have ended;
    /// a peer-copy one once the peer's copies queued under it have run (an
    /// engine of this process: its batches stop at their next window) or
    /// the peer process that had its IPC handle answered that it released
    /// it (`peer_copy`). Past `timeout` it returns
    /// [`EngineError::Timeout`], the revoke still under way; a peer process
    /// that never answers leaves it unconfirmed: `Timeout` too, even once
    /// its memory was given back at
    /// [`EngineConfig::peer_copy_release_timeout`].
    ///
    /// Dropping a grant starts the same revoke without waiting.
    pub fn revoke(self, timeout: Duration) -> Result<(), EngineError> {
        let grant = self.descriptor.grant;
        let peer = self.peer.clone();
        let same_process = self._published.as_ref().map(|p| Arc::clone(&p.fence));
        let may_export = self.may_export;
        let on_paths = self.staged || may_export;
        drop(self);
        if !on_paths {
            // Fenced: its MRs were deregistered by the drop.
            return Ok(());
        }
        let staged_fenced = |slot: &PeerSlot| match slot.peer.as_ref() {
            Some(p) => {
                let rendezvous = slot.core.conn.rendezvous();
                slot.staged.is_fenced(rendezvous, grant, p.gone.is_some())
            }
            // Its state dropped: its copies were waited for.
            None => true,
        };
        // Where the fence stands, under the peer's lock alone (the paths'
        // parts of the peer are in its slot).
        let fenced = |slot: &PeerSlot| {
            let staged = staged_fenced(slot);
            let copies_fenced = same_process.as_ref().is_none_or(|f| f.is_fenced());
            let release = match may_export {
                true => slot.core.conn.peer_copy().exports().release(grant),
                false => Release::Released,
            };
            match release {
                Release::Released if staged && copies_fenced => Some(Ok(())),
                Release::GivenUp => Some(Err(EngineError::Timeout(TimedOut { after: timeout }))),
                _ => None,
            }
        };
        // Nothing under way under it: fenced now.
        if let Some(done) = fenced(&lock_slot(&peer.lock)) {
            return done;
        }
        peer.engine.progress_until_slot(timeout, &peer.lock, fenced)
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        let grant = self.descriptor.grant;
        self.revoke_on_paths(grant);
        let notice = Control::GrantRevoke { grant };
        // Best effort: a peer that is gone needs no notice; its NIC access
        // ends with the MRs either way.
        if let Err(e) = self.peer.send_control(&notice) {
            tracing::debug!(error = %e, "revocation notice not sent");
        }
    }
}

impl Grant {
    /// The revoke on this side: the announcement forgotten, and the paths
    /// beside the NIC's told: an exported IPC handle, requests of the
    /// staged path (their parts of the peer, under its lock).
    fn revoke_on_paths(&self, grant: u64) {
        let fenced = {
            let mut slot = lock_slot(&self.peer.lock);
            if slot.peer.is_some() {
                slot.core.conn.forget_announced(grant);
            }
            if self.may_export {
                // An exported IPC handle: its memory stays until the
                // importer released it (or the bound passed).
                let config = &self.peer.engine.shared.config;
                let now = config.clock.now();
                let bound = config.peer_copy_release_timeout;
                slot.core
                    .conn
                    .peer_copy_mut()
                    .exports_mut()
                    .revoke(grant, now, bound);
            }
            // Requests under it stop at once; the fence waits for their
            // copies under way.
            let PeerSlot { core, staged, .. } = &mut *slot;
            self.staged
                .then(|| staged.revoke(core.conn.rendezvous_mut(), grant))
        };
        // A staged region's last hold may go here: outside the lock.
        drop(fenced);
        if self.staged || self.may_export {
            // The requests under it fail at the next pass.
            self.peer.engine.shared.due.set();
            self.peer.engine.wake();
        }
    }
}

impl Peer {
    /// Runs `f` on the peer's core and state, under the peer's lock
    /// alone.
    pub(super) fn read_peer<T>(
        &self,
        f: impl FnOnce(&mut Core, &mut PeerState) -> T,
    ) -> Result<T, EngineError> {
        Self::on_peer(&mut lock_slot(&self.lock), f)
    }

    /// [`Peer::read_peer`] for a call that queues work: what it queued
    /// is posted before the peer's lock is released.
    pub(super) fn update_peer<T>(
        &self,
        f: impl FnOnce(&mut Core, &mut PeerState) -> T,
    ) -> Result<T, EngineError> {
        let mut guard = lock_slot(&self.lock);
        let out = Self::on_peer(&mut guard, f)?;
        self.engine.settle_slot(guard);
        Ok(out)
    }

    pub(super) fn on_peer<T>(
        slot: &mut PeerSlot,
        f: impl FnOnce(&mut Core, &mut PeerState) -> T,
    ) -> Result<T, EngineError> {
        let PeerSlot { core, peer, .. } = slot;
        let peer = peer
            .as_mut()
            .ok_or(EngineError::PeerGone(PeerGone::Closed))?;
        Ok(f(core, peer))
    }

    /// The engine this peer belongs to.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The peer engine's id.
    pub fn remote_engine(&self) -> u64 {
        self.read_peer(|core, _| core.conn.peer_engine()).unwrap_or(0)
    }

    /// The connection's session id (chosen by the connecting side, the
    /// same on each of its queue pairs).
    pub fn session(&self) -> u64 {
        self.read_peer(|core, _| core.conn.session()).unwrap_or(0)
    }

    /// The peer's address.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.read_peer(|_, p| p.addr).ok()
    }

    /// Counters of each queue pair (index, NIC name, counters).
    pub fn counters(&self) -> Vec<(u16, String, QpCounters)> {
        let nics = &self.engine.shared.nics;
        self.read_peer(|core, p| {
            p.qps
                .iter()
                .enumerate()
                .map(|(i, q)| (i as u16, nics[q.nic].name.clone(), core.counters(q.core)))
                .collect()
        })
        .unwrap_or_default()
    }

    /// Sends where we run and our queue pairs' NICs, and waits up to
    /// `timeout` for the peer's NIC to have them. The acceptor sends first
    /// (once its application accepted); the connector answers.
    pub(super) fn send_paths(&self, timeout: Duration) -> Result<(), EngineError> {
        let nics = &self.engine.shared.nics;
        let devices = self.read_peer(|_, p| {
            p.qps
                .iter()
                .map(|q| nics[q.nic].name.as_str())
                .collect::<Vec<_>>()
                .join(",")
        })?;
        // Where we run goes first: known to the peer once it has our paths.
        self.send_locality()?;
        let batch = self.send_control(&Control::Paths {
            devices: devices.as_bytes(),
        })?;
        batch.wait(timeout).map_err(|e| EngineError::Handshake {
            peer: self.addr(),
            why: HandshakeFailure::SendingPaths(e),
        })
    }

    /// Waits up to `timeout` for the peer's paths.
    pub(super) fn wait_paths(&self, timeout: Duration) -> Result<(), EngineError> {
        self.progress_until(timeout, |conn| conn.paths_known().then_some(()))
    }

    /// Makes progress until `ready` finds what it waits for in the peer's
    /// state, the peer goes, or `timeout` passes.
    pub(super) fn progress_until<T>(
        &self,
        timeout: Duration,
        mut ready: impl FnMut(&mut PeerConnection) -> Option<T>,
    ) -> Result<T, EngineError> {
        let home = std::cell::Cell::new(CqSet::ALL);
        let mut decide = || {
            let mut guard = lock_slot(&self.lock);
            let PeerSlot { core, peer, .. } = &mut *guard;
            let Some(p) = peer.as_mut() else {
                return Some(Err(EngineError::PeerGone(PeerGone::Closed)));
            };
            if let Some(found) = ready(&mut core.conn) {
                return Some(Ok(found));
            }
            home.set(self.engine.home_of(p));
            p.gone.clone().map(|why| Err(EngineError::PeerGone(why)))
        };
        if let Some(decided) = decide() {
            return decided;
        }
        // A spin on the peer's CQs first, as a batch's wait does (one that
        // may not wait spins not).
        if timeout >= super::reactor::SPIN_TIME {
            let mut decided = None;
            self.engine.spin_home_until(home.get(), || {
                decided = decide();
                decided.is_some()
            });
            if let Some(decided) = decided {
                return decided;
            }
        }
        self.engine.wait_until(timeout, decide)
    }

    /// Grants `len` bytes at `offset` of `region` to this peer with
    /// `rights`: MRs of exactly that range on each NIC the peer's queue
    /// pairs use, announced on the connection. The descriptor names this
    /// engine and the grant; the peer may use it only on this connection.
    pub fn grant(
        &self,
        region: &Region,
        offset: u64,
        len: u64,
        rights: GrantRights,
    ) -> Result<Grant, EngineError> {
        let (descriptor, grants) = self.make_grant(region, offset, len, rights)?;
        let encoded = descriptor.encode()?;
        let announce = Control::GrantAnnounce {
            descriptor: &encoded,
        };
        let mut bytes = vec![0; announce.encoded_len()];
        announce.encode_into(&mut bytes)?;
        // GPU memory only may go by peer copy (the path decides under the
        // peer's lock).
        let may_export = self.engine.shared.config.peer_copy
            && matches!(region.inner.location, MemoryLocation::Gpu { .. });
        let published = match may_export {
            true => self.publish_for_peer_copy(region, offset, &descriptor),
            false => None,
        };
        let served = grants.is_empty().then(|| staging::Served {
            region: region.clone(),
            offset,
            len,
            rights,
        });
        if served.is_some() {
            self.engine.ensure_own_driver();
        }
        let staged = served.is_some();
        // Recorded before it is announced: the peer may use it at once.
        if let Some(served) = served {
            let mut slot = lock_slot(&self.lock);
            if slot.peer.is_none() {
                return Err(EngineError::PeerGone(PeerGone::Closed));
            }
            slot.core.conn.announce(descriptor.grant, bytes);
            slot.staged.grant(descriptor.grant, served);
        } else {
            self.read_peer(|core, _| core.conn.announce(descriptor.grant, bytes))?;
        }
        let grant = Grant {
            descriptor,
            peer: self.clone(),
            _grants: grants,
            _published: published,
            staged,
            may_export,
        };
        // A failed announcement revokes it again (the drop).
        self.send_control(&announce)?;
        Ok(grant)
    }

    /// The MRs and descriptor of a grant of `len` bytes at `offset` of
    /// `region` to this peer (not announced): no MR for a region on the
    /// staging rung (its descriptor says `Staged`).
    pub(super) fn make_grant(
        &self,
        region: &Region,
        offset: u64,
        len: u64,
        rights: GrantRights,
    ) -> Result<(MemoryDescriptor, Vec<MrGrant>), EngineError> {
        region.check(self.engine.shared.id, offset, len)?;
        if rights.allows_write() {
            region.check_writable(ReadOnlyUse::WriteGrant { rights })?;
        }
        let nics = self.read_peer(|_, p| {
            let mut nics: Vec<usize> = p.qps.iter().map(|q| q.nic).collect();
            nics.sort_unstable();
            nics.dedup();
            nics
        })?;
        let shared = &self.engine.shared;
        let staged = nics
            .iter()
            .any(|&nic| region.inner.per_nic[nic].rung() == Rung::Staging);
        let mut grants = Vec::new();
        let reach = if staged {
            Reach::Staged
        } else {
            let mut segments: Vec<Segment> = Vec::new();
            for &nic in &nics {
                region.inner.per_nic[nic].grant(
                    &shared.nics[nic].ladder,
                    offset,
                    len,
                    rights,
                    &mut segments,
                    &mut grants,
                )?;
            }
            segments.sort_by(|a, b| (&a.device, a.offset).cmp(&(&b.device, b.offset)));
            Reach::Direct(segments)
        };
        let descriptor = MemoryDescriptor {
            owner: shared.id,
            grant: shared.next_grant.fetch_add(1, Ordering::Relaxed),
            location: region.inner.location,
            rights,
            len,
            reach,
        };
        Ok((descriptor, grants))
    }

    /// A grant the peer announced on this connection, by id.
    pub fn remote_grant(&self, grant: u64) -> Option<MemoryDescriptor> {
        self.read_peer(|core, _| core.conn.remote_grant(grant).cloned())
            .ok()
            .flatten()
    }

    /// Waits up to `timeout` for the peer to announce grant `grant`.
    pub fn wait_grant(
        &self,
        grant: u64,
        timeout: Duration,
    ) -> Result<MemoryDescriptor, EngineError> {
        self.progress_until(timeout, |conn| conn.remote_grant(grant).cloned())
    }

    /// A WRITE of all of `local` into `remote` at `remote_offset`.
    pub fn write(
        &self,
        local: &Region,
        remote: &MemoryDescriptor,
        remote_offset: u64,
    ) -> Result<Batch, EngineError> {
        self.whole(Op::Write, local, remote, remote_offset)
    }

    /// A READ into all of `local` from `remote` at `remote_offset`.
    pub fn read(
        &self,
        local: &Region,
        remote: &MemoryDescriptor,
        remote_offset: u64,
    ) -> Result<Batch, EngineError> {
        self.whole(Op::Read, local, remote, remote_offset)
    }

    /// One `op` of all of `local`, with the engine's default timeout.
    fn whole(
        &self,
        op: Op,
        local: &Region,
        remote: &MemoryDescriptor,
        remote_offset: u64,
    ) -> Result<Batch, EngineError> {
        self.submit(&[Transfer {
            op,
            local,
            local_offset: 0,
            remote,
            remote_offset,
            len: local.len(),
        }])
    }

    /// Submits a batch with the engine's default timeout.
    pub fn submit(&self, transfers: &[Transfer<'_>]) -> Result<Batch, EngineError> {
        self.submit_with_timeout(transfers, self.engine.shared.config.default_timeout)
    }

    /// Submits a batch that must end within `timeout`: every transfer is
    /// checked (local bounds, the grant live on this connection, its rights
    /// and bounds) before anything is posted, then cut into slices over the
    /// peer's queue pairs.
    pub fn submit_with_timeout(
        &self,
        transfers: &[Transfer<'_>],
        timeout: Duration,
    ) -> Result<Batch, EngineError> {
        if let Some(batch) = self.submit_peer_copy(transfers, timeout)? {
            // A parked engine looks at what it now holds: a path's GPU
            // copies are seen only by polling. (What goes to the NIC needs
            // no wake-up for its end, which comes on the CQ's channel; only
            // its deadline is told, below.)
            self.engine.wake();
            return Ok(batch);
        }
        if transfers.iter().any(staging::staged) {
            let batch = self.submit_staged(transfers, timeout);
            self.engine.wake();
            return batch;
        }
        let _span = tracing::debug_span!("submit", transfers = transfers.len()).entered();
        let cell = Arc::new(CompletionCell::new());
        let now = self.engine.shared.config.clock.now();
        let submit = |core: &mut Core,
                      peer: &mut PeerState|
         -> Result<(BatchId, CqSet), EngineError> {
            if let Some(why) = &peer.gone {
                return Err(EngineError::PeerGone(why.clone()));
            }
            let grants = transfers.iter().map(|t| t.remote.grant);
            cell.watch_revocations(grants, Arc::clone(&peer.revoked));
            // The grant is looked up once per descriptor in a row: the same
            // reference within this call is the same, unchanged descriptor.
            let mut checked: Option<&MemoryDescriptor> = None;
            for t in transfers {
                let known = checked.is_some_and(|d| std::ptr::eq(d, t.remote));
                check_transfer_of(core, peer, t, known)?;
                checked = Some(t.remote);
            }
            let work = self.plan_direct(core, peer, transfers)?;
            let deadline = now.checked_add(timeout).map(|at| (at, timeout));
            let id = core.submit(work, Arc::clone(&cell), deadline, holds(transfers));
            Ok((id, self.engine.home_of(peer)))
        };
        let (id, home) = match self.update_peer(submit)? {
            // A queue pair's failure is told (its batches end) before the
            // engine's pass has carried out what it asks (a drained queue
            // pair re-established): carried out now, then asked again, so
            // a submit that follows a failure waits for the queue pair
            // instead of finding the peer gone.
            Err(EngineError::PeerGone(PeerGone::EveryQueuePairFailed)) => {
                self.engine.carry_out_actions();
                self.update_peer(submit)??
            }
            id => id?,
        };
        self.deadline_added(now, timeout);
        Ok(Batch {
            id: Some((Arc::clone(&self.lock), id)),
            fence: gpu_reads(transfers),
            home,
            ..Batch::of_cell(self.engine.clone(), cell)
        })
    }

    /// A parked leader's park ends at the deadlines it knew when it
    /// parked: a batch's submitted at `now` with `timeout` may come first
    /// (a NIC that never answers must still see it fail at its deadline).
    fn deadline_added(&self, now: Instant, timeout: Duration) {
        if let Some(at) = now.checked_add(timeout) {
            self.engine.shared.reactor.deadline_added(at);
        }
    }

    /// The work of `transfers` (checked already) on the peer's queue
    /// pairs: each cut into slices over the usable ones, each slice's
    /// remote segment and local MR resolved. Nothing is queued: on `Err`
    /// nothing of it started.
    fn plan_direct<'t>(
        &self,
        core: &mut Core,
        peer: &mut PeerState,
        transfers: &'t [Transfer<'t>],
    ) -> Result<Vec<(QpId, batches::Work)>, EngineError> {
        let shared = &self.engine.shared;
        let slice_size = shared.config.slice_size.clamp(1, u64::from(u32::MAX));
        if !peer.qps.iter().any(|q| core.accepts_work(q.core)) {
            return Err(EngineError::PeerGone(PeerGone::EveryQueuePairFailed));
        }
        // Work goes to the queue pairs that are up; only when none is,
        // it waits for those being re-established.
        let usable: fn(&Core, QpId) -> bool = if peer.qps.iter().any(|q| core.is_ready(q.core)) {
            Core::is_ready
        } else {
            Core::accepts_work
        };
        let slices: u64 = transfers.iter().map(|t| t.len.div_ceil(slice_size)).sum();
        let mut work = core.work_buffer();
        work.reserve(slices as usize);
        // The segment each queue pair (by its index modulo the size)
        // last used, and the descriptor it came from: a descriptor's
        // segments of one device do not overlap, so one holding the
        // offset is the one `segment` would find.
        let mut segments: [Option<(usize, &MemoryDescriptor, &Segment)>; 8] = Default::default();
        for t in transfers {
            // GPU memory goes over the NICs nearest its GPU, when a
            // queue pair on one of them is usable.
            let prefer = match t.local.inner.location {
                MemoryLocation::Gpu { ordinal } => {
                    shared.nearest_nics.get(&u32::from(ordinal)).filter(|near| {
                        peer.qps
                            .iter()
                            .any(|q| near.contains(&q.nic) && usable(core, q.core))
                    })
                }
                MemoryLocation::Host => None,
            };
            let mut done = 0;
            while done < t.len {
                // The next usable queue pair in turn (one exists).
                let (qi, qp) = loop {
                    // (No division on the way: `next_qp` stays below
                    // the count once wrapped.)
                    let count = peer.qps.len();
                    let qi = match peer.next_qp {
                        n if n < count => n,
                        n => n % count,
                    };
                    peer.next_qp = qi + 1;
                    let qp = &peer.qps[qi];
                    if usable(core, qp.core) && prefer.is_none_or(|near| near.contains(&qp.nic)) {
                        break (qi, qp);
                    }
                };
                let remote_offset = t.remote_offset + done;
                let cached = &mut segments[qi % 8];
                let segment = match *cached {
                    Some((q, d, s))
                        if q == qi
                            && std::ptr::eq(d, t.remote)
                            && s.offset <= remote_offset
                            && remote_offset < s.offset + s.len =>
                    {
                        s
                    }
                    _ => {
                        let remote_device = core.conn.remote_device(qi).unwrap_or("");
                        let s = t.remote.segment(remote_device, remote_offset, 1)?;
                        *cached = Some((qi, t.remote, s));
                        s
                    }
                };
                let in_segment = segment.offset + segment.len - remote_offset;
                // Cut at the local piece's end too (CUDA VMM chunks).
                let (local, in_piece) =
                    t.local.inner.per_nic[qp.nic].at(t.local_offset + done, t.local.inner.len);
                let len = (t.len - done).min(slice_size).min(in_segment).min(in_piece);
                let mr = local
                    .mr()
                    .ok_or(EngineError::Refused(Refusal::StagingRungOnDirectPath))?;
                let op = t.op.send_op(
                    segment.addr + (remote_offset - segment.offset),
                    segment.rkey,
                );
                let mut flags = SendFlags::empty();
                if t.op == Op::Write && local.cpu_readable() && len <= u64::from(qp.max_inline) {
                    flags |= SendFlags::INLINE;
                }
                work.push((
                    qp.core,
                    single_work(
                        op,
                        t.local.inner.addr + t.local_offset + done,
                        len as u32,
                        mr.lkey(),
                        flags,
                    ),
                ));
                done += len;
            }
        }
        Ok(work)
    }

    /// Sends a control message to the peer; the returned batch completes
    /// when the peer's NIC has it. Its payload is at most the peer's
    /// [`EngineConfig::max_message`] less the control header
    /// ([`wire::HEADER_LEN`], 8 bytes): 4,088 bytes at the default 4 KiB.
    /// A longer one is refused here with [`EngineError::MessageTooLarge`]
    /// (which names the whole message's length and the peer's bound).
    pub fn send(&self, message: &[u8]) -> Result<Batch, EngineError> {
        self.send_control(&Control::User(message))
    }

    /// Queues a control message: it goes out as soon as a send slot and
    /// one of the peer's receives are free (never blocking the caller: the
    /// peer may be this very thread); the batch ends when the peer's NIC
    /// has it, or at the engine's default timeout.
    pub(super) fn send_control(&self, message: &Control<'_>) -> Result<Batch, EngineError> {
        let config = &self.engine.shared.config;
        let cell = self.update_peer(|core, peer| {
            let now = config.clock.now();
            let cell = peer.enqueue(core, message, now, config.default_timeout)?;
            peer.flush_outbox(core, now);
            Ok::<_, EngineError>(cell)
        })??;
        self.engine.wake();
        Ok(Batch::of_cell(self.engine.clone(), cell))
    }

    /// The next control message from the peer, waiting up to `timeout`.
    pub fn recv(&self, timeout: Duration) -> Result<Vec<u8>, EngineError> {
        self.progress_until(timeout, |conn| conn.receive())
    }

    /// Says goodbye and disconnects every queue pair: what is in flight
    /// flushes and fails. The peer's staged requests served here stop
    /// first (no copy starts, the running ones end before the goodbye
    /// goes), so nothing moves into or out of this side's memory for the
    /// peer once it has heard goodbye.
    pub fn close(&self) -> Result<(), EngineError> {
        {
            let mut slot = lock_slot(&self.lock);
            if slot.peer.is_none() {
                return Err(EngineError::PeerGone(PeerGone::Closed));
            }
            // The peer's requests served here stop (no copy starts).
            slot.core.conn.rendezvous_mut().owner.close();
        }
        self.engine.shared.due.set();
        // Bounded: a copy that never ends is the GPU's failure, and the
        // goodbye goes anyway.
        let _ = self.engine.progress_until_slot(Duration::from_secs(1), &self.lock, |slot| {
            if !slot.staged.copying(slot.core.conn.rendezvous()) {
                return Some(Ok(()));
            }
            let gone = slot.peer.as_ref().and_then(|p| p.gone.clone());
            gone.map(|why| Err(EngineError::PeerGone(why)))
        });
        if let Ok(batch) = self.send_control(&Control::Goodbye) {
            let _ = batch.wait(Duration::from_secs(1));
        }
        self.update_peer(|core, peer| {
            peer.gone.get_or_insert(PeerGone::Closed);
            for qp in &peer.qps {
                let _ = qp.conn.disconnect();
                core.fail_qp(qp.core, TransferError::PeerGone(PeerGone::Closed));
            }
        })
    }

    /// Submits a batch that starts only once `stream` has reached this
    /// point: work queued on `stream` before this call (a kernel, a copy)
    /// is done, and its memory visible, before anything of the batch is
    /// posted; no CPU thread waits for the stream (see `gate`).
    ///
    /// Every transfer is checked now, as by [`Peer::submit_with_timeout`],
    /// and a refusal returns at once. `timeout` counts from this call and
    /// covers the wait for the stream: a gate that never opens ends the
    /// batch with [`TransferError::Timeout`]. A stream that fails first
    /// ends it with [`TransferError::StreamFailed`]. [`Batch::cancel`]
    /// before the gate opens ends it at once, with nothing posted.
    pub fn submit_after_stream(
        &self,
        stream: &crate::Stream,
        transfers: &[Transfer<'_>],
        timeout: Option<Duration>,
    ) -> Result<Batch, EngineError> {
        let timeout = timeout.unwrap_or(self.engine.shared.config.default_timeout);
        let stream = stream.erased();
        let span = tracing::debug_span!(
            "gate",
            transfers = transfers.len(),
            word = tracing::field::Empty
        );
        let _entered = span.enter();
        let engine = &self.engine;
        self.read_peer(|core, peer| -> Result<(), EngineError> {
            if let Some(why) = &peer.gone {
                return Err(EngineError::PeerGone(why.clone()));
            }
            transfers.iter().try_for_each(|t| check_transfer(core, peer, t))
        })??;
        let now = engine.shared.config.clock.now();
        let res = &engine.shared.res;
        engine.ensure_fence_page()?;
        // The word under the lock; its write (a stream memory operation,
        // which blocks while the driver's queue is full) and the event
        // after it outside: a record blocks while a free of the process
        // waits for a held stream, which this engine's progress may be the
        // one to release.
        let taken = lock_streams(&engine.shared)
            .stream_fences
            .take_word(res)?;
        let signal = match StreamFences::queue_gate_write(stream, &taken) {
            Ok(true) => taken.signal(),
            // Not queued: the word goes back; without stream memory
            // operations the gate's event alone tells.
            unqueued => {
                lock_streams(&engine.shared).stream_fences.unused(taken);
                unqueued?;
                Signal::Event
            }
        };
        let event = match record_gate_event(res, stream) {
            Ok(event) => event,
            Err(e) => {
                lock_streams(&engine.shared)
                    .stream_fences
                    .abandon_gate(signal);
                return Err(e);
            }
        };
        let link = lock_streams(&engine.shared).gates.wait(
            self.slot, transfers, timeout, now, signal, event, &span,
        );
        engine.ensure_own_driver();
        engine.wake();
        Ok(Batch {
            gate: Some(Arc::clone(&link)),
            ..Batch::of_cell(engine.clone(), Arc::clone(link.cell()))
        })
    }

    /// Submits a batch some of whose transfers involve a staging-rung
    /// region (ours, or the peer's grant): the staged path takes those;
    /// the direct rest as usual.
    pub(super) fn submit_staged(
        &self,
        transfers: &[Transfer<'_>],
        timeout: Duration,
    ) -> Result<Batch, EngineError> {
        let engine = &self.engine;
        let shared = &engine.shared;
        let (carried, direct): (Vec<Transfer<'_>>, Vec<Transfer<'_>>) =
            transfers.iter().partition(|t| staging::staged(t));
        // The pools the staged slices go through, made here (outside the
        // lock, off progress) where missing.
        let mut gpus = Vec::new();
        for t in &carried {
            if let Ok(Some(gpu)) = rendezvous::staged_gpu(t)
                && !gpus.contains(&gpu)
            {
                gpus.push(gpu);
            }
        }
        engine.ensure_staging_pools(&gpus)?;
        let cell = Arc::new(CompletionCell::new());
        let now = shared.config.clock.now();
        // Under one hold of the peer's lock (the staged path's part of the
        // peer is in its slot), every transfer is checked and the direct
        // part's work resolved on the queue pairs before the staged part
        // is posted, on the wire to the peer alone: on `Err` nothing of
        // the batch started (the path seam's promise). The direct part
        // takes the NIC. The engine's lock is not taken.
        let submit = |slot: &mut PeerSlot| {
            let planned = Self::on_peer(slot, |core, peer| {
                if let Some(why) = &peer.gone {
                    return Err(EngineError::PeerGone(why.clone()));
                }
                transfers.iter().try_for_each(|t| check_transfer(core, peer, t))?;
                match direct.is_empty() {
                    true => Ok(None),
                    false => self.plan_direct(core, peer, &direct).map(Some),
                }
            })??;
            let posted = on_slot(&shared.res, self.slot, now, slot, |cx, peer| {
                shared
                    .staged()
                    .post(cx, self.slot, peer, &carried, timeout)
            })?;
            let id = planned.map(|work| {
                let deadline = now.checked_add(timeout).map(|at| (at, timeout));
                slot.core
                    .submit(work, Arc::clone(&cell), deadline, holds(&direct))
            });
            Ok::<_, EngineError>((posted, id))
        };
        let mut guard = lock_slot(&self.lock);
        let submitted = match submit(&mut guard) {
            // As a plain submit does: what a queue pair's failure asked is
            // carried out, then the batch is asked again.
            Err(EngineError::PeerGone(PeerGone::EveryQueuePairFailed)) => {
                drop(guard);
                engine.carry_out_actions();
                guard = lock_slot(&self.lock);
                submit(&mut guard)
            }
            submitted => submitted,
        };
        engine.settle_slot(guard);
        let (posted, id) = submitted?;
        // The staged part moves with the engine's pass (its copies are
        // polled there): due now.
        shared.due.set();
        let mut fence = gpu_reads(&direct);
        fence.extend(staging::read_fence(&carried));
        fence.sort_unstable();
        fence.dedup();
        let batch = match id {
            Some(id) => {
                self.deadline_added(now, timeout);
                Batch {
                    id: Some((Arc::clone(&self.lock), id)),
                    ..Batch::of_cell(engine.clone(), cell)
                }
            }
            None => {
                cell.complete(Ok(()));
                Batch::of_cell(engine.clone(), cell)
            }
        };
        Ok(Batch {
            fence,
            parts: vec![posted],
            path_peer: Some(Arc::clone(&self.lock)),
            ..batch
        })
    }

    /// Sends any control message, as a peer of the engine's could: for
    /// tests of the engine's defences against a hostile peer (a forged
    /// slot credit, an unknown request). Feature `testing`; not for
    /// applications.
    #[cfg(feature = "testing")]
    pub fn send_raw_control(&self, message: &Control<'_>) -> Result<Batch, EngineError> {
        self.send_control(message)
    }

    /// Sends `bytes` as a control message, unchecked (they need not
    /// decode): for tests of the engine's defences against a peer that
    /// breaks the wire format. Feature `testing`; not for applications.
    #[cfg(feature = "testing")]
    pub fn send_raw_bytes(&self, bytes: &[u8]) -> Result<Batch, EngineError> {
        let config = &self.engine.shared.config;
        let cell = self.update_peer(|core, peer| {
            let now = config.clock.now();
            let cell = peer.enqueue_bytes(core, bytes.to_vec(), now, config.default_timeout)?;
            peer.flush_outbox(core, now);
            Ok::<_, EngineError>(cell)
        })??;
        self.engine.wake();
        Ok(Batch::of_cell(self.engine.clone(), cell))
    }

    // The peer-copy path's calls ([`peer_copy`]).

    /// How this peer's transfers of GPU memory travel.
    pub fn route(&self) -> PeerCopyRoute {
        let slot = lock_slot(&self.lock);
        let up = slot.peer.as_ref().is_some_and(|p| p.gone.is_none());
        match up && self.engine.shared.config.peer_copy {
            true => self.engine.shared.copies().route(&slot.copy),
            false => PeerCopyRoute::Nic,
        }
    }

    /// Tells the peer where this engine runs (before the paths, so that it
    /// knows once the connection is up), if the path is allowed here.
    pub(super) fn send_locality(&self) -> Result<(), EngineError> {
        if !self.engine.shared.config.peer_copy {
            return Ok(());
        }
        if let Some(message) = self.engine.shared.peer_copy.locality() {
            self.send_control(&message)?;
        }
        Ok(())
    }

    /// Makes a new grant of GPU memory reachable by peer copy (see
    /// [`peer_copy::PeerCopyPath::publish`]), under the peer's lock alone;
    /// what it sends is posted before the lock is released.
    pub(super) fn publish_for_peer_copy(
        &self,
        region: &Region,
        offset: u64,
        descriptor: &MemoryDescriptor,
    ) -> Option<peer_copy::Publication> {
        let shared = &self.engine.shared;
        let res = &shared.res;
        let mut guard = lock_slot(&self.lock);
        let mut copies = shared.copies();
        let published = on_slot_copy(res, self.slot, res.config.clock.now(), &mut guard, |cx, peer| {
            copies.publish(cx, self.slot, peer, region, offset, descriptor)
        });
        // What a failed post asked of a queue pair is the pass's, and a
        // message held for a send slot gets a thread to send it.
        self.engine.settle_slot(guard);
        published
    }

    /// Submits `transfers` by peer copy if the path carries them all
    /// (`Ok(None)`: another path takes the batch); checks each as the NIC
    /// path does first.
    pub(super) fn submit_peer_copy(
        &self,
        transfers: &[Transfer<'_>],
        timeout: Duration,
    ) -> Result<Option<Batch>, EngineError> {
        let engine = &self.engine;
        let res = &engine.shared.res;
        // The path carries a batch only if it carries every transfer, and
        // only GPU memory to GPU memory: any other batch goes without the
        // engine's lock.
        let gpu_to_gpu = |t: &Transfer<'_>| {
            matches!(t.local.inner.location, MemoryLocation::Gpu { .. })
                && matches!(t.remote.location, MemoryLocation::Gpu { .. })
        };
        if !res.config.peer_copy || transfers.is_empty() || !transfers.iter().all(gpu_to_gpu) {
            return Ok(None);
        }
        // The driver calls the batch needs first (a peer's IPC handle
        // opened, peer access between two GPUs) are made outside every
        // lock: each can take long. The mappings are held here until the
        // batch holds them. The engine's lock is not taken: the path's
        // part of the peer is in its slot.
        let shared = &engine.shared;
        let mut copies = shared.copies();
        let mut guard = lock_slot(&self.lock);
        let mut steps = copies.driver_steps_wanted(&guard.copy, transfers);
        if !steps.is_empty() {
            drop(guard);
            for step in &mut steps {
                step.run(res);
            }
            guard = lock_slot(&self.lock);
            copies.driver_steps_done(&mut guard.copy, &steps);
        }
        let now = res.config.clock.now();
        {
            let slot = &mut *guard;
            let peer = slot
                .peer
                .as_ref()
                .ok_or(EngineError::PeerGone(PeerGone::Closed))?;
            if copies.route(&slot.copy) == PeerCopyRoute::Nic {
                return Ok(None);
            }
            if let Some(why) = &peer.gone {
                return Err(EngineError::PeerGone(why.clone()));
            }
            for t in transfers {
                check_transfer(&slot.core, peer, t)?;
            }
            let carried = on_slot_copy(res, self.slot, now, slot, |cx, part| {
                copies.carries(cx.res, self.slot, part, transfers)
            });
            if !carried {
                return Ok(None);
            }
        }
        let cell = on_slot_copy(res, self.slot, now, &mut guard, |cx, peer| {
            copies.post(cx, self.slot, peer, transfers, timeout)
        })?;
        drop(guard);
        // Its copies are polled by the pass: due now, and a parked driver
        // woken to make it (no fd tells of a GPU copy's end).
        shared.due.set();
        engine.wake();
        // A mapping nothing else took closes here, outside the lock.
        drop(steps);
        engine.ensure_own_driver();
        Ok(Some(Batch {
            path_peer: Some(Arc::clone(&self.lock)),
            ..Batch::of_cell(engine.clone(), cell)
        }))
    }
}

/// The regions `transfers` move, one hold per distinct region in a row (a
/// batch usually moves one region).
fn holds<'a>(transfers: &'a [Transfer<'a>]) -> impl Iterator<Item = Keep> + 'a {
    transfers
        .iter()
        .enumerate()
        .filter(|&(i, t)| i == 0 || !Arc::ptr_eq(&transfers[i - 1].local.inner, &t.local.inner))
        .map(|(_, t)| Arc::clone(&t.local.inner) as Keep)
}

/// The GPUs `transfers` READ into over the NIC: fenced once the batch
/// succeeded.
fn gpu_reads(transfers: &[Transfer<'_>]) -> Vec<u32> {
    let mut fence: Vec<u32> = transfers
        .iter()
        .filter(|t| t.op == Op::Read)
        .filter_map(|t| match t.local.inner.location {
            MemoryLocation::Gpu { ordinal } => Some(u32::from(ordinal)),
            MemoryLocation::Host => None,
        })
        .collect();
    fence.sort_unstable();
    fence.dedup();
    fence
}
