"""gdr's exceptions: one hierarchy under :class:`GdrError`, mirroring the
engine's typed errors. Each also derives from the builtin a Python caller
already catches where one fits (``ValueError``, ``TimeoutError``,
``ConnectionError``, ``MemoryError``). The message is the Rust error's,
with its cause.
"""

from __future__ import annotations

__all__ = [
    "GdrError",
    "InvalidArgument",
    "NotSupported",
    "Unavailable",
    "DeviceError",
    "OutOfMemory",
    "Busy",
    "Timeout",
    "PeerGone",
    "ConnectFailed",
    "Refused",
    "Revoked",
    "Cancelled",
    "TransferFailed",
]


class GdrError(Exception):
    """Every error gdr raises."""


class InvalidArgument(GdrError, ValueError):
    """A bad argument: a size, a range past a buffer's end, an object of
    another engine, an object gdr cannot take memory from, a malformed
    descriptor or URI. Nothing was done."""


class NotSupported(GdrError):
    """This engine cannot do that at all (managed memory, a copy between two
    host buffers on a stream, ...)."""


class Unavailable(GdrError):
    """No device or backend for it: no NIC, no GPU of that index, a backend
    this build or machine lacks."""


class DeviceError(GdrError):
    """A verbs or CUDA call failed; the message keeps the native code."""


class OutOfMemory(GdrError, MemoryError):
    """Memory of that size could not be allocated (host memory the
    allocator refuses, pinned or device memory CUDA refuses). Nothing was
    allocated; the process goes on."""


class Busy(GdrError):
    """Still in use: release it once what uses it has ended."""


class Timeout(GdrError, TimeoutError):
    """A deadline passed. For a batch, its queue pair was stopped first:
    nothing of it still runs."""


class PeerGone(GdrError, ConnectionError):
    """The peer (or the path to it) is gone: reconnect."""


class ConnectFailed(GdrError, ConnectionError):
    """Connecting or accepting failed: refused, rejected, not accepted in
    time, or a handshake that does not fit."""


class Refused(GdrError):
    """The peer's grant does not allow it: rights, bounds, a grant not
    announced on this connection, or the peer's NIC refused the access."""


class Revoked(Refused):
    """The grant was revoked while the request was under way."""


class Cancelled(GdrError):
    """The batch was cancelled; nothing of it still runs."""


class TransferFailed(GdrError):
    """A request failed locally or was flushed after another one on its
    queue pair failed; the message says which."""
