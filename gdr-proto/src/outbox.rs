//! This side's control messages waiting for a send slot on the peer's
//! connection: first in, first out, bounded in count, each with a
//! deadline.
//!
//! The driver encodes a message and [`Outbox::push`]es it with what ends
//! it (a completion, `T`); while a send slot is free and the connection
//! can post, it [`Outbox::pop`]s the oldest. A message still waiting at
//! its deadline ends with a timeout instead ([`Outbox::poll_expired`]):
//! the oldest first, so one behind a live message waits its turn (they
//! are sent in order). A full outbox refuses a new message at once
//! ([`OutboxFull`]); nothing already queued is lost.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A message waiting for a send slot.
#[derive(Debug)]
pub struct Waiting<T> {
    /// The encoded message.
    pub bytes: Vec<u8>,
    /// What ends it (the driver's completion).
    pub token: T,
    /// Given up past this (`None`: a timeout past what an `Instant`
    /// holds, never).
    pub deadline: Option<Instant>,
    /// The timeout it was queued with (for the error it ends with).
    pub timeout: Duration,
}

/// The outbox holds as many messages as it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{max} control messages already wait for the peer")]
pub struct OutboxFull {
    /// The bound.
    pub max: usize,
}

/// Control messages waiting for a send slot (see the module docs).
#[derive(Debug)]
pub struct Outbox<T> {
    queue: VecDeque<Waiting<T>>,
    max: usize,
}

impl<T> Outbox<T> {
    /// An empty outbox of at most `max` messages.
    pub fn new(max: usize) -> Self {
        Self {
            queue: VecDeque::new(),
            max,
        }
    }

    /// Queues `bytes`, ended by `token`, to go out within `timeout` of
    /// `now`. A full outbox refuses it (and hands the token back).
    pub fn push(
        &mut self,
        bytes: Vec<u8>,
        token: T,
        now: Instant,
        timeout: Duration,
    ) -> Result<(), (OutboxFull, T)> {
        if self.queue.len() >= self.max {
            return Err((OutboxFull { max: self.max }, token));
        }
        self.queue.push_back(Waiting {
            bytes,
            token,
            deadline: now.checked_add(timeout),
            timeout,
        });
        Ok(())
    }

    /// The oldest message if its deadline passed at `now` (the driver ends
    /// it with a timeout). Changes by [`Outbox::push`], [`Outbox::pop`]
    /// and this.
    pub fn poll_expired(&mut self, now: Instant) -> Option<Waiting<T>> {
        match self.queue.front()?.deadline {
            Some(at) if at <= now => self.queue.pop_front(),
            _ => None,
        }
    }

    /// The oldest message, to go out now (the driver calls this only with
    /// a send slot free and the connection able to post).
    pub fn pop(&mut self) -> Option<Waiting<T>> {
        self.queue.pop_front()
    }

    /// When the oldest message expires.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.queue.front().and_then(|w| w.deadline)
    }

    /// Messages waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests;
