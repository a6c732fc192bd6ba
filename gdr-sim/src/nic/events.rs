//! Completion channels, CQ notification and async events of the simulated
//! NIC, with the readiness semantics of verbs on real file descriptors.
//!
//! - A [`SimCompChannel`] owns an `eventfd` (non-blocking) that is readable
//!   exactly while it holds an undelivered CQ event, so it works in epoll,
//!   poll(2), mio and tokio like `ibv_comp_channel.fd`.
//! - [`CompletionQueue::req_notify`](hal_verbs::CompletionQueue::req_notify)
//!   arms a CQ once: the next completion *added* to it (any, or a solicited
//!   or error one) queues one event on its channel and disarms it. A
//!   completion already in the CQ when it is armed does not fire it: the
//!   caller must poll after arming (arm, then poll), as with verbs.
//! - Each opened [`SimContext`](super::SimContext) has its own async event
//!   queue and `eventfd` ([`Context::async_fd`](hal_verbs::Context::async_fd)).
//!   As in verbs, an affiliated event goes only to the context that owns
//!   its object: a QP event to the context whose PD created the QP, a CQ
//!   event to the context that created the CQ (so a process that opens one
//!   device twice sees each QP's and CQ's events once, on the context that
//!   made it). Unaffiliated events (port active/error, GID, LID and P_Key
//!   change, client reregister, SM change, device fatal) go to every open
//!   context of the device. An affiliated event naming an object the sim
//!   does not know (an SRQ, which it does not have, or a QP or CQ already
//!   destroyed; only
//!   [`SimVerbs::raise_async_event`](super::SimVerbs::raise_async_event)
//!   raises those) goes to every context of the device; one whose owning
//!   context is closed goes nowhere. (Linux uverbs: `uverbs_uobj_event`
//!   queues a QP/CQ/SRQ event on the async file of the object's own
//!   `ib_uverbs_file`, while the per-file `ib_uverbs_event_handler` gets
//!   every unaffiliated one; `drivers/infiniband/core/uverbs_main.c`. The
//!   `rxe_events` test shows it on rxe0 opened twice.)
//! - Each connection of the connection manager has its own eventfd
//!   ([`Connection::event_fd`](hal_verbs::Connection::event_fd)), set when
//!   either side disconnects and consumed by `poll_state`, as reading the
//!   `rdma_event_channel` consumes its events (a device loss is reported on
//!   the async fd, not there).
//!
//! When completions are added, and so when an armed CQ fires: on the Auto
//! clock, by the post that runs the request (on the poster's thread, before
//! the post returns), by a poll, or by the fabric's NIC thread (the
//! completion of a large transfer once its bytes moved; an RNR wait stepped
//! for a QP whose send CQ is armed), so a thread parked in epoll on the
//! channel's fd needs nobody to poll (see the [module docs](super) of the
//! NIC). On the Manual clock only the test's polls,
//! [`SimFabric::progress`](super::SimFabric::progress) and
//! [`advance`](super::SimClock::advance) add them: nothing fires by itself.
//!
//! What raises events by itself: a responder that meets a remote access
//! violation (`REM_ACCESS_ERR` at the requester) raises
//! [`AsyncEvent::QpAccessError`] on the responder's QP, an invalid request
//! (`REM_INV_REQ_ERR`) [`AsyncEvent::QpRequestError`]; a CQ overrun raises
//! [`AsyncEvent::CqError`] (once per overrun CQ: rxe raises one for each
//! completion it loses, `rxe_cq_post`, seven for eight signaled WRITEs into
//! a CQ of one in the VM); a device loss [`AsyncEvent::DeviceFatal`];
//! [`SimVerbs::set_port_state`](super::SimVerbs::set_port_state) raises
//! [`AsyncEvent::PortActive`]/[`AsyncEvent::PortError`]. Any other event is
//! raised with [`SimVerbs::raise_async_event`](super::SimVerbs::raise_async_event).
//!
//! CQ moderation is accepted within the device's
//! [`cq_moderation`](hal_verbs::DeviceAttributes::cq_moderation) limits. It
//! gates the event of an armed CQ on the virtual clock
//! ([`ClockMode::Manual`](super::ClockMode::Manual)): completions that
//! would fire it are held until `count` of them have come, or `period` µs
//! of virtual time have passed since the first of them, whichever is first
//! (the semantics of `ibv_modify_cq`'s `cq_count`/`cq_period`, mlx5's CQ
//! moderation). A zero field is no gate (`count` 0: only the period; `period`
//! 0: only the count); both zero (or count 1) is no moderation. A period
//! that passes fires the event during the
//! [`advance`](super::SimClock::advance) that passes it, and
//! [`next_deadline`](super::SimClock::next_deadline) includes it. In
//! [`ClockMode::Auto`](super::ClockMode::Auto) nothing is delayed: the first
//! completion after arming fires the event, as if the period had already
//! elapsed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use hal_verbs::{AsyncEvent, CompletionChannel, CqNotify, Mtu, Result, VerbsError, WcOpcode};

use super::SimFabric;
use super::state::QpRecord;

/// A non-blocking eventfd: readable between `set` and `clear`.
pub(crate) struct ReadyFd {
    fd: OwnedFd,
}

impl ReadyFd {
    pub(crate) fn new(operation: &'static str) -> Result<Self> {
        // SAFETY: eventfd takes no pointer; the flags are valid.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            let errno = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            return Err(VerbsError::from_errno(operation, "sim", errno));
        }
        // SAFETY: `fd` was just opened and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self { fd })
    }

    /// Makes the fd readable (idempotent: the counter only grows).
    pub(crate) fn set(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our open eventfd. It
        // cannot fail short of a counter at u64::MAX - 1, which would take
        // 2^64 events; a failure is ignored (the fd is readable then anyway).
        unsafe { libc::write(self.fd.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    /// Makes the fd not readable.
    pub(crate) fn clear(&self) {
        let mut value: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our open eventfd;
        // non-blocking, so EAGAIN (already clear) returns at once.
        unsafe { libc::read(self.fd.as_raw_fd(), (&raw mut value).cast(), 8) };
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// A queue of events behind a ready fd: the fd is readable exactly while
/// the queue is not empty (both are changed under the queue's lock).
struct EventQueue<T> {
    ready: ReadyFd,
    queue: Mutex<VecDeque<T>>,
}

impl<T> EventQueue<T> {
    fn new(operation: &'static str) -> Result<Self> {
        Ok(Self {
            ready: ReadyFd::new(operation)?,
            queue: Mutex::new(VecDeque::new()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<T>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn push(&self, item: T) {
        let mut queue = self.lock();
        queue.push_back(item);
        self.ready.set();
    }

    fn pop(&self) -> Option<T> {
        let mut queue = self.lock();
        let item = queue.pop_front();
        if queue.is_empty() {
            self.ready.clear();
        }
        item
    }

    fn raw_fd(&self) -> RawFd {
        self.ready.fd.as_raw_fd()
    }
}

/// The shared part of a completion channel: its CQ events.
pub(crate) struct ChannelShared {
    device: usize,
    events: EventQueue<u64>,
}

impl fmt::Debug for ReadyFd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ReadyFd")
            .field(&self.fd.as_raw_fd())
            .finish()
    }
}

impl fmt::Debug for ChannelShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelShared")
            .field("device", &self.device)
            .field("fd", &self.events.raw_fd())
            .field("pending", &self.events.lock().len())
            .finish()
    }
}

/// A simulated completion channel (`ibv_comp_channel`) on a real,
/// non-blocking eventfd. Cloning shares it.
#[derive(Debug, Clone)]
pub struct SimCompChannel {
    pub(crate) shared: Arc<ChannelShared>,
}

impl SimCompChannel {
    pub(crate) fn create(fabric: &SimFabric, device: usize) -> Result<Self> {
        const OP: &str = "ibv_create_comp_channel";
        fabric.lock().alive(device, OP)?;
        Ok(Self {
            shared: Arc::new(ChannelShared {
                device,
                events: EventQueue::new(OP)?,
            }),
        })
    }

    /// The device it belongs to.
    pub(crate) fn device(&self) -> usize {
        self.shared.device
    }

    /// CQ events queued and not yet taken.
    pub fn pending(&self) -> usize {
        self.shared.events.lock().len()
    }
}

impl AsRawFd for SimCompChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.shared.events.raw_fd()
    }
}

impl AsFd for SimCompChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.shared.events.ready.fd.as_fd()
    }
}

impl CompletionChannel for SimCompChannel {
    fn fd(&self) -> RawFd {
        self.as_raw_fd()
    }

    fn get_cq_event(&self) -> Result<Option<u64>> {
        Ok(self.shared.events.pop())
    }
}

/// A CQ's notification state (kept in its `CqState`).
#[derive(Debug, Default)]
pub(crate) struct CqEvents {
    /// The channel it was created on.
    pub channel: Option<Arc<ChannelShared>>,
    /// Armed, and for what: cleared when the event fires.
    pub armed: Option<CqNotify>,
    /// The moderation last set (`cq_count`, `cq_period` in µs).
    pub moderation: Option<(u16, u16)>,
    /// Completions that matched the armed event but were held by the
    /// moderation (Manual clock only).
    pub held: u16,
    /// When the first of them was added: the moderation period runs from
    /// then.
    pub held_since: Option<Duration>,
}

impl CqEvents {
    /// A completion was added to the CQ `cq_id`: fires the armed event if
    /// it matches (`solicited`: a receive of a solicited request; `error`:
    /// an error completion), and disarms.
    ///
    /// With moderation on a Manual clock the event waits for the count or
    /// the period (see the module docs).
    pub fn on_completion(
        &mut self,
        cq_id: u64,
        solicited: bool,
        error: bool,
        clock: &super::clock::ClockState,
    ) {
        let fire = match self.armed {
            None => false,
            Some(CqNotify::Next) => true,
            Some(CqNotify::Solicited) => solicited || error,
        };
        if !fire {
            return;
        }
        if let Some((count, period)) = self.gates(clock.mode) {
            self.held = self.held.saturating_add(1);
            let since = *self.held_since.get_or_insert(clock.now);
            let counted = count > 0 && self.held >= count;
            let timed = period.is_some_and(|p| clock.now >= since + p);
            if !counted && !timed {
                return;
            }
        }
        self.fire(cq_id);
    }

    /// The moderation's gates in `mode`: the count (0: none) and the
    /// period; `None` when events are not moderated.
    fn gates(&self, mode: super::ClockMode) -> Option<(u16, Option<Duration>)> {
        let (count, period_us) = self.moderation?;
        if mode != super::ClockMode::Manual || (count <= 1 && period_us == 0) {
            return None;
        }
        let period = (period_us > 0).then(|| Duration::from_micros(u64::from(period_us)));
        Some((count, period))
    }

    /// When held completions fire the event by the period, if they do.
    pub fn moderation_deadline(&self, mode: super::ClockMode) -> Option<Duration> {
        self.armed?;
        let (_, period) = self.gates(mode)?;
        Some(self.held_since? + period?)
    }

    /// Fires the event if the moderation period of held completions has
    /// passed by `clock.now`.
    pub fn on_time(&mut self, cq_id: u64, clock: &super::clock::ClockState) {
        if self
            .moderation_deadline(clock.mode)
            .is_some_and(|deadline| deadline <= clock.now)
        {
            self.fire(cq_id);
        }
    }

    /// Queues the event on the channel and disarms.
    fn fire(&mut self, cq_id: u64) {
        self.held = 0;
        self.held_since = None;
        self.armed = None;
        if let Some(channel) = &self.channel {
            tracing::trace!(cq_id, "sim: CQ event");
            channel.events.push(cq_id);
        }
    }
}

/// One opened context's async events.
pub(crate) struct AsyncSink {
    device: usize,
    events: EventQueue<AsyncEvent>,
}

impl fmt::Debug for AsyncSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncSink")
            .field("device", &self.device)
            .field("fd", &self.events.raw_fd())
            .finish()
    }
}

impl AsyncSink {
    pub fn fd(&self) -> RawFd {
        self.events.raw_fd()
    }

    pub fn next(&self) -> Option<AsyncEvent> {
        self.events.pop()
    }
}

/// An object an affiliated event can name, by whose context owns it (a QP
/// is owned through its PD).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Owned {
    /// A protection domain, by id: its QPs' events go to its context.
    Pd(u64),
    /// A completion queue, by id.
    Cq(u64),
}

/// The fabric's event routing (in `FabricState`).
#[derive(Debug, Default)]
pub(crate) struct EventState {
    /// The async queues of open contexts (dropped contexts are pruned).
    sinks: Vec<Weak<AsyncSink>>,
    /// The context that allocated each PD and created each CQ.
    owners: HashMap<Owned, Weak<AsyncSink>>,
    /// Set by the engine just before it adds the receive completion of a
    /// request that asked for a solicited event (`SendFlags::SOLICITED`),
    /// and taken by that completion.
    pub solicited_hint: bool,
}

impl EventState {
    /// A new async queue for a context opened on `device`.
    pub fn open(&mut self, device: usize) -> Result<Arc<AsyncSink>> {
        let sink = Arc::new(AsyncSink {
            device,
            events: EventQueue::new("ibv_open_device")?,
        });
        self.sinks.retain(|s| s.strong_count() > 0);
        self.owners.retain(|_, s| s.strong_count() > 0);
        self.sinks.push(Arc::downgrade(&sink));
        Ok(sink)
    }

    /// Records that the context of `owner` made `object`: its affiliated
    /// events go there only.
    pub fn own(&mut self, object: Owned, owner: &Arc<AsyncSink>) {
        self.owners.insert(object, Arc::downgrade(owner));
    }

    /// Forgets the owner of a destroyed object.
    pub fn disown(&mut self, object: Owned) {
        self.owners.remove(&object);
    }

    /// Delivers `event`, raised on `device`, as verbs does: an affiliated
    /// event (QP, CQ) to the context that owns its object only (a QP's is
    /// its PD's, found in `qps`), any other to every open context of
    /// `device` (see the module docs).
    pub fn raise(&mut self, device: usize, event: AsyncEvent, qps: &BTreeMap<u32, QpRecord>) {
        tracing::debug!(device, ?event, "sim: async event");
        self.sinks.retain(|s| s.strong_count() > 0);
        let object = match event {
            AsyncEvent::CqError { cq } => Some(Owned::Cq(cq)),
            _ => event
                .qp_num()
                .and_then(|qpn| qps.get(&qpn))
                .map(|qp| Owned::Pd(qp.pd)),
        };
        if let Some(owner) = object.and_then(|object| self.owners.get(&object)) {
            // Its context may be closed: then nobody hears it.
            if let Some(sink) = owner.upgrade() {
                sink.events.push(event);
            }
            return;
        }
        for sink in self.sinks.iter().filter_map(Weak::upgrade) {
            if sink.device == device {
                sink.events.push(event);
            }
        }
    }
}

/// Attributes a QP's transitions applied (kept in its `QpRecord`), for
/// `query`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Applied {
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub path_mtu: Option<Mtu>,
    pub dest_qp_num: u32,
    pub rq_psn: u32,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
}

/// A READ depth clamped to the device's limit (as the rdma backend clamps
/// it before `ibv_modify_qp`).
pub(crate) fn clamp_rd_atomic(asked: u8, limit: u32) -> u8 {
    let limit = u8::try_from(limit).unwrap_or(u8::MAX);
    if limit != 0 && asked > limit {
        limit
    } else {
        asked
    }
}

/// Whether a completion of `opcode` is a receive (what a solicited event
/// is about).
pub(crate) fn is_receive(opcode: WcOpcode) -> bool {
    matches!(opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm)
}
