//! The fabric's virtual clock: what drives every timeout and retry of the
//! simulated transport.
//!
//! Time on a [`SimFabric`] is virtual: a [`Duration`] since the fabric was
//! made, which moves only when the fabric moves it. It has two modes
//! ([`ClockMode`]):
//!
//! - **[`Auto`](ClockMode::Auto)** (the default) keeps the behaviour every
//!   test written before the clock relies on. Within one progress call (every
//!   post and every [`poll`](hal_verbs::CompletionQueue::poll) makes one)
//!   nothing outside the fabric can change, so the clock runs through every
//!   transport (ACK) timeout and every outstanding READ on the way: a
//!   request to a dead peer fails with `RETRY_EXC_ERR` in the post (or
//!   poll) that finds it, after `(retry_cnt + 1)` timeouts of virtual time.
//!   An RNR wait is different: the peer is alive and may post its receive
//!   between two polls, so each poll's progress moves the clock past at
//!   most one RNR timer period that was already pending when it started (a
//!   poll is one RNR retry). A post's progress records no RNR NAK and moves
//!   no RNR timer, but a wait whose receive the post brought is retried at
//!   once (the clock moving to its deadline). When nobody polls, the
//!   fabric's NIC thread makes a poll's progress for QPs whose send CQ is
//!   armed, one RNR timer period of virtual time per RNR timer of real time
//!   (at least 1 ms; see the [module docs](super) of the NIC). That is the
//!   only real time the Auto clock follows.
//! - **[`Manual`](ClockMode::Manual)**: the clock moves only when the test
//!   calls [`SimClock::advance`] (or [`SimFabric::advance`]); progress runs
//!   what is runnable *now* and nothing else. Every timer fires exactly at
//!   its deadline, in deadline order, during the `advance` that passes it.
//!   Nothing runs by itself: a post only queues (its work runs at the next
//!   poll, [`SimFabric::progress`] or `advance`), and no thread moves work
//!   or time, so a test on this clock is deterministic to the nanosecond.
//!
//! What is time-driven (see the engine):
//!
//! - **ACK timeout and `retry_cnt`.** A request whose peer does not answer
//!   (QP destroyed, in the wrong state, wrong QPN or PSN, device dead) is
//!   retransmitted after [`ack_timeout`]`(timeout)` = 4.096 µs ×
//!   2^`timeout`; after `retry_cnt` retransmissions the next timeout fails it
//!   with `RETRY_EXC_ERR`: at `(retry_cnt + 1)` × the timeout after it was
//!   first sent, as rxe's completer counts (Linux
//!   `drivers/infiniband/sw/rxe/rxe_comp.c`, `rxe_completer`: its
//!   `COMPST_ERROR_RETRY` state decrements `comp.retry_cnt` on each
//!   timeout and fails the WQE with `IB_WC_RETRY_EXC_ERR` once it is 0). A peer that becomes ready before a retransmission
//!   gets it. `retry_cnt` 7 and `timeout` 0 (infinite) are refused by the
//!   HAL ([`hal_verbs::RtsParams::validate`]).
//! - **RNR NAK and `rnr_retry`.** A SEND (or WRITE with immediate) that
//!   finds no receive posted is NAKed; the requester waits the RNR timer the
//!   *responder* advertises (its `min_rnr_timer`, set at RTR; the table of
//!   [`rnr_nak_timer`], from `ibv_modify_qp(3)` and IBA 9.7.5.2.8), then
//!   retries; the NAK of retry `rnr_retry` fails it with
//!   `RNR_RETRY_EXC_ERR`, i.e. `rnr_retry` timer periods after the first
//!   NAK (rxe's completer, `COMPST_RNR_RETRY`: `comp.rnr_retry` is
//!   decremented per NAK unless it is 7, the requester waits the timer of
//!   the NAK's syndrome, and the WQE fails with `IB_WC_RNR_RETRY_EXC_ERR`
//!   when a NAK finds it 0). `rnr_retry` 7 retries forever. A
//!   receive posted while the requester waits is used by the next retry,
//!   not before. On a device whose retransmit timer runs through RNR waits
//!   ([`DeviceConfig::retransmit_timer_runs_during_rnr_wait`], rxe), an
//!   ACK timeout shorter than the RNR timer also expires in each wait,
//!   counts a transport retry and, once `retry_cnt` are spent, fails the
//!   request with `RETRY_EXC_ERR` at that expiry, `rnr_retry` 7 or not.
//! - **READ round trip and FENCE.** With [`SimClock::set_read_latency`]
//!   above zero, an RDMA READ is outstanding for that long: the responder's
//!   memory is read and the requester's completes only when it is due, while
//!   later requests of the same QP go on (an RC requester pipelines past a
//!   READ). A request posted with [`SendFlags::FENCE`](hal_verbs::SendFlags)
//!   waits until every earlier READ of its QP has completed. At most
//!   `max_rd_atomic` (RTS, as granted: clamped to the device's limit) READs
//!   are outstanding, and no more than the responder's granted
//!   `max_dest_rd_atomic` (RTR) allows (0 counts as 1); a READ
//!   beyond that waits, and the requests behind it with it. Completions
//!   still come in posting order. The default latency is zero: a READ runs
//!   at once, as before the clock.
//!
//! - **rdma_cm waits.** The simulated connection manager's timed waits
//!   (`connect` and `accept` up to [`ConnectParams::timeout`], the
//!   connect's retries while nobody listens, [`Listener::next_request`],
//!   [`Connection::poll_state`]) run on the real clock in Auto mode, as
//!   before the clock. A wait that starts in Manual mode runs on the virtual
//!   clock: it ends with its timeout once an [`advance`](SimClock::advance)
//!   (from another thread: the wait blocks) passes its deadline, and never
//!   because real time passed.
//!
//! Successful requests take no time: bandwidth and wire latency are not
//! modelled.
//!
//! [`DeviceConfig::retransmit_timer_runs_during_rnr_wait`]: super::DeviceConfig::retransmit_timer_runs_during_rnr_wait
//! [`ConnectParams::timeout`]: hal_verbs::ConnectParams::timeout
//! [`Listener::next_request`]: hal_verbs::Listener::next_request
//! [`Connection::poll_state`]: hal_verbs::Connection::poll_state

use std::time::Duration;

use super::SimFabric;

/// How the virtual clock moves (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClockMode {
    /// Progress moves the clock through transport timeouts and READ round
    /// trips at once, and one pending RNR timer period per poll (or per
    /// RNR timer of real time for a parked waiter, on the NIC thread).
    #[default]
    Auto,
    /// Only [`SimClock::advance`] moves the clock.
    Manual,
}

/// The clock's state, behind the fabric's lock.
#[derive(Debug, Default)]
pub(crate) struct ClockState {
    pub now: Duration,
    pub mode: ClockMode,
    pub read_latency: Duration,
}

/// The local ACK timeout of an RC QP's `timeout` code: 4.096 µs ×
/// 2^`timeout` (`ibv_modify_qp(3)`; IBA 9.7.6.1.3). Code 0 means "no
/// timer" (wait forever): `None`.
pub fn ack_timeout(timeout: u8) -> Option<Duration> {
    if timeout == 0 {
        return None;
    }
    let nanos = 4096u128 << timeout.min(31);
    Some(Duration::from_nanos(
        u64::try_from(nanos).unwrap_or(u64::MAX),
    ))
}

/// The RNR NAK timer of a `min_rnr_timer` code, from the table of
/// `ibv_modify_qp(3)` (IBA 9.7.5.2.8): 0 is 655.36 ms, 1 is 0.01 ms, ...,
/// 12 is 0.64 ms, ..., 31 is 491.52 ms. Codes above 31 use their low 5 bits,
/// as the field is 5 bits wide.
pub fn rnr_nak_timer(code: u8) -> Duration {
    /// In units of 10 µs.
    const TABLE: [u32; 32] = [
        65536, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
        1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152,
    ];
    Duration::from_micros(u64::from(TABLE[usize::from(code & 31)]) * 10)
}

/// A handle on the virtual clock of a [`SimFabric`], from
/// [`SimFabric::clock`].
#[derive(Debug, Clone)]
pub struct SimClock {
    pub(crate) fabric: SimFabric,
}

impl SimClock {
    /// Virtual time since the fabric was made.
    pub fn now(&self) -> Duration {
        self.fabric.lock().clock.now
    }

    /// How the clock moves.
    pub fn mode(&self) -> ClockMode {
        self.fabric.lock().clock.mode
    }

    /// Sets how the clock moves; switching never moves it.
    pub fn set_mode(&self, mode: ClockMode) {
        self.fabric.lock().clock.mode = mode;
        self.fabric.cm_notify();
    }

    /// The round trip of an RDMA READ (zero by default: READs run at once).
    pub fn read_latency(&self) -> Duration {
        self.fabric.lock().clock.read_latency
    }

    /// Sets the round trip of RDMA READs posted from now on.
    pub fn set_read_latency(&self, latency: Duration) {
        self.fabric.lock().clock.read_latency = latency;
    }

    /// The earliest pending timer (an ACK timeout, an RNR wait, an
    /// outstanding READ, a CQ moderation period), if any, in virtual time:
    /// what a test on the Manual clock advances to. An engine parked on the
    /// fabric's fds on the Auto clock needs none: the fabric wakes them
    /// itself (see the [module docs](super) of the NIC).
    pub fn next_deadline(&self) -> Option<Duration> {
        let state = self.fabric.lock();
        let moderation = state
            .cqs
            .values()
            .filter_map(|cq| cq.lock().events.moderation_deadline(state.clock.mode))
            .min();
        match (state.next_deadline(), moderation) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Moves the clock forward by `by`, in either mode: every timer that
    /// falls due on the way fires at its deadline, in order, and what it
    /// makes runnable runs then. While the fabric is paused the clock still
    /// moves, but nothing runs: timers that passed fire when it resumes.
    ///
    /// Connection manager waits on the virtual clock (see below) whose
    /// deadline this passes end, with their timeout.
    pub fn advance(&self, by: Duration) {
        {
            let mut guard = self.fabric.lock();
            guard.advance(by);
            // CQ moderation periods that passed fire their events now (an
            // event is one-shot, so firing at the end of the advance rather
            // than at its deadline is the same to a poller).
            let state = &mut *guard;
            for (&id, cq) in &mut state.cqs {
                cq.ring().events.on_time(id, &state.clock);
            }
        }
        self.fabric.cm_notify();
    }
}

impl SimFabric {
    /// The fabric's virtual clock.
    pub fn clock(&self) -> SimClock {
        SimClock {
            fabric: self.clone(),
        }
    }

    /// Shorthand for `self.clock().advance(by)`.
    pub fn advance(&self, by: Duration) {
        self.clock().advance(by);
    }
}

impl super::SimContext {
    /// The virtual clock of the fabric this device is on.
    pub fn clock(&self) -> SimClock {
        self.fabric.clock()
    }
}

/// Why the head request of a send queue waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitCause {
    /// Sent, unanswered: retransmitted when the ACK timer expires.
    Ack,
    /// RNR-NAKed: retried when the RNR timer expires.
    Rnr,
}

/// A timer on the head request of a send queue.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wait {
    pub until: Duration,
    pub cause: WaitCause,
    /// During an RNR wait, when the retransmit timer armed at the request's
    /// last sending expires, if it runs through the wait
    /// ([`DeviceConfig::retransmit_timer_runs_during_rnr_wait`](super::DeviceConfig::retransmit_timer_runs_during_rnr_wait))
    /// and expires before `until`; `None` once it has.
    pub ack_at: Option<Duration>,
}

/// A request that has left the send queue without its completion queued
/// yet: a READ whose response is due, a large transfer whose bytes move
/// outside the fabric lock, or a later request that completed behind them
/// (completions of a send queue come in posting order).
pub(crate) enum Inflight {
    Read {
        wqe: super::state::SendWqe,
        due: Duration,
    },
    /// Checked; its bytes move outside the lock under `ticket`
    /// ([`Copies`](super::state::Copies)). The QP starts nothing else until
    /// `done` (its requests' bytes land in posting order, as an RC
    /// responder places them); the next progress completes it. `flushed`:
    /// its QP flushed while the copy ran; it completes with WR_FLUSH_ERR
    /// once `done`, and what is behind it with it.
    Moving {
        wqe: super::state::SendWqe,
        ticket: u64,
        done: bool,
        flushed: bool,
    },
    Done {
        wqe: super::state::SendWqe,
        status: hal_verbs::WcStatus,
    },
}

/// The time-dependent transport state of one RC QP (its timeout, retry
/// counts and RNR timer are what its transitions applied, `QpRecord::applied`).
#[derive(Default)]
pub(crate) struct QpTiming {
    /// Retransmissions of the head request after ACK timeouts.
    pub retries: u8,
    /// RNR NAKs the head request has received (not counted for 7).
    pub rnr_naks: u8,
    /// Whether the head request was sent once already (its faults drawn).
    pub attempted: bool,
    /// The head request's timer.
    pub wait: Option<Wait>,
    /// Outstanding READs and the completions queued behind them.
    pub inflight: std::collections::VecDeque<Inflight>,
}

impl QpTiming {
    /// The head request is done: its counters and timer go.
    pub fn next_request(&mut self) {
        self.retries = 0;
        self.rnr_naks = 0;
        self.attempted = false;
        self.wait = None;
    }

    /// How many READs are outstanding (a FENCEd request waits for none).
    pub fn reads_outstanding(&self) -> usize {
        self.inflight
            .iter()
            .filter(|entry| match entry {
                Inflight::Read { .. } => true,
                Inflight::Moving { wqe, done, .. } => {
                    !done && matches!(wqe.op, hal_verbs::SendOp::Read { .. })
                }
                Inflight::Done { .. } => false,
            })
            .count()
    }

    /// Whether bytes of a request of this QP are still moving outside the
    /// lock (nothing else of the QP starts meanwhile).
    pub fn moving(&self) -> bool {
        self.inflight
            .iter()
            .any(|entry| matches!(entry, Inflight::Moving { done: false, .. }))
    }

    /// When the first outstanding READ's response is due.
    pub fn read_due(&self) -> Option<Duration> {
        self.inflight.iter().find_map(|entry| match entry {
            Inflight::Read { due, .. } => Some(*due),
            Inflight::Moving { .. } | Inflight::Done { .. } => None,
        })
    }

    /// The earliest of the QP's timers.
    pub fn deadline(&self) -> Option<Duration> {
        let read = self.read_due();
        let wait = self
            .wait
            .map(|w| w.ack_at.map_or(w.until, |ack| ack.min(w.until)));
        match (wait, read) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}
