"""What the package keeps alive, and for how long; the GIL released while
it waits; asyncio without a thread per batch."""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import operator
import os
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest

import gdr

from conftest import WAIT


def test_the_object_is_released_once_its_region_and_batches_are_gone(granted) -> None:
    pair, _target, _grant, remote = granted
    array = np.ones(1 << 16, dtype=np.uint8)
    released = []
    weakref.finalize(array, released.append, True)
    region = pair.client.register(array)
    batch = pair.to_server.write(region, remote)
    del array
    gc.collect()
    assert not released, "the region holds the array"
    del region
    gc.collect()
    assert not released, "the batch holds its region"
    batch.wait(WAIT)
    del batch
    gc.collect()
    assert released == [True], "nothing holds the array once region and batch are gone"


def test_deleting_the_tensor_mid_transfer_is_safe(granted) -> None:
    pair, target, _grant, remote = granted
    source = np.full(1 << 20, 9, dtype=np.uint8)
    released = []
    weakref.finalize(source, released.append, True)
    batch = pair.to_server.write(pair.client.register(source), remote)
    del source  # the region (held by the batch) keeps it
    gc.collect()
    assert not released
    batch.wait(WAIT)
    assert (target == 9).all(), "the bytes arrived whole"
    del batch
    gc.collect()
    assert released == [True]


def test_a_pending_batch_dropped_is_waited_for_before_its_memory_goes(granted) -> None:
    pair, target, _grant, remote = granted
    source = np.full(1 << 20, 3, dtype=np.uint8)
    released = []
    weakref.finalize(source, released.append, True)
    pair.to_server.write(pair.client.register(source), remote)  # dropped at once
    del source
    gc.collect()
    # Whatever the timing, once the array is gone the batch had ended.
    assert released == [True]
    assert (target == 3).all()


def test_a_grant_holds_its_region(pair) -> None:
    array = np.zeros(4096, dtype=np.uint8)
    released = []
    weakref.finalize(array, released.append, True)
    grant = pair.to_client.grant(pair.server.register(array))
    del array
    gc.collect()
    assert not released
    grant.revoke(WAIT)
    del grant
    gc.collect()
    assert released == [True]


def test_the_gil_is_released_while_waiting(pair) -> None:
    ticks = 0
    stop = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    started = time.monotonic()
    try:
        pair.to_client.recv(0.5)  # nothing comes: waits 0.5 s
    except gdr.Timeout:
        pass
    finally:
        stop.set()
        thread.join()
    assert time.monotonic() - started >= 0.45
    assert ticks >= 50, f"the other thread ran only {ticks} times during a 0.5 s wait"


def _threads() -> int:
    """The process's threads, native ones included."""
    return len(os.listdir("/proc/self/task"))


def test_a_thousand_batches_awaited_at_once_add_no_thread(granted) -> None:
    pair, target, _grant, remote = granted
    source = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
    region = pair.client.register(source)

    async def run(n: int) -> None:
        batches = [
            pair.to_server.write(
                region, remote, local_offset=(i % 256) * 4096, remote_offset=(i % 256) * 4096, length=4096
            )
            for i in range(n)
        ]
        await asyncio.gather(*batches)

    most = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal most
        while not stop.is_set():
            most = max(most, _threads())

    async def main() -> int:
        await run(1)  # the engine's own thread (one per engine) is started
        before = _threads()
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            await run(1000)
        finally:
            stop.set()
            sampler.join()
        return before

    before = asyncio.run(main())
    # `before` was counted without the sampler; it is the one thread more.
    assert most <= before + 1, f"{most - before - 1} threads more while awaiting 1000 batches"
    assert np.array_equal(target, source)


def test_an_awaited_batch_raises_its_failure(granted) -> None:
    pair, _target, grant, remote = granted
    region = pair.client.register(np.zeros(4096, dtype=np.uint8))

    async def main() -> None:
        batch = pair.to_server.write(region, remote, length=4096)
        await batch
        pair.to_client.close()
        await asyncio.sleep(0.05)
        try:
            await pair.to_server.write(region, remote, length=4096)
        except (gdr.PeerGone, gdr.Refused):
            return
        raise AssertionError("a write to a closed peer succeeded")

    asyncio.run(main())


def test_a_block_list_batch_holds_its_region(granted) -> None:
    pair, _target, _grant, remote = granted
    pool = np.ones(1 << 16, dtype=np.uint8)
    released = []
    weakref.finalize(pool, released.append, True)
    region = pair.client.register(pool)
    offsets = np.arange(16, dtype=np.uint64) * 4096
    batch = pair.to_server.write(region, remote, offsets, offsets, 4096)
    del pool, region
    gc.collect()
    assert not released, "the batch holds its region"
    batch.wait(WAIT)
    del batch
    gc.collect()
    assert released == [True]


def test_a_cancelled_await_cancels_the_batch(granted) -> None:
    pair, _target, _grant, remote = granted
    region = pair.client.register(np.ones(1 << 20, dtype=np.uint8))
    zeros = np.zeros(256, dtype=np.uint64)

    async def main() -> gdr.Batch:
        # 256 MiB of WRITEs: still running when the task is cancelled.
        batch = pair.to_server.write(region, remote, zeros, zeros, 1 << 20)
        task = asyncio.ensure_future(_await(batch))
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return batch
        raise AssertionError("the task was not cancelled")

    batch = asyncio.run(main())
    with pytest.raises(gdr.Cancelled):
        batch.wait(WAIT)


async def _await(batch: gdr.Batch) -> None:
    await batch


def _release_every_view(root: object) -> int:
    """Releases every memoryview reachable from ``root`` through Python
    objects (what a user can reach), as a careless or hostile caller
    could; how many it released."""
    seen: set[int] = set()
    stack = [root]
    released = 0
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, (type, type(gc))):
            continue
        seen.add(id(item))
        if isinstance(item, memoryview):
            item.release()
            released += 1
            continue
        stack.extend(gc.get_referents(item))
        for name in getattr(type(item), "__slots__", ()):
            stack.append(getattr(item, name, None))
        if isinstance(item, tuple):
            stack.extend(item)
    return released


def test_a_granted_bytearray_cannot_be_unpinned(pair) -> None:
    target = bytearray(1 << 16)
    region = pair.server.register(target)
    assert region.obj is target, "region.obj is the object registered"
    grant = pair.to_client.grant(region)
    remote = pair.to_server.wait_grant(grant.id, WAIT)
    # Whatever a user reaches from the region, released.
    _release_every_view(region)
    _release_every_view(region.obj)
    _release_every_view(grant)
    with pytest.raises(BufferError):
        target.extend(bytes(1 << 20))  # would move it
    with pytest.raises(BufferError):
        del target[:]
    assert len(target) == 1 << 16
    source = np.full(1 << 16, 0x5A, dtype=np.uint8)
    pair.to_server.write(pair.client.register(source), remote).wait(WAIT)
    assert target == bytes([0x5A]) * (1 << 16), "the peer's WRITE landed in the bytearray"
    grant.revoke(WAIT)
    del grant, region
    gc.collect()
    target.extend(b"x")  # the pin went with the region
    assert len(target) == (1 << 16) + 1


def test_a_dlpack_region_hands_back_its_object(pair) -> None:
    array = np.zeros(4096, dtype=np.uint8)
    region = pair.server.register(array, via="dlpack")
    assert region.obj is array
    assert _release_every_view(region) == 0


def _eventfds() -> int:
    """The process's open eventfds."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]":
                count += 1
        except OSError:  # the listing's own fd, closed meanwhile
            pass
    return count


def test_event_loops_that_awaited_batches_go_with_their_eventfds(granted) -> None:
    pair, _target, _grant, remote = granted
    region = pair.client.register(np.ones(4096, dtype=np.uint8))
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def main() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        await pair.to_server.write(region, remote, length=4096)

    asyncio.run(main())  # whatever the engine opens once, opened
    gc.collect()
    before = _eventfds()
    for _ in range(20):
        asyncio.run(main())
    gc.collect()
    alive = sum(1 for loop in loops if loop() is not None)
    assert alive == 0, f"{alive} of {len(loops)} closed event loops are still alive"
    assert _eventfds() <= before, f"{_eventfds() - before} eventfds more after 20 loops"


def test_a_cancelled_await_lets_go_of_its_batch_once_the_loop_is_closed(granted) -> None:
    pair, _target, _grant, remote = granted
    pool = np.ones(1 << 20, dtype=np.uint8)
    released = []
    weakref.finalize(pool, released.append, True)
    zeros = np.zeros(256, dtype=np.uint64)
    batches: list[weakref.ref[gdr.Batch]] = []

    async def main() -> None:
        # 256 MiB of WRITEs: still running when the task is cancelled.
        batch = pair.to_server.write(pair.client.register(pool), remote, zeros, zeros, 1 << 20)
        batches.append(weakref.ref(batch))
        task = asyncio.ensure_future(_await(batch))
        del batch
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    del pool
    gc.collect()
    assert batches[0]() is None, "the cancelled batch is still referenced"
    assert released == [True], "the cancelled batch's memory is still held"


def _lets_another_thread_run(call: Any, arg: Any, calls: int) -> bool:
    """Whether ``call(arg)``, made ``calls`` times in a row from C (no
    bytecode between the calls, so nothing but the calls themselves can
    give the GIL away), let a thread waiting for the GIL run before the
    last one: the waiting thread asks for the GIL after the switch
    interval, and the next release hands it over."""
    remaining = iter(itertools.repeat(arg, calls))
    seen: list[int] = []
    ready = threading.Event()

    def other() -> None:
        ready.wait()
        seen.append(operator.length_hint(remaining))

    thread = threading.Thread(target=other)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        thread.start()
        ready.set()  # it now waits for the GIL
        # Kept (not dropped one by one): only the calls themselves count.
        kept = list(map(call, remaining))
    finally:
        sys.setswitchinterval(interval)
        thread.join()
    del kept
    return 0 < seen[0] < calls


def _calls_for(call: Any, arg: Any, seconds: float) -> int:
    """How many calls of ``call(arg)`` take about ``seconds``."""
    started = time.perf_counter()
    for _ in range(200):
        call(arg)
    each = (time.perf_counter() - started) / 200
    return max(1000, int(seconds / max(each, 1e-7)))


def test_done_result_and_grant_let_other_threads_run(granted) -> None:
    pair, _target, _grant, remote = granted
    region = pair.client.register(np.ones(1 << 16, dtype=np.uint8))
    batch = pair.to_server.write(region, remote)
    batch.wait(WAIT)  # each call as quick as the next
    native = type(batch._native)
    for method in (native.done, native.result):
        calls = _calls_for(method, batch._native, 0.1)
        assert any(
            _lets_another_thread_run(method, batch._native, calls) for _ in range(3)
        ), f"Batch.{method.__name__} held the GIL throughout {calls} calls"
    theirs = pair.server.register(np.zeros(4096, dtype=np.uint8))._native

    # A C callable: no bytecode runs between the calls.
    grant = functools.partial(pair.to_client._native.grant, offset=0, length=4096, rights="read")
    # Few: each is announced, then revoked as it is dropped.
    assert any(
        _lets_another_thread_run(grant, theirs, 256) for _ in range(3)
    ), "Peer.grant held the GIL throughout"
