"""moe_finalize (docs/ops/moe_finalize.md): the fused MoE finalize epilogue as torch.ops.attnres.moe_finalize
and its public wrapper. Strict: every contract violation raises (the C++ validator states each rule)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C
from ._registry import custom_op
from ._tensors import as_tensor, fake_refs, ref, stream_of

OP = "moe_finalize"
KERNELS = ("auto", "cpu", "single_cta")


def _argument_error(arg: str, rule: str) -> _C.ArgumentError:
    return _C.ArgumentError(f"{OP}: {arg} {rule}")


def _options(pdl: bool, kernel: str) -> _C.MoeFinalizeOptions:
    if kernel not in KERNELS:
        raise ValueError(f"{OP}: kernel must be one of {KERNELS}, got {kernel!r}")
    o = _C.MoeFinalizeOptions()
    o.pdl = bool(pdl)
    o.kernel = getattr(_C.KernelKind, kernel)
    return o


# --------------------------------------------------------------------------------------- the custom op
@custom_op("moe_finalize", mutates_args=())
def moe_finalize_op(
    rows: Tensor,
    weights: Tensor,
    index: Tensor,
    shared: Optional[Tensor],  # noqa: UP045 (torch.library infers the schema from these annotations)
    norm_weight: Optional[Tensor],  # noqa: UP045
    eps: float,
    scale: float,
    pdl: bool = True,
    force_kernel: str = "auto",
) -> Tensor:
    T = index.shape[0] if index.dim() == 2 else 0
    D = rows.shape[1] if rows.dim() == 2 else 0
    output = torch.empty((T, D), dtype=torch.bfloat16, device=rows.device)
    args = _C.MoeFinalizeArgs()
    args.rows = ref(rows, OP, "rows")
    args.weights = ref(weights, OP, "weights")
    args.index = ref(index, OP, "index")
    args.shared = ref(shared, OP, "shared")
    args.norm_weight = ref(norm_weight, OP, "norm_weight")
    args.eps = float(eps)
    args.scale = float(scale)
    args.output = ref(output, OP, "output")
    args.stream = stream_of(rows)
    _C.moe_finalize(args, _options(pdl, force_kernel))
    return output


@moe_finalize_op.register_fake
def _(rows, weights, index, shared, norm_weight, eps, scale, pdl=True, force_kernel="auto"):
    # The real op's validation on the fake tensors' shapes, dtypes and layouts (nothing is read).
    refs = fake_refs(OP, {"rows": rows, "weights": weights, "index": index, "shared": shared,
                          "norm_weight": norm_weight})
    if refs is not None:
        args = _C.MoeFinalizeArgs()
        for key, r in refs.items():
            setattr(args, key, r)
        args.eps, args.scale = float(eps), float(scale)
        _C.moe_finalize_validate(args, require_output=False, read_data=False)
    T = index.shape[0] if index.dim() == 2 else 0
    D = rows.shape[1] if rows.dim() == 2 else 0
    return rows.new_empty((T, D), dtype=torch.bfloat16)


def check_index_range(index: Tensor, num_rows: int) -> None:
    """Raises the library's out-of-range message if any route is neither -1 nor a row in [0, num_rows).
    On a CUDA tensor this synchronizes (a debugging aid; the kernel itself writes NaN rows instead)."""
    bad = (index < -1) | (index >= num_rows)
    if bool(bad.any()):
        t, j = bad.nonzero()[0].tolist()
        v = int(index[t, j])
        raise _argument_error("index", f"value {v} at [{t}, {j}] is out of range: must be -1 (remote expert) or a "
                                       f"row of rows in [0, R = {num_rows})")


def moe_finalize(rows, weights, index, *, shared=None, norm_weight=None, eps: float, scale: float = 1.0,
                 check_index: bool = False, pdl: bool = True, kernel: str = "auto") -> Tensor:
    """out [T, D] bf16 = RMSNorm(bf16(scale * sum_j weights[t, j] * rows[index[t, j]]) + shared).

    rows [R, D] bf16 (innermost stride 1, row stride a multiple of 8); weights [T, k] fp32 or bf16 and index
    [T, k] int32, both dense; shared [T, D] bf16 and norm_weight [D] bf16 optional. Runs on the tensors'
    device (CUDA: the current stream). Out-of-range routes raise on the CPU; on CUDA the token's output row
    is NaN unless check_index=True, which scans the index first (synchronizes) and raises the same error."""
    rows = as_tensor(rows, OP, "rows")
    weights = as_tensor(weights, OP, "weights")
    index = as_tensor(index, OP, "index")
    if check_index and index.dim() == 2 and rows.dim() == 2 and not index.is_floating_point():
        check_index_range(index, rows.shape[0])
    return torch.ops.attnres.moe_finalize(rows, weights, index, as_tensor(shared, OP, "shared"),
                                          as_tensor(norm_weight, OP, "norm_weight"), float(eps), float(scale),
                                          bool(pdl), kernel)
