//! Connection set-up: the accepting side's [`Backlog`] of sessions waiting
//! for `accept`, and the connecting side's [`Dial`].
//!
//! # The protocol
//!
//! A connection between two engines (a *session*) is `qp_count` RC queue
//! pairs, each an rdma_cm connection whose connect carries a [`Hello`]: the
//! session id the connector chose, the queue pair's index and the count.
//!
//! 1. The connector connects queue pairs `0, 1, …` in turn ([`Dial`]); the
//!    acceptor answers each with its own [`Hello`] ([`Role::Accept`]).
//! 2. The listener takes each connect request as it arrives, before its
//!    application calls `accept`: [`Backlog::check`] says whether it may
//!    wait (the driver then accepts it at the rdma_cm level and
//!    [`Backlog::admit`]s it) or why not ([`SetupError::reject_reason`] is
//!    the reject to send; a full backlog is [`RejectReason::Busy`]).
//! 3. `accept` takes the first complete session (every index
//!    `0..qp_count` once, [`Backlog::take_complete`]) and sets it up: it
//!    posts its control receives and sends its [`Control::Paths`] first.
//!    The connector waits for them: they are its sign that it was
//!    accepted ([`Dial::on_accepted`]); it answers with its own paths. So
//!    nothing is sent to a side that has no receives posted, and a
//!    connector tells "not accepted" ([`NotAccepted`]) from a failure.
//! 4. Nothing waits unbounded: a session waits in the backlog at most its
//!    deadline from its first queue pair ([`Backlog::handle_timeout`]);
//!    a session one of whose queue pairs is disconnected (its connector
//!    gave up) is dropped whole ([`Backlog::on_disconnected`]); the
//!    connector waits at most its own timeout ([`Dial::handle_timeout`]).
//!    Whatever either side drops, it disconnects: a connector whose set-up
//!    failed after any queue pair connected tears every one down
//!    ([`Dial::poll_teardown`]), so no side keeps a live-looking peer.
//!
//! The bounds and default deadlines are the constants below.
//!
//! [`Control::Paths`]: crate::wire::Control::Paths

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use crate::wire::{Hello, MAX_QPS_PER_PEER, RejectReason, Role};

// ---------------------------------------------------------------------------
// Bounds and deadlines, in one place.

/// Sessions that may wait for `accept` at once, by default: a new session
/// beyond them is refused with [`RejectReason::Busy`].
pub const DEFAULT_BACKLOG: usize = 16;
/// The most sessions a backlog may be configured to hold.
pub const MAX_BACKLOG: usize = 1024;
/// The most queue pairs a backlog holds at once: [`MAX_BACKLOG`] sessions
/// of [`MAX_QPS_PER_PEER`] each.
pub const MAX_BACKLOG_QPS: usize = MAX_BACKLOG * MAX_QPS_PER_PEER as usize;
/// How long a session may wait for `accept` from its first queue pair, by
/// default; past it, it is disconnected.
pub const DEFAULT_ACCEPT_DEADLINE: Duration = Duration::from_secs(10);
/// The shortest accept deadline a backlog takes (shorter ones are raised
/// to it): time for a connector's every queue pair to arrive.
pub const MIN_ACCEPT_DEADLINE: Duration = Duration::from_millis(10);
/// The longest accept deadline a backlog takes (longer ones are lowered to
/// it): a peer may hold queue pairs here unaccepted no longer.
pub const MAX_ACCEPT_DEADLINE: Duration = Duration::from_secs(3600);

/// The least time a connector gives its answer (its own paths) once the
/// listener accepted, even past its timeout: it was accepted, and the
/// answer is one message to a side whose receives are posted.
pub const ANSWER_GRACE: Duration = Duration::from_secs(1);

const _: () = assert!(1 <= DEFAULT_BACKLOG && DEFAULT_BACKLOG <= MAX_BACKLOG);
const _: () = assert!(MAX_BACKLOG_QPS / MAX_QPS_PER_PEER as usize == MAX_BACKLOG);
const _: () = assert!(MIN_ACCEPT_DEADLINE.as_nanos() <= DEFAULT_ACCEPT_DEADLINE.as_nanos());
const _: () = assert!(DEFAULT_ACCEPT_DEADLINE.as_nanos() <= MAX_ACCEPT_DEADLINE.as_nanos());

/// A queue pair's connection, named by the driver: the machines here never
/// see the connection itself, only this.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Token(pub u64);

// ---------------------------------------------------------------------------
// The accepting side.

/// A backlog's bounds. Out-of-range values are brought into range by
/// [`Backlog::new`] ([`BacklogConfig::clamped`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BacklogConfig {
    /// Sessions that may wait at once, `1..=`[`MAX_BACKLOG`].
    pub max_sessions: usize,
    /// How long a session may wait from its first queue pair,
    /// [`MIN_ACCEPT_DEADLINE`]`..=`[`MAX_ACCEPT_DEADLINE`].
    pub deadline: Duration,
    /// Queue pairs one session may ask for, `1..=`[`MAX_QPS_PER_PEER`].
    pub max_qps: u16,
}

impl Default for BacklogConfig {
    fn default() -> Self {
        Self {
            max_sessions: DEFAULT_BACKLOG,
            deadline: DEFAULT_ACCEPT_DEADLINE,
            max_qps: MAX_QPS_PER_PEER,
        }
    }
}

impl BacklogConfig {
    /// The configuration with each field brought into its range.
    pub fn clamped(self) -> Self {
        Self {
            max_sessions: self.max_sessions.clamp(1, MAX_BACKLOG),
            deadline: self
                .deadline
                .clamp(MIN_ACCEPT_DEADLINE, MAX_ACCEPT_DEADLINE),
            max_qps: self.max_qps.clamp(1, MAX_QPS_PER_PEER),
        }
    }
}

/// One queue pair arriving at the listener: what its [`Hello`] says, and
/// the token the driver names its connection by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    /// The session it belongs to.
    pub session: u64,
    /// Its index within the session.
    pub qp_index: u16,
    /// How many queue pairs the session has.
    pub qp_count: u16,
    /// The driver's name for its connection, unique among those waiting.
    pub token: Token,
}

impl Arrival {
    /// The arrival a connect's hello describes.
    pub fn of_hello(hello: &Hello, token: Token) -> Self {
        Self {
            session: hello.session,
            qp_index: hello.qp_index,
            qp_count: hello.qp_count,
            token,
        }
    }
}

/// What [`Backlog::admit`] did with a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    /// It waits with the rest of its session, `arrived` of `qp_count`.
    Waiting {
        /// Queue pairs of the session here, this one included.
        arrived: u16,
        /// Queue pairs the session has.
        qp_count: u16,
    },
    /// It was the last one: the session is complete, for
    /// [`Backlog::take_complete`].
    Complete,
}

/// A complete session, taken out of the backlog for `accept`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// The session id.
    pub id: u64,
    /// Its queue pairs' tokens, in index order.
    pub tokens: Vec<Token>,
    /// When it would have expired in the backlog.
    pub deadline: Instant,
}

/// Why the backlog dropped a queue pair ([`Backlog::poll_dropped`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Its session was not accepted before its deadline.
    Expired,
    /// Another queue pair of its session was disconnected: its connector
    /// gave up.
    Disconnected,
    /// The backlog was closed (the listener is gone).
    Closed,
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DropReason::Expired => "not accepted before its deadline",
            DropReason::Disconnected => "another queue pair of its session was disconnected",
            DropReason::Closed => "the listener closed",
        })
    }
}

/// A queue pair the driver must disconnect and forget: its session was
/// dropped from the backlog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    /// The queue pair's connection.
    pub token: Token,
    /// Its session.
    pub session: u64,
    /// Why.
    pub reason: DropReason,
}

/// Why the backlog refused a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// A new session while `max` sessions already wait for accept.
    #[error("{max} sessions already wait for accept")]
    Busy {
        /// The backlog's bound.
        max: usize,
    },
    /// The backlog is closed: its listener no longer takes new sessions.
    #[error("the listener is closed")]
    Closed,
    /// The session asks for more queue pairs than the backlog allows.
    #[error("session {session:#x} asks for {qp_count} queue pairs, at most {max} are allowed")]
    TooManyQps {
        /// The session.
        session: u64,
        /// The count its hello says.
        qp_count: u16,
        /// The backlog's bound.
        max: u16,
    },
    /// An index outside `0..qp_count` (or a count of zero).
    #[error("session {session:#x}: queue pair index {qp_index} is outside 0..{qp_count}")]
    IndexOutOfRange {
        /// The session.
        session: u64,
        /// The index.
        qp_index: u16,
        /// The count.
        qp_count: u16,
    },
    /// A queue pair of an index already waiting for its session.
    #[error("session {session:#x}: queue pair {qp_index} arrived twice")]
    DuplicateIndex {
        /// The session.
        session: u64,
        /// The index.
        qp_index: u16,
    },
    /// A queue pair whose count disagrees with its session's earlier ones.
    #[error("session {session:#x}: a queue pair says {got} queue pairs, an earlier one {expected}")]
    CountMismatch {
        /// The session.
        session: u64,
        /// The count of the session's first queue pair.
        expected: u16,
        /// The count this one says.
        got: u16,
    },
    /// The driver named two waiting connections by one token.
    #[error("token {0:?} already names a waiting queue pair")]
    DuplicateToken(Token),
}

impl SetupError {
    /// The reject to send the connector: [`RejectReason::Busy`] for a full
    /// or closed backlog (a later attempt may succeed),
    /// [`RejectReason::TooManyQps`] for too many queue pairs,
    /// [`RejectReason::Malformed`] for indices and counts that do not add
    /// up (the wire has no finer code for them; the acceptor logs which).
    pub fn reject_reason(&self) -> RejectReason {
        match self {
            SetupError::Busy { .. } | SetupError::Closed | SetupError::DuplicateToken(_) => {
                RejectReason::Busy
            }
            SetupError::TooManyQps { .. } => RejectReason::TooManyQps,
            SetupError::IndexOutOfRange { .. }
            | SetupError::DuplicateIndex { .. }
            | SetupError::CountMismatch { .. } => RejectReason::Malformed,
        }
    }
}

/// A session some of whose queue pairs have arrived.
#[derive(Debug)]
struct Waiting {
    id: u64,
    /// The token of each index that arrived.
    slots: Vec<Option<Token>>,
    arrived: u16,
    deadline: Instant,
    /// Completion order: the first complete session is taken first.
    completed: Option<u64>,
}

impl Waiting {
    fn qp_count(&self) -> u16 {
        self.slots.len() as u16
    }

    fn tokens(&self) -> impl Iterator<Item = Token> + '_ {
        self.slots.iter().flatten().copied()
    }
}

/// The listener's sessions waiting for `accept`, in quinn-proto's shape:
/// the driver (the engine's listener) reports arrivals, disconnects and
/// time; the backlog decides what may wait, what is complete, and what
/// must be disconnected. No I/O, no clock: `now` comes in.
///
/// Bounds: at most [`BacklogConfig::max_sessions`] sessions, each of at
/// most [`BacklogConfig::max_qps`] queue pairs, each waiting at most
/// [`BacklogConfig::deadline`] from its first queue pair.
#[derive(Debug)]
pub struct Backlog {
    config: BacklogConfig,
    /// In order of first arrival.
    sessions: Vec<Waiting>,
    /// The session of each waiting token.
    tokens: HashMap<Token, u64>,
    dropped: VecDeque<Dropped>,
    next_completion: u64,
    closed: bool,
}

impl Backlog {
    /// An empty backlog with `config`'s bounds (clamped into range).
    pub fn new(config: BacklogConfig) -> Self {
        Self {
            config: config.clamped(),
            sessions: Vec::new(),
            tokens: HashMap::new(),
            dropped: VecDeque::new(),
            next_completion: 0,
            closed: false,
        }
    }

    /// The bounds in force.
    pub fn config(&self) -> BacklogConfig {
        self.config
    }

    /// Sessions waiting (complete or not).
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Whether no session waits.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// Queue pairs waiting, over every session.
    pub fn queue_pairs(&self) -> usize {
        self.tokens.len()
    }

    /// Whether [`Backlog::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    fn position(&self, session: u64) -> Option<usize> {
        self.sessions.iter().position(|s| s.id == session)
    }

    /// Whether `arrival` would be admitted now, changing nothing: the
    /// driver asks before it accepts the connection at the rdma_cm level,
    /// and rejects it with [`SetupError::reject_reason`] if not.
    pub fn check(&self, arrival: &Arrival) -> Result<(), SetupError> {
        let Arrival {
            session,
            qp_index,
            qp_count,
            token,
        } = *arrival;
        if self.closed {
            return Err(SetupError::Closed);
        }
        if qp_index >= qp_count {
            return Err(SetupError::IndexOutOfRange {
                session,
                qp_index,
                qp_count,
            });
        }
        if qp_count > self.config.max_qps {
            return Err(SetupError::TooManyQps {
                session,
                qp_count,
                max: self.config.max_qps,
            });
        }
        if self.tokens.contains_key(&token) {
            return Err(SetupError::DuplicateToken(token));
        }
        match self.position(session) {
            Some(at) => {
                let waiting = &self.sessions[at];
                if waiting.qp_count() != qp_count {
                    return Err(SetupError::CountMismatch {
                        session,
                        expected: waiting.qp_count(),
                        got: qp_count,
                    });
                }
                if waiting.slots[usize::from(qp_index)].is_some() {
                    return Err(SetupError::DuplicateIndex { session, qp_index });
                }
                Ok(())
            }
            None if self.sessions.len() >= self.config.max_sessions => Err(SetupError::Busy {
                max: self.config.max_sessions,
            }),
            None => Ok(()),
        }
    }

    /// A queue pair the driver accepted at the rdma_cm level arrives at
    /// `now`: it waits with its session (the first of a session sets the
    /// session's deadline, `now` + [`BacklogConfig::deadline`]). Refused,
    /// changing nothing, for any reason [`Backlog::check`] gives; the
    /// driver then disconnects it.
    pub fn admit(&mut self, now: Instant, arrival: Arrival) -> Result<Admitted, SetupError> {
        self.check(&arrival)?;
        let at = match self.position(arrival.session) {
            Some(at) => at,
            None => {
                self.sessions.push(Waiting {
                    id: arrival.session,
                    slots: vec![None; usize::from(arrival.qp_count)],
                    arrived: 0,
                    deadline: now + self.config.deadline,
                    completed: None,
                });
                self.sessions.len() - 1
            }
        };
        let waiting = &mut self.sessions[at];
        waiting.slots[usize::from(arrival.qp_index)] = Some(arrival.token);
        waiting.arrived += 1;
        self.tokens.insert(arrival.token, arrival.session);
        if waiting.arrived == waiting.qp_count() {
            waiting.completed = Some(self.next_completion);
            self.next_completion += 1;
            Ok(Admitted::Complete)
        } else {
            Ok(Admitted::Waiting {
                arrived: waiting.arrived,
                qp_count: waiting.qp_count(),
            })
        }
    }

    /// Takes the session that completed first out of the backlog, its
    /// tokens in index order; the driver sets it up with those
    /// connections.
    ///
    /// Its answer changes only by [`Backlog::admit`] (of a session's last
    /// queue pair: `Some`), by this call itself, and by
    /// [`Backlog::handle_timeout`], [`Backlog::on_disconnected`] and
    /// [`Backlog::close`] (which may remove complete sessions).
    pub fn take_complete(&mut self) -> Option<Session> {
        let at = self
            .sessions
            .iter()
            .enumerate()
            .filter_map(|(at, s)| s.completed.map(|order| (order, at)))
            .min()?
            .1;
        let waiting = self.sessions.remove(at);
        let tokens: Vec<Token> = waiting.tokens().collect();
        for token in &tokens {
            self.tokens.remove(token);
        }
        Some(Session {
            id: waiting.id,
            tokens,
            deadline: waiting.deadline,
        })
    }

    /// Removes the session at `at`, queuing each of its queue pairs but
    /// `except` for the driver to disconnect.
    fn drop_session(&mut self, at: usize, reason: DropReason, except: Option<Token>) -> u64 {
        let waiting = self.sessions.remove(at);
        for token in waiting.tokens() {
            self.tokens.remove(&token);
            if Some(token) != except {
                self.dropped.push_back(Dropped {
                    token,
                    session: waiting.id,
                    reason,
                });
            }
        }
        waiting.id
    }

    /// The driver found `token`'s connection disconnected (or failed):
    /// its connector gave up. Its whole session is dropped, the other
    /// queue pairs queued for [`Backlog::poll_dropped`]. Returns the
    /// session, or `None` for a token not waiting here.
    pub fn on_disconnected(&mut self, token: Token) -> Option<u64> {
        let session = *self.tokens.get(&token)?;
        let at = self.position(session)?;
        Some(self.drop_session(at, DropReason::Disconnected, Some(token)))
    }

    /// Expires every session whose deadline is at or before `now`
    /// (complete or not): its queue pairs are queued for
    /// [`Backlog::poll_dropped`].
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(at) = self.sessions.iter().position(|s| s.deadline <= now) {
            self.drop_session(at, DropReason::Expired, None);
        }
    }

    /// The earliest deadline of a waiting session: the driver calls
    /// [`Backlog::handle_timeout`] by then. `None`: nothing waits.
    ///
    /// Its answer changes only by [`Backlog::admit`] (a new session),
    /// [`Backlog::take_complete`], [`Backlog::on_disconnected`],
    /// [`Backlog::handle_timeout`] and [`Backlog::close`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.sessions.iter().map(|s| s.deadline).min()
    }

    /// The next queue pair to disconnect and forget, once each.
    ///
    /// New answers come only after [`Backlog::handle_timeout`],
    /// [`Backlog::on_disconnected`] and [`Backlog::close`]; call it until
    /// `None` after each.
    pub fn poll_dropped(&mut self) -> Option<Dropped> {
        self.dropped.pop_front()
    }

    /// The listener is gone: every session is dropped
    /// ([`DropReason::Closed`]) and every later arrival refused with
    /// [`SetupError::Closed`].
    pub fn close(&mut self) {
        self.closed = true;
        while !self.sessions.is_empty() {
            self.drop_session(0, DropReason::Closed, None);
        }
    }
}

// ---------------------------------------------------------------------------
// The connecting side.

/// Why a listener did not take a connection whose queue pairs all
/// connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotAccepted {
    /// Nobody accepted it within the connector's timeout (the listener's
    /// application was not in `accept`, or busy with other peers). Nothing
    /// of it remains on either side; connecting again succeeds once the
    /// listener accepts.
    #[error("nobody accepted it within {after:?}")]
    Timeout {
        /// The connector's timeout.
        after: Duration,
    },
    /// The listener disconnected it before accepting it: its backlog
    /// deadline passed, its listener closed, or its accept found the
    /// connection broken.
    #[error("the listener dropped it before accepting it")]
    Dropped,
}

/// How an acceptor's [`Hello`] disagrees with the connect it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReplyMismatch {
    /// A reply that is not an accept.
    #[error("the reply's role is {0:?}, not Accept")]
    Role(Role),
    /// Another session.
    #[error("the reply names session {got:#x}")]
    Session {
        /// The session it names.
        got: u64,
    },
    /// Another queue pair.
    #[error("the reply names queue pair {got}")]
    Index {
        /// The index it names.
        got: u16,
    },
    /// Another engine than the session's earlier queue pairs reached.
    #[error("the reply comes from engine {got:#x}, earlier ones from {first:#x}")]
    Engine {
        /// The engine of the earlier queue pairs.
        first: u64,
        /// The engine of this one.
        got: u64,
    },
}

/// Why a [`Dial`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DialError {
    /// The listener rejected queue pair `qp_index` ([`RejectReason::Busy`]:
    /// its backlog is full or it is closing; try again later).
    #[error("queue pair {qp_index} rejected: {reason}")]
    Rejected {
        /// The queue pair.
        qp_index: u16,
        /// The listener's reason.
        reason: RejectReason,
    },
    /// The acceptor's hello for queue pair `qp_index` does not answer it.
    #[error("queue pair {qp_index}: {mismatch}")]
    Reply {
        /// The queue pair.
        qp_index: u16,
        /// How it disagrees.
        mismatch: ReplyMismatch,
    },
    /// Every queue pair connected, but the listener did not accept.
    #[error("not accepted: {0}")]
    NotAccepted(NotAccepted),
    /// The timeout passed before every queue pair connected.
    #[error("{connected} of {qp_count} queue pairs connected within {after:?}")]
    ConnectTimeout {
        /// Queue pairs connected.
        connected: u16,
        /// Queue pairs the session has.
        qp_count: u16,
        /// The timeout.
        after: Duration,
    },
    /// The driver gave up on its own (an error of its I/O).
    #[error("aborted by the driver")]
    Aborted,
    /// An event the dial does not expect in its state (a driver bug): a
    /// queue pair reported after the dial ended, or an accept before
    /// every queue pair connected.
    #[error("an event out of order for the dial's state")]
    OutOfOrder,
}

/// Where a [`Dial`] stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialState {
    /// Connecting queue pair `next` (those before it are connected).
    Connecting {
        /// The index to connect next.
        next: u16,
    },
    /// Every queue pair is connected; waiting for the acceptor's paths,
    /// the sign that it accepted.
    AwaitingAccept,
    /// The listener accepted: the driver answers with its paths. A
    /// failure of that send is still the driver's [`Dial::abort`].
    Accepted,
    /// Failed: every queue pair connected is queued for teardown.
    Failed(DialError),
}

/// The connecting side of a session's set-up, in quinn-proto's shape: the
/// driver (the engine's connect) connects the queue pairs the dial names
/// and reports each outcome, the acceptor's paths, a gone peer and time;
/// the dial checks the replies, bounds the whole set-up by one deadline,
/// and on any failure names every queue pair to tear down.
#[derive(Debug)]
pub struct Dial {
    session: u64,
    qp_count: u16,
    timeout: Duration,
    deadline: Instant,
    /// The engine the first queue pair reached.
    acceptor: Option<u64>,
    /// Connected queue pairs, in index order.
    connected: Vec<Token>,
    state: DialState,
    teardown: VecDeque<Token>,
}

impl Dial {
    /// A dial of session `session` (nonzero, fresh) of `qp_count` queue
    /// pairs (at least 1), all of it bounded by `timeout` from `now`.
    pub fn new(session: u64, qp_count: u16, now: Instant, timeout: Duration) -> Self {
        Self {
            session,
            qp_count: qp_count.max(1),
            timeout,
            deadline: now + timeout,
            acceptor: None,
            connected: Vec::new(),
            state: DialState::Connecting { next: 0 },
            teardown: VecDeque::new(),
        }
    }

    /// The session id.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// The queue pairs the session has.
    pub fn qp_count(&self) -> u16 {
        self.qp_count
    }

    /// Where it stands.
    pub fn state(&self) -> DialState {
        self.state
    }

    /// The acceptor's engine id, once a queue pair connected.
    pub fn acceptor(&self) -> Option<u64> {
        self.acceptor
    }

    /// Time left before the deadline, at `now`.
    pub fn remaining(&self, now: Instant) -> Duration {
        self.deadline.saturating_duration_since(now)
    }

    /// The queue pair to connect next, while connecting.
    ///
    /// Its answer changes only by [`Dial::on_connected`] (the next index,
    /// or `None` after the last), and by any event that ends the dial.
    pub fn next_index(&self) -> Option<u16> {
        match self.state {
            DialState::Connecting { next } => Some(next),
            _ => None,
        }
    }

    /// The dial's deadline while it is undecided (connecting or awaiting
    /// accept): the driver calls [`Dial::handle_timeout`] by then.
    ///
    /// Its answer changes only by events that end the wait:
    /// [`Dial::on_accepted`] and every failure (`None` after them).
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            DialState::Connecting { .. } | DialState::AwaitingAccept => Some(self.deadline),
            DialState::Accepted | DialState::Failed(_) => None,
        }
    }

    /// The next connected queue pair to disconnect, once each, after a
    /// failure.
    ///
    /// New answers come only after an event that fails the dial (or a
    /// queue pair reported after it failed); call it until `None`.
    pub fn poll_teardown(&mut self) -> Option<Token> {
        self.teardown.pop_front()
    }

    fn fail(&mut self, error: DialError) -> DialError {
        if let DialState::Failed(first) = self.state {
            return first;
        }
        self.state = DialState::Failed(error);
        self.teardown.extend(self.connected.drain(..));
        error
    }

    /// Queue pair [`Dial::next_index`] connected as `token`, the acceptor
    /// answering with `reply`. A reply that does not answer it fails the
    /// dial (this queue pair is torn down with the others).
    pub fn on_connected(&mut self, token: Token, reply: &Hello) -> Result<(), DialError> {
        let DialState::Connecting { next } = self.state else {
            // Connected after the end: it goes too.
            self.teardown.push_back(token);
            return Err(match self.state {
                DialState::Failed(error) => error,
                _ => DialError::OutOfOrder,
            });
        };
        self.connected.push(token);
        let mismatch = if reply.role != Role::Accept {
            Some(ReplyMismatch::Role(reply.role))
        } else if reply.session != self.session {
            Some(ReplyMismatch::Session { got: reply.session })
        } else if reply.qp_index != next {
            Some(ReplyMismatch::Index {
                got: reply.qp_index,
            })
        } else {
            match self.acceptor {
                Some(first) if first != reply.engine => Some(ReplyMismatch::Engine {
                    first,
                    got: reply.engine,
                }),
                _ => None,
            }
        };
        if let Some(mismatch) = mismatch {
            return Err(self.fail(DialError::Reply {
                qp_index: next,
                mismatch,
            }));
        }
        self.acceptor = Some(reply.engine);
        self.state = if next + 1 == self.qp_count {
            DialState::AwaitingAccept
        } else {
            DialState::Connecting { next: next + 1 }
        };
        Ok(())
    }

    /// The listener rejected queue pair [`Dial::next_index`] with
    /// `reason`: the dial fails.
    pub fn on_rejected(&mut self, reason: RejectReason) -> DialError {
        match self.state {
            DialState::Connecting { next } => self.fail(DialError::Rejected {
                qp_index: next,
                reason,
            }),
            _ => self.fail(DialError::OutOfOrder),
        }
    }

    /// The acceptor's paths arrived: it accepted.
    pub fn on_accepted(&mut self) -> Result<(), DialError> {
        match self.state {
            DialState::AwaitingAccept => {
                self.state = DialState::Accepted;
                Ok(())
            }
            DialState::Accepted => Ok(()),
            DialState::Failed(error) => Err(error),
            DialState::Connecting { .. } => Err(self.fail(DialError::OutOfOrder)),
        }
    }

    /// The connection went down before the listener accepted it (it
    /// disconnected the queue pairs): [`NotAccepted::Dropped`].
    pub fn on_gone(&mut self) -> DialError {
        self.fail(DialError::NotAccepted(NotAccepted::Dropped))
    }

    /// The driver gave up on its own (a route, an rdma_cm error, a send
    /// that failed): the dial fails with [`DialError::Aborted`], unless it
    /// already failed.
    pub fn abort(&mut self) -> DialError {
        self.fail(DialError::Aborted)
    }

    /// Time passed: at or past the deadline, a dial still connecting fails
    /// with [`DialError::ConnectTimeout`], one awaiting accept with
    /// [`NotAccepted::Timeout`].
    pub fn handle_timeout(&mut self, now: Instant) {
        if now < self.deadline {
            return;
        }
        match self.state {
            DialState::Connecting { next } => {
                self.fail(DialError::ConnectTimeout {
                    connected: next,
                    qp_count: self.qp_count,
                    after: self.timeout,
                });
            }
            DialState::AwaitingAccept => {
                self.fail(DialError::NotAccepted(NotAccepted::Timeout {
                    after: self.timeout,
                }));
            }
            DialState::Accepted | DialState::Failed(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(10);

    fn config(max_sessions: usize) -> BacklogConfig {
        BacklogConfig {
            max_sessions,
            deadline: D,
            max_qps: MAX_QPS_PER_PEER,
        }
    }

    fn arrival(session: u64, qp_index: u16, qp_count: u16, token: u64) -> Arrival {
        Arrival {
            session,
            qp_index,
            qp_count,
            token: Token(token),
        }
    }

    fn drain(backlog: &mut Backlog) -> Vec<Dropped> {
        std::iter::from_fn(|| backlog.poll_dropped()).collect()
    }

    fn reply(session: u64, qp_index: u16, qp_count: u16, engine: u64) -> Hello {
        Hello {
            role: Role::Accept,
            engine,
            session,
            qp_index,
            qp_count,
            max_message: 4096,
            recv_depth: 8,
            max_slice: 1 << 20,
        }
    }

    #[test]
    fn a_session_completes_with_every_index_and_is_taken_in_index_order() {
        let t0 = Instant::now();
        let mut b = Backlog::new(config(4));
        assert_eq!(b.poll_timeout(), None);
        assert_eq!(
            b.admit(t0, arrival(7, 2, 3, 30)),
            Ok(Admitted::Waiting {
                arrived: 1,
                qp_count: 3
            })
        );
        assert_eq!(b.poll_timeout(), Some(t0 + D), "from the first queue pair");
        assert_eq!(
            b.admit(t0 + D / 2, arrival(7, 0, 3, 10)),
            Ok(Admitted::Waiting {
                arrived: 2,
                qp_count: 3
            })
        );
        assert_eq!(b.take_complete(), None, "index 1 is missing");
        assert_eq!(
            b.admit(t0 + D / 2, arrival(7, 1, 3, 20)),
            Ok(Admitted::Complete)
        );
        assert_eq!(b.poll_timeout(), Some(t0 + D), "the first's deadline still");
        assert_eq!((b.len(), b.queue_pairs()), (1, 3));
        assert_eq!(
            b.take_complete(),
            Some(Session {
                id: 7,
                tokens: vec![Token(10), Token(20), Token(30)],
                deadline: t0 + D,
            })
        );
        assert_eq!(b.take_complete(), None, "taken once");
        assert_eq!((b.len(), b.queue_pairs(), b.poll_timeout()), (0, 0, None));
        assert_eq!(b.poll_dropped(), None, "nothing to disconnect");
    }

    /// The engine's old `complete_session` cases: a repeated index does
    /// not stand in for another, and an index past the count is refused.
    #[test]
    fn a_repeated_index_or_one_out_of_range_is_refused_and_never_completes() {
        let t0 = Instant::now();
        let mut b = Backlog::new(config(4));
        b.admit(t0, arrival(7, 0, 2, 1)).unwrap();
        let repeated = arrival(7, 0, 2, 2);
        let err = SetupError::DuplicateIndex {
            session: 7,
            qp_index: 0,
        };
        assert_eq!(b.check(&repeated), Err(err));
        assert_eq!(b.admit(t0, repeated), Err(err));
        assert_eq!(err.reject_reason(), RejectReason::Malformed);
        assert_eq!(b.take_complete(), None);
        let past = arrival(7, 2, 2, 3);
        let err = SetupError::IndexOutOfRange {
            session: 7,
            qp_index: 2,
            qp_count: 2,
        };
        assert_eq!(b.admit(t0, past), Err(err));
        assert_eq!(err.reject_reason(), RejectReason::Malformed);
        assert!(matches!(
            b.admit(t0, arrival(8, 0, 0, 4)),
            Err(SetupError::IndexOutOfRange { qp_count: 0, .. })
        ));
        assert_eq!(b.take_complete(), None);
        assert_eq!(
            (b.len(), b.queue_pairs()),
            (1, 1),
            "refusals change nothing"
        );
        b.admit(t0, arrival(9, 0, 1, 5)).unwrap();
        assert_eq!(b.take_complete().map(|s| s.id), Some(9), "7 lacks index 1");
        b.admit(t0, arrival(7, 1, 2, 6)).unwrap();
        assert_eq!(
            b.take_complete().map(|s| s.tokens),
            Some(vec![Token(1), Token(6)])
        );
    }

    #[test]
    fn inconsistent_counts_duplicate_tokens_and_too_many_queue_pairs_are_refused_typed() {
        let t0 = Instant::now();
        let mut b = Backlog::new(BacklogConfig {
            max_qps: 4,
            ..config(4)
        });
        b.admit(t0, arrival(7, 0, 2, 1)).unwrap();
        let err = b.admit(t0, arrival(7, 1, 3, 2)).unwrap_err();
        assert_eq!(
            err,
            SetupError::CountMismatch {
                session: 7,
                expected: 2,
                got: 3
            }
        );
        assert_eq!(err.reject_reason(), RejectReason::Malformed);
        assert_eq!(
            b.admit(t0, arrival(8, 0, 1, 1)),
            Err(SetupError::DuplicateToken(Token(1)))
        );
        let err = b.admit(t0, arrival(9, 0, 5, 3)).unwrap_err();
        assert_eq!(
            err,
            SetupError::TooManyQps {
                session: 9,
                qp_count: 5,
                max: 4
            }
        );
        assert_eq!(err.reject_reason(), RejectReason::TooManyQps);
        assert_eq!((b.len(), b.queue_pairs()), (1, 1));
        assert_eq!(b.admit(t0, arrival(7, 1, 2, 2)), Ok(Admitted::Complete));
    }

    #[test]
    fn past_the_bound_a_new_session_is_refused_busy_but_its_own_queue_pairs_still_arrive() {
        let t0 = Instant::now();
        let mut b = Backlog::new(config(2));
        b.admit(t0, arrival(1, 0, 2, 1)).unwrap();
        b.admit(t0, arrival(2, 0, 2, 2)).unwrap();
        let third = arrival(3, 0, 2, 3);
        assert_eq!(b.check(&third), Err(SetupError::Busy { max: 2 }));
        assert_eq!(b.admit(t0, third), Err(SetupError::Busy { max: 2 }));
        assert_eq!(
            SetupError::Busy { max: 2 }.reject_reason(),
            RejectReason::Busy
        );
        // The bound counts sessions: the waiting ones complete.
        assert_eq!(b.admit(t0, arrival(2, 1, 2, 4)), Ok(Admitted::Complete));
        assert_eq!(b.admit(t0, third), Err(SetupError::Busy { max: 2 }));
        assert_eq!(b.take_complete().map(|s| s.id), Some(2));
        assert_eq!(
            b.admit(t0, third),
            Ok(Admitted::Waiting {
                arrived: 1,
                qp_count: 2
            }),
            "room again once one is taken"
        );
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn sessions_past_their_deadline_expire_and_their_queue_pairs_are_dropped() {
        let t0 = Instant::now();
        let mut b = Backlog::new(config(4));
        b.admit(t0, arrival(1, 0, 2, 1)).unwrap();
        b.admit(t0 + D / 2, arrival(1, 1, 2, 2)).unwrap();
        b.admit(t0 + D / 4, arrival(2, 0, 3, 3)).unwrap();
        assert_eq!(b.poll_timeout(), Some(t0 + D));
        b.handle_timeout(t0 + D - Duration::from_nanos(1));
        assert_eq!(b.poll_dropped(), None, "nothing before the deadline");
        b.handle_timeout(t0 + D);
        assert_eq!(
            drain(&mut b),
            [1, 2].map(|t| Dropped {
                token: Token(t),
                session: 1,
                reason: DropReason::Expired
            }),
            "a complete session not taken expires too"
        );
        assert_eq!(b.take_complete(), None);
        assert_eq!(b.poll_timeout(), Some(t0 + D / 4 + D));
        b.handle_timeout(t0 + 3 * D);
        assert_eq!(
            drain(&mut b),
            [Dropped {
                token: Token(3),
                session: 2,
                reason: DropReason::Expired
            }]
        );
        assert!(b.is_empty());
        assert_eq!((b.queue_pairs(), b.poll_timeout()), (0, None));
        assert_eq!(
            DropReason::Expired.to_string(),
            "not accepted before its deadline"
        );
    }

    #[test]
    fn a_session_completing_while_another_expires_is_taken_and_the_other_dropped() {
        let t0 = Instant::now();
        let mut b = Backlog::new(config(4));
        b.admit(t0, arrival(1, 0, 2, 1)).unwrap();
        b.admit(t0 + D / 2, arrival(2, 0, 2, 2)).unwrap();
        // At the first's deadline, the second completes, then time is
        // handled: the first goes, the second stays for accept.
        assert_eq!(b.admit(t0 + D, arrival(2, 1, 2, 3)), Ok(Admitted::Complete));
        b.handle_timeout(t0 + D);
        assert_eq!(
            drain(&mut b),
            [Dropped {
                token: Token(1),
                session: 1,
                reason: DropReason::Expired
            }]
        );
        assert_eq!(b.poll_timeout(), Some(t0 + D / 2 + D));
        let taken = b.take_complete().unwrap();
        assert_eq!((taken.id, taken.tokens), (2, vec![Token(2), Token(3)]));
        // A late queue pair of the expired session starts it afresh (it
        // will never complete and expires in its turn).
        assert_eq!(
            b.admit(t0 + D, arrival(1, 1, 2, 4)),
            Ok(Admitted::Waiting {
                arrived: 1,
                qp_count: 2
            })
        );
        assert_eq!(b.poll_timeout(), Some(t0 + 2 * D));
    }

    #[test]
    fn a_disconnect_mid_assembly_drops_the_session_and_its_other_queue_pairs() {
        let t0 = Instant::now();
        let mut b = Backlog::new(config(4));
        b.admit(t0, arrival(5, 0, 3, 1)).unwrap();
        b.admit(t0, arrival(5, 2, 3, 2)).unwrap();
        b.admit(t0, arrival(6, 0, 1, 3)).unwrap();
        assert_eq!(b.on_disconnected(Token(99)), None, "not waiting here");
        assert_eq!(b.poll_dropped(), None);
        assert_eq!(b.on_disconnected(Token(1)), Some(5));
        assert_eq!(
            drain(&mut b),
            [Dropped {
                token: Token(2),
                session: 5,
                reason: DropReason::Disconnected
            }],
            "the disconnected one is the driver's already"
        );
        assert_eq!(b.on_disconnected(Token(2)), None, "gone with its session");
        assert_eq!(
            b.admit(t0, arrival(5, 1, 3, 4)).unwrap(),
            Admitted::Waiting {
                arrived: 1,
                qp_count: 3
            }
        );
        // A complete session disconnected before accept is not taken.
        assert_eq!(b.on_disconnected(Token(3)), Some(6));
        assert_eq!(b.poll_dropped(), None);
        assert_eq!(b.take_complete(), None);
        assert_eq!(b.queue_pairs(), 1);
    }

    #[test]
    fn complete_sessions_are_taken_in_completion_order() {
        let t0 = Instant::now();
        let mut b = Backlog::new(config(4));
        b.admit(t0, arrival(1, 0, 2, 1)).unwrap();
        b.admit(t0, arrival(2, 0, 1, 2)).unwrap();
        b.admit(t0, arrival(3, 0, 1, 3)).unwrap();
        b.admit(t0, arrival(1, 1, 2, 4)).unwrap();
        let order: Vec<u64> = std::iter::from_fn(|| b.take_complete().map(|s| s.id)).collect();
        assert_eq!(order, [2, 3, 1]);
    }

    #[test]
    fn a_closed_backlog_drops_everything_and_refuses_new_queue_pairs_busy() {
        let t0 = Instant::now();
        let mut b = Backlog::new(config(4));
        b.admit(t0, arrival(1, 0, 2, 1)).unwrap();
        b.admit(t0, arrival(2, 0, 1, 2)).unwrap();
        b.close();
        assert!(b.is_closed());
        let dropped = drain(&mut b);
        assert_eq!(dropped.len(), 2);
        assert!(dropped.iter().all(|d| d.reason == DropReason::Closed));
        assert_eq!((b.len(), b.queue_pairs(), b.poll_timeout()), (0, 0, None));
        assert_eq!(b.take_complete(), None);
        let err = b.admit(t0, arrival(1, 1, 2, 3)).unwrap_err();
        assert_eq!(err, SetupError::Closed);
        assert_eq!(err.reject_reason(), RejectReason::Busy);
    }

    #[test]
    fn bounds_out_of_range_are_brought_into_range() {
        let b = Backlog::new(BacklogConfig {
            max_sessions: 0,
            deadline: Duration::ZERO,
            max_qps: 0,
        });
        assert_eq!(
            b.config(),
            BacklogConfig {
                max_sessions: 1,
                deadline: MIN_ACCEPT_DEADLINE,
                max_qps: 1
            }
        );
        let b = Backlog::new(BacklogConfig {
            max_sessions: usize::MAX,
            deadline: Duration::MAX,
            max_qps: u16::MAX,
        });
        assert_eq!(
            b.config(),
            BacklogConfig {
                max_sessions: MAX_BACKLOG,
                deadline: MAX_ACCEPT_DEADLINE,
                max_qps: MAX_QPS_PER_PEER
            }
        );
        assert_eq!(BacklogConfig::default().clamped(), BacklogConfig::default());
    }

    /// splitmix64, for the random walks.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Random arrivals (good and bad), disconnects, expiries, takes and a
    /// close: the bounds always hold, and every queue pair admitted ends
    /// exactly once: taken with its session, dropped for the driver to
    /// disconnect, or reported disconnected by the driver.
    #[test]
    fn property_every_admitted_queue_pair_ends_exactly_once_within_the_bounds() {
        for seed in 0..200 {
            let mut rng = Rng(seed);
            let t0 = Instant::now();
            let max_sessions = 1 + rng.below(4) as usize;
            let mut b = Backlog::new(BacklogConfig {
                max_sessions,
                deadline: D,
                max_qps: 4,
            });
            let mut now = t0;
            let mut admitted: Vec<Token> = Vec::new();
            let mut ended: Vec<Token> = Vec::new();
            let mut next_token = 0;
            for _ in 0..300 {
                match rng.below(10) {
                    0..=5 => {
                        let qp_count = 1 + rng.below(5) as u16;
                        let a = arrival(
                            1 + rng.below(6),
                            rng.below(u64::from(qp_count) + 1) as u16,
                            qp_count,
                            next_token,
                        );
                        next_token += 1;
                        let checked = b.check(&a);
                        let result = b.admit(now, a);
                        assert_eq!(result.map(|_| ()), checked, "check agrees with admit");
                        if result.is_ok() {
                            admitted.push(a.token);
                        }
                    }
                    6 => {
                        if !admitted.is_empty() {
                            let t = admitted[rng.below(admitted.len() as u64) as usize];
                            if b.on_disconnected(t).is_some() {
                                ended.push(t);
                            }
                        }
                    }
                    7 => {
                        now += D / (1 + rng.below(4) as u32);
                        b.handle_timeout(now);
                    }
                    8 => {
                        if let Some(s) = b.take_complete() {
                            assert_eq!(
                                s.tokens.len(),
                                s.tokens
                                    .iter()
                                    .collect::<std::collections::HashSet<_>>()
                                    .len()
                            );
                            ended.extend(s.tokens);
                        }
                    }
                    _ => {
                        if rng.below(20) == 0 {
                            b.close();
                        }
                    }
                }
                ended.extend(std::iter::from_fn(|| b.poll_dropped()).map(|d| d.token));
                assert!(b.len() <= max_sessions, "seed {seed}: the bound");
                if let Some(at) = b.poll_timeout() {
                    assert!(at > now, "seed {seed}: nothing past its deadline waits");
                    assert!(at <= now + D);
                }
            }
            b.close();
            ended.extend(std::iter::from_fn(|| b.poll_dropped()).map(|d| d.token));
            ended.sort();
            admitted.sort();
            assert_eq!(ended, admitted, "seed {seed}: each admitted one ends once");
        }
    }

    // -- The connecting side.

    const T: Duration = Duration::from_millis(300);

    fn teardown(d: &mut Dial) -> Vec<Token> {
        std::iter::from_fn(|| d.poll_teardown()).collect()
    }

    #[test]
    fn a_dial_connects_each_index_in_turn_then_waits_for_the_accept() {
        let t0 = Instant::now();
        let mut d = Dial::new(7, 2, t0, T);
        assert_eq!((d.next_index(), d.poll_timeout()), (Some(0), Some(t0 + T)));
        d.on_connected(Token(0), &reply(7, 0, 2, 42)).unwrap();
        assert_eq!(d.acceptor(), Some(42));
        assert_eq!(d.next_index(), Some(1));
        d.on_connected(Token(1), &reply(7, 1, 2, 42)).unwrap();
        assert_eq!(d.next_index(), None);
        assert_eq!(d.state(), DialState::AwaitingAccept);
        d.handle_timeout(t0 + T / 2);
        assert_eq!(d.state(), DialState::AwaitingAccept, "before the deadline");
        assert_eq!(d.remaining(t0 + T / 2), T / 2);
        d.on_accepted().unwrap();
        assert_eq!((d.state(), d.poll_timeout()), (DialState::Accepted, None));
        d.handle_timeout(t0 + T);
        assert_eq!(
            d.state(),
            DialState::Accepted,
            "accepted is not undone by time"
        );
        assert_eq!(teardown(&mut d), []);
        assert_eq!(Dial::new(1, 0, t0, T).qp_count(), 1);
    }

    #[test]
    fn nobody_accepting_within_the_timeout_is_a_typed_not_accepted_and_tears_everything_down() {
        let t0 = Instant::now();
        let mut d = Dial::new(7, 2, t0, T);
        d.on_connected(Token(10), &reply(7, 0, 2, 42)).unwrap();
        d.on_connected(Token(11), &reply(7, 1, 2, 42)).unwrap();
        d.handle_timeout(t0 + T);
        let error = DialError::NotAccepted(NotAccepted::Timeout { after: T });
        assert_eq!(d.state(), DialState::Failed(error));
        assert_eq!(d.poll_timeout(), None);
        assert_eq!(teardown(&mut d), [Token(10), Token(11)]);
        assert_eq!(teardown(&mut d), [], "once each");
        assert_eq!(d.on_accepted(), Err(error), "too late");
        assert_eq!(d.abort(), error, "the first failure stays");
        assert_eq!(teardown(&mut d), []);
    }

    #[test]
    fn a_dropped_connection_while_waiting_is_not_accepted_dropped() {
        let t0 = Instant::now();
        let mut d = Dial::new(7, 1, t0, T);
        d.on_connected(Token(1), &reply(7, 0, 1, 42)).unwrap();
        assert_eq!(d.on_gone(), DialError::NotAccepted(NotAccepted::Dropped));
        assert_eq!(teardown(&mut d), [Token(1)]);
    }

    #[test]
    fn a_reject_after_a_queue_pair_connected_tears_that_one_down() {
        let t0 = Instant::now();
        let mut d = Dial::new(7, 3, t0, T);
        d.on_connected(Token(1), &reply(7, 0, 3, 42)).unwrap();
        let error = d.on_rejected(RejectReason::Busy);
        assert_eq!(
            error,
            DialError::Rejected {
                qp_index: 1,
                reason: RejectReason::Busy
            }
        );
        assert_eq!(d.next_index(), None);
        assert_eq!(teardown(&mut d), [Token(1)]);
        // A connection reported after the end goes too.
        assert_eq!(d.on_connected(Token(2), &reply(7, 1, 3, 42)), Err(error));
        assert_eq!(teardown(&mut d), [Token(2)]);
    }

    #[test]
    fn replies_that_do_not_answer_the_connect_fail_it_typed() {
        let t0 = Instant::now();
        let cases = [
            (
                Hello {
                    role: Role::Connect,
                    ..reply(7, 1, 2, 42)
                },
                ReplyMismatch::Role(Role::Connect),
            ),
            (reply(8, 1, 2, 42), ReplyMismatch::Session { got: 8 }),
            (reply(7, 0, 2, 42), ReplyMismatch::Index { got: 0 }),
            (
                reply(7, 1, 2, 43),
                ReplyMismatch::Engine { first: 42, got: 43 },
            ),
        ];
        for (bad, mismatch) in cases {
            let mut d = Dial::new(7, 2, t0, T);
            d.on_connected(Token(1), &reply(7, 0, 2, 42)).unwrap();
            assert_eq!(
                d.on_connected(Token(2), &bad),
                Err(DialError::Reply {
                    qp_index: 1,
                    mismatch
                })
            );
            assert_eq!(teardown(&mut d), [Token(1), Token(2)], "{mismatch}");
        }
    }

    #[test]
    fn time_running_out_while_connecting_and_aborts_fail_the_dial() {
        let t0 = Instant::now();
        let mut d = Dial::new(7, 3, t0, T);
        d.on_connected(Token(1), &reply(7, 0, 3, 42)).unwrap();
        d.handle_timeout(t0 + 2 * T);
        assert_eq!(
            d.state(),
            DialState::Failed(DialError::ConnectTimeout {
                connected: 1,
                qp_count: 3,
                after: T
            })
        );
        assert_eq!(teardown(&mut d), [Token(1)]);

        let mut d = Dial::new(7, 1, t0, T);
        d.on_connected(Token(1), &reply(7, 0, 1, 42)).unwrap();
        d.on_accepted().unwrap();
        // Our own paths failed to go out: still torn down.
        assert_eq!(d.abort(), DialError::Aborted);
        assert_eq!(teardown(&mut d), [Token(1)]);

        let mut d = Dial::new(7, 2, t0, T);
        assert_eq!(d.on_accepted(), Err(DialError::OutOfOrder));
        assert_eq!(teardown(&mut d), []);
    }

    /// Both sides in memory, as the engine drives them: a connector whose
    /// listener's application is not in accept times out typed, tears its
    /// queue pairs down, and the listener drops the session on the first
    /// disconnect it sees: nothing is left to accept; a retry (a fresh
    /// session) is accepted.
    #[test]
    fn two_sides_nobody_in_accept_then_a_retry() {
        let t0 = Instant::now();
        let mut backlog = Backlog::new(config(4));
        // The connector's token i and the listener's token 100 + i name
        // the two ends of queue pair i.
        let dial_once = |backlog: &mut Backlog, session: u64, now: Instant| {
            let mut d = Dial::new(session, 2, now, T);
            while let Some(i) = d.next_index() {
                let a = arrival(session, i, 2, 100 * session + u64::from(i));
                backlog.check(&a).unwrap();
                backlog.admit(now, a).unwrap();
                d.on_connected(Token(u64::from(i)), &reply(session, i, 2, 42))
                    .unwrap();
            }
            d
        };
        let mut d = dial_once(&mut backlog, 1, t0);
        // Nobody accepts: the connector's deadline passes.
        d.handle_timeout(t0 + T);
        assert_eq!(
            d.state(),
            DialState::Failed(DialError::NotAccepted(NotAccepted::Timeout { after: T }))
        );
        let gone = teardown(&mut d);
        assert_eq!(gone, [Token(0), Token(1)]);
        // The listener sees the first disconnect and drops the rest.
        assert_eq!(backlog.on_disconnected(Token(100)), Some(1));
        let rest: Vec<Token> = drain(&mut backlog).iter().map(|d| d.token).collect();
        assert_eq!(rest, [Token(101)]);
        assert_eq!(backlog.take_complete(), None, "accept finds nothing");
        // The retry, with accept running.
        let mut d = dial_once(&mut backlog, 2, t0 + T);
        let session = backlog.take_complete().unwrap();
        assert_eq!(session.tokens, [Token(200), Token(201)]);
        d.on_accepted().unwrap();
        assert_eq!(d.state(), DialState::Accepted);
        assert!(backlog.is_empty());
    }
}
