//! The verbs conformance suite (`gdr_tests::conformance`) on the simulator,
//! once per device profile: `default` (`DeviceConfig::default()`), and
//! each of `DeviceConfig::profiles()` (`mlx5`, `rxe`). A new profile gets
//! a module below; where a profile makes the sim differ in a way a
//! scenario checks, `gdr_tests::pair::SimBackend::facts` says so.

/// The sim's default device.
mod default {
    fn backend(_test: &str) -> Option<gdr_tests::pair::SimBackend> {
        Some(gdr_tests::pair::SimBackend::new(
            "default",
            gdr_sim::DeviceConfig::default(),
        ))
    }

    gdr_tests::conformance_tests!(backend);
}

/// The profile named `name` of `DeviceConfig::profiles()`.
fn profile(name: &'static str) -> gdr_tests::pair::SimBackend {
    let (name, device) = gdr_sim::DeviceConfig::profiles()
        .into_iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no device profile {name}"));
    gdr_tests::pair::SimBackend::new(name, device)
}

/// The ConnectX-like profile (`DeviceConfig::mlx5_like()`).
mod mlx5 {
    fn backend(_test: &str) -> Option<gdr_tests::pair::SimBackend> {
        Some(super::profile("mlx5"))
    }

    gdr_tests::conformance_tests!(backend);
}

/// The rxe-like profile (`DeviceConfig::rxe_like()`).
mod rxe {
    fn backend(_test: &str) -> Option<gdr_tests::pair::SimBackend> {
        Some(super::profile("rxe"))
    }

    gdr_tests::conformance_tests!(backend);
}

#[test]
fn every_profile_has_a_module() {
    let names: Vec<_> = gdr_sim::DeviceConfig::profiles()
        .iter()
        .map(|(n, _)| *n)
        .collect();
    assert_eq!(names, ["mlx5", "rxe"], "add a module for each new profile");
}

/// The sim's rxe profile answers as rxe does wherever the suite records a
/// fact: `SimBackend::facts` (derived from `DeviceConfig::rxe_like()`)
/// equals `RxeBackend::facts` field for field, the timing fields aside
/// (the sim's clock is not the VM's). The destructuring names every field,
/// so a new fact must be compared here before this compiles.
#[test]
fn the_rxe_profile_has_rxe_facts() {
    use gdr_tests::pair::{Backend as _, Facts, RxeBackend};
    let sim = profile("rxe").facts();
    let rxe = RxeBackend::rxe_facts();
    let Facts {
        rkey_equals_lkey,
        local_only_rkey_is_zero,
        error_wc_opcode_and_len_zero,
        gather_fault_status,
        scatter_fault_status,
        receive_too_small_status,
        unsignaled_slots_need_a_poll,
        wrong_state_post_accepted,
        destroy_qp_keeps_completions,
        bad_receive_status,
        completion_timeout: _,
        quiet_window: _,
    } = sim;
    assert_eq!(rkey_equals_lkey, rxe.rkey_equals_lkey, "rkey_equals_lkey");
    assert_eq!(
        local_only_rkey_is_zero, rxe.local_only_rkey_is_zero,
        "local_only_rkey_is_zero"
    );
    assert_eq!(
        error_wc_opcode_and_len_zero, rxe.error_wc_opcode_and_len_zero,
        "error_wc_opcode_and_len_zero"
    );
    assert_eq!(
        gather_fault_status, rxe.gather_fault_status,
        "gather_fault_status"
    );
    assert_eq!(
        scatter_fault_status, rxe.scatter_fault_status,
        "scatter_fault_status"
    );
    assert_eq!(
        receive_too_small_status, rxe.receive_too_small_status,
        "receive_too_small_status"
    );
    assert_eq!(
        unsignaled_slots_need_a_poll, rxe.unsignaled_slots_need_a_poll,
        "unsignaled_slots_need_a_poll"
    );
    assert_eq!(
        wrong_state_post_accepted, rxe.wrong_state_post_accepted,
        "wrong_state_post_accepted"
    );
    assert_eq!(
        destroy_qp_keeps_completions, rxe.destroy_qp_keeps_completions,
        "destroy_qp_keeps_completions"
    );
    assert_eq!(
        bad_receive_status, rxe.bad_receive_status,
        "bad_receive_status"
    );
}

/// The sim's mlx5 profile and its default device record mlx5's answers
/// where rxe's differ (see each `Facts` field for its source).
#[test]
fn the_mlx5_profile_and_the_default_have_mlx5_facts() {
    use gdr_tests::pair::Backend as _;
    use hal_verbs::WcStatus;
    let default = gdr_tests::pair::SimBackend::new("default", gdr_sim::DeviceConfig::default());
    for backend in [profile("mlx5"), default] {
        let facts = backend.facts();
        let name = backend.name();
        assert!(!facts.local_only_rkey_is_zero, "{name}");
        assert_eq!(facts.gather_fault_status, WcStatus::LOC_PROT_ERR, "{name}");
        assert_eq!(
            facts.receive_too_small_status,
            (WcStatus::REM_INV_REQ_ERR, WcStatus::LOC_LEN_ERR),
            "{name}"
        );
        assert_eq!(
            facts.bad_receive_status,
            (WcStatus::REM_OP_ERR, WcStatus::LOC_PROT_ERR),
            "{name}"
        );
        assert!(facts.unsignaled_slots_need_a_poll, "{name}");
        assert_eq!(facts.wrong_state_post_accepted, Some(0), "{name}");
    }
}
