//! A loopback pair of queue pairs on one device, and the self-check built on
//! it: prove that a registration really works with one RDMA WRITE and one
//! READ, since registration can succeed while transfers through it fail
//! (every peer has met such bugs).
//!
//! The two QPs are connected to each other through the device's own port and
//! GID, exactly as two peers would be, so the check exercises the NIC's real
//! data path (on SoftRoCE: the kernel's rxe packet path).

use std::sync::Arc;
use std::time::{Duration, Instant};

use hal_verbs::{
    AccessFlags, AddressFamily, Api, Completion, CompletionQueue, ConnectionInfo, Context,
    InitParams, LinkLayer, MemoryRegion, PortState, ProtectionDomain, QpCaps, QueuePair, RtrParams,
    RtsParams, SendFlags, SendOp, SendRequest, SgList, Sge, VerbsError, WcStatus,
    select_roce_v2_gid,
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
    /// The bytes read back differ from those written.
    #[error("data read back differs from data written at byte {first_difference}")]
    Mismatch {
        /// Offset of the first differing byte.
        first_difference: usize,
    },
}

/// Two RC queue pairs on one device connected to each other.
#[derive(Debug)]
pub struct Loopback<A: Api> {
    // Field order is drop order: QPs before the CQ and PD they use.
    requester: A::QueuePair,
    responder: A::QueuePair,
    cq: A::CompletionQueue,
    pd: Arc<A::ProtectionDomain>,
    timeout: Duration,
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
            LinkLayer::InfiniBand => (Default::default(), 0),
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
        let cq = context.create_cq(64)?;
        let caps = QpCaps::default();
        let requester = pd.create_qp(&caps, &cq, &cq)?;
        let responder = pd.create_qp(&caps, &cq, &cq)?;
        let info = |qp: &A::QueuePair, psn: u32| ConnectionInfo {
            qp_num: qp.qp_num(),
            psn,
            gid,
            lid: attrs.lid,
            mtu: attrs.active_mtu,
        };
        let (requester_info, responder_info) = (info(&requester, 0x1000), info(&responder, 0x2000));
        for (qp, remote, own_psn) in [
            (&requester, responder_info, requester_info.psn),
            (&responder, requester_info, responder_info.psn),
        ] {
            qp.to_init(&InitParams {
                port,
                ..InitParams::default()
            })?;
            qp.to_rtr(&RtrParams {
                port,
                ..RtrParams::new(remote, sgid_index, attrs.active_mtu)
            })?;
            qp.to_rts(&RtsParams {
                sq_psn: own_psn,
                ..RtsParams::default()
            })?;
        }
        Ok(Self {
            requester,
            responder,
            cq,
            pd,
            timeout: Duration::from_secs(10),
        })
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
    ///
    /// # Safety
    /// `local` must lie in a live registration of this PD and stay valid until
    /// this returns; `remote_addr..+local.length` is checked by the NIC
    /// against the registration `rkey` names.
    pub unsafe fn run(
        &self,
        op: SendOp,
        local: Sge,
        operation: &'static str,
    ) -> Result<(), LoopbackError> {
        let request = SendRequest {
            wr_id: 1,
            op,
            sg_list: SgList::from_slice(&[local]),
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: the caller guarantees `local` stays valid until completion,
        // and we wait for that completion (or the QP's failure) below.
        unsafe { self.requester.post_send(std::slice::from_ref(&request)) }.map_err(|e| e.error)?;
        let deadline = Instant::now() + self.timeout;
        let mut completions = [Completion::default(); 4];
        loop {
            let n = self.cq.poll(&mut completions)?;
            if let Some(c) = completions[..n]
                .iter()
                .find(|c| c.qp_num == self.requester.qp_num())
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
            if Instant::now() >= deadline {
                return Err(LoopbackError::Timeout {
                    operation,
                    timeout: self.timeout,
                });
            }
            std::thread::yield_now();
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
        // SAFETY: both scratch buffers live until the end of this function,
        // after the registrations (dropped first, in reverse order).
        let source = unsafe {
            self.pd
                .register(written.as_ptr() as u64, len, AccessFlags::LOCAL_WRITE)
        }?;
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
        // end of this function; `run` waits for each completion.
        unsafe {
            self.run(
                SendOp::Write {
                    remote_addr,
                    rkey: target.rkey(),
                },
                sge(&source),
                "RDMA WRITE",
            )?;
            self.run(
                SendOp::Read {
                    remote_addr,
                    rkey: target.rkey(),
                },
                sge(&sink),
                "RDMA READ",
            )?;
        }
        drop(sink);
        drop(source);
        match written.iter().zip(&read_back).position(|(a, b)| a != b) {
            None => Ok(()),
            Some(first_difference) => Err(LoopbackError::Mismatch { first_difference }),
        }
    }

    /// The responder QP (for tests that post to it).
    pub fn responder(&self) -> &A::QueuePair {
        &self.responder
    }
}
