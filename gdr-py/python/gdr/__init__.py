"""gdr: move tensors and buffers between host memory, GPU memory and remote
peers over RDMA, registering GPU memory with the NIC directly (GPUDirect
RDMA) where the machine allows and staging it through pinned host memory
where it does not.

    import gdr
    with gdr.Engine(backend="sim") as engine:
        region = engine.register(numpy_array)      # or a torch/CuPy tensor
        listener = engine.listen()
        ...

The engine is gdr-core's (Rust); every call that waits releases the GIL,
and a :class:`Batch` can be awaited under asyncio with no thread per batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import operator
import warnings
import weakref
from typing import Any, Generator, Iterable, Optional, Sequence, Tuple, Union

from . import _gdr, errors
from ._gdr import Descriptor
from ._memory import Memory, memory_of
from .errors import (
    Busy,
    Cancelled,
    ConnectFailed,
    DeviceError,
    GdrError,
    InvalidArgument,
    NotSupported,
    OutOfMemory,
    PeerGone,
    Refused,
    Revoked,
    Timeout,
    TransferFailed,
    Unavailable,
)

__all__ = [
    "Engine",
    "Region",
    "Listener",
    "Peer",
    "Grant",
    "Descriptor",
    "Batch",
    "Stream",
    "Memory",
    "memory_of",
    "READ",
    "WRITE",
    "SimulationFallbackWarning",
    *errors.__all__,
]

READ = 0
WRITE = 1

_DEFAULT_TIMEOUT = 10.0


def _is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (an int, a numpy integer scalar: not a
    bool, not a float)."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _count(value: Any, what: str) -> int:
    """``value`` as a byte offset or length: an integer from 0 to 2^64 - 1
    (an int or a numpy integer scalar); :class:`InvalidArgument` naming
    ``what`` otherwise (a float is refused, not truncated)."""
    if not _is_int(value):
        raise InvalidArgument(f"{what}: {value!r} is not an integer (offsets and lengths are whole bytes)")
    n = operator.index(value)
    if n < 0:
        raise InvalidArgument(f"{what}: {n} is negative")
    if n >= 1 << 64:
        raise InvalidArgument(f"{what}: {n} does not fit in 64 bits")
    return n


def _rest(size: int, offset: int, what: str) -> int:
    """The bytes of ``size`` from ``offset`` on (the default length)."""
    if offset > size:
        raise InvalidArgument(f"{what}: {offset} is past the {size} bytes")
    return size - offset


class Region:
    """Registered memory: what a grant names locally and a transfer moves.
    It keeps the object it was registered from alive until it, and every
    grant and batch of it, are gone."""

    __slots__ = ("_native", "_engine", "_memory", "_device", "__weakref__")

    def __init__(self, native: Any, engine: "Engine", memory: Optional[Memory] = None) -> None:
        self._native = native
        self._engine = engine
        self._memory = memory
        self._device: Optional[int] = native.device

    def __len__(self) -> int:
        return len(self._native)

    @property
    def address(self) -> int:
        """Its address (a host pointer or a device address)."""
        return int(self._native.address)

    @property
    def device(self) -> Optional[int]:
        """The GPU it lives on; None for host memory."""
        return self._device

    @property
    def readonly(self) -> bool:
        """Whether its memory is read-only (a ``bytes``, a read-only numpy
        array or memoryview): granted for reading only, never READ into or
        written by :meth:`write_bytes` (:class:`InvalidArgument`)."""
        return bool(self._native.readonly)

    @property
    def obj(self) -> Any:
        """The object it was registered from (None for memory the engine
        allocated)."""
        return self._native.obj

    def rungs(self) -> list[str]:
        """How each NIC registered it: ``"host"``, ``"dmabuf"``,
        ``"peermem"`` or ``"staging"``."""
        rungs: list[str] = self._native.rungs()
        return rungs

    def read_bytes(self, offset: int = 0, length: Optional[int] = None) -> bytes:
        """A copy of ``length`` bytes at ``offset`` (GPU memory included)."""
        offset = _count(offset, "offset")
        length = None if length is None else _count(length, "length")
        data: bytes = self._native.read_bytes(offset, length)
        return data

    def write_bytes(self, data: Union[bytes, bytearray, memoryview], offset: int = 0) -> None:
        """Copies ``data`` in at ``offset`` (GPU memory included); refused
        for read-only memory (:class:`InvalidArgument`)."""
        self._native.write_bytes(bytes(data), _count(offset, "offset"))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """GPU memory as a CUDA array of bytes (CuPy, torch and Numba take
        it); host memory has none."""
        if self.device is None:
            raise AttributeError("host memory has no __cuda_array_interface__")
        return {
            "shape": (len(self),),
            "typestr": "|u1",
            "data": (self.address, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }

    def __repr__(self) -> str:
        where = "host" if self.device is None else f"GPU {self.device}"
        return f"<gdr.Region {len(self)} bytes of {where} memory, rungs {self.rungs()}>"


def _rights(rights: str) -> str:
    if rights not in ("read", "write", "read_write"):
        raise InvalidArgument(f'rights: {rights!r} is not "read", "write" or "read_write"')
    return rights


class Grant:
    """Memory granted to a peer. Its :attr:`descriptor` (as bytes or text)
    is what the peer needs; dropping the grant revokes it."""

    __slots__ = ("_native", "region")

    def __init__(self, native: Any, region: Region) -> None:
        self._native = native
        self.region = region

    @property
    def id(self) -> int:
        """The grant's id (the peer can wait for it by id)."""
        return int(self._native.id)

    @property
    def descriptor(self) -> Descriptor:
        """The descriptor: ``bytes(grant.descriptor.to_bytes())`` or
        ``str(grant.descriptor)`` to hand to the peer out of band."""
        descriptor: Descriptor = self._native.descriptor
        return descriptor

    def revoke(self, timeout: float = _DEFAULT_TIMEOUT) -> None:
        """Revokes it and waits for the fence: once this returns, no byte
        moves under the grant by any path."""
        self._native.revoke(timeout)

    def __repr__(self) -> str:
        return f"<gdr.Grant {self.id} {self.descriptor!r}>"


_Offsets = Union[int, Sequence[int], Any]


class Batch:
    """A submitted batch: ends exactly once. ``wait(timeout)``, ``done()``,
    ``cancel()``, or ``await batch`` under asyncio. It keeps the regions it
    moves (and their objects) alive until it has ended."""

    __slots__ = ("_native", "__weakref__")

    def __init__(self, native: Any) -> None:
        self._native = native

    def wait(self, timeout: Optional[float] = None) -> None:
        """Waits (``None``: until it ends), the GIL released; raises what
        it ended with, or :class:`Timeout` when it is still running after
        ``timeout`` (it goes on: wait again, or cancel it)."""
        self._native.wait(timeout)

    def done(self) -> bool:
        """Whether it has ended."""
        done: bool = self._native.done()
        return done

    def result(self) -> None:
        """After it ended: None, or raises what it ended with. Raises
        :class:`InvalidArgument` while it runs."""
        if self._native.result() is None:
            raise InvalidArgument("the batch is still running")

    def cancel(self) -> None:
        """Cancels it: it ends with :class:`Cancelled` unless it ended
        first; nothing of it runs after."""
        self._native.cancel()

    def __await__(self) -> Generator[Any, None, None]:
        """Awaits its end under asyncio; cancelling the awaiting task
        cancels the batch."""
        return _LoopNotifier.of(asyncio.get_running_loop()).wait(self).__await__()

    def __repr__(self) -> str:
        return f"<gdr.Batch {'ended' if self.done() else 'running'}>"


class _LoopNotifier:
    """One per asyncio loop: the batches awaited on it, told of their end
    through one eventfd the loop watches (no thread per batch, no thread
    taking the GIL).

    Only the loop holds it (through its reader): the table of notifiers
    holds the loop and the notifier weakly, and the notifier never holds
    the loop, so a loop that is let go goes, and its notifier (and eventfd)
    with it; closing the loop drops its reader, and so the notifier, at
    once. An await that is cancelled drops its entry at once: a batch never
    waits for a loop that will not run again."""

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.ref[_LoopNotifier]]" = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._native = _gdr.Notifier()
        self._tokens = itertools.count(1)
        self._waiting: dict[int, Tuple[asyncio.Future[None], Batch]] = {}
        loop.add_reader(self._native.fileno(), self._on_ready)

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_LoopNotifier":
        known = cls._by_loop.get(loop)
        notifier = None if known is None else known()
        if notifier is None:
            notifier = cls(loop)
            cls._by_loop[loop] = weakref.ref(notifier)
        return notifier

    def wait(self, batch: Batch) -> "asyncio.Future[None]":
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        token = next(self._tokens)
        if batch._native.notify(self._native, token):
            self._settle(future, batch)
            return future
        self._waiting[token] = (future, batch)
        # A cancelled await (task.cancel(), asyncio.wait_for's timeout)
        # cancels the batch (nothing of it runs after) and forgets it here.
        # Held weakly: the notifier (and its eventfd) goes with its loop.
        notifier = weakref.ref(self)

        def on_done(done: "asyncio.Future[None]") -> None:
            if not done.cancelled():
                return
            batch.cancel()
            this = notifier()
            if this is not None:
                this._waiting.pop(token, None)

        future.add_done_callback(on_done)
        return future

    def _on_ready(self) -> None:
        for token in self._native.drain():
            entry = self._waiting.pop(token, None)
            if entry is None:
                continue
            future, batch = entry
            if batch.done():
                self._settle(future, batch)
            elif batch._native.notify(self._native, token):
                self._settle(future, batch)
            else:
                self._waiting[token] = entry

    @staticmethod
    def _settle(future: "asyncio.Future[None]", batch: Batch) -> None:
        if future.done():
            return
        try:
            batch._native.result()
        except BaseException as error:  # the batch's own exception
            future.set_exception(error)
        else:
            future.set_result(None)


def _u64_array(values: Any, what: str) -> Any:
    """``values`` as an array of uint64 the engine reads in place: a
    C-contiguous numpy ``uint64`` array as it is, other integers converted
    (the engine checks the counts); floats and negative values refused
    (:class:`InvalidArgument` naming ``what``), never truncated or wrapped."""
    import numpy as np

    if type(values) is np.ndarray and values.dtype == np.uint64 and values.flags.c_contiguous:
        return values
    array = np.asarray(values)
    if array.ndim == 0:
        raise InvalidArgument(f"{what}: {values!r} is not an integer (offsets and lengths are whole bytes)")
    if array.ndim != 1:
        raise InvalidArgument(f"{what}: {values!r} is neither an integer nor a one-dimensional array of them")
    if array.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if array.dtype.kind not in "iu":
        raise InvalidArgument(f"{what}: an array of {array.dtype}, not of integers (offsets and lengths are whole bytes)")
    if array.dtype.kind == "i" and array.min() < 0:
        raise InvalidArgument(f"{what}: {int(array[array < 0][0])} is negative")
    return np.ascontiguousarray(array, dtype=np.uint64)


def _stream_handle(stream: Any) -> Tuple[int, Optional[int]]:
    """``(handle, GPU or None)`` of a stream given as a transfer's
    ``stream=``."""
    if type(stream) is int:
        return stream, None
    if hasattr(stream, "__cuda_stream__"):
        _version, handle = stream.__cuda_stream__()
        return int(handle), None
    device = getattr(stream, "device", None)
    gpu = getattr(device, "index", None)
    if gpu is None:
        gpu = getattr(stream, "device_id", None)
    for attribute in ("cuda_stream", "ptr"):  # torch's, CuPy's
        handle = getattr(stream, attribute, None)
        if type(handle) is int:
            return handle, gpu
    raise InvalidArgument(
        f"stream: {type(stream).__name__} is not a stream (torch's or CuPy's, a gdr.Stream, "
        "anything with __cuda_stream__, a CUstream handle as an int, None or False)"
    )


class Stream:
    """A CUDA stream of one GPU that the engine made (:meth:`Engine.stream`):
    copies between host and GPU memory queued on it, and a transfer's
    ``stream=`` to start after them."""

    __slots__ = ("_native",)

    def __init__(self, native: Any) -> None:
        self._native = native

    @property
    def handle(self) -> int:
        """Its ``CUstream`` handle (the simulation's own token on the sim)."""
        return int(self._native.handle)

    @property
    def gpu(self) -> int:
        """The GPU it runs on."""
        return int(self._native.gpu)

    def copy(self, dst: Region, dst_offset: int, src: Region, src_offset: int, length: int) -> None:
        """Queues a copy of ``length`` bytes from ``src`` at ``src_offset``
        to ``dst`` at ``dst_offset`` (host memory and this GPU's, of this
        stream's engine); both are held until the stream is seen past it."""
        self._native.copy(
            dst._native,
            _count(dst_offset, "dst_offset"),
            src._native,
            _count(src_offset, "src_offset"),
            _count(length, "length"),
        )

    def synchronize(self) -> None:
        """Waits for the work queued so far (the GIL released)."""
        self._native.synchronize()

    def __repr__(self) -> str:
        return f"<gdr.Stream of GPU {self.gpu} {self.handle:#x}>"


def _gate(engine: "Engine", regions: Sequence[Region], stream: Any) -> Any:
    """The native stream a batch of ``regions`` waits for, per
    ``stream=``; None for none."""
    if stream is False:
        return None
    gpus = {r.device for r in regions if r.device is not None}
    if stream is not None:
        if isinstance(stream, Stream):
            return stream._native
        handle, gpu = _stream_handle(stream)
        if gpu is None:
            gpu = min(gpus) if gpus else 0
        return engine._engine().borrow_stream(gpu, handle)
    if not gpus:
        return None
    if len(gpus) > 1:
        raise InvalidArgument("the batch moves memory of several GPUs: name its stream (stream=)")
    gpu = gpus.pop()
    gates: dict[int, Any] = {}
    for region in regions:
        memory = region._memory
        if memory is None or region.device is None:
            continue
        if memory.via == "dlpack":
            # DLPack's exchange: the producer makes our stream wait for
            # its current one (an event, no host wait); the capsule is
            # not used.
            own = engine._own_stream(gpu)
            try:
                memory.source.__dlpack__(stream=own.handle)
            except TypeError:
                raise InvalidArgument(
                    f"{type(memory.source).__name__}.__dlpack__ takes no stream: name the "
                    "batch's stream (stream=), or stream=False once you have synchronized"
                ) from None
            gates[own.handle] = own._native
        elif memory.via == "cai":
            named = memory.source.__cuda_array_interface__.get("stream")
            if named is not None:
                gates.setdefault(int(named), engine._engine().borrow_stream(gpu, int(named)))
    if len(gates) > 1:
        raise InvalidArgument("the batch's objects name different streams: name one (stream=)")
    return next(iter(gates.values()), None)


class Peer:
    """A connected peer: grants to it, and READs and WRITEs against its
    grants."""

    __slots__ = ("_native", "_engine")

    def __init__(self, native: Any, engine: "Engine") -> None:
        self._native = native
        self._engine = engine

    @property
    def remote_engine(self) -> int:
        """The peer engine's id."""
        return int(self._native.remote_engine)

    @property
    def route(self) -> str:
        """How GPU memory moves with this peer: ``"nic"``,
        ``"same_process"`` (device copies between two engines of this
        process) or ``"ipc"`` (device copies through CUDA IPC: another
        process on this machine)."""
        return str(self._native.route)

    def grant(
        self,
        region: Region,
        offset: int = 0,
        length: Optional[int] = None,
        rights: Optional[str] = None,
    ) -> Grant:
        """Grants ``length`` bytes (the rest of the region by default) at
        ``offset`` of ``region`` with ``rights`` (``"read"``, ``"write"``,
        ``"read_write"``; by default ``"read_write"``, and ``"read"`` for a
        read-only region, which refuses the others with
        :class:`InvalidArgument`); the descriptor is announced on the
        connection."""
        offset = _count(offset, "offset")
        length = _rest(len(region), offset, "offset") if length is None else _count(length, "length")
        if rights is None:
            rights = "read" if region.readonly else "read_write"
        return Grant(self._native.grant(region._native, offset, length, _rights(rights)), region)

    def wait_grant(self, grant_id: int, timeout: float = _DEFAULT_TIMEOUT) -> Descriptor:
        """Waits for the peer to announce grant ``grant_id``."""
        descriptor: Descriptor = self._native.wait_grant(grant_id, timeout)
        return descriptor

    def _one_or_many(
        self,
        op: int,
        region: Region,
        remote: Descriptor,
        local_offset: _Offsets,
        remote_offset: _Offsets,
        length: Optional[_Offsets],
        timeout: Optional[float],
        stream: Any,
    ) -> Batch:
        # Host memory with no stream named: nothing to order after (the
        # common case, kept cheap).
        after = None if stream is None and region._device is None else _gate(self._engine, (region,), stream)
        if _is_int(local_offset) and _is_int(remote_offset) and (length is None or _is_int(length)):
            lo = _count(local_offset, "local_offset")
            ro = _count(remote_offset, "remote_offset")
            n = _rest(len(region), lo, "local_offset") if length is None else _count(length, "length")
            transfer = (op, region._native, lo, remote, ro, n)
            return Batch(self._native.submit([transfer], timeout, after))
        if length is None:
            raise InvalidArgument("length: needed with arrays of offsets")
        return Batch(
            self._native.submit_arrays(
                op,
                region._native,
                remote,
                _u64_array(local_offset, "local_offset"),
                _u64_array(remote_offset, "remote_offset"),
                _count(length, "length") if _is_int(length) else _u64_array(length, "length"),
                timeout,
                after,
            )
        )

    def write(
        self,
        region: Region,
        remote: Descriptor,
        local_offset: _Offsets = 0,
        remote_offset: _Offsets = 0,
        length: Optional[_Offsets] = None,
        timeout: Optional[float] = None,
        stream: Any = None,
    ) -> Batch:
        """WRITEs ``region`` into the peer's grant ``remote``: one transfer
        (offsets and a length as ints; the rest of the region by default),
        or many in one batch (offsets and lengths as arrays, e.g. numpy
        ``uint64``: a paged KV cache's blocks, no Python loop).

        ``stream``: what the batch waits for on the GPU, with no thread and
        nothing else on the GPU waited for. ``None`` (the default): the
        stream of the region's object (GPU memory registered through
        DLPack: the producer's current stream, by DLPack's exchange;
        through the CUDA array interface: the stream it names). A stream
        (torch's, CuPy's, :class:`Stream`, anything with
        ``__cuda_stream__``, or a ``CUstream`` handle as an int, live until
        this call returns): after the work queued on it so far. ``False``:
        nothing (the caller has synchronized)."""
        return self._one_or_many(WRITE, region, remote, local_offset, remote_offset, length, timeout, stream)

    def read(
        self,
        region: Region,
        remote: Descriptor,
        local_offset: _Offsets = 0,
        remote_offset: _Offsets = 0,
        length: Optional[_Offsets] = None,
        timeout: Optional[float] = None,
        stream: Any = None,
    ) -> Batch:
        """READs the peer's grant ``remote`` into ``region``; as
        :meth:`write` (``stream``: the batch starts after its work, so a
        READ does not overwrite memory a kernel queued before still
        reads). A read-only ``region`` is refused (:class:`InvalidArgument`),
        nothing moved."""
        return self._one_or_many(READ, region, remote, local_offset, remote_offset, length, timeout, stream)

    def submit(
        self,
        transfers: Iterable[Tuple[int, Region, int, Descriptor, int, int]],
        timeout: Optional[float] = None,
        stream: Any = None,
    ) -> Batch:
        """One batch of ``(op, region, local_offset, remote, remote_offset,
        length)`` transfers (op :data:`READ` or :data:`WRITE`), checked
        whole before anything is posted; ``stream`` as for :meth:`write`."""
        listed = list(transfers)
        after = _gate(self._engine, [t[1] for t in listed], stream)
        native = [
            (
                op,
                r._native,
                _count(lo, "local_offset"),
                d,
                _count(ro, "remote_offset"),
                _count(n, "length"),
            )
            for (op, r, lo, d, ro, n) in listed
        ]
        return Batch(self._native.submit(native, timeout, after))

    def send(self, message: bytes) -> Batch:
        """Sends a small control message."""
        return Batch(self._native.send(bytes(message)))

    def recv(self, timeout: float = _DEFAULT_TIMEOUT) -> bytes:
        """Waits for the peer's next control message."""
        data: bytes = self._native.recv(timeout)
        return data

    def close(self) -> None:
        """Closes the connection: requests under way fail, the peer is told."""
        self._native.close()


class Listener:
    """A listening engine."""

    __slots__ = ("_native", "_engine")

    def __init__(self, native: Any, engine: "Engine") -> None:
        self._native = native
        self._engine = engine

    @property
    def address(self) -> Tuple[str, int]:
        """``(host, port)`` to give to the peer."""
        host, port = self._native.address
        return str(host), int(port)

    def accept(self, timeout: float = _DEFAULT_TIMEOUT) -> Peer:
        """Waits for a peer to connect."""
        return Peer(self._native.accept(timeout), self._engine)


class SimulationFallbackWarning(RuntimeWarning):
    """``backend="auto"`` found no RDMA device (or no GPU) and uses the
    simulation for it: nothing leaves this process. Told once per process;
    ``backend="real"`` refuses instead, ``backend="sim"`` asks for it (and
    is not warned of)."""


_fallback_told = False


def _warn_of_fallback(engine: "Engine") -> None:
    """Warns, once per process, when an ``"auto"`` engine fell back to the
    simulation."""
    global _fallback_told
    verbs, cuda, notes = engine.backends()
    simulated = [what for what, backend in (("NIC", verbs), ("GPU", cuda)) if backend == "sim"]
    if _fallback_told or not simulated:
        return
    _fallback_told = True
    why = "; ".join(" ".join(note.split()) for note in notes)
    warnings.warn(
        SimulationFallbackWarning(
            f'gdr: backend="auto" uses the simulated {" and ".join(simulated)} (nothing leaves this '
            f'process): {why}. backend="real" refuses instead; backend="sim" chooses the simulation.'
        ),
        stacklevel=3,
    )


class Engine:
    """A transfer engine over the NICs (and the GPUs they reach) of the
    backends chosen: ``"auto"`` (real rdma-core and CUDA where found, the
    simulation otherwise), ``"real"`` or ``"sim"``. Configuration as
    keywords: ``qps_per_peer``, ``default_timeout`` and ``accept_timeout``
    (seconds), ``peer_copy``, ``staging_slots``, ``staging_slice``,
    ``max_peers`` (peers connected at once; one more is refused). A
    context manager; engines of one process on the simulation reach each
    other as two machines would."""

    def __init__(self, backend: str = "auto", **config: Any) -> None:
        self._native: Any = _gdr.Engine(backend, **config)
        self._streams: dict[int, "Stream"] = {}
        if backend == "auto":
            _warn_of_fallback(self)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Lets go of the engine (it goes once its regions, peers, grants
        and batches are gone too)."""
        self._native = None
        self._streams = {}

    def _engine(self) -> Any:
        if self._native is None:
            raise InvalidArgument("the engine is closed")
        return self._native

    @property
    def id(self) -> int:
        """The engine's id (named in its grants' descriptors)."""
        return int(self._engine().id)

    def describe(self) -> dict[str, Any]:
        """The doctor's report (``gdr info --json``) for this engine's
        backend choice: libraries, NICs, GPUs, the rung each pair takes
        and why, what to do about each "no"."""
        report: dict[str, Any] = json.loads(self._engine().describe_json())
        return report

    def backends(self) -> Tuple[str, Optional[str], list[str]]:
        """``(verbs backend, CUDA backend or None, notes on each fallback)``."""
        verbs, cuda, notes = self._engine().backends()
        return str(verbs), cuda, list(notes)

    def nics(self) -> list[str]:
        """The NICs' names."""
        nics: list[str] = self._engine().nics()
        return nics

    def gpu_count(self) -> int:
        """The GPUs this engine can use."""
        return int(self._engine().gpu_count())

    def nic_address(self, nic: Optional[str] = None) -> str:
        """The address NIC ``nic`` (the first by default) is reached at."""
        if nic is None:
            nics = self.nics()
            if not nics:
                raise Unavailable("the engine has no NIC")
            nic = nics[0]
        address: str = self._engine().nic_address(nic)
        return address

    def register(self, obj: Any, via: Optional[str] = None) -> Region:
        """Registers ``obj``'s memory (see :mod:`gdr._memory` for what is
        accepted: numpy arrays, ``bytearray``, torch and CuPy tensors on
        any device, ``(address, length, device)``), taken through ``via``
        (``"dlpack"``, ``"cai"``, ``"buffer"``; by default the first the
        object offers). The region keeps ``obj`` alive. Read-only memory
        (``bytes``, a read-only array or view) is registered read-only
        (:attr:`Region.readonly`)."""
        memory = memory_of(obj, via=via)
        registered = memory.source if memory.source is not None else obj
        if memory.via == "buffer":
            # The region holds a buffer export of the object natively, out
            # of Python's reach (a memoryview could be released by whoever
            # reaches it, and the object then resized under a grant).
            native = self._engine().register_memory(
                memory.address, memory.length, registered, readonly=memory.readonly, export=True
            )
        else:
            native = self._engine().register_memory(
                memory.address, memory.length, registered, readonly=memory.readonly, pin=memory.keepalive
            )
        # The region keeps where and how, not what pins it.
        return Region(native, self, dataclasses.replace(memory, keepalive=None))

    def stream(self, gpu: int = 0) -> "Stream":
        """A new stream of GPU ``gpu`` (non-blocking): to queue copies on,
        or to name as a transfer's ``stream=``."""
        return Stream(self._engine().stream(gpu))

    def _own_stream(self, gpu: int) -> "Stream":
        # The stream DLPack producers order their work before (one per GPU,
        # made on first use).
        if gpu not in self._streams:
            self._streams[gpu] = self.stream(gpu)
        return self._streams[gpu]

    def alloc(self, length: int, kind: str = "host", gpu: int = 0) -> Region:
        """``length`` bytes the engine allocates and registers: ``"host"``,
        ``"pinned"``, or ``"device"`` memory of GPU ``gpu`` (which exposes
        ``__cuda_array_interface__``)."""
        return Region(self._engine().alloc(_count(length, "length"), kind, _count(gpu, "gpu")), self)

    def listen(self, host: Optional[str] = None, port: int = 0) -> Listener:
        """Listens at ``host`` (the first NIC's address by default) and
        ``port`` (0 picks one)."""
        return Listener(self._engine().listen(host or self.nic_address(), port), self)

    def connect(
        self, address: Union[str, Tuple[str, int]], timeout: float = _DEFAULT_TIMEOUT
    ) -> Peer:
        """Connects to the engine listening at ``(host, port)`` or
        ``"host:port"``."""
        if isinstance(address, str):
            text_host, _, text_port = address.rpartition(":")
            address = (text_host.strip("[]"), int(text_port))
        host, port = address
        return Peer(self._engine().connect(host, int(port), timeout), self)
