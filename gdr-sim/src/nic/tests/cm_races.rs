//! A connection given up by one side inside the other's window: whoever
//! is left removes the request and the connection records, so the fabric
//! ends with none (an engine dropped while its peer accepted its
//! reconnection left a request behind: the world's release check failed).

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hal_verbs::{
    ConnectParams, ConnectRequest, Connection, ConnectionManager, ConnectionState, Listener,
};

use super::super::cm::hooks;
use super::*;

/// One side: its CM, PD and CQ.
struct Node {
    verbs: SimVerbs,
    cm: SimCm,
    pd: SimPd,
    cq: SimCq,
}

fn node(fabric: &SimFabric, name: &str) -> Node {
    let verbs = fabric.add_node(name, NodeConfig::default());
    let cm = verbs.connection_manager().unwrap();
    let ctx = verbs.open("sim0").unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    Node { verbs, cm, pd, cq }
}

fn params(timeout: Duration) -> ConnectParams {
    ConnectParams {
        timeout,
        ..ConnectParams::default()
    }
}

/// Waits (5 s at most) until `done` is set by another thread.
fn until(done: &AtomicBool, what: &str) {
    let start = Instant::now();
    while !done.load(Ordering::SeqCst) {
        assert!(start.elapsed() < Duration::from_secs(5), "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The fabric's connection manager records, once the calls have returned.
fn cm_left(fabric: &SimFabric) -> (usize, usize) {
    let left = fabric.resources();
    (left.requests, left.connections)
}

/// The client gives up (its owner aborts its connects) after the server
/// took the request and checked it, before the server answered: the
/// server's accept fails, and removes the request `abandon` left to it.
#[test]
fn a_client_gone_while_the_server_accepts_leaves_no_request() {
    let fabric = SimFabric::new();
    let (server, client) = (node(&fabric, "server"), node(&fabric, "client"));
    let addr = SocketAddr::new(IpAddr::V4(server.verbs.device_ipv4("sim0").unwrap()), 7000);
    let listener = server.cm.listen(addr, 1).unwrap();
    let gone = std::sync::Arc::new(AtomicBool::new(false));
    std::thread::scope(|s| {
        let c = s.spawn(|| {
            let got = client.cm.connect(
                addr,
                &client.pd,
                &client.cq,
                &client.cq,
                &params(Duration::from_secs(5)),
                b"",
            );
            gone.store(true, Ordering::SeqCst);
            got
        });
        let request = listener.next_request(Duration::from_secs(5)).unwrap();
        let (cm, done) = (client.cm.clone(), std::sync::Arc::clone(&gone));
        hooks::set(&hooks::BEFORE_ACCEPTED, move || {
            cm.abort_connects();
            until(&done, "the aborted connect never returned");
        });
        let accepted = request.accept(
            &server.pd,
            &server.cq,
            &server.cq,
            &params(Duration::from_secs(5)),
            b"",
        );
        assert!(
            matches!(accepted, Err(VerbsError::Os { errno, .. }) if errno == libc::ECONNABORTED),
            "{accepted:?}"
        );
        assert!(c.join().unwrap().is_err(), "the aborted connect succeeded");
    });
    assert_eq!(cm_left(&fabric), (0, 0), "(requests, connections) left");
}

/// The server accepts, and its accept times out (100 ms) while the
/// client's connect (`client_timeout`) is held at `hook` until then;
/// returns the fabric, the listener (still listening) and what the
/// connect returned.
fn a_server_giving_up_at(
    hook: &'static std::thread::LocalKey<hooks::Hook>,
    port: u16,
    client_timeout: Duration,
) -> (SimFabric, SimListener, Result<SimConnection, VerbsError>) {
    let fabric = SimFabric::new();
    let (server, client) = (node(&fabric, "server"), node(&fabric, "client"));
    let addr = SocketAddr::new(IpAddr::V4(server.verbs.device_ipv4("sim0").unwrap()), port);
    let listener = server.cm.listen(addr, 1).unwrap();
    let given_up = std::sync::Arc::new(AtomicBool::new(false));
    let connected = std::thread::scope(|s| {
        let done = std::sync::Arc::clone(&given_up);
        let c = s.spawn(|| {
            hooks::set(hook, move || {
                until(&done, "the server's accept never timed out");
            });
            client.cm.connect(
                addr,
                &client.pd,
                &client.cq,
                &client.cq,
                &params(client_timeout),
                b"",
            )
        });
        let request = listener.next_request(Duration::from_secs(5)).unwrap();
        let accepted = request.accept(
            &server.pd,
            &server.cq,
            &server.cq,
            &params(Duration::from_millis(100)),
            b"",
        );
        assert!(
            matches!(accepted, Err(VerbsError::Timeout { .. })),
            "{accepted:?}"
        );
        given_up.store(true, Ordering::SeqCst);
        c.join().unwrap()
    });
    (fabric, listener, connected)
}

/// The server gives up waiting for the confirmation (its accept times
/// out) after the client saw the answer, before it confirmed: the
/// client's connect fails, and removes the request and its connection.
#[test]
fn a_server_gone_before_the_confirmation_leaves_nothing() {
    let (fabric, _listener, connected) =
        a_server_giving_up_at(&hooks::BEFORE_CONFIRMED, 7001, Duration::from_secs(5));
    assert!(
        matches!(connected, Err(VerbsError::Os { errno, .. }) if errno == libc::ECONNABORTED),
        "{connected:?}"
    );
    assert_eq!(cm_left(&fabric), (0, 0), "(requests, connections) left");
}

/// The server accepts and gives up waiting for the confirmation before
/// the client even looked for the answer: the client removes the
/// abandoned request, tries again and, with nobody taking its next
/// request, times out; nothing is left (the retry's request, never taken,
/// went when the client timed out).
#[test]
fn a_server_gone_before_the_client_saw_its_answer_leaves_nothing() {
    let (fabric, listener, connected) =
        a_server_giving_up_at(&hooks::BEFORE_ANSWER, 7002, Duration::from_millis(500));
    assert!(
        matches!(connected, Err(VerbsError::Timeout { .. })),
        "{connected:?}"
    );
    drop(listener);
    assert_eq!(cm_left(&fabric), (0, 0), "(requests, connections) left");
}

/// An engine looks at each peer's connection every pass: a connection still
/// up is looked at with the fabric held shared, so the look does not stop
/// every poster and poller of the fabric (it took the fabric exclusively,
/// and 12 threads of one engine stalled behind its peers' looks). A change
/// is still seen, under the exclusive lock.
#[test]
fn a_connection_still_up_is_looked_at_with_the_fabric_shared() {
    let fabric = SimFabric::new();
    let (server, client) = (node(&fabric, "server"), node(&fabric, "client"));
    let addr = SocketAddr::new(IpAddr::V4(server.verbs.device_ipv4("sim0").unwrap()), 7003);
    let listener = server.cm.listen(addr, 1).unwrap();
    let (client_conn, server_conn) = std::thread::scope(|s| {
        let c = s.spawn(|| {
            let params = params(Duration::from_secs(5));
            client
                .cm
                .connect(addr, &client.pd, &client.cq, &client.cq, &params, b"")
        });
        let request = listener.next_request(Duration::from_secs(5)).unwrap();
        let params = params(Duration::from_secs(5));
        let accepted = request.accept(&server.pd, &server.cq, &server.cq, &params, b"");
        (c.join().unwrap().unwrap(), accepted.unwrap())
    });
    let looked = AtomicBool::new(false);
    let state = std::thread::scope(|s| {
        // Another holder of the fabric shared (a poster, a poller).
        let held = fabric.read();
        let look = s.spawn(|| {
            let state = client_conn.poll_state(Duration::ZERO);
            looked.store(true, Ordering::SeqCst);
            state
        });
        until(&looked, "the look waited for the fabric's shared holder");
        drop(held);
        look.join().unwrap()
    });
    assert!(matches!(state, Ok(ConnectionState::Connected)), "{state:?}");
    server_conn.disconnect().unwrap();
    let state = client_conn.poll_state(Duration::ZERO);
    assert!(
        matches!(state, Ok(ConnectionState::Disconnected)),
        "{state:?}"
    );
}
