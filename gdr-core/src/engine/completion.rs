//! A request's completion: set once, by whichever of the engine's outcomes
//! comes first (the NIC's completion, the deadline, a cancellation, a
//! device failure), and seen by every waiter: a blocking
//! [`CompletionCell::wait`] or a `Future` polling it.
//!
//! The engine resolves a request through [`CompletionCell::complete`],
//! which answers whether this call decided the outcome: only that caller
//! may count the request as done, so a completion racing a timeout is
//! counted once. Loom-checked (`engine::loom_tests`).

use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::engine::error::TransferError;
use crate::sync::{Condvar, Mutex, lock, wait, wait_timeout};

/// What a request ended with.
pub type Outcome = Result<(), TransferError>;

#[derive(Debug)]
enum CellState {
    /// `blocked`: threads in [`CompletionCell::wait`]; notifying a condvar
    /// is a system call even with nobody waiting, so it is made only for
    /// them.
    Pending {
        wakers: Vec<Waker>,
        blocked: usize,
    },
    Done(Outcome),
}

/// One request's outcome, shared by the engine and its waiters.
#[derive(Debug)]
pub struct CompletionCell {
    state: Mutex<CellState>,
    done: Condvar,
    /// A NIC batch's grants and what their owner revoked: its remote
    /// access error is told as the revocation it was.
    revocations: std::sync::OnceLock<Revocations>,
}

/// Grant ids a peer revoked lately, as its notices said (bounded: the
/// oldest is forgotten first). Ids are never reused, so one stays revoked.
#[derive(Debug, Default)]
pub(crate) struct RevokedGrants {
    ids: std::sync::Mutex<std::collections::VecDeque<u64>>,
}

impl RevokedGrants {
    /// Revocations remembered per peer.
    const REMEMBERED: usize = 1024;

    /// The peer revoked `grant`.
    pub(crate) fn record(&self, grant: u64) {
        let mut ids = self
            .ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if ids.len() >= Self::REMEMBERED {
            ids.pop_front();
        }
        ids.push_back(grant);
    }

    /// Whether the peer revoked `grant` (lately).
    pub(crate) fn contains(&self, grant: u64) -> bool {
        self.ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&grant)
    }
}

/// The grants a NIC batch moves under, and their owner's revocations.
#[derive(Debug)]
struct Revocations {
    grants: Vec<u64>,
    revoked: std::sync::Arc<RevokedGrants>,
}

impl Revocations {
    /// A remote access error (or a flush after one) under a grant whose
    /// revocation notice has come is the revocation: the owner's NIC
    /// refused the access because the grant's MRs were gone.
    fn refine(&self, outcome: Outcome) -> Outcome {
        let access = match &outcome {
            Err(TransferError::RemoteAccess { .. }) => true,
            Err(TransferError::Flushed { cause, .. }) => {
                matches!(**cause, TransferError::RemoteAccess { .. })
            }
            _ => false,
        };
        if !access {
            return outcome;
        }
        match self.grants.iter().find(|&&g| self.revoked.contains(g)) {
            Some(&grant) => Err(TransferError::Revoked { grant }),
            None => outcome,
        }
    }
}

impl Default for CompletionCell {
    fn default() -> Self {
        Self::new()
    }
}

impl CompletionCell {
    /// A pending cell.
    pub fn new() -> Self {
        Self {
            state: Mutex::new(CellState::Pending {
                wakers: Vec::new(),
                blocked: 0,
            }),
            done: Condvar::new(),
            revocations: std::sync::OnceLock::new(),
        }
    }

    /// Tells a remote access error under one of `grants` (once the peer's
    /// notice of its revocation has come) as [`TransferError::Revoked`];
    /// set before the cell's request is submitted.
    pub(crate) fn watch_revocations(
        &self,
        grants: impl IntoIterator<Item = u64>,
        revoked: std::sync::Arc<RevokedGrants>,
    ) {
        // Each once: a batch names few grants, mostly one in a row.
        let mut kept: Vec<u64> = Vec::new();
        for grant in grants {
            if kept.last() != Some(&grant) && !kept.contains(&grant) {
                kept.push(grant);
            }
        }
        let _ = self.revocations.set(Revocations {
            grants: kept,
            revoked,
        });
    }

    /// Sets the outcome unless one is set already; true when this call set
    /// it (the caller then owns the request's accounting).
    pub fn complete(&self, outcome: Outcome) -> bool {
        let outcome = match (&outcome, self.revocations.get()) {
            (Err(_), Some(revocations)) => revocations.refine(outcome),
            _ => outcome,
        };
        let wakers = {
            #[cfg(loom)]
            if crate::cache::mutant::active("complete-check-then-act") {
                // The bug: the check and the store under two locks.
                let pending = matches!(*lock(&self.state), CellState::Pending { .. });
                if !pending {
                    return false;
                }
                let mut state = lock(&self.state);
                let old = std::mem::replace(&mut *state, CellState::Done(outcome));
                let CellState::Pending { wakers, .. } = old else {
                    return true;
                };
                drop(state);
                self.done.notify_all();
                wakers.into_iter().for_each(Waker::wake);
                return true;
            }
            let mut state = lock(&self.state);
            let CellState::Pending { wakers, blocked } = &mut *state else {
                return false;
            };
            let wakers = std::mem::take(wakers);
            let blocked = *blocked;
            *state = CellState::Done(outcome);
            #[cfg(loom)]
            let blocked = if crate::cache::mutant::active("notify-skips-a-waiter") {
                0
            } else {
                blocked
            };
            (wakers, blocked)
        };
        let (wakers, blocked) = wakers;
        if blocked > 0 {
            self.done.notify_all();
        }
        for waker in wakers {
            waker.wake();
        }
        true
    }

    /// The outcome, if set.
    pub fn outcome(&self) -> Option<Outcome> {
        match &*lock(&self.state) {
            CellState::Done(outcome) => Some(outcome.clone()),
            CellState::Pending { .. } => None,
        }
    }

    /// Whether the outcome is set.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // the benches wait on a bare cell
    pub fn is_done(&self) -> bool {
        matches!(*lock(&self.state), CellState::Done(_))
    }

    /// Waits for the outcome, at most `timeout` (`None`: as long as it
    /// takes); `None` when it was not set in time.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // the benches wait on a bare cell
    pub fn wait(&self, timeout: Option<Duration>) -> Option<Outcome> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        let mut state = lock(&self.state);
        loop {
            let left = match (&mut *state, deadline) {
                (CellState::Done(outcome), _) => return Some(outcome.clone()),
                (CellState::Pending { .. }, None) => None,
                (CellState::Pending { .. }, Some(deadline)) => {
                    let left = deadline.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    Some(left)
                }
            };
            if let CellState::Pending { blocked, .. } = &mut *state {
                *blocked += 1;
            }
            state = match left {
                None => wait(&self.done, state),
                Some(left) => wait_timeout(&self.done, state, left),
            };
            if let CellState::Pending { blocked, .. } = &mut *state {
                *blocked -= 1;
            }
        }
    }

    /// Polls for the outcome from a `Future`, registering `cx`'s waker
    /// while pending.
    pub fn poll(&self, cx: &mut Context<'_>) -> Poll<Outcome> {
        let mut state = lock(&self.state);
        match &mut *state {
            CellState::Done(outcome) => Poll::Ready(outcome.clone()),
            CellState::Pending { wakers, .. } => {
                if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
                    wakers.push(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }
}
