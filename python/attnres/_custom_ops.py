"""torch.ops.attnres.*: the ops as torch.library custom ops with fake (meta) implementations, so they run
eagerly, under CUDA-graph capture and inside torch.compile graphs. Each real implementation allocates its
outputs with torch.empty and hands everything to the C++ library (validation, plan, launch on the current
stream)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C
from ._tensors import ref, ref_leading_rows, stream_of
from .options import DEFAULT as _DEFAULT_OPTIONS, Options

# The schemas' defaults are the library's (attnres::Options in attn_res.hpp, through attnres.Options).
_SPLIT_MAX_TOKENS = _DEFAULT_OPTIONS.split_max_tokens

_OPS = _C.AttnResOp


def _rows(t: Tensor) -> tuple[int, int]:
    """(T, H) of a [T, H] tensor; (0, 0) for anything else (the library then rejects its rank)."""
    return (t.shape[0], t.shape[1]) if t.dim() == 2 else (0, 0)


def _candidates(block: Tensor) -> int:
    return block.shape[0] + 1 if block.dim() == 3 else 0


def _empty_rows(like: Tensor, wanted: bool = True) -> Tensor:
    T, H = _rows(like)
    return torch.empty((T, H) if wanted else (0,), dtype=torch.bfloat16, device=like.device)


def _run(op, options: Options, **tensors) -> None:
    name = _C.op_name(op)
    args = _C.AttnResArgs()
    snapshot_slot = tensors.pop("snapshot_slot", -1)
    args.fp8 = getattr(_C.Fp8Scales, tensors.pop("fp8", None) or "none")
    args.fp8_pow2_scales = bool(tensors.pop("fp8_pow2_scales", False))
    for key, value in tensors.items():
        if key in ("rms_eps", "norm_eps"):
            setattr(args, key, float(value))
        elif isinstance(value, _C.TensorRef):
            setattr(args, key, value)
        else:
            setattr(args, key, ref(value, name, key))
    args.snapshot_slot = snapshot_slot
    args.stream = stream_of(tensors["layer_residual"])
    _C.run(op, args, options.to_c())


# ---------------------------------------------------------------------------------------------- attn_res
@torch.library.custom_op("attnres::attn_res", mutates_args=())
def attn_res_op(
    layer_residual: Tensor,
    block_residual: Tensor,
    res_weight: Tensor,
    rms_weight: Tensor,
    rms_eps: float,
    topology: str = "per_token",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    T, _ = _rows(layer_residual)
    N = _candidates(block_residual)
    mixture = _empty_rows(layer_residual)
    diag = [torch.empty((N, T), dtype=torch.float32, device=layer_residual.device) for _ in range(3)]
    _run(
        _OPS.attn_res,
        Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster),
        layer_residual=layer_residual,
        block_residual=block_residual,
        res_weight=res_weight,
        rms_weight=rms_weight,
        rms_eps=rms_eps,
        output=mixture,
        rsigma=diag[0],
        probs=diag[1],
        logits=diag[2],
    )
    return mixture, diag[0], diag[1], diag[2]


@attn_res_op.register_fake
def _(layer_residual, block_residual, res_weight, rms_weight, rms_eps, *options):
    T, H = layer_residual.shape
    N = block_residual.shape[0] + 1
    mixture = layer_residual.new_empty((T, H))
    return mixture, *(layer_residual.new_empty((N, T), dtype=torch.float32) for _ in range(3))


# -------------------------------------------------------------------------------------- attn_res_rmsnorm
@torch.library.custom_op("attnres::attn_res_rmsnorm", mutates_args=())
def attn_res_rmsnorm_op(
    layer_residual: Tensor,
    block_residual: Tensor,
    res_weight: Tensor,
    rms_weight: Tensor,
    norm_weight: Tensor,
    rms_eps: float,
    norm_eps: float,
    return_mixture: bool = False,
    topology: str = "per_token",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
) -> tuple[Tensor, Tensor]:
    output = _empty_rows(layer_residual)
    mixture = _empty_rows(layer_residual, return_mixture)
    _run(
        _OPS.attn_res_rmsnorm,
        Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster),
        layer_residual=layer_residual,
        block_residual=block_residual,
        res_weight=res_weight,
        rms_weight=rms_weight,
        norm_weight=norm_weight,
        rms_eps=rms_eps,
        norm_eps=norm_eps,
        output=output,
        mixture=mixture if return_mixture else None,
    )
    return output, mixture


@attn_res_rmsnorm_op.register_fake
def _(layer_residual, block_residual, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture=False,
      *options):
    T, H = layer_residual.shape
    return layer_residual.new_empty((T, H)), layer_residual.new_empty((T, H) if return_mixture else (0,))


# ---------------------------------------------------------------------------------- attn_res_add_rmsnorm
def _add_rmsnorm(op, layer_residual, layer_residual_add, layer_residual_add2, block_residual, res_weight, rms_weight,
                 norm_weight, rms_eps, norm_eps, return_mixture, snapshot_slot, options, extra=None):
    updated = _empty_rows(layer_residual, layer_residual_add is not None)
    output = _empty_rows(layer_residual)
    mixture = _empty_rows(layer_residual, return_mixture)
    _run(
        op,
        options,
        layer_residual=layer_residual,
        layer_residual_add=layer_residual_add,
        layer_residual_add2=layer_residual_add2,
        block_residual=block_residual,
        res_weight=res_weight,
        rms_weight=rms_weight,
        norm_weight=norm_weight,
        rms_eps=rms_eps,
        norm_eps=norm_eps,
        output=output,
        updated=updated if layer_residual_add is not None else None,
        mixture=mixture if return_mixture else None,
        snapshot_slot=snapshot_slot,
        **(extra or {}),
    )
    return updated, output, mixture


@torch.library.custom_op("attnres::attn_res_add_rmsnorm", mutates_args=())
def attn_res_add_rmsnorm_op(
    layer_residual: Tensor,
    layer_residual_add: Optional[Tensor],
    layer_residual_add2: Optional[Tensor],
    block_residual: Tensor,
    res_weight: Tensor,
    rms_weight: Tensor,
    norm_weight: Tensor,
    rms_eps: float,
    norm_eps: float,
    return_mixture: bool = False,
    topology: str = "per_token",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    return _add_rmsnorm(
        _OPS.attn_res_add_rmsnorm, layer_residual, layer_residual_add, layer_residual_add2, block_residual,
        res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture, -1,
        Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster))


def _add_rmsnorm_fake(layer_residual, return_mixture):
    T, H = layer_residual.shape
    return (layer_residual.new_empty((T, H)), layer_residual.new_empty((T, H)),
            layer_residual.new_empty((T, H) if return_mixture else (0,)))


@attn_res_add_rmsnorm_op.register_fake
def _(layer_residual, layer_residual_add, layer_residual_add2, block_residual, res_weight, rms_weight, norm_weight,
      rms_eps, norm_eps, return_mixture=False, *options):
    return _add_rmsnorm_fake(layer_residual, return_mixture)


def check_bank_in_storage(bank: Tensor, rows: int, op: str) -> None:
    """Refuses a snapshot row that lies past the bank's storage (the C++ layer sees only pointers)."""
    _, T, H = bank.shape
    s = bank.stride()
    last = bank.storage_offset() + (rows - 1) * s[0] + (T - 1) * s[1] + (H - 1) * s[2]
    if (last + 1) * bank.element_size() > bank.untyped_storage().nbytes():
        raise ValueError(f"{op}: snapshot_slot {rows - 1} lies outside block_residual's storage "
                         f"(the bank must be allocated with at least {rows} snapshot rows)")


# The snapshot-writing variant mutates the bank, so it takes the bank as a whole ([rows, T, H] with rows >
# snapshot_slot) plus the candidate count K, and declares the mutation: functionalization under
# torch.compile then sees the write.
@torch.library.custom_op("attnres::attn_res_add_rmsnorm_snapshot", mutates_args=("bank",))
def attn_res_add_rmsnorm_snapshot_op(
    layer_residual: Tensor,
    layer_residual_add: Optional[Tensor],
    layer_residual_add2: Optional[Tensor],
    bank: Tensor,
    num_snapshots: int,
    snapshot_slot: int,
    res_weight: Tensor,
    rms_weight: Tensor,
    norm_weight: Tensor,
    rms_eps: float,
    norm_eps: float,
    return_mixture: bool = False,
    topology: str = "per_token",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    if bank.dim() == 3 and min(bank.stride()) >= 0 and snapshot_slot >= 0:
        check_bank_in_storage(bank, max(num_snapshots, snapshot_slot + 1), "attn_res_add_rmsnorm")
    # The candidates are the bank's first K rows, addressed from the bank's own pointer (valid for K = 0).
    block = ref_leading_rows(bank, num_snapshots, "attn_res_add_rmsnorm", "block_residual") \
        if bank.dim() == 3 else bank
    return _add_rmsnorm(
        _OPS.attn_res_add_rmsnorm, layer_residual, layer_residual_add, layer_residual_add2, block, res_weight,
        rms_weight, norm_weight, rms_eps, norm_eps, return_mixture, snapshot_slot,
        Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster))


@attn_res_add_rmsnorm_snapshot_op.register_fake
def _(layer_residual, layer_residual_add, layer_residual_add2, bank, num_snapshots, snapshot_slot, res_weight,
      rms_weight, norm_weight, rms_eps, norm_eps, return_mixture=False, *options):
    return _add_rmsnorm_fake(layer_residual, return_mixture)


# ----------------------------------------------------------------------- attn_res_add_rmsnorm_persistent
@torch.library.custom_op("attnres::attn_res_add_rmsnorm_persistent", mutates_args=())
def attn_res_add_rmsnorm_persistent_op(
    layer_residual: Tensor,
    layer_residual_add: Optional[Tensor],
    block_residual: Tensor,
    res_weight: Tensor,
    rms_weight: Tensor,
    norm_weight: Tensor,
    rms_eps: float,
    norm_eps: float,
    topology: str = "persistent",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
) -> tuple[Tensor, Tensor]:
    updated, output, _ = _add_rmsnorm(
        _OPS.attn_res_add_rmsnorm_persistent, layer_residual, layer_residual_add, None, block_residual,
        res_weight, rms_weight, norm_weight, rms_eps, norm_eps, False, -1,
        Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster))
    return updated, output


@attn_res_add_rmsnorm_persistent_op.register_fake
def _(layer_residual, layer_residual_add, block_residual, res_weight, rms_weight, norm_weight, rms_eps, norm_eps,
      *options):
    T, H = layer_residual.shape
    return layer_residual.new_empty((T, H) if layer_residual_add is not None else (0,)), layer_residual.new_empty((T, H))


from . import _custom_ops_variants  # noqa: E402,F401  (the FP8 and snapshot-writing variants)
