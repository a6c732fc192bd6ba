//! Completion queues and RC queue pairs: creation, the state machine and
//! posting. Execution is the engine's.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use hal_verbs::{
    Completion, CompletionQueue, CqNotify, InitParams, PostError, Posted, QpAttributes, QpCaps,
    QpState, QueuePair, RecvRequest, Result, RtrParams, RtsParams, SendFlags, SendOp, SendRequest,
    VerbsError,
};

use super::events::{Applied, ChannelShared, CqEvents, clamp_rd_atomic};
use super::mr::PdInner;
use super::state::{CqState, FabricState, Pinned, QpRecord, RecvWqe, Remote, SendWqe};
use super::{ClockMode, SimFabric};
use crate::faults::FaultSite;
use crate::memory;

/// A simulated completion queue. Polling it makes the fabric progress first.
#[derive(Debug)]
pub struct SimCq {
    fabric: SimFabric,
    device: usize,
    id: u64,
    depth: u32,
}

impl SimCq {
    pub(crate) fn create(
        fabric: &SimFabric,
        device: usize,
        depth: u32,
        channel: Option<Arc<ChannelShared>>,
    ) -> Result<Self> {
        const OP: &str = "ibv_create_cq";
        let mut state = fabric.lock();
        state.alive(device, OP)?;
        let attributes = &state.devices[device].config.attributes;
        if depth == 0 || depth > attributes.max_cqe {
            let reason = format!("depth {depth} not in 1..={}", attributes.max_cqe);
            return Err(state.einval(device, OP, reason));
        }
        if state.devices[device].cqs >= attributes.max_cq {
            return Err(VerbsError::from_errno(
                OP,
                &state.devices[device].name,
                libc::ENOMEM,
            ));
        }
        let id = state.next_id();
        state.devices[device].cqs += 1;
        state.cqs.insert(
            id,
            CqState::new(
                device,
                depth,
                CqEvents {
                    channel,
                    ..CqEvents::default()
                },
            ),
        );
        Ok(Self {
            fabric: fabric.clone(),
            device,
            id,
            depth,
        })
    }
}

impl CompletionQueue for SimCq {
    fn depth(&self) -> u32 {
        self.depth
    }

    /// Progresses the fabric (unless paused), then takes completions in
    /// order. On a lost device the completions already there (its flushes)
    /// are still handed out; once none is left, polling fails.
    fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        {
            // Nothing on the fabric to progress: the completions are taken
            // with it held shared (the `fast` module).
            let state = self.fabric.read();
            if state.busy.is_empty() {
                if state.clock.mode == ClockMode::Auto && !state.paused {
                    state.polled_now(true);
                }
                return state.take_completions(self.id, self.device, out);
            }
        }
        // Large transfers' bytes move with the lock released, by this
        // thread, before it takes the completions.
        let state = self.fabric.progress_for_poll();
        state.take_completions(self.id, self.device, out)
    }

    fn cq_id(&self) -> u64 {
        self.id
    }

    /// Arms the CQ; see the `events` module for the semantics.
    fn req_notify(&self, notify: CqNotify) -> Result<()> {
        {
            let state = self.fabric.read();
            state.arm(self.id, self.device, notify)?;
            if state.busy.is_empty() {
                // No QP has an RNR wait for the NIC thread to step.
                return Ok(());
            }
        }
        // Someone may park on the channel now: RNR waits of its QPs move
        // without polls from here (`FabricState::nic_pace`).
        let mut state = self.fabric.lock();
        self.fabric.wake_nic(&mut state);
        Ok(())
    }

    fn set_moderation(&self, count: u16, period_us: u16) -> Result<()> {
        const OP: &str = "ibv_modify_cq";
        let mut state = self.fabric.lock();
        state.alive(self.device, OP)?;
        let Some(caps) = state.devices[self.device].config.attributes.cq_moderation else {
            return Err(VerbsError::NotSupported {
                operation: OP,
                reason: format!(
                    "{} reports no CQ moderation",
                    state.devices[self.device].name
                ),
                errno: Some(libc::EOPNOTSUPP),
            });
        };
        if count > caps.max_cq_count || period_us > caps.max_cq_period_us {
            let reason = format!(
                "count {count} / period {period_us} us above the limits {} / {} us",
                caps.max_cq_count, caps.max_cq_period_us
            );
            return Err(state.einval(self.device, OP, reason));
        }
        if let Some(cq) = state.cqs.get_mut(&self.id) {
            cq.ring().events.moderation = Some((count, period_us));
        }
        Ok(())
    }
}

impl Drop for SimCq {
    fn drop(&mut self) {
        let removed = self.fabric.lock().release_cq(self.id);
        drop(removed);
    }
}

/// A simulated RC queue pair. It keeps its PD and CQs alive.
#[derive(Debug)]
pub struct SimQp {
    pd: Arc<PdInner>,
    qpn: u32,
    caps: QpCaps,
}

/// Whether a posted request may run, or is flushed at once (error state).
#[derive(PartialEq, Eq)]
enum PostMode {
    Queue,
    Flush,
}

impl SimQp {
    pub(crate) fn create(
        pd: Arc<PdInner>,
        caps: &QpCaps,
        send_cq: &SimCq,
        recv_cq: &SimCq,
    ) -> Result<Self> {
        const OP: &str = "ibv_create_qp";
        let device = pd.device;
        let mut state = pd.fabric.lock();
        state.alive(device, OP)?;
        state.fault(device, FaultSite::VerbsCreateQp, OP)?;
        if send_cq.device != device || recv_cq.device != device {
            return Err(state.einval(device, OP, "CQ of another device"));
        }
        let config = &state.devices[device].config;
        let attributes = &config.attributes;
        let problem = if caps.max_send_wr == 0 || caps.max_send_wr > attributes.max_qp_wr {
            Some(format!(
                "max_send_wr {} not in 1..={}",
                caps.max_send_wr, attributes.max_qp_wr
            ))
        } else if caps.max_recv_wr > attributes.max_qp_wr {
            Some(format!(
                "max_recv_wr {} > {}",
                caps.max_recv_wr, attributes.max_qp_wr
            ))
        } else if caps.max_send_sge > attributes.max_sge || caps.max_recv_sge > attributes.max_sge {
            Some(format!("SGEs per request > max_sge {}", attributes.max_sge))
        } else if caps.max_inline_data > config.max_inline_data {
            Some(format!(
                "max_inline_data {} > {}",
                caps.max_inline_data, config.max_inline_data
            ))
        } else {
            None
        };
        if let Some(reason) = problem {
            return Err(state.einval(device, OP, reason));
        }
        if state.devices[device].qps >= attributes.max_qp {
            return Err(VerbsError::from_errno(
                OP,
                &state.devices[device].name,
                libc::ENOMEM,
            ));
        }
        let qpn = state.next_qpn();
        for cq in [send_cq.id, recv_cq.id] {
            if let Some(cq) = state.cqs.get_mut(&cq) {
                cq.refs += 1;
            }
        }
        state.devices[device].qps += 1;
        state.qps.insert(
            qpn,
            QpRecord {
                device,
                pd: pd.id,
                send_cq: send_cq.id,
                recv_cq: recv_cq.id,
                caps: *caps,
                state: QpState::Reset,
                access: hal_verbs::AccessFlags::empty(),
                remote: None,
                sq_psn: 0,
                timing: super::clock::QpTiming::default(),
                applied: Applied::default(),
                sq: VecDeque::new(),
                rq: VecDeque::new(),
                sq_posted: Mutex::new(0),
                sq_retired: AtomicU64::new(0),
                rq_posted: 0,
                rq_retired: AtomicU64::new(0),
            },
        );
        tracing::debug!(device = %state.devices[device].name, qpn, ?caps, "sim: QP created");
        drop(state);
        Ok(Self {
            pd,
            qpn,
            caps: *caps,
        })
    }

    /// Runs one `ibv_modify_qp`: device and fault checks, then `change`.
    fn modify(
        &self,
        operation: &'static str,
        reset: bool,
        change: impl FnOnce(&mut FabricState, usize, u32) -> Result<()>,
    ) -> Result<()> {
        let device = self.pd.device;
        // A reset forgets the requests in flight: none may have bytes still
        // moving then (a flush to ERROR keeps them, `FabricState::flush`).
        let mut state = if reset {
            self.pd.fabric.lock_without_copies()
        } else {
            self.pd.fabric.lock()
        };
        state.alive(device, operation)?;
        state.fault(device, FaultSite::VerbsModifyQp, operation)?;
        change(&mut state, device, self.qpn)?;
        tracing::debug!(qpn = self.qpn, operation, "sim: QP modified");
        Ok(())
    }
}

/// The record of a live QP (its handle exists, so it does).
fn record(state: &mut FabricState, qpn: u32) -> Result<&mut QpRecord> {
    state
        .qps
        .get_mut(&qpn)
        .ok_or_else(|| VerbsError::invalid("ibv_modify_qp", format!("no QP {qpn}")))
}

/// EINVAL for a transition the QP's state does not allow.
fn bad_transition(
    state: &FabricState,
    device: usize,
    operation: &'static str,
    qpn: u32,
    from: QpState,
) -> VerbsError {
    state.einval(
        device,
        operation,
        format!("QP {qpn} cannot make this transition from {from:?}"),
    )
}

/// A post refused for the QP's state (EINVAL), none of the batch queued:
/// the error names the first request, or (on an rxe-like device, see
/// [`DeviceConfig::wrong_state_post_is_unknown`](super::DeviceConfig))
/// none of the batch, as librxe leaves `bad_wr` NULL.
fn wrong_state(
    state: &FabricState,
    device: usize,
    operation: &'static str,
    reason: String,
) -> PostError {
    let error = state.einval(device, operation, reason);
    if state.devices[device].config.wrong_state_post_is_unknown {
        PostError {
            posted: Posted::Unknown,
            error,
        }
    } else {
        PostError::prefix(0, error)
    }
}

fn check_port(state: &FabricState, device: usize, operation: &'static str, port: u8) -> Result<()> {
    if port == 0 || port > state.devices[device].config.attributes.phys_port_cnt {
        return Err(state.einval(device, operation, format!("no port {port}")));
    }
    Ok(())
}

impl QueuePair for SimQp {
    fn qp_num(&self) -> u32 {
        self.qpn
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn state(&self) -> Result<QpState> {
        let mut state = self.pd.fabric.lock();
        state.alive(self.pd.device, "ibv_query_qp")?;
        Ok(record(&mut state, self.qpn)?.state)
    }

    fn to_init(&self, params: &InitParams) -> Result<()> {
        const OP: &str = "ibv_modify_qp(INIT)";
        self.modify(OP, false, |state, device, qpn| {
            check_port(state, device, OP, params.port)?;
            let from = record(state, qpn)?.state;
            if !matches!(from, QpState::Reset | QpState::Init) {
                return Err(bad_transition(state, device, OP, qpn, from));
            }
            let qp = record(state, qpn)?;
            qp.access = params.access;
            qp.state = QpState::Init;
            Ok(())
        })
    }

    fn to_rtr(&self, params: &RtrParams) -> Result<()> {
        const OP: &str = "ibv_modify_qp(RTR)";
        self.modify(OP, false, |state, device, qpn| {
            check_port(state, device, OP, params.port)?;
            let from = record(state, qpn)?.state;
            if from != QpState::Init {
                return Err(bad_transition(state, device, OP, qpn, from));
            }
            let dev = &state.devices[device];
            if !dev
                .gids
                .iter()
                .any(|e| e.index == u32::from(params.sgid_index))
            {
                let reason = format!("sgid_index {} is not in the GID table", params.sgid_index);
                return Err(state.einval(device, OP, reason));
            }
            if params.path_mtu > dev.config.active_mtu {
                let reason = format!(
                    "path MTU {} above the port's active MTU {}",
                    params.path_mtu.bytes(),
                    dev.config.active_mtu.bytes()
                );
                return Err(state.einval(device, OP, reason));
            }
            // Address resolution: the device that owns the peer's GID. Its
            // QPN is not checked here (a real NIC cannot either): a wrong one
            // shows up as a transport retry error when traffic starts.
            let Some(peer) = state
                .devices
                .iter()
                .position(|d| d.gids.iter().any(|e| e.gid == params.remote.gid))
            else {
                return Err(VerbsError::from_errno(
                    OP,
                    &state.devices[device].name,
                    libc::EHOSTUNREACH,
                ));
            };
            let max_dest = state.devices[device].config.attributes.max_qp_rd_atom;
            let qp = record(state, qpn)?;
            qp.remote = Some(Remote {
                device: peer,
                qpn: params.remote.qp_num,
                rq_psn: params.remote.psn,
            });
            // A recycled QP starts with no request in flight and no timer.
            qp.timing = super::clock::QpTiming::default();
            qp.applied.max_dest_rd_atomic = clamp_rd_atomic(params.max_dest_rd_atomic, max_dest);
            qp.applied.path_mtu = Some(params.path_mtu);
            qp.applied.dest_qp_num = params.remote.qp_num;
            qp.applied.rq_psn = params.remote.psn;
            qp.applied.min_rnr_timer = params.min_rnr_timer;
            qp.state = QpState::ReadyToReceive;
            Ok(())
        })
    }

    fn to_rts(&self, params: &RtsParams) -> Result<()> {
        const OP: &str = "ibv_modify_qp(RTS)";
        self.modify(OP, false, |state, device, qpn| {
            params.validate()?;
            let from = record(state, qpn)?.state;
            if !matches!(from, QpState::ReadyToReceive | QpState::ReadyToSend) {
                return Err(bad_transition(state, device, OP, qpn, from));
            }
            let max_init = state.devices[device].config.attributes.max_qp_init_rd_atom;
            let qp = record(state, qpn)?;
            qp.applied.max_rd_atomic = clamp_rd_atomic(params.max_rd_atomic, max_init);
            qp.applied.timeout = params.timeout;
            qp.applied.retry_cnt = params.retry_cnt;
            qp.applied.rnr_retry = params.rnr_retry;
            qp.sq_psn = params.sq_psn;
            qp.state = QpState::ReadyToSend;
            Ok(())
        })
    }

    fn to_error(&self) -> Result<()> {
        self.modify("ibv_modify_qp(ERR)", false, |state, _, qpn| {
            state.set_error(qpn);
            Ok(())
        })
    }

    /// Drops the queues without completions (their slots are free again),
    /// forgets the peer and what RTR/RTS applied; on a device that purges
    /// a destroyed QP's completions (ConnectX-like), its completions still
    /// in its CQs go too, as libmlx5's reset cleans the CQs.
    fn to_reset(&self) -> Result<()> {
        self.modify("ibv_modify_qp(RESET)", true, |state, device, qpn| {
            let purge = state.devices[device].config.destroy_qp_purges_cq;
            let qp = record(state, qpn)?;
            qp.state = QpState::Reset;
            qp.sq.clear();
            qp.rq.clear();
            qp.retire_all();
            qp.remote = None;
            qp.sq_psn = 0;
            qp.access = hal_verbs::AccessFlags::empty();
            qp.applied = Applied::default();
            qp.timing = super::clock::QpTiming::default();
            let cqs = [qp.send_cq, qp.recv_cq];
            if purge {
                for cq in cqs {
                    if let Some(cq) = state.cqs.get_mut(&cq) {
                        cq.ring().entries.retain(|e| e.wc.qp_num != qpn);
                    }
                }
            }
            Ok(())
        })
    }

    fn query(&self) -> Result<QpAttributes> {
        let mut state = self.pd.fabric.lock();
        state.alive(self.pd.device, "ibv_query_qp")?;
        let qp = record(&mut state, self.qpn)?;
        let applied = qp.applied;
        Ok(QpAttributes {
            state: qp.state,
            caps: qp.caps,
            max_rd_atomic: applied.max_rd_atomic,
            max_dest_rd_atomic: applied.max_dest_rd_atomic,
            path_mtu: applied.path_mtu,
            dest_qp_num: applied.dest_qp_num,
            sq_psn: qp.sq_psn,
            rq_psn: applied.rq_psn,
            timeout: applied.timeout,
            retry_cnt: applied.retry_cnt,
            rnr_retry: applied.rnr_retry,
            min_rnr_timer: applied.min_rnr_timer,
        })
    }

    /// Queues the requests, then makes the progress a post makes on the
    /// Auto clock (`SimFabric::progress_after_post`): they run now, as
    /// far as they can, without a poll.
    unsafe fn post_send(&self, requests: &[SendRequest]) -> Result<(), PostError> {
        // SAFETY: forwarded from our caller's contract.
        if unsafe { self.pd.fabric.read().post_sends_fast(self.qpn, requests) } {
            return Ok(());
        }
        let mut state = self.pd.fabric.lock();
        // SAFETY: forwarded from our caller's contract.
        let result = unsafe { self.queue_sends(&mut state, requests) };
        self.pd.fabric.progress_after_post(state);
        result
    }

    /// Queues the receives, then makes the progress a post makes on the
    /// Auto clock: a SEND that waits for one of them runs now.
    unsafe fn post_recv(&self, requests: &[RecvRequest]) -> Result<(), PostError> {
        let mut state = self.pd.fabric.lock();
        let result = self.queue_recvs(&mut state, requests);
        self.pd.fabric.progress_after_post(state);
        result
    }
}

impl SimQp {
    /// `post_send` under the fabric lock, without its progress.
    ///
    /// # Safety
    /// As `post_send`: the SG entries lie in live registrations (inline ones
    /// in readable host memory).
    unsafe fn queue_sends(
        &self,
        state: &mut FabricState,
        requests: &[SendRequest],
    ) -> Result<(), PostError> {
        const OP: &str = "ibv_post_send";
        let device = self.pd.device;
        let at = |accepted: usize| move |error: VerbsError| PostError::prefix(accepted, error);
        state.alive(device, OP).map_err(at(0))?;
        let mode = match record(state, self.qpn).map_err(at(0))?.state {
            QpState::ReadyToSend => PostMode::Queue,
            // Real providers take requests in the error state and flush them.
            QpState::Error => PostMode::Flush,
            other => {
                let reason = format!("QP {} is in {other:?}; sends need RTS", self.qpn);
                return Err(wrong_state(state, device, OP, reason));
            }
        };
        let mut result = Ok(());
        for (index, request) in requests.iter().enumerate() {
            // SAFETY: forwarded from our caller's contract: the SG entries
            // lie in live registrations (inline ones in host memory).
            if let Err(error) = unsafe { self.post_one_send(state, request) } {
                result = Err(PostError::prefix(index, error));
                break;
            }
        }
        if mode == PostMode::Flush {
            state.flush(self.qpn);
        }
        let accepted = match &result {
            Ok(()) => requests.len(),
            Err(e) => e.accepted().unwrap_or(0),
        };
        tracing::debug!(
            qpn = self.qpn,
            accepted,
            of = requests.len(),
            "sim: post_send"
        );
        result
    }

    /// `post_recv` under the fabric lock, without its progress.
    fn queue_recvs(
        &self,
        state: &mut FabricState,
        requests: &[RecvRequest],
    ) -> Result<(), PostError> {
        const OP: &str = "ibv_post_recv";
        let device = self.pd.device;
        let at = |accepted: usize| move |error: VerbsError| PostError::prefix(accepted, error);
        state.alive(device, OP).map_err(at(0))?;
        let mode = match record(state, self.qpn).map_err(at(0))?.state {
            QpState::Reset => {
                let reason = format!("QP {} is in RESET; receives need INIT or later", self.qpn);
                return Err(wrong_state(state, device, OP, reason));
            }
            QpState::Error => PostMode::Flush,
            _ => PostMode::Queue,
        };
        let mut result = Ok(());
        for (index, request) in requests.iter().enumerate() {
            if let Err(error) = self.post_one_recv(state, request) {
                result = Err(PostError::prefix(index, error));
                break;
            }
        }
        if mode == PostMode::Flush {
            state.flush(self.qpn);
        }
        tracing::debug!(
            qpn = self.qpn,
            of = requests.len(),
            ok = result.is_ok(),
            "sim: post_recv"
        );
        result
    }

    /// Checks and queues one send request.
    ///
    /// # Safety
    /// As `post_send`: an INLINE request's SG entries must be readable host
    /// memory.
    unsafe fn post_one_send(&self, state: &mut FabricState, request: &SendRequest) -> Result<()> {
        const OP: &str = "ibv_post_send";
        let device = self.pd.device;
        let forced = state.fault(device, FaultSite::VerbsPostSend, OP)?;
        let qp = record(state, self.qpn)?;
        let caps = qp.caps;
        if qp.sq_in_use() >= u64::from(caps.max_send_wr) {
            return Err(VerbsError::QueueFull {
                queue: "send",
                qp_num: self.qpn,
                depth: caps.max_send_wr,
            });
        }
        if request.sg_list.len() > caps.max_send_sge as usize {
            let reason = format!(
                "{} SG entries > max_send_sge {}",
                request.sg_list.len(),
                caps.max_send_sge
            );
            return Err(state.einval(device, OP, reason));
        }
        let inline = if request.flags.contains(SendFlags::INLINE) {
            if matches!(request.op, SendOp::Read { .. }) {
                return Err(state.einval(device, OP, "INLINE on an RDMA READ"));
            }
            let total = request.byte_len();
            if total > u64::from(caps.max_inline_data) {
                // As the HAL refuses it before the provider: InvalidArgument,
                // with the errno the provider would answer (the profile's).
                let errno = state.devices[device].config.inline_overflow_errno;
                let reason = format!(
                    "{total} inline bytes > max_inline_data {} (the provider answers {})",
                    caps.max_inline_data,
                    std::io::Error::from_raw_os_error(errno)
                );
                return Err(VerbsError::InvalidArgument {
                    operation: OP,
                    reason,
                    errno: Some(errno),
                });
            }
            if request
                .sg_list
                .iter()
                .any(|s| memory::is_device_address(s.addr))
            {
                // The CPU would have to read device memory: refused.
                return Err(state.einval(device, OP, "INLINE payload in device memory"));
            }
            if let Some(sge) = request.sg_list.iter().find(|s| {
                state
                    .mrs
                    .get(&s.lkey)
                    .is_some_and(|mr| matches!(mr._pinned, Pinned::Dmabuf(_)))
            }) {
                // As the rdma backend: a dma-buf MR's addresses are iovas,
                // which the CPU cannot read.
                let reason = format!(
                    "INLINE payload in a dma-buf MR (lkey {:#x}): its addresses are iovas",
                    sge.lkey
                );
                return Err(state.einval(device, OP, reason));
            }
            let mut data = Vec::with_capacity(total as usize);
            for sge in &request.sg_list {
                // SAFETY: the caller guarantees an inline request's SG
                // entries are readable host memory for this call; the lkey
                // is ignored for inline data, as on real hardware.
                let bytes = unsafe {
                    std::slice::from_raw_parts(sge.addr as *const u8, sge.length as usize)
                };
                data.extend_from_slice(bytes);
            }
            Some(data)
        } else {
            None
        };
        let qp = record(state, self.qpn)?;
        let posted = qp.sq_posted();
        let seq = *posted;
        *posted += 1;
        qp.sq.push_back(SendWqe {
            wr_id: request.wr_id,
            op: request.op,
            sg_list: request.sg_list.clone(),
            flags: request.flags,
            inline,
            forced,
            seq,
        });
        state.busy.insert(self.qpn);
        Ok(())
    }

    fn post_one_recv(&self, state: &mut FabricState, request: &RecvRequest) -> Result<()> {
        const OP: &str = "ibv_post_recv";
        let device = self.pd.device;
        state.fault(device, FaultSite::VerbsPostRecv, OP)?;
        let qp = record(state, self.qpn)?;
        let caps = qp.caps;
        if qp.rq_in_use() >= u64::from(caps.max_recv_wr) {
            return Err(VerbsError::QueueFull {
                queue: "recv",
                qp_num: self.qpn,
                depth: caps.max_recv_wr,
            });
        }
        if request.sg_list.len() > caps.max_recv_sge as usize {
            let reason = format!(
                "{} SG entries > max_recv_sge {}",
                request.sg_list.len(),
                caps.max_recv_sge
            );
            return Err(state.einval(device, OP, reason));
        }
        let qp = record(state, self.qpn)?;
        let seq = qp.rq_posted;
        qp.rq_posted += 1;
        qp.rq.push_back(RecvWqe {
            wr_id: request.wr_id,
            sg_list: request.sg_list.clone(),
            seq,
        });
        Ok(())
    }
}

impl Drop for SimQp {
    fn drop(&mut self) {
        // Destroying a QP drops its outstanding requests without completions,
        // as ibv_destroy_qp does; peers then see transport retry errors. On
        // a device configured like ConnectX
        // ([`DeviceConfig::destroy_qp_purges_cq`](super::DeviceConfig)), the
        // completions of the QP still in its CQs go too.
        let removed = {
            // Its requests whose bytes move outside the lock land first.
            let mut state = self.pd.fabric.lock_without_copies();
            let removed = state.qps.remove(&self.qpn);
            state.busy.remove(&self.qpn);
            if let Some(qp) = &removed {
                if state.devices[qp.device].config.destroy_qp_purges_cq {
                    let qpn = self.qpn;
                    for cq in [qp.send_cq, qp.recv_cq] {
                        if let Some(cq) = state.cqs.get_mut(&cq) {
                            let entries = &mut cq.ring().entries;
                            let before = entries.len();
                            entries.retain(|e| e.wc.qp_num != qpn);
                            let purged = before - entries.len();
                            if purged > 0 {
                                tracing::debug!(
                                    qpn,
                                    purged,
                                    "sim: destroyed QP's completions purged"
                                );
                            }
                        }
                    }
                }
                state.devices[qp.device].qps = state.devices[qp.device].qps.saturating_sub(1);
                let cqs = [state.release_cq(qp.send_cq), state.release_cq(qp.recv_cq)];
                drop(cqs);
            }
            removed
        };
        drop(removed);
    }
}
