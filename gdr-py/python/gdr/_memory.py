"""Memory of Python objects: the address and length gdr registers, and what
keeps them valid (the object, plus the export that pins it: a memoryview
keeps a ``bytearray`` from being resized, a DLPack capsule owns its
tensor's reference).

Accepted, in this order (``via=`` picks one):

- ``(address, length, device)``: the raw form NIXL and Mooncake take
  (``device`` ``None`` or -1 for host memory); the caller keeps the memory
  valid while gdr uses it;
- ``__dlpack__`` (torch, CuPy, numpy, JAX): C-contiguous;
- ``__cuda_array_interface__`` (CuPy, torch CUDA tensors, Numba): version 2
  or later, C-contiguous;
- the buffer protocol (``bytes`` for reading, ``bytearray``,
  ``memoryview``, numpy arrays, ``array.array``, ``mmap``): C-contiguous.

DLPack comes first where an object has both: a transfer of GPU memory
registered through it is ordered after the work queued on the producer's
current stream by DLPack's own exchange (``__dlpack__(stream=...)``), with
no wait on anything else. Through the CUDA array interface it is ordered
after the stream the interface names, if it names one.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional

from .errors import InvalidArgument

__all__ = ["Memory", "memory_of"]


@dataclass(frozen=True)
class Memory:
    """Registrable memory: where it is, how long, and what keeps it."""

    address: int
    length: int
    device: Optional[int]
    readonly: bool
    #: What keeps it valid while this Memory lives (the object, with the
    #: memoryview or DLPack capsule that pins it). A region does not keep
    #: it: it holds its own export of the object (or the capsule) where no
    #: Python code can release it.
    keepalive: Any
    #: How it was taken: ``"raw"``, ``"dlpack"``, ``"cai"`` or ``"buffer"``.
    via: str = "raw"
    #: The object itself (what a transfer asks for its stream).
    source: Any = None


class _PyBuffer(ctypes.Structure):
    # Py_buffer, unchanged since CPython 3.3 (in the stable ABI from 3.11).
    # `obj` as a plain pointer: PyBuffer_Release drops its reference, not
    # ctypes.
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)),
        ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", ctypes.c_void_p),
    ]


_PyBUF_C_CONTIGUOUS = 0x0020 | 0x0008  # PyBUF_STRIDES | C contiguity
_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def _buffer_address(view: memoryview) -> int:
    """The address of a C-contiguous memoryview's first byte."""
    raw = _PyBuffer()
    if _get_buffer(view, ctypes.byref(raw), _PyBUF_C_CONTIGUOUS) != 0:
        raise InvalidArgument("the object's buffer is not C-contiguous")
    try:
        return int(raw.buf or 0)
    finally:
        _release_buffer(ctypes.byref(raw))


_TYPESTR_SIZES = {"b": 1, "u": 1, "i": 1, "f": 1, "c": 1, "V": 1, "?": 1}


def _itemsize(typestr: str) -> int:
    # "<f4", "|u1", ">i8", "<c8": the size is the digits after the kind.
    digits = "".join(ch for ch in typestr[2:] if ch.isdigit())
    if not digits:
        raise InvalidArgument(f"unknown element type {typestr!r}")
    return int(digits)


def _c_contiguous(shape: tuple[int, ...], strides: Optional[tuple[int, ...]], itemsize: int) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def _from_cuda_array_interface(obj: Any, cai: dict[str, Any]) -> Memory:
    version = int(cai.get("version", 0))
    if version < 2:
        raise InvalidArgument(f"__cuda_array_interface__ version {version} (2 or later needed)")
    shape = tuple(int(n) for n in cai["shape"])
    if any(extent < 0 for extent in shape):
        raise InvalidArgument(f"__cuda_array_interface__ shape {shape} has a negative extent")
    itemsize = _itemsize(str(cai["typestr"]))
    strides = cai.get("strides")
    strides = None if strides is None else tuple(int(s) for s in strides)
    if not _c_contiguous(shape, strides, itemsize):
        raise InvalidArgument("the array is not C-contiguous (make it so before registering)")
    address, readonly = cai["data"]
    length = itemsize
    for extent in shape:
        length *= extent
    return Memory(int(address), length, None, bool(readonly), obj, "cai", obj)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_pointer.restype = ctypes.c_void_p

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3


def _from_dlpack(obj: Any) -> Memory:
    try:
        capsule = obj.__dlpack__()
    except TypeError:
        capsule = obj.__dlpack__(stream=None)
    # A DLManagedTensor starts with its DLTensor. The capsule is kept (not
    # consumed): its destructor hands the tensor back once gdr lets go.
    try:
        pointer = _capsule_pointer(capsule, b"dltensor")
    except ValueError:
        # Renamed "used_dltensor" by a consumer (or no DLPack capsule at all).
        raise InvalidArgument(
            f"{type(obj).__name__}.__dlpack__ returned a capsule that is not an unconsumed "
            "DLPack tensor (was it consumed already?)"
        ) from None
    if not pointer:
        raise InvalidArgument("__dlpack__ returned no DLPack tensor")
    tensor = _DLTensor.from_address(pointer)
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    if any(extent < 0 for extent in shape):
        raise InvalidArgument(f"the DLPack tensor's shape {shape} has a negative extent")
    itemsize = max(1, tensor.dtype.bits * tensor.dtype.lanes // 8)
    strides = None
    if tensor.strides:
        strides = tuple(tensor.strides[i] * itemsize for i in range(tensor.ndim))
    if not _c_contiguous(shape, strides, itemsize):
        raise InvalidArgument("the tensor is not C-contiguous (make it so before registering)")
    length = itemsize
    for extent in shape:
        length *= extent
    kind = tensor.device.device_type
    if kind in (_DL_CPU, _DL_CUDA_HOST):
        device = None
    elif kind == _DL_CUDA:
        device = int(tensor.device.device_id)
    else:
        raise InvalidArgument(f"DLPack device type {kind} is not host or CUDA memory")
    address = int(tensor.data or 0) + int(tensor.byte_offset)
    return Memory(address, length, device, False, (obj, capsule), "dlpack", obj)


_VIAS = ("dlpack", "cai", "buffer")


def memory_of(obj: Any, *, writable: bool = False, via: Optional[str] = None) -> Memory:
    """Where ``obj``'s memory is, taken through ``via`` (``"dlpack"``,
    ``"cai"``, ``"buffer"``; ``None``: the first the object offers, in the
    order above); raises :class:`InvalidArgument` for an object gdr cannot
    take memory from that way."""
    if via is not None and via not in _VIAS:
        raise InvalidArgument(f'via: {via!r} is not "dlpack", "cai" or "buffer"')
    if via is not None:
        memory = _memory_via(obj, via)
    elif isinstance(obj, tuple):
        if len(obj) != 3:
            raise InvalidArgument("a raw memory tuple is (address, length, device)")
        address, length, device = obj
        if not isinstance(address, int) or not isinstance(length, int) or address <= 0 or length <= 0:
            raise InvalidArgument(f"raw memory: {length!r} bytes at {address!r}")
        if device is not None and (not isinstance(device, int) or device < -1):
            raise InvalidArgument(f"raw memory: device {device!r} is not a GPU index, -1 or None")
        return Memory(address, length, None if device in (None, -1) else device, False, None)
    elif hasattr(obj, "__dlpack__") and not isinstance(obj, (bytes, bytearray, memoryview)):
        try:
            memory = _from_dlpack(obj)
        except BufferError:
            # A read-only numpy array refuses DLPack export: its buffer
            # still serves.
            memory = _from_buffer(obj)
    elif getattr(obj, "__cuda_array_interface__", None) is not None:
        memory = _from_cuda_array_interface(obj, obj.__cuda_array_interface__)
    else:
        memory = _from_buffer(obj)
    if writable and memory.readonly:
        raise InvalidArgument("read-only memory cannot be written into (grant it for reading only)")
    if memory.length <= 0:
        raise InvalidArgument("the object holds no bytes")
    return memory


def _memory_via(obj: Any, via: str) -> Memory:
    if via == "dlpack":
        if not hasattr(obj, "__dlpack__"):
            raise InvalidArgument(f"{type(obj).__name__} has no __dlpack__")
        return _from_dlpack(obj)
    if via == "cai":
        cai = getattr(obj, "__cuda_array_interface__", None)
        if cai is None:
            raise InvalidArgument(f"{type(obj).__name__} has no __cuda_array_interface__")
        return _from_cuda_array_interface(obj, cai)
    return _from_buffer(obj)


def _from_buffer(obj: Any) -> Memory:
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidArgument(
            f"{type(obj).__name__} exposes no memory gdr can take (the buffer protocol, "
            "__dlpack__, __cuda_array_interface__ or (address, length, device))"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument("the buffer is not C-contiguous (make it so before registering)")
    if view.nbytes == 0:
        raise InvalidArgument("the object holds no bytes")
    # The memoryview stays with the region: while it lives a bytearray
    # cannot be resized (its memory moved) under the NIC.
    return Memory(_buffer_address(view), view.nbytes, None, bool(view.readonly), (obj, view), "buffer", obj)
