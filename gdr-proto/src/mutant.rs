//! Deliberate bugs, compiled into the loom build only (`--cfg loom`), so
//! that the loom models driving this crate's state machines (in
//! `gdr-core`) can be shown to fail on the bug each is named after.
//!
//! A hook reads `if mutant::active("name") { <the bug> }`. Outside loom,
//! [`active`] is a `const fn` answering `false`: the hooks compile to
//! nothing and this crate reads no environment. Under loom it answers
//! whether `GDR_MUTANT` names that mutant; `gdr-core`'s mutant table lists
//! every name (and refuses an unknown one), `scripts/loom-mutants.sh` pairs
//! each with the models that must catch it.

/// Whether mutant `name` is active: never, outside loom.
#[cfg(not(loom))]
#[inline(always)]
pub(crate) const fn active(_name: &str) -> bool {
    false
}

/// Whether mutant `name` is active: `GDR_MUTANT` names it.
#[cfg(loom)]
pub(crate) fn active(name: &str) -> bool {
    static CHOSEN: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    CHOSEN
        .get_or_init(|| std::env::var("GDR_MUTANT").ok().filter(|n| !n.is_empty()))
        .as_deref()
        == Some(name)
}
