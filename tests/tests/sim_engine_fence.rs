//! Stream-ordered fences on the simulated GPU: a stream waits for a batch
//! that READs into GPU memory without any thread blocking on it; a copy
//! queued on the stream after the fence runs only once the batch has ended
//! (and the GPU's inbound writes were flushed where its write ordering asks
//! for it), and sees the data. A batch that fails releases the stream too.
//!
//! And the reverse, gated batches (`Peer::submit_after_stream`): a batch
//! held until a stream reaches its gate moves nothing while the stream is
//! held, and moves what the stream produced before the gate once it is
//! released; it times out, is cancelled, fails with its stream, and works
//! by the event where the stream has no memory operations.

use std::time::{Duration, Instant};

use gdr_core::descriptor::GrantRights;
use gdr_core::engine::{EngineConfig, TimedOut, Transfer, TransferError};
use gdr_sim::{Fault, FaultSite, GpuConfig, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, FenceWait, WorldBuffer, WorldGrant};
use hal_cuda::{Context as _, Driver as _, Event as _, Stream as _};

const T: Duration = Duration::from_secs(10);
const LEN: u64 = 1 << 16;

fn world(ordering: hal_cuda::WritesOrdering) -> EngineWorld<SimVerbsApi> {
    let gpu = GpuConfig {
        writes_ordering: ordering,
        ..GpuConfig::default()
    };
    let config = EngineConfig::default()
        .with_qps_per_peer(2)
        .with_default_timeout(T);
    EngineWorld::sim(1, gpu, config, T)
}

/// A stream of a's GPU 0, and an event to record on it.
fn stream_and_event(
    w: &EngineWorld<SimVerbsApi>,
) -> (gdr_core::Stream, hal_cuda::dynamic::DynEvent) {
    let ctx = w.a.driver.context(0).unwrap();
    let stream = gdr_core::Stream::from_erased(0, ctx.create_stream().unwrap());
    (stream, ctx.create_event().unwrap())
}

/// Polls `event` until it completes, at most `T`.
fn wait_for(event: &hal_cuda::dynamic::DynEvent, what: &str) {
    let start = Instant::now();
    while !event.is_complete().unwrap() {
        assert!(start.elapsed() < T, "{what}: the stream never moved on");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_stream_waits_for_the_batch_without_a_thread_blocking() {
    for (ordering, flushes) in [
        (hal_cuda::WritesOrdering::None, 1),
        (hal_cuda::WritesOrdering::Owner, 0),
    ] {
        let w = world(ordering);
        let (batch, _stream, _event) = w.fenced_copy_after_a_held_read(LEN, 4, FenceWait::Stream);
        assert_eq!(batch.status(), Some(Ok(())), "{ordering:?}");
        assert_eq!(w.a.cuda.flushes(0), flushes, "{ordering:?}: the GPU fence");
    }
}

#[test]
fn a_failed_batch_releases_the_stream_too() {
    let w = world(hal_cuda::WritesOrdering::Owner);
    let (_s, src) = w.b.host(LEN, 4);
    let (doomed_grant, doomed) = w.b_grants(&src, GrantRights::Read);
    drop(doomed_grant);
    let (_gpu_buf, gpu_region) = w.a.gpu(LEN, 0);
    let (stream, event) = stream_and_event(&w);
    let batch =
        w.ab.submit(&[Transfer::read(&gpu_region, 0, &doomed, 0, LEN)])
            .unwrap();
    batch.fence_stream(&stream).unwrap();
    stream.record(&event).unwrap();
    wait_for(&event, "a failed batch");
    let outcome = batch.status().expect("ended");
    assert!(
        matches!(outcome, Err(TransferError::Revoked { .. })),
        "{outcome:?}"
    );
}

#[test]
fn a_gated_batch_starts_when_its_stream_reaches_the_gate() {
    let w = world(hal_cuda::WritesOrdering::Owner);
    w.gated_write_after_a_held_stream(LEN, 11);
    // Again on the same engine: the gate's word went back and is reused
    // with a larger value.
    w.gated_write_after_a_held_stream(LEN, 12);
}

#[test]
fn a_stream_without_memory_operations_opens_its_gate_by_the_event() {
    let w = world(hal_cuda::WritesOrdering::Owner);
    let g = w.gated_write(LEN, 13);
    // The gate's cuStreamWriteValue32 is the next memory operation.
    w.fabric().faults().fail_next(
        FaultSite::CudaStreamMemOp,
        Fault::Cuda(hal_cuda::CudaError::NotSupported {
            operation: "cuStreamWriteValue32",
            reason: "no stream memory operations (scripted)".into(),
            code: None,
        }),
    );
    let batch = g.submit(&w, T);
    w.fabric().faults().assert_all_fired();
    g.assert_nothing_moved(&w, 30, "event gate, stream held");
    assert_eq!(batch.status(), None);
    g.held.release();
    assert_eq!(batch.wait(T), Ok(()));
    assert!(
        g.moved(&w),
        "the batch moved what the stream copied in first"
    );
}

#[test]
fn a_gate_that_never_opens_times_out_and_posts_nothing() {
    let w = world(hal_cuda::WritesOrdering::Owner);
    let g = w.gated_write(LEN, 14);
    let bound = Duration::from_millis(200);
    let batch = g.submit(&w, bound);
    let outcome = batch.wait(T);
    assert_eq!(
        outcome,
        Err(TransferError::Timeout(TimedOut { after: bound }))
    );
    // The stream runs now (its late write lands on the gate's word): the
    // batch stays timed out and nothing moves.
    g.held.release();
    g.held.stream.synchronize().unwrap();
    g.assert_nothing_moved(&w, 30, "after the timeout");
    assert_eq!(
        batch.status(),
        Some(Err(TransferError::Timeout(TimedOut { after: bound })))
    );
    // A later gate on the engine still opens when its stream gets there.
    w.gated_write_after_a_held_stream(LEN, 15);
}

#[test]
fn a_gated_batch_cancelled_before_its_gate_posts_nothing() {
    let w = world(hal_cuda::WritesOrdering::Owner);
    let g = w.gated_write(LEN, 16);
    let batch = g.submit(&w, T);
    g.assert_nothing_moved(&w, 5, "before the cancel");
    batch.cancel();
    assert_eq!(batch.status(), Some(Err(TransferError::Cancelled)));
    g.held.release();
    g.held.stream.synchronize().unwrap();
    g.assert_nothing_moved(&w, 30, "the stream passed a cancelled gate");
    assert_eq!(batch.wait(T), Err(TransferError::Cancelled));
}

#[test]
fn a_failed_stream_fails_its_gated_batch() {
    let w = world(hal_cuda::WritesOrdering::Owner);
    let g = w.gated_write(LEN, 17);
    let batch = g.submit(&w, T);
    // The GPU is lost (the next allocation finds out): the stream never
    // reaches the gate, and its event says why.
    w.fabric()
        .faults()
        .fail_next(FaultSite::CudaAlloc, Fault::DeviceLost);
    let ctx = w.a.driver.context(0).unwrap();
    assert!(ctx.alloc(4096).is_err(), "the scripted loss");
    let outcome = batch.wait(T);
    assert!(
        matches!(
            outcome,
            Err(TransferError::StreamFailed {
                source: hal_cuda::CudaError::DeviceLost { .. }
            })
        ),
        "{outcome:?}"
    );
    assert!(
        w.b.bytes(&g.dst) == gdr_tests::pattern(LEN as usize, 19),
        "nothing moved"
    );
}

#[test]
fn a_gated_batch_is_refused_at_the_call_and_ends_when_its_peer_goes() {
    let w = world(hal_cuda::WritesOrdering::Owner);
    let g = w.gated_write(LEN, 20);
    // Checked at the call: out of the grant's bounds.
    let too_long = Transfer::write(&g.gpu_region, 0, &g.remote, 1, LEN);
    let refused =
        w.ab.submit_after_stream(&g.held.stream, &[too_long], Some(T));
    assert!(
        matches!(
            refused,
            Err(gdr_core::engine::EngineError::OutOfBounds { .. })
        ),
        "{refused:?}"
    );
    let batch = g.submit(&w, T);
    w.ab.close().unwrap();
    let outcome = batch.wait(T);
    assert!(
        matches!(outcome, Err(TransferError::PeerGone(_))),
        "{outcome:?}"
    );
}

/// A world whose GPU memory takes the staging rung (as the H200's memory
/// over the sim NIC).
fn staged_world() -> EngineWorld<SimVerbsApi> {
    let config = EngineConfig::default()
        .with_qps_per_peer(2)
        .with_default_timeout(T)
        .with_ladder(gdr_core::ladder::LadderConfig::default().with_policy(
            gdr_core::ladder::Policy::Only(gdr_core::ladder::Rung::Staging),
        ));
    EngineWorld::sim(1, GpuConfig::default(), config, T)
}

/// The same on the staging rung (as the H200's memory over the sim NIC):
/// the READ goes through the pipeline's pool; the fence waits for its
/// parts on the host (their copies are CUDA calls: see the next test) and
/// the copy after it sees the data.
#[test]
fn a_stream_waits_for_a_staged_batch_too() {
    let w = staged_world();
    let (batch, _stream, _event) = w.fenced_copy_after_a_held_read(1 << 20, 4, FenceWait::Host);
    assert_eq!(batch.status(), Some(Ok(())));
}

/// Another thread frees CUDA memory while a staged batch is fenced: the
/// free waits for every stream holding the driver's lock (as the real
/// driver does), and the batch's staging copies wait behind that lock. A
/// fence that held its stream on the staged batch deadlocked so (issue 33
/// item 14: two engines' GPU tests in one process hung); the fence of a
/// staged batch waits on the host, and nothing waits forever. A deadlock
/// aborts the binary.
#[test]
fn a_free_while_a_fence_waits_does_not_deadlock_the_staged_batch() {
    let w = staged_world();
    w.fenced_read_while_another_thread_frees(1 << 20, 9);
}

/// One engine: a stream fenced on a direct READ (held on the paused
/// fabric), a free waiting for that stream, and a staged WRITE whose
/// staging copy waits behind the free: progress hands the copy to the
/// engine's CUDA worker, so it still releases the fence once the READ
/// ends, and everything ends (issue 33 item 14). A deadlock aborts the
/// binary.
#[test]
fn a_free_and_a_staging_copy_do_not_stop_progress_releasing_a_fence() {
    let w = staged_world();
    w.direct_fence_while_a_free_and_a_staged_write_wait(1 << 20, 21);
}

/// Pinned memory whose last holder is a batch (the caller dropped its
/// buffer and region after the submit) goes when progress ends the batch;
/// were it freed there, `cuMemFreeHost` would wait for a stream fenced on
/// a READ behind it on the same queue pair, which only that progress
/// releases. It is freed on the reaper thread instead, and the stream
/// moves on (issue 33 item 14). A deadlock aborts the binary.
#[test]
fn memory_a_batch_holds_last_is_not_freed_inside_progress() {
    use std::io::Write as _;
    let config = EngineConfig::default()
        // One queue pair: the WRITE ends before the fenced READ.
        .with_qps_per_peer(1)
        .with_default_timeout(T);
    let w = EngineWorld::sim(1, GpuConfig::default(), config, T);
    let len = 1 << 16;
    let (_s, src) = w.b.host(len, 5);
    let (_g, remote_src) = w.b_grants(&src, GrantRights::Read);
    let (_h, host_dst) = w.a.host(len, 0);
    let (dst_buf, dst) = w.b.host(len, 0);
    let (_dg, remote_dst) = w.b_grants(&dst, GrantRights::Write);
    let (pinned, pinned_region) = w.a.pinned(len, 6);
    let ctx = w.a.driver.context(0).unwrap();
    let stream = gdr_core::Stream::from_erased(0, ctx.create_stream().unwrap());
    let event = ctx.create_event().unwrap();
    w.fabric().set_paused(true);
    let write =
        w.ab.submit(&[Transfer::write(&pinned_region, 0, &remote_dst, 0, len)])
            .unwrap();
    drop(pinned_region);
    drop(pinned);
    let read =
        w.ab.submit(&[Transfer::read(&host_dst, 0, &remote_src, 0, len)])
            .unwrap();
    read.fence_stream(&stream).unwrap();
    stream.record(&event).unwrap();
    w.fabric().set_paused(false);
    // Only the engine's own thread makes progress: no thread of the test
    // waits on a batch until the stream has moved on.
    let start = Instant::now();
    while !event.is_complete().unwrap() {
        if start.elapsed() > T {
            let _ = writeln!(
                std::io::stderr(),
                "DEADLOCK: the fenced stream did not move on within {T:?}: progress freed \
                 the pinned memory, and the free waited for the fenced stream"
            );
            std::process::abort();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(write.wait(T), Ok(()));
    assert_eq!(read.wait(T), Ok(()));
    assert!(
        w.b.bytes(&dst_buf) == gdr_tests::pattern(len as usize, 6),
        "the WRITE's data"
    );
}

/// A stream fenced on a batch of an engine that is dropped before the
/// batch ends moves on: nothing would end that batch (or store the
/// fence's word) once the engine is gone, and work queued after the fence
/// (a kernel, here a copy) would wait forever.
#[test]
fn a_stream_fenced_on_a_dropped_engines_batch_moves_on() {
    use gdr_core::engine::Engine;
    use gdr_sim::{NodeConfig, SimCuda, SimFabric};
    use gdr_tests::engine_world::{connect_accepted, sim_listener};
    let fabric = SimFabric::new();
    let a_nic = fabric.add_node("a", NodeConfig::default());
    let b_nic = fabric.add_node("b", NodeConfig::default());
    let cuda = SimCuda::new(vec![GpuConfig::default()], fabric.faults());
    let config = EngineConfig::default().with_default_timeout(T);
    let a = Engine::new(&a_nic.erased(), Some(&cuda.erased()), config.clone()).unwrap();
    let b = Engine::new(&b_nic.erased(), None, config).unwrap();
    let (listener, addr) = sim_listener(&b, &b_nic);
    let (ab, ba) = connect_accepted(&a, &listener, addr, T);
    let src = gdr_core::buffer::Buffer::alloc_host(LEN);
    let grant = ba
        .grant(&b.register_buffer(&src).unwrap(), 0, LEN, GrantRights::Read)
        .unwrap();
    let remote = ab.wait_grant(grant.descriptor().grant, T).unwrap();
    let dst = gdr_core::buffer::Buffer::alloc_host(LEN);
    let dst_region = a.register_buffer(&dst).unwrap();
    let ctx = cuda.erased().context(0).unwrap();
    let stream = gdr_core::Stream::from_erased(0, ctx.create_stream().unwrap());
    let event = ctx.create_event().unwrap();
    fabric.set_paused(true);
    let batch = ab
        .submit(&[Transfer::read(&dst_region, 0, &remote, 0, LEN)])
        .unwrap();
    batch.fence_stream(&stream).unwrap();
    stream.record(&event).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    assert!(!event.is_complete().unwrap(), "held while the batch runs");
    drop((batch, dst_region, ab, remote, grant, a));
    wait_for(&event, "a stream fenced on a dropped engine's batch");
    fabric.set_paused(false);
}

/// A READ of b's host memory into a's GPU, and a stream of a's GPU, for
/// the tests of a slow driver call.
struct SlowCallRead {
    ctx: hal_cuda::dynamic::DynContext,
    stream: gdr_core::Stream,
    gpu_region: gdr_core::Region,
    remote: gdr_core::descriptor::MemoryDescriptor,
    _held: (WorldGrant, gdr_core::Region, WorldBuffer, WorldBuffer),
}

impl SlowCallRead {
    fn new(w: &EngineWorld<SimVerbsApi>) -> Self {
        let (src_buf, src) = w.b.host(LEN, 4);
        let (grant, remote) = w.b_grants(&src, GrantRights::ReadWrite);
        let (gpu_buf, gpu_region) = w.a.alloc(gdr_tests::engine_world::Kind::Gpu, LEN, 0);
        let ctx = w.a.driver.context(0).unwrap();
        let stream = gdr_core::Stream::from_erased(0, ctx.create_stream().unwrap());
        Self {
            ctx,
            stream,
            gpu_region,
            remote,
            _held: (grant, src, src_buf, gpu_buf),
        }
    }

    fn read(&self) -> Transfer<'_> {
        Transfer::read(&self.gpu_region, 0, &self.remote, 0, LEN)
    }

    /// The next call at `site` takes 3 s; returns the calls made so far.
    fn slow_next(&self, w: &EngineWorld<SimVerbsApi>, site: FaultSite) -> u64 {
        let faults = w.fabric().faults();
        let calls = faults.calls(site);
        faults.fail_nth(site, calls + 1, Fault::Slow(Duration::from_secs(3)));
        calls
    }
}

/// The GPU fence a stream's release waits for (`cuFlushGPUDirectRDMAWrites`
/// on a GPU whose write ordering asks for it) is a driver call that can
/// take long, scripted here to take 3 s: the engine makes it outside its
/// lock, so its other calls (here: its resources, which take the lock) go
/// on meanwhile, and the stream is released only after it.
#[test]
fn a_slow_gpu_fence_before_a_stream_release_holds_nobody_else_up() {
    let w = world(hal_cuda::WritesOrdering::None);
    let r = SlowCallRead::new(&w);
    let event = r.ctx.create_event().unwrap();
    let (faults, stream) = (w.fabric().faults(), &r.stream);
    let flushes = r.slow_next(&w, FaultSite::CudaFlushWrites);
    w.fabric().set_paused(true);
    let batch = w.ab.submit(&[r.read()]).unwrap();
    batch.fence_stream(stream).unwrap();
    stream.record(&event).unwrap();
    w.fabric().set_paused(false);
    let start = Instant::now();
    while faults.calls(FaultSite::CudaFlushWrites) == flushes {
        assert!(start.elapsed() < T, "the GPU fence was never made");
        std::thread::sleep(Duration::from_millis(1));
    }
    // The flush is under way (it takes SLOW): the lock is free.
    let _ = w.a.engine.resources();
    assert!(
        !event.is_complete().unwrap(),
        "the engine's calls waited for the GPU fence (or the stream went before it)"
    );
    wait_for(&event, "the stream after its GPU fence");
    faults.assert_all_fired();
    assert_eq!(batch.status(), Some(Ok(())));
}

/// While a driver runs, a thread looking at its own batch (`Batch::status`,
/// as `Batch::wait`'s spin does) leaves the engine's pass to the driver,
/// and with it the driver calls the pass makes for other work: here two
/// stream fences' GPU fences (before their streams' release), each
/// scripted to take 3 s. The driver makes the first; meanwhile a thread
/// moves lone host WRITEs for 200 ms, polling each one's status, and polls
/// with them the completion of the second fenced batch (same queue
/// pairs): no WRITE waits for the second GPU fence, which is left to the
/// driver.
#[test]
fn a_waiter_leaves_the_engines_pass_to_a_running_driver() {
    let w = world(hal_cuda::WritesOrdering::None);
    let r = SlowCallRead::new(&w);
    let (faults, stream) = (w.fabric().faults(), &r.stream);
    let other = gdr_core::Stream::from_erased(0, r.ctx.create_stream().unwrap());
    let (first, second) = (r.ctx.create_event().unwrap(), r.ctx.create_event().unwrap());
    let flushes = r.slow_next(&w, FaultSite::CudaFlushWrites);
    faults.fail_nth(
        FaultSite::CudaFlushWrites,
        flushes + 2,
        Fault::Slow(Duration::from_secs(3)),
    );
    let driver = w.a.engine.spawn_driver().unwrap();
    let batch = w.ab.submit(&[r.read()]).unwrap();
    batch.fence_stream(stream).unwrap();
    stream.record(&first).unwrap();
    let start = Instant::now();
    while faults.calls(FaultSite::CudaFlushWrites) == flushes {
        assert!(
            start.elapsed() < T,
            "the driver never made the first GPU fence"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // The driver is inside the first fence (3 s).
    let fenced = w.ab.submit(&[r.read()]).unwrap();
    fenced.fence_stream(&other).unwrap();
    other.record(&second).unwrap();
    let pair = w.host_pair(LEN, 9, GrantRights::ReadWrite);
    let write = [Transfer::write(&pair.src, 0, &pair.remote, 0, 4096)];
    let (start, mut slowest) = (Instant::now(), Duration::ZERO);
    while start.elapsed() < Duration::from_millis(200) {
        let begun = Instant::now();
        let written = w.ab.submit(&write).unwrap();
        let outcome = loop {
            if let Some(outcome) = written.status() {
                break outcome;
            }
            std::thread::yield_now();
        };
        outcome.expect("a WRITE");
        slowest = slowest.max(begun.elapsed());
    }
    assert!(
        slowest < Duration::from_secs(2),
        "a WRITE's thread made the other batch's GPU fence ({slowest:?})"
    );
    assert_eq!(
        faults.calls(FaultSite::CudaFlushWrites),
        flushes + 1,
        "only the driver's fence is under way"
    );
    wait_for(&first, "the first stream after its GPU fence");
    wait_for(&second, "the second stream after its GPU fence");
    faults.assert_all_fired();
    assert_eq!(batch.status(), Some(Ok(())));
    assert_eq!(fenced.status(), Some(Ok(())));
    drop(driver);
}

/// The stream operations of a stream fence (`cuStreamWaitValue32`) and of
/// a gate (`cuStreamWriteValue32`) can block while the driver's queue is
/// full, scripted here to take 3 s: the engine queues them outside its
/// lock, so its other calls go on meanwhile; each then works.
#[test]
fn a_slow_stream_operation_holds_nobody_else_up() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let w = world(hal_cuda::WritesOrdering::Owner);
    let r = SlowCallRead::new(&w);
    let (faults, stream) = (w.fabric().faults(), &r.stream);
    for gate in [false, true] {
        let ops = r.slow_next(&w, FaultSite::CudaStreamMemOp);
        let returned = AtomicBool::new(false);
        std::thread::scope(|s| {
            let call = s.spawn(|| {
                let read = [r.read()];
                let batch = match gate {
                    false => {
                        let batch = w.ab.submit(&read).unwrap();
                        batch.fence_stream(stream).map(|()| batch)
                    }
                    true => w.ab.submit_after_stream(stream, &read, Some(T)),
                };
                returned.store(true, Ordering::SeqCst);
                batch.expect("queued").wait(T)
            });
            let start = Instant::now();
            while faults.calls(FaultSite::CudaStreamMemOp) == ops {
                assert!(start.elapsed() < T, "gate {gate}: no stream operation");
                std::thread::sleep(Duration::from_millis(1));
            }
            let _ = w.a.engine.resources();
            assert!(
                !returned.load(Ordering::SeqCst),
                "gate {gate}: the engine's calls waited for the stream operation"
            );
            call.join().unwrap().expect("the batch");
        });
    }
    faults.assert_all_fired();
}

/// The stream fences and gates are under a lock of their own, not the
/// engine's: a gated submit and a stream fence (on a page of words made
/// by an earlier gate) are taken while another thread holds a's engine
/// lock; each moves once progress, which needs it, runs again.
#[test]
fn gated_submits_and_stream_fences_are_taken_while_the_engines_lock_is_held() {
    const HOLD: Duration = Duration::from_secs(3);
    let w = world(hal_cuda::WritesOrdering::Owner);
    w.gated_write_after_a_held_stream(LEN, 21);
    let g = w.gated_write(LEN, 22);
    let (gated, in_time) = w.a.while_engine_lock_held(HOLD, || g.submit(&w, T));
    assert!(in_time, "a gated submit waited for the engine's lock");
    g.held.release();
    assert_eq!(gated.wait(T), Ok(()));
    assert!(g.moved(&w), "the gated batch moved the stream's bytes");
    let (_s, src) = w.b.host(LEN, 23);
    let (_g, remote) = w.b_grants(&src, GrantRights::Read);
    let (_gpu_buf, gpu_region) = w.a.gpu(LEN, 0);
    let (stream, event) = stream_and_event(&w);
    let batch =
        w.ab.submit(&[Transfer::read(&gpu_region, 0, &remote, 0, LEN)])
            .unwrap();
    let (fenced, in_time) =
        w.a.while_engine_lock_held(HOLD, || batch.fence_stream(&stream));
    assert!(in_time, "a stream fence waited for the engine's lock");
    fenced.unwrap();
    stream.record(&event).unwrap();
    wait_for(&event, "the fenced stream");
    assert_eq!(batch.status(), Some(Ok(())));
}
