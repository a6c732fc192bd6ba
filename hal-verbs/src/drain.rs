//! Draining a queue pair before it is destroyed, on any backend.
//!
//! Destroying a queue pair on ConnectX (mlx5) removes its completions from
//! the CQ, including those of requests still outstanding: their buffers may
//! still be in use by the NIC at that moment, and whoever waits for them
//! waits forever. rxe and the simulation keep them. So a queue pair with
//! outstanding work is torn down in three steps:
//!
//! ```text
//! let completions = hal_verbs::drain::drain::<A>(&qp, &send_cq, &recv_cq, timeout)?;
//! // route `completions` (they may include other QPs' on a shared CQ)
//! drop(qp);  // now nothing of it is outstanding: destroying loses nothing
//! ```
//!
//! [`drain`] posts one marker on each queue, moves the queue pair to ERROR
//! (everything outstanding completes, with its status or `WR_FLUSH_ERR`) and
//! polls the CQs until both markers' completions are seen: a work queue
//! completes in order, so a marker's completion means everything posted
//! before it on that queue has completed, without the caller having to know
//! how many requests were outstanding (it cannot, in general: an unsignaled
//! request that succeeded leaves no completion, while a flushed one does; and
//! after a post that failed with [`crate::Posted::Unknown`] nobody knows).
//! This is what the kernel's `ib_drain_qp` does for kernel consumers.
//!
//! The receive marker is posted *before* the move to ERROR: on rxe (kernel
//! 6.1, measured in the VM) a receive posted to a queue pair already in
//! ERROR is never flushed (librxe posts receives in user space, and nothing
//! runs the responder again), while everything on the queue when it enters
//! ERROR is. Should a peer's SEND consume the marker first, its completion
//! (of any status) still comes after every earlier receive's. Only when the
//! receive queue is full (or the QP is in RESET) is the marker posted after
//! the move. The send marker is posted after the move, as `ib_drain_sq`
//! does (before it, it would go on the wire); rxe flushes that one.
//!
//! The markers use the reserved work request ids [`SEND_MARKER_WR_ID`] and
//! [`RECV_MARKER_WR_ID`] (do not use them for your own requests); their
//! completions are not returned. A send queue that is full when the marker
//! is posted is polled until there is room.
//!
//! Every completion polled on the way is returned, in CQ order, other queue
//! pairs' included (on a shared CQ), so the caller can route them; on
//! failure (timeout, a verb failing) [`DrainError::completions`] holds those
//! polled so far, which must be routed all the same.

use std::time::{Duration, Instant};

use smallvec::smallvec;

use crate::api::{Api, CompletionQueue, QueuePair};
use crate::error::VerbsError;
use crate::types::{Completion, RecvRequest, SendFlags, SendOp, SendRequest};

/// The work request id of the marker posted on the send queue.
pub const SEND_MARKER_WR_ID: u64 = u64::MAX;
/// The work request id of the marker posted on the receive queue.
pub const RECV_MARKER_WR_ID: u64 = u64::MAX - 1;

/// What [`drain_with`] waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainOptions {
    /// Bound on the whole drain (the CQs are polled until then).
    pub timeout: Duration,
    /// Drain the receive queue too (a marker receive is posted): true by
    /// default; false for a queue pair created with no receive queue
    /// (`max_recv_wr` 0), whose receives nobody waits for.
    pub recv: bool,
}

impl DrainOptions {
    /// Both queues, within `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            recv: true,
        }
    }
}

/// A drain that did not finish: why, and the completions polled before,
/// which the caller must route as if the drain had succeeded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("draining QP {qp_num} failed ({} completion(s) polled): {error}", completions.len())]
pub struct DrainError {
    /// The queue pair drained.
    pub qp_num: u32,
    /// Completions polled before the failure (markers left out).
    pub completions: Vec<Completion>,
    /// What failed: [`VerbsError::Timeout`] when a marker's completion did
    /// not come in time (then destroying the queue pair may still lose
    /// completions on ConnectX), or the verb that failed.
    pub error: VerbsError,
}

/// Drains `qp` (both queues) within `timeout`: moves it to ERROR, then polls
/// `send_cq` and `recv_cq` (they may be one CQ, and may be shared with other
/// queue pairs) until everything posted on it has completed. Returns every
/// completion polled, in order, other queue pairs' included. Destroy the
/// queue pair afterwards. See the [module docs](self).
pub fn drain<A: Api>(
    qp: &A::QueuePair,
    send_cq: &A::CompletionQueue,
    recv_cq: &A::CompletionQueue,
    timeout: Duration,
) -> Result<Vec<Completion>, DrainError> {
    drain_with::<A>(qp, send_cq, recv_cq, DrainOptions::new(timeout))
}

/// Where a marker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    /// Not posted yet (or the queue was full).
    Unposted,
    /// Posted; its completion not seen yet.
    Posted,
    /// Its completion was polled (or it is not wanted).
    Seen,
}

/// [`drain`] with options (e.g. a queue pair with no receive queue).
pub fn drain_with<A: Api>(
    qp: &A::QueuePair,
    send_cq: &A::CompletionQueue,
    recv_cq: &A::CompletionQueue,
    options: DrainOptions,
) -> Result<Vec<Completion>, DrainError> {
    let started = Instant::now();
    let qp_num = qp.qp_num();
    let mut completions = Vec::new();
    let fail = |completions: Vec<Completion>, error: VerbsError| DrainError {
        qp_num,
        completions,
        error,
    };
    let recv_marker = RecvRequest {
        wr_id: RECV_MARKER_WR_ID,
        sg_list: smallvec![],
    };
    let mut recv = if options.recv {
        // Before the move to ERROR (see the module docs); any refusal here
        // (a full queue, a QP in RESET) is retried after it.
        // SAFETY: the marker has no SG entry: it names no memory.
        match unsafe { qp.post_recv(std::slice::from_ref(&recv_marker)) } {
            Ok(()) => Marker::Posted,
            Err(e) => {
                tracing::debug!(qp_num, error = %e, "receive marker posted after the move to ERROR");
                Marker::Unposted
            }
        }
    } else {
        Marker::Seen
    };
    if let Err(error) = qp.to_error() {
        return Err(fail(completions, error));
    }
    let mut send = Marker::Unposted;
    let mut buf = [Completion::default(); 32];
    let mut nap = Duration::from_micros(20);
    loop {
        if send == Marker::Unposted {
            // A signaled zero-length WRITE naming no memory, as ib_drain_sq
            // posts: in ERROR it only ever completes as flushed.
            let marker = SendRequest {
                wr_id: SEND_MARKER_WR_ID,
                op: SendOp::Write {
                    remote_addr: 0,
                    rkey: 0,
                },
                sg_list: smallvec![],
                flags: SendFlags::SIGNALED,
            };
            // SAFETY: the marker has no SG entry: it names no memory.
            match unsafe { qp.post_send(std::slice::from_ref(&marker)) } {
                Ok(()) => send = Marker::Posted,
                Err(e) if matches!(e.error, VerbsError::QueueFull { .. }) => {}
                Err(e) => return Err(fail(completions, e.error)),
            }
        }
        if recv == Marker::Unposted {
            // SAFETY: the marker has no SG entry: it names no memory.
            match unsafe { qp.post_recv(std::slice::from_ref(&recv_marker)) } {
                Ok(()) => recv = Marker::Posted,
                Err(e) if matches!(e.error, VerbsError::QueueFull { .. }) => {}
                Err(e) => return Err(fail(completions, e.error)),
            }
        }
        let mut polled = 0;
        for cq in [send_cq, recv_cq] {
            loop {
                let n = match cq.poll(&mut buf) {
                    Ok(n) => n,
                    Err(error) => return Err(fail(completions, error)),
                };
                polled += n;
                for c in &buf[..n] {
                    match (c.qp_num == qp_num, c.wr_id) {
                        (true, SEND_MARKER_WR_ID) if send == Marker::Posted => send = Marker::Seen,
                        (true, RECV_MARKER_WR_ID) if recv == Marker::Posted => recv = Marker::Seen,
                        _ => completions.push(*c),
                    }
                }
                if n < buf.len() {
                    break;
                }
            }
        }
        if send == Marker::Seen && recv == Marker::Seen {
            tracing::debug!(
                qp_num,
                completions = completions.len(),
                took = ?started.elapsed(),
                "drained"
            );
            return Ok(completions);
        }
        let waited = started.elapsed();
        if waited >= options.timeout {
            let detail = format!(
                "send queue marker {send:?}, receive queue marker {recv:?}; \
                 {} completion(s) polled",
                completions.len()
            );
            let error = VerbsError::Timeout {
                operation: "drain",
                waited,
                detail,
            };
            return Err(fail(completions, error));
        }
        if polled == 0 {
            std::thread::sleep(nap.min(options.timeout - waited));
            nap = (nap * 2).min(Duration::from_millis(2));
        } else {
            nap = Duration::from_micros(20);
        }
    }
}
