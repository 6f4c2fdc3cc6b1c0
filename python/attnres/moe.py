"""The MoE finalize epilogue (docs/ops/moe_finalize.md): the consumer side of a deferred MoE finalize.

A MoE runner called with do_finalize=False hands over `rows [R, D]` (expert outputs in permuted order),
`weights [T, k]` (the buffer the routing used) and `index [T, k]` (int32 row of route (t, j); -1 = remote
expert). This module offers:

* `moe_finalize(...)` — the fused op (torch.ops.attnres.moe_finalize): combine in fp32 in j order with one
  rounding, optional shared add, optional two-rounding RMSNorm. Strict: every contract violation raises.
* `unfused_moe_finalize(...)` — the PyTorch sequence a user would write (gather, weight, fp32 sum, round, add
  shared, norm): the fallback and the benchmark baseline.
* `supports_fused_moe_finalize(...)` — the cheap gate: token count, dtype pair, world size, device, D, k.
* `finalize_moe_output(...)` — the dispatching helper: raises on malformed inputs whichever path it takes,
  then runs the fused op when the gate and the layout allow, else the unfused sequence (finalize, all-reduce
  when world_size > 1, then norm). Each decision is recorded (`record_finalize_decisions`,
  `last_finalize_decision`) and logged at debug level once per distinct (path, reason, T, k, D, device).
* `reference_moe_finalize(...)` — the float64 oracle of the contract (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import _C, knobs
from ._tensors import as_tensor, c_dtype, ref, stream_of
from .planning import device_info
from .reference import two_rounding_rmsnorm

log = logging.getLogger("attnres.moe")

OP = "moe_finalize"
MAX_ROUTES = 32
MAX_TOKENS = 16384
MAX_HIDDEN = 16384
KERNELS = ("auto", "cpu", "single_cta")



def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
@torch.library.custom_op("attnres::moe_finalize", mutates_args=())
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
    # Shape errors surface while tracing too (the real op would raise them at run time).
    if index.dim() != 2:
        raise _argument_error("index", f"must be a 2-D [T, k] tensor, got {index.dim()} dimensions {list(index.shape)}")
    if rows.dim() != 2:
        raise _argument_error("rows", f"must be a 2-D [R, D] tensor, got {rows.dim()} dimensions {list(rows.shape)}")
    return rows.new_empty((index.shape[0], rows.shape[1]), dtype=torch.bfloat16)


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


# ------------------------------------------------------------------------------------ the unfused sequence
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


# ------------------------------------------------------------------------------------------- the oracle
def reference_moe_finalize(rows: Tensor, weights: Tensor, index: Tensor, *, shared: Tensor | None = None,
                           norm_weight: Tensor | None = None, eps: float, scale: float = 1.0) -> Tensor:
    """float64 evaluation of the contract on the CPU, its rounding boundaries emulated: routed rounded to
    bf16 once, the shared add rounded once, the norm's two roundings. NaN rows for out-of-range routes."""
    rows64 = rows.detach().cpu().double()
    idx = index.detach().cpu().long()
    T, k = idx.shape
    R, D = rows64.shape
    local = (idx >= 0) & (idx < R)
    broken = ((idx < -1) | (idx >= R)).any(dim=1, keepdim=True)
    gathered = rows64[torch.where(local, idx, 0)] if R > 0 else torch.zeros((T, k, D), dtype=torch.float64)
    terms = torch.where(local.unsqueeze(-1), gathered * weights.detach().cpu().double().unsqueeze(-1), 0.0)
    x = (terms.sum(dim=1) * scale).to(torch.bfloat16)
    if shared is not None:
        x = (x.double() + shared.detach().cpu().double()).to(torch.bfloat16)
    if norm_weight is not None:
        x = two_rounding_rmsnorm(x, norm_weight.detach().cpu(), eps)
    return torch.where(broken, torch.full_like(x, float("nan")), x)


# -------------------------------------------------------------------------------------------- the gate
def supports_fused_moe_finalize(tokens: int, k: int, hidden: int,
                                dtypes: tuple[torch.dtype, torch.dtype] = (torch.bfloat16, torch.float32),
                                device="cpu", world_size: int = 1, *,
                                max_tokens: int | None = None) -> tuple[bool, str]:
    """(True, "") when the fused moe_finalize takes a call of T = tokens, k routes, D = hidden, with
    dtypes = (rows dtype, weights dtype) on `device` in a group of `world_size` ranks; else (False, why).

    Cheap (no tensor is touched). The token gate is ATTNRES_MOE_FINALIZE_MAX_TOKENS (read once at import,
    attnres.knobs; 0 disables the fused path); `max_tokens` overrides it for one query. Arguments that no
    path can compute (tokens, k or hidden < 1, world_size < 1) raise ValueError."""
    for name, v in (("tokens", tokens), ("k", k), ("hidden", hidden), ("world_size", world_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"supports_fused_moe_finalize: {name} must be an int >= 1, got {v!r}")
    gate = knobs.CURRENT.moe_finalize_max_tokens if max_tokens is None else max_tokens
    if gate == 0:
        return False, "the fused finalize is disabled (ATTNRES_MOE_FINALIZE_MAX_TOKENS = 0)"
    if tokens > gate:
        return False, f"T = {tokens} is above the token gate (ATTNRES_MOE_FINALIZE_MAX_TOKENS = {gate})"
    if world_size != 1:
        return False, (f"world_size = {world_size}: the fused kernel has no all-reduce (the partial sums must be "
                       "all-reduced between the combine and the norm)")
    q = _C.MoeFinalizeQuery()
    q.tokens, q.routes, q.hidden = tokens, k, hidden
    q.rows_dtype = c_dtype(dtypes[0])
    q.weights_dtype = c_dtype(dtypes[1])
    try:
        info = device_info(device)
    except _C.ArgumentError as e:  # a support predicate answers, it does not raise, for a missing device
        return False, str(e)
    plan = _C.moe_finalize_plan_query(q, info, _C.MoeFinalizeOptions())
    if not plan.accepted:
        return False, plan.decline
    return True, ""


# ----------------------------------------------------------------------------------- decisions, observable
@dataclass(frozen=True)
class FinalizeDecision:
    path: str  # "fused"; "fused_combine" (world_size > 1: the kernel combines, the norm follows the all-reduce); "unfused"
    reason: str  # why the unfused (or fused_combine) path was taken; "" when fused
    tokens: int
    routes: int
    hidden: int
    device: str
    world_size: int


_state = threading.local()
_logged: set = set()
_logged_lock = threading.Lock()
_last: list[FinalizeDecision | None] = [None]


def last_finalize_decision() -> FinalizeDecision | None:
    """The decision of the latest finalize_moe_output call (any thread)."""
    return _last[0]


@contextlib.contextmanager
def record_finalize_decisions() -> Iterator[list[FinalizeDecision]]:
    """Collects every finalize_moe_output decision taken by this thread inside the block."""
    stack = getattr(_state, "recorders", None)
    if stack is None:
        stack = _state.recorders = []
    record: list[FinalizeDecision] = []
    stack.append(record)
    try:
        yield record
    finally:
        stack.remove(record)


def _note(decision: FinalizeDecision) -> None:
    _last[0] = decision
    for record in getattr(_state, "recorders", None) or ():
        record.append(decision)
    key = (decision.path, decision.reason, decision.tokens, decision.routes, decision.hidden, decision.device)
    with _logged_lock:
        first = key not in _logged
        _logged.add(key)
    if first:
        log.debug("moe_finalize: %s path (T=%d k=%d D=%d on %s, world_size=%d)%s", decision.path, decision.tokens,
                  decision.routes, decision.hidden, decision.device, decision.world_size,
                  f": {decision.reason}" if decision.reason else "")


# ------------------------------------------------------------------------------------ the dispatching helper
def _check_well_formed(rows: Tensor, weights: Tensor, index: Tensor, shared: Tensor | None,
                       norm_weight: Tensor | None, eps: float, scale: float) -> None:
    """What no path can compute: raises with the fused op's messages, whichever path is taken next."""
    if index.dim() == 1:
        raise _argument_error("index", f"must be a 2-D [T, k] tensor, got a flat map of shape {list(index.shape)} "
                                       "(reshape it to [T, k])")
    if index.dim() != 2:
        raise _argument_error("index", f"must be a 2-D [T, k] tensor, got {index.dim()} dimensions {list(index.shape)}")
    T, k = index.shape
    if T < 1:
        raise _argument_error("index", f"holds T = {T} tokens: T must be >= 1 (the fused op: in [1, {MAX_TOKENS}])")
    if k < 1:
        raise _argument_error("index", f"holds k = {k} routes per token: k must be >= 1 (the fused op: in [1, {MAX_ROUTES}])")
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise _argument_error("index", f"must be int32, got {_dtype_name(index.dtype)}")
    if weights.dim() != 2 or tuple(weights.shape) != (T, k):
        raise _argument_error("weights", f"must have the shape of index [T, k] = [{T}, {k}], got {list(weights.shape)}")
    if not weights.is_floating_point():
        raise _argument_error("weights", f"must be float32 or bfloat16, got {_dtype_name(weights.dtype)}")
    if rows.dim() != 2:
        raise _argument_error("rows", f"must be a 2-D [R, D] tensor, got {rows.dim()} dimensions {list(rows.shape)}")
    R, D = rows.shape
    if D < 1 or not rows.is_floating_point():
        raise _argument_error("rows", f"must hold D >= 1 floating-point columns, got {_dtype_name(rows.dtype)} "
                                      f"{list(rows.shape)}")
    if shared is not None:
        if shared.dim() != 2 or tuple(shared.shape) != (T, D):
            raise _argument_error("shared", f"must have shape [T, D] = [{T}, {D}], got {list(shared.shape)}")
        if shared.dtype != rows.dtype:
            raise _argument_error("shared", f"must be {_dtype_name(rows.dtype)} (the dtype of rows), got "
                                            f"{_dtype_name(shared.dtype)}")
    if norm_weight is not None:
        if norm_weight.dim() != 1:
            raise _argument_error("norm_weight", f"must be a 1-D [D] tensor, got {norm_weight.dim()} dimensions "
                                                 f"{list(norm_weight.shape)}")
        if norm_weight.shape[0] != D:
            raise _argument_error("norm_weight", f"must have shape [D] = [{D}], got {list(norm_weight.shape)}")
        if norm_weight.dtype != rows.dtype:
            raise _argument_error("norm_weight", f"must be {_dtype_name(rows.dtype)} (the dtype of rows), got "
                                                 f"{_dtype_name(norm_weight.dtype)}")
    for name, t in (("weights", weights), ("index", index), ("shared", shared), ("norm_weight", norm_weight)):
        if t is not None and t.device != rows.device:
            raise _argument_error(name, f"is on {t.device} but rows is on {rows.device} (all tensors must be on one device)")
    if not math.isfinite(eps) or eps < 0:
        raise _argument_error("eps", f"must be finite and >= 0, got {eps:f}")
    if not math.isfinite(scale):
        raise _argument_error("scale", f"must be finite, got {scale:f}")
    if rows.device.type == "cpu":
        check_index_range(index, R)


def _kernel_layout_decline(rows: Tensor, weights: Tensor, index: Tensor, shared: Tensor | None,
                           norm_weight: Tensor | None) -> str:
    """Why the fused kernel cannot read these tensors as laid out ("" when it can). The helper then takes
    the unfused path, which reads any strided view correctly: a slower path, never a misread."""
    T, k = index.shape
    if index.dtype != torch.int32:
        return f"index is {index.dtype} (the kernel reads int32)"
    for name, t in (("weights", weights), ("index", index)):
        if (k > 1 and t.stride(1) != 1) or (T > 1 and t.stride(0) != k):
            return f"{name} is not dense [T, k] (strides {list(t.stride())})"
    cuda = rows.device.type == "cuda"
    for name, t in (("rows", rows), ("shared", shared), ("norm_weight", norm_weight)):
        if t is None:
            continue
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} has a non-unit innermost stride (strides {list(t.stride())})"
        if t.dim() == 2 and t.shape[0] > 1 and (t.stride(0) % 8 != 0 or t.stride(0) < t.shape[1]):
            return f"{name} row stride {t.stride(0)} is not a multiple of 8 elements of at least D"
        if cuda and t.numel() > 0 and t.data_ptr() % 16 != 0:
            return f"{name} is not 16-byte aligned"
    return ""


def finalize_moe_output(rows, weights, index, *, shared=None, norm_weight=None, eps: float, scale: float = 1.0,
                        world_size: int = 1, all_reduce: Callable[[Tensor], object] | None = None,
                        max_tokens: int | None = None) -> Tensor:
    """The MoE tail after a deferred finalize: combine (+ shared), all-reduce across `world_size` ranks,
    norm. Fused (one moe_finalize call) when supports_fused_moe_finalize and the tensors' layout allow,
    else the unfused PyTorch sequence; the decision is recorded and logged. Malformed inputs raise on both
    paths. With world_size > 1, `all_reduce(x)` sums the [T, D] partials in place (e.g.
    torch.distributed.all_reduce) between the combine and the norm; `shared` is this rank's partial; the
    combine runs fused (moe_finalize without its norm, path "fused_combine") where a world_size = 1 call without
    the norm would, else unfused."""
    rows = as_tensor(rows, OP, "rows")
    weights = as_tensor(weights, OP, "weights")
    index = as_tensor(index, OP, "index")
    shared = as_tensor(shared, OP, "shared")
    norm_weight = as_tensor(norm_weight, OP, "norm_weight")
    eps, scale = float(eps), float(scale)
    _check_well_formed(rows, weights, index, shared, norm_weight, eps, scale)
    if world_size > 1 and all_reduce is None:
        raise ValueError(f"{OP}: world_size = {world_size} needs all_reduce (the partial sums are all-reduced "
                         "between the combine and the norm)")

    T, k = index.shape
    D = rows.shape[1]
    # Under TP the norm must follow the all-reduce, so the kernel can run the combine (+ shared) alone: what it
    # must support then is that world_size = 1 call without the norm (the same gate, dtypes and device).
    fused, reason = supports_fused_moe_finalize(T, k, D, (rows.dtype, weights.dtype), rows.device, 1,
                                                max_tokens=max_tokens)
    if fused:
        reason = _kernel_layout_decline(rows, weights, index, shared, norm_weight if world_size == 1 else None)
        fused = not reason
    if fused and world_size > 1:
        path, reason = "fused_combine", (f"world_size = {world_size}: the fused combine without the norm, then "
                                         "all_reduce, then the norm")
    else:
        path = "fused" if fused else "unfused"
    _note(FinalizeDecision(path, reason, T, k, D, str(rows.device), world_size))

    if world_size == 1:
        if fused:
            return moe_finalize(rows, weights, index, shared=shared, norm_weight=norm_weight, eps=eps, scale=scale)
        return unfused_moe_finalize(rows, weights, index, shared=shared, norm_weight=norm_weight, eps=eps, scale=scale)
    combine = moe_finalize if fused else unfused_moe_finalize
    x = combine(rows, weights, index, shared=shared, eps=eps, scale=scale)
    reduced = all_reduce(x)
    if isinstance(reduced, Tensor):
        x = reduced
    return x if norm_weight is None else rmsnorm_two_rounding(x, norm_weight, eps)
