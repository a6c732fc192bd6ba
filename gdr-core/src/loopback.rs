//! A loopback pair of queue pairs on one device, and the self-check built on
//! it: prove that a registration really works with one RDMA WRITE and one
//! READ, since registration can succeed while transfers through it fail
//! (every peer has met such bugs).
//!
//! The two QPs are connected to each other through the device's own port and
//! GID, exactly as two peers would be, so the check exercises the NIC's real
//! data path (on SoftRoCE: the kernel's rxe packet path).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::cache::{DomainBudget, Reservation};
use crate::cq_wait::CqWaiter;

use hal_verbs::{
    AccessFlags, AddressFamily, Api, ConnectionInfo, Context, Gid, InitParams, LinkLayer,
    MemoryRegion, Mtu, PortState, ProtectionDomain, QpCaps, QueuePair, RtrParams, RtsParams,
    SendFlags, SendOp, SendRequest, SgList, Sge, VerbsError, WcStatus, select_roce_v2_gid,
};

/// Why a loopback operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoopbackError {
    /// A verbs call failed.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// The port is not usable.
    #[error("port {port} of {device} is {state:?}, not active")]
    PortNotActive {
        /// Device.
        device: String,
        /// Port.
        port: u8,
        /// Its state.
        state: PortState,
    },
    /// An Ethernet port without a RoCE v2 GID.
    #[error("{device} port {port} has no RoCE v2 GID")]
    NoGid {
        /// Device.
        device: String,
        /// Port.
        port: u8,
    },
    /// A work request completed with an error status.
    #[error("{operation} completed with {status}")]
    Completion {
        /// `RDMA WRITE` or `RDMA READ`.
        operation: &'static str,
        /// The native status.
        status: WcStatus,
    },
    /// No completion within the deadline.
    #[error("{operation} did not complete within {timeout:?}")]
    Timeout {
        /// The operation.
        operation: &'static str,
        /// The deadline.
        timeout: Duration,
    },
    /// No completion within the deadline, and moving the QP to the error
    /// state did not flush the request either: the NIC may still be
    /// accessing the memory, so the buffers of the operation (and the QPs)
    /// were leaked rather than freed.
    #[error(
        "{operation} did not complete within {timeout:?} and could not be flushed: its buffers are leaked"
    )]
    Unquiesced {
        /// The operation.
        operation: &'static str,
        /// The deadline.
        timeout: Duration,
    },
    /// The PD's budget of MRs is spent.
    #[error("{0}")]
    Budget(crate::cache::BudgetExceeded),
    /// No eventfd could be made to wait on (the process is out of fds).
    #[error("no eventfd to wait for completions on (errno {errno})")]
    WakeFd {
        /// The errno of `eventfd(2)`.
        errno: i32,
    },
    /// The bytes read back differ from those written.
    #[error("data read back differs from data written at byte {first_difference}")]
    Mismatch {
        /// Offset of the first differing byte.
        first_difference: usize,
    },
}

/// How the pair's QPs reach each other: the port, and its GID and LID.
#[derive(Debug, Clone, Copy)]
struct Path {
    port: u8,
    gid: Gid,
    sgid_index: u8,
    lid: u16,
    mtu: Mtu,
}

impl Path {
    /// The port's state, GID (RoCE v2, IPv4 first) or LID, and MTU.
    fn discover<A: Api>(context: &A::Context, port: u8) -> Result<Self, LoopbackError> {
        let device = context.name();
        let attrs = context.query_port(port)?;
        if attrs.state != PortState::Active {
            return Err(LoopbackError::PortNotActive {
                device,
                port,
                state: attrs.state,
            });
        }
        let (gid, sgid_index) = match attrs.link_layer {
            LinkLayer::InfiniBand => (Gid::default(), 0),
            LinkLayer::Ethernet | LinkLayer::Unspecified => {
                let table = context.gid_table(port)?;
                let entry = select_roce_v2_gid(&table, AddressFamily::V4)
                    .or_else(|| select_roce_v2_gid(&table, AddressFamily::V6))
                    .ok_or(LoopbackError::NoGid {
                        device: device.clone(),
                        port,
                    })?;
                (entry.gid, entry.index as u8)
            }
        };
        Ok(Self {
            port,
            gid,
            sgid_index,
            lid: attrs.lid,
            mtu: attrs.active_mtu,
        })
    }
}

/// How the QPs of a [`QpPair`] are created and connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairConfig {
    /// Queue sizes asked for (both QPs).
    pub caps: QpCaps,
    /// RDMA READs each side may have outstanding, as initiator
    /// (`max_rd_atomic`) and as target (`max_dest_rd_atomic`); the backend
    /// clamps it to the device's limits, as perftest does.
    pub rd_atomic: u8,
}

impl Default for PairConfig {
    fn default() -> Self {
        Self {
            caps: QpCaps::default(),
            rd_atomic: RtsParams::default().max_rd_atomic,
        }
    }
}

/// Two RC queue pairs on one device, connected to each other, for callers
/// that drive the requester themselves (benchmarks): the equivalent of
/// perftest's client and server on one host, in one process.
#[derive(Debug)]
pub struct QpPair<A: Api> {
    /// The side that posts.
    pub requester: A::QueuePair,
    /// The target of the requester's one-sided operations; never posted to.
    pub responder: A::QueuePair,
}

impl<A: Api> QpPair<A> {
    /// Creates and connects the pair on `port` of `context`, in `pd`, both
    /// QPs completing into `cq`.
    pub fn connect(
        context: &A::Context,
        pd: &A::ProtectionDomain,
        cq: &A::CompletionQueue,
        port: u8,
        config: &PairConfig,
    ) -> Result<Self, LoopbackError> {
        let path = Path::discover::<A>(context, port)?;
        let pair = connect_pair::<A>(pd, cq, path, config)?;
        Ok(Self {
            requester: pair.requester,
            responder: pair._responder,
        })
    }
}

/// The two QPs; rebuilt after a failure, since an RC QP that saw an error
/// completion is in the error state for good.
#[derive(Debug)]
struct Pair<A: Api> {
    requester: A::QueuePair,
    /// Never posted to: it only has to exist, connected, for the
    /// requester's one-sided operations to target it.
    _responder: A::QueuePair,
}

/// Two RC queue pairs on one device connected to each other.
#[derive(Debug)]
pub struct Loopback<A: Api> {
    // Field order is drop order: QPs before the CQ and PD they use, the
    // CQ before its channel.
    pair: Mutex<Pair<A>>,
    cq: A::CompletionQueue,
    /// Where the CQ reports once armed, so a wait sleeps instead of
    /// polling (`None`: the provider made none; the CQ is polled).
    channel: Option<A::CompletionChannel>,
    waiter: CqWaiter,
    pd: Arc<A::ProtectionDomain>,
    path: Path,
    timeout: Duration,
    /// Work request ids, unique per operation: a late completion of an
    /// earlier, timed-out operation is never taken for the current one.
    next_wr_id: AtomicU64,
    /// The budget the self-check's scratch MRs count against.
    budget: Option<Arc<DomainBudget>>,
}

impl<A: Api> Loopback<A> {
    /// Creates the pair on `port` of `context`, on a PD of its own.
    pub fn new(context: &A::Context, port: u8) -> Result<Self, LoopbackError> {
        let pd = Arc::new(context.alloc_pd()?);
        Self::with_pd(context, pd, port)
    }

    /// Creates the pair on an existing PD (to check registrations made in it).
    pub fn with_pd(
        context: &A::Context,
        pd: Arc<A::ProtectionDomain>,
        port: u8,
    ) -> Result<Self, LoopbackError> {
        let path = Path::discover::<A>(context, port)?;
        let channel = context
            .create_comp_channel()
            .inspect_err(|e| tracing::debug!(error = %e, "no completion channel: the CQ is polled"))
            .ok();
        let cq = match &channel {
            Some(channel) => context.create_cq_on_channel(64, channel, 0)?,
            None => context.create_cq(64)?,
        };
        let waiter = CqWaiter::new().map_err(|e| LoopbackError::WakeFd {
            errno: e.raw_os_error().unwrap_or(0),
        })?;
        let pair = connect_pair::<A>(&pd, &cq, path, &PairConfig::default())?;
        Ok(Self {
            pair: Mutex::new(pair),
            cq,
            channel,
            waiter,
            pd,
            path,
            timeout: Duration::from_secs(10),
            next_wr_id: AtomicU64::new(1),
            budget: None,
        })
    }

    /// Counts the self-check's scratch MRs against `budget` (the PD's).
    pub fn with_budget(mut self, budget: Arc<DomainBudget>) -> Self {
        self.budget = Some(budget);
        self
    }

    fn reserve(&self, bytes: usize) -> Result<Option<Reservation>, LoopbackError> {
        self.budget
            .as_ref()
            .map(|b| b.reserve(bytes as u64))
            .transpose()
            .map_err(LoopbackError::Budget)
    }

    /// The protection domain both QPs use: registrations to check go here.
    pub fn pd(&self) -> &Arc<A::ProtectionDomain> {
        &self.pd
    }

    /// Changes how long an operation may take before it is reported as
    /// timed out (default 10 s: SoftRoCE under emulation is slow).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Runs one signaled RDMA operation from the requester and waits for it.
    /// On a timeout the requester is moved to the error state and its flush
    /// awaited, so the operation is over when this returns, unless
    /// [`LoopbackError::Unquiesced`] says otherwise (then the old QPs are
    /// leaked, and the caller must leak the operation's memory too).
    ///
    /// # Safety
    /// `local` must lie in a live registration of this PD and stay valid until
    /// this returns, or forever after an [`LoopbackError::Unquiesced`];
    /// `remote_addr..+local.length` is checked by the NIC against the
    /// registration `rkey` names.
    pub unsafe fn run(
        &self,
        op: SendOp,
        local: Sge,
        operation: &'static str,
    ) -> Result<(), LoopbackError> {
        let wr_id = self.next_wr_id.fetch_add(1, Ordering::Relaxed);
        let request = SendRequest {
            wr_id,
            op,
            sg_list: SgList::from_slice(&[local]),
            flags: SendFlags::SIGNALED,
        };
        // One operation at a time: the pair is held until it completes.
        let mut pair = self.pair.lock().unwrap_or_else(PoisonError::into_inner);
        let qp_num = pair.requester.qp_num();
        // SAFETY: the caller guarantees `local` stays valid until completion,
        // and we wait for that completion (or its flush) below.
        let result = match unsafe { pair.requester.post_send(std::slice::from_ref(&request)) } {
            Ok(()) => self.wait(qp_num, wr_id, operation),
            Err(e) => Err(e.error.into()),
        };
        let result = match result {
            Err(LoopbackError::Timeout { .. }) => {
                // Still in flight: drain the requester (to the error state,
                // then a marker whose flush proves everything before it is
                // done), so the NIC is done with the memory before anyone
                // frees it. Only the requester posts, and no receives.
                let drained = hal_verbs::drain::drain_with::<A>(
                    &pair.requester,
                    &self.cq,
                    &self.cq,
                    hal_verbs::drain::DrainOptions {
                        recv: false,
                        ..hal_verbs::drain::DrainOptions::new(self.timeout)
                    },
                );
                match drained {
                    Ok(_) => Err(LoopbackError::Timeout {
                        operation,
                        timeout: self.timeout,
                    }),
                    Err(e) => {
                        tracing::error!(error = %e.error, "the timed-out request could not be flushed");
                        Err(LoopbackError::Unquiesced {
                            operation,
                            timeout: self.timeout,
                        })
                    }
                }
            }
            other => other,
        };
        if let Err(error) = &result {
            // The requester (and, after a remote error, the responder) is in
            // the error state now: start over with a fresh pair. If that
            // fails too, the next run reports it.
            match connect_pair::<A>(&self.pd, &self.cq, self.path, &PairConfig::default()) {
                Ok(fresh) => {
                    let old = std::mem::replace(&mut *pair, fresh);
                    if matches!(error, LoopbackError::Unquiesced { .. }) {
                        // Destroying a QP the NIC has not let go of could
                        // free what it still uses: keep it.
                        std::mem::forget(old);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "rebuilding the loopback pair failed"),
            }
        }
        result
    }

    /// Waits for the completion of request `wr_id` of QP `qp_num`; other
    /// completions (late ones of earlier operations) are skipped. Waits as
    /// the engine does ([`CqWaiter`]): spins, then sleeps on the CQ's
    /// channel.
    fn wait(&self, qp_num: u32, wr_id: u64, operation: &'static str) -> Result<(), LoopbackError> {
        let deadline = Instant::now() + self.timeout;
        let mut completions = Vec::new();
        loop {
            completions.clear();
            let got = self.waiter.wait::<A>(
                &self.cq,
                self.channel.as_ref(),
                Some(deadline),
                &mut completions,
            )?;
            if got == 0 {
                return Err(LoopbackError::Timeout {
                    operation,
                    timeout: self.timeout,
                });
            }
            if let Some(c) = completions
                .iter()
                .find(|c| c.qp_num == qp_num && c.wr_id == wr_id)
            {
                return if c.status.is_success() {
                    Ok(())
                } else {
                    Err(LoopbackError::Completion {
                        operation,
                        status: c.status,
                    })
                };
            }
        }
    }

    /// Proves `target` with one RDMA WRITE of a pattern into
    /// `target.addr() + offset` and one READ back, comparing the bytes. Only
    /// the NIC touches `target`, so it may be GPU memory. Overwrites `len`
    /// bytes there.
    pub fn prove(
        &self,
        target: &A::MemoryRegion,
        offset: u64,
        len: usize,
    ) -> Result<(), LoopbackError> {
        if len == 0 || offset.saturating_add(len as u64) > target.len() as u64 {
            return Err(VerbsError::invalid(
                "loopback self-check",
                format!(
                    "{len} bytes at offset {offset} do not fit a {}-byte region",
                    target.len()
                ),
            )
            .into());
        }
        let length = u32::try_from(len)
            .map_err(|_| VerbsError::invalid("loopback self-check", "longer than 4 GiB"))?;
        let written: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let mut read_back = vec![0u8; len];
        let source_budget = self.reserve(len)?;
        // SAFETY: both scratch buffers live until the end of this function,
        // after the registrations (dropped first, in reverse order), or are
        // leaked with them.
        let source = unsafe {
            self.pd
                .register(written.as_ptr() as u64, len, AccessFlags::LOCAL_WRITE)
        }?;
        let sink_budget = self.reserve(len)?;
        // SAFETY: as above.
        let sink = unsafe {
            self.pd
                .register(read_back.as_mut_ptr() as u64, len, AccessFlags::LOCAL_WRITE)
        }?;
        let remote_addr = target.addr() + offset;
        let sge = |mr: &A::MemoryRegion| Sge {
            addr: mr.addr(),
            length,
            lkey: mr.lkey(),
        };
        // SAFETY: the SG entries lie in `source` and `sink`, alive until the
        // end of this function (or leaked below); `run` waits for each
        // completion or flush.
        let outcome = unsafe {
            self.run(
                SendOp::Write {
                    remote_addr,
                    rkey: target.rkey(),
                },
                sge(&source),
                "RDMA WRITE",
            )
            .and_then(|()| {
                self.run(
                    SendOp::Read {
                        remote_addr,
                        rkey: target.rkey(),
                    },
                    sge(&sink),
                    "RDMA READ",
                )
            })
        };
        if let Err(e @ LoopbackError::Unquiesced { .. }) = outcome {
            // A READ may still land in `read_back`: never free it.
            std::mem::forget((sink, sink_budget, read_back, source, source_budget, written));
            return Err(e);
        }
        outcome?;
        drop(sink);
        drop(source);
        drop((sink_budget, source_budget));
        match written.iter().zip(&read_back).position(|(a, b)| a != b) {
            None => Ok(()),
            Some(first_difference) => Err(LoopbackError::Mismatch { first_difference }),
        }
    }
}

/// Two new QPs in `pd`, connected to each other over `path`.
fn connect_pair<A: Api>(
    pd: &A::ProtectionDomain,
    cq: &A::CompletionQueue,
    path: Path,
    config: &PairConfig,
) -> Result<Pair<A>, VerbsError> {
    let requester = pd.create_qp(&config.caps, cq, cq)?;
    let responder = pd.create_qp(&config.caps, cq, cq)?;
    let info = |qp: &A::QueuePair, psn: u32| ConnectionInfo {
        qp_num: qp.qp_num(),
        psn,
        gid: path.gid,
        lid: path.lid,
        mtu: path.mtu,
    };
    let (requester_info, responder_info) = (info(&requester, 0x1000), info(&responder, 0x2000));
    for (qp, remote, own_psn) in [
        (&requester, responder_info, requester_info.psn),
        (&responder, requester_info, responder_info.psn),
    ] {
        qp.to_init(&InitParams {
            port: path.port,
            ..InitParams::default()
        })?;
        qp.to_rtr(&RtrParams {
            port: path.port,
            max_dest_rd_atomic: config.rd_atomic,
            ..RtrParams::new(remote, path.sgid_index, path.mtu)
        })?;
        qp.to_rts(&RtsParams {
            sq_psn: own_psn,
            max_rd_atomic: config.rd_atomic,
            ..RtsParams::default()
        })?;
    }
    Ok(Pair {
        requester,
        _responder: responder,
    })
}
