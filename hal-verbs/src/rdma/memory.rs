//! Protection domains and memory registrations.

use std::collections::HashSet;
use std::ffi::c_int;
use std::fmt;
use std::os::fd::RawFd;
use std::sync::{Arc, PoisonError, RwLock};

use rdma_mummy_sys as sys;

use super::device::ContextInner;
use super::queue::{RdmaCq, RdmaQp};
use super::{RdmaApi, clear_errno, errno_or_eio, ret_errno, verb_error};
use crate::api::{MemoryRegion, ProtectionDomain};
use crate::error::{Result, VerbsError};
use crate::types::{AccessFlags, QpCaps};

/// The native PD, deallocated when its last MR, QP and handle are gone.
pub(crate) struct PdInner {
    pd: *mut sys::ibv_pd,
    ctx: Arc<ContextInner>,
    /// The lkeys of the PD's live dma-buf MRs: their addresses are iovas,
    /// which the CPU cannot read, so an INLINE send naming one is refused.
    dmabuf_lkeys: RwLock<HashSet<u32>>,
}

// SAFETY: an `ibv_pd` is used only as an argument of thread-safe verbs
// (registration, QP creation); it is deallocated only in Drop.
unsafe impl Send for PdInner {}
// SAFETY: see Send.
unsafe impl Sync for PdInner {}

impl PdInner {
    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_pd {
        self.pd
    }

    pub(crate) fn context(&self) -> &Arc<ContextInner> {
        &self.ctx
    }

    /// Whether `lkey` names a live dma-buf MR of this PD.
    pub(crate) fn is_dmabuf_lkey(&self, lkey: u32) -> bool {
        self.dmabuf_lkeys
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&lkey)
    }

    fn track_dmabuf(&self, lkey: u32, live: bool) {
        let mut keys = self
            .dmabuf_lkeys
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if live {
            keys.insert(lkey);
        } else {
            keys.remove(&lkey);
        }
    }
}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: `pd` came from ibv_alloc_pd and is deallocated once; every
        // MR and QP in it holds an Arc to us, so none is left. The context
        // is closed after this, when our Arc to it is dropped.
        let ret = unsafe { sys::ibv_dealloc_pd(self.pd) };
        if ret != 0 {
            tracing::warn!(
                device = %self.ctx.name(),
                errno = ret_errno(ret),
                "ibv_dealloc_pd failed; the protection domain leaks"
            );
        }
    }
}

impl fmt::Debug for PdInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PdInner")
            .field("device", &self.ctx.name())
            .field("pd", &self.pd)
            .finish()
    }
}

/// A protection domain. Cloning shares it.
#[derive(Debug, Clone)]
pub struct RdmaPd {
    pub(crate) inner: Arc<PdInner>,
}

impl RdmaPd {
    pub(crate) fn alloc(ctx: &Arc<ContextInner>) -> Result<Self> {
        clear_errno();
        // SAFETY: the context is open while `ctx` lives.
        let pd = unsafe { sys::ibv_alloc_pd(ctx.as_ptr()) };
        if pd.is_null() {
            return Err(verb_error("ibv_alloc_pd", ctx.name(), errno_or_eio()));
        }
        Ok(Self {
            inner: Arc::new(PdInner {
                pd,
                ctx: Arc::clone(ctx),
                dmabuf_lkeys: RwLock::new(HashSet::new()),
            }),
        })
    }

    fn check_len(&self, operation: &'static str, len: usize) -> Result<()> {
        if len == 0 {
            return Err(VerbsError::invalid(operation, "cannot register 0 bytes"));
        }
        let max = self.inner.ctx.attrs().max_mr_size;
        if max != 0 && u64::try_from(len).unwrap_or(u64::MAX) > max {
            return Err(VerbsError::invalid(
                operation,
                format!("{len} bytes exceed the device's largest MR ({max} bytes)"),
            ));
        }
        Ok(())
    }

    fn wrap_mr(
        &self,
        operation: &'static str,
        mr: *mut sys::ibv_mr,
        addr: u64,
        len: usize,
        access: AccessFlags,
        dmabuf: bool,
    ) -> Result<RdmaMr> {
        if mr.is_null() {
            return Err(verb_error(operation, self.inner.ctx.name(), errno_or_eio()));
        }
        // SAFETY: a non-NULL MR from the library, readable until deregistered.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        tracing::debug!(lkey, rkey, dmabuf, "registered");
        if dmabuf {
            self.inner.track_dmabuf(lkey, true);
        }
        Ok(RdmaMr {
            mr,
            pd: Arc::clone(&self.inner),
            addr,
            len,
            access,
            lkey,
            rkey,
            dmabuf,
        })
    }
}

/// Access flags as the verbs take them (the HAL's values are verbs.h's).
fn native_access(access: AccessFlags) -> c_int {
    c_int::try_from(access.bits()).unwrap_or(c_int::MAX)
}

impl ProtectionDomain<RdmaApi> for RdmaPd {
    #[tracing::instrument(
        level = "debug",
        name = "ibv_reg_mr",
        skip(self),
        fields(device = %self.inner.ctx.name())
    )]
    unsafe fn register(&self, addr: u64, len: usize, access: AccessFlags) -> Result<RdmaMr> {
        self.check_len("ibv_reg_mr", len)?;
        let ptr = usize::try_from(addr)
            .map_err(|_| VerbsError::invalid("ibv_reg_mr", "address beyond the address space"))?
            as *mut libc::c_void;
        clear_errno();
        // SAFETY: the PD is live; the caller guarantees (trait contract)
        // that the range stays mapped while the MR lives. The kernel pins
        // the pages and fails cleanly on an unmapped range.
        let mr = unsafe { sys::ibv_reg_mr(self.inner.pd, ptr, len, native_access(access)) };
        self.wrap_mr("ibv_reg_mr", mr, addr, len, access, false)
    }

    #[tracing::instrument(
        level = "debug",
        name = "ibv_reg_dmabuf_mr",
        skip(self),
        fields(device = %self.inner.ctx.name())
    )]
    unsafe fn register_dmabuf(
        &self,
        fd: RawFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<RdmaMr> {
        self.check_len("ibv_reg_dmabuf_mr", len)?;
        if fd < 0 {
            return Err(VerbsError::invalid(
                "ibv_reg_dmabuf_mr",
                format!("bad fd {fd}"),
            ));
        }
        clear_errno();
        // SAFETY: the PD is live; the caller guarantees `fd` is open for the
        // call and that the exported memory outlives the MR. The kernel
        // checks that `fd` is a dma-buf.
        let mr = unsafe {
            sys::ibv_reg_dmabuf_mr(self.inner.pd, offset, len, iova, fd, native_access(access))
        };
        // rdma-core's `ibv_mr.addr` does not hold the iova of a dma-buf MR:
        // we keep it ourselves.
        self.wrap_mr("ibv_reg_dmabuf_mr", mr, iova, len, access, true)
    }

    #[tracing::instrument(level = "debug", skip(self), fields(device = %self.inner.ctx.name()))]
    fn create_qp(&self, caps: &QpCaps, send_cq: &RdmaCq, recv_cq: &RdmaCq) -> Result<RdmaQp> {
        RdmaQp::create(&self.inner, caps, send_cq, recv_cq)
    }
}

/// A memory registration; keeps its PD (and so the device) alive.
pub struct RdmaMr {
    mr: *mut sys::ibv_mr,
    pd: Arc<PdInner>,
    addr: u64,
    len: usize,
    access: AccessFlags,
    lkey: u32,
    rkey: u32,
    /// Registered from a dma-buf: `addr` is an iova, not CPU-readable.
    dmabuf: bool,
}

// SAFETY: the MR is only read (keys, cached at creation) and deregistered
// once, in Drop or `deregister`, which take it by value.
unsafe impl Send for RdmaMr {}
// SAFETY: see Send: `&RdmaMr` gives only the cached plain values.
unsafe impl Sync for RdmaMr {}

impl RdmaMr {
    /// Whether it was registered from a dma-buf (`ibv_reg_dmabuf_mr`): its
    /// addresses are iovas the CPU cannot read, so INLINE sends from it are
    /// refused.
    pub fn is_dmabuf(&self) -> bool {
        self.dmabuf
    }

    /// Deregisters, leaving `self.mr` NULL so Drop does nothing more.
    fn dereg(&mut self) -> Result<()> {
        let mr = std::mem::replace(&mut self.mr, std::ptr::null_mut());
        if mr.is_null() {
            return Ok(());
        }

        // SAFETY: `mr` came from a registration and is deregistered once
        // (the field is NULL from now on). The PD outlives this call: we
        // hold an Arc to it.
        let ret = unsafe { sys::ibv_dereg_mr(mr) };
        if ret == 0 && self.dmabuf {
            // Forgotten once the key is free for reuse (a failed
            // deregistration leaves it live, and so refused for INLINE).
            self.pd.track_dmabuf(self.lkey, false);
        }
        if ret != 0 {
            return Err(verb_error(
                "ibv_dereg_mr",
                self.pd.ctx.name(),
                ret_errno(ret),
            ));
        }
        Ok(())
    }
}

impl MemoryRegion for RdmaMr {
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

    fn deregister(mut self) -> Result<()> {
        self.dereg()
    }
}

impl Drop for RdmaMr {
    fn drop(&mut self) {
        if let Err(error) = self.dereg() {
            tracing::warn!(%error, addr = self.addr, len = self.len, "the registration leaks");
        }
    }
}

impl fmt::Debug for RdmaMr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaMr")
            .field("device", &self.pd.ctx.name())
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .field("access", &self.access)
            .field("dmabuf", &self.dmabuf)
            .finish()
    }
}
