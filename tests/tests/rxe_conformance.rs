//! The verbs conformance suite (`gdr_tests::conformance`) on rdma-core's
//! SoftRoCE: `rxe0` in the VM (`softroce/run-in-vm.sh` as the cargo
//! runner, `GDR_EXPECT_RXE=1`). Without an RDMA device every test skips
//! with its reason on stderr; with `GDR_EXPECT_RXE=1` a missing `rxe0` is
//! a failure. The tests of the binary run one at a time (the backend holds
//! `gdr_tests::rxe::serial`).

use gdr_tests::pair::RxeBackend;

fn backend(test: &str) -> Option<RxeBackend> {
    RxeBackend::open(test)
}

gdr_tests::conformance_tests!(backend;
    write_and_read_move_bytes_exactly,
    multi_sge_gathers_and_scatters_in_order,
    send_recv_with_and_without_immediate,
    write_with_immediate_consumes_a_receive,
    linked_batch_with_selective_signalling,
    post_beyond_the_queue_reports_the_accepted_prefix,
    inline_payload_is_copied_at_post_time,
    qps_sharing_a_cq_complete_in_order_each,
    remote_access_errors_move_no_byte,
    local_protection_errors,
    receive_too_small_fails_both_sides,
    to_error_flushes_everything_outstanding,
    send_waits_for_a_receive,
    error_completions_carry_no_opcode_or_length,
    lkey_and_rkey_of_a_remote_mr_are_equal,
    local_only_mr_has_no_remote_key,
    keys_are_distinct,
    registration_argument_checks,
    registering_unmapped_memory_is_efault,
);
