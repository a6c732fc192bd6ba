//! What to do about each "no" in a report.

use hal_cuda::WritesOrdering;
use hal_verbs::LinkLayer;

use super::text::{bytes_text, limit_text};
use super::{FlushOption, Hint, MemlockVerdict, RefusedBy, Report};
use crate::ladder::Rung;

/// What to do about each "no" in `report`.
pub(super) fn hints(report: &Report) -> Vec<Hint> {
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
        let dmabuf_works = report.rungs.pairs.iter().any(|p| p.rung == Rung::Dmabuf);
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
                        format!(
                            "{} port {} is {}",
                            device.name,
                            port.number,
                            port.state.map_or_else(String::new, |s| format!("{s:?}"))
                        ),
                        "bring the link up: check the cable and `ip link set <netdev> up`; \
                         `rdma link` shows which netdev the port is",
                    );
                } else if port.link_layer == Some(LinkLayer::Ethernet)
                    && port.roce_v2_gid_index.is_none()
                {
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
        if gpu.writes_ordering == Some(WritesOrdering::None)
            && !gpu.flush_options.contains(&FlushOption::Host)
        {
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
        if pair.rung != Rung::Staging {
            continue;
        }
        let nic_refused = pair
            .checks
            .iter()
            .any(|c| c.rung == Rung::Dmabuf && c.refused_by == Some(RefusedBy::Nic));
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
pub(super) fn kernel_before(release: &str, version: (u32, u32)) -> bool {
    let mut parts = release.split(['.', '-']).map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) < version,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::host::tests::{LIMITS, OPEN, PROPRIETARY};
    use crate::doctor::host::{memlock, parse_nvidia_version};
    use crate::doctor::*;
    use hal_verbs::PortState;

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
                        state: Some(PortState::Active),
                        active: true,
                        link_layer: Some(LinkLayer::Ethernet),
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
                    writes_ordering: Some(WritesOrdering::Owner),
                    flush_options: vec![FlushOption::Host],
                    ..GpuReport::default()
                }],
                error: None,
            },
            rungs: Rungs {
                probed: true,
                pairs: vec![PairRung {
                    nic: "mlx5_0".to_owned(),
                    gpu: 0,
                    rung: Rung::Dmabuf,
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
        r.rungs.pairs[0].rung = Rung::Staging;
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
        r.rdma.devices[0].ports[0].state = Some(PortState::Down);
        assert!(hinted(&r, "port 1 is Down"));

        let mut r = healthy();
        r.rdma.devices[0].ports[0].roce_v2_gid_index = None;
        assert!(hinted(&r, "no RoCE v2"));

        let mut r = healthy();
        r.gpus.gpus[0].dma_buf = false;
        assert!(hinted(&r, "does not export dma-bufs"));

        let mut r = healthy();
        r.gpus.gpus[0].writes_ordering = Some(WritesOrdering::None);
        r.gpus.gpus[0].flush_options.clear();
        assert!(hinted(&r, "neither orders"));

        let mut r = healthy();
        r.kernel_release = Some("5.4.0-150-generic".to_owned());
        assert!(hinted(&r, "predates dma-buf"));
    }
}
