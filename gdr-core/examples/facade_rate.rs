//! The public API's request rate on the simulator, for comparison with the
//! Python package's (`gdr-py/bench/compare.sh` runs both back to back):
//! two engines of this process's simulated fabric, a 1 MiB host region
//! granted, and batches WRITEd one after another, each waited for.
//!
//! `cargo run --release -p gdr-core --features sim --example facade_rate -- [seconds]`
//! prints one line per shape: `rust <shape> <batches/s> <requests/s> <us per batch>`.

use std::time::{Duration, Instant};

use gdr_core::prelude::*;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let seconds: f64 = std::env::args().nth(1).map_or(Ok(2.0), |s| s.parse())?;
    let wait = Duration::from_secs(10);
    let server_context = Context::open(BackendChoice::Sim)?;
    let server = server_context.engine(EngineConfig::default())?;
    let client_context = Context::open(BackendChoice::Sim)?;
    let client = client_context.engine(EngineConfig::default())?;
    let listener = server.listen((server.nic_address(&server.nics()[0])?, 0).into())?;
    let addr = listener.local_addr();
    let accepting = std::thread::spawn(move || listener.accept(wait));
    let to_server = client.connect(addr, wait)?;
    let to_client = accepting.join().expect("accept thread")?;
    const LEN: u64 = 1 << 20;
    let target = server_context.alloc_host(LEN)?;
    let grant = to_client.grant(&server.register(&target)?, 0, LEN, GrantRights::Write)?;
    let remote = to_server.wait_grant(grant.id(), wait)?;
    let source = client.register(&client_context.alloc_host(LEN)?)?;
    for (shape, count, size) in [
        ("1x4KiB", 1u64, 4096u64),
        ("64x4KiB", 64, 4096),
        ("1024x64B", 1024, 64),
    ] {
        let transfers: Vec<Transfer<'_>> = (0..count)
            .map(|i| Transfer::write(&source, i * size, &remote, (count - 1 - i) * size, size))
            .collect();
        // Warm up, then as many batches as fit the time.
        for _ in 0..100 {
            to_server.submit(&transfers)?.wait(wait)?;
        }
        let started = Instant::now();
        let mut batches = 0u64;
        while started.elapsed().as_secs_f64() < seconds {
            to_server.submit(&transfers)?.wait(wait)?;
            batches += 1;
        }
        let elapsed = started.elapsed().as_secs_f64();
        println!(
            "rust {shape} {:.0} {:.0} {:.2}",
            batches as f64 / elapsed,
            (batches * count) as f64 / elapsed,
            elapsed * 1e6 / batches as f64
        );
    }
    Ok(())
}
