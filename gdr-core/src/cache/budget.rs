//! A protection domain's hard budget of memory regions and registered bytes.
//!
//! The cache's [`super::Limits`] steer eviction: they count the entries the
//! index shows. A NIC's `max_mr` and the pinned-memory budget count
//! something else: every MR alive in the domain, whatever holds it. That is
//! cached entries, entries already unlinked (invalidated, superseded by a
//! merge) whose handles live on, registrations in flight, grants, and the
//! probe's and the self-check's scratch MRs. Each of those takes a
//! [`Reservation`] before it calls the NIC and keeps it until the MR is
//! deregistered, so the live count can never pass the budget: a request that
//! would is refused with [`BudgetExceeded`] (the caller may evict unused
//! entries and try again) instead of reaching the NIC.

use std::fmt;
// std's `Arc`, as in `crate::lifetime`: the ladder and the loopback hold
// budgets in std `Arc`s, and it is the count under the mutex that the loom
// models check.
use std::sync::Arc;

use crate::sync::{self, Mutex};

/// The hard limits of one domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetLimits {
    /// Memory regions alive at once (the NIC's `max_mr`).
    pub max_mrs: u64,
    /// Bytes registered at once.
    pub max_bytes: u64,
}

/// What is alive in a domain now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BudgetUsage {
    /// Memory regions alive (or being registered).
    pub mrs: u64,
    /// Bytes they cover.
    pub bytes: u64,
    /// The most MRs ever alive at once.
    pub peak_mrs: u64,
}

/// A registration the budget refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "registering {bytes} more bytes would pass the domain's budget \
     ({} MRs, {} bytes alive; limits {} MRs, {} bytes)",
    usage.mrs, usage.bytes, limits.max_mrs, limits.max_bytes
)]
pub struct BudgetExceeded {
    /// The bytes asked for.
    pub bytes: u64,
    /// What was alive.
    pub usage: BudgetUsage,
    /// The limits.
    pub limits: BudgetLimits,
}

/// The budget of one domain, shared by everything that registers in it.
pub struct DomainBudget {
    limits: BudgetLimits,
    usage: Mutex<BudgetUsage>,
}

impl fmt::Debug for DomainBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DomainBudget")
            .field("limits", &self.limits)
            .field("usage", &self.usage())
            .finish()
    }
}

impl DomainBudget {
    /// A budget with `limits`, nothing alive.
    pub fn new(limits: BudgetLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            usage: Mutex::new(BudgetUsage::default()),
        })
    }

    /// Its limits.
    pub fn limits(&self) -> BudgetLimits {
        self.limits
    }

    /// What is alive now.
    pub fn usage(&self) -> BudgetUsage {
        *sync::lock(&self.usage)
    }

    /// Reserves one MR of `bytes`, held until the reservation drops (after
    /// the MR is deregistered).
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Result<Reservation, BudgetExceeded> {
        let mut usage = sync::lock(&self.usage);
        let fits = usage.mrs < self.limits.max_mrs
            && usage
                .bytes
                .checked_add(bytes)
                .is_some_and(|b| b <= self.limits.max_bytes);
        if !fits {
            return Err(BudgetExceeded {
                bytes,
                usage: *usage,
                limits: self.limits,
            });
        }
        if super::mutant::active("budget-check-then-act") {
            drop(usage);
            usage = sync::lock(&self.usage);
        }
        usage.mrs += 1;
        usage.bytes += bytes;
        usage.peak_mrs = usage.peak_mrs.max(usage.mrs);
        drop(usage);
        Ok(Reservation {
            budget: Arc::clone(self),
            bytes,
        })
    }
}

/// One MR's share of a [`DomainBudget`]; returned when dropped.
pub struct Reservation {
    budget: Arc<DomainBudget>,
    bytes: u64,
}

impl Reservation {
    /// The bytes reserved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut usage = sync::lock(&self.budget.usage);
        usage.mrs = usage.mrs.saturating_sub(1);
        usage.bytes = usage.bytes.saturating_sub(self.bytes);
    }
}
