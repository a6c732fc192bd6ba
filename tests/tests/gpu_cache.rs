//! The registration cache and buffers against the real CUDA driver: a freed
//! allocation whose address `cuMemAlloc` hands out again is detected as
//! stale through `CU_POINTER_ATTRIBUTE_BUFFER_ID`, and buffers see the
//! memory types the driver reports. Skipped (with the reason printed) where
//! no GPU is found.

use std::sync::atomic::{AtomicU64, Ordering};

use gdr_core::buffer::Buffer;
use gdr_core::cache::{CacheConfig, Registrar, RegistrationCache, Request};
use gdr_tests::skip;
use hal_cuda::cuda::{CudaApi, CudaDriver};
use hal_cuda::{Context as _, DeviceMemory as _, Driver as _, MemoryType};

/// Stands in for a NIC: each registration is numbered.
#[derive(Default)]
struct NumberingRegistrar {
    registered: AtomicU64,
}

impl Registrar for NumberingRegistrar {
    type Registration = u64;
    type Error = std::io::Error;

    fn register(&self, _request: &Request) -> Result<u64, std::io::Error> {
        Ok(self.registered.fetch_add(1, Ordering::SeqCst) + 1)
    }
}

fn gpu(test: &str) -> Option<<CudaApi as hal_cuda::Api>::Context> {
    let driver = match CudaDriver::load().and_then(|d| d.device_count().map(|_| d)) {
        Ok(driver) => driver,
        Err(e) => {
            skip(test, &e.to_string());
            return None;
        }
    };
    Some(driver.context(0).expect("context of GPU 0"))
}

#[test]
fn reused_device_address_is_stale_not_a_hit() {
    let Some(ctx) = gpu("reused_device_address_is_stale_not_a_hit") else {
        return;
    };
    let cache = RegistrationCache::new(CacheConfig::default());
    let registrar = NumberingRegistrar::default();
    let len = 4 << 20;
    let first = ctx.alloc(len).unwrap();
    let addr = first.device_ptr();
    let attrs = ctx.pointer_attributes(addr).unwrap();
    let request = Request::from_attributes(1, &attrs, addr, len as u64).unwrap();
    let registration = *cache
        .get_or_register(&registrar, &request)
        .unwrap()
        .registration();
    let again = ctx.pointer_attributes(addr + 4096).unwrap();
    let inner = Request::from_attributes(1, &again, addr + 4096, 4096).unwrap();
    assert_eq!(
        *cache
            .get_or_register(&registrar, &inner)
            .unwrap()
            .registration(),
        registration,
        "a range inside the live allocation hits"
    );
    drop(first);

    // cuMemAlloc of the same size usually returns the freed address; keep
    // the misses alive so each try gets a fresh one.
    let mut others = Vec::new();
    let reused = loop {
        let next = ctx.alloc(len).unwrap();
        if next.device_ptr() == addr {
            break next;
        }
        assert!(others.len() < 8, "the driver never reused {addr:#x}");
        others.push(next);
    };
    let attrs = ctx.pointer_attributes(addr).unwrap();
    assert_ne!(attrs.buffer_id, request.identity.buffer_id().unwrap());
    let request = Request::from_attributes(1, &attrs, addr, len as u64).unwrap();
    let fresh = *cache
        .get_or_register(&registrar, &request)
        .unwrap()
        .registration();
    assert_ne!(
        fresh, registration,
        "the old registration is never returned"
    );
    let stats = cache.stats();
    assert_eq!(stats.stale_detections, 1, "{stats:?}");
    assert_eq!(stats.hits, 1, "{stats:?}");
    drop(reused);
}

#[test]
fn buffers_report_the_drivers_memory_types() {
    let Some(ctx) = gpu("buffers_report_the_drivers_memory_types") else {
        return;
    };
    let device = Buffer::<CudaApi>::alloc_device(&ctx, 1 << 20).unwrap();
    assert_eq!(device.memory_type(), MemoryType::Device);
    assert_eq!(device.device_ordinal(), Some(0));
    assert_ne!(device.buffer_id(), 0);
    assert!(device.host_ptr().is_none());

    let pinned = Buffer::<CudaApi>::alloc_pinned(&ctx, 1 << 20).unwrap();
    assert_eq!(pinned.memory_type(), MemoryType::PinnedHost);
    assert!(pinned.host_ptr().is_some());

    let heap = vec![0u8; 8192];
    // SAFETY: `heap` outlives the wrapping buffer.
    let wrapped =
        unsafe { Buffer::<CudaApi>::wrap(Some(&ctx), heap.as_ptr() as u64, 8192, None) }.unwrap();
    assert_eq!(wrapped.memory_type(), MemoryType::PageableHost);
    assert_eq!(wrapped.buffer_id(), 0);
    drop(wrapped);

    let handle = ctx.ipc_export(device.addr()).unwrap();
    assert!(
        Buffer::<CudaApi>::import_ipc(&ctx, &handle).is_err(),
        "CUDA refuses to open a handle in the process that exported it"
    );
}
