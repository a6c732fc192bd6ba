//! `BackendChoice::Auto` falling back to the simulation is told: one
//! `tracing` warning per process, the real event captured here. (A binary
//! of its own: the process's first fallback must be this test's.)

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use gdr_core::{BackendChoice, Context};
use tracing_subscriber::layer::{Context as LayerContext, SubscriberExt};

/// The warnings seen, as `target: field=value ...`.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: LayerContext<'_, S>) {
        if *event.metadata().level() != tracing::Level::WARN {
            return;
        }
        let mut text = format!("{}:", event.metadata().target());
        event.record(
            &mut |field: &tracing::field::Field, value: &dyn std::fmt::Debug| {
                let _ = write!(text, " {}={value:?}", field.name());
            },
        );
        self.0.lock().unwrap().push(text);
    }
}

#[test]
fn auto_falling_back_to_the_simulation_warns_once_per_process() {
    let warnings = Warnings::default();
    let subscriber = tracing_subscriber::registry().with(warnings.clone());
    let (first, second) = tracing::subscriber::with_default(subscriber, || {
        // The simulation asked for is no fallback: not told.
        Context::open(BackendChoice::Sim).expect("sim");
        (
            Context::open(BackendChoice::Auto).expect("auto"),
            Context::open(BackendChoice::Auto).expect("auto again"),
        )
    });
    let told = warnings.0.lock().unwrap().clone();
    let fell_back = first.verbs_backend() == "sim" || first.cuda_backend() == Some("sim");
    if !fell_back {
        // Real hardware here: nothing to tell.
        assert!(told.is_empty(), "{told:?}");
        return;
    }
    assert_eq!(told.len(), 1, "told once, not {told:?}");
    let told = &told[0];
    assert!(told.starts_with("gdr_core::backend:"), "{told}");
    assert!(told.contains("fell back to the simulation"), "{told}");
    // Why: the first context's notes, on one line.
    let first_note = first.notes()[0].split_whitespace().next().unwrap();
    assert!(told.contains(first_note), "{told} lacks {first_note}");
    // The second fell back as well, and says so in its notes only.
    assert_eq!(second.notes(), first.notes());
}
