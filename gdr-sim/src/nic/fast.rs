//! The fast path: posts and polls that run with the fabric held shared.
//!
//! A real NIC keeps state per queue pair and per completion queue, so
//! threads posting and polling on different QPs never meet. The sim's
//! fabric is one state behind a reader-writer lock ([`super::World`]):
//! everything that creates, changes or destroys objects, runs timers or
//! fails requests holds it exclusively, as before. What remains is the
//! common case, and it runs with the fabric held shared:
//!
//! - a post of WRITEs and READs (no immediate, no inline data, under
//!   [`MOVE_OUTSIDE_FROM`] bytes each, zero READ latency) on a ready QP
//!   whose peer is ready, each of which passes its checks: they run to
//!   completion inside the post, as the slow path's post-time progress
//!   would run them, and nothing is left queued;
//! - a poll, when nothing on the fabric has work to progress;
//! - arming a CQ, likewise.
//!
//! All of it only while the fast path is open
//! ([`FabricState::fast_path_open`]): the Auto clock, not paused, no QP of
//! the fabric with work queued, outstanding or timed (the `busy` set is
//! empty, so a post's progress would run its own requests only and a
//! poll's nothing), and a fault plan that cannot fire. Anything else, or
//! any request that would not complete at once and successfully, goes the
//! slow path whole, with nothing changed: the semantics are the slow
//! path's, only the locking differs.
//!
//! What the fast path changes has a lock of its own: a QP's posted count
//! (`QpRecord::sq_posted`, which also keeps two posts on one QP apart), a
//! CQ's ring ([`CqState::lock`](super::state::CqState::lock)), and the
//! retired slots (atomics, raised to a maximum by polls). The lock order
//! is QP, then CQ; a poll takes its CQ only. Registrations are removed only
//! with the fabric held exclusively, so bytes moved under a shared holding
//! land in live memory.
//!
//! Nor does the fast path allocate per request: a request's ranges and
//! copies, and a post's plan of up to 16 requests, live on the stack
//! (`tests/tests/sim_fast_path_allocations.rs`). Threads that share
//! nothing on a real NIC would otherwise meet in the process allocator's
//! locks (glibc's frees past its per-thread cache take the arena's lock).

use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use hal_verbs::{
    Completion, CqNotify, QpState, Result, SendFlags, SendOp, SendRequest, VerbsError, WcStatus,
};

use smallvec::SmallVec;

use super::ClockMode;
use super::engine::Plan;
use super::state::{CqEntry, FabricState, MOVE_OUTSIDE_FROM, Piece, Queue, SendWqe};

/// Requests of one post planned without an allocation (a longer post
/// spills to the heap, as it may).
const POST_INLINE: usize = 16;

impl FabricState {
    /// Whether the fast path may run now (see the module docs).
    pub(crate) fn fast_path_open(&self) -> bool {
        self.clock.mode == ClockMode::Auto
            && !self.paused
            && self.busy.is_empty()
            && self.faults.is_inert()
    }

    /// Runs `requests` posted on `qpn` at once, with the fabric held
    /// shared, if the fast path may take them all (see the module docs);
    /// returns `false`, having changed nothing, when it may not.
    ///
    /// # Safety
    /// As [`QueuePair::post_send`](hal_verbs::QueuePair::post_send): the SG
    /// entries lie in live registrations.
    pub(crate) unsafe fn post_sends_fast(&self, qpn: u32, requests: &[SendRequest]) -> bool {
        if !self.fast_path_open() || requests.is_empty() {
            return false;
        }
        let Some(qp) = self.qps.get(&qpn) else {
            return false;
        };
        let device = &self.devices[qp.device];
        if qp.state != QpState::ReadyToSend || device.lost {
            return false;
        }
        let reads_wait = !self.clock.read_latency.is_zero();
        let eligible = |r: &SendRequest| {
            let op_ok = match r.op {
                SendOp::Write { .. } => true,
                SendOp::Read { .. } => !reads_wait,
                _ => false,
            };
            op_ok
                && !r.flags.contains(SendFlags::INLINE)
                && r.sg_list.len() <= qp.caps.max_send_sge as usize
                && r.byte_len() < MOVE_OUTSIDE_FROM
        };
        if !requests.iter().all(eligible) {
            return false;
        }
        let Some(send_cq) = self.cqs.get(&qp.send_cq) else {
            return false;
        };
        // From here this QP's posts are ours alone.
        let mut posted = qp.sq_posted.lock().unwrap_or_else(PoisonError::into_inner);
        let in_use = *posted - qp.sq_retired.load(Ordering::Acquire);
        if in_use + requests.len() as u64 > u64::from(qp.caps.max_send_wr) {
            return false;
        }
        // Plan every request before any moves: one that would not succeed
        // at once sends the whole post the slow way, untouched.
        let mut pieces: SmallVec<[Piece; POST_INLINE]> = SmallVec::new();
        let mut ends: SmallVec<[(usize, SendWqe); POST_INLINE]> = SmallVec::new();
        for (index, request) in requests.iter().enumerate() {
            let wqe = SendWqe {
                wr_id: request.wr_id,
                op: request.op,
                sg_list: request.sg_list.clone(),
                flags: request.flags,
                inline: None,
                forced: None,
                seq: *posted + index as u64,
            };
            match self.plan_transfer(qpn, qp, &wqe) {
                Some(Plan::Run {
                    copies, recv: None, ..
                }) => {
                    pieces.extend(copies);
                    ends.push((pieces.len(), wqe));
                }
                _ => return false,
            }
        }
        let signaled = ends
            .iter()
            .filter(|(_, wqe)| wqe.flags.contains(SendFlags::SIGNALED))
            .count();
        let mut ring = send_cq.lock();
        if ring.overrun || ring.entries.len() + signaled > send_cq.depth as usize {
            // An overrun is the slow path's to raise.
            return false;
        }
        let retire_at_completion = !device.config.slots_freed_when_polled;
        let mut start = 0;
        for (end, wqe) in ends {
            self.copy_in_lock(&pieces[start..end]);
            start = end;
            let slot = wqe.seq + 1;
            *posted = slot;
            if retire_at_completion {
                qp.sq_retired.fetch_max(slot, Ordering::AcqRel);
            }
            if !wqe.flags.contains(SendFlags::SIGNALED) {
                continue;
            }
            ring.entries.push_back(CqEntry {
                wc: Completion {
                    wr_id: wqe.wr_id,
                    status: WcStatus::SUCCESS,
                    opcode: wqe.wc_opcode(),
                    byte_len: u32::try_from(wqe.byte_len()).unwrap_or(u32::MAX),
                    imm: None,
                    qp_num: qpn,
                    vendor_err: 0,
                },
                retire: (qpn, Queue::Send, slot),
            });
            ring.events
                .on_completion(qp.send_cq, false, false, &self.clock);
        }
        #[cfg(test)]
        self.fast_posts.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            qpn,
            accepted = requests.len(),
            of = requests.len(),
            "sim: post_send (fast path)"
        );
        true
    }

    /// Takes up to `out.len()` completions of CQ `cq`, retiring the queue
    /// slots they free; holds the CQ's ring only, so it runs with the
    /// fabric held shared as well as exclusively.
    pub(crate) fn take_completions(
        &self,
        cq: u64,
        device: usize,
        out: &mut [Completion],
    ) -> Result<usize> {
        let Some(state) = self.cqs.get(&cq) else {
            return Err(VerbsError::invalid("ibv_poll_cq", "CQ is gone"));
        };
        let mut ring = state.lock();
        if ring.overrun {
            return Err(VerbsError::OutOfResources {
                operation: "ibv_poll_cq (CQ overrun: completions were lost)",
                errno: Some(libc::EOVERFLOW),
            });
        }
        let n = out.len().min(ring.entries.len());
        for (slot, entry) in out.iter_mut().zip(ring.entries.drain(..n)) {
            *slot = entry.wc;
            self.retire(entry.retire);
        }
        drop(ring);
        if n == 0 {
            self.alive(device, "ibv_poll_cq")?;
        }
        Ok(n)
    }

    /// Arms CQ `cq` for `notify` (see the `events` module).
    pub(crate) fn arm(&self, cq: u64, device: usize, notify: CqNotify) -> Result<()> {
        const OP: &str = "ibv_req_notify_cq";
        self.alive(device, OP)?;
        let Some(state) = self.cqs.get(&cq) else {
            return Err(VerbsError::invalid(OP, "CQ is gone"));
        };
        let mut ring = state.lock();
        if ring.events.channel.is_none() {
            return Err(self.einval(device, OP, "the CQ was not created on a completion channel"));
        }
        // Arming for any completion subsumes an armed solicited-only one.
        if ring.events.armed != Some(CqNotify::Next) {
            ring.events.armed = Some(notify);
        }
        Ok(())
    }
}
