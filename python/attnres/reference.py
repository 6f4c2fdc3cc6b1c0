"""The test oracle: a float64 evaluation of the contract's formulas (docs/ops/common.md) with its rounding
boundaries emulated — the prefix update in bf16 exactly as PyTorch adds bf16 tensors, the mixture rounded
to bf16 once, the trailing norm's two roundings. Slow and simple on purpose; never used by the library.

`check_close` applies the contract's accuracy rule: cosine similarity > 0.9999 and relative L2 error
< 5e-3 for bf16 tensors, relative L2 error < 1e-4 for the fp32 diagnostics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

COSINE_MIN = 0.9999
REL_L2_MAX = 5e-3
DIAG_REL_MAX = 1e-4


@dataclass
class Result:
    updated: Tensor | None  # bf16 [T, H], None without an addend
    mixture: Tensor  # bf16 [T, H]
    output: Tensor  # bf16 [T, H] (the mixture without a norm weight)
    rsigma: Tensor  # float64 [N, T]
    probs: Tensor  # float64 [N, T]
    logits: Tensor  # float64 [N, T]


def prefix_update(layer_residual: Tensor, add: Tensor | None = None, add2: Tensor | None = None) -> Tensor:
    """Contract step 1, bit-exact: bf16 tensor adds are fp32 adds rounded to bf16 (no flush)."""
    if add is None:
        return layer_residual.clone()
    s = add if add2 is None else add + add2
    return layer_residual + s


def two_rounding_rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Contract step 7 in float64: normed = bf16(x * r), output = bf16(normed * weight)."""
    x64 = x.double()
    r = torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + eps)
    normed = (x64 * r).to(torch.bfloat16)
    return (normed.double() * weight.reshape(-1).double()).to(torch.bfloat16)


def attn_res(layer_residual: Tensor, block_residual: Tensor, res_weight: Tensor, rms_weight: Tensor,
             rms_eps: float, *, layer_residual_add: Tensor | None = None, layer_residual_add2: Tensor | None = None,
             norm_weight: Tensor | None = None, norm_eps: float = 0.0) -> Result:
    """All outputs of every op for one call ([T, H] prefix, [K, T, H] bank), on the CPU in float64."""
    lr = layer_residual.detach().cpu()
    P = prefix_update(lr, None if layer_residual_add is None else layer_residual_add.detach().cpu(),
                      None if layer_residual_add2 is None else layer_residual_add2.detach().cpu())
    bank = block_residual.detach().cpu()
    V = torch.cat([bank.double(), P.double().unsqueeze(0)], dim=0)  # [N, T, H]
    H = V.shape[-1]
    q = rms_weight.detach().cpu().reshape(H).double() * res_weight.detach().cpu().reshape(H).double()
    rsigma = torch.rsqrt((V * V).mean(-1) + rms_eps)  # [N, T]
    logits = rsigma * (V @ q)
    # With N = 1 the mixture is P itself (ops.md step 6), also when the logit is not finite (rms_eps = 0 and a
    # zero row: rsigma = inf, logit = inf * 0 = NaN).
    probs = torch.softmax(logits, dim=0) if V.shape[0] > 1 else torch.ones_like(logits)
    mixture = (probs.unsqueeze(-1) * V).sum(0).to(torch.bfloat16)
    output = mixture if norm_weight is None else two_rounding_rmsnorm(mixture, norm_weight.detach().cpu(), norm_eps)
    return Result(updated=None if layer_residual_add is None else P, mixture=mixture, output=output, rsigma=rsigma,
                  probs=probs, logits=logits)


def metrics(actual: Tensor, expected: Tensor) -> tuple[float, float]:
    """(cosine similarity, relative L2 error) over the whole tensor, in float64."""
    a = actual.detach().cpu().double().flatten()
    e = expected.detach().cpu().double().flatten()
    denom = e.norm()
    rel = float((a - e).norm() / denom) if denom > 0 else float((a - e).norm())
    na, ne = a.norm(), e.norm()
    cos = float(a.dot(e) / (na * ne)) if na > 0 and ne > 0 else (1.0 if torch.equal(a, e) else 0.0)
    return cos, rel


def check_close(actual: Tensor, expected: Tensor, what: str = "output") -> None:
    """The contract's accuracy rule; raises AssertionError naming the tensor and both metrics."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().cpu().double()
    if not torch.isfinite(a).all():
        raise AssertionError(f"{what}: non-finite values in the result")
    if expected.dtype == torch.bfloat16 or actual.dtype == torch.bfloat16:
        cos, rel = metrics(actual, expected)
        if not (cos > COSINE_MIN and rel < REL_L2_MAX):
            raise AssertionError(f"{what}: cosine {cos:.6f} (need > {COSINE_MIN}), rel L2 {rel:.2e} (need < {REL_L2_MAX})")
    else:
        # fp32 diagnostics: relative L2 error over the [N, T] tensor (a logit near zero has no meaningful
        # elementwise relative error).
        _, rel = metrics(actual, expected)
        if not rel < DIAG_REL_MAX:
            raise AssertionError(f"{what}: relative L2 error {rel:.2e} (need < {DIAG_REL_MAX})")
