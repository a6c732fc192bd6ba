//! The run-time backend choice, shared by the `gdr` command, the C ABI and
//! library users: which verbs provider and which CUDA driver this process
//! uses, chosen once and erased (the HALs' `dynamic` modules), so that code
//! using them is compiled once for every combination.
//!
//! This module is the one place in gdr-core that names backends, each
//! behind a feature:
//!
//! | feature | backend | build needs |
//! | --- | --- | --- |
//! | `sim` | gdr-sim's simulated NIC and GPU | nothing native |
//! | `rdma` | rdma-core (`hal-verbs/rdma-core`) | cmake, libclang |
//! | `cuda` | the CUDA driver (`hal-cuda/cuda`) | nothing native |
//!
//! The module needs `sim`, or both `rdma` and `cuda`.
//!
//! ```no_run
//! use gdr_core::backend::{BackendChoice, Backends};
//! use hal_verbs::Provider as _;
//!
//! let backends = Backends::choose(BackendChoice::Auto)?;
//! let devices = backends.verbs().devices().map_or(0, |d| d.len());
//! # Ok::<(), gdr_core::backend::BackendError>(())
//! ```

use std::fmt;
use std::sync::Arc;

use hal_cuda::Driver as _;
use hal_verbs::Provider as _;

#[cfg(feature = "sim")]
use gdr_sim::{GpuConfig, NodeConfig, SimCuda, SimCudaApi, SimFabric, SimVerbsApi};
#[cfg(all(feature = "cuda", any(feature = "rdma", feature = "sim")))]
use hal_cuda::cuda::CudaApi;
#[cfg(feature = "cuda")]
use hal_cuda::cuda::CudaDriver;
#[cfg(feature = "rdma")]
use hal_verbs::rdma::{RdmaApi, RdmaProvider};

/// Which backends to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// Real hardware where it is found (a loadable library with a device),
    /// the simulation otherwise; each fallback is explained in
    /// [`Backends::notes`], and the first of a process is a `tracing`
    /// warning.
    #[default]
    Auto,
    /// Real verbs, or [`BackendError::Verbs`]; real CUDA where there is a
    /// GPU, else none (host memory only; [`Backends::cuda`] is `None`).
    /// Never the simulation.
    Real,
    /// The simulated NIC and GPU only.
    Sim,
}

/// Why no backends could be chosen.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// Real verbs were asked for ([`BackendChoice::Real`]) and rdma-core
    /// has no usable device.
    #[error("real RDMA verbs asked for, but rdma-core cannot be used: {source}")]
    Verbs {
        /// What rdma-core said.
        #[source]
        source: hal_verbs::VerbsError,
    },
    /// A backend was asked for that this build leaves out.
    #[error(
        "the {backend} backend was asked for, but gdr-core was built without feature `{feature}`"
    )]
    NotBuilt {
        /// The backend asked for.
        backend: &'static str,
        /// The gdr-core feature that would build it in.
        feature: &'static str,
    },
}

/// Makes a provider for another endpoint in this process.
type PeerFactory = Arc<dyn Fn() -> hal_verbs::dynamic::DynProvider + Send + Sync>;

/// The backends chosen for this process ([`Backends::choose`]): the
/// verbs provider, the CUDA driver where there is one, a way to make a
/// second endpoint in this process, and what was chosen and why.
pub struct Backends {
    verbs: hal_verbs::dynamic::DynProvider,
    cuda: Option<hal_cuda::dynamic::DynDriver>,
    gpu_reachable: bool,
    peer: PeerFactory,
    notes: Vec<String>,
}

impl fmt::Debug for Backends {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backends")
            .field("verbs", &self.verbs)
            .field("cuda", &self.cuda)
            .field("gpu_reachable", &self.gpu_reachable)
            .field("notes", &self.notes)
            .finish_non_exhaustive()
    }
}

impl Backends {
    /// Backends from parts, erased here (`hal_verbs::dynamic`,
    /// `hal_cuda::dynamic`), so one engine type serves every backend:
    /// `peer` makes the provider
    /// [`peer_provider`](Self::peer_provider) returns.
    pub fn new<Verbs: hal_verbs::Api, Cuda: hal_cuda::Api>(
        verbs: Verbs::Provider,
        cuda: Option<Cuda::Driver>,
        peer: impl Fn() -> Verbs::Provider + Send + Sync + 'static,
    ) -> Self {
        Self {
            verbs: hal_verbs::dynamic::DynProvider::new::<Verbs>(verbs),
            cuda: cuda.map(hal_cuda::dynamic::DynDriver::new::<Cuda>),
            gpu_reachable: true,
            peer: Arc::new(move || hal_verbs::dynamic::DynProvider::new::<Verbs>(peer())),
            notes: Vec::new(),
        }
    }

    /// The same backends with NICs that cannot register the GPUs' memory
    /// (as a simulated NIC beside a real GPU): GPU memory takes the
    /// staging rung, and [`nic_reaches_gpu`](Self::nic_reaches_gpu) is
    /// false.
    pub fn nic_cannot_reach_gpu(mut self) -> Self {
        self.gpu_reachable = false;
        self
    }

    /// Adds a note on what was chosen.
    pub fn with_note(mut self, note: impl Into<String>) -> Self {
        self.notes.push(note.into());
        self
    }

    /// The verbs provider.
    pub fn verbs(&self) -> &hal_verbs::dynamic::DynProvider {
        &self.verbs
    }

    /// The CUDA driver; `None` where there is no GPU to use.
    pub fn cuda(&self) -> Option<&hal_cuda::dynamic::DynDriver> {
        self.cuda.as_ref()
    }

    /// Whether the NIC can register the GPU's memory: false where a
    /// simulated NIC stands beside a real GPU (it cannot reach device
    /// memory), and where there is no GPU.
    pub fn nic_reaches_gpu(&self) -> bool {
        self.gpu_reachable && self.cuda.is_some()
    }

    /// The CUDA driver whose memory the NIC can register: [`cuda`](Self::cuda)
    /// where [`nic_reaches_gpu`](Self::nic_reaches_gpu), else `None`.
    pub fn registrable_cuda(&self) -> Option<&hal_cuda::dynamic::DynDriver> {
        self.cuda.as_ref().filter(|_| self.gpu_reachable)
    }

    /// A provider for a second endpoint in this process, whose connections
    /// reach this one's: on real hardware the same devices (a connection
    /// goes to the device's own address); on the simulation a new node on
    /// the same fabric (each call adds one), so two engines in one process
    /// connect through the simulated rdma_cm.
    pub fn peer_provider(&self) -> hal_verbs::dynamic::DynProvider {
        (self.peer)()
    }

    /// The verbs backend's name (`rdma-core`, `sim`).
    pub fn verbs_name(&self) -> &'static str {
        self.verbs.backend_name()
    }

    /// The CUDA backend's name (`cuda`, `sim`), where there is one.
    pub fn cuda_name(&self) -> Option<&'static str> {
        self.cuda.as_ref().map(|d| d.backend_name())
    }

    /// Why each backend was chosen where it was not the one asked for, and
    /// what that limits (e.g. `rdma-core: no RDMA device → simulated NIC`),
    /// for the caller to show.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }
}

#[cfg(feature = "sim")]
impl Backends {
    /// The simulation: node `local` on `fabric` with the devices of `node`,
    /// one simulated GPU per `gpus` (none: no CUDA driver), sharing the
    /// fabric's fault plan. Each [`peer_provider`](Self::peer_provider) call
    /// adds a node `peer<k>` with the same devices at an address of its own
    /// (`NodeConfig::ipv4` of `node` must not collide with those the fabric
    /// assigns, `10.77.<node>.1`).
    pub fn sim(fabric: &SimFabric, node: NodeConfig, gpus: Vec<GpuConfig>) -> Self {
        let mut peer_config = node.clone();
        peer_config.ipv4 = None;
        for device in &mut peer_config.devices {
            device.ipv4 = None;
        }
        let verbs = fabric.add_node("local", node);
        let cuda = (!gpus.is_empty()).then(|| SimCuda::new(gpus, fabric.faults()));
        let fabric = fabric.clone();
        let peers = std::sync::atomic::AtomicUsize::new(1);
        Self::new::<SimVerbsApi, SimCudaApi>(verbs, cuda, move || {
            let k = peers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            fabric.add_node(&format!("peer{k}"), peer_config.clone())
        })
    }

    /// [`sim`](Self::sim) on a new fabric: one default device, one default
    /// GPU.
    pub fn sim_default() -> Self {
        Self::sim(
            &SimFabric::new(),
            NodeConfig::default(),
            vec![GpuConfig::default()],
        )
    }
}

/// The verbs backend picked.
enum VerbsPick {
    #[cfg(feature = "rdma")]
    Real(RdmaProvider),
    #[cfg(feature = "sim")]
    Sim,
}

/// The CUDA backend picked.
// Built with no verbs backend, `choose` never gets to use a CUDA pick.
#[cfg_attr(not(any(feature = "rdma", feature = "sim")), allow(dead_code))]
enum CudaPick {
    #[cfg(feature = "cuda")]
    Real(CudaDriver),
    #[cfg(feature = "sim")]
    Sim,
    None,
}

/// Real verbs: a loaded rdma-core with at least one device.
#[cfg(feature = "rdma")]
fn real_verbs_found() -> Result<RdmaProvider, BackendError> {
    let provider = RdmaProvider::load().map_err(|source| BackendError::Verbs { source })?;
    match provider.devices() {
        Ok(devices) if !devices.is_empty() => {
            tracing::debug!(devices = devices.len(), "verbs backend: rdma-core");
            Ok(provider)
        }
        Ok(_) => Err(BackendError::Verbs {
            source: hal_verbs::VerbsError::NoDevice {
                detail: "rdma-core lists no device".to_owned(),
            },
        }),
        Err(source) => Err(BackendError::Verbs { source }),
    }
}

#[cfg(not(feature = "rdma"))]
fn real_verbs_found() -> Result<std::convert::Infallible, BackendError> {
    Err(BackendError::NotBuilt {
        backend: "rdma-core",
        feature: "rdma",
    })
}

fn pick_verbs(choice: BackendChoice, notes: &mut Vec<String>) -> Result<VerbsPick, BackendError> {
    if choice != BackendChoice::Sim {
        let missing = match real_verbs_found() {
            #[cfg(feature = "rdma")]
            Ok(provider) => return Ok(VerbsPick::Real(provider)),
            #[cfg(not(feature = "rdma"))]
            Ok(never) => match never {},
            Err(e) => e,
        };
        // Real only, or nothing to fall back to: the reason is the error.
        if choice == BackendChoice::Real || cfg!(not(feature = "sim")) {
            return Err(missing);
        }
        let missing = match missing {
            BackendError::Verbs { source } => source.to_string(),
            other => other.to_string(),
        };
        notes.push(format!(
            "rdma-core: {missing}\n  -> using the simulated NIC (gdr-sim)"
        ));
    }
    #[cfg(feature = "sim")]
    {
        tracing::debug!(?choice, "verbs backend: sim");
        Ok(VerbsPick::Sim)
    }
    #[cfg(not(feature = "sim"))]
    Err(BackendError::NotBuilt {
        backend: "simulation",
        feature: "sim",
    })
}

/// Real CUDA: a loaded driver with at least one GPU; why not otherwise.
#[cfg(any(feature = "rdma", feature = "sim"))]
fn real_cuda_found() -> Result<CudaPick, String> {
    #[cfg(feature = "cuda")]
    {
        // `device_count` is never Ok(0): no GPU is an error.
        match CudaDriver::load().and_then(|d| d.device_count().map(|n| (d, n))) {
            Ok((driver, gpus)) => {
                tracing::debug!(gpus, "CUDA backend: cuda");
                Ok(CudaPick::Real(driver))
            }
            Err(e) => Err(e.to_string()),
        }
    }
    #[cfg(not(feature = "cuda"))]
    Err("not built in (gdr-core feature `cuda`)".to_owned())
}

#[cfg(any(feature = "rdma", feature = "sim"))]
fn pick_cuda(choice: BackendChoice, notes: &mut Vec<String>) -> CudaPick {
    if choice != BackendChoice::Sim {
        let missing = match real_cuda_found() {
            Ok(pick) => return pick,
            Err(missing) => missing,
        };
        // The simulated GPU only where the simulation may stand in.
        if choice == BackendChoice::Real || cfg!(not(feature = "sim")) {
            notes.push(format!("CUDA: {missing}\n  -> no GPU: host memory only"));
            return CudaPick::None;
        }
        notes.push(format!(
            "CUDA: {missing}\n  -> using the simulated GPU (gdr-sim)"
        ));
    }
    #[cfg(feature = "sim")]
    {
        tracing::debug!(?choice, "CUDA backend: sim");
        CudaPick::Sim
    }
    #[cfg(not(feature = "sim"))]
    CudaPick::None
}

/// A real provider's backends: its peer endpoint is the same devices.
#[cfg(feature = "rdma")]
fn real_verbs(
    provider: RdmaProvider,
    cuda: Option<hal_cuda::dynamic::DynDriver>,
    notes: Vec<String>,
) -> Backends {
    let peer = provider.clone();
    Backends {
        verbs: hal_verbs::dynamic::DynProvider::new::<RdmaApi>(provider),
        cuda,
        gpu_reachable: true,
        peer: Arc::new(move || hal_verbs::dynamic::DynProvider::new::<RdmaApi>(peer.clone())),
        notes,
    }
}

/// The simulated fabric of this process: every simulated NIC the library
/// opens by itself ([`BackendChoice::Sim`], or the fallback where rdma-core
/// has no device) is a node of it, so the engines of one process reach
/// each other as machines of one network do.
#[cfg(feature = "sim")]
pub(crate) static SIM_FABRIC: std::sync::LazyLock<SimFabric> =
    std::sync::LazyLock::new(SimFabric::new);

/// First address of [`SIM_FABRIC`]'s nodes: 10.128.0.0/9, four addresses
/// a node (apart from the `10.77.<node>.1` the fabric assigns itself).
#[cfg(feature = "sim")]
const SIM_NODE_BASE: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 128, 0, 1);

/// An address of its own for the next node of [`SIM_FABRIC`]; `None` once
/// 10.128.0.0/9 is used up.
#[cfg(feature = "sim")]
pub(crate) fn next_sim_node_address() -> Option<std::net::Ipv4Addr> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NODES: AtomicU32 = AtomicU32::new(0);
    NODES
        .fetch_add(1, Ordering::Relaxed)
        .checked_mul(4)
        .and_then(|o| u32::from(SIM_NODE_BASE).checked_add(o))
        .map(std::net::Ipv4Addr::from)
        .filter(|a| a.octets()[0] == 10)
}

/// The simulated NIC (a new node of [`SIM_FABRIC`], one default device)
/// beside `cuda`.
#[cfg(feature = "sim")]
pub(crate) fn sim_verbs(
    cuda: Option<hal_cuda::dynamic::DynDriver>,
    notes: Vec<String>,
) -> Backends {
    let node = NodeConfig {
        ipv4: next_sim_node_address(),
        ..NodeConfig::default()
    };
    let sim = Backends::sim(&SIM_FABRIC, node, Vec::new());
    Backends {
        verbs: sim.verbs,
        cuda,
        gpu_reachable: true,
        peer: sim.peer,
        notes,
    }
}

/// A simulated GPU; host-visible (its memory has host addresses) when
/// `host_visible`, so a real NIC can register it as nvidia-peermem would
/// pin GPU memory.
#[cfg(feature = "sim")]
fn sim_gpu(host_visible: bool) -> SimCuda {
    SimCuda::new(
        vec![GpuConfig {
            host_visible,
            ..GpuConfig::default()
        }],
        Default::default(),
    )
}

/// Tells, once per process, that [`BackendChoice::Auto`] fell back to the
/// simulation: a program meant for real hardware would otherwise run on a
/// simulated NIC or GPU without a word (each context's notes keep every
/// fallback's reason; this says it where logs are read).
#[cfg(feature = "sim")]
fn warn_fallback_once(nic: bool, notes: &[String]) {
    use std::sync::atomic::{AtomicBool, Ordering};
    static WARNED: AtomicBool = AtomicBool::new(false);
    if WARNED.swap(true, Ordering::Relaxed) {
        return;
    }
    let why = notes
        .iter()
        .map(|n| n.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("; ");
    if nic {
        tracing::warn!(
            %why,
            "backend auto fell back to the simulation (gdr-sim): nothing moved over its \
             simulated NIC leaves this process; BackendChoice::Real (backend=\"real\") fails \
             instead (told once per process)"
        );
    } else {
        tracing::warn!(
            %why,
            "backend auto fell back to the simulation (gdr-sim) for the GPU: its GPU memory is \
             simulated host memory (told once per process)"
        );
    }
}

impl Backends {
    /// Chooses backends as `choice` says, among the combinations the
    /// enabled features allow: real verbs and real CUDA, real verbs and
    /// the simulated GPU (host-visible, standing in for peermem-pinned
    /// memory), the simulated NIC beside a real GPU (which it cannot reach:
    /// [`Backends::nic_reaches_gpu`] is false), and the simulation alone.
    /// Fails only where `choice` cannot be met.
    pub fn choose(choice: BackendChoice) -> Result<Self, BackendError> {
        let mut notes = Vec::new();
        let verbs = pick_verbs(choice, &mut notes)?;
        // No verbs backend built: `pick_verbs` has returned its error.
        #[cfg(not(any(feature = "rdma", feature = "sim")))]
        match verbs {}
        #[cfg(any(feature = "rdma", feature = "sim"))]
        {
            let cuda = pick_cuda(choice, &mut notes);
            Ok(Self::from_picks(choice, verbs, cuda, notes))
        }
    }

    #[cfg(any(feature = "rdma", feature = "sim"))]
    fn from_picks(
        choice: BackendChoice,
        verbs: VerbsPick,
        cuda: CudaPick,
        #[allow(unused_mut)] mut notes: Vec<String>, // pushed to where the sim stands in
    ) -> Self {
        #[cfg(feature = "sim")]
        if choice == BackendChoice::Auto
            && (matches!(verbs, VerbsPick::Sim) || matches!(cuda, CudaPick::Sim))
        {
            warn_fallback_once(matches!(verbs, VerbsPick::Sim), &notes);
        }
        let _span = tracing::debug_span!("backends", ?choice).entered();
        #[cfg(all(feature = "cuda", any(feature = "rdma", feature = "sim")))]
        let real_gpu = |d: CudaDriver| Some(hal_cuda::dynamic::DynDriver::new::<CudaApi>(d));
        #[cfg(feature = "sim")]
        let sim_gpu = |host_visible| {
            Some(hal_cuda::dynamic::DynDriver::new::<SimCudaApi>(sim_gpu(
                host_visible,
            )))
        };
        match (verbs, cuda) {
            #[cfg(all(feature = "rdma", feature = "cuda"))]
            (VerbsPick::Real(p), CudaPick::Real(d)) => real_verbs(p, real_gpu(d), notes),
            #[cfg(feature = "rdma")]
            (VerbsPick::Real(p), CudaPick::None) => real_verbs(p, None, notes),
            #[cfg(all(feature = "rdma", feature = "sim"))]
            (VerbsPick::Real(p), CudaPick::Sim) => {
                notes.push(
                    "simulated GPU memory is host-visible here, standing in for peermem-pinned GPU memory"
                        .to_owned(),
                );
                real_verbs(p, sim_gpu(true), notes)
            }
            #[cfg(all(feature = "sim", feature = "cuda"))]
            (VerbsPick::Sim, CudaPick::Real(d)) => {
                notes.push(
                    "a simulated NIC cannot reach real GPU memory: GPU memory is staged through \
                     pinned host memory, and moves between engines of this process by device copies"
                        .to_owned(),
                );
                sim_verbs(real_gpu(d), notes).nic_cannot_reach_gpu()
            }
            #[cfg(feature = "sim")]
            (VerbsPick::Sim, CudaPick::Sim) => sim_verbs(sim_gpu(false), notes),
            #[cfg(feature = "sim")]
            (VerbsPick::Sim, CudaPick::None) => sim_verbs(None, notes),
        }
    }
}

#[cfg(all(test, feature = "sim"))]
mod tests {
    use std::net::{IpAddr, SocketAddr};
    use std::time::Duration;

    use hal_cuda::Driver;
    use hal_verbs::{
        AddressFamily, ConnectParams, ConnectRequest, Connection, ConnectionManager, Context,
        Listener, Provider, QpState, QueuePair, select_roce_v2_gid,
    };

    use super::*;

    /// What a task saw of its backends.
    #[derive(Debug, PartialEq, Eq)]
    struct Seen {
        verbs: &'static str,
        cuda: Option<&'static str>,
        gpus: u32,
        reaches_gpu: bool,
        devices: Vec<String>,
        notes: usize,
    }

    fn look(backends: &Backends) -> Seen {
        {
            Seen {
                verbs: backends.verbs_name(),
                cuda: backends.cuda_name(),
                gpus: backends.cuda().map_or(0, |d| d.device_count().unwrap()),
                reaches_gpu: backends.nic_reaches_gpu(),
                devices: backends
                    .verbs()
                    .devices()
                    .unwrap()
                    .into_iter()
                    .map(|d| d.name)
                    .collect(),
                notes: backends.notes().len(),
            }
        }
    }

    #[test]
    fn the_sim_choice_is_the_simulation() {
        let seen = look(&Backends::choose(BackendChoice::Sim).unwrap());
        assert_eq!(
            seen,
            Seen {
                verbs: "sim",
                cuda: Some("sim"),
                gpus: 1,
                reaches_gpu: true,
                devices: vec!["sim0".to_owned()],
                // Asked for the simulation: nothing to explain.
                notes: 0,
            }
        );
    }

    #[test]
    fn auto_falls_back_with_a_note_per_missing_backend() {
        let seen = look(&Backends::choose(BackendChoice::Auto).unwrap());
        // Hardware where it is found; each backend not found is explained.
        let simulated = usize::from(seen.verbs == "sim") + usize::from(seen.cuda == Some("sim"));
        assert!(seen.notes >= simulated, "{seen:?}");
    }

    /// The address of `provider`'s first device: the IPv4 address in its
    /// RoCE v2 GID of port 1.
    fn address(provider: &hal_verbs::dynamic::DynProvider) -> (String, IpAddr) {
        let device = provider.devices().unwrap().remove(0).name;
        let ctx = provider.open(&device).unwrap();
        let table = ctx.gid_table(1).unwrap();
        let gid = select_roce_v2_gid(&table, AddressFamily::V4).expect("a RoCE v2 IPv4 GID");
        (device, gid.gid.to_ip())
    }

    /// Listens on the first provider's address and connects to it from the
    /// peer provider, on two threads, through the HAL traits only.
    fn connect_to_peer(backends: &Backends) -> (String, String) {
        {
            let server = backends.verbs();
            let client = backends.peer_provider();
            let (device, ip) = address(server);
            let (_, client_ip) = address(&client);
            assert_ne!(ip, client_ip, "the peer is another endpoint");

            let server_ctx = server.open(&device).unwrap();
            let server_pd = server_ctx.alloc_pd().unwrap();
            let server_cq = server_ctx.create_cq(16).unwrap();
            let client_ctx = client.open(&address(&client).0).unwrap();
            let client_pd = client_ctx.alloc_pd().unwrap();
            let client_cq = client_ctx.create_cq(16).unwrap();
            let params = ConnectParams {
                timeout: Duration::from_secs(5),
                ..ConnectParams::default()
            };
            let listener = server
                .connection_manager()
                .unwrap()
                .listen(SocketAddr::new(ip, 7480), 4)
                .unwrap();
            let client_cm = client.connection_manager().unwrap();
            std::thread::scope(|s| {
                let accepted = s.spawn(|| {
                    let request = listener.next_request(Duration::from_secs(5)).unwrap();
                    assert_eq!(request.private_data(), b"hello");
                    request
                        .accept(&server_pd, &server_cq, &server_cq, &params, b"welcome")
                        .unwrap()
                });
                let conn = client_cm
                    .connect(
                        SocketAddr::new(ip, 7480),
                        &client_pd,
                        &client_cq,
                        &client_cq,
                        &params,
                        b"hello",
                    )
                    .unwrap();
                let server_conn = accepted.join().unwrap();
                assert_eq!(conn.qp().state().unwrap(), QpState::ReadyToSend);
                assert_eq!(server_conn.peer_addr().ip(), client_ip);
                (
                    String::from_utf8(conn.peer_private_data()).unwrap(),
                    String::from_utf8(server_conn.peer_private_data()).unwrap(),
                )
            })
        }
    }

    #[test]
    fn the_peer_provider_connects_to_the_first_over_rdma_cm() {
        let (client_saw, server_saw) =
            connect_to_peer(&Backends::choose(BackendChoice::Sim).unwrap());
        assert_eq!(client_saw, "welcome");
        assert_eq!(server_saw, "hello");
        // A chosen set-up does the same.
        let fabric = SimFabric::new();
        let backends = Backends::sim(&fabric, NodeConfig::default(), Vec::new());
        assert!(backends.cuda().is_none() && !backends.nic_reaches_gpu());
        assert_eq!(connect_to_peer(&backends).0, "welcome");
    }
}
