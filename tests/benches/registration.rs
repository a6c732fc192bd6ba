//! A registration-cache hit against a real `ibv_reg_mr` + `ibv_dereg_mr` of
//! the same 1 MiB host buffer, in one run. On SoftRoCE (run it in the VM:
//! `softroce/run-in-vm.sh`, or `scripts/bench-registration.sh`) the NIC is the
//! kernel's rxe; elsewhere the first RDMA device found; without one, the
//! simulated NIC (said on stderr), whose registration is only bookkeeping.

use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use gdr_core::buffer::Buffer;
use gdr_core::cache::{Bounds, CacheConfig, RegistrationCache, Request};
use gdr_core::ladder::{DmabufExports, Ladder, LadderConfig};
use gdr_sim::{NodeConfig, SimFabric};
use hal_verbs::rdma::{RdmaApi, RdmaProvider};
use hal_verbs::{AccessFlags, ProtectionDomain, Provider};

const LEN: usize = 1 << 20;

fn bench_on(c: &mut Criterion, provider: &hal_verbs::dynamic::DynProvider) {
    let device = provider.devices().expect("devices")[0].name.clone();
    let ctx = provider.open(&device).expect("open");
    let ladder = Ladder::new(
        &ctx,
        Vec::new(),
        Arc::new(RegistrationCache::new(CacheConfig::default())),
        Arc::new(DmabufExports::new()),
        LadderConfig::default().with_self_check(false),
    )
    .expect("ladder");
    let buffer = Buffer::alloc_host(LEN as u64);
    let mut group = c.benchmark_group(format!("register_1MiB/{device}"));
    group.bench_function("ibv_reg_mr+dereg", |b| {
        b.iter(|| {
            // SAFETY: `buffer` outlives the region, dropped at once.
            let mr = unsafe {
                ladder
                    .pd()
                    .register(buffer.addr(), LEN, AccessFlags::transfer())
            }
            .expect("ibv_reg_mr");
            drop(mr);
        })
    });
    let first = buffer.register(&ladder, 0, LEN as u64).expect("register");
    // The whole path a caller takes: pointer attributes, the cache, the
    // registration record.
    group.bench_function("buffer_register_hit", |b| {
        b.iter(|| buffer.register(&ladder, 0, LEN as u64).expect("hit"))
    });
    // The cache lookup alone.
    let request = Request::host(ladder.domain(), buffer.addr(), LEN as u64)
        .within(buffer.owner(), Bounds::new(buffer.addr(), LEN as u64));
    group.bench_function("cache_get", |b| {
        b.iter(|| ladder.cache().get(&request).expect("cached"))
    });
    drop(first);
    group.finish();
}

fn registration(c: &mut Criterion) {
    match RdmaProvider::load().and_then(|p| p.devices().map(|_| p)) {
        Ok(provider) => bench_on(
            c,
            &hal_verbs::dynamic::DynProvider::new::<RdmaApi>(provider),
        ),
        Err(e) => {
            eprintln!("no RDMA device ({e}): measuring the simulated NIC");
            let node = SimFabric::new().add_node("bench", NodeConfig::default());
            bench_on(c, &node.erased());
        }
    }
}

criterion_group!(benches, registration);
criterion_main!(benches);
