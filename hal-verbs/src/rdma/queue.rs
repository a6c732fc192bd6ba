//! Completion queues and RC queue pairs: state transitions, linked posts,
//! completions.

use std::ffi::c_int;
use std::fmt;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use rdma_mummy_sys as sys;
use smallvec::SmallVec;

use super::device::ContextInner;
use super::events::ChannelInner;
use super::memory::PdInner;
use super::{clear_errno, errno_or_eio, ret_errno, verb_error};
use crate::api::{CompletionQueue, QueuePair};
use crate::error::{PostError, Posted, Result, VerbsError};
use crate::types::{
    Completion, CqNotify, InitParams, LinkLayer, Mtu, QpAttributes, QpCaps, QpState, RecvRequest,
    RtrParams, RtsParams, SendFlags, SendOp, SendRequest, WcOpcode, WcStatus,
};

/// The native CQ, destroyed when its last QP and handle are gone.
pub(crate) struct CqInner {
    cq: *mut sys::ibv_cq,
    depth: u32,
    ctx: Arc<ContextInner>,
    /// The channel its events go to, kept alive until the CQ is destroyed
    /// (this struct's fields drop after `Drop::drop` ran).
    channel: Option<Arc<ChannelInner>>,
    /// A failure of `ibv_poll_cq` met after completions had already been
    /// taken off the queue in the same `poll`: those are returned first, the
    /// failure on the next call.
    pending: PendingError,
}

// SAFETY: rdma-core providers lock a CQ inside `poll_cq`, so it may be polled
// from any thread; it is destroyed only in Drop.
unsafe impl Send for CqInner {}
// SAFETY: see Send.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: `cq` came from ibv_create_cq and is destroyed once; every
        // QP using it holds an Arc to us, so none is left.
        let ret = unsafe { sys::ibv_destroy_cq(self.cq) };
        if ret != 0 {
            tracing::warn!(
                device = %self.ctx.name(),
                errno = ret_errno(ret),
                "ibv_destroy_cq failed; the completion queue leaks"
            );
        }
    }
}

impl fmt::Debug for CqInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CqInner")
            .field("device", &self.ctx.name())
            .field("depth", &self.depth)
            .finish()
    }
}

/// A completion queue. Cloning shares it.
#[derive(Debug, Clone)]
pub struct RdmaCq {
    inner: Arc<CqInner>,
}

impl RdmaCq {
    pub(crate) fn create(
        ctx: &Arc<ContextInner>,
        depth: u32,
        channel: Option<(&Arc<ChannelInner>, u32)>,
    ) -> Result<Self> {
        let max = ctx.attrs().max_cqe;
        if depth == 0 || (max != 0 && depth > max) {
            return Err(VerbsError::invalid(
                "ibv_create_cq",
                format!("depth {depth} outside 1..={max}"),
            ));
        }
        let (channel_ptr, comp_vector) = match channel {
            None => (std::ptr::null_mut(), 0),
            Some((channel, vector)) => {
                if !Arc::ptr_eq(channel.context(), ctx) {
                    return Err(super::events::foreign_channel(channel, ctx));
                }
                let vectors = ctx.attrs().num_comp_vectors;
                if vector >= vectors {
                    return Err(VerbsError::invalid(
                        "ibv_create_cq",
                        format!(
                            "completion vector {vector} outside 0..{vectors} of {}",
                            ctx.name()
                        ),
                    ));
                }
                (
                    channel.as_ptr(),
                    c_int::try_from(vector).unwrap_or(c_int::MAX),
                )
            }
        };
        let cqe = c_int::try_from(depth).unwrap_or(c_int::MAX);
        clear_errno();
        // SAFETY: the context is open; the channel, if any, is live and of
        // this context (checked above); no user context (events name the
        // CQ by its address).
        let cq = unsafe {
            sys::ibv_create_cq(
                ctx.as_ptr(),
                cqe,
                std::ptr::null_mut(),
                channel_ptr,
                comp_vector,
            )
        };
        if cq.is_null() {
            return Err(verb_error("ibv_create_cq", ctx.name(), errno_or_eio()));
        }
        // SAFETY: a live CQ; `cqe` holds the size granted (>= asked).
        let granted = u32::try_from(unsafe { (*cq).cqe }).unwrap_or(depth);
        Ok(Self {
            inner: Arc::new(CqInner {
                cq,
                depth: granted,
                ctx: Arc::clone(ctx),
                channel: channel.map(|(c, _)| Arc::clone(c)),
                pending: PendingError::default(),
            }),
        })
    }
}

/// Completions polled per `ibv_poll_cq` call, kept on the stack.
const POLL_CHUNK: usize = 32;

fn completion_from_native(wc: &sys::ibv_wc) -> Completion {
    let with_imm = wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
    Completion {
        wr_id: wc.wr_id,
        status: WcStatus(wc.status),
        opcode: WcOpcode::from_native(wc.opcode),
        byte_len: wc.byte_len,
        // SAFETY: with IBV_WC_WITH_IMM the union holds the immediate (in
        // network order); any bit pattern is a valid u32.
        imm: with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
        qp_num: wc.qp_num,
        vendor_err: wc.vendor_err,
    }
}

/// An error held back for the next `poll`, so completions polled before it
/// are not lost with it.
#[derive(Debug, Default)]
struct PendingError {
    /// Fast path: false while nothing is held (every poll reads it).
    set: AtomicBool,
    error: Mutex<Option<VerbsError>>,
}

impl PendingError {
    fn hold(&self, error: VerbsError) {
        let mut slot = self.error.lock().unwrap_or_else(PoisonError::into_inner);
        // A second failure before the first was reported keeps the first.
        slot.get_or_insert(error);
        self.set.store(true, Ordering::Release);
    }

    fn take(&self) -> Option<VerbsError> {
        if !self.set.load(Ordering::Acquire) {
            return None;
        }
        let mut slot = self.error.lock().unwrap_or_else(PoisonError::into_inner);
        self.set.store(false, Ordering::Release);
        slot.take()
    }
}

/// The poll loop over `chunk`, which polls up to `wcs.len()` entries into
/// `wcs` and returns what `ibv_poll_cq` returns. Completions already taken
/// are never dropped: a failure after some is held in `pending` and
/// reported by the next call; a failure with none taken is reported now.
fn poll_loop(
    out: &mut [Completion],
    pending: &PendingError,
    device: &str,
    mut chunk: impl FnMut(&mut [MaybeUninit<sys::ibv_wc>]) -> c_int,
) -> Result<usize> {
    if let Some(error) = pending.take() {
        return Err(error);
    }
    let mut done = 0;
    while done < out.len() {
        let want = (out.len() - done).min(POLL_CHUNK);
        let mut wcs = [MaybeUninit::<sys::ibv_wc>::uninit(); POLL_CHUNK];
        let got = chunk(&mut wcs[..want]);
        if got < 0 {
            // Not an errno: libibverbs' providers return -1 (or another
            // negative code) for a CQ in error, and leave errno alone.
            let error = VerbsError::CompletionQueue {
                operation: "ibv_poll_cq",
                device: device.to_owned(),
                code: got,
            };
            if done == 0 {
                return Err(error);
            }
            pending.hold(error);
            break;
        }
        let got = usize::try_from(got).unwrap_or(0).min(want);
        for (slot, wc) in out[done..done + got].iter_mut().zip(&wcs[..got]) {
            // SAFETY: the provider wrote the first `got` entries.
            *slot = completion_from_native(unsafe { wc.assume_init_ref() });
        }
        done += got;
        if got < want {
            break;
        }
    }
    Ok(done)
}

impl CompletionQueue for RdmaCq {
    fn depth(&self) -> u32 {
        self.inner.depth
    }

    fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        let cq = self.inner.cq;
        poll_loop(out, &self.inner.pending, self.inner.ctx.name(), |wcs| {
            let n = c_int::try_from(wcs.len()).unwrap_or(c_int::MAX);
            // One pointer, derived from the whole slice, for every entry
            // the provider writes.
            let ptr = wcs.as_mut_ptr().cast::<sys::ibv_wc>();
            // SAFETY: the CQ is live (we hold it), created by this
            // context's provider, so the inline wrapper's ops table is the
            // right one; `ptr` has room for `n` entries (MaybeUninit<T> has
            // T's layout).
            unsafe { sys::ibv_poll_cq(cq, n, ptr) }
        })
    }

    fn cq_id(&self) -> u64 {
        self.inner.cq as u64
    }

    fn req_notify(&self, notify: CqNotify) -> Result<()> {
        if self.inner.channel.is_none() {
            return Err(VerbsError::invalid(
                "ibv_req_notify_cq",
                "the CQ was not created on a completion channel",
            ));
        }
        let solicited_only = c_int::from(notify == CqNotify::Solicited);
        // SAFETY: the CQ is live and created by this context's provider, so
        // the inline wrapper's ops table is the right one.
        let ret = unsafe { sys::ibv_req_notify_cq(self.inner.cq, solicited_only) };
        if ret != 0 {
            return Err(verb_error(
                "ibv_req_notify_cq",
                self.inner.ctx.name(),
                ret_errno(ret),
            ));
        }
        Ok(())
    }

    fn set_moderation(&self, count: u16, period_us: u16) -> Result<()> {
        const OP: &str = "ibv_modify_cq";
        let device = self.inner.ctx.name();
        let Some(caps) = self.inner.ctx.attrs().cq_moderation else {
            return Err(VerbsError::NotSupported {
                operation: OP,
                reason: format!("{device} reports no CQ moderation (cq_mod_caps are zero)"),
                errno: Some(libc::EOPNOTSUPP),
            });
        };
        if count > caps.max_cq_count || period_us > caps.max_cq_period_us {
            return Err(VerbsError::invalid(
                OP,
                format!(
                    "count {count} / period {period_us} us above {device}'s limits {} / {} us",
                    caps.max_cq_count, caps.max_cq_period_us
                ),
            ));
        }
        let mut attr = sys::ibv_modify_cq_attr {
            attr_mask: sys::ibv_cq_attr_mask::IBV_CQ_ATTR_MODERATE.0,
            moderate: sys::ibv_moderate_cq {
                cq_count: count,
                cq_period: period_us,
            },
        };
        // SAFETY: the CQ is live; `attr` is valid for the call.
        let ret = unsafe { sys::ibv_modify_cq(self.inner.cq, &mut attr) };
        if ret != 0 {
            return Err(verb_error(OP, device, ret_errno(ret)));
        }
        Ok(())
    }
}

/// An RC queue pair; keeps its PD and CQs (and so the device) alive.
pub struct RdmaQp {
    qp: *mut sys::ibv_qp,
    qp_num: u32,
    caps: QpCaps,
    pd: Arc<PdInner>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
}

// SAFETY: rdma-core providers lock a QP's queues inside post_send/post_recv,
// and modify/query go through the kernel, so a QP may be used from any
// thread; it is destroyed only in Drop.
unsafe impl Send for RdmaQp {}
// SAFETY: see Send.
unsafe impl Sync for RdmaQp {}

impl fmt::Debug for RdmaQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaQp")
            .field("device", &self.device())
            .field("qp_num", &self.qp_num)
            .field("caps", &self.caps)
            .field("send_cq", &self.send_cq)
            .field("recv_cq", &self.recv_cq)
            .finish()
    }
}

impl Drop for RdmaQp {
    fn drop(&mut self) {
        // SAFETY: `qp` came from ibv_create_qp and is destroyed once. Its
        // PD and CQs are released after this body, when our Arcs drop.
        let ret = unsafe { sys::ibv_destroy_qp(self.qp) };
        if ret != 0 {
            tracing::warn!(
                device = %self.device(),
                qp_num = self.qp_num,
                errno = ret_errno(ret),
                "ibv_destroy_qp failed; the queue pair leaks"
            );
        }
    }
}

fn caps_from_native(cap: &sys::ibv_qp_cap) -> QpCaps {
    QpCaps {
        max_send_wr: cap.max_send_wr,
        max_recv_wr: cap.max_recv_wr,
        max_send_sge: cap.max_send_sge,
        max_recv_sge: cap.max_recv_sge,
        max_inline_data: cap.max_inline_data,
    }
}

/// A zeroed `ibv_qp_attr`, the starting point of every transition.
fn zeroed_attr() -> sys::ibv_qp_attr {
    // SAFETY: ibv_qp_attr is integers, byte arrays and unions of them; the
    // all-zero value is valid (and what C callers memset to).
    unsafe { std::mem::zeroed() }
}

fn mask(bits: &[sys::ibv_qp_attr_mask]) -> c_int {
    let all = bits.iter().fold(0, |acc, m| acc | m.0);
    c_int::try_from(all).unwrap_or(c_int::MAX)
}

impl RdmaQp {
    pub(crate) fn create(
        pd: &Arc<PdInner>,
        caps: &QpCaps,
        send_cq: &RdmaCq,
        recv_cq: &RdmaCq,
    ) -> Result<Self> {
        let ctx = pd.context();
        for cq in [send_cq, recv_cq] {
            if !Arc::ptr_eq(&cq.inner.ctx, ctx) {
                return Err(VerbsError::invalid(
                    "ibv_create_qp",
                    format!(
                        "a CQ of {} cannot serve a QP of {}",
                        cq.inner.ctx.name(),
                        ctx.name()
                    ),
                ));
            }
        }
        // SAFETY: ibv_qp_init_attr is pointers and integers; all-zero (NULL
        // pointers) is valid.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.inner.cq;
        init.recv_cq = recv_cq.inner.cq;
        init.cap = sys::ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_send_sge,
            max_recv_sge: caps.max_recv_sge,
            max_inline_data: caps.max_inline_data,
        };
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        // Selective signalling: only SIGNALED requests complete.
        init.sq_sig_all = 0;
        clear_errno();
        // SAFETY: the PD and both CQs are live (we hold them) and of one
        // context; `init` is valid for the call; the granted sizes are
        // written back into `init.cap`.
        let qp = unsafe { sys::ibv_create_qp(pd.as_ptr(), &mut init) };
        if qp.is_null() {
            return Err(verb_error("ibv_create_qp", ctx.name(), errno_or_eio()));
        }
        // SAFETY: a live QP from the library.
        let qp_num = unsafe { (*qp).qp_num };
        let granted = caps_from_native(&init.cap);
        tracing::debug!(qp_num, caps = ?granted, "created RC queue pair");
        Ok(Self {
            qp,
            qp_num,
            caps: granted,
            pd: Arc::clone(pd),
            send_cq: Arc::clone(&send_cq.inner),
            recv_cq: Arc::clone(&recv_cq.inner),
        })
    }

    pub(crate) fn device(&self) -> &str {
        self.pd.context().name()
    }

    pub(crate) fn pd(&self) -> &Arc<PdInner> {
        &self.pd
    }

    /// `ibv_modify_qp` with a mask built by someone else (rdma_cm's
    /// `rdma_init_qp_attr`).
    pub(crate) fn modify_raw(
        &self,
        operation: &'static str,
        attr: &mut sys::ibv_qp_attr,
        mask: c_int,
    ) -> Result<()> {
        // SAFETY: the QP is live; `attr` is valid and `mask` names fields
        // rdma_init_qp_attr (or we) set in it.
        let ret = unsafe { sys::ibv_modify_qp(self.qp, attr, mask) };
        if ret != 0 {
            return Err(verb_error(operation, self.device(), ret_errno(ret)));
        }
        Ok(())
    }

    fn modify(
        &self,
        operation: &'static str,
        attr: &mut sys::ibv_qp_attr,
        bits: &[sys::ibv_qp_attr_mask],
    ) -> Result<()> {
        // SAFETY: the QP is live; `attr` is valid and the mask names only
        // fields we set.
        let ret = unsafe { sys::ibv_modify_qp(self.qp, attr, mask(bits)) };
        if ret != 0 {
            return Err(verb_error(operation, self.device(), ret_errno(ret)));
        }
        Ok(())
    }

    /// Clamps a READ depth to the device's limit, as perftest does.
    fn clamp_rd_atomic(&self, asked: u8, limit: u32, what: &'static str) -> u8 {
        let limit = u8::try_from(limit).unwrap_or(u8::MAX);
        if limit != 0 && asked > limit {
            tracing::debug!(
                qp_num = self.qp_num,
                asked,
                limit,
                what,
                "clamped to the device"
            );
            limit
        } else {
            asked
        }
    }
}

/// The 24-bit PSN check shared by RTR and RTS.
fn check_psn(operation: &'static str, psn: u32) -> Result<()> {
    if psn > 0x00ff_ffff {
        return Err(VerbsError::invalid(
            operation,
            format!("PSN {psn:#x} exceeds 24 bits"),
        ));
    }
    Ok(())
}

fn wr_opcode(op: &SendOp) -> (sys::ibv_wr_opcode::Type, Option<u32>, Option<(u64, u32)>) {
    use sys::ibv_wr_opcode as o;
    match *op {
        SendOp::Write { remote_addr, rkey } => {
            (o::IBV_WR_RDMA_WRITE, None, Some((remote_addr, rkey)))
        }
        SendOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        } => (
            o::IBV_WR_RDMA_WRITE_WITH_IMM,
            Some(imm),
            Some((remote_addr, rkey)),
        ),
        SendOp::Read { remote_addr, rkey } => {
            (o::IBV_WR_RDMA_READ, None, Some((remote_addr, rkey)))
        }
        SendOp::Send => (o::IBV_WR_SEND, None, None),
        SendOp::SendWithImm { imm } => (o::IBV_WR_SEND_WITH_IMM, Some(imm), None),
    }
}

fn to_sge(s: &crate::types::Sge) -> sys::ibv_sge {
    sys::ibv_sge {
        addr: s.addr,
        length: s.length,
        lkey: s.lkey,
    }
}

/// The index of `bad` in `base[..len]`, or `None` when it points elsewhere.
fn index_of<T>(base: *const T, len: usize, bad: *const T) -> Option<usize> {
    let size = std::mem::size_of::<T>();
    let off = (bad as usize).checked_sub(base as usize)?;
    (off % size == 0 && off / size < len).then_some(off / size)
}

/// What a failed post took of the batch `base[..len]`, by its `bad_wr`:
/// the prefix before it, or [`Posted::Unknown`] when it is not one of ours
/// (never "0 accepted": requests may have been posted).
fn posted_by<T>(base: *const T, len: usize, bad: *const T) -> Posted {
    index_of(base, len, bad).map_or(Posted::Unknown, Posted::Prefix)
}

impl RdmaQp {
    /// What a failed `ibv_post_send`/`ibv_post_recv` (`queue`: "send" or
    /// "recv") reports: the accepted prefix, located by `bad_wr` (a
    /// `bad_wr` outside the batch is [`Posted::Unknown`]), and why.
    /// ENOMEM from a post means the work queue is full.
    fn post_error(&self, queue: &'static str, posted: Posted, ret: c_int) -> PostError {
        let (operation, depth) = match queue {
            "send" => ("ibv_post_send", self.caps.max_send_wr),
            _ => ("ibv_post_recv", self.caps.max_recv_wr),
        };
        if posted == Posted::Unknown {
            tracing::warn!(
                qp_num = self.qp_num,
                "{operation} failed with a bad_wr outside the batch: what was posted \
                 is unknown; the QP must be drained"
            );
        }
        let errno = ret_errno(ret);
        let error = if errno == libc::ENOMEM {
            VerbsError::QueueFull {
                queue,
                qp_num: self.qp_num,
                depth,
            }
        } else {
            verb_error(operation, self.device(), errno)
        };
        PostError { posted, error }
    }

    /// The checks a provider would only answer with a misleading errno (or
    /// not make at all) for one send request: an INLINE payload is copied
    /// by the CPU from `sge.addr`, so it must be host memory (never a
    /// dma-buf MR, whose addresses are iovas) and fit the QP's granted
    /// `max_inline_data` (libmlx5 answers ENOMEM, which reads as a full
    /// queue and would be retried forever), and READs cannot be inline.
    fn check_send(&self, r: &SendRequest) -> Result<()> {
        const OP: &str = "ibv_post_send";
        if !r.flags.contains(SendFlags::INLINE) {
            return Ok(());
        }
        if matches!(r.op, SendOp::Read { .. }) {
            return Err(VerbsError::invalid(OP, "INLINE on an RDMA READ"));
        }
        let total = r.byte_len();
        if total > u64::from(self.caps.max_inline_data) {
            return Err(VerbsError::invalid(
                OP,
                format!(
                    "{total} inline bytes > the QP's max_inline_data {}",
                    self.caps.max_inline_data
                ),
            ));
        }
        if let Some(sge) = r.sg_list.iter().find(|s| self.pd.is_dmabuf_lkey(s.lkey)) {
            return Err(VerbsError::invalid(
                OP,
                format!(
                    "INLINE payload in a dma-buf MR (lkey {:#x}): its addresses are iovas \
                     the CPU cannot read",
                    sge.lkey
                ),
            ));
        }
        Ok(())
    }
}

impl QueuePair for RdmaQp {
    fn qp_num(&self) -> u32 {
        self.qp_num
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn state(&self) -> Result<QpState> {
        let mut attr = zeroed_attr();
        // SAFETY: all-zero is a valid ibv_qp_init_attr, see `create`.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        let m = mask(&[sys::ibv_qp_attr_mask::IBV_QP_STATE]);
        // SAFETY: the QP is live; both out-parameters are valid.
        let ret = unsafe { sys::ibv_query_qp(self.qp, &mut attr, m, &mut init) };
        if ret != 0 {
            return Err(verb_error("ibv_query_qp", self.device(), ret_errno(ret)));
        }
        QpState::from_native(attr.qp_state).ok_or_else(|| {
            VerbsError::invalid(
                "ibv_query_qp",
                format!("unknown QP state {}", attr.qp_state),
            )
        })
    }

    #[tracing::instrument(level = "debug", skip(self), fields(device = %self.device(), qp_num = self.qp_num))]
    fn to_reset(&self) -> Result<()> {
        let mut attr = zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RESET;
        self.modify(
            "ibv_modify_qp(RESET)",
            &mut attr,
            &[sys::ibv_qp_attr_mask::IBV_QP_STATE],
        )
    }

    fn query(&self) -> Result<QpAttributes> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = zeroed_attr();
        // SAFETY: all-zero is a valid ibv_qp_init_attr, see `create`.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        let bits = mask(&[
            m::IBV_QP_STATE,
            m::IBV_QP_CAP,
            m::IBV_QP_MAX_QP_RD_ATOMIC,
            m::IBV_QP_MAX_DEST_RD_ATOMIC,
            m::IBV_QP_PATH_MTU,
            m::IBV_QP_DEST_QPN,
            m::IBV_QP_SQ_PSN,
            m::IBV_QP_RQ_PSN,
            m::IBV_QP_TIMEOUT,
            m::IBV_QP_RETRY_CNT,
            m::IBV_QP_RNR_RETRY,
            m::IBV_QP_MIN_RNR_TIMER,
        ]);
        // SAFETY: the QP is live; both out-parameters are valid.
        let ret = unsafe { sys::ibv_query_qp(self.qp, &mut attr, bits, &mut init) };
        if ret != 0 {
            return Err(verb_error("ibv_query_qp", self.device(), ret_errno(ret)));
        }
        let state = QpState::from_native(attr.qp_state).ok_or_else(|| {
            VerbsError::invalid(
                "ibv_query_qp",
                format!("unknown QP state {}", attr.qp_state),
            )
        })?;
        let before_rtr = matches!(state, QpState::Reset | QpState::Init);
        Ok(QpAttributes {
            state,
            // The sizes `ibv_create_qp` wrote back (what posts are checked
            // against); the rest from the query.
            caps: self.caps,
            max_rd_atomic: attr.max_rd_atomic,
            max_dest_rd_atomic: attr.max_dest_rd_atomic,
            path_mtu: if before_rtr {
                None
            } else {
                Mtu::from_native(attr.path_mtu)
            },
            dest_qp_num: attr.dest_qp_num,
            sq_psn: attr.sq_psn,
            rq_psn: attr.rq_psn,
            timeout: attr.timeout,
            retry_cnt: attr.retry_cnt,
            rnr_retry: attr.rnr_retry,
            min_rnr_timer: attr.min_rnr_timer,
        })
    }

    #[tracing::instrument(level = "debug", skip(self), fields(device = %self.device(), qp_num = self.qp_num))]
    fn to_init(&self, params: &InitParams) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = params.pkey_index;
        attr.port_num = params.port;
        attr.qp_access_flags = params.access.bits();
        self.modify(
            "ibv_modify_qp(INIT)",
            &mut attr,
            &[
                m::IBV_QP_STATE,
                m::IBV_QP_PKEY_INDEX,
                m::IBV_QP_PORT,
                m::IBV_QP_ACCESS_FLAGS,
            ],
        )
    }

    #[tracing::instrument(level = "debug", skip(self), fields(device = %self.device(), qp_num = self.qp_num))]
    fn to_rtr(&self, params: &RtrParams) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        const OP: &str = "ibv_modify_qp(RTR)";
        check_psn(OP, params.remote.psn)?;
        let remote = &params.remote;
        let global = !remote.gid.is_zero();
        if !global && self.pd.context().link_layer(params.port)? == LinkLayer::Ethernet {
            return Err(VerbsError::invalid(
                OP,
                "RoCE addresses peers by GID, and the peer's GID is zero",
            ));
        }
        let mut attr = zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = params.path_mtu as u32;
        attr.dest_qp_num = remote.qp_num;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = self.clamp_rd_atomic(
            params.max_dest_rd_atomic,
            self.pd.context().attrs().max_qp_rd_atom,
            "max_dest_rd_atomic",
        );
        attr.min_rnr_timer = params.min_rnr_timer;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = params.port;
        if global {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = sys::ibv_gid { raw: remote.gid.0 };
            attr.ah_attr.grh.sgid_index = params.sgid_index;
            attr.ah_attr.grh.hop_limit = params.hop_limit;
            attr.ah_attr.grh.traffic_class = params.traffic_class;
            attr.ah_attr.grh.flow_label = 0;
        }
        self.modify(
            OP,
            &mut attr,
            &[
                m::IBV_QP_STATE,
                m::IBV_QP_AV,
                m::IBV_QP_PATH_MTU,
                m::IBV_QP_DEST_QPN,
                m::IBV_QP_RQ_PSN,
                m::IBV_QP_MAX_DEST_RD_ATOMIC,
                m::IBV_QP_MIN_RNR_TIMER,
            ],
        )
    }

    #[tracing::instrument(level = "debug", skip(self), fields(device = %self.device(), qp_num = self.qp_num))]
    fn to_rts(&self, params: &RtsParams) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        params.validate()?;
        let mut attr = zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = params.sq_psn;
        attr.timeout = params.timeout;
        attr.retry_cnt = params.retry_cnt;
        attr.rnr_retry = params.rnr_retry;
        attr.max_rd_atomic = self.clamp_rd_atomic(
            params.max_rd_atomic,
            self.pd.context().attrs().max_qp_init_rd_atom,
            "max_rd_atomic",
        );
        self.modify(
            "ibv_modify_qp(RTS)",
            &mut attr,
            &[
                m::IBV_QP_STATE,
                m::IBV_QP_SQ_PSN,
                m::IBV_QP_TIMEOUT,
                m::IBV_QP_RETRY_CNT,
                m::IBV_QP_RNR_RETRY,
                m::IBV_QP_MAX_QP_RD_ATOMIC,
            ],
        )
    }

    #[tracing::instrument(level = "debug", skip(self), fields(device = %self.device(), qp_num = self.qp_num))]
    fn to_error(&self) -> Result<()> {
        let mut attr = zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        self.modify(
            "ibv_modify_qp(ERR)",
            &mut attr,
            &[sys::ibv_qp_attr_mask::IBV_QP_STATE],
        )
    }

    unsafe fn post_send(&self, requests: &[SendRequest]) -> Result<(), PostError> {
        let _span = tracing::trace_span!("ibv_post_send", qp_num = self.qp_num, n = requests.len())
            .entered();
        // Requests the provider must not see are refused before the post:
        // the prefix before the first of them is posted, as a provider
        // would take it, and the refusal reported after it.
        let refused = requests
            .iter()
            .enumerate()
            .find_map(|(i, r)| self.check_send(r).err().map(|e| (i, e)));
        let take = refused.as_ref().map_or(requests.len(), |(i, _)| *i);
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.post_send_raw(&requests[..take]) }?;
        match refused {
            Some((i, error)) => Err(PostError::prefix(i, error)),
            None => Ok(()),
        }
    }

    unsafe fn post_recv(&self, requests: &[RecvRequest]) -> Result<(), PostError> {
        let _span = tracing::trace_span!("ibv_post_recv", qp_num = self.qp_num, n = requests.len())
            .entered();
        if requests.is_empty() {
            return Ok(());
        }
        // As in `post_send_raw`: on the stack for small batches; the
        // arrays are filled first, then each base pointer is taken once,
        // after the last mutation through the SmallVecs, and every link
        // is written through it.
        let mut sges: SmallVec<[sys::ibv_sge; 16]> = requests
            .iter()
            .flat_map(|r| r.sg_list.iter().map(to_sge))
            .collect();
        let mut wrs: SmallVec<[sys::ibv_recv_wr; 8]> = requests
            .iter()
            .map(|r| sys::ibv_recv_wr {
                wr_id: r.wr_id,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: c_int::try_from(r.sg_list.len()).unwrap_or(c_int::MAX),
            })
            .collect();
        // SAFETY: one WR per request with its SG entries laid out in
        // order; memory valid by our caller's contract.
        unsafe {
            self.post_list(
                &mut wrs,
                &mut sges,
                requests.iter().map(|r| r.sg_list.len()),
            )
        }
    }
}

/// A work request of a linked list whose SG entries lie in one array.
trait LinkedWr: Sized {
    /// The queue, as [`RdmaQp::post_error`] names it.
    const QUEUE: &'static str;
    /// Where `wr`'s `next` and `sg_list` fields are.
    fn fields(wr: *mut Self) -> (*mut *mut Self, *mut *mut sys::ibv_sge);
    /// `ibv_post_send` or `ibv_post_recv`.
    ///
    /// # Safety
    /// As the verb's: a live QP, a valid list, memory valid by the trait
    /// contract of the post.
    unsafe fn post(qp: *mut sys::ibv_qp, wr: *mut Self, bad: *mut *mut Self) -> c_int;
}

impl LinkedWr for sys::ibv_send_wr {
    const QUEUE: &'static str = "send";
    fn fields(wr: *mut Self) -> (*mut *mut Self, *mut *mut sys::ibv_sge) {
        // SAFETY: only field addresses are taken (no read, no reference).
        unsafe { (&raw mut (*wr).next, &raw mut (*wr).sg_list) }
    }
    unsafe fn post(qp: *mut sys::ibv_qp, wr: *mut Self, bad: *mut *mut Self) -> c_int {
        // SAFETY: forwarded from our caller's contract.
        unsafe { sys::ibv_post_send(qp, wr, bad) }
    }
}

impl LinkedWr for sys::ibv_recv_wr {
    const QUEUE: &'static str = "recv";
    fn fields(wr: *mut Self) -> (*mut *mut Self, *mut *mut sys::ibv_sge) {
        // SAFETY: as above.
        unsafe { (&raw mut (*wr).next, &raw mut (*wr).sg_list) }
    }
    unsafe fn post(qp: *mut sys::ibv_qp, wr: *mut Self, bad: *mut *mut Self) -> c_int {
        // SAFETY: forwarded from our caller's contract.
        unsafe { sys::ibv_post_recv(qp, wr, bad) }
    }
}

/// Links the WRs at `base` into a list and points each at its SG entries
/// in the array at `sge_base`, every write through those two pointers
/// (taken once, after the arrays' last mutation: no reborrow invalidates
/// them). `sg_lens` gives each WR's number of SG entries, in order.
///
/// # Safety
/// `base` points at one WR per item of `sg_lens`, and `sge_base` at their
/// SG entries laid end to end; both arrays are live and reached through no
/// other path while this runs.
unsafe fn link<W: LinkedWr>(
    base: *mut W,
    sge_base: *mut sys::ibv_sge,
    sg_lens: impl ExactSizeIterator<Item = usize>,
) {
    let n = sg_lens.len();
    let mut first_sge = 0;
    for (i, len) in sg_lens.enumerate() {
        // SAFETY: `i < n` WRs and `first_sge + len` SG entries lie in the
        // arrays by the caller's contract.
        unsafe {
            let (next, sg_list) = W::fields(base.add(i));
            if len != 0 {
                *sg_list = sge_base.add(first_sge);
            }
            if i + 1 < n {
                *next = base.add(i + 1);
            }
        }
        first_sge += len;
    }
}

impl RdmaQp {
    /// Links `wrs` (each with `sg_lens` entries of `sges`, in order) and
    /// posts them with one call of the verb; a failure says what was
    /// posted.
    ///
    /// # Safety
    /// The SG entries name memory valid as the post's trait contract asks.
    unsafe fn post_list<W: LinkedWr>(
        &self,
        wrs: &mut [W],
        sges: &mut [sys::ibv_sge],
        sg_lens: impl ExactSizeIterator<Item = usize>,
    ) -> Result<(), PostError> {
        // Each base pointer is taken once, after the arrays' last mutation
        // through their owners; every link is written through it.
        let sge_base = sges.as_mut_ptr();
        let base = wrs.as_mut_ptr();
        let n = wrs.len();
        // SAFETY: `base` covers the `n` WRs and `sge_base` all SG entries,
        // each WR's in order; neither array is touched through any other
        // path until the post returns.
        unsafe { link(base, sge_base, sg_lens) };
        let mut bad: *mut W = std::ptr::null_mut();
        // SAFETY: the QP is live and created by this context's provider, so
        // the inline wrapper's ops table is the right one; the linked WRs
        // and their SG arrays live until the call returns (the provider
        // copies them into the queue); the memory the SG entries name is
        // valid by our caller's contract.
        let ret = unsafe { W::post(self.qp, base, &mut bad) };
        if ret == 0 {
            return Ok(());
        }
        Err(self.post_error(W::QUEUE, posted_by(base, n, bad), ret))
    }

    /// Links `requests` and posts them with one `ibv_post_send`, checks done.
    ///
    /// # Safety
    /// As [`QueuePair::post_send`].
    unsafe fn post_send_raw(&self, requests: &[SendRequest]) -> Result<(), PostError> {
        if requests.is_empty() {
            return Ok(());
        }
        // All SG entries in one array, so the WRs can point into it. Both
        // arrays live on the stack for batches of up to 8 WRs and 16 SG
        // entries (no allocation per post). They are filled first; then
        // each base pointer is taken once, after the last mutation through
        // the SmallVecs, and every WR's `sg_list` and `next` is written
        // through it, so no pointer is invalidated by a later reborrow.
        let mut sges: SmallVec<[sys::ibv_sge; 16]> = requests
            .iter()
            .flat_map(|r| r.sg_list.iter().map(to_sge))
            .collect();
        let mut wrs: SmallVec<[sys::ibv_send_wr; 8]> = SmallVec::with_capacity(requests.len());
        for r in requests {
            let (opcode, imm, rdma) = wr_opcode(&r.op);
            // SAFETY: ibv_send_wr is pointers, integers and unions of them;
            // all-zero (NULL pointers) is valid, as with C's memset.
            let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = r.wr_id;
            wr.opcode = opcode;
            wr.send_flags = r.flags.bits();
            wr.num_sge = c_int::try_from(r.sg_list.len()).unwrap_or(c_int::MAX);
            if let Some(imm) = imm {
                wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            }
            if let Some((remote_addr, rkey)) = rdma {
                wr.wr.rdma = sys::rdma_t { remote_addr, rkey };
            }
            wrs.push(wr);
        }
        // SAFETY: one WR per request with its SG entries laid out in
        // order; memory valid by our caller's contract.
        unsafe {
            self.post_list(
                &mut wrs,
                &mut sges,
                requests.iter().map(|r| r.sg_list.len()),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_wr_maps_back_to_an_index() {
        let v = [0u64; 4];
        let base = v.as_ptr();
        assert_eq!(index_of(base, 4, base), Some(0));
        assert_eq!(index_of(base, 4, base.wrapping_add(3)), Some(3));
        assert_eq!(index_of(base, 4, base.wrapping_add(4)), None);
        assert_eq!(index_of(base, 4, std::ptr::null()), None);
        // A bad_wr outside the batch is not "0 accepted": it is unknown.
        assert_eq!(posted_by(base, 4, base.wrapping_add(2)), Posted::Prefix(2));
        assert_eq!(posted_by(base, 4, base.wrapping_add(4)), Posted::Unknown);
        assert_eq!(posted_by(base, 4, std::ptr::null()), Posted::Unknown);
    }

    fn wc(wr_id: u64) -> sys::ibv_wc {
        // SAFETY: ibv_wc is integers and unions of them; all-zero is valid.
        let mut wc: sys::ibv_wc = unsafe { std::mem::zeroed() };
        wc.wr_id = wr_id;
        wc
    }

    /// A failure in a later chunk of one poll: what the earlier chunks took
    /// off the CQ comes back now, the failure on the next call.
    #[test]
    fn poll_keeps_completions_taken_before_a_failure() {
        let pending = PendingError::default();
        let calls = std::cell::Cell::new(0);
        let mut next_id = 0u64;
        let mut fake = |wcs: &mut [MaybeUninit<sys::ibv_wc>]| -> c_int {
            calls.set(calls.get() + 1);
            if calls.get() > 1 {
                return -1;
            }
            for slot in wcs.iter_mut() {
                slot.write(wc(next_id));
                next_id += 1;
            }
            c_int::try_from(wcs.len()).unwrap()
        };
        let mut out = [Completion::default(); POLL_CHUNK * 2];
        let got = poll_loop(&mut out, &pending, "fake0", &mut fake).expect("first poll");
        assert_eq!(
            got, POLL_CHUNK,
            "the first chunk's completions are returned"
        );
        assert!(
            out[..got]
                .iter()
                .enumerate()
                .all(|(i, c)| c.wr_id == i as u64)
        );
        let err = poll_loop(&mut out, &pending, "fake0", &mut fake).expect_err("held error");
        assert!(
            matches!(err, VerbsError::CompletionQueue { code: -1, .. }),
            "{err}"
        );
        assert_eq!(err.errno(), None, "a poll failure carries no errno");
        // Reported once; the next poll asks the CQ again.
        let calls_before = calls.get();
        assert!(poll_loop(&mut out, &pending, "fake0", &mut fake).is_err());
        assert_eq!(calls.get(), calls_before + 1);
    }

    #[test]
    fn poll_failure_with_nothing_taken_is_reported_at_once() {
        let pending = PendingError::default();
        let mut out = [Completion::default(); 4];
        let err = poll_loop(&mut out, &pending, "fake0", |_| -2).unwrap_err();
        assert!(
            matches!(err, VerbsError::CompletionQueue { code: -2, .. }),
            "{err}"
        );
        assert!(pending.take().is_none());
    }

    #[test]
    fn send_ops_map_to_verbs_opcodes() {
        use sys::ibv_wr_opcode as o;
        let (op, imm, rdma) = wr_opcode(&SendOp::WriteWithImm {
            remote_addr: 7,
            rkey: 9,
            imm: 0x0102_0304,
        });
        assert_eq!(
            (op, imm, rdma),
            (
                o::IBV_WR_RDMA_WRITE_WITH_IMM,
                Some(0x0102_0304),
                Some((7, 9))
            )
        );
        assert_eq!(wr_opcode(&SendOp::Send).0, o::IBV_WR_SEND);
        assert_eq!(
            wr_opcode(&SendOp::Read {
                remote_addr: 1,
                rkey: 2
            })
            .0,
            o::IBV_WR_RDMA_READ
        );
    }
}
