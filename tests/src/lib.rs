//! Shared helpers of gdr's integration tests.
#![deny(unsafe_op_in_unsafe_fn)]

use std::sync::Once;

pub mod alloc_count;
pub mod awaiting;
pub mod conformance;
pub mod engine_world;
pub mod fd;
pub mod grants;
pub mod ladder_world;
pub mod pair;
pub mod rxe;
pub mod sim;

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

/// The environment switch that turns a skipped GPU test into a failure.
pub const EXPECT_GPU_ENV: &str = "GDR_EXPECT_GPU";

/// Whether `GDR_EXPECT_GPU=1`: the run is on a machine that has a GPU (the
/// H200 run sets it), so a GPU test that cannot find one must fail.
pub fn expect_gpu() -> bool {
    std::env::var(EXPECT_GPU_ENV).is_ok_and(|v| v == "1")
}

/// Skips a GPU test with its reason, like [`skip`], or, with
/// `GDR_EXPECT_GPU=1`, fails it: whatever made the GPU unusable (no
/// libcuda, a stub libcuda on the library path, `cuInit` failing, no device)
/// must not turn a GPU run into a silent pass.
pub fn skip_gpu(test: &str, reason: &str) {
    if expect_gpu() {
        panic!("{test}: {EXPECT_GPU_ENV}=1 but no usable GPU: {reason}");
    }
    skip(test, reason);
}

/// libcuda loaded and GPU 0's primary context, or `None` after
/// [`skip_gpu`] (which fails the test under `GDR_EXPECT_GPU=1`). A load
/// failure other than "no library" or "no device" always fails the test.
pub fn cuda_gpu(test: &str) -> Option<(hal_cuda::cuda::CudaDriver, hal_cuda::cuda::CudaContext)> {
    use hal_cuda::Driver as _;
    init_tracing();
    let driver = match hal_cuda::cuda::CudaDriver::load().and_then(|d| d.device_count().map(|_| d))
    {
        Ok(driver) => driver,
        Err(
            e @ (hal_cuda::CudaError::LibraryUnavailable { .. }
            | hal_cuda::CudaError::NoDevice { .. }),
        ) => {
            skip_gpu(test, &e.to_string());
            return None;
        }
        Err(e) => panic!("{test}: loading the CUDA driver failed: {e}"),
    };
    let ctx = driver.context(0).expect("device 0's primary context");
    Some((driver, ctx))
}
