//! One scenario, run on the simulated NIC and on rxe: a peer that holds a
//! grant reaches exactly the granted range with exactly the granted rights,
//! and the rkey of a cached (local) registration reaches nothing.

use std::sync::Arc;

use gdr_core::buffer::Buffer;
use gdr_core::ladder::{GrantRights, Ladder};
use gdr_core::loopback::{Loopback, LoopbackError};
use hal_verbs::dynamic::DynApi;
use hal_verbs::{AccessFlags, MemoryRegion as _, ProtectionDomain as _, SendOp, Sge};

use crate::pattern;

/// Bytes of the buffer the grants are made in.
pub const LEN: usize = 64 << 10;
/// Read-only grant: 8 KiB at 16 KiB.
const READ_AT: u64 = 16 << 10;
const READ_LEN: u64 = 8 << 10;
/// Write-only grant: 4 KiB at 32 KiB.
const WRITE_AT: u64 = 32 << 10;
const WRITE_LEN: u64 = 4 << 10;

/// What one one-sided operation of the peer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Done,
    Refused,
}

struct Peer<'a> {
    loopback: Loopback<DynApi>,
    _scratch: &'a mut [u8],
    mr: hal_verbs::dynamic::DynMemoryRegion,
}

impl Peer<'_> {
    /// One READ or WRITE of `len` bytes at `addr` with `rkey`, from/into
    /// the peer's scratch buffer.
    fn op(&self, write: bool, addr: u64, rkey: u32, len: u32) -> Outcome {
        let op = if write {
            SendOp::Write {
                remote_addr: addr,
                rkey,
            }
        } else {
            SendOp::Read {
                remote_addr: addr,
                rkey,
            }
        };
        let sge = Sge {
            addr: self.mr.addr(),
            length: len,
            lkey: self.mr.lkey(),
        };
        let what = if write { "RDMA WRITE" } else { "RDMA READ" };
        // SAFETY: the SG entry lies in `self.mr` over `self.scratch`, both
        // alive for the whole call; `run` waits for the completion.
        match unsafe { self.loopback.run(op, sge, what) } {
            Ok(()) => Outcome::Done,
            Err(LoopbackError::Completion { .. }) => Outcome::Refused,
            Err(e) => panic!("{what} of {len} bytes at {addr:#x}: {e}"),
        }
    }
}

/// Grants parts of a host buffer registered through `ladder` and checks
/// what a peer (a loopback QP pair in the ladder's PD, on `port` of
/// `context`) can do with each rkey.
pub fn grants_confine_the_peer(
    context: &hal_verbs::dynamic::DynContext,
    ladder: &Ladder,
    port: u8,
) {
    let buffer = Buffer::alloc_host(LEN as u64);
    // Called when no RDMA is in flight.
    let fill = |bytes: &[u8]| buffer.write_at(0, bytes).unwrap();
    let read = || buffer.to_vec().unwrap();
    grants_confine_the_peer_to(context, ladder, port, &buffer, fill, read);
}

/// The same, on `buffer` (`LEN` bytes of any memory the ladder registers),
/// whose bytes `fill` sets and `read` returns.
pub fn grants_confine_the_peer_to(
    context: &hal_verbs::dynamic::DynContext,
    ladder: &Ladder,
    port: u8,
    buffer: &Buffer,
    fill: impl Fn(&[u8]),
    read: impl Fn() -> Vec<u8>,
) {
    assert_eq!(buffer.len(), LEN as u64);
    let original = pattern(LEN, 11);
    fill(&original);
    let registration = buffer.register(ladder, 0, LEN as u64).unwrap();
    let read_grant = ladder
        .grant(&registration, READ_AT, READ_LEN, GrantRights::Read)
        .unwrap();
    let write = ladder
        .grant(&registration, WRITE_AT, WRITE_LEN, GrantRights::Write)
        .unwrap();
    let (r, w) = (read_grant.segment(0), write.segment(0));
    assert_eq!(
        (r.offset, r.addr, r.len),
        (0, buffer.addr() + READ_AT, READ_LEN)
    );
    assert_eq!((w.addr, w.len), (buffer.addr() + WRITE_AT, WRITE_LEN));
    assert_eq!(
        (r.device.as_str(), w.device.as_str()),
        (ladder.device(), ladder.device())
    );
    assert_eq!((read_grant.addr(), read_grant.len()), (r.addr, r.len));
    assert_eq!(write.segment(WRITE_AT).offset, WRITE_AT);

    let mut scratch = vec![0u8; LEN];
    let loopback = Loopback::<DynApi>::with_pd(context, Arc::clone(ladder.pd()), port).unwrap();
    // SAFETY: `scratch` outlives the region (the peer drops first).
    let mr = unsafe {
        loopback
            .pd()
            .register(scratch.as_mut_ptr() as u64, LEN, AccessFlags::LOCAL_WRITE)
    }
    .unwrap();
    let peer = Peer {
        loopback,
        _scratch: &mut scratch,
        mr,
    };
    use Outcome::{Done, Refused};
    let page = 4096;
    // Inside the read grant: the bytes arrive.
    assert_eq!(peer.op(false, r.addr, r.rkey, READ_LEN as u32), Done);
    // One byte either side of it, or a write into it: refused.
    assert_eq!(peer.op(false, r.addr + READ_LEN - 8, r.rkey, 16), Refused);
    assert_eq!(peer.op(false, r.addr - 8, r.rkey, 16), Refused);
    assert_eq!(peer.op(false, r.addr + READ_LEN, r.rkey, page), Refused);
    assert_eq!(peer.op(true, r.addr, r.rkey, page), Refused);
    // Inside the write grant: written; a read of it or past it: refused.
    assert_eq!(peer.op(true, w.addr, w.rkey, WRITE_LEN as u32), Done);
    assert_eq!(peer.op(false, w.addr, w.rkey, page), Refused);
    assert_eq!(peer.op(true, w.addr + WRITE_LEN - 8, w.rkey, 16), Refused);
    assert_eq!(peer.op(true, w.addr - page as u64, w.rkey, page), Refused);
    // The cached registration's key (lkey = rkey on rxe and mlx5) reaches
    // nothing: local rights only.
    let local = registration.mr().unwrap();
    assert_eq!(peer.op(false, buffer.addr(), local.rkey(), page), Refused);
    assert_eq!(peer.op(true, buffer.addr(), local.rkey(), page), Refused);
    assert_eq!(peer.op(false, buffer.addr(), local.lkey(), page), Refused);
    // A revoked grant reaches nothing either.
    let (revoked_addr, revoked_rkey) = (r.addr, r.rkey);
    read_grant.revoke();
    assert_eq!(
        peer.op(false, revoked_addr, revoked_rkey, READ_LEN as u32),
        Refused
    );
    drop(peer);

    // Only the write grant's range changed (the peer's scratch was zeroed,
    // then read the read grant's bytes: it wrote those back).
    // The peer is gone, nothing is in flight.
    let now = read();
    let (ws, we) = (WRITE_AT as usize, (WRITE_AT + WRITE_LEN) as usize);
    assert_eq!(now[..ws], original[..ws], "bytes before the write grant");
    assert_eq!(now[we..], original[we..], "bytes after the write grant");
    assert_eq!(
        now[ws..we],
        original[READ_AT as usize..READ_AT as usize + WRITE_LEN as usize],
        "the write grant holds what the peer read through the read grant"
    );
    drop((write, registration));
}
