//! The transfer engine between two SoftRoCE guests on a virtual wire
//! (`softroce/two-guest-engine.sh`): one engine per guest, so every byte
//! crosses the wire (rxe's UDP packets, virtio-net, a QEMU datagram
//! socket), where `rxe_engine.rs`'s two engines share one rxe0.
//!
//! Each test is one side of a two-guest run, picked by `GDR_WIRE_ROLE`
//! (`server` in guest A, `client` in guest B); without it the test skips
//! and says why (the one-guest VM stage runs this binary too).
//!
//! - `engine_wire_large_batches`: A grants 32 MiB; B READs it, WRITEs its
//!   own pattern over it and READs that back, each a single batch of 32
//!   transfers sliced over 4 queue pairs (slices and bytes counted per
//!   queue pair); A checks the WRITE landed, B the READs, byte for byte.
//! - `engine_wire_two_nics`: the same WRITE and READ back with B connected
//!   over two paths, rxe0 to A's rxe0 and rxe1 to A's rxe1, each on a wire
//!   of its own (`RXEVM_PAIR_WIRES=2`): the queue pairs alternate between
//!   the two NICs, and each NIC's share is checked in the engine's counters
//!   and in its netdev's transmit counter.
//! - `engine_wire_peer_killed`: A holds the connection until its guest is
//!   killed; B keeps two WRITE batches in flight, prints
//!   `GDR_WIRE_TRANSFERS_RUNNING` once some succeeded, and once A's guest
//!   is gone checks that every batch in flight, and one submitted after,
//!   ends by itself with a typed [`TransferError`] (its `DEAD-PEER` line
//!   says which and when).
//!
//! Env: `GDR_WIRE_ROLE`; `GDR_WIRE_PEER` and `GDR_WIRE_PEER2`, A's address
//! on wire 0 and wire 1 (10.99.0.1, 10.99.1.1); `GDR_WIRE_PORT`, the first
//! test's port (7480; each test listens on its own); `GDR_WIRE_ACK_TIMEOUT`,
//! the queue pairs' ACK timeout code (see [`ack_timeout`]).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::MutexGuard;
use std::thread;
use std::time::{Duration, Instant};

use gdr_core::buffer::Buffer;
use gdr_core::descriptor::{GrantRights, MemoryDescriptor};
use gdr_core::engine::{
    Batch, Driver, Engine, EngineConfig, EngineError, Path, Peer, QpCounters, Region, RegionGrant,
    Transfer, TransferError,
};
use gdr_sim::SimCudaApi;

use gdr_tests::rxe::{self, serial};
use gdr_tests::{pattern, skip};
use hal_verbs::rdma::{RdmaApi, RdmaProvider};
use hal_verbs::{AddressFamily, ConnectParams, Context as _, Provider as _};

type WireEngine = Engine<RdmaApi, SimCudaApi>;
type WirePeer = Peer<RdmaApi, SimCudaApi>;
type WireRegion = Region<RdmaApi>;
type WireGrant = RegionGrant<RdmaApi, SimCudaApi>;
/// Counters' growth per queue pair (index, NIC).
type Grown = Vec<(u16, String, QpCounters)>;

/// Bound on connecting (the other guest boots in no fixed order) and on
/// waiting for the other side's next step.
const SETUP: Duration = Duration::from_secs(300);
/// Bound on one batch: generous, for a software NIC on a virtual wire
/// under software emulation (32 MiB took 2-13 s).
const BATCH: Duration = Duration::from_secs(120);
const QPS: u16 = 4;
const SLICE: u64 = 256 << 10;
const LEN: u64 = 32 << 20;
/// Transfers per batch: 1 MiB each, 4 slices each.
const TRANSFERS: u64 = 32;
const SERVER_SEED: u8 = 7;
const CLIENT_SEED: u8 = 1;

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Guest A: listens, grants, checks what arrived.
    Server,
    /// Guest B: connects and moves the data.
    Client,
}

/// This guest's side of a test. Field order is drop order: the engine
/// before the provider it was opened from, the lock last.
struct Guest {
    role: Role,
    engine: WireEngine,
    provider: RdmaProvider,
    _serial: MutexGuard<'static, ()>,
}

/// This guest's side of `test`, with an engine on `devices`; `None` after
/// printing why `test` skips.
fn guest(test: &str, devices: &[&str]) -> Option<Guest> {
    let role = match env("GDR_WIRE_ROLE").as_deref() {
        None => {
            skip(
                test,
                "GDR_WIRE_ROLE is not set (softroce/two-guest-engine.sh sets it)",
            );
            return None;
        }
        Some("server") => Role::Server,
        Some("client") => Role::Client,
        Some(other) => panic!("GDR_WIRE_ROLE={other}: expected server or client"),
    };
    let serial = serial();
    let (provider, _ctx) = rxe::open_rxe(test)?;
    let engine = WireEngine::new(&provider, None, config(devices))
        .unwrap_or_else(|e| panic!("{test}: an engine on {devices:?}: {e}"));
    assert_eq!(engine.nics(), devices);
    Some(Guest {
        role,
        engine,
        provider,
        _serial: serial,
    })
}

fn port(offset: u16) -> u16 {
    env("GDR_WIRE_PORT").map_or(7480, |p| p.parse().expect("GDR_WIRE_PORT")) + offset
}

fn peer_ip(var: &str, default: &str) -> IpAddr {
    env(var)
        .as_deref()
        .unwrap_or(default)
        .parse()
        .unwrap_or_else(|e| panic!("{var}: {e}"))
}

/// The queue pairs' ACK timeout code: `GDR_WIRE_ACK_TIMEOUT`, default 18
/// (~1.07 s a try; with the HAL's 3 retries a dead peer fails requests
/// after ~4 s). The HAL's default, 14 (~67 ms a try), failed a 32 MiB READ
/// with "retry exceeded" between two live guests on a loaded host (both
/// vCPUs starved for ~0.3 s); `GDR_WIRE_ACK_TIMEOUT=14` measures it.
fn ack_timeout() -> u8 {
    env("GDR_WIRE_ACK_TIMEOUT").map_or(18, |c| c.parse().expect("GDR_WIRE_ACK_TIMEOUT"))
}

/// The path to A's test at `port(offset)` over wire 0, by the route.
fn path_to_a(offset: u16) -> Path {
    Path {
        source: None,
        peer: SocketAddr::new(peer_ip("GDR_WIRE_PEER", "10.99.0.1"), port(offset)),
    }
}

fn config(devices: &[&str]) -> EngineConfig {
    EngineConfig {
        qps_per_peer: QPS,
        slice_size: SLICE,
        default_timeout: BATCH,
        devices: Some(devices.iter().map(|d| (*d).to_owned()).collect()),
        connect: ConnectParams {
            ack_timeout: Some(ack_timeout()),
            ..ConnectParams::default()
        },
        ..EngineConfig::default()
    }
}

/// `len` bytes of host memory holding `data` (zeros when empty),
/// registered.
fn host(engine: &WireEngine, len: u64, data: &[u8]) -> (Buffer<SimCudaApi>, WireRegion) {
    let buffer = Buffer::alloc_host(len);
    if !data.is_empty() {
        buffer.write_at(0, data).unwrap();
    }
    let region = engine.register(&buffer).unwrap();
    (buffer, region)
}

/// The next control message, polling gently: the idle side must not keep
/// a host core busy that the other guest's rxe work needs.
fn recv(peer: &WirePeer, timeout: Duration) -> Vec<u8> {
    let deadline = Instant::now() + timeout;
    loop {
        peer.engine().progress();
        match peer.recv(Duration::ZERO) {
            Ok(message) => return message,
            Err(EngineError::Timeout(_)) if Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("waiting for the peer's message: {e}"),
        }
    }
}

fn send(peer: &WirePeer, message: &[u8]) {
    peer.send(message)
        .unwrap()
        .wait(BATCH)
        .unwrap_or_else(|e| panic!("sending {:?}: {e}", String::from_utf8_lossy(message)));
}

/// A's side: listens on every address at `port`, accepts B, grants it
/// `region` (sending the grant's id), and returns the peer and the grant.
fn serve(test: &str, engine: &WireEngine, port: u16, region: &WireRegion) -> (WirePeer, WireGrant) {
    let mut listener = engine
        .listen(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
        .unwrap_or_else(|e| panic!("{test}: listening on port {port}: {e}"));
    eprintln!("{test}: server listening on {}", listener.local_addr());
    // A connect request that B's rdma_cm gave up on (a ~1 s attempt,
    // retried) can fail to accept here under emulation: accept again.
    let start = Instant::now();
    let peer = loop {
        match listener.accept(SETUP.saturating_sub(start.elapsed())) {
            Ok(peer) => break peer,
            Err(e @ EngineError::Timeout(_)) => panic!("{test}: accepting: {e}"),
            Err(e) => eprintln!("{test}: server: accepting failed ({e}); accepting again"),
        }
    };
    eprintln!("{test}: server accepted {:?}", peer.addr());
    let grant = peer
        .grant(region, 0, region.len(), GrantRights::ReadWrite)
        .unwrap();
    send(&peer, &grant.descriptor().grant.to_le_bytes());
    (peer, grant)
}

/// B's side: connects over `paths` (retrying until A listens) and waits
/// for A's grant. A driver thread makes progress from then on (backing
/// off while idle: a busy poller would keep a host core from the other
/// guest's rxe work).
fn connect(
    test: &str,
    engine: &WireEngine,
    paths: &[Path],
) -> (WirePeer, MemoryDescriptor, Driver) {
    // One attempt may take all the time left (rdma_cm's connect retries
    // while nobody listens); a shorter one could fail after A accepted
    // (under emulation) and leave A a dead peer. Retried: what fails at
    // once (no route yet).
    let start = Instant::now();
    let peer = loop {
        match engine.connect_paths(paths, SETUP.saturating_sub(start.elapsed())) {
            Ok(peer) => break peer,
            Err(e) if start.elapsed() < SETUP => {
                eprintln!("{test}: client: A not ready yet ({e}); retrying");
                thread::sleep(Duration::from_millis(500));
            }
            Err(e) => panic!("{test}: connecting over {paths:?}: {e}"),
        }
    };
    eprintln!(
        "{test}: client connected over {} path(s) in {:?}",
        paths.len(),
        start.elapsed()
    );
    let id = u64::from_le_bytes(recv(&peer, SETUP).try_into().expect("a grant id"));
    let remote = peer.wait_grant(id, SETUP).unwrap();
    let driver = engine.spawn_driver();
    (peer, remote, driver)
}

/// Waits for a batch submitted with bound [`BATCH`] to end by itself (with
/// room to spare: a wait that gives up would hide a hang).
fn ended(batch: &Batch<RdmaApi, SimCudaApi>) -> Result<(), TransferError> {
    let _ = batch.cell().wait(Some(BATCH + Duration::from_secs(30)));
    batch
        .status()
        .expect("the batch ended within its own bound (it hung)")
}

/// Moves all of `local` to or from `remote` as one batch of `TRANSFERS`
/// transfers; checks every queue pair took an equal share of slices and
/// bytes in one doorbell; returns how long it took and the counters'
/// growth.
fn batch(
    peer: &WirePeer,
    write: bool,
    local: &WireRegion,
    remote: &MemoryDescriptor,
) -> (Duration, Grown) {
    let piece = LEN / TRANSFERS;
    let transfers: Vec<_> = (0..TRANSFERS)
        .map(|i| {
            let at = i * piece;
            if write {
                Transfer::write(local, at, remote, at, piece)
            } else {
                Transfer::read(local, at, remote, at, piece)
            }
        })
        .collect();
    let before = peer.counters();
    let start = Instant::now();
    let op = if write { "WRITE" } else { "READ" };
    ended(&peer.submit(&transfers).unwrap()).unwrap_or_else(|e| panic!("{op} of {LEN} bytes: {e}"));
    let took = start.elapsed();
    let after = peer.counters();
    assert_eq!(after.len(), usize::from(QPS), "{after:?}");
    let slices = LEN / SLICE;
    let grown: Vec<_> = before
        .iter()
        .zip(&after)
        .map(|((qp, nic, c0), (_, _, c1))| {
            let d = QpCounters {
                posted: c1.posted - c0.posted,
                bytes: c1.bytes - c0.bytes,
                doorbells: c1.doorbells - c0.doorbells,
                signaled: c1.signaled - c0.signaled,
            };
            assert_eq!(d.posted, slices / u64::from(QPS), "{op}: slices on {qp}");
            assert_eq!(d.bytes, LEN / u64::from(QPS), "{op}: bytes on {qp}");
            assert_eq!(d.doorbells, 1, "{op}: one doorbell on {qp}");
            (*qp, nic.clone(), d)
        })
        .collect();
    (took, grown)
}

/// A's half of checking B's WRITE: once B says it wrote, A's memory must
/// hold B's pattern; A says it checked, and keeps its grant until B is done
/// READing back.
fn server_checks_write(peer: &WirePeer, buffer: &Buffer<SimCudaApi>, what: &str) {
    assert_eq!(recv(peer, SETUP), b"written");
    assert!(
        buffer.to_vec().unwrap() == pattern(LEN as usize, CLIENT_SEED),
        "{what}"
    );
    send(peer, b"checked");
    assert_eq!(recv(peer, SETUP), b"done");
}

/// B's half: says it wrote, waits until A checked.
fn client_wrote(peer: &WirePeer) {
    send(peer, b"written");
    assert_eq!(recv(peer, SETUP), b"checked", "A checked the WRITE");
}

fn mib_s(took: Duration) -> f64 {
    LEN as f64 / took.as_secs_f64() / f64::from(1 << 20)
}

#[test]
fn engine_wire_large_batches() {
    const T: &str = "engine_wire_large_batches";
    let Some(guest) = guest(T, &["rxe0"]) else {
        return;
    };
    let engine = &guest.engine;
    match guest.role {
        Role::Server => {
            let (buffer, region) = host(engine, LEN, &pattern(LEN as usize, SERVER_SEED));
            let (peer, grant) = serve(T, engine, port(0), &region);
            server_checks_write(&peer, &buffer, "the client's WRITE landed whole");
            drop(grant);
            eprintln!("{T}: server: the client's 32 MiB WRITE arrived intact: ok");
        }
        Role::Client => {
            let (peer, remote, _driver) = connect(T, engine, &[path_to_a(0)]);
            assert_eq!(remote.len, LEN);
            let (read_buf, read) = host(engine, LEN, &[]);
            let (read_took, _) = batch(&peer, false, &read, &remote);
            assert!(
                read_buf.to_vec().unwrap() == pattern(LEN as usize, SERVER_SEED),
                "READ brought A's pattern"
            );
            drop((read, read_buf));
            let mine = pattern(LEN as usize, CLIENT_SEED);
            let (_src_buf, src) = host(engine, LEN, &mine);
            let (write_took, _) = batch(&peer, true, &src, &remote);
            client_wrote(&peer);
            let (back_buf, back) = host(engine, LEN, &[]);
            let (back_took, _) = batch(&peer, false, &back, &remote);
            assert!(
                back_buf.to_vec().unwrap() == mine,
                "READ back what was written"
            );
            send(&peer, b"done");
            eprintln!(
                "{T}: client: {} MiB in batches of {TRANSFERS} transfers, {QPS} QPs, {} KiB \
                 slices, over the wire: READ {read_took:.2?} ({:.1} MiB/s), WRITE \
                 {write_took:.2?} ({:.1} MiB/s), READ back {back_took:.2?} ({:.1} MiB/s)",
                LEN >> 20,
                SLICE >> 10,
                mib_s(read_took),
                mib_s(write_took),
                mib_s(back_took)
            );
        }
    }
}

/// This guest's RoCE v2 IPv4 address on `device`.
fn address(provider: &RdmaProvider, device: &str) -> IpAddr {
    let table = provider.open(device).unwrap().gid_table(1).unwrap();
    hal_verbs::select_roce_v2_gid(&table, AddressFamily::V4)
        .unwrap_or_else(|| panic!("{device} has no RoCE v2 IPv4 address"))
        .gid
        .to_ip()
}

/// Bytes sent by the netdev under `device` (rxe's packets leave by it).
fn tx_bytes(device: &str) -> u64 {
    let ndev = std::fs::read_to_string(format!(
        "/sys/class/infiniband/{device}/ports/1/gid_attrs/ndevs/0"
    ))
    .unwrap_or_else(|e| panic!("{device}'s netdev: {e}"));
    std::fs::read_to_string(format!(
        "/sys/class/net/{}/statistics/tx_bytes",
        ndev.trim()
    ))
    .unwrap()
    .trim()
    .parse()
    .unwrap()
}

/// Bytes per NIC in `grown`, in `nics`' order.
fn bytes_by_nic(grown: &Grown, nics: &[&str]) -> Vec<u64> {
    nics.iter()
        .map(|nic| {
            grown
                .iter()
                .filter(|(_, n, _)| n == nic)
                .map(|(_, _, c)| c.bytes)
                .sum()
        })
        .collect()
}

#[test]
fn engine_wire_two_nics() {
    const T: &str = "engine_wire_two_nics";
    const NICS: [&str; 2] = ["rxe0", "rxe1"];
    let Some(guest) = guest(T, &NICS) else {
        return;
    };
    let engine = &guest.engine;
    match guest.role {
        Role::Server => {
            let (buffer, region) = host(engine, LEN, &[]);
            let (peer, grant) = serve(T, engine, port(1), &region);
            assert_eq!(
                grant.descriptor().devices().collect::<Vec<_>>(),
                NICS,
                "the grant reaches A over both NICs"
            );
            server_checks_write(
                &peer,
                &buffer,
                "the client's WRITE over two NICs landed whole",
            );
            drop(grant);
            eprintln!("{T}: server: the WRITE over rxe0 and rxe1 arrived intact: ok");
        }
        Role::Client => {
            let paths = [
                ("rxe0", peer_ip("GDR_WIRE_PEER", "10.99.0.1")),
                ("rxe1", peer_ip("GDR_WIRE_PEER2", "10.99.1.1")),
            ]
            .map(|(nic, ip)| Path {
                source: Some(address(&guest.provider, nic)),
                peer: SocketAddr::new(ip, port(1)),
            });
            let (peer, remote, _driver) = connect(T, engine, &paths);
            let nics: Vec<String> = peer.counters().into_iter().map(|(_, n, _)| n).collect();
            assert_eq!(
                nics,
                ["rxe0", "rxe1", "rxe0", "rxe1"],
                "queue pairs alternate between the paths"
            );
            assert_eq!(remote.devices().collect::<Vec<_>>(), NICS);
            assert_eq!(remote.len, LEN);
            let mine = pattern(LEN as usize, CLIENT_SEED);
            let (_src_buf, src) = host(engine, LEN, &mine);
            let sent: Vec<u64> = NICS.iter().map(|d| tx_bytes(d)).collect();
            let (write_took, grown) = batch(&peer, true, &src, &remote);
            let on_wire: Vec<u64> = NICS
                .iter()
                .zip(&sent)
                .map(|(d, before)| tx_bytes(d) - before)
                .collect();
            let per_nic = bytes_by_nic(&grown, &NICS);
            assert!(per_nic.iter().all(|&b| b > 0), "both NICs carried some");
            assert_eq!(per_nic.iter().sum::<u64>(), LEN, "and together all");
            for ((nic, &engine_bytes), &wire_bytes) in NICS.iter().zip(&per_nic).zip(&on_wire) {
                assert!(
                    wire_bytes >= engine_bytes,
                    "{nic}'s wire carried its {engine_bytes} bytes (sent {wire_bytes})"
                );
            }
            client_wrote(&peer);
            let (back_buf, back) = host(engine, LEN, &[]);
            let (back_took, grown) = batch(&peer, false, &back, &remote);
            let per_nic_back = bytes_by_nic(&grown, &NICS);
            assert!(per_nic_back.iter().all(|&b| b > 0));
            assert_eq!(per_nic_back.iter().sum::<u64>(), LEN);
            assert!(
                back_buf.to_vec().unwrap() == mine,
                "READ back over two NICs what was written"
            );
            send(&peer, b"done");
            eprintln!(
                "{T}: client: {} MiB over rxe0+rxe1 ({QPS} QPs): WRITE {write_took:.2?} \
                 ({:.1} MiB/s; engine bytes per NIC {per_nic:?}, netdev tx bytes {on_wire:?}), \
                 READ back {back_took:.2?} ({:.1} MiB/s; per NIC {per_nic_back:?})",
                LEN >> 20,
                mib_s(write_took),
                mib_s(back_took)
            );
        }
    }
}

/// Bytes per WRITE batch of the kill test, and batches kept in flight.
const KILL_BATCH: u64 = 8 << 20;
const KILL_DEPTH: usize = 2;
/// Successful batches before the client says the transfers run.
const RUNNING_AFTER: u64 = 3;

/// Whether `e` is one of the ways a dead peer may end a request.
fn is_dead_peer(e: &TransferError) -> bool {
    matches!(
        e,
        TransferError::RetryExceeded { .. }
            | TransferError::PeerGone(_)
            | TransferError::Flushed { .. }
            | TransferError::Timeout(_)
    )
}

#[test]
fn engine_wire_peer_killed() {
    const T: &str = "engine_wire_peer_killed";
    let Some(guest) = guest(T, &["rxe0"]) else {
        return;
    };
    let engine = &guest.engine;
    match guest.role {
        Role::Server => {
            let (_buffer, region) = host(engine, KILL_BATCH, &[]);
            let (_peer, _grant) = serve(T, engine, port(2), &region);
            eprintln!("{T}: server holding the connection until its guest is killed");
            thread::sleep(Duration::from_secs(600));
            panic!("{T}: the server's guest was not killed");
        }
        Role::Client => {
            let (peer, remote, _driver) = connect(T, engine, &[path_to_a(2)]);
            let (_src_buf, src) = host(engine, KILL_BATCH, &[]);
            let piece = KILL_BATCH / 8;
            let transfers: Vec<_> = (0..8)
                .map(|i| Transfer::write(&src, i * piece, &remote, i * piece, piece))
                .collect();
            let mut in_flight = std::collections::VecDeque::new();
            let (mut ok, mut last_ok) = (0u64, Instant::now());
            let (failed, error) = loop {
                while in_flight.len() < KILL_DEPTH {
                    let batch = peer
                        .submit_with_timeout(&transfers, BATCH)
                        .unwrap_or_else(|e| panic!("submit while A was up: {e}"));
                    in_flight.push_back((batch, Instant::now()));
                }
                let (batch, at) = in_flight.pop_front().expect("in flight");
                match ended(&batch) {
                    Ok(()) => {
                        ok += 1;
                        last_ok = Instant::now();
                        if ok == RUNNING_AFTER {
                            eprintln!("GDR_WIRE_TRANSFERS_RUNNING");
                        }
                    }
                    Err(e) => break (at, e),
                }
            };
            let failed_at = Instant::now();
            eprintln!(
                "{T}: DEAD-PEER: a WRITE batch of {} MiB failed with {error:?} ({error}); \
                 {:.2?} after its submission, {:.2?} after the last success ({ok} batches \
                 ok before)",
                KILL_BATCH >> 20,
                failed_at - failed,
                failed_at - last_ok
            );
            assert!(ok >= RUNNING_AFTER, "A died before the transfers ran");
            assert!(is_dead_peer(&error), "{error:?}");
            // The rest of what was in flight ends too, each by itself.
            for (batch, _) in in_flight {
                let e = ended(&batch).expect_err("a batch in flight when A died");
                eprintln!("{T}: the batch in flight with it: {e:?}");
                assert!(is_dead_peer(&e), "{e:?}");
            }
            // And so does anything submitted now: refused, or failed.
            let start = Instant::now();
            match peer.submit_with_timeout(&transfers, BATCH) {
                Err(e) => {
                    eprintln!("{T}: a submit after the failure is refused: {e}");
                    assert!(matches!(e, EngineError::PeerGone(_)), "{e}");
                }
                Ok(batch) => {
                    let e = ended(&batch).expect_err("a batch submitted after A died");
                    eprintln!(
                        "{T}: a batch submitted after the failure failed in {:.2?}: {e:?}",
                        start.elapsed()
                    );
                    assert!(is_dead_peer(&e), "{e:?}");
                }
            }
        }
    }
}
