"""torch.ops.attnres.{attn_res, attn_res_rmsnorm, attn_res_add_rmsnorm}: one op per family, every feature an
argument, so they run eagerly, under CUDA-graph capture and inside torch.compile graphs.

Each family has four registrations built from one description:

    <family>(...) -> (outputs)                 allocates its outputs (absent ones are empty (0,) tensors)
    <family>.out(..., *, <outputs>) -> ()      writes into the caller's tensors (None: not produced)
    <family>_snapshot(..., Tensor(a!) bank, int num_snapshots, int snapshot_slot, ...) -> (outputs)
    <family>_snapshot.out(...)                 the bank-writing variants (the schema declares the bank mutated)

The real kernels hand the tensors to the C++ library in one call (attnres._C.attn_res_call: validation, plan,
launch on the current stream); the fake kernels run the same C++ validation on the fake tensors' shapes,
dtypes and layouts (attnres._C.attn_res_check), so a malformed call raises the same ArgumentError while
tracing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from . import _C
from . import fp8 as _fp8
from ._registry import define, note_writes
from ._tensors import _hint, fake_refs
from .errors import ArgumentError
from .options import DEFAULT, Options

# The 15 tensor slots of attnres._C.attn_res_call, in its order.
SLOTS = ("layer_residual", "layer_residual_add", "layer_residual_add2", "block_residual", "res_weight",
         "rms_weight", "norm_weight", "output", "updated", "mixture", "rsigma", "probs", "logits", "output_fp8",
         "fp8_scales")
# [T, H] arguments that may also come as [T, 1, H].
ROWS = frozenset(("layer_residual", "layer_residual_add", "layer_residual_add2", "output", "updated", "mixture",
                  "output_fp8"))
OPTION_NAMES = ("topology", "split_max_tokens", "pdl", "force_kernel", "cluster")
_OPTIONS_SCHEMA = (f'str topology="auto", int split_max_tokens={DEFAULT.split_max_tokens}, bool pdl=True, '
                   'str force_kernel="auto", int cluster=0')


@dataclass(frozen=True)
class Family:
    name: str
    op: _C.AttnResOp
    inputs: tuple[str, ...]  # schema entries; "{bank}" marks the bank argument
    features: tuple[str, ...]
    outputs: tuple[str, ...]
    later: tuple[str, ...] = ()  # features added after the options (positional calls of the older schema stay valid)

    def schema(self, snapshot: bool, out: bool) -> str:
        bank = ("Tensor(z!) bank, int num_snapshots, int snapshot_slot" if snapshot else "Tensor block_residual")
        args = [a.replace("{bank}", bank) for a in self.inputs] + list(self.features) + [_OPTIONS_SCHEMA] + \
            list(self.later)
        if out:
            letters = "abcdefgh"
            args.append("*, " + ", ".join(f"Tensor({letters[i]}!)? {o}=None" for i, o in enumerate(self.outputs)))
            return f"({', '.join(args)}) -> ()"
        return f"({', '.join(args)}) -> ({', '.join('Tensor ' + o for o in self.outputs)})"


_FP8_FEATURES = ('str fp8="none"', "bool fp8_pow2_scales=False")
_FP8_ONLY = ("bool fp8_only=False",)
FAMILIES = {
    f.name: f
    for f in (
        Family("attn_res", _C.AttnResOp.attn_res,
               ("Tensor layer_residual", "{bank}", "Tensor res_weight", "Tensor rms_weight", "float rms_eps"),
               ("Tensor? layer_residual_add=None", "Tensor? layer_residual_add2=None", "bool diagnostics=True"),
               ("updated", "output", "rsigma", "probs", "logits")),
        Family("attn_res_rmsnorm", _C.AttnResOp.attn_res_rmsnorm,
               ("Tensor layer_residual", "{bank}", "Tensor res_weight", "Tensor rms_weight", "Tensor norm_weight",
                "float rms_eps", "float norm_eps"),
               ("bool return_mixture=False", *_FP8_FEATURES),
               ("output", "mixture", "output_fp8", "fp8_scales"), _FP8_ONLY),
        Family("attn_res_add_rmsnorm", _C.AttnResOp.attn_res_add_rmsnorm,
               ("Tensor layer_residual", "Tensor layer_residual_add", "Tensor? layer_residual_add2", "{bank}",
                "Tensor res_weight", "Tensor rms_weight", "Tensor norm_weight", "float rms_eps", "float norm_eps"),
               ("bool return_mixture=False", *_FP8_FEATURES),
               ("updated", "output", "mixture", "output_fp8", "fp8_scales"), _FP8_ONLY),
    )
}


@functools.lru_cache(maxsize=64)
def c_options(topology: str, split_max_tokens: int, pdl: bool, force_kernel: str, cluster: int) -> _C.Options:
    """The library's Options for the schemas' option arguments (validated by attnres.Options)."""
    return Options(topology, split_max_tokens, pdl, force_kernel, cluster).to_c()


def _arg_names(schema: str) -> tuple[str, ...]:
    inner = schema[1:schema.index(") ->")]
    names = []
    for entry in inner.split(", "):
        entry = entry.strip()
        if entry == "*" or entry.startswith("*,"):
            entry = entry[2:].strip()
            if not entry:
                continue
        names.append(entry.split("=")[0].split()[-1])
    return tuple(names)


def _empty(like: Tensor) -> Tensor:
    return torch.empty((0,), dtype=torch.bfloat16, device=like.device)


def _rows(t: Tensor) -> int:
    return t.shape[0] if t.dim() >= 1 else 0


def allocate(family: Family, v: dict, K: int, skip=()) -> dict:
    """The outputs a call with arguments `v` produces (K: its candidate rows), allocated except those in
    `skip`: bf16 rows shaped like layer_residual, fp32 [N, T] diagnostics, the FP8 codes and scales; None for
    what the call does not produce."""
    lr = v["layer_residual"]
    rows = lambda: torch.empty(lr.shape, dtype=torch.bfloat16, device=lr.device)  # noqa: E731
    outs = dict.fromkeys(family.outputs)
    if "output" not in skip and not v.get("fp8_only"):
        outs["output"] = rows()
    if "updated" in outs and "updated" not in skip and v.get("layer_residual_add") is not None:
        outs["updated"] = rows()
    if v.get("return_mixture") and "mixture" not in skip:
        outs["mixture"] = rows()
    if family.name == "attn_res" and v.get("diagnostics", True):
        T, N = _rows(lr), max(K + 1, 0)
        for key in ("rsigma", "probs", "logits"):
            if key not in skip:
                outs[key] = torch.empty((N, T), dtype=torch.float32, device=lr.device)
    mode = v.get("fp8")
    if mode in ("per_token", "block128"):
        T, H = (lr.shape[0], lr.shape[-1]) if lr.dim() >= 2 else (0, 0)
        if "output_fp8" not in skip:
            outs["output_fp8"] = torch.empty(lr.shape, dtype=torch.float8_e4m3fn, device=lr.device)
        if "fp8_scales" not in skip:
            outs["fp8_scales"] = _fp8.empty_scales(mode, T, H, lr.device)
    return outs


def check_fp8_only(op: str, v: dict, outs: dict) -> None:
    """fp8_only (the FP8-only call: codes and scales, no bf16 output) needs an FP8 mode and takes no output
    tensor. Without fp8_only the library requires the output, except in `.out` calls that leave it None with
    an FP8 mode: the same FP8-only call."""
    if not v.get("fp8_only"):
        return
    if v.get("fp8") in (None, "none"):
        raise ArgumentError(f"{op}: fp8_only requires fp8 = 'per_token' or 'block128'")
    if outs.get("output") is not None:
        raise ArgumentError(f"{op}: fp8_only takes no output tensor (it writes no bf16 output)")


def call(family: Family, v: dict, outs: dict, snapshot: bool, direct: bool) -> bool:
    """One call of the library on arguments `v` and outputs `outs` (both by schema name). With `direct`, returns
    False without running when the call needs torch's dispatcher (see attnres._C.attn_res_call)."""
    check_fp8_only(family.name, v, outs)
    tensors = tuple(outs.get(s) if s in outs else v.get(s) for s in SLOTS)
    if snapshot:
        tensors = tensors[:3] + (v["bank"],) + tensors[4:]
        K, slot = v["num_snapshots"], v["snapshot_slot"]
    else:
        K, slot = _C.NOT_SNAPSHOT, -1
    options = v.get("_options") or c_options(*(v.get(k, d) for k, d in zip(OPTION_NAMES, _OPTION_DEFAULTS)))
    return _C.attn_res_call(family.op, tensors, float(v["rms_eps"]), float(v.get("norm_eps", 1e-5)), slot, K,
                            v.get("fp8"), bool(v.get("fp8_pow2_scales", False)), options, direct)


_OPTION_DEFAULTS = ("auto", DEFAULT.split_max_tokens, True, "auto", 0)


def _candidates(v: dict, snapshot: bool) -> int:
    if snapshot:
        return int(v["num_snapshots"])
    block = v["block_residual"]
    return block.shape[0] if block.dim() == 3 else 0


def _real(family: Family, names: tuple[str, ...], snapshot: bool, out: bool):
    def kernel(*args, **kwargs):
        v = dict(zip(names, args))
        v.update(kwargs)
        if snapshot:
            check_bank_storage(family.name, v["bank"], v["num_snapshots"], v["snapshot_slot"])
        if out:
            outs = {o: v.get(o) for o in family.outputs}
        else:
            outs = allocate(family, v, _candidates(v, snapshot))
        call(family, v, outs, snapshot, direct=False)
        if snapshot:
            note_writes(v["bank"])
        if out:
            note_writes(*(t for t in outs.values() if t is not None))
            return None
        lr = v["layer_residual"]
        return tuple(_empty(lr) if outs[o] is None else outs[o] for o in family.outputs)

    return kernel


def rows_past_storage(bank: Tensor, rows: int) -> bool:
    """Whether the first `rows` rows of a [*, T, H] bank, through its strides, reach past its storage (the
    library sees only pointers, so the bound is checked here)."""
    _, T, H = bank.shape
    s = bank.stride()
    last = bank.storage_offset() + (rows - 1) * s[0] + (T - 1) * s[1] + (H - 1) * s[2]
    return (last + 1) * bank.element_size() > bank.untyped_storage().nbytes()


def check_bank_storage(op: str, bank: Tensor, num_snapshots: int, snapshot_slot: int) -> None:
    """A bank view built past its storage (as_strided is not bounds-checked under torch.compile) is refused
    before the library sees its pointers."""
    if bank.dim() != 3 or min(bank.stride(), default=0) < 0 or bank.numel() == 0:
        return  # the library rejects the rank or the strides; an empty bank addresses nothing
    if rows_past_storage(bank, bank.shape[0]):
        raise ArgumentError(f"{op}: the bank's {bank.shape[0]} rows lie outside its storage")


def fake_check(op: str, op_code, num_snapshots, snapshot_slot, rms_eps, norm_eps=1e-5, fp8=None,
               fp8_pow2_scales=False, **tensors) -> None:
    """The library's validation of a traced call: TensorRefs of the fake tensors (synthetic addresses, nothing
    is read), the bank's rows rule, then the op's preconditions (absent outputs allowed). Sizes without an
    example value are not judged."""
    refs = fake_refs(op, tensors)
    K, slot = _hint(num_snapshots), _hint(snapshot_slot)
    if refs is None or K is None or slot is None:
        return
    a = _C.AttnResArgs()
    for key, r in refs.items():
        setattr(a, key, r)
    a.rms_eps, a.norm_eps = float(rms_eps), float(norm_eps)
    a.snapshot_slot = slot
    a.fp8_pow2_scales = bool(fp8_pow2_scales)
    _C.attn_res_check(op_code, a, K, fp8)


def _squeezed(t):
    return t.squeeze(1) if (t is not None and t.dim() == 3 and t.shape[1] == 1) else t


def _fake(family: Family, names: tuple[str, ...], snapshot: bool, out: bool):
    def kernel(*args, **kwargs):
        v = dict(zip(names, args))
        v.update(kwargs)
        tensors = {s: (_squeezed(v.get(s)) if s in ROWS else v.get(s)) for s in SLOTS if s != "block_residual"}
        tensors["block_residual"] = v["bank"] if snapshot else v["block_residual"]
        if not out:
            for o in family.outputs:
                tensors[o] = None
        check_fp8_only(family.name, v, tensors)
        fake_check(family.name, family.op, v["num_snapshots"] if snapshot else _C.NOT_SNAPSHOT,
                   v["snapshot_slot"] if snapshot else -1, v["rms_eps"], v.get("norm_eps", 1e-5), v.get("fp8"),
                   v.get("fp8_pow2_scales", False), **{k: t for k, t in tensors.items()})
        c_options(*(v.get(k, d) for k, d in zip(OPTION_NAMES, _OPTION_DEFAULTS)))
        if out:
            return None
        lr = v["layer_residual"]
        outs = _fake_outputs(family, v, _candidates(v, snapshot))
        return tuple(outs[o] if outs[o] is not None else lr.new_empty((0,), dtype=torch.bfloat16)
                     for o in family.outputs)

    return kernel


def _fake_outputs(family: Family, v: dict, K) -> dict:
    """allocate()'s outputs as fake tensors (new_empty on the fake layer_residual)."""
    lr = v["layer_residual"]
    outs = dict.fromkeys(family.outputs)
    if not v.get("fp8_only"):
        outs["output"] = lr.new_empty(lr.shape, dtype=torch.bfloat16)
    if "updated" in outs and v.get("layer_residual_add") is not None:
        outs["updated"] = lr.new_empty(lr.shape, dtype=torch.bfloat16)
    if v.get("return_mixture"):
        outs["mixture"] = lr.new_empty(lr.shape, dtype=torch.bfloat16)
    if family.name == "attn_res" and v.get("diagnostics", True):
        for key in ("rsigma", "probs", "logits"):
            outs[key] = lr.new_empty((K + 1, lr.shape[0]), dtype=torch.float32)
    mode = v.get("fp8")
    if mode in ("per_token", "block128"):
        T, H = lr.shape[0], lr.shape[-1]
        outs["output_fp8"] = lr.new_empty(lr.shape, dtype=torch.float8_e4m3fn)
        if mode == "per_token":
            outs["fp8_scales"] = lr.new_empty((T, 1), dtype=torch.float32)
        else:
            outs["fp8_scales"] = lr.new_empty_strided((T, H // 128), (1, (T + 3) // 4 * 4), dtype=torch.float32)
    return outs


def _register() -> None:
    for family in FAMILIES.values():
        for snapshot in (False, True):
            for out in (False, True):
                base = family.name + ("_snapshot" if snapshot else "")
                schema = family.schema(snapshot, out)
                names = _arg_names(schema)
                define(base + (".out" if out else ""), schema, _real(family, names, snapshot, out),
                       _fake(family, names, snapshot, out), mutates=snapshot or out, public_name=family.name)


_register()
