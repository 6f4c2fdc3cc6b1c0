"""SGLang plugin: REPLACE hooks on the AttnRes entry points of sglang.srt.layers.attn_residual, routed to attnres
where attnres was measured faster, SGLang's own function everywhere else (docs/integrations.md).

Entry point (group `sglang.srt.plugins`): `attnres.integrations.sglang:register`. SGLang's load_plugins() runs it,
then HookRegistry.apply_hooks() rebinds the module attributes and every stale `from ... import` of them (kimi_k3
imports aggregate_stream by name). Importing this module needs neither SGLang nor a GPU.

Replaced (same signatures, same results and side effects; the per-token mapping):

  _aggregate(prefix, bank, nvb, score_proj, score_norm, out_norm, write_bank_row)  -> attn_res_rmsnorm
  _aggregate_fused(prefix, bank, nvb, score_proj, score_norm, out_norm)            -> attn_res_rmsnorm
  _aggregate_fused_add(a, b, bank, nvb, ..., write_bank_row) -> (normed, a + b)    -> attn_res_add_rmsnorm
  aggregate_stream(prefix, bank, nvb, score_proj, score_norm) -> pre-norm mixture  -> attn_res(diagnostics=False)

with the bank [T, NB, H] passed as the [K, T, H] view bank[:, :nvb].transpose(0, 1) (no copy), write_bank_row as
snapshot_slot=nvb (row nvb of the same storage), res_weight = score_proj.weight, rms_weight/rms_eps =
score_norm.weight/variance_epsilon, norm_weight/norm_eps = out_norm.weight/variance_epsilon.

Turning it off: ATTNRES_SGLANG=0 (read once, when SGLang loads the plugin), or leave `attnres` out of SGLang's
SGLANG_PLUGINS list. ATTNRES_SGLANG_TABLE=path replaces the shipped tables (one per GPU) with that one.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import numbers
import os
import re
from collections import Counter

import torch

from .sglang_table import Shipped, Table, TableError

log = logging.getLogger(__name__)

ENV_SWITCH = "ATTNRES_SGLANG"
ENV_TABLE = "ATTNRES_SGLANG_TABLE"
MODULE = "sglang.srt.layers.attn_residual"
ENTRY_POINTS = ("_aggregate", "_aggregate_fused", "_aggregate_fused_add", "aggregate_stream")

# PDL off: SGLang's own kernels may release their dependents before they wait on their predecessor, which breaks
# the chain that attnres's pre-wait loads of the weights and older bank rows rely on (docs/ops/common.md
# section 7). Bits do not depend on it.
_OPTIONS = None  # attnres.Options(pdl=False), built on first use so that importing this module stays light

# Set while SGLang's own function runs on our behalf: its inner calls of other replaced entry points
# (_aggregate_fused_add calls _aggregate, which calls _aggregate_fused) must then stay SGLang's too, so a
# fallback is exactly the engine's path.
_passthrough: contextvars.ContextVar[bool] = contextvars.ContextVar("attnres_sglang_passthrough", default=False)

_BF16 = torch.bfloat16


class _State:
    def __init__(self):
        self.registered = False
        # entry point name -> SGLang's function, captured before apply_hooks. Kept in a dict, never as module
        # globals: apply_hooks rebinds every module global that is the original to the hook (its stale-import
        # propagation), which would turn a fallback into infinite recursion.
        self.originals: dict = {}
        self.module = None  # sglang.srt.layers.attn_residual
        self.table: Table = Table.empty()
        self.attnres_calls: Counter = Counter()  # entry key -> calls attnres ran
        self.fallbacks: Counter = Counter()  # (entry key, reason) -> calls SGLang's function ran
        self.device_names: dict = {}


_STATE = _State()


def enabled() -> bool:
    """The ATTNRES_SGLANG switch: unset, empty or "1" on, "0" off; anything else off, with a warning (a typo
    must not silently replace the engine's kernels, nor raise inside the engine)."""
    raw = os.environ.get(ENV_SWITCH, "").strip()
    if raw in ("", "1"):
        return True
    if raw != "0":
        log.warning("attnres SGLang plugin off: %s must be 0 or 1, got %r", ENV_SWITCH, raw)
    return False


def register() -> None:
    """SGLang's plugin entry point: registers one REPLACE hook per entry point. Never raises (SGLang's loader
    would log and continue anyway; a failure here leaves SGLang's functions in place)."""
    try:
        _register()
    except Exception:  # noqa: BLE001 - the engine must start with its own functions
        log.exception("attnres SGLang plugin not registered; SGLang's own AttnRes functions stay in place")


def _register() -> None:
    if _STATE.registered:
        return
    if not enabled():
        log.info("attnres SGLang plugin off (%s=0)", ENV_SWITCH)
        return
    import importlib

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    module = importlib.import_module(MODULE)
    missing = [name for name in ENTRY_POINTS if not callable(getattr(module, name, None))]
    if missing:
        log.warning("attnres SGLang plugin not registered: %s lacks %s (another SGLang version?)", MODULE, missing)
        return
    set_table(os.environ.get(ENV_TABLE) or Shipped(_table_error))
    # The REPLACE hook never receives the original, so keep SGLang's functions for the fallback now: apply_hooks
    # has not run yet (it runs after every plugin registered).
    _STATE.module = module
    _STATE.originals = {name: getattr(module, name) for name in ENTRY_POINTS}
    for name in ENTRY_POINTS:
        HookRegistry.register(f"{MODULE}.{name}", HOOKS[name], HookType.REPLACE)
    _STATE.registered = True
    table = _STATE.table
    log.info("attnres SGLang plugin registered on %s (%s); table %s: %s", MODULE, ", ".join(ENTRY_POINTS),
             table.source, "one per GPU" if isinstance(table, Shipped) else
             f"{len(table.rows)} rows measured on {table.device}" if table.rows else
             "empty, every call falls back to SGLang's own function")


def _table_error(e: TableError) -> None:
    log.warning("attnres SGLang plugin: %s; falling back to SGLang's functions everywhere", e)


def set_table(table) -> Table:
    """Installs a Table (or loads one from a path); returns the previous one. A malformed file installs the
    empty table (every call falls back) with a warning."""
    previous = _STATE.table
    if not isinstance(table, Table) and not callable(getattr(table, "verdict", None)):
        try:
            table = Table.load(table)
        except TableError as e:
            _table_error(e)
            table = Table.empty(str(table))
    _STATE.table = table
    return previous


def stats() -> dict:
    """What the plugin did so far (calls made while capturing a CUDA graph count once, replays not at all)."""
    fallbacks: dict = {}
    for (entry, reason), n in sorted(_STATE.fallbacks.items()):
        fallbacks.setdefault(entry, {})[reason] = n
    return {"registered": _STATE.registered, "table": getattr(_STATE.table, "source", None),
            "attnres_calls": dict(_STATE.attnres_calls), "fallbacks": fallbacks}


def reset_stats() -> None:
    _STATE.attnres_calls.clear()
    _STATE.fallbacks.clear()


@contextlib.contextmanager
def sglang_functions():
    """Within it every replaced entry point runs SGLang's own function (the benchmark times them this way)."""
    token = _passthrough.set(True)
    try:
        yield
    finally:
        _passthrough.reset(token)


def original(name: str):
    """SGLang's own function for an entry point (as captured at registration)."""
    return _STATE.originals[name]


# ---- the per-call decision -------------------------------------------------------------------------------------


class _Decline(Exception):
    """Why this call runs SGLang's function (internal control flow of the checks)."""


def _bf16(t, what: str, shape=None):
    if not isinstance(t, torch.Tensor):
        raise _Decline(f"{what} is not a tensor")
    if t.dtype != _BF16:
        raise _Decline(f"{what} is {t.dtype}, attnres takes bfloat16")
    if shape is not None and tuple(t.shape) != shape:
        raise _Decline(f"{what} does not have the shape of prefix_sum")
    return t


def _eps(module, what: str) -> float:
    eps = getattr(module, "variance_epsilon", None)
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        raise _Decline(f"{what} has no numeric variance_epsilon")
    return float(eps)


def _vector(t, H: int, what: str):
    """A [H] or [1, H] bf16 weight (attnres takes both)."""
    _bf16(t, what)
    if tuple(t.shape) not in ((H,), (1, H)):
        raise _Decline(f"{what} is not [H] or [1, H]")
    return t


def _out_norm(norm, H: int):
    """out_norm is *called* by SGLang (its forward decides the arithmetic), so only SGLang's plain RMSNorm maps
    onto attnres's trailing norm: not a subclass with another formula, not one that normalises over part of H,
    changes the output dtype or fuses the next projection's FP8 quantisation (its result is then a tuple)."""
    rmsnorm = getattr(_STATE.module, "RMSNorm", None)
    if rmsnorm is None or type(norm) is not rmsnorm:
        raise _Decline(f"out_norm is {type(norm).__name__}, not SGLang's RMSNorm")
    if getattr(norm, "variance_size_override", None) is not None:
        raise _Decline("out_norm normalises over part of H (variance_size_override)")
    if getattr(norm, "override_orig_dtype", None) is not None:
        raise _Decline("out_norm overrides its output dtype")
    if getattr(norm, "_quant_linear", None) is not None:
        raise _Decline("out_norm fuses the next projection's FP8 input quantisation")
    return _vector(getattr(norm, "weight", None), H, "out_norm.weight"), _eps(norm, "out_norm")


def _check(prefix, add, bank, nvb, score_proj, score_norm, out_norm, write: bool, normed: bool) -> tuple:
    """The attnres arguments of the call, or _Decline. score_proj and score_norm enter SGLang's path only as
    weights and eps (its kernels read get_cw = score_norm.weight * score_proj.weight and variance_epsilon), so any
    module with those maps; out_norm is checked by _out_norm."""
    if not isinstance(prefix, torch.Tensor) or prefix.dim() != 2:
        raise _Decline("prefix_sum is not a 2-D tensor")
    T, H = prefix.shape
    if T == 0:
        raise _Decline("no tokens (T = 0)")
    if prefix.device.type not in ("cuda", "cpu"):
        raise _Decline(f"{prefix.device.type} tensors: attnres runs on cuda and cpu")
    _bf16(prefix, "prefix_sum")
    if add is not None:
        _bf16(add, "the addend (prefix_b)", (T, H))
    _bf16(bank, "bank")
    if bank.dim() != 3 or bank.shape[0] != T or bank.shape[2] != H:
        raise _Decline("bank is not [T, NB, H]")
    if not isinstance(nvb, int) or isinstance(nvb, bool) or not 0 <= nvb <= bank.shape[1]:
        raise _Decline("nvb is not a row count of the bank")
    if write and nvb >= bank.shape[1]:
        raise _Decline("no bank row left for the snapshot")
    if nvb + 1 > 16:
        raise _Decline("N = nvb + 1 > 16 candidates")
    if getattr(score_proj, "bias", None) is not None:
        raise _Decline("score_proj has a bias")
    res_w = _vector(getattr(score_proj, "weight", None), H, "score_proj.weight")
    rms_w = _vector(getattr(score_norm, "weight", None), H, "score_norm.weight")
    rms_eps = _eps(score_norm, "score_norm")
    norm = _out_norm(out_norm, H) if normed else (None, None)
    return T, H, bank[:, :nvb].transpose(0, 1), res_w, rms_w, rms_eps, norm


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = _STATE.device_names.get(index)
    if name is None:
        name = _STATE.device_names[index] = torch.cuda.get_device_name(index)
    return name


def _options():
    global _OPTIONS
    if _OPTIONS is None:
        from ..options import Options

        _OPTIONS = Options(pdl=False)
    return _OPTIONS


def _error_reason(e: Exception) -> str:
    """A bounded reason for an exception (numbers folded, so one shape family counts as one reason)."""
    from ..errors import AttnResError

    text = str(e).splitlines()[0] if str(e) else ""
    kind = "attnres declined" if isinstance(e, AttnResError) else "plugin error"
    if not isinstance(e, AttnResError):
        log.warning("attnres SGLang plugin: unexpected %s (%s); SGLang's function runs", type(e).__name__, e)
    return f"{kind}: {type(e).__name__}: {re.sub(r'[0-9]+', '#', text)}"


def _fallback(entry: str, reason: str, name: str, args: tuple, kwargs: dict):
    key = (entry, reason)
    if key not in _STATE.fallbacks:
        log.debug("attnres SGLang plugin: %s runs SGLang's function: %s", entry, reason)
    _STATE.fallbacks[key] += 1
    token = _passthrough.set(True)
    try:
        return _STATE.originals[name](*args, **kwargs)
    finally:
        _passthrough.reset(token)


def _run(entry: str, name: str, args: tuple, kwargs: dict, prefix, add, bank, nvb, score_proj, score_norm,
         out_norm, write: bool):
    """One replaced call: the checks, the table, attnres; SGLang's function on any decline."""
    normed = out_norm is not None
    try:
        T, H, view, res_w, rms_w, rms_eps, (norm_w, norm_eps) = _check(
            prefix, add, bank, nvb, score_proj, score_norm, out_norm, write, normed)
        reason = _STATE.table.verdict(entry, T, nvb + 1, H, _device_name(prefix.device))
        if reason is not None:
            raise _Decline(reason)
        slot = nvb if write else None
        with torch.no_grad():  # SGLang's norms are Parameters that require grad; its kernels have no backward
            result = _launch(prefix, add, view, res_w, rms_w, rms_eps, norm_w, norm_eps, normed, slot)
    except _Decline as d:
        return _fallback(entry, str(d), name, args, kwargs)
    except Exception as e:  # noqa: BLE001 - attnres raises before writing anything; the engine must not fail
        return _fallback(entry, _error_reason(e), name, args, kwargs)
    _STATE.attnres_calls[entry] += 1
    return result


def _launch(prefix, add, view, res_w, rms_w, rms_eps, norm_w, norm_eps, normed: bool, slot):
    from .. import ops

    if add is not None:
        updated, output = ops.attn_res_add_rmsnorm(prefix, add, view, res_w, rms_w, norm_w, rms_eps, norm_eps,
                                                   snapshot_slot=slot, options=_options())
        return output, updated
    if normed:
        return ops.attn_res_rmsnorm(prefix, view, res_w, rms_w, norm_w, rms_eps, norm_eps, snapshot_slot=slot,
                                    options=_options())
    return ops.attn_res(prefix, view, res_w, rms_w, rms_eps, diagnostics=False, options=_options())


# ---- the hooks (SGLang's signatures) ---------------------------------------------------------------------------


def _aggregate(prefix_sum, bank, nvb, score_proj, score_norm, out_norm, write_bank_row=False):
    args, kwargs = (prefix_sum, bank, nvb, score_proj, score_norm, out_norm), {"write_bank_row": write_bank_row}
    if _passthrough.get():
        return _STATE.originals["_aggregate"](*args, **kwargs)
    entry = "_aggregate+write" if write_bank_row else "_aggregate"
    return _run(entry, "_aggregate", args, kwargs, prefix_sum, None, bank, nvb, score_proj, score_norm, out_norm,
                bool(write_bank_row))


def _aggregate_fused(prefix_sum, bank, nvb, score_proj, score_norm, out_norm):
    args = (prefix_sum, bank, nvb, score_proj, score_norm, out_norm)
    if _passthrough.get():
        return _STATE.originals["_aggregate_fused"](*args)
    return _run("_aggregate_fused", "_aggregate_fused", args, {}, prefix_sum, None, bank, nvb, score_proj,
                score_norm, out_norm, False)


def _aggregate_fused_add(prefix_a, prefix_b, bank, nvb, score_proj, score_norm, out_norm, write_bank_row=False):
    """Returns (normed, prefix_a + prefix_b) as SGLang does; the sum is a new tensor (prefix_a is not updated in
    place: SGLang's callers may still hold it)."""
    args = (prefix_a, prefix_b, bank, nvb, score_proj, score_norm, out_norm)
    kwargs = {"write_bank_row": write_bank_row}
    if _passthrough.get():
        return _STATE.originals["_aggregate_fused_add"](*args, **kwargs)
    entry = "_aggregate_fused_add+write" if write_bank_row else "_aggregate_fused_add"
    return _run(entry, "_aggregate_fused_add", args, kwargs, prefix_a, prefix_b, bank, nvb, score_proj,
                score_norm, out_norm, bool(write_bank_row))


def aggregate_stream(prefix_sum, bank, nvb, score_proj, score_norm):
    args = (prefix_sum, bank, nvb, score_proj, score_norm)
    if _passthrough.get() or nvb == 0:
        # nvb == 0: SGLang returns prefix_sum itself (the same object), nothing to mix or to replace.
        return _STATE.originals["aggregate_stream"](*args)
    return _run("aggregate_stream", "aggregate_stream", args, {}, prefix_sum, None, bank, nvb, score_proj,
                score_norm, None, False)


HOOKS = {"_aggregate": _aggregate, "_aggregate_fused": _aggregate_fused,
         "_aggregate_fused_add": _aggregate_fused_add, "aggregate_stream": aggregate_stream}
