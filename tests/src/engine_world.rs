//! Two transfer engines connected to each other over any verbs backend:
//! the world the engine tests (`sim_engine`, `sim_engine_async`,
//! `rxe_engine`) run their transfers in.
//!
//! Each [`Side`] is a verbs provider, a simulated GPU and an engine over
//! both; an [`EngineWorld`] is two sides, `b` listening (accepting on a
//! thread) and `a` connected to it, with both ends of the connection
//! ([`EngineWorld::ab`], [`EngineWorld::ba`]). [`EngineWorld::sim`] builds
//! one on two nodes of a `SimFabric`, [`EngineWorld::rxe`] on SoftRoCE's
//! `rxe0` (both engines on the one device), and [`Side`] hands out
//! buffers of host, pinned or GPU memory holding a [`pattern`], registered
//! with the engine.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use gdr_core::buffer::Buffer;
use gdr_core::descriptor::{GrantRights, MemoryDescriptor};
use gdr_core::engine::{
    Batch, Engine, EngineConfig, EngineError, Grant, Path, Peer, PeerCopyRoute, Region, Transfer,
    TransferError,
};
use gdr_core::ladder::{Policy, Rung};
use gdr_sim::{
    DeviceConfig, FaultPlan, GpuConfig, NodeConfig, SimCuda, SimCudaApi, SimFabric, SimVerbsApi,
};
use hal_cuda::{Context as _, Driver as _, Stream as _};
use hal_verbs::Api;
use hal_verbs::rdma::{RdmaApi, RdmaProvider};

use crate::{init_tracing, pattern, rxe};

/// An engine (its backends erased: whichever `Side` opened it on).
pub type WorldEngine = Engine;
/// One end of a connection between two engines.
pub type WorldPeer = Peer;
/// A grant of a region to a peer (revoked when dropped).
pub type WorldGrant = Grant;
/// A buffer of the GPU's driver (host, pinned or device memory).
pub type WorldBuffer = Buffer;

/// `base` with GPU memory on the staging rung only (no GPUDirect rung).
pub fn staged_only(base: EngineConfig) -> EngineConfig {
    let ladder = base.ladder.with_policy(Policy::Only(Rung::Staging));
    base.with_ladder(ladder)
}

/// [`staged_only`], and a peer's staged regions reached through the
/// owner's landing slots in 4 KiB slices (4 slots lent, 2 slots of the
/// local pool): many slices for a small transfer.
pub fn staged_through_slots(base: EngineConfig) -> EngineConfig {
    staged_only(base)
        .with_staging_slice(4096)
        .with_staging_slots(2)
        .with_rendezvous_slots(4)
}

/// The memory a region is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Pageable host memory.
    Host,
    /// Pinned host memory of the GPU's driver.
    Pinned,
    /// GPU memory.
    Gpu,
}

/// One node: its verbs provider, its GPU driver (simulated unless said
/// otherwise) and its engine.
#[derive(Debug)]
pub struct Side<V: Api, C: hal_cuda::Api = SimCudaApi> {
    /// The provider the engine was opened on.
    pub verbs: V::Provider,
    /// The GPU the engine registers device and pinned memory of.
    pub cuda: C::Driver,
    /// `cuda` erased, as the engine holds it: buffers for the engine are
    /// made through it.
    pub driver: hal_cuda::dynamic::DynDriver,
    /// The engine.
    pub engine: WorldEngine,
    /// Its engine's stream-fence page bytes, read when the side goes (the
    /// world's release check allows for them).
    fence_page: Arc<AtomicU64>,
}

impl<V: Api, C: hal_cuda::Api> Drop for Side<V, C> {
    fn drop(&mut self) {
        self.fence_page
            .store(self.engine.resources().fence_page_bytes, Ordering::Release);
    }
}

impl<V: Api, C: hal_cuda::Api> Side<V, C> {
    /// Runs `f` here while another thread holds this side's engine lock
    /// (for `hold`, from before `f` starts): what `f` returned, and
    /// whether it returned while the lock was still held. For tests that
    /// what a peer does alone never waits for the engine's lock.
    pub fn while_engine_lock_held<T>(&self, hold: Duration, f: impl FnOnce() -> T) -> (T, bool) {
        use std::sync::atomic::AtomicBool;
        let released = AtomicBool::new(false);
        let (held, holding) = std::sync::mpsc::channel();
        let engine = &self.engine;
        std::thread::scope(|s| {
            s.spawn(|| {
                engine.with_engine_lock_held(|| {
                    held.send(()).expect("the test waits for the hold");
                    std::thread::sleep(hold);
                    released.store(true, Ordering::SeqCst);
                })
            });
            holding.recv().expect("the holding thread runs");
            let out = f();
            (out, !released.load(Ordering::SeqCst))
        })
    }

    /// An engine on `verbs` (the NICs `config` names, or all) and `cuda`.
    pub fn new(verbs: V::Provider, cuda: C::Driver, config: EngineConfig) -> Self
    where
        V::Provider: Clone,
        C::Driver: Clone,
    {
        let provider = hal_verbs::dynamic::DynProvider::new::<V>(verbs.clone());
        let driver = hal_cuda::dynamic::DynDriver::new::<C>(cuda.clone());
        let engine = WorldEngine::new(&provider, Some(&driver), config.clone())
            .unwrap_or_else(|e| panic!("an engine on {:?}: {e}", config.devices));
        Self {
            verbs,
            cuda,
            driver,
            engine,
            fence_page: Arc::new(AtomicU64::new(0)),
        }
    }

    /// `len` bytes of host memory holding `pattern(len, seed)`, registered
    /// (on the host-memory rung of every NIC).
    pub fn host(&self, len: u64, seed: u8) -> (WorldBuffer, Region) {
        let buffer = Buffer::alloc_host(len);
        buffer
            .write_at(0, &pattern(len as usize, seed))
            .expect("host memory is CPU-writable");
        let region = self.engine.register_buffer(&buffer).unwrap();
        let nics = self.engine.nics().len();
        assert_eq!(region.rungs(), vec![Rung::HostMemory; nics], "one per NIC");
        (buffer, region)
    }

    /// `len` bytes of pinned host memory holding `pattern(len, seed)`,
    /// registered.
    pub fn pinned(&self, len: u64, seed: u8) -> (WorldBuffer, Region) {
        let ctx = self.driver.context(0).unwrap();
        let buffer = Buffer::alloc_pinned(&ctx, len).unwrap();
        buffer.write_at(0, &pattern(len as usize, seed)).unwrap();
        let region = self.engine.register_buffer(&buffer).unwrap();
        (buffer, region)
    }

    /// `len` bytes of GPU memory holding `pattern(len, seed)` (copied in
    /// on a stream), registered on whichever rung the ladder takes.
    pub fn gpu(&self, len: u64, seed: u8) -> (WorldBuffer, Region) {
        self.gpu_on(0, len, seed)
    }

    /// [`Side::gpu`] on GPU `ordinal`.
    pub fn gpu_on(&self, ordinal: u32, len: u64, seed: u8) -> (WorldBuffer, Region) {
        let ctx = self.driver.context(ordinal).unwrap();
        let buffer = Buffer::alloc_device(&ctx, len).unwrap();
        let data = pattern(len as usize, seed);
        let stream = ctx.create_stream().unwrap();
        // SAFETY: the device allocation holds `len` bytes, as does `data`,
        // and the stream is synchronised before `data` goes.
        unsafe { stream.copy_host_to_device(buffer.addr(), data.as_ptr(), data.len()) }.unwrap();
        stream.synchronize().unwrap();
        let region = self.engine.register_buffer(&buffer).unwrap();
        (buffer, region)
    }

    /// `len` bytes of `kind` holding `pattern(len, seed)`, registered.
    pub fn alloc(&self, kind: Kind, len: u64, seed: u8) -> (WorldBuffer, Region) {
        match kind {
            Kind::Host => self.host(len, seed),
            Kind::Pinned => self.pinned(len, seed),
            Kind::Gpu => self.gpu(len, seed),
        }
    }

    /// The buffer's bytes: host memory read directly, device memory
    /// through a stream copy.
    pub fn bytes(&self, buffer: &WorldBuffer) -> Vec<u8> {
        if buffer.memory_type() != hal_cuda::MemoryType::Device {
            return buffer.to_vec().expect("host memory is CPU-readable");
        }
        self.device_bytes(
            buffer.device_ordinal().unwrap_or(0),
            buffer.addr(),
            buffer.len() as usize,
        )
    }

    /// `len` bytes of GPU `ordinal`'s memory at `addr`, through a stream copy.
    pub fn device_bytes(&self, ordinal: u32, addr: u64, len: usize) -> Vec<u8> {
        let ctx = self.driver.context(ordinal).unwrap();
        let mut out = vec![0; len];
        let stream = ctx.create_stream().unwrap();
        // SAFETY: `out` holds `len` bytes, the caller names `len` mapped
        // bytes at `addr`, and the stream is synchronised before `out` is
        // read.
        unsafe { stream.copy_device_to_host(out.as_mut_ptr(), addr, len) }.unwrap();
        stream.synchronize().unwrap();
        out
    }

    /// Copies `data` into device memory at `addr` (mapped for its length).
    pub fn write_device(&self, addr: u64, data: &[u8]) {
        let ctx = self.driver.context(0).unwrap();
        let stream = ctx.create_stream().unwrap();
        // SAFETY: the caller names `data.len()` mapped bytes at `addr`; the
        // stream is synchronised before `data` goes.
        unsafe { stream.copy_host_to_device(addr, data.as_ptr(), data.len()) }.unwrap();
        stream.synchronize().unwrap();
    }

    /// CUDA VMM memory as PyTorch's allocator makes it: a reservation of
    /// `slots` chunks of the granularity, the first `chunks` mapped, each
    /// created `gpuDirectRDMACapable` unless its index is in `plain`.
    /// `None` (the reason printed) where the GPU has no VMM API.
    pub fn vmm_memory(&self, slots: usize, chunks: usize, plain: &[usize]) -> Option<VmmMemory> {
        use hal_cuda::VirtualReservation as _;
        let ctx = self.driver.context(0).unwrap();
        let chunk = match ctx.vmm_granularity() {
            Ok(g) => g,
            Err(e) => {
                eprintln!("no CUDA VMM: {e}");
                return None;
            }
        };
        let reservation = ctx.reserve_address_range(slots * chunk).unwrap();
        let mut memory = VmmMemory {
            base: reservation.base(),
            chunk: chunk as u64,
            mappings: Vec::new(),
            physical: Vec::new(),
            reservation,
        };
        for i in 0..chunks {
            let physical = ctx
                .create_physical_with(chunk, !plain.contains(&i))
                .unwrap();
            memory.mappings.push(Some(
                ctx.map(&memory.reservation, i * chunk, &physical).unwrap(),
            ));
            memory.physical.push(physical);
        }
        Some(memory)
    }

    /// `len` bytes at `offset` of `memory` holding `pattern(len, seed)`,
    /// wrapped as a buffer (pointer attributes read: its chunks found) and
    /// registered.
    pub fn wrap_vmm(
        &self,
        memory: &VmmMemory,
        offset: u64,
        len: u64,
        seed: u8,
    ) -> (WorldBuffer, Region) {
        let addr = memory.base + offset;
        self.write_device(addr, &pattern(len as usize, seed));
        let ctx = self.driver.context(0).unwrap();
        // SAFETY: the range is mapped (the caller's `memory`), and tests
        // drop the buffer before the memory (or remap under it on purpose,
        // to see the remap detected).
        let buffer = unsafe { Buffer::wrap(Some(&ctx), addr, len, None) }.unwrap();
        let region = self.engine.register_buffer(&buffer).unwrap();
        (buffer, region)
    }
}

/// CUDA VMM memory made through the HAL ([`Side::vmm_memory`]). Field order
/// is drop order.
#[derive(Debug)]
pub struct VmmMemory {
    /// The mapping of each chunk slot (`None`: unmapped).
    pub mappings: Vec<Option<hal_cuda::dynamic::DynVirtualMapping>>,
    /// The physical chunks created, in order.
    pub physical: Vec<hal_cuda::dynamic::DynPhysicalMemory>,
    /// The reserved range.
    pub reservation: hal_cuda::dynamic::DynVirtualReservation,
    /// Its first address.
    pub base: u64,
    /// The chunk size (the VMM granularity).
    pub chunk: u64,
}

impl VmmMemory {
    /// Unmaps slot `slot`'s chunk and maps fresh physical memory there (a
    /// new buffer id at the same address); the old physical memory is
    /// mapped at slot `spare` (to read what it holds). Returns the old
    /// chunk's address there.
    pub fn remap(&mut self, ctx: &hal_cuda::dynamic::DynContext, slot: usize, spare: usize) -> u64 {
        use hal_cuda::VirtualMapping as _;
        let chunk = self.chunk as usize;
        drop(self.mappings[slot].take());
        let fresh = ctx.create_physical(chunk).unwrap();
        let mapped = ctx.map(&self.reservation, slot * chunk, &fresh).unwrap();
        assert_eq!(mapped.device_ptr(), self.base + (slot * chunk) as u64);
        self.mappings[slot] = Some(mapped);
        let old = ctx
            .map(&self.reservation, spare * chunk, &self.physical[slot])
            .unwrap();
        let at = old.device_ptr();
        while self.mappings.len() <= spare {
            self.mappings.push(None);
        }
        self.mappings[spare] = Some(old);
        self.physical.push(fresh);
        at
    }
}

/// Two engines, a connected to b: `ab` is a's peer b, `ba` b's peer a.
#[derive(Debug)]
pub struct EngineWorld<V: Api, C: hal_cuda::Api = SimCudaApi> {
    /// a's end of the connection (its peer is b).
    pub ab: WorldPeer,
    /// b's end of the connection (its peer is a).
    pub ba: WorldPeer,
    /// The connecting side.
    pub a: Side<V, C>,
    /// The listening side.
    pub b: Side<V, C>,
    /// How long connecting and waiting for a grant may take.
    pub timeout: Duration,
    /// On the simulation: checks, once everything of the world is gone,
    /// that nothing is left on its fabric or GPUs (dropped last).
    released: Option<ReleaseCheck>,
}

/// What a simulated world must give back: every MR, QP, CQ, listener and
/// connection of its fabric, every device and pinned byte, registration
/// and stream of its simulated CUDA processes, but for each engine's
/// stream-fence page (kept for the life of the process, by design). Checked
/// when the world is dropped, after its engines and peers: a test that
/// ends with a region, buffer or grant of its own still alive declares it
/// after the world (it is then dropped first), as tests do. Like mockall's
/// expectations, the check fails the test from `drop`, unless the test is
/// failing already.
#[derive(Debug)]
struct ReleaseCheck {
    fabric: SimFabric,
    /// Each side's simulated CUDA (none for a real GPU driver).
    cudas: Vec<Option<SimCuda>>,
    /// Each side's engine's fence page, read as its side goes.
    fence_pages: Vec<Arc<AtomicU64>>,
}

/// How long the release check waits for what the engines' last steps let
/// go on their own threads (an engine whose internal step outlasted its
/// drop closes when the step ends, saying so in a warning).
const RELEASE_GRACE: Duration = Duration::from_secs(5);

impl Drop for ReleaseCheck {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let start = std::time::Instant::now();
        while !self.fabric.resources().is_empty() && start.elapsed() < RELEASE_GRACE {
            std::thread::sleep(Duration::from_millis(5));
        }
        let late = start.elapsed();
        if late > Duration::from_millis(50) {
            eprintln!("release check: the world's fabric was released {late:?} after its drop");
        }
        let left = self.fabric.resources();
        assert!(left.is_empty(), "the world's fabric kept {left:?}");
        // Two sides of one simulated process (peer-copy worlds) share it.
        let mut seen: Vec<(&SimCuda, u64)> = Vec::new();
        for (cuda, page) in self.cudas.iter().zip(&self.fence_pages) {
            let page = page.load(Ordering::Acquire);
            let Some(cuda) = cuda else { continue };
            match seen
                .iter_mut()
                .find(|(c, _)| c.process_id() == cuda.process_id())
            {
                Some((_, kept)) => *kept += page,
                None => seen.push((cuda, page)),
            }
        }
        for (cuda, kept) in seen {
            let left = cuda.resources();
            let rest = gdr_sim::CudaResources {
                pinned_bytes: left.pinned_bytes.saturating_sub(kept),
                ..left
            };
            assert!(
                rest.is_empty(),
                "the world's simulated CUDA kept {left:?} (its engines' fence pages: {kept} bytes)"
            );
        }
    }
}

impl<V: Api, C: hal_cuda::Api> EngineWorld<V, C> {
    /// b listens on `listen` (an assigned port) and accepts on a thread;
    /// a connects over the paths `paths` makes of b's address. Checks both
    /// ends name each other and share the session.
    pub fn connect(
        a: Side<V, C>,
        b: Side<V, C>,
        listen: IpAddr,
        paths: impl FnOnce(SocketAddr) -> Vec<Path>,
        timeout: Duration,
    ) -> Self {
        let listener = b
            .engine
            .listen(SocketAddr::new(listen, 0))
            .unwrap_or_else(|e| panic!("listening on {listen}: {e}"));
        let addr = listener.local_addr();
        assert_ne!(addr.port(), 0, "a port was assigned: {addr}");
        let (ab, ba) = std::thread::scope(|scope| {
            let accepting = scope.spawn(move || listener.accept(timeout));
            let ab = a
                .engine
                .connect_paths(&paths(addr), timeout)
                .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
            let ba = accepting
                .join()
                .unwrap()
                .unwrap_or_else(|e| panic!("accepting on {addr}: {e}"));
            (ab, ba)
        });
        assert_eq!(ab.remote_engine(), b.engine.id());
        assert_eq!(ba.remote_engine(), a.engine.id());
        assert_eq!(ab.session(), ba.session());
        Self {
            ab,
            ba,
            a,
            b,
            timeout,
            released: None,
        }
    }

    fn with_release_check(mut self, check: ReleaseCheck) -> Self {
        self.released = Some(check);
        self
    }

    /// b grants all of `region` to a, which waits for the announcement
    /// (see [`grant_to`]).
    pub fn b_grants(&self, region: &Region, rights: GrantRights) -> (WorldGrant, MemoryDescriptor) {
        grant_to(&self.ba, &self.ab, region, rights, self.timeout)
    }

    /// `len` bytes of host memory on each side, a's holding
    /// `pattern(len, seed)` and b's `pattern(len, 0)`, b's granted to a with
    /// `rights`: what most transfers go between.
    pub fn host_pair(&self, len: u64, seed: u8, rights: GrantRights) -> HostPair {
        let (src_buf, src) = self.a.host(len, seed);
        let (dst_buf, dst) = self.b.host(len, 0);
        let (grant, remote) = self.b_grants(&dst, rights);
        HostPair {
            grant,
            remote,
            src,
            src_buf,
            dst,
            dst_buf,
        }
    }

    /// `len` bytes of `from` memory on a WRITTEN into `to` memory on b
    /// (granted read-write), then READ back into fresh `from` memory in
    /// `parts` transfers of one batch (at odd offsets when more than one);
    /// both verified byte for byte. `what` names the case in failures.
    /// Returns the rungs of a's and b's regions and b's grant as a saw it.
    pub fn write_and_read_back(
        &self,
        from: Kind,
        to: Kind,
        len: u64,
        seed: u8,
        parts: u64,
        what: &str,
    ) -> (Vec<Rung>, Vec<Rung>, MemoryDescriptor) {
        let t = self.timeout;
        let (_s, src) = self.a.alloc(from, len, seed);
        let (dst_buf, dst) = self.b.alloc(to, len, 0);
        let (_g, remote) = self.b_grants(&dst, GrantRights::ReadWrite);
        self.ab
            .submit(&[Transfer::write(&src, 0, &remote, 0, len)])
            .unwrap()
            .wait(t)
            .unwrap_or_else(|e| panic!("{what} WRITE {from:?}->{to:?}: {e}"));
        assert!(
            self.b.bytes(&dst_buf) == pattern(len as usize, seed),
            "{what} WRITE {from:?}->{to:?}: the data"
        );
        let (back_buf, back) = self.a.alloc(from, len, 0);
        let mut cuts: Vec<u64> = (0..=parts)
            .map(|i| {
                if i == parts {
                    len
                } else {
                    (i * (len / parts) + i).min(len)
                }
            })
            .collect();
        // Tiny lengths: no empty transfer.
        cuts.dedup();
        let reads: Vec<_> = cuts
            .windows(2)
            .map(|c| Transfer::read(&back, c[0], &remote, c[0], c[1] - c[0]))
            .collect();
        self.ab
            .submit(&reads)
            .unwrap()
            .wait(t)
            .unwrap_or_else(|e| panic!("{what} READ {to:?}->{from:?}: {e}"));
        assert!(
            self.a.bytes(&back_buf) == pattern(len as usize, seed),
            "{what} READ {to:?}->{from:?}: the data"
        );
        (src.rungs(), dst.rungs(), remote)
    }
}

impl<V: Api, C: hal_cuda::Api> EngineWorld<V, C> {
    /// Runs `transfers` on `peer` as one batch and waits for it.
    fn run(&self, peer: &WorldPeer, transfers: &[Transfer<'_>], what: &str) {
        peer.submit(transfers)
            .unwrap_or_else(|e| panic!("{what}: submit: {e}"))
            .wait(self.timeout)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }

    /// The CUDA VMM scenario: a's buffer wraps 3 chunks and 1000 bytes of
    /// VMM memory (four chunks, starting 12345 bytes into the first; the
    /// chunks whose index is in `plain` created without
    /// `gpuDirectRDMACapable`), b's is [`Buffer::alloc_vmm`] memory of the
    /// same length, granted to a. a WRITEs all of its buffer into b's and
    /// READs it back (after clearing its own) in three transfers cut off
    /// the chunk boundaries; then a grants its buffer to b, which READs two
    /// chunks' worth across a boundary and WRITEs across another. Every
    /// byte is verified. Returns the rung of each of a's pieces (on its
    /// first NIC) and the descriptor b got for a's grant; `None` where the
    /// GPU has no VMM API.
    pub fn vmm_round_trip(&self, plain: &[usize]) -> Option<(Vec<Rung>, MemoryDescriptor)> {
        let memory = self.a.vmm_memory(4, 4, plain)?;
        let g = memory.chunk;
        let (offset, len, seed) = (12_345, 3 * g + 1000, 21);
        let want = pattern(len as usize, seed);
        let (src_buf, src) = self.a.wrap_vmm(&memory, offset, len, seed);
        assert_eq!(src_buf.chunks().len(), 4, "the range covers four chunks");
        let pieces = src.pieces(0).unwrap();
        let offsets: Vec<u64> = pieces.iter().map(|p| p.offset).collect();
        // Chunk k starts k * g - offset bytes into the buffer.
        let boundary = |k: u64| k * g - offset;
        assert_eq!(
            offsets,
            [0, boundary(1), boundary(2), boundary(3)],
            "one piece per chunk"
        );
        let rungs: Vec<Rung> = pieces.iter().map(|p| p.registration.rung()).collect();

        let ctx = self.b.driver.context(0).unwrap();
        let dst_buf = Buffer::alloc_vmm(&ctx, len, g).unwrap();
        assert_eq!(dst_buf.chunks().len(), 4);
        let dst = self.b.engine.register_buffer(&dst_buf).unwrap();
        let (_g, remote) = self.b_grants(&dst, GrantRights::ReadWrite);
        self.run(
            &self.ab,
            &[Transfer::write(&src, 0, &remote, 0, len)],
            "VMM WRITE",
        );
        assert!(self.b.bytes(&dst_buf) == want, "VMM WRITE: the data");

        self.a.write_device(src_buf.addr(), &vec![0; len as usize]);
        let cuts = [0, boundary(1) - 7, boundary(2) + 13, len];
        let reads: Vec<_> = cuts
            .windows(2)
            .map(|c| Transfer::read(&src, c[0], &remote, c[0], c[1] - c[0]))
            .collect();
        self.run(&self.ab, &reads, "VMM READ back");
        assert!(self.a.bytes(&src_buf) == want, "VMM READ back: the data");

        // b reaches a's chunks through a's grant.
        let (_a_grant, a_remote) = grant_to(
            &self.ab,
            &self.ba,
            &src,
            GrantRights::ReadWrite,
            self.timeout,
        );
        let (across, at) = (2 * g, boundary(1) - 100);
        let (host_buf, host) = self.b.host(across, 0);
        self.run(
            &self.ba,
            &[Transfer::read(&host, 0, &a_remote, at, across)],
            "b READs a's chunks",
        );
        assert!(
            host_buf.to_vec().unwrap()[..] == want[at as usize..(at + across) as usize],
            "b READs a's chunks: the data"
        );
        let (put, put_at) = (g + 200, boundary(2) - g / 2);
        let (_h, from) = self.b.host(put, 77);
        self.run(
            &self.ba,
            &[Transfer::write(&from, 0, &a_remote, put_at, put)],
            "b WRITEs a's chunks",
        );
        let mut expect = want;
        expect[put_at as usize..(put_at + put) as usize]
            .copy_from_slice(&pattern(put as usize, 77));
        assert!(
            self.a.bytes(&src_buf) == expect,
            "b WRITEs a's chunks: the data"
        );
        Some((rungs, a_remote))
    }

    /// A chunk remapped under a registered CUDA VMM buffer is registered
    /// anew: a's buffer wraps three chunks (a fourth slot spare), is
    /// registered and READ into; then chunk 1 is unmapped and fresh
    /// physical memory mapped at the same address (a new buffer id), the
    /// old chunk mapped in the spare slot. Registering the buffer again
    /// gives chunk 1 a new registration (chunks 0 and 2 hit the cache:
    /// where not staged), and a READ into it lands in the new memory,
    /// never the old. `None` where the GPU has no VMM API.
    pub fn vmm_remap_is_stale(&self) -> Option<()> {
        let mut memory = self.a.vmm_memory(4, 3, &[])?;
        let g = memory.chunk;
        let (offset, len) = (100, 3 * g - 200);
        let (src_buf, src) = self.b.host(len, 31);
        let (_g, remote) = self.b_grants(&src, GrantRights::Read);
        let (buf, first) = self.a.wrap_vmm(&memory, offset, len, 0);
        self.run(
            &self.ab,
            &[Transfer::read(&first, 0, &remote, 0, len)],
            "READ before the remap",
        );
        assert!(self.a.bytes(&buf) == pattern(len as usize, 31));

        let ctx = self.a.driver.context(0).unwrap();
        let old_at = memory.remap(&ctx, 1, 3);
        let now = ctx.pointer_attributes(memory.base + g).unwrap();
        assert_ne!(
            now.buffer_id,
            buf.chunks()[1].buffer_id,
            "the remapped chunk has a new buffer id"
        );
        src_buf.write_at(0, &pattern(len as usize, 32)).unwrap();
        let again = self.a.engine.register_buffer(&buf).unwrap();
        let (before, after) = (first.pieces(0).unwrap(), again.pieces(0).unwrap());
        assert_eq!(after.len(), 3);
        for (i, (b, a)) in before.iter().zip(after).enumerate() {
            let (Some(old), Some(new)) = (b.registration.handle(), a.registration.handle()) else {
                assert_eq!(a.registration.rung(), Rung::Staging, "no MR: staged");
                continue;
            };
            assert_eq!(
                old.same_registration(new),
                i != 1,
                "chunk {i}: a cache hit unless remapped"
            );
            if i == 1 {
                assert_eq!(new.identity().buffer_id(), Some(now.buffer_id));
            }
        }
        self.run(
            &self.ab,
            &[Transfer::read(&again, 0, &remote, 0, len)],
            "READ after the remap",
        );
        assert!(
            self.a.bytes(&buf) == pattern(len as usize, 32),
            "the READ landed in the memory mapped now"
        );
        let old_chunk = self.a.device_bytes(0, old_at, g as usize);
        let old_part = &pattern(len as usize, 31)[(g - offset) as usize..(2 * g - offset) as usize];
        assert!(
            old_chunk == old_part,
            "the old chunk kept what it held: nothing went through a stale MR"
        );
        drop((again, first, buf));
        Some(())
    }
}

/// The GPUs two engines of one host use in the peer-copy scenarios: 0 and
/// 1 where the driver has two or more, else 0 for both.
pub fn peer_copy_gpus<C: hal_cuda::Api>(cuda: &C::Driver) -> (u32, u32) {
    match cuda.device_count() {
        Ok(n) if n >= 2 => (0, 1),
        _ => (0, 0),
    }
}

/// The sum of a peer's queue pairs' posted work requests (the NIC's work).
pub fn posted(peer: &WorldPeer) -> u64 {
    peer.counters().iter().map(|(_, _, c)| c.posted).sum()
}

impl<V: Api, C: hal_cuda::Api> EngineWorld<V, C> {
    /// The peer-copy scenario: `len` bytes of a's GPU `gpus.0` memory
    /// WRITTEN into b's GPU `gpus.1` memory (granted read-write), then READ
    /// back into fresh memory of a's GPU in two transfers at an odd cut,
    /// both verified byte for byte; checks a's peer b takes `route`, the
    /// engine's peer-copy counters grew by exactly these two batches, and
    /// a's queue pairs posted nothing for them (the NIC moved no byte).
    pub fn peer_copy_round_trip(&self, gpus: (u32, u32), len: u64, seed: u8, route: PeerCopyRoute) {
        let t = self.timeout;
        let what = format!("{len} B GPU {} <-> GPU {}", gpus.0, gpus.1);
        assert_eq!(self.ab.route(), route, "{what}: the route");
        let (_s, src) = self.a.gpu_on(gpus.0, len, seed);
        let (dst_buf, dst) = self.b.gpu_on(gpus.1, len, 0);
        let (_g, remote) = self.b_grants(&dst, GrantRights::ReadWrite);
        let (back_buf, back) = self.a.gpu_on(gpus.0, len, 0);
        let stats = self.a.engine.peer_copy_stats();
        let nic_work = posted(&self.ab);
        self.ab
            .submit(&[Transfer::write(&src, 0, &remote, 0, len)])
            .unwrap()
            .wait(t)
            .unwrap_or_else(|e| panic!("{what}: WRITE: {e}"));
        assert!(
            self.b.bytes(&dst_buf) == pattern(len as usize, seed),
            "{what}: the WRITE's data"
        );
        let cut = (len / 2) | 1;
        let mut reads = vec![Transfer::read(&back, 0, &remote, 0, cut.min(len))];
        if cut < len {
            reads.push(Transfer::read(&back, cut, &remote, cut, len - cut));
        }
        self.ab
            .submit(&reads)
            .unwrap()
            .wait(t)
            .unwrap_or_else(|e| panic!("{what}: READ: {e}"));
        assert!(
            self.a.bytes(&back_buf) == pattern(len as usize, seed),
            "{what}: the READ's data"
        );
        let after = self.a.engine.peer_copy_stats();
        if route == PeerCopyRoute::Nic {
            assert_eq!(after.bytes, stats.bytes, "{what}: no peer copy");
            assert!(posted(&self.ab) > nic_work, "{what}: the NIC moved it");
        } else {
            assert_eq!(
                after.batches - stats.batches,
                2,
                "{what}: two peer-copy batches"
            );
            assert_eq!(after.bytes - stats.bytes, 2 * len, "{what}: their bytes");
            assert_eq!(posted(&self.ab), nic_work, "{what}: no NIC work request");
        }
    }
}

/// Host memory on a and b, b's granted to a ([`EngineWorld::host_pair`]).
/// Field order is drop order: the grant, then the regions, then the memory.
#[derive(Debug)]
pub struct HostPair {
    /// b's grant of `dst` to a.
    pub grant: WorldGrant,
    /// The descriptor a received for it.
    pub remote: MemoryDescriptor,
    /// a's region.
    pub src: Region,
    /// a's memory.
    pub src_buf: WorldBuffer,
    /// b's region.
    pub dst: Region,
    /// b's memory.
    pub dst_buf: WorldBuffer,
}

/// `granter` grants all of `region` to its peer, whose `grantee` waits up
/// to `timeout` for the announcement. Checks the peer sees exactly what was
/// granted, reaching the granter's every NIC (in these worlds a peer has
/// queue pairs on every NIC of its engine).
pub fn grant_to(
    granter: &WorldPeer,
    grantee: &WorldPeer,
    region: &Region,
    rights: GrantRights,
    timeout: Duration,
) -> (WorldGrant, MemoryDescriptor) {
    let grant = granter.grant(region, 0, region.len(), rights).unwrap();
    let seen = grantee
        .wait_grant(grant.descriptor().grant, timeout)
        .unwrap();
    assert_eq!(
        &seen,
        grant.descriptor(),
        "the peer sees exactly what was granted"
    );
    // A staging-rung region has no MR to name: its grant reaches no NIC.
    let reached = if region.rungs().contains(&gdr_core::ladder::Rung::Staging) {
        Vec::new()
    } else {
        granter.engine().nics()
    };
    assert_eq!(
        seen.devices().collect::<Vec<_>>(),
        reached,
        "the grant reaches every NIC (none when staged)"
    );
    (grant, seen)
}

/// Submits one WRITE of `len` bytes from `src` into `remote` after another
/// on `peer` until the submit is refused (a gone peer's way); each batch
/// accepted meanwhile may only fail as a gone peer fails, and nothing
/// hangs past `timeout`. Returns the refusal.
pub fn submit_until_gone(
    peer: &WorldPeer,
    src: &Region,
    remote: &MemoryDescriptor,
    timeout: Duration,
) -> EngineError {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match peer.submit(&[Transfer::write(src, 0, remote, 0, 4096)]) {
            Err(e) => return e,
            Ok(batch) => {
                if let Err(e) = batch.wait(timeout) {
                    assert!(
                        matches!(
                            e,
                            TransferError::PeerGone(_)
                                | TransferError::RetryExceeded { .. }
                                | TransferError::Flushed { .. }
                        ),
                        "{e}"
                    );
                }
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the peer was never given up"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

impl EngineWorld<SimVerbsApi> {
    /// Two nodes `a` and `b` of a fresh `SimFabric`, `nics` NICs (`sim0`,
    /// `sim1`, ...) and one simulated GPU configured as `gpu` each, engines
    /// configured as `config` ([`EngineWorld::sim_with`]).
    pub fn sim(nics: usize, gpu: GpuConfig, config: EngineConfig, timeout: Duration) -> Self {
        Self::sim_with(nics, config, timeout, |fabric| {
            SimCuda::new(vec![gpu.clone()], fabric.faults())
        })
    }
}

impl<C: hal_cuda::Api> EngineWorld<SimVerbsApi, C> {
    /// Two nodes `a` and `b` of a fresh `SimFabric`, `nics` NICs (`sim0`,
    /// `sim1`, ...) each and the GPU driver `cuda` makes for each (the real
    /// one, on a GPU machine), engines configured as `config`. b listens on
    /// every NIC; with one NIC a connects by the route to b's `sim0`, with
    /// more over one path per NIC pair (`simN` to `simN`), so the queue
    /// pairs spread over them.
    pub fn sim_with(
        nics: usize,
        config: EngineConfig,
        timeout: Duration,
        cuda: impl Fn(&SimFabric) -> C::Driver,
    ) -> Self
    where
        C::Driver: Clone,
    {
        Self::sim_sides(nics, (config.clone(), config), timeout, cuda)
    }

    /// [`EngineWorld::sim_with`] with a's engine configured as
    /// `configs.0` and b's as `configs.1` (`cuda` is called for a first).
    pub fn sim_sides(
        nics: usize,
        configs: (EngineConfig, EngineConfig),
        timeout: Duration,
        cuda: impl Fn(&SimFabric) -> C::Driver,
    ) -> Self
    where
        C::Driver: Clone,
    {
        init_tracing();
        let fabric = SimFabric::new();
        let side = |name: &str, config: EngineConfig| {
            let verbs = fabric.add_node(
                name,
                NodeConfig {
                    ipv4: None,
                    devices: vec![DeviceConfig::default(); nics],
                },
            );
            Side::new(verbs, cuda(&fabric), config)
        };
        let a = side("a", configs.0);
        let b = side("b", configs.1);
        let sim_cuda = |side: &Side<SimVerbsApi, C>| {
            (&side.cuda as &dyn std::any::Any)
                .downcast_ref::<SimCuda>()
                .cloned()
        };
        let released = ReleaseCheck {
            fabric: fabric.clone(),
            cudas: vec![sim_cuda(&a), sim_cuda(&b)],
            fence_pages: vec![Arc::clone(&a.fence_page), Arc::clone(&b.fence_page)],
        };
        let ip = |side: &Side<SimVerbsApi, C>, nic: &str| {
            IpAddr::V4(side.verbs.device_ipv4(nic).unwrap())
        };
        let names: Vec<String> = (0..nics).map(|i| format!("sim{i}")).collect();
        let paths: Vec<(Option<IpAddr>, IpAddr)> = if nics > 1 {
            names
                .iter()
                .map(|nic| (Some(ip(&a, nic)), ip(&b, nic)))
                .collect()
        } else {
            vec![(None, ip(&b, "sim0"))]
        };
        Self::connect(
            a,
            b,
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            |listening| {
                paths
                    .into_iter()
                    .map(|(source, peer)| Path {
                        source,
                        peer: SocketAddr::new(peer, listening.port()),
                    })
                    .collect()
            },
            timeout,
        )
        .with_release_check(released)
    }

    /// The fabric both nodes are on (its pause switch).
    pub fn fabric(&self) -> &SimFabric {
        self.a.verbs.fabric()
    }
}

impl EngineWorld<SimVerbsApi> {
    /// Drops the world (both engines, their peers and all they hold) and
    /// checks nothing is left: no MR, QP, CQ, listener, connection or
    /// connection request on the fabric, no device or pinned byte, host
    /// registration or stream in either process's simulated CUDA. The
    /// caller drops its own buffers, regions, grants and batches first.
    pub fn close_and_check_released(self) {
        let fabric = self.fabric().clone();
        let cudas = [self.a.cuda.clone(), self.b.cuda.clone()];
        drop(self);
        let left = fabric.resources();
        assert!(left.is_empty(), "the fabric kept {left:?}");
        for (side, cuda) in ["a", "b"].into_iter().zip(cudas) {
            let left = cuda.resources();
            assert!(left.is_empty(), "{side}'s simulated CUDA kept {left:?}");
        }
    }

    /// A third node `name` on the fabric (one NIC, one simulated GPU, an
    /// engine configured as `config`) connected to b: returns it, its end
    /// of the connection and b's. For b serving two peers at once.
    pub fn connect_another_to_b(
        &self,
        name: &str,
        config: EngineConfig,
    ) -> (Side<SimVerbsApi>, WorldPeer, WorldPeer) {
        let fabric = self.fabric();
        let verbs = fabric.add_node(
            name,
            NodeConfig {
                ipv4: None,
                devices: vec![DeviceConfig::default()],
            },
        );
        let cuda = SimCuda::new(vec![GpuConfig::default()], fabric.faults());
        let c = Side::new(verbs, cuda, config);
        let listener = self
            .b
            .engine
            .listen(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
            .unwrap();
        let ip = IpAddr::V4(self.b.verbs.device_ipv4("sim0").unwrap());
        let peer = SocketAddr::new(ip, listener.local_addr().port());
        let timeout = self.timeout;
        let (cb, bc) = std::thread::scope(|scope| {
            let accepting = scope.spawn(move || listener.accept(timeout));
            let path = Path { source: None, peer };
            let cb = c.engine.connect_paths(&[path], timeout).unwrap();
            (cb, accepting.join().unwrap().unwrap())
        });
        (c, cb, bc)
    }
}

/// A listener of `engine` (on the simulated node `node`) on a free port,
/// and the address a peer reaches it at (its first NIC's).
pub fn sim_listener(
    engine: &Engine,
    node: &gdr_sim::SimVerbs,
) -> (gdr_core::engine::Listener, SocketAddr) {
    let listener = engine
        .listen(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
        .unwrap();
    let addr = SocketAddr::new(
        IpAddr::V4(node.device_ipv4("sim0").unwrap()),
        listener.local_addr().port(),
    );
    (listener, addr)
}

/// Connects `engine` to `addr` while `listener` accepts: both ends.
pub fn connect_accepted(
    engine: &Engine,
    listener: &gdr_core::engine::Listener,
    addr: SocketAddr,
    timeout: Duration,
) -> (Peer, Peer) {
    std::thread::scope(|scope| {
        let accepting = scope.spawn(|| listener.accept(timeout));
        let connected = engine.connect(addr, timeout).unwrap();
        (connected, accepting.join().unwrap().unwrap())
    })
}

/// Fences `stream` on `batch`, then queues on it a copy of `out`'s length
/// from device address `gpu` into `out` and records `event` after it.
fn fence_then_copy_out(
    batch: &Batch,
    stream: &gdr_core::Stream,
    out: &Buffer,
    gpu: u64,
    event: &hal_cuda::dynamic::DynEvent,
) {
    batch.fence_stream(stream).unwrap();
    // SAFETY: `out` and the GPU range hold as many bytes, and outlive the
    // stream's work (the caller waits for `event` before either goes).
    unsafe { stream.copy_device_to_host(out.addr() as *mut u8, gpu, out.len() as usize) }.unwrap();
    stream.record(event).unwrap();
}

/// Where a stream fence waits for its batch ([`gdr_core::engine::Batch::fence_stream`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceWait {
    /// On the stream: the call returns at once and holds the stream (a
    /// batch on a NIC's direct rungs).
    Stream,
    /// On the host: the call returns once the batch has ended and holds
    /// nothing (a batch whose end needs CUDA calls, as a staged one).
    Host,
}

impl<C: hal_cuda::Api> EngineWorld<SimVerbsApi, C> {
    /// The stream-fence scenario: a READ of `len` bytes of b's host memory
    /// (holding `pattern(len, seed)`) into a's GPU memory, held on the
    /// paused fabric; a stream of a's GPU fenced on it (on another thread),
    /// then a copy of the GPU memory into pinned memory queued after the
    /// fence. Checks, while the batch is held, that the fence waits where
    /// `waits` says (the copy queued but not run, or the fence call not
    /// returned); then resumes the fabric, polls the copy's event (no
    /// thread waits on the batch: the engine's own progress, or the fence
    /// call, ends it) and checks the copy saw the data. Returns the batch
    /// (ended) and its stream and event, for more.
    pub fn fenced_copy_after_a_held_read(
        &self,
        len: u64,
        seed: u8,
        waits: FenceWait,
    ) -> (Batch, gdr_core::Stream, hal_cuda::dynamic::DynEvent) {
        use hal_cuda::Event as _;
        let (_s, src) = self.b.host(len, seed);
        let (_g, remote) = self.b_grants(&src, GrantRights::Read);
        let (gpu_buf, gpu_region) = self.a.alloc(Kind::Gpu, len, 0);
        let ctx = self.a.driver.context(0).unwrap();
        let stream = gdr_core::Stream::from_erased(0, ctx.create_stream().unwrap());
        let out = Buffer::alloc_pinned(&ctx, len).unwrap();
        let event = ctx.create_event().unwrap();
        self.fabric().set_paused(true);
        let batch = self
            .ab
            .submit(&[Transfer::read(&gpu_region, 0, &remote, 0, len)])
            .unwrap();
        let (queued_tx, queued) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            let fencing = scope.spawn(|| {
                fence_then_copy_out(&batch, &stream, &out, gpu_buf.addr(), &event);
                let _ = queued_tx.send(());
            });
            let held = Duration::from_millis(30);
            match waits {
                FenceWait::Stream => {
                    queued
                        .recv_timeout(self.timeout)
                        .expect("the fence returned at once");
                    std::thread::sleep(held);
                    assert!(
                        !event.is_complete().unwrap(),
                        "the copy after the fence ran before the batch ended (batch status now {:?})",
                        batch.status()
                    );
                }
                FenceWait::Host => assert!(
                    queued.recv_timeout(held).is_err(),
                    "the fence returned before the batch ended (batch status now {:?})",
                    batch.status()
                ),
            }
            self.fabric().set_paused(false);
            fencing.join().unwrap();
        });
        let start = std::time::Instant::now();
        while !event.is_complete().unwrap() {
            assert!(start.elapsed() < self.timeout, "the stream never moved on");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            out.to_vec().unwrap() == pattern(len as usize, seed),
            "the copy after the fence saw the data"
        );
        (batch, stream, event)
    }
}

impl<C: hal_cuda::Api> EngineWorld<SimVerbsApi, C> {
    /// Two engines' GPU tests of one process hung on the H200 so (issue
    /// 33 item 14): a stream fenced on a staged READ that the paused
    /// fabric holds, and another thread freeing pinned memory meanwhile.
    /// On the real driver (and on the simulated one, which behaves alike)
    /// a free waits for every stream, a held one included, holding the
    /// driver's lock, and the staged READ's copies wait behind that lock:
    /// had the fence held the stream, neither would ever end. The fence of
    /// a staged batch waits on the host instead ([`FenceWait::Host`]), so
    /// the free returns while the batch is held, the fence returns once it
    /// ended, and the copy queued after the fence sees the data. A
    /// deadlock aborts the test binary with a message (the stuck threads
    /// cannot be unwound).
    pub fn fenced_read_while_another_thread_frees(&self, len: u64, seed: u8) {
        use hal_cuda::Event as _;
        use std::io::Write as _;
        let (_s, src) = self.b.host(len, seed);
        let (_g, remote) = self.b_grants(&src, GrantRights::Read);
        let (gpu_buf, gpu_region) = self.a.alloc(Kind::Gpu, len, 0);
        let read = [Transfer::read(&gpu_region, 0, &remote, 0, len)];
        // Other bytes through first: the staging pool exists, as in an
        // engine at work (its making is not what is tested).
        let (_w, warm_src) = self.b.host(len, seed.wrapping_add(1));
        let (_wg, warm) = self.b_grants(&warm_src, GrantRights::Read);
        self.ab
            .submit(&[Transfer::read(&gpu_region, 0, &warm, 0, len)])
            .unwrap()
            .wait(self.timeout)
            .unwrap();
        let ctx = self.a.driver.context(0).unwrap();
        let stream = gdr_core::Stream::from_erased(0, ctx.create_stream().unwrap());
        let out = Buffer::alloc_pinned(&ctx, len).unwrap();
        let freed_meanwhile = Buffer::alloc_pinned(&ctx, 4096).unwrap();
        let event = ctx.create_event().unwrap();
        let deadlocked = |what: &str| -> ! {
            // Straight to fd 2 (the harness captures only the print macros).
            let _ = writeln!(
                std::io::stderr(),
                "DEADLOCK: {what} within {:?}: a free waited for the fenced stream \
                 while the fence waited for the engine's progress",
                self.timeout,
            );
            std::process::abort()
        };
        self.fabric().set_paused(true);
        let batch = self.ab.submit(&read).unwrap();
        std::thread::scope(|scope| {
            let fencing = scope.spawn(|| {
                fence_then_copy_out(&batch, &stream, &out, gpu_buf.addr(), &event);
            });
            // The fence is under way (or, held on the stream, queued).
            std::thread::sleep(Duration::from_millis(50));
            let (freed_tx, freed) = std::sync::mpsc::channel();
            let freeing = scope.spawn(move || {
                drop(freed_meanwhile);
                let _ = freed_tx.send(());
            });
            // The free is under way while the batch is held.
            std::thread::sleep(Duration::from_millis(50));
            self.fabric().set_paused(false);
            if freed.recv_timeout(self.timeout).is_err() {
                deadlocked("the free did not return");
            }
            freeing.join().unwrap();
            let start = std::time::Instant::now();
            while !fencing.is_finished() {
                if start.elapsed() > self.timeout {
                    deadlocked("the fence and the copy after it were not queued");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            fencing.join().unwrap();
        });
        let start = std::time::Instant::now();
        while !event.is_complete().unwrap() {
            if start.elapsed() > self.timeout {
                deadlocked("the fenced stream did not move on");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(batch.status(), Some(Ok(())));
        assert!(
            out.to_vec().unwrap() == pattern(len as usize, seed),
            "the copy after the fence saw the data"
        );
    }
}

impl<C: hal_cuda::Api> EngineWorld<SimVerbsApi, C> {
    /// One engine, two paths, a free between them (issue 33 item 14): a
    /// stream fenced on a READ of host memory (a direct rung: its fence
    /// holds the stream until progress stores the word), held on the
    /// paused fabric; another thread frees pinned memory, which waits for
    /// that stream holding the driver's lock; then a WRITE of a's staged
    /// GPU memory is submitted, whose staging copy waits behind that lock.
    /// Were the copy made by progress (or by the submit, under the
    /// engine's lock), progress could not store the fence's word once the
    /// READ ended, and neither the free nor anything else would end; the
    /// CUDA worker makes it instead. Checks that, once the fabric resumes,
    /// the free returns, the fenced stream moves on, and both batches end
    /// with their data. A deadlock aborts the binary with a message.
    pub fn direct_fence_while_a_free_and_a_staged_write_wait(&self, len: u64, seed: u8) {
        use hal_cuda::Event as _;
        use std::io::Write as _;
        let deadlocked = |what: &str| -> ! {
            let _ = writeln!(
                std::io::stderr(),
                "DEADLOCK: {what} within {:?}: a free waited for the fenced stream, \
                 the fence for the engine's progress, progress for a staging copy",
                self.timeout,
            );
            std::process::abort()
        };
        let wait_for = |done: &std::sync::mpsc::Receiver<()>, what: &str| {
            if done.recv_timeout(self.timeout).is_err() {
                deadlocked(what);
            }
        };
        // The READ into host memory: fenced on the stream.
        let (_s, src) = self.b.host(len, seed);
        let (_g, remote_src) = self.b_grants(&src, GrantRights::Read);
        let (host_buf, host_dst) = self.a.host(len, 0);
        // The WRITE of staged GPU memory.
        let (_gpu_buf, gpu_src) = self.a.alloc(Kind::Gpu, len, seed.wrapping_add(1));
        let (dst_buf, dst) = self.b.host(len, 0);
        let (_dg, remote_dst) = self.b_grants(&dst, GrantRights::Write);
        // Bytes through first: the staging pool exists, as in an engine at
        // work (its making is not what is tested).
        self.ab
            .submit(&[Transfer::write(&gpu_src, 0, &remote_dst, 0, len)])
            .unwrap()
            .wait(self.timeout)
            .unwrap();
        let ctx = self.a.driver.context(0).unwrap();
        let stream = gdr_core::Stream::from_erased(0, ctx.create_stream().unwrap());
        let event = ctx.create_event().unwrap();
        let freed_meanwhile = Buffer::alloc_pinned(&ctx, 4096).unwrap();
        self.fabric().set_paused(true);
        let read = self
            .ab
            .submit(&[Transfer::read(&host_dst, 0, &remote_src, 0, len)])
            .unwrap();
        read.fence_stream(&stream).unwrap();
        stream.record(&event).unwrap();
        std::thread::scope(|scope| {
            let (freed_tx, freed) = std::sync::mpsc::channel();
            scope.spawn(move || {
                drop(freed_meanwhile);
                let _ = freed_tx.send(());
            });
            // The free waits for the fenced stream, holding the lock.
            std::thread::sleep(Duration::from_millis(50));
            let (written_tx, written) = std::sync::mpsc::channel();
            let write = scope.spawn(move || {
                let outcome = self
                    .ab
                    .submit(&[Transfer::write(&gpu_src, 0, &remote_dst, 0, len)])
                    .unwrap()
                    .wait(self.timeout);
                let _ = written_tx.send(());
                outcome
            });
            // The WRITE's first copy waits behind the free.
            std::thread::sleep(Duration::from_millis(50));
            self.fabric().set_paused(false);
            wait_for(&freed, "the free did not return");
            wait_for(&written, "the staged WRITE did not end");
            assert_eq!(write.join().unwrap(), Ok(()), "the staged WRITE");
        });
        let start = std::time::Instant::now();
        while !event.is_complete().unwrap() {
            if start.elapsed() > self.timeout {
                deadlocked("the fenced stream did not move on");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(read.status(), Some(Ok(())));
        assert!(
            self.a.bytes(&host_buf) == pattern(len as usize, seed),
            "the READ's data"
        );
        assert!(
            self.b.bytes(&dst_buf) == pattern(len as usize, seed.wrapping_add(1)),
            "the WRITE's data"
        );
    }
}

/// A stream of a GPU held by a value wait on a pinned word the test owns:
/// nothing queued on it after the hold runs until [`HeldStream::release`].
/// Dropping it releases the stream and waits for what it holds to run
/// (the word must outlive the stream's wait).
#[derive(Debug)]
pub struct HeldStream {
    /// The stream.
    pub stream: gdr_core::Stream,
    word: Buffer,
    /// The value the last hold waits for.
    held: std::sync::atomic::AtomicU32,
}

impl HeldStream {
    /// A new stream of `ctx`, held.
    pub fn new(ctx: &hal_cuda::dynamic::DynContext) -> Self {
        let word = Buffer::alloc_pinned(ctx, 4096).unwrap();
        word.write_at(0, &[0; 4]).unwrap();
        let held = Self {
            stream: gdr_core::Stream::from_erased(0, ctx.create_stream().unwrap()),
            word,
            held: Default::default(),
        };
        held.hold();
        held
    }

    fn word(&self) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: the word is this stream's own pinned page (page aligned),
        // alive as long as `self`; host and device touch it only with
        // aligned 32-bit atomic accesses.
        unsafe { &*(self.word.addr() as *const std::sync::atomic::AtomicU32) }
    }

    /// Holds the stream again: work queued from now on waits for the next
    /// [`HeldStream::release`].
    pub fn hold(&self) {
        let value = self.held.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        // SAFETY: the word is 4-byte aligned pinned memory of the stream's
        // driver, alive until the stream drained (Drop).
        unsafe { self.stream.wait_value32(self.word.addr(), value) }.unwrap();
    }

    /// Lets the stream run past its last hold.
    pub fn release(&self) {
        let value = self.held.load(std::sync::atomic::Ordering::SeqCst);
        self.word()
            .store(value, std::sync::atomic::Ordering::Release);
    }
}

impl Drop for HeldStream {
    fn drop(&mut self) {
        self.release();
        // The word is freed next: the stream's wait must be behind it (a
        // failed stream's error is of no use here).
        let _ = self.stream.synchronize();
    }
}

/// The gate scenario's memory ([`EngineWorld::gated_write`]): a's GPU
/// buffer, which a copy queued on the held stream fills with
/// `pattern(len, seed)` (it held other bytes before), and b's host memory
/// granted to a, holding other bytes still.
/// Field order is drop order: the stream before the memory it copies.
#[derive(Debug)]
pub struct GatedWrite {
    /// The stream the gate is queued on, held, the copy queued on it.
    pub held: HeldStream,
    /// b's grant of `dst`.
    pub grant: WorldGrant,
    /// The descriptor a received for it.
    pub remote: MemoryDescriptor,
    /// b's memory the batch WRITEs into.
    pub dst: WorldBuffer,
    /// a's GPU region the batch WRITEs from.
    pub gpu_region: Region,
    _gpu: WorldBuffer,
    _staged: WorldBuffer,
    len: u64,
    seed: u8,
}

impl GatedWrite {
    /// The WRITE of all of a's GPU buffer into b's memory.
    pub fn transfer(&self) -> Transfer<'_> {
        Transfer::write(&self.gpu_region, 0, &self.remote, 0, self.len)
    }

    /// Submits the WRITE gated on the held stream, bounded by `timeout`.
    pub fn submit<C: hal_cuda::Api>(
        &self,
        w: &EngineWorld<SimVerbsApi, C>,
        timeout: Duration,
    ) -> Batch {
        w.ab.submit_after_stream(&self.held.stream, &[self.transfer()], Some(timeout))
            .unwrap()
    }

    /// Whether b's memory holds what the stream copied in before the gate.
    pub fn moved<C: hal_cuda::Api>(&self, w: &EngineWorld<SimVerbsApi, C>) -> bool {
        w.b.bytes(&self.dst) == pattern(self.len as usize, self.seed)
    }

    /// Drives both engines' progress `rounds` times (a millisecond apart)
    /// and checks b's memory is as it was: nothing of the batch moved.
    pub fn assert_nothing_moved<C: hal_cuda::Api>(
        &self,
        w: &EngineWorld<SimVerbsApi, C>,
        rounds: u32,
        what: &str,
    ) {
        for _ in 0..rounds {
            w.a.engine.progress();
            w.b.engine.progress();
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            w.b.bytes(&self.dst) == pattern(self.len as usize, self.seed.wrapping_add(2)),
            "{what}: b's memory changed"
        );
    }
}

impl<C: hal_cuda::Api> EngineWorld<SimVerbsApi, C> {
    /// The gate scenario's memory and held stream ([`GatedWrite`]): b's
    /// host memory (`pattern(len, seed + 2)`) granted to a for WRITEs, a's
    /// GPU memory (`pattern(len, seed + 1)`), and a held stream of a's GPU
    /// with a copy of `pattern(len, seed)` from pinned memory into the GPU
    /// memory queued on it.
    pub fn gated_write(&self, len: u64, seed: u8) -> GatedWrite {
        let (dst, dst_region) = self.b.host(len, seed.wrapping_add(2));
        let (grant, remote) = self.b_grants(&dst_region, GrantRights::Write);
        let (gpu, gpu_region) = self.a.alloc(Kind::Gpu, len, seed.wrapping_add(1));
        let ctx = self.a.driver.context(0).unwrap();
        let staged = Buffer::alloc_pinned(&ctx, len).unwrap();
        staged.write_at(0, &pattern(len as usize, seed)).unwrap();
        let held = HeldStream::new(&ctx);
        // SAFETY: both ranges hold `len` bytes and outlive the stream's
        // work (the stream is dropped, and drained, first).
        unsafe {
            held.stream
                .copy_host_to_device(gpu.addr(), staged.addr() as *const u8, len as usize)
        }
        .unwrap();
        GatedWrite {
            held,
            grant,
            remote,
            dst,
            gpu_region,
            _gpu: gpu,
            _staged: staged,
            len,
            seed,
        }
    }

    /// The gate scenario: a WRITE of a's GPU memory into b's, gated on a
    /// held stream that first copies new bytes into the GPU memory. Checks
    /// nothing moves while the stream is held (progress driven), then
    /// releases the stream and checks the batch ends and b holds the bytes
    /// the stream copied in before the gate: the batch started after the
    /// stream's work, not before. Nobody waits on the stream; the engine's
    /// own progress opens the gate.
    pub fn gated_write_after_a_held_stream(&self, len: u64, seed: u8) {
        let g = self.gated_write(len, seed);
        let batch = g.submit(self, self.timeout);
        g.assert_nothing_moved(self, 30, "while the stream is held");
        assert_eq!(batch.status(), None, "the batch ended before its gate");
        g.held.release();
        let start = std::time::Instant::now();
        while batch.cell().outcome().is_none() {
            assert!(start.elapsed() < self.timeout, "the gate never opened");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(batch.wait(self.timeout), Ok(()));
        assert!(
            g.moved(self),
            "the batch did not move what the stream copied in before the gate"
        );
    }
}

impl EngineWorld<SimVerbsApi> {
    /// Pauses the fabric (nothing moves until it is resumed) and submits a
    /// WRITE of the first 4 KiB of `h` that must end within `deadline`: a
    /// batch that can only end by its deadline.
    pub fn stalled_write(&self, h: &HostPair, deadline: Duration) -> Batch {
        self.fabric().set_paused(true);
        self.ab
            .submit_with_timeout(&[Transfer::write(&h.src, 0, &h.remote, 0, 4096)], deadline)
            .unwrap()
    }
}

impl EngineWorld<RdmaApi> {
    /// Two engines on SoftRoCE's `rxe0` ([`rxe::device_name`]), each with a
    /// simulated GPU whose memory is host-visible and registers through
    /// peermem (the stand-in for memory nvidia-peermem pinned), configured
    /// as `config` but on that device only, with `timeout` as the default
    /// one; b listens on rxe0's address ([`rxe::expected_ip`]: rdma_cm
    /// cannot use 127.0.0.1 there). `None` after printing why `test` skips
    /// ([`rxe::open_rxe`]).
    pub fn rxe(test: &str, config: EngineConfig, timeout: Duration) -> Option<Self> {
        let (provider, _ctx) = rxe::open_rxe(test)?;
        let config = config
            .with_devices([rxe::device_name()])
            .with_default_timeout(timeout);
        let side = |provider: RdmaProvider| {
            let cuda = SimCuda::new(
                vec![GpuConfig {
                    host_visible: true,
                    peermem: true,
                    ..GpuConfig::default()
                }],
                FaultPlan::new(),
            );
            let side = Side::<RdmaApi>::new(provider, cuda, config.clone());
            assert_eq!(side.engine.nics(), [rxe::device_name()]);
            side
        };
        let a = side(provider.clone());
        let b = side(provider);
        Some(Self::connect(
            a,
            b,
            rxe::expected_ip(),
            |addr| {
                vec![Path {
                    source: None,
                    peer: addr,
                }]
            },
            timeout,
        ))
    }
}

/// Two engines on two nodes of a fresh simulator (one NIC each, no GPU, no
/// tracing subscriber: what the benchmarks measure), a connected to b, and
/// `len` bytes of b's host memory granted read-write to a, which holds as
/// much host memory registered as `local` ([`sim_host_peers`]). Field
/// order is drop order.
#[derive(Debug)]
pub struct HostPeers {
    /// The fabric both nodes are on.
    pub fabric: SimFabric,
    /// The connecting engine.
    pub a: Engine,
    /// The listening engine.
    pub b: Engine,
    /// a's peer b.
    pub a_to_b: Peer,
    /// b's peer a.
    pub b_to_a: Peer,
    /// a's memory and b's.
    pub buffers: (Buffer, Buffer),
    /// a's region of its memory.
    pub local: Region,
    /// b's grant of its memory to a.
    pub grant: Grant,
    /// The grant as a received it.
    pub remote: MemoryDescriptor,
}

/// [`HostPeers`] with both engines configured as `config`; connecting and
/// waiting for the grant may take `timeout` each.
pub fn sim_host_peers(config: EngineConfig, len: u64, timeout: Duration) -> HostPeers {
    let fabric = SimFabric::new();
    let node = |name: &str| {
        fabric.add_node(
            name,
            NodeConfig {
                ipv4: None,
                devices: vec![DeviceConfig::default()],
            },
        )
    };
    let (va, vb) = (node("a"), node("b"));
    let b_ip = vb.device_ipv4("sim0").expect("b's IP");
    let (va, vb) = (va.erased(), vb.erased());
    let a = Engine::new(&va, None, config.clone()).expect("engine a");
    let b = Engine::new(&vb, None, config).expect("engine b");
    let listener = b
        .listen(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
        .expect("listen");
    let port = listener.local_addr().port();
    let accepting = std::thread::spawn(move || listener.accept(timeout));
    let path = Path {
        source: None,
        peer: SocketAddr::new(IpAddr::V4(b_ip), port),
    };
    let a_to_b = a.connect_paths(&[path], timeout).expect("connect");
    let b_to_a = accepting.join().expect("accept thread").expect("accept");
    let src = Buffer::alloc_host(len);
    let dst = Buffer::alloc_host(len);
    let local = a.register_buffer(&src).expect("register a");
    let region_b = b.register_buffer(&dst).expect("register b");
    let grant = b_to_a
        .grant(&region_b, 0, len, GrantRights::ReadWrite)
        .expect("grant");
    let remote = a_to_b
        .wait_grant(grant.descriptor().grant, timeout)
        .expect("grant seen");
    HostPeers {
        fabric,
        a,
        b,
        a_to_b,
        b_to_a,
        buffers: (src, dst),
        local,
        grant,
        remote,
    }
}
