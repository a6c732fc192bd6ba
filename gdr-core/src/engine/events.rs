//! The CUDA events the engine's progress records, made when the engine
//! starts and recycled, so progress does not create (or destroy) one per
//! copy.
//!
//! Why: on the real driver `cuMemFree`, `cuMemFreeHost` and
//! `cuMemHostUnregister` wait for every stream of the context to drain, a
//! stream held by a stream fence (`cuStreamWaitValue32` on the engine's
//! word) included, and while one waits, other threads' `cuEventCreate`,
//! `cuMemAlloc`, async copies and `cuEventRecord` block on a driver lock
//! (measured on an H100, driver 580, `tests/gpu-probes/lock_probe.cu`;
//! queries, stream memory operations and the GPUDirect flush do not).
//! Creating events in progress was the first call that hung two engines'
//! GPU tests in one process. The copies and records themselves are made
//! by the engine's CUDA worker ([`super::cuda_worker`]), which takes its
//! events from these pools too.
//!
//! A [`PooledEvent`] goes back to its GPU's pool when dropped, whether its
//! copy ended, failed or was abandoned (re-recording an event resets it).
//! A pool that runs dry makes one more event: the bound below which
//! progress makes none is [`EventPools::new`]'s count per GPU.

use std::collections::HashMap;
use std::sync::Arc;

use hal_cuda::Context as _;

use crate::ladder::Gpu;
use crate::sync::{Mutex, lock};

/// Events kept per GPU at most; more than that in flight at once are
/// destroyed when they come back.
const KEPT_PER_GPU: usize = 4096;

/// One GPU's free events.
struct Pool {
    free: Mutex<Vec<hal_cuda::dynamic::DynEvent>>,
}

/// The engine's events, per GPU ordinal.
pub(crate) struct EventPools {
    pools: HashMap<u32, Arc<Pool>>,
}

impl EventPools {
    /// Pools for `gpus`, each filled with `per_gpu` events now (as many as
    /// the driver makes: a GPU that makes none gets them on demand).
    pub(crate) fn new<'g>(gpus: impl IntoIterator<Item = &'g Gpu>, per_gpu: usize) -> Self {
        let pools = gpus
            .into_iter()
            .map(|gpu| {
                let free = (0..per_gpu)
                    .map_while(|_| gpu.context.create_event().ok())
                    .collect();
                (
                    gpu.attributes.ordinal,
                    Arc::new(Pool {
                        free: Mutex::new(free),
                    }),
                )
            })
            .collect();
        Self { pools }
    }

    /// An event of `gpu`'s context: a free one, else a new one.
    pub(crate) fn take(&self, gpu: &Gpu) -> Result<PooledEvent, hal_cuda::CudaError> {
        let pool = self.pools.get(&gpu.attributes.ordinal);
        let event = match pool.and_then(|p| lock(&p.free).pop()) {
            Some(event) => event,
            None => gpu.context.create_event()?,
        };
        Ok(PooledEvent {
            event: Some(event),
            pool: pool.cloned(),
        })
    }
}

/// An event lent by a GPU's pool; goes back to it when dropped.
pub(crate) struct PooledEvent {
    /// `None` only while dropping.
    event: Option<hal_cuda::dynamic::DynEvent>,
    /// `None`: a GPU without a pool (the event is destroyed on drop).
    pool: Option<Arc<Pool>>,
}

impl std::ops::Deref for PooledEvent {
    type Target = hal_cuda::dynamic::DynEvent;

    fn deref(&self) -> &hal_cuda::dynamic::DynEvent {
        // Taken only by `drop`.
        self.event
            .as_ref()
            .unwrap_or_else(|| unreachable!("a pooled event in use is not dropped"))
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        let (Some(event), Some(pool)) = (self.event.take(), self.pool.as_ref()) else {
            return;
        };
        let spare = {
            let mut free = lock(&pool.free);
            if free.len() < KEPT_PER_GPU {
                free.push(event);
                None
            } else {
                Some(event)
            }
        };
        // Destroyed (a driver call) outside the pool's lock.
        drop(spare);
    }
}
