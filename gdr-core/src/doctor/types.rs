//! The report's types: plain structs, serialized (serde) as `gdr info
//! --json` prints them. Where a caller would act on a value it is an enum
//! (the ladder's [`Rung`], the memlock verdict, port states, PCIe classes),
//! serialized as the same strings as before.

use std::fmt;

use hal_cuda::WritesOrdering;
use hal_verbs::{GidType, LinkLayer, PortState};
use serde::{Serialize, Serializer};

use crate::backend::BackendChoice;
use crate::ladder::Rung;

/// Everything the doctor found.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct Report {
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
#[non_exhaustive]
pub struct BackendsUsed {
    /// The choice asked for (JSON: `auto`, `real` or `sim`).
    #[serde(serialize_with = "choice_name")]
    pub asked: BackendChoice,
    /// The verbs backend (`rdma-core`, `sim`); `None` when none could be
    /// chosen.
    pub verbs: Option<String>,
    /// The CUDA backend (`cuda`, `sim`); `None` without a GPU.
    pub cuda: Option<String>,
    /// Why each backend is not the real one.
    pub notes: Vec<String>,
    /// Why the choice could not be met (`real` without rdma-core).
    pub error: Option<String>,
}

/// The native libraries.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct Libraries {
    /// rdma-core's verbs library.
    pub libibverbs: Library,
    /// rdma-core's connection manager.
    pub librdmacm: Library,
    /// The CUDA driver.
    pub libcuda: Library,
}

/// One native library.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct Library {
    /// The name it is loaded by (`libibverbs.so.1`).
    pub soname: String,
    /// Loaded and usable; `None` where not probed (`--backend sim`, or a
    /// build without the backend).
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
#[non_exhaustive]
pub struct Nvidia {
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
#[non_exhaustive]
pub struct KernelModule {
    /// Its version (`580.65.06`), where it says one.
    pub version: Option<String>,
    /// The open kernel module (which dma-buf export needs); `None` where it
    /// does not say.
    pub open: Option<bool>,
}

/// A resource limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Limit {
    /// No limit.
    Unlimited,
    /// This many bytes.
    Bytes(u64),
}

/// What the memlock limit means for registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum MemlockVerdict {
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
#[non_exhaustive]
pub struct Memlock {
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
#[non_exhaustive]
pub struct RdmaSection {
    /// The backend listing them (`rdma-core`, `sim`).
    pub backend: Option<String>,
    /// The devices.
    pub devices: Vec<RdmaDevice>,
    /// Why there is no list.
    pub error: Option<String>,
}

/// One RDMA device.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct RdmaDevice {
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
#[non_exhaustive]
pub struct Port {
    /// 1-based.
    pub number: u8,
    /// Its state; `None` where it could not be queried (JSON: `Active`,
    /// `Down`, ..., or `""`).
    #[serde(serialize_with = "debug_or_empty")]
    pub state: Option<PortState>,
    /// Its state is Active.
    pub active: bool,
    /// Ethernet (RoCE) or InfiniBand; `None` where not queried (JSON:
    /// `Ethernet`, `InfiniBand`, or `""`).
    #[serde(serialize_with = "debug_or_empty")]
    pub link_layer: Option<LinkLayer>,
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
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct GidReport {
    /// Table index.
    pub index: u32,
    /// The address it carries.
    pub address: String,
    /// Its type (JSON: `RoCE v2`, `RoCE v1` or `IB`).
    #[serde(serialize_with = "gid_kind")]
    pub kind: GidType,
    /// RoCE v2 (routable; what gdr uses on Ethernet).
    pub roce_v2: bool,
}

/// The GPUs of the CUDA backend.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct GpuSection {
    /// The backend listing them (`cuda`, `sim`).
    pub backend: Option<String>,
    /// The GPUs.
    pub gpus: Vec<GpuReport>,
    /// Why there is no list.
    pub error: Option<String>,
}

/// One GPU.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct GpuReport {
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
    /// `cuFlushGPUDirectRDMAWrites` options (JSON: `host`, `memops`).
    pub flush_options: Vec<FlushOption>,
    /// Who sees inbound RDMA writes in order; `None` where the attributes
    /// could not be read (JSON: `none`, `owner`, `all_devices`, or `""`).
    #[serde(serialize_with = "writes_ordering")]
    pub writes_ordering: Option<WritesOrdering>,
    /// The virtual memory management API (cuMemCreate).
    pub vmm: bool,
    /// Why its attributes could not be read.
    pub error: Option<String>,
}

/// One `cuFlushGPUDirectRDMAWrites` option a GPU offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FlushOption {
    /// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST`.
    Host,
    /// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_MEMOPS`.
    Memops,
}

impl FlushOption {
    /// Its name (`host`, `memops`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Memops => "memops",
        }
    }
}

/// GPU↔NIC PCIe distances.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct Topology {
    /// `/sys/devices` exists.
    pub sysfs_tree: bool,
    /// One entry per (GPU, NIC).
    pub pairs: Vec<Distance>,
    /// Whether gdr prefers some NIC for some GPU; the note says why not.
    pub preference: bool,
    /// What the distances mean for NIC choice.
    pub note: String,
}

/// NCCL's PCIe distance classes, nearest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum PciClass {
    /// Below one PCIe switch.
    Pix,
    /// Below one root port, through more than one switch.
    Pxb,
    /// Through the host bridge.
    Phb,
    /// Across root complexes of one NUMA node.
    Node,
    /// Across NUMA nodes.
    Sys,
}

impl fmt::Display for PciClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Pix => "PIX",
            Self::Pxb => "PXB",
            Self::Phb => "PHB",
            Self::Node => "NODE",
            Self::Sys => "SYS",
        })
    }
}

/// The distance of one (GPU, NIC) pair.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct Distance {
    /// GPU ordinal.
    pub gpu: u32,
    /// NIC name.
    pub nic: String,
    /// NCCL's class; `None` unknown.
    pub class: Option<PciClass>,
    /// Links between the two, below a shared bridge.
    pub hops: Option<u32>,
    /// Why it is unknown.
    pub unknown_because: Option<String>,
}

/// The registration rungs.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct Rungs {
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
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct PairRung {
    /// NIC name.
    pub nic: String,
    /// GPU ordinal.
    pub gpu: u32,
    /// The rung gdr takes: [`Rung::Dmabuf`], [`Rung::Peermem`] or
    /// [`Rung::Staging`] (JSON: `dma-buf`, `peermem`, `staging`).
    #[serde(serialize_with = "rung_name")]
    pub rung: Rung,
    /// Each GPU-direct rung probed, in ladder order.
    pub checks: Vec<RungCheck>,
}

/// One probed rung.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct RungCheck {
    /// [`Rung::Dmabuf`] or [`Rung::Peermem`] (JSON: `dma-buf`, `peermem`).
    #[serde(serialize_with = "rung_name")]
    pub rung: Rung,
    /// It works (registration and a loopback WRITE and READ).
    pub works: bool,
    /// Who refused.
    pub refused_by: Option<RefusedBy>,
    /// The refusal.
    pub reason: Option<String>,
}

/// Who refused a rung (the kind of the ladder's `Refusal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum RefusedBy {
    /// The GPU reports it cannot.
    Gpu,
    /// The CUDA driver refused.
    Driver,
    /// The NIC or its kernel driver refused the registration.
    Nic,
    /// Registration worked, the loopback self-check did not.
    SelfCheck,
    /// The caller's policy excludes the rung.
    Policy,
    /// The NIC's MR budget is spent.
    Budget,
}

/// What to do about a "no".
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Hint {
    /// What is missing or wrong.
    pub problem: String,
    /// What to do.
    pub fix: String,
}

/// The name a rung has in the report (`dma-buf`, `peermem`, `staging`,
/// `host`).
pub fn rung_label(rung: Rung) -> &'static str {
    match rung {
        Rung::HostMemory => "host",
        Rung::Dmabuf => "dma-buf",
        Rung::Peermem => "peermem",
        Rung::Staging => "staging",
    }
}

/// The name of a backend choice (`auto`, `real`, `sim`).
pub fn choice_label(choice: BackendChoice) -> &'static str {
    match choice {
        BackendChoice::Auto => "auto",
        BackendChoice::Real => "real",
        BackendChoice::Sim => "sim",
    }
}

/// The name of a GID type (`RoCE v2`, `RoCE v1`, `IB`).
pub(crate) fn gid_label(kind: GidType) -> &'static str {
    match kind {
        GidType::Ib => "IB",
        GidType::RoceV1 => "RoCE v1",
        GidType::RoceV2 => "RoCE v2",
    }
}

/// The name of a writes ordering (`none`, `owner`, `all_devices`).
pub(crate) fn ordering_label(ordering: WritesOrdering) -> &'static str {
    match ordering {
        WritesOrdering::None => "none",
        WritesOrdering::Owner => "owner",
        WritesOrdering::AllDevices => "all_devices",
    }
}

fn rung_name<S: Serializer>(rung: &Rung, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(rung_label(*rung))
}

fn choice_name<S: Serializer>(choice: &BackendChoice, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(choice_label(*choice))
}

fn gid_kind<S: Serializer>(kind: &GidType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(gid_label(*kind))
}

fn writes_ordering<S: Serializer>(
    ordering: &Option<WritesOrdering>,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(ordering.map_or("", ordering_label))
}

/// A value's `Debug` name (`Active`, `Ethernet`), `""` for `None`.
fn debug_or_empty<T: fmt::Debug, S: Serializer>(
    value: &Option<T>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(v) => s.collect_str(&format_args!("{v:?}")),
        None => s.serialize_str(""),
    }
}
