//! The engine re-establishes a failed queue pair (simulated NICs): a QP
//! error fails only that queue pair's requests; the engine drains it,
//! reconnects it (same session, same index) and later requests succeed on
//! it, control messages included (they ride on queue pair 0); a peer that
//! is gone for good turns into typed errors within the reconnect bound.

use std::time::{Duration, Instant};

use gdr_core::descriptor::GrantRights;
use gdr_core::engine::{EngineConfig, EngineError, Transfer, TransferError};
use gdr_sim::{GpuConfig, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, HostPair};
use gdr_tests::pattern;

const T: Duration = Duration::from_secs(10);

fn world(qps: u16, reconnect_timeout: Duration) -> EngineWorld<SimVerbsApi> {
    let config = EngineConfig::default()
        .with_qps_per_peer(qps)
        .with_slice_size(4096)
        .with_reconnect_timeout(reconnect_timeout)
        .with_default_timeout(T);
    EngineWorld::sim(1, GpuConfig::default(), config, T)
}

/// Retries `f` (making progress on both engines) until it returns `Some`,
/// or panics naming `what` after `T`.
fn eventually<R>(w: &EngineWorld<SimVerbsApi>, what: &str, mut f: impl FnMut() -> Option<R>) -> R {
    let deadline = Instant::now() + T;
    loop {
        if let Some(r) = f() {
            return r;
        }
        assert!(Instant::now() < deadline, "{what}: not within {T:?}");
        w.a.engine.progress();
        w.b.engine.progress();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Fails the queue pair a's next slice goes to: a WRITE through a grant b
/// revoked before a heard of it meets a remote access error (told as the
/// revocation).
fn fail_a_queue_pair(w: &EngineWorld<SimVerbsApi>, h: &HostPair) {
    let (doomed_grant, doomed) = w.b_grants(&h.dst, GrantRights::ReadWrite);
    drop(doomed_grant);
    let err =
        w.ab.submit(&[Transfer::write(&h.src, 0, &doomed, 0, 4096)])
            .unwrap()
            .wait(T)
            .unwrap_err();
    assert!(matches!(err, TransferError::Revoked { .. }), "{err}");
}

/// With a single queue pair, a remote access error takes down the only
/// path: the engine re-establishes it, and WRITEs, READs, grants made
/// before the failure and control messages both ways work again on it.
#[test]
fn the_only_queue_pair_fails_and_is_re_established() {
    let w = world(1, T);
    let h = w.host_pair(1 << 16, 5, GrantRights::ReadWrite);
    let before = w.ab.counters()[0].2;
    fail_a_queue_pair(&w, &h);
    // A batch submitted while the queue pair is being re-established waits
    // for it rather than failing.
    let waiting =
        w.ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, 1 << 16)])
            .unwrap_or_else(|e| panic!("submit while re-establishing: {e}"));
    let driver = w.b.engine.spawn_driver().unwrap();
    waiting
        .wait(T)
        .unwrap_or_else(|e| panic!("the batch that waited for the new queue pair: {e}"));
    assert_eq!(w.b.bytes(&h.dst_buf), pattern(1 << 16, 5));
    let after = w.ab.counters()[0].2;
    assert!(
        after.posted >= before.posted + 1 + 16,
        "the later batch went over queue pair 0: {before:?} -> {after:?}"
    );
    // READ back over the new queue pair.
    let (back_buf, back) = w.a.host(1 << 16, 0);
    w.ab.submit(&[Transfer::read(&back, 0, &h.remote, 0, 1 << 16)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(w.a.bytes(&back_buf), pattern(1 << 16, 5));
    // Control messages ride on queue pair 0: both ways again.
    w.ab.send(b"after").unwrap().wait(T).unwrap();
    assert_eq!(w.ba.recv(T).unwrap(), b"after");
    drop(driver);
    w.ba.send(b"back").unwrap();
    assert_eq!(w.ab.recv(T).unwrap(), b"back");
    // A grant made after the failure is announced over the new one.
    let (_g2, remote2) = w.b_grants(&h.dst, GrantRights::Read);
    w.ab.submit(&[Transfer::read(&back, 0, &remote2, 0, 4096)])
        .unwrap()
        .wait(T)
        .unwrap();
}

/// A batch past its deadline stops its queue pair; once the fabric moves
/// again the queue pair is re-established and later batches succeed.
#[test]
fn a_queue_pair_stopped_at_a_deadline_comes_back() {
    let w = world(1, T);
    let h = w.host_pair(1 << 16, 7, GrantRights::ReadWrite);
    w.fabric().set_paused(true);
    let err =
        w.ab.submit_with_timeout(
            &[Transfer::write(&h.src, 0, &h.remote, 0, 4096)],
            Duration::from_millis(50),
        )
        .unwrap()
        .wait(T)
        .unwrap_err();
    assert!(matches!(err, TransferError::Timeout(_)), "{err}");
    w.fabric().set_paused(false);
    let _driver = w.b.engine.spawn_driver().unwrap();
    w.ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, 1 << 16)])
        .unwrap()
        .wait(T)
        .unwrap_or_else(|e| panic!("after the queue pair came back: {e}"));
    assert_eq!(w.b.bytes(&h.dst_buf), pattern(1 << 16, 7));
}

/// Two queue pairs: while one is re-established, later batches go over the
/// other at once; afterwards both carry slices again.
#[test]
fn the_other_queue_pair_carries_on_while_one_is_re_established() {
    let w = world(2, T);
    let h = w.host_pair(1 << 16, 9, GrantRights::ReadWrite);
    fail_a_queue_pair(&w, &h);
    let _driver = w.b.engine.spawn_driver().unwrap();
    // Until both are up again, batches still succeed.
    let both_up = eventually(&w, "both queue pairs carry slices again", || {
        let before = w.ab.counters();
        w.ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, 1 << 16)])
            .unwrap()
            .wait(T)
            .unwrap_or_else(|e| panic!("a batch while one queue pair is down: {e}"));
        let after = w.ab.counters();
        let moved: Vec<u64> = before
            .iter()
            .zip(&after)
            .map(|(b, a)| a.2.posted - b.2.posted)
            .collect();
        (moved.iter().all(|&m| m > 0)).then_some(moved)
    });
    assert_eq!(both_up.iter().sum::<u64>(), 16, "{both_up:?}");
    assert_eq!(w.b.bytes(&h.dst_buf), pattern(1 << 16, 9));
}

/// The peer's engine is gone (dropped without a goodbye): its queue pairs
/// fail, re-establishing them is refused or times out, and requests then
/// fail typed: never a hang.
#[test]
fn a_peer_gone_for_good_is_given_up_within_the_reconnect_bound() {
    let w = world(2, Duration::from_millis(300));
    let h = w.host_pair(1 << 16, 3, GrantRights::ReadWrite);
    // Gone without a word: the fabric is held while b goes, so the
    // revocation notice its grant's drop posts dies with its queue pairs
    // (the sim's posts make progress, as a NIC's do: it would arrive).
    let fabric = w.fabric().clone();
    fabric.set_paused(true);
    let EngineWorld { ab, ba, a, b, .. } = w;
    let HostPair {
        grant,
        remote,
        src,
        src_buf: _src_buf,
        dst,
        dst_buf,
    } = h;
    drop((grant, ba, dst, dst_buf, b));
    fabric.set_paused(false);
    let refused = gdr_tests::engine_world::submit_until_gone(&ab, &src, &remote, T);
    assert!(matches!(refused, EngineError::PeerGone(_)), "{refused}");
    drop(a);
}

/// The accepting side re-establishes queue pair 0 without anyone making
/// progress on it (a server that only grants and never waits): its own
/// thread drains the old queue pair and installs the new one with its
/// control receives, so the connecting side's SEND goes through.
#[test]
fn the_accepting_side_installs_a_re_established_queue_pair_on_its_own() {
    let w = world(1, T);
    let h = w.host_pair(1 << 16, 5, GrantRights::ReadWrite);
    fail_a_queue_pair(&w, &h);
    // Only a makes progress from here on (its waits, its reconnect thread).
    w.ab.send(b"ping")
        .unwrap()
        .wait(T)
        .unwrap_or_else(|e| panic!("a SEND over the re-established queue pair: {e}"));
    assert_eq!(w.ba.recv(T).unwrap(), b"ping");
}

/// A control message waiting for queue pair 0 to come back has a
/// deadline the engine's driver must wake for: `next_deadline` names it
/// (it named only the batches' and the paths' deadlines, so a parked
/// driver slept past it until something else woke it). b accepted a's
/// session; a goes without a word, b's queue pair 0 fails and waits for
/// a's dial (up to the reconnect bound, a minute), and b's next message
/// waits with it.
#[test]
fn a_message_waiting_for_queue_pair_0_is_in_the_next_deadline() {
    let w = world(1, Duration::from_secs(60));
    let fabric = w.fabric().clone();
    fabric.set_paused(true);
    let EngineWorld { ab, ba, a, b, .. } = w;
    drop((ab, a));
    fabric.set_paused(false);
    // The first message finds a gone: queue pair 0 fails.
    let first = ba.send(b"one").unwrap().wait(T);
    assert!(first.is_err(), "a message to a gone engine: {first:?}");
    let waiting = ba.send(b"two").expect("queued while queue pair 0 is down");
    let sent = Instant::now();
    let next = b.engine.next_deadline();
    assert!(
        next.is_some_and(|at| at <= sent + T),
        "the waiting message's deadline (by {:?}) is not the next: {next:?}",
        sent + T
    );
    drop((waiting, ba, b));
}
