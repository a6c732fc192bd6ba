//! The protocols together, two endpoints in memory (quinn-proto's `Pair`),
//! through the crate's public API only: a connector and an acceptor, each
//! a [`Connection`], joined by a link that carries encoded control
//! messages and can be cut. Set-up
//! (the dial against the listener's backlog, the paths as the sign of
//! acceptance), grants announced and revoked over the wire, control
//! messages through each side's outbox and inbox, batches on the queue
//! pairs (posted, completed, flushed, timed out), and queue pairs failing
//! and coming back (or not) through each side's recovery. No simulator, no
//! device, no clock: time is the pair's `now`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use gdr_proto::batches::{Action, BatchId, QpLimits, Requests, Work};
use gdr_proto::connection::{Connection, ConnectionConfig, Descriptor, Event, Received, Transmit};
use gdr_proto::reconnect::{self, Drained, GiveUp, Gone, OldQp, Replacement};
use gdr_proto::setup::{
    Admitted, Arrival, Backlog, BacklogConfig, Dial, DialError, DialState, NotAccepted, Token,
};
use gdr_proto::wire::{Control, Hello, Role};
use gdr_proto::{PeerLimits, PeerMisbehaved};

const QPS: u16 = 2;
const SESSION: u64 = 0x5e55;
const RECONNECT: Duration = Duration::from_secs(10);
const T: Duration = Duration::from_secs(1);

/// A work request as the pair posts it: its id (set when taken) and
/// length; batches and messages tell a number.
#[derive(Debug, Clone)]
struct Op {
    wr_id: u64,
    len: u32,
}

#[derive(Debug)]
struct Ops;

impl Requests for Ops {
    type Request = Op;
    type Error = String;
    type Notify = u64;
    type Hold = ();

    fn is_send(_: &Op) -> bool {
        false
    }
    fn len(request: &Op) -> u64 {
        u64::from(request.len)
    }
    fn number(request: &mut Op, wr_id: u64, _signaled: bool) {
        request.wr_id = wr_id;
    }
    fn flushed(qp: u16, cause: &String) -> String {
        format!("flushed on queue pair {qp}: {cause}")
    }
    fn timeout(after: Duration) -> String {
        format!("timed out after {after:?}")
    }
    fn cancelled() -> String {
        "cancelled".into()
    }
}

const QP_LIMITS: QpLimits = QpLimits {
    depth: 8,
    send_limit: 4,
    signal_every: 1,
};

/// Batches' outcomes as told: (token, outcome).
type Told = Vec<(u64, Result<(), String>)>;

/// One endpoint: what the engine keeps of its peer, as the protocols do.
struct Side {
    engine: u64,
    conn: Connection<PairDescriptor, Ops>,
    /// Which of its queue pairs is up (the driver's view of its core).
    up: [bool; QPS as usize],
    /// Tokens of its messages that went out, and of those that expired.
    sent: Vec<u64>,
    expired: Vec<u64>,
    next_token: u64,
    /// The peer misbehaved: dropped with this.
    dropped: Option<PeerMisbehaved>,
    accepted: bool,
}

impl Side {
    fn new(engine: u64, connector: bool) -> Self {
        let peer_engine = if engine == 0xa { 0xb } else { 0xa };
        let mut conn = Connection::new(&ConnectionConfig {
            peer_engine,
            session: SESSION,
            qp_count: QPS.into(),
            connector,
            reconnect_timeout: RECONNECT,
            peer_max_message: 4096,
            max_outbox: 8,
            limits: PeerLimits {
                max_remote_grants: 2,
                max_inbox_messages: 4,
                max_inbox_bytes: 1 << 16,
                ..PeerLimits::DEFAULT
            },
        });
        for index in 0..QPS {
            assert_eq!(
                conn.batches_mut().add_qp(index, QP_LIMITS),
                usize::from(index)
            );
        }
        Self {
            engine,
            conn,
            up: [true; QPS as usize],
            sent: Vec::new(),
            expired: Vec::new(),
            next_token: 1,
            dropped: None,
            accepted: false,
        }
    }

    fn hello(&self, role: Role, qp_index: u16) -> Hello {
        Hello {
            role,
            engine: self.engine,
            session: SESSION,
            qp_index,
            qp_count: QPS,
            max_message: 4096,
            recv_depth: 16,
            max_slice: 1 << 20,
        }
    }

    /// Queues `message` to go out within `timeout`; returns its token.
    fn send(&mut self, message: &Control<'_>, now: Instant, timeout: Duration) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        let bytes = message.encode().expect("encodes");
        self.conn
            .send(bytes, token, now, timeout)
            .expect("room in the outbox");
        token
    }

    /// What the driver does each step: expired messages end, the rest go
    /// out while queue pair 0 is up, in order.
    fn flush(&mut self, now: Instant, link: &mut VecDeque<Vec<u8>>) {
        while let Some(transmit) = self.conn.poll_transmit(now, self.up[0]) {
            match transmit {
                Transmit::Expired(late) => self.expired.push(late.token),
                Transmit::Send(message) => {
                    self.sent.push(message.token);
                    link.push_back(message.bytes);
                }
            }
        }
    }

    /// Submits a batch of one `len`-byte request on queue pair `qp`, told
    /// as `token`, to end within `timeout`.
    fn submit(
        &mut self,
        qp: usize,
        len: u32,
        token: u64,
        now: Instant,
        timeout: Duration,
    ) -> BatchId {
        let work = vec![(qp, Work::new(Op { wr_id: 0, len }))];
        self.conn
            .batches_mut()
            .submit(work, token, Some((now + timeout, timeout)), ())
    }

    /// Posts what queue pair `qp` may post now: the ids the NIC took.
    fn post(&mut self, qp: usize) -> Vec<u64> {
        let mut out = Vec::new();
        self.conn.batches_mut().take_postable(qp, &mut out);
        out.iter().map(|op| op.wr_id).collect()
    }

    /// The batches' actions so far: outcomes told (token, outcome), and the
    /// queue pairs that drained.
    fn settle(&mut self) -> (Told, Vec<usize>) {
        let (mut told, mut drained) = (Vec::new(), Vec::new());
        while let Some(action) = self.conn.batches_mut().poll_action() {
            match action {
                Action::End {
                    notify, outcome, ..
                } => told.push((notify, outcome)),
                Action::QpDrained(qp) => drained.push(qp),
                Action::StopQp(_) | Action::Release { .. } => {}
            }
        }
        (told, drained)
    }

    /// A message from the peer, as the engine's `on_message` takes it.
    fn receive(&mut self, bytes: &[u8]) {
        let message = Control::decode(bytes).expect("the peer's message decodes");
        match self.conn.on_control(message) {
            Ok(Received::Event(Event::PathsKnown)) => self.accepted = true,
            Ok(Received::Event(_) | Received::Stale) => {}
            Ok(Received::Other(other)) => panic!("unexpected {other:?}"),
            Err(why) => {
                self.dropped.get_or_insert(why);
            }
        }
    }
}

/// A grant descriptor as the pair announces it: the grant id, then the
/// owner's engine id, then padding.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PairDescriptor(Vec<u8>);

impl Descriptor for PairDescriptor {
    type Error = ();
    fn decode(bytes: &[u8]) -> Result<Self, ()> {
        (bytes.len() >= 16).then(|| Self(bytes.to_vec())).ok_or(())
    }
    fn owner(&self) -> u64 {
        u64::from_le_bytes(self.0[8..16].try_into().unwrap())
    }
    fn grant(&self) -> u64 {
        u64::from_le_bytes(self.0[..8].try_into().unwrap())
    }
}

/// The queue pairs a side gave up in one step, with why.
type GivenUp = Vec<(usize, GiveUp)>;

/// The connector `a`, the acceptor `b`, the link between them.
struct Pair {
    now: Instant,
    a: Side,
    b: Side,
    to_b: VecDeque<Vec<u8>>,
    to_a: VecDeque<Vec<u8>>,
}

impl Pair {
    /// A session set up: `a` dials `b`'s listener, every queue pair waits
    /// in the backlog until `accept` takes the session, whose paths tell
    /// `a` it was accepted.
    fn connected() -> Self {
        let now = Instant::now();
        let (mut a, mut b) = (Side::new(0xa, true), Side::new(0xb, false));
        let mut dial = Dial::new(SESSION, QPS, now, 5 * T);
        let mut backlog = Backlog::new(BacklogConfig::default());
        while let Some(index) = dial.next_index() {
            let token = Token(u64::from(index));
            let arrival = Arrival::of_hello(&a.hello(Role::Connect, index), token);
            backlog.check(&arrival).expect("the backlog takes it");
            let admitted = backlog.admit(now, arrival).expect("admitted");
            assert_eq!(
                admitted == Admitted::Complete,
                index + 1 == QPS,
                "complete with its last queue pair"
            );
            dial.on_connected(token, &b.hello(Role::Accept, index))
                .expect("the reply answers the dial");
        }
        assert_eq!(dial.state(), DialState::AwaitingAccept);
        let session = backlog.take_complete().expect("a complete session");
        assert_eq!(session.id, SESSION);
        assert_eq!(session.tokens.len(), usize::from(QPS));
        let (mut to_a, mut to_b) = (VecDeque::new(), VecDeque::new());
        // `accept` sends its paths first; they are the connector's sign.
        b.send(&Control::Paths { devices: b"n0,n0" }, now, T);
        b.flush(now, &mut to_a);
        while let Some(bytes) = to_a.pop_front() {
            a.receive(&bytes);
        }
        assert!(a.accepted);
        dial.on_accepted().expect("accepted");
        a.send(&Control::Paths { devices: b"n0,n0" }, now, T);
        a.flush(now, &mut to_b);
        a.conn.recovery_mut().establish();
        b.conn.recovery_mut().establish();
        let mut pair = Self {
            now,
            a,
            b,
            to_b,
            to_a,
        };
        pair.deliver();
        assert!(pair.b.accepted);
        pair
    }

    /// Every message on the link arrives, in order.
    fn deliver(&mut self) {
        self.a.flush(self.now, &mut self.to_b);
        self.b.flush(self.now, &mut self.to_a);
        while let Some(bytes) = self.to_b.pop_front() {
            self.b.receive(&bytes);
        }
        while let Some(bytes) = self.to_a.pop_front() {
            self.a.receive(&bytes);
        }
    }

    /// Queue pair `index` fails on both sides and drains (what was on the
    /// link for it is lost); each side's recovery says what comes next.
    fn fail(&mut self, index: usize) -> (Drained, Drained) {
        if index == 0 {
            self.to_a.clear();
            self.to_b.clear();
        }
        self.a.up[index] = false;
        self.b.up[index] = false;
        let now = self.now;
        (
            self.a
                .conn
                .recovery_mut()
                .on_drained(index, now, false, false),
            self.b
                .conn
                .recovery_mut()
                .on_drained(index, now, false, false),
        )
    }

    /// The connector's dial of queue pair `index` reaches the acceptor,
    /// whose old one drained: both install the new connection.
    fn redial(&mut self, index: usize) {
        assert!(
            self.a
                .conn
                .recovery_mut()
                .time_left(index, self.now)
                .is_some(),
            "still wanted"
        );
        assert_eq!(
            self.b
                .conn
                .recovery_mut()
                .on_replacement(index, OldQp::Reconnecting),
            Replacement::Install
        );
        let reply = self.b.hello(Role::Accept, index as u16);
        reconnect::check_reply(&reply, SESSION, index, self.b.engine).expect("answers the dial");
        assert!(self.b.conn.recovery_mut().installed(index));
        assert!(self.a.conn.recovery_mut().installed(index));
        self.a.up[index] = true;
        self.b.up[index] = true;
    }

    /// Time passes: deadlines are handled on both sides, each through its
    /// connection (batches and re-establishment alike).
    fn advance(&mut self, by: Duration) -> (GivenUp, GivenUp) {
        self.now += by;
        (
            self.a.conn.handle_timeout(self.now),
            self.b.conn.handle_timeout(self.now),
        )
    }
}

fn announce(grant: u64, owner: u64) -> Vec<u8> {
    let mut descriptor = grant.to_le_bytes().to_vec();
    descriptor.extend_from_slice(&owner.to_le_bytes());
    descriptor.extend_from_slice(&[0; 16]);
    descriptor
}

#[test]
fn a_session_carries_grants_and_messages_both_ways() {
    let mut p = Pair::connected();
    let now = p.now;
    let descriptor = announce(7, 0xb);
    p.b.send(
        &Control::GrantAnnounce {
            descriptor: &descriptor,
        },
        now,
        T,
    );
    p.a.send(&Control::User(b"hello"), now, T);
    p.deliver();
    assert_eq!(p.a.conn.remote_grant(7).map(|d| &d.0), Some(&descriptor));
    assert_eq!(p.b.conn.receive().as_deref(), Some(&b"hello"[..]));
    p.b.send(&Control::GrantRevoke { grant: 7 }, now, T);
    p.deliver();
    assert_eq!(p.a.conn.remote_grant(7), None, "revoked over the wire");
}

#[test]
fn messages_wait_out_a_failed_queue_pair_0_and_go_in_order_once_it_is_back() {
    let mut p = Pair::connected();
    let (a, b) = p.fail(0);
    assert!(matches!(a, Drained::Reconnect { dial: true, .. }), "{a:?}");
    assert!(matches!(b, Drained::Reconnect { dial: false, .. }), "{b:?}");
    let now = p.now;
    let first = p.a.send(&Control::User(b"one"), now, 5 * T);
    let short = p.a.send(&Control::User(b"two"), now, T);
    let third = p.a.send(&Control::User(b"three"), now, 5 * T);
    p.deliver();
    assert!(p.a.sent.iter().all(|t| ![first, short, third].contains(t)));
    assert_eq!(
        p.b.conn.inbox_len().0,
        0,
        "nothing goes while queue pair 0 is down"
    );
    // The first is still live: the short one behind it waits its turn
    // (messages go in order), and expires once it is at the front.
    p.advance(2 * T);
    p.redial(0);
    p.deliver();
    assert_eq!(p.a.expired, [short], "only the one past its deadline");
    let got: Vec<Vec<u8>> = std::iter::from_fn(|| p.b.conn.receive()).collect();
    assert_eq!(got, [b"one".to_vec(), b"three".to_vec()], "in order");
    assert_eq!(p.a.conn.recovery_mut().reconnecting(), 0);
    assert_eq!(p.a.conn.recovery_mut().poll_gone(), None);
}

#[test]
fn batches_on_a_failed_queue_pair_end_once_and_new_work_waits_for_it_to_come_back() {
    let mut p = Pair::connected();
    let now = p.now;
    // Posted on queue pair 1 when its link is cut: it flushes, told once.
    p.a.submit(1, 4096, 1, now, 5 * T);
    let posted = p.a.post(1);
    assert_eq!(posted.len(), 1);
    p.a.conn.batches_mut().fail_qp(1, "link cut".into());
    p.a.conn
        .batches_mut()
        .on_completion(1, posted[0], Err("flush".into()));
    let (told, drained) = p.a.settle();
    assert_eq!(told.len(), 1, "{told:?}");
    assert_eq!(told[0].0, 1);
    assert!(told[0].1.as_ref().is_err_and(|e| e.contains("link cut")));
    assert_eq!(drained, [1]);
    let (a, _) = p.fail(1);
    assert!(matches!(a, Drained::Reconnect { dial: true, .. }), "{a:?}");
    assert!(p.a.conn.batches_mut().begin_reconnect(1));
    // Submitted while it comes back: it waits, and its deadline and the
    // re-establishment's are the connection's.
    p.a.submit(1, 4096, 2, now, 3 * T);
    p.a.submit(1, 4096, 3, now, RECONNECT + T);
    assert!(p.a.post(1).is_empty(), "nothing posts on a queue pair down");
    assert_eq!(p.a.conn.poll_timeout(), Some(now + 3 * T));
    // The first one's deadline passes before the queue pair is back.
    let (given_up, _) = p.advance(3 * T);
    assert!(given_up.is_empty());
    let (told, _) = p.a.settle();
    assert_eq!(told.len(), 1, "{told:?}");
    assert_eq!(told[0].0, 2);
    assert!(told[0].1.as_ref().is_err_and(|e| e.contains("timed out")));
    assert_eq!(p.a.conn.poll_timeout(), Some(now + RECONNECT), "the dial's");
    // Back: the other one goes, and ends once its completion comes.
    p.redial(1);
    p.a.conn.batches_mut().revive(1, QP_LIMITS);
    let posted = p.a.post(1);
    assert_eq!(posted.len(), 1);
    p.a.conn.batches_mut().on_completion(1, posted[0], Ok(()));
    let (told, _) = p.a.settle();
    assert_eq!(told, [(3, Ok(()))]);
    assert_eq!(p.a.conn.poll_timeout(), None, "nothing left to time");
    assert_eq!(p.a.conn.batches().batches_live(), 0);
}

#[test]
fn every_queue_pair_not_back_in_time_leaves_both_sides_without_the_peer() {
    let mut p = Pair::connected();
    p.fail(0);
    p.advance(RECONNECT / 2);
    p.fail(1);
    let (a, b) = p.advance(RECONNECT / 2);
    let late0 = GiveUp::Late {
        index: 0,
        after: RECONNECT,
    };
    assert_eq!((a, b), (vec![(0, late0.clone())], vec![(0, late0)]));
    assert_eq!(
        p.a.conn.recovery_mut().poll_gone(),
        None,
        "queue pair 1 may come back"
    );
    // A dial of queue pair 0 that comes back now is not wanted.
    assert_eq!(p.a.conn.recovery_mut().time_left(0, p.now), None);
    assert_eq!(
        p.b.conn.recovery_mut().on_replacement(0, OldQp::Down),
        Replacement::Refuse
    );
    let (a, b) = p.advance(RECONNECT / 2);
    assert_eq!((a.len(), b.len()), (1, 1));
    let late1 = GiveUp::Late {
        index: 1,
        after: RECONNECT,
    };
    assert_eq!(
        p.a.conn.recovery_mut().poll_gone(),
        Some(Gone::GivenUp(late1.clone()))
    );
    assert_eq!(
        p.b.conn.recovery_mut().poll_gone(),
        Some(Gone::GivenUp(late1))
    );
}

#[test]
fn a_peer_flooding_messages_nobody_receives_is_dropped_and_grants_stay_bounded() {
    let mut p = Pair::connected();
    let now = p.now;
    for _ in 0..5 {
        p.b.send(&Control::User(b"x"), now, T);
    }
    let (d1, d2, d3) = (announce(1, 0xb), announce(2, 0xb), announce(3, 0xb));
    for descriptor in [&d1, &d2, &d3] {
        p.b.send(&Control::GrantAnnounce { descriptor }, now, T);
    }
    p.deliver();
    assert_eq!(p.a.conn.inbox_len().0, 4, "the inbox holds its bound");
    assert_eq!(
        p.a.dropped,
        Some(PeerMisbehaved::TooManyMessages { max: 4 }),
        "the first bound crossed names why"
    );
    assert_eq!(
        p.a.conn.remote_grants(),
        2,
        "the grant table holds its bound"
    );
}

#[test]
fn a_grant_of_another_engine_drops_the_peer_and_goodbye_forgets_its_grants() {
    let mut p = Pair::connected();
    let now = p.now;
    let (own, foreign) = (announce(1, 0xb), announce(2, 0xa));
    p.b.send(&Control::GrantAnnounce { descriptor: &own }, now, T);
    p.deliver();
    assert_eq!(p.a.conn.remote_grants(), 1);
    assert_eq!(p.a.dropped, None);
    p.b.send(
        &Control::GrantAnnounce {
            descriptor: &foreign,
        },
        now,
        T,
    );
    p.b.send(&Control::Goodbye, now, T);
    p.deliver();
    assert_eq!(
        p.a.dropped,
        Some(PeerMisbehaved::ForeignGrant {
            owner: 0xa,
            peer: 0xb
        })
    );
    assert!(p.a.conn.said_goodbye());
    assert_eq!(
        p.a.conn.remote_grants(),
        0,
        "its grants went with its goodbye"
    );
}

#[test]
fn a_connect_nobody_accepts_fails_typed_and_leaves_nothing_in_the_backlog() {
    // Finding 4 of the issue at the protocol level: the dial times out,
    // tears every queue pair down, and the listener forgets them.
    let now = Instant::now();
    let a = Side::new(0xa, true);
    let b = Side::new(0xb, false);
    let mut dial = Dial::new(SESSION, QPS, now, T);
    let mut backlog = Backlog::new(BacklogConfig::default());
    while let Some(index) = dial.next_index() {
        let token = Token(u64::from(index));
        backlog
            .admit(
                now,
                Arrival::of_hello(&a.hello(Role::Connect, index), token),
            )
            .unwrap();
        dial.on_connected(token, &b.hello(Role::Accept, index))
            .unwrap();
    }
    dial.handle_timeout(now + T);
    assert_eq!(
        dial.state(),
        DialState::Failed(DialError::NotAccepted(NotAccepted::Timeout { after: T }))
    );
    let mut torn_down = 0;
    while let Some(token) = dial.poll_teardown() {
        // The connector disconnects; the listener hears it.
        backlog.on_disconnected(token);
        torn_down += 1;
    }
    assert_eq!(torn_down, QPS);
    assert_eq!(backlog.queue_pairs(), 0, "nothing waits for accept");
    assert!(
        backlog.take_complete().is_none(),
        "accept gets no abandoned peer"
    );
}
