"""Rejection tests for the precondition messages tools/precondition_table.py found without a test (docs/reliability.md
section 1): each provokes the message on the CPU, checks it in full, and checks that nothing was written. (These
belong next to their siblings in tests/test_moe_finalize.py and tests/test_rejections.py; they live here until
those files are next edited.)"""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres import _C, moe
from attnres._tensors import ref
from helpers import assert_same_bits

BF16 = torch.bfloat16
NAN = float("nan")
T, K_ROUTES, D, R = 3, 4, 64, 20


def _moe_inputs(seed: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    index = torch.randperm(R, generator=g)[:T * K_ROUTES].to(torch.int32).reshape(T, K_ROUTES)
    return {"rows": torch.randn(R, D, generator=g).to(BF16), "weights": torch.rand(T, K_ROUTES, generator=g),
            "index": index, "shared": torch.randn(T, D, generator=g).to(BF16),
            "norm_weight": (1 + 0.1 * torch.randn(D, generator=g)).to(BF16)}


class Unchanged:
    """Every tensor handed to the rejected call keeps its bits."""

    def __init__(self, *tensors):
        self.tensors = [t for t in tensors if isinstance(t, torch.Tensor)]

    def __enter__(self):
        self.before = [t.clone() for t in self.tensors]
        return self

    def __exit__(self, *exc):
        for i, (t, old) in enumerate(zip(self.tensors, self.before)):
            assert_same_bits(t, old, f"tensor #{i} after a rejected call")
        return False


def _raises(exc, message: str):
    class Check:
        def __enter__(self):
            self.ctx = pytest.raises(exc)
            self.info = self.ctx.__enter__()
            return self

        def __exit__(self, *e):
            handled = self.ctx.__exit__(*e)
            assert str(self.info.value).startswith(message), str(self.info.value)
            return handled

    return Check()


def test_moe_finalize_unknown_kernel():
    a = _moe_inputs()
    with Unchanged(*a.values()), _raises(ValueError, "moe_finalize: kernel must be one of ('auto', 'cpu', "
                                         "'single_cta'), got 'fast'"):
        attnres.moe_finalize(a["rows"], a["weights"], a["index"], eps=1e-5, kernel="fast")


@pytest.mark.parametrize("arg,message", [("weights", "moe_finalize: weights has a null data pointer"),
                                         ("index", "moe_finalize: index has a null data pointer")])
def test_moe_finalize_null_weights_or_index(arg, message):
    """The null check of the dense [T, k] maps (a C++ caller's TensorRef with data == nullptr)."""
    a = _moe_inputs()
    out = torch.full((T, D), NAN, dtype=BF16)
    args = _C.MoeFinalizeArgs()
    args.rows = ref(a["rows"], "moe_finalize", "rows")
    args.weights = ref(a["weights"], "moe_finalize", "weights")
    args.index = ref(a["index"], "moe_finalize", "index")
    args.output = ref(out, "moe_finalize", "output")
    dtype = _C.DType.f32 if arg == "weights" else _C.DType.i32
    setattr(args, arg, _C.TensorRef(0, dtype, _C.DeviceType.cpu, 0, [T, K_ROUTES], [K_ROUTES, 1]))
    args.eps, args.scale = 1e-5, 1.0
    with Unchanged(out, *a.values()), _raises(attnres.ArgumentError, message):
        _C.moe_finalize(args, _C.MoeFinalizeOptions())


def test_finalize_helper_no_routes():
    a = _moe_inputs()
    with Unchanged(*a.values()), _raises(attnres.ArgumentError, "moe_finalize: index holds k = 0 routes per token: "
                                         "k must be >= 1 (the fused op: in [1, 32])"):
        moe.finalize_moe_output(a["rows"], a["weights"][:, :0], a["index"][:, :0], eps=1e-5)


def test_finalize_helper_integer_rows():
    a = _moe_inputs()
    rows = a["rows"].to(torch.int16)
    with Unchanged(rows, *a.values()), _raises(attnres.ArgumentError, "moe_finalize: rows must hold D >= 1 "
                                               f"floating-point columns, got int16 [{R}, {D}]"):
        moe.finalize_moe_output(rows, a["weights"], a["index"], eps=1e-5)


@pytest.mark.parametrize("arg,message", [
    ("shared", "moe_finalize: shared must be bfloat16 (the dtype of rows), got float32"),
    ("norm_weight", "moe_finalize: norm_weight must be bfloat16 (the dtype of rows), got float32")])
def test_finalize_helper_dtype_other_than_rows(arg, message):
    a = _moe_inputs()
    kw = {"shared": a["shared"], "norm_weight": a["norm_weight"], arg: a[arg].float()}
    with Unchanged(kw[arg], *a.values()), _raises(attnres.ArgumentError, message):
        moe.finalize_moe_output(a["rows"], a["weights"], a["index"], eps=1e-5, **kw)


def test_rank_five_tensor_message_in_full():
    g = torch.Generator().manual_seed(1)
    prefix = torch.randn(2, 1, 1, 1, 64, generator=g).to(BF16)
    bank = torch.randn(1, 2, 64, generator=g).to(BF16)
    w = torch.ones(64, dtype=BF16)
    with Unchanged(prefix, bank, w), _raises(attnres.ArgumentError, "attn_res_rmsnorm: layer_residual has rank 5: "
                                             "the library takes tensors of rank <= 4"):
        attnres.attn_res_rmsnorm(prefix, bank, w, w, w, 1e-5, 1e-5)
