//! Every state a peer creates on our side is bounded, and what waits on
//! the peer has a deadline (simulated NICs and GPUs): past a bound of
//! [`PeerLimits`] the peer's request is refused with a status it sees, or
//! the peer is dropped by name; a staged request that outlives its
//! deadline gives back the slots lent to it. Each bound is tested once
//! here; the reliability suite attacks them at scale.

use std::time::{Duration, Instant};

use gdr_core::descriptor::GrantRights;
use gdr_core::engine::wire::{Control, WireError};
use gdr_core::engine::{
    EngineConfig, EngineError, PeerGone, PeerLimits, PeerMisbehaved, Transfer, TransferError,
};
use gdr_sim::{GpuConfig, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, Kind, staged_through_slots};
use gdr_tests::pattern;

const T: Duration = Duration::from_secs(10);

fn world(limits: PeerLimits) -> EngineWorld<SimVerbsApi> {
    let config = staged_through_slots(
        EngineConfig::default()
            .with_qps_per_peer(1)
            .with_default_timeout(T)
            .with_peer_limits(limits),
    );
    EngineWorld::sim(1, GpuConfig::default(), config, T)
}

fn gone_because(err: EngineError, why: PeerMisbehaved) {
    assert!(
        matches!(&err, EngineError::PeerGone(PeerGone::Misbehaved(m)) if *m == why),
        "expected the peer dropped because {why:?}, got {err}"
    );
}

/// Finding 3 of the engine review: staged requests that never return a
/// credit were all accepted and kept. Now the owner serves at most
/// `max_staged_requests` of a peer's: the next is refused at once (BUSY,
/// status 7, nothing kept), and once the hostile ones pass their
/// deadline their slots come back and the peer is served again.
#[test]
fn staged_requests_past_the_bound_are_refused_and_stalled_ones_expire() {
    let limits = PeerLimits {
        max_staged_requests: 3,
        staged_request_timeout: Duration::from_millis(300),
        ..PeerLimits::default()
    };
    let w = world(limits);
    let (_src_buf, src) = w.a.alloc(Kind::Host, 4096, 4);
    let (dst_buf, dst) = w.b.alloc(Kind::Gpu, 4096, 0);
    let (_grant, remote) = w.b_grants(&dst, GrantRights::Write);
    // Three WRITE requests that will never fill the slots lent to them.
    for id in 1..=3 {
        let ask = Control::StagedRequest {
            id,
            grant: remote.grant,
            offset: 0,
            len: 4096,
            write: true,
            slots: true,
        };
        w.ab.send_raw_control(&ask).unwrap().wait(T).unwrap();
    }
    let sent = Instant::now();
    let refused =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, 4096)])
            .unwrap()
            .wait(T);
    assert!(
        matches!(refused, Err(TransferError::StagedRefused { status: 7, .. })),
        "the fourth request: {refused:?}"
    );
    assert!(
        sent.elapsed() < limits.staged_request_timeout,
        "refused at once, not after the stalled ones expired"
    );
    // Past the deadline the stalled requests fail and give their slots
    // back: an honest request goes through.
    std::thread::sleep(limits.staged_request_timeout * 2);
    w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, 4096)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(w.b.bytes(&dst_buf) == pattern(4096, 4));
}

/// A peer that announces more live grants than `max_remote_grants` is
/// dropped by name; nothing past the bound is kept.
#[test]
fn a_peer_announcing_too_many_grants_is_dropped() {
    let w = world(PeerLimits {
        max_remote_grants: 3,
        ..PeerLimits::default()
    });
    let (_buf, region) = w.a.alloc(Kind::Host, 4096, 1);
    let grants: Vec<_> = (0..4)
        .map(|i| {
            w.ab.grant(&region, i * 1024, 1024, GrantRights::Read)
                .unwrap()
        })
        .collect();
    let err = w.ba.recv(T).unwrap_err();
    gone_because(err, PeerMisbehaved::TooManyGrants { max: 3 });
    assert!(
        w.ba.remote_grant(grants[3].descriptor().grant).is_none(),
        "the grant past the bound was not kept"
    );
}

/// A peer's grant table goes as soon as the peer is gone (here it said
/// goodbye, and another was dropped for one grant too many), not when the
/// engine does: a gone peer's grants can never be used, and peers that
/// went would otherwise each keep up to `max_remote_grants` descriptors.
#[test]
fn a_gone_peers_grants_are_let_go_at_once() {
    let held = |w: &EngineWorld<SimVerbsApi>| {
        let peers = w.b.engine.resources().peers;
        assert_eq!(peers.len(), 1);
        (peers[0].gone, peers[0].remote_grants)
    };
    for misbehave in [false, true] {
        let w = world(PeerLimits {
            max_remote_grants: 3,
            ..PeerLimits::default()
        });
        let (_buf, region) = w.a.alloc(Kind::Host, 4096, 1);
        let grants: Vec<_> = (0..3)
            .map(|i| {
                w.ab.grant(&region, i * 1024, 1024, GrantRights::Read)
                    .unwrap()
            })
            .collect();
        for grant in &grants {
            w.ba.wait_grant(grant.descriptor().grant, T).unwrap();
        }
        assert_eq!(held(&w), (false, 3));
        if misbehave {
            let _ = w.ab.grant(&region, 3072, 1024, GrantRights::Read);
        } else {
            w.ab.close().unwrap();
        }
        let start = Instant::now();
        // b learns of it by its own progress.
        while !held(&w).0 {
            assert!(start.elapsed() < T, "b never saw a go");
            w.b.engine.progress();
        }
        assert_eq!(held(&w), (true, 0), "misbehaving: {misbehave}");
    }
}

/// Messages nobody receives are bounded: the peer that sends more than
/// `max_inbox_messages` is dropped by name, and the messages kept before
/// are still delivered.
#[test]
fn a_peer_flooding_messages_nobody_receives_is_dropped() {
    let w = world(PeerLimits {
        max_inbox_messages: 8,
        ..PeerLimits::default()
    });
    for i in 0..9u8 {
        // The 9th may fail here once b has dropped a.
        let _ = w.ab.send(&[i; 16]).map(|b| b.wait(T));
    }
    for i in 0..8u8 {
        assert_eq!(w.ba.recv(T).unwrap(), vec![i; 16], "message {i} kept");
    }
    gone_because(
        w.ba.recv(T).unwrap_err(),
        PeerMisbehaved::TooManyMessages { max: 8 },
    );
}

/// Bytes of messages nobody receives are bounded too.
#[test]
fn a_peer_flooding_message_bytes_is_dropped() {
    let w = world(PeerLimits {
        max_inbox_bytes: 1000,
        ..PeerLimits::default()
    });
    for i in 0..3u8 {
        let _ = w.ab.send(&[i; 400]).map(|b| b.wait(T));
    }
    for i in 0..2u8 {
        assert_eq!(w.ba.recv(T).unwrap(), vec![i; 400]);
    }
    gone_because(
        w.ba.recv(T).unwrap_err(),
        PeerMisbehaved::TooManyMessageBytes { max: 1000 },
    );
}

/// The CUDA IPC handles a peer sends (one per grant of GPU memory, for the
/// peer-copy path) are bounded like its grants: one past
/// `max_remote_grants` and the peer is dropped by name. They were kept
/// without bound.
#[test]
fn a_peer_flooding_ipc_handles_is_dropped() {
    let w = world(PeerLimits {
        max_remote_grants: 3,
        ..PeerLimits::default()
    });
    for grant in 1..=4u64 {
        let handle = Control::GrantIpc {
            grant,
            offset: 0,
            handle: [grant as u8; 64],
        };
        // The 4th may fail here once b has dropped a.
        let _ = w.ab.send_raw_control(&handle).map(|b| b.wait(T));
    }
    gone_because(
        w.ba.recv(T).unwrap_err(),
        PeerMisbehaved::TooManyGrants { max: 3 },
    );
}

/// A control message that does not decode (here of a kind no version
/// knows) drops the peer, naming the wire error; it was logged and
/// dropped, the peer kept.
#[test]
fn a_peer_sending_a_malformed_control_message_is_dropped() {
    let w = world(PeerLimits::default());
    let mut bytes = vec![0; Control::Goodbye.encoded_len()];
    Control::Goodbye.encode_into(&mut bytes).unwrap();
    bytes[2] = 200; // The kind.
    let _ = w.ab.send_raw_bytes(&bytes).map(|b| b.wait(T));
    gone_because(
        w.ba.recv(T).unwrap_err(),
        PeerMisbehaved::Malformed(WireError::UnknownKind(200)),
    );
    // What the caller does next is refused with the same cause.
    let (_buf, region) = w.b.alloc(Kind::Host, 4096, 0);
    let err =
        w.ba.grant(&region, 0, 4096, GrantRights::Read)
            .map(|_| ())
            .unwrap_err();
    gone_because(err, PeerMisbehaved::Malformed(WireError::UnknownKind(200)));
}

/// A grant announcement whose descriptor does not decode drops the peer by
/// name (it was logged and ignored).
#[test]
fn a_peer_announcing_a_malformed_grant_is_dropped() {
    let w = world(PeerLimits::default());
    let garbage = [0x5a; 24];
    let announce = Control::GrantAnnounce {
        descriptor: &garbage,
    };
    let _ = w.ab.send_raw_control(&announce).map(|b| b.wait(T));
    gone_because(w.ba.recv(T).unwrap_err(), PeerMisbehaved::MalformedGrant);
}

/// A peer announcing a grant of another engine (here the receiver's own)
/// is dropped, naming both engines (it was logged and ignored).
#[test]
fn a_peer_announcing_a_grant_of_another_engine_is_dropped() {
    let w = world(PeerLimits::default());
    let (_buf, dst) = w.b.alloc(Kind::Host, 4096, 0);
    let (_grant, theirs) = w.b_grants(&dst, GrantRights::Read);
    let encoded = theirs.encode().unwrap();
    let announce = Control::GrantAnnounce {
        descriptor: &encoded,
    };
    let _ = w.ab.send_raw_control(&announce).map(|b| b.wait(T));
    let err = w.ba.recv(T).unwrap_err();
    assert!(
        matches!(
            &err,
            EngineError::PeerGone(PeerGone::Misbehaved(PeerMisbehaved::ForeignGrant { owner, peer }))
                if *owner == theirs.owner && *peer != theirs.owner
        ),
        "{err}"
    );
}
