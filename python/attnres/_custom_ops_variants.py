"""torch.ops.attnres.* variants that write more than the base ops: the FP8 output (`*_fp8`: two more results,
the e4m3 codes and the fp32 scales) and the snapshot write on attn_res and attn_res_rmsnorm (`*_snapshot`,
mutating the bank). Registered as the base ops are (_registry.custom_op); their fake implementations run the
real op's validation (_fake_check) and then allocate the results exactly as the real ones do (the same
helpers, so every result has its real shape and strides: block128 scales column-major with the token stride
padded to a multiple of 4), so they trace under torch.compile and refuse what the real op refuses.

The snapshot variants take the whole bank plus the candidate count K; K is checked against the bank's rows
and the snapshot row against its storage before the library sees a pointer."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C, fp8 as _fp8
from ._custom_ops import (_OPS, _SPLIT_MAX_TOKENS, _add_rmsnorm, _empty_rows, _fake_check, _rows, _run,
                          check_bank_in_storage)
from ._registry import custom_op, note_writes
from ._tensors import _hint, ref_leading_rows
from .options import Options


def fp8_mode(op: str, fp8: str) -> str | None:
    """The schema's string ("none", "per_token", "block128") as attnres.fp8's mode (None for "none")."""
    return _fp8.check_mode(op, None if fp8 == "none" else fp8)


def _fp8_outputs(like: Tensor, mode: str | None) -> tuple[Tensor, Tensor]:
    """The FP8 outputs of a [T, H] call (real, fake or meta, as `like`): [T, H] e4m3 codes and the mode's
    scales; empty (0,) tensors without FP8."""
    T, H = _rows(like)
    if mode is None:
        return (torch.empty((0,), dtype=torch.float8_e4m3fn, device=like.device),
                torch.empty((0,), dtype=torch.float32, device=like.device))
    return (torch.empty((T, H), dtype=torch.float8_e4m3fn, device=like.device),
            _fp8.empty_scales(mode, T, H, like.device))


def _fp8_tensors(mode: str | None, q: Tensor, s: Tensor, pow2: bool) -> dict:
    if mode is None:
        return {"fp8_pow2_scales": pow2}  # the library refuses pow2 without a mode
    return {"fp8": mode, "fp8_pow2_scales": pow2, "output_fp8": q, "fp8_scales": s}


def _fp8_flags(mode: str | None, pow2: bool) -> dict:
    """The FP8 arguments _fake_check judges (the library refuses pow2 without a mode)."""
    return {"fp8": mode, "fp8_pow2_scales": pow2}


def _check_num_snapshots(bank: Tensor, num_snapshots, op: str) -> None:
    """K must be a count of the bank's rows (real or fake; a size without an example value is not judged)."""
    if bank.dim() != 3:
        return  # the library rejects the rank
    K, rows = _hint(num_snapshots), _hint(bank.shape[0])
    if K is not None and rows is not None and not 0 <= K <= rows:
        raise _C.ArgumentError(f"{op}: num_snapshots = {K} must be in [0, {rows}] (the bank holds {rows} rows)")


def snapshot_candidates(bank: Tensor, num_snapshots: int, snapshot_slot: int, op: str):
    """The [K, T, H] candidates of a whole bank, after checking K against the bank's rows and the snapshot row
    against its storage (what the library cannot see from pointers)."""
    if bank.dim() != 3:
        return bank  # the library rejects the rank
    _check_num_snapshots(bank, num_snapshots, op)
    if min(bank.stride()) >= 0 and snapshot_slot >= 0:
        check_bank_in_storage(bank, max(num_snapshots, snapshot_slot + 1), op)
    return ref_leading_rows(bank, num_snapshots, op, "block_residual")


def _snapshot_fake_check(op_code, op: str, bank: Tensor, num_snapshots, snapshot_slot, **tensors) -> None:
    """A snapshot variant's fake validation: K against the bank's rows, then the library's rules on the K
    candidate rows and the snapshot row."""
    _check_num_snapshots(bank, num_snapshots, op)
    _fake_check(op_code, block_residual=bank, snapshot_slot=_hint(snapshot_slot), block_rows=_hint(num_snapshots),
                **tensors)


# ------------------------------------------------------------------------------------ attn_res_snapshot
def _attn_res_outputs(layer_residual: Tensor, num_snapshots) -> tuple[Tensor, list[Tensor]]:
    T, _ = _rows(layer_residual)
    N = max(num_snapshots + 1, 0)
    diag = [torch.empty((N, T), dtype=torch.float32, device=layer_residual.device) for _ in range(3)]
    return _empty_rows(layer_residual), diag


@custom_op("attn_res_snapshot", mutates_args=("bank",))
def attn_res_snapshot_op(
    layer_residual: Tensor,
    bank: Tensor,
    num_snapshots: int,
    snapshot_slot: int,
    res_weight: Tensor,
    rms_weight: Tensor,
    rms_eps: float,
    topology: str = "auto",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    block = snapshot_candidates(bank, num_snapshots, snapshot_slot, "attn_res")
    note_writes(bank)
    mixture, diag = _attn_res_outputs(layer_residual, num_snapshots)
    _run(_OPS.attn_res, Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster),
         layer_residual=layer_residual, block_residual=block, res_weight=res_weight, rms_weight=rms_weight,
         rms_eps=rms_eps, output=mixture, rsigma=diag[0], probs=diag[1], logits=diag[2],
         snapshot_slot=snapshot_slot)
    return mixture, diag[0], diag[1], diag[2]


@attn_res_snapshot_op.register_fake
def _(layer_residual, bank, num_snapshots, snapshot_slot, res_weight, rms_weight, rms_eps, *options):
    _snapshot_fake_check(_OPS.attn_res, "attn_res", bank, num_snapshots, snapshot_slot,
                         layer_residual=layer_residual, res_weight=res_weight, rms_weight=rms_weight,
                         rms_eps=rms_eps)
    mixture, diag = _attn_res_outputs(layer_residual, num_snapshots)
    return mixture, *diag


# ------------------------------------------------------------------ attn_res_rmsnorm: fp8 and snapshot
def _rmsnorm_outputs(layer_residual, return_mixture, mode):
    return (_empty_rows(layer_residual), _empty_rows(layer_residual, return_mixture),
            *_fp8_outputs(layer_residual, mode))


def _rmsnorm(layer_residual, block, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture, mode,
             pow2, snapshot_slot, options):
    output, mixture, q, s = _rmsnorm_outputs(layer_residual, return_mixture, mode)
    _run(_OPS.attn_res_rmsnorm, options, layer_residual=layer_residual, block_residual=block,
         res_weight=res_weight, rms_weight=rms_weight, norm_weight=norm_weight, rms_eps=rms_eps, norm_eps=norm_eps,
         output=output, mixture=mixture if return_mixture else None, snapshot_slot=snapshot_slot,
         **_fp8_tensors(mode, q, s, pow2))
    return output, mixture, q, s


@custom_op("attn_res_rmsnorm_fp8", mutates_args=())
def attn_res_rmsnorm_fp8_op(
    layer_residual: Tensor,
    block_residual: Tensor,
    res_weight: Tensor,
    rms_weight: Tensor,
    norm_weight: Tensor,
    rms_eps: float,
    norm_eps: float,
    return_mixture: bool,
    fp8: str,
    fp8_pow2_scales: bool = False,
    topology: str = "auto",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _rmsnorm(layer_residual, block_residual, res_weight, rms_weight, norm_weight, rms_eps, norm_eps,
                    return_mixture, fp8_mode("attn_res_rmsnorm", fp8), fp8_pow2_scales, -1,
                    Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster))


@attn_res_rmsnorm_fp8_op.register_fake
def _(layer_residual, block_residual, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture, fp8,
      fp8_pow2_scales=False, *options):
    mode = fp8_mode("attn_res_rmsnorm", fp8)
    _fake_check(_OPS.attn_res_rmsnorm, layer_residual=layer_residual, block_residual=block_residual,
                res_weight=res_weight, rms_weight=rms_weight, norm_weight=norm_weight, rms_eps=rms_eps,
                norm_eps=norm_eps, **_fp8_flags(mode, fp8_pow2_scales))
    return _rmsnorm_outputs(layer_residual, return_mixture, mode)


@custom_op("attn_res_rmsnorm_snapshot", mutates_args=("bank",))
def attn_res_rmsnorm_snapshot_op(
    layer_residual: Tensor,
    bank: Tensor,
    num_snapshots: int,
    snapshot_slot: int,
    res_weight: Tensor,
    rms_weight: Tensor,
    norm_weight: Tensor,
    rms_eps: float,
    norm_eps: float,
    return_mixture: bool = False,
    fp8: str = "none",
    fp8_pow2_scales: bool = False,
    topology: str = "auto",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    op = "attn_res_rmsnorm"
    block = snapshot_candidates(bank, num_snapshots, snapshot_slot, op)
    note_writes(bank)
    return _rmsnorm(layer_residual, block, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture,
                    fp8_mode(op, fp8), fp8_pow2_scales, snapshot_slot,
                    Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster))


@attn_res_rmsnorm_snapshot_op.register_fake
def _(layer_residual, bank, num_snapshots, snapshot_slot, res_weight, rms_weight, norm_weight, rms_eps, norm_eps,
      return_mixture=False, fp8="none", fp8_pow2_scales=False, *options):
    mode = fp8_mode("attn_res_rmsnorm", fp8)
    _snapshot_fake_check(_OPS.attn_res_rmsnorm, "attn_res_rmsnorm", bank, num_snapshots, snapshot_slot,
                         layer_residual=layer_residual, res_weight=res_weight, rms_weight=rms_weight,
                         norm_weight=norm_weight, rms_eps=rms_eps, norm_eps=norm_eps,
                         **_fp8_flags(mode, fp8_pow2_scales))
    return _rmsnorm_outputs(layer_residual, return_mixture, mode)


# --------------------------------------------------------------------------- attn_res_add_rmsnorm: fp8
def _add_rmsnorm_fp8(op, layer_residual, layer_residual_add, layer_residual_add2, block, res_weight, rms_weight,
                     norm_weight, rms_eps, norm_eps, return_mixture, mode, pow2, snapshot_slot, options):
    q, s = _fp8_outputs(layer_residual, mode)
    updated, output, mixture = _add_rmsnorm(
        op, layer_residual, layer_residual_add, layer_residual_add2, block, res_weight, rms_weight, norm_weight,
        rms_eps, norm_eps, return_mixture, snapshot_slot, options, extra=_fp8_tensors(mode, q, s, pow2))
    return updated, output, mixture, q, s


def _add_rmsnorm_fp8_outputs(layer_residual, layer_residual_add, return_mixture, mode):
    """What _add_rmsnorm_fp8 returns, allocated for a fake call (updated is empty without an addend)."""
    return (_empty_rows(layer_residual, layer_residual_add is not None), _empty_rows(layer_residual),
            _empty_rows(layer_residual, return_mixture), *_fp8_outputs(layer_residual, mode))


@custom_op("attn_res_add_rmsnorm_fp8", mutates_args=())
def attn_res_add_rmsnorm_fp8_op(
    layer_residual: Tensor,
    layer_residual_add: Optional[Tensor],
    layer_residual_add2: Optional[Tensor],
    block_residual: Tensor,
    res_weight: Tensor,
    rms_weight: Tensor,
    norm_weight: Tensor,
    rms_eps: float,
    norm_eps: float,
    return_mixture: bool,
    fp8: str,
    fp8_pow2_scales: bool = False,
    topology: str = "auto",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _add_rmsnorm_fp8(
        _OPS.attn_res_add_rmsnorm, layer_residual, layer_residual_add, layer_residual_add2, block_residual,
        res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture,
        fp8_mode("attn_res_add_rmsnorm", fp8), fp8_pow2_scales, -1,
        Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster))


@attn_res_add_rmsnorm_fp8_op.register_fake
def _(layer_residual, layer_residual_add, layer_residual_add2, block_residual, res_weight, rms_weight, norm_weight,
      rms_eps, norm_eps, return_mixture, fp8, fp8_pow2_scales=False, *options):
    mode = fp8_mode("attn_res_add_rmsnorm", fp8)
    _fake_check(_OPS.attn_res_add_rmsnorm, layer_residual=layer_residual, layer_residual_add=layer_residual_add,
                layer_residual_add2=layer_residual_add2, block_residual=block_residual, res_weight=res_weight,
                rms_weight=rms_weight, norm_weight=norm_weight, rms_eps=rms_eps, norm_eps=norm_eps,
                **_fp8_flags(mode, fp8_pow2_scales))
    return _add_rmsnorm_fp8_outputs(layer_residual, layer_residual_add, return_mixture, mode)


@custom_op("attn_res_add_rmsnorm_snapshot_fp8", mutates_args=("bank",))
def attn_res_add_rmsnorm_snapshot_fp8_op(
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
    return_mixture: bool,
    fp8: str,
    fp8_pow2_scales: bool = False,
    topology: str = "auto",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    op = "attn_res_add_rmsnorm"
    block = snapshot_candidates(bank, num_snapshots, snapshot_slot, op)
    note_writes(bank)
    return _add_rmsnorm_fp8(
        _OPS.attn_res_add_rmsnorm, layer_residual, layer_residual_add, layer_residual_add2, block, res_weight,
        rms_weight, norm_weight, rms_eps, norm_eps, return_mixture, fp8_mode(op, fp8), fp8_pow2_scales,
        snapshot_slot, Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster))


@attn_res_add_rmsnorm_snapshot_fp8_op.register_fake
def _(layer_residual, layer_residual_add, layer_residual_add2, bank, num_snapshots, snapshot_slot, res_weight,
      rms_weight, norm_weight, rms_eps, norm_eps, return_mixture, fp8, fp8_pow2_scales=False, *options):
    mode = fp8_mode("attn_res_add_rmsnorm", fp8)
    _snapshot_fake_check(_OPS.attn_res_add_rmsnorm, "attn_res_add_rmsnorm", bank, num_snapshots, snapshot_slot,
                         layer_residual=layer_residual, layer_residual_add=layer_residual_add,
                         layer_residual_add2=layer_residual_add2, res_weight=res_weight, rms_weight=rms_weight,
                         norm_weight=norm_weight, rms_eps=rms_eps, norm_eps=norm_eps,
                         **_fp8_flags(mode, fp8_pow2_scales))
    return _add_rmsnorm_fp8_outputs(layer_residual, layer_residual_add, return_mixture, mode)


@custom_op("attn_res_add_rmsnorm_persistent_fp8", mutates_args=())
def attn_res_add_rmsnorm_persistent_fp8_op(
    layer_residual: Tensor,
    layer_residual_add: Optional[Tensor],
    block_residual: Tensor,
    res_weight: Tensor,
    rms_weight: Tensor,
    norm_weight: Tensor,
    rms_eps: float,
    norm_eps: float,
    fp8: str,
    fp8_pow2_scales: bool = False,
    topology: str = "persistent",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    updated, output, _, q, s = _add_rmsnorm_fp8(
        _OPS.attn_res_add_rmsnorm_persistent, layer_residual, layer_residual_add, None, block_residual, res_weight,
        rms_weight, norm_weight, rms_eps, norm_eps, False, fp8_mode("attn_res_add_rmsnorm_persistent", fp8),
        fp8_pow2_scales, -1, Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster))
    return updated, output, q, s


@attn_res_add_rmsnorm_persistent_fp8_op.register_fake
def _(layer_residual, layer_residual_add, block_residual, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, fp8,
      fp8_pow2_scales=False, *options):
    mode = fp8_mode("attn_res_add_rmsnorm_persistent", fp8)
    _fake_check(_OPS.attn_res_add_rmsnorm_persistent, layer_residual=layer_residual,
                layer_residual_add=layer_residual_add, block_residual=block_residual, res_weight=res_weight,
                rms_weight=rms_weight, norm_weight=norm_weight, rms_eps=rms_eps, norm_eps=norm_eps,
                **_fp8_flags(mode, fp8_pow2_scales))
    updated, output, _, q, s = _add_rmsnorm_fp8_outputs(layer_residual, layer_residual_add, False, mode)
    return updated, output, q, s
