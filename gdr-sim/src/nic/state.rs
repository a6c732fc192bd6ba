//! The fabric's state behind its one lock: devices, MRs, CQs and QPs, looked
//! up by key the way a NIC looks them up, plus the helpers that complete,
//! flush and fail them.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use hal_verbs::{
    AccessFlags, Completion, GidEntry, QpCaps, QpState, SendFlags, SendOp, SgList, VerbsError,
    WcOpcode, WcStatus,
};
use memmap2::MmapRaw;

use super::clock::Inflight;
use super::{DeviceConfig, NodeConfig};
use crate::faults::{Fault, FaultPlan, FaultSite};
use crate::memory::Backing;

/// Entries in each port's GID table (only the first four are filled).
pub(crate) const GID_TABLE_LEN: u32 = 16;

pub(crate) struct NodeState {
    pub name: String,
    pub devices: Vec<usize>,
}

pub(crate) struct DeviceState {
    pub name: String,
    pub ipv4: Ipv4Addr,
    pub guid: u64,
    pub config: DeviceConfig,
    pub gids: Vec<GidEntry>,
    /// Set by a `DeviceLost` fault; never cleared.
    pub lost: bool,
    pub mrs: u32,
    pub qps: u32,
    pub cqs: u32,
}

/// A pointer the simulated NIC reads or writes through.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NicPtr(pub *mut u8);

// SAFETY: a NicPtr is only dereferenced by the engine while the
// registration it came from is live: with the fabric lock held, or by a
// thread moving a large transfer's bytes outside the lock while counted in
// [`Copies::outside`], which every deregistration waits to see at zero
// ([`super::SimFabric::lock_without_copies`]). The memory it points to is
// process memory that the registration's contract keeps valid, and which
// thread touches it does not matter.
unsafe impl Send for NicPtr {}

// SAFETY: as for `Send`: what threads holding the fabric shared (the fast
// path) do with a NicPtr is read its value, and dereference it only under
// the rule above (the shared holding keeps every registration live).
unsafe impl Sync for NicPtr {}

/// One contiguous piece of a transfer.
#[derive(Debug)]
pub(crate) struct Piece {
    pub src: NicPtr,
    pub dst: NicPtr,
    pub len: usize,
}

/// Only one-sided transfers of at least this many bytes move their bytes
/// outside the fabric lock ([`Copies`]).
pub(crate) const MOVE_OUTSIDE_FROM: u64 = 64 << 10;

/// A transfer whose checks passed and whose bytes are still to move, outside
/// the lock: see [`Copies`].
#[derive(Debug)]
pub(crate) struct Deferred {
    pub ticket: u64,
    pub qpn: u32,
    pub pieces: Vec<Piece>,
}

/// The book-keeping of the bytes that move outside the fabric lock.
///
/// A real NIC's DMA runs while the host polls; the simulated wire is a CPU
/// copy, and a large one made under the fabric's one lock stops every other
/// thread of the fabric (another engine's driver, polling its own CQ) for
/// as long. So a large RDMA WRITE or READ (at least [`MOVE_OUTSIDE_FROM`]
/// bytes; no receive consumed, no inline data) run by the progress of a
/// post, a poll or the NIC thread on the Auto clock
/// ([`super::SimFabric::progress_after_post`],
/// [`super::SimFabric::progress_for_poll`]) is checked under the lock as
/// any other (an access error is decided before a byte moves), then leaves
/// its send queue as [`Inflight::Moving`]:
/// its pieces wait here in `deferred`; before it lets the lock go, that
/// progress takes them all (`planned`, counted in `outside`) and hands them
/// to a DMA thread, which copies them with the lock released, takes the
/// lock again to mark them done, and makes the progress that completes
/// them, in order (firing armed channels). Everything else (small transfers, SENDs, WRITEs with
/// immediate, the Manual clock, [`super::SimFabric::progress`]) moves its
/// bytes under the lock as before.
///
/// `deferred` is empty whenever the lock is free: the progress that fills
/// it and the planning that empties it run under one holding of the lock,
/// so the pointers of a planned copy were resolved against registrations
/// that were live when `outside` counted it, and deregistrations wait for
/// `outside` to fall to zero before they remove one.
#[derive(Debug, Default)]
pub(crate) struct Copies {
    /// Whether the progress running now may defer copies (set by
    /// `progress_deferring` around its progress calls).
    pub defer: bool,
    /// Checked transfers whose bytes have not started to move.
    pub deferred: Vec<Deferred>,
    /// The next transfer's ticket.
    pub next_ticket: u64,
    /// Tickets whose bytes are moving outside the lock now.
    pub planned: HashSet<u64>,
    /// Copies running outside the lock now (the tickets in `planned`).
    pub outside: usize,
    /// Threads waiting for `outside` to fall to zero (seen by tests).
    pub waiters: usize,
}

/// A test's hook, called with a transfer's length before its bytes move
/// (outside the lock for a deferred copy, under it otherwise).
#[cfg(test)]
pub(crate) type CopyHook = std::sync::Arc<dyn Fn(usize) + Send + Sync>;

/// What keeps a registration's memory mapped.
#[derive(Debug)]
pub(crate) enum Pinned {
    /// Host memory: the caller keeps it (the `register` contract).
    Host,
    /// Device memory through peermem: the allocation's backing (held, not
    /// read).
    Device(#[allow(dead_code)] Arc<Backing>),
    /// A dma-buf: our own shared mapping of its pages.
    Dmabuf(#[allow(dead_code)] MmapRaw),
}

pub(crate) struct MrState {
    pub device: usize,
    pub pd: u64,
    /// First address as the NIC sees it (virtual address or iova).
    pub addr: u64,
    pub len: usize,
    pub access: AccessFlags,
    /// Where `addr` is in this process.
    pub ptr: NicPtr,
    pub _pinned: Pinned,
}

impl MrState {
    /// The host pointer of `len` bytes at `addr`, if they lie in the MR.
    pub fn resolve(&self, addr: u64, len: u64) -> Option<NicPtr> {
        let offset = addr.checked_sub(self.addr)?;
        let end = offset.checked_add(len)?;
        (end <= self.len as u64).then(|| NicPtr(self.ptr.0.wrapping_add(offset as usize)))
    }
}

/// A completion with the queue slots its polling frees.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CqEntry {
    pub wc: Completion,
    /// (QP, queue, sequence number + 1): polling it retires that many
    /// requests of that queue, as ConnectX frees WQEs only when their CQE
    /// (or a later one) is polled; unsignaled requests keep their slot until
    /// then. (An rxe-like device retired them at completion already:
    /// [`DeviceConfig::slots_freed_when_polled`].)
    pub retire: (u32, Queue, u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Queue {
    Send,
    Recv,
}

pub(crate) struct CqState {
    pub device: usize,
    pub depth: u32,
    /// Holders: the handle and each QP queue attached to it.
    pub refs: u32,
    /// What completing and polling change: behind the CQ's own lock, so
    /// the fast path (under the fabric's shared lock) adds and takes
    /// completions of different CQs at once.
    ring: Mutex<CqRing>,
}

/// A CQ's completions and notification state.
pub(crate) struct CqRing {
    pub entries: VecDeque<CqEntry>,
    /// Set when a completion found the queue full (lost; the CQ is in error).
    pub overrun: bool,
    /// Its completion channel and notification state.
    pub events: super::events::CqEvents,
}

impl CqState {
    pub fn new(device: usize, depth: u32, events: super::events::CqEvents) -> Self {
        Self {
            device,
            depth,
            refs: 1,
            ring: Mutex::new(CqRing {
                entries: VecDeque::new(),
                overrun: false,
                events,
            }),
        }
    }

    /// The ring, with the fabric held exclusively (no lock taken).
    pub fn ring(&mut self) -> &mut CqRing {
        self.ring.get_mut().unwrap_or_else(PoisonError::into_inner)
    }

    /// The ring, locked: for the fast path, and for readers that hold the
    /// fabric by `&`.
    pub fn lock(&self) -> MutexGuard<'_, CqRing> {
        self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(crate) struct SendWqe {
    pub wr_id: u64,
    pub op: SendOp,
    pub sg_list: SgList,
    pub flags: SendFlags,
    /// Inline payload, copied at post time.
    pub inline: Option<Vec<u8>>,
    /// A status scripted at post time (a `CompletionStatus` fault there).
    pub forced: Option<WcStatus>,
    pub seq: u64,
}

impl SendWqe {
    pub fn wc_opcode(&self) -> WcOpcode {
        match self.op {
            SendOp::Send | SendOp::SendWithImm { .. } => WcOpcode::Send,
            SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
        }
    }

    pub fn byte_len(&self) -> u64 {
        match &self.inline {
            Some(data) => data.len() as u64,
            None => self.sg_list.iter().map(|s| u64::from(s.length)).sum(),
        }
    }
}

pub(crate) struct RecvWqe {
    pub wr_id: u64,
    pub sg_list: SgList,
    pub seq: u64,
}

/// Where an RTR QP sends: resolved at RTR time from the peer's GID and QPN.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Remote {
    pub device: usize,
    pub qpn: u32,
    /// The PSN the peer said it starts with: what we expect first.
    pub rq_psn: u32,
}

pub(crate) struct QpRecord {
    pub device: usize,
    pub pd: u64,
    pub send_cq: u64,
    pub recv_cq: u64,
    pub caps: QpCaps,
    pub state: QpState,
    /// Remote rights granted at INIT.
    pub access: AccessFlags,
    pub remote: Option<Remote>,
    pub sq_psn: u32,
    /// Timeouts, retry counts and their timers (the virtual clock's).
    pub timing: super::clock::QpTiming,
    /// What its transitions applied, for `query`.
    pub applied: super::events::Applied,
    pub sq: VecDeque<SendWqe>,
    pub rq: VecDeque<RecvWqe>,
    /// Send requests posted: each one's sequence number is the count
    /// before it. Its lock also keeps two fast-path posts on this QP
    /// apart (a slow-path post holds the fabric exclusively).
    pub sq_posted: Mutex<u64>,
    /// Send and receive requests whose slots are free again: raised (to a
    /// maximum, so in any order) by the polls that retire them, which
    /// hold the fabric shared.
    pub sq_retired: AtomicU64,
    pub rq_posted: u64,
    pub rq_retired: AtomicU64,
}

impl QpRecord {
    /// Send requests posted, with the fabric held exclusively.
    pub fn sq_posted(&mut self) -> &mut u64 {
        self.sq_posted
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Send slots in use (posted, not retired).
    pub fn sq_in_use(&mut self) -> u64 {
        let retired = self.sq_retired.load(Ordering::Acquire);
        *self.sq_posted() - retired
    }

    /// Receive slots in use.
    pub fn rq_in_use(&self) -> u64 {
        self.rq_posted - self.rq_retired.load(Ordering::Acquire)
    }

    /// Frees every slot (a reset).
    pub fn retire_all(&mut self) {
        let posted = *self.sq_posted();
        self.sq_retired.store(posted, Ordering::Release);
        self.rq_retired.store(self.rq_posted, Ordering::Release);
    }

    /// Nothing queued, outstanding or timed: progress has nothing to do
    /// for it until a post.
    pub fn is_idle(&self) -> bool {
        self.sq.is_empty() && self.timing.inflight.is_empty() && self.timing.wait.is_none()
    }
}

pub(crate) struct FabricState {
    pub faults: FaultPlan,
    pub paused: bool,
    pub nodes: Vec<NodeState>,
    pub devices: Vec<DeviceState>,
    /// By lkey.
    pub mrs: HashMap<u32, MrState>,
    /// rkey → lkey.
    pub rkeys: HashMap<u32, u32>,
    pub cqs: HashMap<u64, CqState>,
    /// By QPN (unique on the fabric); ordered so progress is deterministic.
    pub qps: BTreeMap<u32, QpRecord>,
    /// The QPs that may have work (a request queued, a READ or a landing
    /// outstanding, a timer): what progress steps and what its timers are
    /// read from, so a call costs the QPs at work, not every QP of the
    /// fabric. Every QP that is not [`QpRecord::is_idle`] is in it (a post
    /// puts it there); progress takes the idle ones out. Ordered, as
    /// `qps`, so progress is deterministic.
    pub busy: BTreeSet<u32>,
    /// Listeners, pending requests and connections of the connection manager.
    pub cm: super::cm::CmState,
    /// The virtual clock.
    pub clock: super::clock::ClockState,
    /// Completion channels' and contexts' event routing.
    pub events: super::events::EventState,
    /// Large transfers whose bytes move outside the lock.
    pub copies: Copies,
    /// Set during the progress a post makes (see [`FabricState::progress`]).
    pub post_time: bool,
    /// When a full progress (a poll's, [`super::SimFabric::progress`]'s,
    /// the NIC thread's) last ran on the Auto clock: the NIC thread stands
    /// in for a poll only when none came for its pace. Written by polls
    /// on the fast path too (shared), so kept as nanoseconds since
    /// `epoch`: see [`FabricState::polled_now`].
    last_full_progress: AtomicU64,
    /// The origin of `last_full_progress`.
    epoch: Instant,
    /// When the NIC thread means to step the fabric's RNR waits for a
    /// parked waiter (`None`: it is not timing any).
    pub nic_due: Option<Instant>,
    #[cfg(test)]
    pub copy_hook: Option<CopyHook>,
    /// Posts the fast path ran (the `fast` module).
    #[cfg(test)]
    pub fast_posts: AtomicU64,
    next_id: u64,
    next_key: u32,
    next_qpn: u32,
}

/// A bijection on u32 (the "lowbias32" integer hash): distinct inputs give
/// distinct keys that look nothing like a counter.
fn scramble(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

impl FabricState {
    pub fn new(faults: FaultPlan) -> Self {
        Self {
            faults,
            paused: false,
            nodes: Vec::new(),
            devices: Vec::new(),
            mrs: HashMap::new(),
            rkeys: HashMap::new(),
            cqs: HashMap::new(),
            qps: BTreeMap::new(),
            busy: BTreeSet::new(),
            cm: super::cm::CmState::default(),
            clock: super::clock::ClockState::default(),
            events: super::events::EventState::default(),
            copies: Copies::default(),
            post_time: false,
            last_full_progress: AtomicU64::new(0),
            epoch: Instant::now(),
            nic_due: None,
            #[cfg(test)]
            copy_hook: None,
            #[cfg(test)]
            fast_posts: AtomicU64::new(0),
            next_id: 1,
            next_key: 0,
            // Low QPNs are reserved on real devices (0 and 1 are special).
            next_qpn: 0x11,
        }
    }

    /// When a full progress last ran (see `last_full_progress`).
    pub fn last_full_progress(&self) -> Instant {
        self.epoch + Duration::from_nanos(self.last_full_progress.load(Ordering::Relaxed))
    }

    /// A full progress (or a poll with nothing to progress) runs now. A
    /// poll on the fast path writes it only when it is a millisecond old,
    /// so polling threads do not bounce its cache line: the NIC thread's
    /// pace is a millisecond at least (`NIC_PACE_MIN`).
    pub fn polled_now(&self, lazily: bool) {
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if lazily && now.saturating_sub(self.last_full_progress.load(Ordering::Relaxed)) < 1_000_000
        {
            return;
        }
        self.last_full_progress.store(now, Ordering::Relaxed);
    }

    pub fn add_node(&mut self, name: &str, config: NodeConfig) -> usize {
        let node = self.nodes.len();
        let base = config.ipv4.unwrap_or(Ipv4Addr::new(10, 77, node as u8, 1));
        let mut devices = Vec::new();
        for (index, device) in config.devices.into_iter().enumerate() {
            let ipv4 = device
                .ipv4
                .unwrap_or_else(|| super::device_address(base, index));
            assert!(
                self.devices.iter().all(|d| d.ipv4 != ipv4),
                "simulated address {ipv4} is used twice on the fabric"
            );
            let guid = 0x0200_5e00_0000_0000 | u64::from(u32::from(ipv4));
            devices.push(self.devices.len());
            self.devices.push(DeviceState {
                name: format!("sim{index}"),
                ipv4,
                guid,
                gids: super::gid_table(guid, ipv4),
                config: device,
                lost: false,
                mrs: 0,
                qps: 0,
                cqs: 0,
            });
        }
        tracing::debug!(node = name, devices = devices.len(), "sim: node added");
        self.nodes.push(NodeState {
            name: name.to_owned(),
            devices,
        });
        node
    }

    pub fn find_device(&self, node: usize, name: &str) -> Option<usize> {
        self.nodes[node]
            .devices
            .iter()
            .copied()
            .find(|&d| self.devices[d].name == name)
    }

    pub fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// A fresh memory key: distinct from every key handed out before on
    /// this fabric, and never 0. An MR's lkey, and its rkey (rxe and mlx5
    /// use one key for both) unless that is 0 (rxe, no remote right).
    pub fn next_key(&mut self) -> u32 {
        loop {
            self.next_key = self.next_key.wrapping_add(1);
            let key = scramble(self.next_key ^ 0x5eed_0000);
            if key != 0 {
                return key;
            }
        }
    }

    pub fn next_qpn(&mut self) -> u32 {
        let qpn = self.next_qpn;
        self.next_qpn = (self.next_qpn + 1) & 0x00ff_ffff;
        qpn
    }

    pub fn lost_error(&self, device: usize, operation: &'static str) -> VerbsError {
        VerbsError::DeviceLost {
            device: self.devices[device].name.clone(),
            operation,
            errno: Some(libc::EIO),
        }
    }

    /// `Err(DeviceLost)` once the device is dead.
    pub fn alive(&self, device: usize, operation: &'static str) -> Result<(), VerbsError> {
        if self.devices[device].lost {
            Err(self.lost_error(device, operation))
        } else {
            Ok(())
        }
    }

    /// EINVAL from `operation`, with our reason.
    pub fn einval(
        &self,
        device: usize,
        operation: &'static str,
        reason: impl Into<String>,
    ) -> VerbsError {
        VerbsError::InvalidArgument {
            operation,
            reason: format!("{} (on {})", reason.into(), self.devices[device].name),
            errno: Some(libc::EINVAL),
        }
    }

    /// Counts a call at `site` against the plan. A scripted verbs error is
    /// returned; a device loss kills the device and returns its error; a
    /// scripted completion status is handed back for the caller to apply
    /// (sites other than the send path ignore it).
    pub fn fault(
        &mut self,
        device: usize,
        site: FaultSite,
        operation: &'static str,
    ) -> Result<Option<WcStatus>, VerbsError> {
        match self.faults.hit(site) {
            None => Ok(None),
            Some(Fault::Verbs(error)) => Err(error),
            Some(Fault::DeviceLost) => {
                self.lose_device(device);
                Err(self.lost_error(device, operation))
            }
            Some(Fault::CompletionStatus(status)) => Ok(Some(status)),
            Some(Fault::Cuda(error)) => {
                tracing::warn!(?site, %error, "sim: CUDA fault scripted at a verbs site; ignored");
                Ok(None)
            }
            Some(fault @ (Fault::CqOverrun | Fault::QpFatal | Fault::Slow(_))) => {
                tracing::warn!(
                    ?site,
                    ?fault,
                    "sim: a completion fault scripted at another site; ignored"
                );
                Ok(None)
            }
        }
    }

    /// Kills a device: every QP on it goes to the error state and flushes.
    pub fn lose_device(&mut self, device: usize) {
        if self.devices[device].lost {
            return;
        }
        tracing::debug!(device = %self.devices[device].name, "sim: device lost");
        self.devices[device].lost = true;
        self.events
            .raise(device, hal_verbs::AsyncEvent::DeviceFatal, &self.qps);
        let flushes = self.devices[device].config.device_loss_flushes;
        let qpns: Vec<u32> = self
            .qps
            .iter()
            .filter(|(_, qp)| qp.device == device)
            .map(|(&qpn, _)| qpn)
            .collect();
        for qpn in qpns {
            if flushes {
                self.set_error(qpn);
            } else if let Some(qp) = self.qps.get_mut(&qpn) {
                // As hardware: the work is gone, no completion says so.
                qp.state = QpState::Error;
                qp.sq.clear();
                qp.rq.clear();
            }
        }
    }

    /// Queues a completion on `cq`. A full CQ loses it and is marked overrun,
    /// as a real CQ overrun is fatal to the CQ.
    pub fn complete(&mut self, cq: u64, entry: CqEntry) {
        let cq_id = cq;
        let solicited = super::events::is_receive(entry.wc.opcode)
            && std::mem::take(&mut self.events.solicited_hint);
        let Some(cq) = self.cqs.get_mut(&cq) else {
            return;
        };
        let depth = cq.depth;
        let ring = cq.ring();
        if ring.entries.len() >= depth as usize {
            tracing::warn!(wr_id = entry.wc.wr_id, depth, "sim: CQ overrun");
            self.overrun(cq_id);
            return;
        }
        let error = !entry.wc.status.is_success();
        ring.entries.push_back(entry);
        ring.events
            .on_completion(cq_id, solicited, error, &self.clock);
    }

    /// Completes a send request of `qpn` with `status` (errors always; success
    /// only when signaled).
    pub fn complete_send(&mut self, qpn: u32, wqe: &SendWqe, status: WcStatus) {
        let Some(qp) = self.qps.get(&qpn) else {
            return;
        };
        // The responder of a request that failed at its end raises an async
        // event on its QP (it goes to ERROR too).
        let raises = |r: &Remote| {
            self.qps.contains_key(&r.qpn) && self.devices[r.device].config.responder_error_events
        };
        if let Some(remote) = qp.remote.filter(raises) {
            let qp_num = remote.qpn;
            let event = match status {
                WcStatus::REM_ACCESS_ERR => Some(hal_verbs::AsyncEvent::QpAccessError { qp_num }),
                WcStatus::REM_INV_REQ_ERR => Some(hal_verbs::AsyncEvent::QpRequestError { qp_num }),
                _ => None,
            };
            if let Some(event) = event {
                self.events.raise(remote.device, event, &self.qps);
            }
        }
        self.retire_at_completion(qpn, (qpn, Queue::Send, wqe.seq + 1));
        let Some(qp) = self.qps.get(&qpn) else {
            return;
        };
        if status.is_success() && !wqe.flags.contains(SendFlags::SIGNALED) {
            return;
        }
        let entry = CqEntry {
            wc: Completion {
                wr_id: wqe.wr_id,
                status,
                // An error completion's opcode and length are undefined on
                // hardware (rxe zeroes them, mlx5 leaves them unset): 0 here,
                // so an engine that reads them fails in the sim too.
                opcode: if status.is_success() {
                    wqe.wc_opcode()
                } else {
                    WcOpcode::Send
                },
                byte_len: if status.is_success() {
                    u32::try_from(wqe.byte_len()).unwrap_or(u32::MAX)
                } else {
                    0
                },
                imm: None,
                qp_num: qpn,
                vendor_err: 0,
            },
            retire: (qpn, Queue::Send, wqe.seq + 1),
        };
        let cq = qp.send_cq;
        self.complete(cq, entry);
    }

    /// Completes a receive request of `qpn`.
    pub fn complete_recv(
        &mut self,
        qpn: u32,
        wqe: &RecvWqe,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u64,
        imm: Option<u32>,
    ) {
        self.retire_at_completion(qpn, (qpn, Queue::Recv, wqe.seq + 1));
        let Some(qp) = self.qps.get(&qpn) else {
            return;
        };
        let entry = CqEntry {
            wc: Completion {
                wr_id: wqe.wr_id,
                status,
                // Zeroed on error, as in `complete_send` (rxe's responder
                // fills them only on success).
                opcode: if status.is_success() {
                    opcode
                } else {
                    WcOpcode::Send
                },
                byte_len: if status.is_success() {
                    u32::try_from(byte_len).unwrap_or(u32::MAX)
                } else {
                    0
                },
                imm: imm.filter(|_| status.is_success()),
                qp_num: qpn,
                vendor_err: 0,
            },
            retire: (qpn, Queue::Recv, wqe.seq + 1),
        };
        let cq = qp.recv_cq;
        self.complete(cq, entry);
    }

    /// Marks `cq` overrun (its later polls fail), raising a CQ error event
    /// the first time.
    pub fn overrun(&mut self, cq_id: u64) {
        let Some(cq) = self.cqs.get_mut(&cq_id) else {
            return;
        };
        if std::mem::replace(&mut cq.ring().overrun, true) {
            return;
        }
        let device = cq.device;
        self.events.raise(
            device,
            hal_verbs::AsyncEvent::CqError { cq: cq_id },
            &self.qps,
        );
    }

    /// Moves a QP to the error state and flushes every outstanding request.
    pub fn set_error(&mut self, qpn: u32) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        if qp.state != QpState::Error {
            tracing::debug!(qpn, from = ?qp.state, "sim: QP to error");
        }
        qp.state = QpState::Error;
        self.flush(qpn);
    }

    /// Completes everything queued on an error-state QP with WR_FLUSH_ERR,
    /// signaled or not (as real hardware reports flushes).
    pub fn flush(&mut self, qpn: u32) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        let sends: Vec<SendWqe> = qp.sq.drain(..).collect();
        let recvs: Vec<RecvWqe> = qp.rq.drain(..).collect();
        // Outstanding READs flush; what completed behind them is reported
        // first, in posting order.
        qp.timing.next_request();
        let inflight = std::mem::take(&mut qp.timing.inflight);
        // A transfer whose bytes are moving outside the lock right now
        // cannot be recalled: it stays, marked flushed, and completes with
        // WR_FLUSH_ERR once its copy is done and accounted (the poller that
        // moves it settles it); everything behind it waits there too, so
        // completions stay in posting order and no flushed completion is
        // out while bytes of its request may still land. One whose copy
        // has not started never copies: it flushes now, as a transfer whose
        // copy is done does.
        let mut held: VecDeque<Inflight> = VecDeque::new();
        for entry in inflight {
            let entry = match entry {
                Inflight::Moving { wqe, ticket, .. } if self.copies.planned.contains(&ticket) => {
                    Inflight::Moving {
                        wqe,
                        ticket,
                        done: false,
                        flushed: true,
                    }
                }
                Inflight::Moving { wqe, ticket, .. } => {
                    self.copies.deferred.retain(|d| d.ticket != ticket);
                    Inflight::Done {
                        wqe,
                        status: WcStatus::WR_FLUSH_ERR,
                    }
                }
                Inflight::Read { wqe, .. } => Inflight::Done {
                    wqe,
                    status: WcStatus::WR_FLUSH_ERR,
                },
                done @ Inflight::Done { .. } => done,
            };
            match entry {
                Inflight::Done { wqe, status } if held.is_empty() => {
                    self.complete_send(qpn, &wqe, status);
                }
                entry => held.push_back(entry),
            }
        }
        // WR_FLUSH_ERR is an error status, so unsignaled requests report it
        // too, as on real hardware.
        for wqe in sends {
            if held.is_empty() {
                self.complete_send(qpn, &wqe, WcStatus::WR_FLUSH_ERR);
            } else {
                held.push_back(Inflight::Done {
                    wqe,
                    status: WcStatus::WR_FLUSH_ERR,
                });
            }
        }
        if let Some(qp) = self.qps.get_mut(&qpn) {
            qp.timing.inflight = held;
        }
        for wqe in &recvs {
            self.complete_recv(qpn, wqe, WcStatus::WR_FLUSH_ERR, WcOpcode::Recv, 0, None);
        }
    }

    /// Frees the slots up to `slot` as the device retires the request
    /// there, on a device that does not wait for the poll (rxe: see
    /// [`DeviceConfig::slots_freed_when_polled`]).
    fn retire_at_completion(&mut self, qpn: u32, slot: (u32, Queue, u64)) {
        let Some(qp) = self.qps.get(&qpn) else {
            return;
        };
        if !self.devices[qp.device].config.slots_freed_when_polled {
            self.retire(slot);
        }
    }

    /// Frees queue slots when a completion is polled (on every device; on
    /// one that frees them at completion already, this changes nothing).
    /// Shared: polls on the fast path retire slots of QPs other threads
    /// post on.
    pub fn retire(&self, (qpn, queue, upto): (u32, Queue, u64)) {
        if let Some(qp) = self.qps.get(&qpn) {
            let retired = match queue {
                Queue::Send => &qp.sq_retired,
                Queue::Recv => &qp.rq_retired,
            };
            retired.fetch_max(upto, Ordering::AcqRel);
        }
    }

    /// Drops one holder of a CQ, removing it with its last.
    pub fn release_cq(&mut self, cq: u64) -> Option<CqState> {
        let state = self.cqs.get_mut(&cq)?;
        state.refs = state.refs.saturating_sub(1);
        if state.refs > 0 {
            return None;
        }
        let removed = self.cqs.remove(&cq)?;
        self.events.disown(super::events::Owned::Cq(cq));
        let device = &mut self.devices[removed.device];
        device.cqs = device.cqs.saturating_sub(1);
        Some(removed)
    }
}
