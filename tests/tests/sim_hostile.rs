//! Hostile peers at scale (simulated NICs): each bound of [`PeerLimits`]
//! driven past by a peer, at the engine's default limits where the attack
//! can reach them, while another peer of the same engine keeps moving
//! data. Each attack checks the attacker is dropped with its typed reason,
//! that what the engine held for it (its own accounting, sampled through
//! the attack) never went past the bound, and that the honest peer was
//! served throughout without an error; it prints the peak, the process's
//! RSS growth and the honest peer's latency (figures, not assertions).
//! Every world ends with nothing left on the fabric or in the GPUs.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gdr_core::descriptor::GrantRights;
use gdr_core::engine::{
    EngineConfig, EngineError, PeerGone, PeerLimits, PeerMisbehaved, PeerResources, Transfer,
};
use gdr_sim::{GpuConfig, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, Kind};

const T: Duration = Duration::from_secs(30);

/// The process's resident set in bytes (`/proc/self/statm`).
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("resident pages");
    pages * 4096
}

/// What the sampler saw of b's state for the attacker, at its largest.
#[derive(Debug, Default, Clone, Copy)]
struct Peak {
    inbox_messages: usize,
    inbox_bytes: usize,
    remote_grants: usize,
    rss: u64,
}

/// What one attack measured.
struct Report {
    peak: Peak,
    rss_before: u64,
    honest_writes: usize,
    honest_latency: Vec<Duration>,
}

impl Report {
    fn print(&mut self, name: &str) {
        self.honest_latency.sort();
        let at = |q: f64| {
            let n = self.honest_latency.len();
            self.honest_latency[((n as f64 * q) as usize).min(n - 1)]
        };
        eprintln!(
            "hostile {name}: peak inbox {} messages / {} bytes, remote grants {}; RSS +{} KiB; \
             honest peer: {} WRITEs of 4 KiB, latency p50 {:?} p99 {:?} max {:?}",
            self.peak.inbox_messages,
            self.peak.inbox_bytes,
            self.peak.remote_grants,
            self.peak.rss.saturating_sub(self.rss_before) / 1024,
            self.honest_writes,
            at(0.5),
            at(0.99),
            at(1.0),
        );
    }
}

/// What an attack keeps until b has dropped the attacker.
type Kept = Box<dyn std::any::Any>;

/// b (the victim, limits `limits`) connected to a (the attacker) and to c
/// (an honest peer WRITEing 4 KiB into b's memory, one WRITE after
/// another, timed). `attack` runs on a's end; then b must drop a with
/// `expected`. b is driven by a driver thread; a sampler reads b's
/// accounting every millisecond.
fn under_attack(
    name: &str,
    limits: PeerLimits,
    attack: impl FnOnce(&EngineWorld<SimVerbsApi>) -> Kept,
    expected: PeerMisbehaved,
) -> Report {
    let config = EngineConfig {
        qps_per_peer: 1,
        default_timeout: T,
        peer_limits: limits,
        ..EngineConfig::default()
    };
    let w = EngineWorld::<SimVerbsApi>::sim(1, GpuConfig::default(), config.clone(), T);
    let (c, cb, bc) = w.connect_another_to_b("c", config);
    let (target, target_region) = w.b.alloc(Kind::Host, 1 << 16, 0);
    let grant = bc
        .grant(&target_region, 0, 1 << 16, GrantRights::Write)
        .expect("grant to c");
    let remote = cb
        .wait_grant(grant.descriptor().grant, T)
        .expect("c sees b's grant");
    let (source, source_region) = c.alloc(Kind::Host, 4096, 7);
    // Both ends driven: the attacker's messages go out as fast as its NIC
    // takes them, whatever the attack waits for.
    let driver = w.b.engine.spawn_driver();
    let attacker_driver = w.a.engine.spawn_driver();
    let attacker = w.a.engine.id();

    let stop = AtomicBool::new(false);
    /// Sets `stop` when dropped: a failing check (a panic) ends the helper
    /// threads too, instead of leaving the scope waiting for them.
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let peak = Mutex::new(Peak::default());
    let latency = Mutex::new(Vec::new());
    let rss_before = rss();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut i = 0u64;
            while !stop.load(Ordering::Acquire) {
                let start = Instant::now();
                cb.submit(&[Transfer::write(
                    &source_region,
                    0,
                    &remote,
                    (i % 16) * 4096,
                    4096,
                )])
                .expect("the honest peer's WRITE is taken")
                .wait(T)
                .expect("the honest peer's WRITE ends well");
                latency.lock().unwrap().push(start.elapsed());
                i += 1;
            }
        });
        scope.spawn(|| {
            while !stop.load(Ordering::Acquire) {
                let held = w.b.engine.resources();
                let mut peak = peak.lock().unwrap();
                for p in held.peers.iter().filter(|p| p.remote_engine == attacker) {
                    peak.inbox_messages = peak.inbox_messages.max(p.inbox_messages);
                    peak.inbox_bytes = peak.inbox_bytes.max(p.inbox_bytes);
                    peak.remote_grants = peak.remote_grants.max(p.remote_grants);
                }
                peak.rss = peak.rss.max(rss());
                drop(peak);
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let _stop = StopOnDrop(&stop);
        let kept = attack(&w);
        // b drops a once past the bound; what b kept before is still
        // delivered, then the reason.
        let start = Instant::now();
        let reason = loop {
            match w.ba.recv(T) {
                Ok(_) => assert!(start.elapsed() < T, "{name}: b never dropped a"),
                Err(e) => break e,
            }
        };
        assert!(
            matches!(&reason, EngineError::PeerGone(PeerGone::Misbehaved(m)) if *m == expected),
            "{name}: expected a dropped because {expected:?}, got {reason}"
        );
        drop(kept);
        // The honest peer goes on after the attacker is gone, too.
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, Ordering::Release);
    });
    let honest_latency = latency.into_inner().unwrap();
    assert!(
        !honest_latency.is_empty(),
        "{name}: the honest peer moved nothing"
    );
    let report = Report {
        peak: *peak.lock().unwrap(),
        rss_before,
        honest_writes: honest_latency.len(),
        honest_latency,
    };
    // Nothing of the attack is left on b once a is gone.
    let left: Vec<PeerResources> =
        w.b.engine
            .resources()
            .peers
            .into_iter()
            .filter(|p| p.remote_engine == attacker)
            .collect();
    assert!(
        left.iter()
            .all(|p| p.gone && p.inbox_messages == 0 && p.remote_grants == 0),
        "{name}: b kept state for the attacker: {left:?}"
    );
    drop((driver, attacker_driver));
    drop((
        grant,
        target_region,
        target,
        source_region,
        source,
        cb,
        bc,
        c,
    ));
    w.close_and_check_released();
    report
}

/// a sends `count` messages (`message(i)`) to b, waiting for them 256 at
/// a time, until b drops it.
fn flood(w: &EngineWorld<SimVerbsApi>, count: usize, message: impl Fn(usize) -> Vec<u8>) -> Kept {
    let mut pending = Vec::new();
    for i in 0..count {
        match w.ab.send(&message(i)) {
            Ok(batch) => pending.push(batch),
            Err(_) => break, // b dropped a
        }
        if pending.len() == 256 {
            for batch in pending.drain(..) {
                let _ = batch.wait(T);
            }
        }
    }
    Box::new(())
}

// The attacks run one after the other in one test: each keeps three
// engines, their drivers and an honest peer busy, and two at once on two
// cores starve the attacker's driver (the flood then never reaches the
// bound in time).
#[test]
#[ignore = "passes on a quiet machine (cargo test -p gdr-tests --test sim_hostile -- --ignored); \
            under load the flood does not reach its bound within 30 s: being looked into (issue 23)"]
fn floods_past_the_default_bounds_are_cut_while_another_peer_is_served() {
    a_flood_of_messages_nobody_receives_is_cut_at_the_default_bound();
    a_flood_of_message_bytes_is_cut_at_the_default_bound();
}

fn a_flood_of_messages_nobody_receives_is_cut_at_the_default_bound() {
    let limits = PeerLimits::default();
    let max = limits.max_inbox_messages;
    let mut report = under_attack(
        "messages",
        limits,
        |w| flood(w, max + 1, |i| (i as u32).to_le_bytes().to_vec()),
        PeerMisbehaved::TooManyMessages { max },
    );
    assert!(
        report.peak.inbox_messages <= max,
        "{}",
        report.peak.inbox_messages
    );
    report.print("messages");
}

fn a_flood_of_message_bytes_is_cut_at_the_default_bound() {
    // The count bound raised so the default byte bound (64 MiB) is the one
    // reached: messages of 2,000 bytes.
    let limits = PeerLimits {
        max_inbox_messages: 1 << 20,
        ..PeerLimits::default()
    };
    let max = limits.max_inbox_bytes;
    let mut report = under_attack(
        "message bytes",
        limits,
        |w| flood(w, max / 2000 + 1, |_| vec![0x5a; 2000]),
        PeerMisbehaved::TooManyMessageBytes { max },
    );
    assert!(
        report.peak.inbox_bytes <= max,
        "{}",
        report.peak.inbox_bytes
    );
    report.print("message bytes");
}
