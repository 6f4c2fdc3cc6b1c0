"""Torch tensors (or DLPack producers) -> attnres._C.TensorRef: pointer, dtype, device, shape, strides.

Passing integers rather than importing through DLPack keeps the call path free of stream synchronisation,
so calls can be captured in CUDA graphs (docs/design.md).
"""

from __future__ import annotations

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
    torch.float8_e4m3fn: _C.DType.e4m3,
}

ABSENT = _C.TensorRef()


def c_dtype(dtype: torch.dtype) -> _C.DType:
    """The library's code for a torch dtype (DType.other for the ones it has no name for)."""
    return _DTYPES.get(dtype, _C.DType.other)
_C_MAX_RANK = 4  # attnres::kMaxRank


def as_tensor(x, op: str, name: str):
    """Accepts a torch.Tensor, None, or any DLPack producer (zero-copy through torch.from_dlpack)."""
    if x is not None and not isinstance(x, torch.Tensor):
        if not hasattr(x, "__dlpack__"):
            raise TypeError(f"{op}: {name} must be a torch.Tensor or a DLPack producer, got {type(x).__name__}")
        x = torch.from_dlpack(x)
    # Checked before dispatch: a meta tensor among CPU tensors would otherwise be routed to the fake
    # implementation and "succeed" without computing anything.
    if x is not None and x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: {name} is on {x.device}: only cpu and cuda tensors are supported")
    return x


def ref(t: torch.Tensor | None, op: str, name: str) -> _C.TensorRef:
    if t is None:
        return ABSENT
    if t.dim() > _C_MAX_RANK:
        raise _C.ArgumentError(f"{op}: {name} has rank {t.dim()}: the library takes tensors of rank <= {_C_MAX_RANK}")
    dev = t.device
    if dev.type == "cuda":
        dev_type, dev_index = _C.DeviceType.cuda, dev.index if dev.index is not None else torch.cuda.current_device()
    elif dev.type == "cpu":
        dev_type, dev_index = _C.DeviceType.cpu, 0
    else:
        raise ValueError(f"{op}: {name} is on {dev}: only cpu and cuda tensors are supported")
    return _C.TensorRef(t.data_ptr(), c_dtype(t.dtype), dev_type, dev_index, t.shape, t.stride())


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
