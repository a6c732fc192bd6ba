//! Finding SoftRoCE's `rxe0` for the tests that need a real RDMA device.
//!
//! Without an RDMA device (the usual host) such tests skip with their reason
//! on stderr; with `GDR_EXPECT_RXE=1` (set by `scripts/test.sh` for the VM
//! run) a missing `rxe0` is a failure instead. Knobs: `GDR_RXE_DEVICE`
//! (default `rxe0`), `GDR_RXE_IP` (default `10.99.0.1`, the address the VM
//! runner gives rxe0's netdev).

use std::alloc::Layout;
use std::net::IpAddr;
use std::ptr::NonNull;
use std::sync::atomic::{Ordering, fence};
use std::sync::{Mutex, MutexGuard};

use hal_verbs::rdma::{RdmaContext, RdmaMr, RdmaPd, RdmaProvider};
use hal_verbs::{AccessFlags, ProtectionDomain, Provider};

use crate::{init_tracing, pattern, skip};

/// The tests of a binary share one device; serialising them keeps resource
/// counts stable and the slow software NIC uncontended.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Page-aligned host memory the NIC reads and writes. Read and written only
/// while no work request on it is in flight.
#[derive(Debug)]
pub struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain owned memory; the tests hand it between threads only while
// no work request on it is in flight.
unsafe impl Send for HostBuf {}
// SAFETY: see Send; reads and writes happen with no RDMA in flight.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, 4096).unwrap()
    }

    /// `len` bytes holding `pattern(len, seed)`.
    pub fn new(len: usize, seed: u8) -> Self {
        assert!(len > 0);
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(Self::layout(len)) };
        let ptr = NonNull::new(ptr).expect("allocation failed");
        let buf = Self { ptr, len };
        buf.write(0, &pattern(len, seed));
        buf
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// A copy of its bytes.
    pub fn read(&self) -> Vec<u8> {
        fence(Ordering::Acquire);
        // SAFETY: `len` initialised bytes we own; no RDMA into them is in
        // flight when the tests read (they poll completions first).
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

    /// Registers `len` bytes from `offset`. The caller keeps `self` alive
    /// longer than the returned region (declare the buffer first).
    pub fn register(&self, pd: &RdmaPd, offset: usize, len: usize, access: AccessFlags) -> RdmaMr {
        assert!(offset + len <= self.len);
        // SAFETY: the range lies in our allocation, which every test keeps
        // alive longer than the region (it is declared, so dropped, after).
        unsafe { pd.register(self.addr() + offset as u64, len, access) }
            .unwrap_or_else(|e| panic!("ibv_reg_mr of {len} bytes: {e}"))
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
    }
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
