//! The engine's staging path on the real CUDA driver (the H200): two
//! engines on two nodes of the simulated NIC fabric, each with the real
//! GPU. The sim NIC moves host memory only, so GPU memory goes through the
//! staging rung: the pipelined bounce pool, device memory copied by the
//! real driver. GPU→GPU, GPU→host and host→GPU, WRITE
//! and READ back, from 1 byte to 1 GiB including sizes that are not
//! multiples of the slice, data verified byte for byte. Skipped (with the
//! reason printed) without a GPU; a failure then with `GDR_EXPECT_GPU=1`.

use std::time::Duration;

use gdr_core::engine::EngineConfig;
use gdr_core::ladder::{LadderConfig, Policy, Rung};
use gdr_sim::SimVerbsApi;
use gdr_tests::engine_world::{EngineWorld, FenceWait, Kind};
use hal_cuda::cuda::CudaApi;

const T: Duration = Duration::from_secs(120);

/// The tests of this process share the real driver, on which a free
/// (`cuMemFree`, `cuMemFreeHost`, `cuMemHostUnregister`) waits for every
/// stream of the process holding a driver lock that async copies,
/// `cuEventRecord` and allocations wait for (issue 33 item 14). A test
/// that holds a stream itself on a word it stores later, and makes such
/// calls before it does (the gated batch's), would deadlock with any other
/// test's free: it runs alone (the write side); the others share (the
/// read side). Nothing of the engine needs this: a stream the engine holds
/// is released by its progress without a driver call.
static DRIVER_SHARED: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// For a test that holds no stream itself.
fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    DRIVER_SHARED
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// For a test that holds a stream itself.
fn alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    DRIVER_SHARED
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Two engines of this process over the sim NIC with the real GPU. The
/// peer-copy path is off (both engines share the GPUs and the process, so
/// it would take every GPU-to-GPU transfer): these tests are about the
/// staging path.
fn world(test: &str, policy: Policy) -> Option<EngineWorld<SimVerbsApi, CudaApi>> {
    world_with(test, policy, false)
}

fn world_with(
    test: &str,
    policy: Policy,
    peer_copy: bool,
) -> Option<EngineWorld<SimVerbsApi, CudaApi>> {
    let (driver, _ctx) = gdr_tests::cuda_gpu(test)?;
    let config = EngineConfig::default()
        .with_qps_per_peer(2)
        .with_default_timeout(T)
        .with_peer_copy(peer_copy)
        .with_ladder(LadderConfig::default().with_policy(policy));
    Some(EngineWorld::sim_with(1, config, T, |_| driver.clone()))
}

/// The ladder over a NIC that cannot reach the real GPU's memory (the sim
/// NIC refuses device addresses instead of dereferencing them) falls back
/// to staging, and the data still moves.
#[test]
fn real_gpu_memory_over_the_sim_nic_takes_the_staging_rung() {
    let _driver = shared();
    let name = "real_gpu_memory_over_the_sim_nic_takes_the_staging_rung";
    let Some(w) = world(name, Policy::Fallback) else {
        return;
    };
    let (src_rungs, dst_rungs, _) =
        w.write_and_read_back(Kind::Gpu, Kind::Gpu, 1 << 20, 3, 2, "fallback");
    assert_eq!(src_rungs, [Rung::Staging], "a's GPU memory");
    assert_eq!(dst_rungs, [Rung::Staging], "b's GPU memory");
}

/// Every direction and size through the pipeline on the real GPU.
#[test]
fn pipelined_staging_on_the_real_gpu() {
    let _driver = shared();
    let name = "pipelined_staging_on_the_real_gpu";
    let Some(w) = world(name, Policy::Only(Rung::Staging)) else {
        return;
    };
    let slice = w.a.engine.config().staging_slice;
    for len in [
        1,
        4095,
        slice - 1,
        slice + 1,
        5 * slice + 4097,
        64 << 20,
        1 << 30,
    ] {
        for (from, to) in [
            (Kind::Gpu, Kind::Gpu),
            (Kind::Gpu, Kind::Host),
            (Kind::Host, Kind::Gpu),
        ] {
            let seed = (len % 251) as u8;
            w.write_and_read_back(from, to, len, seed, 2, &format!("pipelined {len} B"));
        }
    }
}

/// Stream fences on the real driver. A staged READ (GPU memory over the
/// sim NIC) is fenced on the host: the call returns once the batch ended,
/// and a copy queued after it sees the data. A READ of host memory (the
/// sim NIC's direct rung) is fenced on the stream (`cuStreamWaitValue32`
/// on the engine's pinned word, released by its progress): prints the
/// delay from the batch's end (seen by a spinning host thread) to the
/// stream moving on, against waiting on the host and then queuing the
/// stream's work (median and p99 of 200): a measurement, not an
/// assertion.
#[test]
fn a_stream_fence_on_the_real_gpu() {
    let _driver = shared();
    use gdr_core::descriptor::GrantRights;
    use gdr_core::engine::Transfer;
    use hal_cuda::{Event as _, Stream as _};

    let name = "a_stream_fence_on_the_real_gpu";
    let Some(w) = world(name, Policy::Fallback) else {
        return;
    };
    let (batch, stream, event) = w.fenced_copy_after_a_held_read(1 << 20, 6, FenceWait::Host);
    assert_eq!(batch.status(), Some(Ok(())));
    let (_s, src) = w.b.alloc(Kind::Host, 4096, 6);
    let (_g, remote) = w.b_grants(&src, GrantRights::Read);
    let (_host_buf, host_region) = w.a.alloc(Kind::Host, 4096, 0);
    // The delay, fence against host wait, small READs.
    let mut fenced = Vec::new();
    let mut hosted = Vec::new();
    for _ in 0..200 {
        let batch =
            w.ab.submit(&[Transfer::read(&host_region, 0, &remote, 0, 4096)])
                .unwrap();
        batch.fence_stream(&stream).unwrap();
        stream.record(&event).unwrap();
        while batch.status().is_none() {}
        let ended = std::time::Instant::now();
        while !event.is_complete().unwrap() {}
        fenced.push(ended.elapsed());
        let batch =
            w.ab.submit(&[Transfer::read(&host_region, 0, &remote, 0, 4096)])
                .unwrap();
        batch.wait(T).unwrap();
        let ended = std::time::Instant::now();
        stream.record(&event).unwrap();
        while !event.is_complete().unwrap() {}
        hosted.push(ended.elapsed());
    }
    for (what, mut v) in [("stream fence", fenced), ("host wait", hosted)] {
        v.sort();
        eprintln!(
            "fence delay ({what}): median {:?} p99 {:?}",
            v[v.len() / 2],
            v[v.len() * 99 / 100]
        );
    }
}

/// CUDA VMM memory on the real driver through the engine over the sim NIC:
/// four chunks (cuMemCreate/cuMemMap, 2 MiB each on the H200) wrapped as
/// one buffer, one piece per chunk, WRITE and READ back across chunk
/// boundaries, and the peer through a's grant; data verified. The sim NIC
/// cannot reach the real GPU's memory, so every piece is staged: the
/// staging copies run over the chunks of one reservation.
#[test]
fn vmm_chunks_through_the_engine_on_the_real_gpu() {
    let _driver = shared();
    let name = "vmm_chunks_through_the_engine_on_the_real_gpu";
    let Some(w) = world(name, Policy::Fallback) else {
        return;
    };
    let Some((rungs, granted)) = w.vmm_round_trip(&[]) else {
        gdr_tests::skip_gpu(name, "the GPU has no CUDA VMM API");
        return;
    };
    eprintln!("pieces' rungs {rungs:?}, a's grant {:?}", granted.reach);
    assert_eq!(rungs.len(), 4, "one piece per chunk");
    // A chunk created without gpuDirectRDMACapable moves too.
    let Some((rungs, _)) = w.vmm_round_trip(&[1]) else {
        return;
    };
    assert_eq!(rungs[1], Rung::Staging, "the plain chunk is staged");
}

/// A chunk remapped at the same address under a registered buffer (the
/// driver gives it a new buffer id) is registered anew, and a READ lands
/// in the memory mapped now, not the old chunk.
#[test]
fn a_vmm_chunk_remapped_on_the_real_gpu_is_registered_anew() {
    let _driver = shared();
    let name = "a_vmm_chunk_remapped_on_the_real_gpu_is_registered_anew";
    let Some(w) = world(name, Policy::Fallback) else {
        return;
    };
    if w.vmm_remap_is_stale().is_none() {
        gdr_tests::skip_gpu(name, "the GPU has no CUDA VMM API");
    }
}

/// Sizes of the peer-copy tests on the real driver.
const PEER_COPY_SIZES: [u64; 6] = [1, 4097, (16 << 20) + 3, 64 << 20, (256 << 20) + 1, 1 << 30];

/// Two engines of this process (the sim NIC between them) with the real
/// GPU memory: transfers go by CUDA device copies, GPU 0 to GPU 1 where
/// there are two GPUs (peer access enabled: NVLink), GPU 0 to itself on a
/// one-GPU machine; data verified, no NIC work request for them.
#[test]
fn two_engines_of_one_process_copy_by_peer_copy_on_the_real_gpu() {
    let _driver = shared();
    use gdr_core::engine::PeerCopyRoute;
    use gdr_tests::engine_world::peer_copy_gpus;

    let name = "two_engines_of_one_process_copy_by_peer_copy_on_the_real_gpu";
    let Some(w) = world_with(name, Policy::Fallback, true) else {
        return;
    };
    let gpus = peer_copy_gpus::<CudaApi>(&w.a.cuda);
    eprintln!("peer copy between GPU {} and GPU {}", gpus.0, gpus.1);
    for (i, len) in PEER_COPY_SIZES.into_iter().enumerate() {
        w.peer_copy_round_trip(gpus, len, i as u8 + 1, PeerCopyRoute::SameProcess);
    }
}

/// Where the child of the two-process test connects (set only in it).
const PEER_COPY_CHILD_ENV: &str = "GDR_PEER_COPY_CHILD_CONNECT";
const PEER_COPY_LEN: u64 = (64 << 20) + 5;

/// Two processes on this host, the engines connected over SoftRoCE
/// (`rxe0`: the only way two processes' engines meet without an RDMA NIC;
/// skipped without it, or failed with `GDR_EXPECT_RXE=1`), the child the
/// test binary itself: the child grants its GPU memory, this process
/// READs it and WRITEs into it by device copies through the CUDA IPC
/// handle the child sent (opened on this process's context), and the child
/// checks what arrived.
#[test]
fn two_processes_copy_through_cuda_ipc_on_the_real_gpu() {
    let _driver = shared();
    use gdr_core::engine::{PeerCopyRoute, Transfer};
    use gdr_tests::engine_world::{Side, peer_copy_gpus};
    use gdr_tests::{pattern, rxe};
    use hal_verbs::rdma::RdmaApi;

    let name = "two_processes_copy_through_cuda_ipc_on_the_real_gpu";
    if let Ok(addr) = std::env::var(PEER_COPY_CHILD_ENV) {
        peer_copy_child(name, addr.parse().expect("the parent's address"));
        return;
    }
    let Some((driver, _ctx)) = gdr_tests::cuda_gpu(name) else {
        return;
    };
    let Some((provider, _rctx)) = rxe::open_rxe(name) else {
        return;
    };
    let gpus = peer_copy_gpus::<CudaApi>(&driver);
    let side = Side::<RdmaApi, CudaApi>::new(provider, driver, rxe_config());
    let listener = side
        .engine
        .listen(std::net::SocketAddr::new(rxe::expected_ip(), 0))
        .unwrap();
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(PEER_COPY_CHILD_ENV, listener.local_addr().to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawning the child");
    let peer = listener.accept(T).expect("the child connects");
    assert_eq!(peer.route(), PeerCopyRoute::Ipc, "another process");
    let id = peer.recv(T).expect("the child's grant id");
    let id = u64::from_le_bytes(id.try_into().expect("8 bytes"));
    let remote = peer.wait_grant(id, T).unwrap();
    let len = PEER_COPY_LEN;
    let (back_buf, back) = side.gpu_on(gpus.0, len, 0);
    let before = side.engine.peer_copy_stats();
    peer.submit(&[Transfer::read(&back, 0, &remote, 0, len)])
        .unwrap()
        .wait(T)
        .unwrap_or_else(|e| panic!("READ: {e}"));
    assert!(
        side.bytes(&back_buf) == pattern(len as usize, 0x5a),
        "the child's memory, READ"
    );
    let (_s, src) = side.gpu_on(gpus.0, len, 0x6b);
    peer.submit(&[Transfer::write(&src, 0, &remote, 0, len)])
        .unwrap()
        .wait(T)
        .unwrap_or_else(|e| panic!("WRITE: {e}"));
    let after = side.engine.peer_copy_stats();
    assert_eq!(
        after.bytes - before.bytes,
        2 * len,
        "both went by peer copy"
    );
    peer.send(b"check").unwrap().wait(T).unwrap();
    let verdict = peer.recv(T).expect("the child's verdict");
    let out = child.wait_with_output().unwrap();
    eprintln!(
        "child stderr:\n{}\nchild stdout:\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(verdict, b"ok", "the child saw the WRITE's data");
    assert!(out.status.success(), "the child failed: {:?}", out.status);
}

fn rxe_config() -> EngineConfig {
    EngineConfig::default()
        .with_devices([gdr_tests::rxe::device_name()])
        .with_default_timeout(T)
}

/// The child half: connects, grants its GPU memory (holding a pattern),
/// sends the grant's id, and checks what the parent wrote when told.
fn peer_copy_child(name: &str, addr: std::net::SocketAddr) {
    use gdr_core::descriptor::GrantRights;
    use gdr_tests::engine_world::{Side, peer_copy_gpus};
    use gdr_tests::{pattern, rxe};
    use hal_verbs::rdma::RdmaApi;

    let (driver, _ctx) = gdr_tests::cuda_gpu(name).expect("child: the GPU");
    let (provider, _rctx) = rxe::open_rxe(name).expect("child: rxe0");
    let gpus = peer_copy_gpus::<CudaApi>(&driver);
    let side = Side::<RdmaApi, CudaApi>::new(provider, driver, rxe_config());
    let peer = side.engine.connect(addr, T).expect("child: connect");
    let len = PEER_COPY_LEN;
    let (buf, region) = side.gpu_on(gpus.1, len, 0x5a);
    let grant = peer
        .grant(&region, 0, len, GrantRights::ReadWrite)
        .expect("child: grant");
    peer.send(&grant.descriptor().grant.to_le_bytes())
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(peer.recv(T).expect("child: told to check"), b"check");
    let ok = side.bytes(&buf) == pattern(len as usize, 0x6b);
    peer.send(if ok { b"ok" } else { b"no" })
        .unwrap()
        .wait(T)
        .unwrap();
    // The parent reads the verdict before we go.
    std::thread::sleep(Duration::from_millis(500));
    drop(grant);
    assert!(ok, "child: the parent's WRITE did not arrive");
}

/// A gated batch on the real driver (`cuStreamWriteValue32` into the
/// engine's pinned word): a WRITE of GPU memory gated on a held stream that
/// first copies new bytes into it moves nothing while the stream is held,
/// and moves those bytes once released. Prints the delay from the
/// stream's write (seen by a spinning host thread on a marker the stream
/// writes just before the gate) to the batch being posted by the engine's
/// own thread, against a host thread that waits for the stream's event and
/// then submits (median and p99 of 200, 4 KiB WRITEs of host memory, so no
/// staging copy is timed): a measurement, not an assertion.
#[test]
fn a_gated_batch_on_the_real_gpu() {
    let _driver = alone();
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Instant;

    use gdr_core::buffer::Buffer;
    use gdr_core::descriptor::GrantRights;
    use gdr_core::engine::Transfer;
    use gdr_tests::engine_world::HeldStream;
    use hal_cuda::{Context as _, Driver as _, Event as _, Stream as _};

    let name = "a_gated_batch_on_the_real_gpu";
    let Some(w) = world(name, Policy::Fallback) else {
        return;
    };
    w.gated_write_after_a_held_stream(1 << 20, 21);

    let (_s, src) = w.a.alloc(Kind::Host, 4096, 3);
    let (_d, dst) = w.b.alloc(Kind::Host, 4096, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::Write);
    let write = [Transfer::write(&src, 0, &remote, 0, 4096)];
    let ctx = w.a.driver.context(0).unwrap();
    let marker = Buffer::alloc_pinned(&ctx, 4096).unwrap();
    marker.write_at(0, &[0; 4]).unwrap();
    let held = HeldStream::new(&ctx);
    let event = ctx.create_event().unwrap();
    // SAFETY: the marker is pinned memory of this test (page aligned),
    // alive until the end (the stream is drained first: declared after);
    // host and device touch it only with aligned 32-bit accesses.
    let marker_word = unsafe { &*(marker.addr() as *const AtomicU32) };
    let posted = || -> u64 { w.ab.counters().iter().map(|(_, _, c)| c.posted).sum() };
    // The stream writes `value` to the marker, then is released; returns
    // when the host sees the write.
    let marked_release = |value: u32| {
        held.release();
        while marker_word.load(Ordering::Acquire) < value {
            std::hint::spin_loop();
        }
        Instant::now()
    };
    let mut gated = Vec::new();
    let mut hosted = Vec::new();
    for i in 1..=200u32 {
        // SAFETY: as above; the marker outlives the stream's work.
        unsafe { held.stream.write_value32(marker.addr(), 2 * i - 1) }.unwrap();
        let before = posted();
        let batch =
            w.ab.submit_after_stream(&held.stream, &write, Some(T))
                .unwrap();
        let written = marked_release(2 * i - 1);
        while posted() == before {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
        gated.push(written.elapsed());
        batch.wait(T).unwrap();
        held.hold();

        // SAFETY: as above.
        unsafe { held.stream.write_value32(marker.addr(), 2 * i) }.unwrap();
        held.stream.record(&event).unwrap();
        let written = marked_release(2 * i);
        while !event.is_complete().unwrap() {}
        let batch = w.ab.submit(&write).unwrap();
        hosted.push(written.elapsed());
        batch.wait(T).unwrap();
        held.hold();
    }
    for (what, mut v) in [("gate", gated), ("host wait", hosted)] {
        v.sort();
        eprintln!(
            "stream write to batch posted ({what}): median {:?} p99 {:?}",
            v[v.len() / 2],
            v[v.len() * 99 / 100]
        );
    }
}

/// Another thread frees pinned memory while a staged batch is fenced:
/// `cuMemFreeHost` waits for every stream holding the driver's lock, and
/// the batch's staging copy (`cuMemcpyHtoDAsync`) waits behind that lock.
/// A fence that held its stream on the batch deadlocked so, the hang two
/// of these tests hit when run at once (issue 33 item 14; seen on an H100:
/// "the free did not return within 120s"); the fence of a staged batch
/// waits on the host. The simulation runs the same in `sim_engine_fence`.
#[test]
fn a_free_while_a_fence_waits_on_the_real_gpu() {
    let _driver = shared();
    let name = "a_free_while_a_fence_waits_on_the_real_gpu";
    let Some(w) = world(name, Policy::Only(Rung::Staging)) else {
        return;
    };
    w.fenced_read_while_another_thread_frees(1 << 20, 9);
}
