//! Read-only memory (`Buffer::wrap_read_only`: an immutable Python
//! `bytes`, a constant table) through the engine, on every path that could
//! write it (simulated NICs and GPUs): the NIC path, the staging rung, peer
//! copy between two engines of one process, and a batch gated on a stream.
//! A grant of it with write rights and a READ into it are refused with a
//! typed error at the call, nothing granted or posted; it is granted for
//! reading, and WRITEs from it, as any memory; and its bytes never change.

use std::sync::Mutex;
use std::time::Duration;

use gdr_core::buffer::{Access, Buffer};
use gdr_core::descriptor::GrantRights;
use gdr_core::engine::{EngineConfig, EngineError, PeerCopyRoute, ReadOnlyUse, Region, Transfer};
use gdr_core::ladder::Rung;
use gdr_sim::{GpuConfig, SimCuda, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, Side, WorldBuffer, posted, staged_only};
use gdr_tests::pattern;
use hal_cuda::{Context as _, Driver as _};
use hal_verbs::{AccessFlags, MemoryRegion as _};

const T: Duration = Duration::from_secs(10);
const LEN: u64 = 64 << 10;

fn config() -> EngineConfig {
    EngineConfig::default().with_default_timeout(T)
}

/// A read-only buffer over `owner`'s memory (host, or GPU memory of
/// `owner`'s GPU), registered with `side`'s engine.
fn read_only(side: &Side<SimVerbsApi>, owner: &WorldBuffer) -> (WorldBuffer, Region) {
    let ctx = owner
        .device_ordinal()
        .map(|ordinal| side.driver.context(ordinal).unwrap());
    // SAFETY: `owner` holds the memory; every test drops this buffer (and
    // its region) before `owner`.
    let buffer =
        unsafe { Buffer::wrap_read_only(ctx.as_ref(), owner.addr(), owner.len(), None) }.unwrap();
    assert_eq!(buffer.access(), Access::ReadOnly);
    let region = side.engine.register_buffer(&buffer).unwrap();
    assert_eq!(region.access(), Access::ReadOnly);
    (buffer, region)
}

/// `peer`'s grants of `region` with write rights are refused as read-only
/// memory's, typed; nothing is granted.
fn write_grants_refused(peer: &gdr_tests::engine_world::WorldPeer, region: &Region) {
    for rights in [GrantRights::Write, GrantRights::ReadWrite] {
        match peer.grant(region, 0, region.len(), rights) {
            Err(EngineError::ReadOnly(ReadOnlyUse::WriteGrant { rights: asked })) => {
                assert_eq!(asked, rights);
            }
            other => panic!("a {rights:?} grant of read-only memory: {other:?}"),
        }
    }
}

/// A READ into `region` refused at submit, typed, with nothing posted;
/// behind a WRITE from it in one batch too, where `remote` takes WRITEs
/// (the batch is checked whole).
fn read_into_refused(
    w: &EngineWorld<SimVerbsApi>,
    region: &Region,
    remote: &gdr_core::descriptor::MemoryDescriptor,
) {
    let before = posted(&w.ab);
    let read = Transfer::read(region, 0, remote, 0, LEN);
    let write = Transfer::write(region, 0, remote, 0, LEN);
    let mut batches = vec![vec![read]];
    if remote.rights.allows_write() {
        batches.push(vec![write, read]);
    }
    for batch in batches {
        match w.ab.submit(&batch) {
            Err(EngineError::ReadOnly(ReadOnlyUse::ReadInto)) => {}
            other => panic!("a READ into read-only memory: {other:?}"),
        }
    }
    assert_eq!(posted(&w.ab), before, "nothing was posted");
}

#[test]
fn read_only_host_memory_is_granted_for_reading_only_and_never_read_into() {
    let w = EngineWorld::sim(1, GpuConfig::default(), config(), T);
    // b's constant: granted to a for reading only.
    let (b_owner, _) = w.b.host(LEN, 7);
    let (b_ro_buf, b_ro) = read_only(&w.b, &b_owner);
    // Its MR has no write access, local or remote.
    let mr = b_ro.registration(0).unwrap().mr().unwrap();
    assert!(
        !mr.access()
            .intersects(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE),
        "{:?}",
        mr.access()
    );
    write_grants_refused(&w.ba, &b_ro);
    let (read_grant, readable) = w.b_grants(&b_ro, GrantRights::Read);
    let (back_buf, back) = w.a.host(LEN, 0);
    w.ab.submit(&[Transfer::read(&back, 0, &readable, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(
        w.a.bytes(&back_buf) == pattern(LEN as usize, 7),
        "a READ of it"
    );

    // a's constant: WRITTEN from, never READ into.
    let (a_owner, _) = w.a.host(LEN, 9);
    let (a_ro_buf, a_ro) = read_only(&w.a, &a_owner);
    let (dst_buf, dst) = w.b.host(LEN, 0);
    let (write_grant, writable) = w.b_grants(&dst, GrantRights::ReadWrite);
    read_into_refused(&w, &a_ro, &writable);
    read_into_refused(&w, &a_ro, &readable);
    w.ab.submit(&[Transfer::write(&a_ro, 0, &writable, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(
        w.b.bytes(&dst_buf) == pattern(LEN as usize, 9),
        "a WRITE from it"
    );

    drop((read_grant, write_grant, b_ro, a_ro, back, dst));
    drop((b_ro_buf, a_ro_buf, back_buf, dst_buf));
    assert!(
        w.b.bytes(&b_owner) == pattern(LEN as usize, 7),
        "b's unchanged"
    );
    assert!(
        w.a.bytes(&a_owner) == pattern(LEN as usize, 9),
        "a's unchanged"
    );
}

/// The staging rung writes local memory with GPU copies, not the NIC, and
/// a staged grant has no MR to carry rights: the engine's own checks are
/// all that stands between it and the memory.
#[test]
fn read_only_staged_gpu_memory_is_neither_granted_for_writing_nor_read_into() {
    let w = EngineWorld::sim(1, GpuConfig::default(), staged_only(config()), T);
    let (b_owner, _) = w.b.gpu(LEN, 3);
    let (b_ro_buf, b_ro) = read_only(&w.b, &b_owner);
    assert_eq!(b_ro.rungs(), vec![Rung::Staging]);
    write_grants_refused(&w.ba, &b_ro);
    let (read_grant, readable) = w.b_grants(&b_ro, GrantRights::Read);
    let (back_buf, back) = w.a.host(LEN, 0);
    w.ab.submit(&[Transfer::read(&back, 0, &readable, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(
        w.a.bytes(&back_buf) == pattern(LEN as usize, 3),
        "a staged READ of it"
    );

    let (a_owner, _) = w.a.gpu(LEN, 5);
    let (a_ro_buf, a_ro) = read_only(&w.a, &a_owner);
    assert_eq!(a_ro.rungs(), vec![Rung::Staging]);
    let (dst_buf, dst) = w.b.host(LEN, 0);
    let (write_grant, writable) = w.b_grants(&dst, GrantRights::ReadWrite);
    read_into_refused(&w, &a_ro, &writable);
    read_into_refused(&w, &a_ro, &readable);
    // Gated on a stream: refused at the call too.
    let stream =
        gdr_core::Stream::from_erased(0, w.a.driver.context(0).unwrap().create_stream().unwrap());
    let read = Transfer::read(&a_ro, 0, &writable, 0, LEN);
    assert!(
        matches!(
            w.ab.submit_after_stream(&stream, &[read], Some(T)),
            Err(EngineError::ReadOnly(ReadOnlyUse::ReadInto))
        ),
        "a gated READ into read-only memory"
    );
    w.ab.submit(&[Transfer::write(&a_ro, 0, &writable, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(
        w.b.bytes(&dst_buf) == pattern(LEN as usize, 5),
        "a staged WRITE from it"
    );

    drop((read_grant, write_grant, b_ro, a_ro, back, dst, stream));
    drop((b_ro_buf, a_ro_buf, back_buf, dst_buf));
    assert!(
        w.b.bytes(&b_owner) == pattern(LEN as usize, 3),
        "b's unchanged"
    );
    assert!(
        w.a.bytes(&a_owner) == pattern(LEN as usize, 5),
        "a's unchanged"
    );
}

/// Two engines of one process, a's memory on GPU 0 and b's on GPU 1: the
/// peer-copy path's device copies are refused the same way.
#[test]
fn read_only_gpu_memory_is_not_written_by_peer_copy() {
    let made: Mutex<Option<SimCuda>> = Mutex::new(None);
    let w = EngineWorld::sim_sides(1, (config(), config()), T, |fabric| {
        let mut made = made.lock().unwrap();
        made.get_or_insert_with(|| {
            let second = GpuConfig {
                pci_bus_id: "0000:2a:00.0".into(),
                ..GpuConfig::default()
            };
            SimCuda::new(vec![GpuConfig::default(), second], fabric.faults())
        })
        .clone()
    });
    assert_eq!(w.ab.route(), PeerCopyRoute::SameProcess);
    let (b_owner, _) = w.b.gpu_on(1, LEN, 11);
    let (b_ro_buf, b_ro) = read_only(&w.b, &b_owner);
    write_grants_refused(&w.ba, &b_ro);
    let (read_grant, readable) = w.b_grants(&b_ro, GrantRights::Read);
    let (back_buf, back) = w.a.gpu_on(0, LEN, 0);
    let stats = w.a.engine.peer_copy_stats();
    w.ab.submit(&[Transfer::read(&back, 0, &readable, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(w.a.engine.peer_copy_stats().batches, stats.batches + 1);
    assert!(
        w.a.bytes(&back_buf) == pattern(LEN as usize, 11),
        "a peer-copy READ of it"
    );

    let (a_owner, _) = w.a.gpu_on(0, LEN, 13);
    let (a_ro_buf, a_ro) = read_only(&w.a, &a_owner);
    let (dst_buf, dst) = w.b.gpu_on(1, LEN, 0);
    let (write_grant, writable) = w.b_grants(&dst, GrantRights::ReadWrite);
    let stats = w.a.engine.peer_copy_stats();
    read_into_refused(&w, &a_ro, &writable);
    read_into_refused(&w, &a_ro, &readable);
    assert_eq!(w.a.engine.peer_copy_stats(), stats, "no copy was queued");
    w.ab.submit(&[Transfer::write(&a_ro, 0, &writable, 0, LEN)])
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(
        w.b.bytes(&dst_buf) == pattern(LEN as usize, 13),
        "a peer-copy WRITE from it"
    );

    drop((read_grant, write_grant, b_ro, a_ro, back, dst));
    drop((b_ro_buf, a_ro_buf, back_buf, dst_buf));
    assert!(
        w.b.bytes(&b_owner) == pattern(LEN as usize, 11),
        "b's unchanged"
    );
    assert!(
        w.a.bytes(&a_owner) == pattern(LEN as usize, 13),
        "a's unchanged"
    );
}
