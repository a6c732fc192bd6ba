//! CUDA VMM memory (PyTorch's expandable segments, vLLM) through the
//! engine on the simulated GPU: physical chunks mapped side by side, each
//! an allocation of its own for CUDA, registered chunk by chunk, moved
//! across chunk boundaries, granted to a peer as one segment per chunk; a
//! chunk created without `gpuDirectRDMACapable` staged; a chunk remapped
//! under a registered buffer registered anew.

use std::time::Duration;

use gdr_core::buffer::Buffer;
use gdr_core::descriptor::Reach;
use gdr_core::engine::EngineConfig;
use gdr_core::ladder::{GpuLacks, Refusal, Rung};
use gdr_sim::{FaultPlan, GpuConfig, SimCuda, SimVerbsApi};
use gdr_tests::engine_world::EngineWorld;
use hal_cuda::{Context as _, Driver as _};

const T: Duration = Duration::from_secs(20);

fn world(nics: usize) -> EngineWorld<SimVerbsApi> {
    let config = EngineConfig::default()
        .with_qps_per_peer(2)
        .with_default_timeout(T);
    EngineWorld::sim(nics, GpuConfig::default(), config, T)
}

/// Four chunks, each registered through its own dma-buf: transfers cut at
/// chunk boundaries both ways, and the peer's grant of a's buffer names one
/// segment per chunk per NIC, tiling the grant.
#[test]
fn vmm_chunks_register_one_by_one_and_move_across_boundaries() {
    let w = world(2);
    let (rungs, granted) = w.vmm_round_trip(&[]).unwrap();
    assert_eq!(rungs, [Rung::Dmabuf; 4], "every chunk through its dma-buf");
    let Reach::Direct(segments) = &granted.reach else {
        panic!("a's direct pieces are granted directly: {granted:?}");
    };
    assert_eq!(segments.len(), 2 * 4, "one segment per chunk per NIC");
    for nic in ["sim0", "sim1"] {
        let mine: Vec<_> = segments.iter().filter(|s| s.device == nic).collect();
        assert_eq!(mine.len(), 4);
        assert_eq!(mine[0].offset, 0);
        for pair in mine.windows(2) {
            assert_eq!(pair[0].offset + pair[0].len, pair[1].offset, "tiled");
        }
    }
}

/// A chunk created without `gpuDirectRDMACapable` is staged (the reason
/// reported), the others still registered; the region is staged, and the
/// data moves all the same.
#[test]
fn a_chunk_without_gpu_direct_rdma_is_staged_not_refused() {
    let w = world(1);
    let (rungs, granted) = w.vmm_round_trip(&[2]).unwrap();
    assert_eq!(
        rungs,
        [Rung::Dmabuf, Rung::Dmabuf, Rung::Staging, Rung::Dmabuf],
        "chunk 2 staged"
    );
    assert!(
        matches!(granted.reach, Reach::Staged),
        "a region with a staged piece is granted staged: {granted:?}"
    );
}

/// The refusal of the staged chunk names the reason, on both GPU rungs.
#[test]
fn the_staged_chunk_says_why() {
    let w = world(1);
    let memory = w.a.vmm_memory(2, 2, &[1]).unwrap();
    let (buffer, region) = w.a.wrap_vmm(&memory, 0, 2 * memory.chunk, 1);
    assert!(buffer.chunks()[0].gpu_direct_rdma_capable);
    assert!(!buffer.chunks()[1].gpu_direct_rdma_capable);
    assert_eq!(region.rungs(), [Rung::Staging]);
    let pieces = region.pieces(0).unwrap();
    let failures = pieces[1].registration.failures();
    assert_eq!(failures.len(), 2, "{failures:?}");
    for f in failures {
        assert!(
            matches!(
                f.refusal,
                Refusal::Gpu(GpuLacks::VmmChunkNotRdmaCapable { .. })
            ),
            "{f:?}"
        );
    }
    assert!(pieces[0].registration.failures().is_empty());
}

#[test]
fn a_chunk_remapped_under_a_registered_buffer_is_registered_anew() {
    world(1).vmm_remap_is_stale().unwrap();
}

/// Wrapping a range with an unmapped chunk inside is refused, naming the
/// hole; gdr's own VMM buffers free every chunk when the last region goes.
#[test]
fn a_gap_is_refused_and_owned_vmm_memory_is_freed() {
    let cuda = SimCuda::new(vec![GpuConfig::default()], FaultPlan::new());
    let ctx = cuda.erased().context(0).unwrap();
    let w = world(1);
    let memory = w.a.vmm_memory(3, 1, &[]).unwrap();
    let a_ctx = w.a.driver.context(0).unwrap();
    // SAFETY: nothing is registered; the buffer (if any) goes at once.
    let gap = unsafe { Buffer::wrap(Some(&a_ctx), memory.base, 2 * memory.chunk, None) };
    let e = gap.unwrap_err().to_string();
    assert!(
        e.contains(&format!("{:#x}", memory.base + memory.chunk)) && e.contains("not mapped"),
        "{e}"
    );

    let before = cuda.used_bytes(0);
    let g = ctx.vmm_granularity().unwrap() as u64;
    let owned = Buffer::alloc_vmm(&ctx, 3 * g - 5, g).unwrap();
    assert_eq!(owned.chunks().len(), 3);
    assert_eq!(cuda.used_bytes(0), before + 3 * g);
    assert!(Buffer::alloc_vmm(&ctx, g, g + 1).is_err());
    drop(owned);
    assert_eq!(cuda.used_bytes(0), before, "every chunk released");
}
