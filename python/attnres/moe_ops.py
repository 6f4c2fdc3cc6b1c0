"""moe_finalize (docs/ops/moe_finalize.md): the fused MoE finalize epilogue as torch.ops.attnres.moe_finalize
and its public wrapper. Strict: every contract violation raises (the C++ validator states each rule)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C
from ._registry import define, note_writes
from ._tensors import as_tensor, fake_refs, ref, stream_of

OP = "moe_finalize"
KERNELS = ("auto", "cpu", "single_cta")


def _argument_error(arg: str, rule: str) -> _C.ArgumentError:
    return _C.ArgumentError(f"{OP}: {arg} {rule}")


def _options(pdl: bool, kernel: str) -> _C.MoeFinalizeOptions:
    if kernel not in KERNELS:
        raise ValueError(f"{OP}: kernel must be one of {KERNELS}, got {kernel!r}")
    o = _C.MoeFinalizeOptions()
    o.pdl = bool(pdl)
    o.kernel = getattr(_C.KernelKind, kernel)
    return o


# ---------------------------------------------------------------------------------------- the custom ops
# attnres::moe_finalize allocates its output; attnres::moe_finalize.out writes the caller's (PyTorch's out=
# convention: the output is a keyword-only mutated argument, nothing is returned).
_INPUTS = ("Tensor rows, Tensor weights, Tensor index, Tensor? shared, Tensor? norm_weight, float eps, float scale, "
           'bool pdl=True, str force_kernel="auto"')
_NAMES = ("rows", "weights", "index", "shared", "norm_weight", "eps", "scale", "pdl", "force_kernel")


def _output_shape(rows: Tensor, index: Tensor) -> tuple[int, int]:
    return (index.shape[0] if index.dim() == 2 else 0, rows.shape[1] if rows.dim() == 2 else 0)


def _arguments(args, kwargs) -> dict:
    v = dict(zip(_NAMES, args))
    v.update(kwargs)
    v.setdefault("pdl", True)
    v.setdefault("force_kernel", "auto")
    return v


def _run(v: dict, output: Tensor) -> None:
    a = _C.MoeFinalizeArgs()
    for key in ("rows", "weights", "index", "shared", "norm_weight"):
        setattr(a, key, ref(v[key], OP, key))
    a.eps = float(v["eps"])
    a.scale = float(v["scale"])
    a.output = ref(output, OP, "output")
    a.stream = stream_of(v["rows"])
    _C.moe_finalize(a, _options(v["pdl"], v["force_kernel"]))


def _real(*args, **kwargs) -> Tensor:
    v = _arguments(args, kwargs)
    output = torch.empty(_output_shape(v["rows"], v["index"]), dtype=torch.bfloat16, device=v["rows"].device)
    _run(v, output)
    return output


def _real_out(*args, **kwargs) -> None:
    v = _arguments(args, kwargs)
    _run(v, v["output"])
    note_writes(v["output"])


def _fake_check(v: dict, output: Tensor | None) -> None:
    """The real op's validation on the fake tensors' shapes, dtypes and layouts (nothing is read)."""
    tensors = {key: v[key] for key in ("rows", "weights", "index", "shared", "norm_weight")}
    if output is not None:
        tensors["output"] = output
    refs = fake_refs(OP, tensors)
    if refs is not None:
        args = _C.MoeFinalizeArgs()
        for key, r in refs.items():
            setattr(args, key, r)
        args.eps, args.scale = float(v["eps"]), float(v["scale"])
        _C.moe_finalize_validate(args, require_output=False, read_data=False)
    _options(v["pdl"], v["force_kernel"])


def _fake(*args, **kwargs) -> Tensor:
    v = _arguments(args, kwargs)
    _fake_check(v, None)
    return v["rows"].new_empty(_output_shape(v["rows"], v["index"]), dtype=torch.bfloat16)


def _fake_out(*args, **kwargs) -> None:
    v = _arguments(args, kwargs)
    _fake_check(v, v["output"])


define("moe_finalize", f"({_INPUTS}) -> Tensor", _real, _fake, mutates=False, public_name=OP)
define("moe_finalize.out", f"({_INPUTS}, *, Tensor(a!) output) -> ()", _real_out, _fake_out, mutates=True,
       public_name=OP)


def moe_finalize_op(*args, **kwargs) -> Tensor:
    """torch.ops.attnres.moe_finalize."""
    return torch.ops.attnres.moe_finalize(*args, **kwargs)


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
                 check_index: bool = False, pdl: bool = True, kernel: str = "auto", out=None) -> Tensor:
    """out [T, D] bf16 = RMSNorm(bf16(scale * sum_j weights[t, j] * rows[index[t, j]]) + shared).

    rows [R, D] bf16 (innermost stride 1, row stride a multiple of 8); weights [T, k] fp32 or bf16 and index
    [T, k] int32, both dense; shared [T, D] bf16 and norm_weight [D] bf16 optional. Runs on the tensors'
    device (CUDA: the current stream). Out-of-range routes raise on the CPU; on CUDA the token's output row
    is NaN unless check_index=True, which scans the index first (synchronizes) and raises the same error.
    With out= (a [T, D] bf16 tensor), the result is written there and `out` is returned."""
    rows = as_tensor(rows, OP, "rows")
    weights = as_tensor(weights, OP, "weights")
    index = as_tensor(index, OP, "index")
    if check_index and index.dim() == 2 and rows.dim() == 2 and not index.is_floating_point():
        check_index_range(index, rows.shape[0])
    args = (rows, weights, index, as_tensor(shared, OP, "shared"), as_tensor(norm_weight, OP, "norm_weight"),
            float(eps), float(scale), bool(pdl), kernel)
    if isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]  # the out= tuple of a single result; (None,) allocates, as out=None does
    if out is None:
        return torch.ops.attnres.moe_finalize(*args)
    out = as_tensor(out, OP, "out")
    torch.ops.attnres.moe_finalize.out(*args, output=out)
    return out
