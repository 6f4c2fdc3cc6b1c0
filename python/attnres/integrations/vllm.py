"""vLLM general plugin: serves Kimi K3's `attn_res` (vllm.models.kimi_k3.nvidia.ops.attn_res, vLLM 0.33.0)
through attnres where the measured table says attnres is faster on this GPU; every other call goes to vLLM's
own function, with the reason counted in `FALLBACKS` (docs/integrations.md, "## vLLM").

Entry point: `vllm.general_plugins` -> `attnres = attnres.integrations.vllm:register`. vLLM calls it once per
process (API server, engine core, workers), before the model is built. Off: ATTNRES_VLLM=0 (or vLLM's own
VLLM_PLUGINS filter). This module imports without vLLM; `register()` imports vLLM's AttnRes module only.

vLLM's function, `attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks,
block_write_idx, eps, output_norm_eps)`, on a token-major bank `blocks [T, NB, H]`:
  prefix <- bf16(prefix + delta) in place (when delta is given);
  blocks[:, block_write_idx] <- prefix (when block_write_idx >= 0);
  candidates blocks[:, :num_blocks], then prefix; logits = sum(v * norm_weight * qk_weight) * rsqrt(mean(v^2)
  + eps); returns the softmax mixture, RMSNorm'ed with output_norm_weight / output_norm_eps unless that is None.
attnres scores with q = f32(rms_weight) * f32(res_weight) and rsigma over rms_eps (docs/ops/common.md steps
3-4): the same products, so rms_weight = norm_weight, res_weight = qk_weight, rms_eps = eps, norm_eps =
output_norm_eps; the bank is the [K, T, H] view blocks[:, :K].transpose(0, 1) and the block write is the
snapshot row block_write_idx (attnres needs it >= K, outside the candidates).
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

import attnres
from attnres import _C

from ._common import (NOT_MEASURED_HERE, Fallbacks, ShippedTables, Table, switched_off, table_file,
                      table_from_json)

log = logging.getLogger("attnres.integrations.vllm")

ENV_SWITCH = "ATTNRES_VLLM"
# PDL off for engines whose kernels may release their dependents before waiting (docs/ops/common.md section 7).
ENV_PDL = "ATTNRES_VLLM_PDL"
VLLM_VERSION = "0.33.0"
OPS_MODULE = "vllm.models.kimi_k3.nvidia.ops.attn_res"
OPS_PACKAGE = "vllm.models.kimi_k3.nvidia.ops"
MODEL_MODULE = "vllm.models.kimi_k3.nvidia.model"
ENGINE = "vllm"

FALLBACKS = Fallbacks(log)


@dataclass
class Settings:
    """Process state of the plugin. allow_cpu (tests only, never set by register): serve CPU tensors through
    attnres's CPU backend so the mechanics can be tested without a GPU; table: None = the shipped table of the
    call's GPU (table_file), else this one for every call; options: the attnres.Options every served call runs
    with (None = the library's defaults)."""
    allow_cpu: bool = False
    table: Table | None = None
    options: attnres.Options | None = None


SETTINGS = Settings()
_original = None  # vLLM's own attn_res, saved by register()
_lock = threading.Lock()
_device_ok: dict[int, str | None] = {}  # cuda index -> None (supported) or the reason it is not
_device_name: dict[int, str] = {}


def site(has_delta: bool, has_norm: bool, writes: bool) -> str:
    """The call form the table is keyed by. vLLM's sites: pre-attention and post-attention norms are
    add_rmsnorm (add_rmsnorm_write at a block-write layer's pre-attention, rmsnorm at its post-attention,
    rmsnorm_write at layer 0), the final output is add_mix, the auxiliary hidden-state capture is mix."""
    return ("add_" if has_delta else "") + ("rmsnorm" if has_norm else "mix") + ("_write" if writes else "")


def _load_shipped(path: Path) -> Table:
    table = table_from_json(path, log)
    if table.empty:
        log.info("attnres: the vLLM table %s holds no measurement: every attn_res call runs vLLM's own function",
                 path)
    return table


SHIPPED = ShippedTables(ENGINE, _load_shipped)


def _decide(s: str, tokens: int, candidates: int, hidden: int, device: str) -> str | None:
    table = SETTINGS.table if SETTINGS.table is not None else SHIPPED.for_device(device)
    if table is None:
        return NOT_MEASURED_HERE  # run tools/engines/bench_vllm.py on this GPU to measure it
    return table.decide(s, tokens, candidates, hidden, device)


def _device_reason(t: torch.Tensor) -> tuple[str | None, str]:
    """(None, device name) when attnres may serve tensors on t's device, else (reason, "")."""
    if t.device.type == "cpu":
        return (None, "cpu") if SETTINGS.allow_cpu else ("cpu tensors", "")
    if t.device.type != "cuda":
        return f"device {t.device.type}", ""
    i = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if i not in _device_ok:
        if not _C.cuda_backend_built():
            _device_ok[i] = "attnres built without the CUDA backend"
        else:
            major, minor = torch.cuda.get_device_capability(i)
            _device_ok[i] = None if major == 9 else f"compute capability {major}.{minor} (attnres serves 9.x)"
        _device_name[i] = torch.cuda.get_device_name(i)
    return _device_ok[i], _device_name.get(i, "")


def _decline(prefix, delta, blocks, weights, num_blocks: int, block_write_idx: int) -> str | None:
    """Why attnres cannot run this call as vLLM's function would, or None. Cheap checks only: what they miss
    (alignment, aliasing, a plan decline) raises before anything is written and falls back too."""
    if prefix.dim() != 2 or blocks.dim() != 3:
        return "shape"
    T, H = prefix.shape
    if blocks.shape[0] != T or blocks.shape[2] != H or (delta is not None and delta.shape != prefix.shape):
        return "shape"
    if any(w.dim() != 1 or w.shape[0] != H for w in weights):
        return "weight shape"
    bf16 = torch.bfloat16
    if prefix.dtype != bf16 or blocks.dtype != bf16 or (delta is not None and delta.dtype != bf16) or \
            any(w.dtype != bf16 for w in weights):
        return "dtype not bfloat16"
    if H % 8 or not 8 <= H <= 16384:
        return "hidden size not a multiple of 8 in [8, 16384]"
    if not 0 <= num_blocks <= blocks.shape[1]:
        return "num_blocks outside the bank"
    if num_blocks + 1 > 16:
        return "more than 16 candidates"
    if block_write_idx >= blocks.shape[1] or block_write_idx < -1:
        return "block_write_idx outside the bank"
    if 0 <= block_write_idx < num_blocks:
        # vLLM writes the row before reading it as a candidate; attnres's snapshot row is never a candidate.
        return "block_write_idx < num_blocks"
    return None


def _serve(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks, block_write_idx, eps,
           output_norm_eps):
    bank = blocks[:, :num_blocks].transpose(0, 1)  # [K, T, H] view of the token-major bank, no copy
    slot = block_write_idx if block_write_idx >= 0 else None
    opts = SETTINGS.options
    if delta is not None and output_norm_weight is not None:
        return attnres.attn_res_add_rmsnorm(prefix, delta, bank, qk_weight, norm_weight, output_norm_weight, eps,
                                            output_norm_eps, snapshot_slot=slot, out=(prefix, None),
                                            options=opts)[1]
    if delta is not None:
        return attnres.attn_res(prefix, bank, qk_weight, norm_weight, eps, layer_residual_add=delta,
                                diagnostics=False, snapshot_slot=slot, out=(prefix, None), options=opts)[1]
    if output_norm_weight is not None:
        return attnres.attn_res_rmsnorm(prefix, bank, qk_weight, norm_weight, output_norm_weight, eps,
                                        output_norm_eps, snapshot_slot=slot, options=opts)
    return attnres.attn_res(prefix, bank, qk_weight, norm_weight, eps, diagnostics=False, snapshot_slot=slot,
                            options=opts)


def _route(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks, block_write_idx):
    """None to serve through attnres, else the fallback reason (and a detail for the log)."""
    if torch.compiler.is_compiling():
        return "traced by torch.compile", ""  # the engine's function traces; this dispatch would graph-break
    if not all(isinstance(t, torch.Tensor) for t in (prefix, blocks, norm_weight, qk_weight)):
        return "argument not a tensor", ""
    reason, device = _device_reason(prefix)
    if reason is not None:
        return reason, ""
    weights = (norm_weight, qk_weight) + (() if output_norm_weight is None else (output_norm_weight,))
    try:
        nb, bw = int(num_blocks), int(block_write_idx)
    except (TypeError, ValueError):
        return "num_blocks or block_write_idx not an int", ""
    reason = _decline(prefix, delta, blocks, weights, nb, bw)
    if reason is not None:
        return reason, f"T={prefix.shape[0]} num_blocks={nb} block_write_idx={bw}"
    s = site(delta is not None, output_norm_weight is not None, bw >= 0)
    reason = _decide(s, prefix.shape[0], nb + 1, prefix.shape[1], device)
    return reason, f"site={s} T={prefix.shape[0]} N={nb + 1} H={prefix.shape[1]} device={device}"


def attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks, block_write_idx, eps,
             output_norm_eps):
    """vLLM's attn_res signature and side effects, served by attnres where the table says so."""
    try:
        reason, detail = _route(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks,
                                block_write_idx)
        if reason is None:
            out = _serve(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, int(num_blocks),
                         int(block_write_idx), eps, output_norm_eps)
            FALLBACKS.served += 1
            return out
    except attnres.AttnResError as e:
        # ArgumentError / UnsupportedError are raised before anything is written (docs/ops/common.md section
        # 4), so vLLM's function then sees the inputs unchanged.
        reason, detail = type(e).__name__, str(e)
    except Exception as e:  # never an error inside the engine
        reason, detail = f"error {type(e).__name__}", str(e)
    FALLBACKS.record(reason, detail)
    return _original(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks=num_blocks,
                     block_write_idx=block_write_idx, eps=eps, output_norm_eps=output_norm_eps)


def _supported_platform() -> str | None:
    """Why this process should not rebind, or None. Asks vLLM's platform (NVML): no CUDA context is created
    here, since vLLM may fork workers after loading plugins."""
    if not _C.cuda_backend_built():
        return "attnres was built without the CUDA backend"
    try:
        from vllm.platforms import current_platform
        if not current_platform.is_cuda():
            return "not a CUDA platform"
        if not current_platform.is_device_capability_family(90):
            return f"compute capability {current_platform.get_device_capability()} is not 9.x"
    except Exception as e:
        return f"cannot query the platform ({type(e).__name__}: {e})"
    return None


def _bind(fn) -> None:
    """Rebinds every name vLLM calls attn_res through: the function in its module, the package's re-export
    (`from .attn_res import attn_res`), which model.py imports by name (`from vllm.models.kimi_k3.nvidia.ops
    import attn_res`), and model.py's own name if model.py is already imported."""
    for name in (OPS_MODULE, OPS_PACKAGE, MODEL_MODULE):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "attn_res"):
            module.attn_res = fn


def register() -> None:
    """The vllm.general_plugins entry point. Never raises: a problem leaves vLLM's own function in place."""
    global _original
    try:
        if switched_off(ENV_SWITCH):
            log.info("attnres: %s=0, the vLLM plugin is off", ENV_SWITCH)
            return
        if not SETTINGS.allow_cpu:
            reason = _supported_platform()
            if reason is not None:
                log.info("attnres: vLLM plugin not active: %s", reason)
                return
        if switched_off(ENV_PDL):
            SETTINGS.options = attnres.Options(pdl=False)
        import importlib
        module = importlib.import_module(OPS_MODULE)
        importlib.import_module(OPS_PACKAGE)
        with _lock:
            current = module.attn_res
            if current is not attn_res:  # vLLM may call register() more than once per process
                _original = current
            _bind(attn_res)
        log.info("attnres: vLLM attn_res rebound to attnres (served where the GPU's table %s says attnres is "
                 "faster; %s=0 turns this off)", table_file(ENGINE, "GPU").parent, ENV_SWITCH)
    except Exception as e:
        log.warning("attnres: vLLM plugin not active: %s: %s", type(e).__name__, e)


def unregister() -> None:
    """Puts vLLM's own function back under every name (tests; a process that wants the plugin off again)."""
    if _original is not None:
        with _lock:
            _bind(_original)
