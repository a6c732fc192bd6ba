//! `gdr info`: the doctor (`gdr_core::doctor`), printed. The library
//! gathers one report; this prints it for people or as JSON (`--json`).

use std::error::Error;
use std::io::Write as _;

use gdr_core::backend::BackendChoice;
use gdr_core::doctor::{self, DoctorOptions};

/// `gdr info`: the report, for people or as JSON; an error (after the
/// report) only where `--backend` could not be met.
pub(crate) fn print(choice: BackendChoice, json: bool) -> Result<(), Box<dyn Error>> {
    let report = doctor::report(choice, &DoctorOptions::default());
    let mut out = std::io::stdout().lock();
    let written = if json {
        let text = report.to_json()?;
        writeln!(out, "{text}")
    } else {
        write!(out, "{report}")
    };
    match written {
        // Read by `head`: what was wanted was read.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        other => other?,
    }
    match report.backends.error {
        Some(error) => Err(error.into()),
        None => Ok(()),
    }
}
