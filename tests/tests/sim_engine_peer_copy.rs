//! The peer-copy path on the simulated node with two GPUs: engine a's
//! memory on GPU 0, engine b's on GPU 1, in one process (the registry
//! path) and in two simulated processes (the CUDA IPC path: b's grants
//! reach a as IPC handles that a opens on its own context; the simulated
//! driver refuses another process's device addresses, so nothing but the
//! opened mapping can work). WRITE and READ from 1 byte to 64 MiB, data
//! verified, the route asserted (peer-copy counters, no NIC work request);
//! rights, bounds and revoked grants refused; a copy fault fails only its
//! batch; deadlines, cancel and a stream fence; `peer_copy = false` takes
//! the NIC.

use std::sync::Mutex;
use std::time::Duration;

use gdr_core::descriptor::GrantRights;
use gdr_core::engine::{
    EngineConfig, EngineError, PeerCopyRoute, Refusal, Transfer, TransferError,
};
use gdr_sim::{Fault, FaultSite, GpuConfig, SimCuda, SimVerbsApi};
use gdr_tests::engine_world::EngineWorld;
use gdr_tests::pattern;
use hal_cuda::{Context as _, Driver as _, Event as _, Stream as _};

const T: Duration = Duration::from_secs(20);
const MIB: u64 = 1 << 20;

/// Slices smaller than the transfers, so several streams carry one batch.
fn config() -> EngineConfig {
    EngineConfig::default()
        .with_default_timeout(T)
        .with_peer_copy_slice(MIB + 3)
}

/// Two engines on one simulated node with two GPUs: in one simulated
/// process, or b in another (`ipc`). Returns the world and a's driver.
fn world_of(
    configs: (EngineConfig, EngineConfig),
    ipc: bool,
) -> (EngineWorld<SimVerbsApi>, SimCuda) {
    let made: Mutex<Option<SimCuda>> = Mutex::new(None);
    let w = EngineWorld::sim_sides(1, configs, T, |fabric| {
        let mut made = made.lock().unwrap();
        match &*made {
            None => {
                let second = GpuConfig {
                    pci_bus_id: "0000:2a:00.0".into(),
                    ..GpuConfig::default()
                };
                let cuda = SimCuda::new(vec![GpuConfig::default(), second], fabric.faults());
                *made = Some(cuda.clone());
                cuda
            }
            Some(first) if ipc => first.other_process(),
            Some(first) => first.clone(),
        }
    });
    let cuda = made.into_inner().unwrap().expect("a's driver");
    (w, cuda)
}

fn world(ipc: bool) -> (EngineWorld<SimVerbsApi>, SimCuda) {
    world_of((config(), config()), ipc)
}

const SIZES: [u64; 5] = [1, 4097, 3 * MIB + 5, 7 * MIB, 64 * MIB];

#[test]
fn engines_of_one_process_copy_between_their_gpus() {
    let (w, cuda) = world(false);
    assert_eq!(w.ba.route(), PeerCopyRoute::SameProcess, "both ways");
    let copies = cuda.device_copies(0);
    for (i, len) in SIZES.into_iter().enumerate() {
        w.peer_copy_round_trip((0, 1), len, i as u8 + 1, PeerCopyRoute::SameProcess);
    }
    assert!(
        cuda.peer_access_enabled(0) >= 1,
        "GPU 0 was given access to GPU 1"
    );
    let slices: u64 = SIZES.iter().map(|l| 2 * l.div_ceil(MIB + 3) + 1).sum();
    assert!(
        cuda.device_copies(0) - copies >= slices - SIZES.len() as u64,
        "the copies ran on a's GPU, slice by slice"
    );
}

#[test]
fn engines_of_one_process_on_one_gpu() {
    let (w, _cuda) = world(false);
    w.peer_copy_round_trip((0, 0), 5 * MIB + 1, 9, PeerCopyRoute::SameProcess);
}

#[test]
fn an_engine_of_another_process_is_reached_through_ipc() {
    let (w, cuda) = world(true);
    assert_eq!(w.ba.route(), PeerCopyRoute::Ipc, "both ways");
    for (i, len) in SIZES.into_iter().enumerate() {
        w.peer_copy_round_trip((0, 1), len, i as u8 + 20, PeerCopyRoute::Ipc);
    }
    assert_eq!(
        cuda.peer_access_enabled(0),
        0,
        "an IPC mapping needs no explicit peer access"
    );
}

/// Off on either side (that side sends no locality and no handle, and
/// routes nothing by peer copy): the NIC moves the data.
#[test]
fn peer_copy_off_on_either_side_takes_the_nic() {
    for a_off in [true, false] {
        let off = config().with_peer_copy(false);
        let configs = if a_off {
            (off, config())
        } else {
            (config(), off)
        };
        let (w, _cuda) = world_of(configs, false);
        assert_eq!(w.ab.route(), PeerCopyRoute::Nic, "a off: {a_off}");
        assert_eq!(w.ba.route(), PeerCopyRoute::Nic, "a off: {a_off}");
        w.peer_copy_round_trip((0, 1), 3 * MIB + 1, 4, PeerCopyRoute::Nic);
    }
}

#[test]
fn rights_and_bounds_are_refused_before_any_copy() {
    for ipc in [false, true] {
        let (w, cuda) = world(ipc);
        let (_s, src) = w.a.gpu_on(0, 8192, 1);
        let (_d, dst) = w.b.gpu_on(1, 8192, 0);
        let (_g, read_only) = w.b_grants(&dst, GrantRights::Read);
        let copies = cuda.device_copies(0);
        let err =
            w.ab.submit(&[Transfer::write(&src, 0, &read_only, 0, 8192)])
                .unwrap_err();
        assert!(
            matches!(err, EngineError::AccessDenied { .. }),
            "ipc {ipc}: {err}"
        );
        let err =
            w.ab.submit(&[Transfer::read(&src, 0, &read_only, 4096, 4097)])
                .unwrap_err();
        assert!(
            matches!(err, EngineError::OutOfBounds { .. }),
            "ipc {ipc}: {err}"
        );
        let err =
            w.ab.submit(&[Transfer::read(&src, 4096, &read_only, 0, 4097)])
                .unwrap_err();
        assert!(
            matches!(err, EngineError::OutOfBounds { .. }),
            "ipc {ipc}: the local side: {err}"
        );
        assert_eq!(cuda.device_copies(0), copies, "ipc {ipc}: nothing copied");
        assert_eq!(w.a.engine.peer_copy_stats().batches, 0, "ipc {ipc}");
    }
}

#[test]
fn a_revoked_grant_is_refused() {
    for ipc in [false, true] {
        let (w, _cuda) = world(ipc);
        let (_s, src) = w.a.gpu_on(0, 4096, 1);
        let (_d, dst) = w.b.gpu_on(1, 4096, 0);
        let (grant, remote) = w.b_grants(&dst, GrantRights::ReadWrite);
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, 4096)])
            .unwrap()
            .wait(T)
            .unwrap();
        grant.revoke(T).unwrap();
        let start = std::time::Instant::now();
        while w.ab.remote_grant(remote.grant).is_some() {
            assert!(start.elapsed() < T, "the revocation never arrived");
            w.a.engine.progress();
        }
        let err =
            w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, 4096)])
                .unwrap_err();
        assert!(
            matches!(err, EngineError::Refused(Refusal::GrantRevoked { grant }) if grant == remote.grant),
            "ipc {ipc}: {err}"
        );
    }
}

#[test]
fn a_copy_fault_fails_only_its_batch() {
    for ipc in [false, true] {
        let (w, cuda) = world(ipc);
        let len = 3 * MIB;
        let (_s, src) = w.a.gpu_on(0, len, 8);
        let (dst_buf, dst) = w.b.gpu_on(1, len, 0);
        let (_g, remote) = w.b_grants(&dst, GrantRights::ReadWrite);
        let failure = hal_cuda::CudaError::Driver {
            operation: "cuMemcpyDtoDAsync",
            code: 700,
            name: "CUDA_ERROR_ILLEGAL_ADDRESS",
        };
        // The second slice of the first batch (3 slices) fails to queue.
        let faults = w.fabric().faults();
        let calls = faults.calls(FaultSite::CudaCopy);
        faults.fail_nth(FaultSite::CudaCopy, calls + 2, Fault::Cuda(failure));
        let failed =
            w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, len)])
                .unwrap();
        let other =
            w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, len)])
                .unwrap();
        let err = failed.wait(T).unwrap_err();
        assert!(
            matches!(
                &err,
                TransferError::Gpu {
                    what: "a peer copy",
                    ..
                }
            ),
            "ipc {ipc}: {err}"
        );
        other
            .wait(T)
            .unwrap_or_else(|e| panic!("ipc {ipc}: the other batch: {e}"));
        assert!(
            w.b.bytes(&dst_buf) == pattern(len as usize, 8),
            "ipc {ipc}: the data"
        );
        w.fabric().faults().assert_all_fired();
        assert_eq!(
            w.a.engine.peer_copy_stats().batches,
            1,
            "ipc {ipc}: only the other batch counts as moved"
        );
        drop(cuda);
    }
}

#[test]
fn a_peer_copy_batch_times_out_or_is_cancelled_and_holds_its_memory_till_the_copies_ran() {
    let (w, cuda) = world(false);
    let len = 2 * MIB;
    let (_s, src) = w.a.gpu_on(0, len, 3);
    let (dst_buf, dst) = w.b.gpu_on(1, len, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::ReadWrite);
    // Paused, the simulated GPUs run nothing: the copies stay queued.
    cuda.set_paused(true);
    let late =
        w.ab.submit_with_timeout(
            &[Transfer::write(&src, 0, &remote, 0, len)],
            Duration::from_millis(20),
        )
        .unwrap();
    let cancelled =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, len)])
            .unwrap();
    cancelled.cancel();
    let err = late.wait(T).unwrap_err();
    assert!(matches!(err, TransferError::Timeout(_)), "{err}");
    assert_eq!(
        cancelled.status(),
        None,
        "a cancelled batch ends once its copies ran, not before"
    );
    assert!(
        w.b.bytes(&dst_buf) == pattern(len as usize, 0),
        "nothing ran while paused"
    );
    cuda.set_paused(false);
    assert_eq!(cancelled.wait(T), Err(TransferError::Cancelled));
    assert!(
        w.b.bytes(&dst_buf) == pattern(len as usize, 3),
        "queued copies cannot be recalled: they ran"
    );
}

/// A peer copy's end needs CUDA calls (its windows are queued by
/// progress), so its fence waits on the host; the copy queued on the
/// stream after it sees the data.
#[test]
fn a_stream_fence_waits_for_a_peer_copy() {
    let (w, cuda) = world(true);
    let len = 3 * MIB + 7;
    let (_s, src) = w.a.gpu_on(0, len, 12);
    let (_d, dst) = w.b.gpu_on(1, len, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::ReadWrite);
    let (back_buf, back) = w.a.gpu_on(0, len, 0);
    w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, len)])
        .unwrap()
        .wait(T)
        .unwrap();
    let ctx = cuda.erased().context(0).unwrap();
    let stream = gdr_core::Stream::from_erased(0, ctx.create_stream().unwrap());
    let out = gdr_core::buffer::Buffer::alloc_pinned(&ctx, len).unwrap();
    let event = ctx.create_event().unwrap();
    let batch =
        w.ab.submit(&[Transfer::read(&back, 0, &remote, 0, len)])
            .unwrap();
    batch.fence_stream(&stream).unwrap();
    // SAFETY: both ranges hold `len` bytes and outlive the stream's work
    // (its event is waited for below).
    unsafe { stream.copy_device_to_host(out.addr() as *mut u8, back_buf.addr(), len as usize) }
        .unwrap();
    stream.record(&event).unwrap();
    let start = std::time::Instant::now();
    while !event.is_complete().unwrap() {
        assert!(start.elapsed() < T, "the stream never moved on");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(batch.status(), Some(Ok(())));
    assert!(
        out.to_vec().unwrap() == pattern(len as usize, 12),
        "the copy after the fence saw the data"
    );
}

/// Two simulated nodes (each its own `SimCuda`, as in every other engine
/// test) are two hosts: their GPUs never reach each other by copies.
#[test]
fn engines_of_two_simulated_nodes_use_the_nic() {
    let w = EngineWorld::sim(1, GpuConfig::default(), config(), T);
    assert_eq!(w.ab.route(), PeerCopyRoute::Nic);
    w.peer_copy_round_trip((0, 0), MIB + 1, 2, PeerCopyRoute::Nic);
}

/// Slices of 64 KiB: a 4 MiB transfer is 64 of them, queued a window (one
/// slice per stream, 4 streams) at a time, two windows at most.
fn small_slices() -> EngineConfig {
    config().with_peer_copy_slice(64 * 1024)
}

#[test]
fn a_revoke_stops_a_peer_copy_at_its_next_window_and_returns_once_nothing_of_it_runs() {
    for ipc in [false, true] {
        let (w, cuda) = world_of((small_slices(), small_slices()), ipc);
        let len = 4 * MIB;
        let (_s, src) = w.a.gpu_on(0, len, 5);
        let (dst_buf, dst) = w.b.gpu_on(1, len, 0);
        let (grant, remote) = w.b_grants(&dst, GrantRights::ReadWrite);
        let grant_id = remote.grant;
        // a's GPU holds the first windows queued until the revoke is under
        // way.
        cuda.set_paused(true);
        let batch =
            w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, len)])
                .unwrap();
        let (fenced, took) = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                cuda.set_paused(false);
            });
            let start = std::time::Instant::now();
            grant
                .revoke(T)
                .unwrap_or_else(|e| panic!("ipc {ipc}: the revoke was not confirmed: {e}"));
            let took = start.elapsed();
            (w.b.bytes(&dst_buf), took)
        });
        // Issue 33, item 6: the end of the copies' use of the grant wakes
        // the owner's revoke, which took its whole timeout.
        assert!(
            took < Duration::from_secs(3),
            "ipc {ipc}: the revoke returned after {took:?}, not once the copies ended ({T:?} \
             allowed)"
        );
        assert_eq!(
            batch.wait(T),
            Err(TransferError::Revoked { grant: grant_id }),
            "ipc {ipc}"
        );
        std::thread::sleep(Duration::from_millis(50));
        w.a.engine.progress();
        assert!(
            w.b.bytes(&dst_buf) == fenced,
            "ipc {ipc}: bytes moved under the grant after its revoke returned"
        );
        let want = pattern(len as usize, 5);
        let landed = fenced.iter().zip(&want).filter(|(a, b)| a == b).count();
        assert!(
            landed <= 8 * 64 * 1024 + len as usize / 256,
            "ipc {ipc}: {landed} of {len} bytes landed: the revoke did not stop the copies \
             queued after it (two windows of four 64 KiB slices may run)"
        );
    }
}

#[test]
fn a_revoke_a_peer_process_has_not_confirmed_reports_timeout() {
    let (w, cuda) = world_of((small_slices(), small_slices()), true);
    let len = MIB;
    let (_s, src) = w.a.gpu_on(0, len, 6);
    let (_d, dst) = w.b.gpu_on(1, len, 0);
    let (grant, remote) = w.b_grants(&dst, GrantRights::ReadWrite);
    cuda.set_paused(true);
    let batch =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, len)])
            .unwrap();
    // The importer's copies stay queued: it cannot release the grant.
    let err = grant.revoke(Duration::from_millis(300)).unwrap_err();
    assert!(matches!(err, EngineError::Timeout(_)), "{err}");
    cuda.set_paused(false);
    assert!(
        matches!(batch.wait(T), Err(TransferError::Revoked { .. })),
        "the batch under the revoked grant fails"
    );
}

/// The driver calls a peer-copy batch needs first can take long: opening
/// the peer's IPC handle (`cuIpcOpenMemHandle`, another process's
/// engine), enabling peer access between the two GPUs
/// (`cuCtxEnablePeerAccess`, an engine of this process); each is scripted
/// here to take 3 s. The engine makes them outside its lock, so
/// everything else it does (here: its resources and a progress call,
/// which take the lock) goes on meanwhile; the batch then moves its bytes
/// by peer copy.
#[test]
fn a_slow_driver_call_of_a_peer_copy_holds_nobody_else_up() {
    for (ipc, site) in [
        (true, FaultSite::CudaIpcOpen),
        (false, FaultSite::CudaEnablePeerAccess),
    ] {
        slow_driver_call_holds_nobody_else_up(ipc, site);
    }
}

fn slow_driver_call_holds_nobody_else_up(ipc: bool, site: FaultSite) {
    use std::sync::atomic::{AtomicBool, Ordering};
    const SLOW: Duration = Duration::from_secs(3);
    let (w, _cuda) = world(ipc);
    let len = MIB + 7;
    let (_src_buf, src) = w.a.gpu_on(0, len, 31);
    let (dst_buf, dst) = w.b.gpu_on(1, len, 0);
    let (_grant, remote) = w.b_grants(&dst, GrantRights::ReadWrite);
    let faults = w.fabric().faults();
    let calls = faults.calls(site);
    faults.fail_nth(site, calls + 1, Fault::Slow(SLOW));
    let before = w.a.engine.peer_copy_stats();
    let submitted = AtomicBool::new(false);
    std::thread::scope(|s| {
        let copy = s.spawn(|| {
            let batch = w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, len)]);
            submitted.store(true, Ordering::SeqCst);
            batch.expect("submitted").wait(T)
        });
        let start = std::time::Instant::now();
        while faults.calls(site) == calls {
            assert!(
                start.elapsed() < T,
                "{site:?}: the submit never made the call"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // The call is under way (it takes SLOW): the lock is free.
        let _ = w.a.engine.resources();
        w.a.engine.progress();
        assert!(
            !submitted.load(Ordering::SeqCst),
            "{site:?}: the engine's calls waited for it"
        );
        copy.join().unwrap().expect("the peer copy");
    });
    faults.assert_all_fired();
    assert!(
        w.b.bytes(&dst_buf) == pattern(len as usize, 31),
        "{site:?}: its data"
    );
    assert_eq!(w.a.engine.peer_copy_stats().batches - before.batches, 1);
}

/// The peer-copy path's part of each peer lives in the peer's slot: a
/// peer-copy submit and its cancel, and a grant of GPU memory peer copy
/// may export (published to an engine of this process, or its IPC handle
/// sent to another process's) and its revoke, take the peer's lock alone.
/// Each is done here while another thread holds that engine's lock; the
/// batches move once progress (which needs it) runs again.
#[test]
fn peer_copies_and_exportable_grants_are_taken_while_the_engines_lock_is_held() {
    const HOLD: Duration = Duration::from_secs(3);
    for ipc in [false, true] {
        let (w, _cuda) = world(ipc);
        let len = MIB + 7;
        let (_s, src) = w.a.gpu_on(0, len, 41);
        let (dst_buf, dst) = w.b.gpu_on(1, len, 0);
        let (_g, remote) = w.b_grants(&dst, GrantRights::ReadWrite);
        // A first batch makes the driver calls (the IPC handle opened,
        // peer access enabled), outside every lock anyway.
        let write = [Transfer::write(&src, 0, &remote, 0, len)];
        w.ab.submit(&write).unwrap().wait(T).unwrap();
        let ((), in_time) = w.b.while_engine_lock_held(HOLD, || {
            for _ in 0..4 {
                let grant = w.ba.grant(&dst, 0, len, GrantRights::ReadWrite).unwrap();
                match ipc {
                    // Fenced at once: no copy runs under it.
                    false => grant.revoke(T).unwrap(),
                    // The importer's release comes with progress: the
                    // drop starts the revoke without waiting for it.
                    true => drop(grant),
                }
            }
        });
        assert!(
            in_time,
            "ipc {ipc}: an exportable grant or its revoke waited for the engine's lock"
        );
        let stats = w.a.engine.peer_copy_stats();
        let ((kept, cancelled), in_time) = w.a.while_engine_lock_held(HOLD, || {
            let kept = w.ab.submit(&write).unwrap();
            let cancelled = w.ab.submit(&write).unwrap();
            cancelled.cancel();
            (kept, cancelled)
        });
        assert!(
            in_time,
            "ipc {ipc}: a peer-copy submit or cancel waited for the engine's lock"
        );
        kept.wait(T).unwrap();
        match cancelled.wait(T) {
            Ok(()) | Err(TransferError::Cancelled) => {}
            Err(e) => panic!("ipc {ipc}: the cancelled batch: {e}"),
        }
        assert!(
            w.a.engine.peer_copy_stats().batches > stats.batches,
            "ipc {ipc}: by peer copy"
        );
        assert!(w.b.bytes(&dst_buf) == pattern(len as usize, 41));
    }
}

/// Every control message is handled under its peer's lock, a path's
/// included: b's grant of GPU memory to a (another process) sends the
/// grant's IPC handle (the peer-copy path's message) before its
/// announcement (the connection's), and a takes both, and the grant
/// waited for, while another thread holds a's engine lock. (Before, a
/// path's message, and every one after it, waited for the engine's pass.)
#[test]
fn a_paths_messages_are_taken_while_the_engines_lock_is_held() {
    let (w, _cuda) = world(true);
    let len = MIB;
    let (_d, dst) = w.b.gpu_on(1, len, 0);
    let before = w.a.engine.resources();
    let ipc_handles = |r: &gdr_core::engine::EngineResources| {
        r.peers.iter().map(|p| p.ipc_handles).sum::<usize>()
    };
    let (granted, in_time) = w.a.while_engine_lock_held(Duration::from_secs(3), || {
        let grant = w.ba.grant(&dst, 0, len, GrantRights::ReadWrite).unwrap();
        let seen = w.ab.wait_grant(grant.descriptor().grant, T);
        (grant, seen)
    });
    assert!(in_time, "a's messages waited for a's engine lock");
    let (grant, seen) = granted;
    assert_eq!(seen.unwrap().grant, grant.descriptor().grant);
    assert_eq!(
        ipc_handles(&w.a.engine.resources()),
        ipc_handles(&before) + 1,
        "the IPC handle was taken by the path, before the announcement"
    );
}
