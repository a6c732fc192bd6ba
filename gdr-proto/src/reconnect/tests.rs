use super::*;

const T: Duration = Duration::from_secs(10);

fn hello(role: Role, session: u64, qp_index: u16, engine: u64) -> Hello {
    Hello {
        role,
        engine,
        session,
        qp_index,
        qp_count: 2,
        max_message: 4096,
        recv_depth: 16,
        max_slice: 1 << 20,
    }
}

fn established(qps: usize, connector: bool) -> Recovery {
    let mut r = Recovery::new(qps, connector, T);
    r.establish();
    r
}

#[test]
fn a_queue_pair_failing_during_set_up_makes_the_peer_gone() {
    let now = Instant::now();
    let mut r = Recovery::new(2, true, T);
    assert_eq!(
        r.on_drained(1, now, false, false),
        Drained::Gone(Gone::FailedDuringSetUp { index: 1 })
    );
    assert_eq!(r.poll_gone(), None, "reported once, by the return value");
    assert_eq!(
        r.on_drained(0, now, false, false),
        Drained::Gone(Gone::FailedDuringSetUp { index: 1 }),
        "the first reason stands"
    );
    assert_eq!(r.reconnecting(), 0);
}

#[test]
fn the_connector_dials_and_the_acceptor_waits_within_the_timeout() {
    let now = Instant::now();
    let mut dialer = established(2, true);
    let mut waiter = established(2, false);
    assert_eq!(
        dialer.on_drained(1, now, false, false),
        Drained::Reconnect {
            by: Some(now + T),
            dial: true
        }
    );
    assert_eq!(
        waiter.on_drained(1, now, false, false),
        Drained::Reconnect {
            by: Some(now + T),
            dial: false
        }
    );
    assert_eq!(dialer.reconnecting(), 1);
    assert_eq!(dialer.poll_timeout(), Some(now + T));
    assert_eq!(dialer.time_left(1, now + T / 2), Some(T / 2));
    assert_eq!(dialer.time_left(0, now), None, "queue pair 0 is up");
    // The dial reaches the acceptor, whose old queue pair drained.
    assert_eq!(
        waiter.on_replacement(1, OldQp::Reconnecting),
        Replacement::Install
    );
    assert!(waiter.installed(1));
    assert!(dialer.installed(1));
    assert_eq!((dialer.reconnecting(), waiter.reconnecting()), (0, 0));
    assert_eq!(dialer.poll_timeout(), None);
    assert_eq!(dialer.time_left(1, now), None, "no longer wanted: it is up");
    // Installed once: a late second report changes nothing.
    assert!(!dialer.installed(1));
}

#[test]
fn a_queue_pair_not_back_by_its_deadline_is_given_up_and_the_last_one_makes_the_peer_gone() {
    let now = Instant::now();
    let mut r = established(2, true);
    r.on_drained(0, now, false, false);
    assert!(r.handle_timeout(now + T / 2).is_empty(), "not late yet");
    r.on_drained(1, now + T / 2, false, false);
    assert_eq!(
        r.handle_timeout(now + T),
        vec![(0, GiveUp::Late { index: 0, after: T })]
    );
    assert_eq!(
        r.poll_gone(),
        None,
        "queue pair 1 is still being re-established"
    );
    assert_eq!(r.time_left(0, now + T), None);
    let late = r.handle_timeout(now + T + T / 2);
    assert_eq!(late, vec![(1, GiveUp::Late { index: 1, after: T })]);
    assert_eq!(
        r.poll_gone(),
        Some(Gone::GivenUp(GiveUp::Late { index: 1, after: T }))
    );
    assert!(r.handle_timeout(now + 4 * T).is_empty(), "given up once");
    assert_eq!(r.poll_timeout(), None);
}

#[test]
fn a_refused_dial_gives_up_once() {
    let now = Instant::now();
    let mut r = established(1, true);
    r.on_drained(0, now, false, false);
    let why = GiveUp::Refused {
        index: 0,
        why: DialRefused::Rejected(crate::wire::RejectReason::Busy),
    };
    assert!(r.give_up(0, why.clone()));
    assert!(!r.give_up(0, why.clone()), "twice changes nothing");
    assert_eq!(r.poll_gone(), Some(Gone::GivenUp(why)));
    // A dial that comes back after the give-up is not wanted.
    assert_eq!(r.time_left(0, now), None);
    assert!(!r.installed(0));
}

#[test]
fn a_gone_peer_or_a_dead_nic_keeps_the_queue_pair_down() {
    let now = Instant::now();
    let mut r = established(2, true);
    assert_eq!(r.on_drained(0, now, false, true), Drained::StaysDown);
    assert_eq!(r.poll_gone(), None, "queue pair 1 is up");
    assert_eq!(
        r.on_drained(1, now, true, false),
        Drained::Gone(Gone::EveryQueuePairFailed)
    );
    assert_eq!(r.reconnecting(), 0);
}

#[test]
fn a_replacement_for_a_live_queue_pair_fails_the_old_one_and_is_installed_once_it_drained() {
    let now = Instant::now();
    let mut r = established(2, false);
    assert_eq!(
        r.on_replacement(1, OldQp::Ready),
        Replacement::FailOldThenWait
    );
    assert_eq!(r.reconnecting(), 0);
    assert_eq!(r.on_drained(1, now, false, false), Drained::Install);
    // Installed at once: nothing waits on a deadline.
    assert_eq!(r.poll_timeout(), None);
    assert!(r.handle_timeout(now + 2 * T).is_empty());
}

#[test]
fn a_replacement_for_a_draining_queue_pair_waits_and_a_gone_peer_drops_it() {
    let now = Instant::now();
    let mut r = established(2, false);
    assert_eq!(r.on_replacement(0, OldQp::Failing), Replacement::Wait);
    assert_eq!(r.on_drained(0, now, true, false), Drained::StaysDown);
    assert_eq!(r.on_replacement(5, OldQp::Failing), Replacement::Refuse);
    assert_eq!(
        r.on_drained(1, now, true, false),
        Drained::Gone(Gone::EveryQueuePairFailed)
    );
    assert_eq!(
        r.on_replacement(1, OldQp::Reconnecting),
        Replacement::Refuse
    );
}

#[test]
fn a_given_up_queue_pair_refuses_a_late_replacement() {
    let now = Instant::now();
    let mut r = established(2, false);
    r.on_drained(1, now, false, false);
    r.handle_timeout(now + T);
    assert_eq!(r.on_replacement(1, OldQp::Down), Replacement::Refuse);
    assert_eq!(
        r.on_replacement(1, OldQp::Reconnecting),
        Replacement::Refuse
    );
}

#[test]
fn a_timeout_past_what_an_instant_holds_never_gives_up() {
    let now = Instant::now();
    let mut r = Recovery::new(1, true, Duration::MAX);
    r.establish();
    assert_eq!(
        r.on_drained(0, now, false, false),
        Drained::Reconnect {
            by: None,
            dial: true
        }
    );
    assert_eq!(r.time_left(0, now), Some(Duration::MAX));
    assert!(
        r.handle_timeout(now + Duration::from_secs(1 << 20))
            .is_empty()
    );
    assert_eq!(r.poll_gone(), None);
}

#[test]
fn a_reply_must_answer_the_dial() {
    let ok = hello(Role::Accept, 7, 1, 42);
    assert_eq!(check_reply(&ok, 7, 1, 42), Ok(()));
    assert_eq!(
        check_reply(&hello(Role::Connect, 7, 1, 42), 7, 1, 42),
        Err(ReplyMismatch::Role(Role::Connect))
    );
    assert_eq!(
        check_reply(&hello(Role::Accept, 8, 1, 42), 7, 1, 42),
        Err(ReplyMismatch::Session { got: 8 })
    );
    assert_eq!(
        check_reply(&hello(Role::Accept, 7, 0, 42), 7, 1, 42),
        Err(ReplyMismatch::Index { got: 0 })
    );
    assert_eq!(
        check_reply(&hello(Role::Accept, 7, 1, 43), 7, 1, 42),
        Err(ReplyMismatch::Engine { first: 42, got: 43 })
    );
}

#[test]
fn the_backoff_doubles_up_to_its_bound() {
    let mut b = Backoff::default();
    let waits: Vec<Duration> = (0..9).map(|_| b.next_wait()).collect();
    assert_eq!(waits[0], Backoff::FIRST);
    assert_eq!(waits[1], Backoff::FIRST * 2);
    assert!(waits.windows(2).all(|w| w[1] >= w[0]));
    assert_eq!(*waits.last().unwrap(), Backoff::MAX);
}

#[test]
fn a_closed_peer_re_establishes_nothing() {
    let now = Instant::now();
    let mut r = established(2, true);
    r.on_drained(0, now, false, false);
    assert_eq!(r.close(), 1);
    assert_eq!(r.reconnecting(), 0);
    assert_eq!(r.time_left(0, now), None);
    assert_eq!(
        r.poll_gone(),
        None,
        "the driver tore it down: nothing to report"
    );
    assert_eq!(r.on_drained(1, now, false, false), Drained::StaysDown);
    assert_eq!(
        r.on_replacement(0, OldQp::Reconnecting),
        Replacement::Refuse
    );
}
