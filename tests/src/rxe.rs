//! Finding SoftRoCE's `rxe0` for the tests that need a real RDMA device.
//!
//! Without an RDMA device (the usual host) such tests skip with their reason
//! on stderr; with `GDR_EXPECT_RXE=1` (set by `scripts/test.sh` for the VM
//! run) a missing `rxe0` is a failure instead. Knobs: `GDR_RXE_DEVICE`
//! (default `rxe0`), `GDR_RXE_IP` (default `10.99.0.1`, the address the VM
//! runner gives rxe0's netdev).

use std::net::IpAddr;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use hal_verbs::rdma::{RdmaApi, RdmaContext, RdmaCq, RdmaMr, RdmaPd, RdmaProvider, RdmaQp};
use hal_verbs::{AccessFlags, Completion, MemoryRegion, ProtectionDomain, Provider, SgList, Sge};

use crate::pair::HostMem;
use crate::{init_tracing, skip};

/// The tests of a binary share one device; serialising them keeps resource
/// counts stable and the slow software NIC uncontended.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Page-aligned host memory the NIC reads and writes ([`HostMem`], whose
/// `addr`, `len`, `read` and `write` it derefs to). Read and written only
/// while no work request on it is in flight.
#[derive(Debug)]
pub struct HostBuf(HostMem);

impl std::ops::Deref for HostBuf {
    type Target = HostMem;

    fn deref(&self) -> &HostMem {
        &self.0
    }
}

impl HostBuf {
    /// `len` bytes holding `pattern(len, seed)`.
    pub fn new(len: usize, seed: u8) -> Self {
        assert!(len > 0);
        Self(HostMem::new(len, seed))
    }

    /// Registers `len` bytes from `offset`. The caller keeps `self` alive
    /// longer than the returned region (declare the buffer first).
    pub fn register(&self, pd: &RdmaPd, offset: usize, len: usize, access: AccessFlags) -> RdmaMr {
        assert!(offset + len <= self.len());
        // SAFETY: the range lies in our allocation, which every test keeps
        // alive longer than the region (it is declared, so dropped, after).
        unsafe { pd.register(self.addr() + offset as u64, len, access) }
            .unwrap_or_else(|e| panic!("ibv_reg_mr of {len} bytes: {e}"))
    }
}

/// One scatter/gather entry: `length` bytes of `mr` from `offset`.
pub fn sge(mr: &RdmaMr, offset: u64, length: u32) -> SgList {
    let mut list = SgList::new();
    list.push(Sge {
        addr: mr.addr() + offset,
        length,
        lkey: mr.lkey(),
    });
    list
}

/// What `qp` of `ctx` tells its peer (port 1, its RoCE v2 GID), and the
/// GID's index.
pub fn local_info(ctx: &RdmaContext, qp: &RdmaQp, psn: u32) -> (hal_verbs::ConnectionInfo, u8) {
    crate::pair::local_info::<RdmaApi>(ctx, qp, psn)
}

/// Polls `cq` until `n` completions arrived; fails after `timeout`.
pub fn wait(cq: &RdmaCq, n: usize, timeout: Duration) -> Vec<Completion> {
    crate::pair::wait::<RdmaApi>(cq, n, timeout)
}

/// Whether the run promises an rxe device (`GDR_EXPECT_RXE=1`).
pub fn expect_rxe() -> bool {
    std::env::var("GDR_EXPECT_RXE").is_ok_and(|v| v == "1")
}

/// The device to test (`GDR_RXE_DEVICE`, default `rxe0`).
pub fn device_name() -> String {
    std::env::var("GDR_RXE_DEVICE").unwrap_or_else(|_| "rxe0".into())
}

/// The address rxe0's GID carries (`GDR_RXE_IP`, default `10.99.0.1`).
pub fn expected_ip() -> IpAddr {
    std::env::var("GDR_RXE_IP")
        .ok()
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| "10.99.0.1".parse().unwrap())
}

/// The provider and the opened rxe device, or `None` after printing why the
/// test skips. Panics instead when `GDR_EXPECT_RXE=1`.
pub fn open_rxe(test: &str) -> Option<(RdmaProvider, RdmaContext)> {
    init_tracing();
    let name = device_name();
    let unavailable = |why: String| {
        assert!(!expect_rxe(), "{test}: GDR_EXPECT_RXE=1 but {why}");
        skip(test, &why);
    };
    let provider = match RdmaProvider::load() {
        Ok(p) => p,
        Err(e) => {
            unavailable(e.to_string());
            return None;
        }
    };
    let devices = match provider.devices() {
        Ok(d) => d,
        Err(e) => {
            unavailable(e.to_string());
            return None;
        }
    };
    if !devices.iter().any(|d| d.name == name) {
        let names: Vec<_> = devices.iter().map(|d| d.name.as_str()).collect();
        unavailable(format!("no {name} among the RDMA devices {names:?}"));
        return None;
    }
    let ctx = provider
        .open(&name)
        .unwrap_or_else(|e| panic!("{test}: opening {name}: {e}"));
    Some((provider, ctx))
}
