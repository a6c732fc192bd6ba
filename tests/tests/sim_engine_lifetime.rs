//! What keeps memory alive under the engine's paths (simulated NICs and
//! GPUs): a region holds its buffer's memory through the buffer's lease on
//! every rung, the staging rung included, so a buffer dropped (or caller
//! memory released) under a live region or grant is never written after
//! it is freed, by a peer or by this side.

use std::time::Duration;

use gdr_core::buffer::Buffer;
use gdr_core::descriptor::GrantRights;
use gdr_core::engine::{EngineConfig, Transfer};
use gdr_core::ladder::Rung;
use gdr_sim::{GpuConfig, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, staged_only, staged_through_slots};
use gdr_tests::pattern;
use hal_cuda::{Context as _, DeviceMemory as _, Driver as _};

const T: Duration = Duration::from_secs(10);
const LEN: u64 = 64 * 1024;

/// GPU memory takes only the staging rung (no MR over it).
fn staging_world() -> EngineWorld<SimVerbsApi> {
    let config = staged_only(
        EngineConfig::default()
            .with_qps_per_peer(1)
            .with_slice_size(16 * 1024)
            .with_default_timeout(T),
    );
    EngineWorld::sim(1, GpuConfig::default(), config, T)
}

/// The simulator saw no access to freed memory of b's GPU (it refuses and
/// reports each, whether or not the address was handed out again).
fn no_use_after_free(w: &EngineWorld<SimVerbsApi>) {
    let reports = w.b.cuda.use_after_free_reports(0);
    assert!(reports.is_empty(), "use after free: {reports:?}");
}

/// A GPU buffer of `LEN` bytes on b holding `pattern(LEN, seed)`, made
/// after the staged buffer was dropped: the allocator may hand back the
/// dropped buffer's address (CUDA's does; so does the simulator's).
fn later_allocation(w: &EngineWorld<SimVerbsApi>, seed: u8) -> Buffer {
    let ctx = w.b.driver.context(0).unwrap();
    let later = Buffer::alloc_device(&ctx, LEN).unwrap();
    w.b.write_device(later.addr(), &pattern(LEN as usize, seed));
    later
}

/// Finding 1 of the engine review, the peer's side: b's staged GPU buffer
/// is dropped while its region and grant live, and another allocation of
/// the same size follows. a's WRITE through the old grant must not reach
/// the later allocation (it overwrote 65,280 of its 65,536 bytes when the
/// staging rung held nothing of the buffer).
#[test]
fn a_peer_write_through_a_staged_grant_never_reaches_a_later_allocation() {
    let w = staging_world();
    let (_src_buf, src) = w.a.host(LEN, 5);
    let (gpu_buf, gpu) = w.b.gpu(LEN, 0);
    assert_eq!(gpu.rungs(), [Rung::Staging]);
    let (_grant, remote) = w.b_grants(&gpu, GrantRights::ReadWrite);
    drop(gpu_buf);
    let later = later_allocation(&w, 77);
    let outcome =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
            .unwrap()
            .wait(T);
    assert!(
        w.b.bytes(&later) == pattern(LEN as usize, 77),
        "the later allocation was written through the old grant ({outcome:?})"
    );
    // The region (and so the memory) is still b's: the WRITE landed there.
    assert_eq!(outcome, Ok(()));
    no_use_after_free(&w);
}

/// Finding 1, the local side: b READs into its own staged region whose
/// buffer was dropped; the bytes must land in the region's memory, not in
/// a later allocation at the same address.
#[test]
fn a_local_read_into_a_staged_region_never_reaches_a_later_allocation() {
    let w = staging_world();
    let (_src_buf, src) = w.a.host(LEN, 9);
    let (gpu_buf, gpu) = w.b.gpu(LEN, 0);
    let (_grant, remote) =
        gdr_tests::engine_world::grant_to(&w.ab, &w.ba, &src, GrantRights::Read, T);
    drop(gpu_buf);
    let later = later_allocation(&w, 78);
    let outcome =
        w.ba.submit(&[Transfer::read(&gpu, 0, &remote, 0, LEN)])
            .unwrap()
            .wait(T);
    assert!(
        w.b.bytes(&later) == pattern(LEN as usize, 78),
        "the later allocation was written by a READ into the old region ({outcome:?})"
    );
    assert_eq!(outcome, Ok(()));
    no_use_after_free(&w);
}

/// Finding 1 for caller memory: a staged region over `Buffer::wrap`ped GPU
/// memory holds a lease, so `Buffer::release` does not hand the memory
/// back while the region lives (and does once it is gone).
#[test]
fn wrapped_gpu_memory_on_the_staging_rung_is_not_released_under_a_region() {
    let w = staging_world();
    let ctx = w.b.driver.context(0).unwrap();
    let memory = ctx.alloc(LEN as usize).unwrap();
    // SAFETY: `memory` outlives the buffer (released before it is dropped).
    let wrapped = unsafe { Buffer::wrap(Some(&ctx), memory.device_ptr(), LEN, None) }.unwrap();
    let region = w.b.engine.register_buffer(&wrapped).unwrap();
    assert_eq!(region.rungs(), [Rung::Staging]);
    let wrapped = match wrapped.release(Duration::from_millis(50)) {
        Ok(()) => panic!("the wrapped memory was released while a staged region covers it"),
        Err(kept) => kept,
    };
    drop(region);
    assert!(
        wrapped.release(T).is_ok(),
        "released once the region is gone"
    );
    drop(memory);
}

/// GPU memory staged, peers' staged regions reached through the owner's
/// landing slots in 4 KiB slices.
fn slots_world() -> EngineWorld<SimVerbsApi> {
    let config = staged_through_slots(
        EngineConfig::default()
            .with_qps_per_peer(1)
            .with_slice_size(64 * 1024)
            .with_default_timeout(T),
    );
    EngineWorld::sim(1, GpuConfig::default(), config, T)
}

/// Finding 2 of the engine review: an 8 MiB WRITE into a staged grant
/// through 4 KiB slices, the grant revoked after its first slices landed.
/// Once the revoke has completed no byte moves under the grant (the
/// requests the owner accepted included), and the batch fails; before the
/// fence every slice landed and the batch ended `Ok`. (8 MiB: the sim's
/// posts move bytes at once, so 1 MiB could all land between the watcher
/// seeing the first slice and holding the fabric, 2 runs in 25.)
#[test]
fn a_revoked_staged_grant_stops_the_requests_already_accepted() {
    const BIG: u64 = 8 << 20;
    let w = slots_world();
    let (_src_buf, src) = w.a.host(BIG, 3);
    let (dst_buf, dst) = w.b.gpu(BIG, 0);
    let (grant, remote) = w.b_grants(&dst, GrantRights::Write);
    // a's slices move while this thread watches b's memory.
    let _a_driver = w.a.engine.spawn_driver().unwrap();
    let batch =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, BIG)])
            .unwrap();
    let first = pattern(BIG as usize, 3)[..4096].to_vec();
    let started = std::time::Instant::now();
    while w.b.device_bytes(0, dst_buf.addr(), 4096) != first {
        assert!(started.elapsed() < T, "no slice ever landed");
        std::thread::yield_now();
    }
    // Hold the wire while the revoke starts: nothing of the transfer can
    // finish on its own meanwhile.
    w.fabric().set_paused(true);
    grant.revoke(T).expect("the revoke is fenced");
    let fenced = w.b.bytes(&dst_buf);
    w.fabric().set_paused(false);
    let outcome = batch.wait(T);
    assert!(
        outcome.is_err(),
        "the batch ended {outcome:?} though its grant was revoked mid-way"
    );
    assert!(
        w.b.bytes(&dst_buf) == fenced,
        "bytes moved under the grant after its revoke completed"
    );
    assert!(
        fenced != pattern(BIG as usize, 3),
        "every slice landed before the revoke (the test proved nothing)"
    );
    no_use_after_free(&w);
}

/// A staged grant revoked after its peer was closed while a copy into the
/// granted memory still ran (the owner's GPU held): the revoke returns only
/// once that copy has ended. It returned at once when it saw the peer gone
/// before the engine's progress had waited for the copy, which then wrote
/// the granted memory after the fence (3 runs in 6 before the fix).
///
/// Since 11b8f5f a gone peer's landing (its slots, its copies) goes to the
/// CUDA worker to be dropped there; the revoke then saw a fresh landing
/// and returned while those copies were still queued, and they wrote the
/// granted memory after it (bytes moved after the revoke in 4 to 14 runs
/// in 30 when run alone). The fence now waits for the worker's drop
/// (`Landing::copying`): 0 such runs in 30.
///
/// Its precondition, copies held by b's paused GPU, failed 9 runs in 20:
/// b's own driver and this thread's progress both made the peer's landing
/// slots, and the loser's pinned buffer, freed, waited for every stream of
/// the GPU as `cuMemFreeHost` does (the sim then runs what a paused GPU
/// holds; a real one stalls the thread behind all its work). A landing's
/// slots are now made by one thread (`Landing::claim_slots`): 0 in 30.
#[test]
fn a_staged_grant_revoked_after_its_peer_went_waits_for_the_copies_still_running() {
    const BIG: u64 = 1 << 20;
    let w = slots_world();
    let (_src_buf, src) = w.a.host(BIG, 4);
    let (dst_buf, dst) = w.b.gpu(BIG, 0);
    let (grant, remote) = w.b_grants(&dst, GrantRights::Write);
    let _a_driver = w.a.engine.spawn_driver().unwrap();
    // b's GPU runs nothing: the landing copies of the slices a fills stay
    // under way.
    w.b.cuda.set_paused(true);
    let batch =
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, BIG)])
            .unwrap();
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_millis(300) {
        w.b.engine.progress();
        std::thread::yield_now();
    }
    assert!(
        w.b.bytes(&dst_buf) == pattern(BIG as usize, 0),
        "nothing landed while b's GPU was held"
    );
    // b closes the peer: it waits a second for the copies, then goes.
    w.ba.close().unwrap();
    // Gone, its landing retiring (the paused GPU holds its copies): b's
    // progress has nothing to do but wait for them, and says so. The close
    // leaves one-off work that may be counted a few calls late (the
    // landing's replacement, a flush completion): wait for 20 idle calls
    // in a row, which a progress that counted the retirement as work
    // (and so spun a driver) never gives.
    let mut calls = Vec::new();
    while calls.len() < 200 && !calls.ends_with(&[0; 20]) {
        calls.push(w.b.engine.progress());
    }
    assert!(
        calls.ends_with(&[0; 20]),
        "progress while retiring: {calls:?}"
    );
    let fenced = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            w.b.cuda.set_paused(false);
        });
        grant.revoke(T).expect("the revoke is fenced");
        w.b.bytes(&dst_buf)
    });
    let _ = batch.wait(T);
    for _ in 0..100 {
        w.b.engine.progress();
    }
    assert!(
        w.b.bytes(&dst_buf) == fenced,
        "bytes moved under the grant after its revoke completed"
    );
    no_use_after_free(&w);
}
