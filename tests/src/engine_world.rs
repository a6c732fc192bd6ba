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
use std::time::Duration;

use gdr_core::buffer::Buffer;
use gdr_core::descriptor::{GrantRights, MemoryDescriptor};
use gdr_core::engine::{
    Batch, Engine, EngineConfig, EngineError, Path, Peer, Region, RegionGrant, Transfer,
    TransferError,
};
use gdr_core::ladder::Rung;
use gdr_sim::{
    DeviceConfig, FaultPlan, GpuConfig, NodeConfig, SimCuda, SimCudaApi, SimFabric, SimVerbsApi,
};
use hal_cuda::{Context as _, Driver as _, Stream as _};
use hal_verbs::Api;
use hal_verbs::rdma::{RdmaApi, RdmaProvider};

use crate::{init_tracing, pattern, rxe};

/// An engine over verbs backend `V`, for the memory of CUDA backend `C`
/// (the simulated GPU unless said otherwise).
pub type WorldEngine<V, C = SimCudaApi> = Engine<V, C>;
/// One end of a connection between two engines.
pub type WorldPeer<V, C = SimCudaApi> = Peer<V, C>;
/// A grant of a region to a peer (revoked when dropped).
pub type WorldGrant<V, C = SimCudaApi> = RegionGrant<V, C>;
/// A buffer of the GPU's driver (host, pinned or device memory).
pub type WorldBuffer<C = SimCudaApi> = Buffer<C>;

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
    /// The engine.
    pub engine: WorldEngine<V, C>,
}

impl<V: Api, C: hal_cuda::Api> Side<V, C> {
    /// An engine on `verbs` (the NICs `config` names, or all) and `cuda`.
    pub fn new(verbs: V::Provider, cuda: C::Driver, config: EngineConfig) -> Self {
        let engine = WorldEngine::<V, C>::new(&verbs, Some(&cuda), config.clone())
            .unwrap_or_else(|e| panic!("an engine on {:?}: {e}", config.devices));
        Self {
            verbs,
            cuda,
            engine,
        }
    }

    /// `len` bytes of host memory holding `pattern(len, seed)`, registered
    /// (on the host-memory rung of every NIC).
    pub fn host(&self, len: u64, seed: u8) -> (WorldBuffer<C>, Region<V>) {
        let buffer = Buffer::alloc_host(len);
        buffer
            .write_at(0, &pattern(len as usize, seed))
            .expect("host memory is CPU-writable");
        let region = self.engine.register(&buffer).unwrap();
        let nics = self.engine.nics().len();
        assert_eq!(region.rungs(), vec![Rung::HostMemory; nics], "one per NIC");
        (buffer, region)
    }

    /// `len` bytes of pinned host memory holding `pattern(len, seed)`,
    /// registered.
    pub fn pinned(&self, len: u64, seed: u8) -> (WorldBuffer<C>, Region<V>) {
        let ctx = self.cuda.context(0).unwrap();
        let buffer = Buffer::alloc_pinned(&ctx, len).unwrap();
        buffer.write_at(0, &pattern(len as usize, seed)).unwrap();
        let region = self.engine.register(&buffer).unwrap();
        (buffer, region)
    }

    /// `len` bytes of GPU memory holding `pattern(len, seed)` (copied in
    /// on a stream), registered on whichever rung the ladder takes.
    pub fn gpu(&self, len: u64, seed: u8) -> (WorldBuffer<C>, Region<V>) {
        let ctx = self.cuda.context(0).unwrap();
        let buffer = Buffer::alloc_device(&ctx, len).unwrap();
        let data = pattern(len as usize, seed);
        let stream = ctx.create_stream().unwrap();
        // SAFETY: the device allocation holds `len` bytes, as does `data`,
        // and the stream is synchronised before `data` goes.
        unsafe { stream.copy_host_to_device(buffer.addr(), data.as_ptr(), data.len()) }.unwrap();
        stream.synchronize().unwrap();
        let region = self.engine.register(&buffer).unwrap();
        (buffer, region)
    }

    /// `len` bytes of `kind` holding `pattern(len, seed)`, registered.
    pub fn alloc(&self, kind: Kind, len: u64, seed: u8) -> (WorldBuffer<C>, Region<V>) {
        match kind {
            Kind::Host => self.host(len, seed),
            Kind::Pinned => self.pinned(len, seed),
            Kind::Gpu => self.gpu(len, seed),
        }
    }

    /// The buffer's bytes: host memory read directly, device memory
    /// through a stream copy.
    pub fn bytes(&self, buffer: &WorldBuffer<C>) -> Vec<u8> {
        if buffer.memory_type() != hal_cuda::MemoryType::Device {
            return buffer.to_vec().expect("host memory is CPU-readable");
        }
        let ctx = self.cuda.context(0).unwrap();
        let mut out = vec![0; buffer.len() as usize];
        let stream = ctx.create_stream().unwrap();
        // SAFETY: `out` holds the buffer's length, and the stream is
        // synchronised before `out` is read.
        unsafe { stream.copy_device_to_host(out.as_mut_ptr(), buffer.addr(), out.len()) }.unwrap();
        stream.synchronize().unwrap();
        out
    }
}

/// Two engines, a connected to b: `ab` is a's peer b, `ba` b's peer a.
#[derive(Debug)]
pub struct EngineWorld<V: Api, C: hal_cuda::Api = SimCudaApi> {
    /// a's end of the connection (its peer is b).
    pub ab: WorldPeer<V, C>,
    /// b's end of the connection (its peer is a).
    pub ba: WorldPeer<V, C>,
    /// The connecting side.
    pub a: Side<V, C>,
    /// The listening side.
    pub b: Side<V, C>,
    /// How long connecting and waiting for a grant may take.
    pub timeout: Duration,
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
        let mut listener = b
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
        }
    }

    /// b grants all of `region` to a, which waits for the announcement
    /// (see [`grant_to`]).
    pub fn b_grants(
        &self,
        region: &Region<V>,
        rights: GrantRights,
    ) -> (WorldGrant<V, C>, MemoryDescriptor) {
        grant_to(&self.ba, &self.ab, region, rights, self.timeout)
    }

    /// `len` bytes of host memory on each side, a's holding
    /// `pattern(len, seed)` and b's `pattern(len, 0)`, b's granted to a with
    /// `rights`: what most transfers go between.
    pub fn host_pair(&self, len: u64, seed: u8, rights: GrantRights) -> HostPair<V, C> {
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

/// Host memory on a and b, b's granted to a ([`EngineWorld::host_pair`]).
/// Field order is drop order: the grant, then the regions, then the memory.
#[derive(Debug)]
pub struct HostPair<V: Api, C: hal_cuda::Api = SimCudaApi> {
    /// b's grant of `dst` to a.
    pub grant: WorldGrant<V, C>,
    /// The descriptor a received for it.
    pub remote: MemoryDescriptor,
    /// a's region.
    pub src: Region<V>,
    /// a's memory.
    pub src_buf: WorldBuffer<C>,
    /// b's region.
    pub dst: Region<V>,
    /// b's memory.
    pub dst_buf: WorldBuffer<C>,
}

/// `granter` grants all of `region` to its peer, whose `grantee` waits up
/// to `timeout` for the announcement. Checks the peer sees exactly what was
/// granted, reaching the granter's every NIC (in these worlds a peer has
/// queue pairs on every NIC of its engine).
pub fn grant_to<V: Api, C: hal_cuda::Api>(
    granter: &WorldPeer<V, C>,
    grantee: &WorldPeer<V, C>,
    region: &Region<V>,
    rights: GrantRights,
    timeout: Duration,
) -> (WorldGrant<V, C>, MemoryDescriptor) {
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
pub fn submit_until_gone<V: Api, C: hal_cuda::Api>(
    peer: &WorldPeer<V, C>,
    src: &Region<V>,
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
                            TransferError::PeerGone { .. }
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
    ) -> Self {
        init_tracing();
        let fabric = SimFabric::new();
        let side = |name: &str| {
            let verbs = fabric.add_node(
                name,
                NodeConfig {
                    ipv4: None,
                    devices: vec![DeviceConfig::default(); nics],
                },
            );
            Side::new(verbs, cuda(&fabric), config.clone())
        };
        let a = side("a");
        let b = side("b");
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
    }

    /// The fabric both nodes are on (its pause switch).
    pub fn fabric(&self) -> &SimFabric {
        self.a.verbs.fabric()
    }
}

impl EngineWorld<SimVerbsApi> {
    /// A third node `name` on the fabric (one NIC, one simulated GPU, an
    /// engine configured as `config`) connected to b: returns it, its end
    /// of the connection and b's. For b serving two peers at once.
    pub fn connect_another_to_b(
        &self,
        name: &str,
        config: EngineConfig,
    ) -> (
        Side<SimVerbsApi>,
        WorldPeer<SimVerbsApi>,
        WorldPeer<SimVerbsApi>,
    ) {
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
        let mut listener = self
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

impl<C: hal_cuda::Api> EngineWorld<SimVerbsApi, C> {
    /// The stream-fence scenario: a READ of `len` bytes of b's host memory
    /// (holding `pattern(len, seed)`) into a's GPU memory, held on the
    /// paused fabric; a stream of a's GPU fenced on it, and a copy of the
    /// GPU memory into pinned memory queued after the fence. Checks that
    /// the copy does not run while the batch is held; then resumes the
    /// fabric, polls the copy's event (no thread waits on the batch: the
    /// engine's own progress ends it) and checks the copy saw the data.
    /// Returns the batch (ended) and its stream and event, for more.
    pub fn fenced_copy_after_a_held_read(
        &self,
        len: u64,
        seed: u8,
    ) -> (Batch<SimVerbsApi, C>, C::Stream, C::Event) {
        use hal_cuda::Event as _;
        let (_s, src) = self.b.host(len, seed);
        let (_g, remote) = self.b_grants(&src, GrantRights::Read);
        let (gpu_buf, gpu_region) = self.a.alloc(Kind::Gpu, len, 0);
        let ctx = self.a.cuda.context(0).unwrap();
        let stream = ctx.create_stream().unwrap();
        let out = Buffer::<C>::alloc_pinned(&ctx, len).unwrap();
        let event = ctx.create_event().unwrap();
        self.fabric().set_paused(true);
        let batch = self
            .ab
            .submit(&[Transfer::read(&gpu_region, 0, &remote, 0, len)])
            .unwrap();
        batch.fence_stream(&stream).unwrap();
        // SAFETY: both ranges hold `len` bytes and outlive the stream's
        // work (its event is waited for below).
        unsafe { stream.copy_device_to_host(out.addr() as *mut u8, gpu_buf.addr(), len as usize) }
            .unwrap();
        stream.record(&event).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            !event.is_complete().unwrap(),
            "the copy after the fence ran before the batch ended"
        );
        self.fabric().set_paused(false);
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

impl EngineWorld<SimVerbsApi> {
    /// Pauses the fabric (nothing moves until it is resumed) and submits a
    /// WRITE of the first 4 KiB of `h` that must end within `deadline`: a
    /// batch that can only end by its deadline.
    pub fn stalled_write(
        &self,
        h: &HostPair<SimVerbsApi>,
        deadline: Duration,
    ) -> Batch<SimVerbsApi, SimCudaApi> {
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
        let config = EngineConfig {
            devices: Some(vec![rxe::device_name()]),
            default_timeout: timeout,
            ..config
        };
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
