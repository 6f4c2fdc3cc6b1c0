"""The support gate of the fused MoE finalize (cheap: no tensor is touched) and the record of which path
attnres.moe.finalize_moe_output took (recorded per thread, logged once per distinct decision)."""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import _C, knobs
from ._tensors import c_dtype
from .planning import device_info

log = logging.getLogger("attnres.moe")


def token_gate(op: str, knob: str, max_tokens: int | None, **counts: int) -> int:
    """A gate query's token gate: `max_tokens`, else the knob `knob` (that knob alone, read once, at the first
    query that needs it: attnres.knobs.value). First checks `counts` (tokens, k, hidden, world_size): ints >= 1,
    else ArgumentError (a ValueError) naming `op` (no path can compute them); `max_tokens`: None or an int >= 0
    (a float such as nan would compare False against every T and open the gate)."""
    for name, v in counts.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _C.ArgumentError(f"{op}: {name} must be an int >= 1, got {v!r}")
    if max_tokens is None:
        return knobs.value(knob)
    try:
        gate = None if isinstance(max_tokens, bool) else operator.index(max_tokens)  # numpy ints too, not floats
    except TypeError:
        gate = None
    if gate is None or gate < 0:
        raise _C.ArgumentError(f"{op}: max_tokens must be None or an int >= 0 (0 disables the path), got "
                               f"{max_tokens!r}")
    return gate


def gate_dtypes(op: str, dtypes) -> tuple[torch.dtype, torch.dtype]:
    """(rows dtype, weights dtype), else ArgumentError: a gate must not fail with IndexError or compare a
    string's characters."""
    if not isinstance(dtypes, (tuple, list)) or len(dtypes) != 2 or \
            not all(isinstance(d, torch.dtype) for d in dtypes):
        raise _C.ArgumentError(f"{op}: dtypes must be a pair of torch dtypes (rows, weights), got {dtypes!r}")
    return dtypes[0], dtypes[1]


def gate_device(device) -> tuple[_C.DeviceInfo | None, str]:
    """(the device's DeviceInfo, "") or (None, why): a support predicate answers, it does not raise, for a missing
    device (cuda:5 on a machine without it), a device no kernel serves (meta), or a described GPU that cannot run
    anything (sm_count < 1; planning.device_info already refuses values out of range)."""
    try:
        info = device_info(device)
    except _C.ArgumentError as e:
        return None, str(e)
    if info.device_type == _C.DeviceType.cuda and not info.cuda_backend:
        return None, "attnres was built without the CUDA backend"
    if info.device_type == _C.DeviceType.cuda and info.sm_count < 1:
        return None, f"the device {info.name} has sm_count = {info.sm_count}: no SM to run a kernel on"
    return info, ""


def finalize_decline(tokens: int, k: int, hidden: int, dtypes: tuple[torch.dtype, torch.dtype],
                     info: _C.DeviceInfo) -> str:
    """The fused finalize's plan on `info`: "" when it accepts, else its decline."""
    q = _C.MoeFinalizeQuery()
    q.tokens, q.routes, q.hidden = tokens, k, hidden
    q.rows_dtype = c_dtype(dtypes[0])
    q.weights_dtype = c_dtype(dtypes[1])
    plan = _C.moe_finalize_plan_query(q, info, _C.MoeFinalizeOptions())
    return "" if plan.accepted else plan.decline


def supports_fused_moe_finalize(tokens: int, k: int, hidden: int,
                                dtypes: tuple[torch.dtype, torch.dtype] = (torch.bfloat16, torch.float32),
                                device="cpu", world_size: int = 1, *,
                                max_tokens: int | None = None) -> tuple[bool, str]:
    """(True, "") when the fused moe_finalize takes a call of T = tokens, k routes, D = hidden, with
    dtypes = (rows dtype, weights dtype) on `device` in a group of `world_size` ranks; else (False, why).

    Cheap (no tensor is touched). The token gate is `max_tokens`, else ATTNRES_MOE_FINALIZE_MAX_TOKENS (that knob
    alone, read once at the first query that needs it, attnres.knobs.value; 0 disables the fused path). Arguments that no
    path can compute (tokens, k or hidden < 1, world_size < 1, a malformed max_tokens or dtypes) raise
    ArgumentError (a ValueError)."""
    op = "supports_fused_moe_finalize"
    gate = token_gate(op, "ATTNRES_MOE_FINALIZE_MAX_TOKENS", max_tokens, tokens=tokens, k=k, hidden=hidden,
                      world_size=world_size)
    dtypes = gate_dtypes(op, dtypes)
    if gate == 0:
        return False, "the fused finalize is disabled (ATTNRES_MOE_FINALIZE_MAX_TOKENS = 0)"
    if tokens > gate:
        return False, f"T = {tokens} is above the token gate (ATTNRES_MOE_FINALIZE_MAX_TOKENS = {gate})"
    if world_size != 1:
        return False, (f"world_size = {world_size}: the fused kernel has no all-reduce (the partial sums must be "
                       "all-reduced between the combine and the norm)")
    info, why = gate_device(device)
    if info is None:
        return False, why
    decline = finalize_decline(tokens, k, hidden, dtypes, info)
    return (False, decline) if decline else (True, "")


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
