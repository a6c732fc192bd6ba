//! Transfers that succeed: bytes, completions, ordering, signalling.

use hal_verbs::{
    AccessFlags, MemoryRegion, QpCaps, QueuePair, SendFlags, SendOp, Sge, VerbsError, WcOpcode,
    WcStatus,
};

use crate::pair::{Backend, Pair, PairConfig, connect, ids_and_status, recv, req};
use crate::pattern;

const SIG: SendFlags = SendFlags::SIGNALED;
const NONE: SendFlags = SendFlags::empty();

/// WRITE then READ of sizes from 1 byte to 64 KiB + 3, at an offset: the
/// payload lands exactly, the bytes around it are untouched, the
/// completions name the request, its opcode and the QP.
pub fn write_and_read_move_bytes_exactly<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let access = AccessFlags::transfer();
    for (i, size) in [1usize, 7, 4096, 65_536 + 3].into_iter().enumerate() {
        let seed = 10 + i as u8;
        let src = p.a.buf(size + 32, seed, access);
        let dst = p.b.buf(size + 32, seed + 100, access);
        let (s0, d0) = (src.bytes(), dst.bytes());
        Pair::<B::A>::post(
            &p.qa,
            &[req(
                10 + i as u64,
                dst.write_op(16),
                &[src.sge(0, size)],
                SIG,
            )],
        );
        let wc = p.expect(&p.cqa, 1, "WRITE")[0];
        assert_eq!(wc.status, WcStatus::SUCCESS, "{wc:?}");
        assert_eq!(
            (wc.wr_id, wc.opcode, wc.qp_num),
            (10 + i as u64, WcOpcode::RdmaWrite, p.qa.qp_num())
        );
        let d1 = dst.bytes();
        assert!(d1[16..16 + size] == s0[..size], "{size}: WRITE payload");
        assert!(d1[..16] == d0[..16], "{size}: WRITE before its range");
        assert!(
            d1[16 + size..] == d0[16 + size..],
            "{size}: WRITE past its range"
        );
        p.quiet(&p.cqb, "a WRITE completes nothing at the responder");

        // READ it back into a fresh buffer, at an offset.
        let back = p.a.buf(size + 8, seed + 50, access);
        let b0 = back.bytes();
        Pair::<B::A>::post(
            &p.qa,
            &[req(20, dst.read_op(16), &[back.sge(4, size)], SIG)],
        );
        let wc = p.expect(&p.cqa, 1, "READ")[0];
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode),
            (20, WcStatus::SUCCESS, WcOpcode::RdmaRead)
        );
        let b1 = back.bytes();
        assert!(b1[4..4 + size] == s0[..size], "{size}: READ payload");
        assert!(
            b1[..4] == b0[..4] && b1[4 + size..] == b0[4 + size..],
            "{size}: READ outside its range"
        );
    }
}

/// A WRITE gathers its SG entries in order; a READ scatters in order.
pub fn multi_sge_gathers_and_scatters_in_order<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let access = AccessFlags::transfer();
    let src = p.a.buf(1000, 3, access);
    let s = src.bytes();
    let dst = p.b.buf(600, 4, access);
    let sges = [src.sge(500, 100), src.sge(0, 300), src.sge(800, 200)];
    Pair::<B::A>::post(&p.qa, &[req(1, dst.write_op(0), &sges, SIG)]);
    assert!(p.expect(&p.cqa, 1, "WRITE")[0].status.is_success());
    let want = [&s[500..600], &s[..300], &s[800..]].concat();
    assert!(dst.bytes() == want, "gathered WRITE");

    let back = p.a.buf(600, 5, access);
    Pair::<B::A>::post(
        &p.qa,
        &[req(
            2,
            dst.read_op(0),
            &[back.sge(400, 200), back.sge(0, 400)],
            SIG,
        )],
    );
    assert!(p.expect(&p.cqa, 1, "READ")[0].status.is_success());
    let got = back.bytes();
    assert!(got[400..] == want[..200], "first READ piece");
    assert!(got[..400] == want[200..], "second READ piece");
}

/// SEND with an immediate scatters over a two-entry receive; the receive
/// completion says its length and immediate; a plain SEND carries none.
pub fn send_recv_with_and_without_immediate<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let access = AccessFlags::transfer();
    let src = p.a.buf(300, 5, access);
    let s = src.bytes();
    let inbox = p.b.buf(400, 6, access);
    let i0 = inbox.bytes();
    Pair::<B::A>::post_recv(
        &p.qb,
        &[recv(50, &[inbox.sge(200, 100), inbox.sge(0, 200)])],
    );
    let sges = [src.sge(0, 100), src.sge(150, 150)];
    Pair::<B::A>::post(
        &p.qa,
        &[req(1, SendOp::SendWithImm { imm: 0xfeed_f00d }, &sges, SIG)],
    );
    let wc = p.expect(&p.cqa, 1, "SEND")[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (1, WcStatus::SUCCESS, WcOpcode::Send)
    );
    let wc = p.expect(&p.cqb, 1, "receive")[0];
    assert_eq!(wc.status, WcStatus::SUCCESS, "{wc:?}");
    assert_eq!(
        (wc.wr_id, wc.opcode, wc.byte_len, wc.imm, wc.qp_num),
        (50, WcOpcode::Recv, 250, Some(0xfeed_f00d), p.qb.qp_num())
    );
    let sent = [&s[..100], &s[150..]].concat();
    let got = inbox.bytes();
    assert!(got[200..300] == sent[..100], "first receive piece");
    assert!(got[..150] == sent[100..], "second receive piece");
    assert!(
        got[150..200] == i0[150..200] && got[300..] == i0[300..],
        "bytes outside the message"
    );

    Pair::<B::A>::post_recv(&p.qb, &[recv(51, &[inbox.sge(0, 400)])]);
    Pair::<B::A>::post(&p.qa, &[req(2, SendOp::Send, &[src.sge(0, 10)], SIG)]);
    p.expect(&p.cqa, 1, "SEND");
    let wc = p.expect(&p.cqb, 1, "receive")[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm),
        (51, WcStatus::SUCCESS, WcOpcode::Recv, 10, None)
    );
}

/// WRITE with immediate: the bytes land at the remote address and a
/// receive (with no SG entry) is consumed, reporting the length and
/// immediate.
pub fn write_with_immediate_consumes_a_receive<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let access = AccessFlags::transfer();
    let src = p.a.buf(128, 6, access);
    let dst = p.b.buf(256, 7, access);
    Pair::<B::A>::post_recv(&p.qb, &[recv(60, &[])]);
    let op = SendOp::WriteWithImm {
        remote_addr: dst.addr(64),
        rkey: dst.mr.rkey(),
        imm: 42,
    };
    Pair::<B::A>::post(&p.qa, &[req(3, op, &[src.sge(0, 128)], SIG)]);
    let wc = p.expect(&p.cqa, 1, "WRITE with immediate")[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (3, WcStatus::SUCCESS, WcOpcode::RdmaWrite)
    );
    let wc = p.expect(&p.cqb, 1, "receive")[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm),
        (
            60,
            WcStatus::SUCCESS,
            WcOpcode::RecvRdmaWithImm,
            128,
            Some(42)
        )
    );
    assert!(dst.bytes()[64..192] == src.bytes()[..], "payload");
}

/// One linked batch (a two-entry WRITE, a WRITE, a READ, two SENDs and a
/// signalled WRITE with immediate) with only the last signalled: RC
/// completes send-queue entries in order, so its completion means all are
/// done, the READ included.
pub fn linked_batch_with_selective_signalling<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let access = AccessFlags::transfer();
    let buf_a = p.a.buf(64 << 10, 3, access);
    let buf_b = p.b.buf(64 << 10, 4, access);
    let inbox = p.b.buf(3 * 4096, 5, AccessFlags::LOCAL_WRITE);
    let (a0, b0) = (buf_a.bytes(), buf_b.bytes());
    let recvs: Vec<_> = (0..3)
        .map(|i| recv(100 + i as u64, &[inbox.sge(i * 4096, 4096)]))
        .collect();
    Pair::<B::A>::post_recv(&p.qb, &recvs);
    let batch = [
        req(
            1,
            buf_b.write_op(0),
            &[buf_a.sge(0, 1000), buf_a.sge(5000, 500)],
            NONE,
        ),
        req(2, buf_b.write_op(8192), &[buf_a.sge(8192, 4096)], NONE),
        req(3, buf_b.read_op(16384), &[buf_a.sge(32768, 4096)], NONE),
        req(4, SendOp::Send, &[buf_a.sge(40960, 100)], NONE),
        req(
            5,
            SendOp::SendWithImm { imm: 0x0102_0304 },
            &[buf_a.sge(41060, 200)],
            NONE,
        ),
        req(
            6,
            SendOp::WriteWithImm {
                remote_addr: buf_b.addr(24576),
                rkey: buf_b.mr.rkey(),
                imm: 0xdead_beef,
            },
            &[buf_a.sge(49152, 777)],
            SIG,
        ),
    ];
    Pair::<B::A>::post(&p.qa, &batch);
    let sent = p.expect(&p.cqa, 1, "unsignalled requests");
    assert_eq!(
        (sent[0].wr_id, sent[0].status, sent[0].opcode),
        (6, WcStatus::SUCCESS, WcOpcode::RdmaWrite)
    );
    let recvd = p.expect(&p.cqb, 3, "receives");
    assert_eq!(
        recvd
            .iter()
            .map(|c| (c.wr_id, c.status, c.opcode, c.byte_len, c.imm))
            .collect::<Vec<_>>(),
        [
            (100, WcStatus::SUCCESS, WcOpcode::Recv, 100, None),
            (
                101,
                WcStatus::SUCCESS,
                WcOpcode::Recv,
                200,
                Some(0x0102_0304)
            ),
            (
                102,
                WcStatus::SUCCESS,
                WcOpcode::RecvRdmaWithImm,
                777,
                Some(0xdead_beef)
            ),
        ]
    );
    let mut expect_b = b0.clone();
    expect_b[..1000].copy_from_slice(&a0[..1000]);
    expect_b[1000..1500].copy_from_slice(&a0[5000..5500]);
    expect_b[8192..12288].copy_from_slice(&a0[8192..12288]);
    expect_b[24576..24576 + 777].copy_from_slice(&a0[49152..49152 + 777]);
    assert!(buf_b.bytes() == expect_b, "remote buffer after the writes");
    let mut expect_a = a0.clone();
    expect_a[32768..36864].copy_from_slice(&b0[16384..20480]);
    assert!(buf_a.bytes() == expect_a, "local buffer after the read");
    let r = inbox.bytes();
    assert!(r[..100] == a0[40960..41060], "first SEND payload");
    assert!(r[4096..4296] == a0[41060..41260], "second SEND payload");
}

/// A pair whose QPs ask for a send queue of 8.
fn shallow_send_queue<B: Backend>(b: &B) -> Pair<B::A> {
    let caps = QpCaps {
        max_send_wr: 8,
        ..QpCaps::default()
    };
    Pair::with(
        b,
        PairConfig {
            caps,
            ..PairConfig::default()
        },
    )
}

/// A batch deeper than the send queue: the queue takes a prefix (at least
/// the depth asked for; a device may grant more), the error says how many
/// and that the send queue is full, and exactly that prefix completes, in
/// order.
pub fn post_beyond_the_queue_reports_the_accepted_prefix<B: Backend>(b: &B) {
    let p = shallow_send_queue(b);
    let access = AccessFlags::transfer();
    let src = p.a.buf(4096, 6, access);
    let dst = p.b.buf(4096, 7, access);
    let depth = p.qa.caps().max_send_wr as usize;
    assert!(depth >= 8, "granted {:?}", p.qa.caps());
    let n = depth + 8;
    let batch: Vec<_> = (0..n)
        .map(|i| {
            let off = (i % 64) * 64;
            req(i as u64, dst.write_op(off), &[src.sge(off, 64)], SIG)
        })
        .collect();
    let err = Pair::<B::A>::try_post(&p.qa, &batch).expect_err("a batch deeper than the queue");
    let accepted = err
        .accepted()
        .expect("the failing request is one of the batch");
    assert!(
        (depth..n).contains(&accepted),
        "accepted {accepted} of {n}, depth {depth}: {err}"
    );
    assert!(
        matches!(err.error, VerbsError::QueueFull { queue: "send", .. }),
        "{err}"
    );
    let done = p.expect(&p.cqa, accepted, "requests not accepted");
    for (i, c) in done.iter().enumerate() {
        assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::SUCCESS), "{c:?}");
    }
}

/// INLINE copies the payload at post time (the lkey is not used): the
/// buffer may be reused at once. Over the granted `max_inline_data` it is
/// refused before the provider (InvalidArgument, the requests before it
/// posted), as is INLINE on a READ.
pub fn inline_payload_is_copied_at_post_time<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let access = AccessFlags::transfer();
    let inbox = p.b.buf(64, 8, access);
    let max = p.qa.caps().max_inline_data as usize;
    assert!(max >= 48, "granted {:?}", p.qa.caps());
    Pair::<B::A>::post_recv(&p.qb, &[recv(1, &[inbox.sge(0, 64)])]);
    let mut payload = pattern(48, 11);
    let sge = Sge {
        addr: payload.as_ptr() as u64,
        length: 48,
        lkey: 0,
    };
    Pair::<B::A>::post(
        &p.qa,
        &[req(1, SendOp::Send, &[sge], SIG | SendFlags::INLINE)],
    );
    payload.fill(0xee);
    let wc = p.expect(&p.cqa, 1, "inline SEND")[0];
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::SUCCESS), "{wc:?}");
    let wc = p.expect(&p.cqb, 1, "receive")[0];
    assert_eq!((wc.status, wc.byte_len), (WcStatus::SUCCESS, 48), "{wc:?}");
    assert!(inbox.bytes()[..48] == pattern(48, 11)[..], "inline payload");

    let src = p.a.buf(max + 64, 9, access);
    let dst = p.b.buf(max + 64, 10, access);
    let inline = SIG | SendFlags::INLINE;
    let err = Pair::<B::A>::try_post(
        &p.qa,
        &[
            req(2, dst.write_op(0), &[src.sge(0, max)], inline),
            req(3, dst.write_op(0), &[src.sge(0, max + 1)], inline),
            req(4, dst.write_op(0), &[src.sge(0, 8)], SIG),
        ],
    )
    .expect_err("an inline payload over max_inline_data");
    assert_eq!(err.accepted(), Some(1), "{err}");
    assert!(
        matches!(&err.error, VerbsError::InvalidArgument { reason, .. }
            if reason.contains("max_inline_data")),
        "{err}"
    );
    let wc = p.expect(&p.cqa, 1, "the refused requests")[0];
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::SUCCESS), "{wc:?}");
    assert!(
        dst.bytes()[..max] == src.bytes()[..max],
        "inline WRITE payload"
    );
    let err = Pair::<B::A>::try_post(&p.qa, &[req(5, dst.read_op(0), &[src.sge(0, 8)], inline)])
        .expect_err("INLINE on a READ");
    assert!(
        matches!(err.error, VerbsError::InvalidArgument { .. }),
        "{err}"
    );
    p.quiet(&p.cqa, "refused READ");
}

/// Two QPs on one CQ, each with a batch of WRITEs: every completion
/// arrives, each QP's in its own posting order. The order between QPs is
/// not promised by hardware (a NIC interleaves them as its schedulers
/// go), so it is not asserted: the sim runs each QP's queue to exhaustion
/// in QPN order (its engine's choice), rxe interleaves; an engine must
/// accept both.
pub fn qps_sharing_a_cq_complete_in_order_each<B: Backend>(b: &B) {
    crate::init_tracing();
    let (a, bn) = b.nodes();
    let shared = hal_verbs::Context::create_cq(&a.ctx, 64).expect("CQ");
    let cqb = hal_verbs::Context::create_cq(&bn.ctx, 64).expect("CQ");
    let caps = QpCaps::default();
    let pd_qp = |node: &crate::pair::Node<B::A>, cq| {
        hal_verbs::ProtectionDomain::create_qp(&node.pd, &caps, cq, cq).expect("QP")
    };
    let (qa1, qa2) = (pd_qp(&a, &shared), pd_qp(&a, &shared));
    let (qb1, qb2) = (pd_qp(&bn, &cqb), pd_qp(&bn, &cqb));
    let rts = hal_verbs::RtsParams::default();
    connect(&a, &qa1, &bn, &qb1, rts);
    connect(&a, &qa2, &bn, &qb2, rts);
    let access = AccessFlags::transfer();
    let src = a.buf(4096, 9, access);
    let dst = bn.buf(4096, 10, access);
    const K: u64 = 8;
    let batch = |base: u64, half: usize| -> Vec<_> {
        (0..K)
            .map(|i| {
                let off = half * 2048 + i as usize * 256;
                req(base + i, dst.write_op(off), &[src.sge(off, 256)], SIG)
            })
            .collect()
    };
    Pair::<B::A>::post(&qa1, &batch(100, 0));
    Pair::<B::A>::post(&qa2, &batch(200, 1));
    let facts = b.facts();
    let wcs = crate::pair::wait::<B::A>(&shared, 2 * K as usize, facts.completion_timeout);
    crate::pair::quiet::<B::A>(&shared, facts.quiet_window, "shared CQ");
    assert!(wcs.iter().all(|c| c.status.is_success()), "{wcs:?}");
    for (qp, base) in [(&qa1, 100), (&qa2, 200)] {
        let of_qp: Vec<u64> = wcs
            .iter()
            .filter(|c| c.qp_num == qp.qp_num())
            .map(|c| c.wr_id)
            .collect();
        assert_eq!(of_qp, (base..base + K).collect::<Vec<_>>(), "{}", b.name());
    }
    let interleaved = wcs
        .windows(2)
        .filter(|w| w[0].qp_num != w[1].qp_num)
        .count()
        > 1;
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr().lock(),
        "{}: completions of two QPs on one CQ {}: {:?}",
        b.name(),
        if interleaved {
            "interleaved"
        } else {
            "not interleaved"
        },
        ids_and_status(&wcs)
    );
    assert!(dst.bytes() == src.bytes(), "payload");
    drop((qa1, qa2, qb1, qb2));
}

/// Zero-length requests: a SEND with no SG entry consumes a receive and
/// reports 0 bytes; a zero-length WRITE and READ carry no key check (IBA
/// C9-88; rxe's `check_rkey` skips it) and succeed with any rkey.
pub fn zero_length_requests<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let access = AccessFlags::transfer();
    let inbox = p.b.buf(64, 1, access);
    let i0 = inbox.bytes();
    Pair::<B::A>::post_recv(&p.qb, &[recv(40, &[inbox.sge(0, 64)])]);
    Pair::<B::A>::post(&p.qa, &[req(1, SendOp::Send, &[], SIG)]);
    let wc = p.expect(&p.cqa, 1, "empty SEND")[0];
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::SUCCESS), "{wc:?}");
    let wc = p.expect(&p.cqb, 1, "its receive")[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (40, WcStatus::SUCCESS, WcOpcode::Recv, 0)
    );
    assert!(inbox.bytes() == i0);
    let bogus = 0x0bad_0bad;
    let ops = [
        SendOp::Write {
            remote_addr: 0x1000,
            rkey: bogus,
        },
        SendOp::Read {
            remote_addr: 0x1000,
            rkey: bogus,
        },
    ];
    for (i, op) in ops.into_iter().enumerate() {
        Pair::<B::A>::post(&p.qa, &[req(2 + i as u64, op, &[], SIG)]);
        let wc = p.expect(&p.cqa, 1, "zero-length RDMA")[0];
        assert_eq!(
            (wc.wr_id, wc.status),
            (2 + i as u64, WcStatus::SUCCESS),
            "{op:?} on {}: {wc:?}",
            p.name
        );
    }
}

/// Unsignaled requests and their send-queue slots: the queue holds the
/// granted depth; once a signaled completion behind a run of unsignaled
/// ones is polled, every slot is free again (on all devices). Whether
/// slots of unsignaled requests come back before that is the backend's
/// [`crate::pair::Facts::unsignaled_slots_need_a_poll`]: an engine must
/// signal at least once per queue depth either way.
pub fn unsignaled_requests_hold_their_slots<B: Backend>(b: &B) {
    let p = shallow_send_queue(b);
    let access = AccessFlags::transfer();
    let depth = p.qa.caps().max_send_wr as usize;
    let src = p.a.buf(64 * depth, 2, access);
    let dst = p.b.buf(64 * depth, 3, access);
    let w = |wr_id: u64, i: usize, flags| {
        req(wr_id, dst.write_op(i * 64), &[src.sge(i * 64, 64)], flags)
    };
    let unsignaled: Vec<_> = (0..depth).map(|i| w(i as u64, i, NONE)).collect();
    Pair::<B::A>::post(&p.qa, &unsignaled);
    p.quiet(&p.cqa, "unsignaled requests");
    assert!(dst.bytes() == src.bytes(), "every unsignaled WRITE ran");
    let more = Pair::<B::A>::try_post(&p.qa, &[w(100, 0, SIG)]);
    if p.facts.unsignaled_slots_need_a_poll {
        let err = more.expect_err("a full queue: nothing polled yet");
        assert_eq!(err.accepted(), Some(0), "{err}");
        assert!(matches!(err.error, VerbsError::QueueFull { .. }), "{err}");
        // Every slot is held by an unsignaled request and no completion
        // will come to free one: the queue is stuck until the QP is
        // flushed. An engine must never let that happen.
        return;
    }
    more.unwrap_or_else(|e| panic!("slots of completed unsignaled requests: {e}"));
    let wc = p.expect(&p.cqa, 1, "signaled")[0];
    assert_eq!((wc.wr_id, wc.status), (100, WcStatus::SUCCESS));
    // After that poll the whole queue is free.
    let again: Vec<_> = (0..depth).map(|i| w(i as u64, i, SIG)).collect();
    Pair::<B::A>::post(&p.qa, &again);
    assert_eq!(p.expect(&p.cqa, depth, "refill").len(), depth);
}
