//! Accepts on one listener through the C ABI, on the simulation (issue 33,
//! item 9): `gdr_listener_accept` held a lock across its wait, so a second
//! caller waited out the first one's whole timeout before its own began.

use std::ffi::{CStr, CString, c_char};
use std::time::{Duration, Instant};

use gdr::GdrResult;
use gdr::api::{
    GdrBackend, GdrContext, GdrOptions, gdr_context_free, gdr_context_new, gdr_last_error_message,
};
use gdr::engine::{
    GdrEngine, GdrListener, GdrPeer, gdr_engine_connect, gdr_engine_free, gdr_engine_listen,
    gdr_engine_new, gdr_engine_nic_address, gdr_listener_accept, gdr_listener_free,
    gdr_listener_local_addr, gdr_peer_free,
};

fn last_error() -> String {
    let mut buf = [0 as c_char; 512];
    // SAFETY: `buf` is valid for its length; `needed` may be NULL.
    unsafe { gdr_last_error_message(buf.as_mut_ptr(), buf.len(), std::ptr::null_mut()) };
    // SAFETY: the message is NUL-terminated within `buf`.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn ok(result: GdrResult, what: &str) {
    assert_eq!(result, GdrResult::Ok, "{what}: {}", last_error());
}

/// A simulated context (a node of this process's fabric) and an engine on
/// it.
fn engine() -> (GdrContext, GdrEngine) {
    let options = GdrOptions {
        backend: GdrBackend::Sim,
    };
    let mut context = GdrContext { id: 0 };
    // SAFETY: valid pointers to locals.
    ok(
        unsafe { gdr_context_new(&options, &mut context) },
        "context",
    );
    let mut engine = GdrEngine { id: 0 };
    // SAFETY: NULL options (defaults); `engine` a local.
    ok(
        unsafe { gdr_engine_new(context, std::ptr::null(), &mut engine) },
        "engine",
    );
    (context, engine)
}

/// The text a C call writes into a buffer.
fn text(write: impl FnOnce(*mut c_char, usize) -> GdrResult) -> String {
    let mut buf = [0 as c_char; 128];
    ok(write(buf.as_mut_ptr(), buf.len()), "text");
    // SAFETY: written NUL-terminated within `buf`.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_str()
        .unwrap()
        .to_owned()
}

/// An accept of `timeout_ms` on `listener`: its result, peer and how long
/// it took.
fn accept(listener: GdrListener, timeout_ms: u32) -> (GdrResult, GdrPeer, Duration) {
    let mut peer = GdrPeer { id: 0 };
    let start = Instant::now();
    // SAFETY: `peer` a local.
    let result = unsafe { gdr_listener_accept(listener, timeout_ms, &mut peer) };
    (result, peer, start.elapsed())
}

/// Two threads accept on one listener with 5 s each; a third accept of
/// 100 ms meanwhile times out in about 100 ms, not held behind them; one
/// peer connects, and one of the two returns it at once while the other
/// goes on waiting.
#[test]
fn concurrent_accepts_on_one_listener_each_wait_on_their_own() {
    let (ca, ea) = engine();
    let (cb, eb) = engine();
    let ip = text(|buf, len| {
        // SAFETY: the buffer is valid for `len` bytes; `needed` NULL.
        unsafe { gdr_engine_nic_address(eb, 0, buf, len, std::ptr::null_mut()) }
    });
    let asked = CString::new(format!("{ip}:0")).unwrap();
    let mut listener = GdrListener { id: 0 };
    // SAFETY: `asked` NUL-terminated; `listener` a local.
    ok(
        unsafe { gdr_engine_listen(eb, asked.as_ptr(), &mut listener) },
        "listen",
    );
    let bound = text(|buf, len| {
        // SAFETY: the buffer is valid for `len` bytes; `needed` NULL.
        unsafe { gdr_listener_local_addr(listener, buf, len, std::ptr::null_mut()) }
    });
    let long = 5000;
    let (third, connected, accepted) = std::thread::scope(|scope| {
        let waiting: Vec<_> = (0..2)
            .map(|_| scope.spawn(move || accept(listener, long)))
            .collect();
        // Both are in their wait.
        std::thread::sleep(Duration::from_millis(200));
        let third = accept(listener, 100);
        let addr = CString::new(bound.clone()).unwrap();
        let mut ab = GdrPeer { id: 0 };
        let start = Instant::now();
        // SAFETY: `addr` NUL-terminated; `ab` a local.
        let connected = unsafe { gdr_engine_connect(ea, addr.as_ptr(), long, &mut ab) };
        let connected = (connected, ab, start.elapsed());
        let accepted: Vec<_> = waiting.into_iter().map(|t| t.join().unwrap()).collect();
        (third, connected, accepted)
    });
    assert_eq!(third.0, GdrResult::Timeout, "the third accept");
    assert!(
        third.2 < Duration::from_secs(1),
        "the third accept (100 ms) returned after {:?}: held behind another's wait",
        third.2
    );
    ok(connected.0, "connect");
    let (got, missed): (Vec<&(GdrResult, GdrPeer, Duration)>, Vec<_>) =
        accepted.iter().partition(|a| a.0 == GdrResult::Ok);
    assert_eq!(
        (got.len(), missed.len()),
        (1, 1),
        "one accept gets the peer: {accepted:?}"
    );
    assert_eq!(missed[0].0, GdrResult::Timeout, "the other times out");
    assert!(
        got[0].2 < Duration::from_secs(3),
        "the accept that got the peer returned after {:?}",
        got[0].2
    );
    ok(gdr_peer_free(got[0].1), "free b's peer");
    ok(gdr_peer_free(connected.1), "free a's peer");
    ok(gdr_listener_free(listener), "free the listener");
    ok(gdr_engine_free(ea), "free engine a");
    ok(gdr_engine_free(eb), "free engine b");
    ok(gdr_context_free(ca), "free context a");
    ok(gdr_context_free(cb), "free context b");
}
