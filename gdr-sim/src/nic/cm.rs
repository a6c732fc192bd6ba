//! The simulated connection manager: rdma_cm's listen, connect, accept with
//! private data, reject and disconnect, on the fabric.
//!
//! Listeners are keyed by (device IPv4 address, port) on the fabric; an
//! unspecified address listens on every device of the node. A connect finds
//! the listener by the peer's address, queues a request carrying its private
//! data and queue pair, and waits; [`Listener::next_request`] takes it,
//! [`ConnectRequest::accept`] creates the server's queue pair and both
//! sides are driven through INIT, RTR and RTS with the ordinary
//! `to_init`/`to_rtr`/`to_rts` (so the checks of those transitions apply),
//! towards each other's GID, QPN and PSN.
//!
//! The connection manager starts no thread: connect and accept block their callers, so a
//! test runs the two sides on two threads (`std::thread::scope`). They meet
//! through a condition variable beside the fabric's lock, and every wait is
//! bounded by the caller's timeout: on the real clock while the fabric's
//! clock is [`ClockMode::Auto`] (with the NIC thread's RNR pace, the sim's
//! only reads of the real clock),
//! on the virtual clock while it is [`ClockMode::Manual`], where only
//! [`SimClock::advance`](super::SimClock::advance) ends a wait with its
//! timeout (see the [clock](super::clock) docs). What rdma_cm does is mirrored: nobody listening is
//! retried until [`ConnectParams::timeout`], then [`VerbsError::Timeout`], but for at most
//! [`LISTENER_WINDOW`]: the fabric is this process's own, so a listener that has not come by then
//! (one of another process, which the simulation never reaches) fails the connect with
//! [`VerbsError::NotListeningInSimulation`] instead of the whole timeout (as is
//! `route_device` at once for an address no device of the fabric has);
//! a reject (or a request dropped unanswered) is
//! [`VerbsError::ConnectionRejected`] with status 28 at once; private data
//! over the limits, a PD of another device than the one the address picks,
//! and `retry_count` 7 are [`VerbsError::InvalidArgument`]; a disconnect
//! puts the local queue pair in ERROR and shows the peer
//! [`ConnectionState::Disconnected`] on its next
//! [`Connection::poll_state`], which flushes its queue pair too.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use hal_verbs::{
    AddressFamily, ConnectParams, ConnectRequest, Connection, ConnectionInfo, ConnectionManager,
    ConnectionState, InitParams, Listener, MAX_ACCEPT_PRIVATE_DATA, MAX_CONNECT_PRIVATE_DATA,
    MAX_REJECT_PRIVATE_DATA, ProtectionDomain, QueuePair, Result, RtrParams, RtsParams, VerbsError,
    select_roce_v2_gid,
};

use super::clock::ClockMode;
use super::events::ReadyFd;
use super::state::FabricState;
use super::{Exclusive, SimCq, SimFabric, SimPd, SimQp, SimVerbsApi};

/// IB CM reject reason of a reject by the peer's application.
const REJ_CONSUMER_DEFINED: i32 = 28;
/// How long a connect waits for a listener at the peer's address before it
/// fails with [`VerbsError::NotListeningInSimulation`] (when its timeout is
/// longer): time for a listener started a moment after the connect (a
/// server thread coming up), not for one of another process, which the
/// simulation never reaches.
pub const LISTENER_WINDOW: Duration = Duration::from_secs(1);
/// First port handed out for port 0 and for connecting sides.
const FIRST_EPHEMERAL_PORT: u16 = 20_000;

/// The connection manager's part of the fabric state.
#[derive(Default)]
pub(crate) struct CmState {
    listeners: HashMap<(Ipv4Addr, u16), ListenerRecord>,
    requests: HashMap<u64, RequestRecord>,
    conns: HashMap<u64, ConnRecord>,
    /// Each live connection's event fd, by connection.
    wakers: HashMap<u64, Weak<ReadyFd>>,
    next_port: u16,
    /// Calls blocked in a wait on the virtual clock now.
    virtual_waits: usize,
}

struct ListenerRecord {
    node: usize,
    id: u64,
    queue: VecDeque<u64>,
}

/// One side of a connection as the other needs it.
#[derive(Clone, Copy)]
struct Side {
    device: usize,
    qpn: u32,
    psn: u32,
}

enum RequestState {
    /// Queued at the listener.
    Pending,
    /// Taken by `next_request`, not answered yet.
    Taken,
    /// The server's queue pair is in RTS; the client finishes.
    Accepted {
        server: Side,
        private_data: Vec<u8>,
        client_conn: u64,
        server_conn: u64,
    },
    /// Refused by the server's application.
    Rejected { private_data: Vec<u8> },
    /// The listener went away before taking it: the client retries.
    Refused,
    /// The client confirmed (RTU).
    Established,
    /// One side gave up: the client (timeout, abort or error) or the
    /// server (no confirmation in time). The other side removes the request
    /// when it sees this.
    Abandoned,
}

struct RequestRecord {
    client: Side,
    client_addr: SocketAddr,
    server_device: usize,
    server_addr: SocketAddr,
    private_data: Vec<u8>,
    state: RequestState,
}

struct ConnRecord {
    peer: u64,
    disconnected: bool,
}

impl CmState {
    /// Listeners, pending connection requests and live connections.
    pub(crate) fn counts(&self) -> (usize, usize, usize) {
        (self.listeners.len(), self.requests.len(), self.conns.len())
    }

    fn port(&mut self, ip: Ipv4Addr) -> u16 {
        if self.next_port < FIRST_EPHEMERAL_PORT {
            self.next_port = FIRST_EPHEMERAL_PORT;
        }
        loop {
            let port = self.next_port;
            self.next_port = self
                .next_port
                .checked_add(1)
                .unwrap_or(FIRST_EPHEMERAL_PORT);
            if !self.listeners.contains_key(&(ip, port)) {
                return port;
            }
        }
    }

    /// Marks a connection and its peer disconnected, and makes both
    /// sides' event fds readable.
    fn disconnect(&mut self, conn: u64) {
        let peer = self.conns.get_mut(&conn).map(|c| {
            c.disconnected = true;
            c.peer
        });
        if let Some(peer) = peer.and_then(|p| self.conns.get_mut(&p)) {
            peer.disconnected = true;
        }
        self.wakers.retain(|_, w| w.strong_count() > 0);
        for id in std::iter::once(conn).chain(peer) {
            if let Some(fd) = self.wakers.get(&id).and_then(Weak::upgrade) {
                fd.set();
            }
        }
    }

    /// A new event fd for connection `conn`, readable at once if it is
    /// already disconnected.
    fn waker(&mut self, conn: u64) -> Result<Arc<ReadyFd>> {
        let fd = Arc::new(ReadyFd::new("rdma_create_event_channel")?);
        if self.conns.get(&conn).is_none_or(|c| c.disconnected) {
            fd.set();
        }
        self.wakers.insert(conn, Arc::downgrade(&fd));
        Ok(fd)
    }
}

/// When a connection manager's wait ends: on the real clock while the
/// fabric's clock is [`ClockMode::Auto`], on the virtual clock while it is
/// [`ClockMode::Manual`] (then only [`SimClock::advance`] ends it, never
/// real time). The mode is read when the wait starts.
///
/// [`SimClock::advance`]: super::SimClock::advance
#[derive(Debug, Clone, Copy)]
enum CmDeadline {
    Real { start: Instant, deadline: Instant },
    Virtual { start: Duration, deadline: Duration },
}

impl CmDeadline {
    /// `timeout` from now, on the clock the fabric's mode picks.
    fn new(state: &FabricState, timeout: Duration) -> Self {
        match state.clock.mode {
            ClockMode::Auto => {
                let start = Instant::now();
                Self::Real {
                    start,
                    deadline: start.checked_add(timeout).unwrap_or(start + FOREVER),
                }
            }
            ClockMode::Manual => {
                let start = state.clock.now;
                Self::Virtual {
                    start,
                    deadline: start.saturating_add(timeout),
                }
            }
        }
    }

    /// Whether the deadline has passed.
    fn passed(&self, state: &FabricState) -> bool {
        match *self {
            Self::Real { deadline, .. } => Instant::now() >= deadline,
            Self::Virtual { deadline, .. } => state.clock.now >= deadline,
        }
    }

    /// Time since the wait started, on its clock.
    fn waited(&self, state: &FabricState) -> Duration {
        match *self {
            Self::Real { start, .. } => start.elapsed(),
            Self::Virtual { start, .. } => state.clock.now.saturating_sub(start),
        }
    }
}

/// A bound on a real-clock wait that would overflow `Instant`.
const FOREVER: Duration = Duration::from_secs(86_400 * 365);

impl SimFabric {
    /// Waits on the connection manager's condition variable until
    /// `deadline`; true once the deadline has passed. A virtual deadline
    /// waits for a notification (the clock's `advance` gives one), however
    /// long that takes in real time.
    fn cm_wait<'a>(&'a self, guard: Exclusive<'a>, deadline: CmDeadline) -> (Exclusive<'a>, bool) {
        if deadline.passed(&guard) {
            return (guard, true);
        }
        let guard = match deadline {
            CmDeadline::Real { deadline, .. } => {
                let left = deadline.saturating_duration_since(Instant::now());
                self.cm_cond.wait(&self.shared, guard, Some(left))
            }
            CmDeadline::Virtual { .. } => {
                let mut guard = guard;
                guard.cm.virtual_waits += 1;
                let mut guard = self.cm_cond.wait(&self.shared, guard, None);
                guard.cm.virtual_waits -= 1;
                guard
            }
        };
        let late = deadline.passed(&guard);
        (guard, late)
    }

    /// How many connection manager calls (connect, accept, `next_request`,
    /// `poll_state`) are blocked now in a wait on the virtual clock (one
    /// that started in [`ClockMode::Manual`]). A test that advances the
    /// clock for a call on another thread waits for this first: the call
    /// reads the clock when it starts, and an `advance` before that would
    /// not count against its timeout.
    pub fn cm_virtual_waits(&self) -> usize {
        self.lock().cm.virtual_waits
    }

    /// Wakes every connection manager wait (state changed, or the clock
    /// moved).
    pub(crate) fn cm_notify(&self) {
        self.cm_cond.notify_all();
    }
}

fn ipv4(operation: &'static str, ip: IpAddr) -> Result<Ipv4Addr> {
    match ip {
        IpAddr::V4(v4) => Ok(v4),
        IpAddr::V6(_) => Err(VerbsError::unsupported(
            operation,
            "the simulated fabric addresses devices by IPv4 only",
        )),
    }
}

/// The device with address `ip`, anywhere on the fabric.
fn device_by_ip(state: &FabricState, ip: Ipv4Addr) -> Option<usize> {
    state.devices.iter().position(|d| d.ipv4 == ip)
}

/// The device of `node` a connection to `peer` leaves from: the one bound
/// to `source`, else one in the peer's /24, else the node's first.
fn route(
    state: &FabricState,
    node: usize,
    peer: Ipv4Addr,
    source: Option<IpAddr>,
    operation: &'static str,
) -> Result<usize> {
    let devices = &state.nodes[node].devices;
    if let Some(src) = source {
        let src = ipv4(operation, src)?;
        return devices
            .iter()
            .copied()
            .find(|&d| state.devices[d].ipv4 == src)
            .ok_or_else(|| VerbsError::NoDevice {
                detail: format!("no simulated device of this node has address {src}"),
            });
    }
    let subnet = |ip: Ipv4Addr| u32::from(ip) >> 8;
    devices
        .iter()
        .copied()
        .find(|&d| subnet(state.devices[d].ipv4) == subnet(peer))
        .or_else(|| devices.first().copied())
        .ok_or_else(|| VerbsError::NoDevice {
            detail: format!("simulated node {} has no device", state.nodes[node].name),
        })
}

/// A deterministic, distinct initial PSN for a queue pair.
fn psn_of(qpn: u32) -> u32 {
    qpn.wrapping_mul(0x9e37_79b9) & 0x00ff_ffff
}

fn check_pd(
    state: &FabricState,
    fabric: &SimFabric,
    pd: &SimPd,
    device: usize,
    operation: &'static str,
) -> Result<()> {
    if !std::sync::Arc::ptr_eq(&pd.fabric().shared, &fabric.shared) {
        return Err(VerbsError::invalid(
            operation,
            "the PD is of another fabric",
        ));
    }
    if pd.device_index() != device {
        let (want, got) = (
            &state.devices[device].name,
            &state.devices[pd.device_index()].name,
        );
        return Err(VerbsError::invalid(
            operation,
            format!(
                "the connection is on {want}, but the PD is of {got}: allocate the PD \
                 (and register memory) on {want}"
            ),
        ));
    }
    Ok(())
}

/// Drives `qp` (of `local`) to RTS towards `remote`, with the ordinary
/// transitions. Call without the fabric lock.
fn bring_up(
    fabric: &SimFabric,
    qp: &SimQp,
    local: Side,
    remote: Side,
    params: &ConnectParams,
    dest_rd: u8,
    init_rd: u8,
) -> Result<()> {
    let (sgid_index, remote_gid, local_mtu, remote_mtu) = {
        let state = fabric.lock();
        let gid = |d: usize| {
            select_roce_v2_gid(&state.devices[d].gids, AddressFamily::V4)
                .cloned()
                .ok_or_else(|| VerbsError::invalid("rdma_init_qp_attr", "no RoCE v2 IPv4 GID"))
        };
        let (lg, rg) = (gid(local.device)?, gid(remote.device)?);
        (
            u8::try_from(lg.index).unwrap_or(0),
            rg.gid,
            state.devices[local.device].config.active_mtu,
            state.devices[remote.device].config.active_mtu,
        )
    };
    qp.to_init(&InitParams {
        access: params.access,
        ..InitParams::default()
    })?;
    let info = ConnectionInfo {
        qp_num: remote.qpn,
        psn: remote.psn,
        gid: remote_gid,
        lid: 0,
        mtu: remote_mtu,
    };
    qp.to_rtr(&RtrParams {
        max_dest_rd_atomic: dest_rd,
        ..RtrParams::new(info, sgid_index, local_mtu)
    })?;
    qp.to_rts(&RtsParams {
        sq_psn: local.psn,
        // What rdma_cm would derive for a fast local fabric.
        timeout: params.ack_timeout.unwrap_or(14),
        retry_cnt: params.retry_count,
        rnr_retry: params.rnr_retry_count,
        max_rd_atomic: init_rd,
    })
}

/// Points where a unit test runs code on the calling thread, outside the
/// fabric's lock: the windows in which the other side may give up.
#[cfg(test)]
pub(crate) mod hooks {
    use std::cell::RefCell;
    use std::thread::LocalKey;

    /// A hook, taken by the first call that reaches its point.
    pub(crate) type Hook = RefCell<Option<Box<dyn FnOnce()>>>;

    thread_local! {
        /// In `connect`, after the request is queued, before the client
        /// looks for the server's answer.
        pub(crate) static BEFORE_ANSWER: Hook = RefCell::new(None);
        /// In `accept`, after the server's queue pair is up, before the
        /// request is answered.
        pub(crate) static BEFORE_ACCEPTED: Hook = RefCell::new(None);
        /// In `connect`, after the client's queue pair is up, before it
        /// confirms (RTU).
        pub(crate) static BEFORE_CONFIRMED: Hook = RefCell::new(None);
    }

    pub(crate) fn set(hook: &'static LocalKey<Hook>, f: impl FnOnce() + 'static) {
        hook.with(|h| *h.borrow_mut() = Some(Box::new(f)));
    }

    pub(crate) fn run(hook: &'static LocalKey<Hook>) {
        if let Some(f) = hook.with(|h| h.borrow_mut().take()) {
            f();
        }
    }
}

/// One simulated node's connection manager.
#[derive(Debug, Clone)]
pub struct SimCm {
    pub(crate) fabric: SimFabric,
    pub(crate) node: usize,
    /// Bumped (under the fabric lock) by `abort_connects`: a connect that
    /// sees it changed since it began ends.
    pub(crate) aborts: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// Why a connect ended early, in its Timeout's detail.
const ABORTED: &str = "aborted (abort_connects: the connection manager's owner is going)";

impl SimCm {
    /// Takes the client's side of a request once it is answered.
    fn aborted_since(&self, generation: u64) -> bool {
        self.aborts.load(std::sync::atomic::Ordering::SeqCst) != generation
    }

    fn await_answer(
        &self,
        request: u64,
        deadline: CmDeadline,
        generation: u64,
    ) -> std::result::Result<(Side, Vec<u8>, u64), Answer> {
        let mut state = self.fabric.lock();
        loop {
            let Some(rec) = state.cm.requests.get(&request) else {
                return Err(Answer::Retry("request vanished".into()));
            };
            match &rec.state {
                RequestState::Accepted {
                    server,
                    private_data,
                    client_conn,
                    ..
                } => return Ok((*server, private_data.clone(), *client_conn)),
                RequestState::Rejected { private_data } => {
                    let data = private_data.clone();
                    state.cm.requests.remove(&request);
                    return Err(Answer::Rejected(data));
                }
                RequestState::Refused => {
                    state.cm.requests.remove(&request);
                    return Err(Answer::Retry("the listener went away".into()));
                }
                // The server accepted, then gave up waiting for our
                // confirmation before we saw its answer.
                RequestState::Abandoned => {
                    state.cm.requests.remove(&request);
                    return Err(Answer::Retry("the server gave up waiting for us".into()));
                }
                _ => {}
            }
            if self.aborted_since(generation) {
                abandon(&mut state, request);
                self.fabric.cm_notify();
                return Err(Answer::Retry(ABORTED.into()));
            }
            let (guard, late) = self.fabric.cm_wait(state, deadline);
            state = guard;
            if late {
                abandon(&mut state, request);
                self.fabric.cm_notify();
                return Err(Answer::Retry("no answer to the connect request".into()));
            }
        }
    }
}

enum Answer {
    Retry(String),
    Rejected(Vec<u8>),
}

/// The client gives up on a request: take it off the listener's queue.
fn abandon(state: &mut FabricState, request: u64) {
    for l in state.cm.listeners.values_mut() {
        l.queue.retain(|&r| r != request);
    }
    let remove = match state.cm.requests.get_mut(&request) {
        Some(rec) if matches!(rec.state, RequestState::Pending) => true,
        Some(rec) => {
            if let RequestState::Accepted {
                client_conn,
                server_conn,
                ..
            } = rec.state
            {
                state.cm.conns.remove(&client_conn);
                if let Some(c) = state.cm.conns.get_mut(&server_conn) {
                    c.disconnected = true;
                }
            }
            rec.state = RequestState::Abandoned;
            false
        }
        None => false,
    };
    if remove {
        state.cm.requests.remove(&request);
    }
}

impl ConnectionManager<SimVerbsApi> for SimCm {
    fn abort_connects(&self) {
        {
            let _state = self.fabric.lock();
            self.aborts
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.fabric.cm_notify();
    }

    fn route_device(&self, peer: IpAddr, _timeout: Duration) -> Result<String> {
        const OP: &str = "rdma_resolve_addr";
        let peer = ipv4(OP, peer)?;
        let state = self.fabric.lock();
        if device_by_ip(&state, peer).is_none() {
            // No device of this process's fabric has it: nobody here will
            // ever listen there (another process's fabric is not reached).
            tracing::info!(%peer, "sim: no simulated device has this address");
            return Err(VerbsError::NotListeningInSimulation {
                peer: peer.to_string(),
                waited: Duration::ZERO,
            });
        }
        let device = route(&state, self.node, peer, None, OP)?;
        Ok(state.devices[device].name.clone())
    }

    fn listen(&self, addr: SocketAddr, _backlog: u32) -> Result<SimListener> {
        const OP: &str = "rdma_bind_addr";
        let ip = ipv4(OP, addr.ip())?;
        let mut state = self.fabric.lock();
        let device = if ip.is_unspecified() {
            None
        } else {
            let found = state.nodes[self.node]
                .devices
                .iter()
                .copied()
                .find(|&d| state.devices[d].ipv4 == ip);
            Some(found.ok_or_else(|| VerbsError::NoDevice {
                detail: format!("no simulated device of this node has address {ip}"),
            })?)
        };
        let port = if addr.port() == 0 {
            state.cm.port(ip)
        } else {
            addr.port()
        };
        if state.cm.listeners.contains_key(&(ip, port)) {
            return Err(VerbsError::Os {
                operation: OP,
                errno: libc::EADDRINUSE,
            });
        }
        let id = state.next_id();
        state.cm.listeners.insert(
            (ip, port),
            ListenerRecord {
                node: self.node,
                id,
                queue: VecDeque::new(),
            },
        );
        drop(state);
        self.fabric.cm_notify();
        let local = SocketAddr::from((ip, port));
        tracing::debug!(%local, ?device, "sim: listening");
        Ok(SimListener {
            fabric: self.fabric.clone(),
            key: (ip, port),
            id,
            woken: std::sync::atomic::AtomicBool::new(false),
        })
    }

    #[tracing::instrument(
        level = "info",
        name = "sim cm connect",
        skip(self, pd, send_cq, recv_cq, params, private_data),
        fields(private_len = private_data.len())
    )]
    fn connect(
        &self,
        peer: SocketAddr,
        pd: &SimPd,
        send_cq: &SimCq,
        recv_cq: &SimCq,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<SimConnection> {
        const OP: &str = "rdma_connect";
        params.validate(OP, private_data, MAX_CONNECT_PRIVATE_DATA)?;
        let peer_ip = ipv4(OP, peer.ip())?;
        let (device, deadline, window) = {
            let state = self.fabric.lock();
            let deadline = CmDeadline::new(&state, params.timeout);
            let window = CmDeadline::new(&state, params.timeout.min(LISTENER_WINDOW));
            let device = route(&state, self.node, peer_ip, params.source, OP)?;
            check_pd(&state, &self.fabric, pd, device, OP)?;
            (device, deadline, window)
        };
        let generation = self.aborts.load(std::sync::atomic::Ordering::SeqCst);
        let mut attempts = 0u32;
        let mut last = String::from("nobody listening");
        loop {
            attempts += 1;
            // A fresh queue pair per attempt, as the real backend makes.
            let qp = pd.create_qp(&params.caps, send_cq, recv_cq)?;
            let client = Side {
                device,
                qpn: qp.qp_num(),
                psn: psn_of(qp.qp_num()),
            };
            // Wait for a listener, then queue the request.
            let request = {
                let mut state = self.fabric.lock();
                // `Err(true)`: nobody listened within the window.
                loop {
                    let server_device = device_by_ip(&state, peer_ip);
                    let key = server_device.and_then(|d| {
                        let exact = (peer_ip, peer.port());
                        let any = (Ipv4Addr::UNSPECIFIED, peer.port());
                        let node = state.nodes.iter().position(|n| n.devices.contains(&d));
                        if state.cm.listeners.contains_key(&exact) {
                            Some(exact)
                        } else {
                            state
                                .cm
                                .listeners
                                .get(&any)
                                .is_some_and(|l| Some(l.node) == node)
                                .then_some(any)
                        }
                    });
                    if let (Some(key), Some(server_device)) = (key, server_device) {
                        let id = state.next_id();
                        let ip = state.devices[device].ipv4;
                        let client_addr = SocketAddr::from((ip, state.cm.port(ip)));
                        state.cm.requests.insert(
                            id,
                            RequestRecord {
                                client,
                                client_addr,
                                server_device,
                                server_addr: peer,
                                private_data: private_data.to_vec(),
                                state: RequestState::Pending,
                            },
                        );
                        if let Some(l) = state.cm.listeners.get_mut(&key) {
                            l.queue.push_back(id);
                        }
                        break Ok(id);
                    }
                    last = if server_device.is_none() {
                        format!("address resolution: no device has {peer_ip}")
                    } else {
                        format!("rejected: nobody listening on {peer} (status 8)")
                    };
                    // Checked under the lock `abort_connects` takes: an abort
                    // is seen here or wakes the wait.
                    if self.aborted_since(generation) {
                        last = ABORTED.into();
                        break Err(false);
                    }
                    let (guard, late) = self.fabric.cm_wait(state, window);
                    state = guard;
                    if late {
                        // Past the window but not the timeout: nobody of
                        // this process's fabric came to listen.
                        break Err(!deadline.passed(&state));
                    }
                }
            };
            let request = match request {
                Ok(request) => request,
                Err(true) => {
                    let state = self.fabric.lock();
                    let waited = window.waited(&state);
                    tracing::info!(%peer, ?waited, %last, "sim: nobody of this process listens");
                    return Err(VerbsError::NotListeningInSimulation {
                        peer: peer.to_string(),
                        waited,
                    });
                }
                Err(false) => {
                    return Err(VerbsError::Timeout {
                        operation: OP,
                        waited: deadline.waited(&self.fabric.lock()),
                        detail: format!("{attempts} attempt(s); last: {last}"),
                    });
                }
            };
            self.fabric.cm_notify();
            #[cfg(test)]
            hooks::run(&hooks::BEFORE_ANSWER);
            let (server, peer_private, conn) =
                match self.await_answer(request, deadline, generation) {
                    Ok(answer) => answer,
                    Err(Answer::Rejected(private_data)) => {
                        return Err(VerbsError::ConnectionRejected {
                            peer: peer.to_string(),
                            status: REJ_CONSUMER_DEFINED,
                            private_data,
                        });
                    }
                    Err(Answer::Retry(why)) => {
                        last = why;
                        let state = self.fabric.lock();
                        if deadline.passed(&state) || self.aborted_since(generation) {
                            return Err(VerbsError::Timeout {
                                operation: OP,
                                waited: deadline.waited(&state),
                                detail: format!("{attempts} attempt(s); last: {last}"),
                            });
                        }
                        continue;
                    }
                };
            let rd = params.responder_resources;
            let init = params.initiator_depth;
            if let Err(e) = bring_up(&self.fabric, &qp, client, server, params, rd, init) {
                abandon(&mut self.fabric.lock(), request);
                self.fabric.cm_notify();
                return Err(e);
            }
            #[cfg(test)]
            hooks::run(&hooks::BEFORE_CONFIRMED);
            let confirmed = {
                let mut state = self.fabric.lock();
                let local = match state.cm.requests.get_mut(&request) {
                    Some(rec) if matches!(rec.state, RequestState::Accepted { .. }) => {
                        rec.state = RequestState::Established;
                        Some(rec.client_addr)
                    }
                    _ => {
                        // The server gave up waiting for us in the meantime
                        // (its accept has returned): nobody else is left to
                        // remove the request or our end of the connection.
                        state.cm.requests.remove(&request);
                        state.cm.conns.remove(&conn);
                        None
                    }
                };
                local.map(|l| (l, state.devices[device].name.clone()))
            };
            let Some((local, device_name)) = confirmed else {
                self.fabric.cm_notify();
                return Err(VerbsError::Os {
                    operation: OP,
                    errno: libc::ECONNABORTED,
                });
            };
            let (wake, elapsed) = {
                let mut state = self.fabric.lock();
                (state.cm.waker(conn)?, deadline.waited(&state))
            };
            self.fabric.cm_notify();
            tracing::info!(attempts, ?elapsed, qpn = client.qpn, "sim: connected");
            return Ok(SimConnection {
                qp,
                fabric: self.fabric.clone(),
                conn,
                wake,
                device: device_name,
                local,
                peer,
                peer_private_data: peer_private,
            });
        }
    }
}

/// A simulated listener. Dropping it stops listening; requests it had not
/// handed out make their clients retry.
#[derive(Debug)]
pub struct SimListener {
    fabric: SimFabric,
    key: (Ipv4Addr, u16),
    id: u64,
    /// Set by [`Listener::wake`], taken by the wait it ends.
    woken: std::sync::atomic::AtomicBool,
}

impl Listener<SimVerbsApi> for SimListener {
    fn local_addr(&self) -> SocketAddr {
        SocketAddr::from(self.key)
    }

    fn wake(&self) {
        // Under the fabric's lock: a wait checks the flag before it sleeps.
        let _state = self.fabric.lock();
        self.woken.store(true, std::sync::atomic::Ordering::SeqCst);
        self.fabric.cm_cond.notify_all();
    }

    fn next_request(&self, timeout: Duration) -> Result<SimConnectRequest> {
        const OP: &str = "rdma_get_request";
        let mut state = self.fabric.lock();
        let deadline = CmDeadline::new(&state, timeout);
        loop {
            let next = state
                .cm
                .listeners
                .get_mut(&self.key)
                .filter(|l| l.id == self.id)
                .and_then(|l| l.queue.pop_front());
            if let Some(id) = next {
                let st = &mut *state;
                if let Some(rec) = st.cm.requests.get_mut(&id) {
                    rec.state = RequestState::Taken;
                    return Ok(SimConnectRequest {
                        fabric: self.fabric.clone(),
                        id,
                        device: rec.server_device,
                        device_name: st.devices[rec.server_device].name.clone(),
                        peer: rec.client_addr,
                        local: rec.server_addr,
                        private_data: rec.private_data.clone(),
                        answered: false,
                    });
                }
                continue;
            }
            if self.woken.swap(false, std::sync::atomic::Ordering::SeqCst) {
                return Err(VerbsError::Timeout {
                    operation: OP,
                    waited: deadline.waited(&state),
                    detail: format!("woken while waiting on {}", self.local_addr()),
                });
            }
            let (guard, late) = self.fabric.cm_wait(state, deadline);
            state = guard;
            if late {
                return Err(VerbsError::Timeout {
                    operation: OP,
                    waited: deadline.waited(&state),
                    detail: format!("no connect request on {}", self.local_addr()),
                });
            }
        }
    }
}

impl Drop for SimListener {
    fn drop(&mut self) {
        let mut state = self.fabric.lock();
        if state
            .cm
            .listeners
            .get(&self.key)
            .is_some_and(|l| l.id == self.id)
            && let Some(l) = state.cm.listeners.remove(&self.key)
        {
            for id in l.queue {
                if let Some(rec) = state.cm.requests.get_mut(&id) {
                    rec.state = RequestState::Refused;
                }
            }
        }
        drop(state);
        self.fabric.cm_notify();
    }
}

/// A connect request taken from a simulated listener. Dropping it
/// unanswered rejects it.
#[derive(Debug)]
pub struct SimConnectRequest {
    fabric: SimFabric,
    id: u64,
    device: usize,
    device_name: String,
    peer: SocketAddr,
    local: SocketAddr,
    private_data: Vec<u8>,
    answered: bool,
}

impl SimConnectRequest {
    fn answer_reject(&mut self, private_data: &[u8]) {
        self.answered = true;
        let mut state = self.fabric.lock();
        if let Some(rec) = state.cm.requests.get_mut(&self.id) {
            if matches!(rec.state, RequestState::Abandoned) {
                state.cm.requests.remove(&self.id);
            } else {
                rec.state = RequestState::Rejected {
                    private_data: private_data.to_vec(),
                };
            }
        }
        drop(state);
        self.fabric.cm_notify();
    }
}

impl Drop for SimConnectRequest {
    fn drop(&mut self) {
        if !self.answered {
            self.answer_reject(&[]);
        }
    }
}

impl ConnectRequest<SimVerbsApi> for SimConnectRequest {
    fn private_data(&self) -> Vec<u8> {
        self.private_data.clone()
    }

    fn device(&self) -> String {
        self.device_name.clone()
    }

    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    #[tracing::instrument(
        level = "info",
        name = "sim cm accept",
        skip(self, pd, send_cq, recv_cq, params, private_data),
        fields(peer = %self.peer, device = %self.device_name)
    )]
    fn accept(
        mut self,
        pd: &SimPd,
        send_cq: &SimCq,
        recv_cq: &SimCq,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<SimConnection> {
        const OP: &str = "rdma_accept";
        let deadline = CmDeadline::new(&self.fabric.lock(), params.timeout);
        // On an early return `self` drops and rejects the request.
        params.validate(OP, private_data, MAX_ACCEPT_PRIVATE_DATA)?;
        let client = {
            let state = self.fabric.lock();
            check_pd(&state, &self.fabric, pd, self.device, OP)?;
            match state.cm.requests.get(&self.id) {
                Some(rec) if matches!(rec.state, RequestState::Taken) => rec.client,
                _ => {
                    return Err(VerbsError::Os {
                        operation: OP,
                        errno: libc::ECONNABORTED,
                    });
                }
            }
        };
        let qp = pd.create_qp(&params.caps, send_cq, recv_cq)?;
        let server = Side {
            device: self.device,
            qpn: qp.qp_num(),
            psn: psn_of(qp.qp_num()),
        };
        let rd = params.responder_resources;
        let init = params.initiator_depth;
        bring_up(&self.fabric, &qp, server, client, params, rd, init)?;
        #[cfg(test)]
        hooks::run(&hooks::BEFORE_ACCEPTED);
        let mut state = self.fabric.lock();
        let (client_conn, server_conn) = (state.next_id(), state.next_id());
        match state.cm.requests.get_mut(&self.id) {
            Some(rec) if matches!(rec.state, RequestState::Taken) => {
                rec.state = RequestState::Accepted {
                    server,
                    private_data: private_data.to_vec(),
                    client_conn,
                    server_conn,
                };
            }
            _ => {
                // The client gave up since the check above (`abandon`
                // leaves a taken request to the server): it is gone, and
                // the request is this side's to remove.
                state.cm.requests.remove(&self.id);
                drop(state);
                self.answered = true;
                return Err(VerbsError::Os {
                    operation: OP,
                    errno: libc::ECONNABORTED,
                });
            }
        }
        self.answered = true;
        state.cm.conns.insert(
            client_conn,
            ConnRecord {
                peer: server_conn,
                disconnected: false,
            },
        );
        state.cm.conns.insert(
            server_conn,
            ConnRecord {
                peer: client_conn,
                disconnected: false,
            },
        );
        self.fabric.cm_notify();
        // Wait for the client's confirmation (RTU).
        loop {
            match state.cm.requests.get(&self.id).map(|r| &r.state) {
                Some(RequestState::Established) => {
                    state.cm.requests.remove(&self.id);
                    break;
                }
                Some(RequestState::Accepted { .. }) => {}
                _ => {
                    state.cm.requests.remove(&self.id);
                    state.cm.conns.remove(&server_conn);
                    drop(state);
                    return Err(VerbsError::Os {
                        operation: OP,
                        errno: libc::ECONNABORTED,
                    });
                }
            }
            let (guard, late) = self.fabric.cm_wait(state, deadline);
            state = guard;
            if late {
                if let Some(rec) = state.cm.requests.get_mut(&self.id) {
                    rec.state = RequestState::Abandoned;
                }
                state.cm.disconnect(server_conn);
                state.cm.conns.remove(&server_conn);
                // The client's end too: it may never look again (it
                // removes the request when it does).
                state.cm.conns.remove(&client_conn);
                let waited = deadline.waited(&state);
                drop(state);
                self.fabric.cm_notify();
                return Err(VerbsError::Timeout {
                    operation: OP,
                    waited,
                    detail: format!("{} never confirmed (no RTU)", self.peer),
                });
            }
        }
        let wake = state.cm.waker(server_conn)?;
        let elapsed = deadline.waited(&state);
        drop(state);
        tracing::info!(?elapsed, qpn = server.qpn, "sim: accepted");
        Ok(SimConnection {
            qp,
            fabric: self.fabric.clone(),
            conn: server_conn,
            wake,
            device: self.device_name.clone(),
            local: self.local,
            peer: self.peer,
            peer_private_data: std::mem::take(&mut self.private_data),
        })
    }

    fn reject(mut self, private_data: &[u8]) -> Result<()> {
        if private_data.len() > MAX_REJECT_PRIVATE_DATA {
            return Err(VerbsError::invalid(
                "rdma_reject",
                format!(
                    "{} bytes of private data; at most {MAX_REJECT_PRIVATE_DATA} fit",
                    private_data.len()
                ),
            ));
        }
        self.answer_reject(private_data);
        Ok(())
    }
}

/// An established simulated connection: one RC queue pair.
#[derive(Debug)]
pub struct SimConnection {
    // First: dropped after Drop::drop disconnected it.
    qp: SimQp,
    fabric: SimFabric,
    conn: u64,
    /// Readable once the connection is disconnected (by either side);
    /// cleared by `poll_state`.
    wake: Arc<ReadyFd>,
    device: String,
    local: SocketAddr,
    peer: SocketAddr,
    peer_private_data: Vec<u8>,
}

impl SimConnection {
    /// Whether the device of our queue pair was lost.
    fn device_lost(&self, state: &FabricState) -> bool {
        state
            .qps
            .get(&self.qp.qp_num())
            .is_some_and(|q| state.devices[q.device].lost)
    }

    /// Whether [`observe`](Self::observe) would find the connection up (and
    /// so change nothing).
    fn still_connected(&self, state: &FabricState) -> bool {
        !self.device_lost(state)
            && state
                .cm
                .conns
                .get(&self.conn)
                .is_some_and(|c| !c.disconnected)
    }

    /// Disconnected (by either side) or device lost, as seen under the lock;
    /// flushes our queue pair once disconnected.
    fn observe(&self, state: &mut FabricState) -> ConnectionState {
        if self.device_lost(state) {
            return ConnectionState::DeviceRemoved;
        }
        if self.still_connected(state) {
            return ConnectionState::Connected;
        }
        state.set_error(self.qp.qp_num());
        ConnectionState::Disconnected
    }
}

impl Connection<SimVerbsApi> for SimConnection {
    fn qp(&self) -> &SimQp {
        &self.qp
    }

    fn device(&self) -> String {
        self.device.clone()
    }

    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    fn peer_private_data(&self) -> Vec<u8> {
        self.peer_private_data.clone()
    }

    fn event_fd(&self) -> std::os::fd::RawFd {
        self.wake.raw_fd()
    }

    fn poll_state(&self, timeout: Duration) -> Result<ConnectionState> {
        if timeout.is_zero() {
            // What made the fd readable is consumed first: a change after
            // the look below notifies anew.
            self.wake.clear();
            // A connection still up changes nothing: the fabric held shared,
            // so an engine looking at its peers' connections (every pass)
            // does not stop every poster and poller of the fabric.
            if self.still_connected(&self.fabric.read()) {
                return Ok(ConnectionState::Connected);
            }
        }
        let mut state = self.fabric.lock();
        let deadline = CmDeadline::new(&state, timeout);
        // What made the fd readable is consumed here, as reading the
        // rdma_cm channel's events consumes them.
        self.wake.clear();
        loop {
            let now = self.observe(&mut state);
            if now != ConnectionState::Connected {
                return Ok(now);
            }
            let (guard, late) = self.fabric.cm_wait(state, deadline);
            state = guard;
            if late {
                return Ok(self.observe(&mut state));
            }
        }
    }

    fn disconnect(&self) -> Result<()> {
        let mut state = self.fabric.lock();
        state.cm.disconnect(self.conn);
        state.set_error(self.qp.qp_num());
        drop(state);
        self.fabric.cm_notify();
        Ok(())
    }
}

impl Drop for SimConnection {
    fn drop(&mut self) {
        let mut state = self.fabric.lock();
        state.cm.disconnect(self.conn);
        state.set_error(self.qp.qp_num());
        state.cm.conns.remove(&self.conn);
        drop(state);
        self.fabric.cm_notify();
    }
}
