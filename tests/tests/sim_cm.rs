//! Connection management on the simulated fabric, through the HAL's
//! `ConnectionManager`/`Listener`/`ConnectRequest`/`Connection` traits, as
//! an engine would use them: the server sends the memory descriptor of its
//! buffer in the accept's private data (a REQ holds only 55 bytes, so the
//! client sends a small hello), the client WRITEs and READs through it.
//!
//! Connect and accept block, so each test runs the two sides on two threads.
//!
//! The tests that wait for a timeout run the fabric's clock in Manual mode:
//! the waits run on the virtual clock, so a test advances it past the
//! deadline (from another thread than the blocked call) and checks the call
//! returns then, not before, and not because real time passed.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use gdr_core::descriptor::{GrantRights, MemoryDescriptor, MemoryLocation, Reach, Segment};
use gdr_sim::{
    ClockMode, NodeConfig, SimCm, SimConnection, SimContext, SimCq, SimFabric, SimMr, SimPd,
    SimVerbs,
};
use gdr_tests::{init_tracing, pattern};
use hal_verbs::{
    AccessFlags, Completion, CompletionQueue, ConnectParams, ConnectRequest, Connection,
    ConnectionManager, ConnectionState, Context, Listener, MAX_ACCEPT_PRIVATE_DATA,
    MAX_CONNECT_PRIVATE_DATA, MemoryRegion, ProtectionDomain, Provider, QpState, QueuePair,
    SendFlags, SendOp, SendRequest, SgList, Sge, VerbsError, WcOpcode, WcStatus,
};

const HELLO: &[u8] = b"gdr-hello v1";
const LEN: usize = 64 * 1024;

/// One node: its CM, device, PD and a CQ.
struct Node {
    verbs: SimVerbs,
    cm: SimCm,
    ctx: SimContext,
    pd: SimPd,
    cq: SimCq,
}

impl Node {
    fn new(fabric: &SimFabric, name: &str, config: NodeConfig) -> Self {
        let verbs = fabric.add_node(name, config);
        let cm = verbs.connection_manager().unwrap();
        let ctx = verbs.open("sim0").unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        Self {
            verbs,
            cm,
            ctx,
            pd,
            cq,
        }
    }

    fn ip(&self) -> IpAddr {
        IpAddr::V4(self.verbs.device_ipv4("sim0").unwrap())
    }
}

/// Host memory and its registration (the MR is dropped first).
struct Buf {
    mr: SimMr,
    data: Box<[u8]>,
}

impl Buf {
    fn new(pd: &SimPd, len: usize, seed: u8) -> Self {
        let mut data = pattern(len, seed).into_boxed_slice();
        // SAFETY: the box outlives the registration (field order drops the
        // MR first) and is never reallocated.
        let mr =
            unsafe { pd.register(data.as_mut_ptr() as u64, len, AccessFlags::transfer()) }.unwrap();
        Self { mr, data }
    }

    /// A v2 descriptor of the whole buffer, one segment on `device`; the
    /// owner and grant ids are made up (no engine here).
    fn descriptor(&self, device: &str) -> MemoryDescriptor {
        let len = self.mr.len() as u64;
        MemoryDescriptor {
            owner: 1,
            grant: 1,
            location: MemoryLocation::Host,
            rights: GrantRights::ReadWrite,
            len,
            reach: Reach::Direct(vec![Segment {
                offset: 0,
                len,
                addr: self.mr.addr(),
                rkey: self.mr.rkey(),
                device: device.to_owned(),
            }]),
        }
    }

    fn sge(&self) -> SgList {
        let mut list = SgList::new();
        list.push(Sge {
            addr: self.mr.addr(),
            length: self.mr.len() as u32,
            lkey: self.mr.lkey(),
        });
        list
    }
}

fn fast() -> ConnectParams {
    ConnectParams {
        timeout: Duration::from_secs(5),
        ..ConnectParams::default()
    }
}

fn wait_one(cq: &SimCq) -> Completion {
    let start = Instant::now();
    let mut wc = [Completion::default()];
    loop {
        if cq.poll(&mut wc).unwrap() == 1 {
            return wc[0];
        }
        assert!(start.elapsed() < Duration::from_secs(5), "no completion");
        std::thread::yield_now();
    }
}

fn post(conn: &SimConnection, request: SendRequest) {
    // SAFETY: the tests keep their buffers registered and alive until the
    // completion is polled.
    unsafe { conn.qp().post_send(&[request]) }.unwrap();
}

/// Server and client nodes on one fabric, the server listening.
/// One tick of the virtual clock.
const NS: Duration = Duration::from_nanos(1);

/// Returns once `n` connection manager calls wait on `fabric`'s virtual
/// clock; fails after 5 s of real time (a call that waits on the real clock
/// is never counted).
fn until_virtual_waits(fabric: &SimFabric, n: usize) {
    let start = Instant::now();
    while fabric.cm_virtual_waits() < n {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{} cm call(s) wait on the virtual clock, not {n}",
            fabric.cm_virtual_waits()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs `call` (a cm call that blocks until its timeout, `bound`, on the
/// Manual clock) on another thread; advances the clock to one tick before
/// the bound and checks the call still waits after 100 ms of real time,
/// then by the last tick, and returns what the call returned.
fn at_the_virtual_bound<T: Send>(
    fabric: &SimFabric,
    bound: Duration,
    call: impl FnOnce() -> T + Send,
) -> T {
    assert_eq!(fabric.clock().mode(), ClockMode::Manual);
    std::thread::scope(|s| {
        let waiter = s.spawn(call);
        until_virtual_waits(fabric, 1);
        fabric.advance(bound - NS);
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !waiter.is_finished(),
            "returned before its deadline ({bound:?} of virtual time)"
        );
        fabric.advance(NS);
        waiter.join().unwrap()
    })
}

/// A pair on a fabric whose clock is Manual.
fn manual_pair() -> (SimFabric, Node, Node) {
    let (fabric, server, client) = pair();
    fabric.clock().set_mode(ClockMode::Manual);
    (fabric, server, client)
}

fn pair() -> (SimFabric, Node, Node) {
    init_tracing();
    let fabric = SimFabric::new();
    let server = Node::new(&fabric, "server", NodeConfig::default());
    let client = Node::new(&fabric, "client", NodeConfig::default());
    (fabric, server, client)
}

#[test]
fn connect_accept_exchange_a_descriptor_then_write_and_read() {
    let (_fabric, server, client) = pair();
    let target = Buf::new(&server.pd, LEN, 7);
    let listener = server
        .cm
        .listen(SocketAddr::new(server.ip(), 7471), 8)
        .unwrap();
    assert_eq!(listener.local_addr().port(), 7471);
    let device = client.cm.route_device(server.ip(), Duration::from_secs(1));
    assert_eq!(device.unwrap(), "sim0");

    let (server_conn, client_conn) = std::thread::scope(|s| {
        let srv = s.spawn(|| {
            let request = listener.next_request(Duration::from_secs(5)).unwrap();
            assert_eq!(request.private_data(), HELLO);
            assert_eq!(request.device(), "sim0");
            assert_eq!(request.peer_addr().ip(), client.ip());
            let md = target.descriptor(&request.device()).encode().unwrap();
            assert!(md.len() <= MAX_ACCEPT_PRIVATE_DATA);
            request
                .accept(&server.pd, &server.cq, &server.cq, &fast(), &md)
                .unwrap()
        });
        let peer = SocketAddr::new(server.ip(), 7471);
        let conn = client
            .cm
            .connect(peer, &client.pd, &client.cq, &client.cq, &fast(), HELLO)
            .unwrap();
        (srv.join().unwrap(), conn)
    });
    assert_eq!(server_conn.peer_private_data(), HELLO);
    assert_eq!(server_conn.qp().state().unwrap(), QpState::ReadyToSend);
    assert_eq!(client_conn.qp().state().unwrap(), QpState::ReadyToSend);
    assert_eq!(client_conn.peer_addr().port(), 7471);
    assert_eq!(client_conn.device(), "sim0");
    let descriptor = MemoryDescriptor::decode(&client_conn.peer_private_data()).unwrap();
    assert_eq!(descriptor, target.descriptor("sim0"));
    let remote = descriptor.segment("sim0", 0, LEN as u64).unwrap();

    // WRITE our pattern into the server's buffer, through the descriptor.
    let source = Buf::new(&client.pd, LEN, 42);
    post(
        &client_conn,
        SendRequest {
            wr_id: 1,
            op: SendOp::Write {
                remote_addr: remote.addr,
                rkey: remote.rkey,
            },
            sg_list: source.sge(),
            flags: SendFlags::SIGNALED,
        },
    );
    let wc = wait_one(&client.cq);
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::SUCCESS), "{wc:?}");
    assert!(
        target.data[..] == pattern(LEN, 42)[..],
        "WRITE payload differs"
    );

    // READ it back into a third buffer.
    let sink = Buf::new(&client.pd, LEN, 0);
    post(
        &client_conn,
        SendRequest {
            wr_id: 2,
            op: SendOp::Read {
                remote_addr: remote.addr,
                rkey: remote.rkey,
            },
            sg_list: sink.sge(),
            flags: SendFlags::SIGNALED,
        },
    );
    let wc = wait_one(&client.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (2, WcStatus::SUCCESS, WcOpcode::RdmaRead)
    );
    assert!(
        sink.data[..] == pattern(LEN, 42)[..],
        "READ payload differs"
    );

    // Disconnect: the peer sees it, and both queue pairs are flushed.
    assert_eq!(
        server_conn.poll_state(Duration::ZERO).unwrap(),
        ConnectionState::Connected
    );
    client_conn.disconnect().unwrap();
    client_conn.disconnect().unwrap();
    assert_eq!(client_conn.qp().state().unwrap(), QpState::Error);
    assert_eq!(
        server_conn.poll_state(Duration::from_secs(1)).unwrap(),
        ConnectionState::Disconnected
    );
    assert_eq!(server_conn.qp().state().unwrap(), QpState::Error);
}

/// Nobody listening: connect retries until its timeout, on the virtual
/// clock: Timeout exactly when virtual time passes the bound (not before,
/// though 100 ms of real time pass one tick before it), reporting the
/// virtual time waited. (A connect that waits on the real clock fails
/// here within 5 s: it is never seen waiting on the virtual one.) A bound
/// past the listener window ends at the window instead, saying the
/// simulation does not span processes (issue 33, item 7).
#[test]
fn connect_with_nobody_listening_times_out_at_the_virtual_bound() {
    let (fabric, server, client) = manual_pair();
    let long = ConnectParams {
        timeout: Duration::from_secs(30),
        ..ConnectParams::default()
    };
    let peer = SocketAddr::new(server.ip(), 9);
    let err = at_the_virtual_bound(&fabric, gdr_sim::LISTENER_WINDOW, || {
        client
            .cm
            .connect(peer, &client.pd, &client.cq, &client.cq, &long, HELLO)
            .unwrap_err()
    });
    assert!(
        matches!(
            &err,
            VerbsError::NotListeningInSimulation { waited, .. } if *waited == gdr_sim::LISTENER_WINDOW
        ),
        "{err}"
    );
    assert!(err.to_string().contains("does not span processes"), "{err}");
    let bound = gdr_sim::LISTENER_WINDOW / 2;
    let params = ConnectParams {
        timeout: bound,
        ..ConnectParams::default()
    };
    for peer in [
        // A host that exists, no listener on the port.
        SocketAddr::new(server.ip(), 9),
        // No host at all.
        SocketAddr::from((Ipv4Addr::new(10, 77, 9, 9), 7471)),
    ] {
        let err = at_the_virtual_bound(&fabric, bound, || {
            client
                .cm
                .connect(peer, &client.pd, &client.cq, &client.cq, &params, HELLO)
                .unwrap_err()
        });
        assert!(
            matches!(err, VerbsError::Timeout { waited, .. } if waited == bound),
            "{peer}: {err}"
        );
    }
    // Nothing is left behind on the server's device.
    let listener = server
        .cm
        .listen(SocketAddr::new(server.ip(), 9), 1)
        .unwrap();
    let bound = Duration::from_millis(50);
    let err = at_the_virtual_bound(&fabric, bound, || listener.next_request(bound).unwrap_err());
    assert!(
        matches!(err, VerbsError::Timeout { waited, .. } if waited == bound),
        "{err}"
    );
}

/// In Auto mode the waits keep running on the real clock, as before the
/// virtual clock.
#[test]
fn auto_mode_waits_on_the_real_clock() {
    let (fabric, server, client) = pair();
    assert_eq!(fabric.clock().mode(), ClockMode::Auto);
    let bound = Duration::from_millis(100);
    let params = ConnectParams {
        timeout: bound,
        ..ConnectParams::default()
    };
    let start = Instant::now();
    let err = client
        .cm
        .connect(
            SocketAddr::new(server.ip(), 9),
            &client.pd,
            &client.cq,
            &client.cq,
            &params,
            HELLO,
        )
        .unwrap_err();
    let took = start.elapsed();
    assert!(matches!(err, VerbsError::Timeout { .. }), "{err}");
    assert!(
        took >= bound && took < bound + Duration::from_secs(2),
        "{took:?}"
    );
    assert_eq!(fabric.cm_virtual_waits(), 0);
}

#[test]
fn a_client_started_before_its_server_retries_until_it_listens() {
    // On the Manual clock: the client is surely waiting (for a listener)
    // when the server listens, and no time passes at all.
    let (fabric, server, client) = manual_pair();
    let addr = SocketAddr::new(server.ip(), 7000);
    let conn = std::thread::scope(|s| {
        let c = s.spawn(|| {
            client
                .cm
                .connect(addr, &client.pd, &client.cq, &client.cq, &fast(), b"late")
        });
        until_virtual_waits(&fabric, 1);
        let listener = server.cm.listen(addr, 1).unwrap();
        let request = listener.next_request(Duration::from_secs(5)).unwrap();
        let conn = request
            .accept(&server.pd, &server.cq, &server.cq, &fast(), b"")
            .unwrap();
        assert_eq!(conn.peer_private_data(), b"late");
        (c.join().unwrap().unwrap(), conn)
    });
    assert!(conn.0.peer_private_data().is_empty());
    assert_eq!(fabric.clock().now(), Duration::ZERO);
    // Dropping one side disconnects it; the other sees it.
    drop(conn.0);
    assert_eq!(
        conn.1.poll_state(Duration::from_secs(1)).unwrap(),
        ConnectionState::Disconnected
    );
}

#[test]
fn a_reject_reaches_the_client_at_once_with_its_private_data() {
    let (_fabric, server, client) = pair();
    let listener = server
        .cm
        .listen(SocketAddr::new(server.ip(), 0), 1)
        .unwrap();
    let addr = listener.local_addr();
    assert_ne!(addr.port(), 0, "a port is assigned");
    let err = std::thread::scope(|s| {
        s.spawn(|| {
            let request = listener.next_request(Duration::from_secs(5)).unwrap();
            request.reject(b"go away").unwrap();
            // A dropped request is rejected too.
            let request = listener.next_request(Duration::from_secs(5)).unwrap();
            drop(request);
        });
        let start = Instant::now();
        let err = client
            .cm
            .connect(addr, &client.pd, &client.cq, &client.cq, &fast(), HELLO)
            .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(2));
        let err2 = client
            .cm
            .connect(addr, &client.pd, &client.cq, &client.cq, &fast(), HELLO)
            .unwrap_err();
        assert!(
            matches!(err2, VerbsError::ConnectionRejected { .. }),
            "{err2}"
        );
        err
    });
    match err {
        VerbsError::ConnectionRejected {
            status,
            private_data,
            ..
        } => assert_eq!((status, private_data.as_slice()), (28, &b"go away"[..])),
        other => panic!("{other}"),
    }
}

#[test]
fn bad_parameters_are_refused_before_anything_is_sent() {
    let (fabric, server, client) = pair();
    let addr = SocketAddr::new(server.ip(), 7471);
    let cm = &client.cm;
    let (pd, cq) = (&client.pd, &client.cq);
    let too_long = vec![0u8; MAX_CONNECT_PRIVATE_DATA + 1];
    let err = cm
        .connect(addr, pd, cq, cq, &fast(), &too_long)
        .unwrap_err();
    assert!(matches!(err, VerbsError::InvalidArgument { .. }), "{err}");
    let forever = ConnectParams {
        retry_count: 7,
        ..fast()
    };
    let err = cm.connect(addr, pd, cq, cq, &forever, HELLO).unwrap_err();
    assert!(err.to_string().contains("retry forever"), "{err}");
    // ACK timeout 0 switches the transport timer off: as infinite.
    let no_timer = ConnectParams {
        ack_timeout: Some(0),
        ..fast()
    };
    let err = cm.connect(addr, pd, cq, cq, &no_timer, HELLO).unwrap_err();
    assert!(matches!(err, VerbsError::InvalidArgument { .. }), "{err}");
    assert!(err.to_string().contains("ACK timeout 0"), "{err}");

    // A PD of the wrong device: the client's route to the server leaves
    // from sim0, and the PD is of sim1.
    let two = Node::new(&fabric, "two", NodeConfig::with_devices(2));
    let other = two.verbs.open("sim1").unwrap();
    let pd1 = other.alloc_pd().unwrap();
    let cq1 = other.create_cq(8).unwrap();
    let err = two
        .cm
        .connect(addr, &pd1, &cq1, &cq1, &fast(), HELLO)
        .unwrap_err();
    assert!(
        matches!(&err, VerbsError::InvalidArgument { reason, .. } if reason.contains("sim0")),
        "{err}"
    );
    // Naming sim1's address as the source makes it right.
    let source = Some(IpAddr::V4(two.verbs.device_ipv4("sim1").unwrap()));
    let params = ConnectParams {
        source,
        timeout: Duration::from_millis(50),
        ..fast()
    };
    let err = two
        .cm
        .connect(addr, &pd1, &cq1, &cq1, &params, HELLO)
        .unwrap_err();
    assert!(matches!(err, VerbsError::Timeout { .. }), "{err}");
    drop(two.ctx);

    // Listening twice on one address, or on an address not ours.
    let _l = server.cm.listen(addr, 1).unwrap();
    let err = server.cm.listen(addr, 1).unwrap_err();
    assert_eq!(err.errno(), Some(libc::EADDRINUSE), "{err}");
    let err = server
        .cm
        .listen(SocketAddr::new(client.ip(), 1), 1)
        .unwrap_err();
    assert!(matches!(err, VerbsError::NoDevice { .. }), "{err}");
    let _ = &server.ctx;
}

/// `disconnect()` from another thread while `poll_state` waits (long
/// timeout) returns at once, and the waiting `poll_state` returns promptly
/// with `Disconnected`: the wait holds no lock `disconnect` needs.
#[test]
fn disconnect_while_poll_state_waits_returns_promptly() {
    let (fabric, server, client) = manual_pair();
    let addr = SocketAddr::new(server.ip(), 7471);
    let listener = server.cm.listen(addr, 1).unwrap();
    let (server_conn, client_conn) = std::thread::scope(|s| {
        let c = s.spawn(|| {
            client
                .cm
                .connect(addr, &client.pd, &client.cq, &client.cq, &fast(), HELLO)
        });
        let request = listener.next_request(Duration::from_secs(5)).unwrap();
        let conn = request
            .accept(&server.pd, &server.cq, &server.cq, &fast(), b"")
            .unwrap();
        (conn, c.join().unwrap().unwrap())
    });
    // With nothing happening, poll_state returns Connected at its (virtual)
    // timeout.
    let bound = Duration::from_secs(30);
    let state = at_the_virtual_bound(&fabric, bound, || client_conn.poll_state(bound).unwrap());
    assert_eq!(state, ConnectionState::Connected);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let t = Instant::now();
            let state = client_conn.poll_state(Duration::from_secs(30)).unwrap();
            (state, t.elapsed())
        });
        // Surely waiting (on the virtual clock, which no one advances).
        until_virtual_waits(&fabric, 1);
        let t = Instant::now();
        client_conn.disconnect().unwrap();
        let took = t.elapsed();
        assert!(took < Duration::from_secs(1), "disconnect() took {took:?}");
        let (state, waited) = waiter.join().unwrap();
        assert_eq!(state, ConnectionState::Disconnected);
        assert!(
            waited < Duration::from_secs(5),
            "poll_state waited {waited:?}"
        );
    });
    assert_eq!(
        server_conn.poll_state(Duration::from_secs(5)).unwrap(),
        ConnectionState::Disconnected
    );
}
