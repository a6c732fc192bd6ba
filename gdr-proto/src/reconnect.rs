//! Re-establishing a peer's failed queue pairs: what each side does once a
//! queue pair drained, how long it tries, and when the peer is gone.
//!
//! # The protocol
//!
//! A queue pair fails (an error completion, a deadline that stopped it,
//! the peer's disconnect) and fails only its own requests; once it has
//! drained (nothing of it is left in the NIC) the driver reports it
//! ([`Recovery::on_drained`]), and the answer is one of [`Drained`]:
//!
//! 1. During set-up (before [`Recovery::establish`]) the peer is gone:
//!    re-establishing would make a session nobody accepted.
//! 2. A peer already gone, or a queue pair on a NIC that died, stays down.
//! 3. On the accepting side, a new connection the peer made for the index
//!    while the old one drained ([`Recovery::on_replacement`]) is
//!    installed now.
//! 4. Otherwise it is re-established, bounded by the timeout from now:
//!    both sides disconnect the old connection; the connecting side dials
//!    the same index of the session over the same path (attempts backing
//!    off, [`Backoff`]; an attempt may take all the time left; a reply
//!    must answer it, [`check_reply`]); the accepting side waits for the
//!    dial. Meanwhile work for the queue pair waits.
//!
//! A queue pair being re-established is given up when its deadline passes
//! ([`Recovery::handle_timeout`]) or its dial is refused
//! ([`Recovery::give_up`]): its waiting work fails. A peer whose every
//! queue pair is down is gone ([`Recovery::poll_gone`]).
//!
//! On the accepting side, a new connection for an index whose old one is
//! still up means the connector saw it fail first: the old one is failed,
//! and the new one waits for it to drain ([`Replacement::FailOldThenWait`]).

use std::time::{Duration, Instant};

use crate::setup::ReplyMismatch;
use crate::wire::{Hello, RejectReason, Role, WireError};

/// Why a peer is gone, as the recovery decided.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Gone {
    /// A queue pair failed before the session was established.
    #[error("queue pair {index} failed during set-up")]
    FailedDuringSetUp {
        /// The queue pair.
        index: usize,
    },
    /// Every queue pair is down (failed and not re-established).
    #[error("every queue pair failed")]
    EveryQueuePairFailed,
    /// Every queue pair is down, the last given up for this reason.
    #[error("{0}")]
    GivenUp(GiveUp),
}

/// Why re-establishing a queue pair was given up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GiveUp {
    /// Not re-established within the timeout.
    #[error("queue pair {index} not re-established within {after:?}")]
    Late {
        /// The queue pair.
        index: usize,
        /// The timeout.
        after: Duration,
    },
    /// The peer refused the dial (or answered it wrong).
    #[error("re-establishing queue pair {index}: {why}")]
    Refused {
        /// The queue pair.
        index: usize,
        /// What the peer answered.
        why: DialRefused,
    },
}

/// How the peer refused a re-dial of a queue pair, or answered it wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DialRefused {
    /// It rejected the connect request, saying why.
    #[error("rejected: {0}")]
    Rejected(RejectReason),
    /// It rejected the connect request without a reason we could read.
    #[error("rejected")]
    RejectedUnexplained,
    /// Its answer is not a hello.
    #[error("unexpected reply: {0}")]
    Malformed(WireError),
    /// Its hello answers another dial (role, session, queue pair or engine).
    #[error("unexpected reply: {0}")]
    Mismatch(ReplyMismatch),
}

/// What to do with a queue pair that drained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Drained {
    /// The peer is gone for this reason (the driver marks it so).
    Gone(Gone),
    /// It stays down (the peer or its NIC is gone); the peer is not gone
    /// while another queue pair is up.
    StaysDown,
    /// Install the new connection the peer made for it (it waited).
    Install,
    /// Re-establish it by `by`: disconnect the old connection; `dial`:
    /// this side dials (it connected the session), else it waits for the
    /// peer's dial.
    Reconnect {
        /// Given up past this (`None`: a timeout past what an `Instant`
        /// holds, never).
        by: Option<Instant>,
        /// This side dials.
        dial: bool,
    },
}

/// What the accepting side does with a new connection the peer made for a
/// queue pair index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replacement {
    /// Install it now (the old one drained and waits for it).
    Install,
    /// Keep it until the old one drains, which is on its way.
    Wait,
    /// The old one is still up: fail it (disconnect), keep the new one
    /// until the old one drains.
    FailOldThenWait,
    /// Drop it: the peer is gone or has no such queue pair.
    Refuse,
}

/// Where the old connection of a queue pair stands, as the driver's core
/// sees it, when the peer makes a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OldQp {
    /// Up and working.
    Ready,
    /// Failed, still draining.
    Failing,
    /// Drained and waiting to be re-established.
    Reconnecting,
    /// Drained and given up.
    Down,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QpState {
    Up,
    /// `by`: `None` never passes.
    Reconnecting {
        by: Option<Instant>,
    },
    /// A new connection waits for the old one to drain.
    Replaced,
    Down,
}

/// The recovery of one peer's queue pairs, in quinn-proto's shape: the
/// driver reports drains, new connections, dials that failed and time;
/// this says what to do and when the peer is gone.
#[derive(Debug)]
pub struct Recovery {
    connector: bool,
    established: bool,
    timeout: Duration,
    qps: Vec<QpState>,
    gone: Option<Gone>,
    gone_taken: bool,
}

impl Recovery {
    /// The recovery of a peer of `qp_count` queue pairs; `connector`: this
    /// side connected the session (and so dials); each re-establishment is
    /// bounded by `timeout`.
    pub fn new(qp_count: usize, connector: bool, timeout: Duration) -> Self {
        Self {
            connector,
            established: false,
            timeout,
            qps: vec![QpState::Up; qp_count],
            gone: None,
            gone_taken: false,
        }
    }

    /// Set-up is done: from now on a failed queue pair is re-established.
    pub fn establish(&mut self) {
        self.established = true;
    }

    /// Whether set-up is done.
    pub fn is_established(&self) -> bool {
        self.established
    }

    /// Queue pair `index` drained at `now`; `peer_gone`: the peer is gone
    /// (said goodbye, closed); `nic_dead`: its NIC reported a fatal error.
    pub fn on_drained(
        &mut self,
        index: usize,
        now: Instant,
        peer_gone: bool,
        nic_dead: bool,
    ) -> Drained {
        let Some(&state) = self.qps.get(index) else {
            return Drained::StaysDown;
        };
        if state == QpState::Down {
            // Reported twice, or the peer was closed.
            return Drained::StaysDown;
        }
        if !self.established {
            self.qps[index] = QpState::Down;
            return self.drained_gone(Gone::FailedDuringSetUp { index });
        }
        if peer_gone || nic_dead || self.gone.is_some() {
            self.qps[index] = QpState::Down;
            if self.all_down() {
                return self.drained_gone(Gone::EveryQueuePairFailed);
            }
            return Drained::StaysDown;
        }
        match state {
            QpState::Replaced => {
                self.qps[index] = QpState::Up;
                Drained::Install
            }
            QpState::Up => {
                let by = now.checked_add(self.timeout);
                self.qps[index] = QpState::Reconnecting { by };
                Drained::Reconnect {
                    by,
                    dial: self.connector,
                }
            }
            // Reported twice: nothing more to do.
            QpState::Reconnecting { .. } | QpState::Down => Drained::StaysDown,
        }
    }

    /// The peer made a new connection for queue pair `index` (the
    /// accepting side); `old`: where its old one stands.
    pub fn on_replacement(&mut self, index: usize, old: OldQp) -> Replacement {
        if self.gone.is_some() || index >= self.qps.len() {
            return Replacement::Refuse;
        }
        match (self.qps[index], old) {
            (QpState::Reconnecting { .. }, OldQp::Reconnecting) => Replacement::Install,
            (_, OldQp::Down) | (QpState::Down, _) => Replacement::Refuse,
            (_, OldQp::Ready) => {
                self.qps[index] = QpState::Replaced;
                Replacement::FailOldThenWait
            }
            (_, OldQp::Failing | OldQp::Reconnecting) => {
                self.qps[index] = QpState::Replaced;
                Replacement::Wait
            }
        }
    }

    /// Queue pair `index` has its new connection installed: it is up.
    /// Returns whether it was being re-established.
    pub fn installed(&mut self, index: usize) -> bool {
        match self.qps.get_mut(index) {
            Some(state @ QpState::Reconnecting { .. }) => {
                *state = QpState::Up;
                true
            }
            _ => false,
        }
    }

    /// How long queue pair `index` is still wanted at `now` (`None`: not
    /// any more; a dial that finds so drops its connection).
    pub fn time_left(&self, index: usize, now: Instant) -> Option<Duration> {
        match (self.gone.as_ref(), self.qps.get(index)) {
            (None, Some(QpState::Reconnecting { by: None })) => Some(Duration::MAX),
            (None, Some(QpState::Reconnecting { by: Some(by) })) => {
                Some(by.saturating_duration_since(now)).filter(|left| !left.is_zero())
            }
            _ => None,
        }
    }

    /// Re-establishing queue pair `index` failed for good (`why`): it is
    /// down, its waiting work fails. Returns whether it was being
    /// re-established (else nothing changed).
    pub fn give_up(&mut self, index: usize, why: GiveUp) -> bool {
        if !matches!(self.qps.get(index), Some(QpState::Reconnecting { .. })) {
            return false;
        }
        self.qps[index] = QpState::Down;
        if self.all_down() {
            self.mark_gone(Gone::GivenUp(why));
        }
        true
    }

    /// Gives up the queue pairs whose deadline passed at `now`; returns
    /// them with why (the driver fails their waiting work).
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<(usize, GiveUp)> {
        let late: Vec<usize> = (0..self.qps.len())
            .filter(|&i| matches!(self.qps[i], QpState::Reconnecting { by: Some(by) } if by <= now))
            .collect();
        let after = self.timeout;
        late.into_iter()
            .map(|index| (index, GiveUp::Late { index, after }))
            .filter(|(index, why)| self.give_up(*index, why.clone()))
            .collect()
    }

    /// The earliest deadline of a queue pair being re-established.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.qps
            .iter()
            .filter_map(|s| match s {
                QpState::Reconnecting { by } => *by,
                _ => None,
            })
            .min()
    }

    /// Queue pairs being re-established.
    pub fn reconnecting(&self) -> usize {
        self.qps
            .iter()
            .filter(|s| matches!(s, QpState::Reconnecting { .. }))
            .count()
    }

    /// Why the peer is gone, once (the driver marks the peer); `None`
    /// again after, and when [`Recovery::on_drained`] reported it.
    pub fn poll_gone(&mut self) -> Option<Gone> {
        if self.gone_taken {
            return None;
        }
        let gone = self.gone.clone()?;
        self.gone_taken = true;
        Some(gone)
    }

    fn all_down(&self) -> bool {
        self.qps.iter().all(|s| *s == QpState::Down)
    }

    fn mark_gone(&mut self, why: Gone) {
        self.gone.get_or_insert(why);
    }

    /// The peer is gone (the first reason stands), reported by the return
    /// value rather than [`Recovery::poll_gone`].
    fn drained_gone(&mut self, why: Gone) -> Drained {
        self.mark_gone(why);
        self.gone_taken = true;
        Drained::Gone(self.gone.clone().expect("just set"))
    }

    /// This side connected the session (and so dials).
    pub fn is_connector(&self) -> bool {
        self.connector
    }

    /// The peer is torn down: every queue pair is down, nothing more is
    /// re-established or reported. Returns how many were being
    /// re-established.
    pub fn close(&mut self) -> usize {
        let reconnecting = self.reconnecting();
        self.qps.fill(QpState::Down);
        self.gone_taken = true;
        self.gone.get_or_insert(Gone::EveryQueuePairFailed);
        reconnecting
    }
}

/// The waits between a dial's attempts: from 5 ms, doubling, at most
/// 500 ms.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { next: Self::FIRST }
    }
}

impl Backoff {
    /// The first wait.
    pub const FIRST: Duration = Duration::from_millis(5);
    /// The longest wait.
    pub const MAX: Duration = Duration::from_millis(500);

    /// The wait before the next attempt.
    pub fn next_wait(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        wait
    }
}

/// Checks the acceptor's reply to a re-establishing dial of queue pair
/// `index` of `session`, whose other queue pairs reach engine `engine`.
pub fn check_reply(
    reply: &Hello,
    session: u64,
    index: usize,
    engine: u64,
) -> Result<(), ReplyMismatch> {
    if reply.role != Role::Accept {
        return Err(ReplyMismatch::Role(reply.role));
    }
    if reply.session != session {
        return Err(ReplyMismatch::Session { got: reply.session });
    }
    if usize::from(reply.qp_index) != index {
        return Err(ReplyMismatch::Index {
            got: reply.qp_index,
        });
    }
    if reply.engine != engine {
        return Err(ReplyMismatch::Engine {
            first: engine,
            got: reply.engine,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
