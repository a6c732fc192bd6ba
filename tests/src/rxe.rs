//! Finding SoftRoCE's `rxe0` for the tests that need a real RDMA device.
//!
//! Without an RDMA device (the usual host) such tests skip with their reason
//! on stderr; with `GDR_EXPECT_RXE=1` (set by `scripts/test.sh` for the VM
//! run) a missing `rxe0` is a failure instead. Knobs: `GDR_RXE_DEVICE`
//! (default `rxe0`), `GDR_RXE_IP` (default `10.99.0.1`, the address the VM
//! runner gives rxe0's netdev).

use std::net::IpAddr;

use hal_verbs::Provider;
use hal_verbs::rdma::{RdmaContext, RdmaProvider};

use crate::{init_tracing, skip};

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
