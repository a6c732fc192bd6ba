//! `gdr info`: the doctor. What this machine has (rdma-core, the CUDA
//! driver, the NVIDIA kernel modules, RDMA devices and GPUs, the PCIe tree,
//! the memlock limit), which GPU registration rung each (GPU, NIC) pair
//! takes and why, and for each "no" what to do about it.
//!
//! The report is gathered once into plain structs ([`Report`]), then
//! printed for people ([`write_human`]) or as JSON (`--json`). Host facts
//! are read from files under a root directory ([`HostFiles`], `/` on a real
//! system) so tests feed fake ones; nothing here fails: what cannot be read
//! is reported as unknown.

use std::fmt::Write as _;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use gdr_core::backend::{BackendChoice, BackendTask, Backends, run_with};
use gdr_core::engine::topology::{PciDistance, PciTopology};
use gdr_core::ladder::{Gpu, Ladder, Refusal, Rung};
use gdr_core::prelude::EngineConfig;
use hal_cuda::{Driver as _, FlushWritesOptions, WritesOrdering};
use hal_verbs::{AddressFamily, Context as _, GidType, Provider as _};
use serde::Serialize;

/// Linux's capability number of `CAP_IPC_LOCK`: with it, RLIMIT_MEMLOCK
/// does not bound what a process pins.
const CAP_IPC_LOCK: u32 = 14;

/// Everything `gdr info` found.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Report {
    /// The backends the device sections come from, and why.
    pub backends: BackendsUsed,
    /// The native libraries gdr loads at run time.
    pub libraries: Libraries,
    /// The NVIDIA kernel modules and the CUDA driver API version.
    pub nvidia: Nvidia,
    /// The running kernel's release (`uname -r`).
    pub kernel_release: Option<String>,
    /// RLIMIT_MEMLOCK and whether it lets registrations through.
    pub memlock: Memlock,
    /// RDMA devices, their ports and GIDs.
    pub rdma: RdmaSection,
    /// GPUs and the attributes GPUDirect RDMA depends on.
    pub gpus: GpuSection,
    /// How far each GPU is from each NIC on PCIe.
    pub topology: Topology,
    /// The rung each (NIC, GPU) pair takes.
    pub rungs: Rungs,
    /// What to do about each "no".
    pub hints: Vec<Hint>,
}

/// The backends in use.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct BackendsUsed {
    /// `--backend`: `auto`, `real` or `sim`.
    pub asked: String,
    /// The verbs backend (`rdma-core`, `sim`); `None` when none could be
    /// chosen.
    pub verbs: Option<String>,
    /// The CUDA backend (`cuda`, `sim`); `None` without a GPU.
    pub cuda: Option<String>,
    /// Why each backend is not the real one.
    pub notes: Vec<String>,
    /// Why `--backend` could not be met (`real` without rdma-core).
    pub error: Option<String>,
}

/// The native libraries.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Libraries {
    /// rdma-core's verbs library.
    pub libibverbs: Library,
    /// rdma-core's connection manager.
    pub librdmacm: Library,
    /// The CUDA driver.
    pub libcuda: Library,
}

/// One native library.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Library {
    /// The name it is loaded by (`libibverbs.so.1`).
    pub soname: String,
    /// Loaded and usable; `None` where not probed (`--backend sim`).
    pub found: Option<bool>,
    /// The file loaded (from `/proc/self/maps`).
    pub path: Option<String>,
    /// The file's version (`1.14.44.0`, `580.65.06`).
    pub version: Option<String>,
    /// The package the version says (`rdma-core 44`).
    pub package: Option<String>,
    /// Devices it lists where found (RDMA devices, GPUs); 0 with the
    /// reason in `detail` when it lists none.
    pub devices: Option<u32>,
    /// Why it was not found or not probed, or lists no device.
    pub detail: Option<String>,
}

/// The NVIDIA kernel side.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Nvidia {
    /// The `nvidia` kernel module, where it is loaded.
    pub kernel_module: Option<KernelModule>,
    /// `nvidia_peermem` (or Mellanox's older `nv_peer_mem`) is loaded.
    pub peermem_loaded: bool,
    /// Which of the two, where one is.
    pub peermem_module: Option<String>,
    /// `cuDriverGetVersion` as `major.minor` (`13.0`).
    pub cuda_version: Option<String>,
}

/// The `nvidia` kernel module.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct KernelModule {
    /// Its version (`580.65.06`), where it says one.
    pub version: Option<String>,
    /// The open kernel module (which dma-buf export needs); `None` where it
    /// does not say.
    pub open: Option<bool>,
}

/// A resource limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Limit {
    /// No limit.
    Unlimited,
    /// This many bytes.
    Bytes(u64),
}

/// What the memlock limit means for registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum MemlockVerdict {
    /// No limit.
    Unlimited,
    /// The process has CAP_IPC_LOCK: the limit is not enforced on it.
    NotEnforced,
    /// At least what the engine pins by default.
    Enough,
    /// Below what the engine pins by default: registrations will fail.
    TooLow,
    /// Could not be read.
    #[default]
    Unknown,
}

/// RLIMIT_MEMLOCK.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Memlock {
    /// The soft limit, which applies.
    pub soft: Option<Limit>,
    /// The hard limit, to which an unprivileged process may raise it.
    pub hard: Option<Limit>,
    /// The process has CAP_IPC_LOCK.
    pub cap_ipc_lock: bool,
    /// What an engine pins and registers by default (staging pool and
    /// landing slots of one GPU and one peer): less than this is too low.
    pub engine_needs: u64,
    /// What it means.
    pub verdict: MemlockVerdict,
}

/// The RDMA devices of the verbs backend.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct RdmaSection {
    /// The backend listing them (`rdma-core`, `sim`).
    pub backend: Option<String>,
    /// The devices.
    pub devices: Vec<RdmaDevice>,
    /// Why there is no list.
    pub error: Option<String>,
}

/// One RDMA device.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct RdmaDevice {
    /// Kernel name (`mlx5_0`).
    pub name: String,
    /// PCI bus id; `None` for a software device.
    pub pci_bus_id: Option<String>,
    /// Firmware version.
    pub firmware: Option<String>,
    /// PCI vendor and part ids (`0x02c9:0x1021`).
    pub vendor: Option<String>,
    /// The ports.
    pub ports: Vec<Port>,
    /// Why it could not be opened or queried.
    pub error: Option<String>,
}

/// One port of an RDMA device.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Port {
    /// 1-based.
    pub number: u8,
    /// `Active`, `Down`, ...
    pub state: String,
    /// Its state is Active.
    pub active: bool,
    /// `Ethernet` (RoCE) or `InfiniBand`.
    pub link_layer: String,
    /// MTU in use, bytes.
    pub active_mtu: u32,
    /// Largest MTU, bytes.
    pub max_mtu: u32,
    /// The non-zero GID table entries.
    pub gids: Vec<GidReport>,
    /// The GID index rdma_cm and gdr would use (first RoCE v2 IPv4).
    pub roce_v2_gid_index: Option<u32>,
    /// Why the port or its GIDs could not be read.
    pub error: Option<String>,
}

/// One GID table entry.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct GidReport {
    /// Table index.
    pub index: u32,
    /// The address it carries.
    pub address: String,
    /// `RoCE v2`, `RoCE v1` or `IB`.
    pub kind: String,
    /// RoCE v2 (routable; what gdr uses on Ethernet).
    pub roce_v2: bool,
}

/// The GPUs of the CUDA backend.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct GpuSection {
    /// The backend listing them (`cuda`, `sim`).
    pub backend: Option<String>,
    /// The GPUs.
    pub gpus: Vec<GpuReport>,
    /// Why there is no list.
    pub error: Option<String>,
}

/// One GPU.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct GpuReport {
    /// Ordinal.
    pub ordinal: u32,
    /// Marketing name.
    pub name: String,
    /// PCI bus id.
    pub pci_bus_id: String,
    /// Device memory, bytes.
    pub memory_bytes: u64,
    /// `major.minor`.
    pub compute_capability: String,
    /// Memory can be exported as a dma-buf.
    pub dma_buf: bool,
    /// GPUDirect RDMA supported.
    pub gpu_direct_rdma: bool,
    /// `cuFlushGPUDirectRDMAWrites` options: `host`, `memops`.
    pub flush_options: Vec<String>,
    /// Who sees inbound RDMA writes in order: `none`, `owner`,
    /// `all_devices`.
    pub writes_ordering: String,
    /// The virtual memory management API (cuMemCreate).
    pub vmm: bool,
    /// Why its attributes could not be read.
    pub error: Option<String>,
}

/// GPU↔NIC PCIe distances.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Topology {
    /// `/sys/devices` exists.
    pub sysfs_tree: bool,
    /// One entry per (GPU, NIC).
    pub pairs: Vec<Distance>,
    /// Whether gdr prefers some NIC for some GPU; the note says why not.
    pub preference: bool,
    /// What the distances mean for NIC choice.
    pub note: String,
}

/// The distance of one (GPU, NIC) pair.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Distance {
    /// GPU ordinal.
    pub gpu: u32,
    /// NIC name.
    pub nic: String,
    /// NCCL's class (`PIX`, `PXB`, `PHB`, `NODE`, `SYS`); `None` unknown.
    pub class: Option<String>,
    /// Links between the two, below a shared bridge.
    pub hops: Option<u32>,
    /// Why it is unknown.
    pub unknown_because: Option<String>,
}

/// The registration rungs.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Rungs {
    /// Probed (a NIC that reaches GPU memory and a GPU).
    pub probed: bool,
    /// Why not probed.
    pub note: Option<String>,
    /// One per (NIC, GPU).
    pub pairs: Vec<PairRung>,
    /// NICs whose ladder could not be set up, with why.
    pub errors: Vec<String>,
}

/// The rung of one (NIC, GPU) pair.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct PairRung {
    /// NIC name.
    pub nic: String,
    /// GPU ordinal.
    pub gpu: u32,
    /// The rung gdr takes: `dma-buf`, `peermem` or `staging`.
    pub rung: String,
    /// Each GPU-direct rung probed, in ladder order.
    pub checks: Vec<RungCheck>,
}

/// One probed rung.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct RungCheck {
    /// `dma-buf` or `peermem`.
    pub rung: String,
    /// It works (registration and a loopback WRITE and READ).
    pub works: bool,
    /// Who refused: `gpu`, `driver`, `nic`, `self-check`, `policy`,
    /// `budget`.
    pub refused_by: Option<String>,
    /// The refusal.
    pub reason: Option<String>,
}

/// What to do about a "no".
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Hint {
    /// What is missing or wrong.
    pub problem: String,
    /// What to do.
    pub fix: String,
}

/// Host files read under a root directory: `/` on a real system.
#[derive(Debug, Clone)]
pub(crate) struct HostFiles {
    root: PathBuf,
}

impl HostFiles {
    /// This machine.
    pub fn system() -> Self {
        Self::at("/")
    }

    /// Files under `root` (a fake tree in tests).
    pub fn at(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    fn path(&self, absolute: &str) -> PathBuf {
        self.root.join(absolute.trim_start_matches('/'))
    }

    fn read(&self, absolute: &str) -> Option<String> {
        std::fs::read_to_string(self.path(absolute)).ok()
    }

    fn exists(&self, absolute: &str) -> bool {
        self.path(absolute).exists()
    }

    fn topology(&self) -> PciTopology {
        PciTopology::at(&self.root)
    }
}

// ------------------------------------------------------------ gathering

/// Gathers the report for `--backend` `choice` on this machine.
pub(crate) fn gather(choice: BackendChoice) -> Report {
    let host = HostFiles::system();
    let mut report = Report {
        backends: BackendsUsed {
            asked: choice_name(choice).to_owned(),
            ..BackendsUsed::default()
        },
        ..Report::default()
    };
    match run_with(choice, GatherDevices) {
        Ok(devices) => devices.into_report(&mut report),
        Err(e) => report.backends.error = Some(e.to_string()),
    }
    // After the backends: libcuda is then loaded (and in /proc/self/maps)
    // where it could be.
    gather_host(&host, &mut report);
    gather_real_libraries(&host, choice, &mut report);
    finish(&host, &mut report);
    report
}

fn choice_name(choice: BackendChoice) -> &'static str {
    match choice {
        BackendChoice::Auto => "auto",
        BackendChoice::Real => "real",
        BackendChoice::Sim => "sim",
    }
}

/// The parts that read only files: kernel modules, kernel release, memlock.
fn gather_host(host: &HostFiles, report: &mut Report) {
    report.nvidia.kernel_module = nvidia_module(host);
    let modules = host.read("/proc/modules").unwrap_or_default();
    report.nvidia.peermem_module = ["nvidia_peermem", "nv_peer_mem"]
        .into_iter()
        .find(|m| module_loaded(host, &modules, m))
        .map(str::to_owned);
    report.nvidia.peermem_loaded = report.nvidia.peermem_module.is_some();
    report.kernel_release = host
        .read("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned());
    report.memlock = memlock(
        host.read("/proc/self/limits").as_deref(),
        host.read("/proc/self/status").as_deref(),
    );
}

/// rdma-core's libraries (loaded, if at all, by rdma-mummy-sys's shim when
/// the process started: probing them loads nothing) and libcuda (loaded by
/// the backend choice; not probed under `--backend sim`).
fn gather_real_libraries(host: &HostFiles, choice: BackendChoice, report: &mut Report) {
    let maps = host.read("/proc/self/maps").unwrap_or_default();
    let verbs = hal_verbs::rdma::RdmaProvider::load();
    report.libraries.libibverbs = library(
        &maps,
        "libibverbs.so.1",
        verbs.as_ref().map(drop).map_err(|e| e.to_string()),
    );
    if let Ok(provider) = verbs {
        // Listing devices opens none.
        devices_listed(
            &mut report.libraries.libibverbs,
            provider.devices().map(|d| d.len() as u32),
        );
    }
    report.libraries.librdmacm = library(
        &maps,
        "librdmacm.so.1",
        hal_verbs::rdma::RdmaCm::load()
            .map(drop)
            .map_err(|e| e.to_string()),
    );
    if choice == BackendChoice::Sim {
        report.libraries.libcuda = Library {
            soname: "libcuda.so.1".to_owned(),
            detail: Some("not probed: --backend sim".to_owned()),
            ..Library::default()
        };
        return;
    }
    let driver = hal_cuda::cuda::CudaDriver::load();
    report.libraries.libcuda = library(
        &maps_after_load(host, &maps),
        "libcuda.so.1",
        driver.as_ref().map(drop).map_err(|e| e.to_string()),
    );
    if let Ok(driver) = driver {
        report.nvidia.cuda_version = driver.driver_version().ok().map(cuda_version);
        devices_listed(&mut report.libraries.libcuda, driver.device_count());
    }
}

/// Records how many devices a found library lists, or why none.
fn devices_listed(library: &mut Library, count: Result<u32, impl std::fmt::Display>) {
    match count {
        Ok(n) => library.devices = Some(n),
        Err(e) => {
            library.devices = Some(0);
            library.detail = Some(e.to_string());
        }
    }
}

/// `/proc/self/maps` again where libcuda was not in it yet.
fn maps_after_load(host: &HostFiles, maps: &str) -> String {
    if loaded_library(maps, "libcuda.so").is_some() {
        return maps.to_owned();
    }
    host.read("/proc/self/maps").unwrap_or_default()
}

/// A library's entry: found or why not; its file and version from `maps`.
fn library(maps: &str, soname: &str, loaded: Result<(), String>) -> Library {
    // `libibverbs.so.1` → `libibverbs.so`: the files are `<stem>.<version>`.
    let stem = format!("{}.so", soname.split(".so").next().unwrap_or(soname));
    let mut entry = Library {
        soname: soname.to_owned(),
        ..Library::default()
    };
    match loaded {
        Ok(()) => {
            entry.found = Some(true);
            if let Some(path) = loaded_library(maps, &stem) {
                entry.version = library_version(&path, &stem);
                entry.package = entry.version.as_deref().and_then(|v| package_of(&stem, v));
                entry.path = Some(path);
            }
        }
        Err(why) => {
            entry.found = Some(false);
            entry.detail = Some(why);
        }
    }
    entry
}

/// The path of the first mapped file whose name starts with `stem`
/// (`libibverbs.so`) in `/proc/self/maps` text.
pub(crate) fn loaded_library(maps: &str, stem: &str) -> Option<String> {
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| {
            Path::new(path)
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(stem))
        })
        .map(str::to_owned)
}

/// The version in a library's file name: `1.14.44.0` of
/// `libibverbs.so.1.14.44.0`; `None` for the bare soname.
pub(crate) fn library_version(path: &str, stem: &str) -> Option<String> {
    let name = Path::new(path).file_name()?.to_str()?;
    let version = name.strip_prefix(stem)?.strip_prefix('.')?;
    // `libibverbs.so.1` alone says only the ABI.
    (version.contains('.')).then(|| version.to_owned())
}

/// The package a library version names: rdma-core writes its release as
/// the third number of its libraries' versions (`libibverbs.so.1.14.44.0`
/// is rdma-core 44); libcuda's version is the driver's.
fn package_of(stem: &str, version: &str) -> Option<String> {
    match stem {
        "libibverbs.so" | "librdmacm.so" => version
            .split('.')
            .nth(2)
            .map(|release| format!("rdma-core {release}")),
        "libcuda.so" => Some(format!("NVIDIA driver {version}")),
        _ => None,
    }
}

/// `cuDriverGetVersion`'s number as `major.minor` (13000: `13.0`).
pub(crate) fn cuda_version(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

/// The `nvidia` module: `/proc/driver/nvidia/version`, else
/// `/sys/module/nvidia`.
fn nvidia_module(host: &HostFiles) -> Option<KernelModule> {
    if let Some(text) = host.read("/proc/driver/nvidia/version") {
        return Some(parse_nvidia_version(&text));
    }
    host.exists("/sys/module/nvidia").then(|| KernelModule {
        version: host
            .read("/sys/module/nvidia/version")
            .map(|v| v.trim().to_owned()),
        open: None,
    })
}

/// Parses `/proc/driver/nvidia/version`, e.g. `NVRM version: NVIDIA UNIX
/// Open Kernel Module for x86_64  580.65.06  Release Build ...`.
pub(crate) fn parse_nvidia_version(text: &str) -> KernelModule {
    let line = text
        .lines()
        .find(|l| l.starts_with("NVRM version:"))
        .unwrap_or_default();
    let version = line
        .split_whitespace()
        .find(|word| {
            word.contains('.')
                && word.split('.').count() >= 2
                && word
                    .split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_owned);
    KernelModule {
        version,
        open: (!line.is_empty()).then(|| line.contains("Open Kernel Module")),
    }
}

fn module_loaded(host: &HostFiles, proc_modules: &str, name: &str) -> bool {
    host.exists(&format!("/sys/module/{name}"))
        || proc_modules
            .lines()
            .any(|l| l.split_whitespace().next() == Some(name))
}

/// What an engine pins and registers by default for one GPU and one peer:
/// the GPU's staging pool and the landing slots lent to the peer.
pub(crate) fn engine_pinned_bytes() -> u64 {
    let config = EngineConfig::default();
    config.staging_slice * (config.staging_slots + config.rendezvous_slots) as u64
}

/// RLIMIT_MEMLOCK from `/proc/self/limits` and CAP_IPC_LOCK from
/// `/proc/self/status`.
pub(crate) fn memlock(limits: Option<&str>, status: Option<&str>) -> Memlock {
    let engine_needs = engine_pinned_bytes();
    let (soft, hard) = limits.and_then(parse_memlock).unzip();
    let cap_ipc_lock = status.is_some_and(has_cap_ipc_lock);
    let verdict = match soft {
        None => MemlockVerdict::Unknown,
        Some(Limit::Unlimited) => MemlockVerdict::Unlimited,
        Some(_) if cap_ipc_lock => MemlockVerdict::NotEnforced,
        Some(Limit::Bytes(n)) if n >= engine_needs => MemlockVerdict::Enough,
        Some(Limit::Bytes(_)) => MemlockVerdict::TooLow,
    };
    Memlock {
        soft,
        hard,
        cap_ipc_lock,
        engine_needs,
        verdict,
    }
}

/// The soft and hard limits of `Max locked memory` in `/proc/self/limits`.
pub(crate) fn parse_memlock(limits: &str) -> Option<(Limit, Limit)> {
    let rest = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max locked memory"))?;
    let mut words = rest.split_whitespace();
    let limit = |word: &str| match word {
        "unlimited" => Some(Limit::Unlimited),
        n => n.parse().ok().map(Limit::Bytes),
    };
    Some((limit(words.next()?)?, limit(words.next()?)?))
}

/// Whether `CapEff` in `/proc/self/status` holds CAP_IPC_LOCK.
pub(crate) fn has_cap_ipc_lock(status: &str) -> bool {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// The device sections, gathered on the chosen backends.
struct GatherDevices;

/// What [`GatherDevices`] found.
struct Devices {
    verbs: String,
    cuda: Option<String>,
    notes: Vec<String>,
    rdma: RdmaSection,
    gpus: GpuSection,
    rungs: Rungs,
}

impl Devices {
    fn into_report(self, report: &mut Report) {
        report.backends.verbs = Some(self.verbs);
        report.backends.cuda = self.cuda;
        report.backends.notes = self.notes;
        report.rdma = self.rdma;
        report.gpus = self.gpus;
        report.rungs = self.rungs;
    }
}

impl BackendTask for GatherDevices {
    type Output = Devices;

    fn run<V: hal_verbs::Api, C: hal_cuda::Api>(self, backends: Backends<V, C>) -> Devices {
        let gpus = match backends.cuda() {
            Some(driver) => gpu_section::<C>(driver),
            None => GpuSection {
                error: Some("no CUDA driver with a GPU".to_owned()),
                ..GpuSection::default()
            },
        };
        let rungs = match (backends.registrable_cuda(), backends.cuda()) {
            (Some(driver), _) => probe_rungs::<V, C>(backends.verbs(), driver),
            (None, Some(_)) => Rungs {
                note: Some("not probed: the simulated NIC cannot reach real GPU memory".to_owned()),
                ..Rungs::default()
            },
            (None, None) => Rungs {
                note: Some("not probed: no GPU".to_owned()),
                ..Rungs::default()
            },
        };
        Devices {
            verbs: backends.verbs_name().to_owned(),
            cuda: backends.cuda_name().map(str::to_owned),
            notes: backends.notes().to_vec(),
            rdma: rdma_section::<V>(backends.verbs()),
            gpus,
            rungs,
        }
    }
}

fn rdma_section<V: hal_verbs::Api>(provider: &V::Provider) -> RdmaSection {
    let mut section = RdmaSection {
        backend: Some(provider.backend_name().to_owned()),
        ..RdmaSection::default()
    };
    match provider.devices() {
        Ok(devices) => {
            section.devices = devices
                .into_iter()
                .map(|d| rdma_device::<V>(provider, d))
                .collect()
        }
        Err(e) => section.error = Some(e.to_string()),
    }
    section
}

fn rdma_device<V: hal_verbs::Api>(
    provider: &V::Provider,
    info: hal_verbs::DeviceInfo,
) -> RdmaDevice {
    let mut device = RdmaDevice {
        name: info.name.clone(),
        pci_bus_id: info.pci_bus_id,
        ..RdmaDevice::default()
    };
    let ctx = match provider.open(&info.name) {
        Ok(ctx) => ctx,
        Err(e) => {
            device.error = Some(format!("cannot open: {e}"));
            return device;
        }
    };
    let attrs = match ctx.query_device() {
        Ok(attrs) => attrs,
        Err(e) => {
            device.error = Some(format!("cannot query: {e}"));
            return device;
        }
    };
    device.firmware = Some(attrs.fw_ver.clone());
    device.vendor = Some(format!(
        "{:#06x}:{:#06x}",
        attrs.vendor_id, attrs.vendor_part_id
    ));
    device.ports = (1..=attrs.phys_port_cnt)
        .map(|number| port::<V>(&ctx, number))
        .collect();
    device
}

fn port<V: hal_verbs::Api>(ctx: &V::Context, number: u8) -> Port {
    let mut port = Port {
        number,
        ..Port::default()
    };
    match ctx.query_port(number) {
        Ok(p) => {
            port.state = format!("{:?}", p.state);
            port.active = matches!(p.state, hal_verbs::PortState::Active);
            port.link_layer = format!("{:?}", p.link_layer);
            port.active_mtu = p.active_mtu.bytes();
            port.max_mtu = p.max_mtu.bytes();
        }
        Err(e) => {
            port.error = Some(format!("cannot query: {e}"));
            return port;
        }
    }
    match ctx.gid_table(number) {
        Ok(table) => {
            port.roce_v2_gid_index =
                hal_verbs::select_roce_v2_gid(&table, AddressFamily::V4).map(|g| g.index);
            port.gids = table
                .iter()
                .filter(|g| !g.gid.is_zero())
                .map(|g| GidReport {
                    index: g.index,
                    address: g.gid.to_ip().to_string(),
                    kind: match g.gid_type {
                        GidType::Ib => "IB",
                        GidType::RoceV1 => "RoCE v1",
                        GidType::RoceV2 => "RoCE v2",
                    }
                    .to_owned(),
                    roce_v2: g.gid_type == GidType::RoceV2,
                })
                .collect();
        }
        Err(e) => port.error = Some(format!("cannot read the GID table: {e}")),
    }
    port
}

fn gpu_section<C: hal_cuda::Api>(driver: &C::Driver) -> GpuSection {
    let mut section = GpuSection {
        backend: Some(driver.backend_name().to_owned()),
        ..GpuSection::default()
    };
    let count = match driver.device_count() {
        Ok(count) => count,
        Err(e) => {
            section.error = Some(e.to_string());
            return section;
        }
    };
    section.gpus = (0..count)
        .map(|ordinal| match driver.device_attributes(ordinal) {
            Ok(a) => GpuReport {
                ordinal,
                name: a.name.clone(),
                pci_bus_id: a.pci_bus_id.clone(),
                memory_bytes: a.total_memory,
                compute_capability: format!(
                    "{}.{}",
                    a.compute_capability.0, a.compute_capability.1
                ),
                dma_buf: a.dma_buf_supported,
                gpu_direct_rdma: a.gpu_direct_rdma_supported,
                flush_options: flush_options(a.flush_writes_options),
                writes_ordering: match a.writes_ordering {
                    WritesOrdering::None => "none",
                    WritesOrdering::Owner => "owner",
                    WritesOrdering::AllDevices => "all_devices",
                }
                .to_owned(),
                vmm: a.virtual_memory_management,
                error: None,
            },
            Err(e) => GpuReport {
                ordinal,
                error: Some(e.to_string()),
                ..GpuReport::default()
            },
        })
        .collect();
    section
}

fn flush_options(options: FlushWritesOptions) -> Vec<String> {
    let mut names = Vec::new();
    if options.contains(FlushWritesOptions::HOST) {
        names.push("host".to_owned());
    }
    if options.contains(FlushWritesOptions::MEMOPS) {
        names.push("memops".to_owned());
    }
    names
}

fn rung_name(rung: Rung) -> &'static str {
    match rung {
        Rung::HostMemory => "host",
        Rung::Dmabuf => "dma-buf",
        Rung::Peermem => "peermem",
        Rung::Staging => "staging",
    }
}

fn refused_by(refusal: &Refusal) -> &'static str {
    match refusal {
        Refusal::Gpu(_) => "gpu",
        Refusal::Driver(_) => "driver",
        Refusal::Nic(_) => "nic",
        Refusal::SelfCheck(_) => "self-check",
        Refusal::Policy => "policy",
        Refusal::Budget(_) => "budget",
        _ => "other",
    }
}

/// Each NIC's ladder over every GPU, each GPU-direct rung probed with a
/// loopback self-check; the rung taken is the first that works, else
/// staging through pinned host memory.
fn probe_rungs<V: hal_verbs::Api, C: hal_cuda::Api>(
    provider: &V::Provider,
    driver: &C::Driver,
) -> Rungs {
    let mut rungs = Rungs {
        probed: true,
        ..Rungs::default()
    };
    let devices = match provider.devices() {
        Ok(devices) => devices,
        Err(e) => {
            rungs.probed = false;
            rungs.note = Some(format!("not probed: {e}"));
            return rungs;
        }
    };
    for device in devices {
        let ladder = provider
            .open(&device.name)
            .map_err(|e| e.to_string())
            .and_then(|ctx| {
                let count = driver.device_count().map_err(|e| e.to_string())?;
                let gpus = (0..count)
                    .map(|ordinal| Gpu::<C>::open(driver, ordinal))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| e.to_string())?;
                Ladder::<V, C>::standalone(&ctx, gpus).map_err(|e| e.to_string())
            });
        let ladder = match ladder {
            Ok(ladder) => ladder,
            Err(e) => {
                rungs.errors.push(format!("{}: {e}", device.name));
                continue;
            }
        };
        let mut pairs: Vec<PairRung> = Vec::new();
        for (gpu, rung, verdict) in ladder.probe_all() {
            let check = RungCheck {
                rung: rung_name(rung).to_owned(),
                works: verdict.is_ok(),
                refused_by: verdict.as_ref().err().map(|r| refused_by(r).to_owned()),
                reason: verdict.err().map(|r| r.to_string()),
            };
            match pairs.iter_mut().find(|p| p.gpu == gpu) {
                Some(pair) => pair.checks.push(check),
                None => pairs.push(PairRung {
                    nic: device.name.clone(),
                    gpu,
                    rung: String::new(),
                    checks: vec![check],
                }),
            }
        }
        for pair in &mut pairs {
            pair.rung = pair
                .checks
                .iter()
                .find(|c| c.works)
                .map_or("staging", |c| c.rung.as_str())
                .to_owned();
        }
        rungs.pairs.extend(pairs);
    }
    rungs
}

/// The PCIe distances of every (GPU, NIC) pair, and whether they lead to a
/// preference.
pub(crate) fn topology(
    tree: &PciTopology,
    sysfs_tree: bool,
    gpus: &[GpuReport],
    nics: &[RdmaDevice],
) -> Topology {
    let mut pairs = Vec::new();
    for gpu in gpus.iter().filter(|g| g.error.is_none()) {
        let gpu_place = tree.gpu_path(&gpu.pci_bus_id);
        for nic in nics {
            let mut entry = Distance {
                gpu: gpu.ordinal,
                nic: nic.name.clone(),
                ..Distance::default()
            };
            let nic_place = tree.nic_path(&nic.name);
            match (&gpu_place, &nic_place) {
                (Some(g), Some(n)) => {
                    let d = gdr_core::engine::topology::distance(g, n);
                    entry.class = Some(distance_class(d).to_owned());
                    entry.hops = match d {
                        PciDistance::Pix { hops } | PciDistance::Pxb { hops } => Some(hops),
                        _ => None,
                    };
                }
                (None, _) => {
                    entry.unknown_because = Some(format!(
                        "GPU {} ({}) is not in the PCI tree (simulated, or sysfs hidden)",
                        gpu.ordinal, gpu.pci_bus_id
                    ))
                }
                (_, None) => {
                    entry.unknown_because = Some(format!(
                        "{} has no PCI function in the tree (a software or simulated device)",
                        nic.name
                    ))
                }
            }
            pairs.push(entry);
        }
    }
    let (preference, note) = preference(sysfs_tree, &pairs);
    Topology {
        sysfs_tree,
        pairs,
        preference,
        note,
    }
}

/// Whether the distances make gdr prefer some NIC for some GPU, and why
/// not.
fn preference(sysfs_tree: bool, pairs: &[Distance]) -> (bool, String) {
    if pairs.is_empty() {
        return (false, "no (GPU, NIC) pair to place".to_owned());
    }
    if !sysfs_tree {
        return (
            false,
            "no PCIe tree in sysfs (/sys/devices is missing): no preference, NICs are used in \
             the order listed"
                .to_owned(),
        );
    }
    if pairs.iter().all(|p| p.class.is_none()) {
        return (
            false,
            "no distance is known: no preference, NICs are used in the order listed".to_owned(),
        );
    }
    let mut gpus: Vec<u32> = pairs.iter().map(|p| p.gpu).collect();
    gpus.dedup();
    // A GPU has a preference where its NICs are not all at one distance.
    let prefers = gpus.iter().any(|&gpu| {
        let mine: Vec<(&Option<String>, Option<u32>)> = pairs
            .iter()
            .filter(|p| p.gpu == gpu)
            .map(|p| (&p.class, p.hops))
            .collect();
        mine.windows(2).any(|w| w[0] != w[1])
    });
    if prefers {
        (
            true,
            "each GPU's transfers go over its nearest NICs (known distances first)".to_owned(),
        )
    } else {
        (
            false,
            "the PCIe tree is flat here (every NIC at one distance from each GPU): no preference"
                .to_owned(),
        )
    }
}

fn distance_class(d: PciDistance) -> &'static str {
    match d {
        PciDistance::Pix { .. } => "PIX",
        PciDistance::Pxb { .. } => "PXB",
        PciDistance::Phb => "PHB",
        PciDistance::Node => "NODE",
        PciDistance::Sys => "SYS",
    }
}

/// Fills in what depends on the rest: the topology and the hints.
fn finish(host: &HostFiles, report: &mut Report) {
    report.topology = topology(
        &host.topology(),
        host.exists("/sys/devices"),
        &report.gpus.gpus,
        &report.rdma.devices,
    );
    report.hints = hints(report);
}

// ------------------------------------------------------------ hints

/// What to do about each "no" in `report`.
pub(crate) fn hints(report: &Report) -> Vec<Hint> {
    let mut hints = Vec::new();
    let mut hint = |problem: String, fix: &str| {
        hints.push(Hint {
            problem,
            fix: fix.to_owned(),
        })
    };
    let libs = &report.libraries;
    let real_verbs = report.rdma.backend.as_deref() == Some("rdma-core");
    if libs.libibverbs.found == Some(false) {
        hint(
            "libibverbs (rdma-core) not found".to_owned(),
            "install rdma-core: `apt install rdma-core ibverbs-providers` (Debian, Ubuntu) or \
             `dnf install rdma-core libibverbs` (RHEL, Fedora)",
        );
    } else if libs.libibverbs.found == Some(true) && libs.libibverbs.devices == Some(0) {
        hint(
            "rdma-core is installed but lists no RDMA device".to_owned(),
            "load the NIC's RDMA driver (`modprobe mlx5_ib`; `rdma link` lists devices); to \
             try gdr without a NIC, add SoftRoCE: `rdma link add rxe0 type rxe netdev eth0`",
        );
    }
    if libs.librdmacm.found == Some(false) && libs.libibverbs.found == Some(true) {
        hint(
            "librdmacm not found (gdr connects over rdma_cm)".to_owned(),
            "install it: `apt install librdmacm1` or `dnf install librdmacm`",
        );
    }
    if libs.libcuda.found == Some(false) {
        hint(
            "libcuda (the CUDA driver) not found".to_owned(),
            "install the NVIDIA driver (libcuda.so.1 comes with it, not with the CUDA toolkit); \
             in a container, run with the NVIDIA container toolkit (`--gpus all`)",
        );
    } else if libs.libcuda.found == Some(true) && libs.libcuda.devices == Some(0) {
        hint(
            "the CUDA driver loads but reports no GPU".to_owned(),
            "check `nvidia-smi`; in a container, pass the GPUs in (`--gpus all`)",
        );
    }
    let real_gpus = report.gpus.backend.as_deref() == Some("cuda");
    let open_module = report.nvidia.kernel_module.as_ref().and_then(|m| m.open);
    if open_module == Some(false) {
        hint(
            "the NVIDIA kernel module is the proprietary one: no dma-buf export of GPU memory"
                .to_owned(),
            "install the open kernel module (e.g. `apt install nvidia-driver-580-open`, or \
             `nvidia-open`); dma-buf needs it (Turing or newer)",
        );
    }
    // peermem matters only beside a real NIC.
    let real_nics = libs.libibverbs.devices.unwrap_or(0) > 0;
    if (report.nvidia.kernel_module.is_some() || real_gpus)
        && real_nics
        && !report.nvidia.peermem_loaded
    {
        let dmabuf_works = report
            .rungs
            .pairs
            .iter()
            .any(|p| p.rung == rung_name(Rung::Dmabuf));
        hint(
            if dmabuf_works {
                "nvidia-peermem is not loaded (not needed while dma-buf works)".to_owned()
            } else {
                "nvidia-peermem is not loaded: no peermem rung".to_owned()
            },
            "`modprobe nvidia-peermem` (ships with the driver; load it after the NIC's driver), \
             or persist it: `echo nvidia-peermem > /etc/modules-load.d/nvidia-peermem.conf`",
        );
    }
    if report.memlock.verdict == MemlockVerdict::TooLow {
        let soft = report.memlock.soft.map_or_else(String::new, limit_text);
        hint(
            format!(
                "memlock limit {soft} is below the {} an engine pins: registrations will fail \
                 with ENOMEM",
                bytes_text(report.memlock.engine_needs)
            ),
            "raise it: `ulimit -l unlimited` (up to the hard limit), `* - memlock unlimited` in \
             /etc/security/limits.conf, `LimitMEMLOCK=infinity` for a systemd service, \
             `--ulimit memlock=-1` for docker",
        );
    }
    if real_verbs {
        for device in &report.rdma.devices {
            for port in &device.ports {
                if port.error.is_none() && !port.active {
                    hint(
                        format!("{} port {} is {}", device.name, port.number, port.state),
                        "bring the link up: check the cable and `ip link set <netdev> up`; \
                         `rdma link` shows which netdev the port is",
                    );
                } else if port.link_layer == "Ethernet" && port.roce_v2_gid_index.is_none() {
                    hint(
                        format!(
                            "{} port {} has no RoCE v2 IPv4 GID",
                            device.name, port.number
                        ),
                        "give its netdev an IPv4 address (`ip addr add ... dev <netdev>`); \
                         the GID follows",
                    );
                }
            }
        }
    }
    for gpu in report.gpus.gpus.iter().filter(|g| g.error.is_none()) {
        // With the proprietary module that hint says it already.
        if !gpu.dma_buf && open_module != Some(false) {
            hint(
                format!("GPU {} does not export dma-bufs", gpu.ordinal),
                "dma-buf needs a Turing or newer GPU, CUDA 11.7+ and the open kernel module; \
                 peermem or staging is used instead",
            );
        }
        if gpu.writes_ordering == "none" && !gpu.flush_options.iter().any(|o| o == "host") {
            hint(
                format!(
                    "GPU {} neither orders inbound RDMA writes nor offers \
                     cuFlushGPUDirectRDMAWrites",
                    gpu.ordinal
                ),
                "kernels must not read RDMA-written GPU memory before the stream is synchronized \
                 (update the driver)",
            );
        }
    }
    for pair in &report.rungs.pairs {
        if pair.rung != rung_name(Rung::Staging) {
            continue;
        }
        let nic_refused = pair
            .checks
            .iter()
            .any(|c| c.rung == "dma-buf" && c.refused_by.as_deref() == Some("nic"));
        hint(
            format!(
                "{} cannot reach GPU {}'s memory: transfers go through pinned host staging",
                pair.nic, pair.gpu
            ),
            if nic_refused {
                "dma-buf MRs need kernel 5.12+, rdma-core 34+ and a NIC driver that supports \
                 them (mlx5 does, rxe does not); or load nvidia-peermem (see above)"
            } else {
                "enable dma-buf (open kernel module) or nvidia-peermem, see above"
            },
        );
    }
    if let Some(release) = report
        .kernel_release
        .as_ref()
        .filter(|r| kernel_before(r, (5, 12)))
    {
        hint(
            format!("kernel {release} predates dma-buf memory registration (5.12)"),
            "use kernel 5.12 or newer for the dma-buf rung, or nvidia-peermem",
        );
    }
    hints
}

/// Whether kernel `release` (`6.1.0-18-amd64`) is older than `version`.
pub(crate) fn kernel_before(release: &str, version: (u32, u32)) -> bool {
    let mut parts = release.split(['.', '-']).map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) < version,
        _ => false,
    }
}

// ------------------------------------------------------------ printing

/// `n` bytes for people: `8 MiB`, `1.5 GiB`, `4096 bytes`.
pub(crate) fn bytes_text(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} bytes");
    }
    let mut value = n as f64;
    let mut unit = "";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    if value.fract() == 0.0 {
        format!("{value:.0} {unit}")
    } else {
        format!("{value:.1} {unit}")
    }
}

fn limit_text(limit: Limit) -> String {
    match limit {
        Limit::Unlimited => "unlimited".to_owned(),
        Limit::Bytes(n) => bytes_text(n),
    }
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn library_line(name: &str, lib: &Library) -> String {
    let mut line = format!("  {name:<11} ");
    match lib.found {
        Some(true) => {
            line.push_str("found");
            if let Some(path) = &lib.path {
                let _ = write!(line, "  {path}");
            }
            if let Some(package) = &lib.package {
                let _ = write!(line, "  ({package})");
            }
            match (lib.devices, &lib.detail) {
                (Some(0), Some(why)) => {
                    let _ = write!(line, "\n              lists no device: {why}");
                }
                (Some(n), _) => {
                    let _ = write!(line, "  {n} device{}", if n == 1 { "" } else { "s" });
                }
                (None, _) => {}
            }
        }
        Some(false) => {
            let _ = write!(
                line,
                "NOT FOUND: {}",
                lib.detail.as_deref().unwrap_or("unknown")
            );
        }
        None => {
            let _ = write!(line, "{}", lib.detail.as_deref().unwrap_or("not probed"));
        }
    }
    line
}

/// The report for people.
pub(crate) fn write_human(report: &Report, out: &mut impl Write) -> io::Result<()> {
    let b = &report.backends;
    writeln!(
        out,
        "gdr info (--backend {}: verbs {}, CUDA {})",
        b.asked,
        b.verbs.as_deref().unwrap_or("none"),
        b.cuda.as_deref().unwrap_or("none")
    )?;
    if let Some(error) = &b.error {
        writeln!(out, "  backends: {error}")?;
    }
    for note in &b.notes {
        for line in note.lines() {
            writeln!(out, "  {}", line.trim_start())?;
        }
    }

    writeln!(out, "\nLibraries")?;
    let l = &report.libraries;
    writeln!(out, "{}", library_line("libibverbs", &l.libibverbs))?;
    writeln!(out, "{}", library_line("librdmacm", &l.librdmacm))?;
    writeln!(out, "{}", library_line("libcuda", &l.libcuda))?;

    writeln!(out, "\nKernel")?;
    if let Some(release) = &report.kernel_release {
        writeln!(out, "  release          {release}")?;
    }
    let n = &report.nvidia;
    match &n.kernel_module {
        Some(m) => writeln!(
            out,
            "  nvidia module    {}, {}",
            m.version.as_deref().unwrap_or("version unknown"),
            match m.open {
                Some(true) => "open kernel module",
                Some(false) => "proprietary kernel module (no dma-buf)",
                None => "open or proprietary unknown",
            }
        )?,
        None => writeln!(out, "  nvidia module    not loaded")?,
    }
    writeln!(
        out,
        "  nvidia-peermem   {}",
        n.peermem_module
            .as_deref()
            .map_or("not loaded".to_owned(), |m| format!("loaded ({m})"))
    )?;
    writeln!(
        out,
        "  CUDA driver API  {}",
        n.cuda_version.as_deref().unwrap_or("unknown (no libcuda)")
    )?;
    let m = &report.memlock;
    let verdict = match m.verdict {
        MemlockVerdict::Unlimited => "fine".to_owned(),
        MemlockVerdict::NotEnforced => "not enforced: this process has CAP_IPC_LOCK".to_owned(),
        MemlockVerdict::Enough => format!(
            "enough for an engine's {} (more registered host memory needs more)",
            bytes_text(m.engine_needs)
        ),
        MemlockVerdict::TooLow => format!(
            "TOO LOW: an engine pins {}, registrations will fail",
            bytes_text(m.engine_needs)
        ),
        MemlockVerdict::Unknown => "unknown (/proc/self/limits unreadable)".to_owned(),
    };
    match (m.soft, m.hard) {
        (Some(soft), Some(hard)) => writeln!(
            out,
            "  memlock          {} (hard {}): {verdict}",
            limit_text(soft),
            limit_text(hard)
        )?,
        _ => writeln!(out, "  memlock          {verdict}")?,
    }

    let r = &report.rdma;
    writeln!(
        out,
        "\nRDMA devices ({})",
        r.backend.as_deref().unwrap_or("none")
    )?;
    if let Some(error) = &r.error {
        writeln!(out, "  none: {error}")?;
    }
    for d in &r.devices {
        writeln!(
            out,
            "  {}  PCI {}  fw {}  vendor {}",
            d.name,
            d.pci_bus_id.as_deref().unwrap_or("none (software device)"),
            d.firmware.as_deref().unwrap_or("?"),
            d.vendor.as_deref().unwrap_or("?")
        )?;
        if let Some(error) = &d.error {
            writeln!(out, "    {error}")?;
        }
        for p in &d.ports {
            if p.state.is_empty() {
                let error = p.error.as_deref().unwrap_or("not queried");
                writeln!(out, "    port {}: {error}", p.number)?;
                continue;
            }
            writeln!(
                out,
                "    port {}: {}, {}, MTU {} (max {})",
                p.number, p.state, p.link_layer, p.active_mtu, p.max_mtu
            )?;
            if let Some(error) = &p.error {
                writeln!(out, "      {error}")?;
            }
            for g in &p.gids {
                let used = if p.roce_v2_gid_index == Some(g.index) {
                    "  <- gdr uses this one"
                } else {
                    ""
                };
                writeln!(
                    out,
                    "      GID {:>3}  {:<28} {}{used}",
                    g.index, g.address, g.kind
                )?;
            }
        }
    }

    let g = &report.gpus;
    writeln!(out, "\nGPUs ({})", g.backend.as_deref().unwrap_or("none"))?;
    if let Some(error) = &g.error {
        writeln!(out, "  none: {error}")?;
    }
    for gpu in &g.gpus {
        if let Some(error) = &gpu.error {
            writeln!(out, "  {}: {error}", gpu.ordinal)?;
            continue;
        }
        writeln!(
            out,
            "  {}: {}  {}  {}  sm_{}",
            gpu.ordinal,
            gpu.name,
            gpu.pci_bus_id,
            bytes_text(gpu.memory_bytes),
            gpu.compute_capability.replace('.', "")
        )?;
        writeln!(
            out,
            "     dma-buf {}  GPUDirect RDMA {}  writes ordering {}  flush {}  VMM {}",
            yes(gpu.dma_buf),
            yes(gpu.gpu_direct_rdma),
            gpu.writes_ordering,
            if gpu.flush_options.is_empty() {
                "none".to_owned()
            } else {
                gpu.flush_options.join("+")
            },
            yes(gpu.vmm)
        )?;
    }

    let t = &report.topology;
    writeln!(out, "\nGPU <-> NIC PCIe distance")?;
    for p in &t.pairs {
        match (&p.class, p.hops) {
            (Some(class), Some(hops)) => {
                writeln!(out, "  GPU {} - {}: {class} ({hops} links)", p.gpu, p.nic)?
            }
            (Some(class), None) => writeln!(out, "  GPU {} - {}: {class}", p.gpu, p.nic)?,
            (None, _) => writeln!(
                out,
                "  GPU {} - {}: unknown ({})",
                p.gpu,
                p.nic,
                p.unknown_because.as_deref().unwrap_or("?")
            )?,
        }
    }
    writeln!(out, "  {}", t.note)?;

    let rungs = &report.rungs;
    writeln!(
        out,
        "\nGPU registration rungs (verbs {}, CUDA {}; probed with a loopback WRITE and READ)",
        b.verbs.as_deref().unwrap_or("none"),
        b.cuda.as_deref().unwrap_or("none")
    )?;
    if let Some(note) = &rungs.note {
        writeln!(out, "  {note}")?;
    }
    for e in &rungs.errors {
        writeln!(out, "  {e}")?;
    }
    for pair in &rungs.pairs {
        writeln!(out, "  {} x GPU {}: {}", pair.nic, pair.gpu, pair.rung)?;
        for c in &pair.checks {
            match &c.reason {
                None => writeln!(out, "    {}: works", c.rung)?,
                Some(reason) => writeln!(out, "    {}: no: {reason}", c.rung)?,
            }
        }
    }

    writeln!(out, "\nWhat to do")?;
    if report.hints.is_empty() {
        writeln!(out, "  nothing: every path gdr has is available")?;
    }
    for h in &report.hints {
        writeln!(out, "  - {}\n    {}", h.problem, h.fix)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: &str = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  \
        Release Build  (dvs-builder@U16-I3-B03-4-3)  Tue Jul 15 04:48:39 UTC 2025\n\
        GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n";
    const PROPRIETARY: &str = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  \
        Thu Feb 22 01:44:30 UTC 2024\nGCC version:  gcc version 12.2.0\n";

    #[test]
    fn nvidia_version_tells_the_open_module_and_its_version() {
        assert_eq!(
            parse_nvidia_version(OPEN),
            KernelModule {
                version: Some("580.65.06".to_owned()),
                open: Some(true),
            }
        );
        assert_eq!(
            parse_nvidia_version(PROPRIETARY),
            KernelModule {
                version: Some("550.54.14".to_owned()),
                open: Some(false),
            }
        );
        // Not the expected text: unknown, not "proprietary".
        assert_eq!(
            parse_nvidia_version("garbage\n"),
            KernelModule {
                version: None,
                open: None,
            }
        );
    }

    const LIMITS: &str = "Limit                     Soft Limit           Hard Limit           Units\n\
        Max cpu time              unlimited            unlimited            seconds\n\
        Max locked memory         8388608              unlimited            bytes\n";

    #[test]
    fn memlock_is_read_and_judged() {
        assert_eq!(
            parse_memlock(LIMITS),
            Some((Limit::Bytes(8 << 20), Limit::Unlimited))
        );
        let no_cap = "Name:\tgdr\nCapEff:\t0000000000000000\n";
        let cap = "Name:\tgdr\nCapEff:\t0000000000004000\n";
        assert!(!has_cap_ipc_lock(no_cap));
        assert!(has_cap_ipc_lock(cap));
        assert_eq!(
            memlock(Some(LIMITS), Some(no_cap)).verdict,
            MemlockVerdict::TooLow
        );
        assert_eq!(
            memlock(Some(LIMITS), Some(cap)).verdict,
            MemlockVerdict::NotEnforced
        );
        let big = LIMITS.replace("8388608 ", "1073741824");
        assert_eq!(
            memlock(Some(&big), Some(no_cap)).verdict,
            MemlockVerdict::Enough
        );
        let unlimited = LIMITS.replace("8388608 ", "unlimited");
        assert_eq!(
            memlock(Some(&unlimited), Some(no_cap)).verdict,
            MemlockVerdict::Unlimited
        );
        assert_eq!(memlock(None, None).verdict, MemlockVerdict::Unknown);
        assert_eq!(
            memlock(Some("Max locked memory  lots  x  bytes"), None).verdict,
            MemlockVerdict::Unknown
        );
    }

    #[test]
    fn sizes_read_for_people() {
        assert_eq!(bytes_text(4096), "4 KiB");
        assert_eq!(bytes_text(1000), "1000 bytes");
        assert_eq!(bytes_text(8 << 20), "8 MiB");
        assert_eq!(bytes_text(3 << 29), "1.5 GiB");
        assert_eq!(bytes_text(141 << 30), "141 GiB");
    }

    const MAPS: &str = "7f0000000000-7f0000001000 r--p 00000000 fd:01 123 /usr/lib/x86_64-linux-gnu/librdmacm.so.1.3.44.0\n\
        7f0000002000-7f0000003000 r--p 00000000 fd:01 124 /usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0\n\
        7f0000004000-7f0000005000 r--p 00000000 fd:01 125 /usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06\n\
        7f0000006000-7f0000007000 rw-p 00000000 00:00 0 \n";

    #[test]
    fn library_versions_come_from_the_mapped_files() {
        let verbs = library(MAPS, "libibverbs.so.1", Ok(()));
        assert_eq!(verbs.found, Some(true));
        assert_eq!(verbs.version.as_deref(), Some("1.14.44.0"));
        assert_eq!(verbs.package.as_deref(), Some("rdma-core 44"));
        let cm = library(MAPS, "librdmacm.so.1", Ok(()));
        assert_eq!(cm.package.as_deref(), Some("rdma-core 44"));
        let cuda = library(MAPS, "libcuda.so.1", Ok(()));
        assert_eq!(cuda.version.as_deref(), Some("580.65.06"));
        let missing = library("", "libcuda.so.1", Err("no libcuda".to_owned()));
        assert_eq!(missing.found, Some(false));
        assert_eq!(missing.detail.as_deref(), Some("no libcuda"));
        // The bare soname says no version.
        assert_eq!(
            library_version("/lib/libibverbs.so.1", "libibverbs.so"),
            None
        );
        assert_eq!(cuda_version(13000), "13.0");
        assert_eq!(cuda_version(12080), "12.8");
    }

    #[test]
    fn kernel_releases_compare() {
        assert!(kernel_before("5.4.0-150-generic", (5, 12)));
        assert!(!kernel_before("6.1.0-18-amd64", (5, 12)));
        assert!(!kernel_before("5.12.0", (5, 12)));
        assert!(!kernel_before("weird", (5, 12)));
    }

    /// A report of a machine with everything gdr wants.
    fn healthy() -> Report {
        let found = |soname: &str| Library {
            soname: soname.to_owned(),
            found: Some(true),
            devices: Some(1),
            ..Library::default()
        };
        Report {
            libraries: Libraries {
                libibverbs: found("libibverbs.so.1"),
                librdmacm: found("librdmacm.so.1"),
                libcuda: found("libcuda.so.1"),
            },
            nvidia: Nvidia {
                kernel_module: Some(parse_nvidia_version(OPEN)),
                peermem_loaded: true,
                peermem_module: Some("nvidia_peermem".to_owned()),
                cuda_version: Some("13.0".to_owned()),
            },
            kernel_release: Some("6.8.0-45-generic".to_owned()),
            memlock: memlock(Some(&LIMITS.replace("8388608 ", "unlimited")), None),
            rdma: RdmaSection {
                backend: Some("rdma-core".to_owned()),
                devices: vec![RdmaDevice {
                    name: "mlx5_0".to_owned(),
                    ports: vec![Port {
                        number: 1,
                        state: "Active".to_owned(),
                        active: true,
                        link_layer: "Ethernet".to_owned(),
                        roce_v2_gid_index: Some(3),
                        ..Port::default()
                    }],
                    ..RdmaDevice::default()
                }],
                error: None,
            },
            gpus: GpuSection {
                backend: Some("cuda".to_owned()),
                gpus: vec![GpuReport {
                    dma_buf: true,
                    gpu_direct_rdma: true,
                    writes_ordering: "owner".to_owned(),
                    flush_options: vec!["host".to_owned()],
                    ..GpuReport::default()
                }],
                error: None,
            },
            rungs: Rungs {
                probed: true,
                pairs: vec![PairRung {
                    nic: "mlx5_0".to_owned(),
                    gpu: 0,
                    rung: "dma-buf".to_owned(),
                    checks: Vec::new(),
                }],
                ..Rungs::default()
            },
            ..Report::default()
        }
    }

    /// Whether some hint's problem mentions `what`.
    fn hinted(report: &Report, what: &str) -> bool {
        hints(report).iter().any(|h| h.problem.contains(what))
    }

    #[test]
    fn a_healthy_machine_needs_nothing() {
        let hints = hints(&healthy());
        assert!(hints.is_empty(), "{hints:?}");
    }

    #[test]
    fn each_no_gets_its_hint() {
        let mut r = healthy();
        r.libraries.libibverbs.found = Some(false);
        assert!(hinted(&r, "libibverbs"));

        let mut r = healthy();
        r.libraries.libibverbs.devices = Some(0);
        assert!(hinted(&r, "no RDMA device"));

        let mut r = healthy();
        r.libraries.libcuda.devices = Some(0);
        assert!(hinted(&r, "reports no GPU"));

        let mut r = healthy();
        r.libraries.libcuda.found = Some(false);
        assert!(hinted(&r, "libcuda"));

        let mut r = healthy();
        r.nvidia.kernel_module = Some(parse_nvidia_version(PROPRIETARY));
        assert!(hinted(&r, "proprietary"));

        let mut r = healthy();
        r.nvidia.peermem_loaded = false;
        r.nvidia.peermem_module = None;
        assert!(hinted(&r, "not needed while dma-buf works"));
        r.rungs.pairs[0].rung = "staging".to_owned();
        assert!(hinted(&r, "no peermem rung"));
        assert!(hinted(&r, "pinned host staging"));

        let mut r = healthy();
        r.memlock = memlock(Some(LIMITS), None);
        let hints = hints(&r);
        assert!(
            hints
                .iter()
                .any(|h| h.problem.contains("memlock limit 8 MiB") && h.fix.contains("ulimit -l")),
            "{hints:?}"
        );

        let mut r = healthy();
        r.rdma.devices[0].ports[0].active = false;
        r.rdma.devices[0].ports[0].state = "Down".to_owned();
        assert!(hinted(&r, "port 1 is Down"));

        let mut r = healthy();
        r.rdma.devices[0].ports[0].roce_v2_gid_index = None;
        assert!(hinted(&r, "no RoCE v2"));

        let mut r = healthy();
        r.gpus.gpus[0].dma_buf = false;
        assert!(hinted(&r, "does not export dma-bufs"));

        let mut r = healthy();
        r.gpus.gpus[0].writes_ordering = "none".to_owned();
        r.gpus.gpus[0].flush_options.clear();
        assert!(hinted(&r, "neither orders"));

        let mut r = healthy();
        r.kernel_release = Some("5.4.0-150-generic".to_owned());
        assert!(hinted(&r, "predates dma-buf"));
    }

    fn distance(gpu: u32, nic: &str, class: Option<&str>) -> Distance {
        Distance {
            gpu,
            nic: nic.to_owned(),
            class: class.map(str::to_owned),
            ..Distance::default()
        }
    }

    #[test]
    fn flat_or_missing_trees_give_no_preference() {
        let near_far = [
            distance(0, "mlx5_0", Some("PIX")),
            distance(0, "mlx5_1", Some("SYS")),
        ];
        assert!(preference(true, &near_far).0);
        let (prefers, note) = preference(false, &near_far);
        assert!(!prefers && note.contains("no PCIe tree"), "{note}");
        let flat = [
            distance(0, "mlx5_0", Some("PHB")),
            distance(0, "mlx5_1", Some("PHB")),
        ];
        let (prefers, note) = preference(true, &flat);
        assert!(!prefers && note.contains("flat"), "{note}");
        let unknown = [distance(0, "rxe0", None)];
        let (prefers, note) = preference(true, &unknown);
        assert!(!prefers && note.contains("no distance is known"), "{note}");
    }

    #[test]
    fn host_files_are_read_under_the_root() {
        let root = std::env::temp_dir().join(format!("gdr-info-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("proc/driver/nvidia")).unwrap();
        std::fs::create_dir_all(root.join("sys/module/nvidia_peermem")).unwrap();
        std::fs::write(root.join("proc/driver/nvidia/version"), PROPRIETARY).unwrap();
        std::fs::write(root.join("proc/self_limits"), LIMITS).unwrap();
        let host = HostFiles::at(&root);
        let mut report = Report::default();
        gather_host(&host, &mut report);
        assert_eq!(
            report.nvidia.kernel_module,
            Some(parse_nvidia_version(PROPRIETARY))
        );
        assert!(report.nvidia.peermem_loaded);
        // Nothing else is there: unknown, never a failure.
        assert_eq!(report.memlock.verdict, MemlockVerdict::Unknown);
        assert_eq!(report.kernel_release, None);
        std::fs::remove_dir_all(&root).unwrap();
        // A /proc/modules line names the module too.
        std::fs::create_dir_all(root.join("proc")).unwrap();
        std::fs::write(
            root.join("proc/modules"),
            "nv_peer_mem 16384 0 - Live 0x0\nnvidia 1 0 - Live 0x0\n",
        )
        .unwrap();
        let mut report = Report::default();
        gather_host(&HostFiles::at(&root), &mut report);
        assert_eq!(report.nvidia.peermem_module.as_deref(), Some("nv_peer_mem"));
        assert_eq!(report.nvidia.kernel_module, None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// The rung each simulated GPU leads to, with why the higher ones
    /// were refused.
    #[test]
    fn rungs_are_the_first_that_works_on_the_sim() {
        use gdr_sim::{GpuConfig, NodeConfig, SimFabric};
        let gathered = |gpu: GpuConfig| {
            let backends = Backends::sim(&SimFabric::new(), NodeConfig::default(), vec![gpu]);
            GatherDevices.run(backends)
        };
        let all = gathered(GpuConfig::default());
        assert_eq!(all.rungs.pairs.len(), 1);
        let pair = &all.rungs.pairs[0];
        assert_eq!((pair.nic.as_str(), pair.rung.as_str()), ("sim0", "dma-buf"));
        assert_eq!(pair.checks.len(), 2);
        assert!(pair.checks[0].works && pair.checks[0].reason.is_none());
        assert!(all.gpus.gpus[0].dma_buf);
        assert_eq!(all.rdma.devices[0].ports[0].roce_v2_gid_index, Some(3));

        let peermem = gathered(GpuConfig {
            dma_buf_supported: false,
            peermem: true,
            ..GpuConfig::default()
        });
        let pair = &peermem.rungs.pairs[0];
        assert_eq!(pair.rung, "peermem");
        assert_eq!(pair.checks[0].refused_by.as_deref(), Some("gpu"));
        assert!(!peermem.gpus.gpus[0].dma_buf);

        let neither = gathered(GpuConfig {
            dma_buf_supported: false,
            peermem: false,
            ..GpuConfig::default()
        });
        let pair = &neither.rungs.pairs[0];
        assert_eq!(pair.rung, "staging");
        assert!(pair.checks.iter().all(|c| !c.works && c.reason.is_some()));

        let no_gpu = GatherDevices.run(Backends::sim(
            &SimFabric::new(),
            NodeConfig::default(),
            Vec::new(),
        ));
        assert!(!no_gpu.rungs.probed && no_gpu.rungs.pairs.is_empty());
        assert!(no_gpu.gpus.error.is_some());
    }
}
