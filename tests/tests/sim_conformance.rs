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
