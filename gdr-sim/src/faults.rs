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

#[derive(Default)]
struct PlanState {
    calls: HashMap<FaultSite, u64>,
    faults: Vec<ScriptedFault>,
}

/// A shared, cloneable script of faults. An empty plan never fails anything.
#[derive(Clone, Default)]
pub struct FaultPlan {
    state: Arc<Mutex<PlanState>>,
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
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Scripts the `nth` call (from 1) at `site` to fail with `fault`.
    /// Counting starts at the plan's creation, not at this call.
    pub fn fail_nth(&self, site: FaultSite, nth: u64, fault: Fault) -> &Self {
        assert!(nth >= 1, "calls are counted from 1");
        self.lock().faults.push(ScriptedFault {
            site,
            nth,
            fault,
            fired: false,
        });
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
            .find(|f| f.site == site && f.nth == nth && !f.fired)?;
        scripted.fired = true;
        tracing::debug!(?site, nth, fault = ?scripted.fault, "scripted fault fires");
        Some(scripted.fault.clone())
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
}
