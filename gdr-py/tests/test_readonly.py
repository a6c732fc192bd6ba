"""Read-only memory (issue 33): a ``bytes`` object, a numpy array with
``writeable=False`` and a read-only memoryview are registered read-only.
They are granted for reading only (the default for them; "write" and
"read_write" raise :class:`gdr.InvalidArgument`), a peer READs them, and a
READ into them, ``write_bytes`` and a stream copy into them raise
:class:`gdr.InvalidArgument`; their bytes never change."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import gdr

from conftest import WAIT

N = 4096


def pattern(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint64) * 31 + seed) % 251).astype(np.uint8)


def read_only_array(seed: int) -> np.ndarray:
    array = pattern(N, seed)
    array.flags.writeable = False
    return array


# Each kind of read-only object, fresh (a bytes object of its own: CPython
# shares small ones, which a write would change interpreter-wide).
KINDS: dict[str, Callable[[int], Any]] = {
    "bytes": lambda seed: pattern(N, seed).tobytes(),
    "numpy": read_only_array,
    "memoryview": lambda seed: memoryview(bytearray(pattern(N, seed).tobytes())).toreadonly(),
}


def snapshot(obj: Any) -> bytes:
    return bytes(memoryview(obj))


@pytest.mark.parametrize("kind", KINDS)
def test_read_only_memory_is_granted_for_reading_only(pair, kind: str) -> None:
    constant = KINDS[kind](1)
    region = pair.server.register(constant)
    assert region.readonly
    for rights in ("write", "read_write"):
        with pytest.raises(gdr.InvalidArgument, match="read-only"):
            pair.to_client.grant(region, rights=rights)
    grant = pair.to_client.grant(region)
    remote = pair.to_server.wait_grant(grant.id, WAIT)
    assert remote.rights == "read"
    # The peer READs it; its WRITE is refused by the grant.
    back = np.zeros(N, dtype=np.uint8)
    mine = pair.client.register(back)
    pair.to_server.read(mine, remote).wait(WAIT)
    assert back.tobytes() == pattern(N, 1).tobytes()
    with pytest.raises(gdr.Refused, match="does not allow"):
        pair.to_server.write(mine, remote)
    with pytest.raises(gdr.InvalidArgument, match="read-only"):
        region.write_bytes(b"overwritten", 16)
    grant.revoke()
    assert snapshot(constant) == pattern(N, 1).tobytes(), "unchanged"


@pytest.mark.parametrize("kind", KINDS)
def test_a_read_into_read_only_memory_is_refused(granted, kind: str) -> None:
    pair, target, _grant, remote = granted
    constant = KINDS[kind](2)
    region = pair.client.register(constant)
    assert region.readonly
    with pytest.raises(gdr.InvalidArgument, match="read-only"):
        pair.to_server.read(region, remote)
    offsets = np.array([0, 1024], dtype=np.uint64)
    with pytest.raises(gdr.InvalidArgument, match="read-only"):
        pair.to_server.read(region, remote, offsets, offsets, 512)
    with pytest.raises(gdr.InvalidArgument, match="read-only"):
        pair.to_server.submit([(gdr.WRITE, region, 0, remote, 0, N), (gdr.READ, region, 0, remote, 0, N)])
    # A WRITE from it moves its bytes as from any memory.
    pair.to_server.write(region, remote).wait(WAIT)
    assert target[:N].tobytes() == pattern(N, 2).tobytes()
    with pytest.raises(gdr.InvalidArgument, match="read-only"):
        region.write_bytes(b"x")
    assert snapshot(constant) == pattern(N, 2).tobytes(), "unchanged"


def test_a_stream_copy_into_read_only_memory_is_refused(pair) -> None:
    constant = pattern(N, 3).tobytes()
    region = pair.client.register(constant)
    gpu = pair.client.alloc(N, kind="device")
    stream = pair.client.stream()
    with pytest.raises(gdr.InvalidArgument, match="read-only"):
        stream.copy(region, 0, gpu, 0, N)
    stream.synchronize()
    assert constant == pattern(N, 3).tobytes()


def test_writable_memory_keeps_read_write_grants_by_default(pair) -> None:
    region = pair.server.register(bytearray(N))
    assert not region.readonly
    grant = pair.to_client.grant(region)
    assert pair.to_server.wait_grant(grant.id, WAIT).rights == "read_write"
