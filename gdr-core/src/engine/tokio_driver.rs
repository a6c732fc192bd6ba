//! The engine driven by a tokio task through fd readiness
//! ([`Engine::drive_on_tokio`], feature `tokio`): the third way to drive
//! the engine's reactor, beside a caller's wait and a thread.
//!
//! The task leads the reactor as a thread would, with the same policy
//! (`reactor::Spin`): it makes progress, spins (`reactor::SPIN_ROUNDS`
//! empty rounds, each a `yield_now`, so the tasks that share its worker
//! run between them), then parks. Its park is the reactor's
//! (`Reactor::park_begin` and `park_end`: the same arm-then-poll, the
//! same `changes`/`parked` handshake with `Reactor::wake`), but instead of
//! ppoll(2) it awaits one fd: an epoll set of the park's fds (the CQs'
//! completion channels, the NICs' async fds, the connections' event fds
//! and the reactor's wake eventfd), registered with tokio's [`AsyncFd`],
//! raced with a tokio timer at the engine's next deadline. While work
//! runs that only polling sees (GPU copies and stream events: CUDA has no
//! fd; a queue pair being re-established) it does not park at all: it
//! yields and looks again (tokio's timer counts milliseconds, the
//! reactor's GPU poll interval is 20 µs), so a worker stays busy while
//! GPU copies run.
//!
//! Like the engine's own thread, the task holds the engine only for one
//! step at a time (its `InternalHolds`): it never keeps the engine alive,
//! it ends when the engine closes, and the engine's teardown runs in the
//! drop of its last handle, never on a runtime worker.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::reactor::{Next, Parkable, Reactor, Spin};
use super::{Engine, INTERNAL_THREAD, InternalHolds, Shared};

/// Why [`Engine::drive_on_tokio`] could not start its task.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AsyncDriverError {
    /// Not called within a tokio runtime (from a task, or inside
    /// `Runtime::enter` or `Runtime::block_on`).
    #[error("not within a tokio runtime: call drive_on_tokio from a task or inside Runtime::enter")]
    NoRuntime,
    /// The runtime was built without its I/O driver.
    #[error("the tokio runtime has no I/O driver: build it with enable_io (or enable_all)")]
    IoDisabled,
    /// The runtime was built without its timer.
    #[error("the tokio runtime has no timer: build it with enable_time (or enable_all)")]
    TimeDisabled,
    /// The epoll set of the engine's fds could not be made or registered.
    #[error("the driver's epoll set: {0}")]
    Epoll(#[source] std::io::Error),
}

/// A tokio task that drives an engine ([`Engine::drive_on_tokio`]) until
/// this is dropped (or the engine closes, or its runtime shuts down).
/// `Future`s awaited while it runs count on it to wake them, as on a
/// [`Driver`](super::Driver) thread: keep it until they have ended.
pub struct AsyncDriver {
    task: tokio::task::JoinHandle<()>,
    counted: Arc<Counted>,
    polls: Arc<AtomicU64>,
}

impl std::fmt::Debug for AsyncDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncDriver")
            .field("running", &self.is_running())
            .field("polls", &self.polls())
            .finish()
    }
}

impl AsyncDriver {
    /// Whether the task still drives: `false` once the engine closed or
    /// the runtime dropped the task (then the engine counts it no more,
    /// and an awaited batch starts the engine's own thread again).
    pub fn is_running(&self) -> bool {
        !self.task.is_finished()
    }

    /// How many times the runtime has polled the task: a diagnostic. It
    /// grows by a few hundred after each
    /// piece of work (the spin's yields) and stays flat while the engine
    /// is idle (the task is parked).
    pub fn polls(&self) -> u64 {
        self.polls.load(Ordering::Relaxed)
    }
}

impl Drop for AsyncDriver {
    fn drop(&mut self) {
        // The task stops at its next poll (the runtime drops it: its lead
        // is given back then); it counts no more from now on, so a batch
        // awaited after this starts the engine's own thread.
        self.task.abort();
        self.counted.release();
    }
}

/// The driver's place in the engine's count of drivers
/// (`Shared::drivers`): given back once, by the handle's drop or the
/// task's end, whichever comes first.
#[derive(Debug)]
struct Counted {
    drivers: Arc<AtomicUsize>,
    counted: AtomicBool,
}

impl Counted {
    fn release(&self) {
        if self.counted.swap(false, Ordering::AcqRel) {
            self.drivers.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Releases the count when the task ends or is dropped.
struct CountedTask(Arc<Counted>);

impl Drop for CountedTask {
    fn drop(&mut self) {
        self.0.release();
    }
}

impl Engine {
    /// Drives the engine from a task on the current tokio runtime (feature
    /// `tokio`): the task makes progress while work comes and otherwise
    /// awaits the readiness of the engine's fds (one epoll set, through
    /// tokio's `AsyncFd`) or a timer at the engine's next deadline, so an
    /// awaited [`Batch`](super::Batch) is woken by the task, on no thread
    /// of the engine's. Dropping the returned [`AsyncDriver`] stops it.
    ///
    /// Call it within a runtime whose I/O driver and timer are on
    /// (`#[tokio::main]`, `Runtime::new` or `enable_all`); otherwise a
    /// typed error, never a panic of the caller's. (tokio reports a
    /// missing driver by panicking, which is caught here; the panic hook
    /// still prints it, and a build with `panic = "abort"` aborts.)
    ///
    /// What it costs and what it needs:
    /// - After work, the task spins the reactor's rounds with a
    ///   `yield_now` each, then parks; an idle engine's task is not polled.
    /// - While work runs whose end only polling sees (GPU copies, stream
    ///   events, a queue pair being re-established), it yields and looks
    ///   again without parking: one worker stays busy until that work
    ///   ends.
    /// - One leader drives at a time: while a thread leads (a blocking
    ///   [`Batch::wait`](super::Batch::wait), a [`Driver`](super::Driver),
    ///   the engine's own thread), the task waits for the lead (the
    ///   reactor wakes it when it is given back) and that thread drives;
    ///   once the task leads it keeps the lead, and blocking waits on
    ///   other threads follow it (they are told of its progress). A
    ///   blocking wait on a runtime worker can starve the task: run those
    ///   with `spawn_blocking`.
    /// - The park's timer is tokio's (millisecond ticks): a deadline fires
    ///   up to about a millisecond late. It is set at the engine's next
    ///   deadline as a distance on the engine's clock (`EngineConfig::clock`)
    ///   from its now, then measured on tokio's clock: with a clock other
    ///   than the system's the task wakes when that distance has passed in
    ///   real time, and looks at the engine's clock again then (as a
    ///   thread's park does).
    /// - It holds the engine only while it makes progress: it ends when
    ///   the engine's last handle is dropped, and the engine is torn down
    ///   in that drop, not on a runtime worker.
    ///
    /// ```
    /// use gdr_core::engine::{Engine, EngineConfig};
    /// use gdr_sim::{NodeConfig, SimFabric};
    ///
    /// #[tokio::main]
    /// async fn main() -> Result<(), Box<dyn std::error::Error>> {
    ///     let fabric = SimFabric::new();
    ///     let node = fabric.add_node("a", NodeConfig::default());
    ///     let engine =
    ///         Engine::new(&node.erased(), None, EngineConfig::default())?;
    ///     let driver = engine.drive_on_tokio()?;
    ///     // ... submit batches and `.await` them: the task wakes them ...
    ///     assert!(driver.is_running());
    ///     drop(driver); // the task stops
    ///     Ok(())
    /// }
    /// ```
    pub fn drive_on_tokio(&self) -> Result<AsyncDriver, AsyncDriverError> {
        let handle =
            tokio::runtime::Handle::try_current().map_err(|_| AsyncDriverError::NoRuntime)?;
        let epoll = Epoll::new().map_err(AsyncDriverError::Epoll)?;
        // tokio panics where its drivers are off; turned into errors here.
        let registered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: `Epoll` owns its fd (an `OwnedFd`, closed only when
            // it is dropped, which the `AsyncFd` owning it does last) and
            // `as_raw_fd` always returns that fd: it stays open and the
            // same file for the `AsyncFd`'s whole life.
            unsafe { AsyncFd::register_with_interest(epoll, Interest::READABLE) }
        }))
        .map_err(|_| AsyncDriverError::IoDisabled)?
        .map_err(|e| AsyncDriverError::Epoll(e.into_parts().1))?;
        std::panic::catch_unwind(|| drop(tokio::time::sleep(Duration::ZERO)))
            .map_err(|_| AsyncDriverError::TimeDisabled)?;
        let drivers = Arc::clone(&self.shared.drivers);
        drivers.fetch_add(1, Ordering::AcqRel);
        let counted = Arc::new(Counted {
            drivers,
            counted: AtomicBool::new(true),
        });
        let polls = Arc::new(AtomicU64::new(0));
        let task = drive(
            Arc::downgrade(&self.shared),
            Arc::clone(&self.shared.holds),
            Arc::clone(&self.shared.reactor),
            registered,
            CountedTask(Arc::clone(&counted)),
        );
        let task = handle.spawn(CountPolls {
            inner: Box::pin(task),
            polls: Arc::clone(&polls),
        });
        Ok(AsyncDriver {
            task,
            counted,
            polls,
        })
    }
}

/// The driver's task: takes the lead, then leads until the engine
/// closes (or the task is dropped: its lead is given back then).
async fn drive(
    weak: Weak<Shared>,
    holds: Arc<InternalHolds>,
    reactor: Arc<Reactor>,
    epoll: AsyncFd<Epoll>,
    _counted: CountedTask,
) {
    // Counted among the reactor's watchers for its life: another thread's
    // progress tells its park.
    let _watching = reactor.watch();
    // While a thread leads, it drives; the task's turn comes when the lead
    // is given back.
    let _lead = std::future::poll_fn(|cx| match reactor.try_lead_or_wait(cx.waker()) {
        Some(lead) => Poll::Ready(lead),
        None => Poll::Pending,
    })
    .await;
    let mut spin = Spin::default();
    let mut fds = Vec::new();
    let mut members = Vec::new();
    loop {
        let round = step(&weak, &holds, |engine| {
            let round = lead_round(engine, &holds, &reactor, &mut spin, &mut fds);
            if let Round::Park(_) = round {
                epoll.get_ref().sync(&mut members, &fds);
            }
            round
        });
        match round {
            Stepped::Closed => return,
            // The engine's last handle is closing it: it waits for the
            // internal steps, so none is taken until it has done so.
            Stepped::Closing | Stepped::Ran(Round::Yield) => tokio::task::yield_now().await,
            Stepped::Ran(Round::Again) => {}
            Stepped::Ran(Round::Park(timeout)) => {
                tracing::trace!(fds = fds.len(), ?timeout, "park (async)");
                let alive = wait_readable(&epoll, timeout).await;
                match step(&weak, &holds, |engine| reactor.park_end(engine)) {
                    Stepped::Ran(()) => {}
                    Stepped::Closing | Stepped::Closed => reactor.unpark(),
                }
                if !alive {
                    tracing::debug!("the runtime's I/O driver is gone: the engine's task ends");
                    return;
                }
            }
        }
    }
}

/// One round of the task's lead, inside a step: progress, then spin or
/// park. A park's fds are in `fds` (the reactor's `park_begin`).
fn lead_round(
    engine: &Engine,
    holds: &InternalHolds,
    reactor: &Reactor,
    spin: &mut Spin,
    fds: &mut Vec<RawFd>,
) -> Round {
    // (Progress that handled something tells the followers.)
    let handled = Parkable::progress(engine);
    // What changes after this (another thread's progress, a wake) keeps
    // the park from happening.
    let looked = reactor.changes();
    // The task's `done` (a thread's wait looks at its own here): the last
    // handle closing the engine. Its nudge before `looked` wrote no
    // eventfd (nobody was parked), and its close may take the write guard
    // as soon as this step ends, with no nudge after: a park now would
    // never be woken (seen in CI: a task outlived its engine). Looked at
    // after `looked`: a close set later nudges a park this round makes.
    if holds.closing.load(Ordering::SeqCst) {
        return Round::Yield;
    }
    match spin.next(handled, || engine.polls()) {
        Next::Park { polls: false } => {
            let now = engine.now();
            match reactor.park_begin(engine, None, now, false, looked, 0, fds) {
                None => Round::Again,
                Some(until) => Round::Park(until.map(|u| u.saturating_duration_since(now))),
            }
        }
        // The spin, and work only polling sees: look again once the tasks
        // waiting on this worker have run.
        Next::Spin | Next::Yield | Next::Park { polls: true } => Round::Yield,
    }
}

/// What a round of the task's lead asks for next.
#[derive(Debug)]
enum Round {
    /// Work came as it was about to park: a round at once.
    Again,
    /// A round after the worker's other tasks.
    Yield,
    /// Park at most this long (`None`: until a fd is readable).
    Park(Option<Duration>),
}

/// A step under the engine, or why none ran.
enum Stepped<T> {
    Ran(T),
    /// The last handle is closing the engine: ask again after a yield.
    Closing,
    /// The engine is gone.
    Closed,
}

/// Runs `f` on the engine, within its `InternalHolds`, as the engine's
/// own thread does: the engine is held for this step only, and this thread
/// counts as internal while it runs (the step's handle, dropped here,
/// never waits for the internal steps, this one among them).
fn step<T>(weak: &Weak<Shared>, holds: &InternalHolds, f: impl FnOnce(&Engine) -> T) -> Stepped<T> {
    if holds.closing.load(Ordering::SeqCst) {
        return Stepped::Closing;
    }
    /// Puts the thread's mark back, however the step ends.
    struct Internal(bool);
    impl Drop for Internal {
        fn drop(&mut self) {
            let was = self.0;
            INTERNAL_THREAD.with(|i| i.set(was));
        }
    }
    let _internal = Internal(INTERNAL_THREAD.with(|i| i.replace(true)));
    match holds.step(weak, f) {
        Some(out) => Stepped::Ran(out),
        None => Stepped::Closed,
    }
}

/// Waits until one of the epoll set's fds is readable, at most `timeout`
/// (`None`: no bound). `false` if the runtime's I/O driver is gone.
async fn wait_readable(epoll: &AsyncFd<Epoll>, timeout: Option<Duration>) -> bool {
    let ready = async {
        loop {
            let Ok(mut guard) = epoll.readable().await else {
                return false;
            };
            // tokio's readiness is an edge, maybe from before the members
            // were drained: asked again here; `try_io` clears it when
            // nothing is readable (and a readiness that came meanwhile
            // survives, by tokio's tick).
            if guard.try_io(|epoll| epoll.get_ref().any_ready()).is_ok() {
                return true;
            }
        }
    };
    match timeout {
        None => ready.await,
        Some(timeout) => tokio::time::timeout(timeout, ready).await.unwrap_or(true),
    }
}

/// Counts the polls of the task ([`AsyncDriver::polls`]).
struct CountPolls<F> {
    inner: Pin<Box<F>>,
    polls: Arc<AtomicU64>,
}

impl<F: Future<Output = ()>> Future for CountPolls<F> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.polls.fetch_add(1, Ordering::Relaxed);
        self.inner.as_mut().poll(cx)
    }
}

/// An epoll set of the park's fds: the one fd the task awaits.
///
/// Its members are level-triggered (`EPOLLIN`): a member readable before
/// it was added, or still readable after a wait, keeps the set readable,
/// so no readiness is lost between parks; the set itself is registered
/// with tokio (edge-triggered there), and [`wait_readable`] asks the set
/// again before it trusts an edge.
#[derive(Debug)]
struct Epoll {
    fd: OwnedFd,
}

impl AsRawFd for Epoll {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Epoll {
    fn new() -> std::io::Result<Self> {
        // SAFETY: epoll_create1 takes no pointer; the flag is valid.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened by epoll_create1 and is owned by no
        // one else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self { fd })
    }

    /// Makes the set's members `want` (`members`: what the last call
    /// made them). Each fd of `want` is added every time, `EEXIST` meaning
    /// it already is: the set is keyed by the fd's open file, not its
    /// number, and a closed fd leaves the set by itself (the engine's fds
    /// are its own, never duplicated), so a number that was closed and
    /// reused for a new fd of the engine's since the last park is not in
    /// the set, although the number is in `members`: adding it again is
    /// what registers the new file. Numbers no longer wanted are deleted
    /// (`ENOENT` or `EBADF`: closed meanwhile, already gone; a number
    /// reused by a file that is not the engine's was never added).
    fn sync(&self, members: &mut Vec<RawFd>, want: &[RawFd]) {
        for &fd in want {
            let mut event = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: fd as u64,
            };
            // SAFETY: `event` is a live epoll_event for the call; the set
            // is our open epoll fd; `fd` is an fd number (a closed one
            // fails with EBADF, which is reported, not undefined).
            let rc = unsafe {
                libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event)
            };
            if rc < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EEXIST) {
                    tracing::debug!(fd, error = %e, "adding an fd to the driver's epoll set");
                }
            }
        }
        for &fd in members.iter().filter(|fd| !want.contains(fd)) {
            // SAFETY: DEL ignores the event pointer (null is allowed since
            // Linux 2.6.9); the set is our open epoll fd.
            let rc = unsafe {
                libc::epoll_ctl(
                    self.fd.as_raw_fd(),
                    libc::EPOLL_CTL_DEL,
                    fd,
                    std::ptr::null_mut(),
                )
            };
            if rc < 0 {
                tracing::trace!(
                    fd,
                    error = %std::io::Error::last_os_error(),
                    "deleting an fd from the driver's epoll set"
                );
            }
        }
        members.clear();
        members.extend_from_slice(want);
    }

    /// `Ok` if a member is readable now (or the set cannot say: the caller
    /// looks at everything again), `WouldBlock` if none is.
    fn any_ready(&self) -> std::io::Result<()> {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 8];
        // SAFETY: `events` is a live, writable array of 8 epoll_event for
        // the call; a zero timeout never blocks.
        let n = unsafe { libc::epoll_wait(self.fd.as_raw_fd(), events.as_mut_ptr(), 8, 0) };
        if n == 0 {
            Err(std::io::ErrorKind::WouldBlock.into())
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use gdr_sim::{NodeConfig, SimFabric};

    use super::*;
    use crate::engine::EngineConfig;

    /// More rounds than an idle engine's spin takes to park.
    const ROUNDS: usize = 100_000;

    /// A round of the task's lead that began before the last handle's drop
    /// set `closing` and nudged (the step's entry saw neither; the nudge
    /// wrote no eventfd, nobody being parked) never parks: the drop may
    /// close the engine as soon as the step ends, with no nudge after, and
    /// nothing would wake the park (a task outlived its engine in CI).
    #[test]
    fn a_round_never_parks_once_the_last_handle_is_closing() {
        let fabric = SimFabric::new();
        let node = fabric.add_node("a", NodeConfig::default());
        let engine = Engine::new(&node.erased(), None, EngineConfig::default()).unwrap();
        let (holds, reactor) = (&engine.shared.holds, &engine.shared.reactor);
        let mut fds = Vec::new();
        let mut round = |spin: &mut Spin| lead_round(&engine, holds, reactor, spin, &mut fds);
        // An idle engine's rounds spin, then park.
        let mut spin = Spin::default();
        let parked = (0..ROUNDS).find(|_| matches!(round(&mut spin), Round::Park(_)));
        assert!(parked.is_some(), "an idle engine's round never parked");
        reactor.unpark();
        // The drop's first moves, while the step is under way.
        holds.closing.store(true, Ordering::SeqCst);
        reactor.nudge();
        let mut spin = Spin::default();
        for i in 0..ROUNDS {
            let r = round(&mut spin);
            assert!(
                !matches!(r, Round::Park(_)),
                "round {i} parked while the engine closes: nothing would wake it"
            );
        }
        holds.closing.store(false, Ordering::SeqCst);
    }
}
