//! The one error type of the verbs HAL, with kinds a caller can act on.
//!
//! Every backend maps its native failures through the named constructors here
//! ([`VerbsError::from_errno`]), so the same situation reads the same on real
//! hardware, SoftRoCE and the simulation. The native code is always kept.

use std::fmt;

/// Result alias of the verbs HAL.
pub type Result<T, E = VerbsError> = std::result::Result<T, E>;

/// What went wrong in a verbs call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// The native library (libibverbs, librdmacm) could not be loaded or lacks
    /// the entry point; nothing on this machine can do verbs.
    #[error("{library} is unavailable: {reason}")]
    LibraryUnavailable {
        /// The library, e.g. `libibverbs.so.1`.
        library: &'static str,
        /// Why, as the loader or the probe call said.
        reason: String,
    },
    /// The library works but there is no RDMA device (or not the one asked for).
    #[error("no RDMA device: {detail}")]
    NoDevice {
        /// Which device was looked for, or how the list came back.
        detail: String,
    },
    /// The device, driver or backend cannot do this operation at all.
    #[error("{operation} is not supported: {reason}{}", Errno(*errno))]
    NotSupported {
        /// The verb that failed, e.g. `ibv_reg_dmabuf_mr`.
        operation: &'static str,
        /// Why, in words.
        reason: String,
        /// The native errno, where there was one.
        errno: Option<i32>,
    },
    /// A resource limit was hit (memory, MR count, QP count, locked pages).
    #[error("{operation} ran out of resources{}", Errno(*errno))]
    OutOfResources {
        /// The verb that failed.
        operation: &'static str,
        /// The native errno, where there was one.
        errno: Option<i32>,
    },
    /// A work queue has no room; retry after polling completions.
    #[error("{queue} queue of QP {qp_num} is full ({depth} entries)")]
    QueueFull {
        /// `send` or `recv`.
        queue: &'static str,
        /// The queue pair.
        qp_num: u32,
        /// The queue's depth.
        depth: u32,
    },
    /// The caller passed something the verb rejects.
    #[error("{operation}: invalid argument: {reason}{}", Errno(*errno))]
    InvalidArgument {
        /// The verb that failed.
        operation: &'static str,
        /// What was wrong.
        reason: String,
        /// The native errno, where there was one.
        errno: Option<i32>,
    },
    /// The device went away or entered a fatal state; reopen it.
    #[error("device {device} lost during {operation}{}", Errno(*errno))]
    DeviceLost {
        /// The device name.
        device: String,
        /// The verb that failed.
        operation: &'static str,
        /// The native errno, where there was one.
        errno: Option<i32>,
    },
    /// A bounded wait ran out (a connection manager's resolution,
    /// handshake, or retries while the peer was not listening).
    #[error("{operation} timed out after {waited:?}: {detail}")]
    Timeout {
        /// What was waited for, e.g. `rdma_connect`.
        operation: &'static str,
        /// How long it waited.
        waited: std::time::Duration,
        /// The last thing that happened (e.g. the last rejection's reason).
        detail: String,
    },
    /// The peer's application refused the connection (a consumer-defined
    /// reject: a live listener said no; not retried).
    #[error("connection to {peer} rejected by the peer (status {status})")]
    ConnectionRejected {
        /// The peer's address.
        peer: String,
        /// The reject reason (28: consumer defined).
        status: i32,
        /// The private data of the reject.
        private_data: Vec<u8>,
    },
    /// On the simulated fabric, nobody listened at the peer's address (or
    /// no device has it) within the retry window a listener started a
    /// moment later needs. The simulated fabric is this process's own: a
    /// listener of another process is never reached, however long the
    /// connect waits. (Real rdma_cm retries until the connect's timeout:
    /// [`VerbsError::Timeout`].)
    #[error(
        "nobody of this process's simulated fabric listens at {peer} (waited {waited:?}): the \
         simulation does not span processes (a listener of another process is never reached)"
    )]
    NotListeningInSimulation {
        /// The peer's address.
        peer: String,
        /// How long it waited for a listener.
        waited: std::time::Duration,
    },
    /// `ibv_poll_cq` failed. Its negative return is a provider code, not an
    /// errno (libmlx5 answers -1 for a CQ in error, e.g. after an overrun):
    /// the completion queue cannot be trusted any more.
    #[error("{operation} on {device} failed with provider code {code} (not an errno)")]
    CompletionQueue {
        /// The verb that failed (`ibv_poll_cq`).
        operation: &'static str,
        /// The device name.
        device: String,
        /// The provider's (negative) return value.
        code: i32,
    },
    /// An OS error with no more specific kind; the errno is kept.
    #[error("{operation} failed: {}", std::io::Error::from_raw_os_error(*errno))]
    Os {
        /// The verb that failed.
        operation: &'static str,
        /// The native errno.
        errno: i32,
    },
}

/// Formats `Some(errno)` as ` (errno N: text)`, and nothing for `None`.
struct Errno(Option<i32>);

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(code) => {
                // io::Error's text ends in " (os error N)": we name the number once.
                let text = std::io::Error::from_raw_os_error(code).to_string();
                let text = text.split(" (os error").next().unwrap_or(&text);
                write!(f, " (errno {code}: {text})")
            }
            None => Ok(()),
        }
    }
}

impl VerbsError {
    /// Maps an errno returned by a verb to the kind a caller acts on.
    ///
    /// `EOPNOTSUPP`/`ENOSYS`/`EPROTONOSUPPORT` mean the operation does not
    /// exist here; `ENOMEM`/`ENOSPC`/`EMFILE`/`ENFILE` are resource limits
    /// (`ENOMEM` is also what the kernel gives when pinning exceeds
    /// RLIMIT_MEMLOCK); `EINVAL`/`EFAULT`/`ERANGE` are bad arguments; `ENODEV`
    /// and `EIO` mean the device is gone (`ibv_get_async_event` reports
    /// `IBV_EVENT_DEVICE_FATAL` with these).
    pub fn from_errno(operation: &'static str, device: &str, errno: i32) -> Self {
        match errno {
            libc::EOPNOTSUPP | libc::ENOSYS | libc::EPROTONOSUPPORT => Self::NotSupported {
                operation,
                reason: format!("{device} rejected it"),
                errno: Some(errno),
            },
            libc::ENOMEM | libc::ENOSPC | libc::EMFILE | libc::ENFILE | libc::EAGAIN => {
                Self::OutOfResources {
                    operation,
                    errno: Some(errno),
                }
            }
            libc::EINVAL | libc::EFAULT | libc::ERANGE => Self::InvalidArgument {
                operation,
                reason: format!("rejected by {device}"),
                errno: Some(errno),
            },
            libc::ENODEV | libc::EIO => Self::DeviceLost {
                device: device.to_owned(),
                operation,
                errno: Some(errno),
            },
            _ => Self::Os { operation, errno },
        }
    }

    /// Shorthand for [`VerbsError::InvalidArgument`] raised by our own checks.
    pub fn invalid(operation: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            operation,
            reason: reason.into(),
            errno: None,
        }
    }

    /// Shorthand for [`VerbsError::NotSupported`] raised by our own checks.
    pub fn unsupported(operation: &'static str, reason: impl Into<String>) -> Self {
        Self::NotSupported {
            operation,
            reason: reason.into(),
            errno: None,
        }
    }

    /// The native errno behind this error, if one was reported.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::NotSupported { errno, .. }
            | Self::OutOfResources { errno, .. }
            | Self::InvalidArgument { errno, .. }
            | Self::DeviceLost { errno, .. } => *errno,
            Self::Os { errno, .. } => Some(*errno),
            Self::LibraryUnavailable { .. }
            | Self::NoDevice { .. }
            | Self::QueueFull { .. }
            | Self::Timeout { .. }
            | Self::NotListeningInSimulation { .. }
            | Self::CompletionQueue { .. }
            | Self::ConnectionRejected { .. } => None,
        }
    }

    /// True when the same call can never succeed on this machine, so a caller
    /// should fall back (e.g. to another registration rung) rather than retry.
    pub fn is_unsupported(&self) -> bool {
        matches!(
            self,
            Self::LibraryUnavailable { .. } | Self::NoDevice { .. } | Self::NotSupported { .. }
        )
    }
}

/// How much of a batch a failed post took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Posted {
    /// The first `n` work requests of the batch were posted and will
    /// complete; the rest were not posted and never will.
    Prefix(usize),
    /// The provider reported failure with a `bad_wr` that is not one of the
    /// batch's requests, so which of them were posted is unknown. The caller
    /// cannot account for them one by one: move the queue pair to ERROR and
    /// drain it ([`crate::drain`]), which completes every request that was
    /// posted (with its status or `WR_FLUSH_ERR`); a request of the batch
    /// that never completes in the drain was not posted.
    Unknown,
}

impl std::fmt::Display for Posted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Prefix(n) => write!(f, "accepted {n} work request(s)"),
            Self::Unknown => f.write_str(
                "accepted an unknown part of the batch (bad_wr outside it: \
                 move the QP to ERROR and drain it)",
            ),
        }
    }
}

/// A batch post that the queue pair did not take whole.
///
/// [`Posted::Prefix`]: the first `n` work requests of the batch were posted
/// and will complete; the rest were not posted and never will. This is what
/// lets the engine complete every request exactly once. [`Posted::Unknown`]:
/// the provider did not say; drain the queue pair (see [`Posted::Unknown`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("post {posted}, then failed: {error}")]
pub struct PostError {
    /// How much of the batch was posted.
    pub posted: Posted,
    /// Why the next one was refused.
    #[source]
    pub error: VerbsError,
}

impl PostError {
    /// The first `accepted` requests were posted, then `error`.
    pub fn prefix(accepted: usize, error: VerbsError) -> Self {
        Self {
            posted: Posted::Prefix(accepted),
            error,
        }
    }

    /// How many leading requests were posted, when known (`None`:
    /// [`Posted::Unknown`], drain the queue pair).
    pub fn accepted(&self) -> Option<usize> {
        match self.posted {
            Posted::Prefix(n) => Some(n),
            Posted::Unknown => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_maps_to_actionable_kinds_and_is_kept() {
        let e = VerbsError::from_errno("ibv_reg_dmabuf_mr", "rxe0", libc::EOPNOTSUPP);
        assert!(matches!(e, VerbsError::NotSupported { .. }));
        assert!(e.is_unsupported());
        assert_eq!(e.errno(), Some(libc::EOPNOTSUPP));

        let e = VerbsError::from_errno("ibv_reg_mr", "rxe0", libc::ENOMEM);
        assert!(matches!(e, VerbsError::OutOfResources { .. }));
        assert!(!e.is_unsupported());

        let e = VerbsError::from_errno("ibv_post_send", "mlx5_0", libc::EIO);
        assert!(matches!(e, VerbsError::DeviceLost { .. }));

        let e = VerbsError::from_errno("ibv_modify_qp", "mlx5_0", libc::EBUSY);
        assert_eq!(
            e,
            VerbsError::Os {
                operation: "ibv_modify_qp",
                errno: libc::EBUSY
            }
        );
    }

    #[test]
    fn display_names_operation_and_errno() {
        let text = VerbsError::from_errno("ibv_reg_mr", "rxe0", libc::EINVAL).to_string();
        assert!(text.contains("ibv_reg_mr"), "{text}");
        assert!(text.contains(&format!("errno {}", libc::EINVAL)), "{text}");
    }
}
