"""Every refusal the package raises, by class, with the engine's message."""

from __future__ import annotations

import numpy as np
import pytest

import gdr

from conftest import WAIT, connect


def test_the_hierarchy() -> None:
    assert issubclass(gdr.InvalidArgument, ValueError)
    assert issubclass(gdr.Timeout, TimeoutError)
    assert issubclass(gdr.PeerGone, ConnectionError)
    assert issubclass(gdr.Revoked, gdr.Refused)
    for error in (gdr.InvalidArgument, gdr.Timeout, gdr.PeerGone, gdr.Refused, gdr.Cancelled):
        assert issubclass(error, gdr.GdrError)


def test_a_backend_that_is_no_backend() -> None:
    with pytest.raises(gdr.InvalidArgument, match="backend"):
        gdr.Engine(backend="gpu")


def test_objects_without_usable_memory(pair) -> None:
    engine = pair.client
    with pytest.raises(gdr.InvalidArgument, match="exposes no memory"):
        engine.register(42)
    with pytest.raises(gdr.InvalidArgument, match="C-contiguous"):
        engine.register(np.zeros((64, 64), dtype=np.uint8)[:, ::2])
    with pytest.raises(gdr.InvalidArgument, match="no bytes"):
        engine.register(bytearray())
    with pytest.raises(gdr.InvalidArgument, match="raw memory"):
        engine.register((0, 4096, None))
    with pytest.raises(gdr.InvalidArgument, match="version"):
        engine.register(type("Old", (), {"__cuda_array_interface__": {"version": 1, "shape": (4,), "typestr": "|u1", "data": (1, False)}})())


def test_a_region_of_another_engine(granted) -> None:
    pair, _target, _grant, remote = granted
    foreign = pair.server.register(np.zeros(4096, dtype=np.uint8))
    with pytest.raises(gdr.InvalidArgument, match="belongs to another engine"):
        pair.to_server.write(foreign, remote)
    with pytest.raises(gdr.InvalidArgument, match="belongs to another engine"):
        pair.to_server.grant(foreign)


def test_past_the_grant_and_against_its_rights(pair) -> None:
    theirs = pair.server.register(np.zeros(4096, dtype=np.uint8))
    read_only = pair.to_client.grant(theirs, rights="read")
    remote = pair.to_server.wait_grant(read_only.id, WAIT)
    mine = pair.client.register(np.zeros(8192, dtype=np.uint8))
    with pytest.raises(gdr.Refused, match="does not allow"):
        pair.to_server.write(mine, remote, length=4096)
    with pytest.raises(gdr.Refused, match="exceed"):
        pair.to_server.read(mine, remote, remote_offset=1, length=4096)
    with pytest.raises(gdr.InvalidArgument, match="rights"):
        pair.to_client.grant(theirs, rights="all")


def test_a_local_range_past_the_region(granted) -> None:
    pair, _target, _grant, remote = granted
    mine = pair.client.register(np.zeros(4096, dtype=np.uint8))
    with pytest.raises(gdr.InvalidArgument, match="exceed"):
        pair.to_server.write(mine, remote, local_offset=1, length=4096)


def test_descriptor_lists_that_do_not_fit(granted) -> None:
    pair, _target, _grant, remote = granted
    mine = pair.client.register(np.zeros(4096, dtype=np.uint8))
    with pytest.raises(gdr.InvalidArgument, match="entries"):
        pair.to_server.write(mine, remote, np.zeros(4, dtype=np.uint64), np.zeros(3, dtype=np.uint64), 16)
    with pytest.raises(gdr.InvalidArgument, match="length"):
        pair.to_server.write(mine, remote, np.zeros(4, dtype=np.uint64), np.zeros(4, dtype=np.uint64))


def test_timeouts(pair) -> None:
    with pytest.raises(gdr.Timeout):
        pair.to_server.wait_grant(12345, 0.05)
    with pytest.raises(gdr.Timeout):
        pair.to_server.recv(0.05)


def test_malformed_descriptors() -> None:
    with pytest.raises(gdr.InvalidArgument, match="descriptor"):
        gdr.Descriptor.from_text("gdr-md:v2:nonsense")
    with pytest.raises(gdr.InvalidArgument, match="descriptor"):
        gdr.Descriptor.from_bytes(b"\x00" * 16)


def test_a_gpu_that_is_not_there(pair) -> None:
    with pytest.raises(gdr.Unavailable, match="no GPU 5"):
        pair.client.alloc(4096, kind="device", gpu=5)
    with pytest.raises(gdr.InvalidArgument, match="kind"):
        pair.client.alloc(4096, kind="managed")


def test_connecting_where_nobody_listens() -> None:
    engine = gdr.Engine(backend="sim")
    with pytest.raises((gdr.ConnectFailed, gdr.Timeout, gdr.PeerGone)):
        engine.connect((engine.nic_address(), 1), timeout=0.5)
    with pytest.raises(gdr.InvalidArgument, match="not an IP address"):
        engine.connect(("nowhere", 1), timeout=0.5)


def test_a_closed_peer(granted) -> None:
    pair, _target, _grant, remote = granted
    mine = pair.client.register(np.zeros(4096, dtype=np.uint8))
    pair.to_server.close()
    with pytest.raises(gdr.PeerGone):
        pair.to_server.write(mine, remote, length=4096).wait(WAIT)


def test_a_revoked_grant(pair) -> None:
    theirs = pair.server.register(np.zeros(4096, dtype=np.uint8))
    grant = pair.to_client.grant(theirs)
    remote = pair.to_server.wait_grant(grant.id, WAIT)
    grant.revoke(WAIT)
    mine = pair.client.register(np.zeros(4096, dtype=np.uint8))
    with pytest.raises(gdr.Refused):
        pair.to_server.write(mine, remote, length=4096).wait(WAIT)


def test_a_closed_engine() -> None:
    engine = gdr.Engine(backend="sim")
    engine.close()
    with pytest.raises(gdr.InvalidArgument, match="closed"):
        engine.nics()


def test_a_second_engine_pair_is_independent() -> None:
    a, b = gdr.Engine(backend="sim"), gdr.Engine(backend="sim")
    connected = connect(a, b)
    assert connected.to_server.remote_engine == a.id


def test_a_stream_that_is_none_is_refused(granted) -> None:
    pair, _target, _grant, remote = granted
    region = pair.client.register(np.zeros(4096, dtype=np.uint8))
    with pytest.raises(gdr.InvalidArgument, match="is not a stream"):
        pair.to_server.write(region, remote, stream="the current one")
    # An int that is no stream of the simulation's: refused, nothing moves.
    with pytest.raises(gdr.GdrError, match="no stream of this process"):
        pair.to_server.write(region, remote, stream=0x1000)
    gpu = pair.client.alloc(4096, kind="device")
    with pytest.raises(gdr.InvalidArgument, match="via"):
        pair.client.register(gpu, via="magic")
    with pytest.raises(gdr.InvalidArgument, match="no __dlpack__"):
        pair.client.register(gpu, via="dlpack")
