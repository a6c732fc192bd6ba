//! Scripted faults: "the Nth call of this kind fails with this error".
//!
//! One [`FaultPlan`] is shared by every simulated object of a test (NIC and
//! GPU alike). Each simulated call site asks the plan with [`FaultPlan::hit`];
//! the plan counts calls per [`FaultSite`] and hands back the scripted
//! [`Fault`] when the count matches. At the end a test calls
//! [`FaultPlan::verify`] (or [`FaultPlan::assert_all_fired`]): a fault that
//! never fired means the test did not exercise what it claims to.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use hal_cuda::CudaError;
use hal_verbs::{VerbsError, WcStatus};

/// A kind of simulated call that a fault can be attached to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum FaultSite {
    /// `ibv_reg_mr`.
    VerbsRegister,
    /// `ibv_reg_dmabuf_mr`.
    VerbsRegisterDmabuf,
    /// `ibv_create_qp`.
    VerbsCreateQp,
    /// `ibv_modify_qp`.
    VerbsModifyQp,
    /// One work request taken by `ibv_post_send` (counted per request, so a
    /// fault can hit the middle of a batch).
    VerbsPostSend,
    /// One work request taken by `ibv_post_recv`.
    VerbsPostRecv,
    /// One completion produced for a send-queue request.
    VerbsCompletion,
    /// `cuMemAlloc` / `cuMemHostAlloc`.
    CudaAlloc,
    /// Any async copy or memset queued on a stream.
    CudaCopy,
    /// `cuStreamWaitValue32` / `cuStreamWriteValue32` (before the copy
    /// site counts them): e.g. `NotSupported`, as from a driver without
    /// stream memory operations.
    CudaStreamMemOp,
    /// `cuMemGetHandleForAddressRange`.
    CudaExportDmabuf,
    /// `cuIpcOpenMemHandle`.
    CudaIpcOpen,
    /// `cuCtxEnablePeerAccess`.
    CudaEnablePeerAccess,
    /// `cuFlushGPUDirectRDMAWrites`.
    CudaFlushWrites,
}

/// What happens when a scripted fault fires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// A verbs call returns this error.
    Verbs(VerbsError),
    /// A CUDA call returns this error.
    Cuda(CudaError),
    /// A work request runs but completes with this status (only meaningful at
    /// [`FaultSite::VerbsCompletion`]); no byte moves, and the QP goes to
    /// the error state as a real RC QP does after an error completion.
    CompletionStatus(WcStatus),
    /// The device dies: this call and every later one on it fails with
    /// "device lost"; its QPs flush.
    DeviceLost,
    /// The send queue's CQ overruns (only meaningful at
    /// [`FaultSite::VerbsCompletion`]): the request's completion is lost,
    /// the CQ is marked overrun (polling it fails from then on, as a real
    /// overrun is fatal to the CQ) with a CQ error event, and the QP goes
    /// to the error state.
    CqOverrun,
    /// The QP goes to the error state on its own, with a QP fatal event
    /// (only meaningful at [`FaultSite::VerbsCompletion`]): the request and
    /// everything queued behind it flush.
    QpFatal,
    /// The call takes this long, then goes on as if nothing fired: a slow
    /// driver call (only meaningful at CUDA sites, e.g.
    /// [`FaultSite::CudaIpcOpen`]: what a caller holds meanwhile, others
    /// wait for).
    Slow(std::time::Duration),
}

/// One fault in a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptedFault {
    /// Where.
    pub site: FaultSite,
    /// On which call at that site, counting from 1.
    pub nth: u64,
    /// What happens.
    pub fault: Fault,
    /// Whether it has fired.
    pub fired: bool,
}

/// Faults that were scripted but never fired.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("scripted faults never fired: {}", describe(.0))]
pub struct UnfiredFaults(pub Vec<ScriptedFault>);

fn describe(faults: &[ScriptedFault]) -> String {
    faults
        .iter()
        .map(|f| format!("{:?} call #{} ({:?})", f.site, f.nth, f.fault))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Faults drawn at random, reproducibly: the `n`th call at a site fails
/// when a hash of (`seed`, site, `n`) falls under the site's rate, with a
/// fault of its menu the same hash picks. Whether a call fails depends on
/// the seed and on how many calls that site saw before, never on the
/// order in which threads reach different sites.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RandomFaults {
    /// The seed.
    pub seed: u64,
    /// Entries of a site, each: the chance that a call fails, in parts per
    /// million, and the faults it fails with (one picked at random). A site
    /// may have several entries (a rare fault at a rate of its own); the
    /// first that fires wins.
    pub menu: Vec<(FaultSite, u32, Vec<Fault>)>,
}

/// How often one fault of a [`RandomFaults`] menu fired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FiredCount {
    /// Where.
    pub site: FaultSite,
    /// What.
    pub fault: Fault,
    /// How many times.
    pub fired: u64,
}

#[derive(Default)]
struct PlanState {
    calls: HashMap<FaultSite, u64>,
    faults: Vec<ScriptedFault>,
    random: Option<RandomFaults>,
    /// Whether the random faults fire (calls are counted either way).
    random_active: bool,
    /// By (menu entry, fault of its list): times fired.
    random_fired: HashMap<(usize, usize), u64>,
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash of `x`.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A shared, cloneable script of faults. An empty plan never fails anything.
///
/// Calls are counted per site from the plan's creation, with one
/// exception: while the plan is inert (no scripted fault left to fire and
/// no random menu), the simulated NIC's fast path (a post whose requests
/// all complete at once, a poll with nothing to progress) neither consults
/// nor counts it, so threads on different queue pairs never meet on the
/// plan's lock. A fault scripted relative to the count
/// ([`fail_next`](Self::fail_next), `calls(site) + k`) arms the plan, and
/// from then on every call is counted: it fires on the call it names.
#[derive(Clone, Default)]
pub struct FaultPlan {
    shared: Arc<PlanShared>,
}

#[derive(Default)]
struct PlanShared {
    state: Mutex<PlanState>,
    /// Whether a scripted fault is left to fire or a random menu is set
    /// (kept by every change of either, under `state`'s lock).
    armed: AtomicBool,
}

impl fmt::Debug for FaultPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("FaultPlan")
            .field("calls", &state.calls)
            .field("faults", &state.faults)
            .finish()
    }
}

impl FaultPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    // A test that panicked while holding the lock must not hide its own
    // failure behind a poison error here.
    fn lock(&self) -> MutexGuard<'_, PlanState> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether nothing can fire (no scripted fault left, no random menu):
    /// the sim's fast path may then skip the plan (see the type's docs).
    pub(crate) fn is_inert(&self) -> bool {
        !self.shared.armed.load(Ordering::Acquire)
    }

    /// Sets `armed` from `state` (called with its lock held, after any
    /// change of the scripted faults or the random menu).
    fn rearm(&self, state: &PlanState) {
        let armed = state.random.is_some() || state.faults.iter().any(|f| !f.fired);
        self.shared.armed.store(armed, Ordering::Release);
    }

    /// Scripts the `nth` call (from 1) at `site` to fail with `fault`.
    /// Counting starts at the plan's creation, not at this call.
    pub fn fail_nth(&self, site: FaultSite, nth: u64, fault: Fault) -> &Self {
        assert!(nth >= 1, "calls are counted from 1");
        let mut state = self.lock();
        state.faults.push(ScriptedFault {
            site,
            nth,
            fault,
            fired: false,
        });
        self.rearm(&state);
        drop(state);
        self
    }

    /// Scripts the next call at `site` to fail.
    pub fn fail_next(&self, site: FaultSite, fault: Fault) -> &Self {
        let nth = self.calls(site) + 1;
        self.fail_nth(site, nth, fault)
    }

    /// Counts one call at `site` and returns the fault scripted for it, if any.
    /// Simulated objects call this at the top of every faultable operation.
    pub fn hit(&self, site: FaultSite) -> Option<Fault> {
        let mut state = self.lock();
        let count = state.calls.entry(site).or_insert(0);
        *count += 1;
        let nth = *count;
        let scripted = state
            .faults
            .iter_mut()
            .find(|f| f.site == site && f.nth == nth && !f.fired);
        if let Some(scripted) = scripted {
            scripted.fired = true;
            let fault = scripted.fault.clone();
            tracing::debug!(?site, nth, ?fault, "scripted fault fires");
            self.rearm(&state);
            return Some(fault);
        }
        let (entry, pick, fault) = {
            let random = state.random.as_ref().filter(|_| state.random_active)?;
            // Each menu entry of the site draws on its own, the first
            // that fires wins.
            random
                .menu
                .iter()
                .enumerate()
                .filter(|(_, (s, _, faults))| *s == site && !faults.is_empty())
                .find_map(|(entry, (_, rate, faults))| {
                    let h = mix(random.seed ^ mix(((entry as u64) << 48) ^ nth));
                    (h % 1_000_000 < u64::from(*rate)).then(|| {
                        let pick = (h / 1_000_000) as usize % faults.len();
                        (entry, pick, faults[pick].clone())
                    })
                })?
        };
        *state.random_fired.entry((entry, pick)).or_insert(0) += 1;
        tracing::debug!(?site, nth, ?fault, "random fault fires");
        Some(fault)
    }

    /// A plan that also fails calls at random as `random` says (scripted
    /// faults come first).
    pub fn random(random: RandomFaults) -> Self {
        let plan = Self::new();
        {
            let mut state = plan.lock();
            state.random = Some(random);
            state.random_active = true;
            plan.rearm(&state);
        }
        plan
    }

    /// Turns the random faults off (`false`: calls are still counted, so
    /// the faults drawn later stay those of the seed) or on again: a test
    /// sets its world up, or inspects it, without them.
    pub fn set_random_active(&self, active: bool) {
        self.lock().random_active = active;
    }

    /// Each fault of the random menu with how many times it fired (zero
    /// included), in menu order.
    pub fn random_fired(&self) -> Vec<FiredCount> {
        let state = self.lock();
        let Some(random) = &state.random else {
            return Vec::new();
        };
        random
            .menu
            .iter()
            .enumerate()
            .flat_map(|(entry, (site, _, faults))| {
                faults
                    .iter()
                    .enumerate()
                    .map(move |(pick, fault)| (entry, pick, site, fault))
            })
            .map(|(entry, pick, site, fault)| FiredCount {
                site: *site,
                fault: fault.clone(),
                fired: state.random_fired.get(&(entry, pick)).copied().unwrap_or(0),
            })
            .collect()
    }

    /// Calls counted at `site` so far.
    pub fn calls(&self, site: FaultSite) -> u64 {
        self.lock().calls.get(&site).copied().unwrap_or(0)
    }

    /// The faults that have not fired yet.
    pub fn unfired(&self) -> Vec<ScriptedFault> {
        self.lock()
            .faults
            .iter()
            .filter(|f| !f.fired)
            .cloned()
            .collect()
    }

    /// `Ok` when every scripted fault fired.
    pub fn verify(&self) -> Result<(), UnfiredFaults> {
        let unfired = self.unfired();
        if unfired.is_empty() {
            Ok(())
        } else {
            Err(UnfiredFaults(unfired))
        }
    }

    /// Panics, listing them, unless every scripted fault fired (for tests).
    #[track_caller]
    pub fn assert_all_fired(&self) {
        if let Err(e) = self.verify() {
            panic!("{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nth_call_fails_once_and_is_accounted() {
        let plan = FaultPlan::new();
        let err = VerbsError::from_errno("ibv_reg_mr", "sim0", libc::ENOMEM);
        plan.fail_nth(FaultSite::VerbsRegister, 2, Fault::Verbs(err.clone()));
        assert!(plan.verify().is_err());
        assert_eq!(plan.hit(FaultSite::VerbsRegister), None);
        assert_eq!(plan.hit(FaultSite::VerbsPostSend), None);
        assert_eq!(plan.hit(FaultSite::VerbsRegister), Some(Fault::Verbs(err)));
        assert_eq!(plan.hit(FaultSite::VerbsRegister), None);
        assert_eq!(plan.calls(FaultSite::VerbsRegister), 3);
        plan.verify().unwrap();
    }

    #[test]
    fn unfired_fault_is_reported() {
        let plan = FaultPlan::new();
        plan.fail_next(FaultSite::CudaCopy, Fault::DeviceLost);
        let shared = plan.clone();
        shared.hit(FaultSite::CudaAlloc);
        let err = plan.verify().unwrap_err();
        assert_eq!(err.0.len(), 1);
        assert!(err.to_string().contains("CudaCopy"), "{err}");
        let result = std::panic::catch_unwind(|| plan.assert_all_fired());
        assert!(result.is_err());
    }

    #[test]
    fn random_faults_replay_from_their_seed_at_the_menus_rate() {
        let menu = vec![(
            FaultSite::VerbsPostSend,
            100_000, // 10 %
            vec![Fault::DeviceLost, Fault::QpFatal],
        )];
        let run = |seed| {
            let plan = FaultPlan::random(RandomFaults {
                seed,
                menu: menu.clone(),
            });
            let hits: Vec<Option<Fault>> = (0..10_000)
                .map(|_| plan.hit(FaultSite::VerbsPostSend))
                .collect();
            // A site off the menu never fails.
            assert_eq!(plan.hit(FaultSite::CudaCopy), None);
            (hits, plan.random_fired())
        };
        let (first, fired) = run(7);
        assert_eq!(run(7).0, first, "the same seed, the same faults");
        assert_ne!(run(8).0, first, "another seed, other faults");
        let total: u64 = fired.iter().map(|f| f.fired).sum();
        assert_eq!(total, first.iter().flatten().count() as u64);
        assert!(
            (800..1200).contains(&total),
            "about 10 % of 10,000: {total}"
        );
        assert!(
            fired.iter().all(|f| f.fired > 300),
            "both faults drawn: {fired:?}"
        );
    }
}
