//! `gdr://` buffer URIs: a GPU buffer shared between processes by its CUDA
//! IPC handle, in the two forms 3FS's usrbio uses.
//!
//! - `gdr://v1/device/{device}/size/{bytes}/ipc/{handle}`: `size` bytes at
//!   the start of the allocation the handle names.
//! - `gdr://v2/device/{device}/allocation/{bytes}/offset/{bytes}/size/{bytes}/ipc/{handle}`:
//!   `size` bytes at `offset` of an allocation of `allocation` bytes (an IPC
//!   handle always opens a whole allocation, so a sub-range needs saying).
//!
//! The grammar is exact, so that a URI has one spelling and printing a
//! parsed URI gives back its text: the segments in this order and no
//! others; numbers are unsigned decimal without sign, leading zeros (but
//! `0` itself) or escapes, within range (`device` a `u32`, byte counts
//! `u64`); the handle is exactly 128 lowercase hex digits (the 64 bytes of
//! a `CUipcMemHandle`); no whitespace, trailing slash, query or fragment;
//! `size` > 0; in v2 `offset` < `allocation` and `offset + size` ≤
//! `allocation` without overflow. Anything else is a [`UriError`] naming
//! the segment and what is wrong.
//!
//! # Trust
//!
//! A URI is a capability. Whoever holds it can open the **whole**
//! allocation its handle names (not only the range the URI states) and read
//! and write it, for as long as the exporting process keeps the allocation.
//! The range in the URI is what the exporter means to share, and gdr
//! confines its own buffer to it, but a process that holds the handle is
//! trusted with the entire allocation. Send URIs only to processes trusted
//! that far, over a channel others cannot read.

use std::fmt;
use std::str::FromStr;

use hal_cuda::IpcMemHandle;

/// The scheme and authority every URI starts with.
const PREFIX: &str = "gdr://";

/// Digits of the handle: two per byte of a `CUipcMemHandle`.
const HANDLE_DIGITS: usize = 128;

/// Longer than any valid URI (v2 with every number at its widest is 251
/// bytes): longer input is refused before it is looked at.
pub const MAX_URI_LEN: usize = 256;

/// A parsed `gdr://` buffer URI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufferUri {
    /// `gdr://v1/...`: `size` bytes at the start of the allocation.
    V1 {
        /// The exporting process's CUDA device ordinal.
        device: u32,
        /// Bytes shared, from the allocation's start; nonzero.
        size: u64,
        /// The allocation's IPC handle.
        handle: IpcMemHandle,
    },
    /// `gdr://v2/...`: `size` bytes at `offset` of the allocation.
    V2 {
        /// The exporting process's CUDA device ordinal.
        device: u32,
        /// The whole allocation's size in bytes.
        allocation: u64,
        /// Where the shared range starts in the allocation.
        offset: u64,
        /// Bytes shared; nonzero, within the allocation.
        size: u64,
        /// The allocation's IPC handle.
        handle: IpcMemHandle,
    },
}

/// Why a `gdr://` URI was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UriError {
    /// Longer than [`MAX_URI_LEN`].
    #[error("gdr URI of {len} bytes is longer than {max}")]
    TooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Not `gdr://` at the start.
    #[error("not a gdr URI: it must start with \"gdr://\"")]
    Scheme,
    /// A version other than `v1` and `v2`.
    #[error("gdr URI version {0:?} is not supported (v1 and v2 are)")]
    Version(String),
    /// A segment name other than the one the grammar has at that place, or
    /// the URI ends early.
    #[error("gdr URI segment {position}: expected {expected:?}, found {found:?}")]
    Segment {
        /// Its 1-based position after the version.
        position: usize,
        /// What the grammar wants there.
        expected: &'static str,
        /// What is there (empty where the URI ended).
        found: String,
    },
    /// Segments after the handle (a trailing slash included).
    #[error("gdr URI has {0:?} after the handle")]
    Trailing(String),
    /// A number that is not canonical unsigned decimal or out of range.
    #[error("gdr URI {segment} {value:?}: {why}")]
    Number {
        /// The segment it belongs to.
        segment: &'static str,
        /// The text given.
        value: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The handle is not 128 lowercase hex digits.
    #[error("gdr URI ipc handle: {why} ({len} characters given)")]
    Handle {
        /// What is wrong with it.
        why: &'static str,
        /// Its length.
        len: usize,
    },
    /// The numbers do not describe a range of the allocation.
    #[error("gdr URI range: {0}")]
    Range(String),
}

impl BufferUri {
    /// The device ordinal in the exporting process.
    pub fn device(&self) -> u32 {
        match *self {
            Self::V1 { device, .. } | Self::V2 { device, .. } => device,
        }
    }

    /// The IPC handle (a capability for the whole allocation).
    pub fn handle(&self) -> &IpcMemHandle {
        match self {
            Self::V1 { handle, .. } | Self::V2 { handle, .. } => handle,
        }
    }

    /// Where the shared range starts in the allocation.
    pub fn offset(&self) -> u64 {
        match *self {
            Self::V1 { .. } => 0,
            Self::V2 { offset, .. } => offset,
        }
    }

    /// Bytes shared.
    pub fn size(&self) -> u64 {
        match *self {
            Self::V1 { size, .. } | Self::V2 { size, .. } => size,
        }
    }

    /// The allocation's size where the URI says it (v2).
    pub fn allocation(&self) -> Option<u64> {
        match *self {
            Self::V1 { .. } => None,
            Self::V2 { allocation, .. } => Some(allocation),
        }
    }

    /// Checks what the grammar cannot: a nonzero size, and in v2 a range
    /// inside the allocation. Every parsed URI passes; a constructed one
    /// must before it is printed.
    pub fn validate(&self) -> Result<(), UriError> {
        match *self {
            Self::V1 { size, .. } => nonzero(size),
            Self::V2 {
                allocation,
                offset,
                size,
                ..
            } => {
                nonzero(size)?;
                if offset >= allocation {
                    return Err(UriError::Range(format!(
                        "offset {offset} is not inside the allocation of {allocation} bytes"
                    )));
                }
                match offset.checked_add(size) {
                    Some(end) if end <= allocation => Ok(()),
                    _ => Err(UriError::Range(format!(
                        "{size} bytes at offset {offset} run past the allocation of \
                         {allocation} bytes"
                    ))),
                }
            }
        }
    }
}

fn nonzero(size: u64) -> Result<(), UriError> {
    if size == 0 {
        return Err(UriError::Range("size is 0".into()));
    }
    Ok(())
}

/// Canonical unsigned decimal: digits only, no leading zero but in `0`.
fn number<T: FromStr>(segment: &'static str, value: &str) -> Result<T, UriError> {
    let bad = |why| UriError::Number {
        segment,
        value: value.to_owned(),
        why,
    };
    let b = value.as_bytes();
    if b.is_empty() {
        return Err(bad("empty"));
    }
    if !b.iter().all(u8::is_ascii_digit) {
        return Err(bad("not unsigned decimal digits"));
    }
    if b[0] == b'0' && b.len() > 1 {
        return Err(bad("leading zero"));
    }
    value.parse().map_err(|_| bad("out of range"))
}

fn handle(value: &str) -> Result<IpcMemHandle, UriError> {
    let bad = |why| UriError::Handle {
        why,
        len: value.len(),
    };
    if value.len() != HANDLE_DIGITS {
        return Err(bad("not 128 hex digits"));
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut bytes = [0u8; 64];
    for (byte, pair) in bytes.iter_mut().zip(value.as_bytes().chunks_exact(2)) {
        let (Some(high), Some(low)) = (digit(pair[0]), digit(pair[1])) else {
            return Err(bad("not lowercase hex digits"));
        };
        *byte = high << 4 | low;
    }
    Ok(IpcMemHandle(bytes))
}

/// The segments after the version, as `name/value` pairs in order.
struct Segments<'a> {
    parts: std::str::Split<'a, char>,
    position: usize,
}

impl<'a> Segments<'a> {
    /// The value of the segment named `name`, which must come next.
    fn value(&mut self, name: &'static str) -> Result<&'a str, UriError> {
        self.position += 1;
        let found = self.parts.next().unwrap_or("");
        if found != name {
            return Err(UriError::Segment {
                position: self.position,
                expected: name,
                found: found.to_owned(),
            });
        }
        self.parts.next().ok_or(UriError::Segment {
            position: self.position,
            expected: "a value",
            found: String::new(),
        })
    }

    /// Nothing may follow.
    fn end(mut self) -> Result<(), UriError> {
        let rest: Vec<&str> = self.parts.by_ref().collect();
        if rest.is_empty() {
            return Ok(());
        }
        Err(UriError::Trailing(format!("/{}", rest.join("/"))))
    }
}

impl FromStr for BufferUri {
    type Err = UriError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.len() > MAX_URI_LEN {
            return Err(UriError::TooLong {
                len: text.len(),
                max: MAX_URI_LEN,
            });
        }
        let rest = text.strip_prefix(PREFIX).ok_or(UriError::Scheme)?;
        let mut parts = rest.split('/');
        let version = parts.next().unwrap_or("");
        let mut segments = Segments { parts, position: 0 };
        let uri = match version {
            "v1" => {
                let device = number("device", segments.value("device")?)?;
                let size = number("size", segments.value("size")?)?;
                let handle = handle(segments.value("ipc")?)?;
                Self::V1 {
                    device,
                    size,
                    handle,
                }
            }
            "v2" => {
                let device = number("device", segments.value("device")?)?;
                let allocation = number("allocation", segments.value("allocation")?)?;
                let offset = number("offset", segments.value("offset")?)?;
                let size = number("size", segments.value("size")?)?;
                let handle = handle(segments.value("ipc")?)?;
                Self::V2 {
                    device,
                    allocation,
                    offset,
                    size,
                    handle,
                }
            }
            other => return Err(UriError::Version(other.to_owned())),
        };
        segments.end()?;
        uri.validate()?;
        Ok(uri)
    }
}

impl fmt::Display for BufferUri {
    /// The URI's one spelling. A URI that fails [`BufferUri::validate`]
    /// prints too, but does not parse back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::V1 { device, size, .. } => {
                write!(f, "{PREFIX}v1/device/{device}/size/{size}/ipc/")?
            }
            Self::V2 {
                device,
                allocation,
                offset,
                size,
                ..
            } => write!(
                f,
                "{PREFIX}v2/device/{device}/allocation/{allocation}/offset/{offset}/size/{size}/ipc/"
            )?,
        }
        self.handle()
            .0
            .iter()
            .try_for_each(|b| write!(f, "{b:02x}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(byte: u8) -> String {
        format!("{byte:02x}").repeat(64)
    }

    fn v2(allocation: &str, offset: &str, size: &str) -> String {
        format!(
            "gdr://v2/device/3/allocation/{allocation}/offset/{offset}/size/{size}/ipc/{}",
            hex(0xab)
        )
    }

    #[test]
    fn both_forms_parse_to_their_fields_and_print_back() {
        let v1 = format!("gdr://v1/device/0/size/4096/ipc/{}", hex(0x5c));
        let uri: BufferUri = v1.parse().unwrap();
        assert_eq!(
            uri,
            BufferUri::V1 {
                device: 0,
                size: 4096,
                handle: IpcMemHandle([0x5c; 64])
            }
        );
        assert_eq!(
            (uri.offset(), uri.size(), uri.allocation()),
            (0, 4096, None)
        );
        assert_eq!(uri.to_string(), v1);

        let text = v2("1048576", "65536", "4096");
        let uri: BufferUri = text.parse().unwrap();
        assert_eq!(
            uri,
            BufferUri::V2 {
                device: 3,
                allocation: 1 << 20,
                offset: 65536,
                size: 4096,
                handle: IpcMemHandle([0xab; 64])
            }
        );
        assert_eq!(uri.to_string(), text);
        // The handle's bytes in order: the first byte prints first.
        let mut bytes = [0u8; 64];
        bytes[0] = 0x01;
        bytes[63] = 0xfe;
        let uri = BufferUri::V1 {
            device: 1,
            size: 1,
            handle: IpcMemHandle(bytes),
        };
        let text = uri.to_string();
        assert!(
            text.ends_with(&format!("/ipc/01{}fe", "00".repeat(62))),
            "{text}"
        );
        assert_eq!(text.parse::<BufferUri>().unwrap(), uri);
    }

    #[test]
    fn extreme_numbers_are_accepted_at_their_limits() {
        let max = u64::MAX.to_string();
        let text = v2(&max, &(u64::MAX - 1).to_string(), "1");
        assert!(text.len() <= MAX_URI_LEN, "{}", text.len());
        let uri: BufferUri = text.parse().unwrap();
        assert_eq!(uri.to_string(), text);
        let device = format!("gdr://v1/device/{}/size/{max}/ipc/{}", u32::MAX, hex(0));
        assert_eq!(device.parse::<BufferUri>().unwrap().device(), u32::MAX);
        // The whole allocation, offset 0.
        assert!(v2("10", "0", "10").parse::<BufferUri>().is_ok());
    }

    /// Each malformed input fails naming what is wrong.
    #[test]
    fn malformed_uris_are_refused_naming_the_fault() {
        let h = hex(0x11);
        let cases: Vec<(String, &str)> = vec![
            (format!("gdr:/v1/device/0/size/1/ipc/{h}"), "must start"),
            (format!("GDR://v1/device/0/size/1/ipc/{h}"), "must start"),
            (
                format!("gdr://v3/device/0/size/1/ipc/{h}"),
                "version \"v3\"",
            ),
            (
                format!("gdr://V1/device/0/size/1/ipc/{h}"),
                "version \"V1\"",
            ),
            (
                format!("gdr://v1/size/1/device/0/ipc/{h}"),
                "expected \"device\"",
            ),
            (format!("gdr://v1/device/0/ipc/{h}"), "expected \"size\""),
            (
                format!("gdr://v1/device/0/size/1/ipc/{h}/"),
                "after the handle",
            ),
            (
                format!("gdr://v1/device/0/size/1/ipc/{h}/x/1"),
                "after the handle",
            ),
            (
                format!("gdr://v1/device/0/size/1/ipc/{h}?a=1"),
                "ipc handle",
            ),
            (format!("gdr://v1/device/0/size/1/ipc/{h}#f"), "ipc handle"),
            (format!(" gdr://v1/device/0/size/1/ipc/{h}"), "must start"),
            (format!("gdr://v1/device/0/size/1 /ipc/{h}"), "size \"1 \""),
            (format!("gdr://v1/device/00/size/1/ipc/{h}"), "leading zero"),
            (
                format!("gdr://v1/device/+1/size/1/ipc/{h}"),
                "not unsigned decimal",
            ),
            (
                format!("gdr://v1/device/-1/size/1/ipc/{h}"),
                "not unsigned decimal",
            ),
            (
                format!("gdr://v1/device/%31/size/1/ipc/{h}"),
                "not unsigned decimal",
            ),
            (
                format!("gdr://v1/device//size/1/ipc/{h}"),
                "device \"\": empty",
            ),
            (
                format!("gdr://v1/device/4294967296/size/1/ipc/{h}"),
                "out of range",
            ),
            (
                format!("gdr://v1/device/0/size/18446744073709551616/ipc/{h}"),
                "out of range",
            ),
            (format!("gdr://v1/device/0/size/0/ipc/{h}"), "size is 0"),
            (
                format!("gdr://v1/device/0/size/1/ipc/{}", &h[1..]),
                "not 128",
            ),
            (format!("gdr://v1/device/0/size/1/ipc/{h}0"), "not 128"),
            (
                format!("gdr://v1/device/0/size/1/ipc/{}", hex(0xab).to_uppercase()),
                "lowercase hex",
            ),
            (
                format!("gdr://v1/device/0/size/1/ipc/{}g", &h[1..]),
                "lowercase hex",
            ),
            (
                "gdr://v1/device/0/size/1/ipc".to_string(),
                "expected \"a value\"",
            ),
            (v2("10", "10", "1"), "not inside the allocation"),
            (v2("10", "5", "6"), "run past"),
            (
                v2(&u64::MAX.to_string(), "2", &(u64::MAX - 1).to_string()),
                "run past",
            ),
            (v2("10", "0", "0"), "size is 0"),
            (v2("0", "0", "1"), "not inside"),
            ("x".repeat(MAX_URI_LEN + 1), "longer than"),
        ];
        for (text, why) in cases {
            let err = text.parse::<BufferUri>().unwrap_err().to_string();
            assert!(err.contains(why), "{text:?}: {err:?} does not say {why:?}");
        }
    }
}

/// Printing then parsing is the identity, and the grammar has one spelling.
#[cfg(all(test, not(loom)))]
mod properties {
    use proptest::prelude::*;

    use super::*;

    fn uris() -> impl Strategy<Value = BufferUri> {
        let handle = proptest::array::uniform32(any::<u8>()).prop_flat_map(|a| {
            proptest::array::uniform32(any::<u8>()).prop_map(move |b| {
                let mut bytes = [0u8; 64];
                bytes[..32].copy_from_slice(&a);
                bytes[32..].copy_from_slice(&b);
                IpcMemHandle(bytes)
            })
        });
        let v1 = (any::<u32>(), 1..=u64::MAX, handle.clone()).prop_map(|(device, size, handle)| {
            BufferUri::V1 {
                device,
                size,
                handle,
            }
        });
        let v2 = (
            any::<u32>(),
            1..=u64::MAX,
            any::<u64>(),
            any::<u64>(),
            handle,
        )
            .prop_map(|(device, allocation, offset, size, handle)| {
                let offset = offset % allocation;
                let size = 1 + size % (allocation - offset);
                BufferUri::V2 {
                    device,
                    allocation,
                    offset,
                    size,
                    handle,
                }
            });
        prop_oneof![v1, v2]
    }

    proptest! {
        #[test]
        fn printing_then_parsing_is_the_identity(uri in uris()) {
            prop_assert!(uri.validate().is_ok());
            let text = uri.to_string();
            prop_assert!(text.len() <= MAX_URI_LEN);
            prop_assert_eq!(text.parse::<BufferUri>().unwrap(), uri);
        }

        #[test]
        fn any_accepted_text_prints_back_to_itself(text in "gdr://v[12]/[a-z0-9/]{0,80}") {
            if let Ok(uri) = text.parse::<BufferUri>() {
                prop_assert_eq!(uri.to_string(), text);
            }
        }
    }
}
