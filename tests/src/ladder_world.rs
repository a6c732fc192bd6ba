//! A simulated node with NICs and one simulated GPU, a shared registration
//! cache and dma-buf exports: the world the ladder and lifetime tests
//! build their ladders in.

use std::sync::Arc;

use gdr_core::cache::{CacheConfig, RegistrationCache};
use gdr_core::ladder::{DmabufExports, Gpu, Ladder, LadderConfig, NicRegistrar};
use gdr_sim::{DeviceConfig, FaultPlan, GpuConfig, NodeConfig, SimCuda, SimFabric, SimVerbs};
use hal_cuda::Driver as _;
use hal_verbs::Provider as _;

use crate::init_tracing;

/// A ladder over the simulated NIC and GPU.
pub type SimLadder = Ladder;

/// One node (devices `sim0`, `sim1`, ... as given), one GPU, one fault
/// plan for both, one cache and one set of exports for every ladder.
pub struct LadderWorld {
    /// The fabric (its clock, its pause switch).
    pub fabric: SimFabric,
    /// The node.
    pub node: SimVerbs,
    /// The simulated GPU.
    pub cuda: SimCuda,
    /// `cuda` erased, as ladders hold it.
    pub driver: hal_cuda::dynamic::DynDriver,
    /// Faults of the NICs and the GPU.
    pub plan: FaultPlan,
    /// The cache every ladder registers through.
    pub cache: Arc<RegistrationCache<NicRegistrar>>,
    /// The dma-buf exports every ladder shares.
    pub exports: Arc<DmabufExports>,
}

impl std::fmt::Debug for LadderWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LadderWorld")
            .field("cache", &self.cache)
            .field("exports", &self.exports)
            .finish_non_exhaustive()
    }
}

impl LadderWorld {
    /// A node with `nics` and a GPU configured as `gpu`.
    pub fn new(nics: Vec<DeviceConfig>, gpu: GpuConfig) -> Self {
        init_tracing();
        let plan = FaultPlan::new();
        let fabric = SimFabric::with_faults(plan.clone());
        let node = fabric.add_node(
            "n",
            NodeConfig {
                ipv4: None,
                devices: nics,
            },
        );
        let cuda = SimCuda::new(vec![gpu], plan.clone());
        Self {
            fabric,
            node,
            driver: cuda.erased(),
            cuda,
            plan,
            cache: Arc::new(RegistrationCache::new(CacheConfig::default())),
            exports: Arc::new(DmabufExports::new()),
        }
    }

    /// A ladder on NIC `nic` for the GPU.
    pub fn ladder(&self, nic: &str, config: LadderConfig) -> SimLadder {
        let gpu = Gpu::open(&self.driver, 0).unwrap();
        self.ladder_with(nic, vec![gpu], config)
    }

    /// A ladder on NIC `nic` for `gpus`.
    pub fn ladder_with(&self, nic: &str, gpus: Vec<Gpu>, config: LadderConfig) -> SimLadder {
        let ctx = self.node.erased().open(nic).unwrap();
        Ladder::new(
            &ctx,
            gpus,
            Arc::clone(&self.cache),
            Arc::clone(&self.exports),
            config,
        )
        .unwrap()
    }

    /// The GPU's context.
    pub fn gpu(&self) -> hal_cuda::dynamic::DynContext {
        self.driver.context(0).unwrap()
    }
}
