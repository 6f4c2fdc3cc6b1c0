"""torch.ops.attnres.*: the ops as torch.library ops with fake (meta) implementations, so they run
eagerly, under CUDA-graph capture and inside torch.compile graphs. Each real implementation allocates its
outputs with torch.empty and hands everything to the C++ library (validation, plan, launch on the current
stream). Each fake implementation runs the same C++ validator on the fake tensors' shapes, dtypes and
layouts (require_outputs=false), so a malformed call raises the same ArgumentError while tracing."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C
from ._registry import custom_op, note_writes
from ._tensors import _hint, c_dtype, fake_refs, ref, ref_leading_rows, stream_of
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


def _fake_check(op, *, rms_eps: float, norm_eps: float = 1e-5, snapshot_slot=-1, block_rows=None, fp8=None,
                fp8_pow2_scales=False, **tensors) -> None:
    """The real op's validation of a fake call (inputs only; outputs are the fake's own). block_rows: the
    snapshot op's K, the rows of the bank that are candidates; fp8: attnres.fp8's mode (None: no FP8 output)."""
    refs = fake_refs(_C.op_name(op), tensors)
    if refs is None:
        return
    args = _C.AttnResArgs()
    for key, r in refs.items():
        if key == "block_residual" and block_rows is not None and len(r.shape) == 3:
            r = _C.TensorRef(r.data, c_dtype(tensors[key].dtype), r.device_type, r.device_index,
                             [block_rows, *r.shape[1:]], r.strides)
        setattr(args, key, r)
    args.rms_eps, args.norm_eps = float(rms_eps), float(norm_eps)
    args.snapshot_slot = snapshot_slot
    args.fp8 = getattr(_C.Fp8Scales, fp8 or "none")
    args.fp8_pow2_scales = bool(fp8_pow2_scales)
    _C.validate(op, args, False)


# ---------------------------------------------------------------------------------------------- attn_res
@custom_op("attn_res", mutates_args=())
def attn_res_op(
    layer_residual: Tensor,
    block_residual: Tensor,
    res_weight: Tensor,
    rms_weight: Tensor,
    rms_eps: float,
    topology: str = "auto",
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
    _fake_check(_OPS.attn_res, layer_residual=layer_residual, block_residual=block_residual, res_weight=res_weight,
                rms_weight=rms_weight, rms_eps=rms_eps)
    T, H = layer_residual.shape
    N = block_residual.shape[0] + 1
    mixture = layer_residual.new_empty((T, H))
    return mixture, *(layer_residual.new_empty((N, T), dtype=torch.float32) for _ in range(3))


# -------------------------------------------------------------------------------------- attn_res_rmsnorm
@custom_op("attn_res_rmsnorm", mutates_args=())
def attn_res_rmsnorm_op(
    layer_residual: Tensor,
    block_residual: Tensor,
    res_weight: Tensor,
    rms_weight: Tensor,
    norm_weight: Tensor,
    rms_eps: float,
    norm_eps: float,
    return_mixture: bool = False,
    topology: str = "auto",
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
    _fake_check(_OPS.attn_res_rmsnorm, layer_residual=layer_residual, block_residual=block_residual,
                res_weight=res_weight, rms_weight=rms_weight, norm_weight=norm_weight, rms_eps=rms_eps,
                norm_eps=norm_eps)
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


@custom_op("attn_res_add_rmsnorm", mutates_args=())
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
    topology: str = "auto",
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
    _fake_check(_OPS.attn_res_add_rmsnorm, layer_residual=layer_residual, layer_residual_add=layer_residual_add,
                layer_residual_add2=layer_residual_add2, block_residual=block_residual, res_weight=res_weight,
                rms_weight=rms_weight, norm_weight=norm_weight, rms_eps=rms_eps, norm_eps=norm_eps)
    return _add_rmsnorm_fake(layer_residual, return_mixture)


def check_bank_in_storage(bank: Tensor, rows: int, op: str) -> None:
    """Refuses a snapshot row that lies past the bank's storage (the C++ layer sees only pointers)."""
    _, T, H = bank.shape
    s = bank.stride()
    last = bank.storage_offset() + (rows - 1) * s[0] + (T - 1) * s[1] + (H - 1) * s[2]
    if (last + 1) * bank.element_size() > bank.untyped_storage().nbytes():
        raise _C.ArgumentError(f"{op}: snapshot_slot {rows - 1} lies outside block_residual's storage "
                         f"(the bank must be allocated with at least {rows} snapshot rows)")


def _check_bank_rows(bank: Tensor, num_snapshots, snapshot_slot) -> None:
    """The snapshot op's own arguments (no C++ argument holds them): the K candidate rows and the snapshot
    row must be rows of `bank`, so no view built from them reaches past the bank's storage."""
    op = "attn_res_add_rmsnorm"
    K, slot = _hint(num_snapshots), _hint(snapshot_slot)
    if K is not None and K < 0:
        raise _C.ArgumentError(f"{op}: num_snapshots must be >= 0, got {K}")
    if bank.dim() != 3:
        return  # the library rejects block_residual's rank
    rows = _hint(bank.shape[0])
    if None in (K, slot, rows):
        return
    if K > rows:
        raise _C.ArgumentError(f"{op}: num_snapshots {K} exceeds the bank's {rows} rows")
    if slot >= rows:
        raise _C.ArgumentError(f"{op}: snapshot_slot {slot} lies outside the bank's {rows} rows (the bank must "
                               f"hold at least {slot + 1} snapshot rows)")


# The snapshot-writing variant mutates the bank, so it takes the bank as a whole ([rows, T, H] with rows >
# snapshot_slot) plus the candidate count K, and declares the mutation: functionalization under
# torch.compile then sees the write.
@custom_op("attn_res_add_rmsnorm_snapshot", mutates_args=("bank",))
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
    topology: str = "auto",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_bank_rows(bank, num_snapshots, snapshot_slot)
    # A compiled graph can build the bank view past its storage (its as_strided is not bounds-checked).
    if bank.dim() == 3 and min(bank.stride()) >= 0:
        check_bank_in_storage(bank, max(num_snapshots, snapshot_slot + 1), "attn_res_add_rmsnorm")
    note_writes(bank)
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
    _check_bank_rows(bank, num_snapshots, snapshot_slot)
    _fake_check(_OPS.attn_res_add_rmsnorm, layer_residual=layer_residual, layer_residual_add=layer_residual_add,
                layer_residual_add2=layer_residual_add2, block_residual=bank, res_weight=res_weight,
                rms_weight=rms_weight, norm_weight=norm_weight, rms_eps=rms_eps, norm_eps=norm_eps,
                snapshot_slot=_hint(snapshot_slot), block_rows=_hint(num_snapshots))
    return _add_rmsnorm_fake(layer_residual, return_mixture)


# ----------------------------------------------------------------------- attn_res_add_rmsnorm_persistent
@custom_op("attn_res_add_rmsnorm_persistent", mutates_args=())
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
    _fake_check(_OPS.attn_res_add_rmsnorm_persistent, layer_residual=layer_residual,
                layer_residual_add=layer_residual_add, block_residual=block_residual, res_weight=res_weight,
                rms_weight=rms_weight, norm_weight=norm_weight, rms_eps=rms_eps, norm_eps=norm_eps)
    T, H = layer_residual.shape
    return layer_residual.new_empty((T, H) if layer_residual_add is not None else (0,)), layer_residual.new_empty((T, H))


from . import _custom_ops_variants  # noqa: E402,F401  (the FP8 and snapshot-writing variants)
