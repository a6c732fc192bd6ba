//! Resource accounting: what the engines hold while they live
//! (`Engine::resources`: work in flight and each peer's state) and what
//! the simulation holds for them (`SimFabric::resources`,
//! `SimCuda::resources`: MRs, QPs, CQs, the connection manager's records,
//! device and pinned bytes, host registrations, streams). Every path's
//! work ends with the engines' peer state back to its baseline, and with
//! nothing left on the fabric or in the GPUs once the engines are dropped.

use std::time::Duration;

use gdr_core::engine::EngineConfig;
use gdr_core::ladder::{LadderConfig, Policy, Rung};
use gdr_sim::{GpuConfig, SimVerbsApi};
use gdr_tests::engine_world::{EngineWorld, Kind};

const T: Duration = Duration::from_secs(10);
const LEN: u64 = 200 * 1024 + 3;

fn world(policy: Policy, peer_copy: bool) -> EngineWorld<SimVerbsApi> {
    let config = EngineConfig::default()
        .with_qps_per_peer(2)
        .with_default_timeout(T)
        .with_staging_slice(16 * 1024)
        .with_staging_slots(3)
        .with_peer_copy(peer_copy)
        .with_ladder(LadderConfig::default().with_policy(policy));
    EngineWorld::sim(1, GpuConfig::default(), config, T)
}

/// Moves every pair of memory kinds with a GPU end both ways, then checks
/// both engines hold no work and their peer state is at its baseline.
fn move_everything(w: &EngineWorld<SimVerbsApi>, what: &str) {
    let kinds = [Kind::Host, Kind::Pinned, Kind::Gpu];
    for (i, &from) in kinds.iter().enumerate() {
        for (j, &to) in kinds.iter().enumerate() {
            w.write_and_read_back(from, to, LEN, (i * 3 + j) as u8 + 1, 2, what);
        }
    }
    // The last revoke's message may still be on its way: it lands with
    // the next progress.
    let start = std::time::Instant::now();
    let settled = |engine: &gdr_tests::engine_world::WorldEngine| {
        let held = engine.resources();
        held.batches == 0 && held.peers.iter().all(|p| p.remote_grants == 0)
    };
    while !(settled(&w.a.engine) && settled(&w.b.engine)) && start.elapsed() < T {
        w.a.engine.progress();
        w.b.engine.progress();
        std::thread::sleep(Duration::from_millis(1));
    }
    for (side, engine) in [("a", &w.a.engine), ("b", &w.b.engine)] {
        let held = engine.resources();
        assert_eq!(
            (held.batches, held.staged_transfers, held.staged_groups),
            (0, 0, 0),
            "{what}: {side} still holds work: {held:?}"
        );
        assert_eq!(held.peers.len(), 1, "{what}: {side}: {held:?}");
        let peer = &held.peers[0];
        assert!(!peer.gone, "{what}: {side}: {peer:?}");
        assert_eq!(
            (
                peer.inbox_messages,
                peer.inbox_bytes,
                peer.outbox_messages,
                peer.requests_served,
                peer.copies,
                peer.requests_asked,
                peer.grants_announced,
                peer.remote_grants,
                peer.staged_grants,
            ),
            (0, 0, 0, 0, 0, 0, 0, 0, 0),
            "{what}: {side}'s state for its peer is not back to its baseline: {peer:?}"
        );
    }
}

#[test]
fn the_nic_path_leaves_nothing_once_the_engines_are_dropped() {
    let w = world(Policy::Fallback, false);
    move_everything(&w, "nic");
    w.close_and_check_released();
}

#[test]
fn the_staged_path_leaves_nothing_once_the_engines_are_dropped() {
    let w = world(Policy::Only(Rung::Staging), false);
    move_everything(&w, "staged");
    w.close_and_check_released();
}

#[test]
fn the_peer_copy_path_leaves_nothing_once_the_engines_are_dropped() {
    let w = world(Policy::Fallback, true);
    move_everything(&w, "peer copy");
    w.close_and_check_released();
}
