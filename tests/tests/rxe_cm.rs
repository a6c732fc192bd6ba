//! rdma_cm through the HAL on a real device: SoftRoCE's `rxe0` in the VM
//! (`softroce/run-in-vm.sh` as the cargo runner, `GDR_EXPECT_RXE=1`), and
//! between two guests on a virtual wire (`softroce/two-guest-cm.sh`).
//!
//! One guest: a server thread and a client thread on rxe0's address
//! (10.99.0.1; rdma_cm cannot use 127.0.0.1 there). The server sends its
//! buffer's memory descriptor in the accept's private data, the client a
//! hello in the request's; the client WRITEs and READs through the
//! descriptor.
//!
//! Two guests (`rxe_cm_two_guests`, skipped unless `GDR_CM_ROLE` is set):
//! `GDR_CM_ROLE=server` listens on `0.0.0.0:$GDR_CM_PORT` (default 7471);
//! `GDR_CM_ROLE=client` connects to `$GDR_CM_PEER:$GDR_CM_PORT`, retrying
//! until the other guest is up. With `GDR_CM_HOLD=1` the server holds the
//! connection until it is killed and the client READs in a loop, printing
//! `GDR_CM_TRANSFERS_RUNNING`, then measures how long its requests take to
//! fail once the server's guest is gone. `GDR_CM_ACK_TIMEOUT` overrides the
//! QP's ACK timeout code (a number, or `cm` for the one rdma_cm derives;
//! default: the HAL's).
//!
//! Without an RDMA device every test skips with its reason on stderr; with
//! `GDR_EXPECT_RXE=1` a missing `rxe0` is a failure.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use gdr_core::descriptor::{GrantRights, MemoryDescriptor, MemoryLocation, Reach, Segment};
use gdr_tests::rxe::{self, HostBuf, serial, sge};
use gdr_tests::{pattern, skip};
use hal_verbs::rdma::{RdmaCm, RdmaConnection, RdmaContext, RdmaCq, RdmaMr, RdmaPd};
use hal_verbs::{
    AccessFlags, Completion, CompletionQueue, ConnectParams, ConnectRequest, Connection,
    ConnectionManager, ConnectionState, Context, Listener, MemoryRegion, Provider, QpState,
    QueuePair, SendFlags, SendOp, SendRequest, SgList, VerbsError, WcStatus,
};

const HELLO: &[u8] = b"gdr-hello v1";
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(30);

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The opened device, a PD, a CQ and the connection manager; `None` after
/// printing why the test skips (a failure with `GDR_EXPECT_RXE=1`).
struct Rxe {
    cm: RdmaCm,
    ctx: RdmaContext,
    pd: RdmaPd,
    cq: RdmaCq,
}

fn open_rxe(test: &str) -> Option<Rxe> {
    let (provider, ctx) = rxe::open_rxe(test)?;
    let cm = match provider.connection_manager() {
        Ok(cm) => cm,
        Err(e) => {
            assert!(!rxe::expect_rxe(), "{test}: GDR_EXPECT_RXE=1 but {e}");
            skip(test, &e.to_string());
            return None;
        }
    };
    let pd = ctx.alloc_pd().expect("PD");
    let cq = ctx.create_cq(256).expect("CQ");
    Some(Rxe { cm, ctx, pd, cq })
}

/// A v2 descriptor of all of `mr`, one segment on `device`; the owner and
/// grant ids are made up (no engine here).
fn descriptor(mr: &RdmaMr, device: &str) -> MemoryDescriptor {
    let len = mr.len() as u64;
    MemoryDescriptor {
        owner: 1,
        grant: 1,
        location: MemoryLocation::Host,
        rights: GrantRights::ReadWrite,
        len,
        reach: Reach::Direct(vec![Segment {
            offset: 0,
            len,
            addr: mr.addr(),
            rkey: mr.rkey(),
            device: device.to_owned(),
        }]),
    }
}

/// The one segment of a descriptor `descriptor` made.
fn only_segment(descriptor: &MemoryDescriptor) -> &Segment {
    let device = descriptor.devices().next().expect("a segment");
    descriptor
        .segment(device, 0, descriptor.len)
        .expect("one segment covering the grant")
}

/// Posts one signaled request and waits for its completion.
fn run(conn: &RdmaConnection, cq: &RdmaCq, wr_id: u64, op: SendOp, sg: SgList) -> Completion {
    let request = SendRequest {
        wr_id,
        op,
        sg_list: sg,
        flags: SendFlags::SIGNALED,
    };
    // SAFETY: the tests keep buffers and regions alive until the completion
    // is polled (or the connection is dropped first).
    unsafe { conn.qp().post_send(&[request]) }.expect("post_send");
    let start = Instant::now();
    let mut wc = [Completion::default()];
    loop {
        if cq.poll(&mut wc).expect("poll") == 1 {
            return wc[0];
        }
        assert!(
            start.elapsed() < COMPLETION_TIMEOUT,
            "no completion for {wr_id}"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn params(timeout: Duration) -> ConnectParams {
    let default = ConnectParams::default();
    let ack_timeout = match env("GDR_CM_ACK_TIMEOUT").as_deref() {
        None => default.ack_timeout,
        Some("cm") => None,
        Some(code) => Some(code.parse().expect("GDR_CM_ACK_TIMEOUT: a number or cm")),
    };
    ConnectParams {
        timeout,
        ack_timeout,
        ..default
    }
}

/// The client's half of the transfer check: READ the server's original
/// pattern, WRITE ours over the first half, READ it back.
fn client_transfers(rxe: &Rxe, conn: &RdmaConnection, len: usize) -> Duration {
    let descriptor = MemoryDescriptor::decode(&conn.peer_private_data()).expect("descriptor");
    assert_eq!(descriptor.len, len as u64);
    let remote = only_segment(&descriptor);
    let local = HostBuf::new(2 * len, 42);
    let mr = local.register(&rxe.pd, 0, local.len(), AccessFlags::transfer());
    let start = Instant::now();
    let read = SendOp::Read {
        remote_addr: remote.addr,
        rkey: remote.rkey,
    };
    let wc = run(conn, &rxe.cq, 1, read, sge(&mr, len as u64, len as u32));
    assert_eq!(wc.status, WcStatus::SUCCESS, "{wc:?}");
    assert!(
        local.read()[len..] == pattern(len, 7)[..],
        "READ of the server's buffer differs"
    );
    let half = len / 2;
    let write = SendOp::Write {
        remote_addr: remote.addr,
        rkey: remote.rkey,
    };
    let wc = run(conn, &rxe.cq, 2, write, sge(&mr, 0, half as u32));
    assert_eq!(wc.status, WcStatus::SUCCESS, "{wc:?}");
    let wc = run(conn, &rxe.cq, 3, read, sge(&mr, len as u64, half as u32));
    assert_eq!(wc.status, WcStatus::SUCCESS, "{wc:?}");
    assert!(
        local.read()[len..len + half] == pattern(2 * len, 42)[..half],
        "READ after WRITE differs"
    );
    start.elapsed()
}

/// The server's buffer after the client's WRITE of its first half.
fn expected_after_write(len: usize) -> Vec<u8> {
    let mut want = pattern(2 * len, 42)[..len / 2].to_vec();
    want.extend_from_slice(&pattern(len, 7)[len / 2..]);
    want
}

#[test]
fn rxe_cm_connect_accept_write_read() {
    const T: &str = "rxe_cm_connect_accept_write_read";
    let _serial = serial();
    let Some(server) = open_rxe(T) else {
        return;
    };
    let client = open_rxe(T).expect("a second handle on the device");
    const LEN: usize = 1 << 20;
    let target = HostBuf::new(LEN, 7);
    let target_mr = target.register(&server.pd, 0, target.len(), AccessFlags::transfer());
    let addr = SocketAddr::new(rxe::expected_ip(), 7471);
    let device = client.cm.route_device(addr.ip(), Duration::from_secs(5));
    assert_eq!(device.expect("route_device"), rxe::device_name());

    // The client starts first: it must retry until the server listens.
    let start = Instant::now();
    let (server_conn, client_conn) = std::thread::scope(|s| {
        let c = s.spawn(|| {
            client.cm.connect(
                addr,
                &client.pd,
                &client.cq,
                &client.cq,
                &params(Duration::from_secs(30)),
                HELLO,
            )
        });
        std::thread::sleep(Duration::from_millis(500));
        let listener = server.cm.listen(addr, 8).expect("listen");
        assert_eq!(listener.local_addr(), addr);
        let request = listener
            .next_request(Duration::from_secs(30))
            .expect("request");
        assert_eq!(request.private_data(), HELLO);
        assert_eq!(request.device(), rxe::device_name());
        assert_eq!(request.peer_addr().ip(), rxe::expected_ip());
        let md = descriptor(&target_mr, &request.device()).encode().unwrap();
        let conn = request
            .accept(
                &server.pd,
                &server.cq,
                &server.cq,
                &params(Duration::from_secs(30)),
                &md,
            )
            .expect("accept");
        (conn, c.join().unwrap().expect("connect"))
    });
    let connected = start.elapsed();
    assert_eq!(server_conn.peer_private_data(), HELLO);
    assert_eq!(client_conn.qp().state().unwrap(), QpState::ReadyToSend);
    assert_eq!(server_conn.qp().state().unwrap(), QpState::ReadyToSend);
    assert_eq!(client_conn.peer_addr(), addr);
    assert_eq!(server_conn.local_addr(), addr);
    assert_eq!(client_conn.device(), rxe::device_name());

    let took = client_transfers(&client, &client_conn, LEN);
    assert!(target.read() == expected_after_write(LEN), "server buffer");

    // Disconnect: the peer sees it; both queue pairs flush.
    assert_eq!(
        server_conn.poll_state(Duration::ZERO).unwrap(),
        ConnectionState::Connected
    );
    let t = Instant::now();
    client_conn.disconnect().expect("disconnect");
    let state = server_conn.poll_state(Duration::from_secs(10)).unwrap();
    let seen = t.elapsed();
    assert_eq!(state, ConnectionState::Disconnected);
    assert_eq!(server_conn.qp().state().unwrap(), QpState::Error);
    assert_eq!(client_conn.qp().state().unwrap(), QpState::Error);
    eprintln!(
        "{T}: connected (client first, server 0.5 s late) in {connected:?}; \
         READ+WRITE+READ of 1 MiB + 2x512 KiB in {took:?}; disconnect seen by the peer in {seen:?}"
    );
}

#[test]
fn rxe_cm_no_listener_times_out() {
    const T: &str = "rxe_cm_no_listener_times_out";
    let _serial = serial();
    let Some(client) = open_rxe(T) else {
        return;
    };
    let bound = Duration::from_secs(2);
    let addr = SocketAddr::new(rxe::expected_ip(), 7999);
    let start = Instant::now();
    let err = client
        .cm
        .connect(
            addr,
            &client.pd,
            &client.cq,
            &client.cq,
            &params(bound),
            HELLO,
        )
        .unwrap_err();
    let took = start.elapsed();
    eprintln!("{T}: {err} after {took:?}");
    assert!(matches!(err, VerbsError::Timeout { .. }), "{err}");
    assert!(
        took >= bound && took < bound + Duration::from_secs(3),
        "{took:?}"
    );
    // What rdma_cm said each time: a reject for nobody listening.
    assert!(err.to_string().contains("REJECTED"), "{err}");
}

#[test]
fn rxe_cm_reject_and_limits() {
    const T: &str = "rxe_cm_reject_and_limits";
    let _serial = serial();
    let Some(server) = open_rxe(T) else {
        return;
    };
    let client = open_rxe(T).expect("a second handle on the device");
    let listener = server
        .cm
        .listen(SocketAddr::new(rxe::expected_ip(), 0), 4)
        .expect("listen");
    let addr = listener.local_addr();
    assert_ne!(addr.port(), 0);
    let p = params(Duration::from_secs(20));
    let err = std::thread::scope(|s| {
        s.spawn(|| {
            let request = listener.next_request(Duration::from_secs(20)).unwrap();
            request.reject(b"go away").unwrap();
        });
        let start = Instant::now();
        let err = client
            .cm
            .connect(addr, &client.pd, &client.cq, &client.cq, &p, HELLO)
            .unwrap_err();
        eprintln!("{T}: rejected after {:?}", start.elapsed());
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
    // Limits are checked before anything is sent.
    let too_long = vec![1u8; hal_verbs::MAX_CONNECT_PRIVATE_DATA + 1];
    let err = client
        .cm
        .connect(addr, &client.pd, &client.cq, &client.cq, &p, &too_long)
        .unwrap_err();
    assert!(matches!(err, VerbsError::InvalidArgument { .. }), "{err}");
    let forever = ConnectParams {
        retry_count: 7,
        ..p.clone()
    };
    let err = client
        .cm
        .connect(addr, &client.pd, &client.cq, &client.cq, &forever, HELLO)
        .unwrap_err();
    assert!(err.to_string().contains("retry forever"), "{err}");
    // The largest private data both ways arrive whole.
    let big_req = pattern(hal_verbs::MAX_CONNECT_PRIVATE_DATA, 3);
    let big_rep = pattern(hal_verbs::MAX_ACCEPT_PRIVATE_DATA, 4);
    let (s_conn, c_conn) = std::thread::scope(|s| {
        let srv = s.spawn(|| {
            let request = listener.next_request(Duration::from_secs(20)).unwrap();
            assert_eq!(request.private_data(), big_req);
            request
                .accept(&server.pd, &server.cq, &server.cq, &p, &big_rep)
                .unwrap()
        });
        let c = client
            .cm
            .connect(addr, &client.pd, &client.cq, &client.cq, &p, &big_req)
            .unwrap();
        (srv.join().unwrap(), c)
    });
    assert_eq!(c_conn.peer_private_data(), big_rep);
    assert_eq!(s_conn.peer_private_data(), big_req);
    // Dropping the server's side disconnects the client's.
    drop(s_conn);
    assert_eq!(
        c_conn.poll_state(Duration::from_secs(10)).unwrap(),
        ConnectionState::Disconnected
    );
    let _ = (&server.ctx, &client.ctx);
}

/// One side of the two-guest run (see the module docs).
#[test]
fn rxe_cm_two_guests() {
    const T: &str = "rxe_cm_two_guests";
    let Some(role) = env("GDR_CM_ROLE") else {
        skip(
            T,
            "GDR_CM_ROLE is not set (softroce/two-guest-cm.sh sets it)",
        );
        return;
    };
    let _serial = serial();
    let Some(rxe) = open_rxe(T) else {
        return;
    };
    let port: u16 = env("GDR_CM_PORT").map_or(7471, |p| p.parse().expect("GDR_CM_PORT"));
    let hold = env("GDR_CM_HOLD").is_some_and(|v| v == "1");
    const LEN: usize = 1 << 20;
    match role.as_str() {
        "server" => {
            let target = HostBuf::new(LEN, 7);
            let mr = target.register(&rxe.pd, 0, target.len(), AccessFlags::transfer());
            let any = SocketAddr::from(([0, 0, 0, 0], port));
            let listener = rxe.cm.listen(any, 8).expect("listen");
            eprintln!("{T}: server listening on {}", listener.local_addr());
            let request = listener
                .next_request(Duration::from_secs(300))
                .expect("request");
            assert_eq!(request.private_data(), HELLO);
            let device = request.device();
            assert_eq!(device, rxe::device_name());
            let md = descriptor(&mr, &device).encode().unwrap();
            let p = params(Duration::from_secs(60));
            let conn = request
                .accept(&rxe.pd, &rxe.cq, &rxe.cq, &p, &md)
                .expect("accept");
            eprintln!("{T}: server accepted {}", conn.peer_addr());
            if hold {
                eprintln!("{T}: server holding the connection until killed");
                std::thread::sleep(Duration::from_secs(600));
                panic!("{T}: the server was not killed");
            }
            let state = conn.poll_state(Duration::from_secs(300)).unwrap();
            assert_eq!(state, ConnectionState::Disconnected);
            assert!(target.read() == expected_after_write(LEN), "server buffer");
            eprintln!("{T}: server saw the client's WRITE and its disconnect: ok");
        }
        "client" => {
            let peer_ip: IpAddr = env("GDR_CM_PEER")
                .unwrap_or_else(|| "10.99.0.1".into())
                .parse()
                .expect("GDR_CM_PEER");
            let peer = SocketAddr::new(peer_ip, port);
            let device = rxe.cm.route_device(peer_ip, Duration::from_secs(60));
            eprintln!("{T}: client routes to {peer} via {device:?}");
            let p = params(Duration::from_secs(300));
            let start = Instant::now();
            let conn = rxe
                .cm
                .connect(peer, &rxe.pd, &rxe.cq, &rxe.cq, &p, HELLO)
                .expect("connect");
            eprintln!(
                "{T}: client connected to {peer} from {} in {:?}",
                conn.local_addr(),
                start.elapsed()
            );
            if hold {
                dead_peer(&rxe, &conn);
                return;
            }
            let took = client_transfers(&rxe, &conn, LEN);
            eprintln!("{T}: client READ+WRITE+READ over the wire in {took:?}: ok");
            conn.disconnect().expect("disconnect");
        }
        other => panic!("GDR_CM_ROLE={other}: expected server or client"),
    }
}

/// READs in a loop until one fails; reports how long after the last
/// success (the server's guest is killed in between).
fn dead_peer(rxe: &Rxe, conn: &RdmaConnection) {
    const T: &str = "rxe_cm_two_guests";
    let descriptor = MemoryDescriptor::decode(&conn.peer_private_data()).expect("descriptor");
    let remote = only_segment(&descriptor);
    let local = HostBuf::new(4096, 0);
    let mr = local.register(&rxe.pd, 0, local.len(), AccessFlags::transfer());
    let op = SendOp::Read {
        remote_addr: remote.addr,
        rkey: remote.rkey,
    };
    let mut last_ok = Instant::now();
    let begin = Instant::now();
    let mut ok = 0u64;
    loop {
        let request = SendRequest {
            wr_id: ok,
            op,
            sg_list: sge(&mr, 0, 4096),
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: the buffer and region outlive the completion polled below.
        unsafe { conn.qp().post_send(&[request]) }.expect("post_send");
        let mut wc = [Completion::default()];
        while rxe.cq.poll(&mut wc).expect("poll") == 0 {
            assert!(begin.elapsed() < Duration::from_secs(300), "never failed");
            std::thread::sleep(Duration::from_millis(1));
        }
        if !wc[0].status.is_success() {
            let after = last_ok.elapsed();
            let state = conn.poll_state(Duration::ZERO).unwrap();
            eprintln!(
                "{T}: DEAD-PEER: READ failed with {} {after:?} after the last success \
                 ({ok} READs ok before; connection state then {state:?})",
                wc[0].status
            );
            assert_eq!(wc[0].status, WcStatus::RETRY_EXC_ERR);
            return;
        }
        ok += 1;
        last_ok = Instant::now();
        if ok == 20 {
            eprintln!("GDR_CM_TRANSFERS_RUNNING");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `disconnect()` from another thread while `poll_state` waits with a long
/// timeout returns at once (the wait holds no lock it needs), and the
/// waiting `poll_state` returns promptly with `Disconnected`.
#[test]
fn rxe_cm_disconnect_while_poll_state_waits() {
    const T: &str = "rxe_cm_disconnect_while_poll_state_waits";
    let _serial = serial();
    let Some(server) = open_rxe(T) else {
        return;
    };
    let client = open_rxe(T).expect("a second handle on the device");
    let addr = SocketAddr::new(rxe::expected_ip(), 7472);
    let listener = server.cm.listen(addr, 8).expect("listen");
    let (server_conn, client_conn) = std::thread::scope(|s| {
        let c = s.spawn(|| {
            client.cm.connect(
                addr,
                &client.pd,
                &client.cq,
                &client.cq,
                &params(Duration::from_secs(30)),
                HELLO,
            )
        });
        let request = listener
            .next_request(Duration::from_secs(30))
            .expect("request");
        let conn = request
            .accept(
                &server.pd,
                &server.cq,
                &server.cq,
                &params(Duration::from_secs(30)),
                b"",
            )
            .expect("accept");
        (conn, c.join().unwrap().expect("connect"))
    });
    let (took, state, waited) = std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let t = Instant::now();
            let state = client_conn.poll_state(Duration::from_secs(30));
            (state, t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        client_conn.disconnect().expect("disconnect");
        let took = t.elapsed();
        let (state, waited) = waiter.join().unwrap();
        (took, state, waited)
    });
    eprintln!(
        "{T}: disconnect() took {took:?}; the waiting poll_state returned {state:?} after {waited:?}"
    );
    assert!(took < Duration::from_secs(2), "disconnect() took {took:?}");
    assert_eq!(state.expect("poll_state"), ConnectionState::Disconnected);
    assert!(
        waited < Duration::from_secs(5),
        "poll_state waited {waited:?}"
    );
    assert_eq!(client_conn.qp().state().unwrap(), QpState::Error);
    assert_eq!(
        server_conn.poll_state(Duration::from_secs(10)).unwrap(),
        ConnectionState::Disconnected
    );
}
