//! The verbs conformance suite (`gdr_tests::conformance`) on the simulator.
//!
//! Every scenario runs once per device profile. Profiles: `default` (the
//! ConnectX-like `DeviceConfig::default()`) and `rxe_like`
//! (`DeviceConfig::rxe_like()`). Hook for more (an mlx5-like profile of
//! the clock work): add a module below built from that profile's
//! `DeviceConfig`, with the backend's facts adjusted in
//! `gdr_tests::pair::SimBackend::facts` where the profile differs.

/// The simulator's default device (ConnectX-like).
mod default {
    use gdr_tests::pair::SimBackend;

    fn backend(_test: &str) -> Option<SimBackend> {
        Some(SimBackend::new("default", gdr_sim::DeviceConfig::default()))
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
}

/// An rxe-like device (no dma-buf, MTU 1024, no PCI function).
mod rxe_like {
    use gdr_tests::pair::SimBackend;

    fn backend(_test: &str) -> Option<SimBackend> {
        Some(SimBackend::new(
            "rxe_like",
            gdr_sim::DeviceConfig::rxe_like(),
        ))
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
}
