//! The engine's CUDA worker: one thread per engine that makes the driver
//! calls progress needs and that may block (the staging and landing
//! copies with the events recorded after them, the landing slots' making).
//! Progress hands each over as a job and polls its result; it never waits
//! on the driver itself.
//!
//! Why: on the real driver (measured on an H100, driver 580,
//! `tests/gpu-probes/lock_probe.cu`) `cuMemFree`, `cuMemFreeHost` and
//! `cuMemHostUnregister` wait for every stream of the process holding a
//! driver lock, and other threads' async copies, `cuEventRecord`, event
//! and stream creation and allocations wait for that lock meanwhile. A
//! stream a stream fence holds is released by progress alone
//! ([`super::fence`]): were progress blocked in such a call, a free of any
//! thread would wait for the fenced stream, the stream for progress, and
//! progress for the free. With the calls on this thread, progress goes on
//! releasing fences and polling completions while the worker waits, and
//! the free ends once the fenced batch has.
//!
//! A job runs once, in the order queued (the copies of one stream keep
//! their order). The thread starts at the first job and ends with the
//! engine: the engine's drop shuts it ([`CudaWorker::shut`]) before its
//! state goes, so every queued job has run (its copy queued on its stream)
//! before the memory it names can be freed, and those frees wait for the
//! copies as for any.

use std::sync::mpsc;
use std::sync::{Arc, OnceLock, Weak};
use std::thread::JoinHandle;

use super::resources::Resources;
use crate::sync::{Mutex, lock};

/// A job: run on the worker with the engine's resources.
type Job = Box<dyn FnOnce(&Resources) + Send>;

/// The worker of one engine's resources.
pub(crate) struct CudaWorker {
    /// The resources the jobs run with (the worker is one of their
    /// fields: weak, so the thread never keeps them).
    res: Weak<Resources>,
    state: Mutex<WorkerState>,
}

enum WorkerState {
    /// No job yet.
    Idle,
    Running(Running),
    /// The engine is going (or the OS made no thread): jobs run inline.
    Shut,
}

struct Running {
    jobs: mpsc::Sender<Job>,
    thread: JoinHandle<()>,
}

/// A job's result, once it has run.
pub(crate) struct Pending<T>(Arc<OnceLock<T>>);

impl<T> Pending<T> {
    /// The result, once the job has run.
    pub(crate) fn get(&self) -> Option<&T> {
        self.0.get()
    }
}

impl CudaWorker {
    /// The worker of the resources `res` will point to.
    pub(crate) fn new(res: Weak<Resources>) -> Self {
        Self {
            res,
            state: Mutex::new(WorkerState::Idle),
        }
    }

    /// Queues `job`; its result comes in the returned [`Pending`]. Where
    /// the thread cannot run (the OS made none, or the engine is going),
    /// the job runs here, on the caller's thread, as before the worker.
    pub(crate) fn run<T: Send + Sync + 'static>(
        &self,
        res: &Resources,
        job: impl FnOnce(&Resources) -> T + Send + 'static,
    ) -> Pending<T> {
        let result = Arc::new(OnceLock::new());
        let sink = Arc::clone(&result);
        let boxed: Job = Box::new(move |res| {
            let _ = sink.set(job(res));
        });
        if let Err(boxed) = self.queue(boxed) {
            boxed(res);
        }
        Pending(result)
    }

    /// Hands `job` to the thread (started at the first job); gives it back
    /// where there is no thread.
    fn queue(&self, job: Job) -> Result<(), Job> {
        let mut state = lock(&self.state);
        if matches!(*state, WorkerState::Idle) {
            *state = match self.start() {
                Some(running) => WorkerState::Running(running),
                None => WorkerState::Shut,
            };
        }
        match &*state {
            WorkerState::Running(r) => r.jobs.send(job).map_err(|mpsc::SendError(job)| job),
            _ => Err(job),
        }
    }

    fn start(&self) -> Option<Running> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let res = self.res.clone();
        let thread = std::thread::Builder::new()
            .name("gdr-cuda".into())
            .spawn(move || {
                while let Ok(job) = queue.recv() {
                    // The engine's drop drains the queue before its
                    // resources go: upgrading fails only after that.
                    let Some(res) = res.upgrade() else {
                        return;
                    };
                    job(&res);
                }
            });
        match thread {
            Ok(thread) => Some(Running { jobs, thread }),
            Err(e) => {
                tracing::warn!(error = %e, "no CUDA worker thread: progress makes its driver calls");
                None
            }
        }
    }

    /// Ends the thread once every queued job has run. Called by the
    /// engine's drop, before its state (the memory the jobs name) goes.
    pub(crate) fn shut(&self) {
        let state = std::mem::replace(&mut *lock(&self.state), WorkerState::Shut);
        if let WorkerState::Running(Running { jobs, thread }) = state {
            drop(jobs);
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}
