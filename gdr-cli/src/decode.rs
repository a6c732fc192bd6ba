//! `gdr uri`: decodes a `gdr://` buffer URI or a memory descriptor (text
//! form, or the binary form written as hex) and says what it grants. A
//! malformed input is refused with the parser's own error, which names the
//! segment or field that is wrong.

use std::error::Error;
use std::fmt::Write as _;

use gdr_core::descriptor::GrantRights;
use gdr_core::descriptor::{MemoryDescriptor, MemoryLocation, Reach};
use gdr_core::uri::BufferUri;

use gdr_core::doctor::bytes_text;

/// What `text` is, decoded and explained; an error naming what is wrong.
pub(crate) fn explain(text: &str, hex: bool) -> Result<String, Box<dyn Error>> {
    if hex {
        let bytes = parse_hex(text)?;
        let descriptor = MemoryDescriptor::decode(&bytes)
            .map_err(|e| format!("binary memory descriptor: {e}"))?;
        return Ok(explain_descriptor(&descriptor, "binary form", bytes.len()));
    }
    if text.starts_with("gdr://") {
        let uri: BufferUri = text.parse()?;
        return Ok(explain_uri(&uri));
    }
    if text.starts_with("gdr-md:") {
        let descriptor: MemoryDescriptor = text
            .parse()
            .map_err(|e| format!("memory descriptor: {e}"))?;
        return Ok(explain_descriptor(&descriptor, "text form", text.len()));
    }
    Err(format!(
        "{:?} is neither a gdr:// buffer URI nor a gdr-md: memory descriptor (a binary \
         descriptor is given as hex with --hex)",
        shorten(text)
    )
    .into())
}

/// At most 40 characters of `text`, for an error message.
fn shorten(text: &str) -> String {
    match text.char_indices().nth(40) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_owned(),
    }
}

/// Hex digits (either case; whitespace and a leading `0x` ignored) as bytes.
fn parse_hex(text: &str) -> Result<Vec<u8>, String> {
    let digits: String = text.split_whitespace().collect();
    let digits = digits.strip_prefix("0x").unwrap_or(&digits);
    if !digits.len().is_multiple_of(2) {
        return Err(format!(
            "--hex: an odd number of hex digits ({})",
            digits.len()
        ));
    }
    (0..digits.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(&digits[i..i + 2], 16)
                .map_err(|_| format!("--hex: {:?} at digit {i} is not hex", &digits[i..i + 2]))
        })
        .collect()
}

fn explain_uri(uri: &BufferUri) -> String {
    let mut out = String::new();
    let version = match uri {
        BufferUri::V1 { .. } => 1,
        BufferUri::V2 { .. } => 2,
    };
    let _ = writeln!(out, "gdr:// buffer URI, version {version}");
    let _ = writeln!(
        out,
        "  device      GPU {} of the exporting process",
        uri.device()
    );
    match uri.allocation() {
        Some(allocation) => {
            let _ = writeln!(out, "  allocation  {}", exact_bytes(allocation));
        }
        None => {
            let _ = writeln!(
                out,
                "  allocation  not stated (v1): at least the range below"
            );
        }
    }
    let (offset, size) = (uri.offset(), uri.size());
    let _ = writeln!(
        out,
        "  range       bytes {offset}..{} of the allocation: {}",
        offset + size,
        exact_bytes(size)
    );
    let handle: String = uri.handle().0.iter().map(|b| format!("{b:02x}")).collect();
    let _ = writeln!(
        out,
        "  ipc handle  {}... (a 64-byte CUipcMemHandle)",
        &handle[..16]
    );
    let _ = writeln!(
        out,
        "  grants      read and write of the range, to any process of this host that opens it \
         (cuIpcOpenMemHandle)"
    );
    let whole = uri.allocation().map_or_else(
        || "the whole allocation".to_owned(),
        |a| format!("the whole allocation ({})", bytes_text(a)),
    );
    let _ = writeln!(
        out,
        "  trust       the IPC handle opens {whole}, not only the range: whoever holds this URI \
         can read and write all of it while the exporter keeps it. A URI is a capability: send \
         it only to processes trusted that far, over a channel others cannot read."
    );
    out
}

fn rights_text(rights: GrantRights) -> &'static str {
    match rights {
        GrantRights::Read => "read only (RDMA READ from the range)",
        GrantRights::Write => "write only (RDMA WRITE into the range)",
        GrantRights::ReadWrite => "read and write (RDMA READ and WRITE)",
    }
}

fn exact_bytes(n: u64) -> String {
    if n < 1024 {
        format!("{n} bytes")
    } else {
        format!("{n} bytes ({})", bytes_text(n))
    }
}

fn explain_descriptor(d: &MemoryDescriptor, form: &str, form_len: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "memory descriptor, version 2 ({form}, {form_len} bytes)"
    );
    let _ = writeln!(out, "  owner       engine {:#x}", d.owner);
    let _ = writeln!(out, "  grant       {:#x} on that engine", d.grant);
    let location = match d.location {
        MemoryLocation::Host => "host memory of the owner's node".to_owned(),
        MemoryLocation::Gpu { ordinal } => format!("memory of GPU {ordinal} on the owner's node"),
    };
    let _ = writeln!(out, "  location    {location}");
    let _ = writeln!(out, "  rights      {}", rights_text(d.rights));
    let _ = writeln!(out, "  length      {}", exact_bytes(d.len));
    match &d.reach {
        Reach::Staged => {
            let _ = writeln!(
                out,
                "  reach       staged: no memory region a peer can name; its READs and WRITEs \
                 become a rendezvous over control messages with the owner"
            );
        }
        Reach::Direct(_) => {
            let devices: Vec<&str> = {
                let mut names: Vec<&str> = d.devices().collect();
                names.dedup();
                names
            };
            let _ = writeln!(
                out,
                "  reach       direct, through {} NIC{} of the owner (each reaches the whole \
                 grant)",
                devices.len(),
                if devices.len() == 1 { "" } else { "s" }
            );
            for device in devices {
                let segments: Vec<_> = d.segments().iter().filter(|s| s.device == device).collect();
                let _ = writeln!(
                    out,
                    "    {device}: {} segment{}",
                    segments.len(),
                    if segments.len() == 1 { "" } else { "s" }
                );
                for s in segments {
                    let _ = writeln!(
                        out,
                        "      bytes {:#x}..{:#x} at address {:#x}, rkey {:#x}",
                        s.offset,
                        s.offset + s.len,
                        s.addr,
                        s.rkey
                    );
                }
            }
        }
    }
    match form {
        "binary form" => {
            let _ = writeln!(out, "  text form   {d}");
        }
        _ => {
            if let Ok(bytes) = d.encode() {
                let _ = writeln!(out, "  binary form {} bytes", bytes.len());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const HANDLE: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\
                          0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn a_v2_uri_says_its_range_and_the_whole_allocation_it_opens() {
        let uri =
            format!("gdr://v2/device/3/allocation/2097152/offset/4096/size/8192/ipc/{HANDLE}");
        let text = explain(&uri, false).unwrap();
        assert!(text.contains("GPU 3"), "{text}");
        assert!(text.contains("bytes 4096..12288"), "{text}");
        assert!(text.contains("2097152 bytes (2 MiB)"), "{text}");
        assert!(
            text.contains("opens the whole allocation (2 MiB)"),
            "{text}"
        );
    }

    #[test]
    fn a_descriptor_says_its_grant_per_nic() {
        let descriptor = "gdr-md:v2:1f:7:gpu0:r:2000:\
                          mlx5_0@0+1000=7f0000001000/1a2b,mlx5_0@1000+1000=7f0000003000/1a2c,\
                          mlx5_1@0+2000=9000/3";
        let text = explain(descriptor, false).unwrap();
        assert!(text.contains("engine 0x1f"), "{text}");
        assert!(text.contains("GPU 0"), "{text}");
        assert!(text.contains("read only"), "{text}");
        assert!(text.contains("through 2 NICs"), "{text}");
        assert!(text.contains("mlx5_0: 2 segments"), "{text}");
        assert!(text.contains("mlx5_1: 1 segment\n"), "{text}");
        // The binary form of the same descriptor, as hex, says the same.
        let parsed: MemoryDescriptor = descriptor.parse().unwrap();
        let hex: String = parsed
            .encode()
            .unwrap()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let binary = explain(&hex, true).unwrap();
        assert!(binary.contains("mlx5_0: 2 segments"), "{binary}");
        assert!(binary.contains(descriptor), "{binary}");
    }

    #[test]
    fn staged_descriptors_say_rendezvous() {
        let text = explain("gdr-md:v2:1:2:host:rw:10:staged", false).unwrap();
        assert!(text.contains("staged"), "{text}");
        assert!(text.contains("read and write"), "{text}");
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let err = explain("gdr://v2/device/01/size/1/ipc/x", false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("device") && err.contains("leading zero"),
            "{err}"
        );
        let err = explain("gdr-md:v2:1:2:host:x:10:staged", false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"x\""), "{err}");
        let err = explain("abc", true).unwrap_err().to_string();
        assert!(err.contains("odd number"), "{err}");
        let err = explain("zz", true).unwrap_err().to_string();
        assert!(err.contains("not hex"), "{err}");
        // "GDRM", version 2, and nothing more.
        let err = explain("4744524d02", true).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
        let err = explain("00", true).unwrap_err().to_string();
        assert!(err.contains("bad magic"), "{err}");
        let err = explain("http://x", false).unwrap_err().to_string();
        assert!(err.contains("neither"), "{err}");
    }
}
