//! The registration cache and buffers against the real CUDA driver: a
//! device address whose physical memory was replaced (unmapped, and another
//! allocation mapped at the same address with the VMM API) is detected as
//! stale through `CU_POINTER_ATTRIBUTE_BUFFER_ID`, and buffers see the
//! memory types the driver reports. Skipped (with the reason printed) where
//! no GPU is found; a failure instead with `GDR_EXPECT_GPU=1`. Passed 20
//! runs in a row on the H200 (driver 580), both tests in parallel (buffer
//! ids seen: 907 → 909, 907 → 911, 909 → 911).

use std::sync::atomic::{AtomicU64, Ordering};

use gdr_core::buffer::Buffer;
use gdr_core::cache::{CacheConfig, Registrar, RegistrationCache, Request};
use gdr_tests::skip_gpu;
use hal_cuda::cuda::CudaApi;
use hal_cuda::{
    Context as _, Driver as _, MemoryType, VirtualMapping as _, VirtualReservation as _,
};

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
    gdr_tests::cuda_gpu(test).map(|(_driver, ctx)| ctx)
}

/// [`gpu`] through the erased driver, as the engine's buffers hold it.
fn erased_gpu(test: &str) -> Option<hal_cuda::dynamic::DynContext> {
    gdr_tests::cuda_gpu(test).map(|(driver, _ctx)| {
        hal_cuda::dynamic::DynDriver::new::<CudaApi>(driver)
            .context(0)
            .unwrap()
    })
}

/// A stale entry is detected deterministically: physical allocation A is
/// mapped in a reserved range and registered, then unmapped, and allocation
/// B is mapped at the very same address. The driver gives the range a new
/// buffer id (907 → 909 measured on the H200), so the cache must not hand
/// out A's registration for B. (The previous version of this test waited for
/// `cuMemAlloc` to reuse a freed address, which it did not always do while
/// other tests allocated in parallel.)
#[test]
fn remapped_device_address_is_stale_not_a_hit() {
    let name = "remapped_device_address_is_stale_not_a_hit";
    let Some(ctx) = gpu(name) else {
        return;
    };
    let g = match ctx.vmm_granularity() {
        Ok(g) => g,
        Err(e) => {
            skip_gpu(name, &format!("no CUDA VMM: {e}"));
            return;
        }
    };
    let len = 2 * g;
    let cache = RegistrationCache::new(CacheConfig::default());
    let registrar = NumberingRegistrar::default();
    let reservation = ctx.reserve_address_range(len).unwrap();
    let addr = reservation.base();

    let a = ctx.create_physical(len).unwrap();
    let first = ctx.map(&reservation, 0, &a).unwrap();
    let attrs = ctx.pointer_attributes(addr).unwrap();
    assert_eq!(attrs.memory_type, MemoryType::Device);
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
        "a range inside the live mapping hits"
    );

    drop(first);
    drop(a);
    let b = ctx.create_physical(len).unwrap();
    let second = ctx.map(&reservation, 0, &b).unwrap();
    assert_eq!(second.device_ptr(), addr, "B lies exactly where A was");
    let attrs = ctx.pointer_attributes(addr).unwrap();
    eprintln!(
        "buffer id {} -> {} at {addr:#x}",
        request.identity.buffer_id().unwrap(),
        attrs.buffer_id
    );
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
    assert_eq!(registrar.registered.load(Ordering::SeqCst), 2);
    drop(second);
}

#[test]
fn buffers_report_the_drivers_memory_types() {
    let Some(ctx) = erased_gpu("buffers_report_the_drivers_memory_types") else {
        return;
    };
    let device = Buffer::alloc_device(&ctx, 1 << 20).unwrap();
    assert_eq!(device.memory_type(), MemoryType::Device);
    assert_eq!(device.device_ordinal(), Some(0));
    assert_ne!(device.buffer_id(), 0);
    assert!(device.host_ptr().is_none());

    let pinned = Buffer::alloc_pinned(&ctx, 1 << 20).unwrap();
    assert_eq!(pinned.memory_type(), MemoryType::PinnedHost);
    assert!(pinned.host_ptr().is_some());

    let heap = vec![0u8; 8192];
    // SAFETY: `heap` outlives the wrapping buffer.
    let wrapped = unsafe { Buffer::wrap(Some(&ctx), heap.as_ptr() as u64, 8192, None) }.unwrap();
    assert_eq!(wrapped.memory_type(), MemoryType::PageableHost);
    assert_eq!(wrapped.buffer_id(), 0);
    drop(wrapped);

    let handle = ctx.ipc_export(device.addr()).unwrap();
    assert!(
        Buffer::import_ipc(&ctx, &handle).is_err(),
        "CUDA refuses to open a handle in the process that exported it"
    );
}
