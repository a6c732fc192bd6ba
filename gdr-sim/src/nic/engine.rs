//! Execution of queued work requests, with the checks a real RC NIC makes
//! on both ends. Each request is first planned (checks, no side effect),
//! then applied (bytes moved, completions queued, QPs failed): a failed
//! check therefore never moves a byte.

use std::time::Duration;

use hal_verbs::{AccessFlags, QpState, SendFlags, SendOp, SgList, WcOpcode, WcStatus};
use smallvec::{SmallVec, smallvec};

use super::clock::{ClockMode, Inflight, Wait, WaitCause, ack_timeout, rnr_nak_timer};
use super::state::{Deferred, FabricState, MOVE_OUTSIDE_FROM, NicPtr, Piece, QpRecord, SendWqe};
use crate::faults::{Fault, FaultSite};

/// How the responder fails along with the requester.
pub(super) struct ResponderFailure {
    qpn: u32,
    /// Status of the receive the request consumed, if it got that far.
    recv_status: Option<WcStatus>,
}

pub(super) enum Plan {
    /// The head request needs a receive the peer has not posted (RNR).
    Blocked,
    /// No ready peer answers: the request is lost (ACK timeout).
    Unreachable,
    /// A scripted device loss.
    DeviceLost,
    /// A scripted CQ overrun ([`Fault::CqOverrun`]).
    CqOverrun,
    /// A scripted fatal QP error ([`Fault::QpFatal`]).
    QpFatal,
    /// The request completes in error; nothing moves; the QP (and the
    /// responder's, where it saw the request) goes to the error state.
    Fail {
        status: WcStatus,
        responder: Option<ResponderFailure>,
    },
    /// The request succeeds.
    Run {
        target: u32,
        copies: Pieces,
        /// The completion of the receive it consumes at the target.
        recv: Option<(WcOpcode, Option<u32>)>,
        len: u64,
    },
}

enum Step {
    Idle,
    Ran,
}

/// Why an SG entry cannot be used.
#[derive(Debug, Clone, Copy)]
enum SgFault {
    /// Its lkey names no MR of the QP's device and PD (or one without
    /// LOCAL_WRITE where the NIC writes).
    Key,
    /// It runs past its MR.
    Bounds,
}

/// Moves the bytes of a planned transfer.
///
/// # Safety
/// Every piece's source and destination were resolved, under the fabric
/// lock, inside a registration (or the queued request's own inline buffer,
/// still owned by its WQE), bounds-checked against it, and that
/// registration stays registered until this returns: the caller holds the
/// fabric lock, or the copy is counted in [`Copies::outside`](super::state::Copies)
/// since before the lock was let go (deregistration waits for that count).
pub(crate) unsafe fn copy_all(copies: &[Piece]) {
    for copy in copies {
        // SAFETY: the caller's: both ranges lie in memory that stays valid
        // while registered (the contract of `register`, or our own mapping
        // or backing). Ranges may overlap inside one process: `copy`
        // allows it.
        unsafe { std::ptr::copy(copy.src.0.cast_const(), copy.dst.0, copy.len) };
    }
}

/// The memory ranges of one side of a request (most have one or two).
type Segments = SmallVec<[(NicPtr, usize); 2]>;

/// The copies one request makes (most make one).
pub(crate) type Pieces = SmallVec<[Piece; 2]>;

/// Pairs a gather list with a scatter list, in order.
fn pair(src: &[(NicPtr, usize)], dst: &[(NicPtr, usize)]) -> Pieces {
    let mut copies = Pieces::new();
    let (mut s, mut d) = (src.iter().copied(), dst.iter().copied());
    let (mut cur_s, mut cur_d) = (s.next(), d.next());
    while let (Some((sp, sl)), Some((dp, dl))) = (cur_s, cur_d) {
        let len = sl.min(dl);
        if len > 0 {
            copies.push(Piece {
                src: sp,
                dst: dp,
                len,
            });
        }
        cur_s = if sl == len {
            s.next()
        } else {
            Some((NicPtr(sp.0.wrapping_add(len)), sl - len))
        };
        cur_d = if dl == len {
            d.next()
        } else {
            Some((NicPtr(dp.0.wrapping_add(len)), dl - len))
        };
    }
    copies
}

/// The shortest real time the NIC thread waits before it steps an RNR
/// wait ([`FabricState::nic_pace`]): RNR timers shorter than this (codes 1
/// to 8) run slower than real time when nobody polls, rather than spin.
pub(crate) const NIC_PACE_MIN: Duration = Duration::from_millis(1);

/// Bound on the clock jumps of one progress call in Auto mode (each ACK
/// timeout is one; retry counts are at most 6, so this is never reached in
/// practice).
const MAX_JUMPS: usize = 4096;

impl FabricState {
    /// Runs queued requests until none can run; returns how many ran. In
    /// Auto mode the clock moves first and on the way, as the `clock` module
    /// describes; in Manual mode it does not move.
    ///
    /// With `post_time` set (Auto mode only: the progress of a post, of an
    /// unpause, of the NIC thread after a copy) it is what a poll's would be,
    /// except that RNR waits stay the polls' (and the NIC thread's timed
    /// steps'): no NAK is recorded and no RNR timer moves, unless the
    /// receive a waiting request needs is there now (it is retried at its
    /// deadline). So a post completes what it can at once, and a caller
    /// that counts RNR retries per poll counts what it counted before posts
    /// made progress.
    pub fn progress(&mut self) -> usize {
        if self.paused {
            return 0;
        }
        if self.clock.mode == ClockMode::Manual {
            return self.run();
        }
        let post = self.post_time;
        if !post {
            self.polled_now(false);
        }
        // One RNR period per call, and only one that was pending already
        // (not one that has passed: its retry is due now); none at a post.
        let now = self.clock.now;
        let mut rnr_jump = !post
            && self.busy_qps().any(|(_, qp)| {
                qp.timing
                    .wait
                    .is_some_and(|wait| wait.cause == WaitCause::Rnr && wait.until > now)
            });
        let mut ran = self.run();
        for _ in 0..MAX_JUMPS {
            let next = if post {
                self.next_timer_at_post()
            } else {
                self.next_timer()
            };
            let Some((at, rnr)) = next else {
                break;
            };
            if rnr && !post {
                if !rnr_jump {
                    break;
                }
                rnr_jump = false;
            }
            self.clock.now = self.clock.now.max(at);
            ran += self.run();
        }
        ran
    }

    /// Moves the clock by `by`, firing every timer on the way at its
    /// deadline (nothing runs while paused).
    pub fn advance(&mut self, by: Duration) {
        let target = self.clock.now.saturating_add(by);
        if !self.paused {
            self.run();
            for _ in 0..MAX_JUMPS * 64 {
                match self.next_timer() {
                    Some((at, _)) if at <= target => {
                        self.clock.now = self.clock.now.max(at);
                        self.run();
                    }
                    _ => break,
                }
            }
        }
        self.clock.now = target;
        if !self.paused {
            self.run();
        }
    }

    /// The earliest pending timer, and whether it is an RNR wait.
    pub fn next_timer(&self) -> Option<(Duration, bool)> {
        self.busy_qps()
            .map(|(_, qp)| qp)
            .filter(|qp| qp.state == QpState::ReadyToSend && !self.devices[qp.device].lost)
            .filter_map(|qp| {
                let deadline = qp.timing.deadline()?;
                let rnr = qp
                    .timing
                    .wait
                    .is_some_and(|w| w.until == deadline && w.cause == WaitCause::Rnr);
                Some((deadline, rnr))
            })
            .min()
    }

    /// The earliest timer a post's progress may run to: every timer but
    /// those of a QP whose head still waits for a receive (its READs'
    /// responses excepted); an RNR wait whose receive has come is one.
    fn next_timer_at_post(&self) -> Option<(Duration, bool)> {
        self.busy_qps()
            .filter(|(_, qp)| qp.state == QpState::ReadyToSend && !self.devices[qp.device].lost)
            .filter_map(|(&qpn, qp)| {
                if self.blocked_on_rnr(qpn) {
                    return qp.timing.read_due().map(|due| (due, false));
                }
                qp.timing.deadline().map(|at| (at, false))
            })
            .min()
    }

    /// How long the NIC thread waits, in real time without a poll, before
    /// it steps the fabric as a poll would, when a parked waiter needs it:
    /// a QP whose send CQ is armed (someone waits on its channel) has an
    /// RNR wait pending, or a head blocked on RNR not yet NAKed (a post
    /// records no NAK). The wait's remaining virtual time, so one RNR
    /// period of virtual time passes per RNR timer of real time, and at
    /// least [`NIC_PACE_MIN`]. `None`: nothing needs it (paused, the Manual
    /// clock, no such QP), as then only polls or the test move time.
    pub fn nic_pace(&self) -> Option<Duration> {
        if self.paused || self.clock.mode != ClockMode::Auto {
            return None;
        }
        let now = self.clock.now;
        self.busy_qps()
            .filter(|(_, qp)| qp.state == QpState::ReadyToSend && !self.devices[qp.device].lost)
            .filter(|(_, qp)| {
                self.cqs.get(&qp.send_cq).is_some_and(|cq| {
                    let ring = cq.lock();
                    ring.events.armed.is_some() && ring.events.channel.is_some()
                })
            })
            .filter_map(|(&qpn, qp)| match qp.timing.wait {
                Some(wait) if wait.cause == WaitCause::Rnr => {
                    let at = qp.timing.deadline().unwrap_or(wait.until);
                    Some(at.saturating_sub(now))
                }
                Some(_) => None,
                None => self.blocked_on_rnr(qpn).then_some(Duration::ZERO),
            })
            .min()
            .map(|pace| pace.max(NIC_PACE_MIN))
    }

    /// The earliest pending timer.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.next_timer().map(|(at, _)| at)
    }

    /// Runs everything runnable at the current time.
    fn run(&mut self) -> usize {
        let mut ran = 0;
        let mut qpns = Vec::new();
        loop {
            let before = ran;
            // The QPs at work, in QPN order (an idle QP's step does
            // nothing: it is skipped, not visited).
            qpns.clear();
            qpns.extend(self.busy.iter().copied());
            for &qpn in &qpns {
                while let Step::Ran = self.step(qpn) {
                    ran += 1;
                }
            }
            if ran == before {
                break;
            }
        }
        let qps = &self.qps;
        self.busy
            .retain(|qpn| qps.get(qpn).is_some_and(|qp| !qp.is_idle()));
        ran
    }

    /// The QPs that may have work ([`FabricState::busy`]), in QPN order.
    fn busy_qps(&self) -> impl Iterator<Item = (&u32, &QpRecord)> + '_ {
        self.busy
            .iter()
            .filter_map(|qpn| self.qps.get_key_value(qpn))
    }

    /// The head request was RNR-NAKed: wait the responder's RNR timer, or
    /// fail it once `rnr_retry` retries were NAKed too (7: never).
    fn rnr_nak(&mut self, qpn: u32) -> Step {
        let now = self.clock.now;
        let code = self
            .peer_of(qpn)
            .and_then(|peer| self.qps.get(&peer))
            .map_or(0, |peer| peer.applied.min_rnr_timer);
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return Step::Idle;
        };
        let rnr_retry = qp.applied.rnr_retry;
        let timing = &mut qp.timing;
        if rnr_retry != 7 && timing.rnr_naks >= rnr_retry {
            tracing::debug!(qpn, "sim: RNR retries exhausted");
            self.fail_head(qpn, WcStatus::RNR_RETRY_EXC_ERR, None);
            return Step::Ran;
        }
        if rnr_retry != 7 {
            timing.rnr_naks += 1;
        }
        let until = now.saturating_add(rnr_nak_timer(code));
        // The retransmit timer armed when the request was sent, if it runs
        // through the wait (rxe) and expires within it.
        let ack_at = if self.devices[qp.device]
            .config
            .retransmit_timer_runs_during_rnr_wait
        {
            ack_timeout(qp.applied.timeout)
                .map(|timeout| now.saturating_add(timeout))
                .filter(|&at| at < until)
        } else {
            None
        };
        qp.timing.wait = Some(Wait {
            until,
            cause: WaitCause::Rnr,
            ack_at,
        });
        Step::Idle
    }

    /// Completes a request of `qpn` that left its send queue: at once, or
    /// behind the READs still outstanding before it.
    fn finish(&mut self, qpn: u32, wqe: SendWqe, status: WcStatus) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        if qp.timing.inflight.is_empty() {
            self.complete_send(qpn, &wqe, status);
        } else {
            qp.timing.inflight.push_back(Inflight::Done { wqe, status });
        }
    }

    /// Fails the head request of `qpn` (and the responder where it saw it);
    /// both QPs go to the error state.
    fn fail_head(&mut self, qpn: u32, status: WcStatus, responder: Option<ResponderFailure>) {
        let Some(wqe) = self.qps.get_mut(&qpn).and_then(|qp| {
            qp.timing.next_request();
            qp.sq.pop_front()
        }) else {
            return;
        };
        tracing::debug!(qpn, wr_id = wqe.wr_id, %status, "sim: request failed");
        self.finish(qpn, wqe, status);
        self.fail_responder(responder);
        self.set_error(qpn);
    }

    fn fail_responder(&mut self, responder: Option<ResponderFailure>) {
        let Some(responder) = responder else {
            return;
        };
        if let Some(status) = responder.recv_status {
            let recv = self
                .qps
                .get_mut(&responder.qpn)
                .and_then(|peer| peer.rq.pop_front());
            if let Some(recv) = recv {
                self.complete_recv(responder.qpn, &recv, status, WcOpcode::Recv, 0, None);
            }
        }
        self.set_error(responder.qpn);
    }

    /// The READ at the front of `qpn`'s outstanding requests is due: its
    /// response arrives (the responder's memory is read now).
    fn finish_read(&mut self, qpn: u32) -> Step {
        let Some(Inflight::Read { wqe, .. }) = self
            .qps
            .get_mut(&qpn)
            .and_then(|qp| qp.timing.inflight.pop_front())
        else {
            return Step::Idle;
        };
        let plan = self
            .qps
            .get(&qpn)
            .and_then(|qp| self.plan_transfer(qpn, qp, &wqe));
        match plan {
            Some(Plan::Run { copies, .. }) => {
                self.copy_in_lock(&copies);
                self.complete_send(qpn, &wqe, WcStatus::SUCCESS);
            }
            Some(Plan::Fail { status, responder }) => {
                self.complete_send(qpn, &wqe, status);
                self.fail_responder(responder);
                self.set_error(qpn);
            }
            // The responder went away while the READ was outstanding: its
            // response never comes (simplified: no retransmission of the
            // READ, it fails at once).
            _ => {
                self.complete_send(qpn, &wqe, WcStatus::RETRY_EXC_ERR);
                self.set_error(qpn);
            }
        }
        Step::Ran
    }

    /// The connected, ready peer of `qpn`, if its packets would be accepted:
    /// the peer QP exists on the resolved device, is in RTR or RTS, is
    /// connected back to us and expects our first PSN. Anything else is a
    /// silent drop on a real fabric, hence retries and RETRY_EXC_ERR.
    pub(super) fn peer_of(&self, qpn: u32) -> Option<u32> {
        let qp = self.qps.get(&qpn)?;
        let remote = qp.remote?;
        if self.devices[remote.device].lost {
            return None;
        }
        // A port that is not ACTIVE (its link is down) sends and receives
        // nothing: the requester retries until RETRY_EXC_ERR.
        let down = |d: usize| self.devices[d].config.port_state != hal_verbs::PortState::Active;
        if down(qp.device) || down(remote.device) {
            return None;
        }
        let peer = self.qps.get(&remote.qpn)?;
        let back = peer.remote?;
        let ready = matches!(peer.state, QpState::ReadyToReceive | QpState::ReadyToSend);
        (peer.device == remote.device
            && ready
            && back.device == qp.device
            && back.qpn == qpn
            && back.rq_psn == qp.sq_psn)
            .then_some(remote.qpn)
    }

    fn blocked_on_rnr(&self, qpn: u32) -> bool {
        let Some(qp) = self.qps.get(&qpn) else {
            return false;
        };
        let needs_recv = qp.sq.front().is_some_and(|w| {
            matches!(
                w.op,
                SendOp::Send | SendOp::SendWithImm { .. } | SendOp::WriteWithImm { .. }
            )
        });
        qp.state == QpState::ReadyToSend
            && needs_recv
            && self
                .peer_of(qpn)
                .is_some_and(|peer| self.qps[&peer].rq.is_empty())
    }

    /// The local pieces of an SG list: each lkey must name an MR of this
    /// device and PD (with LOCAL_WRITE where the NIC writes), else
    /// [`SgFault::Key`], covering the entry, else [`SgFault::Bounds`].
    fn segments(&self, qp: &QpRecord, sg_list: &SgList, write: bool) -> Result<Segments, SgFault> {
        let mut out = Segments::new();
        for sge in sg_list.iter().filter(|s| s.length > 0) {
            let mr = self
                .mrs
                .get(&sge.lkey)
                .filter(|mr| mr.device == qp.device && mr.pd == qp.pd)
                .filter(|mr| !write || mr.access.contains(AccessFlags::LOCAL_WRITE))
                .ok_or(SgFault::Key)?;
            let ptr = mr
                .resolve(sge.addr, u64::from(sge.length))
                .ok_or(SgFault::Bounds)?;
            out.push((ptr, sge.length as usize));
        }
        Ok(out)
    }

    /// The target memory of a one-sided operation: the rkey must name an MR
    /// of the target's device and PD, with `right`, covering the range.
    fn remote(
        &self,
        target: &QpRecord,
        rkey: u32,
        addr: u64,
        len: u64,
        right: AccessFlags,
    ) -> Option<Segments> {
        if len == 0 {
            // Zero-length RDMA carries no key check (IBA 9.7.5.1.3).
            return Some(Segments::new());
        }
        let mr = self.mrs.get(self.rkeys.get(&rkey)?)?;
        if mr.device != target.device || mr.pd != target.pd || !mr.access.contains(right) {
            return None;
        }
        Some(smallvec![(mr.resolve(addr, len)?, len as usize)])
    }

    fn plan(&self, qpn: u32) -> Option<Plan> {
        let qp = self.qps.get(&qpn)?;
        let wqe = qp.sq.front()?;
        if self.blocked_on_rnr(qpn) {
            return Some(Plan::Blocked);
        }
        // From here the request is sent, once per request as far as the
        // fault plan is concerned (retransmissions draw no faults).
        if !qp.timing.attempted {
            match self.faults.hit(FaultSite::VerbsCompletion) {
                Some(Fault::DeviceLost) => return Some(Plan::DeviceLost),
                Some(Fault::CqOverrun) => return Some(Plan::CqOverrun),
                Some(Fault::QpFatal) => return Some(Plan::QpFatal),
                Some(Fault::CompletionStatus(status)) => {
                    return Some(Plan::Fail {
                        status,
                        responder: None,
                    });
                }
                Some(Fault::Verbs(error)) => {
                    tracing::debug!(%error, "sim: verbs error scripted at a completion");
                    return Some(Plan::Fail {
                        status: WcStatus::GENERAL_ERR,
                        responder: None,
                    });
                }
                Some(Fault::Cuda(_) | Fault::Slow(_)) | None => {}
            }
        }
        if let Some(status) = wqe.forced {
            return Some(Plan::Fail {
                status,
                responder: None,
            });
        }
        self.plan_transfer(qpn, qp, wqe)
    }

    /// The checks of both ends for `wqe` of `qpn`, and what it moves.
    pub(super) fn plan_transfer(&self, qpn: u32, qp: &QpRecord, wqe: &SendWqe) -> Option<Plan> {
        let fail = |status, responder| Some(Plan::Fail { status, responder });
        let len = wqe.byte_len();
        let config = &self.devices[qp.device].config;
        // The local side first: a bad lkey fails before anything is sent.
        let local = match &wqe.inline {
            Some(data) => smallvec![(NicPtr(data.as_ptr().cast_mut()), data.len())],
            None => {
                let is_read = matches!(wqe.op, SendOp::Read { .. });
                match self.segments(qp, &wqe.sg_list, is_read) {
                    Ok(segments) => segments,
                    // A gather whose key is unusable: the device's status
                    // (rxe: LOC_QP_OP_ERR). Everything else, and the
                    // scatter of a READ, is a local protection error.
                    Err(SgFault::Key) if !is_read => {
                        return fail(config.gather_fault_status, None);
                    }
                    Err(_) => return fail(WcStatus::LOC_PROT_ERR, None),
                }
            }
        };
        if config.link_down_fails_locally && config.port_state != hal_verbs::PortState::Active {
            // rxe cannot transmit on a netdev that is down.
            return fail(WcStatus::LOC_QP_OP_ERR, None);
        }
        let Some(target) = self.peer_of(qpn) else {
            return Some(Plan::Unreachable);
        };
        let peer = &self.qps[&target];
        let responder = |recv_status| {
            Some(ResponderFailure {
                qpn: target,
                recv_status,
            })
        };
        let (copies, recv) = match wqe.op {
            SendOp::Write { remote_addr, rkey }
            | SendOp::WriteWithImm {
                remote_addr, rkey, ..
            } => {
                if !peer.access.contains(AccessFlags::REMOTE_WRITE) {
                    return fail(WcStatus::REM_INV_REQ_ERR, responder(None));
                }
                let right = AccessFlags::REMOTE_WRITE;
                let Some(dst) = self.remote(peer, rkey, remote_addr, len, right) else {
                    return fail(WcStatus::REM_ACCESS_ERR, responder(None));
                };
                let recv = match wqe.op {
                    SendOp::WriteWithImm { imm, .. } => {
                        Some((WcOpcode::RecvRdmaWithImm, Some(imm)))
                    }
                    _ => None,
                };
                (pair(&local, &dst), recv)
            }
            SendOp::Read { remote_addr, rkey } => {
                if !peer.access.contains(AccessFlags::REMOTE_READ) {
                    return fail(WcStatus::REM_INV_REQ_ERR, responder(None));
                }
                let right = AccessFlags::REMOTE_READ;
                let Some(src) = self.remote(peer, rkey, remote_addr, len, right) else {
                    return fail(WcStatus::REM_ACCESS_ERR, responder(None));
                };
                (pair(&src, &local), None)
            }
            SendOp::Send | SendOp::SendWithImm { .. } => {
                let recv_wqe = peer.rq.front()?;
                // The responder's device decides what its receive says, and
                // the NAK that the requester's status comes from.
                let peer_config = &self.devices[peer.device].config;
                let dst = match self.segments(peer, &recv_wqe.sg_list, true) {
                    Ok(dst) => dst,
                    // The responder's own error (mlx5: local protection;
                    // rxe: a malformed WQE); the requester is told "remote
                    // operational error".
                    Err(_) => {
                        let status = peer_config.receive_fault_status;
                        return fail(WcStatus::REM_OP_ERR, responder(Some(status)));
                    }
                };
                let room: u64 = dst.iter().map(|&(_, l)| l as u64).sum();
                if room < len {
                    let (requester, receive) = peer_config.receive_too_small_status;
                    return fail(requester, responder(Some(receive)));
                }
                let imm = match wqe.op {
                    SendOp::SendWithImm { imm } => Some(imm),
                    _ => None,
                };
                (pair(&local, &dst), Some((WcOpcode::Recv, imm)))
            }
        };
        Some(Plan::Run {
            target,
            copies,
            recv,
            len,
        })
    }

    /// Executes what `qpn` can do now: the front of its outstanding
    /// requests, else its head request, if it can run.
    fn step(&mut self, qpn: u32) -> Step {
        let now = self.clock.now;
        let Some(qp) = self.qps.get(&qpn) else {
            return Step::Idle;
        };
        let device = qp.device;
        if qp.state != QpState::ReadyToSend || self.devices[device].lost {
            return Step::Idle;
        }
        match qp.timing.inflight.front() {
            Some(Inflight::Moving { done: true, .. }) => {
                if let Some(Inflight::Moving { wqe, flushed, .. }) = self
                    .qps
                    .get_mut(&qpn)
                    .and_then(|qp| qp.timing.inflight.pop_front())
                {
                    let status = if flushed {
                        WcStatus::WR_FLUSH_ERR
                    } else {
                        WcStatus::SUCCESS
                    };
                    self.complete_send(qpn, &wqe, status);
                }
                return Step::Ran;
            }
            Some(Inflight::Done { .. }) => {
                if let Some(Inflight::Done { wqe, status }) = self
                    .qps
                    .get_mut(&qpn)
                    .and_then(|qp| qp.timing.inflight.pop_front())
                {
                    self.complete_send(qpn, &wqe, status);
                }
                return Step::Ran;
            }
            Some(Inflight::Read { due, .. }) if *due <= now => return self.finish_read(qpn),
            _ => {}
        }
        let Some(head) = qp.sq.front() else {
            return Step::Idle;
        };
        if qp.timing.moving() {
            // Bytes of an earlier request are still landing: nothing later
            // of this QP starts before they have.
            return Step::Idle;
        }
        let reads = qp.timing.reads_outstanding();
        if head.flags.contains(SendFlags::FENCE) && reads > 0 {
            return Step::Idle;
        }
        if matches!(head.op, SendOp::Read { .. }) && reads > 0 {
            // The initiator depth, and the responder's resources.
            let responder = qp
                .remote
                .and_then(|remote| self.qps.get(&remote.qpn))
                .map_or(u8::MAX, |peer| peer.applied.max_dest_rd_atomic);
            let depth = qp.applied.max_rd_atomic.min(responder).max(1);
            if reads >= usize::from(depth) {
                return Step::Idle;
            }
        }
        if self.post_time && self.blocked_on_rnr(qpn) {
            // A post leaves RNR waits to polls and the NIC thread
            // (`post_time`).
            return Step::Idle;
        }
        if let Some(mut wait) = qp.timing.wait {
            if let Some(ack_at) = wait.ack_at.filter(|&at| now >= at) {
                // The retransmit timer expired during an RNR wait (rxe): a
                // transport retry, or the last one.
                let Some(qp) = self.qps.get_mut(&qpn) else {
                    return Step::Idle;
                };
                if qp.timing.retries >= qp.applied.retry_cnt {
                    tracing::debug!(
                        qpn,
                        ?ack_at,
                        "sim: transport retries exhausted in an RNR wait"
                    );
                    qp.timing.wait = None;
                    self.fail_head(qpn, WcStatus::RETRY_EXC_ERR, None);
                    return Step::Ran;
                }
                // Counted; armed again only when the request is resent.
                qp.timing.retries += 1;
                wait.ack_at = None;
                qp.timing.wait = Some(wait);
            }
            if now < wait.until {
                return Step::Idle;
            }
            let Some(qp) = self.qps.get_mut(&qpn) else {
                return Step::Idle;
            };
            qp.timing.wait = None;
            if wait.cause == WaitCause::Ack {
                if qp.timing.retries >= qp.applied.retry_cnt {
                    tracing::debug!(qpn, "sim: transport retries exhausted");
                    self.fail_head(qpn, WcStatus::RETRY_EXC_ERR, None);
                    return Step::Ran;
                }
                qp.timing.retries += 1;
            }
        }
        let Some(plan) = self.plan(qpn) else {
            return Step::Idle;
        };
        match plan {
            Plan::Blocked => return self.rnr_nak(qpn),
            Plan::Unreachable => {
                if let Some(qp) = self.qps.get_mut(&qpn) {
                    qp.timing.attempted = true;
                    // Timeout 0 (refused by the HAL) is "no timer": the
                    // request is retried whenever the fabric progresses.
                    qp.timing.wait = ack_timeout(qp.applied.timeout).map(|timeout| Wait {
                        until: now.saturating_add(timeout),
                        cause: WaitCause::Ack,
                        ack_at: None,
                    });
                }
                return Step::Idle;
            }
            Plan::DeviceLost => self.lose_device(device),
            Plan::CqOverrun => {
                let cq = self.qps.get(&qpn).map(|qp| qp.send_cq);
                if let Some(cq) = cq {
                    self.overrun(cq);
                }
                self.set_error(qpn);
            }
            Plan::QpFatal => {
                let event = hal_verbs::AsyncEvent::QpFatal { qp_num: qpn };
                self.events.raise(device, event, &self.qps);
                self.set_error(qpn);
            }
            Plan::Fail { status, responder } => self.fail_head(qpn, status, responder),
            Plan::Run {
                target,
                copies,
                recv,
                len,
            } => {
                let latency = self.clock.read_latency;
                let defer = self.copies.defer;
                let Some(qp) = self.qps.get_mut(&qpn) else {
                    return Step::Idle;
                };
                qp.timing.next_request();
                let Some(wqe) = qp.sq.pop_front() else {
                    return Step::Idle;
                };
                if matches!(wqe.op, SendOp::Read { .. }) && !latency.is_zero() {
                    // Sent; the response (and the memory read) comes later.
                    let due = now.saturating_add(latency);
                    qp.timing.inflight.push_back(Inflight::Read { wqe, due });
                    return Step::Ran;
                }
                let one_sided = matches!(wqe.op, SendOp::Write { .. } | SendOp::Read { .. });
                if defer
                    && one_sided
                    && recv.is_none()
                    && wqe.inline.is_none()
                    && len >= MOVE_OUTSIDE_FROM
                {
                    // Checked; its bytes move outside the lock, before the
                    // poll running this lets the lock go (`Copies`).
                    let ticket = self.copies.next_ticket;
                    self.copies.next_ticket += 1;
                    qp.timing.inflight.push_back(Inflight::Moving {
                        wqe,
                        ticket,
                        done: false,
                        flushed: false,
                    });
                    self.copies.deferred.push(Deferred {
                        ticket,
                        qpn,
                        pieces: copies.into_vec(),
                    });
                    return Step::Ran;
                }
                self.copy_in_lock(&copies);
                let solicited = wqe.flags.contains(hal_verbs::SendFlags::SOLICITED);
                self.finish(qpn, wqe, WcStatus::SUCCESS);
                if let Some((opcode, imm)) = recv {
                    let consumed = self.qps.get_mut(&target).and_then(|p| p.rq.pop_front());
                    if let Some(recv_wqe) = consumed {
                        // Read by the receive CQ's solicited-only notify.
                        self.events.solicited_hint = solicited;
                        self.complete_recv(target, &recv_wqe, WcStatus::SUCCESS, opcode, len, imm);
                    }
                }
            }
        }
        Step::Ran
    }
}

impl FabricState {
    /// Moves the bytes of a transfer planned just now, under the lock.
    pub(super) fn copy_in_lock(&self, copies: &[Piece]) {
        #[cfg(test)]
        if let Some(hook) = &self.copy_hook {
            hook(copies.iter().map(|p| p.len).sum());
        }
        // SAFETY: planned by the caller under the lock it still holds (the
        // `&self` borrows the state behind it): every registration the
        // pieces lie in is registered until it lets the lock go.
        unsafe { copy_all(copies) };
    }

    /// Takes every deferred copy to run outside the lock: each is planned
    /// and counted in `outside` before the lock is let go.
    pub(crate) fn plan_copies(&mut self) -> Vec<Deferred> {
        let batch = std::mem::take(&mut self.copies.deferred);
        for deferred in &batch {
            self.copies.planned.insert(deferred.ticket);
        }
        self.copies.outside += batch.len();
        batch
    }

    /// The copies of `done` (tickets and QPNs) have finished: they are no
    /// longer counted, their transfers are done, and a flushed QP's
    /// requests held behind them complete (a ready QP's complete in its
    /// next progress).
    pub(crate) fn copies_done(&mut self, done: &[(u64, u32)]) {
        for &(ticket, qpn) in done {
            if self.copies.planned.remove(&ticket) {
                self.copies.outside -= 1;
            }
            let Some(qp) = self.qps.get_mut(&qpn) else {
                // Destroyed meanwhile: nobody is told.
                continue;
            };
            for entry in &mut qp.timing.inflight {
                if let Inflight::Moving {
                    ticket: t, done, ..
                } = entry
                    && *t == ticket
                {
                    *done = true;
                }
            }
            self.settle_flushed(qpn);
        }
    }

    /// Completes, in order, what a flush of `qpn` left behind copies that
    /// have finished since.
    fn settle_flushed(&mut self, qpn: u32) {
        loop {
            let Some(qp) = self.qps.get_mut(&qpn) else {
                return;
            };
            let (wqe, status) = match qp.timing.inflight.front() {
                Some(Inflight::Moving {
                    done: true,
                    flushed: true,
                    ..
                }) => match qp.timing.inflight.pop_front() {
                    Some(Inflight::Moving { wqe, .. }) => (wqe, WcStatus::WR_FLUSH_ERR),
                    _ => return,
                },
                // Behind a flushed transfer (a ready QP's are completed by
                // its progress instead).
                Some(Inflight::Done { .. }) if qp.state == QpState::Error => {
                    match qp.timing.inflight.pop_front() {
                        Some(Inflight::Done { wqe, status }) => (wqe, status),
                        _ => return,
                    }
                }
                _ => return,
            };
            self.complete_send(qpn, &wqe, status);
        }
    }
}
