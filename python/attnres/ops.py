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

from . import _C as attnres_C
from . import _custom_ops  # noqa: F401  (registers torch.ops.attnres.*)
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


def attn_res(layer_residual, block_residual, res_weight, rms_weight, rms_eps: float, *,
             options: Options | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mixture [T, H] bf16, and fp32 rsigma, probs, logits [N, T]."""
    op = "attn_res"
    lr, was_3d = _squeeze(layer_residual, op, "layer_residual")
    mixture, rsigma, probs, logits = _ops.attn_res(
        lr, as_tensor(block_residual, op, "block_residual"), as_tensor(res_weight, op, "res_weight"),
        as_tensor(rms_weight, op, "rms_weight"), float(rms_eps), *(options or DEFAULT).as_args())
    return _restore(mixture, was_3d), rsigma, probs, logits


def attn_res_rmsnorm(layer_residual, block_residual, res_weight, rms_weight, norm_weight, rms_eps: float,
                     norm_eps: float, *, return_mixture: bool = False, options: Options | None = None):
    """output [T, H] = RMSNorm(mixture); with return_mixture, (output, mixture)."""
    op = "attn_res_rmsnorm"
    lr, was_3d = _squeeze(layer_residual, op, "layer_residual")
    output, mixture = _ops.attn_res_rmsnorm(
        lr, as_tensor(block_residual, op, "block_residual"), as_tensor(res_weight, op, "res_weight"),
        as_tensor(rms_weight, op, "rms_weight"), as_tensor(norm_weight, op, "norm_weight"), float(rms_eps),
        float(norm_eps), bool(return_mixture), *(options or DEFAULT).as_args())
    if return_mixture:
        return _restore(output, was_3d), _restore(mixture, was_3d)
    return _restore(output, was_3d)


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
                         snapshot_slot: int | None = None, options: Options | None = None):
    """(updated, output[, mixture]): updated = prefix + add (+ add2) exactly as PyTorch's
    `prefix + (add + add2)` on bf16; output = RMSNorm(AttnRes(bank, updated)). With snapshot_slot, updated is
    also written into bank row snapshot_slot (>= K) of block_residual's storage."""
    op = "attn_res_add_rmsnorm"
    lr, was_3d = _squeeze(layer_residual, op, "layer_residual")
    add, _ = _squeeze(layer_residual_add, op, "layer_residual_add")
    add2, _ = _squeeze(layer_residual_add2, op, "layer_residual_add2")
    block = as_tensor(block_residual, op, "block_residual")
    weights = (as_tensor(res_weight, op, "res_weight"), as_tensor(rms_weight, op, "rms_weight"),
               as_tensor(norm_weight, op, "norm_weight"))
    opts = (options or DEFAULT).as_args()
    if snapshot_slot is None:
        updated, output, mixture = _ops.attn_res_add_rmsnorm(
            lr, add, add2, block, *weights, float(rms_eps), float(norm_eps), bool(return_mixture), *opts)
    else:
        slot = operator.index(snapshot_slot)
        if slot < 0:
            raise attnres_C.ArgumentError(f"{op}: snapshot_slot must be None or a row index >= K, got {slot}")
        bank = _bank_through_slot(block, slot, op)
        K = block.shape[0] if block.dim() == 3 else 0
        updated, output, mixture = _ops.attn_res_add_rmsnorm_snapshot(
            lr, add, add2, bank, K, slot, *weights, float(rms_eps), float(norm_eps), bool(return_mixture), *opts)
    result = (_restore(updated, was_3d), _restore(output, was_3d))
    return result + (_restore(mixture, was_3d),) if return_mixture else result


def attn_res_add_rmsnorm_persistent(layer_residual, block_residual, res_weight, rms_weight, norm_weight,
                                    rms_eps: float, norm_eps: float, *, layer_residual_add=None,
                                    options: Options | None = None):
    """(updated or None, output) on the persistent kernel (large T); declines layer_residual_add2."""
    op = "attn_res_add_rmsnorm_persistent"
    lr, was_3d = _squeeze(layer_residual, op, "layer_residual")
    add, _ = _squeeze(layer_residual_add, op, "layer_residual_add")
    updated, output = _ops.attn_res_add_rmsnorm_persistent(
        lr, add, as_tensor(block_residual, op, "block_residual"), as_tensor(res_weight, op, "res_weight"),
        as_tensor(rms_weight, op, "rms_weight"), as_tensor(norm_weight, op, "norm_weight"), float(rms_eps),
        float(norm_eps), *(options or Options(topology="persistent")).as_args())
    return (_restore(updated, was_3d) if add is not None else None), _restore(output, was_3d)
