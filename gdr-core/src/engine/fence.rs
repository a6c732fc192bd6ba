//! Stream-ordered fences: a CUDA stream waits for a batch without a CPU
//! thread blocking on it.
//!
//! [`super::Batch::fence_stream`] queues on the caller's stream a wait
//! (`cuStreamWaitValue32`, "at least") on a word of pinned host memory the
//! engine owns; when the batch ends, the engine's progress (its own thread,
//! started by the first fence) applies the batch's GPU fence where the
//! device needs one (`cuFlushGPUDirectRDMAWrites`) and then stores the
//! word, which releases the stream: work queued after the fence sees the
//! batch's data. The stream is released however the batch ends; work after
//! the fence may rely on the data only if the batch succeeded
//! ([`super::Batch::status`]).
//!
//! Each outstanding fence holds its own word, and each use of a word waits
//! for a larger value than the last, so a late store for an earlier fence
//! can never release a later one. The page of words is never freed once a
//! fence was queued: a stream may still read its word after the engine is
//! gone.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use hal_cuda::Stream as _;
use hal_verbs::Api;

use super::completion::CompletionCell;
use super::{Engine, EngineError, State};
use crate::buffer::Buffer;

/// Words a page holds: the fences that may be outstanding at once.
const WORDS: usize = 1024;

/// The engine's page of fence words.
pub(super) struct FenceWords<C: hal_cuda::Api> {
    /// Never dropped (see the module docs): a stream may read it later.
    buffer: std::mem::ManuallyDrop<Buffer<C>>,
    free: Vec<usize>,
    /// The last value each word was released with.
    released: Vec<u32>,
}

impl<C: hal_cuda::Api> FenceWords<C> {
    fn word(&self, index: usize) -> &AtomicU32 {
        let addr = self.buffer.addr() as usize + index * 4;
        // SAFETY: the page is gdr's own pinned memory of WORDS words,
        // 4-byte aligned (page aligned), never freed; the host touches it
        // only atomically, the device only reads it.
        unsafe { &*(addr as *const AtomicU32) }
    }
}

/// A fence queued on a stream, waiting for its batch to end.
pub(super) struct StreamFence {
    cells: Vec<Arc<CompletionCell>>,
    /// GPUs to fence (flush) before the release, if the batch succeeded.
    gpus: Vec<u32>,
    /// The batch's "fence applied" flag, shared with its waiters.
    fenced: Arc<std::sync::atomic::AtomicBool>,
    word: usize,
    value: u32,
}

impl<V: Api, C: hal_cuda::Api> Engine<V, C> {
    /// Queues on `stream` a wait for the batch of `cells` (its GPU fence on
    /// `gpus` applied on success): see the module docs.
    pub(super) fn queue_stream_fence(
        &self,
        stream: &C::Stream,
        cells: Vec<Arc<CompletionCell>>,
        gpus: Vec<u32>,
        fenced: Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<(), EngineError> {
        let _span = tracing::debug_span!("fence_stream").entered();
        let mut state = crate::sync::lock(&self.shared.state);
        if state.fence_words.is_none() {
            let context = self
                .shared
                .nics
                .first()
                .and_then(|n| n.ladder.gpus().first())
                .map(|g| &g.context)
                .ok_or_else(|| EngineError::Unavailable("no GPU to fence a stream of".into()))?;
            let buffer = Buffer::alloc_pinned(context, (WORDS * 4) as u64)?;
            state.fence_words = Some(FenceWords {
                buffer: std::mem::ManuallyDrop::new(buffer),
                free: (0..WORDS).rev().collect(),
                released: vec![0; WORDS],
            });
        }
        let words = state.fence_words.as_mut().expect("just made");
        let word = words.free.pop().ok_or_else(|| {
            EngineError::Refused(format!("{WORDS} stream fences are already outstanding"))
        })?;
        let value = words.released[word].wrapping_add(1).max(1);
        let addr = words.buffer.addr() + (word * 4) as u64;
        // SAFETY: the word is 4-byte aligned pinned host memory the device
        // can read (unified addressing), never freed (module docs).
        if let Err(e) = unsafe { stream.wait_value32(addr, value) } {
            words.free.push(word);
            return Err(e.into());
        }
        state.stream_fences.push(StreamFence {
            cells,
            gpus,
            fenced,
            word,
            value,
        });
        drop(state);
        self.ensure_own_driver();
        Ok(())
    }

    /// Releases the streams waiting for batches that have ended; returns
    /// how many.
    pub(super) fn release_stream_fences(&self, state: &mut State<V, C>) -> usize {
        if state.stream_fences.is_empty() {
            return 0;
        }
        let State {
            stream_fences,
            fence_words,
            ..
        } = state;
        let Some(words) = fence_words.as_mut() else {
            return 0;
        };
        let mut released = 0;
        stream_fences.retain(|fence| {
            let mut ok = true;
            for cell in &fence.cells {
                match cell.outcome() {
                    None => return true,
                    Some(outcome) => ok &= outcome.is_ok(),
                }
            }
            if ok && !fence.gpus.is_empty() && !fence.fenced.swap(true, Ordering::AcqRel) {
                for &gpu in &fence.gpus {
                    if let Err(e) = self.fence_gpu(gpu) {
                        tracing::warn!(gpu, error = %e, "the GPU fence before a stream release");
                    }
                }
            }
            words.word(fence.word).store(fence.value, Ordering::Release);
            words.released[fence.word] = fence.value;
            words.free.push(fence.word);
            released += 1;
            false
        });
        released
    }
}
