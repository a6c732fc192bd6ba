//! The listening side: [`Listener`], the listener's thread (connect
//! requests taken as they arrive, into the bounded backlog of
//! [`super::setup`]; a peer re-establishing a queue pair served at once)
//! and `accept`'s set-up of a session.

use super::VerbsCall;
use super::*;

/// A listening engine: accepts peers. A thread of the engine takes the
/// connect requests as they arrive: a new peer's queue pairs are connected
/// and wait for [`Listener::accept`], in a bounded backlog
/// ([`EngineConfig::accept_backlog`] peers; one more is refused busy), each
/// at most [`EngineConfig::accept_timeout`] (then disconnected); a peer
/// re-establishing a queue pair of a session accepted here is served at
/// once. Dropping this handle disconnects the peers still waiting and
/// refuses new ones (busy); re-establishment is served until the engine
/// goes (the address stays bound until then).
pub struct Listener {
    pub(super) engine: Engine,
    pub(super) inner: Arc<ListenerInner>,
}

/// A queue pair of a peer not yet accepted: (its hello, the connection,
/// the NIC).
type PendingQp = (Hello, resources::SeatedConnection, usize);

/// How often the listener looks for connectors that gave up (and for
/// deadlines) while connections wait to be accepted and nothing else
/// wakes it.
pub(super) const LISTENER_POLL: Duration = Duration::from_millis(50);

/// How long the listener's thread waits for a connect request while no
/// connection waits to be accepted: it looks only whether its engine is
/// gone (so an idle engine's listener wakes once a second, not twenty
/// times).
pub(super) const LISTENER_IDLE: Duration = Duration::from_secs(1);

pub(super) struct ListenerInner {
    pub(super) listener: hal_verbs::dynamic::DynListener,
    pub(super) waiting: std::sync::Mutex<Waiting>,
    /// Signalled when a session completes.
    pub(super) arrived: std::sync::Condvar,
}

/// A listener's serving thread, as its engine keeps it.
pub(super) struct ListenerThread {
    listener: std::sync::Weak<ListenerInner>,
    thread: std::thread::JoinHandle<()>,
}

impl ListenerThread {
    /// Wakes the thread (its engine closed: its next step ends it) and
    /// waits for it to end, which drops the listener.
    pub(super) fn stop(self) {
        if let Some(inner) = self.listener.upgrade() {
            inner.listener.wake();
        }
        if self.thread.join().is_err() {
            tracing::warn!("a listener's thread panicked");
        }
    }
}

impl ListenerInner {
    pub(super) fn waiting(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// New peers' queue pairs waiting for accept: the backlog decides what
/// may wait and what must go; the connections wait here, by token.
pub(super) struct Waiting {
    pub(super) backlog: Backlog,
    pub(super) conns: HashMap<Token, PendingQp>,
    pub(super) next_token: u64,
}

impl Waiting {
    pub(super) fn token(&mut self) -> Token {
        self.next_token += 1;
        Token(self.next_token)
    }

    /// Disconnects and forgets the queue pairs the backlog dropped.
    pub(super) fn disconnect_dropped(&mut self) {
        while let Some(dropped) = self.backlog.poll_dropped() {
            let Some((hello, conn, _)) = self.conns.remove(&dropped.token) else {
                continue;
            };
            tracing::info!(
                peer = %conn.peer_addr(),
                session = format_args!("{:#x}", dropped.session),
                qp = hello.qp_index,
                reason = %dropped.reason,
                "a queue pair waiting for accept is disconnected"
            );
            if let Err(e) = conn.disconnect() {
                tracing::debug!(error = %e, "disconnecting a queue pair");
            }
        }
    }

    /// Drops the sessions whose connector gave up (a queue pair of theirs
    /// is disconnected) and those past their deadline at `now`.
    pub(super) fn reap(&mut self, now: Instant) {
        let gone: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, (_, conn, _))| match conn.poll_state(Duration::ZERO) {
                Ok(state) => state != ConnectionState::Connected,
                Err(e) => {
                    tracing::debug!(error = %e, "polling a waiting connection's events");
                    false
                }
            })
            .map(|(&token, _)| token)
            .collect();
        for token in gone {
            let Some((hello, conn, _)) = self.conns.remove(&token) else {
                continue;
            };
            if self.backlog.on_disconnected(token).is_some() {
                tracing::info!(
                    peer = %conn.peer_addr(),
                    session = format_args!("{:#x}", hello.session),
                    "a connector gave up before accept: its session is dropped"
                );
            }
        }
        self.backlog.handle_timeout(now);
        self.disconnect_dropped();
    }
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener")
            .field("addr", &self.inner.listener.local_addr())
            .finish_non_exhaustive()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let mut waiting = self.inner.waiting();
        waiting.backlog.close();
        waiting.disconnect_dropped();
        drop(waiting);
        tracing::debug!(addr = %self.local_addr(), "listener closed: new peers are refused");
    }
}

impl Engine {
    /// Listens for peers on `addr` (port 0: one is assigned).
    pub fn listen(&self, addr: SocketAddr) -> Result<Listener, EngineError> {
        let listener = self
            .shared
            .cm
            .listen(addr, 64)
            .map_err(|e| EngineError::verbs(VerbsCall::Listen { addr }, e))?;
        let config = &self.shared.config;
        let backlog = Backlog::new(BacklogConfig {
            max_sessions: config.accept_backlog,
            deadline: config.accept_timeout,
            ..BacklogConfig::default()
        });
        tracing::debug!(%addr, bounds = ?backlog.config(), "listening");
        let inner = Arc::new(ListenerInner {
            listener,
            waiting: std::sync::Mutex::new(Waiting {
                backlog,
                conns: HashMap::new(),
                next_token: 0,
            }),
            arrived: std::sync::Condvar::new(),
        });
        let weak = Arc::downgrade(&self.shared);
        let holds = Arc::clone(&self.shared.holds);
        let served = Arc::clone(&inner);
        let thread = std::thread::Builder::new()
            .name("gdr-listener".into())
            .spawn(move || Self::serve_listener(weak, holds, served))
            .map_err(|source| {
                EngineError::Unavailable(Unavailable::Os {
                    what: "no listener thread",
                    source,
                })
            })?;
        // A listener's thread ends only when its engine closes: kept until then.
        super::lock(&self.shared.listener_threads).push(ListenerThread {
            listener: Arc::downgrade(&inner),
            thread,
        });
        Ok(Listener {
            engine: self.clone(),
            inner,
        })
    }

    /// The listener's thread: takes connect requests, and drops the peers
    /// that gave up or waited too long, until the engine is dropped.
    pub(super) fn serve_listener(
        weak: std::sync::Weak<Shared>,
        holds: Arc<InternalHolds>,
        inner: Arc<ListenerInner>,
    ) {
        INTERNAL_THREAD.with(|i| i.set(true));
        // A look polls every waiting connection: one a poll interval (or
        // at the next deadline), not one per connect request of a burst.
        let mut look_at = Instant::now();
        loop {
            let now = Instant::now();
            if now >= look_at {
                // Held only between waits: the engine's drop ends the thread.
                let Some(wait) = holds.step(&weak, |engine| engine.reap_waiting(&inner)) else {
                    return;
                };
                look_at = now + wait;
            }
            let wait = look_at
                .saturating_duration_since(now)
                .max(Duration::from_millis(1));
            let request = match inner.listener.next_request(wait) {
                Ok(r) => r,
                Err(hal_verbs::VerbsError::Timeout { .. }) => continue,
                Err(e) => {
                    tracing::debug!(error = %e, "waiting for a connect request");
                    std::thread::sleep(wait);
                    continue;
                }
            };
            if holds
                .step(&weak, |engine| engine.on_connect_request(&inner, request))
                .is_none()
            {
                return;
            }
        }
    }

    /// Drops what waits for accept in vain; says how long the listener may
    /// wait before it looks again.
    pub(super) fn reap_waiting(&self, inner: &ListenerInner) -> Duration {
        let now = self.shared.config.clock.now();
        let mut waiting = inner.waiting();
        waiting.reap(now);
        waiting.backlog.poll_timeout().map_or(LISTENER_IDLE, |at| {
            at.saturating_duration_since(now)
                .clamp(Duration::from_millis(1), LISTENER_POLL)
        })
    }

    /// One connect request: a new peer's queue pair (to wait for `accept`,
    /// if the backlog takes it), or a queue pair of a peer already
    /// accepted being re-established.
    pub(super) fn on_connect_request(
        &self,
        inner: &ListenerInner,
        request: hal_verbs::dynamic::DynConnectRequest,
    ) {
        let from = request.peer_addr();
        let hello = match Hello::decode(&request.private_data()) {
            Ok(h) if h.role == Role::Connect => h,
            Ok(_) => {
                let _ = request.reject(&RejectReason::Malformed.encode());
                return;
            }
            Err(e) => {
                tracing::warn!(peer = %from, error = %e, "bad hello: rejected");
                let _ = request.reject(&RejectReason::for_hello_error(&e).encode());
                return;
            }
        };
        let Ok(nic) = self.nic_index(&request.device()) else {
            let _ = request.reject(&RejectReason::Busy.encode());
            return;
        };
        // A session of ours: the peer re-establishes one of its queue pairs.
        let known = {
            let state = look_at_state(&self.shared);
            state.slots.iter().position(|lock| {
                let slot = lock_slot(lock);
                slot.peer.is_some()
                    && !slot.core.conn.recovery().is_connector()
                    && slot.core.conn.session() == hello.session
            })
        };
        /// Where the queue pair goes once connected.
        enum Destination {
            /// Re-established for the peer in this slot.
            Reconnect(usize),
            /// A new peer's: it waits for accept.
            Backlog(Arrival),
        }
        let destination = match known {
            Some(slot) => Destination::Reconnect(slot),
            None if self.peer_room().is_err() => {
                // As many peers as the CQs carry: the connector is told
                // busy before any queue pair of its is made here.
                tracing::info!(peer = %from, "connect refused: the engine carries max_peers peers");
                let _ = request.reject(&RejectReason::Busy.encode());
                return;
            }
            None => {
                let mut waiting = inner.waiting();
                let arrival = Arrival::of_hello(&hello, waiting.token());
                if let Err(e) = waiting.backlog.check(&arrival) {
                    drop(waiting);
                    tracing::info!(
                        peer = %from,
                        session = format_args!("{:#x}", hello.session),
                        qp = hello.qp_index,
                        error = %e,
                        "connect request refused"
                    );
                    let _ = request.reject(&e.reject_reason().encode());
                    return;
                }
                Destination::Backlog(arrival)
            }
        };
        let reply = self.hello(Role::Accept, hello.session, hello.qp_index, hello.qp_count);
        let params = self.connect_params(self.shared.config.reconnect_timeout);
        // Where another of the peer's queue pairs sits, this one goes too.
        let prefer = match &destination {
            Destination::Reconnect(slot) => {
                let state = look_at_state(&self.shared);
                let guard = state.slot(*slot);
                guard.peer.as_ref().and_then(|p| {
                    let index = usize::from(hello.qp_index);
                    let others = p.qps.iter().enumerate().filter(|(i, q)| *i != index && q.nic == nic);
                    others.map(|(_, q)| q.conn.cq()).next()
                })
            }
            Destination::Backlog(_) => inner
                .waiting()
                .conns
                .values()
                .find(|(h, _, n)| h.session == hello.session && *n == nic)
                .map(|(_, c, _)| c.cq()),
        };
        let n = &self.shared.nics[nic];
        let seat = match self.cq_seat(nic, prefer) {
            Ok(seat) => seat,
            Err(e) => {
                tracing::info!(peer = %from, error = %e, "connect request refused: every CQ full");
                let _ = request.reject(&RejectReason::Busy.encode());
                return;
            }
        };
        let cq = &n.cqs.queues()[seat.cq()];
        let conn = match request.accept(n.ladder.pd(), cq, cq, &params, &reply.encode()) {
            Ok(conn) => resources::SeatedConnection::new(conn, seat),
            Err(e) => {
                tracing::warn!(error = %e, "accepting a queue pair");
                return;
            }
        };
        let arrival = match destination {
            Destination::Reconnect(slot) => {
                return self.on_reconnected(slot, usize::from(hello.qp_index), conn);
            }
            Destination::Backlog(arrival) => arrival,
        };
        let now = self.shared.config.clock.now();
        let mut waiting = inner.waiting();
        match waiting.backlog.admit(now, arrival) {
            Ok(admitted) => {
                tracing::debug!(
                    peer = %from,
                    session = format_args!("{:#x}", hello.session),
                    qp = hello.qp_index,
                    ?admitted,
                    "a queue pair waits for accept"
                );
                waiting.conns.insert(arrival.token, (hello, conn, nic));
                if admitted == Admitted::Complete {
                    inner.arrived.notify_all();
                }
            }
            Err(e) => {
                drop(waiting);
                tracing::info!(peer = %from, error = %e, "a connected queue pair refused");
                if let Err(e) = conn.disconnect() {
                    tracing::debug!(error = %e, "disconnecting a queue pair");
                }
            }
        }
    }

    /// The peer in `slot` made a new connection for its queue pair
    /// `index`: installed now if the old one is down, else once it has
    /// drained (it is stopped: the peer has given it up).
    pub(super) fn on_reconnected(
        &self,
        slot: usize,
        index: usize,
        conn: resources::SeatedConnection,
    ) {
        let mut guard = lock_state(&self.shared);
        let state = &mut *guard;
        let lock = Arc::clone(&state.slots[slot]);
        let mut slot_guard = lock_slot(&lock);
        let PeerSlot { core, peer, .. } = &mut *slot_guard;
        let Some(peer) = peer.as_mut() else {
            return;
        };
        let Some(q) = peer.qps.get_mut(index) else {
            tracing::warn!(
                qp = index,
                "a peer re-established a queue pair it never had"
            );
            return;
        };
        if peer.gone.is_some() {
            return;
        }
        let qp = q.core;
        let old = if core.is_ready(qp) {
            OldQp::Ready
        } else if core.accepts_work(qp) {
            OldQp::Reconnecting
        } else if core.is_down(qp) {
            OldQp::Down
        } else {
            OldQp::Failing
        };
        match core.conn.recovery_mut().on_replacement(index, old) {
            Replacement::Install => {
                drop(slot_guard);
                self.install(state, slot, index, conn);
            }
            Replacement::Refuse => {
                tracing::debug!(qp = index, "a new connection for a queue pair given up");
                drop(conn);
                drop(slot_guard);
            }
            step @ (Replacement::Wait | Replacement::FailOldThenWait) => {
                q.replacement = Some(conn);
                if step == Replacement::FailOldThenWait {
                    let _ = q.conn.disconnect();
                    core.fail_qp(qp, TransferError::PeerGone(PeerGone::QueuePairReplaced));
                }
                // The old queue pair must drain before the new one is
                // installed (and, for queue pair 0, gets its receives):
                // that takes this engine's progress, which nobody here may
                // be making (a server that only serves grants): its own
                // thread does it.
                drop(slot_guard);
                self.post_ready(state);
                drop(guard);
                self.ensure_own_driver();
                return;
            }
        }
        self.post_ready(state);
    }
}

impl Listener {
    /// The address listened on.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.listener.local_addr()
    }

    /// Peers waiting for accept (each a session whose queue pairs are
    /// connected as they arrive; complete or not).
    pub fn waiting(&self) -> usize {
        self.inner.waiting().backlog.len()
    }

    /// Waits up to `timeout` for a peer and sets it up: the first whose
    /// queue pairs have all arrived (each connect request's hello checked;
    /// a malformed or other-version one is rejected with the reason) is
    /// taken; this side sends its paths first, the connector's sign that
    /// it was accepted, and returns once the connector's came back. A peer
    /// whose connector gave up meanwhile (its queue pairs disconnected, or
    /// the exchange failed) is dropped, never returned: accept keeps
    /// waiting for another until `timeout`. Threads may accept at once:
    /// each session goes to one of them.
    pub fn accept(&self, timeout: Duration) -> Result<Peer, EngineError> {
        let deadline = Instant::now() + timeout;
        loop {
            let Some((session, conns)) = self.next_session(deadline) else {
                return Err(EngineError::Timeout(TimedOut { after: timeout }));
            };
            match self.engine.set_up_accepted(session, conns, deadline) {
                Ok(peer) => return Ok(peer),
                Err(AcceptFailure::Local(e)) => return Err(e),
                Err(AcceptFailure::ConnectorGone(e)) => tracing::info!(
                    session = format_args!("{session:#x}"),
                    error = %e,
                    "a connector gave up during accept: dropped; waiting for another"
                ),
            }
        }
    }

    /// Waits until `deadline` for a complete session whose queue pairs are
    /// still connected, and takes it (its connections in index order).
    pub(super) fn next_session(&self, deadline: Instant) -> Option<(u64, Vec<PendingQp>)> {
        let clock = &self.engine.shared.config.clock;
        let mut waiting = self.inner.waiting();
        loop {
            // Connectors that gave up are dropped before one is taken.
            waiting.reap(clock.now());
            if let Some(session) = waiting.backlog.take_complete() {
                let conns: Vec<PendingQp> = session
                    .tokens
                    .iter()
                    .filter_map(|token| waiting.conns.remove(token))
                    .collect();
                debug_assert_eq!(conns.len(), session.tokens.len());
                return Some((session.id, conns));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            waiting = self
                .inner
                .arrived
                .wait_timeout(waiting, left.min(LISTENER_POLL))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

/// Why a session `accept` took was not set up.
pub(super) enum AcceptFailure {
    /// This side failed (its buffers could not be registered).
    Local(EngineError),
    /// The connector is gone (or never answered in time): the session was
    /// torn down.
    ConnectorGone(EngineError),
}

impl Engine {
    /// Sets up `session`, which accept took with its connections `conns`:
    /// the peer's state, our paths first, the connector's awaited until
    /// `deadline`. An exchange that fails means the connector is gone: the
    /// peer is torn down.
    pub(super) fn set_up_accepted(
        &self,
        session: u64,
        conns: Vec<PendingQp>,
        deadline: Instant,
    ) -> Result<Peer, AcceptFailure> {
        let Some((hello, first, _)) = conns.first() else {
            return Err(AcceptFailure::Local(EngineError::Refused(
                Refusal::NoQueuePairs,
            )));
        };
        let (hello, addr) = (hello.clone(), first.peer_addr());
        let conns = conns
            .into_iter()
            .map(|(_, c, nic)| (c, nic, None))
            .collect();
        let peer = self
            .add_peer(addr, &hello, session, conns)
            .map_err(AcceptFailure::Local)?;
        let left = || deadline.saturating_duration_since(Instant::now());
        let exchanged = peer
            .send_paths(left())
            .and_then(|()| peer.wait_paths(left()))
            .and_then(|()| peer.read_peer(|core, _| core.conn.recovery_mut().establish()));
        match exchanged {
            Ok(()) => {
                tracing::debug!(peer = %addr, session = format_args!("{session:#x}"), "accepted");
                Ok(peer)
            }
            Err(e) => {
                self.tear_down(peer.slot, PeerGone::AcceptFailed);
                Err(AcceptFailure::ConnectorGone(e))
            }
        }
    }
}
