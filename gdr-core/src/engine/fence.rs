//! Stream-ordered fences: a CUDA stream waits for a batch without a CPU
//! thread blocking on it.
//!
//! For a batch that ends without a CUDA call (its transfers on a NIC's
//! direct rungs; any other batch is waited for on the host, see
//! [`super::Batch::fence_stream`]), the fence queues on the caller's stream a wait
//! (`cuStreamWaitValue32`, "at least") on a word of pinned host memory the
//! engine owns (`StreamFences::queue`); when the batch ends, the engine's
//! progress (its own thread, started by the first fence) applies the
//! batch's GPU fence where the device needs one
//! (`cuFlushGPUDirectRDMAWrites`) and then stores the word
//! (`StreamFences::release`), which releases the stream: work queued
//! after the fence sees the batch's data. The stream is released however
//! the batch ends; work after the fence may rely on the data only if the
//! batch succeeded ([`super::Batch::status`]).
//!
//! Each outstanding fence holds its own word, and each use of a word waits
//! for a larger value than the last, so a late store for an earlier fence
//! can never release a later one. The page of words is never freed once a
//! fence was queued: a stream may still read its word after the engine is
//! gone. An engine that goes stores every outstanding fence's word first
//! (`StreamFences::release_all`): nothing would end those batches then.
//!
//! The reverse, a batch that starts when a stream reaches a point
//! ([`super::Peer::submit_after_stream`], [`super::gate`]), takes its words
//! from the same page (a word book): there the stream writes the word and
//! the engine reads it. Such a word goes back to the free list only once
//! the stream's write has landed, so a late write for a gate that ended
//! early (timed out, cancelled) can never lower the word under a later
//! gate's value.
//!
//! `StreamFences` owns the page and the fences waiting on it; the gates
//! (`super::gate::Gates`) own their held batches and are lent the page
//! for each step (its word methods below). One page and one book serve
//! both, as before the split: one pinned allocation, one bound on what is
//! outstanding, and a word a late gate write still owns is never handed to
//! a fence. It reads the engine's `Resources` only (the first GPU, for
//! the page; the GPU fence), never the engine.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use hal_cuda::Stream as _;

use gdr_proto::gate::{GateWait, Signal, WordBook};

use super::completion::CompletionCell;
use super::resources::Resources;
use super::{EngineError, Refusal, Unavailable};
use crate::buffer::Buffer;

/// Words a page holds: the fences that may be outstanding at once.
const WORDS: usize = 1024;

/// The engine's page of fence words.
struct FenceWords {
    /// Never freed (see the module docs): a stream may read it later. When
    /// the engine goes it is parked in [`PARKED_PAGES`] for the life of the
    /// process, still reachable (not a leak a checker reports).
    buffer: Option<Buffer>,
    /// The page's first address (host and device: pinned, mapped).
    base: u64,
    book: WordBook,
}

impl FenceWords {
    /// A free word and the value to wait for, or the refusal when every
    /// word of the page is outstanding (fences and gates share the page).
    fn take_word(&mut self) -> Result<(usize, u32), EngineError> {
        self.book
            .take()
            .ok_or(EngineError::Refused(Refusal::FencesOutstanding {
                max: WORDS,
            }))
    }
}

/// Fence pages of engines that are gone: kept for the life of the process.
static PARKED_PAGES: std::sync::Mutex<Vec<Box<dyn std::any::Any + Send>>> =
    std::sync::Mutex::new(Vec::new());

impl Drop for FenceWords {
    fn drop(&mut self) {
        if let Some(page) = self.buffer.take() {
            PARKED_PAGES
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(Box::new(page));
        }
    }
}

impl FenceWords {
    /// The word at `index`, for the host to load or store.
    fn word(&self, index: usize) -> &AtomicU32 {
        let addr = self.base as usize + index * 4;
        // SAFETY: the page is gdr's own pinned memory of WORDS words,
        // 4-byte aligned (page aligned), never freed; the host touches it
        // only atomically, the device only through stream memory
        // operations (32-bit, aligned).
        unsafe { &*(addr as *const AtomicU32) }
    }

    /// The device address of word `index`.
    fn addr(&self, index: usize) -> u64 {
        self.base + (index * 4) as u64
    }

    /// Frees the words that awaited a stream's late write and got it.
    fn collect_late_writes(&mut self) -> usize {
        let base = self.base as usize;
        let book = &mut self.book;
        book.collect(|index| {
            // SAFETY: as in `word`.
            unsafe { &*((base + index * 4) as *const AtomicU32) }.load(Ordering::Acquire)
        })
    }
}

/// A fence queued on a stream, waiting for its batch to end.
struct StreamFence {
    cells: Vec<Arc<CompletionCell>>,
    /// GPUs to fence (flush) before the release, if the batch succeeded.
    gpus: Vec<u32>,
    /// The batch's "fence applied" flag, shared with its waiters.
    fenced: Arc<AtomicBool>,
    word: usize,
    value: u32,
    /// Where its GPU fence stands: the stream is released only after it.
    flush: Flush,
}

/// A stream fence's GPU fence (`cuFlushGPUDirectRDMAWrites`, which can
/// take long): made outside every lock
/// ([`StreamFences::claim_flushes`], then [`StreamFences::flushed`]), so
/// the fence is released only by the progress after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flush {
    /// Not looked at (its batch has not ended).
    Pending,
    /// Claimed by a progress call, which makes it outside the lock.
    Running,
    /// Made, or none needed: the stream may be released.
    Done,
}

/// A word of the page taken for a stream operation ([`StreamFences::take_word`]).
#[derive(Debug)]
pub(super) struct TakenWord {
    word: usize,
    value: u32,
    addr: u64,
}

impl TakenWord {
    /// The gate's signal once its write was queued.
    pub(super) fn signal(&self) -> Signal {
        Signal::Word {
            word: self.word,
            value: self.value,
        }
    }
}

/// The engine's page of fence words (made at its first use) and the
/// stream fences waiting on it.
#[derive(Default)]
pub(super) struct StreamFences {
    words: Option<FenceWords>,
    /// Fences whose batch has not ended.
    fences: Vec<StreamFence>,
}

impl StreamFences {
    /// A word for a stream fence or a gate: its index, the value to wait
    /// for or write, and its address. The stream operation on it is queued
    /// outside the streams' lock (a stream operation can block while the
    /// driver's queue is full); the word then goes to [`Self::queued`], or
    /// back by [`Self::unused`].
    pub(super) fn take_word(&mut self, res: &Resources) -> Result<TakenWord, EngineError> {
        let words = self.words(res)?;
        let (word, value) = words.take_word()?;
        Ok(TakenWord {
            word,
            value,
            addr: words.addr(word),
        })
    }

    /// A word taken for a stream operation that was not queued.
    pub(super) fn unused(&mut self, taken: TakenWord) {
        if let Some(words) = self.words.as_mut() {
            words.book.unused(taken.word);
        }
    }

    /// `stream` waits on `taken` (queued outside the lock) for the batch of
    /// `cells`, its GPU fence on `gpus` applied on success: see the module
    /// docs.
    pub(super) fn queued(
        &mut self,
        taken: TakenWord,
        cells: Vec<Arc<CompletionCell>>,
        gpus: Vec<u32>,
        fenced: Arc<AtomicBool>,
    ) {
        self.fences.push(StreamFence {
            cells,
            gpus,
            flush: Flush::Pending,
            fenced,
            word: taken.word,
            value: taken.value,
        });
    }

    /// Bytes of the page of words, once made (0 before).
    /// Whether a stream fence waits for its batch (its release is the
    /// engine's pass's).
    pub(super) fn busy(&self) -> bool {
        !self.fences.is_empty()
    }

    pub(super) fn page_bytes(&self) -> u64 {
        self.words.as_ref().map_or(0, |_| (WORDS * 4) as u64)
    }

    /// Whether the page is still to be made ([`Self::install_page`]).
    pub(super) fn needs_page(&self) -> bool {
        self.words.is_none()
    }

    /// Makes a page of words on the engine's first GPU. A driver call that
    /// blocks while a free waits: made outside every lock (a fence
    /// the lock holds up could be what that free waits for).
    pub(super) fn make_page(res: &Resources) -> Result<Buffer, EngineError> {
        let context = res
            .nics
            .first()
            .and_then(|n| n.ladder.gpus().first())
            .map(|g| &g.context)
            .ok_or(EngineError::Unavailable(Unavailable::NoGpu {
                purpose: "for the stream fence page",
            }))?;
        Ok(Buffer::alloc_pinned(context, (WORDS * 4) as u64)?)
    }

    /// Takes `buffer` (from [`Self::make_page`]) as the page; one made
    /// meanwhile by another thread wins and `buffer` is handed back (to be
    /// freed outside the lock).
    pub(super) fn install_page(&mut self, buffer: Buffer) -> Option<Buffer> {
        if self.words.is_some() {
            return Some(buffer);
        }
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
        self.words = Some(words);
        None
    }

    /// The page of words: installed beforehand, outside the lock
    /// (`Engine::ensure_fence_page`), or made here at its first use by a
    /// caller that did not.
    fn words(&mut self, res: &Resources) -> Result<&mut FenceWords, EngineError> {
        if self.words.is_none() {
            let _ = self.install_page(Self::make_page(res)?);
        }
        Ok(self.words.as_mut().expect("installed above"))
    }

    /// Releases every stream still waiting, its batch ended or not: the
    /// engine goes, and with it the progress that would have (work after
    /// such a fence must not rely on the batch's data: its status says).
    pub(super) fn release_all(&mut self) {
        let Some(words) = self.words.as_mut() else {
            return;
        };
        for fence in self.fences.drain(..) {
            words.word(fence.word).store(fence.value, Ordering::Release);
            words.book.done(fence.word, fence.value);
        }
    }

    /// The GPU fences to make (outside the lock) before the streams of
    /// the batches that ended are released: each fence's word and GPUs.
    /// A fence of a batch that failed, or with nothing to flush, or whose
    /// batch's waiter applied the GPU fence already, is ready at once.
    pub(super) fn claim_flushes(&mut self) -> Vec<(usize, Vec<u32>)> {
        let mut claimed = Vec::new();
        for fence in self.fences.iter_mut().filter(|f| f.flush == Flush::Pending) {
            let mut ok = true;
            let ended = fence.cells.iter().all(|cell| match cell.outcome() {
                None => false,
                Some(outcome) => {
                    ok &= outcome.is_ok();
                    true
                }
            });
            if !ended {
                continue;
            }
            fence.flush = match ok && !fence.gpus.is_empty() {
                true if !fence.fenced.swap(true, Ordering::AcqRel) => {
                    claimed.push((fence.word, fence.gpus.clone()));
                    Flush::Running
                }
                _ => Flush::Done,
            };
        }
        claimed
    }

    /// The GPU fences of the fences of `words` were made (whatever came
    /// of them): their streams may be released.
    pub(super) fn flushed(&mut self, words: &[usize]) {
        for fence in &mut self.fences {
            if fence.flush == Flush::Running && words.contains(&fence.word) {
                fence.flush = Flush::Done;
            }
        }
    }

    /// Releases the streams waiting for batches that have ended and whose
    /// GPU fence was made ([`StreamFences::claim_flushes`]); returns how
    /// many.
    pub(super) fn release(&mut self) -> usize {
        if self.fences.is_empty() {
            return 0;
        }
        let Some(words) = self.words.as_mut() else {
            return 0;
        };
        let mut released = 0;
        self.fences.retain(|fence| {
            if fence.flush != Flush::Done {
                return true;
            }
            words.word(fence.word).store(fence.value, Ordering::Release);
            words.book.done(fence.word, fence.value);
            released += 1;
            false
        });
        released
    }

    // The gates' use of the page (`super::gate`).

    /// Queues the wait of a stream fence on `stream` for `taken` (no
    /// engine lock held).
    pub(super) fn queue_wait(
        stream: &hal_cuda::dynamic::DynStream,
        taken: &TakenWord,
    ) -> Result<(), EngineError> {
        // SAFETY: the word is 4-byte aligned pinned host memory the device
        // can read (unified addressing), never freed (module docs).
        Ok(unsafe { stream.wait_value32(taken.addr, taken.value) }?)
    }

    /// Queues a gate's signal on `stream` for `taken` (no engine lock
    /// held): the word's write where the stream has memory operations
    /// (`Ok(true)`, `Signal::Word`), none where the driver has none
    /// (`Ok(false)`: the word goes back, the gate's event alone tells).
    pub(super) fn queue_gate_write(
        stream: &hal_cuda::dynamic::DynStream,
        taken: &TakenWord,
    ) -> Result<bool, EngineError> {
        // SAFETY: the word is 4-byte aligned pinned (portable) host memory
        // of the engine's, which the device may write (unified addressing)
        // and which is never freed (module docs).
        match unsafe { stream.write_value32(taken.addr, taken.value) } {
            Ok(()) => Ok(true),
            Err(hal_cuda::CudaError::NotSupported { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// A gate whose `signal` was queued never came to wait (its event
    /// failed): a queued write keeps its word out of use until it lands.
    pub(super) fn abandon_gate(&mut self, signal: Signal) {
        if let (Signal::Word { word, value }, Some(words)) = (signal, self.words.as_mut()) {
            words.book.await_write(word, value);
        }
    }

    /// What a gate's word holds now (0 for a gate without one).
    pub(super) fn gate_word(&self, signal: Signal) -> u32 {
        match (signal, &self.words) {
            (Signal::Word { word, .. }, Some(words)) => words.word(word).load(Ordering::Acquire),
            _ => 0,
        }
    }

    /// Gives back the word of a gate that left waiting (`opened` or not),
    /// which held `word_now` then ([`GateWait::retire`]).
    pub(super) fn retire_gate(&mut self, wait: &GateWait, opened: bool, word_now: u32) {
        if let Some(words) = self.words.as_mut() {
            wait.retire(&mut words.book, opened, word_now);
        }
    }

    /// Frees the words that awaited a gate's late write and got it;
    /// returns how many.
    pub(super) fn collect_late_writes(&mut self) -> usize {
        self.words
            .as_mut()
            .map_or(0, FenceWords::collect_late_writes)
    }
}
