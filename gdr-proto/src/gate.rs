//! Gated batches: a batch held unposted until a GPU stream reaches a point,
//! learned without any CPU thread synchronising with the stream.
//!
//! The driver queues on the stream a write of a fresh value into a word of
//! a page of pinned host memory (where the stream has memory operations),
//! then an event; it looks at the word (a load) on each step and at the
//! event (a driver call) only every [`EVENT_EVERY`] steps on the word path,
//! since the event only tells a stream that failed. [`GateWait::step`]
//! decides what the gate does with what the driver saw; [`at_open`]
//! decides, when the driver is about to submit an opened gate's batch
//! outside its lock, whether it still may. [`WordBook`] keeps the page's
//! words: a word is used again only once the value a stream was told to
//! write there has landed, so a late write (its gate ended first) can never
//! open a later gate early.

use std::time::{Duration, Instant};

/// On the word path, the event is looked at every this many steps.
pub const EVENT_EVERY: u64 = 64;

/// How a gate learns that its stream reached it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// The stream writes `value` into `word`; an event after the write
    /// tells a stream that failed.
    Word {
        /// The word's index in the page.
        word: usize,
        /// The value it is told to write.
        value: u32,
    },
    /// No stream memory operations: an event recorded at the gate.
    Event,
}

/// What the driver saw of a gate's stream on one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// The word holds the value, or the event passed.
    Reached,
    /// Neither yet.
    NotYet,
    /// The event reports that the stream failed.
    StreamFailed,
}

/// Why a gate ended without opening.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateEnd {
    /// The caller cancelled it.
    Cancelled,
    /// Its stream failed before reaching it.
    StreamFailed,
    /// The peer went.
    PeerGone,
    /// Its deadline passed.
    TimedOut,
}

/// What a gate does after a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Keep waiting.
    Wait,
    /// The stream reached it: submit its batch.
    Open,
    /// It ends now, nothing of it posted.
    End(GateEnd),
}

/// A gate its stream has not reached yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateWait {
    /// How it learns.
    pub signal: Signal,
    /// When it gives up.
    pub deadline: Instant,
}

impl GateWait {
    /// Whether step `tick` looks at the event: always on the event path,
    /// every [`EVENT_EVERY`]th step on the word path.
    pub fn looks_at_event(&self, tick: u64) -> bool {
        match self.signal {
            Signal::Event => true,
            Signal::Word { .. } => tick.is_multiple_of(EVENT_EVERY),
        }
    }

    /// Whether `word_now`, the word's value loaded this step, shows the
    /// stream reached the gate (never, on the event path).
    pub fn word_reached(&self, word_now: u32) -> bool {
        matches!(self.signal, Signal::Word { value, .. } if word_now >= value)
    }

    /// Decides a step: a cancel wins over everything, then what was seen
    /// of the stream; only a gate not reached ends for a gone peer or its
    /// deadline.
    pub fn step(&self, cancelled: bool, seen: Seen, peer_gone: bool, now: Instant) -> Step {
        if cancelled {
            return Step::End(GateEnd::Cancelled);
        }
        match seen {
            Seen::Reached => Step::Open,
            Seen::StreamFailed => Step::End(GateEnd::StreamFailed),
            Seen::NotYet if peer_gone => Step::End(GateEnd::PeerGone),
            Seen::NotYet if now >= self.deadline => Step::End(GateEnd::TimedOut),
            Seen::NotYet => Step::Wait,
        }
    }

    /// Gives the gate's word back once it left waiting (`opened` or not):
    /// free at once if `word_now` shows the stream's write, else out of use
    /// until that write lands (a gate opened through its event, or one that
    /// ended first).
    pub fn retire(&self, book: &mut WordBook, opened: bool, word_now: u32) {
        if let Signal::Word { word, value } = self.signal {
            if opened && word_now >= value {
                book.done(word, value);
            } else {
                book.await_write(word, value);
            }
        }
    }
}

/// Whether an opened gate's batch may still be submitted at `now`: the
/// time left of its bound, or why not (a cancel that crossed the opening,
/// or the deadline passed meanwhile).
pub fn at_open(cancelled: bool, now: Instant, deadline: Instant) -> Result<Duration, GateEnd> {
    if cancelled {
        return Err(GateEnd::Cancelled);
    }
    let left = deadline.saturating_duration_since(now);
    if left.is_zero() {
        Err(GateEnd::TimedOut)
    } else {
        Ok(left)
    }
}

/// Which words of the page are free, the last value each carried, and
/// which await a stream's write. A word's values only rise: each use takes
/// one larger than any it carried, and a word whose values are spent
/// (`u32::MAX`) is not used again, so a value never wraps to a small one
/// that an old, larger one would satisfy.
#[derive(Debug)]
pub struct WordBook {
    free: Vec<usize>,
    last: Vec<u32>,
    /// (word, value): a stream will write `value` there (its gate ended
    /// before it did); the word stays out of use until the write lands.
    awaiting: Vec<(usize, u32)>,
}

impl WordBook {
    /// `words` words, all free, none used yet.
    pub fn new(words: usize) -> Self {
        Self {
            free: (0..words).rev().collect(),
            last: vec![0; words],
            awaiting: Vec::new(),
        }
    }

    /// A free word and the value its next use carries (larger than any it
    /// carried); `None` when every word is out.
    pub fn take(&mut self) -> Option<(usize, u32)> {
        let word = self.free.pop()?;
        Some((word, self.last[word] + 1))
    }

    /// `word` now holds `value` (the host stored it, or the stream's write
    /// was seen): free again, unless its values are spent.
    pub fn done(&mut self, word: usize, value: u32) {
        self.last[word] = self.last[word].max(value);
        if self.last[word] < u32::MAX {
            self.free.push(word);
        }
    }

    /// `word` was taken but nothing was queued on it: free again as it was.
    pub fn unused(&mut self, word: usize) {
        self.free.push(word);
    }

    /// A stream will still write `value` to `word`: it stays out of use
    /// until [`WordBook::collect`] sees the write.
    pub fn await_write(&mut self, word: usize, value: u32) {
        self.awaiting.push((word, value));
    }

    /// Frees the awaited words whose write landed (`read` loads a word);
    /// returns how many. A stream that never writes (it failed) keeps its
    /// word out for good.
    pub fn collect(&mut self, read: impl Fn(usize) -> u32) -> usize {
        if self.awaiting.is_empty() {
            return 0;
        }
        let mut landed = Vec::new();
        self.awaiting.retain(|&(word, value)| {
            let written = read(word) >= value;
            if written {
                landed.push((word, value));
            }
            !written
        });
        for &(word, value) in &landed {
            self.done(word, value);
        }
        landed.len()
    }
}

#[cfg(test)]
mod tests;
