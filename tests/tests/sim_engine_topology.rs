//! The engine sends GPU memory over the NIC nearest its GPU (simulated
//! NICs and GPU, a fake sysfs PCI tree): two NICs per node, the GPU under
//! the same root port as `sim1`, `sim0` under another root complex. A
//! GPU region's slices all go over `sim1`'s queue pairs; host memory and a
//! machine without a readable tree spread over both.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gdr_core::descriptor::GrantRights;
use gdr_core::engine::topology::PciTopology;
use gdr_core::engine::{EngineConfig, Transfer};
use gdr_sim::{GpuConfig, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, Kind};
use gdr_tests::pattern;

const T: Duration = Duration::from_secs(10);
/// The sim GPU's default PCI bus id.
const GPU: &str = "0000:17:00.0";

/// A fake `/sys` under a fresh folder: the GPU and `sim1` behind one root
/// port, `sim0` on another root complex. Removed on drop.
struct FakeSysfs(PathBuf);

impl FakeSysfs {
    fn new(test: &str) -> Self {
        let root = std::env::temp_dir().join(format!("gdr-topo-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let devices = root.join("sys/devices");
        let near = devices.join("pci0000:00/0000:00:01.0");
        let far = devices.join("pci0000:80/0000:80:01.0");
        for dir in [
            near.join(GPU),
            near.join("0000:18:00.0"),
            far.join("0000:81:00.0"),
        ] {
            std::fs::create_dir_all(dir).unwrap();
        }
        let bus = root.join("sys/bus/pci/devices");
        std::fs::create_dir_all(&bus).unwrap();
        symlink(near.join(GPU), bus.join(GPU)).unwrap();
        for (nic, place) in [
            ("sim1", near.join("0000:18:00.0")),
            ("sim0", far.join("0000:81:00.0")),
        ] {
            let class = root.join("sys/class/infiniband").join(nic);
            std::fs::create_dir_all(&class).unwrap();
            symlink(place, class.join("device")).unwrap();
        }
        Self(root)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for FakeSysfs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn world(topology: PciTopology) -> EngineWorld<SimVerbsApi> {
    let config = EngineConfig::default()
        .with_qps_per_peer(4)
        .with_slice_size(64 * 1024)
        .with_default_timeout(T)
        .with_topology(topology);
    EngineWorld::sim(2, GpuConfig::default(), config, T)
}

/// Requests posted per NIC of a's peer while `f` runs.
fn posted_per_nic(w: &EngineWorld<SimVerbsApi>, f: impl FnOnce()) -> Vec<(String, u64)> {
    let before = w.ab.counters();
    f();
    let after = w.ab.counters();
    let mut per_nic: Vec<(String, u64)> = Vec::new();
    for ((_, nic, b), (_, _, a)) in before.iter().zip(&after) {
        let moved = a.posted - b.posted;
        match per_nic.iter_mut().find(|(n, _)| n == nic) {
            Some((_, total)) => *total += moved,
            None => per_nic.push((nic.clone(), moved)),
        }
    }
    per_nic.sort();
    per_nic
}

fn write_from(w: &EngineWorld<SimVerbsApi>, kind: Kind, seed: u8) -> Vec<(String, u64)> {
    const LEN: u64 = 1 << 20;
    let (_s, src) = w.a.alloc(kind, LEN, seed);
    let (dst_buf, dst) = w.b.alloc(Kind::Host, LEN, 0);
    let (_g, remote) = w.b_grants(&dst, GrantRights::Write);
    let moved = posted_per_nic(w, || {
        w.ab.submit(&[Transfer::write(&src, 0, &remote, 0, LEN)])
            .unwrap()
            .wait(T)
            .unwrap();
    });
    assert!(
        w.b.bytes(&dst_buf) == pattern(LEN as usize, seed),
        "{kind:?}: data"
    );
    moved
}

#[test]
fn gpu_memory_goes_over_the_nic_nearest_its_gpu() {
    let tree = FakeSysfs::new("nearest");
    let w = world(PciTopology::at(tree.path()));
    let gpu = write_from(&w, Kind::Gpu, 3);
    assert_eq!(
        gpu,
        [("sim0".to_owned(), 0), ("sim1".to_owned(), 16)],
        "every slice of GPU memory over sim1"
    );
    let host = write_from(&w, Kind::Host, 4);
    assert!(
        host.iter().all(|(_, n)| *n > 0),
        "host memory over both NICs: {host:?}"
    );
}

#[test]
fn without_a_pci_tree_gpu_memory_spreads_over_every_nic() {
    let w = world(PciTopology::at("/nonexistent-gdr-sysfs"));
    let gpu = write_from(&w, Kind::Gpu, 5);
    assert!(
        gpu.iter().all(|(_, n)| *n > 0),
        "no tree, no preference: {gpu:?}"
    );
}
