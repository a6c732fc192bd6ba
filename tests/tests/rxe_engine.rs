//! The transfer engine on real verbs: SoftRoCE's `rxe0` in the VM
//! (`softroce/run-in-vm.sh` as the cargo runner, `GDR_EXPECT_RXE=1`).
//!
//! Two engines in one process, both on rxe0: b listens on rxe0's address
//! (10.99.0.1; rdma_cm cannot use 127.0.0.1 there) and accepts on a thread,
//! a connects. Host memory WRITE and READ sliced over several queue pairs;
//! a simulated GPU whose memory is host-visible (the stand-in for memory
//! pinned by nvidia-peermem) registered on the peermem rung and moved by
//! the kernel's rxe packet path; control messages both ways; requests
//! outside their grant refused before posting; and one queue pair failing
//! with a remote access error while the others go on, then re-established.
//!
//! Without an RDMA device every test skips with its reason on stderr; with
//! `GDR_EXPECT_RXE=1` a missing `rxe0` is a failure.

use std::time::{Duration, Instant};

use gdr_core::descriptor::{GrantRights, MemoryLocation};
use gdr_core::engine::{EngineConfig, EngineError, Refusal, Transfer, TransferError};
use gdr_core::ladder::Rung;
use gdr_tests::engine_world::EngineWorld;
use gdr_tests::pattern;
use gdr_tests::rxe::{self, serial};
use hal_verbs::rdma::RdmaApi;

/// Generous: the guest's NIC is software under (often) software emulation.
const T: Duration = Duration::from_secs(60);

/// Two engines on rxe0, a connected to b; `None` after printing why the
/// test skips.
fn connected(test: &str, config: EngineConfig) -> Option<EngineWorld<RdmaApi>> {
    EngineWorld::rxe(test, config, T)
}

fn config(qps: u16, slice_size: u64) -> EngineConfig {
    EngineConfig::default()
        .with_qps_per_peer(qps)
        .with_slice_size(slice_size)
}

#[test]
fn host_write_then_read_back_sliced_over_queue_pairs() {
    let _serial = serial();
    const SLICE: u64 = 256 * 1024;
    const QPS: u64 = 4;
    let Some(w) = connected(
        "host_write_then_read_back_sliced_over_queue_pairs",
        config(QPS as u16, SLICE),
    ) else {
        return;
    };
    let EngineWorld { a, b, ab, .. } = &w;
    const LEN: u64 = 6 << 20;
    let h = w.host_pair(LEN, 1, GrantRights::ReadWrite);
    let before = ab.counters();
    assert_eq!(before.len(), QPS as usize, "{before:?}");
    let start = Instant::now();
    ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap_or_else(|e| panic!("WRITE: {e}"));
    let write_took = start.elapsed();
    assert!(
        b.bytes(&h.dst_buf) == pattern(LEN as usize, 1),
        "b holds what a wrote"
    );
    let after = ab.counters();
    let slices = LEN / SLICE;
    for ((qp, nic, c0), (_, _, c1)) in before.iter().zip(&after) {
        assert_eq!(nic, &rxe::device_name());
        assert_eq!(c1.posted - c0.posted, slices / QPS, "queue pair {qp}");
        assert_eq!(c1.bytes - c0.bytes, LEN / QPS, "queue pair {qp}");
        assert_eq!(c1.doorbells - c0.doorbells, 1, "one doorbell on {qp}");
    }
    // READ it back into memory holding something else, in two transfers
    // of one batch at odd offsets.
    let (back_buf, back) = a.host(LEN, 9);
    let cut = LEN / 3 + 13;
    let start = Instant::now();
    ab.submit(&[
        Transfer::read(&back, 0, &h.remote, 0, cut),
        Transfer::read(&back, cut, &h.remote, cut, LEN - cut),
    ])
    .unwrap()
    .wait(T)
    .unwrap_or_else(|e| panic!("READ: {e}"));
    let read_took = start.elapsed();
    assert!(
        a.bytes(&back_buf) == pattern(LEN as usize, 1),
        "a read back what it wrote"
    );
    eprintln!(
        "rxe engine: {} MiB over {QPS} QPs in {} KiB slices: WRITE {write_took:?}, READ {read_took:?}",
        LEN >> 20,
        SLICE >> 10
    );
}

#[test]
fn sim_gpu_memory_on_the_peermem_rung_over_rxe() {
    let _serial = serial();
    let Some(w) = connected(
        "sim_gpu_memory_on_the_peermem_rung_over_rxe",
        config(2, 64 * 1024),
    ) else {
        return;
    };
    let EngineWorld { a, b, ab, .. } = &w;
    const LEN: u64 = (1 << 20) + 4096 + 5;
    // Host on a to the GPU on b, and back.
    let (_src_buf, src) = a.host(LEN, 3);
    let (gpu_buf, gpu) = b.gpu(LEN, 0);
    assert_eq!(gpu.rungs(), [Rung::Peermem], "rxe refuses dma-buf");
    assert_eq!(gpu.location(), MemoryLocation::Gpu { ordinal: 0 });
    let (_grant, remote) = w.b_grants(&gpu, GrantRights::ReadWrite);
    assert_eq!(remote.location, MemoryLocation::Gpu { ordinal: 0 });
    ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap_or_else(|e| panic!("WRITE host->GPU: {e}"));
    assert!(
        b.bytes(&gpu_buf) == pattern(LEN as usize, 3),
        "WRITE host->GPU"
    );
    let (back_buf, back) = a.host(LEN, 0);
    ab.submit(&[Transfer::read(&back, 0, &remote, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap_or_else(|e| panic!("READ GPU->host: {e}"));
    assert!(
        a.bytes(&back_buf) == pattern(LEN as usize, 3),
        "READ GPU->host"
    );
    // And a's own GPU memory as the local side: GPU on a into host on b.
    let (_agpu_buf, agpu) = a.gpu(LEN, 4);
    assert_eq!(agpu.rungs(), [Rung::Peermem]);
    let (host_buf, host) = b.host(LEN, 0);
    let (_grant2, remote2) = w.b_grants(&host, GrantRights::Write);
    ab.submit(&[Transfer::write(&agpu, 0, &remote2, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap_or_else(|e| panic!("WRITE GPU->host: {e}"));
    assert!(
        b.bytes(&host_buf) == pattern(LEN as usize, 4),
        "WRITE GPU->host"
    );
}

#[test]
fn control_messages_both_ways_over_rxe() {
    let _serial = serial();
    let mut cfg = config(2, 1 << 20);
    cfg.max_message = 512;
    let Some(w) = connected("control_messages_both_ways_over_rxe", cfg) else {
        return;
    };
    let EngineWorld { a, ab, ba, .. } = &w;
    // More messages than b keeps receives posted for: the rest go out as b
    // reposts, which a sees only while something makes progress on it.
    let driver = a.engine.spawn_driver().unwrap();
    for i in 0..100u32 {
        ab.send(&i.to_le_bytes()).unwrap();
    }
    for i in 0..100u32 {
        let got = ba.recv(T).unwrap_or_else(|e| panic!("message {i}: {e}"));
        assert_eq!(got, i.to_le_bytes(), "message {i} in order");
    }
    for i in 0..10u8 {
        ba.send(&[i; 300]).unwrap().wait(T).unwrap();
    }
    drop(driver);
    for i in 0..10u8 {
        assert_eq!(ab.recv(T).unwrap(), [i; 300], "reply {i}");
    }
    let largest = vec![7u8; 512 - gdr_core::engine::wire::HEADER_LEN];
    ab.send(&largest).unwrap().wait(T).unwrap();
    assert_eq!(ba.recv(T).unwrap(), largest);
    assert!(matches!(
        ab.send(&[7u8; 512]).unwrap_err(),
        EngineError::MessageTooLarge { max: 512, .. }
    ));
    assert!(matches!(
        ba.recv(Duration::from_millis(50)).unwrap_err(),
        EngineError::Timeout(_)
    ));
}

#[test]
fn requests_outside_their_grant_are_refused_before_posting_on_rxe() {
    let _serial = serial();
    let Some(w) = connected(
        "requests_outside_their_grant_are_refused_before_posting_on_rxe",
        config(2, 1 << 20),
    ) else {
        return;
    };
    let EngineWorld { a, b, ab, ba, .. } = &w;
    let (back_buf, back) = a.host(1 << 16, 0);
    let (_dst_buf, dst) = b.host(1 << 16, 7);
    let read_only = ba.grant(&dst, 4096, 8192, GrantRights::Read).unwrap();
    let remote = ab.wait_grant(read_only.descriptor().grant, T).unwrap();
    let before = ab.counters();
    let refused = |t: Transfer<'_>| ab.submit(&[t]).unwrap_err();
    let e = refused(Transfer::write(&back, 0, &remote, 0, 16));
    assert!(
        matches!(e, EngineError::AccessDenied { op: "WRITE", .. }),
        "{e}"
    );
    let e = refused(Transfer::read(&back, 0, &remote, 8000, 193));
    assert!(
        matches!(
            e,
            EngineError::OutOfBounds {
                what: "remote grant",
                ..
            }
        ),
        "{e}"
    );
    let e = refused(Transfer::read(&back, (1 << 16) - 8, &remote, 0, 16));
    assert!(
        matches!(
            e,
            EngineError::OutOfBounds {
                what: "local region",
                ..
            }
        ),
        "{e}"
    );
    let mut forged = remote.clone();
    forged.len = 1 << 16;
    let e = refused(Transfer::read(&back, 0, &forged, 0, 16));
    assert!(matches!(e, EngineError::NotGranted { .. }), "{e}");
    assert_eq!(ab.counters(), before, "nothing was posted");
    // Inside the grant, the same descriptor works and reads the right bytes.
    ab.submit(&[Transfer::read(&back, 100, &remote, 0, 8192)])
        .unwrap()
        .wait(T)
        .unwrap();
    let got = a.bytes(&back_buf);
    assert!(got[100..100 + 8192] == pattern(1 << 16, 7)[4096..4096 + 8192]);
    assert!(
        got[..100] == pattern(1 << 16, 0)[..100],
        "nothing else moved"
    );
    // Revoked: once the notice arrives, the grant is refused as revoked.
    let id = read_only.descriptor().grant;
    drop(read_only);
    let deadline = Instant::now() + T;
    while ab.remote_grant(id).is_some() {
        assert!(Instant::now() < deadline, "revocation never seen");
        ab.engine().progress();
    }
    let before = ab.counters();
    let e = refused(Transfer::read(&back, 0, &remote, 0, 16));
    assert!(
        matches!(e, EngineError::Refused(Refusal::GrantRevoked { grant }) if grant == id),
        "{e}"
    );
    assert_eq!(ab.counters(), before, "nothing was posted");
}

/// A grant revoked on b before a has read the notice: the request reaches
/// rxe's responder with a deregistered rkey and fails with a remote access
/// error on its queue pair (queue pair `failing`; 0 also carries the control
/// messages); the other queue pair goes on and later batches succeed on it.
fn a_queue_pair_failure_fails_only_its_requests(test: &str, failing: u16) {
    let Some(w) = connected(test, config(2, 4096)) else {
        return;
    };
    let EngineWorld { b, ab, ba, .. } = &w;
    let h = w.host_pair(1 << 16, 5, GrantRights::ReadWrite);
    let (doomed_grant, doomed) = w.b_grants(&h.dst, GrantRights::ReadWrite);
    // Slices go to the queue pairs in turn: one slice per failing queue pair
    // moves the next one there.
    for _ in 0..failing {
        ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, 4096)])
            .unwrap()
            .wait(T)
            .unwrap();
    }
    // Its MRs are deregistered now; the revoke notice sits unread at a.
    drop(doomed_grant);
    let before = ab.counters();
    let failed = ab
        .submit(&[Transfer::write(&h.src, 0, &doomed, 0, 4096)])
        .expect("a has not seen the revocation yet");
    let after = ab.counters();
    let used: Vec<u16> = before
        .iter()
        .zip(&after)
        .filter(|((_, _, c0), (_, _, c1))| c1.posted > c0.posted)
        .map(|((qp, _, _), _)| *qp)
        .collect();
    assert_eq!(used, [failing], "the doomed request's queue pair");
    let err = failed.wait(T).unwrap_err();
    // Told as the revocation where the notice came before the error.
    assert!(
        matches!(
            err,
            TransferError::RemoteAccess { .. } | TransferError::Revoked { .. }
        ),
        "{err}"
    );
    eprintln!("rxe engine: queue pair {failing} failed: {err}");
    // Later batches succeed: over the queue pair still up while the failed
    // one is re-established (a new rdma_cm connection for its index), then
    // over both again.
    let start = Instant::now();
    let mut rounds = 0u32;
    loop {
        h.dst_buf.write_at(0, &[0; 1 << 16]).unwrap();
        let before = ab.counters();
        ab.submit(&[Transfer::write(&h.src, 0, &h.remote, 0, 1 << 16)])
            .unwrap()
            .wait(T)
            .unwrap_or_else(|e| panic!("round {rounds}: {e}"));
        assert!(
            b.bytes(&h.dst_buf) == pattern(1 << 16, 5),
            "round {rounds}: all of it arrived"
        );
        rounds += 1;
        let after = ab.counters();
        if after[usize::from(failing)].2.posted > before[usize::from(failing)].2.posted {
            break;
        }
        assert!(
            start.elapsed() < T,
            "queue pair {failing} not re-established within {T:?}"
        );
        // b serves the reconnect on its listener's thread; its own progress
        // moves its control receives over.
        b.engine.progress();
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "rxe engine: queue pair {failing} carries slices again after {:?} ({rounds} batches)",
        start.elapsed()
    );
    // Control messages go both ways (over queue pair 0, re-established or
    // not).
    ab.send(b"ping").unwrap().wait(T).unwrap();
    assert_eq!(ba.recv(T).unwrap(), b"ping");
    ba.send(b"pong").unwrap().wait(T).unwrap();
    assert_eq!(ab.recv(T).unwrap(), b"pong");
    drop(h);
}

#[test]
fn a_failure_of_the_control_queue_pair_fails_only_its_requests_on_rxe() {
    let _serial = serial();
    a_queue_pair_failure_fails_only_its_requests(
        "a_failure_of_the_control_queue_pair_fails_only_its_requests_on_rxe",
        0,
    );
}

#[test]
fn a_failure_of_a_data_queue_pair_fails_only_its_requests_on_rxe() {
    let _serial = serial();
    a_queue_pair_failure_fails_only_its_requests(
        "a_failure_of_a_data_queue_pair_fails_only_its_requests_on_rxe",
        1,
    );
}
