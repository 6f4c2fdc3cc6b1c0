"""Input sets and the callables each provider runs on them (one call = one decode-step epilogue)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import attnres

BF16 = torch.bfloat16
EPS = 1e-5


@dataclass
class StepSet:
    """One decode-step epilogue's inputs: the prefix, the MoE tail parts, the bank, the site's weights."""

    prefix: torch.Tensor  # [T, H]
    routed: torch.Tensor  # [T, H]
    shared: torch.Tensor  # [T, H]
    bank: torch.Tensor  # [K, T, H]
    res_weight: torch.Tensor  # [H]
    rms_weight: torch.Tensor
    norm_weight: torch.Tensor


def step_bytes(T: int, N: int, H: int) -> int:
    """Bytes one add2 call must move: N - 1 bank rows + prefix + 2 addends in, updated + output out, weights."""
    return (N - 1 + 3 + 2) * T * H * 2 + 3 * H * 2


def make_sets(T: int, N: int, H: int, count: int, seed: int = 0, device: str = "cuda") -> list[StepSet]:
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0, offset=0.0):
        return (torch.randn(*shape, generator=g, device=device) * scale + offset).to(BF16)

    sets = []
    for _ in range(count):
        sets.append(StepSet(prefix=rnd(T, H), routed=rnd(T, H, scale=0.5), shared=rnd(T, H, scale=0.5),
                            bank=rnd(N - 1, T, H, scale=2.0), res_weight=rnd(H, scale=0.02),
                            rms_weight=rnd(H, scale=0.1, offset=1.0), norm_weight=rnd(H, scale=0.1, offset=1.0)))
    return sets


def attnres_call(s: StepSet, variant: str, options: attnres.Options) -> Callable[[], object]:
    """variant: noadd (attn_res_rmsnorm on the prefix), add (one addend), add2 (the MoE-tail fold)."""
    w = (s.res_weight, s.rms_weight, s.norm_weight)
    if variant == "noadd":
        return lambda: attnres.attn_res_rmsnorm(s.prefix, s.bank, *w, EPS, EPS, options=options)
    if variant == "add":
        return lambda: attnres.attn_res_add_rmsnorm(s.prefix, s.routed, s.bank, *w, EPS, EPS, options=options)
    if variant == "add2":
        return lambda: attnres.attn_res_add_rmsnorm(s.prefix, s.routed, s.bank, *w, EPS, EPS,
                                                    layer_residual_add2=s.shared, options=options)
    raise ValueError(f"unknown variant {variant!r}")


def eager_tail_adds(s: StepSet) -> Callable[[], object]:
    """What the fold replaces: the two eager MoE-tail kernels, prefix + (routed + shared)."""
    return lambda: s.prefix + (s.routed + s.shared)


def torch_attn_res_step(prefix, add, bank, res_weight, rms_weight, norm_weight, rms_eps: float = EPS,
                        norm_eps: float = EPS):
    """The step as a PyTorch user writes it (fp32 math, the contract's roundings), with one addend or none
    (add=None): what attnres replaces."""
    updated = prefix if add is None else prefix + add
    V = torch.cat([bank, updated.unsqueeze(0)], 0).float()  # [N, T, H]
    q = rms_weight.float() * res_weight.float()
    rsigma = torch.rsqrt(V.pow(2).mean(-1) + rms_eps)  # [N, T]
    probs = torch.softmax(rsigma * (V @ q), dim=0)
    mixture = (probs.unsqueeze(-1) * V).sum(0).to(BF16)
    x = mixture.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps)).to(BF16)
    return updated, (normed.float() * norm_weight.float()).to(BF16)


def torch_step(prefix, routed, shared, bank, res_weight, rms_weight, norm_weight, rms_eps: float = EPS,
               norm_eps: float = EPS):
    """The MoE-tail step: prefix + (routed + shared), then the one-addend step's mixture and norm."""
    return torch_attn_res_step(prefix, routed + shared, bank, res_weight, rms_weight, norm_weight, rms_eps, norm_eps)


_compiled: dict = {}


def compiled(fn=None):
    """torch.compile of a step function (inductor, dynamic shapes: compiled once per function for a sweep)."""
    fn = fn or torch_step
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


def compiled_step():
    """torch.compile of torch_step."""
    return compiled(torch_step)


def torch_step_call(s: StepSet, compiled: bool) -> Callable[[], object]:
    fn = compiled_step() if compiled else torch_step
    return lambda: fn(s.prefix, s.routed, s.shared, s.bank, s.res_weight, s.rms_weight, s.norm_weight)
