"""Real GPU memory: torch CUDA tensors and CuPy arrays, registered through
``__dlpack__`` and through ``__cuda_array_interface__``, moved between two
engines of this process over the NIC path (the staging rung: no NIC here
reaches the GPU) and by device copies, checked with the frameworks' own
comparisons; a tensor's stream respected with no device- or context-wide
synchronize.

Run where a GPU is: skipped elsewhere, except with ``GDR_EXPECT_GPU=1``,
where a missing GPU, torch or CuPy fails instead.
"""

from __future__ import annotations

import gc
import os
import weakref
from typing import Any, Iterator

import pytest

import gdr

from conftest import WAIT, Pair, connect

EXPECT_GPU = os.environ.get("GDR_EXPECT_GPU") == "1"


def _import(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError as error:
        if EXPECT_GPU:
            raise AssertionError(f"GDR_EXPECT_GPU=1 but {name} cannot be imported: {error}") from error
        pytest.skip(f"{name} is not installed")


@pytest.fixture(scope="module")
def torch() -> Any:
    torch = _import("torch")
    if not torch.cuda.is_available():
        if EXPECT_GPU:
            raise AssertionError("GDR_EXPECT_GPU=1 but torch sees no GPU")
        pytest.skip("no GPU")
    return torch


@pytest.fixture(scope="module")
def cupy(torch: Any) -> Any:
    return _import("cupy")


def _pair(peer_copy: bool) -> Pair:
    server = gdr.Engine(backend="auto", peer_copy=peer_copy)
    client = gdr.Engine(backend="auto", peer_copy=peer_copy)
    assert server.gpu_count() >= 1, server.backends()
    return connect(server, client)


@pytest.fixture(params=["nic", "peer_copy"])
def path(request: Any, torch: Any) -> Iterator[Pair]:
    pair = _pair(peer_copy=request.param == "peer_copy")
    expected = "same_process" if request.param == "peer_copy" else "nic"
    assert pair.to_server.route == expected, (pair.to_server.route, pair.client.backends())
    yield pair


N = 1 << 22  # 4 MiB: several staging slices


def _zeros(framework: str, torch: Any, cupy: Any) -> Any:
    if framework == "torch":
        return torch.zeros(N, dtype=torch.uint8, device="cuda")
    return cupy.zeros(N, dtype=cupy.uint8)


def _pattern_torch(torch: Any, seed: int) -> Any:
    return ((torch.arange(N, device="cuda", dtype=torch.int64) * 31 + seed) % 251).to(torch.uint8)


def _as_torch(torch: Any, array: Any) -> Any:
    """``array`` (torch or CuPy) seen by torch, no copy."""
    return array if isinstance(array, torch.Tensor) else torch.from_dlpack(array)


@pytest.mark.parametrize("framework", ["torch", "cupy"])
@pytest.mark.parametrize("via", ["dlpack", "cai"])
def test_gpu_tensors_move_both_ways(path: Pair, torch: Any, cupy: Any, framework: str, via: str) -> None:
    pair = path
    expected = _pattern_torch(torch, 7)
    target = _zeros(framework, torch, cupy)
    source = _zeros(framework, torch, cupy)
    _as_torch(torch, source).copy_(expected)
    torch.cuda.synchronize()  # the set-up only: the transfers order themselves

    target_region = pair.server.register(target, via=via)
    assert target_region.device == 0
    grant = pair.to_client.grant(target_region)
    remote = pair.to_server.wait_grant(grant.id, WAIT)
    source_region = pair.client.register(source, via=via)
    if pair.to_server.route == "nic":
        assert source_region.rungs() == ["staging"], source_region.rungs()

    pair.to_server.write(source_region, remote).wait(WAIT)
    torch.cuda.synchronize()
    assert torch.equal(_as_torch(torch, target), expected)

    back = _zeros(framework, torch, cupy)
    torch.cuda.synchronize()
    half = N // 2
    pair.to_server.read(pair.client.register(back, via=via), remote, remote_offset=half, length=half).wait(WAIT)
    torch.cuda.synchronize()
    back_t = _as_torch(torch, back)
    assert torch.equal(back_t[:half], expected[half:])
    assert int(back_t[half:].count_nonzero()) == 0


def _cycles_for(torch: Any, seconds: float) -> int:
    """``torch.cuda._sleep``'s cycles for about ``seconds`` (the GPU's
    clock, measured once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    per_second = 10_000_000 / (start.elapsed_time(end) / 1000.0)
    return int(per_second * seconds)


@pytest.mark.parametrize("framework", ["torch", "cupy"])
@pytest.mark.parametrize("via", ["dlpack", "cai"])
def test_a_transfer_sees_the_kernel_that_wrote_its_tensor_and_not_other_streams(
    path: Pair, torch: Any, cupy: Any, framework: str, via: str
) -> None:
    pair = path
    target = torch.zeros(N, dtype=torch.uint8, device="cuda")
    grant = pair.to_client.grant(pair.server.register(target))
    remote = pair.to_server.wait_grant(grant.id, WAIT)
    source = _zeros(framework, torch, cupy)
    region = pair.client.register(source, via=via)
    torch.cuda.synchronize()

    cycles = _cycles_for(torch, 0.5)
    # The kernels launched below while `other` sleeps are launched once
    # first: a kernel's first launch may load its module, which waits for
    # every stream of the context (CUDA's lazy loading: seen as CuPy's
    # first `fill` taking the 3 s of `other`, before any gdr call). Not 0:
    # a fill with zeros is a memset, not the kernel.
    if framework == "torch":
        source.fill_(1)
    else:
        source.fill(1)
    torch.cuda.synchronize()
    other = torch.cuda.Stream()
    mine = torch.cuda.Stream()
    with torch.cuda.stream(other):
        torch.cuda._sleep(cycles * 6)  # about 3 s on a stream the transfer must not wait for
    if framework == "torch":
        with torch.cuda.stream(mine):
            torch.cuda._sleep(cycles)  # the tensor is written late on its own stream...
            source.fill_(9)
            # ...and the transfer is submitted at once, no synchronize: it
            # starts after torch's current stream (DLPack's exchange), or
            # after the stream named (the CUDA array interface of a torch
            # tensor names none).
            batch = pair.to_server.write(region, remote, stream=None if via == "dlpack" else mine)
    else:
        with cupy.cuda.Stream(non_blocking=True) as cupy_stream:
            with torch.cuda.stream(torch.cuda.ExternalStream(cupy_stream.ptr)):
                torch.cuda._sleep(cycles)
            source.fill(9)
            # CuPy's CUDA array interface names its current stream; DLPack
            # orders after it too: nothing to pass either way.
            batch = pair.to_server.write(region, remote)
    batch.wait(WAIT)
    still_sleeping = not other.query()
    torch.cuda.synchronize()
    assert int((target != 9).count_nonzero()) == 0, "the transfer ran before the kernel that wrote its tensor"
    assert still_sleeping, "the transfer waited for another stream's kernel (a device-wide synchronize?)"


def test_a_tensor_deleted_mid_transfer_stays_until_the_batch_has_gone(path: Pair, torch: Any) -> None:
    pair = path
    target = torch.zeros(N, dtype=torch.uint8, device="cuda")
    grant = pair.to_client.grant(pair.server.register(target))
    remote = pair.to_server.wait_grant(grant.id, WAIT)
    source = _pattern_torch(torch, 3)
    torch.cuda.synchronize()
    released = []
    watch = weakref.ref(source, lambda _: released.append(True))
    batch = pair.to_server.write(pair.client.register(source), remote)
    del source
    gc.collect()
    assert not released, "the tensor went while a batch used it"
    batch.wait(WAIT)
    del batch
    gc.collect()
    assert released and watch() is None, "the tensor outlived its region and batch"
    assert torch.equal(target, _pattern_torch(torch, 3))


def test_describe_reports_the_gpu(torch: Any) -> None:
    with gdr.Engine(backend="auto") as engine:
        report = engine.describe()
        assert engine.gpu_count() == torch.cuda.device_count()
        gpus = report["gpus"]["gpus"]
        assert len(gpus) == torch.cuda.device_count(), report["gpus"]
        assert torch.cuda.get_device_name(0) in gpus[0]["name"] or gpus[0]["name"] in torch.cuda.get_device_name(0)
        assert report["backends"]["cuda"] not in (None, "sim"), report["backends"]
