"""The stress runs' comparisons: raw bits (NaN-safe), the contract's tolerance (attnres.reference.check_close)
with a 2-bf16-ulp elementwise allowance, the fp32 error bound of a logit's dot product, a call's outputs against
the CPU backend and against the float64 oracle, and its input buffers against their bits before the call."""

from __future__ import annotations

import torch
from torch import Tensor

from attnres import reference
from attnres.moe import reference_moe_finalize

from .draw import Spec
from .inputs import BF16, Call

BF16_ULPS = 2  # elementwise allowance next to the tolerance rule: two roundings (normed, output) may flip

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: Tensor) -> Tensor:
    """The raw bits (NaN-safe, -0.0 != 0.0), same device."""
    t = t.contiguous()
    return t.view(_INT_OF_WIDTH[t.element_size()]) if t.is_floating_point() else t


def same_bits(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    return torch.equal(bits(a), bits(b.to(a.device)))


def _ordered_bf16(t: Tensor) -> Tensor:
    """bf16 bits as integers ordered like the values (adjacent representable values differ by 1)."""
    b = bits(t.cpu()).to(torch.int32)
    return torch.where(b < 0, -(b & 0x7FFF), b)


def within_ulps(a: Tensor, e: Tensor, ulps: int) -> bool:
    """Every element of a is within `ulps` bf16 steps of e (both finite), or bitwise equal."""
    a, e = a.cpu(), e.cpu()
    af, ef = a.float(), e.float()
    if not (torch.isfinite(af).all() and torch.isfinite(ef).all()):
        # The contract's own NaN/Inf (e.g. eps = 0 and an all-zero row): the same elements non-finite, the same
        # infinities (NaN payloads may differ), the finite rest within the allowance.
        if not (torch.equal(torch.isnan(af), torch.isnan(ef)) and torch.equal(torch.isinf(af), torch.isinf(ef))
                and torch.equal(af[torch.isinf(af)], ef[torch.isinf(ef)])):
            return False
        finite = torch.isfinite(af)
        a, e = a[finite], e[finite]
    return bool(((_ordered_bf16(a) - _ordered_bf16(e)).abs() <= ulps).all())


def close_bf16(a: Tensor, e: Tensor, what: str) -> str | None:
    """None when a meets the contract's tolerance against e (or is within BF16_ULPS of it elementwise)."""
    if tuple(a.shape) != tuple(e.shape) or a.dtype != e.dtype:
        return f"{what}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(e.shape)} {e.dtype}"
    try:
        reference.check_close(a.cpu(), e.cpu(), what)
        return None
    except AssertionError as err:
        if within_ulps(a, e, BF16_ULPS):
            return None
        return str(err)


def _logit_bound(inputs: dict, H: int) -> Tensor:
    """Worst-case |error| of an fp32 logit on either backend, doubled (two results, each off the exact value):
    the dot product of H rounded products summed in any order, gamma(H + 2) * rsigma * sum_h |v_h q_h|, plus
    a few roundings of rsigma and the final product relative to the logit itself."""
    P = inputs["updated_ref"] if inputs.get("updated_ref") is not None else inputs["prefix"]
    V = torch.cat([inputs["block"].double(), P.double().unsqueeze(0)], 0)  # [N, T, H]
    q = inputs["res_weight"].double().reshape(H) * inputs["rms_weight"].double().reshape(H)
    rs = torch.rsqrt((V * V).mean(-1) + inputs["rms_eps"])
    u = 2.0 ** -24
    gamma = (H + 2) * u / (1 - (H + 2) * u)
    return 2 * (gamma * rs * (V.abs() @ q.abs()) + 8 * u * (rs * (V @ q)).abs())


def close_logits(a: Tensor, e: Tensor, inputs: dict, H: int) -> str | None:
    try:
        reference.check_close(a.cpu(), e.cpu(), "logits")
        return None
    except AssertionError as err:
        # A cancelling dot product (a logit near 0) has a large relative error on any backend: judge each
        # logit by the fp32 error bound of its sum instead.
        bound = _logit_bound(inputs, H)
        diff = (a.cpu().double() - e.cpu().double()).abs()
        if torch.isfinite(diff).all() and bool((diff <= bound).all()):
            return None
        return f"{err}; beyond the fp32 dot-product bound at {int((diff > bound).sum())} logits"


EXACT = {"updated"}  # bitwise between backends for every op (docs/ops: updated == PyTorch's adds)


def compare(s: Spec, got: dict[str, Tensor], ref: dict[str, Tensor], cpu_views: dict) -> list[str]:
    """Every disagreement of the device outputs `got` (already on the CPU) with the reference."""
    problems = []
    if sorted(got) != sorted(ref):
        return [f"outputs {sorted(got)} vs reference {sorted(ref)}"]
    for name, e in ref.items():
        a = got[name]
        exact = name in EXACT or (s.op == "moe_finalize" and not s.norm)
        if exact:
            if not same_bits(a, e):
                n = int((bits(a) != bits(e)).sum()) if a.shape == e.shape else -1
                problems.append(f"{name}: {n} elements differ in bits from the CPU backend")
        elif name == "logits":
            why = close_logits(a, e, {**cpu_views, "updated_ref": ref.get("updated"), "rms_eps": s.rms_eps}, s.H)
            if why:
                problems.append(why)
        elif a.dtype == torch.float32:
            try:
                reference.check_close(a, e, name)
            except AssertionError as err:
                problems.append(str(err))
        else:
            why = close_bf16(a, e, name)
            if why:
                problems.append(why)
    return problems


def oracle_check(s: Spec, got: dict[str, Tensor], v: dict) -> list[str]:
    """The device outputs against the float64 oracle (the CPU runs' independent check)."""
    problems = []
    if s.op == "moe_finalize":
        e = reference_moe_finalize(v["rows"], v["weights"], v["index"], shared=v["shared"],
                                   norm_weight=v["norm_weight"], eps=s.norm_eps, scale=s.scale)
        why = close_bf16(got["output"], e, "moe output vs oracle")
        return [why] if why else []
    norm = s.op != "attn_res"
    r = reference.attn_res(v["prefix"], v["block"], v["res_weight"], v["rms_weight"], s.rms_eps,
                           layer_residual_add=v["add"] if s.addends >= 1 else None,
                           layer_residual_add2=v["add2"] if s.addends >= 2 else None,
                           norm_weight=v["norm_weight"] if norm else None, norm_eps=s.norm_eps)
    for name, a in got.items():
        if name == "updated":
            if not same_bits(a, r.updated):
                problems.append("updated differs in bits from PyTorch's prefix + (add + add2)")
            continue
        e = {"output": r.output, "mixture": r.mixture, "rsigma": r.rsigma, "probs": r.probs, "logits": r.logits}[name]
        if name == "logits":
            why = close_logits(a, e.float(), {**v, "updated_ref": r.updated, "rms_eps": s.rms_eps}, s.H)
        elif name in ("rsigma", "probs"):
            try:
                reference.check_close(a, e, name)
                why = None
            except AssertionError as err:
                why = str(err)
        else:
            why = close_bf16(a, e.to(BF16), f"{name} vs oracle")
        if why:
            problems.append(why)
    return problems


def inputs_unchanged(call: Call, before: dict[str, Tensor], outputs: dict[str, Tensor]) -> str | None:
    s = call.spec
    for name, old in before.items():
        now = call.buffers[name]
        if name == "bank" and s.snapshot >= 0 and "updated" in outputs:
            want = old.clone()
            call.bank_row(want, s.snapshot).copy_(outputs["updated"])
            if not same_bits(now, want):
                return f"bank buffer: not (unchanged except snapshot row {s.snapshot} == updated)"
        elif not same_bits(now, old):
            return f"input buffer {name!r} changed"
    return None
