//! Set-up shared by the simulator's tests: nodes on a `SimFabric` and what
//! a side tells its peer.

use gdr_sim::{DeviceConfig, NodeConfig, SimContext, SimFabric, SimQp, SimVerbs};
use hal_verbs::{AddressFamily, ConnectionInfo, Context, QueuePair, select_roce_v2_gid};

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
