"""The unfused MoE finalize: the PyTorch sequence a user would write (gather, weight, fp32 sum, round, add
shared, norm). The fallback of attnres.moe.finalize_moe_output and the benchmarks' baseline."""

from __future__ import annotations

import torch
from torch import Tensor


def rmsnorm_two_rounding(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """ops.md step 7 in PyTorch: normed = round(x * r), out = round(normed * weight), fp32 in between."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = (xf * r).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def unfused_moe_finalize(rows: Tensor, weights: Tensor, index: Tensor, *, shared: Tensor | None = None,
                         norm_weight: Tensor | None = None, eps: float, scale: float = 1.0) -> Tensor:
    """The PyTorch sequence: gather the routed rows, weight them, sum over k in fp32, round once, add the
    shared output, norm. Remote routes (-1) are masked (never multiplied: padding rows may hold NaN); a token
    with an out-of-range route gets a NaN row, as from the CUDA kernel. The output has rows' dtype."""
    T, k = index.shape
    R, D = rows.shape
    idx = index.long()
    local = (idx >= 0) & (idx < R)
    broken = ((idx < -1) | (idx >= R)).any(dim=1, keepdim=True)
    if R > 0:
        gathered = rows.index_select(0, torch.where(local, idx, 0).reshape(-1)).reshape(T, k, D).float()
    else:
        gathered = torch.zeros((T, k, D), dtype=torch.float32, device=rows.device)
    terms = torch.where(local.unsqueeze(-1), gathered * weights.float().unsqueeze(-1), 0.0)
    x = (terms.sum(dim=1) * scale).to(rows.dtype)
    if shared is not None:
        x = x + shared
    if norm_weight is not None:
        x = rmsnorm_two_rounding(x, norm_weight, eps)
    return torch.where(broken, torch.full_like(x, float("nan")), x)
