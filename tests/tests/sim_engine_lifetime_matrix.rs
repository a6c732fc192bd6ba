//! The lifetime matrix (simulated NICs and GPUs): every path × every
//! lifetime event × {READ, WRITE}, each event landing while the transfer
//! is in flight, and what the library promises checked in every case:
//!
//! - no byte lands outside live memory: the simulated GPUs refuse and
//!   report every access to freed memory, and none may be reported; in
//!   memory that stays alive, the bytes around the transferred range keep
//!   what they held and the range holds, byte for byte, either what it
//!   held or what the transfer carries (all of the latter on success);
//! - nothing hangs: every wait is bounded and each case runs on a thread
//!   that must finish within [`CASE_BOUND`];
//! - every request ends exactly once: `wait` returns an outcome (not its
//!   own bound running out), a second `wait` and `status()` give the same;
//! - a revoke is a fence: once `Grant::revoke(timeout)` returned, no
//!   byte moves under the grant (the granted memory is compared with a
//!   snapshot taken then; for a READ the owner writes new bytes into it,
//!   which must never reach the requester).
//!
//! a is the requester (it submits), b the owner (it grants a all of a GPU
//! buffer). How the work is held in flight: on the NIC and staged paths a
//! makes progress (no thread of its own runs there) until the first bytes
//! have landed, then the fabric is paused, so the event lands mid-transfer;
//! on the peer-copy paths a's GPU is paused before the submit, so every
//! copy is queued on the GPU and none has run (the copies are all queued
//! at the submit, so there is no "some landed" state to catch).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use gdr_core::buffer::Buffer;
use gdr_core::descriptor::{GrantRights, MemoryDescriptor, Reach};
use gdr_core::engine::{
    Batch, EngineConfig, PeerCopyRoute, Region, TimedOut, Transfer, TransferError,
};
use gdr_core::ladder::Rung;
use gdr_sim::{GpuConfig, SimCuda, SimFabric, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, Side, WorldGrant, WorldPeer, staged_through_slots};
use gdr_tests::pattern;
use hal_cuda::{Context as _, Driver as _, Stream as _};
use hal_verbs::PortState;

/// Bound of every wait.
const T: Duration = Duration::from_secs(10);
/// Each batch's own deadline: below [`T`], so a wait that returns its own
/// bound (`Timeout { after: T }`) is told apart from a batch that ended by
/// its deadline.
const DEADLINE: Duration = Duration::from_secs(5);
/// A whole case, world set-up and teardown included.
const CASE_BOUND: Duration = Duration::from_secs(30);
/// Bytes moved: 64 slices of 4 KiB on every path that slices by 4 KiB.
const X: u64 = 256 * 1024;
/// Bytes before and after the transferred range in each buffer.
const GUARD: u64 = 4096;
const LEN: u64 = X + 2 * GUARD;
/// Seeds of a's bytes, b's bytes, and of what b writes into its memory
/// once a revoke returned: [`pattern`]s of different seeds differ at every
/// byte, so each byte says where it came from.
const SEED_A: u8 = 11;
const SEED_B: u8 = 22;
const SEED_AFTER_REVOKE: u8 = 33;

type HeldBatch = Batch;
type Mem = Buffer;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PathKind {
    /// GPU memory on both sides registered by dma-buf (a GPUDirect rung):
    /// the NIC moves it.
    Nic,
    /// GPU memory on both sides on the staging rung: a's through its bounce
    /// pool, b's through the landing slots b lends a.
    Staged,
    /// Two GPUs of one simulated node, engines of one process: device
    /// copies through the process-wide registry of grants.
    PeerSameProcess,
    /// The same, b in another simulated process: device copies through the
    /// CUDA IPC handle of b's grant.
    PeerIpc,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    /// a's `Buffer` dropped; its region (and the batch) live on.
    LocalBufferDropped,
    /// b's `Buffer` dropped; its region and grant live on.
    RemoteBufferDropped,
    /// b's grant revoked with `Grant::revoke(T)`.
    GrantRevoked,
    /// b's grant dropped (a revoke not waited for).
    GrantDropped,
    /// Both `Peer` handles dropped (the engines keep the connection).
    PeerHandlesDropped,
    /// a closes the connection (`Peer::close`), its handle dropped.
    LocalPeerClosed,
    /// b closes the connection, its handle dropped.
    RemotePeerClosed,
    /// a's engine and everything of it dropped but the batch.
    LocalEngineDropped,
    /// a's engine and everything of it dropped, the batch included.
    LocalEngineGone,
    /// b's engine and everything of it dropped (grant, region, buffer,
    /// peer, engine, NIC handle).
    RemoteEngineDropped,
    /// b's NIC port goes down: the wire between the two is cut.
    ConnectionLost,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Read,
    Write,
}

const EVENTS: [Event; 11] = [
    Event::LocalBufferDropped,
    Event::RemoteBufferDropped,
    Event::GrantRevoked,
    Event::GrantDropped,
    Event::PeerHandlesDropped,
    Event::LocalPeerClosed,
    Event::RemotePeerClosed,
    Event::LocalEngineDropped,
    Event::LocalEngineGone,
    Event::RemoteEngineDropped,
    Event::ConnectionLost,
];

/// What a case must end with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Ok,
    Err,
    /// Either, the data checked as the outcome says.
    Either,
    /// No batch left to end (what moved is checked, and that nothing moves
    /// once the requester is gone).
    NoBatch,
}

/// What the library promises for `event` on `path` (README "Memory
/// lifetimes, budgets and grants", the guide's "On errors" and "Peer
/// copies", `engine::peer_copy`'s docs).
fn expected(path: PathKind, event: Event) -> Expect {
    let peer_copy = matches!(path, PathKind::PeerSameProcess | PathKind::PeerIpc);
    match event {
        // Every registration (every rung) and every batch in flight holds
        // a lease on its buffer's memory: a dropped buffer is freed only
        // when the region goes, so the transfer goes on into live memory.
        Event::LocalBufferDropped | Event::RemoteBufferDropped => Expect::Ok,
        // "Dropping it leaves the connection up (the engine holds it)."
        Event::PeerHandlesDropped => Expect::Ok,
        // The batch holds its engine (and the regions it uses): dropping
        // the caller's handles neither cancels nor frees anything of it.
        Event::LocalEngineDropped => Expect::Ok,
        // Nothing is left to wait on; the engine frees a's memory as it
        // goes, so none of its work may move after the drop returned.
        Event::LocalEngineGone => Expect::NoBatch,
        // Revoked mid-way: "the requests the peer had under way included
        // (they fail)", on every path; dropping a grant "starts the same
        // revoke without waiting".
        Event::GrantRevoked | Event::GrantDropped => Expect::Err,
        // The NIC and staged paths need the connection (the NIC's queue
        // pairs, the owner's landing slots and credits): a closed peer,
        // a dead one or a cut wire fails what is in flight ("what is in
        // flight flushes and fails", "a peer that dies fails its batches").
        // A peer copy rides no queue pair (`close` fails what is in flight
        // on its queue pairs) and needs neither the wire nor the peer once
        // queued ("copies cannot be recalled"; the batch holds the owner's
        // region or the IPC mapping until they ran), and the grant was not
        // revoked: it may end either way.
        Event::LocalPeerClosed
        | Event::RemotePeerClosed
        | Event::RemoteEngineDropped
        | Event::ConnectionLost => {
            if peer_copy {
                Expect::Either
            } else {
                Expect::Err
            }
        }
    }
}

fn config(path: PathKind) -> EngineConfig {
    let base = EngineConfig::default()
        .with_qps_per_peer(1)
        .with_slice_size(4096)
        // A window of 16 slices per queue pair: the transfer takes several.
        .with_qp_depth(16)
        .with_default_timeout(DEADLINE)
        // A dead or closed peer is given up quickly.
        .with_reconnect_timeout(Duration::from_millis(300));
    match path {
        PathKind::Nic => base,
        PathKind::Staged => staged_through_slots(base),
        PathKind::PeerSameProcess | PathKind::PeerIpc => base.with_peer_copy_slice(64 * 1024),
    }
}

/// The world of `path` and the GPUs of a's and b's memory.
fn world(path: PathKind) -> (EngineWorld<SimVerbsApi>, u32, u32) {
    let config = config(path);
    match path {
        PathKind::Nic | PathKind::Staged => {
            (EngineWorld::sim(1, GpuConfig::default(), config, T), 0, 0)
        }
        PathKind::PeerSameProcess | PathKind::PeerIpc => {
            // One node, two GPUs; b in another simulated process for IPC
            // (as `sim_engine_peer_copy` builds it).
            let made: std::sync::Mutex<Option<SimCuda>> = Default::default();
            let ipc = path == PathKind::PeerIpc;
            let w = EngineWorld::sim_sides(1, (config.clone(), config), T, |fabric| {
                let mut made = made.lock().unwrap();
                match &*made {
                    None => {
                        let second = GpuConfig {
                            pci_bus_id: "0000:2a:00.0".into(),
                            ..GpuConfig::default()
                        };
                        let cuda =
                            SimCuda::new(vec![GpuConfig::default(), second], fabric.faults());
                        *made = Some(cuda.clone());
                        cuda
                    }
                    Some(first) if ipc => first.other_process(),
                    Some(first) => first.clone(),
                }
            });
            (w, 0, 1)
        }
    }
}

/// `len` bytes of GPU `ordinal`'s memory at `addr`, through a stream of
/// the process `cuda` (runs even while that GPU is paused).
fn read(cuda: &SimCuda, ordinal: u32, addr: u64, len: u64) -> Vec<u8> {
    let stream = cuda.context(ordinal).unwrap().create_stream().unwrap();
    let mut out = vec![0; len as usize];
    // SAFETY: `out` holds `len` bytes; callers name `len` bytes of device
    // memory a buffer, region or batch holds; synchronised before `out` is
    // read.
    unsafe { stream.copy_device_to_host(out.as_mut_ptr(), addr, out.len()) }.unwrap();
    stream.synchronize().unwrap();
    out
}

/// Copies `data` into GPU `ordinal`'s memory at `addr` (process `cuda`).
fn write(cuda: &SimCuda, ordinal: u32, addr: u64, data: &[u8]) {
    let stream = cuda.context(ordinal).unwrap().create_stream().unwrap();
    // SAFETY: callers name `data.len()` bytes of live device memory; the
    // stream is synchronised before `data` goes.
    unsafe { stream.copy_host_to_device(addr, data.as_ptr(), data.len()) }.unwrap();
    stream.synchronize().unwrap();
}

/// Where one side's GPU memory is (read only while a buffer or region of
/// it lives: reading freed memory would itself be reported).
struct Place {
    cuda: SimCuda,
    ordinal: u32,
    addr: u64,
}

impl Place {
    fn bytes(&self) -> Vec<u8> {
        read(&self.cuda, self.ordinal, self.addr, LEN)
    }
}

/// A case's objects, each dropped by its event or at the end (in this
/// order: the batch, then the grant, regions, buffers, peers, engines).
struct Objects {
    batch: Option<HeldBatch>,
    grant: Option<WorldGrant>,
    a_region: Option<Region>,
    b_region: Option<Region>,
    a_buf: Option<Mem>,
    b_buf: Option<Mem>,
    ab: Option<WorldPeer>,
    ba: Option<WorldPeer>,
    a: Option<Side<SimVerbsApi>>,
    b: Option<Side<SimVerbsApi>>,
}

impl Objects {
    fn a_alive(&self) -> bool {
        self.a_region.is_some() || self.a_buf.is_some()
    }

    fn b_alive(&self) -> bool {
        self.b_region.is_some() || self.b_buf.is_some()
    }
}

/// What the held work is waiting on, released after the event.
struct Hold {
    path: PathKind,
    fabric: SimFabric,
    a_cuda: SimCuda,
}

impl Hold {
    fn release(&self) {
        match self.path {
            PathKind::Nic | PathKind::Staged => self.fabric.set_paused(false),
            PathKind::PeerSameProcess | PathKind::PeerIpc => self.a_cuda.set_paused(false),
        }
    }
}

/// Bytes of `dst`'s transferred range equal to `src`'s: landed.
fn landed(dst: &[u8], src: &[u8]) -> usize {
    let r = GUARD as usize..(GUARD + X) as usize;
    dst[r.clone()]
        .iter()
        .zip(&src[r])
        .filter(|(d, s)| d == s)
        .count()
}

/// The first byte of `got` outside the transferred range that differs
/// from `was`, if any.
fn guard_broken(got: &[u8], was: &[u8]) -> Option<usize> {
    let (lo, hi) = (GUARD as usize, (GUARD + X) as usize);
    (0..lo).chain(hi..LEN as usize).find(|&i| got[i] != was[i])
}

/// Runs one case on a thread of its own, bounded by [`CASE_BOUND`];
/// returns what happened (for the summary) or panics naming the case.
fn case(path: PathKind, event: Event, op: Op) -> String {
    let name = format!("{path:?} {event:?} {op:?}");
    let (tx, rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            let _ = tx.send(run(path, event, op));
        })
        .unwrap();
    match rx.recv_timeout(CASE_BOUND) {
        Ok(summary) => {
            thread.join().unwrap();
            summary
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{name}: HANG: not over within {CASE_BOUND:?}")
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => match thread.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the case thread sends before it ends"),
        },
    }
}

/// The case itself (see the module docs for what it asserts).
fn run(path: PathKind, event: Event, op: Op) -> String {
    let what = format!("{path:?} {event:?} {op:?}");
    let started = Instant::now();
    let (w, a_gpu, b_gpu) = world(path);
    let fabric = w.fabric().clone();
    let (a_cuda, b_cuda) = (w.a.cuda.clone(), w.b.cuda.clone());
    let (a_buf, a_region) = w.a.gpu_on(a_gpu, LEN, SEED_A);
    let (b_buf, b_region) = w.b.gpu_on(b_gpu, LEN, SEED_B);
    let (grant, remote) = w.b_grants(&b_region, GrantRights::ReadWrite);
    check_path(&w, path, &a_region, &b_region, &remote);
    let a_place = Place {
        cuda: a_cuda.clone(),
        ordinal: a_gpu,
        addr: a_buf.addr(),
    };
    let b_place = Place {
        cuda: b_cuda.clone(),
        ordinal: b_gpu,
        addr: b_buf.addr(),
    };
    let (src_seed, dst_seed) = match op {
        Op::Write => (SEED_A, SEED_B),
        Op::Read => (SEED_B, SEED_A),
    };
    let (src, old) = (
        pattern(LEN as usize, src_seed),
        pattern(LEN as usize, dst_seed),
    );
    let dst_place = match op {
        Op::Write => &b_place,
        Op::Read => &a_place,
    };
    let transfer = match op {
        Op::Write => Transfer::write(&a_region, GUARD, &remote, GUARD, X),
        Op::Read => Transfer::read(&a_region, GUARD, &remote, GUARD, X),
    };
    let hold = Hold {
        path,
        fabric: fabric.clone(),
        a_cuda: a_cuda.clone(),
    };

    // Get the transfer in flight, held.
    let batch = match path {
        PathKind::Nic | PathKind::Staged => {
            let batch = w.ab.submit(&[transfer]).unwrap();
            let start = Instant::now();
            while landed(&dst_place.bytes(), &src) == 0 {
                assert!(start.elapsed() < T, "{what}: no byte ever landed");
                w.a.engine.progress();
            }
            fabric.set_paused(true);
            batch
        }
        PathKind::PeerSameProcess | PathKind::PeerIpc => {
            a_cuda.set_paused(true);
            w.ab.submit(&[transfer]).unwrap()
        }
    };
    let before = landed(&dst_place.bytes(), &src);
    assert_eq!(
        batch.status(),
        None,
        "{what}: the batch ended before the event"
    );
    assert!(
        (before as u64) < X,
        "{what}: all had landed before the event (the case proves nothing)"
    );

    let EngineWorld { ab, ba, a, b, .. } = w;
    let mut o = Objects {
        batch: Some(batch),
        grant: Some(grant),
        a_region: Some(a_region),
        b_region: Some(b_region),
        a_buf: Some(a_buf),
        b_buf: Some(b_buf),
        ab: Some(ab),
        ba: Some(ba),
        a: Some(a),
        b: Some(b),
    };

    // The event, then the hold released.
    let mut fence: Option<Vec<u8>> = None;
    let mut gone: Option<Vec<u8>> = None;
    match event {
        Event::LocalBufferDropped => drop(o.a_buf.take()),
        Event::RemoteBufferDropped => drop(o.b_buf.take()),
        Event::GrantRevoked => {
            // The hold is released 100 ms into the revoke, from another
            // thread: a revoke that waits for the work under way sees it
            // end; one that returns at once is checked against what moves
            // once the hold is released.
            let grant = o.grant.take().unwrap();
            fence = Some(std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(100));
                    hold.release();
                });
                let revoked = grant.revoke(T);
                revoked.unwrap_or_else(|e| panic!("{what}: the revoke did not complete: {e}"));
                // The granted memory as the fence left it (taken before
                // the scope waits for the releasing thread); for a READ the
                // owner first overwrites it (its memory again): the
                // requester must never see these bytes.
                if op == Op::Read {
                    let after = pattern(LEN as usize, SEED_AFTER_REVOKE);
                    write(&b_place.cuda, b_place.ordinal, b_place.addr, &after);
                }
                b_place.bytes()
            }));
        }
        Event::PeerHandlesDropped => {
            drop(o.ab.take());
            drop(o.ba.take());
        }
        Event::GrantDropped => {
            drop(o.grant.take());
            // The drop starts the revoke and returns; the requester learns
            // of it by a message. The hold stays 100 ms (as for
            // `GrantRevoked`), so the revoke reaches a while its transfer
            // is under way, whoever polls a's CQs: released at once, a
            // peer copy may end before a has looked at the message (a
            // thread spinning on a's CQs has them to itself, and a's own
            // driver may end the copy first), and the case would prove
            // nothing about the revoke.
            std::thread::sleep(Duration::from_millis(100));
        }
        Event::LocalPeerClosed => {
            // Held: the goodbye waits its second for the wire and the
            // queue pairs are disconnected with the transfer in flight
            // (released, a's own wait for the goodbye would move it on).
            let ab = o.ab.take().unwrap();
            ab.close()
                .unwrap_or_else(|e| panic!("{what}: closing the peer: {e}"));
        }
        Event::RemotePeerClosed => {
            // The goodbye needs the wire (else `close` waits 1 s for it);
            // a makes no progress meanwhile, so its transfer stays in
            // flight.
            hold.release();
            let ba = o.ba.take().unwrap();
            ba.close()
                .unwrap_or_else(|e| panic!("{what}: closing the peer: {e}"));
        }
        Event::LocalEngineDropped => {
            drop(o.ab.take());
            drop(o.a_region.take());
            drop(o.a_buf.take());
            drop(o.a.take());
        }
        Event::LocalEngineGone => {
            drop(o.batch.take());
            drop(o.ab.take());
            drop(o.a_region.take());
            drop(o.a_buf.take());
            drop(o.a.take());
            // What b holds now: nothing of a's may move from here on.
            gone = o.b_alive().then(|| b_place.bytes());
        }
        Event::RemoteEngineDropped => {
            drop(o.grant.take());
            drop(o.b_region.take());
            drop(o.b_buf.take());
            drop(o.ba.take());
            drop(o.b.take());
        }
        Event::ConnectionLost => {
            let b = o.b.as_ref().unwrap();
            b.verbs.set_port_state("sim0", 1, PortState::Down);
        }
    }
    hold.release();

    // Every broken promise of the case, reported together.
    let mut broken: Vec<String> = Vec::new();
    // Exactly one outcome, within the bound.
    let outcome = o.batch.as_ref().map(|batch| {
        let outcome = batch.wait(T);
        assert_ne!(
            outcome,
            Err(TransferError::Timeout(TimedOut { after: T })),
            "{what}: HANG: the batch never ended"
        );
        outcome
    });
    let dst_alive = match op {
        Op::Write => o.b_alive(),
        Op::Read => o.a_alive(),
    };
    // An outcome comes once nothing of the batch runs any more: whatever
    // else is under way settles, and the destination stays as it was.
    let ended = (dst_alive && outcome.is_some()).then(|| dst_place.bytes());
    std::thread::sleep(Duration::from_millis(50));
    if let (Some(batch), Some(outcome)) = (&o.batch, &outcome) {
        assert_eq!(&batch.wait(T), outcome, "{what}: a second wait differs");
        assert_eq!(batch.status().as_ref(), Some(outcome), "{what}: status()");
    }
    for (when, then) in [("after the outcome", &ended), ("after a was gone", &gone)] {
        if let (Some(then), true) = (then, dst_alive) {
            let now = dst_place.bytes();
            let changed = (0..LEN as usize).filter(|&i| now[i] != then[i]).count();
            if changed > 0 {
                broken.push(format!("{changed} bytes of the destination changed {when}"));
            }
        }
    }
    broken.extend(uses_after_free(&a_cuda, &b_cuda, "before teardown"));

    // The revocation fence: nothing moved under the grant since.
    if let Some(fenced) = &fence {
        let now = b_place.bytes();
        let changed = (0..LEN as usize).filter(|&i| now[i] != fenced[i]).count();
        if changed > 0 {
            broken.push(format!(
                "FENCE BROKEN: {changed} bytes of b's granted memory changed after the revoke \
                 returned"
            ));
        }
    }

    // The memory that is still alive: the source as it was, the
    // destination's guards as they were, its range old or new bytes (all
    // new on success).
    let src_alive = match op {
        Op::Write => o.a_alive(),
        Op::Read => o.b_alive() && fence.is_none(),
    };
    let mut moved = None;
    if dst_alive {
        let got = dst_place.bytes();
        if let Some(i) = guard_broken(&got, &old) {
            broken.push(format!("a byte outside the transferred range changed: {i}"));
        }
        let after_revoke = pattern(LEN as usize, SEED_AFTER_REVOKE);
        let range = GUARD as usize..(GUARD + X) as usize;
        let late = range
            .clone()
            .filter(|&i| fence.is_some() && got[i] == after_revoke[i])
            .count();
        if late > 0 {
            broken.push(format!(
                "FENCE BROKEN: {late} bytes READ from the grant after the revoke returned"
            ));
        }
        if let Some(i) = range.clone().find(|&i| {
            got[i] != old[i] && got[i] != src[i] && !(fence.is_some() && got[i] == after_revoke[i])
        }) {
            broken.push(format!(
                "byte {i} holds neither the old nor the transferred byte"
            ));
        }
        let n = landed(&got, &src);
        if outcome == Some(Ok(())) && late == 0 && n as u64 != X {
            broken.push(format!("ended Ok with {n} of {X} bytes moved"));
        }
        moved = Some(n);
    }
    if src_alive {
        let src_place = match op {
            Op::Write => &a_place,
            Op::Read => &b_place,
        };
        if src_place.bytes() != src {
            broken.push("the source changed".into());
        }
    }

    // The outcome the library promises.
    match (expected(path, event), &outcome) {
        (Expect::Ok, Some(Err(e))) => broken.push(format!("ended {e:?}, expected Ok")),
        (Expect::Err, Some(Ok(()))) => broken.push("ended Ok, expected an error".into()),
        (Expect::NoBatch, _) | (_, Some(_)) => {}
        (_, None) => broken.push("no outcome".into()),
    }

    let summary = format!(
        "{what}: {}; landed before the event {before}/{X}, after {}; {:?}",
        outcome.map_or("(no batch)".into(), |o| format!("{o:?}")),
        moved.map_or("(memory gone)".into(), |n| n.to_string()),
        started.elapsed()
    );
    // Teardown in order, the batch first (its memory may go with it).
    let Objects {
        batch,
        grant,
        a_region,
        b_region,
        a_buf,
        b_buf,
        ab,
        ba,
        a,
        b,
    } = o;
    drop((batch, grant, a_region, b_region, a_buf, b_buf, ab, ba, a, b));
    if broken.is_empty() {
        broken.extend(uses_after_free(&a_cuda, &b_cuda, "at teardown"));
    }
    assert!(broken.is_empty(), "{summary}: {}", broken.join("; "));
    summary
}

/// Each access to freed memory the simulated GPUs of a and b reported.
fn uses_after_free(a_cuda: &SimCuda, b_cuda: &SimCuda, when: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (side, cuda) in [("a", a_cuda), ("b", b_cuda)] {
        for ordinal in [0, 1] {
            let reports = cuda.use_after_free_reports(ordinal);
            if !reports.is_empty() {
                found.push(format!(
                    "USE AFTER FREE on {side}'s GPU {ordinal} {when}: {reports:?}"
                ));
            }
        }
    }
    found
}

/// The world took the path the case names.
fn check_path(
    w: &EngineWorld<SimVerbsApi>,
    path: PathKind,
    a_region: &Region,
    b_region: &Region,
    remote: &MemoryDescriptor,
) {
    let route = w.ab.route();
    match path {
        PathKind::Nic => {
            assert_eq!(a_region.rungs(), [Rung::Dmabuf]);
            assert_eq!(b_region.rungs(), [Rung::Dmabuf]);
            assert!(matches!(remote.reach, Reach::Direct(_)));
            assert_eq!(route, PeerCopyRoute::Nic);
        }
        PathKind::Staged => {
            assert_eq!(a_region.rungs(), [Rung::Staging]);
            assert_eq!(b_region.rungs(), [Rung::Staging]);
            assert!(matches!(remote.reach, Reach::Staged));
            assert_eq!(route, PeerCopyRoute::Nic);
        }
        PathKind::PeerSameProcess => assert_eq!(route, PeerCopyRoute::SameProcess),
        PathKind::PeerIpc => assert_eq!(route, PeerCopyRoute::Ipc),
    }
}

/// Every case of `path`; fails naming every case that failed, after
/// running them all.
fn matrix(path: PathKind) {
    let mut failed = Vec::new();
    for event in EVENTS {
        for op in [Op::Write, Op::Read] {
            match std::panic::catch_unwind(|| case(path, event, op)) {
                Ok(summary) => eprintln!("ok   {summary}"),
                Err(panic) => {
                    let message = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    eprintln!("FAIL {message}");
                    failed.push(message);
                }
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} case(s) failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[test]
fn the_nic_path_keeps_every_lifetime_promise() {
    matrix(PathKind::Nic);
}

#[test]
fn the_staged_path_keeps_every_lifetime_promise() {
    matrix(PathKind::Staged);
}

#[test]
fn the_peer_copy_path_of_one_process_keeps_every_lifetime_promise() {
    matrix(PathKind::PeerSameProcess);
}

#[test]
fn the_peer_copy_path_through_ipc_keeps_every_lifetime_promise() {
    matrix(PathKind::PeerIpc);
}
