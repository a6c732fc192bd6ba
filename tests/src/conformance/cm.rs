//! Connection management (rdma_cm) through the HAL: listen, connect and
//! accept with private data exchanged exactly, transfers through what the
//! accept carried, disconnect seen by the peer, reject with its private
//! data. Connect and accept block: the server runs on a scoped thread.

use std::net::SocketAddr;
use std::time::Duration;

use hal_verbs::{
    AccessFlags, Api, ConnectParams, ConnectRequest, Connection, ConnectionManager,
    ConnectionState, Context, Listener, MemoryRegion, Provider, QpState, QueuePair, SendFlags,
    SendOp, VerbsError, WcOpcode, WcStatus,
};

use crate::pair::{Backend, Buf, Node, req};

const HELLO: &[u8] = b"gdr-hello v1";
const LEN: usize = 64 * 1024;

fn params() -> ConnectParams {
    ConnectParams {
        timeout: Duration::from_secs(20),
        ..ConnectParams::default()
    }
}

/// The server's buffer as the accept carries it: address, length, rkey.
fn encode<A: Api>(buf: &Buf<A>) -> Vec<u8> {
    let mut out = buf.mr.addr().to_le_bytes().to_vec();
    out.extend_from_slice(&(buf.mr.len() as u64).to_le_bytes());
    out.extend_from_slice(&buf.mr.rkey().to_le_bytes());
    out
}

fn decode(data: &[u8]) -> (u64, u64, u32) {
    assert_eq!(data.len(), 20, "{data:?}");
    let u64_at = |i: usize| u64::from_le_bytes(data[i..i + 8].try_into().unwrap());
    (
        u64_at(0),
        u64_at(8),
        u32::from_le_bytes(data[16..20].try_into().unwrap()),
    )
}

/// Connect and accept, each side's private data arriving exactly as sent
/// (not the wire's zero padding); the client WRITEs and READs through the
/// buffer the accept described; a disconnect reaches the peer and both
/// QPs are in ERROR.
pub fn cm_connect_accept_write_read_disconnect<B: Backend>(b: &B) {
    let Some((server, client)) = b.cm_sides() else {
        return;
    };
    let facts = b.facts();
    let listener = server
        .cm
        .listen(SocketAddr::new(server.ip, 0), 8)
        .expect("listen");
    let addr = listener.local_addr();
    assert_ne!(addr.port(), 0, "a port is assigned");
    let device = client
        .cm
        .route_device(server.ip, Duration::from_secs(5))
        .expect("route");
    let cnode = Node::<B::A>::new(client.provider.open(&device).expect("open"));
    let ccq = cnode.ctx.create_cq(64).expect("CQ");

    let (snode, scq, target, sconn, cconn) = std::thread::scope(|s| {
        let srv = s.spawn(|| {
            let request = listener
                .next_request(Duration::from_secs(20))
                .expect("a request");
            assert_eq!(request.private_data(), HELLO);
            let node = Node::<B::A>::new(server.provider.open(&request.device()).expect("open"));
            let cq = node.ctx.create_cq(64).expect("CQ");
            let target = node.buf(LEN, 7, AccessFlags::transfer());
            let conn = request
                .accept(&node.pd, &cq, &cq, &params(), &encode(&target))
                .expect("accept");
            (node, cq, target, conn)
        });
        let conn = client
            .cm
            .connect(addr, &cnode.pd, &ccq, &ccq, &params(), HELLO)
            .expect("connect");
        let (node, cq, target, sconn) = srv.join().unwrap();
        (node, cq, target, sconn, conn)
    });
    assert_eq!(sconn.peer_private_data(), HELLO);
    assert_eq!(cconn.peer_addr(), addr);
    assert_eq!(cconn.qp().state().unwrap(), QpState::ReadyToSend);
    assert_eq!(sconn.qp().state().unwrap(), QpState::ReadyToSend);
    let (raddr, rlen, rkey) = decode(&cconn.peer_private_data());
    assert_eq!(
        (raddr, rlen, rkey),
        (target.addr(0), LEN as u64, target.mr.rkey())
    );

    let source = cnode.buf(LEN, 42, AccessFlags::transfer());
    let sink = cnode.buf(LEN, 0, AccessFlags::transfer());
    let write = SendOp::Write {
        remote_addr: raddr,
        rkey,
    };
    let read = SendOp::Read {
        remote_addr: raddr,
        rkey,
    };
    crate::pair::Pair::<B::A>::post(
        cconn.qp(),
        &[
            req(1, write, &[source.sge(0, LEN)], SendFlags::SIGNALED),
            req(2, read, &[sink.sge(0, LEN)], SendFlags::SIGNALED),
        ],
    );
    let wcs = crate::pair::wait::<B::A>(&ccq, 2, facts.completion_timeout);
    assert_eq!(
        wcs.iter()
            .map(|c| (c.wr_id, c.status, c.opcode))
            .collect::<Vec<_>>(),
        [
            (1, WcStatus::SUCCESS, WcOpcode::RdmaWrite),
            (2, WcStatus::SUCCESS, WcOpcode::RdmaRead)
        ]
    );
    assert!(target.bytes() == source.bytes(), "WRITE payload");
    assert!(sink.bytes() == source.bytes(), "READ payload");

    assert_eq!(
        sconn.poll_state(Duration::ZERO).unwrap(),
        ConnectionState::Connected
    );
    cconn.disconnect().expect("disconnect");
    cconn.disconnect().expect("a second disconnect");
    assert_eq!(cconn.qp().state().unwrap(), QpState::Error);
    assert_eq!(
        sconn.poll_state(Duration::from_secs(10)).unwrap(),
        ConnectionState::Disconnected
    );
    assert_eq!(sconn.qp().state().unwrap(), QpState::Error);
    drop((cconn, sconn, target, scq, snode, source, sink, ccq, cnode));
}

/// A reject reaches the client at once as ConnectionRejected with the
/// server's private data, exactly; private data over the limit is refused
/// before anything is sent.
pub fn cm_reject_carries_private_data<B: Backend>(b: &B) {
    let Some((server, client)) = b.cm_sides() else {
        return;
    };
    let listener = server
        .cm
        .listen(SocketAddr::new(server.ip, 0), 4)
        .expect("listen");
    let addr = listener.local_addr();
    let device = client
        .cm
        .route_device(server.ip, Duration::from_secs(5))
        .expect("route");
    let cnode = Node::<B::A>::new(client.provider.open(&device).expect("open"));
    let ccq = cnode.ctx.create_cq(16).expect("CQ");
    let too_long = vec![1u8; hal_verbs::MAX_CONNECT_PRIVATE_DATA + 1];
    let err = client
        .cm
        .connect(addr, &cnode.pd, &ccq, &ccq, &params(), &too_long)
        .expect_err("private data over the limit");
    assert!(matches!(err, VerbsError::InvalidArgument { .. }), "{err}");
    let err = std::thread::scope(|s| {
        s.spawn(|| {
            let request = listener
                .next_request(Duration::from_secs(20))
                .expect("a request");
            assert_eq!(request.private_data(), HELLO);
            request.reject(b"go away").expect("reject");
        });
        client
            .cm
            .connect(addr, &cnode.pd, &ccq, &ccq, &params(), HELLO)
            .expect_err("rejected")
    });
    match err {
        VerbsError::ConnectionRejected { private_data, .. } => {
            assert_eq!(private_data, b"go away");
        }
        other => panic!("{other:?}"),
    }
}

/// A listener's wake ends the wait for a connect request under way at
/// once (a timeout), and a wake before a wait ends the next one, and only
/// that one: how a listener's serving thread is told its owner is going.
pub fn cm_listener_wake_ends_the_wait<B: Backend>(b: &B) {
    let Some((server, _client)) = b.cm_sides() else {
        return;
    };
    let listener = server
        .cm
        .listen(SocketAddr::new(server.ip, 0), 8)
        .expect("listen");
    let long = Duration::from_secs(30);
    let start = std::time::Instant::now();
    let err = std::thread::scope(|scope| {
        let waiting = scope.spawn(|| listener.next_request(long));
        std::thread::sleep(Duration::from_millis(100));
        listener.wake();
        waiting.join().expect("the waiting thread")
    })
    .expect_err("no connect request came");
    assert!(matches!(err, VerbsError::Timeout { .. }), "{err}");
    assert!(start.elapsed() < long / 3, "the wake did not end the wait");
    listener.wake();
    let start = std::time::Instant::now();
    assert!(matches!(
        listener.next_request(long),
        Err(VerbsError::Timeout { .. })
    ));
    assert!(start.elapsed() < long / 3, "a wake before the wait");
    let start = std::time::Instant::now();
    assert!(matches!(
        listener.next_request(Duration::from_millis(200)),
        Err(VerbsError::Timeout { .. })
    ));
    assert!(
        start.elapsed() >= Duration::from_millis(200),
        "a wake ends one wait only"
    );
}

/// `abort_connects` ends a connect under way (here one retrying a port
/// nobody listens on, with half a minute left) at once, with `Timeout`;
/// a connect begun after it is not affected.
pub fn cm_abort_connects_ends_a_connect_under_way<B: Backend>(b: &B) {
    let Some((server, client)) = b.cm_sides() else {
        return;
    };
    // A port that was listened on and is no more.
    let dead = {
        let listener = server
            .cm
            .listen(SocketAddr::new(server.ip, 0), 8)
            .expect("listen");
        listener.local_addr()
    };
    let device = client
        .cm
        .route_device(server.ip, Duration::from_secs(5))
        .expect("route");
    let node = Node::<B::A>::new(client.provider.open(&device).expect("open"));
    let cq = node.ctx.create_cq(16).expect("CQ");
    let long = ConnectParams {
        timeout: Duration::from_secs(30),
        ..ConnectParams::default()
    };
    let start = std::time::Instant::now();
    let err = std::thread::scope(|scope| {
        let connecting = scope.spawn(|| client.cm.connect(dead, &node.pd, &cq, &cq, &long, HELLO));
        std::thread::sleep(Duration::from_millis(300));
        client.cm.abort_connects();
        connecting.join().expect("the connecting thread")
    })
    .expect_err("nobody listens");
    assert!(matches!(err, VerbsError::Timeout { .. }), "{err}");
    assert!(
        start.elapsed() < long.timeout / 3,
        "the abort did not end the connect: {:?}",
        start.elapsed()
    );
    let short = ConnectParams {
        timeout: Duration::from_millis(400),
        ..ConnectParams::default()
    };
    let start = std::time::Instant::now();
    let err = client
        .cm
        .connect(dead, &node.pd, &cq, &cq, &short, HELLO)
        .expect_err("nobody listens");
    assert!(matches!(err, VerbsError::Timeout { .. }), "{err}");
    assert!(
        start.elapsed() >= short.timeout,
        "a connect after the abort ran its own course: {:?}",
        start.elapsed()
    );
}
