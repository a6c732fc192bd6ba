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
//!
//! The reverse, a batch that starts when a stream reaches a point
//! ([`super::Peer::submit_after_stream`], [`super::gate`]), takes its words
//! from the same page (a word book): there the stream writes the word and
//! the engine reads it. Such a word goes back to the free list only once
//! the stream's write has landed, so a late write for a gate that ended
//! early (timed out, cancelled) can never lower the word under a later
//! gate's value.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use hal_cuda::Stream as _;
use hal_verbs::Api;

use gdr_proto::gate::WordBook;

use super::completion::CompletionCell;
use super::{Engine, EngineError, State};
use crate::buffer::Buffer;

/// Words a page holds: the fences that may be outstanding at once.
const WORDS: usize = 1024;

/// The engine's page of fence words.
pub(super) struct FenceWords<C: hal_cuda::Api> {
    /// Never freed (see the module docs): a stream may read it later. When
    /// the engine goes it is parked in [`PARKED_PAGES`] for the life of the
    /// process, still reachable (not a leak a checker reports).
    buffer: Option<Buffer<C>>,
    /// The page's first address (host and device: pinned, mapped).
    base: u64,
    pub(super) book: WordBook,
}

/// Fence pages of engines that are gone: kept for the life of the process.
static PARKED_PAGES: std::sync::Mutex<Vec<Box<dyn std::any::Any + Send>>> =
    std::sync::Mutex::new(Vec::new());

impl<C: hal_cuda::Api> Drop for FenceWords<C> {
    fn drop(&mut self) {
        if let Some(page) = self.buffer.take() {
            PARKED_PAGES
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(Box::new(page));
        }
    }
}

impl<C: hal_cuda::Api> FenceWords<C> {
    /// The word at `index`, for the host to load or store.
    pub(super) fn word(&self, index: usize) -> &AtomicU32 {
        let addr = self.base as usize + index * 4;
        // SAFETY: the page is gdr's own pinned memory of WORDS words,
        // 4-byte aligned (page aligned), never freed; the host touches it
        // only atomically, the device only through stream memory
        // operations (32-bit, aligned).
        unsafe { &*(addr as *const AtomicU32) }
    }

    /// The device address of word `index`.
    pub(super) fn addr(&self, index: usize) -> u64 {
        self.base + (index * 4) as u64
    }

    /// Frees the words that awaited a stream's late write and got it.
    pub(super) fn collect_late_writes(&mut self) -> usize {
        let base = self.base as usize;
        let book = &mut self.book;
        book.collect(|index| {
            // SAFETY: as in `word`.
            unsafe { &*((base + index * 4) as *const AtomicU32) }.load(Ordering::Acquire)
        })
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
        let words = self.fence_words(&mut state)?;
        let (word, value) = words.book.take().ok_or_else(|| {
            EngineError::Refused(format!(
                "{WORDS} stream fences and gates are already outstanding"
            ))
        })?;
        let addr = words.addr(word);
        // SAFETY: the word is 4-byte aligned pinned host memory the device
        // can read (unified addressing), never freed (module docs).
        if let Err(e) = unsafe { stream.wait_value32(addr, value) } {
            words.book.unused(word);
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

    /// The engine's page of words, made at its first use.
    pub(super) fn fence_words<'s>(
        &self,
        state: &'s mut State<V, C>,
    ) -> Result<&'s mut FenceWords<C>, EngineError> {
        if state.fence_words.is_none() {
            let context = self
                .shared
                .nics
                .first()
                .and_then(|n| n.ladder.gpus().first())
                .map(|g| &g.context)
                .ok_or_else(|| {
                    EngineError::Unavailable("no GPU for the stream fence page".into())
                })?;
            let buffer = Buffer::alloc_pinned(context, (WORDS * 4) as u64)?;
            let words = FenceWords {
                base: buffer.addr(),
                buffer: Some(buffer),
                book: WordBook::new(WORDS),
            };
            // Pinned memory comes back from the driver as it was left (a
            // recycled page may hold anything): every word starts at 0, the
            // value no wait or gate waits for, before any stream sees it.
            for index in 0..WORDS {
                words.word(index).store(0, Ordering::Release);
            }
            state.fence_words = Some(words);
        }
        Ok(state.fence_words.as_mut().expect("just made"))
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
            words.book.done(fence.word, fence.value);
            released += 1;
            false
        });
        released
    }
}
