//! The engine's side of a peer's [`gdr_proto::connection`]: its batches
//! of verbs work requests ([`gdr_proto::batches`], owned by the
//! connection). The protocol decides (what posts, what retires, when a
//! batch ends, when a queue pair stops); this module only carries out its
//! outcome actions at once (an [`Action::End`](gdr_proto::batches::Action)
//! completes the batch's [`CompletionCell`] after releasing what it held;
//! a `Release` drops what it held) and hands the queue-pair actions on to
//! the driver ([`Action`]).

use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gdr_proto::batches::{self as proto, Requests};
use gdr_proto::connection::Connection;
pub use gdr_proto::batches::{BatchId, QpCounters};
pub(crate) use gdr_proto::batches::{QpId, QpLimits};
use hal_verbs::{SendFlags, SendOp, SendRequest, SgList, Sge, WcStatus};

use crate::descriptor::MemoryDescriptor;
use crate::engine::completion::CompletionCell;
use crate::engine::error::TransferError;

/// What a batch keeps alive until its last request is retired.
pub(crate) type Keep = Arc<dyn Any + Send + Sync>;

/// One verbs work request waiting to be posted.
pub(crate) type Work = proto::Work<SendRequest>;

/// A work request of one SG entry (`addr`, `len`, `lkey`); its `wr_id`,
/// batch and signalling are the protocol's to set.
pub(crate) fn single_work(op: SendOp, addr: u64, len: u32, lkey: u32, flags: SendFlags) -> Work {
    let mut sg_list = SgList::new();
    sg_list.push(Sge {
        addr,
        length: len,
        lkey,
    });
    Work::new(SendRequest {
        wr_id: 0,
        op,
        sg_list,
        flags,
    })
}

/// Verbs send requests, [`TransferError`]s, completion cells.
#[derive(Debug)]
pub(crate) struct Verbs;

impl Requests for Verbs {
    type Request = SendRequest;
    type Error = TransferError;
    type Notify = Arc<CompletionCell>;
    type Hold = Vec<Keep>;

    #[inline]
    fn is_send(request: &SendRequest) -> bool {
        matches!(request.op, SendOp::Send | SendOp::SendWithImm { .. })
    }

    #[inline]
    fn len(request: &SendRequest) -> u64 {
        request.sg_list.iter().map(|s| u64::from(s.length)).sum()
    }

    #[inline]
    fn number(request: &mut SendRequest, wr_id: u64, signaled: bool) {
        request.wr_id = wr_id;
        request.flags.set(SendFlags::SIGNALED, signaled);
    }

    fn flushed(qp: u16, cause: &TransferError) -> TransferError {
        TransferError::Flushed {
            qp,
            cause: Box::new(cause.clone()),
        }
    }

    fn timeout(after: Duration) -> TransferError {
        TransferError::Timeout(super::TimedOut { after })
    }

    fn cancelled() -> TransferError {
        TransferError::Cancelled
    }
}

/// What the driver must do for the queue pairs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// Move this queue pair to ERROR so what it holds flushes.
    StopQp(QpId),
    /// The queue pair failed and nothing of it is in flight any more.
    QpDrained(QpId),
}

/// A peer's connection as the engine keeps it: its grants are the
/// engine's descriptors, its batches verbs requests, its batches and
/// messages end the engine's completion cells.
pub(crate) type PeerConnection = Connection<MemoryDescriptor, Verbs>;

/// A peer's connection ([`PeerConnection`], its batches included), the
/// batches' outcomes delivered as they are decided.
#[derive(Debug)]
pub(crate) struct Core {
    /// The peer's protocol state: batches, recovery, grants both ways,
    /// inbox, outbox, paths.
    pub conn: PeerConnection,
    actions: VecDeque<Action>,
    /// Emptied holds, reused by the next batches.
    spare_holds: Vec<Vec<Keep>>,
}

/// Emptied holds kept for reuse, at most.
const SPARE_HOLDS: usize = 64;

impl Core {
    pub fn new(conn: PeerConnection) -> Self {
        Self {
            conn,
            actions: VecDeque::new(),
            spare_holds: Vec::new(),
        }
    }

    /// A connection with no queue pair yet, to a peer of no engine (unit
    /// tests and loom models).
    #[cfg(any(test, loom))]
    pub fn for_tests() -> Self {
        use gdr_proto::connection::ConnectionConfig;
        Self::new(PeerConnection::new(&ConnectionConfig {
            peer_engine: 0,
            session: 0,
            qp_count: 1,
            connector: true,
            reconnect_timeout: Duration::from_secs(1),
            peer_max_message: 4096,
            max_outbox: 16,
            limits: gdr_proto::PeerLimits::DEFAULT,
        }))
    }

    /// Carries out the protocol's actions: outcomes and releases now, the
    /// queue-pair ones queued for [`Core::poll_action`].
    fn settle(&mut self) {
        while let Some(action) = self.conn.batches_mut().poll_action() {
            match action {
                proto::Action::StopQp(qp) => self.actions.push_back(Action::StopQp(qp)),
                proto::Action::QpDrained(qp) => self.actions.push_back(Action::QpDrained(qp)),
                proto::Action::End {
                    outcome,
                    notify,
                    hold,
                    ..
                } => {
                    // Released first: whoever hears the outcome finds the
                    // memory free.
                    if let Some(hold) = hold {
                        self.recycle(hold);
                    }
                    notify.complete(outcome);
                }
                proto::Action::Release { hold, .. } => self.recycle(hold),
            }
        }
    }

    fn recycle(&mut self, mut hold: Vec<Keep>) {
        hold.clear();
        if self.spare_holds.len() < SPARE_HOLDS {
            self.spare_holds.push(hold);
        }
    }

    pub fn add_qp(&mut self, index: u16, limits: QpLimits) -> QpId {
        self.conn.batches_mut().add_qp(index, limits)
    }

    #[inline]
    pub fn is_ready(&self, qp: QpId) -> bool {
        self.conn.batches().is_ready(qp)
    }

    /// See [`proto::Batches::accepts_work`].
    pub fn accepts_work(&self, qp: QpId) -> bool {
        self.conn.batches().accepts_work(qp)
    }

    /// See [`proto::Batches::is_down`].
    pub fn is_down(&self, qp: QpId) -> bool {
        self.conn.batches().is_down(qp)
    }

    /// See [`proto::Batches::begin_reconnect`].
    pub fn begin_reconnect(&mut self, qp: QpId) -> bool {
        self.conn.batches_mut().begin_reconnect(qp)
    }

    /// See [`proto::Batches::revive`].
    pub fn revive(&mut self, qp: QpId, limits: QpLimits) {
        self.conn.batches_mut().revive(qp, limits);
    }

    /// See [`proto::Batches::give_up`].
    pub fn give_up(&mut self, qp: QpId, cause: TransferError) {
        self.conn.batches_mut().give_up(qp, cause);
        self.settle();
    }

    pub fn counters(&self, qp: QpId) -> QpCounters {
        self.conn.batches().counters(qp)
    }

    /// Requests queued or in flight on `qp`.
    #[cfg(all(test, loom))]
    pub fn load(&self, qp: QpId) -> usize {
        self.conn.batches().load(qp)
    }

    /// SENDs in flight on `qp`.
    #[cfg(all(test, loom))]
    pub fn sends_in_flight(&self, qp: QpId) -> u32 {
        self.conn.batches().sends_in_flight(qp)
    }

    /// See [`proto::Batches::send_waits`].
    pub fn send_waits(&self, qp: QpId) -> bool {
        self.conn.batches().send_waits(qp)
    }

    /// Batches not yet released.
    pub fn batches_live(&self) -> usize {
        self.conn.batches().batches_live()
    }

    /// See [`proto::Batches::work_buffer`].
    pub fn work_buffer(&mut self) -> Vec<(QpId, Work)> {
        self.conn.batches_mut().work_buffer()
    }

    /// See [`proto::Batches::submit`]: `cell` is completed once, after `keep` was
    /// released.
    pub fn submit(
        &mut self,
        work: Vec<(QpId, Work)>,
        cell: Arc<CompletionCell>,
        deadline: Option<(Instant, Duration)>,
        keep: impl IntoIterator<Item = Keep>,
    ) -> BatchId {
        let mut hold = self.spare_holds.pop().unwrap_or_default();
        hold.extend(keep);
        let id = self.conn.batches_mut().submit(work, cell, deadline, hold);
        self.settle();
        id
    }

    /// See [`proto::Batches::has_postable`].
    pub fn has_postable(&self, qp: QpId) -> bool {
        self.conn.batches().has_postable(qp)
    }

    /// See [`proto::Batches::take_postable`].
    pub fn take_postable(&mut self, qp: QpId, out: &mut Vec<SendRequest>) {
        self.conn.batches_mut().take_postable(qp, out);
    }

    /// See [`proto::Batches::post_failed`].
    pub fn post_failed(
        &mut self,
        qp: QpId,
        taken: usize,
        accepted: Option<usize>,
        error: TransferError,
    ) {
        self.conn.batches_mut().post_failed(qp, taken, accepted, error);
        self.settle();
    }

    /// A send-queue completion of `qp` with the NIC's status.
    pub fn on_completion(&mut self, qp: QpId, wr_id: u64, status: WcStatus, vendor_err: u32) {
        let result = match status.is_success() {
            true => Ok(()),
            false => Err(TransferError::from_status(status, vendor_err)),
        };
        self.conn.batches_mut().on_completion(qp, wr_id, result);
        self.settle();
    }

    /// See [`proto::Batches::fail_qp`].
    pub fn fail_qp(&mut self, qp: QpId, cause: TransferError) {
        self.conn.batches_mut().fail_qp(qp, cause);
        self.settle();
    }

    /// See [`proto::Batches::abandon_qp`].
    pub fn abandon_qp(&mut self, qp: QpId, cause: TransferError) {
        self.conn.batches_mut().abandon_qp(qp, cause);
        self.settle();
    }

    /// See [`proto::Batches::cancel`].
    pub fn cancel(&mut self, batch: BatchId) {
        self.conn.batches_mut().cancel(batch);
        self.settle();
    }

    /// The earliest deadline of the peer's connection: its batches', a
    /// queue pair's re-establishment, a message waiting for a send slot
    /// ([`Connection::poll_timeout`]).
    pub fn next_deadline(&mut self) -> Option<Instant> {
        self.conn.poll_timeout()
    }

    /// The batches', the rendezvous' and the peer copies' deadlines up to
    /// `now` ([`gdr_proto::connection::Connection::handle_work_timeout`]):
    /// an exported grant whose importer never released it is given back
    /// here, its memory let go.
    pub fn handle_timeout(&mut self, now: Instant) {
        for (grant, _memory) in self.conn.handle_work_timeout(now) {
            tracing::warn!(
                grant,
                "no release of a revoked grant's IPC handle within the bound: its memory is given back unconfirmed"
            );
        }
        self.settle();
    }

    /// Whether a queue-pair action waits for the driver.
    pub fn has_action(&self) -> bool {
        !self.actions.is_empty()
    }

    /// The next queue-pair action the driver must carry out.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }
}

/// A SEND of `len` bytes for the loom models.
#[cfg(all(test, loom))]
pub(crate) fn test_send(len: u32) -> Work {
    let mut work = test_write(len);
    work.request.op = SendOp::Send;
    work
}

/// A WRITE of `len` bytes for the loom models.
#[cfg(all(test, loom))]
pub(crate) fn test_write(len: u32) -> Work {
    let op = SendOp::Write {
        remote_addr: 0x2000,
        rkey: 2,
    };
    single_work(op, 0x1000, len, 1, SendFlags::empty())
}
