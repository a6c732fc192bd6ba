//! The simulated NIC: a fabric of nodes whose devices implement every
//! `hal-verbs` role trait on real memory.
//!
//! A test builds a [`SimFabric`], adds nodes to it ([`SimFabric::add_node`]),
//! and uses each node's [`SimVerbs`] exactly as it would use the rdma-core
//! backend: open a device, allocate a PD, register memory, create CQs and RC
//! QPs, connect them with [`hal_verbs::ConnectionInfo`], post work requests
//! and poll completions.
//!
//! Posted work requests are queued, and run when the fabric makes
//! progress. On the default clock ([`ClockMode::Auto`]) that happens as on a
//! real NIC: the post itself runs what it can (a WRITE lands, a SEND meets
//! its receive, a dead peer's retries run out), so completions land and an
//! armed CQ's channel fires with nobody polling, and a receive posted for a
//! SEND that waits for it lets that SEND through. Every
//! [`CompletionQueue::poll`](hal_verbs::CompletionQueue::poll) makes
//! progress too (so ordinary poll loops just work), and
//! [`SimFabric::progress`] does explicitly. [`SimFabric::set_paused`]
//! holds all of it, so a test can keep requests outstanding (to flush them
//! with `to_error`, for instance); releasing it runs what was held, as a
//! post would.
//!
//! The fabric is one state behind a reader-writer lock. Posts and polls
//! on different QPs and CQs run at once, as on a NIC: the common post (a
//! batch of WRITEs or READs that complete at once) and a poll with nothing
//! to progress hold it shared, changing only what has a lock of its own
//! (a QP's posted count, a CQ's ring); everything else holds it
//! exclusively (see the `fast` module for the rule and why the semantics
//! are the same either way).
//!
//! The fabric's threads (started at their first work, ended with the
//! fabric) do, on the Auto clock, what must happen while nobody calls in:
//!
//! - The bytes of a large RDMA WRITE or READ (64 KiB or more) move on its
//!   DMA threads (one per core, at most four), with the fabric lock
//!   released, as a real NIC's DMA runs while the host's threads poll and
//!   work; its checks are made under the lock before, and its completion
//!   (with its channel event) comes after, in order (see `state::Copies`).
//!   Deregistrations, QP resets and destructions wait for such copies.
//! - RNR waits, on its NIC thread. A post records no RNR NAK and moves no RNR timer (each poll
//!   moves one period, as before: tests count retries per poll), so a SEND
//!   waiting for a receive the peer never posts would never fail for a
//!   waiter parked on its channel. While a QP whose send CQ is armed (so
//!   someone may be parked on its channel) has an RNR wait, and no poll
//!   comes, the thread makes a poll's progress itself, one RNR timer period
//!   of virtual time per RNR timer of real time (at least 1 ms, see
//!   `FabricState::nic_pace`): the request is retried, and fails with
//!   `RNR_RETRY_EXC_ERR` (or, rxe-like, `RETRY_EXC_ERR`) when its retries
//!   run out, without a poll.
//!
//! Nothing else in the sim is time-driven on the Auto clock (ACK timeouts
//! and READ round trips run through within one progress), so an engine
//! parked on its completion channels' fds (armed, then polled: arm then
//! poll), its async fd and its own timers sees every completion and event
//! the sim makes, with no deadline of the sim's to wait for: it needs no
//! `next_deadline` ([`SimClock::next_deadline`] is virtual time, for tests
//! on the Manual clock).
//!
//! How the sim's own tests stay deterministic: on the Manual clock
//! ([`ClockMode::Manual`]) the fabric is thread-free and deterministic as
//! it always was: a post only queues, nothing runs on a real-time timer,
//! and work moves only when the test polls, calls [`SimFabric::progress`]
//! or advances the clock (the clock tests and the conformance suite's
//! timing scenarios run there). On the Auto clock a post's progress is
//! deterministic too (the poster's thread runs it, in QPN order, before
//! the post returns); only the NIC thread's work depends on real time:
//! when a large copy's completion lands (a test holds it with the copy
//! hook, or polls until it comes), and RNR steps for armed CQs (a test
//! that counts retries per poll arms none).
//!
//! Time is virtual ([`SimFabric::clock`], the [`clock`] module): ACK
//! timeouts with `retry_cnt`, RNR NAK timers with `rnr_retry`, and READ round
//! trips with FENCE run on it. By default ([`ClockMode::Auto`]) progress
//! moves it as far as the old, timeless behaviour went (RNR waits one
//! period per poll, or per RNR timer of real time for a parked waiter); a
//! test that wants to watch a timer sets [`ClockMode::Manual`] and moves it
//! with [`SimFabric::advance`].
//!
//! Where ConnectX (libmlx5) and rxe differ in ways an engine must survive,
//! the device's [`DeviceConfig`] says which one it is:
//! [`DeviceConfig::mlx5_like`] and [`DeviceConfig::rxe_like`] (both in
//! [`DeviceConfig::profiles`]), each fact cited from rdma-core's source.
//!
//! What a real RC NIC checks is checked: keys, protection domains, bounds and
//! access rights on both sides, QP states, queue depths, inline limits, the
//! connection's QPN and PSN. Errors complete as real hardware completes them
//! (`REM_ACCESS_ERR`, `LOC_PROT_ERR`, ...), move no byte, and put the QPs in
//! the error state, flushing what is left with `WR_FLUSH_ERR`.
//!
//! A [`FaultPlan`] given to the fabric is consulted at every verbs fault site.
//!
//! Completion channels and async events work on real, non-blocking
//! eventfds, with verbs' readiness semantics (one-shot arming, arm then
//! poll): see the [`events`] module. [`SimVerbs::raise_async_event`] and
//! [`SimVerbs::set_port_state`] raise events; responder errors, CQ overruns
//! and device loss raise theirs by themselves.
//!
//! Connection management (rdma_cm's listen/connect/accept with private data)
//! is [`SimCm`], from [`Provider::connection_manager`]: see the `cm` module.

pub mod clock;
mod cm;
mod engine;
pub mod events;
mod fast;
mod mr;
mod qp;
mod state;

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use crossbeam_utils::sync::{ShardedLock, ShardedLockReadGuard, ShardedLockWriteGuard};

use hal_verbs::{
    Api, AsyncEvent, Context, CqModerationCaps, DeviceAttributes, DeviceInfo, GidEntry, Mtu,
    PortAttributes, PortState, Provider, Result, VerbsError, WcStatus,
};

use crate::faults::FaultPlan;
use state::FabricState;

pub use clock::{ClockMode, SimClock, ack_timeout, rnr_nak_timer};
pub use cm::{LISTENER_WINDOW, SimCm, SimConnectRequest, SimConnection, SimListener};
pub use events::SimCompChannel;
pub use mr::{SimMr, SimPd};
pub use qp::{SimCq, SimQp};

/// The fabric's state behind its reader-writer lock: held exclusively by
/// everything but the fast path (see [`SimFabric::read`]).
pub(crate) type World = ShardedLock<FabricState>;
/// The fabric held exclusively.
pub(crate) type Exclusive<'a> = ShardedLockWriteGuard<'a, FabricState>;
/// The fabric held shared (the fast path).
pub(crate) type Shared<'a> = ShardedLockReadGuard<'a, FabricState>;

/// A condition to wait for with the fabric's lock released (a condition
/// variable cannot take a reader-writer lock's guard): a generation
/// counter, raised by each notification, under a lock of its own that a
/// waiter takes before it lets the fabric go, so no notification made
/// after its check is missed.
#[derive(Debug, Default)]
pub(crate) struct Notifier {
    generation: Mutex<u64>,
    cond: Condvar,
}

impl Notifier {
    fn generation(&self) -> MutexGuard<'_, u64> {
        self.generation
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes every waiter.
    pub(crate) fn notify_all(&self) {
        *self.generation() += 1;
        self.cond.notify_all();
    }

    /// Lets `guard` go, waits for a notification made after this call
    /// (or for `timeout`, or spuriously), and holds `world` again.
    pub(crate) fn wait<'a>(
        &self,
        world: &'a World,
        guard: Exclusive<'a>,
        timeout: Option<Duration>,
    ) -> Exclusive<'a> {
        let generation = self.generation();
        let seen = *generation;
        drop(guard);
        let generation = match timeout {
            None => self
                .cond
                .wait_while(generation, |g| *g == seen)
                .unwrap_or_else(PoisonError::into_inner),
            Some(timeout) => {
                self.cond
                    .wait_timeout_while(generation, timeout, |g| *g == seen)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
        };
        drop(generation);
        lock(world)
    }
}

/// The simulated verbs backend: its handle types.
#[derive(Debug)]
pub struct SimVerbsApi;

impl Api for SimVerbsApi {
    type Provider = SimVerbs;
    type Context = SimContext;
    type ProtectionDomain = SimPd;
    type MemoryRegion = SimMr;
    type CompletionQueue = SimCq;
    type CompletionChannel = SimCompChannel;
    type QueuePair = SimQp;
    type ConnectionManager = SimCm;
    type Listener = SimListener;
    type ConnectRequest = SimConnectRequest;
    type Connection = SimConnection;
}

/// Configuration of one simulated RDMA device (one port, RoCE).
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// The IPv4 address its GIDs carry; `None` derives one from the node's.
    pub ipv4: Option<Ipv4Addr>,
    /// Whether `ibv_reg_dmabuf_mr` works (false: `NotSupported`/EOPNOTSUPP,
    /// as on rxe).
    pub dmabuf: bool,
    /// What `query_device` reports; the limits in it are enforced.
    pub attributes: DeviceAttributes,
    /// Port state.
    pub port_state: PortState,
    /// Largest MTU of the port.
    pub max_mtu: Mtu,
    /// MTU in use (RoCE: set by the netdev's MTU; 1024 on a 1500-byte link).
    pub active_mtu: Mtu,
    /// Largest inline payload a QP may be created with.
    pub max_inline_data: u32,
    /// The PCI bus id it reports (`None`: a software device, like rxe).
    pub pci_bus_id: Option<String>,
    /// The errno the provider answers an INLINE request above the QP's
    /// `max_inline_data` with: `EINVAL` from librxe (`validate_send_wr` in
    /// rdma-core's `providers/rxe/rxe.c`), `ENOMEM` from libmlx5
    /// (`set_data_inl_seg` in `providers/mlx5/qp.c`). The HAL refuses such a
    /// request before the provider sees it, so the sim answers
    /// [`VerbsError::InvalidArgument`] in both profiles, as the rdma backend
    /// does, with this errno in it: what the provider would have said.
    pub inline_overflow_errno: i32,
    /// Whether destroying a QP removes its completions from its CQs, as
    /// ConnectX does (rxe keeps them). Off by default; on, a QP torn down
    /// with work outstanding loses those completions unless it was drained
    /// first (`hal_verbs::drain`).
    pub destroy_qp_purges_cq: bool,
    /// Whether a lost device flushes its QPs' outstanding work
    /// (`WR_FLUSH_ERR` completions, then poll errors): on by default, as the
    /// sim always did. Off, it behaves as hardware does after a fatal error:
    /// no completion comes for outstanding work, only the
    /// [`AsyncEvent::DeviceFatal`] event on the context's async fd, and
    /// polls fail.
    pub device_loss_flushes: bool,
    /// Whether a responder that meets a remote access violation or an
    /// invalid request raises [`AsyncEvent::QpAccessError`] /
    /// [`AsyncEvent::QpRequestError`] on its QP, as the IBA asks and
    /// ConnectX does (mlx5_ib maps the WQ access/invalid-request error
    /// events to them, `mlx5_ib_qp_event` in the kernel's
    /// `drivers/infiniband/hw/mlx5/qp.c`). On by default; off in
    /// [`rxe_like`](Self::rxe_like): rxe (kernel 6.1) moves the responder
    /// to ERROR and reports no async event, as `tests/tests/rxe_events.rs`
    /// measures.
    pub responder_error_events: bool,
    /// Whether a request posted while the local port is down fails at once
    /// with `LOC_QP_OP_ERR`, as on rxe (kernel 6.1: its transmit fails on a
    /// netdev that is down; `tests/tests/rxe_events.rs` measures it). Off by
    /// default (ConnectX): the request is sent into a dead link and ends in
    /// `RETRY_EXC_ERR` when its retries run out.
    pub link_down_fails_locally: bool,
    /// The status of a request whose gather fails locally because an SG
    /// entry's lkey names no MR of the QP's PD (another PD's, or none).
    /// ConnectX: a local protection error (CQE syndrome
    /// `MLX5_CQE_SYNDROME_LOCAL_PROT_ERR`, mapped by libmlx5's
    /// `mlx5_handle_error_cqe` in `providers/mlx5/cq.c`), `LOC_PROT_ERR`,
    /// the default. rxe: `LOC_QP_OP_ERR` (`rxe_requester` in the kernel's
    /// `drivers/infiniband/sw/rxe/rxe_req.c` gives it for a failed
    /// `finish_packet` other than EFAULT, and `copy_data`'s failed MR
    /// lookup is EINVAL; seen in the VM, kernel 6.1). An entry that
    /// overruns its MR is `LOC_PROT_ERR` on both (rxe's range check is
    /// EFAULT).
    pub gather_fault_status: WcStatus,
    /// The status of a receive whose SG entry the responder cannot write
    /// (an lkey of another PD, or none, or an entry past its MR) when a
    /// SEND lands in it; the requester is told `REM_OP_ERR` (NAK Remote
    /// Operational Error) on both devices. ConnectX: `LOC_PROT_ERR` (the
    /// responder's local protection error), the default. rxe:
    /// `LOC_QP_OP_ERR` (`send_data_in` in `rxe_resp.c` answers a failed
    /// `copy_data` with `RESPST_ERR_MALFORMED_WQE`, completed as
    /// `IB_WC_LOC_QP_OP_ERR`; seen in the VM, kernel 6.1).
    pub receive_fault_status: WcStatus,
    /// The requester's and the responder's statuses for a SEND longer
    /// than the receive it consumes (nothing is placed). ConnectX:
    /// `REM_INV_REQ_ERR` (IBA's NAK Invalid Request, which the responder
    /// sends on a length error) and `LOC_LEN_ERR` for the receive, the
    /// default. rxe: `REM_OP_ERR` and `LOC_QP_OP_ERR` (rxe's `copy_data`
    /// refuses a copy past the receive's residue with EINVAL, which the
    /// responder treats as a malformed WQE and NAKs as a remote
    /// operational error; seen in the VM, kernel 6.1).
    pub receive_too_small_status: (WcStatus, WcStatus),
    /// Whether a queue slot is freed only when its completion, or a later
    /// one of its queue, is polled, as on ConnectX (the default): libmlx5
    /// moves a work queue's tail as it polls CQEs (`mlx5_parse_cqe` in
    /// `providers/mlx5/cq.c` sets the send queue's tail from the CQE's
    /// `wqe_counter`), so the slots of unsignaled requests stay taken until
    /// a later signaled completion is polled. Off, as on rxe: the device
    /// frees a slot when it retires the request (`do_complete` in
    /// `rxe_comp.c` and `rxe_resp.c` advance the queue's consumer index,
    /// signaled or not, polled or not; seen in the VM), so a queue whose
    /// unsignaled requests all completed takes new ones before any poll.
    pub slots_freed_when_polled: bool,
    /// Whether a post refused for the QP's state (a send before RTS, a
    /// receive in RESET) leaves `bad_wr` outside the batch, so the HAL
    /// reports [`hal_verbs::Posted::Unknown`], as librxe does: its
    /// `rxe_post_send` sets `*bad_wr = NULL`, queues the requests, and
    /// returns the EINVAL of the doorbell (the kernel's `rxe_post_send`
    /// refuses a QP below RTS); its `rxe_post_recv` answers EINVAL for
    /// RESET before looking at the batch (`providers/rxe/rxe.c`; seen in
    /// the VM). Off (ConnectX-like, the default): the error names the
    /// first request (`Posted::Prefix(0)`), the answer the conformance
    /// suite's facts record for mlx5 (which sets `bad_wr` to the request it
    /// refuses). Either way the sim queues none of the batch: a drain after
    /// `Unknown` completes nothing.
    pub wrong_state_post_is_unknown: bool,
    /// Whether an MR without remote rights gets rkey 0, as on rxe:
    /// `rxe_mr_init` (kernel `rxe_mr.c`) sets `rkey = (access &
    /// IB_ACCESS_REMOTE) ? lkey : 0`. Off (ConnectX, the default): the
    /// MR's one mkey is both its lkey and its rkey whatever its rights
    /// (`mlx5_ib_reg_user_mr`), and a remote access through it fails on the
    /// MR's rights (`REM_ACCESS_ERR`).
    pub local_only_rkey_is_zero: bool,
    /// Whether the requester's retransmit (ACK) timer keeps running while a
    /// request waits out an RNR timer, as on rxe. On: an RNR-NAKed request
    /// whose ACK timeout (armed when it was sent) ends before the
    /// responder's RNR timer does counts a transport retry there (one per
    /// RNR wait at most: the timer is armed again only when the request is
    /// sent again), and once `retry_cnt` retries are spent the next such
    /// expiry fails it with `RETRY_EXC_ERR`, whatever `rnr_retry` says (7
    /// included). Only an ACK resets the count. So with an RNR timer longer
    /// than the ACK timeout, a SEND without a receive fails with
    /// `RETRY_EXC_ERR` at `retry_cnt` × the RNR timer + the ACK timeout.
    /// rxe (Linux `drivers/infiniband/sw/rxe/`): the requester arms
    /// `qp->retrans_timer` when it sends (`update_state` in `rxe_req.c`) and
    /// nothing stops it for an RNR NAK (`COMPST_RNR_RETRY` in `rxe_comp.c`
    /// only arms `qp->rnr_nak_timer`); when it fires, `retransmit_timer`
    /// sets `qp->comp.timeout` and `rxe_completer`'s `COMPST_ERROR_RETRY`
    /// counts `comp.retry_cnt` down and fails the WQE with
    /// `IB_WC_RETRY_EXC_ERR` once it is 0; the retry it asks for otherwise
    /// still waits for the RNR timer (`qp->req.wait_for_rnr_timer`, set by
    /// `COMPST_RNR_RETRY`, cleared by `rnr_nak_timer`), and
    /// `comp.retry_cnt` is reset only by `reset_retry_counters`, on an ACK
    /// (`check_ack`). Measured in the VM (ACK code 12 ≈ 16.8 ms, RNR code
    /// 22 = 20.48 ms, `retry_cnt` 2, `rnr_retry` 7): `RETRY_EXC_ERR` after
    /// 68.5 and 70.1 ms, nominal 2 × 20.48 + 16.8 ms (the conformance scenario
    /// `rnr_wait_longer_than_the_ack_timeout`). Off (the default,
    /// ConnectX, IBA 9.7.5.2.8): an RNR NAK is a response, the ACK timer
    /// stops, and only `rnr_retry` bounds the wait.
    pub retransmit_timer_runs_during_rnr_wait: bool,
}

impl Default for DeviceConfig {
    /// A ConnectX-like device: dma-buf capable, 4096-byte MTU, and the
    /// object limits a ConnectX reports (`ibv_devinfo -vv`): 131,072 QPs
    /// of 32,768 requests and 30 SGEs, 16,777,216 CQs of 4,194,303
    /// entries, 16,777,216 MRs. These are the figures of a ConnectX-6
    /// (fw 20.37) and a ConnectX-6 Dx (fw 22.36) in `ibv_devinfo -vv`
    /// outputs posted to public issue trackers; the ConnectX-7 outputs
    /// found there (part 4129, fw 28.x) were without `-v` and list no
    /// limits, so the ConnectX-6 figures stand for it until one is read
    /// on a ConnectX-7. They are what the simulation enforces: an engine
    /// of a thousand peers fits, as it does on the hardware.
    fn default() -> Self {
        Self {
            ipv4: None,
            dmabuf: true,
            attributes: DeviceAttributes {
                fw_ver: "gdr-sim 1.0".to_owned(),
                vendor_id: 0x02c9,
                vendor_part_id: 0x5117,
                max_mr_size: 1 << 40,
                max_qp: 131_072,
                max_qp_wr: 32_768,
                max_sge: 30,
                max_cq: 16_777_216,
                max_cqe: 4_194_303,
                max_mr: 16_777_216,
                max_qp_rd_atom: 16,
                max_qp_init_rd_atom: 16,
                phys_port_cnt: 1,
                // ConnectX-like: one vector per core, moderation up to
                // mlx5's limits (cq_count 16 bits, cq_period 12 bits).
                num_comp_vectors: 8,
                cq_moderation: Some(CqModerationCaps {
                    max_cq_count: u16::MAX,
                    max_cq_period_us: 4095,
                }),
            },
            port_state: PortState::Active,
            max_mtu: Mtu::Mtu4096,
            active_mtu: Mtu::Mtu4096,
            max_inline_data: 256,
            // Beside the simulated GPU's default 0000:17:00.0, as on a PCIe switch.
            pci_bus_id: Some("0000:18:00.0".to_owned()),
            inline_overflow_errno: libc::EINVAL,
            destroy_qp_purges_cq: false,
            device_loss_flushes: true,
            responder_error_events: true,
            link_down_fails_locally: false,
            gather_fault_status: WcStatus::LOC_PROT_ERR,
            receive_fault_status: WcStatus::LOC_PROT_ERR,
            receive_too_small_status: (WcStatus::REM_INV_REQ_ERR, WcStatus::LOC_LEN_ERR),
            slots_freed_when_polled: true,
            wrong_state_post_is_unknown: false,
            local_only_rkey_is_zero: false,
            retransmit_timer_runs_during_rnr_wait: false,
        }
    }
}

impl DeviceConfig {
    /// A ConnectX-like device (libmlx5): the default device with the
    /// behaviours where mlx5 differs from rxe in ways an engine must
    /// survive, each from rdma-core's source (`providers/`, at
    /// 691953d8d502f54088f776c5ba2aeed0a5ac945d):
    ///
    /// - destroying a QP removes its completions from its CQs
    ///   ([`destroy_qp_purges_cq`](Self::destroy_qp_purges_cq)):
    ///   `mlx5_destroy_qp` (`mlx5/verbs.c`) calls `__mlx5_cq_clean` on the
    ///   receive and the send CQ, and `mlx5_modify_qp` does the same on a
    ///   move to RESET; `rxe_destroy_qp` (`rxe/rxe.c`) only destroys the QP
    ///   in the kernel, its completions stay;
    /// - an INLINE request above `max_inline_data` is refused with ENOMEM
    ///   ([`inline_overflow_errno`](Self::inline_overflow_errno)):
    ///   `set_data_inl_seg` in `mlx5/qp.c` (rxe: EINVAL, `validate_send_wr`);
    /// - a fatal device yields no completion for outstanding work, only the
    ///   `IBV_EVENT_DEVICE_FATAL` async event
    ///   ([`device_loss_flushes`](Self::device_loss_flushes) off): the CQ is
    ///   memory the device writes, and a dead device writes nothing. libmlx5
    ///   marks the context fatal when that event is read (`mlx5_async_event` in
    ///   `mlx5/verbs.c`), and its own steering code stops waiting for
    ///   completions once the device is fatal, since none will come
    ///   (`dr_send.c`, "On IBV_EVENT_DEVICE_FATAL a success is returned").
    ///   rxe cannot be made fatal while a process holds it, so
    ///   [`rxe_like`](Self::rxe_like) keeps the flushes.
    ///
    /// Where the default already behaves as mlx5 does, `mlx5_like()` keeps
    /// it: the error statuses ([`gather_fault_status`](Self::gather_fault_status),
    /// [`receive_fault_status`](Self::receive_fault_status),
    /// [`receive_too_small_status`](Self::receive_too_small_status)), slots
    /// freed as completions are polled
    /// ([`slots_freed_when_polled`](Self::slots_freed_when_polled)), a
    /// refused post naming its first request
    /// ([`wrong_state_post_is_unknown`](Self::wrong_state_post_is_unknown)
    /// off) and the mkey as rkey of every MR
    /// ([`local_only_rkey_is_zero`](Self::local_only_rkey_is_zero) off).
    ///
    /// The conformance suite runs per profile: `mlx5_like()` and
    /// [`rxe_like()`](Self::rxe_like) (see [`profiles`](Self::profiles)).
    pub fn mlx5_like() -> Self {
        Self {
            destroy_qp_purges_cq: true,
            inline_overflow_errno: libc::ENOMEM,
            device_loss_flushes: false,
            // As the default, spelled out: this profile is mlx5 whatever
            // the default becomes.
            gather_fault_status: WcStatus::LOC_PROT_ERR,
            receive_fault_status: WcStatus::LOC_PROT_ERR,
            receive_too_small_status: (WcStatus::REM_INV_REQ_ERR, WcStatus::LOC_LEN_ERR),
            slots_freed_when_polled: true,
            wrong_state_post_is_unknown: false,
            local_only_rkey_is_zero: false,
            retransmit_timer_runs_during_rnr_wait: false,
            ..Self::default()
        }
    }

    /// The device profiles the conformance suite runs in, by name:
    /// `("mlx5", mlx5_like())` and `("rxe", rxe_like())`.
    pub fn profiles() -> [(&'static str, Self); 2] {
        [("mlx5", Self::mlx5_like()), ("rxe", Self::rxe_like())]
    }

    /// An rxe-like device: no dma-buf, 1024-byte active MTU, no PCI
    /// function, one completion vector, no CQ moderation, no async event
    /// for a responder's error
    /// ([`responder_error_events`](Self::responder_error_events)), a
    /// request on a down link failing at once
    /// ([`link_down_fails_locally`](Self::link_down_fails_locally)), and
    /// rxe's answers where they are not ConnectX's, each seen in the VM
    /// (the conformance suite's `RxeBackend` facts) and cited on its
    /// field: `LOC_QP_OP_ERR` for a gather or a receive it cannot use
    /// ([`gather_fault_status`](Self::gather_fault_status),
    /// [`receive_fault_status`](Self::receive_fault_status)),
    /// `REM_OP_ERR`/`LOC_QP_OP_ERR` for a receive too small
    /// ([`receive_too_small_status`](Self::receive_too_small_status)),
    /// slots freed as the device retires requests
    /// ([`slots_freed_when_polled`](Self::slots_freed_when_polled) off),
    /// `Posted::Unknown` for a post refused for the QP's state
    /// ([`wrong_state_post_is_unknown`](Self::wrong_state_post_is_unknown)),
    /// rkey 0 for an MR without remote rights
    /// ([`local_only_rkey_is_zero`](Self::local_only_rkey_is_zero)), and
    /// the retransmit timer running through RNR waits
    /// ([`retransmit_timer_runs_during_rnr_wait`](Self::retransmit_timer_runs_during_rnr_wait)).
    /// Its object limits are the default's: rxe's own have not been read
    /// in the VM yet.
    pub fn rxe_like() -> Self {
        let mut attributes = Self::default().attributes;
        attributes.num_comp_vectors = 1;
        attributes.cq_moderation = None;
        Self {
            dmabuf: false,
            active_mtu: Mtu::Mtu1024,
            pci_bus_id: None,
            attributes,
            responder_error_events: false,
            link_down_fails_locally: true,
            gather_fault_status: WcStatus::LOC_QP_OP_ERR,
            receive_fault_status: WcStatus::LOC_QP_OP_ERR,
            receive_too_small_status: (WcStatus::REM_OP_ERR, WcStatus::LOC_QP_OP_ERR),
            slots_freed_when_polled: false,
            wrong_state_post_is_unknown: true,
            local_only_rkey_is_zero: true,
            retransmit_timer_runs_during_rnr_wait: true,
            ..Self::default()
        }
    }
}

/// Configuration of one simulated node (a host with one or more NICs).
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The node's IPv4 address: device `k` carries this address plus `k`.
    /// `None` assigns `10.77.<node>.1` (plus `k`).
    pub ipv4: Option<Ipv4Addr>,
    /// Its devices, named `sim0`, `sim1`, ... in this order.
    pub devices: Vec<DeviceConfig>,
}

impl Default for NodeConfig {
    /// One default device, an assigned address.
    fn default() -> Self {
        Self {
            ipv4: None,
            devices: vec![DeviceConfig::default()],
        }
    }
}

impl NodeConfig {
    /// `n` default devices.
    pub fn with_devices(n: usize) -> Self {
        Self {
            ipv4: None,
            devices: vec![DeviceConfig::default(); n],
        }
    }
}

/// A simulated RDMA fabric: the nodes, their devices and every verbs object.
///
/// Cloning gives another handle on the same fabric.
#[derive(Clone)]
pub struct SimFabric {
    shared: Arc<World>,
    /// Signalled on every connection-manager change (listen, request,
    /// answer, disconnect), for the sides waiting on one.
    pub(crate) cm_cond: Arc<Notifier>,
    /// Signalled when the last copy running outside the lock has finished
    /// ([`state::Copies`]), for the deregistrations waiting on it.
    copies_cond: Arc<Notifier>,
    /// The fabric's NIC thread, started at the first work it gets (see
    /// [`nic_thread`]): it steps RNR waits for parked waiters.
    nic: Arc<OnceLock<Sender<NicWork>>>,
    /// The fabric's DMA threads, started at the first large copy (see
    /// [`DmaPool`]).
    dma: Arc<OnceLock<DmaPool>>,
}

/// The most DMA threads a fabric starts.
const DMA_THREADS_MAX: usize = 4;

/// The threads that move large transfers' bytes with the lock released:
/// one per core up to [`DMA_THREADS_MAX`], each job to the next in turn,
/// so transfers of different QPs move at once (a QP's own never do: none
/// of its requests starts while bytes of an earlier one are moving). Each
/// ends when the fabric's last handle goes.
struct DmaPool {
    workers: Vec<Sender<DmaJob>>,
    next: std::sync::atomic::AtomicUsize,
}

/// What the NIC thread is handed.
enum NicWork {
    /// Look at the fabric's timed work again ([`FabricState::nic_pace`]):
    /// sooner than planned, or for the first time.
    Timers,
}

/// Copies planned (counted in `copies.outside`) for a DMA thread, with
/// what it needs to account for them: the fabric's state is kept alive
/// until they are.
struct DmaJob {
    batch: Vec<state::Deferred>,
    shared: Arc<World>,
    copies_cond: Arc<Notifier>,
}

impl fmt::Debug for SimFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("SimFabric")
            .field("nodes", &state.nodes.len())
            .field("devices", &state.devices.len())
            .field("qps", &state.qps.len())
            .field("mrs", &state.mrs.len())
            .field("paused", &state.paused)
            .finish()
    }
}

impl Default for SimFabric {
    fn default() -> Self {
        Self::new()
    }
}

impl SimFabric {
    /// A fabric with no nodes and no scripted faults.
    pub fn new() -> Self {
        Self::with_faults(FaultPlan::new())
    }

    /// A fabric whose objects all consult `plan`.
    pub fn with_faults(plan: FaultPlan) -> Self {
        Self {
            shared: Arc::new(ShardedLock::new(FabricState::new(plan))),
            cm_cond: Arc::default(),
            copies_cond: Arc::default(),
            nic: Arc::default(),
            dma: Arc::default(),
        }
    }

    /// The fault plan shared by the fabric's objects.
    pub fn faults(&self) -> FaultPlan {
        self.lock().faults.clone()
    }

    // A test that panicked while holding the lock must not hide its own
    // failure behind a poison error, and Drop impls must not panic.
    pub(crate) fn lock(&self) -> Exclusive<'_> {
        lock(&self.shared)
    }

    /// The fabric held shared: for the fast path only, which changes
    /// nothing but what has a lock of its own (a QP's posted count, a CQ's
    /// ring, retired slots), so holders on different QPs and CQs run at
    /// once; everything else holds it exclusively ([`lock`](Self::lock)).
    /// A registration is not removed while any holding lasts, so bytes
    /// the fast path moves under it land in live memory.
    pub(crate) fn read(&self) -> Shared<'_> {
        self.shared.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lock, once no copy runs outside it ([`state::Copies`]): what
    /// anything that may free or unmap registered memory (deregistration)
    /// or forget a transfer whose bytes may be moving (a QP reset or
    /// destroyed) takes instead of [`lock`](Self::lock).
    pub(crate) fn lock_without_copies(&self) -> Exclusive<'_> {
        let mut state = self.lock();
        while state.copies.outside > 0 {
            state.copies.waiters += 1;
            state = self.copies_cond.wait(&self.shared, state, None);
            state.copies.waiters -= 1;
        }
        state
    }

    /// The progress a poll makes, returning the lock held after it. On the
    /// Auto clock the bytes of large one-sided transfers move with the lock
    /// released ([`state::Copies`]), on the fabric's DMA threads, as a real
    /// NIC's DMA runs while the host's threads poll and work; their
    /// completions come once they have moved, in order. On the Manual
    /// clock, or paused, it is [`FabricState::progress`] under the lock, as
    /// before.
    pub(crate) fn progress_for_poll(&self) -> Exclusive<'_> {
        let mut state = self.lock();
        let batch = progress_deferring(&mut state);
        self.wake_nic(&mut state);
        self.hand_off(state, batch)
    }

    /// The progress a post makes, in the holding of the lock that queued
    /// it (consumed: the lock is free when this returns): on the Auto
    /// clock and not paused, what a poll's would, RNR waits aside
    /// ([`FabricState::progress`] with `post_time`), so completions land and armed
    /// channels fire without a poll, as on a real NIC. On the Manual clock,
    /// or paused, nothing: there work moves only when the test says.
    pub(crate) fn progress_after_post<'a>(&'a self, mut state: Exclusive<'a>) {
        if state.clock.mode != ClockMode::Auto || state.paused {
            return;
        }
        let batch = post_progress_deferring(&mut state);
        self.wake_nic(&mut state);
        drop(self.hand_off(state, batch));
    }

    /// Hands planned copies to a DMA thread, or, when there is none,
    /// moves them in this thread with the lock released; returns the lock.
    fn hand_off<'a>(&'a self, state: Exclusive<'a>, batch: Vec<state::Deferred>) -> Exclusive<'a> {
        if batch.is_empty() {
            return state;
        }
        match self.start_dma(batch) {
            Ok(()) => state,
            Err(job) => {
                // No DMA thread: this caller moves the bytes itself, with
                // the lock released as the thread would.
                drop(state);
                run_dma(job);
                self.lock()
            }
        }
    }

    /// Hands planned copies to a DMA thread (the threads started now if not);
    /// gives the job back when there is no thread to run it.
    fn start_dma(&self, batch: Vec<state::Deferred>) -> Result<(), DmaJob> {
        let job = DmaJob {
            batch,
            shared: Arc::clone(&self.shared),
            copies_cond: Arc::clone(&self.copies_cond),
        };
        let pool = self.dma_pool();
        if pool.workers.is_empty() {
            return Err(job);
        }
        let next = pool.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        pool.workers[next % pool.workers.len()]
            .send(job)
            .map_err(|mpsc::SendError(job)| job)
    }

    /// The DMA threads, started at the first call. After each job a thread
    /// asks the NIC thread to look at the fabric's timed work again, as
    /// the progress the job made may have left an RNR wait to step.
    fn dma_pool(&self) -> &DmaPool {
        self.dma.get_or_init(|| {
            let count = std::thread::available_parallelism()
                .map_or(1, std::num::NonZeroUsize::get)
                .min(DMA_THREADS_MAX);
            let mut workers = Vec::with_capacity(count);
            for index in 0..count {
                let (sender, jobs) = mpsc::channel::<DmaJob>();
                let timers = self.nic_sender().clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("gdr-sim-dma{index}"))
                    .spawn(move || {
                        for job in jobs {
                            run_dma(job);
                            // No NIC thread: polls step RNR waits.
                            let _ = timers.send(NicWork::Timers);
                        }
                    });
                match spawned {
                    Ok(_) => workers.push(sender),
                    Err(e) => tracing::warn!(
                        error = %e,
                        "a DMA thread of the sim did not start: the others, or the poster, move copies"
                    ),
                }
            }
            DmaPool {
                workers,
                next: Default::default(),
            }
        })
    }

    /// The NIC thread's inbox, the thread started at the first call.
    fn nic_sender(&self) -> &Sender<NicWork> {
        self.nic.get_or_init(|| {
            let (sender, work) = mpsc::channel::<NicWork>();
            // It ends when the last handle on the fabric (and with it the
            // sender) is gone; a copy job keeps the state alive, the thread
            // itself only a weak reference.
            let shared = Arc::downgrade(&self.shared);
            let copies_cond = Arc::downgrade(&self.copies_cond);
            let spawned = std::thread::Builder::new()
                .name("gdr-sim-nic".into())
                .spawn(move || nic_thread(&work, &shared, &copies_cond));
            if let Err(e) = spawned {
                tracing::warn!(
                    error = %e,
                    "the sim's NIC thread did not start: \
                     RNR waits move only when polled"
                );
            }
            sender
        })
    }

    /// Tells the NIC thread when a parked waiter needs the fabric stepped
    /// ([`FabricState::nic_pace`]), if that is sooner than it planned.
    fn wake_nic(&self, state: &mut FabricState) {
        let Some(pace) = state.nic_pace() else {
            return;
        };
        let due = state.last_full_progress() + pace;
        if state.nic_due.is_some_and(|planned| planned <= due) {
            return;
        }
        state.nic_due = Some(due);
        if self.nic_sender().send(NicWork::Timers).is_err() {
            // No thread: polls step the waits (warned when it failed to
            // start); `nic_due` stays set so this is not tried per poll.
            tracing::trace!("sim: no NIC thread to step RNR waits");
        }
    }

    /// Adds a node with the devices of `config` and returns its provider.
    ///
    /// # Panics
    /// When a device's address is already used on the fabric (a test
    /// configuration error).
    pub fn add_node(&self, name: &str, config: NodeConfig) -> SimVerbs {
        let node = self.lock().add_node(name, config);
        // A client may be waiting for this node's address to appear.
        self.cm_cond.notify_all();
        SimVerbs {
            fabric: self.clone(),
            node,
        }
    }

    /// Runs every queued work request that can run, until none can; returns
    /// how many ran. Does nothing while paused.
    pub fn progress(&self) -> usize {
        let mut state = self.lock();
        let ran = state.progress();
        self.wake_nic(&mut state);
        ran
    }

    /// Holds (`true`) or releases (`false`) progress: while held, posted work
    /// requests stay outstanding, polls find nothing new and nothing moves
    /// by itself. Releasing it on the Auto clock makes the progress a post
    /// makes: what was held completes, and fires armed channels, without a
    /// poll.
    pub fn set_paused(&self, paused: bool) {
        let mut state = self.lock();
        state.paused = paused;
        if !paused {
            self.progress_after_post(state);
        }
    }

    /// Whether progress is held.
    pub fn is_paused(&self) -> bool {
        self.lock().paused
    }
}

/// Copies running outside the lock, accounted for when they end (or when
/// the thread running them unwinds).
struct Outside<'a> {
    shared: &'a World,
    copies_cond: &'a Notifier,
    /// (ticket, QPN) of each.
    done: Vec<(u64, u32)>,
}

impl<'a> Outside<'a> {
    /// The copies have finished: the lock again, with them accounted.
    fn finish(mut self) -> Exclusive<'a> {
        let done = std::mem::take(&mut self.done);
        let mut state = lock(self.shared);
        Self::account(self.copies_cond, &mut state, &done);
        state
    }

    fn account(copies_cond: &Notifier, state: &mut FabricState, done: &[(u64, u32)]) {
        state.copies_done(done);
        if state.copies.outside == 0 {
            copies_cond.notify_all();
        }
    }
}

impl Drop for Outside<'_> {
    fn drop(&mut self) {
        if !self.done.is_empty() {
            let done = std::mem::take(&mut self.done);
            let mut state = lock(self.shared);
            Self::account(self.copies_cond, &mut state, &done);
        }
    }
}

// A test that panicked while holding the lock must not hide its own
// failure behind a poison error, and Drop impls must not panic.
fn lock(shared: &World) -> Exclusive<'_> {
    shared.write().unwrap_or_else(PoisonError::into_inner)
}

/// Progress under the lock, the large transfers' bytes deferred (Auto
/// clock, not paused, no deregistration waiting for copies to end: it
/// must not be starved by pollers taking turns); returns the copies
/// planned, counted in `copies.outside` before the lock is let go.
fn progress_deferring(state: &mut FabricState) -> Vec<state::Deferred> {
    if state.clock.mode != ClockMode::Auto || state.paused {
        state.progress();
        return Vec::new();
    }
    state.copies.defer = state.copies.waiters == 0;
    state.progress();
    state.copies.defer = false;
    state.plan_copies()
}

/// The fabric's NIC thread (started at its first work, ended when the
/// fabric's last handle goes and its DMA threads with it): while a parked
/// waiter needs it
/// ([`FabricState::nic_pace`]) it stands in for the poll that waiter does
/// not make: once no full progress has run for the pace, it makes one, as
/// a poll would (one RNR timer period, its completions and channel
/// events). It never runs on the Manual clock or while paused.
fn nic_thread(work: &mpsc::Receiver<NicWork>, shared: &Weak<World>, copies_cond: &Weak<Notifier>) {
    let mut due: Option<Instant> = None;
    loop {
        let next = match due {
            None => work.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(at) => work.recv_timeout(at.saturating_duration_since(Instant::now())),
        };
        match next {
            Ok(NicWork::Timers) | Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        let (Some(shared), Some(copies_cond)) = (shared.upgrade(), copies_cond.upgrade()) else {
            return;
        };
        due = step_for_waiters(&shared, &copies_cond);
    }
}

/// The NIC thread's timed step: a full progress if one is due for a parked
/// waiter; returns when to look again (`None`: nothing to time).
fn step_for_waiters(shared: &Arc<World>, copies_cond: &Arc<Notifier>) -> Option<Instant> {
    let mut state = lock(shared);
    let Some(pace) = state.nic_pace() else {
        state.nic_due = None;
        return None;
    };
    let at = state.last_full_progress() + pace;
    if Instant::now() < at {
        state.nic_due = Some(at);
        return Some(at);
    }
    tracing::trace!(
        ?pace,
        "sim: the NIC thread steps RNR waits for a parked waiter"
    );
    let batch = progress_deferring(&mut state);
    if !batch.is_empty() {
        drop(state);
        run_dma(DmaJob {
            batch,
            shared: Arc::clone(shared),
            copies_cond: Arc::clone(copies_cond),
        });
        state = lock(shared);
    }
    let due = state
        .nic_pace()
        .map(|pace| state.last_full_progress() + pace);
    state.nic_due = due;
    due
}

/// [`progress_deferring`] as a post makes it (RNR waits left alone: see
/// `post_time` on [`FabricState::progress`]).
fn post_progress_deferring(state: &mut FabricState) -> Vec<state::Deferred> {
    state.post_time = state.clock.mode == ClockMode::Auto;
    let batch = progress_deferring(state);
    state.post_time = false;
    batch
}

/// A DMA thread's copy work: moves the bytes of a job's planned copies with
/// the lock released, accounts for them, then makes the progress they let
/// happen (their completions, in order, for pollers and for threads that
/// wait without polling), moving any copies it defers in turn.
fn run_dma(job: DmaJob) {
    let DmaJob {
        mut batch,
        shared,
        copies_cond,
    } = job;
    while !batch.is_empty() {
        #[cfg(test)]
        let hook = lock(&shared).copy_hook.clone();
        let outside = Outside {
            shared: &shared,
            copies_cond: &copies_cond,
            done: batch.iter().map(|d| (d.ticket, d.qpn)).collect(),
        };
        for deferred in &batch {
            #[cfg(test)]
            if let Some(hook) = &hook {
                hook(deferred.pieces.iter().map(|p| p.len).sum());
            }
            // SAFETY: the pieces were resolved under the lock inside live
            // registrations by the progress that deferred them, and planned
            // (counted in `copies.outside`) in the same holding of the lock;
            // no registration is removed while that count is above zero
            // (`lock_without_copies`), and `outside` lowers it only after
            // this loop. The job holds the fabric's state alive.
            unsafe { engine::copy_all(&deferred.pieces) };
        }
        let mut state = outside.finish();
        // A post's progress: this is no poll, and counts as no RNR retry.
        batch = post_progress_deferring(&mut state);
    }
}

/// What lives on a fabric (or one node of it): what a test asserts is back
/// to zero once everything using it is dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NicResources {
    /// Memory regions registered.
    pub mrs: usize,
    /// Queue pairs.
    pub qps: usize,
    /// Completion queues.
    pub cqs: usize,
    /// Connection-manager listeners (the whole fabric's only).
    pub listeners: usize,
    /// Connection requests not yet accepted or refused (the whole
    /// fabric's only).
    pub requests: usize,
    /// Connections of the connection manager (the whole fabric's only).
    pub connections: usize,
}

impl NicResources {
    /// Whether nothing is left.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

impl SimFabric {
    /// What lives on the fabric now.
    pub fn resources(&self) -> NicResources {
        let state = self.lock();
        let (listeners, requests, connections) = state.cm.counts();
        NicResources {
            mrs: state.mrs.len(),
            qps: state.qps.len(),
            cqs: state.cqs.len(),
            listeners,
            requests,
            connections,
        }
    }
}

/// One simulated node's verbs provider.
#[derive(Debug, Clone)]
pub struct SimVerbs {
    fabric: SimFabric,
    node: usize,
}

impl SimVerbs {
    /// This provider erased (`hal_verbs::dynamic`), as gdr-core's engines
    /// hold their backends: the erased provider opens this node's devices.
    pub fn erased(&self) -> hal_verbs::dynamic::DynProvider {
        hal_verbs::dynamic::DynProvider::new::<SimVerbsApi>(self.clone())
    }
}

impl SimVerbs {
    /// The fabric the node is on.
    pub fn fabric(&self) -> &SimFabric {
        &self.fabric
    }

    /// What lives on the node's devices now: MRs, QPs and CQs (the
    /// connection manager's records are the fabric's: zero here).
    pub fn resources(&self) -> NicResources {
        let state = self.fabric.lock();
        let devices = &state.nodes[self.node].devices;
        NicResources {
            mrs: state
                .mrs
                .values()
                .filter(|m| devices.contains(&m.device))
                .count(),
            qps: state
                .qps
                .values()
                .filter(|q| devices.contains(&q.device))
                .count(),
            cqs: state
                .cqs
                .values()
                .filter(|c| devices.contains(&c.device))
                .count(),
            ..NicResources::default()
        }
    }

    /// The node's name, as given to [`SimFabric::add_node`].
    pub fn node_name(&self) -> String {
        self.fabric.lock().nodes[self.node].name.clone()
    }

    /// Sets the state of port `port` (from 1) of the node's device `device`
    /// and raises [`AsyncEvent::PortActive`] (to `Active`) or
    /// [`AsyncEvent::PortError`] (from `Active` to anything else), as a
    /// link going up or down does. While a port is not `Active` its
    /// device sends and receives nothing: requests to or from it end in
    /// `RETRY_EXC_ERR` once their retries run out (or at once in
    /// `LOC_QP_OP_ERR` on an rxe-like device, see
    /// [`DeviceConfig::link_down_fails_locally`]).
    ///
    /// # Panics
    /// When the node has no such device (a test configuration error).
    pub fn set_port_state(&self, device: &str, port: u8, port_state: PortState) {
        let mut state = self.fabric.lock();
        let dev = state
            .find_device(self.node, device)
            .unwrap_or_else(|| panic!("no simulated device {device}"));
        let before = std::mem::replace(&mut state.devices[dev].config.port_state, port_state);
        let event = match (before == PortState::Active, port_state == PortState::Active) {
            (false, true) => Some(AsyncEvent::PortActive { port }),
            (true, false) => Some(AsyncEvent::PortError { port }),
            _ => None,
        };
        if let Some(event) = event {
            let state = &mut *state;
            state.events.raise(dev, event, &state.qps);
        }
    }

    /// Raises `event` on the node's device `device`, as the device would:
    /// an affiliated event (QP, CQ) to the context that owns its object,
    /// any other to every context open on it (see the [`events`] module).
    /// [`AsyncEvent::DeviceFatal`] also kills the device, as
    /// [`crate::Fault::DeviceLost`] does; other events change nothing else
    /// (a QP named by a QP event is not moved to ERROR).
    ///
    /// # Panics
    /// When the node has no such device (a test configuration error).
    pub fn raise_async_event(&self, device: &str, event: AsyncEvent) {
        let mut state = self.fabric.lock();
        let dev = state
            .find_device(self.node, device)
            .unwrap_or_else(|| panic!("no simulated device {device}"));
        if event == AsyncEvent::DeviceFatal {
            // Raises the event itself.
            state.lose_device(dev);
        } else {
            let state = &mut *state;
            state.events.raise(dev, event, &state.qps);
        }
    }

    /// The IPv4 address of the node's device `name`.
    pub fn device_ipv4(&self, name: &str) -> Option<Ipv4Addr> {
        let state = self.fabric.lock();
        let dev = state.find_device(self.node, name)?;
        Some(state.devices[dev].ipv4)
    }
}

impl Provider<SimVerbsApi> for SimVerbs {
    fn backend_name(&self) -> &'static str {
        "sim"
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        let state = self.fabric.lock();
        let node = &state.nodes[self.node];
        if node.devices.is_empty() {
            return Err(VerbsError::NoDevice {
                detail: format!("simulated node {} has no device", node.name),
            });
        }
        Ok(node
            .devices
            .iter()
            .map(|&d| DeviceInfo {
                name: state.devices[d].name.clone(),
                node_guid: state.devices[d].guid,
                pci_bus_id: state.devices[d].config.pci_bus_id.clone(),
            })
            .collect())
    }

    fn open(&self, name: &str) -> Result<SimContext> {
        let mut state = self.fabric.lock();
        let device = state
            .find_device(self.node, name)
            .ok_or_else(|| VerbsError::NoDevice {
                detail: format!(
                    "no device {name} on simulated node {}",
                    state.nodes[self.node].name
                ),
            })?;
        state.alive(device, "ibv_open_device")?;
        let events = state.events.open(device)?;
        tracing::debug!(node = %state.nodes[self.node].name, device = name, "sim: open device");
        Ok(SimContext {
            fabric: self.fabric.clone(),
            device,
            name: name.to_owned(),
            events,
        })
    }

    fn connection_manager(&self) -> Result<SimCm> {
        Ok(SimCm {
            fabric: self.fabric.clone(),
            node: self.node,
            aborts: Default::default(),
        })
    }
}

/// An opened simulated device.
#[derive(Debug, Clone)]
pub struct SimContext {
    fabric: SimFabric,
    device: usize,
    name: String,
    /// This context's async events.
    events: Arc<events::AsyncSink>,
}

impl SimContext {
    /// Makes this context the owner of `cq`: its CQ events come here only.
    fn own_cq(&self, cq: &SimCq) {
        let owned = events::Owned::Cq(hal_verbs::CompletionQueue::cq_id(cq));
        self.fabric.lock().events.own(owned, &self.events);
    }

    fn check_port(&self, state: &FabricState, port: u8, op: &'static str) -> Result<()> {
        let count = state.devices[self.device].config.attributes.phys_port_cnt;
        if port == 0 || port > count {
            return Err(state.einval(self.device, op, format!("no port {port}")));
        }
        Ok(())
    }
}

impl Context<SimVerbsApi> for SimContext {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn query_device(&self) -> Result<DeviceAttributes> {
        let state = self.fabric.lock();
        state.alive(self.device, "ibv_query_device")?;
        Ok(state.devices[self.device].config.attributes.clone())
    }

    fn query_port(&self, port: u8) -> Result<PortAttributes> {
        let state = self.fabric.lock();
        state.alive(self.device, "ibv_query_port")?;
        self.check_port(&state, port, "ibv_query_port")?;
        let dev = &state.devices[self.device];
        Ok(PortAttributes {
            state: dev.config.port_state,
            max_mtu: dev.config.max_mtu,
            active_mtu: dev.config.active_mtu,
            lid: 0,
            gid_table_len: state::GID_TABLE_LEN,
            link_layer: hal_verbs::LinkLayer::Ethernet,
        })
    }

    fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let state = self.fabric.lock();
        state.alive(self.device, "ibv_query_gid")?;
        self.check_port(&state, port, "ibv_query_gid")?;
        Ok(state.devices[self.device].gids.clone())
    }

    fn alloc_pd(&self) -> Result<SimPd> {
        let id = {
            let mut state = self.fabric.lock();
            state.alive(self.device, "ibv_alloc_pd")?;
            let id = state.next_id();
            state.events.own(events::Owned::Pd(id), &self.events);
            id
        };
        Ok(SimPd::new(self.fabric.clone(), self.device, id))
    }

    fn create_cq(&self, depth: u32) -> Result<SimCq> {
        let cq = SimCq::create(&self.fabric, self.device, depth, None)?;
        self.own_cq(&cq);
        Ok(cq)
    }

    fn create_comp_channel(&self) -> Result<SimCompChannel> {
        SimCompChannel::create(&self.fabric, self.device)
    }

    fn create_cq_on_channel(
        &self,
        depth: u32,
        channel: &SimCompChannel,
        comp_vector: u32,
    ) -> Result<SimCq> {
        const OP: &str = "ibv_create_cq";
        {
            let state = self.fabric.lock();
            if channel.device() != self.device {
                return Err(state.einval(self.device, OP, "completion channel of another device"));
            }
            let vectors = state.devices[self.device]
                .config
                .attributes
                .num_comp_vectors;
            if comp_vector >= vectors {
                let reason = format!("completion vector {comp_vector} outside 0..{vectors}");
                return Err(state.einval(self.device, OP, reason));
            }
        }
        let cq = SimCq::create(
            &self.fabric,
            self.device,
            depth,
            Some(Arc::clone(&channel.shared)),
        )?;
        self.own_cq(&cq);
        Ok(cq)
    }

    fn async_fd(&self) -> std::os::fd::RawFd {
        self.events.fd()
    }

    fn next_async_event(&self) -> Result<Option<AsyncEvent>> {
        Ok(self.events.next())
    }
}

/// The IPv4 address a device of a node carries.
fn device_address(node_ip: Ipv4Addr, index: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(node_ip).wrapping_add(index as u32))
}

/// The RoCE GID table of a device with address `ip`, laid out as mlx5 lays
/// it out: the link-local IPv6 address (v1, v2), then the IPv4 one (v1, v2).
fn gid_table(guid: u64, ip: Ipv4Addr) -> Vec<GidEntry> {
    let mut link_local = [0u8; 16];
    link_local[0] = 0xfe;
    link_local[1] = 0x80;
    link_local[8..].copy_from_slice(&guid.to_be_bytes());
    let v4 = hal_verbs::Gid::from_ip(IpAddr::V4(ip));
    [
        (hal_verbs::Gid(link_local), hal_verbs::GidType::RoceV1),
        (hal_verbs::Gid(link_local), hal_verbs::GidType::RoceV2),
        (v4, hal_verbs::GidType::RoceV1),
        (v4, hal_verbs::GidType::RoceV2),
    ]
    .into_iter()
    .enumerate()
    .map(|(index, (gid, gid_type))| GidEntry {
        index: index as u32,
        gid,
        gid_type,
        netdev_ifindex: 2,
    })
    .collect()
}

#[cfg(test)]
mod tests;
