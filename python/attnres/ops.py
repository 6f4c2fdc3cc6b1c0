"""The public Python API of the attention-residual ops (docs/ops/*.md).

Each function takes torch tensors (or DLPack producers), allocates its outputs, and runs on the tensors'
device: the CPU backend for CPU tensors, the Hopper kernels for CUDA tensors (on the current stream). They
go through torch.ops.attnres.*, so they also trace under torch.compile and capture in CUDA graphs.

`layer_residual` (and the addends) may be [T, H] or [T, 1, H]; outputs come back in the same rank.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from . import _C, _custom_ops  # noqa: F401  (registers torch.ops.attnres.*)
from . import fp8 as _fp8
from ._tensors import as_tensor
from .options import DEFAULT, Options

_ops = torch.ops.attnres


def _squeeze(t: Tensor | None, op: str, name: str) -> tuple[Tensor | None, bool]:
    """[T, 1, H] -> [T, H] view; other ranks pass through for the library to judge."""
    t = as_tensor(t, op, name)
    if t is not None and t.dim() == 3 and t.shape[1] == 1:
        return t.squeeze(1), True
    return t, False


def _restore(t: Tensor | None, was_3d: bool) -> Tensor | None:
    return t.unsqueeze(1) if (t is not None and was_3d) else t


def _slot(op: str, snapshot_slot) -> int:
    slot = operator.index(snapshot_slot)
    if slot < 0:
        raise _C.ArgumentError(f"{op}: snapshot_slot must be None or a row index >= K, got {slot}")
    return slot


def _fp8_args(op: str, fp8, fp8_pow2_scales) -> tuple[str | None, bool]:
    """The validated FP8 keywords: (mode or None, pow2)."""
    mode = _fp8.check_mode(op, fp8)
    pow2 = bool(fp8_pow2_scales)
    if mode is None and pow2:
        raise _C.ArgumentError(f"{op}: fp8_pow2_scales requires fp8 = per_token or block128")
    return mode, pow2


def attn_res(layer_residual, block_residual, res_weight, rms_weight, rms_eps: float, *,
             snapshot_slot: int | None = None, options: Options | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mixture [T, H] bf16, and fp32 rsigma, probs, logits [N, T]. With snapshot_slot, layer_residual is also
    written into bank row snapshot_slot (>= K) of block_residual's storage."""
    op = "attn_res"
    lr, was_3d = _squeeze(layer_residual, op, "layer_residual")
    block = as_tensor(block_residual, op, "block_residual")
    weights = (as_tensor(res_weight, op, "res_weight"), as_tensor(rms_weight, op, "rms_weight"))
    opts = (options or DEFAULT).as_args()
    if snapshot_slot is None:
        mixture, rsigma, probs, logits = _ops.attn_res(lr, block, *weights, float(rms_eps), *opts)
    else:
        slot = _slot(op, snapshot_slot)
        K = block.shape[0] if block.dim() == 3 else 0
        mixture, rsigma, probs, logits = _ops.attn_res_snapshot(
            lr, _bank_through_slot(block, slot, op), K, slot, *weights, float(rms_eps), *opts)
    return _restore(mixture, was_3d), rsigma, probs, logits


def attn_res_rmsnorm(layer_residual, block_residual, res_weight, rms_weight, norm_weight, rms_eps: float,
                     norm_eps: float, *, return_mixture: bool = False, snapshot_slot: int | None = None,
                     fp8: str | None = None, fp8_pow2_scales: bool = False, options: Options | None = None):
    """output [T, H] = RMSNorm(mixture); with return_mixture, (output, mixture). With fp8 ("per_token" or
    "block128") the result gains (output_fp8, scales): output quantized to e4m3 (docs/ops/attn_res_rmsnorm.md).
    With snapshot_slot, layer_residual is also written into bank row snapshot_slot (>= K)."""
    op = "attn_res_rmsnorm"
    mode, pow2 = _fp8_args(op, fp8, fp8_pow2_scales)
    lr, was_3d = _squeeze(layer_residual, op, "layer_residual")
    block = as_tensor(block_residual, op, "block_residual")
    weights = (as_tensor(res_weight, op, "res_weight"), as_tensor(rms_weight, op, "rms_weight"),
               as_tensor(norm_weight, op, "norm_weight"))
    scalars = (float(rms_eps), float(norm_eps), bool(return_mixture))
    opts = (options or DEFAULT).as_args()
    q = s = None
    if snapshot_slot is not None:
        slot = _slot(op, snapshot_slot)
        K = block.shape[0] if block.dim() == 3 else 0
        output, mixture, q, s = _ops.attn_res_rmsnorm_snapshot(
            lr, _bank_through_slot(block, slot, op), K, slot, *weights, *scalars, mode or "none", pow2, *opts)
    elif mode is not None:
        output, mixture, q, s = _ops.attn_res_rmsnorm_fp8(lr, block, *weights, *scalars, mode, pow2, *opts)
    else:
        output, mixture = _ops.attn_res_rmsnorm(lr, block, *weights, *scalars, *opts)
    result = (_restore(output, was_3d),) + ((_restore(mixture, was_3d),) if return_mixture else ())
    if mode is not None:
        result += (_restore(q, was_3d), s)
    return result if len(result) > 1 else result[0]


def _bank_through_slot(block: Tensor, slot: int, op: str) -> Tensor:
    """The bank as a [max(K, slot + 1), T, H] view of block_residual's storage, so the snapshot row (outside
    the [K, T, H] candidate view) is addressed through the same strides. Rows past the storage are refused
    here in eager mode (a clear message) and by the op itself when compiled (the view's storage offset is
    not traceable)."""
    if block.dim() != 3 or min(block.stride()) < 0:
        return block  # the library rejects the rank or the strides
    K, T, H = block.shape
    rows = max(K, slot + 1)
    if not torch.compiler.is_compiling():
        _custom_ops.check_bank_in_storage(block, rows, op)
    return block.as_strided((rows, T, H), block.stride())


def attn_res_add_rmsnorm(layer_residual, layer_residual_add, block_residual, res_weight, rms_weight, norm_weight,
                         rms_eps: float, norm_eps: float, *, layer_residual_add2=None, return_mixture: bool = False,
                         snapshot_slot: int | None = None, fp8: str | None = None, fp8_pow2_scales: bool = False,
                         options: Options | None = None):
    """(updated, output[, mixture][, output_fp8, scales]): updated = prefix + add (+ add2) exactly as PyTorch's
    `prefix + (add + add2)` on bf16; output = RMSNorm(AttnRes(bank, updated)). With snapshot_slot, updated is
    also written into bank row snapshot_slot (>= K) of block_residual's storage. With fp8 ("per_token" or
    "block128"), output is also returned quantized to e4m3 with its fp32 scales."""
    op = "attn_res_add_rmsnorm"
    mode, pow2 = _fp8_args(op, fp8, fp8_pow2_scales)
    lr, was_3d = _squeeze(layer_residual, op, "layer_residual")
    add, _ = _squeeze(layer_residual_add, op, "layer_residual_add")
    add2, _ = _squeeze(layer_residual_add2, op, "layer_residual_add2")
    block = as_tensor(block_residual, op, "block_residual")
    weights = (as_tensor(res_weight, op, "res_weight"), as_tensor(rms_weight, op, "rms_weight"),
               as_tensor(norm_weight, op, "norm_weight"))
    scalars = (float(rms_eps), float(norm_eps), bool(return_mixture))
    opts = (options or DEFAULT).as_args()
    q = s = None
    if snapshot_slot is None:
        if mode is None:
            updated, output, mixture = _ops.attn_res_add_rmsnorm(lr, add, add2, block, *weights, *scalars, *opts)
        else:
            updated, output, mixture, q, s = _ops.attn_res_add_rmsnorm_fp8(
                lr, add, add2, block, *weights, *scalars, mode, pow2, *opts)
    else:
        slot = _slot(op, snapshot_slot)
        bank = _bank_through_slot(block, slot, op)
        K = block.shape[0] if block.dim() == 3 else 0
        if mode is None:
            updated, output, mixture = _ops.attn_res_add_rmsnorm_snapshot(
                lr, add, add2, bank, K, slot, *weights, *scalars, *opts)
        else:
            updated, output, mixture, q, s = _ops.attn_res_add_rmsnorm_snapshot_fp8(
                lr, add, add2, bank, K, slot, *weights, *scalars, mode, pow2, *opts)
    result = (_restore(updated, was_3d), _restore(output, was_3d))
    if return_mixture:
        result += (_restore(mixture, was_3d),)
    if mode is not None:
        result += (_restore(q, was_3d), s)
    return result


def attn_res_add_rmsnorm_persistent(layer_residual, block_residual, res_weight, rms_weight, norm_weight,
                                    rms_eps: float, norm_eps: float, *, layer_residual_add=None,
                                    fp8: str | None = None, fp8_pow2_scales: bool = False,
                                    options: Options | None = None):
    """(updated or None, output[, output_fp8, scales]) on the persistent kernel (large T); declines
    layer_residual_add2."""
    op = "attn_res_add_rmsnorm_persistent"
    mode, pow2 = _fp8_args(op, fp8, fp8_pow2_scales)
    lr, was_3d = _squeeze(layer_residual, op, "layer_residual")
    add, _ = _squeeze(layer_residual_add, op, "layer_residual_add")
    args = (lr, add, as_tensor(block_residual, op, "block_residual"), as_tensor(res_weight, op, "res_weight"),
            as_tensor(rms_weight, op, "rms_weight"), as_tensor(norm_weight, op, "norm_weight"), float(rms_eps),
            float(norm_eps))
    opts = (options or Options(topology="persistent")).as_args()
    if mode is None:
        updated, output = _ops.attn_res_add_rmsnorm_persistent(*args, *opts)
        return (_restore(updated, was_3d) if add is not None else None), _restore(output, was_3d)
    updated, output, q, s = _ops.attn_res_add_rmsnorm_persistent_fp8(*args, mode, pow2, *opts)
    return (_restore(updated, was_3d) if add is not None else None), _restore(output, was_3d), _restore(q, was_3d), s
