"""Transfers through the Python package on the simulator: numpy arrays, an
object exposing ``__cuda_array_interface__`` over simulated GPU memory,
``__dlpack__`` through numpy, descriptor lists as numpy arrays, and the
descriptors' bytes and text forms."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import gdr

from conftest import WAIT, connect


def pattern(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint64) * 31 + seed) % 251).astype(np.uint8)


def test_a_numpy_array_is_written_and_read_back(granted) -> None:
    pair, target, _grant, remote = granted
    source = pattern(1 << 20, 1)
    region = pair.client.register(source)
    assert region.device is None and len(region) == 1 << 20
    pair.to_server.write(region, remote).wait(WAIT)
    assert np.array_equal(target, source)
    back = np.zeros(1 << 20, dtype=np.uint8)
    pair.to_server.read(pair.client.register(back), remote).wait(WAIT)
    assert np.array_equal(back, source)


def test_a_float_tensor_moves_by_its_bytes(granted) -> None:
    pair, target, _grant, remote = granted
    source = np.linspace(0, 1, 1 << 18, dtype=np.float32)  # 1 MiB
    pair.to_server.write(pair.client.register(source), remote).wait(WAIT)
    assert np.array_equal(target.view(np.float32), source)


def test_simulated_gpu_memory_through_the_cuda_array_interface(granted) -> None:
    pair, target, _grant, remote = granted
    gpu = pair.client.alloc(1 << 16, kind="device")
    assert gpu.device == 0 and gpu.rungs() == ["dmabuf"]
    gpu.write_bytes(pattern(1 << 16, 2).tobytes())

    class CudaArray:
        """A foreign object over the same GPU memory (as CuPy would be)."""

        def __init__(self, owner: gdr.Region) -> None:
            self.owner = owner
            self.__cuda_array_interface__ = {
                "shape": (len(owner) // 4,),
                "typestr": "<u4",
                "data": (owner.address, False),
                "strides": None,
                "version": 3,
            }

    array = CudaArray(gpu)
    region = pair.client.register(array)
    assert region.device == 0 and region.obj is array
    pair.to_server.write(region, remote, remote_offset=4096).wait(WAIT)
    assert target[4096 : 4096 + (1 << 16)].tobytes() == pattern(1 << 16, 2).tobytes()
    # And a READ into it.
    pair.to_server.read(region, remote, remote_offset=0).wait(WAIT)
    assert gpu.read_bytes() == target[: 1 << 16].tobytes()


def test_dlpack_through_numpy(granted) -> None:
    pair, target, _grant, remote = granted
    source = pattern(1 << 16, 3)
    assert hasattr(source, "__dlpack__")
    region = pair.client.register(source)
    assert region.address == source.__array_interface__["data"][0]
    pair.to_server.write(region, remote).wait(WAIT)
    assert np.array_equal(target[: 1 << 16], source)


def test_buffer_protocol_objects(granted) -> None:
    pair, target, _grant, remote = granted
    for i, obj in enumerate([bytearray(b"x" * 4096), memoryview(bytearray(b"y" * 4096)), b"z" * 4096]):
        pair.to_server.write(pair.client.register(obj), remote, remote_offset=i * 4096).wait(WAIT)
    assert target[:4096].tobytes() == b"x" * 4096
    assert target[4096:8192].tobytes() == b"y" * 4096
    assert target[8192:12288].tobytes() == b"z" * 4096


def test_a_paged_kv_cache_block_list_is_one_batch_from_numpy_arrays(granted) -> None:
    pair, target, _grant, remote = granted
    block = 4096
    blocks = 256
    pool = pattern(blocks * block, 4)
    region = pair.client.register(pool)
    rng = np.random.default_rng(7)
    local = rng.permutation(blocks).astype(np.uint64) * block
    remote_offsets = np.arange(blocks, dtype=np.uint64) * block
    pair.to_server.write(region, remote, local, remote_offsets, block).wait(WAIT)
    for i in range(blocks):
        start = int(local[i])
        assert np.array_equal(target[i * block : (i + 1) * block], pool[start : start + block])
    # Lengths as an array too, READ back into a fresh pool.
    back = np.zeros_like(pool)
    lengths = np.full(blocks, block, dtype=np.uint64)
    pair.to_server.read(pair.client.register(back), remote, local, remote_offsets, lengths).wait(WAIT)
    assert np.array_equal(back, pool)


def test_submit_takes_mixed_transfers(granted) -> None:
    pair, target, _grant, remote = granted
    a, b = pattern(8192, 5), pattern(8192, 6)
    ra, rb = pair.client.register(a), pair.client.register(b)
    batch = pair.to_server.submit(
        [(gdr.WRITE, ra, 0, remote, 0, 8192), (gdr.WRITE, rb, 0, remote, 8192, 8192)]
    )
    batch.wait(WAIT)
    assert batch.done()
    batch.result()
    assert np.array_equal(target[:8192], a) and np.array_equal(target[8192:16384], b)


def test_descriptors_travel_as_bytes_and_text(granted) -> None:
    pair, target, grant, remote = granted
    as_bytes = grant.descriptor.to_bytes()
    as_text = str(grant.descriptor)
    assert as_text.startswith("gdr-md:v2:")
    for descriptor in (gdr.Descriptor.from_bytes(as_bytes), gdr.Descriptor.from_text(as_text)):
        assert descriptor == remote
        assert descriptor.grant == grant.id and len(descriptor) == 1 << 20
        assert descriptor.rights == "read_write" and descriptor.owner == pair.server.id
    pair.to_server.write(pair.client.register(pattern(4096, 8)), gdr.Descriptor.from_text(as_text)).wait(WAIT)
    assert np.array_equal(target[:4096], pattern(4096, 8))


def test_control_messages(pair) -> None:
    pair.to_server.send(b"hello").wait(WAIT)
    assert pair.to_client.recv(WAIT) == b"hello"


def test_describe_is_the_doctors_report(pair) -> None:
    report = pair.server.describe()
    assert {"backends", "rdma", "gpus", "rungs", "hints"} <= set(report)
    verbs, cuda, notes = pair.server.backends()
    assert (verbs, cuda) == ("sim", "sim") and notes
    assert pair.server.nics() == ["sim0"] and pair.server.gpu_count() == 1


class _StreamedArray:
    """A foreign GPU array whose producer names its stream in the CUDA
    array interface (as CuPy does)."""

    def __init__(self, owner: gdr.Region, stream: int) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (len(owner),),
            "typestr": "|u1",
            "data": (owner.address, False),
            "strides": None,
            "version": 3,
            "stream": stream,
        }


def _staged_on_a_stream(pair, seed: int):
    """GPU memory holding ``pattern(.., seed + 1)``, a copy of
    ``pattern(.., seed)`` into it queued on a stream nobody synchronizes,
    and that stream."""
    n = 1 << 16
    gpu = pair.client.alloc(n, kind="device")
    gpu.write_bytes(pattern(n, seed + 1).tobytes())
    pinned = pair.client.alloc(n, kind="pinned")
    pinned.write_bytes(pattern(n, seed).tobytes())
    stream = pair.client.stream(0)
    stream.copy(gpu, 0, pinned, 0, n)
    return gpu, stream


def test_a_transfer_waits_for_the_stream_its_object_names(granted) -> None:
    pair, target, _grant, remote = granted
    gpu, stream = _staged_on_a_stream(pair, 40)
    region = pair.client.register(_StreamedArray(gpu, stream.handle))
    pair.to_server.write(region, remote, length=1 << 16).wait(WAIT)
    assert np.array_equal(target[: 1 << 16], pattern(1 << 16, 40)), "the WRITE ran before the stream's copy"


def test_a_transfer_waits_for_the_stream_it_is_given(granted) -> None:
    pair, target, _grant, remote = granted
    for seed, as_handle in ((50, False), (60, True)):
        gpu, stream = _staged_on_a_stream(pair, seed)
        given = stream.handle if as_handle else stream
        pair.to_server.submit([(gdr.WRITE, gpu, 0, remote, 0, 1 << 16)], stream=given).wait(WAIT)
        assert np.array_equal(target[: 1 << 16], pattern(1 << 16, seed)), f"stream as handle: {as_handle}"


def test_two_auto_engines_of_one_process_reach_each_other() -> None:
    # Where no RDMA device is, "auto" falls back to the simulated NIC: a
    # node of the process's one simulated fabric each, at an address of
    # its own, as "sim" does.
    server, client = gdr.Engine(backend="auto"), gdr.Engine(backend="auto")
    if server.backends()[0] != "sim":
        return  # real RDMA here: nothing falls back
    assert server.nic_address() != client.nic_address()
    pair = connect(server, client)
    target = np.zeros(4096, dtype=np.uint8)
    grant = pair.to_client.grant(pair.server.register(target))
    remote = pair.to_server.wait_grant(grant.id, WAIT)
    pair.to_server.write(pair.client.register(pattern(4096, 5)), remote).wait(WAIT)
    assert np.array_equal(target, pattern(4096, 5))


def test_a_fallback_to_the_simulation_is_told_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gdr, "_fallback_told", False)  # as in a new process
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        gdr.Engine(backend="sim")  # asked for: nothing to tell
        first = gdr.Engine(backend="auto")
        gdr.Engine(backend="auto")
    verbs, cuda, _notes = first.backends()
    fallbacks = [w for w in told if issubclass(w.category, gdr.SimulationFallbackWarning)]
    if "sim" not in (verbs, cuda):
        assert not fallbacks, "nothing fell back here"
        return
    assert len(fallbacks) == 1, [str(w.message) for w in told]
    message = str(fallbacks[0].message)
    assert 'backend="real"' in message and "simulated" in message
    assert fallbacks[0].filename == __file__, "it points at the caller's line"
    assert issubclass(gdr.SimulationFallbackWarning, RuntimeWarning)
    monkeypatch.setattr(gdr, "_fallback_told", False)
    with pytest.warns(gdr.SimulationFallbackWarning, match="nothing leaves this process"):
        gdr.Engine(backend="auto")
