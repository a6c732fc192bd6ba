//! Staging bandwidth: pinned host <-> device copies through the real backend
//! (`CudaStream::copy_*` queued on a non-blocking stream, one synchronize per
//! sample) against the "cudaMemcpy ceiling" (a plain synchronous
//! `cuMemcpyHtoD` / `cuMemcpyDtoH` loop, `CudaContext::copy_*_sync`),
//! and the same for pageable host memory for contrast.
//!
//! `cargo bench -p hal-cuda --bench copy_bandwidth` (cargo passes `--bench`;
//! run the built binary directly with `--bench` too). Without a GPU it prints
//! `SKIPPED` and exits 0. `--quick` takes one small sample per cell.
//!
//! Measured on the project's H200 (PCIe, driver 580), GB/s:
//!
//! ```text
//! size     dir     pinned ours  pinned memcpy   ratio  pageable ours pageable memcpy
//! 64 KiB   H2D           17.35           6.76    2.57           8.34           4.09
//! 64 KiB   D2H           20.56           8.57    2.40           3.69           3.85
//! 1 MiB    H2D           47.93          38.87    1.23          17.71          12.30
//! 1 MiB    D2H           50.41          40.48    1.25           9.24           9.37
//! 16 MiB   H2D           54.89          53.99    1.02          15.31          14.90
//! 16 MiB   D2H           55.05          54.13    1.02          10.38          12.60
//! 256 MiB  H2D           55.33          55.34    1.00           8.94           8.34
//! 256 MiB  D2H           55.29          55.25    1.00          16.06          15.33
//! ```
//!
//! Small copies gain from queueing (no host round trip per copy); from
//! 16 MiB both reach the PCIe ceiling.

use std::time::Instant;

use hal_cuda::cuda::{CudaContext, CudaDriver, CudaStream};
use hal_cuda::{Context, DeviceMemory, Driver, PinnedHostMemory, Result, Stream};

const SIZES: [(usize, &str); 4] = [
    (64 << 10, "64 KiB"),
    (1 << 20, "1 MiB"),
    (16 << 20, "16 MiB"),
    (256 << 20, "256 MiB"),
];

#[derive(Clone, Copy, PartialEq)]
enum Dir {
    HostToDevice,
    DeviceToHost,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::HostToDevice => "H2D",
            Dir::DeviceToHost => "D2H",
        }
    }
}

struct Config {
    samples: usize,
    bytes_per_sample: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// GB/s (1e9 bytes a second) of `run`, which moves `bytes` per call; the
/// median of `samples` calls after one warm-up.
fn measure(cfg: &Config, bytes: usize, mut run: impl FnMut() -> Result<()>) -> Result<f64> {
    run()?;
    let mut rates = Vec::with_capacity(cfg.samples);
    for _ in 0..cfg.samples {
        let t = Instant::now();
        run()?;
        rates.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(median(rates))
}

/// Ours: `iters` copies queued on the stream, then one synchronize.
fn ours(
    stream: &CudaStream,
    dir: Dir,
    dev: u64,
    host: *mut u8,
    size: usize,
    iters: usize,
) -> Result<()> {
    for _ in 0..iters {
        // SAFETY: `host` and `dev` hold `size` bytes each and outlive the
        // synchronize below; nobody else touches them meanwhile.
        unsafe {
            match dir {
                Dir::HostToDevice => stream.copy_host_to_device(dev, host, size)?,
                Dir::DeviceToHost => stream.copy_device_to_host(host, dev, size)?,
            }
        }
    }
    stream.synchronize()
}

/// Baseline: synchronous cuMemcpyHtoD / cuMemcpyDtoH, one call each, then a
/// context synchronize.
fn baseline(
    ctx: &CudaContext,
    dir: Dir,
    dev: u64,
    host: *mut u8,
    size: usize,
    iters: usize,
) -> Result<()> {
    for _ in 0..iters {
        // SAFETY: as in `ours`; the copy is synchronous, and `dev` belongs
        // to `ctx`.
        unsafe {
            match dir {
                Dir::HostToDevice => ctx.copy_host_to_device_sync(dev, host, size)?,
                Dir::DeviceToHost => ctx.copy_device_to_host_sync(host, dev, size)?,
            }
        }
    }
    ctx.synchronize()
}

fn run(ctx: &CudaContext, cfg: &Config, pageable: bool) -> Result<()> {
    let stream = ctx.create_stream()?;
    println!(
        "{:<8} {:<4} {:>14} {:>14} {:>7} {:>14} {:>14}",
        "size", "dir", "pinned ours", "pinned memcpy", "ratio", "pageable ours", "pageable memcpy"
    );
    for (size, label) in SIZES {
        let iters = (cfg.bytes_per_sample / size).max(1);
        let bytes = iters * size;
        let dev = ctx.alloc(size)?;
        let pinned = ctx.alloc_pinned(size)?;
        // SAFETY: `pinned` holds `size` writable bytes that only we use.
        unsafe { std::ptr::write_bytes(pinned.as_ptr(), 0x5a, size) };
        let mut plain = vec![0xa5u8; size];
        for dir in [Dir::HostToDevice, Dir::DeviceToHost] {
            let d = dev.device_ptr();
            let p = pinned.as_ptr();
            let ours_pinned = measure(cfg, bytes, || ours(&stream, dir, d, p, size, iters))?;
            let base_pinned = measure(cfg, bytes, || baseline(ctx, dir, d, p, size, iters))?;
            let (ours_page, base_page) = if pageable {
                let h = plain.as_mut_ptr();
                let o = measure(cfg, bytes, || ours(&stream, dir, d, h, size, iters))?;
                let b = measure(cfg, bytes, || baseline(ctx, dir, d, h, size, iters))?;
                (format!("{o:.2}"), format!("{b:.2}"))
            } else {
                ("-".into(), "-".into())
            };
            println!(
                "{:<8} {:<4} {:>14.2} {:>14.2} {:>7.2} {:>14} {:>14}",
                label,
                dir.name(),
                ours_pinned,
                base_pinned,
                ours_pinned / base_pinned,
                ours_page,
                base_page
            );
        }
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("copy_bandwidth: a benchmark; run it with `cargo bench` or pass --bench");
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let pageable = !args.iter().any(|a| a == "--no-pageable");
    let cfg = if quick {
        Config {
            samples: 1,
            bytes_per_sample: 64 << 20,
        }
    } else {
        Config {
            samples: 5,
            bytes_per_sample: 1 << 30,
        }
    };
    let driver = match CudaDriver::load().and_then(|d| d.device_count().map(|_| d)) {
        Ok(d) => d,
        Err(e) if e.is_unsupported() => {
            println!("SKIPPED copy_bandwidth: {e}");
            return;
        }
        Err(e) => {
            eprintln!("copy_bandwidth: {e}");
            std::process::exit(1);
        }
    };
    let result = driver.device_attributes(0).and_then(|attrs| {
        println!(
            "copy bandwidth on {} ({}), GB/s = 1e9 B/s, median of {} samples of ~{} MiB each; \
             ratio = pinned ours / pinned memcpy",
            attrs.name,
            attrs.pci_bus_id,
            cfg.samples,
            cfg.bytes_per_sample >> 20
        );
        let ctx = driver.context(0)?;
        run(&ctx, &cfg, pageable)
    });
    if let Err(e) = result {
        eprintln!("copy_bandwidth failed: {e}");
        std::process::exit(1);
    }
}
