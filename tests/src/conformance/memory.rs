//! Memory registration: keys, argument checks, unmapped memory.

use hal_verbs::{
    AccessFlags, MemoryRegion, ProtectionDomain, SendFlags, SendOp, VerbsError, WcStatus,
};

use crate::pair::{Backend, Buf, Pair, ids_and_status, req};

/// An MR with a remote right has `rkey == lkey` (rxe, mlx5: see
/// [`crate::pair::Facts::rkey_equals_lkey`]), so the lkey given as the
/// rkey of a WRITE works: a sim that made them differ refused it with a
/// REM_ACCESS_ERR no real NIC gives.
pub fn lkey_and_rkey_of_a_remote_mr_are_equal<B: Backend>(b: &B) {
    let p = Pair::new(b);
    if !p.facts.rkey_equals_lkey {
        return;
    }
    for access in [
        AccessFlags::REMOTE_READ,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        AccessFlags::transfer(),
    ] {
        let mr = p.b.buf(64, 1, access);
        assert_eq!(mr.mr.lkey(), mr.mr.rkey(), "{access:?} on {}", p.name);
        assert_ne!(mr.mr.rkey(), 0, "{access:?}");
    }
    let src = p.a.buf(64, 2, AccessFlags::transfer());
    let dst = p.b.buf(64, 3, AccessFlags::transfer());
    let op = SendOp::Write {
        remote_addr: dst.addr(0),
        rkey: dst.mr.lkey(),
    };
    Pair::<B::A>::post(&p.qa, &[req(1, op, &[src.sge(0, 64)], SendFlags::SIGNALED)]);
    let wcs = p.expect(&p.cqa, 1, "WRITE through the lkey");
    assert_eq!(ids_and_status(&wcs), [(1, WcStatus::SUCCESS)], "{wcs:?}");
    assert!(dst.bytes() == src.bytes());
}

/// An MR registered without remote rights gives no usable rkey: 0 where
/// the fact says so (rxe), and a WRITE through it fails (tested with the
/// other remote access errors).
pub fn local_only_mr_has_no_remote_key<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let mr = p.b.buf(64, 1, AccessFlags::LOCAL_WRITE);
    assert_ne!(mr.mr.lkey(), 0);
    if p.facts.local_only_rkey_is_zero {
        assert_eq!(mr.mr.rkey(), 0, "on {}", p.name);
    }
    let mr = p.b.buf(64, 1, AccessFlags::empty());
    assert_ne!(mr.mr.lkey(), 0);
    if p.facts.local_only_rkey_is_zero {
        assert_eq!(mr.mr.rkey(), 0, "no rights at all, on {}", p.name);
    }
}

/// Keys of a device's live MRs are distinct and never 0 (lkeys; rkeys of
/// remote MRs).
pub fn keys_are_distinct<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let bufs: Vec<Buf<B::A>> = (0..16)
        .map(|i| p.a.buf(64, i, AccessFlags::transfer()))
        .collect();
    let mut keys: Vec<u32> = bufs.iter().map(|b| b.mr.lkey()).collect();
    assert!(keys.iter().all(|&k| k != 0), "{keys:x?}");
    keys.sort_unstable();
    keys.dedup();
    assert_eq!(keys.len(), bufs.len(), "lkeys repeat");
    let mut rkeys: Vec<u32> = bufs.iter().map(|b| b.mr.rkey()).collect();
    rkeys.sort_unstable();
    rkeys.dedup();
    assert_eq!(rkeys.len(), bufs.len(), "rkeys repeat");
}

/// Zero length (InvalidArgument), and REMOTE_WRITE without LOCAL_WRITE
/// (`ib_check_mr_access`), are EINVAL; a good registration reports its
/// address, length and rights, and deregisters cleanly.
pub fn registration_argument_checks<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let mem = crate::pair::HostMem::new(4096, 1);
    let pd = &p.a.pd;
    // SAFETY: `mem` outlives every registration made here (none survives
    // the scenario).
    let err =
        unsafe { pd.register(mem.addr(), 0, AccessFlags::transfer()) }.expect_err("zero length");
    // The rdma-core backend refuses it before the verb (no errno).
    assert!(
        matches!(err, VerbsError::InvalidArgument { .. }),
        "zero length: {err:?}"
    );
    for access in [
        AccessFlags::REMOTE_WRITE,
        AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
    ] {
        // SAFETY: as above.
        let err = unsafe { pd.register(mem.addr(), 64, access) }.expect_err("no LOCAL_WRITE");
        assert!(
            matches!(
                err,
                VerbsError::InvalidArgument {
                    errno: Some(libc::EINVAL),
                    ..
                }
            ),
            "{access:?}: {err}"
        );
    }
    // SAFETY: as above.
    let mr = unsafe { pd.register(mem.addr() + 100, 1000, AccessFlags::REMOTE_READ) }
        .expect("a registration");
    assert_eq!(
        (mr.addr(), mr.len(), mr.access()),
        (mem.addr() + 100, 1000, AccessFlags::REMOTE_READ)
    );
    mr.deregister().expect("ibv_dereg_mr");
}

/// Anonymous pages, some of which are unmapped again.
struct Mapping {
    ptr: *mut std::ffi::c_void,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> Self {
        // SAFETY: a fresh private anonymous mapping, unmapped in Drop.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .expect("mmap");
        Self { ptr, len }
    }

    fn addr(&self, offset: usize) -> u64 {
        self.ptr as u64 + offset as u64
    }

    /// Unmaps `len` bytes at `offset` (page aligned).
    fn unmap(&self, offset: usize, len: usize) {
        // SAFETY: a page-aligned part of our own mapping, not referenced by
        // any live registration (the scenario drops them first).
        unsafe { rustix::mm::munmap(self.ptr.cast::<u8>().add(offset).cast(), len) }
            .expect("munmap");
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping; unmapping a range that is partly
        // unmapped already is fine.
        let _ = unsafe { rustix::mm::munmap(self.ptr, self.len) };
    }
}

/// Registering memory that is not mapped fails with EFAULT, as
/// `ibv_reg_mr` does (the kernel cannot pin the pages: `ib_umem_get`):
/// wholly unmapped, or with a hole in the middle; the mapped pages alone
/// register.
pub fn registering_unmapped_memory_is_efault<B: Backend>(b: &B) {
    let p = Pair::new(b);
    // SAFETY: sysconf reads a constant of the process.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap();
    let map = Mapping::new(4 * page);
    // Touch the pages (a registration pins them either way).
    // SAFETY: the mapping is 4 pages long, readable and writable.
    unsafe { std::ptr::write_bytes(map.ptr.cast::<u8>(), 1, 4 * page) };
    map.unmap(2 * page, page);
    let pd = &p.a.pd;
    let access = AccessFlags::transfer();
    let efault = |what: &str, result: hal_verbs::Result<<B::A as hal_verbs::Api>::MemoryRegion>| {
        let err = result.expect_err(what);
        assert!(
            matches!(
                err,
                VerbsError::InvalidArgument {
                    errno: Some(libc::EFAULT),
                    ..
                }
            ),
            "{what} on {}: {err:?}",
            p.name
        );
    };
    // SAFETY: the registrations that succeed are dropped before the
    // mapping; those that fail pin nothing.
    unsafe {
        efault(
            "a hole in the range",
            pd.register(map.addr(0), 4 * page, access),
        );
        efault(
            "the unmapped page alone",
            pd.register(map.addr(2 * page), page, access),
        );
        efault(
            "the range ending in the hole",
            pd.register(map.addr(page + 100), page, access),
        );
        let mr = pd
            .register(map.addr(0), 2 * page, access)
            .expect("the mapped pages before the hole");
        drop(mr);
        let mr = pd
            .register(map.addr(3 * page), page, access)
            .expect("the mapped page after the hole");
        drop(mr);
    }
    map.unmap(0, 4 * page);
    // SAFETY: as above.
    efault("an unmapped range", unsafe {
        pd.register(map.addr(0), page, access)
    });
}
