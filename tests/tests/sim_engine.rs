//! The transfer engine between two simulated nodes: two engines connected
//! over the sim's rdma_cm, regions of host, pinned and GPU memory on every
//! rung, batched READ/WRITE verified byte for byte, slicing over queue
//! pairs and NICs, grants checked before anything is posted, queue-pair
//! failure, timeouts, peer death and control messages.

use std::time::Duration;

use gdr_core::descriptor::GrantRights;
use gdr_core::engine::{EngineConfig, EngineError, Refusal, Transfer, TransferError};
use gdr_core::ladder::{LadderConfig, Policy, Rung};
use gdr_sim::{GpuConfig, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, Kind, grant_to, submit_until_gone};
use gdr_tests::pattern;

const T: Duration = Duration::from_secs(10);

/// Two simulated nodes of `nics` NICs each and a GPU configured as `gpu`,
/// engines configured as `config`, a connected to b (over every NIC).
fn world(nics: usize, gpu: GpuConfig, config: EngineConfig) -> EngineWorld<SimVerbsApi> {
    EngineWorld::sim(nics, gpu, config, T)
}

fn config(qps: u16) -> EngineConfig {
    EngineConfig::default()
        .with_qps_per_peer(qps)
        .with_default_timeout(T)
}

#[test]
fn host_write_then_read_back_byte_for_byte() {
    let w = world(1, GpuConfig::default(), config(2));
    const LEN: u64 = 3 << 20;
    let h = w.host_pair(LEN, 1, GrantRights::ReadWrite);
    w.ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(w.b.bytes(&h.dst_buf), pattern(LEN as usize, 1));
    let (back_buf, back) = w.a.host(LEN, 9);
    w.ab.submit(&[Transfer::read(&back, 0, &h.remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(w.a.bytes(&back_buf), pattern(LEN as usize, 1));
}

/// While a waiter spins on its batch's CQs (`Batch::wait`'s spin), polls
/// of every CQ by other threads (`Engine::progress`, a waiter's every-CQ
/// round) pass those CQs by: the spinning thread takes their completions,
/// and no other thread takes its peer's lock from under it (12 threads of
/// one engine spent 7 % of their time on peers' locks taken by such polls).
/// Once the spin ends, a poll of every CQ takes them again.
#[test]
fn a_poll_of_every_cq_leaves_a_spinning_waiters_cqs_to_it() {
    let w = world(1, GpuConfig::default(), config(2));
    const LEN: u64 = 64 << 10;
    let h = w.host_pair(LEN, 3, GrantRights::ReadWrite);
    let write = [Transfer::write(&h.src, 0, &h.remote, 0, LEN)];
    let batch = w.ab.submit(&write).unwrap();
    let taken = batch.while_spun_on(|| {
        let start = std::time::Instant::now();
        let mut taken = 0;
        while start.elapsed() < Duration::from_millis(200) {
            taken += w.a.engine.progress();
        }
        taken
    });
    assert_eq!(
        taken, 0,
        "another thread took the spinning waiter's completions"
    );
    // The spin over, a poll of every CQ takes them.
    let start = std::time::Instant::now();
    let mut taken = 0;
    while taken == 0 {
        assert!(start.elapsed() < T, "nobody took the batch's completions");
        taken += w.a.engine.progress();
    }
    batch.wait(T).unwrap();
}

/// A peer's plain batches and messages (sent and received), and grants
/// of memory the NIC reaches (made, announced, revoked; the peer's
/// received), take its own lock only: they run
/// while another thread holds the engine's lock (whose holders make no
/// blocking call, but a thousand peers' batches must not queue behind
/// one grant, revoke or path step of another peer).
#[test]
fn a_peers_batches_run_while_the_engines_lock_is_held() {
    let w = world(1, GpuConfig::default(), config(2));
    const LEN: u64 = 1 << 20;
    let h = w.host_pair(LEN, 3, GrantRights::ReadWrite);
    let write = [Transfer::write(&h.src, 0, &h.remote, 0, LEN)];
    w.ab.submit(&write).unwrap().wait(T).unwrap();
    let (_granted_buf, granted) = w.a.host(LEN, 5);
    let ((), in_time) = w.a.while_engine_lock_held(Duration::from_secs(3), || {
        for _ in 0..8 {
            w.ab.submit(&write).unwrap().wait(T).unwrap();
        }
        w.ab.send(b"while held").unwrap().wait(T).unwrap();
        let grant =
            w.ab.grant(&granted, 0, LEN, GrantRights::ReadWrite)
                .unwrap();
        grant.revoke(T).unwrap();
        // The peer's messages and grants are received too.
        w.ba.send(b"to a").unwrap().wait(T).unwrap();
        assert_eq!(w.ab.recv(T).unwrap(), b"to a");
        let (b_granted_buf, b_granted) = w.b.host(LEN, 7);
        let from_b =
            w.ba.grant(&b_granted, 0, LEN, GrantRights::ReadWrite)
                .unwrap();
        w.ab.wait_grant(from_b.id(), T).unwrap();
        drop((from_b, b_granted, b_granted_buf));
    });
    assert!(in_time, "the batches waited for the engine's lock");
    assert_eq!(w.b.bytes(&h.dst_buf), pattern(LEN as usize, 3));
}

/// Every pair of memory kinds, each on every rung its kind allows.
#[test]
fn every_pair_of_memory_kinds_and_rungs() {
    const LEN: u64 = 300 * 1024 + 7;
    let kinds = [Kind::Host, Kind::Pinned, Kind::Gpu];
    for rung in [Rung::Dmabuf, Rung::Peermem] {
        let mut cfg = config(2);
        cfg.slice_size = 64 * 1024;
        cfg.ladder = LadderConfig::default().with_policy(Policy::Only(rung));
        let gpu = GpuConfig {
            peermem: true,
            ..GpuConfig::default()
        };
        let w = world(1, gpu, cfg);
        for (i, &from) in kinds.iter().enumerate() {
            for (j, &to) in kinds.iter().enumerate() {
                let seed = (i * 3 + j) as u8 + 1;
                let (_, dst_rungs, _) =
                    w.write_and_read_back(from, to, LEN, seed, 1, &format!("{rung:?}"));
                if to == Kind::Gpu {
                    assert_eq!(dst_rungs, vec![rung], "{to:?}");
                }
            }
        }
    }
}

#[test]
fn slices_spread_over_every_queue_pair_with_one_doorbell_each() {
    let mut cfg = config(4);
    cfg.slice_size = 64 * 1024;
    let w = world(1, GpuConfig::default(), cfg);
    const LEN: u64 = 4 << 20;
    let h = w.host_pair(LEN, 3, GrantRights::Write);
    let before = w.ab.counters();
    // Many transfers in one batch, at odd offsets.
    let parts: Vec<(u64, u64)> = (0..8).map(|i| (i * (LEN / 8), LEN / 8)).collect();
    let transfers: Vec<_> = parts
        .iter()
        .map(|&(off, len)| Transfer::write(&h.src, off, &h.remote, off, len))
        .collect();
    w.ab.submit(&transfers).unwrap().wait(T).unwrap();
    assert_eq!(w.b.bytes(&h.dst_buf), pattern(LEN as usize, 3));
    let after = w.ab.counters();
    let slices = LEN / (64 * 1024);
    let mut total = 0;
    for ((qp, _, c0), (_, _, c1)) in before.iter().zip(&after) {
        let posted = c1.posted - c0.posted;
        assert_eq!(posted, slices / 4, "queue pair {qp} took its share");
        assert!(
            c1.signaled - c0.signaled < posted,
            "selective signalling on queue pair {qp}"
        );
        total += posted;
    }
    assert_eq!(total, slices);
}

#[test]
fn slices_travel_over_both_nics() {
    let mut cfg = config(4);
    cfg.slice_size = 32 * 1024;
    let w = world(2, GpuConfig::default(), cfg);
    const LEN: u64 = 1 << 20;
    let h = w.host_pair(LEN, 4, GrantRights::ReadWrite);
    assert_eq!(
        h.remote.devices().collect::<Vec<_>>(),
        ["sim0", "sim1"],
        "one segment per NIC the peer's queue pairs use"
    );
    w.ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(w.b.bytes(&h.dst_buf), pattern(LEN as usize, 4));
    let mut per_nic = std::collections::BTreeMap::new();
    for (_, nic, c) in w.ab.counters() {
        *per_nic.entry(nic).or_insert(0) += c.bytes;
    }
    assert_eq!(per_nic.len(), 2, "{per_nic:?}");
    assert!(
        per_nic.values().all(|&b| b >= LEN / 2 - 32 * 1024),
        "{per_nic:?}"
    );
}

#[test]
fn requests_outside_their_grant_are_refused_before_posting() {
    let w = world(1, GpuConfig::default(), config(2));
    let EngineWorld { ab, ba, .. } = &w;
    let (_s, src) = w.a.host(1 << 16, 1);
    let (_d, dst) = w.b.host(1 << 16, 0);
    let read_only = ba.grant(&dst, 4096, 8192, GrantRights::Read).unwrap();
    let remote = ab.wait_grant(read_only.descriptor().grant, T).unwrap();
    let before = ab.counters();
    let refused = |t: Transfer<'_>| ab.submit(&[t]).unwrap_err();
    assert!(matches!(
        refused(Transfer::write(&src, 0, &remote, 0, 16)),
        EngineError::AccessDenied { op: "WRITE", .. }
    ));
    assert!(matches!(
        refused(Transfer::read(&src, 0, &remote, 8000, 193)),
        EngineError::OutOfBounds {
            what: "remote grant",
            ..
        }
    ));
    assert!(matches!(
        refused(Transfer::read(&src, (1 << 16) - 8, &remote, 0, 16)),
        EngineError::OutOfBounds {
            what: "local region",
            ..
        }
    ));
    // A descriptor the peer never announced (a forged one: a wider range).
    let mut forged = remote.clone();
    forged.len = 1 << 16;
    assert!(matches!(
        refused(Transfer::read(&src, 0, &forged, 0, 16)),
        EngineError::NotGranted { .. }
    ));
    // Revoked: once the peer's notice arrives, the grant is refused as
    // revoked (not as one never announced).
    let id = read_only.descriptor().grant;
    drop(read_only);
    let deadline = std::time::Instant::now() + T;
    while ab.remote_grant(id).is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "revocation never seen"
        );
        ab.engine().progress();
    }
    assert!(matches!(
        refused(Transfer::read(&src, 0, &remote, 0, 16)),
        EngineError::Refused(Refusal::GrantRevoked { grant }) if grant == id
    ));
    assert_eq!(ab.counters(), before, "nothing was posted");
    // The valid request still works.
    let ok = ba.grant(&dst, 0, 4096, GrantRights::Read).unwrap();
    let remote = ab.wait_grant(ok.descriptor().grant, T).unwrap();
    ab.submit(&[Transfer::read(&src, 0, &remote, 0, 4096)])
        .unwrap()
        .wait(T)
        .unwrap();
}

/// A grant revoked while the peer has not yet heard of it: its request
/// fails on its queue pair with a remote access error (told as the
/// revocation it was: the notice has come by the time the error does), the
/// queue pair's other requests flush, the other queue pairs go on, and
/// later batches succeed on them.
#[test]
fn a_queue_pair_failure_fails_only_its_requests() {
    let mut cfg = config(2);
    cfg.slice_size = 4096;
    let w = world(1, GpuConfig::default(), cfg);
    let h = w.host_pair(1 << 16, 5, GrantRights::ReadWrite);
    let (doomed_grant, doomed) = w.b_grants(&h.dst, GrantRights::ReadWrite);
    // The MRs go now; the notice sits unread at a.
    drop(doomed_grant);
    // One slice, on the next queue pair in turn.
    let failed =
        w.ab.submit(&[Transfer::write(&h.src, 0, &doomed, 0, 4096)])
            .unwrap();
    let err = failed.wait(T).unwrap_err();
    assert!(
        matches!(err, TransferError::Revoked { grant } if grant == doomed.grant),
        "{err}"
    );
    // Later batches go over the queue pair still up.
    for _ in 0..4 {
        w.ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, 1 << 16)])
            .unwrap()
            .wait(T)
            .unwrap();
    }
    assert_eq!(w.b.bytes(&h.dst_buf), pattern(1 << 16, 5));
    drop(h);
}

#[test]
fn control_messages_both_ways_and_a_message_too_large() {
    let mut cfg = config(1);
    cfg.max_message = 256;
    let w = world(1, GpuConfig::default(), cfg);
    let EngineWorld { ab, ba, .. } = &w;
    // a sends more than b keeps receives posted for: the rest goes out as
    // b reposts, which a sees only if it makes progress meanwhile.
    let driver = w.a.engine.spawn_driver().unwrap();
    for i in 0..100u32 {
        ab.send(&i.to_le_bytes()).unwrap();
    }
    for i in 0..100u32 {
        let got = ba.recv(T).unwrap_or_else(|e| panic!("message {i}: {e}"));
        assert_eq!(got, i.to_le_bytes(), "in order");
    }
    ba.send(b"pong").unwrap().wait(T).unwrap();
    assert_eq!(ab.recv(T).unwrap(), b"pong");
    let big = vec![7u8; 256];
    assert!(matches!(
        ab.send(&big).unwrap_err(),
        EngineError::MessageTooLarge { max: 256, .. }
    ));
    let fits = vec![7u8; 256 - gdr_core::engine::wire::HEADER_LEN];
    ab.send(&fits).unwrap().wait(T).unwrap();
    assert_eq!(ba.recv(T).unwrap(), fits);
    assert!(matches!(
        ba.recv(Duration::from_millis(20)).unwrap_err(),
        EngineError::Timeout(_)
    ));
    drop(driver);
}

/// Control messages are handled in the order they came, whichever thread
/// polled their completions: several threads of the receiving engine wait
/// on WRITEs of the same peer (so they poll the CQ the messages complete
/// on) while it receives numbered messages. The receives two threads
/// polled were handled in the order the threads reached the engine's pass:
/// a grant's IPC handle came after its revocation, and a revoke waited the
/// release bound (`gdr bench isolation`, CI of stop 46).
#[test]
fn control_messages_stay_in_order_while_other_threads_poll_their_cq() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let w = world(1, GpuConfig::default(), config(1));
    const LEN: u64 = 4096;
    const MESSAGES: u32 = 3000;
    let h = w.host_pair(LEN, 3, GrantRights::ReadWrite);
    let _driver = w.b.engine.spawn_driver().unwrap();
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                let write = [Transfer::write(&h.src, 0, &h.remote, 0, LEN)];
                while !done.load(Ordering::Relaxed) {
                    w.ab.submit(&write).unwrap().wait(T).unwrap();
                }
            });
        }
        s.spawn(|| {
            for i in 0..MESSAGES {
                w.ba.send(&i.to_le_bytes()).unwrap();
            }
        });
        let mut order = Vec::new();
        for _ in 0..MESSAGES {
            let got = w.ab.recv(T).unwrap();
            order.push(u32::from_le_bytes(got.try_into().unwrap()));
        }
        done.store(true, Ordering::Relaxed);
        let out_of_order = order.windows(2).filter(|p| p[1] != p[0] + 1).count();
        assert_eq!(out_of_order, 0, "messages handled out of order");
    });
}

/// Issue 33, item 5: a side that only grants (it never waits and never
/// calls `progress`, as in the crate docs' example) announced 32 grants,
/// then nothing: control SENDs on queue pair 0 are bounded by the peer's
/// receives, and their completions were reaped by nobody. Every
/// announcement and revocation notice now goes out on its own.
#[test]
fn a_side_that_only_grants_announces_every_grant_and_revocation() {
    let w = world(1, GpuConfig::default(), config(1));
    let (_dst_buf, dst) = w.b.host(4096, 1);
    let soon = Duration::from_secs(2);
    let mut kept = Vec::new();
    for i in 0..100 {
        let grant = w.ba.grant(&dst, 0, 4096, GrantRights::Read).unwrap();
        let id = grant.descriptor().grant;
        let start = std::time::Instant::now();
        w.ab.wait_grant(id, soon)
            .unwrap_or_else(|e| panic!("grant {i} not seen: {e}"));
        if i % 3 == 0 {
            // Revoked: a sees the notice (its own progress only).
            drop(grant);
            while w.ab.remote_grant(id).is_some() {
                assert!(start.elapsed() < soon, "revocation {i} not seen");
                w.a.engine.progress();
                std::thread::sleep(Duration::from_millis(1));
            }
        } else {
            kept.push(grant);
        }
    }
    assert_eq!(kept.len(), 66);
    for grant in &kept {
        let id = grant.descriptor().grant;
        assert!(w.ab.remote_grant(id).is_some(), "grant {id} still live");
    }
}

#[test]
fn a_peer_that_goes_away_fails_requests_typed() {
    let w = world(1, GpuConfig::default(), config(2));
    let h = w.host_pair(1 << 16, 5, GrantRights::ReadWrite);
    w.ba.close().unwrap();
    // a learns it from the goodbye or the disconnect, whichever it sees.
    let refused = submit_until_gone(&w.ab, &h.src, &h.remote, T);
    assert!(matches!(refused, EngineError::PeerGone(_)), "{refused}");
}

#[test]
fn a_batch_past_its_deadline_times_out_and_the_qp_is_stopped() {
    let w = world(1, GpuConfig::default(), config(1));
    let h = w.host_pair(1 << 16, 5, GrantRights::ReadWrite);
    // Nothing moves on the fabric: the request stays in flight.
    let batch = w.stalled_write(&h, Duration::from_millis(50));
    let start = std::time::Instant::now();
    let err = batch.wait(T).unwrap_err();
    let took = start.elapsed();
    assert!(matches!(err, TransferError::Timeout(_)), "{err}");
    assert!(
        took >= Duration::from_millis(50),
        "not before its deadline: {took:?}"
    );
    w.fabric().set_paused(false);
    // The queue pair was stopped (it flushed: the outcome came only then);
    // sim_engine_recovery.rs shows it re-established afterwards.
    assert!(
        w.ab.counters()[0].2.posted >= 1,
        "the request was posted before it timed out"
    );
}

#[test]
fn a_fatal_device_event_fails_everything_on_that_device_at_once() {
    let w = world(1, GpuConfig::default(), config(2));
    let h = w.host_pair(1 << 16, 5, GrantRights::ReadWrite);
    w.fabric().set_paused(true);
    let batch =
        w.ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, 1 << 16)])
            .unwrap();
    w.a.verbs
        .raise_async_event("sim0", hal_verbs::AsyncEvent::DeviceFatal);
    let err = batch.wait(Duration::from_secs(2)).unwrap_err();
    assert!(
        matches!(&err, TransferError::DeviceFatal { device } if device == "sim0"),
        "{err}"
    );
    assert!(matches!(
        w.ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, 16)]),
        Err(EngineError::PeerGone(_))
    ));
    w.fabric().set_paused(false);
}

/// Found by the soak: a CQ that overran (completions lost) failed every
/// poll after it with only a warning, and each request on the NIC waited
/// for its deadline. Now the overrun fails everything on that NIC at once,
/// typed, and the peer is gone (its only queue pair was there).
#[test]
fn a_completion_queue_overrun_fails_everything_on_that_nic_at_once() {
    let w = world(1, GpuConfig::default(), config(1));
    let h = w.host_pair(1 << 16, 5, GrantRights::ReadWrite);
    w.fabric().faults().fail_next(
        gdr_sim::FaultSite::VerbsCompletion,
        gdr_sim::Fault::CqOverrun,
    );
    // Its deadline is a minute away; the wait gives it ten seconds (a
    // wait that runs out says Timeout, not the CQ's failure).
    let batch =
        w.ab.submit_with_timeout(
            &[Transfer::write(&h.src, 0, &h.remote, 0, 1 << 16)],
            Duration::from_secs(60),
        )
        .unwrap();
    let err = batch.wait(Duration::from_secs(10)).unwrap_err();
    w.fabric().faults().assert_all_fired();
    assert!(
        matches!(&err, TransferError::CompletionQueueFailed { device, .. } if device == "sim0"),
        "{err}"
    );
    assert!(matches!(
        w.ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, 16)]),
        Err(EngineError::PeerGone(_))
    ));
}

/// The GPU fence is tied to the batch: a READ into GPU memory flushes that
/// GPU once before `wait` returns, where the GPU's write ordering asks for
/// it, and never where it orders writes itself; a peer's WRITE is fenced
/// on the region, on request.
#[test]
fn the_gpu_fence_follows_the_batch_that_wrote() {
    for (ordering, flushes_expected) in [
        (hal_cuda::WritesOrdering::None, 1),
        (hal_cuda::WritesOrdering::Owner, 0),
    ] {
        let gpu = GpuConfig {
            writes_ordering: ordering,
            ..GpuConfig::default()
        };
        let w = world(1, gpu, config(2));
        let EngineWorld { a, ab, ba, .. } = &w;
        let (_s, src) = w.b.host(1 << 16, 8);
        let (_g, remote) = w.b_grants(&src, GrantRights::ReadWrite);
        let (gpu_buf, gpu_region) = a.gpu(1 << 16, 0);
        let (_h, host_region) = a.host(1 << 16, 0);
        // A READ into host memory fences nothing.
        ab.submit(&[Transfer::read(&host_region, 0, &remote, 0, 1 << 16)])
            .unwrap()
            .wait(T)
            .unwrap();
        assert_eq!(a.cuda.flushes(0), 0, "{ordering:?}");
        let batch = ab
            .submit(&[
                Transfer::read(&gpu_region, 0, &remote, 0, 1 << 15),
                Transfer::read(&gpu_region, 1 << 15, &remote, 1 << 15, 1 << 15),
            ])
            .unwrap();
        batch.wait(T).unwrap();
        batch.wait(T).unwrap();
        assert_eq!(
            a.cuda.flushes(0),
            flushes_expected,
            "{ordering:?}: one fence for the batch"
        );
        assert_eq!(a.bytes(&gpu_buf), pattern(1 << 16, 8));
        // Inbound: b WRITEs into a's GPU region; a fences the region.
        let (_g2, gpu_remote) = grant_to(ab, ba, &gpu_region, GrantRights::Write, T);
        ba.submit(&[Transfer::write(&src, 0, &gpu_remote, 0, 1 << 16)])
            .unwrap()
            .wait(T)
            .unwrap();
        let fence = a.engine.fence_inbound_writes(&gpu_region).unwrap();
        assert_eq!(
            fence == gdr_core::engine::Fence::Flushed,
            flushes_expected == 1,
            "{ordering:?}"
        );
        assert_eq!(
            a.engine.fence_inbound_writes(&host_region).unwrap(),
            gdr_core::engine::Fence::NotNeeded
        );
    }
}

/// A task awaiting a batch is not re-polled until the batch ends (no busy
/// task): with no driver thread of the caller's the engine's own thread
/// drives the batch and wakes the task; with one, that driver does.
#[test]
fn a_driver_wakes_an_awaited_batch_instead_of_a_busy_task() {
    use std::future::Future;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Poll, Wake, Waker};

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let w = world(1, GpuConfig::default(), config(1));
    let h = w.host_pair(1 << 16, 4, GrantRights::ReadWrite);
    let until_woken = |wakes: &Count, n: usize, who: &str| {
        let deadline = std::time::Instant::now() + T;
        while wakes.0.load(Ordering::SeqCst) < n {
            assert!(
                std::time::Instant::now() < deadline,
                "{who} never woke the task"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    for with_driver in [false, true] {
        let wakes = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&wakes));
        let mut cx = Context::from_waker(&waker);
        w.fabric().set_paused(true);
        let driver = with_driver.then(|| w.a.engine.spawn_driver().unwrap());
        let mut batch =
            w.ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, 4096)])
                .unwrap();
        assert!(std::pin::Pin::new(&mut batch).poll(&mut cx).is_pending());
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            0,
            "driver {with_driver}: woken while the batch cannot end"
        );
        w.fabric().set_paused(false);
        until_woken(
            &wakes,
            1,
            if with_driver {
                "the driver"
            } else {
                "the engine's own thread"
            },
        );
        match std::pin::Pin::new(&mut batch).poll(&mut cx) {
            Poll::Ready(outcome) => outcome.unwrap(),
            Poll::Pending => panic!("woken, but the batch is not done"),
        }
        drop(driver);
    }
}

/// One batch moving to two grants, interleaved, over both NICs: the
/// submit looks a grant up once per descriptor and reuses a segment per
/// queue pair, so each slice must still take its own grant's segment on
/// its own queue pair's NIC (the wrong one would write the other buffer,
/// or fail on the other NIC's rkey); and a descriptor that differs from
/// the announced one is refused even behind a valid one in the batch.
#[test]
fn a_batch_over_two_grants_reaches_each_and_checks_each() {
    let mut cfg = config(4);
    cfg.slice_size = 4096;
    let w = world(2, GpuConfig::default(), cfg);
    let ab = &w.ab;
    const LEN: u64 = 1 << 16;
    let (_s, src) = w.a.host(2 * LEN, 6);
    let (one_buf, one) = w.b.host(LEN, 0);
    let (two_buf, two) = w.b.host(LEN, 0);
    let (_g1, first) = w.b_grants(&one, GrantRights::ReadWrite);
    let (_g2, second) = w.b_grants(&two, GrantRights::ReadWrite);
    let half = LEN / 2;
    let transfers = [
        Transfer::write(&src, 0, &first, 0, half),
        Transfer::write(&src, LEN, &second, 0, half),
        Transfer::write(&src, half, &first, half, half),
        Transfer::write(&src, LEN + half, &second, half, half),
    ];
    ab.submit(&transfers).unwrap().wait(T).unwrap();
    let expected = pattern(2 * LEN as usize, 6);
    assert_eq!(w.b.bytes(&one_buf), expected[..LEN as usize]);
    assert_eq!(w.b.bytes(&two_buf), expected[LEN as usize..]);
    // A copy equal to the announced descriptor is fine; one with any field
    // changed (here the rkey of a segment) is not, wherever it stands.
    let copy = first.clone();
    let mut forged = first.clone();
    match &mut forged.reach {
        gdr_core::descriptor::Reach::Direct(segments) => segments[0].rkey ^= 1,
        other => panic!("a direct grant expected, got {other:?}"),
    }
    let before = ab.counters();
    let err = ab
        .submit(&[
            Transfer::read(&src, 0, &first, 0, 16),
            Transfer::read(&src, 0, &copy, 0, 16),
            Transfer::read(&src, 0, &forged, 0, 16),
        ])
        .unwrap_err();
    assert!(matches!(err, EngineError::NotGranted { .. }), "{err}");
    assert_eq!(ab.counters(), before, "nothing was posted");
    ab.submit(&[
        Transfer::read(&src, 0, &first, 0, 16),
        Transfer::read(&src, 0, &copy, 0, 16),
    ])
    .unwrap()
    .wait(T)
    .unwrap();
}

/// A region belongs to the engine that registered it (its MRs are in that
/// engine's protection domains): another engine refuses to post it or
/// grant it, before anything reaches a NIC.
#[test]
fn a_region_of_another_engine_is_refused() {
    let w = world(1, GpuConfig::default(), config(2));
    let (_s, theirs) = w.b.host(1 << 16, 1);
    let (_d, dst) = w.b.host(1 << 16, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::ReadWrite);
    let before = w.ab.counters();
    let err =
        w.ab.submit(&[Transfer::write(&theirs, 0, &remote, 0, 16)])
            .unwrap_err();
    assert!(
        matches!(&err, EngineError::Refused(Refusal::ForeignRegion { .. })),
        "{err}"
    );
    let err =
        w.ab.grant(&theirs, 0, 4096, GrantRights::Read)
            .map(|_| ())
            .unwrap_err();
    assert!(
        matches!(&err, EngineError::Refused(Refusal::ForeignRegion { .. })),
        "{err}"
    );
    // Nor does a's engine fence b's region.
    let err = w.a.engine.fence_inbound_writes(&theirs).unwrap_err();
    assert!(
        matches!(&err, EngineError::Refused(Refusal::ForeignRegion { .. })),
        "{err}"
    );
    assert_eq!(w.ab.counters(), before, "nothing posted");
}

/// Issue 33, item 9: `spawn_driver` panicked where the OS made no thread
/// (the engine's own thread already handled that); it is a typed error
/// now, and nothing was started. The OS refuses a thread here in a child
/// process of this test whose address space is capped just above what it
/// uses (no thread stack fits; RLIMIT_NPROC does not bind root).
#[test]
fn spawn_driver_without_a_thread_is_a_typed_error() {
    const CHILD: &str = "GDR_TEST_NO_THREAD_CHILD";
    const NAME: &str = "spawn_driver_without_a_thread_is_a_typed_error";
    if std::env::var_os(CHILD).is_some() {
        no_thread_child();
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--test-threads=1", "--nocapture"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child ({:?}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("spawn_driver refused: "),
        "the child never ran the capped spawn:\n{stdout}"
    );
}

/// The child's part: an engine, then the address space capped, then
/// `spawn_driver`.
fn no_thread_child() {
    use gdr_core::engine::{Engine, Unavailable};
    use gdr_sim::{NodeConfig, SimFabric};
    let fabric = SimFabric::new();
    let nic = fabric.add_node("a", NodeConfig::default());
    let engine = Engine::new(&nic.erased(), None, config(1)).unwrap();
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().next().unwrap().parse().unwrap();
    // SAFETY: sysconf reads a constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `old` is a valid rlimit to write.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut old) }, 0);
    // Room for small allocations, none for a thread's stack (2 MiB).
    let capped = libc::rlimit {
        rlim_cur: pages * page + (512 << 10),
        rlim_max: old.rlim_max,
    };
    // SAFETY: a valid rlimit; the soft limit is lowered only.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &capped) }, 0);
    let spawned = engine.spawn_driver();
    // SAFETY: a valid rlimit; the soft limit goes back up to what it was.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &old) }, 0);
    let err = spawned.map(drop).unwrap_err();
    assert!(
        matches!(&err, EngineError::Unavailable(Unavailable::Os { .. })),
        "{err}"
    );
    assert_eq!(engine.resources().drivers, 0, "no driver counted");
    println!("spawn_driver refused: {err}");
}
