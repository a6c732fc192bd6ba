use super::*;
use crate::batches::{Action, QpLimits, Work};
use crate::reconnect::Drained;
use crate::rendezvous::{AskFailure, RequesterAction};

const T: Duration = Duration::from_secs(1);
const PEER: u64 = 0xb;

/// A descriptor as the tests announce it: the grant id, then the owner.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TestDescriptor {
    grant: GrantId,
    owner: u64,
}

impl Descriptor for TestDescriptor {
    type Error = &'static str;
    fn decode(bytes: &[u8]) -> Result<Self, Self::Error> {
        let (grant, owner) = match bytes {
            [g @ .., _, _, _, _, _, _, _, _] if g.len() == 8 => (g, &bytes[8..]),
            _ => return Err("not 16 bytes"),
        };
        Ok(Self {
            grant: u64::from_le_bytes(grant.try_into().unwrap()),
            owner: u64::from_le_bytes(owner.try_into().unwrap()),
        })
    }
    fn owner(&self) -> u64 {
        self.owner
    }
    fn grant(&self) -> GrantId {
        self.grant
    }
}

fn descriptor(grant: GrantId, owner: u64) -> Vec<u8> {
    let mut bytes = grant.to_le_bytes().to_vec();
    bytes.extend_from_slice(&owner.to_le_bytes());
    bytes
}

fn config() -> ConnectionConfig {
    ConnectionConfig {
        peer_engine: PEER,
        session: 7,
        qp_count: 2,
        connector: true,
        reconnect_timeout: 10 * T,
        peer_max_message: 64,
        max_outbox: 3,
        limits: PeerLimits {
            max_remote_grants: 2,
            max_inbox_messages: 2,
            max_inbox_bytes: 1 << 10,
            ..PeerLimits::DEFAULT
        },
    }
}

/// Requests as the tests post them: a length; a batch and a message tell
/// a number.
#[derive(Debug)]
struct Ops;

impl Requests for Ops {
    type Request = u32;
    type Error = String;
    type Notify = u32;
    type Hold = ();

    fn is_send(_: &u32) -> bool {
        false
    }
    fn len(request: &u32) -> u64 {
        u64::from(*request)
    }
    fn number(_: &mut u32, _: u64, _: bool) {}
    fn flushed(qp: u16, cause: &String) -> String {
        format!("flushed on {qp}: {cause}")
    }
    fn timeout(after: Duration) -> String {
        format!("timed out after {after:?}")
    }
    fn cancelled() -> String {
        "cancelled".into()
    }
}

type TestConnection = Connection<TestDescriptor, Ops>;

fn connection() -> TestConnection {
    Connection::new(&config())
}

fn event(c: &mut TestConnection, m: Control<'_>) -> Event {
    match c.on_control(m) {
        Ok(Received::Event(e)) => e,
        other => panic!("not an event: {other:?}"),
    }
}

#[test]
fn the_peers_grants_come_and_go_by_its_messages() {
    let mut c = connection();
    let d = descriptor(5, PEER);
    assert_eq!(
        event(&mut c, Control::GrantAnnounce { descriptor: &d }),
        Event::GrantAnnounced(5)
    );
    assert_eq!(c.remote_grant(5).map(|d| d.grant), Some(5));
    assert_eq!(
        event(&mut c, Control::GrantRevoke { grant: 5 }),
        Event::GrantRevoked(5)
    );
    assert_eq!(c.remote_grant(5), None);
    assert!(
        matches!(
            c.on_control(Control::GrantRevoke { grant: 5 }),
            Ok(Received::Stale)
        ),
        "a second revoke changes nothing"
    );
    assert!(matches!(
        c.on_control(Control::GrantRevoke { grant: 99 }),
        Ok(Received::Stale)
    ));
}

#[test]
fn a_foreign_or_malformed_grant_drops_the_peer() {
    let mut c = connection();
    let foreign = descriptor(1, 0xdead);
    assert_eq!(
        c.on_control(Control::GrantAnnounce {
            descriptor: &foreign
        })
        .unwrap_err(),
        PeerMisbehaved::ForeignGrant {
            owner: 0xdead,
            peer: PEER
        }
    );
    assert_eq!(
        c.on_control(Control::GrantAnnounce {
            descriptor: &[1, 2]
        })
        .unwrap_err(),
        PeerMisbehaved::MalformedGrant
    );
    assert_eq!(c.remote_grants(), 0, "neither was kept");
}

#[test]
fn what_the_peer_makes_this_side_hold_stays_bounded() {
    let mut c = connection();
    for grant in 1..=2 {
        let d = descriptor(grant, PEER);
        event(&mut c, Control::GrantAnnounce { descriptor: &d });
    }
    let third = descriptor(3, PEER);
    assert_eq!(
        c.on_control(Control::GrantAnnounce { descriptor: &third })
            .unwrap_err(),
        PeerMisbehaved::TooManyGrants { max: 2 }
    );
    assert_eq!(c.remote_grants(), 2);
    event(&mut c, Control::User(b"a"));
    event(&mut c, Control::User(b"b"));
    assert_eq!(
        c.on_control(Control::User(b"c")).unwrap_err(),
        PeerMisbehaved::TooManyMessages { max: 2 }
    );
    assert_eq!(c.inbox_len(), (2, 2));
    assert_eq!(c.receive().as_deref(), Some(&b"a"[..]));
}

#[test]
fn goodbye_forgets_the_peers_grants_and_refuses_sends() {
    let mut c = connection();
    let d = descriptor(1, PEER);
    event(&mut c, Control::GrantAnnounce { descriptor: &d });
    assert_eq!(event(&mut c, Control::Goodbye), Event::Goodbye);
    assert!(c.said_goodbye());
    assert_eq!(c.remote_grants(), 0);
    assert_eq!(
        c.send(vec![1], 9, Instant::now(), T),
        Err((SendRefused::Goodbye, 9))
    );
}

#[test]
fn paths_name_the_peers_device_per_queue_pair() {
    let mut c = connection();
    assert!(!c.paths_known());
    assert_eq!(
        event(&mut c, Control::Paths { devices: b"m0,m1" }),
        Event::PathsKnown
    );
    assert!(c.paths_known());
    assert_eq!(c.remote_device(1), Some("m1"));
    assert_eq!(c.remote_device(2), None);
}

#[test]
fn other_protocols_messages_come_back() {
    let mut c = connection();
    assert!(matches!(
        c.on_control(Control::GrantReleased { grant: 3 }),
        Ok(Received::Other(Control::GrantReleased { grant: 3 }))
    ));
}

#[test]
fn sends_are_refused_whole_past_a_bound_and_go_in_order() {
    let now = Instant::now();
    let mut c = connection();
    assert_eq!(
        c.send(vec![0; 65], 1, now, T),
        Err((SendRefused::TooLarge { len: 65, max: 64 }, 1))
    );
    for token in 1..=3 {
        c.send(vec![token as u8], token, now, T).unwrap();
    }
    assert_eq!(
        c.send(vec![4], 4, now, T),
        Err((SendRefused::Full(OutboxFull { max: 3 }), 4))
    );
    assert!(c.poll_transmit(now, false).is_none(), "no slot: nothing");
    let sent: Vec<u32> = std::iter::from_fn(|| match c.poll_transmit(now, true) {
        Some(Transmit::Send(w)) => Some(w.token),
        _ => None,
    })
    .collect();
    assert_eq!(sent, [1, 2, 3]);
}

#[test]
fn one_timeout_covers_the_outbox_and_the_recovery() {
    let now = Instant::now();
    let mut c = connection();
    c.recovery_mut().establish();
    assert_eq!(c.poll_timeout(), None);
    c.send(vec![1], 1, now, 3 * T).unwrap();
    assert_eq!(c.poll_timeout(), Some(now + 3 * T), "the waiting message");
    let drained = c.recovery_mut().on_drained(1, now, false, false);
    assert!(matches!(drained, Drained::Reconnect { .. }), "{drained:?}");
    assert_eq!(
        c.poll_timeout(),
        Some(now + 3 * T),
        "the earlier of the two"
    );
    match c.poll_transmit(now + 3 * T, false) {
        Some(Transmit::Expired(w)) => assert_eq!(w.token, 1),
        other => panic!("not expired: {other:?}"),
    }
    assert_eq!(
        c.poll_timeout(),
        Some(now + 10 * T),
        "the re-establishment's deadline"
    );
    assert_eq!(c.handle_timeout(now + 9 * T), []);
    assert_eq!(c.handle_timeout(now + 10 * T).len(), 1);
    assert_eq!(c.poll_timeout(), None);
}

#[test]
fn one_timeout_covers_the_batches_too() {
    let now = Instant::now();
    let mut c = connection();
    c.recovery_mut().establish();
    let limits = QpLimits {
        depth: 4,
        send_limit: 1,
        signal_every: 1,
    };
    let qp = c.batches_mut().add_qp(0, limits);
    assert_eq!(c.poll_timeout(), None);
    let id = c
        .batches_mut()
        .submit(vec![(qp, Work::new(64))], 7, Some((now + 5 * T, 5 * T)), ());
    assert_ne!(id, 0);
    assert_eq!(c.poll_timeout(), Some(now + 5 * T), "the batch's deadline");
    c.send(vec![1], 1, now, 3 * T).unwrap();
    assert_eq!(c.poll_timeout(), Some(now + 3 * T), "the earlier message");
    assert!(matches!(
        c.poll_transmit(now, true),
        Some(Transmit::Send(_))
    ));
    assert_eq!(c.poll_timeout(), Some(now + 5 * T));
    // Its time handled through the connection: the batch (never posted)
    // ends with a timeout, told once.
    assert_eq!(c.handle_timeout(now + 5 * T), []);
    let mut told = Vec::new();
    while let Some(action) = c.batches_mut().poll_action() {
        if let Action::End {
            notify, outcome, ..
        } = action
        {
            told.push((notify, outcome));
        }
    }
    assert_eq!(told.len(), 1, "{told:?}");
    assert_eq!(told[0].0, 7);
    assert!(told[0].1.as_ref().is_err_and(|e| e.contains("timed out")));
    assert_eq!(c.poll_timeout(), None);
}

#[test]
fn this_sides_grants_are_kept_to_announce_again_until_revoked() {
    let mut c = connection();
    c.announce(1, vec![1]);
    c.announce(2, vec![2]);
    assert!(c.forget_announced(1));
    assert!(!c.forget_announced(1));
    assert_eq!(c.announced().collect::<Vec<_>>(), [&[2][..]]);
    assert_eq!(c.announced_len(), 1);
}

#[test]
fn one_timeout_covers_the_rendezvous_too() {
    let now = Instant::now();
    let mut c = connection();
    assert_eq!(c.poll_timeout(), None);
    let rendezvous = c.rendezvous_mut();
    let id = rendezvous.requester.start(true, 4096, now, 4 * T);
    assert_eq!(
        c.poll_timeout(),
        Some(now + 4 * T),
        "the request's deadline"
    );
    // Lent out, it is the driver's; returned, the connection's again.
    let lent = c.lend_rendezvous();
    assert_eq!(c.poll_timeout(), None);
    c.return_rendezvous(lent);
    assert_eq!(c.poll_timeout(), Some(now + 4 * T));
    // Its time handled through the connection: the request ends, timed
    // out, told once.
    assert_eq!(c.handle_timeout(now + 4 * T), []);
    let requester = &mut c.rendezvous_mut().requester;
    requester.step();
    let mut ended = Vec::new();
    while let Some(action) = requester.poll_action() {
        if let RequesterAction::End { id, outcome } = action {
            ended.push((id, outcome));
        }
    }
    assert_eq!(ended, [(id, Err(AskFailure::TimedOut))]);
    assert_eq!(c.poll_timeout(), None);
}

#[test]
fn one_timeout_covers_the_peer_copies_too() {
    use crate::peer_copy::{CopyFlight, Release, Stop, Windows};
    let now = Instant::now();
    let mut c = connection();
    let windows = Windows {
        slice: 1024,
        slices: 2,
        in_flight: 2,
    };
    // A flight due at 4 T and an export revoked with a bound of 2 T.
    let id = c
        .peer_copy_mut()
        .start(CopyFlight::new(vec![8192], windows, Some(now + 4 * T)));
    let copies = c.peer_copy_mut();
    let flight = copies.flight_mut(id).expect("held");
    assert!(flight.poll_window().is_some(), "a window on the GPU");
    copies.exports_mut().export(7, 1, ());
    copies.exports_mut().revoke(7, now, 2 * T);
    assert_eq!(c.poll_timeout(), Some(now + 2 * T), "the export's bound");
    // Lent out, the driver's; returned, the connection's again.
    let lent = c.lend_peer_copy();
    assert_eq!(c.poll_timeout(), None);
    c.return_peer_copy(lent);
    // The bound handled through the connection: the export is given up
    // on (handed back) and its revoke reports it unconfirmed.
    let given_up: Vec<GrantId> = c
        .handle_work_timeout(now + 2 * T)
        .into_iter()
        .map(|(grant, ())| grant)
        .collect();
    assert_eq!(given_up, [7]);
    assert_eq!(c.peer_copy().exports().release(7), Release::GivenUp);
    assert_eq!(c.poll_timeout(), Some(now + 4 * T), "the flight's deadline");
    // The flight's deadline handled through the connection: it stops,
    // its outcome handed out at once, its window still draining.
    assert_eq!(c.handle_timeout(now + 4 * T), []);
    let flight = c.peer_copy_mut().flight_mut(id).expect("held");
    assert_eq!(flight.stopped(), Some(Stop::TimedOut));
    assert_eq!(flight.poll_outcome(), Some(Err(Stop::TimedOut)));
    assert!(!flight.is_drained(), "its window is still on the GPU");
    assert_eq!(c.poll_timeout(), None);
    flight_done(&mut c, id);
    assert!(c.peer_copy_mut().finish(id).is_some_and(|f| f.is_drained()));
    assert_eq!(c.peer_copy().flights_len(), 0);
}

fn flight_done(c: &mut TestConnection, id: crate::peer_copy::FlightId) {
    c.peer_copy_mut()
        .flight_mut(id)
        .expect("held")
        .window_done();
}
