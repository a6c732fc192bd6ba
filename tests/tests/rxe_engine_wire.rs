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
//! - With the wire really cut (`softroce/two-guest-wire.sh`, one wire):
//!   `engine_wire_cut_silent` (packets dropped with the link up),
//!   `engine_wire_cut_link` (the cable pulled), `engine_wire_cut_outlasting`
//!   (a cut past the reconnect bound), `engine_wire_flapping` (a minute of
//!   flapping), `engine_wire_impaired` (netem delay and loss): see the
//!   section below and softroce/README.md.
//!
//! Env: `GDR_WIRE_ROLE`; `GDR_WIRE_PEER` and `GDR_WIRE_PEER2`, A's address
//! on wire 0 and wire 1 (10.99.0.1, 10.99.1.1); `GDR_WIRE_PORT`, the first
//! test's port (7480; each test listens on its own); `GDR_WIRE_ACK_TIMEOUT`,
//! the queue pairs' ACK timeout code (see [`ack_timeout`]);
//! `GDR_WIRE_RETRY`, their transport retries (see [`retry_count`] and
//! [`impaired_retry`]); `GDR_WIRE_NETEM`, the impaired test's netem words.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::MutexGuard;
use std::thread;
use std::time::{Duration, Instant};

use gdr_core::buffer::Buffer;
use gdr_core::descriptor::{GrantRights, MemoryDescriptor};
use gdr_core::engine::{
    Batch, Driver, Engine, EngineConfig, EngineError, Grant, Path, Peer, QpCounters, Region,
    Transfer, TransferError,
};

use gdr_tests::rxe::{self, serial};
use gdr_tests::{pattern, skip};
use hal_verbs::rdma::{RdmaApi, RdmaProvider};
use hal_verbs::{AddressFamily, ConnectParams, Context as _, Provider as _};

type WireEngine = Engine;
type WirePeer = Peer;
type WireRegion = Region;
type WireGrant = Grant;
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
    guest_with(test, config(devices))
}

/// The same with the engine's config `config`.
fn guest_with(test: &str, config: EngineConfig) -> Option<Guest> {
    let devices = config.devices.clone().expect("devices named");
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
    let engine = WireEngine::new(
        &hal_verbs::dynamic::DynProvider::new::<RdmaApi>(provider.clone()),
        None,
        config,
    )
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
    EngineConfig::default()
        .with_qps_per_peer(QPS)
        .with_slice_size(SLICE)
        .with_default_timeout(BATCH)
        .with_devices(devices.iter().map(|d| (*d).to_owned()))
        .with_connect(ConnectParams {
            ack_timeout: Some(ack_timeout()),
            retry_count: retry_count(),
            ..ConnectParams::default()
        })
}

/// The queue pairs' transport retries: `GDR_WIRE_RETRY`, default the
/// HAL's (3).
fn retry_count() -> u8 {
    env("GDR_WIRE_RETRY").map_or(ConnectParams::default().retry_count, |c| {
        c.parse().expect("GDR_WIRE_RETRY")
    })
}

/// `len` bytes of host memory holding `data` (zeros when empty),
/// registered.
fn host(engine: &WireEngine, len: u64, data: &[u8]) -> (Buffer, WireRegion) {
    let buffer = Buffer::alloc_host(len);
    if !data.is_empty() {
        buffer.write_at(0, data).unwrap();
    }
    let region = engine.register_buffer(&buffer).unwrap();
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
    let listener = engine
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
    let driver = engine.spawn_driver().unwrap();
    (peer, remote, driver)
}

/// Waits for a batch submitted with bound [`BATCH`] to end by itself (with
/// room to spare: a wait that gives up would hide a hang).
fn ended(batch: &Batch) -> Result<(), TransferError> {
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
fn server_checks_write(peer: &WirePeer, buffer: &Buffer, what: &str) {
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
    std::fs::read_to_string(format!(
        "/sys/class/net/{}/statistics/tx_bytes",
        netdev(device)
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

// ---------------------------------------------------------------------
// The wire really cut (`softroce/two-guest-wire.sh`): silently, by link,
// flapping, and impaired. B's side only: it cuts its own end silently
// (`tc` from the host's iproute2, seen through the guest's 9p root), and
// asks the host to pull the cable (QEMU's `set_link`) by printing
// `GDR_WIRE_LINK off|on` or `GDR_WIRE_FLAP <seconds>`.

/// What the engine promises after a cut (module docs of
/// `gdr_core::engine`): a request in flight ends once, by itself, with a
/// typed error when its queue pair fails, which the NIC reports after
/// `retry_count + 1` ACK timeouts (`stated_retry`), or at its deadline,
/// whichever is first, plus the flush grace (gdr-proto's `FLUSH_GRACE`,
/// 1 s) should the NIC not give the work back; the failed queue pair is
/// re-established by the connecting side within `reconnect_timeout`.
const FLUSH_GRACE: Duration = Duration::from_secs(1);
/// Room for a loaded host on top of the promise when waiting for an end
/// (a wait that gave up would be reported as a hang).
const LOAD_SLACK: Duration = Duration::from_secs(15);
/// The wire tests' `reconnect_timeout`: well past their longest outage
/// (9 s) plus the re-dial after it (2-4 s measured).
const RECONNECT: Duration = Duration::from_secs(40);
/// A cut test's batches: 8 MiB, 8 transfers of 1 MiB, slices over `QPS`.
const CUT_LEN: u64 = 8 << 20;
/// Their deadline: far past the stated retry time, so the NIC's own
/// retries are what ends them.
const CUT_DEADLINE: Duration = Duration::from_secs(60);
/// Batches kept in flight while the wire is cut.
const CUT_DEPTH: usize = 2;
/// Batches submitted while the cut is applied, at most.
const CUT_MOST: usize = 64;
/// How long the wire stays cut (from the cut).
const CUT_HOLD: Duration = Duration::from_secs(9);
/// The deadline of a batch submitted while the wire is cut.
const DURING_CUT_DEADLINE: Duration = Duration::from_secs(3);

/// `retry_count + 1` ACK timeouts of 4.096 µs x 2^code: how long after
/// its last answer a queue pair reports "retry exceeded".
fn stated_retry() -> Duration {
    let tries = u32::from(retry_count()) + 1;
    Duration::from_nanos(4096 << ack_timeout()) * tries
}

/// `config(devices)` with the wire tests' reconnect bound.
fn wire_config(devices: &[&str]) -> EngineConfig {
    config(devices)
        .with_reconnect_timeout(RECONNECT)
        .with_default_timeout(CUT_DEADLINE)
}

/// The netdev under `device`.
fn netdev(device: &str) -> String {
    std::fs::read_to_string(format!(
        "/sys/class/infiniband/{device}/ports/1/gid_attrs/ndevs/0"
    ))
    .unwrap_or_else(|e| panic!("{device}'s netdev: {e}"))
    .trim()
    .to_owned()
}

fn carrier(ndev: &str) -> bool {
    std::fs::read_to_string(format!("/sys/class/net/{ndev}/carrier")).is_ok_and(|c| c.trim() == "1")
}

/// Runs `tc args`, which must succeed; returns its output.
fn tc(args: &[&str]) -> String {
    let out = std::process::Command::new("tc")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running tc {args:?} (iproute2's tc): {e}"));
    assert!(
        out.status.success(),
        "tc {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Packets netem dropped on `ndev` (its root qdisc's statistics).
fn netem_dropped(ndev: &str) -> u64 {
    let stats = tc(&["-s", "qdisc", "show", "dev", ndev, "root"]);
    stats
        .split("dropped ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no drop count in {stats:?}"))
}

/// rxe0's nonzero hardware counters (retries, sequence errors...), for
/// the log.
fn rxe_counters() -> String {
    let dir = "/sys/class/infiniband/rxe0/ports/1/hw_counters";
    let mut counters: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| {
                    let value = std::fs::read_to_string(e.path()).ok()?;
                    let value = value.trim();
                    (value != "0").then(|| format!("{}={value}", e.file_name().to_string_lossy()))
                })
                .collect()
        })
        .unwrap_or_default();
    counters.sort();
    counters.join(" ")
}

/// How B's end of wire 0 is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// Packets dropped with the link up: netem drops everything leaving
    /// eth0 and an ingress rule everything arriving, so both directions
    /// die at B's end and neither side sees a carrier change.
    Silent,
    /// The cable pulled: the host turns both guests' NICs off (QEMU's
    /// `set_link n0 off`, asked for by `GDR_WIRE_LINK off`); each guest
    /// sees its carrier go and rxe its port go down.
    Link,
}

/// Waits (bounded) until `ndev`'s carrier is `up`; panics if it is not.
fn await_carrier(ndev: &str, up: bool) {
    let start = Instant::now();
    while carrier(ndev) != up {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{ndev}'s carrier did not go {} (is two-guest-wire.sh driving the link?)",
            if up { "up" } else { "down" }
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// A cut made ready: for a silent one, `tc -batch -` already started
/// (starting a program in the guest takes seconds under emulation; the
/// cut must land while batches are in flight), its rules to come on stdin.
struct ReadyCut {
    how: Cut,
    ndev: String,
    tc: Option<std::process::Child>,
}

impl Cut {
    fn ready(self, ndev: &str) -> ReadyCut {
        let tc = (self == Cut::Silent).then(|| {
            std::process::Command::new("tc")
                .args(["-batch", "-"])
                .stdin(std::process::Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("starting tc -batch (iproute2's tc): {e}"))
        });
        ReadyCut {
            how: self,
            ndev: ndev.to_owned(),
            tc,
        }
    }
}

impl ReadyCut {
    /// Cuts the wire now; returns once the cut is in place.
    fn apply(mut self) {
        let ndev = &self.ndev;
        match (self.how, self.tc.take()) {
            (Cut::Silent, Some(mut tc)) => {
                use std::io::Write;
                let rules = format!(
                    "qdisc add dev {ndev} root netem loss 100%\n\
                     qdisc add dev {ndev} ingress\n\
                     filter add dev {ndev} parent ffff: matchall action drop\n"
                );
                let mut stdin = tc.stdin.take().expect("piped");
                stdin.write_all(rules.as_bytes()).expect("tc's stdin");
                drop(stdin);
                assert!(
                    tc.wait().expect("tc -batch").success(),
                    "tc -batch: {rules}"
                );
                assert!(carrier(ndev), "a silent cut keeps the link up");
            }
            (Cut::Link, _) => {
                eprintln!("GDR_WIRE_LINK off");
                await_carrier(ndev, false);
            }
            (Cut::Silent, None) => unreachable!("made ready with tc"),
        }
    }
}

impl Cut {
    /// Restores the wire; for a silent cut, returns how many packets it
    /// dropped on the way out.
    fn restore(self, ndev: &str) -> Option<u64> {
        match self {
            Cut::Silent => {
                let dropped = netem_dropped(ndev);
                tc(&["qdisc", "del", "dev", ndev, "root"]);
                tc(&["qdisc", "del", "dev", ndev, "ingress"]);
                Some(dropped)
            }
            Cut::Link => {
                eprintln!("GDR_WIRE_LINK on");
                await_carrier(ndev, true);
                None
            }
        }
    }
}

/// Whether `e` is a way a cut wire may end a request: the NIC's retries
/// exhausted, flushed behind such a failure on its queue pair, its
/// deadline, the peer given up; with the link down also a local error
/// (rxe may refuse to send on a port that is down).
fn is_cut_error(e: &TransferError, how: Cut) -> bool {
    is_dead_peer(e)
        || (how == Cut::Link
            && matches!(
                e,
                TransferError::LocalCompletion { .. } | TransferError::QpAsyncError { .. }
            ))
}

/// The outcome of a batch submitted with deadline `deadline`, waiting no
/// longer than the engine's promise, the deadline and the flush grace
/// (plus `LOAD_SLACK`): `None` is a hang.
fn ended_within(batch: &Batch, deadline: Duration) -> Option<Result<(), TransferError>> {
    let _ = batch.cell().wait(Some(deadline + FLUSH_GRACE + LOAD_SLACK));
    batch.status()
}

/// `len / MIB` WRITE (or READ) transfers of 1 MiB between `local` and
/// `remote` from offset 0.
fn transfers<'a>(
    write: bool,
    local: &'a WireRegion,
    remote: &'a MemoryDescriptor,
    len: u64,
) -> Vec<Transfer<'a>> {
    const MIB: u64 = 1 << 20;
    (0..len / MIB)
        .map(|i| {
            if write {
                Transfer::write(local, i * MIB, remote, i * MIB, MIB)
            } else {
                Transfer::read(local, i * MIB, remote, i * MIB, MIB)
            }
        })
        .collect()
}

/// After a restore: WRITEs `src` over `remote` (each attempt bounded by
/// `CUT_DEADLINE`) until one batch succeeded with a share on every queue
/// pair (all re-established), then READs it back into `back` and checks
/// the bytes. Returns how long until the first success and until every
/// queue pair carried one.
fn recovered(
    test: &str,
    peer: &WirePeer,
    src: &WireRegion,
    back: (&Buffer, &WireRegion),
    remote: &MemoryDescriptor,
    expect: &[u8],
) -> (Duration, Duration) {
    let start = Instant::now();
    let mut first_ok = None;
    loop {
        let before = peer.counters();
        let outcome = ended_within(
            &peer
                .submit_with_timeout(&transfers(true, src, remote, CUT_LEN), CUT_DEADLINE)
                .unwrap_or_else(|e| panic!("{test}: submit after the restore: {e}")),
            CUT_DEADLINE,
        )
        .unwrap_or_else(|| panic!("{test}: a WRITE after the restore hung"));
        match outcome {
            Ok(()) => {
                first_ok.get_or_insert(start.elapsed());
                let after = peer.counters();
                let idle: Vec<u16> = before
                    .iter()
                    .zip(&after)
                    .filter(|((_, _, c0), (_, _, c1))| c1.posted == c0.posted)
                    .map(|((qp, _, _), _)| *qp)
                    .collect();
                if idle.is_empty() {
                    break;
                }
                eprintln!("{test}: a WRITE after the restore left queue pairs {idle:?} idle");
            }
            Err(e) => eprintln!("{test}: a WRITE after the restore failed: {e:?}"),
        }
        assert!(
            start.elapsed() < RECONNECT + CUT_DEADLINE,
            "{test}: the queue pairs were not all re-established within {RECONNECT:?}"
        );
        thread::sleep(Duration::from_millis(200));
    }
    let all_up = start.elapsed();
    let (back_buf, back_region) = back;
    ended_within(
        &peer
            .submit_with_timeout(
                &transfers(false, back_region, remote, CUT_LEN),
                CUT_DEADLINE,
            )
            .unwrap(),
        CUT_DEADLINE,
    )
    .expect("the READ back ended")
    .unwrap_or_else(|e| panic!("{test}: READ back after the restore: {e}"));
    assert!(
        back_buf.to_vec().unwrap() == expect,
        "{test}: READ back after the restore what was written"
    );
    (first_ok.expect("a success"), all_up)
}

/// A's half of every wire test: serves `CUT_LEN` bytes, then checks that
/// B's WRITE of `CLIENT_SEED`'s pattern landed once B says so (control
/// messages cross the re-established queue pair 0).
fn wire_server(test: &str, engine: &WireEngine, offset: u16) {
    let (buffer, region) = host(engine, CUT_LEN, &[]);
    let (peer, grant) = serve(test, engine, port(offset), &region);
    assert_eq!(recv(&peer, SETUP), b"written");
    assert!(
        buffer.to_vec().unwrap() == pattern(CUT_LEN as usize, CLIENT_SEED),
        "{test}: B's WRITE after the wire came back landed whole"
    );
    send(&peer, b"checked");
    assert_eq!(recv(&peer, SETUP), b"done");
    drop(grant);
    eprintln!("{test}: server: B's WRITE after the wire came back arrived intact: ok");
}

/// This guest's side of a wire test: an engine on rxe0 with
/// [`wire_config`].
fn wire_guest(test: &str) -> Option<Guest> {
    guest_with(test, wire_config(&["rxe0"]))
}

/// B's side of a cut: keeps `CUT_DEPTH` WRITE batches in flight, cuts the
/// wire `how` once some succeeded, checks each batch in flight ends once
/// with a typed error within the promise, and one submitted during the
/// cut too; restores the wire after `CUT_HOLD` and checks the queue pairs
/// come back and carry verified bytes.
fn cut_client(test: &str, guest: &Guest, how: Cut, offset: u16) {
    let engine = &guest.engine;
    let ndev = netdev("rxe0");
    let (peer, remote, _driver) = connect(test, engine, &[path_to_a(offset)]);
    assert_eq!(remote.len, CUT_LEN);
    let mine = pattern(CUT_LEN as usize, CLIENT_SEED);
    let (_src_buf, src) = host(engine, CUT_LEN, &mine);
    let (back_buf, back) = host(engine, CUT_LEN, &[]);
    let writes = transfers(true, &src, &remote, CUT_LEN);
    let ready = how.ready(&ndev);
    let mut in_flight = std::collections::VecDeque::new();
    let mut ok = 0u64;
    while ok < RUNNING_AFTER {
        while in_flight.len() < CUT_DEPTH {
            in_flight.push_back(peer.submit_with_timeout(&writes, CUT_DEADLINE).unwrap());
        }
        let batch = in_flight.pop_front().expect("in flight");
        ended_within(&batch, CUT_DEADLINE)
            .expect("a WRITE before the cut ended")
            .unwrap_or_else(|e| panic!("{test}: a WRITE before the cut: {e}"));
        ok += 1;
    }
    while in_flight.len() < CUT_DEPTH {
        in_flight.push_back(peer.submit_with_timeout(&writes, CUT_DEADLINE).unwrap());
    }
    let cut_at = Instant::now();
    // Applying the cut takes hundreds of milliseconds in the guest, as
    // long as a batch or two may take: the pipe is kept full meanwhile
    // (CUT_DEPTH batches not ended, at most CUT_MOST in all), so batches
    // are in flight when the cut bites, however fast the wire is (a CI
    // run saw both of two batches end before it did).
    let applied = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            ready.apply();
            applied.store(true, std::sync::atomic::Ordering::Release);
        });
        while !applied.load(std::sync::atomic::Ordering::Acquire) {
            let running = in_flight
                .iter()
                .filter(|b: &&Batch| b.status().is_none())
                .count();
            if running < CUT_DEPTH && in_flight.len() < CUT_MOST {
                in_flight.push_back(peer.submit_with_timeout(&writes, CUT_DEADLINE).unwrap());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let cut_took = cut_at.elapsed();
    eprintln!(
        "{test}: wire cut ({how:?}) in {cut_took:.2?} with {} batches in flight",
        in_flight.len()
    );
    // How each batch in flight ended, and when (from the cut's start).
    let caught: Vec<(Result<(), TransferError>, Duration)> = in_flight
        .into_iter()
        .map(|batch| {
            let outcome = ended_within(&batch, CUT_DEADLINE).unwrap_or_else(|| {
                panic!(
                    "{test}: a batch in flight did not end (it hung); rxe0: {}",
                    rxe_counters()
                )
            });
            (outcome, cut_at.elapsed())
        })
        .collect();
    let failed: Vec<_> = caught.iter().filter(|(o, _)| o.is_err()).collect();
    for (outcome, after) in &caught {
        eprintln!(
            "{test}: CUT-END: a batch in flight ended {after:.2?} after the cut: {outcome:?}"
        );
        if let Err(e) = outcome {
            assert!(is_cut_error(e, how), "{test}: untyped end of a cut: {e:?}");
            // Their deadline is far off: the NIC's retries must end them.
            assert!(
                !matches!(e, TransferError::Timeout(_)),
                "{test}: a batch in flight ran to its deadline: the queue pair never failed"
            );
        }
    }
    assert!(
        !failed.is_empty(),
        "{test}: every batch in flight at the cut succeeded: the cut caught nothing"
    );
    // Work submitted now waits for the failed queue pairs (or is refused
    // if the peer was given up, which must not happen this soon).
    let during = peer
        .submit_with_timeout(&writes, DURING_CUT_DEADLINE)
        .unwrap_or_else(|e| panic!("{test}: submit during the cut refused: {e}"));
    let submitted = Instant::now();
    let outcome = ended_within(&during, DURING_CUT_DEADLINE)
        .unwrap_or_else(|| panic!("{test}: a batch submitted during the cut hung"));
    let during_took = submitted.elapsed();
    eprintln!(
        "{test}: CUT-END: a batch submitted during the cut ended in {during_took:.2?}: {outcome:?}"
    );
    let e = outcome.expect_err("a batch submitted while the wire is cut cannot succeed");
    // It waited for the queue pairs being re-established: its deadline.
    assert!(matches!(e, TransferError::Timeout(_)), "{test}: {e:?}");
    thread::sleep(CUT_HOLD.saturating_sub(cut_at.elapsed()));
    let cut_for = cut_at.elapsed();
    let dropped = how.restore(&ndev);
    let (first_ok, all_up) = recovered(test, &peer, &src, (&back_buf, &back), &remote, &mine);
    client_wrote(&peer);
    send(&peer, b"done");
    let slowest = failed.iter().map(|(_, after)| *after).max().expect("one");
    eprintln!(
        "{test}: CUT ({how:?}): {} of {} batches in flight failed, the last {slowest:.2?} after \
         the cut (promise: the stated retry time {:.2?} = {} tries x ACK timeout code {}, or the \
         deadline {CUT_DEADLINE:?}, + {FLUSH_GRACE:?}); a batch submitted during the cut ended \
         in {during_took:.2?} (deadline {DURING_CUT_DEADLINE:?}); wire cut for {cut_for:.2?}{}; \
         after the restore the first WRITE succeeded in {first_ok:.2?}, every queue pair carried \
         one in {all_up:.2?}; bytes verified both ways",
        failed.len(),
        caught.len(),
        stated_retry(),
        retry_count() + 1,
        ack_timeout(),
        dropped.map_or(String::new(), |d| format!(", netem dropped {d} packets"))
    );
}

#[test]
fn engine_wire_cut_silent() {
    const T: &str = "engine_wire_cut_silent";
    let Some(guest) = wire_guest(T) else {
        return;
    };
    match guest.role {
        Role::Server => wire_server(T, &guest.engine, 3),
        Role::Client => cut_client(T, &guest, Cut::Silent, 3),
    }
}

#[test]
fn engine_wire_cut_link() {
    const T: &str = "engine_wire_cut_link";
    let Some(guest) = wire_guest(T) else {
        return;
    };
    match guest.role {
        Role::Server => wire_server(T, &guest.engine, 4),
        Role::Client => cut_client(T, &guest, Cut::Link, 4),
    }
}

/// How long the host flaps the link (`GDR_WIRE_FLAP`).
const FLAP_FOR: Duration = Duration::from_secs(60);
/// The deadline of each batch while the link flaps.
const FLAP_DEADLINE: Duration = Duration::from_secs(20);

/// Carrier changes of `ndev` seen by polling every 10 ms, with when.
struct CarrierLog {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<thread::JoinHandle<Vec<(Instant, bool)>>>,
}

impl CarrierLog {
    fn start(ndev: String) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = thread::spawn(move || {
            let mut last = carrier(&ndev);
            let mut changes = vec![(Instant::now(), last)];
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                let now = carrier(&ndev);
                if now != last {
                    changes.push((Instant::now(), now));
                    last = now;
                }
                thread::sleep(Duration::from_millis(10));
            }
            changes
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> Vec<(Instant, bool)> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .take()
            .expect("once")
            .join()
            .expect("the carrier log")
    }
}

impl Drop for CarrierLog {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One batch's end while the link flapped.
struct FlapEnd {
    at: Instant,
    write: bool,
    outcome: Result<(), TransferError>,
}

#[test]
fn engine_wire_flapping() {
    const T: &str = "engine_wire_flapping";
    let Some(guest) = wire_guest(T) else {
        return;
    };
    let engine = &guest.engine;
    if guest.role == Role::Server {
        return wire_server(T, engine, 5);
    }
    let ndev = netdev("rxe0");
    let (peer, remote, _driver) = connect(T, engine, &[path_to_a(5)]);
    let (src_buf, src) = host(engine, CUT_LEN, &[]);
    let (back_buf, back) = host(engine, CUT_LEN, &[]);
    let log = CarrierLog::start(ndev.clone());
    eprintln!("GDR_WIRE_FLAP {}", FLAP_FOR.as_secs());
    let start = Instant::now();
    let mut ends: Vec<FlapEnd> = Vec::new();
    let (mut submitted, mut verified) = (0u64, 0u64);
    // One WRITE of a fresh pattern at a time, and once it succeeded a
    // READ back that must bring exactly it.
    let mut round = 0u8;
    while start.elapsed() < FLAP_FOR {
        round = round.wrapping_add(1);
        let expect = pattern(CUT_LEN as usize, round);
        src_buf.write_at(0, &expect).unwrap();
        let mut step = |write: bool| {
            let local = if write { &src } else { &back };
            submitted += 1;
            let outcome = match peer
                .submit_with_timeout(&transfers(write, local, &remote, CUT_LEN), FLAP_DEADLINE)
            {
                Ok(batch) => ended_within(&batch, FLAP_DEADLINE)
                    .unwrap_or_else(|| panic!("{T}: a batch hung while the link flapped")),
                Err(e) => panic!("{T}: submit refused while the link flapped: {e}"),
            };
            if let Err(e) = &outcome {
                assert!(is_cut_error(e, Cut::Link), "{T}: untyped end: {e:?}");
            }
            let ok = outcome.is_ok();
            ends.push(FlapEnd {
                at: Instant::now(),
                write,
                outcome,
            });
            ok
        };
        if step(true) && step(false) {
            assert!(
                back_buf.to_vec().unwrap() == expect,
                "{T}: READ back brought what was written"
            );
            verified += 1;
        }
    }
    assert_eq!(
        submitted,
        ends.len() as u64,
        "every batch ended exactly once"
    );
    await_carrier(&ndev, true);
    let mine = pattern(CUT_LEN as usize, CLIENT_SEED);
    src_buf.write_at(0, &mine).unwrap();
    let settled = Instant::now();
    let (first_ok, all_up) = recovered(T, &peer, &src, (&back_buf, &back), &remote, &mine);
    let changes = log.finish();
    client_wrote(&peer);
    send(&peer, b"done");
    let downs = changes.iter().filter(|(_, up)| !up).count();
    assert!(
        downs >= 3,
        "{T}: the link went down only {downs} times: {changes:?}"
    );
    // The outages longer than the retry time failed what was in flight,
    // and transfers succeeded again while the link still flapped.
    let first_failure = ends
        .iter()
        .find(|e| e.outcome.is_err())
        .unwrap_or_else(|| panic!("{T}: no request failed: the outages caught nothing"))
        .at;
    assert!(
        ends.iter()
            .any(|e| e.at > first_failure && e.outcome.is_ok()),
        "{T}: nothing succeeded after the first failure while the link flapped"
    );
    // Per period of carrier up: batches that ended in it, and successes.
    let mut periods = Vec::new();
    for (i, (from, up)) in changes.iter().enumerate() {
        let to = changes.get(i + 1).map_or(settled, |(t, _)| *t);
        let inside: Vec<_> = ends.iter().filter(|e| e.at >= *from && e.at < to).collect();
        let oks = inside.iter().filter(|e| e.outcome.is_ok()).count();
        periods.push(format!(
            "{} {:.1}-{:.1}s: {}/{} ok",
            if *up { "up" } else { "down" },
            from.duration_since(start).as_secs_f64(),
            to.duration_since(start).as_secs_f64(),
            oks,
            inside.len()
        ));
    }
    let failed: Vec<String> = ends
        .iter()
        .filter_map(|e| e.outcome.as_ref().err().map(|err| (e.write, err)))
        .map(|(w, err)| format!("{}: {err:?}", if w { "WRITE" } else { "READ" }))
        .collect();
    let oks = ends.iter().filter(|e| e.outcome.is_ok()).count();
    eprintln!(
        "{T}: FLAP: periods (batches ended ok / ended): {}",
        periods.join("; ")
    );
    eprintln!("{T}: FLAP: failures: {failed:?}");
    eprintln!(
        "{T}: FLAP: {FLAP_FOR:?} of flapping ({downs} times down): {} batches of {} MiB, {oks} \
         ok, {} failed typed, {verified} WRITE+READ rounds verified; after it the first WRITE \
         succeeded in {first_ok:.2?}, every queue pair carried one in {all_up:.2?}",
        ends.len(),
        CUT_LEN >> 20,
        failed.len()
    );
}

/// netem's impairment of the impaired test, each guest on its way out
/// (`GDR_WIRE_NETEM`, tc's words after "netem").
fn impairment() -> Vec<String> {
    env("GDR_WIRE_NETEM")
        .unwrap_or_else(|| "delay 20ms loss 1%".into())
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// The impaired test's transport retries: `GDR_WIRE_RETRY`, default 6,
/// the most short of forever. rxe counts a sequence-error NAK (a lost
/// packet seen by the next) against the same budget as a timeout and
/// refills it only on an ACK; with the HAL's 3, an 8 MiB WRITE over
/// "delay 20ms loss 1%" (and "loss 2%", even with 6) ended "retry
/// exceeded" between two live guests.
fn impaired_retry() -> u8 {
    env("GDR_WIRE_RETRY").map_or(6, |c| c.parse().expect("GDR_WIRE_RETRY"))
}

fn impair(ndev: &str) {
    let words = impairment();
    let mut args = vec!["qdisc", "add", "dev", ndev, "root", "netem"];
    args.extend(words.iter().map(String::as_str));
    tc(&args);
}

/// Tries of one batch of the impaired test before it fails the test.
const IMPAIRED_TRIES: u32 = 4;

/// Submits `transfers` until a batch succeeds (at most `IMPAIRED_TRIES`):
/// a failure must be one a lossy wire may cause (typed, the queue pair
/// then re-established). Returns the time of the successful try and the
/// failures before it.
fn until_ok(
    what: &str,
    peer: &WirePeer,
    transfers: &[Transfer<'_>],
) -> (Duration, Vec<TransferError>) {
    let mut failures = Vec::new();
    loop {
        let start = Instant::now();
        match ended(&peer.submit(transfers).unwrap()) {
            Ok(()) => return (start.elapsed(), failures),
            Err(e) => {
                eprintln!(
                    "{what}: failed over the impaired wire ({e:?}); rxe0: {}",
                    rxe_counters()
                );
                // The transport gave up on a live peer: its queue pair is
                // re-established, the batch may run again. Nothing else.
                assert!(
                    matches!(
                        e,
                        TransferError::RetryExceeded { .. } | TransferError::Flushed { .. }
                    ),
                    "{what}: {e:?}"
                );
                failures.push(e);
                assert!(
                    failures.len() < IMPAIRED_TRIES as usize,
                    "{what}: failed {IMPAIRED_TRIES} times: {failures:?}"
                );
            }
        }
    }
}

/// Small WRITEs one at a time: their latencies, sorted.
fn small_writes(
    peer: &WirePeer,
    src: &WireRegion,
    remote: &MemoryDescriptor,
    count: usize,
) -> (Vec<Duration>, Vec<TransferError>) {
    let mut failures = Vec::new();
    let mut took: Vec<Duration> = (0..count)
        .map(|_| {
            let (took, failed) = until_ok(
                "a 4 KiB WRITE",
                peer,
                &[Transfer::write(src, 0, remote, 0, 4096)],
            );
            failures.extend(failed);
            took
        })
        .collect();
    took.sort();
    (took, failures)
}

#[test]
fn engine_wire_impaired() {
    const T: &str = "engine_wire_impaired";
    const SMALL: usize = 30;
    let mut config = wire_config(&["rxe0"]);
    config.connect.retry_count = impaired_retry();
    let Some(guest) = guest_with(T, config) else {
        return;
    };
    let engine = &guest.engine;
    let ndev = netdev("rxe0");
    if guest.role == Role::Server {
        let (buffer, region) = host(engine, CUT_LEN, &[]);
        let (peer, grant) = serve(T, engine, port(6), &region);
        assert_eq!(recv(&peer, SETUP), b"impair");
        // B's clean WRITE left its pattern: only the impaired one may.
        buffer.write_at(0, &vec![0; CUT_LEN as usize]).unwrap();
        impair(&ndev);
        send(&peer, b"impaired");
        assert_eq!(recv(&peer, SETUP), b"written");
        assert!(
            buffer.to_vec().unwrap() == pattern(CUT_LEN as usize, CLIENT_SEED),
            "{T}: B's WRITE over the impaired wire landed whole"
        );
        send(&peer, b"checked");
        assert_eq!(recv(&peer, SETUP), b"done");
        let dropped = netem_dropped(&ndev);
        tc(&["qdisc", "del", "dev", &ndev, "root"]);
        drop(grant);
        eprintln!(
            "{T}: server: the WRITE over the impaired wire arrived intact (netem dropped \
             {dropped} of A's packets): ok"
        );
        return;
    }
    let (peer, remote, _driver) = connect(T, engine, &[path_to_a(6)]);
    let mine = pattern(CUT_LEN as usize, CLIENT_SEED);
    let (_src_buf, src) = host(engine, CUT_LEN, &mine);
    let (back_buf, back) = host(engine, CUT_LEN, &[]);
    // WRITE, READ back, small WRITEs: the same on the clean wire first.
    let run = |what: &str| {
        let (write, mut failures) = until_ok(
            &format!("{T}: {what}: WRITE"),
            &peer,
            &transfers(true, &src, &remote, CUT_LEN),
        );
        back_buf.write_at(0, &vec![0; CUT_LEN as usize]).unwrap();
        let (read, failed) = until_ok(
            &format!("{T}: {what}: READ back"),
            &peer,
            &transfers(false, &back, &remote, CUT_LEN),
        );
        failures.extend(failed);
        assert!(
            back_buf.to_vec().unwrap() == mine,
            "{T}: {what}: READ back what was written"
        );
        let (small, failed) = small_writes(&peer, &src, &remote, SMALL);
        failures.extend(failed);
        let mib = |d: Duration| CUT_LEN as f64 / d.as_secs_f64() / f64::from(1 << 20);
        format!(
            "{what}: {} MiB WRITE {write:.2?} ({:.1} MiB/s), READ back {read:.2?} ({:.1} MiB/s); \
             4 KiB WRITE x{SMALL} p50 {:.2?} p90 {:.2?} max {:.2?}; batches failed and \
             resubmitted: {} {failures:?}",
            CUT_LEN >> 20,
            mib(write),
            mib(read),
            small[SMALL / 2],
            small[SMALL * 9 / 10],
            small[SMALL - 1],
            failures.len()
        )
    };
    let clean = run("clean");
    send(&peer, b"impair");
    assert_eq!(recv(&peer, SETUP), b"impaired");
    impair(&ndev);
    let impaired = run(&format!("netem {} both ways", impairment().join(" ")));
    let dropped = netem_dropped(&ndev);
    tc(&["qdisc", "del", "dev", &ndev, "root"]);
    assert!(
        dropped > 0,
        "{T}: netem dropped nothing: the wire was not impaired"
    );
    client_wrote(&peer);
    send(&peer, b"done");
    eprintln!(
        "{T}: IMPAIRED: retry count {}, ACK timeout code {}",
        impaired_retry(),
        ack_timeout()
    );
    eprintln!("{T}: IMPAIRED: {clean}");
    eprintln!("{T}: IMPAIRED: {impaired}; netem dropped {dropped} of B's packets");
}

/// The outlasting test's `reconnect_timeout`: shorter than its cut.
const SHORT_RECONNECT: Duration = Duration::from_secs(5);
/// How long the outlasting test's wire stays cut: past the retry time and
/// the reconnect bound, with room.
const LONG_CUT: Duration = Duration::from_secs(16);

/// A cut that outlasts the promise: B's queue pairs fail, are not
/// re-established within `SHORT_RECONNECT`, and B's peer is gone: its
/// requests end typed, a submit is refused with `PeerGone`. Once the wire
/// is back B connects afresh and moves verified bytes; A, idle, learns of
/// its old peer only when it sends to it (RC has no keepalive and neither
/// does the engine): that send must end typed too.
#[test]
fn engine_wire_cut_outlasting() {
    const T: &str = "engine_wire_cut_outlasting";
    let mut config = wire_config(&["rxe0"]);
    config.reconnect_timeout = SHORT_RECONNECT;
    let Some(guest) = guest_with(T, config) else {
        return;
    };
    let engine = &guest.engine;
    if guest.role == Role::Server {
        let (buffer, region) = host(engine, CUT_LEN, &[]);
        let listener = engine
            .listen(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port(7))))
            .unwrap_or_else(|e| panic!("{T}: listening: {e}"));
        let accept = |what: &str| {
            let start = Instant::now();
            let peer = loop {
                match listener.accept(SETUP.saturating_sub(start.elapsed())) {
                    Ok(peer) => break peer,
                    Err(e @ EngineError::Timeout(_)) => panic!("{T}: accepting {what}: {e}"),
                    Err(e) => eprintln!("{T}: server: accepting {what} failed ({e}); again"),
                }
            };
            let grant = peer
                .grant(&region, 0, region.len(), GrantRights::ReadWrite)
                .unwrap();
            send(&peer, &grant.descriptor().grant.to_le_bytes());
            (peer, grant)
        };
        let (old, _old_grant) = accept("the first connection");
        let (new, _new_grant) = accept("the connection after the cut");
        let gone = engine.resources().peers.iter().filter(|p| p.gone).count();
        eprintln!(
            "{T}: server: B connected afresh; {} peers here, {gone} of them known gone",
            engine.resources().peers.len()
        );
        // The old peer's queue pairs looked fine here; a SEND finds out.
        let start = Instant::now();
        // A has no driver thread: this wait makes the progress.
        let outcome = match old.send(b"anyone there?") {
            Ok(batch) => {
                let _ = batch.wait(CUT_DEADLINE + FLUSH_GRACE + LOAD_SLACK);
                batch
                    .status()
                    .unwrap_or_else(|| panic!("{T}: a SEND to the old peer hung"))
                    .map_err(|e| format!("{e:?}"))
            }
            Err(e) => Err(format!("refused: {e:?}")),
        };
        eprintln!(
            "{T}: OUTLASTING: A's SEND to its old, idle peer ended in {:.2?}: {outcome:?}; \
             rxe0: {}",
            start.elapsed(),
            rxe_counters()
        );
        assert!(
            outcome.is_err(),
            "{T}: a SEND to a peer that is gone succeeded"
        );
        assert_eq!(recv(&new, SETUP), b"written");
        assert!(
            buffer.to_vec().unwrap() == pattern(CUT_LEN as usize, CLIENT_SEED),
            "{T}: B's WRITE over the new connection landed whole"
        );
        send(&new, b"checked");
        assert_eq!(recv(&new, SETUP), b"done");
        return;
    }
    let ndev = netdev("rxe0");
    let (old, remote, driver) = connect(T, engine, &[path_to_a(7)]);
    let mine = pattern(CUT_LEN as usize, CLIENT_SEED);
    let (_src_buf, src) = host(engine, CUT_LEN, &mine);
    let (back_buf, back) = host(engine, CUT_LEN, &[]);
    let writes = transfers(true, &src, &remote, CUT_LEN);
    ended_within(&old.submit(&writes).unwrap(), CUT_DEADLINE)
        .expect("ended")
        .unwrap_or_else(|e| panic!("{T}: a WRITE before the cut: {e}"));
    let in_flight: Vec<_> = (0..CUT_DEPTH)
        .map(|_| old.submit(&writes).unwrap())
        .collect();
    let ready = Cut::Silent.ready(&ndev);
    let cut_at = Instant::now();
    ready.apply();
    // What was in flight ends, ok if it made it before the cut.
    let caught: Vec<_> = in_flight
        .iter()
        .map(|batch| {
            let outcome = ended_within(batch, CUT_DEADLINE)
                .unwrap_or_else(|| panic!("{T}: a batch in flight hung"));
            if let Err(e) = &outcome {
                assert!(is_cut_error(e, Cut::Silent), "{T}: {e:?}");
            }
            (outcome, cut_at.elapsed())
        })
        .collect();
    // Until the peer is gone, work waits for the queue pairs being
    // re-established and ends at its deadline (or with the peer gone).
    let refused = loop {
        match old.submit_with_timeout(&writes, DURING_CUT_DEADLINE) {
            Err(e) => break e,
            Ok(batch) => {
                let outcome = ended_within(&batch, DURING_CUT_DEADLINE)
                    .unwrap_or_else(|| panic!("{T}: a batch during the cut hung"));
                let e = outcome.expect_err("nothing succeeds while the wire is cut");
                assert!(is_cut_error(&e, Cut::Silent), "{T}: {e:?}");
            }
        }
        assert!(
            cut_at.elapsed() < stated_retry() + SHORT_RECONNECT + LOAD_SLACK,
            "{T}: the peer was not given up within the retry time and the reconnect bound"
        );
    };
    let gone_after = cut_at.elapsed();
    assert!(
        matches!(refused, EngineError::PeerGone(_)),
        "{T}: {refused}"
    );
    thread::sleep(LONG_CUT.saturating_sub(cut_at.elapsed()));
    Cut::Silent.restore(&ndev);
    drop(driver);
    let start = Instant::now();
    let (new, remote, _driver) = connect(T, engine, &[path_to_a(7)]);
    let reconnected = start.elapsed();
    let (write, _) = until_ok(
        "a WRITE over the new connection",
        &new,
        &transfers(true, &src, &remote, CUT_LEN),
    );
    let (read, _) = until_ok(
        "a READ back over the new connection",
        &new,
        &transfers(false, &back, &remote, CUT_LEN),
    );
    assert!(
        back_buf.to_vec().unwrap() == mine,
        "{T}: READ back what was written"
    );
    client_wrote(&new);
    send(&new, b"done");
    eprintln!(
        "{T}: OUTLASTING: the batches in flight: {caught:?}; the peer was given up {gone_after:.2?} after it ({refused}; promise: stated retry time \
         {:.2?} + reconnect bound {SHORT_RECONNECT:?}); wire cut for {LONG_CUT:?}; a fresh \
         connect took {reconnected:.2?}, then WRITE {write:.2?} and READ back {read:.2?}, \
         verified",
        stated_retry()
    );
    drop(old);
}
