//! Set-up shared by the simulator's tests: nodes on a `SimFabric` and what
//! a side tells its peer.

use gdr_sim::{DeviceConfig, NodeConfig, SimContext, SimFabric, SimMr, SimPd, SimQp, SimVerbs};
use hal_verbs::{
    AccessFlags, AddressFamily, ConnectionInfo, Context, MemoryRegion, ProtectionDomain, QueuePair,
    SendOp, Sge, select_roce_v2_gid,
};

/// Adds node `name` to `fabric` with one device, `device` (no IPv4
/// address of its own).
pub fn add_node(fabric: &SimFabric, name: &str, device: DeviceConfig) -> SimVerbs {
    fabric.add_node(
        name,
        NodeConfig {
            ipv4: None,
            devices: vec![device],
        },
    )
}

/// What `qp` of `ctx` tells its peer (port 1, its RoCE v2 IPv4 GID: the
/// sim always has one), and the GID index it sends from.
pub fn info(ctx: &SimContext, qp: &SimQp, psn: u32) -> (ConnectionInfo, u8) {
    let port = ctx.query_port(1).unwrap();
    let table = ctx.gid_table(1).unwrap();
    let gid = select_roce_v2_gid(&table, AddressFamily::V4).expect("a RoCE v2 IPv4 GID");
    crate::pair::port_info(&port, gid, qp.qp_num(), psn)
}

/// Zeroed host memory and its registration (deregistered before it is
/// freed: field order).
#[derive(Debug)]
pub struct Buf {
    /// The registration.
    pub mr: SimMr,
    /// The memory.
    pub data: Box<[u8]>,
}

impl Buf {
    /// `len` zeroed bytes registered in `pd` with `access`.
    pub fn new(pd: &SimPd, len: usize, access: AccessFlags) -> Self {
        let mut data = vec![0u8; len].into_boxed_slice();
        // SAFETY: the box outlives the registration (field order drops the
        // MR first) and is never reallocated.
        let mr = unsafe { pd.register(data.as_mut_ptr() as u64, len, access) }.unwrap();
        Self { mr, data }
    }

    /// The address `offset` bytes in.
    pub fn addr(&self, offset: usize) -> u64 {
        self.mr.addr() + offset as u64
    }

    /// `len` bytes from `offset`.
    pub fn sge(&self, offset: usize, len: usize) -> Sge {
        Sge {
            addr: self.addr(offset),
            length: len as u32,
            lkey: self.mr.lkey(),
        }
    }

    /// All of it.
    pub fn whole(&self) -> Sge {
        self.sge(0, self.data.len())
    }

    /// A WRITE to it (from its start).
    pub fn write_op(&self) -> SendOp {
        SendOp::Write {
            remote_addr: self.mr.addr(),
            rkey: self.mr.rkey(),
        }
    }

    /// A READ of it (from its start).
    pub fn read_op(&self) -> SendOp {
        SendOp::Read {
            remote_addr: self.mr.addr(),
            rkey: self.mr.rkey(),
        }
    }
}
