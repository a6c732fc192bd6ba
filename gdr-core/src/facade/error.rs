//! The facade's one error: every layer's typed error kept whole (its
//! native code and context), plus what only the facade can get wrong (an
//! object of one context used with another, an index past the devices, a
//! buffer still in use).

use hal_cuda::CudaError;
use hal_verbs::VerbsError;

use crate::backend::BackendError;
use crate::buffer::BufferAccessError;
use crate::engine::EngineError;
use crate::ladder::LadderError;
use crate::uri::UriError;

/// What a facade call can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No backends could be chosen ([`Context::open`](super::Context::open)).
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// An engine call failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A verbs call failed.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// A CUDA call failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// Registering memory failed.
    #[error(transparent)]
    Ladder(#[from] LadderError),
    /// A `gdr://` URI is malformed or does not fit.
    #[error(transparent)]
    Uri(#[from] UriError),
    /// The CPU cannot touch the buffer's memory that way.
    #[error(transparent)]
    BufferAccess(#[from] BufferAccessError),
    /// An object made in one context (of other backends, or another
    /// engine's) was given to another.
    #[error("the {what} belongs to another {owner}")]
    Foreign {
        /// What was given (`buffer`, `region`, `stream`).
        what: &'static str,
        /// Whose it must be (`context`, `engine`).
        owner: &'static str,
    },
    /// No GPU of that index in this context.
    #[error("no GPU {index} ({count} in this context)")]
    NoGpu {
        /// The index asked for.
        index: u32,
        /// How many the context has.
        count: u32,
    },
    /// The call needs a GPU and the context has none.
    #[error("{what} needs a GPU, and this context has none")]
    NeedsGpu {
        /// What needed it.
        what: &'static str,
    },
    /// No NIC of that index in this context.
    #[error("no NIC {index} ({count} in this context)")]
    NoNic {
        /// The index asked for.
        index: u32,
        /// How many the context has.
        count: u32,
    },
    /// The context cannot do this at all.
    #[error(transparent)]
    Unsupported(#[from] Unsupported),
    /// A size that cannot be allocated or moved (zero, or past the address
    /// space).
    #[error("{what}: {size} bytes is not a usable size")]
    BadSize {
        /// Which size.
        what: &'static str,
        /// The size given.
        size: u64,
    },
    /// Memory of that size could not be allocated: the allocator refused it
    /// (out of memory, or past what the process may map). Nothing was
    /// allocated; the process goes on. (Pinned and device memory CUDA
    /// refuses come as [`Error::Cuda`] with [`CudaError::OutOfMemory`],
    /// its native code kept.)
    #[error("{what}: {size} bytes could not be allocated (out of memory)")]
    OutOfMemory {
        /// What was being allocated.
        what: &'static str,
        /// The size asked for.
        size: u64,
    },
    /// A range falls outside the buffer it names.
    #[error("{what}: {len} bytes at offset {offset} exceed the buffer's {size} bytes")]
    OutOfRange {
        /// Which side.
        what: &'static str,
        /// The offset asked for.
        offset: u64,
        /// The length asked for.
        len: u64,
        /// The buffer's size.
        size: u64,
    },
    /// A stream copy's source and destination overlap.
    #[error("the source and destination ranges of a stream copy overlap")]
    Overlap,
    /// A stream copy names device memory of another GPU than the stream's.
    #[error("{what} is memory of GPU {memory}, the stream is on GPU {stream}")]
    WrongGpu {
        /// Which end.
        what: &'static str,
        /// The memory's GPU.
        memory: u32,
        /// The stream's GPU.
        stream: u32,
    },
    /// The process's simulated fabric has no address left for another sim
    /// context (about eight million were made).
    #[error("the process's simulated fabric has no address left for another context")]
    SimFabricFull,
    /// The buffer was released; its handle is spent.
    #[error("the buffer was released")]
    Released,
    /// The buffer cannot be released yet: copies queued on streams still
    /// use it (synchronize their streams first).
    #[error(
        "{copies} copies queued on streams still use the buffer (synchronize or drop their streams first)"
    )]
    StreamCopiesPending {
        /// How many.
        copies: usize,
    },
    /// The buffer cannot be released yet: memory registrations (a region,
    /// a grant, a transfer in flight) still cover it past its release
    /// timeout.
    #[error("memory registrations still cover the buffer (a region, grant or transfer holds them)")]
    StillRegistered,
}

/// What a context cannot do at all, whatever the arguments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unsupported {
    /// CUDA managed memory is never registered or copied by gdr.
    #[error("managed memory is not supported (it is never registered)")]
    ManagedMemory,
    /// Only device memory has a `gdr://` URI (a CUDA IPC handle).
    #[error("only device memory has a gdr:// URI")]
    UriOfHostMemory,
    /// A stream copies to or from GPU memory; host to host is a memcpy.
    #[error("a stream copies to or from GPU memory; host to host is the caller's memcpy")]
    HostToHostStreamCopy,
    /// The NIC has no RoCE v2 address on port 1.
    #[error("{nic} port 1 has no RoCE v2 address")]
    NoRoceAddress {
        /// The NIC.
        nic: String,
    },
}
