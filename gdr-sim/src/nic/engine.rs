//! Execution of queued work requests, with the checks a real RC NIC makes
//! on both ends. Each request is first planned (checks, no side effect),
//! then applied (bytes moved, completions queued, QPs failed): a failed
//! check therefore never moves a byte.

use std::collections::BTreeSet;

use hal_verbs::{AccessFlags, QpState, SendOp, SgList, WcOpcode, WcStatus};

use super::state::{FabricState, NicPtr, QpRecord};
use crate::faults::{Fault, FaultSite};

/// One contiguous piece of a transfer.
struct Piece {
    src: NicPtr,
    dst: NicPtr,
    len: usize,
}

/// How the responder fails along with the requester.
struct ResponderFailure {
    qpn: u32,
    /// Status of the receive the request consumed, if it got that far.
    recv_status: Option<WcStatus>,
}

enum Plan {
    /// The head request needs a receive the peer has not posted (RNR).
    Blocked,
    /// A scripted device loss.
    DeviceLost,
    /// The request completes in error; nothing moves; the QP (and the
    /// responder's, where it saw the request) goes to the error state.
    Fail {
        status: WcStatus,
        responder: Option<ResponderFailure>,
    },
    /// The request succeeds.
    Run {
        target: u32,
        copies: Vec<Piece>,
        /// The completion of the receive it consumes at the target.
        recv: Option<(WcOpcode, Option<u32>)>,
        len: u64,
    },
}

enum Step {
    Idle,
    Blocked,
    Ran,
}

type Segments = Vec<(NicPtr, usize)>;

/// Pairs a gather list with a scatter list, in order.
fn pair(src: &[(NicPtr, usize)], dst: &[(NicPtr, usize)]) -> Vec<Piece> {
    let mut copies = Vec::new();
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

impl FabricState {
    /// Runs queued requests until none can run; returns how many ran.
    pub fn progress(&mut self) -> usize {
        if self.paused {
            return 0;
        }
        let mut ran = 0;
        let mut blocked = BTreeSet::new();
        loop {
            let before = ran;
            let qpns: Vec<u32> = self.qps.keys().copied().collect();
            for qpn in qpns {
                loop {
                    match self.step(qpn) {
                        Step::Ran => ran += 1,
                        Step::Blocked => {
                            blocked.insert(qpn);
                            break;
                        }
                        Step::Idle => break,
                    }
                }
            }
            if ran == before {
                break;
            }
        }
        // Each progress call is one RNR retry of every request still waiting
        // for a receive (nothing posts receives during progress).
        for qpn in blocked {
            self.rnr_wait(qpn);
        }
        ran
    }

    fn rnr_wait(&mut self, qpn: u32) {
        if !self.blocked_on_rnr(qpn) {
            return;
        }
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        qp.rnr_waits += 1;
        // rnr_retry 7 retries forever, as the spec says.
        if qp.rnr_retry == 7 || qp.rnr_waits <= u32::from(qp.rnr_retry) {
            return;
        }
        qp.rnr_waits = 0;
        if let Some(wqe) = qp.sq.pop_front() {
            tracing::debug!(qpn, wr_id = wqe.wr_id, "sim: RNR retries exhausted");
            self.complete_send(qpn, &wqe, WcStatus::RNR_RETRY_EXC_ERR);
        }
        self.set_error(qpn);
    }

    /// The connected, ready peer of `qpn`, if its packets would be accepted:
    /// the peer QP exists on the resolved device, is in RTR or RTS, is
    /// connected back to us and expects our first PSN. Anything else is a
    /// silent drop on a real fabric, hence retries and RETRY_EXC_ERR.
    fn peer_of(&self, qpn: u32) -> Option<u32> {
        let qp = self.qps.get(&qpn)?;
        let remote = qp.remote?;
        if self.devices[remote.device].lost {
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
    /// device and PD covering the entry (with LOCAL_WRITE where the NIC
    /// writes), else LOC_PROT_ERR.
    fn segments(&self, qp: &QpRecord, sg_list: &SgList, write: bool) -> Result<Segments, WcStatus> {
        let mut out = Vec::with_capacity(sg_list.len());
        for sge in sg_list.iter().filter(|s| s.length > 0) {
            let mr = self
                .mrs
                .get(&sge.lkey)
                .filter(|mr| mr.device == qp.device && mr.pd == qp.pd)
                .filter(|mr| !write || mr.access.contains(AccessFlags::LOCAL_WRITE))
                .ok_or(WcStatus::LOC_PROT_ERR)?;
            let ptr = mr
                .resolve(sge.addr, u64::from(sge.length))
                .ok_or(WcStatus::LOC_PROT_ERR)?;
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
            return Some(Vec::new());
        }
        let mr = self.mrs.get(self.rkeys.get(&rkey)?)?;
        if mr.device != target.device || mr.pd != target.pd || !mr.access.contains(right) {
            return None;
        }
        Some(vec![(mr.resolve(addr, len)?, len as usize)])
    }

    fn plan(&self, qpn: u32) -> Option<Plan> {
        let qp = self.qps.get(&qpn)?;
        let wqe = qp.sq.front()?;
        if self.blocked_on_rnr(qpn) {
            return Some(Plan::Blocked);
        }
        // From here the request executes and produces a completion.
        match self.faults.hit(FaultSite::VerbsCompletion) {
            Some(Fault::DeviceLost) => return Some(Plan::DeviceLost),
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
            Some(Fault::Cuda(_)) | None => {}
        }
        if let Some(status) = wqe.forced {
            return Some(Plan::Fail {
                status,
                responder: None,
            });
        }
        let fail = |status, responder| Some(Plan::Fail { status, responder });
        let len = wqe.byte_len();
        // The local side first: a bad lkey fails before anything is sent.
        let local = match &wqe.inline {
            Some(data) => vec![(NicPtr(data.as_ptr().cast_mut()), data.len())],
            None => {
                let is_read = matches!(wqe.op, SendOp::Read { .. });
                match self.segments(qp, &wqe.sg_list, is_read) {
                    Ok(segments) => segments,
                    Err(status) => return fail(status, None),
                }
            }
        };
        let Some(target) = self.peer_of(qpn) else {
            return fail(WcStatus::RETRY_EXC_ERR, None);
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
                let dst = match self.segments(peer, &recv_wqe.sg_list, true) {
                    Ok(dst) => dst,
                    // The responder's own protection error; the requester is
                    // told "remote operational error".
                    Err(status) => return fail(WcStatus::REM_OP_ERR, responder(Some(status))),
                };
                let room: u64 = dst.iter().map(|&(_, l)| l as u64).sum();
                if room < len {
                    return fail(
                        WcStatus::REM_INV_REQ_ERR,
                        responder(Some(WcStatus::LOC_LEN_ERR)),
                    );
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

    /// Executes the head request of `qpn`, if it can run.
    fn step(&mut self, qpn: u32) -> Step {
        let Some(qp) = self.qps.get(&qpn) else {
            return Step::Idle;
        };
        let device = qp.device;
        if qp.state != QpState::ReadyToSend || qp.sq.is_empty() || self.devices[device].lost {
            return Step::Idle;
        }
        let Some(plan) = self.plan(qpn) else {
            return Step::Idle;
        };
        match plan {
            Plan::Blocked => return Step::Blocked,
            Plan::DeviceLost => self.lose_device(device),
            Plan::Fail { status, responder } => {
                let Some(wqe) = self.qps.get_mut(&qpn).and_then(|qp| qp.sq.pop_front()) else {
                    return Step::Idle;
                };
                tracing::debug!(qpn, wr_id = wqe.wr_id, %status, "sim: request failed");
                self.complete_send(qpn, &wqe, status);
                if let Some(responder) = responder {
                    if let Some(status) = responder.recv_status {
                        let recv = self
                            .qps
                            .get_mut(&responder.qpn)
                            .and_then(|peer| peer.rq.pop_front());
                        if let Some(recv) = recv {
                            self.complete_recv(
                                responder.qpn,
                                &recv,
                                status,
                                WcOpcode::Recv,
                                0,
                                None,
                            );
                        }
                    }
                    self.set_error(responder.qpn);
                }
                self.set_error(qpn);
            }
            Plan::Run {
                target,
                copies,
                recv,
                len,
            } => {
                for copy in &copies {
                    // SAFETY: every source and destination was resolved just
                    // now inside a live registration (or the queued request's
                    // own inline buffer, still queued), bounds-checked against
                    // it; registered memory stays valid while registered (the
                    // contract of `register`, or our own mapping/backing).
                    // Ranges may overlap inside one process: `copy` allows it.
                    unsafe { std::ptr::copy(copy.src.0.cast_const(), copy.dst.0, copy.len) };
                }
                let Some(wqe) = self.qps.get_mut(&qpn).and_then(|qp| {
                    qp.rnr_waits = 0;
                    qp.sq.pop_front()
                }) else {
                    return Step::Idle;
                };
                self.complete_send(qpn, &wqe, WcStatus::SUCCESS);
                if let Some((opcode, imm)) = recv {
                    let consumed = self.qps.get_mut(&target).and_then(|p| p.rq.pop_front());
                    if let Some(recv_wqe) = consumed {
                        self.complete_recv(target, &recv_wqe, WcStatus::SUCCESS, opcode, len, imm);
                    }
                }
            }
        }
        Step::Ran
    }
}
