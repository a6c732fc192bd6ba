//! Shared helpers of gdr's integration tests.
#![deny(unsafe_op_in_unsafe_fn)]

use std::sync::Once;

pub mod grants;
pub mod rxe;

/// Routes `tracing` output to the test harness (shown for failing tests),
/// filtered by `RUST_LOG`.
pub fn init_tracing() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "warn".into()),
            )
            .with_test_writer()
            .try_init();
    });
}

/// A deterministic byte pattern, distinct per `seed`, for verifying copies.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

/// Why a test that needs hardware is skipped, printed so the runner's log
/// says it (`cargo test` has no native skip). Written to the stderr handle
/// directly, not through `eprintln!`, which the harness captures and hides
/// for passing tests.
pub fn skip(test: &str, reason: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED {test}: {reason}");
}
