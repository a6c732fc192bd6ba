//! The verbs conformance suite: every scenario is written once against
//! [`Backend`] and run on gdr-sim on the host (`tests/sim_conformance.rs`)
//! and on rdma-core's rxe in the VM (`tests/rxe_conformance.rs`).
//!
//! A scenario asserts what both backends must do. Where devices
//! legitimately differ, it branches on a documented fact
//! ([`crate::pair::Facts`]), never on the backend's name; where the
//! hardware promises nothing (the order of completions of different QPs on
//! one CQ, the opcode of an error completion), the scenario asserts nothing
//! either, or asserts that a backend gives no more than hardware would.
//!
//! [`conformance_tests!`](crate::conformance_tests) holds the list and
//! expands it into one test per scenario for a backend.

use crate::pair::Backend;

mod cm;
mod errors;
mod memory;
pub mod timing;
mod transfers;

pub use cm::{
    cm_abort_connects_ends_a_connect_under_way, cm_connect_accept_write_read_disconnect,
    cm_listener_wake_ends_the_wait, cm_reject_carries_private_data,
};
pub use errors::{
    destroying_a_qp_with_completions_in_its_cq, drain_flushes_everything_posted,
    error_completions_carry_no_opcode_or_length, local_protection_errors,
    posting_in_the_wrong_state_is_refused, qp_access_flags_are_enforced,
    receive_too_small_fails_both_sides, remote_access_errors_move_no_byte,
    send_into_a_bad_receive_fails_both_sides, send_waits_for_a_receive,
    to_error_flushes_everything_outstanding,
};
pub use memory::{
    keys_are_distinct, lkey_and_rkey_of_a_remote_mr_are_equal, local_only_mr_has_no_remote_key,
    registering_unmapped_memory_is_efault, registration_argument_checks,
};
pub use timing::{
    retry_exceeded_after_the_ack_timeouts, rnr_retry_7_waits_for_the_receive,
    rnr_retry_exceeded_after_the_rnr_timers, rnr_wait_longer_than_the_ack_timeout,
};
pub use transfers::{
    inline_payload_is_copied_at_post_time, linked_batch_with_selective_signalling,
    multi_sge_gathers_and_scatters_in_order, post_beyond_the_queue_reports_the_accepted_prefix,
    qps_sharing_a_cq_complete_in_order_each, send_recv_with_and_without_immediate,
    unsignaled_requests_hold_their_slots, write_and_read_move_bytes_exactly,
    write_with_immediate_consumes_a_receive, zero_length_requests,
};

/// Expands to one `#[test]` per scenario of the suite, each calling
/// `scenario(&backend)` where `backend` comes from `$make(test_name)`, an
/// `Option` of a [`Backend`] (`None`: the test skips). The one list of
/// scenarios is here: a new scenario is added to it and runs on every
/// backend and profile.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@each $make;
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
            drain_flushes_everything_posted,
            cm_connect_accept_write_read_disconnect,
            cm_reject_carries_private_data,
            cm_listener_wake_ends_the_wait,
            cm_abort_connects_ends_a_connect_under_way,
            zero_length_requests,
            unsignaled_requests_hold_their_slots,
            qp_access_flags_are_enforced,
            posting_in_the_wrong_state_is_refused,
            destroying_a_qp_with_completions_in_its_cq,
            send_into_a_bad_receive_fails_both_sides,
            retry_exceeded_after_the_ack_timeouts,
            rnr_retry_exceeded_after_the_rnr_timers,
            rnr_retry_7_waits_for_the_receive,
            rnr_wait_longer_than_the_ack_timeout,
        );
    };
    (@each $make:expr; $($scenario:ident),* $(,)?) => {
        $(
            #[test]
            fn $scenario() {
                let Some(backend) = ($make)(stringify!($scenario)) else {
                    return;
                };
                $crate::conformance::run(
                    &backend,
                    stringify!($scenario),
                    $crate::conformance::$scenario,
                );
            }
        )*
    };
}

/// Runs one scenario, naming the backend in its output.
pub fn run<B: Backend>(backend: &B, name: &str, scenario: fn(&B)) {
    crate::init_tracing();
    scenario(backend);
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr().lock(),
        "conformance {name} on {}: ok",
        backend.name()
    );
}
