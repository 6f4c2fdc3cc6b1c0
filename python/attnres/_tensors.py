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
}

ABSENT = _C.TensorRef()


def as_tensor(x, op: str, name: str):
    """Accepts a torch.Tensor, None, or any DLPack producer (zero-copy through torch.from_dlpack)."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    if hasattr(x, "__dlpack__"):
        return torch.from_dlpack(x)
    raise TypeError(f"{op}: {name} must be a torch.Tensor or a DLPack producer, got {type(x).__name__}")


def ref(t: torch.Tensor | None, op: str, name: str) -> _C.TensorRef:
    if t is None:
        return ABSENT
    dev = t.device
    if dev.type == "cuda":
        dev_type, dev_index = _C.DeviceType.cuda, dev.index if dev.index is not None else torch.cuda.current_device()
    elif dev.type == "cpu":
        dev_type, dev_index = _C.DeviceType.cpu, 0
    else:
        raise ValueError(f"{op}: {name} is on {dev}: only cpu and cuda tensors are supported")
    return _C.TensorRef(t.data_ptr(), _DTYPES.get(t.dtype, _C.DType.other), dev_type, dev_index, t.shape, t.stride())


def stream_of(t: torch.Tensor) -> int:
    """The caller's current stream on t's device (0 for CPU tensors)."""
    if t.device.type != "cuda":
        return 0
    return torch.cuda.current_stream(t.device).cuda_stream
