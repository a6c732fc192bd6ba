//! `gdr`: what this machine can do, and transfers that prove it.
//!
//! `gdr info` is the doctor: what this machine has (rdma-core, the CUDA
//! driver, NVIDIA kernel modules, RDMA devices and GPUs, PCIe distances,
//! memlock), which registration rung each (GPU, NIC) pair takes and why,
//! and what to do about each "no" (`--json` for machines). `gdr uri`
//! decodes a `gdr://` URI or a memory descriptor and says what it grants.
//! `gdr loopback`
//! proves the data path through the transfer engine: two engines in this
//! process connected over rdma_cm, an RDMA WRITE and a READ back through
//! host memory, then through GPU memory on the first registration rung that
//! works (dma-buf, then nvidia-peermem), each checked byte for byte. Where
//! no hardware is found, both say so and run on the simulation backend.

use std::error::Error;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use gdr_core::Rung;
use gdr_core::backend::BackendChoice;
use gdr_core::{Buffer, Context, Engine, EngineConfig, GrantRights, Peer, Transfer};

mod decode;
mod info;

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
    /// The doctor: what this machine has, which GPU registration rung each
    /// (GPU, NIC) pair takes and why, and what to do about each "no".
    Info {
        /// The report as JSON, for machines.
        #[arg(long)]
        json: bool,
    },
    /// Decode a gdr:// buffer URI or a memory descriptor (text form
    /// `gdr-md:v2:...`, or the binary form as hex with --hex) and say what
    /// it grants.
    Uri {
        /// The URI or descriptor.
        text: String,
        /// TEXT is a binary descriptor written as hex digits.
        #[arg(long)]
        hex: bool,
    },
    /// Prove the data path: two transfer engines in this process, RDMA
    /// WRITE and READ back through host and then GPU memory.
    Loopback {
        /// Bytes per transfer (suffixes K, M, G: powers of 1024).
        #[arg(long, default_value = "1M", value_parser = gdr_bench::parse_size)]
        size: usize,
    },
    /// Measure throughput, latency, the cost of waiting, scaling with
    /// threads and isolation between peers (see `gdr bench rdma --help`,
    /// `gdr bench engine --help`, `gdr bench idle --help`, `gdr bench scale
    /// --help`, `gdr bench isolation --help`).
    #[command(subcommand)]
    Bench(gdr_bench::BenchCommand),
}

/// Bound on connecting, granting and each transfer of `gdr loopback`:
/// generous, for a software NIC under software emulation.
const LOOPBACK_TIMEOUT: Duration = Duration::from_secs(60);

/// `gdr loopback`: two transfer engines of one context, connected over
/// rdma_cm (one listening on its first NIC's own address, the other
/// connecting). For host memory, then GPU memory where there is a GPU:
/// the connecting engine WRITEs a pattern into a buffer the other granted
/// it, then READs it back into a third buffer; each buffer registered on
/// the first rung of the ladder that works (reported, with why each higher
/// one did not), both results checked byte for byte.
fn loopback(context: &Context, size: usize) -> Result<(), Box<dyn Error>> {
    let config = EngineConfig::default().with_default_timeout(LOOPBACK_TIMEOUT);
    let qps = config.qps_per_peer;
    let server = context.engine(config.clone())?;
    let client = context.engine(config)?;
    let device = server.nics().into_iter().next().ok_or("no RDMA device")?;
    let listener = server.listen((server.nic_address(&device)?, 0).into())?;
    let addr = listener.local_addr();
    let accepting = std::thread::spawn(move || listener.accept(LOOPBACK_TIMEOUT));
    let to_server = client.connect(addr, LOOPBACK_TIMEOUT)?;
    let to_client = accepting
        .join()
        .map_err(|_| "the accepting thread panicked")??;
    println!(
        "loopback on {device} ({}), {size} bytes: two transfer engines over rdma_cm, one \
         listening on {addr}, {qps} queue pairs",
        context.verbs_backend(),
    );
    let pair = Pair {
        context: context.clone(),
        server,
        client,
        to_server,
        to_client,
    };
    prove_kind(&pair, None, size)?;
    if context.gpu_count() == 0 {
        println!("  GPU memory: no GPU beside this NIC");
    } else {
        if !context.nic_reaches_gpu() {
            println!(
                "  GPU memory: this NIC cannot register it (a simulated NIC beside a real GPU): \
                 staged through pinned host memory"
            );
        }
        prove_kind(&pair, Some(0), size)?;
    }
    for (who, engine) in [("connecting", &pair.client), ("listening", &pair.server)] {
        if let Some(stats) = engine.cache_stats(0) {
            println!(
                "  registration cache ({who} engine): {} entries, {} hits, {} misses",
                stats.entries, stats.hits, stats.misses
            );
        }
    }
    Ok(())
}

/// Two connected engines of one context.
struct Pair {
    /// The engines' context: their buffers.
    context: Context,
    server: Engine,
    client: Engine,
    /// The client's peer: the server.
    to_server: Peer,
    /// The server's peer: the client.
    to_client: Peer,
}

/// A pattern of `len` bytes, different for each `seed`.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i % 251) as u8 ^ seed.wrapping_mul(37))
        .collect()
}

/// A buffer of `context` holding `bytes`: GPU memory of `gpu`, else host
/// memory.
fn filled(context: &Context, gpu: Option<u32>, bytes: &[u8]) -> Result<Buffer, Box<dyn Error>> {
    let len = bytes.len() as u64;
    let buffer = match gpu {
        Some(gpu) => context.alloc_device(gpu, len)?,
        None => context.alloc_host(len)?,
    };
    buffer.copy_from_host(0, bytes)?;
    Ok(buffer)
}

/// `d` in milliseconds, with three significant digits down to a microsecond.
fn millis(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    match ms {
        m if m >= 100.0 => format!("{m:.0} ms"),
        m if m >= 10.0 => format!("{m:.1} ms"),
        m if m >= 1.0 => format!("{m:.2} ms"),
        m => format!("{m:.3} ms"),
    }
}

/// Checks `got` against `want`, naming the first differing byte.
fn verify(what: &str, got: &[u8], want: &[u8]) -> Result<(), Box<dyn Error>> {
    match got.iter().zip(want).position(|(g, w)| g != w) {
        None if got.len() == want.len() => Ok(()),
        None => Err(format!("{what}: {} bytes, {} expected", got.len(), want.len()).into()),
        Some(at) => Err(format!(
            "{what}: byte {at} is {:#04x}, {:#04x} expected",
            got[at], want[at]
        )
        .into()),
    }
}

/// One memory kind (GPU memory of `gpu`, else host memory) through the
/// engines: a source and a read-back buffer on the connecting engine, a
/// granted target on the listening one.
fn prove_kind(pair: &Pair, gpu: Option<u32>, size: usize) -> Result<(), Box<dyn Error>> {
    let what = if gpu.is_some() {
        "GPU memory"
    } else {
        "host memory"
    };
    let len = size as u64;
    let data = pattern(size, u8::from(gpu.is_some()) + 1);
    let zeros = vec![0u8; size];
    let source = filled(&pair.context, gpu, &data)?;
    let target = filled(&pair.context, gpu, &zeros)?;
    let back = filled(&pair.context, gpu, &zeros)?;
    let source_region = pair.client.register(&source)?;
    let target_region = pair.server.register(&target)?;
    let back_region = pair.client.register(&back)?;

    let rung = source_region.rungs().first().copied().ok_or("no NIC")?;
    let target_rung = target_region.rungs().first().copied().ok_or("no NIC")?;
    if target_rung == rung {
        println!("  {what}: {rung:?} rung");
    } else {
        println!("  {what}: {rung:?} rung (the listening engine's buffer: {target_rung:?})");
    }
    for failure in source_region.rung_failures(0) {
        println!("    not {failure}");
    }
    if [rung, target_rung].contains(&Rung::Staging) {
        println!("    staged: moved through pinned host staging buffers by the engine");
    }

    let grant = pair
        .to_client
        .grant(&target_region, 0, len, GrantRights::ReadWrite)?;
    let remote = pair.to_server.wait_grant(grant.id(), LOOPBACK_TIMEOUT)?;
    let started = Instant::now();
    pair.to_server
        .submit(&[Transfer::write(&source_region, 0, &remote, 0, len)])?
        .wait(LOOPBACK_TIMEOUT)
        .map_err(|e| format!("WRITE of {what}: {e}"))?;
    let wrote = started.elapsed();
    // The peer's WRITE is complete: fence it for the GPU before reading.
    pair.server.fence_inbound_writes(&target_region)?;
    verify(&format!("{what} after the WRITE"), &target.to_vec()?, &data)?;
    let started = Instant::now();
    pair.to_server
        .submit(&[Transfer::read(&back_region, 0, &remote, 0, len)])?
        .wait(LOOPBACK_TIMEOUT)
        .map_err(|e| format!("READ of {what}: {e}"))?;
    let read = started.elapsed();
    verify(&format!("{what} read back"), &back.to_vec()?, &data)?;
    println!(
        "    WRITE of {size} bytes in {}, READ back in {}, both verified byte for byte",
        millis(wrote),
        millis(read)
    );
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            // The backends' fallback warning is the library's: the command
            // prints its notes itself.
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,gdr_core::backend=error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let choice = match cli.backend {
        Backend::Auto => BackendChoice::Auto,
        Backend::Real => BackendChoice::Real,
        Backend::Sim => BackendChoice::Sim,
    };
    let result = match cli.command {
        Command::Info { json } => info::print(choice, json),
        Command::Uri { text, hex } => {
            decode::explain(&text, hex).map(|explained| print!("{explained}"))
        }
        Command::Loopback { size } => Context::open(choice)
            .map_err(Box::<dyn Error>::from)
            .and_then(|context| {
                for note in context.notes() {
                    println!("{note}");
                }
                loopback(&context, size)
            }),
        Command::Bench(what) => gdr_bench::run(choice, what),
    };
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
    use super::loopback;
    use gdr_bench::parse_size;
    use gdr_core::sim::{GpuConfig, NodeConfig};
    use gdr_core::{BackendChoice, Context};

    /// The loopback through two engines on the sim: GPU memory on each
    /// rung the simulated GPU leads to (dma-buf, peermem, staging), and
    /// without a GPU.
    #[test]
    fn loopback_runs_on_every_simulated_rung() {
        loopback(&Context::open(BackendChoice::Sim).unwrap(), 1 << 20).unwrap();
        for gpu in [
            GpuConfig {
                dma_buf_supported: false,
                peermem: true,
                ..GpuConfig::default()
            },
            GpuConfig {
                dma_buf_supported: false,
                peermem: false,
                ..GpuConfig::default()
            },
        ] {
            let context = Context::sim(NodeConfig::default(), vec![gpu]).unwrap();
            loopback(&context, 3 << 10).unwrap();
        }
        let context = Context::sim(NodeConfig::default(), Vec::new()).unwrap();
        loopback(&context, 4096).unwrap();
    }

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
