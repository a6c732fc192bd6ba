//! Stream-ordered fences on the simulated GPU: a stream waits for a batch
//! that READs into GPU memory without any thread blocking on it; a copy
//! queued on the stream after the fence runs only once the batch has ended
//! (and the GPU's inbound writes were flushed where its write ordering asks
//! for it), and sees the data. A batch that fails releases the stream too.

use std::time::{Duration, Instant};

use gdr_core::descriptor::GrantRights;
use gdr_core::engine::{EngineConfig, Transfer, TransferError};
use gdr_sim::{GpuConfig, SimCudaApi, SimVerbsApi};
use gdr_tests::engine_world::EngineWorld;
use hal_cuda::{Context as _, Driver as _, Event as _, Stream as _};

const T: Duration = Duration::from_secs(10);
const LEN: u64 = 1 << 16;

fn world(ordering: hal_cuda::WritesOrdering) -> EngineWorld<SimVerbsApi> {
    let gpu = GpuConfig {
        writes_ordering: ordering,
        ..GpuConfig::default()
    };
    let config = EngineConfig {
        qps_per_peer: 2,
        default_timeout: T,
        ..EngineConfig::default()
    };
    EngineWorld::sim(1, gpu, config, T)
}

/// Polls `event` until it completes, at most `T`.
fn wait_for(event: &<SimCudaApi as hal_cuda::Api>::Event, what: &str) {
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
        let (batch, _stream, _event) = w.fenced_copy_after_a_held_read(LEN, 4);
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
    let ctx = w.a.cuda.context(0).unwrap();
    let stream = ctx.create_stream().unwrap();
    let event = ctx.create_event().unwrap();
    let batch =
        w.ab.submit(&[Transfer::read(&gpu_region, 0, &doomed, 0, LEN)])
            .unwrap();
    batch.fence_stream(&stream).unwrap();
    stream.record(&event).unwrap();
    wait_for(&event, "a failed batch");
    let outcome = batch.status().expect("ended");
    assert!(
        matches!(outcome, Err(TransferError::RemoteAccess { .. })),
        "{outcome:?}"
    );
}
