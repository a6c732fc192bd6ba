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
