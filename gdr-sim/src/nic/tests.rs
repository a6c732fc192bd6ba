//! Unit tests of what the integration tests cannot reach: device memory
//! through peermem, CQ overrun, objects dropped under outstanding work.

use std::sync::Arc;

use hal_verbs::{
    AccessFlags, AddressFamily, Completion, CompletionQueue, ConnectionInfo, Context, InitParams,
    MemoryRegion, ProtectionDomain, Provider, QpCaps, QueuePair, RtrParams, RtsParams, SendFlags,
    SendOp, SendRequest, Sge, VerbsError, WcStatus, select_roce_v2_gid,
};

use super::*;
use crate::memory::{self, Backing};

struct End {
    ctx: SimContext,
    pd: SimPd,
    cq: SimCq,
    qp: SimQp,
}

fn end(fabric: &SimFabric, name: &str, cq_depth: u32) -> End {
    let ctx = fabric
        .add_node(name, NodeConfig::default())
        .open("sim0")
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(cq_depth).unwrap();
    let qp = pd.create_qp(&QpCaps::default(), &cq, &cq).unwrap();
    End { ctx, pd, cq, qp }
}

fn connect(a: &End, b: &End) {
    let info = |e: &End| {
        let table = e.ctx.gid_table(1).unwrap();
        let gid = select_roce_v2_gid(&table, AddressFamily::V4).unwrap();
        let mtu = e.ctx.query_port(1).unwrap().active_mtu;
        let info = ConnectionInfo {
            qp_num: e.qp.qp_num(),
            psn: 0,
            gid: gid.gid,
            lid: 0,
            mtu,
        };
        (info, gid.index as u8)
    };
    let ((ia, sa), (ib, sb)) = (info(a), info(b));
    for (e, remote, sgid) in [(a, ib, sa), (b, ia, sb)] {
        e.qp.to_init(&InitParams::default()).unwrap();
        e.qp.to_rtr(&RtrParams::new(remote, sgid, remote.mtu))
            .unwrap();
        e.qp.to_rts(&RtsParams::default()).unwrap();
    }
}

fn write(wr_id: u64, src: Sge, remote_addr: u64, rkey: u32) -> SendRequest {
    SendRequest {
        wr_id,
        op: SendOp::Write { remote_addr, rkey },
        sg_list: [src].into_iter().collect(),
        flags: SendFlags::SIGNALED,
    }
}

fn poll_one(cq: &SimCq) -> Completion {
    let mut slot = [Completion::default()];
    assert_eq!(cq.poll(&mut slot).unwrap(), 1);
    slot[0]
}

/// Host addresses the CPU cannot read (a reservation with `PROT_NONE`, as
/// a real GPU driver makes for its device memory) are refused
/// with EFAULT, as the kernel refuses them, never taken for host memory;
/// readable memory next to them registers.
#[test]
fn unreadable_host_ranges_are_refused_not_dereferenced() {
    let fabric = SimFabric::new();
    let a = end(&fabric, "a", 16);
    // SAFETY: sysconf reads a constant of the process.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    // SAFETY: a fresh private anonymous mapping of three pages, unmapped
    // below; nothing else uses it.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            3 * page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    let base = base as u64;
    // The middle page as a GPU driver reserves device memory.
    // SAFETY: the page lies in the mapping made above.
    let rc = unsafe { libc::mprotect((base + page as u64) as *mut _, page, libc::PROT_NONE) };
    assert_eq!(rc, 0);
    let efault = VerbsError::from_errno("ibv_reg_mr", "sim0", libc::EFAULT);
    // SAFETY: the ranges stay mapped (or reserved) past each registration.
    let err = unsafe {
        a.pd.register(base + page as u64, page, AccessFlags::transfer())
    }
    .unwrap_err();
    assert_eq!(err, efault, "a PROT_NONE page");
    // SAFETY: as above.
    let err = unsafe { a.pd.register(base, 3 * page, AccessFlags::transfer()) }.unwrap_err();
    assert_eq!(err, efault, "a range across one");
    // SAFETY: as above.
    let mr = unsafe {
        a.pd.register(base + 2 * page as u64, page, AccessFlags::transfer())
    };
    assert!(mr.is_ok(), "the readable page after it");
    drop(mr);
    // The fallback where process_vm_readv is not allowed says the same.
    let p = page as u64;
    assert!(super::mr::readable_in_proc_maps(base, base + p));
    assert!(!super::mr::readable_in_proc_maps(base + p, base + 2 * p));
    assert!(!super::mr::readable_in_proc_maps(base, base + 3 * p));
    assert!(super::mr::readable_in_proc_maps(base + 2 * p, base + 3 * p));
    // SAFETY: the mapping made above, no longer registered. (A hole is
    // not probed after: another test's thread may map there meanwhile.)
    unsafe { libc::munmap(base as *mut _, 3 * page) };
}

#[test]
fn device_memory_registers_only_with_peermem() {
    let fabric = SimFabric::new();
    let (a, b) = (end(&fabric, "a", 16), end(&fabric, "b", 16));
    connect(&a, &b);
    let backing = Arc::new(Backing::new(8192).unwrap());
    let gpu = memory::GpuAllocator::new(0, false);
    let with = memory::map(&gpu, 8192, 1, true, false, Arc::clone(&backing));
    let without = memory::map(&gpu, 8192, 1, false, false, Arc::clone(&backing));

    // SAFETY: the device range stays mapped past the registration.
    let err = unsafe { b.pd.register(without.base, 4096, AccessFlags::transfer()) }.unwrap_err();
    assert_eq!(
        err,
        VerbsError::from_errno("ibv_reg_mr", "sim0", libc::EFAULT)
    );
    // SAFETY: as above.
    let err = unsafe {
        b.pd.register(with.base + 4096, 8192, AccessFlags::transfer())
    };
    assert!(err.is_err(), "past the allocation");

    // SAFETY: as above.
    let mr = unsafe { b.pd.register(with.base, 8192, AccessFlags::transfer()) }.unwrap();
    assert_eq!(mr.addr(), with.base);
    let mut src: Vec<u8> = (0..100u8).collect();
    // SAFETY: `src` outlives its registration.
    let smr = unsafe {
        a.pd.register(src.as_mut_ptr() as u64, 100, AccessFlags::transfer())
    }
    .unwrap();
    let sge = Sge {
        addr: smr.addr(),
        length: 100,
        lkey: smr.lkey(),
    };
    // SAFETY: both MRs live until the completion is polled.
    unsafe {
        a.qp.post_send(&[write(1, sge, with.base + 5000, mr.rkey())])
    }
    .unwrap();
    assert!(poll_one(&a.cq).status.is_success());
    // SAFETY: the backing is 8192 bytes; the NIC is done with it.
    let landed = unsafe { std::slice::from_raw_parts(backing.as_ptr().add(5000), 100) };
    assert_eq!(landed, &src[..]);
    drop((mr, smr));
    memory::unmap(with.base, "test");
    memory::unmap(without.base, "test");
}

#[test]
fn cq_overrun_is_reported() {
    let fabric = SimFabric::new();
    let (a, b) = (end(&fabric, "a", 2), end(&fabric, "b", 2));
    connect(&a, &b);
    let mut data = vec![0u8; 64];
    // SAFETY: `data` outlives the registration.
    let mr = unsafe {
        a.pd.register(data.as_mut_ptr() as u64, 64, AccessFlags::transfer())
    }
    .unwrap();
    let mut remote = vec![0u8; 64];
    // SAFETY: `remote` outlives the registration.
    let dst = unsafe {
        b.pd.register(remote.as_mut_ptr() as u64, 64, AccessFlags::transfer())
    }
    .unwrap();
    let sge = Sge {
        addr: mr.addr(),
        length: 8,
        lkey: mr.lkey(),
    };
    let batch: Vec<_> = (0..3)
        .map(|i| write(i, sge, dst.addr(), dst.rkey()))
        .collect();
    // SAFETY: the MRs live until the end.
    unsafe { a.qp.post_send(&batch) }.unwrap();
    let mut slots = [Completion::default(); 4];
    let err = a.cq.poll(&mut slots).unwrap_err();
    assert!(matches!(err, VerbsError::OutOfResources { .. }), "{err}");
}

#[test]
fn deregistered_or_destroyed_objects_fail_queued_requests() {
    let fabric = SimFabric::new();
    let (a, b) = (end(&fabric, "a", 16), end(&fabric, "b", 16));
    connect(&a, &b);
    let mut data = vec![0u8; 64];
    let mut remote = vec![0u8; 64];
    // SAFETY: both vectors outlive their registrations.
    let (mr, dst) = unsafe {
        (
            a.pd.register(data.as_mut_ptr() as u64, 64, AccessFlags::transfer())
                .unwrap(),
            b.pd.register(remote.as_mut_ptr() as u64, 64, AccessFlags::transfer())
                .unwrap(),
        )
    };
    let sge = Sge {
        addr: mr.addr(),
        length: 8,
        lkey: mr.lkey(),
    };
    fabric.set_paused(true);
    // SAFETY: the lkey is checked when the request runs, after the MR is gone.
    unsafe { a.qp.post_send(&[write(1, sge, dst.addr(), dst.rkey())]) }.unwrap();
    mr.deregister().unwrap();
    fabric.set_paused(false);
    assert_eq!(poll_one(&a.cq).status, WcStatus::LOC_PROT_ERR);

    // The peer QP is destroyed: requests to it time out.
    let (c, d) = (end(&fabric, "c", 16), end(&fabric, "d", 16));
    connect(&c, &d);
    // SAFETY: `data` outlives the registration.
    let mr = unsafe {
        c.pd.register(data.as_mut_ptr() as u64, 64, AccessFlags::transfer())
    }
    .unwrap();
    let sge = Sge {
        addr: mr.addr(),
        length: 8,
        lkey: mr.lkey(),
    };
    drop(d);
    // SAFETY: as above.
    unsafe { c.qp.post_send(&[write(2, sge, 0, 0)]) }.unwrap();
    assert_eq!(poll_one(&c.cq).status, WcStatus::RETRY_EXC_ERR);
    drop((mr, dst));
    assert_eq!(fabric.lock().mrs.len(), 0, "every registration released");
}

/// Bytes of the large transfers in the tests of copies outside the lock.
const BIG: usize = 4 << 20;

/// How long a test waits for something that must happen before it gives
/// up and fails (never a timing assertion: the waits end as soon as it
/// does).
const PATIENCE: std::time::Duration = std::time::Duration::from_secs(20);

/// A registered buffer of `len` bytes filled with `fill`.
struct Buf {
    data: Vec<u8>,
    mr: Option<SimMr>,
}

impl Buf {
    fn new(pd: &SimPd, len: usize, fill: impl Fn(usize) -> u8) -> Self {
        let mut data: Vec<u8> = (0..len).map(fill).collect();
        // SAFETY: `data` is never reallocated and outlives the
        // registration (dropped before it in every test, or with it here).
        let mr =
            unsafe { pd.register(data.as_mut_ptr() as u64, len, AccessFlags::transfer()) }.unwrap();
        Self { data, mr: Some(mr) }
    }

    fn mr(&self) -> &SimMr {
        self.mr.as_ref().unwrap()
    }

    fn sge(&self) -> Sge {
        Sge {
            addr: self.mr().addr(),
            length: self.data.len() as u32,
            lkey: self.mr().lkey(),
        }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        drop(self.mr.take());
    }
}

/// A hook that holds copies of at least [`BIG`] bytes: each says it started
/// on the returned receiver, then waits for a word on the returned sender.
fn hold_big_copies(
    fabric: &SimFabric,
) -> (
    std::sync::mpsc::Receiver<()>,
    std::sync::mpsc::SyncSender<()>,
) {
    let (started_tx, started_rx) = std::sync::mpsc::sync_channel(8);
    let (go_tx, go_rx) = std::sync::mpsc::sync_channel::<()>(8);
    let go_rx = std::sync::Mutex::new(go_rx);
    fabric.lock().copy_hook = Some(Arc::new(move |len: usize| {
        if len >= BIG {
            let _ = started_tx.send(());
            // Longer than any test waits for the others, so a test fails
            // before its hold ends by itself.
            let _ = go_rx.lock().unwrap().recv_timeout(3 * PATIENCE);
        }
    }));
    (started_rx, go_tx)
}

/// Polls `cq` until it gives one completion.
fn poll_until_one(cq: &SimCq) -> Completion {
    let deadline = std::time::Instant::now() + PATIENCE;
    let mut slot = [Completion::default()];
    loop {
        if cq.poll(&mut slot).unwrap() == 1 {
            return slot[0];
        }
        assert!(std::time::Instant::now() < deadline, "no completion came");
        std::thread::yield_now();
    }
}

/// While one thread's poll moves a large WRITE's bytes (held in the copy
/// hook), another thread posts and polls on another pair of QPs and gets
/// its completion: the fabric lock is free during the copy. The large
/// WRITE's own completion is not out before its bytes landed.
#[test]
fn another_poller_gets_its_completion_while_a_large_transfer_moves() {
    let fabric = SimFabric::new();
    let (a, b) = (end(&fabric, "a", 16), end(&fabric, "b", 16));
    let (c, d) = (end(&fabric, "c", 16), end(&fabric, "d", 16));
    connect(&a, &b);
    connect(&c, &d);
    let big_src = Buf::new(&a.pd, BIG, |i| (i % 251) as u8);
    let big_dst = Buf::new(&b.pd, BIG, |_| 0);
    let small_src = Buf::new(&c.pd, 64, |i| i as u8 + 1);
    let small_dst = Buf::new(&d.pd, 64, |_| 0);
    let (started, go) = hold_big_copies(&fabric);
    let big = write(1, big_src.sge(), big_dst.mr().addr(), big_dst.mr().rkey());
    // SAFETY: both MRs outlive the polls below.
    unsafe { a.qp.post_send(&[big]) }.unwrap();

    std::thread::scope(|s| {
        let mover = s.spawn(|| poll_until_one(&a.cq));
        started
            .recv_timeout(PATIENCE)
            .expect("the large WRITE's copy started");
        let (tx, rx) = std::sync::mpsc::channel();
        let (c, small_src, small_dst) = (&c, &small_src, &small_dst);
        s.spawn(move || {
            let small = write(
                2,
                small_src.sge(),
                small_dst.mr().addr(),
                small_dst.mr().rkey(),
            );
            // SAFETY: both MRs outlive the poll.
            unsafe { c.qp.post_send(&[small]) }.unwrap();
            let _ = tx.send(poll_until_one(&c.cq));
        });
        let other = rx.recv_timeout(PATIENCE);
        // The large WRITE is still held: its completion is not out.
        let mut slot = [Completion::default()];
        let early = if other.is_ok() {
            a.cq.poll(&mut slot).unwrap()
        } else {
            0
        };
        let _ = go.send(());
        let other = other.expect("the other poller got its completion while the copy moved");
        assert_eq!(other.wr_id, 2);
        assert_eq!(other.status, WcStatus::SUCCESS);
        assert_eq!(small_dst.data, small_src.data);
        assert_eq!(early, 0, "no completion before the bytes landed");
        let wc = mover.join().unwrap();
        assert_eq!((wc.wr_id, wc.status), (1, WcStatus::SUCCESS));
    });
    assert_eq!(big_dst.data, big_src.data);
    assert_eq!(fabric.lock().copies.outside, 0);
}

/// The poster's own poll does not move a large WRITE's bytes (a NIC's DMA
/// does not take the host's thread): while its copy is held on the NIC
/// thread, the thread that posted it polls and returns with nothing, and
/// gets the completion once the bytes landed.
#[test]
fn the_posters_poll_returns_while_the_dma_thread_moves_a_large_transfer() {
    let fabric = SimFabric::new();
    let (a, b) = (end(&fabric, "a", 16), end(&fabric, "b", 16));
    connect(&a, &b);
    let src = Buf::new(&a.pd, BIG, |i| (i % 241) as u8);
    let dst = Buf::new(&b.pd, BIG, |_| 0);
    let (started, go) = hold_big_copies(&fabric);
    let big = write(7, src.sge(), dst.mr().addr(), dst.mr().rkey());
    // SAFETY: both MRs outlive the polls below.
    unsafe { a.qp.post_send(&[big]) }.unwrap();
    let (polled_tx, polled_rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            // The post handed the bytes to the NIC thread: this poll returns.
            let mut slot = [Completion::default()];
            let first = a.cq.poll(&mut slot).unwrap();
            let _ = polled_tx.send(first);
        });
        started
            .recv_timeout(PATIENCE)
            .expect("the large WRITE's copy started");
        let first = polled_rx.recv_timeout(PATIENCE);
        let _ = go.send(());
        assert_eq!(
            first.expect("the poster's poll returned while its bytes moved"),
            0,
            "no completion before the bytes landed"
        );
    });
    let wc = poll_until_one(&a.cq);
    assert_eq!((wc.wr_id, wc.status), (7, WcStatus::SUCCESS));
    assert_eq!(dst.data, src.data);
}

/// A deregistration of the MR that a large WRITE's bytes are moving into,
/// outside the lock, waits until they have landed.
#[test]
fn a_deregistration_waits_for_bytes_moving_outside_the_lock() {
    let fabric = SimFabric::new();
    let (a, b) = (end(&fabric, "a", 16), end(&fabric, "b", 16));
    connect(&a, &b);
    let src = Buf::new(&a.pd, BIG, |i| (i % 253) as u8);
    let mut dst = Buf::new(&b.pd, BIG, |_| 0);
    let (started, go) = hold_big_copies(&fabric);
    let big = write(7, src.sge(), dst.mr().addr(), dst.mr().rkey());
    // SAFETY: `src` outlives the poll; `dst`'s memory outlives its MR.
    unsafe { a.qp.post_send(&[big]) }.unwrap();
    let dst_mr = dst.mr.take().unwrap();
    let deregistered = std::sync::atomic::AtomicBool::new(false);

    std::thread::scope(|s| {
        let mover = s.spawn(|| poll_until_one(&a.cq));
        started
            .recv_timeout(PATIENCE)
            .expect("the large WRITE's copy started");
        let deregistered = &deregistered;
        let dereg = s.spawn(move || {
            dst_mr.deregister().unwrap();
            deregistered.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        // Until the deregistration waits for the copy, or (wrongly) ends.
        let deadline = std::time::Instant::now() + PATIENCE;
        while fabric.lock().copies.waiters == 0
            && !deregistered.load(std::sync::atomic::Ordering::SeqCst)
            && std::time::Instant::now() < deadline
        {
            std::thread::yield_now();
        }
        let early = deregistered.load(std::sync::atomic::Ordering::SeqCst);
        let waiting = fabric.lock().copies.waiters;
        let _ = go.send(());
        assert!(!early, "the deregistration ended while bytes were moving");
        assert_eq!(waiting, 1, "the deregistration waits for the copy");
        dereg.join().unwrap();
        assert!(deregistered.load(std::sync::atomic::Ordering::SeqCst));
        let wc = mover.join().unwrap();
        assert_eq!((wc.wr_id, wc.status), (7, WcStatus::SUCCESS));
    });
    assert_eq!(dst.data, src.data, "every byte landed before the MR went");
    assert_eq!(fabric.lock().mrs.len(), 1, "only the source is registered");
}

/// A QP flushed while a large WRITE's bytes move outside the lock: the
/// WRITE, and a request queued behind it, complete with WR_FLUSH_ERR only
/// once the bytes have landed, in posting order.
#[test]
fn a_flush_completes_a_moving_transfer_once_its_bytes_landed() {
    let fabric = SimFabric::new();
    let (a, b) = (end(&fabric, "a", 16), end(&fabric, "b", 16));
    connect(&a, &b);
    let src = Buf::new(&a.pd, BIG, |i| (i % 241) as u8);
    let dst = Buf::new(&b.pd, BIG, |_| 0);
    let (started, go) = hold_big_copies(&fabric);
    let first = write(1, src.sge(), dst.mr().addr(), dst.mr().rkey());
    let second = write(2, src.sge(), dst.mr().addr(), dst.mr().rkey());
    // SAFETY: both MRs outlive the polls.
    unsafe { a.qp.post_send(&[first, second]) }.unwrap();

    std::thread::scope(|s| {
        let mover = s.spawn(|| {
            let mut got = Vec::new();
            while got.len() < 2 {
                got.push(poll_until_one(&a.cq));
            }
            got
        });
        started
            .recv_timeout(PATIENCE)
            .expect("the first WRITE's copy started");
        a.qp.to_error().unwrap();
        let mut slots = [Completion::default(); 4];
        let early = a.cq.poll(&mut slots).unwrap();
        let _ = go.send(());
        assert_eq!(early, 0, "nothing completes while the bytes move");
        let got = mover.join().unwrap();
        let seen: Vec<_> = got.iter().map(|wc| (wc.wr_id, wc.status)).collect();
        assert_eq!(
            seen,
            [(1, WcStatus::WR_FLUSH_ERR), (2, WcStatus::WR_FLUSH_ERR)]
        );
    });
    assert_eq!(dst.data, src.data, "the first WRITE's bytes all landed");
    assert_eq!(fabric.lock().copies.outside, 0);
}

mod cm_races;
mod parked;

/// A request posted behind one that waits (a SEND without a receive at
/// its peer) completes after it, never before: the fast path is closed
/// while any QP of the fabric has work, so the WRITE queues behind the
/// SEND instead of running at once.
#[test]
fn a_write_behind_a_waiting_send_does_not_overtake_it() {
    let fabric = SimFabric::new();
    let (a, b) = (end(&fabric, "a", 16), end(&fabric, "b", 16));
    connect(&a, &b);
    let mut data = vec![7u8; 64];
    let mut remote = vec![0u8; 64];
    // SAFETY: both buffers outlive their registrations (dropped first).
    let (src, dst) = unsafe {
        (
            a.pd.register(data.as_mut_ptr() as u64, 64, AccessFlags::transfer())
                .unwrap(),
            b.pd.register(remote.as_mut_ptr() as u64, 64, AccessFlags::transfer())
                .unwrap(),
        )
    };
    let sge = Sge {
        addr: src.addr(),
        length: 8,
        lkey: src.lkey(),
    };
    // Alone on the fabric, a WRITE takes the fast path.
    // SAFETY: the MRs live until the end.
    unsafe { a.qp.post_send(&[write(1, sge, dst.addr(), dst.rkey())]) }.unwrap();
    assert_eq!(
        fabric
            .lock()
            .fast_posts
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(poll_one(&a.cq).wr_id, 1);
    let send = SendRequest {
        wr_id: 2,
        op: SendOp::Send,
        sg_list: [sge].into_iter().collect(),
        flags: SendFlags::SIGNALED,
    };
    // SAFETY: as above.
    unsafe {
        a.qp.post_send(&[send, write(3, sge, dst.addr(), dst.rkey())])
    }
    .unwrap();
    // SAFETY: as above.
    unsafe { a.qp.post_send(&[write(4, sge, dst.addr(), dst.rkey())]) }.unwrap();
    assert_eq!(
        fabric
            .lock()
            .fast_posts
            .load(std::sync::atomic::Ordering::Relaxed),
        1,
        "nothing more took the fast path"
    );
    let mut slots = [Completion::default(); 4];
    assert_eq!(a.cq.poll(&mut slots).unwrap(), 0, "all wait for the SEND");
    let recv = hal_verbs::RecvRequest {
        wr_id: 9,
        sg_list: [Sge {
            addr: dst.addr(),
            length: 64,
            lkey: dst.lkey(),
        }]
        .into_iter()
        .collect(),
    };
    // SAFETY: as above.
    unsafe { b.qp.post_recv(&[recv]) }.unwrap();
    let order: Vec<u64> = (0..3).map(|_| poll_until_one(&a.cq).wr_id).collect();
    assert_eq!(order, [2, 3, 4]);
    assert_eq!(poll_one(&b.cq).wr_id, 9);
    drop((src, dst));
}

/// Threads posting and polling on their own queue pairs (the fast path)
/// while another thread changes the fabric (creates and destroys QPs,
/// registers and deregisters memory, pauses progress, so posts queue and
/// run on the slow path): every request completes once, in order, with
/// its bytes.
#[test]
fn lanes_lose_nothing_while_the_fabric_changes_under_them() {
    const LANES: usize = 4;
    const ROUNDS: u64 = 300;
    const BATCH: u64 = 8;
    const SLOT: usize = 256;
    let fabric = SimFabric::new();
    let stop = std::sync::atomic::AtomicBool::new(false);
    // Who pauses the fabric holds this: lane 0 posts one batch into a pause
    // of its own, so the slow path runs whatever the threads' timing (the
    // changer's pauses alone missed every post now and then).
    let pausing = std::sync::Mutex::new(());
    std::thread::scope(|s| {
        let lanes: Vec<_> = (0..LANES)
            .map(|lane| {
                let (fabric, pausing) = (&fabric, &pausing);
                s.spawn(move || {
                    let a = end(fabric, &format!("a{lane}"), 64);
                    let b = end(fabric, &format!("b{lane}"), 64);
                    connect(&a, &b);
                    let span = SLOT * BATCH as usize;
                    let mut src = vec![0u8; span];
                    let mut dst = vec![0u8; span];
                    // SAFETY: both buffers outlive their registrations
                    // (dropped at the end of this closure, before them).
                    let (smr, dmr) = unsafe {
                        (
                            a.pd.register(src.as_mut_ptr() as u64, span, AccessFlags::transfer())
                                .unwrap(),
                            b.pd.register(dst.as_mut_ptr() as u64, span, AccessFlags::transfer())
                                .unwrap(),
                        )
                    };
                    for round in 0..ROUNDS {
                        let fill = (lane as u64 * 31 + round) as u8;
                        src.fill(fill);
                        let batch: Vec<_> = (0..BATCH)
                            .map(|i| {
                                let offset = i * SLOT as u64;
                                let sge = Sge {
                                    addr: smr.addr() + offset,
                                    length: SLOT as u32,
                                    lkey: smr.lkey(),
                                };
                                write(round * BATCH + i, sge, dmr.addr() + offset, dmr.rkey())
                            })
                            .collect();
                        let pause = (lane == 0 && round == ROUNDS / 2).then(|| {
                            let held = pausing.lock().unwrap();
                            fabric.set_paused(true);
                            held
                        });
                        // SAFETY: the MRs live until the end of the closure.
                        unsafe { a.qp.post_send(&batch) }.unwrap();
                        if let Some(_held) = pause {
                            fabric.set_paused(false);
                        }
                        for i in 0..BATCH {
                            let wc = poll_until_one(&a.cq);
                            assert_eq!(wc.status, WcStatus::SUCCESS);
                            assert_eq!(wc.wr_id, round * BATCH + i, "lane {lane}: in order");
                        }
                        assert!(dst.iter().all(|&b| b == fill), "lane {lane} round {round}");
                    }
                    drop((smr, dmr));
                })
            })
            .collect();
        let (fabric, stop, pausing) = (&fabric, &stop, &pausing);
        let changer = s.spawn(move || {
            let c = end(fabric, "changer", 8);
            let mut memory = vec![0u8; 4096];
            let mut changes = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let cq = c.ctx.create_cq(4).unwrap();
                let qp = c.pd.create_qp(&QpCaps::default(), &cq, &cq).unwrap();
                // SAFETY: `memory` outlives the registration, dropped here.
                let mr = unsafe {
                    c.pd.register(memory.as_mut_ptr() as u64, 4096, AccessFlags::transfer())
                }
                .unwrap();
                drop((mr, qp, cq));
                let _held = pausing.lock().unwrap();
                fabric.set_paused(true);
                std::thread::yield_now();
                fabric.set_paused(false);
                changes += 1;
            }
            changes
        });
        for lane in lanes {
            lane.join().unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let changes = changer.join().unwrap();
        assert!(changes > 0);
    });
    let fast = fabric
        .lock()
        .fast_posts
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(fast > 0, "the fast path ran");
    assert!(
        fast < LANES as u64 * ROUNDS,
        "some posts went the slow path"
    );
}

/// A deregistration of the MR that a fast-path WRITE is copying into (the
/// post holding the fabric shared) waits until the bytes have landed, and
/// the copy never runs into memory whose registration is gone.
#[test]
fn a_deregistration_waits_for_a_fast_path_copy() {
    // A size no other copy of this test has, held in the copy hook.
    const HELD: usize = 12 * 1024;
    let fabric = SimFabric::new();
    let (a, b) = (end(&fabric, "a", 16), end(&fabric, "b", 16));
    connect(&a, &b);
    let src = Buf::new(&a.pd, HELD, |i| (i % 251) as u8);
    let mut dst = Buf::new(&b.pd, HELD, |_| 0);
    let (started_tx, started_rx) = std::sync::mpsc::sync_channel(1);
    let (go_tx, go_rx) = std::sync::mpsc::sync_channel::<()>(1);
    let go_rx = std::sync::Mutex::new(go_rx);
    fabric.lock().copy_hook = Some(Arc::new(move |len: usize| {
        if len == HELD {
            let _ = started_tx.send(());
            let _ = go_rx.lock().unwrap().recv_timeout(3 * PATIENCE);
        }
    }));
    let posts_before = fabric
        .read()
        .fast_posts
        .load(std::sync::atomic::Ordering::Relaxed);
    let dst_mr = dst.mr.take().unwrap();
    let request = write(5, src.sge(), dst_mr.addr(), dst_mr.rkey());
    let deregistered = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // SAFETY: `src` and `dst`'s memory outlive the scope.
        let poster = s.spawn(|| unsafe { a.qp.post_send(&[request]) });
        started_rx
            .recv_timeout(PATIENCE)
            .expect("the WRITE's copy started");
        let deregistered = &deregistered;
        let dereg = s.spawn(move || {
            dst_mr.deregister().unwrap();
            deregistered.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        let early = deregistered.load(std::sync::atomic::Ordering::SeqCst);
        let _ = go_tx.send(());
        assert!(!early, "the deregistration ended while the bytes moved");
        poster.join().unwrap().unwrap();
        dereg.join().unwrap();
    });
    assert_eq!(
        fabric
            .read()
            .fast_posts
            .load(std::sync::atomic::Ordering::Relaxed),
        posts_before + 1,
        "the WRITE took the fast path"
    );
    assert_eq!(poll_one(&a.cq).status, WcStatus::SUCCESS);
    assert_eq!(dst.data, src.data, "every byte landed before the MR went");
}
