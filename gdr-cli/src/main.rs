//! `gdr`: what this machine can do, and transfers that prove it.
//!
//! `gdr info` lists the RDMA devices and GPUs found through the real backends
//! (rdma-core and the CUDA driver, both loaded at run time). `gdr loopback`
//! proves the data path: a loopback RDMA WRITE and READ through host memory,
//! then through GPU memory on the first registration rung that works
//! (dma-buf, then nvidia-peermem), each checked byte for byte. Where no
//! hardware is found, both say so and run on the simulation backend.

use std::error::Error;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, Subcommand, ValueEnum};
use gdr_core::backend::{BackendChoice, BackendTask, Backends, run_with};
use gdr_core::buffer::Buffer;
use gdr_core::cache::{CacheConfig, RegistrationCache};
use gdr_core::ladder::{DmabufExports, Gpu, Ladder, LadderConfig};
use hal_cuda::Driver as _;
use hal_verbs::{AddressFamily, Context as _, Provider as _};

mod bench;

#[derive(Debug, Parser)]
#[command(name = "gdr", version, about = "GPU-aware RDMA data movement")]
struct Cli {
    /// Which backends to use: real hardware when found (auto), only real, or
    /// only the simulation.
    #[arg(long, value_enum, default_value_t = Backend::Auto, global = true)]
    backend: Backend,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    Auto,
    Real,
    Sim,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List RDMA devices and GPUs and what they can do.
    Info,
    /// Prove the data path with loopback RDMA through host and GPU memory.
    Loopback {
        /// Bytes per transfer (suffixes K, M, G: powers of 1024).
        #[arg(long, default_value = "1M", value_parser = parse_size)]
        size: usize,
    },
    /// Measure throughput (see `gdr bench rdma --help`).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn parse_size(text: &str) -> Result<usize, String> {
    let (digits, shift) = match text.trim_end_matches(['i', 'B']).chars().last() {
        Some('K' | 'k') => (&text[..text.find(['K', 'k']).unwrap_or(0)], 10),
        Some('M' | 'm') => (&text[..text.find(['M', 'm']).unwrap_or(0)], 20),
        Some('G' | 'g') => (&text[..text.find(['G', 'g']).unwrap_or(0)], 30),
        _ => (text, 0),
    };
    let value: usize = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a size"))?;
    value
        .checked_shl(shift)
        .filter(|v| *v > 0 && v >> shift == value)
        .ok_or_else(|| format!("{text:?} is out of range"))
}

fn print_verbs<A: hal_verbs::Api>(provider: &A::Provider) -> Result<(), Box<dyn Error>> {
    println!("RDMA ({}):", provider.backend_name());
    for device in provider.devices()? {
        let ctx = provider.open(&device.name)?;
        let attrs = ctx.query_device()?;
        println!(
            "  {}  PCI {}  fw {}  vendor {:#06x}:{:#x}  ports {}  max MR {} GiB  max QP WR {}",
            device.name,
            device
                .pci_bus_id
                .as_deref()
                .unwrap_or("none (software device)"),
            attrs.fw_ver,
            attrs.vendor_id,
            attrs.vendor_part_id,
            attrs.phys_port_cnt,
            attrs.max_mr_size >> 30,
            attrs.max_qp_wr
        );
        for port in 1..=attrs.phys_port_cnt {
            let p = ctx.query_port(port)?;
            let table = ctx.gid_table(port)?;
            let gid = hal_verbs::select_roce_v2_gid(&table, AddressFamily::V4).map_or_else(
                || "none".to_owned(),
                |g| format!("{} (index {})", g.gid.to_ip(), g.index),
            );
            println!(
                "    port {port}: {:?}, {:?}, MTU {} (max {}), RoCE v2 GID {gid}",
                p.state,
                p.link_layer,
                p.active_mtu.bytes(),
                p.max_mtu.bytes()
            );
        }
    }
    Ok(())
}

fn print_cuda<A: hal_cuda::Api>(driver: &A::Driver) -> Result<(), Box<dyn Error>> {
    println!("GPUs ({}):", driver.backend_name());
    for ordinal in 0..driver.device_count()? {
        let a = driver.device_attributes(ordinal)?;
        println!(
            "  {ordinal}: {}  {}  {} GiB  sm_{}{}",
            a.name,
            a.pci_bus_id,
            a.total_memory >> 30,
            a.compute_capability.0,
            a.compute_capability.1
        );
        println!(
            "     dma-buf {}  GPUDirect RDMA {}  writes ordering {:?}  flush options {:?}",
            a.dma_buf_supported,
            a.gpu_direct_rdma_supported,
            a.writes_ordering,
            a.flush_writes_options
        );
    }
    Ok(())
}

/// `gdr info`: the RDMA devices and GPUs, then which GPU registration rungs
/// each NIC can take.
fn info<V: hal_verbs::Api, C: hal_cuda::Api>(
    backends: &Backends<V, C>,
) -> Result<(), Box<dyn Error>> {
    print_verbs::<V>(backends.verbs())?;
    if let Some(driver) = backends.cuda() {
        print_cuda::<C>(driver)?;
    }
    // Which GPU rungs each NIC can take, probed with a loopback self-check;
    // only where the NIC can reach the GPU's memory.
    match backends.registrable_cuda() {
        Some(driver) => print_rungs::<V, C>(backends.verbs(), driver),
        None => {
            println!("GPU registration rungs: not probed (no GPU memory this NIC can reach)");
            Ok(())
        }
    }
}

fn print_rungs<V: hal_verbs::Api, C: hal_cuda::Api>(
    provider: &V::Provider,
    driver: &C::Driver,
) -> Result<(), Box<dyn Error>> {
    println!("GPU registration rungs (probed, loopback self-check):");
    for device in provider.devices()? {
        let ctx = provider.open(&device.name)?;
        let gpus = (0..driver.device_count()?)
            .map(|ordinal| Gpu::<C>::open(driver, ordinal))
            .collect::<Result<Vec<_>, _>>()?;
        let ladder = Ladder::<V, C>::new(
            &ctx,
            gpus,
            Arc::new(RegistrationCache::new(CacheConfig::default())),
            Arc::new(DmabufExports::new()),
            LadderConfig::default(),
        );
        let ladder = match ladder {
            Ok(ladder) => ladder,
            Err(e) => {
                println!("  {}: {e}", device.name);
                continue;
            }
        };
        for (ordinal, rung, verdict) in ladder.probe_all() {
            match verdict {
                Ok(()) => println!("  {} x GPU {ordinal}: {rung:?} works", device.name),
                Err(refusal) => {
                    println!("  {} x GPU {ordinal}: {rung:?} no: {refusal}", device.name)
                }
            }
        }
    }
    Ok(())
}

/// Registers a host buffer and a GPU buffer through the registration
/// ladder, reports the rung each took and why every higher rung was not, and
/// proves each MR with a loopback WRITE and READ.
fn prove<V: hal_verbs::Api, C: hal_cuda::Api>(
    provider: &V::Provider,
    cuda: Option<&C::Driver>,
    size: usize,
) -> Result<(), Box<dyn Error>> {
    let device = provider
        .devices()?
        .into_iter()
        .next()
        .ok_or("no RDMA device")?;
    let ctx = provider.open(&device.name)?;
    let gpus = match cuda {
        Some(driver) => vec![Gpu::<C>::open(driver, 0)?],
        None => Vec::new(),
    };
    let gpu_context = match cuda {
        Some(driver) => Some(driver.context(0)?),
        None => None,
    };
    let cache = Arc::new(RegistrationCache::new(CacheConfig::default()));
    let ladder = Ladder::<V, C>::new(
        &ctx,
        gpus,
        cache,
        Arc::new(DmabufExports::new()),
        LadderConfig::default(),
    )?;
    println!(
        "loopback on {} ({}), {size} bytes:",
        device.name,
        provider.backend_name()
    );

    let host = Buffer::<C>::alloc_host(size as u64);
    report("host memory", &ladder, &host, size)?;
    match &gpu_context {
        Some(gpu) => {
            let device_buffer = Buffer::<C>::alloc_device(gpu, size as u64)?;
            report("GPU memory", &ladder, &device_buffer, size)?;
        }
        None => println!("  GPU memory: no GPU beside this NIC"),
    }
    let stats = ladder.cache().stats();
    println!(
        "  registration cache: {} entries, {} hits, {} misses",
        stats.entries, stats.hits, stats.misses
    );
    Ok(())
}

fn report<V: hal_verbs::Api, C: hal_cuda::Api>(
    what: &str,
    ladder: &Ladder<V, C>,
    buffer: &Buffer<C>,
    size: usize,
) -> Result<(), Box<dyn Error>> {
    let registration = buffer.register(ladder, 0, size as u64)?;
    println!("  {what}: {:?} rung", registration.rung());
    for failure in registration.failures() {
        println!("    not {failure}");
    }
    if registration.mr().is_some() {
        let started = Instant::now();
        ladder.prove(&registration, size as u64)?;
        println!(
            "    WRITE + READ of {size} bytes verified in {:.1} ms",
            started.elapsed().as_secs_f64() * 1e3
        );
    } else {
        println!("    transfers of it would go through pinned host staging buffers");
    }
    Ok(())
}

/// `gdr loopback`: host memory, then GPU memory where the NIC reaches it.
fn loopback<V: hal_verbs::Api, C: hal_cuda::Api>(
    backends: &Backends<V, C>,
    size: usize,
) -> Result<(), Box<dyn Error>> {
    prove::<V, C>(backends.verbs(), backends.registrable_cuda(), size)
}

/// A command, run on whichever backends `--backend` leads to: each command
/// is one generic function, compiled for every combination.
struct Run(Command);

impl BackendTask for Run {
    type Output = Result<(), Box<dyn Error>>;

    fn run<V: hal_verbs::Api, C: hal_cuda::Api>(self, backends: Backends<V, C>) -> Self::Output {
        for note in backends.notes() {
            println!("{note}");
        }
        match self.0 {
            Command::Info => info(&backends),
            Command::Loopback { size } => loopback(&backends, size),
            Command::Bench(what) => bench::run(&backends, what),
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let choice = match cli.backend {
        Backend::Auto => BackendChoice::Auto,
        Backend::Real => BackendChoice::Real,
        Backend::Sim => BackendChoice::Sim,
    };
    let result = run_with(choice, Run(cli.command)).unwrap_or_else(|e| Err(e.into()));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gdr: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_binary_suffixes_and_reject_garbage() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert!(parse_size("0").is_err());
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }
}
