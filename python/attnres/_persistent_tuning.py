"""The persistent kernel's tuning knobs, for the benchmark's variants (python -m bench persistent
--variants) and the tests that hold every variant to split_k's bits. Private: not part of attnres.Options nor of
the torch.ops schemas.

A variant sets attnres::Options' persistent_blocks_per_sm (1 or 2 blocks per SM; two share the SM's shared
memory, so each gets a ring of half the size), persistent_slots (exactly this many ring slots) and
persistent_passes (1 or 2 passes over each row); 0 keeps the plan's choice (two blocks per SM where that
geometry exists and honours the other knobs, else one). None of them changes a result:
which thread owns an element and every reduction order depend on H alone (cpp/src/persistent_layout.hpp).
Values out of range raise attnres.ArgumentError (naming the op and the knob); a geometry that does not fit is
declined by the plan (attnres.UnsupportedError when called)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from . import _C
from . import ops
from .options import Options
from .planning import PlanInfo, device_info, plan_info

OP = "attn_res_add_rmsnorm_persistent"


@dataclass(frozen=True)
class Variant:
    """One geometry of the persistent kernel; 0: the plan's choice."""

    name: str
    blocks_per_sm: int = 0
    slots: int = 0
    passes: int = 0

    def __post_init__(self):
        for key in ("blocks_per_sm", "slots", "passes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool):
                raise _C.ArgumentError(f"{OP}: variant {self.name!r}: {key} must be an int, got {value!r}")

    def options(self, pdl: bool = True) -> "_TunedOptions":
        return _TunedOptions(self, pdl)


class _TunedOptions:
    """What the ops layer's runner asks of an options object (to_c), with the knobs set."""

    def __init__(self, variant: Variant, pdl: bool):
        self.variant, self.pdl = variant, pdl

    def to_c(self) -> _C.Options:
        o = Options(topology="persistent", pdl=self.pdl).to_c()
        o._persistent_blocks_per_sm = self.variant.blocks_per_sm
        o._persistent_slots = self.variant.slots
        o._persistent_passes = self.variant.passes
        return o


def plan(variant: Variant, *, tokens: int, candidates: int, hidden: int, add: bool = True, device="cuda",
         pdl: bool = True) -> PlanInfo:
    """The persistent op's plan under `variant` (device: as attnres.plan's, e.g. "h200" without a GPU)."""
    q = _C.PlanQuery()
    q.op = getattr(_C.AttnResOp, OP)
    q.tokens, q.candidates, q.hidden, q.add = int(tokens), int(candidates), int(hidden), bool(add)
    return plan_info(_C.plan_query(q, device_info(device), variant.options(pdl).to_c()))


def call(variant: Variant, layer_residual: Tensor, block_residual: Tensor, res_weight: Tensor, rms_weight: Tensor,
         norm_weight: Tensor, rms_eps: float = 1e-5, norm_eps: float = 1e-5, *,
         layer_residual_add: Tensor | None = None, pdl: bool = True) -> tuple[Tensor | None, Tensor]:
    """attn_res_add_rmsnorm_persistent under `variant` on [T, H] / [K, T, H] tensors: (updated or None, output),
    as the public op returns them."""
    return ops.attn_res_add_rmsnorm_persistent(layer_residual, block_residual, res_weight, rms_weight, norm_weight,
                                               float(rms_eps), float(norm_eps), layer_residual_add=layer_residual_add,
                                               options=variant.options(pdl))
