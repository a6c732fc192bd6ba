//! The public types (`gdr_core::{Context, Engine, Buffer, ...}`) on the
//! sim: two contexts of this process's simulated fabric, host and GPU
//! memory moved both ways and checked through the safe copies, and each
//! refusal of the context and engine themselves (objects of another
//! context or engine, a buffer a stream copy still holds, a spent handle,
//! ranges and sizes).

use std::time::Duration;

use gdr_core::buffer::BufferAccessError;
use gdr_core::engine::{ReadOnlyUse, Refusal};
use gdr_core::{
    Access, BackendChoice, Buffer, Context, Engine, EngineConfig, Error, GrantRights, MemoryKind,
    Peer, Transfer, TransferError,
};

const WAIT: Duration = Duration::from_secs(10);

/// Two engines of two sim contexts, connected: (listening side, its peer
/// object, connecting side, its peer object, the server's context, the
/// client's).
fn pair() -> (Engine, Peer, Engine, Peer, Context, Context) {
    let server_context = Context::open(BackendChoice::Sim).expect("server context");
    let server = server_context
        .engine(EngineConfig::default())
        .expect("server engine");
    let client_context = Context::open(BackendChoice::Sim).expect("client context");
    let client = client_context
        .engine(EngineConfig::default())
        .expect("client engine");
    let (to_client, to_server) = connect(&server, &client);
    (
        server,
        to_client,
        client,
        to_server,
        server_context,
        client_context,
    )
}

/// Connects `client` to `server` listening on its first NIC: (the
/// server's peer object, the client's).
fn connect(server: &Engine, client: &Engine) -> (Peer, Peer) {
    let nic = server.nics()[0].clone();
    let ip = server.nic_address(&nic).expect("the sim NIC's address");
    let listener = server.listen((ip, 0).into()).expect("listen");
    let addr = listener.local_addr();
    let accepting = std::thread::spawn(move || listener.accept(WAIT));
    let to_server = client.connect(addr, WAIT).expect("connect");
    let to_client = accepting.join().expect("accept thread").expect("accept");
    (to_client, to_server)
}

/// A pair with 4 KiB of the server's host memory granted for WRITE to the
/// client, and 4 KiB of the client's filled with `fill`, registered.
struct WriteWorld {
    server: Engine,
    client: Engine,
    to_server: Peer,
    target: Buffer,
    grant: gdr_core::Grant,
    remote: gdr_core::MemoryDescriptor,
    local: gdr_core::Region,
}

impl WriteWorld {
    fn new(fill: u8) -> Self {
        let (server, to_client, client, to_server, server_context, client_context) = pair();
        let target = server_context.alloc_host(4096).expect("memory");
        let region = server.register(&target).expect("register");
        let grant = to_client
            .grant(&region, 0, 4096, GrantRights::Write)
            .expect("grant");
        let remote = to_server.wait_grant(grant.id(), WAIT).expect("announced");
        let source = client_context.alloc_host(4096).expect("memory");
        source.copy_from_host(0, &[fill; 4096]).expect("copy in");
        let local = client.register(&source).expect("register");
        Self {
            server,
            client,
            to_server,
            target,
            grant,
            remote,
            local,
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn host_and_gpu_memory_move_both_ways_through_the_facade() {
    let (server, to_client, client, to_server, server_context, client_context) = pair();
    let gpu = server_context.alloc_device(0, 1 << 16).expect("GPU memory");
    assert_eq!(gpu.kind(), MemoryKind::Device);
    gpu.copy_from_host(0, &pattern(1 << 16, 1))
        .expect("copy in");
    let granted = server.register(&gpu).expect("register");
    let grant = to_client
        .grant(&granted, 0, 1 << 16, GrantRights::ReadWrite)
        .expect("grant");
    let remote = to_server.wait_grant(grant.id(), WAIT).expect("announced");

    let host = client_context.alloc_host(1 << 16).expect("host memory");
    let local = client.register(&host).expect("register");
    to_server
        .read(&local, &remote, 0)
        .expect("submit")
        .wait(WAIT)
        .expect("READ");
    assert_eq!(host.to_vec().expect("host bytes"), pattern(1 << 16, 1));

    host.copy_from_host(0, &pattern(1 << 16, 2))
        .expect("copy in");
    let batch = to_server
        .submit(&[
            Transfer::write(&local, 0, &remote, 4096, 4096),
            Transfer::write(&local, 8192, &remote, 0, 100),
        ])
        .expect("submit");
    batch.wait(WAIT).expect("WRITEs");
    let mut out = vec![0; 4096];
    gpu.copy_to_host(4096, &mut out).expect("copy out");
    assert_eq!(out, pattern(1 << 16, 2)[..4096]);
    gpu.copy_to_host(0, &mut out[..100]).expect("copy out");
    assert_eq!(out[..100], pattern(1 << 16, 2)[8192..8292]);
}

#[test]
fn a_batch_is_awaited_under_tokio_with_the_engine_driven_by_a_task() {
    let w = WriteWorld::new(9);
    let (server, client, to_server, target, _grant, remote, local) = (
        w.server,
        w.client,
        w.to_server,
        w.target,
        w.grant,
        w.remote,
        w.local,
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let _driving = client.drive_on_tokio().expect("driver task");
        let _server_driving = server.drive_on_tokio().expect("driver task");
        let outcome =
            tokio::time::timeout(WAIT, to_server.write(&local, &remote, 0).expect("submit"))
                .await
                .expect("the batch ended");
        outcome.expect("WRITE");
    });
    assert_eq!(target.to_vec().expect("bytes"), vec![9; 4096]);
}

#[test]
fn objects_of_another_context_or_engine_are_refused() {
    let (server, to_client, client, to_server, server_context, client_context) = pair();
    let elsewhere = Context::open(BackendChoice::Sim).expect("third context");
    let foreign = elsewhere.alloc_host(4096).expect("memory");
    assert!(matches!(
        server.register(&foreign),
        Err(Error::Foreign { what: "buffer", .. })
    ));

    // A region of the client's engine granted by the server's peer object:
    // both are sim engines, so only the engine's own check stops it.
    let client_memory = client_context.alloc_host(4096).expect("memory");
    let client_region = client.register(&client_memory).expect("register");
    assert!(matches!(
        to_client.grant(&client_region, 0, 4096, GrantRights::Read),
        Err(Error::Refused(Refusal::ForeignRegion { .. }))
    ));

    let server_memory = server_context.alloc_host(4096).expect("memory");
    let server_region = server.register(&server_memory).expect("register");
    let grant = to_client
        .grant(&server_region, 0, 4096, GrantRights::ReadWrite)
        .expect("grant");
    let remote = to_server.wait_grant(grant.id(), WAIT).expect("announced");
    // The server's region through the client's peer object.
    assert!(matches!(
        to_server.submit(&[Transfer::write(&server_region, 0, &remote, 0, 64)]),
        Err(Error::Refused(Refusal::ForeignRegion { .. }))
    ));
    // A stream of another context.
    let stream = elsewhere.stream(0).expect("stream");
    let gpu = client_context.alloc_device(0, 4096).expect("GPU memory");
    assert!(matches!(
        stream.copy(&gpu, 0, &client_memory, 0, 64),
        Err(Error::Foreign { what: "buffer", .. })
    ));
}

/// Issue 33: read-only memory was registered read-write, so a peer could
/// WRITE into it and a READ landed in it. Wrapped with
/// `Context::wrap_read_only`, it is granted for reading only (a peer READs
/// it), and a grant with write rights, a READ into it, a copy into it
/// (host or device memory) and a stream copy into it are refused, typed;
/// its bytes never change.
#[test]
fn read_only_memory_is_never_written_by_a_grant_a_read_or_a_copy() {
    let (server, to_client, client, to_server, server_context, client_context) = pair();
    let constant = pattern(4096, 21);
    let (server_ctx, client_ctx) = (server_context.clone(), client_context.clone());
    // SAFETY: `constant` outlives the buffer (dropped at the end, before
    // it), and nothing gdr does writes it: that is what this tests.
    let ro = unsafe { server_ctx.wrap_read_only(constant.as_ptr() as u64, 4096) }.expect("wrap");
    assert_eq!(
        (ro.kind(), ro.access()),
        (MemoryKind::Host, Access::ReadOnly)
    );
    let region = server.register(&ro).expect("register");
    assert_eq!(region.access(), Access::ReadOnly);
    for rights in [GrantRights::Write, GrantRights::ReadWrite] {
        assert!(
            matches!(
                to_client.grant(&region, 0, 4096, rights),
                Err(Error::ReadOnly(ReadOnlyUse::WriteGrant { rights: asked }))
                    if asked == rights
            ),
            "{rights:?}"
        );
    }
    let grant = to_client
        .grant(&region, 0, 4096, GrantRights::Read)
        .expect("a read grant");
    let remote = to_server.wait_grant(grant.id(), WAIT).expect("announced");
    let back = client_ctx.alloc_host(4096).expect("memory");
    let back_region = client.register(&back).expect("register");
    to_server
        .read(&back_region, &remote, 0)
        .expect("submit")
        .wait(WAIT)
        .expect("READ");
    assert_eq!(back.to_vec().expect("bytes"), constant, "a READ of it");

    // The client's read-only memory: never READ into.
    let mine = pattern(4096, 22);
    // SAFETY: as above, for `mine`.
    let mine_ro = unsafe { client_ctx.wrap_read_only(mine.as_ptr() as u64, 4096) }.expect("wrap");
    let mine_region = client.register(&mine_ro).expect("register");
    assert!(matches!(
        to_server.read(&mine_region, &remote, 0),
        Err(Error::ReadOnly(ReadOnlyUse::ReadInto))
    ));
    let read_only_copy = |result: Result<(), Error>| {
        matches!(
            result,
            Err(Error::BufferAccess(BufferAccessError::ReadOnly { .. }))
        )
    };
    assert!(read_only_copy(ro.copy_from_host(0, &[0; 16])));
    assert!(read_only_copy(mine_ro.copy_from_host(100, &[0; 16])));
    let gpu = client_ctx.alloc_device(0, 4096).expect("GPU memory");
    let stream = client_ctx.stream(0).expect("stream");
    assert!(read_only_copy(stream.copy(&mine_ro, 0, &gpu, 0, 64)));
    // Device memory wrapped read-only: the copy in is a stream copy.
    // SAFETY: `gpu` outlives the buffer.
    let gpu_ro = unsafe { client_ctx.wrap_read_only(gpu.addr(), 4096) }.expect("wrap");
    assert_eq!(gpu_ro.kind(), MemoryKind::Device);
    assert!(read_only_copy(gpu_ro.copy_from_host(0, &[1; 64])));
    assert!(read_only_copy(stream.copy(&gpu_ro, 0, &back, 0, 64)));
    stream.synchronize().expect("synchronized");
    assert_eq!(gpu.to_vec().expect("bytes"), vec![0; 4096]);

    drop((grant, region, mine_region, back_region));
    for buffer in [ro, mine_ro, gpu_ro] {
        buffer.release().expect("released");
    }
    assert_eq!(constant, pattern(4096, 21), "the server's constant");
    assert_eq!(mine, pattern(4096, 22), "the client's constant");
}

#[test]
fn a_buffer_a_stream_copy_holds_is_not_released_until_the_stream_is_seen_past_it() {
    let context = Context::open(BackendChoice::Sim).expect("context");
    let gpu = context.alloc_device(0, 1 << 20).expect("GPU memory");
    let host = context.alloc_pinned(1 << 20).expect("pinned memory");
    host.copy_from_host(0, &pattern(1 << 20, 3))
        .expect("copy in");
    let stream = context.stream(0).expect("stream");
    stream.copy(&gpu, 0, &host, 0, 1 << 20).expect("queued");
    assert!(matches!(
        host.release(),
        Err(Error::StreamCopiesPending { copies: 1 })
    ));
    assert!(matches!(
        gpu.release(),
        Err(Error::StreamCopiesPending { copies: 1 })
    ));
    stream.synchronize().expect("synchronized");
    assert_eq!(gpu.to_vec().expect("bytes"), pattern(1 << 20, 3));
    gpu.release()
        .expect("released once the stream is past the copy");
    assert!(matches!(gpu.to_vec(), Err(Error::Released)));
    assert!(matches!(gpu.release(), Err(Error::Released)));
    // A clone is a handle of the same, released, buffer.
    let again: Buffer = host.clone();
    host.release().expect("released");
    assert!(matches!(
        again.copy_from_host(0, &[1]),
        Err(Error::Released)
    ));
}

#[test]
fn bad_sizes_ranges_and_devices_are_refused_with_what_was_wrong() {
    let context = Context::open(BackendChoice::Sim).expect("context");
    assert!(matches!(
        context.alloc_host(0),
        Err(Error::BadSize { size: 0, .. })
    ));
    assert!(matches!(
        context.alloc_device(7, 4096),
        Err(Error::NoGpu { index: 7, count: 1 })
    ));
    let buffer = context.alloc_host(4096).expect("memory");
    assert!(matches!(
        buffer.copy_from_host(4000, &[0; 100]),
        Err(Error::OutOfBounds {
            offset: 4000,
            len: 100,
            size: 4096,
            ..
        })
    ));
    let stream = context.stream(0).expect("stream");
    let other = context.alloc_host(4096).expect("memory");
    assert!(matches!(
        stream.copy(&other, 0, &buffer, 0, 64),
        Err(Error::Unsupported(
            gdr_core::Unsupported::HostToHostStreamCopy
        ))
    ));
    let gpu = context.alloc_device(0, 4096).expect("GPU memory");
    assert!(matches!(
        stream.copy(&gpu, 0, &gpu, 32, 64),
        Err(Error::Overlap)
    ));
    assert!(matches!(
        buffer.export_uri(),
        Err(Error::Unsupported(gdr_core::Unsupported::UriOfHostMemory))
    ));
    let uri = gpu.export_uri().expect("a device buffer's URI");
    // As CUDA, the exporting context does not open its own handle.
    assert!(matches!(context.open_uri(&uri), Err(Error::Cuda(_))));
}

/// Sizes the allocator refuses (64 TiB: past any machine's memory and
/// swap) are errors, the process alive (they were the allocator's abort),
/// and the next allocation works. Pinned memory, which CUDA page-locks,
/// is refused as CUDA refuses it.
#[test]
fn sizes_the_allocator_refuses_are_out_of_memory_errors_not_aborts() {
    const HUGE: u64 = 1 << 46;
    let context = Context::open(BackendChoice::Sim).expect("context");
    let refused = context.alloc_host(HUGE);
    assert!(
        matches!(
            refused,
            Err(Error::OutOfMemory {
                what: "host memory",
                size: HUGE
            })
        ),
        "{refused:?}"
    );
    assert!(matches!(
        context.alloc_host(u64::MAX),
        Err(Error::BadSize { size: u64::MAX, .. })
    ));
    let refused = context.alloc_pinned(HUGE);
    assert!(
        matches!(
            refused,
            Err(Error::Cuda(gdr_core::CudaError::OutOfMemory { .. }))
        ),
        "{refused:?}"
    );
    let buffer = context.alloc_host(4096).expect("memory after the refusals");
    buffer.copy_from_host(0, &[7; 4096]).expect("copy in");
    assert_eq!(buffer.to_vec().expect("copy out"), vec![7; 4096]);
    assert!(context.alloc_pinned(4096).is_ok(), "pinned memory after");
}

#[test]
fn a_revoked_grant_refuses_the_peers_next_request() {
    let w = WriteWorld::new(5);
    let (to_server, target, grant, remote, local) =
        (w.to_server, w.target, w.grant, w.remote, w.local);
    to_server
        .write(&local, &remote, 0)
        .expect("submit")
        .wait(WAIT)
        .expect("WRITE");
    grant.revoke(WAIT).expect("revoked");
    target.copy_from_host(0, &[0; 4096]).expect("cleared");
    // Refused at submit (the revoke reached this side) or by the NIC.
    match to_server.write(&local, &remote, 0) {
        Err(Error::NotGranted { .. } | Error::Refused(_)) => {}
        Ok(batch) => assert!(matches!(
            batch.wait(WAIT),
            Err(TransferError::RemoteAccess { .. } | TransferError::Revoked { .. })
        )),
        Err(other) => panic!("unexpected: {other}"),
    }
    assert_eq!(target.to_vec().expect("bytes"), vec![0; 4096]);
}

#[test]
fn a_batch_gated_on_a_borrowed_stream_moves_what_the_streams_owner_queued_first() {
    const LEN: usize = 1 << 16;
    let (server, to_client, client, to_server, server_context, client_context) = pair();
    let target = server_context.alloc_host(LEN as u64).expect("memory");
    let granted = server.register(&target).expect("register");
    let grant = to_client
        .grant(&granted, 0, LEN as u64, GrantRights::Write)
        .expect("grant");
    let remote = to_server.wait_grant(grant.id(), WAIT).expect("announced");

    let context = client_context;
    let gpu = context.alloc_device(0, LEN as u64).expect("GPU memory");
    gpu.copy_from_host(0, &pattern(LEN, 1)).expect("copy in");
    let local = client.register(&gpu).expect("register");
    let staged = context.alloc_pinned(LEN as u64).expect("pinned memory");
    staged.copy_from_host(0, &pattern(LEN, 2)).expect("copy in");
    // "The framework's" stream writes the GPU memory; gdr only borrows it.
    let owner = context.stream(0).expect("stream");
    owner.copy(&gpu, 0, &staged, 0, LEN).expect("queued");
    // SAFETY: `owner` is a stream of this context and outlives `borrowed`.
    let borrowed = unsafe { context.borrow_stream(0, owner.raw()) }.expect("borrowed");
    let batch = to_server
        .submit_after_stream(
            &borrowed,
            &[Transfer::write(&local, 0, &remote, 0, LEN as u64)],
            Some(WAIT),
        )
        .expect("submit");
    batch.wait(WAIT).expect("WRITE");
    assert_eq!(
        target.to_vec().expect("bytes"),
        pattern(LEN, 2),
        "the batch did not wait for the copy its owner queued before it"
    );

    // What the simulation cannot take is refused, typed (the real driver
    // cannot check a handle: there the contract is the caller's).
    for raw in [0x1000_usize, 1, 0] {
        // SAFETY: the simulation looks the token up and touches nothing.
        let refused = unsafe { context.borrow_stream(0, raw as *mut std::ffi::c_void) };
        assert!(
            matches!(
                refused,
                Err(Error::Cuda(hal_cuda::CudaError::InvalidArgument { .. }))
            ),
            "{raw:#x}: {refused:?}"
        );
    }
    // SAFETY: as above.
    let no_gpu = unsafe { context.borrow_stream(7, owner.raw()) };
    assert!(
        matches!(no_gpu, Err(Error::NoGpu { index: 7, .. })),
        "{no_gpu:?}"
    );
    let token = owner.raw();
    drop(borrowed);
    drop(owner);
    // SAFETY: the simulation looks the token up and touches nothing.
    let gone = unsafe { context.borrow_stream(0, token) };
    assert!(
        matches!(
            gone,
            Err(Error::Cuda(hal_cuda::CudaError::InvalidArgument { .. }))
        ),
        "a destroyed stream: {gone:?}"
    );
}

#[test]
fn a_dropped_engines_port_can_be_listened_on_again_at_once() {
    let context = Context::open(BackendChoice::Sim).expect("context");
    let first = context.engine(EngineConfig::default()).expect("engine");
    let ip = first.nic_address(&first.nics()[0]).expect("address");
    let listener = first.listen((ip, 0).into()).expect("listen");
    let addr = listener.local_addr();
    drop(listener);
    drop(first);
    // The engine's listener thread went with it (it used to keep the port
    // until the end of its idle wait, up to a second).
    let second = context.engine(EngineConfig::default()).expect("engine");
    let again = second.listen(addr);
    assert!(again.is_ok(), "{addr} is still taken: {again:?}");
}

/// Two engines of contexts whose NIC cannot register GPU memory at all
/// (what `auto` makes on a GPU machine without an RDMA device: a
/// simulated NIC beside the real GPU). GPU memory still registers, on the
/// staging rung, and moves both ways over the NIC path; with the
/// peer-copy path on, the two engines of this process share the GPU and
/// move it by device copies (issue 33: the facade refused GPU memory here,
/// "GPU 0 is not one of this ladder's GPUs").
#[test]
fn gpu_memory_moves_where_the_nic_cannot_reach_the_gpu() {
    use gdr_core::engine::PeerCopyRoute;
    use gdr_core::ladder::Rung;

    for peer_copy in [false, true] {
        let open = || {
            let c = Context::sim_nic_beside_unreachable_gpu().expect("context");
            assert!(!c.nic_reaches_gpu());
            assert_eq!(c.gpu_count(), 1);
            let engine = c
                .engine(EngineConfig::default().with_peer_copy(peer_copy))
                .expect("engine");
            (engine, c)
        };
        let ((server, server_context), (client, client_context)) = (open(), open());
        let (to_client, to_server) = connect(&server, &client);
        let expected = if peer_copy {
            PeerCopyRoute::SameProcess
        } else {
            PeerCopyRoute::Nic
        };
        assert_eq!(to_server.route(), expected);

        let len = (1 << 20) + 3;
        let target = server_context.alloc_device(0, len).expect("GPU memory");
        let granted = server.register(&target).expect("register GPU memory");
        assert_eq!(granted.rungs(), [Rung::Staging], "peer_copy {peer_copy}");
        let grant = to_client
            .grant(&granted, 0, len, GrantRights::ReadWrite)
            .expect("grant");
        let remote = to_server.wait_grant(grant.id(), WAIT).expect("announced");
        let source = client_context.alloc_device(0, len).expect("GPU memory");
        source
            .copy_from_host(0, &pattern(len as usize, 7))
            .expect("copy in");
        let local = client.register(&source).expect("register GPU memory");
        assert_eq!(local.rungs(), [Rung::Staging]);
        to_server
            .write(&local, &remote, 0)
            .expect("submit")
            .wait(WAIT)
            .expect("WRITE");
        assert_eq!(target.to_vec().expect("bytes"), pattern(len as usize, 7));
        let back = client_context.alloc_device(0, len).expect("GPU memory");
        let back_region = client.register(&back).expect("register");
        to_server
            .read(&back_region, &remote, 0)
            .expect("submit")
            .wait(WAIT)
            .expect("READ");
        assert_eq!(back.to_vec().expect("bytes"), pattern(len as usize, 7));
    }
}
