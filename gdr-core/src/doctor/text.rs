//! The report for people: the text `gdr info` prints.

use std::fmt::{self, Write as _};

use super::types::{gid_label, ordering_label};
use super::{Library, Limit, MemlockVerdict, Report, choice_label, rung_label};

/// `n` bytes for people: `8 MiB`, `1.5 GiB`, `4096 bytes`.
pub fn bytes_text(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} bytes");
    }
    let mut value = n as f64;
    let mut unit = "";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    if value.fract() == 0.0 {
        format!("{value:.0} {unit}")
    } else {
        format!("{value:.1} {unit}")
    }
}

pub(super) fn limit_text(limit: Limit) -> String {
    match limit {
        Limit::Unlimited => "unlimited".to_owned(),
        Limit::Bytes(n) => bytes_text(n),
    }
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn library_line(name: &str, lib: &Library) -> String {
    let mut line = format!("  {name:<11} ");
    match lib.found {
        Some(true) => {
            line.push_str("found");
            if let Some(path) = &lib.path {
                let _ = write!(line, "  {path}");
            }
            if let Some(package) = &lib.package {
                let _ = write!(line, "  ({package})");
            }
            match (lib.devices, &lib.detail) {
                (Some(0), Some(why)) => {
                    let _ = write!(line, "\n              lists no device: {why}");
                }
                (Some(n), _) => {
                    let _ = write!(line, "  {n} device{}", if n == 1 { "" } else { "s" });
                }
                (None, _) => {}
            }
        }
        Some(false) => {
            let _ = write!(
                line,
                "NOT FOUND: {}",
                lib.detail.as_deref().unwrap_or("unknown")
            );
        }
        None => {
            let _ = write!(line, "{}", lib.detail.as_deref().unwrap_or("not probed"));
        }
    }
    line
}

/// The report for people: what `gdr info` prints.
impl fmt::Display for Report {
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_human(self, out)
    }
}

fn write_human(report: &Report, out: &mut fmt::Formatter<'_>) -> fmt::Result {
    let b = &report.backends;
    writeln!(
        out,
        "gdr info (--backend {}: verbs {}, CUDA {})",
        choice_label(b.asked),
        b.verbs.as_deref().unwrap_or("none"),
        b.cuda.as_deref().unwrap_or("none")
    )?;
    if let Some(error) = &b.error {
        writeln!(out, "  backends: {error}")?;
    }
    for note in &b.notes {
        for line in note.lines() {
            writeln!(out, "  {}", line.trim_start())?;
        }
    }

    writeln!(out, "\nLibraries")?;
    let l = &report.libraries;
    writeln!(out, "{}", library_line("libibverbs", &l.libibverbs))?;
    writeln!(out, "{}", library_line("librdmacm", &l.librdmacm))?;
    writeln!(out, "{}", library_line("libcuda", &l.libcuda))?;

    writeln!(out, "\nKernel")?;
    if let Some(release) = &report.kernel_release {
        writeln!(out, "  release          {release}")?;
    }
    let n = &report.nvidia;
    match &n.kernel_module {
        Some(m) => writeln!(
            out,
            "  nvidia module    {}, {}",
            m.version.as_deref().unwrap_or("version unknown"),
            match m.open {
                Some(true) => "open kernel module",
                Some(false) => "proprietary kernel module (no dma-buf)",
                None => "open or proprietary unknown",
            }
        )?,
        None => writeln!(out, "  nvidia module    not loaded")?,
    }
    writeln!(
        out,
        "  nvidia-peermem   {}",
        n.peermem_module
            .as_deref()
            .map_or("not loaded".to_owned(), |m| format!("loaded ({m})"))
    )?;
    writeln!(
        out,
        "  CUDA driver API  {}",
        n.cuda_version.as_deref().unwrap_or("unknown (no libcuda)")
    )?;
    let m = &report.memlock;
    let verdict = match m.verdict {
        MemlockVerdict::Unlimited => "fine".to_owned(),
        MemlockVerdict::NotEnforced => "not enforced: this process has CAP_IPC_LOCK".to_owned(),
        MemlockVerdict::Enough => format!(
            "enough for an engine's {} (more registered host memory needs more)",
            bytes_text(m.engine_needs)
        ),
        MemlockVerdict::TooLow => format!(
            "TOO LOW: an engine pins {}, registrations will fail",
            bytes_text(m.engine_needs)
        ),
        MemlockVerdict::Unknown => "unknown (/proc/self/limits unreadable)".to_owned(),
    };
    match (m.soft, m.hard) {
        (Some(soft), Some(hard)) => writeln!(
            out,
            "  memlock          {} (hard {}): {verdict}",
            limit_text(soft),
            limit_text(hard)
        )?,
        _ => writeln!(out, "  memlock          {verdict}")?,
    }

    let r = &report.rdma;
    writeln!(
        out,
        "\nRDMA devices ({})",
        r.backend.as_deref().unwrap_or("none")
    )?;
    if let Some(error) = &r.error {
        writeln!(out, "  none: {error}")?;
    }
    for d in &r.devices {
        writeln!(
            out,
            "  {}  PCI {}  fw {}  vendor {}",
            d.name,
            d.pci_bus_id.as_deref().unwrap_or("none (software device)"),
            d.firmware.as_deref().unwrap_or("?"),
            d.vendor.as_deref().unwrap_or("?")
        )?;
        if let Some(error) = &d.error {
            writeln!(out, "    {error}")?;
        }
        for p in &d.ports {
            let Some(state) = p.state else {
                let error = p.error.as_deref().unwrap_or("not queried");
                writeln!(out, "    port {}: {error}", p.number)?;
                continue;
            };
            let link_layer = p.link_layer.map_or_else(String::new, |l| format!("{l:?}"));
            writeln!(
                out,
                "    port {}: {state:?}, {link_layer}, MTU {} (max {})",
                p.number, p.active_mtu, p.max_mtu
            )?;
            if let Some(error) = &p.error {
                writeln!(out, "      {error}")?;
            }
            for g in &p.gids {
                let used = if p.roce_v2_gid_index == Some(g.index) {
                    "  <- gdr uses this one"
                } else {
                    ""
                };
                writeln!(
                    out,
                    "      GID {:>3}  {:<28} {}{used}",
                    g.index,
                    g.address,
                    gid_label(g.kind)
                )?;
            }
        }
    }

    let g = &report.gpus;
    writeln!(out, "\nGPUs ({})", g.backend.as_deref().unwrap_or("none"))?;
    if let Some(error) = &g.error {
        writeln!(out, "  none: {error}")?;
    }
    for gpu in &g.gpus {
        if let Some(error) = &gpu.error {
            writeln!(out, "  {}: {error}", gpu.ordinal)?;
            continue;
        }
        writeln!(
            out,
            "  {}: {}  {}  {}  sm_{}",
            gpu.ordinal,
            gpu.name,
            gpu.pci_bus_id,
            bytes_text(gpu.memory_bytes),
            gpu.compute_capability.replace('.', "")
        )?;
        writeln!(
            out,
            "     dma-buf {}  GPUDirect RDMA {}  writes ordering {}  flush {}  VMM {}",
            yes(gpu.dma_buf),
            yes(gpu.gpu_direct_rdma),
            gpu.writes_ordering.map_or("", ordering_label),
            if gpu.flush_options.is_empty() {
                "none".to_owned()
            } else {
                gpu.flush_options
                    .iter()
                    .map(|o| o.name())
                    .collect::<Vec<_>>()
                    .join("+")
            },
            yes(gpu.vmm)
        )?;
    }

    let t = &report.topology;
    writeln!(out, "\nGPU <-> NIC PCIe distance")?;
    for p in &t.pairs {
        match (&p.class, p.hops) {
            (Some(class), Some(hops)) => {
                writeln!(out, "  GPU {} - {}: {class} ({hops} links)", p.gpu, p.nic)?
            }
            (Some(class), None) => writeln!(out, "  GPU {} - {}: {class}", p.gpu, p.nic)?,
            (None, _) => writeln!(
                out,
                "  GPU {} - {}: unknown ({})",
                p.gpu,
                p.nic,
                p.unknown_because.as_deref().unwrap_or("?")
            )?,
        }
    }
    writeln!(out, "  {}", t.note)?;

    let rungs = &report.rungs;
    writeln!(
        out,
        "\nGPU registration rungs (verbs {}, CUDA {}; probed with a loopback WRITE and READ)",
        b.verbs.as_deref().unwrap_or("none"),
        b.cuda.as_deref().unwrap_or("none")
    )?;
    if let Some(note) = &rungs.note {
        writeln!(out, "  {note}")?;
    }
    for e in &rungs.errors {
        writeln!(out, "  {e}")?;
    }
    for pair in &rungs.pairs {
        writeln!(
            out,
            "  {} x GPU {}: {}",
            pair.nic,
            pair.gpu,
            rung_label(pair.rung)
        )?;
        for c in &pair.checks {
            let rung = rung_label(c.rung);
            match &c.reason {
                None => writeln!(out, "    {rung}: works")?,
                Some(reason) => writeln!(out, "    {rung}: no: {reason}")?,
            }
        }
    }

    writeln!(out, "\nWhat to do")?;
    if report.hints.is_empty() {
        writeln!(out, "  nothing: every path gdr has is available")?;
    }
    for h in &report.hints {
        writeln!(out, "  - {}\n    {}", h.problem, h.fix)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_for_people() {
        assert_eq!(bytes_text(4096), "4 KiB");
        assert_eq!(bytes_text(1000), "1000 bytes");
        assert_eq!(bytes_text(8 << 20), "8 MiB");
        assert_eq!(bytes_text(3 << 29), "1.5 GiB");
        assert_eq!(bytes_text(141 << 30), "141 GiB");
    }
}
