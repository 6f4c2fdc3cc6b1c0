"""Torch tensors (or DLPack producers) -> attnres._C.TensorRef: pointer, dtype, device, shape, strides.

Passing integers rather than importing through DLPack keeps the call path free of stream synchronisation,
so calls can be captured in CUDA graphs (docs/design.md).
"""

from __future__ import annotations

import ctypes

import torch

from . import _C

_DTYPES = {
    torch.bfloat16: _C.DType.bf16,
    torch.float32: _C.DType.f32,
    torch.int32: _C.DType.i32,
    torch.float16: _C.DType.f16,
    torch.float64: _C.DType.f64,
    torch.int64: _C.DType.i64,
    torch.uint8: _C.DType.u8,
    torch.bool: _C.DType.boolean,
    torch.int8: _C.DType.i8,
    torch.int16: _C.DType.i16,
    torch.uint16: _C.DType.u16,
    torch.uint32: _C.DType.u32,
    torch.uint64: _C.DType.u64,
    torch.complex32: _C.DType.c32,
    torch.complex64: _C.DType.c64,
    torch.complex128: _C.DType.c128,
    torch.float8_e4m3fn: _C.DType.e4m3,
}

ABSENT = _C.TensorRef()


def c_dtype(dtype: torch.dtype) -> _C.DType:
    """The library's code for a torch dtype (DType.other for the ones it has no name for)."""
    return _DTYPES.get(dtype, _C.DType.other)
MAX_RANK = _C.limits["max_rank"]


# The head of DLPack's DLManagedTensor (dlpack.h): DLTensor first, so its strides are readable from the
# legacy "dltensor" capsule without importing it.
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_DL_CUDA = 2


def _dlpack_capsule(x):
    """x's legacy DLPack capsule, requested as torch.from_dlpack would (the consumer's stream on CUDA)."""
    device_type, device_id = x.__dlpack_device__() if hasattr(x, "__dlpack_device__") else (1, 0)
    if device_type == _DL_CUDA:
        stream = torch.cuda.current_stream(f"cuda:{device_id}").cuda_stream
        return x.__dlpack__(stream=1 if stream == 0 else stream)
    return x.__dlpack__()


_INT64_MAX = (1 << 63) - 1


def _refused_layout(capsule) -> str | None:
    """Why torch.from_dlpack would refuse the capsule's layout, or None. torch refuses these by throwing
    through a C++ boundary, which aborts the interpreter, so each is screened here: a negative stride, a
    negative size, or an element count or storage size (PyTorch's computeStorageNbytes: itemsize x (1 +
    sum (size - 1) x stride) + byte_offset) that overflows int64. Python integers do not overflow."""
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = [t.strides[i] for i in range(t.ndim)] if t.strides else None  # None: row-major contiguous
    if strides is not None and min(strides, default=0) < 0:
        return f"has a negative stride [{', '.join(map(str, strides))}]"
    if min(shape, default=0) < 0:
        return f"has a negative size [{', '.join(map(str, shape))}]"
    numel = 1
    for n in shape:
        numel *= n
    if strides is None:
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
    itemsize = max(1, t.dtype.bits * t.dtype.lanes // 8)
    extent = 0 if numel == 0 else itemsize * (1 + sum((n - 1) * s for n, s in zip(shape, strides)))
    if numel > _INT64_MAX or max(strides, default=0) > _INT64_MAX or extent + t.byte_offset > _INT64_MAX:
        return (f"has a layout whose storage size overflows int64 (shape [{', '.join(map(str, shape))}], strides "
                f"[{', '.join(map(str, strides))}]): no allocation can back it")
    return None


def as_tensor(x, op: str, name: str):
    """Accepts a torch.Tensor, None, or any DLPack producer (zero-copy through torch.from_dlpack). A producer
    is inspected first: torch.from_dlpack aborts the process on a layout it refuses (PyTorch's storage-size
    check throws through a C++ boundary), so such a view is refused here with the library's message."""
    if x is not None and not isinstance(x, torch.Tensor):
        if not hasattr(x, "__dlpack__"):
            raise TypeError(f"{op}: {name} must be a torch.Tensor or a DLPack producer, got {type(x).__name__}")
        capsule = _dlpack_capsule(x)
        why = _refused_layout(capsule)
        if why is not None:
            raise _C.ArgumentError(f"{op}: {name} {why}")
        x = torch.from_dlpack(capsule)
    if x is not None and x.device.type not in ("cpu", "cuda"):
        raise _C.ArgumentError(f"{op}: {name} is on {x.device}: only cpu and cuda tensors are supported")
    return x


def ref(t: torch.Tensor | None, op: str, name: str) -> _C.TensorRef:
    if t is None:
        return ABSENT
    # A TensorRef holds at most MAX_RANK dimensions, so the library cannot judge a larger rank itself.
    if t.dim() > MAX_RANK:
        raise _C.ArgumentError(f"{op}: {name} has rank {t.dim()}: the library takes tensors of rank <= {MAX_RANK}")
    dev = t.device
    if dev.type == "cuda":
        dev_type, dev_index = _C.DeviceType.cuda, dev.index if dev.index is not None else torch.cuda.current_device()
    elif dev.type == "cpu":
        dev_type, dev_index = _C.DeviceType.cpu, 0
    else:
        raise _C.ArgumentError(f"{op}: {name} is on {dev}: only cpu and cuda tensors are supported")
    return _C.TensorRef(t.data_ptr(), c_dtype(t.dtype), dev_type, dev_index, t.shape, t.stride())


def _hint(v) -> int | None:
    """A dimension's value while tracing: the example value of a symbolic size (no guard is added), None
    when it has none (an unbacked size)."""
    if isinstance(v, torch.SymInt):
        node = v.node
        # has_hint() and .hint read the example value without adding a guard (torch >= 2.4; the newer
        # has_guarding_hint/optimization_hint helpers are missing from some releases, e.g. 2.11)
        return int(node.hint) if node.has_hint() else None
    return int(v)


def fake_refs(op: str, tensors: dict) -> dict | None:
    """TensorRefs of fake (or meta) tensors for the library's validator: their shapes, strides, dtypes and
    devices, at distinct synthetic addresses (nothing is read). A meta tensor among real tensors, or two
    devices, raise ArgumentError: torch routes a call with one meta tensor to the fake implementation, which
    must not return unwritten outputs. None when a size has no example value (nothing more to judge)."""
    present = [(k, t) for k, t in tensors.items() if t is not None]
    first_name, first = present[0]
    for key, t in present[1:]:
        if t.device != first.device:
            raise _C.ArgumentError(f"{op}: {key} is on {t.device} but {first_name} is on {first.device} "
                                   "(all tensors must be on one device)")
    refs = {}
    for i, (key, t) in enumerate(present):
        if t.dim() > MAX_RANK:
            raise _C.ArgumentError(f"{op}: {key} has rank {t.dim()}: the library takes tensors of rank <= {MAX_RANK}")
        dims = [_hint(d) for d in (*t.shape, *t.stride(), t.storage_offset())]
        if None in dims:
            return None
        shape, strides, offset = dims[:t.dim()], dims[t.dim():-1], dims[-1]
        cuda = t.device.type == "cuda"
        refs[key] = _C.TensorRef(((i + 1) << 40) + offset * t.element_size(), c_dtype(t.dtype),
                                 _C.DeviceType.cuda if cuda else _C.DeviceType.cpu,
                                 (t.device.index or 0) if cuda else 0, shape, strides)
    return refs


def ref_leading_rows(t: torch.Tensor, rows: int, op: str, name: str) -> _C.TensorRef:
    """A TensorRef of t's first `rows` entries along dim 0, keeping t's data pointer even when rows == 0
    (PyTorch reports a null data_ptr for an empty view, and a snapshot write needs the bank's base)."""
    r = ref(t, op, name)
    return _C.TensorRef(r.data, c_dtype(t.dtype), r.device_type, r.device_index,
                        [rows, *t.shape[1:]], t.stride())


def stream_of(t: torch.Tensor) -> int:
    """The caller's current stream on t's device (0 for CPU tensors)."""
    if t.device.type != "cuda":
        return 0
    return torch.cuda.current_stream(t.device).cuda_stream
