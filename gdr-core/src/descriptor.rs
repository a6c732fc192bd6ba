//! Memory descriptors: what a peer needs to READ or WRITE memory another
//! engine granted it: who granted it (the owner engine and its grant id),
//! where the memory lives, the rights and the length granted, and how to
//! reach it: one or more segments per NIC of the owner (address as that NIC
//! knows it, rkey), or nothing ([`Reach::Staged`]) when the owner's memory
//! has no MR a peer can name and accesses become a rendezvous over control
//! messages.
//!
//! The format is frozen by the C ABI, so both parsers are strict: each
//! malformation is a distinct [`DescriptorError`], nothing is guessed, and
//! every accepted input has exactly one spelling (decoding then encoding
//! gives the input back, byte for byte; parsing then displaying gives the
//! text back). Both are fuzzed (`fuzz/fuzz_targets/descriptor.rs`).
//!
//! # Invariants (checked by [`MemoryDescriptor::validate`] and both parsers)
//!
//! - `owner`, `grant` and `len` are nonzero; a GPU ordinal is at most
//!   1023;
//! - [`Reach::Direct`] has 1 to 64 segments, each of nonzero
//!   length, whose `addr + len` does not wrap and whose `offset + len` is
//!   within the descriptor's `len`;
//! - segments are sorted by (device, offset), and each device's segments
//!   tile `[0, len)` exactly (no gap, no overlap): every NIC listed reaches
//!   the whole grant;
//! - device names are 1 to 63 bytes of `[A-Za-z0-9_-]`,
//!   starting with a letter or digit.
//!
//! # Binary form, version 2 (little endian)
//!
//! A 35-byte header, then the segments:
//!
//! ```text
//! "GDRM" | version u8 = 2 | location u8 (0 host, 1 GPU) | ordinal u16 (0 for host)
//!        | rights u8 (1 read, 2 write, 3 both) | reach u8 (0 staged, 1 direct)
//!        | segment count u8 (0 when staged) | owner u64 | grant u64 | len u64
//! segment: offset u64 | len u64 | addr u64 | rkey u32 | name_len u8 | name
//! ```
//!
//! At most [`MAX_ENCODED_LEN`] bytes. One segment on a NIC of name length
//! `n` takes `64 + n` bytes: it fits rdma_cm's accept (REP) private data,
//! not the 56 bytes of a connect (REQ).
//!
//! # Text form, version 2
//!
//! ```text
//! descriptor := "gdr-md:v2:" owner ":" grant ":" location ":" rights ":" len ":" reach
//! owner, grant, len, off, addr, rkey := hex
//! hex        := "0" | [1-9a-f] [0-9a-f]*          (lowercase, no "0x", no leading zeros)
//! location   := "host" | "gpu" dec                 (dec: "0" | [1-9][0-9]*, at most 1023)
//! rights     := "r" | "w" | "rw"
//! reach      := "staged" | segment ("," segment)*
//! segment    := device "@" off "+" seglen "=" addr "/" rkey
//! device     := [A-Za-z0-9] [A-Za-z0-9_-]*         (at most 63 bytes)
//! ```
//!
//! e.g. `gdr-md:v2:1f:7:gpu0:rw:100000:mlx5_0@0+100000=7f0000001000/1a2b`.
//! At most [`MAX_TEXT_LEN`] bytes.

use std::fmt;
use std::str::FromStr;

use hal_verbs::AccessFlags;

/// Magic of the binary form.
pub(crate) const MAGIC: [u8; 4] = *b"GDRM";
/// The only version this build reads and writes.
pub(crate) const VERSION: u8 = 2;
/// Bytes of the binary form's header.
pub(crate) const HEADER_LEN: usize = 4 + 1 + 1 + 2 + 1 + 1 + 1 + 8 + 8 + 8;
/// Bytes of a segment in the binary form, before its device name.
pub(crate) const SEGMENT_HEADER_LEN: usize = 8 + 8 + 8 + 4 + 1;
/// Most segments a descriptor holds.
pub(crate) const MAX_SEGMENTS: usize = 64;
/// Longest device name (Linux's IB_DEVICE_NAME_MAX is 64, with the NUL).
pub(crate) const MAX_DEVICE_NAME: usize = 63;
/// Highest GPU ordinal a descriptor names.
pub(crate) const MAX_GPU_ORDINAL: u16 = 1023;
// The figures the module docs give.
const _: () = assert!(HEADER_LEN == 35 && MAX_SEGMENTS == 64 && MAX_DEVICE_NAME == 63);
const _: () = assert!(MAX_GPU_ORDINAL == 1023);

/// Longest binary form.
pub const MAX_ENCODED_LEN: usize =
    HEADER_LEN + MAX_SEGMENTS * (SEGMENT_HEADER_LEN + MAX_DEVICE_NAME);
/// Longest text form.
pub const MAX_TEXT_LEN: usize = TEXT_PREFIX.len()
    + (16 + 1) * 2 // owner, grant
    + "gpu1023:".len()
    + "rw:".len()
    + 16 + 1 // len
    + MAX_SEGMENTS * (MAX_DEVICE_NAME + 1 + 16 + 1 + 16 + 1 + 16 + 1 + 8)
    + (MAX_SEGMENTS - 1);

const TEXT_PREFIX: &str = "gdr-md:v2:";
const TEXT_MAGIC: &str = "gdr-md:";
const STAGED: &str = "staged";

/// Where the described memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryLocation {
    /// Host memory (pageable or pinned: the peer cannot tell, need not care).
    Host,
    /// Memory of GPU `ordinal` on the owning node.
    Gpu {
        /// The GPU's ordinal there, at most 1023.
        ordinal: u16,
    },
}

/// What a peer may do with a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GrantRights {
    /// RDMA READ from the range.
    Read,
    /// RDMA WRITE into the range.
    Write,
    /// Both.
    ReadWrite,
}

impl GrantRights {
    /// The MR access flags of exactly these rights (remote write needs
    /// local write, by the verbs rules).
    pub fn access(self) -> AccessFlags {
        match self {
            Self::Read => AccessFlags::REMOTE_READ,
            Self::Write => AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            Self::ReadWrite => {
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ
            }
        }
    }

    /// Whether a peer may READ the memory.
    pub fn allows_read(self) -> bool {
        matches!(self, Self::Read | Self::ReadWrite)
    }

    /// Whether a peer may WRITE the memory.
    pub fn allows_write(self) -> bool {
        matches!(self, Self::Write | Self::ReadWrite)
    }

    fn code(self) -> u8 {
        match self {
            Self::Read => 1,
            Self::Write => 2,
            Self::ReadWrite => 3,
        }
    }

    fn word(self) -> &'static str {
        match self {
            Self::Read => "r",
            Self::Write => "w",
            Self::ReadWrite => "rw",
        }
    }
}

/// Part of a grant as one NIC of the owner reaches it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Where the segment starts within the granted range.
    pub offset: u64,
    /// Its length in bytes, never 0.
    pub len: u64,
    /// Its first address as the owner's NIC `device` knows it (the iova).
    pub addr: u64,
    /// The remote key.
    pub rkey: u32,
    /// The owner's NIC, e.g. `mlx5_0`.
    pub device: String,
}

impl Segment {
    /// The address of byte `offset` of the grant, which must lie in this
    /// segment.
    pub fn addr_of(&self, offset: u64) -> u64 {
        self.addr + (offset - self.offset)
    }
}

/// How a peer reaches the granted memory.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Reach {
    /// One-sided operations on these segments, sorted by (device, offset);
    /// each device's segments tile the grant.
    Direct(Vec<Segment>),
    /// The owner's memory has no MR a peer can name (the pinned-host
    /// staging rung): a peer's READ or WRITE becomes a rendezvous over
    /// control messages.
    Staged,
}

/// Memory an engine granted to a peer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MemoryDescriptor {
    /// The granting engine's id, nonzero.
    pub owner: u64,
    /// The grant's id on that engine, nonzero.
    pub grant: u64,
    /// Host or GPU memory.
    pub location: MemoryLocation,
    /// What the peer may do.
    pub rights: GrantRights,
    /// Bytes granted, nonzero.
    pub len: u64,
    /// How the peer reaches them.
    pub reach: Reach,
}

/// Why a descriptor was rejected, or a segment not found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescriptorError {
    /// Fewer bytes than the binary form needs.
    #[error("descriptor truncated: {got} bytes, need {need}")]
    Truncated {
        /// Bytes given.
        got: usize,
        /// Bytes needed (so far).
        need: usize,
    },
    /// Bytes after the last segment.
    #[error("descriptor has {0} trailing bytes")]
    TrailingBytes(usize),
    /// A text form longer than [`MAX_TEXT_LEN`].
    #[error("descriptor text of {len} bytes is longer than {max}")]
    TooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Not a gdr descriptor.
    #[error("not a gdr memory descriptor (bad magic or prefix)")]
    BadMagic,
    /// A version this build does not read.
    #[error("descriptor version {0} is not supported (this build reads {VERSION})")]
    UnsupportedVersion(u8),
    /// An unknown memory location (binary kind and ordinal, or text word).
    #[error("unknown memory location {0:?}")]
    BadLocation(String),
    /// A GPU ordinal above 1023.
    #[error("GPU ordinal {0} is above {MAX_GPU_ORDINAL}")]
    BadGpuOrdinal(u16),
    /// Unknown rights (binary code or text word).
    #[error("unknown grant rights {0:?}")]
    BadRights(String),
    /// An unknown reach byte, or a staged descriptor with segments.
    #[error("bad reach: {0}")]
    BadReach(String),
    /// A device name that is empty, too long, not `[A-Za-z0-9_-]`, or not
    /// starting with a letter or digit.
    #[error("bad device name {0:?}")]
    BadDeviceName(String),
    /// A text field that is not in its one canonical spelling.
    #[error("bad {field} field {value:?}")]
    BadField {
        /// Which field.
        field: &'static str,
        /// What it held.
        value: String,
    },
    /// A field that must be nonzero is 0.
    #[error("descriptor {0} is 0")]
    Zero(&'static str),
    /// Direct reach with no segment.
    #[error("direct reach with no segment")]
    NoSegments,
    /// More than 64 segments.
    #[error("{0} segments, at most {MAX_SEGMENTS} allowed")]
    TooManySegments(usize),
    /// A segment of length 0.
    #[error("segment {index} is empty")]
    EmptySegment {
        /// Its index.
        index: usize,
    },
    /// A segment whose `addr + len` wraps the address space.
    #[error("segment {index}: {len} bytes at {addr:#x} wrap the address space")]
    SegmentWraps {
        /// Its index.
        index: usize,
        /// Its address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A segment running past the granted length.
    #[error(
        "segment {index}: {len} bytes at offset {offset:#x} run past the grant's {total} bytes"
    )]
    SegmentOutOfRange {
        /// Its index.
        index: usize,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The grant's length.
        total: u64,
    },
    /// Segments not sorted by (device, offset).
    #[error("segment {index} is out of (device, offset) order")]
    Unsorted {
        /// The first one out of order.
        index: usize,
    },
    /// A device's segments leave part of the grant uncovered.
    #[error("segments of {device} leave offsets {start:#x}..{end:#x} uncovered")]
    SegmentGap {
        /// The device.
        device: String,
        /// First uncovered offset.
        start: u64,
        /// End of the uncovered range.
        end: u64,
    },
    /// Two segments of a device overlap.
    #[error(
        "segment of {device} at offset {offset:#x} overlaps the one before (which ends at {expected:#x})"
    )]
    SegmentOverlap {
        /// The device.
        device: String,
        /// The overlapping segment's offset.
        offset: u64,
        /// Where the previous segment ended.
        expected: u64,
    },
    /// An access outside the grant (or of no bytes).
    #[error("{len} bytes at offset {offset:#x} are not inside the grant's {total} bytes")]
    OutOfBounds {
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The grant's length.
        total: u64,
    },
    /// No segment on the device asked for.
    #[error("no segment on device {device:?}")]
    NoSegment {
        /// The device.
        device: String,
    },
    /// The grant is staged: no segment can be named.
    #[error("the grant is staged: it has no segments")]
    Staged,
    /// The access crosses a segment boundary on the device.
    #[error("{len} bytes at offset {offset:#x} span more than one segment of {device}")]
    SpansSegments {
        /// The device.
        device: String,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
    },
}

type E = DescriptorError;

fn check_device(name: &str) -> Result<(), DescriptorError> {
    let bytes = name.as_bytes();
    let ok = !bytes.is_empty()
        && bytes.len() <= MAX_DEVICE_NAME
        && bytes[0].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(E::BadDeviceName(name.to_owned()))
    }
}

impl MemoryDescriptor {
    /// Checks every invariant of the [module docs](self).
    pub fn validate(&self) -> Result<(), DescriptorError> {
        if self.owner == 0 {
            return Err(E::Zero("owner"));
        }
        if self.grant == 0 {
            return Err(E::Zero("grant"));
        }
        if self.len == 0 {
            return Err(E::Zero("len"));
        }
        if let MemoryLocation::Gpu { ordinal } = self.location
            && ordinal > MAX_GPU_ORDINAL
        {
            return Err(E::BadGpuOrdinal(ordinal));
        }
        let segments = match &self.reach {
            Reach::Staged => return Ok(()),
            Reach::Direct(segments) => segments,
        };
        if segments.is_empty() {
            return Err(E::NoSegments);
        }
        if segments.len() > MAX_SEGMENTS {
            return Err(E::TooManySegments(segments.len()));
        }
        for (index, s) in segments.iter().enumerate() {
            check_device(&s.device)?;
            if s.len == 0 {
                return Err(E::EmptySegment { index });
            }
            if s.addr.checked_add(s.len).is_none() {
                return Err(E::SegmentWraps {
                    index,
                    addr: s.addr,
                    len: s.len,
                });
            }
            if s.offset.checked_add(s.len).is_none_or(|end| end > self.len) {
                return Err(E::SegmentOutOfRange {
                    index,
                    offset: s.offset,
                    len: s.len,
                    total: self.len,
                });
            }
        }
        for (index, pair) in segments.windows(2).enumerate() {
            if (pair[0].device.as_str(), pair[0].offset) > (pair[1].device.as_str(), pair[1].offset)
            {
                return Err(E::Unsorted { index: index + 1 });
            }
        }
        // Sorted: each device's segments are consecutive, by offset.
        let mut expected = 0;
        for (index, s) in segments.iter().enumerate() {
            let first = index == 0 || segments[index - 1].device != s.device;
            if first {
                expected = 0;
            }
            if s.offset > expected {
                return Err(E::SegmentGap {
                    device: s.device.clone(),
                    start: expected,
                    end: s.offset,
                });
            }
            if s.offset < expected {
                return Err(E::SegmentOverlap {
                    device: s.device.clone(),
                    offset: s.offset,
                    expected,
                });
            }
            expected = s.offset + s.len;
            let last = segments.get(index + 1).is_none_or(|n| n.device != s.device);
            if last && expected != self.len {
                return Err(E::SegmentGap {
                    device: s.device.clone(),
                    start: expected,
                    end: self.len,
                });
            }
        }
        Ok(())
    }

    /// The segments ([`Reach::Direct`]), or none (staged).
    pub fn segments(&self) -> &[Segment] {
        match &self.reach {
            Reach::Direct(segments) => segments,
            Reach::Staged => &[],
        }
    }

    /// The segment on `device` that holds `[offset, offset + len)` wholly.
    pub fn segment(
        &self,
        device: &str,
        offset: u64,
        len: u64,
    ) -> Result<&Segment, DescriptorError> {
        let end = offset
            .checked_add(len)
            .filter(|&end| len != 0 && end <= self.len)
            .ok_or(E::OutOfBounds {
                offset,
                len,
                total: self.len,
            })?;
        let Reach::Direct(segments) = &self.reach else {
            return Err(E::Staged);
        };
        let mut on_device = segments.iter().filter(|s| s.device == device).peekable();
        if on_device.peek().is_none() {
            return Err(E::NoSegment {
                device: device.to_owned(),
            });
        }
        on_device
            .find(|s| s.offset <= offset && end <= s.offset + s.len)
            .ok_or_else(|| E::SpansSegments {
                device: device.to_owned(),
                offset,
                len,
            })
    }

    /// The owner's NICs that reach the grant, each once, in order (none
    /// when staged).
    pub fn devices(&self) -> impl Iterator<Item = &str> {
        let segments = self.segments();
        segments
            .iter()
            .enumerate()
            .filter(move |(i, s)| *i == 0 || segments[i - 1].device != s.device)
            .map(|(_, s)| s.device.as_str())
    }

    /// The binary form. Fails only if the descriptor is invalid.
    pub fn encode(&self) -> Result<Vec<u8>, DescriptorError> {
        self.validate()?;
        let (kind, ordinal) = match self.location {
            MemoryLocation::Host => (0u8, 0u16),
            MemoryLocation::Gpu { ordinal } => (1u8, ordinal),
        };
        let segments = self.segments();
        let names: usize = segments.iter().map(|s| s.device.len()).sum();
        let mut out = Vec::with_capacity(HEADER_LEN + segments.len() * SEGMENT_HEADER_LEN + names);
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(kind);
        out.extend_from_slice(&ordinal.to_le_bytes());
        out.push(self.rights.code());
        out.push(u8::from(matches!(self.reach, Reach::Direct(_))));
        // At most MAX_SEGMENTS (validated).
        out.push(segments.len() as u8);
        out.extend_from_slice(&self.owner.to_le_bytes());
        out.extend_from_slice(&self.grant.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        for s in segments {
            out.extend_from_slice(&s.offset.to_le_bytes());
            out.extend_from_slice(&s.len.to_le_bytes());
            out.extend_from_slice(&s.addr.to_le_bytes());
            out.extend_from_slice(&s.rkey.to_le_bytes());
            // At most MAX_DEVICE_NAME bytes (validated).
            out.push(s.device.len() as u8);
            out.extend_from_slice(s.device.as_bytes());
        }
        Ok(out)
    }

    /// Parses exactly one binary descriptor (no trailing bytes).
    pub fn decode(bytes: &[u8]) -> Result<Self, DescriptorError> {
        let mut r = Reader { bytes, at: 0 };
        // Magic and version first, so a short foreign input says so.
        let magic_len = bytes.len().min(MAGIC.len());
        if bytes[..magic_len] != MAGIC[..magic_len] {
            return Err(E::BadMagic);
        }
        r.take(MAGIC.len())?;
        let version = r.u8()?;
        if version != VERSION {
            return Err(E::UnsupportedVersion(version));
        }
        let (kind, ordinal) = (r.u8()?, r.u16()?);
        let location = match (kind, ordinal) {
            (0, 0) => MemoryLocation::Host,
            (1, ordinal) => MemoryLocation::Gpu { ordinal },
            _ => return Err(E::BadLocation(format!("kind {kind}, ordinal {ordinal}"))),
        };
        let rights = match r.u8()? {
            1 => GrantRights::Read,
            2 => GrantRights::Write,
            3 => GrantRights::ReadWrite,
            other => return Err(E::BadRights(format!("code {other}"))),
        };
        let (reach, count) = (r.u8()?, usize::from(r.u8()?));
        let direct = match (reach, count) {
            (0, 0) => false,
            (0, n) => return Err(E::BadReach(format!("staged with {n} segments"))),
            (1, n) if n > MAX_SEGMENTS => return Err(E::TooManySegments(n)),
            (1, _) => true,
            (other, _) => return Err(E::BadReach(format!("code {other}"))),
        };
        let (owner, grant, len) = (r.u64()?, r.u64()?, r.u64()?);
        let reach = if direct {
            let mut segments = Vec::with_capacity(count);
            for _ in 0..count {
                let (offset, len, addr, rkey) = (r.u64()?, r.u64()?, r.u64()?, r.u32()?);
                let name_len = usize::from(r.u8()?);
                let name = r.take(name_len)?;
                // ASCII by check_device, so valid UTF-8 when it passes.
                let device = String::from_utf8_lossy(name).into_owned();
                if device.as_bytes() != name {
                    return Err(E::BadDeviceName(device));
                }
                check_device(&device)?;
                segments.push(Segment {
                    offset,
                    len,
                    addr,
                    rkey,
                    device,
                });
            }
            Reach::Direct(segments)
        } else {
            Reach::Staged
        };
        if r.at != bytes.len() {
            return Err(E::TrailingBytes(bytes.len() - r.at));
        }
        let descriptor = Self {
            owner,
            grant,
            location,
            rights,
            len,
            reach,
        };
        descriptor.validate()?;
        Ok(descriptor)
    }
}

/// A cursor over the binary form.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DescriptorError> {
        let end = self.at + n;
        let slice = self.bytes.get(self.at..end).ok_or(E::Truncated {
            got: self.bytes.len(),
            need: end,
        })?;
        self.at = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DescriptorError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, DescriptorError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, DescriptorError> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, DescriptorError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, DescriptorError> {
        self.array().map(u64::from_le_bytes)
    }
}

impl fmt::Display for MemoryLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Host => f.write_str("host"),
            Self::Gpu { ordinal } => write!(f, "gpu{ordinal}"),
        }
    }
}

impl fmt::Display for Segment {
    /// `device@offset+len=addr/rkey`, numbers in hex.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}@{:x}+{:x}={:x}/{:x}",
            self.device, self.offset, self.len, self.addr, self.rkey
        )
    }
}

/// What a peer's connection needs of the descriptors it announces.
impl gdr_proto::connection::Descriptor for MemoryDescriptor {
    type Error = DescriptorError;
    fn decode(bytes: &[u8]) -> Result<Self, DescriptorError> {
        MemoryDescriptor::decode(bytes)
    }
    fn owner(&self) -> u64 {
        self.owner
    }
    fn grant(&self) -> u64 {
        self.grant
    }
}

impl fmt::Display for MemoryDescriptor {
    /// The text form (which parses back to the descriptor when it is valid).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{TEXT_PREFIX}{:x}:{:x}:{}:{}:{:x}:",
            self.owner,
            self.grant,
            self.location,
            self.rights.word(),
            self.len
        )?;
        match &self.reach {
            Reach::Staged => f.write_str(STAGED),
            Reach::Direct(segments) => {
                for (i, s) in segments.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{s}")?;
                }
                Ok(())
            }
        }
    }
}

/// A canonical hex number: lowercase, no prefix, no leading zeros.
fn parse_hex<T: TryFrom<u64>>(field: &'static str, value: &str) -> Result<T, DescriptorError> {
    let bad = || E::BadField {
        field,
        value: value.to_owned(),
    };
    let b = value.as_bytes();
    let canonical = !b.is_empty()
        && b.len() <= 16
        && b.iter().all(|&c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
        && (b[0] != b'0' || b.len() == 1);
    if !canonical {
        return Err(bad());
    }
    let wide = u64::from_str_radix(value, 16).map_err(|_| bad())?;
    T::try_from(wide).map_err(|_| bad())
}

/// A canonical decimal number: digits only, no leading zeros.
fn parse_dec<T: FromStr>(value: &str) -> Option<T> {
    let b = value.as_bytes();
    let canonical =
        !b.is_empty() && b.iter().all(u8::is_ascii_digit) && (b[0] != b'0' || b.len() == 1);
    canonical.then(|| value.parse().ok()).flatten()
}

fn parse_segment(text: &str) -> Result<Segment, DescriptorError> {
    let bad = || E::BadField {
        field: "segment",
        value: text.to_owned(),
    };
    let (device, rest) = text.split_once('@').ok_or_else(bad)?;
    check_device(device)?;
    let (offset, rest) = rest.split_once('+').ok_or_else(bad)?;
    let (len, rest) = rest.split_once('=').ok_or_else(bad)?;
    let (addr, rkey) = rest.split_once('/').ok_or_else(bad)?;
    Ok(Segment {
        offset: parse_hex("segment offset", offset)?,
        len: parse_hex("segment len", len)?,
        addr: parse_hex("segment addr", addr)?,
        rkey: parse_hex("segment rkey", rkey)?,
        device: device.to_owned(),
    })
}

impl FromStr for MemoryDescriptor {
    type Err = DescriptorError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.len() > MAX_TEXT_LEN {
            return Err(E::TooLong {
                len: text.len(),
                max: MAX_TEXT_LEN,
            });
        }
        let Some(rest) = text.strip_prefix(TEXT_PREFIX) else {
            let Some(versioned) = text.strip_prefix(TEXT_MAGIC) else {
                return Err(E::BadMagic);
            };
            let word = versioned.split(':').next().unwrap_or_default();
            return match word.strip_prefix('v').and_then(parse_dec::<u8>) {
                Some(version) => Err(E::UnsupportedVersion(version)),
                None => Err(E::BadField {
                    field: "version",
                    value: word.to_owned(),
                }),
            };
        };
        let fields: Vec<&str> = rest.splitn(7, ':').collect();
        let [owner, grant, location, rights, len, reach] = fields[..] else {
            return Err(E::BadField {
                field: "field count",
                value: fields.len().to_string(),
            });
        };
        let location = match location {
            "host" => MemoryLocation::Host,
            word => {
                let ordinal = word
                    .strip_prefix("gpu")
                    .and_then(parse_dec::<u16>)
                    .ok_or_else(|| E::BadLocation(word.to_owned()))?;
                MemoryLocation::Gpu { ordinal }
            }
        };
        let rights = match rights {
            "r" => GrantRights::Read,
            "w" => GrantRights::Write,
            "rw" => GrantRights::ReadWrite,
            other => return Err(E::BadRights(other.to_owned())),
        };
        let reach = if reach == STAGED {
            Reach::Staged
        } else {
            let count = reach.split(',').count();
            if count > MAX_SEGMENTS {
                return Err(E::TooManySegments(count));
            }
            Reach::Direct(
                reach
                    .split(',')
                    .map(parse_segment)
                    .collect::<Result<_, _>>()?,
            )
        };
        let descriptor = Self {
            owner: parse_hex("owner", owner)?,
            grant: parse_hex("grant", grant)?,
            location,
            rights,
            len: parse_hex("len", len)?,
            reach,
        };
        descriptor.validate()?;
        Ok(descriptor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(device: &str, offset: u64, len: u64, addr: u64, rkey: u32) -> Segment {
        Segment {
            offset,
            len,
            addr,
            rkey,
            device: device.into(),
        }
    }

    fn sample() -> MemoryDescriptor {
        MemoryDescriptor {
            owner: 0x1f,
            grant: 7,
            location: MemoryLocation::Gpu { ordinal: 3 },
            rights: GrantRights::ReadWrite,
            len: 1 << 20,
            reach: Reach::Direct(vec![
                seg("mlx5_0", 0, 1 << 19, 0x7f00_0000_1000, 0x1a2b),
                seg("mlx5_0", 1 << 19, 1 << 19, 0x7f00_0008_1000, 0x1a2c),
                seg("mlx5_1", 0, 1 << 20, 0x7f00_0000_1000, 0x99),
            ]),
        }
    }

    fn segs(d: &mut MemoryDescriptor) -> &mut Vec<Segment> {
        match &mut d.reach {
            Reach::Direct(segments) => segments,
            Reach::Staged => unreachable!("sample() is direct"),
        }
    }

    fn parse(s: &str) -> Result<MemoryDescriptor, DescriptorError> {
        s.parse()
    }

    const GOOD: &str = "gdr-md:v2:1f:7:gpu3:rw:100000:\
        mlx5_0@0+80000=7f0000001000/1a2b,mlx5_0@80000+80000=7f0000081000/1a2c,\
        mlx5_1@0+100000=7f0000001000/99";

    #[test]
    fn binary_and_text_forms_round_trip() {
        let d = sample();
        let bytes = d.encode().unwrap();
        assert_eq!(bytes.len(), HEADER_LEN + 3 * (SEGMENT_HEADER_LEN + 6));
        assert_eq!(&bytes[..5], b"GDRM\x02");
        assert_eq!(MemoryDescriptor::decode(&bytes).unwrap(), d);
        let text = d.to_string();
        assert_eq!(text, GOOD);
        assert_eq!(parse(&text).unwrap(), d);
        let staged = MemoryDescriptor {
            location: MemoryLocation::Host,
            rights: GrantRights::Read,
            reach: Reach::Staged,
            ..d
        };
        let bytes = staged.encode().unwrap();
        assert_eq!(bytes.len(), HEADER_LEN);
        assert_eq!(MemoryDescriptor::decode(&bytes).unwrap(), staged);
        assert_eq!(staged.to_string(), "gdr-md:v2:1f:7:host:r:100000:staged");
        assert_eq!(parse(&staged.to_string()).unwrap(), staged);
    }

    #[test]
    fn rights_say_what_they_allow() {
        use GrantRights::*;
        assert_eq!(
            [Read, Write, ReadWrite].map(|r| (r.allows_read(), r.allows_write())),
            [(true, false), (false, true), (true, true)]
        );
        assert!(!Read.access().contains(AccessFlags::REMOTE_WRITE));
        assert!(Write.access().contains(AccessFlags::LOCAL_WRITE));
    }

    #[test]
    fn segment_lookup_and_devices() {
        let d = sample();
        assert_eq!(d.devices().collect::<Vec<_>>(), ["mlx5_0", "mlx5_1"]);
        let s = d.segment("mlx5_0", 0x80000, 0x1000).unwrap();
        assert_eq!((s.offset, s.rkey), (0x80000, 0x1a2c));
        assert_eq!(s.addr_of(0x80010), 0x7f00_0008_1010);
        assert_eq!(d.segment("mlx5_0", 0, 1 << 19).unwrap().rkey, 0x1a2b);
        assert_eq!(d.segment("mlx5_1", 0, 1 << 20).unwrap().rkey, 0x99);
        assert_eq!(
            d.segment("mlx5_0", 0x7ffff, 2),
            Err(E::SpansSegments {
                device: "mlx5_0".into(),
                offset: 0x7ffff,
                len: 2
            })
        );
        assert_eq!(
            d.segment("mlx5_2", 0, 1),
            Err(E::NoSegment {
                device: "mlx5_2".into()
            })
        );
        for (offset, len) in [(0, 0), ((1 << 20) - 1, 2), (u64::MAX, 2), (1 << 20, 1)] {
            assert!(
                matches!(d.segment("mlx5_0", offset, len), Err(E::OutOfBounds { .. })),
                "{offset} {len}"
            );
        }
        let staged = MemoryDescriptor {
            reach: Reach::Staged,
            ..d
        };
        assert_eq!(staged.segment("mlx5_0", 0, 1), Err(E::Staged));
        assert_eq!(staged.devices().count(), 0);
    }

    #[test]
    fn validation_rejects_each_broken_invariant() {
        let with = |f: &dyn Fn(&mut MemoryDescriptor)| {
            let mut d = sample();
            f(&mut d);
            let v = d.validate();
            // Both encoders refuse what validate refuses.
            assert_eq!(d.encode().err(), v.clone().err());
            v
        };
        assert_eq!(with(&|d| d.owner = 0), Err(E::Zero("owner")));
        assert_eq!(with(&|d| d.grant = 0), Err(E::Zero("grant")));
        assert_eq!(with(&|d| d.len = 0), Err(E::Zero("len")));
        assert_eq!(
            with(&|d| d.location = MemoryLocation::Gpu { ordinal: 1024 }),
            Err(E::BadGpuOrdinal(1024))
        );
        assert_eq!(
            with(&|d| d.reach = Reach::Direct(vec![])),
            Err(E::NoSegments)
        );
        assert_eq!(
            with(&|d| d.reach = Reach::Direct(vec![seg("a", 0, d.len, 0, 0); 65])),
            Err(E::TooManySegments(65))
        );
        assert_eq!(
            with(&|d| segs(d)[2].len = 0),
            Err(E::EmptySegment { index: 2 })
        );
        assert!(matches!(
            with(&|d| segs(d)[2].addr = u64::MAX - 10),
            Err(E::SegmentWraps { index: 2, .. })
        ));
        assert!(matches!(
            with(&|d| segs(d)[2].len += 1),
            Err(E::SegmentOutOfRange { index: 2, .. })
        ));
        assert!(matches!(
            with(&|d| segs(d)[2].offset = u64::MAX),
            Err(E::SegmentOutOfRange { index: 2, .. })
        ));
        assert_eq!(with(&|d| segs(d).swap(0, 1)), Err(E::Unsorted { index: 1 }));
        assert_eq!(with(&|d| segs(d).swap(1, 2)), Err(E::Unsorted { index: 2 }));
        // A gap inside a device, at its end, and an overlap.
        assert_eq!(
            with(&|d| segs(d)[0].len -= 0x1000),
            Err(E::SegmentGap {
                device: "mlx5_0".into(),
                start: 0x7f000,
                end: 0x80000
            })
        );
        assert_eq!(
            with(&|d| segs(d)[1].len -= 0x1000),
            Err(E::SegmentGap {
                device: "mlx5_0".into(),
                start: 0xff000,
                end: 0x100000
            })
        );
        assert_eq!(
            with(&|d| segs(d)[2].len -= 1),
            Err(E::SegmentGap {
                device: "mlx5_1".into(),
                start: 0xfffff,
                end: 0x100000
            })
        );
        assert_eq!(
            with(&|d| segs(d)[0].len += 0x1000),
            Err(E::SegmentOverlap {
                device: "mlx5_0".into(),
                offset: 0x80000,
                expected: 0x81000
            })
        );
        // A device starting past 0.
        assert!(matches!(
            with(&|d| {
                segs(d)[2].offset = 1;
                segs(d)[2].len -= 1;
            }),
            Err(E::SegmentGap {
                start: 0,
                end: 1,
                ..
            })
        ));
        for name in [
            "", ".", "..", "a/b", "a:b", "a.b", "-a", "_a", "a b", "é", "a@b",
        ] {
            assert_eq!(
                with(&|d| segs(d)[2].device = name.into()),
                Err(E::BadDeviceName(name.into())),
                "{name:?}"
            );
        }
        let long = "a".repeat(MAX_DEVICE_NAME + 1);
        assert_eq!(
            with(&|d| segs(d)[2].device = long.clone()),
            Err(E::BadDeviceName(long.clone()))
        );
        let longest = "z".repeat(MAX_DEVICE_NAME);
        for name in ["a", "0", "mlx5_0", "rxe-eth0", "A-_", longest.as_str()] {
            let mut d = sample();
            d.reach = Reach::Direct(vec![seg(name, 0, d.len, 0x1000, 1)]);
            d.validate().unwrap();
            assert_eq!(parse(&d.to_string()).unwrap(), d);
        }
    }

    #[test]
    fn binary_parser_rejects_each_malformation() {
        let good = sample().encode().unwrap();
        let decode = MemoryDescriptor::decode;
        for cut in [0, 3, 4, 10, HEADER_LEN - 1, HEADER_LEN, good.len() - 1] {
            assert!(
                matches!(decode(&good[..cut]), Err(E::Truncated { got, .. }) if got == cut),
                "cut at {cut}: {:?}",
                decode(&good[..cut])
            );
        }
        let mut long = good.clone();
        long.push(0);
        assert_eq!(decode(&long), Err(E::TrailingBytes(1)));
        let patched = |at: usize, value: &[u8]| {
            let mut bad = good.clone();
            bad[at..at + value.len()].copy_from_slice(value);
            decode(&bad)
        };
        assert_eq!(patched(0, b"X"), Err(E::BadMagic));
        assert_eq!(decode(b"GDX"), Err(E::BadMagic));
        assert_eq!(patched(4, &[1]), Err(E::UnsupportedVersion(1)));
        assert_eq!(patched(4, &[3]), Err(E::UnsupportedVersion(3)));
        assert!(matches!(patched(5, &[2]), Err(E::BadLocation(_))));
        // Host with an ordinal.
        assert!(matches!(patched(5, &[0, 1, 0]), Err(E::BadLocation(_))));
        assert_eq!(patched(6, &[0, 4]), Err(E::BadGpuOrdinal(1024)));
        assert!(matches!(patched(8, &[0]), Err(E::BadRights(_))));
        assert!(matches!(patched(8, &[4]), Err(E::BadRights(_))));
        assert!(matches!(patched(9, &[2]), Err(E::BadReach(_))));
        // Staged with segments.
        assert!(matches!(patched(9, &[0]), Err(E::BadReach(_))));
        assert_eq!(patched(10, &[65]), Err(E::TooManySegments(65)));
        // Direct with none: the segments become trailing bytes.
        assert!(matches!(patched(10, &[0]), Err(E::TrailingBytes(_))));
        assert_eq!(patched(11, &0u64.to_le_bytes()), Err(E::Zero("owner")));
        assert_eq!(patched(19, &0u64.to_le_bytes()), Err(E::Zero("grant")));
        assert_eq!(patched(27, &0u64.to_le_bytes()), Err(E::Zero("len")));
        // First segment: offset, len, addr, rkey, name length, name.
        let s0 = HEADER_LEN;
        assert_eq!(
            patched(s0 + 8, &0u64.to_le_bytes()),
            Err(E::EmptySegment { index: 0 })
        );
        assert!(matches!(
            patched(s0 + 16, &u64::MAX.to_le_bytes()),
            Err(E::SegmentWraps { index: 0, .. })
        ));
        assert!(patched(s0 + 28, &[5]).is_err());
        assert_eq!(
            patched(s0 + 29, b"."),
            Err(E::BadDeviceName(".lx5_0".into()))
        );
        assert!(matches!(
            patched(s0 + 29, &[0xff]),
            Err(E::BadDeviceName(_))
        ));
        assert_eq!(patched(s0 + 28, &[0]), Err(E::BadDeviceName(String::new())));
        // A staged descriptor has no segment to lose; one of 65 never parses.
        let staged = MemoryDescriptor {
            reach: Reach::Staged,
            ..sample()
        }
        .encode()
        .unwrap();
        assert_eq!(
            decode(&staged[..HEADER_LEN - 1]).unwrap_err(),
            E::Truncated {
                got: HEADER_LEN - 1,
                need: HEADER_LEN
            }
        );
    }

    #[test]
    fn text_parser_rejects_each_malformation() {
        let good = parse(GOOD).unwrap();
        assert_eq!(good, sample());
        // Each replacement of a piece of GOOD must be refused.
        let bad = |from: &str, to: &str| {
            assert!(GOOD.contains(from), "{from}");
            let text = GOOD.replacen(from, to, 1);
            parse(&text).expect_err(&text)
        };
        assert_eq!(parse("http://x"), Err(E::BadMagic));
        assert_eq!(bad("v2", "v1"), E::UnsupportedVersion(1));
        assert!(matches!(
            bad("v2", "v02"),
            E::BadField {
                field: "version",
                ..
            }
        ));
        assert!(matches!(
            bad("v2", "V2"),
            E::BadField {
                field: "version",
                ..
            }
        ));
        assert_eq!(parse("gdr-mdv2"), Err(E::BadMagic));
        // Hex: uppercase, leading zeros, prefixes, signs, spaces, too wide.
        assert!(matches!(
            bad(":1f:", ":1F:"),
            E::BadField { field: "owner", .. }
        ));
        assert!(matches!(
            bad(":1f:", ":01f:"),
            E::BadField { field: "owner", .. }
        ));
        assert!(matches!(
            bad(":1f:", ":0x1f:"),
            E::BadField { field: "owner", .. }
        ));
        assert!(matches!(
            bad(":1f:", ":+1f:"),
            E::BadField { field: "owner", .. }
        ));
        assert!(matches!(
            bad(":1f:", ": 1f:"),
            E::BadField { field: "owner", .. }
        ));
        assert!(matches!(
            bad(":1f:", "::"),
            E::BadField { field: "owner", .. }
        ));
        assert!(matches!(
            bad(":7:", ":00:"),
            E::BadField { field: "grant", .. }
        ));
        assert!(matches!(
            bad(":100000:", ":10000000000000000:"),
            E::BadField { field: "len", .. }
        ));
        assert!(matches!(
            bad("/1a2b", "/100000000"),
            E::BadField {
                field: "segment rkey",
                ..
            }
        ));
        assert!(matches!(
            bad("/1a2b", "/1A2B"),
            E::BadField {
                field: "segment rkey",
                ..
            }
        ));
        assert!(matches!(
            bad("=7f0000001000", "=07f0000001000"),
            E::BadField {
                field: "segment addr",
                ..
            }
        ));
        assert!(matches!(
            bad("@0+", "@00+"),
            E::BadField {
                field: "segment offset",
                ..
            }
        ));
        assert!(matches!(
            bad("+80000=", "+-80000="),
            E::BadField {
                field: "segment len",
                ..
            }
        ));
        // Zero ids and length.
        assert_eq!(bad(":1f:", ":0:"), E::Zero("owner"));
        assert_eq!(bad(":7:", ":0:"), E::Zero("grant"));
        assert_eq!(bad(":100000:", ":0:"), E::Zero("len"));
        // Location and rights.
        assert!(matches!(bad("gpu3", "gpu003"), E::BadLocation(_)));
        assert!(matches!(bad("gpu3", "gpu"), E::BadLocation(_)));
        assert!(matches!(bad("gpu3", "gpu+3"), E::BadLocation(_)));
        assert!(matches!(bad("gpu3", "GPU3"), E::BadLocation(_)));
        assert!(matches!(bad("gpu3", "cpu"), E::BadLocation(_)));
        assert!(matches!(bad("gpu3", "gpu70000"), E::BadLocation(_)));
        assert_eq!(bad("gpu3", "gpu1024"), E::BadGpuOrdinal(1024));
        assert!(parse(&GOOD.replacen("gpu3", "gpu1023", 1)).is_ok());
        assert!(parse(&GOOD.replacen("gpu3", "gpu0", 1)).is_ok());
        assert!(matches!(bad(":rw:", ":wr:"), E::BadRights(_)));
        assert!(matches!(bad(":rw:", ":RW:"), E::BadRights(_)));
        assert!(matches!(bad(":rw:", "::"), E::BadRights(_)));
        // Structure: field count, separators, empty segments.
        assert!(matches!(
            bad(":rw:", ":"),
            E::BadField {
                field: "field count",
                ..
            }
        ));
        assert!(matches!(
            bad("1a2b,", "1a2b,,"),
            E::BadField {
                field: "segment",
                ..
            }
        ));
        assert!(matches!(
            bad("/99", "/99,"),
            E::BadField {
                field: "segment",
                ..
            }
        ));
        assert!(matches!(bad("@0+100000", "@0-100000"), E::BadField { .. }));
        assert!(matches!(bad("/99", "/99:"), E::BadField { .. }));
        assert!(matches!(bad("/99", "/99 "), E::BadField { .. }));
        assert!(matches!(bad("/99", "/99\n"), E::BadField { .. }));
        assert!(matches!(bad("/99", "/99/1"), E::BadField { .. }));
        // Device names.
        for name in [".", "..", "a.b", "a/b", "-x", "", "x y", "ml\u{e9}"] {
            assert_eq!(
                bad("mlx5_1@", &format!("{name}@")),
                E::BadDeviceName(name.into()),
                "{name:?}"
            );
        }
        // Tiling and order.
        assert!(matches!(bad("@0+100000", "@0+fffff"), E::SegmentGap { .. }));
        assert!(matches!(
            bad("80000+80000", "7ffff+80001"),
            E::SegmentOverlap { .. }
        ));
        assert!(matches!(bad("mlx5_1", "mlx5_"), E::Unsorted { index: 2 }));
        // Staged spelled any other way.
        let staged = "gdr-md:v2:1:1:host:r:1:staged";
        assert!(parse(staged).is_ok());
        for other in ["Staged", "staged,", "staged ", "STAGED", ""] {
            assert!(
                parse(&staged.replace("staged", other)).is_err(),
                "{other:?}"
            );
        }
        // Too many segments, and too long.
        let many: Vec<String> = (0..65).map(|i| format!("d{i:02}@0+1=0/0")).collect();
        let text = format!("gdr-md:v2:1:1:host:r:1:{}", many.join(","));
        assert_eq!(parse(&text), Err(E::TooManySegments(65)));
        let text = format!("{GOOD}{}", "0".repeat(MAX_TEXT_LEN));
        assert!(matches!(parse(&text), Err(E::TooLong { .. })));
    }

    /// Writes the fuzzer's seeds (`fuzz/seeds/descriptor`): run with
    /// `GDR_WRITE_SEEDS=<dir> cargo test -p gdr-core write_fuzz_seeds --
    /// --ignored`.
    #[test]
    #[ignore = "writes files; run by hand to regenerate the fuzz seeds"]
    fn write_fuzz_seeds() {
        let dir = std::path::PathBuf::from(
            std::env::var_os("GDR_WRITE_SEEDS").expect("GDR_WRITE_SEEDS=<directory>"),
        );
        let host_one = MemoryDescriptor {
            owner: 1,
            grant: 1,
            location: MemoryLocation::Host,
            rights: GrantRights::Read,
            len: 0x1000,
            reach: Reach::Direct(vec![seg("mlx5_0", 0, 0x1000, 0x7f12_3456_7000, 0x42)]),
        };
        let staged = MemoryDescriptor {
            owner: 0xabc,
            grant: 2,
            location: MemoryLocation::Gpu { ordinal: 1 },
            rights: GrantRights::Write,
            len: 0x20_0000,
            reach: Reach::Staged,
        };
        let seeds = [("host", host_one), ("gpu", sample()), ("staged", staged)];
        for (name, d) in seeds {
            std::fs::write(dir.join(format!("bin-{name}")), d.encode().unwrap()).unwrap();
            std::fs::write(dir.join(format!("text-{name}")), d.to_string()).unwrap();
        }
    }

    /// A small deterministic generator (splitmix64).
    struct Gen(u64);

    impl Gen {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }

        /// A number of any magnitude (small ones and edges often).
        fn number(&mut self) -> u64 {
            match self.below(4) {
                0 => self.below(16),
                1 => u64::MAX - self.below(4),
                _ => self.next() >> self.below(64),
            }
        }

        fn descriptor(&mut self) -> MemoryDescriptor {
            let len = self.number().max(1);
            let location = if self.below(2) == 0 {
                MemoryLocation::Host
            } else {
                MemoryLocation::Gpu {
                    ordinal: self.below(u64::from(MAX_GPU_ORDINAL) + 1) as u16,
                }
            };
            let rights = [
                GrantRights::Read,
                GrantRights::Write,
                GrantRights::ReadWrite,
            ][self.below(3) as usize];
            let reach = if self.below(5) == 0 {
                Reach::Staged
            } else {
                let mut segments = Vec::new();
                let devices = 1 + self.below(3);
                for d in 0..devices {
                    // Distinct first characters: distinct devices.
                    let mut name = String::from(["a", "Z", "7"][d as usize]);
                    let alphabet = b"abcxyzAZ0189_-";
                    for _ in 0..self.below(MAX_DEVICE_NAME as u64) {
                        name.push(alphabet[self.below(alphabet.len() as u64) as usize] as char);
                    }
                    // Cut [0, len) into up to 4 pieces.
                    let mut cuts: Vec<u64> = (0..self.below(4))
                        .map(|_| self.below(len))
                        .filter(|&c| c != 0)
                        .collect();
                    cuts.push(0);
                    cuts.push(len);
                    cuts.sort_unstable();
                    cuts.dedup();
                    for w in cuts.windows(2) {
                        let seg_len = w[1] - w[0];
                        segments.push(Segment {
                            offset: w[0],
                            len: seg_len,
                            addr: self.number().min(u64::MAX - seg_len),
                            rkey: self.next() as u32,
                            device: name.clone(),
                        });
                    }
                }
                segments.sort_by(|a, b| (&a.device, a.offset).cmp(&(&b.device, b.offset)));
                Reach::Direct(segments)
            };
            MemoryDescriptor {
                owner: self.number().max(1),
                grant: self.number().max(1),
                location,
                rights,
                len,
                reach,
            }
        }
    }

    #[test]
    fn generated_descriptors_round_trip_and_mutations_never_panic() {
        let mut g = Gen(0x5eed);
        let mut accepted_mutants = 0;
        for _ in 0..2000 {
            let d = g.descriptor();
            d.validate().unwrap_or_else(|e| panic!("{d:?}: {e}"));
            let bytes = d.encode().unwrap();
            assert!(bytes.len() <= MAX_ENCODED_LEN);
            assert_eq!(MemoryDescriptor::decode(&bytes).unwrap(), d);
            let text = d.to_string();
            assert!(text.len() <= MAX_TEXT_LEN);
            let parsed = parse(&text).unwrap();
            assert_eq!(parsed, d);
            assert_eq!(parsed.to_string(), text);
            for device in d.devices() {
                let s = d.segment(device, 0, 1).unwrap();
                assert_eq!((s.offset, s.device.as_str()), (0, device));
                let last = d.segment(device, d.len - 1, 1).unwrap();
                assert_eq!(last.offset + last.len, d.len);
            }
            // Flip a byte of each form: whatever still parses is canonical.
            let mut bytes = bytes;
            let i = g.below(bytes.len() as u64) as usize;
            bytes[i] ^= 1 << g.below(8);
            if let Ok(m) = MemoryDescriptor::decode(&bytes) {
                accepted_mutants += 1;
                assert_eq!(m.encode().unwrap(), bytes);
            }
            let mut text = text.into_bytes();
            let i = g.below(text.len() as u64) as usize;
            text[i] = b"0aAf:,@+=/x.-_ "[g.below(15) as usize];
            if let Ok(s) = std::str::from_utf8(&text)
                && let Ok(m) = parse(s)
            {
                assert_eq!(m.to_string(), s);
            }
        }
        // Flipping a bit of an address or key keeps it valid: the property
        // was exercised.
        assert!(accepted_mutants > 100, "{accepted_mutants}");
    }
}
