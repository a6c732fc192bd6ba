//! The transfer engine in the C ABI: engines over a context's NICs and
//! GPUs, regions (registered buffer ranges), listeners and peers, grants
//! and the descriptors a peer receives for them, batches of one-sided
//! READs and WRITEs, and the GPU fence for inbound writes.
//!
//! The C functions call gdr-core's types ([`gdr_core::Engine`] and its
//! kin), which erases the backends once; this module only checks what C
//! hands it and keeps the objects behind their handles.
//!
//! Objects refer to each other by what they hold, as in Rust: a region
//! keeps its registrations (and the engine's NICs) alive, a grant its
//! peer, a batch its regions until the NIC gives them back. Freeing a
//! handle drops the caller's reference only; the object goes when nothing
//! else holds it.
//!
//! Stream-ordered fences, both ways, take a stream of [`crate::stream`]: a
//! stream that waits for a batch ([`gdr_batch_fence_stream`]) and a batch
//! that starts when a stream reaches a point
//! ([`gdr_peer_submit_after_stream`]).

use std::ffi::{c_char, c_void};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use gdr_core::Rung;
use gdr_core::descriptor::{GrantRights, MemoryDescriptor, MemoryLocation};
use gdr_core::{Batch, Engine, Grant, Listener, Peer, Region, Transfer};
use gdr_core::{EngineConfig, Fence, Op, TransferError};

use crate::api::{GdrBuffer, GdrContext, GdrRung};
use crate::boundary::{Out, TextOut, ffi_boundary, text_arg};
use crate::handle::{Kind, Table};
use crate::result::{FfiError, GdrResult};
use crate::stream::GdrStream;

// ---------------------------------------------------------------------------
// The C types.

/// A transfer engine: the NICs and GPUs of a context, its regions and
/// peers.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrEngine {
    /// Opaque; 0 is never a live engine.
    pub id: u64,
}

/// A registered range of a buffer, for transfers and grants.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrRegion {
    /// Opaque; 0 is never a live region.
    pub id: u64,
}

/// An engine listening for peers.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrListener {
    /// Opaque; 0 is never a live listener.
    pub id: u64,
}

/// A connection to another engine.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrPeer {
    /// Opaque; 0 is never a live peer.
    pub id: u64,
}

/// A grant of part of a region to a peer.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrGrant {
    /// Opaque; 0 is never a live grant.
    pub id: u64,
}

/// A peer's grant as this side knows it (a memory descriptor).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrDescriptor {
    /// Opaque; 0 is never a live descriptor.
    pub id: u64,
}

/// A submitted batch of transfers.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrBatch {
    /// Opaque; 0 is never a live batch.
    pub id: u64,
}

crate::handle::c_handles!(
    GdrEngine,
    GdrRegion,
    GdrListener,
    GdrPeer,
    GdrGrant,
    GdrDescriptor,
    GdrBatch,
);

/// Options of [`gdr_engine_new`]; NULL means all defaults, and so does 0
/// in a field.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrEngineOptions {
    /// RC queue pairs per peer (at most 65535); 0: 2.
    pub qps_per_peer: u32,
    /// Bound on a batch submitted without a timeout of its own, in
    /// milliseconds; 0: 30 s.
    pub default_timeout_ms: u32,
}

/// What a peer may do with a grant (the `rights` of [`gdr_peer_grant`]).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdrRights {
    /// RDMA READ from the range.
    Read = 1,
    /// RDMA WRITE into the range.
    Write = 2,
    /// Both.
    ReadWrite = 3,
}

/// The direction of a transfer (the `op` of a [`GdrTransfer`]).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdrOp {
    /// The peer's granted memory into the local region.
    Read = 0,
    /// The local region into the peer's granted memory.
    Write = 1,
}

/// One transfer of a batch: `len` bytes between `region` at
/// `local_offset` and the peer's grant `remote` at `remote_offset`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrTransfer {
    /// A `gdr_op`: `GDR_OP_READ` or `GDR_OP_WRITE`.
    pub op: u32,
    /// The local region (of the peer's engine).
    pub region: GdrRegion,
    /// Offset in the region.
    pub local_offset: u64,
    /// The peer's grant.
    pub remote: GdrDescriptor,
    /// Offset in the grant.
    pub remote_offset: u64,
    /// Bytes, never 0.
    pub len: u64,
}

/// What [`gdr_descriptor_get_info`] reports.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrDescriptorInfo {
    /// The granting engine's id.
    pub owner: u64,
    /// The grant's id on that engine (what [`gdr_peer_wait_grant`] takes).
    pub grant: u64,
    /// Bytes granted.
    pub len: u64,
    /// A `gdr_rights`.
    pub rights: u32,
    /// The owner's GPU for GPU memory, else -1.
    pub device: i32,
}

// ---------------------------------------------------------------------------
// The objects behind the handles.

struct ListenerObject {
    addr: SocketAddr,
    /// Accepts run at once, each waiting on its own (no lock across the
    /// wait: a second caller is not held for the first one's timeout).
    listener: Listener,
}

// Engines, regions and peers are gdr-core's own: it refuses an object of
// another context (`gdr_core::Error::Foreign`) or engine
// (`gdr_core::Refusal::ForeignRegion`) itself.
static ENGINES: Table<Engine> = Table::new(Kind::Engine);
static REGIONS: Table<Region> = Table::new(Kind::Region);
static LISTENERS: Table<ListenerObject> = Table::new(Kind::Listener);
static PEERS: Table<Peer> = Table::new(Kind::Peer);
static GRANTS: Table<Grant> = Table::new(Kind::Grant);
static DESCRIPTORS: Table<MemoryDescriptor> = Table::new(Kind::Descriptor);
static BATCHES: Table<Batch> = Table::new(Kind::Batch);

/// A timeout in milliseconds.
fn millis(ms: u32) -> Duration {
    Duration::from_millis(u64::from(ms))
}

/// An `ip:port` argument.
///
/// # Safety
/// As for [`text_arg`].
unsafe fn addr_arg(name: &str, ptr: *const c_char) -> Result<SocketAddr, FfiError> {
    // SAFETY: the caller's contract.
    let text = unsafe { text_arg(name, ptr) }?;
    text.parse()
        .map_err(|e| FfiError::invalid(name, format!("{text:?} is not ip:port ({e})")))
}

/// Writes bytes into a caller's buffer: all or (with
/// `GDR_RESULT_BUFFER_TOO_SMALL`) none; `needed` gets the length either
/// way.
///
/// # Safety
/// `buf` valid for `len` bytes of writes (NULL only with `len` 0); `needed`
/// NULL or valid for a write.
unsafe fn write_bytes(
    bytes: &[u8],
    buf: *mut u8,
    len: usize,
    needed: *mut usize,
) -> Result<(), FfiError> {
    if buf.is_null() && len != 0 {
        return Err(FfiError::invalid("buf", format!("NULL with length {len}")));
    }
    if !needed.is_null() {
        // SAFETY: the caller's contract; checked for alignment.
        unsafe { Out::new("needed", needed)?.write(bytes.len()) };
    }
    if bytes.len() > len {
        return Err(FfiError::new(
            GdrResult::BufferTooSmall,
            format!("{} bytes needed, {len} given", bytes.len()),
        ));
    }
    // SAFETY: `buf` holds `len` >= `bytes.len()` writable bytes (the
    // caller's contract) and does not overlap a Rust allocation.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
    Ok(())
}

// ---------------------------------------------------------------------------
// Buffers: copies for set-up and checks.

/// Copies `len` bytes from `src` into `buffer` at `offset`, synchronously:
/// a CPU copy for host memory, a copy on a stream of the buffer's GPU
/// (waited for) for device memory. For setting up and checking data, not
/// for speed; order it against transfers on the range yourself. Any
/// thread.
///
/// # Safety
/// `src` must be valid for reads of `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_buffer_copy_in(
    buffer: GdrBuffer,
    offset: u64,
    src: *const c_void,
    len: usize,
) -> GdrResult {
    ffi_boundary! {
        caller_range("src", src.is_null(), len)?;
        let object = crate::api::buffer(buffer)?;
        // SAFETY: `src` is valid for reads of `len` bytes (the caller's
        // contract), not NULL (checked).
        let data = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), len) };
        Ok(object.buffer.copy_from_host(offset, data)?)
    }
}

/// Checks the caller's side of a copy: memory at a non-NULL `name`, a
/// length neither 0 nor beyond what one object may span.
fn caller_range(name: &str, null: bool, len: usize) -> Result<(), FfiError> {
    if null {
        return Err(FfiError::invalid(name, "NULL"));
    }
    if len == 0 || isize::try_from(len).is_err() {
        return Err(FfiError::invalid("len", format!("{len}")));
    }
    Ok(())
}

/// Copies `len` bytes of `buffer` at `offset` to `dst`, synchronously (see
/// [`gdr_buffer_copy_in`]). Any thread.
///
/// # Safety
/// `dst` must be valid for writes of `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_buffer_copy_out(
    buffer: GdrBuffer,
    offset: u64,
    dst: *mut c_void,
    len: usize,
) -> GdrResult {
    ffi_boundary! {
        caller_range("dst", dst.is_null(), len)?;
        let object = crate::api::buffer(buffer)?;
        // SAFETY: `dst` is valid for writes of `len` bytes (the caller's
        // contract), not NULL (checked), and not the buffer's own memory
        // as a Rust reference (the buffer copies through raw pointers).
        let out = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), len) };
        Ok(object.buffer.copy_to_host(offset, out)?)
    }
}

// ---------------------------------------------------------------------------
// Engines and regions.

/// Creates a transfer engine over every NIC of `context` and the GPUs
/// those NICs reach, with `options` (NULL: defaults), and writes its
/// handle to `out`. Every simulated context of a process is a node of one
/// simulated fabric, so engines of two sim contexts connect to each other
/// (see [`gdr_engine_nic_address`]). Any thread; an engine's functions may
/// be called from any thread, concurrently.
///
/// # Safety
/// `options` NULL or valid for a read; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_engine_new(
    context: GdrContext,
    options: *const GdrEngineOptions,
    out: *mut GdrEngine,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        let mut config = EngineConfig::default();
        if !options.is_null() {
            if !options.is_aligned() {
                return Err(FfiError::invalid("options", "misaligned"));
            }
            // SAFETY: not NULL, aligned, valid by the caller's contract;
            // plain integers.
            let options = unsafe { options.read() };
            if options.qps_per_peer != 0 {
                config.qps_per_peer = u16::try_from(options.qps_per_peer).map_err(|_| {
                    FfiError::invalid("options.qps_per_peer", format!("{} > 65535", options.qps_per_peer))
                })?;
            }
            if options.default_timeout_ms != 0 {
                config.default_timeout = millis(options.default_timeout_ms);
            }
        }
        let owner = crate::api::context(context)?;
        let engine = owner.context.engine(config)?;
        // SAFETY: `out` checked by Out::new; valid by the caller's contract.
        unsafe { ENGINES.publish(Arc::new(engine), out) }
    }
}

/// Frees the engine's handle. The engine itself goes once its regions,
/// listeners, peers, grants and batches are freed (each holds it). Any
/// thread; the handle is invalid afterwards.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_engine_free(engine: GdrEngine) -> GdrResult {
    ffi_boundary! {
        ENGINES.remove(engine.id)?;
        Ok(())
    }
}

/// Writes the number of NICs the engine uses (NIC indices run from 0).
/// Any thread.
///
/// # Safety
/// `count` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_engine_nic_count(engine: GdrEngine, count: *mut u32) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("count", count)?;
        let n = ENGINES.get(engine.id)?.nics().len() as u32;
        // SAFETY: checked; valid by the caller's contract.
        unsafe { out.write(n) };
        Ok(())
    }
}

/// Writes the IP address peers reach the engine's NIC `nic` at (its RoCE
/// v2 address), as text, e.g. `10.128.0.1`: listen on it (with a port)
/// and connect to it. See [`crate::api::gdr_last_error_message`] for
/// `buf`, `len` and `needed`. Any thread.
///
/// # Safety
/// `buf` valid for `len` bytes of writes; `needed` NULL or valid for a
/// write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_engine_nic_address(
    engine: GdrEngine,
    nic: u32,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> GdrResult {
    ffi_boundary! {
        let out = TextOut::new(buf, len, needed)?;
        let object = ENGINES.get(engine.id)?;
        let nics = object.nics();
        let name = nics.get(nic as usize).ok_or_else(|| {
            FfiError::new(GdrResult::NoDevice, format!("no NIC {nic} ({} in the engine)", nics.len()))
        })?;
        let ip = object.nic_address(name)?;
        // SAFETY: the caller's contract.
        unsafe { out.write(&ip.to_string()) }
    }
}

/// Registers `len` bytes at `offset` of `buffer` (a buffer of the
/// engine's context) on every NIC of the engine, each on the first rung
/// of the registration ladder that works there ([`gdr_region_rungs`]),
/// and writes the region's handle to `out`. The buffer cannot be freed
/// (`GDR_RESULT_BUSY`) while regions, grants or transfers use it. Any
/// thread.
///
/// # Safety
/// `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_region_register(
    engine: GdrEngine,
    buffer: GdrBuffer,
    offset: u64,
    len: u64,
    out: *mut GdrRegion,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        let owner = ENGINES.get(engine.id)?;
        let memory = crate::api::buffer(buffer)?;
        let region = owner.register_range(&memory.buffer, offset, len)?;
        // SAFETY: `out` checked by Out::new; valid by the caller's contract.
        unsafe { REGIONS.publish(Arc::new(region), out) }
    }
}

/// Frees the region's handle; its registrations go once no grant or
/// batch holds them. Any thread; the handle is invalid afterwards.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_region_free(region: GdrRegion) -> GdrResult {
    ffi_boundary! {
        REGIONS.remove(region.id)?;
        Ok(())
    }
}

/// Writes the rung the region took on each NIC of its engine, in NIC
/// order, into `rungs` (room for `len`; NULL with `len` 0 to ask), and the
/// number of NICs to `count` (may be NULL). `GDR_RESULT_BUFFER_TOO_SMALL`
/// (nothing written to `rungs`) when `len` is short. Any thread.
///
/// # Safety
/// `rungs` valid for `len` writes; `count` NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_region_rungs(
    region: GdrRegion,
    rungs: *mut GdrRung,
    len: usize,
    count: *mut usize,
) -> GdrResult {
    ffi_boundary! {
        if rungs.is_null() && len != 0 {
            return Err(FfiError::invalid("rungs", format!("NULL with length {len}")));
        }
        if !rungs.is_null() && !rungs.is_aligned() {
            return Err(FfiError::invalid("rungs", "misaligned"));
        }
        let count = (!count.is_null()).then(|| Out::new("count", count)).transpose()?;
        let taken = REGIONS.get(region.id)?.rungs();
        if let Some(count) = count {
            // SAFETY: checked; valid by the caller's contract.
            unsafe { count.write(taken.len()) };
        }
        if taken.len() > len {
            return Err(FfiError::new(
                GdrResult::BufferTooSmall,
                format!("{} NICs, room for {len}", taken.len()),
            ));
        }
        for (i, rung) in taken.into_iter().enumerate() {
            let value = match rung {
                Rung::HostMemory => GdrRung::Host,
                Rung::Dmabuf => GdrRung::Dmabuf,
                Rung::Peermem => GdrRung::Peermem,
                Rung::Staging => GdrRung::Staging,
            };
            // SAFETY: `rungs` holds `len` > i aligned elements (the
            // caller's contract; checked above).
            unsafe { rungs.add(i).write(value) };
        }
        Ok(())
    }
}

/// The GPU fence for data a peer WROTE into `region` (a region of
/// `engine`): call it once the peer says its WRITE batch completed;
/// kernels launched afterwards see the data. Flushes only where the GPU
/// needs it; host memory needs nothing. `flushed` (may be NULL) says
/// whether a flush was made. Any thread.
///
/// # Safety
/// `flushed` NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_engine_fence_inbound_writes(
    engine: GdrEngine,
    region: GdrRegion,
    flushed: *mut bool,
) -> GdrResult {
    ffi_boundary! {
        let out = (!flushed.is_null()).then(|| Out::new("flushed", flushed)).transpose()?;
        let owner = ENGINES.get(engine.id)?;
        let region = REGIONS.get(region.id)?;
        let did = owner.fence_inbound_writes(&region)? == Fence::Flushed;
        if let Some(out) = out {
            // SAFETY: checked; valid by the caller's contract.
            unsafe { out.write(did) };
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Listening and connecting.

/// Listens for peers on `addr`, `"ip:port"` (port 0: one is assigned; see
/// [`gdr_listener_local_addr`]); the IP is one of the engine's NICs'
/// ([`gdr_engine_nic_address`]) or `0.0.0.0` for all. Connect requests
/// are answered by a thread of the engine; [`gdr_listener_accept`] hands
/// out the peers. Any thread.
///
/// # Safety
/// `addr` a NUL-terminated string; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_engine_listen(
    engine: GdrEngine,
    addr: *const c_char,
    out: *mut GdrListener,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        // SAFETY: the caller's contract.
        let addr = unsafe { addr_arg("addr", addr) }?;
        let owner = ENGINES.get(engine.id)?;
        let listener = owner.listen(addr)?;
        let object = ListenerObject {
            addr: listener.local_addr(),
            listener,
        };
        // SAFETY: `out` checked by Out::new; valid by the caller's contract.
        unsafe { LISTENERS.publish(Arc::new(object), out) }
    }
}

/// Writes the address the listener is bound to, `"ip:port"` (see
/// [`crate::api::gdr_last_error_message`] for `buf`, `len`, `needed`).
/// Any thread, also while another accepts.
///
/// # Safety
/// As for [`crate::api::gdr_last_error_message`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_listener_local_addr(
    listener: GdrListener,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> GdrResult {
    ffi_boundary! {
        let out = TextOut::new(buf, len, needed)?;
        let addr = LISTENERS.get(listener.id)?.addr;
        // SAFETY: the caller's contract.
        unsafe { out.write(&addr.to_string()) }
    }
}

/// Waits up to `timeout_ms` for a peer to connect and writes its handle to
/// `out`; `GDR_RESULT_TIMEOUT` if none did. The connection's handshake
/// finishes here: a peer's [`gdr_engine_connect`] completes only while
/// this side accepts (call it on another thread, or in another process).
/// Any thread; concurrent accepts on one listener each wait on their own,
/// and a peer goes to one of them.
///
/// # Safety
/// `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_listener_accept(
    listener: GdrListener,
    timeout_ms: u32,
    out: *mut GdrPeer,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        let object = LISTENERS.get(listener.id)?;
        let peer = object.listener.accept(millis(timeout_ms))?;
        // SAFETY: `out` checked by Out::new; valid by the caller's contract.
        unsafe { PEERS.publish(Arc::new(peer), out) }
    }
}

/// Frees the listener: new peers are refused; peers accepted stay. Any
/// thread; the handle is invalid afterwards (an accept running meanwhile
/// finishes first).
#[unsafe(no_mangle)]
pub extern "C" fn gdr_listener_free(listener: GdrListener) -> GdrResult {
    ffi_boundary! {
        LISTENERS.remove(listener.id)?;
        Ok(())
    }
}

/// Connects to the engine listening at `addr` (`"ip:port"`), waiting at
/// most `timeout_ms`, and writes the peer's handle to `out`. The other
/// side must be in [`gdr_listener_accept`] meanwhile (another thread or
/// process): the handshake needs both. Any thread.
///
/// # Safety
/// `addr` a NUL-terminated string; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_engine_connect(
    engine: GdrEngine,
    addr: *const c_char,
    timeout_ms: u32,
    out: *mut GdrPeer,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        // SAFETY: the caller's contract.
        let addr = unsafe { addr_arg("addr", addr) }?;
        let owner = ENGINES.get(engine.id)?;
        let peer = owner.connect(addr, millis(timeout_ms))?;
        // SAFETY: `out` checked by Out::new; valid by the caller's contract.
        unsafe { PEERS.publish(Arc::new(peer), out) }
    }
}

/// Closes the connection (transfers in flight on it fail) and frees the
/// handle. Grants to the peer stay valid handles until revoked. Any
/// thread; the handle is invalid afterwards.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_peer_free(peer: GdrPeer) -> GdrResult {
    ffi_boundary! {
        let object = PEERS.remove(peer.id)?;
        // A peer that is gone already needs no closing: not an error here.
        let _ = object.close();
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Grants and descriptors.

/// Grants `len` bytes at `offset` of `region` (a region of the peer's
/// engine) to `peer` with `rights` (a `gdr_rights`): registrations of
/// exactly that range and rights, announced to the peer, which receives
/// it with [`gdr_peer_wait_grant`] (by [`gdr_grant_id`]) or from the
/// descriptor sent some other way. Any thread.
///
/// # Safety
/// `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_peer_grant(
    peer: GdrPeer,
    region: GdrRegion,
    offset: u64,
    len: u64,
    rights: u32,
    out: *mut GdrGrant,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        let rights = match rights {
            1 => GrantRights::Read,
            2 => GrantRights::Write,
            3 => GrantRights::ReadWrite,
            other => return Err(FfiError::invalid("rights", format!("{other} is no gdr_rights"))),
        };
        let peer = PEERS.get(peer.id)?;
        let region = REGIONS.get(region.id)?;
        let grant = peer.grant(&region, offset, len, rights)?;
        // SAFETY: `out` checked by Out::new; valid by the caller's contract.
        unsafe { GRANTS.publish(Arc::new(grant), out) }
    }
}

/// Writes the grant's id (what the peer's [`gdr_peer_wait_grant`] waits
/// for). Any thread.
///
/// # Safety
/// `id` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_grant_id(grant: GdrGrant, id: *mut u64) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("id", id)?;
        let value = GRANTS.get(grant.id)?.descriptor().grant;
        // SAFETY: checked; valid by the caller's contract.
        unsafe { out.write(value) };
        Ok(())
    }
}

/// Writes the grant's descriptor in binary form into `buf` of `len` bytes
/// (`needed`, may be NULL, gets its length; `buf` may be NULL with `len` 0
/// to ask; `GDR_RESULT_BUFFER_TOO_SMALL`, nothing written, when short).
/// The peer parses it with [`gdr_descriptor_decode`]; it is usable only
/// on the connection it was granted on. Any thread.
///
/// # Safety
/// `buf` valid for `len` bytes of writes; `needed` NULL or valid for a
/// write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_grant_descriptor(
    grant: GdrGrant,
    buf: *mut u8,
    len: usize,
    needed: *mut usize,
) -> GdrResult {
    ffi_boundary! {
        let bytes = GRANTS.get(grant.id)?.descriptor().encode().map_err(|e| FfiError::new(GdrResult::Other, e.to_string()))?;
        // SAFETY: the caller's contract.
        unsafe { write_bytes(&bytes, buf, len, needed) }
    }
}

/// Writes the grant's descriptor as text (`gdr-md:v2:...`, NUL-terminated;
/// see [`crate::api::gdr_last_error_message`] for `buf`, `len`, `needed`).
/// The peer parses it with [`gdr_descriptor_parse_text`]. Any thread.
///
/// # Safety
/// As for [`crate::api::gdr_last_error_message`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_grant_descriptor_text(
    grant: GdrGrant,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> GdrResult {
    ffi_boundary! {
        let out = TextOut::new(buf, len, needed)?;
        let text = GRANTS.get(grant.id)?.descriptor().to_string();
        // SAFETY: the caller's contract.
        unsafe { out.write(&text) }
    }
}

/// Revokes the grant and frees its handle: the peer is told, and its NIC
/// access ends with the grant's registrations (a request of the peer
/// racing the revocation fails with `GDR_RESULT_REFUSED`). Any thread;
/// the handle is invalid afterwards.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_grant_revoke(grant: GdrGrant) -> GdrResult {
    ffi_boundary! {
        // Dropping the last reference revokes it.
        GRANTS.remove(grant.id)?;
        Ok(())
    }
}

/// Waits up to `timeout_ms` for the peer to announce grant `grant_id` on
/// this connection and writes a descriptor handle for it to `out`;
/// `GDR_RESULT_TIMEOUT` if it did not. Any thread.
///
/// # Safety
/// `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_peer_wait_grant(
    peer: GdrPeer,
    grant_id: u64,
    timeout_ms: u32,
    out: *mut GdrDescriptor,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        let descriptor = PEERS.get(peer.id)?.wait_grant(grant_id, millis(timeout_ms))?;
        // SAFETY: `out` checked; valid by the caller's contract.
        unsafe { DESCRIPTORS.publish(Arc::new(descriptor), out) }
    }
}

/// Parses a descriptor's text form (from [`gdr_grant_descriptor_text`])
/// into a handle. A descriptor is only usable on the connection its grant
/// was made on, and only while it is what the peer announced there: a
/// forged or altered one is refused at submit. Any thread.
///
/// # Safety
/// `text` a NUL-terminated string; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_descriptor_parse_text(
    text: *const c_char,
    out: *mut GdrDescriptor,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        // SAFETY: the caller's contract.
        let text = unsafe { text_arg("text", text) }?;
        let descriptor: MemoryDescriptor = text
            .parse()
            .map_err(|e| FfiError::invalid("text", e))?;
        // SAFETY: `out` checked; valid by the caller's contract.
        unsafe { DESCRIPTORS.publish(Arc::new(descriptor), out) }
    }
}

/// Decodes a descriptor's binary form (`len` bytes at `bytes`, from
/// [`gdr_grant_descriptor`]) into a handle; see
/// [`gdr_descriptor_parse_text`]. Any thread.
///
/// # Safety
/// `bytes` valid for reads of `len` bytes; `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_descriptor_decode(
    bytes: *const u8,
    len: usize,
    out: *mut GdrDescriptor,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("out", out)?;
        if bytes.is_null() {
            return Err(FfiError::invalid("bytes", "NULL"));
        }
        if len == 0 || len > gdr_core::descriptor::MAX_ENCODED_LEN {
            return Err(FfiError::invalid("len", format!("{len} bytes is no descriptor")));
        }
        // SAFETY: not NULL, `len` readable bytes (the caller's contract),
        // `len` small.
        let bytes = unsafe { std::slice::from_raw_parts(bytes, len) };
        let descriptor = MemoryDescriptor::decode(bytes).map_err(|e| FfiError::invalid("bytes", e))?;
        // SAFETY: `out` checked; valid by the caller's contract.
        unsafe { DESCRIPTORS.publish(Arc::new(descriptor), out) }
    }
}

/// Writes what a descriptor says: its owner engine, grant id, length,
/// rights and memory. Any thread.
///
/// # Safety
/// `info` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_descriptor_get_info(
    descriptor: GdrDescriptor,
    info: *mut GdrDescriptorInfo,
) -> GdrResult {
    ffi_boundary! {
        let out = Out::new("info", info)?;
        let d = DESCRIPTORS.get(descriptor.id)?;
        let rights = match d.rights {
            GrantRights::Read => GdrRights::Read,
            GrantRights::Write => GdrRights::Write,
            GrantRights::ReadWrite => GdrRights::ReadWrite,
        };
        let device = match d.location {
            MemoryLocation::Host => -1,
            MemoryLocation::Gpu { ordinal } => i32::from(ordinal),
        };
        let value = GdrDescriptorInfo { owner: d.owner, grant: d.grant, len: d.len, rights: rights as u32, device };
        // SAFETY: checked; valid by the caller's contract.
        unsafe { out.write(value) };
        Ok(())
    }
}

/// Frees a descriptor handle (batches submitted with it are not
/// affected). Any thread; the handle is invalid afterwards.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_descriptor_free(descriptor: GdrDescriptor) -> GdrResult {
    ffi_boundary! {
        DESCRIPTORS.remove(descriptor.id)?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Batches.

/// Most transfers in one batch.
const MAX_BATCH: usize = 1 << 20;

/// Checks `count` transfers at `transfers` for `peer` and submits them
/// with `submit`; writes the batch's handle to `out`.
///
/// # Safety
/// As for [`gdr_peer_submit`].
unsafe fn submit_checked(
    peer: GdrPeer,
    transfers: *const GdrTransfer,
    count: usize,
    out: *mut GdrBatch,
    submit: impl FnOnce(&Peer, &[Transfer<'_>]) -> Result<Batch, FfiError>,
) -> Result<(), FfiError> {
    let out = Out::new("out", out)?;
    if transfers.is_null() {
        return Err(FfiError::invalid("transfers", "NULL"));
    }
    if !transfers.is_aligned() {
        return Err(FfiError::invalid("transfers", "misaligned"));
    }
    if count == 0 || count > MAX_BATCH {
        return Err(FfiError::invalid(
            "count",
            format!("{count} (1 to {MAX_BATCH})"),
        ));
    }
    let peer = PEERS.get(peer.id)?;
    let mut held = Vec::with_capacity(count);
    for i in 0..count {
        // SAFETY: `transfers` holds `count` aligned elements (the
        // caller's contract); plain integers, any bit pattern valid.
        let t = unsafe { transfers.add(i).read() };
        let op = match t.op {
            0 => Op::Read,
            1 => Op::Write,
            other => {
                return Err(FfiError::invalid(
                    &format!("transfers[{i}].op"),
                    format!("{other} is no gdr_op"),
                ));
            }
        };
        let region = REGIONS.get(t.region.id)?;
        let remote = DESCRIPTORS.get(t.remote.id)?;
        held.push((op, region, t.local_offset, remote, t.remote_offset, t.len));
    }
    let erased: Vec<Transfer<'_>> = held
        .iter()
        .map(
            |(op, region, local_offset, remote, remote_offset, len)| Transfer {
                op: *op,
                local: region,
                local_offset: *local_offset,
                remote,
                remote_offset: *remote_offset,
                len: *len,
            },
        )
        .collect();
    let batch = submit(&peer, &erased)?;
    // SAFETY: `out` checked by Out::new; valid by the caller's contract.
    unsafe { BATCHES.publish(Arc::new(batch), out) }
}

/// Submits `count` transfers to `peer` as one batch that must end within
/// `timeout_ms` (0: the engine's default timeout) and writes its handle to
/// `out`. Every transfer is checked before anything is posted: its region
/// of the peer's engine and in bounds, its descriptor a live grant of this
/// peer on this connection allowing the operation and holding the range
/// (`GDR_RESULT_REFUSED` otherwise). The batch ends exactly once:
/// [`gdr_batch_poll`], [`gdr_batch_wait`]; a CUDA stream can wait for it
/// ([`gdr_batch_fence_stream`]). Any thread.
///
/// # Safety
/// `transfers` valid for reads of `count` elements; `out` valid for a
/// write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_peer_submit(
    peer: GdrPeer,
    transfers: *const GdrTransfer,
    count: usize,
    timeout_ms: u32,
    out: *mut GdrBatch,
) -> GdrResult {
    ffi_boundary! {
        let timeout = (timeout_ms != 0).then(|| millis(timeout_ms));
        // SAFETY: the caller's contract.
        unsafe { submit_checked(peer, transfers, count, out, |peer, erased| {
            Ok(match timeout {
                Some(timeout) => peer.submit_with_timeout(erased, timeout)?,
                None => peer.submit(erased)?,
            })
        }) }
    }
}

/// Submits `count` transfers to `peer` as one batch that starts only once
/// `stream` reaches this point: what was queued on the stream before the
/// call (kernels, [`crate::stream::gdr_stream_copy`]) is done, and its
/// writes visible, before anything of the batch is posted, so a WRITE
/// sends the data the stream produced. No thread blocks: the engine's own
/// thread watches the stream. The transfers are checked at the call as
/// [`gdr_peer_submit`] checks them. The batch must end within
/// `timeout_ms` (0: the engine's default) counted from the call: a stream
/// that has not reached the point by then ends it `GDR_RESULT_TIMEOUT`,
/// nothing posted; a stream that fails before it ends it with the
/// stream's error; [`gdr_batch_cancel`] before the stream gets there ends
/// it `GDR_RESULT_CANCELLED` at once. Wait for it as for any batch. The
/// stream may be of any context of the same backends. Any thread.
///
/// # Safety
/// As for [`gdr_peer_submit`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_peer_submit_after_stream(
    peer: GdrPeer,
    stream: GdrStream,
    transfers: *const GdrTransfer,
    count: usize,
    timeout_ms: u32,
    out: *mut GdrBatch,
) -> GdrResult {
    ffi_boundary! {
        let timeout = (timeout_ms != 0).then(|| millis(timeout_ms));
        let stream = crate::stream::stream(stream)?;
        // SAFETY: the caller's contract.
        unsafe {
            submit_checked(peer, transfers, count, out, |peer, erased| {
                Ok(peer.submit_after_stream(&stream.stream, erased, timeout)?)
            })
        }
    }
}

/// Makes `stream` wait for the batch: work
/// queued on the stream after this call (kernels,
/// [`crate::stream::gdr_stream_copy`]) runs once the batch has ended and,
/// where the GPU needs it, its inbound writes were flushed, so it sees
/// the data a READ brought into GPU memory. The stream is released however
/// the batch ends: check the batch's outcome ([`gdr_batch_wait`],
/// [`gdr_batch_poll`]) before trusting the data. Several streams may wait
/// for one batch, and a stream for several batches. The stream may be of
/// any context of the same backends. A batch on a NIC's direct rungs is fenced
/// without blocking a thread; a staged batch, a peer copy or a gated batch is
/// waited for in the call (its end needs CUDA calls a stream must not wait
/// behind: see the guide's Fences section). Any thread.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_batch_fence_stream(batch: GdrBatch, stream: GdrStream) -> GdrResult {
    ffi_boundary! {
        let batch = BATCHES.get(batch.id)?;
        let stream = crate::stream::stream(stream)?;
        Ok(batch.fence_stream(&stream.stream)?)
    }
}

/// Whether the batch has ended, without blocking (it makes progress
/// once): `done` gets that, and once done `result` gets its outcome
/// (`GDR_RESULT_OK`, or the first failure's code with its message in the
/// thread's last error); `result` is left alone while running. Any
/// thread.
///
/// # Safety
/// `done` and `result` valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gdr_batch_poll(
    batch: GdrBatch,
    done: *mut bool,
    result: *mut GdrResult,
) -> GdrResult {
    ffi_boundary! {
        let done = Out::new("done", done)?;
        let result = Out::new("result", result)?;
        let status = BATCHES.get(batch.id)?.status();
        let code = status.map(|outcome| match outcome {
            Ok(()) => GdrResult::Ok,
            Err(e) => {
                let error = FfiError::from(e);
                let code = error.result;
                crate::boundary::record(error);
                code
            }
        });
        // SAFETY: checked; valid by the caller's contract.
        unsafe {
            done.write(code.is_some());
            if let Some(code) = code {
                result.write(code);
            }
        }
        Ok(())
    }
}

/// Waits up to `timeout_ms` for the batch to end, making progress, and
/// returns its outcome: `GDR_RESULT_OK`, or the first failure's code
/// (message in the last error): `GDR_RESULT_REFUSED` (the peer's NIC
/// refused the access: revoked, out of the grant), `GDR_RESULT_PEER_GONE`,
/// `GDR_RESULT_CANCELLED`, `GDR_RESULT_TIMEOUT` (its own deadline
/// passed). Still running after `timeout_ms`: `GDR_RESULT_TIMEOUT` too,
/// the batch left running ([`gdr_batch_poll`] tells the two apart). A
/// batch that READ into GPU memory is fenced for kernels before this
/// returns `GDR_RESULT_OK` (a stream can wait for it instead:
/// [`gdr_batch_fence_stream`]). Any thread; several may wait on one batch.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_batch_wait(batch: GdrBatch, timeout_ms: u32) -> GdrResult {
    ffi_boundary! {
        let batch = BATCHES.get(batch.id)?;
        let outcome = match batch.wait(millis(timeout_ms)) {
            // The wait's timeout, or the batch's own: the status says.
            Err(TransferError::Timeout(_)) => match batch.status() {
                Some(outcome) => outcome,
                None => {
                    return Err(FfiError::new(
                        GdrResult::Timeout,
                        format!("the batch is still running after {timeout_ms} ms (wait again, poll or cancel it)"),
                    ));
                }
            },
            outcome => outcome,
        };
        Ok(outcome?)
    }
}

/// Cancels the batch: what is not posted is dropped; it ends with
/// `GDR_RESULT_CANCELLED` once nothing of it is in flight (unless it ended
/// first). Any thread.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_batch_cancel(batch: GdrBatch) -> GdrResult {
    ffi_boundary! {
        BATCHES.get(batch.id)?.cancel();
        Ok(())
    }
}

/// Frees the batch's handle. A batch still running is not cancelled: it
/// runs to its end (its regions held until then). Any thread; the handle
/// is invalid afterwards.
#[unsafe(no_mangle)]
pub extern "C" fn gdr_batch_free(batch: GdrBatch) -> GdrResult {
    ffi_boundary! {
        BATCHES.remove(batch.id)?;
        Ok(())
    }
}
