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
import itertools
import json
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
    "Memory",
    "memory_of",
    "READ",
    "WRITE",
    *errors.__all__,
]

READ = 0
WRITE = 1

_DEFAULT_TIMEOUT = 10.0


class Region:
    """Registered memory: what a grant names locally and a transfer moves.
    It keeps the object it was registered from alive until it, and every
    grant and batch of it, are gone."""

    __slots__ = ("_native", "_engine", "__weakref__")

    def __init__(self, native: Any, engine: "Engine") -> None:
        self._native = native
        self._engine = engine

    def __len__(self) -> int:
        return len(self._native)

    @property
    def address(self) -> int:
        """Its address (a host pointer or a device address)."""
        return int(self._native.address)

    @property
    def device(self) -> Optional[int]:
        """The GPU it lives on; None for host memory."""
        device: Optional[int] = self._native.device
        return device

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
        data: bytes = self._native.read_bytes(offset, length)
        return data

    def write_bytes(self, data: Union[bytes, bytearray, memoryview], offset: int = 0) -> None:
        """Copies ``data`` in at ``offset`` (GPU memory included)."""
        self._native.write_bytes(bytes(data), offset)

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
        return _LoopNotifier.of(asyncio.get_running_loop()).wait(self).__await__()

    def __repr__(self) -> str:
        return f"<gdr.Batch {'ended' if self.done() else 'running'}>"


class _LoopNotifier:
    """One per asyncio loop: the batches awaited on it, told of their end
    through one eventfd the loop watches (no thread per batch, no thread
    taking the GIL)."""

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopNotifier]" = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._native = _gdr.Notifier()
        self._tokens = itertools.count(1)
        self._waiting: dict[int, Tuple[asyncio.Future[None], Batch]] = {}
        loop.add_reader(self._native.fileno(), self._on_ready)

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_LoopNotifier":
        notifier = cls._by_loop.get(loop)
        if notifier is None:
            notifier = cls(loop)
            cls._by_loop[loop] = notifier
        return notifier

    def wait(self, batch: Batch) -> "asyncio.Future[None]":
        future: asyncio.Future[None] = self._loop.create_future()
        token = next(self._tokens)
        if batch._native.notify(self._native, token):
            self._settle(future, batch)
        else:
            self._waiting[token] = (future, batch)
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


def _u64_array(values: Any) -> Any:
    """``values`` as an array of uint64 the engine reads in place: a
    C-contiguous numpy ``uint64`` array as it is, anything else converted
    (the engine checks the element type and the counts)."""
    import numpy as np

    if type(values) is np.ndarray and values.dtype == np.uint64 and values.flags.c_contiguous:
        return values
    return np.ascontiguousarray(values, dtype=np.uint64)


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

    def grant(
        self,
        region: Region,
        offset: int = 0,
        length: Optional[int] = None,
        rights: str = "read_write",
    ) -> Grant:
        """Grants ``length`` bytes (the rest of the region by default) at
        ``offset`` of ``region`` with ``rights`` (``"read"``, ``"write"``,
        ``"read_write"``); the descriptor is announced on the connection."""
        if length is None:
            length = len(region) - offset
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
    ) -> Batch:
        if type(local_offset) is int and type(remote_offset) is int and (length is None or type(length) is int):
            n = len(region) - local_offset if length is None else length
            transfer = (op, region._native, local_offset, remote, remote_offset, n)
            return Batch(self._native.submit([transfer], timeout))
        if length is None:
            raise InvalidArgument("length: needed with arrays of offsets")
        return Batch(
            self._native.submit_arrays(
                op,
                region._native,
                remote,
                _u64_array(local_offset),
                _u64_array(remote_offset),
                length if type(length) is int else _u64_array(length),
                timeout,
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
    ) -> Batch:
        """WRITEs ``region`` into the peer's grant ``remote``: one transfer
        (offsets and a length as ints; the rest of the region by default),
        or many in one batch (offsets and lengths as arrays, e.g. numpy
        ``uint64``: a paged KV cache's blocks, no Python loop)."""
        return self._one_or_many(WRITE, region, remote, local_offset, remote_offset, length, timeout)

    def read(
        self,
        region: Region,
        remote: Descriptor,
        local_offset: _Offsets = 0,
        remote_offset: _Offsets = 0,
        length: Optional[_Offsets] = None,
        timeout: Optional[float] = None,
    ) -> Batch:
        """READs the peer's grant ``remote`` into ``region``; as
        :meth:`write`."""
        return self._one_or_many(READ, region, remote, local_offset, remote_offset, length, timeout)

    def submit(
        self,
        transfers: Iterable[Tuple[int, Region, int, Descriptor, int, int]],
        timeout: Optional[float] = None,
    ) -> Batch:
        """One batch of ``(op, region, local_offset, remote, remote_offset,
        length)`` transfers (op :data:`READ` or :data:`WRITE`), checked
        whole before anything is posted."""
        native = [(op, r._native, lo, d, ro, n) for (op, r, lo, d, ro, n) in transfers]
        return Batch(self._native.submit(native, timeout))

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


class Engine:
    """A transfer engine over the NICs (and the GPUs they reach) of the
    backends chosen: ``"auto"`` (real rdma-core and CUDA where found, the
    simulation otherwise), ``"real"`` or ``"sim"``. Configuration as
    keywords: ``qps_per_peer``, ``default_timeout`` and ``accept_timeout``
    (seconds), ``peer_copy``, ``staging_slots``, ``staging_slice``. A
    context manager; engines of one process on the simulation reach each
    other as two machines would."""

    def __init__(self, backend: str = "auto", **config: Any) -> None:
        self._native: Any = _gdr.Engine(backend, **config)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Lets go of the engine (it goes once its regions, peers, grants
        and batches are gone too)."""
        self._native = None

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

    def register(self, obj: Any) -> Region:
        """Registers ``obj``'s memory (see :mod:`gdr._memory` for what is
        accepted: numpy arrays, ``bytearray``, torch and CuPy tensors on
        any device, ``(address, length, device)``). The region keeps
        ``obj`` alive."""
        memory = memory_of(obj)
        keepalive = memory.keepalive if memory.keepalive is not None else obj
        return Region(self._engine().register_memory(memory.address, memory.length, keepalive), self)

    def alloc(self, length: int, kind: str = "host", gpu: int = 0) -> Region:
        """``length`` bytes the engine allocates and registers: ``"host"``,
        ``"pinned"``, or ``"device"`` memory of GPU ``gpu`` (which exposes
        ``__cuda_array_interface__``)."""
        return Region(self._engine().alloc(length, kind, gpu), self)

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
