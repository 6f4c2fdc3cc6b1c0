"""The public Python API of the attention-residual ops (docs/ops/*.md): one function per family, every feature
an argument.

Each function takes torch tensors (or DLPack producers) and runs on their device: the CPU backend for CPU
tensors, the Hopper kernels for CUDA tensors (on the current stream). Outputs are allocated, or written into
the caller's tensors with `out=` (a tuple in the order the function returns its results; a None entry is
allocated), and returned as given. `updated` may be `layer_residual` itself: the in-place prefix update,
bitwise the out-of-place result. `layer_residual` (and the addends, and the [T, H] outputs) may be [T, H] or
[T, 1, H]; outputs are allocated in layer_residual's rank.

An eager call of plain tensors goes straight to the C++ library (one call: validation, plan, launch); under
torch.compile, with tensor subclasses, autograd or a dispatch mode it goes through torch.ops.attnres.*, which
also trace under torch.compile and capture in CUDA graphs.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import Tensor

from . import _C, _attn_ops
from . import fp8 as _fp8
from ._attn_ops import FAMILIES, allocate, call, rows_past_storage
from ._registry import bump_versions, note_writes
from ._tensors import as_tensor
from .errors import ArgumentError
from .options import DEFAULT, Options

_DEFAULT_C = DEFAULT.to_c()
_is_compiling = torch.compiler.is_compiling
_empty_like = torch.empty_like
_empty = torch.empty
_E4M3 = torch.float8_e4m3fn
_FP8_MODES = frozenset(_fp8.MODES)
_call = _C.attn_res_call
_OP = _C.AttnResOp
_NOT_SNAPSHOT = _C.NOT_SNAPSHOT
# The op codes of the fast paths, looked up once.
_ATTN_RES, _RMSNORM, _ADD_RMSNORM = _OP.attn_res, _OP.attn_res_rmsnorm, _OP.attn_res_add_rmsnorm


@functools.lru_cache(maxsize=64)
def _c_options(options: Options):
    return options.to_c()


def _options(op: str, options) -> Options:
    if options is None:
        return DEFAULT
    # Benchmark-only option sets (attnres._stream_tuning, attnres._persistent_tuning) bring their own to_c().
    if not isinstance(options, Options) and not hasattr(options, "to_c"):
        raise ArgumentError(f"{op}: options must be an attnres.Options, got {type(options).__name__}")
    return options


def _c(opts):
    if opts is DEFAULT:
        return _DEFAULT_C
    return _c_options(opts) if isinstance(opts, Options) else opts.to_c()


def _slot(op: str, snapshot_slot) -> int:
    try:
        slot = operator.index(snapshot_slot)
    except TypeError:
        raise ArgumentError(f"{op}: snapshot_slot must be None or an int row index >= K, got {snapshot_slot!r}") \
            from None
    if slot < 0:
        raise ArgumentError(f"{op}: snapshot_slot must be None or a row index >= K, got {slot}")
    return slot


def _bank_through_slot(block: Tensor, slot: int, op: str) -> Tensor:
    """The bank as a [max(K, slot + 1), T, H] view of block_residual's storage, so the snapshot row (outside the
    [K, T, H] candidate view) is addressed through the same strides, after checking that the row lies inside
    the storage (the library sees only pointers)."""
    if block.dim() != 3 or min(block.stride(), default=0) < 0:
        return block  # the library rejects the rank or the strides
    K, T, H = block.shape
    rows = max(K, slot + 1)
    if not _is_compiling():
        check_bank_in_storage(block, rows, op)
    return block.as_strided((rows, T, H), block.stride())


def check_bank_in_storage(bank: Tensor, rows: int, op: str) -> None:
    """Refuses a snapshot row that lies past the bank's storage."""
    if rows_past_storage(bank, rows):
        raise ArgumentError(f"{op}: snapshot_slot {rows - 1} lies outside block_residual's storage "
                            f"(the bank must be allocated with at least {rows} snapshot rows)")


def given_outputs(op: str, out, produced: tuple[str, ...]) -> dict:
    """The caller's out= tensors by output name (None entries are allocated), screened as inputs are; every op's
    public function reads out= through this."""
    if out is None:
        return {}
    if isinstance(out, Tensor) and len(produced) == 1:
        out = (out,)
    if not isinstance(out, (tuple, list)) or len(out) != len(produced):
        got = type(out).__name__ + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise ArgumentError(f"{op}: out must be a tuple of {len(produced)} tensors or None ({', '.join(produced)}), "
                            f"got {got}")
    return {name: as_tensor(t, op, f"out ({name})") for name, t in zip(produced, out) if t is not None}


def _run(family_name: str, v: dict, snapshot_slot, out, options, produced: tuple[str, ...]):
    """Runs one family's call: `v` holds its arguments by schema name, `produced` the outputs it returns."""
    family = FAMILIES[family_name]
    op = family.name
    opts = _options(op, options)
    _attn_ops.check_fp8_only(op, v, {})
    given = given_outputs(op, out, produced)
    snapshot = snapshot_slot is not None
    if snapshot:
        slot = _slot(op, snapshot_slot)
        block = as_tensor(v.pop("block_residual"), op, "block_residual")
        K = block.shape[0] if block.dim() == 3 else 0
        v["bank"] = _bank_through_slot(block, slot, op)
        v["num_snapshots"], v["snapshot_slot"] = K, slot
    else:
        block = v["block_residual"]
        K = block.shape[0] if isinstance(block, Tensor) and block.dim() == 3 else 0
    lr = v["layer_residual"]
    if not isinstance(lr, Tensor):
        v["layer_residual"] = lr = as_tensor(lr, op, "layer_residual")
    outs = allocate(family, v, K, skip=given)
    outs.update(given)
    if not _is_compiling():
        v["_options"] = _c(opts)
        if call(family, v, outs, snapshot, direct=True):
            note_writes(*given.values())
            if snapshot:
                note_writes(v["bank"])
            return _result(outs, produced)
        del v["_options"]
    return _through_torch_ops(family, v, outs, given, opts, snapshot, produced)


def _through_torch_ops(family, v: dict, outs: dict, given: dict, opts: Options, snapshot: bool, produced):
    op = family.name
    for key, value in list(v.items()):
        if key not in ("fp8",) and value is not None and not isinstance(value, (Tensor, int, float, bool)):
            v[key] = as_tensor(value, op, key)
    v.update(zip(_attn_ops.OPTION_NAMES, opts.as_args()))
    base = getattr(torch.ops.attnres, op + ("_snapshot" if snapshot else ""))
    if v.get("fp8") is None and "fp8" in v:
        v["fp8"] = "none"
    if given:
        base.out(**v, **{k: outs.get(k) for k in family.outputs})
        return _result(outs, produced)
    results = dict(zip(family.outputs, base(**v)))
    return _result(results, produced)


def _given_pair(out, two: bool):
    """The fast path's (first, second) out= tensors: (None, None) without out=; None when out= is anything but a
    tuple of the two outputs (or of the one, when `two` is False) as plain tensors or None (the generic path then
    judges it)."""
    if out is None:
        return (None, None)
    if type(out) is not tuple or len(out) != (2 if two else 1):
        return None
    pair = out if two else (None, out[0])
    for t in pair:
        if t is not None and type(t) is not Tensor:
            return None
    return pair


def _result(outs: dict, produced: tuple[str, ...]):
    return outs[produced[0]] if len(produced) == 1 else tuple(outs[k] for k in produced)


def attn_res(layer_residual, block_residual, res_weight, rms_weight, rms_eps: float, *, layer_residual_add=None,
             layer_residual_add2=None, diagnostics: bool = True, snapshot_slot: int | None = None, out=None,
             options: Options | None = None):
    """The AttnRes mixture of the candidates (the bank rows, then the prefix), no norm (docs/ops/attn_res.md).

    Returns ([updated,] mixture[, rsigma, probs, logits]): with layer_residual_add (and layer_residual_add2)
    the prefix is first updated, updated = prefix + (add + add2) bit for bit as PyTorch computes it, and the
    mixture is taken over the updated prefix; with diagnostics (default) the fp32 [N, T] rsigma, probs and
    logits the mixture used. With snapshot_slot, the (updated) prefix is also written into bank row
    snapshot_slot (>= K) of block_residual's storage. A single result is returned as a tensor."""
    if snapshot_slot is None and options is None and not diagnostics and type(layer_residual) is Tensor and \
            not _is_compiling():
        # The engines' call (no diagnostics): straight to the library. False: it needs torch's dispatcher,
        # handled below.
        given = _given_pair(out, layer_residual_add is not None)
        if given is not None:
            updated, mixture = given
            if mixture is None:
                mixture = _empty_like(layer_residual)
            if updated is None and layer_residual_add is not None:
                updated = _empty_like(layer_residual)
            if _call(_ATTN_RES, (layer_residual, layer_residual_add, layer_residual_add2, block_residual,
                                 res_weight, rms_weight, None, mixture, updated, None, None, None, None, None, None),
                     rms_eps, 1e-5, -1, _NOT_SNAPSHOT, None, False, _DEFAULT_C, True):
                if out is not None:
                    bump_versions((mixture,) if updated is None else (updated, mixture))
                return mixture if updated is None else (updated, mixture)
    produced = (("updated",) if layer_residual_add is not None else ()) + ("output",) + \
        (("rsigma", "probs", "logits") if diagnostics else ())
    v = {"layer_residual": layer_residual, "block_residual": block_residual, "res_weight": res_weight,
         "rms_weight": rms_weight, "rms_eps": rms_eps, "layer_residual_add": layer_residual_add,
         "layer_residual_add2": layer_residual_add2, "diagnostics": bool(diagnostics)}
    return _run("attn_res", v, snapshot_slot, out, options, produced)


def _fp8_outputs(fp8) -> tuple[str, ...]:
    return () if fp8 is None or fp8 == "none" else ("output_fp8", "fp8_scales")


def _normed(fp8_only) -> tuple[str, ...]:
    return () if fp8_only else ("output",)


def _fp8_direct(op, inputs: tuple, lr: Tensor, updated: bool, rms_eps, norm_eps, fp8: str, pow2, fp8_only):
    """The eager FP8 call of plain tensors without out=, a tap, a snapshot or options, straight to the library
    (the same allocations and call as the generic path); None when it needs torch's dispatcher or the generic
    path's judgement (a prefix that is not [T, H] or [T, 1, H])."""
    shape = lr.shape
    if len(shape) not in (2, 3):
        return None
    output = None if fp8_only else _empty_like(lr)
    upd = _empty_like(lr) if updated else None
    codes = _empty(shape, dtype=_E4M3, device=lr.device)
    scales = _fp8.empty_scales(fp8, shape[0], shape[-1], lr.device)
    if not _call(op, (*inputs, output, upd, None, None, None, None, codes, scales), rms_eps, norm_eps, -1,
                 _NOT_SNAPSHOT, fp8, bool(pow2), _DEFAULT_C, True):
        return None
    result = (codes, scales) if fp8_only else (output, codes, scales)
    return (upd, *result) if updated else result


def attn_res_rmsnorm(layer_residual, block_residual, res_weight, rms_weight, norm_weight, rms_eps: float,
                     norm_eps: float, *, return_mixture: bool = False, snapshot_slot: int | None = None,
                     fp8: str | None = None, fp8_pow2_scales: bool = False, fp8_only: bool = False, out=None,
                     options: Options | None = None):
    """output [T, H] = RMSNorm(mixture) (docs/ops/attn_res_rmsnorm.md); with return_mixture, (output, mixture).
    With fp8 ("per_token" or "block128") the result gains (output_fp8, fp8_scales): output quantized to e4m3;
    with fp8_only as well, output itself is neither written nor returned.
    With snapshot_slot, layer_residual is also written into bank row snapshot_slot (>= K)."""
    if out is None and snapshot_slot is None and options is None and fp8 is None and not return_mixture and \
            not fp8_only and type(layer_residual) is Tensor and not _is_compiling():
        output = _empty_like(layer_residual)
        if _call(_RMSNORM, (layer_residual, None, None, block_residual, res_weight, rms_weight, norm_weight,
                            output, None, None, None, None, None, None, None),
                 rms_eps, norm_eps, -1, _NOT_SNAPSHOT, None, bool(fp8_pow2_scales), _DEFAULT_C, True):
            return output
    elif out is None and snapshot_slot is None and options is None and not return_mixture and type(fp8) is str \
            and fp8 in _FP8_MODES and type(layer_residual) is Tensor and not _is_compiling():
        r = _fp8_direct(_RMSNORM, (layer_residual, None, None, block_residual, res_weight, rms_weight, norm_weight),
                        layer_residual, False, rms_eps, norm_eps, fp8, fp8_pow2_scales, fp8_only)
        if r is not None:
            return r
    produced = _normed(fp8_only) + (("mixture",) if return_mixture else ()) + _fp8_outputs(fp8)
    v = {"layer_residual": layer_residual, "block_residual": block_residual, "res_weight": res_weight,
         "rms_weight": rms_weight, "norm_weight": norm_weight, "rms_eps": rms_eps, "norm_eps": norm_eps,
         "return_mixture": bool(return_mixture), "fp8": fp8, "fp8_pow2_scales": fp8_pow2_scales,
         "fp8_only": bool(fp8_only)}
    return _run("attn_res_rmsnorm", v, snapshot_slot, out, options, produced)


def attn_res_add_rmsnorm(layer_residual, layer_residual_add, block_residual, res_weight, rms_weight, norm_weight,
                         rms_eps: float, norm_eps: float, *, layer_residual_add2=None, return_mixture: bool = False,
                         snapshot_slot: int | None = None, fp8: str | None = None, fp8_pow2_scales: bool = False,
                         fp8_only: bool = False, out=None, options: Options | None = None):
    """(updated, output[, mixture][, output_fp8, fp8_scales]) (docs/ops/attn_res_add_rmsnorm.md): updated =
    prefix + (add + add2) exactly as PyTorch's `prefix + (add + add2)` on bf16; output = RMSNorm(AttnRes(bank,
    updated)). With fp8 and fp8_only, output is neither written nor returned (the codes and scales are).
    With snapshot_slot, updated is also written into bank row snapshot_slot (>= K) of
    block_residual's storage. out=(layer_residual, None) updates the prefix in place."""
    if snapshot_slot is None and options is None and fp8 is None and not return_mixture and not fp8_only and \
            type(layer_residual) is Tensor and not _is_compiling():
        given = (None, None) if out is None else _given_pair(out, True)
        if given is not None:
            updated, output = given
            if updated is None:
                updated = _empty_like(layer_residual)
            if output is None:
                output = _empty_like(layer_residual)
            if _call(_ADD_RMSNORM, (layer_residual, layer_residual_add, layer_residual_add2, block_residual,
                                    res_weight, rms_weight, norm_weight, output, updated, None, None, None, None,
                                    None, None),
                     rms_eps, norm_eps, -1, _NOT_SNAPSHOT, None, bool(fp8_pow2_scales), _DEFAULT_C, True):
                if out is not None:
                    bump_versions((updated, output))
                return updated, output
    elif out is None and snapshot_slot is None and options is None and not return_mixture and type(fp8) is str \
            and fp8 in _FP8_MODES and type(layer_residual) is Tensor and not _is_compiling():
        r = _fp8_direct(_ADD_RMSNORM, (layer_residual, layer_residual_add, layer_residual_add2, block_residual,
                                       res_weight, rms_weight, norm_weight),
                        layer_residual, True, rms_eps, norm_eps, fp8, fp8_pow2_scales, fp8_only)
        if r is not None:
            return r
    produced = ("updated",) + _normed(fp8_only) + (("mixture",) if return_mixture else ()) + _fp8_outputs(fp8)
    v = {"layer_residual": layer_residual, "layer_residual_add": layer_residual_add,
         "layer_residual_add2": layer_residual_add2, "block_residual": block_residual, "res_weight": res_weight,
         "rms_weight": rms_weight, "norm_weight": norm_weight, "rms_eps": rms_eps, "norm_eps": norm_eps,
         "return_mixture": bool(return_mixture), "fp8": fp8, "fp8_pow2_scales": fp8_pow2_scales,
         "fp8_only": bool(fp8_only)}
    return _run("attn_res_add_rmsnorm", v, snapshot_slot, out, options, produced)


_PERSISTENT = Options(topology="persistent")


def attn_res_add_rmsnorm_persistent(layer_residual, block_residual, res_weight, rms_weight, norm_weight,
                                    rms_eps: float, norm_eps: float, *, layer_residual_add=None,
                                    fp8: str | None = None, fp8_pow2_scales: bool = False, fp8_only: bool = False,
                                    options: Options | None = None):
    """Alias: attn_res_add_rmsnorm (attn_res_rmsnorm without an addend) with Options(topology="persistent").
    Returns (updated or None, output[, output_fp8, fp8_scales]); with fp8_only, (updated or None, output_fp8,
    fp8_scales)."""
    opts = options or _PERSISTENT
    kw = {"fp8": fp8, "fp8_pow2_scales": fp8_pow2_scales, "fp8_only": fp8_only, "options": opts}
    if layer_residual_add is None:
        r = attn_res_rmsnorm(layer_residual, block_residual, res_weight, rms_weight, norm_weight, rms_eps, norm_eps,
                             **kw)
        return (None,) + (r if isinstance(r, tuple) else (r,))
    return attn_res_add_rmsnorm(layer_residual, layer_residual_add, block_residual, res_weight, rms_weight,
                                norm_weight, rms_eps, norm_eps, **kw)
