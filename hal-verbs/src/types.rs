//! Plain data of the verbs HAL: attributes, access flags, connection
//! parameters, work requests and completions. Numeric values match
//! `<infiniband/verbs.h>` so backends convert by value, not by table.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

use smallvec::SmallVec;

use crate::error::{Result, VerbsError};

/// One RDMA device as enumerated, before it is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `mlx5_0`, `rxe0`.
    pub name: String,
    /// Node GUID, host byte order.
    pub node_guid: u64,
    /// PCI bus id, `dddd:bb:dd.f` (lower case, the form CUDA's
    /// `DeviceAttributes::pci_bus_id` has), for pairing NICs with the
    /// nearest GPU; `None` for a device with no PCI function of its own
    /// (SoftRoCE).
    pub pci_bus_id: Option<String>,
}

/// Whether `text` is a PCI bus id of the form `dddd:bb:dd.f`.
pub fn is_pci_bus_id(text: &str) -> bool {
    let b = text.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
        && (b'0'..=b'7').contains(&b[11])
}

/// What an opened device can do (the subset of `ibv_device_attr` we use).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceAttributes {
    /// Firmware version string.
    pub fw_ver: String,
    /// PCI vendor id.
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Largest MR in bytes.
    pub max_mr_size: u64,
    /// Queue pairs.
    pub max_qp: u32,
    /// Work requests per queue.
    pub max_qp_wr: u32,
    /// Scatter/gather entries per work request.
    pub max_sge: u32,
    /// Completion queues.
    pub max_cq: u32,
    /// Entries per completion queue.
    pub max_cqe: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Outstanding RDMA READs a QP may be target of.
    pub max_qp_rd_atom: u32,
    /// Outstanding RDMA READs a QP may initiate.
    pub max_qp_init_rd_atom: u32,
    /// Physical ports (numbered from 1).
    pub phys_port_cnt: u8,
    /// Completion vectors (`ibv_context.num_comp_vectors`): a CQ's
    /// `comp_vector` is in `0..num_comp_vectors` (rxe: 1).
    pub num_comp_vectors: u32,
    /// CQ moderation limits (`ibv_device_attr_ex.cq_mod_caps`); `None`
    /// where the device has no moderation (rxe), and then
    /// [`crate::CompletionQueue::set_moderation`] is
    /// [`crate::VerbsError::NotSupported`].
    pub cq_moderation: Option<CqModerationCaps>,
}

/// The limits of CQ moderation (`struct ibv_cq_moderation_caps`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CqModerationCaps {
    /// Largest `cq_count`: completions gathered before one event.
    pub max_cq_count: u16,
    /// Largest `cq_period`, in microseconds: longest an event is delayed.
    pub max_cq_period_us: u16,
}

/// What wakes a completion channel's reader once a CQ is armed
/// (`ibv_req_notify_cq`'s `solicited_only`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqNotify {
    /// The next completion of any kind (`solicited_only` 0).
    Next,
    /// The next receive completion of a request sent with
    /// [`SendFlags::SOLICITED`], or the next error completion
    /// (`solicited_only` 1).
    Solicited,
}

/// An asynchronous event (`enum ibv_event_type`), read from the device
/// context's async fd and already acknowledged, naming its object.
///
/// Affiliated events name the object by number: `qp_num` for a queue pair
/// (as [`crate::QueuePair::qp_num`]), `cq` for a completion queue (as
/// [`crate::CompletionQueue::cq_id`]), `srq` for a shared receive queue.
/// Unaffiliated events name the port (from 1) or nothing (the device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncEvent {
    /// The device is dead (`IBV_EVENT_DEVICE_FATAL`): no completion will
    /// come for outstanding work (hardware reports nothing more; it may not
    /// even flush). Close everything and reopen the device.
    DeviceFatal,
    /// A port came up (`IBV_EVENT_PORT_ACTIVE`).
    PortActive {
        /// The port, from 1.
        port: u8,
    },
    /// A port went down (`IBV_EVENT_PORT_ERR`): its connections fail with
    /// transport retry errors.
    PortError {
        /// The port, from 1.
        port: u8,
    },
    /// The port's GID table changed (`IBV_EVENT_GID_CHANGE`): re-read it
    /// before the next connection.
    GidChange {
        /// The port, from 1.
        port: u8,
    },
    /// The subnet manager asks clients to re-register
    /// (`IBV_EVENT_CLIENT_REREGISTER`, InfiniBand).
    ClientReregister {
        /// The port, from 1.
        port: u8,
    },
    /// The port's LID changed (`IBV_EVENT_LID_CHANGE`, InfiniBand).
    LidChange {
        /// The port, from 1.
        port: u8,
    },
    /// The port's P_Key table changed (`IBV_EVENT_PKEY_CHANGE`).
    PkeyChange {
        /// The port, from 1.
        port: u8,
    },
    /// The subnet manager changed (`IBV_EVENT_SM_CHANGE`).
    SmChange {
        /// The port, from 1.
        port: u8,
    },
    /// A queue pair hit an error no completion reports
    /// (`IBV_EVENT_QP_FATAL`); it is in ERROR.
    QpFatal {
        /// The queue pair.
        qp_num: u32,
    },
    /// The responder saw an invalid request (`IBV_EVENT_QP_REQ_ERR`); the
    /// QP is in ERROR.
    QpRequestError {
        /// The queue pair.
        qp_num: u32,
    },
    /// The responder saw an access violation (`IBV_EVENT_QP_ACCESS_ERR`:
    /// a bad rkey, bounds or rights); the QP is in ERROR.
    QpAccessError {
        /// The queue pair.
        qp_num: u32,
    },
    /// First packet on an RTR QP (`IBV_EVENT_COMM_EST`).
    CommunicationEstablished {
        /// The queue pair.
        qp_num: u32,
    },
    /// The send queue drained in SQD (`IBV_EVENT_SQ_DRAINED`).
    SendQueueDrained {
        /// The queue pair.
        qp_num: u32,
    },
    /// The QP migrated to its alternate path (`IBV_EVENT_PATH_MIG`).
    PathMigrated {
        /// The queue pair.
        qp_num: u32,
    },
    /// Migration to the alternate path failed (`IBV_EVENT_PATH_MIG_ERR`).
    PathMigrationError {
        /// The queue pair.
        qp_num: u32,
    },
    /// A QP on an SRQ in ERROR has no more receive WQE in flight
    /// (`IBV_EVENT_QP_LAST_WQE_REACHED`): it may be destroyed.
    QpLastWqeReached {
        /// The queue pair.
        qp_num: u32,
    },
    /// A completion queue failed (`IBV_EVENT_CQ_ERR`, e.g. an overrun):
    /// its completions are lost and its QPs will fail.
    CqError {
        /// The CQ, as [`crate::CompletionQueue::cq_id`].
        cq: u64,
    },
    /// A shared receive queue failed (`IBV_EVENT_SRQ_ERR`).
    SrqError {
        /// The SRQ's identity.
        srq: u64,
    },
    /// An SRQ fell below its armed limit (`IBV_EVENT_SRQ_LIMIT_REACHED`).
    SrqLimitReached {
        /// The SRQ's identity.
        srq: u64,
    },
    /// An event this HAL does not name (`IBV_EVENT_WQ_FATAL`,
    /// `IBV_EVENT_DEVICE_SPEED_CHANGE`, later ones), by its native number.
    Other {
        /// The native `ibv_event_type` value.
        code: u32,
    },
}

impl AsyncEvent {
    /// The native `ibv_event_type` value.
    pub fn code(&self) -> u32 {
        match *self {
            Self::CqError { .. } => 0,
            Self::QpFatal { .. } => 1,
            Self::QpRequestError { .. } => 2,
            Self::QpAccessError { .. } => 3,
            Self::CommunicationEstablished { .. } => 4,
            Self::SendQueueDrained { .. } => 5,
            Self::PathMigrated { .. } => 6,
            Self::PathMigrationError { .. } => 7,
            Self::DeviceFatal => 8,
            Self::PortActive { .. } => 9,
            Self::PortError { .. } => 10,
            Self::LidChange { .. } => 11,
            Self::PkeyChange { .. } => 12,
            Self::SmChange { .. } => 13,
            Self::SrqError { .. } => 14,
            Self::SrqLimitReached { .. } => 15,
            Self::QpLastWqeReached { .. } => 16,
            Self::ClientReregister { .. } => 17,
            Self::GidChange { .. } => 18,
            Self::Other { code } => code,
        }
    }

    /// The event of native type `code`, naming `object`: the QP number for
    /// QP events, the CQ or SRQ identity for theirs, the port for port
    /// events (ignored by [`AsyncEvent::DeviceFatal`]).
    pub fn from_native(code: u32, object: u64) -> Self {
        let qp_num = u32::try_from(object).unwrap_or(u32::MAX);
        let port = u8::try_from(object).unwrap_or(u8::MAX);
        match code {
            0 => Self::CqError { cq: object },
            1 => Self::QpFatal { qp_num },
            2 => Self::QpRequestError { qp_num },
            3 => Self::QpAccessError { qp_num },
            4 => Self::CommunicationEstablished { qp_num },
            5 => Self::SendQueueDrained { qp_num },
            6 => Self::PathMigrated { qp_num },
            7 => Self::PathMigrationError { qp_num },
            8 => Self::DeviceFatal,
            9 => Self::PortActive { port },
            10 => Self::PortError { port },
            11 => Self::LidChange { port },
            12 => Self::PkeyChange { port },
            13 => Self::SmChange { port },
            14 => Self::SrqError { srq: object },
            15 => Self::SrqLimitReached { srq: object },
            16 => Self::QpLastWqeReached { qp_num },
            17 => Self::ClientReregister { port },
            18 => Self::GidChange { port },
            code => Self::Other { code },
        }
    }

    /// What kind of object the native event `code` names.
    pub fn affiliation(code: u32) -> EventAffiliation {
        match code {
            0 => EventAffiliation::Cq,
            1..=7 | 16 => EventAffiliation::Qp,
            14 | 15 => EventAffiliation::Srq,
            9..=13 | 17 | 18 | 20 => EventAffiliation::Port,
            19 => EventAffiliation::Wq,
            _ => EventAffiliation::Device,
        }
    }

    /// The queue pair it names, if it is a QP event.
    pub fn qp_num(&self) -> Option<u32> {
        match *self {
            Self::QpFatal { qp_num }
            | Self::QpRequestError { qp_num }
            | Self::QpAccessError { qp_num }
            | Self::CommunicationEstablished { qp_num }
            | Self::SendQueueDrained { qp_num }
            | Self::PathMigrated { qp_num }
            | Self::PathMigrationError { qp_num }
            | Self::QpLastWqeReached { qp_num } => Some(qp_num),
            _ => None,
        }
    }

    /// The port it names, if it is a port event.
    pub fn port(&self) -> Option<u8> {
        match *self {
            Self::PortActive { port }
            | Self::PortError { port }
            | Self::GidChange { port }
            | Self::ClientReregister { port }
            | Self::LidChange { port }
            | Self::PkeyChange { port }
            | Self::SmChange { port } => Some(port),
            _ => None,
        }
    }
}

/// The object an async event's union names (`struct ibv_async_event`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventAffiliation {
    /// `element.qp`.
    Qp,
    /// `element.cq`.
    Cq,
    /// `element.srq`.
    Srq,
    /// `element.wq`.
    Wq,
    /// `element.port_num`.
    Port,
    /// Nothing: the whole device.
    Device,
}

/// Logical port state (`enum ibv_port_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// No link.
    Down,
    /// Link up, not yet configured.
    Init,
    /// Configured, not yet active.
    Armed,
    /// Ready for traffic.
    Active,
    /// Active, deferring.
    ActiveDefer,
    /// A value this HAL does not name.
    Other(u32),
}

impl PortState {
    /// From the native `ibv_port_state` value.
    pub fn from_native(value: u32) -> Self {
        match value {
            1 => Self::Down,
            2 => Self::Init,
            3 => Self::Armed,
            4 => Self::Active,
            5 => Self::ActiveDefer,
            other => Self::Other(other),
        }
    }
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID.
    InfiniBand,
    /// Ethernet (RoCE): addressed by GID only.
    Ethernet,
    /// Not reported.
    Unspecified,
}

/// Path MTU (`enum ibv_mtu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// From the native value.
    pub fn from_native(value: u32) -> Option<Self> {
        Some(match value {
            1 => Self::Mtu256,
            2 => Self::Mtu512,
            3 => Self::Mtu1024,
            4 => Self::Mtu2048,
            5 => Self::Mtu4096,
            _ => return None,
        })
    }

    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

/// Attributes of one port (the subset of `ibv_port_attr` we use).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAttributes {
    /// Logical state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU in use.
    pub active_mtu: Mtu,
    /// Local identifier (InfiniBand only; 0 on RoCE).
    pub lid: u16,
    /// Entries in the GID table.
    pub gid_table_len: u32,
    /// InfiniBand or Ethernet.
    pub link_layer: LinkLayer,
}

/// A 128-bit global identifier; on RoCE it carries an IP address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The all-zero GID marks an unused table slot.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The GID as an IPv6 address (IPv4 appears as `::ffff:a.b.c.d`).
    pub fn to_ipv6(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.0)
    }

    /// The IP address the GID carries, IPv4 when it is IPv4-mapped.
    pub fn to_ip(&self) -> IpAddr {
        let v6 = self.to_ipv6();
        match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        }
    }

    /// The RoCE GID of an IP address.
    pub fn from_ip(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self(v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => Self(v6.octets()),
        }
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({})", self.to_ipv6())
    }
}

/// How a GID table entry is encapsulated on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    /// InfiniBand.
    Ib,
    /// RoCE v1 (Ethernet, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable): the one to use on Ethernet.
    RoceV2,
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the table: the `sgid_index` of an address vector.
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// Its encapsulation.
    pub gid_type: GidType,
    /// The netdev it belongs to (0 on InfiniBand).
    pub netdev_ifindex: u32,
}

/// Which IP family a RoCE v2 GID should carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressFamily {
    /// IPv4-mapped GIDs.
    V4,
    /// Native IPv6 GIDs (link-local ones are skipped when a global one exists).
    V6,
}

/// Picks the RoCE v2 GID of the requested family, as perftest and NCCL do:
/// the first non-zero RoCE v2 entry of that family, preferring a global
/// IPv6 address over a link-local one.
pub fn select_roce_v2_gid(entries: &[GidEntry], family: AddressFamily) -> Option<&GidEntry> {
    let candidates = entries
        .iter()
        .filter(|e| e.gid_type == GidType::RoceV2 && !e.gid.is_zero());
    match family {
        AddressFamily::V4 => candidates
            .filter(|e| e.gid.to_ip().is_ipv4())
            .min_by_key(|e| e.index),
        AddressFamily::V6 => candidates
            .filter(|e| e.gid.to_ip().is_ipv6())
            // Link-local (fe80::/10) sorts after any routable address.
            .min_by_key(|e| (e.gid.0[0] == 0xfe && (e.gid.0[1] & 0xc0) == 0x80, e.index)),
    }
}

bitflags::bitflags! {
    /// Memory access rights of a registration (`enum ibv_access_flags`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct AccessFlags: u32 {
        /// The local NIC may write (needed for READ targets and receives).
        const LOCAL_WRITE = 1;
        /// Peers may RDMA WRITE into it.
        const REMOTE_WRITE = 1 << 1;
        /// Peers may RDMA READ from it.
        const REMOTE_READ = 1 << 2;
        /// Peers may do atomics on it.
        const REMOTE_ATOMIC = 1 << 3;
        /// Allow relaxed PCIe ordering (a large win for GPU memory on some
        /// platforms; ignored where unsupported).
        const RELAXED_ORDERING = 1 << 20;
    }
}

impl AccessFlags {
    /// Local write plus remote read and write: what a transfer buffer needs.
    pub const fn transfer() -> Self {
        Self::LOCAL_WRITE
            .union(Self::REMOTE_WRITE)
            .union(Self::REMOTE_READ)
    }
}

/// Sizes of a queue pair's work queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive.
    pub max_recv_sge: u32,
    /// Largest inline payload.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        Self {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        }
    }
}

/// Queue pair state (`enum ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Just created.
    Reset,
    /// Initialised: can post receives.
    Init,
    /// Ready to receive.
    ReadyToReceive,
    /// Ready to send.
    ReadyToSend,
    /// Send queue drained.
    SendQueueDrained,
    /// Send queue error.
    SendQueueError,
    /// Error: every outstanding request is flushed.
    Error,
}

impl QpState {
    /// From the native `ibv_qp_state` value.
    pub fn from_native(value: u32) -> Option<Self> {
        Some(match value {
            0 => Self::Reset,
            1 => Self::Init,
            2 => Self::ReadyToReceive,
            3 => Self::ReadyToSend,
            4 => Self::SendQueueDrained,
            5 => Self::SendQueueError,
            6 => Self::Error,
            _ => return None,
        })
    }
}

/// A queue pair's attributes as the device applied them (`ibv_query_qp`):
/// the queue sizes granted and the READ depths after clamping to the
/// device's limits (rxe also rounds them up to a power of two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAttributes {
    /// The current state.
    pub state: QpState,
    /// Queue sizes and inline size as granted.
    pub caps: QpCaps,
    /// READs/atomics we may have outstanding, as applied at RTS (0 before).
    pub max_rd_atomic: u8,
    /// READs/atomics the peer may have outstanding at us, as applied at RTR
    /// (0 before).
    pub max_dest_rd_atomic: u8,
    /// The path MTU set at RTR (`None` before).
    pub path_mtu: Option<Mtu>,
    /// The peer's QP number (0 before RTR).
    pub dest_qp_num: u32,
    /// Our send PSN (set at RTS).
    pub sq_psn: u32,
    /// The PSN we expect first from the peer (set at RTR).
    pub rq_psn: u32,
    /// ACK timeout code (set at RTS).
    pub timeout: u8,
    /// Transport retries (set at RTS).
    pub retry_cnt: u8,
    /// RNR retries (set at RTS).
    pub rnr_retry: u8,
    /// RNR NAK timer code (set at RTR).
    pub min_rnr_timer: u8,
}

/// What one side of an RC connection tells the other (QPN, GID, PSN, ...).
/// This is what rdma_cm exchanges for us, or what a test passes by hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionInfo {
    /// Queue pair number.
    pub qp_num: u32,
    /// First packet sequence number it will send (24 bits).
    pub psn: u32,
    /// Its GID (RoCE) ...
    pub gid: Gid,
    /// ... or LID (InfiniBand).
    pub lid: u16,
    /// Largest MTU it can take.
    pub mtu: Mtu,
}

/// RESET → INIT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitParams {
    /// Port number, from 1.
    pub port: u8,
    /// P_Key index.
    pub pkey_index: u16,
    /// What remote peers may do through this QP.
    pub access: AccessFlags,
}

impl Default for InitParams {
    fn default() -> Self {
        Self {
            port: 1,
            pkey_index: 0,
            access: AccessFlags::transfer(),
        }
    }
}

/// INIT → RTR: the path to the remote side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrParams {
    /// The peer.
    pub remote: ConnectionInfo,
    /// Our port, from 1.
    pub port: u8,
    /// Our GID table index (see [`select_roce_v2_gid`]).
    pub sgid_index: u8,
    /// Path MTU: the smaller of both sides'.
    pub path_mtu: Mtu,
    /// READs/atomics the peer may have outstanding at us.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code (12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// IP hop limit.
    pub hop_limit: u8,
    /// IP traffic class.
    pub traffic_class: u8,
}

impl RtrParams {
    /// Parameters with usual defaults for the given peer.
    pub fn new(remote: ConnectionInfo, sgid_index: u8, local_mtu: Mtu) -> Self {
        Self {
            remote,
            port: 1,
            sgid_index,
            path_mtu: local_mtu.min(remote.mtu),
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            hop_limit: 64,
            traffic_class: 0,
        }
    }
}

/// RTR → RTS: our sending side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsParams {
    /// Our first PSN (24 bits), as told to the peer.
    pub sq_psn: u32,
    /// Local ACK timeout code: 4.096 µs × 2^timeout, 1..=31. 0 is refused:
    /// it means "no timer", so a lost packet or a dead peer is retried
    /// forever, as with `retry_cnt` 7.
    pub timeout: u8,
    /// Transport retries, 0..=6. 7 is refused: rxe then retries forever and
    /// a dead peer never surfaces as an error.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite, which is fine: RNR means a live peer).
    pub rnr_retry: u8,
    /// READs/atomics we may have outstanding.
    pub max_rd_atomic: u8,
}

impl Default for RtsParams {
    fn default() -> Self {
        Self {
            sq_psn: 0,
            // 4.096 µs × 2^14 ≈ 67 ms per try: with 3 retries a dead peer
            // is reported within about a quarter second on real NICs.
            timeout: 14,
            retry_cnt: 3,
            rnr_retry: 7,
            max_rd_atomic: 16,
        }
    }
}

impl RtsParams {
    /// Rejects values that would hide a dead peer or overflow the fields.
    pub fn validate(&self) -> Result<()> {
        if self.retry_cnt > 6 {
            return Err(VerbsError::invalid(
                "ibv_modify_qp(RTS)",
                format!(
                    "retry_cnt {} would retry forever on some providers; use 0..=6",
                    self.retry_cnt
                ),
            ));
        }
        if self.timeout == 0 {
            return Err(VerbsError::invalid(
                "ibv_modify_qp(RTS)",
                "ACK timeout 0 disables the transport timer (a dead peer is never \
                 reported); use 1..=31",
            ));
        }
        if self.timeout > 31 || self.rnr_retry > 7 || self.sq_psn > 0x00ff_ffff {
            return Err(VerbsError::invalid(
                "ibv_modify_qp(RTS)",
                format!("field out of range in {self:?}"),
            ));
        }
        Ok(())
    }
}

/// A scatter/gather element: `length` bytes at `addr` under `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Address in the MR's address space (its iova).
    pub addr: u64,
    /// Bytes.
    pub length: u32,
    /// The local key of the MR covering it.
    pub lkey: u32,
}

/// A scatter/gather list; two entries fit without allocating.
pub type SgList = SmallVec<[Sge; 2]>;

/// The operation of a send-queue work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// One-sided write into remote memory.
    Write {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// Write plus a 32-bit immediate that consumes a receive at the peer.
    WriteWithImm {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data (host order).
        imm: u32,
    },
    /// One-sided read from remote memory into the local SG list.
    Read {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// Two-sided send, consuming a receive at the peer.
    Send,
    /// Send with a 32-bit immediate.
    SendWithImm {
        /// Immediate data (host order).
        imm: u32,
    },
}

bitflags::bitflags! {
    /// Per-request flags (`enum ibv_send_flags`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SendFlags: u32 {
        /// Wait for earlier READs to finish first.
        const FENCE = 1;
        /// Produce a completion (selective signalling).
        const SIGNALED = 1 << 1;
        /// Solicited event at the receiver.
        const SOLICITED = 1 << 2;
        /// Copy the payload into the WQE; host memory only, never GPU memory
        /// (the CPU would read device memory through the BAR, or fault on a
        /// dma-buf MR's iova). The backend refuses it for a SG entry whose
        /// lkey is a dma-buf MR's, for a READ, and above the QP's granted
        /// `max_inline_data`; over peermem (a GPU virtual address) only the
        /// layers above know the memory's kind and must not set it.
        const INLINE = 1 << 3;
    }
}

/// One send-queue work request. A batch of them is linked and posted once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendRequest {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local memory.
    pub sg_list: SgList,
    /// Signalling, fencing, inline.
    pub flags: SendFlags,
}

impl SendRequest {
    /// Total bytes of the SG list.
    pub fn byte_len(&self) -> u64 {
        self.sg_list.iter().map(|s| u64::from(s.length)).sum()
    }
}

/// One receive-queue work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvRequest {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND lands.
    pub sg_list: SgList,
}

/// Completion status (`enum ibv_wc_status`), kept as the native number so
/// nothing a provider reports is lost; named constants for the known values.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WcStatus(pub u32);

impl WcStatus {
    /// Success.
    pub const SUCCESS: Self = Self(0);
    /// Local length error.
    pub const LOC_LEN_ERR: Self = Self(1);
    /// Local QP operation error.
    pub const LOC_QP_OP_ERR: Self = Self(2);
    /// Local protection error (bad lkey or range).
    pub const LOC_PROT_ERR: Self = Self(4);
    /// Flushed: the QP went to the error state before this ran.
    pub const WR_FLUSH_ERR: Self = Self(5);
    /// Bad response.
    pub const BAD_RESP_ERR: Self = Self(7);
    /// Local access error.
    pub const LOC_ACCESS_ERR: Self = Self(8);
    /// Remote invalid request (e.g. READ larger than allowed).
    pub const REM_INV_REQ_ERR: Self = Self(9);
    /// Remote access error: bad rkey, out of the MR's bounds, or no right.
    pub const REM_ACCESS_ERR: Self = Self(10);
    /// Remote operation error.
    pub const REM_OP_ERR: Self = Self(11);
    /// Transport retries exhausted: the peer is gone or unreachable.
    pub const RETRY_EXC_ERR: Self = Self(12);
    /// RNR retries exhausted: the peer posted no receive.
    pub const RNR_RETRY_EXC_ERR: Self = Self(13);
    /// Fatal error.
    pub const FATAL_ERR: Self = Self(19);
    /// Response timeout.
    pub const RESP_TIMEOUT_ERR: Self = Self(20);
    /// General error.
    pub const GENERAL_ERR: Self = Self(21);

    /// True for success.
    pub fn is_success(self) -> bool {
        self == Self::SUCCESS
    }

    /// The name rdma-core's `ibv_wc_status_str` would give.
    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "success",
            1 => "local length error",
            2 => "local QP operation error",
            3 => "local EE context operation error",
            4 => "local protection error",
            5 => "Work Request Flushed Error",
            6 => "memory management operation error",
            7 => "bad response error",
            8 => "local access error",
            9 => "remote invalid request error",
            10 => "remote access error",
            11 => "remote operation error",
            12 => "transport retry counter exceeded",
            13 => "RNR retry counter exceeded",
            14 => "local RDD violation error",
            15 => "remote invalid RD request",
            16 => "aborted error",
            17 => "invalid EE context number",
            18 => "invalid EE context state",
            19 => "fatal error",
            20 => "response timeout error",
            21 => "general error",
            _ => "unknown",
        }
    }
}

impl fmt::Debug for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WcStatus({}: {})", self.0, self.name())
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (status {})", self.name(), self.0)
    }
}

/// What a completion completed (`enum ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WcOpcode {
    /// A SEND.
    #[default]
    Send,
    /// An RDMA WRITE (with or without immediate).
    RdmaWrite,
    /// An RDMA READ.
    RdmaRead,
    /// A received SEND.
    Recv,
    /// A received WRITE with immediate.
    RecvRdmaWithImm,
    /// A value this HAL does not name.
    Other(u32),
}

impl WcOpcode {
    /// From the native value.
    pub fn from_native(value: u32) -> Self {
        match value {
            0 => Self::Send,
            1 => Self::RdmaWrite,
            2 => Self::RdmaRead,
            128 => Self::Recv,
            129 => Self::RecvRdmaWithImm,
            other => Self::Other(other),
        }
    }
}

/// Largest private data a connect request carries: the REQ's 56 bytes under
/// rdma_cm's TCP port space, less the one length byte this HAL frames with.
pub const MAX_CONNECT_PRIVATE_DATA: usize = 55;
/// Largest private data an accept carries: the REP's 196 bytes, less the
/// length byte.
pub const MAX_ACCEPT_PRIVATE_DATA: usize = 195;
/// Largest private data a reject carries: the REJ's 148 bytes, less the
/// length byte.
pub const MAX_REJECT_PRIVATE_DATA: usize = 147;

/// How one side of a connection-managed RC queue pair is set up, on
/// [`crate::ConnectionManager::connect`] and [`crate::ConnectRequest::accept`].
///
/// The connection manager drives the queue pair through INIT, RTR and RTS
/// itself with the path it resolved (port, GID index, MTU, PSNs); these are
/// the knobs left to the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectParams {
    /// Queue sizes of the queue pair created for the connection.
    pub caps: QpCaps,
    /// What the peer may do through the queue pair (remote READ/WRITE).
    pub access: AccessFlags,
    /// READs/atomics the peer may have outstanding at us
    /// (`max_dest_rd_atomic`); on accept, lowered to the requester's
    /// initiator depth.
    pub responder_resources: u8,
    /// READs/atomics we may have outstanding (`max_rd_atomic`); on accept,
    /// lowered to the requester's responder resources.
    pub initiator_depth: u8,
    /// Transport retries, 0..=6. 7 is refused: rxe then retries forever and
    /// a dead peer never surfaces as an error.
    pub retry_count: u8,
    /// RNR retries (7 = infinite, which is fine: RNR means a live peer).
    pub rnr_retry_count: u8,
    /// Local ACK timeout code (4.096 µs × 2^n) put into the queue pair at
    /// RTS; `None` keeps the one the connection manager derives from the
    /// path (19, 2.1 s a try, on rxe). `Some(0)` is refused: 0 disables the
    /// timer (infinite retry, like `retry_count` 7). The default, 14 (~67 ms a try), is
    /// [`RtsParams`]'s. Measured between two SoftRoCE guests with
    /// `retry_count` 3: a killed peer surfaces as status 12 (retry exceeded)
    /// 0.27 s after the last success with 14, 9.3 s with rdma_cm's 19; and
    /// since a packet lost on the wire costs one timeout, 1 MiB READ + WRITE
    /// + READ took 0.99 s with 14 and 4.1 s with 19.
    pub ack_timeout: Option<u8>,
    /// Connect only: the local address to connect from, which picks the
    /// device; `None` lets the routing table pick.
    pub source: Option<IpAddr>,
    /// Bound on the whole operation: address and route resolution, the
    /// handshake, and on connect every retry while the peer is not yet
    /// listening.
    pub timeout: Duration,
}

impl Default for ConnectParams {
    fn default() -> Self {
        Self {
            caps: QpCaps::default(),
            access: AccessFlags::transfer(),
            responder_resources: 16,
            initiator_depth: 16,
            retry_count: 3,
            rnr_retry_count: 7,
            ack_timeout: Some(14),
            source: None,
            timeout: Duration::from_secs(10),
        }
    }
}

impl ConnectParams {
    /// Rejects values that would hide a dead peer or overflow the fields,
    /// and private data over `max_private_data` bytes.
    pub fn validate(
        &self,
        operation: &'static str,
        private_data: &[u8],
        max_private_data: usize,
    ) -> Result<()> {
        if self.retry_count > 6 {
            return Err(VerbsError::invalid(
                operation,
                format!(
                    "retry_count {} would retry forever on some providers; use 0..=6",
                    self.retry_count
                ),
            ));
        }
        if self.ack_timeout == Some(0) {
            return Err(VerbsError::invalid(
                operation,
                "ACK timeout 0 disables the transport timer (a dead peer is never \
                 reported); use 1..=31 or None",
            ));
        }
        if self.rnr_retry_count > 7 || self.ack_timeout.is_some_and(|t| t > 31) {
            return Err(VerbsError::invalid(
                operation,
                format!("field out of range in {self:?}"),
            ));
        }
        if private_data.len() > max_private_data {
            return Err(VerbsError::invalid(
                operation,
                format!(
                    "{} bytes of private data; at most {max_private_data} fit",
                    private_data.len()
                ),
            ));
        }
        Ok(())
    }
}

/// Where a connection stands, as its events last said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionState {
    /// Established: the queue pair is in RTS.
    Connected,
    /// Disconnected, by us or by the peer: the queue pair is in ERROR and
    /// its outstanding requests flush.
    Disconnected,
    /// The device went away under the connection.
    DeviceRemoved,
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Completion {
    /// The request's `wr_id`.
    pub wr_id: u64,
    /// Native status.
    pub status: WcStatus,
    /// What completed. Only meaningful on success for send-queue entries.
    pub opcode: WcOpcode,
    /// Bytes received (receives only).
    pub byte_len: u32,
    /// Immediate data, if any (host order).
    pub imm: Option<u32>,
    /// The local QP it belongs to.
    pub qp_num: u32,
    /// Vendor syndrome, for error reports.
    pub vendor_err: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn entry(index: u32, ip: IpAddr, gid_type: GidType) -> GidEntry {
        GidEntry {
            index,
            gid: Gid::from_ip(ip),
            gid_type,
            netdev_ifindex: 2,
        }
    }

    #[test]
    fn roce_v2_gid_selection_by_family() {
        let v4 = IpAddr::V4(Ipv4Addr::new(10, 99, 0, 1));
        let link_local: IpAddr = "fe80::1".parse().unwrap();
        let global: IpAddr = "2001:db8::7".parse().unwrap();
        let table = vec![
            entry(0, link_local, GidType::RoceV1),
            entry(1, link_local, GidType::RoceV2),
            entry(2, v4, GidType::RoceV1),
            entry(3, v4, GidType::RoceV2),
            GidEntry {
                index: 4,
                gid: Gid::default(),
                gid_type: GidType::RoceV2,
                netdev_ifindex: 0,
            },
            entry(5, global, GidType::RoceV2),
        ];
        let picked = select_roce_v2_gid(&table, AddressFamily::V4).unwrap();
        assert_eq!(picked.index, 3);
        assert_eq!(picked.gid.to_ip(), v4);
        let picked = select_roce_v2_gid(&table, AddressFamily::V6).unwrap();
        assert_eq!(picked.index, 5, "a global IPv6 GID beats a link-local one");
        assert!(select_roce_v2_gid(&table[..3], AddressFamily::V4).is_none());
    }

    #[test]
    fn pci_bus_ids_are_checked() {
        assert!(is_pci_bus_id("0000:17:00.0"));
        assert!(is_pci_bus_id("0000:af:1f.7"));
        assert!(!is_pci_bus_id("0000:17:00.8"));
        assert!(!is_pci_bus_id("17:00.0"));
        assert!(!is_pci_bus_id("0000:17:00.0/"));
        assert!(!is_pci_bus_id("uverbs0"));
    }

    #[test]
    fn rts_refuses_infinite_retry() {
        let mut p = RtsParams::default();
        assert!(p.validate().is_ok());
        p.retry_cnt = 7;
        let err = p.validate().unwrap_err();
        assert!(err.to_string().contains("retry forever"), "{err}");
        p.retry_cnt = 3;
        p.sq_psn = 1 << 24;
        assert!(p.validate().is_err());
        p.sq_psn = 0;
        p.timeout = 0;
        let err = p.validate().unwrap_err();
        assert!(err.to_string().contains("ACK timeout 0"), "{err}");
        p.timeout = 1;
        assert!(p.validate().is_ok());
    }

    #[test]
    fn connect_params_refuse_infinite_retry() {
        let mut p = ConnectParams::default();
        assert!(p.validate("rdma_connect", &[], 55).is_ok());
        p.ack_timeout = None;
        assert!(p.validate("rdma_connect", &[], 55).is_ok());
        p.ack_timeout = Some(0);
        let err = p.validate("rdma_connect", &[], 55).unwrap_err();
        assert!(err.to_string().contains("ACK timeout 0"), "{err}");
        p.ack_timeout = Some(14);
        p.retry_count = 7;
        assert!(p.validate("rdma_connect", &[], 55).is_err());
    }

    #[test]
    fn mtu_and_status_values_match_verbs_h() {
        assert_eq!(Mtu::Mtu1024.bytes(), 1024);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::from_native(5), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::from_native(6), None);
        assert_eq!(WcStatus::REM_ACCESS_ERR.0, 10);
        assert_eq!(
            WcStatus::RETRY_EXC_ERR.name(),
            "transport retry counter exceeded"
        );
        assert_eq!(WcOpcode::from_native(129), WcOpcode::RecvRdmaWithImm);
        assert_eq!(AccessFlags::transfer().bits(), 0b111);
    }

    #[test]
    fn async_events_round_trip_their_native_codes() {
        for code in 0..=24 {
            let object = 7;
            let event = AsyncEvent::from_native(code, object);
            assert_eq!(event.code(), code, "{event:?}");
            match AsyncEvent::affiliation(code) {
                EventAffiliation::Qp => assert_eq!(event.qp_num(), Some(7), "{event:?}"),
                EventAffiliation::Port if code <= 18 => {
                    assert_eq!(event.port(), Some(7), "{event:?}")
                }
                _ => assert_eq!((event.qp_num(), event.port()), (None, None), "{event:?}"),
            }
        }
        assert_eq!(AsyncEvent::from_native(8, 123), AsyncEvent::DeviceFatal);
        assert_eq!(
            AsyncEvent::from_native(0, 0xdead_beef),
            AsyncEvent::CqError { cq: 0xdead_beef }
        );
        assert_eq!(
            AsyncEvent::from_native(20, 1),
            AsyncEvent::Other { code: 20 },
            "DEVICE_SPEED_CHANGE is not named"
        );
    }
}
