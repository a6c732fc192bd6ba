//! Requests that fail: statuses, which QPs go to ERROR, what is flushed,
//! and that no byte moves.

use hal_verbs::{
    AccessFlags, Api, Completion, MemoryRegion, QpState, QueuePair, SendFlags, SendOp, Sge,
    WcOpcode, WcStatus,
};

use crate::pair::{Backend, Buf, Facts, Pair, ids_and_status, recv, req};

const SIG: SendFlags = SendFlags::SIGNALED;
const NONE: SendFlags = SendFlags::empty();

/// Error completions carry no opcode and no length where the backend's
/// fact says so (rxe: zeroed; see [`Facts::error_wc_opcode_and_len_zero`]).
fn assert_error_fields(facts: &Facts, wcs: &[Completion], what: &str) {
    if !facts.error_wc_opcode_and_len_zero {
        return;
    }
    for wc in wcs.iter().filter(|wc| !wc.status.is_success()) {
        assert_eq!(
            (wc.opcode, wc.byte_len, wc.imm),
            (WcOpcode::Send, 0, None),
            "{what}: an error completion with opcode/length/immediate: {wc:?}"
        );
    }
}

const MR_LEN: usize = 4096;

/// One failing one-sided request on a fresh pair, followed by two more in
/// the same batch: its status is REM_ACCESS_ERR, the two behind it flush
/// (the unsignaled one too), no byte moves on either side, the responder
/// QP goes to ERROR as well (IBA class C: NAK, then ERROR) so its posted
/// receive is flushed, and later posts on the requester flush.
fn access_error_case<B: Backend>(
    b: &B,
    what: &str,
    remote_access: AccessFlags,
    op: impl Fn(&Buf<B::A>, &Pair<B::A>) -> SendOp,
) {
    let p = Pair::new(b);
    let local = p.a.buf(2 * MR_LEN, 8, AccessFlags::transfer());
    // Registered from 64 bytes in, MR_LEN long: strays on either side land
    // in memory we check.
    let remote = p.b.buf_part(2 * MR_LEN, 64, MR_LEN, 9, remote_access);
    let inbox = p.b.buf(MR_LEN, 10, AccessFlags::LOCAL_WRITE);
    let (l0, r0, i0) = (local.bytes(), remote.bytes(), inbox.bytes());
    Pair::<B::A>::post_recv(&p.qb, &[recv(88, &[inbox.sge(0, 64)])]);
    Pair::<B::A>::post(
        &p.qa,
        &[
            req(77, op(&remote, &p), &[local.sge(0, 64)], SIG),
            req(78, remote.write_op(0), &[local.sge(0, 16)], NONE),
            req(79, remote.write_op(0), &[local.sge(0, 16)], SIG),
        ],
    );
    let wcs = p.expect(&p.cqa, 3, what);
    assert_eq!(
        ids_and_status(&wcs),
        [
            (77, WcStatus::REM_ACCESS_ERR),
            (78, WcStatus::WR_FLUSH_ERR),
            (79, WcStatus::WR_FLUSH_ERR)
        ],
        "{what} on {}: {wcs:?}",
        p.name
    );
    assert!(wcs.iter().all(|c| c.qp_num == p.qa.qp_num()));
    assert_error_fields(&p.facts, &wcs, what);
    assert_eq!(p.qa.state().unwrap(), QpState::Error, "{what}: requester");
    let r = p.expect(&p.cqb, 1, what);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].qp_num),
        (88, WcStatus::WR_FLUSH_ERR, p.qb.qp_num()),
        "{what}: the responder's receive"
    );
    assert_error_fields(&p.facts, &r, what);
    assert_eq!(p.qb.state().unwrap(), QpState::Error, "{what}: responder");
    // Later requests on the failed QP flush, never run.
    Pair::<B::A>::post(
        &p.qa,
        &[req(80, remote.write_op(0), &[local.sge(0, 16)], NONE)],
    );
    let wcs = p.expect(&p.cqa, 1, what);
    assert_eq!(
        ids_and_status(&wcs),
        [(80, WcStatus::WR_FLUSH_ERR)],
        "{what}"
    );
    assert!(remote.bytes() == r0, "{what}: bytes moved into the remote");
    assert!(local.bytes() == l0, "{what}: bytes moved into the local");
    assert!(inbox.bytes() == i0, "{what}: bytes moved into the inbox");
}

/// Remote access violations: out of bounds (past the end, below the
/// start, WRITE and READ), without the right, an rkey of another PD of the
/// target, an rkey of an MR registered without remote rights.
pub fn remote_access_errors_move_no_byte<B: Backend>(b: &B) {
    let all = AccessFlags::transfer();
    access_error_case(b, "WRITE past the MR's end", all, |mr, _| SendOp::Write {
        remote_addr: mr.addr(MR_LEN - 32),
        rkey: mr.mr.rkey(),
    });
    access_error_case(b, "WRITE one byte past the MR", all, |mr, _| {
        SendOp::Write {
            remote_addr: mr.addr(MR_LEN - 63),
            rkey: mr.mr.rkey(),
        }
    });
    access_error_case(b, "READ past the MR's end", all, |mr, _| SendOp::Read {
        remote_addr: mr.addr(MR_LEN - 32),
        rkey: mr.mr.rkey(),
    });
    access_error_case(b, "WRITE below the MR", all, |mr, _| SendOp::Write {
        remote_addr: mr.addr(0) - 1,
        rkey: mr.mr.rkey(),
    });
    access_error_case(
        b,
        "WRITE without REMOTE_WRITE",
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        |mr, _| mr.write_op(0),
    );
    access_error_case(
        b,
        "READ without REMOTE_READ",
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        |mr, _| mr.read_op(0),
    );
    // Registrations made for a case live until the scenario ends.
    let keep = std::cell::RefCell::new(Vec::new());
    // The rkey of an MR in another PD of the target node.
    access_error_case(b, "rkey of another PD", all, |mr, p| {
        let other = Buf::<B::A>::new(&p.b.other_pd(), MR_LEN, 11, all);
        let op = SendOp::Write {
            remote_addr: mr.addr(0),
            rkey: other.mr.rkey(),
        };
        keep.borrow_mut().push(other);
        op
    });
    // The rkey of a local-only MR of the same PD (0 on rxe).
    access_error_case(b, "rkey of a local-only MR", all, |_, p| {
        let local_only = p.b.buf(MR_LEN, 12, AccessFlags::LOCAL_WRITE);
        let op = local_only.write_op(0);
        keep.borrow_mut().push(local_only);
        op
    });
    keep.borrow_mut().clear();
}

/// Local protection errors: an lkey of another PD, an unknown lkey (the
/// gather of a WRITE), a READ into an MR without LOCAL_WRITE, an SG entry
/// past its MR (the scatter of a READ's response): the request fails with
/// the backend's status for each ([`Facts::gather_fault_status`],
/// [`Facts::scatter_fault_status`]), no byte moves, the requester goes to
/// ERROR and the peer sees nothing.
pub fn local_protection_errors<B: Backend>(b: &B) {
    let access = AccessFlags::transfer();
    let mut seen = Vec::new();
    for what in ["lkey of another PD", "unknown lkey"] {
        let p = Pair::new(b);
        let foreign = Buf::<B::A>::new(&p.a.other_pd(), 64, 1, access);
        let dst = p.b.buf(64, 2, access);
        let d0 = dst.bytes();
        let sge = match what {
            "unknown lkey" => Sge {
                lkey: foreign.mr.lkey() ^ 0x5a5a_0000,
                ..foreign.sge(0, 64)
            },
            _ => foreign.sge(0, 64),
        };
        Pair::<B::A>::post(&p.qa, &[req(1, dst.write_op(0), &[sge], NONE)]);
        let wcs = p.expect(&p.cqa, 1, what);
        seen.push((what, wcs[0].status, p.facts.gather_fault_status));
        assert_eq!(wcs[0].wr_id, 1, "{what}");
        assert_error_fields(&p.facts, &wcs, what);
        assert_eq!(p.qa.state().unwrap(), QpState::Error, "{what}");
        assert!(dst.bytes() == d0, "{what}: a byte moved");
        p.quiet(&p.cqb, what);
        assert_eq!(p.qb.state().unwrap(), QpState::ReadyToSend, "{what}: peer");
        drop(foreign);
    }

    for what in [
        "READ into an MR without LOCAL_WRITE",
        "SG entry past its MR",
    ] {
        let p = Pair::new(b);
        let remote = p.b.buf(128, 4, access);
        let (local, len) = if what.contains("LOCAL_WRITE") {
            (p.a.buf(64, 5, AccessFlags::REMOTE_READ), 64)
        } else {
            (p.a.buf_part(128, 0, 64, 5, access), 65)
        };
        let l0 = local.bytes();
        Pair::<B::A>::post(
            &p.qa,
            &[req(2, remote.read_op(0), &[local.sge(0, len)], SIG)],
        );
        let wcs = p.expect(&p.cqa, 1, what);
        seen.push((what, wcs[0].status, p.facts.scatter_fault_status));
        assert_eq!(wcs[0].wr_id, 2, "{what}");
        assert_error_fields(&p.facts, &wcs, what);
        assert_eq!(p.qa.state().unwrap(), QpState::Error, "{what}");
        assert!(local.bytes() == l0, "{what}: a byte moved");
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{}: {seen:?}", b.name());
    for (what, got, want) in seen {
        assert_eq!(got, want, "{what} on {}", b.name());
    }
}

/// A SEND (wr_id 1) that the responder's receive (70, with 71 behind it)
/// refused: the requester's completions `sent` carry `statuses.0`, the
/// responder's `got` `statuses.1` and a flush, error completions carry no
/// opcode or length where the backend says so, and both QPs are in ERROR.
fn refused_send<A: Api>(
    p: &Pair<A>,
    sent: &[Completion],
    got: &[Completion],
    statuses: (WcStatus, WcStatus),
) {
    assert_eq!(ids_and_status(sent), [(1, statuses.0)], "on {}", p.name);
    assert_eq!(
        ids_and_status(got),
        [(70, statuses.1), (71, WcStatus::WR_FLUSH_ERR)],
        "on {}",
        p.name
    );
    assert_error_fields(&p.facts, sent, "requester");
    assert_error_fields(&p.facts, got, "responder");
    assert_eq!(p.qa.state().unwrap(), QpState::Error);
    assert_eq!(p.qb.state().unwrap(), QpState::Error);
}

/// A SEND longer than the receive: the requester sees the backend's
/// [`Facts::receive_too_small_status`], for itself and for the receive at
/// the responder, and a flush for the next receive; no
/// byte lands; both QPs go to ERROR.
pub fn receive_too_small_fails_both_sides<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let access = AccessFlags::transfer();
    let src = p.a.buf(100, 8, access);
    let inbox = p.b.buf(100, 9, access);
    let i0 = inbox.bytes();
    Pair::<B::A>::post_recv(
        &p.qb,
        &[
            recv(70, &[inbox.sge(0, 60), inbox.sge(60, 39)]),
            recv(71, &[]),
        ],
    );
    Pair::<B::A>::post(&p.qa, &[req(1, SendOp::Send, &[src.sge(0, 100)], NONE)]);
    let sent = p.expect(&p.cqa, 1, "requester");
    let got = p.expect(&p.cqb, 2, "responder");
    refused_send(&p, &sent, &got, p.facts.receive_too_small_status);
    // One packet, checked against the receive before any byte is placed.
    assert!(inbox.bytes() == i0, "bytes landed");
}

/// `to_error` with work outstanding: a SEND waiting for a receive the peer
/// never posts (RNR, retried forever with rnr_retry 7), a WRITE and a READ
/// queued behind it, two receives: everything completes with
/// WR_FLUSH_ERR, unsignaled requests too, each queue in posting order;
/// nothing moves; the peer is untouched.
pub fn to_error_flushes_everything_outstanding<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let access = AccessFlags::transfer();
    let src = p.a.buf(256, 2, access);
    let dst = p.b.buf(256, 3, access);
    let inbox = p.a.buf(256, 4, access);
    let (s0, d0, i0) = (src.bytes(), dst.bytes(), inbox.bytes());
    Pair::<B::A>::post_recv(
        &p.qa,
        &[
            recv(100, &[inbox.sge(0, 128)]),
            recv(101, &[inbox.sge(128, 128)]),
        ],
    );
    Pair::<B::A>::post(
        &p.qa,
        &[
            req(1, SendOp::Send, &[src.sge(0, 8)], SIG),
            req(2, dst.write_op(64), &[src.sge(64, 64)], NONE),
            req(3, dst.read_op(0), &[src.sge(128, 8)], SIG),
        ],
    );
    p.quiet(&p.cqa, "waiting for a receive");
    assert_eq!(p.qa.state().unwrap(), QpState::ReadyToSend);
    p.qa.to_error().unwrap();
    assert_eq!(p.qa.state().unwrap(), QpState::Error);
    let wcs = p.expect(&p.cqa, 5, "flushes");
    assert_error_fields(&p.facts, &wcs, "flushes");
    let sends: Vec<_> = wcs.iter().filter(|c| c.wr_id < 100).copied().collect();
    let recvs: Vec<_> = wcs.iter().filter(|c| c.wr_id >= 100).copied().collect();
    let flushed = WcStatus::WR_FLUSH_ERR;
    assert_eq!(
        ids_and_status(&sends),
        [(1, flushed), (2, flushed), (3, flushed)]
    );
    assert_eq!(ids_and_status(&recvs), [(100, flushed), (101, flushed)]);
    assert!(wcs.iter().all(|c| c.qp_num == p.qa.qp_num()));
    assert!(dst.bytes() == d0, "nothing moved to the peer");
    assert!(
        src.bytes() == s0 && inbox.bytes() == i0,
        "nothing moved here"
    );
    p.quiet(&p.cqb, "the peer");
    assert_eq!(p.qb.state().unwrap(), QpState::ReadyToSend);
}

/// A SEND with no receive posted waits (RNR, rnr_retry 7 retries
/// forever), and the WRITE behind it too (RC order); once the peer posts
/// a receive both complete. (Running out of RNR retries takes time: the
/// clock's.)
pub fn send_waits_for_a_receive<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let access = AccessFlags::transfer();
    let src = p.a.buf(32, 7, access);
    let inbox = p.b.buf(32, 8, access);
    let dst = p.b.buf(32, 9, access);
    let d0 = dst.bytes();
    Pair::<B::A>::post(
        &p.qa,
        &[
            req(1, SendOp::Send, &[src.sge(0, 32)], SIG),
            req(2, dst.write_op(0), &[src.sge(0, 32)], SIG),
        ],
    );
    p.quiet(&p.cqa, "no receive posted");
    assert!(dst.bytes() == d0, "the WRITE behind the SEND ran");
    Pair::<B::A>::post_recv(&p.qb, &[recv(9, &[inbox.sge(0, 32)])]);
    let wcs = p.expect(&p.cqa, 2, "after the receive");
    assert_eq!(
        ids_and_status(&wcs),
        [(1, WcStatus::SUCCESS), (2, WcStatus::SUCCESS)]
    );
    let wcs = p.expect(&p.cqb, 1, "receive");
    assert_eq!(ids_and_status(&wcs), [(9, WcStatus::SUCCESS)]);
    assert!(inbox.bytes() == src.bytes(), "SEND payload");
    assert!(dst.bytes() == src.bytes(), "WRITE payload");
}

/// Error completions: what the fields other than status, wr_id and qp_num
/// hold. Hardware does not define them (rxe zeroes them, mlx5 leaves
/// them unset); a backend that filled in the request's opcode and length
/// would let an engine reading them pass only there. Covers a failed
/// WRITE, a flushed READ and SEND-with-immediate, and flushed receives.
pub fn error_completions_carry_no_opcode_or_length<B: Backend>(b: &B) {
    let p = Pair::new(b);
    if !p.facts.error_wc_opcode_and_len_zero {
        return;
    }
    let access = AccessFlags::transfer();
    let src = p.a.buf(256, 1, access);
    let dst = p.b.buf(256, 2, access);
    let inbox = p.a.buf(256, 3, access);
    Pair::<B::A>::post_recv(&p.qa, &[recv(100, &[inbox.sge(0, 256)])]);
    Pair::<B::A>::post_recv(&p.qb, &[recv(200, &[dst.sge(0, 256)])]);
    Pair::<B::A>::post(
        &p.qa,
        &[
            // Past the remote MR's end: REM_ACCESS_ERR.
            req(1, dst.write_op(200), &[src.sge(0, 100)], SIG),
            req(2, dst.read_op(0), &[src.sge(0, 64)], SIG),
            req(3, SendOp::SendWithImm { imm: 7 }, &[src.sge(0, 32)], NONE),
        ],
    );
    let wcs = p.expect(&p.cqa, 4, "errors");
    let mut ids = ids_and_status(&wcs);
    ids.sort_by_key(|&(id, _)| id);
    assert_eq!(
        ids,
        [
            (1, WcStatus::REM_ACCESS_ERR),
            (2, WcStatus::WR_FLUSH_ERR),
            (3, WcStatus::WR_FLUSH_ERR),
            (100, WcStatus::WR_FLUSH_ERR)
        ]
    );
    assert_error_fields(&p.facts, &wcs, "requester");
    let wcs = p.expect(&p.cqb, 1, "responder");
    assert_eq!(ids_and_status(&wcs), [(200, WcStatus::WR_FLUSH_ERR)]);
    assert_error_fields(&p.facts, &wcs, "responder");
}

/// `hal_verbs::drain` on a QP with SENDs stuck waiting for receives the
/// peer will never post (rnr_retry 7) and a receive outstanding: every one
/// of them comes back as a flush (the unsignaled SEND too, the drain's
/// markers left out), after the ones that completed; the QP ends in
/// ERROR and is destroyed with nothing outstanding.
pub fn drain_flushes_everything_posted<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let access = AccessFlags::transfer();
    let buf = p.a.buf(1 << 16, 23, access);
    let inbox = p.b.buf(3 * 4096, 24, access);
    // b's three receives are consumed by a's first three SENDs; SENDs 4
    // (unsignaled) and 5 wait.
    let recvs: Vec<_> = (0..3)
        .map(|i| recv(10 + i as u64, &[inbox.sge(4096 * i, 4096)]))
        .collect();
    Pair::<B::A>::post_recv(&p.qb, &recvs);
    Pair::<B::A>::post_recv(&p.qa, &[recv(20, &[buf.sge(32768, 4096)])]);
    let sends: Vec<_> = (1..=5)
        .map(|i| {
            let flags = if i == 4 { NONE } else { SIG };
            req(i, SendOp::Send, &[buf.sge(49152, 64)], flags)
        })
        .collect();
    Pair::<B::A>::post(&p.qa, &sends);
    let got = p.wait(&p.cqa, 3);
    assert_eq!(
        ids_and_status(&got),
        [
            (1, WcStatus::SUCCESS),
            (2, WcStatus::SUCCESS),
            (3, WcStatus::SUCCESS)
        ]
    );
    let got_b = p.expect(&p.cqb, 3, "receives");
    assert!(got_b.iter().all(|c| c.status.is_success()), "{got_b:?}");
    p.quiet(&p.cqa, "SENDs waiting for receives");
    assert_eq!(p.qa.state().unwrap(), QpState::ReadyToSend, "still waiting");

    let drained =
        hal_verbs::drain::drain::<B::A>(&p.qa, &p.cqa, &p.cqa, p.facts.completion_timeout)
            .unwrap_or_else(|e| panic!("drain on {}: {e}: {:?}", p.name, e.completions));
    let mut ids = ids_and_status(&drained);
    ids.sort_by_key(|&(id, _)| id);
    let flushed = WcStatus::WR_FLUSH_ERR;
    assert_eq!(
        ids,
        [(4, flushed), (5, flushed), (20, flushed)],
        "{drained:?}"
    );
    assert!(drained.iter().all(|c| c.qp_num == p.qa.qp_num()));
    assert_error_fields(&p.facts, &drained, "drained");
    assert_eq!(p.qa.state().unwrap(), QpState::Error);
    let Pair { qa, cqa, facts, .. } = p;
    drop(qa);
    crate::pair::quiet::<B::A>(&cqa, facts.quiet_window, "after the drain");
}

/// The responder QP's own rights (INIT's access flags) are checked before
/// any MR's: a WRITE to a QP that grants only remote READ, and a READ from
/// one that grants only remote WRITE, fail with REM_INV_REQ_ERR (IBA: NAK
/// Invalid Request; rxe's `check_op_valid`) though the MR allows them;
/// no byte moves and both QPs go to ERROR.
pub fn qp_access_flags_are_enforced<B: Backend>(b: &B) {
    for (what, b_access) in [
        (
            "WRITE to a QP without remote WRITE",
            AccessFlags::REMOTE_READ,
        ),
        (
            "READ from a QP without remote READ",
            AccessFlags::REMOTE_WRITE,
        ),
    ] {
        let p = Pair::with(
            b,
            crate::pair::PairConfig {
                b_access: Some(b_access),
                ..crate::pair::PairConfig::default()
            },
        );
        let access = AccessFlags::transfer();
        let local = p.a.buf(64, 1, access);
        let remote = p.b.buf(64, 2, access);
        let (l0, r0) = (local.bytes(), remote.bytes());
        let op = if what.starts_with("WRITE") {
            remote.write_op(0)
        } else {
            remote.read_op(0)
        };
        Pair::<B::A>::post(&p.qa, &[req(1, op, &[local.sge(0, 64)], SIG)]);
        let wcs = p.expect(&p.cqa, 1, what);
        assert_eq!(
            ids_and_status(&wcs),
            [(1, WcStatus::REM_INV_REQ_ERR)],
            "{what} on {}",
            p.name
        );
        assert_error_fields(&p.facts, &wcs, what);
        assert_eq!(p.qa.state().unwrap(), QpState::Error, "{what}");
        assert_eq!(p.qb.state().unwrap(), QpState::Error, "{what}: responder");
        assert!(
            local.bytes() == l0 && remote.bytes() == r0,
            "{what}: bytes moved"
        );
    }
}

/// Posting on a QP not ready for it is refused (EINVAL): sends before
/// RTS, receives in RESET. How much of the batch the error says was
/// posted is the backend's [`Facts::wrong_state_post_accepted`]: rxe
/// leaves `bad_wr` outside the batch (the HAL reports `Posted::Unknown`:
/// drain before reuse), mlx5 and the sim name the first request
/// (`Prefix(0)`). Nothing completes.
pub fn posting_in_the_wrong_state_is_refused<B: Backend>(b: &B) {
    crate::init_tracing();
    let facts = b.facts();
    let (a, _) = b.nodes();
    let cq = hal_verbs::Context::create_cq(&a.ctx, 16).expect("CQ");
    let qp = hal_verbs::ProtectionDomain::create_qp(&a.pd, &hal_verbs::QpCaps::default(), &cq, &cq)
        .expect("QP");
    let buf = a.buf(64, 1, AccessFlags::transfer());
    let send = || Pair::<B::A>::try_post(&qp, &[req(1, SendOp::Send, &[buf.sge(0, 8)], SIG)]);
    // SAFETY: `buf` outlives the QP's use here (the QP is dropped first).
    let post_recv = || unsafe { qp.post_recv(&[recv(2, &[buf.sge(0, 8)])]) };
    let mut seen = vec![("send in RESET", send()), ("recv in RESET", post_recv())];
    qp.to_init(&hal_verbs::InitParams::default()).expect("INIT");
    seen.push(("send in INIT", send()));
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{}: {seen:?}", b.name());
    for (what, outcome) in seen {
        let err = outcome.expect_err(what);
        assert_eq!(err.error.errno(), Some(libc::EINVAL), "{what}: {err}");
        assert_eq!(
            err.accepted(),
            facts.wrong_state_post_accepted,
            "{what} on {}: {err}",
            b.name()
        );
    }
    crate::pair::quiet::<B::A>(&cq, facts.quiet_window, "refused posts");
    drop(qp);
}

/// Destroying a QP whose flush completions are still in its CQ: rxe keeps
/// them (they are polled after the QP is gone), mlx5 removes them
/// (`mlx5_destroy_qp` cleans the CQ): [`Facts::destroy_qp_keeps_completions`].
/// Either way an engine drains before destroying (`hal_verbs::drain`).
pub fn destroying_a_qp_with_completions_in_its_cq<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let inbox = p.a.buf(256, 1, AccessFlags::LOCAL_WRITE);
    Pair::<B::A>::post_recv(
        &p.qa,
        &[
            recv(1, &[inbox.sge(0, 128)]),
            recv(2, &[inbox.sge(128, 128)]),
        ],
    );
    p.qa.to_error().expect("to ERROR");
    // Let the flushes reach the CQ (rxe flushes from its tasks), without
    // polling them.
    std::thread::sleep(p.facts.quiet_window);
    let Pair {
        qa,
        cqa,
        facts,
        name,
        ..
    } = p;
    drop(qa);
    if facts.destroy_qp_keeps_completions {
        let wcs = crate::pair::wait::<B::A>(&cqa, 2, facts.completion_timeout);
        assert_eq!(
            ids_and_status(&wcs),
            [(1, WcStatus::WR_FLUSH_ERR), (2, WcStatus::WR_FLUSH_ERR)],
            "on {name}"
        );
    }
    crate::pair::quiet::<B::A>(&cqa, facts.quiet_window, &name);
}

/// A SEND into a receive whose SG entry the responder cannot write (an
/// lkey of another PD): the requester's and the responder's statuses are
/// the backend's [`Facts::bad_receive_status`]; no byte lands, both QPs go
/// to ERROR.
pub fn send_into_a_bad_receive_fails_both_sides<B: Backend>(b: &B) {
    let p = Pair::new(b);
    let access = AccessFlags::transfer();
    let src = p.a.buf(64, 1, access);
    let foreign = Buf::<B::A>::new(&p.b.other_pd(), 64, 2, access);
    let f0 = foreign.bytes();
    Pair::<B::A>::post_recv(&p.qb, &[recv(70, &[foreign.sge(0, 64)]), recv(71, &[])]);
    Pair::<B::A>::post(&p.qa, &[req(1, SendOp::Send, &[src.sge(0, 64)], SIG)]);
    let sent = p.expect(&p.cqa, 1, "requester");
    let got = p.expect(&p.cqb, 2, "responder");
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr().lock(),
        "{}: bad receive: requester {:?}, responder {:?}",
        p.name,
        ids_and_status(&sent),
        ids_and_status(&got)
    );
    refused_send(&p, &sent, &got, p.facts.bad_receive_status);
    assert!(foreign.bytes() == f0, "bytes landed");
}
