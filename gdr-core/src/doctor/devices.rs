//! The device sections, gathered on the chosen backends: RDMA devices and
//! their ports, GPUs and their attributes, and the rung each (NIC, GPU)
//! pair takes, probed with a loopback self-check.

use hal_cuda::{Driver as _, FlushWritesOptions};
use hal_verbs::{AddressFamily, Context as _, Provider as _};

use super::{
    FlushOption, GidReport, GpuReport, GpuSection, PairRung, Port, RdmaDevice, RdmaSection,
    RefusedBy, Report, RungCheck, Rungs,
};
use crate::backend::Backends;
use crate::ladder::{Gpu, Ladder, Refusal, Rung};

/// The device sections, gathered on the chosen backends.
/// What [`gather`] found.
pub(super) struct Devices {
    verbs: String,
    cuda: Option<String>,
    notes: Vec<String>,
    pub(super) rdma: RdmaSection,
    pub(super) gpus: GpuSection,
    pub(super) rungs: Rungs,
}

impl Devices {
    pub(super) fn into_report(self, report: &mut Report) {
        report.backends.verbs = Some(self.verbs);
        report.backends.cuda = self.cuda;
        report.backends.notes = self.notes;
        report.rdma = self.rdma;
        report.gpus = self.gpus;
        report.rungs = self.rungs;
    }
}

/// What the doctor reports of `backends`' devices.
pub(super) fn gather(backends: Backends) -> Devices {
    {
        let gpus = match backends.cuda() {
            Some(driver) => gpu_section(driver),
            None => GpuSection {
                error: Some("no CUDA driver with a GPU".to_owned()),
                ..GpuSection::default()
            },
        };
        let rungs = match (backends.registrable_cuda(), backends.cuda()) {
            (Some(driver), _) => probe_rungs(backends.verbs(), driver),
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
            rdma: rdma_section(backends.verbs()),
            gpus,
            rungs,
        }
    }
}

fn rdma_section(provider: &hal_verbs::dynamic::DynProvider) -> RdmaSection {
    let mut section = RdmaSection {
        backend: Some(provider.backend_name().to_owned()),
        ..RdmaSection::default()
    };
    match provider.devices() {
        Ok(devices) => {
            section.devices = devices
                .into_iter()
                .map(|d| rdma_device(provider, d))
                .collect()
        }
        Err(e) => section.error = Some(e.to_string()),
    }
    section
}

fn rdma_device(
    provider: &hal_verbs::dynamic::DynProvider,
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
        .map(|number| port(&ctx, number))
        .collect();
    device
}

fn port(ctx: &hal_verbs::dynamic::DynContext, number: u8) -> Port {
    let mut port = Port {
        number,
        ..Port::default()
    };
    match ctx.query_port(number) {
        Ok(p) => {
            port.state = Some(p.state);
            port.active = matches!(p.state, hal_verbs::PortState::Active);
            port.link_layer = Some(p.link_layer);
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
                    kind: g.gid_type,
                    roce_v2: g.gid_type == hal_verbs::GidType::RoceV2,
                })
                .collect();
        }
        Err(e) => port.error = Some(format!("cannot read the GID table: {e}")),
    }
    port
}

fn gpu_section(driver: &hal_cuda::dynamic::DynDriver) -> GpuSection {
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
                writes_ordering: Some(a.writes_ordering),
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

fn flush_options(options: FlushWritesOptions) -> Vec<FlushOption> {
    let mut names = Vec::new();
    if options.contains(FlushWritesOptions::HOST) {
        names.push(FlushOption::Host);
    }
    if options.contains(FlushWritesOptions::MEMOPS) {
        names.push(FlushOption::Memops);
    }
    names
}

fn refused_by(refusal: &Refusal) -> RefusedBy {
    match refusal {
        Refusal::Gpu(_) => RefusedBy::Gpu,
        Refusal::Driver(_) => RefusedBy::Driver,
        Refusal::Nic(_) => RefusedBy::Nic,
        Refusal::SelfCheck(_) => RefusedBy::SelfCheck,
        Refusal::Policy => RefusedBy::Policy,
        Refusal::Budget(_) => RefusedBy::Budget,
    }
}

/// Each NIC's ladder over every GPU, each GPU-direct rung probed with a
/// loopback self-check; the rung taken is the first that works, else
/// staging through pinned host memory.
fn probe_rungs(
    provider: &hal_verbs::dynamic::DynProvider,
    driver: &hal_cuda::dynamic::DynDriver,
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
                    .map(|ordinal| Gpu::open(driver, ordinal))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| e.to_string())?;
                Ladder::standalone(&ctx, gpus).map_err(|e| e.to_string())
            });
        let ladder = match ladder {
            Ok(ladder) => ladder,
            Err(e) => {
                tracing::debug!(nic = %device.name, error = %e, "doctor: no ladder");
                rungs.errors.push(format!("{}: {e}", device.name));
                continue;
            }
        };
        let mut pairs: Vec<PairRung> = Vec::new();
        for (gpu, rung, verdict) in ladder.probe_all() {
            let check = RungCheck {
                rung,
                works: verdict.is_ok(),
                refused_by: verdict.as_ref().err().map(refused_by),
                reason: verdict.err().map(|r| r.to_string()),
            };
            match pairs.iter_mut().find(|p| p.gpu == gpu) {
                Some(pair) => pair.checks.push(check),
                None => pairs.push(PairRung {
                    nic: device.name.clone(),
                    gpu,
                    rung: Rung::Staging,
                    checks: vec![check],
                }),
            }
        }
        for pair in &mut pairs {
            pair.rung = pair
                .checks
                .iter()
                .find(|c| c.works)
                .map_or(Rung::Staging, |c| c.rung);
        }
        rungs.pairs.extend(pairs);
    }
    rungs
}

#[cfg(all(test, feature = "sim"))]
mod tests {
    use super::*;

    /// The rung each simulated GPU leads to, with why the higher ones
    /// were refused.
    #[test]
    fn rungs_are_the_first_that_works_on_the_sim() {
        use gdr_sim::{GpuConfig, NodeConfig, SimFabric};
        let gathered = |gpu: GpuConfig| {
            let backends = Backends::sim(&SimFabric::new(), NodeConfig::default(), vec![gpu]);
            gather(backends)
        };
        let all = gathered(GpuConfig::default());
        assert_eq!(all.rungs.pairs.len(), 1);
        let pair = &all.rungs.pairs[0];
        assert_eq!((pair.nic.as_str(), pair.rung), ("sim0", Rung::Dmabuf));
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
        assert_eq!(pair.rung, Rung::Peermem);
        assert_eq!(pair.checks[0].refused_by, Some(RefusedBy::Gpu));
        assert!(!peermem.gpus.gpus[0].dma_buf);

        let neither = gathered(GpuConfig {
            dma_buf_supported: false,
            peermem: false,
            ..GpuConfig::default()
        });
        let pair = &neither.rungs.pairs[0];
        assert_eq!(pair.rung, Rung::Staging);
        assert!(pair.checks.iter().all(|c| !c.works && c.reason.is_some()));

        let no_gpu = gather(Backends::sim(
            &SimFabric::new(),
            NodeConfig::default(),
            Vec::new(),
        ));
        assert!(!no_gpu.rungs.probed && no_gpu.rungs.pairs.is_empty());
        assert!(no_gpu.gpus.error.is_some());
    }
}
