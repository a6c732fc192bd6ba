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
