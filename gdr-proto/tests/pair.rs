//! The protocols together, two endpoints in memory (quinn-proto's `Pair`),
//! through the crate's public API only: a connector and an acceptor joined
//! by a link that carries encoded control messages and can be cut. Set-up
//! (the dial against the listener's backlog, the paths as the sign of
//! acceptance), grants announced and revoked over the wire, control
//! messages through each side's outbox and inbox, and queue pairs failing
//! and coming back (or not) through each side's recovery. No simulator, no
//! device, no clock: time is the pair's `now`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use gdr_proto::PeerMisbehaved;
use gdr_proto::grants::RemoteGrants;
use gdr_proto::inbox::Inbox;
use gdr_proto::outbox::Outbox;
use gdr_proto::reconnect::{self, Drained, GiveUp, Gone, OldQp, Recovery, Replacement};
use gdr_proto::setup::{
    Admitted, Arrival, Backlog, BacklogConfig, Dial, DialError, DialState, NotAccepted, Token,
};
use gdr_proto::wire::{Control, Hello, Role};

const QPS: u16 = 2;
const SESSION: u64 = 0x5e55;
const RECONNECT: Duration = Duration::from_secs(10);
const T: Duration = Duration::from_secs(1);

/// One endpoint: what the engine keeps of its peer, as the protocols do.
struct Side {
    engine: u64,
    recovery: Recovery,
    /// Which of its queue pairs is up (the driver's view of its core).
    up: [bool; QPS as usize],
    outbox: Outbox<u64>,
    inbox: Inbox,
    remote: RemoteGrants<Vec<u8>>,
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
        Self {
            engine,
            recovery: Recovery::new(QPS.into(), connector, RECONNECT),
            up: [true; QPS as usize],
            outbox: Outbox::new(8),
            inbox: Inbox::new(4, 1 << 16),
            remote: RemoteGrants::new(2),
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
        self.outbox
            .push(bytes, token, now, timeout)
            .expect("room in the outbox");
        token
    }

    /// What the driver does each step: expired messages end, the rest go
    /// out while queue pair 0 is up, in order.
    fn flush(&mut self, now: Instant, link: &mut VecDeque<Vec<u8>>) {
        while !self.outbox.is_empty() {
            if let Some(late) = self.outbox.poll_expired(now) {
                self.expired.push(late.token);
                continue;
            }
            if !self.up[0] {
                break;
            }
            let message = self.outbox.pop().expect("not empty");
            self.sent.push(message.token);
            link.push_back(message.bytes);
        }
    }

    /// A message from the peer, as the engine's `on_message` takes it.
    fn receive(&mut self, bytes: &[u8]) {
        let result = match Control::decode(bytes).expect("the peer's message decodes") {
            Control::User(payload) => self.inbox.push(payload.to_vec()),
            Control::GrantAnnounce { descriptor } => {
                let id = u64::from_le_bytes(descriptor[..8].try_into().unwrap());
                self.remote.announce(id, descriptor.to_vec())
            }
            Control::GrantRevoke { grant } => {
                self.remote.revoke(grant);
                Ok(())
            }
            Control::Paths { .. } => {
                self.accepted = true;
                Ok(())
            }
            other => panic!("unexpected {other:?}"),
        };
        if let Err(why) = result {
            self.dropped.get_or_insert(why);
        }
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
        a.recovery.establish();
        b.recovery.establish();
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
            self.a.recovery.on_drained(index, now, false, false),
            self.b.recovery.on_drained(index, now, false, false),
        )
    }

    /// The connector's dial of queue pair `index` reaches the acceptor,
    /// whose old one drained: both install the new connection.
    fn redial(&mut self, index: usize) {
        assert!(
            self.a.recovery.time_left(index, self.now).is_some(),
            "still wanted"
        );
        assert_eq!(
            self.b.recovery.on_replacement(index, OldQp::Reconnecting),
            Replacement::Install
        );
        let reply = self.b.hello(Role::Accept, index as u16);
        reconnect::check_reply(&reply, SESSION, index, self.b.engine).expect("answers the dial");
        assert!(self.b.recovery.installed(index));
        assert!(self.a.recovery.installed(index));
        self.a.up[index] = true;
        self.b.up[index] = true;
    }

    /// Time passes: deadlines are handled on both sides.
    fn advance(&mut self, by: Duration) -> (GivenUp, GivenUp) {
        self.now += by;
        (
            self.a.recovery.handle_timeout(self.now),
            self.b.recovery.handle_timeout(self.now),
        )
    }
}

fn announce(grant: u64) -> Vec<u8> {
    let mut descriptor = grant.to_le_bytes().to_vec();
    descriptor.extend_from_slice(&[0; 24]);
    descriptor
}

#[test]
fn a_session_carries_grants_and_messages_both_ways() {
    let mut p = Pair::connected();
    let now = p.now;
    let descriptor = announce(7);
    p.b.send(
        &Control::GrantAnnounce {
            descriptor: &descriptor,
        },
        now,
        T,
    );
    p.a.send(&Control::User(b"hello"), now, T);
    p.deliver();
    assert_eq!(p.a.remote.get(7), Some(&descriptor));
    assert_eq!(p.b.inbox.pop().as_deref(), Some(&b"hello"[..]));
    p.b.send(&Control::GrantRevoke { grant: 7 }, now, T);
    p.deliver();
    assert_eq!(p.a.remote.get(7), None, "revoked over the wire");
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
        p.b.inbox.len(),
        0,
        "nothing goes while queue pair 0 is down"
    );
    // The first is still live: the short one behind it waits its turn
    // (messages go in order), and expires once it is at the front.
    p.advance(2 * T);
    p.redial(0);
    p.deliver();
    assert_eq!(p.a.expired, [short], "only the one past its deadline");
    let got: Vec<Vec<u8>> = std::iter::from_fn(|| p.b.inbox.pop()).collect();
    assert_eq!(got, [b"one".to_vec(), b"three".to_vec()], "in order");
    assert_eq!(p.a.recovery.reconnecting(), 0);
    assert_eq!(p.a.recovery.poll_gone(), None);
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
    assert_eq!(p.a.recovery.poll_gone(), None, "queue pair 1 may come back");
    // A dial of queue pair 0 that comes back now is not wanted.
    assert_eq!(p.a.recovery.time_left(0, p.now), None);
    assert_eq!(
        p.b.recovery.on_replacement(0, OldQp::Down),
        Replacement::Refuse
    );
    let (a, b) = p.advance(RECONNECT / 2);
    assert_eq!((a.len(), b.len()), (1, 1));
    let late1 = GiveUp::Late {
        index: 1,
        after: RECONNECT,
    };
    assert_eq!(p.a.recovery.poll_gone(), Some(Gone::GivenUp(late1.clone())));
    assert_eq!(p.b.recovery.poll_gone(), Some(Gone::GivenUp(late1)));
}

#[test]
fn a_peer_flooding_messages_nobody_receives_is_dropped_and_grants_stay_bounded() {
    let mut p = Pair::connected();
    let now = p.now;
    for _ in 0..5 {
        p.b.send(&Control::User(b"x"), now, T);
    }
    let (d1, d2, d3) = (announce(1), announce(2), announce(3));
    for descriptor in [&d1, &d2, &d3] {
        p.b.send(&Control::GrantAnnounce { descriptor }, now, T);
    }
    p.deliver();
    assert_eq!(p.a.inbox.len(), 4, "the inbox holds its bound");
    assert_eq!(
        p.a.dropped,
        Some(PeerMisbehaved::TooManyMessages { max: 4 }),
        "the first bound crossed names why"
    );
    assert_eq!(p.a.remote.len(), 2, "the grant table holds its bound");
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
