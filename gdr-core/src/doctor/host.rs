//! What the doctor reads from the host: the NVIDIA kernel modules, the
//! kernel release, RLIMIT_MEMLOCK, and the native libraries (loaded or
//! not, their files and versions).

use std::path::Path;

use super::{HostFiles, KernelModule, Library, Limit, Memlock, MemlockVerdict, Report};
use crate::backend::BackendChoice;
use crate::engine::EngineConfig;

/// Linux's capability number of `CAP_IPC_LOCK`: with it, RLIMIT_MEMLOCK
/// does not bound what a process pins.
const CAP_IPC_LOCK: u32 = 14;

/// The parts that read only files: kernel modules, kernel release, memlock.
pub(super) fn gather_host(host: &HostFiles, report: &mut Report) {
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
/// the backend choice; not probed under `--backend sim`). A build without
/// feature `rdma` or `cuda` probes neither library of it.
pub(super) fn gather_real_libraries(host: &HostFiles, choice: BackendChoice, report: &mut Report) {
    let maps = host.read("/proc/self/maps").unwrap_or_default();
    gather_rdma_core(&maps, report);
    if choice == BackendChoice::Sim {
        report.libraries.libcuda = not_probed("libcuda.so.1", "not probed: --backend sim");
        return;
    }
    gather_libcuda(host, &maps, report);
}

#[cfg(feature = "rdma")]
fn gather_rdma_core(maps: &str, report: &mut Report) {
    use hal_verbs::Provider as _;
    let verbs = hal_verbs::rdma::RdmaProvider::load();
    report.libraries.libibverbs = library(
        maps,
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
        maps,
        "librdmacm.so.1",
        hal_verbs::rdma::RdmaCm::load()
            .map(drop)
            .map_err(|e| e.to_string()),
    );
}

#[cfg(not(feature = "rdma"))]
fn gather_rdma_core(_maps: &str, report: &mut Report) {
    const WHY: &str = "not probed: gdr-core built without feature `rdma`";
    report.libraries.libibverbs = not_probed("libibverbs.so.1", WHY);
    report.libraries.librdmacm = not_probed("librdmacm.so.1", WHY);
}

#[cfg(feature = "cuda")]
fn gather_libcuda(host: &HostFiles, maps: &str, report: &mut Report) {
    use hal_cuda::Driver as _;
    let driver = hal_cuda::cuda::CudaDriver::load();
    report.libraries.libcuda = library(
        &maps_after_load(host, maps),
        "libcuda.so.1",
        driver.as_ref().map(drop).map_err(|e| e.to_string()),
    );
    if let Ok(driver) = driver {
        report.nvidia.cuda_version = driver.driver_version().ok().map(cuda_version);
        devices_listed(&mut report.libraries.libcuda, driver.device_count());
    }
}

#[cfg(not(feature = "cuda"))]
fn gather_libcuda(_host: &HostFiles, _maps: &str, report: &mut Report) {
    report.libraries.libcuda = not_probed(
        "libcuda.so.1",
        "not probed: gdr-core built without feature `cuda`",
    );
}

/// A library's entry when it is not probed, and why.
fn not_probed(soname: &str, why: &str) -> Library {
    Library {
        soname: soname.to_owned(),
        detail: Some(why.to_owned()),
        ..Library::default()
    }
}

/// Records how many devices a found library lists, or why none.
#[cfg_attr(not(any(feature = "rdma", feature = "cuda")), allow(dead_code))]
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
#[cfg(feature = "cuda")]
fn maps_after_load(host: &HostFiles, maps: &str) -> String {
    if loaded_library(maps, "libcuda.so").is_some() {
        return maps.to_owned();
    }
    host.read("/proc/self/maps").unwrap_or_default()
}

/// A library's entry: found or why not; its file and version from `maps`.
#[cfg_attr(not(any(feature = "rdma", feature = "cuda", test)), allow(dead_code))]
pub(super) fn library(maps: &str, soname: &str, loaded: Result<(), String>) -> Library {
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
pub(super) fn loaded_library(maps: &str, stem: &str) -> Option<String> {
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
pub(super) fn library_version(path: &str, stem: &str) -> Option<String> {
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
#[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
pub(super) fn cuda_version(version: i32) -> String {
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
pub(super) fn parse_nvidia_version(text: &str) -> KernelModule {
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
pub(super) fn engine_pinned_bytes() -> u64 {
    let config = EngineConfig::default();
    config.staging_slice * (config.staging_slots + config.rendezvous_slots) as u64
}

/// RLIMIT_MEMLOCK from `/proc/self/limits` and CAP_IPC_LOCK from
/// `/proc/self/status`.
pub(super) fn memlock(limits: Option<&str>, status: Option<&str>) -> Memlock {
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
pub(super) fn parse_memlock(limits: &str) -> Option<(Limit, Limit)> {
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
pub(super) fn has_cap_ipc_lock(status: &str) -> bool {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::doctor) const OPEN: &str = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  \
        Release Build  (dvs-builder@U16-I3-B03-4-3)  Tue Jul 15 04:48:39 UTC 2025\n\
        GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n";
    pub(in crate::doctor) const PROPRIETARY: &str = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  \
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

    pub(in crate::doctor) const LIMITS: &str = "Limit                     Soft Limit           Hard Limit           Units\n\
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
}
