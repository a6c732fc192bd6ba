//! The engine's wire formats: the connection handshake and control-message framing.
//!
//! Three formats, all little endian, all strict: a decoder accepts exactly
//! one encoding of each value (what it accepts re-encodes to the same bytes),
//! refuses every other input with a typed [`WireError`], and never panics.
//!
//! # Handshake: [`Hello`] (connect and accept private data)
//!
//! The connecting side sends a [`Hello`] with [`Role::Connect`] in the
//! private data of every queue pair's connect; the acceptor answers with its
//! own [`Hello`] ([`Role::Accept`], the same `session`, `qp_index` and
//! `qp_count`) in the accept. Fixed length, [`Hello::ENCODED_LEN`] = 40
//! bytes, within rdma_cm's private data of a connect (55 bytes) and an
//! accept (195) (`gdr-core` asserts it against `hal_verbs`'s limits):
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | magic `b"GDRH"` |
//! | 4 | 1 | version, [`WIRE_VERSION`] |
//! | 5 | 1 | role: 1 connect, 2 accept |
//! | 6 | 2 | reserved, zero |
//! | 8 | 8 | `engine`, nonzero |
//! | 16 | 8 | `session`, nonzero |
//! | 24 | 2 | `qp_index`, `< qp_count` |
//! | 26 | 2 | `qp_count`, `1..=`[`MAX_QPS_PER_PEER`] |
//! | 28 | 4 | `max_message`, [`MIN_MESSAGE`]`..=`[`MAX_MESSAGE`] |
//! | 32 | 2 | `recv_depth`, nonzero |
//! | 34 | 2 | reserved, zero |
//! | 36 | 4 | `max_slice`, nonzero |
//!
//! The magic and version come first and are checked before the length, so a
//! peer of another version (whose hello may be longer or shorter) is told
//! apart from garbage: [`WireError::Version`] says which version it sent,
//! and [`RejectReason::for_hello_error`] turns that into the reject to send.
//! Any change to a layout here bumps [`WIRE_VERSION`].
//!
//! # Reject: [`RejectReason`] (reject private data)
//!
//! Fixed length, [`RejectReason::ENCODED_LEN`] = 8 bytes, within
//! rdma_cm's private data of a reject (147 bytes). Its layout carries no version and
//! is frozen across versions, so that a peer of any version can read why it
//! was turned away (in particular, which version the acceptor speaks):
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | magic `b"GDRJ"` |
//! | 4 | 1 | code: 1 version mismatch, 2 malformed, 3 session unknown, 4 too many queue pairs, 5 busy |
//! | 5 | 1 | version mismatch: the rejecting side's version; otherwise zero |
//! | 6 | 1 | version mismatch: the version it received; otherwise zero |
//! | 7 | 1 | reserved, zero |
//!
//! # Control messages: [`Control`] (SEND/RECV on queue pair 0)
//!
//! One message per receive buffer; the decoder is given exactly the bytes
//! the receive completion reports. An 8-byte header ([`HEADER_LEN`]), then
//! the body:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 1 | magic `0xC7` |
//! | 1 | 1 | version, [`WIRE_VERSION`] |
//! | 2 | 1 | kind (below) |
//! | 3 | 1 | flags, zero |
//! | 4 | 4 | body length: exactly the bytes after the header |
//!
//! | kind | message | body |
//! | --- | --- | --- |
//! | 1 | [`Control::User`] | the caller's bytes, any length (empty too) |
//! | 2 | [`Control::GrantAnnounce`] | the encoded descriptor, nonempty |
//! | 3 | [`Control::GrantRevoke`] | `grant` u64, nonzero (8 bytes) |
//! | 4 | [`Control::Goodbye`] | empty |
//! | 5 | [`Control::StagedRequest`] | `id` u64, `grant` u64 nonzero, `offset` u64, `len` u64 nonzero with `offset + len` in u64, `write` u8 (0 or 1), `slots` u8 (0 or 1), 6 reserved zero bytes (40 bytes) |
//! | 6 | [`Control::StagedReply`] | `id` u64, `status` u32, 4 reserved zero bytes (16 bytes) |
//! | 7 | [`Control::Paths`] | the sender's NIC of each of its queue pairs to this peer, in queue-pair order: names joined by `,`, each 1..=63 bytes of `[A-Za-z0-9_-]`, at most [`MAX_QPS_PER_PEER`] |
//! | 8 | [`Control::Locality`] | `host` 16 bytes (the boot id), `process` u64 (24 bytes) |
//! | 9 | [`Control::GrantIpc`] | `grant` u64 nonzero, `offset` u64, `handle` 64 bytes (80 bytes) |
//! | 10 | [`Control::Slots`] | `slot_len` u64 nonzero, `count` u32 nonzero, 4 reserved zero bytes, then the encoded descriptor, nonempty (at least 17 bytes) |
//! | 11 | [`Control::SlotReady`] | `id` u64, `offset` u64, `len` u64 nonzero with `offset + len` in u64, `slot` u32, 4 reserved zero bytes (32 bytes) |
//! | 12 | [`Control::SlotFilled`] | `id` u64, `slot` u32, 4 reserved zero bytes (16 bytes) |
//! | 13 | [`Control::SlotDone`] | `id` u64, `slot` u32, 4 reserved zero bytes (16 bytes) |
//! | 14 | [`Control::StagedCancel`] | `id` u64 (8 bytes) |
//! | 15 | [`Control::GrantReleased`] | `grant` u64, nonzero (8 bytes) |
//!
//! A whole message (header included) is at most [`MAX_MESSAGE`] bytes; the
//! fixed-size messages all fit in [`MIN_MESSAGE`], except
//! [`Control::GrantIpc`] (88 bytes), which is sent only to a peer whose
//! `max_message` holds it (without it, that peer's transfers take the NIC).

use std::fmt;

/// The version of every format in this module; a peer speaking another is
/// refused with [`WireError::Version`].
pub const WIRE_VERSION: u8 = 1;
/// Most queue pairs one peer connection may open.
pub const MAX_QPS_PER_PEER: u16 = 64;
/// Smallest receive buffer (largest control message) a side may announce in
/// [`Hello::max_message`]; every fixed-size control message fits in it.
pub const MIN_MESSAGE: u32 = 64;
/// Largest receive buffer a side may announce in [`Hello::max_message`], and
/// the largest control message (header included) this module encodes or
/// decodes.
pub const MAX_MESSAGE: u32 = 1 << 20;
/// Length of a control message's header.
pub const HEADER_LEN: usize = 8;

const HELLO_MAGIC: [u8; 4] = *b"GDRH";
const REJECT_MAGIC: [u8; 4] = *b"GDRJ";
const CONTROL_MAGIC: u8 = 0xC7;

const KIND_USER: u8 = 1;
const KIND_GRANT_ANNOUNCE: u8 = 2;
const KIND_GRANT_REVOKE: u8 = 3;
const KIND_GOODBYE: u8 = 4;
const KIND_STAGED_REQUEST: u8 = 5;
const KIND_STAGED_REPLY: u8 = 6;
const KIND_PATHS: u8 = 7;
const KIND_LOCALITY: u8 = 8;
const KIND_GRANT_IPC: u8 = 9;
const KIND_SLOTS: u8 = 10;
const KIND_SLOT_READY: u8 = 11;
const KIND_SLOT_FILLED: u8 = 12;
const KIND_SLOT_DONE: u8 = 13;
const KIND_STAGED_CANCEL: u8 = 14;
const KIND_GRANT_RELEASED: u8 = 15;

const GRANT_REVOKE_BODY: usize = 8;
const STAGED_REQUEST_BODY: usize = 40;
const STAGED_REPLY_BODY: usize = 16;
const LOCALITY_BODY: usize = 24;
const GRANT_IPC_BODY: usize = 80;
/// The fixed part of a [`Control::Slots`] body, before the descriptor.
const SLOTS_HEAD: usize = 16;
const SLOT_READY_BODY: usize = 32;
const SLOT_CREDIT_BODY: usize = 16;
const STAGED_CANCEL_BODY: usize = 8;
const GRANT_RELEASED_BODY: usize = 8;

const _: () = assert!(HEADER_LEN + STAGED_REQUEST_BODY <= MIN_MESSAGE as usize);
const _: () = assert!(HEADER_LEN + STAGED_REPLY_BODY <= MIN_MESSAGE as usize);
const _: () = assert!(HEADER_LEN + GRANT_REVOKE_BODY <= MIN_MESSAGE as usize);
const _: () = assert!(HEADER_LEN + LOCALITY_BODY <= MIN_MESSAGE as usize);
const _: () = assert!(HEADER_LEN + SLOT_READY_BODY <= MIN_MESSAGE as usize);
const _: () = assert!(HEADER_LEN + SLOT_CREDIT_BODY <= MIN_MESSAGE as usize);
const _: () = assert!(HEADER_LEN + STAGED_CANCEL_BODY <= MIN_MESSAGE as usize);
const _: () = assert!(HEADER_LEN + GRANT_RELEASED_BODY <= MIN_MESSAGE as usize);

/// Why bytes off the wire were refused, or why a message cannot be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the format needs.
    #[error("truncated: {got} bytes where {need} are needed")]
    Truncated {
        /// Bytes given.
        got: usize,
        /// Bytes the format needs.
        need: usize,
    },
    /// More bytes than the format allows, or a length field that disagrees
    /// with the bytes present, or a body of the wrong size for its kind.
    #[error("{what}: {got} bytes where exactly {expected} are required")]
    LengthMismatch {
        /// Which length.
        what: &'static str,
        /// The length the format (or the header) requires.
        expected: usize,
        /// The length found.
        got: usize,
    },
    /// Not one of this module's formats.
    #[error("{what}: bad magic {got:#x}")]
    BadMagic {
        /// Which format was expected.
        what: &'static str,
        /// The magic found, its bytes read big endian.
        got: u32,
    },
    /// The peer speaks another version of the wire formats.
    #[error("wire version {theirs} received, this side speaks version {ours}")]
    Version {
        /// This side's version, [`WIRE_VERSION`].
        ours: u8,
        /// The version received.
        theirs: u8,
    },
    /// A control message of a kind this version does not know.
    #[error("unknown control message kind {0}")]
    UnknownKind(u8),
    /// A hello whose role is neither connect nor accept.
    #[error("unknown handshake role {0}")]
    UnknownRole(u8),
    /// A reject whose reason code this version does not know.
    #[error("unknown reject reason code {0}")]
    UnknownReason(u8),
    /// A reserved field (or the control header's flags) is not zero.
    #[error("{what}: reserved field is {value:#x}, must be zero")]
    Reserved {
        /// Which field.
        what: &'static str,
        /// Its value.
        value: u64,
    },
    /// A field holds a value outside its range.
    #[error("{field} = {value} is out of range")]
    OutOfRange {
        /// Which field, and the range it must be in.
        field: &'static str,
        /// The value found.
        value: u64,
    },
    /// A control message longer than [`MAX_MESSAGE`].
    #[error("control message of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// The message's length, header included.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// [`Control::encode_into`] was given a buffer shorter than the message.
    #[error("output buffer of {got} bytes, the message needs {need}")]
    BufferTooSmall {
        /// The message's encoded length.
        need: usize,
        /// The buffer's length.
        got: usize,
    },
}

/// Reads fixed-size little-endian fields off a byte slice, front to back.
struct Reader<'a> {
    rest: &'a [u8],
    consumed: usize,
}

impl<'a> Reader<'a> {
    /// Reads a four-byte magic: too few bytes are [`WireError::Truncated`]
    /// against `need` (the whole format's length), another magic is
    /// [`WireError::BadMagic`] naming `what`.
    fn magic(
        &mut self,
        expected: [u8; 4],
        what: &'static str,
        need: usize,
    ) -> Result<(), WireError> {
        let got_len = self.rest.len();
        let magic = self
            .array::<4>()
            .map_err(|_| WireError::Truncated { got: got_len, need })?;
        if magic != expected {
            return Err(WireError::BadMagic {
                what,
                got: u32::from_be_bytes(magic),
            });
        }
        Ok(())
    }

    fn new(bytes: &'a [u8]) -> Self {
        Self {
            rest: bytes,
            consumed: 0,
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let Some((head, rest)) = self.rest.split_first_chunk::<N>() else {
            return Err(WireError::Truncated {
                got: self.consumed + self.rest.len(),
                need: self.consumed + N,
            });
        };
        self.rest = rest;
        self.consumed += N;
        Ok(*head)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        self.array().map(u64::from_le_bytes)
    }

    /// Reads `N` bytes that must all be zero.
    fn reserved<const N: usize>(&mut self, what: &'static str) -> Result<(), WireError> {
        let bytes = self.array::<N>()?;
        if bytes.iter().any(|&b| b != 0) {
            let mut wide = [0u8; 8];
            for (dst, src) in wide.iter_mut().zip(bytes) {
                *dst = src;
            }
            return Err(WireError::Reserved {
                what,
                value: u64::from_le_bytes(wide),
            });
        }
        Ok(())
    }
}

/// Which side of a connection sent a [`Hello`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The side that called connect.
    Connect,
    /// The side that accepted.
    Accept,
}

impl Role {
    fn code(self) -> u8 {
        match self {
            Role::Connect => 1,
            Role::Accept => 2,
        }
    }

    fn from_code(code: u8) -> Result<Self, WireError> {
        match code {
            1 => Ok(Role::Connect),
            2 => Ok(Role::Accept),
            other => Err(WireError::UnknownRole(other)),
        }
    }
}

/// Sent by the connecting side in each QP's connect private data, and (with
/// role Accept) back in the accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Which side sent it.
    pub role: Role,
    /// The sender's engine id: nonzero, random per engine.
    pub engine: u64,
    /// Nonzero; chosen by the connecting side, the same on all queue pairs of
    /// one peer connection; the acceptor echoes it.
    pub session: u64,
    /// Which queue pair of the peer connection this is, `< qp_count`.
    pub qp_index: u16,
    /// How many queue pairs the peer connection has,
    /// `1..=`[`MAX_QPS_PER_PEER`].
    pub qp_count: u16,
    /// Largest control message the sender can receive (its receive buffer
    /// size), [`MIN_MESSAGE`]`..=`[`MAX_MESSAGE`].
    pub max_message: u32,
    /// Receive buffers the sender keeps posted on queue pair 0, at least 1.
    pub recv_depth: u16,
    /// Advisory: the largest single RDMA request the sender wants, nonzero.
    pub max_slice: u32,
}

impl Hello {
    /// Length of every encoded hello.
    pub const ENCODED_LEN: usize = 40;

    /// Checks the ranges [`Hello::decode`] enforces: a hello that passes
    /// encodes to bytes the peer accepts.
    pub fn validate(&self) -> Result<(), WireError> {
        let out_of_range = |field, value| Err(WireError::OutOfRange { field, value });
        if self.engine == 0 {
            return out_of_range("hello engine (nonzero)", 0);
        }
        if self.session == 0 {
            return out_of_range("hello session (nonzero)", 0);
        }
        if self.qp_count == 0 || self.qp_count > MAX_QPS_PER_PEER {
            return out_of_range("hello qp_count (1..=64)", self.qp_count.into());
        }
        if self.qp_index >= self.qp_count {
            return out_of_range("hello qp_index (< qp_count)", self.qp_index.into());
        }
        if !(MIN_MESSAGE..=MAX_MESSAGE).contains(&self.max_message) {
            return out_of_range("hello max_message (64..=1048576)", self.max_message.into());
        }
        if self.recv_depth == 0 {
            return out_of_range("hello recv_depth (nonzero)", 0);
        }
        if self.max_slice == 0 {
            return out_of_range("hello max_slice (nonzero)", 0);
        }
        Ok(())
    }

    /// Encodes the hello, [`Hello::ENCODED_LEN`] bytes. Encodes whatever it
    /// holds: [`Hello::validate`] says whether the peer will accept it.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::ENCODED_LEN);
        out.extend_from_slice(&HELLO_MAGIC);
        out.push(WIRE_VERSION);
        out.push(self.role.code());
        out.extend_from_slice(&[0; 2]);
        out.extend_from_slice(&self.engine.to_le_bytes());
        out.extend_from_slice(&self.session.to_le_bytes());
        out.extend_from_slice(&self.qp_index.to_le_bytes());
        out.extend_from_slice(&self.qp_count.to_le_bytes());
        out.extend_from_slice(&self.max_message.to_le_bytes());
        out.extend_from_slice(&self.recv_depth.to_le_bytes());
        out.extend_from_slice(&[0; 2]);
        out.extend_from_slice(&self.max_slice.to_le_bytes());
        debug_assert_eq!(out.len(), Self::ENCODED_LEN);
        out
    }

    /// Decodes a hello: exactly [`Hello::ENCODED_LEN`] bytes of this
    /// version, every field in range, reserved bytes zero. A hello of another
    /// version is [`WireError::Version`], whatever its length.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes);
        r.magic(HELLO_MAGIC, "hello", Self::ENCODED_LEN)?;
        let version = r.u8().map_err(|_| WireError::Truncated {
            got: bytes.len(),
            need: Self::ENCODED_LEN,
        })?;
        if version != WIRE_VERSION {
            return Err(WireError::Version {
                ours: WIRE_VERSION,
                theirs: version,
            });
        }
        if bytes.len() < Self::ENCODED_LEN {
            return Err(WireError::Truncated {
                got: bytes.len(),
                need: Self::ENCODED_LEN,
            });
        }
        if bytes.len() > Self::ENCODED_LEN {
            return Err(WireError::LengthMismatch {
                what: "hello",
                expected: Self::ENCODED_LEN,
                got: bytes.len(),
            });
        }
        let role = Role::from_code(r.u8()?)?;
        r.reserved::<2>("hello bytes 6..8")?;
        let engine = r.u64()?;
        let session = r.u64()?;
        let qp_index = r.u16()?;
        let qp_count = r.u16()?;
        let max_message = r.u32()?;
        let recv_depth = r.u16()?;
        r.reserved::<2>("hello bytes 34..36")?;
        let max_slice = r.u32()?;
        let hello = Hello {
            role,
            engine,
            session,
            qp_index,
            qp_count,
            max_message,
            recv_depth,
            max_slice,
        };
        hello.validate()?;
        Ok(hello)
    }
}

/// Why an acceptor turned a connect request away: the reject's private data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The connector's hello is of another wire version.
    VersionMismatch {
        /// The rejecting side's version.
        ours: u8,
        /// The version the rejecting side received.
        theirs: u8,
    },
    /// The connect's private data is not a valid hello.
    Malformed,
    /// A queue pair other than the first names a session the acceptor does
    /// not know (or no longer knows).
    SessionUnknown,
    /// The connection asks for more queue pairs than the acceptor allows.
    TooManyQps,
    /// The acceptor cannot take the connection now (resources, shutting
    /// down); a later attempt may succeed.
    Busy,
}

impl RejectReason {
    /// Length of every encoded reject reason.
    pub const ENCODED_LEN: usize = 8;

    /// The reject an acceptor sends for a connect whose hello failed to
    /// decode with `error`: [`RejectReason::VersionMismatch`] for another
    /// version, [`RejectReason::Malformed`] for anything else.
    pub fn for_hello_error(error: &WireError) -> Self {
        match *error {
            WireError::Version { ours, theirs } => RejectReason::VersionMismatch { ours, theirs },
            _ => RejectReason::Malformed,
        }
    }

    /// Encodes the reason, [`RejectReason::ENCODED_LEN`] bytes.
    pub fn encode(&self) -> Vec<u8> {
        let (code, ours, theirs) = match *self {
            RejectReason::VersionMismatch { ours, theirs } => (1, ours, theirs),
            RejectReason::Malformed => (2, 0, 0),
            RejectReason::SessionUnknown => (3, 0, 0),
            RejectReason::TooManyQps => (4, 0, 0),
            RejectReason::Busy => (5, 0, 0),
        };
        let mut out = Vec::with_capacity(Self::ENCODED_LEN);
        out.extend_from_slice(&REJECT_MAGIC);
        out.extend_from_slice(&[code, ours, theirs, 0]);
        out
    }

    /// Decodes a reason: exactly [`RejectReason::ENCODED_LEN`] bytes, a
    /// known code, unused bytes zero.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes);
        r.magic(REJECT_MAGIC, "reject", Self::ENCODED_LEN)?;
        if bytes.len() > Self::ENCODED_LEN {
            return Err(WireError::LengthMismatch {
                what: "reject",
                expected: Self::ENCODED_LEN,
                got: bytes.len(),
            });
        }
        let [code, ours, theirs, reserved] = r.array::<4>()?;
        if reserved != 0 {
            return Err(WireError::Reserved {
                what: "reject byte 7",
                value: reserved.into(),
            });
        }
        let no_args = |reason| {
            if ours != 0 || theirs != 0 {
                Err(WireError::Reserved {
                    what: "reject bytes 5..7",
                    value: u16::from_le_bytes([ours, theirs]).into(),
                })
            } else {
                Ok(reason)
            }
        };
        match code {
            1 => Ok(RejectReason::VersionMismatch { ours, theirs }),
            2 => no_args(RejectReason::Malformed),
            3 => no_args(RejectReason::SessionUnknown),
            4 => no_args(RejectReason::TooManyQps),
            5 => no_args(RejectReason::Busy),
            other => Err(WireError::UnknownReason(other)),
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectReason::VersionMismatch { ours, theirs } => write!(
                f,
                "the peer speaks wire version {ours} and was sent version {theirs}"
            ),
            RejectReason::Malformed => f.write_str("the peer could not parse the hello"),
            RejectReason::SessionUnknown => f.write_str("the peer does not know the session"),
            RejectReason::TooManyQps => f.write_str("too many queue pairs for the peer"),
            RejectReason::Busy => f.write_str("the peer is busy"),
        }
    }
}

/// One control message, borrowing its variable-length parts from the
/// receive buffer it was decoded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control<'a> {
    /// A caller's message, opaque.
    User(&'a [u8]),
    /// A grant: an encoded memory descriptor (opaque here), nonempty.
    GrantAnnounce {
        /// The descriptor's encoding.
        descriptor: &'a [u8],
    },
    /// A grant is withdrawn.
    GrantRevoke {
        /// The grant's id, nonzero.
        grant: u64,
    },
    /// Orderly close: the sender posts nothing more.
    Goodbye,
    /// Rendezvous for a staging-rung region: the requester asks the owner
    /// of staged grant `grant` to move a range of it.
    StagedRequest {
        /// The request's id, echoed in the reply.
        id: u64,
        /// The grant the range lies in, nonzero.
        grant: u64,
        /// Start of the range within the grant.
        offset: u64,
        /// Length of the range, nonzero; `offset + len` fits in u64.
        len: u64,
        /// Whether the requester writes the range (else it reads it).
        write: bool,
        /// Through the owner's landing slots lent to the requester
        /// ([`Control::Slots`], slice by slice with [`Control::SlotReady`]
        /// credits); else against the requester's grant whose id is `id`
        /// (the naive rendezvous of older engines: refused,
        /// [`crate::rendezvous::status::ACCESS_DENIED`]).
        slots: bool,
    },
    /// The answer to a [`Control::StagedRequest`].
    StagedReply {
        /// The request's id.
        id: u64,
        /// Its outcome, 0 for success.
        status: u32,
    },
    /// The NIC each of the sender's queue pairs to this peer is on, in
    /// queue-pair order, names joined by `,`: the receiver picks a grant's
    /// segment for a queue pair by the NIC at its other end.
    Paths {
        /// The names, joined by `,`.
        devices: &'a [u8],
    },
    /// Where the sender runs, sent (before [`Control::Paths`]) only by an
    /// engine that allows the peer-copy path: the same `host` (boot id)
    /// means one machine, the same `process` too one address space.
    Locality {
        /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`).
        host: [u8; 16],
        /// The sender's CUDA driver's process token.
        process: u64,
    },
    /// The CUDA IPC handle behind a grant of GPU memory, sent (before its
    /// [`Control::GrantAnnounce`]) only to a peer of the same host in
    /// another process: a capability for the whole allocation.
    GrantIpc {
        /// The grant, nonzero.
        grant: u64,
        /// Where the grant starts within the allocation.
        offset: u64,
        /// The allocation's `CUipcMemHandle`.
        handle: [u8; 64],
    },
    /// The sender's landing slots lent to the receiver (the receiver's
    /// rendezvous go through them): `count` slots of `slot_len` bytes, slot
    /// `i` at offset `i * slot_len` of the grant `descriptor` encodes.
    Slots {
        /// Bytes of one slot, nonzero.
        slot_len: u64,
        /// Slots, nonzero.
        count: u32,
        /// The encoded descriptor of the slots' grant, nonempty.
        descriptor: &'a [u8],
    },
    /// The owner's credit: landing slot `slot` is the requester's for the
    /// slice at `offset` (within request `id`) of `len` bytes: to WRITE
    /// into, or (a READ) holding the slice to READ.
    SlotReady {
        /// The request's id.
        id: u64,
        /// The slice's offset within the request.
        offset: u64,
        /// The slice's length, nonzero; `offset + len` fits in u64.
        len: u64,
        /// The slot.
        slot: u32,
    },
    /// The requester's WRITE into landing slot `slot` for request `id`
    /// completed: the slot holds the slice.
    SlotFilled {
        /// The request's id.
        id: u64,
        /// The slot.
        slot: u32,
    },
    /// The requester's READ of landing slot `slot` for request `id`
    /// completed: the slot is the owner's again.
    SlotDone {
        /// The request's id.
        id: u64,
        /// The slot.
        slot: u32,
    },
    /// The requester gave up request `id` (failed, late or cancelled) and
    /// has nothing of it in flight: every slot lent to it is the owner's
    /// again.
    StagedCancel {
        /// The request's id.
        id: u64,
    },
    /// The answer of a peer that had grant `grant`'s CUDA IPC handle
    /// ([`Control::GrantIpc`]) to its [`Control::GrantRevoke`]: nothing it
    /// queued under the grant runs any more, and it queues nothing more.
    /// Until it comes (or a bound passes) the owner keeps the memory.
    GrantReleased {
        /// The grant, nonzero.
        grant: u64,
    },
}

impl<'a> Control<'a> {
    fn kind(&self) -> u8 {
        match self {
            Control::User(_) => KIND_USER,
            Control::GrantAnnounce { .. } => KIND_GRANT_ANNOUNCE,
            Control::GrantRevoke { .. } => KIND_GRANT_REVOKE,
            Control::Goodbye => KIND_GOODBYE,
            Control::StagedRequest { .. } => KIND_STAGED_REQUEST,
            Control::StagedReply { .. } => KIND_STAGED_REPLY,
            Control::Paths { .. } => KIND_PATHS,
            Control::Locality { .. } => KIND_LOCALITY,
            Control::GrantIpc { .. } => KIND_GRANT_IPC,
            Control::Slots { .. } => KIND_SLOTS,
            Control::SlotReady { .. } => KIND_SLOT_READY,
            Control::SlotFilled { .. } => KIND_SLOT_FILLED,
            Control::SlotDone { .. } => KIND_SLOT_DONE,
            Control::StagedCancel { .. } => KIND_STAGED_CANCEL,
            Control::GrantReleased { .. } => KIND_GRANT_RELEASED,
        }
    }

    fn body_len(&self) -> usize {
        match self {
            Control::User(payload) => payload.len(),
            Control::GrantAnnounce { descriptor } => descriptor.len(),
            Control::Paths { devices } => devices.len(),
            Control::GrantRevoke { .. } => GRANT_REVOKE_BODY,
            Control::Goodbye => 0,
            Control::StagedRequest { .. } => STAGED_REQUEST_BODY,
            Control::StagedReply { .. } => STAGED_REPLY_BODY,
            Control::Locality { .. } => LOCALITY_BODY,
            Control::GrantIpc { .. } => GRANT_IPC_BODY,
            Control::Slots { descriptor, .. } => SLOTS_HEAD + descriptor.len(),
            Control::SlotReady { .. } => SLOT_READY_BODY,
            Control::SlotFilled { .. } | Control::SlotDone { .. } => SLOT_CREDIT_BODY,
            Control::StagedCancel { .. } => STAGED_CANCEL_BODY,
            Control::GrantReleased { .. } => GRANT_RELEASED_BODY,
        }
    }

    /// The message's encoded length, header included.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.body_len()
    }

    /// Checks what [`Control::decode`] enforces: a message that passes
    /// encodes to bytes the peer accepts.
    pub fn validate(&self) -> Result<(), WireError> {
        let len = self.encoded_len();
        if len > MAX_MESSAGE as usize {
            return Err(WireError::TooLarge {
                len,
                max: MAX_MESSAGE as usize,
            });
        }
        match *self {
            Control::Paths { devices } => check_paths(devices),
            Control::GrantAnnounce { descriptor: [] } => Err(WireError::OutOfRange {
                field: "grant announcement descriptor length (nonzero)",
                value: 0,
            }),
            Control::GrantRevoke { grant: 0 } => Err(WireError::OutOfRange {
                field: "grant revocation grant id (nonzero)",
                value: 0,
            }),
            Control::GrantIpc { grant: 0, .. } => Err(WireError::OutOfRange {
                field: "grant IPC handle grant id (nonzero)",
                value: 0,
            }),
            Control::GrantReleased { grant: 0 } => Err(WireError::OutOfRange {
                field: "grant release grant id (nonzero)",
                value: 0,
            }),
            Control::StagedRequest {
                grant, offset, len, ..
            } => {
                if grant == 0 {
                    Err(WireError::OutOfRange {
                        field: "staged request grant id (nonzero)",
                        value: 0,
                    })
                } else if len == 0 {
                    Err(WireError::OutOfRange {
                        field: "staged request len (nonzero)",
                        value: 0,
                    })
                } else if offset.checked_add(len).is_none() {
                    Err(WireError::OutOfRange {
                        field: "staged request offset (offset + len overflows u64)",
                        value: offset,
                    })
                } else {
                    Ok(())
                }
            }
            Control::Slots {
                slot_len,
                count,
                descriptor,
            } => {
                if slot_len == 0 {
                    Err(WireError::OutOfRange {
                        field: "slots slot_len (nonzero)",
                        value: 0,
                    })
                } else if count == 0 {
                    Err(WireError::OutOfRange {
                        field: "slots count (nonzero)",
                        value: 0,
                    })
                } else if descriptor.is_empty() {
                    Err(WireError::OutOfRange {
                        field: "slots descriptor length (nonzero)",
                        value: 0,
                    })
                } else {
                    Ok(())
                }
            }
            Control::SlotReady { offset, len, .. } => {
                if len == 0 {
                    Err(WireError::OutOfRange {
                        field: "slot ready len (nonzero)",
                        value: 0,
                    })
                } else if offset.checked_add(len).is_none() {
                    Err(WireError::OutOfRange {
                        field: "slot ready offset (offset + len overflows u64)",
                        value: offset,
                    })
                } else {
                    Ok(())
                }
            }
            _ => Ok(()),
        }
    }

    /// Encodes the message at the start of `out`, returning its length,
    /// [`Control::encoded_len`]. Refuses a message [`Control::decode`] would
    /// refuse, and a buffer shorter than the message
    /// ([`WireError::BufferTooSmall`]); `out` is untouched then.
    pub fn encode_into(&self, out: &mut [u8]) -> Result<usize, WireError> {
        self.validate()?;
        let need = self.encoded_len();
        if out.len() < need {
            return Err(WireError::BufferTooSmall {
                need,
                got: out.len(),
            });
        }
        let body_len = u32::try_from(self.body_len()).map_err(|_| WireError::TooLarge {
            len: need,
            max: MAX_MESSAGE as usize,
        })?;
        let mut w = Writer { out, pos: 0 };
        w.put(&[CONTROL_MAGIC, WIRE_VERSION, self.kind(), 0]);
        w.put(&body_len.to_le_bytes());
        match *self {
            Control::User(bytes)
            | Control::GrantAnnounce { descriptor: bytes }
            | Control::Paths { devices: bytes } => w.put(bytes),
            Control::GrantRevoke { grant } => w.put(&grant.to_le_bytes()),
            Control::Goodbye => {}
            Control::StagedRequest {
                id,
                grant,
                offset,
                len,
                write,
                slots,
            } => {
                w.put(&id.to_le_bytes());
                w.put(&grant.to_le_bytes());
                w.put(&offset.to_le_bytes());
                w.put(&len.to_le_bytes());
                w.put(&[u8::from(write), u8::from(slots), 0, 0, 0, 0, 0, 0]);
            }
            Control::StagedReply { id, status } => {
                w.put(&id.to_le_bytes());
                w.put(&status.to_le_bytes());
                w.put(&[0; 4]);
            }
            Control::Locality { host, process } => {
                w.put(&host);
                w.put(&process.to_le_bytes());
            }
            Control::GrantIpc {
                grant,
                offset,
                handle,
            } => {
                w.put(&grant.to_le_bytes());
                w.put(&offset.to_le_bytes());
                w.put(&handle);
            }
            Control::Slots {
                slot_len,
                count,
                descriptor,
            } => {
                w.put(&slot_len.to_le_bytes());
                w.put(&count.to_le_bytes());
                w.put(&[0; 4]);
                w.put(descriptor);
            }
            Control::SlotReady {
                id,
                offset,
                len,
                slot,
            } => {
                w.put(&id.to_le_bytes());
                w.put(&offset.to_le_bytes());
                w.put(&len.to_le_bytes());
                w.put(&slot.to_le_bytes());
                w.put(&[0; 4]);
            }
            Control::SlotFilled { id, slot } | Control::SlotDone { id, slot } => {
                w.put(&id.to_le_bytes());
                w.put(&slot.to_le_bytes());
                w.put(&[0; 4]);
            }
            Control::StagedCancel { id } => w.put(&id.to_le_bytes()),
            Control::GrantReleased { grant } => w.put(&grant.to_le_bytes()),
        }
        debug_assert_eq!(w.pos, need);
        Ok(need)
    }

    /// Encodes the message into a new vector of [`Control::encoded_len`]
    /// bytes.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        let mut out = vec![0; self.encoded_len()];
        self.encode_into(&mut out)?;
        Ok(out)
    }

    /// Decodes one message from exactly the bytes a receive completion
    /// delivered: the header's body length must equal the bytes after it,
    /// each kind's body must be its exact size, every field in range.
    pub fn decode(bytes: &'a [u8]) -> Result<Control<'a>, WireError> {
        let mut r = Reader::new(bytes);
        let [magic, version, kind, flags] = r.array::<4>().map_err(|_| WireError::Truncated {
            got: bytes.len(),
            need: HEADER_LEN,
        })?;
        if magic != CONTROL_MAGIC {
            return Err(WireError::BadMagic {
                what: "control message",
                got: magic.into(),
            });
        }
        if version != WIRE_VERSION {
            return Err(WireError::Version {
                ours: WIRE_VERSION,
                theirs: version,
            });
        }
        let declared = r.u32().map_err(|_| WireError::Truncated {
            got: bytes.len(),
            need: HEADER_LEN,
        })?;
        if bytes.len() > MAX_MESSAGE as usize {
            return Err(WireError::TooLarge {
                len: bytes.len(),
                max: MAX_MESSAGE as usize,
            });
        }
        if !(KIND_USER..=KIND_GRANT_RELEASED).contains(&kind) {
            return Err(WireError::UnknownKind(kind));
        }
        if flags != 0 {
            return Err(WireError::Reserved {
                what: "control message flags",
                value: flags.into(),
            });
        }
        let body = r.rest;
        // Widening: usize is at least 32 bits on every target gdr builds for.
        let declared = declared as usize;
        if declared > body.len() {
            return Err(WireError::Truncated {
                got: bytes.len(),
                need: HEADER_LEN.saturating_add(declared),
            });
        }
        if declared < body.len() {
            return Err(WireError::LengthMismatch {
                what: "control message (header's body length)",
                expected: HEADER_LEN + declared,
                got: bytes.len(),
            });
        }
        let exact = |what, expected: usize| {
            if body.len() == expected {
                Ok(())
            } else {
                Err(WireError::LengthMismatch {
                    what,
                    expected,
                    got: body.len(),
                })
            }
        };
        let mut b = Reader::new(body);
        let message = match kind {
            KIND_USER => Control::User(body),
            KIND_GRANT_ANNOUNCE => Control::GrantAnnounce { descriptor: body },
            KIND_PATHS => Control::Paths { devices: body },
            KIND_GRANT_REVOKE => {
                exact("grant revocation body", GRANT_REVOKE_BODY)?;
                Control::GrantRevoke { grant: b.u64()? }
            }
            KIND_GOODBYE => {
                exact("goodbye body", 0)?;
                Control::Goodbye
            }
            KIND_STAGED_REQUEST => {
                exact("staged request body", STAGED_REQUEST_BODY)?;
                let id = b.u64()?;
                let grant = b.u64()?;
                let offset = b.u64()?;
                let len = b.u64()?;
                let flag = |value: u8, field| match value {
                    0 => Ok(false),
                    1 => Ok(true),
                    other => Err(WireError::OutOfRange {
                        field,
                        value: other.into(),
                    }),
                };
                let write = flag(b.u8()?, "staged request write (0 or 1)")?;
                let slots = flag(b.u8()?, "staged request slots (0 or 1)")?;
                b.reserved::<6>("staged request bytes 34..40")?;
                Control::StagedRequest {
                    id,
                    grant,
                    offset,
                    len,
                    write,
                    slots,
                }
            }
            KIND_STAGED_REPLY => {
                exact("staged reply body", STAGED_REPLY_BODY)?;
                let id = b.u64()?;
                let status = b.u32()?;
                b.reserved::<4>("staged reply bytes 12..16")?;
                Control::StagedReply { id, status }
            }
            KIND_LOCALITY => {
                exact("locality body", LOCALITY_BODY)?;
                Control::Locality {
                    host: b.array::<16>()?,
                    process: b.u64()?,
                }
            }
            KIND_GRANT_IPC => {
                exact("grant IPC handle body", GRANT_IPC_BODY)?;
                Control::GrantIpc {
                    grant: b.u64()?,
                    offset: b.u64()?,
                    handle: b.array::<64>()?,
                }
            }
            KIND_SLOTS => {
                if body.len() < SLOTS_HEAD {
                    return Err(WireError::LengthMismatch {
                        what: "slots body (at least its fixed part)",
                        expected: SLOTS_HEAD,
                        got: body.len(),
                    });
                }
                let slot_len = b.u64()?;
                let count = b.u32()?;
                b.reserved::<4>("slots bytes 12..16")?;
                Control::Slots {
                    slot_len,
                    count,
                    descriptor: b.rest,
                }
            }
            KIND_SLOT_READY => {
                exact("slot ready body", SLOT_READY_BODY)?;
                let id = b.u64()?;
                let offset = b.u64()?;
                let len = b.u64()?;
                let slot = b.u32()?;
                b.reserved::<4>("slot ready bytes 28..32")?;
                Control::SlotReady {
                    id,
                    offset,
                    len,
                    slot,
                }
            }
            KIND_SLOT_FILLED | KIND_SLOT_DONE => {
                exact("slot credit body", SLOT_CREDIT_BODY)?;
                let id = b.u64()?;
                let slot = b.u32()?;
                b.reserved::<4>("slot credit bytes 12..16")?;
                if kind == KIND_SLOT_FILLED {
                    Control::SlotFilled { id, slot }
                } else {
                    Control::SlotDone { id, slot }
                }
            }
            KIND_STAGED_CANCEL => {
                exact("staged cancel body", STAGED_CANCEL_BODY)?;
                Control::StagedCancel { id: b.u64()? }
            }
            KIND_GRANT_RELEASED => {
                exact("grant release body", GRANT_RELEASED_BODY)?;
                Control::GrantReleased { grant: b.u64()? }
            }
            other => return Err(WireError::UnknownKind(other)),
        };
        message.validate()?;
        Ok(message)
    }
}

/// Checks a [`Control::Paths`] body: 1..=[`MAX_QPS_PER_PEER`] names of
/// 1..=63 bytes of `[A-Za-z0-9_-]`, joined by `,`.
fn check_paths(devices: &[u8]) -> Result<(), WireError> {
    let bad = |field: &'static str, value: u64| Err(WireError::OutOfRange { field, value });
    let mut count = 0u64;
    for name in devices.split(|&b| b == b',') {
        count += 1;
        if name.is_empty() || name.len() > 63 {
            return bad("paths device name length (1..=63)", name.len() as u64);
        }
        if let Some(&b) = name
            .iter()
            .find(|&&b| !(b.is_ascii_alphanumeric() || b == b'_' || b == b'-'))
        {
            return bad("paths device name byte ([A-Za-z0-9_-])", b.into());
        }
    }
    if count > u64::from(MAX_QPS_PER_PEER) {
        return bad("paths count (1..=64)", count);
    }
    Ok(())
}

/// Writes into a buffer already checked to be long enough.
struct Writer<'o> {
    out: &'o mut [u8],
    pos: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) {
        let end = self.pos + bytes.len();
        self.out[self.pos..end].copy_from_slice(bytes);
        self.pos = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            role: Role::Connect,
            engine: 0x1122_3344_5566_7788,
            session: 0x99AA_BBCC_DDEE_FF01,
            qp_index: 2,
            qp_count: 4,
            max_message: 4096,
            recv_depth: 32,
            max_slice: 1 << 20,
        }
    }

    /// Decodes `bytes` as a hello after `edit` changed them.
    fn hello_edited(edit: impl FnOnce(&mut Vec<u8>)) -> Result<Hello, WireError> {
        let mut bytes = hello().encode();
        edit(&mut bytes);
        Hello::decode(&bytes)
    }

    fn hello_with(edit: impl FnOnce(&mut Hello)) -> Result<Hello, WireError> {
        let mut h = hello();
        edit(&mut h);
        Hello::decode(&h.encode())
    }

    #[test]
    fn hello_round_trips_in_both_roles() {
        for role in [Role::Connect, Role::Accept] {
            let h = Hello { role, ..hello() };
            let bytes = h.encode();
            assert_eq!(bytes.len(), Hello::ENCODED_LEN);
            assert_eq!(Hello::decode(&bytes), Ok(h));
        }
    }

    #[test]
    fn hello_layout_is_the_documented_one() {
        let expected: [u8; 40] = [
            b'G', b'D', b'R', b'H', 1, 1, 0, 0, // magic, version, role, reserved
            0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, // engine
            0x01, 0xFF, 0xEE, 0xDD, 0xCC, 0xBB, 0xAA, 0x99, // session
            2, 0, 4, 0, // qp_index, qp_count
            0x00, 0x10, 0, 0, // max_message
            32, 0, 0, 0, // recv_depth, reserved
            0, 0, 0x10, 0, // max_slice
        ];
        assert_eq!(hello().encode(), expected);
        let accept = Hello {
            role: Role::Accept,
            ..hello()
        };
        assert_eq!(accept.encode()[5], 2);
    }

    #[test]
    fn hello_accepts_the_range_bounds() {
        let edges = [
            (1, 0, MIN_MESSAGE, 1, 1),
            (
                MAX_QPS_PER_PEER,
                MAX_QPS_PER_PEER - 1,
                MAX_MESSAGE,
                u16::MAX,
                u32::MAX,
            ),
        ];
        for (qp_count, qp_index, max_message, recv_depth, max_slice) in edges {
            let h = Hello {
                engine: u64::MAX,
                session: 1,
                qp_count,
                qp_index,
                max_message,
                recv_depth,
                max_slice,
                ..hello()
            };
            assert_eq!(Hello::decode(&h.encode()), Ok(h));
        }
    }

    #[test]
    fn hello_refuses_wrong_lengths() {
        let bytes = hello().encode();
        for n in 0..bytes.len() {
            assert_eq!(
                Hello::decode(&bytes[..n]),
                Err(WireError::Truncated {
                    got: n,
                    need: Hello::ENCODED_LEN
                }),
                "prefix of {n} bytes"
            );
        }
        assert_eq!(
            hello_edited(|b| b.push(0)),
            Err(WireError::LengthMismatch {
                what: "hello",
                expected: 40,
                got: 41
            })
        );
    }

    #[test]
    fn hello_refuses_bad_magic() {
        assert_eq!(
            hello_edited(|b| b[3] = b'X'),
            Err(WireError::BadMagic {
                what: "hello",
                got: u32::from_be_bytes(*b"GDRX")
            })
        );
        // A reject or a control message is not a hello.
        assert!(matches!(
            Hello::decode(&RejectReason::Busy.encode()),
            Err(WireError::BadMagic { .. })
        ));
    }

    #[test]
    fn hello_of_another_version_says_which_whatever_its_length() {
        for len in [5, 39, 40, 41, 55] {
            let mut bytes = hello().encode();
            bytes.resize(len, 0);
            bytes[4] = 2;
            assert_eq!(
                Hello::decode(&bytes),
                Err(WireError::Version { ours: 1, theirs: 2 }),
                "length {len}"
            );
        }
        let err = hello_edited(|b| b[4] = 0).unwrap_err();
        assert_eq!(err, WireError::Version { ours: 1, theirs: 0 });
        assert_eq!(
            RejectReason::for_hello_error(&err),
            RejectReason::VersionMismatch { ours: 1, theirs: 0 }
        );
        assert!(err.to_string().contains("version 0"), "{err}");
    }

    #[test]
    fn hello_refuses_unknown_roles() {
        for role in [0, 3, 0xFF] {
            assert_eq!(
                hello_edited(|b| b[5] = role),
                Err(WireError::UnknownRole(role))
            );
        }
    }

    #[test]
    fn hello_refuses_nonzero_reserved_bytes() {
        for at in [6, 7, 34, 35] {
            let err = hello_edited(|b| b[at] = 0x40).unwrap_err();
            assert!(
                matches!(err, WireError::Reserved { value, .. } if value != 0),
                "byte {at}: {err:?}"
            );
        }
    }

    #[test]
    fn hello_refuses_out_of_range_fields() {
        type Edit = fn(&mut Hello);
        let cases: [(&str, Edit, u64); 9] = [
            ("engine", |h| h.engine = 0, 0),
            ("session", |h| h.session = 0, 0),
            ("qp_count", |h| h.qp_count = 0, 0),
            ("qp_count", |h| h.qp_count = MAX_QPS_PER_PEER + 1, 65),
            ("qp_index", |h| h.qp_index = h.qp_count, 4),
            ("max_message", |h| h.max_message = MIN_MESSAGE - 1, 63),
            (
                "max_message",
                |h| h.max_message = MAX_MESSAGE + 1,
                (1 << 20) + 1,
            ),
            ("recv_depth", |h| h.recv_depth = 0, 0),
            ("max_slice", |h| h.max_slice = 0, 0),
        ];
        for (name, edit, expected) in cases {
            match hello_with(edit) {
                Err(WireError::OutOfRange { field, value }) => {
                    assert!(field.contains(name), "{field} for {name}");
                    assert_eq!(value, expected, "{name}");
                }
                other => panic!("{name}: {other:?}"),
            }
            let mut h = hello();
            edit(&mut h);
            assert!(h.validate().is_err(), "{name}");
        }
    }

    const REASONS: [RejectReason; 5] = [
        RejectReason::VersionMismatch { ours: 1, theirs: 7 },
        RejectReason::Malformed,
        RejectReason::SessionUnknown,
        RejectReason::TooManyQps,
        RejectReason::Busy,
    ];

    #[test]
    fn reject_reasons_round_trip() {
        for (code, reason) in (1u8..).zip(REASONS) {
            let bytes = reason.encode();
            assert_eq!(bytes.len(), RejectReason::ENCODED_LEN);
            assert_eq!(&bytes[..5], &[b'G', b'D', b'R', b'J', code]);
            assert_eq!(RejectReason::decode(&bytes), Ok(reason));
            assert!(!reason.to_string().is_empty());
        }
        assert_eq!(
            RejectReason::VersionMismatch { ours: 1, theirs: 7 }.encode()[5..],
            [1, 7, 0]
        );
    }

    #[test]
    fn reject_reasons_refuse_bad_input() {
        let bytes = RejectReason::Busy.encode();
        for n in 0..bytes.len() {
            assert_eq!(
                RejectReason::decode(&bytes[..n]),
                Err(WireError::Truncated { got: n, need: 8 }),
                "prefix of {n}"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(
            RejectReason::decode(&long),
            Err(WireError::LengthMismatch { got: 9, .. })
        ));
        let edit = |at: usize, value: u8| {
            let mut b = bytes.clone();
            b[at] = value;
            RejectReason::decode(&b)
        };
        assert!(matches!(edit(0, b'X'), Err(WireError::BadMagic { .. })));
        assert_eq!(edit(4, 0), Err(WireError::UnknownReason(0)));
        assert_eq!(edit(4, 6), Err(WireError::UnknownReason(6)));
        assert!(matches!(edit(5, 1), Err(WireError::Reserved { .. })));
        assert!(matches!(edit(6, 1), Err(WireError::Reserved { .. })));
        assert!(matches!(edit(7, 1), Err(WireError::Reserved { .. })));
        assert_eq!(
            RejectReason::for_hello_error(&WireError::UnknownRole(9)),
            RejectReason::Malformed
        );
    }

    fn controls() -> Vec<Control<'static>> {
        vec![
            Control::User(b""),
            Control::User(b"hello, peer"),
            Control::GrantAnnounce {
                descriptor: b"\x01opaque descriptor bytes",
            },
            Control::GrantRevoke { grant: 42 },
            Control::Goodbye,
            Control::Paths {
                devices: b"mlx5_0,mlx5_1",
            },
            Control::StagedRequest {
                id: 7,
                grant: 9,
                offset: 4096,
                len: 1 << 16,
                write: true,
                slots: false,
            },
            Control::StagedRequest {
                id: 0,
                grant: u64::MAX,
                offset: u64::MAX - 1,
                len: 1,
                write: false,
                slots: false,
            },
            Control::StagedReply {
                id: 7,
                status: 0xDEAD_BEEF,
            },
            Control::Locality {
                host: *b"0123456789abcdef",
                process: 0x1122_3344_5566_7788,
            },
            Control::GrantIpc {
                grant: 5,
                offset: 1 << 21,
                handle: std::array::from_fn(|i| i as u8),
            },
            Control::StagedRequest {
                id: 8,
                grant: 3,
                offset: 0,
                len: 5,
                write: true,
                slots: true,
            },
            Control::Slots {
                slot_len: 4 << 20,
                count: 4,
                descriptor: b"\x01opaque slots descriptor",
            },
            Control::SlotReady {
                id: 8,
                offset: 1 << 22,
                len: 4 << 20,
                slot: 3,
            },
            Control::SlotFilled { id: 8, slot: 3 },
            Control::SlotDone {
                id: u64::MAX,
                slot: u32::MAX,
            },
            Control::StagedCancel { id: 8 },
            Control::GrantReleased { grant: 9 },
        ]
    }

    #[test]
    fn control_messages_round_trip() {
        for message in controls() {
            let bytes = message.encode().unwrap();
            assert_eq!(bytes.len(), message.encoded_len(), "{message:?}");
            assert_eq!(Control::decode(&bytes), Ok(message.clone()));
            // A larger buffer: only the message's bytes are written.
            let mut big = vec![0xAB; bytes.len() + 5];
            assert_eq!(message.encode_into(&mut big), Ok(bytes.len()));
            assert_eq!(&big[..bytes.len()], &bytes[..]);
            assert!(big[bytes.len()..].iter().all(|&b| b == 0xAB));
        }
    }

    #[test]
    fn control_layout_is_the_documented_one() {
        let bytes = Control::GrantRevoke { grant: 0x0102 }.encode().unwrap();
        assert_eq!(bytes, [0xC7, 1, 3, 0, 8, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 0]);
        let bytes = Control::StagedRequest {
            id: 1,
            grant: 2,
            offset: 3,
            len: 4,
            write: true,
            slots: false,
        }
        .encode()
        .unwrap();
        assert_eq!(&bytes[..8], &[0xC7, 1, 5, 0, 40, 0, 0, 0]);
        for (field, value) in [(0, 1u8), (1, 2), (2, 3), (3, 4)] {
            let at = HEADER_LEN + 8 * field;
            assert_eq!(bytes[at], value);
            assert!(bytes[at + 1..at + 8].iter().all(|&b| b == 0));
        }
        assert_eq!(bytes[HEADER_LEN + 32], 1);
        assert_eq!(bytes[HEADER_LEN + 33], 0, "not through slots");
        let bytes = Control::SlotReady {
            id: 1,
            offset: 2,
            len: 3,
            slot: 4,
        }
        .encode()
        .unwrap();
        assert_eq!(&bytes[..8], &[0xC7, 1, 11, 0, 32, 0, 0, 0]);
        for (at, value) in [(0, 1u8), (8, 2), (16, 3), (24, 4)] {
            assert_eq!(bytes[HEADER_LEN + at], value, "byte {at}");
        }
        let filled = Control::SlotFilled { id: 5, slot: 6 }.encode().unwrap();
        assert_eq!(
            filled,
            [
                0xC7, 1, 12, 0, 16, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0
            ]
        );
        let done = Control::SlotDone { id: 5, slot: 6 }.encode().unwrap();
        assert_eq!(done[2], 13);
        assert_eq!(done[HEADER_LEN..], filled[HEADER_LEN..]);
        let cancel = Control::StagedCancel { id: 0x0102 }.encode().unwrap();
        assert_eq!(cancel, [0xC7, 1, 14, 0, 8, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 0]);
        let slots = Control::Slots {
            slot_len: 0x10,
            count: 2,
            descriptor: b"d",
        }
        .encode()
        .unwrap();
        assert_eq!(
            slots,
            [
                0xC7, 1, 10, 0, 17, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0,
                b'd'
            ]
        );
        let bytes = Control::User(b"ab").encode().unwrap();
        assert_eq!(bytes, [0xC7, 1, 1, 0, 2, 0, 0, 0, b'a', b'b']);
    }

    #[test]
    fn control_user_message_of_the_largest_size_round_trips() {
        let payload = vec![0x5A; MAX_MESSAGE as usize - HEADER_LEN];
        let message = Control::User(&payload);
        let bytes = message.encode().unwrap();
        assert_eq!(bytes.len(), MAX_MESSAGE as usize);
        assert_eq!(Control::decode(&bytes), Ok(message));

        let payload = vec![0x5A; MAX_MESSAGE as usize - HEADER_LEN + 1];
        let too_large = WireError::TooLarge {
            len: MAX_MESSAGE as usize + 1,
            max: MAX_MESSAGE as usize,
        };
        assert_eq!(Control::User(&payload).encode(), Err(too_large.clone()));
        let mut bytes = vec![0xC7, 1, 1, 0];
        bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&payload);
        assert_eq!(Control::decode(&bytes), Err(too_large));
    }

    #[test]
    fn control_encode_refuses_a_short_buffer_and_leaves_it_alone() {
        let message = Control::StagedReply { id: 1, status: 2 };
        let mut out = [0x11u8; 23];
        assert_eq!(
            message.encode_into(&mut out),
            Err(WireError::BufferTooSmall { need: 24, got: 23 })
        );
        assert_eq!(out, [0x11; 23]);
    }

    #[test]
    fn control_encode_refuses_what_decode_would_refuse() {
        let bad = [
            Control::GrantAnnounce { descriptor: b"" },
            Control::GrantRevoke { grant: 0 },
            Control::GrantReleased { grant: 0 },
            Control::GrantIpc {
                grant: 0,
                offset: 0,
                handle: [0; 64],
            },
            Control::StagedRequest {
                id: 1,
                grant: 0,
                offset: 0,
                len: 1,
                write: false,
                slots: false,
            },
            Control::StagedRequest {
                id: 1,
                grant: 1,
                offset: 0,
                len: 0,
                write: false,
                slots: false,
            },
            Control::StagedRequest {
                id: 1,
                grant: 1,
                offset: u64::MAX,
                len: 1,
                write: false,
                slots: false,
            },
            Control::Slots {
                slot_len: 0,
                count: 1,
                descriptor: b"d",
            },
            Control::Slots {
                slot_len: 1,
                count: 0,
                descriptor: b"d",
            },
            Control::Slots {
                slot_len: 1,
                count: 1,
                descriptor: b"",
            },
            Control::SlotReady {
                id: 1,
                offset: 0,
                len: 0,
                slot: 0,
            },
            Control::SlotReady {
                id: 1,
                offset: u64::MAX,
                len: 1,
                slot: 0,
            },
        ];
        for message in bad {
            let mut out = [0u8; 64];
            assert!(
                matches!(
                    message.encode_into(&mut out),
                    Err(WireError::OutOfRange { .. })
                ),
                "{message:?}"
            );
            assert_eq!(out, [0; 64], "{message:?}: nothing written");
        }
    }

    /// Decodes a control message after `edit` changed `message`'s encoding.
    fn control_edited(message: Control<'_>, edit: impl FnOnce(&mut Vec<u8>)) -> WireError {
        let mut bytes = message.encode().unwrap();
        edit(&mut bytes);
        Control::decode(&bytes).expect_err("edited message is refused")
    }

    fn set_u64(bytes: &mut [u8], at: usize, value: u64) {
        bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
    }

    #[test]
    fn control_refuses_bad_headers() {
        let revoke = Control::GrantRevoke { grant: 5 };
        for n in 0..HEADER_LEN {
            let bytes = revoke.encode().unwrap();
            assert_eq!(
                Control::decode(&bytes[..n]),
                Err(WireError::Truncated {
                    got: n,
                    need: HEADER_LEN
                })
            );
        }
        assert!(matches!(
            control_edited(revoke.clone(), |b| b[0] = b'G'),
            WireError::BadMagic { got: 0x47, .. }
        ));
        assert_eq!(
            control_edited(revoke.clone(), |b| b[1] = 2),
            WireError::Version { ours: 1, theirs: 2 }
        );
        for kind in [0, 16, 0xFF] {
            assert_eq!(
                control_edited(revoke.clone(), |b| b[2] = kind),
                WireError::UnknownKind(kind)
            );
        }
        assert_eq!(
            control_edited(revoke.clone(), |b| b[3] = 0x80),
            WireError::Reserved {
                what: "control message flags",
                value: 0x80
            }
        );
        // The body length disagrees with the bytes delivered, both ways.
        assert_eq!(
            control_edited(revoke.clone(), |b| b[4] = 9),
            WireError::Truncated { got: 16, need: 17 }
        );
        assert_eq!(
            control_edited(revoke.clone(), |b| b[7] = 0x80),
            WireError::Truncated {
                got: 16,
                need: HEADER_LEN + 0x8000_0008
            }
        );
        assert!(matches!(
            control_edited(revoke.clone(), |b| b[4] = 7),
            WireError::LengthMismatch {
                expected: 15,
                got: 16,
                ..
            }
        ));
        assert!(matches!(
            control_edited(revoke, |b| b.push(0)),
            WireError::LengthMismatch {
                expected: 16,
                got: 17,
                ..
            }
        ));
    }

    #[test]
    fn control_refuses_bodies_of_the_wrong_size() {
        // Each fixed-size kind with its body one byte short and one long,
        // the header's length adjusted to match.
        let fixed = [
            (Control::GrantRevoke { grant: 1 }, 8usize),
            (Control::Goodbye, 0),
            (
                Control::StagedRequest {
                    id: 1,
                    grant: 1,
                    offset: 0,
                    len: 1,
                    write: false,
                    slots: false,
                },
                40,
            ),
            (Control::StagedReply { id: 1, status: 0 }, 16),
            (
                Control::Locality {
                    host: [1; 16],
                    process: 2,
                },
                24,
            ),
            (
                Control::GrantIpc {
                    grant: 1,
                    offset: 0,
                    handle: [3; 64],
                },
                80,
            ),
            (
                Control::SlotReady {
                    id: 1,
                    offset: 0,
                    len: 1,
                    slot: 0,
                },
                32,
            ),
            (Control::SlotFilled { id: 1, slot: 0 }, 16),
            (Control::SlotDone { id: 1, slot: 0 }, 16),
            (Control::StagedCancel { id: 1 }, 8),
            (Control::GrantReleased { grant: 1 }, 8),
        ];
        for (message, body) in fixed {
            for delta in [-1isize, 1] {
                let Some(new_len) = body.checked_add_signed(delta) else {
                    continue;
                };
                let err = control_edited(message.clone(), |b| {
                    b.resize(HEADER_LEN + new_len, 0);
                    b[4..8].copy_from_slice(&(new_len as u32).to_le_bytes());
                });
                assert_eq!(
                    err,
                    WireError::LengthMismatch {
                        what: match message {
                            Control::GrantRevoke { .. } => "grant revocation body",
                            Control::Goodbye => "goodbye body",
                            Control::StagedRequest { .. } => "staged request body",
                            Control::Locality { .. } => "locality body",
                            Control::GrantIpc { .. } => "grant IPC handle body",
                            Control::SlotReady { .. } => "slot ready body",
                            Control::SlotFilled { .. } | Control::SlotDone { .. } =>
                                "slot credit body",
                            Control::StagedCancel { .. } => "staged cancel body",
                            Control::GrantReleased { .. } => "grant release body",
                            _ => "staged reply body",
                        },
                        expected: body,
                        got: new_len
                    },
                    "{message:?} with a body of {new_len}"
                );
            }
        }
    }

    #[test]
    fn control_refuses_out_of_range_fields() {
        let request = Control::StagedRequest {
            id: 1,
            grant: 2,
            offset: 100,
            len: 10,
            write: true,
            slots: false,
        };
        let field = |err: WireError| match err {
            WireError::OutOfRange { field, .. } => field,
            other => panic!("{other:?}"),
        };
        let empty_grant = [0xC7, 1, 2, 0, 0, 0, 0, 0];
        assert!(field(Control::decode(&empty_grant).unwrap_err()).contains("descriptor"));
        let err = control_edited(Control::GrantRevoke { grant: 3 }, |b| set_u64(b, 8, 0));
        assert!(field(err).contains("grant id"));
        let err = control_edited(request.clone(), |b| set_u64(b, 16, 0));
        assert!(field(err).contains("grant id"));
        let err = control_edited(request.clone(), |b| set_u64(b, 32, 0));
        assert!(field(err).contains("len"));
        let err = control_edited(request.clone(), |b| set_u64(b, 24, u64::MAX - 9));
        assert_eq!(
            err,
            WireError::OutOfRange {
                field: "staged request offset (offset + len overflows u64)",
                value: u64::MAX - 9
            }
        );
        let err = control_edited(request.clone(), |b| b[40] = 2);
        assert!(field(err).contains("write"));
        let err = control_edited(request.clone(), |b| b[41] = 2);
        assert!(field(err).contains("slots"));
        for at in 42..48 {
            let err = control_edited(request.clone(), |b| b[at] = 1);
            assert!(matches!(err, WireError::Reserved { .. }), "byte {at}");
        }
        for at in 20..24 {
            let err = control_edited(Control::StagedReply { id: 1, status: 2 }, |b| b[at] = 1);
            assert!(matches!(err, WireError::Reserved { .. }), "byte {at}");
            let err = control_edited(Control::SlotFilled { id: 1, slot: 2 }, |b| b[at] = 1);
            assert!(matches!(err, WireError::Reserved { .. }), "byte {at}");
            let err = control_edited(Control::SlotDone { id: 1, slot: 2 }, |b| b[at] = 1);
            assert!(matches!(err, WireError::Reserved { .. }), "byte {at}");
        }
        let ready = Control::SlotReady {
            id: 1,
            offset: 2,
            len: 3,
            slot: 4,
        };
        let err = control_edited(ready.clone(), |b| set_u64(b, 24, 0));
        assert!(field(err).contains("slot ready len"));
        let err = control_edited(ready.clone(), |b| set_u64(b, 16, u64::MAX - 1));
        assert!(field(err).contains("slot ready offset"));
        for at in 36..40 {
            let err = control_edited(ready.clone(), |b| b[at] = 1);
            assert!(matches!(err, WireError::Reserved { .. }), "byte {at}");
        }
        let slots = Control::Slots {
            slot_len: 8,
            count: 2,
            descriptor: b"dd",
        };
        let err = control_edited(slots.clone(), |b| set_u64(b, 8, 0));
        assert!(field(err).contains("slot_len"));
        let err = control_edited(slots.clone(), |b| b[16] = 0);
        assert!(field(err).contains("count"));
        for at in 20..24 {
            let err = control_edited(slots.clone(), |b| b[at] = 1);
            assert!(matches!(err, WireError::Reserved { .. }), "byte {at}");
        }
        // No descriptor, and not even the fixed part.
        let err = control_edited(slots.clone(), |b| {
            b.truncate(HEADER_LEN + 16);
            b[4] = 16;
        });
        assert!(field(err).contains("descriptor"));
        let err = control_edited(slots, |b| {
            b.truncate(HEADER_LEN + 15);
            b[4] = 15;
        });
        assert!(matches!(err, WireError::LengthMismatch { .. }), "{err:?}");
    }

    /// splitmix64: a deterministic stream for the property loops.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }

        fn nonzero(&mut self) -> u64 {
            self.next().max(1)
        }

        fn bytes(&mut self, max: u64) -> Vec<u8> {
            let len = self.below(max + 1);
            (0..len).map(|_| self.next() as u8).collect()
        }
    }

    fn random_hello(rng: &mut Rng) -> Hello {
        let qp_count = 1 + rng.below(MAX_QPS_PER_PEER.into()) as u16;
        Hello {
            role: if rng.below(2) == 0 {
                Role::Connect
            } else {
                Role::Accept
            },
            engine: rng.nonzero(),
            session: rng.nonzero(),
            qp_index: rng.below(qp_count.into()) as u16,
            qp_count,
            max_message: MIN_MESSAGE + rng.below((MAX_MESSAGE - MIN_MESSAGE + 1).into()) as u32,
            recv_depth: (rng.next() as u16).max(1),
            max_slice: (rng.next() as u32).max(1),
        }
    }

    fn random_control<'a>(rng: &mut Rng, payload: &'a [u8]) -> Control<'a> {
        match rng.below(14) {
            0 => Control::User(payload),
            12 => Control::GrantReleased {
                grant: rng.nonzero(),
            },
            6 => Control::Locality {
                host: std::array::from_fn(|_| rng.next() as u8),
                process: rng.next(),
            },
            7 => Control::GrantIpc {
                grant: rng.nonzero(),
                offset: rng.next(),
                handle: std::array::from_fn(|_| rng.next() as u8),
            },
            1 => Control::GrantAnnounce {
                descriptor: if payload.is_empty() { b"d" } else { payload },
            },
            2 => Control::GrantRevoke {
                grant: rng.nonzero(),
            },
            3 => Control::Goodbye,
            4 => {
                let len = rng.nonzero() >> rng.below(64);
                let len = len.max(1);
                Control::StagedRequest {
                    id: rng.next(),
                    grant: rng.nonzero(),
                    offset: rng.below(u64::MAX - len + 1),
                    len,
                    write: rng.below(2) == 1,
                    slots: rng.below(2) == 1,
                }
            }
            5 => Control::StagedReply {
                id: rng.next(),
                status: rng.next() as u32,
            },
            8 => Control::Slots {
                slot_len: rng.nonzero(),
                count: (rng.next() as u32).max(1),
                descriptor: if payload.is_empty() { b"d" } else { payload },
            },
            9 => {
                let len = (rng.nonzero() >> rng.below(64)).max(1);
                Control::SlotReady {
                    id: rng.next(),
                    offset: rng.below(u64::MAX - len + 1),
                    len,
                    slot: rng.next() as u32,
                }
            }
            10 => Control::SlotFilled {
                id: rng.next(),
                slot: rng.next() as u32,
            },
            11 => Control::SlotDone {
                id: rng.next(),
                slot: rng.next() as u32,
            },
            _ => Control::StagedCancel { id: rng.next() },
        }
    }

    #[test]
    fn property_hellos_round_trip_and_every_truncation_is_refused() {
        let mut rng = Rng(1);
        for _ in 0..2000 {
            let h = random_hello(&mut rng);
            assert_eq!(h.validate(), Ok(()));
            let bytes = h.encode();
            assert_eq!(Hello::decode(&bytes), Ok(h.clone()));
            for n in 0..bytes.len() {
                assert!(Hello::decode(&bytes[..n]).is_err(), "{h:?} cut to {n}");
            }
            let mut long = bytes.clone();
            long.push(rng.next() as u8);
            assert!(Hello::decode(&long).is_err(), "{h:?} extended");
            // Any one byte changed: refused, or a different hello that
            // re-encodes to exactly the changed bytes.
            let mut changed = bytes;
            let at = rng.below(changed.len() as u64) as usize;
            changed[at] ^= 1 << rng.below(8);
            if let Ok(other) = Hello::decode(&changed) {
                assert_ne!(other, h);
                assert_eq!(other.encode(), changed);
            }
        }
    }

    #[test]
    fn property_control_messages_round_trip_and_every_truncation_is_refused() {
        let mut rng = Rng(2);
        for _ in 0..2000 {
            let payload = rng.bytes(96);
            let message = random_control(&mut rng, &payload);
            let bytes = message.encode().unwrap();
            assert_eq!(bytes.len(), message.encoded_len());
            assert_eq!(Control::decode(&bytes), Ok(message.clone()));
            for n in 0..bytes.len() {
                assert!(
                    Control::decode(&bytes[..n]).is_err(),
                    "{message:?} cut to {n}"
                );
            }
            let mut long = bytes.clone();
            long.push(rng.next() as u8);
            assert!(Control::decode(&long).is_err(), "{message:?} extended");
            let mut changed = bytes;
            let at = rng.below(changed.len() as u64) as usize;
            changed[at] ^= 1 << rng.below(8);
            if let Ok(other) = Control::decode(&changed) {
                assert_ne!(other, message);
                assert_eq!(other.encode().unwrap(), changed);
            }
        }
    }

    /// The fuzz seeds: valid encodings of each format, by name.
    fn fuzz_seeds() -> Vec<(&'static str, String, Vec<u8>)> {
        let mut seeds = vec![
            ("handshake", "hello-connect".into(), hello().encode()),
            (
                "handshake",
                "hello-accept".into(),
                Hello {
                    role: Role::Accept,
                    qp_index: 0,
                    qp_count: 1,
                    ..hello()
                }
                .encode(),
            ),
        ];
        let reasons = [
            "reject-version",
            "reject-malformed",
            "reject-session",
            "reject-qps",
            "reject-busy",
        ];
        for (name, reason) in reasons.into_iter().zip(REASONS) {
            seeds.push(("handshake", name.into(), reason.encode()));
        }
        let names = [
            "user-empty",
            "user",
            "grant-announce",
            "grant-revoke",
            "goodbye",
            "paths",
            "staged-request-write",
            "staged-request-read",
            "staged-reply",
            "locality",
            "grant-ipc",
            "staged-request-slots",
            "slots",
            "slot-ready",
            "slot-filled",
            "slot-done",
            "staged-cancel",
        ];
        for (name, message) in names.into_iter().zip(controls()) {
            seeds.push(("control", name.into(), message.encode().unwrap()));
        }
        seeds
    }

    fn seed_dir(target: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/seeds")
            .join(target)
    }

    /// Writes the seeds: `cargo test -p gdr-core --lib engine::wire --
    /// --ignored write_fuzz_seeds`.
    #[test]
    #[ignore = "writes fuzz/seeds; run when the formats change"]
    fn write_fuzz_seeds() {
        for (target, name, bytes) in fuzz_seeds() {
            let dir = seed_dir(target);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }

    /// The committed seeds are the current formats' (where the fuzz
    /// directory is present): a format change must regenerate them.
    #[test]
    fn committed_fuzz_seeds_are_current() {
        for (target, name, bytes) in fuzz_seeds() {
            let path = seed_dir(target).join(&name);
            if !seed_dir(target).is_dir() {
                continue;
            }
            let committed = std::fs::read(&path)
                .unwrap_or_else(|e| panic!("{}: {e}; run write_fuzz_seeds", path.display()));
            assert_eq!(committed, bytes, "{}: run write_fuzz_seeds", path.display());
        }
    }

    #[test]
    fn paths_name_devices_strictly() {
        for good in [&b"rxe0"[..], b"mlx5_0,mlx5_1", b"a-b_c,sim0"] {
            let message = Control::Paths { devices: good };
            let mut out = vec![0; message.encoded_len()];
            message.encode_into(&mut out).unwrap();
            assert_eq!(Control::decode(&out).unwrap(), message);
        }
        for bad in [&b""[..], b"a,,b", b"mlx5_0,", b"..", b"a/b", b"a b"] {
            let message = Control::Paths { devices: bad };
            assert!(
                message.validate().is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
            let mut raw = vec![0xC7, WIRE_VERSION, KIND_PATHS, 0];
            raw.extend_from_slice(&(bad.len() as u32).to_le_bytes());
            raw.extend_from_slice(bad);
            assert!(Control::decode(&raw).is_err());
        }
        let many = vec!["n"; 65].join(",");
        assert!(
            Control::Paths {
                devices: many.as_bytes()
            }
            .validate()
            .is_err()
        );
    }
}
