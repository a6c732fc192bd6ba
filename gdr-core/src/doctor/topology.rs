//! GPU↔NIC PCIe distances, and whether they make gdr prefer some NIC.

use super::{Distance, GpuReport, PciClass, RdmaDevice, Topology};
use crate::engine::topology::{PciDistance, PciTopology, distance};

/// The PCIe distances of every (GPU, NIC) pair, and whether they lead to a
/// preference.
pub(super) fn topology(
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
                    let d = distance(g, n);
                    entry.class = Some(class_of(d));
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
pub(super) fn preference(sysfs_tree: bool, pairs: &[Distance]) -> (bool, String) {
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
        let mine: Vec<(Option<PciClass>, Option<u32>)> = pairs
            .iter()
            .filter(|p| p.gpu == gpu)
            .map(|p| (p.class, p.hops))
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

fn class_of(d: PciDistance) -> PciClass {
    match d {
        PciDistance::Pix { .. } => PciClass::Pix,
        PciDistance::Pxb { .. } => PciClass::Pxb,
        PciDistance::Phb => PciClass::Phb,
        PciDistance::Node => PciClass::Node,
        PciDistance::Sys => PciClass::Sys,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn distance(gpu: u32, nic: &str, class: Option<PciClass>) -> Distance {
        Distance {
            gpu,
            nic: nic.to_owned(),
            class,
            ..Distance::default()
        }
    }

    #[test]
    fn flat_or_missing_trees_give_no_preference() {
        let near_far = [
            distance(0, "mlx5_0", Some(PciClass::Pix)),
            distance(0, "mlx5_1", Some(PciClass::Sys)),
        ];
        assert!(preference(true, &near_far).0);
        let (prefers, note) = preference(false, &near_far);
        assert!(!prefers && note.contains("no PCIe tree"), "{note}");
        let flat = [
            distance(0, "mlx5_0", Some(PciClass::Phb)),
            distance(0, "mlx5_1", Some(PciClass::Phb)),
        ];
        let (prefers, note) = preference(true, &flat);
        assert!(!prefers && note.contains("flat"), "{note}");
        let unknown = [distance(0, "rxe0", None)];
        let (prefers, note) = preference(true, &unknown);
        assert!(!prefers && note.contains("no distance is known"), "{note}");
    }

    #[test]
    fn classes_serialize_as_nccl_names() {
        let json = serde_json::to_string(&[PciClass::Pix, PciClass::Node]).unwrap();
        assert_eq!(json, r#"["PIX","NODE"]"#);
    }
}
