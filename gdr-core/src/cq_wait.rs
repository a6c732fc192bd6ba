//! Waiting for one completion queue's completions with the engine's
//! waiting policy (its reactor): poll while completions come, spin a
//! little, then arm the CQ's completion channel, poll once more (verbs'
//! arm-then-poll) and sleep on the channel's fd until a completion or the
//! deadline. The loopback self-check and `gdr bench` wait this way, so the
//! library has one way of waiting, not a poll-then-sleep loop per caller.
//!
//! Without a channel (a provider that makes none) the CQ is polled,
//! yielding the core between empty polls and sleeping at most the reactor's
//! GPU poll interval at a time.

use std::cell::RefCell;
use std::os::fd::RawFd;
use std::time::Instant;

use hal_verbs::{
    Api, Completion, CompletionChannel as _, CompletionQueue as _, CqNotify, VerbsError,
};

use crate::engine::reactor::{Parkable, Reactor};

/// Completions polled per call.
const POLL_BATCH: usize = 16;

/// Waits for the completions of a CQ (and its channel, when it has one).
/// One waiter serves one thread's waits at a time; keep it with the CQ
/// (it holds the reactor's wake-up eventfd).
#[derive(Debug)]
pub struct CqWaiter {
    reactor: Reactor,
}

impl CqWaiter {
    /// A waiter. Fails only when no eventfd can be made (the reactor's own
    /// wake-up fd).
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            reactor: Reactor::new()?,
        })
    }

    /// Appends the next completions of `cq` to `out` (at least one),
    /// waiting until one comes or `deadline` passes (`None`: no deadline).
    /// `channel` is the one `cq` was created on (`None`: it has none, and
    /// is polled). Returns how many were appended: 0 only at the deadline.
    pub fn wait<A: Api>(
        &self,
        cq: &A::CompletionQueue,
        channel: Option<&A::CompletionChannel>,
        deadline: Option<Instant>,
        out: &mut Vec<Completion>,
    ) -> Result<usize, VerbsError> {
        let before = out.len();
        let polling = Polling::<A> {
            cq,
            channel,
            out: RefCell::new(out),
            error: RefCell::new(None),
        };
        self.reactor.wait_until(&polling, deadline, || {
            polling.error.borrow().is_some() || polling.out.borrow().len() > before
        });
        let Polling { out, error, .. } = polling;
        match error.into_inner() {
            Some(e) => Err(e),
            None => Ok(out.into_inner().len() - before),
        }
    }
}

/// One wait's view of the CQ, as the reactor drives it.
struct Polling<'a, A: Api> {
    cq: &'a A::CompletionQueue,
    channel: Option<&'a A::CompletionChannel>,
    out: RefCell<&'a mut Vec<Completion>>,
    /// A poll that failed ends the wait with its error.
    error: RefCell<Option<VerbsError>>,
}

impl<A: Api> Parkable for Polling<'_, A> {
    fn progress(&self) -> usize {
        if self.error.borrow().is_some() {
            return 1;
        }
        let mut polled = [Completion::default(); POLL_BATCH];
        match self.cq.poll(&mut polled) {
            Ok(n) => {
                self.out.borrow_mut().extend_from_slice(&polled[..n]);
                n
            }
            Err(e) => {
                *self.error.borrow_mut() = Some(e);
                1
            }
        }
    }

    fn polls(&self) -> bool {
        self.channel.is_none()
    }

    fn arm(&self) {
        if self.channel.is_some()
            && let Err(e) = self.cq.req_notify(CqNotify::Next)
        {
            tracing::debug!(error = %e, "arming the CQ");
        }
    }

    fn park_set(&self, fds: &mut Vec<RawFd>) -> Option<Instant> {
        fds.extend(self.channel.map(|c| c.fd()));
        None
    }

    fn drain(&self) {
        if let Some(channel) = self.channel {
            while let Ok(Some(_)) = channel.get_cq_event() {}
        }
    }

    fn now(&self) -> Instant {
        Instant::now()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use gdr_sim::{NodeConfig, SimFabric, SimVerbsApi};
    use hal_verbs::{
        AccessFlags, Context as _, MemoryRegion as _, ProtectionDomain as _, Provider as _,
        QueuePair as _, SendFlags, SendOp, SendRequest, SgList, Sge,
    };

    use super::*;
    use crate::loopback::{PairConfig, QpPair};

    type Cq = <SimVerbsApi as Api>::CompletionQueue;
    type Channel = <SimVerbsApi as Api>::CompletionChannel;
    type Pd = <SimVerbsApi as Api>::ProtectionDomain;
    type Mr = <SimVerbsApi as Api>::MemoryRegion;

    /// A loopback pair on a simulated NIC, its CQ on a channel or not, and
    /// a registered buffer the requester WRITEs within.
    struct Rig {
        pair: QpPair<SimVerbsApi>,
        mr: Mr,
        cq: Cq,
        channel: Option<Channel>,
        _pd: Pd,
        _memory: Vec<u8>,
        _fabric: SimFabric,
    }

    fn rig(with_channel: bool) -> Arc<Rig> {
        let fabric = SimFabric::new();
        let ctx = fabric
            .add_node("n", NodeConfig::default())
            .open("sim0")
            .unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let channel = with_channel.then(|| ctx.create_comp_channel().unwrap());
        let cq = match &channel {
            Some(channel) => ctx.create_cq_on_channel(16, channel, 0).unwrap(),
            None => ctx.create_cq(16).unwrap(),
        };
        let pair = QpPair::connect(&ctx, &pd, &cq, 1, &PairConfig::default()).unwrap();
        let mut memory = vec![0u8; 8192];
        // SAFETY: `memory` lives in the rig, after the MR (field order).
        let mr = unsafe {
            pd.register(
                memory.as_mut_ptr() as u64,
                memory.len(),
                AccessFlags::transfer(),
            )
        }
        .unwrap();
        Arc::new(Rig {
            pair,
            mr,
            cq,
            channel,
            _pd: pd,
            _memory: memory,
            _fabric: fabric,
        })
    }

    /// A signaled 4 KiB WRITE from the buffer's first half to its second.
    fn post_write(rig: &Rig, wr_id: u64) {
        let request = SendRequest {
            wr_id,
            op: SendOp::Write {
                remote_addr: rig.mr.addr() + 4096,
                rkey: rig.mr.rkey(),
            },
            sg_list: SgList::from_slice(&[Sge {
                addr: rig.mr.addr(),
                length: 4096,
                lkey: rig.mr.lkey(),
            }]),
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: both ranges lie in `rig.mr`, which the rig keeps alive
        // until after the completion is waited for.
        unsafe { rig.pair.requester.post_send(std::slice::from_ref(&request)) }.unwrap();
    }

    /// This thread's CPU time.
    fn thread_cpu() -> Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec to write; the clock id is a
        // constant every Linux has.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0);
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    /// Waits on `rig` in a thread of its own (deadline in 10 s) while this
    /// one posts after `delay`: what the waiter got, and the CPU time it
    /// used. The wait must end well before its deadline.
    fn wait_for_a_late_post(rig: &Arc<Rig>, delay: Duration) -> (Vec<Completion>, Duration) {
        let waiting = {
            let rig = Arc::clone(rig);
            std::thread::spawn(move || {
                let waiter = CqWaiter::new().unwrap();
                let mut got = Vec::new();
                let cpu = thread_cpu();
                let start = Instant::now();
                let deadline = start + Duration::from_secs(10);
                waiter
                    .wait::<SimVerbsApi>(&rig.cq, rig.channel.as_ref(), Some(deadline), &mut got)
                    .unwrap();
                // (At the deadline a last poll would find it too.)
                assert!(
                    start.elapsed() < Duration::from_secs(5),
                    "the completion did not end the wait: it ran {:?}",
                    start.elapsed()
                );
                (got, thread_cpu() - cpu)
            })
        };
        std::thread::sleep(delay);
        post_write(rig, 7);
        waiting.join().unwrap()
    }

    /// A completion that comes while the waiter sleeps on the channel wakes
    /// it, and the waiter slept: over a 300 ms wait it used far less CPU
    /// than a polling loop (which uses all of it).
    #[test]
    fn a_completion_wakes_a_waiter_asleep_on_the_channel() {
        let rig = rig(true);
        let (got, cpu) = wait_for_a_late_post(&rig, Duration::from_millis(300));
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].wr_id, 7);
        assert!(got[0].status.is_success(), "{:?}", got[0]);
        assert!(
            cpu < Duration::from_millis(30),
            "the waiter used {cpu:?} of CPU in a 300 ms wait: it did not sleep"
        );
    }

    /// A CQ without a channel is polled: the completion is still found.
    #[test]
    fn a_cq_without_a_channel_is_polled() {
        let rig = rig(false);
        let (got, _) = wait_for_a_late_post(&rig, Duration::from_millis(50));
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].wr_id, 7);
    }

    /// Nothing comes: the wait ends at its deadline, with nothing.
    #[test]
    fn a_wait_ends_at_its_deadline_with_nothing() {
        let rig = rig(true);
        let waiter = CqWaiter::new().unwrap();
        let mut got = Vec::new();
        let start = Instant::now();
        let deadline = start + Duration::from_millis(50);
        let n = waiter
            .wait::<SimVerbsApi>(&rig.cq, rig.channel.as_ref(), Some(deadline), &mut got)
            .unwrap();
        assert_eq!((n, got.len()), (0, 0));
        assert!(Instant::now() >= deadline);
    }

    /// Completions already in the CQ are taken without waiting, appended
    /// to what `out` held.
    #[test]
    fn completions_already_there_are_appended() {
        let rig = rig(true);
        post_write(&rig, 1);
        post_write(&rig, 2);
        let waiter = CqWaiter::new().unwrap();
        let mut got = vec![Completion::default()];
        let mut n = 0;
        while n < 2 {
            n += waiter
                .wait::<SimVerbsApi>(&rig.cq, rig.channel.as_ref(), None, &mut got)
                .unwrap();
        }
        let ids: Vec<u64> = got[1..].iter().map(|c| c.wr_id).collect();
        assert_eq!(ids, [1, 2]);
    }
}
