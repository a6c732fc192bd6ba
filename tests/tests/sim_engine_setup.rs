//! Connection set-up between two simulated engines: a connect nobody
//! accepts fails typed and leaves nothing behind on either side (the
//! listener's next accept does not hand out the abandoned peer, and a
//! retry succeeds once the server accepts); the listener's backlog is
//! bounded (a new connection past it is refused busy, typed) and has a
//! deadline (an unaccepted connection is dropped after it, the waiting
//! connector told typed); a closed listener refuses busy.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use gdr_core::VerbsError;
use gdr_core::engine::setup::NotAccepted;
use gdr_core::engine::wire::RejectReason;
use gdr_core::engine::{EngineConfig, EngineError, HandshakeFailure, Listener};
use gdr_sim::{GpuConfig, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, WorldPeer};

const T: Duration = Duration::from_secs(10);
/// A connect or accept that is meant to give up.
const SHORT: Duration = Duration::from_millis(300);

/// Two simulated nodes, a connected to b (two queue pairs a peer), b's
/// engine configured by `b_config` on top of the defaults.
fn world(b_config: impl FnOnce(&mut EngineConfig)) -> EngineWorld<SimVerbsApi> {
    let a = EngineConfig::default()
        .with_qps_per_peer(2)
        .with_default_timeout(T);
    let mut b = a.clone();
    b_config(&mut b);
    EngineWorld::sim_sides(1, (a, b), T, |fabric| {
        gdr_sim::SimCuda::new(vec![GpuConfig::default()], fabric.faults())
    })
}

/// A second listener of b's engine, and the address a reaches it at.
fn listen(w: &EngineWorld<SimVerbsApi>) -> (Listener, SocketAddr) {
    let listener =
        w.b.engine
            .listen(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
            .unwrap();
    let ip = IpAddr::V4(w.b.verbs.device_ipv4("sim0").unwrap());
    let addr = SocketAddr::new(ip, listener.local_addr().port());
    (listener, addr)
}

/// A message each way between the two ends of one connection.
fn round_trip(x: &WorldPeer, y: &WorldPeer) {
    x.send(b"ping").unwrap().wait(T).unwrap();
    assert_eq!(y.recv(T).unwrap(), b"ping");
    y.send(b"pong").unwrap().wait(T).unwrap();
    assert_eq!(x.recv(T).unwrap(), b"pong");
}

/// Connects a to b at `addr` while b accepts on `listener`: both ends.
fn connect_accepted(
    w: &EngineWorld<SimVerbsApi>,
    listener: &Listener,
    addr: SocketAddr,
) -> (WorldPeer, WorldPeer) {
    std::thread::scope(|scope| {
        let accepting = scope.spawn(|| listener.accept(T));
        let ab =
            w.a.engine
                .connect(addr, T)
                .unwrap_or_else(|e| panic!("connecting with accept running: {e}"));
        let ba = accepting
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("accepting: {e}"));
        (ab, ba)
    })
}

/// Finding 4: a connect while nobody is in accept fails saying the
/// listener did not accept; the connector keeps no peer; the listener's
/// next accept does not hand out the abandoned connection; a retry with
/// accept running succeeds and carries messages.
#[test]
fn a_connect_nobody_accepts_fails_typed_and_a_retry_succeeds() {
    let w = world(|_| {});
    let (listener, addr) = listen(&w);
    let err = w.a.engine.connect(addr, SHORT).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::NotAccepted {
                reason: NotAccepted::Timeout { .. },
                ..
            }
        ),
        "not a typed not-accepted: {err}"
    );
    assert_eq!(
        w.a.engine.peer_count(),
        1,
        "the connector holds no peer for the failed connect (only the world's)"
    );
    match listener.accept(SHORT) {
        Err(EngineError::Timeout(_)) => {}
        Ok(peer) => panic!(
            "accept returned the abandoned peer (session {:#x})",
            peer.session()
        ),
        Err(e) => panic!("accept: {e}"),
    }
    assert_eq!(w.b.engine.peer_count(), 1, "the listener kept no peer");
    assert_eq!(listener.waiting(), 0, "nothing waits for accept");

    let (ab, ba) = connect_accepted(&w, &listener, addr);
    assert_eq!(ab.session(), ba.session());
    assert_eq!(ab.remote_engine(), w.b.engine.id());
    round_trip(&ab, &ba);
    assert_eq!((w.a.engine.peer_count(), w.b.engine.peer_count()), (2, 2));
    // The world's first connection is untouched.
    round_trip(&w.ab, &w.ba);
}

/// Issue 33, item 7: a connect to an address where no engine of this
/// process's simulated fabric listens (a server of another process, each
/// with a fabric of its own) waited its whole timeout (30 s) before it
/// failed "nobody listening". It now fails within the listener window,
/// typed, saying the simulation does not span processes; and a listener
/// started a moment after the connect began is still reached.
#[test]
fn a_connect_nobody_of_this_process_listens_for_fails_typed_within_the_window() {
    let w = world(|_| {});
    // A port of b's address nobody listens on.
    let ip = IpAddr::V4(w.b.verbs.device_ipv4("sim0").unwrap());
    let dead = SocketAddr::new(ip, 9);
    let start = Instant::now();
    let err =
        w.a.engine
            .connect(dead, Duration::from_secs(30))
            .unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(
            &err,
            EngineError::Handshake {
                why: HandshakeFailure::Connect(VerbsError::NotListeningInSimulation { .. }),
                ..
            }
        ),
        "not the simulation's typed not-listening: {err}"
    );
    assert!(err.to_string().contains("does not span processes"), "{err}");
    assert!(
        took < Duration::from_secs(3),
        "failed after {took:?}, not within the listener window"
    );
    assert_eq!(w.a.engine.peer_count(), 1, "only the world's peer");
    // An address no device of this fabric has: the same, at once.
    let nowhere = SocketAddr::from((Ipv4Addr::new(10, 77, 250, 250), 9));
    let start = Instant::now();
    let err =
        w.a.engine
            .connect(nowhere, Duration::from_secs(30))
            .unwrap_err();
    assert!(
        matches!(
            &err,
            EngineError::Handshake {
                why: HandshakeFailure::Connect(VerbsError::NotListeningInSimulation { .. }),
                ..
            }
        ),
        "no device there: {err}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    // A listener that comes 200 ms after the connect began is reached.
    let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), dead.port());
    let (ab, ba) = std::thread::scope(|scope| {
        let connecting = scope.spawn(|| w.a.engine.connect(dead, T));
        std::thread::sleep(Duration::from_millis(200));
        let listener = w.b.engine.listen(any).unwrap();
        let ba = listener
            .accept(T)
            .unwrap_or_else(|e| panic!("accepting: {e}"));
        let ab = connecting
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("connecting before the listener came: {e}"));
        (ab, ba)
    });
    round_trip(&ab, &ba);
}

/// The listener's side of finding 4 alone: whatever the connector's error,
/// an accept after it gave up returns no peer (on the old engine it handed
/// out the abandoned one, on which `send` reported success).
#[test]
fn accept_never_returns_a_peer_whose_connector_gave_up() {
    let w = world(|_| {});
    let (listener, addr) = listen(&w);
    let err = w.a.engine.connect(addr, SHORT).unwrap_err();
    eprintln!("the connector's error: {err}");
    let accepted = listener.accept(SHORT);
    if let Ok(peer) = &accepted {
        let sent = peer.send(b"anyone?").map(|b| b.wait(SHORT));
        panic!(
            "accept returned the abandoned peer (session {:#x}); send on it: {sent:?}",
            peer.session()
        );
    }
    assert!(
        matches!(accepted, Err(EngineError::Timeout(_))),
        "{accepted:?}"
    );
}

/// Past the backlog's bound a new connection is refused busy, at once and
/// typed, while the one waiting is accepted later and works.
#[test]
fn past_the_backlog_a_new_connection_is_refused_busy() {
    let w = world(|b| b.accept_backlog = 1);
    let (listener, addr) = listen(&w);
    std::thread::scope(|scope| {
        let waiting = scope.spawn(|| w.a.engine.connect(addr, T));
        let start = Instant::now();
        while listener.waiting() < 1 {
            assert!(start.elapsed() < T, "the first connection never arrived");
            std::thread::sleep(Duration::from_millis(2));
        }
        let start = Instant::now();
        let err = w.a.engine.connect(addr, T).unwrap_err();
        assert!(
            matches!(
                err,
                EngineError::Rejected {
                    reason: RejectReason::Busy,
                    ..
                }
            ),
            "not a typed busy rejection: {err}"
        );
        assert!(
            start.elapsed() < T / 2,
            "refused at once, not by a timeout ({:?})",
            start.elapsed()
        );
        assert_eq!(listener.waiting(), 1, "the first still waits");
        let ba = listener.accept(T).unwrap();
        let ab = waiting.join().unwrap().unwrap();
        assert_eq!(ab.session(), ba.session());
        round_trip(&ab, &ba);
    });
    assert_eq!(
        w.a.engine.peer_count(),
        2,
        "the world's and the accepted one: the refused left nothing"
    );
}

/// A connection nobody accepts is disconnected at the listener's accept
/// deadline: the connector, waiting longer, is told at once and typed;
/// nothing is left to accept.
#[test]
fn an_unaccepted_connection_is_dropped_at_the_listeners_deadline() {
    let deadline = Duration::from_millis(500);
    let w = world(|b| b.accept_timeout = deadline);
    let (listener, addr) = listen(&w);
    let start = Instant::now();
    let err = w.a.engine.connect(addr, T).unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(
            err,
            EngineError::NotAccepted {
                reason: NotAccepted::Dropped,
                ..
            }
        ),
        "not a typed drop: {err}"
    );
    assert!(
        took >= deadline && took < T / 2,
        "dropped at the listener's deadline, not the connector's: {took:?}"
    );
    assert_eq!(listener.waiting(), 0);
    assert!(matches!(
        listener.accept(SHORT),
        Err(EngineError::Timeout(_))
    ));
    assert_eq!((w.a.engine.peer_count(), w.b.engine.peer_count()), (1, 1));
    // Within the deadline, accepted as usual.
    let (ab, ba) = connect_accepted(&w, &listener, addr);
    round_trip(&ab, &ba);
}

/// A listener whose handle was dropped refuses new connections busy,
/// typed; the engine's other connection carries on.
#[test]
fn a_closed_listener_refuses_busy() {
    let w = world(|_| {});
    let (listener, addr) = listen(&w);
    drop(listener);
    let err = w.a.engine.connect(addr, T).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::Rejected {
                reason: RejectReason::Busy,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(w.a.engine.peer_count(), 1);
    round_trip(&w.ab, &w.ba);
}

/// Found by the soak (seed 1): a receive post refused part-way while a
/// peer was being added (its first receive taken, the second refused)
/// left the new queue pairs' entries pointing at a peer slot that was
/// never filled; the flush of the receive that was taken then reached
/// that slot and the engine's driver panicked (index out of bounds). The
/// connect must fail typed, both engines keep going, a retry connects and
/// nothing of the failed attempt is left.
#[test]
fn a_receive_post_refused_while_adding_a_peer_fails_the_connect_and_leaves_nothing() {
    let w = world(|_| {});
    let (listener, addr) = listen(&w);
    // The second receive of the next post: one taken, then a refusal.
    let faults = w.fabric().faults();
    let nth = faults.calls(gdr_sim::FaultSite::VerbsPostRecv) + 2;
    faults.fail_nth(
        gdr_sim::FaultSite::VerbsPostRecv,
        nth,
        gdr_sim::Fault::Verbs(hal_verbs::VerbsError::from_errno(
            "ibv_post_recv",
            "sim0",
            libc::ENOMEM,
        )),
    );
    let (connected, accepted) = std::thread::scope(|scope| {
        let accepting = scope.spawn(|| listener.accept(SHORT));
        let connected = w.a.engine.connect(addr, SHORT);
        (connected, accepting.join().unwrap())
    });
    faults.assert_all_fired();
    assert!(
        connected.is_err() || accepted.is_err(),
        "one side's set-up failed: {:?} / {:?}",
        connected.as_ref().map(|p| p.session()),
        accepted.as_ref().map(|p| p.session())
    );
    drop((connected, accepted));
    // The flushes of the failed attempt come in; progress must survive
    // them (it panicked here).
    for _ in 0..100 {
        w.a.engine.progress();
        w.b.engine.progress();
    }
    let (ab, ba) = connect_accepted(&w, &listener, addr);
    round_trip(&ab, &ba);
    round_trip(&w.ab, &w.ba);
    drop((ab, ba, listener));
    w.close_and_check_released();
}

/// `max_peers` bounds the peers an engine carries: past it a connect is
/// refused before any queue pair is made (typed, naming the bound), and
/// an acceptor at its bound rejects the connector busy; a peer that goes
/// makes room again.
#[test]
fn past_max_peers_a_connect_is_refused_and_an_acceptor_rejects_busy() {
    use gdr_core::engine::Refusal;
    let config = EngineConfig::default()
        .with_qps_per_peer(2)
        .with_default_timeout(T)
        .with_max_peers(1);
    let w = EngineWorld::sim_sides(1, (config.clone(), config), T, |fabric| {
        gdr_sim::SimCuda::new(vec![GpuConfig::default()], fabric.faults())
    });
    let (listener, addr) = listen(&w);
    // a carries the world's peer: its own bound refuses at once.
    let err = w.a.engine.connect(addr, T).unwrap_err();
    assert!(
        matches!(err, EngineError::Refused(Refusal::PeerLimit { max: 1 })),
        "{err}"
    );
    assert_eq!(
        w.a.engine.peer_count(),
        1,
        "the refused connect left nothing"
    );
    // A third engine reaches b, which carries the world's peer: busy.
    let fabric = w.fabric();
    let c_nic = fabric.add_node("c", gdr_sim::NodeConfig::default());
    let c = gdr_core::engine::Engine::new(
        &c_nic.erased(),
        None,
        EngineConfig::default().with_default_timeout(T),
    )
    .unwrap();
    let err = c.connect(addr, T).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::Rejected {
                reason: RejectReason::Busy,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(listener.waiting(), 0, "nothing of c waits at b");
    // b closes the world's peer: room for c.
    w.ba.close().unwrap();
    let start = Instant::now();
    loop {
        let attempt = std::thread::scope(|scope| {
            let accepting = scope.spawn(|| listener.accept(SHORT));
            let connected = c.connect(addr, T);
            (connected, accepting.join().unwrap())
        });
        match attempt {
            (Ok(cb), Ok(bc)) => {
                round_trip_engines(&cb, &bc);
                break;
            }
            (connected, accepted) => {
                assert!(
                    start.elapsed() < T,
                    "no room after the peer went: {connected:?} / {accepted:?}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// A message each way between two peers of any engines.
fn round_trip_engines(x: &gdr_core::engine::Peer, y: &gdr_core::engine::Peer) {
    x.send(b"ping").unwrap().wait(T).unwrap();
    assert_eq!(y.recv(T).unwrap(), b"ping");
}

/// Each NIC's completion queue is sized for `max_peers` peers' queue
/// pairs, brought down to the device's `max_cqe`: on a device whose CQs
/// hold two peers' completions, a third peer is refused (typed), where
/// a CQ sized for 64 queue pairs would have overrun.
#[test]
fn the_cq_bound_of_the_device_bounds_the_peers() {
    use gdr_core::engine::{Engine, Refusal};
    use gdr_sim::{DeviceConfig, NodeConfig, SimFabric};
    let config = EngineConfig::default()
        .with_cqs_per_nic(1)
        .with_qps_per_peer(2)
        .with_qp_depth(64)
        .with_recv_depth(32)
        .with_default_timeout(T);
    let per_peer = 2 * (64 + 32);
    let fabric = SimFabric::new();
    let mut small = DeviceConfig::default();
    small.attributes.max_cqe = 2 * per_peer + per_peer / 2;
    let a_nic = fabric.add_node(
        "a",
        NodeConfig {
            ipv4: None,
            devices: vec![small],
        },
    );
    let b_nic = fabric.add_node("b", NodeConfig::default());
    let a = Engine::new(&a_nic.erased(), None, config.clone()).unwrap();
    let b = Engine::new(&b_nic.erased(), None, config).unwrap();
    let (listener, addr) = gdr_tests::engine_world::sim_listener(&b, &b_nic);
    let peers: Vec<_> = (0..2)
        .map(|_| gdr_tests::engine_world::connect_accepted(&a, &listener, addr, T))
        .collect();
    let err = a.connect(addr, T).unwrap_err();
    assert!(
        matches!(err, EngineError::Refused(Refusal::PeerLimit { max: 2 })),
        "{err}"
    );
    for (ab, ba) in &peers {
        round_trip_engines(ab, ba);
    }
    // A device whose CQs hold not even one peer: the engine says so.
    let mut tiny = DeviceConfig::default();
    tiny.attributes.max_cqe = per_peer - 1;
    let c_nic = fabric.add_node(
        "c",
        NodeConfig {
            ipv4: None,
            devices: vec![tiny],
        },
    );
    let err = Engine::new(
        &c_nic.erased(),
        None,
        EngineConfig::default()
            .with_cqs_per_nic(1)
            .with_qps_per_peer(2)
            .with_qp_depth(64)
            .with_recv_depth(32),
    )
    .map(drop)
    .unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::Unavailable(gdr_core::engine::Unavailable::CompletionQueueTooSmall { .. })
        ),
        "{err}"
    );
}

/// Engines a and b on the simulation, two CQs per NIC, at most two peers
/// of `qps` queue pairs each; b listens.
fn two_engines_of_two_cqs(
    qps: u16,
) -> (
    gdr_core::engine::Engine,
    gdr_core::engine::Engine,
    Listener,
    SocketAddr,
) {
    use gdr_core::engine::Engine;
    use gdr_sim::{NodeConfig, SimFabric};
    let config = EngineConfig::default()
        .with_cqs_per_nic(2)
        .with_qps_per_peer(qps)
        .with_max_peers(2)
        .with_default_timeout(T);
    let fabric = SimFabric::new();
    let a_nic = fabric.add_node("a", NodeConfig::default());
    let b_nic = fabric.add_node("b", NodeConfig::default());
    let a = Engine::new(&a_nic.erased(), None, config.clone()).unwrap();
    let b = Engine::new(&b_nic.erased(), None, config).unwrap();
    let (listener, addr) = gdr_tests::engine_world::sim_listener(&b, &b_nic);
    (a, b, listener, addr)
}

/// Each queue pair takes a seat on its NIC's CQ with the fewest taken, and
/// a drained one (its peer closed) gives it back: two peers of one queue
/// pair each complete on CQs of their own (both sides), a third is refused
/// while both are live, and once one is closed a new peer takes its seat.
#[test]
fn queue_pairs_spread_over_the_cqs_and_give_their_seats_back() {
    use gdr_core::engine::{Engine, Refusal};
    let (a, b, listener, addr) = two_engines_of_two_cqs(1);
    let seated = |e: &Engine| e.resources().cq_queue_pairs;
    assert_eq!(seated(&a), [0, 0]);
    let (ab1, ba1) = gdr_tests::engine_world::connect_accepted(&a, &listener, addr, T);
    let (ab2, ba2) = gdr_tests::engine_world::connect_accepted(&a, &listener, addr, T);
    assert_eq!(seated(&a), [1, 1], "a's two queue pairs on one CQ");
    assert_eq!(seated(&b), [1, 1], "b's two queue pairs on one CQ");
    round_trip_engines(&ab1, &ba1);
    round_trip_engines(&ab2, &ba2);
    let err = a.connect(addr, T).unwrap_err();
    assert!(
        matches!(err, EngineError::Refused(Refusal::PeerLimit { max: 2 })),
        "{err}"
    );
    ab1.close().unwrap();
    // Both sides' queue pairs drain (b hears the goodbye, or sees the
    // queue pair fail) and give their seats back.
    let start = Instant::now();
    while (seated(&a).iter().sum::<usize>() > 1 || seated(&b).iter().sum::<usize>() > 1)
        && start.elapsed() < T
    {
        a.progress();
        b.progress();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        seated(&a).iter().sum::<usize>(),
        1,
        "a kept the closed peer's seat"
    );
    assert_eq!(
        seated(&b).iter().sum::<usize>(),
        1,
        "b kept the closed peer's seat"
    );
    let (ab3, ba3) = gdr_tests::engine_world::connect_accepted(&a, &listener, addr, T);
    assert_eq!(seated(&a), [1, 1]);
    assert_eq!(seated(&b), [1, 1]);
    round_trip_engines(&ab3, &ba3);
    round_trip_engines(&ab2, &ba2);
}

/// `Batch::status` makes progress on its peer's CQs, not on every CQ: a
/// thread looking at its own batches leaves another peer's completions
/// (and that peer's lock) to that peer's thread. It polled every CQ: 12
/// threads of one engine looking at their batches took each other's
/// completions and waited on each other's peers' locks.
#[test]
fn a_batchs_status_leaves_other_peers_completions_alone() {
    let (a, b, listener, addr) = two_engines_of_two_cqs(1);
    let (ab1, ba1) = gdr_tests::engine_world::connect_accepted(&a, &listener, addr, T);
    let (ab2, ba2) = gdr_tests::engine_world::connect_accepted(&a, &listener, addr, T);
    assert_eq!(a.resources().cq_queue_pairs, [1, 1], "a peer on each CQ");
    const LEN: u64 = 4096;
    let src_buf = gdr_core::buffer::Buffer::alloc_host(LEN);
    let src = a.register_buffer(&src_buf).unwrap();
    let (dst1_buf, dst2_buf) = (
        gdr_core::buffer::Buffer::alloc_host(LEN),
        gdr_core::buffer::Buffer::alloc_host(LEN),
    );
    let (dst1, dst2) = (
        b.register_buffer(&dst1_buf).unwrap(),
        b.register_buffer(&dst2_buf).unwrap(),
    );
    let (_kept1, grant1) = gdr_tests::engine_world::grant_to(
        &ba1,
        &ab1,
        &dst1,
        gdr_core::descriptor::GrantRights::Write,
        T,
    );
    let (_kept2, grant2) = gdr_tests::engine_world::grant_to(
        &ba2,
        &ab2,
        &dst2,
        gdr_core::descriptor::GrantRights::Write,
        T,
    );
    // Nothing else of a's waits to be taken.
    while a.progress() > 0 {}
    let first = ab1
        .submit(&[gdr_core::engine::Transfer::write(&src, 0, &grant1, 0, LEN)])
        .unwrap();
    let second = ab2
        .submit(&[gdr_core::engine::Transfer::write(&src, 0, &grant2, 0, LEN)])
        .unwrap();
    let start = Instant::now();
    while second.status().is_none() {
        assert!(start.elapsed() < T, "the second batch never ended");
    }
    // The first peer's completion is still on its CQ for a poll to take.
    let start = Instant::now();
    let mut taken = 0;
    while taken == 0 && start.elapsed() < Duration::from_millis(200) {
        taken += a.progress();
    }
    assert!(
        taken > 0,
        "the second batch's status took the first peer's completion"
    );
    first.wait(T).unwrap();
}

/// A peer's queue pairs sit on one CQ where it has room (a thread waiting
/// on that peer polls one CQ): two peers of two queue pairs each, on two
/// CQs, fill one CQ each, on the connecting side and the accepting one.
#[test]
fn a_peers_queue_pairs_share_one_cq() {
    use gdr_core::engine::Engine;
    let (a, b, listener, addr) = two_engines_of_two_cqs(2);
    let seated = |e: &Engine| {
        let mut seats = e.resources().cq_queue_pairs;
        seats.sort_unstable();
        seats
    };
    let (ab1, ba1) = gdr_tests::engine_world::connect_accepted(&a, &listener, addr, T);
    assert_eq!(seated(&a), [0, 2], "a spread one peer's queue pairs");
    assert_eq!(seated(&b), [0, 2], "b spread one peer's queue pairs");
    let (ab2, ba2) = gdr_tests::engine_world::connect_accepted(&a, &listener, addr, T);
    assert_eq!(seated(&a), [2, 2]);
    assert_eq!(seated(&b), [2, 2]);
    round_trip_engines(&ab1, &ba1);
    round_trip_engines(&ab2, &ba2);
}
