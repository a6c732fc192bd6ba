//! The fast path allocates nothing per request: a post of WRITEs that
//! completes at once, and the poll of its completion, make no heap
//! allocation in the steady state. A simulated NIC that allocated per
//! request would add the process allocator's locks between threads that
//! share nothing on a real NIC (glibc's arena locks: seen as threads
//! waiting in `free` on the 16-core machine's scaling benchmark).
//!
//! This binary's global allocator counts what the calling thread
//! allocates (`gdr_tests::alloc_count`).

use hal_verbs::{
    AccessFlags, AddressFamily, Completion, CompletionQueue as _, ConnectionInfo, Context as _,
    InitParams, MemoryRegion as _, ProtectionDomain as _, Provider as _, QpCaps, QueuePair as _,
    RtrParams, RtsParams, SendFlags, SendOp, SendRequest, Sge, select_roce_v2_gid,
};

use gdr_sim::{NodeConfig, SimCq, SimFabric, SimMr, SimPd, SimQp};
use gdr_tests::alloc_count::{Counting, allocations_in};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

struct End {
    pd: SimPd,
    cq: SimCq,
    qp: SimQp,
    info: (ConnectionInfo, u8),
}

fn end(fabric: &SimFabric, name: &str) -> End {
    let ctx = fabric
        .add_node(name, NodeConfig::default())
        .open("sim0")
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let caps = QpCaps {
        max_send_wr: 64,
        ..QpCaps::default()
    };
    let qp = pd.create_qp(&caps, &cq, &cq).unwrap();
    let table = ctx.gid_table(1).unwrap();
    let gid = select_roce_v2_gid(&table, AddressFamily::V4).unwrap();
    let info = ConnectionInfo {
        qp_num: qp.qp_num(),
        psn: 0,
        gid: gid.gid,
        lid: 0,
        mtu: ctx.query_port(1).unwrap().active_mtu,
    };
    End {
        pd,
        cq,
        qp,
        info: (info, gid.index as u8),
    }
}

fn connect(a: &End, b: &End) {
    for (e, (remote, _), (_, sgid)) in [(a, b.info, a.info), (b, a.info, b.info)] {
        e.qp.to_init(&InitParams::default()).unwrap();
        e.qp.to_rtr(&RtrParams::new(remote, sgid, remote.mtu))
            .unwrap();
        e.qp.to_rts(&RtsParams::default()).unwrap();
    }
}

fn register(pd: &SimPd, memory: &mut [u8]) -> SimMr {
    // SAFETY: every caller's memory outlives its registration (dropped
    // first at the end of the test).
    unsafe {
        pd.register(
            memory.as_mut_ptr() as u64,
            memory.len(),
            AccessFlags::transfer(),
        )
    }
    .unwrap()
}

#[test]
fn a_post_of_writes_and_the_poll_of_its_completion_allocate_nothing() {
    const BATCH: usize = 16;
    const SIZE: usize = 4096;
    let fabric = SimFabric::new();
    let (a, b) = (end(&fabric, "a"), end(&fabric, "b"));
    connect(&a, &b);
    let mut src = vec![0x5au8; BATCH * SIZE];
    let mut dst = vec![0u8; BATCH * SIZE];
    let (src_mr, dst_mr) = (register(&a.pd, &mut src), register(&b.pd, &mut dst));
    // One linked post, the last request signalled: the bare loop's batch.
    let batch: Vec<SendRequest> = (0..BATCH)
        .map(|i| SendRequest {
            wr_id: i as u64,
            op: SendOp::Write {
                remote_addr: dst_mr.addr() + (i * SIZE) as u64,
                rkey: dst_mr.rkey(),
            },
            sg_list: [Sge {
                addr: src_mr.addr() + (i * SIZE) as u64,
                length: SIZE as u32,
                lkey: src_mr.lkey(),
            }]
            .into_iter()
            .collect(),
            flags: if i + 1 == BATCH {
                SendFlags::SIGNALED
            } else {
                SendFlags::empty()
            },
        })
        .collect();
    let mut slot = [Completion::default()];
    let mut round = || {
        // SAFETY: `src` and `dst` outlive their registrations.
        unsafe { a.qp.post_send(&batch) }.unwrap();
        assert_eq!(
            a.cq.poll(&mut slot).unwrap(),
            1,
            "the batch completed in its post"
        );
        assert_eq!(slot[0].wr_id, (BATCH - 1) as u64);
    };
    // Warm-up: the CQ's ring and any first-use state grow here.
    for _ in 0..4 {
        round();
    }
    const ROUNDS: u64 = 100;
    let (made, ()) = allocations_in(|| {
        for _ in 0..ROUNDS {
            round();
        }
    });
    assert_eq!(
        made, 0,
        "{made} allocations over {ROUNDS} posts of {BATCH} WRITEs and their polls"
    );
    assert_eq!(dst, src, "the bytes landed");
    drop((src_mr, dst_mr));
    drop((b.qp, b.cq, a.qp, a.cq));
}
