//! The doctor: what this machine has (rdma-core, the CUDA driver, the
//! NVIDIA kernel modules, RDMA devices and GPUs, the PCIe tree, the
//! memlock limit), which GPU registration rung each (GPU, NIC) pair takes
//! and why, and for each "no" what to do about it.
//!
//! One entry, [`report`], gathers it once into a plain typed [`Report`];
//! `gdr info` prints it for people ([`Report`]'s `Display`) or as JSON
//! ([`Report::to_json`]), and the C ABI's `gdr_doctor_report` returns the
//! JSON. Host facts are read from files under a root directory
//! ([`DoctorOptions::root`], `/` on a real system) so tests feed fake ones.
//! Gathering never fails: what cannot be read is reported as unknown, and
//! a backend choice that cannot be met is in [`BackendsUsed::error`].
//!
//! Needs feature `doctor` and a backend feature (as [`crate::backend`]).
//!
//! ```no_run
//! use gdr_core::backend::BackendChoice;
//! use gdr_core::doctor::{self, DoctorOptions};
//!
//! let report = doctor::report(BackendChoice::Sim, &DoctorOptions::default());
//! for pair in &report.rungs.pairs {
//!     // The rung is the ladder's own enum, not a string.
//!     if !pair.rung.is_gpu_direct() {
//!         eprintln!("{} x GPU {}: staged", pair.nic, pair.gpu);
//!     }
//! }
//! print!("{report}");
//! let json = report.to_json()?;
//! # Ok::<(), gdr_core::doctor::DoctorError>(())
//! ```

use std::path::{Path, PathBuf};

use crate::backend::{BackendChoice, Backends};
use crate::engine::topology::PciTopology;

mod devices;
mod hints;
mod host;
mod text;
mod topology;
mod types;

pub use text::bytes_text;
pub use types::*;

/// What [`report`] reads besides the backends.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DoctorOptions {
    /// The directory host files (`/proc`, `/sys`) are read under: `/` on a
    /// real system, a fake tree in tests.
    pub root: PathBuf,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/"),
        }
    }
}

impl DoctorOptions {
    /// Host files under `root` instead of `/`.
    pub fn with_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.root = root.into();
        self
    }
}

/// Why a report could not be written out.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DoctorError {
    /// The JSON serializer failed.
    #[error("the doctor's report could not be written as JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Gathers the report for backend `choice` on this machine: the device
/// sections on the chosen backends (a choice that cannot be met is in
/// [`BackendsUsed::error`], the rest still gathered), the native libraries,
/// the host's files, then the topology and the hints.
pub fn report(choice: BackendChoice, options: &DoctorOptions) -> Report {
    let host = HostFiles::at(&options.root);
    let mut report = Report {
        backends: BackendsUsed {
            asked: choice,
            ..BackendsUsed::default()
        },
        ..Report::default()
    };
    match Backends::choose(choice).map(devices::gather) {
        Ok(devices) => devices.into_report(&mut report),
        Err(e) => {
            tracing::warn!(error = %e, "doctor: the backend choice cannot be met");
            report.backends.error = Some(e.to_string());
        }
    }
    // After the backends: libcuda is then loaded (and in /proc/self/maps)
    // where it could be.
    host::gather_host(&host, &mut report);
    host::gather_real_libraries(&host, choice, &mut report);
    report.topology = topology::topology(
        &host.topology(),
        host.exists("/sys/devices"),
        &report.gpus.gpus,
        &report.rdma.devices,
    );
    report.hints = hints::hints(&report);
    tracing::debug!(hints = report.hints.len(), "doctor: report gathered");
    report
}

impl Report {
    /// The report as pretty-printed JSON (what `gdr info --json` prints,
    /// without the final newline).
    pub fn to_json(&self) -> Result<String, DoctorError> {
        Ok(serde_json::to_string_pretty(self)?)
    }
}

/// Host files read under a root directory: `/` on a real system.
#[derive(Debug, Clone)]
pub(crate) struct HostFiles {
    root: PathBuf,
}

impl HostFiles {
    /// Files under `root` (a fake tree in tests).
    pub(crate) fn at(root: impl AsRef<Path>) -> Self {
        Self {
            root: root.as_ref().to_path_buf(),
        }
    }

    fn path(&self, absolute: &str) -> PathBuf {
        self.root.join(absolute.trim_start_matches('/'))
    }

    pub(crate) fn read(&self, absolute: &str) -> Option<String> {
        std::fs::read_to_string(self.path(absolute)).ok()
    }

    pub(crate) fn exists(&self, absolute: &str) -> bool {
        self.path(absolute).exists()
    }

    fn topology(&self) -> PciTopology {
        PciTopology::at(&self.root)
    }
}

#[cfg(all(test, feature = "sim"))]
mod tests {
    use super::*;
    use crate::ladder::Rung;

    /// The whole report on the simulation: its fields say what the sim
    /// has, and its JSON carries every section.
    #[test]
    fn the_sim_report_reflects_the_sim_and_its_json_has_every_key() {
        let report = report(BackendChoice::Sim, &DoctorOptions::default());
        assert_eq!(report.backends.asked, BackendChoice::Sim);
        assert_eq!(report.backends.verbs.as_deref(), Some("sim"));
        assert_eq!(report.backends.cuda.as_deref(), Some("sim"));
        assert_eq!(report.backends.error, None);
        assert_eq!(report.rdma.backend.as_deref(), Some("sim"));
        assert!(!report.rdma.devices.is_empty());
        let port = &report.rdma.devices[0].ports[0];
        assert_eq!(port.state, Some(hal_verbs::PortState::Active));
        assert!(port.active);
        assert!(!report.gpus.gpus.is_empty());
        assert!(report.gpus.gpus[0].dma_buf);
        assert!(report.rungs.probed);
        assert_eq!(report.rungs.pairs[0].rung, Rung::Dmabuf);
        assert_eq!(report.libraries.libcuda.found, None);
        // A verdict for the memlock limit (which one depends on the host).
        let _verdict: MemlockVerdict = report.memlock.verdict;
        // Every simulated pair has a distance entry, unknown (no PCI place).
        assert!(report.topology.pairs.iter().all(|p| p.class.is_none()));

        let json = report.to_json().unwrap();
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        let keys: Vec<&str> = value
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        for key in [
            "backends",
            "libraries",
            "nvidia",
            "kernel_release",
            "memlock",
            "rdma",
            "gpus",
            "topology",
            "rungs",
            "hints",
        ] {
            assert!(keys.contains(&key), "{key} missing from {keys:?}");
        }
        assert_eq!(value["backends"]["asked"], "sim");
        assert_eq!(value["rungs"]["pairs"][0]["rung"], "dma-buf");
        assert_eq!(value["rungs"]["pairs"][0]["checks"][0]["rung"], "dma-buf");
        assert_eq!(value["rdma"]["devices"][0]["ports"][0]["state"], "Active");
        assert!(value["gpus"]["gpus"][0]["flush_options"].is_array());
        // The text form has every section heading.
        let text = report.to_string();
        for heading in [
            "Libraries",
            "Kernel",
            "RDMA devices (sim)",
            "GPUs (sim)",
            "What to do",
        ] {
            assert!(text.contains(heading), "{heading} missing:\n{text}");
        }
    }

    /// A fake root: nothing there is unknown, never a failure.
    #[test]
    fn an_empty_root_gives_unknowns() {
        let root = std::env::temp_dir().join(format!("gdr-doctor-empty-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let report = report(
            BackendChoice::Sim,
            &DoctorOptions::default().with_root(&root),
        );
        assert_eq!(report.memlock.verdict, MemlockVerdict::Unknown);
        assert_eq!(report.kernel_release, None);
        assert!(!report.topology.sysfs_tree);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
