//! The verbs conformance suite (`gdr_tests::conformance`) on rdma-core's
//! SoftRoCE: `rxe0` in the VM (`softroce/run-in-vm.sh` as the cargo
//! runner, `GDR_EXPECT_RXE=1`). Without an RDMA device every test skips
//! with its reason on stderr; with `GDR_EXPECT_RXE=1` a missing `rxe0` is
//! a failure. The tests of the binary run one at a time (the backend holds
//! `gdr_tests::rxe::serial`).

fn backend(test: &str) -> Option<gdr_tests::pair::RxeBackend> {
    gdr_tests::pair::RxeBackend::open(test)
}

gdr_tests::conformance_tests!(backend);

/// Not a scenario: how rxe's transport timers actually run, measured by
/// polling without pause, printed for the record (the numbers behind
/// `RxeBackend::timing()`). Asserts only the statuses.
#[test]
fn rxe_timing_measured() {
    use gdr_tests::conformance::timing::{
        ack_timeout, measure_retry_exceeded, measure_rnr_exceeded, rnr_timer,
    };
    use hal_verbs::WcStatus;
    use std::io::Write;
    let Some(backend) = backend("rxe_timing_measured") else {
        return;
    };
    for (code, retry_cnt) in [(10, 1), (12, 0), (12, 2), (14, 1)] {
        let (took, status) = measure_retry_exceeded(&backend, code, retry_cnt);
        let nominal = ack_timeout(code) * (u32::from(retry_cnt) + 1);
        let _ = writeln!(
            std::io::stderr().lock(),
            "rxe timing: ACK timeout code {code} ({:?}), retry_cnt {retry_cnt}: \
             {status:?} after {took:?} (nominal {nominal:?})",
            ack_timeout(code)
        );
        assert_eq!(status, WcStatus::RETRY_EXC_ERR);
    }
    for (code, rnr_retry) in [(1, 2), (22, 1), (22, 2), (24, 2)] {
        let (took, status) = measure_rnr_exceeded(&backend, code, rnr_retry);
        let nominal = rnr_timer(code) * u32::from(rnr_retry);
        let _ = writeln!(
            std::io::stderr().lock(),
            "rxe timing: RNR timer code {code} ({:?}), rnr_retry {rnr_retry}: \
             {status:?} after {took:?} (nominal {nominal:?})",
            rnr_timer(code)
        );
        assert_eq!(status, WcStatus::RNR_RETRY_EXC_ERR);
    }
}
