"""finalize_moe_output: the MoE tail after a deferred finalize (combine, all-reduce across tensor-parallel
ranks, norm), fused where the gate and the layout allow, else the unfused sequence."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from . import _C
from ._tensors import as_tensor
from .moe_gate import FinalizeDecision, _note, supports_fused_moe_finalize
from .moe_ops import OP, _argument_error, check_index_range, moe_finalize
from .moe_unfused import rmsnorm_two_rounding, unfused_moe_finalize

# The fused op's range (attnres/limits.hpp), quoted in the messages of the checks below.
MAX_TOKENS = _C.limits["moe_finalize_max_tokens"]
MAX_ROUTES = _C.limits["moe_finalize_max_routes"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_well_formed(rows: Tensor, weights: Tensor, index: Tensor, shared: Tensor | None,
                       norm_weight: Tensor | None, eps: float, scale: float) -> None:
    """What no path can compute: raises with the fused op's messages, whichever path is taken next. The
    unfused sequence takes more than the fused op (any floating dtype, any D, any strides), so these are
    the rules of that wider contract, not a restatement of the C++ validator's."""
    if index.dim() == 1:
        raise _argument_error("index", f"must be a 2-D [T, k] tensor, got a flat map of shape {list(index.shape)} "
                                       "(reshape it to [T, k])")
    if index.dim() != 2:
        raise _argument_error("index", f"must be a 2-D [T, k] tensor, got {index.dim()} dimensions {list(index.shape)}")
    T, k = index.shape
    if T < 1:
        raise _argument_error("index", f"holds T = {T} tokens: T must be >= 1 (the fused op: in [1, {MAX_TOKENS}])")
    if k < 1:
        raise _argument_error("index", f"holds k = {k} routes per token: k must be >= 1 (the fused op: in [1, {MAX_ROUTES}])")
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise _argument_error("index", f"must be int32, got {_dtype_name(index.dtype)}")
    if weights.dim() != 2 or tuple(weights.shape) != (T, k):
        raise _argument_error("weights", f"must have the shape of index [T, k] = [{T}, {k}], got {list(weights.shape)}")
    if not weights.is_floating_point():
        raise _argument_error("weights", f"must be float32 or bfloat16, got {_dtype_name(weights.dtype)}")
    if rows.dim() != 2:
        raise _argument_error("rows", f"must be a 2-D [R, D] tensor, got {rows.dim()} dimensions {list(rows.shape)}")
    R, D = rows.shape
    if D < 1 or not rows.is_floating_point():
        raise _argument_error("rows", f"must hold D >= 1 floating-point columns, got {_dtype_name(rows.dtype)} "
                                      f"{list(rows.shape)}")
    if shared is not None:
        if shared.dim() != 2 or tuple(shared.shape) != (T, D):
            raise _argument_error("shared", f"must have shape [T, D] = [{T}, {D}], got {list(shared.shape)}")
        if shared.dtype != rows.dtype:
            raise _argument_error("shared", f"must be {_dtype_name(rows.dtype)} (the dtype of rows), got "
                                            f"{_dtype_name(shared.dtype)}")
    if norm_weight is not None:
        if norm_weight.dim() != 1:
            raise _argument_error("norm_weight", f"must be a 1-D [D] tensor, got {norm_weight.dim()} dimensions "
                                                 f"{list(norm_weight.shape)}")
        if norm_weight.shape[0] != D:
            raise _argument_error("norm_weight", f"must have shape [D] = [{D}], got {list(norm_weight.shape)}")
        if norm_weight.dtype != rows.dtype:
            raise _argument_error("norm_weight", f"must be {_dtype_name(rows.dtype)} (the dtype of rows), got "
                                                 f"{_dtype_name(norm_weight.dtype)}")
    for name, t in (("weights", weights), ("index", index), ("shared", shared), ("norm_weight", norm_weight)):
        if t is not None and t.device != rows.device:
            raise _argument_error(name, f"is on {t.device} but rows is on {rows.device} (all tensors must be on one device)")
    if not math.isfinite(eps) or eps < 0:
        raise _argument_error("eps", f"must be finite and >= 0, got {eps!r}")
    if not math.isfinite(scale):
        raise _argument_error("scale", f"must be finite, got {scale!r}")
    if rows.device.type == "cpu":
        check_index_range(index, R)


def _kernel_layout_decline(rows: Tensor, weights: Tensor, index: Tensor, shared: Tensor | None,
                           norm_weight: Tensor | None) -> str:
    """Why the fused kernel cannot read these tensors as laid out ("" when it can). The helper then takes
    the unfused path, which reads any strided view correctly: a slower path, never a misread."""
    T, k = index.shape
    if index.dtype != torch.int32:
        return f"index is {index.dtype} (the kernel reads int32)"
    for name, t in (("weights", weights), ("index", index)):
        if (k > 1 and t.stride(1) != 1) or (T > 1 and t.stride(0) != k):
            return f"{name} is not dense [T, k] (strides {list(t.stride())})"
    cuda = rows.device.type == "cuda"
    for name, t in (("rows", rows), ("shared", shared), ("norm_weight", norm_weight)):
        if t is None:
            continue
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} has a non-unit innermost stride (strides {list(t.stride())})"
        if t.dim() == 2 and t.shape[0] > 1 and (t.stride(0) % 8 != 0 or t.stride(0) < t.shape[1]):
            return f"{name} row stride {t.stride(0)} is not a multiple of 8 elements of at least D"
        if cuda and t.numel() > 0 and t.data_ptr() % 16 != 0:
            return f"{name} is not 16-byte aligned"
    return ""


def finalize_moe_output(rows, weights, index, *, shared=None, norm_weight=None, eps: float, scale: float = 1.0,
                        world_size: int = 1, all_reduce: Callable[[Tensor], object] | None = None,
                        max_tokens: int | None = None) -> Tensor:
    """The MoE tail after a deferred finalize: combine (+ shared), all-reduce across `world_size` ranks,
    norm. Fused (one moe_finalize call) when supports_fused_moe_finalize and the tensors' layout allow,
    else the unfused PyTorch sequence; the decision is recorded and logged. Malformed inputs raise on both
    paths. With world_size > 1, `all_reduce(x)` sums the [T, D] partials in place (e.g.
    torch.distributed.all_reduce) between the combine and the norm; `shared` is this rank's partial; the
    combine runs fused (moe_finalize without its norm, path "fused_combine") where a world_size = 1 call without
    the norm would, else unfused."""
    rows = as_tensor(rows, OP, "rows")
    weights = as_tensor(weights, OP, "weights")
    index = as_tensor(index, OP, "index")
    shared = as_tensor(shared, OP, "shared")
    norm_weight = as_tensor(norm_weight, OP, "norm_weight")
    eps, scale = float(eps), float(scale)
    _check_well_formed(rows, weights, index, shared, norm_weight, eps, scale)
    if world_size > 1 and all_reduce is None:
        raise ValueError(f"{OP}: world_size = {world_size} needs all_reduce (the partial sums are all-reduced "
                         "between the combine and the norm)")

    T, k = index.shape
    D = rows.shape[1]
    # Under TP the norm must follow the all-reduce, so the kernel can run the combine (+ shared) alone: what it
    # must support then is that world_size = 1 call without the norm (the same gate, dtypes and device).
    fused, reason = supports_fused_moe_finalize(T, k, D, (rows.dtype, weights.dtype), rows.device, 1,
                                                max_tokens=max_tokens)
    if fused:
        reason = _kernel_layout_decline(rows, weights, index, shared, norm_weight if world_size == 1 else None)
        fused = not reason
    if fused and world_size > 1:
        path, reason = "fused_combine", (f"world_size = {world_size}: the fused combine without the norm, then "
                                         "all_reduce, then the norm")
    else:
        path = "fused" if fused else "unfused"
    _note(FinalizeDecision(path, reason, T, k, D, str(rows.device), world_size))

    if world_size == 1:
        if fused:
            return moe_finalize(rows, weights, index, shared=shared, norm_weight=norm_weight, eps=eps, scale=scale)
        return unfused_moe_finalize(rows, weights, index, shared=shared, norm_weight=norm_weight, eps=eps, scale=scale)
    combine = moe_finalize if fused else unfused_moe_finalize
    x = combine(rows, weights, index, shared=shared, eps=eps, scale=scale)
    reduced = all_reduce(x)
    if isinstance(reduced, Tensor):
        x = reduced
    return x if norm_weight is None else rmsnorm_two_rounding(x, norm_weight, eps)
