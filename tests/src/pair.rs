//! A two-node test pair over any verbs backend, in the shape of
//! quinn-proto's test pair: the conformance suite
//! ([`crate::conformance`]) is written once against [`Backend`] and run on
//! the simulator (host) and on rdma-core's SoftRoCE (`rxe0`, in the VM).
//!
//! A [`Pair`] is two [`Node`]s (each an opened device and a PD), one RC
//! queue pair on each, connected to each other the way real code connects
//! them (port attributes, the RoCE v2 GID, `ConnectionInfo`, RTR, RTS), and
//! one CQ per side. On the sim the two nodes are two nodes of one
//! `SimFabric`; on rxe they are two contexts of the one `rxe0` device.
//!
//! Progress: the sim runs queued work whenever a CQ is polled, rxe on its
//! own; so [`Pair::wait`] (poll until `n` completions or the backend's
//! deadline) and [`Pair::quiet`] (nothing more completes) drive both.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use hal_verbs::{
    AccessFlags, AddressFamily, Api, Completion, CompletionQueue, ConnectionInfo, Context,
    GidEntry, InitParams, MemoryRegion, PortAttributes, PostError, ProtectionDomain, QpCaps,
    QpState, QueuePair, RecvRequest, RtrParams, RtsParams, SendFlags, SendOp, SendRequest, Sge,
    WcStatus, select_roce_v2_gid,
};

/// Facts about a backend where devices legitimately differ, each with its
/// source; a scenario branches on these, never on the backend's name.
#[derive(Debug, Clone)]
pub struct Facts {
    /// An MR registered with a remote right has `rkey == lkey`. rxe:
    /// `rxe_mr_init` sets `rkey = lkey` (drivers/infiniband/sw/rxe/rxe_mr.c);
    /// mlx5: one mkey serves as both (`mlx5_ib_reg_user_mr`).
    pub rkey_equals_lkey: bool,
    /// An MR without remote rights has rkey 0. rxe: `rkey = (access &
    /// IB_ACCESS_REMOTE) ? lkey : 0` in `rxe_mr_init`; mlx5 hands out the
    /// mkey as rkey regardless (a remote access then fails on rights). The
    /// sim: its device's `local_only_rkey_is_zero`.
    pub local_only_rkey_is_zero: bool,
    /// Error completions carry opcode 0 (`IBV_WC_SEND`) and byte_len 0. rxe:
    /// `make_send_cqe` and the responder's `do_complete` fill opcode and
    /// byte_len only on success (the CQE is zeroed first). On mlx5 they are
    /// left unset (whatever the caller's array held): either way an engine
    /// must not read them, and this makes one that does fail.
    pub error_wc_opcode_and_len_zero: bool,
    /// Status of a request whose gather fails locally (an lkey of another
    /// PD, or none). rxe: LOC_QP_OP_ERR (`rxe_requester`: a failed
    /// `finish_packet` other than EFAULT; seen in the VM); mlx5: local
    /// protection error (syndrome 0x4), LOC_PROT_ERR. The sim: its
    /// device's `gather_fault_status`.
    pub gather_fault_status: WcStatus,
    /// Status of a READ whose response cannot be scattered (the local MR
    /// lacks LOCAL_WRITE, or the SG entry overruns it): LOC_PROT_ERR on
    /// rxe (`rxe_completer`'s failed copy; seen in the VM), mlx5 and the
    /// sim.
    pub scatter_fault_status: WcStatus,
    /// The requester's and the responder's statuses for a SEND longer than
    /// the receive it consumes. rxe: REM_OP_ERR and LOC_QP_OP_ERR (seen in
    /// the VM, kernel 6.1); mlx5: REM_INV_REQ_ERR (IBA's NAK-Invalid
    /// Request) and LOC_LEN_ERR. The sim: its device's
    /// `receive_too_small_status`.
    pub receive_too_small_status: (WcStatus, WcStatus),
    /// Send-queue slots of unsignaled requests are freed only when a later
    /// completion is polled (mlx5: libmlx5 frees WQEs as it polls CQEs);
    /// rxe frees them as its completer retires the WQEs, polled or not
    /// (see the VM run). The sim: its device's `slots_freed_when_polled`.
    pub unsignaled_slots_need_a_poll: bool,
    /// What a post refused for the QP's state (a send before RTS, a
    /// receive in RESET) says was posted: rxe's `ibv_post_send`/`recv`
    /// answer EINVAL with `bad_wr` outside the batch (seen in the VM), so
    /// `None` (`Posted::Unknown`); libmlx5 sets `bad_wr` to the first
    /// request: `Some(0)`. The sim: `None` where its device's
    /// `wrong_state_post_is_unknown`.
    pub wrong_state_post_accepted: Option<usize>,
    /// A destroyed QP's completions stay in its CQ (rxe), or are removed
    /// with it (mlx5: `mlx5_destroy_qp` cleans the CQ); the sim as its
    /// device's `destroy_qp_purges_cq` says.
    pub destroy_qp_keeps_completions: bool,
    /// The requester's and the responder's statuses for a SEND into a
    /// receive whose SG entry the responder cannot write (an lkey of
    /// another PD). Requester REM_OP_ERR everywhere; the responder's
    /// receive LOC_PROT_ERR on mlx5, LOC_QP_OP_ERR on rxe (its failed
    /// `copy_data` is -EINVAL, as for a bad gather; seen in the VM). The
    /// sim's receive: its device's `receive_fault_status`.
    pub bad_receive_status: (WcStatus, WcStatus),
    /// Longest a completion may take before the test fails.
    pub completion_timeout: Duration,
    /// How long "nothing more completes" is watched for.
    pub quiet_window: Duration,
}

/// A verbs backend the conformance suite runs on.
pub trait Backend {
    /// Its handle types.
    type A: Api;
    /// A short name for messages (`sim`, `sim:rxe-like`, `rxe`).
    fn name(&self) -> String;
    /// What it does where devices differ.
    fn facts(&self) -> Facts;
    /// Two fresh nodes that can reach each other.
    fn nodes(&self) -> (Node<Self::A>, Node<Self::A>);
    /// Two sides for connection management (rdma_cm): a provider each and
    /// the address the other reaches it at; `None` where the backend has
    /// no connection manager (the reason printed).
    fn cm_sides(&self) -> Option<CmSides<Self::A>>;
    /// How its transport timers behave ([`TimingFacts`]).
    fn timing(&self) -> TimingFacts;
    /// From now on, time passes for `node`'s device only through
    /// [`Backend::advance`]: the sim's clock goes Manual. Real time cannot
    /// be held, so on real devices (the default) this does nothing.
    fn hold_time(&self, node: &Node<Self::A>) {
        let _ = node;
    }
    /// Lets `d` of time pass for `node`'s device: the sim advances its
    /// virtual clock (every timer due on the way fires, exactly); a real
    /// device (the default) sleeps in real time.
    fn advance(&self, node: &Node<Self::A>, d: Duration) {
        let _ = node;
        std::thread::sleep(d);
    }
}

/// How a backend's transport timers (ACK timeout and `retry_cnt`, RNR
/// timer and `rnr_retry`) behave, for the timing scenarios
/// ([`crate::conformance`]'s `timing`), each with its source.
#[derive(Debug, Clone)]
pub struct TimingFacts {
    /// Time is real (it passes while the test runs, and [`Backend::advance`]
    /// sleeps); false on the sim, whose clock is virtual.
    pub real_time: bool,
    /// The ACK timeout code and `retry_cnt` of RTS are honoured: a request
    /// to a dead peer fails with `RETRY_EXC_ERR` after `retry_cnt + 1`
    /// timeouts (rxe: `qp->qp_timeout_jiffies`, set from the code in
    /// `rxe_qp_from_attr`, drivers/infiniband/sw/rxe/rxe_qp.c, arms
    /// `retrans_timer`; `rxe_completer`'s `COMPST_ERROR_RETRY` counts
    /// `comp.retry_cnt` down, rxe_comp.c).
    pub honours_ack_timeout: bool,
    /// The responder's `min_rnr_timer` (RTR) sets the requester's wait per
    /// RNR NAK and `rnr_retry` (RTS) counts them (rxe: `rnrnak_jiffies`
    /// of the NAK's syndrome, `COMPST_RNR_RETRY` in rxe_comp.c).
    pub honours_rnr_timer: bool,
    /// The requester's retransmit (ACK) timer keeps running while a request
    /// waits out an RNR timer: an ACK timeout shorter than the RNR timer
    /// spends `retry_cnt` and ends in `RETRY_EXC_ERR` even with `rnr_retry`
    /// 7 (rxe: `retrans_timer` is not stopped by an RNR NAK, and
    /// `COMPST_ERROR_RETRY` in rxe_comp.c counts its expiries; seen in the
    /// VM). Off, an RNR NAK stops the ACK timer (IBA, ConnectX). Sim: its
    /// device's `retransmit_timer_runs_during_rnr_wait`.
    pub retransmit_timer_runs_during_rnr_wait: bool,
    /// The timers' tick: a timer period is rounded down to it, and is at
    /// least one tick (rxe: jiffies; `nsecs_to_jiffies` truncates, and
    /// both timers are at least 1 jiffy; the VM's kernel has HZ=250).
    /// Zero on the sim: exact.
    pub tick: Duration,
    /// How much earlier than its nominal period (after the rounding to
    /// `tick`) one timer period may end: a timer armed mid-tick fires at
    /// the next tick boundary, so up to one tick early on rxe. Zero on
    /// the sim.
    pub early_per_period: Duration,
    /// How long after its nominal deadline an expiry may still be in
    /// coming (scheduling, the VM's emulation). Zero on the sim.
    pub late: Duration,
}

impl TimingFacts {
    /// The exact timers of the sim's virtual clock.
    pub fn exact() -> Self {
        Self {
            real_time: false,
            honours_ack_timeout: true,
            honours_rnr_timer: true,
            retransmit_timer_runs_during_rnr_wait: false,
            tick: Duration::ZERO,
            early_per_period: Duration::ZERO,
            late: Duration::ZERO,
        }
    }

    /// One timer period of nominal length `nominal`, as the backend runs
    /// it: rounded down to whole ticks, at least one.
    pub fn period(&self, nominal: Duration) -> Duration {
        if self.tick.is_zero() {
            return nominal;
        }
        let ticks = (nominal.as_nanos() / self.tick.as_nanos()).max(1);
        self.tick * u32::try_from(ticks).expect("ticks")
    }
}

/// A server side and a client side.
pub type CmSides<A> = (CmSide<A>, CmSide<A>);

/// One side of a connection-managed pair.
#[derive(Debug)]
pub struct CmSide<A: Api> {
    /// Opens devices.
    pub provider: A::Provider,
    /// Its connection manager.
    pub cm: A::ConnectionManager,
    /// The address its device carries.
    pub ip: std::net::IpAddr,
}

/// One side: an opened device and a protection domain.
#[derive(Debug)]
pub struct Node<A: Api> {
    /// The opened device.
    pub ctx: A::Context,
    /// Its PD, in which the pair's QP is created.
    pub pd: A::ProtectionDomain,
}

impl<A: Api> Node<A> {
    /// Opens a node on `ctx` with a fresh PD.
    pub fn new(ctx: A::Context) -> Self {
        let pd = ctx.alloc_pd().expect("ibv_alloc_pd");
        Self { ctx, pd }
    }

    /// `len` bytes of page-aligned host memory holding
    /// `pattern(len, seed)`, registered in this node's PD with `access`.
    pub fn buf(&self, len: usize, seed: u8, access: AccessFlags) -> Buf<A> {
        Buf::new(&self.pd, len, seed, access)
    }

    /// Another PD on this node's device.
    pub fn other_pd(&self) -> A::ProtectionDomain {
        self.ctx.alloc_pd().expect("ibv_alloc_pd")
    }

    /// Like [`Node::buf`], `mem_len` bytes of which only `reg_len` from
    /// `reg_offset` are registered: a stray access outside the MR lands in
    /// memory the test can check.
    pub fn buf_part(
        &self,
        mem_len: usize,
        reg_offset: usize,
        reg_len: usize,
        seed: u8,
        access: AccessFlags,
    ) -> Buf<A> {
        Buf::part(&self.pd, mem_len, reg_offset, reg_len, seed, access)
    }

    /// What this side tells its peer about `qp`, and its GID index.
    pub fn info(&self, qp: &A::QueuePair, psn: u32) -> (ConnectionInfo, u8) {
        local_info::<A>(&self.ctx, qp, psn)
    }
}

/// What a side with device `ctx` tells its peer about `qp` (port 1, its
/// RoCE v2 GID: IPv4 first, then IPv6), and the GID's index.
pub fn local_info<A: Api>(ctx: &A::Context, qp: &A::QueuePair, psn: u32) -> (ConnectionInfo, u8) {
    let port = ctx.query_port(1).expect("ibv_query_port");
    let table = ctx.gid_table(1).expect("GID table of port 1");
    let gid = select_roce_v2_gid(&table, AddressFamily::V4)
        .or_else(|| select_roce_v2_gid(&table, AddressFamily::V6))
        .unwrap_or_else(|| panic!("no RoCE v2 GID on port 1: {table:?}"));
    port_info(&port, gid, qp.qp_num(), psn)
}

/// The `ConnectionInfo` of QP `qp_num` on `port` sending from `gid`, and
/// the GID's index.
pub fn port_info(
    port: &PortAttributes,
    gid: &GidEntry,
    qp_num: u32,
    psn: u32,
) -> (ConnectionInfo, u8) {
    let info = ConnectionInfo {
        qp_num,
        psn,
        gid: gid.gid,
        lid: port.lid,
        mtu: port.active_mtu,
    };
    (info, u8::try_from(gid.index).expect("GID index"))
}

/// Page-aligned host memory. Read and written by the CPU only while no
/// work request on it is in flight.
#[derive(Debug)]
pub struct HostMem {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain owned memory, handed between threads only while no work
// request on it is in flight.
unsafe impl Send for HostMem {}
// SAFETY: as for Send.
unsafe impl Sync for HostMem {}

impl HostMem {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1), 4096).unwrap()
    }

    /// `len` bytes holding `pattern(len, seed)`.
    pub fn new(len: usize, seed: u8) -> Self {
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(Self::layout(len)) };
        let ptr = NonNull::new(ptr).expect("allocation failed");
        let mem = Self { ptr, len };
        mem.write(0, &crate::pattern(len, seed));
        mem
    }

    /// Its address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true for a buffer of at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A copy of its bytes.
    pub fn read(&self) -> Vec<u8> {
        fence(Ordering::Acquire);
        // SAFETY: `len` initialised bytes we own; the tests read only after
        // polling the completions of what wrote them.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }.to_vec()
    }

    /// Overwrites bytes from `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        // SAFETY: in bounds (checked above); no RDMA on them is in flight.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
        fence(Ordering::Release);
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
    }
}

/// Host memory and its registration; the MR is dropped (deregistered)
/// before the memory is freed (field order).
#[derive(Debug)]
pub struct Buf<A: Api> {
    /// The registration.
    pub mr: A::MemoryRegion,
    /// The memory.
    pub mem: HostMem,
}

impl<A: Api> Buf<A> {
    /// Registers fresh memory holding `pattern(len, seed)`.
    pub fn new(pd: &A::ProtectionDomain, len: usize, seed: u8, access: AccessFlags) -> Self {
        Self::part(pd, len, 0, len, seed, access)
    }

    /// `mem_len` bytes, `reg_len` of them from `reg_offset` registered.
    pub fn part(
        pd: &A::ProtectionDomain,
        mem_len: usize,
        reg_offset: usize,
        reg_len: usize,
        seed: u8,
        access: AccessFlags,
    ) -> Self {
        assert!(reg_offset + reg_len <= mem_len);
        let mem = HostMem::new(mem_len, seed);
        // SAFETY: the range lies in the memory, which lives in `self` beside
        // the MR, is dropped after it (field order), and never moves (a
        // heap allocation).
        let mr = unsafe { pd.register(mem.addr() + reg_offset as u64, reg_len, access) }
            .unwrap_or_else(|e| panic!("ibv_reg_mr of {reg_len} bytes: {e}"));
        Self { mr, mem }
    }

    /// The address `offset` bytes into the MR.
    pub fn addr(&self, offset: usize) -> u64 {
        self.mr.addr() + offset as u64
    }

    /// An SG entry of `len` bytes at `offset` into the MR.
    pub fn sge(&self, offset: usize, len: usize) -> Sge {
        Sge {
            addr: self.addr(offset),
            length: u32::try_from(len).unwrap(),
            lkey: self.mr.lkey(),
        }
    }

    /// A WRITE to this buffer at `offset`.
    pub fn write_op(&self, offset: usize) -> SendOp {
        SendOp::Write {
            remote_addr: self.addr(offset),
            rkey: self.mr.rkey(),
        }
    }

    /// A READ from this buffer at `offset`.
    pub fn read_op(&self, offset: usize) -> SendOp {
        SendOp::Read {
            remote_addr: self.addr(offset),
            rkey: self.mr.rkey(),
        }
    }

    /// The bytes of the whole memory now (the MR's start at the offset it
    /// was registered at).
    pub fn bytes(&self) -> Vec<u8> {
        self.mem.read()
    }
}

/// A send request.
pub fn req(wr_id: u64, op: SendOp, sges: &[Sge], flags: SendFlags) -> SendRequest {
    SendRequest {
        wr_id,
        op,
        sg_list: sges.iter().copied().collect(),
        flags,
    }
}

/// A receive request.
pub fn recv(wr_id: u64, sges: &[Sge]) -> RecvRequest {
    RecvRequest {
        wr_id,
        sg_list: sges.iter().copied().collect(),
    }
}

/// How the pair's queue pairs are set up.
#[derive(Debug, Clone, Copy, Default)]
pub struct PairConfig {
    /// Queue sizes of both QPs.
    pub caps: QpCaps,
    /// RTS parameters of both (their `sq_psn` is set by the pair).
    pub rts: RtsParams,
    /// What node b's QP lets its peer do (INIT's access flags); `None`:
    /// `InitParams::default()`'s remote READ and WRITE.
    pub b_access: Option<AccessFlags>,
}

/// Two nodes, one RC QP each, connected; one CQ per side (send and recv).
/// Fields drop in order: QPs, CQs, then nodes.
#[derive(Debug)]
pub struct Pair<A: Api> {
    /// Node a's QP.
    pub qa: A::QueuePair,
    /// Node b's QP.
    pub qb: A::QueuePair,
    /// Node a's CQ.
    pub cqa: A::CompletionQueue,
    /// Node b's CQ.
    pub cqb: A::CompletionQueue,
    /// The requester side.
    pub a: Node<A>,
    /// The responder side.
    pub b: Node<A>,
    /// Deadlines and facts of the backend.
    pub facts: Facts,
    /// The backend's name, for messages.
    pub name: String,
}

/// Connects `qa` (on `a`) and `qb` (on `b`) through INIT, RTR and RTS.
pub fn connect<A: Api>(
    a: &Node<A>,
    qa: &A::QueuePair,
    b: &Node<A>,
    qb: &A::QueuePair,
    rts: RtsParams,
) {
    connect_with(a, qa, b, qb, rts, InitParams::default());
}

/// [`connect`], with `init_b` for `qb`'s INIT.
pub fn connect_with<A: Api>(
    a: &Node<A>,
    qa: &A::QueuePair,
    b: &Node<A>,
    qb: &A::QueuePair,
    rts: RtsParams,
    init_b: InitParams,
) {
    let (psn_a, psn_b) = (0x1234, 0xab_cdef);
    let (info_a, sgid_a) = a.info(qa, psn_a);
    let (info_b, sgid_b) = b.info(qb, psn_b);
    for (qp, sgid, own, remote, init) in [
        (qa, sgid_a, info_a, info_b, InitParams::default()),
        (qb, sgid_b, info_b, info_a, init_b),
    ] {
        assert_eq!(qp.state().unwrap(), QpState::Reset);
        qp.to_init(&init).expect("INIT");
        qp.to_rtr(&RtrParams::new(remote, sgid, own.mtu))
            .expect("RTR");
        qp.to_rts(&RtsParams {
            sq_psn: own.psn,
            ..rts
        })
        .expect("RTS");
        assert_eq!(qp.state().unwrap(), QpState::ReadyToSend);
    }
}

impl<A: Api> Pair<A> {
    /// A pair with default queue sizes and RTS parameters.
    pub fn new<B: Backend<A = A>>(backend: &B) -> Self {
        Self::with(backend, PairConfig::default())
    }

    /// A pair set up as `config` says.
    pub fn with<B: Backend<A = A>>(backend: &B, config: PairConfig) -> Self {
        crate::init_tracing();
        let (a, b) = backend.nodes();
        let cqa = a.ctx.create_cq(256).expect("CQ a");
        let cqb = b.ctx.create_cq(256).expect("CQ b");
        let qa = a.pd.create_qp(&config.caps, &cqa, &cqa).expect("QP a");
        let qb = b.pd.create_qp(&config.caps, &cqb, &cqb).expect("QP b");
        let init_b = InitParams {
            access: config.b_access.unwrap_or(InitParams::default().access),
            ..InitParams::default()
        };
        connect_with(&a, &qa, &b, &qb, config.rts, init_b);
        Self {
            qa,
            qb,
            cqa,
            cqb,
            a,
            b,
            facts: backend.facts(),
            name: backend.name(),
        }
    }

    /// Posts sends on `qp`, returning the post's outcome.
    pub fn try_post(qp: &A::QueuePair, requests: &[SendRequest]) -> Result<(), PostError> {
        // SAFETY: every scenario keeps its buffers registered and alive
        // until it has polled what it posted (or the pair is dropped first:
        // the QPs are the pair's first fields).
        unsafe { qp.post_send(requests) }
    }

    /// Posts sends on `qp`; panics when the post fails.
    pub fn post(qp: &A::QueuePair, requests: &[SendRequest]) {
        Self::try_post(qp, requests).unwrap_or_else(|e| panic!("post_send: {e}"));
    }

    /// Posts receives on `qp`; panics when the post fails.
    pub fn post_recv(qp: &A::QueuePair, requests: &[RecvRequest]) {
        // SAFETY: as for `try_post`.
        unsafe { qp.post_recv(requests) }.unwrap_or_else(|e| panic!("post_recv: {e}"));
    }

    /// Polls `cq` until `n` completions came; fails after the backend's
    /// completion timeout.
    pub fn wait(&self, cq: &A::CompletionQueue, n: usize) -> Vec<Completion> {
        wait::<A>(cq, n, self.facts.completion_timeout)
    }

    /// Asserts that nothing (more) completes on `cq` within the backend's
    /// quiet window.
    pub fn quiet(&self, cq: &A::CompletionQueue, what: &str) {
        quiet::<A>(cq, self.facts.quiet_window, what);
    }

    /// `wait` for exactly `n`, then `quiet`.
    pub fn expect(&self, cq: &A::CompletionQueue, n: usize, what: &str) -> Vec<Completion> {
        let got = self.wait(cq, n);
        self.quiet(cq, what);
        got
    }
}

/// Polls `cq` until `n` completions came; fails after `timeout`.
pub fn wait<A: Api>(cq: &A::CompletionQueue, n: usize, timeout: Duration) -> Vec<Completion> {
    let start = Instant::now();
    let mut got = Vec::new();
    let mut slots = [Completion::default(); 16];
    while got.len() < n {
        let k = cq
            .poll(&mut slots[..(n - got.len()).min(16)])
            .expect("poll");
        got.extend_from_slice(&slots[..k]);
        if k == 0 {
            assert!(
                start.elapsed() < timeout,
                "waited {timeout:?} for {n} completions, got {got:?}"
            );
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    got
}

/// Asserts that nothing completes on `cq` within `window`.
pub fn quiet<A: Api>(cq: &A::CompletionQueue, window: Duration, what: &str) {
    let end = Instant::now() + window;
    let mut slots = [Completion::default(); 4];
    loop {
        let k = cq.poll(&mut slots).expect("poll");
        assert_eq!(k, 0, "{what}: unexpected completions {:?}", &slots[..k]);
        if Instant::now() >= end {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `(wr_id, status)` of each completion.
pub fn ids_and_status(wcs: &[Completion]) -> Vec<(u64, hal_verbs::WcStatus)> {
    wcs.iter().map(|wc| (wc.wr_id, wc.status)).collect()
}

/// The simulator as a backend: every pair is two nodes of a fresh fabric,
/// each with one device configured as `device`.
#[derive(Debug, Clone, Default)]
pub struct SimBackend {
    /// The device both nodes get. Hook for device profiles: run the suite
    /// once per profile by building the backend from each profile's config.
    pub device: gdr_sim::DeviceConfig,
    /// A label of the profile, for messages.
    pub profile: &'static str,
}

impl SimBackend {
    /// A backend whose nodes have `device` (named `profile` in messages).
    pub fn new(profile: &'static str, device: gdr_sim::DeviceConfig) -> Self {
        Self { device, profile }
    }
}

impl Backend for SimBackend {
    type A = gdr_sim::SimVerbsApi;

    fn name(&self) -> String {
        format!("sim:{}", self.profile)
    }

    /// Where devices differ, from the device's `DeviceConfig` field that
    /// makes the sim behave so (its docs cite the source).
    fn facts(&self) -> Facts {
        let d = &self.device;
        Facts {
            rkey_equals_lkey: true,
            local_only_rkey_is_zero: d.local_only_rkey_is_zero,
            error_wc_opcode_and_len_zero: true,
            gather_fault_status: d.gather_fault_status,
            scatter_fault_status: WcStatus::LOC_PROT_ERR,
            receive_too_small_status: d.receive_too_small_status,
            unsignaled_slots_need_a_poll: d.slots_freed_when_polled,
            wrong_state_post_accepted: if d.wrong_state_post_is_unknown {
                None
            } else {
                Some(0)
            },
            destroy_qp_keeps_completions: !d.destroy_qp_purges_cq,
            // The requester is told REM_OP_ERR on every device.
            bad_receive_status: (WcStatus::REM_OP_ERR, d.receive_fault_status),
            completion_timeout: Duration::from_secs(2),
            quiet_window: Duration::from_millis(5),
        }
    }

    fn timing(&self) -> TimingFacts {
        TimingFacts {
            retransmit_timer_runs_during_rnr_wait: self
                .device
                .retransmit_timer_runs_during_rnr_wait,
            ..TimingFacts::exact()
        }
    }

    fn hold_time(&self, node: &Node<Self::A>) {
        node.ctx.clock().set_mode(gdr_sim::ClockMode::Manual);
    }

    fn advance(&self, node: &Node<Self::A>, d: Duration) {
        node.ctx.clock().advance(d);
    }

    fn nodes(&self) -> (Node<Self::A>, Node<Self::A>) {
        use hal_verbs::Provider as _;
        let fabric = gdr_sim::SimFabric::new();
        let node = |name: &str| {
            let verbs = crate::sim::add_node(&fabric, name, self.device.clone());
            Node::new(verbs.open("sim0").expect("open sim0"))
        };
        (node("a"), node("b"))
    }

    fn cm_sides(&self) -> Option<CmSides<Self::A>> {
        use hal_verbs::Provider as _;
        let fabric = gdr_sim::SimFabric::new();
        let side = |name: &str| {
            let provider = crate::sim::add_node(&fabric, name, self.device.clone());
            let cm = provider.connection_manager().expect("the sim's CM");
            let ip = std::net::IpAddr::V4(provider.device_ipv4("sim0").expect("sim0's address"));
            CmSide { provider, cm, ip }
        };
        Some((side("server"), side("client")))
    }
}

/// The simulator through the erased verbs backend
/// (`hal_verbs::dynamic::DynApi`): what the suite checks of [`SimBackend`]
/// must hold unchanged when every handle is a trait object, as it is under
/// gdr-core's engine. The fabric of the latest `nodes` is kept for its
/// clock (the erased context has none to reach).
#[derive(Debug)]
pub struct DynSimBackend {
    sim: SimBackend,
    fabric: std::sync::Mutex<Option<gdr_sim::SimFabric>>,
}

impl DynSimBackend {
    /// The sim with `device`, erased.
    pub fn new(profile: &'static str, device: gdr_sim::DeviceConfig) -> Self {
        Self {
            sim: SimBackend::new(profile, device),
            fabric: std::sync::Mutex::new(None),
        }
    }

    fn clock(&self) -> gdr_sim::SimClock {
        self.fabric
            .lock()
            .unwrap()
            .as_ref()
            .expect("nodes first")
            .clock()
    }
}

impl Backend for DynSimBackend {
    type A = hal_verbs::dynamic::DynApi;

    fn name(&self) -> String {
        format!("dyn {}", self.sim.name())
    }

    fn facts(&self) -> Facts {
        self.sim.facts()
    }

    fn timing(&self) -> TimingFacts {
        self.sim.timing()
    }

    fn hold_time(&self, _node: &Node<Self::A>) {
        self.clock().set_mode(gdr_sim::ClockMode::Manual);
    }

    fn advance(&self, _node: &Node<Self::A>, d: Duration) {
        self.clock().advance(d);
    }

    fn nodes(&self) -> (Node<Self::A>, Node<Self::A>) {
        use hal_verbs::Provider as _;
        let fabric = gdr_sim::SimFabric::new();
        *self.fabric.lock().unwrap() = Some(fabric.clone());
        let node = |name: &str| {
            let verbs = crate::sim::add_node(&fabric, name, self.sim.device.clone());
            let provider = hal_verbs::dynamic::DynProvider::new::<gdr_sim::SimVerbsApi>(verbs);
            Node::new(provider.open("sim0").expect("open sim0"))
        };
        (node("a"), node("b"))
    }

    fn cm_sides(&self) -> Option<CmSides<Self::A>> {
        use hal_verbs::Provider as _;
        let fabric = gdr_sim::SimFabric::new();
        *self.fabric.lock().unwrap() = Some(fabric.clone());
        let side = |name: &str| {
            let verbs = crate::sim::add_node(&fabric, name, self.sim.device.clone());
            let ip = std::net::IpAddr::V4(verbs.device_ipv4("sim0").expect("sim0's address"));
            let provider = hal_verbs::dynamic::DynProvider::new::<gdr_sim::SimVerbsApi>(verbs);
            let cm = provider.connection_manager().expect("the sim's CM");
            CmSide { provider, cm, ip }
        };
        Some((side("server"), side("client")))
    }
}

/// rdma-core on SoftRoCE's `rxe0` as a backend: both nodes are contexts of
/// the one device (two QPs of one device connected to each other stand in
/// for two peers).
#[derive(Debug)]
pub struct RxeBackend {
    provider: hal_verbs::rdma::RdmaProvider,
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl RxeBackend {
    /// The backend, or `None` after printing why `test` skips (a failure
    /// under `GDR_EXPECT_RXE=1`). Holds the binary's serialising lock.
    pub fn open(test: &str) -> Option<Self> {
        let serial = crate::rxe::serial();
        let (provider, _ctx) = crate::rxe::open_rxe(test)?;
        Some(Self {
            provider,
            _serial: serial,
        })
    }

    /// What [`Backend::facts`] says for rxe, without opening it (the
    /// sim's rxe-like profile is checked against it on the host).
    pub fn rxe_facts() -> Facts {
        Facts {
            rkey_equals_lkey: true,
            local_only_rkey_is_zero: true,
            error_wc_opcode_and_len_zero: true,
            gather_fault_status: WcStatus::LOC_QP_OP_ERR,
            scatter_fault_status: WcStatus::LOC_PROT_ERR,
            receive_too_small_status: (WcStatus::REM_OP_ERR, WcStatus::LOC_QP_OP_ERR),
            unsignaled_slots_need_a_poll: false,
            wrong_state_post_accepted: None,
            destroy_qp_keeps_completions: true,
            bad_receive_status: (WcStatus::REM_OP_ERR, WcStatus::LOC_QP_OP_ERR),
            // Software emulation (TCG) is slow.
            completion_timeout: Duration::from_secs(20),
            quiet_window: Duration::from_millis(300),
        }
    }

    /// Measured in the VM (Debian kernel, HZ=250: a jiffy is 4 ms) by
    /// `rxe_timing_measured` (tests/rxe_conformance.rs), post to completion,
    /// three runs each: WRITE to a destroyed QP, ACK code 12 (16.8 ms,
    /// 4 jiffies) `retry_cnt` 0: 16.6, 16.9, 54.9 ms; `retry_cnt` 2
    /// (nominal 50.3 ms): 56.8, 60.4, 64.3 ms; code 14 `retry_cnt` 1
    /// (nominal 134.2 ms, 128 in jiffies): 129.9, 133.9, 134.2 ms; code 10
    /// `retry_cnt` 1 (nominal 8.4 ms): 16.7 to 22.8 ms. SEND without a
    /// receive, RNR code 22 (20.48 ms, 5 jiffies) `rnr_retry` 2 (nominal
    /// 40.96 ms): 54.7, 54.8, 55.8 ms; code 1 (10 µs, raised to one jiffy)
    /// `rnr_retry` 2: 15.2, 16.7, 203 ms. So: never earlier than the
    /// jiffy-rounded nominal less a jiffy a period, usually one or two
    /// jiffies a period later (the timer fires, then the completer and the
    /// requester tasks run), and a run may be descheduled for ~200 ms.
    ///
    /// An ACK timeout shorter than the RNR timer expires in every RNR wait
    /// and spends `retry_cnt`
    /// ([`TimingFacts::retransmit_timer_runs_during_rnr_wait`]): with ACK
    /// code 12, RNR code 22, `retry_cnt` 2 and `rnr_retry` 7 the SEND
    /// failed with `RETRY_EXC_ERR` after 68.5 and 70.1 ms (nominal 2 × 20 + 16 =
    /// 56 ms in jiffies), in `rnr_wait_longer_than_the_ack_timeout`.
    ///
    /// What [`Backend::timing`] says for rxe, without opening it (the sim's
    /// rxe-like profile is checked against it on the host).
    pub fn rxe_timing() -> TimingFacts {
        TimingFacts {
            real_time: true,
            honours_ack_timeout: true,
            honours_rnr_timer: true,
            retransmit_timer_runs_during_rnr_wait: true,
            tick: Duration::from_millis(4),
            early_per_period: Duration::from_millis(4),
            late: Duration::from_millis(400),
        }
    }
}

impl Backend for RxeBackend {
    type A = hal_verbs::rdma::RdmaApi;

    fn name(&self) -> String {
        "rxe".to_owned()
    }

    fn facts(&self) -> Facts {
        Self::rxe_facts()
    }

    fn timing(&self) -> TimingFacts {
        Self::rxe_timing()
    }

    fn nodes(&self) -> (Node<Self::A>, Node<Self::A>) {
        use hal_verbs::Provider as _;
        let name = crate::rxe::device_name();
        let open = || Node::new(self.provider.open(&name).expect("open rxe"));
        (open(), open())
    }

    /// Both sides on rxe0's one address (rdma_cm cannot use 127.0.0.1
    /// there), each with a provider of its own.
    fn cm_sides(&self) -> Option<CmSides<Self::A>> {
        use hal_verbs::Provider as _;
        let side = || -> Option<CmSide<Self::A>> {
            let provider = hal_verbs::rdma::RdmaProvider::load().expect("libibverbs");
            let cm = match provider.connection_manager() {
                Ok(cm) => cm,
                Err(e) => {
                    assert!(!crate::rxe::expect_rxe(), "GDR_EXPECT_RXE=1 but {e}");
                    crate::skip("rdma_cm scenario", &e.to_string());
                    return None;
                }
            };
            let ip = crate::rxe::expected_ip();
            Some(CmSide { provider, cm, ip })
        };
        Some((side()?, side()?))
    }
}
