//! Protection domains and memory registrations.

use std::os::fd::{BorrowedFd, RawFd};
use std::sync::Arc;

use hal_verbs::{AccessFlags, MemoryRegion, ProtectionDomain, QpCaps, Result, VerbsError};

use super::qp::{SimCq, SimQp};
use super::state::{FabricState, MrState, NicPtr, Pinned};
use super::{SimFabric, SimVerbsApi};
use crate::faults::FaultSite;
use crate::memory::{self, NicAccessError};

#[derive(Debug)]
pub(crate) struct PdInner {
    pub fabric: SimFabric,
    pub device: usize,
    pub id: u64,
}

/// A simulated protection domain. MRs and QPs keep it alive.
#[derive(Debug, Clone)]
pub struct SimPd {
    inner: Arc<PdInner>,
}

impl SimPd {
    pub(crate) fn new(fabric: SimFabric, device: usize, id: u64) -> Self {
        Self {
            inner: Arc::new(PdInner { fabric, device, id }),
        }
    }

    /// The device (fabric index) the PD is on.
    pub(crate) fn device_index(&self) -> usize {
        self.inner.device
    }

    /// The fabric the PD is on.
    pub(crate) fn fabric(&self) -> &SimFabric {
        &self.inner.fabric
    }

    /// Common checks of both registration verbs; the MR limit, length and
    /// access-flag rules are the kernel's.
    fn check_registration(
        &self,
        state: &FabricState,
        operation: &'static str,
        len: usize,
        access: AccessFlags,
    ) -> Result<()> {
        let device = self.inner.device;
        let attributes = &state.devices[device].config.attributes;
        if len == 0 {
            return Err(state.einval(device, operation, "zero length"));
        }
        if len as u64 > attributes.max_mr_size {
            return Err(state.einval(
                device,
                operation,
                format!("{len} bytes exceed max_mr_size {}", attributes.max_mr_size),
            ));
        }
        // ib_check_mr_access: remote write (or atomic) needs local write.
        if access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
            && !access.contains(AccessFlags::LOCAL_WRITE)
        {
            return Err(state.einval(
                device,
                operation,
                "REMOTE_WRITE/REMOTE_ATOMIC without LOCAL_WRITE",
            ));
        }
        if state.devices[device].mrs >= attributes.max_mr {
            return Err(VerbsError::from_errno(
                operation,
                &state.devices[device].name,
                libc::ENOMEM,
            ));
        }
        Ok(())
    }

    /// Records a checked registration and returns its handle.
    ///
    /// Keys as rxe and mlx5 make them: one key serves as lkey and rkey
    /// (rxe's `rxe_mr_init`, drivers/infiniband/sw/rxe/rxe_mr.c; mlx5's
    /// mkey). An MR without remote rights gets rkey 0 on an rxe-like
    /// device ([`DeviceConfig::local_only_rkey_is_zero`](super::DeviceConfig)),
    /// its mkey on a ConnectX-like one (a remote access through it then
    /// fails on the MR's rights). Checked on rxe by the conformance suite.
    fn insert(&self, state: &mut FabricState, mr: MrState) -> SimMr {
        let lkey = state.next_key();
        let remote =
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        let zero = state.devices[self.inner.device]
            .config
            .local_only_rkey_is_zero;
        let rkey = if mr.access.intersects(remote) || !zero {
            lkey
        } else {
            0
        };
        let (addr, len, access) = (mr.addr, mr.len, mr.access);
        state.devices[self.inner.device].mrs += 1;
        state.mrs.insert(lkey, mr);
        if rkey != 0 {
            state.rkeys.insert(rkey, lkey);
        }
        tracing::debug!(
            device = %state.devices[self.inner.device].name,
            addr = format_args!("{addr:#x}"),
            len,
            lkey = format_args!("{lkey:#x}"),
            rkey = format_args!("{rkey:#x}"),
            ?access,
            "sim: memory registered"
        );
        SimMr {
            pd: Arc::clone(&self.inner),
            lkey,
            rkey,
            addr,
            len,
            access,
        }
    }
}

impl ProtectionDomain<SimVerbsApi> for SimPd {
    unsafe fn register(&self, addr: u64, len: usize, access: AccessFlags) -> Result<SimMr> {
        const OP: &str = "ibv_reg_mr";
        let device = self.inner.device;
        let mut state = self.inner.fabric.lock();
        state.alive(device, OP)?;
        state.fault(device, FaultSite::VerbsRegister, OP)?;
        self.check_registration(&state, OP, len, access)?;
        if addr.checked_add(len as u64).is_none() {
            return Err(state.einval(device, OP, "range wraps around"));
        }
        let efault = || VerbsError::from_errno(OP, &state.devices[device].name, libc::EFAULT);
        let (ptr, backing) = memory::nic_view(addr, len).map_err(|e| {
            tracing::debug!(error = %e, "sim: ibv_reg_mr cannot pin the range");
            match e {
                // What the kernel answers when no peer-memory client claims
                // device memory and get_user_pages fails on it.
                // A freed range (reported as a use after free): the same.
                NicAccessError::NoPeerMemory { .. }
                | NicAccessError::NotMapped { .. }
                | NicAccessError::Freed(_) => {
                    VerbsError::from_errno(OP, &state.devices[device].name, libc::EFAULT)
                }
            }
        })?;
        // Host memory must be mapped and readable, every page of it: the
        // kernel's get_user_pages fails on a hole or on memory it cannot
        // reach, such as a GPU driver's device ranges (ib_umem_get: EFAULT).
        if backing.is_none() && !host_range_is_readable(addr, len) {
            tracing::debug!(
                addr = format_args!("{addr:#x}"),
                len,
                "sim: ibv_reg_mr of unmapped memory"
            );
            return Err(efault());
        }
        let mr = MrState {
            device,
            pd: self.inner.id,
            addr,
            len,
            access,
            ptr: NicPtr(ptr),
            _pinned: backing.map_or(Pinned::Host, Pinned::Device),
        };
        Ok(self.insert(&mut state, mr))
    }

    unsafe fn register_dmabuf(
        &self,
        fd: RawFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<SimMr> {
        const OP: &str = "ibv_reg_dmabuf_mr";
        let device = self.inner.device;
        let mut state = self.inner.fabric.lock();
        state.alive(device, OP)?;
        state.fault(device, FaultSite::VerbsRegisterDmabuf, OP)?;
        if !state.devices[device].config.dmabuf {
            // rxe has no reg_user_mr_dmabuf: the core answers EOPNOTSUPP.
            return Err(VerbsError::from_errno(
                OP,
                &state.devices[device].name,
                libc::EOPNOTSUPP,
            ));
        }
        self.check_registration(&state, OP, len, access)?;
        if iova.checked_add(len as u64).is_none() {
            return Err(state.einval(device, OP, "iova range wraps around"));
        }
        let bad_fd = |errno: i32, reason: String| VerbsError::InvalidArgument {
            operation: OP,
            reason,
            errno: Some(errno),
        };
        if fd < 0 {
            return Err(bad_fd(libc::EBADF, format!("fd {fd} is not a dma-buf")));
        }
        // SAFETY: the caller guarantees `fd` is open for the duration of
        // this call (the trait's contract), and it is not -1.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let stat = rustix::fs::fstat(borrowed)
            .map_err(|e| bad_fd(e.raw_os_error(), format!("fd {fd}: {e}")))?;
        // A dma-buf the simulated GPU exported for a sub-range starts at that
        // sub-range inside the allocation's memfd; any other fd at byte 0.
        let (origin, size) =
            crate::gpu::dmabuf_extent(fd).unwrap_or((0, u64::try_from(stat.st_size).unwrap_or(0)));
        if offset.checked_add(len as u64).is_none_or(|end| end > size) {
            return Err(state.einval(
                device,
                OP,
                format!("{len} bytes at offset {offset} run past the dma-buf's {size} bytes"),
            ));
        }
        // Our own shared mapping of exactly the exporter's pages: every write
        // through the MR lands in the allocation and vice versa.
        let map = memmap2::MmapOptions::new()
            .offset(origin + offset)
            .len(len)
            .map_raw(fd)
            .map_err(|e| {
                bad_fd(
                    e.raw_os_error().unwrap_or(libc::EINVAL),
                    format!("fd {fd} cannot be mapped: {e}"),
                )
            })?;
        let mr = MrState {
            device,
            pd: self.inner.id,
            addr: iova,
            len,
            access,
            ptr: NicPtr(map.as_mut_ptr()),
            _pinned: Pinned::Dmabuf(map),
        };
        Ok(self.insert(&mut state, mr))
    }

    fn create_qp(&self, caps: &QpCaps, send_cq: &SimCq, recv_cq: &SimCq) -> Result<SimQp> {
        SimQp::create(Arc::clone(&self.inner), caps, send_cq, recv_cq)
    }
}

/// Whether every page of `len` bytes at `addr` is mapped in this process:
/// `mincore` fails with ENOMEM on any page that is not.
/// Whether every page of `len` bytes at `addr` is host memory the CPU can
/// read: mapped (a hole fails the kernel's `get_user_pages`, EFAULT) and not
/// `PROT_NONE`. The latter matters where a real GPU driver shares the
/// process: its device memory sits in address ranges it reserved with
/// `PROT_NONE` (unified addressing), which look mapped to `mincore`; a
/// real NIC without a peer-memory client refuses them, and the sim must
/// not take them for host memory (it would read and write there). Probed
/// with `process_vm_readv` on this process, one byte a page, which fails
/// with EFAULT where a read would fault; where that call is not allowed
/// (a seccomp profile), with `/proc/self/maps`.
fn host_range_is_readable(addr: u64, len: usize) -> bool {
    // SAFETY: sysconf reads a constant of the process.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as u64,
        _ => 4096,
    };
    let Some(end) = addr.checked_add(len as u64) else {
        return false;
    };
    let first = addr & !(page - 1);
    let pages: Vec<u64> = (0..(end - first).div_ceil(page))
        .map(|i| (first + i * page).max(addr))
        .collect();
    const BATCH: usize = 1024; // IOV_MAX
    let mut sink = [0u8; BATCH];
    for chunk in pages.chunks(BATCH) {
        let local = libc::iovec {
            iov_base: sink.as_mut_ptr().cast(),
            iov_len: chunk.len(),
        };
        let remote: Vec<libc::iovec> = chunk
            .iter()
            .map(|&at| libc::iovec {
                iov_base: at as *mut libc::c_void,
                iov_len: 1,
            })
            .collect();
        // SAFETY: the kernel reads one byte at each remote address (of this
        // very process) and fails instead of faulting where it cannot; it
        // writes at most `chunk.len()` bytes into `sink`, which has room
        // for BATCH.
        let read = unsafe {
            libc::process_vm_readv(
                libc::getpid(),
                &local,
                1,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if read < 0 {
            let errno = std::io::Error::last_os_error().raw_os_error();
            if matches!(errno, Some(libc::EPERM | libc::ENOSYS)) {
                return readable_in_proc_maps(addr, end);
            }
            return false;
        }
        if read as usize != chunk.len() {
            // A partial read stops at the first page that would fault.
            return false;
        }
    }
    true
}

/// `addr..end` lies in readable mappings of `/proc/self/maps`.
pub(super) fn readable_in_proc_maps(addr: u64, end: u64) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    let mut covered = addr;
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else {
            continue;
        };
        if lo <= covered && covered < hi {
            if !perms.starts_with('r') {
                return false;
            }
            covered = hi;
            if covered >= end {
                return true;
            }
        }
    }
    false
}

/// A simulated memory registration. Dropping it deregisters; it keeps its
/// PD alive.
#[derive(Debug)]
pub struct SimMr {
    pd: Arc<PdInner>,
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: usize,
    access: AccessFlags,
}

impl SimMr {
    /// Removes the registration; `Err` when its device is lost (it is
    /// removed all the same).
    fn release(&self) -> Result<()> {
        let (removed, result) = {
            // Bytes moving outside the lock may be this MR's: they land
            // before it goes (and its memory may be unmapped or freed).
            let mut state = self.pd.fabric.lock_without_copies();
            let removed = state.mrs.remove(&self.lkey);
            if removed.is_some() && self.rkey != 0 {
                state.rkeys.remove(&self.rkey);
            }
            if removed.is_some() {
                state.devices[self.pd.device].mrs =
                    state.devices[self.pd.device].mrs.saturating_sub(1);
                tracing::debug!(
                    lkey = format_args!("{:#x}", self.lkey),
                    "sim: MR deregistered"
                );
            }
            let result = match removed {
                Some(_) => state.alive(self.pd.device, "ibv_dereg_mr"),
                None => Ok(()),
            };
            (removed, result)
        };
        // Unmapping happens outside the fabric lock.
        drop(removed);
        result
    }
}

impl MemoryRegion for SimMr {
    fn lkey(&self) -> u32 {
        self.lkey
    }

    fn rkey(&self) -> u32 {
        self.rkey
    }

    fn addr(&self) -> u64 {
        self.addr
    }

    fn len(&self) -> usize {
        self.len
    }

    fn access(&self) -> AccessFlags {
        self.access
    }

    fn deregister(self) -> Result<()> {
        // Drop runs after and finds nothing left to remove.
        self.release()
    }
}

impl Drop for SimMr {
    fn drop(&mut self) {
        if let Err(error) = self.release() {
            tracing::debug!(%error, "sim: deregistration on drop failed");
        }
    }
}
