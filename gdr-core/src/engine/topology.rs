//! Which NIC is nearest a GPU: PCIe distance read from sysfs.
//!
//! Every PCI device appears in sysfs at the end of a chain of bridges under
//! its root complex, e.g.
//! `/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0`
//! (root complex `pci0000:00`, root port `0000:00:01.0`, a switch's upstream
//! port `0000:01:00.0` and downstream port `0000:02:08.0`, the device). An
//! RDMA device's `/sys/class/infiniband/<dev>/device` link and a GPU's
//! `/sys/bus/pci/devices/<bus id>` link resolve to such a path; how far two
//! devices are is read off the longest chain both paths share.
//!
//! The classes are NCCL's ([`PciDistance`]): through one switch (`PIX`),
//! through several bridges below the host bridge (`PXB`), through the host
//! bridge (`PHB`), across host bridges of one NUMA node (`NODE`), across
//! NUMA nodes (`SYS`). What sysfs does not show (a software device such as
//! rxe or siw, a missing tree, a malformed bus id) is unknown: such NICs rank
//! after every NIC whose distance is known, in the order given.
//!
//! Everything is read under a root directory, `/` on a real system, so tests
//! build a fake tree ([`PciTopology::at`]).

use std::cmp::Reverse;
use std::fs;
use std::path::{Component, Path, PathBuf};

/// How far apart two PCI devices are, nearest first (the derived order is
/// the ranking order: a smaller value is nearer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PciDistance {
    /// NCCL's `PIX`: below one PCIe switch (or one bridge): `hops` links
    /// from one device up to the switch and down to the other, 4 for two
    /// downstream ports of one switch. The best case for GPUDirect RDMA.
    Pix {
        /// Links between the two devices through their common bridge.
        hops: u32,
    },
    /// NCCL's `PXB`: below one root port, through more than one switch, but
    /// not through the host bridge.
    Pxb {
        /// Links between the two devices through their common bridge.
        hops: u32,
    },
    /// NCCL's `PHB`: one root complex, different root ports: traffic crosses
    /// the host bridge (the CPU's PCIe root).
    Phb,
    /// NCCL's `NODE`: different root complexes of one NUMA node.
    Node,
    /// NCCL's `SYS`: different root complexes on different (or unknown) NUMA
    /// nodes: traffic crosses the inter-socket link. The far class.
    Sys,
}

impl PciDistance {
    /// A rough link count, for logs and comparisons across classes: exact
    /// below a shared bridge, `u32::MAX`-ish beyond.
    pub fn hops(self) -> u32 {
        match self {
            Self::Pix { hops } | Self::Pxb { hops } => hops,
            Self::Phb => u32::MAX - 2,
            Self::Node => u32::MAX - 1,
            Self::Sys => u32::MAX,
        }
    }
}

/// A PCI device's place in the tree, from its canonical sysfs path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciPath {
    /// The canonical sysfs directory of the device.
    path: PathBuf,
    /// What lies above the first PCI function (`pci0000:00`, or a longer
    /// platform path on Hyper-V): devices with different roots share no
    /// bridge.
    root: PathBuf,
    /// The PCI functions from the root port down to the device itself.
    chain: Vec<String>,
}

impl PciPath {
    /// The canonical sysfs directory of the device.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The device's bus id (`0000:03:00.0`).
    pub fn bus_id(&self) -> &str {
        // Never empty: `parse` requires the device itself to be a function.
        self.chain.last().map_or("", String::as_str)
    }

    /// The NUMA node the kernel reports for the device, where it knows one.
    fn numa_node(&self) -> Option<u32> {
        let text = fs::read_to_string(self.path.join("numa_node")).ok()?;
        // `-1`: no affinity known; it fails to parse as u32.
        text.trim().parse().ok()
    }

    /// The device under `devices` (a canonical `<root>/sys/devices`) at
    /// canonical `path`; `None` unless it ends in a PCI function.
    fn parse(devices: &Path, path: PathBuf) -> Option<Self> {
        let relative = path.strip_prefix(devices).ok()?;
        let parts: Vec<&str> = relative
            .components()
            .map(|c| match c {
                Component::Normal(part) => part.to_str(),
                _ => None,
            })
            .collect::<Option<_>>()?;
        let first = parts.iter().position(|p| is_bus_id(p))?;
        if !is_bus_id(parts.last()?) {
            // A netdev, a virtio device, ...: not a PCI function itself.
            return None;
        }
        let root = parts[..first].iter().collect();
        // Non-function parts below the first function (a VMD domain's
        // `pci10000:e0`) add no bridge of their own.
        let chain = parts[first..]
            .iter()
            .filter(|p| is_bus_id(p))
            .map(|p| (*p).to_owned())
            .collect();
        Some(Self { path, root, chain })
    }
}

/// How far apart devices `a` and `b` are (see [`PciDistance`]).
pub fn distance(a: &PciPath, b: &PciPath) -> PciDistance {
    if a.root != b.root {
        return match (a.numa_node(), b.numa_node()) {
            (Some(x), Some(y)) if x == y => PciDistance::Node,
            _ => PciDistance::Sys,
        };
    }
    let shared = a
        .chain
        .iter()
        .zip(&b.chain)
        .take_while(|(x, y)| x == y)
        .count();
    if shared == 0 {
        // Different root ports of one root complex.
        return PciDistance::Phb;
    }
    let hops = (a.chain.len() - shared + b.chain.len() - shared) as u32;
    // Two downstream ports of the switch below the common bridge: up two
    // links, down two.
    if hops <= 4 {
        PciDistance::Pix { hops }
    } else {
        PciDistance::Pxb { hops }
    }
}

/// Whether `text` is a PCI bus id `<domain>:<bus>:<device>.<function>`
/// (lower-case hex; a domain of 4 digits, or more as VMD's).
fn is_bus_id(text: &str) -> bool {
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let mut parts = text.split(':');
    let (Some(domain), Some(bus), Some(slot), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let Some((device, function)) = slot.split_once('.') else {
        return false;
    };
    domain.len() >= 4
        && hex(domain, domain.len())
        && hex(bus, 2)
        && hex(device, 2)
        && hex(function, 1)
}

/// A GPU's bus id as sysfs names it: lower case, a 4-digit domain. CUDA
/// (`cuDeviceGetPCIBusId`) and NVML write the domain with 8 digits
/// (`00000000:17:00.0`); a missing domain is `0000`. `None` when `id` is
/// no bus id at all.
pub fn normalize_bus_id(id: &str) -> Option<String> {
    let id = id.trim().to_ascii_lowercase();
    let id = match id.matches(':').count() {
        1 => format!("0000:{id}"),
        _ => id,
    };
    let (domain, rest) = id.split_once(':')?;
    let significant = domain.trim_start_matches('0');
    let domain = if significant.len() <= 4 {
        format!("{significant:0>4}")
    } else {
        significant.to_owned()
    };
    let normal = format!("{domain}:{rest}");
    is_bus_id(&normal).then_some(normal)
}

/// The PCI tree of a machine, read from sysfs under a root directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciTopology {
    root: PathBuf,
}

impl PciTopology {
    /// This machine's tree (`/sys`).
    pub fn system() -> Self {
        Self::at("/")
    }

    /// The tree under `root` (`<root>/sys/...`): a fake tree in tests, a
    /// container's view of the host.
    pub fn at(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The canonical `<root>/sys/devices`, if it exists.
    fn devices(&self) -> Option<PathBuf> {
        self.root.join("sys/devices").canonicalize().ok()
    }

    /// Where RDMA device `name` (`mlx5_0`) sits in the PCI tree; `None` for
    /// a software device (rxe, siw: they have a `parent` attribute naming
    /// their netdev, and their `device` link, where there is one, leads to
    /// no PCI function of their own) or where sysfs does not say.
    pub fn nic_path(&self, name: &str) -> Option<PciPath> {
        let class = self.root.join("sys/class/infiniband").join(name);
        if class.join("parent").exists() {
            tracing::debug!(nic = name, "software RDMA device: no PCI place");
            return None;
        }
        let path = class.join("device").canonicalize().ok()?;
        PciPath::parse(&self.devices()?, path)
    }

    /// Where the GPU with PCI bus id `bus_id` sits (any of the forms
    /// [`normalize_bus_id`] takes).
    pub fn gpu_path(&self, bus_id: &str) -> Option<PciPath> {
        let bus_id = normalize_bus_id(bus_id)?;
        let path = self
            .root
            .join("sys/bus/pci/devices")
            .join(&bus_id)
            .canonicalize()
            .ok()?;
        PciPath::parse(&self.devices()?, path)
    }

    /// The distance from the GPU `gpu_bus_id` to each of `nics`, in their
    /// order; `None` where it is unknown (no GPU, no tree, a software NIC).
    pub fn nic_distances(
        &self,
        gpu_bus_id: Option<&str>,
        nics: &[&str],
    ) -> Vec<Option<PciDistance>> {
        let gpu = gpu_bus_id.and_then(|id| {
            let path = self.gpu_path(id);
            if path.is_none() {
                tracing::debug!(gpu = id, root = %self.root.display(), "GPU not found in the PCI tree");
            }
            path
        });
        nics.iter()
            .map(|nic| {
                let gpu = gpu.as_ref()?;
                let Some(path) = self.nic_path(nic) else {
                    tracing::debug!(nic, "NIC not found in the PCI tree: distance unknown");
                    return None;
                };
                let d = distance(gpu, &path);
                tracing::debug!(nic, gpu = gpu.bus_id(), bus_id = path.bus_id(), distance = ?d, "PCIe distance");
                Some(d)
            })
            .collect()
    }

    /// Indices of `nics`, nearest the GPU `gpu_bus_id` first. NICs at equal
    /// distance keep the given order, and so do NICs whose distance is
    /// unknown, after all the others; without a GPU, or without a tree to
    /// read, the order is the given one.
    pub fn rank_nics(&self, gpu_bus_id: Option<&str>, nics: &[&str]) -> Vec<usize> {
        let distances = self.nic_distances(gpu_bus_id, nics);
        let mut order: Vec<usize> = (0..nics.len()).collect();
        // Stable: ties keep their order. Known distances before unknown.
        order.sort_by_key(|&i| (Reverse(distances[i].is_some()), distances[i]));
        tracing::debug!(
            gpu = gpu_bus_id,
            ranked = ?order.iter().map(|&i| (nics[i], distances[i])).collect::<Vec<_>>(),
            "NICs ranked by PCIe distance"
        );
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fake sysfs tree in a fresh temporary directory, removed on drop.
    struct FakeSys {
        root: PathBuf,
    }

    impl FakeSys {
        fn new(name: &str) -> Self {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let root = std::env::temp_dir().join(format!(
                "gdr-topology-{}-{name}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir_all(root.join("sys/devices")).unwrap();
            Self { root }
        }

        fn topology(&self) -> PciTopology {
            PciTopology::at(&self.root)
        }

        /// Creates device directory `sys/devices/<path>` with `numa_node`.
        fn device(&self, path: &str, numa: i32) -> PathBuf {
            let dir = self.root.join("sys/devices").join(path);
            fs::create_dir_all(&dir).unwrap();
            fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
            dir
        }

        /// A GPU at `path`, linked (relatively, as sysfs does) from
        /// `sys/bus/pci/devices/<its bus id>`.
        fn gpu(&self, path: &str, numa: i32) {
            self.device(path, numa);
            let links = self.root.join("sys/bus/pci/devices");
            fs::create_dir_all(&links).unwrap();
            let bus_id = path.rsplit('/').next().unwrap();
            symlink(Path::new("../../../devices").join(path), links.join(bus_id)).unwrap();
        }

        /// RDMA device `name` whose `device` link leads to `sys/devices/<path>`.
        fn nic(&self, name: &str, path: &str, numa: i32) {
            let target = self.device(path, numa);
            let class = self.root.join("sys/class/infiniband").join(name);
            fs::create_dir_all(&class).unwrap();
            symlink(target, class.join("device")).unwrap();
        }

        /// A software RDMA device over netdev `netdev` (rxe): a `parent`
        /// attribute, and `device` leading to the netdev when `linked`.
        fn rxe(&self, name: &str, netdev_path: Option<&str>) {
            let class = self.root.join("sys/class/infiniband").join(name);
            fs::create_dir_all(&class).unwrap();
            fs::write(class.join("parent"), "eth0\n").unwrap();
            if let Some(path) = netdev_path {
                symlink(self.device(path, 0), class.join("device")).unwrap();
            }
        }
    }

    impl Drop for FakeSys {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.root);
        }
    }

    const GPU: &str = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0";
    const NEAR: &str = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0";
    const FAR: &str = "pci0000:80/0000:80:01.0/0000:81:00.0";

    /// One GPU and a NIC under one switch (node 0), one NIC on another root
    /// complex on the other socket.
    fn two_socket_box(name: &str) -> FakeSys {
        let sys = FakeSys::new(name);
        sys.gpu(GPU, 0);
        sys.nic("mlx5_0", FAR, 1);
        sys.nic("mlx5_1", NEAR, 0);
        sys
    }

    #[test]
    fn the_nic_under_the_gpus_switch_ranks_first() {
        let sys = two_socket_box("switch");
        let topo = sys.topology();
        let nics = ["mlx5_0", "mlx5_1"];
        assert_eq!(topo.rank_nics(Some("0000:03:00.0"), &nics), vec![1, 0]);
        assert_eq!(
            topo.nic_distances(Some("0000:03:00.0"), &nics),
            vec![Some(PciDistance::Sys), Some(PciDistance::Pix { hops: 4 })]
        );
        // Given the other way round, still the near one first.
        assert_eq!(
            topo.rank_nics(Some("0000:03:00.0"), &["mlx5_1", "mlx5_0"]),
            vec![0, 1]
        );
        let near = topo.nic_path("mlx5_1").unwrap();
        assert_eq!(near.bus_id(), "0000:04:00.0");
        assert!(near.path().ends_with("0000:02:01.0/0000:04:00.0"));
    }

    #[test]
    fn missing_sysfs_or_no_gpu_keeps_the_given_order() {
        let missing = PciTopology::at(std::env::temp_dir().join("gdr-topology-no-such-root"));
        let nics = ["mlx5_0", "mlx5_1", "mlx5_2"];
        assert_eq!(
            missing.rank_nics(Some("0000:03:00.0"), &nics),
            vec![0, 1, 2]
        );
        assert_eq!(
            missing.nic_distances(Some("0000:03:00.0"), &nics),
            vec![None; 3]
        );

        let sys = two_socket_box("nogpu");
        let topo = sys.topology();
        assert_eq!(topo.rank_nics(None, &["mlx5_0", "mlx5_1"]), vec![0, 1]);
        // A GPU the tree does not have, and a malformed bus id.
        assert_eq!(
            topo.rank_nics(Some("0000:99:00.0"), &["mlx5_0", "mlx5_1"]),
            vec![0, 1]
        );
        assert_eq!(
            topo.rank_nics(Some("gpu0"), &["mlx5_0", "mlx5_1"]),
            vec![0, 1]
        );
        assert!(topo.rank_nics(Some("0000:03:00.0"), &[]).is_empty());
    }

    #[test]
    fn software_devices_are_unknown_and_rank_last() {
        let sys = two_socket_box("rxe");
        // rxe0: no device link; rxe1: its link leads to a netdev under a
        // PCI function (virtio), not to a function of its own.
        sys.rxe("rxe0", None);
        sys.rxe("rxe1", Some("pci0000:00/0000:00:03.0/virtio0/net/eth0"));
        // A device whose link leads to no PCI function at all, and one with
        // no sysfs entry.
        sys.nic("weird0", "virtual/net/eth1", 0);
        let topo = sys.topology();
        assert_eq!(topo.nic_path("rxe0"), None);
        assert_eq!(topo.nic_path("rxe1"), None);
        assert_eq!(topo.nic_path("weird0"), None);
        assert_eq!(topo.nic_path("ghost0"), None);
        let nics = ["rxe0", "ghost0", "mlx5_0", "rxe1", "mlx5_1", "weird0"];
        assert_eq!(
            topo.rank_nics(Some("0000:03:00.0"), &nics),
            vec![4, 2, 0, 1, 3, 5]
        );
    }

    #[test]
    fn cuda_bus_ids_are_normalised() {
        assert_eq!(
            normalize_bus_id("00000000:17:00.0").as_deref(),
            Some("0000:17:00.0")
        );
        assert_eq!(
            normalize_bus_id("0000:AB:1F.7").as_deref(),
            Some("0000:ab:1f.7")
        );
        assert_eq!(normalize_bus_id("17:00.0").as_deref(), Some("0000:17:00.0"));
        assert_eq!(
            normalize_bus_id("00010000:e1:00.0").as_deref(),
            Some("10000:e1:00.0")
        );
        assert_eq!(
            normalize_bus_id("00000001:02:00.0").as_deref(),
            Some("0001:02:00.0")
        );
        for bad in [
            "",
            "gpu0",
            "0000:17:00",
            "0000:17:0.0",
            "0000:1g:00.0",
            "0:0:0:00.0",
        ] {
            assert_eq!(normalize_bus_id(bad), None, "{bad:?}");
        }
        // CUDA's form finds the GPU.
        let sys = two_socket_box("cuda");
        let topo = sys.topology();
        assert_eq!(
            topo.gpu_path("00000000:03:00.0").unwrap().bus_id(),
            "0000:03:00.0"
        );
        assert_eq!(
            topo.rank_nics(Some("00000000:03:00.0"), &["mlx5_0", "mlx5_1"]),
            vec![1, 0]
        );
    }

    #[test]
    fn distance_classes_follow_the_tree() {
        let sys = two_socket_box("classes");
        // Beside the GPU's switch's downstream port: one more link.
        sys.nic(
            "sib",
            "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.1",
            0,
        );
        // Below a second switch under the same upstream port.
        sys.nic(
            "deep",
            "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:02.0/0000:05:00.0/0000:06:00.0/0000:07:00.0",
            0,
        );
        // Another root port of the same root complex.
        sys.nic("phb", "pci0000:00/0000:00:02.0/0000:08:00.0", 0);
        // Another root complex of the same NUMA node; one of unknown node.
        sys.nic("node", "pci0000:40/0000:40:01.0/0000:41:00.0", 0);
        sys.nic("unaffine", "pci0000:c0/0000:c0:01.0/0000:c1:00.0", -1);
        let topo = sys.topology();
        let nics = ["mlx5_0", "unaffine", "node", "phb", "deep", "mlx5_1", "sib"];
        let distances = topo.nic_distances(Some("0000:03:00.0"), &nics);
        assert_eq!(
            distances,
            vec![
                Some(PciDistance::Sys),
                Some(PciDistance::Sys),
                Some(PciDistance::Node),
                Some(PciDistance::Phb),
                Some(PciDistance::Pxb { hops: 6 }),
                Some(PciDistance::Pix { hops: 4 }),
                Some(PciDistance::Pix { hops: 2 }),
            ]
        );
        // Nearest first; the two SYS NICs keep their order.
        assert_eq!(
            topo.rank_nics(Some("0000:03:00.0"), &nics),
            vec![6, 5, 4, 3, 2, 0, 1]
        );
        assert!(PciDistance::Pix { hops: 4 } < PciDistance::Pxb { hops: 2 });
        assert!(PciDistance::Phb.hops() < PciDistance::Sys.hops());
    }

    #[test]
    fn a_flat_tree_keeps_the_given_order() {
        // A VM: every function on the root bus, no bridges.
        let sys = FakeSys::new("flat");
        sys.gpu("pci0000:00/0000:00:05.0", -1);
        sys.nic("mlx5_0", "pci0000:00/0000:00:06.0", -1);
        sys.nic("mlx5_1", "pci0000:00/0000:00:07.0", -1);
        let topo = sys.topology();
        assert_eq!(
            topo.rank_nics(Some("0000:00:05.0"), &["mlx5_1", "mlx5_0"]),
            vec![0, 1]
        );
        assert_eq!(
            topo.nic_distances(Some("0000:00:05.0"), &["mlx5_1"]),
            vec![Some(PciDistance::Phb)]
        );
    }
}
