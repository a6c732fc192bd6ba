//! Memory descriptors: what a peer needs to READ or WRITE a registered range
//! (address, length, rkey, the NIC that registered it, memory kind), in a
//! compact versioned binary form for the wire and rdma_cm private data, and a
//! text form for logs, configuration and command lines.
//!
//! Both parsers are strict: wrong magic or version, a truncated or oversized
//! input, trailing bytes, a range that wraps the address space, a zero
//! length, a bad device name: each is a distinct [`DescriptorError`], and
//! nothing is guessed. Both are fuzzed (`fuzz/fuzz_targets/descriptor.rs`).
//!
//! Binary form v1 (little endian), a 29-byte header ([`HEADER_LEN`]) and the
//! device name, at most 92 bytes ([`MAX_ENCODED_LEN`]): `"GDRM" | version u8
//! = 1 | kind u8 (0 host, 1 GPU) | ordinal u16 | rkey u32 | addr u64 | len u64
//! | name_len u8 | name`. It fits rdma_cm's REQ private data (56 bytes) only
//! with a device name of up to 27 bytes; longer ones go over SEND after
//! connecting.
//!
//! Text form v1: `gdr-md:v1:{host|gpuN}:{device}:{addr hex}:{len}:{rkey hex}`,
//! e.g. `gdr-md:v1:gpu0:mlx5_0:0x7f0000001000:1048576:0x1a2b`.

use std::fmt;
use std::str::FromStr;

/// Magic of the binary form.
pub const MAGIC: [u8; 4] = *b"GDRM";
/// The only version this build reads and writes.
pub const VERSION: u8 = 1;
/// Bytes before the device name in the binary form.
pub const HEADER_LEN: usize = 4 + 1 + 1 + 2 + 4 + 8 + 8 + 1;
/// Longest device name (Linux's IB_DEVICE_NAME_MAX is 64, with the NUL).
pub const MAX_DEVICE_NAME: usize = 63;
/// Longest binary form.
pub const MAX_ENCODED_LEN: usize = HEADER_LEN + MAX_DEVICE_NAME;

const TEXT_PREFIX: &str = "gdr-md:v1:";

/// Where the described memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryLocation {
    /// Host memory (pageable or pinned: the peer cannot tell, need not care).
    Host,
    /// Memory of GPU `ordinal` on the owning node.
    Gpu {
        /// The GPU's ordinal there.
        ordinal: u16,
    },
}

/// A registered range a peer may access with one-sided operations.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MemoryDescriptor {
    /// First address as the owner's NIC sees it (the iova).
    pub addr: u64,
    /// Length in bytes, never 0.
    pub len: u64,
    /// The remote key.
    pub rkey: u32,
    /// The owner's NIC that registered it, e.g. `mlx5_0`.
    pub device: String,
    /// Host or GPU memory.
    pub location: MemoryLocation,
}

/// Why a descriptor was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescriptorError {
    /// Fewer bytes than the form needs.
    #[error("descriptor truncated: {got} bytes, need {need}")]
    Truncated {
        /// Bytes given.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// More bytes than the descriptor holds.
    #[error("descriptor has {0} trailing bytes")]
    TrailingBytes(usize),
    /// Not a gdr descriptor.
    #[error("not a gdr memory descriptor (bad magic or prefix)")]
    BadMagic,
    /// A version this build does not read.
    #[error("descriptor version {0} is not supported (this build reads {VERSION})")]
    UnsupportedVersion(u8),
    /// An unknown memory-kind byte or word.
    #[error("unknown memory location {0:?}")]
    BadLocation(String),
    /// A device name that is empty, too long, or not `[A-Za-z0-9_.-]`.
    #[error("bad device name {0:?}")]
    BadDeviceName(String),
    /// Zero length, or `addr + len` past the end of the address space.
    #[error("bad range: {len} bytes at {addr:#x}")]
    BadRange {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// A text field that is not a number of the expected form.
    #[error("bad {field} field {value:?}")]
    BadField {
        /// Which field.
        field: &'static str,
        /// What it held.
        value: String,
    },
}

fn check_device(name: &str) -> Result<(), DescriptorError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_DEVICE_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(DescriptorError::BadDeviceName(name.to_owned()))
    }
}

fn check_range(addr: u64, len: u64) -> Result<(), DescriptorError> {
    if len == 0 || addr.checked_add(len).is_none() {
        Err(DescriptorError::BadRange { addr, len })
    } else {
        Ok(())
    }
}

impl MemoryDescriptor {
    /// Checks the invariants a parsed descriptor has.
    pub fn validate(&self) -> Result<(), DescriptorError> {
        check_device(&self.device)?;
        check_range(self.addr, self.len)
    }

    /// The binary form. Fails only if the descriptor is invalid.
    pub fn encode(&self) -> Result<Vec<u8>, DescriptorError> {
        self.validate()?;
        let (kind, ordinal) = match self.location {
            MemoryLocation::Host => (0u8, 0u16),
            MemoryLocation::Gpu { ordinal } => (1u8, ordinal),
        };
        let mut out = Vec::with_capacity(HEADER_LEN + self.device.len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(kind);
        out.extend_from_slice(&ordinal.to_le_bytes());
        out.extend_from_slice(&self.rkey.to_le_bytes());
        out.extend_from_slice(&self.addr.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.push(self.device.len() as u8);
        out.extend_from_slice(self.device.as_bytes());
        Ok(out)
    }

    /// Parses exactly one binary descriptor (no trailing bytes).
    pub fn decode(bytes: &[u8]) -> Result<Self, DescriptorError> {
        if bytes.len() < HEADER_LEN {
            if bytes.len() >= 4 && bytes[..4] != MAGIC {
                return Err(DescriptorError::BadMagic);
            }
            return Err(DescriptorError::Truncated {
                got: bytes.len(),
                need: HEADER_LEN,
            });
        }
        let (header, name) = bytes.split_at(HEADER_LEN);
        if header[..4] != MAGIC {
            return Err(DescriptorError::BadMagic);
        }
        if header[4] != VERSION {
            return Err(DescriptorError::UnsupportedVersion(header[4]));
        }
        let u16_at = |i: usize| u16::from_le_bytes([header[i], header[i + 1]]);
        let u32_at =
            |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&header[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let location = match (header[5], u16_at(6)) {
            (0, 0) => MemoryLocation::Host,
            (1, ordinal) => MemoryLocation::Gpu { ordinal },
            (kind, ordinal) => {
                return Err(DescriptorError::BadLocation(format!(
                    "kind {kind}, ordinal {ordinal}"
                )));
            }
        };
        let name_len = usize::from(header[HEADER_LEN - 1]);
        if name.len() < name_len {
            return Err(DescriptorError::Truncated {
                got: bytes.len(),
                need: HEADER_LEN + name_len,
            });
        }
        if name.len() > name_len {
            return Err(DescriptorError::TrailingBytes(name.len() - name_len));
        }
        let device = std::str::from_utf8(name)
            .map_err(|_| DescriptorError::BadDeviceName(String::from_utf8_lossy(name).into()))?
            .to_owned();
        let descriptor = Self {
            addr: u64_at(12),
            len: u64_at(20),
            rkey: u32_at(8),
            device,
            location,
        };
        descriptor.validate()?;
        Ok(descriptor)
    }
}

impl fmt::Display for MemoryDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let location = match self.location {
            MemoryLocation::Host => "host".to_owned(),
            MemoryLocation::Gpu { ordinal } => format!("gpu{ordinal}"),
        };
        write!(
            f,
            "{TEXT_PREFIX}{location}:{}:{:#x}:{}:{:#x}",
            self.device, self.addr, self.len, self.rkey
        )
    }
}

fn parse_hex<T: TryFrom<u64>>(field: &'static str, value: &str) -> Result<T, DescriptorError> {
    let bad = || DescriptorError::BadField {
        field,
        value: value.to_owned(),
    };
    let digits = value.strip_prefix("0x").ok_or_else(bad)?;
    // from_str_radix accepts a leading '+'; the text form does not.
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    let wide = u64::from_str_radix(digits, 16).map_err(|_| bad())?;
    T::try_from(wide).map_err(|_| bad())
}

impl FromStr for MemoryDescriptor {
    type Err = DescriptorError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.len() > 256 {
            return Err(DescriptorError::TrailingBytes(text.len() - 256));
        }
        let rest = match text.strip_prefix(TEXT_PREFIX) {
            Some(rest) => rest,
            None if text.starts_with("gdr-md:") => {
                let version = text["gdr-md:".len()..]
                    .split(':')
                    .next()
                    .and_then(|v| v.strip_prefix('v'))
                    .and_then(|v| v.parse::<u8>().ok())
                    .unwrap_or(0);
                return Err(DescriptorError::UnsupportedVersion(version));
            }
            None => return Err(DescriptorError::BadMagic),
        };
        let fields: Vec<&str> = rest.split(':').collect();
        let [location, device, addr, len, rkey] = fields[..] else {
            return Err(DescriptorError::BadField {
                field: "field count",
                value: fields.len().to_string(),
            });
        };
        let location = match location {
            "host" => MemoryLocation::Host,
            gpu => {
                let ordinal = gpu
                    .strip_prefix("gpu")
                    .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|d| d.parse::<u16>().ok())
                    .ok_or_else(|| DescriptorError::BadLocation(gpu.to_owned()))?;
                MemoryLocation::Gpu { ordinal }
            }
        };
        check_device(device)?;
        if len.is_empty() || !len.bytes().all(|b| b.is_ascii_digit()) {
            return Err(DescriptorError::BadField {
                field: "len",
                value: len.to_owned(),
            });
        }
        let descriptor = Self {
            addr: parse_hex("addr", addr)?,
            len: len.parse().map_err(|_| DescriptorError::BadField {
                field: "len",
                value: len.to_owned(),
            })?,
            rkey: parse_hex("rkey", rkey)?,
            device: device.to_owned(),
            location,
        };
        descriptor.validate()?;
        Ok(descriptor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> MemoryDescriptor {
        MemoryDescriptor {
            addr: 0x7f00_0000_1000,
            len: 1 << 20,
            rkey: 0x1a2b,
            device: "mlx5_0".into(),
            location: MemoryLocation::Gpu { ordinal: 3 },
        }
    }

    #[test]
    fn binary_and_text_forms_round_trip() {
        let d = sample();
        let bytes = d.encode().unwrap();
        assert_eq!(bytes.len(), HEADER_LEN + 6);
        assert_eq!(MemoryDescriptor::decode(&bytes).unwrap(), d);
        let text = d.to_string();
        assert_eq!(text, "gdr-md:v1:gpu3:mlx5_0:0x7f0000001000:1048576:0x1a2b");
        assert_eq!(text.parse::<MemoryDescriptor>().unwrap(), d);
        let host = MemoryDescriptor {
            location: MemoryLocation::Host,
            ..d
        };
        assert_eq!(
            MemoryDescriptor::decode(&host.encode().unwrap()).unwrap(),
            host
        );
    }

    #[test]
    fn binary_parser_rejects_each_malformation() {
        let good = sample().encode().unwrap();
        use DescriptorError as E;
        assert!(matches!(
            MemoryDescriptor::decode(&good[..good.len() - 1]),
            Err(E::Truncated { .. })
        ));
        assert!(matches!(
            MemoryDescriptor::decode(&good[..10]),
            Err(E::Truncated { .. })
        ));
        let mut long = good.clone();
        long.push(0);
        assert_eq!(MemoryDescriptor::decode(&long), Err(E::TrailingBytes(1)));
        let mut bad = good.clone();
        bad[0] = b'X';
        assert_eq!(MemoryDescriptor::decode(&bad), Err(E::BadMagic));
        let mut bad = good.clone();
        bad[4] = 2;
        assert_eq!(
            MemoryDescriptor::decode(&bad),
            Err(E::UnsupportedVersion(2))
        );
        let mut bad = good.clone();
        bad[5] = 9;
        assert!(matches!(
            MemoryDescriptor::decode(&bad),
            Err(E::BadLocation(_))
        ));
        let mut bad = good.clone();
        bad[20..28].copy_from_slice(&0u64.to_le_bytes());
        assert!(matches!(
            MemoryDescriptor::decode(&bad),
            Err(E::BadRange { .. })
        ));
        let mut bad = good.clone();
        bad[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            MemoryDescriptor::decode(&bad),
            Err(E::BadRange { .. })
        ));
        let mut bad = good;
        let last = bad.len() - 1;
        bad[last] = b'/';
        assert!(matches!(
            MemoryDescriptor::decode(&bad),
            Err(E::BadDeviceName(_))
        ));
    }

    #[test]
    fn text_parser_rejects_each_malformation() {
        use DescriptorError as E;
        let parse = |s: &str| s.parse::<MemoryDescriptor>();
        assert_eq!(parse("http://x"), Err(E::BadMagic));
        assert_eq!(
            parse("gdr-md:v2:host:mlx5_0:0x1000:1:0x1"),
            Err(E::UnsupportedVersion(2))
        );
        assert!(matches!(
            parse("gdr-md:v1:host:mlx5_0:0x1000:1"),
            Err(E::BadField { .. })
        ));
        assert!(matches!(
            parse("gdr-md:v1:cpu:mlx5_0:0x1000:1:0x1"),
            Err(E::BadLocation(_))
        ));
        assert!(matches!(
            parse("gdr-md:v1:gpu:mlx5_0:0x1000:1:0x1"),
            Err(E::BadLocation(_))
        ));
        assert!(matches!(
            parse("gdr-md:v1:gpu70000:mlx5_0:0x1000:1:0x1"),
            Err(E::BadLocation(_))
        ));
        assert!(matches!(
            parse("gdr-md:v1:host::0x1000:1:0x1"),
            Err(E::BadDeviceName(_))
        ));
        assert!(matches!(
            parse("gdr-md:v1:host:mlx5_0:1000:1:0x1"),
            Err(E::BadField { .. })
        ));
        assert!(matches!(
            parse("gdr-md:v1:host:mlx5_0:0x+100:1:0x1"),
            Err(E::BadField { .. })
        ));
        assert!(matches!(
            parse("gdr-md:v1:host:mlx5_0:0x1000:+1:0x1"),
            Err(E::BadField { .. })
        ));
        assert!(matches!(
            parse("gdr-md:v1:host:mlx5_0:0x1000:1:0x100000000"),
            Err(E::BadField { .. })
        ));
        assert!(matches!(
            parse("gdr-md:v1:host:mlx5_0:0x1000:0:0x1"),
            Err(E::BadRange { .. })
        ));
        assert!(matches!(
            parse("gdr-md:v1:host:mlx5_0:0xffffffffffffffff:2:0x1"),
            Err(E::BadRange { .. })
        ));
        assert!(parse(&format!("gdr-md:v1:host:{}:0x1:1:0x1", "a".repeat(300))).is_err());
    }
}
